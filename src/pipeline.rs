//! From a model, devices and a schedule to a running [`Trainer`]: automatic placement with the
//! schedule's simulated in-flight counts, then stages on devices. Shared by the CLI and examples.
//!
//! With tensor parallelism ([`build_trainer_tensor_parallel`]) each stage holds a group of `k`
//! consecutive devices: the planner sees each group as one device `k` times as fast and large,
//! and the model is rebuilt with its wide layers split over the group of the stage they landed on.
//!
//! The planning itself lives in the engine ([`conveyor_engine::placement::pipeline_plan`]), where
//! `TrainerBuilder::placement` uses it; this module re-exports it, builds trainers through the
//! builder, and adds what needs the zoo's [`ModelSpec`]: tensor-parallel planning.
use std::sync::Arc;

use conveyor_engine::collective::{Traffic, TransportGroup};
use conveyor_engine::device::DeviceKind;
use conveyor_engine::graph::Graph;
pub use conveyor_engine::placement::pipeline_plan::{
    CPU_FLOPS_PER_S, PipelineConfig, memory_notes, node_costs, optimizer_memory, plan, plan_by_time, plan_manually,
    planner_inputs, planner_inputs_for, simulated_inflight,
};
use conveyor_engine::placement::{
    DeviceSpec, Link, NodeCosts, OptimizerMemory, Placement, Plan, PlanConfig, measure_node_memory_on_cross_entropy,
    place_manually_with_costs, place_with_costs,
};
use conveyor_engine::runtime::{ReplicaShares, Trainer, TrainerBuilder};
use conveyor_engine::{Device, Error, Result};
use conveyor_layers::{CrossEntropyLoss, RankShard};
use conveyor_schedules::ScheduleKind;

use crate::zoo::{ModelSpec, TensorParallelSplits};

/// A builder for `graph` on `devices` with `config`'s settings and cross-entropy loss.
pub fn builder(graph: Graph, devices: Vec<Device>, config: &PipelineConfig) -> TrainerBuilder {
    Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices(devices)
        .schedule(config.schedule, config.n_chunks)
        .micro_batches(config.n_micro_batches)
        .batch_rows(config.batch_rows)
        .optimizer(config.optimizer)
        .recompute(config.recompute)
        .seed(config.seed)
        .core_slots(config.core_slots)
        .precision(config.precision)
}

/// Plans the graph ([`plan`]) and starts a trainer with that placement: the builder with
/// [`Placement::auto`].
pub fn build_trainer(graph: Graph, devices: Vec<Device>, config: &PipelineConfig) -> Result<(Plan, Trainer)> {
    let trainer = builder(graph, devices, config).placement(Placement::auto()).build()?;
    let plan = trainer.plan().cloned().ok_or_else(|| Error::invalid("placement", "the trainer kept no plan"))?;
    Ok((plan, trainer))
}

/// Starts a trainer for `graph` placed by `plan` (from [`plan`], [`plan_by_time`] or manual
/// placement), with the derived caches and undo snapshots the plan keeps: the builder with
/// [`Placement::Plan`].
pub fn build_trainer_with_plan(
    graph: Graph,
    devices: Vec<Device>,
    plan: &Plan,
    config: &PipelineConfig,
) -> Result<Trainer> {
    builder(graph, devices, config).placement(Placement::Plan(Box::new(plan.clone()))).build()
}

/// [`planner_inputs`] for a pipeline of tensor-parallel groups: `devices` in groups of
/// `tensor_parallel` consecutive devices, each group one planner device ([`DeviceSpec::group`]:
/// `k` times the speed, the sum of the budgets, each shared by the group's chunks).
#[allow(clippy::too_many_arguments)]
pub fn planner_inputs_tensor_parallel(
    devices: &[Device],
    tensor_parallel: usize,
    schedule: ScheduleKind,
    n_chunks: usize,
    n_micro_batches: usize,
    batch_rows: usize,
    optimizer: OptimizerMemory,
) -> Result<(Vec<DeviceSpec>, PlanConfig)> {
    let groups = device_groups(devices, tensor_parallel)?;
    let firsts: Vec<Device> = groups.iter().map(|g| g[0].clone()).collect();
    let (_, mut plan_config) = planner_inputs(&firsts, schedule, n_chunks, n_micro_batches, batch_rows, optimizer)?;
    // Split layers keep no packed weight copies.
    plan_config.count_workspace = tensor_parallel <= 1;
    let specs = (0..groups.len() * n_chunks)
        .map(|s| {
            let members: Vec<DeviceSpec> = groups[schedule.layout().device_of_stage(s, groups.len())]
                .iter()
                .map(|device| DeviceSpec {
                    name: device.to_string(),
                    flops_per_s: CPU_FLOPS_PER_S,
                    budget_bytes: device.memory_budget().map(|b| b / n_chunks as u64),
                    kind: device.kind(),
                })
                .collect();
            DeviceSpec::group(&members)
        })
        .collect();
    Ok((specs, plan_config))
}

