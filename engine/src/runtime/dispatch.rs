//! One step's jobs for the workers (`Trainer::dispatch`): the batch cut into micro-batches, the
//! channels between stages (or the transport's tags to other ranks), each local worker's program,
//! data and targets; then the coordinator collects the step.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use conveyor_schedules::{Instruction, Schedule};
use crossbeam::channel;

use super::super::coordinator::Dispatched;
use super::super::worker::{Command, InputRows, Links, StepJob};
use super::build::wall_clock_s;
use super::{StageInfo, StepOutcome, Trainer};
use crate::optim::OptimizerConfig;
use crate::transport::Tag;
use crate::{Error, Result, Targets, Tensor};

impl Trainer {
    /// Cuts `rows` into the replicas' shares ([`super::ReplicaShares`]) and each share into
    /// micro-batches: per replica, its micro-batches as `(start row, rows)`. Micro-batch sizes
    /// differ by at most one, the first ones get the extra rows.
    fn split(&self, rows: usize) -> Result<Vec<Vec<(usize, usize)>>> {
        let (replicas, n) = (self.replicas, self.schedule.n_micro_batches());
        if rows < replicas * n {
            return Err(Error::invalid(
                "batch",
                match replicas {
                    1 => format!(
                        "{rows} rows cannot make {n} micro-batches; use at most {rows} micro-batches or a larger batch"
                    ),
                    _ => format!(
                        "{rows} rows cannot make {n} micro-batches in each of {replicas} replicas; use at most {} \
                         micro-batches or a batch of at least {} rows",
                        rows / replicas,
                        replicas * n
                    ),
                },
            ));
        }
        let mut start = 0;
        Ok(self
            .shares
            .rows(rows, n)?
            .into_iter()
            .map(|len| {
                let parts = even_parts(start, len, n);
                start += len;
                parts
            })
            .collect())
    }

    pub(in crate::runtime) fn dispatch(
        &mut self,
        inputs: &Tensor,
        targets: Option<&Targets>,
        training: bool,
    ) -> Result<StepOutcome> {
        let step =
            self.launch(inputs, targets, training, Launch { step_idx: self.step_idx, optimistic: false, lr: None })?;
        self.finish(step, &mut None)
    }

    /// Collects a launched step ([`Trainer::launch`]) and learns from it (the replicas' shares).
    /// `next`, a step launched after it (overlapped steps), is abandoned when this one is refused,
    /// fails or must be replayed.
    pub(in crate::runtime) fn finish(&mut self, step: InFlight, next: &mut Option<InFlight>) -> Result<StepOutcome> {
        let InFlight { dispatched, rows_per_replica, .. } = step;
        let training = dispatched.training;
        let outcome = self.collect(dispatched, next)?;
        if training && self.replicas > 1 && !outcome.replay {
            self.shares.observe(&outcome.report, &rows_per_replica, self.schedule.n_devices());
        }
        Ok(outcome)
    }

    /// Whether a step launched ahead (overlapped steps) still runs as it would be launched now on
    /// a batch of `rows`: under the same f16 loss scale and the same rows per replica.
    pub(in crate::runtime) fn launched_as_now(&self, step: &InFlight, rows: usize) -> Result<bool> {
        let scale_now = self.loss_scaler.map_or(1.0, |scaler| scaler.scale());
        let rows_now: Vec<usize> = self.split(rows)?.iter().map(|mbs| mbs.iter().map(|(_, len)| len).sum()).collect();
        Ok(step.loss_scale == scale_now && step.rows_per_replica == rows_now)
    }

