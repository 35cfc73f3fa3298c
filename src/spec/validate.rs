//! Checks of a [`RunSpec`] across its fields ([`RunSpec::validate`]), the optimizer it names
//! ([`OptimizerSection::config`]), and the counts that depend on the devices and the data
//! ([`devices_used`], [`total_steps`]), with checked arithmetic against [`crate::limits`].
use conveyor_engine::optim::{AdamConfig, OptimizerConfig, SgdConfig};

use super::{OptimizerKind, OptimizerSection, PlacementSpec, RunSpec, SpecError, TrainingSection};
use crate::limits::{MAX_CLASSES, MAX_DEVICES, MAX_STAGES, MAX_STEPS};
use crate::zoo::ModelSpec;

impl RunSpec {
    /// Checks what can be checked without the data or the devices: the model spec parses,
    /// `init` and `resume` are not both set, chunks suit the schedule, micro-batches suit the
    /// batch, counts are at least 1 and within the limits, `checkpoint.every` has a
    /// `checkpoint.path`, the optimizer accepts its hyperparameters, mixed precision has no split
    /// layers, and a data-parallel strategy other than plain `allreduce` (`sync`, `compress`,
    /// `interleaving`) asks for nothing it cannot honour (`strategy.rs`).
    /// [`RunSpec::prepare`] checks the rest (the data, the device count, the run's length).
    ///
    /// ```
    /// use conveyor::RunSpec;
    /// use conveyor::spec::SpecError;
    ///
    /// let mut spec = RunSpec::default();
    /// spec.pipeline.chunks = 2;
    /// let error = spec.validate().unwrap_err();
    /// assert!(matches!(error, SpecError::ChunksNeedInterleaved { chunks: 2, .. }));
    /// assert!(error.to_string().contains("--chunks 2 needs --schedule interleaved"));
    /// spec.pipeline.schedule = conveyor::schedules::ScheduleKind::Interleaved;
    /// spec.validate()?;
    /// # Ok::<(), SpecError>(())
    /// ```
    pub fn validate(&self) -> Result<(), SpecError> {
        let (pipeline, training) = (&self.pipeline, &self.training);
        if self.checkpoint.init.is_some() && self.checkpoint.resume.is_some() {
            return Err(SpecError::InitAndResume);
        }
        if let Some(fraction) = self.data.test_fraction
            && !(0.0..1.0).contains(&fraction)
        {
            return Err(SpecError::TestFraction { fraction });
        }
        if let Some(classes) = self.data.classes
            && !(1..=MAX_CLASSES).contains(&classes)
        {
            return Err(SpecError::Classes { classes, limit: MAX_CLASSES });
        }
        if let Some(text) = &self.model.spec {
            model_spec(text)?;
        }
        if pipeline.chunks == 0 {
            return Err(SpecError::ZeroChunks);
        }
        if let Some(required) = pipeline.schedule.required_chunks()
            && pipeline.chunks != required
        {
            return Err(SpecError::ChunksForV { chunks: pipeline.chunks, schedule: pipeline.schedule, required });
        }
        if pipeline.chunks > 1 && !pipeline.schedule.supports_chunks() {
            return Err(SpecError::ChunksNeedInterleaved { chunks: pipeline.chunks, schedule: pipeline.schedule });
        }
        stages_needed(pipeline.stages, pipeline.tensor_parallel)?;
        if pipeline.zero > 1 {
            return Err(SpecError::ZeroStage { zero: pipeline.zero });
        }
        if !(1..=MAX_DEVICES).contains(&pipeline.data_parallel) {
            return Err(SpecError::DataParallelReplicas { replicas: pipeline.data_parallel, limit: MAX_DEVICES });
        }
        if let conveyor_engine::runtime::ReplicaShares::Weights(weights) = &pipeline.replica_shares
            && weights.len() != pipeline.data_parallel
        {
            return Err(SpecError::ReplicaShareCount {
                shares: pipeline.replica_shares.to_string(),
                given: weights.len(),
                replicas: pipeline.data_parallel,
            });
        }
        if pipeline.sequence_parallel && pipeline.tensor_parallel < 2 {
            return Err(SpecError::SequenceParallelNeedsGroup { tensor_parallel: pipeline.tensor_parallel });
        }
        if pipeline.tensor_parallel > 1 && pipeline.placement != PlacementSpec::Auto {
            return Err(SpecError::TensorParallelPlacement);
        }
        if pipeline.microbatches == 0 || training.batch == 0 {
            return Err(SpecError::EmptyBatch { batch: training.batch, microbatches: pipeline.microbatches });
        }
        if pipeline.microbatches > training.batch {
            return Err(SpecError::MicrobatchesOverBatch {
                microbatches: pipeline.microbatches,
                batch: training.batch,
            });
        }
        if pipeline.data_parallel > 1
            && let Err(error) =
                pipeline.replica_shares.rows_per_replica(training.batch, pipeline.data_parallel, pipeline.microbatches)
        {
            return Err(SpecError::ReplicaShareRows { reason: super::toml::reason(error) });
        }
        for (key, flag, value) in [
            ("training.eval_every", "--eval-every", training.eval_every),
            ("checkpoint.every", "--checkpoint-every", self.checkpoint.every),
        ] {
            if value == Some(0) {
                return Err(SpecError::ZeroEvery { key, flag });
            }
        }
        if self.checkpoint.every.is_some() && self.checkpoint.path.is_none() {
            return Err(SpecError::CheckpointEveryWithoutPath);
        }
        self.optimizer.config()?;
        if training.precision.is_mixed() && self.pipeline.tensor_parallel > 1 {
            return Err(SpecError::MixedPrecision {
                precision: training.precision,
                tensor_parallel: self.pipeline.tensor_parallel,
            });
        }
        // The data-parallel strategy's settings, and what a run through the strategies can honour.
        super::strategy::check(self)
    }
}

