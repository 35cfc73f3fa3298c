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
//!
//! # Threads that exit while the process exits
//!
//! A thread's streams are destroyed by its thread-local destructor, which runs after the thread's
//! closure has returned. A scoped thread that is not joined explicitly counts as finished before
//! its thread-local destructors have run (rust-lang/rust#116179, documented as intended in
//! rust-lang/rust#149482), so `std::thread::scope` (libtest-mimic's test threads, for one) can
//! return, and `main` can return and the process exit, while such a destructor is still calling
//! `cublasDestroy` and `cuStreamDestroy`. The CUDA libraries tear themselves down at exit, and a
//! call racing that teardown crashed test executables on an H200 (SIGSEGV after "test result:
//! ok", 2 of 48 runs, a different executable each time). So the destructor and the exit agree:
//! a handler registered with `atexit` after the CUDA libraries' own (it runs before them) marks
//! the process as exiting and waits until no thread is inside a stream destructor; a destructor
//! that starts after the mark leaves its streams to the process's end (the driver reclaims
//! everything of a process that exits). [`exit_guard::register`] registers the handler after the
//! driver, cuBLAS or NVRTC is first used, so it runs before each one's teardown.
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
    static STREAMS: RefCell<ThreadStreams> = RefCell::new(ThreadStreams(HashMap::new()));
}

/// A thread's streams by GPU ordinal, destroyed with the thread unless the process is exiting.
struct ThreadStreams(HashMap<usize, Rc<CudaStream>>);

impl Drop for ThreadStreams {
    fn drop(&mut self) {
        let streams = std::mem::take(&mut self.0);
        if streams.is_empty() {
            return;
        }
        match exit_guard::enter() {
            Some(_inside) => drop(streams),
            // The CUDA libraries may be tearing down: calling them now could crash the process.
            None => std::mem::forget(streams),
        }
    }
}

/// The agreement between stream destructors and process exit (see the module docs).
pub(crate) mod exit_guard {
    use std::sync::Once;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    /// Set by the exit handler: no stream destructor may call CUDA from then on.
    static EXITING: AtomicBool = AtomicBool::new(false);
    /// Stream destructors calling CUDA right now.
    static INSIDE: AtomicUsize = AtomicUsize::new(0);
    /// How long the exit handler waits for destructors already inside (each destroys a few
    /// streams and cuBLAS handles: microseconds to milliseconds).
    const EXIT_WAIT: Duration = Duration::from_secs(2);

    /// A destructor's permission to call CUDA, held while it does.
    pub(crate) struct Inside(());

    impl Drop for Inside {
        fn drop(&mut self) {
            INSIDE.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Permission to destroy CUDA objects now, or `None` once the process is exiting. Counting
    /// before reading the mark (both sequentially consistent) means the handler either sees this
    /// destructor inside and waits for it, or this destructor sees the mark.
    pub(crate) fn enter() -> Option<Inside> {
        INSIDE.fetch_add(1, Ordering::SeqCst);
        let inside = Inside(());
        if EXITING.load(Ordering::SeqCst) { None } else { Some(inside) }
    }

    extern "C" fn on_exit() {
        EXITING.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + EXIT_WAIT;
        while INSIDE.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::yield_now();
        }
    }

    /// Which CUDA library has just been used for the first time.
    #[derive(Clone, Copy)]
    pub(crate) enum Library {
        Driver,
        Cublas,
        Nvrtc,
    }

    /// Registers the exit handler after `library`'s first use in the process (once per library:
    /// handlers run in reverse order of registration, so each registration runs before the
    /// teardown of the libraries loaded until then; running it twice is harmless).
    pub(crate) fn register(library: Library) {
        static ONCE: [Once; 3] = [Once::new(), Once::new(), Once::new()];
        ONCE[library as usize].call_once(|| {
            // SAFETY: `on_exit` is a plain function that touches only atomics and the clock; a
            // failed registration (libc's table full) leaves the race as it was.
            unsafe {
                libc::atexit(on_exit);
            }
        });
    }
}

impl CudaDevice {
    /// This thread's stream on this GPU, created on the thread's first use of the GPU (see the
    /// module docs of `thread_streams.rs` for the synchronisation rule tensors follow).
    pub fn thread_stream(&self) -> Result<Rc<CudaStream>> {
        let ordinal = self.ordinal();
        let found = STREAMS
            .try_with(|streams| streams.borrow().0.get(&ordinal).cloned())
            .map_err(|_| exiting_thread(ordinal))?;
        if let Some(stream) = found {
            return Ok(stream);
        }
        let stream = Rc::new(self.new_stream()?);
        exit_guard::register(exit_guard::Library::Driver);
        STREAMS
            .try_with(|streams| streams.borrow_mut().0.insert(ordinal, Rc::clone(&stream)))
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
