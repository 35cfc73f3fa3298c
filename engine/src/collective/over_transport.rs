//! [`TransportGroup`]: the collectives for the ranks of a [`Transport`]'s world (one process per
//! rank under MPI), with the in-process group's algorithms and failure semantics, and a cost model
//! fitted to the link the transport measured at start-up.
//!
//! # Design
//!
//! A group is this rank's end of the whole world of the transport (rank `r` of the group is rank
//! `r` of the transport), or of one subgroup of it ([`TransportGroup::split`]: the world cut into
//! disjoint lists of ranks, as `MPI_Comm_split` cuts a communicator; rank `r` of a subgroup is the
//! `r`-th transport rank of its list). Its messages are [`Transport::send`]s of f32 bytes, and the algorithms are
//! `algorithms.rs`, the very code the in-process group runs (ring all-reduce, direct root
//! collectives, pairwise all-to-all), so a [`TransportGroup`] and a [`super::ProcessGroup`] given
//! the same inputs give the same results bit for bit.
//!
//! **Tags.** Each group owns a round `COLLECTIVE_ROUND_BASE + k`, far above the runtime's rounds
//! (which count steps from 0): its ranks agree on `k` when they create it, one above every group
//! any of them created before. Its messages from `src` to `dst` go on the channel
//! `(src << 32) | dst` (transport ranks), which is never the runtime's `ABORT_CHANNEL`; the
//! subgroups of one split take consecutive rounds, so their messages never meet. A group opens one inbox per peer when it is created and keeps it:
//! a transport keeps an inbox until its round is closed, and closing rounds closes every earlier
//! round, the runtime's included, so a round per call would leave an open inbox per peer behind
//! every call. Instead each message carries the call's sequence number and collective in a header,
//! as the in-process group's messages do, and a receiver checks them.
//!
//! **Failures.** A rank whose collective fails (bad arguments, a budget overrun, a peer that sent
//! the wrong thing, no message within the timeout) sends an abort notice with its reason to every
//! peer; a waiting rank watches every peer's inbox, not only the one it waits on, so a notice from
//! any rank ends its wait at once with [`Error::CollectiveAborted`]. The group then refuses new
//! collectives until every rank calls [`TransportGroup::recover`].
//!
//! **Recovery** is a message from every member to every other member on the group's own channels,
//! carrying its next sequence number. A channel is first in, first out, so everything a peer sent
//! in the failed call arrives before its recovery notice and is dropped, and everything it sends
//! after recovering arrives after it and is kept. No transport-wide gather is needed, so one
//! subgroup recovers while the others go on.
//!
//! The rejected alternative, MPI's own collectives (`MPI_Iallreduce`), would tie the group to MPI,
//! give up the bit-for-bit agreement with the in-process group (MPI chooses its own reduction
//! order) and need MPI calls from the worker threads, which Open MPI's funneled mode forbids.
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, Select};
use parking_lot::Mutex;

use super::algorithms::{self, Exchange};
use super::{CollectiveOp, Communicator, DEFAULT_TIMEOUT, Partition, Traffic};
use crate::placement::Link;
use crate::transport::{Tag, Transport};
use crate::{Device, Error, Result};

/// The round of the first [`TransportGroup`] of a world; later groups use the rounds above it. The
/// runtime's rounds count dispatched steps from 0 and never come near it.
pub const COLLECTIVE_ROUND_BASE: u64 = 1 << 63;

/// The index this process proposes for its next group: one more than the last group's.
static GROUPS_CREATED: AtomicU64 = AtomicU64::new(0);

/// Set by [`interrupt_waits`], cleared by [`resume_waits`].
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// How often a waiting call looks for an interrupt.
const INTERRUPT_POLL: Duration = Duration::from_millis(20);

/// Ends, within a few milliseconds, every wait of every [`TransportGroup`] collective of this
/// process, and refuses new ones, with [`Error::CollectiveAborted`], until [`resume_waits`]. The
/// runtime calls it when a step is abandoned on this rank (its own failure or another rank's), so
/// that a worker in a tensor-parallel collective (or about to enter one) with a rank that will
/// never come is freed at once instead of at the group's timeout; once the step's workers are done
/// every rank recovers its groups ([`TransportGroup::recover`] does not look at the interrupt) and
/// resumes.
pub fn interrupt_waits() {
    INTERRUPTED.store(true, Ordering::Release);
}

