//! The in-process group (host buffers, for CPU devices and as the host fallback of GPU tensors): one unbounded crossbeam channel per ordered pair of
//! ranks, messages tagged with the collective and its sequence number, and a shared abort flag
//! that ends every rank's wait when one rank fails. The collectives themselves are
//! `algorithms.rs`, shared with the transport group, except the all-reduce, which reads the other
//! ranks' buffers in place (`direct.rs`) and adds in the ring's order.
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam::channel::{self, Receiver, RecvTimeoutError, Sender};

use super::algorithms::{self, Exchange};
use super::{CollectiveOp, Communicator, Partition, Traffic};
use crate::device::Reservation;
use crate::{Device, Error, Result};

/// How long a rank waits for a peer's message before the collective fails.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// How often a waiting rank looks at the abort flag.
pub(super) const ABORT_POLL: Duration = Duration::from_millis(5);

/// A message between two ranks. Data holds a reservation on the receiver's ledger from send to drop.
#[derive(Debug)]
enum Message {
    Data { seq: u64, op: CollectiveOp, data: Vec<f32>, _reservation: Reservation },
    Abort,
}

/// State shared by the ranks of one group.
#[derive(Debug)]
struct Shared {
    n_ranks: usize,
    timeout: Duration,
    aborted: AtomicBool,
    /// The first failure: (rank, message).
    failure: Mutex<Option<(usize, String)>>,
    /// Where the ranks meet for the direct all-reduce.
    board: super::direct::Board,
}

impl Shared {
    fn failure(&self) -> Option<(usize, String)> {
        if !self.aborted.load(Ordering::Acquire) {
            return None;
        }
        self.failure.lock().map(|f| f.clone()).unwrap_or_else(|poisoned| poisoned.into_inner().clone())
    }
}

/// Builds in-process groups. The ranks' buffers are host slices; on CUDA devices the tensor
/// collectives (`Communicator::all_reduce_tensor` ...) stage GPU tensors through them (the host
/// fallback), and messages count on the receiving device's ledger either way.
///
/// ```
/// use conveyor_engine::Device;
/// use conveyor_engine::collective::{Communicator, ProcessGroup};
/// let handles = ProcessGroup::new(&[Device::cpu(0), Device::cpu(1)])?;
/// assert_eq!((handles[1].rank(), handles[1].n_ranks()), (1, 2));
/// # Ok::<(), conveyor_engine::Error>(())
/// ```
#[derive(Debug)]
pub struct ProcessGroup {
    _private: (),
}

impl ProcessGroup {
    /// One handle per device, rank `r` on `devices[r]`, waiting at most [`DEFAULT_TIMEOUT`] for a peer.
    // A group is its handles: each goes to its own thread, so `new` hands them out rather than a
    // `ProcessGroup` that would have to be taken apart.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(devices: &[Device]) -> Result<Vec<RankHandle>> {
        ProcessGroup::with_timeout(devices, DEFAULT_TIMEOUT)
    }

    /// Like [`ProcessGroup::new`], with the longest wait for a peer's message (at least 1 ms).
    pub fn with_timeout(devices: &[Device], timeout: Duration) -> Result<Vec<RankHandle>> {
        if devices.is_empty() {
            return Err(Error::invalid("ProcessGroup devices", "empty: a group needs at least one device"));
        }
        if timeout < Duration::from_millis(1) {
            return Err(Error::invalid("ProcessGroup timeout", format!("{timeout:?}: give at least 1 ms")));
        }
        let n_ranks = devices.len();
        let shared = Arc::new(Shared {
            n_ranks,
            timeout,
            aborted: AtomicBool::new(false),
            failure: Mutex::new(None),
            board: super::direct::Board::new(n_ranks),
        });
        // channels[src][dst]
        let mut senders: Vec<Vec<Sender<Message>>> = (0..n_ranks).map(|_| Vec::with_capacity(n_ranks)).collect();
        let mut receivers: Vec<Vec<Option<Receiver<Message>>>> =
            (0..n_ranks).map(|_| (0..n_ranks).map(|_| None).collect()).collect();
        for (src, src_senders) in senders.iter_mut().enumerate() {
            for dst_receivers in receivers.iter_mut() {
                let (tx, rx) = channel::unbounded();
                src_senders.push(tx);
                dst_receivers[src] = Some(rx);
            }
        }
        Ok(senders
            .into_iter()
            .zip(receivers)
            .enumerate()
            .map(|(rank, (senders, receivers))| RankHandle {
                rank,
                device: devices[rank].clone(),
                peers: devices.to_vec(),
                senders,
                receivers: receivers.into_iter().map(|r| r.expect("every pair has a channel")).collect(),
                shared: Arc::clone(&shared),
                seq: AtomicU64::new(0),
                bytes_sent: AtomicU64::new(0),
                messages_sent: AtomicU64::new(0),
            })
            .collect())
    }

    /// Makes a group usable again after a failed collective: drops every message in flight, clears
    /// the abort and realigns the ranks' sequence numbers. Takes every handle of the group
    /// mutably, so no rank can be inside a collective meanwhile.
    pub fn recover(handles: &mut [RankHandle]) -> Result<()> {
        let Some(first) = handles.first() else {
            return Err(Error::invalid("ProcessGroup::recover handles", "empty: pass every handle of the group"));
        };
        let shared = Arc::clone(&first.shared);
        let complete = handles.len() == shared.n_ranks
            && handles.iter().enumerate().all(|(r, h)| h.rank == r && Arc::ptr_eq(&h.shared, &shared));
        if !complete {
            return Err(Error::invalid(
                "ProcessGroup::recover handles",
                format!("pass all {} handles of one group in rank order", shared.n_ranks),
            ));
        }
        let seq = handles.iter().map(|h| h.seq.load(Ordering::Acquire)).max().unwrap_or(0);
        for handle in handles.iter() {
            for receiver in &handle.receivers {
                while receiver.try_recv().is_ok() {}
            }
            handle.seq.store(seq, Ordering::Release);
        }
        *shared.failure.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
        shared.board.reset();
        shared.aborted.store(false, Ordering::Release);
        Ok(())
    }
}

