//! `MultiheadSelfAttention` and `MeanOverTokens`: forward passes against an f64 reference written
//! here, analytic input and weight gradients against central finite differences of it (tolerance
//! `|a - r| ≤ 1e-3 · (|r| + ‖r‖∞) + 1e-6`, see `common::assert_close`), PyTorch's parameter names,
//! shapes and initialisation, shape errors, and the forward pass against
//! `torch.nn.MultiheadAttention` (fixture made by `tests/fixtures/make_attention_reference.py`).
//!
//! Analytic derivatives the layer implements (per head, scale `s = 1/sqrt(head_dim)`):
//! `S = s · q kᵀ (+ mask)`, `P = softmax(S)`, `ctx = P v`, `y = ctx Woᵀ + bo`;
//! `dctx = dy Wo`, `dv = Pᵀ dctx`, `dP = dctx vᵀ`, `dS = P ⊙ (dP − rowsum(P ⊙ dP))`,
//! `dq = s · dS k`, `dk = s · dSᵀ q`, then through the in-projection like a Linear layer.
mod common;

use std::path::PathBuf;

use common::{Input, assert_close, check_layer, random_values, tensor, to_f64};
use conveyor_engine::{Device, Error, ForwardCtx, Layer, Shape, Tensor, checkpoint, init};
use conveyor_layers::{MeanOverTokens, MultiheadSelfAttention, PositionalEmbedding};

/// Straightforward f64 multi-head self-attention on `x` `[batch, tokens, d]` with parameters
/// `[in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias]` in PyTorch's layout.
fn attention_reference(
    batch: usize,
    tokens: usize,
    d: usize,
    n_heads: usize,
    causal: bool,
) -> impl Fn(&[Vec<f64>], &[Vec<f64>]) -> Vec<f64> {
    move |inputs, params| {
        let (x, w_in, b_in, w_out, b_out) = (&inputs[0], &params[0], &params[1], &params[2], &params[3]);
        let dh = d / n_heads;
        let scale = 1.0 / (dh as f64).sqrt();
        let mut y = Vec::with_capacity(batch * tokens * d);
        for b in 0..batch {
            let row = |t: usize| &x[(b * tokens + t) * d..(b * tokens + t + 1) * d];
            // proj[w][t][o] = Σ_i x[t, i] · w_in[w·d + o, i] + b_in[w·d + o]
            let proj: Vec<Vec<Vec<f64>>> = (0..3)
                .map(|w| {
                    (0..tokens)
                        .map(|t| {
                            (0..d)
                                .map(|o| {
                                    let r = w * d + o;
                                    (0..d).map(|i| row(t)[i] * w_in[r * d + i]).sum::<f64>() + b_in[r]
                                })
                                .collect()
                        })
                        .collect()
                })
                .collect();
            let mut ctx = vec![vec![0.0; d]; tokens];
            for h in 0..n_heads {
                let cols = h * dh..(h + 1) * dh;
                for i in 0..tokens {
                    let keys = if causal { i + 1 } else { tokens };
                    let scores: Vec<f64> = (0..keys)
                        .map(|j| cols.clone().map(|c| proj[0][i][c] * proj[1][j][c]).sum::<f64>() * scale)
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let total: f64 = exps.iter().sum();
                    for c in cols.clone() {
                        ctx[i][c] = (0..keys).map(|j| exps[j] / total * proj[2][j][c]).sum();
                    }
                }
            }
            for ctx_row in &ctx {
                for o in 0..d {
                    y.push((0..d).map(|i| ctx_row[i] * w_out[o * d + i]).sum::<f64>() + b_out[o]);
                }
            }
        }
        y
    }
}

