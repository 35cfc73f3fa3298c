//! Checkpoints as safetensors files: atomic writes, loads onto a device, and strict loads that
//! refuse a missing, extra, misshapen or mistyped tensor and name it.
//!
//! # Format
//!
//! A standard safetensors file (readable by `safetensors.torch.load_file`): tensors by name with
//! their shapes and dtypes (`F32`, `F16`, `BF16`), and a string-to-string metadata map that holds
//! whatever the caller adds (step, data position, ...) plus [`FORMAT_VERSION_KEY`]. Optimizer state
//! follows the naming in [`crate::optim::optimizer_state_name`]:
//! `optimizer.<param name>.step` (an F32 scalar of shape `[]`, as torch keeps it),
//! `optimizer.<param name>.momentum_buffer`, `optimizer.<param name>.exp_avg` and
//! `optimizer.<param name>.exp_avg_sq`.
//!
//! # Atomicity
//!
//! [`save`] writes as every output is written ([`crate::output_file`]): to a temporary file
//! `.<name>.conveyor-tmp-<pid>-<n>` in the target's directory, fsynced and renamed over the target
//! (an atomic replace on POSIX file systems), then the directory fsynced. On any error before the
//! rename, the temporary file is removed and the previous file is untouched, so a crash mid-save
//! never leaves a half-written checkpoint under the target name. A symbolic link is followed (its
//! target replaced, the link kept); a character device such as `/dev/null` is written straight
//! through, never replaced; a directory is refused.
//!
//! # Loading
//!
//! [`load`] reads the whole file, checks it with `safetensors` (a truncated or corrupt file is an
//! [`Error::Checkpoint`], never a panic), and builds each tensor on the given device (counted
//! against its budget). [`load_exact`] first checks names, shapes and dtypes against an expected
//! list and allocates nothing if they differ. [`read_metadata`] reads the metadata map from the
//! header alone, without the tensors.
//!
//! A trainer's loads go through `Trainer::load` and `Trainer::restore`
//! ([`crate::runtime::Trainer`]), which match the file against the model by name and shape as
//! PyTorch's `load_state_dict` does ([`LoadOptions`], [`LoadReport`],
//! [`Error::StateDictMismatch`]).
//!
//! Loading does not judge values: a file may hold NaN or infinity (an experiment's record of a
//! diverged run). Callers about to train from a file ask [`Checkpoint::first_non_finite`] and
//! refuse it, naming the tensor and the element, since one NaN parameter makes every later step
//! non-finite.
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype as SafeDtype, SafeTensors, TensorView, View};

use crate::output_file::{self, OutputFile};
use crate::{DType, Device, Error, Result, Shape, Tensor};

mod metadata;
mod state_dict;

pub use metadata::read_metadata;
pub(crate) use state_dict::describe_mismatch;
pub use state_dict::{LoadOptions, LoadReport, WrongShape};

/// The metadata key under which [`save_with_metadata`] records the format version.
pub const FORMAT_VERSION_KEY: &str = "conveyor.format_version";

/// The format version this build writes and the newest it reads.
pub const FORMAT_VERSION: u32 = 1;

/// The metadata key under which a training checkpoint (`Trainer::checkpoint`) records the trainer's
/// step index: optimizer steps taken.
pub const STEP_KEY: &str = "conveyor.step";

/// The metadata key under which a training checkpoint records the trainer's seed (dropout masks
/// derive from the seed and the step index).
pub const SEED_KEY: &str = "conveyor.seed";

/// The metadata key under which a training checkpoint of an f16 run records the loss scale of its
/// next step ([`crate::LossScaler`]).
pub const LOSS_SCALE_KEY: &str = "conveyor.loss_scale";

/// The metadata key under which a training checkpoint of an f16 run records the committed steps in
/// a row since its loss scale last changed.
pub const LOSS_SCALE_GOOD_STEPS_KEY: &str = "conveyor.loss_scale_good_steps";

/// The metadata keys the writers own: a caller's metadata may not set them.
pub const RESERVED_METADATA_KEYS: [&str; 5] =
    [FORMAT_VERSION_KEY, STEP_KEY, SEED_KEY, LOSS_SCALE_KEY, LOSS_SCALE_GOOD_STEPS_KEY];

