//! State in and out of a trainer: [`Trainer::save`] and [`Trainer::load`] (the weights, as a
//! PyTorch state dict), [`Trainer::checkpoint`] and [`TrainerBuilder::resume`] (everything a run
//! needs to continue bit for bit: weights, every stage's optimizer state, the step index and the
//! seed), and the metadata a program stores with them ([`TrainerBuilder::metadata`]).
//!
//! # Files
//!
//! Every file is one safetensors file written atomically by
//! [`crate::checkpoint::save_with_metadata`] (a temporary file beside the target, fsynced and
//! renamed over it), so a save that fails or is killed midway leaves the previous file whole.
//! Names are PyTorch's state-dict names (`node.param`), tensors unsplit whatever the tensor
//! parallelism and whatever the stages, so a file saved from one placement loads into any other,
//! and `safetensors.torch.load_file` gives a state dict for `model.load_state_dict`. A training
//! checkpoint adds the optimizer state as `optimizer.<param>.<field>` (see [`crate::optim`]) and
//! the step index and seed under [`STEP_KEY`] and [`SEED_KEY`]; the trainer's metadata goes into
//! every file's header, where [`crate::checkpoint::read_metadata`] reads it without the tensors.
//!
//! # Loading
//!
//! Loads are strict by default, as PyTorch's `load_state_dict(strict=True)`: a file that lacks one
//! of the model's tensors, holds one the model does not have, or holds one of another shape is
//! refused with one [`Error::StateDictMismatch`] listing every such name, and nothing is loaded. A
//! non-strict load ([`Trainer::load_with`]) loads what matches and returns the rest as a
//! [`LoadReport`]. Any float dtype loads (converted to the parameter's). A file with NaN or
//! infinity in a tensor to be loaded is refused ([`Error::NonFiniteCheckpoint`]): every step
//! trained from it would be non-finite. Each layer refreshes what it derives from its parameters
//! (such as Linear's packed weights) right after the load.
//!
//! A child module of `trainer.rs` (declared there with `#[path]`), so it reads the trainer's
//! fields without widening their visibility.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::{Trainer, TrainerBuilder};
use crate::checkpoint::{
    self, Checkpoint, LOSS_SCALE_GOOD_STEPS_KEY, LOSS_SCALE_KEY, LoadOptions, LoadReport, RESERVED_METADATA_KEYS,
    SEED_KEY, STEP_KEY,
};
use crate::optim::{OPTIMIZER_STATE_PREFIX, STEP, optimizer_state_name};
use crate::{DType, Device, Error, Result, Shape, Tensor};

/// The builder's state settings: metadata for every checkpoint, and a checkpoint to resume from.
#[derive(Default)]
pub(super) struct StateChoice {
    metadata: BTreeMap<String, String>,
    resume: Option<PathBuf>,
}

impl StateChoice {
    /// Refuses metadata under the writers' keys, before `build` starts any worker.
    pub(super) fn check(&self) -> Result<()> {
        self.metadata.keys().try_for_each(|key| check_metadata_key(key))
    }

    /// Gives the built trainer its metadata, then restores the checkpoint to resume from, if any.
    pub(super) fn apply(self, mut trainer: Trainer) -> Result<Trainer> {
        trainer.metadata = self.metadata;
        if let Some(path) = self.resume {
            trainer.restore(path)?;
        }
        Ok(trainer)
    }
}

/// An [`Error::InvalidArgument`] for a metadata key the checkpoint writers own.
fn check_metadata_key(key: &str) -> Result<()> {
    if RESERVED_METADATA_KEYS.contains(&key) {
        return Err(Error::invalid(
            "metadata",
            format!(
                "`{key}` is written by the trainer itself; use another key (the reserved ones are {})",
                RESERVED_METADATA_KEYS.join(", ")
            ),
        ));
    }
    Ok(())
}

