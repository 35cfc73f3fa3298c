//! The NCCL [`Communicator`] (the `nccl` feature): one rank per GPU of a single process, created
//! together by `ncclCommInitAll`, each rank used from its own thread on its own stream.
//!
//! # Design
//!
//! The rank implements both sides of the collectives. [`DeviceCollectives`] takes buffers already on
//! the rank's GPU (a tensor's elements, reached through `Communicator::all_reduce_tensor` and the
//! other tensor collectives): it waits for the calling thread's stream (the tensors' producers),
//! issues the NCCL operations on the rank's stream and waits for them, with no host copy. The
//! trait's slice collectives take host `f32` slices, so each such call uploads its operands to
//! device buffers counted on the rank's ledger, runs the same NCCL operations, and downloads the
//! result. NCCL has
//! native broadcast, reduce, all-reduce, and all-gather / reduce-scatter for equal parts; scatter,
//! gather and all-to-all are grouped point-to-point sends and receives (NCCL's documented
//! recipes), and all-gather / reduce-scatter over unequal parts are grouped broadcasts / reduces,
//! one rooted at each rank. A rank never sends to itself: its own part is copied on the host.
//!
//! NCCL has no way for one rank to tell its peers that it failed. A rank whose arguments are
//! invalid returns its error before issuing anything, and its peers' operations then wait; every
//! wait is bounded by the group's timeout ([`DEFAULT_TIMEOUT`]), after which the rank aborts its
//! NCCL communicator (`ncclCommAbort`, which ends its pending operations), reports
//! `Error::CollectiveFailed`, and refuses later collectives: build a new group to recover.
//! [`group_abortable`] also returns a [`GroupAbort`] that a thread outside the group (a worker
//! abandoning its step) uses to end those waits early: every rank polls the group's flag while
//! it waits, and a rank that sees it set aborts its communicator the same way and reports
//! `Error::CollectiveAborted`; a rank that has not started its call refuses it.
//!
//! [`Communicator::traffic`] counts, per completed collective, the messages and bytes of the
//! planner's model (`collective::traffic`), not NCCL's internal algorithm, which is not observable.
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream as RawStream;
use cudarc::nccl::{Comm, ReduceOp, group_end, group_start, result::NcclError};

use super::backend::{CudaBuffer, CudaDevice};
use crate::collective::{
    CollectiveOp, Communicator, DEFAULT_TIMEOUT, DeviceCollectives, GroupAbort, Partition, Traffic, traffic,
};
use crate::{Device, Error, Result};

/// How often a waiting rank polls its stream for completion.
const COMPLETION_POLL: Duration = Duration::from_micros(200);

/// An NCCL communicator that may move between threads. NCCL allows a communicator to be used from
/// any thread as long as calls on it are not concurrent; [`NcclRank`] keeps it behind a mutex.
struct CommCell(Comm);

// SAFETY: `Comm` holds an `ncclComm_t` (a raw pointer, hence not `Send`) and an `Arc<CudaStream>`;
// NCCL communicators are not tied to the creating thread, and the mutex in `NcclRank` serialises
// every call on one.
unsafe impl Send for CommCell {}

