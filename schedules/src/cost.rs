//! The cost model the simulator times a schedule with: per-stage compute costs (optionally
//! overridden op by op, as a measured run gives them), one link model and per-stage message sizes.
use std::collections::HashMap;

use serde::Serialize;

use crate::error::ScheduleError;
use crate::timeline::OpKind;

/// One compute op of one step: `(stage_idx, op, micro_batch_idx)`.
pub type OpKey = (usize, OpKind, usize);

/// Seconds one micro-batch spends in each compute op of one stage. A fused `Backward` costs
/// `backward_input_s + backward_weight_s`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StageCosts {
    /// Forward pass (`F`).
    pub forward_s: f64,
    /// Gradient with respect to the stage's input (`B`).
    pub backward_input_s: f64,
    /// Gradient with respect to the stage's weights (`W`).
    pub backward_weight_s: f64,
}

impl StageCosts {
    /// `F = B = W = 1` second: the unit costs the bubble formulas are stated in.
    pub const UNIT: StageCosts = StageCosts { forward_s: 1.0, backward_input_s: 1.0, backward_weight_s: 1.0 };

    /// Costs from `F`, `B` and `W` in seconds.
    pub fn new(forward_s: f64, backward_input_s: f64, backward_weight_s: f64) -> StageCosts {
        StageCosts { forward_s, backward_input_s, backward_weight_s }
    }

    /// The cost of a fused backward: `B + W`.
    pub fn backward_s(&self) -> f64 {
        self.backward_input_s + self.backward_weight_s
    }
}

/// A point-to-point link: sending `bytes` takes `latency_s + bytes / bandwidth_bytes_per_s`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Link {
    /// Fixed cost per message, seconds.
    pub latency_s: f64,
    /// Bytes per second; `f64::INFINITY` for free transfers.
    pub bandwidth_bytes_per_s: f64,
}

impl Link {
    /// No latency, infinite bandwidth: messages arrive when they are sent.
    pub const FREE: Link = Link { latency_s: 0.0, bandwidth_bytes_per_s: f64::INFINITY };

    /// Seconds to move `bytes` over this link.
    pub fn transfer_s(&self, bytes: u64) -> f64 {
        self.latency_s + bytes as f64 / self.bandwidth_bytes_per_s
    }
}

/// Sizes of the messages one stage sends: its output activation (to `s + 1`) and the gradient
/// of its input (to `s - 1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct MessageBytes {
    /// Bytes of the activation stage `s` sends forward.
    pub activation_bytes: u64,
    /// Bytes of the gradient stage `s` sends backward.
    pub gradient_bytes: u64,
}

/// Everything the simulator needs to time a schedule. Per-stage lists hold either one entry
/// (applied to every stage) or one entry per stage. Messages between two stages on the same
/// device cost nothing.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CostModel {
    stage_costs: Vec<StageCosts>,
    link: Link,
    message_bytes: Vec<MessageBytes>,
    optimizer_step_s: f64,
    /// From the last device's last op to the optimizer steps' start (the commit round trip).
    commit_latency_s: f64,
    /// Each device's own commit latency, overriding `commit_latency_s` (empty: none).
    #[serde(skip)]
    device_commit_latency_s: Vec<f64>,
    /// Seconds of individual ops, overriding `stage_costs` for those ops.
    #[serde(skip)]
    op_costs: HashMap<OpKey, f64>,
    /// The part of an op's cost during which its device is occupied but not computing.
    #[serde(skip)]
    op_overheads: HashMap<OpKey, f64>,
    /// When each device can start its program (empty: all at 0).
    #[serde(skip)]
    device_start_s: Vec<f64>,
    /// Each device's own optimizer step, overriding `optimizer_step_s` (empty: none).
    #[serde(skip)]
    device_optimizer_step_s: Vec<f64>,
    /// Each device's gradient all-reduce across data-parallel replicas, run when the device
    /// reaches its optimizer step and before the commit (empty: none).
    #[serde(skip)]
    device_all_reduce_s: Vec<f64>,
    all_reduce_in_buckets: bool,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel::uniform(StageCosts::UNIT)
    }
}

impl CostModel {
    /// The same costs on every stage, free communication, a free optimizer step.
    pub fn uniform(costs: StageCosts) -> CostModel {
        CostModel::per_stage(vec![costs])
    }

    /// One entry per stage (or a single entry for all), free communication.
    pub fn per_stage(stage_costs: Vec<StageCosts>) -> CostModel {
        CostModel {
            stage_costs,
            link: Link::FREE,
            message_bytes: vec![MessageBytes::default()],
            optimizer_step_s: 0.0,
            commit_latency_s: 0.0,
            device_commit_latency_s: Vec::new(),
            op_costs: HashMap::new(),
            op_overheads: HashMap::new(),
            device_start_s: Vec::new(),
            device_optimizer_step_s: Vec::new(),
            device_all_reduce_s: Vec::new(),
            all_reduce_in_buckets: false,
        }
    }

