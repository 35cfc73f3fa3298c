//! `ParallelSelfAttention` against the unsplit `MultiheadSelfAttention`: output, input gradient
//! and every parameter gradient for k = 1, 2, 4 devices, causal and not, with the backward calls
//! in either order; PyTorch's packing of `in_proj_weight` survives the stride-3 split bit for bit;
//! a head count the degree does not divide is refused with the valid degrees named.
//!
//! Tolerance: a shard sums the output projection and the input gradient over its own heads, and
//! the all-reduce adds the shards' partials, so values differ from the unsplit layer's by f32
//! rounding of reordered sums: every element within `1e-5 · ‖expected‖∞`.
use conveyor_engine::collective::{CollectiveOp, traffic};
use conveyor_engine::{Device, ForwardCtx, Layer, Saved, Tensor, init};
use conveyor_layers::{MultiheadSelfAttention, ParallelSelfAttention};

mod common;
use common::{assert_near, uniform, zero_grads};

const EMBED_DIM: usize = 16;
const HEADS: usize = 4;

/// An attention layer with non-zero biases (PyTorch initialises them to zero, which would hide
/// a bias misplaced among the shards).
fn attention(causal: bool, seed: u64) -> MultiheadSelfAttention {
    let mut rng = init::rng(seed);
    let mut layer = MultiheadSelfAttention::new(EMBED_DIM, HEADS, causal, &mut rng).unwrap();
    layer.import_parameter("in_proj_bias", &uniform(&[3 * EMBED_DIM], &mut rng)).unwrap();
    layer.import_parameter("out_proj.bias", &uniform(&[EMBED_DIM], &mut rng)).unwrap();
    layer
}

/// (output, input gradient, parameter gradients under PyTorch's names) of `layer` on `x` and `dy`,
/// the weight pass first when `weight_first`.
fn run(layer: &dyn Layer, x: &Tensor, dy: &Tensor, weight_first: bool) -> (Tensor, Tensor, Vec<Tensor>) {
    let (y, saved): (Tensor, Saved) = layer.forward(&[x], &ForwardCtx::train(0)).unwrap();
    let mut grads = zero_grads(layer);
    let dx = if weight_first {
        layer.backward_weight(&saved, dy, &mut grads).unwrap();
        layer.backward_input(&saved, dy).unwrap().remove(0).unwrap()
    } else {
        let dx = layer.backward_input(&saved, dy).unwrap().remove(0).unwrap();
        layer.backward_weight(&saved, dy, &mut grads).unwrap();
        dx
    };
    (y, dx, grads)
}

