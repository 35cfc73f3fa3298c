//! The data-parallel strategies of `conveyor::engine::strategies`: synchronous `ps` trains the
//! same bits as `allreduce`, and `allreduce` what one device trains on the whole batch (within f32
//! rounding); asynchronous runs in the deterministic mode replay bit for bit from their seed or
//! their record, and stale-synchronous runs keep their staleness bound; every strategy, with and
//! without compression, learns the digits; bad settings are refused. `SyncTrainer::over_ranks`
//! on threads standing in for ranks trains the in-process bits (`mpi_sync_strategies` does it over
//! MPI), a failing rank ends the others by the deadline, and ranks that disagree are refused.
use std::sync::Arc;
use std::time::{Duration, Instant};

use conveyor::Sequential;
use conveyor::data::{DIGITS_TRAIN_ROWS, Dataset, digits, epoch_order};
use conveyor::engine::optim::OptimizerConfig;
use conveyor::engine::runtime::{Batch, Trainer};
use conveyor::engine::strategies::{Compression, Interleaving, StepRecord, StrategyConfig, SyncStrategy, SyncTrainer};
use conveyor::engine::transport::{LinkCost, Tag, Transport, TransportKind};
use conveyor::engine::{Device, Error, Result, Tensor};
use conveyor::layers::CrossEntropyLoss;

const BATCH: usize = 64;

fn split() -> (Dataset, Dataset) {
    let all = digits().unwrap();
    let (mut train, mut test) = (all.slice(0, DIGITS_TRAIN_ROWS), all.slice(DIGITS_TRAIN_ROWS, all.len()));
    let (mean, std) = train.feature_stats();
    train.standardize(&mean, &std);
    test.standardize(&mean, &std);
    (train, test)
}

fn replica(device: usize, optimizer: &OptimizerConfig) -> Trainer {
    let graph = Sequential::new([1, 8, 8]).flatten().linear(32).relu().linear(10).build(3).unwrap();
    Trainer::builder(graph, Arc::new(CrossEntropyLoss))
        .devices(vec![Device::cpu(device)])
        .optimizer(*optimizer)
        .build()
        .unwrap()
}

fn sync_trainer(workers: usize, optimizer: &OptimizerConfig, config: StrategyConfig) -> SyncTrainer {
    let replicas = (0..workers).map(|w| replica(w, optimizer)).collect();
    SyncTrainer::new(replicas, *optimizer, config).unwrap()
}

/// Step `t`'s batch (each epoch in its own shuffled order), worker `w`'s share of `workers`.
fn batches(train: &Dataset, workers: usize) -> impl Fn(usize, usize) -> Result<Batch> + Sync + '_ {
    let per_epoch = train.len() / BATCH;
    let orders: Vec<Vec<usize>> = (0..64).map(|epoch| epoch_order(train.len(), true, 5, epoch)).collect();
    move |t, w| {
        let per = BATCH / workers;
        let order = &orders[(t / per_epoch) % orders.len()];
        let at = (t % per_epoch) * BATCH + w * per;
        Ok(Batch::from(train.batch(&order[at..at + per])?))
    }
}

fn bits(params: &[(String, Tensor)]) -> Vec<u32> {
    params.iter().flat_map(|(_, t)| t.to_vec_f32()).map(f32::to_bits).collect()
}

fn accuracy(trainer: &mut SyncTrainer, test: &Dataset) -> f64 {
    let indices: Vec<usize> = (0..test.len()).collect();
    trainer.evaluate(test.batch(&indices).unwrap()).unwrap().accuracy().unwrap()
}

#[test]
fn synchronous_ps_trains_the_bits_of_allreduce_and_allreduce_what_one_device_trains() {
    let (train, _) = split();
    let adam = OptimizerConfig::adam(0.01);
    let mut allreduce = sync_trainer(2, &adam, StrategyConfig::new(SyncStrategy::AllReduce));
    allreduce.run(6, &batches(&train, 2)).unwrap();
    for shards in [1, 3] {
        let mut ps = sync_trainer(2, &adam, StrategyConfig::new(SyncStrategy::ParameterServer { shards }));
        let records = ps.run(6, &batches(&train, 2)).unwrap();
        assert_eq!(bits(&ps.parameters().unwrap()), bits(&allreduce.parameters().unwrap()), "ps:{shards}");
        assert!(records.iter().all(|r| r.staleness_max == 0 && r.bytes > 0));
    }
    // One device on the whole batch: the same gradients summed in another order.
    let mut one = replica(0, &adam);
    let whole = batches(&train, 1);
    for t in 0..6 {
        one.step(whole(t, 0).unwrap()).unwrap();
    }
    let (a, b) = (one.parameters().unwrap(), allreduce.parameters().unwrap());
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        let diff = x.to_vec_f32().iter().zip(y.to_vec_f32()).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(diff < 1e-5, "{name}: {diff}");
    }
}

