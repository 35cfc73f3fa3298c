//! `ChannelParallelConvStack`: AlexNet's split of a stack of convolutions with configurable
//! exchange points. Every conv is split by output channels over the `k` devices; each conv either
//! *exchanges* (its input is all-gathered, so every device's filters see every channel) or does
//! not (each device's filters see only the channels its own device computed one layer earlier:
//! PyTorch's `nn.Conv2d(groups=k)`).
//!
//! # Exchanges per call
//!
//! Forward: the first conv's input is broadcast from the first device (exchanging) or scattered by
//! channel blocks (grouped); every later exchanging conv all-gathers the previous conv's channel
//! blocks; a grouped conv exchanges nothing; the last conv's blocks are all-gathered into the
//! output. Backward mirrors it: `dy` is scattered by channel blocks; an exchanging conv's partial
//! input gradients are reduce-scattered into the previous conv's blocks (all-reduced for the
//! first conv, whose gradient leaves from the first device); a grouped conv's input gradient stays
//! on its device (gathered for the first conv). `backward_weight` repeats the backward chain up to
//! the first conv's filters (the `Layer` API's two backward calls share no state).
use conveyor_engine::collective::{Communicator, Partition, Traffic};
use conveyor_engine::cpu::Window2d;
use conveyor_engine::device::ops::Activation;
use conveyor_engine::{Device, Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor};
use rand::rngs::StdRng;

use super::exchange::{
    all_gather_columns, broadcast_from_first, gather_columns, grads_per_rank, reduce_scatter_columns, scatter_columns,
};
use super::group::ShardGroup;
use super::layout::with_channels;
use super::{conv_shard, load_shard, shard_rows, split_features, unsplit_rows};
use crate::tensor_io::{check_grad_shape, check_param_grads, chw, expect_inputs, expect_shapes, f32_bytes, nchw};
use crate::{Conv2d, Conv2dOptions};

const KIND: &str = "ChannelParallelConvStack";

/// One conv of a [`ChannelParallelConvStack`]: the unsplit `Conv2d` geometry, an optional ReLU
/// after it, and whether its input is exchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvStackLayer {
    /// Input channels of the unsplit conv (all of them, also for a grouped conv).
    pub in_channels: usize,
    /// Output channels, split over the devices.
    pub out_channels: usize,
    /// (height, width) of the kernel.
    pub kernel_size: (usize, usize),
    /// Stride, padding and bias.
    pub options: Conv2dOptions,
    /// A ReLU after the conv.
    pub relu: bool,
    /// `true`: the input is exchanged (all-gathered, or broadcast for the first conv) and every
    /// filter sees every input channel; weight `[out, in, kh, kw]`. `false`: a grouped conv
    /// (`groups = k`): device `r`'s filters see only input channel block `r`; weight
    /// `[out, in/k, kh, kw]`; needs `in` and `out` divisible by `k`.
    pub exchange: bool,
}

impl ConvStackLayer {
    /// A conv `in → out` with a `kernel`, default options, a ReLU after it, exchanging its input.
    pub fn new(in_channels: usize, out_channels: usize, kernel_size: (usize, usize)) -> Self {
        ConvStackLayer {
            in_channels,
            out_channels,
            kernel_size,
            options: Conv2dOptions::default(),
            relu: true,
            exchange: true,
        }
    }
}

/// Geometry of one conv of the stack, fixed at construction.
#[derive(Debug)]
struct StackConv {
    spec: ConvStackLayer,
    /// Output channels per device.
    parts: Partition,
    /// Input channels each device's filters see: `in` (exchanging) or `in / k` (grouped).
    in_per_shard: usize,
    /// Offset of this conv's `weight` within one rank's run of parameters.
    offset: usize,
    /// Index of this conv in the equivalent `nn.Sequential` (ReLUs count as modules).
    module_idx: usize,
}

impl StackConv {
    fn unsplit_weight_dims(&self) -> [usize; 4] {
        let (kh, kw) = self.spec.kernel_size;
        [self.spec.out_channels, self.in_per_shard, kh, kw]
    }
}

