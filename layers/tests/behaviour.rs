//! Behaviour tests: dropout seeding, shape and argument errors (never panics), PyTorch names and
//! layouts, default initialisation, costs, and half-precision Linear.
mod common;

use common::{random_values, tensor};
use conveyor_engine::{DType, Device, Error, ForwardCtx, Layer, Loss, Shape, Targets, Tensor, init};
use conveyor_layers::{
    Add, AvgPool2d, Conv2d, Conv2dOptions, CrossEntropyLoss, Dropout, Embedding, Flatten, Gelu, GlobalAvgPool2d, LayerNorm,
    Linear, MaxPool2d, Relu, Tanh,
};

fn host() -> Device {
    Device::host()
}

fn zeros(dims: &[usize]) -> Tensor {
    Tensor::zeros(dims.to_vec(), DType::F32, &host()).unwrap()
}

fn grads_for(layer: &dyn Layer) -> Vec<Tensor> {
    layer.parameters().iter().map(|p| Tensor::zeros(p.value.shape().clone(), DType::F32, &host()).unwrap()).collect()
}

#[test]
fn dropout_mask_is_a_function_of_the_seed() {
    let layer = Dropout::new(0.5).unwrap();
    let x = Tensor::full(1.0, [64, 64], DType::F32, &host()).unwrap();
    let (a, _) = layer.forward(&[&x], &ForwardCtx::train(7)).unwrap();
    let (b, _) = layer.forward(&[&x], &ForwardCtx::train(7)).unwrap();
    let (c, _) = layer.forward(&[&x], &ForwardCtx::train(8)).unwrap();
    assert!(a.bit_eq(&b), "same seed, same mask");
    assert!(!a.bit_eq(&c), "different seed, different mask");
    // Kept elements are scaled by 1/(1-p) = 2; about half are dropped.
    let values = a.to_vec_f32();
    assert!(values.iter().all(|&v| v == 0.0 || v == 2.0));
    let dropped = values.iter().filter(|&&v| v == 0.0).count() as f64 / values.len() as f64;
    assert!((dropped - 0.5).abs() < 0.03, "dropped fraction {dropped}");
    // Evaluation mode passes the input through.
    let (eval, saved) = layer.forward(&[&x], &ForwardCtx::eval()).unwrap();
    assert!(eval.bit_eq(&x) && saved.tensors.is_empty());
    // p = 1 drops everything; p outside [0, 1] is refused.
    let (all_dropped, _) = Dropout::new(1.0).unwrap().forward(&[&x], &ForwardCtx::train(1)).unwrap();
    assert!(all_dropped.to_vec_f32().iter().all(|&v| v == 0.0));
    assert!(matches!(Dropout::new(1.5), Err(Error::InvalidArgument { .. })));
    assert!(Dropout::new(f32::NAN).is_err());
}

#[test]
fn pytorch_parameter_names_and_layouts() {
    let mut rng = init::rng(0);
    let names_and_dims = |layer: &dyn Layer| -> Vec<(String, Vec<usize>)> {
        layer.parameters().iter().map(|p| (p.name.clone(), p.value.dims().to_vec())).collect()
    };
    let linear = Linear::new(3, 5, true, &mut rng).unwrap();
    assert_eq!(names_and_dims(&linear), [("weight".into(), vec![5, 3]), ("bias".into(), vec![5])]);
    let conv = Conv2d::new(2, 4, (3, 5), Conv2dOptions::default(), &mut rng).unwrap();
    assert_eq!(names_and_dims(&conv), [("weight".into(), vec![4, 2, 3, 5]), ("bias".into(), vec![4])]);
    let conv_no_bias = Conv2d::new(2, 4, (1, 1), Conv2dOptions { bias: false, ..Conv2dOptions::default() }, &mut rng).unwrap();
    assert_eq!(names_and_dims(&conv_no_bias), [("weight".into(), vec![4, 2, 1, 1])]);
    let norm = LayerNorm::new(6).unwrap();
    assert_eq!(names_and_dims(&norm), [("weight".into(), vec![6]), ("bias".into(), vec![6])]);
    assert!(norm.parameters()[0].value.to_vec_f32().iter().all(|&w| w == 1.0));
    assert!(norm.parameters()[1].value.to_vec_f32().iter().all(|&b| b == 0.0));
    let embedding = Embedding::new(10, 3, &mut rng).unwrap();
    assert_eq!(names_and_dims(&embedding), [("weight".into(), vec![10, 3])]);
    for layer in [&Relu::new() as &dyn Layer, &Gelu::new(), &Tanh::new(), &Flatten::new(), &Add::new(), &GlobalAvgPool2d::new()] {
        assert!(layer.parameters().is_empty(), "{} has no parameters", layer.kind());
    }
    assert_eq!((Relu::new().kind(), Gelu::new().kind()), ("ReLU", "GELU"));
}

