//! Elementwise activation layers: `Relu`, `Gelu` (exact erf form) and `Tanh`. Each keeps one
//! tensor for backward, as a share (no copy): ReLU and tanh their output, GELU its input. A
//! ReLU's output is usually also the next Linear's saved input, one buffer on the ledger.
use conveyor_engine::cpu::activation::{gelu, gelu_grad, relu, relu_grad, tanh, tanh_grad};
use conveyor_engine::cpu::uninit;
use conveyor_engine::{ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor};

use crate::tensor_io::{check_grad_shape, expect_inputs, expect_shapes, f32_bytes, into_dtype, saved_tensor, values};

/// Which tensor an activation keeps for its backward pass.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Keep {
    Input,
    Output,
}

/// Runs an elementwise forward kernel (the activation of one element, statically dispatched so
/// the loop vectorises) and saves what backward needs: a share of the kept tensor, no copy.
fn elementwise_forward(
    kind: &str,
    inputs: &[&Tensor],
    kernel: impl Fn(f32) -> f32,
    keep: Keep,
) -> Result<(Tensor, Saved)> {
    expect_inputs(kind, inputs, 1)?;
    let input = inputs[0];
    let x = values(input);
    let output = Tensor::from_f32_init(input.shape().clone(), input.device(), |dst| uninit::map(dst, &x, kernel))?;
    let output = into_dtype(output, input.dtype())?;
    let kept = match keep {
        Keep::Input => input.share(),
        Keep::Output => output.share(),
    };
    Ok((output, Saved { tensors: vec![kept] }))
}

/// Runs an elementwise backward kernel on the saved tensor and `grad_output`.
/// `kernel` maps the kept element (input or output) and its output gradient to the input gradient.
fn elementwise_backward(
    kind: &str,
    saved: &Saved,
    grad_output: &Tensor,
    kernel: impl Fn(f32, f32) -> f32,
) -> Result<Vec<Option<Tensor>>> {
    let kept = saved_tensor(kind, saved, 0)?;
    check_grad_shape(kind, grad_output, kept.shape())?;
    let (kept_values, grad) = (values(kept), values(grad_output));
    let grad_input = Tensor::from_f32_init(kept.shape().clone(), grad_output.device(), |dst| {
        uninit::map2(dst, &kept_values, &grad, kernel)
    })?;
    Ok(vec![Some(into_dtype(grad_input, kept.dtype())?)])
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
    })
}

macro_rules! activation_layer {
    ($name:ident, $kind:literal, $doc:literal, $forward:path, $backward:path, $keep:expr, $flops:literal) => {
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
                elementwise_forward($kind, inputs, $forward, $keep)
            }

            fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
                elementwise_backward($kind, saved, grad_output, $backward)
            }

            fn backward_weight(&self, _saved: &Saved, _grad_output: &Tensor, _param_grads: &mut [Tensor]) -> Result<()> {
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
    "`y = max(x, 0)` (PyTorch's `nn.ReLU`); the derivative at 0 is 0. Saves its output.",
    relu,
    relu_grad,
    Keep::Output,
    1
);

activation_layer!(
    Gelu,
    "GELU",
    "`y = x · Φ(x) = x/2 · (1 + erf(x/√2))`, the exact form (PyTorch's `nn.GELU()` with \
     `approximate='none'`); `dy/dx = Φ(x) + x·φ(x)`. Saves its input.",
    gelu,
    gelu_grad,
    Keep::Input,
    20
);

activation_layer!(
    Tanh,
    "Tanh",
    "`y = tanh(x)`; `dy/dx = 1 - y²`. Saves its output.",
    tanh,
    tanh_grad,
    Keep::Output,
    10
);
