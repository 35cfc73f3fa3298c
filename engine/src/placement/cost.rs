//! The planner's cost model: device speeds and budgets, the link model t = latency + bytes /
//! bandwidth, and the memory of a stage: parameters, gradients, optimizer state, the commit's undo
//! snapshot, the copies layers derive from their parameters, and the most its micro-batches,
//! messages and ops hold at any moment of a step (see `memory/README.md`).
use std::sync::Arc;

use conveyor_schedules::Schedule;

use super::memory::{
    Moment, NodeMemory, Running, ScheduleMemory, StageFootprint, StageInput, StageShape, at, footprint,
};
use crate::device::DeviceKind;
use crate::graph::{Graph, NodeId};
use crate::runtime::Recompute;
use crate::{CallScratch, Error, LayerCost, Result};

/// A device as the planner sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceSpec {
    /// Its name, e.g. `cpu:0`.
    pub name: String,
    /// Sustained f32 FLOP/s on layer work.
    pub flops_per_s: f64,
    /// Memory budget in bytes (none: unlimited).
    pub budget_bytes: Option<u64>,
    /// CPU or GPU: on a GPU the layers' ops reserve their scratch on the device's ledger
    /// ([`crate::LayerCost::gpu_scratch_bytes_per_sample`]), so the plan counts it in each call.
    pub kind: DeviceKind,
}

impl DeviceSpec {
    /// CPU core `index` (named `cpu:INDEX`) at `flops_per_s` under `budget_bytes`.
    pub fn cpu(index: usize, flops_per_s: f64, budget_bytes: Option<u64>) -> DeviceSpec {
        DeviceSpec { name: format!("cpu:{index}"), flops_per_s, budget_bytes, kind: DeviceKind::Cpu }
    }

    /// A tensor-parallel group of devices as one planner device: `name` joins the members' names
    /// with `+`, the speed is their sum and the budget the sum of theirs (unlimited when any is).
    ///
    /// This treats a stage split `k` ways as `k` times faster and larger, which holds for the
    /// split layers (their FLOPs and parameters divide evenly) but not for what stays whole: a
    /// stage's unsplit layers, its activations and the copies of inputs that split layers keep on
    /// every member all sit on the first device. A placement chosen for groups is therefore
    /// checked again device by device once the split layers exist
    /// (`conveyor::pipeline::plan_tensor_parallel`).
    pub fn group(members: &[DeviceSpec]) -> DeviceSpec {
        DeviceSpec {
            name: members.iter().map(|m| m.name.as_str()).collect::<Vec<_>>().join("+"),
            flops_per_s: members.iter().map(|m| m.flops_per_s).sum(),
            budget_bytes: members.iter().map(|m| m.budget_bytes).sum(),
            kind: members.iter().map(|m| m.kind).max().unwrap_or(DeviceKind::Cpu),
        }
    }
}

/// The link between consecutive devices: a message of `b` bytes takes `latency_s + b / bandwidth`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Seconds per message.
    pub latency_s: f64,
    /// Bytes per second.
    pub bandwidth_bytes_per_s: f64,
}

impl Link {
    /// Time to move `bytes` in one message (zero bytes cost nothing).
    pub fn transfer_s(&self, bytes: u64) -> f64 {
        if bytes == 0 { 0.0 } else { self.latency_s + bytes as f64 / self.bandwidth_bytes_per_s }
    }
}

impl Default for Link {
    /// In-process channels between CPU cores: about 5 µs per message and 10 GB/s.
    fn default() -> Self {
        Link { latency_s: 5e-6, bandwidth_bytes_per_s: 10e9 }
    }
}

/// Optimizer state kept per parameter byte: SGD none, momentum one buffer, Adam/AdamW two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerMemory {
    /// Plain SGD.
    Sgd,
    /// SGD with momentum.
    Momentum,
    /// Adam or AdamW.
    Adam,
}

impl OptimizerMemory {
    /// State bytes per parameter byte.
    pub fn state_factor(self) -> u64 {
        match self {
            OptimizerMemory::Sgd => 0,
            OptimizerMemory::Momentum => 1,
            OptimizerMemory::Adam => 2,
        }
    }
}

/// What the plan is made for.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanConfig {
    /// Rows in one micro-batch.
    pub micro_batch_rows: usize,
    /// Peak number of micro-batches whose activations each stage holds under the chosen schedule,
    /// for each stage count `p` (index p - 1 holds a vector of p entries, stage 0 first). Built by
    /// [`PlanConfig::new`] from the schedule simulator. Used only for stage counts the schedule of
    /// [`PlanConfig::with_schedule`] does not describe.
    pub inflight_by_n_stages: Vec<Vec<usize>>,
    /// Optimizer state.
    pub optimizer: OptimizerMemory,
    /// The link between devices.
    pub link: Link,
    /// Count the copies layers derive from their parameters (`LayerCost::workspace_bytes`, such
    /// as Linear's packed weights). True by default; false when every Linear and Conv will be
    /// split over a tensor-parallel group, whose shards keep no such copies.
    pub count_workspace: bool,
    /// Which derived caches (Linear's packed weights) the stages keep ([`WeightCache`]).
    pub weight_cache: WeightCache,
    /// Activation recomputation of every stage (what a stage keeps between forward and backward).
    pub recompute: Recompute,
    /// Keep the commit's undo snapshot (a copy of the stage's parameters and optimizer state)
    /// when it fits. True by default.
    pub commit_snapshot: bool,
    /// Where every micro-batch is at each instruction of the schedule and how many messages can
    /// wait for each stage ([`PlanConfig::with_schedule`]); without it, a stand-in built from the
    /// in-flight counts.
    pub schedule: Option<Arc<ScheduleMemory>>,
}

