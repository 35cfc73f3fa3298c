//! What a forward pass keeps for backward, measured on the device ledgers, against what the
//! layer's `cost()` tells the planner (`activation_bytes_per_sample`).
//!
//! Layers keep their inputs and outputs as shares (`Tensor::share`, no copy), so "what a layer
//! keeps" is the bytes that stay on the ledgers because of its `Saved` alone: the forward's input
//! and output are dropped before the ledgers are read. Every layer must match its cost exactly,
//! so a plan's activation memory is what the runtime will hold.
use conveyor_engine::{Device, ForwardCtx, Layer, Shape, Tensor, init};
use conveyor_layers::{
    Add, AvgPool2d, ChannelParallelConv2d, ChannelParallelConvStack, ColumnParallelLinear, Conv2d, Conv2dOptions,
    ConvStackLayer, Dropout, Embedding, Flatten, Gelu, GlobalAvgPool2d, LayerNorm, Linear, MaxPool2d, MeanOverTokens,
    MlpActivation, MultiheadSelfAttention, ParallelMlp, PositionalEmbedding, Relu, RowParallelLinear, Tanh,
};
use rand::RngExt;

const BATCH: usize = 3;

/// A layer and the dims (batch first) of each of its inputs.
type Case<'a> = (Box<dyn Layer>, Vec<&'a [usize]>);

fn random(dims: &[usize], device: &Device, seed: u64) -> Tensor {
    let mut rng = init::rng(seed);
    let n = dims.iter().product();
    Tensor::from_vec((0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect(), dims.to_vec(), device).unwrap()
}

/// Runs a training forward of `layer` on inputs of `dims` (batch first) made on `devices[0]`,
/// drops the inputs and the output, and checks that the bytes left on the ledgers of `devices`
/// (what `Saved` keeps) equal `BATCH` samples of the layer's `activation_bytes_per_sample`.
fn check(layer: &dyn Layer, dims: &[&[usize]], devices: &[Device], make: impl Fn(&[usize], &Device, u64) -> Tensor) {
    let in_use = || devices.iter().map(Device::memory_in_use).sum::<u64>();
    let before = in_use();
    let inputs: Vec<Tensor> = dims.iter().enumerate().map(|(i, d)| make(d, &devices[0], i as u64)).collect();
    let (output, saved) = layer.forward(&inputs.iter().collect::<Vec<_>>(), &ForwardCtx::train(7)).unwrap();
    drop((output, inputs));
    let kept = in_use() - before;
    let per_sample: Vec<Shape> = dims.iter().map(|d| Shape::new(d[1..].to_vec())).collect();
    let cost = layer.cost(&per_sample).unwrap();
    assert_eq!(
        kept,
        BATCH as u64 * cost.activation_bytes_per_sample,
        "{}: Saved keeps {kept} bytes, cost says {} per sample",
        layer.kind(),
        cost.activation_bytes_per_sample
    );
    drop(saved);
    assert_eq!(in_use(), before, "{}: everything is freed with Saved", layer.kind());
}

fn on<L: Layer>(mut layer: L, device: &Device) -> L {
    layer.to_device(device).unwrap();
    layer
}

#[test]
fn single_device_layers_keep_what_their_cost_says() {
    let device = Device::cpu(0);
    let devices = std::slice::from_ref(&device);
    let mut rng = init::rng(1);
    let padded = Conv2dOptions { padding: (1, 1), ..Conv2dOptions::default() };
    let image: &[usize] = &[BATCH, 2, 6, 6];
    let tokens: &[usize] = &[BATCH, 4, 8];
    let cases: Vec<Case> = vec![
        (Box::new(on(Linear::new(8, 5, true, &mut rng).unwrap(), &device)), vec![&[BATCH, 8]]),
        (Box::new(on(Linear::new(8, 5, false, &mut rng).unwrap(), &device)), vec![tokens]),
        (Box::new(Relu::new()), vec![image]),
        (Box::new(Gelu::new()), vec![image]),
        (Box::new(Tanh::new()), vec![image]),
        (Box::new(Dropout::new(0.5).unwrap()), vec![image]),
        (Box::new(Flatten::new()), vec![image]),
        (Box::new(Add::new()), vec![image, image]),
        (Box::new(on(Conv2d::new(2, 3, (3, 3), padded, &mut rng).unwrap(), &device)), vec![image]),
        (Box::new(on(Conv2d::new(2, 3, (1, 1), Conv2dOptions::default(), &mut rng).unwrap(), &device)), vec![image]),
        (Box::new(MaxPool2d::new((2, 2), (2, 2)).unwrap()), vec![image]),
        (Box::new(AvgPool2d::new((2, 2), (2, 2)).unwrap()), vec![image]),
        (Box::new(GlobalAvgPool2d::new()), vec![image]),
        (Box::new(on(LayerNorm::new(8).unwrap(), &device)), vec![tokens]),
        (Box::new(on(PositionalEmbedding::new(4, 8, &mut rng).unwrap(), &device)), vec![tokens]),
        (Box::new(MeanOverTokens::new()), vec![tokens]),
        (Box::new(on(MultiheadSelfAttention::new(8, 2, false, &mut rng).unwrap(), &device)), vec![tokens]),
    ];
    for (layer, dims) in &cases {
        check(layer.as_ref(), dims, devices, random);
    }
    let embedding = on(Embedding::new(10, 4, &mut rng).unwrap(), &device);
    let ids = |dims: &[usize], device: &Device, _| {
        let n = dims.iter().product();
        Tensor::from_vec((0..n).map(|i| (i % 10) as f32).collect(), dims.to_vec(), device).unwrap()
    };
    check(&embedding, &[&[BATCH, 5]], devices, ids);
}

#[test]
fn split_layers_keep_what_their_cost_says_over_all_their_devices() {
    let devices: Vec<Device> = (0..2).map(Device::cpu).collect();
    let mut rng = init::rng(2);
    let padded = Conv2dOptions { padding: (1, 1), ..Conv2dOptions::default() };
    let column = ColumnParallelLinear::new(6, 4, true, &devices, &mut rng).unwrap();
    check(&column, &[&[BATCH, 6]], &devices, random);
    let row = RowParallelLinear::new(6, 4, true, &devices, &mut rng).unwrap();
    check(&row, &[&[BATCH, 6]], &devices, random);
    for activation in [MlpActivation::Relu, MlpActivation::Gelu, MlpActivation::Identity] {
        let mlp = ParallelMlp::new(6, 8, 4, true, activation, &devices, &mut rng).unwrap();
        check(&mlp, &[&[BATCH, 6]], &devices, random);
    }
    let conv = ChannelParallelConv2d::new(2, 4, (3, 3), padded, &devices, &mut rng).unwrap();
    check(&conv, &[&[BATCH, 2, 5, 5]], &devices, random);
    // Every pattern of exchanged and grouped convs: a ReLU output that the next conv takes
    // without an exchange is one buffer, kept once.
    for exchanges in [[true, true, true], [true, false, true], [true, false, false], [true, true, false]] {
        let spec: Vec<ConvStackLayer> = [(2, 4), (4, 4), (4, 2)]
            .iter()
            .zip(exchanges)
            .map(|(&(cin, cout), exchange)| ConvStackLayer {
                options: padded,
                exchange,
                ..ConvStackLayer::new(cin, cout, (3, 3))
            })
            .collect();
        let stack = ChannelParallelConvStack::new(&spec, &devices, &mut rng).unwrap();
        check(&stack, &[&[BATCH, 2, 5, 5]], &devices, random);
    }
}
