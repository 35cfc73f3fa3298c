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
    DeviceSpec, Link, NodeCosts, OptimizerMemory, Plan, PlanConfig, place_automatically, place_with_costs, profile_graph,
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
/// (stage `s` on device `s % n_devices`, a device's budget shared by its chunks), in-flight
/// counts from the schedule simulator, the default in-process link. `conveyor train` and
/// `conveyor plan` both plan through this, so they agree on every figure.
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
    );
    let specs = (0..n_stages)
        .map(|s| {
            let device = &devices[s % n_devices];
            let budget = device.memory_budget().map(|b| b / n_chunks as u64);
            DeviceSpec { name: device.to_string(), flops_per_s: CPU_FLOPS_PER_S, budget_bytes: budget }
        })
        .collect();
    Ok((specs, plan_config))
}

/// Plans `graph` on `devices` (one stage per device and chunk) under their budgets.
pub fn plan(graph: &Graph, devices: &[Device], config: &PipelineConfig) -> Result<Plan> {
    let (specs, plan_config) = planner_inputs(
        devices,
        config.schedule,
        config.n_chunks,
        config.n_micro_batches,
        config.batch_rows,
        optimizer_memory(&config.optimizer),
    )?;
    place_automatically(graph, &specs, &plan_config)
}

/// Plans `graph` like [`plan`], but from layer times measured on this machine (torchgpipe's
/// balance by time: [`profile_graph`] times every layer's forward, input-gradient and weight-gradient
/// passes on micro-batches of the planned size) instead of FLOP estimates.
pub fn plan_by_time(graph: &Graph, devices: &[Device], config: &PipelineConfig) -> Result<Plan> {
    let (specs, plan_config) = planner_inputs(
        devices,
        config.schedule,
        config.n_chunks,
        config.n_micro_batches,
        config.batch_rows,
        optimizer_memory(&config.optimizer),
    )?;
    let times = profile_graph(graph, plan_config.micro_batch_rows, 5)?;
    let costs = NodeCosts::of_graph(graph)?.with_measured_times(&times, CPU_FLOPS_PER_S)?;
    place_with_costs(&costs, &specs, &plan_config)
}

/// Plans the graph and starts a trainer with that placement.
pub fn build_trainer(graph: Graph, devices: Vec<Device>, config: &PipelineConfig) -> Result<(Plan, Trainer)> {
    let plan = plan(&graph, &devices, config)?;
    let trainer = build_trainer_with_plan(graph, devices, &plan, config)?;
    Ok((plan, trainer))
}

/// Starts a trainer for `graph` placed by `plan` (from [`plan`], [`plan_by_time`] or manual placement).
pub fn build_trainer_with_plan(graph: Graph, devices: Vec<Device>, plan: &Plan, config: &PipelineConfig) -> Result<Trainer> {
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
        .build()
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

/// Plans `spec` over groups of `tensor_parallel` devices and starts a trainer whose stages each
/// hold one group: every Linear and Conv2d of a stage is split over the stage's group (Linears
/// column- then row-parallel in turn, convolutions by output channels), so a layer too large for
/// one device's budget fits its group. The graph is built from `seed`; with `tensor_parallel` 1
/// this is [`build_trainer`] on `spec.build(seed)`.
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
    let groups = device_groups(&devices, tensor_parallel)?;
    let whole = spec.build(seed)?;
    let (specs, plan_config) = planner_inputs_tensor_parallel(
        &devices,
        tensor_parallel,
        config.schedule,
        config.n_chunks,
        config.n_micro_batches,
        config.batch_rows,
        optimizer_memory(&config.optimizer),
    )?;
    let plan = place_automatically(&whole, &specs, &plan_config)?;
    let mut splits = TensorParallelSplits::new();
    for stage in &plan.stages {
        for name in &stage.node_names {
            splits.insert(name.clone(), groups[stage.stage_idx % groups.len()].clone());
        }
    }
    let graph = spec.build_split(seed, &splits)?;
    // The split graph has the whole graph's nodes, so the plan's node ids carry over.
    for stage in &plan.stages {
        for (&id, name) in stage.nodes.iter().zip(&stage.node_names) {
            if graph.node(id)?.name != *name {
                return Err(Error::invalid(
                    "tensor parallelism",
                    format!("node `{name}` moved when its layers were split"),
                ));
            }
        }
    }
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
        .build()?;
    Ok((plan, trainer))
}
