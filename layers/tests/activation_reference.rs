//! GELU (exact and tanh-approximate), tanh, softmax and log-softmax against PyTorch evaluated in
//! float64 on the same float32 inputs (fixture `tests/fixtures/activation_reference.safetensors`,
//! made by `tests/fixtures/make_activation_reference.py`; no Python at test time).
//!
//! Tolerance, per element: `|actual - expected| ≤ rtol · |expected| + atol`, with `rtol = 1e-6`
//! everywhere except the tanh-GELU beyond `|x| > 3` (`rtol = 1e-5`: its result is conditioned
//! by `2|u|`, and torch's own float32 is off by up to 100% there), and `atol` = 1e-30 for outputs
//! (only subnormals), 1e-7 for the GELU gradients (their two terms cancel near x = -0.75, where
//! a float32 ulp of a term is 1.5e-8), 2.5e-7 for tanh's (computed from the float32 output, as
//! torch does, so `1 - y²` carries y's rounding); softmax `atol` 1e-30, log-softmax 1e-7 (the
//! log of a float32 row sum, absolute ~6e-8, is subtracted from values that may be near 0).
//!
//! The GELU references are PyTorch float64 in non-cancelling forms (`x·erfc(-x/√2)/2`,
//! `x·sigmoid(2u)`), which the script checks against `nn.GELU` in float64 where that is
//! accurate: `nn.GELU`'s float64 `x/2·(1 + erf(x/√2))` is 0 below x = -8.
use std::path::PathBuf;

use conveyor_engine::checkpoint::{self, Checkpoint};
use conveyor_engine::cpu::softmax::{log_softmax_rows, softmax_rows};
use conveyor_engine::{Device, ForwardCtx, Layer, Tensor};
use conveyor_layers::{Gelu, GeluTanh, Tanh};

fn fixture() -> Checkpoint {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/activation_reference.safetensors");
    checkpoint::load(&path, &Device::host()).expect("the fixture loads")
}

fn values(fixture: &Checkpoint, name: &str) -> Vec<f32> {
    fixture.get(name).unwrap_or_else(|| panic!("the fixture has no tensor `{name}`")).to_vec_f32()
}

/// The worst `|a - e| / (rtol·|e| + atol)` (≤ 1 passes) and where, over the elements `keep` selects.
fn worst(actual: &[f32], expected: &[f32], rtol: f64, atol: f64, keep: impl Fn(usize) -> bool) -> (f64, usize) {
    assert_eq!(actual.len(), expected.len());
    let mut worst = (0.0, 0);
    for i in (0..actual.len()).filter(|&i| keep(i)) {
        let (a, e) = (actual[i] as f64, expected[i] as f64);
        let ratio = (a - e).abs() / (rtol * e.abs() + atol);
        if ratio.is_nan() || ratio > worst.0 {
            worst = (if ratio.is_nan() { f64::INFINITY } else { ratio }, i);
        }
    }
    worst
}

fn check_elementwise(name: &str, layer: &dyn Layer, dx_atol: f64) {
    let fixture = fixture();
    let (x, dy) = (values(&fixture, "x"), values(&fixture, "dy"));
    let x_tensor = Tensor::from_vec(x.clone(), [x.len()], &Device::host()).unwrap();
    let dy_tensor = Tensor::from_vec(dy, [x.len()], &Device::host()).unwrap();
    let (y, saved) = layer.forward(&[&x_tensor], &ForwardCtx::train(0)).unwrap();
    let dx = layer.backward_input(&saved, &dy_tensor).unwrap().remove(0).unwrap();
    let (y, dx) = (y.to_vec_f32(), dx.to_vec_f32());
    let (want_y, want_dx) = (values(&fixture, &format!("{name}.y")), values(&fixture, &format!("{name}.dx")));
    let conditioned = |i: usize| name != "gelu_tanh" || x[i].abs() <= 3.0;
    for (what, got, want, atol) in [("y", &y, &want_y, 1e-30), ("dx", &dx, &want_dx, dx_atol)] {
        let (ratio, i) = worst(got, want, 1e-6, atol, conditioned);
        assert!(
            ratio <= 1.0,
            "{name}.{what} at x = {}: {} vs torch {} ({ratio:.2} of the tolerance)",
            x[i],
            got[i],
            want[i]
        );
        let (ratio, i) = worst(got, want, 1e-5, atol, |i| !conditioned(i));
        assert!(
            ratio <= 1.0,
            "{name}.{what} at x = {}: {} vs torch {} ({ratio:.2} of the tolerance)",
            x[i],
            got[i],
            want[i]
        );
    }
}

#[test]
fn gelu_matches_torch_in_float64_to_1e_6() {
    check_elementwise("gelu", &Gelu::new(), 1e-7);
}

#[test]
fn gelu_tanh_matches_torch_in_float64() {
    check_elementwise("gelu_tanh", &GeluTanh::new(), 1e-7);
}

#[test]
fn tanh_matches_torch_in_float64_to_1e_6() {
    check_elementwise("tanh", &Tanh::new(), 2.5e-7);
}

#[test]
fn softmax_rows_match_torch_in_float64_to_1e_6() {
    let fixture = fixture();
    for width in [16, 64, 512] {
        let x = values(&fixture, &format!("rows{width}.x"));
        let mut got = vec![0.0; x.len()];
        softmax_rows(&x, width, &mut got).unwrap();
        let (ratio, i) = worst(&got, &values(&fixture, &format!("rows{width}.softmax")), 1e-6, 1e-30, |_| true);
        assert!(ratio <= 1.0, "softmax width {width} element {i}: {ratio:.2} of the tolerance");
        log_softmax_rows(&x, width, &mut got).unwrap();
        let (ratio, i) = worst(&got, &values(&fixture, &format!("rows{width}.log_softmax")), 1e-6, 1e-7, |_| true);
        assert!(ratio <= 1.0, "log_softmax width {width} element {i}: {ratio:.2} of the tolerance");
    }
}
