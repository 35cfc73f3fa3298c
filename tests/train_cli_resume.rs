//! `conveyor train --save` / `--resume`: a run stopped after 3 steps and resumed to 6 saves
//! bit-for-bit the weights and optimizer state of an uninterrupted 6-step run (shuffled data,
//! momentum SGD and Adam, a model with dropout), and a failed save leaves the previous checkpoint
//! whole and loadable.
mod train_cli_support;

use train_cli_support::{arg, assert_usage_error, conveyor, conveyor_ok, metrics, read_checkpoint, temp_dir};

/// Runs 6 steps straight, and 3 steps then a resume to 6; asserts both final checkpoints hold
/// identical tensors (parameters and optimizer state).
fn resume_matches_uninterrupted(name: &str, run: &[&str]) {
    let dir = temp_dir(name);
    let straight = dir.join("straight.safetensors");
    let stopped = dir.join("stopped.safetensors");
    let resumed = dir.join("resumed.safetensors");
    let base = [&["train", "--log-every", "0"], run].concat();
    conveyor_ok(&[&base[..], &["--steps", "6", "--checkpoint", arg(&straight)]].concat());
    conveyor_ok(&[&base[..], &["--steps", "3", "--checkpoint", arg(&stopped)]].concat());
    let metrics_path = dir.join("m.jsonl");
    let stdout = conveyor_ok(
        &[
            &base[..],
            &["--steps", "6", "--resume", arg(&stopped), "--checkpoint", arg(&resumed), "--metrics", arg(&metrics_path)],
        ]
        .concat(),
    );
    assert!(stdout.contains("resumed from") && stdout.contains("at step 3"), "{stdout}");
    assert!(!stdout.contains("will not match"), "{stdout}");
    let steps: Vec<u64> = metrics(&metrics_path).iter().filter_map(|l| l["step"].as_u64()).collect();
    assert_eq!(steps, [4, 5, 6], "the resumed run continues at step 4");
    let (want, want_meta) = read_checkpoint(&straight);
    let (got, got_meta) = read_checkpoint(&resumed);
    assert!(want.keys().any(|n| n.starts_with("optimizer.")), "optimizer state is saved");
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
    for (tensor, value) in &want {
        assert!(got[tensor] == *value, "{name}: `{tensor}` differs after resuming");
    }
    assert_eq!(got_meta, want_meta);
    assert_eq!(got_meta["conveyor.train.step"], "6");
}

#[test]
fn resume_is_bit_for_bit_with_momentum_sgd() {
    resume_matches_uninterrupted(
        "resume-momentum",
        &[
            "--model",
            "mlp:8,16,16,4",
            "--data",
            "synthetic:40,8,4",
            "--batch",
            "16",
            "--microbatches",
            "4",
            "--optimizer",
            "momentum",
            "--lr",
            "0.05",
            "--lr-schedule",
            "constant",
            "--seed",
            "5",
        ],
    );
}

#[test]
fn resume_is_bit_for_bit_with_adam_dropout_and_a_step_schedule() {
    // The CNN has dropout, whose masks derive from the step index; digits are shuffled per epoch
    // (44 batches of 32), so steps 4..6 need the restored step index, data position and Adam moments.
    resume_matches_uninterrupted(
        "resume-adam",
        &["--model", "cnn", "--batch", "32", "--optimizer", "adam", "--lr-schedule", "step:2,0.5", "--seed", "7"],
    );
}

#[test]
fn resume_crosses_an_epoch_boundary() {
    // 40 rows, batch 16: 2 steps per epoch, so the resume at step 3 is mid-epoch 1 and step 5 starts epoch 2.
    resume_matches_uninterrupted(
        "resume-epochs",
        &[
            "--model",
            "mlp:8,16,4",
            "--data",
            "synthetic:40,8,4",
            "--batch",
            "16",
            "--microbatches",
            "2",
            "--optimizer",
            "adamw",
            "--lr-schedule",
            "constant",
            "--seed",
            "1",
        ],
    );
}

