//! The MPI transport (`mpi` feature): one communication thread per rank owns MPI (initialised
//! `MPI_THREAD_FUNNELED`, so only that thread ever calls it, which Open MPI's `!Send` communicators
//! require) and talks to the rest of the process over crossbeam channels. It never blocks inside
//! MPI: sends are `MPI_Isend` of owned buffers tested until done, arrivals are found with
//! `MPI_Iprobe` and received whole, and collectives are non-blocking and polled against a deadline,
//! so one loop keeps every direction moving (see `README.md` for why that cannot deadlock).
use std::collections::HashMap;
use std::os::raw::{c_int, c_void};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam::channel::{self, Receiver, Sender};
use mpi::ffi;
use parking_lot::Mutex;

use super::{LinkCost, Tag, Transport, TransportKind};
use crate::{Error, Result};

/// Whether this build can run on MPI.
pub const MPI_BUILT: bool = true;

/// The MPI tag of every runtime message (the [`Tag`] travels in the message's first bytes).
const DATA_TAG: c_int = 1;
/// The MPI tag of start-up measurements.
const PING_TAG: c_int = 2;
/// Largest piece of one message (MPI counts are `int`); larger messages go in pieces, in order.
const MAX_PIECE: usize = 1 << 30;
/// How long shutdown waits for this rank's sends and the other ranks before it aborts the job.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest sleep of the communication thread when nothing moves (it wakes at once for a command
/// from this process; messages from other ranks wait at most this long to be noticed).
const MAX_IDLE_SLEEP: Duration = Duration::from_micros(200);
/// How long the thread keeps polling without sleeping after something moved.
const BUSY_WINDOW: Duration = Duration::from_micros(100);

enum Command {
    Send { to: usize, tag: Tag, bytes: Vec<u8> },
    AllGather { bytes: Vec<u8>, timeout: Duration, reply: Sender<Result<Vec<Vec<u8>>>> },
    Shutdown,
}

/// Where arriving messages go: an open inbox per tag, messages kept for tags not opened yet.
#[derive(Default)]
struct Mailbox {
    open: HashMap<Tag, Sender<Vec<u8>>>,
    waiting: HashMap<Tag, Vec<Vec<u8>>>,
    closed_before: u64,
}

impl Mailbox {
    fn deliver(&mut self, tag: Tag, bytes: Vec<u8>) {
        if tag.round < self.closed_before {
            return;
        }
        match self.open.get(&tag) {
            // A receiver that went away (its step ended) drops the message.
            Some(tx) => {
                let _ = tx.send(bytes);
            }
            None => self.waiting.entry(tag).or_default().push(bytes),
        }
    }
}

/// The MPI transport: see the module docs. Create it once per process with
/// [`MpiTransport::init`]; dropping the last handle finalises MPI.
pub struct MpiTransport {
    rank: usize,
    world_size: usize,
    commands: Sender<Command>,
    mailbox: Arc<Mutex<Mailbox>>,
    links: Vec<Option<LinkCost>>,
    clock_offset_s: f64,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for MpiTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiTransport").field("rank", &self.rank).field("world_size", &self.world_size).finish()
    }
}

/// What the communication thread measured at start-up.
struct Started {
    rank: usize,
    world_size: usize,
    links: Vec<Option<LinkCost>>,
    clock_offset_s: f64,
}

