//! Parameters and optimizer state in and out of the workers: gathered onto the host under
//! unsplit names, loaded back by name, and the closures the trainer runs on every worker between
//! steps (each worker owns its stages, so everything goes to it as a command over its channel).
use std::sync::Arc;

use crossbeam::channel;

use super::stage::Stage;
use super::trainer::Trainer;
use super::worker::{self, Command};
use crate::checkpoint::Checkpoint;
use crate::optim::Optimizer;
use crate::{Error, Result, Tensor};

impl Trainer {
    /// Runs `f` on every local worker's stages (every worker in-process; this rank's under MPI)
    /// and gathers the answers, worker 0 first. A panic in `f` is caught on the worker (which stays
    /// alive) and returned as [`Error::WorkerPanicked`].
    pub(super) fn on_every_worker<T: Send + 'static>(
        &self,
        f: impl Fn(&mut [Stage]) -> T + Send + Sync + 'static,
    ) -> Result<Vec<T>> {
        self.on_workers(|_| true, f)
    }

    /// [`Trainer::on_every_worker`] for the local workers of replica 0 only: the replicas hold
    /// the same parameters and optimizer state, so what is read once is read there.
    pub(super) fn on_first_replica<T: Send + 'static>(
        &self,
        f: impl Fn(&mut [Stage]) -> T + Send + Sync + 'static,
    ) -> Result<Vec<T>> {
        let n_devices = self.schedule().n_devices();
        self.on_workers(|w| w < n_devices, f)
    }

    /// Runs `f` on the stages of every local worker `w` with `which(w)`, in worker order.
    fn on_workers<T: Send + 'static>(
        &self,
        which: impl Fn(usize) -> bool,
        f: impl Fn(&mut [Stage]) -> T + Send + Sync + 'static,
    ) -> Result<Vec<T>> {
        let f = Arc::new(f);
        let mut answers = Vec::with_capacity(self.workers.len());
        for (device_idx, worker) in self.workers.iter().enumerate() {
            let Some(worker) = worker.as_ref().filter(|_| which(device_idx)) else { continue };
            let (tx, rx) = channel::bounded(1);
            let f = Arc::clone(&f);
            worker
                .commands
                .send(Command::With(Box::new(move |stages| {
                    let answer = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(stages)))
                        .map_err(worker::panic_message);
                    let _ = tx.send(answer);
                })))
                .map_err(|_| Error::invalid("worker", format!("the worker of device {device_idx} has stopped")))?;
            answers.push((device_idx, rx));
        }
        // A worker's device is its group's first.
        let device_of = |device_idx: usize| self.devices[device_idx * self.tensor_parallel].to_string();
        answers
            .into_iter()
            .map(|(device_idx, rx)| match rx.recv() {
                Ok(Ok(answer)) => Ok(answer),
                Ok(Err(message)) => Err(Error::WorkerPanicked { device_idx, device: device_of(device_idx), message }),
                Err(_) => Err(Error::invalid("worker", format!("the worker of device {device_idx} has stopped"))),
            })
            .collect()
    }

    /// Every parameter gathered from all stages onto the host, as `(node.param, tensor)` in graph
    /// order (PyTorch state-dict names when nodes are named like module children). Split layers
    /// give their unsplit tensors under the unsplit names ([`crate::Layer::export_parameters`]), so
    /// the result does not depend on the tensor-parallel degree.
    ///
    /// ```
    /// # include!("doc_model.rs");
    /// # fn main() -> conveyor_engine::Result<()> {
    /// let trainer = conveyor_engine::runtime::Trainer::builder(graph(), loss()).build()?;
    /// let names: Vec<String> = trainer.parameters()?.into_iter().map(|(name, _)| name).collect();
    /// assert_eq!(names, ["a.weight", "b.weight"]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
        self.named_from_stages(|node| {
            let exported = node.layer.export_parameters()?;
            Ok(exported.into_iter().map(|(name, tensor)| (format!("{}.{name}", node.name), tensor)).collect())
        })
    }

    /// The gradients the last step left in the stages, named and ordered as
    /// [`Trainer::parameters`], on the host (see [`Trainer::gradient_step`]).
    pub(super) fn gradients(&self) -> Result<Vec<(String, Tensor)>> {
        self.named_from_stages(|node| {
            let pairs = node.layer.parameters().iter().zip(&node.grads);
            pairs
                .map(|(param, grad)| {
                    Ok((format!("{}.{}", node.name, param.name), grad.to_device(&crate::Device::host())?))
                })
                .collect()
        })
    }

    /// Named tensors `of` every node of replica 0's stages gives, gathered from every rank and
    /// sorted into [`Trainer::parameters`]' order.
    fn named_from_stages(
        &self,
        of: impl Fn(&super::stage::NodeExec) -> Result<Vec<(String, Tensor)>> + Send + Sync + 'static,
    ) -> Result<Vec<(String, Tensor)>> {
        let parts = self.on_first_replica(move |stages| -> Result<Vec<(String, Tensor)>> {
            let mut out = Vec::new();
            for node in stages.iter().flat_map(|stage| &stage.nodes) {
                out.extend(of(node)?);
            }
            Ok(out)
        })?;
        let mut gathered = Vec::new();
        for part in parts {
            gathered.extend(part?);
        }
        let mut gathered = self.gather_named(gathered)?;
        gathered.sort_by_key(|(name, _)| self.param_order.iter().position(|o| o == name).unwrap_or(usize::MAX));
        Ok(gathered)
    }

    /// This rank's named tensors joined with every other rank's (rank order); with one rank, as
    /// they are. Every rank must call it at the same point (a collective).
    /// With a rank per tensor-parallel shard, only shard 0's ranks contribute: the other shards'
    /// ranks hold the same unsplit tensors (split layers gather into every shard's rank).
    fn gather_named(&self, local: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
        if self.transport.world_size() == 1 {
            return Ok(local);
        }
        let local = if self.shard == 0 { local } else { Vec::new() };
        let parts = self.transport.all_gather(super::ranks::encode_named(&local)?, self.collective_timeout())?;
        let mut all = Vec::new();
        for (rank, part) in parts.iter().enumerate() {
            if rank == self.transport.rank() {
                all.extend(local.iter().map(|(n, t)| (n.clone(), t.share())));
            } else {
                all.extend(super::ranks::decode_named(part)?);
            }
        }
        Ok(all)
    }

    /// Bytes and messages each split layer's devices have sent in collectives since the layer was
    /// built, as `(node, per-rank traffic)` for every node that has any, in stage order.
    pub fn collective_traffic(&self) -> Result<Vec<(String, Vec<crate::collective::Traffic>)>> {
        let parts = self.on_every_worker(|stages| {
            let mut out = Vec::new();
            for stage in stages.iter() {
                for node in &stage.nodes {
                    let traffic = node.layer.collective_traffic();
                    if !traffic.is_empty() {
                        out.push((stage.stage_idx, node.name.clone(), traffic));
                    }
                }
            }
            out
        })?;
        let mut all: Vec<_> = parts.into_iter().flatten().collect();
        all.sort_by_key(|(stage_idx, _, _)| *stage_idx);
        Ok(all.into_iter().map(|(_, name, traffic)| (name, traffic)).collect())
    }

    /// Sets parameters by name (shapes and dtypes must match; names not given stay as they are).
    ///
    /// Tied parameters ([`crate::runtime::TrainerBuilder::tie_parameters`]) stay one parameter: a
    /// tie named by one of its copies alone (as `safetensors` files of tied models keep one name)
    /// sets every copy, and copies given different values are refused.
    pub fn load_parameters(&mut self, mut tensors: Vec<(String, Tensor)>) -> Result<()> {
        for tie in self.ties.iter() {
            let given: Vec<usize> =
                tie.names.iter().filter_map(|name| tensors.iter().position(|(n, _)| n == name)).collect();
            let Some(&first) = given.first() else { continue };
            let values = tensors[first].1.to_vec_f32();
            for &other in &given[1..] {
                if tensors[other].1.to_vec_f32().iter().zip(&values).any(|(a, b)| a.to_bits() != b.to_bits())
                    || tensors[other].1.shape() != tensors[first].1.shape()
                {
                    return Err(Error::invalid(
                        "parameters",
                        format!(
                            "`{}` and `{}` are tied (one parameter) but given different values; give one of them, \
                             or equal values",
                            tensors[first].0, tensors[other].0
                        ),
                    ));
                }
            }
            for name in &tie.names {
                if !tensors.iter().any(|(n, _)| n == name) {
                    let value = tensors[first].1.share();
                    tensors.push((name.clone(), value));
                }
            }
        }
        let tensors = Arc::new(tensors);
        for (name, _) in tensors.iter() {
            if !self.param_order.contains(name) {
                return Err(Error::invalid("parameters", format!("the model has no parameter `{name}`")));
            }
        }
        let results = self.on_every_worker(move |stages| -> Result<()> {
            for stage in stages.iter_mut() {
                for node in &mut stage.nodes {
                    for (name, shape) in node.layer.export_parameter_shapes() {
                        let full = format!("{}.{name}", node.name);
                        if let Some((_, t)) = tensors.iter().find(|(n, _)| *n == full) {
                            if *t.shape() != shape {
                                return Err(Error::shape(
                                    format!("parameter `{full}`"),
                                    shape.to_string(),
                                    t.shape().to_string(),
                                ));
                            }
                            node.layer.import_parameter(&name, t)?;
                        }
                    }
                    node.layer.refresh()?;
                }
            }
            Ok(())
        })?;
        results.into_iter().collect()
    }

    /// Every stage's optimizer state on the host under the unsplit parameter names of
    /// [`Trainer::parameters`] (`optimizer.<node>.<param>.<field>`, as
    /// [`Optimizer::export_state`] names them): split layers' per-shard buffers are gathered the way
    /// the layers gather their parameters ([`Optimizer::export_layer_state`]), so the result does
    /// not depend on the tensor-parallel degree.
    ///
    /// With ZeRO-1 ([`crate::runtime::TrainerBuilder::zero`]) each layer's state comes from the
    /// replica that keeps it.
    pub fn optimizer_state(&self) -> Result<Vec<(String, Tensor)>> {
        let export = |stages: &mut [Stage]| -> Result<Vec<(String, Tensor)>> {
            let mut out = Vec::new();
            for stage in stages.iter_mut() {
                let mut offset = 0;
                for (node_idx, node) in stage.nodes.iter_mut().enumerate() {
                    if stage.zero.as_ref().is_none_or(|z| z.owns(node_idx)) {
                        out.extend(stage.optimizer.export_layer_state(&node.name, node.layer.as_mut(), offset)?);
                    }
                    offset += node.layer.parameters().len();
                }
            }
            Ok(out)
        };
        let parts = match self.zero {
            true => self.on_every_worker(export)?,
            false => self.on_first_replica(export)?,
        };
        let mut gathered = Vec::new();
        for part in parts {
            gathered.extend(part?);
        }
        self.gather_named(gathered)
    }

    /// Loads every stage's optimizer state from `checkpoint` (names as [`Trainer::optimizer_state`]
    /// gives them), splitting it over split layers' shards; takes the tensors it uses and leaves
    /// the others.
    pub fn load_optimizer_state(&mut self, checkpoint: Checkpoint) -> Result<Checkpoint> {
        // The checkpoint travels from worker to worker through channels: each takes its stages'
        // tensors and hands the rest back, so no worker shares it with another.
        // Replicas other than 0 take their tensors from copies (sharing storage); replica 0 takes
        // them from the checkpoint and hands back the rest.
        let n_devices = self.schedule().n_devices();
        for replica in 1..self.replicas {
            drop(self.load_optimizer_state_into(checkpoint.share(), replica * n_devices..(replica + 1) * n_devices)?);
        }
        self.load_optimizer_state_into(checkpoint, 0..n_devices)
    }

    /// [`Trainer::load_optimizer_state`] on the local workers `workers` (one replica's).
    fn load_optimizer_state_into(
        &mut self,
        checkpoint: Checkpoint,
        workers: std::ops::Range<usize>,
    ) -> Result<Checkpoint> {
        let mut checkpoint = checkpoint;
        for (device_idx, worker) in self.workers.iter().enumerate() {
            let Some(worker) = worker.as_ref().filter(|_| workers.contains(&device_idx)) else { continue };
            let (tx, rx) = channel::bounded(1);
            let stopped = || Error::invalid("worker", format!("the worker of device {device_idx} has stopped"));
            worker
                .commands
                .send(Command::With(Box::new(move |stages| {
                    let mut checkpoint = checkpoint;
                    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<()> {
                        for stage in stages.iter_mut() {
                            let mut offset = 0;
                            for (node_idx, node) in stage.nodes.iter_mut().enumerate() {
                                // With ZeRO-1 a replica keeps the state of its own layers only.
                                if stage.zero.as_ref().is_none_or(|z| z.owns(node_idx)) {
                                    let layer = node.layer.as_mut();
                                    stage.optimizer.import_layer_state(&node.name, layer, offset, &mut checkpoint)?;
                                }
                                offset += node.layer.parameters().len();
                            }
                        }
                        Ok(())
                    }));
                    let _ = tx.send((outcome.map_err(worker::panic_message), checkpoint));
                })))
                .map_err(|_| stopped())?;
            let (outcome, rest) = rx.recv().map_err(|_| stopped())?;
            checkpoint = rest;
            let device = self.devices[device_idx * self.tensor_parallel].to_string();
            outcome.map_err(|message| Error::WorkerPanicked { device_idx, device, message })??;
        }
        Ok(checkpoint)
    }

    /// Runs `f` on every stage's optimizer on its worker (state export and import for checkpoints).
    /// The names are those of [`crate::Layer::parameters`]: for split layers, one per shard (the
    /// same name on each shard), so optimizer state of split layers is per shard here; checkpoints
    /// use [`Trainer::optimizer_state`] and [`Trainer::load_optimizer_state`], which are not.
    pub fn with_optimizers<T: Send + 'static>(
        &self,
        f: impl Fn(&mut Optimizer, &[String]) -> T + Send + Sync + 'static,
    ) -> Result<Vec<T>> {
        let answers = self.on_every_worker(move |stages| {
            stages
                .iter_mut()
                .map(|stage| {
                    let names: Vec<String> = stage.named_parameters().map(|(n, _)| n).collect();
                    f(&mut stage.optimizer, &names)
                })
                .collect::<Vec<T>>()
        })?;
        Ok(answers.into_iter().flatten().collect())
    }
}
