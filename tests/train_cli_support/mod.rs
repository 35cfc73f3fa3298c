//! Helpers shared by the `tests/train_cli*.rs` suites: run the built `conveyor` binary, make
//! temporary directories, write data files, and compare checkpoints tensor by tensor.
#![allow(dead_code)]
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

/// Runs `conveyor ARGS` with captured output.
pub fn conveyor(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_conveyor")).args(args).output().expect("the conveyor binary runs")
}

/// Runs `conveyor ARGS`, asserts it succeeded, and returns its stdout.
pub fn conveyor_ok(args: &[&str]) -> String {
    let out = conveyor(args);
    assert!(out.status.success(), "{args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// Asserts `conveyor ARGS` exits with code 2, without a panic, and with `expected` on stderr
/// (case-insensitive); returns stderr.
pub fn assert_usage_error(args: &[&str], expected: &str) -> String {
    let out = conveyor(args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "{args:?}: stderr {stderr}");
    assert!(stderr.to_lowercase().contains(&expected.to_lowercase()), "{args:?}: expected `{expected}` in {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    stderr
}

/// A fresh, empty directory for one test, removed with everything in it when dropped (so the
/// suite leaves nothing in the temporary folder, pass or fail). Derefs to its path.
pub struct TempDir(PathBuf);

impl std::ops::Deref for TempDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl TempDir {
    /// Every entry in the directory, sorted.
    pub fn entries(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh, empty directory for one test (see [`TempDir`]).
pub fn temp_dir(name: &str) -> TempDir {
    let dir = std::env::temp_dir().join(format!("conveyor-train-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    TempDir(dir)
}

/// A path as `&str` for an argument list.
pub fn arg(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 temporary path")
}

/// A committed fixture under `tests/fixtures`.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// Writes a safetensors file of raw tensors `(name, dtype, shape, little-endian bytes)`.
pub fn write_safetensors(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| (*name, TensorView::new(*dtype, shape.clone(), bytes).unwrap()))
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// Writes a data file: `inputs` f32 `[N, features...]` and `labels` i64 `[N]`.
pub fn write_data(path: &Path, inputs: &[f32], feature_shape: &[usize], labels: &[i64]) {
    let mut shape = vec![labels.len()];
    shape.extend_from_slice(feature_shape);
    let input_bytes = inputs.iter().flat_map(|v| v.to_le_bytes()).collect();
    let label_bytes = labels.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_safetensors(
        path,
        &[("inputs", Dtype::F32, shape, input_bytes), ("labels", Dtype::I64, vec![labels.len()], label_bytes)],
    );
}

/// A learnable data set: `n` rows of `d` features in `c` classes (class centre plus a small
/// deterministic wobble), labels cycling through the classes.
pub fn separable_data(n: usize, d: usize, c: usize) -> (Vec<f32>, Vec<i64>) {
    let labels: Vec<i64> = (0..n).map(|row| (row % c) as i64).collect();
    let inputs = (0..n)
        .flat_map(|row| {
            (0..d).map(move |f| if f % c == row % c { 2.0 } else { 0.0 } + ((row * 7 + f * 3) % 11) as f32 * 0.02)
        })
        .collect();
    (inputs, labels)
}

/// Tensors by name as `(dtype, shape, little-endian bytes)`.
pub type RawTensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

/// A checkpoint's tensors and its metadata.
pub fn read_checkpoint(path: &Path) -> (RawTensors, BTreeMap<String, String>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let metadata = header.metadata().clone().unwrap_or_default().into_iter().collect();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let tensors = file
        .tensors()
        .into_iter()
        .map(|(name, view)| (name, (view.dtype(), view.shape().to_vec(), view.data().to_vec())))
        .collect();
    (tensors, metadata)
}

/// The parameter tensors of a checkpoint (optimizer state set aside), by name.
pub fn parameters(path: &Path) -> RawTensors {
    read_checkpoint(path).0.into_iter().filter(|(name, _)| !name.starts_with("optimizer.")).collect()
}

/// f32 values of a tensor's bytes.
pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

/// Parses a metrics file into its JSON lines.
pub fn metrics(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}
