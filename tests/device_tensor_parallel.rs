//! The tensor-parallel layers on every device: each split layer (linears, the MLP pair, the
//! channel-split convolution, head-split attention, the vocabulary-split embedding) over two handles of the trial's
//! device (`cpu:0`,`cpu:1`, or two handles of one GPU, each with its own ledger and stream)
//! against its unsplit counterpart on the host, forward, input gradient and weight gradients.
//! On a GPU the shards compute with the device ops and exchange through the in-process group's
//! host fallback (two handles of one GPU are no NCCL group); `engine/tests/device_collectives.rs`
//! checks the NCCL path itself.
//!
//! One trial per device (`engine/tests/common/device_cases.rs`): without a GPU the `[cuda]` trials
//! are listed as ignored.
//!
//! Tolerance: the shards sum the products in another order than the unsplit layer (per-shard
//! partial sums, then the exchange; cuBLAS's order on a GPU), over inner dimensions of at most 64
//! here, so each element may differ by `2·(64 + 1)·u·Σ|terms|` (`u = 2⁻²⁴`, terms of magnitude
//! below 4): a tensor `a` passes against the unsplit `e` when every element satisfies
//! `|a - e| ≤ 1e-4 · max(‖e‖∞, 1)`.
#[path = "../engine/tests/common/device_cases.rs"]
mod device_cases;

use std::process::ExitCode;

use anyhow::{Result, ensure};
use conveyor::engine::{Device, ForwardCtx, Layer, Saved, Tensor, init};
use conveyor::layers::{
    ChannelParallelConv2d, ColumnParallelLinear, Conv2d, Conv2dOptions, Embedding, Linear, MlpActivation,
    MultiheadSelfAttention, ParallelMlp, ParallelSelfAttention, RowParallelLinear, VocabParallelEmbedding,
};
use device_cases::Case;
use rand::RngExt;
use rand::rngs::StdRng;

const RELATIVE: f32 = 1e-4;

fn check(what: &str, actual: &Tensor, expected: &Tensor) -> Result<()> {
    ensure!(actual.dims() == expected.dims(), "{what}: shape {:?}, expected {:?}", actual.dims(), expected.dims());
    let (a, e) = (actual.try_to_vec_f32()?, expected.try_to_vec_f32()?);
    let bound = RELATIVE * e.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(&e).enumerate() {
        ensure!((x - y).abs() <= bound, "{what}[{i}]: {x} vs {y} (bound {bound})");
    }
    Ok(())
}

/// The trial's device and a second handle of the same kind (its own ledger; on a GPU, the same GPU).
fn two_handles(device: &Device) -> Result<Vec<Device>> {
    let second = match device {
        Device::Cpu(_) => Device::cpu(1),
        Device::Cuda(cuda) => Device::cuda(cuda.ordinal(), None)?,
    };
    Ok(vec![device.clone(), second])
}

