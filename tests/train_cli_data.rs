//! `conveyor train --data` with files: safetensors data files (consecutive rows without shuffling,
//! the held-out split from the end, the class count), MNIST IDX directories (plain and gzipped),
//! and every kind of bad data file refused with exit code 2 and a message naming the problem.
mod train_cli_support;

use std::io::Write;
use std::path::Path;

use safetensors::tensor::Dtype;
use train_cli_support::{
    arg, assert_usage_error, conveyor_ok, metrics, separable_data, temp_dir, write_data, write_safetensors,
};

#[test]
fn a_safetensors_file_trains_with_its_held_out_end() {
    let dir = temp_dir("data-file");
    let data = dir.join("data.safetensors");
    let (inputs, labels) = separable_data(100, 6, 3);
    write_data(&data, &inputs, &[6], &labels);
    let metrics_path = dir.join("m.jsonl");
    let stdout = conveyor_ok(&[
        "train",
        "--data",
        arg(&data),
        "--test-fraction",
        "0.2",
        "--batch",
        "16",
        "--microbatches",
        "4",
        "--epochs",
        "15",
        "--optimizer",
        "adam",
        "--lr",
        "0.02",
        "--log-every",
        "0",
        "--metrics",
        arg(&metrics_path),
    ]);
    // 20 of 100 rows held out from the end; 80 / 16 = 5 steps per epoch; default model over 6 features, 3 classes.
    assert!(stdout.contains("mlp:6,128,128,3 on"), "{stdout}");
    assert!(stdout.contains("(80 train rows, 20 test rows)"), "{stdout}");
    let summary = metrics(&metrics_path).pop().unwrap();
    assert_eq!(summary["steps"], 75);
    assert!(summary["test_accuracy"].as_f64().unwrap() >= 0.9, "{summary}");
}

#[test]
fn classes_flag_widens_the_class_count_and_checks_labels() {
    let dir = temp_dir("data-classes");
    let data = dir.join("data.safetensors");
    let (inputs, labels) = separable_data(32, 4, 3);
    write_data(&data, &inputs, &[4], &labels);
    let common =
        ["train", "--data", arg(&data), "--batch", "8", "--microbatches", "2", "--steps", "2", "--log-every", "0"];
    let stdout = conveyor_ok(&[&common[..], &["--classes", "5"]].concat());
    assert!(stdout.contains("mlp:4,128,128,5"), "{stdout}");
    assert_usage_error(&[&common[..], &["--classes", "2"]].concat(), "label 2");
    assert_usage_error(&[&common[..], &["--model", "mlp:4,8,2"]].concat(), "labels out of range");
}

#[test]
fn bad_data_files_exit_2_naming_the_problem() {
    let dir = temp_dir("data-bad");
    let path = |name: &str| dir.join(name);
    let (inputs, labels) = separable_data(8, 4, 2);
    let corrupt = path("corrupt.safetensors");
    std::fs::write(&corrupt, b"\x10\x00\x00\x00\x00\x00\x00\x00{\"inputs\": [1,").unwrap();
    let mut with_nan = inputs.clone();
    with_nan[4 * 5 + 2] = f32::NAN;
    write_data(&path("nan.safetensors"), &with_nan, &[4], &labels);
    let mut negative = labels.clone();
    negative[3] = -1;
    write_data(&path("negative.safetensors"), &inputs, &[4], &negative);
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let i64_bytes = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    write_safetensors(
        &path("float-labels.safetensors"),
        &[
            ("inputs", Dtype::F32, vec![8, 4], f32_bytes(&inputs)),
            ("labels", Dtype::F32, vec![8], f32_bytes(&[0.0; 8])),
        ],
    );
    write_safetensors(
        &path("f16-inputs.safetensors"),
        &[("inputs", Dtype::F16, vec![8, 4], vec![0; 64]), ("labels", Dtype::I64, vec![8], i64_bytes(&labels))],
    );
    write_safetensors(
        &path("short-labels.safetensors"),
        &[
            ("inputs", Dtype::F32, vec![8, 4], f32_bytes(&inputs)),
            ("labels", Dtype::I64, vec![6], i64_bytes(&labels[..6])),
        ],
    );
    write_safetensors(
        &path("no-labels.safetensors"),
        &[("inputs", Dtype::F32, vec![8, 4], f32_bytes(&inputs)), ("targets", Dtype::I64, vec![8], i64_bytes(&labels))],
    );
    write_safetensors(
        &path("flat-inputs.safetensors"),
        &[("inputs", Dtype::F32, vec![32], f32_bytes(&inputs)), ("labels", Dtype::I64, vec![8], i64_bytes(&labels))],
    );
    let cases = [
        ("missing.safetensors", "no such file or directory"),
        ("corrupt.safetensors", "not a valid safetensors file"),
        ("nan.safetensors", "row 5 has a non-finite value (NaN)"),
        ("negative.safetensors", "row 3 has label -1"),
        ("float-labels.safetensors", "`labels` has dtype F32; save class indices as int64"),
        ("f16-inputs.safetensors", "`inputs` has dtype F16; save it as float32"),
        ("short-labels.safetensors", "`labels` has shape [6] but `inputs` has 8 rows"),
        ("no-labels.safetensors", "no tensor `labels` (found: inputs, targets)"),
        ("flat-inputs.safetensors", "`inputs` has shape [32]"),
    ];
    for (name, expected) in cases {
        let file = path(name);
        assert_usage_error(
            &["train", "--data", arg(&file), "--batch", "4", "--microbatches", "2", "--steps", "1"],
            expected,
        );
    }
}

