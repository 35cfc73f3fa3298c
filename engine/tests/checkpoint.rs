//! Checkpoints: bit-exact round trips for every dtype, strict loads that name the offending tensor,
//! corrupt and truncated files refused with `Error::Checkpoint`, atomic saves that leave the
//! previous file intact and no temporary file behind, and optimizer state that resumes exactly.
mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use common::TempDir;

use conveyor_engine::checkpoint::{
    self, Checkpoint, FORMAT_VERSION, FORMAT_VERSION_KEY, TensorSpec, write_file_atomically,
};
use conveyor_engine::optim::{AdamConfig, Optimizer, OptimizerConfig, SgdConfig, optimizer_state_name};
use conveyor_engine::{DType, Device, Error, Tensor};
use half::{bf16, f16};

fn sample_tensors(device: &Device) -> Vec<(String, Tensor)> {
    let f32_values = vec![1.5, -0.0, f32::MIN_POSITIVE, f32::MAX, -3.25e-7, f32::INFINITY];
    let f16_values: Vec<f16> = [0.1f32, -65504.0, 6.0e-8, 1.0].iter().map(|&x| f16::from_f32(x)).collect();
    let bf16_values: Vec<bf16> =
        [1.0e30f32, -2.5, 3.0e-30, 0.007_812_5, 7.0, -1.0].iter().map(|&x| bf16::from_f32(x)).collect();
    vec![
        ("layers.0.weight".into(), Tensor::from_vec(f32_values, [2, 3], device).unwrap()),
        ("layers.0.bias".into(), Tensor::from_f16_vec(f16_values, [4], device).unwrap()),
        ("layers.1.weight".into(), Tensor::from_bf16_vec(bf16_values, [3, 1, 2], device).unwrap()),
        ("scalar".into(), Tensor::from_vec(vec![42.0], Vec::<usize>::new(), device).unwrap()),
        ("empty".into(), Tensor::zeros([0, 5], DType::F32, device).unwrap()),
    ]
}

fn refs(tensors: &[(String, Tensor)]) -> Vec<(&str, &Tensor)> {
    tensors.iter().map(|(name, tensor)| (name.as_str(), tensor)).collect()
}

fn specs(tensors: &[(String, Tensor)]) -> Vec<TensorSpec> {
    tensors.iter().map(|(name, tensor)| TensorSpec::of(name.clone(), tensor)).collect()
}

fn checkpoint_reason(err: Error) -> String {
    match err {
        Error::Checkpoint { reason, .. } => reason,
        other => panic!("expected Error::Checkpoint, got {other:?}"),
    }
}

#[test]
fn round_trip_is_bit_exact_for_every_dtype_with_metadata() {
    let dir = TempDir::new("round-trip");
    let path = dir.join("model.safetensors");
    let device = Device::cpu(0);
    let tensors = sample_tensors(&device);
    let metadata =
        BTreeMap::from([("step".to_string(), "1200".to_string()), ("data_position".to_string(), "77".to_string())]);
    checkpoint::save_with_metadata(&path, &refs(&tensors), &metadata).unwrap();

    let loaded = checkpoint::load(&path, &device).unwrap();
    assert_eq!(loaded.len(), tensors.len());
    for (name, tensor) in &tensors {
        let got = loaded.get(name).unwrap_or_else(|| panic!("{name} missing"));
        assert!(got.bit_eq(tensor), "{name} differs after the round trip");
        assert!(got.device().same_device(&device));
    }
    assert_eq!(loaded.metadata_value::<u64>("step").unwrap(), 1200);
    assert_eq!(loaded.metadata_value::<u64>("data_position").unwrap(), 77);
    assert_eq!(loaded.metadata()[FORMAT_VERSION_KEY], FORMAT_VERSION.to_string());
    let err = loaded.metadata_value::<u64>("epoch").unwrap_err();
    assert!(checkpoint_reason(err).contains("`epoch` is missing"));

    // The strict loader accepts the exact list and hands tensors back in its order.
    let expected = specs(&tensors);
    let exact = checkpoint::load_exact(&path, &device, &expected).unwrap().take_exact(&expected).unwrap();
    for ((_, original), loaded) in tensors.iter().zip(&exact) {
        assert!(original.bit_eq(loaded));
    }
    assert_eq!(dir.entries(), vec!["model.safetensors"]);
}

