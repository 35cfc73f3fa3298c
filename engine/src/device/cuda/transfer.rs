//! Device-to-device copies: on one GPU a plain copy; between GPUs a peer copy when the hardware
//! has a peer path (peer access enabled once per pair), otherwise staged through pinned host
//! memory in double-buffered chunks, so the download of one chunk overlaps the upload of the last.
//!
//! Ordering: the copy runs on the destination stream after every earlier write to the source (on
//! whatever stream issued it) and before any later writer of the source or reader of the
//! destination, through the buffers' read/write events.
use cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE;
use cudarc::driver::{CudaEvent, DevicePtr, PinnedHostSlice};

use super::buffer::{CudaBuffer, CudaElement};
use super::stream::CudaStream;
use crate::Result;

/// Elements per staging chunk: 8 MiB of f32, large enough to run the PCIe link at full speed.
const STAGING_CHUNK_BYTES: usize = 8 << 20;

impl CudaStream {
    /// A copy of `src` (on any GPU) on this stream's GPU, counted on this GPU's ledger.
    pub fn copy_from<T: CudaElement>(&self, src: &CudaBuffer<T>) -> Result<CudaBuffer<T>> {
        let mut dst = self.alloc_zeros(src.len())?;
        self.copy_into(src, &mut dst)?;
        Ok(dst)
    }

    /// Copies `src` (on any GPU) into `dst` (same length, on this stream's GPU).
    pub fn copy_into<T: CudaElement>(&self, src: &CudaBuffer<T>, dst: &mut CudaBuffer<T>) -> Result<()> {
        self.check_len("copy_into", "dst", src.len(), dst.len())?;
        self.check_on_device("copy_into", dst)?;
        if src.is_empty() {
            return Ok(());
        }
        if src.device().same_gpu(self.device()) {
            return self
                .raw
                .memcpy_dtod(&src.slice, &mut dst.slice)
                .map_err(|err| self.driver_error("copying on the GPU", err));
        }
        if self.device().enable_peer_access(src.device())? && src.device().enable_peer_access(self.device())? {
            self.copy_peer(src, dst)
        } else {
            self.copy_staged(src, dst)
        }
    }

    /// A direct GPU-to-GPU copy over the peer path, issued on this (the destination) stream.
    fn copy_peer<T: CudaElement>(&self, src: &CudaBuffer<T>, dst: &mut CudaBuffer<T>) -> Result<()> {
        let op = format!("copying from cuda:{} by peer access", src.device().ordinal());
        // cudarc waits for the source's stream and records dst's write event on this stream.
        self.raw.memcpy_dtod(&src.slice, &mut dst.slice).map_err(|err| self.driver_error(&op, err))?;
        // cudarc records src's read event on the source's stream before the copy has run on this
        // one; make the source's stream wait for the copy and record the read event again, so a
        // later writer of src (on any stream) waits for the copy to finish reading it.
        let src_stream = src.slice.stream();
        let copied = self.raw.record_event(None).map_err(|err| self.driver_error(&op, err))?;
        src_stream.wait(&copied).map_err(|err| self.driver_error(&op, err))?;
        let (_src_ptr, _record_read) = src.slice.device_ptr(src_stream);
        Ok(())
    }

    /// A copy through pinned host memory, for GPUs without a peer path: chunks are downloaded on
    /// the source's stream into one of two pinned buffers while the other's chunk is uploaded on
    /// this stream. Returns once the last upload has been queued and every upload has finished
    /// reading the pinned memory.
    fn copy_staged<T: CudaElement>(&self, src: &CudaBuffer<T>, dst: &mut CudaBuffer<T>) -> Result<()> {
        let op = format!("copying from cuda:{} through pinned host memory", src.device().ordinal());
        let src_stream = src.slice.stream();
        let len = src.len();
        let chunk = (STAGING_CHUNK_BYTES / size_of::<T>().max(1)).clamp(1, len);
        // PORTABLE: the pages are pinned for every context, the destination GPU's included.
        // SAFETY: the pinned memory is only read after a download has filled the part read.
        let mut staging: Vec<PinnedHostSlice<T>> = (0..2.min(len.div_ceil(chunk)))
            .map(|_| unsafe { src.device().context().alloc_pinned_with_flags::<T>(chunk, CU_MEMHOSTALLOC_PORTABLE) })
            .collect::<std::result::Result<_, _>>()
            .map_err(|err| self.driver_error(&op, err))?;
        // The upload that last read each staging buffer, to wait for before refilling it.
        let mut uploaded: Vec<Option<CudaEvent>> = (0..staging.len()).map(|_| None).collect();
        let outcome = (|| -> Result<()> {
            for (chunk_idx, start) in (0..len).step_by(chunk).enumerate() {
                let end = (start + chunk).min(len);
                let slot = chunk_idx % staging.len();
                if let Some(event) = uploaded[slot].take() {
                    event.synchronize().map_err(|err| self.driver_error(&op, err))?;
                }
                let pinned = &mut staging[slot];
                let part = src.slice.slice(start..end);
                let host = pinned.as_mut_slice().map_err(|err| self.driver_error(&op, err))?;
                // Downloading into a plain slice of pinned memory is asynchronous; wait for it on
                // the host before the upload reads the same memory (the upload of the previous
                // chunk keeps running meanwhile).
                src_stream.memcpy_dtoh(&part, &mut host[..end - start]).map_err(|err| self.driver_error(&op, err))?;
                src_stream.synchronize().map_err(|err| self.driver_error(&op, err))?;
                let mut target = dst.slice.slice_mut(start..end);
                self.raw.memcpy_htod(&host[..end - start], &mut target).map_err(|err| self.driver_error(&op, err))?;
                uploaded[slot] = Some(self.raw.record_event(None).map_err(|err| self.driver_error(&op, err))?);
            }
            Ok(())
        })();
        // Whatever happened, no upload may still be reading pinned memory when it is freed.
        for event in uploaded.into_iter().flatten() {
            event.synchronize().map_err(|err| self.driver_error(&op, err))?;
        }
        outcome
    }
}