/// This rank's shard when the process transport runs a rank per tensor-parallel shard (its world
/// is every device: `stages x tensor_parallel` ranks, rank `group * k + shard` on `devices[rank]`),
/// with the transport group of its stage's ranks; `None` otherwise (in-process, or a rank per
/// pipeline device with its group on threads). Every rank must call it (it creates the groups).
pub fn rank_shard(devices: &[Device], tensor_parallel: usize) -> Result<Option<RankShard>> {
    let transport = conveyor_engine::transport::process_transport();
    let (rank, world) = (transport.rank(), transport.world_size());
    if tensor_parallel <= 1 || world <= 1 || world != devices.len() {
        return Ok(None);
    }
    let groups: Vec<Vec<usize>> =
        (0..world / tensor_parallel).map(|g| (g * tensor_parallel..(g + 1) * tensor_parallel).collect()).collect();
    let device = devices[rank].clone();
    // The group's message buffers count on this rank's device (on the host for a GPU's shard).
    let buffers = if matches!(device, Device::Cpu(_)) { device.clone() } else { Device::host() };
    let comm = TransportGroup::split(transport, buffers, conveyor_engine::collective::DEFAULT_TIMEOUT, &groups)?;
    Ok(Some(RankShard::new(device, comm)))
}

/// `devices` cut into groups of `tensor_parallel` consecutive devices, or an error saying how
/// many devices the degree needs.
pub fn device_groups(devices: &[Device], tensor_parallel: usize) -> Result<Vec<Vec<Device>>> {
    if tensor_parallel == 0 || devices.is_empty() || !devices.len().is_multiple_of(tensor_parallel) {
        return Err(Error::invalid(
            "tensor parallelism",
            format!(
                "{} devices cannot form groups of {tensor_parallel}: give stages x {tensor_parallel} devices",
                devices.len()
            ),
        ));
    }
    Ok(devices.chunks(tensor_parallel).map(<[Device]>::to_vec).collect())
}