impl TrainerBuilder {
    /// Stores `value` under `key` in the metadata of every file the trainer saves
    /// ([`Trainer::save`], [`Trainer::checkpoint`]) and in [`Trainer::metadata`]; a program can
    /// read it back with [`crate::checkpoint::read_metadata`] before building anything (the
    /// facade stores its run spec as TOML under `conveyor.spec` this way). With
    /// [`TrainerBuilder::resume`], keys set here override the checkpoint's. The keys the trainer
    /// writes itself ([`RESERVED_METADATA_KEYS`]) are refused by `build`.
    ///
    /// ```
    /// # include!("doc_model.rs");
    /// # fn main() -> conveyor_engine::Result<()> {
    /// use conveyor_engine::checkpoint;
    /// use conveyor_engine::runtime::Trainer;
    ///
    /// // `graph()` and `loss()` give a small model and its loss (see the module docs).
    /// let trainer = Trainer::builder(graph(), loss()).metadata("experiment", "baseline").build()?;
    /// assert_eq!(trainer.metadata()["experiment"], "baseline");
    ///
    /// let path = temp_path("metadata.safetensors");
    /// trainer.checkpoint(&path)?;
    /// let stored = checkpoint::read_metadata(&path)?;
    /// assert_eq!(stored["experiment"], "baseline");
    /// assert_eq!(stored[checkpoint::STEP_KEY], "0");
    /// # std::fs::remove_file(&path).unwrap();
    /// # Ok(())
    /// # }
    /// ```
    pub fn metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.state.metadata.insert(key.into(), value.into());
        self
    }

    /// Makes `build` continue the run saved by [`Trainer::checkpoint`] at `path`: it restores
    /// the weights, every stage's optimizer state, the step index and the seed (so dropout masks
    /// continue as they would have), and takes the checkpoint's metadata, under the keys set with
    /// [`TrainerBuilder::metadata`]. The model, optimizer kind and hyperparameters are the
    /// builder's; devices, stages, schedule and tensor parallelism may differ from the run that
    /// saved it, and training goes on bit for bit as if uninterrupted (up to f32 rounding with
    /// another tensor-parallel degree).
    ///
    /// `build` fails, as [`Trainer::restore`] does, when the file does not hold exactly the model's
    /// tensors and this optimizer's state ([`Error::StateDictMismatch`], listing every name) or
    /// holds NaN or infinity ([`Error::NonFiniteCheckpoint`]).
    ///
    /// ```
    /// # include!("doc_model.rs");
    /// # fn main() -> conveyor_engine::Result<()> {
    /// use conveyor_engine::optim::OptimizerConfig;
    /// use conveyor_engine::placement::Placement;
    /// use conveyor_engine::runtime::Trainer;
    /// use conveyor_engine::Device;
    ///
    /// // Five steps on one device, uninterrupted.
    /// let mut whole = Trainer::builder(graph(), loss()).optimizer(OptimizerConfig::adam(0.1)).build()?;
    /// train(&mut whole, 5)?;
    ///
    /// // Three steps, a checkpoint, and the last two on two devices.
    /// let mut first = Trainer::builder(graph(), loss()).optimizer(OptimizerConfig::adam(0.1)).build()?;
    /// train(&mut first, 3)?;
    /// let path = temp_path("resume.safetensors");
    /// first.checkpoint(&path)?;
    /// let mut resumed = Trainer::builder(graph(), loss())
    ///     .optimizer(OptimizerConfig::adam(0.1))
    ///     .devices(vec![Device::cpu(0), Device::cpu(1)])
    ///     .placement(Placement::Manual(vec![vec!["a".to_string()], vec!["b".to_string()]]))
    ///     .batch_rows(4)
    ///     .resume(&path)
    ///     .build()?;
    /// assert_eq!(resumed.step_idx(), 3);
    /// train(&mut resumed, 2)?;
    /// assert_eq!(resumed.parameters()?[0].1.to_vec_f32(), whole.parameters()?[0].1.to_vec_f32());
    /// # std::fs::remove_file(&path).unwrap();
    /// # Ok(())
    /// # }
    /// ```
    pub fn resume(mut self, path: impl AsRef<Path>) -> Self {
        self.state.resume = Some(path.as_ref().to_path_buf());
        self
    }
}

