//! Exporters: a [`Timeline`](crate::Timeline) (simulated or measured) drawn for people to look at.
//!
//! - [`chrome_trace`]: Chrome trace / Perfetto JSON, one row per device, one complete (`X`)
//!   event per op, memory as counter (`C`) events. Open it in `ui.perfetto.dev` or
//!   `chrome://tracing`.
//! - [`svg_gantt`]: a self-contained SVG Gantt chart: ops coloured by kind and labelled with
//!   their micro-batch, idle time inside the makespan hatched as bubbles, a time axis, a legend
//!   and the bubble fraction in the title.
//! - [`terminal_chart`]: a compact Gantt of one text line per device for a terminal.
//!
//! - [`ChromeTraceWriter`]: the same trace written batch by batch to any `io::Write`, for
//!   timelines too long to hold in memory (a whole training run).
//!
//! **API Boundary**: every exporter is a pure function from a timeline (plus optional device
//! labels and memory samples) to a `String`, or for the trace also a writer into a caller's
//! `io::Write`; opening and naming files is the caller's business.
//! **Architecture Invariant:** exporters read only [`Timeline`](crate::Timeline); they never know whether it was
//! simulated or measured, nor anything of tensors, devices or threads.
//!
//! Design: we emit the formats by hand (JSON through `serde_json`, SVG as escaped text) rather
//! than through a plotting library, so the crate stays small, the output is deterministic (and
//! snapshot-testable), and the SVG needs no scripts, fonts or external files to display.
//!
//! ```
//! use conveyor_schedules::export::{SvgOptions, TraceOptions, chrome_trace, svg_gantt, terminal_chart};
//! use conveyor_schedules::{CostModel, Schedule, ScheduleKind, StageCosts, simulate};
//!
//! let schedule = Schedule::new(ScheduleKind::GPipe, 2, 2, 1)?;
//! let report = simulate(&schedule, &CostModel::uniform(StageCosts::UNIT))?;
//! let trace = chrome_trace(&report.timeline, &TraceOptions::default());
//! assert!(trace.contains("\"traceEvents\":[") && trace.contains("\"name\":\"F1\""));
//! let svg = svg_gantt(&report.timeline, &SvgOptions { title: "GPipe, p=2, m=2".into(), ..SvgOptions::default() });
//! assert!(svg.contains("GPipe, p=2, m=2 — bubble 33.3%"));
//! let chart = terminal_chart(&report.timeline, 40);
//! assert_eq!(chart.lines().count(), 3); // two devices and a legend
//! # Ok::<(), conveyor_schedules::ScheduleError>(())
//! ```
mod chrome_trace;
mod svg;
mod terminal;

pub use chrome_trace::{ChromeTraceWriter, MemorySample, TraceOptions, chrome_trace};
pub use svg::{SvgOptions, svg_gantt};
pub use terminal::terminal_chart;

use crate::timeline::{OpKind, TimelineEvent};

/// Every op kind, in the order legends list them.
const ALL_KINDS: [OpKind; 11] = [
    OpKind::Forward,
    OpKind::Backward,
    OpKind::BackwardInput,
    OpKind::BackwardWeight,
    OpKind::OptimizerStep,
    OpKind::AllReduce,
    OpKind::Recompute,
    OpKind::Wait,
    OpKind::CoreWait,
    OpKind::Send,
    OpKind::Recv,
];

/// The kind's name in `snake_case`, as `OpKind` serializes.
fn kind_name(kind: OpKind) -> &'static str {
    match kind {
        OpKind::Forward => "forward",
        OpKind::BackwardInput => "backward_input",
        OpKind::BackwardWeight => "backward_weight",
        OpKind::Backward => "backward",
        OpKind::OptimizerStep => "optimizer_step",
        OpKind::Send => "send",
        OpKind::Recv => "recv",
        OpKind::Wait => "wait",
        OpKind::CoreWait => "core_wait",
        OpKind::Recompute => "recompute",
        OpKind::AllReduce => "all_reduce",
    }
}

/// The short name of an event: `F3`, `B3`, `I3`, `W3`, `R3`, `optimizer`, `send 3`, `recv 3`,
/// `wait 3` (the letter notation of [`crate::render_timeline`]; `I` is Zero Bubble's `B`).
fn event_name(event: &TimelineEvent) -> String {
    let letter = match event.op {
        OpKind::Forward => "F",
        OpKind::Backward => "B",
        OpKind::BackwardInput => "I",
        OpKind::BackwardWeight => "W",
        OpKind::Recompute => "R",
        OpKind::OptimizerStep => return "optimizer".to_owned(),
        OpKind::AllReduce => return "all-reduce".to_owned(),
        OpKind::Send => "send ",
        OpKind::Recv => "recv ",
        OpKind::Wait => "wait ",
        OpKind::CoreWait => "core ",
    };
    match event.micro_batch_idx {
        Some(micro_batch_idx) => format!("{letter}{micro_batch_idx}"),
        None => letter.trim_end().to_owned(),
    }
}

