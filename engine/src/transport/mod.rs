//! How ranks of one training job talk: the [`Transport`] interface the runtime's cross-rank
//! messages, its commit vote and its gathers go through, the in-process transport (one rank: every
//! stage is a thread of this process, and messages between stages stay crossbeam channels of
//! tensors), and the MPI transport (one rank per pipeline device, or per device with tensor
//! parallelism; behind the `mpi` feature).
//!
//! `mod.rs` picks `mpi_enabled.rs` or `mpi_disabled.rs` with `#[path]`: **the one MPI switch
//! point**, as `device/mod.rs` is CUDA's. `README.md` beside this file argues why the MPI
//! transport cannot deadlock and how a failure on one rank ends the step on all.
use std::fmt;
use std::time::Duration;

use crossbeam::channel::Receiver;

use crate::Result;

#[cfg_attr(feature = "mpi", path = "mpi_enabled.rs")]
#[cfg_attr(not(feature = "mpi"), path = "mpi_disabled.rs")]
mod mpi_backend;
pub(crate) mod wire;

pub use mpi_backend::{MPI_BUILT, MpiTransport};

/// What a message is for. Messages with one tag from one rank arrive in the order they were sent;
/// a tag belongs to one round (one dispatched step or evaluation, numbered alike on every rank),
/// so messages of a round that ended are dropped instead of being read by a later one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tag {
    /// The round (the trainer's count of dispatched steps and evaluations).
    pub round: u64,
    /// The channel within the round (for stage links: from stage, to stage and direction).
    pub channel: u64,
}

/// The channel of a round's abort notices (see [`Transport::inbox`]).
pub const ABORT_CHANNEL: u64 = u64::MAX;

/// Which transport a job runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// Threads of one process; messages are channels of tensors.
    InProcess,
    /// One MPI rank per pipeline device.
    Mpi,
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransportKind::InProcess => "in-process",
            TransportKind::Mpi => "mpi",
        })
    }
}

/// The cost of moving bytes between two ranks, `t = latency + bytes / bandwidth`, as measured at
/// start-up ([`Transport::link`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkCost {
    /// Seconds for an empty message.
    pub latency_s: f64,
    /// Bytes per second.
    pub bandwidth_bytes_per_s: f64,
}

impl LinkCost {
    /// Seconds to move `bytes`.
    pub fn seconds(&self, bytes: u64) -> f64 {
        self.latency_s + bytes as f64 / self.bandwidth_bytes_per_s
    }
}

/// How the ranks of a job reach each other. The runtime moves a step's messages between ranks with
/// [`Transport::send`] and [`Transport::inbox`], agrees on the commit with
/// [`Transport::all_gather`], and gathers parameters, outputs and reports the same way; with one
/// rank ([`InProcess`]) it does none of that and keeps everything in channels of tensors.
///
/// Implementations never block in `send`, deliver messages with one tag from one rank in order,
/// and give every collective a deadline: a peer that stops answering ends the call with an error
/// instead of a hang.
pub trait Transport: Send + Sync + fmt::Debug {
    /// This process's rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// How many ranks the job has.
    fn world_size(&self) -> usize;
    /// Which transport this is.
    fn kind(&self) -> TransportKind;
    /// Sends `bytes` to rank `to` under `tag` and returns at once; the transport owns the bytes
    /// until they are delivered.
    fn send(&self, to: usize, tag: Tag, bytes: Vec<u8>) -> Result<()>;
    /// The receiving end of `tag`: every message sent under it, from any rank, including those that
    /// came before this call. Call once per tag.
    fn inbox(&self, tag: Tag) -> Result<Receiver<Vec<u8>>>;
    /// Ends every round before `round`: their inboxes close, their waiting messages are dropped and
    /// later messages for them are dropped on arrival.
    fn close_rounds_before(&self, round: u64);
    /// Every rank's `bytes`, rank 0 first. Every rank must call it, in the same order as its other
    /// collectives; a rank that does not call it within `timeout` makes it fail.
    fn all_gather(&self, bytes: Vec<u8>, timeout: Duration) -> Result<Vec<Vec<u8>>>;
    /// The measured cost of a message between this rank and `peer` (`None` for this rank, or when
    /// it was not measured).
    fn link(&self, peer: usize) -> Option<LinkCost>;
    /// This rank's clock minus rank 0's, in seconds, measured at start-up (0 on rank 0), so that
    /// timestamps of every rank can be put on one time line.
    fn clock_offset_s(&self) -> f64;
    /// Ends the whole job at once (every rank), with exit status `code`.
    fn abort(&self, code: i32) -> !;
}

