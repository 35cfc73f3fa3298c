//! The run state a training checkpoint carries as metadata (`conveyor.train.*`): where the run
//! stands (step, data position) and the configuration that decides its arithmetic, so `--resume`
//! can refuse a run that would not continue it.
//!
//! What a resume may change: the total (`--steps`, `--epochs`), outputs (`--save`, `--checkpoint`,
//! `--checkpoint-every`, `--metrics`, `--trace`, `--svg`), evaluation and logging (`--eval-every`,
//! `--log-every`), `--on-nonfinite`, and how the work is laid out: `--devices`, `--stages`,
//! `--schedule`, `--chunks`, `--placement`, `--recompute`, `--core-slots`, `--device-memory` (every
//! schedule and stage count gives bit-identical weights, `tests/pipeline_equivalence.rs`) and
//! `--tensor-parallel`, `--sequence-parallel` and `--data-parallel` (the same weights up to f32 rounding). What it may not: the data, the model,
//! the optimizer and its hyperparameters (`--lr`, `--lr-schedule`, `--momentum`,
//! `--weight-decay`), `--batch`, `--microbatches` (a different split sums the gradients in another
//! order and draws other dropout masks), `--seed` and `--no-shuffle`.
use std::collections::BTreeMap;

use super::{UsageError, usage};
use crate::data::Dataset;

/// Prefix of the run state's metadata keys.
pub const RUN_STATE_KEY_PREFIX: &str = "conveyor.train.";

/// Metadata key of the run's spec as TOML ([`crate::RunSpec::for_checkpoint`]).
pub const SPEC_KEY: &str = "conveyor.spec";

/// Where a run stands and what it was run with: saved as checkpoint metadata. The optional fields
/// are absent from checkpoints written before they were recorded; a resume checks what is there.
#[derive(Clone, Debug, PartialEq)]
pub struct RunState {
    /// Optimizer steps taken.
    pub step: u64,
    /// Batches per epoch (training rows / batch).
    pub steps_per_epoch: u64,
    /// Seed of initialisation, shuffling and dropout.
    pub seed: u64,
    /// Rows per batch.
    pub batch: usize,
    /// Whether epochs are shuffled.
    pub shuffle: bool,
    /// Training rows.
    pub train_rows: usize,
    /// The model spec.
    pub model: String,
    /// The `--data` flag.
    pub data: String,
    /// The `--optimizer` flag.
    pub optimizer: String,
    /// The base learning rate.
    pub lr: f64,
    /// The learning-rate schedule.
    pub lr_schedule: String,
    /// The run's total steps (the schedule's horizon).
    pub total_steps: u64,
    /// Micro-batches per batch.
    pub micro_batches: Option<usize>,
    /// The optimizer's momentum (0 without).
    pub momentum: Option<f64>,
    /// The optimizer's weight decay.
    pub weight_decay: Option<f64>,
    /// [`data_fingerprint`] of the training rows.
    pub data_fingerprint: Option<String>,
    /// The run's spec as TOML, saved under [`SPEC_KEY`] (absent from older checkpoints). Not
    /// compared by [`RunState::differences`]: the fields above are what a resume must keep.
    pub spec: Option<String>,
}

impl RunState {
    /// Step 0 of a run of `spec` (as prepared: its spec, optimizer and training rows), the model
    /// named `model`, `steps_per_epoch` batches an epoch and `total_steps` in all.
    pub fn starting(
        spec: &crate::RunSpec,
        optimizer: &conveyor_engine::optim::OptimizerConfig,
        train: &Dataset,
        model: &str,
        steps_per_epoch: u64,
        total_steps: u64,
    ) -> RunState {
        let (momentum, weight_decay) = crate::spec::hyperparameters(optimizer);
        RunState {
            step: 0,
            steps_per_epoch,
            seed: spec.training.seed,
            batch: spec.training.batch,
            shuffle: spec.training.shuffle,
            train_rows: train.len(),
            model: model.to_string(),
            data: spec.data.source.clone(),
            optimizer: spec.optimizer.name.to_string(),
            lr: optimizer.lr(),
            lr_schedule: spec.optimizer.lr_schedule.to_string(),
            total_steps,
            micro_batches: Some(spec.pipeline.microbatches),
            momentum: Some(momentum),
            weight_decay: Some(weight_decay),
            data_fingerprint: Some(data_fingerprint(train)),
            // What the run is, without this invocation's files: a resume from it writes only its own.
            spec: spec.for_checkpoint().to_toml_string().ok(),
        }
    }