    /// Sends one step's jobs to the workers and returns at once: the batch cut into micro-batches,
    /// the channels between stages, each local worker's program, data and targets.
    pub(in crate::runtime) fn launch(
        &mut self,
        inputs: &Tensor,
        targets: Option<&Targets>,
        training: bool,
        how: Launch,
    ) -> Result<InFlight> {
        if let Some(reason) = &self.poisoned {
            return Err(Error::Poisoned { reason: reason.clone() });
        }
        // Checked here, before any job is sent, so that a bad rate never fails an apply half-way.
        if let Some(lr) = how.lr {
            OptimizerConfig::check_lr(lr)?;
        }
        let rows = inputs.shape().leading();
        if let Some(targets) = targets {
            self.check_targets("train_step", rows, targets)?;
        }
        let input_nodes = self.graph.inputs();
        if input_nodes.len() != 1 {
            return Err(Error::invalid("graph inputs", "the trainer feeds graphs with exactly one input node"));
        }
        let input_id = input_nodes[0];
        let expected = self.graph.node(input_id)?.output_shape.clone();
        if inputs.dims().get(1..) != Some(expected.dims()) {
            return Err(Error::shape(
                "train_step",
                format!(
                    "inputs [batch, {}]",
                    expected.dims().iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")
                ),
                inputs.shape().to_string(),
            ));
        }
        let splits = self.split(rows)?;
        let n_micro_batches = splits[0].len();
        let round = self.round;
        self.round += 1;
        self.transport.close_rounds_before(round);
        if !how.optimistic || how.step_idx == self.step_idx {
            // (A step launched while another runs leaves the peaks to that one: they then cover
            // both.)
            for device in &self.devices {
                device.reset_peak_memory();
            }
        }
        let started = Instant::now();
        let started_s = wall_clock_s() - self.transport.clock_offset_s();
        let local_workers = self.local_workers();
        let n_devices = self.schedule.n_devices();
        let worker_of =
            |replica: usize, stage_idx: usize| self.worker_index(replica, self.schedule.device_of_stage(stage_idx));
        let is_local = |replica: usize, stage_idx: usize| self.workers[worker_of(replica, stage_idx)].is_some();
        // Channels: per replica, one per (from, to, direction), bounded by the micro-batch count,
        // between stages of this process; a stage on another rank is reached through the
        // transport.
        let mut senders = HashMap::new();
        let mut receivers = HashMap::new();
        let mut remote_senders = HashMap::new();
        let mut remote_receivers = HashMap::new();
        for replica in 0..self.replicas {
            for info in &self.stage_info {
                for &peer in &info.send_to {
                    for (from, to, gradient) in [(info.stage_idx, peer, false), (peer, info.stage_idx, true)] {
                        let key = (replica, (from, to, gradient));
                        let channel =
                            ((replica as u64) << 48) | ((from as u64) << 32) | ((to as u64) << 1) | u64::from(gradient);
                        let tag = Tag { round, channel };
                        match (is_local(replica, from), is_local(replica, to)) {
                            (true, true) => {
                                let (tx, rx) = channel::bounded(n_micro_batches);
                                senders.insert(key, tx);
                                receivers.insert(key, rx);
                            }
                            (true, false) => {
                                // The receiving stage's rank of this rank's shard.
                                let to_rank = worker_of(replica, to) * self.ranks_per_worker + self.shard;
                                remote_senders.insert(key, (to_rank, tag));
                            }
                            (false, true) => {
                                remote_receivers.insert(key, self.transport.inbox(tag)?);
                            }
                            (false, false) => {}
                        }
                    }
                }
            }
        }
        let loss_scale = match (&self.loss_scaler, training) {
            (Some(scaler), true) => scaler.scale(),
            _ => 1.0,
        };
        let slots_this_step = self.slots_for(rows / (self.replicas * n_micro_batches).max(1));
        if let Some(slots) = &self.slots {
            slots.take_wake_latencies();
        }
        let (abort_tx, abort_rx) = channel::bounded::<()>(0);
        let (report_tx, report_rx) = channel::unbounded();
        let mut commit_txs = Vec::with_capacity(local_workers.len());
        let programs: Vec<Vec<Instruction>> = if training {
            self.schedule.programs().to_vec()
        } else {
            forward_only_programs(&self.schedule, n_micro_batches)
        };
        for &worker_idx in &local_workers {
            let (replica, device_idx) = (worker_idx / n_devices, worker_idx % n_devices);
            let program = programs[device_idx].clone();
            let my_stages: Vec<&StageInfo> =
                self.stage_info.iter().filter(|s| self.schedule.device_of_stage(s.stage_idx) == device_idx).collect();
            let mine = |stage_idx: usize| my_stages.iter().any(|s| s.stage_idx == stage_idx);
            let ours = |r: usize| r == replica;
            let mut links = Links { transport: Some(Arc::clone(&self.transport)), ..Links::default() };
            links.senders.extend(
                senders.iter().filter(|((r, k), _)| ours(*r) && mine(k.0)).map(|((_, k), tx)| (*k, tx.clone())),
            );
            links.receivers.extend(
                receivers.iter().filter(|((r, k), _)| ours(*r) && mine(k.1)).map(|((_, k), rx)| (*k, rx.clone())),
            );
            links
                .remote_senders
                .extend(remote_senders.iter().filter(|((r, k), _)| ours(*r) && mine(k.0)).map(|((_, k), v)| (*k, *v)));
            let remote_in: Vec<_> = remote_receivers.keys().filter(|(r, k)| ours(*r) && mine(k.1)).copied().collect();
            for key in remote_in {
                links.remote_receivers.insert(key.1, remote_receivers.remove(&key).expect("listed"));
            }
            let stage_devices = &self.stage_devices[replica];
            let mut data: HashMap<usize, Vec<Vec<InputRows>>> = HashMap::new();
            for info in &my_stages {
                if info.data_inputs.contains(&input_id) {
                    // Cut out and moved onto the stage's device by its worker (`InputRows`).
                    let per_mb = splits[replica]
                        .iter()
                        .map(|&(start, len)| vec![InputRows { node: input_id, tensor: inputs.share(), start, len }])
                        .collect();
                    data.insert(info.stage_idx, per_mb);
                }
            }
            let holds_output = my_stages.iter().any(|s| s.holds_output);
            let mb_targets = match (targets, holds_output) {
                (Some(targets), true) => splits[replica]
                    .iter()
                    .map(|&(start, len)| targets.slice_rows(start, len).map(Some))
                    .collect::<Result<Vec<_>>>()?,
                _ => Vec::new(),
            };
            let (commit_tx, commit_rx) = channel::bounded(1);
            commit_txs.push((worker_idx, commit_tx));
            let job = StepJob {
                step_idx: how.step_idx,
                seed: self.seed,
                training,
                program,
                n_micro_batches,
                // Every replica's losses are divided by the whole batch's rows: their sum is the
                // batch's mean, and the summed gradients are one device's on the whole batch.
                normalizer: rows as f32,
                data,
                targets: mb_targets,
                links,
                stage_devices: Arc::clone(stage_devices),
                stage_workers: Arc::clone(&self.stage_workers[replica]),
                abort: abort_rx.clone(),
                commit: commit_rx,
                fault: self.fault.filter(|_| self.fault_replica.is_none_or(|r| r == replica)),
                stall: self.stall,
                started,
                max_grad_norm: self.max_grad_norm,
                use_core_slots: slots_this_step.is_some(),
                micro_batch_offset: replica * n_micro_batches,
                bucket_bytes: self.bucket_bytes,
                apply: !self.gradients_only,
                precision: self.precision,
                loss_scale,
                optimistic: how.optimistic && training,
                lr: how.lr,
            };
            let worker = self.workers[worker_idx].as_ref().expect("a local worker");
            worker
                .commands
                .send(Command::Step(Box::new(job), report_tx.clone()))
                .map_err(|_| Error::invalid("worker", format!("the worker {worker_idx} has stopped")))?;
        }
        // Only workers hold report senders now: a worker that vanishes closes its end.
        drop((senders, receivers, report_tx));
        Ok(InFlight {
            dispatched: Dispatched {
                reports: report_rx,
                abort: abort_tx,
                commits: commit_txs,
                started,
                started_s,
                training,
                slots_this_step,
                round,
                optimistic: how.optimistic && training,
            },
            rows_per_replica: splits.iter().map(|mbs| mbs.iter().map(|(_, len)| len).sum()).collect(),
            loss_scale,
        })
    }
}

