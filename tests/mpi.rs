//! The MPI tests of issue 18 (`cargo test --features mpi --test mpi`; a test without libtest's
//! harness, since most of it launches `mpirun` and times how jobs end). It owns:
//! - without the `mpi` feature: `conveyor train --transport mpi` exits 2 and says how to enable it;
//!   the MPI tests are skipped, saying why;
//! - with it (skipped when `mpirun` is missing, unless `CONVEYOR_REQUIRE_MPI` is set):
//!   equivalence (`mpirun -n 2|4 conveyor train` with GPipe, 1F1B, ZB-H2 and interleaved against
//!   `--transport in-process`, every tensor bit for bit), a world size that does not fit (exit 2,
//!   the message once, no hang), checkpoint and resume across transports and stage counts, and
//!   faults: an error or a panic at every point of a step on one rank (every rank gets an error,
//!   nothing is half-committed: a checkpoint taken afterwards equals a fault-free run's), a rank
//!   killed in each phase, a rank whose main thread panics and one that exits (the job ends
//!   within 5 s; the times are printed).
//!
//! The same binary is the MPI program of the fault cases: with `CONVEYOR_MPI_FAULT` set, `main` runs
//! as one rank of the job (`rank_main`) instead of as the driver. Every child process has a hard
//! timeout: a hang is a failure, never a stuck test.
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail, ensure};
use conveyor::Sequential;
use conveyor::engine::checkpoint;
use conveyor::engine::graph::{Graph, NodeId};
use conveyor::engine::optim::OptimizerConfig;
use conveyor::engine::runtime::{FaultInjection, FaultPoint, Trainer};
use conveyor::engine::transport::{self, InProcess, MpiTransport, Transport};
use conveyor::engine::{Device, Tensor};
use conveyor::layers::CrossEntropyLoss;
use conveyor::schedules::{OpKind, ScheduleKind};

#[path = "mpi_support/fault_cases.rs"]
mod fault_cases;
use fault_cases::*;

/// Set in the environment of a rank of a fault case: the case, as [`FaultCase::encode`] writes it.
const FAULT_ENV: &str = "CONVEYOR_MPI_FAULT";
/// Set (CI): a missing `mpirun` fails the test instead of skipping it.
const REQUIRE_ENV: &str = "CONVEYOR_REQUIRE_MPI";
/// The longest any child process may run; past it, it is killed and the test fails (a hang).
const CHILD_TIMEOUT: Duration = Duration::from_secs(120);
/// How soon a job must end after a rank dies (issue 18: within 5 s).
const END_WITHIN_S: f64 = 5.0;
/// Fault-free steps before the faulty one.
const STEPS_BEFORE_FAULT: usize = 3;
/// Rows of the fault cases' batches.
const FAULT_BATCH_ROWS: usize = 32;

