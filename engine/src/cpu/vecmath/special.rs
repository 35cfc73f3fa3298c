//! The special functions of `cpu::vecmath`, written once over [`Lanes`]: `exp`, the normal CDF
//! `Φ` and density `φ`, the exact and tanh-approximate GELUs and their gradients, and `tanh`
//! (the accuracy of each is in `vecmath.rs`'s header; the tests measure it).
use super::Lanes;

const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// `ln 2 = LN2_HI + LN2_LO`, the high part short enough that `n · LN2_HI` is exact (Cephes).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// `1/√(2π)`.
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

/// `e^r` for `|r| ≤ ln2/2` (a little beyond is fine): Cephes expf, `1 + r + r²·P(r)`.
#[inline(always)]
fn exp_reduced<V: Lanes>(r: V) -> V {
    let p = V::splat(1.987_569_1e-4);
    let p = p.fma(r, V::splat(1.398_199_9e-3));
    let p = p.fma(r, V::splat(8.333_452e-3));
    let p = p.fma(r, V::splat(4.166_579_6e-2));
    let p = p.fma(r, V::splat(1.666_666_5e-1));
    let p = p.fma(r, V::splat(0.5));
    p.fma(r.mul(r), r).add(V::splat(1.0))
}

/// `e^(hi + lo)` for a small correction `lo` (|lo| ≤ ulp(hi)), NaN propagating.
#[inline(always)]
pub(crate) fn exp2parts<V: Lanes>(hi: V, lo: V) -> V {
    // Beyond [-104, 89] the result is 0 or inf either way; the clamp keeps the exponent in range.
    let x = hi.max(V::splat(-104.0)).min(V::splat(89.0));
    let n = x.mul(V::splat(LOG2_E)).round();
    let r = n.fma(V::splat(-LN2_HI), x);
    let r = n.fma(V::splat(-LN2_LO), r).add(lo);
    // 2^n with n in [-150, 128], rounded once (subnormal results kept).
    let y = exp_reduced(r).scale2(n);
    V::select(hi.is_nan(), hi, y)
}

/// `e^x`.
#[inline(always)]
pub(crate) fn exp<V: Lanes>(x: V) -> V {
    exp2parts(x, V::splat(0.0))
}

/// `R(t) = erfcx(z)/t` for `t = 1/(1 + z/2)` on [0.15, 1] (`z ≤ 16/√2`), evaluated at
/// `th = t/2`: a degree-8 polynomial in `t` fitted for relative error (7e-8 in exact arithmetic,
/// 1.4e-7 evaluated in f32), its coefficients of `t^k` times `2^k` here (exact), so that Horner in
/// `th` gives the same bits as Horner in `t` would.
#[inline(always)]
fn erfcx_over_t<V: Lanes>(th: V) -> V {
    let p = V::splat(-5.932_692_4e-2 * 256.0);
    let p = p.fma(th, V::splat(2.858_342_5e-1 * 128.0));
    let p = p.fma(th, V::splat(-4.898_085_3e-1 * 64.0));
    let p = p.fma(th, V::splat(2.810_523e-1 * 32.0));
    let p = p.fma(th, V::splat(-2.868_201e-2 * 16.0));
    let p = p.fma(th, V::splat(2.035_565_7e-1 * 8.0));
    let p = p.fma(th, V::splat(2.428_841_7e-1 * 4.0));
    let p = p.fma(th, V::splat(2.824_054_4e-1 * 2.0));
    p.fma(th, V::splat(2.820_847e-1))
}

/// `e^{w/2}` for `|w| ≤ ln 2` (a little beyond is fine): `1 + w·q(w)`, `q` of degree 5 fitted
/// for relative error (2e-9 exact, 8e-8 evaluated in f32), written in `w = 2r` so that the caller
/// need not halve its argument.
#[inline(always)]
fn exp_of_half<V: Lanes>(w: V) -> V {
    let p = V::splat(1.384_271_1e-3 / 64.0);
    let p = p.fma(w, V::splat(8.374_965e-3 / 32.0));
    let p = p.fma(w, V::splat(4.166_805_7e-2 / 16.0));
    let p = p.fma(w, V::splat(1.666_642_1e-1 / 8.0));
    let p = p.fma(w, V::splat(0.499_999_94 / 4.0));
    let p = p.fma(w, V::splat(0.5));
    p.fma(w, V::splat(1.0))
}

