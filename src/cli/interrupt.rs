//! Ctrl-C (SIGINT) and SIGTERM during training: the first signal asks the run to stop, the second
//! ends the process at once.
//!
//! After [`install`], the first signal only sets a flag, which `conveyor train` reads between steps
//! (and between evaluation batches): the step under way finishes (a step is all-or-nothing, so the
//! parameters are never half-updated), no further step starts, and the run writes `--save`,
//! `--checkpoint`, `--metrics`, `--trace` and `--svg` as at a normal end, says where they are,
//! and exits with status 128 + the signal number (130 for SIGINT, 143 for SIGTERM). A second
//! signal calls `_exit` from the handler with the same status: every output is written through a
//! temporary file and a rename, so no file is ever left half-written; the temporary file of a
//! write cut short stays, recognisably named, until a later run removes it.
//!
//! The handler does only async-signal-safe things: atomic stores and, for the second signal,
//! `write(2)` of a fixed message and `_exit(2)`.
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

/// Signals received since [`install`].
static RECEIVED: AtomicUsize = AtomicUsize::new(0);
/// The first signal received (0: none).
static FIRST_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    let _ = FIRST_SIGNAL.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
    if RECEIVED.fetch_add(1, Ordering::SeqCst) >= 1 {
        const MESSAGE: &[u8] = b"\nconveyor: second signal, stopping now; the files on disk are whole\n";
        // SAFETY: write(2) and _exit(2) are async-signal-safe; MESSAGE outlives the call.
        unsafe {
            libc::write(libc::STDERR_FILENO, MESSAGE.as_ptr().cast(), MESSAGE.len());
            libc::_exit(128 + signal);
        }
    }
}

/// Installs the handler for SIGINT and SIGTERM (restarting interrupted system calls).
pub fn install() -> std::io::Result<()> {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction is valid; the handler is an `extern "C" fn(c_int)` that does
        // only async-signal-safe work; sigemptyset and sigaction get valid pointers.
        let rc = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as *const () as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The first signal received since [`install`], if any: the run should stop before its next step.
pub fn requested() -> Option<i32> {
    match FIRST_SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        signal => Some(signal),
    }
}

/// A signal's name for messages.
pub fn signal_name(signal: i32) -> String {
    match signal {
        libc::SIGINT => "SIGINT".to_owned(),
        libc::SIGTERM => "SIGTERM".to_owned(),
        other => format!("signal {other}"),
    }
}

/// A run stopped by a signal after writing its outputs: exit status 128 + the signal number.
#[derive(Debug)]
pub struct Interrupted {
    /// The signal.
    pub signal: i32,
    /// The steps the outputs hold.
    pub step: u64,
    /// The steps the run was to reach.
    pub total_steps: u64,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "interrupted by {} at step {} of {}", signal_name(self.signal), self.step, self.total_steps)
    }
}

impl std::error::Error for Interrupted {}
