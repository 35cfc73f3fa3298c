//! What the all-or-nothing commit costs: the 8x1024 MLP (batch 256) on one CPU device and on two
//! stages (ZB-H2, 4 micro-batches), with SGD and with Adam, each with the undo snapshot (the
//! default: parameters and optimizer state copied in the prepare phase so a failed apply can be
//! rolled back) and without it (what the memory plan falls back to when the copy does not fit).
//! Run: `cargo bench --bench commit_cost` (`CONVEYOR_BENCH_STEPS=N` timed steps per round).
//!
//! The two variants run in alternating rounds (machines drift); the table gives the median step of
//! all rounds for each, and the median of the per-round ratios.
#[path = "support/mod.rs"]
mod support;

use std::sync::Arc;

use conveyor::engine::Device;
use conveyor::engine::optim::OptimizerConfig;
use conveyor::engine::runtime::Trainer;
use conveyor::layers::CrossEntropyLoss;
use conveyor::schedules::ScheduleKind;
use support::{BATCH, CLASSES, WIDTH};

const ROUNDS: usize = 5;
const WARMUP: usize = 2;

fn trainer(n_devices: usize, optimizer: OptimizerConfig, snapshot: bool) -> Trainer {
    let graph = support::wide_mlp();
    let layers: Vec<_> =
        graph.topological_order().unwrap().into_iter().filter(|&id| graph.layer(id).is_some()).collect();
    let per = layers.len().div_ceil(n_devices);
    let stages: Vec<_> = layers.chunks(per).map(<[_]>::to_vec).collect();
    let (kind, micro_batches) = if n_devices == 1 { (ScheduleKind::OneFOneB, 1) } else { (ScheduleKind::ZbH2, 4) };
    Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices((0..n_devices).map(Device::cpu).collect())
        .stages(stages)
        .schedule(kind, 1)
        .micro_batches(micro_batches)
        .optimizer(optimizer)
        .commit_snapshot(vec![snapshot; n_devices])
        .build()
        .unwrap()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let steps = support::steps_from_env(4);
    let (x, y) = support::batch(BATCH, WIDTH, CLASSES);
    println!("| devices | optimizer | step with snapshot | without | cost (median of per-round ratios) |");
    println!("|---|---|---|---|---|");
    for n_devices in [1, 2] {
        for (name, optimizer) in [("sgd", OptimizerConfig::sgd(0.01)), ("adam", OptimizerConfig::adam(1e-4))] {
            let mut with = trainer(n_devices, optimizer, true);
            let mut without = trainer(n_devices, optimizer, false);
            let (mut all_with, mut all_without, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..ROUNDS {
                let w: Vec<f64> =
                    support::timed_steps(&mut with, &x, &y, WARMUP, steps).into_iter().map(|(s, _)| s).collect();
                let o: Vec<f64> =
                    support::timed_steps(&mut without, &x, &y, WARMUP, steps).into_iter().map(|(s, _)| s).collect();
                ratios.push(median(w.clone()) / median(o.clone()));
                all_with.extend(w);
                all_without.extend(o);
            }
            let (w, o) = (median(all_with), median(all_without));
            println!(
                "| {n_devices} | {name} | {:.2} ms | {:.2} ms | {:+.1}% |",
                w * 1e3,
                o * 1e3,
                (median(ratios) - 1.0) * 100.0
            );
        }
    }
}
