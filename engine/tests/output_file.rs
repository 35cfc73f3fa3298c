//! Output files (`conveyor_engine::output_file`): regular files replaced atomically, symbolic links
//! followed and kept, character devices written straight through and never replaced, directories
//! and block devices refused, unwritable directories caught by the probe, and the temporary files
//! of killed writers removed once stale and never while their writer may live.
mod common;

use std::io::Write;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;

use common::TempDir;
use std::time::{Duration, SystemTime};

use conveyor_engine::Error;
use conveyor_engine::output_file::{
    self, OutputFile, OutputKind, STALE_AFTER, check_output, remove_stale_temporaries, resolve_output, temporary_name,
    write_output,
};

fn write_text(path: &Path, text: &str) -> conveyor_engine::Result<()> {
    write_output(path, |file| file.write_all(text.as_bytes()))
}

#[test]
fn a_regular_file_is_replaced_whole_keeping_its_permissions() {
    let dir = TempDir::new("regular");
    let path = dir.join("out.txt");
    std::fs::write(&path, "old").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    write_text(&path, "new").unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(dir.entries(), ["out.txt"]);
}

#[test]
fn a_symbolic_link_is_followed_and_kept() {
    let dir = TempDir::new("symlink");
    std::fs::create_dir(dir.join("real")).unwrap();
    std::fs::write(dir.join("real/target.txt"), "old").unwrap();
    std::os::unix::fs::symlink("real/target.txt", dir.join("link.txt")).unwrap();
    // A chain of two links, one of them absolute.
    std::os::unix::fs::symlink(dir.join("link.txt"), dir.join("link2.txt")).unwrap();
    assert_eq!(resolve_output(dir.join("link2.txt")).unwrap().resolved, dir.join("real/target.txt"));
    write_text(&dir.join("link2.txt"), "new").unwrap();
    assert!(std::fs::symlink_metadata(dir.join("link.txt")).unwrap().file_type().is_symlink());
    assert!(std::fs::symlink_metadata(dir.join("link2.txt")).unwrap().file_type().is_symlink());
    assert_eq!(std::fs::read_to_string(dir.join("real/target.txt")).unwrap(), "new");
    // A dangling link: its target is created, as a shell's `>` would.
    std::os::unix::fs::symlink("real/fresh.txt", dir.join("dangling.txt")).unwrap();
    write_text(&dir.join("dangling.txt"), "fresh").unwrap();
    assert_eq!(std::fs::read_to_string(dir.join("real/fresh.txt")).unwrap(), "fresh");
    assert!(std::fs::symlink_metadata(dir.join("dangling.txt")).unwrap().file_type().is_symlink());
    assert_eq!(std::fs::read_dir(dir.join("real")).unwrap().count(), 2, "no temporary file left");
}

#[test]
fn a_symbolic_link_loop_is_refused() {
    let dir = TempDir::new("loop");
    std::os::unix::fs::symlink("b", dir.join("a")).unwrap();
    std::os::unix::fs::symlink("a", dir.join("b")).unwrap();
    match write_text(&dir.join("a"), "x").unwrap_err() {
        Error::OutputPath { reason, .. } => assert!(reason.contains("symbolic links"), "{reason}"),
        other => panic!("expected OutputPath, got {other:?}"),
    }
}

#[test]
fn dev_null_is_written_straight_through_and_stays_a_device() {
    let target = check_output("/dev/null").unwrap();
    assert_eq!(target.kind, OutputKind::CharDevice);
    write_text(Path::new("/dev/null"), "discarded").unwrap();
    let mut output = OutputFile::create("/dev/null").unwrap();
    output.write_all(b"discarded too").unwrap();
    assert_eq!(output.writing_to(), Path::new("/dev/null"));
    output.commit().unwrap();
    assert!(std::fs::symlink_metadata("/dev/null").unwrap().file_type().is_char_device());
    // /dev/full takes the open but fails the write: an I/O error, and still a device.
    let err = write_text(Path::new("/dev/full"), "x").unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert!(std::fs::symlink_metadata("/dev/full").unwrap().file_type().is_char_device());
}

