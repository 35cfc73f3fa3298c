//! The server strategies (`ps[:S]`, `downpour:F,P`, `ssp:S`) across MPI ranks: how a worker
//! reaches server shards that live on other ranks, how a rank serves the pulls and pushes that
//! come to its shards, how the deterministic mode's turns are taken from rank 0, and how a
//! failure on one rank stops the others. The shards and the protocol are the in-process ones
//! (`server.rs`, `sync_trainer.rs`); only the messages travel through the transport.
//!
//! **Layout.** One worker per rank (worker = rank). Shard `s` of `S` runs as a thread on rank
//! `s mod R`, so a job needs no extra ranks for servers (as BytePS and MXNet co-locate them);
//! Downpour and SSP have one shard, on rank 0.
//!
//! **Messages.** Every message of a trainer travels in its own round
//! ([`STRATEGY_ROUND_BASE`] + the trainer's index, agreed by the start-up check), on one channel
//! per purpose ([`Channel`]). A worker sends a pull or push for a remote shard to the shard's rank
//! (`Channel::Server`); that rank's *bridge* thread decodes it and puts it in the shard's inbox,
//! the same FIFO channel the local worker sends to, with a reply that answers through the
//! transport (`Channel::Reply`). After its last step a worker sends `Done` to every rank that
//! hosts shards; a bridge ends when every other rank's worker is done, and the shards end when
//! every sender is gone, as in one process. Messages from one rank under one tag arrive in the
//! order they were sent, so a `Done` comes after every message of that worker.
//!
//! **Deterministic turns** (`Interleaving::Seeded`, `Replay`). The turnstile lives on rank 0; a
//! worker on another rank asks for its turn (`Channel::Turn(w)`), waits for the grant
//! (`Channel::Grant`), sends its messages, waits until each remote shard's bridge has put them
//! in the shard's inbox (`Channel::Ack`), and ends the turn. A proxy thread on rank 0 takes each
//! remote worker's turns on the turnstile for it. So a turn covers a message's arrival in its
//! shard's inbox, as in one process, and the servers see every message in the drawn order: a
//! seed gives the in-process run's bits. The record (rank 0's) is gathered to every rank.
//!
//! **Failures.** A rank whose run fails sends its error's text to every other rank
//! (`Channel::Abort`); each rank's watcher raises its run's abort flag on receipt, so every wait
//! there ends. Every wait for another rank also has a deadline (the trainer's collective
//! timeout), so a rank that dies silently cannot hang the others. As with the all-gather
//! strategies, a trainer whose run failed cannot rejoin; end the job.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, RecvTimeoutError, Sender};

use super::compress::Compression;
use super::links::{Abort, Turnstile};
use super::server::{Pulled, Reply, ToServer};
use crate::transport::wire::{Reader, Writer};
use crate::transport::{Tag, Transport};
use crate::{Device, Error, Result};

/// The round of the first strategy trainer's messages; later trainers take the rounds above it.
/// Far above the runtime's rounds (which count steps from 0) and below the collectives'
/// (`collective::over_transport`, from 2^63).
pub const STRATEGY_ROUND_BASE: u64 = 1 << 62;

/// Strategy trainers this process has created across ranks: the next one's round offset.
static TRAINERS_CREATED: AtomicU64 = AtomicU64::new(0);

/// The round this process proposes for its next strategy trainer. The start-up check takes the
/// largest proposal of all ranks ([`agreed_round`]), as the collectives agree on theirs, so ranks
/// that created different numbers of trainers (threads standing in for ranks, a trainer one rank
/// refused alone) still meet in one round.
pub(super) fn proposed_round() -> u64 {
    STRATEGY_ROUND_BASE + TRAINERS_CREATED.load(Ordering::SeqCst)
}

/// The ranks agreed on `round`: this process's next proposal is above it.
pub(super) fn agreed_round(round: u64) {
    TRAINERS_CREATED.fetch_max(round - STRATEGY_ROUND_BASE + 1, Ordering::SeqCst);
}

/// How long a wait sleeps before it looks at the abort flag again.
const POLL: Duration = Duration::from_millis(20);

/// [`Abort`]'s record of a failure on another rank.
pub(super) const REMOTE_FAILURE: usize = usize::MAX - 1;

/// What a message of the trainer's round is for.
#[derive(Clone, Copy, Debug)]
enum Channel {
    /// To a rank's shards: pulls, pushes and `Done`.
    Server,
    /// Pulled parameters, to the pulling worker's rank.
    Reply,
    /// Deterministic mode: a message reached its shard's inbox.
    Ack,
    /// A rank's run failed (its error's text).
    Abort,
    /// Deterministic mode: rank 0 grants this rank's worker its turn.
    Grant,
    /// Deterministic mode: worker `w` takes (0) or ends (1) a turn, to rank 0.
    Turn(usize),
}

