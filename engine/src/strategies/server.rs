//! Parameter-server shards: each owns some of the model's tensors (round-robin by tensor index)
//! with their optimizer state, and runs as a thread that answers pulls and applies pushes in the
//! order they arrive. A synchronous shard (`ps`) applies step `t` once every worker pushed it,
//! summing in worker order; an asynchronous one (Downpour, SSP) applies each push on arrival and
//! records its staleness (updates applied since the pushing worker pulled).
use std::collections::BTreeMap;

use crossbeam::channel::{Receiver, RecvTimeoutError, Sender};

use super::compress::{self, Compression};
use super::links::{Abort, RunStats};
use crate::optim::{Optimizer, OptimizerConfig};
use crate::{Device, Result, Tensor};

/// A message to a server shard.
pub(super) enum ToServer {
    /// Parameters, once the shard has applied at least `min_version` updates.
    Pull { step: usize, min_version: u64, reply: Sender<Pulled> },
    /// A worker's gradients of this shard's tensors (encoded, shard order) for `step`, computed
    /// on the parameters of version `pulled_version`, encoded by `codec`, to be applied at `lr`
    /// (the step's rate under a schedule; `None`: the shard's current rate).
    Push { worker: usize, step: usize, pulled_version: u64, codec: Compression, lr: Option<f64>, grads: Vec<Vec<u8>> },
}

/// A shard's answer to a pull.
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

    fn answer(&self, reply: &Sender<Pulled>, stats: &RunStats, step: usize) -> Result<()> {
        let params =
            self.tensors.iter().zip(&self.params).map(|(&i, p)| Ok((i, p.try_clone()?))).collect::<Result<_>>()?;
        let bytes: u64 = self.params.iter().map(|p| 4 * p.numel() as u64).sum();
        stats.with(step, |s| s.bytes += bytes);
        // A worker that stopped waiting has left the run; nothing to tell it.
        let _ = reply.send(Pulled { shard: self.shard, version: self.version, params });
        Ok(())
    }

    /// Serves messages until every worker hung up. `sync_workers`: a synchronous shard's worker
    /// count (it applies step `t` when all of them pushed `t`); `None` for an asynchronous one.
    pub fn serve(
        &mut self,
        inbox: Receiver<ToServer>,
        sync_workers: Option<usize>,
        stats: &RunStats,
        abort: &Abort,
    ) -> Result<()> {
        let mut waiting: Vec<(usize, u64, Sender<Pulled>)> = Vec::new();
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
                ToServer::Pull { step, min_version, reply } => {
                    if self.version >= min_version {
                        self.answer(&reply, stats, step)?;
                    } else {
                        waiting.push((step, min_version, reply));
                    }
                }
                ToServer::Push { worker, step, pulled_version, codec, lr, grads } => {
                    let decoded = self.decode(codec, &grads)?;
                    if let Some(lr) = lr {
                        self.set_lr(lr)?;
                    }
                    match sync_workers {
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
                    let version = self.version;
                    let (ready, still): (Vec<_>, Vec<_>) = waiting.drain(..).partition(|(_, min, _)| *min <= version);
                    waiting = still;
                    for (step, _, reply) in ready {
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
