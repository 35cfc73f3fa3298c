//! The arithmetic of one shard of a channel-split convolution, on the shard's device: the
//! convolution device ops `Conv2d` uses (`Tensor::conv2d`, `conv2d_input_grad`,
//! `conv2d_weight_grad_accumulate`), on the shard's output filters `weight_r [out_r, in, kh, kw]`.
use conveyor_engine::cpu::Window2d;
use conveyor_engine::{Result, Shape, Tensor};

/// `y [batch, out_r, H_out, W_out] = weight_r ⊛ x + bias_r`.
pub(crate) fn forward(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, window: &Window2d) -> Result<Tensor> {
    x.conv2d(weight, bias, window, weight.dims()[0])
}

/// This shard's part of the input gradient: the gradient through its filters alone.
pub(crate) fn input_grad(grad_output: &Tensor, weight: &Tensor, window: &Window2d, x_shape: &Shape) -> Result<Tensor> {
    grad_output.conv2d_input_grad(weight, window, weight.dims()[0], x_shape)
}

/// `dweight_r += Σ_samples dy_r · im2col(x)ᵀ` and `dbias_r += Σ_plane dy_r`.
pub(crate) fn weight_grad(
    grad_output: &Tensor,
    x: &Tensor,
    window: &Window2d,
    weight_grad: &mut Tensor,
    bias_grad: Option<&mut Tensor>,
) -> Result<()> {
    grad_output.conv2d_weight_grad_accumulate(x, window, weight_grad, bias_grad)
}