    /// The metadata map saved with a checkpoint (keys under [`RUN_STATE_KEY_PREFIX`]).
    pub fn to_metadata(&self) -> BTreeMap<String, String> {
        let epoch = self.step / self.steps_per_epoch.max(1);
        let batch_in_epoch = self.step % self.steps_per_epoch.max(1);
        let mut entries = vec![
            ("step", self.step.to_string()),
            ("epoch", epoch.to_string()),
            ("batch_in_epoch", batch_in_epoch.to_string()),
            ("steps_per_epoch", self.steps_per_epoch.to_string()),
            ("seed", self.seed.to_string()),
            ("batch", self.batch.to_string()),
            ("shuffle", self.shuffle.to_string()),
            ("train_rows", self.train_rows.to_string()),
            ("model", self.model.clone()),
            ("data", self.data.clone()),
            ("optimizer", self.optimizer.clone()),
            ("lr", self.lr.to_string()),
            ("lr_schedule", self.lr_schedule.clone()),
            ("total_steps", self.total_steps.to_string()),
        ];
        entries.extend(self.micro_batches.map(|m| ("microbatches", m.to_string())));
        entries.extend(self.momentum.map(|m| ("momentum", m.to_string())));
        entries.extend(self.weight_decay.map(|w| ("weight_decay", w.to_string())));
        entries.extend(self.data_fingerprint.clone().map(|f| ("data_fingerprint", f)));
        let mut metadata: BTreeMap<String, String> =
            entries.into_iter().map(|(key, value)| (format!("{RUN_STATE_KEY_PREFIX}{key}"), value)).collect();
        metadata.extend(self.spec.clone().map(|spec| (SPEC_KEY.to_string(), spec)));
        metadata
    }

    /// Reads the run state from a checkpoint's metadata; `source` names the file in errors.
    pub fn from_metadata(metadata: &BTreeMap<String, String>, source: &str) -> Result<RunState, UsageError> {
        let optional = |key: &str| metadata.get(&format!("{RUN_STATE_KEY_PREFIX}{key}")).cloned();
        let get = |key: &str| -> Result<String, UsageError> {
            optional(key).ok_or_else(|| {
                usage(format!(
                    "--resume {source}: metadata key `{RUN_STATE_KEY_PREFIX}{key}` is missing; resume from a \
                     checkpoint written by conveyor train --checkpoint (a --save file holds weights only)"
                ))
            })
        };
        let not_a = |key: &str, value: &str, kind: &str| {
            usage(format!(
                "--resume {source}: metadata `{RUN_STATE_KEY_PREFIX}{key}` = `{}` is not {kind}; the checkpoint \
                 is damaged, resume from another one",
                value.chars().take(40).collect::<String>()
            ))
        };
        let number = |key: &str| -> Result<u64, UsageError> {
            let value = get(key)?;
            value.trim().parse().map_err(|_| not_a(key, &value, "a whole number"))
        };
        let real = |key: &str, value: String| -> Result<f64, UsageError> {
            value
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite())
                .ok_or_else(|| not_a(key, &value, "a finite number"))
        };
        let shuffle = match get("shuffle")?.as_str() {
            "true" => true,
            "false" => false,
            other => return Err(not_a("shuffle", other, "true or false")),
        };
        let optional_real = |key: &str| optional(key).map(|value| real(key, value)).transpose();
        Ok(RunState {
            step: number("step")?,
            steps_per_epoch: number("steps_per_epoch")?,
            seed: number("seed")?,
            batch: usize::try_from(number("batch")?).map_err(|_| not_a("batch", "", "a row count"))?,
            shuffle,
            train_rows: usize::try_from(number("train_rows")?).map_err(|_| not_a("train_rows", "", "a row count"))?,
            model: get("model")?,
            data: get("data")?,
            optimizer: get("optimizer")?,
            lr: real("lr", get("lr")?)?,
            lr_schedule: get("lr_schedule")?,
            total_steps: number("total_steps")?,
            micro_batches: optional("microbatches")
                .map(|value| value.trim().parse::<usize>().map_err(|_| not_a("microbatches", &value, "a whole number")))
                .transpose()?,
            momentum: optional_real("momentum")?,
            weight_decay: optional_real("weight_decay")?,
            data_fingerprint: optional("data_fingerprint"),
            spec: metadata.get(SPEC_KEY).cloned(),
        })
    }

    /// What differs between this (the checkpoint's) state and `run`'s in what decides the
    /// training's arithmetic, one `FLAG: checkpoint A, this run B` each; empty when a resume may
    /// continue. Fields the checkpoint lacks are not compared; the data is compared by fingerprint
    /// when both have one (the same data under another path may resume), else by the `--data` flag.
    pub fn differences(&self, run: &RunState) -> Vec<String> {
        let show = |value: Option<String>| value.unwrap_or_else(|| "unrecorded".to_string());
        let mut compared: Vec<(&str, Option<String>, Option<String>)> = vec![
            ("--model", Some(self.model.clone()), Some(run.model.clone())),
            ("--batch", Some(self.batch.to_string()), Some(run.batch.to_string())),
            ("--seed", Some(self.seed.to_string()), Some(run.seed.to_string())),
            ("--no-shuffle", Some((!self.shuffle).to_string()), Some((!run.shuffle).to_string())),
            ("--optimizer", Some(self.optimizer.clone()), Some(run.optimizer.clone())),
            ("--lr", Some(self.lr.to_string()), Some(run.lr.to_string())),
            ("--lr-schedule", Some(self.lr_schedule.clone()), Some(run.lr_schedule.clone())),
            ("training rows", Some(self.train_rows.to_string()), Some(run.train_rows.to_string())),
        ];
        if self.micro_batches.is_some() {
            compared.push((
                "--microbatches",
                self.micro_batches.map(|m| m.to_string()),
                run.micro_batches.map(|m| m.to_string()),
            ));
        }
        if self.momentum.is_some() {
            compared.push(("--momentum", self.momentum.map(|m| m.to_string()), run.momentum.map(|m| m.to_string())));
        }
        if self.weight_decay.is_some() {
            compared.push((
                "--weight-decay",
                self.weight_decay.map(|w| w.to_string()),
                run.weight_decay.map(|w| w.to_string()),
            ));
        }
        match (&self.data_fingerprint, &run.data_fingerprint) {
            (Some(saved), Some(now)) if saved != now => compared.push((
                "--data (the training rows' contents)",
                Some(format!("{} ({saved})", self.data)),
                Some(format!("{} ({now})", run.data)),
            )),
            (Some(_), Some(_)) => {}
            _ => compared.push(("--data", Some(self.data.clone()), Some(run.data.clone()))),
        }
        compared
            .into_iter()
            .filter(|(_, saved, now)| saved != now)
            .map(|(flag, saved, now)| format!("{flag}: checkpoint {}, this run {}", show(saved), show(now)))
            .collect()
    }
}

