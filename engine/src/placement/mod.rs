//! Stage placement (API Boundary): which graph nodes run on which device, manual or automatic,
//! under per-device memory budgets, with the predicted time and memory of every stage.
//!
//! A placement cuts a topological order of the graph's layer nodes into contiguous stages, stage
//! `k` on device `k`. Every edge then runs from an earlier stage to a later one (or stays inside a
//! stage), so a DAG edge that skips stages goes straight from its producer's stage to its
//! consumer's. For a chain this family is every possible placement, and the dynamic programme in
//! `auto.rs` finds the optimum of the cost model exactly.
//!
//! Memory (`memory/`, argued in `memory/README.md`): a stage's figure bounds everything the
//! runtime reserves for it on its device during a step, and is tight: parameters, gradients,
//! optimizer state, the commit's undo snapshot, layers' derived caches, and the most held at any
//! instruction of the schedule by activations, waiting messages and data, and the running op.
//! The snapshot and the caches are optional: the plan keeps the snapshot when it fits, then as
//! many caches as fit (largest FLOPs first), and reports what it dropped.
//!
//! A run chooses its stages with a [`Placement`] (by hand, a placement file, or automatically by
//! predicted memory and FLOPs or by measured times); `pipeline_plan.rs` turns it, the devices and
//! the run's settings ([`PipelineConfig`]) into a [`Plan`], and `file.rs` reads placement files.
mod auto;
mod auto_schedule;
mod cost;
mod data_parallel;
mod file;
mod fit;
mod manual;
mod memory;
pub mod pipeline_plan;
mod profile;

pub use auto::{place_automatically, place_with_costs};
pub use auto_schedule::{PlannedCandidate, ScheduleCandidate, ScheduleChoice, choose_schedule, predicted_costs};
pub use cost::{
    DeviceSpec, FLOPS_PER_BYTE_MOVED, Link, NodeCosts, OptimizerMemory, PlanConfig, StageMemory, WeightCache,
    format_bytes, format_seconds,
};
pub use data_parallel::{ReplicaPlan, ReplicaStage, replica_plan, zero_owners};
pub use file::{MAX_PLACEMENT_FILE_BYTES, MAX_STAGES, PlacementFileProblem, parse_placement, read_placement_file};
pub(crate) use fit::DoesNotFitMessage;
pub use fit::{FitHint, MemoryBreakdown, PlacedBy, StageFit};
pub use manual::{place_manually, place_manually_with_costs};
pub use memory::{
    InputGradMemory, NodeMemory, OutputMemory, OwnLossMemory, Rank, SavedMemory, ScheduleMemory, measure_node_memory,
    measure_node_memory_at, measure_node_memory_on, measure_node_memory_on_cross_entropy,
    measure_node_memory_on_device,
};
pub use pipeline_plan::{
    AutoPlacement, CPU_FLOPS_PER_S, NoProfile, PipelineConfig, PlaceBy, Placement, plan_auto, plan_placement,
};
pub use profile::{NodeTimes, profile_graph};

use crate::graph::NodeId;

/// One stage of a [`Plan`].
#[derive(Clone, Debug)]
pub struct StagePlan {
    /// Position in the pipeline, 0 first.
    pub stage_idx: usize,
    /// Index into the plan's devices. A tensor-parallel group is one planner device
    /// ([`DeviceSpec::group`]); the runtime maps it to its `k` devices.
    pub device_idx: usize,
    /// The layer nodes of the stage, in execution order.
    pub nodes: Vec<NodeId>,
    /// Their names, for reports.
    pub node_names: Vec<String>,
    /// Number of parameters (elements).
    pub n_params: u64,
    /// Memory the stage needs on its device (with tensor parallelism: on its group's first device).
    pub memory: StageMemory,
    /// With tensor parallelism, the memory on the other devices of the group (second first);
    /// empty otherwise.
    pub member_memory: Vec<StageMemory>,
    /// Per node (aligned with `nodes`): whether it keeps the caches it derives from its
    /// parameters (`Layer::set_derived_cache`); false for nodes whose caches were dropped to
    /// fit, and for nodes without any.
    pub derived_caches: Vec<bool>,
    /// Names of the nodes whose derived caches the plan dropped to fit.
    pub dropped_caches: Vec<String>,
    /// Per device of the stage (one without tensor parallelism), per instruction of its
    /// device's program: the bytes held beyond the persistent ones (activations, messages,
    /// the running op). Stages sharing a device (interleaved chunks) add up moment by moment.
    pub memory_timeline: Vec<Vec<u64>>,
    /// Predicted forward time of one micro-batch, seconds (compute plus incoming transfers).
    pub forward_s: f64,
    /// Predicted input-gradient time of one micro-batch, seconds.
    pub backward_input_s: f64,
    /// Predicted weight-gradient time of one micro-batch, seconds.
    pub backward_weight_s: f64,
    /// Predicted transfer time of one micro-batch's activations and gradients crossing this
    /// stage's boundaries, seconds (included in the times above).
    pub transfer_s: f64,
}

