//! Behaviour of the collectives: every collective against a sequential reference for group sizes
//! 1..=8 and seeded random lengths (including lengths not divisible by the group size and shorter
//! than it), the bytes each rank sends against the ring formula, and failures that end every
//! rank's wait instead of hanging.
//!
//! Every group is built with a 10 s timeout, so a protocol bug fails a test instead of hanging it.
//! Sums are compared with `|a - e| ≤ 1e-5 · (|e| + ‖e‖∞) + 1e-6`: f32 sums of at most 8 terms in
//! U(-1, 1) in a different order differ by about 8 · 2⁻²⁴ · Σ|x| ≈ 4e-6 at worst; everything that
//! only moves data must be bit-exact.
use std::time::Duration;

use conveyor_engine::collective::{CollectiveOp, Communicator, Partition, ProcessGroup, RankHandle, traffic};
use conveyor_engine::{Device, Error, Result, init};
use rand::RngExt;
use rand::rngs::StdRng;

const WATCHDOG: Duration = Duration::from_secs(10);

fn group(n: usize) -> Vec<RankHandle> {
    let devices: Vec<Device> = (0..n).map(Device::cpu).collect();
    ProcessGroup::with_timeout(&devices, WATCHDOG).unwrap()
}

/// Runs `f` on every rank, each on its own scoped thread; results in rank order.
fn on_ranks<T: Send>(handles: &[RankHandle], f: impl Fn(&RankHandle) -> Result<T> + Sync) -> Vec<Result<T>> {
    std::thread::scope(|scope| {
        let threads: Vec<_> = handles.iter().map(|h| scope.spawn(|| f(h))).collect();
        threads.into_iter().map(|t| t.join().expect("rank thread panicked")).collect()
    })
}

fn all_ok<T>(results: Vec<Result<T>>) -> Vec<T> {
    results.into_iter().enumerate().map(|(r, res)| res.unwrap_or_else(|e| panic!("rank {r}: {e}"))).collect()
}

fn random_vec(len: usize, rng: &mut StdRng) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn assert_sum_close(what: &str, actual: &[f32], expected: &[f32]) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths");
    let scale = expected.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        let bound = 1e-5 * (e.abs() + scale) + 1e-6;
        assert!((a - e).abs() <= bound, "{what}[{i}]: {a} vs {e}");
    }
}

/// Sequential sum in rank order.
fn reference_sum(inputs: &[Vec<f32>]) -> Vec<f32> {
    let mut sum = vec![0.0f32; inputs[0].len()];
    for input in inputs {
        for (s, x) in sum.iter_mut().zip(input) {
            *s += *x;
        }
    }
    sum
}

/// Lengths for a group of `n`: empty, shorter than `n`, divisible, not divisible, and random.
fn lengths(n: usize, rng: &mut StdRng) -> Vec<usize> {
    let mut lens = vec![0, 1, n.saturating_sub(1), n, 3 * n, 3 * n + 1, 7 * n - 1];
    lens.extend((0..3).map(|_| rng.random_range(0..300)));
    lens
}

/// A random partition of `total` over `n` ranks (some parts may be empty).
fn random_partition(total: usize, n: usize, rng: &mut StdRng) -> Partition {
    let mut cuts: Vec<usize> = (0..n - 1).map(|_| rng.random_range(0..=total)).collect();
    cuts.sort_unstable();
    let mut counts = Vec::with_capacity(n);
    let mut prev = 0;
    for cut in cuts.into_iter().chain([total]) {
        counts.push(cut - prev);
        prev = cut;
    }
    Partition::from_counts(&counts).unwrap()
}