/// Lets collectives run again after [`interrupt_waits`].
pub fn resume_waits() {
    INTERRUPTED.store(false, Ordering::Release);
}

/// Message kinds, the first byte of every message.
const DATA: u8 = 0;
const ABORT: u8 = 1;
const RECOVER: u8 = 2;
/// Kind, collective, sequence number.
const HEADER_BYTES: usize = 1 + 1 + 8;

/// The collectives over a [`Transport`], for this process's rank of its world: see the module
/// docs. Every rank creates its groups in the same order and calls the same collectives in the same
/// order; use a group from one thread at a time.
///
/// ```
/// use std::sync::Arc;
/// use conveyor_engine::Device;
/// use conveyor_engine::collective::{CollectiveOp, Communicator, TransportGroup};
/// use conveyor_engine::transport::InProcess;
/// // A world of one rank: every collective is a copy, and costs nothing.
/// let group = TransportGroup::new(Arc::new(InProcess), Device::cpu(0))?;
/// let mut buf = vec![1.0, 2.0, 3.0];
/// group.all_reduce(&mut buf)?;
/// assert_eq!(buf, [1.0, 2.0, 3.0]);
/// assert_eq!(group.cost_s(CollectiveOp::AllReduce, 12), Some(0.0));
/// # Ok::<(), conveyor_engine::Error>(())
/// ```
#[derive(Debug)]
pub struct TransportGroup {
    transport: Arc<dyn Transport>,
    device: Device,
    /// This rank's index in `members`.
    rank: usize,
    n_ranks: usize,
    /// The transport ranks of the group, in group-rank order (`0..world` for the whole world).
    members: Vec<usize>,
    /// This group's round: every message of the group travels in it.
    round: u64,
    timeout: Duration,
    /// From each rank (`None` for this rank).
    inboxes: Vec<Option<Receiver<Vec<u8>>>>,
    /// Data messages taken from an inbox while waiting for another rank's, per source, in order.
    pending: Mutex<Vec<VecDeque<Vec<u8>>>>,
    /// The slowest link of the world, as every rank measured it at start-up.
    link: Option<Link>,
    /// The next collective's sequence number (the same on every rank).
    seq: AtomicU64,
    /// Sequence numbers below this belong to calls before the last recovery: their messages and
    /// abort notices are dropped.
    epoch: AtomicU64,
    /// The first failure seen by this rank: (the rank that failed, its reason).
    failure: Mutex<Option<(usize, String)>>,
    bytes_sent: AtomicU64,
    messages_sent: AtomicU64,
}

impl TransportGroup {
    /// This rank's end of a group of every rank of `transport`, its buffers on `device` (a CPU
    /// device), waiting at most [`DEFAULT_TIMEOUT`] for a peer. Every rank must call it: the ranks
    /// agree on the group's round and link with a [`Transport::all_gather`], so they create their
    /// groups in the same order with respect to the transport's other gathers.
    pub fn new(transport: Arc<dyn Transport>, device: Device) -> Result<TransportGroup> {
        TransportGroup::with_timeout(transport, device, DEFAULT_TIMEOUT)
    }

    /// Like [`TransportGroup::new`], with the longest wait for a peer's message (at least 1 ms).
    pub fn with_timeout(transport: Arc<dyn Transport>, device: Device, timeout: Duration) -> Result<TransportGroup> {
        let world: Vec<usize> = (0..transport.world_size()).collect();
        TransportGroup::split(transport, device, timeout, &[world])
    }

