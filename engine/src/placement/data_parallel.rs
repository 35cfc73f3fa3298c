//! A pipeline plan seen through data-parallel replicas ([`ReplicaPlan`]): what each replica's
//! device holds of the optimizer state with and without ZeRO-1, and what the gradient all-reduce
//! across the replicas moves and costs under the link model `t = latency + bytes / bandwidth`.
//!
//! The replicas run the same plan on their own devices; the runtime all-reduces every gradient
//! tensor of a stage on its own (a ring: `2 (R - 1)` messages and `2 (R - 1) / R` of the tensor
//! through each rank's link) when the stage's device reaches its optimizer step, and ZeRO-1 deals
//! each stage's layers to the replicas by parameter bytes ([`zero_owners`], the runtime's rule),
//! each keeping optimizer state (and its undo copy) for its own layers only.
use crate::collective::{CollectiveOp, cost_s};
use crate::graph::Graph;
use crate::placement::{Link, Plan};
use crate::{Error, Result};

/// The replica that owns each node under ZeRO-1, for nodes with `node_bytes` parameter bytes
/// (stage order) over `replicas`: each node in turn to the replica with the fewest bytes so far
/// (the lowest index on a tie). The runtime shards by this rule, so the plan's figures are the
/// runtime's.
pub fn zero_owners(replicas: usize, node_bytes: &[u64]) -> Vec<usize> {
    let mut load = vec![0u64; replicas.max(1)];
    node_bytes
        .iter()
        .map(|&bytes| {
            let owner = (0..load.len()).min_by_key(|&r| (load[r], r)).unwrap_or(0);
            load[owner] += bytes;
            owner
        })
        .collect()
}

/// One stage of a [`ReplicaPlan`]: the same for every replica's copy of the stage, except where
/// ZeRO-1 gives replicas different shares (then the largest share, the one a budget must hold).
#[derive(Clone, Debug, PartialEq)]
pub struct ReplicaStage {
    /// The stage.
    pub stage_idx: usize,
    /// Optimizer state on the stage's device: all of it without ZeRO, the largest replica's share
    /// with ZeRO-1.
    pub optimizer_state: u64,
    /// The commit's undo snapshot (parameters, and the optimizer state the replica keeps), or 0
    /// when the plan dropped it.
    pub commit_snapshot: u64,
    /// The stage's planned memory ([`crate::placement::StageMemory::total`]) with this optimizer
    /// state and snapshot, and the all-reduce's scratch where it exceeds what the step held.
    pub total: u64,
    /// Bytes of gradients the stage all-reduces each step (its parameters' bytes).
    pub gradient_bytes: u64,
    /// Gradient tensors, one all-reduce each.
    pub gradient_tensors: usize,
    /// Bytes through each replica's link for those all-reduces (ring: `2 (R - 1) / R` of each).
    pub all_reduce_link_bytes: f64,
    /// Predicted seconds of those all-reduces.
    pub all_reduce_s: f64,
}

/// A plan for one replica's devices, seen across `replicas` replicas ([`replica_plan`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ReplicaPlan {
    /// Replicas of the pipeline.
    pub replicas: usize,
    /// Whether ZeRO-1 shards the optimizer state across the replicas.
    pub zero: bool,
    /// The link the all-reduce was costed with.
    pub link: Link,
    /// Per stage, stage 0 first.
    pub stages: Vec<ReplicaStage>,
}

impl ReplicaPlan {
    /// Each pipeline device's all-reduce seconds (its stages' together), device 0 first, for
    /// `n_devices` devices holding stage `s` on `device_of_stage(s)`: what the schedule simulator
    /// takes as [`conveyor_schedules::CostModel::with_device_all_reduce_s`].
    pub fn device_all_reduce_s(&self, n_devices: usize, device_of_stage: impl Fn(usize) -> usize) -> Vec<f64> {
        let mut seconds = vec![0.0; n_devices];
        for stage in &self.stages {
            if let Some(slot) = seconds.get_mut(device_of_stage(stage.stage_idx)) {
                *slot += stage.all_reduce_s;
            }
        }
        seconds
    }

