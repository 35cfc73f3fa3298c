//! `ColumnParallelLinear`: a `Linear` whose weight is split by output features (rows of
//! `weight [out, in]`) over `k` devices; the output is all-gathered, or, as a model's output
//! layer with [`ColumnParallelLinear::with_split_cross_entropy`], never gathered: the softmax
//! cross-entropy is computed over the split logits (Megatron's vocabulary-parallel loss).
use conveyor_engine::collective::{Partition, Traffic};
use conveyor_engine::device::ops::LOGIT_SHARD_STATS;
use conveyor_engine::{DType, Device, Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor};
use rand::rngs::StdRng;

use super::exchange::{all_gather_columns, columns_for_shard, grads_per_rank, input_for_shard, rows};
use super::group::{ShardGroup, Shards};
use super::layout::with_last;
use super::{
    check_linear_input, check_saved_replicated, gather_rows, linear_cost, linear_shard, load_shard, shard_rows,
    split_features,
};
use crate::Linear;
use crate::tensor_io::{check_grad_shape, check_param_grads, expect_inputs};

const KIND: &str = "ColumnParallelLinear";

/// `y = x · weightᵀ + bias` with `weight` `[out, in]` split by rows: device `r` holds rows
/// `parts.range(r)` of `weight` and `bias` (the first `out % k` devices one row more), computes
/// `y_r = x · weight_rᵀ + bias_r`, and the blocks are all-gathered into `y`.
///
/// Exchanges per call (`x` `[rows, in]`, `y` `[rows, out]`): forward broadcasts `x` from the first
/// device and all-gathers `y`; `backward_input` scatters `dy` by column blocks and all-reduces
/// the partial `dx_r = dy_r · weight_r`; `backward_weight` scatters `dy` and adds
/// `dweight_r += dy_rᵀ · x` locally.
///
/// As the graph's output layer under softmax cross-entropy, with
/// [`ColumnParallelLinear::with_split_cross_entropy`], a training step never gathers the logits:
/// each device reduces its block to three numbers per row, those are all-gathered, and each
/// device keeps its block's gradient; the backward calls then need no scatter of `dy`
/// ([`Layer::forward_cross_entropy`]).
///
/// `parameters()` is rank-major: for each shard held here, in order, its `weight` shard, then its `bias`
/// shard; each keeps PyTorch's name. [`ColumnParallelLinear::gather_parameters`] returns the
/// unsplit tensors and [`ColumnParallelLinear::load_unsplit`] splits one in.
#[derive(Debug)]
pub struct ColumnParallelLinear {
    in_features: usize,
    out_features: usize,
    parts: Partition,
    has_bias: bool,
    params: Vec<Parameter>,
    group: ShardGroup,
    /// Computes a softmax cross-entropy over its split output when asked.
    split_cross_entropy: bool,
}

impl ColumnParallelLinear {
    /// A layer initialised exactly like `Linear::new(in_features, out_features, bias, rng)`, split over `devices`.
    pub fn new(
        in_features: usize,
        out_features: usize,
        bias: bool,
        devices: &[Device],
        rng: &mut StdRng,
    ) -> Result<Self> {
        ColumnParallelLinear::from_linear(&Linear::new(in_features, out_features, bias, rng)?, devices)
    }

    /// `linear`'s parameters split over `devices` (each shard created on its device).
    pub fn from_linear(linear: &Linear, devices: &[Device]) -> Result<Self> {
        ColumnParallelLinear::from_parameters(linear.weight(), linear.bias(), devices)
    }

    /// `linear`'s parameters split as `shards` says (all shards here, or this rank's one).
    pub fn from_linear_on(linear: &Linear, shards: &Shards) -> Result<Self> {
        ColumnParallelLinear::from_parameters_on(linear.weight(), linear.bias(), shards)
    }

    /// The unsplit `weight` `[out, in]` and optional `bias` `[out]` split over `devices`.
    pub fn from_parameters(weight: &Tensor, bias: Option<&Tensor>, devices: &[Device]) -> Result<Self> {
        ColumnParallelLinear::from_parameters_on(weight, bias, &Shards::Local(devices.to_vec()))
    }

