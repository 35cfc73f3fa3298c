//! A device's worker thread: executes its instruction list for each step, moving messages over
//! crossbeam channels, recording every op on the timeline, and taking part in the two-phase
//! commit that makes a step all-or-nothing.
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Instant;

use conveyor_schedules::{Instruction, OpKind, TimelineEvent};
use crossbeam::channel::{Receiver, Sender};

use super::core_seat::{Aborted, CoreSeat};
use super::core_slots::CoreSlots;
use super::gradient_buckets::BucketReducer;
use super::gradient_groups::{GradientGroups, GroupComm};
use super::stage::{Payload, Stage, StepCtx};
use super::{FaultInjection, FaultPoint};
use crate::graph::NodeId;
use crate::transport::{Tag, Transport};
use crate::{Device, Error, Loss, Result, Targets, Tensor};

/// A message between stages: one micro-batch's tensors.
pub(crate) type Message = (usize, Payload);

/// Key of a channel: (from stage, to stage, gradient?).
pub(crate) type ChannelKey = (usize, usize, bool);

/// The channel ends a worker uses in one step: channels of tensors to and from stages of this
/// process, and for stages on other ranks the rank and the transport's tag (sends) or inbox
/// (receives); see `transport/README.md`.
#[derive(Default)]
pub(crate) struct Links {
    pub senders: HashMap<ChannelKey, Sender<Message>>,
    pub receivers: HashMap<ChannelKey, Receiver<Message>>,
    pub remote_senders: HashMap<ChannelKey, (usize, Tag)>,
    pub remote_receivers: HashMap<ChannelKey, Receiver<Vec<u8>>>,
    pub transport: Option<Arc<dyn Transport>>,
}

impl Links {
    /// Receives the message on channel `key` for a stage on `device`: from a local stage through
    /// the core seat, from another rank through the transport's inbox (decoded onto `device`).
    fn recv(
        &self,
        seat: &mut CoreSeat<'_>,
        key: ChannelKey,
        abort: &Receiver<()>,
        device: &Device,
    ) -> std::result::Result<(Message, Option<Instant>), OpFailure> {
        if let Some(inbox) = self.remote_receivers.get(&key) {
            let bytes = super::core_seat::poll_then_block(inbox, abort, super::core_seat::POLL_BEFORE_SLEEP)?;
            return Ok((super::ranks::decode_message(&bytes, device)?, None));
        }
        let rx = self.receivers.get(&key).ok_or_else(|| missing_link(key))?;
        Ok(seat.recv(rx, key, abort)?)
    }
}

fn missing_link(key: ChannelKey) -> Error {
    Error::invalid("links", format!("no channel from stage {} to stage {} (gradient: {})", key.0, key.1, key.2))
}

/// Rows `start..start + len` of a caller's input tensor for graph input `node`: cut out and moved
/// onto the stage's device by the worker when the micro-batch's forward begins, so that a step
/// launched while another runs (overlapped steps) holds none of its inputs on a device before
/// that device starts it, and a device holds only the running micro-batch's rows.
pub(crate) struct InputRows {
    pub node: NodeId,
    pub tensor: Tensor,
    pub start: usize,
    pub len: usize,
}

impl InputRows {
    /// The rows on `device`.
    fn take(self, device: &Device) -> Result<(NodeId, Tensor)> {
        Ok((self.node, self.tensor.narrow_rows(self.start, self.len)?.move_to_device(device)?))
    }
}

