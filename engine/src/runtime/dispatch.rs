//! One step's jobs for the workers (`Trainer::dispatch`): the batch cut into micro-batches, the
//! channels between stages (or the transport's tags to other ranks), each local worker's program,
//! data and targets; then the coordinator collects the step.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use conveyor_schedules::{Instruction, Schedule};
use crossbeam::channel;

use super::super::coordinator::Dispatched;
use super::super::stage::Payload;
use super::super::worker::{Command, Links, StepJob};
use super::build::wall_clock_s;
use super::{StageInfo, StepOutcome, Trainer};
use crate::transport::Tag;
use crate::{Error, Result, Targets, Tensor};

impl Trainer {
    /// Splits `rows` into `n` micro-batches: sizes differ by at most one, the first
    /// `rows % n` get the extra row.
    fn split(&self, rows: usize) -> Result<Vec<(usize, usize)>> {
        let n = self.schedule.n_micro_batches();
        if rows < n {
            return Err(Error::invalid(
                "batch",
                format!(
                    "{rows} rows cannot make {n} micro-batches; use at most {rows} micro-batches or a larger batch"
                ),
            ));
        }
        let (base, extra) = (rows / n, rows % n);
        let mut start = 0;
        Ok((0..n)
            .map(|i| {
                let len = base + usize::from(i < extra);
                let range = (start, len);
                start += len;
                range
            })
            .collect())
    }

    pub(in crate::runtime) fn dispatch(
        &mut self,
        inputs: &Tensor,
        targets: Option<&Targets>,
        training: bool,
    ) -> Result<StepOutcome> {
        if let Some(reason) = &self.poisoned {
            return Err(Error::Poisoned { reason: reason.clone() });
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
        let n_micro_batches = splits.len();
        let round = self.round;
        self.round += 1;
        self.transport.close_rounds_before(round);
        for device in &self.devices {
            device.reset_peak_memory();
        }
        let started = Instant::now();
        let started_s = wall_clock_s() - self.transport.clock_offset_s();
        let local_workers = self.local_workers();
        let is_local = |stage_idx: usize| self.workers[self.schedule.device_of_stage(stage_idx)].is_some();
        // Channels: one per (from, to, direction), bounded by the micro-batch count, between
        // stages of this process; a stage on another rank is reached through the transport.
        let mut senders = HashMap::new();
        let mut receivers = HashMap::new();
        let mut remote_senders = HashMap::new();
        let mut remote_receivers = HashMap::new();
        for info in &self.stage_info {
            for &peer in &info.send_to {
                for (from, to, gradient) in [(info.stage_idx, peer, false), (peer, info.stage_idx, true)] {
                    let key = (from, to, gradient);
                    let tag = Tag { round, channel: ((from as u64) << 32) | ((to as u64) << 1) | u64::from(gradient) };
                    match (is_local(from), is_local(to)) {
                        (true, true) => {
                            let (tx, rx) = channel::bounded(n_micro_batches);
                            senders.insert(key, tx);
                            receivers.insert(key, rx);
                        }
                        (true, false) => {
                            // The receiving stage's rank of this rank's shard.
                            let to_rank = self.schedule.device_of_stage(to) * self.ranks_per_device + self.shard;
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
        let slots_this_step = self.slots_for(rows / n_micro_batches.max(1));
        if let Some(slots) = &self.slots {
            slots.take_wake_latencies();
        }
        let (abort_tx, abort_rx) = channel::bounded::<()>(0);
        let (report_tx, report_rx) = channel::unbounded();
        let mut commit_txs = Vec::with_capacity(local_workers.len());
        let mut programs: Vec<Vec<Instruction>> = if training {
            self.schedule.programs().to_vec()
        } else {
            forward_only_programs(&self.schedule, n_micro_batches)
        };
        for &device_idx in &local_workers {
            let program = std::mem::take(&mut programs[device_idx]);
            let my_stages: Vec<&StageInfo> =
                self.stage_info.iter().filter(|s| self.schedule.device_of_stage(s.stage_idx) == device_idx).collect();
            let mine = |stage_idx: usize| my_stages.iter().any(|s| s.stage_idx == stage_idx);
            let mut links = Links { transport: Some(Arc::clone(&self.transport)), ..Links::default() };
            links.senders.extend(senders.iter().filter(|(k, _)| mine(k.0)).map(|(k, tx)| (*k, tx.clone())));
            links.receivers.extend(receivers.iter().filter(|(k, _)| mine(k.1)).map(|(k, rx)| (*k, rx.clone())));
            links.remote_senders.extend(remote_senders.iter().filter(|(k, _)| mine(k.0)).map(|(k, v)| (*k, *v)));
            let remote_in: Vec<_> = remote_receivers.keys().filter(|k| mine(k.1)).copied().collect();
            for key in remote_in {
                links.remote_receivers.insert(key, remote_receivers.remove(&key).expect("listed"));
            }
            let mut data: HashMap<usize, Vec<Payload>> = HashMap::new();
            for info in &my_stages {
                if info.data_inputs.contains(&input_id) {
                    let device = &self.stage_devices[info.stage_idx];
                    let per_mb = splits
                        .iter()
                        .map(|&(start, len)| {
                            Ok(vec![(input_id, inputs.narrow_rows(start, len)?.move_to_device(device)?)])
                        })
                        .collect::<Result<Vec<Payload>>>()?;
                    data.insert(info.stage_idx, per_mb);
                }
            }
            let holds_output = my_stages.iter().any(|s| s.holds_output);
            let mb_targets = match (targets, holds_output) {
                (Some(targets), true) => splits
                    .iter()
                    .map(|&(start, len)| targets.slice_rows(start, len).map(Some))
                    .collect::<Result<Vec<_>>>()?,
                _ => Vec::new(),
            };
            let (commit_tx, commit_rx) = channel::bounded(1);
            commit_txs.push((device_idx, commit_tx));
            let job = StepJob {
                step_idx: self.step_idx,
                seed: self.seed,
                training,
                program,
                n_micro_batches,
                normalizer: rows as f32,
                data,
                targets: mb_targets,
                links,
                stage_devices: Arc::clone(&self.stage_devices),
                stage_workers: Arc::clone(&self.stage_workers),
                abort: abort_rx.clone(),
                commit: commit_rx,
                fault: self.fault,
                stall: self.stall,
                started,
                max_grad_norm: self.max_grad_norm,
                use_core_slots: slots_this_step.is_some(),
            };
            let worker = self.workers[device_idx].as_ref().expect("a local worker");
            worker
                .commands
                .send(Command::Step(Box::new(job), report_tx.clone()))
                .map_err(|_| Error::invalid("worker", format!("the worker of device {device_idx} has stopped")))?;
        }
        // Only workers hold report senders now: a worker that vanishes closes its end.
        drop((senders, receivers, report_tx));
        self.collect(Dispatched {
            reports: report_rx,
            abort: abort_tx,
            commits: commit_txs,
            started,
            started_s,
            training,
            slots_this_step,
            round,
        })
    }
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
