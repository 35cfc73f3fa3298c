//! Data-parallel synchronisation strategies side by side: synchronous all-reduce, local SGD
//! (parameter averaging), parameter servers, asynchronous Downpour SGD and stale-synchronous
//! parallel (SSP), each with optional gradient compression ([`compress`]).
//!
//! [`SyncTrainer`] runs `R` workers, each a [`crate::runtime::Trainer`] (any layout: one device or
//! a pipeline) that computes gradients ([`crate::runtime::Trainer::gradient_step`]); the strategy
//! decides what is exchanged, when, and who applies the optimizer. `README.md` beside this file
//! describes each strategy's protocol, why none can deadlock, and how the deterministic mode
//! ([`Interleaving::Seeded`]) makes an asynchronous run replayable bit for bit.
//!
//! [`SyncTrainer::over_ranks`] runs `allreduce` and `average:K` with one worker per MPI rank
//! instead, through the same code with the transport's all-gather (`ranks.rs` describes what
//! differs and how a failure on one rank ends the others).
//!
//! The runtime's own replicas ([`crate::runtime::TrainerBuilder::data_parallel`]) are the fast
//! path for plain synchronous all-reduce (bucketed, overlapped with backward); this module is for
//! comparing strategies, and runs `allreduce` too, so that every strategy is measured the same way.
use std::fmt;
use std::str::FromStr;

use crate::{Error, Result};

pub mod compress;
mod links;
mod powersgd;
mod ranks;
mod remote;
mod server;
mod sync_trainer;

pub use compress::{Compression, Compressor};
pub use ranks::DEFAULT_COLLECTIVE_TIMEOUT;
pub use sync_trainer::{StepRecord, SyncTrainer};

/// How replicas keep their parameters in step (`--sync`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncStrategy {
    /// Every step: gradients averaged over all workers (an all-gather in fixed worker order, so
    /// every worker applies the same update), then each worker's optimizer steps.
    AllReduce,
    /// Local SGD: each worker steps on its own gradients; every `every` steps the parameters are
    /// averaged (as deltas since the last average, so compression applies to them).
    Average {
        /// Steps between averages (K).
        every: usize,
    },
    /// `shards` server threads own the parameters (round-robin by tensor) and the optimizer state;
    /// workers pull parameters, push gradients; synchronous: a shard applies a step once every
    /// worker pushed it, summing in worker order.
    ParameterServer {
        /// Server shards (S).
        shards: usize,
    },
    /// Downpour SGD (Dean et al. 2012): each worker fetches parameters every `fetch_every` steps
    /// and pushes its accumulated gradients every `push_every` steps, updating its own copy in
    /// between; the server applies each push as it arrives. No worker waits for another.
    Downpour {
        /// Steps between fetches of the parameters (F).
        fetch_every: usize,
        /// Steps between pushes of the accumulated gradients (P).
        push_every: usize,
    },
    /// Stale-synchronous parallel (Ho et al. 2013): as the asynchronous server, but a worker may
    /// start step `c` only once the slowest worker has finished step `c - staleness - 1`.
    Ssp {
        /// How many steps the fastest worker may be ahead of the slowest (S).
        staleness: usize,
    },
}

/// The valid values of `--sync`, for error messages.
pub const SYNC_VALUES: &str = "allreduce, average:K (K >= 1), ps, ps:S (S >= 1 server shards), downpour:F,P (fetch every F >= 1 \
     steps, push every P >= 1), ssp:S (S >= 0 steps of staleness)";

impl SyncStrategy {
    /// Whether workers run without waiting for each other (Downpour, SSP within its bound): the
    /// result then depends on the interleaving ([`Interleaving`]).
    pub fn is_asynchronous(&self) -> bool {
        matches!(self, SyncStrategy::Downpour { .. } | SyncStrategy::Ssp { .. })
    }

    /// Whether parameters live on server shards (and how many).
    pub fn server_shards(&self) -> Option<usize> {
        match *self {
            SyncStrategy::ParameterServer { shards } => Some(shards),
            SyncStrategy::Downpour { .. } | SyncStrategy::Ssp { .. } => Some(1),
            SyncStrategy::AllReduce | SyncStrategy::Average { .. } => None,
        }
    }
}

impl fmt::Display for SyncStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            SyncStrategy::AllReduce => write!(f, "allreduce"),
            SyncStrategy::Average { every } => write!(f, "average:{every}"),
            SyncStrategy::ParameterServer { shards: 1 } => write!(f, "ps"),
            SyncStrategy::ParameterServer { shards } => write!(f, "ps:{shards}"),
            SyncStrategy::Downpour { fetch_every, push_every } => write!(f, "downpour:{fetch_every},{push_every}"),
            SyncStrategy::Ssp { staleness } => write!(f, "ssp:{staleness}"),
        }
    }
}

