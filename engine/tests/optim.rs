//! Optimizers and clipping against torch: a committed torch.optim fixture (made by
//! `fixtures/make_optim_fixture.py`), an independent f64 reference written from torch's formulas,
//! hand-computed values, validation errors, and the all-or-nothing contract of `step`.
//!
//! Tolerance, used everywhere below: `|actual − expected| ≤ 1e-6 · max(|expected|, scale)`, where
//! `scale` is the largest `|expected|` in the same tensor. That is 1e-6 relative for every element
//! of the tensor's own magnitude, and an absolute floor for elements that cancel towards zero
//! (f32 rounds at about 6e-8 of the operands, not of the result).
use conveyor_engine::optim::{
    AdamConfig, Optimizer, OptimizerConfig, SgdConfig, clip_grad_norm, clip_grads_with_norm, grad_sum_of_squares,
    total_norm_from_sums_of_squares,
};
use conveyor_engine::{DType, Device, Error, Tensor};
use serde_json::Value;

const RELATIVE_TOLERANCE: f64 = 1e-6;

fn assert_close(what: &str, actual: &[f32], expected: &[f64]) {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    let scale = expected.iter().fold(0.0f64, |m, e| m.max(e.abs()));
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let bound = RELATIVE_TOLERANCE * e.abs().max(scale);
        let a = f64::from(a);
        assert!((a - e).abs() <= bound, "{what}[{i}]: got {a}, expected {e} (|diff| {} > {bound})", (a - e).abs());
    }
}

// ---------------------------------------------------------------------------------------------
// An independent f64 reference, written from torch's documented formulas (not from the engine).
// ---------------------------------------------------------------------------------------------

#[derive(Default, Clone)]
struct ReferenceState {
    step: u64,
    momentum_buffer: Option<Vec<f64>>,
    exp_avg: Vec<f64>,
    exp_avg_sq: Vec<f64>,
}

fn reference_step(config: &OptimizerConfig, p: &mut [f64], grad: &[f64], state: &mut ReferenceState) {
    state.step += 1;
    match config {
        OptimizerConfig::Sgd(c) => {
            let mut g: Vec<f64> = grad.iter().zip(p.iter()).map(|(g, p)| g + c.weight_decay * p).collect();
            if c.momentum != 0.0 {
                let buf = match state.momentum_buffer.take() {
                    None => g.clone(),
                    Some(buf) => buf.iter().zip(&g).map(|(b, g)| c.momentum * b + (1.0 - c.dampening) * g).collect(),
                };
                g = if c.nesterov {
                    g.iter().zip(&buf).map(|(g, b)| g + c.momentum * b).collect()
                } else {
                    buf.clone()
                };
                state.momentum_buffer = Some(buf);
            }
            p.iter_mut().zip(&g).for_each(|(p, g)| *p -= c.lr * g);
        }
        OptimizerConfig::Adam(c) | OptimizerConfig::AdamW(c) => {
            let decoupled = matches!(config, OptimizerConfig::AdamW(_));
            if state.exp_avg.is_empty() {
                state.exp_avg = vec![0.0; p.len()];
                state.exp_avg_sq = vec![0.0; p.len()];
            }
            let t = state.step as f64;
            let bias_correction1 = 1.0 - c.beta1.powf(t);
            let bias_correction2 = 1.0 - c.beta2.powf(t);
            for i in 0..p.len() {
                let mut g = grad[i];
                if decoupled {
                    p[i] *= 1.0 - c.lr * c.weight_decay;
                } else {
                    g += c.weight_decay * p[i];
                }
                state.exp_avg[i] = c.beta1 * state.exp_avg[i] + (1.0 - c.beta1) * g;
                state.exp_avg_sq[i] = c.beta2 * state.exp_avg_sq[i] + (1.0 - c.beta2) * g * g;
                let denom = state.exp_avg_sq[i].sqrt() / bias_correction2.sqrt() + c.eps;
                p[i] -= c.lr / bias_correction1 * state.exp_avg[i] / denom;
            }
        }
    }
}

