//! GELU forward and backward on [4096, 128] and row softmax at widths 16, 64 and 512 (16384,
//! 4096 and 512 rows: 256 Ki elements each), one thread; PyTorch's peer is
//! `engine/benches/activations_torch.py`, and `engine/benches/activations_compare.sh` runs both in
//! interleaved rounds and prints the median per-round ratio.
//!
//! Run alone: `cargo bench -p conveyor-engine --bench activations` (prints `op ns_per_call` lines,
//! the median of 15 timed repetitions per op).
use std::hint::black_box;
use std::time::Instant;

use conveyor_engine::cpu::activation::{gelu_backward, gelu_forward, gelu_tanh_backward, gelu_tanh_forward};
use conveyor_engine::cpu::softmax::softmax_rows;

/// Median nanoseconds per call of `f`, over 15 repetitions of enough calls to fill ~20 ms.
fn time(mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    f();
    let once = start.elapsed().as_secs_f64().max(1e-7);
    let calls = ((0.02 / once) as usize).clamp(1, 10_000);
    let mut samples: Vec<f64> = (0..15)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..calls {
                f();
            }
            start.elapsed().as_secs_f64() * 1e9 / calls as f64
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn values(n: usize, scale: f32) -> Vec<f32> {
    // A fixed pseudo-random sequence (xorshift), roughly normal by summing uniforms.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    (0..n).map(|_| ((0..4).map(|_| uniform()).sum::<f32>() - 2.0) * scale * 1.73).collect()
}

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
