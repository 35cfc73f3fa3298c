//! cudarc's errors as the engine's [`Error`]: an allocation the GPU cannot hold becomes
//! `Error::OutOfDeviceMemory`, as a budget overrun does; every other driver, cuBLAS or NVRTC failure
//! becomes `Error::CudaUnavailable` naming the device and the operation that failed.
use cudarc::cublas::result::CublasError;
use cudarc::driver::{DriverError, sys::CUresult};

use crate::Error;

/// A driver call `op` on `cuda:{ordinal}` failed.
pub(crate) fn driver(ordinal: usize, op: &str, err: DriverError) -> Error {
    Error::CudaUnavailable(format!("cuda:{ordinal}: {op} failed: {err}"))
}

/// A cuBLAS call `op` on `cuda:{ordinal}` failed.
pub(crate) fn cublas(ordinal: usize, op: &str, err: CublasError) -> Error {
    Error::CudaUnavailable(format!("cuda:{ordinal}: cuBLAS {op} failed: {err}"))
}

/// True when the driver reported that the GPU has no memory left for an allocation.
pub(crate) fn is_out_of_memory(err: &DriverError) -> bool {
    err.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY
}

/// Checks that `value` (a size given to a CUDA API that takes a C `int`) fits in an `i32`.
pub(crate) fn to_i32(op: &str, what: &str, value: usize) -> Result<i32, Error> {
    i32::try_from(value).map_err(|_| {
        Error::invalid(what, format!("{op}: {value} exceeds the 32-bit limit {} of the CUDA API", i32::MAX))
    })
}
