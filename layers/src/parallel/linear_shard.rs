//! The arithmetic of one shard of a split linear layer, on the shard's device: `y = x · wᵀ + b`,
//! `dx = dy · w`, `dw += dyᵀ · x`, `db += Σ dy` for `x` `[.., in]`, `w` `[out, in]`, `dy` `[.., out]`.
//! The same products as `Linear`, on the shard's part of the weight.
use conveyor_engine::cpu::elementwise::accumulate_column_sums;
use conveyor_engine::cpu::{MatRef, matmul, matmul_uninit, uninit};
use conveyor_engine::{Result, Shape, Tensor};

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
    let x_view = MatRef::row_major(x.as_f32()?, rows, in_features)?;
    let weight_t = MatRef::row_major(weight.as_f32()?, out_features, in_features)?.t();
    let bias = bias.map(Tensor::as_f32).transpose()?;
    // Written in full (bias pre-fill, then the product onto it; or the product alone): no zero-fill.
    Tensor::from_f32_init(with_last(x.shape(), out_features), weight.device(), |dst| match bias {
        Some(bias) => {
            let dst = uninit::broadcast_rows(bias, dst)?;
            matmul(dst, x_view, weight_t, true)?;
            Ok(dst)
        }
        None => matmul_uninit(dst, x_view, weight_t),
    })
}

/// `dx = dy · w`, shaped like `x_shape`, on the weight's device.
pub(crate) fn input_grad(grad_output: &Tensor, weight: &Tensor, x_shape: &Shape) -> Result<Tensor> {
    let (out_features, in_features) = out_in(weight);
    let rows = rows_of(grad_output);
    let dy_view = MatRef::row_major(grad_output.as_f32()?, rows, out_features)?;
    let weight_view = MatRef::row_major(weight.as_f32()?, out_features, in_features)?;
    Tensor::from_f32_init(with_last(x_shape, in_features), weight.device(), |dst| {
        matmul_uninit(dst, dy_view, weight_view)
    })
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