impl MpiTransport {
    /// Initialises MPI on a new communication thread, measures the latency and bandwidth between
    /// rank 0 and every other rank and every rank's clock offset, and returns the transport. Fails
    /// when MPI was already initialised in this process or cannot start.
    pub fn init() -> Result<Arc<MpiTransport>> {
        let (commands_tx, commands_rx) = channel::unbounded();
        let (started_tx, started_rx) = channel::bounded(1);
        let mailbox = Arc::new(Mutex::new(Mailbox::default()));
        let thread_mailbox = Arc::clone(&mailbox);
        let thread = std::thread::Builder::new()
            .name("conveyor-mpi".into())
            .spawn(move || comm_thread(commands_rx, thread_mailbox, started_tx))
            .map_err(|e| Error::Transport { rank: None, reason: format!("could not start the MPI thread: {e}") })?;
        let started = started_rx
            .recv()
            .map_err(|_| Error::Transport { rank: None, reason: "the MPI thread ended during start-up".into() })??;
        Ok(Arc::new(MpiTransport {
            rank: started.rank,
            world_size: started.world_size,
            commands: commands_tx,
            mailbox,
            links: started.links,
            clock_offset_s: started.clock_offset_s,
            thread: Mutex::new(Some(thread)),
        }))
    }

    fn stopped(&self) -> Error {
        Error::Transport { rank: Some(self.rank), reason: "the MPI communication thread has stopped".into() }
    }
}

impl Transport for MpiTransport {
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
        if to >= self.world_size || to == self.rank {
            return Err(Error::Transport {
                rank: Some(self.rank),
                reason: format!("cannot send to rank {to} of a world of {}", self.world_size),
            });
        }
        self.commands.send(Command::Send { to, tag, bytes }).map_err(|_| self.stopped())
    }
    fn inbox(&self, tag: Tag) -> Result<Receiver<Vec<u8>>> {
        let (tx, rx) = channel::unbounded();
        let mut mailbox = self.mailbox.lock();
        for bytes in mailbox.waiting.remove(&tag).unwrap_or_default() {
            let _ = tx.send(bytes);
        }
        if tag.round >= mailbox.closed_before {
            mailbox.open.insert(tag, tx);
        }
        Ok(rx)
    }
    fn close_rounds_before(&self, round: u64) {
        let mut mailbox = self.mailbox.lock();
        mailbox.closed_before = mailbox.closed_before.max(round);
        mailbox.open.retain(|tag, _| tag.round >= round);
        mailbox.waiting.retain(|tag, _| tag.round >= round);
    }
    fn all_gather(&self, bytes: Vec<u8>, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let (reply, answer) = channel::bounded(1);
        self.commands.send(Command::AllGather { bytes, timeout, reply }).map_err(|_| self.stopped())?;
        answer.recv().map_err(|_| self.stopped())?
    }
    fn link(&self, peer: usize) -> Option<LinkCost> {
        self.links.get(peer).copied().flatten()
    }
    fn clock_offset_s(&self) -> f64 {
        self.clock_offset_s
    }
    fn abort(&self, code: i32) -> ! {
        abort_job(code)
    }
}

/// `MPI_Abort` on the world: the launcher ends every rank. This is the one MPI call made outside
/// the communication thread; it does not return.
fn abort_job(code: i32) -> ! {
    // SAFETY: MPI_Abort takes the world communicator (a constant the library defines) and a code;
    // it ends the process, so nothing after it runs concurrently with the communication thread.
    unsafe {
        ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code);
    }
    std::process::exit(code)
}

impl Drop for MpiTransport {
    fn drop(&mut self) {
        // A panic unwinding through here must not wait in `MPI_Finalize` for ranks that are still
        // waiting for this one: end the job instead.
        if std::thread::panicking() {
            abort_job(70);
        }
        let _ = self.commands.send(Command::Shutdown);
        if let Some(thread) = self.thread.lock().take() {
            let _ = thread.join();
        }
    }
}

/// A send in flight: its request and the bytes it reads.
struct Sending {
    request: ffi::MPI_Request,
    _bytes: Vec<u8>,
}

/// An all-gather in flight: first every rank's length, then the bytes.
struct Gathering {
    request: ffi::MPI_Request,
    lengths: Vec<u64>,
    /// This rank's length, read by the first phase (boxed: it must not move while in flight).
    own_length: Box<u64>,
    own: Vec<u8>,
    received: Vec<u8>,
    counts: Vec<c_int>,
    displacements: Vec<c_int>,
    second_phase: bool,
    deadline: Instant,
    timeout: Duration,
    reply: Sender<Result<Vec<Vec<u8>>>>,
}

