//! The run spec ([`conveyor::RunSpec`]): its TOML form round-trips, `conveyor train` with no flags
//! means `RunSpec::default()`, flags override `--config`, errors name the key, checkpoints store
//! the spec, and a library loop over `RunSpec::prepare` trains bit for bit as `conveyor train` does.
mod train_cli_support;

use std::path::PathBuf;

use conveyor::RunSpec;
use conveyor::engine::runtime::{CoreSlotPolicy, Recompute};
use conveyor::engine::strategies::{Compression, SyncStrategy};
use conveyor::schedules::ScheduleKind;
use conveyor::spec::{BucketSize, InterleavingSpec, LrSchedule, OnNonFinite, OptimizerKind, PlacementSpec, SpecError};
use train_cli_support::{arg, assert_usage_error, conveyor_ok, f32s, parameters, temp_dir};

/// A spec with every field away from its default.
fn everything_set() -> RunSpec {
    let mut spec = RunSpec::default();
    spec.model.spec = Some("mlp:8,16,4".into());
    spec.data.source = "synthetic:64,8,4".into();
    spec.data.test_fraction = Some(0.25);
    spec.data.classes = Some(4);
    let pipeline = &mut spec.pipeline;
    pipeline.devices = "cpu:0,cpu:1,cpu:2,cpu:3".into();
    pipeline.device_memory = Some(3 * 1024 * 1024 + 1);
    pipeline.stages = Some(2);
    pipeline.tensor_parallel = 2;
    pipeline.schedule = ScheduleKind::Interleaved;
    pipeline.chunks = 2;
    pipeline.microbatches = 4;
    pipeline.recompute = Recompute::ExceptLast;
    pipeline.core_slots = CoreSlotPolicy::Slots(3);
    pipeline.bucket_size = BucketSize::Bytes(4 << 20);
    pipeline.sync = SyncStrategy::Downpour { fetch_every: 2, push_every: 3 };
    pipeline.compress = Compression::TopK { ratio: 0.25 };
    pipeline.interleaving = InterleavingSpec::Replay("turns.json".into());
    let training = &mut spec.training;
    training.batch = 16;
    training.steps = Some(12);
    training.epochs = 2;
    training.seed = u64::MAX;
    training.shuffle = false;
    training.on_nonfinite = OnNonFinite::Skip { max_in_a_row: 5 };
    training.eval_every = Some(3);
    training.log_every = 0;
    let optimizer = &mut spec.optimizer;
    optimizer.name = OptimizerKind::Momentum;
    optimizer.lr = Some(0.125);
    optimizer.momentum = Some(0.5);
    optimizer.weight_decay = Some(1e-4);
    optimizer.lr_schedule = LrSchedule::Step { step_size: 100, gamma: 0.5 };
    spec.checkpoint.resume = Some("ck.safetensors".into());
    spec.checkpoint.path = Some("out/ck.safetensors".into());
    spec.checkpoint.every = Some(4);
    spec.outputs.save = Some("model.safetensors".into());
    spec.outputs.metrics = Some("m.jsonl".into());
    spec.outputs.trace = Some("trace.json".into());
    spec.outputs.svg = Some("step.svg".into());
    spec.outputs.record_interleaving = Some("turns-out.json".into());
    spec
}

#[test]
fn toml_round_trips_a_table_of_specs() {
    let mut manual = RunSpec::default();
    manual.pipeline.placement =
        PlacementSpec::Manual(vec![vec!["conv1..relu2".into()], vec!["pool".into(), "flatten..fc2".into()]]);
    manual.pipeline.device_memory = Some(512 << 10);
    let mut file = RunSpec::default();
    file.pipeline.placement = PlacementSpec::File("stages.txt".into());
    file.optimizer.name = OptimizerKind::AdamW;
    file.optimizer.lr_schedule = LrSchedule::Constant;
    file.training.epochs = u64::MAX;
    let mut time = RunSpec::default();
    time.pipeline.placement = PlacementSpec::Time;
    time.pipeline.core_slots = CoreSlotPolicy::Off;
    time.checkpoint.init = Some("start.safetensors".into());
    time.pipeline.bucket_size = BucketSize::Off;
    for spec in [RunSpec::default(), everything_set(), manual, file, time] {
        let text = spec.to_toml_string().unwrap();
        assert_eq!(RunSpec::from_toml_str(&text).unwrap(), spec, "{text}");
    }
    // Sizes are written exactly, as a unit when they are a whole number of one.
    let text = everything_set().to_toml_string().unwrap();
    assert!(text.contains("device_memory = 3145729\n"), "{text}");
    assert!(text.contains("seed = \"18446744073709551615\""), "counts past TOML's i64 are strings: {text}");
    let mut gib = RunSpec::default();
    gib.pipeline.device_memory = Some(2 << 30);
    assert!(gib.to_toml_string().unwrap().contains("device_memory = \"2GiB\""));
}