/// Parses a model spec's text.
pub(super) fn model_spec(text: &str) -> Result<ModelSpec, SpecError> {
    text.parse().map_err(|e| SpecError::Model { text: text.to_string(), reason: reason(e) })
}

/// An engine error's reason alone when it is an invalid argument, else the whole message.
pub(super) fn reason(error: conveyor_engine::Error) -> String {
    match error {
        conveyor_engine::Error::InvalidArgument { reason, .. } => reason,
        other => other.to_string(),
    }
}

impl OptimizerSection {
    /// The optimizer this section names with its defaults filled in (lr 0.005 for adam and
    /// adamw, 0.05 for sgd and momentum; momentum 0.9; weight decay 0, or 0.01 for adamw), after
    /// checking `momentum` is given only to `momentum` and the optimizer accepts every value.
    ///
    /// ```
    /// use conveyor::spec::{OptimizerKind, OptimizerSection};
    ///
    /// let section = OptimizerSection { name: OptimizerKind::Momentum, ..Default::default() };
    /// assert_eq!(section.config()?.lr(), 0.05);
    /// # Ok::<(), conveyor::spec::SpecError>(())
    /// ```
    pub fn config(&self) -> Result<OptimizerConfig, SpecError> {
        let (name, lr, weight_decay) = (self.name, self.lr, self.weight_decay);
        if let Some(momentum) = self.momentum
            && name != OptimizerKind::Momentum
        {
            return Err(SpecError::MomentumNotApplicable { momentum, optimizer: name });
        }
        let wd = weight_decay.unwrap_or(0.0);
        let config = match name {
            OptimizerKind::Sgd => OptimizerConfig::Sgd(SgdConfig::new(lr.unwrap_or(0.05)).with_weight_decay(wd)),
            OptimizerKind::Momentum => OptimizerConfig::Sgd(
                SgdConfig::new(lr.unwrap_or(0.05)).with_momentum(self.momentum.unwrap_or(0.9)).with_weight_decay(wd),
            ),
            OptimizerKind::Adam => OptimizerConfig::Adam(AdamConfig::adam(lr.unwrap_or(0.005)).with_weight_decay(wd)),
            OptimizerKind::AdamW => OptimizerConfig::AdamW(
                AdamConfig::adamw(lr.unwrap_or(0.005)).with_weight_decay(weight_decay.unwrap_or(0.01)),
            ),
        };
        if let Some(max_norm) = self.clip_grad_norm {
            conveyor_engine::optim::check_max_norm(max_norm).map_err(|e| SpecError::Hyperparameter {
                key: "optimizer.clip_grad_norm",
                flag: "--clip-grad-norm",
                optimizer: name,
                reason: match e {
                    conveyor_engine::Error::InvalidArgument { reason, .. } => reason,
                    other => other.to_string(),
                },
            })?;
        }
        config.validate().map_err(|e| match e {
            // Name the key that set the value: the optimizer's message names the hyperparameter.
            conveyor_engine::Error::InvalidArgument { name: parameter, reason } => {
                let (key, flag) = match parameter.as_str() {
                    "lr" => ("optimizer.lr", "--lr"),
                    "momentum" => ("optimizer.momentum", "--momentum"),
                    "weight_decay" => ("optimizer.weight_decay", "--weight-decay"),
                    _ => ("optimizer.name", "--optimizer"),
                };
                SpecError::Hyperparameter { key, flag, optimizer: name, reason }
            }
            other => SpecError::Engine(other),
        })?;
        Ok(config)
    }
}