/// One step's work for one worker.
pub(crate) struct StepJob {
    pub step_idx: u64,
    pub seed: u64,
    pub training: bool,
    pub program: Vec<Instruction>,
    pub n_micro_batches: usize,
    pub normalizer: f32,
    /// Per stage held by this worker: per micro-batch, the graph inputs it reads.
    pub data: HashMap<usize, Vec<Vec<InputRows>>>,
    /// Per micro-batch targets, on the host (for the stage holding the output, when training).
    pub targets: Vec<Option<Targets>>,
    pub links: Links,
    /// Devices of every stage, to move messages onto the receiver's device.
    pub stage_devices: Arc<Vec<Device>>,
    /// The worker of every stage, to queue a message's receiver for a core slot.
    pub stage_workers: Arc<Vec<usize>>,
    pub abort: Receiver<()>,
    pub commit: Receiver<Commit>,
    pub fault: Option<FaultInjection>,
    pub stall: Option<super::StallInjection>,
    pub started: Instant,
    pub max_grad_norm: Option<f64>,
    /// Whether this step's compute ops take core slots (when the trainer has them).
    pub use_core_slots: bool,
    /// Added to this worker's micro-batch indices in what it reports (losses, outputs): replica
    /// `r`'s micro-batches come after those of the replicas before it.
    pub micro_batch_offset: usize,
    /// With data-parallel replicas: the gradient buckets' size, or `None` to all-reduce every
    /// gradient at the optimizer step ([`super::TrainerBuilder::bucket_size`]).
    pub bucket_bytes: Option<usize>,
    /// Whether the commit applies the optimizer; false for [`super::Trainer::gradient_step`],
    /// which stops after the vote and leaves the step's gradients in the stages.
    pub apply: bool,
    /// The autocast policy the layers run under ([`super::TrainerBuilder::precision`]).
    pub precision: crate::Precision,
    /// The loss scale of this step (f16 training; 1 otherwise): the loss gradient is multiplied
    /// by it and every gradient divided by it in the prepare phase.
    pub loss_scale: f32,
    /// Overlapped steps ([`super::TrainerBuilder::overlap_steps`]): apply the update right after
    /// the vote, unclipped, without waiting for the commit; the coordinator validates the step
    /// afterwards, and this worker waits for that verdict before it prepares its next update
    /// (`runtime/README.md`, "Overlapped steps").
    pub optimistic: bool,
    /// The learning rate every stage's optimizer takes before this step's update, if set.
    pub lr: Option<f64>,
}

/// The coordinator's decision after every worker is ready.
pub(crate) struct Commit {
    pub global_norm: f64,
}

/// What a worker tells the coordinator about a step.
pub(crate) enum Report {
    /// Every backward is done and the commit prepared (the vote): losses per micro-batch, the
    /// gradients' sum of squares, and the first stage and parameter with a non-finite gradient.
    Ready { device_idx: usize, losses: Vec<(usize, f64)>, sum_of_squares: f64, non_finite: Option<(usize, String)> },
    /// The optimizer was applied (or the evaluation finished).
    Done {
        device_idx: usize,
        /// The worker's stages hold this step's update (undone only by [`Command::RollBack`]).
        applied: bool,
        events: Vec<TimelineEvent>,
        cpu_times: Vec<super::OpCpuTime>,
        peak_activation_bytes: Vec<(usize, u64)>,
        outputs: Vec<(usize, Tensor)>,
    },
    /// The step failed here; with `needs_rollback` after the worker began applying its update.
    Failed { device_idx: usize, error: Error, needs_rollback: bool },
    /// The step was aborted because of a failure elsewhere.
    Aborted { device_idx: usize },
}

/// A closure run on a worker's stages.
pub(crate) type StagesJob = Box<dyn FnOnce(&mut [Stage]) + Send>;

/// Commands a worker thread takes.
pub(crate) enum Command {
    Step(Box<StepJob>, Sender<Report>),
    /// Runs a closure on the worker's stages (parameter gather, load, state export).
    With(StagesJob),
    /// Puts back every stage's parameters and optimizer state from the undo snapshot of the last
    /// step (another worker's update failed after this one applied); answers whether every stage
    /// could be restored.
    RollBack(Sender<bool>),
    /// Replaces the worker's gradient groups (after an abandoned step, for in-process groups).
    SetGradientGroups(Box<GradientGroups>),
    /// Recovers the worker's gradient groups over ranks after an abandoned step (every rank does).
    RecoverGradientGroups(Sender<Result<()>>),
    Shutdown,
}

enum OpFailure {
    Aborted,
    Failed(Error),
}

impl From<Error> for OpFailure {
    fn from(error: Error) -> Self {
        OpFailure::Failed(error)
    }
}

impl From<Aborted> for OpFailure {
    fn from(_: Aborted) -> Self {
        OpFailure::Aborted
    }
}

/// Sends a step's report when dropped unless one was sent: a worker thread that dies in a way
/// `catch_unwind` cannot see (a panic while unwinding) still tells the coordinator at once.
struct ReportGuard<'a> {
    device_idx: usize,
    device: String,
    reports: &'a Sender<Report>,
    sent: bool,
}

impl ReportGuard<'_> {
    fn send(&mut self, report: Report) {
        self.sent = true;
        // The coordinator may have given up on us; nothing else to do then.
        let _ = self.reports.send(report);
    }
}

impl Drop for ReportGuard<'_> {
    fn drop(&mut self) {
        if !self.sent {
            let error = Error::WorkerPanicked {
                device_idx: self.device_idx,
                device: self.device.clone(),
                message: "the worker thread died during the step".into(),
            };
            let _ = self.reports.send(Report::Failed { device_idx: self.device_idx, error, needs_rollback: true });
        }
    }
}

