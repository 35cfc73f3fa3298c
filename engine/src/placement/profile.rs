//! Profiling: time each layer's forward, input-gradient and weight-gradient passes on a real
//! device (as torchgpipe's `balance_by_time` does), and feed the measured times to the planner
//! in place of FLOP estimates.
use std::time::Instant;

use super::NodeCosts;
use crate::graph::{Graph, NodeId};
use crate::{Device, ForwardCtx, Result, Tensor, init};

/// Measured seconds per sample of one node.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NodeTimes {
    /// Forward pass.
    pub forward_s: f64,
    /// Input-gradient pass.
    pub backward_input_s: f64,
    /// Weight-gradient pass.
    pub backward_weight_s: f64,
}

/// Times every layer node of `graph` with batches of `rows` rows on the calling thread (one
/// core: exactly what a CPU device is), taking the median of `repeats` runs of each pass. Inputs
/// are seeded random values of each node's input shapes (an embedding's ids are zeros).
pub fn profile_graph(graph: &Graph, rows: usize, repeats: usize) -> Result<Vec<(NodeId, NodeTimes)>> {
    let mut rng = init::rng(0x5EED);
    let mut out = Vec::new();
    let repeats = repeats.max(1);
    let rows = rows.max(1);
    let host = Device::host();
    for id in graph.topological_order()? {
        let Some(layer) = graph.layer(id) else { continue };
        let mut host_inputs = Vec::new();
        for pred in graph.predecessors(id) {
            let shape = graph.node(pred)?.output_shape.with_leading_dim(rows);
            host_inputs.push(if layer.takes_indices() {
                Tensor::zeros(shape, crate::DType::F32, &host)?
            } else {
                init::uniform(shape, -1.0, 1.0, &mut rng, &host)?
            });
        }
        let host_refs: Vec<&Tensor> = host_inputs.iter().collect();
        let ctx = ForwardCtx::train(1);
        let mut forward = Vec::with_capacity(repeats);
        let mut backward_input = Vec::with_capacity(repeats);
        let mut backward_weight = Vec::with_capacity(repeats);
        for _ in 0..repeats {
            let start = Instant::now();
            let (output, saved) = layer.forward(&host_refs, &ctx)?;
            forward.push(start.elapsed().as_secs_f64());
            let grad = Tensor::full(1.0, output.shape().clone(), output.dtype(), &host)?;
            let start = Instant::now();
            layer.backward_input(&saved, &grad)?;
            backward_input.push(start.elapsed().as_secs_f64());
            let mut grads: Vec<Tensor> = layer
                .parameters()
                .iter()
                .map(|p| Tensor::zeros(p.value.shape().clone(), p.value.dtype(), &host))
                .collect::<Result<_>>()?;
            let start = Instant::now();
            layer.backward_weight(&saved, &grad, &mut grads)?;
            backward_weight.push(start.elapsed().as_secs_f64());
        }
        let per_sample = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2] / rows as f64
        };
        out.push((
            id,
            NodeTimes {
                forward_s: per_sample(forward),
                backward_input_s: per_sample(backward_input),
                backward_weight_s: per_sample(backward_weight),
            },
        ));
    }
    Ok(out)
}

impl NodeCosts {
    /// Replaces the FLOP estimates with measured times. Times are converted to "equivalent
    /// FLOPs" at `profiled_flops_per_s`, so a [`super::DeviceSpec`] with that speed predicts
    /// exactly the measured times and a device twice as fast half of them.
    pub fn with_measured_times(
        mut self,
        times: &[(NodeId, NodeTimes)],
        profiled_flops_per_s: f64,
    ) -> Result<NodeCosts> {
        let mut prefixes = [vec![0.0], vec![0.0], vec![0.0]];
        for (position, id) in self.order.iter().enumerate() {
            let measured = times.iter().find(|(n, _)| n == id).map(|(_, t)| *t).ok_or_else(|| {
                crate::Error::invalid("profile", format!("no measured time for node `{}`", self.names[position]))
            })?;
            for (k, seconds) in
                [measured.forward_s, measured.backward_input_s, measured.backward_weight_s].into_iter().enumerate()
            {
                let last = *prefixes[k].last().unwrap();
                prefixes[k].push(last + seconds * profiled_flops_per_s);
            }
        }
        let [f, b, w] = prefixes;
        self.prefix_forward_flops = f;
        self.prefix_backward_input_flops = b;
        self.prefix_backward_weight_flops = w;
        Ok(self)
    }
}
