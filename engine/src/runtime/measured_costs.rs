//! The cost model a measured step gives the simulator, so a bubble report can set a measured step
//! beside a simulated one ([`super::bubbles`]): each op's duration and its occupancy of its
//! device, device starts, optimizer steps, when the commit reached each worker, the delivery
//! latency of messages, and per-stage means of the ops' thread CPU times.
use std::collections::HashMap;

use conveyor_schedules::{CostModel, OpKey, OpKind, StageCosts, Timeline, TimelineEvent};

use super::StepReport;

/// Op costs from the wall durations in a measured timeline, for the simulator: per-stage means,
/// with each measured op given its own duration.
pub(crate) fn measured_costs(timeline: &Timeline, n_stages: usize) -> CostModel {
    // An op occupies its device from its start until the device turns to anything else: its
    // sends and bookkeeping count, up to the next event (but never the wait for the commit
    // before the optimizer step).
    let mut until_next: HashMap<DeviceOpKey, f64> = HashMap::new();
    // When the commit reached each device: its optimizer step, or its wait for a core to run
    // that step, starts.
    let mut commit_s = vec![f64::INFINITY; timeline.n_devices];
    for ((d, device_commit_s), events) in commit_s.iter_mut().enumerate().zip(events_by_device(timeline)) {
        for (idx, pair) in events.windows(2).enumerate() {
            // The wait for the commit is not the op's: its next event is the optimizer step, or
            // the wait for a core to run it.
            let before_optimizer = pair[1].op == OpKind::OptimizerStep
                || (pair[1].op == OpKind::CoreWait
                    && events.get(idx + 2).is_some_and(|next| next.op == OpKind::OptimizerStep));
            if before_optimizer {
                *device_commit_s = device_commit_s.min(pair[1].start_s);
            }
            if pair[0].op.is_compute() && !before_optimizer && pair[1].start_s >= pair[0].end_s {
                until_next.insert(
                    (d, pair[0].stage_idx, pair[0].op, pair[0].micro_batch_idx),
                    pair[1].start_s - pair[0].start_s,
                );
            }
        }
    }
    let (op_costs, op_overheads) = per_op_costs(timeline, &until_next);
    // Workers start their programs when the coordinator's step command reaches them, not all at
    // once: each device starts at its first event, relative to the first op.
    let origin = timeline.events.iter().filter(|e| e.op.is_compute()).map(|e| e.start_s).fold(f64::INFINITY, f64::min);
    let device_start_s = (0..timeline.n_devices)
        .map(|d| {
            let first =
                timeline.events.iter().filter(|e| e.device_idx == d).map(|e| e.start_s).fold(f64::INFINITY, f64::min);
            if first.is_finite() && origin.is_finite() { (first - origin).max(0.0) } else { 0.0 }
        })
        .collect();
    // The commit round trip: from the last op of the step (or gradient all-reduce) to the commit
    // reaching a device.
    let last_op_end_s = timeline
        .events
        .iter()
        .filter(|e| (e.op.is_compute() && e.op != OpKind::OptimizerStep) || e.op == OpKind::AllReduce)
        .map(|e| e.end_s)
        .fold(f64::NEG_INFINITY, f64::max);
    // Each worker's own: the commit reaches each when the operating system wakes it.
    let device_commit_latency_s: Vec<f64> = commit_s
        .iter()
        .map(|&s| if s.is_finite() && last_op_end_s.is_finite() { (s - last_op_end_s).max(0.0) } else { 0.0 })
        .collect();
    let commit_latency_s = device_commit_latency_s.iter().copied().fold(f64::INFINITY, f64::min);
    let commit_latency_s = if commit_latency_s.is_finite() { commit_latency_s } else { 0.0 };
    mean_costs(timeline.events.iter().map(|e| (e.stage_idx, e.op, e.duration_s())), n_stages)
        .with_commit_latency_s(commit_latency_s)
        .with_device_commit_latency_s(device_commit_latency_s)
        .with_op_costs(op_costs)
        .with_op_overheads(op_overheads)
        .with_device_start_s(device_start_s)
        .with_device_optimizer_step_s(device_optimizer_step_s(timeline))
        .with_device_all_reduce_s(device_time_in(timeline, OpKind::AllReduce))
        .with_all_reduce_in_buckets(all_reduce_in_buckets(timeline))
}

/// Whether the gradient all-reduce ran in buckets beside the backward pass (some all-reduce of a
/// device starts before that device's last compute op other than the optimizer step ends), so
/// the simulator fed these costs starts it with the final weight pass, as the runtime did.
fn all_reduce_in_buckets(timeline: &Timeline) -> bool {
    timeline.events.iter().filter(|e| e.op == OpKind::AllReduce).any(|all_reduce| {
        timeline.events.iter().any(|e| {
            e.device_idx == all_reduce.device_idx
                && e.op.is_compute()
                && e.op != OpKind::OptimizerStep
                && e.end_s > all_reduce.start_s
        })
    })
}

