//! `conveyor train` as a user runs it: metrics and checkpoints written, equal results across
//! schedules from the command line, and bad input refused with exit code 2 and a clear message.
mod train_cli_support;

use train_cli_support::{arg, assert_usage_error, conveyor, metrics, parameters, read_checkpoint, temp_dir};

const SMALL: &[&str] = &[
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
    "6",
    "--optimizer",
    "momentum",
    "--lr",
    "0.05",
    "--seed",
    "3",
    "--log-every",
    "0",
];

#[test]
fn metrics_and_checkpoint_are_written() {
    let dir = temp_dir("metrics");
    let metrics_path = dir.join("m.jsonl");
    let save = dir.join("model.safetensors");
    let checkpoint = dir.join("checkpoint.safetensors");
    let mut args = SMALL.to_vec();
    args.extend(["--metrics", arg(&metrics_path), "--save", arg(&save), "--checkpoint", arg(&checkpoint)]);
    let out = conveyor(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains('\u{1b}'), "no terminal escapes (progress bars) in captured output: {stdout}");
    let lines = metrics(&metrics_path);
    assert_eq!(lines.len(), 7, "6 steps and a summary");
    for (i, line) in lines[..6].iter().enumerate() {
        assert_eq!(line["step"], i as u64 + 1);
        for key in ["loss", "step_s", "samples_per_s", "lr"] {
            assert!(line[key].as_f64().unwrap() > 0.0, "{key} in {line}");
        }
    }
    // The default schedule is cosine annealing over the run: the rate falls every step.
    let rates: Vec<f64> = lines[..6].iter().map(|l| l["lr"].as_f64().unwrap()).collect();
    assert_eq!(rates[0], 0.05);
    assert!(rates.windows(2).all(|w| w[1] < w[0]), "{rates:?}");
    let summary = &lines[6];
    assert_eq!(summary["summary"], true);
    assert_eq!(summary["peak_memory_bytes"].as_array().unwrap().len(), 2);
    assert!(summary["bubble_fraction"].as_f64().unwrap() > 0.0);
    // --save writes exactly the state dict; --checkpoint adds the optimizer state for --resume.
    let (saved, _) = read_checkpoint(&save);
    let mut saved_names: Vec<&String> = saved.keys().collect();
    saved_names.sort();
    assert_eq!(saved_names, ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]);
    let names: Vec<String> = parameters(&checkpoint).into_keys().collect();
    assert_eq!(names, ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]);
    let (tensors, metadata) = read_checkpoint(&checkpoint);
    assert_eq!(tensors["0.weight"].1, [16, 8]);
    assert_eq!(tensors["optimizer.0.weight.momentum_buffer"].1, [16, 8]);
    assert_eq!(metadata["conveyor.train.step"], "6");
    assert_eq!(metadata["conveyor.train.model"], "mlp:8,16,16,4");
}

#[test]
fn every_schedule_saves_the_same_weights_from_the_command_line() {
    let dir = temp_dir("schedules");
    let mut saved = Vec::new();
    for schedule in ["gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved"] {
        let path = dir.join(format!("{schedule}.safetensors"));
        let mut args = SMALL.to_vec();
        args.extend(["--schedule", schedule, "--save", arg(&path), "--no-shuffle"]);
        if schedule == "interleaved" {
            args.extend(["--chunks", "2"]);
        }
        let out = conveyor(&args);
        assert!(out.status.success(), "{schedule}: {}", String::from_utf8_lossy(&out.stderr));
        saved.push(read_checkpoint(&path).0);
    }
    // Placement differs with chunks, not the arithmetic: every tensor is bit-identical.
    assert!(saved.windows(2).all(|w| w[0] == w[1]));
}

