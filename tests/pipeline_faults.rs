//! Faults: an error or panic injected at every point of a step (each compute op, each message sent
//! or received, the commit's prepare, vote and apply, the worker's own loop) on every stage, for
//! every schedule on 1, 2 and 4 devices and with tensor parallelism, ends the step with an error
//! naming stage, point and micro-batch within a second, leaves every parameter and optimizer state
//! bit-identical, and the trainer (or one resumed from its state) trains on bit for bit. Every
//! test runs under a watchdog so none can hang.
mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use std::sync::Arc;

use common::{SCHEDULES, data, even_stages, trainer};
use conveyor::engine::optim::OptimizerConfig;
use conveyor::engine::runtime::{FaultInjection, FaultPoint, Recompute, Trainer};
use conveyor::engine::{Device, Error, Tensor};
use conveyor::layers::CrossEntropyLoss;
use conveyor::schedules::{OpKind, ScheduleKind};
use conveyor::zoo::{ModelSpec, mlp};

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

/// Every point a fault can strike in a step of `kind`: its compute ops, its messages and the
/// commit's phases.
fn points_of(kind: ScheduleKind) -> Vec<FaultPoint> {
    let mut points = vec![
        FaultPoint::Op(OpKind::Forward),
        FaultPoint::Op(OpKind::Recompute),
        FaultPoint::Send,
        FaultPoint::Receive,
        FaultPoint::Prepare,
        FaultPoint::Vote,
        FaultPoint::Apply,
    ];
    if kind.splits_backward() {
        points.extend([FaultPoint::Op(OpKind::BackwardInput), FaultPoint::Op(OpKind::BackwardWeight)]);
    } else {
        points.push(FaultPoint::Op(OpKind::Backward));
    }
    points
}

/// Parameters and optimizer state, bit for bit.
fn full_state(t: &Trainer) -> Vec<(String, Vec<u8>)> {
    let mut all: Vec<(String, Vec<u8>)> =
        t.parameters().unwrap().into_iter().map(|(n, t)| (n, t.to_le_bytes())).collect();
    all.extend(t.optimizer_state().unwrap().into_iter().map(|(n, t)| (n, t.to_le_bytes())));
    all
}

/// How long each failed step took to return its error, for the figures printed at the end.
static ABORT_TIMES: std::sync::Mutex<Vec<f64>> = std::sync::Mutex::new(Vec::new());

/// Silences the default panic message of injected panics (each test still reports its own).
fn quiet_injected_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info.payload().downcast_ref::<&str>().copied().unwrap_or_default();
        if !message.starts_with("injected panic") && !message.starts_with("custom layer panics") {
            default(info);
        }
    }));
}

/// Injects `fault` into one step of `t` and checks the step ends in a typed error naming the
/// point within a second, with parameters and optimizer state bit-identical, and that the next
/// step trains (when `then_train`). Returns false when the point does not occur in this
/// configuration (the step then trained normally).
fn check_fault(t: &mut Trainer, x: &Tensor, y: &[usize], fault: FaultInjection, label: &str) -> bool {
    check_fault_then(t, x, y, fault, label, true)
}

fn check_fault_then(
    t: &mut Trainer,
    x: &Tensor,
    y: &[usize],
    fault: FaultInjection,
    label: &str,
    then_train: bool,
) -> bool {
    let before = full_state(t);
    t.inject_fault(Some(fault));
    let started = Instant::now();
    let outcome = t.train_step(x, y);
    let took = started.elapsed();
    t.inject_fault(None);
    let Err(err) = outcome else { return false };
    ABORT_TIMES.lock().unwrap().push(took.as_secs_f64());
    assert!(took < Duration::from_secs(1), "{label}: abort took {took:?}");
    match (&err, fault.at) {
        (Error::WorkerPanicked { message, .. }, FaultPoint::WorkerLoop) => {
            assert!(message.contains("injected panic"), "{label}: {err}");
        }
        (Error::StageFailed { stage_idx, op, micro_batch_idx, message, .. }, at) => {
            assert_eq!(*stage_idx, fault.stage_idx, "{label}: {err}");
            assert_eq!(op, at.name(), "{label}: {err}");
            let expected_mb = at.has_micro_batch().then_some(fault.micro_batch_idx);
            assert_eq!(*micro_batch_idx, expected_mb, "{label}: {err}");
            assert!(message.contains(if fault.panic { "panicked" } else { "injected failure" }), "{label}: {err}");
        }
        (other, _) => panic!("{label}: expected StageFailed, got {other}"),
    }
    assert!(full_state(t) == before, "{label}: parameters or optimizer state changed");
    if then_train {
        t.train_step(x, y).unwrap_or_else(|e| panic!("{label}: the next step failed: {e}"));
    }
    true
}