/// Which copies derived from parameters (Linear's packed weights: two per Linear, each as large
/// as its weight, rebuilt after every update and read by its forward and input-gradient
/// products) the stages keep (`--weight-cache`).
///
/// `Off` is the default: since the small-row kernel (`cpu::rows_gemm`) takes a Linear's products
/// at micro-batch sizes, the copies no longer pay for their rebuild. Measured on the 8 x 1024 MLP
/// (batch 256, 1 to 32 micro-batches, one device, two stages and two replicas), runs without
/// them were faster in every configuration: medians of per-round ratios 1.02-1.23
/// (`benches/README.md`, "Issues 19 and 25, 2026-12-07 (later)").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightCache {
    /// Keep each one where the stage's memory has room after everything else, the most used
    /// (largest FLOPs) first; drop the rest.
    Auto,
    /// Keep every one; a stage they push over its budget does not fit.
    On,
    /// Keep none (the default): less memory, and no rebuild after each update.
    #[default]
    Off,
}

impl WeightCache {
    /// The flag's value (`auto`, `on`, `off`).
    pub fn name(self) -> &'static str {
        match self {
            WeightCache::Auto => "auto",
            WeightCache::On => "on",
            WeightCache::Off => "off",
        }
    }
}

impl std::fmt::Display for WeightCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for WeightCache {
    type Err = Error;

    fn from_str(text: &str) -> Result<WeightCache> {
        match text {
            "auto" => Ok(WeightCache::Auto),
            "on" => Ok(WeightCache::On),
            "off" => Ok(WeightCache::Off),
            other => Err(Error::invalid("weight cache", format!("`{other}`: use auto, on or off"))),
        }
    }
}

impl PlanConfig {
    /// A config whose in-flight counts come from `inflight(p)` for p = 1..=max_stages.
    pub fn new(
        micro_batch_rows: usize,
        max_stages: usize,
        inflight: impl Fn(usize) -> Vec<usize>,
        optimizer: OptimizerMemory,
        link: Link,
    ) -> Self {
        PlanConfig {
            micro_batch_rows,
            inflight_by_n_stages: (1..=max_stages).map(inflight).collect(),
            optimizer,
            link,
            count_workspace: true,
            weight_cache: WeightCache::default(),
            recompute: Recompute::Never,
            commit_snapshot: true,
            schedule: None,
        }
    }

    /// The same config with the memory moments of `schedule` (for plans of its number of stages).
    pub fn with_schedule(mut self, schedule: &Schedule) -> Self {
        self.schedule = Some(Arc::new(ScheduleMemory::new(schedule)));
        self
    }

    /// The moments of stage `stage_idx` of `n_stages`.
    fn moments(&self, n_stages: usize, stage_idx: usize) -> Result<std::borrow::Cow<'_, [Moment]>> {
        if let Some(schedule) = self.schedule.as_ref().filter(|s| s.n_stages() == n_stages) {
            return Ok(std::borrow::Cow::Borrowed(&schedule.moments[stage_idx]));
        }
        let inflight = self
            .inflight_by_n_stages
            .get(n_stages.wrapping_sub(1))
            .ok_or_else(|| Error::invalid("PlanConfig", format!("no in-flight count for {n_stages} stages")))?;
        let n_micro_batches = self.inflight_by_n_stages.iter().flatten().copied().max().unwrap_or(1);
        let mut stand_in = ScheduleMemory::from_inflight(inflight, n_micro_batches);
        Ok(std::borrow::Cow::Owned(std::mem::take(&mut stand_in.moments[stage_idx])))
    }

    fn n_micro_batches(&self, n_stages: usize) -> usize {
        match self.schedule.as_ref().filter(|s| s.n_stages() == n_stages) {
            Some(schedule) => schedule.n_micro_batches,
            None => self.inflight_by_n_stages.iter().flatten().copied().max().unwrap_or(1),
        }
    }

    /// Whether micro-batch `micro_batch_idx` of `n_micro_batches` is recomputed.
    fn recomputes(&self, micro_batch_idx: usize, n_micro_batches: usize) -> bool {
        match self.recompute {
            Recompute::Never => false,
            Recompute::Always => true,
            Recompute::ExceptLast => micro_batch_idx + 1 < n_micro_batches,
        }
    }
}

