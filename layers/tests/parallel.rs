//! Tensor-parallel layers against their unsplit counterparts: outputs, input gradients and weight
//! gradients for Linear column/row pairs, the Megatron MLP and channel-split conv stacks over
//! k = 1..=4 devices (feature counts divisible by k and not); a Linear too large for one device's
//! budget trained split over 4; the bytes each exchange moves against the ring formula; and
//! errors instead of panics.
//!
//! Tolerance: a split layer sums the same products in another order (partial sums per shard, then
//! the ring's order), so each value may differ by f32 rounding of sums of at most a few dozen
//! terms. A tensor `a` passes against the unsplit `e` when every element satisfies
//! `|a - e| ≤ 1e-5 · ‖e‖∞`, relative to the tensor's largest magnitude (and `1e-7` absolute when
//! `e` is all zeros).
use std::time::Instant;

use conveyor_engine::collective::{CollectiveOp, Traffic, traffic};
use conveyor_engine::optim::{Optimizer, SgdConfig};
use conveyor_engine::{DType, Device, Error, ForwardCtx, Layer, Saved, Tensor, init};
use conveyor_layers::{
    ChannelParallelConv2d, ColumnParallelLinear, Conv2d, Conv2dOptions, Linear, MlpActivation, ParallelMlp, Relu,
    RowParallelLinear,
};
use rand::RngExt;
use rand::rngs::StdRng;

mod common;
use common::zero_grads;

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

fn random(dims: &[usize], rng: &mut StdRng, device: &Device) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec((0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect(), dims.to_vec(), device).unwrap()
}

/// Forward, backward_input and backward_weight of one layer on `x`, with output gradient `dy`
/// (both moved to `device`). Returns (y, dx, weight grads).
fn run_layer(layer: &dyn Layer, x: &Tensor, dy: &Tensor, device: &Device) -> (Tensor, Tensor, Vec<Tensor>) {
    let (y, saved) = layer.forward(&[&x.to_device(device).unwrap()], &ForwardCtx::train(0)).unwrap();
    let dy = dy.to_device(device).unwrap();
    let dx = layer.backward_input(&saved, &dy).unwrap().remove(0).unwrap();
    let mut grads = zero_grads(layer);
    layer.backward_weight(&saved, &dy, &mut grads).unwrap();
    (y, dx, grads)
}

/// Per-shard gradients turned into unsplit tensors by loading them into a twin layer's shards and
/// gathering them (only public API).
fn unsplit_grads<L: Layer>(
    twin: &mut L,
    grads: &[Tensor],
    gather: impl Fn(&L) -> Vec<(String, Tensor)>,
) -> Vec<(String, Tensor)> {
    for (param, grad) in twin.parameters_mut().iter_mut().zip(grads) {
        param.value.copy_from(grad).unwrap();
    }
    gather(twin)
}

/// Compares a split layer with its unsplit reference on one batch.
fn compare<L: Layer>(
    what: &str,
    split: &L,
    twin: &mut L,
    gather: impl Fn(&L) -> Vec<(String, Tensor)>,
    reference: &[(&str, &dyn Layer)],
    x: &Tensor,
    dy: &Tensor,
) {
    let (y, dx, grads) = run_layer(split, x, dy, &split.parameters()[0].value.device().clone());
    // Reference: the unsplit layers chained on the host.
    let host = Device::host();
    let mut acts = vec![x.try_clone().unwrap()];
    let mut saveds: Vec<Saved> = Vec::new();
    for (_, layer) in reference {
        let (out, saved) = layer.forward(&[acts.last().unwrap()], &ForwardCtx::train(0)).unwrap();
        acts.push(out);
        saveds.push(saved);
    }
    let mut grad = dy.to_device(&host).unwrap();
    let mut expected_grads = Vec::new();
    for ((name, layer), saved) in reference.iter().zip(&saveds).rev() {
        let mut g = zero_grads(*layer);
        layer.backward_weight(saved, &grad, &mut g).unwrap();
        for (p, g) in layer.parameters().iter().zip(g) {
            let full = if name.is_empty() { p.name.clone() } else { format!("{name}.{}", p.name) };
            expected_grads.push((full, g));
        }
        grad = layer.backward_input(saved, &grad).unwrap().remove(0).unwrap();
    }
    assert_close(&format!("{what} output"), &y, acts.last().unwrap());
    assert_close(&format!("{what} input gradient"), &dx, &grad);
    let actual = unsplit_grads(twin, &grads, gather);
    assert_eq!(actual.len(), expected_grads.len(), "{what}: parameter count");
    for (name, g) in actual {
        let (_, e) = expected_grads.iter().find(|(n, _)| *n == name).unwrap_or_else(|| panic!("{what}: no `{name}`"));
        assert_close(&format!("{what} gradient of {name}"), &g, e);
    }
}

