//! NaN, ±inf and -0.0 through every activation, pool, LayerNorm, dropout and the cross-entropy
//! loss, forward and backward, element by element against PyTorch (fixture
//! `tests/fixtures/nonfinite_reference.safetensors`, made by
//! `tests/fixtures/make_nonfinite_reference.py`; no Python at test time).
//!
//! The rule PyTorch keeps and Conveyor must keep: a NaN in is a NaN out wherever it reaches
//! (`relu(nan) = nan`, a max-pool window holding NaN gives NaN, a LayerNorm or softmax row holding
//! NaN is NaN), never silently zeroed, so a non-finite step is seen and refused, never committed.
//!
//! Comparison, per element: NaN equals NaN; an infinity must be the same infinity; a finite value
//! must lie within `|actual - expected| ≤ 1e-4 · |expected| + 1e-6` (the ops evaluate
//! transcendentals and sums differently from torch); the sign of a zero is compared only where the
//! fixture's `*_check` mask says torch itself is deterministic about it (2), values only where it
//! is 1, and nothing where torch disagrees with itself (0, e.g. gelu(+inf): inf on torch's scalar
//! path, NaN on its vectorised one).
use std::path::PathBuf;

use conveyor_engine::checkpoint::{self, Checkpoint};
use conveyor_engine::{Device, ForwardCtx, Layer, Loss, Targets, Tensor};
use conveyor_layers::{AvgPool2d, CrossEntropyLoss, Dropout, Gelu, GlobalAvgPool2d, LayerNorm, MaxPool2d, Relu, Tanh};

const RELATIVE_TOLERANCE: f32 = 1e-4;
const ABSOLUTE_TOLERANCE: f32 = 1e-6;

fn fixture() -> Checkpoint {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nonfinite_reference.safetensors");
    checkpoint::load(&path, &Device::host()).expect("the fixture loads")
}

fn get<'a>(fixture: &'a Checkpoint, name: &str) -> &'a Tensor {
    fixture.get(name).unwrap_or_else(|| panic!("the fixture has no tensor `{name}`"))
}

fn values(fixture: &Checkpoint, name: &str) -> Vec<f32> {
    get(fixture, name).to_vec_f32()
}

/// How strictly one element is compared (the fixture's `*_check` values).
#[derive(Clone, Copy, PartialEq)]
enum Check {
    /// Torch disagrees with itself: nothing to compare.
    Skip,
    /// The value, not the sign of a zero.
    Value,
    /// The value and the sign of a zero.
    Exact,
}

fn checks(fixture: &Checkpoint, name: &str) -> Vec<Check> {
    values(fixture, name)
        .into_iter()
        .map(|c| match c as u8 {
            0 => Check::Skip,
            1 => Check::Value,
            _ => Check::Exact,
        })
        .collect()
}

/// Why `actual` does not match `expected`, if it does not.
fn mismatch(actual: f32, expected: f32, check: Check) -> Option<String> {
    let ok = match check {
        Check::Skip => true,
        _ if expected.is_nan() => actual.is_nan(),
        _ if expected.is_infinite() => actual == expected,
        _ if actual.is_nan() || actual.is_infinite() => false,
        Check::Exact if expected == 0.0 => actual == 0.0 && actual.is_sign_negative() == expected.is_sign_negative(),
        _ => (actual - expected).abs() <= RELATIVE_TOLERANCE * expected.abs() + ABSOLUTE_TOLERANCE,
    };
    (!ok).then(|| format!("got {actual:?}, torch gives {expected:?}"))
}

/// Every element of `actual` against `expected` under `checks`; the failures, each named.
fn compare(what: &str, inputs: &[f32], actual: &[f32], expected: &[f32], checks: &[Check]) -> Vec<String> {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths differ");
    assert_eq!(checks.len(), expected.len(), "{what}: check mask length");
    (0..expected.len())
        .filter_map(|i| {
            let input = inputs.get(i).map(|x| format!(" (x = {x:?})")).unwrap_or_default();
            mismatch(actual[i], expected[i], checks[i]).map(|why| format!("{what}[{i}]{input}: {why}"))
        })
        .collect()
}