/// The one-rank transport: every stage is a thread of this process. It sends nothing (the runtime
/// keeps messages between its stages in channels of tensors) and its collectives return at once.
#[derive(Debug, Default)]
pub struct InProcess;

impl Transport for InProcess {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn kind(&self) -> TransportKind {
        TransportKind::InProcess
    }
    fn send(&self, to: usize, _tag: Tag, _bytes: Vec<u8>) -> Result<()> {
        Err(crate::Error::invalid("transport", format!("the in-process transport has one rank; there is no rank {to}")))
    }
    fn inbox(&self, _tag: Tag) -> Result<Receiver<Vec<u8>>> {
        // Nothing is ever sent; the inbox stays empty (its sender is dropped).
        Ok(crossbeam::channel::never())
    }
    fn close_rounds_before(&self, _round: u64) {}
    fn all_gather(&self, bytes: Vec<u8>, _timeout: Duration) -> Result<Vec<Vec<u8>>> {
        Ok(vec![bytes])
    }
    fn link(&self, _peer: usize) -> Option<LinkCost> {
        None
    }
    fn clock_offset_s(&self) -> f64 {
        0.0
    }
    fn abort(&self, code: i32) -> ! {
        std::process::exit(code)
    }
}

/// The transport of this process, as `torch.distributed.init_process_group` sets a default
/// group: set once by [`init_process`], used by every trainer built without
/// [`crate::runtime::TrainerBuilder::transport`], and let go by [`finish_process`].
static PROCESS: parking_lot::Mutex<Option<std::sync::Arc<dyn Transport>>> = parking_lot::Mutex::new(None);

/// Makes `transport` this process's default transport (see [`process_transport`]); refused when
/// one is set already.
pub fn init_process(transport: std::sync::Arc<dyn Transport>) -> Result<()> {
    let mut process = PROCESS.lock();
    if process.is_some() {
        return Err(crate::Error::invalid("transport", "this process already has a transport; set it once"));
    }
    *process = Some(transport);
    Ok(())
}

/// This process's default transport: the one [`init_process`] set, else [`InProcess`].
pub fn process_transport() -> std::sync::Arc<dyn Transport> {
    PROCESS.lock().clone().unwrap_or_else(|| std::sync::Arc::new(InProcess))
}

/// Lets go of the process's transport; when no trainer holds it any more this finalises it (for
/// MPI: completes this rank's sends, meets every rank in a barrier and calls `MPI_Finalize`).
/// Every rank must call it at the end of the job, after dropping its trainers.
pub fn finish_process() {
    let transport = PROCESS.lock().take();
    drop(transport);
}

/// The world size an MPI launcher (`mpirun`, `mpiexec`, `srun` with PMI) gave this process, if
/// one started it: what `--transport auto` goes by.
pub fn launcher_world_size() -> Option<usize> {
    const LAUNCHED: [&str; 5] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK", "MPI_LOCALNRANKS"];
    const SIZE: [&str; 4] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS"];
    if !LAUNCHED.iter().any(|v| std::env::var_os(v).is_some()) {
        return None;
    }
    SIZE.iter().find_map(|v| std::env::var(v).ok()?.parse().ok())
}