struct Comm {
    world: ffi::MPI_Comm,
    rank: usize,
    size: usize,
    mailbox: Arc<Mutex<Mailbox>>,
    sending: Vec<Sending>,
    gathering: Option<Gathering>,
    queued_gathers: std::collections::VecDeque<Command>,
    /// Pieces of a message from each rank that arrived in parts.
    partial: HashMap<usize, Vec<u8>>,
}

fn mpi_error(rank: usize, call: &str, code: c_int) -> Error {
    Error::Transport { rank: Some(rank), reason: format!("{call} failed with MPI error {code}") }
}

fn comm_thread(commands: Receiver<Command>, mailbox: Arc<Mutex<Mailbox>>, started: Sender<Result<Started>>) {
    let Some((universe, _threading)) = mpi::initialize_with_threading(mpi::Threading::Funneled) else {
        let _ = started.send(Err(Error::Transport {
            rank: None,
            reason: "MPI was already initialised in this process; create one MpiTransport per process".into(),
        }));
        return;
    };
    // SAFETY (for every `ffi` call below): MPI was initialised on this thread, which is the only
    // one that calls it (funneled); buffers passed to non-blocking calls are owned by the
    // `Sending` / `Gathering` that holds the request and live until it completes.
    let world = unsafe { ffi::RSMPI_COMM_WORLD };
    let (mut rank, mut size): (c_int, c_int) = (0, 0);
    unsafe {
        ffi::MPI_Comm_rank(world, &mut rank);
        ffi::MPI_Comm_size(world, &mut size);
    }
    let mut comm = Comm {
        world,
        rank: rank as usize,
        size: size as usize,
        mailbox,
        sending: Vec::new(),
        gathering: None,
        queued_gathers: Default::default(),
        partial: HashMap::new(),
    };
    let (links, clock_offset_s) = comm.measure();
    let _ = started.send(Ok(Started { rank: comm.rank, world_size: comm.size, links, clock_offset_s }));
    comm.serve(&commands);
    comm.shut_down();
    drop(universe);
}

/// `bytes` with a real allocation behind it even when empty: an empty `Vec`'s placeholder address
/// can equal the value Open MPI gives `MPI_IN_PLACE`, which an empty all-gather must not pass.
fn with_real_address(mut bytes: Vec<u8>) -> Vec<u8> {
    bytes.reserve(1);
    bytes
}

fn realtime_s() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// The line `t = latency + bytes / bandwidth` through `(bytes, seconds)` samples, by least squares
/// on the relative error (each residual divided by its sample's time): plain least squares would
/// let the largest messages' noise, a percent of milliseconds, swamp a latency of microseconds and
/// even make it negative. A fit with no positive slope or intercept (noise on a link whose latency
/// or bandwidth the sizes cannot resolve) falls back to the smallest sample's time as the latency
/// and the largest sample's time less it for the bandwidth.
fn fit_link(samples: &[(f64, f64)]) -> LinkCost {
    let (mut s, mut sx, mut sxx, mut st, mut sxt) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(x, t) in samples {
        let w = 1.0 / (t * t).max(1e-30);
        (s, sx, sxx, st, sxt) = (s + w, sx + w * x, sxx + w * x * x, st + w * t, sxt + w * x * t);
    }
    let det = s * sxx - sx * sx;
    let (slope, intercept) = ((s * sxt - sx * st) / det, (sxx * st - sx * sxt) / det);
    let smallest = samples.iter().min_by(|a, b| a.0.total_cmp(&b.0)).copied().unwrap_or((0.0, 1e-6));
    let largest = samples.iter().max_by(|a, b| a.0.total_cmp(&b.0)).copied().unwrap_or((1.0, 1e-6));
    let latency_s = if intercept.is_finite() && intercept > 0.0 { intercept } else { smallest.1.max(1e-9) };
    let bandwidth_bytes_per_s = if slope.is_finite() && slope > 0.0 {
        1.0 / slope
    } else {
        (largest.0 - smallest.0).max(1.0) / (largest.1 - latency_s).max(1e-9)
    };
    LinkCost { latency_s, bandwidth_bytes_per_s }
}