#[test]
fn column_and_row_linears_match_the_unsplit_linear() {
    let mut rng = init::rng(1);
    for k in 1..=4 {
        for (in_features, out_features) in [(12, 12), (7, 10), (5, 9)] {
            for bias in [true, false] {
                let linear = Linear::new(in_features, out_features, bias, &mut rng).unwrap();
                let devs = devices(k);
                let x = random(&[2, 3, in_features], &mut rng, &Device::host());
                let dy = random(&[2, 3, out_features], &mut rng, &Device::host());
                let reference: [(&str, &dyn Layer); 1] = [("", &linear)];
                let what = format!("k={k} in={in_features} out={out_features} bias={bias}");
                if k <= out_features {
                    let split = ColumnParallelLinear::from_linear(&linear, &devs).unwrap();
                    let mut twin = ColumnParallelLinear::from_linear(&linear, &devs).unwrap();
                    let gather = |l: &ColumnParallelLinear| l.gather_parameters().unwrap();
                    compare(&format!("column {what}"), &split, &mut twin, gather, &reference, &x, &dy);
                }
                if k <= in_features {
                    let split = RowParallelLinear::from_linear(&linear, &devs).unwrap();
                    let mut twin = RowParallelLinear::from_linear(&linear, &devs).unwrap();
                    let gather = |l: &RowParallelLinear| l.gather_parameters().unwrap();
                    compare(&format!("row {what}"), &split, &mut twin, gather, &reference, &x, &dy);
                }
            }
        }
    }
}

#[test]
fn parallel_mlp_matches_linear_activation_linear() {
    let mut rng = init::rng(2);
    for k in 1..=4 {
        for (activation, act_layer) in [(MlpActivation::Relu, Some(Relu::new())), (MlpActivation::Identity, None)]
            .into_iter()
            .chain([(MlpActivation::Gelu, None)])
        {
            for hidden in [8, 11] {
                let fc1 = Linear::new(6, hidden, true, &mut rng).unwrap();
                let fc2 = Linear::new(hidden, 5, true, &mut rng).unwrap();
                let devs = devices(k);
                let split = ParallelMlp::from_linears(&fc1, activation, &fc2, &devs).unwrap();
                let mut twin = ParallelMlp::from_linears(&fc1, activation, &fc2, &devs).unwrap();
                let x = random(&[4, 6], &mut rng, &Device::host());
                let dy = random(&[4, 5], &mut rng, &Device::host());
                let gelu = conveyor_layers::Gelu::new();
                let mut reference: Vec<(&str, &dyn Layer)> = vec![("fc1", &fc1)];
                match (&act_layer, activation) {
                    (Some(relu), _) => reference.push(("", relu)),
                    (None, MlpActivation::Gelu) => reference.push(("", &gelu)),
                    _ => {}
                }
                reference.push(("fc2", &fc2));
                let what = format!("mlp k={k} hidden={hidden} {activation:?}");
                compare(
                    &what,
                    &split,
                    &mut twin,
                    |l: &ParallelMlp| l.gather_parameters().unwrap(),
                    &reference,
                    &x,
                    &dy,
                );
            }
        }
    }
}

