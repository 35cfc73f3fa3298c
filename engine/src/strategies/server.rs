//! Parameter-server shards: each owns some of the model's tensors (round-robin by tensor index)
//! with their optimizer state, and runs as a thread that answers pulls and applies pushes in the
//! order they arrive. A synchronous shard (`ps`) applies step `t` once every worker pushed it,
//! summing in worker order; an asynchronous one (Downpour, SSP) applies each push on arrival and
//! records its staleness (updates applied since the pushing worker pulled). A pull waits until
//! the shard has the version it asks for and, for SSP, until every worker's pushes reach the
//! bound it names; so the stale-synchronous bound is kept where the pushes are counted, in one
//! process or across ranks alike. Across MPI ranks a shard runs on the rank that hosts it and
//! answers remote pulls through the transport ([`Reply::Remote`], `remote.rs`).
use std::collections::BTreeMap;

use crossbeam::channel::{Receiver, RecvTimeoutError, Sender};

use super::compress::{self, Compression};
use super::links::{Abort, RunStats};
use super::remote::RemoteReply;
use crate::optim::{Optimizer, OptimizerConfig};
use crate::{Device, Error, Result, Tensor};

/// A message to a server shard.
pub(super) enum ToServer {
    /// Parameters, once the shard has applied at least `min_version` updates and taken at least
    /// `min_pushes` pushes from every worker (SSP's bound; 0 for the other strategies).
    Pull { step: usize, min_version: u64, min_pushes: usize, reply: Reply },
    /// A worker's gradients of this shard's tensors (encoded, shard order) for `step`, computed
    /// on the parameters of version `pulled_version`, encoded by `codec`, to be applied at `lr`
    /// (the step's rate under a schedule; `None`: the shard's current rate).
    Push { worker: usize, step: usize, pulled_version: u64, codec: Compression, lr: Option<f64>, grads: Vec<Vec<u8>> },
}

/// Where a pull's answer goes: the pulling worker's channel (a thread of this process) or, across
/// ranks, the transport to the pulling worker's rank.
pub(super) enum Reply {
    Local(Sender<Pulled>),
    Remote(RemoteReply),
}

/// A shard's answer to a pull.
#[derive(Debug)]
pub(super) struct Pulled {
    pub shard: usize,
    pub version: u64,
    /// `(tensor index, values)` of the shard's tensors.
    pub params: Vec<(usize, Tensor)>,
}

/// One shard's state, kept across runs.
#[derive(Debug)]
pub(super) struct ServerShard {
    pub shard: usize,
    /// Global tensor indices this shard owns, ascending.
    pub tensors: Vec<usize>,
    pub params: Vec<Tensor>,
    optimizer: Optimizer,
    /// Updates applied.
    pub version: u64,
    /// Pushes taken from each worker since training began (index: worker).
    pushed: Vec<usize>,
}

impl ServerShard {
    /// Shard `shard` of `shards`, owning tensors `shard, shard + shards, ...` of `params`.
    pub fn new(shard: usize, shards: usize, params: &[Tensor], optimizer: &OptimizerConfig) -> Result<ServerShard> {
        let tensors: Vec<usize> = (shard..params.len()).step_by(shards).collect();
        let owned = tensors.iter().map(|&i| params[i].try_clone()).collect::<Result<Vec<_>>>()?;
        Ok(ServerShard {
            shard,
            optimizer: Optimizer::new(*optimizer, owned.len())?,
            tensors,
            params: owned,
            version: 0,
            pushed: Vec::new(),
        })
    }

