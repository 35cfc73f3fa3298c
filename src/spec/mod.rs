//! One run specification, [`RunSpec`]: everything a training run is (model, data, devices and
//! placement, schedule, micro-batches, tensor parallelism, recomputation, the optimizer and its
//! learning-rate schedule, precision, checkpoints and outputs), in one value that `conveyor train`
//! parses its flags into, a library user builds or reads from TOML, and a checkpoint stores.
//!
//! Code map: this file holds the types and their defaults ([`RunSpec::default`] is what
//! `conveyor train` runs with no flags); `toml.rs` reads and writes the TOML form (unknown keys and
//! bad values are errors naming the key); `validate.rs` the checks across fields
//! ([`RunSpec::validate`]) and of counts against the devices; `error.rs` [`SpecError`]; `data.rs`
//! turns `[data]` into splits fitted to the model; `prepare.rs` builds the trainer
//! ([`RunSpec::prepare`]) and feeds it the run's batches; `strategy.rs` the data-parallel
//! strategies (`sync`, `compress`, `interleaving`): what they can honour, and the replicas they
//! train ([`RunSpec::prepare_replicas`]).
//!
//! In a file every table and key is optional; a missing one takes its default:
//!
//! ```toml
//! [model]
//! spec = "mlp:8,16,4"          # a zoo spec; left out: the data's default model
//!
//! [data]
//! source = "synthetic:64,8,4"  # digits, synthetic:N,D,C, tokens:N,T,VOCAB,C, a file or an MNIST directory
//!
//! [pipeline]
//! devices = "cpu:2"
//! schedule = "1f1b"
//! microbatches = 4
//! placement = "auto"           # "time", a placement file, or stages: [["0", "1"], ["2..4"]]
//!
//! [training]
//! batch = 16
//! steps = 10
//!
//! [optimizer]
//! name = "momentum"
//! lr = 0.05
//! ```
//!
//! A library user runs a spec in a few lines:
//!
//! ```
//! use conveyor::RunSpec;
//!
//! let spec = RunSpec::from_toml_str(
//!     r#"
//!     model.spec = "mlp:8,16,4"
//!     data.source = "synthetic:64,8,4"
//!     training = { batch = 16, steps = 3 }
//!     pipeline.microbatches = 4
//!     "#,
//! )?;
//! let mut run = spec.prepare()?;
//! for step in 0..run.total_steps {
//!     let report = run.train_step(step)?;
//!     assert!(report.loss.is_finite());
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
mod data;
mod error;
mod prepare;
mod strategy;
mod toml;
mod validate;

use std::path::PathBuf;

use conveyor_engine::placement::WeightCache;
use conveyor_engine::runtime::{CoreSlotPolicy, Recompute, ReplicaShares};
use conveyor_engine::strategies::{Compression, SyncStrategy};
use conveyor_schedules::ScheduleKind;
use serde::{Deserialize, Serialize};

pub use data::{Splits, default_model, fit_to_model, load_data};
pub use error::SpecError;
pub use prepare::PreparedRun;
pub use strategy::{INTERLEAVING_VALUES, InterleavingSpec, MAX_INTERLEAVING_FILE_BYTES, PreparedReplicas};
pub use toml::{MAX_SPEC_FILE_BYTES, flag_of_key};
pub use validate::{devices_used, hyperparameters, total_steps};

pub use crate::cli_input::{BucketSize, LrSchedule, OnNonFinite};

/// Everything a training run is. Each table of the TOML form is one field; [`RunSpec::default`]
/// is `conveyor train` with no flags. See the [module documentation](self) for the file format.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunSpec {
    /// `[model]`: which model.
    #[serde(skip_serializing_if = "is_default")]
    pub model: ModelSection,
    /// `[data]`: what it trains on.
    pub data: DataSection,
    /// `[pipeline]`: devices, stages, placement, schedule, micro-batches, tensor parallelism.
    pub pipeline: PipelineSection,
    /// `[training]`: batch, length, seed, shuffling, precision, non-finite policy, evaluation.
    pub training: TrainingSection,
    /// `[optimizer]`: the optimizer and its learning-rate schedule.
    pub optimizer: OptimizerSection,
    /// `[checkpoint]`: where the parameters start from and where checkpoints go.
    #[serde(skip_serializing_if = "is_default")]
    pub checkpoint: CheckpointSection,
    /// `[outputs]`: the files a run writes besides checkpoints.
    #[serde(skip_serializing_if = "is_default")]
    pub outputs: OutputsSection,
}

