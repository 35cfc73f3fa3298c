//! Datasets for training: the built-in digits set (embedded in the binary), a seeded synthetic
//! generator, safetensors data files, MNIST's IDX files, train/test splits and shuffled batches.
//!
//! Every reader checks what it reads (dtypes, shapes, label range, finite inputs) and returns an
//! [`Error::InvalidArgument`] naming the file and what to fix; none panics on a bad file, and
//! sizes read from a file are checked against [`crate::limits`] with checked arithmetic before
//! anything is allocated from them. The byte-level readers ([`from_safetensors_bytes`],
//! [`idx_split`], [`digits_from_csv`]) take the bytes, so `tests/fuzz_readers.rs` calls them
//! directly.
use std::io::Read;
use std::path::Path;

use conveyor_engine::runtime::Batch;
use conveyor_engine::{Device, Error, Result, Tensor};
use rand::seq::SliceRandom;

use crate::limits::{MAX_CLASSES, MAX_DECOMPRESSED_BYTES, MAX_GENERATED_VALUES, checked_product};

/// The UCI optical-digits set, gzipped CSV, embedded so no file is read at run time.
const DIGITS_CSV_GZ: &[u8] = include_bytes!("../data/digits.csv.gz");

/// Rows of the digits set used for training; the rest are the test split.
pub const DIGITS_TRAIN_ROWS: usize = 1437;

/// Samples with their per-sample shape and integer labels.
#[derive(Clone, Debug)]
pub struct Dataset {
    /// Row-major features, `n_rows x numel(feature_shape)`.
    pub features: Vec<f32>,
    /// Shape of one sample.
    pub feature_shape: Vec<usize>,
    /// One label per row, in `0..n_classes`.
    pub labels: Vec<usize>,
    /// Number of classes.
    pub n_classes: usize,
}

