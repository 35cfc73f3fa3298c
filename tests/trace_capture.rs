//! Op spans through `tracing`: a `TimelineLayer` subscriber sees every executed op of every
//! worker, with the same (device, stage, op, micro-batch) as the runtime's own step timeline.
mod common;

use common::{data, trainer};
use conveyor::engine::runtime::Recompute;
use conveyor::engine::trace::TimelineRecorder;
use conveyor::schedules::export::{MemorySample, TraceOptions, chrome_trace};
use conveyor::schedules::{OpKind, ScheduleKind};
use conveyor::zoo::mlp;
use tracing_subscriber::layer::SubscriberExt;

// One test function: `tracing` caches per-callsite interest process-wide, so a second test running
// trainers without a subscriber on another thread at the same time can race with the scoped
// subscriber below. Programs install the subscriber globally (as `conveyor train` does).
#[test]
fn op_spans_are_captured_with_a_subscriber_and_not_without() {
    every_op_of_every_worker_is_captured_as_a_span();
    without_a_subscriber_nothing_is_recorded();
}

fn every_op_of_every_worker_is_captured_as_a_span() {
    let (recorder, layer) = TimelineRecorder::new();
    let subscriber = tracing_subscriber::registry().with(layer);
    let (n_devices, n_micro_batches) = (4, 8);
    let report = tracing::subscriber::with_default(subscriber, || {
        let mut t = trainer(mlp(&[8, 16, 16, 16, 16, 4], 2).unwrap(), n_devices, ScheduleKind::ZbH1, 1, n_micro_batches, Recompute::Never);
        let (x, y) = data(16, &[8], 4, 1);
        t.train_step(&x, &y).unwrap()
    });
    let captured = recorder.timeline(n_devices, n_devices);
    let key = |e: &conveyor::schedules::TimelineEvent| (e.device_idx, e.stage_idx, e.op, e.micro_batch_idx);
    let compute = |events: &[conveyor::schedules::TimelineEvent]| {
        let mut keys: Vec<_> = events.iter().filter(|e| e.op.is_compute()).map(key).collect();
        keys.sort_by_key(|k| format!("{k:?}"));
        keys
    };
    assert_eq!(compute(&captured.events), compute(&report.timeline.events));
    for op in [OpKind::Forward, OpKind::BackwardInput, OpKind::BackwardWeight] {
        let count = captured.events.iter().filter(|e| e.op == op).count();
        assert_eq!(count, n_devices * n_micro_batches, "{op:?}");
    }
    assert_eq!(captured.events.iter().filter(|e| e.op == OpKind::OptimizerStep).count(), n_devices);
    assert!(captured.events.iter().all(|e| e.end_s >= e.start_s));

    // The Chrome trace of this measured 4-stage run: valid JSON with one complete (`X`) event for
    // every forward and every input-gradient pass of every (micro-batch, stage).
    let memory_samples = recorder
        .memory()
        .into_iter()
        .map(|m| MemorySample { device_idx: m.device_idx, time_s: m.time_s, bytes: m.bytes })
        .collect::<Vec<_>>();
    assert!(!memory_samples.is_empty(), "memory samples are recorded after every op");
    let options = TraceOptions { device_labels: (0..n_devices).map(|d| format!("cpu:{d}")).collect(), memory_samples };
    let trace: serde_json::Value = serde_json::from_str(&chrome_trace(&captured, &options)).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    for op in ["forward", "backward_input"] {
        for stage in 0..n_devices {
            for micro_batch in 0..n_micro_batches {
                let matching = events
                    .iter()
                    .filter(|e| {
                        e["ph"] == "X"
                            && e["args"]["op"] == op
                            && e["args"]["stage"] == stage
                            && e["args"]["micro_batch"] == micro_batch
                    })
                    .count();
                assert_eq!(matching, 1, "{op} of micro-batch {micro_batch} on stage {stage}");
            }
        }
    }
    assert!(events.iter().any(|e| e["ph"] == "C"), "memory counters");
}

fn without_a_subscriber_nothing_is_recorded() {
    let (recorder, _layer) = TimelineRecorder::new();
    let mut t = trainer(mlp(&[8, 16, 4], 2).unwrap(), 2, ScheduleKind::OneFOneB, 1, 4, Recompute::Never);
    let (x, y) = data(8, &[8], 4, 1);
    t.train_step(&x, &y).unwrap();
    assert!(recorder.is_empty());
}
