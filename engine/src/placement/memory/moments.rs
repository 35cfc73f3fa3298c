//! Where every micro-batch of every stage is at each instruction of a schedule, and how many
//! messages can be waiting for a stage then, at worst.
//!
//! A device holds, while it runs instruction `i` of its program: the state of each micro-batch
//! its stages have started (after the forward; after the input-gradient pass; freed after the
//! weight pass, in micro-batch order as the runtime accumulates), the op's own working set (a
//! forward's includes its micro-batch's data, which the worker moves onto the device when the
//! forward begins), and the messages other devices have already moved onto its ledger. How many messages that can be depends on how far the others got: the most is the
//! *closure* of the device stopped at `i`, every other device running as far as the dependencies
//! (a forward needs the previous stage's forward, a backward the next stage's backward) allow,
//! and no further than the optimizer step, which waits for every device. Any real interleaving
//! gets at most that far, so the counts are upper bounds, and a slow device reaches them.
//!
//! The closure only grows as the device moves on (a dependency met stays met), so the walk keeps
//! it from one instruction to the next, and each stage's counts, instead of recomputing them:
//! linear in the programs' length (`conveyor plan` with thousands of micro-batches), where the
//! first version, kept in the tests as the oracle, was quadratic.
use conveyor_schedules::{Instruction, Schedule};

/// The op a stage runs at a moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Running {
    /// A forward.
    Forward,
    /// A forward of an evaluation step: no loss, so an output layer that computes its own loss
    /// in training ([`crate::Layer::forward_cross_entropy`]) runs its plain forward.
    Evaluate,
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

impl Running {
    /// The op `instruction` runs (one before the optimizer step).
    fn of(instruction: &Instruction) -> Running {
        match *instruction {
            Instruction::Forward { .. } => Running::Forward,
            Instruction::BackwardInput { micro_batch_idx, .. } => {
                Running::BackwardInput { micro_batch_idx, fused: false }
            }
            Instruction::Backward { micro_batch_idx, .. } => Running::BackwardInput { micro_batch_idx, fused: true },
            Instruction::BackwardWeight { .. } => Running::BackwardWeight,
            Instruction::OptimizerStep => unreachable!("moments stop before the optimizer step"),
        }
    }
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
    /// many others in flight, and a message of each kind waiting.
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
    let ops = OpPositions::new(programs, n_stages, n_micro_batches);
    let mut moments = vec![Vec::new(); n_stages];
    for (device, program) in programs.iter().enumerate() {
        let end = program.iter().position(|i| matches!(i, Instruction::OptimizerStep)).unwrap_or(program.len());
        let mut closure = Closure::new(programs.len(), n_stages);
        let mut books: Vec<StageBooks> = (0..n_stages).map(|_| StageBooks::new(n_micro_batches)).collect();
        for (i, running) in program.iter().enumerate().take(end) {
            closure.stop_at(device, i, programs, &ops);
            for stage_idx in schedule.stages_of_device(device) {
                let mut moment = books[stage_idx].moment(running, stage_idx, &closure.done);
                if eval {
                    // Nothing is kept for a backward; the outputs are kept until the step ends.
                    moment.running = moment.running.map(|_| Running::Evaluate);
                    moment.outputs_held = moment.n_forward;
                    moment.n_forward = 0;
                    moment.forward_has_last = false;
                }
                moments[stage_idx].push(moment);
            }
            if let Some(stage_idx) = running.stage_idx() {
                books[stage_idx].record(running);
            }
        }
    }
    moments
}

/// Where each op (forward or input-gradient part, micro-batch, stage) sits: `(device, position)`.
struct OpPositions {
    n_stages: usize,
    n_micro_batches: usize,
    at: Vec<Option<(usize, usize)>>,
}

impl OpPositions {
    fn new(programs: &[Vec<Instruction>], n_stages: usize, n_micro_batches: usize) -> Self {
        let mut ops = OpPositions { n_stages, n_micro_batches, at: vec![None; 2 * n_micro_batches * n_stages] };
        for (device, program) in programs.iter().enumerate() {
            for (position, instruction) in program.iter().enumerate() {
                if let Some(k) = key(instruction)
                    && let Some(slot) = ops.slot(k)
                {
                    ops.at[slot] = Some((device, position));
                }
            }
        }
        ops
    }