impl Channel {
    fn id(self) -> u64 {
        match self {
            Channel::Server => 0,
            Channel::Reply => 1,
            Channel::Ack => 2,
            Channel::Abort => 3,
            Channel::Grant => 4,
            Channel::Turn(w) => 16 + w as u64,
        }
    }
}

/// Kinds of a `Channel::Server` message.
const PULL: u8 = 0;
const PUSH: u8 = 1;
const DONE: u8 = 2;

/// A trainer's inboxes for the server strategies across ranks, opened once when it is created
/// (a transport opens each tag once) and used by every run.
#[derive(Debug)]
pub(super) struct ServerRanks {
    transport: Arc<dyn Transport>,
    round: u64,
    server: Receiver<Vec<u8>>,
    reply: Receiver<Vec<u8>>,
    ack: Receiver<Vec<u8>>,
    abort: Receiver<Vec<u8>>,
    grant: Receiver<Vec<u8>>,
    /// Rank 0: every worker's turn requests (index: worker; empty on other ranks).
    turns: Vec<Receiver<Vec<u8>>>,
}

impl ServerRanks {
    pub fn open(transport: Arc<dyn Transport>, round: u64) -> Result<ServerRanks> {
        let inbox = |channel: Channel| transport.inbox(Tag { round, channel: channel.id() });
        let turns = if transport.rank() == 0 {
            (0..transport.world_size()).map(|w| inbox(Channel::Turn(w))).collect::<Result<_>>()?
        } else {
            Vec::new()
        };
        Ok(ServerRanks {
            server: inbox(Channel::Server)?,
            reply: inbox(Channel::Reply)?,
            ack: inbox(Channel::Ack)?,
            abort: inbox(Channel::Abort)?,
            grant: inbox(Channel::Grant)?,
            turns,
            transport,
            round,
        })
    }

    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    fn world(&self) -> usize {
        self.transport.world_size()
    }

    fn send(&self, to: usize, channel: Channel, bytes: Vec<u8>) -> Result<()> {
        self.transport.send(to, Tag { round: self.round, channel: channel.id() }, bytes)
    }

    /// The rank that hosts shard `shard` ([`host_rank`]).
    pub fn host(&self, shard: usize) -> usize {
        host_rank(shard, self.world())
    }

    /// Whether this rank hosts any of `shards` shards.
    pub fn hosts_any(&self, shards: usize) -> bool {
        self.rank() < shards
    }

    /// Tells every other rank that this rank's run failed, with the error's text.
    pub fn notify_failure(&self, error: &Error) {
        let text = error.to_string().into_bytes();
        for rank in (0..self.world()).filter(|&r| r != self.rank()) {
            // Best effort: a rank that is gone has nothing left to stop.
            let _ = self.send(rank, Channel::Abort, text.clone());
        }
    }

    /// Raises `abort` when another rank reports a failure, until `finished`; the other rank's
    /// error text, if one came.
    pub fn watch_failures(&self, abort: &Abort, finished: &AtomicBool) -> Option<String> {
        while !finished.load(Ordering::SeqCst) {
            if let Ok(text) = self.abort.recv_timeout(POLL) {
                abort.raise(REMOTE_FAILURE);
                return Some(String::from_utf8_lossy(&text).into_owned());
            }
        }
        None
    }

    /// Rank 0: takes worker `worker`'s `turns` turns on `turnstile` for it (the worker asks from
    /// its rank and is granted there).
    pub fn serve_turns(
        &self,
        turnstile: &Turnstile,
        worker: usize,
        turns: usize,
        abort: &Abort,
        timeout: Duration,
    ) -> Result<()> {
        let requests = self.turns.get(worker).ok_or_else(|| {
            Error::invalid("strategy over ranks", format!("turn requests of worker {worker} reach rank 0 only"))
        })?;
        for _ in 0..turns {
            expect_turn_message(&wait(requests, abort, timeout, "a turn request", worker)?, TAKE_TURN)?;
            turnstile.acquire(worker, abort)?;
            self.send(worker, Channel::Grant, Vec::new())?;
            expect_turn_message(&wait(requests, abort, timeout, "the end of a turn", worker)?, END_TURN)?;
            turnstile.release(worker);
        }
        Ok(())
    }

    /// This rank's worker waits for its turn from rank 0.
    pub fn take_turn(&self, worker: usize, abort: &Abort, timeout: Duration) -> Result<()> {
        self.send(0, Channel::Turn(worker), vec![TAKE_TURN])?;
        wait(&self.grant, abort, timeout, "its turn", 0).map(drop)
    }

