//! Per-device memory accounting: bytes in use, the peak, and an optional budget that allocations must fit.
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Error, Result};

/// The memory ledger of one device. Every tensor on the device holds a [`Reservation`] against it.
#[derive(Debug)]
pub struct MemoryAccount {
    device_name: String,
    budget: Option<u64>,
    in_use: AtomicU64,
    peak: AtomicU64,
    /// Bytes ever reserved (never decreases): what a sequence of operations reserved in all,
    /// whatever order its frees came in (the memory planner's bound on a call's peak).
    reserved_total: AtomicU64,
}

impl MemoryAccount {
    /// A ledger for `device_name` with an optional budget in bytes.
    pub fn new(device_name: String, budget: Option<u64>) -> Self {
        MemoryAccount {
            device_name,
            budget,
            in_use: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            reserved_total: AtomicU64::new(0),
        }
    }

    /// Bytes currently reserved.
    pub fn in_use(&self) -> u64 {
        self.in_use.load(Ordering::Acquire)
    }

    /// Highest `in_use` seen since creation or the last [`MemoryAccount::reset_peak`].
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Acquire)
    }

    /// Bytes reserved since creation, frees not subtracted: the difference over a span of work
    /// bounds that span's peak above its start whatever the order of its reserves and frees.
    pub fn reserved_total(&self) -> u64 {
        self.reserved_total.load(Ordering::Acquire)
    }

    /// The budget, if any.
    pub fn budget(&self) -> Option<u64> {
        self.budget
    }

    /// Sets the peak back to the bytes in use now (to measure one step).
    pub fn reset_peak(&self) {
        self.peak.store(self.in_use(), Ordering::Release);
    }

    /// Reserves `bytes`, or fails with [`Error::OutOfDeviceMemory`] if the budget would be exceeded.
    pub fn reserve(self: &Arc<Self>, bytes: u64) -> Result<Reservation> {
        let mut current = self.in_use.load(Ordering::Acquire);
        loop {
            let next = current.saturating_add(bytes);
            if let Some(budget) = self.budget
                && next > budget
            {
                return Err(Error::OutOfDeviceMemory {
                    device: self.device_name.clone(),
                    requested: bytes,
                    in_use: current,
                    budget,
                });
            }
            match self.in_use.compare_exchange_weak(current, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    self.peak.fetch_max(next, Ordering::AcqRel);
                    self.reserved_total.fetch_add(bytes, Ordering::AcqRel);
                    return Ok(Reservation { account: Arc::clone(self), bytes });
                }
                Err(actual) => current = actual,
            }
        }
    }

    /// Reserves `bytes` even past the budget: for the few operations that cannot fail (such as
    /// `Tensor::fill_zero` on a tensor whose elements another handle shares) and must still
    /// count what they hold. The peak records the overrun.
    pub fn reserve_past_budget(self: &Arc<Self>, bytes: u64) -> Reservation {
        let next = self.in_use.fetch_add(bytes, Ordering::AcqRel).saturating_add(bytes);
        self.peak.fetch_max(next, Ordering::AcqRel);
        self.reserved_total.fetch_add(bytes, Ordering::AcqRel);
        Reservation { account: Arc::clone(self), bytes }
    }
}

/// Bytes held against a [`MemoryAccount`]; released when dropped.
#[derive(Debug)]
pub struct Reservation {
    account: Arc<MemoryAccount>,
    bytes: u64,
}

impl Reservation {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.account.in_use.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}
