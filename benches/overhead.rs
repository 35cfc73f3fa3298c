//! Scheduling overhead per op: an MLP of width-4 layers (8 Linear 4x4 + 7 ReLU), whose arithmetic
//! is negligible, on 1, 2 and 4 CPU devices with many micro-batches, so a step's time is almost all
//! runtime bookkeeping: channels, timeline, fault guards, allocation. Target: < 20 µs per op.
//! Run: `cargo bench --bench overhead` (`CONVEYOR_BENCH_STEPS=N` for more timed steps).
//! Four devices run under the default policy (`Auto`: these ops are far below
//! `AUTO_SLOTS_MIN_OP_FLOPS`, so the operating system shares the cores) and with two core slots
//! forced; on fewer cores than devices, a device's wait for a core counts here too. The `slots`
//! column is what the measured step used.
//!
//! For each device `d` of the median step: `(step time − compute time on d) / ops on d`, where
//! compute time is the summed duration of its compute events (forward, backward parts, optimizer)
//! and ops their count; the table gives the worst device. This charges every gap between ops, the
//! waits for a neighbour's message included, to the runtime. `wall/op` is the step time over the
//! worst device's op count, a bound that charges the compute events' own bookkeeping as well.
#[path = "support/mod.rs"]
mod support;

use std::sync::Arc;

use conveyor::engine::Device;
use conveyor::engine::optim::OptimizerConfig;
use conveyor::engine::runtime::{CoreSlotPolicy, Trainer};
use conveyor::layers::CrossEntropyLoss;
use conveyor::schedules::ScheduleKind;

const WIDTHS: [usize; 9] = [4; 9];
const CONFIGS: [(usize, ScheduleKind, usize, CoreSlotPolicy); 9] = [
    (1, ScheduleKind::OneFOneB, 32, CoreSlotPolicy::Auto),
    (2, ScheduleKind::OneFOneB, 32, CoreSlotPolicy::Auto),
    (2, ScheduleKind::ZbH1, 32, CoreSlotPolicy::Auto),
    (4, ScheduleKind::OneFOneB, 32, CoreSlotPolicy::Auto),
    (4, ScheduleKind::GPipe, 32, CoreSlotPolicy::Auto),
    (4, ScheduleKind::ZbH2, 32, CoreSlotPolicy::Auto),
    (4, ScheduleKind::OneFOneB, 32, CoreSlotPolicy::Slots(2)),
    (4, ScheduleKind::GPipe, 32, CoreSlotPolicy::Slots(2)),
    (4, ScheduleKind::ZbH2, 32, CoreSlotPolicy::Slots(2)),
];

/// Cuts the layer nodes, in topological order, into `n` contiguous groups of near-equal count.
fn even_stages(graph: &conveyor::engine::graph::Graph, n: usize) -> Vec<Vec<conveyor::engine::graph::NodeId>> {
    let layers: Vec<_> =
        graph.topological_order().unwrap().into_iter().filter(|&id| graph.layer(id).is_some()).collect();
    let (base, extra) = (layers.len() / n, layers.len() % n);
    let mut start = 0;
    (0..n)
        .map(|i| {
            let len = base + usize::from(i < extra);
            start += len;
            layers[start - len..start].to_vec()
        })
        .collect()
}

fn main() {
    let steps = support::steps_from_env(20);
    println!(
        "{:<7} {:<9} {:>3} {:>6} {:>8} {:>12} {:>13} {:>10} {:>10}",
        "devices", "schedule", "M", "slots", "ops/dev", "step µs", "compute µs", "ovh/op µs", "wall/op µs"
    );
    for (n_devices, kind, n_micro_batches, policy) in CONFIGS {
        let graph = conveyor::zoo::mlp(&WIDTHS, 1).unwrap();
        let stages = even_stages(&graph, n_devices);
        let mut trainer = Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
            .devices((0..n_devices).map(Device::cpu).collect())
            .stages(stages)
            .schedule(kind, 1)
            .micro_batches(n_micro_batches)
            .optimizer(OptimizerConfig::sgd(0.01))
            .core_slots(policy)
            .build()
            .unwrap();
        // One row per micro-batch.
        let (x, y) = support::batch(n_micro_batches, WIDTHS[0], WIDTHS[WIDTHS.len() - 1]);
        let timed = support::timed_steps(&mut trainer, &x, &y, 3, steps);
        let (step_s, report) = &timed[timed.len() / 2];
        let busy = report.timeline.busy_s();
        let mut ops = vec![0usize; n_devices];
        for event in report.timeline.events.iter().filter(|e| e.op.is_compute()) {
            ops[event.device_idx] += 1;
        }
        let (worst, d) = (0..n_devices)
            .map(|d| ((step_s - busy[d]) / ops[d] as f64, d))
            .fold((f64::NEG_INFINITY, 0), |a, b| if b.0 > a.0 { b } else { a });
        println!(
            "{:<7} {:<9} {:>3} {:>6} {:>8} {:>12.0} {:>13.0} {:>10.1} {:>10.1}",
            n_devices,
            kind.to_string(),
            n_micro_batches,
            report.core_slots.map_or("-".to_string(), |n| n.to_string()),
            ops[d],
            step_s * 1e6,
            busy[d] * 1e6,
            worst * 1e6,
            step_s / ops[d] as f64 * 1e6
        );
    }
}
