//! Gradient checks: every layer's forward pass against an f64 reference written here, and its
//! analytic input and weight gradients against central finite differences of that reference.
//! The tolerance is `|a - r| ≤ 1e-3 · (|r| + ‖r‖∞) + 1e-6` (see `common::assert_close` and the
//! crate docs for why).
mod common;

use common::{Input, check_layer, distinct_values, random_values, tensor, to_f64, values_away_from_zero};
use conveyor_engine::{ForwardCtx, Layer, Loss, Targets, Tensor, init};
use conveyor_layers::{
    Add, AvgPool2d, Conv2d, Conv2dOptions, CrossEntropyLoss, Dropout, Embedding, Flatten, Gelu, GeluTanh,
    GlobalAvgPool2d, LayerNorm, Linear, MaxPool2d, Relu, Tanh,
};

fn train() -> ForwardCtx {
    ForwardCtx::train(0)
}

/// `y[r, o] = Σ_i x[r, i] · w[o, i] + b[o]` over rows `r` of the flattened leading dims.
fn linear_reference(in_features: usize, out_features: usize) -> impl Fn(&[Vec<f64>], &[Vec<f64>]) -> Vec<f64> {
    move |inputs, params| {
        let x = &inputs[0];
        let rows = x.len() / in_features;
        let mut y = vec![0.0; rows * out_features];
        for r in 0..rows {
            for o in 0..out_features {
                let dot: f64 = (0..in_features).map(|i| x[r * in_features + i] * params[0][o * in_features + i]).sum();
                y[r * out_features + o] = dot + params.get(1).map_or(0.0, |b| b[o]);
            }
        }
        y
    }
}

#[test]
fn linear_gradients_match_finite_differences() {
    let mut rng = init::rng(1);
    let layer = Linear::new(5, 4, true, &mut rng).unwrap();
    // A rank-3 input [batch, tokens, in]: the layer acts on the last dimension.
    let x = Input::new(random_values(2 * 3 * 5, -1.0, 1.0, &mut rng), &[2, 3, 5]);
    check_layer("Linear", &layer, &[x], train(), &linear_reference(5, 4), 10);

    let no_bias = Linear::new(6, 3, false, &mut rng).unwrap();
    assert_eq!(no_bias.parameters().len(), 1);
    let x = Input::new(random_values(4 * 6, -2.0, 2.0, &mut rng), &[4, 6]);
    check_layer("Linear without bias", &no_bias, &[x], train(), &linear_reference(6, 3), 11);
}

/// Direct convolution by its definition: `y[n, o, i, j] = b[o] + Σ_{c, p, q} w[o, c, p, q] ·
/// x[n, c, i·s_h + p - pad_h, j·s_w + q - pad_w]` (zero outside the input).
fn conv2d_reference(
    input_dims: [usize; 4],
    weight_dims: [usize; 4],
    stride: (usize, usize),
    padding: (usize, usize),
) -> impl Fn(&[Vec<f64>], &[Vec<f64>]) -> Vec<f64> {
    move |inputs, params| {
        let [n, c, h, w] = input_dims;
        let [o, _, kh, kw] = weight_dims;
        let oh = (h + 2 * padding.0 - kh) / stride.0 + 1;
        let ow = (w + 2 * padding.1 - kw) / stride.1 + 1;
        let (x, weight) = (&inputs[0], &params[0]);
        let mut y = Vec::with_capacity(n * o * oh * ow);
        for b in 0..n {
            for oc in 0..o {
                for i in 0..oh {
                    for j in 0..ow {
                        let mut sum = params.get(1).map_or(0.0, |bias| bias[oc]);
                        for ic in 0..c {
                            for p in 0..kh {
                                for q in 0..kw {
                                    let r = (i * stride.0 + p) as isize - padding.0 as isize;
                                    let s = (j * stride.1 + q) as isize - padding.1 as isize;
                                    if r >= 0 && s >= 0 && (r as usize) < h && (s as usize) < w {
                                        let xv = x[((b * c + ic) * h + r as usize) * w + s as usize];
                                        sum += weight[((oc * c + ic) * kh + p) * kw + q] * xv;
                                    }
                                }
                            }
                        }
                        y.push(sum);
                    }
                }
            }
        }
        y
    }
}

