//! Training on GPUs gives what training on CPUs gives: the `Trainer` trains a small MLP (Linear,
//! ReLU, cross-entropy, SGD with momentum and gradient clipping) for a few steps on `cuda:0`, and
//! as a 2-stage 1F1B pipeline on `cuda:0`,`cuda:1` (or, with one GPU, on two handles of `cuda:0`,
//! two workers with their own streams and ledgers), and the weights, losses and predictions are
//! compared with the same runs on CPU devices. The pooling layers, Dropout, Add, Conv2d and
//! self-attention give on a GPU, forward and backward, what they give on a CPU (LayerNorm and the
//! embedding layers: `cuda_norm_layers.rs`).
//!
//! One trial per case and device (`engine/tests/common/device_cases.rs`): without the `cuda`
//! feature, a driver or a GPU, each `[cuda]` trial is listed as ignored, by name, and the reason
//! printed once; the CPU trial checks the reference runs are deterministic.
//!
//! # Tolerance
//!
//! cuBLAS and the reduction kernels sum in another order than the CPU kernels, so results are not
//! bit-identical. Each product with inner dimension `k ≤ 32` may differ by `2·(k + 1)·u ≈ 4e-6`
//! of the magnitudes it sums (`u = 2⁻²⁴`); the elementwise kernels and the SGD update round as
//! the CPU does. Over 3 steps of SGD (lr 0.05, momentum 0.9, gradients clipped to norm 1) each
//! weight moves by at most `0.05·(1 + 1.9 + 2.71)·max|g| < 0.3·max|g|`, so its difference stays
//! below `1e-6`, far within the bound we check:
//! `max |w_gpu - w_cpu| / max(|w_cpu|, 1e-3) ≤ 1e-4` for every weight (as `common::max_rel_diff`
//! computes it), `1e-5` relative on the reported losses, and `1e-4` (same formula) on the
//! predicted logits.
//!
//! The pooling layers, Dropout and Add compute without products: their forward passes and the
//! gradients of non-overlapping windows round as on the CPU (bit for bit); the gradients of
//! overlapping windows (3x3 stride 1 here) sum at most 9 terms (each |g| ≤ 0.5) in another
//! order, so each differs from the CPU's by at most `2·9·u·Σ|terms| ≈ 4.8e-6` (u = 2^-24),
//! checked as an absolute difference ≤ 1e-5. (Relative to `max(|x|, 1e-3)`, as `max_rel_diff`
//! measures, a sum that cancels differs by 3e-5 on an H200: that measure cannot hold them.)
mod common;
#[path = "../engine/tests/common/device_cases.rs"]
mod device_cases;

use std::process::ExitCode;
use std::sync::Arc;

use device_cases::Case;

use common::{data, even_stages, max_rel_diff, weights};
use conveyor::engine::device::DeviceKind;
use conveyor::engine::optim::{OptimizerConfig, SgdConfig};
use conveyor::engine::placement::{SavedMemory, measure_node_memory, measure_node_memory_on_device};
use conveyor::engine::runtime::Trainer;
use conveyor::engine::{Device, ForwardCtx, Layer, Tensor, init};
use conveyor::layers::{
    Add, AvgPool2d, Conv2d, Conv2dOptions, CrossEntropyLoss, Dropout, GlobalAvgPool2d, MaxPool2d,
    MultiheadSelfAttention,
};
use conveyor::schedules::ScheduleKind;
use conveyor::zoo::{ModelSpec, mlp};

const STEPS: u64 = 3;
const DIMS: [usize; 4] = [12, 32, 32, 10];

/// What one run produced: the weights, the loss of every step, and the logits predicted after.
struct Run {
    weights: Vec<(String, Vec<f32>)>,
    losses: Vec<f64>,
    predictions: Vec<(String, Vec<f32>)>,
    peak_memory: Vec<u64>,
}