/// A stack of channel-split convolutions (each with an optional ReLU) as one layer, with a
/// per-conv choice of exchanging the input or computing a grouped conv; see the module docs.
///
/// Unsplit parameters carry `nn.Sequential`'s names, ReLUs counting as modules: for
/// conv, ReLU, conv they are `0.weight`, `0.bias`, `2.weight`, `2.bias`; a grouped conv's weight
/// is `nn.Conv2d(groups=k)`'s `[out, in/k, kh, kw]`. `parameters()` is rank-major: for each device,
/// each conv's `weight` shard then its `bias` shard, under the same names.
#[derive(Debug)]
pub struct ChannelParallelConvStack {
    convs: Vec<StackConv>,
    per_rank: usize,
    params: Vec<Parameter>,
    group: ShardGroup,
}

/// Per-device saved state of one forward: each conv's input as that device saw it, and each ReLU
/// output block.
struct ShardSaved<'a> {
    inputs: Vec<&'a Tensor>,
    activations: Vec<Option<&'a Tensor>>,
}

impl ChannelParallelConvStack {
    /// A stack whose convs are initialised like `Conv2d::new` (a grouped conv like PyTorch's, with
    /// fan-in `in/k · kh · kw`), split over `devices`.
    pub fn new(layers: &[ConvStackLayer], devices: &[Device], rng: &mut StdRng) -> Result<Self> {
        let k = devices.len().max(1);
        let mut params = Vec::with_capacity(layers.len());
        for spec in layers {
            let in_per_shard = if spec.exchange { spec.in_channels } else { spec.in_channels / k };
            let conv = Conv2d::new(in_per_shard.max(1), spec.out_channels, spec.kernel_size, spec.options, rng)?;
            params.push((conv.weight().try_clone()?, conv.bias().map(Tensor::try_clone).transpose()?));
        }
        ChannelParallelConvStack::from_parameters(layers, &params, devices)
    }

