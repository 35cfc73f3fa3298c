//! The flags of `conveyor train` and how they override a run spec ([`TrainArgs::to_spec`]),
//! with the value parsers shared with `conveyor plan`.
use std::path::{Path, PathBuf};

use clap::Args;
use conveyor::cli_input::SPEC_KEY;
pub use conveyor::cli_input::{LrSchedule, OnNonFinite, parse_devices, parse_size};
use conveyor::engine::optim::OptimizerConfig;
use conveyor::spec::{OptimizerKind, OptimizerSection, PlacementSpec, Precision};
use conveyor::{RunSpec, engine};

use crate::cli::usage;

/// Arguments of `conveyor train`. Every flag given overrides its field of the run spec (the
/// `--config` file, else the `--resume` checkpoint's spec when no --model is given, else
/// [`RunSpec::default`]); the defaults stated are those of [`RunSpec::default`].
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Read the run spec from this TOML file (see examples/run.toml); flags given override its
    /// fields.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print the run spec this command line means as TOML (after --config and the flags,
    /// validated) and exit without training; `--config` reads it back.
    #[arg(long)]
    pub print_config: bool,
    /// Model: `mlp:D0,D1,...,Dn` (Linear/ReLU stack), `cnn` (LeNet-like, 1x8x8 inputs), `resnet`
    /// (1x8x8; `resnet:28` for 28x28 images such as MNIST) or `transformer[:VOCAB,T,D,H,L,C]`. Default: the checkpoint's model with --resume, `cnn` for
    /// 1x8x8 images, else `mlp:D,128,128,C` over the flattened inputs.
    #[arg(long)]
    pub model: Option<String>,
    /// Data: `digits` (built in: 1,437 train and 360 test images), `synthetic:N,D,C` (N samples,
    /// D features, C classes, seeded by --seed), `tokens:N,T,VOCAB,C` (N sequences of T token ids,
    /// labelled by their first token mod C; the default model is then a transformer), a `FILE.safetensors` holding `inputs` f32 [N, ...]
    /// and `labels` i64 [N], or an MNIST directory of IDX files (train-images-idx3-ubyte,
    /// train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each optionally .gz;
    /// pixels scaled to [0, 1]).
    /// [default: digits]
    #[arg(long)]
    pub data: Option<String>,
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
    /// [default: cpu:2]
    #[arg(long)]
    pub devices: Option<String>,
    /// Memory budget of each device, e.g. `512MiB` or `2GiB` (default: unlimited).
    #[arg(long, value_name = "SIZE")]
    pub device_memory: Option<String>,
    /// Pipeline stages per chunk; default one per device (per group of --tensor-parallel
    /// devices). Uses the first P (x K) devices.
    #[arg(long)]
    pub stages: Option<usize>,
    /// Split every Linear, Conv2d and attention of each stage across a group of K devices
    /// (Megatron column/row pairs, channel-split convolutions, attention by heads: K must divide a
    /// transformer's heads); stages x K must not exceed the devices. [default: 1]
    #[arg(long, value_name = "K")]
    pub tensor_parallel: Option<usize>,
    /// With --tensor-parallel K and a transformer: split each block's LayerNorm and residual
    /// regions along the tokens across the K devices too (Megatron's sequence parallelism:
    /// all-gathers and reduce-scatters instead of all-reduces, each device saving about 1/K of the
    /// block's activations). The same weights as without, up to f32 rounding.
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Data parallelism: R replicas of the pipeline, each on its own devices (devices = R x stages
    /// x K, replica-major), each taking 1/R of every batch (--microbatches is per replica); the
    /// gradients are summed across replicas before every step. [default: 1]
    #[arg(long, value_name = "R")]
    pub data_parallel: Option<usize>,
    /// ZeRO stage with --data-parallel: 1 shards the optimizer state across the replicas (each
    /// keeps and updates its share of the layers and broadcasts them; the same weights as 0).
    /// [default: 0]
    #[arg(long, value_name = "STAGE")]
    pub zero: Option<u8>,
    /// With --data-parallel: how each batch is shared among the replicas: `even`, one weight per
    /// replica (`3,1`: three quarters to the first), or `auto` (by each replica's throughput
    /// measured over the first 3 steps, then fixed), for replicas on unequal devices. Every
    /// share gives one device's gradient on the whole batch. [default: even]
    #[arg(long, value_name = "auto|even|A,B,...")]
    pub replica_shares: Option<String>,
    /// With --data-parallel: all-reduce the gradients in buckets of about this size (e.g. 25MiB,
    /// 4MiB), each started as soon as its gradients are final so that communication overlaps the
    /// backward pass, or `off` to all-reduce every gradient at the optimizer step. The same
    /// weights either way. [default: 25MiB]
    #[arg(long, value_name = "SIZE|off")]
    pub bucket_size: Option<String>,
    /// How the --data-parallel replicas keep their parameters in step: `allreduce` (gradients
    /// averaged every step), `average:K` (local SGD: parameters averaged every K steps), `ps` or
    /// `ps:S` (a synchronous parameter server of S shards), `downpour:F,P` (asynchronous: fetch the
    /// parameters every F steps, push gradients every P) or `ssp:S` (stale-synchronous: at most S
    /// steps ahead of the slowest worker). `allreduce` without --compress or --interleaving is the
    /// runtime's own replicas; anything else trains through the strategies, which follow
    /// --lr-schedule step by step and do not support --resume, --checkpoint,
    /// --tensor-parallel, --zero, --replica-shares, --bucket-size, --trace, --svg or
    /// --on-nonfinite skip. --batch is the global batch, split evenly among the workers.
    /// [default: allreduce]
    #[arg(long, value_name = "STRATEGY")]
    pub sync: Option<String>,
    /// How the --sync strategy compresses what workers exchange: `none`, `bf16`, `f16`, `topk:R`
    /// (the largest fraction 0 < R <= 1 of each tensor, with error feedback) or `powersgd:R`
    /// (rank-R approximation, R >= 1, with error feedback). [default: none]
    #[arg(long, value_name = "CODEC")]
    pub compress: Option<String>,
    /// With --compress: exchange the first STEPS steps uncompressed, then compress (PyTorch's
    /// `start_powerSGD_iter`; compression from the first step loses more accuracy). [default: 0]
    #[arg(long, value_name = "STEPS")]
    pub compress_after: Option<usize>,
    /// The order of an asynchronous strategy's pulls and pushes (--sync downpour:F,P or ssp:S):
    /// `free` (as the threads arrive), `seed:N` (drawn from seed N: the same weights every run),
    /// or `replay:PATH` (the turns --record-interleaving wrote, replayed with the recording run's
    /// flags: the same weights again). [default: free]
    #[arg(long, value_name = "free|seed:N|replay:PATH")]
    pub interleaving: Option<String>,
    /// Write the run's order of turns (--interleaving seed:N or replay:PATH) here at the end, as a
    /// JSON array of worker indices, atomically; --interleaving replay:FILE replays it.
    #[arg(long, value_name = "FILE")]
    pub record_interleaving: Option<PathBuf>,
    /// Placement of layers on stages: `auto` (minimise the slowest stage under the budgets, from
    /// the cost model: FLOPs and bytes moved; on CPU devices, when timing the layers is cheap and
    /// the model long enough to time, the measured cut instead if it is at least 10% faster),
    /// `time` (always the cut from layer times measured on this machine first: balance by time),
    /// or a file as `conveyor plan --placement` reads: one line per stage
    /// listing node names or ranges `first..last` separated by spaces (`#` starts a comment).
    /// [default: auto]
    #[arg(long, value_name = "auto|time|FILE")]
    pub placement: Option<String>,
    /// Schedule: gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, dualpipe-v or interleaved-zb, or
    /// `auto` (schedule, chunks, micro-batches and recompute mode chosen as `plan --schedule auto`
    /// chooses them).
    /// [default: 1f1b]
    #[arg(long)]
    pub schedule: Option<String>,
    /// Model chunks per device (interleaved and interleaved-zb; zb-v and dualpipe-v need 2).
    /// [default: 1, 2 for zb-v and dualpipe-v]
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Micro-batches per batch.
    /// [default: 8]
    #[arg(long)]
    pub microbatches: Option<usize>,
    /// Rows per batch (one optimizer step).
    /// [default: 32]
    #[arg(long)]
    pub batch: Option<usize>,
    /// Total optimizer steps (overrides --epochs; with --resume, the total including the steps
    /// already taken). 0 trains nothing (with --init and --save: convert a file). At most 2^40,
    /// as is --epochs times the steps per epoch.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Passes over the training data (when --steps is not given).
    /// [default: 30]
    #[arg(long)]
    pub epochs: Option<u64>,
    /// Optimizer: sgd, momentum (SGD with momentum 0.9, or --momentum), adam or adamw.
    /// [default: adam]
    #[arg(long)]
    pub optimizer: Option<String>,
    /// Learning rate (default 0.005 for adam/adamw, 0.05 for sgd/momentum).
    #[arg(long, allow_negative_numbers = true)]
    pub lr: Option<f64>,
    /// Learning-rate schedule over the run's total steps, stepped after every optimizer step as
    /// torch's schedulers are: `constant`, `cosine` (CosineAnnealingLR with T_max = total steps,
    /// eta_min 0) or `step:N,GAMMA` (StepLR: multiply by GAMMA every N steps).
    /// [default: cosine]
    #[arg(long, value_name = "NAME")]
    pub lr_schedule: Option<String>,
    /// Momentum for `--optimizer momentum` (default 0.9).
    #[arg(long)]
    pub momentum: Option<f64>,
    /// Weight decay (L2 for sgd/adam, decoupled for adamw).
    #[arg(long, allow_negative_numbers = true)]
    pub weight_decay: Option<f64>,
    /// Clip the gradients to this global L2 norm before each update (torch's
    /// `clip_grad_norm_`), over every stage and replica. [default: no clipping]
    #[arg(long, value_name = "MAX", allow_negative_numbers = true)]
    pub clip_grad_norm: Option<f64>,
    /// Activation recomputation: never, except-last or always.
    /// [default: never]
    #[arg(long)]
    pub recompute: Option<String>,
    /// Core slots for CPU workers: auto (one per core when workers outnumber cores), off (let the
    /// OS share the cores), or a number (at most that many ops compute at once, first come first
    /// served).
    /// [default: auto]
    #[arg(long)]
    pub core_slots: Option<String>,
    /// Which packed weight copies the stages keep (two per Linear, each as large as its weight,
    /// rebuilt after every update): off (none: they measured no faster than the weight itself
    /// since the small-row kernel, benches/README.md), auto (where the memory plan has room, the
    /// most used first) or on (all; a stage they push over its budget does not fit).
    /// [default: off]
    #[arg(long)]
    pub weight_cache: Option<String>,
    /// `on`: each stage starts the next step as soon as it has applied its own update, without a
    /// barrier across the stages; each step is validated after the fact (finite losses and
    /// gradients, no fault) and rolled back, with the step begun after it, if it fails, so the
    /// weights are those of `off`. In one process only (under mpirun steps stay synchronous).
    /// [default: on]
    #[arg(long)]
    pub overlap_steps: Option<String>,
    /// How the pipeline's devices reach each other: `in-process` (threads of this process), `mpi`
    /// (this process is one rank of `mpirun -n P conveyor train ...`, one rank per pipeline device, or per device with --tensor-parallel;
    /// needs a build with `--features mpi`), or `auto`: MPI when an MPI launcher started this
    /// process with several ranks, else in-process.
    #[arg(long, default_value = "auto")]
    pub transport: crate::cli::ranks::TransportChoice,
    /// Seed for initialisation, shuffling, synthetic data and dropout.
    /// [default: 0]
    #[arg(long)]
    pub seed: Option<u64>,
    /// Take batches in data order from the first row instead of shuffling.
    #[arg(long)]
    pub no_shuffle: bool,
    /// Number format of activations and products: f32, bf16 or f16 (mixed precision as
    /// torch.autocast: f32 master weights and optimizer state; f16 with dynamic loss scaling).
    /// [default: f32]
    #[arg(long, value_name = "NAME")]
    pub precision: Option<String>,
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
    /// --tensor-parallel (equal up to f32 rounding). Without --model or --config the run starts
    /// from the spec the checkpoint stores (its data, model, optimizer, batch, layout...; not its
    /// outputs), and the flags given override it.
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
    /// Write one JSON object per optimizer step to this file, then a summary object. A step's
    /// `step_s` is its wall time (with --overlap-steps on, the time since the step before it was
    /// reported, as the two overlap).
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Write a Chrome / Perfetto trace of every op of the whole run (open in ui.perfetto.dev).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Write an SVG Gantt chart of the last step: one row per device, bubbles marked.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Print a progress line every this many steps (0: only the summary).
    /// [default: 100]
    #[arg(long)]
    pub log_every: Option<u64>,
    /// What a step whose loss or gradients are not finite (NaN or infinity) does; such a step is
    /// never committed. `error`: stop, naming the step, the stage and the first parameter affected,
    /// still write --save/--checkpoint from the last good step, exit status 3. `skip[:N]`: skip the
    /// step like a loss scaler (its batch is consumed, the parameters stay), count it in the
    /// metrics, and stop as `error` does after N skipped steps in a row (default 10).
    /// [default: error]
    #[arg(long, value_name = "POLICY")]
    pub on_nonfinite: Option<String>,
}