/// Name, shape and dtype a strict load expects of one tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// The tensor's name in the file.
    pub name: String,
    /// The expected shape.
    pub shape: Shape,
    /// The expected dtype.
    pub dtype: DType,
}

impl TensorSpec {
    /// A spec from its parts.
    pub fn new(name: impl Into<String>, shape: impl Into<Shape>, dtype: DType) -> Self {
        TensorSpec { name: name.into(), shape: shape.into(), dtype }
    }

    /// The spec of an existing tensor (e.g. a freshly initialised parameter).
    pub fn of(name: impl Into<String>, tensor: &Tensor) -> Self {
        TensorSpec { name: name.into(), shape: tensor.shape().clone(), dtype: tensor.dtype() }
    }
}

/// A loaded checkpoint: its tensors by name (on the device given to [`load`]) and its metadata.
#[derive(Debug)]
pub struct Checkpoint {
    path: PathBuf,
    tensors: BTreeMap<String, Tensor>,
    metadata: BTreeMap<String, String>,
}

impl Checkpoint {
    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The metadata map (including [`FORMAT_VERSION_KEY`] when written by Conveyor).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// One metadata value parsed as `T` (e.g. the step as `u64`); an [`Error::Checkpoint`] naming
    /// the key when it is absent or does not parse.
    pub fn metadata_value<T: std::str::FromStr>(&self, key: &str) -> Result<T> {
        let raw = self.metadata.get(key).ok_or_else(|| {
            self.error(format!(
                "metadata key `{key}` is missing (keys present: {}); was the checkpoint saved with it?",
                list_or_none(self.metadata.keys())
            ))
        })?;
        raw.parse().map_err(|_| {
            self.error(format!("metadata `{key}` = `{raw}` does not parse as {}", std::any::type_name::<T>()))
        })
    }

    /// A checkpoint holding the same tensors (sharing their storage) and metadata, for a second
    /// reader that takes its own tensors (a data-parallel replica's optimizer state).
    pub fn share(&self) -> Checkpoint {
        Checkpoint {
            path: self.path.clone(),
            tensors: self.tensors.iter().map(|(name, tensor)| (name.clone(), tensor.share())).collect(),
            metadata: self.metadata.clone(),
        }
    }

    /// The names of the tensors still held, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Number of tensors still held.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// True when no tensors are held.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The tensor named `name`, if held.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    /// Removes and returns the tensor named `name`, if held.
    pub fn take(&mut self, name: &str) -> Option<Tensor> {
        self.tensors.remove(name)
    }

    /// Removes and returns the tensor named `name`, checking its shape and dtype; an
    /// [`Error::Checkpoint`] naming the tensor when it is missing or differs.
    pub fn take_checked(&mut self, name: &str, shape: &Shape, dtype: DType) -> Result<Tensor> {
        let Some(tensor) = self.tensors.get(name) else {
            return Err(self.error(format!("tensor `{name}` is missing: expected {dtype} {shape}")));
        };
        if let Some(problem) = describe_difference(name, shape, dtype, tensor.shape().dims(), Ok(tensor.dtype())) {
            return Err(self.error(problem));
        }
        self.tensors.remove(name).ok_or_else(|| self.error(format!("tensor `{name}` vanished")))
    }

    /// Checks that the held tensors are exactly `expected`: no name missing, none extra, and each
    /// with the expected shape and dtype. The error names every offending tensor with what was
    /// expected and what was found.
    pub fn check_exact(&self, expected: &[TensorSpec]) -> Result<()> {
        let found = self.tensors.iter().map(|(name, tensor)| Found {
            name: name.clone(),
            shape: tensor.dims().to_vec(),
            dtype: Ok(tensor.dtype()),
        });
        check_exact(&self.path, found.collect(), expected)
    }

    /// [`Checkpoint::check_exact`], then the tensors in the order of `expected`.
    pub fn take_exact(mut self, expected: &[TensorSpec]) -> Result<Vec<Tensor>> {
        self.check_exact(expected)?;
        let mut tensors = Vec::with_capacity(expected.len());
        for spec in expected {
            tensors.push(self.take_checked(&spec.name, &spec.shape, spec.dtype)?);
        }
        Ok(tensors)
    }