/// The hidden gradient both backward calls need is computed once: the first call leaves it in a
/// slot (a hidden activation's bytes over the shards), the second takes it, and either order gives
/// the same bits as the other.
#[test]
fn parallel_mlp_computes_its_hidden_gradient_once_in_either_order() {
    let mut rng = init::rng(5);
    let (fc1, fc2) = (Linear::new(6, 10, true, &mut rng).unwrap(), Linear::new(10, 5, true, &mut rng).unwrap());
    let devs = devices(2);
    let x = random(&[3, 4, 6], &mut rng, &devs[0]);
    let dy = random(&[3, 4, 5], &mut rng, &devs[0]);
    let hidden_bytes = 3 * 4 * 10 * 4;
    let run = |weight_first: bool| -> (Vec<f32>, Vec<Vec<f32>>) {
        let mlp = ParallelMlp::from_linears(&fc1, MlpActivation::Gelu, &fc2, &devs).unwrap();
        let (_, saved) = mlp.forward(&[&x], &ForwardCtx::train(0)).unwrap();
        let mut grads = zero_grads(&mlp);
        let dx = if weight_first {
            mlp.backward_weight(&saved, &dy, &mut grads).unwrap();
            assert_eq!(mlp.pending_gradient_bytes(), hidden_bytes, "the weight call leaves the hidden gradient");
            mlp.backward_input(&saved, &dy).unwrap().remove(0).unwrap()
        } else {
            let dx = mlp.backward_input(&saved, &dy).unwrap().remove(0).unwrap();
            assert_eq!(mlp.pending_gradient_bytes(), hidden_bytes, "the input call leaves the hidden gradient");
            mlp.backward_weight(&saved, &dy, &mut grads).unwrap();
            dx
        };
        assert_eq!(mlp.pending_gradient_bytes(), 0, "the second call empties the slot");
        (dx.to_vec_f32(), grads.iter().map(Tensor::to_vec_f32).collect())
    };
    let (input_first, weight_first) = (run(false), run(true));
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&input_first.0), bits(&weight_first.0), "input gradient");
    for (a, b) in input_first.1.iter().zip(&weight_first.1) {
        assert_eq!(bits(a), bits(b), "parameter gradients");
    }
}

/// A conv stack: split conv (3 → c1, 3x3, padding 1) → ReLU → split conv (c1 → c2, 2x2, stride 2).
#[test]
fn channel_split_conv_stacks_match_the_unsplit_stack() {
    let mut rng = init::rng(3);
    for k in 1..=4 {
        for (c1, c2) in [(4, 8), (5, 7)] {
            let padded = Conv2dOptions { padding: (1, 1), ..Conv2dOptions::default() };
            let strided = Conv2dOptions { stride: (2, 2), ..Conv2dOptions::default() };
            let conv1 = Conv2d::new(3, c1, (3, 3), padded, &mut rng).unwrap();
            let conv2 = Conv2d::new(c1, c2, (2, 2), strided, &mut rng).unwrap();
            let devs = devices(k);
            let split = |conv: &Conv2d, o: Conv2dOptions| {
                ChannelParallelConv2d::from_parameters(conv.weight(), conv.bias(), o.stride, o.padding, &devs).unwrap()
            };
            let (split1, split2) = (split(&conv1, padded), split(&conv2, strided));
            let relu = Relu::new();
            let x = random(&[2, 3, 6, 5], &mut rng, &devs[0]);
            let ctx = ForwardCtx::train(0);
            let (h, s1) = split1.forward(&[&x], &ctx).unwrap();
            let (a, sr) = relu.forward(&[&h], &ctx).unwrap();
            let (y, s2) = split2.forward(&[&a], &ctx).unwrap();
            let dy = random(y.dims(), &mut rng, &devs[0]);
            let da = split2.backward_input(&s2, &dy).unwrap().remove(0).unwrap();
            let dh = relu.backward_input(&sr, &da).unwrap().remove(0).unwrap();
            let dx = split1.backward_input(&s1, &dh).unwrap().remove(0).unwrap();
            let (mut g1, mut g2) = (zero_grads(&split1), zero_grads(&split2));
            split2.backward_weight(&s2, &dy, &mut g2).unwrap();
            split1.backward_weight(&s1, &dh, &mut g1).unwrap();

            let host = Device::host();
            let xh = x.to_device(&host).unwrap();
            let (hr, r1) = conv1.forward(&[&xh], &ctx).unwrap();
            let (ar, rr) = relu.forward(&[&hr], &ctx).unwrap();
            let (yr, r2) = conv2.forward(&[&ar], &ctx).unwrap();
            let dyh = dy.to_device(&host).unwrap();
            let dar = conv2.backward_input(&r2, &dyh).unwrap().remove(0).unwrap();
            let dhr = relu.backward_input(&rr, &dar).unwrap().remove(0).unwrap();
            let dxr = conv1.backward_input(&r1, &dhr).unwrap().remove(0).unwrap();
            let what = format!("conv stack k={k} channels {c1},{c2}");
            assert_close(&format!("{what} output"), &y, &yr);
            assert_close(&format!("{what} input gradient"), &dx, &dxr);
            for (conv, split_layer, grads, saved, grad_out, o) in
                [(&conv1, &split1, &g1, &r1, &dhr, padded), (&conv2, &split2, &g2, &r2, &dyh, strided)]
            {
                let mut expected = zero_grads(conv);
                conv.backward_weight(saved, grad_out, &mut expected).unwrap();
                let mut twin = split(conv, o);
                let actual =
                    unsplit_grads(&mut twin, grads, |l: &ChannelParallelConv2d| l.gather_parameters().unwrap());
                assert_eq!(split_layer.parameters().len(), 2 * k);
                for ((name, g), e) in actual.iter().zip(&expected) {
                    assert_close(&format!("{what} gradient of {name}"), g, e);
                }
            }
        }
    }
}

