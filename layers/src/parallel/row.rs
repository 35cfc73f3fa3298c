//! `RowParallelLinear`: a `Linear` whose weight is split by input features (columns of
//! `weight [out, in]`) over `k` devices; the partial outputs are all-reduced.
use conveyor_engine::collective::{Partition, Traffic};
use conveyor_engine::{DType, Device, Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor};
use rand::rngs::StdRng;

use super::exchange::{
    all_gather_columns, columns_for_shard, gather_row_parallel, grads_per_rank, input_for_shard, rows,
};
use super::group::{ShardGroup, Shards};
use super::layout::{column_block, with_last};
use super::{
    check_linear_input, check_saved_inputs, linear_cost, linear_shard, load_shard, shard_rows, split_features,
    unsplit_columns,
};
use crate::Linear;
use crate::tensor_io::{check_grad_shape, check_param_grads, expect_inputs, into_dtype};

const KIND: &str = "RowParallelLinear";

/// `y = x · weightᵀ + bias` with `weight` `[out, in]` split by columns: device `r` holds columns
/// `parts.range(r)` (the first `in % k` devices one more), computes the partial product
/// `x_r · weight_rᵀ` from its block `x_r` of the input features, and the partials are
/// all-reduced. The unsplit `bias` lives on the first device and is added there once, before the
/// all-reduce.
///
/// The input may arrive whole on the first device (the `Layer` path: forward scatters its feature
/// blocks) or already split by a [`super::ColumnParallelLinear`]-style layer with the same
/// partition, which is how [`super::ParallelMlp`] feeds it with no exchange in between.
///
/// Exchanges per call: forward scatters `x` and all-reduces `y`; `backward_input` broadcasts `dy`
/// and all-gathers `dx_r = dy · weight_r`; `backward_weight` broadcasts `dy` and adds
/// `dweight_r += dyᵀ · x_r` locally (and `dbias += Σ dy` on the first device).
///
/// `parameters()` is rank-major over the shards held here: shard 0's `weight` block, then `bias`
/// (unsplit, held with shard 0), then each other shard's `weight` block.
#[derive(Debug)]
pub struct RowParallelLinear {
    in_features: usize,
    out_features: usize,
    parts: Partition,
    has_bias: bool,
    params: Vec<Parameter>,
    group: ShardGroup,
}

impl RowParallelLinear {
    /// A layer initialised exactly like `Linear::new(in_features, out_features, bias, rng)`, split over `devices`.
    pub fn new(
        in_features: usize,
        out_features: usize,
        bias: bool,
        devices: &[Device],
        rng: &mut StdRng,
    ) -> Result<Self> {
        RowParallelLinear::from_linear(&Linear::new(in_features, out_features, bias, rng)?, devices)
    }

    /// `linear`'s parameters split over `devices` (each shard created on its device).
    pub fn from_linear(linear: &Linear, devices: &[Device]) -> Result<Self> {
        RowParallelLinear::from_parameters(linear.weight(), linear.bias(), devices)
    }

    /// `linear`'s parameters split as `shards` says (all shards here, or this rank's one).
    pub fn from_linear_on(linear: &Linear, shards: &Shards) -> Result<Self> {
        RowParallelLinear::from_parameters_on(linear.weight(), linear.bias(), shards)
    }

    /// The unsplit `weight` `[out, in]` and optional `bias` `[out]` split over `devices`.
    pub fn from_parameters(weight: &Tensor, bias: Option<&Tensor>, devices: &[Device]) -> Result<Self> {
        RowParallelLinear::from_parameters_on(weight, bias, &Shards::Local(devices.to_vec()))
    }

    /// The unsplit `weight` `[out, in]` and optional `bias` `[out]` split as `shards` says; only
    /// the shards held here are created (the bias with shard 0).
    pub fn from_parameters_on(weight: &Tensor, bias: Option<&Tensor>, shards: &Shards) -> Result<Self> {
        let group = ShardGroup::new(KIND, shards)?;
        let (out_features, in_features) = super::check_linear_params(KIND, weight, bias)?;
        let parts = split_features(KIND, "in_features", in_features, group.k())?;
        let weight = into_dtype(weight.share(), DType::F32)?;
        let mut params = Vec::new();
        for (rank, device) in group.local_devices() {
            let value = column_block(&weight, out_features, &parts, rank, vec![out_features, parts.len(rank)], device)?;
            params.push(Parameter { name: "weight".into(), value });
            if rank == 0
                && let Some(bias) = bias
            {
                let value = shard_rows(bias, 0..out_features, [out_features], device)?;
                params.push(Parameter { name: "bias".into(), value });
            }
        }
        Ok(RowParallelLinear { in_features, out_features, parts, has_bias: bias.is_some(), params, group })
    }

    /// Input features (all shards together).
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Input features per device.
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

    /// Where shard `rank`'s weight block sits in `params` (shard 0 is followed by the bias).
    fn weight_index(&self, rank: usize) -> usize {
        let here = self.group.local_index(rank);
        let bias_before = self.has_bias && self.group.local().start == 0 && rank > 0;
        here + usize::from(bias_before)
    }

    fn weight(&self, rank: usize) -> &Tensor {
        &self.params[self.weight_index(rank)].value
    }

    /// The bias, when shard 0 (which holds it) is held here.
    fn bias(&self) -> Option<&Tensor> {
        (self.has_bias && self.group.local().start == 0).then(|| &self.params[1].value)
    }

