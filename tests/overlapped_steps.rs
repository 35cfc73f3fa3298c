//! Overlapped steps with post-validation (`TrainerBuilder::overlap_steps`): `fit` launches each
//! next step before the last is validated and workers apply before the verdict, yet the weights,
//! the optimizer state, the reports and the errors are bit for bit those of synchronous steps, on
//! every schedule, with replicas, with clipping (a step that must be clipped is rolled back and
//! replayed), with a non-finite step, a fault or a stop mid-stream (the step after it is
//! abandoned and undone). Every test runs under a watchdog so none can hang.
mod common;

use std::ops::ControlFlow;
use std::sync::{Arc, mpsc};
use std::time::Duration;

use common::{SCHEDULES, data, even_stages};
use conveyor::engine::optim::{OptimizerConfig, SgdConfig, clips};
use conveyor::engine::runtime::{
    Batch, CoreSlotPolicy, FaultInjection, FaultPoint, Recompute, StallInjection, StepReport, Trainer, TrainerBuilder,
};
use conveyor::engine::{Device, Error, LossScaleConfig, Precision, Tensor};
use conveyor::layers::CrossEntropyLoss;
use conveyor::schedules::{OpKind, ScheduleKind};
use conveyor::zoo::mlp;

/// Runs `f` on a thread and fails the test if it does not finish within a minute.
fn with_watchdog(f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(()) => handle.join().unwrap(),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(panic) = handle.join() {
                std::panic::resume_unwind(panic);
            }
        }
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("test hung for more than a minute"),
    }
}

fn model() -> conveyor::engine::graph::Graph {
    mlp(&[6, 16, 16, 16, 10], 1).unwrap()
}

/// A trainer on `devices` CPU devices (`replicas` pipelines of `devices / replicas`).
fn builder(devices: usize, replicas: usize, kind: ScheduleKind, chunks: usize) -> TrainerBuilder {
    let graph = model();
    let stages = even_stages(&graph, devices / replicas * chunks);
    let builder = Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices((0..devices).map(Device::cpu).collect())
        .stages(stages)
        .schedule(kind, chunks)
        .micro_batches(4)
        .optimizer(OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.9)))
        .seed(11);
    if replicas > 1 { builder.data_parallel(replicas, |_, _| Ok(model())) } else { builder }
}

fn batches(n: usize) -> Vec<(Tensor, Vec<usize>)> {
    (0..n as u64).map(|seed| data(16, &[6], 10, seed)).collect()
}

fn copies(items: &[(Tensor, Vec<usize>)]) -> Vec<(Tensor, Vec<usize>)> {
    items
        .iter()
        .map(|(x, y)| (Tensor::from_vec(x.to_vec_f32(), x.dims().to_vec(), &Device::host()).unwrap(), y.clone()))
        .collect()
}

/// Parameters and optimizer state, bit for bit.
fn state(t: &Trainer) -> Vec<(String, Vec<u8>)> {
    let mut all: Vec<(String, Vec<u8>)> =
        t.parameters().unwrap().into_iter().map(|(n, t)| (n, t.to_le_bytes())).collect();
    all.extend(t.optimizer_state().unwrap().into_iter().map(|(n, t)| (n, t.to_le_bytes())));
    all
}

/// What a report says about the step that every run must agree on.
fn summary(report: &StepReport) -> (u64, u64) {
    (report.loss.to_bits(), report.grad_norm.to_bits())
}

/// `fit` over `items`, returning the reports' summaries and the result.
fn fit_all(t: &mut Trainer, items: Vec<(Tensor, Vec<usize>)>) -> (Vec<(u64, u64)>, conveyor::engine::Result<usize>) {
    let mut seen = Vec::new();
    let result = t.fit(items, |report| seen.push(summary(report))).map(|s| s.steps);
    (seen, result)
}

