//! The transport group on a loopback world (one [`Transport`] per rank, each rank a thread, messages
//! over crossbeam channels): every collective against the in-process group on the same inputs, bit
//! for bit, with the same traffic; the agreed link; and a failure on one rank that ends every
//! rank's wait, then a recovery.
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;

use crossbeam::channel::{self, Sender};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use super::*;
use crate::collective::{ProcessGroup, traffic};
use crate::transport::{LinkCost, TransportKind};

const WATCHDOG: Duration = Duration::from_secs(20);
/// The loopback's gathers travel in this round (below the collectives' rounds).
const GATHER_ROUND: u64 = COLLECTIVE_ROUND_BASE - 1;

/// Both ends of one channel of byte messages.
type Ends = (Sender<Vec<u8>>, Receiver<Vec<u8>>);

/// The channels of one loopback world: one per (destination, tag), created by whichever end comes first.
#[derive(Debug, Default)]
struct Hub {
    channels: parking_lot::Mutex<HashMap<(usize, Tag), Ends>>,
}

impl Hub {
    fn channel(&self, to: usize, tag: Tag) -> Ends {
        self.channels.lock().entry((to, tag)).or_insert_with(channel::unbounded).clone()
    }
}

/// One rank of a loopback world. Its link to rank `p` costs `(1 + max(rank, p))` µs and
/// `1 / (1 + max(rank, p))` GB/s, so the slowest link of a world of `n` is `n` µs and `1/n` GB/s.
#[derive(Debug)]
struct Loopback {
    rank: usize,
    world_size: usize,
    hub: Arc<Hub>,
    gathers: AtomicU64,
}

fn loopback_world(n: usize) -> Vec<Arc<dyn Transport>> {
    let hub = Arc::new(Hub::default());
    (0..n)
        .map(|rank| {
            Arc::new(Loopback { rank, world_size: n, hub: Arc::clone(&hub), gathers: AtomicU64::new(0) })
                as Arc<dyn Transport>
        })
        .collect()
}

impl Transport for Loopback {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }
    fn kind(&self) -> TransportKind {
        TransportKind::Mpi
    }
    fn send(&self, to: usize, tag: Tag, bytes: Vec<u8>) -> Result<()> {
        self.hub
            .channel(to, tag)
            .0
            .send(bytes)
            .map_err(|_| Error::Transport { rank: Some(self.rank), reason: "closed".into() })
    }
    fn inbox(&self, tag: Tag) -> Result<Receiver<Vec<u8>>> {
        Ok(self.hub.channel(self.rank, tag).1)
    }
    fn close_rounds_before(&self, _round: u64) {}
    fn all_gather(&self, bytes: Vec<u8>, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let tag = Tag { round: GATHER_ROUND, channel: self.gathers.fetch_add(1, Ordering::AcqRel) };
        for to in (0..self.world_size).filter(|&r| r != self.rank) {
            let mut message = (self.rank as u64).to_le_bytes().to_vec();
            message.extend_from_slice(&bytes);
            self.send(to, tag, message)?;
        }
        let mut all = vec![Vec::new(); self.world_size];
        all[self.rank] = bytes;
        let inbox = self.inbox(tag)?;
        for _ in 1..self.world_size {
            let message = inbox
                .recv_timeout(timeout)
                .map_err(|_| Error::Transport { rank: Some(self.rank), reason: "gather timed out".into() })?;
            let from = u64::from_le_bytes(message[..8].try_into().unwrap()) as usize;
            all[from] = message[8..].to_vec();
        }
        Ok(all)
    }
    fn link(&self, peer: usize) -> Option<LinkCost> {
        let slowness = 1.0 + peer.max(self.rank) as f64;
        (peer != self.rank).then_some(LinkCost { latency_s: 1e-6 * slowness, bandwidth_bytes_per_s: 1e9 / slowness })
    }
    fn clock_offset_s(&self) -> f64 {
        0.0
    }
    fn abort(&self, code: i32) -> ! {
        panic!("loopback rank {} aborted with {code}", self.rank)
    }
}

