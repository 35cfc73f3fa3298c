//! The arithmetic of one shard of a split linear layer, on the shard's device: `y = x · wᵀ + b`,
//! `dx = dy · w`, `dw += dyᵀ · x`, `db += Σ dy` for `x` `[.., in]`, `w` `[out, in]`, `dy` `[.., out]`.
//! The same device ops as `Linear` without its packed weight (`Tensor::matmul`,
//! `matmul_accumulate`, `accumulate_column_sums`), on the shard's part of the weight.
use conveyor_engine::device::ops::Matrix;
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
    let x_view = Matrix::new(x, rows, in_features)?;
    let weight_t = Matrix::new(weight, out_features, in_features)?.t();
    Tensor::matmul(x_view, weight_t, bias, with_last(x.shape(), out_features), weight.device())
}

/// `dx = dy · w`, shaped like `x_shape`, on the weight's device.
pub(crate) fn input_grad(grad_output: &Tensor, weight: &Tensor, x_shape: &Shape) -> Result<Tensor> {
    let (out_features, in_features) = out_in(weight);
    let rows = rows_of(grad_output);
    let dy_view = Matrix::new(grad_output, rows, out_features)?;
    let weight_view = Matrix::new(weight, out_features, in_features)?;
    Tensor::matmul(dy_view, weight_view, None, with_last(x_shape, in_features), weight.device())
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
    let dy_t = Matrix::new(grad_output, rows, out_features)?.t();
    weight_grad.matmul_accumulate(dy_t, Matrix::new(x, rows, in_features)?)?;
    if let Some(bias_grad) = bias_grad {
        bias_grad.accumulate_column_sums(grad_output)?;
    }
    Ok(())
}