#[test]
fn overlapped_steps_train_the_bits_of_synchronous_steps_on_every_schedule() {
    with_watchdog(|| {
        for (kind, chunks) in SCHEDULES {
            for recompute in [Recompute::Never, Recompute::Always] {
                let mut sync = builder(2, 1, kind, chunks).recompute(recompute).build().unwrap();
                let mut overlapped =
                    builder(2, 1, kind, chunks).recompute(recompute).overlap_steps(true).build().unwrap();
                assert!(overlapped.overlaps_steps(), "{kind}: {:?}", overlapped.overlap_unavailable());
                assert!(!sync.overlaps_steps());
                let (a, ra) = fit_all(&mut sync, batches(6));
                let (b, rb) = fit_all(&mut overlapped, batches(6));
                assert_eq!((ra.unwrap(), rb.unwrap()), (6, 6), "{kind}");
                assert_eq!(a, b, "{kind} {recompute:?}: losses and norms");
                assert_eq!(state(&sync), state(&overlapped), "{kind} {recompute:?}: parameters and state");
                assert_eq!(overlapped.step_idx(), 6);
                // A synchronous step after an overlapped run starts from the same place.
                let (x, y) = data(16, &[6], 10, 99);
                let (p, q) = (sync.train_step(&x, &y).unwrap(), overlapped.train_step(&x, &y).unwrap());
                assert_eq!(summary(&p), summary(&q), "{kind}");
                assert_eq!(state(&sync), state(&overlapped), "{kind}: a step after the run");
            }
        }
    });
}

#[test]
fn overlapped_steps_keep_the_bits_on_the_v_schedules_and_with_tensor_parallel_stages() {
    with_watchdog(|| {
        // Every kind the common list lacks: two chunks per device in a V, and interleaved with
        // split backward; four micro-batches on two devices (`m >= 2p`).
        for (kind, chunks) in [(ScheduleKind::ZbV, 2), (ScheduleKind::DualPipeV, 2), (ScheduleKind::InterleavedZb, 2)] {
            let mut sync = builder(2, 1, kind, chunks).build().unwrap();
            let mut overlapped = builder(2, 1, kind, chunks).overlap_steps(true).build().unwrap();
            let (a, _) = fit_all(&mut sync, batches(5));
            let (b, _) = fit_all(&mut overlapped, batches(5));
            assert_eq!(a, b, "{kind}");
            assert_eq!(state(&sync), state(&overlapped), "{kind}");
        }
        // Two stages of two tensor-parallel shards each.
        let spec: conveyor::zoo::ModelSpec = "mlp:6,16,16,10".parse().unwrap();
        let split = |overlap: bool| {
            let mut t = common::split_trainer(&spec, 2, 2, ScheduleKind::OneFOneB, 4, OptimizerConfig::adam(0.01));
            t.set_overlap_steps(overlap);
            t
        };
        let (mut sync, mut overlapped) = (split(false), split(true));
        assert!(overlapped.overlaps_steps());
        let (a, _) = fit_all(&mut sync, batches(4));
        let (b, _) = fit_all(&mut overlapped, batches(4));
        assert_eq!(a, b, "tensor parallel");
        assert_eq!(state(&sync), state(&overlapped), "tensor parallel");
    });
}

#[test]
fn overlapped_steps_with_replicas_train_the_bits_of_synchronous_steps() {
    with_watchdog(|| {
        for (devices, replicas) in [(2, 2), (4, 2)] {
            let mut sync = builder(devices, replicas, ScheduleKind::OneFOneB, 1).build().unwrap();
            let mut overlapped =
                builder(devices, replicas, ScheduleKind::OneFOneB, 1).overlap_steps(true).build().unwrap();
            assert!(overlapped.overlaps_steps());
            let (a, _) = fit_all(&mut sync, batches(5));
            let (b, _) = fit_all(&mut overlapped, batches(5));
            assert_eq!(a, b, "{devices} devices, {replicas} replicas");
            assert_eq!(state(&sync), state(&overlapped), "{devices} devices, {replicas} replicas");
        }
    });
}

