//! The launcher half of the MPI tests that re-run their own binary as the ranks of a job
//! (`mpi_collectives`, `mpi_sync_strategies`): checks for `mpirun` (a skip that says so, or a
//! failure under `CONVEYOR_REQUIRE_MPI`), runs `mpirun -n N --oversubscribe` for each world size
//! with the job's rank variable set, kills a job past its timeout (its own process group, so
//! mpirun and every rank end together), and requires rank 0's success line in the output.
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};

/// One MPI test's jobs.
pub struct Jobs {
    /// The test's name, starting every line it prints.
    pub name: &'static str,
    /// Set in the ranks' environment: the copy of the binary is one rank of the job.
    pub rank_var: &'static str,
    /// Rank counts of the jobs, in order.
    pub world_sizes: &'static [usize],
    /// What rank 0 prints last when every check passed on every rank.
    pub passed: &'static str,
    /// Longest a job may run before it is killed.
    pub timeout: Duration,
}

/// Runs every job; the process's exit code.
pub fn launcher_main(jobs: &Jobs) -> ExitCode {
    match launch_all(jobs) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}: FAILED: {e:#}", jobs.name);
            ExitCode::FAILURE
        }
    }
}

fn launch_all(jobs: &Jobs) -> anyhow::Result<()> {
    let have_mpirun = Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !have_mpirun {
        if std::env::var_os("CONVEYOR_REQUIRE_MPI").is_some() {
            bail!("mpirun is not on the path, and CONVEYOR_REQUIRE_MPI is set");
        }
        println!("{}: skipped (no `mpirun` on the path; install Open MPI to run it)", jobs.name);
        return Ok(());
    }
    let exe = std::env::current_exe().context("finding this test binary")?;
    for &n in jobs.world_sizes {
        println!("{}: mpirun -n {n} --oversubscribe", jobs.name);
        let output = run_job(jobs, &exe, n)?;
        print!("{output}");
        ensure!(output.contains(jobs.passed), "the {n}-rank job exited without rank 0 reporting success");
    }
    Ok(())
}

/// Runs the job of `n` ranks to its end (killing it past the timeout) and returns its output;
/// fails unless every rank exited with success.
fn run_job(jobs: &Jobs, exe: &std::path::Path, n: usize) -> anyhow::Result<String> {
    let mut child = Command::new("mpirun")
        .args(["-n", &n.to_string(), "--oversubscribe"])
        .arg(exe)
        .env(jobs.rank_var, "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, so a timeout can end mpirun and every rank together.
        .process_group(0)
        .spawn()
        .context("starting mpirun")?;
    let mut stdout = child.stdout.take().context("piped stdout")?;
    let mut stderr = child.stderr.take().context("piped stderr")?;
    let out_reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let err_reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + jobs.timeout;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if Instant::now() > deadline {
            // SAFETY: kill(2) on the process group this test created; no memory is involved.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = out_reader.join().unwrap_or_default() + &err_reader.join().unwrap_or_default();
    match status {
        None => bail!("the {n}-rank job ran past {:?} and was killed; its output:\n{output}", jobs.timeout),
        Some(s) if !s.success() => bail!("the {n}-rank job failed ({s}); its output:\n{output}"),
        Some(_) => Ok(output),
    }
}
