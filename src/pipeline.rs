//! From a model, devices and a schedule to a running [`Trainer`]: automatic placement with the
//! schedule's simulated in-flight counts, then stages on devices. Shared by the CLI and examples.
use std::sync::Arc;

use conveyor_engine::graph::Graph;
use conveyor_engine::optim::OptimizerConfig;
use conveyor_engine::placement::{DeviceSpec, Link, OptimizerMemory, Plan, PlanConfig, place_automatically};
use conveyor_engine::runtime::{Recompute, Trainer};
use conveyor_engine::{Device, Result};
use conveyor_layers::CrossEntropyLoss;
use conveyor_schedules::{CostModel, Schedule, ScheduleKind, StageCosts, simulate};

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
}

/// Peak micro-batches in flight per stage under `kind`, from the schedule simulator.
pub fn simulated_inflight(kind: ScheduleKind, n_devices: usize, n_micro_batches: usize, n_chunks: usize) -> Result<Vec<usize>> {
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

/// Plans the graph and starts a trainer with that placement.
pub fn build_trainer(graph: Graph, devices: Vec<Device>, config: &PipelineConfig) -> Result<(Plan, Trainer)> {
    let plan = plan(&graph, &devices, config)?;
    let stages = plan.stages.iter().map(|s| s.nodes.clone()).collect();
    let trainer = Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices(devices)
        .stages(stages)
        .schedule(config.schedule, config.n_chunks)
        .micro_batches(config.n_micro_batches)
        .optimizer(config.optimizer)
        .recompute(config.recompute)
        .seed(config.seed)
        .build()?;
    Ok((plan, trainer))
}