/// Builds one NCCL rank per device (`devices[r]` is rank `r`; every device a different GPU), and
/// the handle that aborts the group from outside (see the module docs).
pub(crate) fn group_abortable(devices: &[Device]) -> Result<(Vec<Box<dyn Communicator>>, GroupAbort)> {
    if devices.is_empty() {
        return Err(Error::invalid("NCCL group devices", "empty: a group needs at least one device"));
    }
    let mut cuda_devices = Vec::with_capacity(devices.len());
    for device in devices {
        match device {
            Device::Cuda(cuda) => cuda_devices.push(cuda.clone()),
            Device::Cpu(_) => {
                return Err(Error::invalid(
                    "NCCL group devices",
                    format!("{device}: NCCL serves CUDA devices; CPU groups use collective::ProcessGroup"),
                ));
            }
        }
    }
    for (rank, cuda) in cuda_devices.iter().enumerate() {
        if let Some(other) = cuda_devices[..rank].iter().position(|c| c.ordinal() == cuda.ordinal()) {
            return Err(Error::invalid(
                "NCCL group devices",
                format!("ranks {other} and {rank} are both cuda:{}; NCCL needs one GPU per rank", cuda.ordinal()),
            ));
        }
    }
    // SAFETY: only a dlopen probe.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(Error::CudaUnavailable(
            "an NCCL group was requested, but libnccl was not found; install NCCL (or PyPI's nvidia-nccl-cu12) \
             and put its library directory on LD_LIBRARY_PATH"
                .to_string(),
        ));
    }
    let streams = cuda_devices
        .iter()
        .map(|cuda| {
            cuda.context().new_stream().map_err(|err| {
                Error::CudaUnavailable(format!("cuda:{}: creating a stream failed: {err}", cuda.ordinal()))
            })
        })
        .collect::<Result<Vec<Arc<RawStream>>>>()?;
    let comms = Comm::from_devices(streams.clone()).map_err(|err| {
        Error::CudaUnavailable(format!("ncclCommInitAll over {} GPUs failed: {:?}", devices.len(), err.0))
    })?;
    let n_ranks = devices.len();
    let aborted = Arc::new(AtomicBool::new(false));
    let ranks = comms
        .into_iter()
        .zip(cuda_devices)
        .zip(streams)
        .enumerate()
        .map(|(rank, ((comm, cuda), stream))| {
            Box::new(NcclRank {
                rank,
                n_ranks,
                device: Device::Cuda(cuda.clone()),
                cuda,
                stream,
                comm: Mutex::new(Some(CommCell(comm))),
                traffic: Mutex::new(Traffic::default()),
                timeout: DEFAULT_TIMEOUT,
                aborted: Arc::clone(&aborted),
            }) as Box<dyn Communicator>
        })
        .collect();
    Ok((ranks, GroupAbort::flag(aborted)))
}

/// One rank of an NCCL group.
struct NcclRank {
    rank: usize,
    n_ranks: usize,
    device: Device,
    cuda: CudaDevice,
    stream: Arc<RawStream>,
    /// `None` once the communicator was aborted after a failure.
    comm: Mutex<Option<CommCell>>,
    traffic: Mutex<Traffic>,
    timeout: Duration,
    /// Set from outside the group to end its waits ([`group_abortable`]).
    aborted: Arc<AtomicBool>,
}

impl std::fmt::Debug for NcclRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclRank({} of {} on {})", self.rank, self.n_ranks, self.device)
    }
}

/// What one collective call needs: its name, its rank's handle and the communicator, and whether
/// it has issued NCCL work yet (after which a failure must abort the communicator).
struct Call<'a> {
    op: CollectiveOp,
    rank: &'a NcclRank,
    comm: &'a Comm,
    issued: Cell<bool>,
}

