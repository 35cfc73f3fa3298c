//! [`SyncTrainer`]: `R` worker replicas trained under one [`super::SyncStrategy`], each worker a
//! thread driving its own [`Trainer`] (gradients only), server shards threads of their own; or one
//! worker per MPI rank ([`SyncTrainer::over_ranks`], what differs lives in `ranks.rs`).
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam::channel::{self, Sender};

use super::compress::{self, Compression, Compressor};
use super::links::{Abort, Action, Exchange, RunStats, Turnstile, WorkerExchange};
use super::powersgd::{AllGather, CollectivePowerSgd};
use super::ranks::{self, DEFAULT_COLLECTIVE_TIMEOUT, RankExchange, Ranks};
use super::remote::{self, REMOTE_FAILURE, ServerLinks, ServerRanks};
use super::server::{Pulled, Reply, ServerShard, ToServer, mean_in_order};
use super::{Interleaving, StrategyConfig, SyncStrategy};
use crate::optim::{Optimizer, OptimizerConfig};
use crate::runtime::{Batch, Evaluation, Trainer};
use crate::transport::Transport;
use crate::{Device, Error, Result, Shape, Tensor};

/// What one step (every worker's step of that index) did.
#[derive(Clone, Debug, PartialEq)]
pub struct StepRecord {
    /// The step's index since training began.
    pub step: usize,
    /// The mean of the workers' losses (each on its share of the step's batch).
    pub loss: f64,
    /// Bytes sent in the step by workers and servers (see `README.md` for how each exchange is
    /// counted).
    pub bytes: u64,
    /// Updates a server applied between a worker's pull and its push, over the step's pushes:
    /// mean (0 for synchronous strategies).
    pub staleness_mean: f64,
    /// The largest staleness of the step's pushes.
    pub staleness_max: u64,
    /// Seconds from the run's start until the last worker finished the step.
    pub elapsed_s: f64,
}

/// A worker's own state, kept across runs.
#[derive(Debug)]
struct WorkerState {
    /// Its copy of the parameters (all strategies but the servers', whose copy is what it pulls).
    params: Vec<Tensor>,
    /// Its optimizer: `allreduce`, `average:K`, and Downpour's local updates.
    optimizer: Option<Optimizer>,
    compressor: Compressor,
    /// PowerSGD over the all-gather (`allreduce`, `average:K` with `--compress powersgd:R`).
    powersgd: Option<CollectivePowerSgd>,
    /// `average:K`: the parameters at the last average.
    anchor: Vec<Tensor>,
    /// Downpour: gradients accumulated since the last push.
    accumulated: Vec<Vec<f32>>,
    /// Per server shard, the version of its last pull.
    pulled: Vec<u64>,
}

/// Replicas trained under a data-parallel strategy; see the module documentation.
///
/// ```
#[doc = include_str!("../runtime/doc_model.md")]
/// use conveyor_engine::runtime::Batch;
/// use conveyor_engine::strategies::{StrategyConfig, SyncTrainer};
///
/// // Two replicas of `y = w x` (w = 0, targets 2 x) behind a synchronous parameter server.
/// let replicas = vec![model()?, model()?];
/// let config = StrategyConfig::new("ps".parse()?);
/// let mut trainer = SyncTrainer::new(replicas, OptimizerConfig::sgd(0.5), config)?;
/// // Worker `w` of step `t` trains on its own 4 rows.
/// let records = trainer.run(20, &|t, w| Ok(Batch::from(data(4, (2 * t + w) as u64)?)))?;
/// assert!(records[19].loss < records[0].loss);
/// assert!(records.iter().all(|r| r.staleness_max == 0 && r.bytes > 0));
/// let w = trainer.parameters()?[0].1.to_vec_f32()[0];
/// assert!((w - 2.0).abs() < 1e-3, "{w}");
/// # Ok::<(), conveyor_engine::Error>(())
/// ```
pub struct SyncTrainer {
    config: StrategyConfig,
    replicas: Vec<Trainer>,
    names: Vec<String>,
    shapes: Vec<Shape>,
    workers: Vec<WorkerState>,
    servers: Vec<ServerShard>,
    step: usize,
    turns: Vec<u16>,
    bytes_sent: u64,
    /// Across MPI ranks: this rank runs worker `rank` of `world_size` ([`SyncTrainer::over_ranks`]).
    ranks: Option<Ranks>,
    /// The server strategies across ranks: the trainer's inboxes (`remote.rs`).
    server_ranks: Option<ServerRanks>,
    /// Across ranks, after the last run: `average:K`'s workers' mean, or the server shards'
    /// parameters gathered from the ranks that host them.
    consensus: Option<Vec<Tensor>>,
}

