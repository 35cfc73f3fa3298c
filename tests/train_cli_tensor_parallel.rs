//! `conveyor train --stages 2 --tensor-parallel 2` on cpu:4 trains the same weights as one device
//! (within 1e-5 relative: splitting a product across devices changes the order of f32 sums), and
//! device counts that do not split into groups are refused with exit code 2; a 2-stage x 2-way run
//! stopped after 3 steps and resumed from its `--checkpoint` saves bit-for-bit the weights and
//! optimizer state (under the unsplit names) of an uninterrupted 6-step run.
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