/// The worker thread's loop: runs commands until `Shutdown` or the command channel closes. A
/// panic anywhere in a command (outside the ops, which catch their own) is caught here and
/// reported as [`Error::WorkerPanicked`]; the worker stays alive for the next command.
pub(crate) fn run(
    device_idx: usize,
    mut stages: Vec<Stage>,
    loss: Arc<dyn Loss>,
    commands: Receiver<Command>,
    core_slots: Option<Arc<CoreSlots>>,
    mut groups: GradientGroups,
) {
    let device = stages.first().map(|s| s.device.to_string()).unwrap_or_default();
    // The commit channel of the last step this worker applied optimistically, until it has read
    // the coordinator's verdict from it (overlapped steps).
    let mut unvalidated: Option<Receiver<Commit>> = None;
    while let Ok(command) = commands.recv() {
        match command {
            Command::Step(mut job, reports) => {
                let mut guard = ReportGuard { device_idx, device: device.clone(), reports: &reports, sent: false };
                let slots = core_slots.as_deref().filter(|_| job.use_core_slots);
                let mut applied = false;
                let report = catch_unwind(AssertUnwindSafe(|| {
                    let ctx = RunCtx {
                        device_idx,
                        loss: loss.as_ref(),
                        reports: &reports,
                        core_slots: slots,
                        groups: &groups,
                    };
                    run_step(&ctx, &mut stages, &mut job, &mut applied, &mut unvalidated)
                }))
                .unwrap_or_else(|payload| {
                    let message = panic_message(payload);
                    tracing::error!(device_idx, %message, "worker panicked");
                    Report::Failed {
                        device_idx,
                        error: Error::WorkerPanicked { device_idx, device: device.clone(), message },
                        needs_rollback: applied,
                    }
                });
                let _ = catch_unwind(AssertUnwindSafe(|| stages.iter_mut().for_each(Stage::end_step)));
                guard.send(report);
            }
            Command::With(f) => {
                // A panicking closure drops its answer channel, which its caller reports.
                let _ = catch_unwind(AssertUnwindSafe(|| f(&mut stages)));
            }
            Command::RollBack(answer) => {
                // The update rolled back is the unvalidated one, if any: nothing is left to wait for.
                unvalidated = None;
                // Every stage, even after one fails to restore.
                let restored = catch_unwind(AssertUnwindSafe(|| {
                    stages.iter_mut().map(Stage::roll_back).fold(true, |all, restored| all & restored)
                }));
                let _ = answer.send(restored.unwrap_or(false));
            }
            Command::SetGradientGroups(new) => groups = *new,
            Command::RecoverGradientGroups(answer) => {
                let _ = answer.send(groups.recover());
            }
            Command::Shutdown => break,
        }
    }
}

pub(crate) fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// Runs one op (or message, or commit phase) with fault injection and panic capture, naming
/// stage, point and micro-batch on failure.
fn guarded<T>(
    stage_idx: usize,
    device: &Device,
    at: FaultPoint,
    micro_batch_idx: Option<usize>,
    fault: Option<FaultInjection>,
    f: impl FnOnce() -> std::result::Result<T, OpFailure>,
) -> std::result::Result<T, OpFailure> {
    let fail = |message: String| {
        OpFailure::Failed(Error::StageFailed {
            stage_idx,
            device: device.to_string(),
            op: at.name().to_string(),
            micro_batch_idx,
            message,
        })
    };
    let injected = fault.filter(|f| f.strikes(stage_idx, at, micro_batch_idx));
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        if let Some(fault) = injected {
            if fault.panic {
                panic!("injected panic");
            }
            return Err(OpFailure::Failed(Error::invalid("fault injection", "injected failure")));
        }
        f()
    }));
    match outcome {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(OpFailure::Aborted)) => Err(OpFailure::Aborted),
        Ok(Err(OpFailure::Failed(error @ Error::StageFailed { .. }))) => Err(OpFailure::Failed(error)),
        Ok(Err(OpFailure::Failed(error))) => Err(fail(error.to_string())),
        Err(payload) => Err(fail(format!("panicked: {}", panic_message(payload)))),
    }
}

/// An injected fault at a message (`Send`, `Receive`) of one stage and micro-batch, reported as
/// [`guarded`] reports it; free when no fault is injected (the usual case, on every message).
fn injected(
    fault: Option<FaultInjection>,
    stage_idx: usize,
    device: &Device,
    at: FaultPoint,
    micro_batch_idx: usize,
) -> std::result::Result<(), OpFailure> {
    match fault.filter(|f| f.strikes(stage_idx, at, Some(micro_batch_idx))) {
        Some(_) => guarded(stage_idx, device, at, Some(micro_batch_idx), fault, || Ok(())),
        None => Ok(()),
    }
}