#[test]
fn default_initialisation_is_seeded_and_bounded_by_one_over_sqrt_fan_in() {
    let a = Linear::new(100, 20, true, &mut init::rng(3)).unwrap();
    let b = Linear::new(100, 20, true, &mut init::rng(3)).unwrap();
    assert!(a.weight().bit_eq(b.weight()) && a.bias().unwrap().bit_eq(b.bias().unwrap()));
    assert!(a.weight().to_vec_f32().iter().chain(&a.bias().unwrap().to_vec_f32()).all(|w| w.abs() <= 0.1));
    // Conv2d: fan_in = in_channels · kh · kw = 4 · 5 · 5 = 100.
    let conv = Conv2d::new(4, 8, (5, 5), Conv2dOptions::default(), &mut init::rng(3)).unwrap();
    let weights = conv.weight().to_vec_f32();
    assert!(weights.iter().all(|w| w.abs() <= 0.1));
    assert!(weights.iter().any(|w| w.abs() > 0.09), "the bound is used, not a narrower one");
}

fn is_shape_error<T>(result: Result<T, Error>) -> bool {
    matches!(result, Err(Error::ShapeMismatch { .. }))
}

#[test]
fn shape_mismatches_are_errors_not_panics() {
    let mut rng = init::rng(1);
    let ctx = ForwardCtx::train(0);

    let linear = Linear::new(4, 3, true, &mut rng).unwrap();
    assert!(is_shape_error(linear.forward(&[&zeros(&[2, 5])], &ctx)));
    assert!(is_shape_error(linear.forward(&[&zeros(&[4])], &ctx)));
    assert!(is_shape_error(linear.output_shape(&[Shape::new([5])])));
    let (_, saved) = linear.forward(&[&zeros(&[2, 4])], &ctx).unwrap();
    assert!(is_shape_error(linear.backward_input(&saved, &zeros(&[2, 4]))));
    assert!(is_shape_error(linear.backward_weight(&saved, &zeros(&[3, 3]), &mut grads_for(&linear))));
    assert!(linear.backward_weight(&saved, &zeros(&[2, 3]), &mut grads_for(&linear)[..1]).is_err());
    assert!(is_shape_error(linear.backward_weight(&saved, &zeros(&[2, 3]), &mut [zeros(&[4, 3]), zeros(&[3])])));
    assert!(linear.forward(&[], &ctx).is_err());
    assert!(linear.backward_input(&Default::default(), &zeros(&[2, 3])).is_err());
    assert!(is_shape_error(Linear::from_parameters(zeros(&[3, 4]), Some(zeros(&[4]))).map(|_| ())));

    let conv = Conv2d::new(3, 2, (3, 3), Conv2dOptions::default(), &mut rng).unwrap();
    assert!(is_shape_error(conv.forward(&[&zeros(&[1, 2, 5, 5])], &ctx)), "wrong channel count");
    assert!(is_shape_error(conv.forward(&[&zeros(&[3, 5, 5])], &ctx)), "missing batch dim");
    assert!(is_shape_error(conv.forward(&[&zeros(&[1, 3, 2, 5])], &ctx)), "smaller than the kernel");
    assert!(is_shape_error(conv.output_shape(&[Shape::new([3, 2, 2])])));
    let (_, saved) = conv.forward(&[&zeros(&[1, 3, 5, 5])], &ctx).unwrap();
    assert!(is_shape_error(conv.backward_input(&saved, &zeros(&[1, 2, 4, 4]))));

    let pool = MaxPool2d::new((2, 2), (2, 2)).unwrap();
    assert!(is_shape_error(pool.forward(&[&zeros(&[1, 1, 1, 1])], &ctx)));
    assert!(is_shape_error(pool.forward(&[&zeros(&[4, 4])], &ctx)));
    let (_, saved) = pool.forward(&[&zeros(&[1, 1, 4, 4])], &ctx).unwrap();
    assert!(is_shape_error(pool.backward_input(&saved, &zeros(&[1, 1, 3, 2]))));
    assert!(MaxPool2d::with_padding((2, 2), (2, 2), (2, 0)).is_err(), "padding over half the kernel");
    assert!(MaxPool2d::new((0, 2), (1, 1)).is_err());
    assert!(is_shape_error(AvgPool2d::new((3, 3), (1, 1)).unwrap().forward(&[&zeros(&[1, 1, 2, 2])], &ctx)));
    assert!(is_shape_error(GlobalAvgPool2d::new().forward(&[&zeros(&[2, 3, 4])], &ctx)));

    assert!(is_shape_error(Add::new().forward(&[&zeros(&[2, 3]), &zeros(&[3, 2])], &ctx)));
    assert!(is_shape_error(Add::new().output_shape(&[Shape::new([3]), Shape::new([4])])));
    assert!(Add::new().forward(&[&zeros(&[2, 3])], &ctx).is_err(), "Add needs two inputs");
    assert!(is_shape_error(LayerNorm::new(4).unwrap().forward(&[&zeros(&[2, 5])], &ctx)));
    assert!(is_shape_error(
        Relu::new().backward_input(&Relu::new().forward(&[&zeros(&[2, 3])], &ctx).unwrap().1, &zeros(&[3, 2]))
    ));
    assert!(is_shape_error(
        Flatten::new().backward_input(&Flatten::new().forward(&[&zeros(&[2, 3, 4])], &ctx).unwrap().1, &zeros(&[2, 11]))
    ));
}

