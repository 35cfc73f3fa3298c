//! Watching the runtime's messages from outside: a graph of `Probe` layers, one per stage, whose
//! values carry (micro-batch, hops). A probe records every activation and gradient it is given;
//! with one probe per stage, the first thing a stage computes on is what it received, so the
//! probes' records are the runtime's receives, in the order the stage took them.
//!
//! Encoding: micro-batch `m`'s input rows hold `SCALE * m`; every probe adds 1 on the way forward
//! and on the way back, and the loss restarts the count (its gradient is `SCALE * m`). So a value
//! `SCALE * m + h` says "micro-batch m, through h probes": `h` tells which stage sent it.
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use conveyor::engine::graph::Graph;
use conveyor::engine::optim::OptimizerConfig;
use conveyor::engine::runtime::{CoreSlotPolicy, Trainer};
use conveyor::engine::{Device, ForwardCtx, Layer, LayerCost, Loss, Parameter, Result, Saved, Shape, Targets, Tensor};
use conveyor::schedules::{ChannelId, Direction, Schedule};

/// Micro-batch `m` is `SCALE * m`; hop counts stay below it.
pub const SCALE: f32 = 1000.0;

/// What one probe saw: at `stage_idx`, its input `input_idx` (gradients: always 0), micro-batch
/// `micro_batch_idx` after `hops` probes, on thread `thread`.
#[derive(Clone, Debug)]
pub struct Seen {
    pub stage_idx: usize,
    pub direction: Direction,
    pub input_idx: usize,
    pub micro_batch_idx: usize,
    pub hops: usize,
    pub thread: String,
}

pub type Log = Arc<Mutex<Vec<Seen>>>;

/// Identity plus one, recording what it sees. `zero_grad_inputs` get a zero gradient back (so
/// the producer of a skip edge sees one decodable gradient, from its main consumer).
#[derive(Debug)]
pub struct Probe {
    pub stage_idx: usize,
    pub n_inputs: usize,
    pub zero_grad_inputs: Vec<usize>,
    pub log: Log,
}

fn decode(tensor: &Tensor) -> Result<(usize, usize)> {
    let values = tensor.as_f32()?;
    let first = values[0];
    assert!(values.iter().all(|&v| v == first), "a probe's tensor mixes micro-batches: {values:?}");
    let micro_batch = (first / SCALE).floor();
    Ok((micro_batch as usize, (first - micro_batch * SCALE) as usize))
}

fn plus_one(tensor: &Tensor) -> Result<Tensor> {
    let mut out = tensor.try_clone()?;
    out.as_f32_mut()?.iter_mut().for_each(|v| *v += 1.0);
    Ok(out)
}

impl Probe {
    fn record(&self, direction: Direction, input_idx: usize, tensor: &Tensor) -> Result<()> {
        let (micro_batch_idx, hops) = decode(tensor)?;
        let thread = std::thread::current().name().unwrap_or("unnamed").to_string();
        let seen = Seen { stage_idx: self.stage_idx, direction, input_idx, micro_batch_idx, hops, thread };
        self.log.lock().expect("the probe log is not poisoned").push(seen);
        Ok(())
    }
}

impl Layer for Probe {
    fn kind(&self) -> &'static str {
        "Probe"
    }

    fn n_inputs(&self) -> usize {
        self.n_inputs
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        Ok(input_shapes[0].clone())
    }

    fn parameters(&self) -> &[Parameter] {
        &[]
    }

    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut []
    }

    fn forward(&self, inputs: &[&Tensor], _ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        for (input_idx, input) in inputs.iter().enumerate() {
            self.record(Direction::Activation, input_idx, input)?;
        }
        Ok((plus_one(inputs[0])?, Saved::default()))
    }

    fn backward_input(&self, _saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        self.record(Direction::Gradient, 0, grad_output)?;
        (0..self.n_inputs)
            .map(|input_idx| {
                if self.zero_grad_inputs.contains(&input_idx) {
                    Ok(Some(Tensor::zeros(grad_output.shape().clone(), grad_output.dtype(), grad_output.device())?))
                } else {
                    Ok(Some(plus_one(grad_output)?))
                }
            })
            .collect()
    }

    fn backward_weight(&self, _saved: &Saved, _grad_output: &Tensor, _param_grads: &mut [Tensor]) -> Result<()> {
        Ok(())
    }

    fn cost(&self, _input_shapes: &[Shape]) -> Result<LayerCost> {
        Ok(LayerCost::default())
    }
}

/// Gradient `SCALE * m` for micro-batch `m`: the backward count starts again at 0.
#[derive(Debug)]
pub struct RestartLoss;

impl Loss for RestartLoss {
    fn loss_and_grad(&self, output: &Tensor, _targets: &Targets, _normalizer: f32) -> Result<(f64, Tensor)> {
        let (micro_batch_idx, _) = decode(output)?;
        let grad =
            Tensor::full(SCALE * micro_batch_idx as f32, output.shape().clone(), output.dtype(), output.device())?;
        Ok((0.0, grad))
    }
}