/// [`guarded`] for a compute op on one stage.
fn guarded_mut<T>(
    stage: &mut Stage,
    op: OpKind,
    micro_batch_idx: usize,
    fault: Option<FaultInjection>,
    f: impl FnOnce(&mut Stage) -> std::result::Result<T, OpFailure>,
) -> std::result::Result<T, OpFailure> {
    let (stage_idx, device) = (stage.stage_idx, stage.device.clone());
    guarded(stage_idx, &device, FaultPoint::Op(op), Some(micro_batch_idx), fault, || f(stage))
}

/// What a step's run needs from the worker besides its stages and the job.
struct RunCtx<'a> {
    device_idx: usize,
    loss: &'a dyn Loss,
    reports: &'a Sender<Report>,
    core_slots: Option<&'a CoreSlots>,
    groups: &'a GradientGroups,
}

fn run_step(
    ctx: &RunCtx<'_>,
    stages: &mut [Stage],
    job: &mut StepJob,
    applied: &mut bool,
    unvalidated: &mut Option<Receiver<Commit>>,
) -> Report {
    let device_idx = ctx.device_idx;
    let mut events = Vec::with_capacity(job.program.len() * 2);
    let mut cpu_times = Vec::with_capacity(job.program.len());
    let mut outputs = Vec::new();
    let outcome = execute(ctx, stages, job, (&mut events, &mut cpu_times, &mut outputs), applied, unvalidated);
    match outcome {
        Ok(()) => Report::Done {
            device_idx,
            applied: *applied,
            events,
            cpu_times,
            peak_activation_bytes: stages.iter().map(|s| (s.stage_idx, s.peak_activation_bytes)).collect(),
            outputs,
        },
        Err(OpFailure::Aborted) => Report::Aborted { device_idx },
        Err(OpFailure::Failed(error)) => Report::Failed { device_idx, error, needs_rollback: *applied },
    }
}

