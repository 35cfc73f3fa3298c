//! Pooling layers over NCHW inputs: `MaxPool2d` (argmax positions saved for backward),
//! `AvgPool2d` (padding counted in the divisor, PyTorch's default) and `GlobalAvgPool2d`
//! (`[B, C, H, W] -> [B, C]`).
//!
//! They compute through the engine's device ops (`Tensor::max_pool2d`, `Tensor::avg_pool2d`,
//! `Tensor::global_avg_pool2d` and their input gradients), so they run on every device: on a CPU
//! the kernels of `conveyor_engine::cpu::pool`, in the input's dtype; on a GPU the CUDA kernels,
//! which compute in f32 and return the input's dtype too. The layers check shapes and geometry and never ask where a tensor lives.
use conveyor_engine::cpu::Window2d;
use conveyor_engine::{Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor};

use crate::tensor_io::{
    check_grad_shape, chw, expect_inputs, expect_shapes, f32_bytes, nchw, read_shape_marker, saved_tensor, shape_marker,
};

/// Kernel, stride and padding shared by the windowed pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PoolGeometry {
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
}

impl PoolGeometry {
    fn new(
        kind: &str,
        kernel: (usize, usize),
        stride: (usize, usize),
        padding: (usize, usize),
    ) -> Result<PoolGeometry> {
        if kernel.0 == 0 || kernel.1 == 0 || stride.0 == 0 || stride.1 == 0 {
            return Err(Error::invalid(
                format!("{kind} geometry"),
                format!("kernel {kernel:?} and stride {stride:?} must be at least 1 on both axes"),
            ));
        }
        if padding.0 > kernel.0 / 2 || padding.1 > kernel.1 / 2 {
            return Err(Error::invalid(
                format!("{kind} padding"),
                format!(
                    "padding {padding:?} must be at most half the kernel {kernel:?} (PyTorch's rule), so no window lies entirely in padding"
                ),
            ));
        }
        Ok(PoolGeometry { kernel, stride, padding })
    }

    fn window(&self, kind: &str, channels: usize, height: usize, width: usize, shape: &Shape) -> Result<Window2d> {
        if height == 0 || width == 0 {
            return Err(Error::shape(kind, "a non-empty plane", shape.to_string()));
        }
        Window2d::new(channels, (height, width), self.kernel, self.stride, self.padding).map_err(|_| {
            Error::shape(
                kind,
                format!("planes at least as large as the kernel {:?} after padding {:?}", self.kernel, self.padding),
                shape.to_string(),
            )
        })
    }

    /// Batch size, window and output dims of a batched NCHW input.
    fn batch_window(&self, kind: &str, shape: &Shape) -> Result<(usize, Window2d, [usize; 4])> {
        let [batch, channels, height, width] = nchw(kind, shape)?;
        let window = self.window(kind, channels, height, width, shape)?;
        Ok((batch, window, [batch, channels, window.out_height(), window.out_width()]))
    }

    fn output_shape(&self, kind: &str, input_shapes: &[Shape]) -> Result<(Shape, Window2d)> {
        let shape = &expect_shapes(kind, input_shapes, 1)?[0];
        let [channels, height, width] = chw(kind, shape)?;
        let window = self.window(kind, channels, height, width, shape)?;
        Ok((Shape::new([channels, window.out_height(), window.out_width()]), window))
    }
}

/// Max pooling over NCHW input; padding acts as -inf. Saves the argmax position of every output
/// (as f32, exact for planes below 2^24 positions) and the input shape.
#[derive(Debug)]
pub struct MaxPool2d {
    geometry: PoolGeometry,
}

impl MaxPool2d {
    /// `kernel` and `stride` as (height, width), no padding (PyTorch's `MaxPool2d(kernel, stride)`).
    pub fn new(kernel: (usize, usize), stride: (usize, usize)) -> Result<MaxPool2d> {
        MaxPool2d::with_padding(kernel, stride, (0, 0))
    }

