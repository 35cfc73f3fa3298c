//! Saved models (`--save`: a PyTorch state dict), training checkpoints (`--checkpoint`,
//! `--checkpoint-every`, `--resume`) and `--init`.
//!
//! The files are the trainer's: `--save` is `Trainer::save` (a PyTorch state dict), `--checkpoint`
//! is `Trainer::checkpoint` (weights, every stage's optimizer state as
//! `optimizer.<param>.<field>`, the step index and seed), `--resume` is `Trainer::restore` and
//! `--init` is `Trainer::load`; each is written atomically, so a save that fails or is killed
//! midway leaves the previous file whole. This module adds what only the command line knows:
//!
//! - metadata under `conveyor.train.*` ([`RunState`]), stored as the trainer's metadata before
//!   each save: the step count, epoch and batch within the epoch (the data position: a shuffled
//!   epoch's order is a function of the seed and the epoch), the seed, batch size, micro-batches,
//!   shuffling, training rows and a fingerprint of their contents, model spec, data, optimizer,
//!   learning rate and its schedule, momentum and weight decay. A resume that would change any of
//!   these (other than the position and the total) is refused with the list of differences; see
//!   `conveyor::cli_input::RunState` for what may change.
//! - the messages: each library error becomes a usage error (exit status 2) naming the flag and
//!   the file, and saying what to do.
//!
//! Resuming restores the parameters, every stage's optimizer state, the trainer's step index
//! (dropout masks derive from it) and the data position, so a resumed run continues bit for bit
//! as the uninterrupted one would have.
//!
//! `--init` and `--resume` refuse a file with NaN or infinity in any tensor they load (parameters,
//! and for `--resume` the optimizer state), naming the file, the tensor and the element (exit
//! status 2): every step trained from it would be non-finite, and the trainer would refuse each one.
use std::path::Path;

use conveyor::engine::Error;
use conveyor::engine::checkpoint;
use conveyor::engine::runtime::Trainer;

pub use conveyor::cli_input::RunState;

use crate::cli::usage;

/// Reads just the model spec a checkpoint was saved with (to build the model before resuming),
/// from the file's header.
pub fn model_of(path: &Path) -> anyhow::Result<String> {
    let metadata = checkpoint::read_metadata(path).map_err(|e| usage(format!("--resume {}: {e}", path.display())))?;
    Ok(RunState::from_metadata(&metadata, &path.display().to_string())?.model)
}

/// The usage error (exit status 2) for a file that `flag` cannot load, or the error itself when
/// the file is not to blame; `fix` says what to do about non-finite values.
fn load_error(error: Error, flag: &str, path: &Path, fix: &str) -> anyhow::Error {
    match error {
        Error::NonFiniteCheckpoint { found, .. } => {
            usage(format!("{flag} {}: {found}; every step trained from it would be non-finite: {fix}", path.display()))
        }
        e @ Error::StateDictMismatch { .. } => usage(format!("{flag}: {e}")),
        e @ (Error::Checkpoint { .. } | Error::Io { .. }) => usage(format!("{flag} {}: {e}", path.display())),
        other => anyhow::Error::new(other),
    }
}

/// Saves parameters, optimizer state (unless `weights_only`) and the run state to `path`,
/// atomically; `flag` names the option in errors.
pub fn save(
    path: &Path,
    trainer: &mut Trainer,
    state: &RunState,
    weights_only: bool,
    flag: &str,
) -> anyhow::Result<()> {
    for (key, value) in state.to_metadata() {
        trainer.set_metadata(key, value)?;
    }
    let saved = if weights_only { trainer.save(path) } else { trainer.checkpoint(path) };
    saved.map_err(|e| match e {
        Error::OutputPath { reason, .. } => usage(format!("{flag} {}: {reason}", path.display())),
        Error::Io { .. } => {
            usage(format!("{flag} {}: {e}; the previous checkpoint there is unchanged", path.display()))
        }
        other => anyhow::Error::new(other),
    })
}

/// Restores a checkpoint into `trainer`: checks its run state matches `expected` in everything
/// that decides the training's arithmetic ([`RunState::differences`]), then restores parameters,
/// every stage's optimizer state and the step index ([`Trainer::restore`]: strictly, and only
/// from finite values). Returns the checkpoint's run state.
pub fn resume(path: &Path, trainer: &mut Trainer, expected: &RunState) -> anyhow::Result<RunState> {
    let metadata = checkpoint::read_metadata(path).map_err(|e| usage(format!("--resume {}: {e}", path.display())))?;
    let saved = RunState::from_metadata(&metadata, &path.display().to_string())?;
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
    // A checkpoint of an earlier version keeps its step and seed only in the run state.
    trainer.restore_with_position(path, saved.step, saved.seed).map_err(|e| {
        let fix =
            "resume from an earlier checkpoint of the run, saved before it diverged (or start again without --resume)";
        load_error(e, "--resume", path, fix)
    })?;
    Ok(saved)
}

/// `--init`: loads parameters with PyTorch names ([`Trainer::load`]: exactly the model's
/// parameters with their shapes, any float dtype converted to the model's, all finite). Returns
/// how many tensors it loaded.
pub fn init(path: &Path, trainer: &mut Trainer) -> anyhow::Result<usize> {
    trainer.load(path).map_err(|e| {
        let fix = "save the weights again from a model whose parameters are all finite (or train without --init)";
        load_error(e, "--init", path, fix)
    })?;
    Ok(trainer.parameter_names().len())
}