/// Plans `spec` over groups of `tensor_parallel` devices and builds its graph with each stage's
/// Linears and Conv2ds split over the stage's group; returns the plan and that graph.
///
/// Two passes. The placement is chosen on the whole model, each group one planner device
/// ([`DeviceSpec::group`]: `k` times as fast, the sum of the budgets). Then the split layers,
/// built on their devices, are run once on each group's ledgers ([`measure_node_memory_on`]:
/// shards, saved copies and collective buffers on every member), and every device of every group
/// is checked against its own budget with those figures; [`Error::DoesNotFit`] when one is over.
/// The plan returned has each stage's memory on its first device in `memory` and on the others in
/// `member_memory`.
pub fn plan_tensor_parallel(
    spec: &ModelSpec,
    seed: u64,
    devices: &[Device],
    tensor_parallel: usize,
    config: &PipelineConfig,
) -> Result<(Plan, Graph)> {
    let groups = device_groups(devices, tensor_parallel)?;
    // The tensor-parallel form unsplit: the nodes the split graph will have.
    let whole = spec.build_split(seed, &TensorParallelSplits::new())?;
    let (specs, mut plan_config) = planner_inputs_tensor_parallel(
        devices,
        tensor_parallel,
        config.schedule,
        config.n_chunks,
        config.n_micro_batches,
        config.batch_rows,
        optimizer_memory(&config.optimizer),
    )?;
    plan_config.recompute = config.recompute;
    plan_config.weight_cache = config.weight_cache;
    let rows = plan_config.micro_batch_rows;
    let placement = place_with_costs(&node_costs(&whole, rows)?, &specs, &plan_config)?;
    drop(whole);
    let group_of_stage = |stage_idx: usize| &groups[config.schedule.layout().device_of_stage(stage_idx, groups.len())];
    let mut splits = TensorParallelSplits::new();
    for stage in &placement.stages {
        for name in &stage.node_names {
            splits.insert(name.clone(), group_of_stage(stage.stage_idx).clone());
        }
    }
    let graph = spec.build_split(seed, &splits)?;
    // The split graph has the whole graph's nodes, so the plan's node ids carry over.
    for stage in &placement.stages {
        for (&id, name) in stage.nodes.iter().zip(&stage.node_names) {
            if graph.node(id)?.name != *name {
                return Err(Error::invalid(
                    "tensor parallelism",
                    format!("node `{name}` moved when its layers were split"),
                ));
            }
        }
    }
    let stage_of = placement.stage_of_nodes();
    // The zoo's models train with softmax cross-entropy: a split head computes it itself.
    let measured = measure_node_memory_on_cross_entropy(&graph, rows, |id| {
        stage_of.iter().find(|(n, _)| *n == id).map(|&(_, s)| group_of_stage(s).clone())
    })?;
    let costs = NodeCosts::of_graph(&graph)?.with_measured_memory(&measured)?;
    // Every device of a group against its own budget (the smallest in the group).
    let n_chunks = config.n_chunks.max(1) as u64;
    let member_specs: Vec<DeviceSpec> = (0..placement.stages.len())
        .map(|s| {
            let group = group_of_stage(s);
            DeviceSpec {
                name: group[0].to_string(),
                flops_per_s: CPU_FLOPS_PER_S * group.len() as f64,
                budget_bytes: group.iter().filter_map(Device::memory_budget).min().map(|b| b / n_chunks),
                kind: group.iter().map(Device::kind).max().unwrap_or(DeviceKind::Cpu),
            }
        })
        .collect();
    // Unsplit Linears of a split stage keep their packed copies; split ones have none.
    plan_config.count_workspace = true;
    let names: Vec<Vec<String>> = placement.stages.iter().map(|s| s.node_names.clone()).collect();
    let plan = place_manually_with_costs(&graph, &costs, &names, &member_specs, &plan_config)?;
    Ok((plan, graph))
}

/// Plans `spec` over groups of `tensor_parallel` devices and starts a trainer whose stages each
/// hold one group: every Linear and Conv2d of a stage is split over the stage's group (Linears
/// column- then row-parallel in turn, convolutions by output channels), so a layer too large for
/// one device's budget fits its group. The graph is built from `seed`; with `tensor_parallel` 1
/// this is [`build_trainer`] on `spec.build(seed)`. See [`plan_tensor_parallel`] for the plan.
///
/// Stages: `devices.len() / tensor_parallel` groups times `config.n_chunks`. Stage `s` runs on
/// the schedule's group of it (`s % n_groups` looped, or in a V), whose first device is its
/// worker's device.
pub fn build_trainer_tensor_parallel(
    spec: &ModelSpec,
    seed: u64,
    devices: Vec<Device>,
    tensor_parallel: usize,
    config: &PipelineConfig,
) -> Result<(Plan, Trainer)> {
    build_trainer_replicated(spec, seed, devices, tensor_parallel, &DataParallel::none(), config)
}

/// Data parallelism for the builders of this module: `replicas` copies of the pipeline
/// (`TrainerBuilder::data_parallel`), ZeRO stage `zero` (`TrainerBuilder::zero`) and how each
/// batch is shared among them (`TrainerBuilder::replica_shares`).
#[derive(Clone, Debug, PartialEq)]
pub struct DataParallel {
    /// Replicas of the pipeline (1: none).
    pub replicas: usize,
    /// 1 shards the optimizer state across the replicas; 0 does not.
    pub zero: u8,
    /// How each batch is shared among the replicas.
    pub shares: ReplicaShares,
    /// The gradient buckets' size, `None` to all-reduce at the optimizer step
    /// (`TrainerBuilder::bucket_size`).
    pub bucket_bytes: Option<usize>,
}

impl DataParallel {
    /// One replica: no data parallelism.
    pub fn none() -> DataParallel {
        DataParallel {
            replicas: 1,
            zero: 0,
            shares: ReplicaShares::Even,
            bucket_bytes: Some(conveyor_engine::runtime::DEFAULT_BUCKET_BYTES),
        }
    }

    /// `replicas` replicas sharing every batch evenly, optimizer state not sharded.
    pub fn replicas(replicas: usize) -> DataParallel {
        DataParallel { replicas, ..DataParallel::none() }
    }
}

