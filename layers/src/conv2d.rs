//! `Conv2d`: 2-D convolution over NCHW inputs with PyTorch's names, layout and default
//! initialisation. It computes only through the engine's device ops ([`Tensor::conv2d`],
//! [`Tensor::conv2d_input_grad`], [`Tensor::conv2d_weight_grad_accumulate`]), so it runs wherever
//! its input lives: the CPU kernels described below on a CPU device, batched im2col and cuBLAS
//! products on a GPU.
use conveyor_engine::cpu::Window2d;
use conveyor_engine::device::ops::conv2d_gpu_scratch;
use conveyor_engine::{
    Device, Error, ForwardCtx, Layer, LayerCost, Parameter, Precision, Result, Saved, Shape, Tensor, init,
};
use rand::rngs::StdRng;

use crate::tensor_io::{
    check_grad_shape, check_param_grads, check_same_device, chw, expect_inputs, expect_shapes, f32_bytes, into_dtype,
    largest_parameter_bytes, nchw, saved_tensor,
};

/// Stride, zero padding and bias of a [`Conv2d`]; the default is PyTorch's (stride 1, no padding, bias).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dOptions {
    /// (vertical, horizontal) stride.
    pub stride: (usize, usize),
    /// (rows, columns) of zeros added on each side.
    pub padding: (usize, usize),
    /// Whether the layer has a bias.
    pub bias: bool,
}

impl Default for Conv2dOptions {
    fn default() -> Self {
        Conv2dOptions { stride: (1, 1), padding: (0, 0), bias: true }
    }
}

/// 2-D convolution (cross-correlation, like PyTorch): input `[batch, in_channels, H, W]`, output
/// `[batch, out_channels, H_out, W_out]` with `H_out = floor((H + 2·pad_h - kh) / stride_h) + 1`.
///
/// Parameters (PyTorch's `nn.Conv2d`): `weight` `[out_channels, in_channels, kh, kw]`, then `bias`
/// `[out_channels]` when enabled; both default to U(±1/sqrt(in_channels·kh·kw)).
///
/// Per sample the forward pass is `y = weight [out, in·kh·kw] · im2col(x) [in·kh·kw, H_out·W_out]`;
/// the weight gradient is `dy · im2col(x)ᵀ`, the col matrix being recomputed rather than saved (it
/// is kh·kw times the input). The input gradient is, for stride 1, the gather form
/// `dx = conv(dy, flipped weightᵀ)` with padding `k - 1 - pad` (the same im2col and product,
/// writing every element), and for larger strides `col2im(weightᵀ · dy)`. im2col copies each sample
/// once into a zero-bordered scratch and then copies rows without bounds cases
/// ([`Im2col`]). A 1x1 kernel with stride 1 and no padding multiplies the input directly.
///
/// Where the output plane is a multiple of 16 pixels (the zoo's 8x8 and 32x32), the forward pass
/// and the gather-form input gradient run as one kernel over the batch
/// ([`conveyor_engine::cpu::conv_lanes`]: output pixels in SIMD lanes, no packing, and for
/// stride 1 shifted views of the input read through a row table instead of im2col), measured
/// 1.1-2.2x the general path at those sizes (`layers/benches/conv_compare.py`).
#[derive(Debug)]
pub struct Conv2d {
    in_channels: usize,
    out_channels: usize,
    kernel_size: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
    params: Vec<Parameter>,
}