/// Memory of one stage on one device, bytes: what it holds all the time (parameters, gradients,
/// optimizer state, the undo snapshot, derived caches) plus what it holds at its busiest moment
/// of a step (activations kept for backward, messages waiting, the running op's working
/// set). With tensor parallelism a stage has one of these per device of its group.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StageMemory {
    /// Parameters.
    pub params: u64,
    /// Copies layers derive from their parameters and keep (Linear's packed weights); the copies
    /// the plan dropped to fit are in `workspace_dropped`.
    pub workspace: u64,
    /// Gradients (same size as the parameters).
    pub grads: u64,
    /// Optimizer state (allocated at the first step).
    pub optimizer_state: u64,
    /// The commit's undo snapshot (parameters and optimizer state, copied before the update so a
    /// failed apply can be rolled back), or 0 when the plan dropped it (`commit_snapshot_dropped`).
    pub commit_snapshot: u64,
    /// At the busiest moment: activations the stage keeps for backward (saved tensors, kept
    /// inputs, output gradients awaiting the weight pass).
    pub activations: u64,
    /// At the busiest moment: messages moved onto the device that the stage has not consumed
    /// yet, and the data of micro-batches it has not read.
    pub messages: u64,
    /// At the busiest moment: the running op's micro-batch at the op's peak: what it started
    /// from (its kept activations, the inputs or gradients it consumes) and everything the op
    /// creates (outputs held until the stage's forward ends, the loss gradient, input gradients,
    /// messages before they are sent).
    pub scratch: u64,
    /// Bytes of derived caches dropped to fit (not part of the total).
    pub workspace_dropped: u64,
    /// Bytes of the undo snapshot when dropped to fit (not part of the total).
    pub commit_snapshot_dropped: u64,
}

impl StageMemory {
    /// Everything the stage can hold at once.
    pub fn total(&self) -> u64 {
        self.persistent() + self.activations + self.messages + self.scratch
    }

    /// What the stage holds from the first step on, whatever the step is doing.
    pub fn persistent(&self) -> u64 {
        self.params + self.workspace + self.grads + self.optimizer_state + self.commit_snapshot
    }

    /// What the stage needs at least: the total without the caches and the snapshot it keeps.
    pub fn required(&self) -> u64 {
        self.total() - self.workspace - self.commit_snapshot
    }
}

/// Where a node's input comes from, in [`NodeCosts`] positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NodeInput {
    /// The layer node at this position.
    Node(usize),
    /// Graph input number `input_idx` (data), with its bytes per sample.
    Data { input_idx: usize, bytes_per_sample: u64 },
}

/// Per-node figures in topological order, with prefix sums so any contiguous range's compute
/// costs O(1) (transfers are summed over the range's boundary edges, memory replayed per range).
#[derive(Clone, Debug)]
pub struct NodeCosts {
    /// Layer nodes in the order stages cut them.
    pub order: Vec<NodeId>,
    /// Names, aligned with `order`.
    pub names: Vec<String>,
    pub(crate) prefix_forward_flops: Vec<f64>,
    pub(crate) prefix_backward_input_flops: Vec<f64>,
    pub(crate) prefix_backward_weight_flops: Vec<f64>,
    prefix_param_bytes: Vec<u64>,
    /// Bytes of derived caches of each node (`LayerCost::workspace_bytes`).
    workspace_bytes: Vec<u64>,
    /// Output bytes per sample of each node in `order`.
    output_bytes: Vec<u64>,
    /// Per sample, each node's ops' scratch on a GPU (`LayerCost::gpu_scratch_bytes_per_sample`).
    gpu_scratch: Vec<CallScratch>,
    /// Gradients of one output are summed through f32 copies (a mixed precision).
    half_gradient_sums: bool,
    /// For each node in `order`, the positions (in `order`) of layer nodes it feeds.
    consumers: Vec<Vec<usize>>,
    /// For each node in `order`, positions of the layer nodes feeding it.
    producers: Vec<Vec<usize>>,
    /// For each node, its inputs in input order.
    inputs: Vec<Vec<NodeInput>>,
    /// The position of the graph's output node.
    output_position: Option<usize>,
    /// How each node uses memory (from its cost figures, or measured).
    memory: Vec<NodeMemory>,
}