/// The momentum and weight decay an optimizer runs with (recorded in checkpoints so a resume
/// with other values is refused).
pub fn hyperparameters(optimizer: &OptimizerConfig) -> (f64, f64) {
    match optimizer {
        OptimizerConfig::Sgd(sgd) => (sgd.momentum, sgd.weight_decay),
        OptimizerConfig::Adam(adam) | OptimizerConfig::AdamW(adam) => (0.0, adam.weight_decay),
    }
}

/// Checks the tensor-parallel degree and the stage count alone; returns the devices `stages`
/// needs, if given.
fn stages_needed(stages: Option<usize>, tensor_parallel: usize) -> Result<Option<usize>, SpecError> {
    let k = tensor_parallel;
    if k == 0 {
        return Err(SpecError::ZeroTensorParallel);
    }
    if k > MAX_DEVICES {
        return Err(SpecError::TensorParallelOverLimit { tensor_parallel: k, limit: MAX_DEVICES });
    }
    match stages {
        None => Ok(None),
        Some(0) => Err(SpecError::ZeroStages),
        Some(stages) => stages
            .checked_mul(k)
            .filter(|&n| n <= MAX_DEVICES)
            .map(Some)
            .ok_or(SpecError::StagesOverLimit { stages, tensor_parallel: k, limit: MAX_DEVICES }),
    }
}

/// How many of the `n_devices` listed a run uses: `stages` x `tensor_parallel` (all of them
/// without `stages`), after checking the counts and that the pipeline, devices x `chunks`
/// stages, is within [`MAX_STAGES`].
pub fn devices_used(spec: &RunSpec, n_devices: usize) -> Result<usize, SpecError> {
    let pipeline = &spec.pipeline;
    let (k, replicas) = (pipeline.tensor_parallel, pipeline.data_parallel.max(1));
    let needed = stages_needed(pipeline.stages, k)?
        .map(|n| {
            n.checked_mul(replicas)
                .filter(|&n| n <= MAX_DEVICES)
                .ok_or(SpecError::DataParallelReplicas { replicas, limit: MAX_DEVICES })
        })
        .transpose()?;
    let used = match (needed, pipeline.stages) {
        (Some(needed), Some(stages)) if needed > n_devices => {
            return Err(SpecError::StagesNeedDevices {
                stages,
                tensor_parallel: k,
                needed,
                devices: pipeline.devices.clone(),
                available: n_devices,
            });
        }
        (Some(needed), _) => needed,
        (None, _) => n_devices,
    };
    if replicas > 1 && !used.is_multiple_of(replicas * k) {
        return Err(SpecError::DataParallelDevices { replicas, tensor_parallel: k, devices: used });
    }
    if (used / k / replicas).checked_mul(pipeline.chunks).is_none_or(|n| n > MAX_STAGES) {
        return Err(SpecError::ChunksOverLimit {
            chunks: pipeline.chunks,
            pipeline_devices: used / k / replicas,
            limit: MAX_STAGES,
        });
    }
    Ok(used)
}

