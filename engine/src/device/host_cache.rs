//! Freed host memory kept for reuse: the process's C allocator (glibc's malloc) as the host
//! devices' caching allocator.
//!
//! Every op on a CPU device returns a fresh tensor, and glibc's defaults give the largest of them
//! fresh pages every time: a block above the mmap threshold (128 KiB at first, raised to the size
//! of the largest block freed so far) is mapped on allocation and unmapped on free, and free
//! memory at the top of a heap above the trim threshold (128 KiB) is handed back to the kernel.
//! So each step of a training run touched the same activations' pages afresh, and each first
//! touch is a page fault that zero-fills a page. Measured on the 2-core development machine
//! (`conveyor train --devices cpu:1 --microbatches 1 --batch 256 --steps 40`, transformer on
//! `tokens:4096,16,32,10`): 224,469 minor faults and 2.19 s; with both thresholds raised, 11,308
//! faults and 1.35 s, the peak resident set 53 MB against 50 MB (each threshold alone did not
//! help: 414,969 and 228,153 faults).
//!
//! [`retain_freed_host_memory`] raises both: blocks up to 32 MiB (glibc's largest mmap threshold)
//! come from the heaps, and freed memory stays in the process to be handed out again, as a
//! caching allocator keeps it (PyTorch's CUDA allocator, for one). Tensors still reserve and
//! release exactly their bytes on their device's ledger, so the memory plan and budgets are
//! unchanged; what the process holds from the operating system is instead the high-water mark of
//! what was allocated, plus fragmentation. The trainer calls it when it is built, unless told not
//! to (`TrainerBuilder::retain_freed_host_memory`). Elsewhere than Linux with glibc it does
//! nothing.

/// glibc's largest mmap threshold on 64-bit targets (`DEFAULT_MMAP_THRESHOLD_MAX`): a larger
/// value is refused.
pub const MMAP_THRESHOLD_BYTES: usize = 32 << 20;

/// Makes the C allocator keep freed host memory for reuse (see the module docs); process-wide and
/// idempotent. Returns whether the allocator took the settings (false elsewhere than Linux with
/// glibc).
pub fn retain_freed_host_memory() -> bool {
    retain()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn retain() -> bool {
    // SAFETY: mallopt only changes the allocator's thresholds; it is thread-safe in glibc (it
    // takes each arena's lock).
    unsafe {
        let trim = libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
        let mmap = libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES as libc::c_int);
        trim == 1 && mmap == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn retain() -> bool {
    false
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    /// Minor page faults of the calling thread so far.
    fn thread_faults() -> i64 {
        let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: getrusage writes the struct it is given.
        let usage = unsafe {
            assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr()), 0);
            usage.assume_init()
        };
        usage.ru_minflt
    }

    /// Allocates and fills 8 MiB, then frees it; returns the faults that took.
    fn fill_and_free() -> i64 {
        let before = thread_faults();
        let buffer = std::hint::black_box(vec![1.0f32; 2 << 20]);
        drop(buffer);
        thread_faults() - before
    }

    #[test]
    fn a_freed_buffer_is_reused_without_fresh_pages() {
        assert!(retain_freed_host_memory(), "glibc takes both thresholds");
        assert!(retain_freed_host_memory(), "a second call is harmless");
        // The first round may grow the heap (2,048 pages of 4 KiB); the second reuses it.
        fill_and_free();
        let again = fill_and_free();
        assert!(again < 64, "the second 8 MiB buffer took {again} page faults (2,048 if it had fresh pages)");
    }
}