fn assert_no_mismatches(case: &str, mismatches: Vec<String>) {
    assert!(mismatches.is_empty(), "{case} differs from PyTorch:\n  {}", mismatches.join("\n  "));
}

/// Runs `layer` forward on `<case>.x` and backward on `<case>.dy` and compares output and input
/// gradient with torch's. For elementwise ops the input shown next to a failure is the element's.
fn check_case(case: &str, layer: &dyn Layer, ctx: ForwardCtx) {
    let fixture = fixture();
    let x = get(&fixture, &format!("{case}.x"));
    let dy = get(&fixture, &format!("{case}.dy"));
    let (y, saved) = layer.forward(&[x], &ctx).expect("forward");
    let dx = layer.backward_input(&saved, dy).expect("backward_input").remove(0).expect("an input gradient");
    let x_values = x.to_vec_f32();
    let elementwise_inputs = if y.numel() == x.numel() { x_values.clone() } else { Vec::new() };
    let mut mismatches = compare(
        "y",
        &elementwise_inputs,
        &y.to_vec_f32(),
        &values(&fixture, &format!("{case}.y")),
        &checks(&fixture, &format!("{case}.y_check")),
    );
    mismatches.extend(compare(
        "dx",
        &x_values,
        &dx.to_vec_f32(),
        &values(&fixture, &format!("{case}.dx")),
        &checks(&fixture, &format!("{case}.dx_check")),
    ));
    assert_no_mismatches(case, mismatches);
}

#[test]
fn relu_propagates_nan_and_keeps_negative_zero_like_torch() {
    check_case("relu", &Relu::new(), ForwardCtx::train(0));
}

#[test]
fn gelu_matches_torch_on_non_finite_values() {
    check_case("gelu", &Gelu::new(), ForwardCtx::train(0));
}

#[test]
fn tanh_matches_torch_on_non_finite_values() {
    check_case("tanh", &Tanh::new(), ForwardCtx::train(0));
}

#[test]
fn max_pool_propagates_nan_and_routes_its_gradient_to_the_last_nan() {
    check_case("max_pool_k2s2", &MaxPool2d::new((2, 2), (2, 2)).unwrap(), ForwardCtx::train(0));
    check_case("max_pool_k3s1p1", &MaxPool2d::with_padding((3, 3), (1, 1), (1, 1)).unwrap(), ForwardCtx::train(0));
}

#[test]
fn avg_pools_propagate_non_finite_values_like_torch() {
    check_case("avg_pool_k2s2", &AvgPool2d::new((2, 2), (2, 2)).unwrap(), ForwardCtx::train(0));
    check_case("avg_pool_k3s1p1", &AvgPool2d::with_padding((3, 3), (1, 1), (1, 1)).unwrap(), ForwardCtx::train(0));
    check_case("global_avg_pool", &GlobalAvgPool2d::new(), ForwardCtx::train(0));
}

#[test]
fn layer_norm_confines_non_finite_values_to_their_row_like_torch() {
    check_case("layer_norm", &LayerNorm::new(4).unwrap(), ForwardCtx::train(0));
}

#[test]
fn dropout_multiplies_so_a_dropped_nan_stays_nan_like_torch() {
    check_case("dropout_p1", &Dropout::new(1.0).unwrap(), ForwardCtx::train(0));
}

