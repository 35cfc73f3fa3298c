//! The flags of `conveyor train` and their parsers (sizes, devices, optimizers, learning-rate
//! schedules), shared with `conveyor plan`.
use std::path::PathBuf;

use clap::Args;
use conveyor::engine::Device;
use conveyor::engine::optim::{AdamConfig, OptimizerConfig, SgdConfig};

use crate::cli::usage;

/// Arguments of `conveyor train`.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Model: `mlp:D0,D1,...,Dn` (Linear/ReLU stack), `cnn` (LeNet-like, 1x8x8 inputs), `resnet` or
    /// `transformer[:VOCAB,T,D,H,L,C]`. Default: the checkpoint's model with --resume, `cnn` for
    /// 1x8x8 images, else `mlp:D,128,128,C` over the flattened inputs.
    #[arg(long)]
    pub model: Option<String>,
    /// Data: `digits` (built in: 1,437 train and 360 test images), `synthetic:N,D,C` (N samples,
    /// D features, C classes, seeded by --seed), `tokens:N,T,VOCAB,C` (N sequences of T token ids,
    /// labelled by their first token mod C; the default model is then a transformer), a `FILE.safetensors` holding `inputs` f32 [N, ...]
    /// and `labels` i64 [N], or an MNIST directory of IDX files (train-images-idx3-ubyte,
    /// train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each optionally .gz;
    /// pixels scaled to [0, 1]).
    #[arg(long, default_value = "digits")]
    pub data: String,
    /// Hold out this fraction of the rows of a data file or synthetic data for evaluation, taken
    /// from the END of the data (digits and MNIST have their own test split).
    #[arg(long, value_name = "F")]
    pub test_fraction: Option<f64>,
    /// Number of classes of a data file (default: the largest label plus one); a label at or above
    /// it is an error.
    #[arg(long, value_name = "C")]
    pub classes: Option<usize>,
    /// Devices: `cpu:N` for N CPU devices (one core each), a list such as `cpu:0,cpu:1` or
    /// `cuda:0,1`, or `list` to print the available devices and exit.
    #[arg(long, default_value = "cpu:2")]
    pub devices: String,
    /// Memory budget of each device, e.g. `512MiB` or `2GiB` (default: unlimited).
    #[arg(long, value_name = "SIZE")]
    pub device_memory: Option<String>,
    /// Pipeline stages per chunk; default one per device (per group of --tensor-parallel
    /// devices). Uses the first P (x K) devices.
    #[arg(long)]
    pub stages: Option<usize>,
    /// Split every Linear and Conv2d of each stage across a group of K devices (Megatron
    /// column/row pairs, channel-split convolutions); stages x K must not exceed the devices.
    #[arg(long, value_name = "K", default_value_t = 1)]
    pub tensor_parallel: usize,
    /// Placement of layers on stages: `auto` (minimise the slowest stage under the budgets, from
    /// FLOP estimates), `time` (the same from layer times measured on this machine first:
    /// balance by time), or a file as `conveyor plan --placement` reads: one line per stage
    /// listing node names or ranges `first..last` separated by spaces (`#` starts a comment).
    #[arg(long, value_name = "auto|time|FILE", default_value = "auto")]
    pub placement: String,
    /// Schedule: gpipe, 1f1b, interleaved, zb-h1 or zb-h2.
    #[arg(long, default_value = "1f1b")]
    pub schedule: String,
    /// Model chunks per device (interleaved schedule only).
    #[arg(long, default_value_t = 1)]
    pub chunks: usize,
    /// Micro-batches per batch.
    #[arg(long, default_value_t = 8)]
    pub microbatches: usize,
    /// Rows per batch (one optimizer step).
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Total optimizer steps (overrides --epochs; with --resume, the total including the steps
    /// already taken). 0 trains nothing (with --init and --save: convert a file).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Passes over the training data (when --steps is not given).
    #[arg(long, default_value_t = 30)]
    pub epochs: u64,
    /// Optimizer: sgd, momentum (SGD with momentum 0.9, or --momentum), adam or adamw.
    #[arg(long, default_value = "adam")]
    pub optimizer: String,
    /// Learning rate (default 0.005 for adam/adamw, 0.05 for sgd/momentum).
    #[arg(long, allow_negative_numbers = true)]
    pub lr: Option<f64>,
    /// Learning-rate schedule over the run's total steps, stepped after every optimizer step as
    /// torch's schedulers are: `constant`, `cosine` (CosineAnnealingLR with T_max = total steps,
    /// eta_min 0) or `step:N,GAMMA` (StepLR: multiply by GAMMA every N steps).
    #[arg(long, value_name = "NAME", default_value = "cosine")]
    pub lr_schedule: String,
    /// Momentum for `--optimizer momentum` (default 0.9).
    #[arg(long)]
    pub momentum: Option<f64>,
    /// Weight decay (L2 for sgd/adam, decoupled for adamw).
    #[arg(long, allow_negative_numbers = true)]
    pub weight_decay: Option<f64>,
    /// Activation recomputation: never, except-last or always.
    #[arg(long, default_value = "never")]
    pub recompute: String,
    /// Core slots for CPU workers: auto (one per core when workers outnumber cores), off (let the
    /// OS share the cores), or a number (at most that many ops compute at once, first come first
    /// served).
    #[arg(long, default_value = "auto")]
    pub core_slots: String,
    /// Seed for initialisation, shuffling, synthetic data and dropout.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Take batches in data order from the first row instead of shuffling.
    #[arg(long)]
    pub no_shuffle: bool,
    /// Start from these parameters (a safetensors file with PyTorch state-dict names, e.g. from
    /// `safetensors.torch.save_file(model.state_dict(), FILE)`); names and shapes must match the
    /// model exactly.
    #[arg(long, value_name = "FILE")]
    pub init: Option<PathBuf>,
    /// Continue from a checkpoint written by --checkpoint, up to --steps total, with the
    /// optimizer state, step count and data position restored.
    #[arg(long, value_name = "FILE")]
    pub resume: Option<PathBuf>,
    /// Save the trained model here at the end (atomically): exactly a PyTorch state dict, the
    /// parameters under their PyTorch names (`model.load_state_dict(load_file(FILE))`).
    #[arg(long, value_name = "FILE")]
    pub save: Option<PathBuf>,
    /// Write a training checkpoint here at the end (atomically) for --resume: the parameters, the
    /// optimizer state as `optimizer.<param>.<field>`, and the run's position as metadata.
    #[arg(long, value_name = "FILE")]
    pub checkpoint: Option<PathBuf>,
    /// Also write the --checkpoint file every N steps during the run.
    #[arg(long, value_name = "N")]
    pub checkpoint_every: Option<u64>,
    /// Measure accuracy on the held-out split every N steps (printed and in the metrics file).
    #[arg(long, value_name = "N")]
    pub eval_every: Option<u64>,
    /// Write one JSON object per optimizer step to this file, then a summary object.
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Write a Chrome / Perfetto trace of every op of the whole run (open in ui.perfetto.dev).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Write an SVG Gantt chart of the last step: one row per device, bubbles marked.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Print a progress line every this many steps (0: only the summary).
    #[arg(long, default_value_t = 100)]
    pub log_every: u64,
    /// What a step whose loss or gradients are not finite (NaN or infinity) does; such a step is
    /// never committed. `error`: stop, naming the step, the stage and the first parameter affected,
    /// still write --save/--checkpoint from the last good step, exit status 3. `skip[:N]`: skip the
    /// step like a loss scaler (its batch is consumed, the parameters stay), count it in the
    /// metrics, and stop as `error` does after N skipped steps in a row (default 10).
    #[arg(long, value_name = "POLICY", default_value = "error")]
    pub on_nonfinite: String,
}

