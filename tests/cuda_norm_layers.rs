//! `LayerNorm`, `Embedding`, `PositionalEmbedding` and `MeanOverTokens` through the `Layer`
//! trait on every device (`device_cases`): forward, input gradient and two accumulated weight
//! gradients, each against the same layer on the CPU. The layers compute only through device ops
//! (`engine/src/device/ops/norm.rs`), whose kernels repeat the CPU's operations in its order; the
//! tolerance is that of `engine/tests/device_norm.rs`: bits equal, or
//! `|got_i - cpu_i| <= 4·u·max_j |cpu_j|` with `u = 2⁻²⁴`.
#[path = "../engine/tests/common/device_cases.rs"]
mod device_cases;

use std::process::ExitCode;

use anyhow::{Context, Result, ensure};
use conveyor::engine::{DType, Device, ForwardCtx, Layer, Tensor, init};
use conveyor::layers::{Embedding, LayerNorm, MeanOverTokens, PositionalEmbedding};
use device_cases::Case;

/// Unit roundoff of f32.
const U: f32 = 1.0 / 16_777_216.0;

/// A layer under test: its name, the layer, its input's values and dims.
type LayerCase = (&'static str, Box<dyn Layer>, Vec<f32>, Vec<usize>);

fn seeded(seed: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| (((i * 37 + seed * 11) % 23) as f32 - 11.0) * 0.09).collect()
}

/// Forward output, input gradient (when there is one) and the parameter gradients after two
/// accumulations, all downloaded.
fn run(name: &str, mut layer: Box<dyn Layer>, input: &[f32], dims: &[usize], device: &Device) -> Result<Vec<Vec<f32>>> {
    layer.to_device(device)?;
    let input = Tensor::from_vec(input.to_vec(), dims.to_vec(), device)?;
    let (output, saved) = layer.forward(&[&input], &ForwardCtx::train(1)).with_context(|| format!("{name} forward"))?;
    ensure!(output.device().same_device(device), "{name}: output on {}", output.device());
    let grad_output = Tensor::from_vec(seeded(7, output.numel()), output.shape().clone(), device)?;
    let mut results = vec![output.try_to_vec_f32()?];
    if let Some(grad_input) = layer.backward_input(&saved, &grad_output)?.into_iter().next().flatten() {
        results.push(grad_input.try_to_vec_f32()?);
    }
    let mut grads: Vec<Tensor> = layer
        .parameters()
        .iter()
        .map(|p| Tensor::zeros(p.value.shape().clone(), DType::F32, device))
        .collect::<conveyor::engine::Result<_>>()?;
    layer.backward_weight(&saved, &grad_output, &mut grads)?;
    layer.backward_weight(&saved, &grad_output, &mut grads)?;
    for grad in grads {
        results.push(grad.try_to_vec_f32()?);
    }
    Ok(results)
}

fn layers() -> Result<Vec<LayerCase>> {
    let mut rng = init::rng(3);
    let tokens = seeded(1, 2 * 4 * 8);
    let ids = vec![0.0, 4.0, 2.0, 4.0, 1.0, 0.0, 4.0, 3.0];
    Ok(vec![
        ("LayerNorm", Box::new(LayerNorm::new(8)?), tokens.clone(), vec![2, 4, 8]),
        ("Embedding", Box::new(Embedding::new(6, 8, &mut rng)?), ids, vec![2, 4]),
        ("PositionalEmbedding", Box::new(PositionalEmbedding::new(6, 8, &mut rng)?), tokens.clone(), vec![2, 4, 8]),
        ("MeanOverTokens", Box::new(MeanOverTokens::new()), tokens, vec![2, 4, 8]),
    ])
}

fn layers_match_the_cpu(device: &Device) -> Result<()> {
    for ((name, cpu_layer, input, dims), (_, layer, _, _)) in layers()?.into_iter().zip(layers()?) {
        let expected = run(name, cpu_layer, &input, &dims, &Device::cpu(0))?;
        let got = run(name, layer, &input, &dims, device)?;
        ensure!(got.len() == expected.len(), "{name}: {} results, expected {}", got.len(), expected.len());
        for (index, (got, expected)) in got.iter().zip(&expected).enumerate() {
            let atol = 4.0 * U * expected.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (i, (g, e)) in got.iter().zip(expected).enumerate() {
                ensure!(
                    g.to_bits() == e.to_bits() || (g - e).abs() <= atol,
                    "{name} result {index} on {device}: element {i} is {g:e}, the CPU's {e:e}"
                );
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cases = [Case::every_device("norm_and_sequence_layers_match_the_cpu", layers_match_the_cpu)];
    device_cases::run(&[], &cases, device_cases::devices())
}