#[test]
fn a_step_that_must_be_clipped_is_replayed_and_equals_synchronous_clipping() {
    with_watchdog(|| {
        // The norms of an unclipped run, to put the limit between them: some steps clip, some not.
        let mut probe = builder(2, 1, ScheduleKind::ZbH1, 1).build().unwrap();
        let (norms, _) = fit_all(&mut probe, batches(8));
        let mut norms: Vec<f64> = norms.iter().map(|(_, n)| f64::from_bits(*n)).collect();
        norms.sort_by(f64::total_cmp);
        let limit = norms[norms.len() / 2];
        for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZbH1, ScheduleKind::ZbH2] {
            let mut sync = builder(2, 1, kind, 1).max_grad_norm(Some(limit)).build().unwrap();
            let mut overlapped = builder(2, 1, kind, 1).max_grad_norm(Some(limit)).overlap_steps(true).build().unwrap();
            let (a, _) = fit_all(&mut sync, batches(8));
            let (b, _) = fit_all(&mut overlapped, batches(8));
            let clipped = a.iter().filter(|(_, n)| f64::from_bits(*n) > limit).count();
            assert!((1..8).contains(&clipped), "{kind}: {clipped} of 8 steps clipped; the test needs a mix");
            assert_eq!(a, b, "{kind}: losses and norms");
            assert_eq!(state(&sync), state(&overlapped), "{kind}: parameters and state");
        }
    });
}

#[test]
fn after_a_step_that_clipped_the_steps_run_with_the_barrier_until_one_does_not_clip() {
    with_watchdog(|| {
        let mut probe = builder(2, 1, ScheduleKind::ZbH1, 1).build().unwrap();
        // A limit that is not a finite number of at least 0 is refused, when built and when set.
        assert!(builder(2, 1, ScheduleKind::ZbH1, 1).max_grad_norm(Some(-1.0)).build().is_err());
        assert!(probe.set_max_grad_norm(Some(f64::NAN)).is_err());
        assert_eq!(probe.max_grad_norm(), None, "a refused limit leaves the old one");
        let (norms, _) = fit_all(&mut probe, batches(8));
        let mut sorted: Vec<f64> = norms.iter().map(|(_, n)| f64::from_bits(*n)).collect();
        sorted.sort_by(f64::total_cmp);
        // Every step clips (0), none does (twice the largest norm), and a mix (the median).
        for limit in [0.0, 2.0 * sorted[7], sorted[4]] {
            let mut sync = builder(2, 1, ScheduleKind::ZbH1, 1).max_grad_norm(Some(limit)).build().unwrap();
            let (a, _) = fit_all(&mut sync, batches(8));
            let clips: Vec<bool> = a.iter().map(|(_, n)| clips(limit, f64::from_bits(*n))).collect();
            // A step runs optimistically when the one before it did not clip; such a step that
            // clips is replayed. So the replays are the clipping steps that follow a step that
            // did not clip (or come first).
            let expected = (0..8).filter(|&k| clips[k] && (k == 0 || !clips[k - 1])).count();
            let mut overlapped =
                builder(2, 1, ScheduleKind::ZbH1, 1).max_grad_norm(Some(limit)).overlap_steps(true).build().unwrap();
            let (mut b, mut replayed) = (Vec::new(), Vec::new());
            let fitted = overlapped
                .fit(batches(8), |report| {
                    b.push(summary(report));
                    replayed.push(report.replayed);
                })
                .unwrap();
            let expected_flags: Vec<bool> = (0..8).map(|k| clips[k] && (k == 0 || !clips[k - 1])).collect();
            assert_eq!(replayed, expected_flags, "limit {limit}: which reports say they were replayed");
            assert_eq!(a, b, "limit {limit}: losses and norms");
            assert_eq!(state(&sync), state(&overlapped), "limit {limit}: parameters and state");
            assert_eq!(fitted.replayed_steps, expected, "limit {limit}: steps that clip {clips:?}");
            let clipped = clips.iter().filter(|&&c| c).count();
            match limit {
                0.0 => assert_eq!((clipped, expected), (8, 1), "every step clips, one is replayed"),
                l if l > sorted[7] => assert_eq!(clipped, 0),
                _ => assert!((1..8).contains(&clipped), "the median limit clips some steps: {clips:?}"),
            }
        }
    });
}

