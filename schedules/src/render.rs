//! Text rendering of a timeline: one row per device, one fixed-width cell per time unit.
//!
//! Labels: `F` forward, `B` fused backward, `I` input gradient (Zero Bubble's `B`), `W` weight
//! gradient, `O` optimizer step, `R` recompute, followed by the micro-batch; on devices holding
//! several stages, `:c` names the chunk. An op longer than one cell continues with `-`; `.` is
//! idle. Only compute ops are drawn.
use std::fmt::Write;

use crate::timeline::{OpKind, Timeline};

/// Most cells a row may have; longer timelines use coarser cells.
const MAX_CELLS: usize = 400;

/// Renders `timeline` with one cell per shortest compute op (or coarser, to fit 400 cells).
pub fn render_timeline(timeline: &Timeline) -> String {
    let shortest = timeline
        .events
        .iter()
        .filter(|event| (event.op.is_compute() || event.op == OpKind::AllReduce) && event.duration_s() > 0.0)
        .map(|event| event.duration_s())
        .fold(f64::INFINITY, f64::min);
    let cell_s = if shortest.is_finite() { shortest } else { 1.0 };
    let cell_s = cell_s.max(timeline.makespan_s() / MAX_CELLS as f64);
    render_timeline_with_cell(timeline, cell_s)
}

/// Renders `timeline` with cells of `cell_s` seconds.
pub fn render_timeline_with_cell(timeline: &Timeline, cell_s: f64) -> String {
    let origin = timeline
        .events
        .iter()
        .filter(|event| event.op.is_compute())
        .map(|event| event.start_s)
        .fold(f64::INFINITY, f64::min);
    let origin = if origin.is_finite() { origin } else { 0.0 };
    let to_cell = |time_s: f64| ((time_s - origin) / cell_s).round().max(0.0) as usize;
    let n_cells = to_cell(origin + timeline.makespan_s()).max(1);
    // Stages of each device, sorted, to number chunks.
    let mut device_stages = vec![Vec::new(); timeline.n_devices];
    for event in &timeline.events {
        if let Some(stage_idx) = event.stage_idx
            && !device_stages[event.device_idx].contains(&stage_idx)
        {
            device_stages[event.device_idx].push(stage_idx);
        }
    }
    device_stages.iter_mut().for_each(|stages| stages.sort_unstable());
    let mut rows = vec![vec![String::new(); n_cells]; timeline.n_devices];
    for event in timeline
        .events
        .iter()
        .filter(|event| (event.op.is_compute() || event.op == OpKind::AllReduce) && event.duration_s() > 0.0)
    {
        let letter = match event.op {
            OpKind::Forward => "F",
            OpKind::Backward => "B",
            OpKind::BackwardInput => "I",
            OpKind::BackwardWeight => "W",
            OpKind::OptimizerStep => "O",
            OpKind::Recompute => "R",
            OpKind::AllReduce => "A",
            OpKind::Send | OpKind::Recv | OpKind::Wait | OpKind::CoreWait => continue,
        };
        let mut label = letter.to_owned();
        if let Some(micro_batch_idx) = event.micro_batch_idx {
            write!(label, "{micro_batch_idx}").expect("writing to a String");
        }
        let stages = &device_stages[event.device_idx];
        if let (true, Some(stage_idx)) = (stages.len() > 1, event.stage_idx) {
            let chunk_idx = stages.iter().position(|&s| s == stage_idx).expect("collected above");
            write!(label, ":{chunk_idx}").expect("writing to a String");
        }
        let first = to_cell(event.start_s).min(n_cells - 1);
        let last = to_cell(event.end_s).clamp(first + 1, n_cells);
        let row = &mut rows[event.device_idx];
        for (offset, cell) in row[first..last].iter_mut().enumerate() {
            *cell = if offset == 0 { label.clone() } else { "-".to_owned() };
        }
    }
    let width = rows.iter().flatten().map(String::len).max().unwrap_or(1).max(1) + 1;
    let name_width = format!("dev{}", timeline.n_devices.saturating_sub(1)).len();
    let mut out = String::new();
    for (device_idx, row) in rows.iter().enumerate() {
        let name = format!("dev{device_idx}");
        write!(out, "{name:<name_width$} |").expect("writing to a String");
        for cell in row {
            let cell = if cell.is_empty() { "." } else { cell.as_str() };
            write!(out, "{cell:<width$}").expect("writing to a String");
        }
        out.push_str("|\n");
    }
    out
}