/// `--on-nonfinite`: what a step with a non-finite loss or gradient does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnNonFinite {
    /// Stop the run (after writing the outputs from the last good step).
    Error,
    /// Skip the step; stop after this many skipped in a row.
    Skip { max_in_a_row: u64 },
}

impl std::str::FromStr for OnNonFinite {
    type Err = anyhow::Error;
    fn from_str(text: &str) -> anyhow::Result<Self> {
        let bad =
            || usage(format!("--on-nonfinite `{text}`: use error, skip or skip:N with N at least 1 (e.g. skip:5)"));
        match text.split_once(':') {
            None if text == "error" => Ok(OnNonFinite::Error),
            None if text == "skip" => Ok(OnNonFinite::Skip { max_in_a_row: 10 }),
            Some(("skip", n)) => {
                let max_in_a_row = n.trim().parse().ok().filter(|&n: &u64| n > 0).ok_or_else(bad)?;
                Ok(OnNonFinite::Skip { max_in_a_row })
            }
            _ => Err(bad()),
        }
    }
}

/// Parses a size like `512MiB`, `2GiB`, `1000000` (bytes), `64KiB`, `1.5GB`.
pub fn parse_size(text: &str) -> anyhow::Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 =
        number.parse().map_err(|_| usage(format!("--device-memory `{text}`: expected a size like 512MiB or 2GiB")))?;
    let factor = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" | "k" => 1024.0,
        "mib" | "m" => 1024.0 * 1024.0,
        "gib" | "g" => 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        other => {
            return Err(usage(format!("--device-memory `{text}`: unknown unit `{other}`; use B, KiB, MiB or GiB")));
        }
    };
    if value <= 0.0 || !value.is_finite() {
        return Err(usage(format!("--device-memory `{text}`: the size must be positive")));
    }
    Ok((value * factor) as u64)
}