#[test]
fn conv2d_gradients_match_finite_differences() {
    let mut rng = init::rng(2);
    // (in, out, kernel, stride, padding, bias, input H x W)
    let configs = [
        (2, 3, (3, 3), (2, 2), (1, 1), true, (5, 6)),
        (3, 2, (2, 3), (1, 2), (1, 0), false, (4, 5)),
        (3, 4, (1, 1), (1, 1), (0, 0), true, (3, 3)),
        (1, 2, (3, 3), (1, 1), (0, 0), true, (3, 3)),
    ];
    for (seed, (in_ch, out_ch, kernel, stride, padding, bias, (h, w))) in configs.into_iter().enumerate() {
        let options = Conv2dOptions { stride, padding, bias };
        let layer = Conv2d::new(in_ch, out_ch, kernel, options, &mut rng).unwrap();
        let x = Input::new(random_values(2 * in_ch * h * w, -1.0, 1.0, &mut rng), &[2, in_ch, h, w]);
        let reference = conv2d_reference([2, in_ch, h, w], [out_ch, in_ch, kernel.0, kernel.1], stride, padding);
        check_layer(
            &format!("Conv2d {kernel:?} stride {stride:?} padding {padding:?}"),
            &layer,
            &[x],
            train(),
            &reference,
            20 + seed as u64,
        );
    }
}

/// Every stride (1, 2), padding (0, 1) and kernel (1, 3, 5) pairing, with 1, 3, 8 and 16 channels
/// on either side: stride 1 with padding at most k - 1 takes the gather-form input gradient, the
/// rest col2im; output widths 4 and 8 take im2col's fixed-width copies, the others its general rows.
#[test]
fn conv2d_gradients_over_strides_paddings_kernels_and_channels() {
    let mut rng = init::rng(5);
    // (in, out, kernel, stride, padding, input H x W)
    let configs = [
        (1, 3, 1, 1, 0, (4, 5)),
        (3, 1, 1, 2, 1, (5, 4)),
        (16, 8, 1, 1, 1, (3, 3)),
        (8, 16, 1, 2, 0, (4, 4)),
        (1, 8, 3, 1, 1, (6, 7)),
        (3, 16, 3, 1, 0, (4, 10)),
        (16, 3, 3, 2, 1, (5, 6)),
        (8, 1, 3, 2, 0, (7, 7)),
        (3, 3, 5, 1, 1, (6, 6)),
        (1, 16, 5, 1, 0, (6, 8)),
        (16, 1, 5, 2, 1, (6, 6)),
        (8, 8, 5, 2, 0, (7, 7)),
    ];
    for (seed, (in_ch, out_ch, k, s, p, (h, w))) in configs.into_iter().enumerate() {
        let options = Conv2dOptions { stride: (s, s), padding: (p, p), bias: true };
        let layer = Conv2d::new(in_ch, out_ch, (k, k), options, &mut rng).unwrap();
        let x = Input::new(random_values(2 * in_ch * h * w, -1.0, 1.0, &mut rng), &[2, in_ch, h, w]);
        let reference = conv2d_reference([2, in_ch, h, w], [out_ch, in_ch, k, k], (s, s), (p, p));
        check_layer(
            &format!("Conv2d {in_ch}->{out_ch} kernel {k} stride {s} padding {p}"),
            &layer,
            &[x],
            train(),
            &reference,
            40 + seed as u64,
        );
    }
}

