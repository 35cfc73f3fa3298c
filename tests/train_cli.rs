//! `conveyor train` as a user runs it: metrics and checkpoints written, equal results across
//! schedules from the command line, and bad input refused with exit code 2 and a clear message.
use std::path::PathBuf;
use std::process::{Command, Output};

fn conveyor(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_conveyor")).args(args).output().expect("the conveyor binary runs")
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("conveyor-train-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const SMALL: &[&str] = &[
    "train", "--model", "mlp:8,16,16,4", "--data", "synthetic:64,8,4", "--devices", "cpu:2", "--batch", "16",
    "--microbatches", "4", "--steps", "6", "--optimizer", "momentum", "--lr", "0.05", "--seed", "3", "--log-every", "0",
];

#[test]
fn metrics_and_checkpoint_are_written() {
    let dir = temp_dir("metrics");
    let metrics = dir.join("m.jsonl");
    let save = dir.join("model.safetensors");
    let mut args = SMALL.to_vec();
    args.extend(["--metrics", metrics.to_str().unwrap(), "--save", save.to_str().unwrap()]);
    let out = conveyor(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&metrics).unwrap();
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 7, "6 steps and a summary");
    for (i, line) in lines[..6].iter().enumerate() {
        assert_eq!(line["step"], i as u64 + 1);
        for key in ["loss", "step_s", "samples_per_s"] {
            assert!(line[key].as_f64().unwrap() > 0.0, "{key} in {line}");
        }
    }
    let summary = &lines[6];
    assert_eq!(summary["summary"], true);
    assert_eq!(summary["peak_memory_bytes"].as_array().unwrap().len(), 2);
    let loaded = conveyor::engine::checkpoint::load(&save, &conveyor::engine::Device::host()).unwrap();
    let mut names: Vec<String> = loaded.names().map(|n| n.to_string()).collect();
    names.sort();
    assert_eq!(names, ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]);
    assert_eq!(loaded.get("0.weight").unwrap().dims(), &[16, 8]);
}

#[test]
fn every_schedule_saves_the_same_weights_from_the_command_line() {
    let dir = temp_dir("schedules");
    let mut saved = Vec::new();
    for schedule in ["gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved"] {
        let path = dir.join(format!("{schedule}.safetensors"));
        let mut args = SMALL.to_vec();
        args.extend(["--schedule", schedule, "--save", path.to_str().unwrap(), "--no-shuffle"]);
        if schedule == "interleaved" {
            args.extend(["--chunks", "2"]);
        }
        let out = conveyor(&args);
        assert!(out.status.success(), "{schedule}: {}", String::from_utf8_lossy(&out.stderr));
        saved.push(std::fs::read(&path).unwrap());
    }
    // Placement differs with chunks, not the arithmetic: the files are byte-identical.
    assert!(saved.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn bad_input_exits_2_with_a_clear_message() {
    let cases: &[(&[&str], &str)] = &[
        (&["train", "--model", "transformerish"], "unknown model"),
        (&["train", "--devices", "gpu:2"], "--devices `gpu:2`"),
        (&["train", "--devices", "cpu:0"], "at least one device"),
        (&["train", "--schedule", "round-robin"], "--schedule"),
        (&["train", "--chunks", "2", "--schedule", "1f1b"], "--chunks 2 needs --schedule interleaved"),
        (&["train", "--microbatches", "64", "--batch", "32"], "more than the 32 rows"),
        (&["train", "--lr", "-1"], "learning rate"),
        (&["train", "--data", "synthetic:10,4"], "synthetic:N,D,C"),
        (&["train", "--model", "mlp:64,10"], "takes inputs of shape"),
        (&["train", "--device-memory", "10KiB"], "does not fit"),
        (&["train", "--device-memory", "lots"], "--device-memory"),
        (&["train", "--recompute", "sometimes"], "never, except-last or always"),
    ];
    for (args, expected) in cases {
        let out = conveyor(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: stderr {stderr}");
        assert!(stderr.to_lowercase().contains(&expected.to_lowercase()), "{args:?}: expected `{expected}` in {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