    /// This rank's end of its subgroup: `groups` cuts the transport's ranks into disjoint lists
    /// (every rank in exactly one), and the group returned holds the list with this rank, its
    /// ranks in list order. Every rank of the transport must call it with the same `groups` (it
    /// agrees on rounds with a [`Transport::all_gather`]); the subgroups of one call take
    /// consecutive rounds, and each serves its members alone (collectives, [`Self::recover`]).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use conveyor_engine::Device;
    /// use conveyor_engine::collective::{Communicator, TransportGroup};
    /// use conveyor_engine::transport::InProcess;
    /// let group = TransportGroup::split(Arc::new(InProcess), Device::cpu(0), Duration::from_secs(1), &[vec![0]])?;
    /// assert_eq!((group.rank(), group.n_ranks(), group.members()), (0, 1, &[0][..]));
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn split(
        transport: Arc<dyn Transport>,
        device: Device,
        timeout: Duration,
        groups: &[Vec<usize>],
    ) -> Result<TransportGroup> {
        if timeout < Duration::from_millis(1) {
            return Err(Error::invalid("TransportGroup timeout", format!("{timeout:?}: give at least 1 ms")));
        }
        if matches!(device, Device::Cuda(_)) {
            return Err(Error::invalid(
                "TransportGroup device",
                format!("{device}: the transport group moves host buffers; give a CPU device"),
            ));
        }
        let (me, world) = (transport.rank(), transport.world_size());
        let mut seen = vec![false; world];
        for &rank in groups.iter().flatten() {
            if rank >= world || std::mem::replace(&mut seen[rank], true) {
                return Err(Error::invalid(
                    "TransportGroup groups",
                    format!(
                        "rank {rank} is {} in {groups:?}; give every rank of the world of {world} exactly once",
                        if rank >= world { "outside the world" } else { "listed twice" }
                    ),
                ));
            }
        }
        if let Some(missing) = seen.iter().position(|s| !s) {
            return Err(Error::invalid(
                "TransportGroup groups",
                format!("rank {missing} is in no group of {groups:?}; give every rank of the world of {world} once"),
            ));
        }
        let (index, link) = agree(transport.as_ref(), timeout, groups.len() as u64)?;
        let (which, members) =
            groups.iter().enumerate().find(|(_, g)| g.contains(&me)).expect("every rank is in a group (checked)");
        let members = members.clone();
        let rank = members.iter().position(|&m| m == me).expect("listed");
        let n_ranks = members.len();
        let round = COLLECTIVE_ROUND_BASE + index + which as u64;
        let inboxes = members
            .iter()
            .map(|&src| (src != me).then(|| transport.inbox(Tag { round, channel: channel(src, me) })).transpose())
            .collect::<Result<Vec<_>>>()?;
        Ok(TransportGroup {
            transport,
            device,
            rank,
            n_ranks,
            members,
            round,
            timeout,
            inboxes,
            pending: Mutex::new(vec![VecDeque::new(); n_ranks]),
            link,
            seq: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
            failure: Mutex::new(None),
            bytes_sent: AtomicU64::new(0),
            messages_sent: AtomicU64::new(0),
        })
    }

    /// The transport ranks of this group, in group-rank order.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// The link the cost model uses: the slowest of the world's links (largest latency, smallest
    /// bandwidth) as [`Transport::link`] measured them at start-up, the same on every rank; `None`
    /// when the transport measured none (a world of one).
    pub fn link(&self) -> Option<Link> {
        self.link
    }

    /// Seconds `op` on `bytes` should take in this group under `t = latency + bytes / bandwidth`
    /// with [`TransportGroup::link`] ([`super::cost_s`]; `bytes` as [`super::traffic`] defines
    /// them). Zero for a group of one; `None` when no link was measured.
    pub fn cost_s(&self, op: CollectiveOp, bytes: u64) -> Option<f64> {
        if self.n_ranks <= 1 {
            return Some(0.0);
        }
        self.link.map(|link| super::cost_s(op, bytes, self.n_ranks, &link))
    }

