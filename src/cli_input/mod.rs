//! Parsers of what the `conveyor` command line reads besides data files: flag values (sizes,
//! device lists, learning-rate schedules, the non-finite policy), placement files, and the run
//! state a training checkpoint carries as metadata.
//!
//! They live in the library, not the binary, so `tests/fuzz_readers.rs` can call them directly
//! on mutated input; the binary re-exports them. Every problem is a [`UsageError`] whose message
//! names the flag, the value, what is wrong and what would fix it (exit status 2 in the CLI).
//! Counts and sizes are checked against [`crate::limits`].
mod placement;
mod run_state;
mod values;

pub use placement::{parse_placement, read_placement_file};
pub use run_state::{RUN_STATE_KEY_PREFIX, RunState, SPEC_KEY, data_fingerprint};
pub use values::{BucketSize, LrSchedule, OnNonFinite, exact_size, parse_devices, parse_size};

/// A problem with what the user gave: the message says what was wrong and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// Builds a [`UsageError`] from a message.
pub(crate) fn usage(message: impl Into<String>) -> UsageError {
    UsageError(message.into())
}
