//! Megatron's interleaved 1F1B over `v = n_chunks` virtual stages per device.
//!
//! Device `d` holds stages `d, d + p, .., d + (v - 1) p`. Its `k`-th forward (counting all
//! chunks) is chunk `(k mod p v) / p` of micro-batch `(k / (p v)) p + k mod p`: micro-batches
//! enter in groups of `p` and each group passes through chunk 0, then chunk 1, and so on. The
//! `k`-th backward walks the chunks in reverse order. Device `d` runs
//! `min(m v, 2 (p - d - 1) + (v - 1) p)` warm-up forwards, then alternates one forward and one
//! fused backward, then drains the remaining backwards — Megatron-LM's
//! `forward_backward_pipelining_with_interleaving`. It needs `m` to be a multiple of `p`.
//!
//! With one chunk there is nothing to interleave and the schedule is plain 1F1B (as in Megatron,
//! which only interleaves when `v > 1`).
use crate::instruction::Instruction;
use crate::one_f_one_b;

/// Per-device programs; requires `n_micro_batches % n_devices == 0` when `n_chunks > 1`.
pub(crate) fn programs(n_devices: usize, n_micro_batches: usize, n_chunks: usize) -> Vec<Vec<Instruction>> {
    if n_chunks == 1 {
        return one_f_one_b::programs(n_devices, n_micro_batches);
    }
    debug_assert_eq!(n_micro_batches % n_devices, 0);
    (0..n_devices).map(|device_idx| program(device_idx, n_devices, n_micro_batches, n_chunks)).collect()
}

fn program(device_idx: usize, n_devices: usize, n_micro_batches: usize, n_chunks: usize) -> Vec<Instruction> {
    let group = n_devices * n_chunks;
    let n_total = n_micro_batches * n_chunks;
    // The `k`-th op of one direction on this device, as (micro-batch, stage).
    let locate = |k: usize, forward: bool| {
        let chunk_in_order = (k % group) / n_devices;
        let chunk_idx = if forward { chunk_in_order } else { n_chunks - 1 - chunk_in_order };
        let micro_batch_idx = (k / group) * n_devices + k % n_devices;
        (micro_batch_idx, chunk_idx * n_devices + device_idx)
    };
    let forward = |k| {
        let (micro_batch_idx, stage_idx) = locate(k, true);
        Instruction::Forward { micro_batch_idx, stage_idx }
    };
    let backward = |k| {
        let (micro_batch_idx, stage_idx) = locate(k, false);
        Instruction::Backward { micro_batch_idx, stage_idx }
    };
    let n_warmup = (2 * (n_devices - device_idx - 1) + (n_chunks - 1) * n_devices).min(n_total);
    let n_steady = n_total - n_warmup;
    let mut program = Vec::with_capacity(2 * n_total + 1);
    program.extend((0..n_warmup).map(forward));
    for step in 0..n_steady {
        program.push(forward(n_warmup + step));
        program.push(backward(step));
    }
    program.extend((n_steady..n_total).map(backward));
    program.push(Instruction::OptimizerStep);
    program
}
