//! `ChannelParallelConv2d`: AlexNet's split of a convolution, each device computing its share of
//! the output filters; the outputs are gathered by concatenating channels.
use conveyor_engine::collective::{Partition, Traffic};
use conveyor_engine::cpu::Window2d;
use conveyor_engine::{Device, Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor};
use rand::rngs::StdRng;

use super::exchange::{all_gather_columns, columns_for_shard, grads_per_rank, input_for_shard};
use super::group::{ShardGroup, Shards};
use super::layout::with_channels;
use super::{check_saved_replicated_dims, conv_shard, gather_rows, load_shard, shard_rows, split_features};
use crate::tensor_io::{check_grad_shape, check_param_grads, chw, expect_inputs, expect_shapes, f32_bytes, nchw};
use crate::{Conv2d, Conv2dOptions};

const KIND: &str = "ChannelParallelConv2d";

/// A `Conv2d` whose filters (`weight [out, in, kh, kw]` by rows, and `bias`) are split over `k`
/// devices: device `r` computes output channels `parts.range(r)` from the whole input, and the
/// channel blocks are all-gathered into `[batch, out, H_out, W_out]`.
///
/// Exchanges per call: forward broadcasts `x` from the first device and all-gathers the channel
/// blocks; `backward_input` scatters `dy` by channel blocks and all-reduces the partial input
/// gradients `col2im(weight_rᵀ · dy_r)`; `backward_weight` scatters `dy` and adds the filter
/// gradients locally.
///
/// `parameters()` is rank-major: for each shard held here its `weight` shard, then its `bias` shard.
#[derive(Debug)]
pub struct ChannelParallelConv2d {
    in_channels: usize,
    out_channels: usize,
    kernel_size: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
    parts: Partition,
    has_bias: bool,
    params: Vec<Parameter>,
    group: ShardGroup,
}

