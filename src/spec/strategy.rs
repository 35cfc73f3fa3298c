//! The data-parallel strategy of a run: `pipeline.sync`, `pipeline.compress`,
//! `pipeline.interleaving` and `outputs.record_interleaving`. This file owns their spec forms
//! ([`InterleavingSpec`], the TOML text of [`SyncStrategy`] and [`Compression`]), the checks of
//! what a run through the strategies can honour ([`check`], part of [`RunSpec::validate`]),
//! reading a recorded interleaving, and [`RunSpec::prepare_replicas`]: the `data_parallel`
//! independent replica trainers a [`SyncTrainer`] drives, with the run's batches split among them.
//!
//! Two paths, one spec: `allreduce` without compression and with free interleaving is the
//! runtime's own replicas ([`RunSpec::prepare`]: bucketed all-reduce overlapped with the backward
//! pass, checkpoints, traces); any other strategy trains through
//! [`conveyor_engine::strategies`], which exchanges whole gradients (or parameters) between
//! worker threads and server shards, keeps its own optimizer state (following the spec's
//! learning-rate schedule step by step), and records no timeline. What only the runtime's
//! replicas can do (resume, checkpoints, tensor parallelism, ZeRO, unequal shares, buckets,
//! traces, skipping non-finite steps) is refused for the other path, naming the flag ([`SpecError::StrategyUnsupported`]).
use std::io::Read;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use conveyor_engine::optim::OptimizerConfig;
use conveyor_engine::placement::{Placement, Plan};
use conveyor_engine::runtime::{Batch, ReplicaShares, Trainer};
use conveyor_engine::strategies::{Compression, Interleaving, StrategyConfig, SyncStrategy, SyncTrainer};

use super::prepare::{Loaded, Replicated, place_and_build};
use super::toml::{SpecText, reason};
use super::{BucketSize, OnNonFinite, PipelineSection, RunSpec, SpecError};
use crate::cli_input::usage;
use crate::data::{Dataset, epoch_order};
use crate::pipeline::{DataParallel, builder};
use crate::zoo::ModelSpec;

/// The valid values of `--interleaving`, for error messages.
pub const INTERLEAVING_VALUES: &str =
    "free, seed:N (N a whole number: a seeded, recorded order), replay:PATH (a file --record-interleaving wrote)";

/// The largest recorded interleaving `replay:PATH` reads (64 MiB: some 20 million turns).
pub const MAX_INTERLEAVING_FILE_BYTES: u64 = 64 << 20;

/// The order of an asynchronous strategy's turns, as a spec names it (`interleaving` in
/// `[pipeline]`, `--interleaving`): the engine's [`Interleaving`] with a replay's record still in
/// its file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum InterleavingSpec {
    /// `free`: as the threads happen to arrive.
    #[default]
    Free,
    /// `seed:N`: drawn from a generator with this seed, and recorded.
    Seeded(u64),
    /// `replay:PATH`: the turns a run recorded (`--record-interleaving`), read from this file.
    Replay(PathBuf),
}

impl std::fmt::Display for InterleavingSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InterleavingSpec::Free => f.write_str("free"),
            InterleavingSpec::Seeded(seed) => write!(f, "seed:{seed}"),
            InterleavingSpec::Replay(path) => write!(f, "replay:{}", path.display()),
        }
    }
}

impl FromStr for InterleavingSpec {
    type Err = String;

    /// `free`, `seed:N` or `replay:PATH`; the error says what would fix the text.
    fn from_str(text: &str) -> Result<Self, String> {
        match text.split_once(':') {
            None if text == "free" => Ok(InterleavingSpec::Free),
            Some(("seed", seed)) => seed
                .trim()
                .parse()
                .map(InterleavingSpec::Seeded)
                .map_err(|_| format!("`{text}`: N of seed:N must be a whole number; valid: {INTERLEAVING_VALUES}")),
            Some(("replay", "")) => Err(format!("`{text}` names no file; valid: {INTERLEAVING_VALUES}")),
            Some(("replay", path)) => Ok(InterleavingSpec::Replay(PathBuf::from(path))),
            _ => Err(format!("`{text}` is not an interleaving; valid: {INTERLEAVING_VALUES}")),
        }
    }
}