#[test]
fn plain_save_loads_and_overwrites_atomically() {
    let dir = TempDir::new("overwrite");
    let path = dir.join("ckpt.safetensors");
    let device = Device::cpu(0);
    let first = Tensor::from_slice(&[1.0, 2.0], [2], &device).unwrap();
    checkpoint::save(&path, &[("w", &first)]).unwrap();
    let second = Tensor::from_slice(&[3.0, 4.0, 5.0], [3], &device).unwrap();
    checkpoint::save(&path, &[("w", &second)]).unwrap();
    let loaded = checkpoint::load(&path, &device).unwrap();
    assert!(loaded.get("w").unwrap().bit_eq(&second));
    assert_eq!(dir.entries(), vec!["ckpt.safetensors"]);
}

fn strict_error(expected: &[TensorSpec]) -> String {
    let dir = TempDir::new("strict");
    let path = dir.join("model.safetensors");
    let device = Device::cpu(0);
    let tensors = sample_tensors(&device);
    checkpoint::save(&path, &refs(&tensors)).unwrap();
    let in_use_before = device.memory_in_use();
    let err = checkpoint::load_exact(&path, &device, expected).unwrap_err();
    assert_eq!(device.memory_in_use(), in_use_before, "a refused strict load allocates nothing");
    // The in-memory form refuses the same way.
    let loaded = checkpoint::load(&path, &device).unwrap();
    let again = loaded.check_exact(expected).unwrap_err();
    let reason = checkpoint_reason(err);
    assert_eq!(reason, checkpoint_reason(again));
    reason
}

#[test]
fn strict_load_refuses_a_missing_tensor_and_names_it() {
    let device = Device::cpu(0);
    let mut expected = specs(&sample_tensors(&device));
    expected.push(TensorSpec::new("layers.2.weight", [8, 8], DType::F32));
    let reason = strict_error(&expected);
    assert!(reason.contains("tensor `layers.2.weight` is missing: expected f32 [8, 8]"), "{reason}");
}

#[test]
fn strict_load_refuses_an_extra_tensor_and_names_it() {
    let device = Device::cpu(0);
    let expected: Vec<TensorSpec> =
        specs(&sample_tensors(&device)).into_iter().filter(|s| s.name != "scalar").collect();
    let reason = strict_error(&expected);
    assert!(reason.contains("tensor `scalar` (f32 []) is in the file but not expected"), "{reason}");
}

#[test]
fn strict_load_refuses_a_wrong_shape_and_names_it() {
    let device = Device::cpu(0);
    let mut expected = specs(&sample_tensors(&device));
    expected[0].shape = [3, 2].into();
    let reason = strict_error(&expected);
    assert!(reason.contains("tensor `layers.0.weight` has shape [2, 3] but [3, 2] was expected"), "{reason}");
}

#[test]
fn strict_load_refuses_a_wrong_dtype_and_names_it() {
    let device = Device::cpu(0);
    let mut expected = specs(&sample_tensors(&device));
    expected[1].dtype = DType::F32;
    let reason = strict_error(&expected);
    assert!(reason.contains("tensor `layers.0.bias` has dtype f16 but f32 was expected"), "{reason}");
}

#[test]
fn take_checked_names_the_tensor() {
    let dir = TempDir::new("take-checked");
    let path = dir.join("m.safetensors");
    let device = Device::cpu(0);
    let tensors = sample_tensors(&device);
    checkpoint::save(&path, &refs(&tensors)).unwrap();
    let mut loaded = checkpoint::load(&path, &device).unwrap();
    let err = loaded.take_checked("layers.1.weight", &[3, 2].into(), DType::BF16).unwrap_err();
    assert!(checkpoint_reason(err).contains("`layers.1.weight` has shape [3, 1, 2] but [3, 2] was expected"));
    let err = loaded.take_checked("nope", &[1].into(), DType::F32).unwrap_err();
    assert!(checkpoint_reason(err).contains("`nope` is missing"));
    assert!(loaded.take_checked("layers.1.weight", &[3, 1, 2].into(), DType::BF16).is_ok());
    assert!(loaded.get("layers.1.weight").is_none());
}