impl Dataset {
    /// Number of rows.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when there are no rows.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    fn per_row(&self) -> usize {
        self.feature_shape.iter().product()
    }

    /// Rows `start..end` as a new dataset.
    pub fn slice(&self, start: usize, end: usize) -> Dataset {
        let per_row = self.per_row();
        Dataset {
            features: self.features[start * per_row..end * per_row].to_vec(),
            feature_shape: self.feature_shape.clone(),
            labels: self.labels[start..end].to_vec(),
            n_classes: self.n_classes,
        }
    }

    /// The rows `indices` as an input tensor on the host and their labels.
    ///
    /// ```
    /// let digits = conveyor::data::digits()?;
    /// let (inputs, labels) = digits.batch(&[0, 5, 9])?;
    /// assert_eq!(inputs.dims(), [3, 1, 8, 8]);
    /// assert_eq!(labels.len(), 3);
    /// # Ok::<(), conveyor::engine::Error>(())
    /// ```
    pub fn batch(&self, indices: &[usize]) -> Result<(Tensor, Vec<usize>)> {
        let per_row = self.per_row();
        let mut features = Vec::with_capacity(indices.len() * per_row);
        for &i in indices {
            features.extend_from_slice(&self.features[i * per_row..(i + 1) * per_row]);
        }
        let mut shape = vec![indices.len()];
        shape.extend_from_slice(&self.feature_shape);
        Ok((Tensor::from_vec(features, shape, &Device::host())?, indices.iter().map(|&i| self.labels[i]).collect()))
    }

    /// One epoch of batches of `batch_rows` rows, ready for `Trainer::fit`: the rows in
    /// [`epoch_order`] (shuffled with `seed` and `epoch`, or in data order), each batch the inputs
    /// on the host and their class labels. The last `len % batch_rows` rows of the order are left
    /// out, as the CLI does (PyTorch's `DataLoader(drop_last=True)`), so every step has the same
    /// size; a `batch_rows` of 0 yields one error.
    ///
    /// ```
    /// use std::ops::ControlFlow;
    /// use std::sync::Arc;
    /// use conveyor::engine::optim::OptimizerConfig;
    /// use conveyor::engine::runtime::Trainer;
    /// use conveyor::{Sequential, data, layers::CrossEntropyLoss};
    ///
    /// let digits = data::digits()?;
    /// let train = digits.slice(0, data::DIGITS_TRAIN_ROWS);
    /// let test = digits.slice(data::DIGITS_TRAIN_ROWS, digits.len());
    /// let graph = Sequential::new([1, 8, 8]).flatten().linear(32).relu().linear(10).build(0)?;
    /// let mut trainer = Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
    ///     .optimizer(OptimizerConfig::adam(0.01))
    ///     .build()?;
    /// for epoch in 0..2 {
    ///     let summary = trainer.fit(train.batches(64, true, 0, epoch), |_| ControlFlow::Continue(()))?;
    ///     assert_eq!(summary.steps, train.len() / 64);
    /// }
    /// let indices: Vec<usize> = (0..test.len()).collect();
    /// let evaluation = trainer.evaluate(test.batch(&indices)?)?;
    /// assert!(evaluation.accuracy().unwrap() > 0.8, "{evaluation:?}");
    /// # Ok::<(), conveyor::engine::Error>(())
    /// ```
    pub fn batches(
        &self,
        batch_rows: usize,
        shuffle: bool,
        seed: u64,
        epoch: u64,
    ) -> impl Iterator<Item = Result<Batch>> + '_ {
        let order = epoch_order(self.len(), shuffle, seed, epoch);
        let n_batches = self.len().checked_div(batch_rows).unwrap_or(0);
        let error = (batch_rows == 0).then(|| Err(Error::invalid("batch rows", "0: a batch needs at least one row")));
        error.into_iter().chain((0..n_batches).map(move |i| {
            let indices = &order[i * batch_rows..(i + 1) * batch_rows];
            Ok(Batch::from(self.batch(indices)?))
        }))
    }

    /// Per-feature mean and standard deviation over all rows (a constant feature gets std 1).
    pub fn feature_stats(&self) -> (Vec<f32>, Vec<f32>) {
        let per_row = self.per_row();
        let n = self.len().max(1) as f64;
        let mut mean = vec![0.0f64; per_row];
        let mut sq = vec![0.0f64; per_row];
        for row in self.features.chunks_exact(per_row) {
            for (f, &v) in row.iter().enumerate() {
                mean[f] += v as f64;
                sq[f] += (v as f64) * (v as f64);
            }
        }
        let mean: Vec<f64> = mean.iter().map(|m| m / n).collect();
        let std = sq
            .iter()
            .zip(&mean)
            .map(|(s, m)| (s / n - m * m).max(0.0).sqrt())
            .map(|s| if s < 1e-6 { 1.0 } else { s as f32 });
        (mean.iter().map(|&m| m as f32).collect(), std.collect())
    }

    /// Standardises every feature with the given statistics: `(x - mean) / std`.
    pub fn standardize(&mut self, mean: &[f32], std: &[f32]) {
        let per_row = self.per_row();
        for row in self.features.chunks_exact_mut(per_row) {
            for (f, v) in row.iter_mut().enumerate() {
                *v = (*v - mean[f]) / std[f];
            }
        }
    }

    /// Checks every feature is a token id for an embedding of `vocab` rows: an integer in
    /// `0..vocab`. Called when the data is loaded for a transformer, so a bad id is found then, not
    /// at the step that meets it.
    pub fn check_token_ids(&self, vocab: usize, source: &str) -> Result<()> {
        let per_row = self.per_row().max(1);
        let is_id = |v: f32| v >= 0.0 && v.fract() == 0.0 && f64::from(v) < vocab as f64;
        let bad = self.features.iter().position(|&v| !is_id(v));
        match bad {
            None => Ok(()),
            Some(i) => Err(Error::invalid(
                "token ids",
                format!(
                    "{source}: row {} token {} is {}, not a token id in 0..{vocab} (the model's vocabulary); \
                     give integer ids below {vocab}, or a model with a larger VOCAB",
                    i / per_row,
                    i % per_row,
                    self.features[i]
                ),
            )),
        }
    }

    /// Checks labels are in range and features are finite.
    pub fn validate(&self, source: &str) -> Result<()> {
        if let Some((row, label)) = self.labels.iter().enumerate().find(|(_, l)| **l >= self.n_classes) {
            return Err(Error::invalid(
                "labels",
                format!("{source}: row {row} has label {label}, outside 0..{}", self.n_classes),
            ));
        }
        if let Some(i) = self.features.iter().position(|v| !v.is_finite()) {
            return Err(Error::invalid(
                "inputs",
                format!(
                    "{source}: row {} has a non-finite value ({}); clean the data first",
                    i / self.per_row().max(1),
                    self.features[i]
                ),
            ));
        }
        Ok(())
    }
}

