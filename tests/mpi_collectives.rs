//! Collectives across MPI ranks: the transport group (`TransportGroup` over `MpiTransport`) against
//! the in-process group, bit for bit, on 2, 3 and 4 ranks; its traffic against the cost model's;
//! and all-reduce times against the times the model predicts from the link fitted at start-up.
//!
//! The test re-runs its own binary under `mpirun -n {2,3,4} --oversubscribe`, with
//! `CONVEYOR_MPI_COLLECTIVES_RANK` set so that each copy acts as one rank, and a hard timeout on
//! each job. Every rank derives every rank's inputs from one seed, runs each collective on seeded
//! data (lengths not divisible by the rank count, uneven partitions, varying roots) through the
//! transport group, computes the same collectives with an in-process group of as many threads, and
//! compares its own results bit for bit. Rank 0 prints the fitted links and a table of measured
//! against predicted all-reduce times (`-- --nocapture` shows it).
//!
//! Without the `mpi` feature it prints a skip and passes; with it and no `mpirun` on the path it
//! skips too, unless `CONVEYOR_REQUIRE_MPI` is set (as in CI), where it fails.

#[cfg(not(feature = "mpi"))]
fn main() {
    println!("mpi_collectives: skipped (build with `--features mpi` to run collectives across MPI ranks)");
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
    use std::time::{Duration, Instant};

    use anyhow::{Context, ensure};
    use conveyor::engine::collective::{
        CollectiveOp, Communicator, Partition, ProcessGroup, Traffic, TransportGroup, traffic,
    };
    use conveyor::engine::transport::{MpiTransport, Transport};
    use conveyor::engine::{Device, Result};
    use rand::rngs::StdRng;
    use rand::{RngExt, SeedableRng};

    /// Set in the ranks' environment: this copy of the binary is one rank of the job.
    pub const RANK_VAR: &str = "CONVEYOR_MPI_COLLECTIVES_RANK";
    /// Rank counts of the jobs.
    const WORLD_SIZES: [usize; 3] = [2, 3, 4];
    /// Longest a job may run before the launcher kills it.
    const JOB_TIMEOUT: Duration = Duration::from_secs(180);
    /// Longest a rank waits for a peer inside a collective.
    const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(30);
    /// What rank 0 prints last when every check passed on every rank.
    const PASSED: &str = "mpi_collectives: every rank passed";
    /// All-reduce sizes timed, in bytes.
    const TIMED_BYTES: [usize; 5] = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20];

    // ---- the launcher ----

    pub fn launcher_main() -> ExitCode {
        launcher::launcher_main(&launcher::Jobs {
            name: "mpi_collectives",
            rank_var: RANK_VAR,
            world_sizes: &WORLD_SIZES,
            passed: PASSED,
            timeout: JOB_TIMEOUT,
        })
    }

    // ---- one rank ----

    pub fn rank_main() -> ExitCode {
        if std::env::var_os("RUST_LOG").is_some() {
            let _ =
                tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).try_init();
        }
        let started = Instant::now();
        let transport: Arc<dyn Transport> = match MpiTransport::init() {
            Ok(t) => t,
            Err(e) => {
                eprintln!("mpi_collectives: MPI did not start: {e}");
                return ExitCode::FAILURE;
            }
        };
        let init_s = started.elapsed().as_secs_f64();
        match run_rank(&transport, init_s) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                // Every other rank may be waiting on this one: end the job rather than let it hang.
                eprintln!("mpi_collectives: rank {} FAILED: {e:#}", transport.rank());
                transport.abort(1)
            }
        }
    }

    fn run_rank(transport: &Arc<dyn Transport>, init_s: f64) -> anyhow::Result<()> {
        let (rank, n) = (transport.rank(), transport.world_size());
        let group = TransportGroup::with_timeout(Arc::clone(transport), Device::cpu(0), COLLECTIVE_TIMEOUT)?;
        let init_times = transport.all_gather(init_s.to_le_bytes().to_vec(), COLLECTIVE_TIMEOUT)?;
        // Empty contributions (every rank's, then only rank 0's) gather as empty parts.
        let empty = transport.all_gather(Vec::new(), COLLECTIVE_TIMEOUT)?;
        anyhow::ensure!(empty.len() == n && empty.iter().all(Vec::is_empty), "an all-gather of nothing: {empty:?}");
        let some = transport.all_gather(if rank == 0 { Vec::new() } else { vec![rank as u8] }, COLLECTIVE_TIMEOUT)?;
        anyhow::ensure!(
            some[0].is_empty() && (1..n).all(|r| some[r] == [r as u8]),
            "a partly empty all-gather: {some:?}"
        );
        if rank == 0 {
            let slowest_init =
                init_times.iter().map(|b| f64::from_le_bytes(b[..8].try_into().unwrap())).fold(0.0, f64::max);
            println!(
                "  {n} ranks: MpiTransport::init (MPI_Init and the link measurement) took at most {slowest_init:.3} s"
            );
            for peer in 1..n {
                let link = transport.link(peer).context("a link to every peer is measured")?;
                println!(
                    "  fitted link rank 0 <-> rank {peer}: latency {:.2} us, bandwidth {:.2} GB/s",
                    link.latency_s * 1e6,
                    link.bandwidth_bytes_per_s / 1e9
                );
            }
            let link = group.link().context("the group has a link")?;
            println!(
                "  group link (slowest of the world): latency {:.2} us, bandwidth {:.2} GB/s",
                link.latency_s * 1e6,
                link.bandwidth_bytes_per_s / 1e9
            );
        }

        let mut checked = 0;
        for (case, len) in [0, 1, n - 1, n + 1, 7 * n - 1, 1000, 4099, 65_537].into_iter().enumerate() {
            let seed = 0x0C01_1EC7 + 1000 * n as u64 + case as u64;
            let (over_mpi, mpi_traffic) = every_collective(&group, seed, len)?;
            let (in_process, process_traffic) = in_process_reference(n, rank, seed, len)?;
            for (i, op) in CollectiveOp::ALL.iter().enumerate() {
                ensure!(
                    bits(&over_mpi[i]) == bits(&in_process[i]),
                    "rank {rank}: {op} on {len} elements (seed {seed:#x}) differs from the in-process group"
                );
                ensure!(
                    mpi_traffic[i] == process_traffic[i],
                    "rank {rank}: {op} on {len} elements sent {:?}, the in-process group {:?}",
                    mpi_traffic[i],
                    process_traffic[i]
                );
                checked += 1;
            }
        }
        check_traffic_model(&group)?;
        let start_up = group.link().context("a start-up link")?;
        let mut group = group;
        let calibrated = group.calibrate()?;
        let timings = time_all_reduce(transport.as_ref(), &group)?;
        if rank == 0 {
            println!(
                "  start-up link (MPI alone): latency {:.2} us, {:.2} GB/s; calibrated on the group's all-reduces: \
                 latency {:.1} us per message, {:.2} GB/s",
                start_up.latency_s * 1e6,
                start_up.bandwidth_bytes_per_s / 1e9,
                calibrated.latency_s * 1e6,
                calibrated.bandwidth_bytes_per_s / 1e9
            );
            println!(
                "  {checked} collective results bit for bit equal to the in-process group's, traffic as the model says"
            );
            println!(
                "  all-reduce on {n} ranks, slowest rank's median of the runs vs cost_s (start-up link, calibrated link):"
            );
            println!(
                "  {:>10} {:>12} {:>12} {:>8} {:>12} {:>8}",
                "bytes", "measured ms", "start-up ms", "ratio", "calibrated", "ratio"
            );
            for &(bytes, measured_s) in &timings {
                let raw_s = conveyor::engine::collective::cost_s(CollectiveOp::AllReduce, bytes as u64, n, &start_up);
                let predicted_s = group.cost_s(CollectiveOp::AllReduce, bytes as u64).context("a link")?;
                println!(
                    "  {bytes:>10} {:>12.3} {:>12.3} {:>8.2} {:>12.3} {:>8.2}",
                    measured_s * 1e3,
                    raw_s * 1e3,
                    measured_s / raw_s,
                    predicted_s * 1e3,
                    measured_s / predicted_s
                );
            }
            let (latency_s, bandwidth) = effective_link(n, &timings);
            println!(
                "  effective link of the transport group (the same model fitted to these times): \
                 latency {:.1} us per message, bandwidth {:.2} GB/s",
                latency_s * 1e6,
                bandwidth / 1e9
            );
            if let Ok(load) = std::fs::read_to_string("/proc/loadavg") {
                println!(
                    "  (load average while measuring: {})",
                    load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
                );
            }
            println!("{PASSED} ({n} ranks)");
        }
        Ok(())
    }

    /// `t = messages · latency + bytes / bandwidth` fitted to the measured all-reduce times (least
    /// squares on the relative error), with the ring's messages and bytes per rank.
    fn effective_link(n: usize, timings: &[(usize, f64)]) -> (f64, f64) {
        let (mut saa, mut sab, mut sbb, mut sat, mut sbt) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for &(bytes, t) in timings {
            let model = traffic(CollectiveOp::AllReduce, bytes as u64, n);
            let (a, b, w) = (model.messages as f64, model.bytes, 1.0 / (t * t));
            (saa, sab, sbb, sat, sbt) =
                (saa + w * a * a, sab + w * a * b, sbb + w * b * b, sat + w * a * t, sbt + w * b * t);
        }
        let det = saa * sbb - sab * sab;
        ((sbb * sat - sab * sbt) / det, det / (saa * sbt - sab * sat))
    }

    // ---- the cases ----

    /// Rank `rank`'s seeded input number `which` of `len` elements.
    fn input(seed: u64, rank: usize, which: u64, len: usize) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed ^ ((rank as u64) << 40) ^ (which << 20));
        (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// A seeded partition of `total` over `n` ranks, uneven, with some parts possibly empty.
    fn uneven(total: usize, n: usize, rng: &mut StdRng) -> Partition {
        let mut cuts: Vec<usize> = (0..n - 1).map(|_| rng.random_range(0..=total)).collect();
        cuts.sort_unstable();
        let mut counts = Vec::with_capacity(n);
        let mut prev = 0;
        for cut in cuts.into_iter().chain([total]) {
            counts.push(cut - prev);
            prev = cut;
        }
        Partition::from_counts(&counts).expect("at least one rank")
    }

    /// Every collective (in [`CollectiveOp::ALL`]'s order) once on `comm` with the inputs of `seed`
    /// for buffers of `len`: this rank's results and the traffic of each.
    fn every_collective(comm: &dyn Communicator, seed: u64, len: usize) -> Result<(Vec<Vec<f32>>, Vec<Traffic>)> {
        let (n, rank) = (comm.n_ranks(), comm.rank());
        let mut rng = StdRng::seed_from_u64(seed);
        let parts = uneven(len, n, &mut rng);
        // counts[s][d]: what rank s sends to rank d in the all-to-all.
        let counts: Vec<Vec<usize>> =
            (0..n).map(|_| (0..n).map(|_| rng.random_range(0..=len / n + 2)).collect()).collect();
        let send_parts = Partition::from_counts(&counts[rank])?;
        let recv_parts = Partition::from_counts(&(0..n).map(|s| counts[s][rank]).collect::<Vec<_>>())?;
        let root = len % n;
        let mut results = Vec::new();
        let mut traffics = Vec::new();
        for op in CollectiveOp::ALL {
            comm.reset_traffic();
            let which = results.len() as u64;
            let result = match op {
                CollectiveOp::Broadcast => {
                    let mut buf = input(seed, rank, which, len);
                    comm.broadcast(&mut buf, root)?;
                    buf
                }
                CollectiveOp::Scatter => {
                    let mut part = vec![0.0; parts.len(rank)];
                    comm.scatter(&input(seed, rank, which, len), &mut part, root, &parts)?;
                    part
                }
                CollectiveOp::Gather => {
                    let mut whole = vec![0.0; len];
                    comm.gather(&input(seed, rank, which, parts.len(rank)), &mut whole, root, &parts)?;
                    whole
                }
                CollectiveOp::Reduce => {
                    let mut buf = input(seed, rank, which, len);
                    comm.reduce(&mut buf, root)?;
                    buf
                }
                CollectiveOp::AllReduce => {
                    let mut buf = input(seed, rank, which, len);
                    comm.all_reduce(&mut buf)?;
                    buf
                }
                CollectiveOp::AllGather => {
                    let mut whole = vec![0.0; len];
                    comm.all_gather(&input(seed, rank, which, parts.len(rank)), &mut whole, &parts)?;
                    whole
                }
                CollectiveOp::ReduceScatter => {
                    let mut part = vec![0.0; parts.len(rank)];
                    comm.reduce_scatter(&input(seed, rank, which, len), &mut part, &parts)?;
                    part
                }
                CollectiveOp::AllToAll => {
                    let mut received = vec![0.0; recv_parts.total()];
                    comm.all_to_all(
                        &input(seed, rank, which, send_parts.total()),
                        &send_parts,
                        &mut received,
                        &recv_parts,
                    )?;
                    received
                }
            };
            results.push(result);
            traffics.push(comm.traffic());
        }
        Ok((results, traffics))
    }

    /// The same collectives on an in-process group of `n` threads: rank `rank`'s results and traffic.
    fn in_process_reference(n: usize, rank: usize, seed: u64, len: usize) -> Result<(Vec<Vec<f32>>, Vec<Traffic>)> {
        let devices: Vec<Device> = (0..n).map(Device::cpu).collect();
        let handles = ProcessGroup::with_timeout(&devices, COLLECTIVE_TIMEOUT)?;
        let mut all = std::thread::scope(|scope| {
            let threads: Vec<_> = handles.iter().map(|h| scope.spawn(move || every_collective(h, seed, len))).collect();
            threads.into_iter().map(|t| t.join().expect("an in-process rank panicked")).collect::<Result<Vec<_>>>()
        })?;
        Ok(all.swap_remove(rank))
    }

    fn bits(values: &[f32]) -> Vec<u32> {
        values.iter().map(|v| v.to_bits()).collect()
    }

    /// Each collective on an evenly divided buffer whose length every rank count divides: what this
    /// rank sends must be what `collective::traffic` says (the busiest rank's figure, which every
    /// rank of a ring and the root of a root collective send; the other ranks of a reduce or gather
    /// send their own share once).
    fn check_traffic_model(group: &TransportGroup) -> anyhow::Result<()> {
        let (n, rank, len) = (group.n_ranks(), group.rank(), 840 * 3);
        let bytes = (4 * len) as u64;
        let parts = Partition::even(len, n)?;
        let full = vec![1.0f32; len];
        for op in CollectiveOp::ALL {
            group.reset_traffic();
            let (mut whole, mut part) = (vec![0.0; len], vec![0.0; parts.len(rank)]);
            let own = &full[parts.range(rank)];
            match op {
                CollectiveOp::Broadcast => group.broadcast(&mut whole, 0)?,
                CollectiveOp::Reduce => group.reduce(&mut whole, 0)?,
                CollectiveOp::AllReduce => group.all_reduce(&mut whole)?,
                CollectiveOp::Scatter => group.scatter(&full, &mut part, 0, &parts)?,
                CollectiveOp::Gather => group.gather(own, &mut whole, 0, &parts)?,
                CollectiveOp::AllGather => group.all_gather(own, &mut whole, &parts)?,
                CollectiveOp::ReduceScatter => group.reduce_scatter(&full, &mut part, &parts)?,
                CollectiveOp::AllToAll => group.all_to_all(&full, &parts, &mut whole, &parts)?,
            }
            let model = traffic(op, bytes, n);
            let share = Traffic { messages: 1, bytes: (4 * parts.len(rank)) as f64 };
            let expected = match op {
                CollectiveOp::Broadcast | CollectiveOp::Scatter if rank != 0 => Traffic::default(),
                CollectiveOp::Reduce if rank != 0 => Traffic { messages: 1, bytes: bytes as f64 },
                CollectiveOp::Gather if rank != 0 => share,
                CollectiveOp::Reduce | CollectiveOp::Gather => Traffic::default(),
                _ => model,
            };
            ensure!(group.traffic() == expected, "rank {rank}: {op} sent {:?}, expected {expected:?}", group.traffic());
        }
        Ok(())
    }

    /// All-reduce of each of [`TIMED_BYTES`]: every rank starts each run together (after a gather),
    /// times it, and the slowest rank's median over the runs is the collective's time.
    fn time_all_reduce(transport: &dyn Transport, group: &TransportGroup) -> anyhow::Result<Vec<(usize, f64)>> {
        let mut timings = Vec::new();
        for bytes in TIMED_BYTES {
            let runs = if bytes >= 1 << 20 { 7 } else { 15 };
            let mut buf = input(7, group.rank(), 0, bytes / 4);
            group.all_reduce(&mut buf)?; // warm-up
            let mut times = Vec::with_capacity(runs);
            for _ in 0..runs {
                // One byte: an empty buffer's dangling pointer is Open MPI's MPI_IN_PLACE.
                transport.all_gather(vec![0], COLLECTIVE_TIMEOUT)?;
                let t0 = Instant::now();
                group.all_reduce(&mut buf)?;
                times.push(t0.elapsed().as_secs_f64());
                buf.iter_mut().for_each(|v| *v *= 0.25);
            }
            times.sort_by(f64::total_cmp);
            let median = times[runs / 2];
            let all = transport.all_gather(median.to_le_bytes().to_vec(), COLLECTIVE_TIMEOUT)?;
            let slowest = all.iter().map(|b| f64::from_le_bytes(b[..8].try_into().unwrap())).fold(0.0, f64::max);
            timings.push((bytes, slowest));
        }
        Ok(timings)
    }
}