#[test]
fn every_collective_matches_a_sequential_reference() {
    let mut rng = init::rng(7);
    for n in 1..=8 {
        let handles = group(n);
        for len in lengths(n, &mut rng) {
            let inputs: Vec<Vec<f32>> = (0..n).map(|_| random_vec(len, &mut rng)).collect();
            let root = rng.random_range(0..n);
            let sum = reference_sum(&inputs);
            let ctx = format!("n={n} len={len} root={root}");

            let out = all_ok(on_ranks(&handles, |h| {
                let mut buf = inputs[h.rank()].clone();
                h.broadcast(&mut buf, root).map(|()| buf)
            }));
            assert!(out.iter().all(|b| b == &inputs[root]), "broadcast {ctx}");

            let out = all_ok(on_ranks(&handles, |h| {
                let mut buf = inputs[h.rank()].clone();
                h.reduce(&mut buf, root).map(|()| buf)
            }));
            for (r, buf) in out.iter().enumerate() {
                // The root sums in rank order, exactly like the reference; others keep their input.
                assert_eq!(buf, if r == root { &sum } else { &inputs[r] }, "reduce {ctx} rank {r}");
            }

            let out = all_ok(on_ranks(&handles, |h| {
                let mut buf = inputs[h.rank()].clone();
                h.all_reduce(&mut buf).map(|()| buf)
            }));
            assert_sum_close(&format!("all_reduce {ctx}"), &out[0], &sum);
            assert!(out.iter().all(|b| b == &out[0]), "all_reduce {ctx}: ranks disagree");

            for parts in [Partition::even(len, n).unwrap(), random_partition(len, n, &mut rng)] {
                let full = &inputs[root];
                let out = all_ok(on_ranks(&handles, |h| {
                    let mut recv = vec![f32::NAN; parts.len(h.rank())];
                    h.scatter(full, &mut recv, root, &parts).map(|()| recv)
                }));
                for (r, recv) in out.iter().enumerate() {
                    assert_eq!(recv.as_slice(), &full[parts.range(r)], "scatter {ctx} {parts:?}");
                }

                let local = |r: usize| &inputs[r][parts.range(r)];
                let expected_gathered: Vec<f32> = (0..n).flat_map(|r| local(r).to_vec()).collect();
                let out = all_ok(on_ranks(&handles, |h| {
                    let mut recv = if h.rank() == root { vec![f32::NAN; len] } else { Vec::new() };
                    h.gather(local(h.rank()), &mut recv, root, &parts).map(|()| recv)
                }));
                assert_eq!(out[root], expected_gathered, "gather {ctx} {parts:?}");

                let out = all_ok(on_ranks(&handles, |h| {
                    let mut recv = vec![f32::NAN; len];
                    h.all_gather(local(h.rank()), &mut recv, &parts).map(|()| recv)
                }));
                assert!(out.iter().all(|b| b == &expected_gathered), "all_gather {ctx} {parts:?}");

                let out = all_ok(on_ranks(&handles, |h| {
                    let mut recv = vec![f32::NAN; parts.len(h.rank())];
                    h.reduce_scatter(&inputs[h.rank()], &mut recv, &parts).map(|()| recv)
                }));
                for (r, recv) in out.iter().enumerate() {
                    assert_sum_close(&format!("reduce_scatter {ctx} rank {r}"), recv, &sum[parts.range(r)]);
                }
            }

            // all-to-all with random counts: counts[s][d] elements from s to d.
            let counts: Vec<Vec<usize>> =
                (0..n).map(|_| (0..n).map(|_| rng.random_range(0..=len.min(9))).collect()).collect();
            let sends: Vec<Vec<f32>> = counts.iter().map(|row| random_vec(row.iter().sum(), &mut rng)).collect();
            let out = all_ok(on_ranks(&handles, |h| {
                let r = h.rank();
                let send_parts = Partition::from_counts(&counts[r])?;
                let recv_counts: Vec<usize> = (0..n).map(|s| counts[s][r]).collect();
                let recv_parts = Partition::from_counts(&recv_counts)?;
                let mut recv = vec![f32::NAN; recv_parts.total()];
                h.all_to_all(&sends[r], &send_parts, &mut recv, &recv_parts).map(|()| recv)
            }));
            for (r, recv) in out.iter().enumerate() {
                let expected: Vec<f32> = (0..n)
                    .flat_map(|s| sends[s][Partition::from_counts(&counts[s]).unwrap().range(r)].to_vec())
                    .collect();
                assert_eq!(recv, &expected, "all_to_all {ctx} rank {r}");
            }
        }
    }
}

/// Runs one all-reduce of `len` elements on `n` ranks and returns each rank's (messages, bytes) sent.
fn all_reduce_traffic(n: usize, len: usize) -> Vec<(u64, f64)> {
    let handles = group(n);
    all_ok(on_ranks(&handles, |h| {
        let mut buf = vec![1.0; len];
        h.all_reduce(&mut buf)?;
        let t = h.traffic();
        Ok((t.messages, t.bytes))
    }))
}