/// Parses `cpu:N` (N devices), `cuda:0,1` (a list of GPUs) or a list of single devices such as
/// `cpu:0,cpu:1` or `cpu:0,cuda:0`, each with the budget.
pub fn parse_devices(spec: &str, budget: Option<u64>) -> anyhow::Result<Vec<Device>> {
    let bad = || {
        usage(format!(
            "--devices `{spec}`: use cpu:N for N CPU devices, cuda:0,1 for GPUs, a list such as cpu:0,cpu:1, or list"
        ))
    };
    let items: Vec<&str> = spec.split(',').map(str::trim).collect();
    if items.len() > 1 && items.iter().all(|item| item.contains(':')) {
        let devices = items
            .iter()
            .map(|item| Device::parse(item, budget).map_err(|e| usage(format!("--devices `{spec}`: {e}"))))
            .collect::<anyhow::Result<Vec<_>>>()?;
        for (i, device) in devices.iter().enumerate() {
            if devices[..i].iter().any(|d| d.to_string() == device.to_string()) {
                return Err(usage(format!("--devices `{spec}`: {device} is listed twice; list each device once")));
            }
        }
        return Ok(devices);
    }
    let (kind, rest) = spec.split_once(':').ok_or_else(bad)?;
    match kind {
        "cpu" => {
            let n: usize = rest.trim().parse().map_err(|_| bad())?;
            if n == 0 {
                return Err(usage(format!("--devices `{spec}`: at least one device is needed")));
            }
            Ok((0..n).map(|i| Device::cpu_with_budget(i, budget)).collect())
        }
        "cuda" => rest
            .split(',')
            .map(|idx| {
                let ordinal: usize = idx.trim().parse().map_err(|_| bad())?;
                Device::cuda(ordinal, budget).map_err(|e| usage(e.to_string()))
            })
            .collect(),
        _ => Err(bad()),
    }
}

/// Parses the optimizer flags into a configuration, refusing invalid values with exit code 2.
pub fn parse_optimizer(
    name: &str,
    lr: Option<f64>,
    momentum: Option<f64>,
    weight_decay: Option<f64>,
) -> anyhow::Result<OptimizerConfig> {
    let wd = weight_decay.unwrap_or(0.0);
    let config = match name {
        "sgd" => OptimizerConfig::Sgd(SgdConfig::new(lr.unwrap_or(0.05)).with_weight_decay(wd)),
        "momentum" => OptimizerConfig::Sgd(
            SgdConfig::new(lr.unwrap_or(0.05)).with_momentum(momentum.unwrap_or(0.9)).with_weight_decay(wd),
        ),
        "adam" => OptimizerConfig::Adam(AdamConfig::adam(lr.unwrap_or(0.005)).with_weight_decay(wd)),
        "adamw" => OptimizerConfig::AdamW(
            AdamConfig::adamw(lr.unwrap_or(0.005)).with_weight_decay(weight_decay.unwrap_or(0.01)),
        ),
        other => return Err(usage(format!("--optimizer `{other}`: use sgd, momentum, adam or adamw"))),
    };
    config.validate().map_err(|e| usage(format!("--lr/--momentum/--weight-decay: {e}")))?;
    Ok(config)
}