impl std::fmt::Debug for SyncTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyncTrainer")
            .field("config", &self.config)
            .field("replicas", &self.replicas.len())
            .field("step", &self.step)
            .field("bytes_sent", &self.bytes_sent)
            .field("ranks", &self.ranks.as_ref().map(|r| (r.rank(), r.world_size())))
            .finish_non_exhaustive()
    }
}

impl SyncTrainer {
    /// `replicas` (built alike, from one seed, each on its own devices) trained under `config`,
    /// every update by `optimizer` (the replicas' own optimizers are not used).
    pub fn new(replicas: Vec<Trainer>, optimizer: OptimizerConfig, config: StrategyConfig) -> Result<SyncTrainer> {
        SyncTrainer::build(replicas, optimizer, config, 0)
    }

    /// This rank's worker of a run across MPI ranks: `replica` is worker `transport.rank()` of
    /// `transport.world_size()`, and `allreduce` and `average:K` (with any compression) exchange
    /// through [`Transport::all_gather`], computing the same bits as [`SyncTrainer::new`] with as
    /// many in-process replicas. The server strategies (`ps`, `downpour`, `ssp`) keep shard `s` on
    /// rank `s mod R` and send pulls, pushes and (deterministic mode) turns through the transport
    /// (`remote.rs`); a seeded run gives the in-process run's bits. Every rank must call it (it
    /// checks, with an all-gather, that every rank has the same strategy, optimizer and initial
    /// parameters, and refuses otherwise) and then make the same calls in the same order; `run`'s
    /// `batches(step, worker)` is asked only for this rank's worker. `replica` itself should run
    /// in this process (the in-process transport). `ranks.rs` and `remote.rs` describe the
    /// failure behaviour.
    pub fn over_ranks(
        replica: Trainer,
        optimizer: OptimizerConfig,
        config: StrategyConfig,
        transport: Arc<dyn Transport>,
    ) -> Result<SyncTrainer> {
        let world = transport.world_size();
        if world == 0 || world > usize::from(u16::MAX) || transport.rank() >= world {
            return Err(Error::invalid(
                "transport",
                format!("rank {} of {world} ranks: need 1 to {} ranks", transport.rank(), u16::MAX),
            ));
        }
        // The check first, so that ranks given different settings all fail here together rather
        // than some refusing alone while the others wait for them.
        let ranks = Ranks { transport, timeout: DEFAULT_COLLECTIVE_TIMEOUT };
        let round =
            ranks::check_same_start(&ranks, &config, &optimizer, remote::proposed_round(), &replica.parameters()?)?;
        remote::agreed_round(round);
        config.validate()?;
        let server_ranks = match config.sync.server_shards() {
            Some(_) => Some(ServerRanks::open(Arc::clone(&ranks.transport), round)?),
            None => None,
        };
        let mut trainer = SyncTrainer::build(vec![replica], optimizer, config, ranks.rank())?;
        trainer.ranks = Some(ranks);
        trainer.server_ranks = server_ranks;
        Ok(trainer)
    }

    /// How long a rank waits in one of the strategy's all-gathers for the others before failing
    /// (runs across ranks; 300 s unless set).
    pub fn set_collective_timeout(&mut self, timeout: Duration) {
        if let Some(ranks) = self.ranks.as_mut() {
            ranks.timeout = timeout;
        }
    }

    /// The workers of the strategy (the replicas, or the ranks).
    pub fn n_workers(&self) -> usize {
        self.ranks.as_ref().map_or(self.replicas.len(), Ranks::world_size)
    }