#[test]
fn asynchronous_runs_replay_bit_for_bit_from_their_seed_or_their_record() {
    let (train, _) = split();
    let sgd = OptimizerConfig::sgd(0.05);
    for sync in [SyncStrategy::Downpour { fetch_every: 2, push_every: 2 }, SyncStrategy::Ssp { staleness: 1 }] {
        let run = |interleaving: Interleaving| {
            let config = StrategyConfig::new(sync).interleaving(interleaving);
            let mut trainer = sync_trainer(3, &sgd, config);
            // Two runs: the record spans both.
            trainer.run(5, &batches(&train, 3)).unwrap();
            trainer.run(4, &batches(&train, 3)).unwrap();
            (bits(&trainer.parameters().unwrap()), trainer.interleaving().to_vec())
        };
        let (first, record) = run(Interleaving::Seeded(7));
        assert!(!record.is_empty());
        let (again, record_again) = run(Interleaving::Seeded(7));
        assert_eq!(again, first, "{sync}: the same seed");
        assert_eq!(record_again, record);
        let (replayed, _) = run(Interleaving::Replay(record.clone()));
        assert_eq!(replayed, first, "{sync}: replayed from the record");
        let (other, other_record) = run(Interleaving::Seeded(8));
        assert_ne!(other_record, record, "{sync}: another seed draws another order");
        assert_ne!(other, first, "{sync}: and trains other weights");
        // A record that does not fit the run is refused, not followed blindly.
        let config = StrategyConfig::new(sync).interleaving(Interleaving::Replay(record[..3].to_vec()));
        let error = sync_trainer(3, &sgd, config).run(5, &batches(&train, 3)).unwrap_err().to_string();
        assert!(error.contains("interleaving"), "{error}");
    }
}

#[test]
fn stale_synchronous_runs_keep_their_bound() {
    let (train, _) = split();
    let sgd = OptimizerConfig::sgd(0.05);
    for (staleness, interleaving) in
        [(0, Interleaving::Seeded(1)), (2, Interleaving::Seeded(2)), (1, Interleaving::Free)]
    {
        let mut trainer =
            sync_trainer(3, &sgd, StrategyConfig::new(SyncStrategy::Ssp { staleness }).interleaving(interleaving));
        let records = trainer.run(12, &batches(&train, 3)).unwrap();
        // Between a worker's pull for step c and its push, the others push at most steps
        // c - S - 1 .. c + S (each at most 2S + 1 pushes), so at most (R - 1)(2S + 1) updates land.
        let bound = 2 * (2 * staleness as u64 + 1);
        let max = records.iter().map(|r| r.staleness_max).max().unwrap();
        assert!(max <= bound, "ssp:{staleness}: staleness {max} > {bound}");
    }
}

#[test]
fn every_strategy_learns_the_digits() {
    let (train, test) = split();
    let adam = OptimizerConfig::adam(0.003);
    let steps = 4 * DIGITS_TRAIN_ROWS / BATCH;
    let cases = [
        ("allreduce", "none", 0.83),
        ("allreduce", "bf16", 0.83),
        ("allreduce", "topk:0.05", 0.78),
        ("allreduce", "powersgd:2", 0.78),
        ("average:4", "none", 0.78),
        ("ps:2", "f16", 0.83),
        ("downpour:2,2", "none", 0.83),
        ("ssp:2", "topk:0.1", 0.83),
    ];
    for (sync, compress, floor) in cases {
        let sync: SyncStrategy = sync.parse().unwrap();
        let mut config = StrategyConfig::new(sync).compress(compress.parse().unwrap());
        if sync.is_asynchronous() {
            // A fixed interleaving: the floor holds whatever the machine's load does to timing.
            config = config.interleaving(Interleaving::Seeded(11));
        }
        let mut trainer = sync_trainer(4, &adam, config);
        let records = trainer.run(steps, &batches(&train, 4)).unwrap();
        let acc = accuracy(&mut trainer, &test);
        assert!(acc >= floor, "{sync} --compress {compress}: test accuracy {acc}");
        assert_eq!(records.len(), steps);
        assert!(records.last().unwrap().loss < records[0].loss, "{sync} {compress}");
    }
}