/// The digits set: 1,797 images 1x8x8 scaled to [0, 1] (pixels are 0..16), 10 classes.
///
/// ```
/// let digits = conveyor::data::digits()?;
/// assert_eq!((digits.len(), digits.n_classes), (1797, 10));
/// # Ok::<(), conveyor::engine::Error>(())
/// ```
pub fn digits() -> Result<Dataset> {
    let mut text = String::new();
    flate2::read::GzDecoder::new(DIGITS_CSV_GZ)
        .read_to_string(&mut text)
        .map_err(|e| Error::invalid("digits data", format!("the embedded file is damaged: {e}")))?;
    digits_from_csv(&text)
}

/// Parses the digits CSV: one row per line, 64 pixel values (0..16) then the label (an integer
/// 0..9), comma-separated.
pub fn digits_from_csv(text: &str) -> Result<Dataset> {
    let mut features = Vec::with_capacity(1797 * 64);
    let mut labels = Vec::with_capacity(1797);
    for (line_idx, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let values: Vec<f32> = line
            .split(',')
            .map(|v| v.trim().parse::<f32>())
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| Error::invalid("digits data", format!("line {}: {e}", line_idx + 1)))?;
        if values.len() != 65 {
            return Err(Error::invalid(
                "digits data",
                format!("line {}: {} columns, expected 65", line_idx + 1, values.len()),
            ));
        }
        let label = values[64];
        if !(label.fract() == 0.0 && (0.0..10.0).contains(&label)) {
            return Err(Error::invalid(
                "digits data",
                format!("line {}: label {label} is not a digit 0..9", line_idx + 1),
            ));
        }
        features.extend(values[..64].iter().map(|v| v / 16.0));
        labels.push(label as usize);
    }
    let dataset = Dataset { features, feature_shape: vec![1, 8, 8], labels, n_classes: 10 };
    dataset.validate("digits")?;
    Ok(dataset)
}

/// `n_rows` samples of `n_features` features in `n_classes` classes: each class has a random
/// centre, samples are centre plus noise, so the task is learnable. Seeded.
///
/// ```
/// let data = conveyor::data::synthetic(100, 8, 3, 0)?;
/// assert_eq!((data.len(), data.n_classes), (100, 3));
/// let (inputs, _) = data.batch(&[0, 1])?;
/// assert_eq!(inputs.dims(), [2, 8]);
/// # Ok::<(), conveyor::engine::Error>(())
/// ```
pub fn synthetic(n_rows: usize, n_features: usize, n_classes: usize, seed: u64) -> Result<Dataset> {
    if n_rows == 0 || n_features == 0 || n_classes < 2 {
        return Err(Error::invalid(
            "synthetic data",
            "need N >= 1 rows, D >= 1 features and C >= 2 classes (synthetic:N,D,C)",
        ));
    }
    check_generated("synthetic data", n_classes, &[("N x D", n_rows, n_features), ("C x D", n_classes, n_features)])?;
    let mut rng = conveyor_engine::init::rng(seed);
    let device = Device::host();
    let centres = conveyor_engine::init::normal([n_classes, n_features], 1.0, &mut rng, &device)?.to_vec_f32();
    let noise = conveyor_engine::init::normal([n_rows, n_features], 0.5, &mut rng, &device)?.to_vec_f32();
    let labels: Vec<usize> =
        (0..n_rows).map(|r| r.wrapping_mul(7919).wrapping_add(seed as usize) % n_classes).collect();
    let mut features = Vec::with_capacity(n_rows * n_features);
    for (row, &label) in labels.iter().enumerate() {
        for f in 0..n_features {
            features.push(centres[label * n_features + f] + noise[row * n_features + f]);
        }
    }
    Ok(Dataset { features, feature_shape: vec![n_features], labels, n_classes })
}

