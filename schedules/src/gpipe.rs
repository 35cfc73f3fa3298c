//! GPipe: every device runs all forwards, then all fused backwards.
//!
//! Backwards run in **reverse** micro-batch order: the last stage finishes micro-batch `m - 1`'s
//! forward last, so its gradient is the first that can start, and each stage then receives
//! gradients in the order its downstream neighbour sends them. (Forward order would give the
//! same makespan with unit costs; reverse order is what autograd over a concatenated batch does.)
//! Peak in-flight activations: all `m` micro-batches on every stage.
use crate::instruction::Instruction;

/// Per-device programs for `n_devices` stages (one per device) and `n_micro_batches`.
pub(crate) fn programs(n_devices: usize, n_micro_batches: usize) -> Vec<Vec<Instruction>> {
    (0..n_devices)
        .map(|stage_idx| {
            let forwards =
                (0..n_micro_batches).map(|micro_batch_idx| Instruction::Forward { micro_batch_idx, stage_idx });
            let backwards =
                (0..n_micro_batches).rev().map(|micro_batch_idx| Instruction::Backward { micro_batch_idx, stage_idx });
            forwards.chain(backwards).chain([Instruction::OptimizerStep]).collect()
        })
        .collect()
}
