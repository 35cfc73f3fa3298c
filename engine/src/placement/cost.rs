//! The planner's cost model: device speeds and budgets, the link model t = latency + bytes /
//! bandwidth, and the memory of a stage (parameters, gradients, optimizer state, activations in flight).
use crate::graph::{Graph, NodeId};
use crate::{Error, Result};

/// A device as the planner sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceSpec {
    /// Its name, e.g. `cpu:0`.
    pub name: String,
    /// Sustained f32 FLOP/s on layer work.
    pub flops_per_s: f64,
    /// Memory budget in bytes (none: unlimited).
    pub budget_bytes: Option<u64>,
}

impl DeviceSpec {
    /// A tensor-parallel group of devices as one planner device: `name` joins the members' names
    /// with `+`, the speed is their sum and the budget the sum of theirs (unlimited when any is).
    ///
    /// This treats a stage split `k` ways as `k` times faster and larger, which holds for the
    /// split layers (their FLOPs and parameters divide evenly) but not for what stays whole: a
    /// stage's unsplit layers, its activations and the copies of inputs that split layers keep on
    /// every member all sit on the first device. Plans for groups are therefore optimistic for the
    /// first device; the runtime's budgets still hold every device to its own.
    pub fn group(members: &[DeviceSpec]) -> DeviceSpec {
        DeviceSpec {
            name: members.iter().map(|m| m.name.as_str()).collect::<Vec<_>>().join("+"),
            flops_per_s: members.iter().map(|m| m.flops_per_s).sum(),
            budget_bytes: members.iter().map(|m| m.budget_bytes).sum(),
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
    /// [`PlanConfig::new`] from the schedule simulator.
    pub inflight_by_n_stages: Vec<Vec<usize>>,
    /// Optimizer state.
    pub optimizer: OptimizerMemory,
    /// The link between devices.
    pub link: Link,
    /// Count the copies layers derive from their parameters (`LayerCost::workspace_bytes`, such
    /// as Linear's packed weights). True by default; false when every Linear and Conv will be
    /// split over a tensor-parallel group, whose shards keep no such copies.
    pub count_workspace: bool,
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
        }
    }

    pub(crate) fn inflight(&self, n_stages: usize, stage_idx: usize) -> Result<u64> {
        self.inflight_by_n_stages
            .get(n_stages.wrapping_sub(1))
            .and_then(|v| v.get(stage_idx))
            .map(|&n| n as u64)
            .ok_or_else(|| {
                Error::invalid("PlanConfig", format!("no in-flight count for stage {stage_idx} of {n_stages}"))
            })
    }
}

/// Memory of one stage, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StageMemory {
    /// Parameters.
    pub params: u64,
    /// Copies layers derive from their parameters (Linear's transposed weight).
    pub workspace: u64,
    /// Gradients (same size as the parameters).
    pub grads: u64,
    /// Optimizer state.
    pub optimizer_state: u64,
    /// Activations of the micro-batches in flight (saved tensors plus received inputs).
    pub activations: u64,
}

impl StageMemory {
    /// Everything.
    pub fn total(&self) -> u64 {
        self.params + self.workspace + self.grads + self.optimizer_state + self.activations
    }
}

/// Per-node figures in topological order, with prefix sums so any contiguous range costs O(1)
/// for compute and memory (transfers are summed over the range's boundary edges).
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
    prefix_saved_bytes: Vec<u64>,
    prefix_workspace_bytes: Vec<u64>,
    /// Output bytes per sample of each node in `order`.
    output_bytes: Vec<u64>,
    /// For each node in `order`, the positions (in `order`) of layer nodes it feeds.
    consumers: Vec<Vec<usize>>,
    /// For each node in `order`, positions of the layer nodes feeding it.
    producers: Vec<Vec<usize>>,
}

