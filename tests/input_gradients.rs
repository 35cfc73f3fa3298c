//! The runtime asks no layer for the gradient of a graph input (the data), as PyTorch skips
//! inputs that do not require a gradient; every other input still gets its gradient, and the
//! trained weights are those of a run that computes every gradient.
mod common;

use std::sync::{Arc, Mutex};

use common::{SCHEDULES, data, weights};
use conveyor::engine::graph::Graph;
use conveyor::engine::optim::{OptimizerConfig, SgdConfig};
use conveyor::engine::runtime::Trainer;
use conveyor::engine::{Device, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor, init};
use conveyor::layers::{CrossEntropyLoss, Linear, Relu};

/// What a probe saw: `needed` per call, or `None` for a plain `backward_input` call.
type Calls = Arc<Mutex<Vec<Option<Vec<bool>>>>>;

/// A layer that records how the runtime asks for its input gradients, then delegates. With
/// `compute_all`, it ignores `needed` and computes every gradient (the reference).
#[derive(Debug)]
struct Probe {
    inner: Box<dyn Layer>,
    calls: Calls,
    compute_all: bool,
}

impl Layer for Probe {
    fn kind(&self) -> &'static str {
        self.inner.kind()
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
        self.inner.forward(inputs, ctx)
    }
    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        self.calls.lock().unwrap().push(None);
        self.inner.backward_input(saved, grad_output)
    }
    fn backward_input_for(&self, saved: &Saved, grad_output: &Tensor, needed: &[bool]) -> Result<Vec<Option<Tensor>>> {
        self.calls.lock().unwrap().push(Some(needed.to_vec()));
        if self.compute_all {
            return self.inner.backward_input(saved, grad_output);
        }
        self.inner.backward_input_for(saved, grad_output, needed)
    }
    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()> {
        self.inner.backward_weight(saved, grad_output, param_grads)
    }
    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        self.inner.cost(input_shapes)
    }
    fn refresh(&mut self) -> Result<()> {
        self.inner.refresh()
    }
    fn to_device(&mut self, device: &Device) -> Result<()> {
        self.inner.to_device(device)
    }
}

/// input → fc1 → relu → fc2 → relu → fc3, each Linear behind a probe.
fn probed_mlp(compute_all: bool) -> (Graph, Vec<Calls>) {
    let mut rng = init::rng(7);
    let mut graph = Graph::new();
    let mut node = graph.input("x", [12]).unwrap();
    let mut calls = Vec::new();
    for (idx, (fan_in, fan_out)) in [(12, 32), (32, 32), (32, 5)].into_iter().enumerate() {
        let probe_calls: Calls = Arc::default();
        let linear = Linear::new(fan_in, fan_out, true, &mut rng).unwrap();
        let probe = Probe { inner: Box::new(linear), calls: probe_calls.clone(), compute_all };
        node = graph.add(&format!("fc{idx}"), probe, &[node]).unwrap();
        if idx < 2 {
            node = graph.add(&format!("relu{idx}"), Relu, &[node]).unwrap();
        }
        calls.push(probe_calls);
    }
    graph.set_output(node).unwrap();
    (graph, calls)
}

fn trainer(graph: Graph, n_devices: usize, kind: conveyor::schedules::ScheduleKind, n_chunks: usize) -> Trainer {
    let stages = common::even_stages(&graph, n_devices * n_chunks);
    Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices((0..n_devices).map(Device::cpu).collect())
        .stages(stages)
        .schedule(kind, n_chunks)
        .micro_batches(4)
        .optimizer(OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.9)))
        .seed(3)
        .build()
        .unwrap()
}

#[test]
fn graph_inputs_take_no_gradient_and_weights_do_not_change() {
    let (x, y) = data(32, &[12], 5, 1);
    for (kind, n_chunks) in SCHEDULES {
        for n_devices in [1, 2] {
            let (graph, calls) = probed_mlp(false);
            let mut skipping = trainer(graph, n_devices, kind, n_chunks);
            let (graph, _) = probed_mlp(true);
            let mut reference = trainer(graph, n_devices, kind, n_chunks);
            for _ in 0..2 {
                skipping.train_step(&x, &y).unwrap();
                reference.train_step(&x, &y).unwrap();
            }
            let what = format!("{kind:?}, {n_devices} devices");
            // Two steps of 4 micro-batches: 8 calls per layer, all through `backward_input_for`.
            for (layer_idx, layer_calls) in calls.iter().enumerate() {
                let layer_calls = layer_calls.lock().unwrap();
                assert_eq!(layer_calls.len(), 8, "{what}: fc{layer_idx}");
                let expected = vec![layer_idx > 0];
                assert!(
                    layer_calls.iter().all(|c| c.as_ref() == Some(&expected)),
                    "{what}: fc{layer_idx} {layer_calls:?}"
                );
            }
            assert_eq!(weights(&skipping), weights(&reference), "{what}");
        }
    }
}
