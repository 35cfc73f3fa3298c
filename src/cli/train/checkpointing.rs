//! Saved models (`--save`: a PyTorch state dict), training checkpoints (`--checkpoint`,
//! `--checkpoint-every`, `--resume`) and `--init`.
//!
//! A checkpoint is one safetensors file written atomically by
//! [`conveyor::engine::checkpoint::save_with_metadata`] (temporary file, fsync, rename; see
//! `conveyor::engine::output_file` for symbolic links and devices), so a save that fails or is
//! killed midway leaves the previous file whole. It holds:
//!
//! - the parameters under PyTorch's state-dict names (`0.weight`, `conv1.bias`, ...);
//! - the optimizer state as `optimizer.<param>.<field>` (see `conveyor::engine::optim`);
//! - metadata under `conveyor.train.*` ([`RunState`]): the step count, epoch and batch within the
//!   epoch (the data position: a shuffled epoch's order is a function of the seed and the epoch),
//!   the seed, batch size, micro-batches, shuffling, training rows and a fingerprint of their
//!   contents, model spec, data, optimizer, learning rate and its schedule, momentum and weight
//!   decay. A resume that would change any of these (other than the position and the total) is
//!   refused with the list of differences; see `conveyor::cli_input::RunState` for what may change.
//!
//! Resuming restores the parameters, every stage's optimizer state, the trainer's step index
//! (dropout masks derive from it) and the data position, so a resumed run continues bit for bit
//! as the uninterrupted one would have.
//!
//! `--init` and `--resume` refuse a file with NaN or infinity in any tensor (parameters or
//! optimizer state), naming the file, the tensor and the element (exit status 2): every step
//! trained from it would be non-finite, and the trainer would refuse each one.
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use conveyor::engine::checkpoint::{self, Checkpoint, TensorSpec};
use conveyor::engine::optim::{OptimizerConfig, STEP, optimizer_state_name};
use conveyor::engine::placement::Plan;
use conveyor::engine::runtime::Trainer;
use conveyor::engine::{DType, Device, Shape, Tensor};

pub use conveyor::cli_input::RunState;

use crate::cli::usage;

/// Reads just the model spec a checkpoint was saved with (to build the model before resuming).
pub fn model_of(path: &Path) -> anyhow::Result<String> {
    let checkpoint = load(path, "--resume")?;
    Ok(RunState::from_metadata(checkpoint.metadata(), &path.display().to_string())?.model)
}

fn load(path: &Path, flag: &str) -> anyhow::Result<Checkpoint> {
    checkpoint::load(path, &Device::host()).map_err(|e| usage(format!("{flag} {}: {e}", path.display())))
}

/// A usage error when any tensor of `checkpoint` holds NaN or infinity, naming the file, the first
/// such tensor (name order) and element, and `fix`.
fn refuse_non_finite(checkpoint: &Checkpoint, flag: &str, fix: &str) -> anyhow::Result<()> {
    match checkpoint.first_non_finite()? {
        None => Ok(()),
        Some(found) => Err(usage(format!(
            "{flag} {}: {found}; every step trained from it would be non-finite: {fix}",
            checkpoint.path().display()
        ))),
    }
}

/// Each parameter's shape and the device its stage runs on.
pub struct ParamHomes(Arc<HashMap<String, (Shape, Device)>>);

impl ParamHomes {
    /// From the trainer's parameters and the plan that placed their nodes.
    pub fn new(trainer: &Trainer, plan: &Plan) -> anyhow::Result<ParamHomes> {
        let mut homes = HashMap::new();
        for (name, tensor) in trainer.parameters()? {
            // The node is the longest stage node name that prefixes `name` followed by a dot.
            let home = plan
                .stages
                .iter()
                .flat_map(|s| s.node_names.iter().map(move |n| (s.stage_idx, n)))
                .filter(|(_, node)| name.strip_prefix(node.as_str()).is_some_and(|rest| rest.starts_with('.')))
                .max_by_key(|(_, node)| node.len())
                .map(|(stage_idx, _)| trainer.devices()[trainer.schedule().device_of_stage(stage_idx)].clone())
                .ok_or_else(|| anyhow::anyhow!("parameter `{name}` belongs to no stage of the plan"))?;
            homes.insert(name, (tensor.shape().clone(), home));
        }
        Ok(ParamHomes(Arc::new(homes)))
    }
}

