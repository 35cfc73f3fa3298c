//! The coordinator's side of a step, after the jobs went out: collecting the local workers'
//! reports, the commit vote across ranks, the commit or the abort, the rollback, and the step's
//! report gathered from every rank. With one rank (in-process) the vote and the gathers are
//! plain values and nothing is encoded; with several, every rank runs the same decision on the same
//! gathered votes, so a step commits on every rank or on none (`runtime/README.md`,
//! `transport/README.md`).
use std::time::{Duration, Instant};

use crossbeam::channel::{self, Receiver, Sender, select};

use super::StepReport;
use super::ranks::{Finish, Vote};
use super::trainer::{InFlight, REPORT_TIMEOUT, StepOutcome, Trainer};
use super::worker::{Command, Commit, Report};
use crate::transport::{ABORT_CHANNEL, Tag};
use crate::{Error, Result};

/// What one step's dispatch hands the coordinator.
pub(super) struct Dispatched {
    pub reports: Receiver<Report>,
    pub abort: Sender<()>,
    /// Per local worker: its commit channel.
    pub commits: Vec<(usize, Sender<Commit>)>,
    pub started: Instant,
    /// When the step started, in seconds on rank 0's clock.
    pub started_s: f64,
    pub training: bool,
    pub slots_this_step: Option<usize>,
    pub round: u64,
    /// The workers apply before the verdict (overlapped steps): the commit sent is only the
    /// verdict, and a step that clipping would change is rolled back and replayed.
    pub optimistic: bool,
}

/// What the local workers reported.
#[derive(Default)]
struct Local {
    ready: Vec<bool>,
    finished: Vec<bool>,
    losses: Vec<(usize, f64)>,
    sums_of_squares: Vec<(usize, f64)>,
    non_finite: Option<(usize, String)>,
    failure: Option<Error>,
    /// A local failure after the vote (the apply phase) or in an evaluation.
    late_failure: bool,
    /// The local failure came after another rank's abort notice: taken as its consequence (a
    /// worker freed from a collective with the failed rank), so this rank votes `Aborted` and the
    /// failed rank is named.
    after_peer: bool,
    needs_rollback: Vec<bool>,
    finish: Finish,
}

impl Local {
    fn absorb(&mut self, report: Report, voted: bool) {
        match report {
            Report::Ready { device_idx, losses, sum_of_squares, non_finite } => {
                self.ready[device_idx] = true;
                self.losses.extend(losses);
                self.sums_of_squares.push((device_idx, sum_of_squares));
                if let Some((stage_idx, parameter)) = non_finite
                    && self.non_finite.as_ref().is_none_or(|(first, _)| stage_idx < *first)
                {
                    self.non_finite = Some((stage_idx, parameter));
                }
            }
            Report::Done { device_idx, applied, events, cpu_times, peak_activation_bytes, outputs } => {
                self.finished[device_idx] = true;
                self.needs_rollback[device_idx] = applied;
                self.finish.events.extend(events);
                self.finish.cpu_times.extend(cpu_times);
                self.finish.peak_activation_bytes.extend(peak_activation_bytes);
                self.finish.outputs.extend(outputs);
            }
            Report::Failed { device_idx, error, needs_rollback } => {
                self.finished[device_idx] = true;
                self.needs_rollback[device_idx] = needs_rollback;
                if self.failure.is_none() {
                    self.late_failure = voted;
                    self.failure = Some(error);
                }
            }
            Report::Aborted { device_idx } => self.finished[device_idx] = true,
        }
    }
}

fn lost(error: channel::RecvTimeoutError) -> Error {
    Error::invalid(
        "step",
        match error {
            channel::RecvTimeoutError::Timeout => {
                format!("no worker reported for {} s; the step was abandoned", REPORT_TIMEOUT.as_secs())
            }
            channel::RecvTimeoutError::Disconnected => {
                "a worker thread vanished without reporting; the step was abandoned".to_string()
            }
        },
    )
}

