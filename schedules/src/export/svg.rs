//! A self-contained SVG Gantt chart of a timeline.
//!
//! Layout, top to bottom: the title (with the bubble fraction) and a line of figures; one row
//! per device (`<g class="device-row" data-device="d">`), each a bar of compute ops over the
//! makespan (`<rect class="row">` outlines it) with a thin lane beneath for waits, sends and
//! receives; the time axis, with ticks at 1, 2 or 5 times a power of ten in `s`, `ms` or `µs`;
//! the legend. Idle time inside the makespan is a hatched `<rect class="bubble">` under the
//! bar; every op and bubble carries a `<title>` tooltip. No scripts, fonts or external files.
use std::fmt::Write;

use super::{ALL_KINDS, device_name, format_number, idle_intervals, origin_s};
use crate::timeline::{OpKind, Timeline, TimelineEvent};

/// What [`svg_gantt`] draws besides the timeline.
#[derive(Debug, Clone, PartialEq)]
pub struct SvgOptions {
    /// Title, e.g. `1F1B, p=4, m=8`; the chart appends ` — bubble 27.3%`.
    pub title: String,
    /// Label of each device, device 0 first (e.g. `cpu:0`): rows read `device 0 (cpu:0)`, or
    /// `device 0` where a label is missing or empty.
    pub device_labels: Vec<String>,
    /// Width of the picture, pixels (at least 400 are used).
    pub width_px: u32,
}

impl Default for SvgOptions {
    fn default() -> SvgOptions {
        SvgOptions { title: String::new(), device_labels: Vec::new(), width_px: 1200 }
    }
}

const TOP_PX: f64 = 70.0;
const BAR_PX: f64 = 26.0;
const LANE_GAP_PX: f64 = 2.0;
const LANE_PX: f64 = 6.0;
const ROW_PITCH_PX: f64 = 46.0;
const RIGHT_PX: f64 = 30.0;
const FONT_PX: f64 = 12.0;
const OP_FONT_PX: f64 = 11.0;
/// Labels of narrow ops fall back to this font size.
const SMALL_FONT_PX: f64 = 9.0;
/// Rough advance of one character of a sans-serif font, in ems (DejaVu Sans digits are 0.64),
/// for fitting labels.
const CHAR_EM: f64 = 0.64;
const BUBBLE_FILL: &str = "url(#bubble-hatch)";

/// Fill and label colour of each kind (Tableau 10, readable with either text colour).
fn colours(kind: OpKind) -> (&'static str, &'static str) {
    match kind {
        OpKind::Forward => ("#4e79a7", "#ffffff"),
        OpKind::Backward => ("#f28e2b", "#000000"),
        OpKind::BackwardInput => ("#edc948", "#000000"),
        OpKind::BackwardWeight => ("#59a14f", "#ffffff"),
        OpKind::OptimizerStep => ("#5f5f5f", "#ffffff"),
        OpKind::Recompute => ("#76b7b2", "#000000"),
        OpKind::Wait => ("#a8a8a8", "#000000"),
        OpKind::CoreWait => ("#ff9da7", "#000000"),
        OpKind::Send => ("#9c755f", "#ffffff"),
        OpKind::Recv => ("#b07aa1", "#ffffff"),
        OpKind::AllReduce => ("#e15759", "#ffffff"),
    }
}

fn legend_text(kind: OpKind) -> &'static str {
    match kind {
        OpKind::Forward => "F forward",
        OpKind::Backward => "B backward",
        OpKind::BackwardInput => "I backward input",
        OpKind::BackwardWeight => "W backward weight",
        OpKind::OptimizerStep => "optimizer step",
        OpKind::Recompute => "R recompute",
        OpKind::Wait => "wait for input",
        OpKind::CoreWait => "wait for a core",
        OpKind::Send => "send",
        OpKind::Recv => "receive",
        OpKind::AllReduce => "gradient all-reduce",
    }
}

