//! `conveyor train --init FILE` and `--resume FILE` refuse a file holding NaN or infinity in any
//! tensor (a parameter, or optimizer state on resume; f32 or f16), with exit status 2 and a
//! message naming the file, the tensor, the element and what would fix it; the same files
//! unpoisoned still train. Every file a test writes lives in a directory removed when it ends.
mod train_cli_support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};
use train_cli_support::{RawTensors, arg, assert_usage_error, conveyor_ok, fixture, read_checkpoint, temp_dir};

/// A fresh directory for one test, removed (with everything in it) when dropped.
struct ScratchDir(train_cli_support::TempDir);

impl ScratchDir {
    fn new(name: &str) -> ScratchDir {
        ScratchDir(temp_dir(name))
    }

    fn join(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes `tensors` with `metadata` as a safetensors file.
fn write_file(path: &Path, tensors: &RawTensors, metadata: &BTreeMap<String, String>) {
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, (dtype, shape, bytes))| (name.as_str(), TensorView::new(*dtype, shape.clone(), bytes).unwrap()))
        .collect();
    let metadata = (!metadata.is_empty()).then(|| metadata.clone().into_iter().collect());
    std::fs::write(path, safetensors::serialize(views, metadata).unwrap()).unwrap();
}

/// `tensors` with element `index` of f32 tensor `name` set to `value`.
fn poison(tensors: &RawTensors, name: &str, index: usize, value: f32) -> RawTensors {
    let mut tensors = tensors.clone();
    let (dtype, _, bytes) = tensors.get_mut(name).unwrap_or_else(|| panic!("no tensor `{name}`"));
    assert_eq!(*dtype, Dtype::F32);
    bytes[index * 4..index * 4 + 4].copy_from_slice(&value.to_le_bytes());
    tensors
}

const INIT_RUN: [&str; 12] = [
    "train",
    "--model",
    "mlp:8,16,4",
    "--data",
    "synthetic:32,8,4",
    "--steps",
    "1",
    "--batch",
    "8",
    "--log-every",
    "0",
    "--no-shuffle",
];

#[test]
fn init_files_with_nan_or_infinity_exit_2_naming_the_tensor_and_element() {
    let dir = ScratchDir::new("nonfinite-init");
    let (good, _) = read_checkpoint(&fixture("torch_init.safetensors"));
    let good_path = dir.join("good.safetensors");
    write_file(&good_path, &good, &BTreeMap::new());
    let stdout = conveyor_ok(&[&INIT_RUN[..], &["--init", arg(&good_path)]].concat());
    assert!(stdout.contains("initialised 4 parameter tensors"), "{stdout}");

    // 2.weight is [4, 16]: element 19 is [1, 3].
    let nan_path = dir.join("nan.safetensors");
    write_file(&nan_path, &poison(&good, "2.weight", 19, f32::NAN), &BTreeMap::new());
    let stderr = assert_usage_error(
        &[&INIT_RUN[..], &["--init", arg(&nan_path)]].concat(),
        "tensor `2.weight` holds NaN at [1, 3] (element 19",
    );
    assert!(stderr.contains(&format!("--init {}", nan_path.display())), "names the file: {stderr}");
    assert!(stderr.contains("save the weights again from a model whose parameters are all finite"), "{stderr}");

    let inf_path = dir.join("inf.safetensors");
    let both = poison(&poison(&good, "0.bias", 5, f32::NEG_INFINITY), "2.weight", 0, f32::INFINITY);
    write_file(&inf_path, &both, &BTreeMap::new());
    // The first tensor in name order is named.
    assert_usage_error(&[&INIT_RUN[..], &["--init", arg(&inf_path)]].concat(), "tensor `0.bias` holds -inf at [5]");

    // f16 (any float dtype is accepted by --init): 1.0 everywhere, +inf at element 7.
    let f16_path = dir.join("f16.safetensors");
    let mut half = good.clone();
    let mut bias = [0x3c00u16; 16];
    bias[7] = 0x7c00;
    half.insert("0.bias".into(), (Dtype::F16, vec![16], bias.iter().flat_map(|b| b.to_le_bytes()).collect()));
    write_file(&f16_path, &half, &BTreeMap::new());
    assert_usage_error(&[&INIT_RUN[..], &["--init", arg(&f16_path)]].concat(), "tensor `0.bias` holds inf at [7]");
    bias[7] = 0x3c00;
    half.insert("0.bias".into(), (Dtype::F16, vec![16], bias.iter().flat_map(|b| b.to_le_bytes()).collect()));
    write_file(&f16_path, &half, &BTreeMap::new());
    conveyor_ok(&[&INIT_RUN[..], &["--init", arg(&f16_path)]].concat());
}

#[test]
fn resume_files_with_nan_or_infinity_exit_2_naming_the_tensor() {
    let dir = ScratchDir::new("nonfinite-resume");
    let run = [
        "train",
        "--model",
        "mlp:8,16,4",
        "--data",
        "synthetic:32,8,4",
        "--batch",
        "8",
        "--optimizer",
        "adam",
        "--seed",
        "3",
        "--log-every",
        "0",
    ];
    let saved = dir.join("step1.safetensors");
    conveyor_ok(&[&run[..], &["--steps", "1", "--checkpoint", arg(&saved)]].concat());
    let (tensors, metadata) = read_checkpoint(&saved);
    fn resume<'a>(run: &[&'a str], path: &'a Path) -> Vec<&'a str> {
        [run, &["--steps", "2", "--resume", arg(path)]].concat()
    }

    let nan_param = dir.join("nan-param.safetensors");
    write_file(&nan_param, &poison(&tensors, "0.weight", 9, f32::NAN), &metadata);
    let stderr = assert_usage_error(&resume(&run, &nan_param), "tensor `0.weight` holds NaN at [1, 1] (element 9");
    assert!(stderr.contains(&format!("--resume {}", nan_param.display())), "names the file: {stderr}");
    assert!(stderr.contains("resume from an earlier checkpoint"), "{stderr}");

    let inf_state = dir.join("inf-state.safetensors");
    write_file(&inf_state, &poison(&tensors, "optimizer.2.bias.exp_avg_sq", 2, f32::INFINITY), &metadata);
    assert_usage_error(&resume(&run, &inf_state), "tensor `optimizer.2.bias.exp_avg_sq` holds inf at [2]");

    // The untouched checkpoint, rewritten the same way, still resumes.
    let good = dir.join("good.safetensors");
    write_file(&good, &tensors, &metadata);
    let stdout = conveyor_ok(&resume(&run, &good));
    assert!(stdout.contains("resumed from") && stdout.contains("at step 1"), "{stdout}");
}
