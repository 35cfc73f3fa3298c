//! The planner's memory model: the most bytes a stage's device holds at any moment of a training
//! step, as an upper bound that is also tight. See `README.md` beside this file for the argument.
//!
//! Three parts, each in its own file:
//!
//! - [`NodeMemory`] (this file, and `probe.rs`): how one layer node uses memory on one micro-batch:
//!   its output, what it saves for backward (its own tensors, or shares of its input or output),
//!   its input gradients, and the most it holds during each call. Derived from
//!   [`crate::LayerCost`] (a conservative estimate that assumes no sharing), or measured by running
//!   the layer once ([`measure_node_memory`]: exact).
//! - `footprint.rs`: a symbolic replay of what the runtime's stage does with those tensors for one
//!   micro-batch (run every layer, keep the outputs it sends, compute the loss, send, keep or drop
//!   the saved tensors, accumulate gradients, ...), giving the bytes a micro-batch holds between
//!   ops and the peak during each op ([`StageFootprint`]).
//! - `moments.rs`: for every instruction of a device's program, how many micro-batches of each
//!   stage are in which state and how many messages can be waiting in its channels at worst
//!   ([`ScheduleMemory`]). Combined with a footprint this bounds the stage's bytes over the step.
mod footprint;
mod moments;
mod probe;

pub(crate) use footprint::{StageFootprint, StageInput, StageShape, footprint};
pub use moments::ScheduleMemory;
pub(crate) use moments::{Moment, Running};
pub use probe::{
    measure_node_memory, measure_node_memory_at, measure_node_memory_on, measure_node_memory_on_cross_entropy,
    measure_node_memory_on_device,
};

use crate::{CallScratch, LayerCost};

/// The device of a tensor in a layer call, as an index into the stage's device group: 0 is the
/// stage's device (inputs, outputs, gradients, unsplit layers); `r > 0` is the `r`-th device of a
/// tensor-parallel group.
pub type Rank = usize;

/// What a layer's forward returns as output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OutputMemory {
    /// New bytes on the stage's device.
    New(u64),
    /// A share of input `i` (a view such as `Flatten`): no new bytes.
    ShareOfInput(usize),
}

/// One tensor a layer's forward saves for its backward.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SavedMemory {
    /// A share of input `i` (held as long as the saved state is).
    Input(usize),
    /// A share of the output.
    Output,
    /// Its own bytes on device `rank`.
    Own {
        /// Where they live.
        rank: Rank,
        /// How many.
        bytes: u64,
    },
}

/// What a layer's input-gradient pass returns for one input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InputGradMemory {
    /// No gradient (the input takes none, or the layer gives none).
    None,
    /// New bytes on the stage's device.
    New(u64),
    /// A share of the output gradient (a view such as `Flatten`'s).
    ShareOfGradOutput,
}

/// How one layer node uses device memory on one micro-batch of `rows` rows (all byte counts are
/// for that many rows).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeMemory {
    /// Rows of the micro-batch the figures are for.
    pub rows: usize,
    /// The output.
    pub output: OutputMemory,
    /// Bytes of the output tensor (new or shared): what a message carrying it or its gradient holds.
    pub output_bytes: u64,
    /// What the forward saves.
    pub saved: Vec<SavedMemory>,
    /// Per rank: the most bytes reserved during the forward call beyond what was reserved before
    /// it (at least the new output and saved bytes).
    pub forward_peak: Vec<u64>,
    /// Per input: the input-gradient pass's result (inputs that take no gradient: `None`).
    pub input_grads: Vec<InputGradMemory>,
    /// Per rank: the most bytes reserved during the input-gradient call beyond what was reserved
    /// before it (at least the new input gradients).
    pub backward_input_peak: Vec<u64>,
    /// Per rank: the most bytes reserved during the weight-gradient call beyond what was reserved
    /// before it (the gradients are added in place; a layer may sum the micro-batch's part in a
    /// buffer first, [`crate::Layer::weight_pass_scratch_bytes`]).
    pub backward_weight_peak: Vec<u64>,
    /// Per rank: bytes the input-gradient call leaves for the weight call of the same
    /// micro-batch ([`LayerCost::backward_held_bytes_per_sample`]); included in
    /// `backward_input_peak`.
    pub backward_held: Vec<u64>,
    /// Per rank: parameter bytes (gradients take as many; optimizer state is counted as f32).
    pub params: Vec<u64>,
    /// What the node holds instead when, as the graph's output in training, it computes the
    /// loss itself ([`crate::Layer::forward_cross_entropy`]); `None`: it does not.
    pub own_loss: Option<OwnLossMemory>,
}

/// What a node's [`crate::Layer::forward_cross_entropy`] call takes on one micro-batch: what it
/// saves (a split output layer: its input copies and each shard's logit gradient) and its peak.
/// Its output is no tensor, and the gradient the runtime gives its backward calls one number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnLossMemory {
    /// What the call saves.
    pub saved: Vec<SavedMemory>,
    /// Per rank: the most bytes reserved during the call beyond what was reserved before it.
    pub forward_peak: Vec<u64>,
}