/// `n_rows` sequences of `n_tokens` token ids in `0..vocab` (stored as integral f32, as the
/// Embedding layer reads them), labelled by their first token modulo `n_classes`: a task a
/// transformer learns only by attending to position 0. Seeded.
pub fn synthetic_tokens(n_rows: usize, n_tokens: usize, vocab: usize, n_classes: usize, seed: u64) -> Result<Dataset> {
    if n_rows == 0 || n_tokens == 0 || vocab < 2 || n_classes < 2 || n_classes > vocab {
        return Err(Error::invalid(
            "token data",
            "need N >= 1 rows, T >= 1 tokens, VOCAB >= 2 and 2 <= C <= VOCAB classes (tokens:N,T,VOCAB,C)",
        ));
    }
    check_generated("token data", n_classes, &[("N x T", n_rows, n_tokens)])?;
    if vocab > crate::limits::MAX_WIDTH {
        return Err(Error::invalid(
            "token data",
            format!("VOCAB {vocab} is over the limit of {} token ids (MAX_WIDTH)", crate::limits::MAX_WIDTH),
        ));
    }
    let mut rng = conveyor_engine::init::rng(seed);
    let ids = conveyor_engine::init::uniform([n_rows * n_tokens], 0.0, vocab as f32, &mut rng, &Device::host())?;
    let features: Vec<f32> = ids.to_vec_f32().iter().map(|v| v.floor().min(vocab as f32 - 1.0)).collect();
    let labels = (0..n_rows).map(|r| features[r * n_tokens] as usize % n_classes).collect();
    Ok(Dataset { features, feature_shape: vec![n_tokens], labels, n_classes })
}

/// Refuses generated data over [`MAX_CLASSES`] classes or [`MAX_GENERATED_VALUES`] values
/// (each of `products` is a named `a x b`).
fn check_generated(what: &str, n_classes: usize, products: &[(&str, usize, usize)]) -> Result<()> {
    if n_classes > MAX_CLASSES {
        return Err(Error::invalid(
            what,
            format!("C {n_classes} is over the limit of {MAX_CLASSES} classes (MAX_CLASSES)"),
        ));
    }
    for &(name, a, b) in products {
        if a.checked_mul(b).is_none_or(|n| n > MAX_GENERATED_VALUES) {
            return Err(Error::invalid(
                what,
                format!(
                    "{name} = {a} x {b} values is over the limit of {MAX_GENERATED_VALUES} generated values \
                     (MAX_GENERATED_VALUES, 1 GiB of f32); give fewer rows or features"
                ),
            ));
        }
    }
    Ok(())
}

/// Row order for one epoch: shuffled with the epoch's seed, or in data order.
pub fn epoch_order(n_rows: usize, shuffle: bool, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n_rows).collect();
    if shuffle {
        let mut rng = conveyor_engine::init::rng(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        order.shuffle(&mut rng);
    }
    order
}

/// The tensor names a safetensors data file holds.
pub const DATA_INPUTS: &str = "inputs";
/// See [`DATA_INPUTS`].
pub const DATA_LABELS: &str = "labels";

