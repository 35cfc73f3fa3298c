//! Output files that never destroy what they must not: the one place that decides how a file the
//! user named for output (a checkpoint, a metrics log, a trace, a chart) is written.
//!
//! # What a write to `path` does
//!
//! Symbolic links are followed first (up to [`MAX_SYMLINK_HOPS`]): the link stays and its target
//! is written, as a shell's `>` would. Then, by what is there:
//!
//! - **nothing, or a regular file**: written atomically. The bytes go to a temporary file beside
//!   the target, named [`temporary_name`] (`.<name>.conveyor-tmp-<pid>-<n>`), which is fsynced
//!   and renamed over the target (keeping the old file's permission bits), then the directory is
//!   fsynced. Readers see the old file or the whole new one, never a part; on any failure the
//!   temporary file is removed and the old file is untouched.
//! - **a character device or a FIFO** (`/dev/null`, a terminal, a named pipe, `/dev/stdout` when
//!   it is a terminal or a pipe): written straight through, never replaced. (Renaming over `/dev/null`, as root, used to turn the
//!   device node into a regular file.) A FIFO blocks the write until a reader opens it.
//! - **a directory, a block device or a socket**: refused with [`Error::OutputPath`], before
//!   anything is written.
//!
//! [`check_output`] makes the same decision without writing anything but a probe: callers run it
//! for every output before a long computation (training), so a path that cannot be written is
//! reported at the start rather than after the work whose result it was to hold.
//!
//! # Leftovers
//!
//! A process killed during a write (SIGKILL, a power cut) leaves its temporary file. The name says
//! whose it was, and [`remove_stale_temporaries`] (run by [`check_output`] on the directory)
//! removes those of processes that are no longer alive and that nobody has touched for
//! [`STALE_AFTER`]: the age guards a writer in another PID namespace or on another host sharing the
//! directory, whose process number means nothing here and whose file must not vanish mid-write.
//!
//! We rejected writing in place with a "complete" marker (readers would have to know the marker)
//! and replacing whatever is at the path (it destroys device nodes and symbolic links).
use std::ffi::{OsStr, OsString};
use std::fs::{self, File, Metadata, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use crate::{Error, Result};

/// How many symbolic links a path may go through before it is refused as a loop.
pub const MAX_SYMLINK_HOPS: usize = 40;

/// How long a dead process's temporary file must have been left untouched before
/// [`remove_stale_temporaries`] removes it.
pub const STALE_AFTER: Duration = Duration::from_secs(300);

/// The marker in every temporary file name: `.<name>.conveyor-tmp-<pid>-<n>`.
const TEMPORARY_MARKER: &str = ".conveyor-tmp-";

/// Bytes of the target's name kept in a temporary name, so the whole stays under the usual
/// 255-byte limit of a file name.
const MAX_NAME_IN_TEMPORARY: usize = 200;

/// What an output path holds, after following symbolic links.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputKind {
    /// Nothing yet: the file will be created (atomically).
    New,
    /// A regular file: replaced atomically.
    RegularFile,
    /// A character device such as `/dev/null`: written straight through.
    CharDevice,
    /// A named pipe: written straight through.
    Fifo,
}

impl OutputKind {
    /// Whether writes go through a temporary file and a rename.
    pub fn is_atomic(self) -> bool {
        matches!(self, OutputKind::New | OutputKind::RegularFile)
    }
}

/// An output path resolved: where the bytes will go and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputTarget {
    /// The path as given.
    pub requested: PathBuf,
    /// The file actually written: `requested` with its symbolic links followed.
    pub resolved: PathBuf,
    /// What is there.
    pub kind: OutputKind,
}

impl OutputTarget {
    /// The directory the resolved file lives in (where a temporary file goes).
    pub fn directory(&self) -> PathBuf {
        directory_of(&self.resolved)
    }
}

fn directory_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn refuse(path: &Path, reason: impl Into<String>) -> Error {
    Error::OutputPath { path: path.display().to_string(), reason: reason.into() }
}

