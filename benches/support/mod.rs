//! Shared by the root benchmarks: the 8x1024 MLP, its deterministic batch, and step timing.
#![allow(dead_code)]
use std::sync::Arc;
use std::time::Instant;

use conveyor::engine::graph::Graph;
use conveyor::engine::optim::OptimizerConfig;
use conveyor::engine::runtime::{StepReport, Trainer};
use conveyor::engine::{Device, Tensor};
use conveyor::layers::CrossEntropyLoss;
use conveyor::pipeline::PipelineConfig;
use conveyor::schedules::ScheduleKind;

/// Rows per batch of the throughput benchmarks.
pub const BATCH: usize = 256;
/// Width of the hidden layers.
pub const WIDTH: usize = 1024;
/// Classes of the final layer.
pub const CLASSES: usize = 10;

/// Eight Linear 1024x1024 + ReLU, then Linear 1024x10 (`mlp:1024,...,1024,10`, nine Linears).
pub fn wide_mlp_widths() -> Vec<usize> {
    let mut widths = vec![WIDTH; 9];
    widths.push(CLASSES);
    widths
}

/// The wide MLP's graph.
pub fn wide_mlp() -> Graph {
    conveyor::zoo::mlp(&wide_mlp_widths(), 7).expect("a valid MLP spec")
}

/// FLOPs of one training step of an MLP (forward, input gradient and weight gradient of every
/// Linear: 3 · 2 · rows · in · out), ignoring biases, activations and the optimizer.
pub fn mlp_step_flops(widths: &[usize], rows: usize) -> f64 {
    widths.windows(2).map(|w| 6.0 * rows as f64 * w[0] as f64 * w[1] as f64).sum()
}

/// A deterministic batch `[rows, features]` in [-1, 1) and labels in `0..classes`.
pub fn batch(rows: usize, features: usize, classes: usize) -> (Tensor, Vec<usize>) {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let values = (0..rows * features)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 20_000) as f32 / 10_000.0 - 1.0
        })
        .collect();
    let labels = (0..rows).map(|r| (r * 7 + 3) % classes).collect();
    (Tensor::from_vec(values, [rows, features], &Device::host()).unwrap(), labels)
}

/// How the throughput benchmarks run the wide MLP on a pipeline: `kind` with `n_micro_batches`,
/// one chunk, batch [`BATCH`], SGD at 0.01, no recomputation, the default slots, precision and
/// weight caches.
pub fn mlp_pipeline_config(kind: ScheduleKind, n_micro_batches: usize) -> PipelineConfig {
    PipelineConfig { n_chunks: 1, ..PipelineConfig::new(kind, n_micro_batches, BATCH) }
}

/// A one-device trainer (one micro-batch: the whole batch in one GEMM per layer).
pub fn single_device_trainer(graph: Graph, optimizer: OptimizerConfig) -> Trainer {
    Trainer::builder(graph, Arc::new(CrossEntropyLoss::new())).optimizer(optimizer).build().unwrap()
}

/// Runs `warmup` untimed steps, then `steps` timed ones; returns the step reports sorted by wall
/// time (so the median is in the middle) with each step's wall time as the coordinator saw it.
pub fn timed_steps(
    trainer: &mut Trainer,
    x: &Tensor,
    y: &[usize],
    warmup: usize,
    steps: usize,
) -> Vec<(f64, StepReport)> {
    for _ in 0..warmup {
        trainer.train_step(x, y).unwrap();
    }
    let mut timed: Vec<(f64, StepReport)> = (0..steps)
        .map(|_| {
            let started = Instant::now();
            let report = trainer.train_step(x, y).unwrap();
            (started.elapsed().as_secs_f64(), report)
        })
        .collect();
    timed.sort_by(|a, b| a.0.total_cmp(&b.0));
    timed
}

/// Number of timed steps: `CONVEYOR_BENCH_STEPS` or `default`.
pub fn steps_from_env(default: usize) -> usize {
    std::env::var("CONVEYOR_BENCH_STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}