impl Call<'_> {
    fn failed(&self, reason: impl Into<String>) -> Error {
        Error::CollectiveFailed {
            op: self.op.name().to_string(),
            rank: self.rank.rank,
            n_ranks: self.rank.n_ranks,
            reason: reason.into(),
        }
    }

    fn nccl<T>(&self, what: &str, outcome: std::result::Result<T, NcclError>) -> Result<()> {
        self.issued.set(true);
        outcome.map(drop).map_err(|err| self.failed(format!("NCCL {what} failed: {:?}", err.0)))
    }

    fn check_len(&self, what: &str, expected: usize, got: usize) -> Result<()> {
        if expected != got {
            return Err(self.failed(format!("{what} has {got} elements where {expected} were expected")));
        }
        Ok(())
    }

    fn check_root(&self, root: usize) -> Result<i32> {
        if root >= self.rank.n_ranks {
            return Err(self.failed(format!("root {root} is not a rank of this group of {}", self.rank.n_ranks)));
        }
        Ok(root as i32)
    }

    fn upload(&self, host: &[f32]) -> Result<CudaBuffer<f32>> {
        CudaBuffer::from_host(&self.rank.cuda, &self.rank.stream, host)
    }

    fn zeros(&self, len: usize) -> Result<CudaBuffer<f32>> {
        CudaBuffer::zeros(&self.rank.cuda, &self.rank.stream, len)
    }

    /// Issues `body`'s NCCL calls as one group (NCCL starts none until the group ends).
    fn grouped(&self, body: impl FnOnce() -> Result<()>) -> Result<()> {
        self.nccl("group start", group_start())?;
        let issued = body();
        let ended = self.nccl("group end", group_end());
        issued.and(ended)
    }

    /// Waits, at most the group's timeout, for everything issued on the rank's stream.
    fn wait(&self) -> Result<()> {
        let stream = &self.rank.stream;
        let done = stream.record_event(None).map_err(|err| self.failed(format!("recording completion: {err}")))?;
        let deadline = Instant::now() + self.rank.timeout;
        loop {
            if self.rank.aborted.load(Ordering::Acquire) {
                return Err(self.rank.aborted_error(self.op));
            }
            match done.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) if Instant::now() < deadline => std::thread::sleep(COMPLETION_POLL),
                Ok(false) => {
                    return Err(self.failed(format!(
                        "NCCL did not complete within {:?}; did every rank call {} with matching arguments?",
                        self.rank.timeout, self.op
                    )));
                }
                Err(err) => return Err(self.failed(format!("the GPU reported {err}"))),
            }
        }
    }

    /// Copies `src` into `host` (the stream was waited for).
    fn download(&self, src: &CudaBuffer<f32>, host: &mut [f32]) -> Result<()> {
        if host.is_empty() {
            return Ok(());
        }
        let stream = &self.rank.stream;
        stream
            .memcpy_dtoh(&src.slice.slice(..host.len()), host)
            .map_err(|err| self.failed(format!("download: {err}")))?;
        stream.synchronize().map_err(|err| self.failed(format!("download: {err}")))
    }
}

impl NcclRank {
    /// The error of a call that the group's abort flag ended or refused.
    fn aborted_error(&self, op: CollectiveOp) -> Error {
        Error::CollectiveAborted {
            op: op.name().to_string(),
            rank: self.rank,
            failed_rank: self.rank,
            reason: "the NCCL group was aborted from outside (a step was abandoned); build a new group".into(),
        }
    }

    /// Runs one collective on `bytes` (as `collective::traffic` counts them): refuses on an aborted
    /// communicator, aborts it when the body fails after issuing NCCL work, counts the traffic.
    fn run(&self, op: CollectiveOp, bytes: usize, body: impl FnOnce(&Call<'_>) -> Result<()>) -> Result<()> {
        let mut guard = self.comm.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if self.aborted.load(Ordering::Acquire) {
            // Whatever it had issued is ended with the communicator.
            *guard = None;
            return Err(self.aborted_error(op));
        }
        let Some(CommCell(comm)) = guard.as_ref() else {
            return Err(Error::CollectiveFailed {
                op: op.name().to_string(),
                rank: self.rank,
                n_ranks: self.n_ranks,
                reason: "this rank's NCCL communicator was aborted after an earlier failure; build a new group".into(),
            });
        };
        if let Err(err) = self.cuda.context().bind_to_thread() {
            return Err(Error::CollectiveFailed {
                op: op.name().to_string(),
                rank: self.rank,
                n_ranks: self.n_ranks,
                reason: format!("binding cuda:{}: {err}", self.cuda.ordinal()),
            });
        }
        let call = Call { op, rank: self, comm, issued: Cell::new(false) };
        let outcome = body(&call);
        match &outcome {
            Ok(()) => {
                let sent = traffic(op, (bytes * size_of::<f32>()) as u64, self.n_ranks);
                let mut total = self.traffic.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                total.messages += sent.messages;
                total.bytes += sent.bytes;
            }
            // A failure after NCCL work was issued may leave it pending, which only an abort
            // (dropping the communicator) ends; invalid arguments are found before anything is issued.
            Err(_) if call.issued.get() => *guard = None,
            Err(_) => {}
        }
        outcome
    }
}

/// Grouped point-to-point sends of `send[parts.range(peer)]` to each `peer` in `peers` with a
/// non-empty part (the caller is inside a group).
fn send_each_part(
    call: &Call<'_>,
    send: &CudaBuffer<f32>,
    parts: &Partition,
    peers: impl Iterator<Item = usize>,
) -> Result<()> {
    for peer in peers.filter(|&p| parts.len(p) > 0) {
        call.nccl("send", call.comm.send(&send.slice.slice(parts.range(peer)), peer as i32))?;
    }
    Ok(())
}

/// Grouped point-to-point receives into `recv[parts.range(peer)]` from each `peer` in `peers`
/// with a non-empty part (the caller is inside a group).
fn recv_each_part(
    call: &Call<'_>,
    recv: &mut CudaBuffer<f32>,
    parts: &Partition,
    peers: impl Iterator<Item = usize>,
) -> Result<()> {
    for peer in peers.filter(|&p| parts.len(p) > 0) {
        call.nccl("recv", call.comm.recv(&mut recv.slice.slice_mut(parts.range(peer)), peer as i32))?;
    }
    Ok(())
}

/// True when every part of `parts` has the same length (NCCL's all-gather and reduce-scatter).
fn equal_parts(parts: &Partition) -> bool {
    (0..parts.n_ranks()).all(|r| parts.len(r) == parts.len(0))
}

impl Call<'_> {
    /// Checks that a tensor's buffer lives on this rank's GPU.
    fn check_buffer(&self, what: &str, buffer: &CudaBuffer<f32>) -> Result<()> {
        if buffer.device().ordinal() != self.rank.cuda.ordinal() {
            return Err(self.failed(format!(
                "{what} lives on cuda:{}, but this rank is cuda:{}",
                buffer.device().ordinal(),
                self.rank.cuda.ordinal()
            )));
        }
        Ok(())
    }

