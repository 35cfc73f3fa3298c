//! From a model, devices and a schedule to a running [`Trainer`]: automatic placement with the
//! schedule's simulated in-flight counts, then stages on devices. Shared by the CLI and examples.
//!
//! With tensor parallelism ([`build_trainer_tensor_parallel`]) each stage holds a group of `k`
//! consecutive devices: the planner sees each group as one device `k` times as fast and large,
//! and the model is rebuilt with its wide layers split over the group of the stage they landed on.
use std::sync::Arc;

use conveyor_engine::graph::Graph;
use conveyor_engine::optim::OptimizerConfig;
use conveyor_engine::placement::{
    DeviceSpec, Link, NodeCosts, OptimizerMemory, Plan, PlanConfig, format_bytes, measure_node_memory,
    measure_node_memory_on, place_manually_with_costs, place_with_costs, profile_graph,
};
use conveyor_engine::runtime::{CoreSlotPolicy, Recompute, Trainer};
use conveyor_engine::{Device, Error, Result};
use conveyor_layers::CrossEntropyLoss;
use conveyor_schedules::{CostModel, Schedule, ScheduleKind, StageCosts, simulate};

use crate::zoo::{ModelSpec, TensorParallelSplits};

/// Sustained single-core f32 throughput the planner assumes for a CPU device.
pub const CPU_FLOPS_PER_S: f64 = 50e9;

/// How to run a model.
#[derive(Clone, Debug)]
pub struct PipelineConfig {
    /// The schedule.
    pub schedule: ScheduleKind,
    /// Chunks per device (interleaved only).
    pub n_chunks: usize,
    /// Micro-batches per batch.
    pub n_micro_batches: usize,
    /// Rows per batch (sets the micro-batch size the planner budgets for).
    pub batch_rows: usize,
    /// The optimizer.
    pub optimizer: OptimizerConfig,
    /// Activation recomputation.
    pub recompute: Recompute,
    /// Seed for dropout.
    pub seed: u64,
    /// Core slots for CPU workers ([`conveyor_engine::runtime::CoreSlotPolicy`]).
    pub core_slots: CoreSlotPolicy,
}

/// Peak micro-batches in flight per stage under `kind`, from the schedule simulator.
pub fn simulated_inflight(
    kind: ScheduleKind,
    n_devices: usize,
    n_micro_batches: usize,
    n_chunks: usize,
) -> Result<Vec<usize>> {
    let schedule = Schedule::new(kind, n_devices, n_micro_batches, n_chunks)?;
    Ok(simulate(&schedule, &CostModel::uniform(StageCosts::UNIT))?.peak_inflight)
}

/// The planner's optimizer-state class of an optimizer configuration.
pub fn optimizer_memory(optimizer: &OptimizerConfig) -> OptimizerMemory {
    match optimizer.state_bytes_per_param_byte() {
        0 => OptimizerMemory::Sgd,
        1 => OptimizerMemory::Momentum,
        _ => OptimizerMemory::Adam,
    }
}

/// The planner's devices and settings for `devices` under a schedule: one spec per stage
/// (stage `s` on device `s % n_devices`, a device's budget shared by its chunks), where every
/// micro-batch is at each instruction of the schedule (for the memory plan), in-flight counts
/// from the schedule simulator, the default in-process link, no recomputation (set
/// `PlanConfig::recompute` for another mode). `conveyor train` and `conveyor plan` both plan
/// through this, so they agree on every figure.
pub fn planner_inputs(
    devices: &[Device],
    schedule: ScheduleKind,
    n_chunks: usize,
    n_micro_batches: usize,
    batch_rows: usize,
    optimizer: OptimizerMemory,
) -> Result<(Vec<DeviceSpec>, PlanConfig)> {
    let n_devices = devices.len();
    let n_stages = n_devices * n_chunks;
    let inflight = simulated_inflight(schedule, n_devices, n_micro_batches, n_chunks)?;
    let micro_batch_rows = batch_rows.div_ceil(n_micro_batches.max(1)).max(1);
    let plan_config = PlanConfig::new(
        micro_batch_rows,
        n_stages,
        |p| if p == n_stages { inflight.clone() } else { vec![n_micro_batches; p] },
        optimizer,
        Link::default(),
    )
    .with_schedule(&Schedule::new(schedule, n_devices, n_micro_batches, n_chunks)?);
    let specs = (0..n_stages)
        .map(|s| {
            let device = &devices[s % n_devices];
            let budget = device.memory_budget().map(|b| b / n_chunks as u64);
            DeviceSpec { name: device.to_string(), flops_per_s: CPU_FLOPS_PER_S, budget_bytes: budget }
        })
        .collect();
    Ok((specs, plan_config))
}

