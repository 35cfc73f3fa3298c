//! Checks of `conveyor train`'s counts before anything is built from them: the pipeline's layout
//! (`--stages`, `--tensor-parallel`, `--chunks` against the devices) and the run's length
//! (`--steps`, `--epochs`), with checked arithmetic and the limits of `conveyor::limits`.
use conveyor::engine::optim::OptimizerConfig;
use conveyor::limits::{MAX_DEVICES, MAX_STAGES, MAX_STEPS};

use crate::cli::usage;

/// How many devices the run uses: `--stages` x `--tensor-parallel` of the `n_devices` given
/// (all of them without `--stages`), after checking the counts and that the pipeline, devices x
/// `--chunks` stages, is within [`MAX_STAGES`].
pub fn devices_used(
    stages: Option<usize>,
    tensor_parallel: usize,
    chunks: usize,
    devices_flag: &str,
    n_devices: usize,
) -> anyhow::Result<usize> {
    let k = tensor_parallel;
    if k == 0 {
        return Err(usage("--tensor-parallel 0: each stage needs at least 1 device; give --tensor-parallel 1 or more"));
    }
    if k > MAX_DEVICES {
        return Err(usage(format!(
            "--tensor-parallel {k} is over the limit of {MAX_DEVICES} devices (MAX_DEVICES); give at most the devices of --devices"
        )));
    }
    let used = match stages {
        None => n_devices,
        Some(0) => {
            return Err(usage(
                "--stages 0: a pipeline needs at least 1 stage; give --stages 1 or more, or leave it out for one stage per device",
            ));
        }
        Some(stages) => {
            let needed = stages.checked_mul(k).filter(|&n| n <= MAX_DEVICES).ok_or_else(|| {
                usage(format!(
                    "--stages {stages} with --tensor-parallel {k} needs more than {MAX_DEVICES} devices, the limit (MAX_DEVICES); give fewer stages"
                ))
            })?;
            if needed > n_devices {
                return Err(usage(format!(
                    "--stages {stages} with --tensor-parallel {k} needs {needed} devices but --devices {devices_flag} gives {n_devices}; \
                     give more devices or fewer stages"
                )));
            }
            needed
        }
    };
    let pipeline_stages = (used / k).checked_mul(chunks).filter(|&n| n <= MAX_STAGES);
    if pipeline_stages.is_none() {
        return Err(usage(format!(
            "--chunks {chunks} on {} pipeline devices makes more than {MAX_STAGES} stages, the limit (MAX_STAGES); give fewer chunks",
            used / k
        )));
    }
    Ok(used)
}

/// The run's total optimizer steps: `--steps`, or `--epochs` x `steps_per_epoch`; at most
/// [`MAX_STEPS`], never wrapped around.
pub fn total_steps(steps: Option<u64>, epochs: u64, steps_per_epoch: u64) -> anyhow::Result<u64> {
    let (total, from) = match steps {
        Some(steps) => (Some(steps), format!("--steps {steps}")),
        None => (
            epochs.checked_mul(steps_per_epoch),
            format!("--epochs {epochs} of {steps_per_epoch} steps (training rows / --batch)"),
        ),
    };
    match total {
        Some(total) if total <= MAX_STEPS => Ok(total),
        _ => Err(usage(format!(
            "{from} is over the limit of {MAX_STEPS} optimizer steps (MAX_STEPS); give fewer steps or epochs"
        ))),
    }
}

/// The momentum and weight decay the optimizer runs with (recorded in checkpoints so a resume
/// with other values is refused).
pub fn hyperparameters(optimizer: &OptimizerConfig) -> (f64, f64) {
    match optimizer {
        OptimizerConfig::Sgd(sgd) => (sgd.momentum, sgd.weight_decay),
        OptimizerConfig::Adam(adam) | OptimizerConfig::AdamW(adam) => (0.0, adam.weight_decay),
    }
}