impl NodeCosts {
    /// Collects the costs of every layer node of a validated graph. Memory use comes from the
    /// layers' cost figures ([`NodeMemory::from_cost`]: an upper bound that counts no sharing);
    /// [`NodeCosts::with_measured_memory`] replaces it with measured figures.
    pub fn of_graph(graph: &Graph) -> Result<Self> {
        graph.validate()?;
        let order: Vec<NodeId> =
            graph.topological_order()?.into_iter().filter(|&id| graph.layer(id).is_some()).collect();
        let position = |id: NodeId| order.iter().position(|&o| o == id);
        let graph_inputs = graph.inputs();
        let output = graph.output()?;
        let mut costs = NodeCosts {
            names: Vec::new(),
            prefix_forward_flops: vec![0.0],
            prefix_backward_input_flops: vec![0.0],
            prefix_backward_weight_flops: vec![0.0],
            prefix_param_bytes: vec![0],
            workspace_bytes: Vec::new(),
            output_bytes: Vec::new(),
            gpu_scratch: Vec::new(),
            half_gradient_sums: false,
            consumers: Vec::new(),
            producers: Vec::new(),
            inputs: Vec::new(),
            output_position: position(output),
            memory: Vec::new(),
            order: order.clone(),
        };
        for &id in &order {
            let c = graph.cost(id)?;
            let traffic = pass_traffic(graph, id, &c, &graph_inputs)?;
            let push_f = |v: &mut Vec<f64>, flops: u64, bytes: u64| {
                v.push(v.last().unwrap() + flops as f64 + FLOPS_PER_BYTE_MOVED * bytes as f64)
            };
            push_f(&mut costs.prefix_forward_flops, c.forward_flops_per_sample, traffic[0]);
            push_f(&mut costs.prefix_backward_input_flops, c.backward_input_flops_per_sample, traffic[1]);
            push_f(&mut costs.prefix_backward_weight_flops, c.backward_weight_flops_per_sample, traffic[2]);
            costs.prefix_param_bytes.push(costs.prefix_param_bytes.last().unwrap() + c.param_bytes);
            costs.workspace_bytes.push(c.workspace_bytes);
            costs.output_bytes.push(c.output_bytes_per_sample);
            costs.gpu_scratch.push(c.gpu_scratch_bytes_per_sample);
            costs.names.push(graph.node(id)?.name.clone());
            costs.consumers.push(graph.successors(id).into_iter().filter_map(position).collect());
            costs.producers.push(graph.predecessors(id).into_iter().filter_map(position).collect());
            let mut inputs = Vec::new();
            let (mut input_bytes, mut takes_grad) = (Vec::new(), Vec::new());
            for pred in graph.predecessors(id) {
                let bytes = 4 * graph.node(pred)?.output_shape.numel() as u64;
                match position(pred) {
                    Some(p) => inputs.push(NodeInput::Node(p)),
                    None => {
                        let input_idx = graph_inputs.iter().position(|&i| i == pred).unwrap_or(0);
                        inputs.push(NodeInput::Data { input_idx, bytes_per_sample: bytes });
                    }
                }
                input_bytes.push(bytes);
                takes_grad.push(!graph_inputs.contains(&pred));
            }
            let scratch = graph.layer(id).map_or(0, |l| l.weight_pass_scratch_bytes());
            costs.memory.push(NodeMemory::from_cost(&c, &input_bytes, &takes_grad, 1, scratch));
            costs.inputs.push(inputs);
        }
        Ok(costs)
    }

    /// Replaces the memory figures of the nodes in `measured` (from
    /// [`super::measure_node_memory`]) with those.
    pub fn with_measured_memory(mut self, measured: &[(NodeId, NodeMemory)]) -> Result<NodeCosts> {
        for (id, memory) in measured {
            if let Some(position) = self.order.iter().position(|o| o == id) {
                self.memory[position] = memory.clone();
            }
        }
        Ok(self)
    }

    /// The costs of a mixed-precision run. The runtime sums two gradients of one output through
    /// f32 copies rather than in place. And a GPU op reads each f16/bf16 operand through an exact
    /// f32 copy and computes its result in f32 before rounding it, so on a GPU each call also
    /// takes, per sample, f32 bytes of the node's inputs and output (forward: inputs and result;
    /// input gradient: the output gradient, the saved inputs and the result; weight gradient: the
    /// output gradient and the saved inputs), on top of the scratch its layer declares. A bound:
    /// f32 operands and the half products' cuBLAS path take no copies.
    pub fn under_mixed_precision(mut self) -> NodeCosts {
        self.half_gradient_sums = true;
        for node in 0..self.order.len() {
            let inputs: u64 = self.inputs[node]
                .iter()
                .map(|input| match *input {
                    NodeInput::Node(p) => self.output_bytes[p],
                    NodeInput::Data { bytes_per_sample, .. } => bytes_per_sample,
                })
                .sum();
            let output = self.output_bytes[node];
            let scratch = &mut self.gpu_scratch[node];
            scratch.forward = scratch.forward.saturating_add(inputs + output);
            scratch.backward_input = scratch.backward_input.saturating_add(output + 2 * inputs);
            scratch.backward_weight = scratch.backward_weight.saturating_add(output + inputs);
        }
        self
    }

