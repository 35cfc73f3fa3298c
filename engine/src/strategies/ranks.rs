//! [`super::SyncTrainer`] across MPI ranks ([`super::SyncTrainer::over_ranks`]): one worker per
//! rank, worker index = the rank, `R` = the world size. This file owns what differs from the
//! in-process run: the all-gather through [`Transport::all_gather`] ([`RankExchange`]), the
//! start-up check that every rank starts alike, and the end-of-run gathers that make statistics
//! and the `average:K` consensus global.
//!
//! **One code path for the math.** `allreduce` and `average:K` (every `--compress`, the collective
//! PowerSGD included) encode, all-gather, decode and sum in worker order exactly as the in-process
//! run does; only the all-gather ([`super::links::WorkerExchange`]) differs. The transport returns
//! the parts in rank order, so every rank computes the same bits as the in-process run with as
//! many workers (the `mpi_sync_strategies` test checks it on 2 and 4 ranks).
//!
//! **Global records.** Each rank counts only its own worker's bytes and loss; at the end of
//! [`super::SyncTrainer::run`] the ranks all-gather their per-step statistics and sum them in rank
//! order (the elapsed time is the slowest rank's), so every rank returns the same records. For
//! `average:K` the ranks also all-gather their parameters then and keep the mean in worker order,
//! which [`super::SyncTrainer::parameters`] and `evaluate` return on every rank.
//!
//! **Failures.** Every all-gather has a deadline ([`DEFAULT_COLLECTIVE_TIMEOUT`], or
//! [`super::SyncTrainer::set_collective_timeout`]). A rank whose step fails (a bad batch, a
//! non-finite loss) returns its error from `run` at once; the others wait in their next all-gather
//! until the deadline and then fail with the transport's timeout error, so no rank hangs forever.
//! A rank whose run failed cannot rejoin the others' collective sequence: end the job (every rank
//! should treat an error from `run` as fatal, e.g. [`Transport::abort`]).
//!
//! **The server strategies** (`ps`, `downpour`, `ssp`) send pulls, pushes and turns through the
//! transport (`remote.rs`); at the end of each run the ranks gather the shards' parameters
//! ([`gather_tensors`]) and rank 0's record of turns ([`rank_zero_turns`]) so that every rank
//! returns the same model and record.
use std::sync::Arc;
use std::time::Duration;

use super::StrategyConfig;
use super::links::{Abort, StepStats, WorkerExchange};
use super::server::mean_in_order;
use crate::optim::OptimizerConfig;
use crate::transport::Transport;
use crate::{Device, Error, Result, Shape, Tensor};

/// How long a rank waits in one of the strategy's all-gathers for the others by default.
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(300);

/// The ranks a [`super::SyncTrainer`] runs across, and its collectives' deadline.
#[derive(Clone, Debug)]
pub(super) struct Ranks {
    pub transport: Arc<dyn Transport>,
    pub timeout: Duration,
}

impl Ranks {
    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    pub fn world_size(&self) -> usize {
        self.transport.world_size()
    }

    /// Every rank's `bytes`, rank 0 first, checked to be one part per rank.
    fn all_gather(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let parts = self.transport.all_gather(bytes, self.timeout)?;
        if parts.len() != self.world_size() {
            return Err(Error::invalid(
                "strategy over ranks",
                format!("an all-gather returned {} parts for {} ranks", parts.len(), self.world_size()),
            ));
        }
        Ok(parts)
    }
}

/// The all-gather of `allreduce` and `average:K` across ranks: this rank's worker is the rank.
#[derive(Debug)]
pub(super) struct RankExchange<'a> {
    pub ranks: &'a Ranks,
}

impl WorkerExchange for RankExchange<'_> {
    fn all_gather(&self, worker: usize, bytes: Vec<u8>, abort: &Abort) -> Result<Arc<Vec<Vec<u8>>>> {
        abort.check()?;
        if worker != self.ranks.rank() {
            return Err(Error::invalid(
                "strategy over ranks",
                format!("worker {worker} exchanged on rank {}; each rank runs its own worker", self.ranks.rank()),
            ));
        }
        Ok(Arc::new(self.ranks.all_gather(bytes)?))
    }
}