#[test]
fn every_injected_fault_aborts_the_step_cleanly() {
    quiet_injected_panics();
    with_watchdog(Duration::from_secs(240), || {
        let n_micro_batches = 4;
        let (x, y) = data(8, &[6], 10, 2);
        let mut struck = 0;
        for n_devices in [1, 2, 4] {
            for (kind, chunks) in SCHEDULES {
                let n_stages = n_devices * chunks;
                let model = mlp(&[6, 8, 8, 8, 8, 8, 8, 8, 10], 1).unwrap();
                let mut t = trainer(model, n_devices, kind, chunks, n_micro_batches, Recompute::Always);
                t.train_step(&x, &y).unwrap();
                for stage_idx in 0..n_stages {
                    for at in points_of(kind).into_iter().chain([FaultPoint::WorkerLoop]) {
                        for (micro_batch_idx, panic) in [(0, false), (n_micro_batches - 1, true)] {
                            if at == FaultPoint::WorkerLoop && !panic {
                                continue;
                            }
                            let label = format!("{kind} p={n_devices} stage {stage_idx} {at:?} panic={panic}");
                            let fault = FaultInjection { stage_idx, at, micro_batch_idx, panic };
                            if check_fault(&mut t, &x, &y, fault, &label) {
                                struck += 1;
                            } else {
                                // Only messages can be absent: a one-stage pipeline sends none.
                                let messages = matches!(at, FaultPoint::Send | FaultPoint::Receive);
                                assert!(messages && n_stages == 1, "{label}: the fault never struck");
                            }
                        }
                    }
                }
            }
        }
        assert!(struck > 500, "only {struck} faults struck");
        let mut times = ABORT_TIMES.lock().unwrap().clone();
        times.sort_by(f64::total_cmp);
        println!(
            "{struck} faults: error returned after median {:.2} ms, 99th percentile {:.2} ms, max {:.2} ms",
            times[times.len() / 2] * 1e3,
            times[times.len() * 99 / 100] * 1e3,
            times[times.len() - 1] * 1e3
        );
    });
}

#[test]
fn faults_in_tensor_parallel_stages_abort_cleanly() {
    quiet_injected_panics();
    with_watchdog(Duration::from_secs(120), || {
        let spec: ModelSpec = "mlp:6,8,8,8,10".parse().unwrap();
        let (x, y) = data(8, &spec.input_shape(), 10, 4);
        for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZbH1] {
            let mut t = split_trainer(&spec, 2, 2, kind);
            t.train_step(&x, &y).unwrap();
            for stage_idx in 0..2 {
                for at in points_of(kind) {
                    for (micro_batch_idx, panic) in [(0, false), (1, true)] {
                        let label = format!("{kind} tensor-parallel stage {stage_idx} {at:?} panic={panic}");
                        let fault = FaultInjection { stage_idx, at, micro_batch_idx, panic };
                        if at != FaultPoint::Op(OpKind::Recompute) {
                            assert!(check_fault(&mut t, &x, &y, fault, &label), "{label}: the fault never struck");
                        }
                    }
                }
            }
        }
    });
}

/// `n_stages` stages of `k` devices each over `spec`, every layer split over its stage's group.
fn split_trainer(spec: &ModelSpec, n_stages: usize, k: usize, kind: ScheduleKind) -> Trainer {
    common::split_trainer(spec, n_stages, k, kind, 2, OptimizerConfig::adam(1e-2))
}

/// A trainer with Adam (state in every field) over a 4-stage MLP.
fn adam_trainer(kind: ScheduleKind, chunks: usize) -> Trainer {
    let graph = mlp(&[6, 8, 8, 8, 8, 8, 8, 8, 10], 1).unwrap();
    let stages = even_stages(&graph, 2 * chunks);
    Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices(vec![Device::cpu(0), Device::cpu(1)])
        .stages(stages)
        .schedule(kind, chunks)
        .micro_batches(4)
        .optimizer(OptimizerConfig::adam(1e-2))
        .seed(11)
        .build()
        .unwrap()
}

