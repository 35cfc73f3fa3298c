//! Faults: an error or panic injected at every op kind on every stage, for every schedule, ends
//! the step with an error naming stage, op and micro-batch, leaves every weight bit-identical, and
//! the trainer runs the next step normally. Every test runs under a watchdog so none can hang.
mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{SCHEDULES, data, trainer, weights};
use conveyor::engine::Error;
use conveyor::engine::runtime::{FaultInjection, Recompute};
use conveyor::schedules::{OpKind, ScheduleKind};
use conveyor::zoo::mlp;

/// Runs `f` on a thread and fails the test if it does not finish within `limit`.
fn with_watchdog(limit: Duration, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(limit) {
        Ok(()) => handle.join().unwrap(),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(panic) = handle.join() {
                std::panic::resume_unwind(panic);
            }
        }
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("test hung for more than {limit:?}"),
    }
}

fn ops_of(kind: ScheduleKind) -> Vec<OpKind> {
    let mut ops = vec![OpKind::Forward, OpKind::OptimizerStep, OpKind::Recompute];
    if kind.splits_backward() {
        ops.extend([OpKind::BackwardInput, OpKind::BackwardWeight]);
    } else {
        ops.push(OpKind::Backward);
    }
    ops
}

#[test]
fn every_injected_fault_aborts_the_step_cleanly() {
    with_watchdog(Duration::from_secs(120), || {
        let n_devices = 2;
        let n_micro_batches = 4;
        let (x, y) = data(8, &[6], 10, 2);
        for (kind, chunks) in SCHEDULES {
            let n_stages = n_devices * chunks;
            let mut t = trainer(mlp(&[6, 8, 8, 8, 8, 10], 1).unwrap(), n_devices, kind, chunks, n_micro_batches, Recompute::Always);
            t.train_step(&x, &y).unwrap();
            for stage_idx in 0..n_stages {
                for op in ops_of(kind) {
                    for (micro_batch_idx, panic) in [(0, false), (n_micro_batches - 1, true)] {
                        let before = weights(&t);
                        t.inject_fault(Some(FaultInjection { stage_idx, op, micro_batch_idx, panic }));
                        let started = Instant::now();
                        let err = t.train_step(&x, &y).unwrap_err();
                        assert!(started.elapsed() < Duration::from_secs(1), "{kind}: abort took {:?}", started.elapsed());
                        match &err {
                            Error::StageFailed { stage_idx: s, op: name, micro_batch_idx: m, message, .. } => {
                                assert_eq!(*s, stage_idx, "{kind} {op:?}: {err}");
                                let expected_mb = (op != OpKind::OptimizerStep).then_some(micro_batch_idx);
                                assert_eq!(*m, expected_mb, "{kind} {op:?}: {err}");
                                assert!(!name.is_empty());
                                assert!(message.contains(if panic { "panicked" } else { "injected failure" }), "{err}");
                            }
                            other => panic!("{kind} {op:?}: expected StageFailed, got {other}"),
                        }
                        assert!(weights(&t) == before, "{kind}: weights changed after a fault at stage {stage_idx} {op:?}");
                        t.inject_fault(None);
                        t.train_step(&x, &y).unwrap();
                    }
                }
            }
        }
    });
}

#[test]
fn one_f_one_b_holds_p_over_m_of_gpipe_activations_on_stage_zero() {
    with_watchdog(Duration::from_secs(60), || {
        let (n_devices, n_micro_batches) = (4, 8);
        let (x, y) = data(64, &[16], 10, 3);
        let peak = |kind| {
            let mut t = trainer(mlp(&[16, 128, 128, 128, 128, 128, 128, 128, 10], 5).unwrap(), n_devices, kind, 1, n_micro_batches, Recompute::Never);
            t.train_step(&x, &y).unwrap().peak_activation_bytes[0] as f64
        };
        let ratio = peak(ScheduleKind::OneFOneB) / peak(ScheduleKind::GPipe);
        let expected = n_devices as f64 / n_micro_batches as f64;
        assert!((ratio - expected).abs() < 0.1, "1F1B / GPipe stage-0 activation peak {ratio:.3}, expected about {expected}");
    });
}
