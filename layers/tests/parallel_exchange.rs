//! `ChannelParallelConvStack` (AlexNet-style exchange points) against unsplit references: outputs,
//! input gradients and weight gradients for k = 2 and 4, with exchanging convs (reference:
//! `Conv2d`) and grouped convs (reference: `nn.Conv2d(groups=k)` written here from `k` per-group
//! `Conv2d`s on channel slices); the bytes moved per configuration (a grouped conv moves nothing
//! on its input); parameter names and layouts; errors.
//!
//! Tolerance (as in `parallel.rs`): a tensor `a` passes against the reference `e` when every
//! element satisfies `|a - e| ≤ 1e-5 · ‖e‖∞` (`1e-7` absolute when `e` is all zeros): the split
//! layer sums the same products in another order (partial input gradients summed by the ring).
use conveyor_engine::collective::{CollectiveOp, traffic};
use conveyor_engine::{DType, Device, Error, ForwardCtx, Layer, Saved, Tensor, init};
use conveyor_layers::{ChannelParallelConvStack, Conv2d, Conv2dOptions, ConvStackLayer};
use rand::RngExt;
use rand::rngs::StdRng;

const RELATIVE: f32 = 1e-5;

fn assert_close(what: &str, actual: &Tensor, expected: &Tensor) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shapes");
    let (a, e) = (actual.to_vec_f32(), expected.to_vec_f32());
    let scale = e.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let bound = if scale == 0.0 { 1e-7 } else { RELATIVE * scale };
    for (i, (x, y)) in a.iter().zip(&e).enumerate() {
        assert!((x - y).abs() <= bound, "{what}[{i}]: {x} vs {y} (bound {bound})");
    }
}

fn devices(k: usize) -> Vec<Device> {
    (0..k).map(Device::cpu).collect()
}

fn random(dims: &[usize], rng: &mut StdRng) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec((0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect(), dims.to_vec(), &Device::host()).unwrap()
}

/// Channels `range` of an NCHW host tensor.
fn channels(t: &Tensor, range: std::ops::Range<usize>) -> Tensor {
    let [batch, c, h, w] = t.dims().try_into().unwrap();
    let values = t.to_vec_f32();
    let mut out = Vec::new();
    for n in 0..batch {
        out.extend_from_slice(&values[(n * c + range.start) * h * w..(n * c + range.end) * h * w]);
    }
    Tensor::from_vec(out, [batch, range.len(), h, w], &Device::host()).unwrap()
}

/// NCHW host tensors concatenated along channels.
fn concat_channels(parts: &[Tensor]) -> Tensor {
    let [batch, _, h, w] = parts[0].dims().try_into().unwrap();
    let total: usize = parts.iter().map(|p| p.dims()[1]).sum();
    let values: Vec<Vec<f32>> = parts.iter().map(Tensor::to_vec_f32).collect();
    let mut out = Vec::new();
    for n in 0..batch {
        for (p, v) in parts.iter().zip(&values) {
            let len = p.dims()[1] * h * w;
            out.extend_from_slice(&v[n * len..(n + 1) * len]);
        }
    }
    Tensor::from_vec(out, [batch, total, h, w], &Device::host()).unwrap()
}

/// Rows `range` of a host tensor along its first dimension.
fn rows(t: &Tensor, range: std::ops::Range<usize>) -> Tensor {
    let per_row = t.numel() / t.dims()[0];
    let mut dims = t.dims().to_vec();
    dims[0] = range.len();
    Tensor::from_vec(t.to_vec_f32()[range.start * per_row..range.end * per_row].to_vec(), dims, &Device::host())
        .unwrap()
}

fn concat_rows(parts: &[Tensor]) -> Tensor {
    let mut dims = parts[0].dims().to_vec();
    dims[0] = parts.iter().map(|p| p.dims()[0]).sum();
    Tensor::from_vec(parts.iter().flat_map(Tensor::to_vec_f32).collect(), dims, &Device::host()).unwrap()
}

fn relu_forward(t: &mut Tensor) {
    t.as_f32_mut().unwrap().iter_mut().for_each(|v| *v = v.max(0.0));
}

/// The unsplit reference of one conv: `groups` per-group `Conv2d`s (one for an exchanging conv),
/// group `g` mapping input channels block `g` to output channels block `g` (PyTorch's grouped
/// convolution).
struct Reference {
    groups: Vec<Conv2d>,
    relu: bool,
}

/// What the reference keeps per conv for backward: per-group saved state and the ReLU output.
struct ReferenceSaved {
    groups: Vec<Saved>,
    activation: Option<Tensor>,
}

