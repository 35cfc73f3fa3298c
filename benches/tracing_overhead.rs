//! Cost of recording op spans: the 8x1024 MLP (batch 256, SGD) on two stages (1F1B, 4
//! micro-batches), one trainer built under a `TimelineLayer` subscriber and one without, stepped
//! in turn. Two instances of each kind (built alternately) are pooled, since instances of one
//! kind differ by a few percent; the two untraced ones against each other give the noise floor.
//! Prints the median step of each, the overhead, and the direct cost of recording a step's ops
//! (timed on one thread), which lies below that noise.
//! Run: `cargo bench --bench tracing_overhead` (`CONVEYOR_BENCH_STEPS=N` pairs, default 30).
#[path = "support/mod.rs"]
mod support;

use std::time::Instant;

use conveyor::engine::Device;
use conveyor::engine::runtime::Trainer;
use conveyor::engine::trace::{MEMORY_TARGET, OP_TARGET, TimelineRecorder, timeline_filter};
use conveyor::pipeline::build_trainer;
use conveyor::schedules::ScheduleKind;
use support::{BATCH, CLASSES, WIDTH};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;

fn trainer() -> Trainer {
    let config = support::mlp_pipeline_config(ScheduleKind::OneFOneB, 4);
    build_trainer(support::wide_mlp(), vec![Device::cpu(0), Device::cpu(1)], &config).unwrap().1
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let pairs: usize = std::env::var("CONVEYOR_BENCH_STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(30);
    let (recorder, layer) = TimelineRecorder::new();
    let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(layer.with_filter(timeline_filter())));
    // Two trainers of each kind, built alternately: two trainers of the same kind differ by a few
    // percent (where their buffers landed), so each figure pools two instances, and the two plain
    // ones against each other give the noise floor.
    let mut trainers = [
        (true, tracing::dispatcher::with_default(&dispatch, trainer)),
        (false, trainer()),
        (false, trainer()),
        (true, tracing::dispatcher::with_default(&dispatch, trainer)),
    ];
    let (x, y) = support::batch(BATCH, WIDTH, CLASSES);
    let mut step_s: Vec<Vec<f64>> = vec![Vec::new(); trainers.len()];
    for round in 0..pairs / 2 + 2 {
        // Each trainer takes every position in turn, so the order hits all alike.
        for offset in 0..trainers.len() {
            let idx = (round + offset) % trainers.len();
            let start = Instant::now();
            trainers[idx].1.train_step(&x, &y).unwrap();
            if round >= 2 {
                step_s[idx].push(start.elapsed().as_secs_f64());
            }
        }
    }
    let pooled = |traced: bool| {
        median(trainers.iter().zip(&step_s).filter(|((t, _), _)| *t == traced).flat_map(|(_, s)| s.clone()).collect())
    };
    let (plain_s, traced_s) = (pooled(false), pooled(true));
    let noise = (median(step_s[1].clone()) / median(step_s[2].clone()) - 1.0) * 100.0;
    let (plain_median, traced_median) = (plain_s, traced_s);
    println!("without tracing: median step {:.2} ms", plain_median * 1e3);
    println!("with op spans recorded: median step {:.2} ms ({} events recorded)", traced_median * 1e3, recorder.len());
    println!("overhead: {:+.2}% of step time", (traced_median / plain_median - 1.0) * 100.0);
    println!("noise floor: the two untraced trainers differ by {noise:+.2}%");
    // The direct cost, below that noise: what recording one op (its span and the memory sample
    // after it) costs on this thread, times the ops of a step.
    let spans_per_step = recorder.len() as f64 / (2 * (pairs / 2 + 2)) as f64;
    let n = 20_000;
    let start = Instant::now();
    tracing::dispatcher::with_default(&dispatch, || {
        for i in 0..n {
            let span = tracing::info_span!(
                target: OP_TARGET, "op", device = 0u64, stage = 0u64, op = "forward", micro_batch = i as u64
            )
            .entered();
            drop(span);
            tracing::trace!(target: MEMORY_TARGET, device = 0u64, bytes = i as u64);
        }
    });
    let per_op_s = start.elapsed().as_secs_f64() / n as f64;
    println!(
        "direct: {:.2} µs per recorded op x {spans_per_step:.0} ops per step (both devices) = {:.3}% of the step",
        per_op_s * 1e6,
        per_op_s * spans_per_step / 2.0 / traced_median * 100.0
    );
}