    /// `replicas` are workers `first_worker..`.
    fn build(
        replicas: Vec<Trainer>,
        optimizer: OptimizerConfig,
        config: StrategyConfig,
        first_worker: usize,
    ) -> Result<SyncTrainer> {
        config.validate()?;
        optimizer.validate()?;
        let Some(first) = replicas.first() else {
            return Err(Error::invalid("replicas", "a data-parallel strategy needs at least one replica"));
        };
        if replicas.len() > usize::from(u16::MAX) {
            return Err(Error::invalid("replicas", format!("at most {} replicas, got {}", u16::MAX, replicas.len())));
        }
        let initial = first.parameters()?;
        for (r, replica) in replicas.iter().enumerate().skip(1) {
            let theirs = replica.parameters()?;
            let same = theirs.len() == initial.len()
                && theirs.iter().zip(&initial).all(|((n1, t1), (n2, t2))| n1 == n2 && t1.bit_eq(t2));
            if !same {
                return Err(Error::invalid(
                    "replicas",
                    format!(
                        "replica {r} does not start from replica 0's parameters: build every replica from one seed"
                    ),
                ));
            }
        }
        let names: Vec<String> = initial.iter().map(|(n, _)| n.clone()).collect();
        let shapes: Vec<Shape> = initial.iter().map(|(_, t)| t.shape().clone()).collect();
        let params: Vec<Tensor> =
            initial.into_iter().map(|(_, t)| t.to_device(&Device::host())).collect::<Result<_>>()?;
        let shards = config.sync.server_shards().unwrap_or(0).min(params.len().max(1));
        let servers =
            (0..shards).map(|s| ServerShard::new(s, shards, &params, &optimizer)).collect::<Result<Vec<_>>>()?;
        let keeps_optimizer = !matches!(config.sync, SyncStrategy::ParameterServer { .. } | SyncStrategy::Ssp { .. });
        let workers = (0..replicas.len())
            .map(|w| {
                Ok(WorkerState {
                    params: clone_all(&params)?,
                    optimizer: if keeps_optimizer { Some(Optimizer::new(optimizer, params.len())?) } else { None },
                    compressor: Compressor::new(config.compress, config.seed.wrapping_add((first_worker + w) as u64)),
                    powersgd: match (config.compress, config.sync) {
                        (Compression::PowerSgd { rank }, SyncStrategy::AllReduce | SyncStrategy::Average { .. }) => {
                            Some(CollectivePowerSgd::new(rank, config.seed))
                        }
                        _ => None,
                    },
                    anchor: if matches!(config.sync, SyncStrategy::Average { .. }) {
                        clone_all(&params)?
                    } else {
                        Vec::new()
                    },
                    accumulated: Vec::new(),
                    pulled: vec![0; shards],
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SyncTrainer {
            config,
            replicas,
            names,
            shapes,
            workers,
            servers,
            step: 0,
            turns: Vec::new(),
            bytes_sent: 0,
            ranks: None,
            server_ranks: None,
            consensus: None,
        })
    }

    /// The strategy's settings.
    pub fn config(&self) -> &StrategyConfig {
        &self.config
    }

    /// Steps every worker has taken.
    pub fn step_idx(&self) -> usize {
        self.step
    }

    /// The turns of every pull and push so far, in order (deterministic runs; empty otherwise):
    /// what [`Interleaving::Replay`] takes to replay the run.
    pub fn interleaving(&self) -> &[u16] {
        &self.turns
    }

    /// Sets the learning rate of every optimizer the strategy steps (the workers' and the
    /// servers'), for a schedule applied between runs.
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        for worker in &mut self.workers {
            if let Some(optimizer) = worker.optimizer.as_mut() {
                optimizer.set_lr(lr)?;
            }
        }
        self.servers.iter_mut().try_for_each(|shard| shard.set_lr(lr))
    }

    /// Bytes sent since training began.
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    /// The model the strategy stands for: the servers' parameters, worker 0's (`allreduce`, where
    /// all are equal) or the workers' mean (`average:K`), named as [`Trainer::parameters`].
    pub fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let values: Vec<Tensor> = match self.config.sync {
            SyncStrategy::AllReduce => clone_all(&self.workers[0].params)?,
            SyncStrategy::Average { .. } => match (&self.ranks, &self.consensus) {
                (Some(_), Some(consensus)) => clone_all(consensus)?,
                (ranks, _) => {
                    // Before any run across ranks every worker holds this rank's parameters.
                    let copies = ranks.as_ref().map_or(1, Ranks::world_size);
                    let per_worker: Vec<Vec<Vec<f32>>> = self
                        .workers
                        .iter()
                        .flat_map(|w| std::iter::repeat_n(w, copies))
                        .map(|w| w.params.iter().map(Tensor::to_vec_f32).collect())
                        .collect();
                    self.tensors(mean_in_order(per_worker))?
                }
            },
            _ if self.consensus.is_some() => clone_all(self.consensus.as_deref().unwrap_or_default())?,
            _ => {
                // Before any run across ranks every rank's shards hold the initial parameters.
                let mut values: Vec<Option<Tensor>> = (0..self.names.len()).map(|_| None).collect();
                for shard in &self.servers {
                    for (&i, p) in shard.tensors.iter().zip(&shard.params) {
                        values[i] = Some(p.try_clone()?);
                    }
                }
                values
                    .into_iter()
                    .map(|v| v.ok_or_else(|| Error::invalid("servers", "a tensor no shard owns")))
                    .collect::<Result<_>>()?
            }
        };
        Ok(self.names.iter().cloned().zip(values).collect())
    }

    /// Evaluates the model the strategy stands for ([`SyncTrainer::parameters`]) on `batch`, on
    /// replica 0 (whose own parameters are put back after).
    pub fn evaluate(&mut self, batch: impl Into<Batch>) -> Result<Evaluation> {
        let consensus = self.parameters()?;
        let own = self.replicas[0].parameters()?;
        self.replicas[0].load_parameters(consensus)?;
        let evaluation = self.replicas[0].evaluate(batch);
        self.replicas[0].load_parameters(own)?;
        evaluation
    }

    fn tensors(&self, values: Vec<Vec<f32>>) -> Result<Vec<Tensor>> {
        values.into_iter().zip(&self.shapes).map(|(v, s)| Tensor::from_vec(v, s.clone(), &Device::host())).collect()
    }

    /// Runs `steps` steps on every worker; `batches(step, worker)` gives each worker its part of
    /// the step's batch (across ranks: only this rank's worker is asked). Asynchronous workers run free within the run and meet at its end. The
    /// learning rate stays as it is ([`SyncTrainer::set_lr`]); see [`SyncTrainer::run_with_lr`].
    pub fn run(
        &mut self,
        steps: usize,
        batches: &(dyn Fn(usize, usize) -> Result<Batch> + Sync),
    ) -> Result<Vec<StepRecord>> {
        self.run_with_lr(steps, batches, None)
    }

    /// [`SyncTrainer::run`] with a learning-rate schedule: `lr(step)` is the rate of every update
    /// of step `step` (a worker's own step, or a server applying that step's gradients; an
    /// asynchronous server applies a push at the rate of the step it was computed in).
    pub fn run_with_lr(
        &mut self,
        steps: usize,
        batches: &(dyn Fn(usize, usize) -> Result<Batch> + Sync),
        lr: Option<&(dyn Fn(usize) -> f64 + Sync)>,
    ) -> Result<Vec<StepRecord>> {
        let start = self.step;
        let n_workers = self.n_workers();
        let first_worker = self.ranks.as_ref().map_or(0, Ranks::rank);
        let stats = RunStats::new(start, steps);
        let abort = Abort::default();
        let in_process;
        let across_ranks;
        let exchange: &dyn WorkerExchange = match &self.ranks {
            Some(ranks) => {
                across_ranks = RankExchange { ranks };
                &across_ranks
            }
            None => {
                in_process = Exchange::new(n_workers);
                &in_process
            }
        };
        let sync = self.config.sync;
        let deterministic = sync.is_asynchronous() && !matches!(self.config.interleaving, Interleaving::Free);
        let server_ranks = self.server_ranks.as_ref();
        // The turnstile lives in this process, or on rank 0 across ranks.
        let turnstile = match (deterministic, server_ranks.map(ServerRanks::rank)) {
            (true, None | Some(0)) => {
                let actions = (0..n_workers).map(|_| actions_of(sync, start, steps)).collect();
                let staleness = if let SyncStrategy::Ssp { staleness } = sync { Some(staleness) } else { None };
                Some(Turnstile::new(&self.config.interleaving, actions, start, staleness, self.turns.len()))
            }
            _ => None,
        };
        let timeout = self.ranks.as_ref().map_or(DEFAULT_COLLECTIVE_TIMEOUT, |r| r.timeout);
        let shared = Shared {
            sync,
            compression: self.config.compress,
            compress_after: self.config.compress_after,
            n_workers,
            names: &self.names,
            shapes: &self.shapes,
            stats: &stats,
            abort: &abort,
            exchange,
            turnstile: turnstile.as_ref(),
            server_ranks: if deterministic { server_ranks } else { None },
            timeout,
            started: Instant::now(),
            batches,
            lr,
        };
        let finished = std::sync::atomic::AtomicBool::new(false);
        let (mut errors, remote_failure): (Vec<(usize, Error)>, Option<String>) = std::thread::scope(|scope| {
            let n_local = self.replicas.len();
            let n_shards = self.servers.len();
            // Shard `s` runs here in one process, across ranks on rank `s mod R`.
            let hosted = |s: usize| server_ranks.is_none_or(|r| r.host(s) == r.rank());
            let mut inboxes: Vec<Option<Sender<ToServer>>> = Vec::with_capacity(n_shards);
            let mut threads = Vec::new();
            for (s, shard) in self.servers.iter_mut().enumerate() {
                if !hosted(s) {
                    inboxes.push(None);
                    continue;
                }
                let (tx, rx) = channel::unbounded();
                inboxes.push(Some(tx));
                let (stats, abort) = (&stats, &abort);
                let is_ps = matches!(sync, SyncStrategy::ParameterServer { .. });
                threads.push((
                    n_local + s,
                    scope
                        .spawn(move || guarded(n_local + s, abort, || shard.serve(rx, n_workers, is_ps, stats, abort))),
                ));
            }
            let mut who = n_local + n_shards;
            if let Some(remote) = server_ranks.filter(|r| r.hosts_any(n_shards)) {
                let (bridge_inboxes, abort) = (inboxes.clone(), &abort);
                threads.push((
                    who,
                    scope.spawn(move || {
                        guarded(who, abort, || remote.bridge(bridge_inboxes, deterministic, abort, timeout))
                    }),
                ));
                who += 1;
            }
            if let (Some(remote), Some(turnstile)) = (server_ranks, turnstile.as_ref()) {
                for worker in 1..n_workers {
                    let turns = actions_of(sync, start, steps).len();
                    let abort = &abort;
                    threads.push((
                        who,
                        scope.spawn(move || {
                            guarded(who, abort, || remote.serve_turns(turnstile, worker, turns, abort, timeout))
                        }),
                    ));
                    who += 1;
                }
            }
            let watcher = server_ranks.map(|remote| {
                let (abort, finished) = (&abort, &finished);
                scope.spawn(move || remote.watch_failures(abort, finished))
            });
            let workers: Vec<_> = self
                .replicas
                .iter_mut()
                .zip(self.workers.iter_mut())
                .enumerate()
                .map(|(i, (trainer, state))| {
                    let w = first_worker + i;
                    let links = ServerLinks::new(inboxes.clone(), server_ranks);
                    let shared = &shared;
                    scope.spawn(move || {
                        guarded(i, shared.abort, || {
                            (start..start + steps)
                                .try_for_each(|t| shared.worker_step(w, t, trainer, state, &links))?;
                            match server_ranks {
                                Some(remote) => remote.worker_done(w, links.shards()),
                                None => Ok(()),
                            }
                        })
                    })
                })
                .collect();
            drop(inboxes);
            // Thread `who` (workers first, then servers, the bridge and turn proxies) and its
            // error; `guarded` caught panics.
            let mut errors = Vec::new();
            for (who, handle) in workers.into_iter().enumerate().chain(threads) {
                if let Ok(Err(error)) = handle.join() {
                    errors.push((who, error));
                }
            }
            finished.store(true, std::sync::atomic::Ordering::SeqCst);
            let remote_failure = watcher.and_then(|w| w.join().ok().flatten());
            (errors, remote_failure)
        });
        if !errors.is_empty() {
            if abort.first() == Some(REMOTE_FAILURE) {
                return Err(Error::invalid(
                    "strategy over ranks",
                    format!("another rank failed: {}", remote_failure.as_deref().unwrap_or("(no reason given)")),
                ));
            }
            // The first failure, not the stops it caused elsewhere.
            let first = errors.iter().position(|(who, _)| Some(*who) == abort.first()).unwrap_or(0);
            let error = errors.swap_remove(first).1;
            if let Some(remote) = server_ranks {
                remote.notify_failure(&error);
            }
            if let Some(turnstile) = turnstile {
                self.turns.extend(turnstile.into_record());
            }
            return Err(error);
        }
        let mut record = turnstile.map(Turnstile::into_record).unwrap_or_default();
        let mut steps_stats = stats.steps.into_inner();
        if let Some(ranks) = &self.ranks {
            steps_stats = ranks::combine_stats(ranks, steps_stats)?;
            match sync {
                SyncStrategy::Average { .. } => {
                    let mean = ranks::mean_over_ranks(ranks, &self.workers[0].params)?;
                    self.consensus = Some(self.tensors(mean)?);
                }
                SyncStrategy::AllReduce => {}
                _ => {
                    let hosted: Vec<(usize, &Tensor)> = self
                        .servers
                        .iter()
                        .filter(|shard| super::remote::host_rank(shard.shard, ranks.world_size()) == ranks.rank())
                        .flat_map(|shard| shard.tensors.iter().copied().zip(&shard.params))
                        .collect();
                    self.consensus = Some(ranks::gather_tensors(ranks, &hosted, &self.shapes)?);
                    if deterministic {
                        record = ranks::rank_zero_turns(ranks, &record)?;
                    }
                }
            }
        }
        self.turns.extend(record);
        self.step += steps;
        let records: Vec<StepRecord> = steps_stats
            .into_iter()
            .enumerate()
            .map(|(i, s)| StepRecord {
                step: start + i,
                loss: s.loss_sum / s.losses.max(1) as f64,
                bytes: s.bytes,
                staleness_mean: if s.pushes == 0 { 0.0 } else { s.staleness_sum as f64 / s.pushes as f64 },
                staleness_max: s.staleness_max,
                elapsed_s: s.finished_s,
            })
            .collect();
        self.bytes_sent += records.iter().map(|r| r.bytes).sum::<u64>();
        Ok(records)
    }
}

/// A worker's pulls and pushes, in order, for the steps `start..start + steps` of an
/// asynchronous strategy (what the turnstile orders).
fn actions_of(sync: SyncStrategy, start: usize, steps: usize) -> Vec<Action> {
    let mut actions = Vec::new();
    for t in start..start + steps {
        match sync {
            SyncStrategy::Downpour { fetch_every, push_every } => {
                if t.is_multiple_of(fetch_every) {
                    actions.push(Action::Pull { step: t });
                }
                if (t + 1).is_multiple_of(push_every) {
                    actions.push(Action::Push { step: t });
                }
            }
            SyncStrategy::Ssp { .. } => actions.extend([Action::Pull { step: t }, Action::Push { step: t }]),
            _ => {}
        }
    }
    actions
}

/// What every worker of a run reads.
struct Shared<'a> {
    sync: SyncStrategy,
    compression: Compression,
    compress_after: usize,
    n_workers: usize,
    names: &'a [String],
    shapes: &'a [Shape],
    stats: &'a RunStats,
    abort: &'a Abort,
    exchange: &'a dyn WorkerExchange,
    /// The deterministic mode's turnstile, in this process (or on rank 0 across ranks).
    turnstile: Option<&'a Turnstile>,
    /// The deterministic mode across ranks: turns from rank 0, receipts from remote shards.
    server_ranks: Option<&'a ServerRanks>,
    /// How long a wait for another rank may last.
    timeout: Duration,
    started: Instant,
    batches: &'a (dyn Fn(usize, usize) -> Result<Batch> + Sync),
    lr: Option<&'a (dyn Fn(usize) -> f64 + Sync)>,
}