    /// Uses `link` for every message between devices.
    pub fn with_link(mut self, link: Link) -> CostModel {
        self.link = link;
        self
    }

    /// Every stage sends messages of these sizes.
    pub fn with_message_bytes(self, message_bytes: MessageBytes) -> CostModel {
        self.with_message_bytes_per_stage(vec![message_bytes])
    }

    /// Message sizes by sending stage (one entry, or one per stage).
    pub fn with_message_bytes_per_stage(mut self, message_bytes: Vec<MessageBytes>) -> CostModel {
        self.message_bytes = message_bytes;
        self
    }

    /// Seconds each device spends in its optimizer step.
    pub fn with_optimizer_step_s(mut self, optimizer_step_s: f64) -> CostModel {
        self.optimizer_step_s = optimizer_step_s;
        self
    }

    /// Seconds from the moment every device has finished its ops to the start of the optimizer
    /// steps: the coordinator's commit round trip (0 by default).
    pub fn with_commit_latency_s(mut self, commit_latency_s: f64) -> CostModel {
        self.commit_latency_s = commit_latency_s;
        self
    }

    /// The commit latency.
    pub fn commit_latency_s(&self) -> f64 {
        self.commit_latency_s
    }

    /// Gives each device its own commit latency (a measured run's: the commit reaches each
    /// worker when the operating system wakes it). Devices past the list keep
    /// [`CostModel::commit_latency_s`].
    pub fn with_device_commit_latency_s(mut self, device_commit_latency_s: Vec<f64>) -> CostModel {
        self.device_commit_latency_s = device_commit_latency_s;
        self
    }

    /// The commit latency of `device_idx`.
    pub fn device_commit_latency_s(&self, device_idx: usize) -> f64 {
        self.device_commit_latency_s.get(device_idx).copied().unwrap_or(self.commit_latency_s)
    }

    /// Gives individual ops their own costs (a measured run's op durations): `(stage, op,
    /// micro-batch)` with `op` one of `Forward`, `BackwardInput`, `BackwardWeight`, `Backward`.
    /// Ops without an entry keep their stage's cost.
    pub fn with_op_costs(mut self, op_costs: impl IntoIterator<Item = (OpKey, f64)>) -> CostModel {
        self.op_costs.extend(op_costs);
        self
    }

    /// Marks the last `seconds` of individual ops' costs as overhead: the device is occupied (it
    /// starts nothing else and the op's messages leave at the end) but not computing, so the
    /// simulated timeline records the op as busy only until `cost - overhead`. A measured run's
    /// ops hold their device past their recorded span (sending, freeing buffers, a descheduled
    /// thread); giving the simulator that time as overhead rather than compute keeps its busy
    /// time equal to the measured one, so the two bubble fractions differ only by timing.
    pub fn with_op_overheads(mut self, op_overheads: impl IntoIterator<Item = (OpKey, f64)>) -> CostModel {
        self.op_overheads.extend(op_overheads);
        self
    }

    /// The overhead given to one op by [`CostModel::with_op_overheads`] (0 when none).
    pub fn op_overhead_s(&self, key: OpKey) -> f64 {
        self.op_overheads.get(&key).copied().unwrap_or(0.0)
    }

    /// When each device starts its program (a measured run's: the worker's first event), so the
    /// simulator does not assume every device starts at once. Devices past the list start at 0.
    pub fn with_device_start_s(mut self, device_start_s: Vec<f64>) -> CostModel {
        self.device_start_s = device_start_s;
        self
    }

    /// Gives each device its own optimizer step (a measured run's: stages of different sizes
    /// update different numbers of parameters). Devices past the list keep
    /// [`CostModel::optimizer_step_s`].
    pub fn with_device_optimizer_step_s(mut self, device_optimizer_step_s: Vec<f64>) -> CostModel {
        self.device_optimizer_step_s = device_optimizer_step_s;
        self
    }

    /// Gives each device a gradient all-reduce across data-parallel replicas: the simulator runs
    /// it (as an [`crate::OpKind::AllReduce`] event) as soon as the device reaches its optimizer
    /// step, and the commit waits for every device's, as the runtime sums each stage's gradients
    /// with the other replicas' copies of that stage before it votes. The replicas run the same
    /// program on equal devices, so one replica's timeline stands for all. Devices past the list
    /// have none.
    pub fn with_device_all_reduce_s(mut self, device_all_reduce_s: Vec<f64>) -> CostModel {
        self.device_all_reduce_s = device_all_reduce_s;
        self
    }