    /// The parameters of each shard held here.
    fn counts(&self) -> Vec<usize> {
        self.group.local().map(|r| if r == 0 { 1 + usize::from(self.has_bias) } else { 1 }).collect()
    }

    /// The unsplit parameters on the host under PyTorch's names: `weight` `[out, in]`, `bias` `[out]`.
    /// With one shard per rank this is a collective (an all-gather and a broadcast from shard 0):
    /// every rank of the group calls it, and every rank gets the unsplit tensors.
    pub fn gather_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        if self.group.n_local() == self.group.k() {
            let shards: Vec<&Tensor> = (0..self.group.k()).map(|r| self.weight(r)).collect();
            let mut out = vec![("weight".to_string(), unsplit_columns(&shards, self.out_features, &self.parts)?)];
            if let Some(bias) = self.bias() {
                out.push(("bias".to_string(), bias.to_device(&Device::host())?));
            }
            return Ok(out);
        }
        let mut gathered = self.group.run(vec![(); self.group.n_local()], |rank, comm, ()| {
            gather_row_parallel(comm, self.weight(rank), self.has_bias, self.bias(), self.out_features, &self.parts)
        })?;
        let (weight, bias) = gathered.swap_remove(0);
        let mut out = vec![("weight".to_string(), weight)];
        out.extend(bias.map(|b| ("bias".to_string(), b)));
        Ok(out)
    }

    /// Splits the unsplit tensor `name` (`weight` or `bias`) into the shards, in place.
    pub fn load_unsplit(&mut self, name: &str, value: &Tensor) -> Result<()> {
        match name {
            "weight" => {
                let dims = [self.out_features, self.in_features];
                if value.dims() != dims {
                    return Err(Error::shape(format!("{KIND} weight"), format!("{dims:?}"), value.shape().to_string()));
                }
                let value = into_dtype(value.share(), DType::F32)?;
                for rank in self.group.local() {
                    let index = self.weight_index(rank);
                    let device = self.params[index].value.device().clone();
                    let block = column_block(
                        &value,
                        self.out_features,
                        &self.parts,
                        rank,
                        vec![self.out_features, self.parts.len(rank)],
                        &device,
                    )?;
                    self.params[index].value.copy_from(&block)?;
                }
                Ok(())
            }
            "bias" if self.has_bias => {
                if value.dims() != [self.out_features] {
                    return Err(Error::shape(
                        format!("{KIND} bias"),
                        format!("[{}]", self.out_features),
                        value.shape().to_string(),
                    ));
                }
                if self.bias().is_some() {
                    load_shard(&mut self.params[1].value, value.share())?;
                }
                Ok(())
            }
            _ => Err(Error::invalid(format!("{KIND} parameter"), format!("`{name}`: expected weight or bias"))),
        }
    }
}

impl Layer for RowParallelLinear {
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
        let n_rows = rows(input);
        let replicated = self.group.inputs_replicated();
        let results = self.group.run(vec![(); self.group.n_local()], |rank, comm, ()| {
            let device = self.group.device(rank);
            let dims = with_last(input.shape(), self.parts.len(rank));
            let x = columns_for_shard(comm, input, n_rows, &self.parts, dims, device, replicated)?;
            let bias = if rank == 0 { self.bias() } else { None };
            let mut y = linear_shard::forward(&x, self.weight(rank), bias)?;
            comm.all_reduce_tensor(&mut y)?;
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

    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let input_dims = check_saved_inputs(KIND, saved, &self.parts, self.group.local())?;
        let input_shape = Shape::new(input_dims);
        check_grad_shape(KIND, grad_output, &Shape::new(with_last(&input_shape, self.out_features)))?;
        self.group.check_input(KIND, grad_output)?;
        let n_rows = rows(grad_output);
        let replicated = self.group.inputs_replicated();
        let mut results = self.group.run(vec![(); self.group.n_local()], |rank, comm, ()| {
            let device = self.group.device(rank);
            let dy = input_for_shard(comm, grad_output, device, replicated)?;
            let x_shape = saved.tensors[self.group.local_index(rank)].shape();
            let dx_block = linear_shard::input_grad(&dy, self.weight(rank), x_shape)?;
            drop(dy);
            let dx = all_gather_columns(comm, &dx_block, n_rows, &self.parts, input_shape.dims().to_vec(), device)?;
            Ok(self.group.returns_output(rank).then_some(dx))
        })?;
        Ok(vec![results.swap_remove(0)])
    }

    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()> {
        check_param_grads(KIND, &self.params, param_grads)?;
        let input_shape = Shape::new(check_saved_inputs(KIND, saved, &self.parts, self.group.local())?);
        check_grad_shape(KIND, grad_output, &Shape::new(with_last(&input_shape, self.out_features)))?;
        self.group.check_input(KIND, grad_output)?;
        let grads = grads_per_rank(param_grads, &self.counts())?;
        let replicated = self.group.inputs_replicated();
        self.group.run(grads, |rank, comm, grads| {
            let device = self.group.device(rank);
            let dy = input_for_shard(comm, grad_output, device, replicated)?;
            let (weight_grad, bias_grad) = grads.split_at_mut(1);
            let bias_grad = if rank == 0 { bias_grad.first_mut() } else { None };
            let x = &saved.tensors[self.group.local_index(rank)];
            linear_shard::weight_grad(&dy, x, &mut weight_grad[0], bias_grad)
        })?;
        Ok(())
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let output = self.output_shape(input_shapes)?;
        Ok(linear_cost(
            &input_shapes[0],
            &output,
            self.in_features,
            self.out_features,
            self.has_bias,
            input_shapes[0].numel(),
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