fn main() -> ExitCode {
    if let Ok(case) = std::env::var(FAULT_ENV) {
        return rank_main(&case);
    }
    // `cargo test -- --list` and test runners that ask: this binary is one test, `mpi`.
    if std::env::args().any(|a| a == "--list") {
        println!("mpi: test");
        return ExitCode::SUCCESS;
    }
    // `cargo test --workspace NAME`: as libtest, run only when a filter matches (here, `mpi`).
    let filters = filters();
    if !filters.is_empty() && !filters.iter().any(|f| "mpi".contains(f.as_str())) {
        println!("mpi tests filtered out by {filters:?}");
        return ExitCode::SUCCESS;
    }
    match drive() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("\nmpi tests FAILED: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// The test-name filters among this binary's arguments (libtest's options and their values
/// skipped).
fn filters() -> Vec<String> {
    const WITH_VALUE: [&str; 6] = ["--test-threads", "--skip", "--format", "--color", "--logfile", "-Z"];
    let mut filters = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if WITH_VALUE.contains(&arg.as_str()) {
            args.next();
        } else if !arg.starts_with('-') {
            filters.push(arg);
        }
    }
    filters
}

// ---------------------------------------------------------------------------------------------
// The driver.

fn drive() -> Result<()> {
    let conveyor = PathBuf::from(env!("CARGO_BIN_EXE_conveyor"));
    if !cfg!(feature = "mpi") {
        without_the_feature(&conveyor)?;
        println!(
            "mpi tests skipped: this build has no `mpi` feature (run `cargo test --features mpi --test mpi` with \
             Open MPI installed); checked that `conveyor train --transport mpi` exits 2 and says how to enable it"
        );
        return Ok(());
    }
    if !on_path("mpirun") {
        if std::env::var_os(REQUIRE_ENV).is_some() {
            bail!("{REQUIRE_ENV} is set but `mpirun` is not on PATH: install Open MPI (openmpi-bin)");
        }
        println!("mpi tests skipped: `mpirun` is not on PATH (install openmpi-bin; set {REQUIRE_ENV}=1 to require it)");
        return Ok(());
    }
    let started = Instant::now();
    let dir = TempDir::new()?;
    let mut h = Harness { conveyor, dir: dir.path.clone(), failures: Vec::new() };

    println!("== equivalence: mpirun -n N against --transport in-process, every tensor bit for bit");
    for (schedule, chunks) in [("gpipe", None), ("1f1b", None), ("zb-h2", None)] {
        for ranks in [2, 4] {
            let result = h.equivalence(schedule, chunks, ranks);
            h.record(&format!("equivalence {schedule} -n {ranks}"), result);
        }
    }
    let result = h.equivalence("interleaved", Some(2), 2);
    h.record("equivalence interleaved --chunks 2 -n 2", result);
    let result = h.overlap_stays_synchronous();
    h.record("--overlap-steps on under mpirun -n 2: synchronous, the overlapped in-process model", result);
    // Tensor-parallel groups inside each rank: 2 ranks of 2 devices each.
    let result = h.equivalence_tensor_parallel(2, 2);
    h.record("equivalence --tensor-parallel 2 on 2 ranks (cpu:4)", result);
    // A rank per tensor-parallel shard (rank = stage x k + shard), checkpoints with Adam's state.
    for (model, devices, k, schedule, extra) in [
        ("mlp:64,96,96,96,10", 4, 2, "1f1b", ""),
        ("cnn", 4, 2, "zb-h2", ""),
        ("resnet", 2, 2, "gpipe", ""),
        ("mlp:64,96,96,96,10", 4, 4, "gpipe", ""),
        ("transformer", 4, 2, "1f1b", ""),
        ("transformer", 4, 2, "zb-h2", "--sequence-parallel"),
    ] {
        let result = h.equivalence_rank_per_shard(model, devices, k, schedule, extra);
        h.record(
            &format!("equivalence {model} --tensor-parallel {k} {extra} {schedule}: -n {devices}, a rank per shard"),
            result,
        );
    }
    // Data-parallel replicas across ranks: a rank per worker (replica x pipeline device), and a
    // rank per device with tensor-parallel groups (2 replicas x 2 stages x 2 shards = 8 ranks);
    // two with small gradient buckets, all-reduced across ranks during the backward pass.
    for (ranks, devices, extra) in [
        (2, "cpu:2", vec!["--microbatches", "1"]),
        (4, "cpu:4", vec!["--stages", "2", "--schedule", "zb-h2", "--microbatches", "2", "--bucket-size", "1KiB"]),
        (4, "cpu:8", vec!["--stages", "2", "--tensor-parallel", "2", "--microbatches", "2"]),
        (8, "cpu:8", vec!["--stages", "2", "--tensor-parallel", "2", "--microbatches", "2", "--bucket-size", "1"]),
    ] {
        let result = h.equivalence_data_parallel(ranks, devices, &extra);
        h.record(&format!("equivalence --data-parallel 2 {} on {devices}: -n {ranks}", extra.join(" ")), result);
    }

    // Tied parameters across ranks: the transformer's embedding (stage 0) and output projection
    // (the last stage) summed over the ranks holding them, alone and in 2 replicas.
    for (ranks, extra) in [(2, vec!["--devices", "cpu:2"]), (4, vec!["--devices", "cpu:4", "--data-parallel", "2"])] {
        let result = h.equivalence_tied(ranks, &extra);
        h.record(&format!("equivalence tied transformer {}: -n {ranks}", extra.join(" ")), result);
    }

    // The data-parallel strategies under mpirun: one worker per rank, the server shards on the
    // ranks; the saved model (and a seeded run's record of turns) equal the in-process run's.
    println!("== strategies: mpirun -n N conveyor train --sync ... against the in-process workers");
    for (ranks, extra) in [
        (2, vec!["--sync", "ps:2"]),
        (4, vec!["--sync", "ps:3", "--compress", "bf16"]),
        (4, vec!["--sync", "ssp:1", "--interleaving", "seed:3"]),
        (2, vec!["--sync", "downpour:2,1", "--interleaving", "seed:4", "--compress", "topk:0.1"]),
        (2, vec!["--sync", "allreduce", "--compress", "powersgd:2", "--compress-after", "2"]),
        (4, vec!["--sync", "average:2"]),
    ] {
        let result = h.equivalence_strategy(ranks, &extra);
        h.record(&format!("strategy {}: -n {ranks}", extra.join(" ")), result);
    }
    let result = h.strategy_world_size();
    h.record("strategy --data-parallel 2 on 3 ranks", result);

    println!("== world size");
    let result = h.world_size();
    h.record("world size 3 for 2 devices", result);

    println!("== checkpoint and resume across transports and stage counts");
    let result = h.resume();
    h.record("resume", result);

    println!("== faults");
    let rows = h.faults();

    println!("\n== fault cases");
    print_fault_table(&rows);
    println!("\nmpi tests: {:.1} s in all", started.elapsed().as_secs_f64());
    if !h.failures.is_empty() {
        bail!("{} failure(s):\n  {}", h.failures.len(), h.failures.join("\n  "));
    }
    Ok(())
}

/// Without the feature: `--transport mpi` is refused with exit status 2, saying how to enable it.
fn without_the_feature(conveyor: &Path) -> Result<()> {
    let mut command = Command::new(conveyor);
    command.args(["train", "--transport", "mpi", "--steps", "1"]);
    let out = run_child(command, "conveyor train --transport mpi (no mpi feature)")?;
    ensure!(
        out.code == Some(2),
        "`conveyor train --transport mpi` without the feature exited {}, not 2\n{}",
        out.status_text(),
        out.text()
    );
    ensure!(
        out.stderr.contains("--features mpi"),
        "`conveyor train --transport mpi` without the feature does not say `--features mpi`:\n{}",
        out.stderr
    );
    Ok(())
}

struct Harness {
    conveyor: PathBuf,
    dir: PathBuf,
    failures: Vec<String>,
}

impl Harness {
    fn record(&mut self, name: &str, result: Result<String>) {
        match result {
            Ok(note) => println!("  ok    {name}: {note}"),
            Err(error) => {
                println!("  FAIL  {name}: {error:#}");
                self.failures.push(format!("{name}: {error:#}"));
            }
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// `conveyor train ARGS` in this process's view: in-process, or under `mpirun -n ranks`.
    fn train(&self, ranks: Option<usize>, args: &[String]) -> Result<Finished> {
        let (mut command, what) = match ranks {
            Some(n) => {
                let mut command = mpirun(n);
                command.arg(&self.conveyor).args(["train", "--transport", "mpi"]);
                (command, format!("mpirun -n {n} conveyor train --transport mpi {}", args.join(" ")))
            }
            None => {
                let mut command = Command::new(&self.conveyor);
                command.args(["train", "--transport", "in-process"]);
                (command, format!("conveyor train --transport in-process {}", args.join(" ")))
            }
        };
        command.args(args).args(["--log-every", "0"]);
        run_child(command, &what)
    }

    /// Trains and requires success.
    fn train_ok(&self, ranks: Option<usize>, args: &[String]) -> Result<Finished> {
        let out = self.train(ranks, args)?;
        ensure!(out.code == Some(0), "{} exited {}\n{}", out.what, out.status_text(), out.text());
        Ok(out)
    }

    /// `ranks` ranks of `k` devices each (the pipeline's devices are the groups): every tensor bit
    /// for bit equal to the same layout in one process.
    fn equivalence_tensor_parallel(&self, ranks: usize, k: usize) -> Result<String> {
        let args = strings(&[
            "--model",
            "mlp:64,96,96,96,10",
            "--devices",
            &format!("cpu:{}", ranks * k),
            "--tensor-parallel",
            &k.to_string(),
            "--schedule",
            "1f1b",
            "--microbatches",
            "4",
            "--steps",
            "8",
            "--batch",
            "64",
        ]);
        let mpi = self.path(&format!("eq-tp{k}-{ranks}-mpi.safetensors"));
        let local = self.path(&format!("eq-tp{k}-{ranks}-in-process.safetensors"));
        self.train_ok(Some(ranks), &with_path(&args, "--save", &mpi))?;
        self.train_ok(None, &with_path(&args, "--save", &local))?;
        same_tensors(&mpi, &local)
    }

    /// `--overlap-steps on` under `mpirun -n 2`: the steps stay synchronous (said once), and the
    /// model is bit for bit the one the same command overlapped in one process trains.
    fn overlap_stays_synchronous(&self) -> Result<String> {
        let args = strings(&[
            "--model",
            "mlp:64,96,96,96,10",
            "--devices",
            "cpu:2",
            "--schedule",
            "zb-h2",
            "--microbatches",
            "4",
            "--steps",
            "8",
            "--batch",
            "64",
            "--overlap-steps",
            "on",
        ]);
        let (mpi, local) = (self.path("overlap-mpi.safetensors"), self.path("overlap-in-process.safetensors"));
        let out = self.train_ok(Some(2), &with_path(&args, "--save", &mpi))?;
        let said = "overlapped steps: off (steps overlap in one process only";
        ensure!(out.text().matches(said).count() == 1, "expected `{said}` once:\n{}", out.text());
        let out = self.train_ok(None, &with_path(&args, "--save", &local))?;
        ensure!(out.text().contains("overlapped steps: each stage starts"), "in one process:\n{}", out.text());
        same_tensors(&mpi, &local)
    }

    fn equivalence(&self, schedule: &str, chunks: Option<usize>, ranks: usize) -> Result<String> {
        let mut args = strings(&[
            "--model",
            "mlp:64,96,96,96,10",
            "--devices",
            &format!("cpu:{ranks}"),
            "--schedule",
            schedule,
            "--microbatches",
            "4",
            "--steps",
            "8",
            "--batch",
            "64",
        ]);
        if let Some(chunks) = chunks {
            args.extend(strings(&["--chunks", &chunks.to_string()]));
        }
        let mpi = self.path(&format!("eq-{schedule}-{ranks}-mpi.safetensors"));
        let local = self.path(&format!("eq-{schedule}-{ranks}-in-process.safetensors"));
        let t0 = Instant::now();
        self.train_ok(Some(ranks), &with_path(&args, "--save", &mpi))?;
        let mpi_s = t0.elapsed().as_secs_f64();
        self.train_ok(None, &with_path(&args, "--save", &local))?;
        let same = same_tensors(&mpi, &local)?;
        Ok(format!("{same} (mpirun {mpi_s:.2} s)"))
    }

    /// `conveyor train --data-parallel ranks` through a strategy (`extra`) under `mpirun -n ranks`
    /// and in one process: the saved models bit for bit, and for a seeded run the records of turns.
    fn equivalence_strategy(&self, ranks: usize, extra: &[&str]) -> Result<String> {
        let n = ranks.to_string();
        let mut args = strings(&[
            "--model",
            "mlp:64,32,10",
            "--devices",
            &format!("cpu:{ranks}"),
            "--data-parallel",
            &n,
            "--microbatches",
            "1",
            "--steps",
            "6",
            "--batch",
            "64",
            "--eval-every",
            "3",
        ]);
        args.extend(strings(extra));
        let name = format!("sync-{ranks}-{}", extra.join("").replace(['-', ':', ','], ""));
        let seeded = extra.contains(&"--interleaving");
        let run = |ranks: Option<usize>, tag: &str| -> Result<(PathBuf, Option<String>, f64)> {
            let model = self.path(&format!("{name}-{tag}.safetensors"));
            let turns = self.path(&format!("{name}-{tag}.turns.json"));
            let mut args = with_path(&args, "--save", &model);
            if seeded {
                args = with_path(&args, "--record-interleaving", &turns);
            }
            let out = self.train_ok(ranks, &args)?;
            let turns =
                if seeded { Some(std::fs::read_to_string(&turns).context("the record of turns")?) } else { None };
            Ok((model, turns, out.wall_s))
        };
        let (mpi, mpi_turns, mpi_s) = run(Some(ranks), "mpi")?;
        let (local, local_turns, _) = run(None, "local")?;
        let same = same_tensors(&mpi, &local)?;
        ensure!(mpi_turns == local_turns, "the records of turns differ: {mpi_turns:?} against {local_turns:?}");
        let turns = mpi_turns.map(|t| format!("; the same {} turns", t.matches(',').count() + 1)).unwrap_or_default();
        Ok(format!("{same}{turns} (mpirun {mpi_s:.2} s)"))
    }

    /// A strategy under `mpirun` with a rank count other than `--data-parallel`: exit 2, said once.
    fn strategy_world_size(&self) -> Result<String> {
        let args = strings(&[
            "--model",
            "mlp:64,32,10",
            "--devices",
            "cpu:2",
            "--data-parallel",
            "2",
            "--sync",
            "ps",
            "--steps",
            "1",
        ]);
        let out = self.train(Some(3), &args)?;
        ensure!(out.code == Some(2), "mpirun -n 3 for 2 workers exited {}, not 2\n{}", out.status_text(), out.text());
        let needle = "runs one worker per rank";
        let count = out.stderr.matches(needle).count();
        ensure!(count == 1, "stderr says `{needle}` {count} times, not once:\n{}", out.stderr);
        Ok(format!(
            "exit 2 after {:.2} s: {}",
            out.wall_s,
            out.stderr.lines().find(|l| l.contains(needle)).unwrap_or("")
        ))
    }

    fn world_size(&self) -> Result<String> {
        let args = strings(&["--model", "mlp:64,96,96,96,10", "--devices", "cpu:2", "--steps", "1"]);
        let out = self.train(Some(3), &args)?;
        ensure!(out.code == Some(2), "mpirun -n 3 for 2 devices exited {}, not 2\n{}", out.status_text(), out.text());
        let needle = "ranks but the layout needs";
        let count = out.stderr.matches(needle).count();
        ensure!(count == 1, "stderr says `{needle}` {count} times, not once:\n{}", out.stderr);
        Ok(format!("exit 2 after {:.2} s, the message once", out.wall_s))
    }

    /// REF: 10 uninterrupted in-process steps on cpu:4. Then 5 steps under `mpirun -n 2` resumed
    /// in-process on cpu:4, and 5 in-process steps on cpu:2 resumed under `mpirun -n 4`: both equal
    /// REF bit for bit.
    fn resume(&self) -> Result<String> {
        let common = |devices: &str, steps: u64| {
            strings(&[
                "--model",
                "mlp:64,96,96,96,10",
                "--devices",
                devices,
                "--schedule",
                "1f1b",
                "--microbatches",
                "4",
                "--batch",
                "64",
                "--lr-schedule",
                "constant",
                "--steps",
                &steps.to_string(),
            ])
        };
        let reference = self.path("resume-ref.safetensors");
        self.train_ok(None, &with_path(&common("cpu:4", 10), "--save", &reference))?;

        let checkpoint = self.path("resume-mpi-2.ckpt.safetensors");
        self.train_ok(Some(2), &with_path(&common("cpu:2", 5), "--checkpoint", &checkpoint))?;
        let out = self.path("resume-from-mpi.safetensors");
        let args = with_path(&with_path(&common("cpu:4", 10), "--resume", &checkpoint), "--save", &out);
        self.train_ok(None, &args)?;
        let first = same_tensors(&out, &reference).context("mpirun -n 2 (5 steps) resumed in-process on cpu:4")?;

        let checkpoint = self.path("resume-in-process-2.ckpt.safetensors");
        self.train_ok(None, &with_path(&common("cpu:2", 5), "--checkpoint", &checkpoint))?;
        let out = self.path("resume-under-mpi.safetensors");
        let args = with_path(&with_path(&common("cpu:4", 10), "--resume", &checkpoint), "--save", &out);
        self.train_ok(Some(4), &args)?;
        let second = same_tensors(&out, &reference).context("in-process cpu:2 (5 steps) resumed under mpirun -n 4")?;

        // A rank per shard: 5 steps under mpirun -n 4 (2 stages x 2 shards) resumed in-process in
        // the same layout, against 10 uninterrupted in-process steps in it.
        let tp = |steps: u64| {
            let mut args = common("cpu:4", steps);
            args.extend(strings(&["--tensor-parallel", "2"]));
            args
        };
        let reference = self.path("resume-tp-ref.safetensors");
        self.train_ok(None, &with_path(&tp(10), "--save", &reference))?;
        let checkpoint = self.path("resume-tp-mpi-4.ckpt.safetensors");
        self.train_ok(Some(4), &with_path(&tp(5), "--checkpoint", &checkpoint))?;
        let out = self.path("resume-tp-from-mpi.safetensors");
        self.train_ok(None, &with_path(&with_path(&tp(10), "--resume", &checkpoint), "--save", &out))?;
        let third = same_tensors(&out, &reference)
            .context("mpirun -n 4, a rank per shard (5 steps), resumed in-process with --tensor-parallel 2")?;
        Ok(format!(
            "mpirun -n 2 -> in-process cpu:4: {first}; in-process cpu:2 -> mpirun -n 4: {second} (both against 10 \
             uninterrupted steps on cpu:4); mpirun -n 4 a rank per shard -> in-process --tensor-parallel 2: {third}"
        ))
    }

    /// `mpirun -n ranks` with 2 data-parallel replicas (the cnn) against the same layout in one
    /// process: every tensor of the checkpoint bit for bit, and a trace row per rank.
    fn equivalence_data_parallel(&self, ranks: usize, devices: &str, extra: &[&str]) -> Result<String> {
        let mut args =
            strings(&["--model", "cnn", "--devices", devices, "--data-parallel", "2", "--steps", "5", "--batch", "64"]);
        args.extend(strings(extra));
        let name = format!("dp-{ranks}-{}", extra.join("").replace("--", "-"));
        let (mpi, local) =
            (self.path(&format!("{name}-mpi.safetensors")), self.path(&format!("{name}-local.safetensors")));
        let trace = self.path(&format!("{name}.trace.json"));
        let t0 = Instant::now();
        self.train_ok(Some(ranks), &with_path(&with_path(&args, "--checkpoint", &mpi), "--trace", &trace))?;
        let mpi_s = t0.elapsed().as_secs_f64();
        self.train_ok(None, &with_path(&args, "--checkpoint", &local))?;
        let same = same_tensors(&mpi, &local)?;
        let rows = trace_rows(&trace, ranks)?;
        Ok(format!("{same}; a trace row for each of the {rows} ranks (mpirun {mpi_s:.2} s)"))
    }

    /// A transformer with its output projection tied to its embedding: `mpirun -n ranks` against
    /// the same layout in one process, every tensor (parameters and Adam's state) bit for bit.
    fn equivalence_tied(&self, ranks: usize, extra: &[&str]) -> Result<String> {
        let mut args = strings(&[
            "--model",
            "transformer:16,8,16,2,2,16,tied",
            "--data",
            "tokens:256,8,16,16",
            "--steps",
            "4",
            "--batch",
            "32",
            "--microbatches",
            "2",
            "--optimizer",
            "adam",
        ]);
        args.extend(strings(extra));
        let name = format!("tied-{ranks}");
        let (mpi, local) =
            (self.path(&format!("{name}-mpi.safetensors")), self.path(&format!("{name}-local.safetensors")));
        let t0 = Instant::now();
        self.train_ok(Some(ranks), &with_path(&args, "--checkpoint", &mpi))?;
        let mpi_s = t0.elapsed().as_secs_f64();
        self.train_ok(None, &with_path(&args, "--checkpoint", &local))?;
        let same = same_tensors(&mpi, &local)?;
        Ok(format!("{same} (mpirun {mpi_s:.2} s)"))
    }

    /// `mpirun -n devices` with a rank per tensor-parallel shard against the same layout in one
    /// process: every tensor of the checkpoint (parameters and Adam's state) bit for bit.
    fn equivalence_rank_per_shard(
        &self,
        model: &str,
        devices: usize,
        k: usize,
        schedule: &str,
        extra: &str,
    ) -> Result<String> {
        let args = strings(&[
            "--model",
            model,
            "--devices",
            &format!("cpu:{devices}"),
            "--tensor-parallel",
            &k.to_string(),
            "--schedule",
            schedule,
            "--microbatches",
            "4",
            "--steps",
            "6",
            "--batch",
            "64",
        ]);
        // A transformer reads token ids: 256 sequences of its 16 tokens from a vocabulary of 32.
        let args = match model.starts_with("transformer") {
            true => [args, strings(&["--data", "tokens:256,16,32,4"])].concat(),
            false => args,
        };
        let args = [args, extra.split_whitespace().map(str::to_string).collect()].concat();
        let name = format!("{}{}", model.split(':').next().unwrap_or(model), extra.replace(' ', ""));
        let mpi = self.path(&format!("eq-ranks-{name}-{k}-{schedule}-mpi.safetensors"));
        let local = self.path(&format!("eq-ranks-{name}-{k}-{schedule}-in-process.safetensors"));
        let trace = self.path(&format!("eq-ranks-{name}-{k}-{schedule}.trace.json"));
        let t0 = Instant::now();
        self.train_ok(Some(devices), &with_path(&with_path(&args, "--checkpoint", &mpi), "--trace", &trace))?;
        let mpi_s = t0.elapsed().as_secs_f64();
        self.train_ok(None, &with_path(&args, "--checkpoint", &local))?;
        let same = same_tensors(&mpi, &local)?;
        let rows = trace_rows(&trace, devices)?;
        Ok(format!("{same}; the trace has a row of ops for each of the {rows} ranks (mpirun {mpi_s:.2} s)"))
    }

    fn faults(&mut self) -> Vec<FaultRow> {
        let points = FaultAt::ALL;
        let mut cases = Vec::new();
        for kind in [Kind::Error, Kind::Panic] {
            for at in points {
                for stage_idx in [1, 0] {
                    cases.push(FaultCase { ranks: 2, kind, at: Some(at), victim: stage_idx, layout: Layout::Pipeline });
                }
            }
        }
        for at in points {
            cases.push(FaultCase { ranks: 2, kind: Kind::Kill, at: Some(at), victim: 1, layout: Layout::Pipeline });
        }
        cases.push(FaultCase {
            ranks: 2,
            kind: Kind::Kill,
            at: Some(FaultAt::Op(OpKind::Forward)),
            victim: 0,
            layout: Layout::Pipeline,
        });
        cases.push(FaultCase {
            ranks: 2,
            kind: Kind::Kill,
            at: Some(FaultAt::Apply),
            victim: 0,
            layout: Layout::Pipeline,
        });
        for (kind, at, victim) in [
            (Kind::Error, FaultAt::Op(OpKind::Forward), 2),
            (Kind::Panic, FaultAt::Receive, 3),
            (Kind::Error, FaultAt::Send, 1),
            (Kind::Error, FaultAt::Apply, 3),
            (Kind::Panic, FaultAt::Vote, 0),
            (Kind::Kill, FaultAt::Op(OpKind::Backward), 2),
            (Kind::Kill, FaultAt::Vote, 3),
        ] {
            cases.push(FaultCase { ranks: 4, kind, at: Some(at), victim, layout: Layout::Pipeline });
        }
        // A rank per tensor-parallel shard (2 stages x 2 shards): the struck rank is one shard, the
        // other shard of its stage waits for it inside the split layers' collectives.
        for (kind, at, victim) in [
            (Kind::Error, FaultAt::Op(OpKind::Forward), 1),
            (Kind::Panic, FaultAt::Op(OpKind::Backward), 2),
            (Kind::Error, FaultAt::Apply, 3),
            (Kind::Kill, FaultAt::Op(OpKind::Forward), 3),
        ] {
            cases.push(FaultCase { ranks: 4, kind, at: Some(at), victim, layout: Layout::PerShard });
        }
        // Two data-parallel replicas of 2 stages (4 ranks): the struck rank is one replica's; the
        // other replica waits for it in the gradient all-reduce.
        for (kind, at, victim) in [
            (Kind::Error, FaultAt::Op(OpKind::Forward), 3),
            (Kind::Panic, FaultAt::Prepare, 2),
            (Kind::Error, FaultAt::Apply, 1),
            (Kind::Kill, FaultAt::Op(OpKind::Backward), 2),
        ] {
            cases.push(FaultCase { ranks: 4, kind, at: Some(at), victim, layout: Layout::Replicas });
        }
        cases.push(FaultCase { ranks: 2, kind: Kind::MainPanic, at: None, victim: 1, layout: Layout::Pipeline });
        cases.push(FaultCase { ranks: 2, kind: Kind::Exit, at: None, victim: 1, layout: Layout::Pipeline });
        cases.push(FaultCase { ranks: 4, kind: Kind::MainPanic, at: None, victim: 2, layout: Layout::Pipeline });
        cases.push(FaultCase { ranks: 4, kind: Kind::Exit, at: None, victim: 0, layout: Layout::Pipeline });

        let mut references = std::collections::BTreeMap::new();
        let mut rows = Vec::new();
        for (i, case) in cases.into_iter().enumerate() {
            let case_dir = self.dir.join(format!("fault-{i}"));
            let key = (case.ranks, case.layout);
            let reference = match references.get(&key) {
                Some(path) => Ok(PathBuf::clone(path)),
                None => {
                    let path = self.path(&format!("fault-reference-{}-{:?}.safetensors", case.ranks, case.layout));
                    fault_free_reference(case.ranks, case.layout, &path).map(|()| {
                        references.insert(key, path.clone());
                        path
                    })
                }
            };
            let result = reference.and_then(|reference| run_fault_case(&case, &case_dir, &reference));
            let row = match result {
                Ok(row) => row,
                Err(error) => {
                    let row = FaultRow {
                        case: case.clone(),
                        outcome: format!("FAIL: {error:#}"),
                        exit: String::new(),
                        wall_s: f64::NAN,
                        ended_after_s: None,
                        failed: true,
                    };
                    self.failures.push(format!("fault {}: {error:#}", case.name()));
                    row
                }
            };
            let mark = if row.failed { "FAIL" } else { "ok  " };
            println!("  {mark}  {}: {}", case.name(), row.outcome);
            rows.push(row);
            let _ = std::fs::remove_dir_all(&case_dir);
        }
        rows
    }
}

/// The parameters and optimizer state after [`STEPS_BEFORE_FAULT`] fault-free steps of the fault
/// cases' model, trained in this process on `ranks` devices, written to `path`.
fn fault_free_reference(ranks: usize, layout: Layout, path: &Path) -> Result<()> {
    let mut trainer = layout.trainer(ranks, Arc::new(InProcess))?;
    for step in 0..STEPS_BEFORE_FAULT {
        trainer.step(fault_batch(step)?)?;
    }
    trainer.checkpoint(path)?;
    Ok(())
}

fn run_fault_case(case: &FaultCase, dir: &Path, reference: &Path) -> Result<FaultRow> {
    std::fs::create_dir_all(dir)?;
    let self_exe = std::env::current_exe()?;
    let mut command = mpirun(case.ranks);
    command.args(["-x", FAULT_ENV]).arg(&self_exe).env(FAULT_ENV, case.encode(dir));
    let out = run_child(command, &format!("mpirun -n {} (fault case {})", case.ranks, case.name()))?;
    let exit = out.status_text();
    let diagnostics = || format!("\n{}", out.text());
    match case.kind {
        Kind::Error | Kind::Panic => {
            ensure!(
                out.code == Some(0),
                "the job exited {exit}, not 0 (every rank should go on after the error){}",
                diagnostics()
            );
            let mut texts = Vec::new();
            for rank in 0..case.ranks {
                let file = dir.join(format!("rank-{rank}.txt"));
                let text = std::fs::read_to_string(&file)
                    .with_context(|| format!("rank {rank} wrote no outcome{}", diagnostics()))?;
                ensure!(text.starts_with("error: "), "rank {rank}'s faulty step did not fail: {text}");
                texts.push(text);
            }
            let named = match case.layout {
                // The struck rank, never the rank freed from waiting for it.
                Layout::PerShard | Layout::Replicas => vec![format!("rank {}", case.victim)],
                Layout::Pipeline => vec![format!("stage {}", case.victim), format!("rank {}", case.victim)],
            };
            ensure!(
                named.iter().any(|n| texts[0].contains(n.as_str())),
                "rank 0's error does not name stage {} or rank {}: {}",
                case.victim,
                case.victim,
                texts[0]
            );
            let same = same_tensors(&dir.join("after-fault.safetensors"), reference)
                .context("the checkpoint after the failed step against the fault-free 3 steps")?;
            for rank in 0..case.ranks {
                let file = dir.join(format!("rank-{rank}-next.txt"));
                let text = std::fs::read_to_string(&file).with_context(|| format!("rank {rank} wrote no next step"))?;
                ensure!(text.starts_with("ok"), "rank {rank}'s step after the failed one: {text}");
            }
            let rank0 = texts[0].trim_start_matches("error: ").trim();
            Ok(FaultRow {
                case: case.clone(),
                outcome: format!(
                    "every rank failed the step, then the next step trained; checkpoint {same}; {:.2} s; rank 0: {}",
                    out.wall_s,
                    shorten(rank0, 150)
                ),
                exit,
                wall_s: out.wall_s,
                ended_after_s: None,
                failed: false,
            })
        }
        Kind::Kill | Kind::MainPanic | Kind::Exit => {
            ensure!(out.code != Some(0), "the job exited 0 although a rank died{}", diagnostics());
            let stamp = std::fs::read_to_string(dir.join("died-at.txt")).with_context(|| {
                format!("the rank that should die wrote no time (it never reached the fault){}", diagnostics())
            })?;
            let died_at: f64 = stamp.trim().parse().context("the death time")?;
            let ended_after = out.exited_at - died_at;
            ensure!(
                ended_after < END_WITHIN_S,
                "the job ended {ended_after:.3} s after the rank died, not within {END_WITHIN_S} s{}",
                diagnostics()
            );
            Ok(FaultRow {
                case: case.clone(),
                outcome: format!("job ended {ended_after:.3} s after the rank died (mpirun {exit})"),
                exit,
                wall_s: out.wall_s,
                ended_after_s: Some(ended_after),
                failed: false,
            })
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Processes, files and comparisons.

/// `mpirun -n n --oversubscribe`, allowed to run as root.
fn mpirun(n: usize) -> Command {
    let mut command = Command::new("mpirun");
    command
        .args(["-n", &n.to_string(), "--oversubscribe"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    command
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
}

/// A child process that ended.
struct Finished {
    what: String,
    code: Option<i32>,
    signal: Option<i32>,
    stdout: String,
    stderr: String,
    /// When it ended, seconds since the Unix epoch (polled every 2 ms).
    exited_at: f64,
    wall_s: f64,
}

impl Finished {
    fn status_text(&self) -> String {
        match (self.code, self.signal) {
            (Some(code), _) => format!("status {code}"),
            (None, Some(signal)) => format!("signal {signal}"),
            (None, None) => "?".into(),
        }
    }
    fn text(&self) -> String {
        format!(
            "--- stdout of {}:\n{}\n--- stderr:\n{}",
            self.what,
            shorten(&self.stdout, 4000),
            shorten(&self.stderr, 4000)
        )
    }
}

/// Runs `command` to its end, with its output captured and [`CHILD_TIMEOUT`] as a hard limit: past
/// it the child (and its process group) is killed and this fails.
fn run_child(mut command: Command, what: &str) -> Result<Finished> {
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    let started = Instant::now();
    let mut child = command.spawn().with_context(|| format!("could not start {what}"))?;
    let stdout = read_all(child.stdout.take());
    let stderr = read_all(child.stderr.take());
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() > CHILD_TIMEOUT {
            let group = child.id() as i32;
            // SAFETY: kill only sends signals, to the child's own process group.
            unsafe {
                libc::kill(-group, libc::SIGTERM);
            }
            std::thread::sleep(Duration::from_secs(2));
            unsafe {
                libc::kill(-group, libc::SIGKILL);
            }
            let _ = child.wait();
            let out = stdout.recv_timeout(Duration::from_secs(2)).unwrap_or_default();
            let err = stderr.recv_timeout(Duration::from_secs(2)).unwrap_or_default();
            bail!(
                "{what} ran past {} s and was killed: a hang\n--- stdout:\n{}\n--- stderr:\n{}",
                CHILD_TIMEOUT.as_secs(),
                shorten(&out, 4000),
                shorten(&err, 4000)
            );
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let exited_at = now_s();
    let wall_s = started.elapsed().as_secs_f64();
    Ok(Finished {
        what: what.to_string(),
        code: status.code(),
        signal: status.signal(),
        stdout: stdout.recv_timeout(Duration::from_secs(10)).unwrap_or_default(),
        stderr: stderr.recv_timeout(Duration::from_secs(10)).unwrap_or_default(),
        exited_at,
        wall_s,
    })
}

/// Reads a pipe to its end on a thread of its own (so neither pipe can fill and stall the child).
fn read_all(pipe: Option<impl Read + Send + 'static>) -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    if let Some(mut pipe) = pipe {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            let _ = tx.send(String::from_utf8_lossy(&bytes).into_owned());
        });
    }
    rx
}

/// Whether two safetensors files hold the same tensors (names, shapes, dtypes and every bit); the
/// files may differ in metadata and order. Says how many tensors and values it compared.
fn same_tensors(a: &Path, b: &Path) -> Result<String> {
    let host = Device::host();
    let left = checkpoint::load(a, &host).with_context(|| format!("loading {}", a.display()))?;
    let right = checkpoint::load(b, &host).with_context(|| format!("loading {}", b.display()))?;
    let mut left_names: Vec<&str> = left.names().collect();
    let mut right_names: Vec<&str> = right.names().collect();
    left_names.sort_unstable();
    right_names.sort_unstable();
    ensure!(left_names == right_names, "different tensors: {left_names:?} against {right_names:?}");
    let mut values = 0;
    for name in &left_names {
        let (x, y) = (left.get(name).expect("listed"), right.get(name).expect("listed"));
        ensure!(x.dims() == y.dims(), "`{name}`: shape {:?} against {:?}", x.dims(), y.dims());
        if !x.bit_eq(y) {
            let (xs, ys) = (x.to_vec_f32(), y.to_vec_f32());
            let differing = xs.iter().zip(&ys).filter(|(p, q)| p.to_bits() != q.to_bits()).count();
            let max = xs.iter().zip(&ys).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
            bail!("`{name}` differs in {differing} of {} values (largest difference {max:e})", xs.len());
        }
        values += x.dims().iter().product::<usize>();
    }
    Ok(format!("{} tensors, {values} values bit for bit equal", left_names.len()))
}

/// Checks that a Perfetto trace names `ranks` processes `rank r (cpu:...)` and holds ops in each;
/// returns the number of ranks.
fn trace_rows(path: &Path, ranks: usize) -> Result<usize> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text).context("the trace is JSON")?;
    let events = json.get("traceEvents").and_then(|e| e.as_array()).context("traceEvents")?;
    for rank in 0..ranks {
        let pid = serde_json::json!(rank);
        let name = format!("rank {rank} (cpu:");
        let named = events.iter().any(|e| {
            e["ph"] == "M"
                && e["name"] == "process_name"
                && e["pid"] == pid
                && e["args"]["name"].as_str().is_some_and(|n| n.starts_with(name.as_str()))
        });
        ensure!(named, "the trace names no process `{name}`");
        let ops = events.iter().filter(|e| e["ph"] == "X" && e["pid"] == pid).count();
        ensure!(ops > 0, "the trace holds no op of rank {rank}");
    }
    Ok(ranks)
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

fn with_path(args: &[String], flag: &str, path: &Path) -> Vec<String> {
    let mut args = args.to_vec();
    args.push(flag.to_string());
    args.push(path.display().to_string());
    args
}

fn shorten(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

/// A directory under the system's temporary directory, removed when dropped.
struct TempDir {
    path: PathBuf,
}

impl TempDir {
    fn new() -> Result<TempDir> {
        let path = std::env::temp_dir().join(format!("conveyor-mpi-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path)?;
        Ok(TempDir { path })
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
