//! Several optimizer steps in a row: [`simulate_steps`] times `n` consecutive steps of one
//! schedule, synchronous (a barrier between steps) or overlapped (apply first, validate after),
//! and reports their combined timeline and the step period in steady state.
//!
//! Model, composing the one-step loop of [`crate::simulate`] step by step (each step's messages
//! follow the schedule's dependencies within that step; devices start it at the times below):
//! - **Synchronous** (the runtime's default): each step is timed as [`crate::simulate`] times it,
//!   its optimizer steps waiting for the commit (every device has voted, plus the device's commit
//!   latency); step `k + 1` starts on every device when the last device has finished step `k`'s
//!   optimizer step.
//! - **Overlapped** (`TrainerBuilder::overlap_steps(true)`): a device applies its update as soon
//!   as it has voted (after its all-reduce, if any), without waiting for the commit, and starts
//!   step `k + 1` when it has finished its own step `k`. The one wait left on the coordinator is
//!   the runtime's: before it applies step `k + 1`, a device waits for step `k`'s verdict (step
//!   `k`'s commit plus its commit latency), which rarely binds as a whole step lies between.
//!
//! Every start time in either mode is a maximum of earlier times plus costs, so relaxing a wait
//! never delays an op: the overlapped run ends no later than the synchronous one, and its period
//! (between the ends of the last two steps) is at most the synchronous step's length.
use std::ops::Range;

use serde::Serialize;

use crate::cost::CostModel;
use crate::error::ScheduleError;
use crate::schedule::Schedule;
use crate::simulate::{OptimizerWait, simulate_step};
use crate::timeline::{OpKind, Timeline};

/// How consecutive optimizer steps follow each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepOverlap {
    /// A barrier between steps: the optimizer steps wait for the commit, and the next step
    /// starts on every device once the last device has applied.
    Synchronous,
    /// Apply first, validate after: each device applies once it has voted and starts its next
    /// step once it has applied.
    Overlapped,
}

/// One step of a multi-step run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepSpan {
    /// When the first device started the step, seconds.
    pub start_s: f64,
    /// When the last device finished the step's optimizer step, seconds.
    pub end_s: f64,
    /// When every device had voted (the commit, or with overlapped steps the verdict, leaves
    /// then), seconds.
    pub commit_s: f64,
    /// The step's events: `timeline.events[events]` of the [`StepsReport`].
    pub events: Range<usize>,
}

/// The simulated timeline of several consecutive steps, with the figures derived from it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepsReport {
    /// How the steps followed each other.
    pub overlap: StepOverlap,
    /// Seconds from one step's end to the next in steady state: between the ends of the last
    /// two steps; with one step, from the run's first start to the step's end.
    pub step_period_s: f64,
    /// First compute start to last compute end over all steps, seconds.
    pub makespan_s: f64,
    /// Idle over `n_devices * makespan` over the whole run, compute ops counting as busy.
    pub bubble_fraction: f64,
    /// Compute seconds per device over the whole run, device 0 first.
    pub busy_s: Vec<f64>,
    /// Each step, the first first.
    pub steps: Vec<StepSpan>,
    /// Every event of every step, at run times, step after step (see [`StepSpan::events`]).
    pub timeline: Timeline,
}