    /// All tensors still held, by name.
    pub fn into_tensors(self) -> BTreeMap<String, Tensor> {
        self.tensors
    }

    /// An [`Error::Checkpoint`] about this checkpoint's file.
    pub fn error(&self, reason: impl Into<String>) -> Error {
        Error::Checkpoint { path: self.path.display().to_string(), reason: reason.into() }
    }

    /// The first held tensor, in name order, with a NaN or infinite element, and where: `None`
    /// when every element of every tensor is finite. Works for every dtype (f16 and bf16 widen to
    /// f32 exactly, NaN and infinities included); a tensor on a GPU is downloaded.
    pub fn first_non_finite(&self) -> Result<Option<NonFiniteTensor>> {
        for (name, tensor) in &self.tensors {
            let widened;
            let values = match tensor.as_f32() {
                Ok(values) => values,
                Err(_) => {
                    widened = tensor.try_to_vec_f32()?;
                    &widened
                }
            };
            if let Some(index) = values.iter().position(|v| !v.is_finite()) {
                return Ok(Some(NonFiniteTensor {
                    name: name.clone(),
                    shape: tensor.shape().clone(),
                    index,
                    value: values[index],
                    count: values[index..].iter().filter(|v| !v.is_finite()).count(),
                }));
            }
        }
        Ok(None)
    }
}

/// A tensor holding NaN or infinity, as [`Checkpoint::first_non_finite`] found it.
#[derive(Clone, Debug, PartialEq)]
pub struct NonFiniteTensor {
    /// The tensor's name in the file.
    pub name: String,
    /// Its shape.
    pub shape: Shape,
    /// The row-major (flat) index of its first non-finite element.
    pub index: usize,
    /// That element (NaN, +inf or -inf), widened to f32.
    pub value: f32,
    /// How many of its elements are not finite.
    pub count: usize,
}

impl NonFiniteTensor {
    /// The first non-finite element's index per dimension (`[row, col]` of a matrix; `[]` for a
    /// scalar).
    pub fn position(&self) -> Vec<usize> {
        let mut rest = self.index;
        let mut position: Vec<usize> = self
            .shape
            .dims()
            .iter()
            .rev()
            .map(|&dim| {
                let coordinate = rest % dim.max(1);
                rest /= dim.max(1);
                coordinate
            })
            .collect();
        position.reverse();
        position
    }
}

impl std::fmt::Display for NonFiniteTensor {
    /// "tensor `0.weight` holds NaN at [1, 2] (element 6; 1 of its 32 elements is not finite)".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let value = if self.value.is_nan() { "NaN".to_string() } else { self.value.to_string() };
        let numel = self.shape.numel();
        let verb = if self.count == 1 { "is" } else { "are" };
        write!(
            f,
            "tensor `{}` holds {value} at {:?} (element {}; {} of its {numel} elements {verb} not finite)",
            self.name,
            self.position(),
            self.index,
            self.count
        )
    }
}

/// Saves `tensors` to `path` as safetensors, atomically (see the module docs). Names must be unique.
///
/// ```
/// use conveyor_engine::{Device, Tensor, checkpoint};
///
/// let path = std::env::temp_dir().join(format!("conveyor-doc-save-{}.safetensors", std::process::id()));
/// let weight = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0], [2, 2], &Device::host())?;
/// checkpoint::save(&path, &[("fc.weight", &weight)])?;
/// let loaded = checkpoint::load(&path, &Device::host())?;
/// assert!(loaded.get("fc.weight").unwrap().bit_eq(&weight));
/// # std::fs::remove_file(&path).unwrap();
/// # Ok::<(), conveyor_engine::Error>(())
/// ```
pub fn save<N: AsRef<str>>(path: impl AsRef<Path>, tensors: &[(N, &Tensor)]) -> Result<()> {
    save_with_metadata(path, tensors, &BTreeMap::new())
}

