//! `conveyor train --data-parallel`: two replicas of one device (one micro-batch each) save
//! bit for bit what one device saves with two micro-batches; replicas of 2-stage pipelines and of
//! tensor-parallel groups (2 replicas x 2 stages x 2 shards on cpu:8) train what one device trains
//! within f32 rounding; `--zero 1` saves the same bits as unsharded replicas and says what each
//! replica holds of the optimizer state; device counts that do not split into replicas are
//! refused (exit code 2).
mod train_cli_support;

use std::path::Path;
use std::process::{Command, Output};

use conveyor::engine::Device;
use conveyor::engine::checkpoint;

fn conveyor(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_conveyor")).args(args).output().expect("the conveyor binary runs")
}

#[rustfmt::skip]
const RUN: &[&str] = &[
    "train", "--model", "mlp:8,32,32,4", "--data", "synthetic:64,8,4", "--batch", "16", "--steps", "5",
    "--optimizer", "adam", "--lr", "0.01", "--seed", "2", "--no-shuffle", "--log-every", "0",
];

fn train(extra: &[&str], save: &Path) -> String {
    let mut args = RUN.to_vec();
    args.extend(extra);
    args.extend(["--save", save.to_str().unwrap()]);
    let out = conveyor(&args);
    assert!(out.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The largest relative difference between two saved files' tensors (same names).
fn worst(a: &Path, b: &Path) -> f32 {
    let host = Device::host();
    let (a, b) = (checkpoint::load(a, &host).unwrap(), checkpoint::load(b, &host).unwrap());
    let names: Vec<&str> = a.names().collect();
    assert_eq!(names, b.names().collect::<Vec<_>>());
    let mut worst = 0.0f32;
    for name in names {
        let (x, y) = (a.get(name).unwrap().to_vec_f32(), b.get(name).unwrap().to_vec_f32());
        for (p, q) in x.iter().zip(&y) {
            worst = worst.max((p - q).abs() / p.abs().max(1e-3));
        }
    }
    worst
}

#[test]
fn two_replicas_save_what_one_device_saves() {
    let dir = train_cli_support::temp_dir("dp-cli");
    let (one, two) = (dir.join("one.safetensors"), dir.join("two.safetensors"));
    train(&["--devices", "cpu:1", "--microbatches", "2"], &one);
    let stdout = train(&["--devices", "cpu:2", "--data-parallel", "2", "--microbatches", "1"], &two);
    assert!(stdout.contains("x 2 data-parallel replicas") && stdout.contains("replica 1 on cpu:1"), "{stdout}");
    assert_eq!(worst(&one, &two), 0.0, "2 replicas against one device: not bit for bit");
}

#[test]
fn replicas_of_pipelines_and_of_tensor_parallel_groups_train_what_one_device_trains() {
    let dir = train_cli_support::temp_dir("dp-cli-3d");
    let (one, pipelines, three_d) =
        (dir.join("one.safetensors"), dir.join("pipelines.safetensors"), dir.join("3d.safetensors"));
    train(&["--devices", "cpu:1", "--microbatches", "4"], &one);
    train(&["--devices", "cpu:4", "--data-parallel", "2", "--microbatches", "2"], &pipelines);
    let stdout = train(
        &[
            "--devices",
            "cpu:8",
            "--data-parallel",
            "2",
            "--tensor-parallel",
            "2",
            "--stages",
            "2",
            "--microbatches",
            "2",
        ],
        &three_d,
    );
    assert!(stdout.contains("replica 1 on cpu:4+cpu:5, cpu:6+cpu:7"), "{stdout}");
    let (a, b) = (worst(&one, &pipelines), worst(&one, &three_d));
    assert!(a < 1e-5 && b < 1e-5, "replicated pipelines {a}, 2 x 2 x 2 {b} (relative)");
}

#[test]
fn devices_that_do_not_split_into_replicas_are_refused() {
    let mut args = RUN.to_vec();
    args.extend(["--devices", "cpu:3", "--data-parallel", "2"]);
    let out = conveyor(&args);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--data-parallel 2") && stderr.contains("replicas x stages"), "{stderr}");
    let mut args = RUN.to_vec();
    args.extend(["--devices", "cpu:2", "--data-parallel", "0"]);
    let out = conveyor(&args);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn zero_one_saves_what_unsharded_replicas_save() {
    let dir = train_cli_support::temp_dir("dp-cli-zero");
    let (plain, sharded) = (dir.join("plain.safetensors"), dir.join("sharded.safetensors"));
    let common = ["--devices", "cpu:4", "--data-parallel", "2", "--microbatches", "2"];
    let stdout = train(&common, &plain);
    assert!(stdout.contains("(replicated; --zero 1 shards it)"), "{stdout}");
    let mut args = common.to_vec();
    args.extend(["--zero", "1"]);
    let stdout = train(&args, &sharded);
    assert!(stdout.contains("ZeRO-1: sharded"), "{stdout}");
    assert_eq!(worst(&plain, &sharded), 0.0, "--zero 1 against --zero 0: not bit for bit");
    let mut bad = RUN.to_vec();
    bad.extend(["--devices", "cpu:2", "--data-parallel", "2", "--zero", "2"]);
    let out = conveyor(&bad);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--zero 2"));
}

#[test]
fn replica_shares_split_the_batch_and_train_the_whole_batch() {
    let dir = train_cli_support::temp_dir("dp-cli-shares");
    let (one, fixed, auto) = (dir.join("one.safetensors"), dir.join("fixed.safetensors"), dir.join("auto.safetensors"));
    train(&["--devices", "cpu:1", "--microbatches", "1"], &one);
    let common = ["--devices", "cpu:2", "--data-parallel", "2", "--microbatches", "1"];
    let mut args = common.to_vec();
    args.extend(["--replica-shares", "3,1"]);
    let stdout = train(&args, &fixed);
    assert!(stdout.contains("replica shares of each batch: 75.0%, 25.0% (fixed weights)"), "{stdout}");
    let mut args = common.to_vec();
    args.extend(["--replica-shares", "auto"]);
    let stdout = train(&args, &auto);
    assert!(stdout.contains("(auto: measured throughput over the first steps, then fixed)"), "{stdout}");
    let (a, b) = (worst(&one, &fixed), worst(&one, &auto));
    assert!(a < 1e-5 && b < 1e-5, "3,1 shares {a}, auto shares {b} (relative)");
    for (shares, expected) in [
        ("3", "1 weights for 2 replicas"),
        ("3,x", "one positive weight per replica"),
        ("15,1", "replica 1's share of 16 rows is 1 rows, fewer than its 2 micro-batches"),
    ] {
        let mut bad = RUN.to_vec();
        bad.extend(["--devices", "cpu:2", "--data-parallel", "2", "--microbatches", "2", "--replica-shares", shares]);
        let out = conveyor(&bad);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{shares}: {stderr}");
        assert!(stderr.contains(expected), "{shares}: {stderr}");
    }
}

#[test]
fn bucket_sizes_save_the_same_bits_and_bad_sizes_are_refused() {
    let dir = train_cli_support::temp_dir("dp-cli-buckets");
    let replicas = ["--devices", "cpu:4", "--data-parallel", "2", "--stages", "2", "--microbatches", "2"];
    let at_step = dir.join("off.safetensors");
    train(&[&replicas[..], &["--bucket-size", "off"]].concat(), &at_step);
    for size in ["1", "1KiB", "25MiB"] {
        let path = dir.join(format!("{size}.safetensors"));
        let stdout = train(&[&replicas[..], &["--bucket-size", size]].concat(), &path);
        assert_eq!(worst(&at_step, &path), 0.0, "--bucket-size {size} against off: not bit for bit");
        // The bubble summary says how much of the all-reduce ran beside compute.
        assert!(stdout.contains("% of it under compute"), "{stdout}");
    }
    for bad in ["lots", "0", "4XB"] {
        let mut args = RUN.to_vec();
        args.extend(["--devices", "cpu:2", "--data-parallel", "2", "--bucket-size", bad]);
        let out = conveyor(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "--bucket-size {bad}: {stderr}");
        assert!(stderr.contains("--bucket-size") && stderr.contains("or off"), "--bucket-size {bad}: {stderr}");
    }
}
