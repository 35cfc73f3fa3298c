//! `conveyor train --stages 2 --tensor-parallel 2` on cpu:4 trains the same weights as one device
//! (within 1e-5 relative: splitting a product across devices changes the order of f32 sums), and
//! device counts that do not split into groups are refused with exit code 2; a 2-stage x 2-way run
//! stopped after 3 steps and resumed from its `--checkpoint` saves bit-for-bit the weights and
//! optimizer state (under the unsplit names) of an uninterrupted 6-step run; `--sequence-parallel`
//! without a group or a transformer is refused (exit 2), and `plan --sequence-parallel` shows less
//! memory on the busiest device and fewer bytes moved forward.
mod train_cli_support;

use std::process::{Command, Output};

use conveyor::engine::Device;
use conveyor::engine::checkpoint;

fn conveyor(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_conveyor")).args(args).output().expect("the conveyor binary runs")
}

#[rustfmt::skip]
const RUN: &[&str] = &[
    "train", "--model", "mlp:8,32,32,4", "--data", "synthetic:64,8,4", "--batch", "16", "--microbatches", "4",
    "--steps", "5", "--optimizer", "momentum", "--lr", "0.05", "--seed", "2", "--no-shuffle", "--log-every", "0",
];

#[test]
fn two_stages_of_two_devices_train_what_one_device_trains() {
    let dir = train_cli_support::temp_dir("tp-cli");
    let (one, split) = (dir.join("one.safetensors"), dir.join("split.safetensors"));
    let mut args = RUN.to_vec();
    args.extend(["--devices", "cpu:1", "--save", one.to_str().unwrap()]);
    let out = conveyor(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut args = RUN.to_vec();
    args.extend(["--devices", "cpu:4", "--stages", "2", "--tensor-parallel", "2", "--save", split.to_str().unwrap()]);
    let out = conveyor(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("cpu:0+cpu:1") && stdout.contains("cpu:3: peak memory"), "{stdout}");

    let host = Device::host();
    let (mut a, b) = (checkpoint::load(&one, &host).unwrap(), checkpoint::load(&split, &host).unwrap());
    let mut names: Vec<String> = b.names().map(str::to_string).collect();
    names.sort();
    assert_eq!(names, ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"], "unsplit names");
    let mut worst = 0.0f32;
    for name in &names {
        let (x, y) = (a.take(name).unwrap().to_vec_f32(), b.get(name).unwrap().to_vec_f32());
        assert_eq!(x.len(), y.len(), "{name}: unsplit shapes");
        for (p, q) in x.iter().zip(&y) {
            worst = worst.max((p - q).abs() / p.abs().max(1e-3));
        }
    }
    assert!(worst <= 1e-5, "split training differs from one device by {worst}");
}

#[test]
fn groups_that_do_not_divide_the_devices_are_refused() {
    for (devices, extra) in
        [("cpu:4", vec!["--tensor-parallel", "3"]), ("cpu:4", vec!["--stages", "3", "--tensor-parallel", "2"])]
    {
        let mut args = RUN.to_vec();
        args.extend(["--devices", devices]);
        args.extend(extra.iter().copied());
        let out = conveyor(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stderr).contains("--tensor-parallel"));
    }
}

/// The optimizer state of split layers is saved under the unsplit names and restored into the
/// shards, so resuming is exact.
#[test]
fn a_split_run_resumed_from_a_checkpoint_matches_an_uninterrupted_run() {
    let dir = train_cli_support::temp_dir("tp-resume");
    let (straight, stopped, resumed) =
        (dir.join("straight.safetensors"), dir.join("stopped.safetensors"), dir.join("resumed.safetensors"));
    let mut base: Vec<&str> = RUN.iter().copied().filter(|a| *a != "--steps" && *a != "5").collect();
    // A constant rate: a cosine schedule over --steps 3 would differ from one over 6.
    base.extend(["--lr-schedule", "constant", "--devices", "cpu:4", "--stages", "2", "--tensor-parallel", "2"]);
    let run = |extra: &[&str]| {
        let out = conveyor(&[&base[..], extra].concat());
        assert!(out.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    run(&["--steps", "6", "--checkpoint", straight.to_str().unwrap()]);
    run(&["--steps", "3", "--checkpoint", stopped.to_str().unwrap()]);
    let stdout =
        run(&["--steps", "6", "--resume", stopped.to_str().unwrap(), "--checkpoint", resumed.to_str().unwrap()]);
    assert!(stdout.contains("resumed from") && stdout.contains("at step 3"), "{stdout}");

    let host = Device::host();
    let (want, got) = (checkpoint::load(&straight, &host).unwrap(), checkpoint::load(&resumed, &host).unwrap());
    let mut names: Vec<String> = want.names().map(str::to_string).collect();
    names.sort();
    let mut got_names: Vec<String> = got.names().map(str::to_string).collect();
    got_names.sort();
    assert_eq!(got_names, names);
    assert!(names.contains(&"optimizer.0.weight.momentum_buffer".to_string()), "unsplit state names: {names:?}");
    assert!(names.contains(&"optimizer.2.weight.step".to_string()), "{names:?}");
    for name in &names {
        let (a, b) = (want.get(name).unwrap(), got.get(name).unwrap());
        assert!(a.bit_eq(b), "`{name}` differs after resuming");
    }
}

/// `--sequence-parallel` without a tensor-parallel group, or with a model that has no sequence,
/// is refused before anything runs (exit 2, naming the flag and the fix); `plan` refuses the same.
#[test]
fn sequence_parallelism_without_a_group_or_a_transformer_is_refused() {
    let transformer = ["--model", "transformer", "--data", "tokens:64,16,32,10"];
    let cases: [(Vec<&str>, &str); 3] = [
        (
            [&["train"][..], &transformer, &["--sequence-parallel", "--steps", "1"]].concat(),
            "--tensor-parallel 2 or more",
        ),
        (
            [
                &["train", "--model", "mlp:8,4", "--data", "synthetic:64,8,4"][..],
                &["--devices", "cpu:2"],
                &["--tensor-parallel", "2", "--sequence-parallel", "--steps", "1"],
            ]
            .concat(),
            "use --model transformer",
        ),
        (
            vec!["plan", "--model", "cnn", "--devices", "cpu:2", "--tensor-parallel", "2", "--sequence-parallel"],
            "use --model transformer",
        ),
    ];
    for (args, fix) in cases {
        let out = conveyor(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("--sequence-parallel") && stderr.contains(fix), "{args:?}: {stderr}");
    }
}

/// `conveyor plan --sequence-parallel` shows the activation memory the split along the tokens
/// saves: the first device of the group, which held the LayerNorm and residual regions whole,
/// plans less, and so does the busier device; the collectives move fewer bytes forward.
#[test]
fn plan_shows_what_sequence_parallelism_saves() {
    let plan = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "plan",
            "--model",
            "transformer:64,64,128,8,2,10",
            "--devices",
            "cpu:2",
            "--tensor-parallel",
            "2",
            "--batch",
            "256",
            "--microbatches",
            "2",
            "--json",
        ];
        args.extend(extra);
        let out = conveyor(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let (without, with) = (plan(&[]), plan(&["--sequence-parallel"]));
    let memory = |json: &serde_json::Value| -> Vec<u64> {
        let stage = &json["tensor_parallel"]["stages"][0];
        stage["memory_bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap()).collect()
    };
    let forward = |json: &serde_json::Value| json["tensor_parallel"]["stages"][0]["forward"]["bytes"].as_f64().unwrap();
    let (a, b) = (memory(&without), memory(&with));
    eprintln!("planned bytes per device: {a:?} without, {b:?} with sequence parallelism");
    assert!(b[0] < a[0], "the first device: {} with, {} without", b[0], a[0]);
    assert!(b.iter().max() < a.iter().max(), "the busiest device: {b:?} against {a:?}");
    assert!(forward(&with) < forward(&without), "forward bytes: {} against {}", forward(&with), forward(&without));
}