    /// The unsplit `(weight, bias)` of each conv (bias present exactly when `options.bias`) split
    /// over `devices`.
    pub fn from_parameters(
        layers: &[ConvStackLayer],
        params: &[(Tensor, Option<Tensor>)],
        devices: &[Device],
    ) -> Result<Self> {
        let group = ShardGroup::new(KIND, &super::Shards::Local(devices.to_vec()))?;
        let k = group.k();
        if layers.is_empty() || layers.len() != params.len() {
            return Err(Error::invalid(
                format!("{KIND} layers"),
                format!(
                    "{} layers and {} parameter pairs: give at least one conv and one pair per conv",
                    layers.len(),
                    params.len()
                ),
            ));
        }
        let mut convs = Vec::with_capacity(layers.len());
        let (mut offset, mut module_idx) = (0, 0);
        for (i, spec) in layers.iter().enumerate() {
            let what = format!("{KIND} conv {i}");
            if let Some(prev) = layers.get(i.wrapping_sub(1))
                && prev.out_channels != spec.in_channels
            {
                return Err(Error::shape(
                    what,
                    format!("{} input channels (conv {})", prev.out_channels, i - 1),
                    spec.in_channels.to_string(),
                ));
            }
            if spec.options.stride.0 == 0
                || spec.options.stride.1 == 0
                || spec.kernel_size.0 == 0
                || spec.kernel_size.1 == 0
            {
                return Err(Error::invalid(what, "kernel and stride must be at least 1"));
            }
            if !spec.exchange && (spec.in_channels % k != 0 || spec.out_channels % k != 0) {
                return Err(Error::invalid(
                    what,
                    format!(
                        "a grouped conv {} → {} over {k} devices: both channel counts must be divisible by {k}; exchange its input instead",
                        spec.in_channels, spec.out_channels
                    ),
                ));
            }
            let parts = split_features(KIND, "out_channels", spec.out_channels, k)?;
            let in_per_shard = if spec.exchange { spec.in_channels } else { spec.in_channels / k };
            let conv = StackConv { spec: *spec, parts, in_per_shard, offset, module_idx };
            let (weight, bias) = &params[i];
            if weight.dims() != conv.unsplit_weight_dims() {
                return Err(Error::shape(
                    format!("{what} weight"),
                    format!("{:?}", conv.unsplit_weight_dims()),
                    weight.shape().to_string(),
                ));
            }
            match bias {
                Some(bias) if spec.options.bias && bias.dims() == [spec.out_channels] => {}
                None if !spec.options.bias => {}
                _ => {
                    return Err(Error::invalid(
                        format!("{what} bias"),
                        format!(
                            "options.bias is {}: give a bias [{}] exactly when it is true",
                            spec.options.bias, spec.out_channels
                        ),
                    ));
                }
            }
            offset += 1 + usize::from(spec.options.bias);
            module_idx += 1 + usize::from(spec.relu);
            convs.push(conv);
        }
        let per_rank = offset;
        let mut shards = Vec::with_capacity(per_rank * k);
        for (rank, device) in group.devices().iter().enumerate() {
            for (conv, (weight, bias)) in convs.iter().zip(params) {
                let [_, in_per_shard, kh, kw] = conv.unsplit_weight_dims();
                let channels = conv.parts.range(rank);
                let dims = [channels.len(), in_per_shard, kh, kw];
                let value = shard_rows(weight, channels.clone(), dims, device)?;
                shards.push(Parameter { name: format!("{}.weight", conv.module_idx), value });
                if let Some(bias) = bias {
                    let value = shard_rows(bias, channels.clone(), [channels.len()], device)?;
                    shards.push(Parameter { name: format!("{}.bias", conv.module_idx), value });
                }
            }
        }
        Ok(ChannelParallelConvStack { convs, per_rank, params: shards, group })
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

    fn weight(&self, rank: usize, conv: usize) -> &Tensor {
        &self.params[rank * self.per_rank + self.convs[conv].offset].value
    }

    fn bias(&self, rank: usize, conv: usize) -> Option<&Tensor> {
        let conv_ref = &self.convs[conv];
        conv_ref.spec.options.bias.then(|| &self.params[rank * self.per_rank + conv_ref.offset + 1].value)
    }

    /// The unsplit parameters on the host under `nn.Sequential`'s names (see the type's docs).
    pub fn gather_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for conv in &self.convs {
            let shards = |at: usize| (0..self.group.k()).map(move |rank| &self.params[rank * self.per_rank + at]);
            out.push((
                format!("{}.weight", conv.module_idx),
                unsplit_rows(shards(conv.offset), conv.unsplit_weight_dims())?,
            ));
            if conv.spec.options.bias {
                out.push((
                    format!("{}.bias", conv.module_idx),
                    unsplit_rows(shards(conv.offset + 1), [conv.spec.out_channels])?,
                ));
            }
        }
        Ok(out)
    }

    /// Splits the unsplit tensor `name` (a name [`Self::gather_parameters`] gives) into the shards.
    pub fn load_unsplit(&mut self, name: &str, value: &Tensor) -> Result<()> {
        let found = self.convs.iter().find_map(|conv| {
            if name == format!("{}.weight", conv.module_idx) {
                Some((conv.offset, conv.unsplit_weight_dims().to_vec(), &conv.parts))
            } else if conv.spec.options.bias && name == format!("{}.bias", conv.module_idx) {
                Some((conv.offset + 1, vec![conv.spec.out_channels], &conv.parts))
            } else {
                None
            }
        });
        let Some((offset, dims, parts)) = found else {
            let names: Vec<String> = self.export_parameter_shapes().into_iter().map(|(n, _)| n).collect();
            return Err(Error::invalid(format!("{KIND} parameter"), format!("`{name}`: expected one of {names:?}")));
        };
        if value.dims() != dims {
            return Err(Error::shape(format!("{KIND} {name}"), format!("{dims:?}"), value.shape().to_string()));
        }
        let blocks: Vec<Tensor> = (0..self.group.k())
            .map(|rank| {
                let channels = parts.range(rank);
                value.narrow_rows(channels.start, channels.len())
            })
            .collect::<Result<_>>()?;
        for (rank, block) in blocks.into_iter().enumerate() {
            load_shard(&mut self.params[rank * self.per_rank + offset].value, block)?;
        }
        Ok(())
    }