fn execute(
    run: &RunCtx<'_>,
    stages: &mut [Stage],
    job: &mut StepJob,
    (events, cpu_times, outputs): (&mut Vec<TimelineEvent>, &mut Vec<super::OpCpuTime>, &mut Vec<(usize, Tensor)>),
    applied: &mut bool,
    unvalidated: &mut Option<Receiver<Commit>>,
) -> std::result::Result<(), OpFailure> {
    let (device_idx, loss, reports, core_slots) = (run.device_idx, run.loss, run.reports, run.core_slots);
    let ctx = StepCtx {
        step_idx: job.step_idx,
        seed: job.seed,
        n_micro_batches: job.n_micro_batches,
        normalizer: job.normalizer,
        loss,
        training: job.training,
        micro_batch_offset: job.micro_batch_offset,
        precision: job.precision,
        loss_scale: job.loss_scale,
    };
    for stage in stages.iter_mut() {
        if job.fault.is_some_and(|f| f.panic && f.strikes(stage.stage_idx, FaultPoint::WorkerLoop, None)) {
            panic!("injected panic in the worker loop");
        }
        // An update not yet validated keeps its undo snapshot until this step's prepare phase,
        // which comes after the verdict.
        stage.begin_step(job.n_micro_batches, unvalidated.is_none())?;
    }
    let device = stages.first().map(|s| s.device.clone()).expect("a worker holds at least one stage");
    let mut rec = OpRecorder { device_idx, device, started: job.started, events, cpu_times };
    let mut losses = Vec::new();
    // With core slots the worker holds one whenever it runs (ops and the bookkeeping between
    // them) and gives it up only to block, so no more workers are runnable than there are cores
    // and the operating system never has to choose among them: the slot queue decides, first come
    // first served, as `simulate_with_core_slots` assumes.
    let mut seat = CoreSeat::new(core_slots, device_idx);
    let local = |stages: &[Stage], stage_idx: usize| stages.iter().position(|s| s.stage_idx == stage_idx);
    // Data parallelism with buckets: a communication thread all-reduces each bucket of final
    // gradients while this thread goes on (see `gradient_buckets.rs`).
    let buckets = job.bucket_bytes.filter(|_| job.training).zip(run.groups.replica.as_ref());
    std::thread::scope(|scope| {
        let mut reducer = buckets.map(|(cap, comm)| BucketReducer::start(scope, comm, cap, job.started, device_idx));
        let outcome = catch_unwind(AssertUnwindSafe(|| -> std::result::Result<(), OpFailure> {
            for (instruction_idx, instruction) in job.program.iter().enumerate() {
                if let Some(stall) =
                    job.stall.filter(|s| s.device_idx == device_idx && s.instruction_idx == instruction_idx)
                {
                    seat.release();
                    std::thread::sleep(std::time::Duration::from_secs_f64(stall.seconds));
                }
                let op = instruction.op_kind();
                let micro_batch_idx = instruction.micro_batch_idx();
                if op == OpKind::OptimizerStep {
                    if !job.training {
                        continue;
                    }
                    // Data parallelism: every replica's gradients summed into each (a fixed order, the same
                    // sum in every replica) before anything reads them.
                    let replica = run.groups.replica.as_ref().map(GroupComm::comm);
                    // The sums wait for other workers, which may need a core slot to get there:
                    // no slot is held while waiting (with more workers than cores, two replicas'
                    // workers holding both slots in the all-reduce would wait for ever on the
                    // other replica's, which have none).
                    let sums = replica.is_some() || !run.groups.ties.is_empty();
                    if sums {
                        seat.release();
                    }
                    if let Some(reducer) = reducer.take() {
                        let first =
                            stages.first().map(|s| (s.stage_idx, s.device.clone())).expect("a worker holds a stage");
                        // Every gradient comes back, whatever happens next.
                        let finished = reducer.finish(stages);
                        let events = guarded(first.0, &first.1, FaultPoint::Prepare, None, job.fault, || {
                            finished.map_err(|error| match error {
                                // Another worker failed and abandoned the step; its report says why.
                                Error::CollectiveAborted { .. } => OpFailure::Aborted,
                                error => OpFailure::Failed(error),
                            })
                        })?;
                        rec.events.extend(events);
                    } else if let Some(replica) = replica {
                        for stage in stages.iter_mut() {
                            let (stage_idx, device) = (stage.stage_idx, stage.device.clone());
                            rec.record(Some(stage_idx), OpKind::AllReduce, None, || {
                                guarded(stage_idx, &device, FaultPoint::Prepare, None, job.fault, || {
                                    Ok(stage.all_reduce_gradients(replica)?)
                                })
                            })?;
                        }
                    }
                    // Tied parameters: every copy's gradient summed into each (after the replicas' sums).
                    if !run.groups.ties.is_empty() {
                        let first = run.groups.ties[0].copies[0].stage_idx;
                        let device = stages.iter().find(|s| s.stage_idx == first).map(|s| s.device.clone());
                        let device = device.unwrap_or_else(Device::host);
                        rec.record(None, OpKind::AllReduce, None, || {
                            guarded(first, &device, FaultPoint::Prepare, None, job.fault, || {
                                Ok(run.groups.sum_tied(stages)?)
                            })
                        })?;
                    }
                    if sums {
                        rec.take_core(&mut seat, None, None, &job.abort)?;
                    }
                    // Overlapped steps: the last update must be validated before this one is
                    // prepared (which reuses its undo snapshot). The verdict is the commit the
                    // coordinator sent for that step; none (a closed channel) means the step was
                    // refused, and the coordinator aborts this one and rolls that one back.
                    if let Some(verdict) = unvalidated.take() {
                        seat.wait_for(&verdict, &job.abort)?;
                        rec.take_core(&mut seat, None, None, &job.abort)?;
                    }
                    // The commit (see runtime/README.md). Prepare: everything that can fail, then vote.
                    let mut sum_of_squares = 0.0;
                    let mut non_finite = None;
                    for stage in stages.iter_mut() {
                        let (stage_idx, device) = (stage.stage_idx, stage.device.clone());
                        let vote = guarded(stage_idx, &device, FaultPoint::Prepare, None, job.fault, || {
                            Ok(stage.prepare_commit(job.loss_scale)?)
                        })?;
                        sum_of_squares += vote.sum_of_squares;
                        if let (None, Some(parameter)) = (&non_finite, vote.non_finite_parameter) {
                            non_finite = Some((stage_idx, parameter));
                        }
                        guarded(stage_idx, &device, FaultPoint::Vote, None, job.fault, || Ok(()))?;
                    }
                    let losses = std::mem::take(&mut losses);
                    // A worker that already knows the step will be refused (its own gradients are
                    // not finite) waits for the refusal instead of applying.
                    let finite_here = non_finite.is_none();
                    let _ = reports.send(Report::Ready { device_idx, losses, sum_of_squares, non_finite });
                    // Optimistic: apply at once, unclipped (a norm of 0 never clips); the
                    // coordinator replays the step if it finds it must be clipped or refused.
                    let commit = match job.optimistic && job.apply && finite_here {
                        true => {
                            *unvalidated = Some(job.commit.clone());
                            Commit { global_norm: 0.0 }
                        }
                        false => seat.wait_for(&job.commit, &job.abort)?,
                    };
                    if !job.apply {
                        continue;
                    }
                    rec.take_core(&mut seat, None, None, &job.abort)?;
                    // Apply: from here this worker's stages may hold the update until the step ends; a
                    // failure anywhere then rolls every stage back (`needs_rollback`).
                    *applied = true;
                    rec.record(None, op, None, || {
                        for stage in stages.iter_mut() {
                            let (stage_idx, device) = (stage.stage_idx, stage.device.clone());
                            guarded(stage_idx, &device, FaultPoint::Apply, None, job.fault, || {
                                Ok(stage.apply_commit(job.lr, job.max_grad_norm, commit.global_norm, replica)?)
                            })?;
                        }
                        Ok(())
                    })?;
                    continue;
                }
                let stage_idx = instruction.stage_idx().expect("compute instructions have a stage");
                let micro_batch_idx = micro_batch_idx.expect("compute instructions have a micro-batch");
                let Some(s) = local(stages, stage_idx) else {
                    return Err(OpFailure::Failed(Error::invalid(
                        "program",
                        format!("device {device_idx} does not hold stage {stage_idx}"),
                    )));
                };
                match instruction {
                    Instruction::Forward { .. } => {
                        if !stages[s].recv_from.is_empty() {
                            injected(job.fault, stage_idx, &stages[s].device, FaultPoint::Receive, micro_batch_idx)?;
                        }
                        let wait = rec.start_wait(stage_idx, micro_batch_idx);
                        let mut inputs: Payload = Vec::new();
                        let mut queued_at = None;
                        for route in &stages[s].recv_from {
                            let key = (route.peer_stage_idx, stage_idx, false);
                            let ((mb, payload), queued) =
                                job.links.recv(&mut seat, key, &job.abort, &stages[s].device)?;
                            queued_at = queued.or(queued_at);
                            check_order(&stages[s], mb, micro_batch_idx)?;
                            inputs.extend(payload);
                        }
                        if let Some(per_mb) = job.data.get_mut(&stage_idx)
                            && let Some(payload) = per_mb.get_mut(micro_batch_idx)
                        {
                            for rows in payload.drain(..) {
                                inputs.push(rows.take(&stages[s].device)?);
                            }
                        }
                        rec.end_wait(wait, queued_at);
                        let targets = match stages[s].output_node {
                            Some(_) => job.targets.get_mut(micro_batch_idx).and_then(Option::take),
                            None => None,
                        };
                        let stage = &mut stages[s];
                        rec.take_core(&mut seat, Some(stage_idx), Some(micro_batch_idx), &job.abort)?;
                        let (messages, loss_value, eval_output) =
                            rec.record(Some(stage_idx), op, Some(micro_batch_idx), || {
                                guarded_mut(stage, op, micro_batch_idx, job.fault, |stage| {
                                    Ok(stage.forward(&ctx, micro_batch_idx, inputs, targets)?)
                                })
                            })?;
                        if let Some(l) = loss_value {
                            losses.push((job.micro_batch_offset + micro_batch_idx, l));
                        }
                        if let Some(out) = eval_output {
                            outputs.push((job.micro_batch_offset + micro_batch_idx, out));
                        }
                        send_all(job, &seat, stage_idx, micro_batch_idx, messages, false)?;
                    }
                    Instruction::BackwardInput { .. } | Instruction::Backward { .. } => {
                        if stages[s].needs_recompute(micro_batch_idx) {
                            let stage = &mut stages[s];
                            rec.take_core(&mut seat, Some(stage_idx), Some(micro_batch_idx), &job.abort)?;
                            rec.record(Some(stage_idx), OpKind::Recompute, Some(micro_batch_idx), || {
                                guarded_mut(stage, OpKind::Recompute, micro_batch_idx, job.fault, |stage| {
                                    Ok(stage.recompute(&ctx, micro_batch_idx)?)
                                })
                            })?;
                        }
                        let wait = rec.start_wait(stage_idx, micro_batch_idx);
                        let mut received = Vec::new();
                        let mut peers: Vec<usize> = stages[s].send_to.iter().map(|r| r.peer_stage_idx).collect();
                        peers.sort_unstable_by(|a, b| b.cmp(a));
                        if !peers.is_empty() {
                            injected(job.fault, stage_idx, &stages[s].device, FaultPoint::Receive, micro_batch_idx)?;
                        }
                        let mut queued_at = None;
                        for peer in peers {
                            let key = (peer, stage_idx, true);
                            let ((mb, payload), queued) =
                                job.links.recv(&mut seat, key, &job.abort, &stages[s].device)?;
                            queued_at = queued.or(queued_at);
                            check_order(&stages[s], mb, micro_batch_idx)?;
                            received.push(payload);
                        }
                        rec.end_wait(wait, queued_at);
                        let fused = matches!(instruction, Instruction::Backward { .. });
                        let stage = &mut stages[s];
                        rec.take_core(&mut seat, Some(stage_idx), Some(micro_batch_idx), &job.abort)?;
                        let messages = rec.record(Some(stage_idx), op, Some(micro_batch_idx), || {
                            guarded_mut(stage, op, micro_batch_idx, job.fault, |stage| {
                                Ok(stage.backward_input(
                                    micro_batch_idx,
                                    received,
                                    fused,
                                    reducer.as_mut().map(|r| &mut r.queue),
                                )?)
                            })
                        })?;
                        send_all(job, &seat, stage_idx, micro_batch_idx, messages, true)?;
                    }
                    Instruction::BackwardWeight { .. } => {
                        let stage = &mut stages[s];
                        rec.take_core(&mut seat, Some(stage_idx), Some(micro_batch_idx), &job.abort)?;
                        rec.record(Some(stage_idx), op, Some(micro_batch_idx), || {
                            guarded_mut(stage, op, micro_batch_idx, job.fault, |stage| {
                                Ok(stage.backward_weight(micro_batch_idx, reducer.as_mut().map(|r| &mut r.queue))?)
                            })
                        })?;
                    }
                    Instruction::OptimizerStep => unreachable!("handled above"),
                }
            }
            Ok(())
        }));
        // A step that ended early leaves the all-reduces unfinished: end them, take the gradients back.
        if let Some(reducer) = reducer.take() {
            reducer.abandon(stages);
        }
        outcome.unwrap_or_else(|payload| std::panic::resume_unwind(payload))
    })
}

