//! The schedules crate's error type: one structured enum; each variant says what was wrong,
//! where (device, instruction) and what would fix it.
use std::fmt;

use crate::instruction::{Instruction, Message};
use crate::kind::ScheduleKind;

/// Everything that can go wrong while building, validating or simulating a schedule.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleError {
    /// A count that must be at least one was zero.
    #[error("{parameter} must be at least 1, got 0; a pipeline needs at least one {noun}")]
    ZeroParameter {
        /// The parameter, e.g. `n_devices`.
        parameter: &'static str,
        /// What the parameter counts, e.g. `device`.
        noun: &'static str,
    },
    /// More than one chunk per device was asked of a schedule that places one stage per device.
    #[error(
        "{kind} places exactly one stage per device, but n_chunks = {n_chunks} was given; \
         use the interleaved schedule for several chunks per device, or set n_chunks to 1"
    )]
    ChunksUnsupported {
        /// The schedule asked for.
        kind: ScheduleKind,
        /// The number of chunks given.
        n_chunks: usize,
    },
    /// The interleaved schedule with several chunks groups micro-batches by `n_devices`.
    #[error(
        "interleaved with n_chunks = {n_chunks} needs n_micro_batches to be a multiple of n_devices \
         (Megatron's rule: micro-batches enter in groups of n_devices), got {n_micro_batches} micro-batches \
         on {n_devices} devices; use {suggested} micro-batches or n_chunks = 1"
    )]
    MicroBatchesNotMultipleOfDevices {
        /// Micro-batches given.
        n_micro_batches: usize,
        /// Devices given.
        n_devices: usize,
        /// Chunks given.
        n_chunks: usize,
        /// The nearest valid micro-batch count at or above the one given.
        suggested: usize,
    },
    /// A V-shaped schedule was asked for a chunk count other than the two chunks of its V.
    #[error(
        "{kind} places exactly {required} chunks per device (in a V: device 0 holds the first and the last \
         stage), but n_chunks = {n_chunks} was given; give n_chunks = {required}"
    )]
    ChunksRequired {
        /// The schedule asked for.
        kind: ScheduleKind,
        /// The chunks it needs.
        required: usize,
        /// The number of chunks given.
        n_chunks: usize,
    },
    /// DualPipe-V runs its steady step only with at least two micro-batches per device.
    #[error(
        "{kind} needs at least {minimum} micro-batches on {n_devices} devices (2 per device, DualPipe's rule: \
         the V fills with 2p forwards before the first backward returns), got {n_micro_batches}; use {minimum} \
         or more micro-batches, or zb-v"
    )]
    TooFewMicroBatches {
        /// The schedule asked for.
        kind: ScheduleKind,
        /// Micro-batches given.
        n_micro_batches: usize,
        /// Devices given.
        n_devices: usize,
        /// The fewest micro-batches the schedule runs with.
        minimum: usize,
    },
    /// A schedule name that is not one of the known ones.
    #[error("unknown schedule {name:?}; expected one of {}", ScheduleKind::names())]
    UnknownScheduleKind {
        /// The name given.
        name: String,
    },
    /// The schedule has a different number of programs than devices.
    #[error("the schedule has {got} device programs but n_devices = {expected}; give one program per device")]
    WrongProgramCount {
        /// `n_devices`.
        expected: usize,
        /// Programs present.
        got: usize,
    },
    /// An instruction names a stage or micro-batch outside the schedule.
    #[error(
        "device {device_idx}, instruction {instruction_idx} ({instruction}) is out of range: the schedule has \
         {n_stages} stages and {n_micro_batches} micro-batches"
    )]
    OutOfRange {
        /// Device whose program holds the instruction.
        device_idx: usize,
        /// Position in that program.
        instruction_idx: usize,
        /// The instruction.
        instruction: Instruction,
        /// Stages in the schedule.
        n_stages: usize,
        /// Micro-batches in the schedule.
        n_micro_batches: usize,
    },
    /// An instruction sits on a device that does not hold its stage.
    #[error(
        "device {device_idx}, instruction {instruction_idx} ({instruction}) belongs on device {expected_device_idx}, \
         which holds stage {stage_idx}; move it to that device's program"
    )]
    WrongDevice {
        /// Device whose program holds the instruction.
        device_idx: usize,
        /// Position in that program.
        instruction_idx: usize,
        /// The instruction.
        instruction: Instruction,
        /// The instruction's stage.
        stage_idx: usize,
        /// The device that holds the stage.
        expected_device_idx: usize,
    },
    /// The same instruction appears twice.
    #[error(
        "device {device_idx}, instruction {instruction_idx} ({instruction}) duplicates instruction \
         {first_instruction_idx} of the same device; every op runs exactly once"
    )]
    Duplicate {
        /// Device whose program holds the duplicate.
        device_idx: usize,
        /// Position of the duplicate.
        instruction_idx: usize,
        /// The instruction.
        instruction: Instruction,
        /// Position of the first occurrence.
        first_instruction_idx: usize,
    },
    /// An op that every (micro-batch, stage) needs is absent.
    #[error("device {device_idx} never runs {instruction}; add it to that device's program")]
    Missing {
        /// The device that should run it.
        device_idx: usize,
        /// The missing instruction.
        instruction: Instruction,
    },
    /// A (micro-batch, stage) has both a fused backward and a split one.
    #[error(
        "device {device_idx}, instruction {instruction_idx} ({instruction}) mixes a fused backward with a split \
         one for the same micro-batch and stage; use either Backward, or BackwardInput then BackwardWeight"
    )]
    MixedBackward {
        /// Device whose program holds the instruction.
        device_idx: usize,
        /// Position in that program.
        instruction_idx: usize,
        /// The instruction.
        instruction: Instruction,
    },
    /// The optimizer step is missing, duplicated or not the last instruction of a device.
    #[error(
        "device {device_idx}: the optimizer step must be the last instruction and appear exactly once, \
         found it at {positions:?} in a program of {program_len} instructions"
    )]
    OptimizerStepPlacement {
        /// The device.
        device_idx: usize,
        /// Positions where an optimizer step was found.
        positions: Vec<usize>,
        /// Length of the device's program.
        program_len: usize,
    },
    /// An instruction would run before an op it depends on.
    #[error(
        "device {device_idx}, instruction {instruction_idx} ({instruction}) runs before {requires}, which it \
         depends on; reorder the programs so that {requires} comes first"
    )]
    DependencyViolated {
        /// Device whose program holds the instruction.
        device_idx: usize,
        /// Position in that program.
        instruction_idx: usize,
        /// The instruction.
        instruction: Instruction,
        /// The op that has not completed yet.
        requires: Instruction,
    },
    /// A receive found a different micro-batch at the head of its FIFO channel.
    #[error(
        "device {device_idx}, instruction {instruction_idx} ({instruction}) expects {expected} but the channel \
         delivers {got} first; the sender and receiver must walk micro-batches in the same order"
    )]
    MessageOutOfOrder {
        /// Receiving device.
        device_idx: usize,
        /// Position in its program.
        instruction_idx: usize,
        /// The receiving instruction.
        instruction: Instruction,
        /// The message the instruction needs.
        expected: Message,
        /// The message at the head of the channel.
        got: Message,
    },
    /// No device can make progress: every unfinished device waits on a channel.
    #[error("deadlock with channel capacity {channel_capacity}: {}", BlockedList(blocked))]
    Deadlock {
        /// The capacity the programs were executed with.
        channel_capacity: usize,
        /// Every device that has not finished, with what it waits on.
        blocked: Vec<BlockedDevice>,
    },
    /// A cost, latency or bandwidth that is negative, not finite, or (bandwidth) zero.
    #[error("invalid {what}: {value}; costs and latencies must be finite and >= 0, bandwidth must be > 0")]
    InvalidCost {
        /// Which quantity, e.g. `forward_s of stage 2`.
        what: String,
        /// The value given.
        value: f64,
    },
    /// A per-stage cost list whose length is neither 1 nor the number of stages.
    #[error("{what} lists {got} stages but the schedule has {n_stages}; give one entry, or one per stage")]
    PerStageLength {
        /// Which list.
        what: &'static str,
        /// Entries given.
        got: usize,
        /// Stages in the schedule.
        n_stages: usize,
    },
}

/// A device that cannot proceed, as reported in [`ScheduleError::Deadlock`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockedDevice {
    /// The stuck device.
    pub device_idx: usize,
    /// Position of the stuck instruction in its program.
    pub instruction_idx: usize,
    /// The stuck instruction.
    pub instruction: Instruction,
    /// What it waits for.
    pub waiting_on: Wait,
}

/// What a blocked device waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// A receive on an empty channel.
    Receive(Message),
    /// A send on a full channel (or, with capacity 0, a send nobody has picked up).
    Send(Message),
}

struct BlockedList<'a>(&'a [BlockedDevice]);

impl fmt::Display for BlockedList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, blocked) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            let (verb, message) = match blocked.waiting_on {
                Wait::Receive(message) => ("receive", message),
                Wait::Send(message) => ("send", message),
            };
            write!(
                f,
                "device {} is stuck on instruction {} ({}) waiting to {verb} {message}",
                blocked.device_idx, blocked.instruction_idx, blocked.instruction
            )?;
        }
        f.write_str(
            "; reorder the programs so that every send is matched by a receive the peer reaches, \
             or raise the channel capacity",
        )
    }
}