/// [`planner_inputs`] for `config` (its schedule, micro-batches, rows, optimizer and recompute mode).
pub fn planner_inputs_for(devices: &[Device], config: &PipelineConfig) -> Result<(Vec<DeviceSpec>, PlanConfig)> {
    let (specs, mut plan_config) = planner_inputs(
        devices,
        config.schedule,
        config.n_chunks,
        config.n_micro_batches,
        config.batch_rows,
        optimizer_memory(&config.optimizer),
    )?;
    plan_config.recompute = config.recompute;
    Ok((specs, plan_config))
}

/// The planner's node costs of `graph` with the memory each layer uses measured by running it
/// once on a micro-batch of `micro_batch_rows` rows ([`measure_node_memory`]: which saved
/// tensors share their inputs and outputs, so shared bytes are counted once). The layers must
/// be on the host (as a freshly built graph's are).
pub fn node_costs(graph: &Graph, micro_batch_rows: usize) -> Result<NodeCosts> {
    NodeCosts::of_graph(graph)?.with_measured_memory(&measure_node_memory(graph, micro_batch_rows)?)
}

/// Plans `graph` on `devices` (one stage per device and chunk) under their budgets.
pub fn plan(graph: &Graph, devices: &[Device], config: &PipelineConfig) -> Result<Plan> {
    let (specs, plan_config) = planner_inputs_for(devices, config)?;
    place_with_costs(&node_costs(graph, plan_config.micro_batch_rows)?, &specs, &plan_config)
}

/// Plans `graph` with the layers of each stage named in `stages` (as a placement file gives
/// them; see [`conveyor_engine::placement::place_manually`]), with the same memory figures as
/// [`plan`].
pub fn plan_manually(
    graph: &Graph,
    stages: &[Vec<String>],
    devices: &[Device],
    config: &PipelineConfig,
) -> Result<Plan> {
    let (specs, plan_config) = planner_inputs_for(devices, config)?;
    let costs = node_costs(graph, plan_config.micro_batch_rows)?;
    place_manually_with_costs(graph, &costs, stages, &specs, &plan_config)
}

/// Plans `graph` like [`plan`], but from layer times measured on this machine (torchgpipe's
/// balance by time: [`profile_graph`] times every layer's forward, input-gradient and weight-gradient
/// passes on micro-batches of the planned size) instead of FLOP estimates.
pub fn plan_by_time(graph: &Graph, devices: &[Device], config: &PipelineConfig) -> Result<Plan> {
    let (specs, plan_config) = planner_inputs_for(devices, config)?;
    let times = profile_graph(graph, plan_config.micro_batch_rows, 5)?;
    let costs = node_costs(graph, plan_config.micro_batch_rows)?.with_measured_times(&times, CPU_FLOPS_PER_S)?;
    place_with_costs(&costs, &specs, &plan_config)
}

/// Plans the graph and starts a trainer with that placement.
pub fn build_trainer(graph: Graph, devices: Vec<Device>, config: &PipelineConfig) -> Result<(Plan, Trainer)> {
    let plan = plan(&graph, &devices, config)?;
    let trainer = build_trainer_with_plan(graph, devices, &plan, config)?;
    Ok((plan, trainer))
}

