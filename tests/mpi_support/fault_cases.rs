//! The fault cases of `tests/mpi.rs` and the MPI program each rank of a case runs: how the
//! struck rank fails ([`Kind`]), where ([`FaultAt`]), how the ranks are laid out ([`Layout`]),
//! the case's trainer on every layout, `rank_main`, which the test binary runs instead of the
//! driver when `CONVEYOR_MPI_FAULT` names a case, and the table of the cases' results.
use super::*;

/// How the struck rank fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// The injected fault returns an error.
    Error,
    /// The injected fault panics (caught by the runtime).
    Panic,
    /// The injected fault panics and the panic hook raises SIGKILL.
    Kill,
    /// The main thread panics between steps (uncaught).
    MainPanic,
    /// The process calls `exit(3)` between steps.
    Exit,
}

impl Kind {
    pub(super) const ALL: [Kind; 5] = [Kind::Error, Kind::Panic, Kind::Kill, Kind::MainPanic, Kind::Exit];
    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::Error => "error",
            Kind::Panic => "panic",
            Kind::Kill => "kill",
            Kind::MainPanic => "main-panic",
            Kind::Exit => "exit(3)",
        }
    }
}

/// The fault points the cases strike (the schedule is 1F1B: its backward is the fused one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FaultAt {
    Op(OpKind),
    Send,
    Receive,
    Prepare,
    Vote,
    Apply,
}

impl FaultAt {
    pub(super) const ALL: [FaultAt; 7] = [
        FaultAt::Op(OpKind::Forward),
        FaultAt::Op(OpKind::Backward),
        FaultAt::Send,
        FaultAt::Receive,
        FaultAt::Prepare,
        FaultAt::Vote,
        FaultAt::Apply,
    ];
    pub(super) fn name(self) -> &'static str {
        match self {
            FaultAt::Op(OpKind::Forward) => "forward",
            FaultAt::Op(_) => "backward",
            FaultAt::Send => "send",
            FaultAt::Receive => "receive",
            FaultAt::Prepare => "prepare",
            FaultAt::Vote => "vote",
            FaultAt::Apply => "apply",
        }
    }
    pub(super) fn point(self) -> FaultPoint {
        match self {
            FaultAt::Op(op) => FaultPoint::Op(op),
            FaultAt::Send => FaultPoint::Send,
            FaultAt::Receive => FaultPoint::Receive,
            FaultAt::Prepare => FaultPoint::Prepare,
            FaultAt::Vote => FaultPoint::Vote,
            FaultAt::Apply => FaultPoint::Apply,
        }
    }
}

/// One fault case: `ranks` ranks (one pipeline device and stage each), `victim` the struck stage
/// (its rank, for [`Kind::MainPanic`] and [`Kind::Exit`]).
#[derive(Clone, Debug)]
pub(super) struct FaultCase {
    pub(super) ranks: usize,
    pub(super) kind: Kind,
    pub(super) at: Option<FaultAt>,
    pub(super) victim: usize,
    /// How the ranks are laid out; with a rank per shard or replicas `victim` is a rank.
    pub(super) layout: Layout,
}

impl FaultCase {
    pub(super) fn name(&self) -> String {
        match self.at {
            Some(at) if self.layout != Layout::Pipeline => format!(
                "{} at {} on rank {} ({}), {} ranks",
                self.kind.name(),
                at.name(),
                self.victim,
                self.layout.name(),
                self.ranks
            ),
            Some(at) => format!("{} at {} on stage {}, {} ranks", self.kind.name(), at.name(), self.victim, self.ranks),
            None => format!("{} on rank {}, {} ranks", self.kind.name(), self.victim, self.ranks),
        }
    }

    /// `kind;point;victim;layout;dir`.
    pub(super) fn encode(&self, dir: &Path) -> String {
        let (kind, at) = (self.kind.name(), self.at.map_or("-", FaultAt::name));
        format!("{kind};{at};{};{:?};{}", self.victim, self.layout, dir.display())
    }

    pub(super) fn decode(text: &str) -> Result<(FaultCase, PathBuf)> {
        let mut parts = text.splitn(5, ';');
        let mut next = || parts.next().ok_or_else(|| anyhow!("malformed {FAULT_ENV}: `{text}`"));
        let kind = next()?;
        let kind = Kind::ALL.into_iter().find(|k| k.name() == kind).ok_or_else(|| anyhow!("unknown kind `{kind}`"))?;
        let at = next()?;
        let at = FaultAt::ALL.into_iter().find(|a| a.name() == at);
        let victim = next()?.parse()?;
        let layout = next()?;
        let layout = Layout::ALL
            .into_iter()
            .find(|l| format!("{l:?}") == layout)
            .ok_or_else(|| anyhow!("unknown layout `{layout}`"))?;
        let dir = PathBuf::from(next()?);
        Ok((FaultCase { ranks: 0, kind, at, victim, layout }, dir))
    }
}