impl Comm {
    fn send_blocking(&self, to: usize, tag: c_int, bytes: &[u8]) {
        unsafe {
            ffi::MPI_Send(
                bytes.as_ptr() as *const c_void,
                bytes.len() as c_int,
                ffi::RSMPI_UINT8_T,
                to as c_int,
                tag,
                self.world,
            );
        }
    }

    fn recv_blocking(&self, from: usize, tag: c_int, bytes: &mut [u8]) {
        unsafe {
            ffi::MPI_Recv(
                bytes.as_mut_ptr() as *mut c_void,
                bytes.len() as c_int,
                ffi::RSMPI_UINT8_T,
                from as c_int,
                tag,
                self.world,
                ffi::RSMPI_STATUS_IGNORE,
            );
        }
    }

    /// Rank 0 against every other rank in turn: the clock offset (the exchange with the shortest
    /// round trip of eight) and the link, `t = latency + bytes / bandwidth` fitted by least squares
    /// ([`fit_link`]) to the one-way time (half the fastest of a few round trips) of each size in
    /// `PROBES`. Rank 0 then broadcasts them. About 8 ms a peer on the 2-core test machine.
    fn measure(&mut self) -> (Vec<Option<LinkCost>>, f64) {
        /// (bytes, round trips): more round trips for small messages, whose times vary more.
        const PROBES: [(usize, usize); 5] = [(8, 16), (64 << 10, 6), (256 << 10, 4), (1 << 20, 3), (4 << 20, 2)];
        let started = Instant::now();
        let mut table = vec![0.0f64; 3 * self.size];
        let mut small = [0u8; 8];
        let mut buffer = vec![0u8; if self.size > 1 { PROBES[PROBES.len() - 1].0 } else { 0 }];
        for peer in 1..self.size {
            if self.rank == 0 {
                let mut best = (f64::INFINITY, 0.0);
                for _ in 0..8 {
                    let t0 = realtime_s();
                    self.send_blocking(peer, PING_TAG, &t0.to_le_bytes());
                    self.recv_blocking(peer, PING_TAG, &mut small);
                    let t2 = realtime_s();
                    let t1 = f64::from_le_bytes(small);
                    if t2 - t0 < best.0 {
                        best = (t2 - t0, t1 - (t0 + t2) / 2.0);
                    }
                }
                let mut samples = [(0.0, 0.0); PROBES.len()];
                for (sample, &(bytes, round_trips)) in samples.iter_mut().zip(&PROBES) {
                    let mut one_way = f64::INFINITY;
                    for _ in 0..round_trips {
                        let t0 = Instant::now();
                        self.send_blocking(peer, PING_TAG, &buffer[..bytes]);
                        self.recv_blocking(peer, PING_TAG, &mut buffer[..bytes]);
                        one_way = one_way.min(t0.elapsed().as_secs_f64() / 2.0);
                    }
                    *sample = (bytes as f64, one_way);
                }
                let link = fit_link(&samples);
                tracing::debug!(peer, ?samples, ?link, "fitted the link to rank 0");
                table[3 * peer] = best.1;
                table[3 * peer + 1] = link.latency_s;
                table[3 * peer + 2] = link.bandwidth_bytes_per_s;
            } else if self.rank == peer {
                for _ in 0..8 {
                    self.recv_blocking(0, PING_TAG, &mut small);
                    self.send_blocking(0, PING_TAG, &realtime_s().to_le_bytes());
                }
                for &(bytes, round_trips) in &PROBES {
                    for _ in 0..round_trips {
                        self.recv_blocking(0, PING_TAG, &mut buffer[..bytes]);
                        self.send_blocking(0, PING_TAG, &buffer[..bytes]);
                    }
                }
            }
        }
        unsafe {
            ffi::MPI_Bcast(
                table.as_mut_ptr() as *mut c_void,
                (8 * table.len()) as c_int,
                ffi::RSMPI_UINT8_T,
                0,
                self.world,
            );
        }
        let links = (0..self.size)
            .map(|peer| {
                (peer != self.rank).then(|| {
                    // Every link is taken to be rank 0's to the farther of the two ranks.
                    let p = peer.max(self.rank).max(1);
                    LinkCost { latency_s: table[3 * p + 1], bandwidth_bytes_per_s: table[3 * p + 2] }
                })
            })
            .collect();
        tracing::debug!(rank = self.rank, elapsed_s = started.elapsed().as_secs_f64(), "measured the links");
        (links, table[3 * self.rank])
    }

