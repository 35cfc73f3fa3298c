//! The validator: structural checks (every op exactly once, on the right device) and an abstract
//! execution over blocking bounded FIFO channels that finds dependency violations, out-of-order
//! messages and deadlocks.
use std::collections::{HashMap, HashSet, VecDeque};

use crate::error::{BlockedDevice, ScheduleError, Wait};
use crate::instruction::{ChannelId, Instruction, Message};
use crate::schedule::Schedule;

/// Checks that `schedule` is complete, correctly placed, and runs to completion when every
/// (from stage, to stage, direction) is a blocking FIFO channel holding `channel_capacity`
/// messages.
///
/// Structural checks: one program per device; every instruction in range and on the device of
/// its stage; for every (micro-batch, stage) exactly one `Forward` and either one fused
/// `Backward` or one `BackwardInput` and one `BackwardWeight`; one `OptimizerStep`, last on
/// every device.
///
/// Abstract execution: each device walks its program; an instruction first receives (blocking
/// while its channel is empty), then computes, then sends (blocking while the channel holds
/// `channel_capacity` messages). Capacity 0 is a rendezvous: a send completes only once the
/// receiver has taken the message. When an instruction computes, the ops it depends on must
/// have computed: `F(m, s - 1)` before `F(m, s)`; `F(m, s)` and the input-gradient of
/// `(m, s + 1)` before the input-gradient of `(m, s)`; `BackwardInput(m, s)` before
/// `BackwardWeight(m, s)`; every backward of the device's stages before `OptimizerStep`.
///
/// Every error names the device and instruction at fault.
pub fn validate(schedule: &Schedule, channel_capacity: usize) -> Result<(), ScheduleError> {
    check_structure(schedule)?;
    execute(schedule, channel_capacity)
}

fn check_structure(schedule: &Schedule) -> Result<(), ScheduleError> {
    let n_stages = schedule.n_stages();
    let n_micro_batches = schedule.n_micro_batches();
    if schedule.programs().len() != schedule.n_devices() {
        return Err(ScheduleError::WrongProgramCount {
            expected: schedule.n_devices(),
            got: schedule.programs().len(),
        });
    }
    // (micro-batch, stage) -> [forward, backward-input, backward-weight, fused backward] positions.
    let mut seen: HashMap<Instruction, usize> = HashMap::new();
    for (device_idx, program) in schedule.programs().iter().enumerate() {
        let optimizer_positions: Vec<usize> = program
            .iter()
            .enumerate()
            .filter(|(_, instruction)| **instruction == Instruction::OptimizerStep)
            .map(|(instruction_idx, _)| instruction_idx)
            .collect();
        if optimizer_positions != [program.len().wrapping_sub(1)] {
            return Err(ScheduleError::OptimizerStepPlacement {
                device_idx,
                positions: optimizer_positions,
                program_len: program.len(),
            });
        }
        for (instruction_idx, &instruction) in program.iter().enumerate() {
            let (Some(stage_idx), Some(micro_batch_idx)) = (instruction.stage_idx(), instruction.micro_batch_idx())
            else {
                continue;
            };
            if stage_idx >= n_stages || micro_batch_idx >= n_micro_batches {
                return Err(ScheduleError::OutOfRange {
                    device_idx,
                    instruction_idx,
                    instruction,
                    n_stages,
                    n_micro_batches,
                });
            }
            let expected_device_idx = schedule.device_of_stage(stage_idx);
            if expected_device_idx != device_idx {
                return Err(ScheduleError::WrongDevice {
                    device_idx,
                    instruction_idx,
                    instruction,
                    stage_idx,
                    expected_device_idx,
                });
            }
            if let Some(&first_instruction_idx) = seen.get(&instruction) {
                return Err(ScheduleError::Duplicate {
                    device_idx,
                    instruction_idx,
                    instruction,
                    first_instruction_idx,
                });
            }
            let fused = Instruction::Backward { micro_batch_idx, stage_idx };
            let split = [
                Instruction::BackwardInput { micro_batch_idx, stage_idx },
                Instruction::BackwardWeight { micro_batch_idx, stage_idx },
            ];
            let mixed = match instruction {
                Instruction::Backward { .. } => split.iter().any(|other| seen.contains_key(other)),
                Instruction::BackwardInput { .. } | Instruction::BackwardWeight { .. } => seen.contains_key(&fused),
                _ => false,
            };
            if mixed {
                return Err(ScheduleError::MixedBackward { device_idx, instruction_idx, instruction });
            }
            seen.insert(instruction, instruction_idx);
        }
    }
    for stage_idx in 0..n_stages {
        let device_idx = schedule.device_of_stage(stage_idx);
        for micro_batch_idx in 0..n_micro_batches {
            let forward = Instruction::Forward { micro_batch_idx, stage_idx };
            let fused = Instruction::Backward { micro_batch_idx, stage_idx };
            let input = Instruction::BackwardInput { micro_batch_idx, stage_idx };
            let weight = Instruction::BackwardWeight { micro_batch_idx, stage_idx };
            let missing = if !seen.contains_key(&forward) {
                Some(forward)
            } else if seen.contains_key(&fused) {
                None
            } else if !seen.contains_key(&input) {
                // Neither fused nor split: name the fused form for split-free schedules.
                Some(if seen.contains_key(&weight) || schedule.kind().splits_backward() { input } else { fused })
            } else if !seen.contains_key(&weight) {
                Some(weight)
            } else {
                None
            };
            if let Some(instruction) = missing {
                return Err(ScheduleError::Missing { device_idx, instruction });
            }
        }
    }
    Ok(())
}