/// Runs `f` on every rank of a loopback world of `n` (each creating its group), each on a thread.
fn on_transport_ranks<T: Send>(n: usize, f: impl Fn(TransportGroup) -> Result<T> + Sync) -> Vec<T> {
    let world = loopback_world(n);
    std::thread::scope(|scope| {
        let threads: Vec<_> = world
            .into_iter()
            .map(|t| {
                let f = &f;
                scope.spawn(move || {
                    let rank = t.rank();
                    f(TransportGroup::with_timeout(t, Device::cpu(rank), WATCHDOG)?)
                })
            })
            .collect();
        threads
            .into_iter()
            .enumerate()
            .map(|(r, t)| t.join().unwrap().unwrap_or_else(|e| panic!("rank {r}: {e}")))
            .collect()
    })
}

/// Runs `f` on every rank of a loopback world of `n`, each with its transport, on a thread.
fn on_transports<T: Send>(n: usize, f: impl Fn(Arc<dyn Transport>) -> Result<T> + Sync) -> Vec<T> {
    let world = loopback_world(n);
    std::thread::scope(|scope| {
        let threads: Vec<_> = world.into_iter().map(|t| scope.spawn(|| f(t))).collect();
        threads
            .into_iter()
            .enumerate()
            .map(|(r, t)| t.join().unwrap().unwrap_or_else(|e| panic!("rank {r}: {e}")))
            .collect()
    })
}

/// Runs `f` on every rank of an in-process group of `n`, each on a thread.
fn on_process_ranks<T: Send>(n: usize, f: impl Fn(&dyn Communicator) -> Result<T> + Sync) -> Vec<T> {
    let devices: Vec<Device> = (0..n).map(Device::cpu).collect();
    let handles = ProcessGroup::with_timeout(&devices, WATCHDOG).unwrap();
    std::thread::scope(|scope| {
        let threads: Vec<_> = handles.iter().map(|h| scope.spawn(|| f(h))).collect();
        threads
            .into_iter()
            .enumerate()
            .map(|(r, t)| t.join().unwrap().unwrap_or_else(|e| panic!("rank {r}: {e}")))
            .collect()
    })
}

/// Rank `rank`'s seeded input number `which` of `len` elements.
fn input(seed: u64, rank: usize, which: u64, len: usize) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed ^ ((rank as u64) << 40) ^ (which << 20));
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// A seeded partition of `total` over `n` ranks, uneven, with some parts possibly empty.
fn uneven(total: usize, n: usize, rng: &mut StdRng) -> Partition {
    let mut cuts: Vec<usize> = (0..n - 1).map(|_| rng.random_range(0..=total)).collect();
    cuts.sort_unstable();
    let counts: Vec<usize> =
        cuts.iter().chain([&total]).scan(0, |prev, &cut| Some(cut - std::mem::replace(prev, cut))).collect();
    Partition::from_counts(&counts).unwrap()
}

/// Every collective once on `comm` with seeded inputs for a group of `n` and buffers of `len`:
/// each result, in order, and the traffic after each.
fn every_collective(comm: &dyn Communicator, seed: u64, len: usize) -> Result<(Vec<Vec<f32>>, Vec<Traffic>)> {
    let (n, rank) = (comm.n_ranks(), comm.rank());
    let mut rng = StdRng::seed_from_u64(seed);
    let parts = uneven(len, n, &mut rng);
    // counts[s][d]: what rank s sends to rank d in the all-to-all.
    let counts: Vec<Vec<usize>> = (0..n).map(|_| (0..n).map(|_| rng.random_range(0..=len / n + 2)).collect()).collect();
    let send_parts = Partition::from_counts(&counts[rank]).unwrap();
    let recv_parts = Partition::from_counts(&(0..n).map(|s| counts[s][rank]).collect::<Vec<_>>()).unwrap();
    let root = len % n;
    let (mut results, mut traffics) = (Vec::new(), Vec::new());
    let mut keep = |buf: Vec<f32>, comm: &dyn Communicator| {
        results.push(buf);
        traffics.push(comm.traffic());
        comm.reset_traffic();
    };
    let mut buf = input(seed, rank, 0, len);
    comm.broadcast(&mut buf, root)?;
    keep(buf, comm);
    let mut buf = input(seed, rank, 1, len);
    comm.reduce(&mut buf, root)?;
    keep(buf, comm);
    let mut buf = input(seed, rank, 2, len);
    comm.all_reduce(&mut buf)?;
    keep(buf, comm);
    let mut part = vec![0.0; parts.len(rank)];
    comm.scatter(&input(seed, rank, 3, len), &mut part, root, &parts)?;
    keep(part, comm);
    let mut whole = vec![0.0; len];
    comm.gather(&input(seed, rank, 4, parts.len(rank)), &mut whole, root, &parts)?;
    keep(whole, comm);
    let mut whole = vec![0.0; len];
    comm.all_gather(&input(seed, rank, 5, parts.len(rank)), &mut whole, &parts)?;
    keep(whole, comm);
    let mut part = vec![0.0; parts.len(rank)];
    comm.reduce_scatter(&input(seed, rank, 6, len), &mut part, &parts)?;
    keep(part, comm);
    let mut received = vec![0.0; recv_parts.total()];
    comm.all_to_all(&input(seed, rank, 7, send_parts.total()), &send_parts, &mut received, &recv_parts)?;
    keep(received, comm);
    Ok((results, traffics))
}

