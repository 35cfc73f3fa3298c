//! The arithmetic of one shard of a channel-split convolution, on the shard's device: the same
//! im2col products as `Conv2d`, on the shard's output filters `weight_r [out_r, in, kh, kw]`.
use conveyor_engine::cpu::conv::{col2im, im2col};
use conveyor_engine::cpu::elementwise::accumulate_row_sums;
use conveyor_engine::cpu::{MatRef, Window2d, matmul};
use conveyor_engine::{DType, Result, Shape, Tensor};

/// `y [batch, out_r, H_out, W_out] = weight_r · im2col(x) + bias_r`, per sample.
pub(crate) fn forward(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, window: &Window2d) -> Result<Tensor> {
    let (batch, out_channels) = (x.dims()[0], weight.dims()[0]);
    let (col_rows, out_plane) = (window.col_rows(), window.out_plane_len());
    let weight_view = MatRef::row_major(weight.as_f32()?, out_channels, col_rows)?;
    let bias = bias.map(Tensor::as_f32).transpose()?;
    let mut col = if window.is_pointwise() { Vec::new() } else { vec![0.0; col_rows * out_plane] };
    let dims = [batch, out_channels, window.out_height(), window.out_width()];
    let mut y = Tensor::zeros(dims, DType::F32, weight.device())?;
    let samples = y.as_f32_mut()?.chunks_exact_mut((out_channels * out_plane).max(1));
    for (x_sample, y_sample) in x.as_f32()?.chunks_exact(window.input_len().max(1)).zip(samples) {
        if let Some(bias) = bias {
            for (y_channel, &b) in y_sample.chunks_exact_mut(out_plane.max(1)).zip(bias) {
                y_channel.fill(b);
            }
        }
        let col_view = if window.is_pointwise() {
            MatRef::row_major(x_sample, col_rows, out_plane)?
        } else {
            im2col(x_sample, window, &mut col)?;
            MatRef::row_major(&col, col_rows, out_plane)?
        };
        matmul(y_sample, weight_view, col_view, bias.is_some())?;
    }
    Ok(y)
}

/// `dx = col2im(weight_rᵀ · dy_r)` per sample: this shard's part of the input gradient.
pub(crate) fn input_grad(grad_output: &Tensor, weight: &Tensor, window: &Window2d, x_shape: &Shape) -> Result<Tensor> {
    let out_channels = weight.dims()[0];
    let (col_rows, out_plane) = (window.col_rows(), window.out_plane_len());
    let weight_t = MatRef::row_major(weight.as_f32()?, out_channels, col_rows)?.t();
    let mut dx = Tensor::zeros(x_shape.clone(), DType::F32, weight.device())?;
    let mut col = if window.is_pointwise() { Vec::new() } else { vec![0.0; col_rows * out_plane] };
    let dy_samples = grad_output.as_f32()?.chunks_exact((out_channels * out_plane).max(1));
    for (dy_sample, dx_sample) in dy_samples.zip(dx.as_f32_mut()?.chunks_exact_mut(window.input_len().max(1))) {
        let dy_view = MatRef::row_major(dy_sample, out_channels, out_plane)?;
        if window.is_pointwise() {
            matmul(dx_sample, weight_t, dy_view, false)?;
        } else {
            matmul(&mut col, weight_t, dy_view, false)?;
            col2im(&col, window, dx_sample)?;
        }
    }
    Ok(dx)
}

/// `dweight_r += dy_r · im2col(x)ᵀ` and `dbias_r += Σ_plane dy_r`, per sample.
pub(crate) fn weight_grad(
    grad_output: &Tensor,
    x: &Tensor,
    window: &Window2d,
    weight_grad: &mut Tensor,
    bias_grad: Option<&mut Tensor>,
) -> Result<()> {
    let out_channels = weight_grad.dims()[0];
    let (col_rows, out_plane) = (window.col_rows(), window.out_plane_len());
    let dy = grad_output.as_f32()?;
    let mut col = if window.is_pointwise() { Vec::new() } else { vec![0.0; col_rows * out_plane] };
    let dw = weight_grad.as_f32_mut()?;
    for (x_sample, dy_sample) in
        x.as_f32()?.chunks_exact(window.input_len().max(1)).zip(dy.chunks_exact((out_channels * out_plane).max(1)))
    {
        let col_view = if window.is_pointwise() {
            MatRef::row_major(x_sample, col_rows, out_plane)?
        } else {
            im2col(x_sample, window, &mut col)?;
            MatRef::row_major(&col, col_rows, out_plane)?
        };
        matmul(dw, MatRef::row_major(dy_sample, out_channels, out_plane)?, col_view.t(), true)?;
    }
    if let Some(bias_grad) = bias_grad {
        let db = bias_grad.as_f32_mut()?;
        for dy_sample in dy.chunks_exact((out_channels * out_plane).max(1)) {
            accumulate_row_sums(dy_sample, db)?;
        }
    }
    Ok(())
}
