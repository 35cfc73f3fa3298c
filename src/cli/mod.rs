//! Subcommand modules, the shared error reporting of the `conveyor` binary, output files, streams
//! that never panic ([`console`]) and signal handling ([`interrupt`]).
use std::io::Write;
use std::path::Path;

use conveyor::engine::output_file;

pub mod bench;
pub mod console;
pub mod interrupt;
pub mod messages;
pub mod placement_file;
pub mod plan;
pub mod plan_auto;
pub mod plan_flags;
mod plan_tp;
pub mod ranks;
pub mod simulate;
pub mod train;

/// A problem with what the user gave us: printed to stderr, exit code 2. It lives in the library
/// with the parsers of `conveyor::cli_input`, which return it.
pub use conveyor::cli_input::UsageError;

/// Builds a usage error (exit code 2) from a message that says what was wrong and how to fix it.
pub fn usage(message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(UsageError(message.into()))
}

/// Prints the error chain to stderr and returns the process exit code for it.
pub fn report(err: &anyhow::Error) -> i32 {
    if let Some(interrupted) = err.downcast_ref::<interrupt::Interrupted>() {
        console::err(&format!("conveyor: {interrupted}\n"));
        return 128 + interrupted.signal;
    }
    console::err(&format!("error: {err:#}\n"));
    let bad_input = err.downcast_ref::<UsageError>().is_some()
        || err.downcast_ref::<ranks::UsageOnEveryRank>().is_some()
        || matches!(
            err.downcast_ref::<conveyor::engine::Error>(),
            Some(
                conveyor::engine::Error::InvalidArgument { .. }
                    | conveyor::engine::Error::ShapeMismatch { .. }
                    | conveyor::engine::Error::DoesNotFit { .. }
                    | conveyor::engine::Error::CudaUnavailable(_)
                    | conveyor::engine::Error::NotOnHost { .. }
                    | conveyor::engine::Error::Checkpoint { .. }
                    | conveyor::engine::Error::OutputPath { .. }
                    | conveyor::engine::Error::Schedule(_)
                    | conveyor::engine::Error::WorldSize { .. }
                    | conveyor::engine::Error::MpiNotBuilt
            )
        );
    let diverged =
        matches!(err.downcast_ref::<conveyor::engine::Error>(), Some(conveyor::engine::Error::NonFiniteStep { .. }));
    if bad_input {
        2
    } else if diverged {
        3
    } else {
        1
    }
}

/// Writes `contents` to `path` as every output is written ([`output_file`]): readers see the old
/// file or the whole new one, never a part (a temporary file renamed over it); a symbolic link is
/// followed and kept, a character device or FIFO is written straight through, a directory is
/// refused. A path the user can fix (a missing directory, a directory, no permission) is a usage
/// error, exit code 2.
pub fn write_atomically(path: &Path, flag: &str, contents: &str) -> anyhow::Result<()> {
    output_file::check_output(path).map_err(|e| output_error(flag, path, e))?;
    output_file::write_output(path, |file| file.write_all(contents.as_bytes())).map_err(|e| output_error(flag, path, e))
}

/// An output's error for the user: a path they can fix (refused by [`output_file`], a missing
/// directory, no permission, a read-only file system) is a usage error naming `flag` (exit code
/// 2); anything else (a full disk, an I/O error) is a failure, exit code 1.
pub fn output_error(flag: &str, path: &Path, error: conveyor::engine::Error) -> anyhow::Error {
    use std::io::ErrorKind;
    match error {
        conveyor::engine::Error::OutputPath { reason, .. } => {
            usage(format!("cannot write {flag} {}: {reason}", path.display()))
        }
        conveyor::engine::Error::Io { source, .. }
            if matches!(
                source.kind(),
                ErrorKind::PermissionDenied
                    | ErrorKind::NotFound
                    | ErrorKind::IsADirectory
                    | ErrorKind::ReadOnlyFilesystem
            ) =>
        {
            usage(format!("cannot write {flag} {}: {source}", path.display()))
        }
        other => anyhow::Error::new(other).context(format!("writing {flag} {}", path.display())),
    }
}
