//! `TrainerBuilder::build`: checks the layout (devices, stages, schedule, ranks), moves each
//! stage's layers onto its devices and starts one worker thread per pipeline device held here.
use std::collections::HashMap;
use std::sync::Arc;

use crossbeam::channel;

use super::super::CoreSlotPolicy;
use super::super::core_slots::CoreSlots;
use super::super::gradient_groups::{self, GradientGroups, WorkerLayout};
use super::super::stage::{NodeExec, Route, Stage, ZeroShards};
use super::super::worker;
use super::{REPORT_TIMEOUT, StageInfo, Trainer, TrainerBuilder, WorkerHandle};
use crate::graph::NodeId;
use crate::optim::Optimizer;
use crate::transport::Transport;
use crate::{Device, Error, Result, Tensor};
use conveyor_schedules::Schedule;

impl TrainerBuilder {
    /// Plans the placement if one was given ([`TrainerBuilder::placement`]), checks the layout
    /// (stages, schedule, devices), moves the layers onto their devices and starts the workers;
    /// restores a checkpoint if [`TrainerBuilder::resume`] named one. See [`Trainer::builder`]
    /// for an example.
    pub fn build(mut self) -> Result<Trainer> {
        if self.retain_freed_host_memory {
            crate::device::retain_freed_host_memory();
        }
        let state = std::mem::take(&mut self.state);
        state.check()?;
        self.graph.validate()?;
        self.optimizer.validate()?;
        self.max_grad_norm.map(crate::optim::check_max_norm).transpose()?;
        if self.devices.is_empty() {
            return Err(Error::invalid("devices", "no devices given; give at least one (e.g. cpu:0)"));
        }
        let k = self.tensor_parallel;
        if k == 0 || !self.devices.len().is_multiple_of(k) {
            return Err(Error::invalid(
                "tensor_parallel",
                format!(
                    "degree {k} with {} devices: the devices must be a whole number of groups of k",
                    self.devices.len()
                ),
            ));
        }
        let replicas = self.replicas;
        if self.zero > 1 {
            return Err(Error::invalid(
                "zero",
                format!("ZeRO stage {}: only 0 (no sharding) and 1 (optimizer state) are built", self.zero),
            ));
        }
        let zero = self.zero == 1 && replicas > 1;
        self.replica_shares.check(replicas)?;
        let groups: Vec<Vec<Device>> = self.devices.chunks(k).map(<[Device]>::to_vec).collect();
        if replicas == 0 || !groups.len().is_multiple_of(replicas) {
            return Err(Error::invalid(
                "data_parallel",
                format!(
                    "{replicas} replicas with {} devices in groups of {k}: give replicas x pipeline devices x {k} devices",
                    self.devices.len()
                ),
            ));
        }
        // One worker per group: worker `r * n_devices + d` runs pipeline device `d` of replica `r`.
        let n_workers = groups.len();
        let n_devices = n_workers / replicas;
        let (rank, world) = (self.transport.rank(), self.transport.world_size());
        // A rank per worker (a tensor-parallel group stays inside its rank, on threads), or a rank
        // per device: rank `worker * k + shard`, tensor-parallel fastest.
        if world > 1 && world != n_workers && world != n_workers * k {
            return Err(Error::WorldSize {
                world_size: world,
                needed: n_workers,
                n_devices: self.devices.len(),
                tensor_parallel: k,
            });
        }
        let ranks_per_worker = if world > 1 { world / n_workers } else { 1 };
        let (worker_rank, shard) = (rank / ranks_per_worker, rank % ranks_per_worker);
        let worker_here = |w: usize| world == 1 || w == worker_rank;
        // Replica 0's devices are the ones placement plans for.
        let first_replica = self.devices[..n_devices * k].to_vec();
        let all_devices = std::mem::replace(&mut self.devices, first_replica);
        let plan = self.apply_placement();
        self.devices = all_devices;
        let plan = plan?;
        let schedule = Schedule::new(self.schedule, n_devices, self.n_micro_batches, self.n_chunks)?;
        // Channels hold one message per micro-batch; prove the programs complete under that.
        conveyor_schedules::validate(&schedule, self.n_micro_batches)?;
        let n_stages = schedule.n_stages();
        let layer_order: Vec<NodeId> =
            self.graph.topological_order()?.into_iter().filter(|&id| self.graph.layer(id).is_some()).collect();
        let stage_nodes = match self.stages.take() {
            Some(stages) => stages,
            None if n_stages == 1 => vec![layer_order.clone()],
            None => {
                return Err(Error::invalid(
                    "stages",
                    format!("{n_stages} stages need a placement; call .placement(...) or .stages(...)"),
                ));
            }
        };
        if stage_nodes.len() != n_stages {
            return Err(Error::invalid(
                "stages",
                format!(
                    "{} stages given but the schedule runs {n_stages} ({n_devices} devices x {} chunks)",
                    stage_nodes.len(),
                    self.n_chunks
                ),
            ));
        }
        let mut stage_of: HashMap<NodeId, usize> = HashMap::new();
        for (stage_idx, nodes) in stage_nodes.iter().enumerate() {
            if nodes.is_empty() {
                return Err(Error::invalid("stages", format!("stage {stage_idx} has no layers")));
            }
            for &id in nodes {
                if self.graph.layer(id).is_none() {
                    return Err(Error::invalid("stages", format!("node #{} is not a layer of this graph", id.index())));
                }
                if stage_of.insert(id, stage_idx).is_some() {
                    return Err(Error::invalid(
                        "stages",
                        format!("node `{}` is placed twice", self.graph.node(id)?.name),
                    ));
                }
            }
        }
        if let Some(missing) = layer_order.iter().find(|id| !stage_of.contains_key(id)) {
            return Err(Error::invalid(
                "stages",
                format!("node `{}` is not placed on any stage", self.graph.node(*missing)?.name),
            ));
        }
        if world > 1 {
            agree_on_stages(self.transport.as_ref(), &stage_nodes)?;
        }
        let tied: Vec<Vec<String>> = self.graph.ties().iter().chain(&self.tied).cloned().collect();
        let ties = gradient_groups::resolve_ties(&tied, &self.graph, &stage_nodes)?;
        let output = self.graph.output()?;
        // Checkpoint names: the unsplit tensors' names, in node order.
        let param_order: Vec<String> = self
            .graph
            .node_ids()
            .into_iter()
            .filter_map(|id| Some((self.graph.node(id).ok()?.name.clone(), self.graph.layer(id)?)))
            .flat_map(|(node, layer)| {
                layer.export_parameter_shapes().into_iter().map(move |(name, _)| format!("{node}.{name}"))
            })
            .collect();
        let data_inputs = self.graph.inputs();
        // A stage's device in each replica: its group's first, or this rank's shard's with a rank
        // per shard.
        let worker_of = |replica: usize, stage_idx: usize| replica * n_devices + schedule.device_of_stage(stage_idx);
        let stage_devices: Vec<Vec<Device>> =
            (0..replicas).map(|r| (0..n_stages).map(|s| groups[worker_of(r, s)][shard].clone()).collect()).collect();
        let mut send_to: Vec<Vec<Route>> = vec![Vec::new(); n_stages];
        let mut recv_from: Vec<Vec<Route>> = vec![Vec::new(); n_stages];
        let mut stage_data_inputs: Vec<Vec<NodeId>> = vec![Vec::new(); n_stages];
        for (stage_idx, nodes) in stage_nodes.iter().enumerate() {
            for (position, &id) in nodes.iter().enumerate() {
                for pred in self.graph.predecessors(id) {
                    if data_inputs.contains(&pred) {
                        if !stage_data_inputs[stage_idx].contains(&pred) {
                            stage_data_inputs[stage_idx].push(pred);
                        }
                        continue;
                    }
                    let pred_stage = stage_of[&pred];
                    let earlier_here = pred_stage == stage_idx && nodes[..position].contains(&pred);
                    if pred_stage > stage_idx || (pred_stage == stage_idx && !earlier_here) {
                        return Err(Error::invalid(
                            "stages",
                            format!(
                                "node `{}` on stage {stage_idx} consumes `{}` which runs later (stage {pred_stage}); stages must follow graph order",
                                self.graph.node(id)?.name,
                                self.graph.node(pred)?.name
                            ),
                        ));
                    }
                    if pred_stage < stage_idx {
                        add_route(&mut recv_from[stage_idx], pred_stage, pred);
                        add_route(&mut send_to[pred_stage], stage_idx, pred);
                    }
                }
            }
        }
        // Mean flops per sample of one compute op (F, B or W) over the stages, for the automatic
        // core-slot policy; `None` when a layer cannot say.
        let op_flops_per_sample: Option<f64> = stage_nodes
            .iter()
            .map(|nodes| {
                nodes.iter().try_fold(0.0, |sum, &id| {
                    let cost = self.graph.cost(id).ok()?;
                    let flops = cost.forward_flops_per_sample
                        + cost.backward_input_flops_per_sample
                        + cost.backward_weight_flops_per_sample;
                    Some(sum + flops as f64 / 3.0)
                })
            })
            .sum::<Option<f64>>()
            .map(|total| total / n_stages as f64);
        // What the coordinator needs to route every stage's messages (the same in every replica).
        let stage_info: Vec<StageInfo> = stage_nodes
            .iter()
            .enumerate()
            .map(|(stage_idx, nodes)| StageInfo {
                stage_idx,
                data_inputs: stage_data_inputs[stage_idx].clone(),
                send_to: send_to[stage_idx].iter().map(|r| r.peer_stage_idx).collect(),
                holds_output: nodes.contains(&output),
            })
            .collect();
        let reference = structure(&self.graph)?;
        let mut per_worker: Vec<Vec<Stage>> = (0..n_workers).map(|_| Vec::new()).collect();
        for (replica, replica_stage_devices) in stage_devices.iter().enumerate() {
            let here = (0..n_devices).any(|d| worker_here(replica * n_devices + d));
            let mut replica_graph = match (replica, here) {
                (0, _) | (_, false) => None,
                (_, true) => {
                    let build = self.replica_graphs.as_ref().ok_or_else(|| {
                        Error::invalid(
                            "data_parallel",
                            "replicas need a way to build their graphs; use .data_parallel(r, build)",
                        )
                    })?;
                    let devices = &self.devices[replica * n_devices * k..(replica + 1) * n_devices * k];
                    let graph = build(replica, devices)?;
                    let theirs = structure(&graph)?;
                    if theirs != reference {
                        return Err(Error::invalid(
                            "data_parallel",
                            format!(
                                "replica {replica}'s graph differs from replica 0's (nodes or parameter shapes); build every replica's graph the same way"
                            ),
                        ));
                    }
                    Some(graph)
                }
            };
            let graph = replica_graph.as_mut().unwrap_or(&mut self.graph);
            gradient_groups::tie_initial_values(graph, &stage_nodes, &ties)?;
            for (stage_idx, nodes) in stage_nodes.iter().enumerate() {
                let worker = worker_of(replica, stage_idx);
                if !worker_here(worker) {
                    // Another rank's stage: its layers (built here as on that rank, so every rank
                    // draws the same initial values) are dropped without touching its devices.
                    if replica == 0 {
                        nodes.iter().for_each(|&id| drop(graph.take_layer(id)));
                    }
                    continue;
                }
                let device = &replica_stage_devices[stage_idx];
                let group = &groups[worker];
                let mut execs = Vec::with_capacity(nodes.len());
                let mut n_params = 0;
                for &id in nodes {
                    let mut layer = graph.take_layer(id).expect("checked above");
                    if let Some(&(_, keep)) = self.derived_caches.iter().find(|(node, _)| *node == id) {
                        layer.set_derived_cache(keep);
                    }
                    layer.to_device(device)?;
                    if ranks_per_worker > 1
                        && let Some(p) = layer.parameters().iter().find(|p| !p.value.device().same_device(device))
                    {
                        return Err(Error::invalid(
                            "stages",
                            format!(
                                "node `{}` on stage {stage_idx} holds `{}` on {}, but with a rank per tensor-parallel \
                                 shard rank {rank} holds only {device}'s shard; build split layers with \
                                 Shards::Rank (conveyor::pipeline does)",
                                graph.node(id)?.name,
                                p.name,
                                p.value.device(),
                            ),
                        ));
                    }
                    if let Some(p) =
                        layer.parameters().iter().find(|p| !group.iter().any(|d| d.same_device(p.value.device())))
                    {
                        return Err(Error::invalid(
                            "stages",
                            format!(
                                "node `{}` on stage {stage_idx} holds `{}` on {}, outside the stage's devices [{}]; build split layers on their stage's group",
                                graph.node(id)?.name,
                                p.name,
                                p.value.device(),
                                group.iter().map(Device::to_string).collect::<Vec<_>>().join(", ")
                            ),
                        ));
                    }
                    // Gradients live beside their parameters: on the shard's device for split layers.
                    let grads = layer
                        .parameters()
                        .iter()
                        .map(|p| Tensor::zeros(p.value.shape().clone(), p.value.dtype(), p.value.device()))
                        .collect::<Result<Vec<_>>>()?;
                    n_params += grads.len();
                    execs.push(NodeExec {
                        id,
                        name: graph.node(id)?.name.clone(),
                        inputs: graph.predecessors(id),
                        layer,
                        grads,
                    });
                }
                let recompute = self.recompute.get(stage_idx).or(self.recompute.last()).copied().unwrap_or_default();
                let mut stage = Stage::new(
                    stage_idx,
                    device.clone(),
                    execs,
                    recv_from[stage_idx].clone(),
                    send_to[stage_idx].clone(),
                    nodes.contains(&output).then_some(output),
                    recompute,
                    Optimizer::new(self.optimizer, n_params)?,
                    self.commit_snapshot.as_ref().and_then(|keep| keep.get(stage_idx).copied()).unwrap_or(true),
                );
                // The other shards' ranks hold copies of the unsplit layers: counted once, on
                // shard 0; the other replicas hold copies of every gradient (after the all-reduce).
                stage.counts_unsplit = shard == 0;
                stage.counts_in_norm = replica == 0;
                // A tied parameter counts once in the norm: its first copy.
                stage.norm_skips = ties
                    .iter()
                    .flat_map(|t| &t.copies[1..])
                    .filter(|c| c.stage_idx == stage_idx)
                    .map(|c| (c.node_pos, c.param_idx))
                    .collect();
                if zero {
                    let node_bytes: Vec<u64> = nodes
                        .iter()
                        .map(|&id| {
                            let shapes = reference_shapes(&reference, graph, id);
                            shapes.iter().map(|s| 4 * s.numel() as u64).sum()
                        })
                        .collect();
                    stage.zero = Some(ZeroShards::balanced(replica, replicas, &node_bytes));
                }
                per_worker[worker].push(stage);
            }
        }
        // The gradient groups: worker `r * n + d` with the same `d` (and shard) in every replica,
        // and the workers holding each tied parameter's copies. Every rank creates the same groups
        // (the transport's subgroups are agreed).
        let layout = WorkerLayout {
            n_devices,
            replicas,
            device_of_stage: (0..n_stages).map(|s| schedule.device_of_stage(s)).collect(),
        };
        let mut gradient_groups: Vec<GradientGroups> = if world == 1 {
            gradient_groups::in_process_groups(&layout, &ties, |w| groups[w][0].clone())?
        } else {
            let buffers = match &groups[worker_rank][shard] {
                Device::Cpu(_) => groups[worker_rank][shard].clone(),
                _ => Device::host(),
            };
            let mine = gradient_groups::rank_groups(&layout, &ties, &self.transport, buffers, ranks_per_worker)?;
            let mut all: Vec<GradientGroups> = (0..n_workers).map(|_| GradientGroups::default()).collect();
            all[worker_rank] = mine;
            all
        };
        let group_aborts: Vec<crate::collective::GroupAbort> =
            gradient_groups.iter().flat_map(|g| g.aborts()).collect();
        let n_slots = match self.core_slots {
            CoreSlotPolicy::Slots(n) => Some(n.max(1)),
            CoreSlotPolicy::Off => None,
            CoreSlotPolicy::Auto => {
                let cores = std::thread::available_parallelism().map_or(1, usize::from);
                let all_cpu = groups.iter().all(|g| matches!(g[0], Device::Cpu(_)));
                (k == 1 && all_cpu && world == 1 && n_workers > cores).then_some(cores)
            }
        };
        let slots = n_slots.map(|n| Arc::new(CoreSlots::new(n, n_workers)));
        let auto_slots_op_flops = match self.core_slots {
            CoreSlotPolicy::Auto => op_flops_per_sample,
            _ => None,
        };
        let mut workers = Vec::with_capacity(n_workers);
        // Workers report op spans to the subscriber of the thread that built the trainer.
        let dispatch = tracing::dispatcher::get_default(|d| d.clone());
        for (worker_idx, (stages, worker_groups)) in per_worker.into_iter().zip(gradient_groups.drain(..)).enumerate() {
            if !worker_here(worker_idx) {
                // Another rank's worker: that rank holds its stages.
                workers.push(None);
                continue;
            }
            let (tx, rx) = channel::unbounded();
            let loss = Arc::clone(&self.loss);
            let dispatch = dispatch.clone();
            let slots = slots.clone();
            let handle = std::thread::Builder::new()
                .name(format!("conveyor-{}", groups[worker_idx][0]))
                .spawn(move || {
                    tracing::dispatcher::with_default(&dispatch, || {
                        worker::run(worker_idx, stages, loss, rx, slots, worker_groups)
                    })
                })
                .map_err(|e| Error::invalid("worker thread", format!("could not start: {e}")))?;
            workers.push(Some(WorkerHandle { commands: tx, thread: Some(handle) }));
        }
        state.apply(Trainer {
            workers,
            replicas,
            zero,
            bucket_bytes: self.bucket_bytes,
            shares: crate::runtime::replica_shares::ShareState::new(self.replica_shares, replicas),
            group_aborts,
            group_layout: layout,
            ties: Arc::new(ties),
            transport: self.transport,
            round: 0,
            devices: self.devices,
            tensor_parallel: k,
            ranks_per_worker,
            shard,
            stage_devices: stage_devices.into_iter().map(Arc::new).collect(),
            stage_workers: (0..replicas)
                .map(|r| Arc::new((0..schedule.n_stages()).map(|s| worker_of(r, s)).collect()))
                .collect(),
            stage_info,
            schedule,
            seed: self.seed,
            max_grad_norm: self.max_grad_norm,
            core_slots: n_slots,
            slots,
            auto_slots_op_flops,
            step_idx: 0,
            fault: None,
            fault_replica: None,
            stall: None,
            poisoned: None,
            gradients_only: false,
            overlap_steps: self.overlap_steps,
            overlap_blocked: if world > 1 {
                Some("steps overlap in one process only; across ranks they stay synchronous")
            } else if self.commit_snapshot.as_ref().is_some_and(|keep| keep.iter().any(|&k| !k)) {
                Some("a stage keeps no undo snapshot, so an update applied before its validation could not be undone")
            } else {
                None
            },
            graph: self.graph,
            param_order,
            plan,
            loss: self.loss,
            metadata: Default::default(),
            precision: self.precision,
            loss_scaler: self.precision.scales_loss().then(|| crate::LossScaler::new(self.loss_scale)),
        })
    }
}

