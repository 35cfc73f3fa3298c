//! Layer normalisation over the last dimension: forward (saving each row's mean and reciprocal
//! standard deviation), input gradient and affine-parameter gradients.
//!
//! With `x̂ = (x - mean) · rstd`, `rstd = 1 / sqrt(var + eps)` (biased variance) and `g = dy · weight`:
//! `dx = rstd · (g - mean(g) - x̂ · mean(g · x̂))`, `dweight += Σ_rows dy · x̂`, `dbias += Σ_rows dy`.
use super::window::check_len;
use crate::{Error, Result};

fn rows_of(op: &str, input: &[f32], dim: usize) -> Result<usize> {
    if dim == 0 || !input.len().is_multiple_of(dim) {
        return Err(Error::shape(op, format!("rows of {dim} elements (dim > 0)"), format!("{} elements", input.len())));
    }
    Ok(input.len() / dim)
}

/// `output = (x - mean) · rstd · weight + bias` per row of `weight.len()` elements; writes each
/// row's `mean` and `rstd`.
pub fn layer_norm_forward(
    input: &[f32],
    weight: &[f32],
    bias: &[f32],
    eps: f32,
    output: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
) -> Result<()> {
    let dim = weight.len();
    let rows = rows_of("layer_norm", input, dim)?;
    check_len("layer_norm", "bias", dim, bias.len())?;
    check_len("layer_norm", "output", input.len(), output.len())?;
    check_len("layer_norm", "mean", rows, mean.len())?;
    check_len("layer_norm", "rstd", rows, rstd.len())?;
    for (((x, y), m), r) in
        input.chunks_exact(dim).zip(output.chunks_exact_mut(dim)).zip(mean.iter_mut()).zip(rstd.iter_mut())
    {
        let row_mean = x.iter().map(|&v| v as f64).sum::<f64>() / dim as f64;
        let var = x.iter().map(|&v| (v as f64 - row_mean).powi(2)).sum::<f64>() / dim as f64;
        let row_rstd = 1.0 / (var + eps as f64).sqrt();
        let (row_mean, row_rstd) = (row_mean as f32, row_rstd as f32);
        for (((yv, &xv), &w), &b) in y.iter_mut().zip(x).zip(weight).zip(bias) {
            *yv = (xv - row_mean) * row_rstd * w + b;
        }
        *m = row_mean;
        *r = row_rstd;
    }
    Ok(())
}

/// `input_grad = rstd · (g - mean(g) - x̂ · mean(g · x̂))` with `g = grad_output · weight`.
pub fn layer_norm_backward_input(
    input: &[f32],
    grad_output: &[f32],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    input_grad: &mut [f32],
) -> Result<()> {
    let dim = weight.len();
    let rows = rows_of("layer_norm_backward_input", input, dim)?;
    check_len("layer_norm_backward_input", "grad_output", input.len(), grad_output.len())?;
    check_len("layer_norm_backward_input", "input_grad", input.len(), input_grad.len())?;
    check_len("layer_norm_backward_input", "mean", rows, mean.len())?;
    check_len("layer_norm_backward_input", "rstd", rows, rstd.len())?;
    let rows_iter = input.chunks_exact(dim).zip(grad_output.chunks_exact(dim)).zip(input_grad.chunks_exact_mut(dim));
    for (((x, dy), dx), (&m, &r)) in rows_iter.zip(mean.iter().zip(rstd)) {
        let (mut sum_g, mut sum_g_xhat) = (0.0f64, 0.0f64);
        for ((&xv, &dyv), &w) in x.iter().zip(dy).zip(weight) {
            let g = (dyv * w) as f64;
            sum_g += g;
            sum_g_xhat += g * ((xv - m) * r) as f64;
        }
        let mean_g = (sum_g / dim as f64) as f32;
        let mean_g_xhat = (sum_g_xhat / dim as f64) as f32;
        for (((dxv, &xv), &dyv), &w) in dx.iter_mut().zip(x).zip(dy).zip(weight) {
            let xhat = (xv - m) * r;
            *dxv = r * (dyv * w - mean_g - xhat * mean_g_xhat);
        }
    }
    Ok(())
}

/// `weight_grad += Σ_rows grad_output · x̂` and `bias_grad += Σ_rows grad_output` (either may be
/// absent when the layer has no such parameter).
pub fn layer_norm_backward_weight(
    input: &[f32],
    grad_output: &[f32],
    mean: &[f32],
    rstd: &[f32],
    weight_grad: Option<&mut [f32]>,
    bias_grad: Option<&mut [f32]>,
) -> Result<()> {
    let dim = weight_grad.as_ref().map(|g| g.len()).or(bias_grad.as_ref().map(|g| g.len())).unwrap_or(0);
    if dim == 0 {
        return Ok(());
    }
    let rows = rows_of("layer_norm_backward_weight", input, dim)?;
    check_len("layer_norm_backward_weight", "grad_output", input.len(), grad_output.len())?;
    check_len("layer_norm_backward_weight", "mean", rows, mean.len())?;
    check_len("layer_norm_backward_weight", "rstd", rows, rstd.len())?;
    if let Some(bias_grad) = bias_grad {
        check_len("layer_norm_backward_weight", "bias_grad", dim, bias_grad.len())?;
        for dy in grad_output.chunks_exact(dim) {
            bias_grad.iter_mut().zip(dy).for_each(|(g, &d)| *g += d);
        }
    }
    if let Some(weight_grad) = weight_grad {
        check_len("layer_norm_backward_weight", "weight_grad", dim, weight_grad.len())?;
        for ((x, dy), (&m, &r)) in input.chunks_exact(dim).zip(grad_output.chunks_exact(dim)).zip(mean.iter().zip(rstd))
        {
            for ((g, &xv), &d) in weight_grad.iter_mut().zip(x).zip(dy) {
                *g += d * (xv - m) * r;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalises_rows_to_zero_mean_unit_variance() {
        let input = [1.0f32, 2.0, 3.0, 4.0, -1.0, 0.0, 1.0, 8.0];
        let (weight, bias) = ([1.0f32; 4], [0.0f32; 4]);
        let (mut out, mut mean, mut rstd) = ([0.0; 8], [0.0; 2], [0.0; 2]);
        layer_norm_forward(&input, &weight, &bias, 1e-5, &mut out, &mut mean, &mut rstd).unwrap();
        assert_eq!(mean, [2.5, 2.0]);
        for row in out.chunks(4) {
            let m: f32 = row.iter().sum::<f32>() / 4.0;
            let v: f32 = row.iter().map(|x| (x - m) * (x - m)).sum::<f32>() / 4.0;
            assert!(m.abs() < 1e-6 && (v - 1.0).abs() < 1e-4, "mean {m} var {v}");
        }
        assert!(layer_norm_forward(&input[..7], &weight, &bias, 1e-5, &mut out, &mut mean, &mut rstd).is_err());
    }
}