/// `[model]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// `spec` (`--model`): a zoo spec such as `mlp:64,128,10`, `cnn`, `resnet` or
    /// `transformer:VOCAB,T,D,H,L,C`. `None`: the checkpoint's model with a resume, `cnn` for 1x8x8
    /// images, a small transformer for token data, else `mlp:D,128,128,C` over the inputs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec: Option<String>,
}

/// `[data]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// `source` (`--data`): `digits`, `synthetic:N,D,C`, `tokens:N,T,VOCAB,C`, a
    /// `FILE.safetensors` or an MNIST directory. Default `digits`.
    pub source: String,
    /// `test_fraction` (`--test-fraction`): rows held out for evaluation from the end of a data
    /// file or generated data.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub test_fraction: Option<f64>,
    /// `classes` (`--classes`): the class count of a data file.
    #[serde(skip_serializing_if = "Option::is_none", with = "toml::wide_opt")]
    pub classes: Option<usize>,
}

impl Default for DataSection {
    fn default() -> Self {
        DataSection { source: "digits".to_string(), test_fraction: None, classes: None }
    }
}

/// How layers are placed on stages (`placement` in `[pipeline]`, `--placement`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PlacementSpec {
    /// `"auto"`: minimise the slowest stage under the memory budgets, from FLOP estimates.
    #[default]
    Auto,
    /// `"time"`: the same from layer times measured on this machine first.
    Time,
    /// Any other string: a placement file (one line of node names or `first..last` ranges per
    /// stage), relative to the working directory.
    File(PathBuf),
    /// An array of arrays: the node names (or ranges) of each stage.
    Manual(Vec<Vec<String>>),
}

