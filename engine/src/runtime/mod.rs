//! The pipeline runtime: one worker thread per device executing its instruction list from
//! `conveyor-schedules`, micro-batches streaming through bounded crossbeam channels, and a
//! [`Trainer`] (API Boundary) tying graph, placement, schedule and devices together.
//!
//! Why it cannot hang: every channel is bounded by the number of micro-batches, and each
//! (sender, receiver, direction) pair carries at most one message per micro-batch per step, so a
//! send never blocks. A receive waits only for a message that an earlier instruction of the same
//! micro-batch's dependency chain sends, and the schedule validator proves every device reaches
//! that instruction. Faults close a per-step abort channel that every blocking receive selects on.
//!
//! Why results equal one device's: each layer does the same arithmetic wherever it runs, the loss
//! of every micro-batch is divided by the full batch size, and weight gradients are accumulated in
//! micro-batch order on every stage whatever order the schedule computes them in.
//!
//! Tensor parallelism: with degree `k` ([`TrainerBuilder::tensor_parallel`]) a stage holds a group
//! of `k` devices `[first..first + k)`. The runtime treats the group as one device, its first:
//! the worker thread, messages, data and unsplit layers live there. Split layers spread their
//! shards over the group and run them on their own threads inside each call; the runtime only
//! allocates each gradient on its parameter's device, reports peak memory for every device of
//! every group, and exports and imports parameters through [`crate::Layer::export_parameters`] and
//! [`crate::Layer::import_parameter`], so checkpoints carry unsplit tensors under unsplit names.
mod bubbles;
mod coordinator;
mod core_seat;
mod core_slots;
mod gradient_buckets;
mod gradient_groups;
mod measured_costs;
mod overlap;
mod ranks;
mod replica_shares;
mod stage;
mod stepping;
mod trainer;
mod transfer;
mod worker;

pub use bubbles::{BubbleGap, BubbleReport, CoresIdle, CostBasis, DevicePeak, DeviceTime, bubbles_over};
pub use gradient_buckets::{DEFAULT_BUCKET_BYTES, FIRST_BUCKET_BYTES};
pub use replica_shares::{AUTO_SHARE_STEPS, ReplicaShares};
pub use stepping::{Batch, Evaluation, FitSummary, IntoBatch, StepControl};
pub use trainer::{AUTO_SLOTS_MIN_OP_FLOPS, Trainer, TrainerBuilder};

use conveyor_schedules::OpKind;

/// Activation recomputation (torchgpipe's checkpoint modes), chosen per stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Recompute {
    /// Keep every activation a backward needs (fastest, most memory).
    #[default]
    Never,
    /// Recompute every micro-batch but the last one of the step (torchgpipe's `except_last`: the
    /// last micro-batch's backward follows its forward closely, so keeping it costs little).
    ExceptLast,
    /// Keep only each stage's inputs and recompute its forward before the backward.
    Always,
}

impl std::str::FromStr for Recompute {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "never" => Ok(Recompute::Never),
            "except-last" | "except_last" => Ok(Recompute::ExceptLast),
            "always" => Ok(Recompute::Always),
            other => Err(crate::Error::invalid("recompute", format!("`{other}`: use never, except-last or always"))),
        }
    }
}

/// Whether compute ops on CPU workers take core slots ([`TrainerBuilder::core_slots`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CoreSlotPolicy {
    /// One slot per core when the CPU workers outnumber the machine's cores (and there is no
    /// tensor parallelism), used by each step whose mean compute op reaches
    /// [`AUTO_SLOTS_MIN_OP_FLOPS`]; otherwise none.
    #[default]
    Auto,
    /// No slots: every worker computes whenever it can, and the operating system shares the cores.
    Off,
    /// This many slots (at least 1).
    Slots(usize),
}

impl std::str::FromStr for CoreSlotPolicy {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "auto" => Ok(CoreSlotPolicy::Auto),
            "off" => Ok(CoreSlotPolicy::Off),
            n => match n.parse::<usize>() {
                Ok(n) if n > 0 => Ok(CoreSlotPolicy::Slots(n)),
                _ => Err(crate::Error::invalid(
                    "core slots",
                    format!("`{s}`: use auto, off or a number of slots of at least 1"),
                )),
            },
        }
    }
}

/// Where a [`FaultInjection`] strikes: a compute op, a message, or a phase of the commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultPoint {
    /// A compute op of the schedule (Forward, BackwardInput, BackwardWeight, Backward, Recompute).
    Op(OpKind),
    /// Sending the stage's message of the micro-batch (activations forward, gradients backward).
    Send,
    /// Receiving a message for the stage's micro-batch.
    Receive,
    /// The commit's prepare phase (finiteness, optimizer state, undo snapshot), before the vote.
    Prepare,
    /// The stage's vote.
    Vote,
    /// The commit's apply phase (the optimizer update), after every stage voted ready: the step is
    /// then rolled back on every stage from its undo snapshot.
    Apply,
    /// The worker's own loop, outside any op, message or phase (only `panic: true` means anything
    /// here: the worker panics where no op catches it, as a bug in the runtime would).
    WorkerLoop,
}