/// For `a = min(|x|, 16)` ([`abs_clamped`]): the lower tail `Φ(-a) = erfc(z)/2` (`z = a/√2`) and
/// the Gaussian `e^{-a²/2}`, from one `exp`.
///
/// `erfc(z) = erfcx(z)·e^{-z²}` with `erfcx(z) = t·R(t)`, `t = 1/(1 + z/2)` ([`erfcx_over_t`]).
/// `x²` is carried as an exact double-float (`sq = fl(x·x)`, `sq - x²` by one fused
/// multiply-add) into the exponential, so the lower tail stays accurate relative to its own
/// value, where `1 + erf` would cancel. The reduction works on `-x²` and `2n·ln 2` (both halves
/// of `ln 2` doubled exactly) and the polynomial takes the doubled residual ([`exp_of_half`]).
#[inline(always)]
fn normal_tail_and_gauss<V: Lanes>(a: V) -> (V, V) {
    let sq = a.mul(a);
    let sq_minus_exact = a.fnma(a, sq);
    // -x²/2 ∈ [-128, 0], so n ∈ [-185, 0]: no clamp needed for `scale2`.
    let n = sq.mul(V::splat(-0.5 * LOG2_E)).round();
    // sq + 2n·LN2_HI is exact (the terms nearly cancel); w = -x² - 2n·ln 2 = 2r.
    let u = n.fma(V::splat(2.0 * LN2_HI), sq);
    let v = n.fnma(V::splat(2.0 * LN2_LO), sq_minus_exact);
    let gauss = exp_of_half(v.sub(u)).scale2(n);
    // th = t/2 = 1/(2 + z).
    let th = V::splat(1.0).div(a.fma(V::splat(FRAC_1_SQRT_2), V::splat(2.0)));
    let tail = th.mul(erfcx_over_t(th)).mul(gauss);
    (tail, gauss)
}

/// `Φ(x)` from the lower tail `Φ(-|x|)`.
#[inline(always)]
fn cdf_from_tail<V: Lanes>(x: V, tail: V) -> V {
    V::select_sub(V::splat(0.0).lt(x), V::splat(1.0), tail, tail)
}

/// `min(|x|, 16)`: beyond 16 `Φ` and `φ` are already 0/1 and 0 in f32 (and NaN gives 16: `min`
/// keeps its right operand; the callers propagate the NaN themselves).
#[inline(always)]
fn abs_clamped<V: Lanes>(x: V) -> V {
    x.abs().min(V::splat(16.0))
}

/// The standard normal CDF `Φ(x)`, NaN propagating.
#[inline(always)]
pub(crate) fn normal_cdf<V: Lanes>(x: V) -> V {
    let (tail, _) = normal_tail_and_gauss(abs_clamped(x));
    V::select(x.is_nan(), x, cdf_from_tail(x, tail))
}

/// The standard normal density `φ(x) = e^{-x²/2}/√(2π)`, NaN propagating.
#[inline(always)]
pub(crate) fn normal_pdf<V: Lanes>(x: V) -> V {
    let (_, gauss) = normal_tail_and_gauss(abs_clamped(x));
    V::select(x.is_nan(), x, gauss.mul(V::splat(FRAC_1_SQRT_2PI)))
}

/// Exact GELU `x·Φ(x)` (PyTorch's `approximate='none'`).
#[inline(always)]
pub(crate) fn gelu<V: Lanes>(x: V) -> V {
    let (tail, _) = normal_tail_and_gauss(abs_clamped(x));
    // x·Φ(x) propagates NaN by itself (NaN · anything).
    x.mul(cdf_from_tail(x, tail))
}

