//! Gradient checks for layers: [`gradcheck`] compares a layer's backward pass (both the split
//! halves and the combined [`Layer::backward`]) with central finite differences of its own
//! forward pass, so a custom layer is checked in one line, as `torch.autograd.gradcheck` does.
//!
//! The checked function is `L(x, θ) = Σ g ⊙ forward(x, θ)` for a seeded random `g`; its
//! derivatives are exactly the input gradients [`Layer::backward_input`] returns for `g` and the
//! parameter gradients [`Layer::backward_weight`] adds. Tensors are f32, so the differences use a
//! step of `1e-2` and the tolerance is `rtol · (|numeric| + max |numeric|) + atol` (defaults
//! `1e-2` and `1e-3`), loose enough for f32 rounding, tight enough to catch a wrong formula, a
//! missing term or a transposed product.
use crate::{Device, Error, ForwardCtx, Layer, Result, Shape, Tensor, init};
use rand::RngExt;

/// Settings of a [`gradcheck_with`] run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradcheckOptions {
    /// Rows of the batch the layer is run on.
    pub batch: usize,
    /// Seed of the inputs, the output gradient `g` and the forward context (dropout masks).
    pub seed: u64,
    /// Central-difference step.
    pub step: f64,
    /// Relative tolerance (of the largest numeric derivative of the tensor checked, and of each).
    pub rtol: f64,
    /// Absolute tolerance.
    pub atol: f64,
    /// At most this many elements of each input and parameter are perturbed (chosen evenly
    /// spread when a tensor has more), bounding the forward passes at about `2 x` this per tensor.
    pub max_elements_per_tensor: usize,
}

impl Default for GradcheckOptions {
    fn default() -> Self {
        GradcheckOptions { batch: 2, seed: 0, step: 1e-2, rtol: 1e-2, atol: 1e-3, max_elements_per_tensor: 256 }
    }
}

/// What a passing [`gradcheck`] compared.
#[derive(Clone, Debug, PartialEq)]
pub struct GradcheckReport {
    /// Derivatives compared with finite differences (inputs and parameters).
    pub n_checked: usize,
    /// Largest `|analytic - numeric|`.
    pub max_abs_error: f64,
    /// Largest `|analytic - numeric| / max(|numeric|, atol)`.
    pub max_rel_error: f64,
}

/// Checks `layer`'s backward against finite differences on a batch of [`GradcheckOptions::batch`]
/// rows of seeded random inputs of the given per-sample shapes (the shapes
/// [`Layer::output_shape`] takes): every input gradient (inputs of a layer that
/// [`Layer::takes_indices`] are ids and get none), every parameter gradient, the combined
/// [`Layer::backward`] against the two halves, and that [`Layer::backward_weight`] adds into its
/// gradients. The layer is borrowed mutably to perturb its parameters; they are restored before
/// it returns. A mismatch is [`Error::GradientCheck`] naming the tensor, the element and both values.
///
/// ```
/// use conveyor_engine::testing::gradcheck;
/// use conveyor_engine::{DType, Device, ForwardCtx, Layer, Parameter, Result, Saved, Shape, Tensor};
///
/// /// `y = x * gamma` over the last dimension.
/// #[derive(Debug)]
/// struct Scale(Vec<Parameter>);
///
/// impl Layer for Scale {
///     fn parameters(&self) -> &[Parameter] { &self.0 }
///     fn parameters_mut(&mut self) -> &mut [Parameter] { &mut self.0 }
///     fn forward(&self, x: &[&Tensor], _: &ForwardCtx) -> Result<(Tensor, Saved)> {
///         Ok((x[0].mul_rows(&self.0[0].value)?, Saved { tensors: vec![x[0].share()] }))
///     }
///     fn backward(&self, saved: &Saved, grad: &Tensor, param_grads: &mut [Tensor]) -> Result<Vec<Option<Tensor>>> {
///         param_grads[0].accumulate_column_sums(&saved.tensors[0].mul(grad)?)?;
///         Ok(vec![Some(grad.mul_rows(&self.0[0].value)?)])
///     }
/// }
///
/// let gamma = Tensor::from_vec(vec![0.5, -2.0, 3.0], [3], &Device::host())?;
/// let mut layer = Scale(vec![Parameter { name: "gamma".into(), value: gamma }]);
/// let report = gradcheck(&mut layer, &[Shape::from([3])])?;
/// assert_eq!(report.n_checked, 2 * 3 + 3);
/// # Ok::<(), conveyor_engine::Error>(())
/// ```
pub fn gradcheck(layer: &mut dyn Layer, input_shapes: &[Shape]) -> Result<GradcheckReport> {
    gradcheck_with(layer, input_shapes, &GradcheckOptions::default())
}