impl Reference {
    fn new(spec: &ConvStackLayer, weight: &Tensor, bias: Option<&Tensor>, k: usize) -> Reference {
        let groups = if spec.exchange { 1 } else { k };
        let per_group = spec.out_channels / groups;
        let groups = (0..groups)
            .map(|g| {
                let range = g * per_group..(g + 1) * per_group;
                Conv2d::from_parameters(
                    rows(weight, range.clone()),
                    bias.map(|b| rows(b, range)),
                    spec.options.stride,
                    spec.options.padding,
                )
                .unwrap()
            })
            .collect();
        Reference { groups, relu: spec.relu }
    }

    fn forward(&self, x: &Tensor) -> (Tensor, ReferenceSaved) {
        let per_group = x.dims()[1] / self.groups.len();
        let ctx = ForwardCtx::train(0);
        let mut outputs = Vec::new();
        let mut saved = Vec::new();
        for (g, conv) in self.groups.iter().enumerate() {
            let (y, s) = conv.forward(&[&channels(x, g * per_group..(g + 1) * per_group)], &ctx).unwrap();
            outputs.push(y);
            saved.push(s);
        }
        let mut y = concat_channels(&outputs);
        let activation = self.relu.then(|| {
            relu_forward(&mut y);
            y.try_clone().unwrap()
        });
        (y, ReferenceSaved { groups: saved, activation })
    }

    /// Returns dx and the unsplit (weight, bias) gradients.
    fn backward(&self, saved: &ReferenceSaved, dy: &Tensor) -> (Tensor, Vec<Tensor>) {
        let mut dy = dy.try_clone().unwrap();
        if let Some(a) = &saved.activation {
            // d relu(z)/dz = 1 where the output is positive, else 0.
            for (g, &v) in dy.as_f32_mut().unwrap().iter_mut().zip(a.as_f32().unwrap()) {
                if v <= 0.0 {
                    *g = 0.0;
                }
            }
        }
        let per_group = dy.dims()[1] / self.groups.len();
        let (mut dxs, mut dws, mut dbs) = (Vec::new(), Vec::new(), Vec::new());
        for (g, (conv, s)) in self.groups.iter().zip(&saved.groups).enumerate() {
            let dy_g = channels(&dy, g * per_group..(g + 1) * per_group);
            dxs.push(conv.backward_input(s, &dy_g).unwrap().remove(0).unwrap());
            let mut grads: Vec<Tensor> = conv
                .parameters()
                .iter()
                .map(|p| Tensor::zeros(p.value.shape().clone(), DType::F32, &Device::host()).unwrap())
                .collect();
            conv.backward_weight(s, &dy_g, &mut grads).unwrap();
            dws.push(grads.remove(0));
            dbs.extend(grads);
        }
        let mut grads = vec![concat_rows(&dws)];
        if !dbs.is_empty() {
            grads.push(concat_rows(&dbs));
        }
        (concat_channels(&dxs), grads)
    }
}

/// A four-conv stack, every channel count divisible by 2 and 4:
/// conv0 4 → 8 (3x3, pad 1, ReLU), conv1 8 → 8 (3x3, pad 1, ReLU),
/// conv2 8 → 8 (1x1, no bias), conv3 8 → 4 (2x2, stride 2). `grouped[i]` makes conv i grouped.
fn stack_spec(grouped: [bool; 4]) -> Vec<ConvStackLayer> {
    let padded = Conv2dOptions { padding: (1, 1), ..Conv2dOptions::default() };
    let no_bias = Conv2dOptions { bias: false, ..Conv2dOptions::default() };
    let strided = Conv2dOptions { stride: (2, 2), ..Conv2dOptions::default() };
    let mut layers = vec![
        ConvStackLayer { options: padded, ..ConvStackLayer::new(4, 8, (3, 3)) },
        ConvStackLayer { options: padded, ..ConvStackLayer::new(8, 8, (3, 3)) },
        ConvStackLayer { options: no_bias, relu: false, ..ConvStackLayer::new(8, 8, (1, 1)) },
        ConvStackLayer { options: strided, relu: false, ..ConvStackLayer::new(8, 4, (2, 2)) },
    ];
    for (layer, grouped) in layers.iter_mut().zip(grouped) {
        layer.exchange = !grouped;
    }
    layers
}