    /// Waits for the work this thread queued on the GPU (a tensor's producers) before NCCL reads
    /// or writes its buffers on the rank's stream.
    fn settle(&self) -> Result<()> {
        let stream = self.rank.cuda.thread_stream()?;
        stream.synchronize()
    }

    /// Copies `src[from]` into `dst[to]` (equal lengths) on the rank's stream and waits.
    fn copy_on_gpu(
        &self,
        src: &CudaBuffer<f32>,
        from: std::ops::Range<usize>,
        dst: &mut CudaBuffer<f32>,
        to: std::ops::Range<usize>,
    ) -> Result<()> {
        if from.is_empty() {
            return Ok(());
        }
        self.rank
            .stream
            .memcpy_dtod(&src.slice.slice(from), &mut dst.slice.slice_mut(to))
            .map_err(|err| self.failed(format!("copying this rank's own part: {err}")))?;
        self.wait()
    }

    /// The NCCL part of a broadcast of `buf` (not empty) from `root`.
    fn broadcast_on(&self, buf: &mut CudaBuffer<f32>, root: i32) -> Result<()> {
        self.nccl("broadcast", self.comm.broadcast_in_place(&mut buf.slice, root))?;
        self.wait()
    }

    /// The NCCL part of an all-reduce of `buf` (not empty).
    fn all_reduce_on(&self, buf: &mut CudaBuffer<f32>) -> Result<()> {
        self.nccl("all_reduce", self.comm.all_reduce_in_place(&mut buf.slice, &ReduceOp::Sum))?;
        self.wait()
    }

    /// The NCCL part of a scatter: the root sends every other rank its part of `send`; another
    /// rank receives its part into `recv` (when not empty). Own parts are the caller's.
    fn scatter_on(
        &self,
        send: Option<&CudaBuffer<f32>>,
        recv: Option<&mut CudaBuffer<f32>>,
        root: usize,
        parts: &Partition,
    ) -> Result<()> {
        let n_ranks = self.rank.n_ranks;
        if let Some(send) = send {
            self.grouped(|| send_each_part(self, send, parts, (0..n_ranks).filter(|&r| r != root)))?;
        } else if let Some(recv) = recv {
            let len = recv.len();
            self.grouped(|| self.nccl("recv", self.comm.recv(&mut recv.slice.slice_mut(..len), root as i32)))?;
        }
        self.wait()
    }