impl Trainer {
    /// The metadata every saved file carries: what [`TrainerBuilder::metadata`] and
    /// [`Trainer::set_metadata`] set, and after a resume the checkpoint's other keys. The keys the
    /// trainer writes itself (the step and seed of a checkpoint) are not in it: see
    /// [`Trainer::step_idx`] and [`Trainer::seed`].
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// Stores `value` under `key` in the metadata of the files saved from now on (for example the
    /// epoch a loop has reached); an [`Error::InvalidArgument`] for a key the trainer writes itself
    /// ([`RESERVED_METADATA_KEYS`]).
    ///
    /// ```
    /// # include!("doc_model.rs");
    /// # fn main() -> conveyor_engine::Result<()> {
    /// let mut trainer = conveyor_engine::runtime::Trainer::builder(graph(), loss()).build()?;
    /// trainer.set_metadata("epoch", "3")?;
    /// assert_eq!(trainer.metadata()["epoch"], "3");
    /// assert!(trainer.set_metadata(conveyor_engine::checkpoint::STEP_KEY, "9").is_err());
    /// # Ok(())
    /// # }
    /// ```
    pub fn set_metadata(&mut self, key: impl Into<String>, value: impl Into<String>) -> Result<()> {
        let key = key.into();
        check_metadata_key(&key)?;
        self.metadata.insert(key, value.into());
        Ok(())
    }

