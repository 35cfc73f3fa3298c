//! [`CudaDevice`]: one GPU ordinal, its primary context, its memory ledger and the properties the
//! launch configurations need; opening it, counting GPUs, peer access, and creating worker streams.
use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::CudaContext;
use cudarc::driver::sys::{self, CUdevice_attribute, CUresult};

use super::compile::{self, KernelSet};
use super::errors;
use super::stream::CudaStream;
use crate::device::{LogicalSlice, MemoryAccount};
use crate::{Error, Result};

/// A CUDA GPU: its context and memory ledger. Cheap to clone; clones share the ledger.
#[derive(Clone)]
pub struct CudaDevice {
    ordinal: usize,
    /// Which logical device of the GPU this handle is (`cuda:0x4#1`), if it is one.
    slice: Option<LogicalSlice>,
    context: Arc<CudaContext>,
    memory: Arc<MemoryAccount>,
    properties: Arc<Properties>,
}

/// What the driver reports about the GPU, read once when it is opened.
#[derive(Debug)]
struct Properties {
    name: String,
    compute_capability: (i32, i32),
    multiprocessor_count: u32,
    total_memory: u64,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.properties.name)
            .field("compute_capability", &self.properties.compute_capability)
            .field("memory", &self.memory)
            .finish()
    }
}

/// The message for a machine without libcuda.
fn no_driver(what: &str) -> Error {
    Error::CudaUnavailable(format!(
        "{what} requested, but no CUDA driver (libcuda) was found on this machine; \
         install the NVIDIA driver or use cpu devices"
    ))
}