/// Seeded inputs: a splitmix64 stream mapped to [-1, 1), scaled per step so Adam sees a spread.
fn seeded_values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn run_against_reference(config: OptimizerConfig) {
    let device = Device::cpu(0);
    let shapes: [&[usize]; 2] = [&[3, 4], &[5]];
    let mut params: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            Tensor::from_vec(seeded_values(i as u64, shape.iter().product(), 1.0), *shape, &device).unwrap()
        })
        .collect();
    let mut reference_params: Vec<Vec<f64>> =
        params.iter().map(|p| p.as_f32().unwrap().iter().map(|&x| f64::from(x)).collect()).collect();
    let mut reference_states = vec![ReferenceState::default(); params.len()];
    let mut optimizer = Optimizer::new(config, params.len()).unwrap();
    for (step, scale) in [1.0, 0.01, 5.0, 0.3, 2.0, 1e-3].into_iter().enumerate() {
        let grads: Vec<Tensor> = params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                Tensor::from_vec(seeded_values(100 + 10 * step as u64 + i as u64, p.numel(), scale), p.dims(), &device)
                    .unwrap()
            })
            .collect();
        let mut param_refs: Vec<&mut Tensor> = params.iter_mut().collect();
        let grad_refs: Vec<&Tensor> = grads.iter().collect();
        optimizer.step(&mut param_refs, &grad_refs).unwrap();
        for (i, grad) in grads.iter().enumerate() {
            let grad: Vec<f64> = grad.as_f32().unwrap().iter().map(|&x| f64::from(x)).collect();
            reference_step(&config, &mut reference_params[i], &grad, &mut reference_states[i]);
            assert_close(
                &format!("{config:?} step {} param {i}", step + 1),
                params[i].as_f32().unwrap(),
                &reference_params[i],
            );
        }
    }
    for (i, reference) in reference_states.iter().enumerate() {
        let state = optimizer.state(i).unwrap();
        assert_eq!(state.step(), 6);
        if let Some(buf) = &reference.momentum_buffer {
            assert_close("momentum_buffer", state.momentum_buffer().unwrap().as_f32().unwrap(), buf);
        }
        if !reference.exp_avg.is_empty() {
            assert_close("exp_avg", state.exp_avg().unwrap().as_f32().unwrap(), &reference.exp_avg);
            assert_close("exp_avg_sq", state.exp_avg_sq().unwrap().as_f32().unwrap(), &reference.exp_avg_sq);
        }
    }
}

#[test]
fn sgd_plain_matches_reference() {
    run_against_reference(SgdConfig::new(0.1).into());
}

#[test]
fn sgd_weight_decay_matches_reference() {
    run_against_reference(SgdConfig::new(0.05).with_weight_decay(0.1).into());
}

#[test]
fn sgd_momentum_matches_reference() {
    run_against_reference(SgdConfig::new(0.1).with_momentum(0.9).into());
}

#[test]
fn sgd_momentum_dampening_weight_decay_matches_reference() {
    run_against_reference(SgdConfig::new(0.02).with_momentum(0.7).with_dampening(0.4).with_weight_decay(0.03).into());
}

#[test]
fn sgd_nesterov_weight_decay_matches_reference() {
    run_against_reference(SgdConfig::new(0.1).with_momentum(0.9).with_nesterov(true).with_weight_decay(0.01).into());
}

#[test]
fn adam_matches_reference() {
    run_against_reference(OptimizerConfig::adam(1e-2));
}

#[test]
fn adam_l2_weight_decay_matches_reference() {
    run_against_reference(OptimizerConfig::Adam(
        AdamConfig::adam(3e-3).with_betas(0.8, 0.99).with_eps(1e-6).with_weight_decay(0.05),
    ));
}

#[test]
fn adamw_matches_reference() {
    run_against_reference(OptimizerConfig::AdamW(AdamConfig::adamw(1e-2).with_weight_decay(0.1)));
}

#[test]
fn adamw_with_small_beta1_matches_reference() {
    // 1 − β1 ≥ 0.5 takes torch's other lerp branch.
    run_against_reference(OptimizerConfig::AdamW(AdamConfig::adamw(1e-2).with_betas(0.3, 0.999)));
}

// ---------------------------------------------------------------------------------------------
// Hand-computed values.
// ---------------------------------------------------------------------------------------------