/// Follows `path`'s symbolic links and says what is there, refusing what must not be written
/// (a directory, a block device, a socket, a path that names no file, a symbolic-link loop).
/// Touches nothing.
pub fn resolve_output(path: impl AsRef<Path>) -> Result<OutputTarget> {
    let requested = path.as_ref().to_path_buf();
    let mut current = requested.clone();
    for _ in 0..=MAX_SYMLINK_HOPS {
        let metadata = match fs::symlink_metadata(&current) {
            Ok(metadata) => Some(metadata),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {
                return Err(refuse(&requested, "a component of its directory is a file, not a directory"));
            }
            Err(e) => return Err(refuse(&requested, format!("cannot look at it: {e}"))),
        };
        if let Some(metadata) = &metadata
            && metadata.file_type().is_symlink()
        {
            // A link the kernel resolves to a device or a pipe (`/dev/stdout`, `/proc/self/fd/1`,
            // whose text is `pipe:[...]`, not a path) is opened through the link.
            if let Ok(followed) = fs::metadata(&current)
                && let Some(kind) = straight_through_kind(&followed)
            {
                return Ok(OutputTarget { requested, resolved: current, kind });
            }
            let link = fs::read_link(&current).map_err(|e| refuse(&requested, format!("cannot read the link: {e}")))?;
            current = if link.is_absolute() { link } else { directory_of(&current).join(link) };
            continue;
        }
        let kind = classify(&requested, &current, metadata.as_ref())?;
        if current.file_name().is_none() {
            return Err(refuse(&requested, "it does not name a file; give a path such as out/run.safetensors"));
        }
        return Ok(OutputTarget { requested, resolved: current, kind });
    }
    Err(refuse(&requested, format!("more than {MAX_SYMLINK_HOPS} symbolic links (a loop?)")))
}

fn straight_through_kind(metadata: &Metadata) -> Option<OutputKind> {
    let file_type = metadata.file_type();
    if file_type.is_char_device() {
        Some(OutputKind::CharDevice)
    } else if file_type.is_fifo() {
        Some(OutputKind::Fifo)
    } else {
        None
    }
}

fn classify(requested: &Path, resolved: &Path, metadata: Option<&Metadata>) -> Result<OutputKind> {
    let Some(metadata) = metadata else { return Ok(OutputKind::New) };
    let file_type = metadata.file_type();
    let through = if requested == resolved { String::new() } else { format!(" ({})", resolved.display()) };
    if file_type.is_file() {
        Ok(OutputKind::RegularFile)
    } else if let Some(kind) = straight_through_kind(metadata) {
        Ok(kind)
    } else if file_type.is_dir() {
        Err(refuse(requested, format!("it is a directory{through}; give a file path inside it")))
    } else if file_type.is_block_device() {
        Err(refuse(
            requested,
            format!("it is a block device{through}; conveyor writes only files, character devices and FIFOs"),
        ))
    } else {
        Err(refuse(
            requested,
            format!("it is a socket{through}; conveyor writes only files, character devices and FIFOs"),
        ))
    }
}

/// Checks, before any real work, that `path` can be written as [`OutputFile::create`] would:
/// [`resolve_output`], then for a file written atomically, that its directory exists and a file
/// can be created and removed there (a probe with a temporary name), removing stale temporary
/// files of killed writers on the way. Character devices and FIFOs are not opened.
pub fn check_output(path: impl AsRef<Path>) -> Result<OutputTarget> {
    let target = resolve_output(path)?;
    if !target.kind.is_atomic() {
        return Ok(target);
    }
    let directory = target.directory();
    match fs::metadata(&directory) {
        Ok(metadata) if metadata.is_dir() => {}
        Ok(_) => return Err(refuse(&target.requested, format!("{} is not a directory", directory.display()))),
        Err(_) => {
            return Err(refuse(
                &target.requested,
                format!("directory {} does not exist; create it first", directory.display()),
            ));
        }
    }
    let file_name = target.resolved.file_name().unwrap_or(OsStr::new("output"));
    let probe = directory.join(temporary_name(file_name));
    match OpenOptions::new().write(true).create_new(true).open(&probe) {
        Ok(file) => {
            drop(file);
            let _ = fs::remove_file(&probe);
        }
        Err(e) => {
            let why = match e.kind() {
                std::io::ErrorKind::PermissionDenied => "permission denied".to_owned(),
                std::io::ErrorKind::ReadOnlyFilesystem => "a read-only file system".to_owned(),
                _ => e.to_string(),
            };
            return Err(refuse(
                &target.requested,
                format!("cannot create a file in directory {} ({why})", directory.display()),
            ));
        }
    }
    remove_stale_temporaries(&directory);
    Ok(target)
}