impl Shared<'_> {
    /// The codec of step `t`'s exchanges.
    fn codec(&self, t: usize) -> Compression {
        if t < self.compress_after { Compression::None } else { self.compression }
    }

    fn worker_step(
        &self,
        w: usize,
        t: usize,
        trainer: &mut Trainer,
        state: &mut WorkerState,
        servers: &ServerLinks<'_>,
    ) -> Result<()> {
        self.abort.check()?;
        if let (Some(lr), Some(optimizer)) = (self.lr, state.optimizer.as_mut()) {
            optimizer.set_lr(lr(t))?;
        }
        let batch = (self.batches)(t, w)?;
        let loss = match self.sync {
            SyncStrategy::AllReduce => {
                let (report, grads) = trainer.gradient_step(batch)?;
                let mean = self.average_over_workers(w, t, state, &values_of(&grads))?;
                step_optimizer(state, self.shapes, &mean)?;
                load(trainer, self.names, &state.params)?;
                report.loss
            }
            SyncStrategy::Average { every } => {
                let (report, grads) = trainer.gradient_step(batch)?;
                step_optimizer(state, self.shapes, &values_of(&grads))?;
                if (t + 1).is_multiple_of(every) {
                    let deltas: Vec<Vec<f32>> = state
                        .params
                        .iter()
                        .zip(&state.anchor)
                        .map(|(p, a)| p.to_vec_f32().iter().zip(a.to_vec_f32()).map(|(p, a)| p - a).collect())
                        .collect();
                    let mean = self.average_over_workers(w, t, state, &deltas)?;
                    let averaged: Vec<Vec<f32>> = state
                        .anchor
                        .iter()
                        .zip(mean)
                        .map(|(a, d)| a.to_vec_f32().iter().zip(d).map(|(a, d)| a + d).collect())
                        .collect();
                    state.params = host_tensors(averaged, self.shapes)?;
                    state.anchor = clone_all(&state.params)?;
                }
                load(trainer, self.names, &state.params)?;
                report.loss
            }
            SyncStrategy::ParameterServer { .. } => {
                self.pull(w, t, t as u64, trainer, state, servers)?;
                let (report, grads) = trainer.gradient_step(batch)?;
                self.push(w, t, state, servers, &values_of(&grads))?;
                report.loss
            }
            SyncStrategy::Downpour { fetch_every, push_every } => {
                if t.is_multiple_of(fetch_every) {
                    self.pull(w, t, 0, trainer, state, servers)?;
                }
                let (report, grads) = trainer.gradient_step(batch)?;
                let grads = values_of(&grads);
                if state.accumulated.is_empty() {
                    state.accumulated = grads.iter().map(|g| vec![0.0; g.len()]).collect();
                }
                for (acc, g) in state.accumulated.iter_mut().zip(&grads) {
                    acc.iter_mut().zip(g).for_each(|(a, g)| *a += g);
                }
                step_optimizer(state, self.shapes, &grads)?;
                load(trainer, self.names, &state.params)?;
                if (t + 1).is_multiple_of(push_every) {
                    let accumulated = std::mem::take(&mut state.accumulated);
                    self.push(w, t, state, servers, &accumulated)?;
                }
                report.loss
            }
            SyncStrategy::Ssp { staleness } => {
                // Step `t` starts once every worker pushed step `t - staleness - 1`: the shards
                // hold the pull until then (they count the pushes).
                self.pull_when(w, t, 0, t.saturating_sub(staleness), trainer, state, servers)?;
                let (report, grads) = trainer.gradient_step(batch)?;
                self.push(w, t, state, servers, &values_of(&grads))?;
                report.loss
            }
        };
        let elapsed = self.started.elapsed().as_secs_f64();
        self.stats.with(t, |s| {
            s.loss_sum += loss;
            s.losses += 1;
            s.finished_s = s.finished_s.max(elapsed);
        });
        Ok(())
    }

    /// The workers' mean of `values` (compressed on the way), the same on every worker.
    fn average_over_workers(
        &self,
        w: usize,
        t: usize,
        state: &mut WorkerState,
        values: &[Vec<f32>],
    ) -> Result<Vec<Vec<f32>>> {
        let codec = self.codec(t);
        let group = Gather { shared: self, worker: w, step: t, codec };
        if let (Some(powersgd), Compression::PowerSgd { .. }) = (state.powersgd.as_mut(), codec) {
            let dims: Vec<&[usize]> = self.shapes.iter().map(Shape::dims).collect();
            return powersgd.mean(&dims, values, &group, self.n_workers);
        }
        let mut payload = Vec::new();
        for (i, (v, shape)) in values.iter().zip(self.shapes).enumerate() {
            payload.extend(encode(&mut state.compressor, codec, i, shape.dims(), v)?);
        }
        let parts = group.all_gather(payload)?;
        let decoded = parts.iter().map(|part| decode_all(codec, self.shapes, part)).collect::<Result<Vec<_>>>()?;
        Ok(mean_in_order(decoded))
    }

    /// Pulls every shard's parameters (at least `min_version` updates) into the worker's trainer.
    fn pull(
        &self,
        w: usize,
        t: usize,
        min_version: u64,
        trainer: &mut Trainer,
        state: &mut WorkerState,
        servers: &ServerLinks<'_>,
    ) -> Result<()> {
        self.pull_when(w, t, min_version, 0, trainer, state, servers)
    }

    /// [`Shared::pull`] once every shard also took `min_pushes` pushes from every worker.
    #[allow(clippy::too_many_arguments)]
    fn pull_when(
        &self,
        w: usize,
        t: usize,
        min_version: u64,
        min_pushes: usize,
        trainer: &mut Trainer,
        state: &mut WorkerState,
        servers: &ServerLinks<'_>,
    ) -> Result<()> {
        let (tx, rx) = channel::unbounded::<Pulled>();
        self.in_turn(w, || {
            let mut remote = 0;
            for shard in 0..servers.shards() {
                let message = ToServer::Pull { step: t, min_version, min_pushes, reply: Reply::Local(tx.clone()) };
                remote += usize::from(servers.send(shard, message)?);
            }
            Ok(remote)
        })?;
        let mut params: Vec<Option<Tensor>> = (0..self.names.len()).map(|_| None).collect();
        for pulled in servers.collect(&rx, servers.shards(), self.abort, self.timeout)? {
            let version = state.pulled.get_mut(pulled.shard).ok_or_else(|| {
                Error::invalid(
                    "parameter server",
                    format!("an answer from shard {} of {}", pulled.shard, servers.shards()),
                )
            })?;
            *version = pulled.version;
            for (i, tensor) in pulled.params {
                params[i] = Some(tensor);
            }
        }
        let params: Vec<Tensor> = params
            .into_iter()
            .map(|p| p.ok_or_else(|| Error::invalid("parameter server", "a pull missed a tensor")))
            .collect::<Result<_>>()?;
        load(trainer, self.names, &params)?;
        if state.optimizer.is_some() {
            state.params = params; // Downpour's local updates start from what was fetched
        }
        Ok(())
    }

    /// Pushes `values` (gradients), compressed, to the shards that own them.
    fn push(
        &self,
        w: usize,
        t: usize,
        state: &mut WorkerState,
        servers: &ServerLinks<'_>,
        values: &[Vec<f32>],
    ) -> Result<()> {
        let shards = servers.shards();
        let codec = self.codec(t);
        let mut per_shard: Vec<Vec<Vec<u8>>> = vec![Vec::new(); shards];
        let mut bytes = 0;
        for (i, (v, shape)) in values.iter().zip(self.shapes).enumerate() {
            let encoded = encode(&mut state.compressor, codec, i, shape.dims(), v)?;
            bytes += encoded.len() as u64;
            per_shard[i % shards].push(encoded);
        }
        self.stats.with(t, |s| s.bytes += bytes);
        self.in_turn(w, || {
            let mut remote = 0;
            for (shard, grads) in per_shard.into_iter().enumerate() {
                let message = ToServer::Push {
                    worker: w,
                    step: t,
                    pulled_version: state.pulled[shard],
                    codec,
                    lr: self.lr.map(|lr| lr(t)),
                    grads,
                };
                remote += usize::from(servers.send(shard, message)?);
            }
            Ok(remote)
        })
    }

    /// Runs `send` (which returns how many of its messages went to other ranks) in this
    /// worker's turn (deterministic runs), or at once. Across ranks a turn also covers each
    /// remote message's arrival in its shard's inbox.
    fn in_turn(&self, w: usize, send: impl FnOnce() -> Result<usize>) -> Result<()> {
        match (self.turnstile, self.server_ranks) {
            (Some(turnstile), remote) => {
                turnstile.acquire(w, self.abort)?;
                let result = send().and_then(|n| match remote {
                    Some(remote) => remote.wait_acks(n, self.abort, self.timeout),
                    None => Ok(()),
                });
                turnstile.release(w);
                result
            }
            (None, Some(remote)) => {
                remote.take_turn(w, self.abort, self.timeout)?;
                let n = send()?;
                remote.wait_acks(n, self.abort, self.timeout)?;
                remote.end_turn(w)
            }
            (None, None) => send().map(drop),
        }
    }
}