/// Trains the MLP on `devices` (one stage per device, 1F1B with 4 micro-batches).
fn train(devices: Vec<Device>) -> anyhow::Result<Run> {
    let graph = mlp(&DIMS, 5)?;
    let stages = even_stages(&graph, devices.len());
    let mut trainer = Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices(devices)
        .stages(stages)
        .schedule(ScheduleKind::OneFOneB, 1)
        .micro_batches(4)
        .optimizer(OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.9)))
        .max_grad_norm(Some(1.0))
        .seed(11)
        .build()?;
    let mut losses = Vec::new();
    let mut peak_memory = Vec::new();
    for step in 0..STEPS {
        let (x, y) = data(16, &[DIMS[0]], DIMS[3], step);
        let report = trainer.train_step(&x, &y)?;
        losses.push(report.loss);
        peak_memory = report.peak_memory;
    }
    let (x, _) = data(8, &[DIMS[0]], DIMS[3], 99);
    let logits = trainer.predict(&x)?;
    anyhow::ensure!(logits.device().same_device(&Device::host()), "predictions come back to the host");
    Ok(Run {
        weights: weights(&trainer),
        losses,
        predictions: vec![("logits".to_string(), logits.to_vec_f32())],
        peak_memory,
    })
}

fn compare(what: &str, gpu: &Run, cpu: &Run) {
    let rel = max_rel_diff(&gpu.weights, &cpu.weights);
    assert!(rel <= 1e-4, "{what}: weights differ from the CPU run by {rel:e} (relative)");
    for (step, (g, c)) in gpu.losses.iter().zip(&cpu.losses).enumerate() {
        assert!((g - c).abs() <= 1e-5 * c.abs(), "{what}: loss of step {step} is {g}, on CPU {c}");
    }
    let rel = max_rel_diff(&gpu.predictions, &cpu.predictions);
    assert!(rel <= 1e-4, "{what}: predictions differ from the CPU run by {rel:e} (relative)");
    assert!(gpu.peak_memory.iter().all(|&bytes| bytes > 0), "{what}: every GPU ledger counted the step");
}

fn an_mlp_trained_on_every_device_matches_one_cpu(device: &Device) -> anyhow::Result<()> {
    let one_cpu = train(vec![Device::cpu(0)])?;
    let two_cpus = train(vec![Device::cpu(0), Device::cpu(1)])?;
    // The pipeline reproduces one device bit for bit on CPUs; the GPU runs are held to that reference.
    anyhow::ensure!(one_cpu.weights == two_cpus.weights, "the CPU pipeline is not bit-exact");
    let Device::Cuda(_) = device else {
        let again = train(vec![device.clone()])?;
        anyhow::ensure!(again.weights == one_cpu.weights && again.losses == one_cpu.losses, "CPU runs differ");
        return Ok(());
    };
    let one_gpu = train(vec![device.clone()])?;
    compare(&device.to_string(), &one_gpu, &one_cpu);
    // Two stages: on two GPUs (peer or staged copies between them), or on two handles of one GPU
    // (two worker threads with their own streams, copies between two ledgers).
    let ordinals = device_cases::gpu_ordinals().map_err(anyhow::Error::msg)?;
    let second = ordinals.iter().copied().find(|&o| format!("cuda:{o}") != device.to_string()).unwrap_or(ordinals[0]);
    let devices = vec![device.clone(), Device::cuda(second, None)?];
    let what = format!("{},cuda:{second}", device);
    let two_gpus = train(devices)?;
    compare(&what, &two_gpus, &two_cpus);
    Ok(())
}