impl SpecText for InterleavingSpec {
    fn to_text(&self) -> String {
        self.to_string()
    }
    fn from_text(text: &str) -> Result<Self, String> {
        text.parse()
    }
}

impl SpecText for SyncStrategy {
    fn to_text(&self) -> String {
        self.to_string()
    }
    fn from_text(text: &str) -> Result<Self, String> {
        text.parse().map_err(reason)
    }
}

impl SpecText for Compression {
    fn to_text(&self) -> String {
        self.to_string()
    }
    fn from_text(text: &str) -> Result<Self, String> {
        text.parse().map_err(reason)
    }
}

impl PipelineSection {
    /// Whether the run trains through the data-parallel strategies: any `sync` but `allreduce`,
    /// any compression, or an interleaving other than `free`. Otherwise the runtime's own
    /// replicas train it ([`RunSpec::prepare`]).
    pub fn uses_strategy(&self) -> bool {
        self.sync != SyncStrategy::AllReduce
            || self.compress != Compression::None
            || self.interleaving != InterleavingSpec::Free
    }

    /// The strategy as flags, for messages: `--sync ps`, with `--compress` and `--interleaving`
    /// when they are not the defaults.
    pub fn strategy_flags(&self) -> String {
        let mut text = format!("--sync {}", self.sync);
        if self.compress != Compression::None {
            text.push_str(&format!(" --compress {}", self.compress));
        }
        if self.compress_after > 0 {
            text.push_str(&format!(" --compress-after {}", self.compress_after));
        }
        if self.interleaving != InterleavingSpec::Free {
            text.push_str(&format!(" --interleaving {}", self.interleaving));
        }
        text
    }
}

/// Part of [`RunSpec::validate`]: the strategy's own values (for specs built in code, which skip
/// the parsers), an interleaving only for asynchronous strategies, a record only of a drawn or
/// replayed order, and, for a run through the strategies, nothing they cannot honour.
pub(super) fn check(spec: &RunSpec) -> Result<(), SpecError> {
    let pipeline = &spec.pipeline;
    let (sync, interleaving) = (pipeline.sync, &pipeline.interleaving);
    // Display then parse: the parsers' checks (K, S, F, P at least 1; a ratio in (0, 1]).
    if let Err(error) = sync.to_string().parse::<SyncStrategy>() {
        return Err(SpecError::Input(usage(format!("--sync: {} (pipeline.sync)", reason(error)))));
    }
    if let Err(error) = pipeline.compress.validate() {
        return Err(SpecError::Input(usage(format!("--compress: {} (pipeline.compress)", reason(error)))));
    }
    if pipeline.compress_after > 0 && pipeline.compress == Compression::None {
        return Err(SpecError::Input(usage(format!(
            "--compress-after {}: there is no compression to start; add --compress (bf16, f16, topk:R or \
             powersgd:R), or drop --compress-after (pipeline.compress_after)",
            pipeline.compress_after
        ))));
    }
    if !sync.is_asynchronous() && *interleaving != InterleavingSpec::Free {
        return Err(SpecError::InterleavingNeedsAsynchronous { interleaving: interleaving.clone(), sync });
    }
    if spec.outputs.record_interleaving.is_some()
        && (!sync.is_asynchronous() || *interleaving == InterleavingSpec::Free)
    {
        return Err(SpecError::RecordInterleaving { sync, interleaving: interleaving.clone() });
    }
    if pipeline.uses_strategy() { check_supported(spec) } else { Ok(()) }
}