    /// The unsplit `weight` `[out, in]` and optional `bias` `[out]` split as `shards` says; only
    /// the shards held here are created.
    pub fn from_parameters_on(weight: &Tensor, bias: Option<&Tensor>, shards: &Shards) -> Result<Self> {
        let group = ShardGroup::new(KIND, shards)?;
        let (out_features, in_features) = super::check_linear_params(KIND, weight, bias)?;
        let parts = split_features(KIND, "out_features", out_features, group.k())?;
        let mut params = Vec::new();
        for (rank, device) in group.local_devices() {
            let range = parts.range(rank);
            let value = shard_rows(weight, range.clone(), [range.len(), in_features], device)?;
            params.push(Parameter { name: "weight".into(), value });
            if let Some(bias) = bias {
                let value = shard_rows(bias, range.clone(), [range.len()], device)?;
                params.push(Parameter { name: "bias".into(), value });
            }
        }
        Ok(ColumnParallelLinear {
            in_features,
            out_features,
            parts,
            has_bias: bias.is_some(),
            params,
            group,
            split_cross_entropy: false,
        })
    }

    /// This layer computing, as a model's output layer, the softmax cross-entropy over its split
    /// output where the blocks live ([`Layer::forward_cross_entropy`]): the logits
    /// `[rows, out_features]` never meet on one device, only `3 · rows` numbers per device cross
    /// between them. Evaluation and prediction still gather the logits.
    pub fn with_split_cross_entropy(mut self) -> Self {
        self.split_cross_entropy = true;
        self
    }

    /// Whether the layer computes a softmax cross-entropy over its split output
    /// ([`ColumnParallelLinear::with_split_cross_entropy`]).
    pub fn splits_cross_entropy(&self) -> bool {
        self.split_cross_entropy
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Output features (all shards together).
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Output features per device.
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

    fn per_rank(&self) -> usize {
        1 + usize::from(self.has_bias)
    }

    fn shard(&self, rank: usize) -> (&Tensor, Option<&Tensor>) {
        let at = self.group.local_index(rank) * self.per_rank();
        (&self.params[at].value, self.has_bias.then(|| &self.params[at + 1].value))
    }

    /// The unsplit parameters on the host under PyTorch's names: `weight` `[out, in]`, `bias` `[out]`.
    /// With one shard per rank this is a collective (an all-gather): every rank of the group calls
    /// it, and every rank gets the unsplit tensors.
    pub fn gather_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let per_rank = self.per_rank();
        let weights: Vec<&Tensor> = self.params.iter().step_by(per_rank).map(|p| &p.value).collect();
        let weight_parts = self.parts.scaled(self.in_features);
        let mut out = vec![(
            "weight".to_string(),
            gather_rows(&self.group, &weights, &weight_parts, [self.out_features, self.in_features])?,
        )];
        if self.has_bias {
            let biases: Vec<&Tensor> = self.params.iter().skip(1).step_by(per_rank).map(|p| &p.value).collect();
            out.push(("bias".to_string(), gather_rows(&self.group, &biases, &self.parts, [self.out_features])?));
        }
        Ok(out)
    }

    /// Splits the unsplit tensor `name` (`weight` or `bias`) into the shards, in place.
    pub fn load_unsplit(&mut self, name: &str, value: &Tensor) -> Result<()> {
        let (offset, dims) = match name {
            "weight" => (0, vec![self.out_features, self.in_features]),
            "bias" if self.has_bias => (1, vec![self.out_features]),
            _ => return Err(Error::invalid(format!("{KIND} parameter"), format!("`{name}`: expected weight or bias"))),
        };
        if value.dims() != dims {
            return Err(Error::shape(format!("{KIND} {name}"), format!("{dims:?}"), value.shape().to_string()));
        }
        let per_rank = self.per_rank();
        for rank in self.group.local() {
            let range = self.parts.range(rank);
            let at = self.group.local_index(rank) * per_rank + offset;
            load_shard(&mut self.params[at].value, value.narrow_rows(range.start, range.len())?)?;
        }
        Ok(())
    }
}