impl Conv2d {
    /// A layer with PyTorch's default initialisation, parameters on the host.
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel_size: (usize, usize),
        options: Conv2dOptions,
        rng: &mut StdRng,
    ) -> Result<Conv2d> {
        let (kh, kw) = kernel_size;
        if in_channels == 0 || out_channels == 0 || kh == 0 || kw == 0 {
            return Err(Error::invalid(
                "Conv2d size",
                format!(
                    "in_channels={in_channels}, out_channels={out_channels}, kernel {kh}x{kw}: all must be at least 1"
                ),
            ));
        }
        let fan_in = in_channels * kh * kw;
        let host = Device::host();
        let weight = init::kaiming_uniform_default([out_channels, in_channels, kh, kw], fan_in, rng, &host)?;
        let bias =
            if options.bias { Some(init::bias_uniform_default([out_channels], fan_in, rng, &host)?) } else { None };
        Conv2d::from_parameters(weight, bias, options.stride, options.padding)
    }

    /// A layer from given tensors: `weight` `[out_channels, in_channels, kh, kw]`, optional `bias` `[out_channels]`.
    pub fn from_parameters(
        weight: Tensor,
        bias: Option<Tensor>,
        stride: (usize, usize),
        padding: (usize, usize),
    ) -> Result<Conv2d> {
        let &[out_channels, in_channels, kh, kw] = weight.dims() else {
            return Err(Error::shape(
                "Conv2d weight",
                "[out_channels, in_channels, kh, kw]",
                weight.shape().to_string(),
            ));
        };
        if weight.numel() == 0 {
            return Err(Error::shape(
                "Conv2d weight",
                "[out_channels, in_channels, kh, kw] with all at least 1",
                weight.shape().to_string(),
            ));
        }
        if stride.0 == 0 || stride.1 == 0 {
            return Err(Error::invalid("Conv2d stride", format!("{stride:?}: both strides must be at least 1")));
        }
        let mut params = vec![Parameter { name: "weight".into(), value: weight }];
        if let Some(bias) = bias {
            if bias.dims() != [out_channels] {
                return Err(Error::shape(
                    "Conv2d bias",
                    format!("[{out_channels}] (out_channels)"),
                    bias.shape().to_string(),
                ));
            }
            params.push(Parameter { name: "bias".into(), value: bias });
        }
        Ok(Conv2d { in_channels, out_channels, kernel_size: (kh, kw), stride, padding, params })
    }

    /// The weight, `[out_channels, in_channels, kh, kw]`.
    pub fn weight(&self) -> &Tensor {
        &self.params[0].value
    }

    /// The bias, `[out_channels]`, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.params.get(1).map(|p| &p.value)
    }

    /// (in_channels, out_channels).
    pub fn channels(&self) -> (usize, usize) {
        (self.in_channels, self.out_channels)
    }

    /// The window geometry for a per-sample input `[in_channels, height, width]`.
    fn window(&self, channels: usize, height: usize, width: usize, shape: &Shape) -> Result<Window2d> {
        if channels != self.in_channels || height == 0 || width == 0 {
            return Err(Error::shape(
                "Conv2d",
                format!("{} input channels and a non-empty plane", self.in_channels),
                shape.to_string(),
            ));
        }
        Window2d::new(channels, (height, width), self.kernel_size, self.stride, self.padding).map_err(|_| {
            Error::shape(
                "Conv2d",
                format!(
                    "an input at least as large as the kernel {:?} after padding {:?}",
                    self.kernel_size, self.padding
                ),
                shape.to_string(),
            )
        })
    }

    /// The batch size and window of a batched NCHW input.
    fn batch_window(&self, shape: &Shape) -> Result<(usize, Window2d)> {
        let [batch, channels, height, width] = nchw("Conv2d", shape)?;
        Ok((batch, self.window(channels, height, width, shape)?))
    }

    fn output_dims(&self, batch: usize, window: &Window2d) -> [usize; 4] {
        [batch, self.out_channels, window.out_height(), window.out_width()]
    }
}

