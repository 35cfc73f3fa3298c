//! A compact terminal Gantt chart: one line per device, the makespan scaled to a given width.
//!
//! Each column covers `makespan / columns` seconds and shows the compute op that covers most of
//! it, or `.` when compute covers less than half of it. Letters as in [`crate::render_timeline`]:
//! `F` forward, `B` fused backward, `I` input gradient, `W` weight gradient, `O` optimizer step,
//! `R` recompute; odd micro-batches are lower case, so neighbouring ops of one kind stay apart
//! (`FfFf` is four forwards). Unlike [`crate::render_timeline`], the width is fixed by the
//! terminal, not by the number of ops.
use std::fmt::Write;

use super::origin_s;
use crate::timeline::{OpKind, Timeline, TimelineEvent};

/// Fewest chart columns drawn, however narrow `width` is.
const MIN_COLUMNS: usize = 8;

/// The timeline as `n_devices` lines of at most `width` characters (`dev0 |...|`), then a legend
/// line.
pub fn terminal_chart(timeline: &Timeline, width: usize) -> String {
    let name_width = format!("dev{}", timeline.n_devices.saturating_sub(1)).len();
    let n_columns = width.saturating_sub(name_width + 3).max(MIN_COLUMNS);
    let origin = origin_s(&timeline.events);
    let makespan = timeline.makespan_s();
    let column_s = if makespan > 0.0 { makespan / n_columns as f64 } else { 1.0 };
    let mut device_events: Vec<Vec<&TimelineEvent>> = vec![Vec::new(); timeline.n_devices];
    for event in timeline.events.iter().filter(|event| event.op.is_compute() && event.duration_s() > 0.0) {
        device_events[event.device_idx].push(event);
    }
    let mut kinds_seen: Vec<OpKind> = Vec::new();
    let mut out = String::new();
    // Each column looks only at the events that can overlap it: a sweep over the device's events
    // by start time, so a chart costs O(columns + events) per device, not their product.
    let mut column_events: Vec<(usize, f64)> = Vec::new();
    for (device_idx, events) in device_events.iter().enumerate() {
        write!(out, "{:<name_width$} |", format!("dev{device_idx}")).expect("writing to a String");
        let mut by_start: Vec<usize> = (0..events.len()).collect();
        by_start.sort_by(|&a, &b| events[a].start_s.total_cmp(&events[b].start_s));
        let mut first = 0;
        for column_idx in 0..n_columns {
            let start = origin + column_idx as f64 * column_s;
            let end = start + column_s;
            while first < by_start.len() && events[by_start[first]].end_s <= start {
                first += 1;
            }
            column_events.clear();
            for &event_idx in by_start[first..].iter().take_while(|&&i| events[i].start_s < end) {
                let event = events[event_idx];
                column_events.push((event_idx, (event.end_s.min(end) - event.start_s.max(start)).max(0.0)));
            }
            // In the events' own order, as a scan of all of them would sum and pick: the widest
            // overlap, the last of equals.
            column_events.sort_unstable_by_key(|&(event_idx, _)| event_idx);
            let covered: f64 = column_events.iter().map(|&(_, overlap)| overlap).sum();
            let widest =
                column_events.iter().max_by(|a, b| a.1.total_cmp(&b.1)).map(|&(event_idx, _)| events[event_idx]);
            match widest {
                Some(event) if covered >= column_s / 2.0 => {
                    if !kinds_seen.contains(&event.op) {
                        kinds_seen.push(event.op);
                    }
                    out.push(letter(event));
                }
                _ => out.push('.'),
            }
        }
        out.push_str("|\n");
    }
    let mut legend: Vec<&str> = super::ALL_KINDS
        .iter()
        .filter(|kind| kinds_seen.contains(kind))
        .map(|kind| match kind {
            OpKind::Forward => "F forward",
            OpKind::Backward => "B backward",
            OpKind::BackwardInput => "I input grad",
            OpKind::BackwardWeight => "W weight grad",
            OpKind::OptimizerStep => "O optimizer",
            _ => "R recompute",
        })
        .collect();
    legend.push(". idle");
    writeln!(
        out,
        "{}; odd micro-batches lower case; 1 column = {} s",
        legend.join(", "),
        super::format_number(column_s)
    )
    .expect("writing to a String");
    out
}