#[test]
fn bad_ids_and_labels_are_clear_errors() {
    let embedding = Embedding::new(5, 2, &mut init::rng(2)).unwrap();
    let ctx = ForwardCtx::train(0);
    let (output, _) = embedding.forward(&[&tensor(&[0.0, 4.0, 2.0, 2.0], &[2, 2])], &ctx).unwrap();
    assert_eq!(output.dims(), &[2, 2, 2]);
    for bad in [5.0, -1.0, 1.5, f64::NAN] {
        let err = embedding.forward(&[&tensor(&[0.0, bad], &[1, 2])], &ctx).unwrap_err();
        let message = err.to_string();
        assert!(message.contains("0..5") && message.contains("position 1"), "{message}");
    }

    let loss = CrossEntropyLoss::new();
    let logits = zeros(&[2, 3]);
    let message = loss.loss_and_grad(&logits, &Targets::Classes(vec![0, 3]), 2.0).unwrap_err().to_string();
    assert!(message.contains("label 3") && message.contains("3 classes"), "{message}");
    assert!(matches!(loss.loss_and_grad(&logits, &Targets::Classes(vec![0]), 2.0), Err(Error::ShapeMismatch { .. })));
    assert!(loss.loss_and_grad(&logits, &Targets::Classes(vec![0, 1]), 0.0).is_err());
    assert!(loss.loss_and_grad(&zeros(&[3]), &Targets::Classes(vec![0, 1, 2]), 1.0).is_err());
    // Uniform logits over 3 classes: loss ln 3 per row.
    let (value, _) = loss.loss_and_grad(&logits, &Targets::Classes(vec![0, 1]), 2.0).unwrap();
    assert!((value - 3f64.ln()).abs() < 1e-6);
}