/// A graph of probes, one per stage: probe `s` takes the previous probe's output, and the probes
/// listed in `skips` as (consumer stage, producer stage) also take that earlier probe's output.
/// Returns the graph, the stages, and the stage-to-stage edges (producer, consumer) it makes.
pub fn probe_graph(
    n_stages: usize,
    skips: &[(usize, usize)],
    log: &Log,
) -> (Graph, Vec<Vec<conveyor::engine::graph::NodeId>>, Vec<(usize, usize)>) {
    assert!(
        skips.iter().all(|&(consumer, producer)| producer + 1 < consumer && consumer < n_stages),
        "{skips:?} skip no stage"
    );
    let mut graph = Graph::new();
    let x = graph.input("x", [1]).expect("an input node");
    let mut nodes = Vec::new();
    let mut edges = Vec::new();
    for stage_idx in 0..n_stages {
        let mut inputs = vec![nodes.last().copied().unwrap_or(x)];
        if stage_idx > 0 {
            edges.push((stage_idx - 1, stage_idx));
        }
        for &(_, producer) in skips.iter().filter(|(consumer, _)| *consumer == stage_idx) {
            inputs.push(nodes[producer]);
            edges.push((producer, stage_idx));
        }
        let probe = Probe {
            stage_idx,
            n_inputs: inputs.len(),
            zero_grad_inputs: (1..inputs.len()).collect(),
            log: Arc::clone(log),
        };
        nodes.push(graph.add(&format!("probe{stage_idx}"), probe, &inputs).expect("a probe node"));
    }
    graph.set_output(*nodes.last().expect("at least one stage")).expect("the output");
    (graph, nodes.into_iter().map(|n| vec![n]).collect(), edges)
}

/// Trains one step of the probe graph under `schedule`'s kind on CPU devices; returns the log.
pub fn run_probes(schedule: &Schedule, skips: &[(usize, usize)]) -> (Vec<Seen>, Vec<(usize, usize)>) {
    let log: Log = Arc::default();
    let (graph, stages, edges) = probe_graph(schedule.n_stages(), skips, &log);
    let n_micro_batches = schedule.n_micro_batches();
    let mut trainer = Trainer::builder(graph, Arc::new(RestartLoss))
        .devices((0..schedule.n_devices()).map(Device::cpu).collect())
        .stages(stages)
        .schedule(schedule.kind(), schedule.n_chunks())
        .micro_batches(n_micro_batches)
        .optimizer(OptimizerConfig::sgd(0.1))
        .core_slots(CoreSlotPolicy::Off)
        .build()
        .expect("the probe trainer builds");
    let rows_per_micro_batch = 2;
    let rows = n_micro_batches * rows_per_micro_batch;
    let values: Vec<f32> = (0..rows).map(|r| SCALE * (r / rows_per_micro_batch) as f32).collect();
    let inputs = Tensor::from_vec(values, [rows, 1], &Device::host()).expect("inputs");
    trainer.train_step(&inputs, &vec![0; rows]).expect("the probe step runs");
    let seen = log.lock().expect("the probe log is not poisoned").clone();
    (seen, edges)
}

/// Per channel, the micro-batches in the order they were received, from a probe log: stage `s`'s
/// activation input `i` came from the producer of that input, its gradient from stage `s + 1`
/// (the probe chain's consumer; skip producers get a zero gradient, which the probe cannot tell).
/// Checks each value's hop count against the stage it must have come from.
pub fn received_per_channel(
    seen: &[Seen],
    n_stages: usize,
    skips: &[(usize, usize)],
) -> BTreeMap<ChannelId, Vec<usize>> {
    let mut out: BTreeMap<ChannelId, Vec<usize>> = BTreeMap::new();
    for s in seen {
        let from_stage_idx = match s.direction {
            Direction::Activation if s.input_idx == 0 && s.stage_idx == 0 => continue, // the data
            Direction::Activation if s.input_idx == 0 => s.stage_idx - 1,
            Direction::Activation => {
                skips
                    .iter()
                    .filter(|(consumer, _)| *consumer == s.stage_idx)
                    .nth(s.input_idx - 1)
                    .expect("a skip input")
                    .1
            }
            Direction::Gradient if s.stage_idx + 1 == n_stages => continue, // from the loss
            Direction::Gradient => s.stage_idx + 1,
        };
        // Forward, a value has passed probes 0..=producer; backward, probes producer..n_stages.
        let expected_hops = match s.direction {
            Direction::Activation => from_stage_idx + 1,
            Direction::Gradient => n_stages - from_stage_idx,
        };
        assert_eq!(
            s.hops, expected_hops,
            "stage {} got {:?} of micro-batch {} after {} probes; from stage {from_stage_idx} it would have passed {expected_hops}",
            s.stage_idx, s.direction, s.micro_batch_idx, s.hops
        );
        let channel = ChannelId { from_stage_idx, to_stage_idx: s.stage_idx, direction: s.direction };
        out.entry(channel).or_default().push(s.micro_batch_idx);
    }
    out
}
