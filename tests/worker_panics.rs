//! A panic anywhere ends the step cleanly in under a second: a custom layer panicking in its
//! forward, either backward half or the optimizer step (its `refresh`), a user callback panicking
//! on a worker, and the worker's own loop panicking each end in a typed error naming the device and
//! the panic message; the other workers stop, nothing is committed, the trainer trains on, and a
//! dropped trainer leaves no worker thread behind. One test, run serially, so the thread count is
//! this test's own.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use common::data;
use conveyor::engine::graph::Graph;
use conveyor::engine::optim::OptimizerConfig;
use conveyor::engine::runtime::{FaultInjection, FaultPoint, Trainer};
use conveyor::engine::{Device, Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor, init};
use conveyor::layers::{CrossEntropyLoss, Linear, Relu};
use conveyor::schedules::ScheduleKind;

const NONE: u8 = 0;
const FORWARD: u8 = 1;
const BACKWARD_INPUT: u8 = 2;
const BACKWARD_WEIGHT: u8 = 3;
const REFRESH: u8 = 4;

/// A Linear that panics in the call `mode` names.
#[derive(Debug)]
struct PanickingLinear {
    inner: Linear,
    mode: Arc<AtomicU8>,
}

impl PanickingLinear {
    fn maybe_panic(&self, when: u8) {
        if self.mode.load(Ordering::SeqCst) == when {
            panic!("custom layer panics in call {when}");
        }
    }
}

impl Layer for PanickingLinear {
    fn kind(&self) -> &'static str {
        "PanickingLinear"
    }
    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        self.inner.output_shape(input_shapes)
    }
    fn parameters(&self) -> &[Parameter] {
        self.inner.parameters()
    }
    fn parameters_mut(&mut self) -> &mut [Parameter] {
        self.inner.parameters_mut()
    }
    fn forward(&self, inputs: &[&Tensor], ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        self.maybe_panic(FORWARD);
        self.inner.forward(inputs, ctx)
    }
    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        self.maybe_panic(BACKWARD_INPUT);
        self.inner.backward_input(saved, grad_output)
    }
    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()> {
        self.maybe_panic(BACKWARD_WEIGHT);
        self.inner.backward_weight(saved, grad_output, param_grads)
    }
    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        self.inner.cost(input_shapes)
    }
    fn refresh(&mut self) -> Result<()> {
        self.maybe_panic(REFRESH);
        self.inner.refresh()
    }
}

fn trainer(mode: &Arc<AtomicU8>, kind: ScheduleKind) -> Trainer {
    let mut rng = init::rng(0);
    let mut g = Graph::new();
    let x = g.input("x", [6]).unwrap();
    let h = g.add("fc1", Linear::new(6, 8, true, &mut rng).unwrap(), &[x]).unwrap();
    let h = g.add("relu", Relu::new(), &[h]).unwrap();
    let custom = PanickingLinear { inner: Linear::new(8, 8, true, &mut rng).unwrap(), mode: Arc::clone(mode) };
    let h = g.add("custom", custom, &[h]).unwrap();
    let y = g.add("fc2", Linear::new(8, 10, true, &mut rng).unwrap(), &[h]).unwrap();
    g.set_output(y).unwrap();
    let stages = vec![
        vec![g.find("fc1").unwrap(), g.find("relu").unwrap()],
        vec![g.find("custom").unwrap(), g.find("fc2").unwrap()],
    ];
    Trainer::builder(g, Arc::new(CrossEntropyLoss::new()))
        .devices(vec![Device::cpu(0), Device::cpu(1)])
        .stages(stages)
        .schedule(kind, 1)
        .micro_batches(4)
        .optimizer(OptimizerConfig::adam(1e-2))
        .build()
        .unwrap()
}

fn full_state(t: &Trainer) -> Vec<(String, Vec<u8>)> {
    let mut all: Vec<(String, Vec<u8>)> =
        t.parameters().unwrap().into_iter().map(|(n, t)| (n, t.to_le_bytes())).collect();
    all.extend(t.optimizer_state().unwrap().into_iter().map(|(n, t)| (n, t.to_le_bytes())));
    all
}

/// Worker threads of any trainer alive in this process.
fn worker_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|name| name.starts_with("conveyor-"))
                .count()
        })
        .unwrap_or(0)
}

#[test]
fn a_panic_anywhere_ends_the_step_cleanly_and_leaves_no_thread() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info.payload().downcast_ref::<String>().map(String::as_str).unwrap_or_default();
        let static_message = info.payload().downcast_ref::<&str>().copied().unwrap_or_default();
        if !message.starts_with("custom layer panics") && !static_message.starts_with("injected panic") {
            default_hook(info);
        }
    }));
    let (x, y) = data(8, &[6], 10, 1);
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZbH2] {
        let mode = Arc::new(AtomicU8::new(NONE));
        let mut t = trainer(&mode, kind);
        t.train_step(&x, &y).unwrap();
        for when in [FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, REFRESH] {
            let before = full_state(&t);
            mode.store(when, Ordering::SeqCst);
            let started = Instant::now();
            let err = t.train_step(&x, &y).unwrap_err();
            let took = started.elapsed();
            mode.store(NONE, Ordering::SeqCst);
            assert!(took < Duration::from_secs(1), "{kind} call {when}: the error took {took:?}");
            match &err {
                Error::StageFailed { stage_idx: 1, device, message, .. } => {
                    assert_eq!(device, "cpu:1", "{err}");
                    assert!(message.contains(&format!("custom layer panics in call {when}")), "{err}");
                }
                other => panic!("{kind} call {when}: expected StageFailed on stage 1, got {other}"),
            }
            assert!(full_state(&t) == before, "{kind} call {when}: something was committed");
            t.train_step(&x, &y).unwrap();
        }
        // A user callback panicking on a worker: a typed error, and the worker lives on.
        let err = t.with_optimizers(|_, _| -> () { panic!("custom layer panics in a callback") }).unwrap_err();
        assert!(matches!(&err, Error::WorkerPanicked { message, .. } if message.contains("in a callback")), "{err}");
        t.train_step(&x, &y).unwrap();
        // The worker's own loop panicking, outside any op.
        let before = full_state(&t);
        t.inject_fault(Some(FaultInjection {
            stage_idx: 0,
            at: FaultPoint::WorkerLoop,
            micro_batch_idx: 0,
            panic: true,
        }));
        let started = Instant::now();
        let err = t.train_step(&x, &y).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
        t.inject_fault(None);
        assert!(
            matches!(&err, Error::WorkerPanicked { device_idx: 0, device, message } if device == "cpu:0" && message.contains("injected panic")),
            "{err}"
        );
        assert!(full_state(&t) == before);
        t.train_step(&x, &y).unwrap();
        assert_eq!(worker_threads(), 2, "two workers while the trainer lives");
    }
    assert_eq!(worker_threads(), 0, "a worker thread outlived its trainer");
}