/// A fingerprint of a data set's contents (shape, values, labels, classes): 64-bit FNV-1a over
/// 32- and 64-bit words, as `fnv1a64:` and 16 hex digits. Two runs on the same rows in the same
/// order agree whatever path the data came from.
pub fn data_fingerprint(dataset: &Dataset) -> String {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut mix = |word: u64| hash = (hash ^ word).wrapping_mul(PRIME);
    mix(dataset.feature_shape.len() as u64);
    dataset.feature_shape.iter().for_each(|&d| mix(d as u64));
    mix(dataset.n_classes as u64);
    dataset.features.iter().for_each(|v| mix(u64::from(v.to_bits())));
    dataset.labels.iter().for_each(|&l| mix(l as u64));
    format!("fnv1a64:{hash:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> RunState {
        RunState {
            step: 3,
            steps_per_epoch: 2,
            seed: 0,
            batch: 8,
            shuffle: true,
            train_rows: 16,
            model: "mlp:4,2".to_string(),
            data: "synthetic:16,4,2".to_string(),
            optimizer: "adam".to_string(),
            lr: 0.005,
            lr_schedule: "cosine".to_string(),
            total_steps: 6,
            micro_batches: Some(4),
            momentum: Some(0.0),
            weight_decay: Some(0.0),
            data_fingerprint: Some("fnv1a64:0000000000000001".to_string()),
            spec: Some("[training]\nbatch = 8\n".to_string()),
        }
    }

    #[test]
    fn metadata_round_trips_and_differences_are_listed() {
        let saved = state();
        let metadata = saved.to_metadata();
        assert_eq!(metadata[SPEC_KEY], "[training]\nbatch = 8\n", "the spec is saved under its own key");
        let read = RunState::from_metadata(&metadata, "ck").unwrap();
        assert_eq!(read, saved);
        let mut run = saved.clone();
        run.total_steps = 100;
        run.step = 0;
        assert!(saved.differences(&run).is_empty(), "the total and the position may change");
        run.lr = 0.1;
        run.micro_batches = Some(2);
        run.data = "elsewhere.safetensors".to_string();
        let differences = saved.differences(&run);
        assert_eq!(differences, ["--lr: checkpoint 0.005, this run 0.1", "--microbatches: checkpoint 4, this run 2"]);
        run.data_fingerprint = Some("fnv1a64:0000000000000002".to_string());
        assert_eq!(saved.differences(&run).len(), 3);
    }

    #[test]
    fn damaged_metadata_is_a_usage_error() {
        let mut metadata = state().to_metadata();
        metadata.insert(format!("{RUN_STATE_KEY_PREFIX}lr"), "NaN".to_string());
        assert!(RunState::from_metadata(&metadata, "ck").unwrap_err().0.contains("is not a finite number"));
        metadata.remove(&format!("{RUN_STATE_KEY_PREFIX}seed"));
        assert!(RunState::from_metadata(&metadata, "ck").unwrap_err().0.contains("is missing"));
    }
}
