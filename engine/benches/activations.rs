//! GELU forward and backward on [4096, 128] and row softmax at widths 16, 64 and 512 (16384,
//! 4096 and 512 rows: 256 Ki elements each), one thread; PyTorch's peer is
//! `engine/benches/activations_torch.py`, and `engine/benches/activations_compare.sh` runs both in
//! interleaved rounds and prints the median per-round ratio.
//!
//! Run alone: `cargo bench -p conveyor-engine --bench activations` (prints `op ns_per_call` lines,
//! the median of 15 timed repetitions per op).
use std::hint::black_box;

use conveyor_engine::cpu::activation::{gelu_backward, gelu_forward, gelu_tanh_backward, gelu_tanh_forward};
use conveyor_engine::cpu::softmax::softmax_rows;

#[path = "support/mod.rs"]
mod support;

/// See [`support::time`].
fn time(f: impl FnMut()) -> f64 {
    support::time(f, false)
}

use support::values;

fn main() {
    let n = 4096 * 128;
    let (x, dy) = (values(n, 1.0), values(n, 1.0));
    let (mut y, mut dx) = (vec![0.0f32; n], vec![0.0f32; n]);
    let gelu_fwd = time(|| gelu_forward(black_box(&x), black_box(&mut y)).unwrap());
    let gelu_bwd = time(|| gelu_backward(black_box(&x), black_box(&dy), black_box(&mut dx)).unwrap());
    println!("gelu_fwd {gelu_fwd:.0}");
    println!("gelu_bwd {gelu_bwd:.0}");
    println!("gelu_fwd_bwd {:.0}", gelu_fwd + gelu_bwd);
    let tanh_fwd = time(|| gelu_tanh_forward(black_box(&x), black_box(&mut y)).unwrap());
    let tanh_bwd = time(|| gelu_tanh_backward(black_box(&x), black_box(&dy), black_box(&mut dx)).unwrap());
    println!("gelu_tanh_fwd_bwd {:.0}", tanh_fwd + tanh_bwd);
    for width in [16usize, 64, 512] {
        let logits = values(n / 2, 3.0);
        let mut out = vec![0.0f32; logits.len()];
        let t = time(|| softmax_rows(black_box(&logits), width, black_box(&mut out)).unwrap());
        println!("softmax{width} {t:.0}");
    }
}
