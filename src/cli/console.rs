//! Standard output and standard error that never panic: `println!` panics when stdout is a closed
//! pipe (`conveyor train | head -1`) or a full device (`> /dev/full`), which used to kill a run
//! before it saved anything. Every line the training path prints goes through [`outln!`] or
//! [`errln!`] (and the `tracing` logs through [`StderrWriter`]): a write that fails is recorded,
//! that stream stays silent from then on, and the run goes on to finish and write its files.
//!
//! What the exit status says ([`exit_code`]), decided as ripgrep does:
//! - a **broken pipe** (the reader went away, as `head` does once it has its lines) is not a
//!   failure: nothing more is printed and the status is the run's own (0 when it succeeded);
//! - **any other write error** on stdout or stderr (a full disk or device, an I/O error) lost
//!   output the user asked for: a run that otherwise succeeded exits 1, with one line on stderr
//!   naming the stream and the error when stderr still works. A run that failed keeps its status.
use std::io::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};

/// A stream's state: whether writing it failed, and how.
struct Stream {
    /// [`OK`], [`BROKEN_PIPE`] or [`FAILED`].
    state: AtomicU8,
    /// The first error other than a broken pipe, for the final message.
    error: Mutex<Option<String>>,
}

const OK: u8 = 0;
const BROKEN_PIPE: u8 = 1;
const FAILED: u8 = 2;

static STDOUT: Stream = Stream { state: AtomicU8::new(OK), error: Mutex::new(None) };
static STDERR: Stream = Stream { state: AtomicU8::new(OK), error: Mutex::new(None) };

/// Silences stdout and stderr from here on, without counting it a failure (an MPI rank other than
/// rank 0: rank 0 speaks for the job).
pub fn silence() {
    STDOUT.state.store(BROKEN_PIPE, Ordering::Relaxed);
    STDERR.state.store(BROKEN_PIPE, Ordering::Relaxed);
}

impl Stream {
    fn write(&self, bytes: &[u8], mut sink: impl Write) {
        if self.state.load(Ordering::Relaxed) != OK {
            return;
        }
        if let Err(e) = sink.write_all(bytes).and_then(|()| sink.flush()) {
            self.record(&e);
        }
    }

    fn record(&self, error: &std::io::Error) {
        if error.kind() == std::io::ErrorKind::BrokenPipe {
            let _ = self.state.compare_exchange(OK, BROKEN_PIPE, Ordering::Relaxed, Ordering::Relaxed);
        } else {
            self.state.store(FAILED, Ordering::Relaxed);
            let mut first = self.error.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            first.get_or_insert_with(|| error.to_string());
        }
    }

    fn failure(&self) -> Option<String> {
        if self.state.load(Ordering::Relaxed) != FAILED {
            return None;
        }
        let error = self.error.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        Some(error.clone().unwrap_or_default())
    }
}

/// Writes `text` to stdout unless an earlier write failed; a failure is recorded, never a panic.
pub fn out(text: &str) {
    STDOUT.write(text.as_bytes(), std::io::stdout().lock());
}

/// Writes `text` to stderr unless an earlier write failed; a failure is recorded, never a panic.
pub fn err(text: &str) {
    STDERR.write(text.as_bytes(), std::io::stderr().lock());
}

/// `println!` that never panics (see the module docs).
macro_rules! outln {
    () => {
        $crate::cli::console::out("\n")
    };
    ($($arg:tt)*) => {
        $crate::cli::console::out(&format!("{}\n", format_args!($($arg)*)))
    };
}

/// `eprintln!` that never panics (see the module docs).
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::cli::console::err(&format!("{}\n", format_args!($($arg)*)))
    };
}

pub(crate) use {errln, outln};

/// Standard error for the `tracing` subscriber: writes through [`err`] and always reports
/// success, so a failed stderr silences the logs instead of making the subscriber panic.
pub struct StderrWriter;

impl Write for StderrWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        STDERR.write(bytes, std::io::stderr().lock());
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The process's exit status given the run's own `code`: a run that succeeded but could not write
/// stdout or stderr (other than a broken pipe) exits 1 (see the module docs).
pub fn exit_code(code: i32) -> i32 {
    let out_failure = STDOUT.failure();
    let err_failure = STDERR.failure();
    if let Some(error) = &out_failure {
        err(&format!("error: could not write to stdout ({error}); what followed was not shown\n"));
    }
    if code == 0 && (out_failure.is_some() || err_failure.is_some()) { 1 } else { code }
}
