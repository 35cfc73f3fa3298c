//! GPipe: every device runs all forwards, then all fused backwards.
//!
//! Backwards run in **forward** micro-batch order (0 first): every forward is done before any
//! backward, so micro-batch 0's gradient can start as soon as the last stage finishes its forwards,
//! and each stage receives gradients in the order its downstream neighbour sends them. The
//! makespan is the same as with reverse order; forward order is what lets the runtime accumulate
//! weight gradients in micro-batch order (bit-identical to every other schedule) while freeing each
//! micro-batch's activations right after its backward, which recomputation relies on.
//! Peak in-flight activations: all `m` micro-batches on every stage.
use crate::instruction::Instruction;

/// Per-device programs for `n_devices` stages (one per device) and `n_micro_batches`.
pub(crate) fn programs(n_devices: usize, n_micro_batches: usize) -> Vec<Vec<Instruction>> {
    (0..n_devices)
        .map(|stage_idx| {
            let forwards =
                (0..n_micro_batches).map(|micro_batch_idx| Instruction::Forward { micro_batch_idx, stage_idx });
            let backwards =
                (0..n_micro_batches).map(|micro_batch_idx| Instruction::Backward { micro_batch_idx, stage_idx });
            forwards.chain(backwards).chain([Instruction::OptimizerStep]).collect()
        })
        .collect()
}
