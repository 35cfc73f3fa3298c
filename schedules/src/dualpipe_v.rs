//! DualPipe-V (DeepSeek's DualPipe folded onto a V, as in its `dualpipev.py` and PyTorch's
//! `ScheduleDualPipeV`): two chunks per device placed in a V, chunk 0 of device `r` being stage
//! `r` and chunk 1 stage `2p - 1 - r`.
//!
//! Each device runs eight phases; with `p` devices, `m >= 2p` micro-batches and `r` the device:
//!
//! | phase | repeats | ops |
//! |-------|---------|-----|
//! | 1 `nF0` | `2 (p - r - 1)` | forward chunk 0 |
//! | 2 `nF0F1` | `r + 1` | forward chunk 0, forward chunk 1 |
//! | 3 `nB1W1F1` | `p - r - 1` | split backward chunk 1 (`B`, then its `W`), forward chunk 1 |
//! | 4 `nF0B1F1B0` | `m - 2p + r + 1` | forward chunk 0 with backward chunk 1, forward chunk 1 with backward chunk 0 |
//! | 5 `nB1F1B0` | `p - r - 1` | backward chunk 1, forward chunk 1 with backward chunk 0 |
//! | 6 `nB1B0` | `r + 1` | backward chunk 1, backward chunk 0; the second half split (`B` now, `W` later) |
//! | 7 `nWB0` | `p - r - 1` | a deferred `W`, split backward chunk 0 |
//! | 8 `nW` | `r + 1` | the remaining deferred `W`s |
//!
//! DualPipe overlaps a forward and a backward of different micro-batches on two CUDA streams
//! ("forward chunk 0 with backward chunk 1"). The runtime runs one op at a time per device, so
//! here the pair is two adjacent instructions, the forward first: the communication of one hides
//! behind the compute of the other only as far as the channels let the sender run ahead, and the
//! pairing shows as a forward and a backward side by side in the timeline. A fused "overlapped
//! F + B" instruction would add nothing on one core, so there is none. Backwards outside the
//! split phases are fused (`Backward`); deferred `W`s run in the order of their `B`s, so each
//! stage walks its weight passes in micro-batch order.
use std::collections::VecDeque;

use crate::instruction::Instruction;
use crate::layout::StageLayout;

/// Per-device programs; needs `n_micro_batches >= 2 n_devices` (checked by `Schedule::new`).
pub(crate) fn programs(n_devices: usize, n_micro_batches: usize) -> Vec<Vec<Instruction>> {
    (0..n_devices).map(|device_idx| RankProgram::new(device_idx, n_devices).program(n_micro_batches)).collect()
}

/// One device's (rank's, in DualPipe's words) program under construction.
struct RankProgram {
    stages: [usize; 2],
    next_forward: [usize; 2],
    next_backward: [usize; 2],
    deferred_weights: VecDeque<Instruction>,
    program: Vec<Instruction>,
    n_devices: usize,
    rank: usize,
}

impl RankProgram {
    fn new(rank: usize, n_devices: usize) -> RankProgram {
        let stage = |chunk_idx| StageLayout::V.stage_of(rank, chunk_idx, n_devices);
        RankProgram {
            stages: [stage(0), stage(1)],
            next_forward: [0; 2],
            next_backward: [0; 2],
            deferred_weights: VecDeque::new(),
            program: Vec::new(),
            n_devices,
            rank,
        }
    }

    fn forward(&mut self, chunk_idx: usize) {
        let micro_batch_idx = self.next_forward[chunk_idx];
        self.next_forward[chunk_idx] += 1;
        self.program.push(Instruction::Forward { micro_batch_idx, stage_idx: self.stages[chunk_idx] });
    }

    /// The next backward of `chunk_idx`: fused, or split with its `W` deferred.
    fn backward(&mut self, chunk_idx: usize, split: bool) {
        let micro_batch_idx = self.next_backward[chunk_idx];
        self.next_backward[chunk_idx] += 1;
        let stage_idx = self.stages[chunk_idx];
        if split {
            self.program.push(Instruction::BackwardInput { micro_batch_idx, stage_idx });
            self.deferred_weights.push_back(Instruction::BackwardWeight { micro_batch_idx, stage_idx });
        } else {
            self.program.push(Instruction::Backward { micro_batch_idx, stage_idx });
        }
    }

    fn weight(&mut self) {
        let weight = self.deferred_weights.pop_front().expect("a W is deferred before it is run");
        self.program.push(weight);
    }

    fn program(mut self, n_micro_batches: usize) -> Vec<Instruction> {
        let (p, r) = (self.n_devices, self.rank);
        for _ in 0..2 * (p - r - 1) {
            self.forward(0);
        }
        for _ in 0..r + 1 {
            self.forward(0);
            self.forward(1);
        }
        for _ in 0..p - r - 1 {
            self.backward(1, true);
            self.weight();
            self.forward(1);
        }
        for _ in 0..n_micro_batches + r + 1 - 2 * p {
            self.forward(0);
            self.backward(1, false);
            self.forward(1);
            self.backward(0, false);
        }
        for _ in 0..p - r - 1 {
            self.backward(1, false);
            self.forward(1);
            self.backward(0, false);
        }
        let n_drain = r + 1;
        let mut split = false;
        for i in 0..n_drain {
            if i == n_drain / 2 && r % 2 == 1 {
                split = true;
            }
            self.backward(1, split);
            if i == n_drain / 2 && r % 2 == 0 {
                split = true;
            }
            self.backward(0, split);
        }
        for _ in 0..p - r - 1 {
            self.weight();
            self.backward(0, true);
        }
        while !self.deferred_weights.is_empty() {
            self.weight();
        }
        debug_assert_eq!((self.next_forward, self.next_backward), ([n_micro_batches; 2], [n_micro_batches; 2]));
        self.program.push(Instruction::OptimizerStep);
        self.program
    }
}