/// One layer's forward (training, seed 3) and input gradients on `device` and on the host.
fn forward_and_backward(
    layer: &mut dyn Layer,
    inputs: &[&Tensor],
    device: &Device,
) -> anyhow::Result<Vec<(String, Vec<f32>)>> {
    layer.to_device(device)?;
    let inputs: Vec<Tensor> = inputs.iter().map(|t| t.to_device(device)).collect::<Result<_, _>>()?;
    let inputs: Vec<&Tensor> = inputs.iter().collect();
    let (output, saved) = layer.forward(&inputs, &ForwardCtx::train(3))?;
    let grad_values: Vec<f32> = (0..output.numel()).map(|i| ((i * 7) % 11) as f32 * 0.1 - 0.5).collect();
    let grad_output = Tensor::from_vec(grad_values, output.shape().clone(), device)?;
    let mut results = vec![("output".to_string(), output.try_to_vec_f32()?)];
    for (i, grad) in layer.backward_input(&saved, &grad_output)?.into_iter().enumerate() {
        let grad = grad.ok_or_else(|| anyhow::anyhow!("no gradient for input {i}"))?;
        anyhow::ensure!(grad.device().same_device(device), "input {i}'s gradient is on {}", grad.device());
        results.push((format!("input {i} gradient"), grad.try_to_vec_f32()?));
    }
    let mut param_grads: Vec<Tensor> = layer
        .parameters()
        .iter()
        .map(|p| Tensor::zeros(p.value.shape().clone(), conveyor::engine::DType::F32, device))
        .collect::<Result<_, _>>()?;
    layer.backward_weight(&saved, &grad_output, &mut param_grads)?;
    for (param, grad) in layer.parameters().iter().zip(&param_grads) {
        anyhow::ensure!(grad.device().same_device(device), "{}'s gradient is on {}", param.name, grad.device());
        results.push((format!("{} gradient", param.name), grad.try_to_vec_f32()?));
    }
    Ok(results)
}

