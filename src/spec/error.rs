//! [`SpecError`]: what is wrong with a [`RunSpec`](super::RunSpec), in fields a program can act
//! on (the numbers, the key, the flag). Each message names the `conveyor train` flag as the
//! command line always has, then the TOML key in parentheses, and says what would fix it.
use std::path::PathBuf;

use conveyor_engine::strategies::SyncStrategy;
use conveyor_schedules::ScheduleKind;

use crate::cli_input::UsageError;

/// A run spec that cannot be read, is inconsistent, or cannot be prepared.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// A spec file that cannot be read (missing, a directory, too large, not UTF-8).
    #[error("{}: {reason}; give a readable TOML run spec", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why it could not be read.
        reason: String,
    },
    /// TOML that does not parse, an unknown key, or a value of the wrong type or refused by its
    /// parser.
    #[error(
        "{origin}: {}{}{}",
        if key.is_empty() { String::new() } else { format!("`{key}`{} ", flag.map(|f| format!(" ({f})")).unwrap_or_default()) },
        match (line, column) { (Some(l), Some(c)) => format!("at line {l}, column {c}: "), _ => String::new() },
        message
    )]
    Toml {
        /// The file, or "the run spec" for text.
        origin: String,
        /// The key, dotted from the top (`pipeline.schedule`; an unknown key included); empty for
        /// a syntax error.
        key: String,
        /// The `conveyor train` flag of the key, if it has one.
        flag: Option<&'static str>,
        /// 1-based line of the offending text.
        line: Option<usize>,
        /// 1-based column of the offending text.
        column: Option<usize>,
        /// What is wrong, and for values what would fix it.
        message: String,
    },
    /// A spec that cannot be written as TOML (a path that is not UTF-8).
    #[error("the run spec cannot be written as TOML: {reason}")]
    Serialize {
        /// Why.
        reason: String,
    },
    /// Both `init` and `resume`.
    #[error("--init and --resume both set the parameters; give one (checkpoint.init, checkpoint.resume)")]
    InitAndResume,
    /// A model spec that does not parse.
    #[error("--model: invalid model spec {reason} (model.spec)")]
    Model {
        /// The spec text.
        text: String,
        /// Why it does not parse.
        reason: String,
    },
    /// A model that cannot be built.
    #[error("--model {text}: {reason}")]
    ModelBuild {
        /// The spec text.
        text: String,
        /// Why it cannot be built.
        reason: String,
    },
    /// `test_fraction` outside `[0, 1)`.
    #[error("--test-fraction {fraction}: give a fraction from 0 up to (not including) 1 (data.test_fraction)")]
    TestFraction {
        /// The fraction given.
        fraction: f64,
    },
    /// `classes` outside `1..=limit`.
    #[error("--classes {classes}: give a class count from 1 to {limit} (MAX_CLASSES; data.classes)")]
    Classes {
        /// The count given.
        classes: usize,
        /// [`crate::limits::MAX_CLASSES`].
        limit: usize,
    },
    /// `chunks` = 0.
    #[error("--chunks 0: each device needs at least 1 chunk; give --chunks 1 or more (pipeline.chunks)")]
    ZeroChunks,
    /// More than one chunk with a schedule of one stage per device.
    #[error(
        "--chunks {chunks} needs --schedule interleaved or interleaved-zb, not {schedule} (pipeline.chunks, pipeline.schedule)"
    )]
    ChunksNeedInterleaved {
        /// The chunks given.
        chunks: usize,
        /// The schedule given.
        schedule: ScheduleKind,
    },
    /// A V-shaped schedule with a chunk count other than its two.
    #[error(
        "--chunks {chunks} with --schedule {schedule}: {schedule} places exactly {required} chunks per device in a V \
         (device 0 holds the first and the last stage); give --chunks {required} or leave it out (pipeline.chunks)"
    )]
    ChunksForV {
        /// The chunks given.
        chunks: usize,
        /// The schedule given.
        schedule: ScheduleKind,
        /// The chunks it needs.
        required: usize,
    },
    /// A checkpoint without a run spec (written by a library user who set none, or before
    /// checkpoints carried one).
    #[error("{}: the checkpoint holds no run spec (`conveyor.spec` metadata); give the run's spec or flags", path.display())]
    NoSpecInCheckpoint {
        /// The checkpoint.
        path: std::path::PathBuf,
    },
    /// `tensor_parallel` = 0.
    #[error(
        "--tensor-parallel 0: each stage needs at least 1 device; give --tensor-parallel 1 or more (pipeline.tensor_parallel)"
    )]
    ZeroTensorParallel,
    /// `tensor_parallel` over the device limit.
    #[error(
        "--tensor-parallel {tensor_parallel} is over the limit of {limit} devices (MAX_DEVICES); give at most the devices of --devices (pipeline.tensor_parallel)"
    )]
    TensorParallelOverLimit {
        /// The degree given.
        tensor_parallel: usize,
        /// [`crate::limits::MAX_DEVICES`].
        limit: usize,
    },
    /// `stages` = 0.
    #[error(
        "--stages 0: a pipeline needs at least 1 stage; give --stages 1 or more, or leave it out for one stage per device (pipeline.stages)"
    )]
    ZeroStages,
    /// `stages` x `tensor_parallel` over the device limit.
    #[error(
        "--stages {stages} with --tensor-parallel {tensor_parallel} needs more than {limit} devices, the limit (MAX_DEVICES); give fewer stages (pipeline.stages)"
    )]
    StagesOverLimit {
        /// The stages given.
        stages: usize,
        /// The tensor-parallel degree.
        tensor_parallel: usize,
        /// [`crate::limits::MAX_DEVICES`].
        limit: usize,
    },
    /// More devices needed than listed.
    #[error(
        "--stages {stages} with --tensor-parallel {tensor_parallel} needs {needed} devices but --devices {devices} gives {available}; \
         give more devices or fewer stages (pipeline.stages, pipeline.devices)"
    )]
    StagesNeedDevices {
        /// The stages given.
        stages: usize,
        /// The tensor-parallel degree.
        tensor_parallel: usize,
        /// Devices needed.
        needed: usize,
        /// The device list.
        devices: String,
        /// Devices it gives.
        available: usize,
    },
    /// devices x chunks over the stage limit.
    #[error(
        "--chunks {chunks} on {pipeline_devices} pipeline devices makes more than {limit} stages, the limit (MAX_STAGES); give fewer chunks (pipeline.chunks)"
    )]
    ChunksOverLimit {
        /// The chunks given.
        chunks: usize,
        /// Pipeline devices (groups of `tensor_parallel`).
        pipeline_devices: usize,
        /// [`crate::limits::MAX_STAGES`].
        limit: usize,
    },
    /// Devices that do not split into tensor-parallel groups.
    #[error(
        "--tensor-parallel {tensor_parallel}: the {devices} devices do not split into groups of {tensor_parallel}; give stages x {tensor_parallel} devices (pipeline.tensor_parallel)"
    )]
    TensorParallelGroups {
        /// The degree given.
        tensor_parallel: usize,
        /// Devices used.
        devices: usize,
    },
    /// `data_parallel` = 0 or over the device limit.
    #[error("--data-parallel {replicas}: give 1 to {limit} replicas of the pipeline (pipeline.data_parallel)")]
    DataParallelReplicas {
        /// The replicas given.
        replicas: usize,
        /// [`crate::limits::MAX_DEVICES`].
        limit: usize,
    },
    /// Replica weights whose count is not the number of replicas.
    #[error(
        "--replica-shares {shares}: {given} weights for {replicas} replicas; give one weight per replica (--data-parallel), or auto (pipeline.replica_shares)"
    )]
    ReplicaShareCount {
        /// The shares as given.
        shares: String,
        /// Weights given.
        given: usize,
        /// Replicas (`data_parallel`).
        replicas: usize,
    },
    /// A batch whose share for some replica is smaller than its micro-batch count.
    #[error("--replica-shares with --batch: {reason} (pipeline.replica_shares)")]
    ReplicaShareRows {
        /// Which replica falls short, and by how much.
        reason: String,
    },
    /// A ZeRO stage other than 0 or 1.
    #[error("--zero {zero}: give 0 (no sharding) or 1 (optimizer state sharded across replicas) (pipeline.zero)")]
    ZeroStage {
        /// The stage given.
        zero: u8,
    },
    /// Devices that do not split into replicas of tensor-parallel groups.
    #[error(
        "--data-parallel {replicas} --tensor-parallel {tensor_parallel}: the {devices} devices do not split into {replicas} replicas of groups of {tensor_parallel}; give replicas x stages x {tensor_parallel} devices (pipeline.data_parallel)"
    )]
    DataParallelDevices {
        /// The replicas given.
        replicas: usize,
        /// The tensor-parallel degree.
        tensor_parallel: usize,
        /// Devices used.
        devices: usize,
    },
    /// A placement other than `auto` with tensor parallelism.
    #[error("--placement FILE is not supported with --tensor-parallel yet; use --placement auto (pipeline.placement)")]
    TensorParallelPlacement,
    /// `batch` or `microbatches` = 0.
    #[error(
        "--batch {batch} --microbatches {microbatches}: a batch needs at least 1 row and 1 micro-batch; give both at least 1 (training.batch, pipeline.microbatches)"
    )]
    EmptyBatch {
        /// Rows per batch.
        batch: usize,
        /// Micro-batches per batch.
        microbatches: usize,
    },
    /// More micro-batches than rows.
    #[error(
        "--microbatches {microbatches} is more than the {batch} rows of a batch; use at most --microbatches {batch} (pipeline.microbatches)"
    )]
    MicrobatchesOverBatch {
        /// Micro-batches per batch.
        microbatches: usize,
        /// Rows per batch.
        batch: usize,
    },
    /// A batch larger than the training rows.
    #[error("--batch {batch} is larger than the {rows} training rows; give --batch at most {rows} (training.batch)")]
    BatchOverRows {
        /// Rows per batch.
        batch: usize,
        /// Training rows.
        rows: usize,
    },
    /// An `every` of 0 (`eval_every`, `checkpoint.every`).
    #[error("{flag} must be at least 1, got 0; give {flag} N with N >= 1 or leave it out ({key})")]
    ZeroEvery {
        /// The TOML key.
        key: &'static str,
        /// The flag.
        flag: &'static str,
    },
    /// `checkpoint.every` without `checkpoint.path`.
    #[error(
        "--checkpoint-every needs --checkpoint FILE to write the checkpoints to; add --checkpoint FILE or drop --checkpoint-every (checkpoint.every needs checkpoint.path)"
    )]
    CheckpointEveryWithoutPath,
    /// `steps` over [`crate::limits::MAX_STEPS`].
    #[error(
        "--steps {steps} is over the limit of {limit} optimizer steps (MAX_STEPS); give fewer steps or epochs (training.steps)"
    )]
    StepsOverLimit {
        /// Steps given.
        steps: u64,
        /// [`crate::limits::MAX_STEPS`].
        limit: u64,
    },
    /// `epochs` x steps per epoch over [`crate::limits::MAX_STEPS`].
    #[error(
        "--epochs {epochs} of {steps_per_epoch} steps (training rows / --batch) is over the limit of {limit} optimizer steps (MAX_STEPS); give fewer steps or epochs (training.epochs)"
    )]
    EpochsOverLimit {
        /// Epochs given.
        epochs: u64,
        /// Batches per epoch.
        steps_per_epoch: u64,
        /// [`crate::limits::MAX_STEPS`].
        limit: u64,
    },
    /// `momentum` with an optimizer other than `momentum`.
    #[error(
        "--momentum {momentum} applies only to --optimizer momentum, not {optimizer}; drop --momentum or use --optimizer momentum (optimizer.momentum)"
    )]
    MomentumNotApplicable {
        /// The momentum given.
        momentum: f64,
        /// The optimizer.
        optimizer: super::OptimizerKind,
    },
    /// A hyperparameter the optimizer refuses.
    #[error("{flag}: {reason} (--optimizer {optimizer}; {key})")]
    Hyperparameter {
        /// The TOML key (`optimizer.lr`).
        key: &'static str,
        /// The flag (`--lr`).
        flag: &'static str,
        /// The optimizer.
        optimizer: super::OptimizerKind,
        /// Why it is refused.
        reason: String,
    },
    /// Sequence parallelism without a tensor-parallel group to split the sequence over.
    #[error(
        "--sequence-parallel with --tensor-parallel {tensor_parallel}: it splits each transformer block's tokens \
         across a stage's tensor-parallel group; give --tensor-parallel 2 or more, or drop --sequence-parallel \
         (pipeline.sequence_parallel)"
    )]
    SequenceParallelNeedsGroup {
        /// The tensor-parallel degree given.
        tensor_parallel: usize,
    },
    /// Sequence parallelism with a model that has no sequence.
    #[error(
        "--sequence-parallel with --model {model}: it splits a transformer's LayerNorm and residual regions along \
         the tokens, and this model has none; use --model transformer[:VOCAB,T,D,H,L,C] or drop --sequence-parallel \
         (pipeline.sequence_parallel)"
    )]
    SequenceParallelModel {
        /// The model spec given.
        model: String,
    },
    /// A mixed precision with split (tensor-parallel) layers, which compute in f32 only.
    #[error(
        "--precision {precision} with --tensor-parallel {tensor_parallel}: the split layers compute in f32 only; \
         use --precision f32 or --tensor-parallel 1 (training.precision, pipeline.tensor_parallel)"
    )]
    MixedPrecision {
        /// The precision given.
        precision: conveyor_engine::Precision,
        /// The tensor-parallel degree given.
        tensor_parallel: usize,
    },
    /// An interleaving other than `free` for a synchronous strategy, which has none to draw or
    /// replay.
    #[error(
        "--interleaving {interleaving} with --sync {sync}: {sync} is synchronous and has no interleaving to draw or replay; \
         valid with it: free (seed:N and replay:PATH are for --sync downpour:F,P and ssp:S) (pipeline.interleaving)"
    )]
    InterleavingNeedsAsynchronous {
        /// The interleaving given.
        interleaving: super::InterleavingSpec,
        /// The strategy given.
        sync: SyncStrategy,
    },
    /// `record_interleaving` for a run that records no order: a synchronous strategy, or an
    /// asynchronous one running free.
    #[error(
        "--record-interleaving needs an asynchronous --sync (downpour:F,P or ssp:S) with --interleaving seed:N or \
         replay:PATH, whose turns are recorded; this run has --sync {sync} --interleaving {interleaving} \
         (outputs.record_interleaving)"
    )]
    RecordInterleaving {
        /// The strategy given.
        sync: SyncStrategy,
        /// The interleaving given.
        interleaving: super::InterleavingSpec,
    },
    /// A setting the data-parallel strategies cannot honour (`--sync` other than `allreduce`,
    /// `--compress` or `--interleaving` given): only the runtime's own replicas support it.
    #[error(
        "{flag} {value} is not supported with {strategy}: {reason}; --sync allreduce without --compress or \
         --interleaving (the runtime's own replicas) supports it ({key})"
    )]
    StrategyUnsupported {
        /// The flag (`--resume`).
        flag: &'static str,
        /// The TOML key (`checkpoint.resume`).
        key: &'static str,
        /// Its value as given.
        value: String,
        /// The strategy's flags (`--sync ps --compress topk:0.1`).
        strategy: String,
        /// Why the strategies cannot honour it, and what would.
        reason: &'static str,
    },
    /// A batch that does not split evenly among the strategies' workers.
    #[error(
        "--batch {batch} with --data-parallel {replicas}: every worker of {strategy} takes an equal share of each batch \
         and {batch} rows do not split into {replicas}; give --batch a multiple of {replicas} (training.batch)"
    )]
    StrategyBatch {
        /// Rows per batch.
        batch: usize,
        /// Workers (`data_parallel`).
        replicas: usize,
        /// The strategy's flags.
        strategy: String,
    },
    /// [`RunSpec::prepare`](super::RunSpec::prepare) of a spec that trains through the
    /// data-parallel strategies.
    #[error(
        "{strategy} trains through the data-parallel strategies: prepare it with RunSpec::prepare_replicas \
         (RunSpec::prepare builds the runtime's own replicas, --sync allreduce) (pipeline.sync)"
    )]
    StrategyRun {
        /// The strategy's flags.
        strategy: String,
    },
    /// A recorded interleaving (`replay:PATH`) that cannot be read or is not a record of this run's
    /// workers.
    #[error(
        "--interleaving replay:{}: {reason}; give a file --record-interleaving wrote, a JSON array of worker indices \
         below --data-parallel (pipeline.interleaving)",
        path.display()
    )]
    InterleavingFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A placement the planner refuses (unknown nodes, a stage that does not fit).
    #[error("--placement {placement}: {source} (pipeline.placement)")]
    Placement {
        /// The placement file, or `stages` for stages listed in the spec.
        placement: String,
        /// The planner's error.
        source: Box<conveyor_engine::Error>,
    },
    /// Input the parsers of [`crate::cli_input`] refuse (data, devices): the message names the
    /// flag, the value and the fix.
    #[error(transparent)]
    Input(#[from] UsageError),
    /// Planning or building the trainer failed (a schedule the layout cannot run, a model that
    /// does not fit the budgets, ...).
    #[error(transparent)]
    Engine(#[from] conveyor_engine::Error),
}