/// The fault cases' model: a 7-layer MLP (enough layers for 4 stages).
pub(super) fn fault_model() -> Result<Graph> {
    Ok(Sequential::new([16]).linear(32).relu().linear(32).relu().linear(32).relu().linear(4).build(0)?)
}

/// The layers in order, cut into `n` contiguous stages of near-equal count.
pub(super) fn even_stages(graph: &Graph, n: usize) -> Result<Vec<Vec<NodeId>>> {
    let layers: Vec<NodeId> = graph.topological_order()?.into_iter().filter(|&id| graph.layer(id).is_some()).collect();
    let (base, extra) = (layers.len() / n, layers.len() % n);
    let mut stages = Vec::new();
    let mut start = 0;
    for i in 0..n {
        let len = base + usize::from(i < extra);
        stages.push(layers[start..start + len].to_vec());
        start += len;
    }
    Ok(stages)
}

/// The fault cases' trainer on `n` CPU devices (one stage each, 1F1B, 4 micro-batches, Adam).
pub(super) fn fault_trainer(n: usize, transport: Arc<dyn Transport>) -> Result<Trainer> {
    let graph = fault_model()?;
    let stages = even_stages(&graph, n)?;
    Ok(Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .transport(transport)
        .devices((0..n).map(Device::cpu).collect())
        .stages(stages)
        .schedule(ScheduleKind::OneFOneB, 1)
        .micro_batches(4)
        .optimizer(OptimizerConfig::adam(0.01))
        .build()?)
}

/// How a fault case's ranks are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Layout {
    /// One stage per rank.
    Pipeline,
    /// 2 stages of `ranks / 2` tensor-parallel shards, a rank per shard.
    PerShard,
    /// 2 data-parallel replicas of `ranks / 2` stages, a rank per stage.
    Replicas,
}

impl Layout {
    pub(super) const ALL: [Layout; 3] = [Layout::Pipeline, Layout::PerShard, Layout::Replicas];

    pub(super) fn name(self) -> &'static str {
        match self {
            Layout::Pipeline => "a stage per rank",
            Layout::PerShard => "a rank per shard",
            Layout::Replicas => "2 replicas",
        }
    }

    /// The case's trainer on `ranks` CPU devices (in one process with [`InProcess`]).
    pub(super) fn trainer(self, ranks: usize, transport: Arc<dyn Transport>) -> Result<Trainer> {
        match self {
            Layout::Pipeline => fault_trainer(ranks, transport),
            Layout::PerShard => per_shard_fault_trainer(ranks),
            Layout::Replicas => {
                let graph = fault_model()?;
                let stages = even_stages(&graph, ranks / 2)?;
                Ok(Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
                    .transport(transport)
                    .devices((0..ranks).map(Device::cpu).collect())
                    .data_parallel(2, |_, _| {
                        Sequential::new([16]).linear(32).relu().linear(32).relu().linear(32).relu().linear(4).build(0)
                    })
                    .stages(stages)
                    .schedule(ScheduleKind::OneFOneB, 1)
                    .micro_batches(2)
                    .optimizer(OptimizerConfig::adam(0.01))
                    // A bucket per layer: the faults strike with all-reduces in flight across ranks.
                    .bucket_size(Some(1))
                    .build()?)
            }
        }
    }
}

/// The per-shard fault cases' trainer: `mlp:16,32,32,32,4` on cpu:`n` in 2 stages of `n / 2`
/// shards (a rank per shard under MPI, threads in one process), 1F1B, 4 micro-batches, Adam.
pub(super) fn per_shard_fault_trainer(n: usize) -> Result<Trainer> {
    let spec: conveyor::zoo::ModelSpec = "mlp:16,32,32,32,4".parse()?;
    let config = conveyor::pipeline::PipelineConfig {
        schedule: ScheduleKind::OneFOneB,
        n_micro_batches: 4,
        batch_rows: FAULT_BATCH_ROWS,
        optimizer: OptimizerConfig::adam(0.01),
        n_chunks: 1,
        recompute: Default::default(),
        seed: 0,
        core_slots: Default::default(),
        precision: Default::default(),
        weight_cache: Default::default(),
    };
    let devices = (0..n).map(Device::cpu).collect();
    Ok(conveyor::pipeline::build_trainer_tensor_parallel(&spec, 0, devices, n / 2, &config)?.1)
}

/// Step `step`'s batch: seeded synthetic data, a different slice each step.
pub(super) fn fault_batch(step: usize) -> Result<(Tensor, Vec<usize>)> {
    let data = conveyor::data::synthetic(FAULT_BATCH_ROWS * 8, 16, 4, 0)?;
    let start = (step % 8) * FAULT_BATCH_ROWS;
    Ok(data.batch(&(start..start + FAULT_BATCH_ROWS).collect::<Vec<_>>())?)
}

/// Seconds since the Unix epoch (comparable across processes of one machine).
pub(super) fn now_s() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// The rank program of a fault case (see the module docs): returns the process's exit status.
pub(super) fn rank_main(case: &str) -> ExitCode {
    match rank_program(case) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("fault-case rank failed: {error:#}");
            ExitCode::FAILURE
        }
    }
}