/// [`gradcheck`] with explicit settings.
pub fn gradcheck_with(
    layer: &mut dyn Layer,
    input_shapes: &[Shape],
    options: &GradcheckOptions,
) -> Result<GradcheckReport> {
    if input_shapes.len() != layer.n_inputs() {
        return Err(Error::invalid(
            "gradcheck input shapes",
            format!("{} takes {} input(s), {} shapes given", layer.kind(), layer.n_inputs(), input_shapes.len()),
        ));
    }
    if options.batch == 0 || options.step.is_nan() || options.step <= 0.0 {
        return Err(Error::invalid(
            "gradcheck options",
            "the batch needs at least 1 row and the step must be positive",
        ));
    }
    let host = Device::host();
    let mut rng = init::rng(options.seed);
    let differentiable = !layer.takes_indices();
    let mut inputs: Vec<Vec<f32>> = Vec::new();
    let mut batch_shapes: Vec<Shape> = Vec::new();
    for shape in input_shapes {
        let mut dims = vec![options.batch];
        dims.extend_from_slice(shape.dims());
        let n: usize = dims.iter().product();
        // Away from zero, so kinks at zero (ReLU's) lie farther than a step from every input.
        let values = (0..n)
            .map(|_| {
                if !differentiable {
                    return 0.0;
                }
                let magnitude = rng.random_range(0.05f32..1.0);
                if rng.random::<bool>() { magnitude } else { -magnitude }
            })
            .collect();
        inputs.push(values);
        batch_shapes.push(Shape::new(dims));
    }
    let ctx = ForwardCtx::train(options.seed);
    let to_tensors = |inputs: &[Vec<f32>]| -> Result<Vec<Tensor>> {
        inputs.iter().zip(&batch_shapes).map(|(v, s)| Tensor::from_vec(v.clone(), s.clone(), &host)).collect()
    };
    let tensors = to_tensors(&inputs)?;
    let refs: Vec<&Tensor> = tensors.iter().collect();
    let (output, saved) = layer.forward(&refs, &ctx)?;
    let grad_output_values: Vec<f32> = (0..output.numel()).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let grad_output = Tensor::from_vec(grad_output_values.clone(), output.shape().clone(), output.device())?;
    let objective = |layer: &dyn Layer, inputs: &[Vec<f32>]| -> Result<f64> {
        let tensors = to_tensors(inputs)?;
        let refs: Vec<&Tensor> = tensors.iter().collect();
        let (output, _) = layer.forward(&refs, &ctx)?;
        Ok(output.to_vec_f32().iter().zip(&grad_output_values).map(|(&y, &g)| f64::from(y) * f64::from(g)).sum())
    };

    // The analytic gradients, split and combined.
    let zeros = |layer: &dyn Layer| -> Result<Vec<Tensor>> {
        layer
            .parameters()
            .iter()
            .map(|p| Tensor::zeros(p.value.shape().clone(), p.value.dtype(), p.value.device()))
            .collect()
    };
    let input_grads = layer.backward_input(&saved, &grad_output)?;
    let mut param_grads = zeros(layer)?;
    layer.backward_weight(&saved, &grad_output, &mut param_grads)?;
    let mut combined_param_grads = zeros(layer)?;
    let combined_input_grads = layer.backward(&saved, &grad_output, &mut combined_param_grads)?;
    if input_grads.len() != inputs.len() || combined_input_grads.len() != inputs.len() {
        return Err(Error::invalid(
            format!("{} backward", layer.kind()),
            format!("{} input(s) but {} input gradient(s) returned", inputs.len(), input_grads.len()),
        ));
    }

    let mut check = Check { options: *options, layer: layer.kind(), report: GradcheckReport::default_empty() };
    for (index, (grad, combined)) in input_grads.iter().zip(&combined_input_grads).enumerate() {
        let what = format!("input {index}");
        let grad = match (differentiable, grad) {
            (false, _) => continue,
            (true, Some(grad)) => grad.to_vec_f32(),
            (true, None) => return Err(check.missing(&what)),
        };
        let combined = combined.as_ref().ok_or_else(|| check.missing(&format!("{what} (from Layer::backward)")))?;
        check.tensors_agree(&format!("{what}: backward against backward_input"), &combined.to_vec_f32(), &grad)?;
        let mut numeric = Vec::new();
        let mut analytic = Vec::new();
        let mut perturbed = inputs.clone();
        for k in sample(inputs[index].len(), options.max_elements_per_tensor) {
            let original = perturbed[index][k];
            perturbed[index][k] = original + options.step as f32;
            let plus = objective(layer, &perturbed)?;
            perturbed[index][k] = original - options.step as f32;
            let minus = objective(layer, &perturbed)?;
            perturbed[index][k] = original;
            // The step as the f32 values actually moved.
            let moved = f64::from(original + options.step as f32) - f64::from(original - options.step as f32);
            numeric.push((k, (plus - minus) / moved));
            analytic.push(f64::from(grad[k]));
        }
        check.against_differences(&what, &analytic, &numeric)?;
    }

    for index in 0..param_grads.len() {
        let name = layer.parameters()[index].name.clone();
        let what = format!("parameter `{name}`");
        let grad = param_grads[index].to_vec_f32();
        check.tensors_agree(
            &format!("{what}: backward against backward_weight"),
            &combined_param_grads[index].to_vec_f32(),
            &grad,
        )?;
        let original = layer.parameters()[index].value.try_clone()?;
        let mut values = original.to_vec_f32();
        let mut numeric = Vec::new();
        let mut analytic = Vec::new();
        let result = (|| -> Result<()> {
            for k in sample(values.len(), options.max_elements_per_tensor) {
                let centre = values[k];
                let mut at = |value: f32, layer: &mut dyn Layer| -> Result<f64> {
                    values[k] = value;
                    set_parameter(layer, index, &values, &original)?;
                    objective(layer, &inputs)
                };
                let plus = at(centre + options.step as f32, layer)?;
                let minus = at(centre - options.step as f32, layer)?;
                values[k] = centre;
                let moved = f64::from(centre + options.step as f32) - f64::from(centre - options.step as f32);
                numeric.push((k, (plus - minus) / moved));
                analytic.push(f64::from(grad[k]));
            }
            Ok(())
        })();
        // The parameter as it was, whatever happened.
        layer.parameters_mut()[index].value = original;
        layer.refresh()?;
        result?;
        check.against_differences(&what, &analytic, &numeric)?;
    }

    // backward_weight adds: a second call doubles the gradients.
    if !param_grads.is_empty() {
        let once: Vec<Vec<f32>> = param_grads.iter().map(Tensor::to_vec_f32).collect();
        layer.backward_weight(&saved, &grad_output, &mut param_grads)?;
        for (index, (twice, once)) in param_grads.iter().zip(&once).enumerate() {
            let doubled: Vec<f32> = once.iter().map(|v| 2.0 * v).collect();
            let name = &layer.parameters()[index].name;
            check.tensors_agree(
                &format!("parameter `{name}`: backward_weight must add into its gradients (twice is double)"),
                &twice.to_vec_f32(),
                &doubled,
            )?;
        }
    }
    Ok(check.report)
}

