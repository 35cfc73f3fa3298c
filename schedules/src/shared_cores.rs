//! Simulation when devices share fewer cores than there are devices (four CPU stages on a
//! two-core machine), under two models:
//! - [`simulate_on_cores`]: processor sharing, where the ops running at one moment progress at
//!   rate `min(1, n_cores / n_running)` each (threads left to the operating system);
//! - [`simulate_with_core_slots`]: core slots, where an op that is ready queues for one of
//!   `n_cores` slots, first come first served, and then runs at full speed to its end (the
//!   runtime's core slots, `TrainerBuilder::core_slots`).
//!
//! Unlike [`crate::simulate`], an op's duration depends on what else runs meanwhile, so this is a
//! true event loop: at each step it starts every op whose device is free and whose input has
//! arrived, then advances time to the next op completion or message arrival. Op costs are the
//! seconds an op needs with a core to itself (for a measured run: its thread's CPU time).
use std::collections::HashMap;

use crate::cost::CostModel;
use crate::error::{BlockedDevice, ScheduleError, Wait};
use crate::instruction::Message;
use crate::schedule::Schedule;
use crate::simulate::{SimulationReport, busy_end_s, instruction_event, op_cost, transfer_s};
use crate::timeline::{OpKind, Timeline};

/// Simulates `schedule` under `costs` with the devices sharing `n_cores` cores.
///
/// With `n_cores >= n_devices` this gives the same timeline as [`crate::simulate`] (less its
/// `Wait` and `Send` events). Errors: an unusable cost model, zero cores, or programs that cannot
/// finish.
pub fn simulate_on_cores(
    schedule: &Schedule,
    costs: &CostModel,
    n_cores: usize,
) -> Result<SimulationReport, ScheduleError> {
    if n_cores == 0 {
        return Err(ScheduleError::ZeroParameter { parameter: "n_cores", noun: "core" });
    }
    let n_stages = schedule.n_stages();
    costs.check(n_stages)?;
    let programs = schedule.programs();
    let n_devices = programs.len();
    let mut timeline = Timeline::new(schedule.n_devices(), n_stages);
    let mut arrivals: HashMap<Message, f64> = HashMap::new();
    let mut positions = vec![0usize; n_devices];
    // Per device: the op running, its start and the work (core-seconds) it still needs.
    let mut running: Vec<Option<(usize, f64, f64)>> = vec![None; n_devices];
    let mut now = 0.0f64;
    const EPSILON: f64 = 1e-12;
    loop {
        // Start every op that can start now.
        for device_idx in 0..n_devices {
            if running[device_idx].is_some() {
                continue;
            }
            let Some(&instruction) = programs[device_idx].get(positions[device_idx]) else { continue };
            let ready = match instruction.recv_from(n_stages) {
                Some(message) => arrivals.get(&message).is_some_and(|&arrival| arrival <= now + EPSILON),
                None => true,
            };
            if ready {
                running[device_idx] = Some((positions[device_idx], now, op_cost(costs, device_idx, instruction)));
            }
        }
        let n_running = running.iter().flatten().count();
        if n_running == 0 {
            if positions.iter().zip(programs).all(|(&p, program)| p == program.len()) {
                return Ok(SimulationReport::from_timeline(timeline));
            }
            // Idle until the next message arrives, or stuck for good.
            match arrivals.values().copied().filter(|&a| a > now + EPSILON).min_by(f64::total_cmp) {
                Some(next) => {
                    now = next;
                    continue;
                }
                None => {
                    let blocked = (0..n_devices)
                        .filter_map(|device_idx| {
                            let instruction_idx = positions[device_idx];
                            let instruction = *programs[device_idx].get(instruction_idx)?;
                            let message = instruction.recv_from(n_stages)?;
                            Some(BlockedDevice {
                                device_idx,
                                instruction_idx,
                                instruction,
                                waiting_on: Wait::Receive(message),
                            })
                        })
                        .collect();
                    return Err(ScheduleError::Deadlock { channel_capacity: usize::MAX, blocked });
                }
            }
        }
        let rate = (n_cores as f64 / n_running as f64).min(1.0);
        let to_finish = running.iter().flatten().map(|&(_, _, work)| work / rate).fold(f64::INFINITY, f64::min);
        let to_arrival = arrivals.values().map(|&a| a - now).filter(|&dt| dt > EPSILON).fold(f64::INFINITY, f64::min);
        let step = to_finish.min(to_arrival);
        now += step;
        for device_idx in 0..n_devices {
            let Some((position, start_s, work)) = running[device_idx] else { continue };
            let left = work - step * rate;
            if left > EPSILON {
                running[device_idx] = Some((position, start_s, left));
                continue;
            }
            let instruction = programs[device_idx][position];
            if let Some(message) = instruction.recv_from(n_stages) {
                arrivals.remove(&message);
            }
            timeline.events.push(instruction_event(device_idx, instruction, instruction.op_kind(), start_s, now));
            if let Some(message) = instruction.send_to(n_stages) {
                arrivals.insert(message, now + transfer_s(schedule, costs, message));
            }
            positions[device_idx] += 1;
            running[device_idx] = None;
        }
    }
}