/// One rank of an in-process group: its device, a channel to and from every rank, and counters of
/// what it sent. Use each handle from one thread at a time.
#[derive(Debug)]
pub struct RankHandle {
    rank: usize,
    device: Device,
    peers: Vec<Device>,
    /// To each rank (indexed by destination).
    senders: Vec<Sender<Message>>,
    /// From each rank (indexed by source).
    receivers: Vec<Receiver<Message>>,
    shared: Arc<Shared>,
    seq: AtomicU64,
    bytes_sent: AtomicU64,
    messages_sent: AtomicU64,
}

/// One collective in progress on one rank.
struct Call<'a> {
    handle: &'a RankHandle,
    op: CollectiveOp,
    seq: u64,
}

impl Call<'_> {
    fn aborted(&self, (failed_rank, reason): (usize, String)) -> Error {
        Error::CollectiveAborted { op: self.op.name().into(), rank: self.handle.rank, failed_rank, reason }
    }
}

impl Exchange for Call<'_> {
    fn rank(&self) -> usize {
        self.handle.rank
    }

    fn n_ranks(&self) -> usize {
        self.handle.n_ranks()
    }

    fn device(&self) -> &Device {
        &self.handle.device
    }

    fn failed(&self, reason: String) -> Error {
        Error::CollectiveFailed {
            op: self.op.name().into(),
            rank: self.handle.rank,
            n_ranks: self.handle.n_ranks(),
            reason,
        }
    }

    /// Sends a copy of `data` to `dst`, reserving its bytes on `dst`'s ledger until it is consumed.
    fn send(&self, dst: usize, data: &[f32]) -> Result<()> {
        let bytes = std::mem::size_of_val(data) as u64;
        let reservation = self.handle.peers[dst].reserve(bytes)?;
        let message = Message::Data { seq: self.seq, op: self.op, data: data.to_vec(), _reservation: reservation };
        self.handle.senders[dst]
            .send(message)
            .map_err(|_| self.failed(format!("rank {dst}'s handle was dropped (its thread ended)")))?;
        self.handle.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
        self.handle.messages_sent.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Waits for the next message from `src`, which must belong to this collective and hold
    /// `expected_len` elements. The message's bytes stay counted on this rank's ledger from its
    /// send until it is taken here; callers copy it into their buffer at once.
    fn recv(&self, src: usize, expected_len: usize) -> Result<Vec<f32>> {
        let deadline = Instant::now() + self.handle.shared.timeout;
        loop {
            if let Some(failure) = self.handle.shared.failure() {
                return Err(self.aborted(failure));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.failed(format!(
                    "no message from rank {src} within {:?}; did every rank call {}?",
                    self.handle.shared.timeout, self.op
                )));
            }
            match self.handle.receivers[src].recv_timeout(ABORT_POLL.min(deadline - now)) {
                Ok(Message::Data { seq, op, data, _reservation }) => {
                    if seq != self.seq || op != self.op {
                        return Err(self.failed(format!(
                            "rank {src} sent a message of its collective #{seq} ({op}) while this rank is in #{} ({})",
                            self.seq, self.op
                        )));
                    }
                    if data.len() != expected_len {
                        return Err(self.failed(format!(
                            "rank {src} sent {} elements where {expected_len} were expected; the ranks' lengths or partitions differ",
                            data.len()
                        )));
                    }
                    return Ok(data);
                }
                Ok(Message::Abort) => {
                    let failure = self.handle.shared.failure().unwrap_or((src, "aborted".into()));
                    return Err(self.aborted(failure));
                }
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(self.failed(format!("rank {src}'s handle was dropped (its thread ended or panicked)")));
                }
            }
        }
    }
}