/// `[pipeline]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PipelineSection {
    /// `devices` (`--devices`): `cpu:N`, `cuda:0,1` or a list such as `cpu:0,cpu:1`. Default `cpu:2`.
    pub devices: String,
    /// `device_memory` (`--device-memory`): each device's budget in bytes; in TOML a size such as
    /// `"512MiB"` or a number of bytes. `None`: unlimited.
    #[serde(skip_serializing_if = "Option::is_none", with = "toml::size_opt")]
    pub device_memory: Option<u64>,
    /// `stages` (`--stages`): stages per chunk; `None`: one per device (per group of
    /// `tensor_parallel` devices).
    #[serde(skip_serializing_if = "Option::is_none", with = "toml::wide_opt")]
    pub stages: Option<usize>,
    /// `tensor_parallel` (`--tensor-parallel`): devices per stage. Default 1.
    #[serde(with = "toml::wide")]
    pub tensor_parallel: usize,
    /// `sequence_parallel` (`--sequence-parallel`): with `tensor_parallel` > 1 and a transformer,
    /// split each block's LayerNorm and residual regions along the tokens across the stage's group
    /// (Megatron's sequence parallelism: all-gathers and reduce-scatters instead of all-reduces,
    /// activations spread over the group). The same weights as without, up to f32 rounding.
    /// Default false.
    pub sequence_parallel: bool,
    /// `data_parallel` (`--data-parallel`): replicas of the pipeline, each on its own devices
    /// (devices = replicas x stages x tensor_parallel, replica-major), each taking its share of
    /// every batch; `microbatches` is per replica. Default 1.
    #[serde(with = "toml::wide")]
    pub data_parallel: usize,
    /// `zero` (`--zero`): 1 shards the optimizer state across the data-parallel replicas
    /// (ZeRO-1: each keeps and updates its share of the layers, then broadcasts them), 0 does
    /// not. Default 0.
    pub zero: u8,
    /// `replica_shares` (`--replica-shares`): how each batch is shared among the data-parallel
    /// replicas: `even`, weights such as `"3,1"`, or `auto` (by throughput measured over the first
    /// steps). Default even.
    #[serde(with = "toml::text")]
    pub replica_shares: ReplicaShares,
    /// `bucket_size` (`--bucket-size`): with data-parallel replicas, gradients are all-reduced in
    /// buckets of about this size (`"25MiB"`), each started as soon as its gradients are final so
    /// that communication overlaps the backward pass, or `"off"`: every gradient at the optimizer
    /// step. The same sums either way. Default 25MiB (PyTorch DDP's).
    #[serde(with = "toml::text")]
    pub bucket_size: BucketSize,
    /// `sync` (`--sync`): how the `data_parallel` replicas keep their parameters in step:
    /// `allreduce`, `average:K`, `ps`, `ps:S`, `downpour:F,P` or `ssp:S`
    /// ([`conveyor_engine::strategies::SyncStrategy`]). `allreduce` without compression and with
    /// free interleaving is the runtime's own replicas; anything else trains through the
    /// strategies (`strategy.rs`). Default allreduce.
    #[serde(with = "toml::text")]
    pub sync: SyncStrategy,
    /// `compress` (`--compress`): how the strategies compress what workers exchange: `none`,
    /// `bf16`, `f16`, `topk:R` or `powersgd:R`. Default none.
    #[serde(with = "toml::text")]
    pub compress: Compression,
    /// `compress_after` (`--compress-after`): the first this many steps exchange uncompressed
    /// (PyTorch's `start_powerSGD_iter`), then `compress` starts. Needs a `compress`. Default 0.
    #[serde(with = "toml::wide")]
    pub compress_after: usize,
    /// `interleaving` (`--interleaving`): the order of an asynchronous strategy's pulls and
    /// pushes: `free`, `seed:N` (drawn from a seed, recorded) or `replay:PATH` (a record written by
    /// `record_interleaving`). Default free.
    #[serde(with = "toml::text")]
    pub interleaving: InterleavingSpec,
    /// `placement` (`--placement`). Default auto.
    #[serde(with = "toml::placement")]
    pub placement: PlacementSpec,
    /// `schedule` (`--schedule`): gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, dualpipe-v or
    /// interleaved-zb. Default 1f1b.
    #[serde(with = "toml::text")]
    pub schedule: ScheduleKind,
    /// `chunks` (`--chunks`): model chunks per device (interleaved and interleaved-zb; zb-v and
    /// dualpipe-v need 2, which `conveyor train` and `plan` set when `--chunks` is not given).
    /// Default 1.
    #[serde(with = "toml::wide")]
    pub chunks: usize,
    /// `microbatches` (`--microbatches`): micro-batches per batch. Default 8.
    #[serde(with = "toml::wide")]
    pub microbatches: usize,
    /// `recompute` (`--recompute`): never, except-last or always. Default never.
    #[serde(with = "toml::text")]
    pub recompute: Recompute,
    /// `core_slots` (`--core-slots`): auto, off or a number. Default auto.
    #[serde(with = "toml::text")]
    pub core_slots: CoreSlotPolicy,
    /// `weight_cache` (`--weight-cache`): auto, on or off, which packed weight copies the stages
    /// keep. Default auto.
    #[serde(with = "toml::text")]
    pub weight_cache: WeightCache,
    /// `overlap_steps` (`--overlap-steps`): `on` lets each stage start the next step as soon as
    /// it has applied its own update, with the step validated after the fact (the same weights;
    /// `TrainerBuilder::overlap_steps`), or `off`. Default on: where steps cannot overlap (across MPI
    /// ranks, a stage without an undo snapshot) they stay synchronous and `train` says why.
    #[serde(with = "toml::text")]
    pub overlap_steps: OverlapSteps,
}

/// Whether steps overlap (`--overlap-steps on|off`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OverlapSteps {
    /// Every step ends with a barrier across the stages (the commit).
    Off,
    /// Each stage starts the next step once it applied its own update; steps are validated after.
    #[default]
    On,
}

impl OverlapSteps {
    /// Whether steps overlap.
    pub fn is_on(self) -> bool {
        self == OverlapSteps::On
    }
}

