//! `ParallelMlp`: Megatron's pairing of a column-split and a row-split Linear around an
//! elementwise activation, inside one layer so the hidden activation never leaves its device.
use conveyor_engine::collective::{Partition, Traffic};
use conveyor_engine::device::ops::Activation;
use conveyor_engine::{DType, Device, Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor};
use rand::rngs::StdRng;

use super::exchange::{gather_row_parallel, grads_per_rank, input_for_shard};
use super::group::{ShardGroup, Shards};
use super::layout::{column_block, with_last};
use super::pending::{Half, PendingSlots};
use super::{
    check_linear_input, check_linear_params, gather_rows, linear_cost, linear_shard, load_shard, shard_rows,
    split_features, unsplit_columns,
};
use crate::Linear;
use crate::tensor_io::{check_grad_shape, check_param_grads, expect_inputs, f32_bytes, into_dtype};

const KIND: &str = "ParallelMlp";

/// The elementwise function between the two Linears of a [`ParallelMlp`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MlpActivation {
    /// None: `fc2(fc1(x))`.
    Identity,
    /// `max(h, 0)`.
    Relu,
    /// Exact GELU (PyTorch's `approximate='none'`), Megatron's choice.
    #[default]
    Gelu,
}

impl MlpActivation {
    /// `act(h)` through the device op (the identity is a share of `h`, no copy).
    fn forward(self, hidden: &Tensor) -> Result<Tensor> {
        match self {
            MlpActivation::Identity => Ok(hidden.share()),
            MlpActivation::Relu => hidden.activation(Activation::Relu),
            MlpActivation::Gelu => hidden.activation(Activation::Gelu),
        }
    }

    /// `dh = act'(h) ⊙ da` through the device op (ReLU's mask `h > 0` equals `relu(h) > 0`).
    fn backward(self, hidden: &Tensor, grad: &Tensor) -> Result<Tensor> {
        match self {
            MlpActivation::Identity => Ok(grad.share()),
            MlpActivation::Relu => Tensor::activation_grad(Activation::Relu, hidden, grad),
            MlpActivation::Gelu => Tensor::activation_grad(Activation::Gelu, hidden, grad),
        }
    }
}

/// `y = fc2(act(fc1(x)))` with `fc1` split by output features and `fc2` by input features over the
/// same partition of the hidden features, so device `r` computes `h_r = x · fc1.weight_rᵀ +
/// fc1.bias_r`, `a_r = act(h_r)` and the partial `a_r · fc2.weight_rᵀ` with no exchange, and one
/// all-reduce sums the partials (`fc2.bias` is added once, on the first device).
///
/// Exchanges per call: forward broadcasts `x` and all-reduces `y`; `backward_input` broadcasts
/// `dy` and all-reduces the partial `dx_r = (act'(h_r) ⊙ dy · fc2.weight_r) · fc1.weight_r`;
/// `backward_weight` broadcasts `dy` and recomputes `a_r` locally. With one shard per rank (MPI,
/// [`Shards::Rank`]) every rank is called with the same `x` and `dy`, so nothing is broadcast.
///
/// The hidden gradient `act'(h_r) ⊙ dy · fc2.weight_r` is needed by both backward calls: whichever
/// runs first computes every local shard's and leaves it in a pending slot keyed by the saved
/// hidden block and the output gradient, and the other takes it out (as `ParallelSelfAttention`
/// does with `∂L/∂qkv`); the memory plan counts the slot (`backward_held_bytes_per_sample`).
///
/// `parameters()` is rank-major over the shards held here: for each its `fc1.weight` shard,
/// `fc1.bias` shard, `fc2.weight` shard, and with shard 0 `fc2.bias` (unsplit) after its
/// `fc2.weight`.
///
/// A group of one device is the unsplit block (what the transformer's tensor-parallel form holds
/// for a block no group splits); it alone can move to another device ([`Layer::to_device`]).
#[derive(Debug)]
pub struct ParallelMlp {
    in_features: usize,
    hidden_features: usize,
    out_features: usize,
    activation: MlpActivation,
    parts: Partition,
    fc1_bias: bool,
    fc2_bias: bool,
    params: Vec<Parameter>,
    /// Index of the first parameter of the i-th shard held here.
    offsets: Vec<usize>,
    group: ShardGroup,
    /// Every local shard's hidden gradient, computed by one backward call and waiting for the other.
    pending: PendingSlots,
}