    /// Each conv's window (on the input one device's filters see) for a batch input shape
    /// `[batch, in, H, W]`; returns the batch too.
    fn windows(&self, shape: &Shape) -> Result<(usize, Vec<Window2d>)> {
        let [batch, channels, mut height, mut width] = nchw(KIND, shape)?;
        if channels != self.convs[0].spec.in_channels || height == 0 || width == 0 {
            return Err(Error::shape(
                KIND,
                format!("{} input channels and a non-empty plane", self.convs[0].spec.in_channels),
                shape.to_string(),
            ));
        }
        let mut windows = Vec::with_capacity(self.convs.len());
        for (i, conv) in self.convs.iter().enumerate() {
            let spec = &conv.spec;
            let window = Window2d::new(
                conv.in_per_shard,
                (height, width),
                spec.kernel_size,
                spec.options.stride,
                spec.options.padding,
            )
            .map_err(|_| {
                Error::shape(
                    format!("{KIND} conv {i}"),
                    format!(
                        "an input at least as large as the kernel {:?} after padding {:?}",
                        spec.kernel_size, spec.options.padding
                    ),
                    format!("{height}x{width}"),
                )
            })?;
            (height, width) = (window.out_height(), window.out_width());
            windows.push(window);
        }
        Ok((batch, windows))
    }

    fn output_dims(&self, batch: usize, windows: &[Window2d]) -> [usize; 4] {
        let last = windows.last().expect("a stack has at least one conv");
        [batch, self.convs.last().expect("non-empty").spec.out_channels, last.out_height(), last.out_width()]
    }

    /// Saved tensors per rank: one input per conv, then one activation per ReLU.
    fn saved_per_rank(&self) -> usize {
        self.convs.len() + self.convs.iter().filter(|c| c.spec.relu).count()
    }