    fn serve(&mut self, commands: &Receiver<Command>) {
        let mut last_activity = Instant::now();
        loop {
            let mut moved = false;
            loop {
                match commands.try_recv() {
                    Ok(Command::Shutdown) | Err(channel::TryRecvError::Disconnected) => return,
                    Ok(command) => {
                        self.take(command);
                        moved = true;
                    }
                    Err(channel::TryRecvError::Empty) => break,
                }
            }
            moved |= self.progress();
            if moved {
                last_activity = Instant::now();
                continue;
            }
            let idle = last_activity.elapsed();
            if idle < BUSY_WINDOW {
                std::thread::yield_now();
                continue;
            }
            let sleep = (idle / 4).min(MAX_IDLE_SLEEP);
            match commands.recv_timeout(sleep) {
                Ok(Command::Shutdown) | Err(channel::RecvTimeoutError::Disconnected) => return,
                Ok(command) => {
                    self.take(command);
                    last_activity = Instant::now();
                }
                Err(channel::RecvTimeoutError::Timeout) => {}
            }
        }
    }

    fn take(&mut self, command: Command) {
        match command {
            Command::Send { to, tag, bytes } => self.start_send(to, tag, &bytes),
            gather @ Command::AllGather { .. } => {
                self.queued_gathers.push_back(gather);
                self.start_next_gather();
            }
            Command::Shutdown => {}
        }
    }

    /// Posts a message as pieces of at most [`MAX_PIECE`] bytes, each headed by the tag and
    /// whether more pieces follow.
    fn start_send(&mut self, to: usize, tag: Tag, bytes: &[u8]) {
        let mut chunks: Vec<&[u8]> = bytes.chunks(MAX_PIECE).collect();
        if chunks.is_empty() {
            chunks.push(&[]);
        }
        let n = chunks.len();
        for (i, chunk) in chunks.into_iter().enumerate() {
            let mut piece = Vec::with_capacity(17 + chunk.len());
            piece.extend_from_slice(&tag.round.to_le_bytes());
            piece.extend_from_slice(&tag.channel.to_le_bytes());
            piece.push(u8::from(i + 1 < n));
            piece.extend_from_slice(chunk);
            let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
            unsafe {
                ffi::MPI_Isend(
                    piece.as_ptr() as *const c_void,
                    piece.len() as c_int,
                    ffi::RSMPI_UINT8_T,
                    to as c_int,
                    DATA_TAG,
                    self.world,
                    &mut request,
                );
            }
            self.sending.push(Sending { request, _bytes: piece });
        }
    }

    /// Moves everything one notch: tests sends, receives what has arrived, advances the
    /// collective. True if anything happened.
    fn progress(&mut self) -> bool {
        let mut moved = false;
        let before = self.sending.len();
        self.sending.retain_mut(|s| {
            let mut done: c_int = 0;
            unsafe { ffi::MPI_Test(&mut s.request, &mut done, ffi::RSMPI_STATUS_IGNORE) };
            done == 0
        });
        moved |= self.sending.len() != before;
        while self.receive_one() {
            moved = true;
        }
        moved |= self.advance_gather();
        moved
    }

