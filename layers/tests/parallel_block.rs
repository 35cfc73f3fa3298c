//! `ParallelTransformerBlock` (a pre-norm transformer block split by heads, hidden features and,
//! between them, tokens: Megatron's sequence parallelism) against the same block computed layer by
//! layer with the unsplit layers (`LayerNorm`, `MultiheadSelfAttention`, `Linear`, `Gelu`) and the
//! residual adds: output, input gradient and every parameter gradient under PyTorch's names, for
//! k = 1, 2, 3 devices, token counts the degree does not divide, causal and not, with the backward
//! calls in either order. Its unsplit parameters come back bit for bit; each device saves about
//! `1/k` of what one device saves; too few tokens are refused.
//!
//! Tolerance: the shards sum the projections over their own heads and hidden features, the
//! reduce-scatters add the partials, and the LayerNorms' weight gradients are summed per token
//! block: every element within `1e-5 · ‖expected‖∞`, as in `parallel_attention.rs`.
use conveyor_engine::{Device, ForwardCtx, Layer, Saved, Tensor, init};
use conveyor_layers::{Gelu, LayerNorm, Linear, MultiheadSelfAttention, ParallelTransformerBlock};

mod common;
use common::{assert_near, uniform, zero_grads};

const DIM: usize = 12;
const HEADS: usize = 6;
const HIDDEN: usize = 4 * DIM;