/// [`build_trainer_tensor_parallel`] with `replicas` data-parallel replicas of the pipeline
/// (`TrainerBuilder::data_parallel`): `devices` are `replicas x pipeline devices x
/// tensor_parallel`, replica-major; the plan is made for replica 0's devices and every replica's
/// graph is built from `seed` with its layers split over its own groups. With `tensor_parallel`
/// 1 nothing is split and the plan is the automatic one ([`plan`]). `zero` 1 shards the
/// optimizer state across the replicas (`TrainerBuilder::zero`).
pub fn build_trainer_replicated(
    spec: &ModelSpec,
    seed: u64,
    devices: Vec<Device>,
    tensor_parallel: usize,
    data_parallel: &DataParallel,
    config: &PipelineConfig,
) -> Result<(Plan, Trainer)> {
    let (k, replicas) = (tensor_parallel, data_parallel.replicas);
    if replicas == 0 || !devices.len().is_multiple_of(replicas * k) {
        return Err(Error::invalid(
            "data parallelism",
            format!(
                "{} devices cannot form {replicas} replicas of groups of {k}: give replicas x stages x {k} devices",
                devices.len()
            ),
        ));
    }
    let per_replica = devices.len() / replicas;
    if k == 1 {
        let graph = spec.build(seed)?;
        let owned = spec.clone();
        let trainer = with_replicas(builder(graph, devices, config), data_parallel, move |_, _| owned.build(seed))
            .placement(Placement::auto())
            .build()?;
        let plan = trainer.plan().cloned().ok_or_else(|| Error::invalid("placement", "the trainer kept no plan"))?;
        return Ok((plan, trainer));
    }
    let (plan, mut graph) = plan_tensor_parallel(spec, seed, &devices[..per_replica], k, config)?;
    // Every replica's splits: the plan's nodes on the groups of that replica's devices.
    let names: Vec<(usize, Vec<String>)> = plan.stages.iter().map(|s| (s.stage_idx, s.node_names.clone())).collect();
    let layout = config.schedule.layout();
    let splits_on = move |replica_devices: &[Device]| -> Result<TensorParallelSplits> {
        let groups = device_groups(replica_devices, k)?;
        let mut splits = TensorParallelSplits::new();
        for (stage_idx, nodes) in &names {
            for name in nodes {
                splits.insert(name.clone(), groups[layout.device_of_stage(*stage_idx, groups.len())].clone());
            }
        }
        Ok(splits)
    };
    let here = rank_shard(&devices, k)?;
    // With a rank per shard, the replica whose groups hold this rank's device keeps only its shard.
    if let Some(here) = &here {
        drop(graph);
        graph = spec.build_split_on(seed, &splits_on(&devices[..per_replica])?, Some(here))?;
    }
    let stages = plan.stages.iter().map(|s| s.nodes.clone()).collect();
    let owned = spec.clone();
    let build_replica = move |_: usize, replica_devices: &[Device]| {
        owned.build_split_on(seed, &splits_on(replica_devices)?, here.as_ref())
    };
    let trainer = with_replicas(builder(graph, devices, config), data_parallel, build_replica)
        .tensor_parallel(k)
        .stages(stages)
        .derived_caches(plan.derived_caches())
        .commit_snapshot(plan.commit_snapshots())
        .build()?;
    Ok((plan, trainer))
}

/// `builder` with the replicas of `data_parallel` built by `build_replica` (unchanged for one
/// replica).
pub fn with_replicas(
    builder: TrainerBuilder,
    data_parallel: &DataParallel,
    build_replica: impl Fn(usize, &[Device]) -> Result<Graph> + 'static,
) -> TrainerBuilder {
    match data_parallel.replicas {
        1 => builder,
        replicas => builder
            .data_parallel(replicas, build_replica)
            .zero(data_parallel.zero)
            .replica_shares(data_parallel.shares.clone())
            .bucket_size(data_parallel.bucket_bytes),
    }
}

/// The collectives one micro-batch makes in a tensor-parallel stage, per call kind, through the
/// busiest device of its group (what bounds the call's time), and their predicted seconds on a link.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StageCollectives {
    /// In the forward calls.
    pub forward: Traffic,
    /// In the input-gradient calls.
    pub backward_input: Traffic,
    /// In the weight-gradient calls.
    pub backward_weight: Traffic,
}