    /// This rank's worker ends its turn.
    pub fn end_turn(&self, worker: usize) -> Result<()> {
        self.send(0, Channel::Turn(worker), vec![END_TURN])
    }

    /// Waits until `n` messages this worker sent reached their shards' inboxes.
    pub fn wait_acks(&self, n: usize, abort: &Abort, timeout: Duration) -> Result<()> {
        for _ in 0..n {
            wait(&self.ack, abort, timeout, "a shard's receipt", usize::MAX)?;
        }
        Ok(())
    }

    /// After its last step, this rank's worker tells every other rank hosting shards.
    pub fn worker_done(&self, worker: usize, shards: usize) -> Result<()> {
        let hosts = (0..shards.min(self.world())).filter(|&r| r != self.rank());
        for rank in hosts {
            let mut w = Writer::default();
            w.u8(DONE).usize(worker);
            self.send(rank, Channel::Server, w.bytes)?;
        }
        Ok(())
    }

    /// This rank's bridge: puts every pull and push other ranks send into the inbox of the local
    /// shard it is for (`inboxes`, by shard; `None` for shards elsewhere), acknowledging each in
    /// the deterministic mode, until every other rank's worker is done.
    pub fn bridge(
        &self,
        inboxes: Vec<Option<Sender<ToServer>>>,
        deterministic: bool,
        abort: &Abort,
        timeout: Duration,
    ) -> Result<()> {
        let mut done = vec![false; self.world()];
        done[self.rank()] = true;
        while done.iter().any(|d| !d) {
            let waiting_for = done.iter().position(|d| !d).unwrap_or(0);
            let bytes = wait(&self.server, abort, timeout, "a worker's pull, push or end", waiting_for)?;
            let mut r = Reader::new(&bytes);
            let kind = r.u8()?;
            if kind == DONE {
                let worker = r.usize()?;
                *done.get_mut(worker).ok_or_else(|| bad_message("a worker past the world's size"))? = true;
                continue;
            }
            let shard = r.usize()?;
            let worker = r.usize()?;
            let step = r.usize()?;
            let message = match kind {
                PULL => {
                    let min_version = r.u64()?;
                    let min_pushes = r.usize()?;
                    let reply = Reply::Remote(RemoteReply {
                        transport: Arc::clone(&self.transport),
                        to: worker,
                        tag: Tag { round: self.round, channel: Channel::Reply.id() },
                    });
                    ToServer::Pull { step, min_version, min_pushes, reply }
                }
                PUSH => {
                    let pulled_version = r.u64()?;
                    let codec: Compression = r.string()?.parse()?;
                    let lr = match r.u8()? {
                        0 => None,
                        _ => Some(r.f64()?),
                    };
                    let n = r.count(8)?;
                    let grads = (0..n).map(|_| Ok(r.bytes()?.to_vec())).collect::<Result<_>>()?;
                    ToServer::Push { worker, step, pulled_version, codec, lr, grads }
                }
                _ => return Err(bad_message("an unknown kind")),
            };
            let inbox = inboxes
                .get(shard)
                .and_then(Option::as_ref)
                .ok_or_else(|| bad_message("a shard this rank does not host"))?;
            inbox.send(message).map_err(|_| Error::invalid("parameter server", "a server shard stopped"))?;
            if deterministic {
                self.send(worker, Channel::Ack, Vec::new())?;
            }
        }
        Ok(())
    }
}

const TAKE_TURN: u8 = 0;
const END_TURN: u8 = 1;

fn expect_turn_message(bytes: &[u8], expected: u8) -> Result<()> {
    if bytes != [expected] {
        return Err(bad_message("a turn message out of order"));
    }
    Ok(())
}

fn bad_message(what: &str) -> Error {
    Error::invalid("strategy over ranks", format!("a server message named {what}: ranks out of step"))
}

/// The next message of `inbox`, polling `abort`, failing past `timeout` (`from`: the rank it is
/// expected from, for the message; `usize::MAX`: any).
fn wait(inbox: &Receiver<Vec<u8>>, abort: &Abort, timeout: Duration, what: &str, from: usize) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    loop {
        match inbox.recv_timeout(POLL) {
            Ok(bytes) => return Ok(bytes),
            Err(RecvTimeoutError::Timeout) => {
                abort.check()?;
                if Instant::now() >= deadline {
                    let source = if from == usize::MAX { "another rank".to_string() } else { format!("rank {from}") };
                    return Err(Error::invalid(
                        "strategy over ranks",
                        format!(
                            "waited {:.0} s for {what} from {source}; it may have failed or hung",
                            timeout.as_secs_f64()
                        ),
                    ));
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(Error::invalid("strategy over ranks", "the transport stopped"));
            }
        }
    }
}

