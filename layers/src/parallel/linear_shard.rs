//! The arithmetic of one shard of a split linear layer, on the shard's device: `y = x · wᵀ + b`,
//! `dx = dy · w`, `dw += dyᵀ · x`, `db += Σ dy` for `x` `[.., in]`, `w` `[out, in]`, `dy` `[.., out]`.
//! The same products as `Linear`, on the shard's part of the weight.
use conveyor_engine::cpu::elementwise::{accumulate_column_sums, broadcast_rows};
use conveyor_engine::cpu::{MatRef, matmul};
use conveyor_engine::{DType, Result, Shape, Tensor};

use super::layout::with_last;

fn rows_of(x: &Tensor) -> usize {
    x.numel() / x.dims().last().copied().unwrap_or(1).max(1)
}

/// `[out, in]` of a weight (checked rank 2 at construction).
fn out_in(weight: &Tensor) -> (usize, usize) {
    (weight.dims()[0], weight.dims()[1])
}

/// `y = x · wᵀ + b` on the weight's device.
pub(crate) fn forward(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (out_features, in_features) = out_in(weight);
    let rows = rows_of(x);
    let mut y = Tensor::zeros(with_last(x.shape(), out_features), DType::F32, weight.device())?;
    let dst = y.as_f32_mut()?;
    if let Some(bias) = bias {
        broadcast_rows(bias.as_f32()?, dst)?;
    }
    let x_view = MatRef::row_major(x.as_f32()?, rows, in_features)?;
    let weight_t = MatRef::row_major(weight.as_f32()?, out_features, in_features)?.t();
    matmul(dst, x_view, weight_t, bias.is_some())?;
    Ok(y)
}

/// `dx = dy · w`, shaped like `x_shape`, on the weight's device.
pub(crate) fn input_grad(grad_output: &Tensor, weight: &Tensor, x_shape: &Shape) -> Result<Tensor> {
    let (out_features, in_features) = out_in(weight);
    let rows = rows_of(grad_output);
    let mut dx = Tensor::zeros(with_last(x_shape, in_features), DType::F32, weight.device())?;
    matmul(
        dx.as_f32_mut()?,
        MatRef::row_major(grad_output.as_f32()?, rows, out_features)?,
        MatRef::row_major(weight.as_f32()?, out_features, in_features)?,
        false,
    )?;
    Ok(dx)
}

/// `dw += dyᵀ · x` and `db += Σ_rows dy`.
pub(crate) fn weight_grad(
    grad_output: &Tensor,
    x: &Tensor,
    weight_grad: &mut Tensor,
    bias_grad: Option<&mut Tensor>,
) -> Result<()> {
    let (out_features, in_features) = (weight_grad.dims()[0], weight_grad.dims()[1]);
    let rows = rows_of(x);
    let dy = grad_output.as_f32()?;
    let dy_t = MatRef::row_major(dy, rows, out_features)?.t();
    matmul(weight_grad.as_f32_mut()?, dy_t, MatRef::row_major(x.as_f32()?, rows, in_features)?, true)?;
    if let Some(bias_grad) = bias_grad {
        accumulate_column_sums(dy, bias_grad.as_f32_mut()?)?;
    }
    Ok(())
}
