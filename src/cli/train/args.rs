//! The flags of `conveyor train` and their parsers (sizes, devices, optimizers, learning-rate
//! schedules), shared with `conveyor plan`.
use std::path::PathBuf;

use clap::Args;
pub use conveyor::cli_input::{LrSchedule, OnNonFinite, parse_devices, parse_size};
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
    /// it is an error. At most 2^20 (1,048,576), and so are labels.
    #[arg(long, value_name = "C")]
    pub classes: Option<usize>,
    /// Devices: `cpu:N` for N CPU devices (one core each), a list such as `cpu:0,cpu:1` or
    /// `cuda:0,1`, or `list` to print the available devices and exit. At most 1024 devices, and
    /// at most 1024 pipeline stages (devices x --chunks).
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
    /// already taken). 0 trains nothing (with --init and --save: convert a file). At most 2^40,
    /// as is --epochs times the steps per epoch.
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
    /// optimizer state, step count and data position restored. The run must train as the saved
    /// one did: the same data (compared by content, so the file may move), model, --optimizer,
    /// --lr, --lr-schedule, --momentum, --weight-decay, --batch, --microbatches (another split sums
    /// gradients in another order), --seed and shuffling; a resume that changes any of them is
    /// refused, listing the differences. What may change: --steps/--epochs, the outputs (--save,
    /// --checkpoint, --checkpoint-every, --metrics, --trace, --svg), --eval-every, --log-every,
    /// --on-nonfinite, and the layout: --devices, --stages, --schedule, --chunks, --placement,
    /// --recompute, --core-slots, --device-memory (the weights come out bit-identical) and
    /// --tensor-parallel (equal up to f32 rounding).
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

/// Parses the optimizer flags into a configuration, refusing invalid values with exit code 2.
pub fn parse_optimizer(
    name: &str,
    lr: Option<f64>,
    momentum: Option<f64>,
    weight_decay: Option<f64>,
) -> anyhow::Result<OptimizerConfig> {
    if let Some(momentum) = momentum
        && name != "momentum"
    {
        return Err(usage(format!(
            "--momentum {momentum} applies only to --optimizer momentum, not {name}; drop --momentum or use --optimizer momentum"
        )));
    }
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
    config.validate().map_err(|e| match e {
        // Name the flag that set the value: the optimizer's message names the hyperparameter.
        conveyor::engine::Error::InvalidArgument { name: parameter, reason } => {
            let flag = match parameter.as_str() {
                "lr" => "--lr",
                "momentum" => "--momentum",
                "weight_decay" => "--weight-decay",
                _ => "--optimizer",
            };
            usage(format!("{flag}: {reason} (--optimizer {name})"))
        }
        other => usage(format!("--optimizer {name}: {other}")),
    })?;
    Ok(config)
}
