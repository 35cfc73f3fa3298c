//! Elementwise activations and their input gradients: ReLU, GELU (exact erf form, PyTorch's
//! `approximate='none'`) and tanh; plus the `erfc` and normal CDF they rest on.
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
//! Each function is also given per element (`relu`, `relu_grad`, ...), for `cpu::uninit::map`
//! and `map2` into outputs that need no zero-fill; the slice kernels apply the same functions,
//! so both give bit-identical results.
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

/// Complementary error function with relative error below 1.2e-7 everywhere (the Chebyshev
/// fit of Numerical Recipes' `erfcc`), evaluated in f64.
pub fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98 + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let tail = t * (-z * z + poly).exp();
    if x >= 0.0 { tail } else { 2.0 - tail }
}

/// The standard normal CDF `Φ(x) = erfc(-x / √2) / 2`, accurate relative to its value even far
/// in the lower tail (which is what keeps GELU of large negative inputs accurate).
pub fn normal_cdf(x: f64) -> f64 {
    0.5 * erfc(-x * std::f64::consts::FRAC_1_SQRT_2)
}

const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// `x · Φ(x)` (exact GELU), evaluated in f64.
#[inline]
pub fn gelu(x: f32) -> f32 {
    let x = x as f64;
    (x * normal_cdf(x)) as f32
}

/// GELU's input gradient from its input `x` and the output gradient `dy`:
/// `dy · (Φ(x) + x·φ(x))` with `φ(x) = exp(-x²/2) / √(2π)`.
#[inline]
pub fn gelu_grad(x: f32, dy: f32) -> f32 {
    let x = x as f64;
    let derivative = normal_cdf(x) + x * FRAC_1_SQRT_2PI * (-0.5 * x * x).exp();
    (dy as f64 * derivative) as f32
}

/// `tanh(x)`.
#[inline]
pub fn tanh(x: f32) -> f32 {
    x.tanh()
}

/// tanh's input gradient from its output `y` and the output gradient `dy`: `dy · (1 - y²)`.
#[inline]
pub fn tanh_grad(y: f32, dy: f32) -> f32 {
    dy * (1.0 - y * y)
}

/// `output = x · Φ(x)` (exact GELU).
pub fn gelu_forward(input: &[f32], output: &mut [f32]) -> Result<()> {
    check_len("gelu", "output", input.len(), output.len())?;
    for (y, &x) in output.iter_mut().zip(input) {
        *y = gelu(x);
    }
    Ok(())
}

/// `input_grad = grad_output · (Φ(x) + x·φ(x))` with `φ(x) = exp(-x²/2) / √(2π)`.
pub fn gelu_backward(input: &[f32], grad_output: &[f32], input_grad: &mut [f32]) -> Result<()> {
    check_len("gelu_backward", "grad_output", input.len(), grad_output.len())?;
    check_len("gelu_backward", "input_grad", input.len(), input_grad.len())?;
    for ((dx, &x), &dy) in input_grad.iter_mut().zip(input).zip(grad_output) {
        *dx = gelu_grad(x, dy);
    }
    Ok(())
}

/// `output = tanh(input)`.
pub fn tanh_forward(input: &[f32], output: &mut [f32]) -> Result<()> {
    check_len("tanh", "output", input.len(), output.len())?;
    for (y, &x) in output.iter_mut().zip(input) {
        *y = tanh(x);
    }
    Ok(())
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

    /// erf by its Maclaurin series, accurate to ~1e-12 for |x| <= 3.
    fn erf_series(x: f64) -> f64 {
        let (mut term, mut sum) = (x, x);
        for n in 1..200 {
            term *= -x * x / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    #[test]
    fn erfc_is_accurate_against_the_series() {
        for i in -30..=30 {
            let x = i as f64 * 0.1;
            let expected = 1.0 - erf_series(x);
            assert!((erfc(x) - expected).abs() <= 1.2e-7 * expected, "erfc({x}) = {} vs {expected}", erfc(x));
        }
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7);
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
