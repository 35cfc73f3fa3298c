//! 1F1B (PipeDream-Flush): warm-up forwards, a steady phase alternating one forward with one
//! fused backward, then the cool-down backwards.
//!
//! Stage `s` of `p` runs `min(m, p - s - 1)` warm-up forwards. Each steady step runs one forward
//! before one backward, so stage `s` holds at most `min(m, p - s)` micro-batches' activations.
use crate::instruction::Instruction;

/// Per-device programs for `n_devices` stages (one per device) and `n_micro_batches`.
pub(crate) fn programs(n_devices: usize, n_micro_batches: usize) -> Vec<Vec<Instruction>> {
    (0..n_devices).map(|stage_idx| program(stage_idx, n_devices, n_micro_batches)).collect()
}

/// The program of one stage; `n_stages` is the pipeline depth.
pub(crate) fn program(stage_idx: usize, n_stages: usize, n_micro_batches: usize) -> Vec<Instruction> {
    let forward = |micro_batch_idx| Instruction::Forward { micro_batch_idx, stage_idx };
    let backward = |micro_batch_idx| Instruction::Backward { micro_batch_idx, stage_idx };
    let n_warmup = (n_stages - stage_idx - 1).min(n_micro_batches);
    let n_steady = n_micro_batches - n_warmup;
    let mut program = Vec::with_capacity(2 * n_micro_batches + 1);
    program.extend((0..n_warmup).map(forward));
    for step in 0..n_steady {
        program.push(forward(n_warmup + step));
        program.push(backward(step));
    }
    program.extend((n_steady..n_micro_batches).map(backward));
    program.push(Instruction::OptimizerStep);
    program
}