#[test]
fn all_reduce_sends_2_n_minus_1_over_n_of_the_buffer_per_rank() {
    println!("ring all-reduce, bytes sent per rank (measured vs 2(n-1)/n * len * 4):");
    for n in 1..=8 {
        for len in [840, 1000, 1001, 37] {
            let per_rank = all_reduce_traffic(n, len);
            let formula = 2.0 * (n as f64 - 1.0) / n as f64 * (len * 4) as f64;
            let model = traffic(CollectiveOp::AllReduce, (len * 4) as u64, n);
            let (steps, lo, hi) = (2 * (n as u64 - 1), (len / n * 4) as f64, len.div_ceil(n) as f64 * 4.0);
            for &(messages, bytes) in &per_rank {
                assert_eq!(messages, steps, "n={n} len={len}");
                assert_eq!(model.messages, steps);
                if len % n == 0 {
                    assert_eq!(bytes, formula, "n={n} len={len}: exact for divisible lengths");
                } else {
                    // Each of the 2(n-1) chunks a rank sends is floor or ceil of len/n elements.
                    assert!(steps as f64 * lo <= bytes && bytes <= steps as f64 * hi, "n={n} len={len}: {bytes}");
                }
            }
            assert!((model.bytes - formula).abs() < 1e-9);
            // Summed over ranks the ring sends every chunk exactly 2(n-1) times.
            let total: f64 = per_rank.iter().map(|&(_, b)| b).sum();
            assert_eq!(total, 2.0 * (n as f64 - 1.0) * (len * 4) as f64, "n={n} len={len}");
            let bytes: Vec<f64> = per_rank.iter().map(|&(_, b)| b).collect();
            println!("  n={n} len={len:5}: formula {formula:8.1}, measured {bytes:?}");
        }
    }
}

#[test]
fn other_collectives_send_what_the_traffic_model_says() {
    let (n, len) = (4, 1000);
    let bytes = (len * 4) as u64;
    let handles = group(n);
    let parts = Partition::even(len, n).unwrap();
    let measure = |op: CollectiveOp| -> Vec<f64> {
        all_ok(on_ranks(&handles, |h| {
            h.reset_traffic();
            let full = vec![1.0; len];
            let mut recv_full = vec![0.0; len];
            let mut recv_part = vec![0.0; parts.len(h.rank())];
            match op {
                CollectiveOp::Broadcast => h.broadcast(&mut recv_full, 0)?,
                CollectiveOp::Reduce => h.reduce(&mut recv_full, 0)?,
                CollectiveOp::AllReduce => h.all_reduce(&mut recv_full)?,
                CollectiveOp::Scatter => h.scatter(&full, &mut recv_part, 0, &parts)?,
                CollectiveOp::Gather => h.gather(&full[parts.range(h.rank())], &mut recv_full, 0, &parts)?,
                CollectiveOp::AllGather => h.all_gather(&full[parts.range(h.rank())], &mut recv_full, &parts)?,
                CollectiveOp::ReduceScatter => h.reduce_scatter(&full, &mut recv_part, &parts)?,
                CollectiveOp::AllToAll => h.all_to_all(&full, &parts, &mut recv_full, &parts)?,
            }
            Ok(h.traffic().bytes)
        }))
    };
    println!("bytes sent per rank, n={n}, buffer {bytes} B:");
    for op in CollectiveOp::ALL {
        let sent = measure(op);
        let model = traffic(op, bytes, n).bytes;
        println!("  {op:>14}: model (busiest rank) {model:7.0}, measured per rank {sent:?}");
        let expected: Vec<f64> = match op {
            // The root sends; the model's figure is the root's.
            CollectiveOp::Broadcast | CollectiveOp::Scatter => {
                (0..n).map(|r| if r == 0 { model } else { 0.0 }).collect()
            }
            // Every other rank sends its share once; the model counts what the root receives.
            CollectiveOp::Reduce => (0..n).map(|r| if r == 0 { 0.0 } else { bytes as f64 }).collect(),
            CollectiveOp::Gather => (0..n).map(|r| if r == 0 { 0.0 } else { (parts.len(r) * 4) as f64 }).collect(),
            CollectiveOp::AllReduce
            | CollectiveOp::AllGather
            | CollectiveOp::ReduceScatter
            | CollectiveOp::AllToAll => {
                vec![model; n]
            }
        };
        assert_eq!(sent, expected, "{op}");
    }
    let received_by_root = (1..n).map(|r| (parts.len(r) * 4) as f64).sum::<f64>();
    assert_eq!(traffic(CollectiveOp::Gather, bytes, n).bytes, received_by_root);
}

fn is_collective_error(e: &Error) -> bool {
    matches!(e, Error::CollectiveFailed { .. } | Error::CollectiveAborted { .. })
}

#[test]
fn mismatched_lengths_fail_on_every_rank_and_the_group_recovers() {
    let mut handles = group(4);
    let results = on_ranks(&handles, |h| {
        let mut buf = vec![1.0; if h.rank() == 2 { 9 } else { 8 }];
        h.all_reduce(&mut buf)
    });
    assert!(results.iter().all(|r| matches!(r, Err(e) if is_collective_error(e))), "{results:?}");
    assert!(results.iter().any(|r| matches!(r, Err(Error::CollectiveFailed { .. }))));
    // Refused until recovered, then usable again.
    assert!(matches!(
        all_or_first_err(on_ranks(&handles, |h| h.broadcast(&mut [0.0], 0))),
        Err(Error::CollectiveAborted { .. })
    ));
    ProcessGroup::recover(&mut handles).unwrap();
    let out = all_ok(on_ranks(&handles, |h| {
        let mut buf = vec![h.rank() as f32; 5];
        h.all_reduce(&mut buf).map(|()| buf)
    }));
    assert!(out.iter().all(|b| b == &vec![6.0; 5]));
}