    /// Fits the cost model to this group's own all-reduces and uses it from then on: the start-up
    /// link prices MPI's transfer alone, while a collective here also pays the hand-offs to the
    /// communication thread and the copies into and out of messages. Times all-reduces of 1 KiB to
    /// 1 MiB (the fastest of three runs each, the slowest rank's), then fits
    /// `messages x latency + bytes / bandwidth` with [`super::traffic`]'s counts by least squares
    /// on relative error. Every rank must call it (it runs collectives and one gather) and gets
    /// the same link. Takes a few milliseconds.
    pub fn calibrate(&mut self) -> Result<Link> {
        const LENS: [usize; 4] = [1 << 8, 1 << 14, 1 << 16, 1 << 18];
        let mut own = Vec::with_capacity(LENS.len());
        for len in LENS {
            let mut buf = vec![0.0f32; len];
            self.all_reduce(&mut buf)?;
            let mut fastest = f64::INFINITY;
            for _ in 0..3 {
                let started = Instant::now();
                self.all_reduce(&mut buf)?;
                fastest = fastest.min(started.elapsed().as_secs_f64());
            }
            own.push(fastest);
        }
        let bytes: Vec<u8> = own.iter().flat_map(|t| t.to_le_bytes()).collect();
        let mut slowest = vec![0.0f64; LENS.len()];
        for part in self.transport.all_gather(bytes, self.timeout)? {
            for (i, chunk) in part.chunks_exact(8).enumerate().take(LENS.len()) {
                slowest[i] = slowest[i].max(f64::from_le_bytes(chunk.try_into().expect("eight bytes")));
            }
        }
        // Weighted least squares for t = m * a + b * c (a: latency, c: seconds per byte), each
        // equation divided by its t so every size counts by its relative error.
        let (mut smm, mut smb, mut sbb, mut smt, mut sbt) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for (len, t) in LENS.iter().zip(&slowest) {
            let traffic = super::traffic(CollectiveOp::AllReduce, (len * 4) as u64, self.n_ranks);
            let (m, b) = (traffic.messages as f64 / t, traffic.bytes / t);
            smm += m * m;
            smb += m * b;
            sbb += b * b;
            smt += m;
            sbt += b;
        }
        let det = smm * sbb - smb * smb;
        let (latency_s, seconds_per_byte) = if det.abs() > f64::EPSILON * smm * sbb {
            ((smt * sbb - sbt * smb) / det, (smm * sbt - smb * smt) / det)
        } else {
            (0.0, 0.0)
        };
        let link = Link { latency_s: latency_s.max(1e-9), bandwidth_bytes_per_s: 1.0 / seconds_per_byte.max(1e-15) };
        self.link = Some(link);
        Ok(link)
    }

    /// Makes the group usable again after a failed collective. Every member must call it: each
    /// tells every other member its next sequence number on the group's channels and waits (at most
    /// the group's timeout) for theirs; the members go on from the largest, and every message and
    /// abort notice of an earlier call is dropped (see the module docs).
    pub fn recover(&mut self) -> Result<()> {
        let own = self.seq.load(Ordering::Acquire);
        for dst in (0..self.n_ranks).filter(|&d| d != self.rank) {
            let notice = header(RECOVER, CollectiveOp::AllReduce, own, 0);
            self.transport.send(self.members[dst], self.tag(self.rank, dst), notice)?;
        }
        let deadline = Instant::now() + self.timeout;
        let mut next = own;
        let me = self.rank;
        for src in (0..self.n_ranks).filter(|&s| s != me) {
            next = next.max(self.take_recovery(src, deadline)?);
        }
        self.seq.store(next, Ordering::Release);
        self.epoch.store(next, Ordering::Release);
        *self.failure.get_mut() = None;
        Ok(())
    }

    /// Drops `src`'s messages up to its recovery notice and returns the sequence number it carries;
    /// messages queued after the notice stay queued.
    fn take_recovery(&mut self, src: usize, deadline: Instant) -> Result<u64> {
        let queue = &mut self.pending.get_mut()[src];
        while let Some(bytes) = queue.pop_front() {
            if let Some((RECOVER, _, seq)) = parse_header(&bytes) {
                return Ok(seq);
            }
        }
        let inbox = self.inboxes[src].as_ref().expect("a peer's inbox");
        loop {
            let bytes = inbox.recv_deadline(deadline).map_err(|_| Error::CollectiveFailed {
                op: "recover".into(),
                rank: self.rank,
                n_ranks: self.n_ranks,
                reason: format!(
                    "no recovery notice from rank {src} within {:?}; did every member call recover?",
                    self.timeout
                ),
            })?;
            if let Some((RECOVER, _, seq)) = parse_header(&bytes) {
                return Ok(seq);
            }
        }
    }

    fn failure(&self) -> Option<(usize, String)> {
        self.failure.lock().clone()
    }

    fn record_failure(&self, rank: usize, reason: String) -> (usize, String) {
        self.failure.lock().get_or_insert((rank, reason)).clone()
    }