/// Aborts an in-process group from outside it ([`RankHandle::abort_handle`]): every rank waiting
/// in a collective ends within a few milliseconds with [`Error::CollectiveAborted`], and every
/// later call is refused, until the group is recovered or replaced. An NCCL group's handle
/// ([`GroupAbort::flag`], from `CudaDevice::nccl_group_abortable`) sets the flag its ranks poll
/// while they wait; they then abort their communicators and refuse later calls, and the group is
/// replaced.
#[derive(Clone, Debug)]
pub struct GroupAbort {
    target: AbortTarget,
}

#[derive(Clone, Debug)]
enum AbortTarget {
    InProcess(Arc<Shared>),
    Flag(Arc<AtomicBool>),
}

impl GroupAbort {
    /// A handle that sets `flag`, which the group's ranks poll (an NCCL group's).
    pub fn flag(flag: Arc<AtomicBool>) -> GroupAbort {
        GroupAbort { target: AbortTarget::Flag(flag) }
    }

    /// Aborts the group (the first failure recorded wins), naming `rank` as the failed one.
    pub fn abort(&self, rank: usize, reason: &str) {
        let shared = match &self.target {
            AbortTarget::InProcess(shared) => shared,
            AbortTarget::Flag(flag) => {
                flag.store(true, Ordering::Release);
                return;
            }
        };
        {
            let mut failure = shared.failure.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if failure.is_none() {
                *failure = Some((rank, reason.to_string()));
            }
        }
        shared.aborted.store(true, Ordering::Release);
        shared.board.wake();
    }
}

impl RankHandle {
    /// A handle that aborts this rank's group from any thread ([`GroupAbort`]).
    pub fn abort_handle(&self) -> GroupAbort {
        GroupAbort { target: AbortTarget::InProcess(Arc::clone(&self.shared)) }
    }