fn bits(results: &[Vec<f32>]) -> Vec<Vec<u32>> {
    results.iter().map(|r| r.iter().map(|v| v.to_bits()).collect()).collect()
}

#[test]
fn every_collective_matches_the_in_process_group_bit_for_bit() {
    for n in 1..=4 {
        for (case, len) in [0, 1, n + 1, 7 * n - 1, 257, 5003].into_iter().enumerate() {
            let seed = 0x5eed_0000 + 100 * n as u64 + case as u64;
            let over_transport = on_transport_ranks(n, |group| every_collective(&group, seed, len));
            let in_process = on_process_ranks(n, |handle| every_collective(handle, seed, len));
            for (rank, ((t_results, t_traffic), (p_results, p_traffic))) in
                over_transport.iter().zip(&in_process).enumerate()
            {
                assert_eq!(bits(t_results), bits(p_results), "n={n} len={len} rank {rank}");
                assert_eq!(t_traffic, p_traffic, "n={n} len={len} rank {rank}: traffic");
            }
        }
    }
}

#[test]
fn all_reduce_traffic_follows_the_ring_formula() {
    let (n, len) = (4, 1000);
    let sent = on_transport_ranks(n, |group| {
        group.all_reduce(&mut vec![1.0; len])?;
        Ok(group.traffic())
    });
    let model = traffic(CollectiveOp::AllReduce, (4 * len) as u64, n);
    assert!(sent.iter().all(|&t| t == model), "{sent:?} vs {model:?}");
}

#[test]
fn every_rank_agrees_on_the_slowest_link_and_predicts_with_it() {
    let n = 3;
    let groups = on_transport_ranks(n, |group| Ok((group.link(), group.cost_s(CollectiveOp::AllReduce, 1 << 20))));
    let slowest = Link { latency_s: 3e-6, bandwidth_bytes_per_s: 1e9 / 3.0 };
    for (link, cost) in groups {
        assert_eq!(link, Some(slowest));
        assert_eq!(cost, Some(super::super::cost_s(CollectiveOp::AllReduce, 1 << 20, n, &slowest)));
    }
}

#[test]
fn groups_of_one_world_take_distinct_rounds() {
    let rounds = on_transport_ranks(2, |first| {
        let second = TransportGroup::with_timeout(Arc::clone(&first.transport), first.device.clone(), WATCHDOG)?;
        // Messages of the two groups must not mix: run one collective on each, interleaved.
        let (mut a, mut b) = (vec![first.rank as f32; 5], vec![10.0 * first.rank as f32; 3]);
        first.all_reduce(&mut a)?;
        second.all_reduce(&mut b)?;
        assert_eq!((a, b), (vec![1.0; 5], vec![10.0; 3]));
        Ok((first.round, second.round))
    });
    assert_eq!(rounds[0], rounds[1], "every rank agrees");
    assert!(rounds[0].0 >= COLLECTIVE_ROUND_BASE && rounds[0].1 > rounds[0].0);
}

