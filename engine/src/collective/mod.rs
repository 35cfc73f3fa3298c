//! Collectives over a group of devices: broadcast, scatter, gather, reduce, all-reduce,
//! all-gather, reduce-scatter and all-to-all on f32 buffers, behind one [`Communicator`] trait.
//!
//! # Design
//!
//! A group of `n` ranks is a set of handles, one per device, each used from its own thread (SPMD:
//! every rank calls the same collectives in the same order). [`ProcessGroup::new`] builds the
//! in-process implementation over crossbeam channels (host buffers, for CPU devices and as the host
//! fallback of GPU tensors); [`TransportGroup::new`] the same collectives for the ranks of a
//! [`crate::transport::Transport`] (one process per rank under MPI), with the same algorithms
//! (`algorithms.rs`), so the two agree bit for bit; NCCL implements the same trait. Every
//! collective names its buffers explicitly and writes in place, as NCCL and
//! MPI do, so a later backend needs no change of signature. How a buffer is divided among ranks is
//! a [`Partition`]: even (sizes within one element) or given counts (the `v` variants of MPI), so
//! lengths not divisible by `n` need no padding.
//!
//! All-reduce is the bandwidth-optimal ring: a reduce-scatter then an all-gather, each `n - 1`
//! steps in which every rank sends one chunk of about `1/n` of the buffer to its successor, so
//! each rank sends `2(n-1)/n` of the buffer whatever `n` is. Broadcast, scatter, gather and reduce
//! go directly between the root and each rank; all-to-all pairwise. [`traffic`] and [`cost_s`]
//! give each one's messages, bytes and time under `t = latency + bytes / bandwidth` for the
//! planner, and every handle counts the messages and bytes it sends ([`Communicator::traffic`]) so
//! tests can hold the implementation to the formula.
//!
//! Tensors enter through the `*_tensor` methods (`all_reduce_tensor`, `broadcast_tensor`,
//! `scatter_tensor`, `gather_tensor`, `all_gather_tensor`, `reduce_scatter_tensor`), which run
//! where the tensors live (`tensors.rs`): on CPU tensors the slice collective on their host
//! elements in place (the same call, the same bits); on GPU tensors the communicator's
//! [`DeviceCollectives`] when it has them (NCCL's rank, no host copy), and otherwise a host
//! fallback (copy to the host, the slice collective, copy back), so an in-process or transport
//! group serves GPU tensors too. The runtime's gradient sums and the tensor-parallel layers call
//! only these.
//!
//! The rejected alternative, a shared buffer behind a barrier that every rank reads and sums, is
//! simpler in process but has no counterpart on separate devices and moves `n` times the bytes
//! through one place. `README.md` beside this file argues why the in-process group cannot
//! deadlock and how failures end every rank's wait.
//!
//! ```
//! use conveyor_engine::Device;
//! use conveyor_engine::collective::{Communicator, ProcessGroup};
//! let devices: Vec<Device> = (0..3).map(Device::cpu).collect();
//! let handles = ProcessGroup::new(&devices)?;
//! let results: Vec<Vec<f32>> = std::thread::scope(|scope| {
//!     let threads: Vec<_> = handles
//!         .iter()
//!         .map(|handle| {
//!             scope.spawn(move || {
//!                 let mut buf = vec![handle.rank() as f32 + 1.0; 5];
//!                 handle.all_reduce(&mut buf).map(|()| buf)
//!             })
//!         })
//!         .collect();
//!     threads.into_iter().map(|t| t.join().unwrap()).collect::<Result<_, _>>()
//! })?;
//! assert!(results.iter().all(|r| r == &vec![6.0; 5]));
//! # Ok::<(), conveyor_engine::Error>(())
//! ```
mod algorithms;
mod cost;
mod direct;
mod in_process;
mod over_transport;
mod partition;
mod tensors;

use std::fmt;

pub use cost::{Traffic, cost_s, traffic};
pub use in_process::{DEFAULT_TIMEOUT, GroupAbort, ProcessGroup, RankHandle};
pub use over_transport::{COLLECTIVE_ROUND_BASE, TransportGroup, interrupt_waits, resume_waits};
pub use partition::Partition;
pub use tensors::DeviceCollectives;

use crate::{Device, Result, Tensor};

/// The collectives, for cost queries and for tagging messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CollectiveOp {
    /// The root's buffer copied to every rank.
    Broadcast,
    /// The root's buffer split by a partition, one part to each rank.
    Scatter,
    /// Each rank's part concatenated on the root.
    Gather,
    /// The elementwise sum of every rank's buffer, on the root.
    Reduce,
    /// The elementwise sum of every rank's buffer, on every rank.
    AllReduce,
    /// Each rank's part concatenated on every rank.
    AllGather,
    /// The elementwise sum of every rank's buffer, each rank keeping its part.
    ReduceScatter,
    /// Each rank sends a part to every rank (its own included).
    AllToAll,
}

impl CollectiveOp {
    /// Every collective.
    pub const ALL: [CollectiveOp; 8] = [
        CollectiveOp::Broadcast,
        CollectiveOp::Scatter,
        CollectiveOp::Gather,
        CollectiveOp::Reduce,
        CollectiveOp::AllReduce,
        CollectiveOp::AllGather,
        CollectiveOp::ReduceScatter,
        CollectiveOp::AllToAll,
    ];