    /// Runs each device's gradient all-reduce in buckets beside its backward pass (the runtime's
    /// `bucket_size`): it starts when the device starts its final weight pass (the weight pass,
    /// or fused backward, of the last micro-batch, which makes the gradients final node by node)
    /// instead of at the optimizer step, on the device's communication thread, and the commit
    /// waits for its end. A model of the overlap: the runtime's first bucket starts after the
    /// last node's weight gradient, a little later.
    pub fn with_all_reduce_in_buckets(mut self, in_buckets: bool) -> CostModel {
        self.all_reduce_in_buckets = in_buckets;
        self
    }

    /// Whether the all-reduce overlaps the final weight pass ([`CostModel::with_all_reduce_in_buckets`]).
    pub fn all_reduce_in_buckets(&self) -> bool {
        self.all_reduce_in_buckets
    }

    /// The gradient all-reduce's cost on `device_idx` (0 without data parallelism).
    pub fn device_all_reduce_s(&self, device_idx: usize) -> f64 {
        self.device_all_reduce_s.get(device_idx).copied().unwrap_or(0.0)
    }

    /// The optimizer step's cost on `device_idx`.
    pub fn device_optimizer_step_s(&self, device_idx: usize) -> f64 {
        self.device_optimizer_step_s.get(device_idx).copied().unwrap_or(self.optimizer_step_s)
    }

    /// When `device_idx` can start its program.
    pub fn device_start_s(&self, device_idx: usize) -> f64 {
        self.device_start_s.get(device_idx).copied().unwrap_or(0.0)
    }

    /// The cost given to one op by [`CostModel::with_op_costs`], if any.
    pub fn op_cost(&self, key: OpKey) -> Option<f64> {
        self.op_costs.get(&key).copied()
    }

    /// The link.
    pub fn link(&self) -> Link {
        self.link
    }

    /// The optimizer step's cost.
    pub fn optimizer_step_s(&self) -> f64 {
        self.optimizer_step_s
    }

    /// Costs of `stage_idx`.
    pub fn stage_costs(&self, stage_idx: usize) -> StageCosts {
        pick(&self.stage_costs, stage_idx)
    }

    /// Message sizes sent by `stage_idx`.
    pub fn message_bytes(&self, stage_idx: usize) -> MessageBytes {
        pick(&self.message_bytes, stage_idx)
    }

    /// Checks lengths against `n_stages` and that every number is usable.
    pub fn check(&self, n_stages: usize) -> Result<(), ScheduleError> {
        for (what, len) in [("stage costs", self.stage_costs.len()), ("message bytes", self.message_bytes.len())] {
            if len != 1 && len != n_stages {
                return Err(ScheduleError::PerStageLength { what, got: len, n_stages });
            }
        }
        let non_negative = |what: String, value: f64| {
            if value.is_finite() && value >= 0.0 { Ok(()) } else { Err(ScheduleError::InvalidCost { what, value }) }
        };
        for (stage_idx, costs) in self.stage_costs.iter().enumerate() {
            non_negative(format!("forward_s of stage {stage_idx}"), costs.forward_s)?;
            non_negative(format!("backward_input_s of stage {stage_idx}"), costs.backward_input_s)?;
            non_negative(format!("backward_weight_s of stage {stage_idx}"), costs.backward_weight_s)?;
        }
        for (&(stage_idx, op, micro_batch_idx), &seconds) in &self.op_costs {
            non_negative(format!("{op:?} of stage {stage_idx}, micro-batch {micro_batch_idx}"), seconds)?;
        }
        for (&(stage_idx, op, micro_batch_idx), &seconds) in &self.op_overheads {
            non_negative(format!("overhead of {op:?} of stage {stage_idx}, micro-batch {micro_batch_idx}"), seconds)?;
        }
        for (device_idx, &start_s) in self.device_start_s.iter().enumerate() {
            non_negative(format!("start of device {device_idx}"), start_s)?;
        }
        for (device_idx, &seconds) in self.device_optimizer_step_s.iter().enumerate() {
            non_negative(format!("optimizer step of device {device_idx}"), seconds)?;
        }
        for (device_idx, &seconds) in self.device_all_reduce_s.iter().enumerate() {
            non_negative(format!("gradient all-reduce of device {device_idx}"), seconds)?;
        }
        non_negative("latency_s".into(), self.link.latency_s)?;
        non_negative("optimizer_step_s".into(), self.optimizer_step_s)?;
        non_negative("commit_latency_s".into(), self.commit_latency_s)?;
        for (device_idx, &seconds) in self.device_commit_latency_s.iter().enumerate() {
            non_negative(format!("commit latency of device {device_idx}"), seconds)?;
        }
        let bandwidth = self.link.bandwidth_bytes_per_s;
        if bandwidth.is_nan() || bandwidth <= 0.0 {
            return Err(ScheduleError::InvalidCost { what: "bandwidth_bytes_per_s".into(), value: bandwidth });
        }
        Ok(())
    }
}

fn pick<T: Copy>(entries: &[T], stage_idx: usize) -> T {
    if entries.len() == 1 { entries[0] } else { entries[stage_idx] }
}
