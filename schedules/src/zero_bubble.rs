//! Zero Bubble ZB-H1 and ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023), built by
//! greedy list scheduling over a unit-cost simulation.
//!
//! Backward is split into `BackwardInput` (`B`, on the critical path: stage `s - 1` waits for
//! it) and `BackwardWeight` (`W`, needed only by the optimizer step), so `W`s can fill bubbles.
//! The construction steps time in units of one op (`F = B = W = 1`, free communication); whenever
//! a stage is free it picks, in priority order:
//!
//! 1. the `F` of its next micro-batch whose activation has arrived, if both memory caps allow;
//! 2. the `B` of its oldest micro-batch whose gradient has arrived (micro-batch order);
//! 3. the `W` of its oldest micro-batch whose `B` is done;
//! 4. otherwise it idles.
//!
//! Forward first, as in 1F1B's steady "one forward, then one backward": the last micro-batch's
//! forward chain followed by its `B` chain is the critical path of the drain, and a stage that
//! ran a ready `B` ahead of a ready `F` delays it (with `B` first, ZB-H1 at `p = 4, m = 8` idles
//! 5 units per device instead of 3). `W`s only ever fill time nothing else can use.
//!
//! Two caps bound memory on stage `s` of `p`, with `m` micro-batches:
//!
//! | variant | `F` done, `B` not done | `F` done, `W` not done ("in flight") |
//! |---------|------------------------|--------------------------------------|
//! | ZB-H1   | `min(m, p - s)` (1F1B's) | `min(m, p)` (1F1B's peak, stage 0's) |
//! | ZB-H2   | `min(m, 2(p - s) - 1)`   | `min(m, 2p - 1)`                     |
//!
//! ZB-H1 keeps every stage within 1F1B's peak of `p` micro-batches, letting later stages hold
//! finished-`B` micro-batches until a `W` fits (1F1B's per-stage profile `p - s` would force
//! twice the bubble; README.md gives the argument). ZB-H2 runs up to `2(p - s) - 1` warm-up
//! forwards so stage `s` never waits for its first gradient, and holds about twice 1F1B's
//! memory. The result is recorded as a static program per device; the tests validate every
//! shape up to `p = 8, m = 32` at channel capacity 1, and callers validate larger ones.
use std::collections::VecDeque;

use crate::instruction::Instruction;

/// Which handcrafted Zero Bubble schedule to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Variant {
    /// 1F1B's memory, bubble `(p - 1)(F + B - W)`.
    H1,
    /// About 2x 1F1B's memory, no bubble inside a device's busy span once `m >= 2p - 1`.
    H2,
}

impl Variant {
    /// (cap on micro-batches between F and B, cap on micro-batches between F and W) for a stage.
    pub(crate) fn caps(self, stage_idx: usize, n_stages: usize, n_micro_batches: usize) -> (usize, usize) {
        let (before_b, before_w) = match self {
            Variant::H1 => (n_stages - stage_idx, n_stages),
            Variant::H2 => (2 * (n_stages - stage_idx) - 1, 2 * n_stages - 1),
        };
        (before_b.min(n_micro_batches), before_w.min(n_micro_batches))
    }
}

/// Per-stage scheduling state of the unit-cost construction.
struct StageState {
    next_forward: usize,
    next_backward: usize,
    n_weights_done: usize,
    pending_weights: VecDeque<usize>,
    busy_until: usize,
    program: Vec<Instruction>,
}

/// Per-device programs (one stage per device).
pub(crate) fn programs(variant: Variant, n_stages: usize, n_micro_batches: usize) -> Vec<Vec<Instruction>> {
    // End times (in units) of each stage's F and B per micro-batch.
    let mut forward_end = vec![vec![usize::MAX; n_micro_batches]; n_stages];
    let mut backward_end = vec![vec![usize::MAX; n_micro_batches]; n_stages];
    let mut stages: Vec<StageState> = (0..n_stages)
        .map(|_| StageState {
            next_forward: 0,
            next_backward: 0,
            n_weights_done: 0,
            pending_weights: VecDeque::new(),
            busy_until: 0,
            program: Vec::with_capacity(3 * n_micro_batches + 1),
        })
        .collect();
    let n_ops = 3 * n_micro_batches;
    let mut time = 0;
    while stages.iter().any(|stage| stage.program.len() < n_ops) {
        for stage_idx in 0..n_stages {
            let (cap_before_b, cap_before_w) = variant.caps(stage_idx, n_stages, n_micro_batches);
            let stage = &mut stages[stage_idx];
            if stage.busy_until > time || stage.program.len() == n_ops {
                continue;
            }
            let backward_idx = stage.next_backward;
            let gradient_ready = backward_idx < stage.next_forward
                && if stage_idx + 1 == n_stages {
                    forward_end[stage_idx][backward_idx] <= time
                } else {
                    backward_end[stage_idx + 1][backward_idx] <= time
                };
            let forward_idx = stage.next_forward;
            let forward_ready = forward_idx < n_micro_batches
                && (stage_idx == 0 || forward_end[stage_idx - 1][forward_idx] <= time)
                && forward_idx - stage.next_backward < cap_before_b
                && forward_idx - stage.n_weights_done < cap_before_w;
            let instruction = if forward_ready {
                stage.next_forward += 1;
                forward_end[stage_idx][forward_idx] = time + 1;
                Instruction::Forward { micro_batch_idx: forward_idx, stage_idx }
            } else if gradient_ready {
                stage.next_backward += 1;
                stage.pending_weights.push_back(backward_idx);
                backward_end[stage_idx][backward_idx] = time + 1;
                Instruction::BackwardInput { micro_batch_idx: backward_idx, stage_idx }
            } else if let Some(micro_batch_idx) = stage.pending_weights.pop_front() {
                stage.n_weights_done += 1;
                Instruction::BackwardWeight { micro_batch_idx, stage_idx }
            } else {
                continue;
            };
            stage.program.push(instruction);
            stage.busy_until = time + 1;
        }
        time += 1;
        debug_assert!(time <= 4 * n_ops + 4 * n_stages, "zero-bubble construction made no progress");
    }
    stages
        .into_iter()
        .map(|mut stage| {
            stage.program.push(Instruction::OptimizerStep);
            stage.program
        })
        .collect()
}