    /// Receives one waiting message, if any, and delivers it.
    fn receive_one(&mut self) -> bool {
        let mut flag: c_int = 0;
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        unsafe { ffi::MPI_Iprobe(ffi::RSMPI_ANY_SOURCE, DATA_TAG, self.world, &mut flag, &mut status) };
        if flag == 0 {
            return false;
        }
        let mut count: c_int = 0;
        unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count) };
        let source = status.MPI_SOURCE as usize;
        let mut piece = vec![0u8; count.max(0) as usize];
        self.recv_blocking(source, DATA_TAG, &mut piece);
        if piece.len() < 17 {
            tracing::warn!(source, "dropped a malformed message");
            return true;
        }
        let tag = Tag {
            round: u64::from_le_bytes(piece[0..8].try_into().expect("eight bytes")),
            channel: u64::from_le_bytes(piece[8..16].try_into().expect("eight bytes")),
        };
        let more = piece[16] != 0;
        let body = &piece[17..];
        let buffer = self.partial.entry(source).or_default();
        buffer.extend_from_slice(body);
        if !more {
            let bytes = std::mem::take(buffer);
            self.partial.remove(&source);
            self.mailbox.lock().deliver(tag, bytes);
        }
        true
    }

    fn start_next_gather(&mut self) {
        if self.gathering.is_some() {
            return;
        }
        let Some(Command::AllGather { bytes, timeout, reply }) = self.queued_gathers.pop_front() else { return };
        if bytes.len() > c_int::MAX as usize {
            let _ = reply.send(Err(Error::Transport {
                rank: Some(self.rank),
                reason: format!("an all-gather of {} bytes is larger than MPI's 2 GiB count limit", bytes.len()),
            }));
            return;
        }
        let mut gathering = Gathering {
            request: unsafe { ffi::RSMPI_REQUEST_NULL },
            lengths: vec![0; self.size],
            own_length: Box::new(bytes.len() as u64),
            own: with_real_address(bytes),
            received: Vec::new(),
            counts: Vec::new(),
            displacements: Vec::new(),
            second_phase: false,
            deadline: Instant::now() + timeout,
            timeout,
            reply,
        };
        let rc = unsafe {
            ffi::MPI_Iallgather(
                &*gathering.own_length as *const u64 as *const c_void,
                8,
                ffi::RSMPI_UINT8_T,
                gathering.lengths.as_mut_ptr() as *mut c_void,
                8,
                ffi::RSMPI_UINT8_T,
                self.world,
                &mut gathering.request,
            )
        };
        if rc != 0 {
            let _ = gathering.reply.send(Err(mpi_error(self.rank, "MPI_Iallgather", rc)));
            return;
        }
        self.gathering = Some(gathering);
    }

    fn advance_gather(&mut self) -> bool {
        let Some(g) = self.gathering.as_mut() else { return false };
        let mut done: c_int = 0;
        unsafe { ffi::MPI_Test(&mut g.request, &mut done, ffi::RSMPI_STATUS_IGNORE) };
        if done == 0 {
            if Instant::now() > g.deadline {
                let g = self.gathering.take().expect("checked");
                let _ = g.reply.send(Err(Error::Transport {
                    rank: Some(self.rank),
                    reason: format!(
                        "another rank did not reach the same collective within {} s (stopped or failed)",
                        g.timeout.as_secs_f64()
                    ),
                }));
                // The collective cannot be cancelled; nothing more can be exchanged.
                self.queued_gathers.clear();
            }
            return false;
        }
        if !g.second_phase {
            let total: u64 = g.lengths.iter().sum();
            if total > c_int::MAX as u64 {
                let g = self.gathering.take().expect("checked");
                let _ = g.reply.send(Err(Error::Transport {
                    rank: Some(self.rank),
                    reason: format!("an all-gather of {total} bytes is larger than MPI's 2 GiB count limit"),
                }));
                return true;
            }
            g.counts = g.lengths.iter().map(|&l| l as c_int).collect();
            let mut offset = 0;
            g.displacements = g
                .counts
                .iter()
                .map(|&c| {
                    let d = offset;
                    offset += c;
                    d
                })
                .collect();
            g.received = with_real_address(vec![0u8; total as usize]);
            g.second_phase = true;
            let rc = unsafe {
                ffi::MPI_Iallgatherv(
                    g.own.as_ptr() as *const c_void,
                    g.own.len() as c_int,
                    ffi::RSMPI_UINT8_T,
                    g.received.as_mut_ptr() as *mut c_void,
                    g.counts.as_ptr(),
                    g.displacements.as_ptr(),
                    ffi::RSMPI_UINT8_T,
                    self.world,
                    &mut g.request,
                )
            };
            if rc != 0 {
                let g = self.gathering.take().expect("checked");
                let _ = g.reply.send(Err(mpi_error(self.rank, "MPI_Iallgatherv", rc)));
            }
            return true;
        }
        let g = self.gathering.take().expect("checked");
        let parts = g
            .counts
            .iter()
            .zip(&g.displacements)
            .map(|(&c, &d)| g.received[d as usize..(d + c) as usize].to_vec())
            .collect();
        let _ = g.reply.send(Ok(parts));
        self.start_next_gather();
        true
    }

    /// Completes this rank's sends and meets every other rank in a barrier, receiving (and
    /// dropping) what still arrives, so no rank finalises while another still sends to it. Past
    /// [`SHUTDOWN_TIMEOUT`] it aborts the job instead of waiting forever.
    fn shut_down(&mut self) {
        let deadline = Instant::now() + SHUTDOWN_TIMEOUT;
        if let Some(g) = self.gathering.take() {
            // A collective still in flight (its caller is gone): the ranks disagree; end the job.
            drop(g);
            abort_job(70);
        }
        while !self.sending.is_empty() {
            self.progress();
            if Instant::now() > deadline {
                abort_job(70);
            }
            std::thread::yield_now();
        }
        let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
        unsafe { ffi::MPI_Ibarrier(self.world, &mut request) };
        loop {
            let mut done: c_int = 0;
            unsafe { ffi::MPI_Test(&mut request, &mut done, ffi::RSMPI_STATUS_IGNORE) };
            if done != 0 {
                break;
            }
            while self.receive_one() {}
            if Instant::now() > deadline {
                abort_job(70);
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fit_link;

    #[test]
    fn the_fit_recovers_a_line_and_keeps_a_small_latency_under_noise() {
        let line = |x: f64| 2e-6 + x / 5e9;
        let sizes = [8.0, 65536.0, 262144.0, 1048576.0, 4194304.0];
        let exact: Vec<(f64, f64)> = sizes.iter().map(|&x| (x, line(x))).collect();
        let fit = fit_link(&exact);
        assert!((fit.latency_s - 2e-6).abs() < 1e-12 && (fit.bandwidth_bytes_per_s - 5e9).abs() < 1e-2, "{fit:?}");
        // One percent of noise on the large sizes: plain least squares would put the intercept
        // tens of microseconds off; the relative fit stays within a few percent of it.
        let noisy: Vec<(f64, f64)> =
            exact.iter().enumerate().map(|(i, &(x, t))| (x, t * if i % 2 == 0 { 1.01 } else { 0.99 })).collect();
        let fit = fit_link(&noisy);
        assert!((fit.latency_s - 2e-6).abs() < 0.1e-6, "{fit:?}");
        assert!((fit.bandwidth_bytes_per_s / 5e9 - 1.0).abs() < 0.03, "{fit:?}");
    }

    #[test]
    fn a_fit_without_a_positive_slope_falls_back_to_the_samples() {
        let flat = [(8.0, 1e-5), (1e6, 1e-5), (4e6, 0.9e-5)];
        let fit = fit_link(&flat);
        assert!(
            fit.latency_s > 0.0 && fit.bandwidth_bytes_per_s > 0.0 && fit.bandwidth_bytes_per_s.is_finite(),
            "{fit:?}"
        );
    }
}