impl Trainer {
    /// Pipeline devices whose worker runs in this process.
    pub(super) fn local_workers(&self) -> Vec<usize> {
        (0..self.workers.len()).filter(|&d| self.workers[d].is_some()).collect()
    }

    /// How long a rank waits in a collective for the others: as long as it would wait for its own
    /// workers.
    pub(super) fn collective_timeout(&self) -> Duration {
        REPORT_TIMEOUT
    }

    /// Collects a step; `next`, a step launched after it (overlapped steps), is abandoned before
    /// anything is rolled back when this one fails, is refused or must be replayed.
    pub(super) fn collect(&mut self, step: Dispatched, next: &mut Option<InFlight>) -> Result<StepOutcome> {
        let Dispatched { reports, abort, commits, started, started_s, training, slots_this_step, round, optimistic } =
            step;
        let n_devices = self.workers.len();
        let local_workers = self.local_workers();
        let world = self.transport.world_size();
        let peer_abort = match world {
            1 => channel::never(),
            _ => self.transport.inbox(Tag { round, channel: ABORT_CHANNEL })?,
        };
        let mut abort = Some(abort);
        let mut local = Local {
            ready: vec![false; n_devices],
            finished: vec![false; n_devices],
            needs_rollback: vec![false; n_devices],
            ..Default::default()
        };
        let mut peer_failed = false;
        let mut notified = false;
        // Until every local worker has voted (training) or finished; after a failure, until every
        // one has finished.
        loop {
            let healthy = local.failure.is_none() && !peer_failed;
            if local_workers.iter().all(|&d| local.finished[d] || (training && healthy && local.ready[d])) {
                break;
            }
            select! {
                recv(reports) -> report => {
                    let report = report.map_err(|_| lost(channel::RecvTimeoutError::Disconnected))?;
                    let had_failure = local.failure.is_some();
                    local.absorb(report, false);
                    local.after_peer |= !had_failure && local.failure.is_some() && peer_failed;
                }
                recv(peer_abort) -> _ => {
                    peer_failed = true;
                    abort.take();
                    // Free this rank's workers waiting in a collective for a rank that failed.
                    crate::collective::interrupt_waits();
                }
                default(REPORT_TIMEOUT) => return Err(lost(channel::RecvTimeoutError::Timeout)),
            }
            if local.failure.is_some() {
                abort.take();
                // Free the workers of other replicas waiting in the gradient all-reduce.
                self.group_aborts.iter().for_each(|group| group.abort(0, "the step was abandoned"));
                if world > 1 && !notified {
                    crate::collective::interrupt_waits();
                    // Wake every rank's workers that wait for a message from here.
                    notified = true;
                    for peer in (0..world).filter(|&p| p != self.transport.rank()) {
                        let _ = self.transport.send(peer, Tag { round, channel: ABORT_CHANNEL }, Vec::new());
                    }
                }
            }
        }
        let mut committed = false;
        let mut replay = false;
        let mut global_norm = 0.0;
        let mut all_losses = Vec::new();
        if self.shard != 0 {
            // Shard 0's rank speaks for the stage; this rank computed the same losses.
            local.losses.clear();
        }
        if training {
            let vote = match (&local.failure, peer_failed) {
                (Some(_), true) if local.after_peer => Vote::Aborted,
                (Some(error), _) => Vote::Failed { message: error.to_string() },
                (None, true) => Vote::Aborted,
                (None, false) => Vote::Ready {
                    losses: std::mem::take(&mut local.losses),
                    sums_of_squares: std::mem::take(&mut local.sums_of_squares),
                    non_finite: local.non_finite.take(),
                },
            };
            let votes = match world {
                1 => vec![vote],
                _ => self
                    .transport
                    .all_gather(vote.encode(), self.collective_timeout())?
                    .iter()
                    .map(|bytes| Vote::decode(bytes))
                    .collect::<Result<Vec<_>>>()?,
            };
            let decision = self.decide(votes, &mut all_losses);
            match (local.failure.is_some(), decision) {
                (true, Err(error)) if local.after_peer => local.failure = Some(error),
                (true, _) => {}
                (false, Ok(norm))
                    if optimistic && self.max_grad_norm.is_some_and(|max| crate::optim::clips(max, norm)) =>
                {
                    // Applied unclipped, but the norm clips: refused for now, replayed below.
                    replay = true;
                    global_norm = norm;
                }
                (false, Ok(norm)) => {
                    committed = true;
                    global_norm = norm;
                    // Workers of an overlapped step applied without it: for them the commit is the
                    // verdict, sent below once every one of them has applied.
                    if !optimistic {
                        for (_, commit) in &commits {
                            let _ = commit.send(Commit { global_norm });
                        }
                    }
                }
                (false, Err(error)) => local.failure = Some(error),
            }
            if !committed {
                abort.take();
            }
        }
        // Every local worker finishes: applied, failed or aborted. A failure now (the apply phase)
        // must free the workers of other replicas or ranks that wait for this one in the apply
        // phase's broadcasts (ZeRO-1).
        let mut late_notified = local.failure.is_some();
        while local_workers.iter().any(|&d| !local.finished[d]) {
            select! {
                recv(reports) -> report => {
                    let report = report.map_err(|_| lost(channel::RecvTimeoutError::Disconnected))?;
                    local.absorb(report, true);
                    if local.failure.is_some() && !late_notified {
                        late_notified = true;
                        self.group_aborts.iter().for_each(|group| group.abort(0, "the step was abandoned"));
                        if world > 1 {
                            crate::collective::interrupt_waits();
                            for peer in (0..world).filter(|&p| p != self.transport.rank()) {
                                let _ = self.transport.send(peer, Tag { round, channel: ABORT_CHANNEL }, Vec::new());
                            }
                        }
                    }
                }
                recv(peer_abort) -> _ => {
                    crate::collective::interrupt_waits();
                }
                default(REPORT_TIMEOUT) => return Err(lost(channel::RecvTimeoutError::Timeout)),
            }
        }
        // The verdict of an overlapped step: only after every worker applied it. A worker that
        // failed while applying leaves it unsent, so no worker prepares the next step on top of
        // an update that is about to be rolled back (its snapshot would be gone).
        if optimistic && committed && local.failure.is_none() {
            for (_, commit) in &commits {
                let _ = commit.send(Commit { global_norm });
            }
        }
        drop(abort);
        let mut finish = std::mem::take(&mut local.finish);
        if self.shard != 0 {
            // Shard 0's rank reports the stage's outputs, CPU times and activation peaks; this
            // rank's ops go to `StepReport::other_events`.
            finish.cpu_times.clear();
            finish.outputs.clear();
            finish.peak_activation_bytes.clear();
        }
        let local_late = local.failure.as_ref().filter(|_| local.late_failure || !training);
        finish.failure = local_late.map(Error::to_string);
        finish.started_s = started_s;
        for &d in &local_workers {
            let group = d * self.tensor_parallel..(d + 1) * self.tensor_parallel;
            // With a rank per shard this rank reports its own device of the group.
            let here = |i: &usize| self.ranks_per_worker == 1 || *i == d * self.tensor_parallel + self.shard;
            finish.peak_memory.extend(group.filter(here).map(|i| (i, self.devices[i].peak_memory())));
        }
        let finishes = match world {
            1 => vec![finish],
            _ => self
                .transport
                .all_gather(finish.encode()?, self.collective_timeout())?
                .iter()
                .map(|bytes| Finish::decode(bytes))
                .collect::<Result<Vec<_>>>()?,
        };
        if local.failure.is_none()
            && let Some((rank, message)) =
                finishes.iter().enumerate().find_map(|(rank, f)| f.failure.clone().map(|m| (rank, m)))
        {
            local.failure = Some(Error::RankFailed { rank, message });
        }
        if local.failure.is_some() || replay {
            // The next step ran on this one's update: it goes first (it may hold a snapshot of
            // its own only if this one was validated, which it was not).
            self.abandon(next.take())?;
        }
        if replay {
            self.roll_back(&local.needs_rollback, &Error::invalid("overlapped step", "the gradients must be clipped"))?;
            let mut outcome = self.report(finishes, all_losses, global_norm, started, slots_this_step, training);
            outcome.replay = true;
            return Ok(outcome);
        }
        if let Some(error) = local.failure {
            if local.needs_rollback.iter().any(|&r| r) {
                self.roll_back(&local.needs_rollback, &error)?;
            }
            if world > 1 {
                // Every rank abandons the step here, so every rank's split layers recover together.
                let recovered = self.recover_collectives();
                crate::collective::resume_waits();
                recovered?;
            }
            if self.replicas > 1 || !self.ties.is_empty() {
                self.renew_gradient_groups()?;
            }
            // Under f16 loss scaling a gradient that overflowed is GradScaler's skipped step: not
            // committed (as any non-finite step), not an error; the scale is lowered.
            if self.loss_scaler.is_some()
                && let Error::NonFiniteStep { what: crate::NonFinite::Gradient, .. } = error
            {
                let mut outcome = self.report(finishes, all_losses, f64::INFINITY, started, slots_this_step, training);
                outcome.report.skipped = true;
                if let Some(scaler) = self.loss_scaler.as_mut() {
                    scaler.overflowed();
                }
                return Ok(outcome);
            }
            return Err(error);
        }
        let outcome = self.report(finishes, all_losses, global_norm, started, slots_this_step, training);
        if let (true, Some(scaler)) = (training, self.loss_scaler.as_mut()) {
            scaler.committed();
        }
        Ok(outcome)
    }