/// Refuses what a run through the strategies cannot honour, and a batch that does not split
/// evenly among the workers.
fn check_supported(spec: &RunSpec) -> Result<(), SpecError> {
    let (pipeline, training, checkpoint, outputs) = (&spec.pipeline, &spec.training, &spec.checkpoint, &spec.outputs);
    let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
    const CHECKPOINTS: &str = "the strategies' state (workers, servers, optimizer state) is not checkpointed; --save writes the trained model";
    const TIMELINE: &str = "the strategies' workers record no timeline of ops";
    #[rustfmt::skip]
    let refused: [(&'static str, &'static str, Option<String>, &'static str); 11] = [
        ("--tensor-parallel", "pipeline.tensor_parallel", (pipeline.tensor_parallel > 1).then(|| pipeline.tensor_parallel.to_string()),
            "gradients of tensor-parallel stages are not gathered for the strategies; give --tensor-parallel 1"),
        ("--zero", "pipeline.zero", (pipeline.zero != 0).then(|| pipeline.zero.to_string()),
            "the strategies keep their own optimizer state; give --zero 0"),
        ("--replica-shares", "pipeline.replica_shares", (pipeline.replica_shares != ReplicaShares::Even).then(|| pipeline.replica_shares.to_string()),
            "every worker takes an equal share of each batch; give --replica-shares even"),
        ("--bucket-size", "pipeline.bucket_size", (pipeline.bucket_size != BucketSize::default()).then(|| pipeline.bucket_size.to_string()),
            "the strategies exchange whole gradients, not buckets; leave --bucket-size out"),
        ("--resume", "checkpoint.resume", path(&checkpoint.resume), CHECKPOINTS),
        ("--checkpoint", "checkpoint.path", path(&checkpoint.path), CHECKPOINTS),
        ("--checkpoint-every", "checkpoint.every", checkpoint.every.map(|n| n.to_string()), CHECKPOINTS),
        ("--trace", "outputs.trace", path(&outputs.trace), TIMELINE),
        ("--svg", "outputs.svg", path(&outputs.svg), TIMELINE),
        ("--clip-grad-norm", "optimizer.clip_grad_norm", spec.optimizer.clip_grad_norm.map(|max| max.to_string()),
            "each worker's update uses its own gradients, with no global norm to clip to; leave --clip-grad-norm out"),
        ("--on-nonfinite", "training.on_nonfinite", (training.on_nonfinite != OnNonFinite::Error).then(|| training.on_nonfinite.to_text()),
            "a run through the strategies stops at a non-finite loss; give --on-nonfinite error"),
    ];
    for (flag, key, value, reason) in refused {
        if let Some(value) = value {
            return Err(SpecError::StrategyUnsupported {
                flag,
                key,
                value,
                strategy: pipeline.strategy_flags(),
                reason,
            });
        }
    }
    let replicas = pipeline.data_parallel;
    if !training.batch.is_multiple_of(replicas) {
        return Err(SpecError::StrategyBatch { batch: training.batch, replicas, strategy: pipeline.strategy_flags() });
    }
    Ok(())
}

/// Reads a recorded interleaving: a JSON array of worker indices, each below `workers`.
pub fn read_interleaving(path: &Path, workers: usize) -> Result<Vec<u16>, SpecError> {
    let bad = |reason: String| SpecError::InterleavingFile { path: path.to_path_buf(), reason };
    let file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let mut bytes = Vec::new();
    file.take(MAX_INTERLEAVING_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(|e| bad(e.to_string()))?;
    if bytes.len() as u64 > MAX_INTERLEAVING_FILE_BYTES {
        return Err(bad(format!(
            "the file is over the limit of {MAX_INTERLEAVING_FILE_BYTES} bytes (MAX_INTERLEAVING_FILE_BYTES)"
        )));
    }
    let turns: Vec<u64> =
        serde_json::from_slice(&bytes).map_err(|e| bad(format!("not a JSON array of whole numbers ({e})")))?;
    if turns.is_empty() {
        return Err(bad("the record holds no turns".to_string()));
    }
    turns
        .iter()
        .enumerate()
        .map(|(turn, &worker)| match u16::try_from(worker) {
            Ok(w) if (w as usize) < workers => Ok(w),
            _ => Err(bad(format!("turn {turn} is worker {worker}, but this run has {workers} worker(s)"))),
        })
        .collect()
}

/// A run through the data-parallel strategies, ready to train: `data_parallel` replica trainers
/// built alike from the seed, each on its own devices, and the strategy they train under. The
/// fields are public for a loop of one's own; [`PreparedReplicas::sync_trainer`] hands the
/// replicas to a [`SyncTrainer`], and [`PreparedReplicas::worker_batches`] gives each worker its
/// share of each step's batch.
pub struct PreparedReplicas {
    /// The spec with its model filled in (the data's default model when none was named).
    pub spec: RunSpec,
    /// The parsed model.
    pub model: ModelSpec,
    /// Rows batches are drawn from, fitted to the model.
    pub train: Dataset,
    /// Held-out rows, if the data has them.
    pub test: Option<Dataset>,
    /// Replica 0's placement, which every replica has on its own devices.
    pub plan: Plan,
    /// The replicas, replica `r` on devices `r x P .. (r + 1) x P` of the run's (P pipeline
    /// devices each); taken by [`PreparedReplicas::sync_trainer`].
    pub replicas: Vec<Trainer>,
    /// The optimizer with its defaults filled in (what the strategy updates with).
    pub optimizer: OptimizerConfig,
    /// The strategy, its compression and interleaving (a replay's record read), seeded by the
    /// run's seed.
    pub strategy: StrategyConfig,
    /// Batches per epoch (training rows / batch).
    pub steps_per_epoch: u64,
    /// The run's total steps (`steps`, or `epochs` x `steps_per_epoch`).
    pub total_steps: u64,
    /// Pipeline devices of each replica.
    pub pipeline_devices: usize,
}

impl RunSpec {
    /// Prepares a run through the data-parallel strategies: what [`RunSpec::prepare`] does
    /// (validation, data, devices, model, placement), but with `data_parallel` independent
    /// trainers, each on its share of the devices with `microbatches` micro-batches of its
    /// 1/`data_parallel` share of every batch, placed as replica 0 is; the strategy's recorded
    /// interleaving is read (`replay:PATH`). `init` is not loaded here.
    ///
    /// ```
    /// use conveyor::RunSpec;
    ///
    /// let spec = RunSpec::from_toml_str(
    ///     r#"
    ///     model.spec = "mlp:4,8,2"
    ///     data.source = "synthetic:64,4,2"
    ///     pipeline = { devices = "cpu:2", data_parallel = 2, microbatches = 2, sync = "ps" }
    ///     training = { batch = 16, steps = 3 }
    ///     optimizer.lr_schedule = "constant"
    ///     "#,
    /// )?;
    /// let mut run = spec.prepare_replicas()?;
    /// let mut trainer = run.sync_trainer()?;
    /// let records = trainer.run(3, &run.worker_batches(0))?;
    /// assert!(records.iter().all(|r| r.loss.is_finite() && r.bytes > 0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn prepare_replicas(&self) -> Result<PreparedReplicas, SpecError> {
        self.prepare_replicas_of(None)
    }

    /// [`RunSpec::prepare_replicas`] for one rank of an MPI job, which runs worker `worker` of
    /// `data_parallel` (one per rank): only that worker's replica is built, on its share of the
    /// devices; [`PreparedReplicas::sync_trainer_over`] joins it to the others.
    pub fn prepare_replica_of(&self, worker: usize) -> Result<PreparedReplicas, SpecError> {
        self.prepare_replicas_of(Some(worker))
    }

    fn prepare_replicas_of(&self, only: Option<usize>) -> Result<PreparedReplicas, SpecError> {
        let Loaded {
            model_text,
            model,
            graph,
            train,
            test,
            devices,
            optimizer,
            steps_per_epoch,
            total_steps,
            mut config,
        } = self.load()?;
        // `validate` checks these only for a spec that names a strategy; here plain allreduce
        // runs through the strategies too.
        check_supported(self)?;
        let (pipeline, training) = (&self.pipeline, &self.training);
        let workers = pipeline.data_parallel;
        let interleaving = match &pipeline.interleaving {
            InterleavingSpec::Free => Interleaving::Free,
            InterleavingSpec::Seeded(seed) => Interleaving::Seeded(*seed),
            InterleavingSpec::Replay(path) => Interleaving::Replay(read_interleaving(path, workers)?),
        };
        let mut strategy = StrategyConfig::new(pipeline.sync)
            .compress(pipeline.compress)
            .compress_after(pipeline.compress_after)
            .interleaving(interleaving);
        strategy.seed = training.seed;
        config.batch_rows = training.batch / workers;
        let per_replica = devices.len() / workers;
        let mut first_graph = Some(graph);
        let mut plan: Option<Plan> = None;
        let mut replicas = Vec::with_capacity(workers);
        for (worker, replica_devices) in devices.chunks(per_replica).enumerate() {
            if only.is_some_and(|only| only != worker) {
                continue;
            }
            let graph = match first_graph.take() {
                Some(graph) => graph,
                None => model
                    .build(training.seed)
                    .map_err(|e| SpecError::ModelBuild { text: model_text.clone(), reason: reason(e) })?,
            };
            let trainer = match &plan {
                // Every replica as replica 0 is placed (measured once for `time`).
                Some(plan) => builder(graph, replica_devices.to_vec(), &config)
                    .transport(std::sync::Arc::new(conveyor_engine::transport::InProcess))
                    .placement(Placement::Plan(Box::new(plan.clone())))
                    .build()?,
                None => {
                    let replicated = Replicated {
                        data_parallel: DataParallel::none(),
                        model: model.clone(),
                        seed: training.seed,
                        // Each worker's replica runs here; the strategy exchanges across ranks.
                        in_this_process: true,
                    };
                    let (first_plan, trainer, _) =
                        place_and_build(graph, replica_devices.to_vec(), &config, &pipeline.placement, replicated)?;
                    plan = Some(first_plan);
                    trainer
                }
            };
            replicas.push(trainer);
        }
        let plan = plan.ok_or_else(|| SpecError::from(conveyor_engine::Error::invalid("replicas", "no devices")))?;
        let mut spec = self.clone();
        spec.model.spec = Some(model_text);
        Ok(PreparedReplicas {
            spec,
            model,
            train,
            test,
            plan,
            replicas,
            optimizer,
            strategy,
            steps_per_epoch,
            total_steps,
            pipeline_devices: per_replica,
        })
    }
}

impl PreparedReplicas {
    /// The model spec's text (`mlp:8,16,4`).
    pub fn model_text(&self) -> &str {
        self.spec.model.spec.as_deref().unwrap_or_default()
    }

    /// The epoch step `step` falls in.
    pub fn epoch(&self, step: u64) -> u64 {
        step / self.steps_per_epoch.max(1)
    }

    /// The learning rate of step `step` (0-based) under the spec's schedule, as
    /// [`super::PreparedRun::lr`] gives it.
    pub fn lr(&self, step: u64) -> f64 {
        self.spec.optimizer.lr_schedule.lr(self.optimizer.lr(), step, self.total_steps)
    }

    /// Rows of each worker's share of a batch.
    pub fn worker_rows(&self) -> usize {
        self.spec.training.batch / self.spec.pipeline.data_parallel.max(1)
    }

    /// A [`SyncTrainer`] over the replicas (taken from [`PreparedReplicas::replicas`]) with the
    /// run's optimizer and strategy.
    pub fn sync_trainer(&mut self) -> Result<SyncTrainer, SpecError> {
        let replicas = std::mem::take(&mut self.replicas);
        Ok(SyncTrainer::new(replicas, self.optimizer, self.strategy.clone())?)
    }

    /// This rank's worker (prepared by [`RunSpec::prepare_replica_of`]) joined to the other
    /// ranks' through `transport` ([`SyncTrainer::over_ranks`]); every rank calls it together.
    pub fn sync_trainer_over(
        &mut self,
        transport: std::sync::Arc<dyn conveyor_engine::transport::Transport>,
    ) -> Result<SyncTrainer, SpecError> {
        let mut replicas = std::mem::take(&mut self.replicas);
        let (Some(replica), true) = (replicas.pop(), replicas.is_empty()) else {
            return Err(conveyor_engine::Error::invalid("replicas", "one replica per rank across MPI ranks").into());
        };
        Ok(SyncTrainer::over_ranks(replica, self.optimizer, self.strategy.clone(), transport)?)
    }

    /// What [`SyncTrainer::run`] takes for steps of epoch `epoch`: `(step, worker)` gives worker
    /// `worker` its share of step `step`'s batch, the rows of the step's place in its epoch's
    /// order (as [`super::PreparedRun::step_batch`] draws them) from `worker x rows` on. The
    /// epoch's order is drawn once; a step of another epoch draws its own.
    pub fn worker_batches(&self, epoch: u64) -> impl Fn(usize, usize) -> conveyor_engine::Result<Batch> + Sync + '_ {
        let training = &self.spec.training;
        let (batch, shuffle, seed) = (training.batch, training.shuffle, training.seed);
        let (rows, steps_per_epoch, train) = (self.worker_rows(), self.steps_per_epoch.max(1), &self.train);
        let order = epoch_order(train.len(), shuffle, seed, epoch);
        move |step, worker| {
            let step = step as u64;
            let other;
            let order = match step / steps_per_epoch {
                e if e == epoch => &order,
                e => {
                    other = epoch_order(train.len(), shuffle, seed, e);
                    &other
                }
            };
            let at = (step % steps_per_epoch) as usize * batch + worker * rows;
            let indices = order.get(at..at + rows).ok_or_else(|| {
                conveyor_engine::Error::invalid("worker", format!("worker {worker} has no rows in step {step}"))
            })?;
            Ok(Batch::from(train.batch(indices)?))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::LrSchedule;

    #[test]
    fn interleavings_parse_and_print_back() {
        for text in ["free", "seed:0", "seed:18446744073709551615", "replay:runs/turns.json"] {
            assert_eq!(text.parse::<InterleavingSpec>().unwrap().to_string(), text);
        }
        for text in ["", "seeded", "seed:", "seed:-1", "replay:", "free:1"] {
            let error = text.parse::<InterleavingSpec>().unwrap_err();
            assert!(error.contains("replay:PATH"), "{text:?}: {error}");
        }
    }

    #[test]
    fn strategies_built_in_code_are_checked_as_the_parsers_check_them() {
        let mut spec = RunSpec::default();
        spec.optimizer.lr_schedule = LrSchedule::Constant;
        spec.pipeline.sync = SyncStrategy::Average { every: 0 };
        let error = spec.validate().unwrap_err().to_string();
        assert!(error.contains("--sync: K of average:K must be at least 1"), "{error}");
        spec.pipeline.sync = SyncStrategy::ParameterServer { shards: 1 };
        spec.pipeline.compress = Compression::TopK { ratio: f64::NAN };
        assert!(spec.validate().unwrap_err().to_string().contains("--compress: top-k ratio NaN"));
        spec.pipeline.compress = Compression::None;
        spec.validate().unwrap();
        assert!(matches!(spec.prepare(), Err(SpecError::StrategyRun { .. })));
    }
}