/// The unsplit layers of one block, with every bias and LayerNorm parameter drawn at random
/// (PyTorch's zeros and ones would hide a misplaced one).
struct Parts {
    ln1: LayerNorm,
    attn: MultiheadSelfAttention,
    ln2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

fn parts(causal: bool, seed: u64) -> Parts {
    let mut rng = init::rng(seed);
    let mut ln1 = LayerNorm::new(DIM).unwrap();
    let mut attn = MultiheadSelfAttention::new(DIM, HEADS, causal, &mut rng).unwrap();
    let mut ln2 = LayerNorm::new(DIM).unwrap();
    let fc1 = Linear::new(DIM, HIDDEN, true, &mut rng).unwrap();
    let fc2 = Linear::new(HIDDEN, DIM, true, &mut rng).unwrap();
    for norm in [&mut ln1, &mut ln2] {
        norm.import_parameter("weight", &uniform(&[DIM], &mut rng)).unwrap();
        norm.import_parameter("bias", &uniform(&[DIM], &mut rng)).unwrap();
    }
    attn.import_parameter("in_proj_bias", &uniform(&[3 * DIM], &mut rng)).unwrap();
    attn.import_parameter("out_proj.bias", &uniform(&[DIM], &mut rng)).unwrap();
    Parts { ln1, attn, ln2, fc1, fc2 }
}

fn add(a: &Tensor, b: &Tensor) -> Tensor {
    a.add(b).unwrap()
}

fn only(grads: Vec<Option<Tensor>>) -> Tensor {
    grads.into_iter().next().flatten().unwrap()
}

/// The block layer by layer: (output, input gradient, parameter gradients in the block's
/// unsplit order `ln1.weight` ... `fc2.bias`).
fn reference(p: &Parts, x: &Tensor, dy: &Tensor) -> (Tensor, Tensor, Vec<Tensor>) {
    let ctx = ForwardCtx::train(0);
    let gelu = Gelu::new();
    let (h1, s_ln1) = p.ln1.forward(&[x], &ctx).unwrap();
    let (a, s_attn) = p.attn.forward(&[&h1], &ctx).unwrap();
    let s = add(x, &a);
    let (h2, s_ln2) = p.ln2.forward(&[&s], &ctx).unwrap();
    let (u, s_fc1) = p.fc1.forward(&[&h2], &ctx).unwrap();
    let (v, s_gelu) = gelu.forward(&[&u], &ctx).unwrap();
    let (z, s_fc2) = p.fc2.forward(&[&v], &ctx).unwrap();
    let y = add(&s, &z);

    let dv = only(p.fc2.backward_input(&s_fc2, dy).unwrap());
    let du = only(gelu.backward_input(&s_gelu, &dv).unwrap());
    let dh2 = only(p.fc1.backward_input(&s_fc1, &du).unwrap());
    let ds = add(dy, &only(p.ln2.backward_input(&s_ln2, &dh2).unwrap()));
    let dh1 = only(p.attn.backward_input(&s_attn, &ds).unwrap());
    let dx = add(&ds, &only(p.ln1.backward_input(&s_ln1, &dh1).unwrap()));

    let mut grads = Vec::new();
    let mut weight = |layer: &dyn Layer, saved: &Saved, dy: &Tensor| {
        let mut g = zero_grads(layer);
        layer.backward_weight(saved, dy, &mut g).unwrap();
        grads.extend(g);
    };
    weight(&p.ln1, &s_ln1, &dh1);
    weight(&p.attn, &s_attn, &ds);
    weight(&p.ln2, &s_ln2, &dh2);
    weight(&p.fc1, &s_fc1, &du);
    weight(&p.fc2, &s_fc2, dy);
    (y, dx, grads)
}

fn block(p: &Parts, devices: &[Device]) -> ParallelTransformerBlock {
    ParallelTransformerBlock::from_layers(&p.ln1, &p.attn, &p.ln2, &p.fc1, &p.fc2, devices).unwrap()
}

/// (output, input gradient, parameter gradients, saved state) of the split block, the weight pass
/// first when `weight_first`.
fn run(layer: &ParallelTransformerBlock, x: &Tensor, dy: &Tensor, weight_first: bool) -> (Tensor, Tensor, Vec<Tensor>) {
    let (y, saved) = layer.forward(&[x], &ForwardCtx::train(0)).unwrap();
    let mut grads = zero_grads(layer);
    let dx = if weight_first {
        layer.backward_weight(&saved, dy, &mut grads).unwrap();
        only(layer.backward_input(&saved, dy).unwrap())
    } else {
        let dx = only(layer.backward_input(&saved, dy).unwrap());
        layer.backward_weight(&saved, dy, &mut grads).unwrap();
        dx
    };
    (y, dx, grads)
}

#[test]
fn the_sequence_parallel_block_matches_the_block_layer_by_layer() {
    for causal in [false, true] {
        let p = parts(causal, 11);
        let mut rng = init::rng(5);
        for tokens in [5, 7] {
            let (x, dy) = (uniform(&[2, tokens, DIM], &mut rng), uniform(&[2, tokens, DIM], &mut rng));
            let (y, dx, grads) = reference(&p, &x, &dy);
            for k in [1, 2, 3] {
                let devices: Vec<Device> = (0..k).map(Device::cpu).collect();
                for weight_first in [false, true] {
                    let what = format!("k={k} T={tokens} causal={causal} weight_first={weight_first}");
                    let split = block(&p, &devices);
                    assert_eq!(
                        split.parameters().len(),
                        12 + 6 * (k - 1),
                        "{what}: the first shard holds the whole ones"
                    );
                    let on_first = |t: &Tensor| t.to_device(&devices[0]).unwrap();
                    let (split_y, split_dx, split_grads) = run(&split, &on_first(&x), &on_first(&dy), weight_first);
                    assert_eq!(split.pending_gradient_bytes(), 0, "{what}: the slot is emptied by the second call");
                    assert_near(&format!("{what} output"), &split_y, &y);
                    assert_near(&format!("{what} input gradient"), &split_dx, &dx);
                    // The shards' gradients made unsplit through a twin's shards.
                    let mut twin = block(&p, &devices);
                    for (param, grad) in twin.parameters_mut().iter_mut().zip(&split_grads) {
                        param.value.copy_from(grad).unwrap();
                    }
                    let gathered = twin.gather_parameters().unwrap();
                    assert_eq!(gathered.len(), grads.len(), "{what}");
                    for ((name, actual), expected) in gathered.iter().zip(&grads) {
                        assert_near(&format!("{what} gradient of {name}"), actual, expected);
                    }
                }
            }
        }
    }
}

#[test]
fn the_unsplit_parameters_come_back_bit_for_bit_under_pytorch_names() {
    let p = parts(false, 3);
    let sources: Vec<(String, Tensor)> = [
        ("ln1", p.ln1.export_parameters().unwrap()),
        ("attn", p.attn.export_parameters().unwrap()),
        ("ln2", p.ln2.export_parameters().unwrap()),
        ("fc1", p.fc1.export_parameters().unwrap()),
        ("fc2", p.fc2.export_parameters().unwrap()),
    ]
    .into_iter()
    .flat_map(|(child, params)| params.into_iter().map(move |(name, value)| (format!("{child}.{name}"), value)))
    .collect();
    let mut rng = init::rng(8);
    for k in [1, 2, 3] {
        let devices: Vec<Device> = (0..k).map(Device::cpu).collect();
        let mut split = block(&p, &devices);
        let shapes: Vec<String> = split.export_parameter_shapes().into_iter().map(|(n, _)| n).collect();
        let gathered = split.gather_parameters().unwrap();
        assert_eq!(gathered.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(), shapes, "k={k}");
        for ((name, value), (source_name, source)) in gathered.iter().zip(&sources) {
            assert_eq!(name, source_name, "k={k}");
            assert_eq!(value.dims(), source.dims(), "k={k}: {name}");
            assert_eq!(value.to_vec_f32(), source.to_vec_f32(), "k={k}: {name} after the split");
        }
        // Loaded by name, each comes back unchanged.
        let fresh: Vec<(String, Tensor)> =
            sources.iter().map(|(name, value)| (name.clone(), uniform(value.dims(), &mut rng))).collect();
        for (name, value) in &fresh {
            split.load_unsplit(name, value).unwrap();
        }
        for ((name, value), (_, loaded)) in split.gather_parameters().unwrap().iter().zip(&fresh) {
            assert_eq!(value.to_vec_f32(), loaded.to_vec_f32(), "k={k}: {name} round trip");
        }
    }
    let mut split = block(&p, &[Device::cpu(0), Device::cpu(1)]);
    let message = split.load_unsplit("attn.weight", &uniform(&[DIM], &mut rng)).unwrap_err().to_string();
    assert!(message.contains("ln1.weight"), "{message}");
}

/// What each device saves for the backward pass: about `1/k` of the whole block's (every
/// activation is a token block, a head block or a hidden block), where the attention and MLP
/// layers split without the sequence save a whole copy of their input on every device.
#[test]
fn each_device_saves_about_one_kth_of_the_block() {
    let p = parts(false, 2);
    let x = uniform(&[4, 12, DIM], &mut init::rng(1));
    let saved_on = |k: usize| -> Vec<usize> {
        let devices: Vec<Device> = (0..k).map(Device::cpu).collect();
        let split = block(&p, &devices);
        let (_, saved) = split.forward(&[&x.to_device(&devices[0]).unwrap()], &ForwardCtx::train(0)).unwrap();
        devices
            .iter()
            .map(|d| saved.tensors.iter().filter(|t| t.device().same_device(d)).map(Tensor::size_in_bytes).sum())
            .collect()
    };
    let whole = saved_on(1)[0];
    for k in [2, 3] {
        for (rank, bytes) in saved_on(k).into_iter().enumerate() {
            // 1/k of the activations, plus each device's copy of the LayerNorm weights.
            let bound = whole / k + 4 * 4 * DIM + 64;
            assert!(bytes <= bound, "k={k} device {rank}: saves {bytes} bytes, over {bound} (one device: {whole})");
        }
    }
}

#[test]
fn fewer_tokens_than_devices_are_refused() {
    let p = parts(false, 4);
    let devices: Vec<Device> = (0..3).map(Device::cpu).collect();
    let split = block(&p, &devices);
    let x = uniform(&[2, 2, DIM], &mut init::rng(1)).to_device(&devices[0]).unwrap();
    let message = split.forward(&[&x], &ForwardCtx::train(0)).unwrap_err().to_string();
    assert!(message.contains("2 tokens cannot be split over 3 devices"), "{message}");
    // The layer stays usable.
    let x = uniform(&[2, 3, DIM], &mut init::rng(1)).to_device(&devices[0]).unwrap();
    split.forward(&[&x], &ForwardCtx::train(0)).unwrap();
}

#[test]
fn a_head_count_the_degree_does_not_divide_is_refused() {
    let p = parts(false, 4);
    let devices: Vec<Device> = (0..4).map(Device::cpu).collect();
    let error = ParallelTransformerBlock::from_layers(&p.ln1, &p.attn, &p.ln2, &p.fc1, &p.fc2, &devices).unwrap_err();
    assert!(error.to_string().contains("6 heads cannot be split over 4 devices"), "{error}");
}