#[test]
fn no_flags_print_the_default_spec_and_the_example_is_it() {
    let printed = conveyor_ok(&["train", "--print-config"]);
    assert_eq!(RunSpec::from_toml_str(&printed).unwrap(), RunSpec::default(), "{printed}");
    let example = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/run.toml");
    let spec = RunSpec::from_file(&example).unwrap();
    spec.validate().unwrap();
    assert_eq!(spec, RunSpec::default(), "examples/run.toml is the default run");
}

#[test]
fn flags_override_the_config_and_the_printed_spec_reads_back() {
    let dir = temp_dir("spec-override");
    let config = dir.join("run.toml");
    std::fs::write(
        &config,
        "[model]\nspec = \"mlp:8,16,4\"\n[data]\nsource = \"synthetic:64,8,4\"\n\
         [pipeline]\nschedule = \"gpipe\"\nmicrobatches = 4\n[training]\nbatch = 16\nsteps = 7\n",
    )
    .unwrap();
    let printed = conveyor_ok(&["train", "--config", arg(&config), "--batch", "8", "--no-shuffle", "--print-config"]);
    let spec = RunSpec::from_toml_str(&printed).unwrap();
    assert_eq!(spec.training.batch, 8, "the flag wins");
    assert_eq!((spec.training.steps, spec.pipeline.schedule), (Some(7), ScheduleKind::GPipe), "the file's values stay");
    assert!(!spec.training.shuffle);
    assert_eq!(spec.training.epochs, RunSpec::default().training.epochs, "what neither sets is the default");
    let again = dir.join("printed.toml");
    std::fs::write(&again, &printed).unwrap();
    assert_eq!(conveyor_ok(&["train", "--config", arg(&again), "--print-config"]), printed);
}

#[test]
fn unknown_keys_and_bad_values_name_the_key() {
    let error = RunSpec::from_toml_str("[pipeline]\nmicrobatches = 4\nshedule = \"gpipe\"\n").unwrap_err();
    let SpecError::Toml { ref key, line, .. } = error else { panic!("{error:?}") };
    assert_eq!((key.as_str(), line), ("pipeline.shedule", Some(3)));
    assert!(error.to_string().contains("unknown field `shedule`, expected one of"), "{error}");
    let cases = [
        ("[pipeline]\nschedule = \"round-robin\"\n", "pipeline.schedule", Some("--schedule"), "expected one of"),
        ("[training]\nbatch = -1\n", "training.batch", Some("--batch"), "-1 is negative"),
        ("[training]\nprecision = \"f64\"\n", "training.precision", Some("--precision"), "use f32"),
        ("[optimizer]\nlr_schedule = \"sawtooth\"\n", "optimizer.lr_schedule", Some("--lr-schedule"), "step:N,GAMMA"),
        ("[pipeline]\ndevice_memory = \"lots\"\n", "pipeline.device_memory", Some("--device-memory"), "512MiB"),
        ("[pipeline]\nplacement = []\n", "pipeline.placement", Some("--placement"), "no stages"),
        ("[pipeline]\nbucket_size = \"big\"\n", "pipeline.bucket_size", Some("--bucket-size"), "or off"),
        ("[pipeline]\nsync = \"gossip\"\n", "pipeline.sync", Some("--sync"), "downpour:F,P"),
        ("[pipeline]\ncompress = \"topk:0\"\n", "pipeline.compress", Some("--compress"), "powersgd:R"),
        ("[pipeline]\ninterleaving = \"seed:x\"\n", "pipeline.interleaving", Some("--interleaving"), "replay:PATH"),
        ("[optimizer]\nname = \"lamb\"\n", "optimizer.name", Some("--optimizer"), "use sgd, momentum, adam or adamw"),
        ("[outputs]\nsvgs = \"x.svg\"\n", "outputs.svgs", None, "unknown field"),
        ("[trainig]\nbatch = 8\n", "trainig", None, "unknown field `trainig`"),
    ];
    for (text, want_key, want_flag, want_message) in cases {
        match RunSpec::from_toml_str(text) {
            Err(SpecError::Toml { key, flag, message, .. }) => {
                assert_eq!((key.as_str(), flag), (want_key, want_flag), "{text}");
                assert!(message.contains(want_message), "{text}: {message}");
            }
            other => panic!("{text}: {other:?}"),
        }
    }
    // Cross-field checks come back as variants with their numbers.
    let mut spec = RunSpec::default();
    spec.pipeline.microbatches = 64;
    assert!(matches!(spec.validate(), Err(SpecError::MicrobatchesOverBatch { microbatches: 64, batch: 32 })));
    spec.pipeline.microbatches = 8;
    spec.training.precision = "bf16".parse().unwrap();
    spec.validate().unwrap();
    spec.pipeline.tensor_parallel = 2;
    assert!(matches!(spec.validate(), Err(SpecError::MixedPrecision { tensor_parallel: 2, .. })));
}

