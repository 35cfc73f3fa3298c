//! See the bubbles: simulate a schedule, then run it for real on two CPU devices, and write both
//! timelines as SVG Gantt charts side by side with their bubble fractions.
//!
//! Run: `cargo run --release --example bubbles [SCHEDULE] [OUT_DIR]`
//! (default `1f1b` and the current directory); writes `bubbles-simulated.svg` and
//! `bubbles-measured.svg`.
use std::path::PathBuf;

use conveyor::data;
use conveyor::engine::Device;
use conveyor::engine::trace::{TimelineRecorder, timeline_filter};
use conveyor::pipeline::{PipelineConfig, build_trainer};
use conveyor::schedules::export::{SvgOptions, svg_gantt};
use conveyor::schedules::{CostModel, Schedule, ScheduleKind, StageCosts, simulate};
use conveyor::zoo::mlp;
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let kind: ScheduleKind = args.next().as_deref().unwrap_or("1f1b").parse()?;
    let out_dir = PathBuf::from(args.next().unwrap_or_else(|| ".".into()));
    let (n_devices, n_micro_batches) = (2, 8);

    // Record every op the workers run, through `tracing`.
    let (recorder, layer) = TimelineRecorder::new();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer.with_filter(timeline_filter())))?;

    // 1. The schedule's promise, with equal op costs.
    let schedule = Schedule::new(kind, n_devices, n_micro_batches, 1)?;
    let simulated = simulate(&schedule, &CostModel::uniform(StageCosts::UNIT))?;
    let title = format!("{kind}, p={n_devices}, m={n_micro_batches}, simulated (F = B = W = 1)");
    let path = out_dir.join("bubbles-simulated.svg");
    std::fs::write(&path, svg_gantt(&simulated.timeline, &SvgOptions { title, ..SvgOptions::default() }))?;
    println!("simulated bubble {:.1}% -> {}", simulated.bubble_fraction * 100.0, path.display());

    // 2. The same schedule, measured: an MLP of 1024-wide layers on two CPU devices.
    let config = PipelineConfig { n_chunks: 1, ..PipelineConfig::new(kind, n_micro_batches, 256) };
    let devices = vec![Device::cpu(0), Device::cpu(1)];
    let (_, mut trainer) = build_trainer(mlp(&[256, 1024, 1024, 1024, 1024, 1024, 10], 0)?, devices, &config)?;
    let train = data::synthetic(256, 256, 10, 0)?;
    let (x, y) = train.batch(&(0..256).collect::<Vec<_>>())?;
    for _ in 0..3 {
        trainer.train_step(&x, &y)?; // warm up
    }
    let start = recorder.now_s();
    let report = trainer.train_step(&x, &y)?;
    let measured = recorder.timeline_window(start, recorder.now_s(), n_devices, schedule.n_stages());
    let title = format!("{kind}, p={n_devices}, m={n_micro_batches}, measured on cpu:0 and cpu:1");
    let labels = vec!["cpu:0".to_string(), "cpu:1".to_string()];
    let path = out_dir.join("bubbles-measured.svg");
    std::fs::write(&path, svg_gantt(&measured, &SvgOptions { title, device_labels: labels, ..SvgOptions::default() }))?;
    println!(
        "measured bubble {:.1}% in a {:.1} ms step (loss {:.3}) -> {}",
        measured.bubble_fraction() * 100.0,
        report.step_s * 1e3,
        report.loss,
        path.display()
    );
    Ok(())
}