#[test]
fn truncated_and_corrupt_files_are_refused_not_panicked_on() {
    let dir = TempDir::new("corrupt");
    let path = dir.join("good.safetensors");
    let device = Device::cpu(0);
    let tensors = sample_tensors(&device);
    checkpoint::save(&path, &refs(&tensors)).unwrap();
    let bytes = std::fs::read(&path).unwrap();

    let mut cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", Vec::new()),
        ("four bytes", bytes[..4].to_vec()),
        ("header cut", bytes[..20].to_vec()),
        ("data cut", bytes[..bytes.len() - 3].to_vec()),
        ("one byte extra", [bytes.as_slice(), &[0]].concat()),
        ("huge header length", [&u64::MAX.to_le_bytes()[..], &bytes[8..]].concat()),
        ("not safetensors", b"this is not a checkpoint at all, just text".to_vec()),
    ];
    let mut json_broken = bytes.clone();
    json_broken[8] = b'[';
    cases.push(("broken JSON", json_broken));

    for (label, contents) in cases {
        let bad = dir.join("bad.safetensors");
        std::fs::write(&bad, &contents).unwrap();
        for result in [
            checkpoint::load(&bad, &device).map(|_| ()),
            checkpoint::load_exact(&bad, &device, &specs(&tensors)).map(|_| ()),
        ] {
            match result.unwrap_err() {
                Error::Checkpoint { path, reason } => {
                    assert!(path.ends_with("bad.safetensors"), "{label}: {path}");
                    assert!(reason.contains("truncated or corrupt"), "{label}: {reason}");
                }
                other => panic!("{label}: expected Error::Checkpoint, got {other:?}"),
            }
        }
    }
}

#[test]
fn a_missing_file_is_an_io_error_carrying_the_path() {
    let dir = TempDir::new("missing");
    let path = dir.join("nowhere.safetensors");
    match checkpoint::load(&path, &Device::cpu(0)).unwrap_err() {
        Error::Io { path: got, source } => {
            assert_eq!(got, path.display().to_string());
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected Error::Io, got {other:?}"),
    }
}

#[test]
fn a_tensor_of_a_dtype_conveyor_does_not_hold_is_refused_by_name() {
    let dir = TempDir::new("i64");
    let path = dir.join("ints.safetensors");
    let data = 7i64.to_le_bytes();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![1], &data).unwrap();
    let bytes = safetensors::serialize([("position_ids", view)], None).unwrap();
    std::fs::write(&path, bytes).unwrap();
    let reason = checkpoint_reason(checkpoint::load(&path, &Device::cpu(0)).unwrap_err());
    assert!(reason.contains("tensor `position_ids` has dtype I64"), "{reason}");
    let reason = checkpoint_reason(checkpoint::load_exact(&path, &Device::cpu(0), &[]).unwrap_err());
    assert!(reason.contains("tensor `position_ids` (I64 [1]) is in the file but not expected"), "{reason}");
}

#[test]
fn a_newer_format_version_is_refused() {
    let dir = TempDir::new("version");
    let path = dir.join("future.safetensors");
    let data = 1.0f32.to_le_bytes();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1], &data).unwrap();
    let metadata =
        std::collections::HashMap::from([(FORMAT_VERSION_KEY.to_string(), (FORMAT_VERSION + 1).to_string())]);
    std::fs::write(&path, safetensors::serialize([("w", view)], Some(metadata)).unwrap()).unwrap();
    let reason = checkpoint_reason(checkpoint::load(&path, &Device::cpu(0)).unwrap_err());
    assert!(reason.contains("format version"), "{reason}");
}

#[test]
fn loading_counts_against_the_device_budget() {
    let dir = TempDir::new("budget");
    let path = dir.join("big.safetensors");
    let host = Device::cpu(0);
    let big = Tensor::zeros([100], DType::F32, &host).unwrap();
    checkpoint::save(&path, &[("big", &big)]).unwrap();
    let small_device = Device::cpu_with_budget(1, Some(100));
    assert!(matches!(checkpoint::load(&path, &small_device), Err(Error::OutOfDeviceMemory { .. })));
    assert_eq!(small_device.memory_in_use(), 0);
}

// ---------------------------------------------------------------------------------------------
// Atomicity.
// ---------------------------------------------------------------------------------------------

fn save_previous(dir: &TempDir) -> (PathBuf, Tensor) {
    let path = dir.join("ckpt.safetensors");
    let previous = Tensor::from_slice(&[1.0, 2.0, 3.0], [3], &Device::cpu(0)).unwrap();
    checkpoint::save(&path, &[("w", &previous)]).unwrap();
    (path, previous)
}

fn assert_previous_intact(path: &Path, previous: &Tensor) {
    let loaded = checkpoint::load(path, &Device::cpu(0)).unwrap();
    assert!(loaded.get("w").unwrap().bit_eq(previous));
}