/// Where a device is inside its current instruction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Receive,
    Compute,
    Send,
    /// Capacity 0 only: the message is in the channel, waiting for the receiver to take it.
    AwaitPickup,
}

fn execute(schedule: &Schedule, channel_capacity: usize) -> Result<(), ScheduleError> {
    let n_stages = schedule.n_stages();
    let programs = schedule.programs();
    let mut channels: HashMap<ChannelId, VecDeque<Message>> = HashMap::new();
    let mut done: HashSet<Instruction> = HashSet::new();
    let mut positions = vec![0usize; programs.len()];
    let mut phases = vec![Phase::Receive; programs.len()];
    loop {
        let mut progressed = false;
        for (device_idx, program) in programs.iter().enumerate() {
            while let Some(&instruction) = program.get(positions[device_idx]) {
                let instruction_idx = positions[device_idx];
                let phase = &mut phases[device_idx];
                match *phase {
                    Phase::Receive => {
                        if let Some(expected) = instruction.recv_from(n_stages) {
                            let queue = channels.entry(expected.channel()).or_default();
                            let Some(&got) = queue.front() else { break };
                            if got != expected {
                                return Err(ScheduleError::MessageOutOfOrder {
                                    device_idx,
                                    instruction_idx,
                                    instruction,
                                    expected,
                                    got,
                                });
                            }
                            queue.pop_front();
                        }
                        *phase = Phase::Compute;
                    }
                    Phase::Compute => {
                        if let Some(requires) = first_unmet_dependency(schedule, device_idx, instruction, &done) {
                            return Err(ScheduleError::DependencyViolated {
                                device_idx,
                                instruction_idx,
                                instruction,
                                requires,
                            });
                        }
                        done.insert(instruction);
                        *phase = Phase::Send;
                    }
                    Phase::Send => {
                        if let Some(message) = instruction.send_to(n_stages) {
                            let queue = channels.entry(message.channel()).or_default();
                            if queue.len() >= channel_capacity.max(1) {
                                break;
                            }
                            queue.push_back(message);
                            if channel_capacity == 0 {
                                *phase = Phase::AwaitPickup;
                                progressed = true;
                                continue;
                            }
                        }
                        positions[device_idx] += 1;
                        *phase = Phase::Receive;
                    }
                    Phase::AwaitPickup => {
                        let message = instruction.send_to(n_stages).expect("only sends await pickup");
                        if channels.get(&message.channel()).is_some_and(|queue| !queue.is_empty()) {
                            break;
                        }
                        positions[device_idx] += 1;
                        *phase = Phase::Receive;
                    }
                }
                progressed = true;
            }
        }
        let finished = positions.iter().zip(programs).all(|(&position, program)| position == program.len());
        if finished {
            return Ok(());
        }
        if !progressed {
            return Err(deadlock(schedule, channel_capacity, &positions, &phases));
        }
    }
}

