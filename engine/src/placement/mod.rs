//! Stage placement (API Boundary): which graph nodes run on which device, manual or automatic,
//! under per-device memory budgets, with the predicted time and memory of every stage.
//!
//! A placement cuts a topological order of the graph's layer nodes into contiguous stages, stage
//! `k` on device `k`. Every edge then runs from an earlier stage to a later one (or stays inside a
//! stage), so a DAG edge that skips stages goes straight from its producer's stage to its
//! consumer's. For a chain this family is every possible placement, and the dynamic programme in
//! `auto.rs` finds the optimum of the cost model exactly.
mod auto;
mod cost;
mod manual;
mod profile;

pub use auto::{place_automatically, place_with_costs};
pub use cost::{DeviceSpec, Link, NodeCosts, OptimizerMemory, PlanConfig, StageMemory, format_bytes};
pub use manual::place_manually;
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
    /// Memory the stage needs on its device.
    pub memory: StageMemory,
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
}