/// Sets parameter `index` of `layer` to `values` (shape, dtype and device of `like`), refreshed.
fn set_parameter(layer: &mut dyn Layer, index: usize, values: &[f32], like: &Tensor) -> Result<()> {
    let value = Tensor::from_vec(values.to_vec(), like.shape().clone(), &Device::host())?;
    let value = value.to_dtype(like.dtype())?.to_device(like.device())?;
    layer.parameters_mut()[index].value = value;
    layer.refresh()
}

/// Up to `max` element indices of `0..n`, evenly spread (all of them when `n <= max`).
fn sample(n: usize, max: usize) -> Vec<usize> {
    if n <= max {
        return (0..n).collect();
    }
    let max = max.max(1);
    (0..max).map(|i| i * n / max).collect()
}

/// The running comparison of one [`gradcheck_with`] call.
struct Check {
    options: GradcheckOptions,
    layer: &'static str,
    report: GradcheckReport,
}

impl GradcheckReport {
    fn default_empty() -> GradcheckReport {
        GradcheckReport { n_checked: 0, max_abs_error: 0.0, max_rel_error: 0.0 }
    }
}

impl Check {
    fn missing(&self, what: &str) -> Error {
        Error::invalid(format!("{} backward", self.layer), format!("{what} takes a gradient but none was returned"))
    }

    /// Analytic derivatives against `(element, numeric)` pairs.
    fn against_differences(&mut self, what: &str, analytic: &[f64], numeric: &[(usize, f64)]) -> Result<()> {
        let scale = numeric.iter().fold(0.0f64, |m, (_, v)| m.max(v.abs()));
        for (&a, &(element, n)) in analytic.iter().zip(numeric) {
            let error = (a - n).abs();
            let tolerance = self.options.rtol * (n.abs() + scale) + self.options.atol;
            // NaN fails too.
            if error.is_nan() || error > tolerance {
                return Err(Error::GradientCheck {
                    layer: self.layer.to_string(),
                    what: what.to_string(),
                    element,
                    analytic: a,
                    numeric: n,
                    tolerance,
                });
            }
            self.report.n_checked += 1;
            self.report.max_abs_error = self.report.max_abs_error.max(error);
            self.report.max_rel_error = self.report.max_rel_error.max(error / n.abs().max(self.options.atol));
        }
        Ok(())
    }