/// Exact GELU's input gradient `dy·(Φ(x) + x·φ(x))`: `Φ` and `φ` share one `exp`.
#[inline(always)]
pub(crate) fn gelu_grad<V: Lanes>(x: V, dy: V) -> V {
    let (tail, gauss) = normal_tail_and_gauss(abs_clamped(x));
    let pdf = gauss.mul(V::splat(FRAC_1_SQRT_2PI));
    x.fma(pdf, cdf_from_tail(x, tail)).mul(dy)
}

/// `√(2/π)` and the cubic coefficient of PyTorch's tanh-approximate GELU.
const GELU_TANH_BETA: f32 = 0.797_884_6;
const GELU_TANH_KAPPA: f32 = 0.044_715;

/// `2u` for the tanh-approximate GELU, `u = √(2/π)·(x + 0.044715·x³)`.
#[inline(always)]
fn gelu_tanh_twice_inner<V: Lanes>(x: V) -> V {
    let cubic = x.mul(x).mul(V::splat(GELU_TANH_KAPPA)).fma(x, x);
    cubic.mul(V::splat(2.0 * GELU_TANH_BETA))
}

/// PyTorch's `GELU(approximate='tanh')`: `x/2·(1 + tanh(u))`, evaluated as the equal
/// `x / (1 + e^{-2u})`, which does not cancel for negative `x`.
#[inline(always)]
pub(crate) fn gelu_tanh<V: Lanes>(x: V) -> V {
    let e = exp(V::splat(0.0).sub(gelu_tanh_twice_inner(x)));
    x.div(V::splat(1.0).add(e))
}

/// The tanh-approximate GELU's input gradient: with `σ = 1/(1 + e^{-2u})`,
/// `dy·(σ + 2x·σ(1-σ)·u')`, `u' = √(2/π)·(1 + 3·0.044715·x²)`, `1 - σ = e^{-2u}·σ`.
#[inline(always)]
pub(crate) fn gelu_tanh_grad<V: Lanes>(x: V, dy: V) -> V {
    // Beyond |2u| = 80 σ is 0 or 1 to f32 precision; the clamp keeps e^{-2u} finite.
    let twice_inner = gelu_tanh_twice_inner(x).max(V::splat(-80.0)).min(V::splat(80.0));
    let e = exp(V::splat(0.0).sub(twice_inner));
    let sigma = V::splat(1.0).div(V::splat(1.0).add(e));
    let one_minus_sigma = e.mul(sigma);
    let inner_slope = x.mul(x).mul(V::splat(3.0 * GELU_TANH_KAPPA * 2.0 * GELU_TANH_BETA));
    let inner_slope = inner_slope.add(V::splat(2.0 * GELU_TANH_BETA));
    let derivative = x.mul(sigma).mul(one_minus_sigma).fma(inner_slope, sigma);
    // NaN in x reaches the result through σ and the product.
    derivative.mul(dy)
}

/// `tanh(x)`, odd (the sign of zero kept), NaN propagating.
#[inline(always)]
pub(crate) fn tanh<V: Lanes>(x: V) -> V {
    let a = x.abs();
    // |x| < 0.625: Cephes tanhf, a + a·z·P(z) with z = a².
    let z = a.mul(a);
    let p = V::splat(-5.704_988_7e-3);
    let p = p.fma(z, V::splat(2.063_909e-2));
    let p = p.fma(z, V::splat(-5.373_971_6e-2));
    let p = p.fma(z, V::splat(1.333_144_2e-1));
    let p = p.fma(z, V::splat(-3.333_328e-1));
    let small = p.mul(z).fma(a, a);
    // Otherwise 1 - 2/(e^{2a} + 1) (1 once e^{2a} overflows).
    let large = V::splat(1.0).sub(V::splat(2.0).div(exp(a.add(a)).add(V::splat(1.0))));
    let y = V::select(a.lt(V::splat(0.625)), small, large).copysign(x);
    V::select(x.is_nan(), x, y)
}