pub(super) fn rank_program(text: &str) -> Result<()> {
    let (case, dir) = FaultCase::decode(text)?;
    let mpi = MpiTransport::init()?;
    let (rank, ranks) = (mpi.rank(), mpi.world_size());
    transport::init_process(mpi)?;
    let stamp = dir.join("died-at.txt");
    let died_now = {
        let stamp = stamp.clone();
        move || {
            let _ = std::fs::write(&stamp, format!("{:.6}", now_s()));
        }
    };
    if case.kind == Kind::Kill {
        let default_hook = std::panic::take_hook();
        let died_now = died_now.clone();
        std::panic::set_hook(Box::new(move |info| {
            if info.payload().downcast_ref::<&str>() == Some(&"injected panic") {
                died_now();
                // SAFETY: raise only sends a signal to this process.
                unsafe {
                    libc::raise(libc::SIGKILL);
                }
            }
            default_hook(info);
        }));
    }
    let mut trainer = case.layout.trainer(ranks, transport::process_transport())?;
    for step in 0..STEPS_BEFORE_FAULT {
        trainer.step(fault_batch(step)?)?;
    }
    match case.kind {
        Kind::MainPanic if rank == case.victim => {
            died_now();
            panic!("a rank's main thread panics between steps");
        }
        Kind::Exit if rank == case.victim => {
            died_now();
            std::process::exit(3);
        }
        _ => {}
    }
    // With a rank per shard every shard's rank holds the stage: strike the victim rank alone.
    let (strikes_here, stage_idx) = match case.layout {
        Layout::PerShard => (rank == case.victim, case.victim / (ranks / 2)),
        Layout::Replicas => (rank == case.victim, case.victim % 2),
        Layout::Pipeline => (true, case.victim),
    };
    if let Some(at) = case.at.filter(|_| strikes_here) {
        trainer.inject_fault(Some(FaultInjection {
            stage_idx,
            at: at.point(),
            micro_batch_idx: 1,
            panic: matches!(case.kind, Kind::Panic | Kind::Kill),
        }));
    }
    let outcome = match trainer.step(fault_batch(STEPS_BEFORE_FAULT)?) {
        Ok(report) => format!("ok: loss {}", report.loss),
        Err(error) => format!("error: {error}"),
    };
    trainer.inject_fault(None);
    std::fs::write(dir.join(format!("rank-{rank}.txt")), outcome)?;
    // A collective: every rank gathers, rank 0 writes.
    trainer.checkpoint(dir.join("after-fault.safetensors"))?;
    // The job goes on: the next step trains on every rank (the split layers' groups recovered).
    let next = match trainer.step(fault_batch(STEPS_BEFORE_FAULT)?) {
        Ok(report) => format!("ok: loss {}", report.loss),
        Err(error) => format!("error: {error}"),
    };
    std::fs::write(dir.join(format!("rank-{rank}-next.txt")), next)?;
    drop(trainer);
    transport::finish_process();
    Ok(())
}

/// One fault case's result, for the table.
pub(super) struct FaultRow {
    pub case: FaultCase,
    pub outcome: String,
    pub exit: String,
    pub wall_s: f64,
    pub ended_after_s: Option<f64>,
    pub failed: bool,
}

pub(super) fn print_fault_table(rows: &[FaultRow]) {
    println!(
        "{:<5} {:<10} {:<9} {:>6} {:>7} {:>9} {:>12}  outcome",
        "ranks", "kind", "point", "stage", "exit", "wall (s)", "ended in (s)"
    );
    for row in rows {
        let c = &row.case;
        println!(
            "{:<5} {:<10} {:<9} {:>6} {:>7} {:>9.2} {:>12}  {}",
            c.ranks,
            c.kind.name(),
            c.at.map_or("-", FaultAt::name),
            match c.kind {
                Kind::MainPanic | Kind::Exit => format!("rank {}", c.victim),
                _ => c.victim.to_string(),
            },
            row.exit,
            row.wall_s,
            row.ended_after_s.map_or("-".to_string(), |s| format!("{s:.3}")),
            if row.failed { "FAIL" } else { "ok" },
        );
    }
    let mut ended: Vec<(String, f64)> = rows
        .iter()
        .filter_map(|r| {
            let label = match r.case.at {
                Some(at) => format!("{} at {}", r.case.kind.name(), at.name()),
                None => r.case.kind.name().to_string(),
            };
            r.ended_after_s.map(|s| (label, s))
        })
        .collect();
    ended.sort_by(|a, b| a.1.total_cmp(&b.1));
    if let (Some(first), Some(last)) = (ended.first(), ended.last()) {
        println!(
            "a dead rank ended the job in {:.3} s at best ({}) and {:.3} s at worst ({}); the limit is {END_WITHIN_S} s",
            first.1, first.0, last.1, last.0
        );
    }
}