#[test]
fn compression_counts_the_bytes_it_saves() {
    let (train, _) = split();
    let sgd = OptimizerConfig::sgd(0.1);
    let bytes = |compress: Compression| {
        let mut trainer = sync_trainer(2, &sgd, StrategyConfig::new(SyncStrategy::AllReduce).compress(compress));
        trainer.run(3, &batches(&train, 2)).unwrap();
        trainer.bytes_sent()
    };
    let none = bytes(Compression::None);
    assert_eq!(bytes(Compression::Bf16) * 2, none);
    assert_eq!(bytes(Compression::F16) * 2, none);
    assert!(bytes(Compression::TopK { ratio: 0.01 }) * 20 < none);
    assert!(bytes(Compression::PowerSgd { rank: 1 }) * 5 < none);
}

#[test]
fn bad_settings_are_refused() {
    let sgd = OptimizerConfig::sgd(0.1);
    // Replicas that do not start alike.
    let other = {
        let graph = Sequential::new([1, 8, 8]).flatten().linear(32).relu().linear(10).build(4).unwrap();
        Trainer::builder(graph, Arc::new(CrossEntropyLoss)).devices(vec![Device::cpu(1)]).build().unwrap()
    };
    let error = SyncTrainer::new(vec![replica(0, &sgd), other], sgd, StrategyConfig::new(SyncStrategy::AllReduce))
        .unwrap_err()
        .to_string();
    assert!(error.contains("one seed"), "{error}");
    // A replay for a synchronous strategy.
    let config = StrategyConfig::new(SyncStrategy::AllReduce).interleaving(Interleaving::Replay(vec![0]));
    let error = SyncTrainer::new(vec![replica(0, &sgd)], sgd, config).unwrap_err().to_string();
    assert!(error.contains("synchronous"), "{error}");
    assert!(SyncTrainer::new(Vec::new(), sgd, StrategyConfig::new(SyncStrategy::AllReduce)).is_err());
}

/// Threads standing in for MPI ranks: a [`Transport`] whose `all_gather` meets the other threads
/// (with its deadline) and whose messages are channels per rank and tag, so
/// `SyncTrainer::over_ranks` runs without MPI.
#[derive(Debug)]
struct ThreadRanks {
    rank: usize,
    meeting: Arc<Meeting>,
}

type MeetingState = (Vec<Option<Vec<u8>>>, u64, Arc<Vec<Vec<u8>>>);

#[derive(Debug, Default)]
struct Meeting {
    /// Each rank's part of the all-gather under way, the all-gathers done, the last one's parts.
    state: std::sync::Mutex<MeetingState>,
    ready: std::sync::Condvar,
    /// Messages by receiving rank and tag.
    mail: std::sync::Mutex<std::collections::HashMap<(usize, Tag), Mailbox>>,
}

type Mailbox = (crossbeam::channel::Sender<Vec<u8>>, crossbeam::channel::Receiver<Vec<u8>>);

impl Meeting {
    fn mailbox(&self, rank: usize, tag: Tag) -> Mailbox {
        self.mail.lock().unwrap().entry((rank, tag)).or_insert_with(crossbeam::channel::unbounded).clone()
    }
}

fn thread_ranks(world: usize) -> Vec<Arc<dyn Transport>> {
    let meeting = Arc::new(Meeting::default());
    meeting.state.lock().unwrap().0 = vec![None; world];
    (0..world).map(|rank| Arc::new(ThreadRanks { rank, meeting: Arc::clone(&meeting) }) as Arc<dyn Transport>).collect()
}

impl Transport for ThreadRanks {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.meeting.state.lock().unwrap().0.len()
    }
    fn kind(&self) -> TransportKind {
        TransportKind::Mpi
    }
    fn send(&self, to: usize, tag: Tag, bytes: Vec<u8>) -> Result<()> {
        self.meeting.mailbox(to, tag).0.send(bytes).map_err(|_| Error::invalid("test transport", "closed"))
    }
    fn inbox(&self, tag: Tag) -> Result<crossbeam::channel::Receiver<Vec<u8>>> {
        Ok(self.meeting.mailbox(self.rank, tag).1)
    }
    fn close_rounds_before(&self, _round: u64) {}
    fn all_gather(&self, bytes: Vec<u8>, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let mut state = self.meeting.state.lock().unwrap();
        let generation = state.1;
        state.0[self.rank] = Some(bytes);
        if state.0.iter().all(Option::is_some) {
            state.2 = Arc::new(state.0.iter_mut().map(|s| s.take().unwrap_or_default()).collect());
            state.1 += 1;
            self.meeting.ready.notify_all();
        }
        let deadline = Instant::now() + timeout;
        while state.1 == generation {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::invalid("test transport", format!("rank {} timed out in an all-gather", self.rank)));
            }
            state = self.meeting.ready.wait_timeout(state, left).unwrap().0;
        }
        Ok(state.2.as_ref().clone())
    }
    fn link(&self, _peer: usize) -> Option<LinkCost> {
        None
    }
    fn clock_offset_s(&self) -> f64 {
        0.0
    }
    fn abort(&self, code: i32) -> ! {
        panic!("rank {} aborted the job with {code}", self.rank)
    }
}