#[test]
fn parameters_on_another_device_are_a_device_error() {
    let mut linear = Linear::new(4, 3, true, &mut init::rng(4)).unwrap();
    let stage = Device::cpu(0);
    linear.to_device(&stage).unwrap();
    assert!(matches!(linear.forward(&[&zeros(&[2, 4])], &ForwardCtx::eval()), Err(Error::DeviceMismatch { .. })));
    let x = Tensor::zeros([2, 4], DType::F32, &stage).unwrap();
    let (y, _) = linear.forward(&[&x], &ForwardCtx::eval()).unwrap();
    assert!(y.device().same_device(&stage), "outputs live on the input's device");
}

#[test]
fn costs_count_flops_and_bytes() {
    let mut rng = init::rng(5);
    let linear = Linear::new(1024, 512, true, &mut rng).unwrap();
    let cost = linear.cost(&[Shape::new([1024])]).unwrap();
    assert_eq!(cost.forward_flops_per_sample, 2 * 1024 * 512 + 512);
    assert_eq!(cost.backward_input_flops_per_sample, 2 * 1024 * 512);
    assert_eq!(cost.param_bytes, 4 * (1024 * 512 + 512));
    assert_eq!((cost.activation_bytes_per_sample, cost.output_bytes_per_sample), (4 * 1024, 4 * 512));
    let conv = Conv2d::new(3, 8, (3, 3), Conv2dOptions { stride: (2, 2), padding: (1, 1), bias: false }, &mut rng).unwrap();
    assert_eq!(conv.output_shape(&[Shape::new([3, 32, 32])]).unwrap().dims(), &[8, 16, 16]);
    let cost = conv.cost(&[Shape::new([3, 32, 32])]).unwrap();
    assert_eq!(cost.forward_flops_per_sample, 2 * 8 * 27 * 256);
    assert_eq!(cost.output_bytes_per_sample, 4 * 8 * 256);
    assert_eq!(Flatten::new().output_shape(&[Shape::new([8, 4, 4])]).unwrap().dims(), &[128]);
    assert_eq!(GlobalAvgPool2d::new().output_shape(&[Shape::new([8, 4, 4])]).unwrap().dims(), &[8]);
    assert_eq!(Embedding::new(10, 6, &mut rng).unwrap().output_shape(&[Shape::new([7])]).unwrap().dims(), &[7, 6]);
}

/// Asserts `|half - full| ≤ 4 · u · sqrt(n) · (|full| + ‖full‖∞)` elementwise.
fn assert_within_half_bound(what: &str, half: &Tensor, full: &Tensor, unit_roundoff: f64, n: usize) {
    let (half, full) = (half.to_vec_f32(), full.to_vec_f32());
    let scale = full.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
    let factor = 4.0 * unit_roundoff * (n as f64).sqrt();
    for (i, (h, f)) in half.iter().zip(&full).enumerate() {
        let bound = factor * ((*f as f64).abs() + scale);
        assert!(((h - f) as f64).abs() <= bound, "{what}[{i}]: {h} vs {f}, bound {bound}");
    }
}

