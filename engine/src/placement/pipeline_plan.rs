//! From a graph, devices and a run's settings to a [`Plan`]: the planner's devices and settings
//! for a schedule ([`planner_inputs`]), the node costs with measured memory ([`node_costs`]), and
//! the three ways to choose stages a [`Placement`] names (by hand, automatically under budgets
//! from FLOP estimates, or from measured layer times). `TrainerBuilder::placement`, `conveyor
//! train` and `conveyor plan` all plan through here, so they agree on every figure.
use std::path::PathBuf;

use conveyor_schedules::{CostModel, Schedule, ScheduleKind, StageCosts, simulate};

use super::{
    DeviceSpec, Link, NodeCosts, OptimizerMemory, Plan, PlanConfig, WeightCache, format_bytes, measure_node_memory,
    measure_node_memory_at, place_manually_with_costs, place_with_costs, profile_graph, read_placement_file,
};
use crate::graph::{Graph, NodeId};
use crate::optim::OptimizerConfig;
use crate::runtime::{CoreSlotPolicy, Recompute};
use crate::{Device, Result};

/// Sustained single-core f32 throughput the planner assumes for a CPU device.
pub const CPU_FLOPS_PER_S: f64 = 50e9;

/// How often [`PlaceBy::Time`] runs each pass of each layer (the median is kept).
const PROFILE_REPEATS: usize = 5;

/// How to run a model: what the planner and the trainer need besides the graph and devices.
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
    /// Core slots for CPU workers ([`CoreSlotPolicy`]).
    pub core_slots: CoreSlotPolicy,
    /// The autocast policy ([`crate::Precision`]): the memory plan measures each layer under it,
    /// so half-typed activations count at their bytes.
    pub precision: crate::Precision,
    /// Which packed weight copies the stages keep ([`WeightCache`]).
    pub weight_cache: WeightCache,
}

impl PipelineConfig {
    /// `schedule` with `n_micro_batches` per batch of `batch_rows` rows and everything else at its
    /// default: the schedule's default chunk count ([`ScheduleKind::default_chunks`]), SGD at 0.01
    /// (the trainer's default optimizer), no recomputation, seed 0, the default core slots,
    /// precision and weight caches. Change a field with struct update syntax:
    ///
    /// ```
    /// use conveyor_engine::optim::OptimizerConfig;
    /// use conveyor_engine::placement::PipelineConfig;
    /// use conveyor_schedules::ScheduleKind;
    ///
    /// let config = PipelineConfig { optimizer: OptimizerConfig::adam(1e-3), ..PipelineConfig::new(ScheduleKind::ZbH2, 4, 256) };
    /// assert_eq!((config.n_chunks, config.n_micro_batches, config.batch_rows), (1, 4, 256));
    /// assert_eq!(PipelineConfig::new(ScheduleKind::Interleaved, 4, 256).n_chunks, 2);
    /// ```
    pub fn new(schedule: ScheduleKind, n_micro_batches: usize, batch_rows: usize) -> PipelineConfig {
        PipelineConfig {
            schedule,
            n_chunks: schedule.default_chunks(),
            n_micro_batches,
            batch_rows,
            optimizer: OptimizerConfig::sgd(0.01),
            recompute: Recompute::Never,
            seed: 0,
            core_slots: CoreSlotPolicy::default(),
            precision: crate::Precision::default(),
            weight_cache: WeightCache::default(),
        }
    }
}

/// What automatic placement balances.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PlaceBy {
    /// Stage times predicted from each layer's FLOP estimate, with every stage under its device's
    /// memory budget (the memory plan: parameters, gradients, optimizer state, activations held
    /// under the schedule, messages, caches). `conveyor train --placement auto`.
    #[default]
    Memory,
    /// Like [`PlaceBy::Memory`], but with each layer's forward, input-gradient and weight-gradient
    /// times measured on this machine on micro-batches of the planned size (torchgpipe's balance
    /// by time). `conveyor train --placement time`.
    Time,
}