#[test]
fn a_writer_failing_midway_leaves_the_previous_file_and_no_temp_file() {
    let dir = TempDir::new("fail-midway");
    let (path, previous) = save_previous(&dir);
    let err = write_file_atomically(&path, |file| {
        file.write_all(b"half of a checkpoint")?;
        Err(std::io::Error::other("tensor source failed mid-way"))
    })
    .unwrap_err();
    match err {
        Error::Io { path: temp, source } => {
            assert!(temp.contains(".ckpt.safetensors.conveyor-tmp-"), "the error names the temporary file: {temp}");
            assert_eq!(source.to_string(), "tensor source failed mid-way");
        }
        other => panic!("expected Error::Io, got {other:?}"),
    }
    assert_previous_intact(&path, &previous);
    assert_eq!(dir.entries(), vec!["ckpt.safetensors"]);
}

#[test]
fn a_writer_panicking_midway_leaves_no_temp_file() {
    let dir = TempDir::new("panic-midway");
    let (path, previous) = save_previous(&dir);
    let outcome = std::panic::catch_unwind(|| {
        let _ = write_file_atomically(&path, |file| {
            file.write_all(b"partial")?;
            panic!("writer bug");
        });
    });
    assert!(outcome.is_err());
    assert_previous_intact(&path, &previous);
    assert_eq!(dir.entries(), vec!["ckpt.safetensors"]);
}

#[test]
fn a_directory_target_is_refused_before_anything_is_written() {
    // The target is a non-empty directory: refused before a temporary file is made.
    let dir = TempDir::new("rename");
    let target = dir.join("occupied");
    std::fs::create_dir(&target).unwrap();
    std::fs::write(target.join("keep"), b"x").unwrap();
    let tensor = Tensor::from_slice(&[1.0], [1], &Device::cpu(0)).unwrap();
    match checkpoint::save(&target, &[("w", &tensor)]).unwrap_err() {
        Error::OutputPath { path, reason } => {
            assert_eq!(path, target.display().to_string());
            assert!(reason.contains("is a directory"), "{reason}");
        }
        other => panic!("expected Error::OutputPath, got {other:?}"),
    }
    assert_eq!(dir.entries(), vec!["occupied"]);
    assert_eq!(std::fs::read(target.join("keep")).unwrap(), b"x");
}