    /// Number of layer nodes.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// True when the graph has no layers.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// The same nodes in another topological order (`new_order[k]` is the old position of the
    /// node that comes k-th).
    pub(crate) fn reorder(&self, new_order: &[usize]) -> NodeCosts {
        let mut old_to_new = vec![0; new_order.len()];
        for (new, &old) in new_order.iter().enumerate() {
            old_to_new[old] = new;
        }
        let diff_f = |prefix: &[f64]| {
            let mut out = vec![0.0];
            for &old in new_order {
                out.push(out.last().unwrap() + (prefix[old + 1] - prefix[old]));
            }
            out
        };
        let diff_u = |prefix: &[u64]| {
            let mut out = vec![0];
            for &old in new_order {
                out.push(out.last().unwrap() + (prefix[old + 1] - prefix[old]));
            }
            out
        };
        let remap = |lists: &[Vec<usize>]| -> Vec<Vec<usize>> {
            new_order.iter().map(|&old| lists[old].iter().map(|&o| old_to_new[o]).collect()).collect()
        };
        let pick = |v: &[u64]| new_order.iter().map(|&o| v[o]).collect::<Vec<u64>>();
        NodeCosts {
            order: new_order.iter().map(|&o| self.order[o]).collect(),
            names: new_order.iter().map(|&o| self.names[o].clone()).collect(),
            prefix_forward_flops: diff_f(&self.prefix_forward_flops),
            prefix_backward_input_flops: diff_f(&self.prefix_backward_input_flops),
            prefix_backward_weight_flops: diff_f(&self.prefix_backward_weight_flops),
            prefix_param_bytes: diff_u(&self.prefix_param_bytes),
            workspace_bytes: pick(&self.workspace_bytes),
            output_bytes: pick(&self.output_bytes),
            gpu_scratch: new_order.iter().map(|&o| self.gpu_scratch[o]).collect(),
            half_gradient_sums: self.half_gradient_sums,
            consumers: remap(&self.consumers),
            producers: remap(&self.producers),
            inputs: new_order
                .iter()
                .map(|&old| {
                    self.inputs[old]
                        .iter()
                        .map(|input| match *input {
                            NodeInput::Node(p) => NodeInput::Node(old_to_new[p]),
                            data => data,
                        })
                        .collect()
                })
                .collect(),
            output_position: self.output_position.map(|p| old_to_new[p]),
            memory: new_order.iter().map(|&o| self.memory[o].clone()).collect(),
        }
    }

    /// Parameter bytes of nodes `start..end`.
    pub fn param_bytes(&self, start: usize, end: usize) -> u64 {
        self.prefix_param_bytes[end] - self.prefix_param_bytes[start]
    }

    /// Bytes per sample entering range `start..end` from earlier nodes (each producer once) and
    /// leaving it to later nodes (each producer once).
    pub fn boundary_bytes(&self, start: usize, end: usize) -> (u64, u64) {
        let mut incoming = 0;
        let mut seen = Vec::new();
        for node in start..end {
            for &p in &self.producers[node] {
                if p < start && !seen.contains(&p) {
                    seen.push(p);
                    incoming += self.output_bytes[p];
                }
            }
        }
        let outgoing =
            (start..end).filter(|&n| self.consumers[n].iter().any(|&c| c >= end)).map(|n| self.output_bytes[n]).sum();
        (incoming, outgoing)
    }

    /// How the nodes `start..end` use memory as stage `stage_idx` of `n_stages`, per micro-batch
    /// of `rows` rows: the replay's input, and the bytes per micro-batch of the messages the stage
    /// receives, by sending stage. `stage_of` gives every node's stage when the whole placement
    /// is known; without it (inside the search, where only this stage's range is) a message from
    /// a node before the previous one is counted as if from stage 0, and a gradient from a node
    /// after the next one as if from the last stage: those run furthest ahead, so wait the most.
    fn stage_shape(
        &self,
        rows: usize,
        n_stages: usize,
        stage_idx: usize,
        (start, end): (usize, usize),
        stage_of: Option<&[usize]>,
    ) -> StageParts {
        let nodes: Vec<NodeMemory> = self.memory[start..end].iter().map(|m| m.scaled_to(rows)).collect();
        let output_bytes = |p: usize| self.memory[p].scaled_to(rows).output_bytes;
        let mut received: Vec<usize> = Vec::new();
        let mut data: Vec<(usize, u64)> = Vec::new();
        let output = self.output_position.filter(|p| (start..end).contains(p)).map_or(0, output_bytes);
        let mut waiting = Waiting { forward: vec![0; stage_idx], gradient: vec![0; n_stages - stage_idx - 1], output };
        let inputs: Vec<Vec<StageInput>> = (start..end)
            .map(|node| {
                self.inputs[node]
                    .iter()
                    .map(|input| match *input {
                        NodeInput::Node(p) if p >= start => StageInput::Local(p - start),
                        NodeInput::Node(p) => {
                            let i = received.iter().position(|&r| r == p).unwrap_or_else(|| {
                                received.push(p);
                                let from = match stage_of {
                                    Some(stage_of) => stage_of[p],
                                    None if p + 1 == start => stage_idx.saturating_sub(1),
                                    None => 0,
                                };
                                // (The search also tries first stages that do not start at node 0.)
                                if let Some(bytes) = waiting.forward.get_mut(from) {
                                    *bytes += output_bytes(p);
                                }
                                received.len() - 1
                            });
                            StageInput::Received(i)
                        }
                        NodeInput::Data { input_idx, bytes_per_sample } => {
                            let i = data.iter().position(|&(d, _)| d == input_idx).unwrap_or_else(|| {
                                data.push((input_idx, bytes_per_sample * rows as u64));
                                data.len() - 1
                            });
                            StageInput::Data(i)
                        }
                    })
                    .collect()
            })
            .collect();
        let routes: Vec<usize> = (start..end)
            .map(|node| {
                let outside: Vec<usize> = self.consumers[node].iter().copied().filter(|&c| c >= end).collect();
                // (The search also tries ranges that leave nodes after the last stage; it never keeps them.)
                if outside.is_empty() || stage_idx + 1 == n_stages {
                    return 0;
                }
                // One message (and one gradient back) per consuming stage.
                let mut from: Vec<usize> = match stage_of {
                    Some(stage_of) => outside.iter().map(|&c| stage_of[c]).collect(),
                    None if outside.iter().all(|&c| c == end) => vec![stage_idx + 1],
                    None => vec![n_stages - 1; outside.len().min(n_stages - 1 - stage_idx)],
                };
                if stage_of.is_some() {
                    from.sort_unstable();
                    from.dedup();
                }
                for &t in &from {
                    waiting.gradient[t - stage_idx - 1] += output_bytes(node);
                }
                from.len()
            })
            .collect();
        StageParts {
            received: received.iter().map(|&p| output_bytes(p)).collect(),
            data: data.iter().map(|&(_, b)| b).collect(),
            nodes,
            inputs,
            routes,
            waiting,
        }
    }