/// Simulates `n_steps` consecutive optimizer steps of `schedule` under `costs`, following each
/// other as `overlap` says. The first step starts each device at
/// [`CostModel::device_start_s`]; later steps start as the module documentation says.
///
/// Errors: `n_steps == 0` ([`ScheduleError::ZeroParameter`]), and those of
/// [`crate::simulate`].
pub fn simulate_steps(
    schedule: &Schedule,
    costs: &CostModel,
    n_steps: usize,
    overlap: StepOverlap,
) -> Result<StepsReport, ScheduleError> {
    if n_steps == 0 {
        return Err(ScheduleError::ZeroParameter { parameter: "n_steps", noun: "optimizer step" });
    }
    let n_devices = schedule.n_devices();
    let mut timeline = Timeline::new(n_devices, schedule.n_stages());
    let mut steps: Vec<StepSpan> = Vec::with_capacity(n_steps);
    let mut step_costs = costs.clone();
    let mut starts: Vec<f64> = (0..n_devices).map(|d| costs.device_start_s(d)).collect();
    // With overlapped steps: when the previous step's verdict reaches each device.
    let mut verdicts: Vec<f64> = Vec::new();
    for _ in 0..n_steps {
        step_costs = step_costs.with_device_start_s(starts.clone());
        let wait = match overlap {
            StepOverlap::Synchronous => OptimizerWait::Commit,
            StepOverlap::Overlapped => OptimizerWait::NotBefore(&verdicts),
        };
        let step = simulate_step(schedule, &step_costs, wait)?;
        let ends: Vec<f64> = (0..n_devices).map(|d| device_end_s(&step.timeline, d, starts[d])).collect();
        let first = timeline.events.len();
        timeline.events.extend(step.timeline.events);
        steps.push(StepSpan {
            start_s: starts.iter().copied().fold(f64::INFINITY, f64::min),
            end_s: ends.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            commit_s: step.commit_s,
            events: first..timeline.events.len(),
        });
        starts = match overlap {
            StepOverlap::Synchronous => vec![ends.iter().copied().fold(0.0, f64::max); n_devices],
            StepOverlap::Overlapped => ends,
        };
        verdicts = (0..n_devices).map(|d| step.commit_s + costs.device_commit_latency_s(d)).collect();
    }
    let step_period_s = match steps.as_slice() {
        [.., before, last] => last.end_s - before.end_s,
        [only] => only.end_s - only.start_s,
        [] => 0.0,
    };
    Ok(StepsReport {
        overlap,
        step_period_s,
        makespan_s: timeline.makespan_s(),
        bubble_fraction: timeline.bubble_fraction(),
        busy_s: timeline.busy_s(),
        steps,
        timeline,
    })
}