    /// Runs one collective: refuses to start on a failed group, numbers its messages, and on a
    /// failure of this rank tells every peer, so that no peer waits for a message that will not come.
    fn run(&self, op: CollectiveOp, body: impl FnOnce(&Call<'_>) -> Result<()>) -> Result<()> {
        let seq = self.seq.fetch_add(1, Ordering::AcqRel);
        let call = Call { group: self, op, seq };
        if let Some(failure) = self.failure() {
            return Err(call.aborted(failure));
        }
        if INTERRUPTED.load(Ordering::Acquire) {
            return Err(call.interrupted());
        }
        let result = body(&call);
        if let Err(error) = &result
            && !matches!(error, Error::CollectiveAborted { .. })
        {
            let reason = error.to_string();
            self.record_failure(self.rank, reason.clone());
            for dst in (0..self.n_ranks).filter(|&d| d != self.rank) {
                let mut notice = header(ABORT, op, seq, reason.len());
                notice.extend_from_slice(reason.as_bytes());
                // A peer that cannot be told ends on its timeout instead.
                let _ = self.transport.send(self.members[dst], self.tag(self.rank, dst), notice);
            }
        }
        result
    }

    /// The tag of the messages from group rank `src` to group rank `dst`.
    fn tag(&self, src: usize, dst: usize) -> Tag {
        Tag { round: self.round, channel: channel(self.members[src], self.members[dst]) }
    }
}

/// The channel of the messages from transport rank `src` to transport rank `dst`.
fn channel(src: usize, dst: usize) -> u64 {
    ((src as u64) << 32) | dst as u64
}

fn header(kind: u8, op: CollectiveOp, seq: u64, payload_bytes: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(HEADER_BYTES + payload_bytes);
    bytes.push(kind);
    bytes.push(CollectiveOp::ALL.iter().position(|&o| o == op).expect("every op is listed") as u8);
    bytes.extend_from_slice(&seq.to_le_bytes());
    bytes
}

/// A message's kind, collective (`None` if unknown) and sequence number, or `None` if it is too short.
fn parse_header(bytes: &[u8]) -> Option<(u8, Option<CollectiveOp>, u64)> {
    let head = bytes.get(..HEADER_BYTES)?;
    let op = CollectiveOp::ALL.get(usize::from(head[1])).copied();
    Some((head[0], op, u64::from_le_bytes(head[2..10].try_into().expect("eight bytes"))))
}

/// Agrees with every rank on the first index of `n_groups` new groups and their link: each rank
/// proposes the next index of its process and the slowest of the links it measured; the groups take
/// the largest index (above every round any rank used before) and the ones after it, and the
/// slowest link of all.
fn agree(transport: &dyn Transport, timeout: Duration, n_groups: u64) -> Result<(u64, Option<Link>)> {
    let rank = transport.rank();
    let slowest = |a: Link, b: Link| Link {
        latency_s: a.latency_s.max(b.latency_s),
        bandwidth_bytes_per_s: a.bandwidth_bytes_per_s.min(b.bandwidth_bytes_per_s),
    };
    let own = (0..transport.world_size())
        .filter(|&p| p != rank)
        .filter_map(|p| transport.link(p))
        .map(|l| Link { latency_s: l.latency_s, bandwidth_bytes_per_s: l.bandwidth_bytes_per_s })
        .reduce(slowest);
    let mut bytes = GROUPS_CREATED.load(Ordering::Acquire).to_le_bytes().to_vec();
    if let Some(link) = own {
        bytes.extend_from_slice(&link.latency_s.to_le_bytes());
        bytes.extend_from_slice(&link.bandwidth_bytes_per_s.to_le_bytes());
    }
    let (mut index, mut link) = (0, None);
    for (peer, proposal) in transport.all_gather(bytes, timeout)?.iter().enumerate() {
        let field = |i: usize| proposal.get(8 * i..8 * i + 8).map(|b| b.try_into().expect("eight bytes"));
        let Some(proposed) = field(0).map(u64::from_le_bytes) else {
            return Err(Error::Transport { rank: Some(rank), reason: format!("rank {peer} proposed no group index") });
        };
        index = index.max(proposed);
        if let (Some(latency_s), Some(bandwidth)) = (field(1).map(f64::from_le_bytes), field(2).map(f64::from_le_bytes))
        {
            let theirs = Link { latency_s, bandwidth_bytes_per_s: bandwidth };
            link = Some(link.map_or(theirs, |l| slowest(l, theirs)));
        }
    }
    if index >= u64::MAX - COLLECTIVE_ROUND_BASE - n_groups {
        return Err(Error::invalid("TransportGroup", "this process created 2^63 groups; no round is left"));
    }
    GROUPS_CREATED.fetch_max(index + n_groups, Ordering::AcqRel);
    Ok((index, link))
}

/// One collective in progress on one rank.
struct Call<'a> {
    group: &'a TransportGroup,
    op: CollectiveOp,
    seq: u64,
}

