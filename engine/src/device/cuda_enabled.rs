//! The CUDA backend when Conveyor is built with the `cuda` feature. With `cuda_disabled.rs`, this
//! file is the one CUDA switch point: it wires the backend in `device/cuda/` and, behind the `nccl`
//! feature, the NCCL communicator. Everything the rest of the engine may name is re-exported here,
//! and `cuda_disabled.rs` declares the same names with the same signatures.
#[path = "cuda/mod.rs"]
mod backend;

#[cfg(feature = "nccl")]
#[path = "cuda/nccl.rs"]
mod nccl;

pub(crate) use backend::CudaStorage;
pub use backend::{CudaBuffer, CudaDevice, CudaElement, CudaStream, DeviceMatRef, GemmElement};

use crate::collective::{Communicator, GroupAbort};
use crate::{Device, Result};

impl CudaDevice {
    /// One NCCL communicator per device (rank `r` on `devices[r]`, every device a different GPU),
    /// each to be used from its own thread; an error when built without the `nccl` feature, when
    /// libnccl is missing, or when a device is not a CUDA device.
    pub fn nccl_group(devices: &[Device]) -> Result<Vec<Box<dyn Communicator>>> {
        nccl_group_abortable(devices).map(|(ranks, _)| ranks)
    }

    /// [`CudaDevice::nccl_group`], and a handle that ends the group's waits from outside it (its
    /// ranks then refuse every later call: build a new group).
    pub fn nccl_group_abortable(devices: &[Device]) -> Result<(Vec<Box<dyn Communicator>>, GroupAbort)> {
        nccl_group_abortable(devices)
    }
}

#[cfg(feature = "nccl")]
fn nccl_group_abortable(devices: &[Device]) -> Result<(Vec<Box<dyn Communicator>>, GroupAbort)> {
    nccl::group_abortable(devices)
}

#[cfg(not(feature = "nccl"))]
fn nccl_group_abortable(devices: &[Device]) -> Result<(Vec<Box<dyn Communicator>>, GroupAbort)> {
    Err(crate::Error::CudaUnavailable(format!(
        "an NCCL group of {} device(s) was requested, but Conveyor was built without the `nccl` feature; \
         rebuild with `--features nccl` (libnccl must be installed at run time)",
        devices.len()
    )))
}
