//! Core slots (`TrainerBuilder::core_slots`): with `n` slots at most `n` compute ops run at once
//! across all workers, results stay bit-for-bit those of a run without slots, and the wait for a
//! core shows on the timeline as `CoreWait`; `Auto` uses them only for ops long enough to pay
//! for the wake-ups.
mod common;

use std::sync::Arc;

use common::{data, even_stages, weights};
use conveyor::engine::Device;
use conveyor::engine::optim::{OptimizerConfig, SgdConfig};
use conveyor::engine::runtime::{CoreSlotPolicy, StepReport, Trainer};
use conveyor::layers::CrossEntropyLoss;
use conveyor::schedules::{OpKind, ScheduleKind};
use conveyor::zoo::mlp;

fn trainer(n_devices: usize, kind: ScheduleKind, policy: CoreSlotPolicy) -> Trainer {
    let graph = mlp(&[64, 512, 512, 512, 512, 512, 10], 5).unwrap();
    let stages = even_stages(&graph, n_devices);
    Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices((0..n_devices).map(Device::cpu).collect())
        .stages(stages)
        .schedule(kind, 1)
        .micro_batches(8)
        .optimizer(OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.9)))
        .core_slots(policy)
        .build()
        .unwrap()
}

/// The most compute ops whose intervals overlap at one instant.
fn max_concurrent_compute(report: &StepReport) -> usize {
    let mut edges: Vec<(f64, i32)> = Vec::new();
    for e in report.timeline.events.iter().filter(|e| e.op.is_compute()) {
        edges.push((e.start_s, 1));
        edges.push((e.end_s, -1));
    }
    // Ends sort before starts at the same instant: touching ops do not overlap.
    edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut now, mut most) = (0i32, 0i32);
    for (_, delta) in edges {
        now += delta;
        most = most.max(now);
    }
    most as usize
}

#[test]
fn slots_bound_concurrency_and_keep_results_bit_for_bit() {
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::ZbH2] {
        for n_slots in [1, 2] {
            let mut slotted = trainer(4, kind, CoreSlotPolicy::Slots(n_slots));
            assert_eq!(slotted.core_slots(), Some(n_slots));
            let mut core_waits = 0;
            for step in 0..3 {
                let (x, y) = data(256, &[64], 10, step);
                let report = slotted.train_step(&x, &y).unwrap();
                let most = max_concurrent_compute(&report);
                assert!(most <= n_slots, "{kind}, {n_slots} slots: {most} ops computed at once");
                core_waits += report.timeline.events.iter().filter(|e| e.op == OpKind::CoreWait).count();
                for e in report.timeline.events.iter().filter(|e| e.op == OpKind::CoreWait) {
                    assert!(e.end_s >= e.start_s, "{e:?}");
                }
            }
            // One slot for four stages: a ready stage must queue at least once per step.
            if n_slots == 1 {
                assert!(core_waits > 0, "{kind}: no core waits recorded with one slot for four workers");
            }
            let mut reference = trainer(4, kind, CoreSlotPolicy::Off);
            for step in 0..3 {
                let (x, y) = data(256, &[64], 10, step);
                reference.train_step(&x, &y).unwrap();
            }
            assert_eq!(reference.core_slots(), None);
            assert_eq!(weights(&slotted), weights(&reference), "{kind}, {n_slots} slots");
        }
    }
}

#[test]
fn auto_gives_one_slot_per_core_only_when_workers_outnumber_cores() {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let within = trainer(cores.min(4), ScheduleKind::OneFOneB, CoreSlotPolicy::Auto);
    assert_eq!(within.core_slots(), None);
    let mut beyond = trainer(cores + 1, ScheduleKind::OneFOneB, CoreSlotPolicy::Auto);
    assert_eq!(beyond.core_slots(), Some(cores));
    // 32 rows per micro-batch: each op is tens of MFLOP, above AUTO_SLOTS_MIN_OP_FLOPS, and the
    // step uses the slots.
    let (x, y) = data(256, &[64], 10, 0);
    assert_eq!(beyond.train_step(&x, &y).unwrap().core_slots, Some(cores));
    // One row per micro-batch: ops below a million flops cannot pay for a wake-up per handoff,
    // and the step leaves the cores to the operating system.
    let (x, y) = data(8, &[64], 10, 0);
    let report = beyond.train_step(&x, &y).unwrap();
    assert_eq!(report.core_slots, None);
    assert_eq!(report.core_wake_latency_s, None);
    assert!(report.timeline.events.iter().all(|e| e.op != OpKind::CoreWait));
    // Forced slots are used whatever the op size.
    let mut forced = trainer(cores + 1, ScheduleKind::OneFOneB, CoreSlotPolicy::Slots(cores));
    assert_eq!(forced.train_step(&x, &y).unwrap().core_slots, Some(cores));
}

#[test]
fn core_slot_policies_parse() {
    assert_eq!("auto".parse::<CoreSlotPolicy>().unwrap(), CoreSlotPolicy::Auto);
    assert_eq!("off".parse::<CoreSlotPolicy>().unwrap(), CoreSlotPolicy::Off);
    assert_eq!("3".parse::<CoreSlotPolicy>().unwrap(), CoreSlotPolicy::Slots(3));
    for bad in ["0", "-1", "many", ""] {
        let error = bad.parse::<CoreSlotPolicy>().unwrap_err().to_string();
        assert!(error.contains("auto, off or a number"), "{bad}: {error}");
    }
}