/// The event's letter, lower case for odd micro-batches.
fn letter(event: &TimelineEvent) -> char {
    let letter = match event.op {
        OpKind::Forward => 'F',
        OpKind::Backward => 'B',
        OpKind::BackwardInput => 'I',
        OpKind::BackwardWeight => 'W',
        OpKind::OptimizerStep => 'O',
        _ => 'R',
    };
    if event.micro_batch_idx.is_some_and(|micro_batch_idx| micro_batch_idx % 2 == 1) {
        letter.to_ascii_lowercase()
    } else {
        letter
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CostModel, Schedule, ScheduleKind, StageCosts, simulate};

    #[test]
    fn gpipe_two_stages_one_column_per_unit() {
        let schedule = Schedule::new(ScheduleKind::GPipe, 2, 2, 1).unwrap();
        let report = simulate(&schedule, &CostModel::uniform(StageCosts::UNIT)).unwrap();
        // Makespan 9 units; `dev0 |` + 9 + `|` = 16 characters gives one column per unit.
        let chart = terminal_chart(&report.timeline, 16);
        expect_test::expect![[r#"
            dev0 |Ff...BBbb|
            dev1 |.FfBBbb..|
            F forward, B backward, . idle; odd micro-batches lower case; 1 column = 1 s
        "#]]
        .assert_eq(&chart);
    }

    /// The chart's columns as a scan of every event per column draws them (the sweep's reference).
    fn columns_by_scan(timeline: &Timeline, width: usize) -> Vec<String> {
        let name_width = format!("dev{}", timeline.n_devices.saturating_sub(1)).len();
        let n_columns = width.saturating_sub(name_width + 3).max(MIN_COLUMNS);
        let origin = origin_s(&timeline.events);
        let makespan = timeline.makespan_s();
        let column_s = if makespan > 0.0 { makespan / n_columns as f64 } else { 1.0 };
        (0..timeline.n_devices)
            .map(|device_idx| {
                let events: Vec<&TimelineEvent> = timeline
                    .events
                    .iter()
                    .filter(|e| e.device_idx == device_idx && e.op.is_compute() && e.duration_s() > 0.0)
                    .collect();
                (0..n_columns)
                    .map(|column_idx| {
                        let start = origin + column_idx as f64 * column_s;
                        let end = start + column_s;
                        let overlap = |e: &&TimelineEvent| (e.end_s.min(end) - e.start_s.max(start)).max(0.0);
                        let covered: f64 = events.iter().map(overlap).sum();
                        match events.iter().max_by(|a, b| overlap(a).total_cmp(&overlap(b))) {
                            Some(event) if covered >= column_s / 2.0 => letter(event),
                            _ => '.',
                        }
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn the_sweep_draws_what_a_scan_of_every_event_draws() {
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved, ScheduleKind::ZbH2] {
            for (n_devices, n_micro_batches) in [(2, 4), (3, 6), (4, 8)] {
                let n_chunks = if kind == ScheduleKind::Interleaved { 2 } else { 1 };
                let schedule = Schedule::new(kind, n_devices, n_micro_batches, n_chunks).unwrap();
                let costs = CostModel::uniform(StageCosts::new(1.0, 1.7, 0.3));
                let report = simulate(&schedule, &costs).unwrap();
                for width in [10, 23, 40, 97, 300] {
                    let chart = terminal_chart(&report.timeline, width);
                    let drawn: Vec<String> =
                        chart.lines().take(n_devices).map(|line| line.split('|').nth(1).unwrap().to_string()).collect();
                    assert_eq!(drawn, columns_by_scan(&report.timeline, width), "{kind} p={n_devices} width {width}");
                }
            }
        }
    }
}
