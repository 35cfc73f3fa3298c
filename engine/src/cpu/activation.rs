//! Elementwise activations and their input gradients: ReLU, GELU (exact erf form, PyTorch's
//! `approximate='none'`, and the tanh approximation, `approximate='tanh'`) and tanh, in f32 on
//! the vector math of `cpu::vecmath` (AVX-512, AVX2+FMA or scalar, the same bits on each).
//!
//! Backward kernels take whichever forward tensor determines the derivative most cheaply: ReLU and
//! tanh the output (`y <= 0 ? 0 : dy`, `1 - y²`), GELU the input.
//!
//! Non-finite values follow PyTorch (checked element by element in
//! `layers/tests/nonfinite.rs`): NaN propagates through every activation and every gradient, so a
//! bad step is seen by the trainer's finiteness check instead of being zeroed away. ReLU is
//! `x < 0 ? 0 : x` (torch's `clamp_min(x, 0)`: `relu(nan) = nan`, `relu(-0.0) = -0.0`) and its
//! gradient `y <= 0 ? 0 : dy` (torch's `threshold_backward`: the gradient at NaN passes `dy`
//! through). Both stay branch-free selects that vectorise.
//!
//! Each function is also given per element (`relu`, `gelu`, `gelu_grad`, ...); the slice kernels
//! (and their `_uninit` forms, for outputs that need no zero-fill) give bit-identical results,
//! vectorised. Prefer the slice kernels: the per-element GELU and tanh run the scalar path.
use std::mem::MaybeUninit;

use super::vecmath::{self, Isa};
use super::window::check_len;
use crate::Result;

/// `max(x, 0)`, NaN propagating and -0.0 kept as PyTorch does: `x < 0 ? 0 : x`.
#[inline]
pub fn relu(x: f32) -> f32 {
    if x < 0.0 { 0.0 } else { x }
}

/// ReLU's input gradient from its output `y` (or input: the test is the same) and the output
/// gradient `dy`: `y <= 0 ? 0 : dy`, so `dy` passes where `y` is NaN (PyTorch's
/// `threshold_backward`), and a NaN `dy` is zeroed where `y <= 0` (a select, not a product).
#[inline]
pub fn relu_grad(y: f32, dy: f32) -> f32 {
    if y <= 0.0 { 0.0 } else { dy }
}

/// `output = max(input, 0)` (NaN propagates, see [`relu`]).
pub fn relu_forward(input: &[f32], output: &mut [f32]) -> Result<()> {
    check_len("relu", "output", input.len(), output.len())?;
    for (y, &x) in output.iter_mut().zip(input) {
        *y = relu(x);
    }
    Ok(())
}

/// `input_grad = output <= 0 ? 0 : grad_output` (the derivative at 0 is taken as 0, and at NaN as
/// 1, like PyTorch).
pub fn relu_backward(output: &[f32], grad_output: &[f32], input_grad: &mut [f32]) -> Result<()> {
    check_len("relu_backward", "grad_output", output.len(), grad_output.len())?;
    check_len("relu_backward", "input_grad", output.len(), input_grad.len())?;
    for ((dx, &y), &dy) in input_grad.iter_mut().zip(output).zip(grad_output) {
        *dx = relu_grad(y, dy);
    }
    Ok(())
}

/// The standard normal CDF `Φ(x) = erfc(-x/√2)/2` in f32, accurate relative to its value even
/// far in the lower tail (≤ 4e-7 relative on [-10, 10]; see `cpu::vecmath`).
#[inline]
pub fn normal_cdf(x: f32) -> f32 {
    vecmath::scalar_unary(vecmath::NormalCdfKernel, x)
}

/// The standard normal density `φ(x) = e^{-x²/2}/√(2π)` in f32.
#[inline]
pub fn normal_pdf(x: f32) -> f32 {
    vecmath::scalar_unary(vecmath::NormalPdfKernel, x)
}

/// `x · Φ(x)` (exact GELU) for one element: the same bits as [`gelu_forward`] gives it.
#[inline]
pub fn gelu(x: f32) -> f32 {
    vecmath::scalar_unary(vecmath::GeluKernel, x)
}

/// GELU's input gradient from its input `x` and the output gradient `dy`:
/// `dy · (Φ(x) + x·φ(x))` with `φ(x) = exp(-x²/2) / √(2π)`; the same bits as [`gelu_backward`].
#[inline]
pub fn gelu_grad(x: f32, dy: f32) -> f32 {
    vecmath::scalar_binary(vecmath::GeluGradKernel, x, dy)
}