    /// Sets the shard's learning rate (a schedule's next value).
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        self.optimizer.set_lr(lr)
    }

    fn apply(&mut self, grads: &[Tensor]) -> Result<()> {
        let mut params: Vec<&mut Tensor> = self.params.iter_mut().collect();
        let grads: Vec<&Tensor> = grads.iter().collect();
        self.optimizer.step(&mut params, &grads)?;
        self.version += 1;
        Ok(())
    }

    fn decode(&self, compression: Compression, grads: &[Vec<u8>]) -> Result<Vec<Vec<f32>>> {
        self.params.iter().zip(grads).map(|(p, bytes)| compress::decode(compression, p.dims(), bytes)).collect()
    }

    fn answer(&self, reply: &Reply, stats: &RunStats, step: usize) -> Result<()> {
        let params =
            self.tensors.iter().zip(&self.params).map(|(&i, p)| Ok((i, p.try_clone()?))).collect::<Result<_>>()?;
        let bytes: u64 = self.params.iter().map(|p| 4 * p.numel() as u64).sum();
        stats.with(step, |s| s.bytes += bytes);
        let pulled = Pulled { shard: self.shard, version: self.version, params };
        match reply {
            // A worker that stopped waiting has left the run; nothing to tell it.
            Reply::Local(tx) => {
                let _ = tx.send(pulled);
            }
            Reply::Remote(remote) => remote.send(&pulled)?,
        }
        Ok(())
    }

    /// Whether a pull asking for `min_version` and `min_pushes` can be answered now.
    fn can_answer(&self, min_version: u64, min_pushes: usize) -> bool {
        self.version >= min_version && self.pushed.iter().all(|&n| n >= min_pushes)
    }

    /// Serves messages until every worker hung up. `workers`: how many push to it; `sync`: a
    /// synchronous shard (it applies step `t` when all of them pushed `t`), else an asynchronous
    /// one.
    pub fn serve(
        &mut self,
        inbox: Receiver<ToServer>,
        workers: usize,
        sync: bool,
        stats: &RunStats,
        abort: &Abort,
    ) -> Result<()> {
        if self.pushed.len() != workers {
            self.pushed = vec![0; workers];
        }
        let mut waiting: Vec<(usize, u64, usize, Reply)> = Vec::new();
        let mut pending: BTreeMap<usize, Vec<Option<Vec<Vec<f32>>>>> = BTreeMap::new();
        loop {
            let message = match inbox.recv_timeout(std::time::Duration::from_millis(20)) {
                Ok(message) => message,
                Err(RecvTimeoutError::Timeout) => {
                    abort.check()?;
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return Ok(()),
            };
            match message {
                ToServer::Pull { step, min_version, min_pushes, reply } => {
                    if self.can_answer(min_version, min_pushes) {
                        self.answer(&reply, stats, step)?;
                    } else {
                        waiting.push((step, min_version, min_pushes, reply));
                    }
                }
                ToServer::Push { worker, step, pulled_version, codec, lr, grads } => {
                    let Some(pushed) = self.pushed.get_mut(worker) else {
                        return Err(Error::invalid(
                            "parameter server",
                            format!("a push from worker {worker} of {workers}"),
                        ));
                    };
                    *pushed += 1;
                    let decoded = self.decode(codec, &grads)?;
                    if let Some(lr) = lr {
                        self.set_lr(lr)?;
                    }
                    match sync.then_some(workers) {
                        None => {
                            let staleness = self.version.saturating_sub(pulled_version);
                            let grads = self.to_tensors(decoded)?;
                            self.apply(&grads)?;
                            stats.with(step, |s| {
                                s.staleness_sum += staleness;
                                s.staleness_max = s.staleness_max.max(staleness);
                                s.pushes += 1;
                            });
                        }
                        Some(workers) => {
                            pending.entry(step).or_insert_with(|| vec![None; workers])[worker] = Some(decoded);
                            // Steps are applied in order; a worker pushes step t only after pulling
                            // version t, so only the next step can be complete.
                            while let Some(parts) = pending.get(&(self.version as usize))
                                && parts.iter().all(Option::is_some)
                            {
                                let step = self.version as usize;
                                let parts = pending.remove(&step).expect("present");
                                let mean = mean_in_order(parts.into_iter().flatten().collect());
                                let grads = self.to_tensors(mean)?;
                                self.apply(&grads)?;
                                stats.with(step, |s| s.pushes += workers as u64);
                            }
                        }
                    }
                    let (ready, still): (Vec<_>, Vec<_>) =
                        waiting.drain(..).partition(|&(_, version, pushes, _)| self.can_answer(version, pushes));
                    waiting = still;
                    for (step, _, _, reply) in ready {
                        self.answer(&reply, stats, step)?;
                    }
                }
            }
        }
    }

    fn to_tensors(&self, values: Vec<Vec<f32>>) -> Result<Vec<Tensor>> {
        values
            .into_iter()
            .zip(&self.params)
            .map(|(v, p)| Tensor::from_vec(v, p.shape().clone(), &Device::host()))
            .collect()
    }
}

/// The mean of the workers' values, tensor by tensor: summed in worker order, then divided by
/// the count (the same arithmetic in the server and in `allreduce`, so `ps` and `allreduce` give
/// the same bits).
pub(super) fn mean_in_order(per_worker: Vec<Vec<Vec<f32>>>) -> Vec<Vec<f32>> {
    let n = per_worker.len() as f32;
    let mut workers = per_worker.into_iter();
    let Some(mut sum) = workers.next() else { return Vec::new() };
    for other in workers {
        for (acc, values) in sum.iter_mut().zip(other) {
            acc.iter_mut().zip(values).for_each(|(a, v)| *a += v);
        }
    }
    for values in &mut sum {
        values.iter_mut().for_each(|v| *v /= n);
    }
    sum
}
