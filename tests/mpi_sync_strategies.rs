//! The strategies of `conveyor::engine::strategies` across MPI ranks (`SyncTrainer::over_ranks`):
//! on 2 and 4 ranks, `allreduce` (no compression, bf16, top-k, PowerSGD), `average:2` (none,
//! PowerSGD), the synchronous parameter server (`ps:1`, and `ps:3` with its shards spread over
//! the ranks, with and without bf16) and the asynchronous servers in the deterministic mode
//! (`ssp:1` and `downpour:2,2` with top-k, seeded) train a small MLP on the digits to parameters
//! bit for bit equal to the in-process `SyncTrainer` with as many workers (the seeded runs with
//! the same record of turns), return the same step records (bytes equal, losses within rounding)
//! on every rank, and evaluate alike. Free-running `downpour:1,1` and `ssp:1` train and every rank
//! returns the same model. Ranks that start from different parameters or settings are refused on
//! every rank, and a rank whose batch fails mid-run stops every other rank's run with its error.
//!
//! The test re-runs its own binary under `mpirun -n {2,4} --oversubscribe` with
//! `CONVEYOR_MPI_SYNC_RANK` set, so that each copy acts as one rank, with a hard timeout per job.
//! Every rank gathers its parameters' bits to rank 0, which runs the in-process reference itself
//! and compares. Without the `mpi` feature it prints a skip and passes; with it and no `mpirun` on
//! the path it skips too, unless `CONVEYOR_REQUIRE_MPI` is set (as in CI), where it fails.

#[cfg(not(feature = "mpi"))]
fn main() {
    println!("mpi_sync_strategies: skipped (build with `--features mpi` to run the strategies across MPI ranks)");
}

#[cfg(feature = "mpi")]
fn main() -> std::process::ExitCode {
    if std::env::var_os(mpi_tests::RANK_VAR).is_some() { mpi_tests::rank_main() } else { mpi_tests::launcher_main() }
}

#[cfg(feature = "mpi")]
#[path = "mpi_support/launcher.rs"]
mod launcher;

#[cfg(feature = "mpi")]
mod mpi_tests {
    use super::launcher;
    use std::process::ExitCode;
    use std::sync::Arc;
    use std::time::Duration;

    use anyhow::{Context, ensure};
    use conveyor::Sequential;
    use conveyor::data::{DIGITS_TRAIN_ROWS, Dataset, digits, epoch_order};
    use conveyor::engine::optim::OptimizerConfig;
    use conveyor::engine::runtime::{Batch, Trainer};
    use conveyor::engine::strategies::{
        Compression, Interleaving, StepRecord, StrategyConfig, SyncStrategy, SyncTrainer,
    };
    use conveyor::engine::transport::{MpiTransport, Transport};
    use conveyor::engine::{Device, Result, Tensor};
    use conveyor::layers::CrossEntropyLoss;

    /// Set in the ranks' environment: this copy of the binary is one rank of the job.
    pub const RANK_VAR: &str = "CONVEYOR_MPI_SYNC_RANK";
    /// Rank counts of the jobs.
    const WORLD_SIZES: [usize; 2] = [2, 4];
    /// Longest a job may run before the launcher kills it.
    const JOB_TIMEOUT: Duration = Duration::from_secs(240);
    /// Longest a rank waits for a peer inside a collective.
    const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(60);
    /// What rank 0 prints last when every check passed on every rank.
    const PASSED: &str = "mpi_sync_strategies: every rank passed";
    /// The step's whole batch, split among the workers.
    const BATCH: usize = 32;
    /// Steps of each run; each case runs twice (the second continues the first).
    const STEPS: usize = 3;

    // ---- the launcher ----

    pub fn launcher_main() -> ExitCode {
        launcher::launcher_main(&launcher::Jobs {
            name: "mpi_sync_strategies",
            rank_var: RANK_VAR,
            world_sizes: &WORLD_SIZES,
            passed: PASSED,
            timeout: JOB_TIMEOUT,
        })
    }

    // ---- one rank ----

