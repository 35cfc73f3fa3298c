//! `conveyor plan` end to end: runs the built binary and checks its JSON, its table, memory
//! refusals and placement files, with their exit codes.
use std::path::PathBuf;
use std::process::{Command, Output};

use anyhow::{Context, Result, ensure};
use conveyor::engine::cpu::packed::packed_len;
use serde_json::Value;

/// Eight 1024-wide Linear layers: about 28 MiB of parameters, gradients and Adam state per
/// 1024x1024 layer (with Linear's transposed weight copy, 20 MiB a layer): 52 MiB per device fits
/// on four devices, not on one.
const BIG_MLP: &str = "mlp:1024,1024,1024,1024,1024,1024,1024,1024,10";

fn conveyor(args: &[&str]) -> Result<Output> {
    Command::new(env!("CARGO_BIN_EXE_conveyor")).args(args).output().context("running conveyor")
}

fn plan_json(args: &[&str]) -> Result<Value> {
    let mut all = vec!["plan", "--json"];
    all.extend_from_slice(args);
    let output = conveyor(&all)?;
    ensure!(output.status.success(), "conveyor {all:?} failed: {}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).context("stdout is one JSON object")
}

fn assert_usage_error(args: &[&str], needles: &[&str]) -> Result<()> {
    let output = conveyor(args)?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(output.status.code() == Some(2), "{args:?} exited with {:?}: {stderr}", output.status.code());
    for needle in needles {
        ensure!(stderr.contains(needle), "{args:?}: stderr {stderr:?} lacks {needle:?}");
    }
    Ok(())
}

/// A placement file in the temp directory, removed when dropped.
struct PlacementFile(PathBuf);

impl PlacementFile {
    fn new(name: &str, text: &str) -> Result<Self> {
        let path = std::env::temp_dir().join(format!("conveyor-plan-{}-{name}.txt", std::process::id()));
        std::fs::write(&path, text)?;
        Ok(PlacementFile(path))
    }

    fn arg(&self) -> &str {
        self.0.to_str().expect("temp paths are UTF-8 here")
    }
}

impl Drop for PlacementFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn stage_layers(json: &Value) -> Result<Vec<Vec<String>>> {
    json["stages"]
        .as_array()
        .context("stages")?
        .iter()
        .map(|stage| {
            stage["layers"]
                .as_array()
                .context("layers")?
                .iter()
                .map(|name| name.as_str().map(str::to_string).context("a layer name"))
                .collect()
        })
        .collect()
}

fn f64_of(value: &Value, key: &str) -> Result<f64> {
    value[key].as_f64().with_context(|| format!("{key} in {value}"))
}

fn u64_of(value: &Value, key: &str) -> Result<u64> {
    value[key].as_u64().with_context(|| format!("{key} in {value}"))
}

#[test]
fn json_stages_are_consistent_and_cover_every_layer_once() -> Result<()> {
    let json = plan_json(&["--model", BIG_MLP, "--devices", "cpu:4", "--device-memory", "52MiB"])?;
    assert_eq!(json["schedule"], "1f1b");
    assert_eq!(json["microbatches"], 8);
    let stages = json["stages"].as_array().context("stages")?;
    assert_eq!(stages.len(), 4, "one stage per device");
    let budget = 52u64 << 20;
    for (stage_idx, stage) in stages.iter().enumerate() {
        assert_eq!(stage["stage"], stage_idx);
        assert_eq!(stage["device"], format!("cpu:{stage_idx}"));
        let memory = &stage["memory"];
        let parts = [
            "params",
            "workspace",
            "grads",
            "optimizer_state",
            "commit_snapshot",
            "activations",
            "messages",
            "scratch",
        ]
        .map(|k| u64_of(memory, k));
        let sum: u64 = parts.into_iter().sum::<Result<u64>>()?;
        assert_eq!(u64_of(stage, "memory_bytes")?, sum, "stage {stage_idx}: total is the sum of the breakdown");
        assert!(sum <= budget, "stage {stage_idx} needs {sum} > budget {budget}");
        // Adam keeps two moments per parameter; gradients are as large as the parameters.
        assert_eq!(u64_of(memory, "optimizer_state")?, 2 * u64_of(memory, "params")?);
        assert_eq!(u64_of(memory, "grads")?, u64_of(memory, "params")?);
        assert_eq!(u64_of(memory, "params")?, 4 * u64_of(stage, "params")?, "f32 parameters");
        let fbw =
            f64_of(stage, "forward_s")? + f64_of(stage, "backward_input_s")? + f64_of(stage, "backward_weight_s")?;
        assert!((f64_of(stage, "predicted_time_s")? - fbw).abs() <= 1e-12 * fbw);
    }
    let mut layers: Vec<String> = stage_layers(&json)?.concat();
    layers.sort_by_key(|name| name.parse::<usize>().unwrap_or(usize::MAX));
    let expected: Vec<String> = (0..15).map(|i| i.to_string()).collect();
    assert_eq!(layers, expected, "every layer exactly once");
    // A 1F1B step runs m forward-backward pairs on the slowest stage, plus the fill and drain.
    let bottleneck = f64_of(&json, "bottleneck_s")?;
    let step = f64_of(&json, "predicted_step_s")?;
    assert!(step >= 8.0 * bottleneck * (1.0 - 1e-12), "step {step} < m x bottleneck {bottleneck}");
    let bubble = f64_of(&json, "predicted_bubble_fraction")?;
    assert!((0.0..1.0).contains(&bubble) && bubble > 0.0, "{bubble}");
    // 1F1B's device 0 starts and ends every step, so overlapped steps (train's default) keep
    // its period when the optimizer and the commit cost nothing.
    let overlapped = f64_of(&json, "predicted_overlapped_step_s")?;
    assert!((overlapped - step).abs() <= 1e-9 * step, "1f1b: no gain without commit latency: {overlapped} {step}");
    Ok(())
}

#[test]
fn the_plan_predicts_the_overlapped_period_that_train_runs_by_default() -> Result<()> {
    // ZB-H2's devices end a step one forward apart; the next step's first forwards fill that gap
    // (here the second stage holds three of the five layers, so the gap is there to fill).
    let model = "mlp:1024,1024,1024,1024,1024,10";
    let args = ["--model", model, "--devices", "cpu:2", "--schedule", "zb-h2", "--microbatches", "4", "--batch", "256"];
    let json = plan_json(&args)?;
    let (one, overlapped) = (f64_of(&json, "predicted_step_s")?, f64_of(&json, "predicted_overlapped_step_s")?);
    assert!(overlapped < one * 0.99, "overlapped {overlapped} against one step {one}");
    // At least the busiest device's work per step.
    let busiest = json["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| 4.0 * f64_of(s, "predicted_time_s").unwrap())
        .fold(0.0, f64::max);
    assert!(overlapped >= busiest * (1.0 - 1e-9), "overlapped {overlapped} below the busiest device's {busiest}");
    let output = conveyor(&[&["plan"], &args[..]].concat())?;
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success() && table.contains("with overlapped steps (`train`'s default)"), "{table}");
    Ok(())
}

/// Many micro-batches plan (the memory plan's walk is linear in the schedule's length: 8,000
/// micro-batches on two stages took 12 s when it was quadratic, 0.04 s now, release builds), and
/// more (micro-batch, stage) pairs than `MAX_SIMULATED_PAIRS` are refused before any work.
#[test]
fn many_micro_batches_plan_and_too_many_pairs_are_refused() -> Result<()> {
    let base = ["plan", "--model", "mlp:16,32,10", "--devices", "cpu:2", "--schedule", "zb-h2"];
    let with = |extra: &[&'static str]| -> Vec<&str> { base.iter().copied().chain(extra.iter().copied()).collect() };
    let json = plan_json(&with(&["--microbatches", "8000", "--batch", "8000"])[1..])?;
    assert!(f64_of(&json, "predicted_overlapped_step_s")? >= f64_of(&json, "predicted_step_s")? * 0.5);
    assert_usage_error(
        &with(&["--microbatches", "200000", "--batch", "200000"]),
        &["400000 (micro-batch, stage) pairs", "MAX_SIMULATED_PAIRS", "at most --microbatches 131072"],
    )?;
    // A tensor-parallel pair of devices runs one stage.
    let split = ["plan", "--model", "mlp:16,32,32,10", "--devices", "cpu:4", "--tensor-parallel", "2"];
    assert_usage_error(
        &[&split[..], &["--microbatches", "200000", "--batch", "200000"]].concat(),
        &["on 2 stages makes 400000 (micro-batch, stage) pairs"],
    )
}

#[test]
fn a_model_that_fits_on_four_devices_does_not_fit_on_one() -> Result<()> {
    plan_json(&["--model", BIG_MLP, "--devices", "cpu:4", "--device-memory", "52MiB"])?;
    assert_usage_error(
        &["plan", "--model", BIG_MLP, "--devices", "cpu:1", "--device-memory", "52MiB"],
        &["memory", "does not fit", "more stages"],
    )?;
    // Plain SGD needs half of Adam's memory, but still more than one device's 52 MiB.
    assert_usage_error(
        &["plan", "--model", BIG_MLP, "--devices", "cpu:1", "--device-memory", "52MiB", "--optimizer", "sgd"],
        &["memory"],
    )
}

/// The 59M-parameter Adam MLP of issue 15: its parameters, gradients and Adam state alone are
/// 898 MiB. On four devices of 400 MiB the stages holding a 4096x4096 layer (384 MiB with both
/// packed weight copies) drop their undo snapshots and, where needed, a layer's packed copies, and
/// every stage fits; on one device it is refused with a memory message. (`plan` builds the model
/// to measure its layers: about 0.7 GB of host memory for a second.)
#[test]
fn a_59m_parameter_adam_mlp_fits_four_400_mib_devices_by_dropping_what_is_optional() -> Result<()> {
    const MLP_59M: &str = "mlp:1024,4096,4096,4096,4096,1024";
    let budget = 400u64 << 20;
    let json = plan_json(&["--model", MLP_59M, "--devices", "cpu:4", "--device-memory", "400MiB"])?;
    let stages = json["stages"].as_array().context("stages")?;
    ensure!(stages.len() == 4);
    let mut dropped = 0;
    for stage in stages {
        ensure!(u64_of(stage, "memory_bytes")? <= budget, "{stage}");
        dropped += u64_of(stage, "commit_snapshot_dropped_bytes")? + u64_of(stage, "dropped_cache_bytes")?;
    }
    ensure!(dropped > 0, "something optional was dropped to fit");
    ensure!(json["memory_notes"].as_array().is_some_and(|n| !n.is_empty()), "and the plan says so: {json}");
    assert_usage_error(
        &["plan", "--model", MLP_59M, "--devices", "cpu:1", "--device-memory", "400MiB"],
        &["memory", "does not fit"],
    )
}

#[test]
fn table_lists_stages_memory_times_step_and_bubble() -> Result<()> {
    let output = conveyor(&["plan", "--model", BIG_MLP, "--devices", "cpu:4", "--device-memory", "52MiB"])?;
    ensure!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8(output.stdout)?;
    for needle in [
        "1f1b, 8 micro-batches of 8 rows, adam",
        "stage  device  layers",
        "param mem",
        "optimizer",
        "activations",
        "52.0 MiB",
        "cpu:3",
        "predicted step:",
        "predicted bubble fraction: 0.",
    ] {
        ensure!(stdout.contains(needle), "{stdout} lacks {needle:?}");
    }
    // A long stage is compacted to `first..last (n layers)`.
    let output = conveyor(&["plan", "--model", BIG_MLP, "--devices", "cpu:2"])?;
    let stdout = String::from_utf8(output.stdout)?;
    ensure!(stdout.contains("0..") && stdout.contains(" layers)"), "{stdout}");
    Ok(())
}

#[test]
fn other_schedules_and_chunks() -> Result<()> {
    let json = plan_json(&["--model", "resnet", "--devices", "cpu:2", "--schedule", "interleaved", "--chunks", "2"])?;
    assert_eq!(json["stages"].as_array().map(Vec::len), Some(4), "devices x chunks stages");
    assert_eq!(json["stages"][2]["device"], "cpu:0", "stage 2 of 4 sits on device 0");
    let json = plan_json(&["--model", "cnn", "--devices", "cpu:3", "--schedule", "zb-h1", "--microbatches", "4"])?;
    assert_eq!(json["schedule"], "zb-h1");
    assert_eq!(json["micro_batch_rows"], 16);
    Ok(())
}

#[test]
fn manual_placement_file_is_followed() -> Result<()> {
    let file = PlacementFile::new("good", "# stage per line\n0..4\n5 6 7 8\n9..10\n11..14  # head\n")?;
    let json = plan_json(&["--model", BIG_MLP, "--devices", "cpu:4", "--placement", file.arg()])?;
    let layers = stage_layers(&json)?;
    let expected: Vec<Vec<String>> =
        [0..5, 5..9, 9..11, 11..15].into_iter().map(|r| r.map(|i| i.to_string()).collect()).collect();
    assert_eq!(layers, expected);
    // A residual skip edge crossing stages: block1's sum on stage 1 reads stem_relu from stage 0.
    let file = PlacementFile::new("resnet", "stem stem_relu block1.conv1\nblock1.relu1..fc\n")?;
    let json = plan_json(&["--model", "resnet", "--devices", "cpu:2", "--placement", file.arg()])?;
    assert_eq!(stage_layers(&json)?[0], ["stem", "stem_relu", "block1.conv1"]);
    Ok(())
}

#[test]
fn bad_placement_files_exit_2() -> Result<()> {
    let run = |name: &str, text: &str, needles: &[&str]| -> Result<()> {
        let file = PlacementFile::new(name, text)?;
        assert_usage_error(&["plan", "--model", BIG_MLP, "--devices", "cpu:2", "--placement", file.arg()], needles)
    };
    // Stage 0 holds `4`, which consumes `3` from stage 1.
    run("later", "0 1 2 4\n3 5..14\n", &["--placement", "consumes `3` from the later stage 1"])?;
    run("unknown", "0..6 fc9\n7..14\n", &["no node named `fc9`"])?;
    run("missing", "0..6\n7..13\n", &["`14` is not placed"])?;
    run("twice", "0..7\n7..14\n", &["placed twice"])?;
    run("count", "0..4\n5..9\n10..14\n", &["3 stages given for 2 devices"])?;
    run("empty", "# nothing\n\n", &["lists no stages"])?;
    assert_usage_error(
        &["plan", "--model", BIG_MLP, "--devices", "cpu:2", "--placement", "/nonexistent/conveyor-plan.txt"],
        &["--placement /nonexistent/conveyor-plan.txt"],
    )?;
    // Over budget by hand: every layer but the head on stage 0.
    let file = PlacementFile::new("over", "0..12\n13 14\n")?;
    assert_usage_error(
        &["plan", "--model", BIG_MLP, "--devices", "cpu:2", "--device-memory", "52MiB", "--placement", file.arg()],
        &["memory", "stage 0"],
    )
}

#[test]
fn bad_arguments_exit_2() -> Result<()> {
    let base = ["plan", "--model", BIG_MLP, "--devices"];
    let with = |extra: &[&'static str]| -> Vec<&str> { base.iter().copied().chain(extra.iter().copied()).collect() };
    assert_usage_error(&with(&["gpu:2"]), &["--devices `gpu:2`"])?;
    assert_usage_error(&with(&["cpu:0"]), &["at least one device"])?;
    assert_usage_error(&with(&["cpu:2", "--device-memory", "40XB"]), &["unknown unit"])?;
    assert_usage_error(&with(&["cpu:2", "--optimizer", "lamb"]), &["--optimizer `lamb`"])?;
    assert_usage_error(&with(&["cpu:2", "--chunks", "2"]), &["--chunks 2 needs --schedule interleaved"])?;
    assert_usage_error(&with(&["cpu:2", "--microbatches", "100"]), &["--microbatches 100"])?;
    assert_usage_error(&with(&["cpu:2", "--schedule", "pipedream"]), &["pipedream"])?;
    assert_usage_error(&["plan", "--model", "mlp:4", "--devices", "cpu:1"], &["model spec"])?;
    assert_usage_error(&["plan", "--model", "mlp:4,4", "--devices", "cpu:2"], &["only 1 layers"])
}

#[test]
fn plan_config_plans_the_run_a_spec_describes_and_flags_override_it() -> Result<()> {
    let spec = PlacementFile::new(
        "run-spec",
        "[model]\nspec = \"mlp:64,256,256,10\"\n[pipeline]\ndevices = \"cpu:2\"\ndevice_memory = \"4MiB\"\n\
         schedule = \"zb-h1\"\nmicrobatches = 4\nrecompute = \"always\"\n[training]\nbatch = 32\n\
         [optimizer]\nname = \"sgd\"\n",
    )?;
    let from_spec = plan_json(&["--config", spec.arg()])?;
    let by_flags = plan_json(&[
        "--model",
        "mlp:64,256,256,10",
        "--devices",
        "cpu:2",
        "--device-memory",
        "4MiB",
        "--schedule",
        "zb-h1",
        "--microbatches",
        "4",
        "--recompute",
        "always",
        "--batch",
        "32",
        "--optimizer",
        "sgd",
    ])?;
    ensure!(from_spec == by_flags, "the spec's plan differs from the flags' plan:\n{from_spec}\n{by_flags}");
    // A flag given beside --config wins over the spec's field.
    let overridden = plan_json(&["--config", spec.arg(), "--devices", "cpu:3"])?;
    ensure!(stage_layers(&overridden)?.len() == 3, "--devices cpu:3 over the spec's cpu:2: {overridden}");
    // A spec without a model needs --model; plan without --config needs --model and --devices.
    let no_model = PlacementFile::new("run-spec-no-model", "[pipeline]\ndevices = \"cpu:2\"\n")?;
    assert_usage_error(&["plan", "--config", no_model.arg()], &["names no model", "--model"])?;
    assert_usage_error(&["plan", "--devices", "cpu:2"], &["--model is required"])?;
    assert_usage_error(&["plan", "--config", "/no/such/run.toml"], &["--config", "/no/such/run.toml"])?;
    Ok(())
}

#[test]
fn data_parallel_plans_show_each_replicas_memory_and_the_all_reduce_on_the_step() -> Result<()> {
    let common = ["--model", "mlp:64,1024,1024,1024,10", "--batch", "256", "--microbatches", "4"];
    let with = |extra: &[&str]| -> Result<Value> {
        let mut args = common.to_vec();
        args.extend_from_slice(extra);
        plan_json(&args)
    };
    let one = with(&["--devices", "cpu:2"])?;
    let replicated = with(&["--devices", "cpu:4", "--data-parallel", "2", "--bucket-size", "off"])?;
    let bucketed = with(&["--devices", "cpu:4", "--data-parallel", "2"])?;
    let sharded = with(&["--devices", "cpu:4", "--data-parallel", "2", "--zero", "1"])?;
    // Each replica plans the first two devices on half the batch.
    ensure!(u64_of(&one, "micro_batch_rows")? == 64 && u64_of(&replicated, "micro_batch_rows")? == 32);
    let dp = &replicated["data_parallel"];
    ensure!(u64_of(dp, "replicas")? == 2 && u64_of(dp, "zero")? == 0, "{dp}");
    let stages = dp["stages"].as_array().context("stages")?;
    ensure!(stages.len() == 2);
    for (stage, planned) in stages.iter().zip(replicated["stages"].as_array().context("plan stages")?) {
        // Every gradient all-reduced, costed on the link: a ring moves 2 (R - 1) / R of it.
        let bytes = u64_of(stage, "gradient_bytes")?;
        ensure!(bytes == u64_of(&planned["memory"], "grads")?, "{stage}");
        ensure!((f64_of(stage, "all_reduce_link_bytes")? - bytes as f64).abs() < 1.0, "{stage}");
        ensure!(f64_of(stage, "all_reduce_s")? > 0.0);
        ensure!(u64_of(stage, "optimizer_state")? == u64_of(&planned["memory"], "optimizer_state")?);
        ensure!(u64_of(stage, "memory_bytes")? >= u64_of(planned, "memory_bytes")? - 1, "{stage}");
    }
    // The all-reduce lies on the simulated step: each device's, before its optimizer step.
    let events = dp["all_reduce_events"].as_array().context("events")?;
    ensure!(events.len() == 2, "{dp}");
    let latest_end =
        events.iter().map(|e| f64_of(e, "end_s")).collect::<Result<Vec<_>>>()?.into_iter().fold(0.0, f64::max);
    ensure!((f64_of(&replicated, "predicted_step_s")? - latest_end).abs() < 1e-9, "the step ends with the all-reduce");
    // In buckets (the default) the all-reduce starts beside the final weight pass: the same
    // bytes, a step no longer than at the optimizer step.
    ensure!(bucketed["data_parallel"]["bucket_size"] == "25MiB" && dp["bucket_size"] == "off");
    let step = |v: &Value| f64_of(v, "predicted_step_s");
    ensure!(step(&bucketed)? <= step(&replicated)? + 1e-12, "{} against {}", step(&bucketed)?, step(&replicated)?);
    // ZeRO-1 halves the state over all replicas and never raises a device's.
    let all = |v: &Value| u64_of(&v["data_parallel"], "optimizer_state_all_replicas");
    ensure!(all(&sharded)? * 2 == all(&replicated)?, "{} against {}", all(&sharded)?, all(&replicated)?);
    for (z, r) in sharded["data_parallel"]["stages"].as_array().context("z")?.iter().zip(stages) {
        ensure!(u64_of(z, "optimizer_state")? <= u64_of(r, "optimizer_state")?, "{z} against {r}");
    }
    // The table says the same in words.
    let mut args = vec!["plan"];
    args.extend_from_slice(&common);
    args.extend(["--devices", "cpu:4", "--data-parallel", "2", "--zero", "1"]);
    let table = String::from_utf8(conveyor(&args)?.stdout)?;
    for needle in ["data parallel: 2 replicas", "ZeRO-1: optimizer state sharded", "(replicated: ", "all-reduce"] {
        ensure!(table.contains(needle), "{needle:?} missing from {table}");
    }
    let mut bad = vec!["plan"];
    bad.extend_from_slice(&common);
    bad.extend(["--devices", "cpu:3", "--data-parallel", "2"]);
    assert_usage_error(&bad, &["--data-parallel 2", "do not split into 2 replicas"])?;
    Ok(())
}

/// `--tensor-parallel 2`: every device of each group has its memory, the split transformer's
/// collectives are counted per call kind and priced into the stage times, and a degree that does
/// not divide the heads, or devices that do not form groups, exit 2.
#[test]
fn tensor_parallel_plans_show_each_device_and_the_collectives() -> Result<()> {
    let model = "transformer:16,8,32,4,2,10";
    let common = ["--model", model, "--batch", "16", "--microbatches", "2"];
    let whole = plan_json(&[&common[..], &["--devices", "cpu:2"]].concat())?;
    let split = plan_json(&[&common[..], &["--devices", "cpu:4", "--tensor-parallel", "2"]].concat())?;
    let tp = &split["tensor_parallel"];
    ensure!(tp["degree"] == 2, "{tp}");
    let stages = tp["stages"].as_array().context("tensor_parallel.stages")?;
    ensure!(stages.len() == 2, "two stages of two devices: {tp}");
    for stage in stages {
        let memory = stage["memory_bytes"].as_array().context("memory_bytes")?;
        ensure!(memory.len() == 2 && memory.iter().all(|m| m.as_u64() > Some(0)), "each member holds shards: {stage}");
        for phase in ["forward", "backward_input", "backward_weight"] {
            let bytes = stage[phase]["bytes"].as_f64().context("bytes")?;
            let seconds = stage[phase]["predicted_s"].as_f64().context("predicted_s")?;
            ensure!(bytes > 0.0 && seconds > 0.0, "every call of a split block exchanges: {phase} {stage}");
        }
    }
    // The stage times include the collectives: each split stage's forward is at least its
    // collectives' time, and the plan predicts a step.
    let forward = split["stages"][0]["forward_s"].as_f64().context("forward_s")?;
    ensure!(forward >= stages[0]["forward"]["predicted_s"].as_f64().unwrap_or(f64::INFINITY), "{split}");
    ensure!(split["predicted_step_s"].as_f64() > Some(0.0) && whole["predicted_step_s"].as_f64() > Some(0.0));

    let table = conveyor(&["plan", "--model", model, "--devices", "cpu:4", "--tensor-parallel", "2"])?;
    let stdout = String::from_utf8_lossy(&table.stdout);
    ensure!(table.status.success() && stdout.contains("tensor parallelism: 2 devices per stage"), "{stdout}");
    ensure!(stdout.contains("cpu:1") && stdout.contains("cpu:3"), "every member's memory is listed: {stdout}");

    assert_usage_error(
        &["plan", "--model", model, "--devices", "cpu:3", "--tensor-parallel", "3"],
        &["4 heads cannot be split over 3 devices", "1, 2, 4"],
    )?;
    assert_usage_error(
        &["plan", "--model", model, "--devices", "cpu:3", "--tensor-parallel", "2"],
        &["do not split into groups of 2"],
    )
}

/// `--weight-cache`: `off` (the default) keeps no packed copy (0 bytes of caches, their bytes
/// counted as dropped, no note), `on` keeps both copies of every Linear (twice the weights) and
/// refuses a budget that only fits without them, where `auto` fits by dropping some.
#[test]
fn weight_cache_modes_keep_all_none_or_what_fits() -> Result<()> {
    const MLP: &str = "mlp:1024,1024,1024,10";
    // The two packed copies of the three Linears (f32): each as large as the weight, with the
    // columns rounded up to the strip width (the head's 10 outputs).
    let copies = |n_in: usize, n_out: usize| 4 * (packed_len(n_in, n_out) + packed_len(n_out, n_in)) as u64;
    let caches: u64 = 2 * copies(1024, 1024) + copies(1024, 10);
    let cache_bytes = |json: &Value| -> Result<(u64, u64)> {
        let stages = json["stages"].as_array().context("stages")?;
        let kept = stages.iter().map(|s| u64_of(&s["memory"], "workspace")).sum::<Result<u64>>()?;
        let dropped = stages.iter().map(|s| u64_of(s, "dropped_cache_bytes")).sum::<Result<u64>>()?;
        Ok((kept, dropped))
    };
    let args =
        |mode: &'static str| vec!["--model", MLP, "--devices", "cpu:1", "--optimizer", "sgd", "--weight-cache", mode];
    let on = plan_json(&args("on"))?;
    ensure!(on["weight_cache"] == "on", "{on}");
    ensure!(cache_bytes(&on)? == (caches, 0), "on: both copies of every weight kept: {:?}", cache_bytes(&on)?);
    let off = plan_json(&args("off"))?;
    ensure!(cache_bytes(&off)? == (0, caches), "off: none kept: {:?}", cache_bytes(&off)?);
    let off_total = u64_of(&off["stages"][0], "memory_bytes")?;
    let on_total = u64_of(&on["stages"][0], "memory_bytes")?;
    ensure!(on_total == off_total + caches, "the caches are the whole difference: {on_total} vs {off_total}");
    // A budget between the two: auto fits by dropping caches, on is refused.
    let budget = format!("{}", (off_total + on_total) / 2);
    let mut tight = args("auto");
    tight.extend(["--device-memory", &budget]);
    let auto = plan_json(&tight)?;
    let (kept, dropped) = cache_bytes(&auto)?;
    ensure!(dropped > 0 && kept + dropped == caches, "auto drops some to fit: kept {kept}, dropped {dropped}");
    let mut refused = vec!["plan"];
    refused.extend(args("on"));
    refused.extend(["--device-memory", &budget]);
    assert_usage_error(&refused, &["does not fit"])?;
    // `train` plans alike with the default placement (it used to plan the cost model's cut again
    // with the automatic caches, whatever --weight-cache said).
    let train = |mode: &'static str, budget: &str| -> Result<Output> {
        let mut all = vec!["train", "--data", "synthetic:64,1024,10", "--steps", "1", "--log-every", "0"];
        all.extend(args(mode));
        all.extend(["--device-memory", budget]);
        conveyor(&all)
    };
    let fitting = train("auto", &budget)?;
    let stdout = String::from_utf8_lossy(&fitting.stdout);
    ensure!(fitting.status.success() && stdout.contains("drops the derived caches"), "train, auto: {stdout}");
    // `off` (the default) drops nothing: it asked for no caches.
    let off_run = train("off", &budget)?;
    let stdout = String::from_utf8_lossy(&off_run.stdout);
    ensure!(off_run.status.success() && !stdout.contains("derived caches"), "{stdout}");
    let default = plan_json(&["--model", MLP, "--devices", "cpu:1", "--optimizer", "sgd"])?;
    ensure!(default["weight_cache"] == "off" && cache_bytes(&default)? == (0, caches), "default: {default}");
    let on_run = train("on", &budget)?;
    let stderr = String::from_utf8_lossy(&on_run.stderr);
    ensure!(on_run.status.code() == Some(2) && stderr.contains("does not fit"), "train, on, tight: {stderr}");
    assert_usage_error(&["plan", "--model", MLP, "--weight-cache", "sometimes"], &["--weight-cache", "sometimes"])?;
    assert_usage_error(
        &["train", "--model", MLP, "--steps", "1", "--weight-cache", "sometimes"],
        &["--weight-cache", "auto, on or off"],
    )
}