/// The temporary name for a write to `file_name`: `.<file name>.conveyor-tmp-<pid>-<n>`, unique
/// across the threads of a process (`n` counts) and, with the process id, across processes.
pub fn temporary_name(file_name: &OsStr) -> OsString {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = file_name.to_string_lossy();
    let mut end = name.len().min(MAX_NAME_IN_TEMPORARY);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    OsString::from(format!(".{}{TEMPORARY_MARKER}{}-{n}", &name[..end], std::process::id()))
}

/// The process id in a name made by [`temporary_name`]; `None` for any other name.
pub fn temporary_owner(name: &OsStr) -> Option<u32> {
    let name = name.to_str()?;
    let rest = name.strip_prefix('.')?;
    let (_, tail) = rest.rsplit_once(TEMPORARY_MARKER)?;
    let (pid, n) = tail.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (digits(pid) && digits(n)).then(|| pid.parse().ok()).flatten()
}

/// Whether process `pid` is alive on this machine (or exists and is not ours to signal).
fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
    if pid <= 0 {
        return true;
    }
    // SAFETY: signal 0 checks for existence and permission only; nothing is delivered.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Removes from `directory` the temporary files of [`temporary_name`]'s pattern whose process is
/// no longer alive and which were last modified more than [`STALE_AFTER`] ago; returns how many.
/// Best effort: what cannot be read or removed is left.
pub fn remove_stale_temporaries(directory: &Path) -> usize {
    let Ok(entries) = fs::read_dir(directory) else { return 0 };
    let mut removed = 0;
    for entry in entries.flatten() {
        let Some(pid) = temporary_owner(&entry.file_name()) else { continue };
        if pid == std::process::id() || process_alive(pid) {
            continue;
        }
        let Ok(metadata) = entry.path().symlink_metadata() else { continue };
        let untouched = metadata.modified().ok().and_then(|m| SystemTime::now().duration_since(m).ok());
        if metadata.is_file() && untouched.is_some_and(|age| age > STALE_AFTER) && fs::remove_file(entry.path()).is_ok()
        {
            removed += 1;
        }
    }
    removed
}

/// An output being written: a temporary file renamed over the target by [`OutputFile::commit`],
/// or a character device or FIFO written straight through. Dropped without a commit, the
/// temporary file is removed and the target keeps its previous contents.
pub struct OutputFile {
    file: Option<File>,
    /// Bytes written so far (for [`inject_write_fault`]).
    written: u64,
    target: OutputTarget,
    /// The temporary file while it is ours to remove.
    temporary: Option<PathBuf>,
}

impl OutputFile {
    /// Opens `path` for output (see the module docs for what happens to what is there).
    pub fn create(path: impl AsRef<Path>) -> Result<OutputFile> {
        let target = resolve_output(path)?;
        if !target.kind.is_atomic() {
            let file = OpenOptions::new().write(true).open(&target.resolved).map_err(io_error(&target.resolved))?;
            return Ok(OutputFile { file: Some(file), written: 0, target, temporary: None });
        }
        let file_name = target.resolved.file_name().unwrap_or(OsStr::new("output"));
        let temporary = target.directory().join(temporary_name(file_name));
        let file = OpenOptions::new().write(true).create_new(true).open(&temporary).map_err(io_error(&temporary))?;
        Ok(OutputFile { file: Some(file), written: 0, target, temporary: Some(temporary) })
    }

    /// Where the bytes go.
    pub fn target(&self) -> &OutputTarget {
        &self.target
    }

    /// The file being written: the temporary file, or the device.
    pub fn writing_to(&self) -> &Path {
        self.temporary.as_deref().unwrap_or(&self.target.resolved)
    }