#[test]
fn over_ranks_trains_the_bits_of_the_in_process_workers_and_a_failing_rank_ends_the_others() {
    let (train, _) = split();
    let adam = OptimizerConfig::adam(0.01);
    let world = 2;
    for config in [
        StrategyConfig::new(SyncStrategy::AllReduce).compress(Compression::PowerSgd { rank: 2 }),
        StrategyConfig::new(SyncStrategy::Average { every: 2 }).compress(Compression::TopK { ratio: 0.1 }),
    ] {
        let mut reference = sync_trainer(world, &adam, config.clone());
        let expected = reference.run(4, &batches(&train, world)).unwrap();
        // Across thread ranks in two runs (2 + 2 steps): the same bits as one run of 4 in one process.
        let results = over_thread_ranks(world, &config, &adam, 4);
        for (rank, (params, records, _)) in results.iter().enumerate() {
            assert_eq!(params, &bits(&reference.parameters().unwrap()), "{}: rank {rank}", config.sync);
            let bytes: Vec<u64> = records.iter().map(|r| r.bytes).collect();
            assert_eq!(bytes, expected.iter().map(|r| r.bytes).collect::<Vec<_>>(), "{}: rank {rank}", config.sync);
        }
    }
    // Rank 1's batch of step 1 fails: it returns that error, rank 0 its all-gather's timeout.
    let config = StrategyConfig::new(SyncStrategy::AllReduce);
    let errors = failing_rank_errors(world, &config, Duration::from_millis(500), 3);
    for (rank, (_, waited)) in errors.iter().enumerate() {
        assert!(*waited < Duration::from_secs(20), "rank {rank} waited {waited:?}");
    }
    let errors: Vec<String> = errors.into_iter().map(|(error, _)| error).collect();
    assert!(errors[0].contains("timed out"), "{}", errors[0]);
    assert!(errors[1].contains("rank 1 has no batch 1"), "{}", errors[1]);
}

