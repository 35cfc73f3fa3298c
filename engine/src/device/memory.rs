//! Per-device memory accounting: bytes in use, the peak, and an optional budget that allocations must fit.
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;

use crate::{Error, Result};

/// The memory ledger of one device. Every tensor on the device holds a [`Reservation`] against it.
#[derive(Debug)]
pub struct MemoryAccount {
    device_name: String,
    budget: Option<u64>,
    in_use: AtomicU64,
    peak: AtomicU64,
    /// Whether a [`ThreadTally`] is counting: every reserve and release reads this flag, and only
    /// while it is set takes the lock below (so only while the memory planner probes a call).
    tallying: AtomicBool,
    /// Per thread, net bytes reserved on this ledger since the tally started, and their highest.
    threads: Mutex<Vec<ThreadNet>>,
}

/// One thread's count in a [`ThreadTally`].
#[derive(Clone, Copy, Debug)]
struct ThreadNet {
    thread: ThreadId,
    /// Bytes the thread reserved minus bytes it released (whoever reserved them).
    net: i64,
    /// The highest `net` so far (at least 0: the start).
    peak: i64,
}

impl MemoryAccount {
    /// A ledger for `device_name` with an optional budget in bytes.
    pub fn new(device_name: String, budget: Option<u64>) -> Self {
        MemoryAccount {
            device_name,
            budget,
            in_use: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            tallying: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
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

    /// Starts counting, for each thread, the bytes it reserves on this ledger minus the bytes it
    /// releases, until the returned tally is dropped ([`ThreadTally::bound`] reads it). The
    /// counts are right only for work that starts and ends within the tally; one tally at a time.
    ///
    /// What it is for: bounding how far a multi-threaded call (a split layer's shards exchanging
    /// through collectives) takes the ledger above where it started, in every interleaving of its
    /// threads, from one run. See [`ThreadTally::bound`].
    pub fn tally_threads(self: &Arc<Self>) -> Result<ThreadTally> {
        let mut threads = self.lock_threads();
        if self.tallying.load(Ordering::Acquire) {
            return Err(Error::invalid(
                format!("memory tally on {}", self.device_name),
                "already counting: drop the other tally first",
            ));
        }
        threads.clear();
        self.tallying.store(true, Ordering::Release);
        Ok(ThreadTally { account: Arc::clone(self) })
    }

    fn lock_threads(&self) -> MutexGuard<'_, Vec<ThreadNet>> {
        self.threads.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Adds `delta` bytes to the calling thread's count, if a tally is counting.
    fn tally(&self, delta: i64) {
        if !self.tallying.load(Ordering::Acquire) {
            return;
        }
        let thread = std::thread::current().id();
        let mut threads = self.lock_threads();
        let at = match threads.iter().position(|t| t.thread == thread) {
            Some(at) => at,
            None => {
                threads.push(ThreadNet { thread, net: 0, peak: 0 });
                threads.len() - 1
            }
        };
        let count = &mut threads[at];
        count.net += delta;
        count.peak = count.peak.max(count.net);
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
                    self.tally(bytes as i64);
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
        self.tally(bytes as i64);
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
        self.account.tally(-(self.bytes as i64));
    }
}

/// Per-thread counts of the reserves and releases on one ledger ([`MemoryAccount::tally_threads`]);
/// counting stops when it is dropped.
#[derive(Debug)]
pub struct ThreadTally {
    account: Arc<MemoryAccount>,
}

impl ThreadTally {
    /// The sum over threads of each thread's highest net bytes (reserved minus released by that
    /// thread) since the tally started.
    ///
    /// At every moment the ledger holds its starting bytes plus the sum of the threads' nets, so
    /// this bounds how far above its start the ledger went. It bounds every other interleaving
    /// of the same work too when each thread's reserves and releases come in an order of its own
    /// (its program's, as in a split layer's shards, which block on collectives but never choose
    /// by what arrived first): each thread's highest net is then the same in every interleaving.
    /// A release of bytes another thread reserved (a collective message freed by its receiver)
    /// only lowers the releasing thread's count, which keeps the sum an upper bound.
    pub fn bound(&self) -> u64 {
        self.account.lock_threads().iter().map(|t| t.peak.max(0) as u64).sum()
    }
}

impl Drop for ThreadTally {
    fn drop(&mut self) {
        let mut threads = self.account.lock_threads();
        self.account.tallying.store(false, Ordering::Release);
        threads.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tally_sums_each_threads_highest_net_bytes() {
        let account = Arc::new(MemoryAccount::new("test".into(), None));
        let before = account.reserve(1000).unwrap();
        let tally = account.tally_threads().unwrap();
        assert!(account.tally_threads().is_err(), "one tally at a time");
        // This thread: 100, then 50 after freeing it (highest 100); a bystander's 1000 released
        // here only lowers this thread's count.
        let a = account.reserve(100).unwrap();
        drop(a);
        let _b = account.reserve(50).unwrap();
        drop(before);
        // Another thread: 30, released by this thread (a message freed by its receiver): the
        // other thread's highest stays 30.
        let message = std::thread::scope(|s| s.spawn(|| account.reserve(30).unwrap()).join().unwrap());
        drop(message);
        assert_eq!(tally.bound(), 130);
        drop(tally);
        let again = account.tally_threads().unwrap();
        assert_eq!(again.bound(), 0, "a new tally starts from nothing");
    }
}