/// A layer with every parameter random (biases too, so their gradients are not trivial).
fn random_layer(d: usize, n_heads: usize, causal: bool, seed: u64) -> MultiheadSelfAttention {
    let mut rng = init::rng(seed);
    let mut param =
        |dims: &[usize], bound: f32| tensor(&random_values(dims.iter().product(), -bound, bound, &mut rng), dims);
    let bound = 1.0 / (d as f32).sqrt();
    MultiheadSelfAttention::from_parameters(
        n_heads,
        causal,
        param(&[3 * d, d], 2.0 * bound),
        param(&[3 * d], 0.5),
        param(&[d, d], bound),
        param(&[d], 0.5),
    )
    .unwrap()
}

fn check_attention(name: &str, batch: usize, tokens: usize, d: usize, n_heads: usize, causal: bool, seed: u64) {
    let layer = random_layer(d, n_heads, causal, seed);
    let mut rng = init::rng(seed + 1000);
    let x = Input::new(random_values(batch * tokens * d, -1.5, 1.5, &mut rng), &[batch, tokens, d]);
    let reference = attention_reference(batch, tokens, d, n_heads, causal);
    check_layer(name, &layer, &[x], ForwardCtx::train(0), &reference, seed);
}

#[test]
fn attention_gradients_match_finite_differences() {
    check_attention("attention 2 heads", 2, 4, 6, 2, false, 1);
    check_attention("attention 1 head", 3, 3, 4, 1, false, 2);
    check_attention("attention 4 heads, one token", 2, 1, 8, 4, false, 3);
}

#[test]
fn causal_attention_gradients_match_finite_differences() {
    check_attention("causal attention 2 heads", 2, 4, 6, 2, true, 4);
    check_attention("causal attention 3 heads", 1, 5, 6, 3, true, 5);
}

#[test]
fn default_initialisation_has_pytorch_gradients_too() {
    // Zero biases and xavier in-projection, as `new` builds them.
    let layer = MultiheadSelfAttention::new(4, 2, false, &mut init::rng(6)).unwrap();
    let x = Input::new(random_values(2 * 3 * 4, -1.0, 1.0, &mut init::rng(60)), &[2, 3, 4]);
    check_layer(
        "attention (default init)",
        &layer,
        &[x],
        ForwardCtx::train(0),
        &attention_reference(2, 3, 4, 2, false),
        61,
    );
}

#[test]
fn causal_mask_hides_later_tokens() {
    // Changing the last token leaves every earlier output of a causal layer unchanged.
    let layer = random_layer(6, 2, true, 7);
    let mut values = random_values(4 * 6, -1.0, 1.0, &mut init::rng(70));
    let (before, _) = layer.forward(&[&tensor(&values, &[1, 4, 6])], &ForwardCtx::eval()).unwrap();
    values[3 * 6..].iter_mut().for_each(|v| *v += 1.0);
    let (after, _) = layer.forward(&[&tensor(&values, &[1, 4, 6])], &ForwardCtx::eval()).unwrap();
    assert_eq!(before.to_vec_f32()[..3 * 6], after.to_vec_f32()[..3 * 6]);
    assert_ne!(before.to_vec_f32()[3 * 6..], after.to_vec_f32()[3 * 6..]);
}

#[test]
fn parameters_have_pytorch_names_shapes_and_initialisation() {
    let d = 16;
    let layer = MultiheadSelfAttention::new(d, 4, false, &mut init::rng(8)).unwrap();
    let names: Vec<(&str, &[usize])> = layer.parameters().iter().map(|p| (p.name.as_str(), p.value.dims())).collect();
    assert_eq!(
        names,
        [
            ("in_proj_weight", &[3 * d, d][..]),
            ("in_proj_bias", &[3 * d][..]),
            ("out_proj.weight", &[d, d][..]),
            ("out_proj.bias", &[d][..]),
        ]
    );
    assert_eq!((layer.embed_dim(), layer.n_heads(), layer.head_dim(), layer.is_causal()), (16, 4, 4, false));
    let params: Vec<Vec<f32>> = layer.parameters().iter().map(|p| p.value.to_vec_f32()).collect();
    // xavier_uniform on [3D, D]: bound sqrt(6 / (fan_in + fan_out)) = sqrt(6 / 4D).
    let xavier = (6.0 / (4 * d) as f32).sqrt();
    assert!(params[0].iter().all(|v| v.abs() <= xavier));
    assert!(params[0].iter().any(|v| v.abs() > 0.9 * xavier), "in_proj_weight should fill its range");
    // out_proj.weight: Linear's default U(±1/sqrt(D)).
    let linear = 1.0 / (d as f32).sqrt();
    assert!(params[2].iter().all(|v| v.abs() <= linear) && params[2].iter().any(|v| v.abs() > 0.9 * linear));
    assert!(params[1].iter().chain(&params[3]).all(|&v| v == 0.0), "biases start at zero");
    // Seeded: the same seed gives the same parameters.
    let again = MultiheadSelfAttention::new(d, 4, false, &mut init::rng(8)).unwrap();
    assert!(layer.parameters().iter().zip(again.parameters()).all(|(a, b)| a.value.bit_eq(&b.value)));
}