/// Forward, backward_input and backward_weight of the split stack against the reference, on a
/// batch `[3, 4, 6, 6]`.
fn check_stack(k: usize, grouped: [bool; 4], seed: u64) {
    let mut rng = init::rng(seed);
    let devs = devices(k);
    let spec = stack_spec(grouped);
    let stack = ChannelParallelConvStack::new(&spec, &devs, &mut rng).unwrap();
    let unsplit = stack.gather_parameters().unwrap();
    let mut references = Vec::new();
    let mut at = 0;
    for layer in &spec {
        let weight = &unsplit[at].1;
        let bias = layer.options.bias.then(|| &unsplit[at + 1].1);
        at += 1 + usize::from(layer.options.bias);
        references.push(Reference::new(layer, weight, bias, k));
    }
    let x = random(&[3, 4, 6, 6], &mut rng);
    let ctx = ForwardCtx::train(0);
    let (y, saved) = stack.forward(&[&x.to_device(&devs[0]).unwrap()], &ctx).unwrap();
    let mut h = x.try_clone().unwrap();
    let mut ref_saved = Vec::new();
    for reference in &references {
        let (next, s) = reference.forward(&h);
        ref_saved.push(s);
        h = next;
    }
    let what = format!("k={k} grouped={grouped:?}");
    assert_close(&format!("{what} output"), &y, &h);

    let dy = random(y.dims(), &mut rng);
    let dx = stack.backward_input(&saved, &dy.to_device(&devs[0]).unwrap()).unwrap().remove(0).unwrap();
    let mut grads: Vec<Tensor> = stack
        .parameters()
        .iter()
        .map(|p| Tensor::zeros(p.value.shape().clone(), DType::F32, p.value.device()).unwrap())
        .collect();
    stack.backward_weight(&saved, &dy.to_device(&devs[0]).unwrap(), &mut grads).unwrap();
    let mut g = dy;
    let mut expected_grads = Vec::new();
    for (reference, s) in references.iter().zip(&ref_saved).rev() {
        let (dx_ref, param_grads) = reference.backward(s, &g);
        expected_grads.splice(0..0, param_grads);
        g = dx_ref;
    }
    assert_close(&format!("{what} input gradient"), &dx, &g);
    // Gather the shard gradients as the layer gathers its parameters: load them into a twin.
    let mut twin =
        ChannelParallelConvStack::from_parameters(&spec, &references_params(&unsplit, &spec), &devs).unwrap();
    for (param, grad) in twin.parameters_mut().iter_mut().zip(&grads) {
        param.value.copy_from(grad).unwrap();
    }
    for ((name, actual), expected) in twin.gather_parameters().unwrap().iter().zip(&expected_grads) {
        assert_close(&format!("{what} gradient of {name}"), actual, expected);
    }
}

fn references_params(unsplit: &[(String, Tensor)], spec: &[ConvStackLayer]) -> Vec<(Tensor, Option<Tensor>)> {
    let mut at = 0;
    spec.iter()
        .map(|layer| {
            let weight = unsplit[at].1.try_clone().unwrap();
            let bias = layer.options.bias.then(|| unsplit[at + 1].1.try_clone().unwrap());
            at += 1 + usize::from(layer.options.bias);
            (weight, bias)
        })
        .collect()
}

#[test]
fn exchanging_and_grouped_convs_match_the_unsplit_references() {
    for k in [2, 4] {
        // All exchanging (ChannelParallelConv2d's behaviour), then AlexNet's pattern with grouped
        // middle convs, then grouped from the first conv (input scattered, gradient gathered).
        check_stack(k, [false, false, false, false], 10 + k as u64);
        check_stack(k, [false, true, false, true], 20 + k as u64);
        check_stack(k, [true, true, false, false], 30 + k as u64);
    }
}

#[test]
fn one_device_is_the_unsplit_stack() {
    check_stack(1, [false, true, false, true], 7);
}

