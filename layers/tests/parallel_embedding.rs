//! `VocabParallelEmbedding` against the unsplit `Embedding`: a vocabulary of 10 over k = 1..=4
//! devices (shards of 3, 3, 2, 2 rows at k = 4, no padding), ids in every shard and repeated: the
//! output and the table's gradient are bit for bit the unsplit layer's (each id's row comes from
//! one shard, the others add zeros; each row's gradient is summed in the same order), the
//! unsplit table round-trips, and ids outside the vocabulary or more devices than rows are errors.
use conveyor_engine::{Device, ForwardCtx, Layer, Tensor, init};
use conveyor_layers::{Embedding, VocabParallelEmbedding};
use rand::RngExt;

mod common;
use common::zero_grads;

const VOCAB: usize = 10;
const DIM: usize = 3;

fn ids(values: &[usize], device: &Device) -> Tensor {
    Tensor::from_vec(values.iter().map(|&v| v as f32).collect(), [2, values.len() / 2], device).unwrap()
}

#[test]
fn vocabulary_shards_give_the_unsplit_output_and_gradient_bit_for_bit() {
    let whole = Embedding::new(VOCAB, DIM, &mut init::rng(5)).unwrap();
    let tokens = [9, 0, 3, 3, 7, 2, 5, 9, 1, 6, 4, 8];
    let mut rng = init::rng(6);
    let dy_values: Vec<f32> = (0..tokens.len() * DIM).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let host = Device::host();
    let (y, saved) = whole.forward(&[&ids(&tokens, &host)], &ForwardCtx::train(0)).unwrap();
    let dy = Tensor::from_vec(dy_values.clone(), y.shape().clone(), &host).unwrap();
    let mut grad = zero_grads(&whole);
    whole.backward_weight(&saved, &dy, &mut grad).unwrap();
    for k in 1..=4 {
        let devices: Vec<Device> = (0..k).map(Device::cpu).collect();
        let split = VocabParallelEmbedding::from_embedding(&whole, &devices).unwrap();
        if k == 4 {
            let rows: Vec<usize> = (0..4).map(|r| split.partition().len(r)).collect();
            assert_eq!(rows, [3, 3, 2, 2], "tensor_split's rows, no padding");
        }
        let (split_y, split_saved) = split.forward(&[&ids(&tokens, &devices[0])], &ForwardCtx::train(0)).unwrap();
        assert!(split_y.bit_eq(&y), "k={k}: the output has the unsplit bits");
        assert!(split.backward_input(&split_saved, &dy).unwrap()[0].is_none(), "ids take no gradient");
        let split_dy = dy.to_device(&devices[0]).unwrap();
        let mut grads = zero_grads(&split);
        split.backward_weight(&split_saved, &split_dy, &mut grads).unwrap();
        let mut twin = VocabParallelEmbedding::from_embedding(&whole, &devices).unwrap();
        for (param, g) in twin.parameters_mut().iter_mut().zip(&grads) {
            param.value.copy_from(g).unwrap();
        }
        let gathered = twin.gather_parameters().unwrap();
        assert_eq!(gathered[0].0, "weight");
        assert!(gathered[0].1.bit_eq(&grad[0]), "k={k}: the gradient has the unsplit bits");
        // The unsplit table round-trips.
        let table = split.gather_parameters().unwrap().remove(0).1;
        assert!(table.bit_eq(&whole.parameters()[0].value), "k={k}: gathered table");
    }
}

#[test]
fn bad_ids_and_too_many_devices_are_errors() {
    let whole = Embedding::new(VOCAB, DIM, &mut init::rng(5)).unwrap();
    let devices: Vec<Device> = (0..2).map(Device::cpu).collect();
    let split = VocabParallelEmbedding::from_embedding(&whole, &devices).unwrap();
    let err = split.forward(&[&ids(&[1, 10], &devices[0])], &ForwardCtx::train(0)).unwrap_err().to_string();
    assert!(err.contains("id 10"), "{err}");
    let many: Vec<Device> = (0..11).map(Device::cpu).collect();
    let err = VocabParallelEmbedding::from_embedding(&whole, &many).unwrap_err().to_string();
    assert!(err.contains("at most 10 devices"), "{err}");
}