/// [`save`] with a metadata map (e.g. `step`, the data position). [`FORMAT_VERSION_KEY`] is added
/// and reserved: a caller that sets it gets an [`Error::InvalidArgument`].
pub fn save_with_metadata<N: AsRef<str>>(
    path: impl AsRef<Path>,
    tensors: &[(N, &Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let path = path.as_ref();
    let mut seen = BTreeSet::new();
    for (name, _) in tensors {
        if !seen.insert(name.as_ref()) {
            return Err(Error::invalid(
                "tensors",
                format!(
                    "tensor name `{}` appears twice in the save to {}; names must be unique",
                    name.as_ref(),
                    path.display()
                ),
            ));
        }
    }
    if metadata.contains_key(FORMAT_VERSION_KEY) {
        return Err(Error::invalid(
            "metadata",
            format!("`{FORMAT_VERSION_KEY}` is reserved for the checkpoint writer; use another key"),
        ));
    }
    let mut header_metadata: HashMap<String, String> = metadata.clone().into_iter().collect();
    header_metadata.insert(FORMAT_VERSION_KEY.to_string(), FORMAT_VERSION.to_string());

    let views: Vec<(&str, TensorBytes)> = tensors
        .iter()
        .map(|(name, tensor)| {
            (
                name.as_ref(),
                TensorBytes { dtype: tensor.dtype(), shape: tensor.dims().to_vec(), bytes: tensor.to_le_bytes() },
            )
        })
        .collect();
    let bytes = safetensors::serialize(views, Some(header_metadata)).map_err(|error| Error::Checkpoint {
        path: path.display().to_string(),
        reason: format!("could not encode the tensors as safetensors: {error}"),
    })?;
    write_file_atomically(path, |file| file.write_all(&bytes))
}

/// Writes a file the way every output is written ([`crate::output_file`]): atomically through a
/// temporary file beside `path` renamed over it (a character device or FIFO is written straight
/// through; a directory is refused). If `write_contents` or any file operation fails, the
/// temporary file is removed, `path` keeps its previous contents, and the error carries the path it
/// concerns.
pub fn write_file_atomically(
    path: impl AsRef<Path>,
    write_contents: impl FnOnce(&mut OutputFile) -> std::io::Result<()>,
) -> Result<()> {
    output_file::write_output(path, write_contents)
}

/// Loads every tensor of the checkpoint at `path` onto `device`, with its metadata.
pub fn load(path: impl AsRef<Path>, device: &Device) -> Result<Checkpoint> {
    let path = path.as_ref();
    let buffer = fs::read(path).map_err(|source| Error::Io { path: path.display().to_string(), source })?;
    let parsed = parse(path, &buffer)?;
    materialise(path, parsed, device)
}

/// Loads the checkpoint at `path` onto `device` only if its tensors are exactly `expected` (see
/// [`Checkpoint::check_exact`]); checks the header before allocating any tensor.
pub fn load_exact(path: impl AsRef<Path>, device: &Device, expected: &[TensorSpec]) -> Result<Checkpoint> {
    let path = path.as_ref();
    let buffer = fs::read(path).map_err(|source| Error::Io { path: path.display().to_string(), source })?;
    let parsed = parse(path, &buffer)?;
    let found = parsed
        .tensors
        .iter()
        .map(|(name, view)| Found {
            name: name.clone(),
            shape: view.shape().to_vec(),
            dtype: engine_dtype(view.dtype()),
        })
        .collect();
    check_exact(path, found, expected)?;
    materialise(path, parsed, device)
}

/// A parsed file: views into the buffer, and the metadata.
struct Parsed<'data> {
    tensors: Vec<(String, TensorView<'data>)>,
    metadata: BTreeMap<String, String>,
}

fn checkpoint_error(path: &Path, reason: impl Into<String>) -> Error {
    Error::Checkpoint { path: path.display().to_string(), reason: reason.into() }
}

fn parse<'data>(path: &Path, buffer: &'data [u8]) -> Result<Parsed<'data>> {
    let corrupt = |error: safetensors::SafeTensorError| {
        checkpoint_error(
            path,
            format!(
                "not a valid safetensors file ({error}; {} bytes on disk); it is truncated or corrupt, \
                 restore it from an earlier checkpoint or save it again",
                buffer.len()
            ),
        )
    };
    let (_, header) = SafeTensors::read_metadata(buffer).map_err(corrupt)?;
    let metadata: BTreeMap<String, String> = header.metadata().clone().unwrap_or_default().into_iter().collect();
    check_format_version(path, &metadata)?;
    let tensors = SafeTensors::deserialize(buffer).map_err(corrupt)?.tensors();
    Ok(Parsed { tensors, metadata })
}