    /// Optimizer state on all devices of all replicas together.
    pub fn optimizer_state_in_all(&self, plan: &Plan) -> u64 {
        match self.zero {
            // Sharded: every byte of state lives on exactly one replica.
            true => plan.stages.iter().map(|s| s.memory.optimizer_state).sum(),
            false => self.replicas as u64 * plan.stages.iter().map(|s| s.memory.optimizer_state).sum::<u64>(),
        }
    }
}

/// `plan` (made for one replica's devices, from `graph`) across `replicas` data-parallel replicas,
/// with ZeRO-1 when `zero`, the all-reduces costed over `link`.
///
/// Memory: ZeRO-1 keeps on each replica the optimizer state of its own layers (by [`zero_owners`])
/// and that state's undo copy; parameters, gradients and their snapshot stay whole. The
/// all-reduce runs after the stage's last backward, when its activations are gone, and holds at
/// most two ring chunks of its largest gradient tensor (one received, one sent): the stage's
/// total grows only if that exceeds the activations, messages and scratch of the step.
pub fn replica_plan(plan: &Plan, graph: &Graph, replicas: usize, zero: bool, link: &Link) -> Result<ReplicaPlan> {
    if replicas == 0 {
        return Err(Error::invalid("replicas", "0: give at least 1 replica"));
    }
    let zero = zero && replicas > 1;
    let mut stages = Vec::with_capacity(plan.stages.len());
    for stage in &plan.stages {
        let tensor_bytes: Vec<Vec<u64>> = stage
            .nodes
            .iter()
            .map(|&id| {
                graph
                    .layer(id)
                    .map(|layer| layer.parameters().iter().map(|p| 4 * p.value.shape().numel() as u64).collect())
                    .unwrap_or_default()
            })
            .collect();
        let node_bytes: Vec<u64> = tensor_bytes.iter().map(|t| t.iter().sum()).collect();
        let gradient_bytes: u64 = node_bytes.iter().sum();
        let memory = &stage.memory;
        let (optimizer_state, commit_snapshot) = if zero && gradient_bytes > 0 {
            let owners = zero_owners(replicas, &node_bytes);
            let largest = (0..replicas)
                .map(|r| owners.iter().zip(&node_bytes).filter(|(o, _)| **o == r).map(|(_, b)| b).sum::<u64>())
                .max()
                .unwrap_or(0);
            // State is a fixed multiple of the parameters it belongs to (0, 1 or 2 buffers).
            let state = (memory.optimizer_state as u128 * largest as u128 / gradient_bytes as u128) as u64;
            let snapshot = match memory.commit_snapshot {
                0 => 0,
                kept => kept - memory.optimizer_state + state,
            };
            (state, snapshot)
        } else {
            (memory.optimizer_state, memory.commit_snapshot)
        };
        let largest_tensor = tensor_bytes.iter().flatten().copied().max().unwrap_or(0);
        let all_reduce_scratch = match replicas {
            1 => 0,
            r => 2 * largest_tensor.div_ceil(r as u64),
        };
        let step_part = memory.activations + memory.messages + memory.scratch;
        let total = memory.persistent() - memory.optimizer_state - memory.commit_snapshot
            + optimizer_state
            + commit_snapshot
            + step_part.max(all_reduce_scratch);
        let tensors = tensor_bytes.iter().flatten();
        let all_reduce_link_bytes =
            tensors.clone().map(|&b| crate::collective::traffic(CollectiveOp::AllReduce, b, replicas).bytes).sum();
        let all_reduce_s = tensors.clone().map(|&b| cost_s(CollectiveOp::AllReduce, b, replicas, link)).sum();
        stages.push(ReplicaStage {
            stage_idx: stage.stage_idx,
            optimizer_state,
            commit_snapshot,
            total,
            gradient_bytes,
            gradient_tensors: tensors.count(),
            all_reduce_link_bytes,
            all_reduce_s,
        });
    }
    Ok(ReplicaPlan { replicas, zero, link: *link, stages })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_owners_balance_bytes_in_order() {
        assert_eq!(zero_owners(2, &[100, 10, 10, 100, 0]), vec![0, 1, 1, 1, 0]);
        assert_eq!(zero_owners(1, &[5, 5]), vec![0, 0]);
        assert_eq!(zero_owners(3, &[]), Vec::<usize>::new());
    }
}