#[test]
fn cost_counts_projections_attention_and_saved_tensors() {
    let (t, d, h) = (5u64, 8u64, 2u64);
    let layer = MultiheadSelfAttention::new(d as usize, h as usize, false, &mut init::rng(9)).unwrap();
    let cost = layer.cost(&[Shape::new(vec![t as usize, d as usize])]).unwrap();
    assert_eq!(cost.forward_flops_per_sample, 8 * t * d * d + 4 * t * d + 4 * t * t * d + 5 * h * t * t);
    assert_eq!(cost.param_bytes, 4 * (4 * d * d + 4 * d));
    // Input, q/k/v, context (5 · T · D) and the rows' logsumexp (H · T), f32.
    assert_eq!(cost.activation_bytes_per_sample, 4 * (5 * t * d + h * t));
    assert_eq!(cost.output_bytes_per_sample, 4 * t * d);
    // dq/dk/dv (3 · T · D floats) waits in the pending slot between the two backward calls.
    assert_eq!(cost.backward_held_bytes_per_sample, 4 * 3 * t * d);
    // The shared dq/dk/dv chain is counted once, in the input half (the runtime runs it first).
    assert!(cost.backward_input_flops_per_sample > cost.backward_weight_flops_per_sample);
    // The forward pass saves exactly what the estimate counts (batch 3).
    let x = tensor(&vec![0.1; 3 * (t * d) as usize], &[3, t as usize, d as usize]);
    let (_, saved) = layer.forward(&[&x], &ForwardCtx::eval()).unwrap();
    assert_eq!(saved.size_in_bytes() as u64, 3 * cost.activation_bytes_per_sample);
}

fn f32_tensor(values: Vec<f64>, dims: impl Into<Shape>, device: &Device) -> Tensor {
    Tensor::from_vec(values.into_iter().map(|v| v as f32).collect(), dims, device).unwrap()
}

/// What one layer's `Saved` holds on the ledger at 16 and 512 tokens (D = 32, 4 heads, batch 2):
/// the input, q/k/v and context (5 · T · D floats per sample) and a logsumexp per head and token
/// (H · T), where the layer used to keep the probabilities (H · T²): at T = 16, 10,496 bytes per
/// sample instead of 14,336; at T = 512, 335,872 instead of 4,521,984 (13× less).
#[test]
fn saved_memory_is_linear_in_tokens() {
    let (d, h, batch) = (32usize, 4usize, 2usize);
    for (t, per_sample) in [(16usize, 10_496u64), (512, 335_872)] {
        let device = Device::cpu(0);
        let mut layer = MultiheadSelfAttention::new(d, h, false, &mut init::rng(12)).unwrap();
        layer.to_device(&device).unwrap();
        let before = device.memory_in_use();
        let x = f32_tensor(random_values(batch * t * d, -1.0, 1.0, &mut init::rng(13)), [batch, t, d], &device);
        let (y, saved) = layer.forward(&[&x], &ForwardCtx::train(0)).unwrap();
        drop((x, y));
        let kept = device.memory_in_use() - before;
        assert_eq!(per_sample, 4 * (5 * t * d + h * t) as u64);
        assert_eq!(kept, batch as u64 * per_sample, "T = {t}");
        assert_eq!(saved.size_in_bytes() as u64, kept);
        let probabilities_were = 4 * (5 * t * d + h * t * t) as u64;
        assert!(per_sample < probabilities_were, "T = {t}: {per_sample} vs {probabilities_were}");
    }
}