/// Split cross-entropy ([`ColumnParallelLinear::with_split_cross_entropy`]): its saved state is
/// the input copies, then each local shard's logit gradient `[rows, parts.len(r)]`.
impl ColumnParallelLinear {
    fn forward_split_cross_entropy(
        &self,
        inputs: &[&Tensor],
        labels: &[usize],
        normalizer: f32,
    ) -> Result<(f64, Saved)> {
        expect_inputs(KIND, inputs, 1)?;
        let input = inputs[0];
        check_linear_input(KIND, &self.group, input, self.in_features)?;
        let n_rows = rows(input);
        if labels.len() != n_rows {
            return Err(Error::shape(
                format!("{KIND} cross-entropy labels"),
                format!("{n_rows} labels, one per row of the input {}", input.shape()),
                format!("{} labels", labels.len()),
            ));
        }
        crate::loss::check_label_range(labels, self.out_features)?;
        crate::loss::check_normalizer(KIND, normalizer)?;
        let k = self.group.k();
        let stat_parts = Partition::even(k * n_rows * LOGIT_SHARD_STATS, k)?;
        let replicated = self.group.inputs_replicated();
        let results = self.group.run(vec![(); self.group.n_local()], |rank, comm, ()| {
            let device = self.group.device(rank);
            let x = input_for_shard(comm, input, device, replicated)?;
            let (weight, bias) = self.shard(rank);
            let logits = linear_shard::forward(&x, weight, bias)?;
            let first = self.parts.range(rank).start;
            let stats = logits.logit_shard_stats(labels, first)?;
            let mut gathered = Tensor::zeros([stat_parts.total()], DType::F32, device)?;
            comm.all_gather_tensor(&stats, &mut gathered, &stat_parts)?;
            let (lse, loss_sum) = gathered.combine_logit_shard_stats(k, n_rows)?;
            let grad = logits.logit_shard_grad(&lse, labels, first, normalizer)?;
            Ok((x, grad, loss_sum))
        })?;
        // Every shard combined the same statistics in the same order: one loss.
        let loss = results.first().map_or(0.0, |r| r.2) / f64::from(normalizer);
        let (inputs, grads): (Vec<Tensor>, Vec<Tensor>) = results.into_iter().map(|(x, grad, _)| (x, grad)).unzip();
        Ok((loss, Saved { tensors: inputs.into_iter().chain(grads).collect() }))
    }

    /// The input copies and logit gradients of a split cross-entropy's saved state, or `None`
    /// for a plain forward's (one input copy per shard). The loss's own gradient must be the
    /// `[1]` the runtime passes.
    fn split_cross_entropy_saved<'a>(
        &self,
        saved: &'a Saved,
        grad_output: &Tensor,
    ) -> Result<Option<(&'a [Tensor], &'a [Tensor])>> {
        let n_local = self.group.n_local();
        if !self.split_cross_entropy || saved.tensors.len() != 2 * n_local {
            return Ok(None);
        }
        if grad_output.dims() != [1] {
            return Err(Error::shape(
                format!("{KIND} gradient after its own cross-entropy"),
                "[1] (the loss's gradient with respect to itself)",
                grad_output.shape().to_string(),
            ));
        }
        let (inputs, grads) = saved.tensors.split_at(n_local);
        let in_dims = inputs[0].dims();
        let shapes_fit =
            inputs.iter().all(|x| x.dims() == in_dims && in_dims.last() == Some(&self.in_features))
                && self.group.local().zip(grads).all(|(rank, g)| {
                    g.dims().split_last() == Some((&self.parts.len(rank), &in_dims[..in_dims.len() - 1]))
                });
        if !shapes_fit {
            return Err(Error::invalid(
                format!("{KIND} saved state"),
                "not the input copies and logit gradients its cross-entropy saved",
            ));
        }
        Ok(Some((inputs, grads)))
    }
}