/// The V schedules (two chunks by default, device 0 holding the first and the last stage) and
/// interleaved zero bubble train on 2 and 4 devices bit for bit what one device trains.
#[test]
fn v_and_interleaved_zero_bubble_schedules_match_one_device_from_the_command_line() {
    let dir = temp_dir("v-schedules");
    let run = |devices: &str, schedule: &str, extra: &[&str]| {
        let path = dir.join(format!("{schedule}-{devices}.safetensors"));
        // SMALL without the flags set here.
        let mut args: Vec<&str> = vec!["train"];
        for pair in SMALL[1..].chunks(2) {
            if !["--model", "--microbatches", "--steps", "--devices"].contains(&pair[0]) {
                args.extend(pair);
            }
        }
        args.extend(["--model", "mlp:8,16,16,16,16,4", "--microbatches", "8", "--steps", "3"]);
        args.extend(["--devices", devices, "--schedule", schedule, "--save", arg(&path), "--no-shuffle"]);
        args.extend(extra);
        let out = conveyor(&args);
        assert!(out.status.success(), "{schedule} on {devices}: {}", String::from_utf8_lossy(&out.stderr));
        (read_checkpoint(&path).0, String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let (one, _) = run("cpu:1", "gpipe", &[]);
    for devices in ["cpu:2", "cpu:4"] {
        for (schedule, extra) in
            [("zb-v", &[][..]), ("dualpipe-v", &[][..]), ("interleaved-zb", &["--chunks", "2"][..])]
        {
            let (piped, stdout) = run(devices, schedule, extra);
            assert!(piped == one, "{schedule} on {devices}: weights differ from one device");
            if schedule != "interleaved-zb" {
                // The V: the last stage on device 0, beside the first.
                let last = if devices == "cpu:2" { 3 } else { 7 };
                assert!(stdout.contains(&format!("stage {last} on cpu:0")), "{schedule} on {devices}: {stdout}");
            }
        }
    }
    // The V on the chart and the trace: each row names its stages.
    let (svg, trace) = (dir.join("v.svg"), dir.join("v.trace.json"));
    run("cpu:2", "zb-v", &["--svg", arg(&svg), "--trace", arg(&trace)]);
    for path in [&svg, &trace] {
        let text = std::fs::read_to_string(path).unwrap();
        for row in ["cpu:0: stages 0, 3", "cpu:1: stages 1, 2"] {
            assert!(text.contains(row), "{} lacks the row {row:?}", path.display());
        }
    }
    let stderr =
        assert_usage_error(&["train", "--schedule", "zb-v", "--chunks", "3"], "--chunks 3 with --schedule zb-v");
    assert!(stderr.contains("give --chunks 2"), "{stderr}");
    let stderr = assert_usage_error(
        &["train", "--schedule", "dualpipe-v", "--devices", "cpu:4", "--microbatches", "4"],
        "--microbatches 4 with --schedule dualpipe-v",
    );
    assert!(stderr.contains("at least 8"), "{stderr}");
}

#[test]
fn bad_input_exits_2_with_a_clear_message() {
    let dir = temp_dir("bad-input");
    let placement = dir.join("placement.txt");
    std::fs::write(&placement, "conv1 relu1\nno_such_layer\n").unwrap();
    let checkpoint = dir.join("ck.safetensors");
    let cases: &[(&[&str], &str)] = &[
        (&["train", "--model", "transformerish"], "unknown model"),
        (&["train", "--devices", "gpu:2"], "--devices `gpu:2`"),
        (&["train", "--devices", "cpu:0"], "at least one device"),
        (&["train", "--devices", "cpu:0,cpu:0"], "listed twice"),
        (&["train", "--devices", "cpu:0,tpu:1"], "unknown device kind"),
        (&["train", "--schedule", "round-robin"], "--schedule"),
        (&["train", "--chunks", "2", "--schedule", "1f1b"], "--chunks 2 needs --schedule interleaved"),
        (&["train", "--microbatches", "64", "--batch", "32"], "more than the 32 rows"),
        (&["train", "--lr", "-1"], "learning rate"),
        (&["train", "--lr-schedule", "sawtooth"], "--lr-schedule `sawtooth`"),
        (&["train", "--lr-schedule", "step:0,0.5"], "step:N,GAMMA"),
        (&["train", "--data", "synthetic:10,4"], "synthetic:N,D,C"),
        (&["train", "--model", "mlp:65,10"], "takes inputs of shape"),
        (&["train", "--model", "mlp:64,10"], "use at most 1 devices"),
        (&["train", "--device-memory", "10KiB"], "does not fit"),
        (&["train", "--device-memory", "lots"], "--device-memory"),
        (&["train", "--recompute", "sometimes"], "never, except-last or always"),
        (&["train", "--test-fraction", "0.2"], "digits has its own test split"),
        (&["train", "--data", "synthetic:64,8,4", "--test-fraction", "1.5"], "--test-fraction 1.5"),
        (&["train", "--eval-every", "0"], "--eval-every must be at least 1"),
        (&["train", "--checkpoint-every", "5"], "needs --checkpoint FILE"),
        (&["train", "--placement", "/no/such/placement.txt"], "--placement /no/such/placement.txt"),
        (&["train", "--placement", arg(&placement)], "no_such_layer"),
        (&["train", "--init", arg(&checkpoint), "--resume", arg(&checkpoint)], "give one"),
        (&["train", "--resume", "/no/such/checkpoint.safetensors"], "--resume /no/such/checkpoint.safetensors"),
    ];
    for (args, expected) in cases {
        assert_usage_error(args, expected);
    }
}

#[test]
fn devices_list_prints_what_is_available() {
    let out = conveyor(&["train", "--devices", "list"]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("cpu:") && stdout.contains("cuda:"), "{stdout}");
}
