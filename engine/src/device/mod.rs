//! Devices: the closed `Device` enum (CPU, CUDA) that tensors live on, each with its memory ledger.
//!
//! A CPU device is one core: its kernels are single-threaded (`gemm` with `Parallelism::None`), so
//! N CPU devices driven by N worker threads use N cores. The CUDA variant always exists; whether it
//! can be constructed is decided in exactly one place, the `cuda` module chosen below.
//!
//! Code map: `list.rs` (the device grammar: `cuda:1`, `cpu:0-3`, lists), `memory.rs` (ledgers and reservations), [`host_cache`] (freed host memory kept for reuse), `host.rs` (`HostStorage`, tensor elements in
//! host memory and the host side of every upload and download), [`ops`] (the tensor-level
//! arithmetic layers use, each op dispatched on its device in one `match`), `kernels/` (the CUDA
//! kernel sources), and `cuda_enabled.rs` / `cuda_disabled.rs` with `cuda/` (the CUDA backend,
//! including `CudaStorage`, the payload of `Tensor`'s CUDA storage, and each thread's streams).
mod host;
pub mod host_cache;
pub mod kernels;
mod list;
mod memory;
pub mod ops;

#[cfg_attr(feature = "cuda", path = "cuda_enabled.rs")]
#[cfg_attr(not(feature = "cuda"), path = "cuda_disabled.rs")]
mod cuda;

use std::fmt;
use std::sync::Arc;

pub(crate) use cuda::CudaStorage;
pub use cuda::{CudaBuffer, CudaDevice, CudaElement, CudaStream, DeviceMatRef, GemmElement};
pub(crate) use host::HostStorage;
pub use host_cache::retain_freed_host_memory;
pub use list::{DeviceId, DeviceKind, DeviceList, DeviceListProblem, LogicalSlice, MAX_DEVICES};
pub use memory::{MemoryAccount, Reservation, ThreadTally};

use crate::Result;

/// A CPU device: one worker core and a memory ledger.
#[derive(Clone, Debug)]
pub struct CpuDevice {
    ordinal: usize,
    memory: Arc<MemoryAccount>,
}

impl CpuDevice {
    /// The device's index (`cpu:N`).
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
}

/// Where a tensor lives. Cheap to clone: clones share one memory ledger.
#[derive(Clone, Debug)]
pub enum Device {
    /// A CPU core with its own memory budget.
    Cpu(CpuDevice),
    /// A CUDA GPU (usable only when built with the `cuda` feature and a driver is present).
    Cuda(CudaDevice),
}

impl Device {
    /// Whether this is a CPU core or a GPU.
    pub fn kind(&self) -> DeviceKind {
        match self {
            Device::Cpu(_) => DeviceKind::Cpu,
            Device::Cuda(_) => DeviceKind::Cuda,
        }
    }

    /// CPU device `ordinal` with no memory budget.
    pub fn cpu(ordinal: usize) -> Device {
        Device::cpu_with_budget(ordinal, None)
    }

    /// CPU device `ordinal` whose allocations must fit `budget_bytes` (none: unlimited).
    ///
    /// ```
    /// use conveyor_engine::{DType, Device, Error, Tensor};
    ///
    /// let device = Device::cpu_with_budget(0, Some(1024));
    /// let small = Tensor::zeros([16, 16], DType::F32, &device)?; // 1 KiB: fits exactly
    /// assert_eq!(device.memory_in_use(), 1024);
    /// let err = Tensor::zeros([1], DType::F32, &device).unwrap_err();
    /// assert!(matches!(err, Error::OutOfDeviceMemory { .. }), "{err}");
    /// drop(small);
    /// assert_eq!((device.memory_in_use(), device.peak_memory()), (0, 1024));
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn cpu_with_budget(ordinal: usize, budget_bytes: Option<u64>) -> Device {
        let memory = Arc::new(MemoryAccount::new(format!("cpu:{ordinal}"), budget_bytes));
        Device::Cpu(CpuDevice { ordinal, memory })
    }

    /// The host: an unbudgeted CPU device shared by everything that calls it. Layers are built here
    /// before placement moves their parameters onto stage devices.
    pub fn host() -> Device {
        static HOST: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
        HOST.get_or_init(|| {
            let memory = Arc::new(MemoryAccount::new("host".to_string(), None));
            Device::Cpu(CpuDevice { ordinal: usize::MAX, memory })
        })
        .clone()
    }

    /// CUDA device `ordinal`; an error when built without the `cuda` feature or without a driver.
    pub fn cuda(ordinal: usize, budget_bytes: Option<u64>) -> Result<Device> {
        Ok(Device::Cuda(CudaDevice::new(ordinal, budget_bytes)?))
    }

    /// The device's memory ledger.
    pub fn memory(&self) -> &Arc<MemoryAccount> {
        match self {
            Device::Cpu(cpu) => &cpu.memory,
            Device::Cuda(cuda) => cuda.memory(),
        }
    }

    /// Bytes in use on the device now.
    pub fn memory_in_use(&self) -> u64 {
        self.memory().in_use()
    }

    /// Peak bytes in use since creation or the last [`Device::reset_peak_memory`].
    pub fn peak_memory(&self) -> u64 {
        self.memory().peak()
    }

    /// The memory budget, if any.
    pub fn memory_budget(&self) -> Option<u64> {
        self.memory().budget()
    }

    /// Starts a new peak measurement from the bytes in use now.
    pub fn reset_peak_memory(&self) {
        self.memory().reset_peak()
    }

    /// Reserves `bytes` on this device (used by tensors; also for messages and workspaces).
    pub fn reserve(&self, bytes: u64) -> Result<Reservation> {
        self.memory().reserve(bytes)
    }

    /// True when both handles are the same device (the same ledger).
    pub fn same_device(&self, other: &Device) -> bool {
        Arc::ptr_eq(self.memory(), other.memory())
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu(cpu) if cpu.ordinal == usize::MAX => f.write_str("host"),
            Device::Cpu(cpu) => write!(f, "cpu:{}", cpu.ordinal),
            Device::Cuda(cuda) => f.write_str(&cuda.label()),
        }
    }
}