fn first_unmet_dependency(
    schedule: &Schedule,
    device_idx: usize,
    instruction: Instruction,
    done: &HashSet<Instruction>,
) -> Option<Instruction> {
    let n_stages = schedule.n_stages();
    // The input-gradient op of (m, s): fused or split, whichever the schedule uses.
    let input_gradient = |micro_batch_idx, stage_idx| {
        let fused = Instruction::Backward { micro_batch_idx, stage_idx };
        let split = Instruction::BackwardInput { micro_batch_idx, stage_idx };
        if done.contains(&fused) || done.contains(&split) { None } else { Some(split) }
    };
    let need = |instruction: Instruction| (!done.contains(&instruction)).then_some(instruction);
    match instruction {
        Instruction::Forward { micro_batch_idx, stage_idx } if stage_idx > 0 => {
            need(Instruction::Forward { micro_batch_idx, stage_idx: stage_idx - 1 })
        }
        Instruction::Forward { .. } => None,
        Instruction::BackwardInput { micro_batch_idx, stage_idx }
        | Instruction::Backward { micro_batch_idx, stage_idx } => {
            need(Instruction::Forward { micro_batch_idx, stage_idx }).or_else(|| {
                if stage_idx + 1 < n_stages { input_gradient(micro_batch_idx, stage_idx + 1) } else { None }
            })
        }
        Instruction::BackwardWeight { micro_batch_idx, stage_idx } => {
            need(Instruction::BackwardInput { micro_batch_idx, stage_idx })
        }
        Instruction::OptimizerStep => schedule.stages_of_device(device_idx).find_map(|stage_idx| {
            (0..schedule.n_micro_batches()).find_map(|micro_batch_idx| {
                let fused = Instruction::Backward { micro_batch_idx, stage_idx };
                let weight = Instruction::BackwardWeight { micro_batch_idx, stage_idx };
                (!done.contains(&fused) && !done.contains(&weight)).then_some(weight)
            })
        }),
    }
}