/// f16 and bf16 Linear (input and parameters in the half format, computed in f32) against the f32
/// layer on the unrounded values: the rounding of inputs, parameters and output bounds the error by
/// `4 · u · sqrt(in_features) · (|y| + ‖y‖∞)`, u = 2⁻¹¹ (f16) or 2⁻⁸ (bf16).
#[test]
fn half_precision_linear_matches_f32_within_the_unit_roundoff_bound() {
    let (batch, in_features, out_features) = (8, 64, 32);
    let mut rng = init::rng(6);
    let full = Linear::new(in_features, out_features, true, &mut rng).unwrap();
    let x = tensor(&random_values(batch * in_features, -1.0, 1.0, &mut rng), &[batch, in_features]);
    let dy = tensor(&random_values(batch * out_features, -1.0, 1.0, &mut rng), &[batch, out_features]);
    let ctx = ForwardCtx::train(0);
    let (y_full, saved_full) = full.forward(&[&x], &ctx).unwrap();
    let dx_full = full.backward_input(&saved_full, &dy).unwrap().remove(0).unwrap();
    let mut grads_full = grads_for(&full);
    full.backward_weight(&saved_full, &dy, &mut grads_full).unwrap();

    for (dtype, unit_roundoff) in [(DType::F16, 2f64.powi(-11)), (DType::BF16, 2f64.powi(-8))] {
        let half =
            Linear::from_parameters(full.weight().to_dtype(dtype).unwrap(), Some(full.bias().unwrap().to_dtype(dtype).unwrap()))
                .unwrap();
        let (x_half, dy_half) = (x.to_dtype(dtype).unwrap(), dy.to_dtype(dtype).unwrap());
        let (y_half, saved) = half.forward(&[&x_half], &ctx).unwrap();
        assert_eq!(y_half.dtype(), dtype, "output in the input's dtype");
        assert_within_half_bound(&format!("{dtype} forward"), &y_half, &y_full, unit_roundoff, in_features);

        let dx_half = half.backward_input(&saved, &dy_half).unwrap().remove(0).unwrap();
        assert_eq!(dx_half.dtype(), dtype);
        assert_within_half_bound(&format!("{dtype} input gradient"), &dx_half, &dx_full, unit_roundoff, out_features);

        // f32 gradient buffers (mixed precision) and half ones both accumulate.
        let mut grads = grads_for(&half);
        half.backward_weight(&saved, &dy_half, &mut grads).unwrap();
        let mut half_grads: Vec<Tensor> = grads.iter().map(|g| g.to_dtype(dtype).unwrap()).collect();
        for g in &mut half_grads {
            g.fill_zero();
        }
        half.backward_weight(&saved, &dy_half, &mut half_grads).unwrap();
        for ((g, h), f) in grads.iter().zip(&half_grads).zip(&grads_full) {
            assert_within_half_bound(&format!("{dtype} weight gradient"), g, f, unit_roundoff, batch);
            assert_eq!(h.dtype(), dtype);
            assert_within_half_bound(&format!("{dtype} weight gradient (half buffer)"), h, f, unit_roundoff, batch);
        }
    }
}

#[test]
fn max_pool_saves_argmax_and_layers_accept_half_inputs() {
    let pool = MaxPool2d::new((2, 2), (2, 2)).unwrap();
    let x = tensor(&[1., 5., 2., 0., 3., 4., 8., 7., 0., 0., 1., 1., 9., 0., 1., 2.], &[1, 1, 4, 4]);
    let (y, saved) = pool.forward(&[&x], &ForwardCtx::eval()).unwrap();
    assert_eq!(y.to_vec_f32(), vec![5., 8., 9., 2.]);
    assert_eq!(saved.tensors[0].to_vec_f32(), vec![1., 6., 12., 15.]);
    // Every layer reads f16 and answers in f16.
    let x16 = x.to_dtype(DType::F16).unwrap();
    for layer in [&pool as &dyn Layer, &Relu::new(), &Gelu::new(), &Tanh::new(), &GlobalAvgPool2d::new(), &Flatten::new()] {
        let (y, saved) = layer.forward(&[&x16], &ForwardCtx::eval()).unwrap();
        assert_eq!(y.dtype(), DType::F16, "{}", layer.kind());
        let dy = Tensor::full(1.0, y.shape().clone(), DType::F16, &host()).unwrap();
        assert_eq!(layer.backward_input(&saved, &dy).unwrap()[0].as_ref().unwrap().dtype(), DType::F16, "{}", layer.kind());
    }
}