#[test]
fn head_split_attention_matches_the_unsplit_layer() {
    for causal in [false, true] {
        let whole = attention(causal, 7);
        let mut rng = init::rng(99);
        let (x, dy) = (uniform(&[3, 5, EMBED_DIM], &mut rng), uniform(&[3, 5, EMBED_DIM], &mut rng));
        let (y, dx, grads) = run(&whole, &x, &dy, false);
        for k in [1, 2, 4] {
            let devices: Vec<Device> = (0..k).map(Device::cpu).collect();
            for weight_first in [false, true] {
                let what = format!("k={k} causal={causal} weight_first={weight_first}");
                let split = ParallelSelfAttention::from_attention(&whole, &devices).unwrap();
                assert_eq!(split.parameters().len(), 3 * k + 1, "{what}: rank-major shards plus one bias");
                let (split_y, split_dx, split_grads) =
                    run(&split, &x.to_device(&devices[0]).unwrap(), &dy.to_device(&devices[0]).unwrap(), weight_first);
                assert_eq!(split.pending_gradient_bytes(), 0, "{what}: the slot is emptied by the second call");
                assert_near(&format!("{what} output"), &split_y, &y);
                assert_near(&format!("{what} input gradient"), &split_dx, &dx);
                // The shards' gradients made unsplit through a twin's shards.
                let mut twin = ParallelSelfAttention::from_attention(&whole, &devices).unwrap();
                for (param, grad) in twin.parameters_mut().iter_mut().zip(&split_grads) {
                    param.value.copy_from(grad).unwrap();
                }
                let gathered = twin.gather_parameters().unwrap();
                let names: Vec<&str> = gathered.iter().map(|(n, _)| n.as_str()).collect();
                assert_eq!(names, ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"]);
                for ((name, actual), expected) in gathered.iter().zip(&grads) {
                    assert_near(&format!("{what} gradient of {name}"), actual, expected);
                }
            }
        }
    }
}

#[test]
fn pytorch_packing_survives_the_stride_three_split_bit_for_bit() {
    let whole = attention(false, 3);
    // Every element distinct, so any misplaced row or column shows.
    let arange =
        |n: usize, dims: &[usize]| Tensor::from_vec((0..n).map(|i| i as f32).collect(), dims.to_vec(), &Device::host());
    let d = EMBED_DIM;
    let values = [
        ("in_proj_weight", arange(3 * d * d, &[3 * d, d]).unwrap()),
        ("in_proj_bias", arange(3 * d, &[3 * d]).unwrap()),
        ("out_proj.weight", arange(d * d, &[d, d]).unwrap()),
        ("out_proj.bias", arange(d, &[d]).unwrap()),
    ];
    for k in [2, 4] {
        let devices: Vec<Device> = (0..k).map(Device::cpu).collect();
        let mut split = ParallelSelfAttention::from_attention(&whole, &devices).unwrap();
        // Built from the layer: its unsplit tensors come back unchanged.
        for ((name, gathered), param) in split.gather_parameters().unwrap().iter().zip(whole.parameters()) {
            assert_eq!(name, &param.name);
            assert_eq!(gathered.to_vec_f32(), param.value.to_vec_f32(), "k={k}: {name} after the split");
        }
        for (name, value) in &values {
            split.load_unsplit(name, value).unwrap();
        }
        for ((name, gathered), (_, value)) in split.gather_parameters().unwrap().iter().zip(&values) {
            assert_eq!(gathered.dims(), value.dims(), "k={k}: {name} keeps PyTorch's shape");
            assert_eq!(gathered.to_vec_f32(), value.to_vec_f32(), "k={k}: {name} round trip");
        }
        // Shard 1 owns heads k..: its q rows start at row (HEADS / k) · head_dim of the q third.
        let head_dim = d / HEADS;
        let first_q_row = HEADS / k * head_dim;
        let shard1 = &split.parameters()[4].value;
        assert_eq!(shard1.dims(), &[3 * d / k, d]);
        assert_eq!(shard1.to_vec_f32()[0], (first_q_row * d) as f32, "k={k}: shard 1's first q row");
        assert_eq!(shard1.to_vec_f32()[d / k * d], ((d + first_q_row) * d) as f32, "k={k}: shard 1's first k row");
    }
}

#[test]
fn a_head_count_the_degree_does_not_divide_is_refused_naming_the_valid_degrees() {
    let whole = attention(false, 1);
    let devices: Vec<Device> = (0..3).map(Device::cpu).collect();
    let message = ParallelSelfAttention::from_attention(&whole, &devices).unwrap_err().to_string();
    assert!(message.contains("4 heads cannot be split over 3 devices"), "{message}");
    assert!(message.contains("1, 2, 4"), "{message}");
}

/// Bytes each device sends per call, against `collective::traffic` (the root sends the broadcast;
/// every rank its share of the ring all-reduce).
#[test]
fn one_all_reduce_each_way_and_only_the_gradient_broadcast_in_the_weight_pass() {
    let k = 2;
    let whole = attention(false, 5);
    let devices: Vec<Device> = (0..k).map(Device::cpu).collect();
    let split = ParallelSelfAttention::from_attention(&whole, &devices).unwrap();
    let mut rng = init::rng(4);
    let on_first = |t: Tensor| t.to_device(&devices[0]).unwrap();
    let (x, dy) = (on_first(uniform(&[2, 3, EMBED_DIM], &mut rng)), on_first(uniform(&[2, 3, EMBED_DIM], &mut rng)));
    let buffer = (4 * x.numel()) as u64;
    let (broadcast, all_reduce) =
        (traffic(CollectiveOp::Broadcast, buffer, k).bytes, traffic(CollectiveOp::AllReduce, buffer, k).bytes);
    let sent = |layer: &ParallelSelfAttention| layer.traffic().iter().map(|t| t.bytes).collect::<Vec<f64>>();
    let expected: Vec<f64> = (0..k).map(|r| all_reduce + if r == 0 { broadcast } else { 0.0 }).collect();

    let (_, saved) = split.forward(&[&x], &ForwardCtx::train(0)).unwrap();
    assert_eq!(sent(&split), expected, "forward: broadcast x, all-reduce y");
    split.reset_traffic();
    split.backward_input(&saved, &dy).unwrap();
    assert_eq!(sent(&split), expected, "backward_input: broadcast dy, all-reduce dx");
    split.reset_traffic();
    let mut grads = zero_grads(&split);
    split.backward_weight(&saved, &dy, &mut grads).unwrap();
    let only_broadcast: Vec<f64> = (0..k).map(|r| if r == 0 { broadcast } else { 0.0 }).collect();
    assert_eq!(sent(&split), only_broadcast, "backward_weight: broadcast dy (∂L/∂qkv was kept)");
}
