//! The simulator: times a schedule under a [`CostModel`] and reports its timeline and figures.
//!
//! Model: each device runs its program in order; an op starts when the device is free and its
//! input message (by the communication rule of [`crate::instruction`]) has arrived; a message
//! sent by an op ending at `t` arrives at `t + latency + bytes / bandwidth` (at `t` between
//! stages on one device). Sends never block here — channel capacity is the validator's concern.
//! Every start time is therefore `max(device free, input arrival)`, fixed once the sender's op
//! is timed, so the simulation times ops in dependency order in one pass over the programs: a
//! discrete-event simulation with one event per op, without an event queue. The optimizer steps
//! wait for the commit, as in the runtime: every device done with its other ops, plus the cost
//! model's commit latency for that device. (`crate::steps` runs the same loop with the optimizer
//! steps not waiting for it, for overlapped steps.)
use std::collections::HashMap;

use serde::Serialize;

use crate::cost::CostModel;
use crate::error::{BlockedDevice, ScheduleError, Wait};
use crate::instruction::{Instruction, Message};
use crate::schedule::Schedule;
use crate::timeline::{OpKind, Timeline, TimelineEvent};

/// A simulated timeline with the figures derived from it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimulationReport {
    /// First compute start to last compute end, seconds.
    pub makespan_s: f64,
    /// Idle over `n_devices * makespan`, compute ops counting as busy.
    pub bubble_fraction: f64,
    /// Idle inside each device's own busy span; see [`Timeline::interior_bubble_fraction`].
    pub interior_bubble_fraction: f64,
    /// Compute seconds per device, device 0 first.
    pub busy_s: Vec<f64>,
    /// Peak in-flight micro-batches per stage, stage 0 first.
    pub peak_inflight: Vec<usize>,
    /// Peak in-flight (micro-batch, stage) activation sets per device, device 0 first.
    pub peak_inflight_per_device: Vec<usize>,
    /// Every event.
    pub timeline: Timeline,
}

impl SimulationReport {
    /// Derives the figures from a timeline (simulated or measured).
    pub fn from_timeline(timeline: Timeline) -> SimulationReport {
        SimulationReport {
            makespan_s: timeline.makespan_s(),
            bubble_fraction: timeline.bubble_fraction(),
            interior_bubble_fraction: timeline.interior_bubble_fraction(),
            busy_s: timeline.busy_s(),
            peak_inflight: timeline.peak_inflight(),
            peak_inflight_per_device: timeline.peak_inflight_per_device(),
            timeline,
        }
    }
}

/// Simulates `schedule` under `costs`.
///
/// The timeline holds one event per instruction, a `Wait` event for each interval a device
/// idles before an op whose input has not arrived, and a `Send` event (on the sender) for each
/// message whose transfer takes time. Errors: an unusable cost model; programs that cannot
/// finish (a receive nobody sends), reported as [`ScheduleError::Deadlock`] with capacity
/// `usize::MAX`.
pub fn simulate(schedule: &Schedule, costs: &CostModel) -> Result<SimulationReport, ScheduleError> {
    let step = simulate_step(schedule, costs, OptimizerWait::Commit)?;
    Ok(SimulationReport::from_timeline(step.timeline))
}

/// What each device's optimizer step waits for, besides its device and its all-reduce.
#[derive(Debug, Clone, Copy)]
pub(crate) enum OptimizerWait<'a> {
    /// This step's commit: every device has voted, plus the device's commit latency
    /// (synchronous steps).
    Commit,
    /// Nothing of this step: each device applies once it has voted, not before its entry here
    /// (an overlapped step: the previous step's verdict reaching the device; past the list, 0).
    NotBefore(&'a [f64]),
}

/// One simulated step: its timeline, and when its commit could be sent (every device voted).
#[derive(Debug, Clone)]
pub(crate) struct SimulatedStep {
    /// Every event, at absolute times (devices start at [`CostModel::device_start_s`]).
    pub timeline: Timeline,
    /// When the last device voted: reached its optimizer step with its all-reduce done.
    pub commit_s: f64,
}