#[test]
fn a_non_finite_step_mid_stream_is_refused_with_nothing_after_it_applied() {
    with_watchdog(|| {
        let mut items = batches(5);
        let (x, _) = &items[2];
        let mut values = x.to_vec_f32();
        values[6 * 3 + 1] = f32::NAN;
        items[2].0 = Tensor::from_vec(values, [16, 6], &Device::host()).unwrap();
        for (kind, chunks) in SCHEDULES {
            let mut sync = builder(2, 1, kind, chunks).build().unwrap();
            let mut overlapped = builder(2, 1, kind, chunks).overlap_steps(true).build().unwrap();
            let (a, ra) = fit_all(&mut sync, copies(&items));
            let (b, rb) = fit_all(&mut overlapped, copies(&items));
            assert!(matches!(ra, Err(Error::NonFiniteStep { step_idx: 2, .. })), "{kind}: {ra:?}");
            match rb {
                Err(Error::NonFiniteStep { step_idx: 2, .. }) => {}
                other => panic!("{kind}: expected the third step refused, got {other:?}"),
            }
            assert_eq!((a.len(), b.len()), (2, 2), "{kind}: two steps reported");
            assert_eq!(a, b, "{kind}");
            assert_eq!(overlapped.step_idx(), 2, "{kind}: the refused step and the one after it not counted");
            assert_eq!(state(&sync), state(&overlapped), "{kind}: nothing of steps 3 and 4 applied");
            // Both go on alike.
            let (c, _) = fit_all(&mut sync, batches(2));
            let (d, _) = fit_all(&mut overlapped, batches(2));
            assert_eq!(c, d, "{kind}");
            assert_eq!(state(&sync), state(&overlapped), "{kind}: after the refusal");
        }
    });
}

#[test]
fn a_fault_while_updates_run_ahead_changes_nothing_and_the_run_goes_on() {
    with_watchdog(|| {
        // Stage 1 finishes first in 1F1B and applies while stage 0 still works; stage 0's apply
        // (or prepare) then fails: stage 1's update, and any step it started, must be undone.
        for at in [FaultPoint::Apply, FaultPoint::Prepare, FaultPoint::Vote] {
            let mut sync = builder(2, 1, ScheduleKind::OneFOneB, 1).build().unwrap();
            let mut overlapped = builder(2, 1, ScheduleKind::OneFOneB, 1).overlap_steps(true).build().unwrap();
            fit_all(&mut sync, batches(2)).1.unwrap();
            fit_all(&mut overlapped, batches(2)).1.unwrap();
            let before = state(&overlapped);
            overlapped.inject_fault(Some(FaultInjection { stage_idx: 0, at, micro_batch_idx: 0, panic: false }));
            let (reports, result) = fit_all(&mut overlapped, batches(3));
            assert!(reports.is_empty(), "{at:?}: the first step already fails");
            let error = result.unwrap_err();
            assert!(matches!(error, Error::StageFailed { stage_idx: 0, .. }), "{at:?}: {error}");
            assert_eq!(state(&overlapped), before, "{at:?}: every update undone");
            assert_eq!(overlapped.step_idx(), 2);
            overlapped.inject_fault(None);
            let (a, _) = fit_all(&mut sync, batches(3));
            let (b, _) = fit_all(&mut overlapped, batches(3));
            assert_eq!(a, b, "{at:?}");
            assert_eq!(state(&sync), state(&overlapped), "{at:?}: trains on as if no fault happened");
        }
    });
}

