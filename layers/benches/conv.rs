//! Convolution kernels one at a time: `Conv2d`'s forward, input gradient and weight gradient
//! (with the bias gradient) on the zoo's 3x3 padding-1 shapes, batch 256, on one core.
//! Run: `cargo bench -p conveyor-layers --bench conv -- [--reps N]`; the PyTorch peer is
//! `layers/benches/conv_torch.py` and `layers/benches/conv_compare.py` runs both in interleaved
//! rounds and prints the median per-round speed ratio (Conveyor / PyTorch).
//!
//! Output: one line per case, `in->out@HxW op median_us`, the median of `reps` timed calls after one
//! warm-up call. A plain `main` (no divan) so that the comparison script can parse one line per case.
use std::time::Instant;

use conveyor_engine::{DType, Device, ForwardCtx, Layer, Tensor, init};
use conveyor_layers::{Conv2d, Conv2dOptions};
use rand::RngExt;

/// Samples per batch.
const BATCH: usize = 256;
/// (in_channels, out_channels, plane side): ResNet's 1→8, 8→8 and CNN's 1→16, 16→32 on the 8x8
/// digits, and the same convolutions on 32x32.
const CASES: [(usize, usize, usize); 8] =
    [(1, 8, 8), (8, 8, 8), (1, 16, 8), (16, 32, 8), (1, 8, 32), (8, 8, 32), (1, 16, 32), (16, 32, 32)];

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let reps = args
        .iter()
        .position(|a| a == "--reps")
        .and_then(|i| args.get(i + 1))
        .and_then(|r| r.parse().ok())
        .unwrap_or(7usize);
    let host = Device::host();
    let mut rng = init::rng(1);
    for (cin, cout, side) in CASES {
        let options = Conv2dOptions { padding: (1, 1), ..Conv2dOptions::default() };
        let conv = Conv2d::new(cin, cout, (3, 3), options, &mut rng).unwrap();
        let n = BATCH * cin * side * side;
        let x =
            Tensor::from_vec((0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect(), [BATCH, cin, side, side], &host)
                .unwrap();
        let ctx = ForwardCtx::train(0);
        let (y, saved) = conv.forward(&[&x], &ctx).unwrap();
        let dy = Tensor::from_vec(
            (0..y.numel()).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
            y.dims().to_vec(),
            &host,
        )
        .unwrap();
        let mut grads: Vec<Tensor> = conv
            .parameters()
            .iter()
            .map(|p| Tensor::zeros(p.value.shape().clone(), DType::F32, &host).unwrap())
            .collect();
        let name = format!("{cin}->{cout}@{side}x{side}");
        report(&name, "forward", reps, || drop(std::hint::black_box(conv.forward(&[&x], &ctx).unwrap())));
        report(&name, "input_grad", reps, || drop(std::hint::black_box(conv.backward_input(&saved, &dy).unwrap())));
        report(&name, "weight_grad", reps, || conv.backward_weight(&saved, &dy, &mut grads).unwrap());
    }
}

/// Prints the median time of `reps` calls of `f` after one warm-up call.
fn report(name: &str, op: &str, reps: usize, mut f: impl FnMut()) {
    f();
    let mut times: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    times.sort_by(f64::total_cmp);
    println!("{name} {op} {:.1}", times[times.len() / 2]);
}