/// `‖gpu − cpu‖ / ‖cpu‖`, in f64.
fn norm_rel_diff(gpu: &[f32], cpu: &[f32]) -> f64 {
    let norm = |v: &mut dyn Iterator<Item = f32>| v.map(|x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    norm(&mut gpu.iter().zip(cpu).map(|(a, b)| a - b)) / norm(&mut cpu.iter().copied()).max(1e-30)
}

fn pooling_dropout_and_add_on_a_gpu_match_the_cpu(device: &Device) -> anyhow::Result<()> {
    let host = Device::host();
    let image = Tensor::from_vec(
        (0..2 * 3 * 7 * 6).map(|i| ((i * 5) % 13) as f32 * 0.15 - 0.9).collect(),
        [2, 3, 7, 6],
        &host,
    )?;
    let tokens = Tensor::from_vec((0..2 * 4 * 8).map(|i| (i % 5) as f32 * 0.1).collect(), [2, 4, 8], &host)?;
    let other = Tensor::from_vec((0..2 * 4 * 8).map(|i| (i % 3) as f32 * -0.3).collect(), [2, 4, 8], &host)?;
    type Make = fn() -> Box<dyn Layer>;
    let layers: Vec<(&str, Make, Vec<&Tensor>)> = vec![
        ("MaxPool2d 2x2/2", || Box::new(MaxPool2d::new((2, 2), (2, 2)).unwrap()), vec![&image]),
        ("MaxPool2d 3x3/1 pad 1", || Box::new(MaxPool2d::with_padding((3, 3), (1, 1), (1, 1)).unwrap()), vec![&image]),
        ("AvgPool2d 2x2/2", || Box::new(AvgPool2d::new((2, 2), (2, 2)).unwrap()), vec![&image]),
        ("AvgPool2d 3x3/1 pad 1", || Box::new(AvgPool2d::with_padding((3, 3), (1, 1), (1, 1)).unwrap()), vec![&image]),
        ("GlobalAvgPool2d", || Box::new(GlobalAvgPool2d::new()), vec![&image]),
        ("Dropout", || Box::new(Dropout::new(0.5).unwrap()), vec![&tokens]),
        ("Add", || Box::new(Add::new()), vec![&tokens, &other]),
    ];
    for (name, make, inputs) in layers {
        let on_gpu = forward_and_backward(make().as_mut(), &inputs, device)?;
        let on_cpu = forward_and_backward(make().as_mut(), &inputs, &host)?;
        // Everything but the overlapping windows' gradients rounds as on the CPU. Those sum up to
        // nine contributions in another order, within an absolute bound (module docs); a sum
        // that cancels can differ by far more relatively (3e-5 of max(|x|, 1e-3) on an H200).
        let overlapping = name.contains("3x3/1");
        for ((what, gpu), (_, cpu)) in on_gpu.iter().zip(&on_cpu) {
            if overlapping && what != "output" {
                let diff = gpu.iter().zip(cpu).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                anyhow::ensure!(diff <= 1e-5, "{name} on {device}: the {what} differs from the CPU's by {diff:e}");
                continue;
            }
            let same = gpu.iter().map(|v| v.to_bits()).eq(cpu.iter().map(|v| v.to_bits()));
            anyhow::ensure!(same, "{name} on {device}: the {what} differs from the CPU's bits");
        }
    }
    Ok(())
}

/// Conv2d (the lane-kernel and im2col paths, stride 2) and self-attention (causal and not),
/// forward and every gradient, on the GPU against the CPU: `‖gpu − cpu‖ / ‖cpu‖ ≤ 1e-5` for each
/// result, the products summing in another order. (Element by element a sum that cancels to near
/// zero differs by far more, relatively: 2.1e-4 by `max_rel_diff`'s measure for a conv weight
/// gradient on an H200. The element-wise error bounds are held in `engine/tests/device_conv.rs`
/// and `device_attention.rs`; this case checks the layers' plumbing: dispatch, layouts, saved
/// state.)
fn conv_and_attention_on_a_gpu_match_the_cpu(device: &Device) -> anyhow::Result<()> {
    let host = Device::host();
    let image = Tensor::from_vec(
        (0..2 * 3 * 8 * 8).map(|i| ((i * 5) % 13) as f32 * 0.15 - 0.9).collect(),
        [2, 3, 8, 8],
        &host,
    )?;
    let tokens =
        Tensor::from_vec((0..3 * 5 * 8).map(|i| ((i * 3) % 7) as f32 * 0.2 - 0.6).collect(), [3, 5, 8], &host)?;
    type Make = fn() -> Box<dyn Layer>;
    let layers: Vec<(&str, Make, Vec<&Tensor>)> = vec![
        (
            "Conv2d 3x3 pad 1",
            || {
                let options = Conv2dOptions { padding: (1, 1), ..Conv2dOptions::default() };
                Box::new(Conv2d::new(3, 4, (3, 3), options, &mut init::rng(5)).unwrap())
            },
            vec![&image],
        ),
        (
            "Conv2d 3x3/2",
            || {
                let options = Conv2dOptions { stride: (2, 2), ..Conv2dOptions::default() };
                Box::new(Conv2d::new(3, 2, (3, 3), options, &mut init::rng(6)).unwrap())
            },
            vec![&image],
        ),
        (
            "MultiheadSelfAttention",
            || Box::new(MultiheadSelfAttention::new(8, 2, false, &mut init::rng(7)).unwrap()),
            vec![&tokens],
        ),
        (
            "MultiheadSelfAttention causal",
            || Box::new(MultiheadSelfAttention::new(8, 4, true, &mut init::rng(8)).unwrap()),
            vec![&tokens],
        ),
    ];
    for (name, make, inputs) in layers {
        let on_gpu = forward_and_backward(make().as_mut(), &inputs, device)?;
        let on_cpu = forward_and_backward(make().as_mut(), &inputs, &host)?;
        for ((what, gpu), (_, cpu)) in on_gpu.iter().zip(&on_cpu) {
            let diff = norm_rel_diff(gpu, cpu);
            anyhow::ensure!(
                diff <= 1e-5,
                "{name} on {device}: the {what} differs from the CPU's by {diff:e} (norm-wise)"
            );
        }
    }
    Ok(())
}

/// Every zoo layer's memory on `device`, measured on its ledger call by call, stays within what
/// the memory plan counts for it there: the figures measured on the host (new output, saved
/// tensors, each call's peak), plus on a GPU the scratch its cost declares for the GPU ops
/// (`LayerCost::gpu_scratch_bytes_per_sample`). This is what makes the plan a bound on a GPU
/// (`examples/gpu_check.rs` holds whole runs to it); on the CPU, whose kernels keep scratch off
/// the ledger, the two measurements agree.
fn zoo_layers_stay_within_their_planned_memory(device: &Device) -> anyhow::Result<()> {
    const ROWS: usize = 16;
    let mut problems = Vec::new();
    for model in ["mlp:64,128,128,10", "cnn", "resnet", "transformer"] {
        let spec: ModelSpec = model.parse()?;
        let mut graph = spec.build(7)?;
        let on_host = measure_node_memory(&graph, ROWS)?;
        for (id, _) in &on_host {
            graph
                .layer_mut(*id)
                .ok_or_else(|| anyhow::anyhow!("node {} is not a layer", id.index()))?
                .to_device(device)?;
        }
        let on_device = measure_node_memory_on_device(&graph, ROWS, device)?;
        anyhow::ensure!(
            on_device.len() == on_host.len(),
            "{model}: {} layers measured on {device}, {} on the host",
            on_device.len(),
            on_host.len()
        );
        for ((id, host), (_, measured)) in on_host.iter().zip(&on_device) {
            let mut planned = host.clone();
            if device.kind() == DeviceKind::Cuda {
                planned.add_call_scratch(graph.cost(*id)?.gpu_scratch_bytes_per_sample.times(ROWS as u64));
            }
            let node = &graph.node(*id)?.name;
            let calls = [
                ("forward", &measured.forward_peak, &planned.forward_peak),
                ("input-gradient", &measured.backward_input_peak, &planned.backward_input_peak),
                ("weight-gradient", &measured.backward_weight_peak, &planned.backward_weight_peak),
            ];
            for (call, measured, planned) in calls {
                let (measured, planned) =
                    (measured.first().copied().unwrap_or(0), planned.first().copied().unwrap_or(0));
                if measured > planned {
                    problems
                        .push(format!("{model} {node}: {call} call {measured} bytes on {device}, planned {planned}"));
                }
            }
            let own = |m: &conveyor::engine::placement::NodeMemory| -> u64 {
                m.saved.iter().map(|s| if let SavedMemory::Own { bytes, .. } = s { *bytes } else { 0 }).sum()
            };
            if own(measured) > own(host) || measured.output_bytes != host.output_bytes {
                problems.push(format!(
                    "{model} {node}: saves {} and outputs {} bytes on {device}, {} and {} on the host",
                    own(measured),
                    measured.output_bytes,
                    own(host),
                    host.output_bytes
                ));
            }
        }
    }
    anyhow::ensure!(problems.is_empty(), "memory beyond the plan's figures:\n{}", problems.join("\n"));
    Ok(())
}

fn main() -> ExitCode {
    let cases: [Case<Device>; 4] = [
        Case::every_device(
            "an_mlp_trained_on_every_device_matches_one_cpu",
            an_mlp_trained_on_every_device_matches_one_cpu,
        ),
        Case::gpus("pooling_dropout_and_add_on_a_gpu_match_the_cpu", pooling_dropout_and_add_on_a_gpu_match_the_cpu),
        Case::gpus("conv_and_attention_on_a_gpu_match_the_cpu", conv_and_attention_on_a_gpu_match_the_cpu),
        Case::every_device("zoo_layers_stay_within_their_planned_memory", zoo_layers_stay_within_their_planned_memory),
    ];
    device_cases::run(&[], &cases, device_cases::devices())
}