    /// The commit decision every rank takes from the same votes: the global gradient norm, or why
    /// the step is refused (the first failing rank's error, or a non-finite loss or gradient). A
    /// rank that only aborted because another failed is named only if no rank reports a failure of
    /// its own: the error names the rank that failed, not the first one woken by its notice.
    fn decide(&self, votes: Vec<Vote>, all_losses: &mut Vec<(usize, f64)>) -> Result<f64> {
        // One slot per rank's worker: worker `w`, shard `rank % ranks_per_worker` (replicas other
        // than 0 vote 0: their gradients are replica 0's after the all-reduce).
        let per_worker = self.ranks_per_worker;
        let mut sums = vec![0.0; self.workers.len() * per_worker];
        let mut non_finite: Option<(usize, String)> = None;
        let mut first_aborted = None;
        for (rank, vote) in votes.into_iter().enumerate() {
            match vote {
                Vote::Failed { message } => return Err(Error::RankFailed { rank, message }),
                Vote::Aborted => {
                    first_aborted.get_or_insert(rank);
                }
                Vote::Ready { losses, sums_of_squares, non_finite: nf } => {
                    all_losses.extend(losses);
                    for (w, s) in sums_of_squares {
                        sums[w * per_worker + rank % per_worker] = s;
                    }
                    if let Some((stage_idx, parameter)) = nf
                        && non_finite.as_ref().is_none_or(|(first, _)| stage_idx < *first)
                    {
                        non_finite = Some((stage_idx, parameter));
                    }
                }
            }
        }
        if let Some(rank) = first_aborted {
            return Err(Error::RankFailed { rank, message: "aborted by a failure on another rank".into() });
        }
        if let Some(error) = self.non_finite_error(all_losses, non_finite) {
            return Err(error);
        }
        // Summed in device order on every rank: the same norm bit for bit wherever it is taken.
        Ok(sums.iter().sum::<f64>().sqrt())
    }