#[test]
fn sgd_momentum_two_steps_by_hand() {
    // lr 0.5, μ 0.5, p 1: step 1 buf = g = 2, p = 1 − 0.5·2 = 0; step 2 g = 4, buf = 0.5·2 + 4 = 5,
    // p = 0 − 0.5·5 = −2.5. With Nesterov step 1 moves by g + μ·buf = 3: p = −0.5.
    let device = Device::cpu(0);
    let mut p = Tensor::from_slice(&[1.0], [1], &device).unwrap();
    let mut optimizer = Optimizer::new(SgdConfig::new(0.5).with_momentum(0.5), 1).unwrap();
    optimizer.step(&mut [&mut p], &[&Tensor::from_slice(&[2.0], [1], &device).unwrap()]).unwrap();
    assert_eq!(p.as_f32().unwrap(), &[0.0]);
    optimizer.step(&mut [&mut p], &[&Tensor::from_slice(&[4.0], [1], &device).unwrap()]).unwrap();
    assert_eq!(p.as_f32().unwrap(), &[-2.5]);
    assert_eq!(optimizer.state(0).unwrap().momentum_buffer().unwrap().as_f32().unwrap(), &[5.0]);

    let mut p = Tensor::from_slice(&[1.0], [1], &device).unwrap();
    let mut nesterov = Optimizer::new(SgdConfig::new(0.5).with_momentum(0.5).with_nesterov(true), 1).unwrap();
    nesterov.step(&mut [&mut p], &[&Tensor::from_slice(&[2.0], [1], &device).unwrap()]).unwrap();
    assert_eq!(p.as_f32().unwrap(), &[-0.5]);
}

#[test]
fn adam_first_step_moves_each_parameter_by_lr() {
    // After one step m̂ = g and v̂ = g², so the update is lr·g/(|g| + eps) ≈ lr·sign(g).
    let device = Device::cpu(0);
    let mut p = Tensor::from_slice(&[1.0, 1.0, 1.0], [3], &device).unwrap();
    let g = Tensor::from_slice(&[0.25, -3.0, 1e-3], [3], &device).unwrap();
    let mut optimizer = Optimizer::new(OptimizerConfig::adam(0.01), 1).unwrap();
    optimizer.step(&mut [&mut p], &[&g]).unwrap();
    let expected: Vec<f64> = [0.25f64, -3.0, 1e-3].iter().map(|g| 1.0 - 0.01 * g / (g.abs() + 1e-8)).collect();
    assert_close("adam first step", p.as_f32().unwrap(), &expected);
}

#[test]
fn adamw_decays_a_parameter_with_zero_gradient() {
    // g = 0: m = v = 0, so only the decoupled decay acts: p = 2·(1 − 0.1·0.5) = 1.9. Adam's L2
    // decay instead turns into a gradient 0.5·2 = 1 and moves p by lr: 2 − 0.1 = 1.9 as well, but
    // with state m ≠ 0.
    let device = Device::cpu(0);
    let zero = Tensor::zeros([1], DType::F32, &device).unwrap();
    let mut p = Tensor::from_slice(&[2.0], [1], &device).unwrap();
    let mut adamw = Optimizer::new(OptimizerConfig::AdamW(AdamConfig::adamw(0.1).with_weight_decay(0.5)), 1).unwrap();
    adamw.step(&mut [&mut p], &[&zero]).unwrap();
    assert_close("adamw decay", p.as_f32().unwrap(), &[1.9]);
    assert_eq!(adamw.state(0).unwrap().exp_avg().unwrap().as_f32().unwrap(), &[0.0]);

    let mut p = Tensor::from_slice(&[2.0], [1], &device).unwrap();
    let mut adam = Optimizer::new(OptimizerConfig::Adam(AdamConfig::adam(0.1).with_weight_decay(0.5)), 1).unwrap();
    adam.step(&mut [&mut p], &[&zero]).unwrap();
    assert_close("adam l2", p.as_f32().unwrap(), &[1.9]);
    assert_close("adam l2 exp_avg", adam.state(0).unwrap().exp_avg().unwrap().as_f32().unwrap(), &[0.1]);
}

