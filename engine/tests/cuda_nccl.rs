//! The NCCL communicator against the in-process group: the same inputs through every collective,
//! on a group of every GPU (built with `--features nccl`, with libnccl and a GPU present), must
//! give what the in-process group of as many CPU devices gives. Elsewhere the test checks that
//! asking for an NCCL group is a clear error and prints why the GPU cases were skipped.
//!
//! A second case aborts an NCCL group from outside and checks that its waits end and its ranks
//! refuse later calls.
//!
//! Tolerance: data movement (broadcast, scatter, gather, all-gather, all-to-all) bit for bit; sums
//! over `n` ranks of values in [-1, 1) within `2·n·2⁻²⁴·n` absolute (any order of `n` terms).
use anyhow::{Result, bail, ensure};
use conveyor_engine::collective::{Communicator, Partition, ProcessGroup};
use conveyor_engine::{CudaDevice, Device};

/// Seeded values in `[-1, 1)` for `rank`.
fn values(seed: u64, rank: usize, len: usize) -> Vec<f32> {
    let mut state = (seed * 1000 + rank as u64).wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Every collective on one rank, its outputs concatenated in a fixed order.
fn run_all(comm: &dyn Communicator) -> conveyor_engine::Result<Vec<Vec<f32>>> {
    let (rank, n) = (comm.rank(), comm.n_ranks());
    let even = Partition::even(10 * n + 3, n)?; // unequal parts unless n divides 3
    let equal = Partition::even(6 * n, n)?;
    let mut outputs = Vec::new();

    let mut buf = values(1, rank, 1000);
    comm.broadcast(&mut buf, n - 1)?;
    outputs.push(buf);
    let mut buf = values(2, rank, 1000);
    comm.reduce(&mut buf, 0)?;
    outputs.push(if rank == 0 { buf } else { Vec::new() });
    let mut buf = values(3, rank, 1001);
    comm.all_reduce(&mut buf)?;
    outputs.push(buf);
    for parts in [&even, &equal] {
        let send = values(4, rank, parts.total());
        let mut recv = vec![0.0; parts.len(rank)];
        comm.scatter(&send, &mut recv, 0, parts)?;
        outputs.push(recv);
        let send = values(5, rank, parts.len(rank));
        let mut recv = vec![0.0; if rank == 0 { parts.total() } else { 0 }];
        comm.gather(&send, &mut recv, 0, parts)?;
        outputs.push(recv);
        let mut recv = vec![0.0; parts.total()];
        comm.all_gather(&send, &mut recv, parts)?;
        outputs.push(recv);
        let send = values(6, rank, parts.total());
        let mut recv = vec![0.0; parts.len(rank)];
        comm.reduce_scatter(&send, &mut recv, parts)?;
        outputs.push(recv);
    }
    // All-to-all: rank r sends r + d + 1 elements to rank d.
    let send_parts = Partition::from_counts(&(0..n).map(|d| rank + d + 1).collect::<Vec<_>>())?;
    let recv_parts = Partition::from_counts(&(0..n).map(|s| s + rank + 1).collect::<Vec<_>>())?;
    let send = values(7, rank, send_parts.total());
    let mut recv = vec![0.0; recv_parts.total()];
    comm.all_to_all(&send, &send_parts, &mut recv, &recv_parts)?;
    outputs.push(recv);
    Ok(outputs)
}

/// `run_all` on every rank of a group, each on its own thread.
fn run_group(group: &[Box<dyn Communicator>]) -> Result<Vec<Vec<Vec<f32>>>> {
    std::thread::scope(|scope| {
        let threads: Vec<_> = group.iter().map(|comm| scope.spawn(move || run_all(comm.as_ref()))).collect();
        threads
            .into_iter()
            .map(|t| t.join().map_err(|_| anyhow::anyhow!("a rank panicked"))?.map_err(Into::into))
            .collect()
    })
}

#[test]
fn nccl_collectives_match_the_in_process_group() -> Result<()> {
    // Asking for an NCCL group of CPU devices is always a clear error, whatever the build.
    let err = CudaDevice::nccl_group(&[Device::cpu(0)]).err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(
        err.contains("without the `cuda` feature")
            || err.contains("without the `nccl` feature")
            || err.contains("NCCL serves CUDA"),
        "unexpected answer for a CPU NCCL group: {err:?}"
    );
    // The case list itself is consistent (partitions, roots): it runs on an in-process group.
    run_group(&in_process_group(3)?)?;
    let gpus = match CudaDevice::count() {
        Ok(0) => return skip("the CUDA driver sees no GPU"),
        Ok(count) => count,
        Err(err) => return skip(&err.to_string()),
    };
    let devices = (0..gpus).map(|ordinal| Device::cuda(ordinal, None)).collect::<conveyor_engine::Result<Vec<_>>>()?;
    let group = match CudaDevice::nccl_group(&devices) {
        Ok(group) => group,
        Err(err) => return skip(&err.to_string()),
    };
    let (got, expected) = (run_group(&group)?, run_group(&in_process_group(gpus)?)?);
    let sum_tolerance = 2.0 * (gpus * gpus) as f32 / 16_777_216.0;
    for (rank, (got, expected)) in got.iter().zip(&expected).enumerate() {
        for (index, (g, e)) in got.iter().zip(expected).enumerate() {
            ensure!(g.len() == e.len(), "rank {rank}, output {index}: {} elements, expected {}", g.len(), e.len());
            // Outputs 1, 2, 6 and 10 are sums (reduce, all-reduce, the two reduce-scatters).
            let tolerance = if [1, 2, 6, 10].contains(&index) { sum_tolerance } else { 0.0 };
            for (i, (a, b)) in g.iter().zip(e).enumerate() {
                if (a - b).abs() > tolerance {
                    bail!("rank {rank}, output {index}, element {i}: NCCL gave {a}, the in-process group {b}");
                }
            }
        }
    }
    Ok(())
}

/// An NCCL group aborted from outside (what a worker abandoning its step does to its replica
/// group): with two or more GPUs, a rank waiting for peers that never call ends long before the
/// group's timeout; on any number of GPUs, every rank then refuses calls with
/// `CollectiveAborted`, and a new group works.
#[test]
fn an_aborted_nccl_group_ends_its_waits_and_refuses_later_calls() -> Result<()> {
    let gpus = match CudaDevice::count() {
        Ok(0) => return skip("the CUDA driver sees no GPU"),
        Ok(count) => count,
        Err(err) => return skip(&err.to_string()),
    };
    let devices = (0..gpus).map(|ordinal| Device::cuda(ordinal, None)).collect::<conveyor_engine::Result<Vec<_>>>()?;
    let (group, abort) = match CudaDevice::nccl_group_abortable(&devices) {
        Ok(group) => group,
        Err(err) => return skip(&err.to_string()),
    };
    if gpus >= 2 {
        // Rank 0 alone in an all-reduce: it waits for the others until the abort.
        let started = std::time::Instant::now();
        let outcome = std::thread::scope(|scope| {
            let waiting = scope.spawn(|| group[0].all_reduce(&mut [1.0f32; 1000]));
            std::thread::sleep(std::time::Duration::from_millis(200));
            abort.abort(0, "the step was abandoned");
            waiting.join().map_err(|_| anyhow::anyhow!("rank 0 panicked"))
        })?;
        let waited = started.elapsed();
        ensure!(
            matches!(outcome, Err(conveyor_engine::Error::CollectiveAborted { .. })),
            "the waiting rank should report the abort, got {outcome:?}"
        );
        ensure!(waited < std::time::Duration::from_secs(10), "the abort ended the wait only after {waited:?}");
    } else {
        abort.abort(0, "the step was abandoned");
        println!("one GPU: the wait that an abort ends needs two; checking the refusal only");
    }
    for (rank, comm) in group.iter().enumerate() {
        let refused = comm.all_reduce(&mut [1.0f32; 4]);
        ensure!(
            matches!(refused, Err(conveyor_engine::Error::CollectiveAborted { .. })),
            "rank {rank} after the abort: {refused:?}"
        );
    }
    let fresh = CudaDevice::nccl_group(&devices)?;
    let sums = std::thread::scope(|scope| {
        let threads: Vec<_> = fresh
            .iter()
            .map(|comm| {
                scope.spawn(move || {
                    let mut buf = [1.0f32; 4];
                    comm.all_reduce(&mut buf).map(|()| buf)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().expect("a rank panicked")).collect::<conveyor_engine::Result<Vec<_>>>()
    })?;
    ensure!(sums.iter().all(|s| s.iter().all(|&v| v == gpus as f32)), "a new group sums again: {sums:?}");
    Ok(())
}

/// The in-process group of `n` CPU devices.
fn in_process_group(n: usize) -> Result<Vec<Box<dyn Communicator>>> {
    let cpus: Vec<Device> = (0..n).map(Device::cpu).collect();
    Ok(ProcessGroup::new(&cpus)?.into_iter().map(|h| Box::new(h) as Box<dyn Communicator>).collect())
}

/// Without a GPU or NCCL the GPU half of a case is skipped, unless `CONVEYOR_REQUIRE_CUDA` is set
/// (`scripts/gpu-check` sets it on a GPU machine), where a skip is a failure.
fn skip(why: &str) -> Result<()> {
    ensure!(std::env::var_os("CONVEYOR_REQUIRE_CUDA").is_none(), "CONVEYOR_REQUIRE_CUDA is set, but: {why}");
    println!("NCCL cases skipped: {why}");
    Ok(())
}