/// An op on one device: (device, stage, op, micro-batch), as a timeline event has them.
type DeviceOpKey = (usize, Option<usize>, OpKind, Option<usize>);

/// What the ops alone cost: each op its own span (a recomputation counted toward its backward),
/// every device starting at once, no delivery latency, no commit round trip. Against schedule
/// theory this shows what the ops' unequal costs do to the bubble.
pub(crate) fn span_costs(timeline: &Timeline, n_stages: usize) -> CostModel {
    let (op_costs, _) = per_op_costs(timeline, &HashMap::new());
    mean_costs(timeline.events.iter().map(|e| (e.stage_idx, e.op, e.duration_s())), n_stages)
        .with_op_costs(op_costs)
        .with_device_optimizer_step_s(device_optimizer_step_s(timeline))
        .with_device_all_reduce_s(device_time_in(timeline, OpKind::AllReduce))
        .with_all_reduce_in_buckets(all_reduce_in_buckets(timeline))
}

/// Each measured op's cost and the part of it that is not its own span, keyed by (stage, op,
/// micro-batch): an op costs its occupancy of its device where `occupancy` (keyed by device,
/// stage, op and micro-batch) has one, else its span; a recomputation runs right before its
/// micro-batch's backward, so it counts toward that op.
fn per_op_costs(
    timeline: &Timeline,
    occupancy: &HashMap<DeviceOpKey, f64>,
) -> (HashMap<OpKey, f64>, HashMap<OpKey, f64>) {
    let mut op_costs: HashMap<OpKey, f64> = HashMap::new();
    let mut op_overheads: HashMap<OpKey, f64> = HashMap::new();
    let recomputes: Vec<_> = timeline.events.iter().filter(|e| e.op == OpKind::Recompute).collect();
    for e in &timeline.events {
        let (Some(stage_idx), Some(micro_batch_idx)) = (e.stage_idx, e.micro_batch_idx) else { continue };
        if matches!(e.op, OpKind::Forward | OpKind::BackwardInput | OpKind::BackwardWeight | OpKind::Backward) {
            let recompute_s: f64 = if matches!(e.op, OpKind::BackwardInput | OpKind::Backward) {
                recomputes
                    .iter()
                    .filter(|r| r.stage_idx == e.stage_idx && r.micro_batch_idx == e.micro_batch_idx)
                    .map(|r| r.duration_s())
                    .sum()
            } else {
                0.0
            };
            let occupied =
                occupancy.get(&(e.device_idx, e.stage_idx, e.op, e.micro_batch_idx)).copied().unwrap_or(e.duration_s());
            *op_costs.entry((stage_idx, e.op, micro_batch_idx)).or_default() += occupied + recompute_s;
            // The time the op holds its device past its own span is not compute: the simulator
            // keeps the device occupied but not busy for it, as the measured timeline does.
            *op_overheads.entry((stage_idx, e.op, micro_batch_idx)).or_default() += occupied - e.duration_s();
        }
    }
    (op_costs, op_overheads)
}

/// Each device's optimizer step, device 0 first: stages of different sizes update different
/// numbers of parameters.
fn device_optimizer_step_s(timeline: &Timeline) -> Vec<f64> {
    device_time_in(timeline, OpKind::OptimizerStep)
}

/// Each device's time in events of kind `op`, device 0 first.
fn device_time_in(timeline: &Timeline, op: OpKind) -> Vec<f64> {
    (0..timeline.n_devices)
        .map(|d| {
            timeline.events.iter().filter(|e| e.device_idx == d && e.op == op).map(|e| e.duration_s()).sum::<f64>()
                + 0.0 // an empty f64 sum is -0.0
        })
        .collect()
}

/// The mean time from a message's send (the end of its sender's occupancy of its device) to the
/// end of its receiver's wait for it: the delivery latency, chiefly the operating system waking
/// the sleeping receiver. Only messages someone waited for count; 0 when there are none.
pub(crate) fn delivery_latency_s(timeline: &Timeline) -> f64 {
    let per_device = events_by_device(timeline);
    // When each compute op let go of its device (the device's next event, or the op's end), and
    // on which device: each (stage, op, micro-batch) runs once a step.
    let mut released = HashMap::new();
    for events in &per_device {
        for (idx, e) in events.iter().enumerate() {
            if let (true, Some(stage_idx), Some(micro_batch_idx)) = (e.op.is_compute(), e.stage_idx, e.micro_batch_idx)
            {
                let next = events.get(idx + 1).map_or(e.end_s, |next| next.start_s.max(e.end_s));
                released.insert((stage_idx, e.op, micro_batch_idx), (e.device_idx, next));
            }
        }
    }
    let (mut sum, mut count) = (0.0, 0usize);
    for events in &per_device {
        for pair in events.windows(2) {
            let (wait, op) = (pair[0], pair[1]);
            let (Some(stage_idx), Some(micro_batch_idx)) = (op.stage_idx, op.micro_batch_idx) else { continue };
            if wait.op != OpKind::Wait {
                continue;
            }
            // The sender: the previous stage's forward, or the next stage's backward.
            let senders: &[(usize, OpKind)] = match op.op {
                OpKind::Forward if stage_idx > 0 => &[(stage_idx - 1, OpKind::Forward)],
                OpKind::BackwardInput | OpKind::Backward => {
                    &[(stage_idx + 1, OpKind::BackwardInput), (stage_idx + 1, OpKind::Backward)]
                }
                _ => continue,
            };
            let sent = senders.iter().find_map(|&(s, kind)| released.get(&(s, kind, micro_batch_idx)));
            if let Some(&(sender_device, sent_s)) = sent
                && sender_device != op.device_idx
                && wait.end_s >= sent_s
            {
                sum += wait.end_s - sent_s;
                count += 1;
            }
        }
    }
    if count == 0 { 0.0 } else { sum / count as f64 }
}

