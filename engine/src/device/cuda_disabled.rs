//! The CUDA device when Conveyor is built without the `cuda` feature: same signatures, and a
//! constructor that returns a clear error. This file and `cuda_enabled.rs` are the one CUDA switch point.
use std::sync::Arc;

use super::MemoryAccount;
use crate::{Error, Result};

/// A CUDA device. Without the `cuda` feature no value of this type can exist.
#[derive(Clone, Debug)]
pub struct CudaDevice {
    never: std::convert::Infallible,
}

impl CudaDevice {
    /// Always fails: this build has no CUDA support.
    pub fn new(ordinal: usize, _budget_bytes: Option<u64>) -> Result<Self> {
        Err(Error::CudaUnavailable(format!(
            "cuda:{ordinal} requested, but Conveyor was built without the `cuda` feature; \
             rebuild with `cargo build --release --features cuda` or use cpu devices"
        )))
    }

    /// The GPU ordinal.
    pub fn ordinal(&self) -> usize {
        match self.never {}
    }

    /// The device's memory ledger.
    pub fn memory(&self) -> &Arc<MemoryAccount> {
        match self.never {}
    }
}