impl CudaDevice {
    /// Opens GPU `ordinal`; a clear error when no CUDA driver is installed or the GPU does not exist.
    pub fn new(ordinal: usize, budget_bytes: Option<u64>) -> Result<Self> {
        // SAFETY: `is_culib_present` only tries to dlopen the driver library and reports whether
        // it loaded; it touches no CUDA state.
        if !unsafe { sys::is_culib_present() } {
            return Err(no_driver(&format!("cuda:{ordinal}")));
        }
        let context = CudaContext::new(ordinal)
            .map_err(|err| Error::CudaUnavailable(format!("cuda:{ordinal} could not be opened: {err}")))?;
        let query =
            |what: &str, err| Error::CudaUnavailable(format!("cuda:{ordinal}: reading its {what} failed: {err}"));
        let multiprocessor_count = context
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|err| query("multiprocessor count", err))?;
        let properties = Properties {
            name: context.name().map_err(|err| query("name", err))?,
            compute_capability: context.compute_capability().map_err(|err| query("compute capability", err))?,
            multiprocessor_count: u32::try_from(multiprocessor_count).unwrap_or(1).max(1),
            total_memory: context.total_mem().map_err(|err| query("total memory", err))? as u64,
        };
        let memory = Arc::new(MemoryAccount::new(format!("cuda:{ordinal}"), budget_bytes));
        Ok(CudaDevice { ordinal, slice: None, context, memory, properties: Arc::new(properties) })
    }

    /// A handle of GPU `ordinal` (a logical device of it when `slice` says so) whose ledger's
    /// budget is `budget_bytes`, or without one the memory free on the GPU now (`cuMemGetInfo`)
    /// divided by the logical devices sharing it: what the CLI and the run spec open, so the
    /// memory plan checks against what the card really has.
    pub fn with_free_memory_budget(
        ordinal: usize,
        budget_bytes: Option<u64>,
        slice: Option<LogicalSlice>,
    ) -> Result<Self> {
        let mut device = CudaDevice::new(ordinal, None)?;
        let budget = match budget_bytes {
            Some(budget) => budget,
            None => device.free_memory()? / slice.map_or(1, |s| s.count.max(1)) as u64,
        };
        device.slice = slice;
        device.memory = Arc::new(MemoryAccount::new(device.label(), Some(budget)));
        Ok(device)
    }

    /// The memory free on the GPU now, in bytes (`cuMemGetInfo`: every process's allocations
    /// counted, not only this ledger's).
    pub fn free_memory(&self) -> Result<u64> {
        let (free, _total) =
            self.context.mem_get_info().map_err(|err| errors::driver(self.ordinal, "reading its free memory", err))?;
        Ok(free as u64)
    }

    /// Which logical device of its GPU this handle is, if it is one.
    pub fn logical_slice(&self) -> Option<LogicalSlice> {
        self.slice
    }

    /// The handle's name: `cuda:N`, or `cuda:NxK#I` for a logical device.
    pub fn label(&self) -> String {
        match self.slice {
            Some(LogicalSlice { index, count }) => format!("cuda:{}x{count}#{index}", self.ordinal),
            None => format!("cuda:{}", self.ordinal),
        }
    }

    /// How many CUDA GPUs the driver sees; an error when no driver is installed.
    pub fn count() -> Result<usize> {
        // SAFETY: as in `new`, only a dlopen probe.
        if !unsafe { sys::is_culib_present() } {
            return Err(no_driver("CUDA GPUs"));
        }
        match CudaContext::device_count() {
            Ok(count) => Ok(usize::try_from(count).unwrap_or(0)),
            Err(err) if err.0 == CUresult::CUDA_ERROR_NO_DEVICE => Ok(0),
            Err(err) => Err(Error::CudaUnavailable(format!("the CUDA driver could not count GPUs: {err}"))),
        }
    }

    /// The GPU ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's memory ledger.
    pub fn memory(&self) -> &Arc<MemoryAccount> {
        &self.memory
    }

    /// The cudarc context (the GPU's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// The GPU's name, e.g. `NVIDIA H100 80GB HBM3`.
    pub fn name(&self) -> &str {
        &self.properties.name
    }

    /// The compute capability `(major, minor)`, e.g. `(9, 0)`.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.properties.compute_capability
    }

    /// The GPU's physical memory in bytes (the ledger's budget is separate and may be smaller).
    pub fn total_memory(&self) -> u64 {
        self.properties.total_memory
    }

    /// A new stream on this GPU, for one worker thread: every operation issued through it runs in
    /// order, and concurrently with other streams' work.
    pub fn new_stream(&self) -> Result<CudaStream> {
        let stream = self.context.new_stream().map_err(|err| errors::driver(self.ordinal, "creating a stream", err))?;
        Ok(CudaStream::new(self.clone(), stream))
    }

    /// True when this GPU can read and write `other`'s memory directly (peer access over NVLink or
    /// PCIe); always true for the same GPU.
    pub fn can_access_peer(&self, other: &CudaDevice) -> Result<bool> {
        if self.ordinal == other.ordinal {
            return Ok(true);
        }
        let mut can_access: std::ffi::c_int = 0;
        // SAFETY: both devices come from live contexts; the driver writes one int.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can_access, self.context.cu_device(), other.context.cu_device()) }
            .result()
            .map_err(|err| {
                errors::driver(self.ordinal, &format!("querying peer access to cuda:{}", other.ordinal), err)
            })?;
        Ok(can_access != 0)
    }

    /// Enables this GPU's context to access `other`'s memory, once per ordered pair of GPUs for the
    /// process. Returns false (and enables nothing) when the hardware has no peer path.
    pub(crate) fn enable_peer_access(&self, other: &CudaDevice) -> Result<bool> {
        static ENABLED: OnceLock<Mutex<HashSet<(usize, usize)>>> = OnceLock::new();
        // Each thread remembers the pairs it saw enabled, so a copy between GPUs takes the
        // process-wide lock only the first time a thread copies between them.
        thread_local! {
            static SEEN: std::cell::RefCell<HashSet<(usize, usize)>> = Default::default();
        }
        if self.ordinal == other.ordinal {
            return Ok(true);
        }
        let pair = (self.ordinal, other.ordinal);
        if SEEN.with(|seen| seen.borrow().contains(&pair)) {
            return Ok(true);
        }
        let mut enabled = ENABLED.get_or_init(Default::default).lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if enabled.contains(&pair) {
            SEEN.with(|seen| seen.borrow_mut().insert(pair));
            return Ok(true);
        }
        if !self.can_access_peer(other)? {
            return Ok(false);
        }
        let op = format!("enabling peer access to cuda:{}", other.ordinal);
        self.context.bind_to_thread().map_err(|err| errors::driver(self.ordinal, &op, err))?;
        // SAFETY: this context is current on the thread (bound above) and `other`'s context is
        // alive; the call only changes the mapping of `other`'s allocations into this context.
        match unsafe { sys::cuCtxEnablePeerAccess(other.context.cu_ctx(), 0) }.result() {
            Ok(()) => {}
            Err(err) if err.0 == CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
            Err(err) => return Err(errors::driver(self.ordinal, &op, err)),
        }
        enabled.insert(pair);
        SEEN.with(|seen| seen.borrow_mut().insert(pair));
        Ok(true)
    }

    /// The compiled kernels for this GPU (compiled on the first call for the GPU, then cached).
    pub(crate) fn kernels(&self) -> Result<Arc<KernelSet>> {
        compile::kernels_for(self)
    }

    /// How many blocks a grid-stride launch uses at most: 32 per multiprocessor, enough to fill the
    /// GPU with 256-thread blocks while each thread still loops over several elements.
    pub(crate) fn max_grid_blocks(&self) -> u32 {
        self.properties.multiprocessor_count.saturating_mul(32)
    }

    /// True when `other` is the same GPU (buffers of one may be used by kernels on the other).
    pub(crate) fn same_gpu(&self, other: &CudaDevice) -> bool {
        self.ordinal == other.ordinal
    }
}