    /// The stage made of nodes `start..end` as stage `stage_idx` of `n_stages` on `device`: its
    /// memory (keeping the undo snapshot and derived caches that fit the device's budget), its
    /// times, and which caches it keeps.
    pub(crate) fn stage(
        &self,
        config: &PlanConfig,
        device: &DeviceSpec,
        n_stages: usize,
        stage_idx: usize,
        (start, end): (usize, usize),
        stage_of: Option<&[usize]>,
    ) -> Result<StageEstimate> {
        let rows = config.micro_batch_rows as f64;
        let (incoming, outgoing) = self.boundary_bytes(start, end);
        let memory = self.stage_memory(config, device, n_stages, stage_idx, (start, end), stage_of)?;
        let rows_u = config.micro_batch_rows as u64;
        // A forward receives the incoming activations; a backward receives the outgoing gradients.
        let forward_in = config.link.transfer_s(incoming * rows_u);
        let backward_in = config.link.transfer_s(outgoing * rows_u);
        let flops = |prefix: &[f64]| (prefix[end] - prefix[start]) * rows / device.flops_per_s;
        let forward_s = flops(&self.prefix_forward_flops) + forward_in;
        let backward_input_s = flops(&self.prefix_backward_input_flops) + backward_in;
        let backward_weight_s = flops(&self.prefix_backward_weight_flops);
        Ok(StageEstimate {
            times: [forward_s, backward_input_s, backward_weight_s, forward_in + backward_in],
            ..memory
        })
    }

    /// [`NodeCosts::stage`]'s memory part, under `device`'s budget; on a GPU each call's peak
    /// includes its ops' scratch.
    fn stage_memory(
        &self,
        config: &PlanConfig,
        device: &DeviceSpec,
        n_stages: usize,
        stage_idx: usize,
        (start, end): (usize, usize),
        stage_of: Option<&[usize]>,
    ) -> Result<StageEstimate> {
        let budget = device.budget_bytes;
        let StageParts { mut nodes, inputs, routes, received, data, waiting } =
            self.stage_shape(config.micro_batch_rows, n_stages, stage_idx, (start, end), stage_of);
        if device.kind == DeviceKind::Cuda {
            for (node, scratch) in nodes.iter_mut().zip(&self.gpu_scratch[start..end]) {
                node.add_call_scratch(scratch.times(config.micro_batch_rows as u64));
            }
        }
        let n_ranks = nodes.iter().map(NodeMemory::n_ranks).max().unwrap_or(1);
        let output_node = self.output_position.filter(|p| (start..end).contains(p)).map(|p| p - start);
        let shape = StageShape {
            nodes: nodes.iter().collect(),
            inputs,
            routes,
            output_node,
            received,
            data,
            n_ranks,
            half_gradient_sums: self.half_gradient_sums,
        };
        let print = footprint(&shape);
        let moments = config.moments(n_stages, stage_idx)?;
        let n_micro_batches = config.n_micro_batches(n_stages);
        // Per rank: every moment's (activations, messages, scratch).
        let per_rank: Vec<Vec<[u64; 3]>> = (0..n_ranks)
            .map(|rank| {
                moments.iter().map(|m| moment_bytes(m, &print, &waiting, config, n_micro_batches, rank)).collect()
            })
            .collect();
        let state_factor = config.optimizer.state_factor();
        let mut members: Vec<StageMemory> = (0..n_ranks)
            .map(|rank| {
                let params: u64 = nodes.iter().map(|n| at(&n.params, rank)).sum();
                let busiest = per_rank[rank].iter().copied().max_by_key(|[a, m, s]| a + m + s).unwrap_or_default();
                StageMemory {
                    params,
                    grads: params,
                    optimizer_state: params * state_factor,
                    activations: busiest[0],
                    messages: busiest[1],
                    scratch: busiest[2],
                    ..StageMemory::default()
                }
            })
            .collect();
        let fits = |members: &[StageMemory], extra: &[u64]| {
            budget.is_none_or(|b| members.iter().enumerate().all(|(rank, m)| m.total() + at(extra, rank) <= b))
        };
        // The undo snapshot first: it keeps a failed commit from losing the step, where a cache
        // only saves time.
        let snapshot: Vec<u64> = members.iter().map(|m| m.params + m.optimizer_state).collect();
        let keep_snapshot = config.commit_snapshot && fits(&members, &snapshot);
        for (m, bytes) in members.iter_mut().zip(&snapshot) {
            if keep_snapshot {
                m.commit_snapshot = *bytes;
            } else {
                m.commit_snapshot_dropped = *bytes;
            }
        }
        // Then the derived caches (on the stage's device), the most used (largest FLOPs) first,
        // each kept if it still fits.
        let mut derived_caches = vec![false; end - start];
        let mut dropped_caches = Vec::new();
        if config.count_workspace {
            let mut by_flops: Vec<usize> = (0..end - start).filter(|&j| self.workspace_bytes[start + j] > 0).collect();
            let node_flops = |j: usize| {
                let n = start + j;
                (self.prefix_forward_flops[n + 1] - self.prefix_forward_flops[n])
                    + (self.prefix_backward_input_flops[n + 1] - self.prefix_backward_input_flops[n])
            };
            by_flops.sort_by(|&a, &b| node_flops(b).total_cmp(&node_flops(a)).then(a.cmp(&b)));
            for j in by_flops {
                let bytes = self.workspace_bytes[start + j];
                let keep = match config.weight_cache {
                    WeightCache::Auto => fits(&members, &[bytes]),
                    // Kept whether or not they fit: a stage they push over its budget does not fit.
                    WeightCache::On => true,
                    WeightCache::Off => false,
                };
                if keep {
                    members[0].workspace += bytes;
                    derived_caches[j] = true;
                } else {
                    members[0].workspace_dropped += bytes;
                    dropped_caches.push(j);
                }
            }
        }
        dropped_caches.sort_unstable();
        let dropped_caches = dropped_caches.into_iter().map(|j| self.names[start + j].clone()).collect();
        let timeline = per_rank.iter().map(|moments| moments.iter().map(|[a, m, s]| a + m + s).collect()).collect();
        let memory = members.remove(0);
        Ok(StageEstimate { memory, members, derived_caches, dropped_caches, timeline, times: [0.0; 4] })
    }
}