#[test]
fn a_rolled_back_step_leaves_the_learning_rate_as_it_was() {
    with_watchdog(|| {
        // Steps that carry their own rate; the failing step's rate is set by stage 1 with its
        // update (1F1B: stage 1 finishes first; overlapped, it applies before stage 0's apply
        // fails). The rollback must put the rate back too: the next steps carry no rate, and run
        // at the one before the failed step, as on a trainer that never saw it.
        let at_rate =
            |items: Vec<(Tensor, Vec<usize>)>, lr: f64| items.into_iter().map(move |item| Batch::from(item).at_lr(lr));
        for overlap in [true, false] {
            let mut clean = builder(2, 1, ScheduleKind::OneFOneB, 1).overlap_steps(overlap).build().unwrap();
            let mut faulty = builder(2, 1, ScheduleKind::OneFOneB, 1).overlap_steps(overlap).build().unwrap();
            clean.fit(at_rate(batches(2), 0.02), |_| ()).unwrap();
            faulty.fit(at_rate(batches(2), 0.02), |_| ()).unwrap();
            let fault = FaultInjection { stage_idx: 0, at: FaultPoint::Apply, micro_batch_idx: 0, panic: false };
            faulty.inject_fault(Some(fault));
            let error = faulty.fit(at_rate(batches(1), 0.5), |_| ()).unwrap_err();
            assert!(matches!(error, Error::StageFailed { stage_idx: 0, .. }), "overlap {overlap}: {error}");
            faulty.inject_fault(None);
            assert_eq!(state(&clean), state(&faulty), "overlap {overlap}: the failed step undone");
            let (a, _) = fit_all(&mut clean, batches(3));
            let (b, _) = fit_all(&mut faulty, batches(3));
            assert_eq!(a, b, "overlap {overlap}: losses and norms");
            assert_eq!(state(&clean), state(&faulty), "overlap {overlap}: the steps after it ran at the old rate");
        }
    });
}

#[test]
fn stopping_mid_stream_undoes_the_step_already_started() {
    with_watchdog(|| {
        let mut sync = builder(2, 1, ScheduleKind::ZbH2, 1).build().unwrap();
        let mut overlapped = builder(2, 1, ScheduleKind::ZbH2, 1).overlap_steps(true).build().unwrap();
        let stop_after_two = |n: &mut usize| {
            *n += 1;
            if *n == 2 { ControlFlow::Break(()) } else { ControlFlow::Continue(()) }
        };
        let mut n = 0;
        let s = sync.fit(batches(5), |_| stop_after_two(&mut n)).unwrap();
        let mut n = 0;
        let o = overlapped.fit(batches(5), |_| stop_after_two(&mut n)).unwrap();
        assert_eq!((s.steps, o.steps, o.stopped_early), (2, 2, true));
        assert_eq!(overlapped.step_idx(), 2);
        assert_eq!(state(&sync), state(&overlapped), "the third step, started, left nothing behind");
        let (a, _) = fit_all(&mut sync, batches(2));
        let (b, _) = fit_all(&mut overlapped, batches(2));
        assert_eq!(a, b);
        assert_eq!(state(&sync), state(&overlapped));
    });
}

#[test]
fn a_batch_that_cannot_be_had_ends_the_run_after_the_steps_before_it() {
    with_watchdog(|| {
        let mut sync = builder(2, 1, ScheduleKind::OneFOneB, 1).build().unwrap();
        let mut overlapped = builder(2, 1, ScheduleKind::OneFOneB, 1).overlap_steps(true).build().unwrap();
        let items = || {
            batches(4).into_iter().enumerate().map(|(i, batch)| match i {
                2 => Err(Error::invalid("loader", "the third batch is unreadable")),
                _ => Ok(batch),
            })
        };
        let (mut a, mut b) = (0, 0);
        let ra = sync.fit(items(), |_| a += 1);
        let rb = overlapped.fit(items(), |_| b += 1);
        assert_eq!(ra.unwrap_err().to_string(), rb.unwrap_err().to_string());
        assert_eq!((a, b), (2, 2));
        assert_eq!(state(&sync), state(&overlapped));
        // A batch of too few rows for the micro-batches: refused as the step it would have been.
        let short = data(2, &[6], 10, 7);
        let mut items = batches(2);
        items.push(short);
        let (_, ra) = fit_all(&mut sync, copies(&items));
        let (_, rb) = fit_all(&mut overlapped, items);
        assert_eq!(ra.unwrap_err().to_string(), rb.unwrap_err().to_string());
        assert_eq!(state(&sync), state(&overlapped));
    });
}