    /// Finishes the write: flushes and fsyncs the temporary file, gives it the permission bits of
    /// the file it replaces, renames it over the target and fsyncs the directory. For a device or
    /// FIFO, flushes.
    pub fn commit(mut self) -> Result<()> {
        let mut file = self.file.take().expect("an uncommitted output has its file");
        let writing_to = self.writing_to().to_path_buf();
        file.flush().map_err(io_error(&writing_to))?;
        let Some(temporary) = self.temporary.clone() else { return Ok(()) };
        file.sync_all().map_err(io_error(&temporary))?;
        if self.target.kind == OutputKind::RegularFile
            && let Ok(previous) = fs::metadata(&self.target.resolved)
        {
            let _ = file.set_permissions(previous.permissions());
        }
        drop(file);
        fs::rename(&temporary, &self.target.resolved).map_err(io_error(&self.target.resolved))?;
        self.temporary = None;
        // Make the rename itself durable. Best effort: the new file is already in place, so a
        // failure here must not be reported as a failed write.
        if let Ok(directory) = File::open(self.target.directory()) {
            let _ = directory.sync_all();
        }
        Ok(())
    }
}

thread_local! {
    /// The byte count after which this thread's next output write fails ([`inject_write_fault`]).
    static WRITE_FAULT: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// Makes the next output written on this thread fail once it has written `after_bytes` bytes (as
/// a full disk would, part of the data already in the temporary file), for testing what a failed
/// write leaves behind; `None` clears it. The fault strikes once.
pub fn inject_write_fault(after_bytes: Option<u64>) {
    WRITE_FAULT.with(|fault| fault.set(after_bytes));
}

impl OutputFile {
    /// Fails the write of `bytes` if an injected fault strikes within it, after writing the bytes
    /// up to the fault.
    fn injected_fault(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        let Some(limit) = WRITE_FAULT.with(std::cell::Cell::get) else { return Ok(()) };
        if self.written + bytes.len() as u64 <= limit {
            return Ok(());
        }
        WRITE_FAULT.with(|fault| fault.set(None));
        let before = (limit.saturating_sub(self.written) as usize).min(bytes.len());
        self.file.as_mut().expect("an uncommitted output has its file").write_all(&bytes[..before])?;
        Err(std::io::Error::new(std::io::ErrorKind::StorageFull, "injected write failure"))
    }
}

impl Write for OutputFile {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.injected_fault(bytes)?;
        let n = self.file.as_mut().expect("an uncommitted output has its file").write(bytes)?;
        self.written += n as u64;
        Ok(n)
    }

    fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.injected_fault(bytes)?;
        self.file.as_mut().expect("an uncommitted output has its file").write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.as_mut().expect("an uncommitted output has its file").flush()
    }
}

impl Drop for OutputFile {
    fn drop(&mut self) {
        drop(self.file.take());
        if let Some(temporary) = self.temporary.take() {
            let _ = fs::remove_file(temporary);
        }
    }
}

/// Writes a whole output at once: [`OutputFile::create`], `write_contents`, [`OutputFile::commit`].
/// If `write_contents` or any file operation fails (or panics), the temporary file is removed, the
/// target keeps its previous contents, and the error carries the path it concerns.
pub fn write_output(
    path: impl AsRef<Path>,
    write_contents: impl FnOnce(&mut OutputFile) -> std::io::Result<()>,
) -> Result<()> {
    let mut output = OutputFile::create(path)?;
    write_contents(&mut output)
        .map_err(|e| Error::Io { path: output.writing_to().display().to_string(), source: e })?;
    output.commit()
}

/// Wraps an I/O error with the path it concerns.
fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.display().to_string(), source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temporary_names_carry_the_owner_and_only_they_parse() {
        let name = temporary_name(OsStr::new("model.safetensors"));
        let text = name.to_str().unwrap();
        assert!(text.starts_with(".model.safetensors.conveyor-tmp-"), "{text}");
        assert_eq!(temporary_owner(&name), Some(std::process::id()));
        for other in ["model.safetensors", ".model.safetensors.tmp-12-3", ".a.conveyor-tmp-12", ".a.conveyor-tmp-x-1"] {
            assert_eq!(temporary_owner(OsStr::new(other)), None, "{other}");
        }
        let long = "x".repeat(400);
        assert!(temporary_name(OsStr::new(&long)).len() < 255);
        assert!(temporary_owner(&temporary_name(OsStr::new(&long))).is_some());
    }

    #[test]
    fn this_process_is_alive_and_an_impossible_pid_is_not() {
        assert!(process_alive(std::process::id()));
        assert!(!process_alive(i32::MAX as u32 - 1));
    }
}