fn check_order(stage: &Stage, got: usize, expected: usize) -> std::result::Result<(), OpFailure> {
    if got != expected {
        return Err(OpFailure::Failed(Error::invalid(
            "schedule",
            format!(
                "stage {} expected micro-batch {expected} but received {got}; the schedule's channel order is broken",
                stage.stage_idx
            ),
        )));
    }
    Ok(())
}

/// Reports the device's bytes in use as a `tracing` event (see [`crate::trace::MEMORY_TARGET`]).
fn note_memory(device_idx: usize, device: &Device) {
    tracing::trace!(target: crate::trace::MEMORY_TARGET, device = device_idx as u64, bytes = device.memory_in_use());
}

/// CPU seconds the calling thread has run (`CLOCK_THREAD_CPUTIME_ID`).
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec through a valid pointer and touches nothing else.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc == 0 { ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9 } else { 0.0 }
}

fn cpu_time_of(event: &TimelineEvent, cpu_s: f64) -> super::OpCpuTime {
    super::OpCpuTime {
        device_idx: event.device_idx,
        stage_idx: event.stage_idx,
        op: event.op,
        micro_batch_idx: event.micro_batch_idx,
        cpu_s,
    }
}

/// Opens the `tracing` span of one op (see [`crate::trace`]); a disabled callsite when no
/// subscriber listens to [`crate::trace::OP_TARGET`].
pub(super) fn op_span(
    device_idx: usize,
    stage_idx: Option<usize>,
    op: OpKind,
    micro_batch_idx: Option<usize>,
) -> tracing::span::EnteredSpan {
    use crate::trace::{NONE_FIELD, OP_TARGET};
    tracing::info_span!(
        target: OP_TARGET,
        "op",
        device = device_idx as u64,
        stage = stage_idx.map_or(NONE_FIELD, |s| s as u64),
        op = crate::trace::op_name(op),
        micro_batch = micro_batch_idx.map_or(NONE_FIELD, |m| m as u64),
    )
    .entered()
}