    /// The step's report from every rank's end of it, on rank 0's time line.
    fn report(
        &self,
        finishes: Vec<Finish>,
        mut losses: Vec<(usize, f64)>,
        global_norm: f64,
        started: Instant,
        slots_this_step: Option<usize>,
        training: bool,
    ) -> StepOutcome {
        let origin = finishes.iter().map(|f| f.started_s).fold(f64::INFINITY, f64::min);
        let mut events = Vec::new();
        let mut op_cpu_times = Vec::new();
        let mut peak_activation_bytes = vec![0; self.stage_info.len()];
        let mut peak_memory = vec![0; self.devices.len()];
        let mut outputs = Vec::new();
        let mut other_events = Vec::new();
        let n_devices = self.schedule().n_devices();
        for (rank, finish) in finishes.into_iter().enumerate() {
            let shift = if origin.is_finite() { finish.started_s - origin } else { 0.0 };
            let shard = rank % self.ranks_per_worker;
            for mut e in finish.events {
                e.start_s += shift;
                e.end_s += shift;
                // Replica 0's shard-0 ops make the pipeline's time line; the others are kept by row.
                match (e.device_idx < n_devices, shard) {
                    (true, 0) => events.push(e),
                    _ => other_events.push((e.device_idx * self.ranks_per_worker + shard, e)),
                }
            }
            op_cpu_times.extend(finish.cpu_times);
            for (stage_idx, bytes) in finish.peak_activation_bytes {
                peak_activation_bytes[stage_idx] = bytes;
            }
            for (device, bytes) in finish.peak_memory {
                peak_memory[device] = bytes;
            }
            outputs.extend(finish.outputs);
        }
        losses.sort_by_key(|(mb, _)| *mb);
        let loss = losses.iter().map(|(_, l)| l).sum();
        outputs.sort_by_key(|(mb, _)| *mb);
        let mut timeline = conveyor_schedules::Timeline::new(n_devices, self.stage_info.len());
        events.sort_by(|a: &conveyor_schedules::TimelineEvent, b| a.start_s.total_cmp(&b.start_s));
        timeline.events = events;
        StepOutcome {
            report: StepReport {
                loss,
                peak_memory,
                peak_activation_bytes,
                timeline,
                other_events,
                started_s: if origin.is_finite() { origin } else { 0.0 },
                step_s: started.elapsed().as_secs_f64(),
                grad_norm: global_norm,
                op_cpu_times,
                core_slots: slots_this_step,
                core_wake_latency_s: self.slots.as_ref().filter(|_| slots_this_step.is_some()).map(|slots| {
                    let latencies = slots.take_wake_latencies();
                    latencies.iter().sum::<f64>() / latencies.len().max(1) as f64
                }),
                loss_scale: self.loss_scaler.map(|scaler| scaler.scale()).filter(|_| training),
                skipped: false,
                replayed: false,
            },
            outputs: outputs.into_iter().map(|(_, t)| t).collect(),
            replay: false,
        }
    }