    /// The NCCL part of a gather: another rank sends `send` (when not empty) to the root; the
    /// root receives every other rank's part into `recv`. Own parts are the caller's.
    fn gather_on(
        &self,
        send: Option<&CudaBuffer<f32>>,
        recv: Option<&mut CudaBuffer<f32>>,
        root: usize,
        parts: &Partition,
    ) -> Result<()> {
        let n_ranks = self.rank.n_ranks;
        if let Some(recv) = recv {
            self.grouped(|| recv_each_part(self, recv, parts, (0..n_ranks).filter(|&r| r != root)))?;
        } else if let Some(send) = send {
            let len = send.len();
            self.grouped(|| self.nccl("send", self.comm.send(&send.slice.slice(..len), root as i32)))?;
        }
        self.wait()
    }

    /// The NCCL part of an all-gather of `send` into `recv` (not empty).
    fn all_gather_on(&self, send: &CudaBuffer<f32>, recv: &mut CudaBuffer<f32>, parts: &Partition) -> Result<()> {
        let len = send.len();
        if equal_parts(parts) {
            let outcome = self.comm.all_gather(&send.slice.slice(..len), &mut recv.slice);
            self.nccl("all_gather", outcome)?;
        } else {
            // allgatherv: one broadcast rooted at each rank, into that rank's part.
            self.grouped(|| {
                for root in (0..self.rank.n_ranks).filter(|&r| parts.len(r) > 0) {
                    let own = (root == self.rank.rank).then(|| send.slice.slice(..len));
                    let mut target = recv.slice.slice_mut(parts.range(root));
                    self.nccl("broadcast", self.comm.broadcast(own.as_ref(), &mut target, root as i32))?;
                }
                Ok(())
            })?;
        }
        self.wait()
    }

    /// The NCCL part of a reduce-scatter of `send` (not empty) into `recv`.
    fn reduce_scatter_on(&self, send: &CudaBuffer<f32>, recv: &mut CudaBuffer<f32>, parts: &Partition) -> Result<()> {
        let len = recv.len();
        if equal_parts(parts) {
            let outcome = self.comm.reduce_scatter(&send.slice, &mut recv.slice, &ReduceOp::Sum);
            self.nccl("reduce_scatter", outcome)?;
        } else {
            // reduce_scatter_v: one reduce rooted at each rank, of that rank's part.
            self.grouped(|| {
                for root in (0..self.rank.n_ranks).filter(|&r| parts.len(r) > 0) {
                    let part = send.slice.slice(parts.range(root));
                    let mut own = (root == self.rank.rank).then(|| recv.slice.slice_mut(..len));
                    self.nccl("reduce", self.comm.reduce(&part, own.as_mut(), &ReduceOp::Sum, root as i32))?;
                }
                Ok(())
            })?;
        }
        self.wait()
    }
}