/// Bytes on the wire per byte of one worker's payload: a ring all-reduce for payloads that sum
/// (`2 (R - 1) / R`: f32, bf16, f16, PowerSGD's `P` and `Q`), an all-gather for top-k's indices
/// and values, which do not (`R - 1`).
fn exchange_factor(compression: Compression, workers: usize) -> f64 {
    let r = workers as f64;
    match compression {
        Compression::None | Compression::Bf16 | Compression::F16 | Compression::PowerSgd { .. } => 2.0 * (r - 1.0) / r,
        Compression::TopK { .. } => r - 1.0,
    }
}

/// One worker's side of the run's all-gather, counting what it sends in the step's bytes.
struct Gather<'a, 'b> {
    shared: &'a Shared<'b>,
    worker: usize,
    step: usize,
    codec: Compression,
}

impl AllGather for Gather<'_, '_> {
    fn all_gather(&self, bytes: Vec<u8>) -> Result<std::sync::Arc<Vec<Vec<u8>>>> {
        let shared = self.shared;
        let sent = bytes.len() as f64 * exchange_factor(self.codec, shared.n_workers);
        shared.stats.with(self.step, |s| s.bytes += sent.round() as u64);
        shared.exchange.all_gather(self.worker, bytes, shared.abort)
    }
}