/// The bytes of one moment on `rank`: (activations kept, messages waiting, the running op's
/// working set beyond them).
fn moment_bytes(
    moment: &Moment,
    print: &StageFootprint,
    waiting: &Waiting,
    config: &PlanConfig,
    n_micro_batches: usize,
    rank: usize,
) -> [u64; 3] {
    let whole = match config.recompute {
        Recompute::Never => moment.n_forward,
        Recompute::Always => 0,
        Recompute::ExceptLast => usize::from(moment.forward_has_last),
    } as u64;
    let kept = moment.n_forward as u64 - whole;
    let activations = whole * at(&print.stash_forward, rank)
        + kept * at(&print.stash_kept, rank)
        + moment.n_backward as u64 * at(&print.stash_backward, rank);
    let dot = |counts: &[usize], bytes: &[u64]| counts.iter().zip(bytes).map(|(&c, &b)| c as u64 * b).sum::<u64>();
    let waiting = if rank == 0 {
        dot(&moment.queued_forward, &waiting.forward)
            + dot(&moment.queued_gradient, &waiting.gradient)
            + moment.outputs_held as u64 * waiting.output
    } else {
        0
    };
    let scratch = match moment.running {
        None => 0,
        Some(Running::Forward) => at(&print.peak_forward, rank),
        Some(Running::Evaluate) => at(&print.peak_evaluation, rank),
        Some(Running::BackwardInput { micro_batch_idx, fused }) => {
            let recompute = config.recomputes(micro_batch_idx, n_micro_batches);
            if fused {
                at(&print.peak_backward(recompute), rank)
            } else if recompute {
                at(&print.peak_backward_input_recompute, rank)
            } else {
                at(&print.peak_backward_input, rank)
            }
        }
        Some(Running::BackwardWeight) => at(&print.peak_backward_weight, rank),
    };
    [activations, waiting, scratch]
}

/// A stage's nodes as [`StageShape`] takes them, and what it receives.
struct StageParts {
    nodes: Vec<NodeMemory>,
    inputs: Vec<Vec<StageInput>>,
    routes: Vec<usize>,
    received: Vec<u64>,
    data: Vec<u64>,
    waiting: Waiting,
}

/// Bytes per micro-batch of what a stage receives or keeps outside its ops: activations by
/// sending stage (index `t`), gradients by sending stage (index `t - stage_idx - 1`), and the
/// graph output an evaluation step keeps. (A micro-batch's data reaches the device when its
/// forward begins, so it is part of the running op.)
#[derive(Clone, Debug)]
struct Waiting {
    forward: Vec<u64>,
    gradient: Vec<u64>,
    output: u64,
}