/// How [`Trainer::launch`] runs a step.
#[derive(Clone, Copy, Debug)]
pub(in crate::runtime) struct Launch {
    /// The step's index (dropout masks and the like follow it).
    pub step_idx: u64,
    /// Whether workers apply their update before the coordinator validates it (overlapped steps).
    pub optimistic: bool,
    /// The learning rate the update takes, if the step sets one ([`super::super::Batch::lr`]).
    pub lr: Option<f64>,
}

/// A step whose jobs went out ([`Trainer::launch`]), not yet collected ([`Trainer::finish`]).
pub(in crate::runtime) struct InFlight {
    pub dispatched: Dispatched,
    /// The rows each replica took.
    pub rows_per_replica: Vec<usize>,
    /// The f16 loss scale the step runs under (1 without one).
    pub loss_scale: f32,
}

/// `len` rows from `start` cut into `n` parts `(start, rows)`, sizes differing by at most one, the
/// first `len % n` one larger.
fn even_parts(start: usize, len: usize, n: usize) -> Vec<(usize, usize)> {
    let (base, extra) = (len / n, len % n);
    let mut at = start;
    (0..n)
        .map(|i| {
            let rows = base + usize::from(i < extra);
            let part = (at, rows);
            at += rows;
            part
        })
        .collect()
}

/// Forward-only programs for evaluation: each device runs its stages' forwards in
/// (micro-batch, stage) order, which depends only on lexicographically earlier work, so it
/// completes with non-blocking sends.
fn forward_only_programs(schedule: &Schedule, n_micro_batches: usize) -> Vec<Vec<Instruction>> {
    (0..schedule.n_devices())
        .map(|device_idx| {
            let stages: Vec<usize> = schedule.stages_of_device(device_idx).collect();
            (0..n_micro_batches)
                .flat_map(|micro_batch_idx| {
                    stages.iter().map(move |&stage_idx| Instruction::Forward { micro_batch_idx, stage_idx })
                })
                .collect()
        })
        .collect()
}