impl std::fmt::Display for OverlapSteps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_on() { "on" } else { "off" })
    }
}

impl std::str::FromStr for OverlapSteps {
    type Err = conveyor_engine::Error;

    fn from_str(text: &str) -> Result<OverlapSteps, Self::Err> {
        match text {
            "on" => Ok(OverlapSteps::On),
            "off" => Ok(OverlapSteps::Off),
            other => Err(conveyor_engine::Error::invalid("overlap steps", format!("`{other}`: use on or off"))),
        }
    }
}

impl Default for PipelineSection {
    fn default() -> Self {
        PipelineSection {
            devices: "cpu:2".to_string(),
            device_memory: None,
            stages: None,
            tensor_parallel: 1,
            sequence_parallel: false,
            data_parallel: 1,
            zero: 0,
            replica_shares: ReplicaShares::Even,
            bucket_size: BucketSize::default(),
            sync: SyncStrategy::AllReduce,
            compress: Compression::None,
            compress_after: 0,
            interleaving: InterleavingSpec::Free,
            placement: PlacementSpec::Auto,
            schedule: ScheduleKind::OneFOneB,
            chunks: 1,
            microbatches: 8,
            recompute: Recompute::Never,
            core_slots: CoreSlotPolicy::Auto,
            weight_cache: WeightCache::default(),
            overlap_steps: OverlapSteps::On,
        }
    }
}

/// Number format of the activations and products (`precision` in `[training]`, `--precision`):
/// the engine's autocast policy, [`conveyor_engine::Precision`].
pub use conveyor_engine::Precision;

/// `[training]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainingSection {
    /// `batch` (`--batch`): rows per batch (one optimizer step). Default 32.
    #[serde(with = "toml::wide")]
    pub batch: usize,
    /// `steps` (`--steps`): total optimizer steps (with a resume, including those taken); `None`:
    /// `epochs` passes over the training rows.
    #[serde(skip_serializing_if = "Option::is_none", with = "toml::wide_opt")]
    pub steps: Option<u64>,
    /// `epochs` (`--epochs`): passes over the training data when `steps` is not given. Default 30.
    #[serde(with = "toml::wide")]
    pub epochs: u64,
    /// `seed` (`--seed`): initialisation, shuffling, generated data and dropout. Default 0.
    #[serde(with = "toml::wide")]
    pub seed: u64,
    /// `shuffle` (`--no-shuffle` sets false): shuffle each epoch's batches. Default true.
    pub shuffle: bool,
    /// `precision` (`--precision`): f32, bf16 or f16 (mixed precision with f32 master weights;
    /// f16 with dynamic loss scaling). Default f32.
    #[serde(with = "toml::text")]
    pub precision: Precision,
    /// `on_nonfinite` (`--on-nonfinite`): error, skip or skip:N. Default error.
    #[serde(with = "toml::text")]
    pub on_nonfinite: OnNonFinite,
    /// `eval_every` (`--eval-every`): measure held-out accuracy every N steps.
    #[serde(skip_serializing_if = "Option::is_none", with = "toml::wide_opt")]
    pub eval_every: Option<u64>,
    /// `log_every` (`--log-every`): a progress line every N steps (0: only the summary). Default 100.
    #[serde(with = "toml::wide")]
    pub log_every: u64,
}

impl Default for TrainingSection {
    fn default() -> Self {
        TrainingSection {
            batch: 32,
            steps: None,
            epochs: 30,
            seed: 0,
            shuffle: true,
            precision: Precision::F32,
            on_nonfinite: OnNonFinite::Error,
            eval_every: None,
            log_every: 100,
        }
    }
}

/// The optimizers a spec names (`name` in `[optimizer]`, `--optimizer`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OptimizerKind {
    /// `sgd`: plain SGD (lr 0.05 by default).
    Sgd,
    /// `momentum`: SGD with momentum 0.9 (or `momentum`), lr 0.05 by default.
    Momentum,
    /// `adam` (lr 0.005 by default).
    #[default]
    Adam,
    /// `adamw`: Adam with decoupled weight decay (0.01 by default), lr 0.005 by default.
    AdamW,
}