#[test]
fn parameters_are_rank_major_shards_on_their_devices_and_round_trip_unsplit() {
    let mut rng = init::rng(4);
    let devs = devices(3);
    let mut column = ColumnParallelLinear::new(4, 7, true, &devs, &mut rng).unwrap();
    let names: Vec<(&str, Vec<usize>, String)> = column
        .parameters()
        .iter()
        .map(|p| (p.name.as_str(), p.value.dims().to_vec(), p.value.device().to_string()))
        .collect();
    let expected = [("weight", vec![3, 4], "cpu:0"), ("bias", vec![3], "cpu:0"), ("weight", vec![2, 4], "cpu:1")];
    for ((name, dims, device), (en, ed, edev)) in names.iter().zip(expected) {
        assert_eq!((*name, dims.clone(), device.as_str()), (en, ed, edev));
    }
    let row = RowParallelLinear::new(7, 4, true, &devs, &mut rng).unwrap();
    let row_names: Vec<&str> = row.parameters().iter().map(|p| p.name.as_str()).collect();
    assert_eq!(row_names, ["weight", "bias", "weight", "weight"]);
    let mlp = ParallelMlp::new(3, 5, 2, true, MlpActivation::Gelu, &devs[..2], &mut rng).unwrap();
    let mlp_names: Vec<&str> = mlp.parameters().iter().map(|p| p.name.as_str()).collect();
    assert_eq!(mlp_names, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc1.weight", "fc1.bias", "fc2.weight"]);

    // Same seed, same initialisation as the unsplit layer.
    let reference = Linear::new(4, 7, true, &mut init::rng(4)).unwrap();
    let gathered = column.gather_parameters().unwrap();
    assert!(gathered[0].1.bit_eq(reference.weight()) && gathered[1].1.bit_eq(reference.bias().unwrap()));
    // load_unsplit then gather_parameters is the identity.
    let new_weight = random(&[7, 4], &mut rng, &Device::host());
    column.load_unsplit("weight", &new_weight).unwrap();
    assert!(column.gather_parameters().unwrap()[0].1.bit_eq(&new_weight));
    for layer_params in
        mlp.gather_parameters().unwrap().iter().zip(["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"])
    {
        assert_eq!(layer_params.0.0, layer_params.1);
    }
    let mut mlp = mlp;
    for (name, value) in mlp.gather_parameters().unwrap() {
        let fresh = random(value.dims(), &mut rng, &Device::host());
        mlp.load_unsplit(&name, &fresh).unwrap();
        let back = mlp.gather_parameters().unwrap().into_iter().find(|(n, _)| *n == name).unwrap().1;
        assert!(back.bit_eq(&fresh), "{name}");
    }
    assert!(matches!(
        column.load_unsplit("weight", &new_weight.reshape([4, 7]).unwrap()),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        column.load_unsplit("gamma", &Tensor::zeros([7], DType::F32, &Device::host()).unwrap()),
        Err(Error::InvalidArgument { .. })
    ));
    // The pipeline may "place" the layer on its first device; elsewhere is an error.
    assert!(column.to_device(&devs[0]).is_ok());
    assert!(matches!(column.to_device(&devs[1]), Err(Error::InvalidArgument { .. })));
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let mut rng = init::rng(5);
    let devs = devices(2);
    assert!(matches!(ColumnParallelLinear::new(4, 1, true, &devs, &mut rng), Err(Error::InvalidArgument { .. })));
    assert!(matches!(
        RowParallelLinear::new(4, 3, true, &[devs[0].clone(), devs[0].clone()], &mut rng),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(ColumnParallelLinear::new(4, 3, true, &[], &mut rng).is_err());
    let layer = ColumnParallelLinear::new(4, 3, true, &devs, &mut rng).unwrap();
    let ctx = ForwardCtx::eval();
    let on_host = Tensor::zeros([2, 4], DType::F32, &Device::host()).unwrap();
    assert!(matches!(layer.forward(&[&on_host], &ctx), Err(Error::DeviceMismatch { .. })));
    let wrong = Tensor::zeros([2, 5], DType::F32, &devs[0]).unwrap();
    assert!(matches!(layer.forward(&[&wrong], &ctx), Err(Error::ShapeMismatch { .. })));
    let half = Tensor::zeros([2, 4], DType::F16, &devs[0]).unwrap();
    assert!(matches!(layer.forward(&[&half], &ctx), Err(Error::UnsupportedDType { .. })));
    let x = Tensor::zeros([2, 4], DType::F32, &devs[0]).unwrap();
    let (y, saved) = layer.forward(&[&x], &ctx).unwrap();
    assert!(layer.backward_input(&Saved::default(), &y).is_err());
    assert!(layer.backward_input(&saved, &x).is_err());
    assert!(layer.backward_weight(&saved, &y, &mut []).is_err());
    let conv = ChannelParallelConv2d::new(2, 3, (3, 3), Conv2dOptions::default(), &devs, &mut rng).unwrap();
    let tiny = Tensor::zeros([1, 2, 2, 2], DType::F32, &devs[0]).unwrap();
    assert!(matches!(conv.forward(&[&tiny], &ctx), Err(Error::ShapeMismatch { .. })));
}

/// A Linear 256 → 512 (512 KiB of weight) cannot live on a device with a 320 KiB budget; split over
/// four such devices it trains (forward, both backward passes, SGD) with every device under budget,
/// and matches the unsplit layer trained on the host.
#[test]
fn a_linear_larger_than_one_device_trains_split_over_four() {
    const BUDGET: u64 = 320 * 1024;
    let (in_features, out_features, batch) = (256, 512, 8);
    let mut rng = init::rng(6);
    let mut reference = Linear::new(in_features, out_features, true, &mut rng).unwrap();
    let weight_bytes = reference.weight().size_in_bytes() as u64;
    assert!(weight_bytes > BUDGET);
    let one = Device::cpu_with_budget(9, Some(BUDGET));
    let err =
        Linear::from_parameters(reference.weight().to_device(&Device::host()).unwrap(), None).unwrap().to_device(&one);
    assert!(matches!(err, Err(Error::OutOfDeviceMemory { .. })), "{err:?}");

    let devs: Vec<Device> = (0..4).map(|i| Device::cpu_with_budget(i, Some(BUDGET))).collect();
    let mut split = ColumnParallelLinear::from_linear(&reference, &devs).unwrap();
    let mut grads = zero_grads(&split);
    let mut ref_grads = zero_grads(&reference);
    let mut optimizer = Optimizer::new(SgdConfig::new(0.1), split.parameters().len()).unwrap();
    let mut ref_optimizer = Optimizer::new(SgdConfig::new(0.1), ref_grads.len()).unwrap();
    devs.iter().for_each(Device::reset_peak_memory);
    let ctx = ForwardCtx::train(0);
    for _step in 0..3 {
        let x = random(&[batch, in_features], &mut rng, &devs[0]);
        let target = random(&[batch, out_features], &mut rng, &Device::host());
        let (y, saved) = split.forward(&[&x], &ctx).unwrap();
        // Loss Σ (y - t)² / batch; dy = 2 (y - t) / batch.
        let dy_values: Vec<f32> =
            y.to_vec_f32().iter().zip(target.to_vec_f32()).map(|(y, t)| 2.0 * (y - t) / batch as f32).collect();
        let dy = Tensor::from_vec(dy_values, [batch, out_features], &devs[0]).unwrap();
        drop(y);
        split.backward_input(&saved, &dy).unwrap();
        grads.iter_mut().for_each(Tensor::fill_zero);
        split.backward_weight(&saved, &dy, &mut grads).unwrap();
        drop(saved);
        let mut params: Vec<&mut Tensor> = split.parameters_mut().iter_mut().map(|p| &mut p.value).collect();
        optimizer.step(&mut params, &grads.iter().collect::<Vec<_>>()).unwrap();

        let host = Device::host();
        let (_, ref_saved) = reference.forward(&[&x.to_device(&host).unwrap()], &ctx).unwrap();
        let dy_host = dy.to_device(&host).unwrap();
        ref_grads.iter_mut().for_each(Tensor::fill_zero);
        reference.backward_weight(&ref_saved, &dy_host, &mut ref_grads).unwrap();
        let mut ref_params: Vec<&mut Tensor> = reference.parameters_mut().iter_mut().map(|p| &mut p.value).collect();
        ref_optimizer.step(&mut ref_params, &ref_grads.iter().collect::<Vec<_>>()).unwrap();
    }
    println!("Linear {in_features}→{out_features}: weight {weight_bytes} B; budget {BUDGET} B per device");
    for device in &devs {
        let peak = device.peak_memory();
        println!(
            "  {device}: peak {peak} B ({:.0}% of budget), in use after training {} B",
            100.0 * peak as f64 / BUDGET as f64,
            device.memory_in_use()
        );
        assert!(peak <= BUDGET);
    }
    let trained = split.gather_parameters().unwrap();
    assert_close("trained weight", &trained[0].1, reference.weight());
    assert_close("trained bias", &trained[1].1, reference.bias().unwrap());
}

#[test]
fn a_budget_overrun_in_one_shard_is_reported_and_the_layer_stays_usable() {
    let devs = [Device::cpu(0), Device::cpu_with_budget(1, Some(4096))];
    let layer = ColumnParallelLinear::new(16, 8, true, &devs, &mut init::rng(7)).unwrap();
    let big = Tensor::zeros([64, 16], DType::F32, &devs[0]).unwrap(); // 4 KiB: its copy cannot fit on cpu:1
    let err = layer.forward(&[&big], &ForwardCtx::eval()).unwrap_err();
    assert!(matches!(err, Error::OutOfDeviceMemory { ref device, .. } if device == "cpu:1"), "{err}");
    let small = Tensor::zeros([2, 16], DType::F32, &devs[0]).unwrap();
    assert_eq!(layer.forward(&[&small], &ForwardCtx::eval()).unwrap().0.dims(), &[2, 8]);
}

fn bytes(traffic: &[Traffic]) -> Vec<f64> {
    traffic.iter().map(|t| t.bytes).collect()
}

/// Bytes each device sends per call, measured by the group's counters, against the formulas of
/// `collective::traffic` (ring: 2(k-1)/k of the buffer per rank for all-reduce; (k-1)/k for
/// all-gather and scatter; root-based: the root sends (k-1) copies for broadcast).
#[test]
fn bytes_moved_per_exchange_match_the_ring_formula() {
    let mut rng = init::rng(8);
    let (rows, in_features, hidden, out_features, k) = (8, 16, 32, 12, 4);
    let devs = devices(k);
    let f32_bytes = |n: usize| (4 * n) as u64;
    let model = |op, n| traffic(op, f32_bytes(n), k).bytes;
    let x = random(&[rows, in_features], &mut rng, &devs[0]);
    let ctx = ForwardCtx::train(0);
    println!("bytes sent per device, k={k}, batch {rows}:");

    let mlp = ParallelMlp::new(in_features, hidden, out_features, true, MlpActivation::Gelu, &devs, &mut rng).unwrap();
    let (y, saved) = mlp.forward(&[&x], &ctx).unwrap();
    let forward = bytes(&mlp.traffic());
    let all_reduce = model(CollectiveOp::AllReduce, rows * out_features);
    let broadcast = model(CollectiveOp::Broadcast, rows * in_features);
    assert_eq!(all_reduce, 2.0 * 3.0 / 4.0 * (rows * out_features * 4) as f64);
    let expected: Vec<f64> = (0..k).map(|r| all_reduce + if r == 0 { broadcast } else { 0.0 }).collect();
    println!(
        "  ParallelMlp forward: measured {forward:?}; broadcast x (rank 0) {broadcast} + ring all-reduce y {all_reduce} each"
    );
    assert_eq!(forward, expected);
    mlp.reset_traffic();
    mlp.backward_input(&saved, &y).unwrap();
    let backward = bytes(&mlp.traffic());
    let all_reduce_dx = model(CollectiveOp::AllReduce, rows * in_features);
    let broadcast_dy = model(CollectiveOp::Broadcast, rows * out_features);
    println!(
        "  ParallelMlp backward_input: measured {backward:?}; broadcast dy (rank 0) {broadcast_dy} + ring all-reduce dx {all_reduce_dx} each"
    );
    assert_eq!(backward, (0..k).map(|r| all_reduce_dx + if r == 0 { broadcast_dy } else { 0.0 }).collect::<Vec<_>>());

    let column = ColumnParallelLinear::new(in_features, hidden, true, &devs, &mut rng).unwrap();
    column.forward(&[&x], &ctx).unwrap();
    let measured = bytes(&column.traffic());
    let all_gather = model(CollectiveOp::AllGather, rows * hidden);
    println!(
        "  ColumnParallelLinear forward: measured {measured:?}; broadcast x {broadcast} + ring all-gather y {all_gather} each"
    );
    assert_eq!(measured, (0..k).map(|r| all_gather + if r == 0 { broadcast } else { 0.0 }).collect::<Vec<_>>());

    let row = RowParallelLinear::new(in_features, out_features, true, &devs, &mut rng).unwrap();
    row.forward(&[&x], &ctx).unwrap();
    let measured = bytes(&row.traffic());
    let scatter = model(CollectiveOp::Scatter, rows * in_features);
    println!(
        "  RowParallelLinear forward: measured {measured:?}; scatter x {scatter} + ring all-reduce y {all_reduce} each"
    );
    assert_eq!(measured, (0..k).map(|r| all_reduce + if r == 0 { scatter } else { 0.0 }).collect::<Vec<_>>());
}

/// Prints the cost of spawning k threads per call on a small layer (no assertion on time).
#[test]
fn thread_overhead_on_a_small_layer() {
    let mut rng = init::rng(9);
    let linear = Linear::new(32, 32, true, &mut rng).unwrap();
    let x_host = random(&[4, 32], &mut rng, &Device::host());
    let ctx = ForwardCtx::eval();
    let time = |layer: &dyn Layer, x: &Tensor| {
        for _ in 0..20 {
            layer.forward(&[x], &ctx).unwrap();
        }
        let start = Instant::now();
        let calls = 200;
        for _ in 0..calls {
            layer.forward(&[x], &ctx).unwrap();
        }
        start.elapsed().as_secs_f64() / calls as f64 * 1e6
    };
    println!("forward of Linear 32→32, batch 4: unsplit {:.1} µs", time(&linear, &x_host));
    for k in [2, 4] {
        let devs = devices(k);
        let split = ColumnParallelLinear::from_linear(&linear, &devs).unwrap();
        let x = x_host.to_device(&devs[0]).unwrap();
        println!("  column-split k={k}: {:.1} µs per call", time(&split, &x));
    }
}
