//! Subcommand modules, the shared error reporting of the `conveyor` binary, and atomic file writes.
use std::io::Write;
use std::path::Path;

pub mod messages;
pub mod placement_file;
pub mod plan;
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
    eprintln!("error: {err:#}");
    let bad_input = err.downcast_ref::<UsageError>().is_some()
        || matches!(
            err.downcast_ref::<conveyor::engine::Error>(),
            Some(
                conveyor::engine::Error::InvalidArgument { .. }
                    | conveyor::engine::Error::ShapeMismatch { .. }
                    | conveyor::engine::Error::DoesNotFit { .. }
                    | conveyor::engine::Error::CudaUnavailable(_)
                    | conveyor::engine::Error::NotOnHost { .. }
                    | conveyor::engine::Error::Checkpoint { .. }
                    | conveyor::engine::Error::Schedule(_)
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

/// Writes `contents` to `path` so that readers see the old file or the whole new one, never a
/// part: into a temporary file in the same directory, then renamed over `path` (the temporary
/// file is removed if anything fails). A path the user can fix (a missing directory, a
/// directory, no permission) is a usage error, exit code 2.
pub fn write_atomically(path: &Path, flag: &str, contents: &str) -> anyhow::Result<()> {
    let bad_path = |why: String| usage(format!("cannot write {flag} {}: {why}", path.display()));
    let Some(file_name) = path.file_name() else {
        return Err(bad_path("not a file name; give a path such as out/timeline.svg".to_owned()));
    };
    if path.is_dir() {
        return Err(bad_path("it is a directory; give a file path inside it".to_owned()));
    }
    let directory = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    if !directory.is_dir() {
        return Err(bad_path(format!("directory {} does not exist; create it first", directory.display())));
    }
    let mut temporary_name = std::ffi::OsString::from(".");
    temporary_name.push(file_name);
    temporary_name.push(format!(".{}.tmp", std::process::id()));
    let temporary = directory.join(temporary_name);
    let result = std::fs::File::create(&temporary)
        .and_then(|mut file| {
            file.write_all(contents.as_bytes())?;
            file.sync_all()
        })
        .and_then(|()| std::fs::rename(&temporary, path));
    if let Err(err) = result {
        let _ = std::fs::remove_file(&temporary);
        return Err(match err.kind() {
            std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::NotFound | std::io::ErrorKind::IsADirectory => {
                bad_path(err.to_string())
            }
            _ => anyhow::Error::new(err).context(format!("writing {flag} {}", path.display())),
        });
    }
    Ok(())
}
