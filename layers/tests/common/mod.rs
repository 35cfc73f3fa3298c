//! Shared test helpers: seeded inputs, the tolerance formula, and the finite-difference gradient
//! checker that compares a layer against an f64 reference of its forward pass.
#![allow(dead_code)]

use conveyor_engine::{DType, Device, ForwardCtx, Layer, Tensor};
use rand::RngExt;
use rand::rngs::StdRng;

/// Relative part of the tolerance.
pub const RELATIVE_TOLERANCE: f64 = 1e-3;
/// Absolute floor of the tolerance.
pub const ABSOLUTE_TOLERANCE: f64 = 1e-6;
/// Central-difference step (in f64).
pub const FD_STEP: f64 = 1e-4;

/// The tolerance used everywhere: `|actual - expected| ≤ 1e-3 · (|expected| + ‖expected‖∞) + 1e-6`.
pub fn assert_close(what: &str, actual: &[f64], expected: &[f64]) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths differ");
    let scale = expected.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        let bound = RELATIVE_TOLERANCE * (e.abs() + scale) + ABSOLUTE_TOLERANCE;
        assert!(
            (a - e).abs() <= bound,
            "{what}[{i}]: got {a}, expected {e} (|diff| {} > bound {bound})",
            (a - e).abs()
        );
    }
}

/// `n` values drawn from U(low, high), rounded to f32 (so f32 layers and f64 references see the same numbers).
pub fn random_values(n: usize, low: f32, high: f32, rng: &mut StdRng) -> Vec<f64> {
    (0..n).map(|_| rng.random_range(low..high) as f64).collect()
}

/// Like [`random_values`] but at least `gap` away from zero (for kinks such as ReLU's).
pub fn values_away_from_zero(n: usize, gap: f32, rng: &mut StdRng) -> Vec<f64> {
    (0..n)
        .map(|_| {
            let magnitude = rng.random_range(gap..1.0);
            (if rng.random::<bool>() { magnitude } else { -magnitude }) as f64
        })
        .collect()
}

/// Distinct values spaced `step` apart in a seeded random order (no ties, for max pooling).
pub fn distinct_values(n: usize, step: f64, rng: &mut StdRng) -> Vec<f64> {
    let mut values: Vec<f64> = (0..n).map(|i| ((i as f64 - n as f64 / 2.0) * step) as f32 as f64).collect();
    for i in (1..n).rev() {
        let j = rng.random_range(0..=i);
        values.swap(i, j);
    }
    values
}

/// An f32 host tensor from f64 values.
pub fn tensor(values: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(values.iter().map(|&v| v as f32).collect(), shape.to_vec(), &Device::host()).unwrap()
}

/// A tensor's elements as f64.
pub fn to_f64(tensor: &Tensor) -> Vec<f64> {
    tensor.to_vec_f32().into_iter().map(f64::from).collect()
}

/// One input of a gradient check.
pub struct Input {
    /// Values (f32-representable).
    pub values: Vec<f64>,
    /// Shape, batch first.
    pub shape: Vec<usize>,
    /// Whether the layer returns a gradient for it (`false`: it must return `None`).
    pub differentiable: bool,
}

impl Input {
    /// A differentiable input.
    pub fn new(values: Vec<f64>, shape: &[usize]) -> Input {
        assert_eq!(values.len(), shape.iter().product::<usize>());
        Input { values, shape: shape.to_vec(), differentiable: true }
    }

    /// An input without gradient (ids).
    pub fn constant(values: Vec<f64>, shape: &[usize]) -> Input {
        Input { differentiable: false, ..Input::new(values, shape) }
    }
}

/// f64 reference of a layer's forward: `(inputs, parameters) -> output`.
pub type Reference<'a> = &'a dyn Fn(&[Vec<f64>], &[Vec<f64>]) -> Vec<f64>;

