//! Property tests over every schedule kind, 1..=8 devices, 1..=32 micro-batches and 1..=4
//! chunks: defined shapes validate under bounded channels and simulate to completion; undefined
//! shapes are rejected with the right error; overlapped steps never take longer than synchronous
//! ones (1..=4 devices, 1..=8 micro-batches). Failures persist to
//! `schedules/proptest-regressions/properties.txt` (commit it).
use conveyor_schedules::{
    CostModel, Instruction, Link, OpKind, Schedule, ScheduleError, ScheduleKind, StageCosts, StepOverlap, simulate,
    simulate_steps, validate,
};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/proptest-regressions/properties.txt"
        )))),
        ..ProptestConfig::default()
    }
}

fn kind() -> impl Strategy<Value = ScheduleKind> {
    prop::sample::select(ScheduleKind::ALL.to_vec())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn defined_schedules_validate_and_simulate(
        kind in kind(),
        n_devices in 1usize..=8,
        n_micro_batches in 1usize..=32,
        n_chunks in 1usize..=4,
        capacity in 2usize..=16,
        forward_s in 0.5f64..2.0,
        backward_s in 0.5f64..2.0,
    ) {
        // Make the shape defined: one chunk unless the kind takes several, two for the V kinds,
        // whole groups of micro-batches for interleaved, two per device for DualPipe-V.
        let n_chunks = kind.required_chunks().unwrap_or(if kind.supports_chunks() { n_chunks } else { 1 });
        let n_micro_batches = match kind {
            ScheduleKind::Interleaved if n_chunks > 1 => n_micro_batches.next_multiple_of(n_devices),
            ScheduleKind::DualPipeV => n_micro_batches.max(2 * n_devices),
            _ => n_micro_batches,
        };
        let schedule = Schedule::new(kind, n_devices, n_micro_batches, n_chunks).unwrap();
        validate(&schedule, 1).map_err(|err| TestCaseError::fail(format!("capacity 1: {err}")))?;
        validate(&schedule, capacity).map_err(|err| TestCaseError::fail(format!("capacity {capacity}: {err}")))?;

        let costs = CostModel::uniform(StageCosts::new(forward_s, backward_s, backward_s / 2.0));
        let report = simulate(&schedule, &costs).map_err(|err| TestCaseError::fail(err.to_string()))?;
        let n_instructions: usize = schedule.programs().iter().map(Vec::len).sum();
        let n_compute = report.timeline.events.iter().filter(|event| event.op.is_compute()).count();
        prop_assert_eq!(n_compute, n_instructions);
        prop_assert!(report.bubble_fraction >= -1e-9 && report.bubble_fraction < 1.0);
        // Every stage holds at least one and at most m micro-batches.
        prop_assert!(report.peak_inflight.iter().all(|&peak| (1..=n_micro_batches).contains(&peak)));
        // The optimizer step is last on every device and every device runs.
        for program in schedule.programs() {
            prop_assert_eq!(program.last(), Some(&Instruction::OptimizerStep));
        }
        prop_assert!(report.timeline.events.iter().any(|event| event.op == OpKind::OptimizerStep));
    }

    #[test]
    fn undefined_shapes_are_rejected(
        kind in kind(),
        n_devices in 0usize..=8,
        n_micro_batches in 0usize..=32,
        n_chunks in 0usize..=4,
    ) {
        let result = Schedule::new(kind, n_devices, n_micro_batches, n_chunks);
        let zero = n_devices == 0 || n_micro_batches == 0 || n_chunks == 0;
        let chunks_unsupported = n_chunks > 1 && !kind.supports_chunks();
        let chunks_wrong = kind.required_chunks().is_some_and(|required| n_chunks != required);
        let too_few = kind == ScheduleKind::DualPipeV && n_micro_batches < 2 * n_devices;
        let ragged = kind == ScheduleKind::Interleaved
            && n_chunks > 1
            && n_devices > 0
            && n_micro_batches % n_devices != 0;
        match result {
            Err(ScheduleError::ZeroParameter { .. }) => prop_assert!(zero),
            Err(ScheduleError::ChunksUnsupported { .. }) => prop_assert!(!zero && chunks_unsupported),
            Err(ScheduleError::ChunksRequired { .. }) => prop_assert!(!zero && chunks_wrong),
            Err(ScheduleError::TooFewMicroBatches { .. }) => prop_assert!(!zero && !chunks_wrong && too_few),
            Err(ScheduleError::MicroBatchesNotMultipleOfDevices { .. }) => {
                prop_assert!(!zero && !chunks_unsupported && ragged)
            }
            Err(err) => prop_assert!(false, "unexpected error {err}"),
            Ok(schedule) => {
                prop_assert!(!zero && !chunks_unsupported && !chunks_wrong && !too_few && !ragged);
                prop_assert!(validate(&schedule, 1).is_ok());
            }
        }
    }

    #[test]
    fn overlapped_steps_are_never_slower(
        kind in kind(),
        n_devices in 1usize..=4,
        n_micro_batches in 1usize..=8,
        n_steps in 2usize..=4,
        forward_s in 0.0f64..2.0,
        backward_s in 0.0f64..2.0,
        optimizer_step_s in 0.0f64..2.0,
        commit_latency_s in 0.0f64..2.0,
        link_latency_s in 0.0f64..0.5,
    ) {
        let n_chunks = kind.required_chunks().unwrap_or(if kind.supports_chunks() { 2 } else { 1 });
        let n_micro_batches = match kind {
            ScheduleKind::Interleaved => n_micro_batches.next_multiple_of(n_devices),
            ScheduleKind::DualPipeV => n_micro_batches.max(2 * n_devices),
            _ => n_micro_batches,
        };
        let schedule = Schedule::new(kind, n_devices, n_micro_batches, n_chunks).unwrap();
        let costs = CostModel::uniform(StageCosts::new(forward_s, backward_s, backward_s / 2.0))
            .with_link(Link { latency_s: link_latency_s, bandwidth_bytes_per_s: f64::INFINITY })
            .with_optimizer_step_s(optimizer_step_s)
            .with_commit_latency_s(commit_latency_s);
        let run = |overlap| simulate_steps(&schedule, &costs, n_steps, overlap).map_err(|err| TestCaseError::fail(err.to_string()));
        let (sync, overlapped) = (run(StepOverlap::Synchronous)?, run(StepOverlap::Overlapped)?);
        // Relaxing a wait never delays an op: every step ends no later, and the last step's
        // period is at most the synchronous step.
        prop_assert!(overlapped.step_period_s <= sync.step_period_s + 1e-9, "{} > {}", overlapped.step_period_s, sync.step_period_s);
        prop_assert!(overlapped.makespan_s <= sync.makespan_s + 1e-9);
        for (o, s) in overlapped.steps.iter().zip(&sync.steps) {
            prop_assert!(o.end_s <= s.end_s + 1e-9);
        }
        let n_compute = |events: &[conveyor_schedules::TimelineEvent]| events.iter().filter(|e| e.op.is_compute()).count();
        prop_assert_eq!(n_compute(&overlapped.timeline.events), n_compute(&sync.timeline.events));
    }
}