/// Bytes moved per configuration, on rank 1 (which is never the root of a broadcast, scatter or
/// gather): forward sends its share of each all-gather, `(k-1)/k` of the gathered tensor — one
/// per exchanging conv after the first, plus the output; a grouped conv moves nothing.
#[test]
fn bytes_moved_match_the_exchange_points() {
    let k = 2;
    let batch = 3;
    let f32_bytes = |n: usize| (4 * n) as u64;
    let model = |op, n| traffic(op, f32_bytes(n), k).bytes;
    // Activation sizes [batch, 8, 6, 6] after convs 0..=2; output [batch, 4, 3, 3].
    let hidden = batch * 8 * 36;
    let output = batch * 4 * 9;
    let mut figures = Vec::new();
    for grouped in [[false; 4], [false, true, false, true], [false, true, true, true]] {
        let mut rng = init::rng(3);
        let devs = devices(k);
        let stack = ChannelParallelConvStack::new(&stack_spec(grouped), &devs, &mut rng).unwrap();
        let x = random(&[batch, 4, 6, 6], &mut rng).to_device(&devs[0]).unwrap();
        stack.reset_traffic();
        let (y, saved) = stack.forward(&[&x], &ForwardCtx::train(0)).unwrap();
        let forward = stack.traffic()[1].bytes;
        let exchanges = (1..4).filter(|&i| !grouped[i]).count();
        let expected_forward =
            exchanges as f64 * model(CollectiveOp::AllGather, hidden) + model(CollectiveOp::AllGather, output);
        assert_eq!(forward, expected_forward, "forward bytes of rank 1 for grouped={grouped:?}");
        stack.reset_traffic();
        stack.backward_input(&saved, &y).unwrap();
        let backward = stack.traffic()[1].bytes;
        // Reduce-scatter of each exchanging conv's input gradient after the first; all-reduce of
        // the first conv's input gradient [batch, 4, 6, 6]; scatter of dy sends nothing from rank 1.
        let expected_backward = exchanges as f64 * model(CollectiveOp::ReduceScatter, hidden)
            + model(CollectiveOp::AllReduce, batch * 4 * 36);
        assert_eq!(backward, expected_backward, "backward bytes of rank 1 for grouped={grouped:?}");
        figures.push(format!("grouped={grouped:?}: forward {forward} B, backward_input {backward} B"));
    }
    eprintln!("bytes sent by rank 1 of 2, batch {batch}:\n{}", figures.join("\n"));
}

#[test]
fn parameters_use_sequential_names_and_grouped_layouts() {
    let mut rng = init::rng(4);
    let devs = devices(2);
    let spec = stack_spec([false, true, false, true]);
    let mut stack = ChannelParallelConvStack::new(&spec, &devs, &mut rng).unwrap();
    let shapes: Vec<(String, Vec<usize>)> =
        stack.export_parameter_shapes().into_iter().map(|(n, s)| (n, s.dims().to_vec())).collect();
    let expected = [
        ("0.weight", vec![8, 4, 3, 3]),
        ("0.bias", vec![8]),
        ("2.weight", vec![8, 4, 3, 3]), // grouped: in/k = 4
        ("2.bias", vec![8]),
        ("4.weight", vec![8, 8, 1, 1]),
        ("5.weight", vec![4, 4, 2, 2]), // grouped
        ("5.bias", vec![4]),
    ];
    let expected: Vec<(String, Vec<usize>)> = expected.iter().map(|(n, d)| (n.to_string(), d.clone())).collect();
    assert_eq!(shapes, expected);
    for (name, value) in stack.gather_parameters().unwrap() {
        let fresh = random(value.dims(), &mut rng);
        stack.import_parameter(&name, &fresh).unwrap();
        let back = stack.export_parameters().unwrap().into_iter().find(|(n, _)| *n == name).unwrap().1;
        assert!(back.bit_eq(&fresh), "{name}");
    }
    let zeros = |dims: &[usize]| Tensor::zeros(dims.to_vec(), DType::F32, &Device::host()).unwrap();
    assert!(matches!(stack.import_parameter("2.weight", &zeros(&[8, 8, 3, 3])), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(stack.import_parameter("1.weight", &zeros(&[8])), Err(Error::InvalidArgument { .. })));
}

#[test]
fn bad_configurations_are_errors() {
    let mut rng = init::rng(6);
    let devs = devices(4);
    // A grouped conv needs both channel counts divisible by k.
    let odd =
        [ConvStackLayer::new(4, 8, (1, 1)), ConvStackLayer { exchange: false, ..ConvStackLayer::new(8, 6, (1, 1)) }];
    assert!(matches!(ChannelParallelConvStack::new(&odd, &devs, &mut rng), Err(Error::InvalidArgument { .. })));
    let mismatched = [ConvStackLayer::new(4, 8, (1, 1)), ConvStackLayer::new(6, 8, (1, 1))];
    assert!(ChannelParallelConvStack::new(&mismatched, &devs, &mut rng).is_err());
    assert!(ChannelParallelConvStack::new(&[], &devs, &mut rng).is_err());
    let stack = ChannelParallelConvStack::new(&stack_spec([false; 4]), &devs, &mut rng).unwrap();
    let ctx = ForwardCtx::eval();
    let wrong = Tensor::zeros([1, 3, 6, 6], DType::F32, &devs[0]).unwrap();
    assert!(matches!(stack.forward(&[&wrong], &ctx), Err(Error::ShapeMismatch { .. })));
    let x = Tensor::zeros([1, 4, 6, 6], DType::F32, &devs[0]).unwrap();
    let (y, _) = stack.forward(&[&x], &ctx).unwrap();
    assert!(stack.backward_input(&Saved::default(), &y).is_err());
}
