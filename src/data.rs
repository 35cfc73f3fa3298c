//! Datasets for training: the built-in digits set (embedded in the binary), a seeded synthetic
//! generator, train/test splits and shuffled batches.
use std::io::Read;

use conveyor_engine::{Device, Error, Result, Tensor};
use rand::seq::SliceRandom;

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
        let std = sq.iter().zip(&mean).map(|(s, m)| (s / n - m * m).max(0.0).sqrt()).map(|s| if s < 1e-6 { 1.0 } else { s as f32 });
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

    /// Checks labels are in range and features are finite.
    pub fn validate(&self, source: &str) -> Result<()> {
        if let Some((row, label)) = self.labels.iter().enumerate().find(|(_, l)| **l >= self.n_classes) {
            return Err(Error::invalid("labels", format!("{source}: row {row} has label {label}, outside 0..{}", self.n_classes)));
        }
        if let Some(i) = self.features.iter().position(|v| !v.is_finite()) {
            return Err(Error::invalid(
                "inputs",
                format!("{source}: row {} has a non-finite value ({}); clean the data first", i / self.per_row().max(1), self.features[i]),
            ));
        }
        Ok(())
    }
}

/// The digits set: 1,797 images 1x8x8 scaled to [0, 1] (pixels are 0..16), 10 classes.
pub fn digits() -> Result<Dataset> {
    let mut text = String::new();
    flate2::read::GzDecoder::new(DIGITS_CSV_GZ)
        .read_to_string(&mut text)
        .map_err(|e| Error::invalid("digits data", format!("the embedded file is damaged: {e}")))?;
    let mut features = Vec::with_capacity(1797 * 64);
    let mut labels = Vec::with_capacity(1797);
    for (line_idx, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let values: Vec<f32> = line
            .split(',')
            .map(|v| v.trim().parse::<f32>())
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| Error::invalid("digits data", format!("line {}: {e}", line_idx + 1)))?;
        if values.len() != 65 {
            return Err(Error::invalid("digits data", format!("line {}: {} columns, expected 65", line_idx + 1, values.len())));
        }
        features.extend(values[..64].iter().map(|v| v / 16.0));
        labels.push(values[64] as usize);
    }
    let dataset = Dataset { features, feature_shape: vec![1, 8, 8], labels, n_classes: 10 };
    dataset.validate("digits")?;
    Ok(dataset)
}

/// `n_rows` samples of `n_features` features in `n_classes` classes: each class has a random
/// centre, samples are centre plus noise, so the task is learnable. Seeded.
pub fn synthetic(n_rows: usize, n_features: usize, n_classes: usize, seed: u64) -> Result<Dataset> {
    if n_rows == 0 || n_features == 0 || n_classes < 2 {
        return Err(Error::invalid("synthetic data", "need N >= 1 rows, D >= 1 features and C >= 2 classes (synthetic:N,D,C)"));
    }
    let mut rng = conveyor_engine::init::rng(seed);
    let device = Device::host();
    let centres = conveyor_engine::init::normal([n_classes, n_features], 1.0, &mut rng, &device)?.to_vec_f32();
    let noise = conveyor_engine::init::normal([n_rows, n_features], 0.5, &mut rng, &device)?.to_vec_f32();
    let labels: Vec<usize> = (0..n_rows).map(|r| (r * 7919 + seed as usize) % n_classes).collect();
    let mut features = Vec::with_capacity(n_rows * n_features);
    for (row, &label) in labels.iter().enumerate() {
        for f in 0..n_features {
            features.push(centres[label * n_features + f] + noise[row * n_features + f]);
        }
    }
    Ok(Dataset { features, feature_shape: vec![n_features], labels, n_classes })
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