/// Windowed pooling by definition; `max` takes the largest in-bounds value, otherwise the window
/// sum over in-bounds values is divided by kh·kw (padding counted as zeros).
fn pool_reference(
    input_dims: [usize; 4],
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
    max: bool,
) -> impl Fn(&[Vec<f64>], &[Vec<f64>]) -> Vec<f64> {
    move |inputs, _| {
        let [n, c, h, w] = input_dims;
        let oh = (h + 2 * padding.0 - kernel.0) / stride.0 + 1;
        let ow = (w + 2 * padding.1 - kernel.1) / stride.1 + 1;
        let mut y = Vec::new();
        for plane in 0..n * c {
            for i in 0..oh {
                for j in 0..ow {
                    let mut window = Vec::new();
                    for p in 0..kernel.0 {
                        for q in 0..kernel.1 {
                            let r = (i * stride.0 + p) as isize - padding.0 as isize;
                            let s = (j * stride.1 + q) as isize - padding.1 as isize;
                            if r >= 0 && s >= 0 && (r as usize) < h && (s as usize) < w {
                                window.push(inputs[0][(plane * h + r as usize) * w + s as usize]);
                            }
                        }
                    }
                    y.push(if max {
                        window.iter().copied().fold(f64::NEG_INFINITY, f64::max)
                    } else {
                        window.iter().sum::<f64>() / (kernel.0 * kernel.1) as f64
                    });
                }
            }
        }
        y
    }
}

#[test]
fn pool_gradients_match_finite_differences() {
    let mut rng = init::rng(3);
    let dims = [2, 3, 5, 6];
    let numel = dims.iter().product();
    // Distinct values 0.01 apart: no ties, and a step of 1e-4 never changes a window's winner.
    let x = || Input::new(distinct_values(numel, 0.01, &mut init::rng(30)), &dims);
    let max_pool = MaxPool2d::new((2, 2), (2, 2)).unwrap();
    check_layer("MaxPool2d 2x2/2", &max_pool, &[x()], train(), &pool_reference(dims, (2, 2), (2, 2), (0, 0), true), 31);
    let overlapping = MaxPool2d::with_padding((3, 3), (2, 2), (1, 1)).unwrap();
    check_layer(
        "MaxPool2d 3x3/2 pad 1",
        &overlapping,
        &[x()],
        train(),
        &pool_reference(dims, (3, 3), (2, 2), (1, 1), true),
        32,
    );

    let avg = AvgPool2d::with_padding((3, 2), (2, 1), (1, 1)).unwrap();
    let x = Input::new(random_values(numel, -1.0, 1.0, &mut rng), &dims);
    check_layer("AvgPool2d", &avg, &[x], train(), &pool_reference(dims, (3, 2), (2, 1), (1, 1), false), 33);

    let global = GlobalAvgPool2d::new();
    let x = Input::new(random_values(numel, -1.0, 1.0, &mut rng), &dims);
    let plane = dims[2] * dims[3];
    let reference = move |inputs: &[Vec<f64>], _: &[Vec<f64>]| {
        inputs[0].chunks(plane).map(|p| p.iter().sum::<f64>() / plane as f64).collect()
    };
    check_layer("GlobalAvgPool2d", &global, &[x], train(), &reference, 34);
}