/// Records what a worker does: each op's `tracing` span, timeline event and CPU time, a memory
/// sample after it, and the waits for input between ops.
struct OpRecorder<'a> {
    device_idx: usize,
    device: Device,
    started: Instant,
    events: &'a mut Vec<TimelineEvent>,
    cpu_times: &'a mut Vec<super::OpCpuTime>,
}

/// A wait for input in progress: its span and start.
struct WaitInProgress {
    span: tracing::span::EnteredSpan,
    stage_idx: usize,
    micro_batch_idx: usize,
    start_s: f64,
}

impl OpRecorder<'_> {
    fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Runs one op and records it (only when it succeeds: a failed step reports its error instead).
    fn record<T>(
        &mut self,
        stage_idx: Option<usize>,
        op: OpKind,
        micro_batch_idx: Option<usize>,
        f: impl FnOnce() -> std::result::Result<T, OpFailure>,
    ) -> std::result::Result<T, OpFailure> {
        let span = op_span(self.device_idx, stage_idx, op, micro_batch_idx);
        let (start_s, cpu_start) = (self.now(), thread_cpu_s());
        let value = f()?;
        let event =
            TimelineEvent { device_idx: self.device_idx, stage_idx, op, micro_batch_idx, start_s, end_s: self.now() };
        self.cpu_times.push(cpu_time_of(&event, thread_cpu_s() - cpu_start));
        self.events.push(event);
        drop(span);
        note_memory(self.device_idx, &self.device);
        Ok(value)
    }

    /// Makes sure the worker holds a core before it computes ([`CoreSeat::take`]), recording the
    /// time in line as `CoreWait`.
    fn take_core(
        &mut self,
        seat: &mut CoreSeat<'_>,
        stage_idx: Option<usize>,
        micro_batch_idx: Option<usize>,
        abort: &Receiver<()>,
    ) -> std::result::Result<(), Aborted> {
        if !seat.must_wait() {
            return Ok(());
        }
        let span = op_span(self.device_idx, stage_idx, OpKind::CoreWait, micro_batch_idx);
        let start_s = self.now();
        let taken = seat.take(abort);
        self.core_wait(stage_idx, micro_batch_idx, start_s);
        drop(span);
        taken.map(|_| ())
    }

    /// Records the time from `start_s` to now spent in line for a core slot.
    fn core_wait(&mut self, stage_idx: Option<usize>, micro_batch_idx: Option<usize>, start_s: f64) {
        let end_s = self.now();
        if end_s - start_s > 5e-6 {
            self.events.push(TimelineEvent {
                device_idx: self.device_idx,
                stage_idx,
                op: OpKind::CoreWait,
                micro_batch_idx,
                start_s,
                end_s,
            });
        }
    }

    fn start_wait(&self, stage_idx: usize, micro_batch_idx: usize) -> WaitInProgress {
        let span = op_span(self.device_idx, Some(stage_idx), OpKind::Wait, Some(micro_batch_idx));
        WaitInProgress { span, stage_idx, micro_batch_idx, start_s: self.now() }
    }

    /// Ends a wait for input; with `queued_at` (the worker slept for the message and then queued
    /// for a core slot) the wait ends there and the rest is `CoreWait`.
    fn end_wait(&mut self, wait: WaitInProgress, queued_at: Option<Instant>) {
        let end_s = match queued_at {
            Some(at) => at.saturating_duration_since(self.started).as_secs_f64(),
            None => self.now(),
        };
        // Waits shorter than a few microseconds are channel bookkeeping, not idling.
        if end_s - wait.start_s > 5e-6 {
            self.events.push(TimelineEvent {
                device_idx: self.device_idx,
                stage_idx: Some(wait.stage_idx),
                op: OpKind::Wait,
                micro_batch_idx: Some(wait.micro_batch_idx),
                start_s: wait.start_s,
                end_s,
            });
        }
        if queued_at.is_some() {
            self.core_wait(Some(wait.stage_idx), Some(wait.micro_batch_idx), end_s);
        }
        drop(wait.span);
    }
}

fn send_all(
    job: &StepJob,
    seat: &CoreSeat<'_>,
    from_stage: usize,
    micro_batch_idx: usize,
    messages: Vec<(usize, Payload)>,
    gradient: bool,
) -> std::result::Result<(), OpFailure> {
    for (to_stage, payload) in messages {
        injected(job.fault, from_stage, &job.stage_devices[from_stage], FaultPoint::Send, micro_batch_idx)?;
        let key = (from_stage, to_stage, gradient);
        if let Some(&(rank, tag)) = job.links.remote_senders.get(&key) {
            let transport = job.links.transport.as_ref().ok_or_else(|| missing_link(key))?;
            transport.send(rank, tag, super::ranks::encode_message(micro_batch_idx, &payload)?)?;
            continue;
        }
        let target = &job.stage_devices[to_stage];
        let moved =
            payload.into_iter().map(|(id, t)| Ok((id, t.move_to_device(target)?))).collect::<Result<Payload>>()?;
        let tx = job.links.senders.get(&key).ok_or_else(|| missing_link(key))?;
        seat.send(tx, key, job.stage_workers[to_stage], (micro_batch_idx, moved))?;
    }
    Ok(())
}
