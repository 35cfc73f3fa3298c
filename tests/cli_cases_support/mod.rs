//! The table-driven CLI suite's harness: each [`Case`] is a command line, the exit status it must
//! end with, a phrase its output must contain, and the files that must come through unchanged
//! (checked by hash). Every case runs in a fresh temporary directory that is removed afterwards,
//! under a time limit (a hang fails the case), and no case may panic.
#![allow(dead_code)]
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One row of the table.
pub struct Case {
    /// A short name, printed on failure.
    pub name: &'static str,
    /// The arguments after `conveyor`; `{dir}` is replaced by the case's temporary directory.
    pub args: &'static [&'static str],
    /// Prepares the directory before the run (writes inputs, makes FIFOs, symlinks...).
    pub setup: fn(&Path),
    /// The exit status the run must end with.
    pub exit: i32,
    /// A phrase stdout or stderr must contain (case-insensitive); empty for none.
    pub phrase: &'static str,
    /// Paths (relative to the directory, or absolute) whose bytes must be the same after the run;
    /// a path that did not exist before must not exist after.
    pub unchanged: &'static [&'static str],
}

/// A setup that does nothing.
pub fn nothing(_: &Path) {}

/// How long one case may run.
pub const CASE_LIMIT: Duration = Duration::from_secs(30);

fn fingerprint(path: &Path) -> Option<(u64, bool)> {
    let meta = std::fs::symlink_metadata(path).ok()?;
    let mut hasher = DefaultHasher::new();
    if meta.file_type().is_file() {
        std::fs::read(path).ok()?.hash(&mut hasher);
    } else if meta.file_type().is_symlink() {
        std::fs::read_link(path).ok()?.hash(&mut hasher);
    }
    format!("{:?}", meta.file_type()).hash(&mut hasher);
    Some((hasher.finish(), meta.file_type().is_file()))
}

/// A fresh directory for one case (removed by [`run_case`]).
pub fn case_dir(name: &str) -> PathBuf {
    let safe: String = name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    let dir = std::env::temp_dir().join(format!("conveyor-cli-case-{safe}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs one case; returns a description of what went wrong, if anything.
pub fn run_case(case: &Case) -> Result<(), String> {
    let dir = case_dir(case.name);
    let outcome = run_in(case, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    outcome
}

fn run_in(case: &Case, dir: &Path) -> Result<(), String> {
    (case.setup)(dir);
    let resolve = |p: &str| -> PathBuf {
        let p = p.replace("{dir}", dir.to_str().unwrap());
        if Path::new(&p).is_absolute() { PathBuf::from(p) } else { dir.join(p) }
    };
    let watched: Vec<(PathBuf, Option<(u64, bool)>)> =
        case.unchanged.iter().map(|p| resolve(p)).map(|p| (p.clone(), fingerprint(&p))).collect();
    let args: Vec<String> = case.args.iter().map(|a| a.replace("{dir}", dir.to_str().unwrap())).collect();
    let mut child = Command::new(env!("CARGO_BIN_EXE_conveyor"))
        .args(&args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not run conveyor: {e}"))?;
    // Drain the pipes on threads so a chatty run cannot block on a full pipe.
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut s);
        s
    });
    let err_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
        s
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            break status;
        }
        if started.elapsed() > CASE_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("hung for more than {CASE_LIMIT:?}: conveyor {}", args.join(" ")));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let (stdout, stderr) = (out_thread.join().unwrap(), err_thread.join().unwrap());
    let both = format!("{stdout}\n{stderr}");
    let mut problems = Vec::new();
    if status.code() != Some(case.exit) {
        problems.push(format!("exit status {:?}, expected {}", status.code(), case.exit));
    }
    if both.contains("panicked") || both.contains("RUST_BACKTRACE") {
        problems.push("it panicked".to_string());
    }
    if !case.phrase.is_empty() && !both.to_lowercase().contains(&case.phrase.to_lowercase()) {
        problems.push(format!("the output lacks `{}`", case.phrase));
    }
    for (path, before) in &watched {
        if fingerprint(path) != *before {
            problems.push(format!("{} changed", path.display()));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        let tail: String = stderr.chars().rev().take(1500).collect::<Vec<_>>().into_iter().rev().collect();
        Err(format!("{}: conveyor {}\n  stderr: {tail}", problems.join("; "), args.join(" ")))
    }
}

/// Runs every case (in parallel, on the test harness's threads of this one test) and fails with
/// the list of the cases that went wrong.
pub fn run_table(cases: &[Case]) {
    let names: std::collections::HashSet<&str> = cases.iter().map(|c| c.name).collect();
    assert_eq!(names.len(), cases.len(), "case names must be unique");
    let failures: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = cases
            .chunks(cases.len().div_ceil(4).max(1))
            .map(|chunk| {
                scope.spawn(move || {
                    chunk
                        .iter()
                        .filter_map(|c| run_case(c).err().map(|e| format!("[{}] {e}", c.name)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
    println!("{} passed, 0 failed", cases.len());
}