/// PyTorch's `GELU(approximate='tanh')`, `x/2 · (1 + tanh(√(2/π)(x + 0.044715x³)))`, for one
/// element (evaluated as `x / (1 + e^{-2u})`, which does not cancel for negative `x`).
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    vecmath::scalar_unary(vecmath::GeluTanhKernel, x)
}

/// The tanh-approximate GELU's input gradient from its input `x` and output gradient `dy`.
#[inline]
pub fn gelu_tanh_grad(x: f32, dy: f32) -> f32 {
    vecmath::scalar_binary(vecmath::GeluTanhGradKernel, x, dy)
}

/// `tanh(x)` (f32, ≤ 2e-7 relative), the same bits as [`tanh_forward`] gives it.
#[inline]
pub fn tanh(x: f32) -> f32 {
    vecmath::scalar_unary(vecmath::TanhKernel, x)
}

/// tanh's input gradient from its output `y` and the output gradient `dy`: `dy · (1 - y²)`.
#[inline]
pub fn tanh_grad(y: f32, dy: f32) -> f32 {
    dy * (1.0 - y * y)
}

/// `output = x · Φ(x)` (exact GELU), vectorised.
pub fn gelu_forward(input: &[f32], output: &mut [f32]) -> Result<()> {
    gelu_forward_uninit(input, vecmath::as_uninit(output)).map(drop)
}

/// [`gelu_forward`] into an uninitialised output, which it returns initialised.
pub fn gelu_forward_uninit<'a>(input: &[f32], output: &'a mut [MaybeUninit<f32>]) -> Result<&'a mut [f32]> {
    check_len("gelu", "output", input.len(), output.len())?;
    Ok(vecmath::map_unary_on(Isa::detect(), vecmath::GeluKernel, input, output))
}

/// `input_grad = grad_output · (Φ(x) + x·φ(x))` with `φ(x) = exp(-x²/2) / √(2π)`, vectorised.
pub fn gelu_backward(input: &[f32], grad_output: &[f32], input_grad: &mut [f32]) -> Result<()> {
    gelu_backward_uninit(input, grad_output, vecmath::as_uninit(input_grad)).map(drop)
}

/// [`gelu_backward`] into an uninitialised output, which it returns initialised.
pub fn gelu_backward_uninit<'a>(
    input: &[f32],
    grad_output: &[f32],
    input_grad: &'a mut [MaybeUninit<f32>],
) -> Result<&'a mut [f32]> {
    check_len("gelu_backward", "grad_output", input.len(), grad_output.len())?;
    check_len("gelu_backward", "input_grad", input.len(), input_grad.len())?;
    Ok(vecmath::map_binary_on(Isa::detect(), vecmath::GeluGradKernel, input, grad_output, input_grad))
}

/// The tanh-approximate GELU ([`gelu_tanh`]) of every element, vectorised.
pub fn gelu_tanh_forward(input: &[f32], output: &mut [f32]) -> Result<()> {
    gelu_tanh_forward_uninit(input, vecmath::as_uninit(output)).map(drop)
}

/// [`gelu_tanh_forward`] into an uninitialised output, which it returns initialised.
pub fn gelu_tanh_forward_uninit<'a>(input: &[f32], output: &'a mut [MaybeUninit<f32>]) -> Result<&'a mut [f32]> {
    check_len("gelu_tanh", "output", input.len(), output.len())?;
    Ok(vecmath::map_unary_on(Isa::detect(), vecmath::GeluTanhKernel, input, output))
}

/// The tanh-approximate GELU's input gradient ([`gelu_tanh_grad`]) from its input, vectorised.
pub fn gelu_tanh_backward(input: &[f32], grad_output: &[f32], input_grad: &mut [f32]) -> Result<()> {
    gelu_tanh_backward_uninit(input, grad_output, vecmath::as_uninit(input_grad)).map(drop)
}

/// [`gelu_tanh_backward`] into an uninitialised output, which it returns initialised.
pub fn gelu_tanh_backward_uninit<'a>(
    input: &[f32],
    grad_output: &[f32],
    input_grad: &'a mut [MaybeUninit<f32>],
) -> Result<&'a mut [f32]> {
    check_len("gelu_tanh_backward", "grad_output", input.len(), grad_output.len())?;
    check_len("gelu_tanh_backward", "input_grad", input.len(), input_grad.len())?;
    Ok(vecmath::map_binary_on(Isa::detect(), vecmath::GeluTanhGradKernel, input, grad_output, input_grad))
}