impl StageCollectives {
    /// Predicted seconds of (forward, input-gradient, weight-gradient) collectives on `link`:
    /// `messages · latency + bytes / bandwidth` each.
    pub fn seconds(&self, link: &Link) -> (f64, f64, f64) {
        let time = |t: &Traffic| t.messages as f64 * link.latency_s + t.bytes / link.bandwidth_bytes_per_s;
        (time(&self.forward), time(&self.backward_input), time(&self.backward_weight))
    }
}

/// What each stage of `plan` over the split `graph` (from [`plan_tensor_parallel`]) exchanges per
/// micro-batch of `plan`'s rows: every split layer run once per call kind on seeded inputs of a
/// micro-batch, its collectives' traffic counted (split layers report it per device), summed over
/// the stage's split layers through each layer's busiest device. An output layer that computes a
/// softmax cross-entropy over its split output ([`conveyor_engine::Layer::forward_cross_entropy`])
/// is run that way, as training with [`conveyor_layers::CrossEntropyLoss`] runs it.
pub fn tensor_parallel_collectives(graph: &Graph, plan: &Plan) -> Result<Vec<StageCollectives>> {
    let rows = plan.config.micro_batch_rows.max(1);
    let mut rng = conveyor_engine::init::rng(0xC011);
    let busiest = |before: &[Traffic], after: &[Traffic]| -> Traffic {
        let sent = after
            .iter()
            .zip(before)
            .map(|(a, b)| Traffic { messages: a.messages - b.messages, bytes: a.bytes - b.bytes });
        sent.fold(Traffic::default(), |m, t| if t.bytes > m.bytes { t } else { m })
    };
    let add = |a: Traffic, b: Traffic| Traffic { messages: a.messages + b.messages, bytes: a.bytes + b.bytes };
    let mut out = Vec::with_capacity(plan.stages.len());
    for stage in &plan.stages {
        let mut stage_total = StageCollectives::default();
        for &id in &stage.nodes {
            let Some(layer) = graph.layer(id) else { continue };
            if !layer.is_split() {
                continue;
            }
            let device = layer.parameters()[0].value.device().clone();
            let inputs = graph
                .predecessors(id)
                .iter()
                .map(|&pred| {
                    let shape = graph.node(pred)?.output_shape.with_leading_dim(rows);
                    match layer.takes_indices() {
                        // Id 0, a valid index for any table.
                        true => conveyor_engine::Tensor::zeros(shape, conveyor_engine::DType::F32, &device),
                        false => conveyor_engine::init::uniform(shape, -1.0, 1.0, &mut rng, &device),
                    }
                })
                .collect::<Result<Vec<_>>>()?;
            let refs: Vec<&conveyor_engine::Tensor> = inputs.iter().collect();
            let t0 = layer.collective_traffic();
            let ctx = conveyor_engine::ForwardCtx::train(1);
            // One label (class 0) per row of the output layer's input.
            let label_rows = inputs.first().map_or(rows, |x| x.numel() / x.dims().last().copied().unwrap_or(1).max(1));
            let labels = vec![0; label_rows];
            let own_loss = match graph.output().ok() == Some(id) {
                true => layer.forward_cross_entropy(&refs, &labels, rows as f32, &ctx),
                false => None,
            };
            let (saved, grad) = match own_loss {
                Some(own_loss) => {
                    let saved = own_loss?.1;
                    (saved, conveyor_engine::Tensor::full(1.0, [1], conveyor_engine::DType::F32, &device)?)
                }
                None => {
                    let (output, saved) = layer.forward(&refs, &ctx)?;
                    let shape = output.shape().clone();
                    (saved, conveyor_engine::Tensor::full(1.0, shape, output.dtype(), output.device())?)
                }
            };
            let t1 = layer.collective_traffic();
            drop(layer.backward_input(&saved, &grad)?);
            let t2 = layer.collective_traffic();
            let mut grads = layer
                .parameters()
                .iter()
                .map(|p| conveyor_engine::Tensor::zeros(p.value.shape().clone(), p.value.dtype(), p.value.device()))
                .collect::<Result<Vec<_>>>()?;
            layer.backward_weight(&saved, &grad, &mut grads)?;
            let t3 = layer.collective_traffic();
            stage_total.forward = add(stage_total.forward, busiest(&t0, &t1));
            stage_total.backward_input = add(stage_total.backward_input, busiest(&t1, &t2));
            stage_total.backward_weight = add(stage_total.backward_weight, busiest(&t2, &t3));
        }
        out.push(stage_total);
    }
    Ok(out)
}