#[test]
fn a_failure_on_one_rank_ends_every_wait_and_recovery_restores_the_group() {
    // Rank 0 calls reduce with a root that does not exist and fails at once; ranks 1 and 2 are in an
    // all-reduce where rank 2 waits on rank 1 and rank 1 on rank 0: both must end with the abort
    // (rank 2 through rank 0's notice, not through a timeout).
    let outcomes = on_transport_ranks(3, |mut group| {
        let mut buf = vec![1.0; 9];
        let first = if group.rank == 0 { group.reduce(&mut buf, 7) } else { group.all_reduce(&mut buf) };
        let later = group.broadcast(&mut buf, 0);
        group.recover()?;
        let mut buf = vec![group.rank as f32; 10];
        group.all_reduce(&mut buf)?;
        Ok((first, later, buf))
    });
    // A rank may also be freed by a peer's recovery notice (rank 2 recovering before rank 0's
    // abort notice reached rank 1): a peer that recovers has given up the call too.
    let freed = |error: &Error, rank: usize| match error {
        Error::CollectiveAborted { failed_rank: 0, .. } => true,
        Error::CollectiveAborted { failed_rank, reason, .. } => *failed_rank != rank && reason.contains("recovering"),
        _ => false,
    };
    for (rank, (first, later, after)) in outcomes.into_iter().enumerate() {
        match (rank, first) {
            (0, Err(Error::CollectiveFailed { op, .. })) => assert_eq!(op, "reduce"),
            (_, Err(error)) if rank > 0 && freed(&error, rank) => {}
            (_, other) => panic!("rank {rank}: {other:?}"),
        }
        assert!(later.as_ref().is_err_and(|e| freed(e, rank)), "rank {rank}: {later:?}");
        assert_eq!(after, vec![3.0; 10], "rank {rank} after recovery");
    }
}

#[test]
fn refuses_tiny_timeouts_and_serves_a_world_of_one() {
    let transport: Arc<dyn Transport> = Arc::new(crate::transport::InProcess);
    let err = TransportGroup::with_timeout(Arc::clone(&transport), Device::cpu(0), Duration::ZERO).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let group = TransportGroup::new(transport, Device::cpu(0)).unwrap();
    assert_eq!((group.rank(), group.n_ranks(), group.link()), (0, 1, None));
}

#[test]
fn subgroups_serve_their_members_alone_and_recover_without_the_others() {
    // A world of 4 cut into {0, 2} and {3, 1} (list order is group order): each group's all-reduce
    // sums its members only, a failure in one group aborts only its members, and that group
    // recovers while the other goes on.
    let groups = vec![vec![0, 2], vec![3, 1]];
    let outcomes = on_transports(4, |transport| {
        let me = transport.rank();
        let mut group = TransportGroup::split(transport, Device::cpu(me), WATCHDOG, &groups)?;
        let mut buf = vec![me as f32 + 1.0; 5];
        group.all_reduce(&mut buf)?;
        let mut root = vec![group.rank() as f32 * 10.0 + me as f32; 3];
        group.broadcast(&mut root, 1)?;
        let failed = if group.members() == [0, 2] {
            let mut x = vec![1.0; 4];
            let outcome = if group.rank() == 0 { group.reduce(&mut x, 9) } else { group.all_reduce(&mut x) };
            group.recover()?;
            Some(outcome.is_err())
        } else {
            None
        };
        let mut after = vec![me as f32; 2];
        group.all_reduce(&mut after)?;
        Ok((group.rank(), group.members().to_vec(), buf, root, failed, after))
    });
    let expect = |me: usize| match me {
        0 | 2 => (vec![0, 2], 4.0, 12.0, Some(true), 2.0),
        _ => (vec![3, 1], 6.0, 11.0, None, 4.0),
    };
    for (me, (rank, members, buf, root, failed, after)) in outcomes.into_iter().enumerate() {
        let (want_members, sum, root_value, want_failed, after_sum) = expect(me);
        assert_eq!(members, want_members, "rank {me}");
        assert_eq!(members[rank], me, "rank {me}'s group rank");
        assert_eq!(buf, vec![sum; 5], "rank {me}: the sum over its group");
        assert_eq!(root, vec![root_value; 3], "rank {me}: group rank 1's buffer");
        assert_eq!(failed, want_failed, "rank {me}");
        assert_eq!(after, vec![after_sum; 2], "rank {me} after its group recovered");
    }
}

#[test]
fn a_split_that_misses_or_repeats_a_rank_is_refused() {
    let transport: Arc<dyn Transport> = Arc::new(crate::transport::InProcess);
    for groups in [vec![vec![0, 0]], vec![vec![1]], vec![vec![]]] {
        let err = TransportGroup::split(Arc::clone(&transport), Device::cpu(0), WATCHDOG, &groups).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{groups:?}: {err}");
    }
}