    /// The seed dropout masks derive from (with the step index): the builder's
    /// ([`TrainerBuilder::seed`]), or after a resume the checkpoint's.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Saves the weights to `path`, atomically: exactly a PyTorch state dict (every parameter
    /// under its state-dict name, unsplit whatever the stages and tensor parallelism), with
    /// [`Trainer::metadata`] in the header. `safetensors.torch.load_file(path)` gives a dict that
    /// `model.load_state_dict` takes. If the write fails, the previous file at `path` is whole.
    ///
    /// ```
    /// # include!("doc_model.rs");
    /// # fn main() -> conveyor_engine::Result<()> {
    /// use conveyor_engine::runtime::Trainer;
    ///
    /// let mut trainer = Trainer::builder(graph(), loss()).build()?;
    /// train(&mut trainer, 2)?;
    /// let path = temp_path("weights.safetensors");
    /// trainer.save(&path)?;
    ///
    /// // A fresh trainer of the same model predicts the same, bit for bit.
    /// let mut fresh = Trainer::builder(graph(), loss()).build()?;
    /// fresh.load(&path)?;
    /// assert_eq!(fresh.predict(&batch())?.to_vec_f32(), trainer.predict(&batch())?.to_vec_f32());
    /// # std::fs::remove_file(&path).unwrap();
    /// # Ok(())
    /// # }
    /// ```
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        self.refuse_if_poisoned()?;
        let tensors = self.parameters()?;
        if !self.writes_files() {
            return Ok(());
        }
        write(path.as_ref(), &tensors, &self.metadata)
    }

    /// Whether this process writes the files [`Trainer::save`] and [`Trainer::checkpoint`] name:
    /// always in-process; under MPI only rank 0 (every rank must still call them: they gather).
    pub fn writes_files(&self) -> bool {
        self.transport.rank() == 0
    }

    /// Loads the weights saved at `path` (by [`Trainer::save`], [`Trainer::checkpoint`] or
    /// PyTorch's `safetensors.torch.save_file(model.state_dict(), path)`), strictly: see
    /// [`Trainer::load_with`] with the default [`LoadOptions`]. Optimizer state in the file is
    /// ignored; the step index, seed and optimizer state stay as they are.
    ///
    /// ```
    /// # include!("doc_model.rs");
    /// # fn main() -> conveyor_engine::Result<()> {
    /// use conveyor_engine::{Device, Error, Tensor};
    /// use conveyor_engine::checkpoint;
    /// use conveyor_engine::runtime::Trainer;
    ///
    /// // A file with `a.weight` only, and a tensor the model does not have.
    /// let path = temp_path("partial.safetensors");
    /// let weight = Tensor::from_vec(vec![1.0; 4], [4], &Device::host())?;
    /// checkpoint::save(&path, &[("a.weight", &weight), ("c.weight", &weight)])?;
    ///
    /// let mut trainer = Trainer::builder(graph(), loss()).build()?;
    /// match trainer.load(&path) {
    ///     Err(Error::StateDictMismatch { missing, unexpected, wrong_shape, .. }) => {
    ///         assert_eq!(missing, ["b.weight"]);
    ///         assert_eq!(unexpected, ["c.weight"]);
    ///         assert!(wrong_shape.is_empty());
    ///     }
    ///     other => panic!("a strict load refuses the file: {other:?}"),
    /// }
    /// # std::fs::remove_file(&path).unwrap();
    /// # Ok(())
    /// # }
    /// ```
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        self.load_with(path, LoadOptions::default()).map(|_| ())
    }

    /// Loads the weights saved at `path` as `options` say, and reports what matched.
    ///
    /// Strict ([`LoadOptions::default`], PyTorch's `strict=True`): a file that lacks one of the
    /// model's parameters, holds a tensor the model does not have, or holds one of another shape
    /// is refused with one [`Error::StateDictMismatch`] listing every such name, and nothing is
    /// loaded. Non-strict: the tensors whose names and shapes match are loaded and the others
    /// returned in the [`LoadReport`] (unlike PyTorch, a wrong shape is reported, not raised).
    ///
    /// Either way: tensors named `optimizer.*` that are not parameters (a training checkpoint's
    /// optimizer state) are passed over; any float dtype is converted to the parameter's; a tensor
    /// to be loaded holding NaN or infinity fails the load ([`Error::NonFiniteCheckpoint`]) before
    /// anything changes; after the load every layer refreshes what it derives from its
    /// parameters. A file that cannot be read is an [`Error::Io`], one that is not safetensors an
    /// [`Error::Checkpoint`].
    ///
    /// ```
    /// # include!("doc_model.rs");
    /// # fn main() -> conveyor_engine::Result<()> {
    /// use conveyor_engine::{Device, Tensor};
    /// use conveyor_engine::checkpoint::{self, LoadOptions};
    /// use conveyor_engine::runtime::Trainer;
    ///
    /// let path = temp_path("some-weights.safetensors");
    /// let weight = Tensor::from_vec(vec![1.0; 4], [4], &Device::host())?;
    /// checkpoint::save(&path, &[("a.weight", &weight)])?;
    ///
    /// let mut trainer = Trainer::builder(graph(), loss()).build()?;
    /// let report = trainer.load_with(&path, LoadOptions { strict: false })?;
    /// assert_eq!((report.loaded, report.missing), (vec!["a.weight".to_string()], vec!["b.weight".to_string()]));
    /// assert_eq!(trainer.parameters()?[0].1.to_vec_f32(), [1.0; 4]);
    /// # std::fs::remove_file(&path).unwrap();
    /// # Ok(())
    /// # }
    /// ```
    pub fn load_with(&mut self, path: impl AsRef<Path>, options: LoadOptions) -> Result<LoadReport> {
        let path = path.as_ref();
        let mut file = checkpoint::load(path, &Device::host())?;
        let parameters = self.state_shapes()?.parameters;
        let is_optimizer_state = |name: &str| name.starts_with(OPTIMIZER_STATE_PREFIX);
        let report = file.match_state_dict(&parameters, is_optimizer_state);
        if options.strict && !report.is_exact() {
            return Err(report.into_error(path));
        }
        // Keep only what is loaded, so the finiteness check judges exactly that.
        let others: Vec<String> =
            file.names().filter(|n| !report.loaded.iter().any(|l| l == n)).map(String::from).collect();
        for name in others {
            file.take(&name);
        }
        refuse_non_finite(&file)?;
        self.load_parameters(file.into_tensors().into_iter().collect())?;
        Ok(report)
    }

    /// Saves a training checkpoint to `path`, atomically: the weights (as [`Trainer::save`]),
    /// every stage's optimizer state (`optimizer.<param>.<field>`, unsplit), the step index under
    /// [`STEP_KEY`], the seed under [`SEED_KEY`], and [`Trainer::metadata`].
    /// [`TrainerBuilder::resume`] (or [`Trainer::restore`]) continues from it; its weights also
    /// load on their own ([`Trainer::load`]). If the write fails, the previous file at `path` is
    /// whole.
    ///
    /// ```
    /// # include!("doc_model.rs");
    /// # fn main() -> conveyor_engine::Result<()> {
    /// use conveyor_engine::checkpoint;
    /// use conveyor_engine::optim::OptimizerConfig;
    /// use conveyor_engine::runtime::Trainer;
    ///
    /// let mut trainer = Trainer::builder(graph(), loss()).optimizer(OptimizerConfig::adam(0.01)).seed(7).build()?;
    /// train(&mut trainer, 2)?;
    /// let path = temp_path("checkpoint.safetensors");
    /// trainer.checkpoint(&path)?;
    ///
    /// let file = checkpoint::load(&path, &conveyor_engine::Device::host())?;
    /// assert!(file.get("optimizer.a.weight.exp_avg").is_some());
    /// assert_eq!(file.metadata()[checkpoint::STEP_KEY], "2");
    /// assert_eq!(file.metadata()[checkpoint::SEED_KEY], "7");
    /// # std::fs::remove_file(&path).unwrap();
    /// # Ok(())
    /// # }
    /// ```
    pub fn checkpoint(&self, path: impl AsRef<Path>) -> Result<()> {
        self.refuse_if_poisoned()?;
        let mut tensors = self.parameters()?;
        // Under the unsplit names, so the file does not depend on the tensor-parallel degree.
        tensors.extend(self.optimizer_state()?);
        let mut metadata = self.metadata.clone();
        metadata.insert(STEP_KEY.to_string(), self.step_idx.to_string());
        metadata.insert(SEED_KEY.to_string(), self.seed.to_string());
        if let Some(scaler) = &self.loss_scaler {
            metadata.insert(LOSS_SCALE_KEY.to_string(), scaler.scale().to_string());
            metadata.insert(LOSS_SCALE_GOOD_STEPS_KEY.to_string(), scaler.good_steps().to_string());
        }
        if !self.writes_files() {
            return Ok(());
        }
        write(path.as_ref(), &tensors, &metadata)
    }

    /// Restores the training checkpoint at `path` into this trainer, as
    /// [`TrainerBuilder::resume`] does for the trainer it builds (use that unless the trainer is
    /// built elsewhere): weights, every stage's optimizer state, the step index and the seed, and
    /// the checkpoint's metadata under keys the trainer does not have.
    ///
    /// Everything the file holds is checked before anything changes: exactly the model's
    /// parameters and this optimizer's state for each, with their shapes
    /// ([`Error::StateDictMismatch`] listing every other name), the state in f32 with whole step
    /// counts, the step and seed in the metadata ([`Error::Checkpoint`]), every value finite
    /// ([`Error::NonFiniteCheckpoint`]).
    ///
    /// ```
    /// # include!("doc_model.rs");
    /// # fn main() -> conveyor_engine::Result<()> {
    /// use conveyor_engine::runtime::Trainer;
    ///
    /// let mut trainer = Trainer::builder(graph(), loss()).build()?;
    /// train(&mut trainer, 3)?;
    /// let path = temp_path("restore.safetensors");
    /// trainer.checkpoint(&path)?;
    ///
    /// let mut other = Trainer::builder(graph(), loss()).build()?;
    /// other.restore(&path)?;
    /// assert_eq!(other.step_idx(), 3);
    /// assert_eq!(other.parameters()?[1].1.to_vec_f32(), trainer.parameters()?[1].1.to_vec_f32());
    /// # std::fs::remove_file(&path).unwrap();
    /// # Ok(())
    /// # }
    /// ```
    pub fn restore(&mut self, path: impl AsRef<Path>) -> Result<()> {
        self.restore_at(path.as_ref(), None)
    }

    /// [`Trainer::restore`] for a checkpoint written before checkpoints carried the step index and
    /// seed (`conveyor train --checkpoint` files of earlier versions keep them in their own run
    /// state): `step_idx` and `seed` are used where the file has no `conveyor.step` and
    /// `conveyor.seed`; a file that has them keeps its own.
    pub fn restore_with_position(&mut self, path: impl AsRef<Path>, step_idx: u64, seed: u64) -> Result<()> {
        self.restore_at(path.as_ref(), Some((step_idx, seed)))
    }

    /// [`Trainer::restore`], with the position to use where the file has none.
    fn restore_at(&mut self, path: &Path, fallback: Option<(u64, u64)>) -> Result<()> {
        let mut file = checkpoint::load(path, &Device::host())?;
        let StateShapes { parameters, fields } = self.state_shapes()?;
        let mut expected = parameters.clone();
        for (name, shape) in &parameters {
            expected.push((optimizer_state_name(name, STEP), Shape::new(Vec::new())));
            expected.extend(fields.iter().map(|field| (optimizer_state_name(name, field), shape.clone())));
        }
        let report = file.match_state_dict(&expected, |_| false);
        if !report.is_exact() {
            return Err(report.into_error(path));
        }
        refuse_non_finite(&file)?;
        check_optimizer_state(&file, &parameters)?;
        // An f16 run's loss scale, when the file has one (a file of another precision starts the
        // scale afresh, as a new GradScaler).
        let loss_scale: Option<(f32, u32)> = match (&self.loss_scaler, file.metadata().contains_key(LOSS_SCALE_KEY)) {
            (Some(_), true) => {
                let scale: f32 = file.metadata_value(LOSS_SCALE_KEY)?;
                if !(scale.is_finite() && scale > 0.0) {
                    return Err(Error::Checkpoint {
                        path: path.display().to_string(),
                        reason: format!("metadata `{LOSS_SCALE_KEY}` = {scale}: a loss scale is positive and finite"),
                    });
                }
                Some((scale, file.metadata_value(LOSS_SCALE_GOOD_STEPS_KEY)?))
            }
            _ => None,
        };
        let (step_idx, seed): (u64, u64) = match fallback {
            Some((step_idx, seed)) if !file.metadata().contains_key(STEP_KEY) => {
                let seed = if file.metadata().contains_key(SEED_KEY) { file.metadata_value(SEED_KEY)? } else { seed };
                (step_idx, seed)
            }
            _ => (file.metadata_value(STEP_KEY)?, file.metadata_value(SEED_KEY)?),
        };
        let weights: Vec<(String, Tensor)> =
            parameters.iter().filter_map(|(name, _)| file.take(name).map(|t| (name.clone(), t))).collect();
        self.load_parameters(weights)?;
        let metadata: Vec<(String, String)> = file.metadata().clone().into_iter().collect();
        self.load_optimizer_state(file)?;
        self.step_idx = step_idx;
        self.seed = seed;
        if let (Some(scaler), Some((scale, good_steps))) = (self.loss_scaler.as_mut(), loss_scale) {
            scaler.restore(scale, good_steps);
        }
        for (key, value) in metadata {
            if !RESERVED_METADATA_KEYS.contains(&key.as_str()) {
                self.metadata.entry(key).or_insert(value);
            }
        }
        Ok(())
    }

    /// Every parameter's unsplit name and shape, and the optimizer's state fields.
    fn state_shapes(&self) -> Result<StateShapes> {
        let parts = self.on_first_replica(|stages| {
            let mut shapes = Vec::new();
            for stage in stages.iter() {
                for node in &stage.nodes {
                    let exported = node.layer.export_parameter_shapes();
                    shapes.extend(exported.into_iter().map(|(name, shape)| (format!("{}.{name}", node.name), shape)));
                }
            }
            (shapes, stages.first().map(|stage| stage.optimizer.config().state_tensor_fields()))
        })?;
        let fields = parts.iter().find_map(|(_, fields)| *fields).unwrap_or(&[]);
        let mut shapes: Vec<(String, Shape)> = parts.into_iter().flat_map(|(shapes, _)| shapes).collect();
        if self.transport.world_size() > 1 {
            shapes = self.gather_shapes(&shapes)?;
        }
        shapes.sort_by_key(|(name, _)| self.param_order.iter().position(|o| o == name).unwrap_or(usize::MAX));
        Ok(StateShapes { parameters: shapes, fields })
    }

    /// Every rank's named shapes (a collective).
    fn gather_shapes(&self, local: &[(String, Shape)]) -> Result<Vec<(String, Shape)>> {
        // Shard 0's ranks speak for their stages (see `gather_named`).
        let local = if self.shard == 0 { local } else { &[] };
        let mut all = Vec::new();
        for part in self.transport.all_gather(crate::runtime::ranks::encode_shapes(local), self.collective_timeout())? {
            all.extend(crate::runtime::ranks::decode_shapes(&part)?);
        }
        Ok(all)
    }

    /// An [`Error::Poisoned`] when the parameters are no longer one step's (nothing to save).
    fn refuse_if_poisoned(&self) -> Result<()> {
        match &self.poisoned {
            Some(reason) => Err(Error::Poisoned { reason: reason.clone() }),
            None => Ok(()),
        }
    }
}