impl Layer for Conv2d {
    fn kind(&self) -> &'static str {
        "Conv2d"
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        let shape = &expect_shapes("Conv2d", input_shapes, 1)?[0];
        let [channels, height, width] = chw("Conv2d", shape)?;
        let window = self.window(channels, height, width, shape)?;
        Ok(Shape::new([self.out_channels, window.out_height(), window.out_width()]))
    }

    fn parameters(&self) -> &[Parameter] {
        &self.params
    }

    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut self.params
    }

    fn forward(&self, inputs: &[&Tensor], ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        expect_inputs("Conv2d", inputs, 1)?;
        let (_, window) = self.batch_window(inputs[0].shape())?;
        check_same_device("Conv2d", inputs[0], self.weight())?;
        // Autocast ([`Precision`]): under a half precision, or given a half input, input, weight
        // and bias are rounded to the half type, the sums run in f32, the output and the saved
        // input are in the half type.
        let dtype = ctx.precision.matmul_dtype(inputs[0].dtype());
        let input = Precision::round_operand(inputs[0], dtype)?;
        let weight = Precision::round_operand(self.weight(), dtype)?;
        let bias = self.bias().map(|b| Precision::round_operand(b, dtype)).transpose()?;
        let output = input.conv2d(&weight, bias.as_ref(), &window, self.out_channels)?;
        Ok((into_dtype(output, dtype)?, Saved { tensors: vec![input] }))
    }

    fn backward_input_for(&self, saved: &Saved, grad_output: &Tensor, needed: &[bool]) -> Result<Vec<Option<Tensor>>> {
        if needed.first().copied().unwrap_or(true) {
            return self.backward_input(saved, grad_output);
        }
        let input = saved_tensor("Conv2d", saved, 0)?;
        let (batch, window) = self.batch_window(input.shape())?;
        check_grad_shape("Conv2d", grad_output, &Shape::new(self.output_dims(batch, &window)))?;
        Ok(vec![None])
    }

    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let input = saved_tensor("Conv2d", saved, 0)?;
        let (batch, window) = self.batch_window(input.shape())?;
        check_grad_shape("Conv2d", grad_output, &Shape::new(self.output_dims(batch, &window)))?;
        // The product runs in the saved input's type (rounded operands, f32 sums), as the forward.
        let grad = Precision::round_operand(grad_output, input.dtype())?;
        let weight = Precision::round_operand(self.weight(), input.dtype())?;
        let grad_input = grad.conv2d_input_grad(&weight, &window, self.out_channels, input.shape())?;
        Ok(vec![Some(into_dtype(grad_input, input.dtype())?)])
    }

    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()> {
        check_param_grads("Conv2d", &self.params, param_grads)?;
        let input = saved_tensor("Conv2d", saved, 0)?;
        let (batch, window) = self.batch_window(input.shape())?;
        check_grad_shape("Conv2d", grad_output, &Shape::new(self.output_dims(batch, &window)))?;
        let (weight_grad, bias_grad) = param_grads.split_at_mut(1);
        let grad = Precision::round_operand(grad_output, input.dtype())?;
        grad.conv2d_weight_grad_accumulate(input, &window, &mut weight_grad[0], bias_grad.first_mut())
    }

    fn weight_pass_scratch_bytes(&self) -> u64 {
        // The device ops sum each parameter's part apart (on a CPU), one parameter at a time.
        largest_parameter_bytes(&self.params)
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let output = self.output_shape(input_shapes)?;
        let [channels, height, width] = chw("Conv2d", &input_shapes[0])?;
        let window = self.window(channels, height, width, &input_shapes[0])?;
        let product_flops = 2 * (self.out_channels * window.col_rows() * window.out_plane_len()) as u64;
        let bias_flops = if self.bias().is_some() { output.numel() as u64 } else { 0 };
        let param_count: usize = self.params.iter().map(|p| p.value.numel()).sum();
        Ok(LayerCost {
            workspace_bytes: 0,
            forward_flops_per_sample: product_flops + bias_flops,
            backward_input_flops_per_sample: product_flops,
            backward_weight_flops_per_sample: product_flops + bias_flops,
            param_bytes: f32_bytes(param_count),
            activation_bytes_per_sample: f32_bytes(input_shapes[0].numel()),
            output_bytes_per_sample: f32_bytes(output.numel()),
            backward_held_bytes_per_sample: 0,
            gpu_scratch_bytes_per_sample: conv2d_gpu_scratch(&window, self.out_channels, self.bias().is_some()),
        })
    }
}