    fn slot(&self, (backward, micro_batch_idx, stage_idx): (bool, usize, usize)) -> Option<usize> {
        (micro_batch_idx < self.n_micro_batches && stage_idx < self.n_stages)
            .then(|| (usize::from(backward) * self.n_micro_batches + micro_batch_idx) * self.n_stages + stage_idx)
    }

    /// Whether op `k` has finished when each device is at `positions`.
    fn done(&self, positions: &[usize], k: (bool, usize, usize)) -> bool {
        self.slot(k).and_then(|slot| self.at[slot]).is_some_and(|(d, p)| positions[d] > p)
    }
}

/// One device stopped at an instruction, every other device as far as the dependencies allow, and
/// how many forwards and input-gradient passes of each stage have finished then.
struct Closure {
    positions: Vec<usize>,
    /// `done[backward][stage]`: finished forwards (`false`) or input-gradient passes (`true`).
    done: [Vec<usize>; 2],
}

impl Closure {
    fn new(n_devices: usize, n_stages: usize) -> Self {
        Closure { positions: vec![0; n_devices], done: [vec![0; n_stages], vec![0; n_stages]] }
    }

    /// Moves past `instruction` on `device`, counting it.
    fn pass(&mut self, device: usize, instruction: &Instruction) {
        if let Some((backward, _, stage_idx)) = key(instruction) {
            self.done[usize::from(backward)][stage_idx] += 1;
        }
        self.positions[device] += 1;
    }

    /// The closure of `device` stopped at `i`, from the closure at an earlier instruction of the
    /// same device: both only move forward.
    fn stop_at(&mut self, device: usize, i: usize, programs: &[Vec<Instruction>], ops: &OpPositions) {
        let n_stages = self.done[0].len();
        while self.positions[device] < i {
            self.pass(device, &programs[device][self.positions[device]]);
        }
        loop {
            let mut moved = false;
            for (other, other_program) in programs.iter().enumerate() {
                if other == device {
                    continue;
                }
                while let Some(instruction) = other_program.get(self.positions[other]) {
                    let ready = match *instruction {
                        Instruction::Forward { micro_batch_idx, stage_idx } => {
                            stage_idx == 0 || ops.done(&self.positions, (false, micro_batch_idx, stage_idx - 1))
                        }
                        Instruction::BackwardInput { micro_batch_idx, stage_idx }
                        | Instruction::Backward { micro_batch_idx, stage_idx } => {
                            stage_idx + 1 == n_stages
                                || ops.done(&self.positions, (true, micro_batch_idx, stage_idx + 1))
                        }
                        Instruction::BackwardWeight { .. } => true,
                        Instruction::OptimizerStep => false,
                    };
                    if !ready {
                        break;
                    }
                    self.pass(other, instruction);
                    moved = true;
                }
            }
            if !moved {
                break;
            }
        }
    }
}

/// One stage's micro-batches over the instructions its device has run so far.
struct StageBooks {
    forward_done: Vec<bool>,
    backward_done: Vec<bool>,
    weight_done: Vec<bool>,
    /// Forwards and input-gradient passes run.
    n_forwards: usize,
    n_backwards: usize,
    /// Micro-batches past their forward and before their input-gradient pass.
    n_open: usize,
    /// Micro-batches freed by weight passes (in micro-batch order), and how many of them had run
    /// their input-gradient pass.
    freed: usize,
    backwards_freed: usize,
}

impl StageBooks {
    fn new(m: usize) -> Self {
        StageBooks {
            forward_done: vec![false; m],
            backward_done: vec![false; m],
            weight_done: vec![false; m],
            n_forwards: 0,
            n_backwards: 0,
            n_open: 0,
            freed: 0,
            backwards_freed: 0,
        }
    }

    /// Counts `instruction`, one of this stage's ops, as run.
    fn record(&mut self, instruction: &Instruction) {
        let Some(mb) = instruction.micro_batch_idx() else { return };
        let (forward, backward, weight) = match instruction {
            Instruction::Forward { .. } => (true, false, false),
            Instruction::BackwardInput { .. } => (false, true, false),
            Instruction::Backward { .. } => (false, true, true),
            Instruction::BackwardWeight { .. } => (false, false, true),
            Instruction::OptimizerStep => return,
        };
        if forward && !self.forward_done[mb] {
            self.forward_done[mb] = true;
            self.n_forwards += 1;
            self.n_open += usize::from(!self.backward_done[mb]);
        }
        if backward && !self.backward_done[mb] {
            self.n_open -= usize::from(self.forward_done[mb]);
            self.backward_done[mb] = true;
            self.n_backwards += 1;
            self.backwards_freed += usize::from(mb < self.freed);
        }
        if weight {
            self.weight_done[mb] = true;
        }
        // Weight passes free micro-batches in order (a later one waits for the earlier ones).
        while self.weight_done.get(self.freed) == Some(&true) {
            self.backwards_freed += usize::from(self.backward_done[self.freed]);
            self.freed += 1;
        }
    }