#[test]
fn directories_and_paths_naming_no_file_are_refused() {
    let dir = TempDir::new("dirs");
    for path in [dir.0.clone(), dir.join("."), dir.join("..")] {
        match check_output(&path).unwrap_err() {
            Error::OutputPath { reason, .. } => assert!(reason.contains("directory"), "{}: {reason}", path.display()),
            other => panic!("expected OutputPath, got {other:?}"),
        }
    }
    std::fs::write(dir.join("file"), "x").unwrap();
    match check_output(dir.join("file/inside.txt")).unwrap_err() {
        Error::OutputPath { reason, .. } => assert!(reason.contains("not a directory"), "{reason}"),
        other => panic!("expected OutputPath, got {other:?}"),
    }
    match check_output(dir.join("missing/out.txt")).unwrap_err() {
        Error::OutputPath { reason, .. } => assert!(reason.contains("does not exist"), "{reason}"),
        other => panic!("expected OutputPath, got {other:?}"),
    }
    assert_eq!(dir.entries(), ["file"], "the probe leaves nothing");
}

#[test]
fn a_block_device_is_refused_when_one_exists() {
    let Some(block) = std::fs::read_dir("/dev")
        .unwrap()
        .flatten()
        .find(|e| e.file_type().is_ok_and(|t| t.is_block_device()))
        .map(|e| e.path())
    else {
        eprintln!("skipped: no block device under /dev");
        return;
    };
    match resolve_output(&block).unwrap_err() {
        Error::OutputPath { reason, .. } => assert!(reason.contains("block device"), "{reason}"),
        other => panic!("expected OutputPath, got {other:?}"),
    }
}

#[test]
fn an_output_dropped_without_commit_leaves_the_old_file_and_no_temporary() {
    let dir = TempDir::new("drop");
    let path = dir.join("metrics.jsonl");
    std::fs::write(&path, "old\n").unwrap();
    let mut output = OutputFile::create(&path).unwrap();
    output.write_all(b"half").unwrap();
    let temporary = output.writing_to().to_path_buf();
    assert!(temporary.file_name().unwrap().to_str().unwrap().starts_with(".metrics.jsonl.conveyor-tmp-"));
    assert!(temporary.exists());
    drop(output);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "old\n");
    assert_eq!(dir.entries(), ["metrics.jsonl"]);
}

fn set_age(path: &Path, age: Duration) {
    let file = std::fs::File::options().write(true).open(path).unwrap();
    file.set_modified(SystemTime::now() - age).unwrap();
}

#[test]
fn stale_temporaries_of_dead_writers_are_removed_and_no_others() {
    let dir = TempDir::new("stale");
    let dead_pid = i32::MAX - 1;
    let old = STALE_AFTER + Duration::from_secs(60);
    let stale = dir.join(&format!(".model.st.conveyor-tmp-{dead_pid}-0"));
    let recent = dir.join(&format!(".model.st.conveyor-tmp-{dead_pid}-1"));
    let alive = dir.join(&format!(".model.st.conveyor-tmp-{}-0", std::process::id()));
    let init = dir.join(".model.st.conveyor-tmp-1-0");
    let foreign = dir.join(".model.st.tmp-12345-0");
    for path in [&stale, &recent, &alive, &init, &foreign] {
        std::fs::write(path, "partial").unwrap();
    }
    for path in [&stale, &alive, &init, &foreign] {
        set_age(path, old);
    }
    assert_eq!(remove_stale_temporaries(&dir.0), 1);
    assert!(!stale.exists(), "a dead writer's old temporary file is removed");
    for kept in [&recent, &alive, &init, &foreign] {
        assert!(kept.exists(), "{} is kept", kept.display());
    }
    // check_output sweeps the directory it probes.
    std::fs::write(&stale, "partial").unwrap();
    set_age(&stale, old);
    check_output(dir.join("model.st")).unwrap();
    assert!(!stale.exists());
}

#[test]
fn temporary_names_are_recognisable() {
    let name = temporary_name(std::ffi::OsStr::new("run.safetensors"));
    assert_eq!(output_file::temporary_owner(&name), Some(std::process::id()));
}