fn all_or_first_err(results: Vec<Result<()>>) -> Result<()> {
    results.into_iter().collect()
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let mut handles = group(3);
    let results = on_ranks(&handles, |h| h.broadcast(&mut [1.0, 2.0], 3));
    assert!(
        results.iter().all(|r| matches!(r, Err(Error::CollectiveFailed { .. }) | Err(Error::CollectiveAborted { .. })))
    );
    ProcessGroup::recover(&mut handles).unwrap();
    let wrong_parts = Partition::even(6, 2).unwrap();
    let results = on_ranks(&handles, |h| h.all_gather(&[0.0; 3], &mut [0.0; 6], &wrong_parts));
    assert!(results.iter().any(|r| matches!(r, Err(Error::InvalidArgument { .. }))), "{results:?}");
    assert!(ProcessGroup::recover(&mut handles[..2]).is_err(), "recover needs every handle");
    assert!(ProcessGroup::new(&[]).is_err());
}

#[test]
fn a_rank_that_never_calls_times_out_and_a_dropped_rank_disconnects() {
    let devices = [Device::cpu(0), Device::cpu(1)];
    let handles = ProcessGroup::with_timeout(&devices, Duration::from_millis(100)).unwrap();
    let err = handles[0].broadcast(&mut [0.0; 4], 1).unwrap_err();
    assert!(matches!(err, Error::CollectiveFailed { ref reason, .. } if reason.contains("no message")), "{err}");

    let mut handles = ProcessGroup::with_timeout(&devices, WATCHDOG).unwrap();
    drop(handles.pop());
    let err = handles[0].broadcast(&mut [0.0; 4], 1).unwrap_err();
    assert!(matches!(err, Error::CollectiveFailed { ref reason, .. } if reason.contains("dropped")), "{err}");
}

#[test]
fn messages_count_against_the_receivers_budget() {
    // Rank 1 may hold 64 bytes; rank 0's 32-float part of an all-to-all (128 bytes) cannot be
    // delivered to it. (The in-process all-reduce, broadcast, scatter, gather, all-gather and
    // reduce-scatter send no messages: they read the callers' buffers in place, which their
    // callers' ledgers already count.)
    let devices = [Device::cpu(0), Device::cpu_with_budget(1, Some(64))];
    let handles = ProcessGroup::with_timeout(&devices, WATCHDOG).unwrap();
    let parts = Partition::even(64, 2).unwrap();
    let results = on_ranks(&handles, |h| h.all_to_all(&[1.0; 64], &parts, &mut [0.0; 64], &parts));
    assert!(matches!(results[0], Err(Error::OutOfDeviceMemory { .. })), "{:?}", results[0]);
    assert!(matches!(results[1], Err(Error::CollectiveAborted { failed_rank: 0, .. })), "{:?}", results[1]);
    assert_eq!(devices[1].memory_in_use(), 0);
}

/// The in-process reduce-scatter adds in the ring's nesting, as the in-process all-reduce does
/// (and the transport group's ring, across ranks): each rank's block is the all-reduce's bit for
/// bit, for every group size and lengths the group does not divide.
#[test]
fn reduce_scatter_blocks_are_the_all_reduce_bit_for_bit() {
    let mut rng = init::rng(17);
    for n in 1..=5 {
        let handles = group(n);
        for len in [1, n, 3 * n + 2, 1000 + n] {
            let inputs: Vec<Vec<f32>> = (0..n).map(|_| random_vec(len, &mut rng)).collect();
            let parts = Partition::even(len, n).unwrap();
            let reduced = all_ok(on_ranks(&handles, |h| {
                let mut buf = inputs[h.rank()].clone();
                h.all_reduce(&mut buf).map(|()| buf)
            }));
            let blocks = all_ok(on_ranks(&handles, |h| {
                let mut block = vec![0.0; parts.len(h.rank())];
                h.reduce_scatter(&inputs[h.rank()], &mut block, &parts).map(|()| block)
            }));
            for (rank, block) in blocks.iter().enumerate() {
                let expected = &reduced[rank][parts.range(rank)];
                assert!(
                    block.iter().zip(expected).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "n={n} len={len} rank {rank}"
                );
            }
        }
    }
}