#[test]
fn a_temp_file_that_cannot_be_created_is_an_io_error_with_its_path() {
    let dir = TempDir::new("no-dir");
    let path = dir.join("missing-subdir").join("ckpt.safetensors");
    let tensor = Tensor::from_slice(&[1.0], [1], &Device::cpu(0)).unwrap();
    match checkpoint::save(&path, &[("w", &tensor)]).unwrap_err() {
        Error::Io { path: temp, source } => {
            assert!(temp.contains("missing-subdir"), "{temp}");
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected Error::Io, got {other:?}"),
    }
    assert!(dir.entries().is_empty());
}

#[test]
fn invalid_saves_are_refused_before_touching_the_disk() {
    let dir = TempDir::new("invalid");
    let (path, previous) = save_previous(&dir);
    let tensor = Tensor::from_slice(&[9.0], [1], &Device::cpu(0)).unwrap();
    let err = checkpoint::save(&path, &[("w", &tensor), ("w", &tensor)]).unwrap_err();
    assert!(matches!(&err, Error::InvalidArgument { reason, .. } if reason.contains("`w` appears twice")), "{err}");
    let reserved = BTreeMap::from([(FORMAT_VERSION_KEY.to_string(), "7".to_string())]);
    let err = checkpoint::save_with_metadata(&path, &[("w", &tensor)], &reserved).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert_previous_intact(&path, &previous);
    assert_eq!(dir.entries(), vec!["ckpt.safetensors"]);
}

// ---------------------------------------------------------------------------------------------
// Optimizer state.
// ---------------------------------------------------------------------------------------------

fn grad_for(step: usize, param_idx: usize, numel: usize, device: &Device) -> Tensor {
    let values: Vec<f32> = (0..numel).map(|i| ((step * 7 + param_idx * 3 + i) as f32 * 0.37).sin()).collect();
    Tensor::from_vec(values, [numel], device).unwrap()
}

fn train(optimizer: &mut Optimizer, params: &mut [Tensor], steps: std::ops::Range<usize>, device: &Device) {
    for step in steps {
        let grads: Vec<Tensor> = params.iter().enumerate().map(|(i, p)| grad_for(step, i, p.numel(), device)).collect();
        let mut param_refs: Vec<&mut Tensor> = params.iter_mut().collect();
        optimizer.step(&mut param_refs, &grads.iter().collect::<Vec<_>>()).unwrap();
    }
}

fn resume_case(config: OptimizerConfig) {
    let dir = TempDir::new("resume");
    let path = dir.join("step3.safetensors");
    let device = Device::cpu(0);
    let names = ["fc.weight", "fc.bias"];
    let initial = || {
        vec![
            Tensor::from_slice(&[0.5, -0.25, 1.0, 2.0], [4], &device).unwrap(),
            Tensor::from_slice(&[0.1, 0.2], [2], &device).unwrap(),
        ]
    };

    // Five uninterrupted steps.
    let mut straight_params = initial();
    let mut straight = Optimizer::new(config, 2).unwrap();
    train(&mut straight, &mut straight_params, 0..5, &device);

    // Three steps, save parameters and state, resume into fresh objects, two more steps.
    let mut params = initial();
    let mut optimizer = Optimizer::new(config, 2).unwrap();
    train(&mut optimizer, &mut params, 0..3, &device);
    let param_refs: Vec<&Tensor> = params.iter().collect();
    let mut to_save: Vec<(String, Tensor)> =
        names.iter().zip(&params).map(|(n, p)| (n.to_string(), p.try_clone().unwrap())).collect();
    to_save.extend(optimizer.export_state(&names, &param_refs).unwrap());
    let metadata = BTreeMap::from([("step".to_string(), "3".to_string())]);
    checkpoint::save_with_metadata(&path, &refs(&to_save), &metadata).unwrap();

    let mut fresh_params = initial();
    let mut resumed = Optimizer::new(config, 2).unwrap();
    let mut expected: Vec<TensorSpec> = names.iter().zip(&fresh_params).map(|(n, p)| TensorSpec::of(*n, p)).collect();
    expected.extend(resumed.state_specs(&names, &fresh_params.iter().collect::<Vec<_>>()).unwrap());
    let mut loaded: Checkpoint = checkpoint::load_exact(&path, &device, &expected).unwrap();
    assert_eq!(loaded.metadata_value::<u64>("step").unwrap(), 3);
    resumed.import_state(&names, &fresh_params.iter().collect::<Vec<_>>(), &mut loaded).unwrap();
    for (name, param) in names.iter().zip(fresh_params.iter_mut()) {
        param.copy_from(&loaded.take(name).unwrap()).unwrap();
    }
    assert!(loaded.is_empty(), "import takes its tensors: left {:?}", loaded.names().collect::<Vec<_>>());
    assert_eq!(resumed.state(0).unwrap().step(), 3);
    train(&mut resumed, &mut fresh_params, 3..5, &device);

    for (resumed, straight) in fresh_params.iter().zip(&straight_params) {
        assert!(resumed.bit_eq(straight), "{config:?}: resumed training differs from uninterrupted training");
    }
}

#[test]
fn sgd_momentum_resumes_bit_exactly() {
    resume_case(SgdConfig::new(0.1).with_momentum(0.9).with_nesterov(true).into());
}

#[test]
fn adam_resumes_bit_exactly() {
    resume_case(OptimizerConfig::adam(1e-2));
}

#[test]
fn adamw_resumes_bit_exactly() {
    resume_case(OptimizerConfig::AdamW(AdamConfig::adamw(1e-2).with_betas(0.8, 0.95)));
}

#[test]
fn exported_state_uses_the_documented_names() {
    let device = Device::cpu(0);
    let param = Tensor::from_slice(&[1.0, 2.0], [2], &device).unwrap();
    let optimizer = Optimizer::new(OptimizerConfig::adamw(1e-3), 1).unwrap();
    let exported = optimizer.export_state(&["w"], &[&param]).unwrap();
    let names: Vec<&str> = exported.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["optimizer.w.step", "optimizer.w.exp_avg", "optimizer.w.exp_avg_sq"]);
    assert_eq!(exported[0].1.dims(), &[] as &[usize]);
    assert_eq!(exported[0].1.as_f32().unwrap(), &[0.0]);
    assert_eq!(optimizer_state_name("layers.3.weight", "momentum_buffer"), "optimizer.layers.3.weight.momentum_buffer");
    let sgd = Optimizer::new(SgdConfig::new(0.1), 1).unwrap();
    assert_eq!(sgd.export_state(&["w"], &[&param]).unwrap().len(), 1, "plain SGD keeps only the step");
}