impl NodeMemory {
    /// The estimate from a layer's [`LayerCost`] for micro-batches of `rows` rows: a new output,
    /// saved tensors of their own (no shares), new input gradients the size of the inputs, all
    /// on the stage's device. Sharing only ever makes a layer hold less, so this bounds what a
    /// layer whose cost figures are right holds.
    /// `weight_pass_scratch` is [`crate::Layer::weight_pass_scratch_bytes`].
    pub fn from_cost(
        cost: &LayerCost,
        input_bytes_per_sample: &[u64],
        input_takes_grad: &[bool],
        rows: usize,
        weight_pass_scratch: u64,
    ) -> Self {
        let rows_u = rows as u64;
        let output = cost.output_bytes_per_sample * rows_u;
        let saved = cost.activation_bytes_per_sample * rows_u;
        let input_grads: Vec<InputGradMemory> = input_bytes_per_sample
            .iter()
            .zip(input_takes_grad)
            .map(|(&bytes, &takes)| if takes { InputGradMemory::New(bytes * rows_u) } else { InputGradMemory::None })
            .collect();
        let grads_bytes: u64 = input_grads.iter().map(InputGradMemory::new_bytes).sum();
        let held = cost.backward_held_bytes_per_sample * rows_u;
        NodeMemory {
            rows,
            output: OutputMemory::New(output),
            output_bytes: output,
            saved: if saved > 0 { vec![SavedMemory::Own { rank: 0, bytes: saved }] } else { Vec::new() },
            forward_peak: vec![output + saved],
            input_grads,
            backward_input_peak: vec![grads_bytes + held],
            backward_weight_peak: vec![weight_pass_scratch],
            backward_held: vec![held],
            params: vec![cost.param_bytes],
            own_loss: None,
        }
    }

    /// The devices the figures cover (1 for a layer on one device).
    pub fn n_ranks(&self) -> usize {
        self.params
            .len()
            .max(self.forward_peak.len())
            .max(self.backward_input_peak.len())
            .max(self.backward_weight_peak.len())
            .max(self.backward_held.len())
            .max(
                self.saved
                    .iter()
                    .chain(self.own_loss.iter().flat_map(|own| &own.saved))
                    .map(|s| if let SavedMemory::Own { rank, .. } = s { rank + 1 } else { 1 })
                    .max()
                    .unwrap_or(1),
            )
            .max(self.own_loss.as_ref().map_or(0, |own| own.forward_peak.len()))
    }

    /// The same node on micro-batches of `rows` rows: every per-micro-batch figure scaled by
    /// `rows / self.rows`, rounded up (parameters unchanged).
    pub fn scaled_to(&self, rows: usize) -> NodeMemory {
        if rows == self.rows {
            return self.clone();
        }
        let from = self.rows.max(1) as u64;
        let scale = |b: u64| (b * rows as u64).div_ceil(from);
        let scale_all = |v: &[u64]| v.iter().map(|&b| scale(b)).collect();
        let scale_saved = |saved: &[SavedMemory]| {
            saved
                .iter()
                .map(|s| match *s {
                    SavedMemory::Own { rank, bytes } => SavedMemory::Own { rank, bytes: scale(bytes) },
                    ref other => other.clone(),
                })
                .collect()
        };
        NodeMemory {
            rows,
            output: match self.output {
                OutputMemory::New(b) => OutputMemory::New(scale(b)),
                ref share => share.clone(),
            },
            output_bytes: scale(self.output_bytes),
            saved: scale_saved(&self.saved),
            forward_peak: scale_all(&self.forward_peak),
            input_grads: self
                .input_grads
                .iter()
                .map(|g| match *g {
                    InputGradMemory::New(b) => InputGradMemory::New(scale(b)),
                    ref other => other.clone(),
                })
                .collect(),
            backward_input_peak: scale_all(&self.backward_input_peak),
            // A parameter-sized buffer does not shrink with the rows: never below the measured.
            backward_weight_peak: self.backward_weight_peak.iter().map(|&b| scale(b).max(b)).collect(),
            backward_held: scale_all(&self.backward_held),
            params: self.params.clone(),
            own_loss: self.own_loss.as_ref().map(|own| OwnLossMemory {
                saved: scale_saved(&own.saved),
                forward_peak: scale_all(&own.forward_peak),
            }),
        }
    }

    /// Adds `scratch` (bytes a call reserves and frees before it returns) to every rank's peak of
    /// each call: a bound, as the figures were measured without it.
    pub fn add_call_scratch(&mut self, scratch: CallScratch) {
        let add = |peaks: &mut Vec<u64>, bytes: u64| {
            if peaks.is_empty() {
                peaks.push(0);
            }
            peaks.iter_mut().for_each(|p| *p = p.saturating_add(bytes));
        };
        add(&mut self.forward_peak, scratch.forward);
        if let Some(own) = &mut self.own_loss {
            add(&mut own.forward_peak, scratch.forward);
        }
        add(&mut self.backward_input_peak, scratch.backward_input);
        add(&mut self.backward_weight_peak, scratch.backward_weight);
    }

    /// Parameter bytes on all ranks together.
    pub fn total_params(&self) -> u64 {
        self.params.iter().sum()
    }
}

impl InputGradMemory {
    /// New bytes (0 for none or a share).
    pub fn new_bytes(&self) -> u64 {
        match self {
            InputGradMemory::New(b) => *b,
            _ => 0,
        }
    }
}

/// `v[rank]`, 0 past the end.
pub(crate) fn at(v: &[u64], rank: Rank) -> u64 {
    v.get(rank).copied().unwrap_or(0)
}