/// The run's total optimizer steps: `steps`, or `epochs` x `steps_per_epoch`; at most
/// [`MAX_STEPS`], never wrapped around.
pub fn total_steps(training: &TrainingSection, steps_per_epoch: u64) -> Result<u64, SpecError> {
    match training.steps {
        Some(steps) if steps <= MAX_STEPS => Ok(steps),
        Some(steps) => Err(SpecError::StepsOverLimit { steps, limit: MAX_STEPS }),
        None => training
            .epochs
            .checked_mul(steps_per_epoch)
            .filter(|&n| n <= MAX_STEPS)
            .ok_or(SpecError::EpochsOverLimit { epochs: training.epochs, steps_per_epoch, limit: MAX_STEPS }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_spec_is_valid() {
        RunSpec::default().validate().unwrap();
    }

    #[test]
    fn cross_field_checks_name_flag_and_key() {
        type Change = fn(&mut RunSpec);
        let cases: Vec<(Change, &str)> = vec![
            (|s| s.checkpoint.every = Some(5), "checkpoint.every needs checkpoint.path"),
            (|s| s.training.eval_every = Some(0), "--eval-every must be at least 1"),
            (|s| s.pipeline.microbatches = 64, "more than the 32 rows"),
            (|s| s.pipeline.tensor_parallel = 0, "pipeline.tensor_parallel"),
            (|s| s.pipeline.stages = Some(0), "--stages 0"),
            (
                |s| {
                    s.training.precision = conveyor_engine::Precision::Bf16;
                    s.pipeline.tensor_parallel = 2;
                },
                "the split layers compute in f32 only",
            ),
            (|s| s.optimizer.lr = Some(-1.0), "--lr: Invalid learning rate"),
            (|s| s.optimizer.momentum = Some(0.5), "--momentum 0.5 applies only"),
            (|s| s.model.spec = Some("mlp".into()), "invalid model spec `mlp`"),
            (|s| s.data.test_fraction = Some(1.5), "data.test_fraction"),
            (
                |s| {
                    s.checkpoint.init = Some("a".into());
                    s.checkpoint.resume = Some("b".into());
                },
                "give one",
            ),
        ];
        for (change, expected) in cases {
            let mut spec = RunSpec::default();
            change(&mut spec);
            let message = spec.validate().unwrap_err().to_string();
            assert!(message.contains(expected), "expected `{expected}` in {message}");
        }
    }

    #[test]
    fn device_counts_and_steps_are_checked() {
        let mut spec = RunSpec::default();
        spec.pipeline.stages = Some(3);
        assert!(matches!(devices_used(&spec, 2), Err(SpecError::StagesNeedDevices { needed: 3, available: 2, .. })));
        assert_eq!(devices_used(&spec, 4).unwrap(), 3);
        spec.pipeline.stages = None;
        spec.pipeline.chunks = 100_000;
        assert!(matches!(devices_used(&spec, 2), Err(SpecError::ChunksOverLimit { .. })));
        let training = TrainingSection { epochs: u64::MAX, ..Default::default() };
        assert!(matches!(total_steps(&training, 3), Err(SpecError::EpochsOverLimit { steps_per_epoch: 3, .. })));
        assert_eq!(total_steps(&TrainingSection::default(), 3).unwrap(), 90);
    }
}