/// Every node's name with its parameters' names and shapes, in node order.
type GraphStructure = Vec<(String, Vec<(String, crate::Shape)>)>;

/// A graph's nodes in order with their parameters' names and shapes: what every replica's graph
/// must share with replica 0's.
fn structure(graph: &crate::graph::Graph) -> Result<GraphStructure> {
    graph
        .node_ids()
        .into_iter()
        .map(|id| {
            let name = graph.node(id)?.name.clone();
            Ok((name, graph.layer(id).map(|l| l.export_parameter_shapes()).unwrap_or_default()))
        })
        .collect()
}

/// The unsplit parameter shapes of node `id` as recorded in `reference` ([`structure`]), which
/// every rank and replica shares (a layer already taken from `graph` is found there).
fn reference_shapes(reference: &GraphStructure, graph: &crate::graph::Graph, id: NodeId) -> Vec<crate::Shape> {
    let name = graph.node(id).map(|n| n.name.clone()).unwrap_or_default();
    reference
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, shapes)| shapes.iter().map(|(_, s)| s.clone()).collect())
        .unwrap_or_default()
}

/// Seconds since the Unix epoch on this machine's clock.
pub(super) fn wall_clock_s() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// Refuses a build whose ranks chose different stages (a placement from measured times differs
/// from process to process): every rank must run the same split.
fn agree_on_stages(transport: &dyn Transport, stage_nodes: &[Vec<NodeId>]) -> Result<()> {
    let mine: Vec<u8> = stage_nodes
        .iter()
        .flat_map(|nodes| nodes.iter().map(|id| id.index() as u64).chain([u64::MAX]))
        .flat_map(u64::to_le_bytes)
        .collect();
    let all = transport.all_gather(mine.clone(), REPORT_TIMEOUT)?;
    match all.iter().position(|theirs| *theirs != mine) {
        None => Ok(()),
        Some(other) => Err(Error::invalid(
            "stages",
            format!(
                "rank {} and rank {other} placed the layers on different stages; give every rank the same \
                 placement (a placement file, or planning by estimated costs rather than measured ones)",
                transport.rank()
            ),
        )),
    }
}

fn add_route(routes: &mut Vec<Route>, peer_stage_idx: usize, node: NodeId) {
    match routes.iter_mut().find(|r| r.peer_stage_idx == peer_stage_idx) {
        Some(route) => {
            if !route.nodes.contains(&node) {
                route.nodes.push(node);
            }
        }
        None => routes.push(Route { peer_stage_idx, nodes: vec![node] }),
    }
}