impl Layer for ColumnParallelLinear {
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
        let (n_rows, out_dims) = (rows(input), with_last(input.shape(), self.out_features));
        let replicated = self.group.inputs_replicated();
        let results = self.group.run(vec![(); self.group.n_local()], |rank, comm, ()| {
            let device = self.group.device(rank);
            let x = input_for_shard(comm, input, device, replicated)?;
            let (weight, bias) = self.shard(rank);
            let y_block = linear_shard::forward(&x, weight, bias)?;
            let y = all_gather_columns(comm, &y_block, n_rows, &self.parts, out_dims.clone(), device)?;
            Ok((x, self.group.returns_output(rank).then_some(y)))
        })?;
        let mut tensors = Vec::with_capacity(results.len());
        let mut output = None;
        for (x, y) in results {
            tensors.push(x);
            output = output.or(y);
        }
        let output = output.ok_or_else(|| Error::invalid(KIND, "rank 0 returned no output"))?;
        Ok((output, Saved { tensors }))
    }

    fn forward_cross_entropy(
        &self,
        inputs: &[&Tensor],
        labels: &[usize],
        normalizer: f32,
        _ctx: &ForwardCtx,
    ) -> Option<Result<(f64, Saved)>> {
        self.split_cross_entropy.then(|| self.forward_split_cross_entropy(inputs, labels, normalizer))
    }

    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        if let Some((inputs, grads)) = self.split_cross_entropy_saved(saved, grad_output)? {
            let input_shape = inputs[0].shape();
            let mut results = self.group.run(grads.iter().collect(), |rank, comm, grad| {
                let mut dx = linear_shard::input_grad(grad, self.shard(rank).0, input_shape)?;
                comm.all_reduce_tensor(&mut dx)?;
                Ok(self.group.returns_output(rank).then_some(dx))
            })?;
            return Ok(vec![results.swap_remove(0)]);
        }
        let input_shape = check_saved_replicated(KIND, saved, self.group.n_local(), self.in_features)?;
        check_grad_shape(KIND, grad_output, &Shape::new(with_last(&input_shape, self.out_features)))?;
        self.group.check_input(KIND, grad_output)?;
        let n_rows = rows(grad_output);
        let replicated = self.group.inputs_replicated();
        let mut results = self.group.run(vec![(); self.group.n_local()], |rank, comm, ()| {
            let device = self.group.device(rank);
            let dims = with_last(&input_shape, self.parts.len(rank));
            let dy = columns_for_shard(comm, grad_output, n_rows, &self.parts, dims, device, replicated)?;
            let mut dx = linear_shard::input_grad(&dy, self.shard(rank).0, &input_shape)?;
            drop(dy);
            comm.all_reduce_tensor(&mut dx)?;
            Ok(self.group.returns_output(rank).then_some(dx))
        })?;
        Ok(vec![results.swap_remove(0)])
    }

    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()> {
        check_param_grads(KIND, &self.params, param_grads)?;
        let grads = grads_per_rank(param_grads, &vec![self.per_rank(); self.group.n_local()])?;
        if let Some((inputs, logit_grads)) = self.split_cross_entropy_saved(saved, grad_output)? {
            let states = grads.into_iter().zip(inputs.iter().zip(logit_grads)).collect();
            self.group.run(states, |_, _, (grads, (x, logit_grad))| {
                let (weight_grad, bias_grad) = grads.split_at_mut(1);
                linear_shard::weight_grad(logit_grad, x, &mut weight_grad[0], bias_grad.first_mut())
            })?;
            return Ok(());
        }
        let input_shape = check_saved_replicated(KIND, saved, self.group.n_local(), self.in_features)?;
        check_grad_shape(KIND, grad_output, &Shape::new(with_last(&input_shape, self.out_features)))?;
        self.group.check_input(KIND, grad_output)?;
        let n_rows = rows(grad_output);
        let replicated = self.group.inputs_replicated();
        self.group.run(grads, |rank, comm, grads| {
            let device = self.group.device(rank);
            let dims = with_last(&input_shape, self.parts.len(rank));
            let dy = columns_for_shard(comm, grad_output, n_rows, &self.parts, dims, device, replicated)?;
            let (weight_grad, bias_grad) = grads.split_at_mut(1);
            let x = &saved.tensors[self.group.local_index(rank)];
            linear_shard::weight_grad(&dy, x, &mut weight_grad[0], bias_grad.first_mut())
        })?;
        Ok(())
    }

    /// With a split cross-entropy, the saved state also holds the logits' gradient, one block
    /// per device (the runtime's output gradient is then one number, not the logits).
    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let output = self.output_shape(input_shapes)?;
        let logit_grads = if self.split_cross_entropy { output.numel() } else { 0 };
        Ok(linear_cost(
            &input_shapes[0],
            &output,
            self.in_features,
            self.out_features,
            self.has_bias,
            self.group.k() * input_shapes[0].numel() + logit_grads,
        ))
    }

    fn to_device(&mut self, device: &Device) -> Result<()> {
        self.group.to_device(KIND, device)
    }

    fn export_parameter_shapes(&self) -> Vec<(String, Shape)> {
        let mut out = vec![("weight".to_string(), Shape::new([self.out_features, self.in_features]))];
        if self.has_bias {
            out.push(("bias".to_string(), Shape::new([self.out_features])));
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

    fn collective_traffic(&self) -> Vec<Traffic> {
        self.group.traffic()
    }

    fn recover_collectives(&self) -> Result<()> {
        self.group.recover()
    }
}