/// Simulates `schedule` under `costs` the way the runtime shares `n_cores` core slots: a device
/// holds a slot while it runs, keeps it for its next op when that op's input is already there,
/// and gives it up when it would block; a device whose input arrives then queues for a slot,
/// first come first served (ties in device order). The optimizer step starts once every device
/// has finished its other ops (the runtime's commit barrier). A device that slept (it held no
/// slot) starts `wake_latency_s` after its slot is handed to it: the time the operating system
/// takes to run a sleeping thread, measured by the runtime (`StepReport::core_wake_latency_s`).
///
/// The timeline holds the ops, a `Wait` event for each interval a device waited for an input,
/// and a `CoreWait` event for each interval a ready op queued for a core. With `n_cores >= n_devices` it equals
/// [`crate::simulate`] (less `Send` events). Errors: an unusable cost model, zero cores, or
/// programs that cannot finish.
pub fn simulate_with_core_slots(
    schedule: &Schedule,
    costs: &CostModel,
    n_cores: usize,
    wake_latency_s: f64,
) -> Result<SimulationReport, ScheduleError> {
    if n_cores == 0 {
        return Err(ScheduleError::ZeroParameter { parameter: "n_cores", noun: "core" });
    }
    if !(wake_latency_s.is_finite() && wake_latency_s >= 0.0) {
        return Err(ScheduleError::InvalidCost { what: "wake_latency_s".into(), value: wake_latency_s });
    }
    let n_stages = schedule.n_stages();
    costs.check(n_stages)?;
    let programs = schedule.programs();
    let n_devices = programs.len();
    let mut timeline = Timeline::new(schedule.n_devices(), n_stages);
    let mut arrivals: HashMap<Message, f64> = HashMap::new();
    let mut positions = vec![0usize; n_devices];
    // When each device's previous op ended (its input wait starts there).
    let mut free_since: Vec<f64> = (0..n_devices).map(|d| costs.device_start_s(d)).collect();
    // When each queued device joined the queue.
    let mut queued_at: Vec<Option<f64>> = vec![None; n_devices];
    let mut queue: std::collections::VecDeque<usize> = std::collections::VecDeque::new();
    // Per device: the running op's start and end.
    let mut running: Vec<Option<(f64, f64)>> = vec![None; n_devices];
    // Devices that hold a slot between ops (they keep it while their next op is ready).
    let mut holding = vec![false; n_devices];
    let mut free_slots = n_cores;
    let mut now = 0.0f64;
    // When the optimizer steps may start: every device done with its other ops, plus the commit
    // latency.
    let mut commit_at: Option<f64> = None;
    const EPSILON: f64 = 1e-12;
    loop {
        // The optimizer step waits for every device to finish its ops (the commit barrier).
        let barrier_met = (0..n_devices).all(|d| {
            programs[d].get(positions[d]).is_none_or(|i| matches!(i, crate::instruction::Instruction::OptimizerStep))
        });
        if barrier_met && commit_at.is_none() {
            commit_at = Some(free_since.iter().copied().fold(0.0, f64::max));
        }
        // When each idle device's next op is ready, if it is.
        let ready_at = |device_idx: usize, arrivals: &HashMap<Message, f64>| -> Option<f64> {
            let instruction = *programs[device_idx].get(positions[device_idx])?;
            if matches!(instruction, crate::instruction::Instruction::OptimizerStep) {
                return commit_at
                    .map(|commit_s| commit_s + costs.device_commit_latency_s(device_idx))
                    .filter(|&ready_s| ready_s <= now + EPSILON);
            }
            // A device that has not started its program yet.
            if free_since[device_idx] > now + EPSILON {
                return None;
            }
            match instruction.recv_from(n_stages) {
                Some(message) => arrivals.get(&message).copied().filter(|&arrival| arrival <= now + EPSILON),
                None => Some(free_since[device_idx]),
            }
        };
        // A device holding a slot goes on with its next op if it is ready and gives the slot up
        // otherwise (to block); then every other device whose op is ready queues, in device order.
        for device_idx in 0..n_devices {
            if running[device_idx].is_some() || !holding[device_idx] {
                continue;
            }
            match ready_at(device_idx, &arrivals) {
                Some(_) => {
                    let instruction = programs[device_idx][positions[device_idx]];
                    running[device_idx] = Some((now, now + op_cost(costs, device_idx, instruction)));
                }
                None => {
                    holding[device_idx] = false;
                    free_slots += 1;
                }
            }
        }
        for device_idx in 0..n_devices {
            if running[device_idx].is_some() || queued_at[device_idx].is_some() {
                continue;
            }
            let Some(ready_at) = ready_at(device_idx, &arrivals) else { continue };
            let instruction = programs[device_idx][positions[device_idx]];
            let waits_for_commit = matches!(instruction, crate::instruction::Instruction::OptimizerStep);
            if ready_at > free_since[device_idx] + EPSILON && !waits_for_commit {
                timeline.events.push(instruction_event(
                    device_idx,
                    instruction,
                    OpKind::Wait,
                    free_since[device_idx],
                    ready_at,
                ));
            }
            queued_at[device_idx] = Some(now);
            queue.push_back(device_idx);
        }
        while free_slots > 0 {
            let Some(device_idx) = queue.pop_front() else { break };
            let since = queued_at[device_idx].take().expect("queued devices have a time");
            free_slots -= 1;
            let instruction = programs[device_idx][positions[device_idx]];
            // The device was asleep: it runs once the operating system has woken it.
            let start_s = now + wake_latency_s;
            if start_s > since + EPSILON {
                timeline.events.push(instruction_event(device_idx, instruction, OpKind::CoreWait, since, start_s));
            }
            running[device_idx] = Some((start_s, start_s + op_cost(costs, device_idx, instruction)));
            holding[device_idx] = true;
        }
        let next_end = running.iter().flatten().map(|&(_, end)| end).fold(f64::INFINITY, f64::min);
        let next_arrival = arrivals.values().copied().filter(|&a| a > now + EPSILON).fold(f64::INFINITY, f64::min);
        let next_start = free_since.iter().copied().filter(|&t| t > now + EPSILON).fold(f64::INFINITY, f64::min);
        let next_commit = commit_at
            .into_iter()
            .flat_map(|commit_s| (0..n_devices).map(move |d| commit_s + costs.device_commit_latency_s(d)))
            .filter(|&t| t > now + EPSILON)
            .fold(f64::INFINITY, f64::min);
        let next = next_end.min(next_arrival).min(next_start).min(next_commit);
        if !next.is_finite() {
            if positions.iter().zip(programs).all(|(&p, program)| p == program.len()) {
                return Ok(SimulationReport::from_timeline(timeline));
            }
            let blocked = (0..n_devices)
                .filter_map(|device_idx| {
                    let instruction_idx = positions[device_idx];
                    let instruction = *programs[device_idx].get(instruction_idx)?;
                    let message = instruction.recv_from(n_stages)?;
                    Some(BlockedDevice { device_idx, instruction_idx, instruction, waiting_on: Wait::Receive(message) })
                })
                .collect();
            return Err(ScheduleError::Deadlock { channel_capacity: usize::MAX, blocked });
        }
        now = next;
        for device_idx in 0..n_devices {
            let Some((start_s, end_s)) = running[device_idx] else { continue };
            if end_s > now + EPSILON {
                continue;
            }
            let instruction = programs[device_idx][positions[device_idx]];
            if let Some(message) = instruction.recv_from(n_stages) {
                arrivals.remove(&message);
            }
            timeline.events.push(instruction_event(
                device_idx,
                instruction,
                instruction.op_kind(),
                start_s,
                busy_end_s(costs, instruction, start_s, end_s),
            ));
            if let Some(message) = instruction.send_to(n_stages) {
                arrivals.insert(message, end_s + transfer_s(schedule, costs, message));
            }
            positions[device_idx] += 1;
            running[device_idx] = None;
            free_since[device_idx] = end_s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::StageCosts;
    use crate::kind::ScheduleKind;
    use crate::simulate::simulate;
    use crate::timeline::OpKind;

    #[test]
    fn with_a_core_per_device_it_matches_the_plain_simulator() {
        for kind in ScheduleKind::ALL {
            let chunks = if kind.supports_chunks() { 2 } else { 1 };
            let schedule = Schedule::new(kind, 4, 8, chunks).unwrap();
            let costs = CostModel::per_stage(
                (0..schedule.n_stages()).map(|s| StageCosts::new(1.0 + s as f64 * 0.1, 1.3, 0.7)).collect(),
            );
            let plain = simulate(&schedule, &costs).unwrap();
            let shared = simulate_on_cores(&schedule, &costs, 4).unwrap();
            assert!((plain.makespan_s - shared.makespan_s).abs() < 1e-9, "{kind}");
            assert!((plain.bubble_fraction - shared.bubble_fraction).abs() < 1e-9, "{kind}");
        }
    }

    #[test]
    fn with_a_slot_per_device_slots_match_the_plain_simulator() {
        for kind in ScheduleKind::ALL {
            let chunks = if kind.supports_chunks() { 2 } else { 1 };
            let schedule = Schedule::new(kind, 4, 8, chunks).unwrap();
            let costs = CostModel::per_stage(
                (0..schedule.n_stages()).map(|s| StageCosts::new(1.0 + s as f64 * 0.1, 1.3, 0.7)).collect(),
            );
            let plain = simulate(&schedule, &costs).unwrap();
            let slots = simulate_with_core_slots(&schedule, &costs, 4, 0.0).unwrap();
            assert!((plain.makespan_s - slots.makespan_s).abs() < 1e-9, "{kind}");
            assert!((plain.bubble_fraction - slots.bubble_fraction).abs() < 1e-9, "{kind}");
        }
    }

    #[test]
    fn slots_run_ops_whole_and_in_arrival_order() {
        // GPipe, 2 devices on 1 core, F = 1, B = 2: nothing overlaps, so the makespan is the
        // total work 2 x 2 x 3 = 12; ops never overlap in time.
        let schedule = Schedule::new(ScheduleKind::GPipe, 2, 2, 1).unwrap();
        let costs = CostModel::uniform(StageCosts::new(1.0, 1.0, 1.0));
        let one = simulate_with_core_slots(&schedule, &costs, 1, 0.0).unwrap();
        assert!((one.makespan_s - 12.0).abs() < 1e-9, "{}", one.makespan_s);
        let mut ops: Vec<_> =
            one.timeline.events.iter().filter(|e| matches!(e.op, OpKind::Forward | OpKind::Backward)).collect();
        ops.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
        for pair in ops.windows(2) {
            assert!(pair[1].start_s >= pair[0].end_s - 1e-9, "{pair:?}");
            assert!((pair[0].duration_s() - if pair[0].op == OpKind::Forward { 1.0 } else { 2.0 }).abs() < 1e-9);
        }
        // Device 0's F0 [0,1]; then device 0's F1 and device 1's F0 are both ready at 1: device
        // order breaks the tie, so F1 on device 0 runs [1,2] and F0 on device 1 runs [2,3].
        let f0_dev1 = ops.iter().find(|e| e.device_idx == 1 && e.op == OpKind::Forward).unwrap();
        assert_eq!((f0_dev1.start_s, f0_dev1.end_s), (2.0, 3.0));
        assert!(simulate_with_core_slots(&schedule, &costs, 0, 0.0).is_err());
    }

    #[test]
    fn fewer_cores_stretch_overlapping_ops() {
        // GPipe on 4 devices with F = B = 1: on one core nothing overlaps, so the makespan is the
        // total work, 4 devices x 8 micro-batches x 2.
        let schedule = Schedule::new(ScheduleKind::GPipe, 4, 8, 1).unwrap();
        let costs = CostModel::uniform(StageCosts::new(1.0, 0.5, 0.5));
        let one_core = simulate_on_cores(&schedule, &costs, 1).unwrap();
        assert!((one_core.makespan_s - 64.0).abs() < 1e-9, "{}", one_core.makespan_s);
        let two_cores = simulate_on_cores(&schedule, &costs, 2).unwrap();
        let four_cores = simulate_on_cores(&schedule, &costs, 4).unwrap();
        assert!(four_cores.makespan_s < two_cores.makespan_s && two_cores.makespan_s < one_core.makespan_s);
        assert!(simulate_on_cores(&schedule, &costs, 0).is_err());
    }
}