    /// The stage at the moment its device runs `running`, given the finished forwards and
    /// input-gradient passes of every stage (`done`).
    fn moment(&self, running: &Instruction, stage_idx: usize, done: &[Vec<usize>; 2]) -> Moment {
        let m = self.forward_done.len();
        let mine = running.stage_idx() == Some(stage_idx);
        let running_mb = running.micro_batch_idx().filter(|_| mine);
        let running_kind = mine.then(|| Running::of(running));
        // The running micro-batch's own state is the running op's, not counted here.
        let open = |mb: usize| self.forward_done[mb] && !self.backward_done[mb];
        let held = |mb: usize| self.backward_done[mb] && mb >= self.freed;
        let n_forward = self.n_open - running_mb.map_or(0, |mb| usize::from(open(mb)));
        let n_backward = self.n_backwards - self.backwards_freed - running_mb.map_or(0, |mb| usize::from(held(mb)));
        let forward_has_last = m > 0 && open(m - 1) && running_mb != Some(m - 1);
        let running_forward = usize::from(matches!(running_kind, Some(Running::Forward)));
        let running_backward = usize::from(matches!(running_kind, Some(Running::BackwardInput { .. })));
        let consumed_forward = self.n_forwards + running_forward;
        let consumed_backward = self.n_backwards + running_backward;
        let n_stages = done[0].len();
        Moment {
            running: running_kind,
            n_forward,
            forward_has_last,
            n_backward,
            queued_forward: (0..stage_idx).map(|t| done[0][t].saturating_sub(consumed_forward)).collect(),
            queued_gradient: (stage_idx + 1..n_stages).map(|t| done[1][t].saturating_sub(consumed_backward)).collect(),
            outputs_held: 0,
        }
    }
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
        let peak_inflight = memory.moments[0].iter().map(|m| m.n_forward + 1).max().unwrap();
        assert_eq!(peak_inflight, 2);
    }

    /// The incremental walk gives the first walk's moments for every schedule kind on 1 to 4
    /// devices, 1 to 9 micro-batches, its valid chunk counts, and the forward-only programs.
    #[test]
    fn the_incremental_walk_matches_the_quadratic_one() {
        let mut compared = 0;
        for kind in ScheduleKind::ALL {
            for n_devices in 1..=4 {
                for n_micro_batches in 1..=9 {
                    for n_chunks in 1..=3 {
                        let Ok(schedule) = Schedule::new(kind, n_devices, n_micro_batches, n_chunks) else { continue };
                        let forward_only: Vec<Vec<Instruction>> = (0..n_devices)
                            .map(|d| {
                                let stages: Vec<usize> = schedule.stages_of_device(d).collect();
                                (0..n_micro_batches)
                                    .flat_map(|mb| {
                                        stages
                                            .iter()
                                            .map(move |&s| Instruction::Forward { micro_batch_idx: mb, stage_idx: s })
                                    })
                                    .collect()
                            })
                            .collect();
                        for (programs, eval) in [(schedule.programs(), false), (&forward_only[..], true)] {
                            assert_eq!(
                                moments_of(&schedule, programs, eval),
                                reference_moments_of(&schedule, programs, eval),
                                "{kind:?} on {n_devices} devices, {n_micro_batches} micro-batches, {n_chunks} chunks, eval {eval}"
                            );
                            compared += 1;
                        }
                    }
                }
            }
        }
        assert!(compared > 200, "only {compared} schedules compared");
    }

    /// The first, quadratic walk: the closure computed afresh at each instruction, the counts from
    /// the program's prefix. The oracle for [`moments_of`].
    fn reference_moments_of(schedule: &Schedule, programs: &[Vec<Instruction>], eval: bool) -> Vec<Vec<Moment>> {
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
                                    stage_idx + 1 == n_stages
                                        || done(&positions, (true, micro_batch_idx, stage_idx + 1))
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
                        moment.running = moment.running.map(|_| Running::Evaluate);
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
        let running_kind = mine.then(|| Running::of(running));
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
        moment
    }
}