/// `backward_input` leaves dq/dk/dv for `backward_weight` (on the device's ledger), which takes
/// it; either order gives the gradients of the combined `backward`, bit for bit.
#[test]
fn backward_halves_share_one_qkv_gradient_in_either_order() {
    let device = Device::cpu(1);
    let mut layer = random_layer(8, 2, true, 14);
    layer.to_device(&device).unwrap();
    let (batch, t, d) = (3usize, 5usize, 8usize);
    let x = f32_tensor(random_values(batch * t * d, -1.0, 1.0, &mut init::rng(15)), [batch, t, d], &device);
    let (y, saved) = layer.forward(&[&x], &ForwardCtx::train(0)).unwrap();
    let grad = f32_tensor(random_values(y.numel(), -1.0, 1.0, &mut init::rng(16)), y.shape().clone(), &device);
    let zeros = |layer: &MultiheadSelfAttention| -> Vec<Tensor> {
        layer
            .parameters()
            .iter()
            .map(|p| Tensor::zeros(p.value.shape().clone(), p.value.dtype(), &device).unwrap())
            .collect()
    };
    let mut combined = zeros(&layer);
    let combined_input = layer.backward(&saved, &grad, &mut combined).unwrap()[0].take().unwrap();
    assert_eq!(layer.pending_gradient_bytes(), 0, "backward keeps nothing");
    let qkv_bytes = 4 * 3 * batch * t * d;
    let cost = layer.cost(&[Shape::new(vec![t, d])]).unwrap();
    assert_eq!(qkv_bytes as u64, batch as u64 * cost.backward_held_bytes_per_sample, "the plan counts the slot");
    for input_first in [true, false] {
        let mut grads = zeros(&layer);
        let in_use = device.memory_in_use();
        let input_grad = if input_first {
            let g = layer.backward_input(&saved, &grad).unwrap()[0].take().unwrap();
            assert_eq!(layer.pending_gradient_bytes(), qkv_bytes);
            assert_eq!(device.memory_in_use() - in_use, (qkv_bytes + g.size_in_bytes()) as u64, "slot on the ledger");
            layer.backward_weight(&saved, &grad, &mut grads).unwrap();
            g
        } else {
            layer.backward_weight(&saved, &grad, &mut grads).unwrap();
            assert_eq!(layer.pending_gradient_bytes(), qkv_bytes);
            layer.backward_input(&saved, &grad).unwrap()[0].take().unwrap()
        };
        assert_eq!(layer.pending_gradient_bytes(), 0, "the second call drops the slot");
        assert!(input_grad.bit_eq(&combined_input));
        assert!(grads.iter().zip(&combined).all(|(a, b)| a.bit_eq(b)));
    }
    // A slot whose `Saved` is dropped before the second call is freed on the next call.
    layer.backward_input(&saved, &grad).unwrap();
    assert_eq!(layer.pending_gradient_bytes(), qkv_bytes);
    drop(saved);
    let (_, saved) = layer.forward(&[&x], &ForwardCtx::train(0)).unwrap();
    layer.backward_weight(&saved, &grad, &mut zeros(&layer)).unwrap();
    assert_eq!(layer.pending_gradient_bytes(), qkv_bytes, "only the new call's slot");
}

