//! Elementwise activation layers: `Relu`, `Gelu` (exact erf form), `GeluTanh` (PyTorch's
//! `approximate='tanh'`) and `Tanh`. Each keeps one tensor for backward, as a share (no copy):
//! ReLU and tanh their output, the GELUs their input. A
//! ReLU's output is usually also the next Linear's saved input, one buffer on the ledger.
//!
//! The arithmetic is the engine's device op ([`Tensor::activation`],
//! [`Tensor::activation_grad`]), so the layers run on every device: the CPU kernels of
//! `conveyor_engine::cpu::activation` on a CPU device, the CUDA kernels on a GPU.
use conveyor_engine::device::ops::Activation;
use conveyor_engine::{ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor};

use crate::tensor_io::{check_grad_shape, expect_inputs, expect_shapes, f32_bytes, saved_tensor};

/// Which tensor an activation keeps for its backward pass.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Keep {
    Input,
    Output,
}

/// Runs an elementwise forward op and saves what backward needs: a share of the kept tensor, no copy.
fn elementwise_forward(kind: &str, inputs: &[&Tensor], activation: Activation, keep: Keep) -> Result<(Tensor, Saved)> {
    expect_inputs(kind, inputs, 1)?;
    let input = inputs[0];
    let output = input.activation(activation)?;
    let kept = match keep {
        Keep::Input => input.share(),
        Keep::Output => output.share(),
    };
    Ok((output, Saved { tensors: vec![kept] }))
}

/// Runs an elementwise backward op on the saved tensor (input or output) and `grad_output`.
fn elementwise_backward(
    kind: &str,
    saved: &Saved,
    grad_output: &Tensor,
    activation: Activation,
) -> Result<Vec<Option<Tensor>>> {
    let kept = saved_tensor(kind, saved, 0)?;
    check_grad_shape(kind, grad_output, kept.shape())?;
    Ok(vec![Some(Tensor::activation_grad(activation, kept, grad_output)?)])
}

/// Cost of an elementwise layer: `flops_per_element` forward and backward, one saved tensor.
fn elementwise_cost(kind: &str, input_shapes: &[Shape], flops_per_element: u64) -> Result<LayerCost> {
    let numel = expect_shapes(kind, input_shapes, 1)?[0].numel();
    Ok(LayerCost {
        workspace_bytes: 0,
        forward_flops_per_sample: flops_per_element * numel as u64,
        backward_input_flops_per_sample: flops_per_element * numel as u64,
        backward_weight_flops_per_sample: 0,
        param_bytes: 0,
        activation_bytes_per_sample: f32_bytes(numel),
        output_bytes_per_sample: f32_bytes(numel),
        backward_held_bytes_per_sample: 0,
        gpu_scratch_bytes_per_sample: Default::default(),
    })
}

macro_rules! activation_layer {
    ($name:ident, $kind:literal, $doc:literal, $activation:expr, $keep:expr, $flops:literal) => {
        #[doc = $doc]
        #[derive(Debug, Default, Clone, Copy)]
        pub struct $name;

        impl $name {
            /// The layer (it has no parameters).
            pub fn new() -> $name {
                $name
            }
        }

        impl Layer for $name {
            fn kind(&self) -> &'static str {
                $kind
            }

            fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
                Ok(expect_shapes($kind, input_shapes, 1)?[0].clone())
            }

            fn parameters(&self) -> &[Parameter] {
                &[]
            }

            fn parameters_mut(&mut self) -> &mut [Parameter] {
                &mut []
            }

            fn forward(&self, inputs: &[&Tensor], _ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
                elementwise_forward($kind, inputs, $activation, $keep)
            }

            fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
                elementwise_backward($kind, saved, grad_output, $activation)
            }

            fn backward_weight(
                &self,
                _saved: &Saved,
                _grad_output: &Tensor,
                _param_grads: &mut [Tensor],
            ) -> Result<()> {
                Ok(())
            }

            fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
                elementwise_cost($kind, input_shapes, $flops)
            }
        }
    };
}

activation_layer!(
    Relu,
    "ReLU",
    "`y = max(x, 0)` (PyTorch's `nn.ReLU`: NaN propagates, `relu(-0.0) = -0.0`); the derivative at 0 \
     is 0 and at NaN 1. Saves its output.",
    Activation::Relu,
    Keep::Output,
    1
);

activation_layer!(
    Gelu,
    "GELU",
    "`y = x · Φ(x) = x/2 · (1 + erf(x/√2))`, the exact form (PyTorch's `nn.GELU()` with \
     `approximate='none'`); `dy/dx = Φ(x) + x·φ(x)`. Saves its input.",
    Activation::Gelu,
    Keep::Input,
    20
);

activation_layer!(
    GeluTanh,
    "GELUTanh",
    "`y = x/2 · (1 + tanh(√(2/π)·(x + 0.044715·x³)))`, PyTorch's `nn.GELU(approximate='tanh')` \
     (evaluated as the equal `x / (1 + e^{-2u})`, which does not cancel for negative `x`). Saves its \
     input.",
    Activation::GeluTanh,
    Keep::Input,
    24
);

activation_layer!(
    Tanh,
    "Tanh",
    "`y = tanh(x)`; `dy/dx = 1 - y²`. Saves its output.",
    Activation::Tanh,
    Keep::Output,
    10
);