impl FromStr for SyncStrategy {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        let bad = |why: String| Error::invalid("--sync", format!("{why}; valid: {SYNC_VALUES}"));
        let number = |what: &str, value: &str, min: usize| -> Result<usize> {
            match value.trim().parse::<usize>() {
                Ok(n) if n >= min => Ok(n),
                Ok(n) => Err(bad(format!("{what} must be at least {min}, got {n}"))),
                Err(_) => Err(bad(format!("{what} must be a whole number, got {value:?}"))),
            }
        };
        let (name, arg) = match text.split_once(':') {
            Some((name, arg)) => (name, Some(arg)),
            None => (text, None),
        };
        match (name, arg) {
            ("allreduce", None) => Ok(SyncStrategy::AllReduce),
            ("average", Some(k)) => Ok(SyncStrategy::Average { every: number("K of average:K", k, 1)? }),
            ("ps", None) => Ok(SyncStrategy::ParameterServer { shards: 1 }),
            ("ps", Some(s)) => Ok(SyncStrategy::ParameterServer { shards: number("S of ps:S", s, 1)? }),
            ("downpour", Some(fp)) => {
                let Some((f, p)) = fp.split_once(',') else {
                    return Err(bad(format!("downpour takes two numbers, F,P; got {fp:?}")));
                };
                Ok(SyncStrategy::Downpour {
                    fetch_every: number("F of downpour:F,P", f, 1)?,
                    push_every: number("P of downpour:F,P", p, 1)?,
                })
            }
            ("ssp", Some(s)) => Ok(SyncStrategy::Ssp { staleness: number("S of ssp:S", s, 0)? }),
            ("average" | "downpour" | "ssp", None) => Err(bad(format!("{name} needs its numbers"))),
            ("allreduce", Some(_)) => Err(bad("allreduce takes no number".into())),
            _ => Err(bad(format!("unknown strategy {text:?}"))),
        }
    }
}

/// In what order an asynchronous run's workers talk to the servers.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum Interleaving {
    /// As the threads happen to arrive (timing-dependent, fastest).
    #[default]
    Free,
    /// Deterministic: each pull and push waits for its turn, drawn from a generator with this
    /// seed among the workers allowed to go; the order is recorded
    /// ([`SyncTrainer::interleaving`]) and the weights depend only on the seed.
    Seeded(u64),
    /// Deterministic: the turns of a recorded run, in order (a run replayed from its record).
    Replay(Vec<u16>),
}

/// A strategy with its compression and interleaving.
#[derive(Clone, Debug, PartialEq)]
pub struct StrategyConfig {
    /// How replicas synchronise.
    pub sync: SyncStrategy,
    /// How exchanged values are compressed (gradients, or parameter deltas for `average:K`;
    /// parameters pulled from servers travel as f32).
    pub compress: Compression,
    /// The order of an asynchronous run's pulls and pushes.
    pub interleaving: Interleaving,
    /// Steps exchanged uncompressed before compression starts (PyTorch's `start_powerSGD_iter`:
    /// early gradients change fast, and a low-rank or sparse start slows training).
    pub compress_after: usize,
    /// Seeds the compressors (PowerSGD's first `Q`).
    pub seed: u64,
}

impl StrategyConfig {
    /// `sync` without compression, free interleaving, seed 0.
    pub fn new(sync: SyncStrategy) -> StrategyConfig {
        StrategyConfig {
            sync,
            compress: Compression::None,
            interleaving: Interleaving::Free,
            compress_after: 0,
            seed: 0,
        }
    }

    /// With `compress`.
    pub fn compress(mut self, compress: Compression) -> StrategyConfig {
        self.compress = compress;
        self
    }

    /// Compressing only from step `steps` on.
    pub fn compress_after(mut self, steps: usize) -> StrategyConfig {
        self.compress_after = steps;
        self
    }

    /// With `interleaving`.
    pub fn interleaving(mut self, interleaving: Interleaving) -> StrategyConfig {
        self.interleaving = interleaving;
        self
    }

    /// Refuses combinations no strategy serves: a recorded interleaving for a synchronous
    /// strategy (which has none to replay).
    pub fn validate(&self) -> Result<()> {
        if matches!(self.interleaving, Interleaving::Replay(_)) && !self.sync.is_asynchronous() {
            return Err(Error::invalid(
                "--interleaving",
                format!(
                    "{} is synchronous and has no interleaving to replay; replay is for downpour:F,P and ssp:S",
                    self.sync
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategies_parse_and_print_back() {
        for text in ["allreduce", "average:4", "ps", "ps:3", "downpour:2,5", "ssp:0", "ssp:2"] {
            let sync: SyncStrategy = text.parse().unwrap();
            assert_eq!(sync.to_string(), text);
        }
        assert_eq!("ps:1".parse::<SyncStrategy>().unwrap(), SyncStrategy::ParameterServer { shards: 1 });
    }

    #[test]
    fn bad_strategies_name_the_flag_and_the_valid_values() {
        for text in [
            "",
            "gossip",
            "average",
            "average:0",
            "average:x",
            "ps:0",
            "downpour:2",
            "downpour:0,1",
            "downpour:1,0",
            "ssp",
            "ssp:-1",
            "allreduce:2",
        ] {
            let error = text.parse::<SyncStrategy>().unwrap_err().to_string();
            assert!(error.contains("--sync") && error.contains("downpour:F,P"), "{text:?}: {error}");
        }
    }
}