/// Refuses to start unless every rank has the same strategy, optimizer and initial parameters
/// (names, shapes and bits): one all-gather of a digest, compared with rank 0's. Every rank calls
/// it and every rank gets the same verdict. The same all-gather agrees on the trainer's round of
/// messages (`remote.rs`): the largest any rank proposed (`round`), which it returns.
pub(super) fn check_same_start(
    ranks: &Ranks,
    config: &StrategyConfig,
    optimizer: &OptimizerConfig,
    round: u64,
    params: &[(String, Tensor)],
) -> Result<u64> {
    let settings = format!(
        "--sync {} --compress {} compress_after {} seed {} interleaving {:?} optimizer {optimizer:?}",
        config.sync, config.compress, config.compress_after, config.seed, config.interleaving
    );
    let mut digest = Fnv::default();
    for (name, tensor) in params {
        digest.write(name.as_bytes());
        for &d in tensor.shape().dims() {
            digest.write(&(d as u64).to_le_bytes());
        }
        for v in tensor.to_vec_f32() {
            digest.write(&v.to_bits().to_le_bytes());
        }
    }
    let mut mine = digest.0.to_le_bytes().to_vec();
    mine.extend(round.to_le_bytes());
    mine.extend(settings.as_bytes());
    let parts = ranks.all_gather(mine)?;
    let (first_digest, mut agreed, first_settings) = split_start(&parts[0])?;
    for (rank, part) in parts.iter().enumerate().skip(1) {
        let (theirs, their_round, their_settings) = split_start(part)?;
        agreed = agreed.max(their_round);
        if their_settings != first_settings {
            return Err(Error::invalid(
                "strategy over ranks",
                format!(
                    "rank {rank} runs `{their_settings}` but rank 0 runs `{first_settings}`; give every rank one strategy"
                ),
            ));
        }
        if theirs != first_digest {
            return Err(Error::invalid(
                "strategy over ranks",
                format!(
                    "rank {rank} does not start from the same parameters as rank 0 (names, shapes or values differ): \
                     build every rank's replica from one seed"
                ),
            ));
        }
    }
    Ok(agreed)
}

fn split_start(part: &[u8]) -> Result<(u64, u64, String)> {
    let Some((digest, rest)) = part.split_first_chunk::<8>() else {
        return Err(Error::invalid("strategy over ranks", "a rank sent a start-up check of under 16 bytes"));
    };
    let Some((round, settings)) = rest.split_first_chunk::<8>() else {
        return Err(Error::invalid("strategy over ranks", "a rank sent a start-up check of under 16 bytes"));
    };
    Ok((u64::from_le_bytes(*digest), u64::from_le_bytes(*round), String::from_utf8_lossy(settings).into_owned()))
}

/// FNV-1a, 64 bits: a digest of the initial parameters (a check, not a defence).
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// Fields of one step's statistics on the wire.
const STAT_FIELDS: usize = 7;

/// Every rank's statistics of the run's steps combined: counts and sums added in rank order, the
/// largest staleness and elapsed time over ranks. The same on every rank.
pub(super) fn combine_stats(ranks: &Ranks, steps: Vec<StepStats>) -> Result<Vec<StepStats>> {
    let mut mine = Vec::with_capacity(steps.len() * STAT_FIELDS * 8);
    for s in &steps {
        for word in [
            s.loss_sum.to_bits(),
            s.losses as u64,
            s.bytes,
            s.staleness_sum,
            s.staleness_max,
            s.pushes,
            s.finished_s.to_bits(),
        ] {
            mine.extend(word.to_le_bytes());
        }
    }
    let expected = mine.len();
    let parts = ranks.all_gather(mine)?;
    let mut combined = vec![StepStats::default(); steps.len()];
    for (rank, part) in parts.iter().enumerate() {
        if part.len() != expected {
            return Err(Error::invalid(
                "strategy over ranks",
                format!("rank {rank} sent {} bytes of step statistics, expected {expected}", part.len()),
            ));
        }
        let words: Vec<u64> =
            part.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect();
        for (c, w) in combined.iter_mut().zip(words.chunks_exact(STAT_FIELDS)) {
            c.loss_sum += f64::from_bits(w[0]);
            c.losses += w[1] as usize;
            c.bytes += w[2];
            c.staleness_sum += w[3];
            c.staleness_max = c.staleness_max.max(w[4]);
            c.pushes += w[5];
            c.finished_s = c.finished_s.max(f64::from_bits(w[6]));
        }
    }
    Ok(combined)
}