/// A pull's answer to a worker on another rank.
#[derive(Debug)]
pub(super) struct RemoteReply {
    transport: Arc<dyn Transport>,
    to: usize,
    tag: Tag,
}

impl RemoteReply {
    pub fn send(&self, pulled: &Pulled) -> Result<()> {
        let mut w = Writer::default();
        w.usize(pulled.shard).u64(pulled.version).usize(pulled.params.len());
        for (index, tensor) in &pulled.params {
            w.usize(*index).tensor(tensor)?;
        }
        self.transport.send(self.to, self.tag, w.bytes)
    }
}

fn decode_pulled(bytes: &[u8]) -> Result<Pulled> {
    let mut r = Reader::new(bytes);
    let shard = r.usize()?;
    let version = r.u64()?;
    let n = r.count(16)?;
    let params = (0..n).map(|_| Ok((r.usize()?, r.tensor(&Device::host())?))).collect::<Result<_>>()?;
    Ok(Pulled { shard, version, params })
}

/// How a worker reaches the server shards: a channel per shard of this process, and across ranks
/// the transport to the others' shards.
pub(super) struct ServerLinks<'a> {
    /// By shard: the inbox of a shard of this process.
    local: Vec<Option<Sender<ToServer>>>,
    remote: Option<&'a ServerRanks>,
}

impl<'a> ServerLinks<'a> {
    pub fn new(local: Vec<Option<Sender<ToServer>>>, remote: Option<&'a ServerRanks>) -> ServerLinks<'a> {
        ServerLinks { local, remote }
    }

    pub fn shards(&self) -> usize {
        self.local.len()
    }

    /// Sends `message` to shard `shard`; whether it went to another rank. A pull to a remote
    /// shard is answered through the transport (`collect`), whatever its `reply`.
    pub fn send(&self, shard: usize, message: ToServer) -> Result<bool> {
        if let Some(inbox) = self.local.get(shard).and_then(Option::as_ref) {
            inbox.send(message).map_err(|_| Error::invalid("parameter server", "a server shard stopped"))?;
            return Ok(false);
        }
        let remote =
            self.remote.ok_or_else(|| Error::invalid("parameter server", format!("shard {shard} is in no process")))?;
        let mut w = Writer::default();
        match message {
            ToServer::Pull { step, min_version, min_pushes, reply: _ } => {
                w.u8(PULL).usize(shard).usize(remote.rank()).usize(step).u64(min_version).usize(min_pushes);
            }
            ToServer::Push { worker, step, pulled_version, codec, lr, grads } => {
                w.u8(PUSH).usize(shard).usize(worker).usize(step).u64(pulled_version).str(&codec.to_string());
                match lr {
                    None => w.u8(0),
                    Some(lr) => w.u8(1).f64(lr),
                };
                w.usize(grads.len());
                for g in &grads {
                    w.bytes(g);
                }
            }
        }
        remote.send(remote.host(shard), Channel::Server, w.bytes)?;
        Ok(true)
    }

    /// `n` answers to the pulls just sent: local ones from `local`, remote ones from the
    /// transport.
    pub fn collect(&self, local: &Receiver<Pulled>, n: usize, abort: &Abort, timeout: Duration) -> Result<Vec<Pulled>> {
        let deadline = Instant::now() + timeout;
        let mut answers = Vec::with_capacity(n);
        while answers.len() < n {
            let answer = match self.remote {
                None => local.recv_timeout(POLL).ok(),
                Some(remote) => crossbeam::select! {
                    recv(local) -> pulled => pulled.ok(),
                    recv(remote.reply) -> bytes => bytes.ok().map(|b| decode_pulled(&b)).transpose()?,
                    default(POLL) => None,
                },
            };
            match answer {
                Some(pulled) => answers.push(pulled),
                None => {
                    abort.check()?;
                    if self.remote.is_some() && Instant::now() >= deadline {
                        return Err(Error::invalid(
                            "strategy over ranks",
                            format!(
                                "waited {:.0} s for a server shard's parameters; its rank may have failed or hung",
                                timeout.as_secs_f64()
                            ),
                        ));
                    }
                }
            }
        }
        Ok(answers)
    }
}

/// The rank of `world` ranks that hosts server shard `shard`: shard `s` runs on rank `s mod R`
/// (BytePS's and MXNet's co-located servers), so shards spread over the ranks in turn.
pub(crate) fn host_rank(shard: usize, world: usize) -> usize {
    shard % world
}
