//! `conveyor simulate` end to end: runs the built binary and checks its JSON and exit codes.
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
    for (schedule, stages) in [("gpipe", 4), ("1f1b", 4), ("interleaved", 8), ("zb-h1", 4), ("zb-h2", 4)] {
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
        "multiple of n_devices",
    )?;
    assert_usage_error(&["simulate", "--schedule", "gpipe", "--stages", "2"], "--microbatches")?;
    Ok(())
}
