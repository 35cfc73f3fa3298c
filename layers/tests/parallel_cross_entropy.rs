//! `ColumnParallelLinear::with_split_cross_entropy` (a vocabulary-parallel output layer and its
//! loss) against the unsplit `Linear` followed by `CrossEntropyLoss`: a vocabulary of 11 over
//! k = 1..=4 devices (blocks of 3, 3, 3, 2 at k = 4: uneven, nothing padded), labels in every
//! block, `[rows, D]` and `[rows, T, D]` inputs. The loss, the input gradient and the weight
//! gradients agree (the loss's arithmetic on one block is `softmax_cross_entropy`'s bit for bit,
//! checked beside the ops; the logits are not: `Linear` multiplies through its packed weight, a
//! shard through `Tensor::matmul`). The logits never
//! cross between devices: the forward call sends less than an all-gather of them would. Wrong
//! labels, a wrong normalizer and a stray gradient are errors, not panics.
//!
//! Tolerance: besides the logits' products, only the sum of exponentials is added in another order (each
//! block's sum, then the blocks'), and the products of the gradients are summed per block: every
//! value within `1e-5` of the largest magnitude of its tensor, as in `tests/parallel.rs`.
use conveyor_engine::{DType, Device, ForwardCtx, Layer, Loss, Saved, Targets, Tensor, init};
use conveyor_layers::{ColumnParallelLinear, CrossEntropyLoss, Linear};
use rand::RngExt;

mod common;
use common::zero_grads;

const VOCAB: usize = 11;
const DIM: usize = 5;
const NORMALIZER: f32 = 8.0;

fn assert_close(what: &str, actual: &Tensor, expected: &Tensor) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shapes");
    let (a, e) = (actual.to_vec_f32(), expected.to_vec_f32());
    let scale = e.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(&e).enumerate() {
        assert!((x - y).abs() <= 1e-5 * scale, "{what}[{i}]: {x} vs {y}");
    }
}

/// The reference: the unsplit Linear, then the loss on its logits. Returns the loss, the input
/// gradient and the weight gradients.
fn unsplit(linear: &Linear, x: &Tensor, labels: &[usize]) -> (f64, Tensor, Vec<Tensor>) {
    let (logits, saved) = linear.forward(&[x], &ForwardCtx::train(0)).unwrap();
    let targets = Targets::Classes(labels.to_vec());
    let (loss, dy) = CrossEntropyLoss::new().loss_and_grad(&logits, &targets, NORMALIZER).unwrap();
    let dx = linear.backward_input(&saved, &dy).unwrap().remove(0).unwrap();
    let mut grads = zero_grads(linear);
    linear.backward_weight(&saved, &dy, &mut grads).unwrap();
    (loss, dx, grads)
}

/// The split layer's own loss; returns the loss, the input gradient, the unsplit weight gradients
/// and the saved state.
fn split(layer: &ColumnParallelLinear, x: &Tensor, labels: &[usize]) -> (f64, Tensor, Vec<Tensor>, Saved) {
    let ctx = ForwardCtx::train(0);
    let (loss, saved) = layer.forward_cross_entropy(&[x], labels, NORMALIZER, &ctx).expect("offered").unwrap();
    let one = Tensor::full(1.0, [1], DType::F32, &Device::host()).unwrap();
    let dx = layer.backward_input(&saved, &one).unwrap().remove(0).unwrap();
    let mut grads = zero_grads(layer);
    layer.backward_weight(&saved, &one, &mut grads).unwrap();
    // Gradients into an unsplit layout through a twin's shards.
    let mut twin = ColumnParallelLinear::from_parameters(
        &Tensor::zeros([VOCAB, DIM], DType::F32, &Device::host()).unwrap(),
        Some(&Tensor::zeros([VOCAB], DType::F32, &Device::host()).unwrap()),
        layer.devices(),
    )
    .unwrap();
    for (param, grad) in twin.parameters_mut().iter_mut().zip(&grads) {
        param.value.copy_from(grad).unwrap();
    }
    let unsplit = twin.gather_parameters().unwrap().into_iter().map(|(_, g)| g).collect();
    (loss, dx, unsplit, saved)
}