#[test]
fn importing_incomplete_or_misshapen_state_names_the_tensor_and_keeps_the_old_state() {
    let dir = TempDir::new("import");
    let path = dir.join("state.safetensors");
    let device = Device::cpu(0);
    let mut param = Tensor::from_slice(&[1.0, 2.0], [2], &device).unwrap();
    let mut optimizer = Optimizer::new(OptimizerConfig::adam(1e-2), 1).unwrap();
    let grad = Tensor::from_slice(&[0.5, 0.5], [2], &device).unwrap();
    optimizer.step(&mut [&mut param], &[&grad]).unwrap();

    let step = Tensor::from_vec(vec![4.0], Vec::<usize>::new(), &device).unwrap();
    let exp_avg = Tensor::zeros([2], DType::F32, &device).unwrap();
    let wrong_shape = Tensor::zeros([3], DType::F32, &device).unwrap();
    let fractional_step = Tensor::from_vec(vec![1.5], Vec::<usize>::new(), &device).unwrap();

    let cases: Vec<(Vec<(&str, &Tensor)>, &str)> = vec![
        (vec![], "tensor `optimizer.w.step` is missing"),
        (
            vec![("optimizer.w.step", &step), ("optimizer.w.exp_avg", &exp_avg)],
            "tensor `optimizer.w.exp_avg_sq` is missing",
        ),
        (
            vec![
                ("optimizer.w.step", &step),
                ("optimizer.w.exp_avg", &exp_avg),
                ("optimizer.w.exp_avg_sq", &wrong_shape),
            ],
            "tensor `optimizer.w.exp_avg_sq` is f32 [3] but f32 [2]",
        ),
        (vec![("optimizer.w.step", &fractional_step)], "holds 1.5, which is not a step count"),
    ];
    for (tensors, message) in cases {
        checkpoint::save(&path, &tensors).unwrap();
        let mut loaded = checkpoint::load(&path, &device).unwrap();
        let n_before = loaded.len();
        let reason = checkpoint_reason(optimizer.import_state(&["w"], &[&param], &mut loaded).unwrap_err());
        assert!(reason.contains(message), "expected `{message}` in: {reason}");
        assert_eq!(loaded.len(), n_before, "a failed import takes nothing");
        assert_eq!(optimizer.state(0).unwrap().step(), 1, "a failed import keeps the old state");
    }

    // A step of 0 means no state yet: buffers are optional and ignored.
    let zero = Tensor::from_vec(vec![0.0], Vec::<usize>::new(), &device).unwrap();
    checkpoint::save(&path, &[("optimizer.w.step", &zero)]).unwrap();
    let mut loaded = checkpoint::load(&path, &device).unwrap();
    optimizer.import_state(&["w"], &[&param], &mut loaded).unwrap();
    assert_eq!(optimizer.state(0).unwrap().step(), 0);
    assert_eq!(optimizer.state_size_in_bytes(), 0);
}

#[test]
fn a_file_written_by_pytorch_loads_with_its_values() {
    // fixtures/torch_saved.safetensors comes from fixtures/make_checkpoint_fixture.py
    // (safetensors.torch.save_file).
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch_saved.safetensors");
    let device = Device::cpu(0);
    let expected = [
        TensorSpec::new("linear.weight", [2, 3], DType::F32),
        TensorSpec::new("linear.bias", [2], DType::F16),
        TensorSpec::new("norm.weight", [2, 2], DType::BF16),
        TensorSpec::new("optimizer.linear.weight.step", Vec::<usize>::new(), DType::F32),
    ];
    let loaded = checkpoint::load_exact(&path, &device, &expected).unwrap();
    assert_eq!(loaded.metadata_value::<u64>("step").unwrap(), 7);
    assert!(!loaded.metadata().contains_key(FORMAT_VERSION_KEY), "files from elsewhere carry no version");
    let tensors = loaded.take_exact(&expected).unwrap();
    assert_eq!(tensors[0].as_f32().unwrap(), &[0.0, 0.25, 0.5, 0.75, 1.0, 1.25]);
    assert_eq!(tensors[1].to_vec_f32(), vec![-1.5, 65504.0]);
    assert_eq!(tensors[2].to_vec_f32(), vec![1.0, -2.0, 0.5, bf16::from_f32(3.0e38).to_f32()]);
    assert_eq!(tensors[3].as_f32().unwrap(), &[7.0]);
}