/// The simulation loop behind [`simulate`], with the optimizer steps waiting as `wait` says.
pub(crate) fn simulate_step(
    schedule: &Schedule,
    costs: &CostModel,
    wait: OptimizerWait<'_>,
) -> Result<SimulatedStep, ScheduleError> {
    let n_stages = schedule.n_stages();
    costs.check(n_stages)?;
    let programs = schedule.programs();
    let mut timeline = Timeline::new(schedule.n_devices(), n_stages);
    let mut arrivals: HashMap<Message, f64> = HashMap::new();
    let mut positions = vec![0usize; programs.len()];
    let mut free_at: Vec<f64> = (0..programs.len()).map(|d| costs.device_start_s(d)).collect();
    // The optimizer steps wait for the commit: every device done with its other ops.
    let mut commit_at: Option<f64> = None;
    // Whether each device has run its gradient all-reduce (data parallelism), which it does on
    // reaching its optimizer step, before the commit.
    let mut all_reduced = vec![false; programs.len()];
    // With buckets, each device's all-reduce starts with its final weight pass.
    let mut final_weight_start: Vec<Option<f64>> = vec![None; programs.len()];
    // When each device voted: reached its optimizer step, all-reduce done.
    let mut voted_at = vec![0.0f64; programs.len()];
    let last_micro_batch = schedule.n_micro_batches().checked_sub(1);
    loop {
        let mut progressed = false;
        if matches!(wait, OptimizerWait::Commit)
            && commit_at.is_none()
            && programs.iter().zip(&positions).zip(&all_reduced).all(|((program, &position), &reduced)| {
                program.get(position).is_none_or(|instruction| *instruction == Instruction::OptimizerStep && reduced)
            })
        {
            commit_at = Some(free_at.iter().copied().fold(0.0, f64::max));
        }
        for (device_idx, program) in programs.iter().enumerate() {
            while let Some(&instruction) = program.get(positions[device_idx]) {
                if instruction == Instruction::OptimizerStep && !all_reduced[device_idx] {
                    all_reduced[device_idx] = true;
                    progressed = true;
                    let seconds = costs.device_all_reduce_s(device_idx);
                    if seconds > 0.0 {
                        let start_s = match final_weight_start[device_idx] {
                            Some(start_s) if costs.all_reduce_in_buckets() => start_s,
                            _ => free_at[device_idx],
                        };
                        timeline.events.push(instruction_event(
                            device_idx,
                            instruction,
                            OpKind::AllReduce,
                            start_s,
                            start_s + seconds,
                        ));
                        free_at[device_idx] = free_at[device_idx].max(start_s + seconds);
                    }
                }
                if instruction == Instruction::OptimizerStep {
                    voted_at[device_idx] = free_at[device_idx];
                }
                let ready_at = match instruction.recv_from(n_stages) {
                    None if instruction == Instruction::OptimizerStep => match (wait, commit_at) {
                        (OptimizerWait::NotBefore(not_before), _) => not_before.get(device_idx).copied().unwrap_or(0.0),
                        (OptimizerWait::Commit, Some(commit_s)) => commit_s + costs.device_commit_latency_s(device_idx),
                        (OptimizerWait::Commit, None) => break,
                    },
                    Some(message) => match arrivals.remove(&message) {
                        Some(arrival) => arrival,
                        None => break,
                    },
                    None => 0.0,
                };
                let start_s = free_at[device_idx].max(ready_at);
                // The wait for the commit is not a wait for input: no `Wait` event for it.
                if start_s > free_at[device_idx] && instruction != Instruction::OptimizerStep {
                    timeline.events.push(instruction_event(
                        device_idx,
                        instruction,
                        OpKind::Wait,
                        free_at[device_idx],
                        start_s,
                    ));
                }
                if matches!(instruction.op_kind(), OpKind::Backward | OpKind::BackwardWeight)
                    && instruction.micro_batch_idx() == last_micro_batch
                {
                    final_weight_start[device_idx] = Some(start_s);
                }
                let end_s = start_s + op_cost(costs, device_idx, instruction);
                timeline.events.push(instruction_event(
                    device_idx,
                    instruction,
                    instruction.op_kind(),
                    start_s,
                    busy_end_s(costs, instruction, start_s, end_s),
                ));
                if let Some(message) = instruction.send_to(n_stages) {
                    let arrival = end_s + transfer_s(schedule, costs, message);
                    if arrival > end_s {
                        timeline.events.push(TimelineEvent {
                            device_idx,
                            stage_idx: Some(message.from_stage_idx),
                            op: OpKind::Send,
                            micro_batch_idx: Some(message.micro_batch_idx),
                            start_s: end_s,
                            end_s: arrival,
                        });
                    }
                    arrivals.insert(message, arrival);
                }
                free_at[device_idx] = end_s;
                positions[device_idx] += 1;
                progressed = true;
            }
        }
        if positions.iter().zip(programs).all(|(&position, program)| position == program.len()) {
            let commit_s = match wait {
                OptimizerWait::Commit => commit_at,
                OptimizerWait::NotBefore(_) => None,
            }
            .unwrap_or_else(|| voted_at.iter().copied().fold(0.0, f64::max));
            return Ok(SimulatedStep { timeline, commit_s });
        }
        if !progressed {
            let blocked = programs
                .iter()
                .enumerate()
                .filter_map(|(device_idx, program)| {
                    let instruction_idx = positions[device_idx];
                    let instruction = *program.get(instruction_idx)?;
                    let message = instruction.recv_from(n_stages)?;
                    Some(BlockedDevice { device_idx, instruction_idx, instruction, waiting_on: Wait::Receive(message) })
                })
                .collect();
            return Err(ScheduleError::Deadlock { channel_capacity: usize::MAX, blocked });
        }
    }
}

