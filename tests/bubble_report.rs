//! The bubble report of measured steps (`Trainer::bubbles`, `StepReport::bubbles`): per device
//! busy and idle time add up to the step, theory is the simulator's with equal costs, the gap
//! decomposes `measured - theory`, and on a machine with a core per device the simulator fed the
//! measured op costs lands within a few points of the measured bubble.
mod common;

use std::sync::{Arc, Mutex};

use common::{data, even_stages};
use conveyor::engine::Device;
use conveyor::engine::optim::{OptimizerConfig, SgdConfig};
use conveyor::engine::runtime::{CostBasis, StepReport, Trainer};
use conveyor::layers::CrossEntropyLoss;
use conveyor::schedules::{OpKind, ScheduleKind};
use conveyor::zoo::mlp;

/// The tests train one at a time: two trainers at once would share the cores the comparison of
/// measured and simulated bubbles needs one each of.
static SERIAL: Mutex<()> = Mutex::new(());

const N_MICRO_BATCHES: usize = 4;
const ROWS: usize = 128;

/// Two stages of two 1024-wide Linears each, micro-batches of 128 rows: each op several
/// milliseconds, long against the operating system's wake-up latency.
fn trainer(kind: ScheduleKind) -> Trainer {
    let graph = mlp(&[256, 1024, 1024, 1024, 10], 3).unwrap();
    let stages = even_stages(&graph, 2);
    Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices((0..2).map(Device::cpu).collect())
        .stages(stages)
        .schedule(kind, 1)
        .micro_batches(N_MICRO_BATCHES)
        .optimizer(OptimizerConfig::Sgd(SgdConfig::new(0.05)))
        .build()
        .unwrap()
}

fn steps(trainer: &mut Trainer, n: usize) -> Vec<StepReport> {
    (0..n as u64)
        .map(|step| {
            let (x, y) = data(ROWS * N_MICRO_BATCHES, &[256], 10, step);
            trainer.train_step(&x, &y).unwrap()
        })
        .collect()
}

#[test]
fn busy_and_idle_make_the_step_and_theory_is_the_simulators() {
    let _serial = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        let mut trainer = trainer(kind);
        let reports = steps(&mut trainer, 3);
        let bubbles = trainer.bubbles(&reports).unwrap();
        assert_eq!(bubbles.n_steps, 3);
        // (p - 1) / (m + p - 1) with p = 2, m = 4.
        assert!((bubbles.theory_fraction - 1.0 / 5.0).abs() < 1e-12, "{kind}: {}", bubbles.theory_fraction);
        let last = reports.last().unwrap();
        assert!((bubbles.makespan_s - last.timeline.makespan_s()).abs() < 1e-12);
        assert_eq!(bubbles.devices.len(), 2);
        for (device_idx, device) in bubbles.devices.iter().enumerate() {
            assert_eq!(device.label, format!("cpu:{device_idx}"));
            assert!(device.busy_s > 0.0 && device.idle_s >= 0.0, "{kind}: {device:?}");
            assert!((device.busy_s + device.idle_s - bubbles.makespan_s).abs() < 1e-9, "{kind}: {device:?}");
            assert!(device.waiting_s + device.core_wait_s <= device.idle_s + 1e-9, "{kind}: {device:?}");
            assert_eq!(device.peak_memory_bytes, last.peak_memory[device_idx]);
        }
        // The second stage waits for the first stage's first forward.
        assert!(bubbles.devices[1].waiting_s > 0.0, "{kind}: {:?}", bubbles.devices[1]);
        // The last step's measured fraction is the busy figures' own.
        let one = last.bubbles(trainer.schedule()).unwrap();
        let busy: f64 = one.devices.iter().map(|d| d.busy_s).sum();
        assert!((one.measured_fraction - (1.0 - busy / (2.0 * one.makespan_s))).abs() < 1e-9);
        assert!((one.measured_fraction - last.timeline.bubble_fraction()).abs() < 1e-12);
        // The gap's parts add up to measured - theory.
        let gap = bubbles.gap;
        let parts = gap.op_costs + gap.machine + gap.unexplained;
        assert!((parts - (bubbles.measured_fraction - bubbles.theory_fraction)).abs() < 1e-9, "{gap:?}");
        assert!((gap.unexplained - (bubbles.measured_fraction - bubbles.simulated_fraction)).abs() < 1e-9);
        // What `conveyor train` prints.
        let text = bubbles.to_string();
        assert!(text.starts_with("bubble (mean of the last 3 steps): measured "), "{text}");
        assert!(text.contains("schedule theory (equal costs) 20.0%"), "{text}");
        assert!(text.contains("\n  cpu:1: busy "), "{text}");
        assert!(text.contains("(micro-batches in flight on its first stage: "), "{text}");
    }
}

#[test]
fn the_simulator_fed_measured_costs_lands_near_the_measured_bubble() {
    let _serial = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let mut trainer = trainer(ScheduleKind::OneFOneB);
    // A warm-up step first: the first touches every page of the parameters and activations.
    let reports = steps(&mut trainer, 6).split_off(1);
    let bubbles = trainer.bubbles(&reports).unwrap();
    if cores < 2 {
        println!("skipped the comparison: {cores} core for 2 devices, the simulator then shares the cores");
        return;
    }
    assert!(matches!(bubbles.cost_basis, CostBasis::Delivery { .. }), "{:?}", bubbles.cost_basis);
    assert!(bubbles.cores_idle.is_none());
    // Whether the workers had a core each: their ops' CPU time against their wall time (a busy
    // machine takes the cores away mid-op, and wakes a waiting worker late).
    let layer_op = |op: OpKind| op.is_compute() && op != OpKind::OptimizerStep;
    let cpu_s: f64 = reports.iter().flat_map(|r| &r.op_cpu_times).filter(|t| layer_op(t.op)).map(|t| t.cpu_s).sum();
    let wall_s: f64 =
        reports.iter().flat_map(|r| &r.timeline.events).filter(|e| layer_op(e.op)).map(|e| e.duration_s()).sum();
    if cpu_s < 0.8 * wall_s {
        println!(
            "skipped the comparison: the ops got {:.0}% of a core each (other processes share the {cores} cores), \
             so a core per device, the simulator's model, does not hold: {bubbles}",
            100.0 * cpu_s / wall_s
        );
        return;
    }
    let points = (bubbles.simulated_fraction - bubbles.measured_fraction).abs() * 100.0;
    assert!(points < 5.0, "{points:.1} points apart: {bubbles}\n{}", bubbles.gap);
}

#[test]
fn no_reports_or_another_schedule_is_an_error_not_a_panic() {
    let _serial = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let trainer = trainer(ScheduleKind::GPipe);
    assert!(trainer.bubbles(&[]).is_err());
    let mut other = Trainer::builder(mlp(&[256, 512, 10], 3).unwrap(), Arc::new(CrossEntropyLoss::new()))
        .devices(vec![Device::cpu(0)])
        .micro_batches(N_MICRO_BATCHES)
        .optimizer(OptimizerConfig::Sgd(SgdConfig::new(0.05)))
        .build()
        .unwrap();
    let reports = steps(&mut other, 1);
    let err = trainer.bubbles(&reports).unwrap_err();
    assert!(err.to_string().contains("has 1 devices and 1 stages, the schedule 2 and 2"), "{err}");
}