/// What a trainer's files hold, by name and shape.
struct StateShapes {
    /// Every parameter's unsplit name and shape, in graph order.
    parameters: Vec<(String, Shape)>,
    /// The optimizer's state fields beside the step (every stage's optimizer has the builder's
    /// configuration).
    fields: &'static [&'static str],
}

/// Writes `tensors` and `metadata` to `path` atomically.
fn write(path: &Path, tensors: &[(String, Tensor)], metadata: &BTreeMap<String, String>) -> Result<()> {
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    checkpoint::save_with_metadata(path, &named, metadata)
}

/// An [`Error::NonFiniteCheckpoint`] when a held tensor holds NaN or infinity.
fn refuse_non_finite(file: &Checkpoint) -> Result<()> {
    match file.first_non_finite()? {
        None => Ok(()),
        Some(found) => {
            Err(Error::NonFiniteCheckpoint { path: file.path().display().to_string(), found: Box::new(found) })
        }
    }
}

/// An [`Error::Checkpoint`] when an optimizer-state tensor is not f32 or a step count is not a
/// whole number (checked before a restore changes anything; shapes are checked already).
fn check_optimizer_state(file: &Checkpoint, parameters: &[(String, Shape)]) -> Result<()> {
    for name in file.names().filter(|n| n.starts_with(OPTIMIZER_STATE_PREFIX)) {
        let tensor = file.get(name).expect("a held name");
        if tensor.dtype() != DType::F32 {
            return Err(file.error(format!(
                "tensor `{name}` is {} {} but optimizer state is f32; save it as f32",
                tensor.dtype(),
                tensor.shape()
            )));
        }
    }
    for (parameter, _) in parameters {
        let name = optimizer_state_name(parameter, STEP);
        let step = file.get(&name).expect("checked present").as_f32()?[0];
        if !(step >= 0.0 && step.fract() == 0.0) {
            return Err(file.error(format!("tensor `{name}` holds {step}, which is not a step count")));
        }
    }
    Ok(())
}