    /// The error for a step whose votes found a non-finite loss or gradient, if any: the loss of
    /// the first such micro-batch, else the first stage's first such gradient.
    fn non_finite_error(&self, losses: &[(usize, f64)], non_finite_grad: Option<(usize, String)>) -> Option<Error> {
        let bad_loss = losses.iter().filter(|(_, l)| !l.is_finite()).map(|(mb, _)| *mb).min();
        let output_stage = self.stage_info.iter().find(|s| s.holds_output).map_or(0, |s| s.stage_idx);
        let (stage_idx, what, micro_batch_idx) = match (bad_loss, &non_finite_grad) {
            (Some(mb), _) => (output_stage, crate::NonFinite::Loss, Some(mb)),
            (None, Some((stage_idx, _))) => (*stage_idx, crate::NonFinite::Gradient, None),
            (None, None) => return None,
        };
        Some(Error::NonFiniteStep {
            step_idx: self.step_idx,
            stage_idx,
            device: self.stage_devices[0][stage_idx].to_string(),
            what,
            micro_batch_idx,
            parameter: non_finite_grad.map(|(_, p)| p),
        })
    }

    /// Recovers every split layer's collectives on this rank's workers, in stage and node order
    /// (the same on every rank), after an abandoned step ([`crate::Layer::recover_collectives`]).
    fn recover_collectives(&mut self) -> Result<()> {
        let outcomes = self.on_every_worker(|stages| {
            for stage in stages.iter() {
                for node in &stage.nodes {
                    node.layer.recover_collectives()?;
                }
            }
            Ok(())
        })?;
        outcomes.into_iter().collect::<Result<()>>()
    }