impl StagePlan {
    /// Forward plus backward time of one micro-batch: the stage's share of the bottleneck.
    pub fn time_per_micro_batch_s(&self) -> f64 {
        self.forward_s + self.backward_input_s + self.backward_weight_s
    }

    /// The largest need among the stage's devices.
    pub fn largest_total(&self) -> u64 {
        std::iter::once(&self.memory).chain(&self.member_memory).map(StageMemory::total).max().unwrap_or(0)
    }

    /// The stage's memory on each of its devices (one without tensor parallelism).
    pub fn device_memory(&self) -> impl Iterator<Item = &StageMemory> {
        std::iter::once(&self.memory).chain(&self.member_memory)
    }

    /// Whether the stage keeps the commit's undo snapshot.
    pub fn keeps_commit_snapshot(&self) -> bool {
        self.device_memory().all(|m| m.commit_snapshot_dropped == 0)
    }
}

/// A placement of a graph's nodes onto stages and devices, with predictions.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The stages, stage 0 first.
    pub stages: Vec<StagePlan>,
    /// The devices the plan was made for.
    pub devices: Vec<DeviceSpec>,
    /// The settings the plan was made with.
    pub config: PlanConfig,
}

impl Plan {
    /// The slowest stage's time per micro-batch (what automatic placement minimises).
    pub fn bottleneck_s(&self) -> f64 {
        self.stages.iter().map(StagePlan::time_per_micro_batch_s).fold(0.0, f64::max)
    }

    /// The stage each node runs on, as `(node, stage_idx)` pairs.
    pub fn stage_of_nodes(&self) -> Vec<(NodeId, usize)> {
        self.stages.iter().flat_map(|s| s.nodes.iter().map(move |&n| (n, s.stage_idx))).collect()
    }

    /// Per node: whether it keeps its derived caches (for `TrainerBuilder::derived_caches`).
    pub fn derived_caches(&self) -> Vec<(NodeId, bool)> {
        self.stages.iter().flat_map(|s| s.nodes.iter().copied().zip(s.derived_caches.iter().copied())).collect()
    }

    /// Per stage: whether it keeps the commit's undo snapshot (for `TrainerBuilder::commit_snapshot`).
    pub fn commit_snapshots(&self) -> Vec<bool> {
        self.stages.iter().map(StagePlan::keeps_commit_snapshot).collect()
    }

    /// The planned peak of each pipeline device (a device group with tensor parallelism), per
    /// device of the group: the persistent bytes of its stages plus the busiest moment of their
    /// timelines added moment by moment (stage `s` on the schedule's device of it, from the plan's
    /// schedule, else `s % n_devices`). This is what the runtime's `StepReport::peak_memory` is
    /// bounded by.
    pub fn device_peaks(&self, n_devices: usize) -> Vec<Vec<u64>> {
        let n_devices = n_devices.max(1);
        let schedule = self.config.schedule.as_ref().filter(|s| {
            s.n_stages() == self.stages.len() && (0..s.n_stages()).all(|t| s.device_of_stage(t) < n_devices)
        });
        let device_of = |stage_idx: usize| schedule.map_or(stage_idx % n_devices, |s| s.device_of_stage(stage_idx));
        let n_ranks = self.stages.iter().map(|s| 1 + s.member_memory.len()).max().unwrap_or(1);
        (0..n_devices)
            .map(|device| {
                let stages: Vec<&StagePlan> = self.stages.iter().filter(|s| device_of(s.stage_idx) == device).collect();
                (0..n_ranks)
                    .map(|rank| {
                        let persistent: u64 = stages
                            .iter()
                            .filter_map(|s| s.device_memory().nth(rank))
                            .map(StageMemory::persistent)
                            .sum();
                        let timelines: Vec<&Vec<u64>> =
                            stages.iter().filter_map(|s| s.memory_timeline.get(rank)).collect();
                        let len = timelines.iter().map(|t| t.len()).max().unwrap_or(0);
                        let busiest = (0..len)
                            .map(|i| timelines.iter().map(|t| t.get(i).copied().unwrap_or(0)).sum::<u64>())
                            .max()
                            .unwrap_or(0);
                        persistent + busiest
                    })
                    .collect()
            })
            .collect()
    }
}