#[test]
fn resume_refuses_a_checkpoint_of_another_run() {
    let dir = temp_dir("resume-mismatch");
    let checkpoint = dir.join("ck.safetensors");
    let weights = dir.join("weights.safetensors");
    let run = ["train", "--model", "mlp:8,16,4", "--data", "synthetic:40,8,4", "--batch", "8", "--log-every", "0"];
    conveyor_ok(&[&run[..], &["--steps", "2", "--checkpoint", arg(&checkpoint)]].concat());
    conveyor_ok(&[&run[..], &["--steps", "2", "--save", arg(&weights)]].concat());
    let checkpoint_arg = arg(&checkpoint);
    let resume = |extra: &[&'static str]| -> Vec<&str> {
        [&run[..], &["--steps", "4", "--resume", checkpoint_arg], extra].concat()
    };
    assert_usage_error(&resume(&["--seed", "9"]), "--seed: checkpoint 0, this run 9");
    assert_usage_error(&resume(&["--optimizer", "momentum"]), "--optimizer: checkpoint adam, this run momentum");
    let other_model: Vec<&str> =
        resume(&[]).into_iter().map(|a| if a == "mlp:8,16,4" { "mlp:8,32,4" } else { a }).collect();
    assert_usage_error(&other_model, "--model: checkpoint mlp:8,16,4, this run mlp:8,32,4");
    let weights_resume = [&run[..], &["--steps", "4", "--resume", arg(&weights)]].concat();
    assert_usage_error(&weights_resume, "`optimizer.0.bias.step` is missing");
    // Without --model, the checkpoint's model is used.
    let no_model: Vec<&str> = resume(&[]).into_iter().filter(|a| *a != "--model" && *a != "mlp:8,16,4").collect();
    let stdout = conveyor_ok(&no_model);
    assert!(stdout.contains("mlp:8,16,4 on") && stdout.contains("at step 2"), "{stdout}");
}

#[test]
fn a_failed_save_leaves_the_previous_checkpoint_loadable() {
    let dir = temp_dir("save-fails");
    let checkpoint = dir.join("ck.safetensors");
    let run = ["train", "--model", "mlp:8,16,4", "--data", "synthetic:40,8,4", "--batch", "8", "--log-every", "0"];
    conveyor_ok(&[&run[..], &["--steps", "2", "--checkpoint", arg(&checkpoint)]].concat());
    let before = std::fs::read(&checkpoint).unwrap();

    // A target that is a directory: refused, nothing else touched.
    let as_dir = dir.join("a-directory.safetensors");
    std::fs::create_dir_all(&as_dir).unwrap();
    assert_usage_error(&[&run[..], &["--steps", "1", "--checkpoint", arg(&as_dir)]].concat(), "it is a directory");

    // A directory we cannot write into: the temporary file cannot be created, so the save fails
    // before the rename and the previous checkpoint stays as it was. (Skipped when running as a
    // user that ignores permissions, such as root.)
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
    let writable_anyway = std::fs::File::create(dir.join("probe")).is_ok();
    if writable_anyway {
        let _ = std::fs::remove_file(dir.join("probe"));
        eprintln!("skipped the read-only directory case: this user can write to read-only directories");
    } else {
        let out =
            conveyor(&[&run[..], &["--steps", "4", "--resume", arg(&checkpoint), "--checkpoint", arg(&checkpoint)]].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("the previous checkpoint there is unchanged"), "{stderr}");
        assert_eq!(std::fs::read(&checkpoint).unwrap(), before, "the failed save changed the checkpoint");
    }
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();

    // A save killed midway: a process stopped by SIGKILL while it writes. The checkpoint was
    // replaced whole or not at all, so whatever is there loads.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_conveyor"))
        .args([&run[..], &["--steps", "400", "--checkpoint-every", "1", "--checkpoint", arg(&checkpoint)]].concat())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(150));
    child.kill().unwrap();
    child.wait().unwrap();
    let (tensors, metadata) = read_checkpoint(&checkpoint);
    assert!(tensors.contains_key("0.weight") && tensors.contains_key("optimizer.0.weight.exp_avg"));
    let step: u64 = metadata["conveyor.train.step"].parse().unwrap();
    assert!(step >= 2, "the checkpoint is the previous one or a newer whole one (step {step})");
    eprintln!("killed mid-run; the checkpoint on disk is whole, at step {step}");
    // And it resumes.
    conveyor_ok(&[&run[..], &["--steps", &(step + 1).to_string(), "--resume", arg(&checkpoint)]].concat());
}
