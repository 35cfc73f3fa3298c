//! `--transport`: how `conveyor train` runs across processes. `in-process` keeps every pipeline
//! device a thread of this process; `mpi` makes this process one rank of an MPI job
//! (`mpirun -n P conveyor train ...`, one rank per pipeline device or per device); `auto` (the default) takes
//! MPI when an MPI launcher started the process with more than one rank, else in-process.
//!
//! Under MPI every rank runs the same command line, builds the same trainer and calls the same
//! trainer methods in the same order (the gathers and the commit vote are collectives); rank 0
//! owns the user's view: only it prints and writes files. How the job ends:
//! - success, or an error every rank reached together (a failed or non-finite step, a world size
//!   that does not fit the layout): rank 0 prints it once, every rank finalises MPI and exits with
//!   the same status;
//! - an error on one rank alone (an unreadable file, a failed write): that rank prints it with its
//!   rank and calls `MPI_Abort`, which ends every rank at once (never a hang).
use std::str::FromStr;
use std::sync::Arc;

use conveyor::engine::Error;
use conveyor::engine::transport::{self, MpiTransport, Transport, TransportKind};

use super::console;

/// The `--transport` choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// MPI when launched by an MPI launcher with more than one rank, else in-process.
    #[default]
    Auto,
    /// Every pipeline device a thread of this process.
    InProcess,
    /// One MPI rank per pipeline device.
    Mpi,
}

impl FromStr for TransportChoice {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "auto" => Ok(TransportChoice::Auto),
            "in-process" => Ok(TransportChoice::InProcess),
            "mpi" => Ok(TransportChoice::Mpi),
            other => Err(format!("`{other}` is not a transport; use auto, in-process or mpi")),
        }
    }
}

/// Starts the transport `choice` means and makes it the process's; on ranks other than 0, silences
/// stdout and stderr (rank 0 speaks for the job). Returns the transport when it is MPI.
pub fn start(choice: TransportChoice) -> anyhow::Result<Option<Arc<dyn Transport>>> {
    if transport::process_transport().kind() == TransportKind::Mpi {
        // Already started (a second run in one process): MPI starts once per process.
        return Ok(Some(transport::process_transport()));
    }
    let mpi = match choice {
        TransportChoice::InProcess => false,
        TransportChoice::Mpi => true,
        TransportChoice::Auto => transport::launcher_world_size().is_some_and(|n| n > 1),
    };
    if !mpi {
        return Ok(None);
    }
    let transport: Arc<dyn Transport> = match MpiTransport::init() {
        Ok(t) => t,
        Err(e @ Error::MpiNotBuilt) => {
            let why = match choice {
                TransportChoice::Auto => " (an MPI launcher started this process with several ranks)",
                _ => "",
            };
            return Err(super::usage(format!("--transport mpi{why}: {e}")));
        }
        Err(e) => return Err(e.into()),
    };
    transport::init_process(Arc::clone(&transport))?;
    if transport.rank() != 0 {
        console::silence();
    }
    let links: Vec<String> = (1..transport.world_size())
        .filter_map(|peer| {
            let link = transport.link(peer)?;
            Some(format!("rank {peer}: {:.1} µs + {:.2} GB/s", link.latency_s * 1e6, link.bandwidth_bytes_per_s / 1e9))
        })
        .collect();
    console::out(&format!(
        "transport: MPI, {} ranks (this output is rank 0's); links measured from rank 0: {}\n",
        transport.world_size(),
        if links.is_empty() { "none".to_string() } else { links.join(", ") }
    ));
    Ok(Some(transport))
}

/// A usage error (exit status 2) that every rank of an MPI job reaches from the same values (the
/// job's world size against the run's flags), so the job ends in order with the message once.
#[derive(Debug)]
pub struct UsageOnEveryRank(pub String);

impl std::fmt::Display for UsageOnEveryRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageOnEveryRank {}

/// Whether every rank reaches `error` together (so the job can end in order): errors of the
/// step's vote and of the layout, which every rank computes from the same gathered values, and a
/// stop by a signal (agreed by every rank, `cli::train`).
fn reached_together(error: &anyhow::Error) -> bool {
    error.downcast_ref::<super::interrupt::Interrupted>().is_some()
        || error.downcast_ref::<UsageOnEveryRank>().is_some()
        || matches!(
            error.downcast_ref::<Error>(),
            Some(
                Error::WorldSize { .. }
                    | Error::RankFailed { .. }
                    | Error::StageFailed { .. }
                    | Error::WorkerPanicked { .. }
                    | Error::NonFiniteStep { .. }
            )
        )
}

/// Ends this rank's part of the job with exit status `code` after `result` (a no-op without MPI):
/// finalises MPI when every rank ends the same way, else prints the error with the rank (rank 0
/// printed it already) and aborts the job.
pub fn finish(result: &anyhow::Result<()>, code: i32) -> i32 {
    let transport = transport::process_transport();
    if transport.kind() != TransportKind::Mpi {
        return code;
    }
    match result {
        Err(error) if !reached_together(error) => {
            if transport.rank() != 0 {
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "error on rank {}: {error:#}; ending the job", transport.rank());
            }
            transport.abort(if code == 0 { 1 } else { code })
        }
        _ => {
            drop(transport);
            transport::finish_process();
            code
        }
    }
}

/// After a panic of the main thread: under MPI, ends the job at once (`MPI_Abort`: the other ranks
/// would wait for this one until their deadline); else exits with status 101, as an unwinding panic
/// does.
pub fn panicked() -> ! {
    let transport = transport::process_transport();
    if transport.kind() == TransportKind::Mpi {
        transport.abort(101)
    }
    std::process::exit(101)
}
