//! One training step of the 8x1024 MLP (batch 256, SGD) on one CPU device, in samples/s.
//! Run: `cargo bench --bench training`.
//!
//! The model is eight Linear 1024x1024 + ReLU and a final Linear 1024x10; a step is about
//! 12.9 GFLOP (3 · 2 · 256 · 1024² per wide layer), so at a core's GEMM rate of ~100 GFLOP/s a step
//! takes ~130 ms. divan counts the batch's rows as items: `item/s` reads as samples/s.
#[path = "support/mod.rs"]
mod support;

use conveyor::engine::optim::OptimizerConfig;
use divan::Bencher;
use divan::counter::ItemsCount;
use support::{BATCH, CLASSES, WIDTH};

fn main() {
    divan::main();
}

/// One `Trainer::train_step` (forward, backward, SGD update) on one device, one micro-batch.
#[divan::bench(sample_count = 10, sample_size = 1)]
fn train_step_one_device(bencher: Bencher) {
    let mut trainer = support::single_device_trainer(support::wide_mlp(), OptimizerConfig::sgd(0.01));
    let (x, y) = support::batch(BATCH, WIDTH, CLASSES);
    trainer.train_step(&x, &y).unwrap();
    bencher.counter(ItemsCount::new(BATCH)).bench_local(|| trainer.train_step(&x, &y).unwrap());
}