#[test]
fn a_stage_without_an_undo_snapshot_keeps_steps_synchronous() {
    let t = builder(2, 1, ScheduleKind::OneFOneB, 1)
        .commit_snapshot(vec![true, false])
        .overlap_steps(true)
        .build()
        .unwrap();
    assert!(!t.overlaps_steps());
    assert!(t.overlap_unavailable().unwrap().contains("undo snapshot"));
}

#[test]
fn a_stage_starts_the_next_step_while_a_slower_one_still_finishes_this_one() {
    with_watchdog(|| {
        // Device 1 pauses 100 ms before its update every step. Device 0 has nothing left to wait
        // for by then: with overlap it applies and starts the next step's forwards during the
        // pause; synchronous, the next step waits for the pause to end.
        let starts_early = |overlap: bool| {
            let mut t = builder(2, 1, ScheduleKind::OneFOneB, 1).overlap_steps(overlap).build().unwrap();
            let last = t.schedule().programs()[1].len() - 1;
            t.inject_stall(Some(StallInjection { device_idx: 1, instruction_idx: last, seconds: 0.1 }));
            let mut reports = Vec::new();
            t.fit(batches(3), |report| reports.push(report.clone())).unwrap();
            let at = |r: &StepReport, device: usize, op: OpKind, first: bool| {
                let mut times = r.timeline.events.iter().filter(|e| e.device_idx == device && e.op == op);
                let event = if first { times.next() } else { times.next_back() }.expect("the op ran");
                r.started_s + if first { event.start_s } else { event.end_s }
            };
            (0..2).all(|k| {
                let update_ends = at(&reports[k], 1, OpKind::OptimizerStep, false);
                let next_starts = at(&reports[k + 1], 0, OpKind::Forward, true);
                next_starts < update_ends - 0.05
            })
        };
        assert!(starts_early(true), "overlapped: the next step's first forward runs during the pause");
        assert!(!starts_early(false), "synchronous: it waits for the pause to end");
    });
}

#[test]
fn overlapped_steps_keep_the_bits_with_core_slots_and_under_f16_loss_scaling() {
    with_watchdog(|| {
        // Four workers on two core slots: a worker waiting for a verdict holds no slot.
        let slots = || builder(4, 1, ScheduleKind::OneFOneB, 1).core_slots(CoreSlotPolicy::Slots(2));
        let (mut sync, mut overlapped) = (slots().build().unwrap(), slots().overlap_steps(true).build().unwrap());
        let (a, _) = fit_all(&mut sync, batches(5));
        let (b, _) = fit_all(&mut overlapped, batches(5));
        assert_eq!(a, b, "core slots");
        assert_eq!(state(&sync), state(&overlapped), "core slots");
        // f16: a scale so large that the first steps overflow (skipped, the scale halved), then
        // growth every 2 steps: each change comes after the next step was launched, which is
        // then launched again under the new scale.
        let f16 = || {
            builder(2, 1, ScheduleKind::OneFOneB, 1).precision(Precision::F16).loss_scale(LossScaleConfig {
                init_scale: 2f32.powi(22),
                growth_interval: 2,
                ..Default::default()
            })
        };
        let (mut sync, mut overlapped) = (f16().build().unwrap(), f16().overlap_steps(true).build().unwrap());
        let run = |t: &mut Trainer| {
            let mut seen = Vec::new();
            t.fit(batches(14), |r| seen.push((summary(r), r.skipped, r.loss_scale))).unwrap();
            seen
        };
        let (a, b) = (run(&mut sync), run(&mut overlapped));
        assert!(a.iter().any(|(_, skipped, _)| *skipped), "the test needs a skipped step: {a:?}");
        assert!(a.windows(2).any(|w| w[1].2 > w[0].2), "the test needs the scale to grow: {a:?}");
        assert_eq!(a, b, "f16: losses, skips and scales");
        assert_eq!(state(&sync), state(&overlapped), "f16");
    });
}