impl ChannelParallelConv2d {
    /// A layer initialised exactly like `Conv2d::new(...)` with the same arguments, split over `devices`.
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel_size: (usize, usize),
        options: Conv2dOptions,
        devices: &[Device],
        rng: &mut StdRng,
    ) -> Result<Self> {
        let conv = Conv2d::new(in_channels, out_channels, kernel_size, options, rng)?;
        ChannelParallelConv2d::from_parameters(conv.weight(), conv.bias(), options.stride, options.padding, devices)
    }

    /// The unsplit `weight` `[out, in, kh, kw]` and optional `bias` `[out]` split over `devices`.
    pub fn from_parameters(
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: (usize, usize),
        padding: (usize, usize),
        devices: &[Device],
    ) -> Result<Self> {
        ChannelParallelConv2d::from_parameters_on(weight, bias, stride, padding, &Shards::Local(devices.to_vec()))
    }

    /// The unsplit `weight` `[out, in, kh, kw]` and optional `bias` `[out]` split as `shards` says
    /// (all shards here, or this rank's one); only the shards held here are created.
    pub fn from_parameters_on(
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: (usize, usize),
        padding: (usize, usize),
        shards: &Shards,
    ) -> Result<Self> {
        let group = ShardGroup::new(KIND, shards)?;
        let &[out_channels, in_channels, kh, kw] = weight.dims() else {
            return Err(Error::shape(
                format!("{KIND} weight"),
                "[out_channels, in_channels, kh, kw]",
                weight.shape().to_string(),
            ));
        };
        if weight.numel() == 0 {
            return Err(Error::shape(
                format!("{KIND} weight"),
                "all dimensions at least 1",
                weight.shape().to_string(),
            ));
        }
        if stride.0 == 0 || stride.1 == 0 {
            return Err(Error::invalid(
                format!("{KIND} stride"),
                format!("{stride:?}: both strides must be at least 1"),
            ));
        }
        if let Some(bias) = bias
            && bias.dims() != [out_channels]
        {
            return Err(Error::shape(format!("{KIND} bias"), format!("[{out_channels}]"), bias.shape().to_string()));
        }
        let parts = split_features(KIND, "out_channels", out_channels, group.k())?;
        let mut params = Vec::new();
        for (rank, device) in group.local_devices() {
            let channels = parts.range(rank);
            let value = shard_rows(weight, channels.clone(), [channels.len(), in_channels, kh, kw], device)?;
            params.push(Parameter { name: "weight".into(), value });
            if let Some(bias) = bias {
                let value = shard_rows(bias, channels.clone(), [channels.len()], device)?;
                params.push(Parameter { name: "bias".into(), value });
            }
        }
        Ok(ChannelParallelConv2d {
            in_channels,
            out_channels,
            kernel_size: (kh, kw),
            stride,
            padding,
            parts,
            has_bias: bias.is_some(),
            params,
            group,
        })
    }

    /// Output channels per device.
    pub fn partition(&self) -> &Partition {
        &self.parts
    }

    /// The devices, shard `r` on `devices()[r]`; inputs arrive on and outputs leave from the first.
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

    fn weight_dims(&self) -> [usize; 4] {
        [self.out_channels, self.in_channels, self.kernel_size.0, self.kernel_size.1]
    }

    /// The unsplit parameters on the host under PyTorch's names: `weight` `[out, in, kh, kw]`, `bias` `[out]`.
    /// With one shard per rank this is a collective (an all-gather): every rank of the group calls
    /// it, and every rank gets the unsplit tensors.
    pub fn gather_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let per_rank = self.per_rank();
        let filter_len = self.in_channels * self.kernel_size.0 * self.kernel_size.1;
        let weights: Vec<&Tensor> = self.params.iter().step_by(per_rank).map(|p| &p.value).collect();
        let weight = gather_rows(&self.group, &weights, &self.parts.scaled(filter_len), self.weight_dims())?;
        let mut out = vec![("weight".to_string(), weight)];
        if self.has_bias {
            let biases: Vec<&Tensor> = self.params.iter().skip(1).step_by(per_rank).map(|p| &p.value).collect();
            out.push(("bias".to_string(), gather_rows(&self.group, &biases, &self.parts, [self.out_channels])?));
        }
        Ok(out)
    }

    /// Splits the unsplit tensor `name` (`weight` or `bias`) into the shards, in place.
    pub fn load_unsplit(&mut self, name: &str, value: &Tensor) -> Result<()> {
        let (offset, dims) = match name {
            "weight" => (0, self.weight_dims().to_vec()),
            "bias" if self.has_bias => (1, vec![self.out_channels]),
            _ => return Err(Error::invalid(format!("{KIND} parameter"), format!("`{name}`: expected weight or bias"))),
        };
        if value.dims() != dims {
            return Err(Error::shape(format!("{KIND} {name}"), format!("{dims:?}"), value.shape().to_string()));
        }
        let per_rank = self.per_rank();
        for rank in self.group.local() {
            let channels = self.parts.range(rank);
            let at = self.group.local_index(rank) * per_rank + offset;
            load_shard(&mut self.params[at].value, value.narrow_rows(channels.start, channels.len())?)?;
        }
        Ok(())
    }

    fn window(&self, shape: &Shape, channels: usize, height: usize, width: usize) -> Result<Window2d> {
        if channels != self.in_channels || height == 0 || width == 0 {
            return Err(Error::shape(
                KIND,
                format!("{} input channels and a non-empty plane", self.in_channels),
                shape.to_string(),
            ));
        }
        Window2d::new(channels, (height, width), self.kernel_size, self.stride, self.padding).map_err(|_| {
            Error::shape(
                KIND,
                format!(
                    "an input at least as large as the kernel {:?} after padding {:?}",
                    self.kernel_size, self.padding
                ),
                shape.to_string(),
            )
        })
    }

    fn batch_window(&self, shape: &Shape) -> Result<(usize, Window2d)> {
        let [batch, channels, height, width] = nchw(KIND, shape)?;
        Ok((batch, self.window(shape, channels, height, width)?))
    }

    fn output_dims(&self, batch: usize, window: &Window2d) -> [usize; 4] {
        [batch, self.out_channels, window.out_height(), window.out_width()]
    }
}