/// When `device_idx` finished its step: the end of its last op (its optimizer step, which may
/// take no time), or `start_s` for a device without ops. Messages in transit do not count.
fn device_end_s(timeline: &Timeline, device_idx: usize, start_s: f64) -> f64 {
    timeline
        .events
        .iter()
        .filter(|event| event.device_idx == device_idx && event.op != OpKind::Send)
        .map(|event| event.end_s)
        .fold(start_s, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::StageCosts;
    use crate::kind::ScheduleKind;
    use crate::simulate::simulate;

    const EPS: f64 = 1e-9;

    /// A defined shape of `kind` on `n_devices` devices with about `n_micro_batches`.
    fn schedule(kind: ScheduleKind, n_devices: usize, n_micro_batches: usize) -> Schedule {
        let n_chunks = kind.required_chunks().unwrap_or(if kind.supports_chunks() { 2 } else { 1 });
        let n_micro_batches = match kind {
            ScheduleKind::Interleaved if n_chunks > 1 => n_micro_batches.next_multiple_of(n_devices),
            ScheduleKind::DualPipeV => n_micro_batches.max(2 * n_devices),
            _ => n_micro_batches,
        };
        Schedule::new(kind, n_devices, n_micro_batches, n_chunks).unwrap()
    }

    fn assert_close(got: &[f64], expected: &[f64]) {
        assert_eq!(got.len(), expected.len(), "{got:?} against {expected:?}");
        assert!(got.iter().zip(expected).all(|(a, b)| (a - b).abs() < EPS), "{got:?} against {expected:?}");
    }

    fn costs(optimizer_step_s: f64, commit_latency_s: f64) -> CostModel {
        CostModel::uniform(StageCosts::UNIT)
            .with_optimizer_step_s(optimizer_step_s)
            .with_commit_latency_s(commit_latency_s)
    }

    #[test]
    fn one_step_is_the_one_step_simulation() {
        for kind in ScheduleKind::ALL {
            let schedule = schedule(kind, 4, 8);
            let costs = costs(0.5, 0.25);
            let one = simulate(&schedule, &costs).unwrap();
            let sync = simulate_steps(&schedule, &costs, 1, StepOverlap::Synchronous).unwrap();
            assert_eq!(sync.timeline, one.timeline, "{kind}");
            assert_eq!(sync.makespan_s, one.makespan_s, "{kind}");
            assert_eq!(sync.step_period_s, one.makespan_s, "{kind}");
            // Uniform optimizer steps: the last device to vote applies last, 0.25 s sooner.
            let overlapped = simulate_steps(&schedule, &costs, 1, StepOverlap::Overlapped).unwrap();
            assert!((overlapped.makespan_s - (one.makespan_s - 0.25)).abs() < EPS, "{kind}");
            assert!((overlapped.step_period_s - overlapped.makespan_s).abs() < EPS, "{kind}");
            // Without a commit latency nothing waits on the commit past the last vote.
            let no_latency = costs.clone().with_commit_latency_s(0.0);
            let overlapped = simulate_steps(&schedule, &no_latency, 1, StepOverlap::Overlapped).unwrap();
            assert!((overlapped.makespan_s - simulate(&schedule, &no_latency).unwrap().makespan_s).abs() < EPS);
            // The votes come before any optimizer step: the same in both modes.
            assert_eq!(overlapped.steps[0].commit_s, sync.steps[0].commit_s);
        }
    }

    #[test]
    fn synchronous_steps_repeat_the_step() {
        for kind in ScheduleKind::ALL {
            for n_devices in [1, 2, 4] {
                let schedule = schedule(kind, n_devices, 8);
                let costs = costs(0.5, 0.25);
                let step_s = simulate(&schedule, &costs).unwrap().makespan_s;
                let report = simulate_steps(&schedule, &costs, 3, StepOverlap::Synchronous).unwrap();
                assert!((report.makespan_s - 3.0 * step_s).abs() < EPS, "{kind} p={n_devices}");
                assert!((report.step_period_s - step_s).abs() < EPS, "{kind} p={n_devices}");
                let n_events = report.steps[0].events.len();
                assert!(report.steps.iter().all(|step| step.events.len() == n_events));
                assert_eq!(report.steps[2].events.end, report.timeline.events.len());
                // Each step starts on every device when the previous one ended.
                assert_eq!(report.steps[1].start_s, report.steps[0].end_s);
            }
        }
    }

    #[test]
    fn overlapped_steps_hide_the_commit_latency_of_1f1b_and_zb_h2() {
        for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZbH2] {
            for n_devices in [2, 4] {
                let schedule = schedule(kind, n_devices, 8);
                let costs = costs(0.5, 0.25);
                let sync = simulate_steps(&schedule, &costs, 4, StepOverlap::Synchronous).unwrap();
                let overlapped = simulate_steps(&schedule, &costs, 4, StepOverlap::Overlapped).unwrap();
                assert!(
                    overlapped.step_period_s < sync.step_period_s - 0.1,
                    "{kind} p={n_devices}: {} against {}",
                    overlapped.step_period_s,
                    sync.step_period_s
                );
                assert!(overlapped.makespan_s < sync.makespan_s);
                assert!(overlapped.bubble_fraction < sync.bubble_fraction);
            }
        }
    }

    #[test]
    fn hand_timeline_of_two_devices() {
        // 1F1B, 2 devices, 2 micro-batches, F = B = 1 with W folded into B (fused backward 1),
        // optimizer step 0.5, commit latency 0.1. One step, from 0:
        //   dev0: F0 [0,1] F1 [1,2] . B0 [3,4] . B1 [5,6]      (votes at 6)
        //   dev1: .  F0 [1,2] B0 [2,3] F1 [3,4] B1 [4,5]       (votes at 5)
        // Synchronous: the commit leaves at 6, reaches both at 6.1; both apply over [6.1, 6.6];
        // step 2 starts at 6.6 on both and repeats the step: period 6.6.
        // Overlapped: dev1 applies over [5, 5.5], dev0 over [6, 6.5]. Step 2: dev0 starts at
        // 6.5 (F0 [6.5,7.5]), dev1 is idle from 5.5 until F0 arrives at 7.5, and the step
        // repeats 6.5 s later (dev0's applies end at 6.5, 13, 19.5; the verdict of the step
        // before, 0.1 after its last vote, is long in by then): period 6.5, the commit latency
        // less than synchronous.
        let schedule = Schedule::new(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
        let costs =
            CostModel::uniform(StageCosts::new(1.0, 1.0, 0.0)).with_optimizer_step_s(0.5).with_commit_latency_s(0.1);
        let sync = simulate_steps(&schedule, &costs, 3, StepOverlap::Synchronous).unwrap();
        assert!((sync.step_period_s - 6.6).abs() < EPS, "{}", sync.step_period_s);
        assert_close(&sync.steps.iter().map(|step| step.commit_s).collect::<Vec<_>>(), &[6.0, 12.6, 19.2]);
        assert_close(&sync.steps.iter().map(|step| step.end_s).collect::<Vec<_>>(), &[6.6, 13.2, 19.8]);
        let overlapped = simulate_steps(&schedule, &costs, 3, StepOverlap::Overlapped).unwrap();
        assert!((overlapped.step_period_s - 6.5).abs() < EPS, "{}", overlapped.step_period_s);
        assert_close(&overlapped.steps.iter().map(|step| step.end_s).collect::<Vec<_>>(), &[6.5, 13.0, 19.5]);
        assert!((overlapped.makespan_s - 19.5).abs() < EPS);
        // Step 2 on dev1 starts at 5.5; its first forward waits for dev0's, at 7.5.
        assert_eq!(overlapped.steps[1].start_s, 5.5);
        let dev1_forward = overlapped.timeline.events[overlapped.steps[1].events.clone()]
            .iter()
            .find(|event| event.device_idx == 1 && event.op == OpKind::Forward)
            .unwrap();
        assert_eq!((dev1_forward.start_s, dev1_forward.end_s), (7.5, 8.5));
    }

    #[test]
    fn the_verdict_of_the_step_before_bounds_the_apply() {
        // One device, one micro-batch, F = B = W = 0, optimizer step 1, commit latency 5: each
        // step votes as it starts, and applies only once the verdict of the step before is in.
        let schedule = Schedule::new(ScheduleKind::GPipe, 1, 1, 1).unwrap();
        let costs =
            CostModel::uniform(StageCosts::new(0.0, 0.0, 0.0)).with_optimizer_step_s(1.0).with_commit_latency_s(5.0);
        let report = simulate_steps(&schedule, &costs, 3, StepOverlap::Overlapped).unwrap();
        // Step 1 applies over [0, 1]; step 2 votes at 1, waits for step 1's verdict (0 + 5),
        // applies over [5, 6]; step 3 votes at 6, waits for 1 + 5 = 6 (no wait): [6, 7].
        assert_eq!(report.steps.iter().map(|step| step.end_s).collect::<Vec<_>>(), vec![1.0, 6.0, 7.0]);
        assert_eq!(report.steps.iter().map(|step| step.commit_s).collect::<Vec<_>>(), vec![0.0, 1.0, 6.0]);
        let sync = simulate_steps(&schedule, &costs, 3, StepOverlap::Synchronous).unwrap();
        assert_eq!(sync.steps.iter().map(|step| step.end_s).collect::<Vec<_>>(), vec![6.0, 12.0, 18.0]);
    }

    #[test]
    fn zero_steps_are_refused() {
        let schedule = Schedule::new(ScheduleKind::GPipe, 2, 1, 1).unwrap();
        let err = simulate_steps(&schedule, &CostModel::default(), 0, StepOverlap::Synchronous).unwrap_err();
        assert!(matches!(err, ScheduleError::ZeroParameter { parameter: "n_steps", .. }), "{err}");
        let negative = CostModel::default().with_commit_latency_s(-1.0);
        let err = simulate_steps(&schedule, &negative, 2, StepOverlap::Overlapped).unwrap_err();
        assert!(matches!(err, ScheduleError::InvalidCost { .. }), "{err}");
    }
}