/// Reads a safetensors data file: `inputs` f32 `[N, ...]` and `labels` i64 `[N]` (i32 is accepted
/// too). Rows stay in file order. The class count is `n_classes` when given (a label at or above
/// it is an error), otherwise the largest label plus one.
pub fn from_safetensors(path: &Path, n_classes: Option<usize>) -> Result<Dataset> {
    let source = path.display().to_string();
    // A device or a pipe (`/dev/zero`, a FIFO) could be read without end: only regular files.
    if std::fs::metadata(path).is_ok_and(|m| !m.is_file()) {
        return Err(Error::invalid(
            "data file",
            format!("{source}: not a regular file (a directory, device or pipe); give a .safetensors file"),
        ));
    }
    let buffer = std::fs::read(path).map_err(|e| {
        Error::invalid("data file", format!("{source}: cannot read it ({e}); give an existing .safetensors file"))
    })?;
    from_safetensors_bytes(&buffer, &source, n_classes)
}

/// [`from_safetensors`] of the file's bytes; `source` names the file in errors.
pub fn from_safetensors_bytes(buffer: &[u8], source: &str, n_classes: Option<usize>) -> Result<Dataset> {
    use safetensors::tensor::{Dtype, SafeTensors};
    let bad = |reason: String| Error::invalid("data file", format!("{source}: {reason}"));
    if let Some(n_classes) = n_classes
        && !(1..=MAX_CLASSES).contains(&n_classes)
    {
        return Err(bad(format!("a class count of {n_classes} is outside 1..={MAX_CLASSES} (MAX_CLASSES)")));
    }
    let file = SafeTensors::deserialize(buffer).map_err(|e| {
        bad(format!("not a valid safetensors file ({e}; {} bytes); it is truncated or corrupt", buffer.len()))
    })?;
    let tensor = |name: &str| {
        file.tensor(name).map_err(|_| {
            let mut present = file.names();
            present.sort();
            bad(format!(
                "no tensor `{name}` (found: {}); a data file holds `{DATA_INPUTS}` f32 [N, ...] and `{DATA_LABELS}` i64 [N]",
                if present.is_empty() { "none".to_string() } else { present.join(", ") }
            ))
        })
    };
    let inputs = tensor(DATA_INPUTS)?;
    let labels = tensor(DATA_LABELS)?;
    if inputs.dtype() != Dtype::F32 {
        return Err(bad(format!("`{DATA_INPUTS}` has dtype {:?}; save it as float32 (F32)", inputs.dtype())));
    }
    let &[n_rows, ref feature_shape @ ..] = inputs.shape() else {
        return Err(bad(format!("`{DATA_INPUTS}` is a scalar; it must be [N, ...] with one row per sample")));
    };
    if feature_shape.is_empty() {
        return Err(bad(format!("`{DATA_INPUTS}` has shape [{n_rows}]; it must be [N, features...], e.g. [N, 1]")));
    }
    if labels.shape() != [n_rows] {
        return Err(bad(format!(
            "`{DATA_LABELS}` has shape {:?} but `{DATA_INPUTS}` has {n_rows} rows; it must be [{n_rows}]",
            labels.shape()
        )));
    }
    if n_rows == 0 {
        return Err(bad("the file holds no rows".to_string()));
    }
    if feature_shape.contains(&0) {
        return Err(bad(format!(
            "`{DATA_INPUTS}` has shape {:?}: a sample of shape {feature_shape:?} has no features",
            inputs.shape()
        )));
    }
    // The reader checked the shape against the bytes; checked here too before anything is
    // allocated from it.
    let n_values = checked_product(inputs.shape().iter().copied())
        .filter(|&n| n.checked_mul(4) == Some(inputs.data().len()))
        .ok_or_else(|| {
            bad(format!("`{DATA_INPUTS}` has shape {:?} but {} bytes", inputs.shape(), inputs.data().len()))
        })?;
    let mut features = Vec::with_capacity(n_values);
    features.extend(inputs.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
    let raw_labels: Vec<i64> = match labels.dtype() {
        Dtype::I64 => {
            labels.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))).collect()
        }
        Dtype::I32 => {
            labels.data().chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")) as i64).collect()
        }
        other => return Err(bad(format!("`{DATA_LABELS}` has dtype {other:?}; save class indices as int64 (I64)"))),
    };
    if let Some((row, label)) = raw_labels.iter().enumerate().find(|(_, l)| **l < 0) {
        return Err(bad(format!("row {row} has label {label}; labels are class indices 0..C")));
    }
    if let Some((row, label)) = raw_labels.iter().enumerate().find(|(_, l)| **l >= MAX_CLASSES as i64) {
        return Err(bad(format!(
            "row {row} has label {label}, over the limit of {MAX_CLASSES} classes (MAX_CLASSES); labels are class indices 0..C"
        )));
    }
    let labels: Vec<usize> = raw_labels.iter().map(|&l| l as usize).collect();
    let largest = labels.iter().copied().max().unwrap_or(0);
    let n_classes = n_classes.unwrap_or(largest + 1);
    let dataset = Dataset { features, feature_shape: feature_shape.to_vec(), labels, n_classes };
    dataset.validate(source).map_err(|e| match e {
        Error::InvalidArgument { reason, .. } => bad(format!("{reason} (the class count is {n_classes})")),
        other => other,
    })?;
    Ok(dataset)
}