/// `[optimizer]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerSection {
    /// `name` (`--optimizer`): sgd, momentum, adam or adamw. Default adam.
    #[serde(with = "toml::text")]
    pub name: OptimizerKind,
    /// `lr` (`--lr`); `None`: 0.005 for adam and adamw, 0.05 for sgd and momentum.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// `momentum` (`--momentum`), for `momentum` only; `None`: 0.9.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub momentum: Option<f64>,
    /// `weight_decay` (`--weight-decay`): L2 for sgd/adam, decoupled for adamw; `None`: 0, or
    /// 0.01 for adamw.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f64>,
    /// `lr_schedule` (`--lr-schedule`): constant, cosine or step:N,GAMMA. Default cosine.
    #[serde(with = "toml::text")]
    pub lr_schedule: LrSchedule,
    /// `clip_grad_norm` (`--clip-grad-norm`): clip the gradients to this global L2 norm before
    /// each update (torch's `clip_grad_norm_`, over every stage and replica); `None`: no clipping.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clip_grad_norm: Option<f64>,
}

/// `[checkpoint]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointSection {
    /// `init` (`--init`): start from these parameters (a PyTorch state dict in safetensors).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init: Option<PathBuf>,
    /// `resume` (`--resume`): continue from this checkpoint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resume: Option<PathBuf>,
    /// `path` (`--checkpoint`): write a training checkpoint here at the end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// `every` (`--checkpoint-every`): also write it every N steps.
    #[serde(skip_serializing_if = "Option::is_none", with = "toml::wide_opt")]
    pub every: Option<u64>,
}

/// `[outputs]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutputsSection {
    /// `save` (`--save`): the trained parameters as a PyTorch state dict.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub save: Option<PathBuf>,
    /// `metrics` (`--metrics`): one JSON object per step, then a summary.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics: Option<PathBuf>,
    /// `trace` (`--trace`): a Chrome / Perfetto trace of every op.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace: Option<PathBuf>,
    /// `svg` (`--svg`): a Gantt chart of the last step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub svg: Option<PathBuf>,
    /// `record_interleaving` (`--record-interleaving`): the order of an asynchronous strategy's
    /// turns (`interleaving` seed:N or replay:PATH), as a JSON array of worker indices, written at
    /// the end; `interleaving = "replay:PATH"` replays it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub record_interleaving: Option<PathBuf>,
}

impl RunSpec {
    /// The spec a checkpoint stores: this one without the files of one invocation (`[outputs]`
    /// and `[checkpoint]`), which decide nothing of the training. A resume that starts from it
    /// therefore writes only the files its own command names.
    pub fn for_checkpoint(&self) -> RunSpec {
        RunSpec { checkpoint: CheckpointSection::default(), outputs: OutputsSection::default(), ..self.clone() }
    }
}

impl PlacementSpec {
    /// Reads `--placement`'s text: `auto`, `time`, else a placement file's path.
    pub fn from_text(text: &str) -> PlacementSpec {
        match text {
            "auto" => PlacementSpec::Auto,
            "time" => PlacementSpec::Time,
            path => PlacementSpec::File(PathBuf::from(path)),
        }
    }
}

impl std::fmt::Display for OptimizerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Momentum => "momentum",
            OptimizerKind::Adam => "adam",
            OptimizerKind::AdamW => "adamw",
        })
    }
}

impl std::str::FromStr for OptimizerKind {
    type Err = String;
    /// `sgd`, `momentum`, `adam` or `adamw`; the error says what would fix the text.
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "sgd" => Ok(OptimizerKind::Sgd),
            "momentum" => Ok(OptimizerKind::Momentum),
            "adam" => Ok(OptimizerKind::Adam),
            "adamw" => Ok(OptimizerKind::AdamW),
            other => Err(format!("`{other}`: use sgd, momentum, adam or adamw")),
        }
    }
}

/// True when `value` is its type's default (a table left out of the TOML form).
fn is_default<T: Default + PartialEq>(value: &T) -> bool {
    *value == T::default()
}