/// The workers' mean of their parameters, summed in worker (rank) order: the `average:K` model.
pub(super) fn mean_over_ranks(ranks: &Ranks, params: &[Tensor]) -> Result<Vec<Vec<f32>>> {
    let lens: Vec<usize> = params.iter().map(|p| p.shape().dims().iter().product()).collect();
    let mine: Vec<u8> = params.iter().flat_map(Tensor::to_vec_f32).flat_map(f32::to_le_bytes).collect();
    let expected = mine.len();
    let parts = ranks.all_gather(mine)?;
    let per_worker = parts
        .iter()
        .enumerate()
        .map(|(rank, part)| {
            if part.len() != expected {
                return Err(Error::invalid(
                    "strategy over ranks",
                    format!("rank {rank} sent {} bytes of parameters, expected {expected}", part.len()),
                ));
            }
            let mut values = part.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
            Ok(lens.iter().map(|&n| values.by_ref().take(n).collect()).collect())
        })
        .collect::<Result<Vec<Vec<Vec<f32>>>>>()?;
    Ok(mean_in_order(per_worker))
}

/// The model's tensors gathered from the ranks that hold them: each rank gives its `(index,
/// tensor)` pairs, and every rank gets every tensor, checked to come exactly once with its shape.
pub(super) fn gather_tensors(ranks: &Ranks, mine: &[(usize, &Tensor)], shapes: &[Shape]) -> Result<Vec<Tensor>> {
    let mut bytes = Vec::new();
    for (index, tensor) in mine {
        bytes.extend((*index as u64).to_le_bytes());
        bytes.extend(tensor.to_vec_f32().iter().flat_map(|v| v.to_le_bytes()));
    }
    let parts = ranks.all_gather(bytes)?;
    let mut values: Vec<Option<Tensor>> = (0..shapes.len()).map(|_| None).collect();
    for (rank, part) in parts.iter().enumerate() {
        let mut rest = part.as_slice();
        while let Some((index, tail)) = rest.split_first_chunk::<8>() {
            let index = usize::try_from(u64::from_le_bytes(*index)).unwrap_or(usize::MAX);
            let (Some(shape), Some(None)) = (shapes.get(index), values.get(index)) else {
                return Err(Error::invalid(
                    "strategy over ranks",
                    format!("rank {rank} sent tensor {index}, which is not the model's or came twice"),
                ));
            };
            let len = 4 * shape.numel();
            let Some((data, tail)) = tail.split_at_checked(len) else {
                return Err(Error::invalid("strategy over ranks", format!("rank {rank} sent a short tensor {index}")));
            };
            let v: Vec<f32> = data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            values[index] = Some(Tensor::from_vec(v, shape.clone(), &Device::host())?);
            rest = tail;
        }
        if !rest.is_empty() {
            return Err(Error::invalid("strategy over ranks", format!("rank {rank} sent a truncated tensor")));
        }
    }
    values
        .into_iter()
        .enumerate()
        .map(|(i, v)| v.ok_or_else(|| Error::invalid("strategy over ranks", format!("no rank holds tensor {i}"))))
        .collect()
}

/// Rank 0's record of a run's turns (the deterministic mode's turnstile lives there), on every rank.
pub(super) fn rank_zero_turns(ranks: &Ranks, record: &[u16]) -> Result<Vec<u16>> {
    let mine: Vec<u8> =
        if ranks.rank() == 0 { record.iter().flat_map(|t| t.to_le_bytes()).collect() } else { Vec::new() };
    let parts = ranks.all_gather(mine)?;
    Ok(parts[0].chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
}