impl TrainArgs {
    /// `--schedule auto`: the schedule, chunks, micro-batches and recompute mode are chosen
    /// (`plan_auto::resolve_for_train`) once the spec is assembled.
    pub fn auto_schedule(&self) -> bool {
        self.schedule.as_deref().is_some_and(|s| s.eq_ignore_ascii_case("auto"))
    }

    /// The run spec this command line means: the base spec (`--config`, else the spec a
    /// `--resume` checkpoint stores when no --model is given, else the default) with every flag
    /// given written over its field. Not yet validated.
    pub fn to_spec(&self) -> anyhow::Result<RunSpec> {
        let mut spec = match (&self.config, &self.resume, &self.model) {
            (Some(path), _, _) => RunSpec::from_file(path).map_err(|e| usage(format!("--config {e}")))?,
            // With --init too, validation refuses the pair before the checkpoint is read.
            (None, Some(path), None) if self.init.is_none() => spec_of_checkpoint(path)?,
            _ => RunSpec::default(),
        };
        self.override_fields(&mut spec)?;
        Ok(spec)
    }

    /// Writes every flag given over its field of `spec`, parsing values as the flags always have.
    fn override_fields(&self, spec: &mut RunSpec) -> anyhow::Result<()> {
        fn set<T: Clone>(field: &mut T, flag: &Option<T>) {
            if let Some(value) = flag {
                *field = value.clone();
            }
        }
        fn set_some<T: Clone>(field: &mut Option<T>, flag: &Option<T>) {
            if flag.is_some() {
                field.clone_from(flag);
            }
        }
        set_some(&mut spec.model.spec, &self.model);
        set(&mut spec.data.source, &self.data);
        set_some(&mut spec.data.test_fraction, &self.test_fraction);
        set_some(&mut spec.data.classes, &self.classes);
        let pipeline = &mut spec.pipeline;
        set(&mut pipeline.devices, &self.devices);
        if let Some(text) = &self.device_memory {
            pipeline.device_memory = Some(parse_size(text)?);
        }
        set_some(&mut pipeline.stages, &self.stages);
        set(&mut pipeline.tensor_parallel, &self.tensor_parallel);
        if self.sequence_parallel {
            pipeline.sequence_parallel = true;
        }
        set(&mut pipeline.data_parallel, &self.data_parallel);
        set(&mut pipeline.zero, &self.zero);
        if let Some(text) = &self.replica_shares {
            pipeline.replica_shares =
                text.parse().map_err(|e: conveyor_engine::Error| usage(format!("--replica-shares: {e}")))?;
        }
        if let Some(text) = &self.bucket_size {
            pipeline.bucket_size = text.parse()?;
        }
        if let Some(text) = &self.sync {
            pipeline.sync = text.parse().map_err(|e| usage(format!("--sync: {}", reason(e))))?;
        }
        if let Some(text) = &self.compress {
            pipeline.compress = text.parse().map_err(|e| usage(format!("--compress: {}", reason(e))))?;
        }
        set(&mut pipeline.compress_after, &self.compress_after);
        if let Some(text) = &self.interleaving {
            pipeline.interleaving = text.parse().map_err(|why| usage(format!("--interleaving {why}")))?;
        }
        if let Some(text) = &self.placement {
            pipeline.placement = PlacementSpec::from_text(text);
        }
        if let Some(text) = self.schedule.as_ref().filter(|_| !self.auto_schedule()) {
            pipeline.schedule = text.parse().map_err(|e| usage(format!("--schedule: {e}, or auto")))?;
        }
        set(&mut pipeline.chunks, &self.chunks);
        // The V schedules run exactly two chunks: the default when --chunks is not given.
        if let (None, Some(required)) = (self.chunks, pipeline.schedule.required_chunks())
            && pipeline.chunks == 1
        {
            pipeline.chunks = required;
        }
        set(&mut pipeline.microbatches, &self.microbatches);
        if let Some(text) = &self.recompute {
            pipeline.recompute = text.parse().map_err(|e| usage(format!("--recompute {}", reason(e))))?;
        }
        if let Some(text) = &self.core_slots {
            pipeline.core_slots = text.parse().map_err(|e| usage(format!("--core-slots {}", reason(e))))?;
        }
        if let Some(text) = &self.weight_cache {
            pipeline.weight_cache = text.parse().map_err(|e| usage(format!("--weight-cache {}", reason(e))))?;
        }
        if let Some(text) = &self.overlap_steps {
            pipeline.overlap_steps = text.parse().map_err(|e| usage(format!("--overlap-steps {}", reason(e))))?;
        }
        let training = &mut spec.training;
        set(&mut training.batch, &self.batch);
        set_some(&mut training.steps, &self.steps);
        set(&mut training.epochs, &self.epochs);
        set(&mut training.seed, &self.seed);
        if self.no_shuffle {
            training.shuffle = false;
        }
        if let Some(text) = &self.precision {
            training.precision = text.parse::<Precision>().map_err(|why| usage(format!("--precision {why}")))?;
        }
        if let Some(text) = &self.on_nonfinite {
            training.on_nonfinite = text.parse()?;
        }
        set_some(&mut training.eval_every, &self.eval_every);
        set(&mut training.log_every, &self.log_every);
        let optimizer = &mut spec.optimizer;
        if let Some(text) = &self.optimizer {
            optimizer.name = text.parse::<OptimizerKind>().map_err(|why| usage(format!("--optimizer {why}")))?;
        }
        set_some(&mut optimizer.lr, &self.lr);
        set_some(&mut optimizer.momentum, &self.momentum);
        set_some(&mut optimizer.weight_decay, &self.weight_decay);
        set_some(&mut optimizer.clip_grad_norm, &self.clip_grad_norm);
        if let Some(text) = &self.lr_schedule {
            optimizer.lr_schedule = text.parse()?;
        }
        let checkpoint = &mut spec.checkpoint;
        set_some(&mut checkpoint.init, &self.init);
        set_some(&mut checkpoint.resume, &self.resume);
        set_some(&mut checkpoint.path, &self.checkpoint);
        set_some(&mut checkpoint.every, &self.checkpoint_every);
        let outputs = &mut spec.outputs;
        set_some(&mut outputs.save, &self.save);
        set_some(&mut outputs.metrics, &self.metrics);
        set_some(&mut outputs.trace, &self.trace);
        set_some(&mut outputs.svg, &self.svg);
        set_some(&mut outputs.record_interleaving, &self.record_interleaving);
        Ok(())
    }
}

