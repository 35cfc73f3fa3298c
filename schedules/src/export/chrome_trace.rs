//! Chrome trace / Perfetto JSON (the "Trace Event Format"): what `chrome://tracing` and
//! `ui.perfetto.dev` open.
//!
//! Layout: one process (`pid` 0), or with [`ChromeTraceWriter::with_process_per_device`] one
//! process per device (`pid = d`, for a job of one process per device); device `d`'s compute and
//! wait events on thread `tid = d`,
//! named by an `M` `thread_name` event; its send and receive events, which overlap its compute,
//! on a second thread `tid = n_devices + d` named `... comm`, emitted only for devices that have
//! them. Every op is a complete (`X`) event with `ts` and `dur` in microseconds from the step's
//! start, `cat` the op kind (`forward`, `backward`, `backward_input`, ...) and `args` holding
//! stage, micro-batch and op. Memory samples become counter (`C`) events named `memory`, one
//! series per device (`id` `device d`), `args` `{"bytes": n}`.
use std::io::Write;

use serde_json::{Value, json};

use super::{device_name, event_name, kind_name};
use crate::timeline::{OpKind, Timeline, TimelineEvent};

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

/// The timeline as Chrome trace JSON: `{"displayTimeUnit": "ms", "traceEvents": [...]}`.
///
/// Events appear in a deterministic order: metadata, then ops sorted by (device, start), then
/// memory samples sorted by (device, time).
pub fn chrome_trace(timeline: &Timeline, options: &TraceOptions) -> String {
    let mut has_comm = vec![false; timeline.n_devices];
    for event in timeline.events.iter().filter(|event| is_comm(event.op)) {
        if let Some(flag) = has_comm.get_mut(event.device_idx) {
            *flag = true;
        }
    }
    let mut writer =
        ChromeTraceWriter::start(Vec::new(), timeline.n_devices, options.device_labels.clone(), &has_comm, None)
            .expect("writing to memory cannot fail");
    writer.write_ops(&timeline.events).expect("writing to memory cannot fail");
    writer.write_memory(&options.memory_samples).expect("writing to memory cannot fail");
    let bytes = writer.finish().expect("writing to memory cannot fail");
    String::from_utf8(bytes).expect("serde_json writes UTF-8")
}

/// A Chrome trace written as it goes, for timelines too long to hold (a whole training run):
/// [`ChromeTraceWriter::new`] writes the opening and the device rows, each
/// [`ChromeTraceWriter::write_ops`] or [`ChromeTraceWriter::write_memory`] appends a batch of events
/// (sorted within the batch as [`chrome_trace`] sorts), and [`ChromeTraceWriter::finish`] closes the
/// JSON. A device's comm row is named when its first send or receive arrives. Memory use is that of
/// one batch, whatever the length of the trace; the file is the same format [`chrome_trace`]
/// writes, a valid trace for `ui.perfetto.dev` and `chrome://tracing` once finished.
pub struct ChromeTraceWriter<W: Write> {
    out: W,
    n_devices: usize,
    device_labels: Vec<String>,
    /// Whether each device's comm row has been named.
    comm_named: Vec<bool>,
    /// Whether an event has been written (so the next one needs a comma).
    any_written: bool,
    /// Whether device `d` has a process of its own (`pid = d`) rather than sharing `pid` 0.
    process_per_device: bool,
}

impl<W: Write> ChromeTraceWriter<W> {
    /// Starts a trace of `n_devices` devices labelled `device_labels` (as in [`TraceOptions`]).
    pub fn new(out: W, n_devices: usize, device_labels: Vec<String>) -> std::io::Result<Self> {
        Self::start(out, n_devices, device_labels, &[], None)
    }

    /// Starts a trace of `n_devices` devices each in a process of its own, named
    /// `process_names[d]` (a job of one process per device: `rank 0 (cpu:0)`, ...): device `d`'s
    /// rows and memory counters go under `pid = d`, its rows named as in [`ChromeTraceWriter::new`].
    pub fn with_process_per_device(
        out: W,
        n_devices: usize,
        device_labels: Vec<String>,
        process_names: &[String],
    ) -> std::io::Result<Self> {
        Self::start(out, n_devices, device_labels, &[], Some(process_names))
    }