impl Communicator for NcclRank {
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
        *self.traffic.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn reset_traffic(&self) {
        *self.traffic.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Traffic::default();
    }

    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        Some(self)
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        self.run(CollectiveOp::Broadcast, buf.len(), |call| {
            let root = call.check_root(root)?;
            if buf.is_empty() {
                return Ok(());
            }
            let mut device = call.upload(buf)?;
            call.broadcast_on(&mut device, root)?;
            call.download(&device, buf)
        })
    }

    fn reduce(&self, buf: &mut [f32], root: usize) -> Result<()> {
        self.run(CollectiveOp::Reduce, buf.len(), |call| {
            let root_rank = call.check_root(root)?;
            if buf.is_empty() {
                return Ok(());
            }
            let mut device = call.upload(buf)?;
            call.nccl("reduce", call.comm.reduce_in_place(&mut device.slice, &ReduceOp::Sum, root_rank))?;
            call.wait()?;
            if self.rank == root { call.download(&device, buf) } else { Ok(()) }
        })
    }

    fn all_reduce(&self, buf: &mut [f32]) -> Result<()> {
        self.run(CollectiveOp::AllReduce, buf.len(), |call| {
            if buf.is_empty() {
                return Ok(());
            }
            let mut device = call.upload(buf)?;
            call.all_reduce_on(&mut device)?;
            call.download(&device, buf)
        })
    }

    fn scatter(&self, send: &[f32], recv: &mut [f32], root: usize, parts: &Partition) -> Result<()> {
        self.run(CollectiveOp::Scatter, parts.total(), |call| {
            call.check_root(root)?;
            parts.check_ranks("scatter", self.n_ranks)?;
            call.check_len("recv", parts.len(self.rank), recv.len())?;
            if self.rank == root {
                call.check_len("the root's send", parts.total(), send.len())?;
                let device_send = call.upload(send)?;
                call.scatter_on(Some(&device_send), None, root, parts)?;
                recv.copy_from_slice(&send[parts.range(root)]);
                return Ok(());
            }
            if recv.is_empty() {
                return Ok(());
            }
            let mut device_recv = call.zeros(recv.len())?;
            call.scatter_on(None, Some(&mut device_recv), root, parts)?;
            call.download(&device_recv, recv)
        })
    }

    fn gather(&self, send: &[f32], recv: &mut [f32], root: usize, parts: &Partition) -> Result<()> {
        self.run(CollectiveOp::Gather, parts.total(), |call| {
            call.check_root(root)?;
            parts.check_ranks("gather", self.n_ranks)?;
            call.check_len("send", parts.len(self.rank), send.len())?;
            if self.rank != root {
                if send.is_empty() {
                    return Ok(());
                }
                let device_send = call.upload(send)?;
                return call.gather_on(Some(&device_send), None, root, parts);
            }
            call.check_len("the root's recv", parts.total(), recv.len())?;
            let mut device_recv = call.zeros(recv.len())?;
            call.gather_on(None, Some(&mut device_recv), root, parts)?;
            call.download(&device_recv, recv)?;
            recv[parts.range(root)].copy_from_slice(send);
            Ok(())
        })
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32], parts: &Partition) -> Result<()> {
        self.run(CollectiveOp::AllGather, parts.total(), |call| {
            parts.check_ranks("all_gather", self.n_ranks)?;
            call.check_len("send", parts.len(self.rank), send.len())?;
            call.check_len("recv", parts.total(), recv.len())?;
            if recv.is_empty() {
                return Ok(());
            }
            let device_send = call.upload(send)?;
            let mut device_recv = call.zeros(recv.len())?;
            call.all_gather_on(&device_send, &mut device_recv, parts)?;
            call.download(&device_recv, recv)
        })
    }

    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32], parts: &Partition) -> Result<()> {
        self.run(CollectiveOp::ReduceScatter, parts.total(), |call| {
            parts.check_ranks("reduce_scatter", self.n_ranks)?;
            call.check_len("send", parts.total(), send.len())?;
            call.check_len("recv", parts.len(self.rank), recv.len())?;
            if send.is_empty() {
                return Ok(());
            }
            let device_send = call.upload(send)?;
            let mut device_recv = call.zeros(recv.len())?;
            call.reduce_scatter_on(&device_send, &mut device_recv, parts)?;
            call.download(&device_recv, recv)
        })
    }

    fn all_to_all(&self, send: &[f32], send_parts: &Partition, recv: &mut [f32], recv_parts: &Partition) -> Result<()> {
        self.run(CollectiveOp::AllToAll, send_parts.total(), |call| {
            send_parts.check_ranks("all_to_all send", self.n_ranks)?;
            recv_parts.check_ranks("all_to_all recv", self.n_ranks)?;
            call.check_len("send", send_parts.total(), send.len())?;
            call.check_len("recv", recv_parts.total(), recv.len())?;
            call.check_len("this rank's part for itself", send_parts.len(self.rank), recv_parts.len(self.rank))?;
            let device_send = call.upload(send)?;
            let mut device_recv = call.zeros(recv.len())?;
            let peers = || (0..self.n_ranks).filter(|&r| r != self.rank);
            call.grouped(|| {
                send_each_part(call, &device_send, send_parts, peers())?;
                recv_each_part(call, &mut device_recv, recv_parts, peers())
            })?;
            call.wait()?;
            call.download(&device_recv, recv)?;
            recv[recv_parts.range(self.rank)].copy_from_slice(&send[send_parts.range(self.rank)]);
            Ok(())
        })
    }
}