    /// With padding on each side (at most half the kernel, PyTorch's rule).
    pub fn with_padding(kernel: (usize, usize), stride: (usize, usize), padding: (usize, usize)) -> Result<MaxPool2d> {
        Ok(MaxPool2d { geometry: PoolGeometry::new("MaxPool2d", kernel, stride, padding)? })
    }
}

impl Layer for MaxPool2d {
    fn kind(&self) -> &'static str {
        "MaxPool2d"
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        Ok(self.geometry.output_shape("MaxPool2d", input_shapes)?.0)
    }

    fn parameters(&self) -> &[Parameter] {
        &[]
    }

    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut []
    }

    fn forward(&self, inputs: &[&Tensor], _ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        expect_inputs("MaxPool2d", inputs, 1)?;
        let input = inputs[0];
        let (_, window, _) = self.geometry.batch_window("MaxPool2d", input.shape())?;
        let (output, argmax) = input.max_pool2d(&window)?;
        let saved = Saved { tensors: vec![argmax, shape_marker(input.shape(), input.device())?] };
        Ok((output, saved))
    }

    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let argmax = saved_tensor("MaxPool2d", saved, 0)?;
        let input_shape = read_shape_marker("MaxPool2d", saved_tensor("MaxPool2d", saved, 1)?)?;
        let (_, window, out_dims) = self.geometry.batch_window("MaxPool2d", &input_shape)?;
        check_grad_shape("MaxPool2d", grad_output, &Shape::new(out_dims))?;
        Ok(vec![Some(Tensor::max_pool2d_input_grad(grad_output, argmax, &window, &input_shape)?)])
    }

    fn backward_weight(&self, _saved: &Saved, _grad_output: &Tensor, _param_grads: &mut [Tensor]) -> Result<()> {
        Ok(())
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let (output, window) = self.geometry.output_shape("MaxPool2d", input_shapes)?;
        let window_len = (window.kernel_height * window.kernel_width) as u64;
        Ok(LayerCost {
            workspace_bytes: 0,
            forward_flops_per_sample: output.numel() as u64 * window_len,
            backward_input_flops_per_sample: output.numel() as u64,
            backward_weight_flops_per_sample: 0,
            param_bytes: 0,
            activation_bytes_per_sample: f32_bytes(output.numel()),
            output_bytes_per_sample: f32_bytes(output.numel()),
            backward_held_bytes_per_sample: 0,
            gpu_scratch_bytes_per_sample: Default::default(),
        })
    }
}

/// Average pooling over NCHW input; each output is its window's sum divided by kh·kw (zero padding
/// counted, PyTorch's `count_include_pad=True`). Saves only the input shape.
#[derive(Debug)]
pub struct AvgPool2d {
    geometry: PoolGeometry,
}

impl AvgPool2d {
    /// `kernel` and `stride` as (height, width), no padding.
    pub fn new(kernel: (usize, usize), stride: (usize, usize)) -> Result<AvgPool2d> {
        AvgPool2d::with_padding(kernel, stride, (0, 0))
    }

    /// With zero padding on each side (at most half the kernel).
    pub fn with_padding(kernel: (usize, usize), stride: (usize, usize), padding: (usize, usize)) -> Result<AvgPool2d> {
        Ok(AvgPool2d { geometry: PoolGeometry::new("AvgPool2d", kernel, stride, padding)? })
    }
}