/// How the layers are put on stages ([`crate::runtime::TrainerBuilder::placement`]).
///
/// ```
/// use conveyor_engine::placement::{PlaceBy, Placement};
///
/// // By hand: node names, or ranges `first..last` in graph order, one list per stage.
/// let by_hand = Placement::Manual(vec![vec!["fc1".into(), "relu1".into()], vec!["fc2..head".into()]]);
/// // By the planner, under the devices' memory budgets: from FLOP estimates, or measured times.
/// let (by_flops, by_time) = (Placement::auto(), Placement::Auto { by: PlaceBy::Time });
/// // From a placement file (`conveyor plan --placement FILE`): one line of names per stage.
/// let from_file = Placement::File("stages.txt".into());
/// # let _ = (by_hand, by_flops, by_time, from_file);
/// ```
#[derive(Clone, Debug)]
pub enum Placement {
    /// The nodes of each stage by name, stage 0 first; an entry `first..last` names every layer
    /// from `first` to `last` in topological order (as [`super::place_manually`] takes them).
    Manual(Vec<Vec<String>>),
    /// Chosen by the planner: one stage per device and chunk, balanced as `by` says.
    Auto {
        /// What the planner balances.
        by: PlaceBy,
    },
    /// A placement file: one line of node names or ranges per stage (`conveyor plan --placement`).
    File(PathBuf),
    /// The layer nodes of each stage, used as given without planning (as
    /// `TrainerBuilder::stages`): no plan, no memory check, every cache and snapshot kept.
    Stages(Vec<Vec<NodeId>>),
    /// A plan made before (for example by `TrainerBuilder::plan`), with its derived caches and
    /// commit snapshots.
    Plan(Box<Plan>),
}