// ---------------------------------------------------------------------------------------------
// The torch.optim fixture.
// ---------------------------------------------------------------------------------------------

fn floats(value: &Value) -> Vec<f64> {
    value.as_array().expect("array").iter().map(|x| x.as_f64().expect("number")).collect()
}

fn fixture_config(case: &Value) -> OptimizerConfig {
    let hyper = &case["hyper"];
    let get = |key: &str, default: f64| hyper.get(key).and_then(Value::as_f64).unwrap_or(default);
    let betas = hyper.get("betas").map(floats).unwrap_or_else(|| vec![0.9, 0.999]);
    match case["optimizer"].as_str().unwrap() {
        "SGD" => SgdConfig {
            lr: get("lr", 0.0),
            momentum: get("momentum", 0.0),
            dampening: get("dampening", 0.0),
            nesterov: hyper.get("nesterov").and_then(Value::as_bool).unwrap_or(false),
            weight_decay: get("weight_decay", 0.0),
        }
        .into(),
        "Adam" => OptimizerConfig::Adam(AdamConfig {
            lr: get("lr", 1e-3),
            beta1: betas[0],
            beta2: betas[1],
            eps: get("eps", 1e-8),
            weight_decay: get("weight_decay", 0.0),
        }),
        "AdamW" => OptimizerConfig::AdamW(AdamConfig {
            lr: get("lr", 1e-3),
            beta1: betas[0],
            beta2: betas[1],
            eps: get("eps", 1e-8),
            weight_decay: get("weight_decay", 1e-2),
        }),
        other => panic!("unknown optimizer {other} in fixture"),
    }
}

