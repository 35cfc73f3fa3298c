//! Where every micro-batch of every stage is at each instruction of a schedule, and how many
//! messages can be waiting for a stage then, at worst.
//!
//! A device holds, while it runs instruction `i` of its program: the state of each micro-batch
//! its stages have started (after the forward; after the input-gradient pass; freed after the
//! weight pass, in micro-batch order as the runtime accumulates), the op's own working set, the
//! data of micro-batches it has not read yet (the runtime puts the whole batch on the data
//! stage's device when the step starts), and the messages other devices have already moved onto
//! its ledger. How many messages that can be depends on how far the others got: the most is the
//! *closure* of the device stopped at `i`, every other device running as far as the dependencies
//! (a forward needs the previous stage's forward, a backward the next stage's backward) allow,
//! and no further than the optimizer step, which waits for every device. Any real interleaving
//! gets at most that far, so the counts are upper bounds, and a slow device reaches them.
use conveyor_schedules::{Instruction, Schedule};

/// The op a stage runs at a moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Running {
    /// A forward.
    Forward,
    /// An input-gradient pass of `micro_batch_idx` (with the weight pass when `fused`).
    BackwardInput {
        /// The micro-batch (recomputed or not, by the recompute mode).
        micro_batch_idx: usize,
        /// Whether the weight pass runs in the same op (`Backward`).
        fused: bool,
    },
    /// A weight pass.
    BackwardWeight,
}

/// One stage at one instruction of its device's program.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Moment {
    /// The stage's op running now, if the instruction is one of its ops.
    pub running: Option<Running>,
    /// Micro-batches past their forward and before their input-gradient pass (not the running one).
    pub n_forward: usize,
    /// Whether the step's last micro-batch is among them (kept whole under `except-last`).
    pub forward_has_last: bool,
    /// Micro-batches past their input-gradient pass whose weight pass has not freed them.
    pub n_backward: usize,
    /// Per earlier stage `t` (index `t`): its activation messages waiting for this stage (at
    /// most as many as it sent). The earliest stage's count bounds every earlier stage's.
    pub queued_forward: Vec<usize>,
    /// Per later stage `t` (index `t - stage_idx - 1`): its gradient messages waiting. The last
    /// stage's count bounds every later stage's.
    pub queued_gradient: Vec<usize>,
    /// Micro-batches whose data has not been read yet.
    pub data_pending: usize,
    /// Graph outputs an evaluation step keeps (on the stage holding the output).
    pub outputs_held: usize,
}

/// The moments of every stage of a schedule: per stage, one per instruction of its device's
/// program before the optimizer step, aligned across the stages of a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduleMemory {
    pub(crate) n_micro_batches: usize,
    pub(crate) device_of_stage: Vec<usize>,
    pub(crate) moments: Vec<Vec<Moment>>,
}

/// Identifies an op across devices: forward or backward-input part, micro-batch, stage.
fn key(instruction: &Instruction) -> Option<(bool, usize, usize)> {
    match *instruction {
        Instruction::Forward { micro_batch_idx, stage_idx } => Some((false, micro_batch_idx, stage_idx)),
        Instruction::BackwardInput { micro_batch_idx, stage_idx }
        | Instruction::Backward { micro_batch_idx, stage_idx } => Some((true, micro_batch_idx, stage_idx)),
        _ => None,
    }
}

impl ScheduleMemory {
    /// The moments of `schedule`: for each device, one per instruction of its training program
    /// before the optimizer step, then one per forward of an evaluation step (the runtime's
    /// forward-only programs: every micro-batch through each of the device's stages in turn,
    /// nothing kept for a backward, the graph outputs kept until the step ends).
    pub fn new(schedule: &Schedule) -> Self {
        let n_stages = schedule.n_stages();
        let n_micro_batches = schedule.n_micro_batches();
        let mut moments = moments_of(schedule, schedule.programs(), false);
        let forward_only: Vec<Vec<Instruction>> = (0..schedule.n_devices())
            .map(|device| {
                let stages: Vec<usize> = schedule.stages_of_device(device).collect();
                (0..n_micro_batches)
                    .flat_map(|micro_batch_idx| {
                        stages.iter().map(move |&stage_idx| Instruction::Forward { micro_batch_idx, stage_idx })
                    })
                    .collect()
            })
            .collect();
        for (stage, eval) in moments.iter_mut().zip(moments_of(schedule, &forward_only, true)) {
            stage.extend(eval);
        }
        ScheduleMemory {
            n_micro_batches,
            device_of_stage: (0..n_stages).map(|s| schedule.device_of_stage(s)).collect(),
            moments,
        }
    }