impl Placement {
    /// Automatic placement under memory budgets from FLOP estimates ([`PlaceBy::Memory`]).
    pub fn auto() -> Placement {
        Placement::Auto { by: PlaceBy::Memory }
    }
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
/// (stage `s` on the schedule's device of it, a device's budget shared by its chunks), where every
/// micro-batch is at each instruction of the schedule (for the memory plan), in-flight counts
/// from the schedule simulator, the default in-process link, no recomputation (set
/// `PlanConfig::recompute` for another mode).
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
    let built = Schedule::new(schedule, n_devices, n_micro_batches, n_chunks)?;
    let plan_config = PlanConfig::new(
        micro_batch_rows,
        n_stages,
        |p| if p == n_stages { inflight.clone() } else { vec![n_micro_batches; p] },
        optimizer,
        Link::default(),
    )
    .with_schedule(&built);
    let specs = (0..n_stages)
        .map(|s| {
            let device = &devices[built.device_of_stage(s)];
            let budget = device.memory_budget().map(|b| b / n_chunks as u64);
            DeviceSpec {
                name: device.to_string(),
                flops_per_s: CPU_FLOPS_PER_S,
                budget_bytes: budget,
                kind: device.kind(),
            }
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
    plan_config.weight_cache = config.weight_cache;
    Ok((specs, plan_config))
}

/// The planner's node costs of `graph` with the memory each layer uses measured by running it
/// once on a micro-batch of `micro_batch_rows` rows ([`measure_node_memory`]: which saved
/// tensors share their inputs and outputs, so shared bytes are counted once). The layers must
/// be on the host (as a freshly built graph's are).
pub fn node_costs(graph: &Graph, micro_batch_rows: usize) -> Result<NodeCosts> {
    NodeCosts::of_graph(graph)?.with_measured_memory(&measure_node_memory(graph, micro_batch_rows)?)
}

/// [`node_costs`] under an autocast policy ([`measure_node_memory_at`]): activations in a half
/// type count at 2 bytes per element, gradient sums go through f32 copies, and GPU stages count
/// the f32 copies their ops read half operands through ([`NodeCosts::under_mixed_precision`]).
pub fn node_costs_at(graph: &Graph, micro_batch_rows: usize, precision: crate::Precision) -> Result<NodeCosts> {
    let costs = NodeCosts::of_graph(graph)?.with_measured_memory(&measure_node_memory_at(
        graph,
        micro_batch_rows,
        precision,
    )?)?;
    Ok(if precision.is_mixed() { costs.under_mixed_precision() } else { costs })
}

/// Plans `graph` on `devices` (one stage per device and chunk) under their budgets, from FLOP
/// estimates ([`PlaceBy::Memory`]).
pub fn plan(graph: &Graph, devices: &[Device], config: &PipelineConfig) -> Result<Plan> {
    let (specs, plan_config) = planner_inputs_for(devices, config)?;
    place_with_costs(&node_costs_at(graph, plan_config.micro_batch_rows, config.precision)?, &specs, &plan_config)
}

/// Plans `graph` with the layers of each stage named in `stages` (as a placement file gives
/// them; see [`super::place_manually`]), with the same memory figures as [`plan`].
pub fn plan_manually(
    graph: &Graph,
    stages: &[Vec<String>],
    devices: &[Device],
    config: &PipelineConfig,
) -> Result<Plan> {
    let (specs, plan_config) = planner_inputs_for(devices, config)?;
    let costs = node_costs_at(graph, plan_config.micro_batch_rows, config.precision)?;
    place_manually_with_costs(graph, &costs, stages, &specs, &plan_config)
}

/// Plans `graph` like [`plan`], but from layer times measured on this machine ([`PlaceBy::Time`]:
/// [`profile_graph`] times every layer's forward, input-gradient and weight-gradient passes on
/// micro-batches of the planned size) instead of FLOP estimates.
pub fn plan_by_time(graph: &Graph, devices: &[Device], config: &PipelineConfig) -> Result<Plan> {
    let (specs, plan_config) = planner_inputs_for(devices, config)?;
    let times = profile_graph(graph, plan_config.micro_batch_rows, PROFILE_REPEATS)?;
    let costs = node_costs_at(graph, plan_config.micro_batch_rows, config.precision)?
        .with_measured_times(&times, CPU_FLOPS_PER_S)?;
    place_with_costs(&costs, &specs, &plan_config)
}

/// Seconds of profiling [`plan_auto`] may spend, estimated from the cost model before it starts.
pub const AUTO_PROFILE_BUDGET_S: f64 = 0.5;
/// [`plan_auto`] profiles only models whose passes take at least this long per micro-batch (by
/// the cost model): below it, timing noise would decide the cut from run to run.
pub const AUTO_PROFILE_MIN_STEP_S: f64 = 2e-3;
/// [`plan_auto`] keeps the measured plan only when its slowest stage is at most this fraction of
/// the estimated plan's (both priced by the profile): a margin, so that noise between two equally
/// good cuts does not flip the placement from run to run.
pub const AUTO_MEASURED_MARGIN: f64 = 0.9;

/// How [`plan_auto`] placed a graph.
#[derive(Clone, Debug, PartialEq)]
pub enum AutoPlacement {
    /// From the cost model alone; no profile was taken, for this reason.
    Estimated(NoProfile),
    /// A profile was taken ([`profile_graph`], `profile_s` seconds) and priced both cuts.
    Profiled {
        /// The slowest stage per micro-batch of the cost model's cut, at the measured times.
        estimated_cut_s: f64,
        /// The slowest stage per micro-batch of the cut made from the measured times.
        measured_cut_s: f64,
        /// Whether the measured cut was used (it was faster by the margin).
        used_measured: bool,
        /// Seconds the profile took.
        profile_s: f64,
    },
}

/// Why [`plan_auto`] took no profile.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NoProfile {
    /// The caller did not allow it (several MPI ranks must place alike, without timing).
    NotAllowed,
    /// A device is not a CPU (the profile runs on this process's host core).
    NotCpu,
    /// Several model chunks per device (the planner's cut is not one stage per device).
    Chunks,
    /// The passes take under [`AUTO_PROFILE_MIN_STEP_S`] per micro-batch by the cost model.
    TooShort {
        /// The cost model's seconds per micro-batch (every pass of every layer).
        step_s: f64,
    },
    /// The profile would take over [`AUTO_PROFILE_BUDGET_S`].
    TooCostly {
        /// The profile's estimated seconds.
        profile_s: f64,
    },
}

/// `--placement auto`: [`plan`] from the cost model (FLOPs and bytes moved), then, on CPU devices
/// when a profile is affordable (at most [`AUTO_PROFILE_BUDGET_S`], on a model whose passes are
/// long enough to time, and `may_profile`), the layers' times measured as [`plan_by_time`] does:
/// the measured cut is used when its slowest stage is at most [`AUTO_MEASURED_MARGIN`] of the
/// estimated cut's, both priced by the profile. Where the cost model already finds the best cut
/// (as for the zoo's models) the plan is the estimated one, so runs repeat; the report says what
/// was decided and why.
pub fn plan_auto(
    graph: &Graph,
    devices: &[Device],
    config: &PipelineConfig,
    may_profile: bool,
) -> Result<(Plan, AutoPlacement)> {
    let (specs, plan_config) = planner_inputs_for(devices, config)?;
    let costs = node_costs_at(graph, plan_config.micro_batch_rows, config.precision)?;
    let estimated = place_with_costs(&costs, &specs, &plan_config)?;
    let skip = |why| Ok((estimated.clone(), AutoPlacement::Estimated(why)));
    if !may_profile {
        return skip(NoProfile::NotAllowed);
    }
    if devices.iter().any(|d| d.kind() != crate::device::DeviceKind::Cpu) {
        return skip(NoProfile::NotCpu);
    }
    if config.n_chunks > 1 || estimated.stages.len() != specs.len() {
        return skip(NoProfile::Chunks);
    }
    let rows = plan_config.micro_batch_rows as f64;
    let total_flops: f64 =
        [&costs.prefix_forward_flops, &costs.prefix_backward_input_flops, &costs.prefix_backward_weight_flops]
            .iter()
            .map(|prefix| prefix.last().copied().unwrap_or(0.0))
            .sum();
    let step_s = total_flops * rows / CPU_FLOPS_PER_S;
    if step_s < AUTO_PROFILE_MIN_STEP_S {
        return skip(NoProfile::TooShort { step_s });
    }
    let profile_s = step_s * PROFILE_REPEATS as f64;
    if profile_s > AUTO_PROFILE_BUDGET_S {
        return skip(NoProfile::TooCostly { profile_s });
    }
    let started = std::time::Instant::now();
    let times = profile_graph(graph, plan_config.micro_batch_rows, PROFILE_REPEATS)?;
    let profile_s = started.elapsed().as_secs_f64();
    let measured_costs = costs.with_measured_times(&times, CPU_FLOPS_PER_S)?;
    let measured = place_with_costs(&measured_costs, &specs, &plan_config)?;
    let stages: Vec<Vec<String>> = estimated.stages.iter().map(|s| s.node_names.clone()).collect();
    let estimated_priced = place_manually_with_costs(graph, &measured_costs, &stages, &specs, &plan_config)?;
    let (estimated_cut_s, measured_cut_s) = (estimated_priced.bottleneck_s(), measured.bottleneck_s());
    let used_measured = measured_cut_s <= AUTO_MEASURED_MARGIN * estimated_cut_s;
    let report = AutoPlacement::Profiled { estimated_cut_s, measured_cut_s, used_measured, profile_s };
    Ok((if used_measured { measured } else { estimated }, report))
}

/// The plan `placement` makes for `graph` on `devices` under `config`: `None` for
/// [`Placement::Stages`], which is used as given, unplanned.
pub fn plan_placement(
    graph: &Graph,
    devices: &[Device],
    config: &PipelineConfig,
    placement: &Placement,
) -> Result<Option<Plan>> {
    Ok(Some(match placement {
        Placement::Manual(stages) => plan_manually(graph, stages, devices, config)?,
        Placement::Auto { by: PlaceBy::Memory } => plan(graph, devices, config)?,
        Placement::Auto { by: PlaceBy::Time } => plan_by_time(graph, devices, config)?,
        Placement::File(path) => plan_manually(graph, &read_placement_file(path)?, devices, config)?,
        Placement::Stages(_) => return Ok(None),
        Placement::Plan(plan) => (**plan).clone(),
    }))
}

/// What the memory plan decided, one line per stage that dropped something to fit: the packed
/// weight caches `--weight-cache auto|on` asked for, or its commit undo snapshot (a failed
/// update then cannot be rolled back on that stage). Empty when the plan keeps everything. With
/// [`WeightCache::Off`] (the default) no stage keeps caches, which is no drop.
pub fn memory_notes(plan: &Plan) -> Vec<String> {
    let mut notes = Vec::new();
    let caches_off = plan.config.weight_cache == WeightCache::Off;
    for stage in &plan.stages {
        let mut dropped = Vec::new();
        if !stage.dropped_caches.is_empty() && !caches_off {
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