impl ParallelMlp {
    /// Initialised exactly like `Linear::new(in, hidden, bias, rng)` then `Linear::new(hidden, out, bias, rng)`.
    pub fn new(
        in_features: usize,
        hidden_features: usize,
        out_features: usize,
        bias: bool,
        activation: MlpActivation,
        devices: &[Device],
        rng: &mut StdRng,
    ) -> Result<Self> {
        let fc1 = Linear::new(in_features, hidden_features, bias, rng)?;
        let fc2 = Linear::new(hidden_features, out_features, bias, rng)?;
        ParallelMlp::from_linears(&fc1, activation, &fc2, devices)
    }

    /// `fc2(act(fc1(x)))` from unsplit layers, split over `devices` by the hidden features.
    pub fn from_linears(fc1: &Linear, activation: MlpActivation, fc2: &Linear, devices: &[Device]) -> Result<Self> {
        ParallelMlp::from_linears_on(fc1, activation, fc2, &Shards::Local(devices.to_vec()))
    }

    /// [`Self::from_linears`] split as `shards` says (all shards here, or this rank's one); only
    /// the shards held here are created (`fc2.bias` with shard 0).
    pub fn from_linears_on(fc1: &Linear, activation: MlpActivation, fc2: &Linear, shards: &Shards) -> Result<Self> {
        let group = ShardGroup::new(KIND, shards)?;
        let (hidden_features, in_features) = check_linear_params(KIND, fc1.weight(), fc1.bias())?;
        let (out_features, fc2_in) = check_linear_params(KIND, fc2.weight(), fc2.bias())?;
        if fc2_in != hidden_features {
            return Err(Error::shape(
                format!("{KIND} fc2"),
                format!("{hidden_features} input features (fc1's outputs)"),
                fc2_in.to_string(),
            ));
        }
        let parts = split_features(KIND, "hidden_features", hidden_features, group.k())?;
        let (b1, b2) = (fc1.bias(), fc2.bias());
        let w2 = into_dtype(fc2.weight().share(), DType::F32)?;
        let mut params = Vec::new();
        let mut offsets = Vec::new();
        for (rank, device) in group.local_devices() {
            offsets.push(params.len());
            let hidden = parts.range(rank);
            let value = shard_rows(fc1.weight(), hidden.clone(), [hidden.len(), in_features], device)?;
            params.push(Parameter { name: "fc1.weight".into(), value });
            if let Some(b1) = b1 {
                let value = shard_rows(b1, hidden.clone(), [hidden.len()], device)?;
                params.push(Parameter { name: "fc1.bias".into(), value });
            }
            let w2_block = column_block(&w2, out_features, &parts, rank, vec![out_features, hidden.len()], device)?;
            params.push(Parameter { name: "fc2.weight".into(), value: w2_block });
            if rank == 0
                && let Some(b2) = b2
            {
                let value = shard_rows(b2, 0..out_features, [out_features], device)?;
                params.push(Parameter { name: "fc2.bias".into(), value });
            }
        }
        Ok(ParallelMlp {
            in_features,
            hidden_features,
            out_features,
            activation,
            parts,
            fc1_bias: b1.is_some(),
            fc2_bias: b2.is_some(),
            params,
            offsets,
            group,
            pending: PendingSlots::default(),
        })
    }

    /// Hidden features per device.
    pub fn partition(&self) -> &Partition {
        &self.parts
    }

    /// The devices of the shards held here, in shard order; inputs arrive on and outputs leave
    /// from the first.
    pub fn devices(&self) -> &[Device] {
        self.group.devices()
    }

