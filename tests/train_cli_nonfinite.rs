//! `--on-nonfinite`: a diverging run (`--lr 1e20`) never commits a non-finite step. Under `error`
//! (the default) it stops naming the step, the stage and the first parameter affected, still writes
//! `--save` and `--checkpoint` from the last good step, and exits with status 3; under `skip:N` it
//! skips such steps, counts them in the metrics, and gives up after N in a row.
mod train_cli_support;

use train_cli_support::{arg, conveyor, f32s, metrics, parameters, read_checkpoint, temp_dir};

const DIVERGING: &[&str] = &[
    "train",
    "--model",
    "mlp:8,16,16,4",
    "--data",
    "synthetic:64,8,4",
    "--devices",
    "cpu:2",
    "--batch",
    "16",
    "--microbatches",
    "4",
    "--steps",
    "12",
    "--optimizer",
    "sgd",
    "--lr",
    "1e20",
    "--log-every",
    "0",
];

#[test]
fn a_diverging_run_stops_at_the_first_non_finite_step_and_keeps_the_last_good_weights() {
    let dir = temp_dir("nonfinite-error");
    let (save, checkpoint, metrics_path) = (dir.join("w.safetensors"), dir.join("c.safetensors"), dir.join("m.jsonl"));
    let mut args = DIVERGING.to_vec();
    args.extend(["--save", arg(&save), "--checkpoint", arg(&checkpoint), "--metrics", arg(&metrics_path)]);
    let out = conveyor(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    for phrase in ["is not finite on stage", "first affected parameter `", "not committed", "--on-nonfinite skip"] {
        assert!(stderr.contains(phrase), "expected `{phrase}` in {stderr}");
    }
    let lines = metrics(&metrics_path);
    let summary = lines.last().unwrap();
    let good_steps = summary["steps"].as_u64().unwrap();
    assert!(good_steps < 12, "the run should have stopped early: {summary}");
    assert!(stderr.contains(&format!("step {}:", good_steps + 1)), "{stderr}");
    // The saved weights are the last good step's: all finite, at that step.
    for (name, (_, _, bytes)) in parameters(&save) {
        assert!(f32s(&bytes).iter().all(|v| v.is_finite()), "{name} holds a non-finite value");
    }
    let (_, meta) = read_checkpoint(&checkpoint);
    assert_eq!(meta.get("conveyor.train.step").map(String::as_str), Some(good_steps.to_string().as_str()), "{meta:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn skip_counts_skipped_steps_and_gives_up_after_n_in_a_row() {
    let dir = temp_dir("nonfinite-skip");
    let metrics_path = dir.join("m.jsonl");
    let mut args = DIVERGING.to_vec();
    args.extend(["--on-nonfinite", "skip:3", "--metrics", arg(&metrics_path)]);
    let out = conveyor(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    let lines = metrics(&metrics_path);
    let skipped: Vec<_> = lines.iter().filter(|l| l["skipped"] == true).collect();
    assert_eq!(skipped.len(), 3, "three skipped steps before giving up: {lines:?}");
    assert_eq!(lines.last().unwrap()["skipped_steps"], 3);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_bad_policy_is_a_usage_error() {
    let mut args = DIVERGING.to_vec();
    args.extend(["--on-nonfinite", "skip:0"]);
    let out = conveyor(&args);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--on-nonfinite `skip:0`"));
}