fn deadlock(schedule: &Schedule, channel_capacity: usize, positions: &[usize], phases: &[Phase]) -> ScheduleError {
    let n_stages = schedule.n_stages();
    let blocked = schedule
        .programs()
        .iter()
        .enumerate()
        .filter_map(|(device_idx, program)| {
            let instruction_idx = positions[device_idx];
            let instruction = *program.get(instruction_idx)?;
            let waiting_on = match phases[device_idx] {
                Phase::Receive => Wait::Receive(instruction.recv_from(n_stages)?),
                Phase::Send | Phase::AwaitPickup => Wait::Send(instruction.send_to(n_stages)?),
                Phase::Compute => return None,
            };
            Some(BlockedDevice { device_idx, instruction_idx, instruction, waiting_on })
        })
        .collect();
    ScheduleError::Deadlock { channel_capacity, blocked }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kind::ScheduleKind;

    fn forward(micro_batch_idx: usize, stage_idx: usize) -> Instruction {
        Instruction::Forward { micro_batch_idx, stage_idx }
    }

    fn backward(micro_batch_idx: usize, stage_idx: usize) -> Instruction {
        Instruction::Backward { micro_batch_idx, stage_idx }
    }

    fn two_stage(programs: Vec<Vec<Instruction>>, n_micro_batches: usize) -> Schedule {
        Schedule::from_programs(ScheduleKind::OneFOneB, 2, n_micro_batches, 1, programs)
    }

    #[test]
    fn generated_schedules_pass() {
        for kind in ScheduleKind::ALL {
            let n_chunks = if kind.supports_chunks() { 2 } else { 1 };
            let schedule = Schedule::new(kind, 3, 6, n_chunks).unwrap();
            for capacity in [1, 2, 64] {
                validate(&schedule, capacity).unwrap_or_else(|err| panic!("{kind} capacity {capacity}: {err}"));
            }
        }
    }

    #[test]
    fn rendezvous_channels_deadlock_one_f_one_b_but_not_gpipe() {
        let gpipe = Schedule::new(ScheduleKind::GPipe, 3, 4, 1).unwrap();
        validate(&gpipe, 0).unwrap();
        let one_f_one_b = Schedule::new(ScheduleKind::OneFOneB, 3, 4, 1).unwrap();
        let err = validate(&one_f_one_b, 0).unwrap_err();
        assert!(matches!(err, ScheduleError::Deadlock { channel_capacity: 0, .. }), "{err}");
    }

    #[test]
    fn reports_deadlock_with_stuck_devices() {
        // Device 0 waits for micro-batch 0's gradient before sending any activation.
        let schedule = two_stage(
            vec![
                vec![backward(0, 0), forward(0, 0), Instruction::OptimizerStep],
                vec![forward(0, 1), backward(0, 1), Instruction::OptimizerStep],
            ],
            1,
        );
        let err = validate(&schedule, 1).unwrap_err();
        let ScheduleError::Deadlock { blocked, .. } = &err else { panic!("{err}") };
        assert_eq!(blocked.len(), 2);
        assert_eq!(blocked[0].instruction, backward(0, 0));
        assert!(
            err.to_string().contains("device 0 is stuck on instruction 0 (backward of micro-batch 0 on stage 0)"),
            "{err}"
        );
    }

    #[test]
    fn reports_structural_errors() {
        let optimizer_first = two_stage(
            vec![
                vec![Instruction::OptimizerStep, forward(0, 0), backward(0, 0)],
                vec![forward(0, 1), backward(0, 1), Instruction::OptimizerStep],
            ],
            1,
        );
        assert!(matches!(
            validate(&optimizer_first, 1),
            Err(ScheduleError::OptimizerStepPlacement { device_idx: 0, .. })
        ));
        let wrong_device = two_stage(
            vec![
                vec![forward(0, 0), forward(0, 1), backward(0, 0), Instruction::OptimizerStep],
                vec![backward(0, 1), Instruction::OptimizerStep],
            ],
            1,
        );
        let err = validate(&wrong_device, 1).unwrap_err();
        assert!(matches!(err, ScheduleError::WrongDevice { device_idx: 0, instruction_idx: 1, .. }), "{err}");
        let missing = two_stage(
            vec![
                vec![forward(0, 0), forward(1, 0), backward(0, 0), Instruction::OptimizerStep],
                vec![forward(0, 1), forward(1, 1), backward(0, 1), backward(1, 1), Instruction::OptimizerStep],
            ],
            2,
        );
        assert_eq!(validate(&missing, 1), Err(ScheduleError::Missing { device_idx: 0, instruction: backward(1, 0) }));
        let duplicate = two_stage(
            vec![
                vec![forward(0, 0), forward(0, 0), backward(0, 0), Instruction::OptimizerStep],
                vec![forward(0, 1), backward(0, 1), Instruction::OptimizerStep],
            ],
            1,
        );
        assert!(matches!(validate(&duplicate, 1), Err(ScheduleError::Duplicate { instruction_idx: 1, .. })));
    }

    #[test]
    fn reports_out_of_order_messages_and_dependencies() {
        let out_of_order = two_stage(
            vec![
                vec![forward(0, 0), forward(1, 0), backward(0, 0), backward(1, 0), Instruction::OptimizerStep],
                vec![forward(1, 1), forward(0, 1), backward(0, 1), backward(1, 1), Instruction::OptimizerStep],
            ],
            2,
        );
        let err = validate(&out_of_order, 4).unwrap_err();
        assert!(matches!(err, ScheduleError::MessageOutOfOrder { device_idx: 1, instruction_idx: 0, .. }), "{err}");
        let weight_first = Schedule::from_programs(
            ScheduleKind::ZbH1,
            1,
            1,
            1,
            vec![vec![
                forward(0, 0),
                Instruction::BackwardWeight { micro_batch_idx: 0, stage_idx: 0 },
                Instruction::BackwardInput { micro_batch_idx: 0, stage_idx: 0 },
                Instruction::OptimizerStep,
            ]],
        );
        let err = validate(&weight_first, 1).unwrap_err();
        assert!(matches!(err, ScheduleError::DependencyViolated { instruction_idx: 1, .. }), "{err}");
        assert!(err.to_string().contains("runs before backward-input of micro-batch 0 on stage 0"), "{err}");
    }
}