    /// The snake-case name, e.g. `all_reduce`.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveOp::Broadcast => "broadcast",
            CollectiveOp::Scatter => "scatter",
            CollectiveOp::Gather => "gather",
            CollectiveOp::Reduce => "reduce",
            CollectiveOp::AllReduce => "all_reduce",
            CollectiveOp::AllGather => "all_gather",
            CollectiveOp::ReduceScatter => "reduce_scatter",
            CollectiveOp::AllToAll => "all_to_all",
        }
    }
}

impl fmt::Display for CollectiveOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One rank's end of a group of `n_ranks()` ranks. Every rank must call the same collectives in
/// the same order with matching arguments (the root, the partitions); a rank that fails (bad
/// arguments, a budget overrun, a timeout) makes every other rank's pending and later collectives
/// fail too, with [`crate::Error::CollectiveAborted`], until the group is recovered.
///
/// Sums are in f32; the ring adds in an order that depends on the chunk, so all-reduce agrees with
/// a sequential sum to rounding, and every rank receives bit-identical results.
pub trait Communicator: Send + Sync + fmt::Debug {
    /// This rank, `0..n_ranks()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn n_ranks(&self) -> usize;

    /// The device this rank's buffers live on (received messages count against its budget).
    fn device(&self) -> &Device;

    /// Messages and payload bytes this rank has sent since creation or the last reset.
    fn traffic(&self) -> Traffic;

    /// Sets the sent-traffic counters to zero.
    fn reset_traffic(&self);

    /// Copies `buf` on `root` into `buf` on every rank (all `buf`s of one length).
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()>;

    /// Sums `buf` over ranks into `buf` on `root` (in rank order); other ranks' `buf` is unchanged.
    fn reduce(&self, buf: &mut [f32], root: usize) -> Result<()>;

    /// Sums `buf` over ranks into `buf` on every rank (ring; all `buf`s of one length).
    fn all_reduce(&self, buf: &mut [f32]) -> Result<()>;

    /// Rank `r` receives `send[parts.range(r)]` of `root`'s `send` (`parts.total()` elements) into
    /// `recv` (`parts.len(r)` elements). `send` is ignored off the root.
    fn scatter(&self, send: &[f32], recv: &mut [f32], root: usize, parts: &Partition) -> Result<()>;

    /// `root`'s `recv` (`parts.total()` elements) receives rank `r`'s `send` (`parts.len(r)`
    /// elements) at `parts.range(r)`. `recv` is ignored off the root.
    fn gather(&self, send: &[f32], recv: &mut [f32], root: usize, parts: &Partition) -> Result<()>;

    /// Every rank's `recv` (`parts.total()`) receives rank `r`'s `send` (`parts.len(r)`) at
    /// `parts.range(r)` (ring).
    fn all_gather(&self, send: &[f32], recv: &mut [f32], parts: &Partition) -> Result<()>;

    /// Sums `send` (`parts.total()` elements on every rank) over ranks; rank `r` keeps
    /// `parts.range(r)` of the sum in `recv` (ring).
    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32], parts: &Partition) -> Result<()>;

    /// Rank `r` sends `send[send_parts.range(d)]` to each rank `d` and receives rank `s`'s part for
    /// it into `recv[recv_parts.range(s)]`; rank `s`'s `send_parts.len(r)` must equal rank `r`'s
    /// `recv_parts.len(s)`.
    fn all_to_all(&self, send: &[f32], send_parts: &Partition, recv: &mut [f32], recv_parts: &Partition) -> Result<()>;

    /// Collectives on buffers already on this rank's GPU, when the communicator has them (NCCL's
    /// rank); `None` (the default) sends GPU tensors through the host (`tensors.rs`).
    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        None
    }

    /// [`Communicator::all_reduce`] on an f32 tensor's elements, where they live: in place on a
    /// CPU tensor's host elements (exactly the slice call), on the GPU buffer with NCCL, or
    /// through host copies otherwise (see `tensors.rs`). So it is for every tensor collective.
    fn all_reduce_tensor(&self, tensor: &mut Tensor) -> Result<()> {
        tensors::all_reduce(self, tensor)
    }

    /// [`Communicator::broadcast`] on an f32 tensor's elements, where they live.
    fn broadcast_tensor(&self, tensor: &mut Tensor, root: usize) -> Result<()> {
        tensors::broadcast(self, tensor, root)
    }

    /// [`Communicator::scatter`] on f32 tensors, where they live (`send` is needed on the root only).
    fn scatter_tensor(&self, send: Option<&Tensor>, recv: &mut Tensor, root: usize, parts: &Partition) -> Result<()> {
        tensors::scatter(self, send, recv, root, parts)
    }

    /// [`Communicator::gather`] on f32 tensors, where they live (`recv` is needed on the root only).
    fn gather_tensor(&self, send: &Tensor, recv: Option<&mut Tensor>, root: usize, parts: &Partition) -> Result<()> {
        tensors::gather(self, send, recv, root, parts)
    }

    /// [`Communicator::all_gather`] on f32 tensors, where they live.
    fn all_gather_tensor(&self, send: &Tensor, recv: &mut Tensor, parts: &Partition) -> Result<()> {
        tensors::all_gather(self, send, recv, parts)
    }

    /// [`Communicator::reduce_scatter`] on f32 tensors, where they live.
    fn reduce_scatter_tensor(&self, send: &Tensor, recv: &mut Tensor, parts: &Partition) -> Result<()> {
        tensors::reduce_scatter(self, send, recv, parts)
    }
}
