//! Exporters on simulated timelines: the Chrome trace parses and counts one event per op; the
//! SVG Gantt chart is well-formed XML with one row per device and its bubbles where the
//! schedule puts them.
use std::collections::HashMap;

use anyhow::{Context, Result, ensure};
use conveyor_schedules::export::{MemorySample, SvgOptions, TraceOptions, chrome_trace, svg_gantt, terminal_chart};
use conveyor_schedules::{CostModel, Schedule, ScheduleKind, StageCosts, Timeline, simulate};
use serde_json::Value;

fn simulated(kind: ScheduleKind, n_devices: usize, n_micro_batches: usize) -> Result<Timeline> {
    let schedule = Schedule::new(kind, n_devices, n_micro_batches, 1)?;
    Ok(simulate(&schedule, &CostModel::uniform(StageCosts::UNIT))?.timeline)
}

#[test]
fn chrome_trace_of_one_f_one_b_has_one_event_per_forward_and_backward() -> Result<()> {
    let timeline = simulated(ScheduleKind::OneFOneB, 4, 8)?;
    let labels: Vec<String> = (0..4).map(|device_idx| format!("cpu:{device_idx}")).collect();
    let samples = vec![
        MemorySample { device_idx: 0, time_s: 0.0, bytes: 0 },
        MemorySample { device_idx: 0, time_s: 4.0, bytes: 1 << 20 },
    ];
    let options = TraceOptions { device_labels: labels, memory_samples: samples };
    let trace: Value = serde_json::from_str(&chrome_trace(&timeline, &options)).context("the trace is JSON")?;
    assert_eq!(trace["displayTimeUnit"], "ms");
    let events = trace["traceEvents"].as_array().context("traceEvents")?;

    // Exactly one X event per (micro-batch, stage) for F and for B.
    for (cat, letter) in [("forward", "F"), ("backward", "B")] {
        let mut counts: HashMap<(u64, u64), usize> = HashMap::new();
        for event in events.iter().filter(|event| event["ph"] == "X" && event["cat"] == cat) {
            let micro_batch_idx = event["args"]["micro_batch"].as_u64().context("micro_batch")?;
            let stage_idx = event["args"]["stage"].as_u64().context("stage")?;
            assert_eq!(event["name"], format!("{letter}{micro_batch_idx}"));
            assert_eq!(event["tid"], stage_idx, "one stage per device: tid is the stage's device");
            assert!(event["dur"].as_f64().is_some_and(|dur| dur > 0.0));
            *counts.entry((micro_batch_idx, stage_idx)).or_default() += 1;
        }
        assert_eq!(counts.len(), 8 * 4, "{cat}");
        assert!(counts.values().all(|&count| count == 1), "{cat}: {counts:?}");
    }
    // F = 1 s: stage 3's first forward runs from 3 s to 4 s.
    let first = events
        .iter()
        .find(|event| event["cat"] == "forward" && event["args"]["stage"] == 3 && event["args"]["micro_batch"] == 0)
        .context("F0 on stage 3")?;
    assert_eq!((first["ts"].as_f64(), first["dur"].as_f64()), (Some(3e6), Some(1e6)));

    let rows: Vec<(u64, &str)> = events
        .iter()
        .filter(|event| event["ph"] == "M" && event["name"] == "thread_name")
        .map(|event| (event["tid"].as_u64().unwrap_or(u64::MAX), event["args"]["name"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(
        rows,
        [(0, "device 0 (cpu:0)"), (1, "device 1 (cpu:1)"), (2, "device 2 (cpu:2)"), (3, "device 3 (cpu:3)")]
    );
    let counters: Vec<&Value> = events.iter().filter(|event| event["ph"] == "C").collect();
    assert_eq!(counters.len(), 2);
    assert!(counters.iter().all(|event| event["name"] == "memory"));
    assert_eq!(counters[1]["args"]["bytes"], 1 << 20);
    Ok(())
}

/// A rectangle's horizontal extent, pixels.
fn extent(node: roxmltree::Node) -> Result<(f64, f64)> {
    let x: f64 = node.attribute("x").context("x")?.parse()?;
    let width: f64 = node.attribute("width").context("width")?.parse()?;
    Ok((x, x + width))
}

#[test]
fn svg_of_gpipe_is_xml_with_four_rows_and_bubbles_at_fill_and_drain() -> Result<()> {
    let timeline = simulated(ScheduleKind::GPipe, 4, 8)?;
    let options = SvgOptions { title: "GPipe, p=4, m=8".to_owned(), ..SvgOptions::default() };
    let svg = svg_gantt(&timeline, &options);
    let document = roxmltree::Document::parse(&svg).context("the SVG is well-formed XML")?;
    let root = document.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    assert_eq!(root.tag_name().namespace(), Some("http://www.w3.org/2000/svg"));
    let title = root.descendants().find(|node| node.attribute("class") == Some("title")).context("title")?;
    assert_eq!(title.text(), Some("GPipe, p=4, m=8 — bubble 27.3%"));

    let rows: Vec<roxmltree::Node> =
        root.descendants().filter(|node| node.attribute("class") == Some("device-row")).collect();
    assert_eq!(rows.len(), 4);
    // F = B = W = 1, fused backward 2, makespan 33. Device d idles d units while the forward
    // wave fills, 9 - 3d between its last forward and its first backward, and 2d after its last
    // backward (the backward wave drains towards device 0); (p - 1) (F + B + W) = 9 in all.
    let makespan = 33.0;
    for (device_idx, row) in rows.iter().enumerate() {
        assert_eq!(row.attribute("data-device"), Some(device_idx.to_string().as_str()));
        let label = row.children().find(|node| node.attribute("class") == Some("row-label")).context("row label")?;
        assert_eq!(label.text(), Some(format!("device {device_idx}").as_str()));
        let frame = row.children().find(|node| node.attribute("class") == Some("row")).context("row frame")?;
        let (left, right) = extent(frame)?;
        let to_time = |x: f64| (x - left) / (right - left) * makespan;
        let mut bubbles = Vec::new();
        for bubble in row.children().filter(|node| node.attribute("class") == Some("bubble")) {
            let (start, end) = extent(bubble)?;
            bubbles.push((to_time(start), to_time(end)));
            let tooltip = bubble.children().find(|node| node.has_tag_name("title")).and_then(|node| node.text());
            ensure!(tooltip.is_some_and(|text| text.starts_with("bubble")), "{tooltip:?}");
        }
        let d = device_idx as f64;
        let expected: Vec<(f64, f64)> = [(0.0, d), (8.0 + d, 17.0 - 2.0 * d), (makespan - 2.0 * d, makespan)]
            .into_iter()
            .filter(|(s, e)| e > s)
            .collect();
        ensure!(bubbles.len() == expected.len(), "device {device_idx}: bubbles {bubbles:?}, expected {expected:?}");
        for (got, want) in bubbles.iter().zip(&expected) {
            // Coordinates are written with two decimals: well under 0.01 units at ~30 px per unit.
            ensure!(
                (got.0 - want.0).abs() < 0.01 && (got.1 - want.1).abs() < 0.01,
                "device {device_idx}: {got:?} vs {want:?}"
            );
        }
    }
    // So the last devices start and end idle (fill and drain), the first starts and ends busy.
    let ops = |device_idx: usize| {
        rows[device_idx].children().filter(|node| node.attribute("class") == Some("op backward")).count()
    };
    assert!((0..4).all(|device_idx| ops(device_idx) == 8));
    let legend = root.descendants().find(|node| node.attribute("class") == Some("legend")).context("legend")?;
    let legend_text: Vec<&str> =
        legend.children().filter(|node| node.has_tag_name("text")).filter_map(|node| node.text()).collect();
    assert_eq!(legend_text, ["F forward", "B backward", "wait for input", "bubble (idle)"]);
    Ok(())
}

#[test]
fn svg_of_every_schedule_parses_and_labels_rows() -> Result<()> {
    for kind in ScheduleKind::ALL {
        let n_chunks = if kind.supports_chunks() { 2 } else { 1 };
        let schedule = Schedule::new(kind, 4, 8, n_chunks)?;
        let timeline = simulate(&schedule, &CostModel::uniform(StageCosts::new(1.0, 2.0, 1.0)))?.timeline;
        let labels: Vec<String> = ["cpu:0", "cuda:0 <&>", "", "cpu:3"].map(str::to_owned).to_vec();
        let svg =
            svg_gantt(&timeline, &SvgOptions { title: format!("{kind} & co"), device_labels: labels, width_px: 900 });
        let document = roxmltree::Document::parse(&svg).with_context(|| format!("{kind}: SVG is XML"))?;
        let names: Vec<&str> = document
            .descendants()
            .filter(|node| node.attribute("class") == Some("row-label"))
            .filter_map(|node| node.text())
            .collect();
        assert_eq!(names, ["device 0 (cpu:0)", "device 1 (cuda:0 <&>)", "device 2", "device 3 (cpu:3)"], "{kind}");
        let n_compute =
            timeline.events.iter().filter(|event| event.op.is_compute() && event.duration_s() > 0.0).count();
        let n_op_rects = document
            .descendants()
            .filter(|node| node.attribute("class").is_some_and(|class| class.starts_with("op ")))
            .count();
        assert_eq!(n_op_rects, n_compute, "{kind}");
    }
    Ok(())
}

#[test]
fn terminal_chart_fits_its_width_and_marks_idle() -> Result<()> {
    let timeline = simulated(ScheduleKind::GPipe, 4, 8)?;
    let chart = terminal_chart(&timeline, 80);
    let lines: Vec<&str> = chart.lines().collect();
    assert_eq!(lines.len(), 5);
    assert!(lines[..4].iter().all(|line| line.chars().count() == 80), "{chart}");
    // Device 3 waits 3 of 33 units for its first forward: the row starts idle.
    assert!(lines[3].starts_with("dev3 |......"), "{chart}");
    assert!(lines[0].starts_with("dev0 |FF"), "{chart}");
    Ok(())
}