/// Saves parameters, optimizer state (unless `weights_only`) and the run state to `path`,
/// atomically; `flag` names the option in errors.
pub fn save(path: &Path, trainer: &Trainer, state: &RunState, weights_only: bool, flag: &str) -> anyhow::Result<()> {
    let mut tensors: Vec<(String, Tensor)> = trainer.parameters()?;
    if !weights_only {
        // Under the unsplit names, so the file does not depend on --tensor-parallel.
        tensors.extend(trainer.optimizer_state()?);
    }
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    checkpoint::save_with_metadata(path, &named, &state.to_metadata()).map_err(|e| match e {
        conveyor::engine::Error::OutputPath { reason, .. } => usage(format!("{flag} {}: {reason}", path.display())),
        conveyor::engine::Error::Io { .. } => {
            usage(format!("{flag} {}: {e}; the previous checkpoint there is unchanged", path.display()))
        }
        other => anyhow::Error::new(other),
    })
}

/// Restores a checkpoint into `trainer`: checks its run state matches `expected` in everything
/// that decides the training's arithmetic ([`RunState::differences`]) and that every tensor is
/// finite, then loads parameters and every
/// stage's optimizer state strictly and sets the step index. Returns the checkpoint's run state.
pub fn resume(
    path: &Path,
    trainer: &mut Trainer,
    homes: &ParamHomes,
    optimizer: &OptimizerConfig,
    expected: &RunState,
) -> anyhow::Result<RunState> {
    let mut checkpoint = load(path, "--resume")?;
    let saved = RunState::from_metadata(checkpoint.metadata(), &path.display().to_string())?;
    let differences = saved.differences(expected);
    if !differences.is_empty() {
        return Err(usage(format!(
            "--resume {}: the checkpoint was saved by a different run, and continuing it with these flags \
             would not train as that run would ({}); give the same flags to continue it (what may change: \
             --steps, --epochs, outputs, evaluation, logging, devices, stages, schedule, placement)",
            path.display(),
            differences.join("; ")
        )));
    }
    let mut expected_tensors: Vec<TensorSpec> = Vec::new();
    let mut param_names: Vec<String> = homes.0.keys().cloned().collect();
    param_names.sort();
    for name in &param_names {
        let shape = homes.0[name].0.clone();
        expected_tensors.push(TensorSpec::new(name.clone(), shape.clone(), DType::F32));
        expected_tensors.push(TensorSpec::new(optimizer_state_name(name, STEP), Shape::new(Vec::new()), DType::F32));
        for field in optimizer.state_tensor_fields() {
            expected_tensors.push(TensorSpec::new(optimizer_state_name(name, field), shape.clone(), DType::F32));
        }
    }
    checkpoint.check_exact(&expected_tensors).map_err(|e| usage(format!("--resume: {e}")))?;
    refuse_non_finite(
        &checkpoint,
        "--resume",
        "resume from an earlier checkpoint of the run, saved before it diverged (or start again without --resume)",
    )?;
    let params: Vec<(String, Tensor)> =
        param_names.iter().filter_map(|name| checkpoint.take(name).map(|t| (name.clone(), t))).collect();
    trainer.load_parameters(params)?;
    trainer.load_optimizer_state(checkpoint).map_err(|e| usage(format!("--resume: {e}")))?;
    trainer.set_step_idx(saved.step);
    Ok(saved)
}

/// `--init`: loads parameters with PyTorch names after checking the file holds exactly the model's
/// parameters with their shapes (any float dtype; converted to the model's), all finite.
pub fn init(path: &Path, trainer: &mut Trainer) -> anyhow::Result<usize> {
    let checkpoint = load(path, "--init")?;
    let expected: Vec<TensorSpec> = trainer
        .parameters()?
        .iter()
        .map(|(name, tensor)| {
            let dtype = checkpoint.get(name).map_or(DType::F32, Tensor::dtype);
            TensorSpec::new(name.clone(), tensor.shape().clone(), dtype)
        })
        .collect();
    checkpoint.check_exact(&expected).map_err(|e| usage(format!("--init: {e}")))?;
    refuse_non_finite(
        &checkpoint,
        "--init",
        "save the weights again from a model whose parameters are all finite (or train without --init)",
    )?;
    let tensors: Vec<(String, Tensor)> = checkpoint.into_tensors().into_iter().collect();
    let n = tensors.len();
    trainer.load_parameters(tensors)?;
    Ok(n)
}