    /// Makes the gradient groups (replicas, tied parameters) usable after an abandoned step: in
    /// one process, new groups for every worker (the old ones may hold the aborted all-reduce's
    /// messages); across ranks, every rank's groups recover (every rank does this after the same
    /// step).
    fn renew_gradient_groups(&mut self) -> Result<()> {
        if self.transport.world_size() == 1 {
            let device_of = |w: usize| self.devices[w * self.tensor_parallel].clone();
            let groups = super::gradient_groups::in_process_groups(&self.group_layout, &self.ties, device_of)?;
            self.group_aborts = groups.iter().flat_map(|g| g.aborts()).collect();
            for (worker, groups) in self.workers.iter().zip(groups) {
                if let Some(worker) = worker {
                    let _ = worker.commands.send(Command::SetGradientGroups(Box::new(groups)));
                }
            }
            return Ok(());
        }
        for worker in self.workers.iter().flatten() {
            let (tx, rx) = channel::bounded(1);
            if worker.commands.send(Command::RecoverGradientGroups(tx)).is_ok() {
                rx.recv().unwrap_or(Ok(()))?;
            }
        }
        Ok(())
    }

    /// Abandons a step launched after the one being collected (overlapped steps): no verdict is
    /// sent for it, its abort channel closes (every worker still in it stops at its next wait, and
    /// the replicas' all-reduce is interrupted), every local worker's report is awaited, and the
    /// workers that applied it optimistically put their snapshot back. Then the gradient groups are
    /// renewed, as after any abandoned step. Nothing of it remains.
    pub(super) fn abandon(&mut self, step: Option<InFlight>) -> Result<()> {
        let Some(step) = step else { return Ok(()) };
        let Dispatched { reports, abort, commits, .. } = step.dispatched;
        drop((commits, abort));
        self.group_aborts.iter().for_each(|group| group.abort(0, "the step was abandoned"));
        let local_workers = self.local_workers();
        let mut finished = vec![false; self.workers.len()];
        let mut needs_rollback = vec![false; self.workers.len()];
        while local_workers.iter().any(|&d| !finished[d]) {
            match reports.recv_timeout(REPORT_TIMEOUT).map_err(lost)? {
                Report::Ready { .. } => {}
                Report::Done { device_idx, applied, .. } => {
                    finished[device_idx] = true;
                    needs_rollback[device_idx] = applied;
                }
                Report::Failed { device_idx, needs_rollback: applied, .. } => {
                    finished[device_idx] = true;
                    needs_rollback[device_idx] = applied;
                }
                Report::Aborted { device_idx } => finished[device_idx] = true,
            }
        }
        if needs_rollback.iter().any(|&r| r) {
            self.roll_back(&needs_rollback, &Error::invalid("overlapped step", "abandoned after its update"))?;
        }
        if self.replicas > 1 || !self.ties.is_empty() {
            self.renew_gradient_groups()?;
        }
        Ok(())
    }

    /// Undoes a step that some workers applied before another failed: every local worker that may
    /// hold the update puts back its undo snapshot (every rank does this for its own workers, from
    /// the same gathered outcome). If one cannot (a stage without a snapshot), the trainer is
    /// poisoned and says so.
    fn roll_back(&mut self, needs_rollback: &[bool], cause: &Error) -> Result<()> {
        let mut all_restored = true;
        for (worker, _) in self.workers.iter().zip(needs_rollback).filter(|(_, r)| **r) {
            let Some(worker) = worker else { continue };
            let (tx, rx) = channel::bounded(1);
            let restored = worker.commands.send(Command::RollBack(tx)).is_ok() && rx.recv().unwrap_or(false);
            all_restored &= restored;
        }
        if all_restored {
            return Ok(());
        }
        let reason = format!(
            "a step failed after some stages applied their update ({cause}), and a stage without an undo snapshot \
             could not be rolled back"
        );
        self.poisoned = Some(reason.clone());
        Err(Error::Poisoned { reason })
    }
}
