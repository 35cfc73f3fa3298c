//! `conveyor simulate` end to end: runs the built binary and checks its JSON, the files it
//! writes and its exit codes.
use std::path::PathBuf;
use std::process::{Command, Output};

use anyhow::{Context, Result, ensure};
use serde_json::Value;

fn conveyor(args: &[&str]) -> Result<Output> {
    Command::new(env!("CARGO_BIN_EXE_conveyor")).args(args).output().context("running conveyor")
}

fn simulate_json(args: &[&str]) -> Result<Value> {
    let mut all = vec!["simulate", "--json"];
    all.extend_from_slice(args);
    let output = conveyor(&all)?;
    ensure!(output.status.success(), "conveyor {all:?} failed: {}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).context("stdout is one JSON object")
}

fn assert_usage_error(args: &[&str], needle: &str) -> Result<()> {
    let output = conveyor(args)?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(output.status.code() == Some(2), "{args:?} exited with {:?}: {stderr}", output.status.code());
    ensure!(stderr.contains(needle), "{args:?}: stderr {stderr:?} lacks {needle:?}");
    Ok(())
}

#[test]
fn one_f_one_b_json_has_makespan_bubble_peaks_and_events() -> Result<()> {
    let json = simulate_json(&["--schedule", "1f1b", "--stages", "4", "--microbatches", "8"])?;
    // F = B = W = 1, fused backward 2: makespan 3 (m + p - 1), bubble (p - 1) / (m + p - 1).
    assert_eq!(json["makespan"].as_f64(), Some(33.0));
    let bubble = json["bubble_fraction"].as_f64().context("bubble_fraction")?;
    assert!((bubble - 3.0 / 11.0).abs() < 1e-12, "{bubble}");
    assert_eq!(json["peak_inflight"], serde_json::json!([4, 3, 2, 1]));
    let events = json["events"].as_array().context("events")?;
    let forwards: Vec<&Value> = events.iter().filter(|event| event["op"] == "forward").collect();
    assert_eq!(forwards.len(), 4 * 8);
    let first = forwards.iter().find(|event| event["device"] == 3).context("a forward on device 3")?;
    assert_eq!(first["stage"], 3);
    assert_eq!(first["micro_batch"], 0);
    assert_eq!(first["start"].as_f64(), Some(3.0));
    assert_eq!(first["end"].as_f64(), Some(4.0));
    Ok(())
}

#[test]
fn every_schedule_simulates() -> Result<()> {
    let every = [
        ("gpipe", 4),
        ("1f1b", 4),
        ("interleaved", 8),
        ("zb-h1", 4),
        ("zb-h2", 4),
        ("zb-v", 8),
        ("dualpipe-v", 8),
        ("interleaved-zb", 8),
    ];
    for (schedule, stages) in every {
        let json = simulate_json(&["--schedule", schedule, "--stages", "4", "--microbatches", "8"])?;
        assert_eq!(json["peak_inflight"].as_array().map(Vec::len), Some(stages), "{schedule}");
        assert!(json["bubble_fraction"].as_f64().is_some_and(|b| (0.0..1.0).contains(&b)), "{schedule}");
    }
    Ok(())
}

#[test]
fn interleaved_chunks_and_link_costs() -> Result<()> {
    let json = simulate_json(&["--schedule", "interleaved", "--stages", "2", "--microbatches", "4", "--chunks", "2"])?;
    assert_eq!(json["makespan"].as_f64(), Some(27.0));
    assert_eq!(json["chunks"], 2);
    // One hop of 0.5 s latency + 100 B / 100 B/s: GPipe p=2 m=1 gets two hops of 1.5 s.
    let slow = simulate_json(&[
        "--schedule",
        "gpipe",
        "--stages",
        "2",
        "--microbatches",
        "1",
        "--costs",
        "1,1,1",
        "--latency",
        "0.5",
        "--bandwidth",
        "100",
        "--message-bytes",
        "100",
    ])?;
    assert_eq!(slow["makespan"].as_f64(), Some(9.0));
    Ok(())
}

#[test]
fn text_output_has_header_timeline_and_figures() -> Result<()> {
    let output = conveyor(&["simulate", "--schedule", "gpipe", "--stages", "2", "--microbatches", "2"])?;
    ensure!(output.status.success());
    let stdout = String::from_utf8(output.stdout)?;
    for needle in ["schedule gpipe: p = 2", "dev0 |F0 F1 ", "makespan: 9 s", "bubble fraction: 0.3333", "[2, 2]"] {
        ensure!(stdout.contains(needle), "{stdout:?} lacks {needle:?}");
    }
    Ok(())
}

#[test]
fn bad_arguments_exit_2() -> Result<()> {
    assert_usage_error(&["simulate", "--schedule", "gpipe", "--stages", "0", "--microbatches", "4"], "--stages")?;
    assert_usage_error(&["simulate", "--schedule", "gpipe", "--stages", "2", "--microbatches", "0"], "--microbatches")?;
    assert_usage_error(
        &["simulate", "--schedule", "pipedream", "--stages", "2", "--microbatches", "4"],
        "unknown schedule",
    )?;
    assert_usage_error(
        &["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--chunks", "2"],
        "--chunks applies only to --schedule interleaved",
    )?;
    assert_usage_error(
        &["simulate", "--schedule", "gpipe", "--stages", "2", "--microbatches", "4", "--costs", "1,x,1"],
        "--costs",
    )?;
    assert_usage_error(
        &["simulate", "--schedule", "interleaved", "--stages", "4", "--microbatches", "6", "--chunks", "2"],
        "must be a multiple of 4; give --microbatches 8",
    )?;
    assert_usage_error(&["simulate", "--schedule", "gpipe", "--stages", "2"], "--microbatches")?;
    Ok(())
}

/// A fresh directory under the target's temporary folder, removed first if a run left it.
fn scratch_dir(name: &str) -> Result<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

#[test]
fn svg_and_trace_are_written_and_show_draws_the_chart() -> Result<()> {
    let dir = scratch_dir("simulate_cli_exports")?;
    let svg = dir.join("gpipe.svg");
    let trace = dir.join("gpipe.json");
    let (svg_arg, trace_arg) = (svg.to_str().context("utf-8 path")?, trace.to_str().context("utf-8 path")?);
    let args = ["simulate", "--schedule", "gpipe", "--stages", "4", "--microbatches", "8"];
    let output = conveyor(&[&args[..], &["--svg", svg_arg, "--trace", trace_arg, "--show"]].concat())?;
    ensure!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8(output.stdout)?;
    ensure!(stdout.contains("dev3 |..."), "--show draws the chart: {stdout}");
    ensure!(stdout.contains("odd micro-batches lower case"), "--show prints its legend: {stdout}");

    let svg_text = std::fs::read_to_string(&svg)?;
    ensure!(svg_text.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""), "{svg_text:.80}");
    ensure!(svg_text.contains("GPipe, p=4, m=8 — bubble 27.3%"));
    ensure!(svg_text.trim_end().ends_with("</svg>"));
    let trace_json: Value = serde_json::from_str(&std::fs::read_to_string(&trace)?)?;
    let events = trace_json["traceEvents"].as_array().context("traceEvents")?;
    let n_forwards = events.iter().filter(|event| event["ph"] == "X" && event["cat"] == "forward").count();
    assert_eq!(n_forwards, 4 * 8);
    // Only the two files: the temporary files were renamed away.
    let mut names: Vec<String> = std::fs::read_dir(&dir)?
        .map(|entry| Ok(entry?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_>>()?;
    names.sort();
    assert_eq!(names, ["gpipe.json", "gpipe.svg"]);

    // With --json, files are still written and stdout stays one JSON object.
    std::fs::remove_file(&svg)?;
    let json = simulate_json(&["--schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--svg", svg_arg])?;
    assert_eq!(json["makespan"].as_f64(), Some(27.0));
    ensure!(std::fs::read_to_string(&svg)?.contains("ZB-H1, p=4, m=8 — bubble 11.1%"));
    Ok(())
}

/// The V placement shows in every output: the text's placement line, the JSON's stages per
/// device, and the SVG's and the trace's row labels (device 0 holds the first and last stage).
#[test]
fn v_placement_is_visible_in_text_json_svg_and_trace() -> Result<()> {
    let dir = scratch_dir("simulate_cli_v")?;
    let (svg, trace) = (dir.join("zb-v.svg"), dir.join("zb-v.json"));
    let (svg_arg, trace_arg) = (svg.to_str().context("utf-8 path")?, trace.to_str().context("utf-8 path")?);
    let args = ["simulate", "--schedule", "zb-v", "--stages", "4", "--microbatches", "8", "--show"];
    let output = conveyor(&[&args[..], &["--svg", svg_arg, "--trace", trace_arg]].concat())?;
    ensure!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8(output.stdout)?;
    ensure!(
        stdout.contains("placement (V): dev0 stages 0, 7; dev1 stages 1, 6; dev2 stages 2, 5; dev3 stages 3, 4"),
        "{stdout}"
    );
    ensure!(stdout.contains("bubble fraction: 0.0588 (inside each device's busy span: 0.0204)"), "{stdout}");
    let svg_text = std::fs::read_to_string(&svg)?;
    ensure!(svg_text.contains("ZB-V, p=4, m=8, v=2"), "{svg_text:.200}");
    for label in ["device 0 (stages 0, 7)", "device 3 (stages 3, 4)"] {
        ensure!(svg_text.contains(label), "SVG row {label}");
        ensure!(std::fs::read_to_string(&trace)?.contains(label), "trace row {label}");
    }
    let json = simulate_json(&["--schedule", "dualpipe-v", "--stages", "4", "--microbatches", "8"])?;
    assert_eq!(json["layout"], "v");
    assert_eq!(json["stages_of_device"][0], serde_json::json!([0, 7]));
    let looped = simulate_json(&["--schedule", "interleaved-zb", "--stages", "4", "--microbatches", "8"])?;
    assert_eq!(looped["stages_of_device"][0], serde_json::json!([0, 4]));
    assert_usage_error(
        &["simulate", "--schedule", "zb-v", "--stages", "4", "--microbatches", "8", "--chunks", "3"],
        "give --chunks 2",
    )?;
    assert_usage_error(&["simulate", "--schedule", "dualpipe-v", "--stages", "4", "--microbatches", "6"], "at least 8")
}

#[test]
fn unwritable_export_paths_exit_2() -> Result<()> {
    let dir = scratch_dir("simulate_cli_bad_paths")?;
    let missing = dir.join("no-such-dir").join("out.svg");
    let missing = missing.to_str().context("utf-8 path")?;
    let base = ["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2"];
    assert_usage_error(&[&base[..], &["--svg", missing]].concat(), "does not exist")?;
    assert_usage_error(&[&base[..], &["--trace", missing]].concat(), "--trace")?;
    let directory = dir.to_str().context("utf-8 path")?;
    assert_usage_error(&[&base[..], &["--svg", directory]].concat(), "is a directory")?;
    assert_usage_error(&[&base[..], &["--json", "--show"]].concat(), "--show")?;
    ensure!(std::fs::read_dir(&dir)?.next().is_none(), "nothing was left behind in {}", dir.display());
    Ok(())
}

#[test]
fn data_parallel_all_reduces_end_the_step_and_cost_by_the_link() -> Result<()> {
    let common = ["--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--latency", "0.001"];
    let mut args = common.to_vec();
    args.extend(["--bandwidth", "4000000", "--data-parallel", "2", "--gradient-bytes", "4000000"]);
    let bucketed = simulate_json(&args)?;
    args.extend(["--bucket-size", "off"]);
    let json = simulate_json(&args)?;
    let plain = simulate_json(&common)?;
    // Ring over 2 ranks: 2 messages and 2 (R - 1) / R = 1 times the bytes.
    let per_stage = json["all_reduce_s_per_stage"].as_f64().context("all_reduce_s_per_stage")?;
    ensure!((per_stage - (2.0 * 0.001 + 1.0)).abs() < 1e-12, "{per_stage}");
    let makespan = |v: &Value| v["makespan"].as_f64().context("makespan");
    // Stage 0 finishes last; its all-reduce ends the step.
    ensure!(
        (makespan(&json)? - makespan(&plain)? - per_stage).abs() < 1e-9,
        "{} {}",
        makespan(&json)?,
        makespan(&plain)?
    );
    let reduces = json["events"].as_array().context("events")?.iter().filter(|e| e["op"] == "all_reduce").count();
    ensure!(reduces == 2);
    // In buckets (the default) each all-reduce starts with its device's final backward: part of
    // it hides under that op, so the step is shorter than at the optimizer step, never shorter
    // than without replicas.
    ensure!(bucketed["bucket_size"] == "25MiB" && json["bucket_size"] == "off");
    let (with_buckets, at_step) = (makespan(&bucketed)?, makespan(&json)?);
    ensure!(makespan(&plain)? <= with_buckets && with_buckets < at_step, "{with_buckets} against {at_step}");
    let events = bucketed["events"].as_array().context("events")?;
    let on_device_0 = |op: &'static str| events.iter().filter(move |e| e["device"] == 0 && e["op"] == op);
    let last_backward_end = on_device_0("backward").filter_map(|e| e["end"].as_f64()).fold(0.0, f64::max);
    let all_reduce_start = on_device_0("all_reduce").find_map(|e| e["start"].as_f64()).context("an all-reduce")?;
    ensure!(all_reduce_start < last_backward_end, "{all_reduce_start} {last_backward_end}");
    assert_usage_error(
        &[&["simulate"], &args[..args.len() - 2], &["--bucket-size", "lots"]].concat(),
        "--bucket-size `lots`",
    )?;
    assert_usage_error(
        &["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--data-parallel", "0"],
        "--data-parallel 0",
    )?;
    Ok(())
}

#[test]
fn overlapped_steps_have_a_shorter_period() -> Result<()> {
    let common = ["--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--costs", "1,1,1", "--steps", "3"];
    let with_commit = [&common[..], &["--optimizer-step", "0.5", "--commit-latency", "0.25"]].concat();
    let period = |json: &Value| json["step_period_s"].as_f64().context("step_period_s");
    let sync = simulate_json(&[&with_commit[..], &["--overlap-steps", "off"]].concat())?;
    let overlapped = simulate_json(&[&with_commit[..], &["--overlap-steps", "on"]].concat())?;
    ensure!(sync["steps"] == 3 && sync["overlap_steps"] == false && overlapped["overlap_steps"] == true);
    // 1F1B, p = 2, m = 4: one step takes (m + p - 1) (F + B + W) = 15 s of ops; device 0 votes
    // last, at 15. Synchronous: the optimizer steps start 0.25 s after the commit, and the next
    // step after them: 15.75 s. Overlapped: device 0 applies at once and starts the next step at
    // 15.5, the commit latency sooner.
    ensure!((period(&sync)? - 15.75).abs() < 1e-9, "{}", period(&sync)?);
    ensure!((period(&overlapped)? - 15.5).abs() < 1e-9, "{}", period(&overlapped)?);
    let makespan = |json: &Value| json["makespan"].as_f64().context("makespan");
    ensure!((makespan(&sync)? - 3.0 * 15.75).abs() < 1e-9, "{}", makespan(&sync)?);
    ensure!(makespan(&overlapped)? < makespan(&sync)?);
    // Three steps' events: three forwards of micro-batch 0 on device 0.
    let events = overlapped["events"].as_array().context("events")?;
    let first_forwards = events.iter().filter(|e| e["op"] == "forward" && e["device"] == 0 && e["micro_batch"] == 0);
    ensure!(first_forwards.count() == 3);
    // Without an optimizer cost or commit latency 1F1B gains nothing: device 0 ends each step
    // and starts the next one, with or without a barrier.
    let plain_sync = simulate_json(&common)?;
    let plain_overlapped = simulate_json(&[&common[..], &["--overlap-steps", "on"]].concat())?;
    ensure!(period(&plain_sync)? == 15.0 && period(&plain_overlapped)? == 15.0);
    // The text output names the mode and prints the period.
    let output = conveyor(&[&["simulate"], &with_commit[..], &["--overlap-steps", "on"]].concat())?;
    ensure!(output.status.success());
    let stdout = String::from_utf8(output.stdout)?;
    for needle in ["3 steps, overlapped", "step period: 15.5 s", "commit latency 0.25 s"] {
        ensure!(stdout.contains(needle), "{stdout:?} lacks {needle:?}");
    }
    // One synchronous step keeps the plain JSON: no step fields.
    let one = simulate_json(&["--schedule", "1f1b", "--stages", "2", "--microbatches", "4"])?;
    ensure!(one.get("steps").is_none() && one.get("step_period_s").is_none());
    Ok(())
}

#[test]
fn bad_step_flags_exit_2() -> Result<()> {
    let common = ["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4"];
    assert_usage_error(&[&common[..], &["--steps", "0"]].concat(), "--steps 0: give at least 1")?;
    assert_usage_error(&[&common[..], &["--overlap-steps", "maybe"]].concat(), "give --overlap-steps on")?;
    assert_usage_error(&[&common[..], &["--steps", "100000"]].concat(), "give at most 32768 steps")?;
    assert_usage_error(&[&common[..], &["--optimizer-step", "-1"]].concat(), "--optimizer-step must be")?;
    assert_usage_error(&[&common[..], &["--commit-latency", "nan"]].concat(), "--commit-latency must be")?;
    Ok(())
}