impl FaultPoint {
    /// The name errors and traces give the point.
    pub fn name(self) -> &'static str {
        match self {
            FaultPoint::Op(op) => crate::trace::op_name(op),
            FaultPoint::Send => "send",
            FaultPoint::Receive => "receive",
            FaultPoint::Prepare => "prepare",
            FaultPoint::Vote => "vote",
            FaultPoint::Apply => "apply",
            FaultPoint::WorkerLoop => "worker loop",
        }
    }

    /// Whether the point concerns one micro-batch (the commit's phases concern the whole step).
    pub fn has_micro_batch(self) -> bool {
        matches!(self, FaultPoint::Op(_) | FaultPoint::Send | FaultPoint::Receive)
    }
}

/// A deliberate failure, for testing fault handling: the given point of the given stage and
/// micro-batch returns an error (or panics) instead of doing its work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultInjection {
    /// The stage that fails.
    pub stage_idx: usize,
    /// Where it fails.
    pub at: FaultPoint,
    /// The micro-batch (ignored for the commit's phases).
    pub micro_batch_idx: usize,
    /// Panic instead of returning an error.
    pub panic: bool,
}

impl FaultInjection {
    /// Whether this fault strikes `at` on `stage_idx` (and `micro_batch_idx`, where that matters).
    pub(crate) fn strikes(&self, stage_idx: usize, at: FaultPoint, micro_batch_idx: Option<usize>) -> bool {
        self.stage_idx == stage_idx
            && self.at == at
            && (!at.has_micro_batch() || micro_batch_idx == Some(self.micro_batch_idx))
    }
}

/// A deliberate pause, for testing what timing decides (how far neighbours run ahead, and so how
/// many messages wait on a device): the worker of `device_idx` gives up its core and sleeps for
/// `seconds` before the instruction at `instruction_idx` of its program, every step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StallInjection {
    /// The worker (pipeline device or tensor-parallel group).
    pub device_idx: usize,
    /// The position in that worker's program before which it pauses.
    pub instruction_idx: usize,
    /// How long it pauses.
    pub seconds: f64,
}

/// What one optimizer step reports.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// The full-batch mean loss.
    pub loss: f64,
    /// Peak bytes in use on each device during the step, device 0 first (every device of every
    /// tensor-parallel group, in [`Trainer::devices`] order).
    pub peak_memory: Vec<u64>,
    /// Peak bytes of activations (saved tensors and kept inputs) per stage during the step.
    pub peak_activation_bytes: Vec<u64>,
    /// Every op executed, with its start and end relative to the step's start.
    pub timeline: conveyor_schedules::Timeline,
    /// The ops that `timeline` leaves out, as `(row, op)` on its clock: those of data-parallel
    /// replicas other than 0, and with a rank per tensor-parallel shard those of shards other than
    /// 0. `timeline` holds replica 0's shard-0 ops, one row per pipeline device, which the bubble
    /// figures use. A row is `worker * ranks_per_worker + shard` ([`Trainer::ranks_per_worker`];
    /// worker `replica * pipeline devices + device`): the rank under MPI. Empty with one replica
    /// and no rank per shard.
    pub other_events: Vec<(usize, conveyor_schedules::TimelineEvent)>,
    /// When the step started, the zero of [`StepReport::timeline`]: seconds since the Unix epoch
    /// on rank 0's clock (under MPI, the earliest rank's start, each rank's clock shifted by the
    /// offset measured at start-up). The steps of a run lie `started_s` apart on one time line.
    pub started_s: f64,
    /// Wall time of the step, seconds.
    pub step_s: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// CPU time of every compute op on its worker thread: what the op costs with a core to
    /// itself, even when more devices than cores share the machine.
    pub op_cpu_times: Vec<OpCpuTime>,
    /// The core slots this step's compute ops shared, if any (under [`CoreSlotPolicy::Auto`],
    /// none when the ops were too small to pay for slot handoffs).
    pub core_slots: Option<usize>,
    /// With core slots: the mean time the operating system took to run a sleeping worker once a
    /// slot was handed to it (for `simulate_with_core_slots`); `None` without slots.
    pub core_wake_latency_s: Option<f64>,
    /// The loss scale this step ran with (f16 training, [`TrainerBuilder::precision`]); `None`
    /// for f32 and bf16.
    pub loss_scale: Option<f32>,
    /// True when the step was skipped, not committed: under f16 loss scaling a gradient was not
    /// finite, so no parameter changed and the scale was lowered for the next step (as
    /// `GradScaler` skips `optimizer.step()`). `grad_norm` is then infinite or NaN.
    pub skipped: bool,
    /// True when the step ran twice: with overlapped steps ([`TrainerBuilder::overlap_steps`]) it
    /// was applied before its gradient norm was known, found to clip, rolled back and run again
    /// with the barrier; this report is the second run's (the bits of a synchronous step).
    pub replayed: bool,
}

/// The CPU time one op took on its worker thread.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpCpuTime {
    /// The worker (pipeline device or tensor-parallel group).
    pub device_idx: usize,
    /// The stage (none for the optimizer step).
    pub stage_idx: Option<usize>,
    /// The op.
    pub op: OpKind,
    /// The micro-batch, when the op has one.
    pub micro_batch_idx: Option<usize>,
    /// Thread CPU seconds.
    pub cpu_s: f64,
}