#[test]
fn optimizers_match_torch_fixture() {
    let fixture: Value = serde_json::from_str(include_str!("fixtures/optim_torch_reference.json")).unwrap();
    let device = Device::cpu(0);
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 5);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let config = fixture_config(case);
        let shapes: Vec<Vec<usize>> = case["shapes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| floats(s).iter().map(|&d| d as usize).collect())
            .collect();
        let mut params: Vec<Tensor> = case["params_initial"]
            .as_array()
            .unwrap()
            .iter()
            .zip(&shapes)
            .map(|(values, shape)| {
                Tensor::from_vec(floats(values).iter().map(|&x| x as f32).collect(), shape.clone(), &device).unwrap()
            })
            .collect();
        let mut optimizer = Optimizer::new(config, params.len()).unwrap();
        let steps = case["grads"].as_array().unwrap().iter().zip(case["params_after"].as_array().unwrap());
        for (step, (grads, expected_params)) in steps.enumerate() {
            let grads: Vec<Tensor> = grads
                .as_array()
                .unwrap()
                .iter()
                .zip(&shapes)
                .map(|(values, shape)| {
                    Tensor::from_vec(floats(values).iter().map(|&x| x as f32).collect(), shape.clone(), &device)
                        .unwrap()
                })
                .collect();
            let mut param_refs: Vec<&mut Tensor> = params.iter_mut().collect();
            optimizer.step(&mut param_refs, &grads.iter().collect::<Vec<_>>()).unwrap();
            for (i, expected) in expected_params.as_array().unwrap().iter().enumerate() {
                assert_close(
                    &format!("{name} step {} param {i}", step + 1),
                    params[i].as_f32().unwrap(),
                    &floats(expected),
                );
            }
        }
        for (i, expected_state) in case["final_state"].as_array().unwrap().iter().enumerate() {
            let state = optimizer.state(i).unwrap();
            let fields = expected_state.as_object().unwrap();
            if let Some(step) = fields.get("step") {
                assert_eq!(state.step() as f64, step.as_f64().unwrap(), "{name} param {i} step");
            }
            for (key, actual) in [
                ("momentum_buffer", state.momentum_buffer()),
                ("exp_avg", state.exp_avg()),
                ("exp_avg_sq", state.exp_avg_sq()),
            ] {
                match (fields.get(key), actual) {
                    (Some(expected), Some(actual)) => {
                        assert_close(&format!("{name} param {i} {key}"), actual.as_f32().unwrap(), &floats(expected))
                    }
                    (None, None) => {}
                    (expected, actual) => panic!(
                        "{name} param {i} {key}: torch has it: {}, we have it: {}",
                        expected.is_some(),
                        actual.is_some()
                    ),
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Validation and the all-or-nothing step.
// ---------------------------------------------------------------------------------------------

fn invalid_argument(config: impl Into<OptimizerConfig>) -> (String, String) {
    match Optimizer::new(config, 1).unwrap_err() {
        Error::InvalidArgument { name, reason } => (name, reason),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn invalid_hyperparameters_are_refused_with_torch_messages() {
    let (name, reason) = invalid_argument(SgdConfig::new(-0.1));
    assert_eq!(name, "lr");
    assert!(reason.contains("Invalid learning rate: -0.1"), "{reason}");
    let (name, reason) = invalid_argument(SgdConfig::new(0.1).with_weight_decay(-1.0));
    assert_eq!(name, "weight_decay");
    assert!(reason.contains("Invalid weight_decay value: -1"), "{reason}");
    let (name, _) = invalid_argument(SgdConfig::new(0.1).with_momentum(-0.5));
    assert_eq!(name, "momentum");
    let (name, reason) = invalid_argument(SgdConfig::new(0.1).with_nesterov(true));
    assert_eq!(name, "nesterov");
    assert!(reason.contains("Nesterov momentum requires a momentum and zero dampening"), "{reason}");
    let (name, _) = invalid_argument(SgdConfig::new(0.1).with_momentum(0.9).with_dampening(0.1).with_nesterov(true));
    assert_eq!(name, "nesterov");
    let (name, _) = invalid_argument(SgdConfig::new(f64::NAN));
    assert_eq!(name, "lr");

    let (name, reason) = invalid_argument(OptimizerConfig::Adam(AdamConfig::adam(1e-3).with_betas(1.0, 0.999)));
    assert_eq!(name, "betas[0]");
    assert!(reason.contains("Invalid beta parameter at index 0: 1"), "{reason}");
    let (name, _) = invalid_argument(OptimizerConfig::AdamW(AdamConfig::adamw(1e-3).with_betas(0.9, -0.1)));
    assert_eq!(name, "betas[1]");
    let (name, reason) = invalid_argument(OptimizerConfig::Adam(AdamConfig::adam(1e-3).with_eps(-1e-8)));
    assert_eq!(name, "eps");
    assert!(reason.contains("Invalid epsilon value"), "{reason}");
    let (name, _) = invalid_argument(OptimizerConfig::AdamW(AdamConfig::adamw(-1.0)));
    assert_eq!(name, "lr");
    let (name, _) = invalid_argument(OptimizerConfig::Adam(AdamConfig::adam(1e-3).with_weight_decay(-0.1)));
    assert_eq!(name, "weight_decay");

    // Edge values torch accepts.
    assert!(Optimizer::new(OptimizerConfig::Adam(AdamConfig::adam(0.0).with_betas(0.0, 0.0).with_eps(0.0)), 1).is_ok());
}

#[test]
fn set_lr_refuses_a_negative_rate_and_keeps_the_old_one() {
    let mut optimizer = Optimizer::new(OptimizerConfig::adamw(1e-3), 2).unwrap();
    optimizer.set_lr(5e-4).unwrap();
    assert_eq!(optimizer.lr(), 5e-4);
    assert!(matches!(optimizer.set_lr(-1.0), Err(Error::InvalidArgument { .. })));
    assert_eq!(optimizer.lr(), 5e-4);
}

#[test]
fn bad_operands_leave_every_parameter_and_state_untouched() {
    let device = Device::cpu(0);
    let other_device = Device::cpu(1);
    let mut a = Tensor::from_slice(&[1.0, 2.0], [2], &device).unwrap();
    let mut b = Tensor::from_slice(&[3.0, 4.0, 5.0], [3], &device).unwrap();
    let grad_a = Tensor::from_slice(&[1.0, 1.0], [2], &device).unwrap();
    let mut optimizer = Optimizer::new(OptimizerConfig::adam(0.1), 2).unwrap();

    // Wrong count.
    let err = optimizer.step(&mut [&mut a], &[&grad_a]).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { reason, .. } if reason.contains("built for 2 parameter tensors")),
        "{err}"
    );
    // Wrong shape in the second parameter: the first must not move either.
    let wrong_shape = Tensor::from_slice(&[1.0, 1.0], [2], &device).unwrap();
    let err = optimizer.step(&mut [&mut a, &mut b], &[&grad_a, &wrong_shape]).unwrap_err();
    assert!(matches!(&err, Error::ShapeMismatch { op, .. } if op.contains("parameter 1")), "{err}");
    // Wrong dtype.
    let half = Tensor::zeros([3], DType::F16, &device).unwrap();
    let err = optimizer.step(&mut [&mut a, &mut b], &[&grad_a, &half]).unwrap_err();
    assert!(matches!(err, Error::UnsupportedDType { dtype: DType::F16, .. }), "{err}");
    // Wrong device.
    let elsewhere = Tensor::zeros([3], DType::F32, &other_device).unwrap();
    let err = optimizer.step(&mut [&mut a, &mut b], &[&grad_a, &elsewhere]).unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { .. }), "{err}");
    // Index out of range for the per-parameter form.
    assert!(matches!(optimizer.update(2, &mut a, &grad_a), Err(Error::InvalidArgument { .. })));

    assert_eq!(a.as_f32().unwrap(), &[1.0, 2.0]);
    assert_eq!(b.as_f32().unwrap(), &[3.0, 4.0, 5.0]);
    assert_eq!(optimizer.state(0).unwrap().step(), 0);
}

#[test]
fn state_lives_on_the_parameter_device_and_counts_against_its_budget() {
    for (config, ratio) in [
        (OptimizerConfig::sgd(0.1), 0u64),
        (SgdConfig::new(0.1).with_momentum(0.9).into(), 1),
        (OptimizerConfig::adam(0.1), 2),
        (OptimizerConfig::adamw(0.1), 2),
    ] {
        assert_eq!(config.state_bytes_per_param_byte(), ratio, "{config:?}");
        let param_device = Device::cpu(1);
        let grad_device = param_device.clone();
        let mut param = Tensor::zeros([10], DType::F32, &param_device).unwrap();
        let grad = Tensor::full(1.0, [10], DType::F32, &grad_device).unwrap();
        let before = param_device.memory_in_use();
        let mut optimizer = Optimizer::new(config, 1).unwrap();
        optimizer.step(&mut [&mut param], &[&grad]).unwrap();
        assert_eq!(param_device.memory_in_use() - before, ratio * 40, "{config:?}");
        assert_eq!(optimizer.state_size_in_bytes() as u64, ratio * 40);
        optimizer.reset_state();
        assert_eq!(param_device.memory_in_use(), before);
    }

    // Adam needs 80 more bytes per 40-byte parameter. With a budget of 200 and two parameters plus
    // their gradients (160 bytes), the first parameter's state fits only halfway: the step must fail
    // with OutOfDeviceMemory, free what it allocated, and move nothing.
    let device = Device::cpu_with_budget(2, Some(200));
    let mut a = Tensor::from_vec(vec![1.0; 10], [10], &device).unwrap();
    let mut b = Tensor::from_vec(vec![2.0; 10], [10], &device).unwrap();
    let grad_a = Tensor::from_vec(vec![1.0; 10], [10], &device).unwrap();
    let grad_b = Tensor::from_vec(vec![1.0; 10], [10], &device).unwrap();
    let mut optimizer = Optimizer::new(OptimizerConfig::adam(0.1), 2).unwrap();
    let err = optimizer.step(&mut [&mut a, &mut b], &[&grad_a, &grad_b]).unwrap_err();
    assert!(matches!(err, Error::OutOfDeviceMemory { requested: 40, .. }), "{err}");
    assert_eq!(device.memory_in_use(), 160);
    assert_eq!(optimizer.state_size_in_bytes(), 0);
    assert_eq!(a.as_f32().unwrap(), &[1.0; 10]);
    assert_eq!(b.as_f32().unwrap(), &[2.0; 10]);
}

// ---------------------------------------------------------------------------------------------
// Gradient-norm clipping.
// ---------------------------------------------------------------------------------------------

#[test]
fn clip_grad_norm_scales_by_max_norm_over_total_norm() {
    // Two gradients with squares 9 + 16 + 144 = 169: total norm 13. max_norm 6.5 gives
    // clip_coef = 6.5 / (13 + 1e-6), just under 0.5.
    let device = Device::cpu(0);
    let mut a = Tensor::from_slice(&[3.0, 4.0], [2], &device).unwrap();
    let mut b = Tensor::from_slice(&[12.0], [1], &device).unwrap();
    let total_norm = clip_grad_norm(&mut [&mut a, &mut b], 6.5).unwrap();
    assert_eq!(total_norm, 13.0);
    let coef = 6.5 / (13.0 + 1e-6);
    assert_close("a", a.as_f32().unwrap(), &[3.0 * coef, 4.0 * coef]);
    assert_close("b", b.as_f32().unwrap(), &[12.0 * coef]);
}

#[test]
fn clip_grad_norm_leaves_small_gradients_alone() {
    let device = Device::cpu(0);
    let mut a = Tensor::from_slice(&[0.3, -0.4], [2], &device).unwrap();
    let total_norm = clip_grad_norm(&mut [&mut a], 1.0).unwrap();
    assert!((total_norm - 0.5).abs() < 1e-7);
    assert_eq!(a.as_f32().unwrap(), &[0.3, -0.4]);
    // Zero gradients: the 1e-6 keeps the coefficient finite and nothing changes.
    let mut zero = Tensor::zeros([3], DType::F32, &device).unwrap();
    assert_eq!(clip_grad_norm(&mut [&mut zero], 1.0).unwrap(), 0.0);
    assert_eq!(zero.as_f32().unwrap(), &[0.0; 3]);
}

#[test]
fn two_phase_clipping_across_stages_equals_one_phase() {
    let device = Device::cpu(0);
    let values: Vec<Vec<f32>> = (0..4).map(|i| seeded_values(i, 7, 3.0)).collect();
    let make = |v: &Vec<f32>| Tensor::from_slice(v, [7], &device).unwrap();
    let mut whole: Vec<Tensor> = values.iter().map(make).collect();
    let mut whole_refs: Vec<&mut Tensor> = whole.iter_mut().collect();
    let one_phase_norm = clip_grad_norm(&mut whole_refs, 1.0).unwrap();

    // Two stages holding two gradients each.
    let mut stage0: Vec<Tensor> = values[..2].iter().map(make).collect();
    let mut stage1: Vec<Tensor> = values[2..].iter().map(make).collect();
    let sums = [
        grad_sum_of_squares(&stage0.iter().collect::<Vec<_>>()).unwrap(),
        grad_sum_of_squares(&stage1.iter().collect::<Vec<_>>()).unwrap(),
    ];
    let total_norm = total_norm_from_sums_of_squares(&sums);
    assert!((total_norm - one_phase_norm).abs() <= 1e-12 * one_phase_norm);
    let coef0 = clip_grads_with_norm(&mut stage0.iter_mut().collect::<Vec<_>>(), 1.0, total_norm).unwrap();
    let coef1 = clip_grads_with_norm(&mut stage1.iter_mut().collect::<Vec<_>>(), 1.0, total_norm).unwrap();
    assert_eq!(coef0, coef1);
    assert!(coef0 < 1.0);
    for (two_phase, one_phase) in stage0.iter().chain(&stage1).zip(&whole) {
        assert!(two_phase.bit_eq(one_phase));
    }
}

#[test]
fn clipping_refuses_a_bad_limit_and_non_f32_gradients() {
    let device = Device::cpu(0);
    let mut a = Tensor::from_slice(&[3.0, 4.0], [2], &device).unwrap();
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        let err = clip_grad_norm(&mut [&mut a], bad).unwrap_err();
        assert!(matches!(&err, Error::InvalidArgument { name, .. } if name == "max_norm"), "{err}");
    }
    let mut half = Tensor::zeros([2], DType::F16, &device).unwrap();
    let err = clip_grad_norm(&mut [&mut a, &mut half], 1.0).unwrap_err();
    assert!(matches!(err, Error::UnsupportedDType { dtype: DType::F16, .. }), "{err}");
    assert_eq!(a.as_f32().unwrap(), &[3.0, 4.0]);
}
