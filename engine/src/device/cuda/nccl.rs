//! The NCCL [`Communicator`] (the `nccl` feature): one rank per GPU of a single process, created
//! together by `ncclCommInitAll`, each rank used from its own thread on its own stream.
//!
//! # Design
//!
//! The trait's collectives take host `f32` slices (the engine's tensors live in host memory
//! today), so each call uploads its operands to device buffers counted on the rank's ledger, issues
//! the NCCL operations on the rank's stream, waits for them, and downloads the result. NCCL has
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
//!
//! [`Communicator::traffic`] counts, per completed collective, the messages and bytes of the
//! planner's model (`collective::traffic`), not NCCL's internal algorithm, which is not observable.
use std::cell::Cell;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream as RawStream;
use cudarc::nccl::{Comm, ReduceOp, group_end, group_start, result::NcclError};

use super::backend::{CudaBuffer, CudaDevice};
use crate::collective::{CollectiveOp, Communicator, DEFAULT_TIMEOUT, Partition, Traffic, traffic};
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

/// Builds one NCCL rank per device (`devices[r]` is rank `r`; every device a different GPU).
pub(crate) fn group(devices: &[Device]) -> Result<Vec<Box<dyn Communicator>>> {
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
    Ok(comms
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
            }) as Box<dyn Communicator>
        })
        .collect())
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
    /// Runs one collective on `bytes` (as `collective::traffic` counts them): refuses on an aborted
    /// communicator, aborts it when the body fails after issuing NCCL work, counts the traffic.
    fn run(&self, op: CollectiveOp, bytes: usize, body: impl FnOnce(&Call<'_>) -> Result<()>) -> Result<()> {
        let mut guard = self.comm.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
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

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        self.run(CollectiveOp::Broadcast, buf.len(), |call| {
            let root = call.check_root(root)?;
            if buf.is_empty() {
                return Ok(());
            }
            let mut device = call.upload(buf)?;
            call.nccl("broadcast", call.comm.broadcast_in_place(&mut device.slice, root))?;
            call.wait()?;
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
            call.nccl("all_reduce", call.comm.all_reduce_in_place(&mut device.slice, &ReduceOp::Sum))?;
            call.wait()?;
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
                call.grouped(|| send_each_part(call, &device_send, parts, (0..self.n_ranks).filter(|&r| r != root)))?;
                call.wait()?;
                recv.copy_from_slice(&send[parts.range(root)]);
                return Ok(());
            }
            if recv.is_empty() {
                return Ok(());
            }
            let mut device_recv = call.zeros(recv.len())?;
            call.grouped(|| {
                call.nccl("recv", call.comm.recv(&mut device_recv.slice.slice_mut(..recv.len()), root as i32))
            })?;
            call.wait()?;
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
                call.grouped(|| {
                    call.nccl("send", call.comm.send(&device_send.slice.slice(..send.len()), root as i32))
                })?;
                return call.wait();
            }
            call.check_len("the root's recv", parts.total(), recv.len())?;
            let mut device_recv = call.zeros(recv.len())?;
            call.grouped(|| recv_each_part(call, &mut device_recv, parts, (0..self.n_ranks).filter(|&r| r != root)))?;
            call.wait()?;
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
            if equal_parts(parts) {
                let outcome = call.comm.all_gather(&device_send.slice.slice(..send.len()), &mut device_recv.slice);
                call.nccl("all_gather", outcome)?;
            } else {
                // allgatherv: one broadcast rooted at each rank, into that rank's part.
                call.grouped(|| {
                    for root in (0..self.n_ranks).filter(|&r| parts.len(r) > 0) {
                        let own = (root == self.rank).then(|| device_send.slice.slice(..send.len()));
                        let mut target = device_recv.slice.slice_mut(parts.range(root));
                        call.nccl("broadcast", call.comm.broadcast(own.as_ref(), &mut target, root as i32))?;
                    }
                    Ok(())
                })?;
            }
            call.wait()?;
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
            if equal_parts(parts) {
                let outcome = call.comm.reduce_scatter(&device_send.slice, &mut device_recv.slice, &ReduceOp::Sum);
                call.nccl("reduce_scatter", outcome)?;
            } else {
                // reduce_scatter_v: one reduce rooted at each rank, of that rank's part.
                call.grouped(|| {
                    for root in (0..self.n_ranks).filter(|&r| parts.len(r) > 0) {
                        let part = device_send.slice.slice(parts.range(root));
                        let mut own = (root == self.rank).then(|| device_recv.slice.slice_mut(..recv.len()));
                        call.nccl("reduce", call.comm.reduce(&part, own.as_mut(), &ReduceOp::Sum, root as i32))?;
                    }
                    Ok(())
                })?;
            }
            call.wait()?;
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