/// Checks `layer` against `reference`: the forward output, then `backward_input` and
/// `backward_weight` against central finite differences (step [`FD_STEP`]) of
/// `L = Σ g ⊙ reference(x, θ)` for a seeded random `g`, all within [`assert_close`]'s bound.
/// Also checks that `backward_weight` adds into its gradients (calling it twice doubles them).
pub fn check_layer(
    name: &str,
    layer: &dyn Layer,
    inputs: &[Input],
    ctx: ForwardCtx,
    reference: Reference<'_>,
    seed: u64,
) {
    let mut rng = conveyor_engine::init::rng(seed);
    let tensors: Vec<Tensor> = inputs.iter().map(|i| tensor(&i.values, &i.shape)).collect();
    let refs: Vec<&Tensor> = tensors.iter().collect();
    let mut input_values: Vec<Vec<f64>> = inputs.iter().map(|i| i.values.clone()).collect();
    let mut param_values: Vec<Vec<f64>> = layer.parameters().iter().map(|p| to_f64(&p.value)).collect();

    let (output, saved) = layer.forward(&refs, &ctx).unwrap();
    let expected_output = reference(&input_values, &param_values);
    assert_close(&format!("{name} forward"), &to_f64(&output), &expected_output);
    let per_sample: Vec<_> = inputs.iter().map(|i| conveyor_engine::Shape::new(i.shape[1..].to_vec())).collect();
    assert_eq!(
        layer.output_shape(&per_sample).unwrap().dims(),
        &output.dims()[1..],
        "{name}: output_shape disagrees with forward"
    );
    layer.cost(&per_sample).unwrap();

    let grad_output_values = random_values(output.numel(), -1.0, 1.0, &mut rng);
    let grad_output = tensor(&grad_output_values, output.dims());
    let objective = |inputs: &[Vec<f64>], params: &[Vec<f64>]| -> f64 {
        reference(inputs, params).iter().zip(&grad_output_values).map(|(y, g)| y * g).sum()
    };

    let input_grads = layer.backward_input(&saved, &grad_output).unwrap();
    assert_eq!(input_grads.len(), inputs.len(), "{name}: one gradient slot per input");
    for (index, (input, grad)) in inputs.iter().zip(&input_grads).enumerate() {
        if !input.differentiable {
            assert!(grad.is_none(), "{name}: input {index} takes no gradient");
            continue;
        }
        let grad = grad.as_ref().unwrap_or_else(|| panic!("{name}: input {index} needs a gradient"));
        assert_eq!(grad.dims(), input.shape.as_slice(), "{name}: gradient shape of input {index}");
        let numeric: Vec<f64> = (0..input.values.len())
            .map(|k| central_difference(&mut input_values, index, k, |x| objective(x, &param_values)))
            .collect();
        assert_close(&format!("{name} input {index} gradient"), &to_f64(grad), &numeric);
    }

    let zero_grads = || -> Vec<Tensor> {
        layer
            .parameters()
            .iter()
            .map(|p| Tensor::zeros(p.value.shape().clone(), p.value.dtype(), &Device::host()).unwrap())
            .collect()
    };
    let mut param_grads = zero_grads();
    layer.backward_weight(&saved, &grad_output, &mut param_grads).unwrap();
    for (index, grad) in param_grads.iter().enumerate() {
        let numeric: Vec<f64> = (0..param_values[index].len())
            .map(|k| central_difference(&mut param_values, index, k, |p| objective(&input_values, p)))
            .collect();
        let param_name = &layer.parameters()[index].name;
        assert_close(&format!("{name} `{param_name}` gradient"), &to_f64(grad), &numeric);
    }
    layer.backward_weight(&saved, &grad_output, &mut param_grads).unwrap();
    let mut once = zero_grads();
    layer.backward_weight(&saved, &grad_output, &mut once).unwrap();
    for (twice, once) in param_grads.iter().zip(&once) {
        let doubled: Vec<f64> = to_f64(once).iter().map(|v| 2.0 * v).collect();
        assert_close(&format!("{name} backward_weight accumulates"), &to_f64(twice), &doubled);
    }
}

/// `(f(v + h) - f(v - h)) / 2h` for element `k` of `values[index]`, restoring it afterwards.
fn central_difference(values: &mut [Vec<f64>], index: usize, k: usize, f: impl Fn(&[Vec<f64>]) -> f64) -> f64 {
    let original = values[index][k];
    values[index][k] = original + FD_STEP;
    let plus = f(values);
    values[index][k] = original - FD_STEP;
    let minus = f(values);
    values[index][k] = original;
    (plus - minus) / (2.0 * FD_STEP)
}

/// The split layers' tolerance: shards sum over their own heads, features or tokens and the
/// collectives add the partials, so every element of `actual` is within `1e-5 · ‖expected‖∞`
/// (at least `1e-7`) of `expected`.
pub fn assert_near(what: &str, actual: &Tensor, expected: &Tensor) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shapes");
    let (a, e) = (actual.to_vec_f32(), expected.to_vec_f32());
    let bound = 1e-5 * e.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-2);
    for (i, (x, y)) in a.iter().zip(&e).enumerate() {
        assert!((x - y).abs() <= bound, "{what}[{i}]: {x} vs {y} (bound {bound})");
    }
}

/// An f32 host tensor of `dims` drawn from U(-1, 1).
pub fn uniform(dims: &[usize], rng: &mut StdRng) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec((0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect(), dims.to_vec(), &Device::host()).unwrap()
}

/// Zeroed f32 gradients for every parameter of `layer`, each on its parameter's device.
pub fn zero_grads(layer: &dyn Layer) -> Vec<Tensor> {
    let zeros = |p: &conveyor_engine::Parameter| Tensor::zeros(p.value.shape().clone(), DType::F32, p.value.device());
    layer.parameters().iter().map(|p| zeros(p).unwrap()).collect()
}