impl Call<'_> {
    /// The error of a call ended by [`interrupt_waits`]; the group stays failed until recovered.
    fn interrupted(&self) -> Error {
        let group = self.group;
        self.aborted(group.record_failure(group.rank, "the step was abandoned on this rank".to_string()))
    }

    fn aborted(&self, (failed_rank, reason): (usize, String)) -> Error {
        Error::CollectiveAborted { op: self.op.name().into(), rank: self.group.rank, failed_rank, reason }
    }

    /// Takes the next message from any peer, waiting until `deadline`: an abort notice of this
    /// epoch ends the call; anything else is queued under its source. False on timeout.
    fn take_any(&self, deadline: Instant) -> Result<bool> {
        let group = self.group;
        let mut select = Select::new();
        let mut sources = Vec::with_capacity(group.n_ranks);
        for (src, inbox) in group.inboxes.iter().enumerate() {
            if let Some(inbox) = inbox {
                select.recv(inbox);
                sources.push(src);
            }
        }
        let selected = loop {
            if INTERRUPTED.load(Ordering::Acquire) {
                return Err(self.interrupted());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match select.select_timeout(left.min(INTERRUPT_POLL)) {
                Ok(selected) => break selected,
                Err(_) if left > INTERRUPT_POLL => continue,
                Err(_) => return Ok(false),
            }
        };
        let src = sources[selected.index()];
        let bytes = selected
            .recv(group.inboxes[src].as_ref().expect("selected inboxes exist"))
            .map_err(|_| self.failed(format!("the transport closed the inbox of rank {src}'s messages")))?;
        match parse_header(&bytes) {
            Some((ABORT, _, seq)) => {
                if seq >= group.epoch.load(Ordering::Acquire) {
                    let reason = String::from_utf8_lossy(&bytes[HEADER_BYTES..]).into_owned();
                    return Err(self.aborted(group.record_failure(src, reason)));
                }
            }
            // A peer recovering has given up its call (its own failure need not have been a
            // collective's, so no abort notice came): end this call too, and keep the notice for
            // this rank's recovery.
            Some((RECOVER, _, _)) => {
                group.pending.lock()[src].push_back(bytes);
                let reason = "it gave up the call and is recovering the group".to_string();
                return Err(self.aborted(group.record_failure(src, reason)));
            }
            _ => group.pending.lock()[src].push_back(bytes),
        }
        Ok(true)
    }

    /// This call's data from a message of `src`, `None` for a message of a call before the last
    /// recovery (dropped).
    fn read(&self, src: usize, bytes: &[u8], expected_len: usize) -> Result<Option<Vec<f32>>> {
        let Some((DATA, op, seq)) = parse_header(bytes) else {
            return Err(self.failed(format!("rank {src} sent a malformed message of {} bytes", bytes.len())));
        };
        if seq < self.group.epoch.load(Ordering::Acquire) {
            return Ok(None);
        }
        let op_name = op.map_or("an unknown collective", CollectiveOp::name);
        if seq != self.seq || op != Some(self.op) {
            return Err(self.failed(format!(
                "rank {src} sent a message of its collective #{seq} ({op_name}) while this rank is in #{} ({})",
                self.seq, self.op
            )));
        }
        let payload = &bytes[HEADER_BYTES..];
        if payload.len() != 4 * expected_len {
            return Err(self.failed(format!(
                "rank {src} sent {} bytes where {expected_len} elements were expected; the ranks' lengths or partitions differ",
                payload.len()
            )));
        }
        let _reservation = self.group.device.reserve(payload.len() as u64)?;
        Ok(Some(payload.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().expect("four bytes"))).collect()))
    }
}

