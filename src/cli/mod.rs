//! Subcommand modules and the shared error reporting of the `conveyor` binary.
pub mod plan;
pub mod simulate;
pub mod train;

/// A problem with what the user gave us: printed to stderr, exit code 2.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// Builds a usage error (exit code 2) from a message that says what was wrong and how to fix it.
pub fn usage(message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(UsageError(message.into()))
}

/// Prints the error chain to stderr and returns the process exit code for it.
pub fn report(err: &anyhow::Error) -> i32 {
    eprintln!("error: {err:#}");
    let bad_input = err.downcast_ref::<UsageError>().is_some()
        || matches!(
            err.downcast_ref::<conveyor::engine::Error>(),
            Some(
                conveyor::engine::Error::InvalidArgument { .. }
                    | conveyor::engine::Error::ShapeMismatch { .. }
                    | conveyor::engine::Error::DoesNotFit { .. }
                    | conveyor::engine::Error::CudaUnavailable(_)
                    | conveyor::engine::Error::Checkpoint { .. }
                    | conveyor::engine::Error::Schedule(_)
            )
        );
    if bad_input { 2 } else { 1 }
}