/// A learning-rate schedule with torch's semantics: the rate of step `t` (0-based) of `total`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LrSchedule {
    /// The base rate throughout.
    Constant,
    /// `CosineAnnealingLR(T_max = total, eta_min = 0)`: `base · (1 + cos(π·t / total)) / 2`.
    Cosine,
    /// `StepLR(step_size, gamma)`: `base · gamma^⌊t / step_size⌋`.
    Step {
        /// Steps between decays.
        step_size: u64,
        /// Factor per decay.
        gamma: f64,
    },
}

impl LrSchedule {
    /// The learning rate of step `step_idx` of a run of `total_steps`.
    pub fn lr(&self, base: f64, step_idx: u64, total_steps: u64) -> f64 {
        match *self {
            LrSchedule::Constant => base,
            LrSchedule::Cosine => {
                let t = step_idx.min(total_steps) as f64 / total_steps.max(1) as f64;
                base * (1.0 + (std::f64::consts::PI * t).cos()) / 2.0
            }
            LrSchedule::Step { step_size, gamma } => base * gamma.powi((step_idx / step_size) as i32),
        }
    }
}

impl std::str::FromStr for LrSchedule {
    type Err = anyhow::Error;
    fn from_str(text: &str) -> anyhow::Result<Self> {
        let bad = || usage(format!("--lr-schedule `{text}`: use constant, cosine or step:N,GAMMA (e.g. step:100,0.5)"));
        match text.split_once(':') {
            None if text == "constant" => Ok(LrSchedule::Constant),
            None if text == "cosine" => Ok(LrSchedule::Cosine),
            Some(("step", rest)) => {
                let (n, gamma) = rest.split_once(',').ok_or_else(bad)?;
                let step_size: u64 = n.trim().parse().ok().filter(|&n| n > 0).ok_or_else(bad)?;
                let gamma: f64 =
                    gamma.trim().parse().ok().filter(|g: &f64| g.is_finite() && *g > 0.0).ok_or_else(bad)?;
                Ok(LrSchedule::Step { step_size, gamma })
            }
            _ => Err(bad()),
        }
    }
}

impl std::fmt::Display for LrSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LrSchedule::Constant => f.write_str("constant"),
            LrSchedule::Cosine => f.write_str("cosine"),
            LrSchedule::Step { step_size, gamma } => write!(f, "step:{step_size},{gamma}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_follow_torch() {
        let cosine: LrSchedule = "cosine".parse().unwrap();
        assert_eq!(cosine.lr(0.1, 0, 10), 0.1);
        assert!((cosine.lr(0.1, 5, 10) - 0.05).abs() < 1e-12);
        let step: LrSchedule = "step:3,0.5".parse().unwrap();
        assert_eq!([0, 2, 3, 6].map(|t| step.lr(1.0, t, 10)), [1.0, 1.0, 0.5, 0.25]);
        assert_eq!(step.to_string().parse::<LrSchedule>().unwrap(), step);
        assert!("linear".parse::<LrSchedule>().is_err());
    }

    #[test]
    fn device_lists() {
        let devices = parse_devices("cpu:0,cpu:1", None).unwrap();
        assert_eq!(devices.iter().map(ToString::to_string).collect::<Vec<_>>(), ["cpu:0", "cpu:1"]);
        assert_eq!(parse_devices("cpu:3", None).unwrap().len(), 3);
        assert!(parse_devices("cpu:0,cpu:0", None).is_err());
        assert!(parse_devices("tpu:0,cpu:1", None).is_err());
    }
}