    fn shard_saved<'a>(&self, saved: &'a Saved, rank: usize) -> ShardSaved<'a> {
        let run = &saved.tensors[rank * self.saved_per_rank()..(rank + 1) * self.saved_per_rank()];
        let (inputs, mut relus) = (run[..self.convs.len()].iter().collect(), run[self.convs.len()..].iter());
        let activations = self.convs.iter().map(|c| if c.spec.relu { relus.next() } else { None }).collect();
        ShardSaved { inputs, activations }
    }

    fn check_saved(&self, saved: &Saved) -> Result<(usize, Vec<Window2d>)> {
        if saved.tensors.len() != self.group.k() * self.saved_per_rank() {
            return Err(Error::invalid(
                format!("{KIND} saved state"),
                format!(
                    "expected {} tensors, found {}; pass the Saved returned by this layer's forward",
                    self.group.k() * self.saved_per_rank(),
                    saved.tensors.len()
                ),
            ));
        }
        let first = &saved.tensors[0];
        let mut dims = first.dims().to_vec();
        if dims.len() == 4 && !self.convs[0].spec.exchange {
            dims[1] = self.convs[0].spec.in_channels;
        }
        self.windows(&Shape::new(dims))
    }

    /// The backward chain on one rank from the output gradient down to the first conv: adds the
    /// weight gradients into `grads` when given, and returns the input gradient on rank 0 when
    /// `want_dx` (else `None`).
    #[allow(clippy::too_many_arguments)]
    fn backward_chain(
        &self,
        rank: usize,
        comm: &(impl Communicator + ?Sized),
        shard: &ShardSaved<'_>,
        grad_output: &Tensor,
        batch: usize,
        windows: &[Window2d],
        mut grads: Option<&mut [Tensor]>,
        want_dx: bool,
    ) -> Result<Option<Tensor>> {
        let device = &self.group.devices()[rank];
        let last = self.convs.len() - 1;
        let plane = windows[last].out_plane_len();
        let dims = with_channels(grad_output.shape(), self.convs[last].parts.len(rank));
        let mut dy = scatter_columns(comm, grad_output, batch, &self.convs[last].parts.scaled(plane), dims, device)?;
        for (i, conv) in self.convs.iter().enumerate().rev() {
            if let Some(activation) = shard.activations[i] {
                dy = Tensor::activation_grad(Activation::Relu, activation, &dy)?;
            }
            let x = shard.inputs[i];
            if let Some(grads) = grads.as_deref_mut() {
                let (weight_grad, rest) = grads[conv.offset..].split_at_mut(1);
                let bias_grad = if conv.spec.options.bias { rest.first_mut() } else { None };
                conv_shard::weight_grad(&dy, x, &windows[i], &mut weight_grad[0], bias_grad)?;
            }
            if i == 0 && !want_dx {
                return Ok(None);
            }
            let mut dx = conv_shard::input_grad(&dy, self.weight(rank, i), &windows[i], x.shape())?;
            drop(dy);
            if i == 0 {
                if conv.spec.exchange {
                    comm.all_reduce_tensor(&mut dx)?;
                    return Ok((rank == 0).then_some(dx));
                }
                let in_plane = windows[0].in_height * windows[0].in_width;
                let in_parts = Partition::even(conv.spec.in_channels, self.group.k())?;
                let dims = with_channels(dx.shape(), conv.spec.in_channels);
                return gather_columns(comm, &dx, batch, &in_parts.scaled(in_plane), dims, device);
            }
            let prev = &self.convs[i - 1];
            dy = if conv.spec.exchange {
                let in_plane = windows[i].in_height * windows[i].in_width;
                let dims = with_channels(dx.shape(), prev.parts.len(rank));
                reduce_scatter_columns(comm, &dx, batch, &prev.parts.scaled(in_plane), dims, device)?
            } else {
                dx
            };
        }
        unreachable!("the loop returns at the first conv")
    }
}