/// Every rank's parameters and records of `config` over `world` thread ranks, `steps` steps in two
/// runs.
fn over_thread_ranks(
    world: usize,
    config: &StrategyConfig,
    optimizer: &OptimizerConfig,
    steps: usize,
) -> Vec<(Vec<u32>, Vec<StepRecord>, Vec<u16>)> {
    let (train, _) = split();
    std::thread::scope(|scope| {
        let handles: Vec<_> = thread_ranks(world)
            .into_iter()
            .map(|transport| {
                let (config, train) = (config.clone(), &train);
                scope.spawn(move || {
                    let rank = transport.rank();
                    let mut over =
                        SyncTrainer::over_ranks(replica(rank, optimizer), *optimizer, config, transport).unwrap();
                    over.set_collective_timeout(Duration::from_secs(60));
                    let data = batches(train, world);
                    let mine = |t: usize, w: usize| {
                        assert_eq!(w, rank, "asked for another rank's batch");
                        data(t, w)
                    };
                    let mut records = over.run(steps / 2, &mine).unwrap();
                    records.extend(over.run(steps - steps / 2, &mine).unwrap());
                    (bits(&over.parameters().unwrap()), records, over.interleaving().to_vec())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn server_strategies_over_ranks_train_the_in_process_bits() {
    let (train, _) = split();
    let adam = OptimizerConfig::adam(0.01);
    let world = 3;
    for config in [
        StrategyConfig::new(SyncStrategy::ParameterServer { shards: 4 }).compress(Compression::Bf16),
        StrategyConfig::new(SyncStrategy::Ssp { staleness: 1 }).interleaving(Interleaving::Seeded(11)),
        StrategyConfig::new(SyncStrategy::Downpour { fetch_every: 2, push_every: 1 })
            .compress(Compression::TopK { ratio: 0.1 })
            .interleaving(Interleaving::Seeded(12)),
    ] {
        let mut reference = sync_trainer(world, &adam, config.clone());
        let mut expected = reference.run(2, &batches(&train, world)).unwrap();
        expected.extend(reference.run(3, &batches(&train, world)).unwrap());
        let expected_bytes: Vec<u64> = expected.iter().map(|r| r.bytes).collect();
        assert_eq!(reference.interleaving().is_empty(), !config.sync.is_asynchronous(), "{}", config.sync);
        for (rank, (params, records, turns)) in over_thread_ranks(world, &config, &adam, 5).into_iter().enumerate() {
            assert_eq!(params, bits(&reference.parameters().unwrap()), "{}: rank {rank}", config.sync);
            let bytes: Vec<u64> = records.iter().map(|r| r.bytes).collect();
            assert_eq!(bytes, expected_bytes, "{}: rank {rank}", config.sync);
            assert_eq!(turns, reference.interleaving(), "{}: rank {rank}'s record of turns", config.sync);
        }
    }
}

#[test]
fn free_running_servers_over_ranks_agree_on_one_model() {
    let adam = OptimizerConfig::adam(0.01);
    for sync in [SyncStrategy::Ssp { staleness: 0 }, SyncStrategy::Downpour { fetch_every: 1, push_every: 2 }] {
        let results = over_thread_ranks(2, &StrategyConfig::new(sync), &adam, 6);
        assert_eq!(results[0].0, results[1].0, "{sync}: the ranks return different models");
        assert_ne!(results[0].0, bits(&replica(0, &adam).parameters().unwrap()), "{sync}: nothing trained");
        if let SyncStrategy::Ssp { .. } = sync {
            // Staleness 0: every worker waits for all pushes of the step before, so a push can be
            // at most one update per other worker stale.
            assert!(results[0].1.iter().all(|r| r.staleness_max <= 1), "{:?}", results[0].1);
        }
    }
}

/// Every rank's error (and how long its run took) from `steps` steps of `config` over `world`
/// thread ranks where the last rank's batch of step 1 fails; each waits `timeout` for the others.
fn failing_rank_errors(
    world: usize,
    config: &StrategyConfig,
    timeout: Duration,
    steps: usize,
) -> Vec<(String, Duration)> {
    let (train, _) = split();
    let adam = OptimizerConfig::adam(0.01);
    let failing = world - 1;
    std::thread::scope(|scope| {
        let handles: Vec<_> = thread_ranks(world)
            .into_iter()
            .map(|transport| {
                let (config, train) = (config.clone(), &train);
                scope.spawn(move || {
                    let rank = transport.rank();
                    let mut over = SyncTrainer::over_ranks(replica(rank, &adam), adam, config, transport).unwrap();
                    over.set_collective_timeout(timeout);
                    let data = batches(train, world);
                    let started = Instant::now();
                    let error = over
                        .run(steps, &|t, w| {
                            if (t, w) == (1, failing) {
                                Err(Error::invalid("batch", format!("rank {failing} has no batch 1")))
                            } else {
                                data(t, w)
                            }
                        })
                        .unwrap_err();
                    (error.to_string(), started.elapsed())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_failing_rank_stops_a_parameter_server_run_on_every_rank() {
    let config = StrategyConfig::new(SyncStrategy::ParameterServer { shards: 2 });
    let errors = failing_rank_errors(3, &config, Duration::from_secs(60), 4);
    for (rank, (error, waited)) in errors.iter().enumerate() {
        assert!(error.contains("rank 2 has no batch 1"), "rank {rank}: {error}");
        assert!(rank == 2 || error.contains("another rank failed"), "rank {rank}: {error}");
        // The notice, not the 60 s deadline, ended the others' runs.
        assert!(*waited < Duration::from_secs(20), "rank {rank} waited {waited:?}");
    }
}

#[test]
fn over_ranks_refuses_ranks_that_start_apart() {
    let adam = OptimizerConfig::adam(0.01);
    let errors: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = thread_ranks(2)
            .into_iter()
            .map(|transport| {
                scope.spawn(move || {
                    let rank = transport.rank();
                    let graph =
                        Sequential::new([1, 8, 8]).flatten().linear(32).relu().linear(10).build(3 + rank as u64);
                    let trainer =
                        Trainer::builder(graph.unwrap(), Arc::new(CrossEntropyLoss)).optimizer(adam).build().unwrap();
                    let config = StrategyConfig::new(SyncStrategy::AllReduce);
                    SyncTrainer::over_ranks(trainer, adam, config, transport).unwrap_err().to_string()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for error in errors {
        assert!(error.contains("rank 1 does not start from the same parameters"), "{error}");
    }
}
