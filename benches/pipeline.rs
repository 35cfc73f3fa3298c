//! Pipeline throughput: the 8x1024 MLP (batch 256, SGD) on one CPU device, then on two stages
//! (`cpu:0`, `cpu:1`, automatic placement) under GPipe, 1F1B, ZB-H1 and ZB-H2 with 2, 4 and 8
//! micro-batches, in samples/s and as a ratio to one device, all from one run.
//! Run: `cargo bench --bench pipeline` (`CONVEYOR_BENCH_STEPS=N` for more timed steps).
//!
//! Each configuration runs 2 warm-up steps and then N timed steps (default 5). The table gives the
//! fastest step (`best`, the least disturbed by other processes on a shared machine) and the
//! median; ratios divide the one-device figure of the same kind. The one-device baseline is
//! measured before and after the pipelined runs and the better of the two is the denominator, so
//! drift of the machine's load shows up as a gap between the two lines.
//! Columns: `ratio` is samples/s over one device's (the bubble-free ideal is 2.00x);
//! `bubble` is the measured idle fraction of the median step's compute span on both devices
//! (`Timeline::bubble_fraction`), `busy ms` each device's compute time, and `split` the layer
//! nodes (Linear and ReLU) per stage.
//!
//! Two stages need two idle cores: on a loaded machine the ratio measures the scheduler, not us.
#[path = "support/mod.rs"]
mod support;

use conveyor::engine::Device;
use conveyor::engine::optim::OptimizerConfig;
use conveyor::pipeline::build_trainer;
use conveyor::schedules::ScheduleKind;
use support::{BATCH, CLASSES, WIDTH};

const SCHEDULES: [ScheduleKind; 4] =
    [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::ZbH1, ScheduleKind::ZbH2];
const MICRO_BATCHES: [usize; 3] = [2, 4, 8];
const WARMUP: usize = 2;

/// Fastest and median step of one device, seconds.
fn one_device(steps: usize) -> (f64, f64) {
    let (x, y) = support::batch(BATCH, WIDTH, CLASSES);
    let mut trainer = support::single_device_trainer(support::wide_mlp(), OptimizerConfig::sgd(0.01));
    let timed = support::timed_steps(&mut trainer, &x, &y, WARMUP, steps);
    print_breakdown("one device", &timed[0].1);
    (timed[0].0, timed[timed.len() / 2].0)
}

/// Mean duration of each op kind on each device of one step, milliseconds.
fn print_breakdown(label: &str, report: &conveyor::engine::runtime::StepReport) {
    let mut totals: std::collections::BTreeMap<(usize, String), (f64, usize)> = Default::default();
    for event in &report.timeline.events {
        let entry = totals.entry((event.device_idx, format!("{:?}", event.op))).or_default();
        entry.0 += event.duration_s();
        entry.1 += 1;
    }
    let parts: Vec<String> = totals
        .iter()
        .map(|((device, op), (total, count))| {
            format!("d{device} {op} {count}x{:.2}={:.1}", total / *count as f64 * 1e3, total * 1e3)
        })
        .collect();
    println!("  [{label}] ms: {}", parts.join(", "));
}

fn main() {
    let steps = support::steps_from_env(5);
    let verbose = std::env::var_os("CONVEYOR_BENCH_BREAKDOWN").is_some();
    let (x, y) = support::batch(BATCH, WIDTH, CLASSES);
    let flops = support::mlp_step_flops(&support::wide_mlp_widths(), BATCH);
    let before = one_device(steps);
    let report_one = |label: &str, (best, median): (f64, f64)| {
        println!(
            "one device ({label}): best {:.1} ms/step = {:.0} samples/s = {:.1} GFLOP/s; median {:.1} ms/step",
            best * 1e3,
            BATCH as f64 / best,
            flops / best / 1e9,
            median * 1e3
        );
    };
    report_one("before", before);
    let mut rows = Vec::new();
    for kind in SCHEDULES {
        for n_micro_batches in MICRO_BATCHES {
            let config = support::mlp_pipeline_config(kind, n_micro_batches);
            let devices = vec![Device::cpu(0), Device::cpu(1)];
            let (plan, mut trainer) = build_trainer(support::wide_mlp(), devices, &config).unwrap();
            let split: Vec<String> = plan.stages.iter().map(|s| s.nodes.len().to_string()).collect();
            let timed = support::timed_steps(&mut trainer, &x, &y, WARMUP, steps);
            let (best_s, report) = &timed[0];
            if verbose {
                print_breakdown(&format!("{kind} M={n_micro_batches}"), report);
            }
            let busy: Vec<String> = report.timeline.busy_s().iter().map(|b| format!("{:.0}", b * 1e3)).collect();
            let bubble = report.timeline.bubble_fraction();
            rows.push((
                kind,
                n_micro_batches,
                split.join("/"),
                *best_s,
                timed[timed.len() / 2].0,
                bubble,
                busy.join("/"),
            ));
        }
    }
    let after = one_device(steps);
    report_one("after", after);
    let (best_one, median_one) = (before.0.min(after.0), before.1.min(after.1));
    println!();
    println!(
        "{:<8} {:>2} {:>5} {:>8} {:>9} {:>6} {:>10} {:>6} {:>7} {:>9}",
        "schedule", "M", "split", "best ms", "samples/s", "ratio", "median ms", "ratio", "bubble", "busy ms"
    );
    let mut best = (0.0, String::new());
    for (kind, m, split, best_s, median_s, bubble, busy) in rows {
        let ratio = best_one / best_s;
        if ratio > best.0 {
            best = (ratio, format!("{kind} M={m}"));
        }
        println!(
            "{:<8} {:>2} {:>5} {:>8.1} {:>9.0} {:>5.2}x {:>10.1} {:>5.2}x {:>6.1}% {:>9}",
            kind.to_string(),
            m,
            split,
            best_s * 1e3,
            BATCH as f64 / best_s,
            ratio,
            median_s * 1e3,
            median_one / median_s,
            bubble * 100.0,
            busy
        );
    }
    println!();
    println!("best two-stage configuration: {} at {:.2}x one device (best steps; target 1.8x)", best.1, best.0);
}