/// The IDX files of an MNIST-style directory (each uncompressed or with `.gz` added).
pub const MNIST_FILES: [&str; 4] =
    ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"];

/// Reads an MNIST-style directory of IDX files ([`MNIST_FILES`]): the train and test splits,
/// images as `[1, rows, cols]` scaled to [0, 1], 10 classes.
pub fn mnist_idx(dir: &Path) -> Result<(Dataset, Dataset)> {
    let train = mnist_split(dir, MNIST_FILES[0], MNIST_FILES[1])?;
    let test = mnist_split(dir, MNIST_FILES[2], MNIST_FILES[3])?;
    if test.feature_shape != train.feature_shape {
        return Err(Error::invalid(
            "MNIST data",
            format!(
                "{}: test images are {:?} but train images {:?}",
                dir.display(),
                test.feature_shape,
                train.feature_shape
            ),
        ));
    }
    Ok((train, test))
}

fn mnist_split(dir: &Path, images_name: &str, labels_name: &str) -> Result<Dataset> {
    let (images_path, images) = read_idx_file(dir, images_name)?;
    let (labels_path, labels) = read_idx_file(dir, labels_name)?;
    idx_split(&images, &labels, &images_path.display().to_string(), &labels_path.display().to_string())
}

/// One split from the bytes of an IDX images file (`[count, rows, columns]` unsigned bytes) and
/// its labels file (`[count]`, digits 0..9); the sources name the files in errors.
pub fn idx_split(images: &[u8], labels: &[u8], images_source: &str, labels_source: &str) -> Result<Dataset> {
    let bad = |source: &str, reason: String| Error::invalid("MNIST data", format!("{source}: {reason}"));
    let (image_dims, pixels) = parse_idx(images).map_err(|r| bad(images_source, r))?;
    let (label_dims, label_bytes) = parse_idx(labels).map_err(|r| bad(labels_source, r))?;
    let &[n_images, rows, cols] = image_dims.as_slice() else {
        return Err(bad(
            images_source,
            format!("holds a {}-dimensional array; images need 3 (count, rows, columns)", image_dims.len()),
        ));
    };
    let &[n_labels] = label_dims.as_slice() else {
        return Err(bad(labels_source, format!("holds a {}-dimensional array; labels need 1", label_dims.len())));
    };
    if n_images != n_labels {
        return Err(bad(labels_source, format!("{n_labels} labels for the {n_images} images of {images_source}")));
    }
    if n_images == 0 || rows == 0 || cols == 0 {
        return Err(bad(
            images_source,
            format!("holds {n_images} images of {rows}x{cols} pixels: nothing to train on"),
        ));
    }
    let dataset = Dataset {
        features: pixels.iter().map(|&p| f32::from(p) / 255.0).collect(),
        feature_shape: vec![1, rows, cols],
        labels: label_bytes.iter().map(|&l| usize::from(l)).collect(),
        n_classes: 10,
    };
    dataset.validate(labels_source)?;
    Ok(dataset)
}