impl Layer for ChannelParallelConv2d {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        let shape = &expect_shapes(KIND, input_shapes, 1)?[0];
        let [channels, height, width] = chw(KIND, shape)?;
        let window = self.window(shape, channels, height, width)?;
        Ok(Shape::new([self.out_channels, window.out_height(), window.out_width()]))
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
        let (batch, window) = self.batch_window(input.shape())?;
        self.group.check_input(KIND, input)?;
        let out_dims = self.output_dims(batch, &window).to_vec();
        let plane = window.out_plane_len();
        let replicated = self.group.inputs_replicated();
        let results = self.group.run(vec![(); self.group.n_local()], |rank, comm, ()| {
            let device = self.group.device(rank);
            let x = input_for_shard(comm, input, device, replicated)?;
            let (weight, bias) = self.shard(rank);
            let y_block = conv_shard::forward(&x, weight, bias, &window)?;
            let y = all_gather_columns(comm, &y_block, batch, &self.parts.scaled(plane), out_dims.clone(), device)?;
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
        let input_shape = check_saved_replicated_dims(KIND, saved, self.group.n_local())?;
        let (batch, window) = self.batch_window(&input_shape)?;
        check_grad_shape(KIND, grad_output, &Shape::new(self.output_dims(batch, &window)))?;
        self.group.check_input(KIND, grad_output)?;
        let plane = window.out_plane_len();
        let replicated = self.group.inputs_replicated();
        let mut results = self.group.run(vec![(); self.group.n_local()], |rank, comm, ()| {
            let device = self.group.device(rank);
            let dims = with_channels(grad_output.shape(), self.parts.len(rank));
            let parts = self.parts.scaled(plane);
            let dy = columns_for_shard(comm, grad_output, batch, &parts, dims, device, replicated)?;
            let mut dx = conv_shard::input_grad(&dy, self.shard(rank).0, &window, &input_shape)?;
            drop(dy);
            comm.all_reduce_tensor(&mut dx)?;
            Ok(self.group.returns_output(rank).then_some(dx))
        })?;
        Ok(vec![results.swap_remove(0)])
    }

    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()> {
        check_param_grads(KIND, &self.params, param_grads)?;
        let input_shape = check_saved_replicated_dims(KIND, saved, self.group.n_local())?;
        let (batch, window) = self.batch_window(&input_shape)?;
        check_grad_shape(KIND, grad_output, &Shape::new(self.output_dims(batch, &window)))?;
        self.group.check_input(KIND, grad_output)?;
        let plane = window.out_plane_len();
        let grads = grads_per_rank(param_grads, &vec![self.per_rank(); self.group.n_local()])?;
        let replicated = self.group.inputs_replicated();
        self.group.run(grads, |rank, comm, grads| {
            let device = self.group.device(rank);
            let dims = with_channels(grad_output.shape(), self.parts.len(rank));
            let parts = self.parts.scaled(plane);
            let dy = columns_for_shard(comm, grad_output, batch, &parts, dims, device, replicated)?;
            let (weight_grad, bias_grad) = grads.split_at_mut(1);
            let x = &saved.tensors[self.group.local_index(rank)];
            conv_shard::weight_grad(&dy, x, &window, &mut weight_grad[0], bias_grad.first_mut())
        })?;
        Ok(())
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let output = self.output_shape(input_shapes)?;
        let [channels, height, width] = chw(KIND, &input_shapes[0])?;
        let window = self.window(&input_shapes[0], channels, height, width)?;
        let product_flops = 2 * (self.out_channels * window.col_rows() * window.out_plane_len()) as u64;
        let bias_flops = if self.has_bias { output.numel() as u64 } else { 0 };
        let param_count: usize = self.params.iter().map(|p| p.value.numel()).sum();
        Ok(LayerCost {
            forward_flops_per_sample: product_flops + bias_flops,
            backward_input_flops_per_sample: product_flops,
            backward_weight_flops_per_sample: product_flops + bias_flops,
            param_bytes: f32_bytes(param_count),
            activation_bytes_per_sample: f32_bytes(self.group.k() * input_shapes[0].numel()),
            output_bytes_per_sample: f32_bytes(output.numel()),
            workspace_bytes: 0,
            backward_held_bytes_per_sample: 0,
            gpu_scratch_bytes_per_sample: Default::default(),
        })
    }

    fn to_device(&mut self, device: &Device) -> Result<()> {
        self.group.to_device(KIND, device)
    }

    fn export_parameter_shapes(&self) -> Vec<(String, Shape)> {
        let mut out = vec![("weight".to_string(), Shape::new(self.weight_dims()))];
        if self.has_bias {
            out.push(("bias".to_string(), Shape::new([self.out_channels])));
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