/// An [`Error::Checkpoint`] when `metadata` names a format version newer than this build reads.
fn check_format_version(path: &Path, metadata: &BTreeMap<String, String>) -> Result<()> {
    match metadata.get(FORMAT_VERSION_KEY).map(|version| (version, version.parse::<u32>())) {
        Some((version, parsed)) if !matches!(parsed, Ok(v) if v <= FORMAT_VERSION) => Err(checkpoint_error(
            path,
            format!(
                "format version `{version}` is not one this build reads (up to {FORMAT_VERSION}); \
                 load it with a newer Conveyor"
            ),
        )),
        _ => Ok(()),
    }
}

fn materialise(path: &Path, parsed: Parsed<'_>, device: &Device) -> Result<Checkpoint> {
    let mut tensors = BTreeMap::new();
    for (name, view) in parsed.tensors {
        let dtype = engine_dtype(view.dtype()).map_err(|found| {
            checkpoint_error(
                path,
                format!("tensor `{name}` has dtype {found}, which Conveyor does not hold; save it as F32, F16 or BF16"),
            )
        })?;
        let tensor = Tensor::from_le_bytes(view.data(), dtype, view.shape(), device)?;
        tensors.insert(name, tensor);
    }
    Ok(Checkpoint { path: path.to_path_buf(), tensors, metadata: parsed.metadata })
}

/// The engine's dtype for a safetensors dtype, or the file's name for it.
fn engine_dtype(dtype: SafeDtype) -> std::result::Result<DType, String> {
    match dtype {
        SafeDtype::F32 => Ok(DType::F32),
        SafeDtype::F16 => Ok(DType::F16),
        SafeDtype::BF16 => Ok(DType::BF16),
        other => Err(format!("{other:?}")),
    }
}

fn safetensors_dtype(dtype: DType) -> SafeDtype {
    match dtype {
        DType::F32 => SafeDtype::F32,
        DType::F16 => SafeDtype::F16,
        DType::BF16 => SafeDtype::BF16,
    }
}

/// A tensor in a file, as far as the strict check needs it.
struct Found {
    name: String,
    shape: Vec<usize>,
    dtype: std::result::Result<DType, String>,
}

/// Most problems one strict-check error lists before summarising the rest.
const MAX_LISTED_PROBLEMS: usize = 8;

fn check_exact(path: &Path, found: Vec<Found>, expected: &[TensorSpec]) -> Result<()> {
    let mut expected_names = BTreeSet::new();
    for spec in expected {
        if !expected_names.insert(spec.name.as_str()) {
            return Err(Error::invalid(
                "expected",
                format!("tensor `{}` is listed twice in the expected tensors; list each name once", spec.name),
            ));
        }
    }
    let found_by_name: BTreeMap<&str, &Found> = found.iter().map(|f| (f.name.as_str(), f)).collect();
    let mut problems = Vec::new();
    for spec in expected {
        match found_by_name.get(spec.name.as_str()) {
            None => problems.push(format!("tensor `{}` is missing: expected {} {}", spec.name, spec.dtype, spec.shape)),
            Some(f) => {
                problems.extend(describe_difference(&spec.name, &spec.shape, spec.dtype, &f.shape, f.dtype.clone()))
            }
        }
    }
    for f in &found {
        if !expected_names.contains(f.name.as_str()) {
            let dtype = f.dtype.as_ref().map(ToString::to_string).unwrap_or_else(|name| name.clone());
            problems.push(format!(
                "tensor `{}` ({dtype} {}) is in the file but not expected",
                f.name,
                Shape::new(f.shape.clone())
            ));
        }
    }
    if problems.is_empty() {
        return Ok(());
    }
    let n_problems = problems.len();
    let mut reason = problems.into_iter().take(MAX_LISTED_PROBLEMS).collect::<Vec<_>>().join("; ");
    if n_problems > MAX_LISTED_PROBLEMS {
        reason.push_str(&format!("; and {} more", n_problems - MAX_LISTED_PROBLEMS));
    }
    reason.push_str(
        "; the checkpoint does not match this model: check it was saved from the same model and stage layout",
    );
    Err(checkpoint_error(path, reason))
}