impl Layer for AvgPool2d {
    fn kind(&self) -> &'static str {
        "AvgPool2d"
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        Ok(self.geometry.output_shape("AvgPool2d", input_shapes)?.0)
    }

    fn parameters(&self) -> &[Parameter] {
        &[]
    }

    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut []
    }

    fn forward(&self, inputs: &[&Tensor], _ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        expect_inputs("AvgPool2d", inputs, 1)?;
        let input = inputs[0];
        let (_, window, _) = self.geometry.batch_window("AvgPool2d", input.shape())?;
        let output = input.avg_pool2d(&window)?;
        let saved = Saved { tensors: vec![shape_marker(input.shape(), input.device())?] };
        Ok((output, saved))
    }

    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let input_shape = read_shape_marker("AvgPool2d", saved_tensor("AvgPool2d", saved, 0)?)?;
        let (_, window, out_dims) = self.geometry.batch_window("AvgPool2d", &input_shape)?;
        check_grad_shape("AvgPool2d", grad_output, &Shape::new(out_dims))?;
        Ok(vec![Some(Tensor::avg_pool2d_input_grad(grad_output, &window, &input_shape)?)])
    }

    fn backward_weight(&self, _saved: &Saved, _grad_output: &Tensor, _param_grads: &mut [Tensor]) -> Result<()> {
        Ok(())
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let (output, window) = self.geometry.output_shape("AvgPool2d", input_shapes)?;
        let window_len = (window.kernel_height * window.kernel_width) as u64;
        Ok(LayerCost {
            workspace_bytes: 0,
            forward_flops_per_sample: output.numel() as u64 * window_len,
            backward_input_flops_per_sample: output.numel() as u64 * window_len,
            backward_weight_flops_per_sample: 0,
            param_bytes: 0,
            activation_bytes_per_sample: 0,
            output_bytes_per_sample: f32_bytes(output.numel()),
            backward_held_bytes_per_sample: 0,
            gpu_scratch_bytes_per_sample: Default::default(),
        })
    }
}

/// Global average pooling: `[B, C, H, W] -> [B, C]`, each output the mean of its plane.
#[derive(Debug, Default)]
pub struct GlobalAvgPool2d;

impl GlobalAvgPool2d {
    /// The layer (it has no configuration).
    pub fn new() -> GlobalAvgPool2d {
        GlobalAvgPool2d
    }
}

impl Layer for GlobalAvgPool2d {
    fn kind(&self) -> &'static str {
        "GlobalAvgPool2d"
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        let shape = &expect_shapes("GlobalAvgPool2d", input_shapes, 1)?[0];
        let [channels, height, width] = chw("GlobalAvgPool2d", shape)?;
        if height == 0 || width == 0 {
            return Err(Error::shape("GlobalAvgPool2d", "a non-empty plane", shape.to_string()));
        }
        Ok(Shape::new([channels]))
    }

    fn parameters(&self) -> &[Parameter] {
        &[]
    }

    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut []
    }

    fn forward(&self, inputs: &[&Tensor], _ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        expect_inputs("GlobalAvgPool2d", inputs, 1)?;
        let input = inputs[0];
        let [_, _, height, width] = nchw("GlobalAvgPool2d", input.shape())?;
        if height == 0 || width == 0 {
            return Err(Error::shape("GlobalAvgPool2d", "a non-empty plane", input.shape().to_string()));
        }
        let output = input.global_avg_pool2d()?;
        let saved = Saved { tensors: vec![shape_marker(input.shape(), input.device())?] };
        Ok((output, saved))
    }

    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let input_shape = read_shape_marker("GlobalAvgPool2d", saved_tensor("GlobalAvgPool2d", saved, 0)?)?;
        let [batch, channels, _, _] = nchw("GlobalAvgPool2d", &input_shape)?;
        check_grad_shape("GlobalAvgPool2d", grad_output, &Shape::new([batch, channels]))?;
        Ok(vec![Some(Tensor::global_avg_pool2d_input_grad(grad_output, &input_shape)?)])
    }

    fn backward_weight(&self, _saved: &Saved, _grad_output: &Tensor, _param_grads: &mut [Tensor]) -> Result<()> {
        Ok(())
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let output = self.output_shape(input_shapes)?;
        let numel = input_shapes[0].numel() as u64;
        Ok(LayerCost {
            workspace_bytes: 0,
            forward_flops_per_sample: numel,
            backward_input_flops_per_sample: numel,
            backward_weight_flops_per_sample: 0,
            param_bytes: 0,
            activation_bytes_per_sample: 0,
            output_bytes_per_sample: f32_bytes(output.numel()),
            backward_held_bytes_per_sample: 0,
            gpu_scratch_bytes_per_sample: Default::default(),
        })
    }
}