/// The first compute start, or 0 for a timeline without compute: the origin of the time axes.
fn origin_s(events: &[TimelineEvent]) -> f64 {
    let origin =
        events.iter().filter(|event| event.op.is_compute()).map(|event| event.start_s).fold(f64::INFINITY, f64::min);
    if origin.is_finite() { origin } else { 0.0 }
}

/// Idle intervals of each device inside `[origin_s, origin_s + makespan_s]`: the time no
/// compute op covers, device 0 first, each list in time order.
fn idle_intervals(events: &[TimelineEvent], n_devices: usize, origin_s: f64, makespan_s: f64) -> Vec<Vec<(f64, f64)>> {
    let end_s = origin_s + makespan_s;
    let mut busy: Vec<Vec<(f64, f64)>> = vec![Vec::new(); n_devices];
    for event in events.iter().filter(|event| event.op.is_compute() && event.duration_s() > 0.0) {
        busy[event.device_idx].push((event.start_s, event.end_s));
    }
    busy.into_iter()
        .map(|mut intervals| {
            intervals.sort_by(|a, b| a.0.total_cmp(&b.0));
            let mut idle = Vec::new();
            let mut cursor = origin_s;
            for (start, end) in intervals {
                if start > cursor {
                    idle.push((cursor, start.min(end_s)));
                }
                cursor = cursor.max(end);
            }
            if end_s > cursor {
                idle.push((cursor, end_s));
            }
            // Gaps below a billionth of the makespan are rounding, not bubbles.
            idle.retain(|(start, end)| end - start > makespan_s * 1e-9);
            idle
        })
        .collect()
}

/// `value` with four significant digits and no trailing zeros: `1`, `0.25`, `12.35`.
fn format_number(value: f64) -> String {
    if value == 0.0 || !value.is_finite() {
        return format!("{value}");
    }
    let decimals = (3 - value.abs().log10().floor() as i32).max(0) as usize;
    let text = format!("{value:.decimals$}");
    if text.contains('.') { text.trim_end_matches('0').trim_end_matches('.').to_owned() } else { text }
}

/// `label` if given, else `device {idx}`, as rows are named in every exporter.
fn device_name(device_labels: &[String], device_idx: usize) -> String {
    match device_labels.get(device_idx) {
        Some(label) if !label.is_empty() => format!("device {device_idx} ({label})"),
        _ => format!("device {device_idx}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(device_idx: usize, op: OpKind, start_s: f64, end_s: f64) -> TimelineEvent {
        TimelineEvent { device_idx, stage_idx: Some(device_idx), op, micro_batch_idx: Some(0), start_s, end_s }
    }

    #[test]
    fn idle_intervals_are_the_gaps_between_compute() {
        let events = [
            event(0, OpKind::Forward, 0.0, 1.0),
            event(0, OpKind::Backward, 3.0, 5.0),
            event(1, OpKind::Wait, 0.0, 1.0),
            event(1, OpKind::Forward, 1.0, 2.0),
            event(1, OpKind::Backward, 2.0, 4.0),
        ];
        let idle = idle_intervals(&events, 2, 0.0, 5.0);
        assert_eq!(idle, vec![vec![(1.0, 3.0)], vec![(0.0, 1.0), (4.0, 5.0)]]);
    }

    #[test]
    fn names_follow_the_letter_notation() {
        assert_eq!(event_name(&event(0, OpKind::BackwardInput, 0.0, 1.0)), "I0");
        assert_eq!(event_name(&event(0, OpKind::Send, 0.0, 1.0)), "send 0");
        let step =
            TimelineEvent { stage_idx: None, micro_batch_idx: None, ..event(0, OpKind::OptimizerStep, 0.0, 1.0) };
        assert_eq!(event_name(&step), "optimizer");
        assert_eq!(device_name(&["cpu:1".to_owned()], 0), "device 0 (cpu:1)");
        assert_eq!(device_name(&[], 2), "device 2");
    }

    #[test]
    fn numbers_have_four_significant_digits() {
        assert_eq!(format_number(1.0), "1");
        assert_eq!(format_number(0.25), "0.25");
        assert_eq!(format_number(12.3456), "12.35");
        assert_eq!(format_number(0.000123456), "0.0001235");
        assert_eq!(format_number(20000.0), "20000");
    }
}