impl Exchange for Call<'_> {
    fn rank(&self) -> usize {
        self.group.rank
    }

    fn n_ranks(&self) -> usize {
        self.group.n_ranks
    }

    fn device(&self) -> &Device {
        &self.group.device
    }

    fn failed(&self, reason: String) -> Error {
        Error::CollectiveFailed {
            op: self.op.name().into(),
            rank: self.group.rank,
            n_ranks: self.group.n_ranks,
            reason,
        }
    }

    fn send(&self, dst: usize, data: &[f32]) -> Result<()> {
        let group = self.group;
        let mut bytes = header(DATA, self.op, self.seq, std::mem::size_of_val(data));
        bytes.resize(HEADER_BYTES + std::mem::size_of_val(data), 0);
        for (out, value) in bytes[HEADER_BYTES..].chunks_exact_mut(4).zip(data) {
            out.copy_from_slice(&value.to_le_bytes());
        }
        group
            .transport
            .send(group.members[dst], group.tag(group.rank, dst), bytes)
            .map_err(|e| self.failed(format!("could not send to rank {dst}: {e}")))?;
        group.bytes_sent.fetch_add(std::mem::size_of_val(data) as u64, Ordering::Relaxed);
        group.messages_sent.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Waits for the next message of this call from `src`, watching every peer for an abort notice
    /// meanwhile; its bytes are counted on this rank's device while they are decoded.
    fn recv(&self, src: usize, expected_len: usize) -> Result<Vec<f32>> {
        let deadline = Instant::now() + self.group.timeout;
        loop {
            let queued = self.group.pending.lock()[src].pop_front();
            if let Some(bytes) = queued {
                if let Some((RECOVER, _, _)) = parse_header(&bytes) {
                    // Kept for this rank's recovery (see `take_any`).
                    self.group.pending.lock()[src].push_front(bytes);
                    let reason = "it gave up the call and is recovering the group".to_string();
                    return Err(self.aborted(self.group.record_failure(src, reason)));
                }
                match self.read(src, &bytes, expected_len)? {
                    Some(data) => return Ok(data),
                    None => continue,
                }
            }
            if let Some(failure) = self.group.failure() {
                return Err(self.aborted(failure));
            }
            if !self.take_any(deadline)? {
                return Err(self.failed(format!(
                    "no message from rank {src} within {:?}; did every rank call {}?",
                    self.group.timeout, self.op
                )));
            }
        }
    }
}

impl Communicator for TransportGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn n_ranks(&self) -> usize {
        self.n_ranks
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

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        self.run(CollectiveOp::Broadcast, |call| algorithms::broadcast(call, buf, root))
    }

    fn reduce(&self, buf: &mut [f32], root: usize) -> Result<()> {
        self.run(CollectiveOp::Reduce, |call| algorithms::reduce(call, buf, root))
    }

    fn all_reduce(&self, buf: &mut [f32]) -> Result<()> {
        self.run(CollectiveOp::AllReduce, |call| algorithms::all_reduce(call, buf))
    }

    fn scatter(&self, send: &[f32], recv: &mut [f32], root: usize, parts: &Partition) -> Result<()> {
        self.run(CollectiveOp::Scatter, |call| algorithms::scatter(call, send, recv, root, parts))
    }

    fn gather(&self, send: &[f32], recv: &mut [f32], root: usize, parts: &Partition) -> Result<()> {
        self.run(CollectiveOp::Gather, |call| algorithms::gather(call, send, recv, root, parts))
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32], parts: &Partition) -> Result<()> {
        self.run(CollectiveOp::AllGather, |call| algorithms::all_gather(call, send, recv, parts))
    }

    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32], parts: &Partition) -> Result<()> {
        self.run(CollectiveOp::ReduceScatter, |call| algorithms::reduce_scatter(call, send, recv, parts))
    }

    fn all_to_all(&self, send: &[f32], send_parts: &Partition, recv: &mut [f32], recv_parts: &Partition) -> Result<()> {
        self.run(CollectiveOp::AllToAll, |call| algorithms::all_to_all(call, send, send_parts, recv, recv_parts))
    }
}

#[cfg(test)]
mod tests;