/// The timeline as an SVG document.
pub fn svg_gantt(timeline: &Timeline, options: &SvgOptions) -> String {
    let width = f64::from(options.width_px.max(400));
    let n_devices = timeline.n_devices;
    let names: Vec<String> = (0..n_devices).map(|device_idx| device_name(&options.device_labels, device_idx)).collect();
    let label_chars = names.iter().map(|name| name.chars().count()).max().unwrap_or(0);
    let left = (label_chars as f64 * 7.2 + 24.0).max(90.0);
    let plot_width = width - left - RIGHT_PX;
    let origin = origin_s(&timeline.events);
    let makespan = timeline.makespan_s();
    let span = if makespan > 0.0 { makespan } else { 1.0 };
    let x_of = |time_s: f64| left + ((time_s - origin) / span).clamp(0.0, 1.0) * plot_width;
    let row_top = |device_idx: usize| TOP_PX + device_idx as f64 * ROW_PITCH_PX;
    let rows_bottom = row_top(n_devices) - ROW_PITCH_PX + BAR_PX + LANE_GAP_PX + LANE_PX;
    let axis_y = rows_bottom + 8.0;

    let kinds_present: Vec<OpKind> = ALL_KINDS
        .iter()
        .copied()
        .filter(|kind| timeline.events.iter().any(|event| event.op == *kind && event.duration_s() > 0.0))
        .collect();
    let legend_items: Vec<(Option<OpKind>, &str)> =
        kinds_present.iter().map(|&kind| (Some(kind), legend_text(kind))).chain([(None, "bubble (idle)")]).collect();
    let legend_layout = layout_legend(&legend_items, left, width - RIGHT_PX);
    let legend_top = axis_y + 64.0;
    let n_legend_lines = legend_layout.iter().map(|&(_, line)| line + 1).max().unwrap_or(1);
    let height = legend_top + n_legend_lines as f64 * 20.0 + 8.0;

    let mut out = String::new();
    let w = &mut out;
    let title = if options.title.is_empty() { "pipeline timeline" } else { options.title.as_str() };
    let heading = format!("{title} — bubble {:.1}%", 100.0 * timeline.bubble_fraction());
    let _ = writeln!(
        w,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="{FONT_PX}">"##
    );
    let _ = writeln!(w, "<title>{}</title>", escape(&heading));
    let _ = writeln!(
        w,
        r##"<defs><pattern id="bubble-hatch" patternUnits="userSpaceOnUse" width="6" height="6" patternTransform="rotate(45)"><rect width="6" height="6" fill="#fde3e3"/><line x1="0" y1="0" x2="0" y2="6" stroke="#e15759" stroke-width="2"/></pattern></defs>"##
    );
    let _ = writeln!(w, r##"<rect width="100%" height="100%" fill="#ffffff"/>"##);
    let _ = writeln!(
        w,
        r##"<text class="title" x="{left}" y="26" font-size="17" font-weight="bold">{}</text>"##,
        escape(&heading)
    );
    let busy: f64 = timeline.busy_s().iter().sum();
    let figures = format!(
        "makespan {} s · {n_devices} devices, {} stages · compute {} s of {} s device time · interior bubble {:.1}%",
        format_number(makespan),
        timeline.n_stages,
        format_number(busy),
        format_number(makespan * n_devices as f64),
        100.0 * timeline.interior_bubble_fraction()
    );
    let _ = writeln!(w, r##"<text class="figures" x="{left}" y="48" fill="#555555">{}</text>"##, escape(&figures));

    // Ticks and grid lines first, so that rows draw over them.
    let (unit, unit_s) = time_unit(span);
    let step_s = tick_step(span, (plot_width / 80.0).max(2.0));
    let n_ticks = (span / step_s + 1e-9).floor() as usize;
    let _ = writeln!(w, r##"<g class="axis" stroke="#d9d9d9">"##);
    for tick_idx in 0..=n_ticks {
        let x = x_of(origin + tick_idx as f64 * step_s);
        let _ = writeln!(w, r##"<line x1="{x:.2}" y1="{:.2}" x2="{x:.2}" y2="{axis_y:.2}"/>"##, TOP_PX - 6.0);
    }
    let _ = writeln!(w, "</g>");

    let device_stages = stages_per_device(timeline);
    let idle = idle_intervals(&timeline.events, n_devices, origin, makespan);
    for device_idx in 0..n_devices {
        let top = row_top(device_idx);
        let _ = writeln!(w, r#"<g class="device-row" data-device="{device_idx}">"#);
        let _ = writeln!(
            w,
            r##"<text class="row-label" x="{:.2}" y="{:.2}" text-anchor="end">{}</text>"##,
            left - 10.0,
            top + BAR_PX / 2.0 + 4.0,
            escape(&names[device_idx])
        );
        let _ = writeln!(
            w,
            r##"<rect class="row" x="{left:.2}" y="{top:.2}" width="{plot_width:.2}" height="{BAR_PX}" fill="#ffffff" stroke="#bdbdbd"/>"##
        );
        for &(start, end) in &idle[device_idx] {
            let (x, bar_width) = (x_of(start), x_of(end) - x_of(start));
            let _ = writeln!(
                w,
                r##"<rect class="bubble" x="{x:.2}" y="{top:.2}" width="{bar_width:.2}" height="{BAR_PX}" fill="{BUBBLE_FILL}"><title>bubble: idle {} s ({} s to {} s)</title></rect>"##,
                format_number(end - start),
                format_number(start - origin),
                format_number(end - origin)
            );
        }
        let mut events: Vec<&TimelineEvent> =
            timeline.events.iter().filter(|event| event.device_idx == device_idx && event.duration_s() > 0.0).collect();
        events.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
        for event in events {
            let (fill, text_fill) = colours(event.op);
            let x = x_of(event.start_s);
            let bar_width = x_of(event.end_s) - x;
            let name = label(event, &device_stages[device_idx]);
            let tooltip = format!(
                "{name}: {}{} s to {} s ({} s)",
                event.stage_idx.map(|stage_idx| format!("stage {stage_idx}, ")).unwrap_or_default(),
                format_number(event.start_s - origin),
                format_number(event.end_s - origin),
                format_number(event.duration_s())
            );
            let class = super::kind_name(event.op);
            if !event.op.is_compute() {
                let lane_top = top + BAR_PX + LANE_GAP_PX;
                let _ = writeln!(
                    w,
                    r##"<rect class="lane {class}" x="{x:.2}" y="{lane_top:.2}" width="{bar_width:.2}" height="{LANE_PX}" fill="{fill}"><title>{}</title></rect>"##,
                    escape(&tooltip)
                );
                continue;
            }
            let _ = writeln!(
                w,
                r##"<rect class="op {class}" x="{x:.2}" y="{top:.2}" width="{bar_width:.2}" height="{BAR_PX}" fill="{fill}" stroke="#ffffff" stroke-width="1"><title>{}</title></rect>"##,
                escape(&tooltip)
            );
            // The longest label that fits: `F3:1`, `3:1` (the colour names the kind), `F3`, `3`,
            // then `3` in a smaller font.
            let number = event.micro_batch_idx.map(|micro_batch_idx| micro_batch_idx.to_string());
            let letter_len = name.len() - name.trim_start_matches(|c: char| c.is_ascii_alphabetic()).len();
            let candidates = [
                Some((name.clone(), OP_FONT_PX)),
                name.contains(':').then(|| (name[letter_len..].to_owned(), OP_FONT_PX)),
                Some((super::event_name(event), OP_FONT_PX)),
                number.clone().map(|number| (number, OP_FONT_PX)),
                number.map(|number| (number, SMALL_FONT_PX)),
            ];
            if let Some((text, font_px)) =
                candidates.into_iter().flatten().find(|(text, font_px)| fits(text, *font_px, bar_width))
            {
                let _ = writeln!(
                    w,
                    r##"<text class="op-label" x="{:.2}" y="{:.2}" text-anchor="middle" font-size="{font_px}" fill="{text_fill}" pointer-events="none">{}</text>"##,
                    x + bar_width / 2.0,
                    top + BAR_PX / 2.0 + font_px * 0.36,
                    escape(&text)
                );
            }
        }
        let _ = writeln!(w, "</g>");
    }

    let _ = writeln!(w, r##"<g class="axis-ticks" font-size="{OP_FONT_PX}" fill="#333333">"##);
    let _ = writeln!(
        w,
        r##"<line x1="{left:.2}" y1="{axis_y:.2}" x2="{:.2}" y2="{axis_y:.2}" stroke="#333333"/>"##,
        left + plot_width
    );
    for tick_idx in 0..=n_ticks {
        let offset_s = tick_idx as f64 * step_s;
        let x = x_of(origin + offset_s);
        let _ = writeln!(
            w,
            r##"<line x1="{x:.2}" y1="{axis_y:.2}" x2="{x:.2}" y2="{:.2}" stroke="#333333"/><text x="{x:.2}" y="{:.2}" text-anchor="middle">{}</text>"##,
            axis_y + 5.0,
            axis_y + 18.0,
            format_number(offset_s / unit_s)
        );
    }
    let _ = writeln!(
        w,
        r##"<text class="axis-unit" x="{:.2}" y="{:.2}" text-anchor="middle" font-size="{FONT_PX}">time ({unit}) from the first op</text>"##,
        left + plot_width / 2.0,
        axis_y + 34.0
    );
    let _ = writeln!(w, "</g>");

    let _ = writeln!(w, r#"<g class="legend">"#);
    for ((kind, text), &(x, line)) in legend_items.iter().zip(&legend_layout) {
        let y = legend_top + line as f64 * 20.0;
        let swatch = match kind {
            Some(kind) if kind.is_compute() => {
                format!(
                    r##"<rect x="{x:.2}" y="{:.2}" width="14" height="14" fill="{}"/>"##,
                    y - 11.0,
                    colours(*kind).0
                )
            }
            Some(kind) => format!(
                r##"<rect x="{x:.2}" y="{:.2}" width="14" height="{LANE_PX}" fill="{}"/>"##,
                y - 7.0,
                colours(*kind).0
            ),
            None => format!(
                r##"<rect x="{x:.2}" y="{:.2}" width="14" height="14" fill="{BUBBLE_FILL}" stroke="#e15759"/>"##,
                y - 11.0
            ),
        };
        let _ = writeln!(w, r##"{swatch}<text x="{:.2}" y="{y:.2}">{}</text>"##, x + 19.0, escape(text));
    }
    let _ = writeln!(w, "</g>");
    let _ = writeln!(w, "</svg>");
    out
}

/// `(x, line)` of each legend item, wrapping at `right`.
fn layout_legend(items: &[(Option<OpKind>, &str)], left: f64, right: f64) -> Vec<(f64, usize)> {
    let mut layout = Vec::new();
    let (mut x, mut line) = (left, 0);
    for (_, text) in items {
        let item_width = 19.0 + text.chars().count() as f64 * 7.0 + 22.0;
        if x > left && x + item_width > right {
            x = left;
            line += 1;
        }
        layout.push((x, line));
        x += item_width;
    }
    layout
}

/// The unit the axis counts in, and its length in seconds.
fn time_unit(span_s: f64) -> (&'static str, f64) {
    if span_s >= 1.0 {
        ("s", 1.0)
    } else if span_s >= 1e-3 {
        ("ms", 1e-3)
    } else {
        ("µs", 1e-6)
    }
}

/// The smallest of 1, 2, 5 times a power of ten giving at most `max_ticks` intervals over `span_s`.
fn tick_step(span_s: f64, max_ticks: f64) -> f64 {
    let raw = span_s / max_ticks;
    let power = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|multiple| multiple * power).find(|&step| step >= raw).unwrap_or(10.0 * power)
}

/// Stages each device runs, sorted, to number chunks on devices with several.
fn stages_per_device(timeline: &Timeline) -> Vec<Vec<usize>> {
    let mut stages = vec![Vec::new(); timeline.n_devices];
    for event in &timeline.events {
        if let Some(stage_idx) = event.stage_idx
            && !stages[event.device_idx].contains(&stage_idx)
        {
            stages[event.device_idx].push(stage_idx);
        }
    }
    stages.iter_mut().for_each(|stages| stages.sort_unstable());
    stages
}

/// `F3`, or `F3:1` (chunk 1) on a device holding several stages.
fn label(event: &TimelineEvent, device_stages: &[usize]) -> String {
    let mut name = super::event_name(event);
    if let (true, Some(stage_idx), true) = (device_stages.len() > 1, event.stage_idx, event.op.is_compute())
        && let Some(chunk_idx) = device_stages.iter().position(|&stage| stage == stage_idx)
    {
        let _ = write!(name, ":{chunk_idx}");
    }
    name
}

/// Whether `text` in a `font_px` font fits inside a bar `width_px` wide with a little padding.
fn fits(text: &str, font_px: f64, width_px: f64) -> bool {
    text.chars().count() as f64 * CHAR_EM * font_px + 3.0 <= width_px
}

/// `text` with the five XML special characters escaped.
fn escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for character in text.chars() {
        match character {
            '&' => escaped.push_str("&amp;"),
            '<' => escaped.push_str("&lt;"),
            '>' => escaped.push_str("&gt;"),
            '"' => escaped.push_str("&quot;"),
            '\'' => escaped.push_str("&apos;"),
            _ => escaped.push(character),
        }
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_one_two_five() {
        assert_eq!(tick_step(33.0, 12.0), 5.0);
        assert_eq!(tick_step(27.0, 14.0), 2.0);
        assert_eq!(tick_step(0.004, 10.0), 0.0005);
        assert_eq!(time_unit(0.004), ("ms", 1e-3));
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(escape(r#"a<b & "c" 'd'>"#), "a&lt;b &amp; &quot;c&quot; &apos;d&apos;&gt;");
        let svg = svg_gantt(&Timeline::new(1, 1), &SvgOptions { title: "<&>".into(), ..SvgOptions::default() });
        assert!(svg.contains("&lt;&amp;&gt; — bubble 0.0%"));
    }
}