fn random(dims: &[usize], rng: &mut StdRng, device: &Device) -> Result<Tensor> {
    let n = dims.iter().product();
    Ok(Tensor::from_vec((0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect(), dims.to_vec(), device)?)
}

fn zero_grads(layer: &dyn Layer) -> Result<Vec<Tensor>> {
    layer
        .parameters()
        .iter()
        .map(|p| Ok(Tensor::zeros(p.value.shape().clone(), p.value.dtype(), p.value.device())?))
        .collect()
}

/// Forward, input gradient and weight gradients of `layer` on `x` and `dy`.
fn run(layer: &dyn Layer, x: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor, Vec<Tensor>)> {
    let (y, saved): (Tensor, Saved) = layer.forward(&[x], &ForwardCtx::train(0))?;
    let dx = layer.backward_input(&saved, dy)?.remove(0).ok_or_else(|| anyhow::anyhow!("no input gradient"))?;
    let mut grads = zero_grads(layer)?;
    layer.backward_weight(&saved, dy, &mut grads)?;
    Ok((y, dx, grads))
}

/// The split layer's per-shard gradients as unsplit tensors: loaded into `twin`'s shards and
/// gathered by name.
fn unsplit(twin: &mut dyn Layer, grads: &[Tensor]) -> Result<Vec<(String, Tensor)>> {
    for (param, grad) in twin.parameters_mut().iter_mut().zip(grads) {
        param.value.copy_from(grad)?;
    }
    Ok(twin.export_parameters()?)
}

/// `split` (with its `twin`) against `reference`, one layer on the host, on one batch.
fn compare(
    what: &str,
    split: &dyn Layer,
    twin: &mut dyn Layer,
    reference: &dyn Layer,
    x: &Tensor,
    dy: &Tensor,
) -> Result<()> {
    let (y, dx, grads) = run(split, x, dy)?;
    let host = Device::host();
    let (yr, dxr, grads_r) = run(reference, &x.to_device(&host)?, &dy.to_device(&host)?)?;
    ensure!(y.device().same_device(x.device()), "{what}: the output left the first shard's device");
    check(&format!("{what} output"), &y, &yr)?;
    check(&format!("{what} input gradient"), &dx, &dxr)?;
    let actual = unsplit(twin, &grads)?;
    for (p, expected) in reference.parameters().iter().zip(&grads_r) {
        let (_, got) = actual
            .iter()
            .find(|(name, _)| *name == p.name)
            .ok_or_else(|| anyhow::anyhow!("{what}: no gradient for `{}`", p.name))?;
        check(&format!("{what} gradient of {}", p.name), got, expected)?;
    }
    Ok(())
}

fn split_linears_match_the_unsplit_linear(device: &Device) -> Result<()> {
    let devices = two_handles(device)?;
    let mut rng = init::rng(3);
    let linear = Linear::new(7, 10, true, &mut rng)?;
    let x = random(&[2, 3, 7], &mut rng, device)?;
    let dy = random(&[2, 3, 10], &mut rng, device)?;
    let column = ColumnParallelLinear::from_linear(&linear, &devices)?;
    let mut twin = ColumnParallelLinear::from_linear(&linear, &devices)?;
    compare("column-parallel", &column, &mut twin, &linear, &x, &dy)?;
    let row = RowParallelLinear::from_linear(&linear, &devices)?;
    let mut twin = RowParallelLinear::from_linear(&linear, &devices)?;
    compare("row-parallel", &row, &mut twin, &linear, &x, &dy)
}

fn a_parallel_mlp_matches_linear_relu_linear(device: &Device) -> Result<()> {
    let devices = two_handles(device)?;
    let mut rng = init::rng(4);
    let (fc1, fc2) = (Linear::new(6, 9, true, &mut rng)?, Linear::new(9, 5, true, &mut rng)?);
    let split = ParallelMlp::from_linears(&fc1, MlpActivation::Relu, &fc2, &devices)?;
    let x = random(&[4, 6], &mut rng, device)?;
    let dy = random(&[4, 5], &mut rng, device)?;
    let (y, dx, grads) = run(&split, &x, &dy)?;
    // Reference: fc2(relu(fc1(x))) on the host, chained by hand.
    let host = Device::host();
    let ctx = ForwardCtx::train(0);
    let (h, s1) = fc1.forward(&[&x.to_device(&host)?], &ctx)?;
    let relu = conveyor::layers::Relu::new();
    let (a, sr) = relu.forward(&[&h], &ctx)?;
    let (yr, s2) = fc2.forward(&[&a], &ctx)?;
    let dyh = dy.to_device(&host)?;
    let da = fc2.backward_input(&s2, &dyh)?.remove(0).ok_or_else(|| anyhow::anyhow!("no fc2 input gradient"))?;
    let dh = relu.backward_input(&sr, &da)?.remove(0).ok_or_else(|| anyhow::anyhow!("no relu input gradient"))?;
    let dxr = fc1.backward_input(&s1, &dh)?.remove(0).ok_or_else(|| anyhow::anyhow!("no fc1 input gradient"))?;
    check("mlp output", &y, &yr)?;
    check("mlp input gradient", &dx, &dxr)?;
    let (mut g1, mut g2) = (zero_grads(&fc1)?, zero_grads(&fc2)?);
    fc1.backward_weight(&s1, &dh, &mut g1)?;
    fc2.backward_weight(&s2, &dyh, &mut g2)?;
    let mut twin = ParallelMlp::from_linears(&fc1, MlpActivation::Relu, &fc2, &devices)?;
    let actual = unsplit(&mut twin, &grads)?;
    let expected = [("fc1.weight", &g1[0]), ("fc1.bias", &g1[1]), ("fc2.weight", &g2[0]), ("fc2.bias", &g2[1])];
    for (name, e) in expected {
        let (_, got) = actual.iter().find(|(n, _)| n == name).ok_or_else(|| anyhow::anyhow!("no `{name}`"))?;
        check(&format!("mlp gradient of {name}"), got, e)?;
    }
    Ok(())
}

fn a_channel_split_conv_matches_the_unsplit_conv(device: &Device) -> Result<()> {
    let devices = two_handles(device)?;
    let mut rng = init::rng(5);
    let options = Conv2dOptions { padding: (1, 1), ..Conv2dOptions::default() };
    let conv = Conv2d::new(3, 5, (3, 3), options, &mut rng)?;
    let split = || ChannelParallelConv2d::from_parameters(conv.weight(), conv.bias(), (1, 1), (1, 1), &devices);
    let x = random(&[2, 3, 6, 5], &mut rng, device)?;
    let dy = random(&[2, 5, 6, 5], &mut rng, device)?;
    compare("channel-split conv", &split()?, &mut split()?, &conv, &x, &dy)
}

/// Attention split by heads (two of four per handle), causal and not, against the unsplit layer.
fn head_split_attention_matches_the_unsplit_attention(device: &Device) -> Result<()> {
    let devices = two_handles(device)?;
    for causal in [false, true] {
        let mut rng = init::rng(6);
        let attention = MultiheadSelfAttention::new(8, 4, causal, &mut rng)?;
        let x = random(&[2, 5, 8], &mut rng, device)?;
        let dy = random(&[2, 5, 8], &mut rng, device)?;
        let split = || ParallelSelfAttention::from_attention(&attention, &devices);
        compare(&format!("head-split attention (causal {causal})"), &split()?, &mut split()?, &attention, &x, &dy)?;
    }
    Ok(())
}

/// The token table split by vocabulary rows (11 rows: shards of 6 and 5), ids in both shards and
/// repeated: output and table gradient against the unsplit layer (ids take no gradient).
fn a_vocabulary_split_embedding_matches_the_unsplit_embedding(device: &Device) -> Result<()> {
    let devices = two_handles(device)?;
    let mut rng = init::rng(7);
    let embedding = Embedding::new(11, 6, &mut rng)?;
    let tokens = [10.0f32, 0.0, 5.0, 5.0, 6.0, 2.0, 10.0, 1.0];
    let ids = Tensor::from_vec(tokens.to_vec(), vec![2, 4], device)?;
    let dy = random(&[2, 4, 6], &mut rng, device)?;
    let split = VocabParallelEmbedding::from_embedding(&embedding, &devices)?;
    let (y, saved) = split.forward(&[&ids], &ForwardCtx::train(0))?;
    ensure!(y.device().same_device(device), "the output left the first shard's device");
    ensure!(split.backward_input(&saved, &dy)?[0].is_none(), "ids take no gradient");
    let mut grads = zero_grads(&split)?;
    split.backward_weight(&saved, &dy, &mut grads)?;
    let host = Device::host();
    let (yr, saved_r) = embedding.forward(&[&ids.to_device(&host)?], &ForwardCtx::train(0))?;
    let mut grads_r = zero_grads(&embedding)?;
    embedding.backward_weight(&saved_r, &dy.to_device(&host)?, &mut grads_r)?;
    check("vocabulary-split embedding output", &y, &yr)?;
    let mut twin = VocabParallelEmbedding::from_embedding(&embedding, &devices)?;
    let actual = unsplit(&mut twin, &grads)?;
    let (_, got) = actual.iter().find(|(name, _)| name == "weight").ok_or_else(|| anyhow::anyhow!("no `weight`"))?;
    check("vocabulary-split embedding gradient", got, &grads_r[0])
}

fn main() -> ExitCode {
    let cases: [Case<Device>; 5] = [
        Case::every_device("split_linears_match_the_unsplit_linear", split_linears_match_the_unsplit_linear),
        Case::every_device("a_parallel_mlp_matches_linear_relu_linear", a_parallel_mlp_matches_linear_relu_linear),
        Case::every_device(
            "a_channel_split_conv_matches_the_unsplit_conv",
            a_channel_split_conv_matches_the_unsplit_conv,
        ),
        Case::every_device(
            "head_split_attention_matches_the_unsplit_attention",
            head_split_attention_matches_the_unsplit_attention,
        ),
        Case::every_device(
            "a_vocabulary_split_embedding_matches_the_unsplit_embedding",
            a_vocabulary_split_embedding_matches_the_unsplit_embedding,
        ),
    ];
    device_cases::run(&[], &cases, device_cases::devices())
}