/// Each device's events other than sends, in start order, device 0 first.
fn events_by_device(timeline: &Timeline) -> Vec<Vec<&TimelineEvent>> {
    let mut per_device: Vec<Vec<&TimelineEvent>> = vec![Vec::new(); timeline.n_devices];
    for e in timeline.events.iter().filter(|e| e.op != OpKind::Send) {
        per_device[e.device_idx].push(e);
    }
    for events in &mut per_device {
        events.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
    }
    per_device
}

/// Per-stage mean op costs from the ops' thread CPU times: what each op costs with a core to
/// itself, for simulating devices that share fewer cores.
pub(crate) fn cpu_costs(report: &StepReport, n_stages: usize) -> CostModel {
    mean_costs(report.op_cpu_times.iter().map(|t| (t.stage_idx, t.op, t.cpu_s)), n_stages)
}

fn mean_costs(samples: impl Iterator<Item = (Option<usize>, OpKind, f64)>, n_stages: usize) -> CostModel {
    let mut sums = vec![[0.0f64; 4]; n_stages];
    let mut counts = vec![[0usize; 4]; n_stages];
    let (mut optimizer_s, mut optimizer_n) = (0.0, 0usize);
    for (stage_idx, op, seconds) in samples {
        if op == OpKind::OptimizerStep {
            optimizer_s += seconds;
            optimizer_n += 1;
        }
        let Some(stage) = stage_idx else { continue };
        let slot = match op {
            OpKind::Forward => 0,
            OpKind::BackwardInput => 1,
            OpKind::BackwardWeight => 2,
            OpKind::Backward => 3,
            _ => continue,
        };
        sums[stage][slot] += seconds;
        counts[stage][slot] += 1;
    }
    let mean = |s: usize, k: usize| if counts[s][k] == 0 { 0.0 } else { sums[s][k] / counts[s][k] as f64 };
    let stages = (0..n_stages)
        .map(|s| {
            let (b, w) = if counts[s][3] > 0 {
                // A fused backward: split it evenly so B + W equals the measured fused cost.
                (mean(s, 3) / 2.0, mean(s, 3) / 2.0)
            } else {
                (mean(s, 1), mean(s, 2))
            };
            StageCosts { forward_s: mean(s, 0), backward_input_s: b, backward_weight_s: w }
        })
        .collect();
    CostModel::per_stage(stages).with_optimizer_step_s(if optimizer_n == 0 {
        0.0
    } else {
        optimizer_s / optimizer_n as f64
    })
}

#[cfg(test)]
mod tests {
    use conveyor_schedules::TimelineEvent;

    use super::*;

    fn event(device_idx: usize, op: OpKind, start_s: f64, end_s: f64) -> TimelineEvent {
        TimelineEvent { device_idx, stage_idx: Some(device_idx), op, micro_batch_idx: None, start_s, end_s }
    }

    #[test]
    fn an_all_reduce_beside_the_backward_pass_is_simulated_in_buckets() {
        let mut timeline = Timeline::new(2, 2);
        timeline.events = vec![
            event(0, OpKind::Backward, 0.0, 2.0),
            event(1, OpKind::Backward, 0.0, 1.0),
            event(1, OpKind::AllReduce, 1.0, 1.5),
            event(1, OpKind::OptimizerStep, 1.5, 2.0),
        ];
        // Device 1's all-reduce starts after its own last op: at the optimizer step.
        assert!(!all_reduce_in_buckets(&timeline));
        assert!(!span_costs(&timeline, 2).all_reduce_in_buckets());
        // Device 0's starts during its backward: in buckets.
        timeline.events.push(event(0, OpKind::AllReduce, 1.5, 2.5));
        assert!(all_reduce_in_buckets(&timeline));
        assert!(span_costs(&timeline, 2).all_reduce_in_buckets());
    }
}
