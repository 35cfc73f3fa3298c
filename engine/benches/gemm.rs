//! GEMM throughput of `conveyor_engine::cpu::matmul` on one core, in both weight layouts a Linear
//! layer uses. Run: `cargo bench -p conveyor-engine --bench gemm`.
//!
//! Each case multiplies `x` `[rows, 1024]` by a 1024x1024 weight, 2·rows·1024·1024 FLOPs. divan has
//! no FLOP counter, so the FLOPs are counted as items: the `item/s` column reads as FLOP/s
//! (`Gitem/s` = GFLOP/s). Compare against the core's peak (f32 FMA width x 2 x clock).
//!
//! - `x_wt`: `x · Wᵀ` with `W` `[out, in]` viewed transposed (Linear's forward, PyTorch's layout);
//! - `x_w`: `x · W` with `W` `[in, out]` row-major (the backward's `dy · W`);
//! - `dyt_x`: `dyᵀ · x` accumulated into a `[1024, 1024]` gradient (the weight gradient);
//! - `transpose_weight`: the 1024x1024 transpose Linear's `refresh` runs after every optimizer
//!   step (bytes read plus bytes written counted, so the column reads as memory bandwidth).
use conveyor_engine::cpu::transpose::transpose;
use conveyor_engine::cpu::{MatRef, matmul};
use divan::Bencher;
use divan::counter::{BytesCount, ItemsCount};

const ROWS: [usize; 3] = [32, 64, 256];
const IN: usize = 1024;
const OUT: usize = 1024;

fn main() {
    divan::main();
}

fn operands(rows: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let x = (0..rows * IN).map(|i| ((i % 97) as f32 - 48.0) / 97.0).collect();
    let w = (0..IN * OUT).map(|i| ((i % 89) as f32 - 44.0) / 890.0).collect();
    (x, w, vec![0.0; rows * OUT])
}

fn flops(rows: usize) -> ItemsCount {
    ItemsCount::new(2 * rows * IN * OUT)
}

/// `y = x · Wᵀ`, `W` `[out, in]` (transposed view, no copy).
#[divan::bench(args = ROWS)]
fn x_wt(bencher: Bencher, rows: usize) {
    let (x, w, mut y) = operands(rows);
    bencher.counter(flops(rows)).bench_local(|| {
        let x_view = MatRef::row_major(&x, rows, IN).unwrap();
        let w_t = MatRef::row_major(&w, OUT, IN).unwrap().t();
        matmul(divan::black_box(&mut y), x_view, w_t, false).unwrap();
    });
}

/// `y = x · W`, `W` `[in, out]` row-major.
#[divan::bench(args = ROWS)]
fn x_w(bencher: Bencher, rows: usize) {
    let (x, w, mut y) = operands(rows);
    bencher.counter(flops(rows)).bench_local(|| {
        let x_view = MatRef::row_major(&x, rows, IN).unwrap();
        let w_view = MatRef::row_major(&w, IN, OUT).unwrap();
        matmul(divan::black_box(&mut y), x_view, w_view, false).unwrap();
    });
}

/// `dW += dyᵀ · x`, `dy` `[rows, out]` viewed transposed, `x` `[rows, in]`: Linear's weight
/// gradient, where `rows` is the inner dimension (small micro-batches make it memory-bound).
#[divan::bench(args = ROWS)]
fn dyt_x(bencher: Bencher, rows: usize) {
    let (x, _, _) = operands(rows);
    let dy: Vec<f32> = (0..rows * OUT).map(|i| ((i % 83) as f32 - 41.0) / 830.0).collect();
    let mut dw = vec![0.0; OUT * IN];
    bencher.counter(flops(rows)).bench_local(|| {
        let dy_t = MatRef::row_major(&dy, rows, OUT).unwrap().t();
        let x_view = MatRef::row_major(&x, rows, IN).unwrap();
        matmul(divan::black_box(&mut dw), dy_t, x_view, true).unwrap();
    });
}

/// `Wᵀ` `[in, out]` from `W` `[out, in]`: Linear's transposed weight copy, rebuilt every step.
#[divan::bench]
fn transpose_weight(bencher: Bencher) {
    let (_, w, _) = operands(0);
    let mut w_t = vec![0.0; IN * OUT];
    bencher.counter(BytesCount::new(2 * 4 * IN * OUT)).bench_local(|| {
        transpose(divan::black_box(&w), OUT, IN, &mut w_t).unwrap();
    });
}

/// The same transpose over nine distinct weights in turn (36 MiB, as a step refreshes nine
/// 1024x1024 Linears), so the operands come from memory rather than cache.
#[divan::bench]
fn transpose_nine_weights(bencher: Bencher) {
    let weights: Vec<Vec<f32>> = (0..9).map(|_| operands(0).1).collect();
    let mut outputs = vec![vec![0.0; IN * OUT]; 9];
    bencher.counter(BytesCount::new(9 * 2 * 4 * IN * OUT)).bench_local(|| {
        for (w, w_t) in weights.iter().zip(&mut outputs) {
            transpose(divan::black_box(w), OUT, IN, w_t).unwrap();
        }
    });
}