    /// Stand-in moments for `n_stages` stages when only each stage's peak number of micro-batches
    /// in flight is known (`inflight[s]`): the forward and the backward of a micro-batch with that
    /// many others in flight, a message of each kind waiting, and the data of the rest unread.
    pub fn from_inflight(inflight: &[usize], n_micro_batches: usize) -> Self {
        let n_stages = inflight.len();
        let moments = inflight
            .iter()
            .enumerate()
            .map(|(s, &c)| {
                let c = c.max(1);
                let waiting = usize::from;
                let base = Moment {
                    n_forward: c - 1,
                    forward_has_last: true,
                    queued_forward: vec![waiting(true); s],
                    queued_gradient: vec![waiting(true); n_stages - s - 1],
                    data_pending: n_micro_batches.saturating_sub(1),
                    ..Moment::default()
                };
                vec![
                    Moment { running: Some(Running::Forward), ..base.clone() },
                    Moment {
                        running: Some(Running::BackwardInput {
                            micro_batch_idx: n_micro_batches.saturating_sub(1),
                            fused: true,
                        }),
                        ..base
                    },
                ]
            })
            .collect();
        ScheduleMemory { n_micro_batches, device_of_stage: (0..n_stages).collect(), moments }
    }

    /// The device of `stage_idx` under the schedule these moments come from.
    pub fn device_of_stage(&self, stage_idx: usize) -> usize {
        self.device_of_stage[stage_idx]
    }

    /// Stages.
    pub fn n_stages(&self) -> usize {
        self.moments.len()
    }
}

/// The moments of every stage under `programs` (the schedule's, or forward-only ones when `eval`).
fn moments_of(schedule: &Schedule, programs: &[Vec<Instruction>], eval: bool) -> Vec<Vec<Moment>> {
    let n_stages = schedule.n_stages();
    let n_micro_batches = schedule.n_micro_batches();
    let n_devices = programs.len();
    // (backward?, micro-batch, stage) -> (device, position).
    let mut at = std::collections::HashMap::new();
    for (device, program) in programs.iter().enumerate() {
        for (position, instruction) in program.iter().enumerate() {
            if let Some(k) = key(instruction) {
                at.insert(k, (device, position));
            }
        }
    }
    let done = |positions: &[usize], k: (bool, usize, usize)| at.get(&k).is_some_and(|&(d, p)| positions[d] > p);
    let mut moments = vec![Vec::new(); n_stages];
    for (device, program) in programs.iter().enumerate() {
        let end = program.iter().position(|i| matches!(i, Instruction::OptimizerStep)).unwrap_or(program.len());
        for i in 0..end {
            // The closure: every other device runs as far as it can while this one is at `i`.
            let mut positions = vec![0usize; n_devices];
            positions[device] = i;
            loop {
                let mut moved = false;
                for (other, other_program) in programs.iter().enumerate() {
                    if other == device {
                        continue;
                    }
                    while let Some(instruction) = other_program.get(positions[other]) {
                        let ready = match *instruction {
                            Instruction::Forward { micro_batch_idx, stage_idx } => {
                                stage_idx == 0 || done(&positions, (false, micro_batch_idx, stage_idx - 1))
                            }
                            Instruction::BackwardInput { micro_batch_idx, stage_idx }
                            | Instruction::Backward { micro_batch_idx, stage_idx } => {
                                stage_idx + 1 == n_stages || done(&positions, (true, micro_batch_idx, stage_idx + 1))
                            }
                            Instruction::BackwardWeight { .. } => true,
                            Instruction::OptimizerStep => false,
                        };
                        if !ready {
                            break;
                        }
                        positions[other] += 1;
                        moved = true;
                    }
                }
                if !moved {
                    break;
                }
            }
            for stage_idx in schedule.stages_of_device(device) {
                let mut moment =
                    moment(program, i, &program[i], stage_idx, n_stages, n_micro_batches, &|k| done(&positions, k));
                if eval {
                    // Nothing is kept for a backward; the outputs are kept until the step ends.
                    moment.outputs_held = moment.n_forward;
                    moment.n_forward = 0;
                    moment.forward_has_last = false;
                }
                moments[stage_idx].push(moment);
            }
        }
    }
    moments
}

