//! `conveyor train --sync/--compress/--interleaving`: a parameter server over four replicas learns
//! the digits; an asynchronous Downpour run with a seeded interleaving saves the same weights
//! every time and again when replayed from its `--record-interleaving` record; top-k compression
//! sends fewer bytes than bf16 (itself half of none); plain allreduce stays the runtime's own
//! replicas; the keys read back from a `--config` file; and every bad value, and every flag the
//! strategies cannot honour, exits 2 naming the flag.
mod train_cli_support;

use train_cli_support::{arg, assert_usage_error, conveyor_ok, read_checkpoint, temp_dir};

/// A tiny MLP on the digits at a constant learning rate.
#[rustfmt::skip]
const RUN: &[&str] = &[
    "train", "--model", "mlp:64,32,10", "--data", "digits", "--lr-schedule", "constant", "--microbatches", "1",
];

fn with(extra: &[&str]) -> Vec<String> {
    RUN.iter().chain(extra).map(|s| s.to_string()).collect()
}

fn train(extra: &[&str]) -> String {
    let args = with(extra);
    conveyor_ok(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// The number after `prefix` on the line that starts with it.
fn printed(stdout: &str, prefix: &str) -> f64 {
    let line = stdout.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no `{prefix}` in {stdout}"));
    let number: String =
        line[prefix.len()..].trim_start().chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
    number.parse().unwrap_or_else(|_| panic!("{line}"))
}

#[test]
fn a_parameter_server_over_four_replicas_learns_the_digits() {
    let stdout =
        train(&["--devices", "cpu:4", "--data-parallel", "4", "--sync", "ps", "--epochs", "2", "--log-every", "40"]);
    assert!(
        stdout.contains("4 worker(s) x 1 device(s), --sync ps") && stdout.contains("worker 3 on cpu:3"),
        "{stdout}"
    );
    assert!(stdout.contains("step    40/88  epoch 0  loss") && stdout.contains("staleness 0.00/0"), "{stdout}");
    let accuracy = printed(&stdout, "test accuracy");
    assert!(accuracy > 70.0, "test accuracy {accuracy}%: {stdout}");
    assert!(printed(&stdout, "bytes sent:") > 0.0 && stdout.contains("staleness: mean 0.00, max 0"), "{stdout}");
}

#[test]
fn a_seeded_asynchronous_run_saves_the_same_weights_again_and_when_replayed() {
    let dir = temp_dir("sync-replay");
    let (record, w1, w2, w3) = (dir.join("order.json"), dir.join("w1"), dir.join("w2"), dir.join("w3"));
    let common = ["--devices", "cpu:2", "--data-parallel", "2", "--sync", "downpour:2,2", "--steps", "30"];
    let run = |extra: &[&str]| train(&[&common[..], extra].concat());
    let stdout = run(&["--interleaving", "seed:3", "--record-interleaving", arg(&record), "--save", arg(&w1)]);
    let turns: Vec<u16> = serde_json::from_str(&std::fs::read_to_string(&record).unwrap()).unwrap();
    assert!(!turns.is_empty() && turns.iter().all(|&w| w < 2), "{turns:?}");
    assert!(stdout.contains(&format!("recorded the interleaving ({} turns)", turns.len())), "{stdout}");
    run(&["--interleaving", &format!("replay:{}", arg(&record)), "--save", arg(&w2)]);
    run(&["--interleaving", "seed:3", "--save", arg(&w3)]);
    let ((t1, m1), (t2, m2), (t3, m3)) = (read_checkpoint(&w1), read_checkpoint(&w2), read_checkpoint(&w3));
    assert!(!t1.is_empty());
    assert_eq!(t1, t3, "the same seed: the same weights, bit for bit");
    assert_eq!(m1, m3, "and the same metadata");
    assert_eq!(t1, t2, "replayed from the record: the same weights, bit for bit");
    assert!(m2["conveyor.spec"].contains("interleaving = \"replay:"), "the replay's spec says so");
    // A record that does not fit the run (here a longer one) is refused, and nothing is saved.
    let w4 = dir.join("w4");
    let mut args = with(&common);
    let steps = args.iter().position(|a| a == "30").unwrap();
    args[steps] = "40".into();
    args.extend(["--interleaving".into(), format!("replay:{}", arg(&record)), "--save".into(), arg(&w4).into()]);
    assert_usage_error(&args.iter().map(String::as_str).collect::<Vec<_>>(), "--interleaving replay:");
    assert!(!w4.exists());
}

#[test]
fn top_k_sends_fewer_bytes_and_plain_allreduce_is_the_runtime_path() {
    let common = ["--devices", "cpu:2", "--data-parallel", "2", "--sync", "allreduce", "--steps", "20"];
    let top_k = train(&[&common[..], &["--compress", "topk:0.05"]].concat());
    let bf16 = train(&[&common[..], &["--compress", "bf16"]].concat());
    let (sparse, half) = (printed(&top_k, "bytes sent:"), printed(&bf16, "bytes sent:"));
    // bf16 sends 2 bytes a value, half of none's f32 (the runtime's path counts no bytes).
    assert!(sparse > 0.0 && sparse < half / 2.0, "topk:0.05 sent {sparse} bytes, bf16 {half} (none {})", 2.0 * half);
    assert!(top_k.contains("--sync allreduce --compress topk:0.05"), "{top_k}");
    assert!(printed(&top_k, "test accuracy") > 30.0, "{top_k}");
    // Without compression, allreduce is the runtime's own replicas, printed as ever.
    let plain = train(&common);
    assert!(plain.contains("x 2 data-parallel replicas") && !plain.contains("bytes sent"), "{plain}");
}

#[test]
fn the_keys_read_back_from_a_config_file() {
    let dir = temp_dir("sync-config");
    let config = dir.join("run.toml");
    std::fs::write(
        &config,
        "[pipeline]\ndevices = \"cpu:2\"\ndata_parallel = 2\nsync = \"ssp:1\"\ncompress = \"f16\"\ncompress_after = 2\n\
         interleaving = \"seed:5\"\n\
         microbatches = 1\n[training]\nsteps = 4\n[optimizer]\nlr_schedule = \"constant\"\n\
         [outputs]\nrecord_interleaving = \"order.json\"\n",
    )
    .unwrap();
    let printed = conveyor_ok(&["train", "--config", arg(&config), "--print-config"]);
    let spec = conveyor::RunSpec::from_toml_str(&printed).unwrap();
    assert_eq!(spec.pipeline.strategy_flags(), "--sync ssp:1 --compress f16 --compress-after 2 --interleaving seed:5");
    assert_eq!(spec.outputs.record_interleaving.as_deref(), Some(std::path::Path::new("order.json")));
    std::fs::write(&config, "[pipeline]\nsync = \"gossip\"\n").unwrap();
    assert_usage_error(&["train", "--config", arg(&config)], "`pipeline.sync` (--sync)");
}

#[test]
fn bad_values_and_flags_the_strategies_cannot_honour_exit_2_naming_the_flag() {
    let dir = temp_dir("sync-bad");
    let garbage = dir.join("garbage.json");
    std::fs::write(&garbage, "[0, 1, \"x\"").unwrap();
    let out_of_range = dir.join("range.json");
    std::fs::write(&out_of_range, "[0, 5]").unwrap();
    let replay = |path: &std::path::Path| format!("replay:{}", arg(path));
    let (garbage, out_of_range) = (replay(&garbage), replay(&out_of_range));
    let downpour = ["--sync", "downpour:1,1", "--interleaving"];
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--sync", "gossip"], "--sync: unknown strategy"),
        (vec!["--sync", "average:0"], "--sync: K of average:K must be at least 1"),
        (vec!["--sync", "ssp:-1"], "--sync: S of ssp:S must be a whole number"),
        (vec!["--compress", "topk:0"], "--compress: top-k ratio 0 is not in (0, 1]"),
        (vec!["--compress", "topk:1.5"], "--compress: top-k ratio 1.5"),
        (vec!["--compress", "powersgd:0"], "--compress: PowerSGD rank 0"),
        (vec!["--compress", "zip"], "--compress: unknown compression"),
        (vec!["--sync", "ps", "--compress-after", "3"], "--compress-after 3: there is no compression to start"),
        ([&downpour[..], &["seed:x"]].concat(), "--interleaving `seed:x`: N of seed:N"),
        ([&downpour[..], &["replay:/nonexistent"]].concat(), "--interleaving replay:/nonexistent"),
        ([&downpour[..], &[garbage.as_str()]].concat(), "not a JSON array of whole numbers"),
        ([&downpour[..], &[out_of_range.as_str()]].concat(), "turn 1 is worker 5, but this run has 2 worker(s)"),
        (vec!["--interleaving", "seed:1", "--sync", "ps"], "--interleaving seed:1 with --sync ps"),
        (vec!["--sync", "ps", "--record-interleaving", "order.json"], "--record-interleaving needs an asynchronous"),
        (vec!["--sync", "ps", "--resume", "x"], "--resume x is not supported with --sync ps"),
        (vec!["--sync", "ps", "--tensor-parallel", "2"], "--tensor-parallel 2 is not supported"),
        (vec!["--sync", "ps", "--zero", "1"], "--zero 1 is not supported"),
        (vec!["--sync", "ps", "--checkpoint", "c.safetensors"], "--checkpoint c.safetensors is not supported"),
        (vec!["--sync", "ps", "--trace", "t.json"], "--trace t.json is not supported"),
        (vec!["--sync", "ps", "--on-nonfinite", "skip"], "--on-nonfinite skip:10 is not supported"),
        (vec!["--sync", "ps", "--clip-grad-norm", "1"], "--clip-grad-norm 1 is not supported"),
        (vec!["--sync", "ps", "--batch", "31"], "--batch 31 with --data-parallel 2"),
    ];
    for (extra, expected) in cases {
        let mut args = with(&["--devices", "cpu:2", "--data-parallel", "2", "--steps", "2"]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let stderr = assert_usage_error(&args.iter().map(String::as_str).collect::<Vec<_>>(), expected);
        let flagged =
            ["--sync", "--compress", "--compress-after", "--interleaving", "--record-interleaving", "--batch"]
                .iter()
                .any(|flag| stderr.contains(flag));
        assert!(flagged, "{extra:?}: {stderr}");
        if stderr.contains("is not supported") {
            assert!(stderr.contains("--sync allreduce without --compress"), "{extra:?}: {stderr}");
        }
    }
}

#[test]
fn the_default_cosine_schedule_steps_the_strategies_learning_rate() {
    let stdout = conveyor_ok(&[
        "train",
        "--model",
        "mlp:64,32,10",
        "--data",
        "digits",
        "--devices",
        "cpu:2",
        "--data-parallel",
        "2",
        "--sync",
        "ps:2",
        "--steps",
        "6",
        "--log-every",
        "1",
    ]);
    let lrs: Vec<f64> =
        stdout.lines().filter_map(|line| line.split("  lr ").nth(1)?.split_whitespace().next()?.parse().ok()).collect();
    assert_eq!(lrs.len(), 6, "{stdout}");
    assert!(lrs.windows(2).all(|w| w[1] < w[0]), "the cosine decays step by step: {lrs:?}");
}