#[test]
fn the_split_loss_matches_the_unsplit_head_and_loss() {
    let linear = Linear::new(DIM, VOCAB, true, &mut init::rng(3)).unwrap();
    let mut rng = init::rng(4);
    for dims in [vec![6, DIM], vec![3, 2, DIM]] {
        let n: usize = dims.iter().product();
        let x =
            Tensor::from_vec((0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect(), dims.clone(), &Device::host())
                .unwrap();
        let rows = n / DIM;
        // Labels in every block (0, the last class, and between).
        let labels: Vec<usize> = (0..rows).map(|r| [0, 10, 4, 7, 2, 9][r % 6]).collect();
        let (want_loss, want_dx, want_grads) = unsplit(&linear, &x, &labels);
        for k in 1..=4 {
            let devices: Vec<Device> = (0..k).map(Device::cpu).collect();
            let layer = ColumnParallelLinear::from_linear(&linear, &devices).unwrap().with_split_cross_entropy();
            let x_here = x.to_device(&devices[0]).unwrap();
            let (loss, dx, grads, _) = split(&layer, &x_here, &labels);
            let what = format!("k = {k}, input {dims:?}");
            assert!((loss - want_loss).abs() <= 1e-6 * want_loss.abs(), "{what}: loss {loss} vs {want_loss}");
            assert_close(&format!("{what}: input gradient"), &dx, &want_dx);
            for (name, (got, want)) in ["weight", "bias"].iter().zip(grads.iter().zip(&want_grads)) {
                assert_close(&format!("{what}: {name} gradient"), got, want);
            }
        }
    }
}

#[test]
fn the_logits_never_cross_between_devices() {
    let (rows, k) = (8, 2);
    let linear = Linear::new(DIM, VOCAB, true, &mut init::rng(3)).unwrap();
    let devices: Vec<Device> = (0..k).map(Device::cpu).collect();
    let gathering = ColumnParallelLinear::from_linear(&linear, &devices).unwrap();
    let own_loss = ColumnParallelLinear::from_linear(&linear, &devices).unwrap().with_split_cross_entropy();
    assert!(own_loss.splits_cross_entropy() && !gathering.splits_cross_entropy());
    let x = Tensor::full(0.5, [rows, DIM], DType::F32, &devices[0]).unwrap();
    let labels = vec![3; rows];
    let sent = |layer: &ColumnParallelLinear| layer.traffic().iter().map(|t| t.bytes).sum::<f64>();
    let ctx = ForwardCtx::train(0);
    // Without it, the layer offers nothing and the runtime gathers the logits.
    assert!(gathering.forward_cross_entropy(&[&x], &labels, 1.0, &ctx).is_none());
    gathering.forward(&[&x], &ctx).unwrap();
    own_loss.forward_cross_entropy(&[&x], &labels, 1.0, &ctx).unwrap().unwrap();
    let (input_bytes, logit_bytes) = ((rows * DIM * 4) as f64, (rows * VOCAB * 4) as f64);
    let (gathered, own) = (sent(&gathering), sent(&own_loss));
    eprintln!("forward sent {gathered} bytes gathering the logits, {own} computing the loss over them split");
    // Both broadcast the input; the all-gather of the logits moves at least half of them, the
    // statistics 3 numbers per row and device.
    assert!(gathered >= input_bytes + logit_bytes / 2.0, "{gathered}");
    assert!(own <= input_bytes + (k * rows * 3 * 4) as f64, "{own}");
    assert!(own < gathered);
}

#[test]
fn bad_labels_normalizers_and_gradients_are_errors() {
    let linear = Linear::new(DIM, VOCAB, true, &mut init::rng(3)).unwrap();
    let devices: Vec<Device> = (0..2).map(Device::cpu).collect();
    let layer = ColumnParallelLinear::from_linear(&linear, &devices).unwrap().with_split_cross_entropy();
    let x = Tensor::full(0.5, [4, DIM], DType::F32, &devices[0]).unwrap();
    let ctx = ForwardCtx::train(0);
    let run = |labels: &[usize], normalizer: f32| layer.forward_cross_entropy(&[&x], labels, normalizer, &ctx).unwrap();
    let message = |labels: &[usize], normalizer| run(labels, normalizer).unwrap_err().to_string();
    assert!(message(&[0, 1, VOCAB, 2], 1.0).contains("label 11 at row 2"), "{}", message(&[0, 1, VOCAB, 2], 1.0));
    assert!(message(&[0, 1], 1.0).contains("4 labels"));
    assert!(message(&[0, 1, 2, 3], 0.0).contains("normalizer"));
    assert!(message(&[0, 1, 2, 3], f32::NAN).contains("normalizer"));
    // The layer stays usable after each error.
    let (_, saved) = run(&[0, 1, 2, 3], 4.0).unwrap();
    let logits_shaped = Tensor::zeros([4, VOCAB], DType::F32, &devices[0]).unwrap();
    assert!(layer.backward_input(&saved, &logits_shaped).is_err(), "a loss's saved state takes the [1] gradient");
    let one = Tensor::full(1.0, [1], DType::F32, &devices[0]).unwrap();
    assert!(layer.backward_input(&saved, &one).is_ok());
}