/// erf by its Maclaurin series (accurate to ~1e-12 for |x| ≤ 3), independent of the kernel's erfc.
fn erf_series(x: f64) -> f64 {
    let (mut term, mut sum) = (x, x);
    for n in 1..200 {
        term *= -x * x / n as f64;
        sum += term / (2 * n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

#[test]
fn activation_gradients_match_finite_differences() {
    let mut rng = init::rng(4);
    let shape = [3, 2, 7];
    let numel = 42;
    let elementwise = |f: fn(f64) -> f64| {
        move |inputs: &[Vec<f64>], _: &[Vec<f64>]| inputs[0].iter().map(|&x| f(x)).collect::<Vec<f64>>()
    };
    // ReLU: inputs at least 0.05 from its kink at 0.
    let x = Input::new(values_away_from_zero(numel, 0.05, &mut rng), &shape);
    check_layer("ReLU", &Relu::new(), &[x], train(), &elementwise(|x| x.max(0.0)), 40);
    // GELU: x·Φ(x) with Φ from the series erf; dy/dx = Φ(x) + x·φ(x).
    let x = Input::new(random_values(numel, -3.0, 3.0, &mut rng), &shape);
    let gelu = |x: f64| 0.5 * x * (1.0 + erf_series(x / std::f64::consts::SQRT_2));
    check_layer("GELU", &Gelu::new(), &[x], train(), &elementwise(gelu), 41);
    // GELU, tanh approximation: x/2·(1 + tanh(√(2/π)(x + 0.044715x³))).
    let x = Input::new(random_values(numel, -3.0, 3.0, &mut rng), &shape);
    let gelu_tanh =
        |x: f64| 0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh());
    check_layer("GELUTanh", &GeluTanh::new(), &[x], train(), &elementwise(gelu_tanh), 43);
    // tanh: dy/dx = 1 - tanh².
    let x = Input::new(random_values(numel, -2.5, 2.5, &mut rng), &shape);
    check_layer("Tanh", &Tanh::new(), &[x], train(), &elementwise(f64::tanh), 42);
}

#[test]
fn flatten_and_add_gradients_match_finite_differences() {
    let mut rng = init::rng(5);
    let x = Input::new(random_values(2 * 3 * 4, -1.0, 1.0, &mut rng), &[2, 3, 4]);
    let (output, _) = Flatten::new().forward(&[&tensor(&x.values, &x.shape)], &train()).unwrap();
    assert_eq!(output.dims(), &[2, 12]);
    check_layer("Flatten", &Flatten::new(), &[x], train(), &|inputs, _| inputs[0].clone(), 50);

    let a = Input::new(random_values(24, -1.0, 1.0, &mut rng), &[4, 6]);
    let b = Input::new(random_values(24, -1.0, 1.0, &mut rng), &[4, 6]);
    assert_eq!(Add::new().n_inputs(), 2);
    let reference =
        |inputs: &[Vec<f64>], _: &[Vec<f64>]| inputs[0].iter().zip(&inputs[1]).map(|(a, b)| a + b).collect();
    check_layer("Add", &Add::new(), &[a, b], train(), &reference, 51);
}

#[test]
fn dropout_gradients_match_finite_differences_for_a_fixed_mask() {
    let mut rng = init::rng(6);
    let p = 0.3;
    let layer = Dropout::new(p).unwrap();
    let x = Input::new(random_values(5 * 8, -1.0, 1.0, &mut rng), &[5, 8]);
    let seed = 42;
    // The mask is a function of the seed alone, so the reference can rebuild it.
    let mask = layer.mask(40, seed);
    assert!(mask.contains(&0.0) && mask.contains(&1.0));
    let scale = 1.0 / (1.0 - p as f64);
    let reference = move |inputs: &[Vec<f64>], _: &[Vec<f64>]| {
        inputs[0].iter().zip(&mask).map(|(x, &m)| x * m as f64 * scale).collect()
    };
    check_layer("Dropout", &layer, &[x], ForwardCtx::train(seed), &reference, 60);
    // Evaluation mode is the identity.
    let x = Input::new(random_values(12, -1.0, 1.0, &mut rng), &[3, 4]);
    check_layer("Dropout (eval)", &layer, &[x], ForwardCtx::eval(), &|inputs, _| inputs[0].clone(), 61);
}

#[test]
fn layer_norm_gradients_match_finite_differences() {
    let mut rng = init::rng(7);
    let dim = 6;
    // Random affine parameters, so their gradients are not the trivial ones at weight 1, bias 0.
    let weight = tensor(&random_values(dim, 0.5, 1.5, &mut rng), &[dim]);
    let bias = tensor(&random_values(dim, -0.5, 0.5, &mut rng), &[dim]);
    let layer = LayerNorm::from_parameters(weight, bias).unwrap();
    let x = Input::new(random_values(2 * 3 * dim, -2.0, 2.0, &mut rng), &[2, 3, dim]);
    // y = (x - mean) / sqrt(var + 1e-5) · w + b per row, biased variance.
    let reference = move |inputs: &[Vec<f64>], params: &[Vec<f64>]| {
        let mut y = Vec::new();
        for row in inputs[0].chunks(dim) {
            let mean = row.iter().sum::<f64>() / dim as f64;
            let var = row.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / dim as f64;
            let rstd = 1.0 / (var + 1e-5f32 as f64).sqrt();
            y.extend(row.iter().enumerate().map(|(i, x)| (x - mean) * rstd * params[0][i] + params[1][i]));
        }
        y
    };
    check_layer("LayerNorm", &layer, &[x], train(), &reference, 70);
}

#[test]
fn embedding_weight_gradient_matches_finite_differences() {
    let mut rng = init::rng(8);
    let (num_embeddings, dim) = (7, 4);
    let layer = Embedding::new(num_embeddings, dim, &mut rng).unwrap();
    // Repeated ids (3 twice, 0 twice) check that gradients of one row accumulate.
    let ids = Input::constant(vec![3.0, 0.0, 6.0, 3.0, 1.0, 0.0], &[2, 3]);
    let reference = move |inputs: &[Vec<f64>], params: &[Vec<f64>]| {
        inputs[0].iter().flat_map(|&id| params[0][id as usize * dim..(id as usize + 1) * dim].to_vec()).collect()
    };
    check_layer("Embedding", &layer, &[ids], train(), &reference, 80);
}

#[test]
fn cross_entropy_matches_reference_and_finite_differences() {
    let mut rng = init::rng(9);
    let (rows, classes) = (4, 5);
    let logits = random_values(rows * classes, -3.0, 3.0, &mut rng);
    let labels = [2usize, 0, 4, 2];
    let normalizer = 3.0f32;
    // L = Σ_r (log Σ_c exp(z[r, c]) - z[r, y_r]) / normalizer; ∂L/∂z = (softmax(z) - onehot(y)) / normalizer.
    let reference = |z: &[f64]| -> f64 {
        z.chunks(classes)
            .zip(&labels)
            .map(|(row, &label)| row.iter().map(|v| v.exp()).sum::<f64>().ln() - row[label])
            .sum::<f64>()
            / normalizer as f64
    };
    let targets = Targets::Classes(labels.to_vec());
    let (loss, grad) =
        CrossEntropyLoss::new().loss_and_grad(&tensor(&logits, &[rows, classes]), &targets, normalizer).unwrap();
    common::assert_close("cross-entropy loss", &[loss], &[reference(&logits)]);
    let mut z = logits.clone();
    let numeric: Vec<f64> = (0..z.len())
        .map(|k| {
            let original = z[k];
            z[k] = original + common::FD_STEP;
            let plus = reference(&z);
            z[k] = original - common::FD_STEP;
            let minus = reference(&z);
            z[k] = original;
            (plus - minus) / (2.0 * common::FD_STEP)
        })
        .collect();
    common::assert_close("cross-entropy gradient", &to_f64(&grad), &numeric);

    // Large logits stay finite (the row maximum is subtracted before exponentiating).
    let large = Tensor::from_vec(vec![1000.0, 0.0, -1000.0], [1, 3], &conveyor_engine::Device::host()).unwrap();
    let (loss, grad) = CrossEntropyLoss::new().loss_and_grad(&large, &Targets::Classes(vec![1]), 1.0).unwrap();
    assert!((loss - 1000.0).abs() < 1e-3, "loss {loss}");
    assert!(grad.to_vec_f32().iter().all(|g| g.is_finite()));
}