pub(crate) fn op_cost(costs: &CostModel, device_idx: usize, instruction: Instruction) -> f64 {
    let Some(stage_idx) = instruction.stage_idx() else {
        return costs.device_optimizer_step_s(device_idx);
    };
    if let Some(micro_batch_idx) = instruction.micro_batch_idx()
        && let Some(seconds) = costs.op_cost((stage_idx, instruction.op_kind(), micro_batch_idx))
    {
        return seconds;
    }
    let stage = costs.stage_costs(stage_idx);
    match instruction {
        Instruction::Forward { .. } => stage.forward_s,
        Instruction::BackwardInput { .. } => stage.backward_input_s,
        Instruction::BackwardWeight { .. } => stage.backward_weight_s,
        Instruction::Backward { .. } => stage.backward_s(),
        Instruction::OptimizerStep => costs.device_optimizer_step_s(device_idx),
    }
}

/// The timeline event of `op` (the instruction itself, or a wait before it) on `device_idx`,
/// with the instruction's stage and micro-batch.
pub(crate) fn instruction_event(
    device_idx: usize,
    instruction: Instruction,
    op: OpKind,
    start_s: f64,
    end_s: f64,
) -> TimelineEvent {
    TimelineEvent {
        device_idx,
        stage_idx: instruction.stage_idx(),
        op,
        micro_batch_idx: instruction.micro_batch_idx(),
        start_s,
        end_s,
    }
}

/// When `instruction`'s compute ends, for an op occupying its device over `[start_s, end_s]`: the
/// end less the op's overhead ([`CostModel::with_op_overheads`]), never before the start.
pub(crate) fn busy_end_s(costs: &CostModel, instruction: Instruction, start_s: f64, end_s: f64) -> f64 {
    let (Some(stage_idx), Some(micro_batch_idx)) = (instruction.stage_idx(), instruction.micro_batch_idx()) else {
        return end_s;
    };
    (end_s - costs.op_overhead_s((stage_idx, instruction.op_kind(), micro_batch_idx))).max(start_s)
}