/// p = 0.5: each element against torch's output for the same outcome (kept or dropped), the
/// outcome taken from Conveyor's own mask.
#[test]
fn dropout_half_matches_torch_element_by_element() {
    let fixture = fixture();
    let (x, dy) = (get(&fixture, "dropout_half.x"), get(&fixture, "dropout_half.dy"));
    let dropout = Dropout::new(0.5).unwrap();
    let seed = 7;
    let mask = dropout.mask(x.numel(), seed);
    assert!(mask.contains(&0.0) && mask.contains(&1.0), "seed {seed} should both keep and drop");
    let (y, saved) = dropout.forward(&[x], &ForwardCtx::train(seed)).unwrap();
    let dx = dropout.backward_input(&saved, dy).unwrap().remove(0).unwrap();
    let pick = |kept: Vec<f32>, dropped: Vec<f32>| -> Vec<f32> {
        mask.iter().enumerate().map(|(i, &keep)| if keep == 1.0 { kept[i] } else { dropped[i] }).collect()
    };
    let expected_y = pick(values(&fixture, "dropout_half.y_kept"), values(&fixture, "dropout_half.y_dropped"));
    let expected_dx = pick(values(&fixture, "dropout_half.dx_kept"), values(&fixture, "dropout_half.dx_dropped"));
    let exact = vec![Check::Exact; x.numel()];
    let x_values = x.to_vec_f32();
    let mut mismatches = compare("y", &x_values, &y.to_vec_f32(), &expected_y, &exact);
    mismatches.extend(compare("dx", &x_values, &dx.to_vec_f32(), &expected_dx, &exact));
    assert_no_mismatches("dropout_half", mismatches);
}

/// Each row alone (normalizer 1): its loss and its gradient against torch's
/// `F.cross_entropy(row, label)`.
#[test]
fn cross_entropy_makes_a_row_with_nan_or_inf_logits_nan_like_torch() {
    let fixture = fixture();
    let logits = get(&fixture, "cross_entropy.x");
    let n_classes = logits.dims()[1];
    let logits = logits.to_vec_f32();
    let labels = values(&fixture, "cross_entropy.labels");
    let (expected_loss, expected_dx) = (values(&fixture, "cross_entropy.loss"), values(&fixture, "cross_entropy.dx"));
    let (loss_checks, dx_checks) =
        (checks(&fixture, "cross_entropy.loss_check"), checks(&fixture, "cross_entropy.dx_check"));
    let mut mismatches = Vec::new();
    for (row_idx, row) in logits.chunks_exact(n_classes).enumerate() {
        let output = Tensor::from_vec(row.to_vec(), [1, n_classes], &Device::host()).unwrap();
        let (loss, grad) = CrossEntropyLoss::new()
            .loss_and_grad(&output, &Targets::Classes(vec![labels[row_idx] as usize]), 1.0)
            .unwrap();
        let span = row_idx * n_classes..(row_idx + 1) * n_classes;
        let what = format!("row {row_idx} {row:?}, label {}:", labels[row_idx]);
        mismatches.extend(compare(
            &format!("{what} loss"),
            &[],
            &[loss as f32],
            &expected_loss[row_idx..=row_idx],
            &loss_checks[row_idx..=row_idx],
        ));
        mismatches.extend(compare(
            &format!("{what} dx"),
            &[],
            &grad.to_vec_f32(),
            &expected_dx[span.clone()],
            &dx_checks[span],
        ));
    }
    assert_no_mismatches("cross_entropy", mismatches);
}

/// The comparison itself: NaN equals NaN, infinities and zero signs are exact where asked.
#[test]
fn the_comparison_treats_nan_as_equal_and_checks_zero_signs_only_where_asked() {
    assert!(mismatch(f32::NAN, f32::NAN, Check::Exact).is_none());
    assert!(mismatch(0.0, f32::NAN, Check::Exact).is_some());
    assert!(mismatch(f32::NAN, 0.0, Check::Value).is_some());
    assert!(mismatch(f32::INFINITY, f32::NEG_INFINITY, Check::Value).is_some());
    assert!(mismatch(0.0, -0.0, Check::Exact).is_some());
    assert!(mismatch(0.0, -0.0, Check::Value).is_none());
    assert!(mismatch(f32::NAN, 1.0, Check::Skip).is_none());
    assert!(mismatch(1.0001, 1.0, Check::Value).is_none());
    assert!(mismatch(1.001, 1.0, Check::Value).is_some());
}
