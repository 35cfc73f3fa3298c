//! `--schedule auto` against the fixed schedules, measured: the 8x1024 MLP (batch 256, SGD) on two
//! CPU devices. The automatic choice (schedule, micro-batches, recompute mode and stage split,
//! from layer times measured here and the simulator) is trained next to every fixed schedule at
//! the default settings (8 micro-batches, no recomputation, 2 chunks where the schedule takes
//! them, automatic placement), all in one run.
//! Run: `cargo bench --bench auto_schedule` (`CONVEYOR_BENCH_STEPS=N` rounds, default 7).
//!
//! The fixed schedules are placed by measured times too (`plan_by_time`), each from its own
//! profile, so their predicted steps carry that profile's noise; the choice compares candidates
//! from one profile.
//!
//! Rounds interleave the configurations (one step of each per round, after 2 warm-up steps each),
//! so drift of the machine's load hits all alike; the table gives each configuration's median
//! step and its predicted one, and the last line the median over rounds of the ratio of the
//! chosen configuration's step to the best fixed one's in that round.
//!
//! Two devices need two idle cores: on a loaded machine the figures measure the scheduler.
//!
//! One run on a quiet 2-core AMD EPYC (2026-11-25, load average 1.3): the choice, interleaved-zb
//! x2 with 4 micro-batches, 44.7 ms median against 48.7 ms for the best fixed schedule
//! (dualpipe-v x2, m = 8) and 53.7 ms for 1f1b; per-round ratio chosen / best fixed 0.912.
//! Predicted steps (about 31 ms) are below the measured ones: the stage costs leave out the
//! optimizer step, the commit and the threads' wake-ups.
#[path = "support/mod.rs"]
mod support;

use std::time::Instant;

use conveyor::engine::Device;
use conveyor::engine::placement::{PlaceBy, choose_schedule};
use conveyor::engine::runtime::Recompute;
use conveyor::pipeline::{PipelineConfig, build_trainer_with_plan, plan_by_time};
use conveyor::schedules::{Schedule, ScheduleKind, simulate};
use support::{BATCH, CLASSES, WIDTH};

const WARMUP: usize = 2;

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let rounds = support::steps_from_env(7);
    let (x, y) = support::batch(BATCH, WIDTH, CLASSES);
    let devices = vec![Device::cpu(0), Device::cpu(1)];
    let base = support::mlp_pipeline_config(ScheduleKind::OneFOneB, 8);
    let graph = support::wide_mlp();
    let started = Instant::now();
    let choice = choose_schedule(&graph, &devices, &base, PlaceBy::Time).unwrap();
    println!(
        "--schedule auto weighed {} candidates in {:.1} s and chose {}: {}",
        choice.candidates.len(),
        started.elapsed().as_secs_f64(),
        choice.chosen().label(),
        choice.why()
    );
    // (label, trainer, predicted step) for the choice, then each fixed schedule.
    let mut configs = Vec::new();
    let chosen = choice.chosen();
    let chosen_plan = choice.plan().clone();
    let predicted = chosen.planned().unwrap().step_s;
    let trainer = build_trainer_with_plan(support::wide_mlp(), devices.clone(), &chosen_plan, &chosen.config(&base));
    configs.push((format!("auto: {}", chosen.label()), trainer.unwrap(), predicted));
    for kind in ScheduleKind::ALL {
        let n_chunks = kind.required_chunks().unwrap_or(if kind.supports_chunks() { 2 } else { 1 });
        let config = PipelineConfig { schedule: kind, n_chunks, ..base.clone() };
        let plan = plan_by_time(&graph, &devices, &config).unwrap();
        let schedule = Schedule::new(kind, devices.len(), config.n_micro_batches, n_chunks).unwrap();
        let costs = conveyor::engine::placement::predicted_costs(&plan, &schedule, Recompute::Never);
        let predicted = simulate(&schedule, &costs).unwrap().makespan_s;
        let trainer = build_trainer_with_plan(support::wide_mlp(), devices.clone(), &plan, &config).unwrap();
        configs.push((format!("{kind}{}, m=8", if n_chunks > 1 { " x2" } else { "" }), trainer, predicted));
    }
    for (_, trainer, _) in &mut configs {
        for _ in 0..WARMUP {
            trainer.train_step(&x, &y).unwrap();
        }
    }
    let mut steps = vec![Vec::new(); configs.len()];
    for _ in 0..rounds {
        for (i, (_, trainer, _)) in configs.iter_mut().enumerate() {
            let started = Instant::now();
            trainer.train_step(&x, &y).unwrap();
            steps[i].push(started.elapsed().as_secs_f64());
        }
    }
    println!("{:<40} {:>10} {:>13}", "configuration", "median ms", "predicted ms");
    for ((label, _, predicted), measured) in configs.iter().zip(&steps) {
        println!("{label:<40} {:>10.1} {:>13.1}", median(&mut measured.clone()) * 1e3, predicted * 1e3);
    }
    let mut ratios: Vec<f64> = (0..rounds)
        .map(|round| {
            let best_fixed = steps[1..].iter().map(|s| s[round]).fold(f64::INFINITY, f64::min);
            steps[0][round] / best_fixed
        })
        .collect();
    println!(
        "chosen / best fixed schedule, median over {rounds} rounds of the per-round ratio: {:.3}",
        median(&mut ratios)
    );
}