#[test]
fn bad_shapes_and_head_counts_are_errors() {
    let mut rng = init::rng(10);
    assert!(matches!(MultiheadSelfAttention::new(6, 4, false, &mut rng), Err(Error::InvalidArgument { .. })));
    assert!(matches!(MultiheadSelfAttention::new(6, 0, false, &mut rng), Err(Error::InvalidArgument { .. })));
    assert!(matches!(MultiheadSelfAttention::new(0, 1, false, &mut rng), Err(Error::InvalidArgument { .. })));
    let zeros = |dims: &[usize]| Tensor::zeros(dims.to_vec(), conveyor_engine::DType::F32, &Device::host()).unwrap();
    let from = |w_in: &[usize], b_in: &[usize], w_out: &[usize], b_out: &[usize]| {
        MultiheadSelfAttention::from_parameters(2, false, zeros(w_in), zeros(b_in), zeros(w_out), zeros(b_out))
    };
    assert!(from(&[12, 4], &[12], &[4, 4], &[4]).is_ok());
    for (w_in, b_in, w_out, b_out) in [
        (&[12, 5][..], &[12][..], &[4, 4][..], &[4][..]),
        (&[12, 4], &[4], &[4, 4], &[4]),
        (&[12, 4], &[12], &[4, 5], &[4]),
        (&[12, 4], &[12], &[4, 4], &[12]),
        (&[12], &[12], &[4, 4], &[4]),
    ] {
        assert!(
            matches!(from(w_in, b_in, w_out, b_out), Err(Error::ShapeMismatch { .. })),
            "{w_in:?} {b_in:?} {w_out:?} {b_out:?}"
        );
    }

    let layer = MultiheadSelfAttention::new(4, 2, true, &mut rng).unwrap();
    let ctx = ForwardCtx::eval();
    for dims in [&[2, 3, 5][..], &[2, 12], &[2, 3, 4, 1], &[2, 0, 4]] {
        assert!(matches!(layer.forward(&[&zeros(dims)], &ctx), Err(Error::ShapeMismatch { .. })), "input {dims:?}");
    }
    let x = zeros(&[2, 3, 4]);
    assert!(matches!(layer.forward(&[&x, &x], &ctx), Err(Error::InvalidArgument { .. })));
    for dims in [&[3, 5][..], &[12], &[0, 4]] {
        assert!(
            matches!(layer.output_shape(&[Shape::new(dims.to_vec())]), Err(Error::ShapeMismatch { .. })),
            "{dims:?}"
        );
        assert!(layer.cost(&[Shape::new(dims.to_vec())]).is_err());
    }
    assert_eq!(layer.output_shape(&[Shape::new(vec![3, 4])]).unwrap().dims(), &[3, 4]);

    let (_, saved) = layer.forward(&[&x], &ctx).unwrap();
    assert!(matches!(layer.backward_input(&saved, &zeros(&[2, 3, 3])), Err(Error::ShapeMismatch { .. })));
    let mut grads: Vec<Tensor> = layer.parameters().iter().map(|p| zeros(p.value.dims())).collect();
    assert!(matches!(layer.backward_weight(&saved, &zeros(&[2, 4, 4]), &mut grads), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(
        layer.backward_weight(&saved, &zeros(&[2, 3, 4]), &mut grads[..3]),
        Err(Error::InvalidArgument { .. })
    ));
    grads[1] = zeros(&[4]);
    assert!(matches!(layer.backward_weight(&saved, &zeros(&[2, 3, 4]), &mut grads), Err(Error::ShapeMismatch { .. })));
    assert!(layer.backward_input(&conveyor_engine::Saved::default(), &x).is_err());
}

#[test]
fn mean_over_tokens_matches_reference_and_finite_differences() {
    let (batch, tokens, features) = (3, 4, 5);
    let x =
        Input::new(random_values(batch * tokens * features, -1.0, 1.0, &mut init::rng(11)), &[batch, tokens, features]);
    // y[b, f] = (1/T) Σ_t x[b, t, f]; ∂y[b, f]/∂x[b, t, f] = 1/T.
    let reference = move |inputs: &[Vec<f64>], _: &[Vec<f64>]| {
        inputs[0]
            .chunks(tokens * features)
            .flat_map(|sample| {
                (0..features).map(move |f| (0..tokens).map(|t| sample[t * features + f]).sum::<f64>() / tokens as f64)
            })
            .collect()
    };
    check_layer("MeanOverTokens", &MeanOverTokens::new(), &[x], ForwardCtx::train(0), &reference, 110);
    let layer = MeanOverTokens::new();
    assert_eq!(layer.output_shape(&[Shape::new(vec![4, 5])]).unwrap().dims(), &[5]);
    assert!(layer.output_shape(&[Shape::new(vec![5])]).is_err());
    assert!(layer.output_shape(&[Shape::new(vec![0, 5])]).is_err());
    assert!(matches!(
        layer.forward(&[&tensor(&[0.0; 6], &[2, 3])], &ForwardCtx::eval()),
        Err(Error::ShapeMismatch { .. })
    ));
}

#[test]
fn positional_embedding_matches_reference_and_finite_differences() {
    let (batch, tokens, dim, max_tokens) = (2, 3, 4, 5);
    let layer = PositionalEmbedding::new(max_tokens, dim, &mut init::rng(12)).unwrap();
    assert_eq!(layer.parameters()[0].name, "weight");
    assert_eq!(layer.parameters()[0].value.dims(), &[max_tokens, dim]);
    // y[b, t, :] = x[b, t, :] + weight[t, :] for t < tokens: rows past `tokens` get zero gradient.
    let x = Input::new(random_values(batch * tokens * dim, -1.0, 1.0, &mut init::rng(120)), &[batch, tokens, dim]);
    let reference = move |inputs: &[Vec<f64>], params: &[Vec<f64>]| {
        inputs[0].iter().enumerate().map(|(i, x)| x + params[0][i % (tokens * dim)]).collect()
    };
    check_layer("PositionalEmbedding", &layer, &[x], ForwardCtx::train(0), &reference, 121);
    assert!(layer.output_shape(&[Shape::new(vec![6, 4])]).is_err(), "more tokens than the table");
    assert!(layer.output_shape(&[Shape::new(vec![3, 5])]).is_err());
    assert!(matches!(
        layer.forward(&[&tensor(&[0.0; 24], &[1, 6, 4])], &ForwardCtx::eval()),
        Err(Error::ShapeMismatch { .. })
    ));
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// Forward output against `torch.nn.MultiheadAttention(8, 2, batch_first=True)` with the same
/// weights, within `|a - r| ≤ 1e-5 · (|r| + ‖r‖∞)`: f32 sums of ≤ 24 terms in another order differ
/// by a few ulps (≈ 1e-7 relative), far inside 1e-5 of the output's scale.
#[test]
fn forward_matches_pytorch_multihead_attention() {
    let reference = checkpoint::load(fixture("attention_reference.safetensors"), &Device::host()).unwrap();
    let n_heads: usize = reference.metadata_value("n_heads").unwrap();
    let get = |name: &str| reference.get(name).unwrap_or_else(|| panic!("fixture lacks `{name}`")).try_clone().unwrap();
    let x = get("x");
    for (causal, output) in [(false, "y"), (true, "y_causal")] {
        let layer = MultiheadSelfAttention::from_parameters(
            n_heads,
            causal,
            get("in_proj_weight"),
            get("in_proj_bias"),
            get("out_proj.weight"),
            get("out_proj.bias"),
        )
        .unwrap();
        let (y, _) = layer.forward(&[&x], &ForwardCtx::eval()).unwrap();
        let (got, want) = (to_f64(&y), to_f64(&get(output)));
        let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        for (i, (a, r)) in got.iter().zip(&want).enumerate() {
            assert!((a - r).abs() <= 1e-5 * (r.abs() + scale), "{output}[{i}]: got {a}, torch {r}");
        }
        // The f64 reference of the gradient tests agrees with torch too.
        let params: Vec<Vec<f64>> = layer.parameters().iter().map(|p| to_f64(&p.value)).collect();
        let dims = x.dims();
        let f64_ref = attention_reference(dims[0], dims[1], dims[2], n_heads, causal)(&[to_f64(&x)], &params);
        assert_close(&format!("{output} f64 reference vs torch"), &f64_ref, &want);
    }
}
