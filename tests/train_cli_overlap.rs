//! `conveyor train --overlap-steps on|off`: overlapped steps train the same model bit for bit as
//! synchronous ones through the CLI's whole loop (a cosine learning-rate schedule that changes
//! every step, evaluations and periodic checkpoints that cut the run into stretches, a
//! zero-bubble schedule), write the same metrics, and a bad value or a config key is handled like
//! every other flag.
mod train_cli_support;

use train_cli_support::{arg, assert_usage_error, conveyor_ok, metrics, parameters, temp_dir};

/// Trains with `--overlap-steps mode` and returns the saved parameters and the metrics lines.
fn train(mode: &str, schedule: &str, dir: &std::path::Path) -> (train_cli_support::RawTensors, Vec<serde_json::Value>) {
    let (model, metrics_path, checkpoint) = (
        dir.join(format!("{mode}-{schedule}.safetensors")),
        dir.join(format!("{mode}-{schedule}.jsonl")),
        dir.join(format!("{mode}-{schedule}.ckpt")),
    );
    conveyor_ok(&[
        "train",
        "--model",
        "mlp:8,32,32,4",
        "--data",
        "synthetic:240,8,4",
        "--test-fraction",
        "0.25",
        "--devices",
        "cpu:2",
        "--schedule",
        schedule,
        "--batch",
        "12",
        "--microbatches",
        "4",
        "--steps",
        "14",
        "--lr-schedule",
        "cosine",
        "--eval-every",
        "5",
        "--checkpoint",
        arg(&checkpoint),
        "--checkpoint-every",
        "3",
        "--log-every",
        "0",
        "--overlap-steps",
        mode,
        "--save",
        arg(&model),
        "--metrics",
        arg(&metrics_path),
    ]);
    (parameters(&model), metrics(&metrics_path))
}

/// The metrics that must agree (timings differ from run to run).
fn agreed(lines: &[serde_json::Value]) -> Vec<String> {
    lines
        .iter()
        .filter(|l| l.get("summary").is_none())
        .map(|l| format!("{} {} {} {} {}", l["step"], l["loss"], l["lr"], l["grad_norm"], l["test_accuracy"]))
        .collect()
}

#[test]
fn overlapped_steps_train_the_model_of_synchronous_ones() {
    let dir = temp_dir("train-overlap");
    for schedule in ["1f1b", "zb-h2"] {
        let (off, off_metrics) = train("off", schedule, &dir);
        let (on, on_metrics) = train("on", schedule, &dir);
        assert_eq!(off, on, "{schedule}: the saved parameters, bit for bit");
        assert_eq!(agreed(&off_metrics), agreed(&on_metrics), "{schedule}: losses, rates, norms, accuracies");
        assert_eq!(agreed(&on_metrics).len(), 14, "{schedule}: a line per step");
        let lrs: Vec<f64> = on_metrics.iter().filter_map(|l| l["lr"].as_f64()).collect();
        assert!(lrs.windows(2).all(|w| w[1] < w[0]), "{schedule}: the cosine rate falls every step: {lrs:?}");
    }
}

#[test]
fn a_bad_overlap_value_is_a_usage_error_and_the_config_key_is_read() {
    assert_usage_error(
        &["train", "--model", "mlp:8,4", "--data", "synthetic:40,8,4", "--steps", "1", "--overlap-steps", "maybe"],
        "--overlap-steps",
    );
    let dir = temp_dir("train-overlap-config");
    let config = dir.join("run.toml");
    std::fs::write(
        &config,
        "[model]\nspec = \"mlp:8,16,4\"\n[data]\nsource = \"synthetic:40,8,4\"\n[training]\nbatch = 8\nsteps = 2\n\
         [pipeline]\ndevices = \"cpu:2\"\nmicrobatches = 2\noverlap_steps = \"on\"\n",
    )
    .unwrap();
    let printed = conveyor_ok(&["train", "--config", arg(&config), "--print-config"]);
    assert!(printed.contains("overlap_steps = \"on\""), "{printed}");
    let stdout = conveyor_ok(&["train", "--config", arg(&config)]);
    assert!(stdout.contains("overlapped steps: each stage starts the next step"), "{stdout}");
}