/// Stage `stage_idx` while its device runs `program[i]`, with `done` telling which ops of any
/// device have finished.
fn moment(
    program: &[Instruction],
    i: usize,
    running: &Instruction,
    stage_idx: usize,
    n_stages: usize,
    n_micro_batches: usize,
    done: &dyn Fn((bool, usize, usize)) -> bool,
) -> Moment {
    let m = n_micro_batches;
    let mine = running.stage_idx() == Some(stage_idx);
    let running_mb = running.micro_batch_idx().filter(|_| mine);
    let (mut forward_done, mut backward_done, mut weight_done) = (vec![false; m], vec![false; m], vec![false; m]);
    for instruction in &program[..i] {
        if instruction.stage_idx() != Some(stage_idx) {
            continue;
        }
        let mb = instruction.micro_batch_idx().expect("stage ops have a micro-batch");
        match instruction {
            Instruction::Forward { .. } => forward_done[mb] = true,
            Instruction::BackwardInput { .. } => backward_done[mb] = true,
            Instruction::Backward { .. } => {
                backward_done[mb] = true;
                weight_done[mb] = true;
            }
            Instruction::BackwardWeight { .. } => weight_done[mb] = true,
            Instruction::OptimizerStep => {}
        }
    }
    // Weight passes free micro-batches in order (a later one waits for the earlier ones).
    let freed = weight_done.iter().take_while(|&&w| w).count();
    let running_kind = mine.then(|| match running {
        Instruction::Forward { .. } => Running::Forward,
        Instruction::BackwardInput { micro_batch_idx, .. } => {
            Running::BackwardInput { micro_batch_idx: *micro_batch_idx, fused: false }
        }
        Instruction::Backward { micro_batch_idx, .. } => {
            Running::BackwardInput { micro_batch_idx: *micro_batch_idx, fused: true }
        }
        Instruction::BackwardWeight { .. } => Running::BackwardWeight,
        Instruction::OptimizerStep => unreachable!("moments stop before the optimizer step"),
    });
    let mut moment = Moment { running: running_kind, ..Moment::default() };
    for mb in 0..m {
        if Some(mb) == running_mb {
            continue;
        }
        if forward_done[mb] && !backward_done[mb] {
            moment.n_forward += 1;
            moment.forward_has_last |= mb + 1 == m;
        } else if backward_done[mb] && mb >= freed {
            moment.n_backward += 1;
        }
    }
    let count = |backward: bool, stage: usize| (0..m).filter(|&mb| done((backward, mb, stage))).count();
    let running_forward = usize::from(matches!(moment.running, Some(Running::Forward)));
    let running_backward = usize::from(matches!(moment.running, Some(Running::BackwardInput { .. })));
    let consumed_forward = forward_done.iter().filter(|&&f| f).count() + running_forward;
    let consumed_backward = backward_done.iter().filter(|&&b| b).count() + running_backward;
    moment.queued_forward = (0..stage_idx).map(|t| count(false, t).saturating_sub(consumed_forward)).collect();
    moment.queued_gradient =
        (stage_idx + 1..n_stages).map(|t| count(true, t).saturating_sub(consumed_backward)).collect();
    moment.data_pending = m.saturating_sub(consumed_forward);
    moment
}

#[cfg(test)]
mod tests {
    use super::*;
    use conveyor_schedules::ScheduleKind;

    /// 1F1B on 2 stages, 4 micro-batches: stage 1 runs F0 B0 F1 B1 ...; while it runs its first
    /// forward, stage 0 can have sent its two warm-up forwards (it then waits for B0), so one
    /// more activation is waiting.
    #[test]
    fn one_f_one_b_last_stage_has_one_activation_waiting() {
        let schedule = Schedule::new(ScheduleKind::OneFOneB, 2, 4, 1).unwrap();
        let memory = ScheduleMemory::new(&schedule);
        let first = &memory.moments[1][0];
        assert_eq!(first.running, Some(Running::Forward));
        assert_eq!(first.queued_forward, vec![1]);
        assert_eq!(first.n_forward, 0);
        // Stage 0 before anything: every micro-batch's data is there.
        assert_eq!(memory.moments[0][0].data_pending, 3);
        let peak_inflight = memory.moments[0].iter().map(|m| m.n_forward + 1).max().unwrap();
        assert_eq!(peak_inflight, 2);
    }
}
