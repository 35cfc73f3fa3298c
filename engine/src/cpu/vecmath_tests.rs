//! Tests of `cpu::vecmath`: every ISA gives the scalar path's bits, and each function is within
//! its stated bound of an f64 reference.
use rand::{RngExt, SeedableRng, rngs::StdRng};

use super::*;

const ISAS: [Isa; 4] = Isa::ALL;

/// Inputs with every edge: zeros of both signs, infinities, NaN, subnormals, the range limits of
/// each function, and seeded random values over several scales; a length that leaves a tail.
fn inputs() -> Vec<f32> {
    let mut xs = vec![
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
        1e-40,
        -1e-40,
        f32::MAX,
        f32::MIN,
        88.72,
        88.73,
        -87.3,
        -103.9,
        -104.5,
        0.625,
        -0.625,
        0.624_999_94,
        16.0,
        -16.0,
        -13.5,
        1e-20,
    ];
    let mut rng = StdRng::seed_from_u64(26);
    for scale in [1e-3f32, 0.5, 3.0, 12.0, 100.0, 1e6] {
        xs.extend((0..4001).map(|_| rng.random_range(-scale..scale)));
    }
    xs
}

fn same_bits(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn run_unary<F: Unary>(isa: Isa, f: F, xs: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0; xs.len()];
    map_unary_on(isa, f, xs, as_uninit(&mut out));
    out
}

fn run_binary<F: Binary>(isa: Isa, f: F, xs: &[f32], ys: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0; xs.len()];
    map_binary_on(isa, f, xs, ys, as_uninit(&mut out));
    out
}

fn assert_isas_agree(name: &str, results: impl Fn(Isa) -> Vec<f32>, xs: &[f32]) {
    let scalar = results(Isa::Scalar);
    for isa in ISAS.into_iter().filter(|isa| isa.available()) {
        for (i, (a, b)) in results(isa).iter().zip(&scalar).enumerate() {
            assert!(same_bits(*a, *b), "{name} on {isa:?} at x = {:e}: {a:e} vs scalar {b:e}", xs[i]);
        }
    }
}

#[test]
fn every_isa_gives_the_scalar_bits() {
    let xs = inputs();
    let dys: Vec<f32> = xs.iter().enumerate().map(|(i, _)| [1.0, -0.75, 3.5, f32::NAN, 0.0][i % 5]).collect();
    assert_isas_agree("exp", |isa| run_unary(isa, ExpKernel, &xs), &xs);
    assert_isas_agree("normal_cdf", |isa| run_unary(isa, NormalCdfKernel, &xs), &xs);
    assert_isas_agree("normal_pdf", |isa| run_unary(isa, NormalPdfKernel, &xs), &xs);
    assert_isas_agree("gelu", |isa| run_unary(isa, GeluKernel, &xs), &xs);
    assert_isas_agree("gelu_tanh", |isa| run_unary(isa, GeluTanhKernel, &xs), &xs);
    assert_isas_agree("tanh", |isa| run_unary(isa, TanhKernel, &xs), &xs);
    assert_isas_agree("gelu_grad", |isa| run_binary(isa, GeluGradKernel, &xs, &dys), &xs);
    assert_isas_agree("gelu_tanh_grad", |isa| run_binary(isa, GeluTanhGradKernel, &xs, &dys), &xs);
    // The one-element entry points are the scalar path too.
    for &x in &xs {
        assert!(same_bits(scalar_unary(GeluKernel, x), gelu(x)));
    }
}