#[test]
fn a_failed_apply_is_rolled_back_and_training_continues_bit_for_bit_also_after_a_resume() {
    quiet_injected_panics();
    with_watchdog(Duration::from_secs(60), || {
        for (kind, chunks) in SCHEDULES {
            let mut faulty = adam_trainer(kind, chunks);
            let mut clean = adam_trainer(kind, chunks);
            let batches: Vec<_> = (0..5).map(|seed| data(8, &[6], 10, seed)).collect();
            let mut resumed = None;
            for (step, (x, y)) in batches.iter().enumerate() {
                if step == 2 {
                    for (stage_idx, panic) in [(1, false), (2 * chunks - 1, true), (0, true)] {
                        let fault = FaultInjection { stage_idx, at: FaultPoint::Apply, micro_batch_idx: 0, panic };
                        let label = format!("{kind} apply stage {stage_idx}");
                        assert!(check_fault_then(&mut faulty, x, y, fault, &label, false));
                    }
                    // A checkpoint of the state right after the faults resumes bit for bit.
                    let mut fresh = adam_trainer(kind, chunks);
                    fresh.load_parameters(faulty.parameters().unwrap()).unwrap();
                    let dir = std::env::temp_dir().join(format!("conveyor-fault-resume-{}-{kind}", std::process::id()));
                    std::fs::create_dir_all(&dir).unwrap();
                    let path = dir.join("state.safetensors");
                    let state = faulty.optimizer_state().unwrap();
                    let named: Vec<(&str, &Tensor)> = state.iter().map(|(n, t)| (n.as_str(), t)).collect();
                    conveyor::engine::checkpoint::save(&path, &named).unwrap();
                    let checkpoint = conveyor::engine::checkpoint::load(&path, &Device::host()).unwrap();
                    std::fs::remove_dir_all(&dir).unwrap();
                    fresh.load_optimizer_state(checkpoint).unwrap();
                    fresh.set_step_idx(faulty.step_idx());
                    resumed = Some(fresh);
                }
                faulty.train_step(x, y).unwrap();
                clean.train_step(x, y).unwrap();
                if let Some(fresh) = resumed.as_mut() {
                    fresh.train_step(x, y).unwrap();
                }
            }
            let expected = full_state(&clean);
            assert!(full_state(&faulty) == expected, "{kind}: training after rolled-back faults differs");
            assert!(full_state(resumed.as_ref().unwrap()) == expected, "{kind}: the resumed run differs");
        }
    });
}

#[test]
fn a_failed_checkpoint_write_keeps_the_previous_checkpoint_and_resumes_bit_for_bit() {
    with_watchdog(Duration::from_secs(60), || {
        let dir = std::env::temp_dir().join(format!("conveyor-fault-checkpoint-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ck.safetensors");
        let save = |t: &Trainer| -> conveyor::engine::Result<()> {
            let all: Vec<(String, Tensor)> = t.parameters()?.into_iter().chain(t.optimizer_state()?).collect();
            let named: Vec<(&str, &Tensor)> = all.iter().map(|(n, t)| (n.as_str(), t)).collect();
            conveyor::engine::checkpoint::save(&path, &named)
        };
        let batches: Vec<_> = (0..5).map(|seed| data(8, &[6], 10, seed)).collect();
        let mut t = adam_trainer(ScheduleKind::ZbH1, 1);
        for (x, y) in &batches[..2] {
            t.train_step(x, y).unwrap();
        }
        save(&t).unwrap();
        let good = std::fs::read(&path).unwrap();
        t.train_step(&batches[2].0, &batches[2].1).unwrap();
        let state = full_state(&t);
        conveyor::engine::output_file::inject_write_fault(Some(good.len() as u64 / 2));
        let err = save(&t).unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "a typed I/O error: {err}");
        assert!(err.to_string().contains("injected write failure"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), good, "the previous checkpoint was damaged");
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left.len(), 1, "a temporary file was left behind: {left:?}");
        assert!(full_state(&t) == state, "a failed save changed the trainer");
        // Resume from the checkpoint that survived: the same steps give the same bits.
        let mut checkpoint = conveyor::engine::checkpoint::load(&path, &Device::host()).unwrap();
        let mut resumed = adam_trainer(ScheduleKind::ZbH1, 1);
        let names: Vec<String> = resumed.parameter_names().to_vec();
        let params: Vec<(String, Tensor)> = names.iter().map(|n| (n.clone(), checkpoint.take(n).unwrap())).collect();
        resumed.load_parameters(params).unwrap();
        resumed.load_optimizer_state(checkpoint).unwrap();
        resumed.set_step_idx(2);
        for (x, y) in &batches[2..] {
            resumed.train_step(x, y).unwrap();
        }
        for (x, y) in &batches[3..] {
            t.train_step(x, y).unwrap();
        }
        assert!(full_state(&resumed) == full_state(&t), "the resumed run differs");
        std::fs::remove_dir_all(&dir).unwrap();
    });
}

#[test]
fn one_f_one_b_holds_p_over_m_of_gpipe_activations_on_stage_zero() {
    with_watchdog(Duration::from_secs(60), || {
        let (n_devices, n_micro_batches) = (4, 8);
        let (x, y) = data(64, &[16], 10, 3);
        let peak = |kind| {
            let mut t = trainer(
                mlp(&[16, 128, 128, 128, 128, 128, 128, 128, 10], 5).unwrap(),
                n_devices,
                kind,
                1,
                n_micro_batches,
                Recompute::Never,
            );
            t.train_step(&x, &y).unwrap().peak_activation_bytes[0] as f64
        };
        let ratio = peak(ScheduleKind::OneFOneB) / peak(ScheduleKind::GPipe);
        let expected = n_devices as f64 / n_micro_batches as f64;
        assert!(
            (ratio - expected).abs() < 0.1,
            "1F1B / GPipe stage-0 activation peak {ratio:.3}, expected about {expected}"
        );
    });
}
