//! GEMM throughput on one core for the three products a Linear layer runs, at the row counts of
//! micro-batches (16, 32, 64, 128, 256) and a 1024x1024 weight, packed (the weight cache,
//! `--weight-cache on`) and unpacked (`off`); plus the weight transpose `refresh` runs. PyTorch's
//! peer is `engine/benches/gemm_torch.py`; `engine/benches/gemm_compare.sh` runs both in
//! interleaved rounds and prints the median per-round ratio.
//!
//! Run alone: `cargo bench -p conveyor-engine --bench gemm` (prints `op ns_per_call` lines;
//! `BENCH_ONLY=x_wt` runs the ops whose name starts so). The ops, `R` the row count:
//!
//! - `x_wt_R`: `y = x · Wᵀ`, `W` `[out, in]` viewed transposed (Linear's forward without the
//!   cache, `cpu::matmul_uninit`); `x_wt_packed_R`: the same product from `Wᵀ` in strips
//!   (`cpu::packed::matmul_packed_uninit`, the forward with the cache);
//! - `x_w_R`: `dx = dy · W`, `W` `[out, in]` row-major (the input gradient without the cache);
//!   `x_w_packed_R`: from `W` in strips (with it);
//! - `dyt_x_R`: `dW += dyᵀ · x` (`cpu::matmul` accumulating; the weight gradient, cache or not),
//!   `R` its inner dimension;
//! - `transpose_weight`, `transpose_nine_weights`: the 1024x1024 transpose, one hot weight or
//!   nine in turn (36 MiB, so they come from memory); no PyTorch peer.
//!
//! Every product is 2·R·1024·1024 FLOPs: GFLOP/s = 2·R·2²⁰ / ns.
use std::hint::black_box;
use std::mem::MaybeUninit;

use conveyor_engine::cpu::packed::{matmul_packed_uninit, pack_rhs, packed_len};
use conveyor_engine::cpu::transpose::transpose;
use conveyor_engine::cpu::{MatRef, matmul, matmul_uninit};

#[path = "support/mod.rs"]
mod support;

use support::values;

const ROWS: [usize; 5] = [16, 32, 64, 128, 256];
const IN: usize = 1024;
const OUT: usize = 1024;

fn main() {
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    let report = |op: String, f: &mut dyn FnMut()| {
        if op.starts_with(&only) {
            println!("{op} {:.0}", support::time(f, false));
        }
    };
    let w = values(OUT * IN, 0.03);
    let w_view = MatRef::row_major(&w, OUT, IN).unwrap();
    let mut forward = vec![0.0; packed_len(IN, OUT)];
    pack_rhs(w_view.t(), &mut forward).unwrap();
    let mut backward_input = vec![0.0; packed_len(OUT, IN)];
    pack_rhs(w_view, &mut backward_input).unwrap();
    for rows in ROWS {
        let x = values(rows * IN, 1.0);
        let dy = values(rows * OUT, 0.1);
        let x_view = MatRef::row_major(&x, rows, IN).unwrap();
        let dy_view = MatRef::row_major(&dy, rows, OUT).unwrap();
        let mut y = vec![MaybeUninit::uninit(); rows * OUT];
        let mut dx = vec![MaybeUninit::uninit(); rows * IN];
        report(format!("x_wt_{rows}"), &mut || {
            black_box(matmul_uninit(&mut y, x_view, w_view.t()).unwrap());
        });
        report(format!("x_wt_packed_{rows}"), &mut || {
            black_box(matmul_packed_uninit(&mut y, x_view, &forward, IN, OUT).unwrap());
        });
        report(format!("x_w_{rows}"), &mut || {
            black_box(matmul_uninit(&mut dx, dy_view, w_view).unwrap());
        });
        report(format!("x_w_packed_{rows}"), &mut || {
            black_box(matmul_packed_uninit(&mut dx, dy_view, &backward_input, OUT, IN).unwrap());
        });
        let mut dw = vec![0.0; OUT * IN];
        report(format!("dyt_x_{rows}"), &mut || {
            matmul(black_box(&mut dw), dy_view.t(), x_view, true).unwrap();
        });
    }
    let mut w_t = vec![0.0; IN * OUT];
    report("transpose_weight".into(), &mut || transpose(black_box(&w), OUT, IN, &mut w_t).unwrap());
    let weights: Vec<Vec<f32>> = (0..9).map(|_| w.clone()).collect();
    let mut outputs = vec![vec![0.0; IN * OUT]; 9];
    report("transpose_nine_weights".into(), &mut || {
        for (w, w_t) in weights.iter().zip(&mut outputs) {
            transpose(black_box(w), OUT, IN, w_t).unwrap();
        }
    });
}