/// Starts a trainer for `graph` placed by `plan` (from [`plan`], [`plan_by_time`] or manual
/// placement), with the derived caches and undo snapshots the plan keeps.
pub fn build_trainer_with_plan(
    graph: Graph,
    devices: Vec<Device>,
    plan: &Plan,
    config: &PipelineConfig,
) -> Result<Trainer> {
    let stages = plan.stages.iter().map(|s| s.nodes.clone()).collect();
    Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices(devices)
        .stages(stages)
        .schedule(config.schedule, config.n_chunks)
        .micro_batches(config.n_micro_batches)
        .optimizer(config.optimizer)
        .recompute(config.recompute)
        .seed(config.seed)
        .core_slots(config.core_slots)
        .derived_caches(plan.derived_caches())
        .commit_snapshot(plan.commit_snapshots())
        .build()
}

/// What the memory plan decided, one line per stage that dropped something to fit: its packed
/// weight caches (slower, same results) or its commit undo snapshot (a failed update then
/// cannot be rolled back on that stage). Empty when the plan keeps everything.
pub fn memory_notes(plan: &Plan) -> Vec<String> {
    let mut notes = Vec::new();
    for stage in &plan.stages {
        let mut dropped = Vec::new();
        if !stage.dropped_caches.is_empty() {
            dropped.push(format!(
                "the derived caches of {} ({}; those layers run a little slower)",
                stage.dropped_caches.join(" "),
                format_bytes(stage.memory.workspace_dropped)
            ));
        }
        if !stage.keeps_commit_snapshot() {
            let bytes: u64 = stage.device_memory().map(|m| m.commit_snapshot_dropped).sum();
            dropped.push(format!(
                "its commit undo snapshot ({}; a failed update cannot be rolled back there)",
                format_bytes(bytes)
            ));
        }
        if !dropped.is_empty() {
            notes.push(format!("stage {} drops {} to fit its memory", stage.stage_idx, dropped.join(" and ")));
        }
    }
    notes
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
            let members: Vec<DeviceSpec> = groups[s % groups.len()]
                .iter()
                .map(|device| DeviceSpec {
                    name: device.to_string(),
                    flops_per_s: CPU_FLOPS_PER_S,
                    budget_bytes: device.memory_budget().map(|b| b / n_chunks as u64),
                })
                .collect();
            DeviceSpec::group(&members)
        })
        .collect();
    Ok((specs, plan_config))
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
    let whole = spec.build(seed)?;
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
    let rows = plan_config.micro_batch_rows;
    let placement = place_with_costs(&node_costs(&whole, rows)?, &specs, &plan_config)?;
    drop(whole);
    let group_of_stage = |stage_idx: usize| &groups[stage_idx % groups.len()];
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
    let measured = measure_node_memory_on(&graph, rows, |id| {
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
/// group `s % n_groups`, whose first device is its worker's device.
pub fn build_trainer_tensor_parallel(
    spec: &ModelSpec,
    seed: u64,
    devices: Vec<Device>,
    tensor_parallel: usize,
    config: &PipelineConfig,
) -> Result<(Plan, Trainer)> {
    let (plan, graph) = plan_tensor_parallel(spec, seed, &devices, tensor_parallel, config)?;
    let stages = plan.stages.iter().map(|s| s.nodes.clone()).collect();
    let trainer = Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices(devices)
        .tensor_parallel(tensor_parallel)
        .stages(stages)
        .schedule(config.schedule, config.n_chunks)
        .micro_batches(config.n_micro_batches)
        .optimizer(config.optimizer)
        .recompute(config.recompute)
        .seed(config.seed)
        .core_slots(config.core_slots)
        .derived_caches(plan.derived_caches())
        .commit_snapshot(plan.commit_snapshots())
        .build()?;
    Ok((plan, trainer))
}