    /// Runs one collective: refuses to start on an aborted group, tags its messages, and on
    /// failure aborts the group so that no peer waits for a message that will not come.
    fn run(&self, op: CollectiveOp, body: impl FnOnce(&Call<'_>) -> Result<()>) -> Result<()> {
        let seq = self.seq.fetch_add(1, Ordering::AcqRel);
        let call = Call { handle: self, op, seq };
        if let Some(failure) = self.shared.failure() {
            return Err(call.aborted(failure));
        }
        let result = body(&call);
        if let Err(error) = &result
            && !matches!(error, Error::CollectiveAborted { .. })
        {
            self.abort(error.to_string());
        }
        result
    }

    /// Runs a collective of `direct.rs` and counts the traffic its message form would have had:
    /// the elements `body` reports and `messages(n_ranks)` messages (none when it reports `None`:
    /// a rank that sends nothing).
    fn direct(
        &self,
        call: &Call<'_>,
        body: impl FnOnce(&super::direct::Ctx<'_>) -> Result<Option<usize>>,
        messages: impl Fn(u64) -> u64,
    ) -> Result<()> {
        let failure = || self.shared.failure();
        let aborted = |failure| call.aborted(failure);
        let failed = |reason| call.failed(reason);
        let ctx = super::direct::Ctx {
            board: &self.shared.board,
            rank: self.rank,
            seq: call.seq,
            op: call.op.name(),
            timeout: self.shared.timeout,
            failure: &failure,
            aborted: &aborted,
            failed: &failed,
        };
        if let Some(sent) = body(&ctx)? {
            self.bytes_sent.fetch_add((sent * std::mem::size_of::<f32>()) as u64, Ordering::Relaxed);
            self.messages_sent.fetch_add(messages(self.shared.n_ranks as u64), Ordering::Relaxed);
        }
        Ok(())
    }

    /// Marks the group failed (the first failure wins) and wakes every peer.
    fn abort(&self, reason: String) {
        {
            let mut failure = self.shared.failure.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if failure.is_none() {
                *failure = Some((self.rank, reason));
            }
        }
        self.shared.aborted.store(true, Ordering::Release);
        self.shared.board.wake();
        for (dst, sender) in self.senders.iter().enumerate() {
            if dst != self.rank {
                let _ = sender.send(Message::Abort);
            }
        }
    }
}

impl Drop for RankHandle {
    /// Tells the board this rank will not come, so a rank waiting for it in an in-place collective
    /// ends at once (as a dropped channel ends a receive).
    fn drop(&mut self) {
        self.shared.board.drop_rank(self.rank);
    }
}

impl Communicator for RankHandle {
    fn rank(&self) -> usize {
        self.rank
    }

    fn n_ranks(&self) -> usize {
        self.shared.n_ranks
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn traffic(&self) -> Traffic {
        Traffic {
            messages: self.messages_sent.load(Ordering::Relaxed),
            bytes: self.bytes_sent.load(Ordering::Relaxed) as f64,
        }
    }

    fn reset_traffic(&self) {
        self.messages_sent.store(0, Ordering::Relaxed);
        self.bytes_sent.store(0, Ordering::Relaxed);
    }

    /// In place across the threads (`direct.rs`), counted as the root's sends.
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        self.run(CollectiveOp::Broadcast, |call| {
            if root >= self.shared.n_ranks {
                return Err(call.failed(format!("root {root} is not a rank of a group of {}", self.shared.n_ranks)));
            }
            self.direct(call, |ctx| super::direct::broadcast(ctx, buf, root), |n| n.saturating_sub(1))
        })
    }

    fn reduce(&self, buf: &mut [f32], root: usize) -> Result<()> {
        self.run(CollectiveOp::Reduce, |call| algorithms::reduce(call, buf, root))
    }

    /// In place across the threads (`direct.rs`): the ring all-reduce's sums bit for bit, counted
    /// as the ring's traffic.
    fn all_reduce(&self, buf: &mut [f32]) -> Result<()> {
        self.run(CollectiveOp::AllReduce, |call| {
            self.direct(call, |ctx| super::direct::all_reduce(ctx, buf), |n| 2 * n.saturating_sub(1))
        })
    }

    /// In place across the threads (`direct.rs`), counted as the root's sends.
    fn scatter(&self, send: &[f32], recv: &mut [f32], root: usize, parts: &Partition) -> Result<()> {
        self.run(CollectiveOp::Scatter, |call| {
            algorithms::check_root(call, root)?;
            parts.check_ranks("scatter", self.shared.n_ranks)?;
            algorithms::check_len(call, "recv", parts.len(self.rank), recv.len())?;
            if self.rank == root {
                algorithms::check_len(call, "the root's send", parts.total(), send.len())?;
            }
            self.direct(call, |ctx| super::direct::scatter(ctx, send, recv, root, parts), |n| n.saturating_sub(1))
        })
    }

    /// In place across the threads (`direct.rs`), counted as each non-root rank's send.
    fn gather(&self, send: &[f32], recv: &mut [f32], root: usize, parts: &Partition) -> Result<()> {
        self.run(CollectiveOp::Gather, |call| {
            algorithms::check_root(call, root)?;
            parts.check_ranks("gather", self.shared.n_ranks)?;
            algorithms::check_len(call, "send", parts.len(self.rank), send.len())?;
            if self.rank == root {
                algorithms::check_len(call, "the root's recv", parts.total(), recv.len())?;
            }
            self.direct(call, |ctx| super::direct::gather(ctx, send, recv, root, parts), |_| 1)
        })
    }

    /// In place across the threads (`direct.rs`), counted as the ring's traffic.
    fn all_gather(&self, send: &[f32], recv: &mut [f32], parts: &Partition) -> Result<()> {
        self.run(CollectiveOp::AllGather, |call| {
            parts.check_ranks("all_gather", self.shared.n_ranks)?;
            algorithms::check_len(call, "send", parts.len(self.rank), send.len())?;
            algorithms::check_len(call, "recv", parts.total(), recv.len())?;
            self.direct(call, |ctx| super::direct::all_gather(ctx, send, recv, parts), |n| n.saturating_sub(1))
        })
    }

    /// In place across the threads (`direct.rs`), counted as the ring's traffic.
    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32], parts: &Partition) -> Result<()> {
        self.run(CollectiveOp::ReduceScatter, |call| {
            parts.check_ranks("reduce_scatter", self.shared.n_ranks)?;
            algorithms::check_len(call, "send", parts.total(), send.len())?;
            algorithms::check_len(call, "recv", parts.len(self.rank), recv.len())?;
            self.direct(call, |ctx| super::direct::reduce_scatter(ctx, send, recv, parts), |n| n.saturating_sub(1))
        })
    }

    fn all_to_all(&self, send: &[f32], send_parts: &Partition, recv: &mut [f32], recv_parts: &Partition) -> Result<()> {
        self.run(CollectiveOp::AllToAll, |call| algorithms::all_to_all(call, send, send_parts, recv, recv_parts))
    }
}