/// erfc in f64 to ~1e-14 relative: the Maclaurin series of erf below 3, a continued fraction above.
fn erfc_reference(x: f64) -> f64 {
    if x < 0.0 {
        return 2.0 - erfc_reference(-x);
    }
    if x < 3.0 {
        let (mut term, mut sum) = (x, x);
        for n in 1..200 {
            term *= -x * x / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        return 1.0 - sum * 2.0 / std::f64::consts::PI.sqrt();
    }
    // erfc(x) = e^{-x²}/√π · 1/(x + (1/2)/(x + 1/(x + (3/2)/(x + ...)))).
    let mut fraction = x;
    for k in (1..200).rev() {
        fraction = x + (k as f64 / 2.0) / fraction;
    }
    (-x * x).exp() / std::f64::consts::PI.sqrt() / fraction
}

fn cdf_reference(x: f64) -> f64 {
    0.5 * erfc_reference(-x / std::f64::consts::SQRT_2)
}

fn pdf_reference(x: f64) -> f64 {
    (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

/// The largest `|got - want| / |want|` over `xs` (ignoring `want` below `floor`).
fn max_relative(xs: &[f32], got: &[f32], want: impl Fn(f64) -> f64, floor: f64) -> (f64, f32) {
    let worst = max_relative_quiet(xs, got, want, floor);
    eprintln!("max relative error {:e} at {}", worst.0, worst.1);
    worst
}

fn max_relative_quiet(xs: &[f32], got: &[f32], want: impl Fn(f64) -> f64, floor: f64) -> (f64, f32) {
    let mut worst = (0.0, 0.0);
    for (&x, &g) in xs.iter().zip(got) {
        let w = want(x as f64);
        if w.abs() < floor {
            continue;
        }
        let err = (g as f64 - w).abs() / w.abs();
        if err > worst.0 {
            worst = (err, x);
        }
    }
    worst
}

fn grid(lo: f32, hi: f32, n: usize) -> Vec<f32> {
    (0..=n).map(|i| lo + (hi - lo) * i as f32 / n as f32).collect()
}

/// Measured (AVX-512 VM; every ISA gives the same bits): exp 8.0e-8 relative on [-87, 88]; on
/// [-10, 10] Φ 3.4e-7, φ 1.5e-7, exact GELU 3.6e-7, its gradient 3.0e-7 of `Φ + |x|φ`; tanh
/// 1.4e-7 on [-12, 12]; tanh-GELU 8.0e-7 on [-3, 3], 4.1e-6 on [-6, 10]. The bounds leave room.
#[test]
fn functions_are_within_their_bounds_of_f64_references() {
    let isa = Isa::detect();
    let xs = grid(-87.0, 88.0, 100_000);
    let (err, at) = max_relative(&xs, &run_unary(isa, ExpKernel, &xs), f64::exp, 0.0);
    assert!(err < 2.5e-7, "exp: {err:e} at {at}");

    let xs = grid(-10.0, 10.0, 100_000);
    let (err, at) = max_relative(&xs, &run_unary(isa, NormalCdfKernel, &xs), cdf_reference, 0.0);
    assert!(err < 1e-6, "normal_cdf: {err:e} at {at}");
    let (err, at) = max_relative(&xs, &run_unary(isa, NormalPdfKernel, &xs), pdf_reference, 0.0);
    assert!(err < 5e-7, "normal_pdf: {err:e} at {at}");
    let (err, at) = max_relative(&xs, &run_unary(isa, GeluKernel, &xs), |x| x * cdf_reference(x), 0.0);
    eprintln!("gelu: {err:e} at {at}");
    assert!(err < 1e-6, "gelu: {err:e} at {at}");
    // The derivative Φ + xφ crosses zero near x = -0.75, so its error is measured against the
    // size of its terms, Φ + |x|φ.
    let ones = vec![1.0; xs.len()];
    let got = run_binary(isa, GeluGradKernel, &xs, &ones);
    let (mut err, mut at) = (0.0f64, 0.0f32);
    for (&x, &g) in xs.iter().zip(&got) {
        let (c, d) = (cdf_reference(x as f64), x as f64 * pdf_reference(x as f64));
        let e = (g as f64 - (c + d)).abs() / (c + d.abs());
        if e > err {
            (err, at) = (e, x);
        }
    }
    eprintln!("gelu_grad: {err:e} at {at}");
    assert!(err < 1e-6, "gelu_grad: {err:e} at {at}");

    let xs = grid(-12.0, 12.0, 100_000);
    let (err, at) = max_relative(&xs, &run_unary(isa, TanhKernel, &xs), f64::tanh, 0.0);
    assert!(err < 4e-7, "tanh: {err:e} at {at}");
    let tiny = grid(-1e-3, 1e-3, 1000);
    let (err, at) = max_relative(&tiny, &run_unary(isa, TanhKernel, &tiny), f64::tanh, 0.0);
    assert!(err < 2.5e-7, "tanh near 0: {err:e} at {at}");

    // The tanh approximation is conditioned by 2|u| (u = √(2/π)(x + 0.044715x³)): within 1e-6
    // where |x| ≤ 3, and 1e-5 on [-6, 10].
    let tanh_approx = |x: f64| {
        let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
        0.5 * x * (1.0 + u.tanh())
    };
    let xs = grid(-3.0, 3.0, 60_000);
    let (err, at) = max_relative(&xs, &run_unary(isa, GeluTanhKernel, &xs), tanh_approx, 0.0);
    assert!(err < 1e-6, "gelu_tanh: {err:e} at {at}");
    let xs = grid(-6.0, 10.0, 60_000);
    let (err, at) = max_relative(&xs, &run_unary(isa, GeluTanhKernel, &xs), tanh_approx, 0.0);
    assert!(err < 1e-5, "gelu_tanh: {err:e} at {at}");
}

#[test]
fn edges_follow_ieee_and_torch() {
    let isa = Isa::detect();
    let xs = [f32::NEG_INFINITY, f32::INFINITY, -0.0, 0.0, f32::NAN];
    assert_eq!(run_unary(isa, ExpKernel, &xs)[..4], [0.0, f32::INFINITY, 1.0, 1.0]);
    assert_eq!(run_unary(isa, NormalCdfKernel, &xs)[..4], [0.0, 1.0, 0.5, 0.5]);
    let t = run_unary(isa, TanhKernel, &xs);
    assert_eq!(t[..4], [-1.0, 1.0, -0.0, 0.0]);
    assert!(t[2].is_sign_negative() && t[3].is_sign_positive());
    let g = run_unary(isa, GeluKernel, &xs);
    assert!(g[0].is_nan() && g[1] == f32::INFINITY && g[2] == 0.0 && g[2].is_sign_negative());
    for f in [exp::<f32>, normal_cdf, normal_pdf, gelu, gelu_tanh, tanh] {
        assert!(f(f32::NAN).is_nan());
    }
    assert!(gelu_grad(f32::NAN, 1.0).is_nan() && gelu_tanh_grad(f32::NAN, 1.0).is_nan());
    assert_eq!(exp(88.8f32), f32::INFINITY);
    assert_eq!(exp(-104.0f32), 0.0);
    assert!(exp(-100.0f32) > 0.0, "subnormal results are kept");
}