/// `output = tanh(input)`, vectorised.
pub fn tanh_forward(input: &[f32], output: &mut [f32]) -> Result<()> {
    tanh_forward_uninit(input, vecmath::as_uninit(output)).map(drop)
}

/// [`tanh_forward`] into an uninitialised output, which it returns initialised.
pub fn tanh_forward_uninit<'a>(input: &[f32], output: &'a mut [MaybeUninit<f32>]) -> Result<&'a mut [f32]> {
    check_len("tanh", "output", input.len(), output.len())?;
    Ok(vecmath::map_unary_on(Isa::detect(), vecmath::TanhKernel, input, output))
}

/// `input_grad = grad_output · (1 - output²)`.
pub fn tanh_backward(output: &[f32], grad_output: &[f32], input_grad: &mut [f32]) -> Result<()> {
    check_len("tanh_backward", "grad_output", output.len(), grad_output.len())?;
    check_len("tanh_backward", "input_grad", output.len(), input_grad.len())?;
    for ((dx, &y), &dy) in input_grad.iter_mut().zip(output).zip(grad_output) {
        *dx = tanh_grad(y, dy);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_kernels_give_the_per_element_bits() {
        let x: Vec<f32> = (0..203).map(|i| (i as f32 - 100.0) * 0.073).collect();
        let dy: Vec<f32> = x.iter().map(|v| 1.0 - v * 0.5).collect();
        let (mut y, mut dx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
        gelu_forward(&x, &mut y).unwrap();
        gelu_backward(&x, &dy, &mut dx).unwrap();
        for i in 0..x.len() {
            assert_eq!(y[i].to_bits(), gelu(x[i]).to_bits());
            assert_eq!(dx[i].to_bits(), gelu_grad(x[i], dy[i]).to_bits());
        }
        gelu_tanh_forward(&x, &mut y).unwrap();
        gelu_tanh_backward(&x, &dy, &mut dx).unwrap();
        for i in 0..x.len() {
            assert_eq!(y[i].to_bits(), gelu_tanh(x[i]).to_bits());
            assert_eq!(dx[i].to_bits(), gelu_tanh_grad(x[i], dy[i]).to_bits());
        }
        tanh_forward(&x, &mut y).unwrap();
        for i in 0..x.len() {
            assert_eq!(y[i].to_bits(), tanh(x[i]).to_bits());
        }
        assert!(gelu_backward(&x, &dy[1..], &mut dx).is_err());
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7 && (normal_pdf(0.0) - 0.398_942_3).abs() < 1e-7);
    }

    #[test]
    fn activations_have_expected_values() {
        let x = [-2.0f32, -0.5, 0.0, 0.5, 2.0];
        let mut y = [0.0; 5];
        relu_forward(&x, &mut y).unwrap();
        assert_eq!(y, [0.0, 0.0, 0.0, 0.5, 2.0]);
        gelu_forward(&x, &mut y).unwrap();
        // PyTorch: torch.nn.functional.gelu(torch.tensor([-2., -.5, 0., .5, 2.]))
        let torch = [-0.045_500_27f32, -0.154_268_65, 0.0, 0.345_731_35, 1.954_499_7];
        for (a, b) in y.iter().zip(torch) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        tanh_forward(&x, &mut y).unwrap();
        assert!((y[4] - 2.0f32.tanh()).abs() < 1e-7);
        assert!(relu_forward(&x, &mut [0.0; 4]).is_err());
    }

    /// PyTorch: `torch.relu(torch.tensor([nan, inf, -inf, -0., 0.]))` is `[nan, inf, 0., -0., 0.]`
    /// and the gradient of its sum is `[1., 1., 0., 0., 0.]`.
    #[test]
    fn relu_propagates_nan_and_keeps_negative_zero_like_torch() {
        let x = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 0.0];
        let mut y = [1.0; 5];
        relu_forward(&x, &mut y).unwrap();
        assert!(y[0].is_nan());
        assert_eq!(y[1..], [f32::INFINITY, 0.0, 0.0, 0.0]);
        assert!(y[3].is_sign_negative() && y[4].is_sign_positive() && y[2].is_sign_positive());
        let mut dx = [f32::NAN; 5];
        relu_backward(&y, &[1.0; 5], &mut dx).unwrap();
        assert_eq!(dx, [1.0, 1.0, 0.0, 0.0, 0.0]);
        relu_backward(&[-1.0, 1.0], &[f32::NAN, f32::NAN], &mut dx[..2]).unwrap();
        assert!(dx[0] == 0.0 && dx[1].is_nan());
    }
}