/// The spec a checkpoint was trained with, as the base of a resume: its `conveyor.spec`
/// metadata, or for a checkpoint written before specs were stored, the default spec with the
/// checkpoint's model.
fn spec_of_checkpoint(path: &Path) -> anyhow::Result<RunSpec> {
    let checkpoint = engine::checkpoint::load(path, &engine::Device::host())
        .map_err(|e| usage(format!("--resume {}: {e}", path.display())))?;
    match checkpoint.metadata().get(SPEC_KEY) {
        Some(text) => RunSpec::from_toml_str(text).map_err(|e| {
            usage(format!(
                "--resume {}: its `{SPEC_KEY}` metadata: {e}; give --model and the run's flags",
                path.display()
            ))
        }),
        None => {
            let mut spec = RunSpec::default();
            spec.model.spec = Some(super::checkpointing::model_of(path)?);
            Ok(spec)
        }
    }
}

/// An engine error's reason alone when it is an invalid argument (the message names the flag).
fn reason(error: engine::Error) -> String {
    match error {
        engine::Error::InvalidArgument { reason, .. } => reason,
        other => other.to_string(),
    }
}

/// Parses the optimizer flags into a configuration, refusing invalid values with exit code 2
/// (`conveyor plan`'s `--optimizer`; `conveyor train` reads them through the run spec).
pub fn parse_optimizer(
    name: &str,
    lr: Option<f64>,
    momentum: Option<f64>,
    weight_decay: Option<f64>,
) -> anyhow::Result<OptimizerConfig> {
    let name = name.parse::<OptimizerKind>().map_err(|why| usage(format!("--optimizer {why}")))?;
    let section = OptimizerSection { name, lr, momentum, weight_decay, ..OptimizerSection::default() };
    section.config().map_err(|e| usage(e.to_string()))
}
