//! The CUDA device when Conveyor is built with the `cuda` feature: a cudarc context per GPU ordinal,
//! created only after checking that the driver library is present (cudarc panics otherwise).
use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::MemoryAccount;
use crate::{Error, Result};

/// A CUDA GPU with its context and memory ledger.
#[derive(Clone, Debug)]
pub struct CudaDevice {
    ordinal: usize,
    context: Arc<CudaContext>,
    memory: Arc<MemoryAccount>,
}

impl CudaDevice {
    /// Opens GPU `ordinal`; a clear error when no CUDA driver is installed or the GPU does not exist.
    pub fn new(ordinal: usize, budget_bytes: Option<u64>) -> Result<Self> {
        // SAFETY: `is_culib_present` only tries to dlopen the driver library and reports whether
        // it loaded; it touches no CUDA state.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::CudaUnavailable(format!(
                "cuda:{ordinal} requested, but no CUDA driver (libcuda) was found on this machine; \
                 install the NVIDIA driver or use cpu devices"
            )));
        }
        let context = CudaContext::new(ordinal)
            .map_err(|err| Error::CudaUnavailable(format!("cuda:{ordinal} could not be opened: {err}")))?;
        let memory = Arc::new(MemoryAccount::new(format!("cuda:{ordinal}"), budget_bytes));
        Ok(CudaDevice { ordinal, context, memory })
    }

    /// The GPU ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's memory ledger.
    pub fn memory(&self) -> &Arc<MemoryAccount> {
        &self.memory
    }

    /// The cudarc context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }
}
