//! `conveyor train --eval-every`, `--placement FILE` and device lists: accuracy on the held-out
//! split during the run (printed and in the metrics), manual placement read in `conveyor plan`'s
//! format, and `cpu:0,cpu:1` meaning the same as `cpu:2`.
mod train_cli_support;

use train_cli_support::{arg, conveyor_ok, metrics, read_checkpoint, temp_dir};

#[test]
fn eval_every_reports_test_accuracy_during_the_run() {
    let dir = temp_dir("eval-every");
    let metrics_path = dir.join("m.jsonl");
    let stdout = conveyor_ok(&[
        "train",
        "--model",
        "mlp:8,32,4",
        "--data",
        "synthetic:200,8,4",
        "--test-fraction",
        "0.25",
        "--batch",
        "10",
        "--microbatches",
        "4",
        "--steps",
        "12",
        "--eval-every",
        "4",
        "--log-every",
        "0",
        "--metrics",
        arg(&metrics_path),
    ]);
    assert_eq!(stdout.matches("test accuracy").count(), 4, "3 evaluations and the final one: {stdout}");
    let lines = metrics(&metrics_path);
    let evaluated: Vec<u64> = lines
        .iter()
        .filter(|l| l.get("test_accuracy").is_some_and(|a| a.is_f64()))
        .filter_map(|l| l["step"].as_u64())
        .collect();
    assert_eq!(evaluated, [4, 8, 12]);
    let summary = lines.last().unwrap();
    let final_accuracy = summary["test_accuracy"].as_f64().unwrap();
    assert_eq!(lines[11]["test_accuracy"].as_f64().unwrap(), final_accuracy, "same model, same rows");
    assert!(final_accuracy > 0.5, "learns the synthetic classes: {final_accuracy}");
}

#[test]
fn eval_works_when_the_test_split_is_smaller_than_the_micro_batch_count() {
    let stdout = conveyor_ok(&[
        "train",
        "--model",
        "mlp:8,16,4",
        "--data",
        "synthetic:42,8,4",
        "--test-fraction",
        "0.05",
        "--batch",
        "8",
        "--microbatches",
        "8",
        "--steps",
        "2",
        "--eval-every",
        "1",
        "--log-every",
        "0",
    ]);
    assert!(stdout.contains("(40 train rows, 2 test rows)"), "{stdout}");
    assert!(stdout.contains("test accuracy"), "{stdout}");
}

#[test]
fn a_placement_file_sets_the_stages_and_gives_the_same_weights() {
    let dir = temp_dir("placement");
    let placement = dir.join("stages.txt");
    std::fs::write(&placement, "# first stage: everything but the head\n0..3\n4  # the head\n").unwrap();
    let run = [
        "train",
        "--model",
        "mlp:8,16,16,4",
        "--data",
        "synthetic:64,8,4",
        "--batch",
        "16",
        "--microbatches",
        "4",
        "--steps",
        "4",
        "--log-every",
        "0",
        "--no-shuffle",
    ];
    let manual = dir.join("manual.safetensors");
    let stdout = conveyor_ok(&[&run[..], &["--placement", arg(&placement), "--save", arg(&manual)]].concat());
    assert!(stdout.contains("stage 0 on cpu:0: 0 1 2 3 (") && stdout.contains("stage 1 on cpu:1: 4 ("), "{stdout}");
    let auto = dir.join("auto.safetensors");
    conveyor_ok(&[&run[..], &["--save", arg(&auto)]].concat());
    let listed = dir.join("listed.safetensors");
    let stdout = conveyor_ok(&[&run[..], &["--devices", "cpu:0,cpu:1", "--save", arg(&listed)]].concat());
    assert!(stdout.contains("2 device(s)"), "{stdout}");
    let params =
        |path| read_checkpoint(path).0.into_iter().filter(|(n, _)| !n.starts_with("optimizer.")).collect::<Vec<_>>();
    assert_eq!(params(&manual), params(&auto));
    assert_eq!(params(&listed), params(&auto));
}