/// `values` encoded by `codec`: the compressor's (with its error feedback), or f32 before
/// compression starts.
fn encode(
    compressor: &mut Compressor,
    codec: Compression,
    i: usize,
    dims: &[usize],
    values: &[f32],
) -> Result<Vec<u8>> {
    match codec {
        Compression::None => Ok(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
        _ => compressor.encode(i, dims, values),
    }
}

fn decode_all(compression: Compression, shapes: &[Shape], payload: &[u8]) -> Result<Vec<Vec<f32>>> {
    let mut at = 0;
    let mut out = Vec::with_capacity(shapes.len());
    for shape in shapes {
        let len = compression.encoded_bytes(shape.dims());
        let part = payload.get(at..at + len).ok_or_else(|| {
            Error::invalid(
                "exchange",
                format!("a payload of {} bytes is too short for the model's tensors", payload.len()),
            )
        })?;
        out.push(compress::decode(compression, shape.dims(), part)?);
        at += len;
    }
    Ok(out)
}

fn values_of(named: &[(String, Tensor)]) -> Vec<Vec<f32>> {
    named.iter().map(|(_, t)| t.to_vec_f32()).collect()
}

fn host_tensors(values: Vec<Vec<f32>>, shapes: &[Shape]) -> Result<Vec<Tensor>> {
    values.into_iter().zip(shapes).map(|(v, s)| Tensor::from_vec(v, s.clone(), &Device::host())).collect()
}

fn clone_all(tensors: &[Tensor]) -> Result<Vec<Tensor>> {
    tensors.iter().map(Tensor::try_clone).collect()
}

/// The worker's optimizer steps its parameter copy with `grads`.
fn step_optimizer(state: &mut WorkerState, shapes: &[Shape], grads: &[Vec<f32>]) -> Result<()> {
    let grads = host_tensors(grads.to_vec(), shapes)?;
    let optimizer =
        state.optimizer.as_mut().ok_or_else(|| Error::invalid("strategy", "this worker keeps no optimizer"))?;
    let mut params: Vec<&mut Tensor> = state.params.iter_mut().collect();
    let grads: Vec<&Tensor> = grads.iter().collect();
    optimizer.step(&mut params, &grads)
}

fn load(trainer: &mut Trainer, names: &[String], params: &[Tensor]) -> Result<()> {
    let named = names.iter().cloned().zip(params.iter().map(Tensor::try_clone).collect::<Result<Vec<_>>>()?).collect();
    trainer.load_parameters(named)
}

/// Runs thread `who`'s work, turning a panic into an error; any failure raises `abort`, so no
/// other thread waits for this one forever.
fn guarded(who: usize, abort: &Abort, work: impl FnOnce() -> Result<()>) -> Result<()> {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).unwrap_or_else(|payload| {
        Err(Error::invalid(
            "data-parallel strategy",
            format!("a worker or server thread panicked: {}", panic_text(payload)),
        ))
    });
    if result.is_err() {
        abort.raise(who);
    }
    result
}

fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(text) => *text,
        Err(payload) => payload.downcast::<&str>().map(|s| s.to_string()).unwrap_or_else(|_| "a panic".into()),
    }
}