/// What [`NodeCosts::stage`] estimates for one stage.
#[derive(Clone, Debug)]
pub(crate) struct StageEstimate {
    /// Memory on the stage's device.
    pub memory: StageMemory,
    /// Memory on the other devices of a tensor-parallel group (rank 1 on).
    pub members: Vec<StageMemory>,
    /// Per node of the stage: whether it keeps its derived caches.
    pub derived_caches: Vec<bool>,
    /// Names of the nodes whose caches were dropped to fit.
    pub dropped_caches: Vec<String>,
    /// Per rank, per moment of the schedule: bytes beyond the persistent ones.
    pub timeline: Vec<Vec<u64>>,
    /// Forward, input-gradient, weight-gradient and transfer seconds per micro-batch.
    pub times: [f64; 4],
}

impl StageEstimate {
    /// Whether every device of the stage fits `budget`.
    pub fn fits(&self, budget: Option<u64>) -> bool {
        budget.is_none_or(|b| std::iter::once(&self.memory).chain(&self.members).all(|m| m.total() <= b))
    }

    /// The largest need of the stage's devices.
    pub fn largest_total(&self) -> u64 {
        std::iter::once(&self.memory).chain(&self.members).map(StageMemory::total).max().unwrap_or(0)
    }
}

/// Builds the [`super::StagePlan`] for a given set of cut points (`cuts[k]..cuts[k + 1]` is stage k).
pub(crate) fn plan_from_cuts(
    costs: &NodeCosts,
    config: &PlanConfig,
    devices: &[DeviceSpec],
    cuts: &[usize],
) -> Result<super::Plan> {
    let n_stages = cuts.len() - 1;
    // With the whole placement known, every message's sender is known.
    let stage_of: Vec<usize> = (0..n_stages).flat_map(|s| std::iter::repeat_n(s, cuts[s + 1] - cuts[s])).collect();
    let mut stages = Vec::with_capacity(n_stages);
    for stage_idx in 0..n_stages {
        let (start, end) = (cuts[stage_idx], cuts[stage_idx + 1]);
        let estimate = costs.stage(config, &devices[stage_idx], n_stages, stage_idx, (start, end), Some(&stage_of))?;
        let [forward_s, backward_input_s, backward_weight_s, transfer_s] = estimate.times;
        stages.push(super::StagePlan {
            stage_idx,
            device_idx: stage_idx,
            nodes: costs.order[start..end].to_vec(),
            node_names: costs.names[start..end].to_vec(),
            n_params: costs.param_bytes(start, end) / 4,
            memory: estimate.memory,
            member_memory: estimate.members,
            derived_caches: estimate.derived_caches,
            dropped_caches: estimate.dropped_caches,
            memory_timeline: estimate.timeline,
            forward_s,
            backward_input_s,
            backward_weight_s,
            transfer_s,
        });
    }
    Ok(super::Plan { stages, devices: devices[..n_stages].to_vec(), config: config.clone() })
}

/// Seconds with a unit that keeps three or four significant digits: `12.3 µs`, `1.234 ms`, `2.50 s`.
pub fn format_seconds(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.1} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// Formats a byte count with binary units.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes} B") } else { format!("{value:.1} {}", UNITS[unit]) }
}

/// Flop-equivalents per byte a pass moves through memory, added to each pass's FLOPs when the
/// planner estimates its time. Elementwise ops, pooling and normalisation are bound by memory
/// traffic, not arithmetic: counted by FLOPs alone (1 a element for ReLU) they came out 20-200
/// times faster than measured, so `--placement auto` cut the CNN after its pool, leaving the
/// second stage a tenth of the work. Measured on one core with [`super::profile_graph`]: ReLU,
/// GELU, max-pool and LayerNorm move 1-4 GB/s per core while products run at about
/// [`super::CPU_FLOPS_PER_S`] (50 GFLOP/s), so a byte costs about 12.5 FLOPs. (A GPU's ratio,
/// about 100 TFLOP/s over 3-4 TB/s, is of the same order.)
pub const FLOPS_PER_BYTE_MOVED: f64 = 12.5;

/// Bytes per sample each pass of node `id` reads and writes, `[forward, input gradient, weight
/// gradient]`: the forward reads its inputs and writes its output; the input-gradient pass reads
/// the output's gradient and writes the gradient of each input that takes one; the
/// weight-gradient pass reads its inputs and the output's gradient. A pass without FLOPs (a view,
/// such as Flatten, or a layer without parameters' weight pass) moves nothing.
fn pass_traffic(graph: &Graph, id: NodeId, cost: &LayerCost, graph_inputs: &[NodeId]) -> Result<[u64; 3]> {
    let (mut read, mut grad_written) = (0u64, 0u64);
    for pred in graph.predecessors(id) {
        let bytes = 4 * graph.node(pred)?.output_shape.numel() as u64;
        read += bytes;
        if !graph_inputs.contains(&pred) {
            grad_written += bytes;
        }
    }
    let out = cost.output_bytes_per_sample;
    let when = |flops: u64, bytes: u64| if flops == 0 { 0 } else { bytes };
    Ok([
        when(cost.forward_flops_per_sample, read + out),
        when(cost.backward_input_flops_per_sample, out + grad_written),
        when(cost.backward_weight_flops_per_sample, read + out),
    ])
}