impl Layer for ChannelParallelConvStack {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        let shape = &expect_shapes(KIND, input_shapes, 1)?[0];
        let [channels, height, width] = chw(KIND, shape)?;
        let (_, windows) = self.windows(&Shape::new([1, channels, height, width]))?;
        let [_, out, h, w] = self.output_dims(1, &windows);
        Ok(Shape::new([out, h, w]))
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
        let (batch, windows) = self.windows(input.shape())?;
        self.group.check_input(KIND, input)?;
        let out_dims = self.output_dims(batch, &windows).to_vec();
        let k = self.group.k();
        let results = self.group.run(vec![(); k], |rank, comm, ()| {
            let device = &self.group.devices()[rank];
            let first = &self.convs[0];
            let mut x = if first.spec.exchange {
                broadcast_from_first(comm, input, device)?
            } else {
                let in_parts = Partition::even(first.spec.in_channels, k)?;
                let plane = windows[0].in_height * windows[0].in_width;
                let dims = with_channels(input.shape(), in_parts.len(rank));
                scatter_columns(comm, input, batch, &in_parts.scaled(plane), dims, device)?
            };
            let (mut conv_inputs, mut activations) = (Vec::new(), Vec::new());
            let mut y = Tensor::zeros([0], conveyor_engine::DType::F32, device)?;
            for (i, conv) in self.convs.iter().enumerate() {
                if i > 0 {
                    x = if conv.spec.exchange {
                        let prev = &self.convs[i - 1];
                        let plane = windows[i].in_height * windows[i].in_width;
                        let dims = with_channels(y.shape(), conv.spec.in_channels);
                        all_gather_columns(comm, &y, batch, &prev.parts.scaled(plane), dims, device)?
                    } else {
                        std::mem::replace(&mut y, Tensor::zeros([0], conveyor_engine::DType::F32, device)?)
                    };
                }
                y = conv_shard::forward(&x, self.weight(rank, i), self.bias(rank, i), &windows[i])?;
                if conv.spec.relu {
                    y = y.activation(Activation::Relu)?;
                    activations.push(y.share());
                }
                conv_inputs.push(std::mem::replace(&mut x, Tensor::zeros([0], conveyor_engine::DType::F32, device)?));
            }
            let last = self.convs.last().expect("non-empty");
            let plane = windows.last().expect("non-empty").out_plane_len();
            let output = all_gather_columns(comm, &y, batch, &last.parts.scaled(plane), out_dims.clone(), device)?;
            conv_inputs.extend(activations);
            Ok((conv_inputs, (rank == 0).then_some(output)))
        })?;
        let mut tensors = Vec::with_capacity(k * self.saved_per_rank());
        let mut output = None;
        for (saved, y) in results {
            tensors.extend(saved);
            output = output.or(y);
        }
        let output = output.ok_or_else(|| Error::invalid(KIND, "rank 0 returned no output"))?;
        Ok((output, Saved { tensors }))
    }

    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let (batch, windows) = self.check_saved(saved)?;
        check_grad_shape(KIND, grad_output, &Shape::new(self.output_dims(batch, &windows)))?;
        self.group.check_input(KIND, grad_output)?;
        let mut results = self.group.run(vec![(); self.group.k()], |rank, comm, ()| {
            let shard = self.shard_saved(saved, rank);
            self.backward_chain(rank, comm, &shard, grad_output, batch, &windows, None, true)
        })?;
        Ok(vec![results.swap_remove(0)])
    }

    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()> {
        check_param_grads(KIND, &self.params, param_grads)?;
        let (batch, windows) = self.check_saved(saved)?;
        check_grad_shape(KIND, grad_output, &Shape::new(self.output_dims(batch, &windows)))?;
        self.group.check_input(KIND, grad_output)?;
        let grads = grads_per_rank(param_grads, &vec![self.per_rank; self.group.k()])?;
        self.group.run(grads, |rank, comm, grads| {
            let shard = self.shard_saved(saved, rank);
            self.backward_chain(rank, comm, &shard, grad_output, batch, &windows, Some(grads), false).map(|_| ())
        })?;
        Ok(())
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let output = self.output_shape(input_shapes)?;
        let [channels, height, width] = chw(KIND, &input_shapes[0])?;
        let (_, windows) = self.windows(&Shape::new([1, channels, height, width]))?;
        let (mut product_flops, mut bias_flops, mut saved_numel) = (0u64, 0u64, 0usize);
        for (i, (conv, window)) in self.convs.iter().zip(&windows).enumerate() {
            let out_numel = conv.spec.out_channels * window.out_plane_len();
            product_flops += 2 * (conv.spec.out_channels * window.col_rows() * window.out_plane_len()) as u64;
            if conv.spec.options.bias {
                bias_flops += out_numel as u64;
            }
            let in_numel = window.in_height * window.in_width * conv.spec.in_channels;
            saved_numel += if conv.spec.exchange { self.group.k() * in_numel } else { in_numel };
            // A kept activation that the next conv takes without an exchange is that conv's
            // saved input too, one shared buffer counted above.
            let next_takes_it_as_is = self.convs.get(i + 1).is_some_and(|next| !next.spec.exchange);
            if conv.spec.relu && !next_takes_it_as_is {
                saved_numel += out_numel;
            }
        }
        let param_count: usize = self.params.iter().map(|p| p.value.numel()).sum();
        Ok(LayerCost {
            forward_flops_per_sample: product_flops + bias_flops,
            backward_input_flops_per_sample: product_flops,
            backward_weight_flops_per_sample: product_flops + bias_flops,
            param_bytes: f32_bytes(param_count),
            activation_bytes_per_sample: f32_bytes(saved_numel),
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
        let mut out = Vec::new();
        for conv in &self.convs {
            out.push((format!("{}.weight", conv.module_idx), Shape::new(conv.unsplit_weight_dims())));
            if conv.spec.options.bias {
                out.push((format!("{}.bias", conv.module_idx), Shape::new([conv.spec.out_channels])));
            }
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
}