    /// Starts a trace, naming the comm rows of the devices flagged in `has_comm` up front.
    fn start(
        out: W,
        n_devices: usize,
        device_labels: Vec<String>,
        has_comm: &[bool],
        process_names: Option<&[String]>,
    ) -> std::io::Result<Self> {
        let mut writer = ChromeTraceWriter {
            out,
            n_devices,
            device_labels,
            comm_named: vec![false; n_devices],
            any_written: false,
            process_per_device: process_names.is_some(),
        };
        writer.out.write_all(b"{\"displayTimeUnit\":\"ms\",\"traceEvents\":[")?;
        match process_names {
            None => writer.event(&json!({
                "ph": "M", "pid": 0, "name": "process_name", "args": {"name": "conveyor pipeline"}
            }))?,
            Some(names) => {
                for device_idx in 0..n_devices {
                    let name = names.get(device_idx).cloned().unwrap_or_else(|| format!("process {device_idx}"));
                    writer.event(&json!({
                        "ph": "M", "pid": device_idx, "name": "process_name", "args": {"name": name}
                    }))?;
                    writer.event(&json!({
                        "ph": "M", "pid": device_idx, "name": "process_sort_index", "args": {"sort_index": device_idx}
                    }))?;
                }
            }
        }
        for device_idx in 0..n_devices {
            let name = device_name(&writer.device_labels, device_idx);
            for event in thread_metadata(writer.pid(device_idx), device_idx, &name, 2 * device_idx) {
                writer.event(&event)?;
            }
            if has_comm.get(device_idx).copied().unwrap_or(false) {
                writer.name_comm_row(device_idx)?;
            }
        }
        Ok(writer)
    }

    /// The process device `device_idx`'s rows belong to.
    fn pid(&self, device_idx: usize) -> usize {
        if self.process_per_device { device_idx } else { 0 }
    }

    fn event(&mut self, event: &Value) -> std::io::Result<()> {
        if self.any_written {
            self.out.write_all(b",")?;
        }
        self.any_written = true;
        serde_json::to_writer(&mut self.out, event).map_err(std::io::Error::from)
    }

    fn name_comm_row(&mut self, device_idx: usize) -> std::io::Result<()> {
        if self.comm_named.len() <= device_idx {
            self.comm_named.resize(device_idx + 1, false);
        }
        if self.comm_named[device_idx] {
            return Ok(());
        }
        self.comm_named[device_idx] = true;
        let name = format!("{} comm", device_name(&self.device_labels, device_idx));
        for event in thread_metadata(self.pid(device_idx), self.n_devices + device_idx, &name, 2 * device_idx + 1) {
            self.event(&event)?;
        }
        Ok(())
    }

    /// Appends ops as complete (`X`) events, sorted by (device, start) within the batch.
    pub fn write_ops(&mut self, events: &[TimelineEvent]) -> std::io::Result<()> {
        let mut events: Vec<_> = events.iter().collect();
        events.sort_by(|a, b| a.device_idx.cmp(&b.device_idx).then(a.start_s.total_cmp(&b.start_s)));
        for event in events {
            let tid = if is_comm(event.op) {
                self.name_comm_row(event.device_idx)?;
                self.n_devices + event.device_idx
            } else {
                event.device_idx
            };
            self.event(&json!({
                "ph": "X",
                "pid": self.pid(event.device_idx),
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
            }))?;
        }
        Ok(())
    }

    /// Appends memory samples as counter (`C`) events, sorted by (device, time) within the batch.
    pub fn write_memory(&mut self, samples: &[MemorySample]) -> std::io::Result<()> {
        let mut samples = samples.to_vec();
        samples.sort_by(|a, b| a.device_idx.cmp(&b.device_idx).then(a.time_s.total_cmp(&b.time_s)));
        for sample in samples {
            self.event(&json!({
                "ph": "C",
                "pid": self.pid(sample.device_idx),
                "name": "memory",
                "id": format!("device {}", sample.device_idx),
                "ts": sample.time_s * MICROS_PER_S,
                "args": {"bytes": sample.bytes},
            }))?;
        }
        Ok(())
    }

    /// Closes the JSON and hands back the writer (flushed).
    pub fn finish(mut self) -> std::io::Result<W> {
        self.out.write_all(b"]}")?;
        self.out.flush()?;
        Ok(self.out)
    }
}

fn is_comm(op: OpKind) -> bool {
    matches!(op, OpKind::Send | OpKind::Recv)
}