    /// Two computations of the same gradient (they may differ by f32 rounding only).
    fn tensors_agree(&self, what: &str, actual: &[f32], expected: &[f32]) -> Result<()> {
        if actual.len() != expected.len() {
            return Err(Error::shape(
                format!("{} {what}", self.layer),
                format!("{} elements", expected.len()),
                format!("{} elements", actual.len()),
            ));
        }
        let scale = expected.iter().fold(0.0f64, |m, &v| m.max(f64::from(v).abs()));
        for (element, (&a, &e)) in actual.iter().zip(expected).enumerate() {
            let (a, e) = (f64::from(a), f64::from(e));
            let tolerance = 1e-5 * (e.abs() + scale) + 1e-6;
            if (a - e).is_nan() || (a - e).abs() > tolerance {
                return Err(Error::GradientCheck {
                    layer: self.layer.to_string(),
                    what: what.to_string(),
                    element,
                    analytic: a,
                    numeric: e,
                    tolerance,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Parameter, Saved};

    /// `y = x * gamma`, with a backward that can be made wrong.
    #[derive(Debug)]
    struct Scale {
        params: Vec<Parameter>,
        wrong: bool,
    }

    impl Layer for Scale {
        fn parameters(&self) -> &[Parameter] {
            &self.params
        }
        fn parameters_mut(&mut self) -> &mut [Parameter] {
            &mut self.params
        }
        fn forward(&self, x: &[&Tensor], _: &ForwardCtx) -> Result<(Tensor, Saved)> {
            Ok((x[0].mul_rows(&self.params[0].value)?, Saved { tensors: vec![x[0].share()] }))
        }
        fn backward(&self, saved: &Saved, grad: &Tensor, param_grads: &mut [Tensor]) -> Result<Vec<Option<Tensor>>> {
            param_grads[0].accumulate_column_sums(&saved.tensors[0].mul(grad)?)?;
            let mut dx = grad.mul_rows(&self.params[0].value)?;
            if self.wrong {
                dx.scale_in_place(1.1)?;
            }
            Ok(vec![Some(dx)])
        }
    }

    fn scale(wrong: bool) -> Scale {
        let gamma = Tensor::from_vec(vec![0.5, -2.0, 3.0, 0.25], [4], &Device::host()).unwrap();
        Scale { params: vec![Parameter { name: "gamma".into(), value: gamma }], wrong }
    }

    #[test]
    fn a_right_backward_passes_and_the_parameters_come_back() {
        let mut layer = scale(false);
        let before = layer.params[0].value.try_clone().unwrap();
        let report = gradcheck(&mut layer, &[Shape::from([4])]).unwrap();
        assert_eq!(report.n_checked, 2 * 4 + 4);
        assert!(report.max_abs_error < 1e-3, "{report:?}");
        assert!(layer.params[0].value.bit_eq(&before));
    }

    #[test]
    fn a_wrong_input_gradient_is_caught_and_named() {
        let err = gradcheck(&mut scale(true), &[Shape::from([4])]).unwrap_err();
        match err {
            Error::GradientCheck { what, element, analytic, numeric, .. } => {
                assert_eq!(what, "input 0");
                assert!(element < 2 * 4, "{element}");
                assert!((analytic / numeric - 1.1).abs() < 1e-2, "{analytic} against {numeric}");
            }
            other => panic!("expected a gradient-check error, got {other}"),
        }
    }

    #[test]
    fn a_layer_without_any_backward_is_a_clear_error() {
        #[derive(Debug)]
        struct NoBackward;
        impl Layer for NoBackward {
            fn forward(&self, x: &[&Tensor], _: &ForwardCtx) -> Result<(Tensor, Saved)> {
                Ok((x[0].share(), Saved::default()))
            }
        }
        let err = gradcheck(&mut NoBackward, &[Shape::from([3])]).unwrap_err();
        assert!(matches!(&err, Error::BackwardNotImplemented { layer } if layer == "NoBackward"), "{err}");
        assert!(err.to_string().contains("implement `Layer::backward`"), "{err}");
        // The defaults leave nothing behind: the guard is released after the error.
        let x = Tensor::full(1.0, [1, 3], DType::F32, &Device::host()).unwrap();
        let (_, saved) = NoBackward.forward(&[&x], &ForwardCtx::eval()).unwrap();
        assert!(NoBackward.backward_input(&saved, &x).is_err());
        assert!(NoBackward.backward(&saved, &x, &mut []).is_err());
    }

    #[test]
    fn sampling_spreads_evenly_and_covers_small_tensors() {
        assert_eq!(sample(3, 8), [0, 1, 2]);
        assert_eq!(sample(10, 5), [0, 2, 4, 6, 8]);
    }
}