#[test]
fn a_bad_config_file_exits_2_naming_the_path() {
    let dir = temp_dir("spec-bad-config");
    let missing = dir.join("missing.toml");
    assert_usage_error(&["train", "--config", arg(&missing)], &format!("--config {}", missing.display()));
    assert_usage_error(&["train", "--config", arg(&dir)], &format!("--config {}", dir.display()));
    let invalid = dir.join("invalid.toml");
    std::fs::write(&invalid, "[pipeline]\nchunks = \"two\"\n").unwrap();
    let stderr = assert_usage_error(&["train", "--config", arg(&invalid)], &format!("--config {}", invalid.display()));
    assert!(stderr.contains("`pipeline.chunks` (--chunks) at line 2"), "{stderr}");
    let broken = dir.join("broken.toml");
    std::fs::write(&broken, "[pipeline\n").unwrap();
    assert_usage_error(&["train", "--config", arg(&broken)], "line 1");
    let inconsistent = dir.join("inconsistent.toml");
    std::fs::write(&inconsistent, "[pipeline]\nchunks = 2\n").unwrap();
    assert_usage_error(&["train", "--config", arg(&inconsistent)], "--chunks 2 needs --schedule interleaved");
    assert_usage_error(&["train", "--precision", "f64"], "use f32, bf16 or f16");
}

/// A small run: 40 rows in batches of 16 (2 steps an epoch, so 5 steps cross two epoch
/// boundaries), shuffled, momentum SGD on a cosine schedule.
const SMALL: &str = "[model]\nspec = \"mlp:8,16,4\"\n[data]\nsource = \"synthetic:40,8,4\"\n\
                     [pipeline]\nmicrobatches = 4\n[training]\nbatch = 16\nsteps = 5\nseed = 3\nlog_every = 0\n\
                     [optimizer]\nname = \"momentum\"\n";

#[test]
fn a_checkpoint_stores_its_spec_and_a_resume_starts_from_it() {
    let dir = temp_dir("spec-checkpoint");
    let config = dir.join("run.toml");
    std::fs::write(&config, SMALL).unwrap();
    let checkpoint = dir.join("ck.safetensors");
    conveyor_ok(&["train", "--config", arg(&config), "--steps", "2", "--checkpoint", arg(&checkpoint)]);
    let loaded = conveyor::engine::checkpoint::load(&checkpoint, &conveyor::engine::Device::host()).unwrap();
    let stored = RunSpec::from_toml_str(&loaded.metadata()["conveyor.spec"]).unwrap();
    let mut want = RunSpec::from_toml_str(SMALL).unwrap();
    want.training.steps = Some(2);
    assert_eq!(stored, want, "the spec trained, without this invocation's files");
    // No --model and no --config: the checkpoint's spec is the base (its data, batch, optimizer).
    let resumed = dir.join("resumed.safetensors");
    let stdout = conveyor_ok(&["train", "--resume", arg(&checkpoint), "--steps", "4", "--save", arg(&resumed)]);
    assert!(stdout.contains("mlp:8,16,4 on synthetic:40,8,4") && stdout.contains("at step 2"), "{stdout}");
    assert!(parameters(&resumed).contains_key("0.weight"));
}

#[test]
fn prepare_and_train_step_equal_conveyor_train_bit_for_bit() {
    let dir = temp_dir("spec-library");
    let config = dir.join("run.toml");
    std::fs::write(&config, SMALL).unwrap();
    let saved = dir.join("model.safetensors");
    conveyor_ok(&["train", "--config", arg(&config), "--save", arg(&saved)]);

    let mut run = RunSpec::from_file(&config).unwrap().prepare().unwrap();
    assert_eq!((run.total_steps, run.steps_per_epoch), (5, 2));
    for step in 0..run.total_steps {
        let report = run.train_step(step).unwrap();
        assert!(report.loss.is_finite());
    }
    let cli = parameters(&saved);
    let library = run.trainer.parameters().unwrap();
    assert_eq!(library.len(), cli.len());
    for (name, tensor) in library {
        let bits: Vec<u32> = tensor.to_vec_f32().iter().map(|v| v.to_bits()).collect();
        let want: Vec<u32> = f32s(&cli[&name].2).iter().map(|v| v.to_bits()).collect();
        assert_eq!(bits, want, "`{name}` differs between the library loop and conveyor train");
    }
}