    /// Messages and bytes each device (in rank order) has sent in this layer's collectives since
    /// construction or the last [`Self::reset_traffic`].
    pub fn traffic(&self) -> Vec<Traffic> {
        self.group.traffic()
    }

    /// Sets the sent-traffic counters to zero.
    pub fn reset_traffic(&self) {
        self.group.reset_traffic()
    }

    /// Indices of shard `rank`'s (fc1.weight, fc1.bias, fc2.weight, fc2.bias) in `parameters()`
    /// (a shard held here).
    fn slots(&self, rank: usize) -> (usize, Option<usize>, usize, Option<usize>) {
        let at = self.offsets[self.group.local_index(rank)];
        let b1 = self.fc1_bias.then_some(at + 1);
        let w2 = at + 1 + usize::from(self.fc1_bias);
        let b2 = (rank == 0 && self.fc2_bias).then_some(w2 + 1);
        (at, b1, w2, b2)
    }

    /// The parameters of each shard held here.
    fn counts(&self) -> Vec<usize> {
        (0..self.group.n_local())
            .map(|i| self.offsets.get(i + 1).copied().unwrap_or(self.params.len()) - self.offsets[i])
            .collect()
    }

    /// The unsplit parameters on the host under PyTorch's names: `fc1.weight`, `fc1.bias`,
    /// `fc2.weight`, `fc2.bias`. With one shard per rank this is a collective (all-gathers and a
    /// broadcast from shard 0): every rank of the group calls it, and every rank gets the unsplit
    /// tensors.
    pub fn gather_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let slots: Vec<_> = self.group.local().map(|r| self.slots(r)).collect();
        let w1: Vec<&Tensor> = slots.iter().map(|s| &self.params[s.0].value).collect();
        let w1_parts = self.parts.scaled(self.in_features);
        let mut out = vec![(
            "fc1.weight".to_string(),
            gather_rows(&self.group, &w1, &w1_parts, [self.hidden_features, self.in_features])?,
        )];
        if self.fc1_bias {
            let b1: Vec<&Tensor> = slots.iter().filter_map(|s| s.1).map(|i| &self.params[i].value).collect();
            out.push(("fc1.bias".to_string(), gather_rows(&self.group, &b1, &self.parts, [self.hidden_features])?));
        }
        let host = Device::host();
        if self.group.n_local() == self.group.k() {
            let w2: Vec<&Tensor> = slots.iter().map(|s| &self.params[s.2].value).collect();
            out.push(("fc2.weight".to_string(), unsplit_columns(&w2, self.out_features, &self.parts)?));
            if let Some(b2) = slots[0].3 {
                out.push(("fc2.bias".to_string(), self.params[b2].value.to_device(&host)?));
            }
            return Ok(out);
        }
        let mut gathered = self.group.run(vec![(); self.group.n_local()], |rank, comm, ()| {
            let (_, _, w2, b2) = self.slots(rank);
            let held = b2.map(|i| &self.params[i].value);
            gather_row_parallel(comm, &self.params[w2].value, self.fc2_bias, held, self.out_features, &self.parts)
        })?;
        let (weight, bias) = gathered.swap_remove(0);
        out.push(("fc2.weight".to_string(), weight));
        out.extend(bias.map(|b| ("fc2.bias".to_string(), b)));
        Ok(out)
    }

    /// Splits the unsplit tensor `name` (`fc1.weight`, `fc1.bias`, `fc2.weight`, `fc2.bias`) into the shards, in place.
    pub fn load_unsplit(&mut self, name: &str, value: &Tensor) -> Result<()> {
        let expected: Vec<usize> = match name {
            "fc1.weight" => vec![self.hidden_features, self.in_features],
            "fc1.bias" if self.fc1_bias => vec![self.hidden_features],
            "fc2.weight" => vec![self.out_features, self.hidden_features],
            "fc2.bias" if self.fc2_bias => vec![self.out_features],
            _ => {
                return Err(Error::invalid(
                    format!("{KIND} parameter"),
                    format!("`{name}`: expected fc1.weight, fc1.bias, fc2.weight or fc2.bias"),
                ));
            }
        };
        if value.dims() != expected {
            return Err(Error::shape(format!("{KIND} {name}"), format!("{expected:?}"), value.shape().to_string()));
        }
        let value = into_dtype(value.share(), DType::F32)?;
        for rank in self.group.local() {
            let (w1, b1, w2, b2) = self.slots(rank);
            let hidden = self.parts.range(rank);
            let (index, block) = match name {
                "fc1.weight" => (w1, value.narrow_rows(hidden.start, hidden.len())?),
                "fc1.bias" => (b1.expect("checked fc1_bias"), value.narrow_rows(hidden.start, hidden.len())?),
                "fc2.weight" => {
                    let dims = vec![self.out_features, hidden.len()];
                    (w2, column_block(&value, self.out_features, &self.parts, rank, dims, value.device())?)
                }
                _ => match b2 {
                    Some(b2) => (b2, value.share()),
                    None => continue,
                },
            };
            load_shard(&mut self.params[index].value, block)?;
        }
        Ok(())
    }

    /// The input's shape from a `Saved` of [`Layer::forward`]: the input copies, then the hidden
    /// blocks, of the shards held here.
    fn check_saved(&self, saved: &Saved) -> Result<Shape> {
        let k = self.group.n_local();
        let first = self.group.local().start;
        let bad = saved.tensors.len() != 2 * k
            || (0..k).any(|r| {
                saved.tensors[r].dims().last() != Some(&self.in_features)
                    || saved.tensors[r].dims() != saved.tensors[0].dims()
                    || saved.tensors[k + r].dims() != with_last(saved.tensors[0].shape(), self.parts.len(first + r))
            });
        if bad {
            return Err(Error::invalid(
                format!("{KIND} saved state"),
                format!(
                    "expected {k} input copies and {k} hidden blocks; pass the Saved returned by this layer's forward"
                ),
            ));
        }
        Ok(saved.tensors[0].shape().clone())
    }

    /// Bytes of hidden gradients waiting in slots for their second backward call.
    pub fn pending_gradient_bytes(&self) -> usize {
        self.pending.bytes()
    }

    /// Every local shard's hidden gradient from the slot the other backward call filled, if any
    /// (keyed by the first local shard's saved hidden block).
    fn take_pending(&self, saved: &Saved, grad_output: &Tensor, half: Half) -> Option<Vec<Tensor>> {
        self.pending.take(&saved.tensors[self.group.n_local()], grad_output, half)
    }

    /// Leaves `grad_hidden` for the other backward call of the same `Saved` and `dy`.
    fn leave_pending(&self, saved: &Saved, grad_output: &Tensor, grad_hidden: &[Tensor], half: Half) {
        self.pending.leave(&saved.tensors[self.group.n_local()], grad_output, grad_hidden, half)
    }

    /// Shard `rank`'s hidden gradient `act'(h_r) ⊙ (dy · fc2.weight_r)` from its copy of `dy`.
    fn shard_grad_hidden(&self, rank: usize, saved: &Saved, dy: &Tensor) -> Result<Tensor> {
        let (_, _, w2, _) = self.slots(rank);
        let hidden = &saved.tensors[self.group.n_local() + self.group.local_index(rank)];
        let grad_activated = linear_shard::input_grad(dy, &self.params[w2].value, hidden.shape())?;
        self.activation.backward(hidden, &grad_activated)
    }
}

