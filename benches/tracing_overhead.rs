//! Cost of recording op spans: the 8x1024 MLP (batch 256, SGD) on two stages (1F1B, 4
//! micro-batches), one trainer built under a `TimelineLayer` subscriber and one without, stepped
//! alternately so machine drift hits both alike. Prints the median step of each and the overhead.
//! Run: `cargo bench --bench tracing_overhead` (`CONVEYOR_BENCH_STEPS=N` pairs, default 30).
#[path = "support/mod.rs"]
mod support;

use std::time::Instant;

use conveyor::engine::Device;
use conveyor::engine::optim::OptimizerConfig;
use conveyor::engine::runtime::{Recompute, Trainer};
use conveyor::engine::trace::{TimelineRecorder, timeline_filter};
use conveyor::pipeline::{PipelineConfig, build_trainer};
use conveyor::schedules::ScheduleKind;
use support::{BATCH, CLASSES, WIDTH};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;

fn trainer() -> Trainer {
    let config = PipelineConfig {
        schedule: ScheduleKind::OneFOneB,
        n_chunks: 1,
        n_micro_batches: 4,
        batch_rows: BATCH,
        optimizer: OptimizerConfig::sgd(0.01),
        recompute: Recompute::Never,
        seed: 0,
        core_slots: Default::default(),
    };
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
    let mut traced = tracing::dispatcher::with_default(&dispatch, trainer);
    let mut plain = trainer();
    let (x, y) = support::batch(BATCH, WIDTH, CLASSES);
    let (mut plain_s, mut traced_s) = (Vec::new(), Vec::new());
    for pair in 0..pairs + 2 {
        let start = Instant::now();
        traced.train_step(&x, &y).unwrap();
        let b = start.elapsed().as_secs_f64();
        let start = Instant::now();
        plain.train_step(&x, &y).unwrap();
        let a = start.elapsed().as_secs_f64();
        if pair >= 2 {
            plain_s.push(a);
            traced_s.push(b);
        }
    }
    let (plain_median, traced_median) = (median(plain_s), median(traced_s));
    println!("without tracing: median step {:.2} ms", plain_median * 1e3);
    println!("with op spans recorded: median step {:.2} ms ({} events recorded)", traced_median * 1e3, recorder.len());
    println!("overhead: {:+.2}% of step time", (traced_median / plain_median - 1.0) * 100.0);
}