/// What differs between an expected and a found tensor of the same name, if anything.
fn describe_difference(
    name: &str,
    shape: &Shape,
    dtype: DType,
    found_shape: &[usize],
    found_dtype: std::result::Result<DType, String>,
) -> Option<String> {
    let found_dtype_name = found_dtype.as_ref().map(ToString::to_string).unwrap_or_else(|name| name.clone());
    if shape.dims() != found_shape {
        return Some(format!(
            "tensor `{name}` has shape {} but {shape} was expected",
            Shape::new(found_shape.to_vec())
        ));
    }
    if found_dtype != Ok(dtype) {
        return Some(format!(
            "tensor `{name}` has dtype {found_dtype_name} but {dtype} was expected; convert it with `to_dtype` before saving"
        ));
    }
    None
}

fn list_or_none<'a>(names: impl Iterator<Item = &'a String>) -> String {
    let names: Vec<&str> = names.map(String::as_str).collect();
    if names.is_empty() { "none".to_string() } else { names.join(", ") }
}

/// A tensor's bytes in the shape safetensors' serializer reads.
struct TensorBytes {
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for TensorBytes {
    fn dtype(&self) -> SafeDtype {
        safetensors_dtype(self.dtype)
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }

    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checkpoint(tensors: Vec<(&str, Tensor)>) -> Checkpoint {
        Checkpoint {
            path: PathBuf::from("model.safetensors"),
            tensors: tensors.into_iter().map(|(name, tensor)| (name.to_string(), tensor)).collect(),
            metadata: BTreeMap::new(),
        }
    }

    fn host(values: Vec<f32>, dims: &[usize], dtype: DType) -> Tensor {
        Tensor::from_vec(values, dims.to_vec(), &Device::host()).unwrap().to_dtype(dtype).unwrap()
    }

    #[test]
    fn first_non_finite_names_the_tensor_and_element_in_every_dtype() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let found = checkpoint(vec![
                    ("a.bias", host(vec![0.5, -1.0], &[2], dtype)),
                    ("b.weight", host(vec![1.0, 2.0, 3.0, 4.0, bad, bad], &[2, 3], dtype)),
                    ("c.weight", host(vec![bad], &[1], dtype)),
                ])
                .first_non_finite()
                .unwrap()
                .expect("a non-finite element");
                assert_eq!((found.name.as_str(), found.index, found.count), ("b.weight", 4, 2), "{dtype}");
                assert_eq!(found.position(), [1, 1]);
                assert!(found.value.is_nan() == bad.is_nan() && (bad.is_nan() || found.value == bad), "{dtype}");
                let message = found.to_string();
                assert!(
                    message.contains("tensor `b.weight` holds") && message.contains("at [1, 1] (element 4"),
                    "{message}"
                );
            }
        }
    }

    #[test]
    fn finite_checkpoints_and_scalars_pass() {
        let finite = checkpoint(vec![("w", host(vec![f32::MAX, f32::MIN_POSITIVE, -0.0], &[3], DType::F32))]);
        assert_eq!(finite.first_non_finite().unwrap(), None);
        let scalar = checkpoint(vec![("optimizer.w.step", host(vec![f32::NAN], &[], DType::F32))]);
        let found = scalar.first_non_finite().unwrap().unwrap();
        assert_eq!(found.position(), Vec::<usize>::new());
        assert_eq!(
            found.to_string(),
            "tensor `optimizer.w.step` holds NaN at [] (element 0; 1 of its 1 elements is not finite)"
        );
    }
}