/// Writes an IDX file of unsigned bytes, gzipped when `gz`.
fn write_idx(path: &Path, dims: &[u32], data: &[u8], gz: bool) {
    let mut bytes = vec![0, 0, 0x08, dims.len() as u8];
    for d in dims {
        bytes.extend(d.to_be_bytes());
    }
    bytes.extend_from_slice(data);
    if gz {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(&bytes).unwrap();
        bytes = encoder.finish().unwrap();
        std::fs::write(path.with_file_name(format!("{}.gz", path.file_name().unwrap().to_str().unwrap())), bytes)
            .unwrap();
    } else {
        std::fs::write(path, bytes).unwrap();
    }
}

/// A tiny MNIST-like set: `n` images `size x size`, the label's row lit (pixels 255), labels 0..4.
fn write_mnist(dir: &Path, prefix: &str, n: usize, size: usize, gz: bool) {
    let labels: Vec<u8> = (0..n).map(|i| (i % 4) as u8).collect();
    let mut pixels = vec![0u8; n * size * size];
    for (i, &label) in labels.iter().enumerate() {
        for col in 0..size {
            pixels[i * size * size + usize::from(label) * size + col] = 255;
        }
        pixels[i * size * size + (i * 5) % (size * size)] = 128;
    }
    write_idx(&dir.join(format!("{prefix}-images-idx3-ubyte")), &[n as u32, size as u32, size as u32], &pixels, gz);
    write_idx(&dir.join(format!("{prefix}-labels-idx1-ubyte")), &[n as u32], &labels, gz);
}

#[test]
fn an_mnist_directory_trains_plain_or_gzipped() {
    for gz in [false, true] {
        let dir = temp_dir(if gz { "mnist-gz" } else { "mnist" });
        write_mnist(&dir, "train", 64, 6, gz);
        write_mnist(&dir, "t10k", 16, 6, !gz);
        let stdout = conveyor_ok(&[
            "train",
            "--data",
            arg(&dir),
            "--batch",
            "16",
            "--microbatches",
            "4",
            "--epochs",
            "10",
            "--lr",
            "0.01",
            "--log-every",
            "0",
        ]);
        // Images are [1, 6, 6]: the default MLP flattens them to 36 inputs and has 10 outputs.
        assert!(stdout.contains("mlp:36,128,128,10 on"), "{stdout}");
        assert!(stdout.contains("(64 train rows, 16 test rows)"), "{stdout}");
        assert!(stdout.contains("test accuracy 100.00%"), "{stdout}");
    }
}

#[test]
fn broken_mnist_directories_exit_2() {
    let dir = temp_dir("mnist-bad");
    write_mnist(&dir, "train", 8, 4, false);
    assert_usage_error(&["train", "--data", arg(&dir)], "neither t10k-images-idx3-ubyte nor t10k-images-idx3-ubyte.gz");
    write_mnist(&dir, "t10k", 4, 4, false);
    write_idx(&dir.join("t10k-labels-idx1-ubyte"), &[3], &[0, 1, 2], false);
    assert_usage_error(&["train", "--data", arg(&dir)], "3 labels for the 4 images");
    write_idx(&dir.join("t10k-labels-idx1-ubyte"), &[4], &[0, 1, 12, 3], false);
    assert_usage_error(&["train", "--data", arg(&dir)], "row 2 has label 12");
    std::fs::write(dir.join("t10k-labels-idx1-ubyte"), [0, 0, 8, 1, 0, 0, 0, 9, 1]).unwrap();
    assert_usage_error(&["train", "--data", arg(&dir)], "need 9 bytes of data");
}