/// The same collectives on buffers already on the rank's GPU (tensors' elements): no upload or
/// download, and the rank's own parts copied on the GPU.
impl DeviceCollectives for NcclRank {
    fn all_reduce_device(&self, buf: &mut CudaBuffer<f32>) -> Result<()> {
        self.run(CollectiveOp::AllReduce, buf.len(), |call| {
            call.check_buffer("the buffer", buf)?;
            if buf.is_empty() {
                return Ok(());
            }
            call.settle()?;
            call.all_reduce_on(buf)
        })
    }

    fn broadcast_device(&self, buf: &mut CudaBuffer<f32>, root: usize) -> Result<()> {
        self.run(CollectiveOp::Broadcast, buf.len(), |call| {
            let root = call.check_root(root)?;
            call.check_buffer("the buffer", buf)?;
            if buf.is_empty() {
                return Ok(());
            }
            call.settle()?;
            call.broadcast_on(buf, root)
        })
    }

    fn scatter_device(
        &self,
        send: Option<&CudaBuffer<f32>>,
        recv: &mut CudaBuffer<f32>,
        root: usize,
        parts: &Partition,
    ) -> Result<()> {
        self.run(CollectiveOp::Scatter, parts.total(), |call| {
            call.check_root(root)?;
            parts.check_ranks("scatter", self.n_ranks)?;
            call.check_len("recv", parts.len(self.rank), recv.len())?;
            call.check_buffer("recv", recv)?;
            call.settle()?;
            if self.rank == root {
                let send = send.ok_or_else(|| call.failed("the root has no send buffer"))?;
                call.check_len("the root's send", parts.total(), send.len())?;
                call.check_buffer("send", send)?;
                call.scatter_on(Some(send), None, root, parts)?;
                return call.copy_on_gpu(send, parts.range(root), recv, 0..parts.len(root));
            }
            if recv.is_empty() {
                return Ok(());
            }
            call.scatter_on(None, Some(recv), root, parts)
        })
    }

    fn gather_device(
        &self,
        send: &CudaBuffer<f32>,
        recv: Option<&mut CudaBuffer<f32>>,
        root: usize,
        parts: &Partition,
    ) -> Result<()> {
        self.run(CollectiveOp::Gather, parts.total(), |call| {
            call.check_root(root)?;
            parts.check_ranks("gather", self.n_ranks)?;
            call.check_len("send", parts.len(self.rank), send.len())?;
            call.check_buffer("send", send)?;
            call.settle()?;
            if self.rank != root {
                if send.is_empty() {
                    return Ok(());
                }
                return call.gather_on(Some(send), None, root, parts);
            }
            let recv = recv.ok_or_else(|| call.failed("the root has no receive buffer"))?;
            call.check_len("the root's recv", parts.total(), recv.len())?;
            call.check_buffer("recv", recv)?;
            call.gather_on(None, Some(&mut *recv), root, parts)?;
            call.copy_on_gpu(send, 0..send.len(), recv, parts.range(root))
        })
    }

    fn all_gather_device(&self, send: &CudaBuffer<f32>, recv: &mut CudaBuffer<f32>, parts: &Partition) -> Result<()> {
        self.run(CollectiveOp::AllGather, parts.total(), |call| {
            parts.check_ranks("all_gather", self.n_ranks)?;
            call.check_len("send", parts.len(self.rank), send.len())?;
            call.check_len("recv", parts.total(), recv.len())?;
            call.check_buffer("send", send)?;
            call.check_buffer("recv", recv)?;
            if recv.is_empty() {
                return Ok(());
            }
            call.settle()?;
            call.all_gather_on(send, recv, parts)
        })
    }

    fn reduce_scatter_device(
        &self,
        send: &CudaBuffer<f32>,
        recv: &mut CudaBuffer<f32>,
        parts: &Partition,
    ) -> Result<()> {
        self.run(CollectiveOp::ReduceScatter, parts.total(), |call| {
            parts.check_ranks("reduce_scatter", self.n_ranks)?;
            call.check_len("send", parts.total(), send.len())?;
            call.check_len("recv", parts.len(self.rank), recv.len())?;
            call.check_buffer("send", send)?;
            call.check_buffer("recv", recv)?;
            if send.is_empty() {
                return Ok(());
            }
            call.settle()?;
            call.reduce_scatter_on(send, recv, parts)
        })
    }
}