pub(crate) fn transfer_s(schedule: &Schedule, costs: &CostModel, message: Message) -> f64 {
    if schedule.device_of_stage(message.from_stage_idx) == schedule.device_of_stage(message.to_stage_idx) {
        return 0.0;
    }
    let bytes = costs.message_bytes(message.from_stage_idx);
    let n_bytes = match message.direction {
        crate::instruction::Direction::Activation => bytes.activation_bytes,
        crate::instruction::Direction::Gradient => bytes.gradient_bytes,
    };
    costs.link().transfer_s(n_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{Link, MessageBytes, StageCosts};
    use crate::kind::ScheduleKind;

    #[test]
    fn link_costs_delay_the_receiver() {
        let schedule = Schedule::new(ScheduleKind::GPipe, 2, 1, 1).unwrap();
        let costs = CostModel::uniform(StageCosts::UNIT)
            .with_link(Link { latency_s: 0.5, bandwidth_bytes_per_s: 100.0 })
            .with_message_bytes(MessageBytes { activation_bytes: 50, gradient_bytes: 150 });
        let report = simulate(&schedule, &costs).unwrap();
        // F0 on stage 0: [0, 1]; transfer 0.5 + 0.5; F0 on stage 1: [2, 3]; B: [3, 5];
        // gradient transfer 0.5 + 1.5; B on stage 0: [7, 9].
        assert_eq!(report.makespan_s, 9.0);
        let sends: Vec<_> = report.timeline.events.iter().filter(|e| e.op == OpKind::Send).collect();
        assert_eq!(sends.len(), 2);
    }

    #[test]
    fn op_costs_override_stage_costs() {
        use crate::timeline::OpKind;
        // GPipe, 2 stages, 1 micro-batch, F = B = 1 except stage 1's forward, measured at 3.
        let schedule = Schedule::new(ScheduleKind::GPipe, 2, 1, 1).unwrap();
        let costs = CostModel::uniform(StageCosts::new(1.0, 0.5, 0.5)).with_op_costs([((1, OpKind::Forward, 0), 3.0)]);
        assert_eq!(costs.op_cost((1, OpKind::Forward, 0)), Some(3.0));
        assert_eq!(costs.op_cost((0, OpKind::Forward, 0)), None);
        // F0 on stage 0 [0,1], F0 on stage 1 [1,4], B on stage 1 [4,5], B on stage 0 [5,6].
        assert_eq!(simulate(&schedule, &costs).unwrap().makespan_s, 6.0);
        let negative = CostModel::default().with_op_costs([((0, OpKind::Forward, 0), -1.0)]);
        assert!(matches!(simulate(&schedule, &negative), Err(ScheduleError::InvalidCost { .. })));
    }

    /// `op`'s events as `(device, start, end)`, device 0 first.
    fn spans_of(report: &SimulationReport, op: OpKind) -> Vec<(usize, f64, f64)> {
        let mut events: Vec<_> =
            report.timeline.events.iter().filter(|e| e.op == op).map(|e| (e.device_idx, e.start_s, e.end_s)).collect();
        events.sort_by_key(|e| e.0);
        events
    }

    #[test]
    fn bucketed_all_reduces_start_with_the_final_weight_pass() {
        // As below, with buckets: device 1's fused backward of the last micro-batch runs [2, 3],
        // device 0's [3, 4]; their all-reduces start with them ([2, 4] and [3, 3.5]), the commit
        // waits for both, at 4; the steps take 1.
        let schedule = Schedule::new(ScheduleKind::GPipe, 2, 1, 1).unwrap();
        let costs = CostModel::uniform(StageCosts::new(1.0, 0.5, 0.5))
            .with_optimizer_step_s(1.0)
            .with_device_all_reduce_s(vec![0.5, 2.0])
            .with_all_reduce_in_buckets(true);
        let report = simulate(&schedule, &costs).unwrap();
        assert_eq!(spans_of(&report, OpKind::AllReduce), vec![(0, 3.0, 3.5), (1, 2.0, 4.0)]);
        assert_eq!(report.makespan_s, 5.0);
    }

    #[test]
    fn gradient_all_reduces_run_before_the_commit() {
        // GPipe, 2 stages, 1 micro-batch, F = B = 1: device 1 is done at 3, device 0 at 4. Each
        // all-reduces its gradients on reaching the optimizer step (device 1: [3, 5]; device 0:
        // [4, 4.5]); the commit waits for both, at 5; the steps take 1.
        let schedule = Schedule::new(ScheduleKind::GPipe, 2, 1, 1).unwrap();
        let costs = CostModel::uniform(StageCosts::new(1.0, 0.5, 0.5))
            .with_optimizer_step_s(1.0)
            .with_device_all_reduce_s(vec![0.5, 2.0]);
        assert_eq!(costs.device_all_reduce_s(5), 0.0, "devices past the list have none");
        let report = simulate(&schedule, &costs).unwrap();
        let of = |op: OpKind| spans_of(&report, op);
        assert_eq!(of(OpKind::AllReduce), vec![(0, 4.0, 4.5), (1, 3.0, 5.0)]);
        assert_eq!(of(OpKind::OptimizerStep), vec![(0, 5.0, 6.0), (1, 5.0, 6.0)]);
        assert_eq!(report.makespan_s, 6.0);
        // Communication is not busy time: the all-reduce adds to the bubble.
        let without = simulate(&schedule, &costs.clone().with_device_all_reduce_s(vec![])).unwrap();
        assert_eq!(without.makespan_s, 5.0);
        assert!(report.bubble_fraction > without.bubble_fraction);
        let negative = CostModel::default().with_device_all_reduce_s(vec![-1.0]);
        assert!(matches!(simulate(&schedule, &negative), Err(ScheduleError::InvalidCost { .. })));
    }

    #[test]
    fn optimizer_steps_wait_for_the_commit() {
        // GPipe, 2 stages, 1 micro-batch, F = B = 1: F0 on stage 0 [0,1], on stage 1 [1,2], B on
        // stage 1 [2,3], on stage 0 [3,4]. Device 1 is done at 3 but its optimizer step waits for
        // the commit at 4 + 0.5; the steps take 2 and 1.
        let schedule = Schedule::new(ScheduleKind::GPipe, 2, 1, 1).unwrap();
        let costs = CostModel::uniform(StageCosts::new(1.0, 0.5, 0.5))
            .with_optimizer_step_s(9.0)
            .with_device_optimizer_step_s(vec![2.0, 1.0])
            .with_commit_latency_s(0.5);
        for report in
            [simulate(&schedule, &costs).unwrap(), crate::simulate_with_core_slots(&schedule, &costs, 2, 0.0).unwrap()]
        {
            let steps: Vec<(usize, f64, f64)> = report
                .timeline
                .events
                .iter()
                .filter(|e| e.op == OpKind::OptimizerStep)
                .map(|e| (e.device_idx, e.start_s, e.end_s))
                .collect();
            assert!(steps.contains(&(0, 4.5, 6.5)) && steps.contains(&(1, 4.5, 5.5)), "{steps:?}");
            assert_eq!(report.makespan_s, 6.5);
        }
        // The commit reaches device 1 a second later than device 0.
        let late = costs.clone().with_device_commit_latency_s(vec![0.5, 1.5]);
        for report in
            [simulate(&schedule, &late).unwrap(), crate::simulate_with_core_slots(&schedule, &late, 2, 0.0).unwrap()]
        {
            let device_1 =
                report.timeline.events.iter().find(|e| e.device_idx == 1 && e.op == OpKind::OptimizerStep).unwrap();
            assert_eq!((device_1.start_s, device_1.end_s), (5.5, 6.5));
        }
        let negative = CostModel::default().with_commit_latency_s(-1.0);
        assert!(matches!(simulate(&schedule, &negative), Err(ScheduleError::InvalidCost { .. })));
    }

    #[test]
    fn op_overheads_occupy_the_device_without_counting_as_busy() {
        // Stage 0's forward occupies device 0 for 2 but computes for 1: busy [0,1], its message
        // leaves at 2. Then F0 on stage 1 [2,3], B on stage 1 [3,4], B on stage 0 [4,5].
        let schedule = Schedule::new(ScheduleKind::GPipe, 2, 1, 1).unwrap();
        let key = (0, OpKind::Forward, 0);
        let costs = CostModel::uniform(StageCosts::new(1.0, 0.5, 0.5))
            .with_op_costs([(key, 2.0)])
            .with_op_overheads([(key, 1.0)]);
        for report in
            [simulate(&schedule, &costs).unwrap(), crate::simulate_with_core_slots(&schedule, &costs, 2, 0.0).unwrap()]
        {
            assert_eq!(report.makespan_s, 5.0);
            assert_eq!(report.busy_s, vec![2.0, 2.0]);
            let forward = report.timeline.events.iter().find(|e| e.device_idx == 0 && e.op == OpKind::Forward).unwrap();
            assert_eq!((forward.start_s, forward.end_s), (0.0, 1.0));
        }
    }

    #[test]
    fn rejects_bad_costs() {
        let schedule = Schedule::new(ScheduleKind::GPipe, 2, 1, 1).unwrap();
        let negative = CostModel::uniform(StageCosts::new(-1.0, 1.0, 1.0));
        assert!(matches!(simulate(&schedule, &negative), Err(ScheduleError::InvalidCost { .. })));
        let three = CostModel::per_stage(vec![StageCosts::UNIT; 3]);
        assert!(matches!(simulate(&schedule, &three), Err(ScheduleError::PerStageLength { got: 3, .. })));
    }
}