/// Reads `dir/name`, or `dir/name.gz` decompressed.
fn read_idx_file(dir: &Path, name: &str) -> Result<(std::path::PathBuf, Vec<u8>)> {
    let plain = dir.join(name);
    let gz = dir.join(format!("{name}.gz"));
    let io = |path: &Path, e: std::io::Error| {
        Error::invalid("MNIST data", format!("{}: cannot read it ({e})", path.display()))
    };
    if plain.is_file() {
        return Ok((plain.clone(), std::fs::read(&plain).map_err(|e| io(&plain, e))?));
    }
    if gz.is_file() {
        let compressed = std::fs::read(&gz).map_err(|e| io(&gz, e))?;
        let mut bytes = Vec::new();
        flate2::read::GzDecoder::new(compressed.as_slice())
            .take(MAX_DECOMPRESSED_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| io(&gz, e))?;
        if bytes.len() as u64 > MAX_DECOMPRESSED_BYTES {
            return Err(Error::invalid(
                "MNIST data",
                format!(
                    "{}: decompresses to more than {MAX_DECOMPRESSED_BYTES} bytes (MAX_DECOMPRESSED_BYTES); \
                     it is not an MNIST file",
                    gz.display()
                ),
            ));
        }
        return Ok((gz, bytes));
    }
    Err(Error::invalid(
        "MNIST data",
        format!(
            "{}: neither {name} nor {name}.gz is there; an MNIST directory holds {}",
            dir.display(),
            MNIST_FILES.join(", ")
        ),
    ))
}

/// An IDX file of unsigned bytes (type code 0x08): its dimensions and data.
fn parse_idx(bytes: &[u8]) -> std::result::Result<(Vec<usize>, &[u8]), String> {
    let [0, 0, kind, n_dims, ..] = *bytes else {
        return Err("too short or not an IDX file (it must start with 0x00 0x00 TYPE DIMS)".to_string());
    };
    if kind != 0x08 {
        return Err(format!("IDX type code 0x{kind:02x}; only unsigned bytes (0x08) are read"));
    }
    let header = 4 + 4 * usize::from(n_dims);
    if bytes.len() < header {
        return Err(format!("truncated header ({} bytes)", bytes.len()));
    }
    let dims: Vec<usize> =
        bytes[4..header].chunks_exact(4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize).collect();
    let data = &bytes[header..];
    let Some(expected) = checked_product(dims.iter().copied()) else {
        return Err(format!(
            "dimensions {dims:?} multiply past {} elements; the header is corrupt (the file has {} bytes of data)",
            usize::MAX,
            data.len()
        ));
    };
    if data.len() != expected {
        return Err(format!("dimensions {dims:?} need {expected} bytes of data but the file has {}", data.len()));
    }
    Ok((dims, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idx_header_is_checked() {
        let mut bytes = vec![0, 0, 8, 1, 0, 0, 0, 3];
        bytes.extend([1, 2, 3]);
        assert_eq!(parse_idx(&bytes).unwrap(), (vec![3], &[1u8, 2, 3][..]));
        assert!(parse_idx(&bytes[..10]).unwrap_err().contains("need 3 bytes"));
        assert!(parse_idx(&[0, 0, 9, 1]).unwrap_err().contains("type code"));
        assert!(parse_idx(&[1]).is_err());
    }
}
