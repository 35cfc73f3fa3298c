//! `conveyor train` and PyTorch: `--init` accepts a state_dict that PyTorch saved and trains from it
//! exactly as torch does, refuses a file whose names or shapes differ, and a `--save` checkpoint of
//! an `mlp:` spec loads into the matching `nn.Sequential`.
//!
//! The fixtures come from `tests/fixtures/make_torch_init.py`. Tolerance, as in
//! `tests/torch_reference.rs`: `|got − want| ≤ 1e-5 · max(|want|, 1e-3)`.
mod train_cli_support;

use std::path::Path;

use safetensors::tensor::Dtype;
use train_cli_support::{
    arg, assert_usage_error, conveyor_ok, f32s, fixture, parameters, read_checkpoint, temp_dir, write_safetensors,
};

const RTOL: f64 = 1e-5;
const FLOOR: f64 = 1e-3;

fn sgd_from_torch_init(save: &Path, steps: &str, extra: &[&str]) -> String {
    let init = fixture("torch_init.safetensors");
    let data = fixture("torch_data.safetensors");
    let args = [
        "train",
        "--model",
        "mlp:8,16,4",
        "--init",
        arg(&init),
        "--data",
        arg(&data),
        "--no-shuffle",
        "--optimizer",
        "momentum",
        "--lr",
        "0.1",
        "--lr-schedule",
        "constant",
        "--batch",
        "8",
        "--microbatches",
        "1",
        "--steps",
        steps,
        "--save",
        arg(save),
        "--log-every",
        "0",
    ];
    conveyor_ok(&[&args[..], extra].concat())
}

#[test]
fn init_from_torch_then_three_sgd_steps_match_torch() {
    let dir = temp_dir("torch-init");
    let want = parameters(&fixture("torch_init_sgd3.safetensors"));
    for devices in ["cpu:1", "cpu:2"] {
        let save = dir.join(format!("{devices}.safetensors"));
        let stdout = sgd_from_torch_init(&save, "3", &["--devices", devices]);
        assert!(stdout.contains("initialised 4 parameter tensors"), "{stdout}");
        let got = parameters(&save);
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
        let mut worst: f64 = 0.0;
        for (name, (_, shape, bytes)) in &got {
            assert_eq!(shape, &want[name].1, "{name}");
            for (i, (g, w)) in f32s(bytes).into_iter().zip(f32s(&want[name].2)).enumerate() {
                let error = (g as f64 - w as f64).abs() / (w as f64).abs().max(FLOOR);
                assert!(error <= RTOL, "{devices}: `{name}`[{i}] is {g}, torch's {w} (scaled error {error:e})");
                worst = worst.max(error);
            }
        }
        eprintln!("{devices}: worst scaled error against torch {worst:e}");
    }
}

#[test]
fn zero_steps_save_the_init_file_unchanged() {
    let dir = temp_dir("torch-init-zero");
    let save = dir.join("converted.safetensors");
    sgd_from_torch_init(&save, "0", &[]);
    assert_eq!(parameters(&save), parameters(&fixture("torch_init.safetensors")));
}

#[test]
fn init_files_with_wrong_names_or_shapes_exit_2_naming_the_tensor() {
    let dir = temp_dir("torch-init-bad");
    let (good, _) = read_checkpoint(&fixture("torch_init.safetensors"));
    let write = |name: &str, tensors: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)>| {
        let path = dir.join(name);
        write_safetensors(&path, &tensors);
        path
    };
    let entry = |name: &'static str| (name, good[name].0, good[name].1.clone(), good[name].2.clone());
    let renamed = write(
        "renamed.safetensors",
        vec![
            entry("0.weight"),
            entry("0.bias"),
            ("fc2.weight", Dtype::F32, vec![4, 16], good["2.weight"].2.clone()),
            entry("2.bias"),
        ],
    );
    let reshaped = write(
        "reshaped.safetensors",
        vec![
            entry("0.weight"),
            entry("0.bias"),
            ("2.weight", Dtype::F32, vec![16, 4], good["2.weight"].2.clone()),
            entry("2.bias"),
        ],
    );
    let missing = write("missing.safetensors", vec![entry("0.weight"), entry("0.bias"), entry("2.weight")]);
    let base = ["train", "--model", "mlp:8,16,4", "--data", "synthetic:32,8,4", "--steps", "1", "--batch", "8"];
    let renamed_err = assert_usage_error(&[&base[..], &["--init", arg(&renamed)]].concat(), "`2.weight` is missing");
    assert!(renamed_err.contains("`fc2.weight` is in the file but not expected"), "{renamed_err}");
    assert_usage_error(&[&base[..], &["--init", arg(&reshaped)]].concat(), "`2.weight` has shape [16, 4] but [4, 16]");
    assert_usage_error(&[&base[..], &["--init", arg(&missing)]].concat(), "`2.bias` is missing");
    assert_usage_error(
        &[&base[..], &["--init", "/no/such/init.safetensors"]].concat(),
        "--init /no/such/init.safetensors",
    );
    let corrupt = dir.join("corrupt.safetensors");
    std::fs::write(&corrupt, b"not safetensors at all").unwrap();
    assert_usage_error(&[&base[..], &["--init", arg(&corrupt)]].concat(), "not a valid safetensors file");
}

#[test]
fn a_saved_mlp_checkpoint_loads_into_the_matching_torch_sequential() {
    let dir = temp_dir("torch-load");
    let save = dir.join("mlp.safetensors");
    conveyor_ok(&[
        "train",
        "--model",
        "mlp:8,16,16,4",
        "--data",
        "synthetic:64,8,4",
        "--batch",
        "16",
        "--microbatches",
        "4",
        "--steps",
        "3",
        "--save",
        arg(&save),
        "--log-every",
        "0",
    ]);
    // Without torch: the names, shapes and dtypes nn.Sequential(Linear(8,16), ReLU, Linear(16,16),
    // ReLU, Linear(16,4)).state_dict() has.
    let want: Vec<(&str, Vec<usize>)> = vec![
        ("0.bias", vec![16]),
        ("0.weight", vec![16, 8]),
        ("2.bias", vec![16]),
        ("2.weight", vec![16, 16]),
        ("4.bias", vec![4]),
        ("4.weight", vec![4, 16]),
    ];
    let got: Vec<(String, Vec<usize>)> = parameters(&save)
        .into_iter()
        .map(|(name, (dtype, shape, _))| {
            assert_eq!(dtype, Dtype::F32, "{name}");
            (name, shape)
        })
        .collect();
    assert_eq!(got, want.iter().map(|(n, s)| (n.to_string(), s.clone())).collect::<Vec<_>>());
    let python = Path::new("/tmp/tvenv/bin/python");
    if !python.exists() {
        eprintln!(
            "skipped the PyTorch load check: {} is not here (names, shapes and dtypes were checked)",
            python.display()
        );
        return;
    }
    let out = std::process::Command::new(python)
        .arg(fixture("check_torch_load.py"))
        .args([arg(&save), "8,16,16,4"])
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.starts_with("ok"),
        "torch could not load it: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The weights-only form loads with a plain load_state_dict(load_file(path)).
    let weights_only = dir.join("weights.safetensors");
    conveyor_ok(&[
        "train",
        "--model",
        "mlp:8,16,16,4",
        "--data",
        "synthetic:64,8,4",
        "--batch",
        "16",
        "--microbatches",
        "4",
        "--steps",
        "1",
        "--save",
        arg(&weights_only),
        "--log-every",
        "0",
    ]);
    assert!(read_checkpoint(&weights_only).0.keys().all(|name| !name.starts_with("optimizer.")));
}