    pub fn rank_main() -> ExitCode {
        // Not made the process transport: the replicas themselves run in this process.
        let transport: Arc<dyn Transport> = match MpiTransport::init() {
            Ok(t) => t,
            Err(e) => {
                eprintln!("mpi_sync_strategies: MPI did not start: {e}");
                return ExitCode::FAILURE;
            }
        };
        match run_rank(&transport) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                // Every other rank may be waiting on this one: end the job rather than let it hang.
                eprintln!("mpi_sync_strategies: rank {} FAILED: {e:#}", transport.rank());
                transport.abort(1)
            }
        }
    }

    fn train_set() -> anyhow::Result<Dataset> {
        let all = digits()?;
        let mut train = all.slice(0, DIGITS_TRAIN_ROWS);
        let (mean, std) = train.feature_stats();
        train.standardize(&mean, &std);
        Ok(train)
    }

    fn replica(device: usize, seed: u64, optimizer: &OptimizerConfig) -> Result<Trainer> {
        let graph = Sequential::new([1, 8, 8]).flatten().linear(16).relu().linear(10).build(seed)?;
        Trainer::builder(graph, Arc::new(CrossEntropyLoss))
            .devices(vec![Device::cpu(device)])
            .optimizer(*optimizer)
            .build()
    }

    /// Step `t`'s batch, worker `w`'s share of `workers`.
    fn batches(train: &Dataset, workers: usize) -> impl Fn(usize, usize) -> Result<Batch> + Sync + '_ {
        let order = epoch_order(train.len(), true, 7, 0);
        move |t, w| {
            let per = BATCH / workers;
            let at = (t * BATCH + w * per) % (train.len() - BATCH);
            Ok(Batch::from(train.batch(&order[at..at + per])?))
        }
    }

    fn bits(params: &[(String, Tensor)]) -> Vec<u32> {
        params.iter().flat_map(|(_, t)| t.to_vec_f32()).map(f32::to_bits).collect()
    }

    fn to_bytes(words: &[u32]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    fn run_rank(transport: &Arc<dyn Transport>) -> anyhow::Result<()> {
        let (rank, n) = (transport.rank(), transport.world_size());
        let train = train_set()?;
        let indices: Vec<usize> = (0..200).collect();
        let held_out = || train.batch(&indices);
        let adam = OptimizerConfig::adam(0.01);
        let seeded = Interleaving::Seeded(5);
        let cases = [
            (SyncStrategy::AllReduce, Compression::None, Interleaving::Free),
            (SyncStrategy::AllReduce, Compression::Bf16, Interleaving::Free),
            (SyncStrategy::AllReduce, Compression::TopK { ratio: 0.05 }, Interleaving::Free),
            (SyncStrategy::AllReduce, Compression::PowerSgd { rank: 2 }, Interleaving::Free),
            (SyncStrategy::Average { every: 2 }, Compression::None, Interleaving::Free),
            (SyncStrategy::Average { every: 2 }, Compression::PowerSgd { rank: 2 }, Interleaving::Free),
            (SyncStrategy::ParameterServer { shards: 1 }, Compression::None, Interleaving::Free),
            (SyncStrategy::ParameterServer { shards: 3 }, Compression::None, Interleaving::Free),
            (SyncStrategy::ParameterServer { shards: 3 }, Compression::Bf16, Interleaving::Free),
            (SyncStrategy::Ssp { staleness: 1 }, Compression::None, seeded.clone()),
            (SyncStrategy::Downpour { fetch_every: 2, push_every: 2 }, Compression::TopK { ratio: 0.05 }, seeded),
        ];
        for (sync, compress, interleaving) in cases {
            let config = StrategyConfig::new(sync).compress(compress).compress_after(1).interleaving(interleaving);
            let mut over =
                SyncTrainer::over_ranks(replica(rank, 3, &adam)?, adam, config.clone(), Arc::clone(transport))?;
            over.set_collective_timeout(COLLECTIVE_TIMEOUT);
            ensure!(over.n_workers() == n, "{n} workers across {n} ranks");
            let data = batches(&train, n);
            let asked_other = std::sync::atomic::AtomicBool::new(false);
            let mine = |t: usize, w: usize| {
                if w != rank {
                    asked_other.store(true, std::sync::atomic::Ordering::SeqCst);
                }
                data(t, w)
            };
            let mut records = over.run(STEPS, &mine)?;
            records.extend(over.run(STEPS, &mine)?);
            ensure!(!asked_other.into_inner(), "rank {rank} was asked for another worker's batch");
            let evaluation = over.evaluate(held_out()?)?;
            let params = bits(&over.parameters()?);
            // Everything rank 0 needs to compare: parameters, records' bytes, the evaluation loss.
            let mut summary = to_bytes(&params);
            summary.extend(evaluation.loss.to_bits().to_le_bytes());
            for r in &records {
                summary.extend((r.step as u64).to_le_bytes());
                summary.extend(r.bytes.to_le_bytes());
                summary.extend(r.loss.to_bits().to_le_bytes());
            }
            let gathered = transport.all_gather(summary, COLLECTIVE_TIMEOUT)?;
            if rank == 0 {
                let label = format!("{sync} --compress {compress} ({:?}) on {n} ranks", config.interleaving);
                let mut reference = {
                    let replicas = (0..n).map(|w| replica(w, 3, &adam)).collect::<Result<Vec<_>>>()?;
                    SyncTrainer::new(replicas, adam, config)?
                };
                let mut expected = reference.run(STEPS, &data)?;
                expected.extend(reference.run(STEPS, &data)?);
                let reference_eval = reference.evaluate(held_out()?)?;
                let reference_params = bits(&reference.parameters()?);
                ensure!(
                    over.interleaving() == reference.interleaving(),
                    "{label}: the record of turns differs from the in-process run's"
                );
                ensure!(
                    !sync.is_asynchronous() || !over.interleaving().is_empty(),
                    "{label}: a seeded asynchronous run recorded no turns"
                );
                ensure!(
                    reference_params.iter().zip(&bits(&replica(0, 3, &adam)?.parameters()?)).any(|(a, b)| a != b),
                    "{label}: training changed nothing"
                );
                for (r, part) in gathered.iter().enumerate() {
                    let (theirs, rest) = part.split_at((4 * reference_params.len()).min(part.len()));
                    ensure!(
                        theirs == to_bytes(&reference_params).as_slice(),
                        "{label}: rank {r}'s parameters differ from the in-process run's"
                    );
                    check_rest(&label, r, rest, &expected, reference_eval.loss)?;
                }
                println!(
                    "  {label}: parameters bit for bit equal to the in-process run on every rank; {} bytes sent",
                    expected.iter().map(|r| r.bytes).sum::<u64>()
                );
            }
        }
        free_running(transport, &train, &adam)?;
        refusals(transport, rank, &adam)?;
        a_failing_rank_stops_the_others(transport, &train, &adam)?;
        transport.all_gather(Vec::new(), COLLECTIVE_TIMEOUT)?;
        if rank == 0 {
            println!("{PASSED}");
        }
        Ok(())
    }

    /// A rank's evaluation loss and records against the in-process run's: bytes and steps equal,
    /// losses within rounding (the in-process run adds the workers' losses as threads finish).
    fn check_rest(label: &str, r: usize, rest: &[u8], expected: &[StepRecord], eval_loss: f64) -> anyhow::Result<()> {
        let words: Vec<u64> =
            rest.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect();
        ensure!(words.len() == 1 + 3 * expected.len(), "{label}: rank {r} sent {} record words", words.len());
        let loss = f64::from_bits(words[0]);
        ensure!(
            (loss - eval_loss).abs() <= 1e-9 * eval_loss.abs().max(1.0),
            "{label}: rank {r} evaluates {loss}, in-process {eval_loss}"
        );
        for (record, w) in expected.iter().zip(words[1..].chunks_exact(3)) {
            ensure!(
                w[0] == record.step as u64 && w[1] == record.bytes,
                "{label}: rank {r}'s step {} record differs: {w:?} vs {record:?}",
                record.step
            );
            let loss = f64::from_bits(w[2]);
            ensure!(
                (loss - record.loss).abs() <= 1e-9 * record.loss.abs().max(1.0),
                "{label}: rank {r}'s step {} loss {loss} vs {}",
                record.step,
                record.loss
            );
        }
        Ok(())
    }

    /// Free-running asynchronous servers across ranks: they train, and every rank returns the same
    /// model (the shards' parameters, gathered).
    fn free_running(transport: &Arc<dyn Transport>, train: &Dataset, adam: &OptimizerConfig) -> anyhow::Result<()> {
        let (rank, n) = (transport.rank(), transport.world_size());
        for sync in [SyncStrategy::Downpour { fetch_every: 1, push_every: 1 }, SyncStrategy::Ssp { staleness: 1 }] {
            let mut over = SyncTrainer::over_ranks(
                replica(rank, 3, adam)?,
                *adam,
                StrategyConfig::new(sync),
                Arc::clone(transport),
            )?;
            over.set_collective_timeout(COLLECTIVE_TIMEOUT);
            let records = over.run(2 * STEPS, &batches(train, n))?;
            ensure!(records.iter().all(|r| r.bytes > 0), "{sync}: a step sent nothing");
            ensure!(over.interleaving().is_empty(), "{sync}: a free run records no turns");
            let params = bits(&over.parameters()?);
            ensure!(params != bits(&replica(0, 3, adam)?.parameters()?), "{sync}: training changed nothing");
            let gathered = transport.all_gather(to_bytes(&params), COLLECTIVE_TIMEOUT)?;
            ensure!(gathered.iter().all(|p| *p == gathered[0]), "{sync}: the ranks return different models");
            if rank == 0 {
                let max = records.iter().map(|r| r.staleness_max).max().unwrap_or(0);
                println!(
                    "  {sync} free-running on {n} ranks: trained, every rank returns one model (staleness max {max})"
                );
            }
        }
        Ok(())
    }

    /// `ps:1` where rank 1's batch of step 1 fails: rank 1 returns its own error, every other rank
    /// an error naming rank 1's failure, within the deadline (no rank waits for the lost push).
    fn a_failing_rank_stops_the_others(
        transport: &Arc<dyn Transport>,
        train: &Dataset,
        adam: &OptimizerConfig,
    ) -> anyhow::Result<()> {
        let (rank, n) = (transport.rank(), transport.world_size());
        let config = StrategyConfig::new(SyncStrategy::ParameterServer { shards: 1 });
        let mut over = SyncTrainer::over_ranks(replica(rank, 3, adam)?, *adam, config, Arc::clone(transport))?;
        over.set_collective_timeout(COLLECTIVE_TIMEOUT);
        let data = batches(train, n);
        let failing = |t: usize, w: usize| {
            if (t, w) == (1, 1) {
                return Err(conveyor::engine::Error::invalid("batch", "the test's bad batch"));
            }
            data(t, w)
        };
        let started = std::time::Instant::now();
        let error =
            over.run(4, &failing).err().context("a run with a failing rank must fail on every rank")?.to_string();
        ensure!(error.contains("the test's bad batch"), "rank {rank}: {error}");
        ensure!(rank == 1 || error.contains("another rank failed"), "rank {rank}: {error}");
        ensure!(started.elapsed() < COLLECTIVE_TIMEOUT, "rank {rank} waited for the deadline instead of the notice");
        if rank == 0 {
            println!("  ps:1 with a failing rank: every rank's run stopped with rank 1's error");
        }
        Ok(())
    }

    /// Ranks that start apart are refused on every rank.
    fn refusals(transport: &Arc<dyn Transport>, rank: usize, adam: &OptimizerConfig) -> anyhow::Result<()> {
        let config = StrategyConfig::new(SyncStrategy::AllReduce);
        let seed = if rank == 1 { 4 } else { 3 };
        let apart = SyncTrainer::over_ranks(replica(rank, seed, adam)?, *adam, config.clone(), Arc::clone(transport));
        let error = apart.err().context("ranks with different initial parameters must be refused")?.to_string();
        ensure!(error.contains("rank 1") && error.contains("same parameters"), "{error}");
        let other = if rank == 1 { StrategyConfig::new(SyncStrategy::Average { every: 2 }) } else { config };
        let apart = SyncTrainer::over_ranks(replica(rank, 3, adam)?, *adam, other, Arc::clone(transport));
        let error = apart.err().context("ranks with different strategies must be refused")?.to_string();
        ensure!(error.contains("rank 1") && error.contains("average:2"), "{error}");
        if rank == 0 {
            println!("  different initial parameters and different strategies: refused on every rank");
        }
        Ok(())
    }
}