/// A `thread_name` and a `thread_sort_index` event, so rows appear named and each device's comm
/// row right below its compute row.
fn thread_metadata(pid: usize, tid: usize, name: &str, sort_index: usize) -> [Value; 2] {
    [
        json!({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}),
        json!({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": sort_index}}),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn one_process_per_device_puts_each_device_under_its_own_pid() {
        let forward = TimelineEvent {
            device_idx: 1,
            stage_idx: Some(1),
            op: OpKind::Forward,
            micro_batch_idx: Some(0),
            start_s: 0.5,
            end_s: 1.0,
        };
        let labels = vec!["cpu:0".to_owned(), "cpu:1".to_owned()];
        let names = ["rank 0 (cpu:0)".to_owned(), "rank 1 (cpu:1)".to_owned()];
        let mut writer = ChromeTraceWriter::with_process_per_device(Vec::new(), 2, labels, &names).unwrap();
        writer.write_ops(&[forward, TimelineEvent { op: OpKind::Recv, ..forward }]).unwrap();
        writer.write_memory(&[MemorySample { device_idx: 1, time_s: 0.25, bytes: 8 }]).unwrap();
        let trace: Value = serde_json::from_slice(&writer.finish().unwrap()).unwrap();
        let events = trace["traceEvents"].as_array().unwrap();
        let processes: Vec<(&Value, &str)> = events
            .iter()
            .filter(|event| event["name"] == "process_name")
            .map(|event| (&event["pid"], event["args"]["name"].as_str().unwrap()))
            .collect();
        assert_eq!(processes, [(&json!(0), "rank 0 (cpu:0)"), (&json!(1), "rank 1 (cpu:1)")]);
        let threads: Vec<(&Value, &Value, &str)> = events
            .iter()
            .filter(|event| event["name"] == "thread_name")
            .map(|event| (&event["pid"], &event["tid"], event["args"]["name"].as_str().unwrap()))
            .collect();
        assert_eq!(
            threads,
            [
                (&json!(0), &json!(0), "device 0 (cpu:0)"),
                (&json!(1), &json!(1), "device 1 (cpu:1)"),
                (&json!(1), &json!(3), "device 1 (cpu:1) comm")
            ]
        );
        let pids: Vec<(&Value, &Value)> =
            events.iter().filter(|event| event["ph"] != "M").map(|event| (&event["ph"], &event["pid"])).collect();
        assert_eq!(pids, [(&json!("X"), &json!(1)), (&json!("X"), &json!(1)), (&json!("C"), &json!(1))]);
    }

    #[test]
    fn a_trace_written_in_batches_holds_the_same_events_as_one_written_whole() {
        let mut timeline = Timeline::new(2, 2);
        for (device_idx, op, start_s) in
            [(0, OpKind::Forward, 0.0), (1, OpKind::Forward, 1.0), (1, OpKind::Recv, 0.5), (0, OpKind::Backward, 3.0)]
        {
            timeline.events.push(TimelineEvent {
                device_idx,
                stage_idx: Some(device_idx),
                op,
                micro_batch_idx: Some(0),
                start_s,
                end_s: start_s + 0.5,
            });
        }
        let samples = [
            MemorySample { device_idx: 0, time_s: 0.1, bytes: 8 },
            MemorySample { device_idx: 1, time_s: 2.0, bytes: 16 },
        ];
        let labels = vec!["cpu:0".to_owned(), "cpu:1".to_owned()];
        let whole =
            chrome_trace(&timeline, &TraceOptions { device_labels: labels.clone(), memory_samples: samples.to_vec() });
        let mut writer = ChromeTraceWriter::new(Vec::new(), 2, labels).unwrap();
        for (events, samples) in [(&timeline.events[..2], &samples[..1]), (&timeline.events[2..], &samples[1..])] {
            writer.write_ops(events).unwrap();
            writer.write_memory(samples).unwrap();
        }
        let streamed = String::from_utf8(writer.finish().unwrap()).unwrap();
        let sorted_events = |text: &str| {
            let trace: Value = serde_json::from_str(text).unwrap();
            assert_eq!(trace["displayTimeUnit"], "ms");
            let mut events: Vec<String> =
                trace["traceEvents"].as_array().unwrap().iter().map(|event| event.to_string()).collect();
            events.sort();
            events
        };
        assert_eq!(sorted_events(&streamed), sorted_events(&whole));
    }
}