impl NodeCosts {
    /// Collects the costs of every layer node of a validated graph.
    pub fn of_graph(graph: &Graph) -> Result<Self> {
        graph.validate()?;
        let order: Vec<NodeId> =
            graph.topological_order()?.into_iter().filter(|&id| graph.layer(id).is_some()).collect();
        let position = |id: NodeId| order.iter().position(|&o| o == id);
        let mut costs = NodeCosts {
            names: Vec::new(),
            prefix_forward_flops: vec![0.0],
            prefix_backward_input_flops: vec![0.0],
            prefix_backward_weight_flops: vec![0.0],
            prefix_param_bytes: vec![0],
            prefix_saved_bytes: vec![0],
            prefix_workspace_bytes: vec![0],
            output_bytes: Vec::new(),
            consumers: Vec::new(),
            producers: Vec::new(),
            order: order.clone(),
        };
        for &id in &order {
            let c = graph.cost(id)?;
            let push_f = |v: &mut Vec<f64>, x: u64| v.push(v.last().unwrap() + x as f64);
            push_f(&mut costs.prefix_forward_flops, c.forward_flops_per_sample);
            push_f(&mut costs.prefix_backward_input_flops, c.backward_input_flops_per_sample);
            push_f(&mut costs.prefix_backward_weight_flops, c.backward_weight_flops_per_sample);
            costs.prefix_param_bytes.push(costs.prefix_param_bytes.last().unwrap() + c.param_bytes);
            costs.prefix_saved_bytes.push(costs.prefix_saved_bytes.last().unwrap() + c.activation_bytes_per_sample);
            costs.prefix_workspace_bytes.push(costs.prefix_workspace_bytes.last().unwrap() + c.workspace_bytes);
            costs.output_bytes.push(c.output_bytes_per_sample);
            costs.names.push(graph.node(id)?.name.clone());
            costs.consumers.push(graph.successors(id).into_iter().filter_map(position).collect());
            costs.producers.push(graph.predecessors(id).into_iter().filter_map(position).collect());
        }
        Ok(costs)
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
        NodeCosts {
            order: new_order.iter().map(|&o| self.order[o]).collect(),
            names: new_order.iter().map(|&o| self.names[o].clone()).collect(),
            prefix_forward_flops: diff_f(&self.prefix_forward_flops),
            prefix_backward_input_flops: diff_f(&self.prefix_backward_input_flops),
            prefix_backward_weight_flops: diff_f(&self.prefix_backward_weight_flops),
            prefix_param_bytes: diff_u(&self.prefix_param_bytes),
            prefix_saved_bytes: diff_u(&self.prefix_saved_bytes),
            prefix_workspace_bytes: diff_u(&self.prefix_workspace_bytes),
            output_bytes: new_order.iter().map(|&o| self.output_bytes[o]).collect(),
            consumers: remap(&self.consumers),
            producers: remap(&self.producers),
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

    /// The stage made of nodes `start..end` as stage `stage_idx` of `n_stages` on `device`.
    pub(crate) fn stage(
        &self,
        config: &PlanConfig,
        device: &DeviceSpec,
        n_stages: usize,
        stage_idx: usize,
        start: usize,
        end: usize,
    ) -> Result<(StageMemory, [f64; 4])> {
        let rows = config.micro_batch_rows as f64;
        let params = self.param_bytes(start, end);
        let (incoming, outgoing) = self.boundary_bytes(start, end);
        let saved = self.prefix_saved_bytes[end] - self.prefix_saved_bytes[start];
        let inflight = config.inflight(n_stages, stage_idx)?;
        let workspace = if config.count_workspace {
            self.prefix_workspace_bytes[end] - self.prefix_workspace_bytes[start]
        } else {
            0
        };
        let memory = StageMemory {
            params,
            workspace,
            grads: params,
            optimizer_state: params * config.optimizer.state_factor(),
            activations: inflight * config.micro_batch_rows as u64 * (saved + incoming),
        };
        let rows_u = config.micro_batch_rows as u64;
        // A forward receives the incoming activations; a backward receives the outgoing gradients.
        let forward_in = config.link.transfer_s(incoming * rows_u);
        let backward_in = config.link.transfer_s(outgoing * rows_u);
        let flops = |prefix: &[f64]| (prefix[end] - prefix[start]) * rows / device.flops_per_s;
        let forward_s = flops(&self.prefix_forward_flops) + forward_in;
        let backward_input_s = flops(&self.prefix_backward_input_flops) + backward_in;
        let backward_weight_s = flops(&self.prefix_backward_weight_flops);
        Ok((memory, [forward_s, backward_input_s, backward_weight_s, forward_in + backward_in]))
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
    let mut stages = Vec::with_capacity(n_stages);
    for stage_idx in 0..n_stages {
        let (start, end) = (cuts[stage_idx], cuts[stage_idx + 1]);
        let (memory, [forward_s, backward_input_s, backward_weight_s, transfer_s]) =
            costs.stage(config, &devices[stage_idx], n_stages, stage_idx, start, end)?;
        stages.push(super::StagePlan {
            stage_idx,
            device_idx: stage_idx,
            nodes: costs.order[start..end].to_vec(),
            node_names: costs.names[start..end].to_vec(),
            n_params: costs.param_bytes(start, end) / 4,
            memory,
            forward_s,
            backward_input_s,
            backward_weight_s,
            transfer_s,
        });
    }
    Ok(super::Plan { stages, devices: devices[..n_stages].to_vec(), config: config.clone() })
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
