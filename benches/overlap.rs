//! Overlapped steps against synchronous ones (issue 25 §1): the 8x1024 MLP (batch 256, SGD) on
//! two stages (`cpu:0`, `cpu:1`, automatic placement), trained by `Trainer::fit` with
//! `TrainerBuilder::overlap_steps` off and on, and one device for the ratio, all in one run.
//! Run: `cargo bench --bench overlap` (`CONVEYOR_BENCH_STEPS=N` steps per fit, default 12;
//! `CONVEYOR_BENCH_ROUNDS=R` rounds, default 5).
//!
//! Each round runs every configuration once (one device, then each schedule synchronous and
//! overlapped, in turn), so a slow phase of the machine hits all of them; a fit's figure is its
//! wall time over its steps after 2 warm-up steps (`FitSummary::elapsed_s / steps`). The table
//! gives medians over rounds of ms per step, and the medians of the per-round ratios:
//! overlapped / synchronous speed, and each against one device.
//!
//! Two stages need two idle cores: on a loaded machine the ratio measures the scheduler, not us.
#[path = "support/mod.rs"]
mod support;

use std::ops::ControlFlow;

use conveyor::engine::optim::OptimizerConfig;
use conveyor::engine::placement::Placement;
use conveyor::engine::runtime::Trainer;
use conveyor::engine::{Device, Tensor};
use conveyor::pipeline::builder;
use conveyor::schedules::ScheduleKind;
use support::{BATCH, CLASSES, WIDTH};

const CONFIGS: [(ScheduleKind, usize); 4] =
    [(ScheduleKind::OneFOneB, 4), (ScheduleKind::ZbH1, 2), (ScheduleKind::ZbH2, 2), (ScheduleKind::ZbH2, 4)];
const WARMUP: usize = 2;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Seconds per step of a `fit` over `steps` copies of the batch (after the warm-up).
fn seconds_per_step(trainer: &mut Trainer, x: &Tensor, y: &[usize], steps: usize) -> f64 {
    let copies = |n: usize| {
        let values = x.to_vec_f32();
        (0..n).map(move |_| (Tensor::from_vec(values.clone(), [BATCH, WIDTH], &Device::host()).unwrap(), y.to_vec()))
    };
    trainer.fit(copies(WARMUP), |_| ControlFlow::<()>::Continue(())).unwrap();
    let summary = trainer.fit(copies(steps), |_| ControlFlow::<()>::Continue(())).unwrap();
    summary.elapsed_s / summary.steps as f64
}

fn two_stages(kind: ScheduleKind, n_micro_batches: usize, overlap: bool) -> Trainer {
    let config = support::mlp_pipeline_config(kind, n_micro_batches);
    let devices = vec![Device::cpu(0), Device::cpu(1)];
    let trainer = builder(support::wide_mlp(), devices, &config)
        .placement(Placement::auto())
        .overlap_steps(overlap)
        .build()
        .unwrap();
    assert_eq!(trainer.overlaps_steps(), overlap, "{:?}", trainer.overlap_unavailable());
    trainer
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let (steps, rounds) = (env("CONVEYOR_BENCH_STEPS", 12), env("CONVEYOR_BENCH_ROUNDS", 5));
    let (x, y) = support::batch(BATCH, WIDTH, CLASSES);
    let mut one = support::single_device_trainer(support::wide_mlp(), OptimizerConfig::sgd(0.01));
    let mut trainers: Vec<(Trainer, Trainer)> =
        CONFIGS.iter().map(|&(kind, m)| (two_stages(kind, m, false), two_stages(kind, m, true))).collect();
    // Per round: one device, then per configuration (synchronous, overlapped).
    let mut per_round: Vec<(f64, Vec<(f64, f64)>)> = Vec::new();
    for round in 0..rounds {
        let one_s = seconds_per_step(&mut one, &x, &y, steps);
        let pairs = trainers
            .iter_mut()
            .map(|(sync, overlapped)| {
                (seconds_per_step(sync, &x, &y, steps), seconds_per_step(overlapped, &x, &y, steps))
            })
            .collect();
        per_round.push((one_s, pairs));
        eprintln!("round {} of {rounds} done", round + 1);
    }
    let one_ms = median(per_round.iter().map(|(o, _)| o * 1e3).collect());
    println!(
        "one device: {one_ms:.1} ms/step = {:.0} samples/s (median of {rounds} rounds)",
        BATCH as f64 / one_ms * 1e3
    );
    println!();
    println!(
        "{:<8} {:>2} {:>8} {:>11} {:>10} {:>10} {:>15}",
        "schedule", "M", "sync ms", "overlap ms", "sync/1dev", "ovl/1dev", "overlap/sync"
    );
    for (c, &(kind, m)) in CONFIGS.iter().enumerate() {
        let col = |f: &dyn Fn(f64, (f64, f64)) -> f64| median(per_round.iter().map(|(o, p)| f(*o, p[c])).collect());
        println!(
            "{:<8} {:>2} {:>8.1} {:>11.1} {:>9.2}x {:>9.2}x {:>14.3}x",
            kind.to_string(),
            m,
            col(&|_, (s, _)| s * 1e3),
            col(&|_, (_, o)| o * 1e3),
            col(&|one, (s, _)| one / s),
            col(&|one, (_, o)| one / o),
            col(&|_, (s, o)| s / o),
        );
    }
}
