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

fn optimizer_memory(optimizer: &OptimizerConfig) -> OptimizerMemory {
    match optimizer.state_bytes_per_param_byte() {
        0 => OptimizerMemory::Sgd,
        1 => OptimizerMemory::Momentum,
        _ => OptimizerMemory::Adam,
    }
}

/// Plans `graph` on `devices` (one stage per device and chunk) under their budgets.
pub fn plan(graph: &Graph, devices: &[Device], config: &PipelineConfig) -> Result<Plan> {
    let n_devices = devices.len();
    let n_stages = n_devices * config.n_chunks;
    let inflight = simulated_inflight(config.schedule, n_devices, config.n_micro_batches, config.n_chunks)?;
    let micro_batch_rows = config.batch_rows.div_ceil(config.n_micro_batches.max(1)).max(1);
    let plan_config = PlanConfig::new(
        micro_batch_rows,
        n_stages,
        |p| if p == n_stages { inflight.clone() } else { vec![config.n_micro_batches; p] },
        optimizer_memory(&config.optimizer),
        Link::default(),
    );
    let specs: Vec<DeviceSpec> = (0..n_stages)
        .map(|s| {
            let device = &devices[s % n_devices];
            // With chunks, a device's budget is shared by its chunks.
            let budget = device.memory_budget().map(|b| b / config.n_chunks as u64);
            DeviceSpec { name: device.to_string(), flops_per_s: CPU_FLOPS_PER_S, budget_bytes: budget }
        })
        .collect();
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
