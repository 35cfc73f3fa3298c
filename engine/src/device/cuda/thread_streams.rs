//! Per-thread streams and the rule that makes tensors safe to hand from one thread to another.
//!
//! # One stream per thread and GPU
//!
//! Every thread that touches a GPU issues its work on its own [`CudaStream`] for that GPU, created
//! on the thread's first use of the GPU ([`CudaDevice::thread_stream`]) and kept in a thread-local
//! map from GPU ordinal to stream until the thread exits. A pipeline worker thread therefore gets
//! its own stream (and its own cuBLAS handle) with no help from the runtime, and two workers on
//! one GPU never serialise on each other. The map is keyed by ordinal, not by `Device` handle:
//! two handles of one GPU (two ledgers) share the thread's stream, so allocations name the ledger
//! explicitly ([`CudaDevice::alloc_zeros`], [`CudaDevice::upload`]), and the stream's own
//! `alloc_zeros`/`upload` (which charge the stream's device) are not used for tensor storage.
//!
//! # Synchronisation rule
//!
//! 1. On one GPU, work issued on different streams is ordered through each buffer's read and
//!    write events, which cudarc records and waits on (a kernel reading a buffer waits for the last
//!    write to it, on whatever stream that was).
//! 2. Uploads (host to GPU) synchronize the destination stream before they return: the host
//!    memory may then be freed, and the buffer is complete for any thread and stream.
//! 3. Downloads (GPU to host) and copies to another device first *settle* the source buffer: they
//!    synchronize this thread's stream on the source GPU and the stream the buffer was allocated
//!    on (the stream of the thread that produced it). Then the copy runs on this thread's stream
//!    on the destination GPU, which is synchronized before the copy returns.
//!
//! So a tensor returned by `Tensor::to_device` or `Tensor::move_to_device` is complete: nothing is
//! still writing it and nothing is still reading its source. The runtime sends every message
//! between stages through `move_to_device`, so the receiving worker may read it on its own stream
//! without further ordering, and rule 1 covers the rest (parameters uploaded by the builder
//! thread and read by a worker, outputs downloaded by the coordinator). The cost is one stall of
//! the producing thread per message; the rejected alternative, event-only hand-off, saves that
//! stall but leans entirely on cudarc's per-buffer events, which track only the last reader.
//!
//! A stream (and its cuBLAS handle) is destroyed when its thread exits; buffers allocated on it
//! keep the underlying CUDA stream alive and free themselves on it after their last use.
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use super::buffer::{CudaBuffer, CudaElement};
use super::device::CudaDevice;
use super::errors;
use super::stream::CudaStream;
use crate::{Error, Result};

thread_local! {
    /// This thread's stream on each GPU it has used, by ordinal.
    static STREAMS: RefCell<HashMap<usize, Rc<CudaStream>>> = RefCell::new(HashMap::new());
}

impl CudaDevice {
    /// This thread's stream on this GPU, created on the thread's first use of the GPU (see the
    /// module docs of `thread_streams.rs` for the synchronisation rule tensors follow).
    pub fn thread_stream(&self) -> Result<Rc<CudaStream>> {
        let ordinal = self.ordinal();
        let found =
            STREAMS.try_with(|streams| streams.borrow().get(&ordinal).cloned()).map_err(|_| exiting_thread(ordinal))?;
        if let Some(stream) = found {
            return Ok(stream);
        }
        let stream = Rc::new(self.new_stream()?);
        STREAMS
            .try_with(|streams| streams.borrow_mut().insert(ordinal, Rc::clone(&stream)))
            .map_err(|_| exiting_thread(ordinal))?;
        Ok(stream)
    }

    /// `len` zeroed elements on this GPU, counted on this device's ledger, ordered on this thread's
    /// stream.
    pub fn alloc_zeros<T: CudaElement>(&self, len: usize) -> Result<CudaBuffer<T>> {
        let stream = self.thread_stream()?;
        CudaBuffer::zeros(self, &stream.raw, len)
    }

    /// A copy of `host` on this GPU, counted on this device's ledger. Returns once the copy has
    /// finished, so `host` may be freed and any thread may use the buffer.
    pub fn upload<T: CudaElement>(&self, host: &[T]) -> Result<CudaBuffer<T>> {
        let stream = self.thread_stream()?;
        let buffer = CudaBuffer::from_host(self, &stream.raw, host)?;
        stream.synchronize()?;
        Ok(buffer)
    }
}

/// The error when a thread uses a GPU while its thread-local streams are being destroyed.
fn exiting_thread(ordinal: usize) -> Error {
    Error::CudaUnavailable(format!("cuda:{ordinal}: a CUDA operation was issued by a thread that is exiting"))
}

/// Waits until every write to `buffer` issued so far by this thread (on its stream for the
/// buffer's GPU) or by the thread that allocated it (on the buffer's own stream) has finished:
/// rule 3 of the module docs, before the buffer is read on the host or copied to another device.
pub(crate) fn settle<T: CudaElement>(buffer: &CudaBuffer<T>) -> Result<()> {
    let ordinal = buffer.device().ordinal();
    let stream = buffer.device().thread_stream()?;
    stream.synchronize()?;
    let own = buffer.slice.stream();
    if !Arc::ptr_eq(own, &stream.raw) {
        own.synchronize().map_err(|err| errors::driver(ordinal, "synchronizing a buffer's stream", err))?;
    }
    Ok(())
}