impl Layer for ParallelMlp {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        super::linear_output_shape(KIND, input_shapes, self.in_features, self.out_features)
    }

    fn parameters(&self) -> &[Parameter] {
        &self.params
    }

    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut self.params
    }

    fn forward(&self, inputs: &[&Tensor], _ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        expect_inputs(KIND, inputs, 1)?;
        let input = inputs[0];
        check_linear_input(KIND, &self.group, input, self.in_features)?;
        let replicated = self.group.inputs_replicated();
        let results = self.group.run(vec![(); self.group.n_local()], |rank, comm, ()| {
            let device = self.group.device(rank);
            let (w1, b1, w2, b2) = self.slots(rank);
            let x = input_for_shard(comm, input, device, replicated)?;
            let hidden = linear_shard::forward(&x, &self.params[w1].value, b1.map(|i| &self.params[i].value))?;
            let activated = self.activation.forward(&hidden)?;
            let mut y = linear_shard::forward(&activated, &self.params[w2].value, b2.map(|i| &self.params[i].value))?;
            drop(activated);
            comm.all_reduce_tensor(&mut y)?;
            Ok((x, hidden, self.group.returns_output(rank).then_some(y)))
        })?;
        let mut copies = Vec::with_capacity(2 * results.len());
        let mut hiddens = Vec::with_capacity(results.len());
        let mut output = None;
        for (x, hidden, y) in results {
            copies.push(x);
            hiddens.push(hidden);
            output = output.or(y);
        }
        copies.extend(hiddens);
        let output = output.ok_or_else(|| Error::invalid(KIND, "rank 0 returned no output"))?;
        Ok((output, Saved { tensors: copies }))
    }

    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let input_shape = self.check_saved(saved)?;
        check_grad_shape(KIND, grad_output, &Shape::new(with_last(&input_shape, self.out_features)))?;
        self.group.check_input(KIND, grad_output)?;
        let replicated = self.group.inputs_replicated();
        let states: Vec<Option<Tensor>> = match self.take_pending(saved, grad_output, Half::Input) {
            Some(grads) => grads.into_iter().map(Some).collect(),
            None => (0..self.group.n_local()).map(|_| None).collect(),
        };
        let was_pending = states.iter().all(Option::is_some);
        let results = self.group.run(states, |rank, comm, grad_hidden| {
            let device = self.group.device(rank);
            let (w1, ..) = self.slots(rank);
            let grad_hidden = match grad_hidden {
                Some(grad_hidden) => grad_hidden,
                None => {
                    let dy = input_for_shard(comm, grad_output, device, replicated)?;
                    self.shard_grad_hidden(rank, saved, &dy)?
                }
            };
            let mut dx = linear_shard::input_grad(&grad_hidden, &self.params[w1].value, &input_shape)?;
            comm.all_reduce_tensor(&mut dx)?;
            Ok((grad_hidden, self.group.returns_output(rank).then_some(dx)))
        })?;
        let (grads, outputs): (Vec<Tensor>, Vec<Option<Tensor>>) = results.into_iter().unzip();
        if !was_pending {
            self.leave_pending(saved, grad_output, &grads, Half::Input);
        }
        Ok(vec![outputs.into_iter().flatten().next()])
    }

    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()> {
        check_param_grads(KIND, &self.params, param_grads)?;
        let input_shape = self.check_saved(saved)?;
        check_grad_shape(KIND, grad_output, &Shape::new(with_last(&input_shape, self.out_features)))?;
        self.group.check_input(KIND, grad_output)?;
        let k = self.group.n_local();
        let replicated = self.group.inputs_replicated();
        let pending = self.take_pending(saved, grad_output, Half::Weight);
        let was_pending = pending.is_some();
        let mut pending = pending.map(|grads| grads.into_iter().map(Some).collect::<Vec<_>>());
        let grads = grads_per_rank(param_grads, &self.counts())?;
        let states: Vec<_> =
            grads.into_iter().enumerate().map(|(i, g)| (g, pending.as_mut().and_then(|p| p[i].take()))).collect();
        let computed = self.group.run(states, |rank, comm, (grads, grad_hidden)| {
            let device = self.group.device(rank);
            let (w1, b1, w2, b2) = self.slots(rank);
            let i = self.group.local_index(rank);
            let at = self.offsets[i];
            let (x, hidden) = (&saved.tensors[i], &saved.tensors[k + i]);
            let dy = input_for_shard(comm, grad_output, device, replicated)?;
            // Local indices into this rank's run of gradients.
            let (fc1_grads, fc2_grads) = grads.split_at_mut(w2 - at);
            let (w2_grad, b2_grad) = fc2_grads.split_at_mut(1);
            let activated = self.activation.forward(hidden)?;
            linear_shard::weight_grad(&dy, &activated, &mut w2_grad[0], b2.and(b2_grad.first_mut()))?;
            drop(activated);
            let grad_hidden = match grad_hidden {
                Some(grad_hidden) => grad_hidden,
                None => self.shard_grad_hidden(rank, saved, &dy)?,
            };
            let (w1_grad, b1_grad) = fc1_grads.split_at_mut(1);
            debug_assert_eq!(w1, at);
            linear_shard::weight_grad(&grad_hidden, x, &mut w1_grad[0], b1.and(b1_grad.first_mut()))?;
            Ok(grad_hidden)
        })?;
        if !was_pending {
            self.leave_pending(saved, grad_output, &computed, Half::Weight);
        }
        Ok(())
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let output = self.output_shape(input_shapes)?;
        let hidden = Shape::new(with_last(&input_shapes[0], self.hidden_features));
        let k = self.group.k();
        let fc1 = linear_cost(&input_shapes[0], &hidden, self.in_features, self.hidden_features, self.fc1_bias, 0);
        let fc2 = linear_cost(&hidden, &output, self.hidden_features, self.out_features, self.fc2_bias, 0);
        let activation_flops = hidden.numel() as u64;
        Ok(LayerCost {
            forward_flops_per_sample: fc1.forward_flops_per_sample + activation_flops + fc2.forward_flops_per_sample,
            backward_input_flops_per_sample: fc1.backward_input_flops_per_sample
                + activation_flops
                + fc2.backward_input_flops_per_sample,
            // backward_weight recomputes the activation; the hidden gradient comes from
            // backward_input's pending slot.
            backward_weight_flops_per_sample: fc1.backward_weight_flops_per_sample
                + fc2.backward_weight_flops_per_sample
                + activation_flops,
            param_bytes: fc1.param_bytes + fc2.param_bytes,
            activation_bytes_per_sample: f32_bytes(k * input_shapes[0].numel() + hidden.numel()),
            output_bytes_per_sample: fc2.output_bytes_per_sample,
            workspace_bytes: 0,
            // The hidden gradient of every shard, left by backward_input for backward_weight.
            backward_held_bytes_per_sample: f32_bytes(hidden.numel()),
            gpu_scratch_bytes_per_sample: Default::default(),
        })
    }

    /// A group of one device moves whole; a split block stays on its devices.
    fn to_device(&mut self, device: &Device) -> Result<()> {
        self.group.move_unsplit(KIND, &mut self.params, device)
    }

    fn export_parameter_shapes(&self) -> Vec<(String, Shape)> {
        let mut out = vec![("fc1.weight".to_string(), Shape::new([self.hidden_features, self.in_features]))];
        if self.fc1_bias {
            out.push(("fc1.bias".to_string(), Shape::new([self.hidden_features])));
        }
        out.push(("fc2.weight".to_string(), Shape::new([self.out_features, self.hidden_features])));
        if self.fc2_bias {
            out.push(("fc2.bias".to_string(), Shape::new([self.out_features])));
        }
        out
    }

    /// The unsplit tensors ([`Self::gather_parameters`]).
    fn export_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        self.gather_parameters()
    }

    /// Splits an unsplit tensor into the shards ([`Self::load_unsplit`]).
    fn import_parameter(&mut self, name: &str, value: &Tensor) -> Result<()> {
        self.load_unsplit(name, value)
    }

    /// Nothing for the unsplit block (a group of one device): it is not a split layer.
    fn collective_traffic(&self) -> Vec<Traffic> {
        if self.group.k() == 1 {
            return Vec::new();
        }
        self.group.traffic()
    }

    fn recover_collectives(&self) -> Result<()> {
        self.group.recover()
    }
}
