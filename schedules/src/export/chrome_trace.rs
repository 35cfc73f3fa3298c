//! Chrome trace / Perfetto JSON (the "Trace Event Format"): what `chrome://tracing` and
//! `ui.perfetto.dev` open.
//!
//! Layout: one process (`pid` 0); device `d`'s compute and wait events on thread `tid = d`,
//! named by an `M` `thread_name` event; its send and receive events, which overlap its compute,
//! on a second thread `tid = n_devices + d` named `... comm`, emitted only for devices that have
//! them. Every op is a complete (`X`) event with `ts` and `dur` in microseconds from the step's
//! start, `cat` the op kind (`forward`, `backward`, `backward_input`, ...) and `args` holding
//! stage, micro-batch and op. Memory samples become counter (`C`) events named `memory`, one
//! series per device (`id` `device d`), `args` `{"bytes": n}`.
use serde_json::{Value, json};

use super::{device_name, event_name, kind_name};
use crate::timeline::{OpKind, Timeline};

/// Bytes one device held at one moment, for the memory counter track.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemorySample {
    /// The device.
    pub device_idx: usize,
    /// When, seconds from the step's start (the timeline's clock).
    pub time_s: f64,
    /// Bytes in use.
    pub bytes: u64,
}

/// What [`chrome_trace`] adds to the timeline's events.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TraceOptions {
    /// Label of each device, device 0 first (e.g. `cpu:0`); rows are named
    /// `device 0 (cpu:0)`, or `device 0` where a label is missing or empty.
    pub device_labels: Vec<String>,
    /// Memory samples, drawn as a counter track per device; any order.
    pub memory_samples: Vec<MemorySample>,
}

/// Microseconds per second: Chrome traces count time in microseconds.
const MICROS_PER_S: f64 = 1e6;

/// The timeline as Chrome trace JSON: `{"traceEvents": [...], "displayTimeUnit": "ms"}`.
///
/// Events appear in a deterministic order: metadata, then ops sorted by (device, start), then
/// memory samples sorted by (device, time).
pub fn chrome_trace(timeline: &Timeline, options: &TraceOptions) -> String {
    let n_devices = timeline.n_devices;
    let is_comm = |op: OpKind| matches!(op, OpKind::Send | OpKind::Recv);
    let mut has_comm = vec![false; n_devices];
    for event in timeline.events.iter().filter(|event| is_comm(event.op)) {
        has_comm[event.device_idx] = true;
    }
    let mut trace_events: Vec<Value> = vec![json!({
        "ph": "M", "pid": 0, "name": "process_name", "args": {"name": "conveyor pipeline"}
    })];
    for (device_idx, has_comm) in has_comm.into_iter().enumerate() {
        let name = device_name(&options.device_labels, device_idx);
        trace_events.extend(thread_metadata(device_idx, &name, 2 * device_idx));
        if has_comm {
            trace_events.extend(thread_metadata(n_devices + device_idx, &format!("{name} comm"), 2 * device_idx + 1));
        }
    }
    let mut events: Vec<_> = timeline.events.iter().collect();
    events.sort_by(|a, b| a.device_idx.cmp(&b.device_idx).then(a.start_s.total_cmp(&b.start_s)));
    for event in events {
        let tid = if is_comm(event.op) { n_devices + event.device_idx } else { event.device_idx };
        trace_events.push(json!({
            "ph": "X",
            "pid": 0,
            "tid": tid,
            "name": event_name(event),
            "cat": kind_name(event.op),
            "ts": event.start_s * MICROS_PER_S,
            "dur": event.duration_s() * MICROS_PER_S,
            "args": {
                "stage": event.stage_idx,
                "micro_batch": event.micro_batch_idx,
                "op": kind_name(event.op),
            },
        }));
    }
    let mut samples = options.memory_samples.clone();
    samples.sort_by(|a, b| a.device_idx.cmp(&b.device_idx).then(a.time_s.total_cmp(&b.time_s)));
    for sample in samples {
        trace_events.push(json!({
            "ph": "C",
            "pid": 0,
            "name": "memory",
            "id": format!("device {}", sample.device_idx),
            "ts": sample.time_s * MICROS_PER_S,
            "args": {"bytes": sample.bytes},
        }));
    }
    json!({"traceEvents": trace_events, "displayTimeUnit": "ms"}).to_string()
}

/// A `thread_name` and a `thread_sort_index` event, so rows appear named and each device's comm
/// row right below its compute row.
fn thread_metadata(tid: usize, name: &str, sort_index: usize) -> [Value; 2] {
    [
        json!({"ph": "M", "pid": 0, "tid": tid, "name": "thread_name", "args": {"name": name}}),
        json!({"ph": "M", "pid": 0, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": sort_index}}),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timeline::TimelineEvent;

    #[test]
    fn sends_go_to_a_comm_row_and_memory_to_counters() {
        let mut timeline = Timeline::new(2, 2);
        let forward = TimelineEvent {
            device_idx: 0,
            stage_idx: Some(0),
            op: OpKind::Forward,
            micro_batch_idx: Some(1),
            start_s: 0.5,
            end_s: 1.0,
        };
        timeline.events.push(forward);
        timeline.events.push(TimelineEvent { op: OpKind::Send, start_s: 1.0, end_s: 1.25, ..forward });
        let options = TraceOptions {
            device_labels: vec!["cpu:0".to_owned()],
            memory_samples: vec![MemorySample { device_idx: 1, time_s: 0.25, bytes: 4096 }],
        };
        let trace: Value = serde_json::from_str(&chrome_trace(&timeline, &options)).unwrap();
        let events = trace["traceEvents"].as_array().unwrap();
        let names: Vec<&str> = events
            .iter()
            .filter(|event| event["name"] == "thread_name")
            .map(|event| event["args"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["device 0 (cpu:0)", "device 0 (cpu:0) comm", "device 1"]);
        let forward = events.iter().find(|event| event["name"] == "F1").unwrap();
        assert_eq!(
            (forward["ts"].as_f64(), forward["dur"].as_f64(), &forward["tid"]),
            (Some(5e5), Some(5e5), &json!(0))
        );
        assert_eq!(forward["args"], json!({"stage": 0, "micro_batch": 1, "op": "forward"}));
        let send = events.iter().find(|event| event["cat"] == "send").unwrap();
        assert_eq!((&send["name"], &send["tid"]), (&json!("send 1"), &json!(2)));
        let memory = events.iter().find(|event| event["ph"] == "C").unwrap();
        assert_eq!((&memory["name"], &memory["args"]["bytes"]), (&json!("memory"), &json!(4096)));
        assert_eq!(trace["displayTimeUnit"], "ms");
    }
}
