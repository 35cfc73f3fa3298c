//! `Tensor` on every device: each case is written once and run as one trial per device
//! (`case[cpu]`, `case[cuda:0]`, ...; `common::device_cases`). Without a GPU each case's `[cuda]`
//! trial is listed as ignored, by name, and the reason printed once.
//!
//! - Round trips host → device → host are exact for f32, f16 and bf16, and so are narrowing,
//!   concatenation, dtype conversion and copies between devices; the ledger counts every byte.
//! - Copy-on-write: no write through one handle is seen through another, on every device.
//! - The device ops (`conveyor_engine::device::ops`) and the optimizers give the CPU's results
//!   within the tolerances below.
//! - Host-only access to a GPU tensor is `Error::NotOnHost`, never a panic; and without the
//!   feature or a driver, asking for a CUDA device is a clear `CudaUnavailable` error (this case
//!   runs on every machine).
//!
//! # Tolerances
//!
//! Element `i` passes when `|got_i - expected_i| <= atol_i + rtol·|expected_i|` (the formula of
//! `device_ops.rs`), with `u = 2⁻²⁴`:
//! - data movement, ReLU and its gradient, additions, scaling and the optimizer updates (compiled
//!   with `--fmad=false`, rounding as the CPU does): bit for bit;
//! - products with inner dimension `k`: `atol_ij = 2·(k + 1)·u·((|A|·|B|)_ij + |C0_ij|)` (`C0` the
//!   bias or the accumulated-onto destination), twice the worst-case error bound of a dot product;
//! - column sums of `n` rows onto `c0`: `atol_j = 2·(n + 1)·u·(Σ_r |m_rj| + |c0_j|)`;
//! - GELU and tanh (CUDA's `erfcf`/`expf`/`tanhf` within 2–4 ulp; the CPU computes in f64):
//!   `rtol = 4e-6`, `atol = 1e-6`; their gradients `rtol = 1.6e-5` (tanh's reads the forward
//!   output, whose error `1 - y²` amplifies by less than 3 for inputs in `[-1, 1)`);
//! - softmax cross-entropy over rows of 10 (the GPU sums exponentials in f32, the CPU in f64):
//!   `rtol = 1e-5`, `atol = 1e-6` on gradients and on the loss;
//! - the sum of squares (f64 partial sums in another order): `rtol = 1e-12`.
mod common;

use common::device_cases::{self, Case, Plain};
use common::values;
use std::process::ExitCode;

use anyhow::{Result, bail, ensure};
use conveyor_engine::device::ops::{Activation, Matrix};
use conveyor_engine::optim::{AdamConfig, Optimizer, OptimizerConfig, SgdConfig, clip_grad_norm, grad_sum_of_squares};
use conveyor_engine::{DType, Device, Error, Tensor};
use half::{bf16, f16};

/// Unit roundoff of f32.
const U: f32 = 1.0 / 16_777_216.0;

/// The elements on the host, whatever the device.
fn on_host(tensor: &Tensor) -> Result<Vec<f32>> {
    Ok(tensor.try_to_vec_f32()?)
}

/// `|got - expected| <= atol_i + rtol·|expected|` for every element.
fn assert_close(what: &str, got: &[f32], expected: &[f32], rtol: f32, atol: impl Fn(usize) -> f32) -> Result<()> {
    ensure!(got.len() == expected.len(), "{what}: {} elements, expected {}", got.len(), expected.len());
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        let bound = atol(i) + rtol * e.abs();
        ensure!(
            g.to_bits() == e.to_bits() || (g - e).abs() <= bound,
            "{what}: element {i} is {g:e}, expected {e:e} (|diff| {:e} > {bound:e})",
            (g - e).abs()
        );
    }
    Ok(())
}

fn assert_exact(what: &str, got: &[f32], expected: &[f32]) -> Result<()> {
    assert_close(what, got, expected, 0.0, |_| 0.0)
}

fn round_trips_are_exact_and_counted_on_the_ledger(device: &Device) -> Result<()> {
    let data = values(1, 24);
    let t = Tensor::from_slice(&data, [4, 6], device)?;
    ensure!(device.memory_in_use() == 96, "ledger holds {} bytes, expected 96", device.memory_in_use());
    assert_exact("upload/download", &on_host(&t)?, &data)?;
    assert_exact("to_device(host)", t.to_device(&Device::host())?.as_f32()?, &data)?;
    assert_exact("narrow_rows", &on_host(&t.narrow_rows(1, 2)?)?, &data[6..18])?;
    let cat = Tensor::cat_rows(&[&t.narrow_rows(0, 1)?, &t.narrow_rows(1, 3)?], device)?;
    ensure!(cat.device().same_device(device) && cat.dims() == [4, 6]);
    assert_exact("cat_rows", &on_host(&cat)?, &data)?;
    ensure!(t.to_le_bytes() == Tensor::from_slice(&data, [4, 6], &Device::host())?.to_le_bytes());
    // Half formats: values exact in both survive every hop bit for bit.
    let exact = [0.0f32, 1.0, -2.5, 0.15625, 1024.0, -0.0078125];
    let halves = [
        Tensor::from_f16_vec(exact.iter().map(|&x| f16::from_f32(x)).collect(), [6], device)?,
        Tensor::from_bf16_vec(exact.iter().map(|&x| bf16::from_f32(x)).collect(), [6], device)?,
        Tensor::from_slice(&exact, [6], device)?.to_dtype(DType::F16)?,
    ];
    for half in &halves {
        ensure!(half.device().same_device(device));
        assert_exact(&format!("{} round trip", half.dtype()), &on_host(half)?, &exact)?;
        assert_exact("to_dtype(F32)", &on_host(&half.to_dtype(DType::F32)?)?, &exact)?;
    }
    // Between devices: onto another CPU device and back, and GPU to GPU when there are two.
    let elsewhere = Device::cpu(7);
    let back = t.to_device(&elsewhere)?.move_to_device(device)?;
    assert_exact("cpu:7 and back", &on_host(&back)?, &data)?;
    for ordinal in device_cases::gpu_ordinals().unwrap_or_default() {
        let other = &Device::cuda(ordinal, None)?;
        let there = t.to_device(other)?;
        ensure!(there.device().same_device(other));
        assert_exact(&format!("to {other}"), &on_host(&there)?, &data)?;
        assert_exact(&format!("{other} and back"), &on_host(&there.move_to_device(device)?)?, &data)?;
    }
    ensure!(t.bit_eq(&back));
    let (zeros, full) = (Tensor::zeros([5], DType::F32, device)?, Tensor::full(1.5, [3], DType::BF16, device)?);
    assert_exact("zeros", &on_host(&zeros)?, &[0.0; 5])?;
    assert_exact("full", &on_host(&full)?, &[1.5; 3])?;
    drop((t, cat, halves, back, zeros, full));
    ensure!(device.memory_in_use() == 0, "{} bytes left on the ledger", device.memory_in_use());
    Ok(())
}

fn writes_through_a_share_never_reach_the_other_handle(device: &Device) -> Result<()> {
    let original = Tensor::from_slice(&[1.0, 2.0], [2], device)?;
    let writes: [fn(&mut Tensor) -> Result<()>; 5] = [
        |t| Ok(t.add_assign(&Tensor::from_slice(&[1.0, 1.0], [2], t.device())?)?),
        |t| Ok(t.scale_in_place(3.0)?),
        |t| Ok(t.try_fill_zero()?),
        |t| {
            t.fill_zero();
            Ok(())
        },
        |t| Ok(t.copy_from(&Tensor::from_slice(&[5.0, 6.0], [2], &Device::host())?)?),
    ];
    let expected: [[f32; 2]; 5] = [[2.0, 3.0], [3.0, 6.0], [0.0, 0.0], [0.0, 0.0], [5.0, 6.0]];
    for (write, expected) in writes.iter().zip(expected) {
        let mut copy = original.share();
        write(&mut copy)?;
        assert_exact("written handle", &on_host(&copy)?, &expected)?;
        assert_exact("other handle", &on_host(&original)?, &[1.0, 2.0])?;
        ensure!(!copy.shares_storage_with(&original));
        ensure!(device.memory_in_use() == 16, "the private copy is on the ledger");
    }
    // Unshared writes happen in place.
    let mut t = original.try_clone()?;
    t.add_assign(&original)?;
    t.scale_in_place(0.5)?;
    assert_exact("in place", &on_host(&t)?, &[1.0, 2.0])?;
    Ok(())
}

fn host_access_to_a_gpu_tensor_is_a_structured_error(device: &Device) -> Result<()> {
    ensure!(matches!(device, Device::Cuda(_)), "a GPU-only case given {device}");
    let mut t = Tensor::from_slice(&[1.0, 2.0], [2], device)?;
    let not_on_host = |err: Error, op: &str| match err {
        Error::NotOnHost { op: got, device: on } if got == op && on == device.to_string() => Ok(()),
        other => bail!("{op}: expected NotOnHost on {device}, got {other:?}"),
    };
    not_on_host(t.as_f32().unwrap_err(), "as_f32")?;
    not_on_host(t.as_f32_mut().unwrap_err(), "as_f32_mut")?;
    let init = Tensor::from_f32_init([2], device, |out| Ok(conveyor_engine::cpu::uninit::fill(out, 0.0)));
    not_on_host(init.unwrap_err(), "Tensor::from_f32_init")?;
    // A host op reading a GPU operand: the CPU side of a device op.
    let on_host = Tensor::from_slice(&[1.0, 2.0], [1, 2], &Device::host())?;
    let product = Tensor::matmul(Matrix::new(&t, 2, 1)?, Matrix::new(&on_host, 1, 2)?, None, [2, 2], &Device::host());
    not_on_host(product.unwrap_err(), "matmul")?;
    // A GPU op with a host operand is a device mismatch.
    let mismatch = Tensor::matmul(Matrix::new(&on_host, 2, 1)?, Matrix::new(&t, 1, 2)?, None, [2, 2], device);
    ensure!(matches!(mismatch, Err(Error::DeviceMismatch { .. })), "{mismatch:?}");
    // GPU kernels compute in f32: a bf16 operand is read through an exact f32 copy and the result
    // rounded back to bf16, as on the CPU; accumulating into a bf16 tensor is refused by dtype.
    let half = t.to_dtype(DType::BF16)?;
    let relu = half.activation(Activation::Relu)?;
    ensure!(relu.dtype() == DType::BF16 && relu.to_vec_f32() == [1.0, 2.0], "{relu:?}");
    let mut half_target = half.try_clone()?;
    ensure!(matches!(half_target.add_assign(&t), Err(Error::UnsupportedDType { .. })));
    ensure!(t.to_vec_f32() == [1.0, 2.0]);
    Ok(())
}

/// `(|A|·|B|)` on the host, for the product tolerance.
fn abs_product(lhs: &[f32], rhs: &[f32], m: usize, k: usize, n: usize, rhs_transposed: bool) -> Vec<f32> {
    let mut out = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k)
                .map(|l| lhs[i * k + l].abs() * if rhs_transposed { rhs[j * k + l] } else { rhs[l * n + j] }.abs())
                .sum();
        }
    }
    out
}

fn products_and_sums_match_the_cpu(device: &Device) -> Result<()> {
    let (m, k, n) = (7, 33, 5);
    let host = Device::host();
    let (x, w, b, dy) = (values(2, m * k), values(3, n * k), values(4, n), values(5, m * n));
    let cpu = |data: &[f32], dims: &[usize]| Tensor::from_slice(data, dims.to_vec(), &host);
    let (x_cpu, w_cpu, b_cpu, dy_cpu) = (cpu(&x, &[m, k])?, cpu(&w, &[n, k])?, cpu(&b, &[n])?, cpu(&dy, &[m, n])?);
    let y_cpu =
        Tensor::matmul(Matrix::new(&x_cpu, m, k)?, Matrix::new(&w_cpu, n, k)?.t(), Some(&b_cpu), [m, n], &host)?;
    let dx_cpu = Tensor::matmul(Matrix::new(&dy_cpu, m, n)?, Matrix::new(&w_cpu, n, k)?, None, [m, k], &host)?;
    let mut dw_cpu = cpu(&values(6, n * k), &[n, k])?;
    let dw0 = dw_cpu.to_vec_f32();
    dw_cpu.matmul_accumulate(Matrix::new(&dy_cpu, m, n)?.t(), Matrix::new(&x_cpu, m, k)?)?;
    let mut db_cpu = cpu(&b, &[n])?;
    db_cpu.accumulate_column_sums(&dy_cpu)?;
    // Tolerances from |A|·|B| (+ |C0|).
    let y_abs = abs_product(&x, &w, m, k, n, true);
    let dx_abs = abs_product(&dy, &w, m, n, k, false);
    let dy_t: Vec<f32> = (0..n * m).map(|i| dy[(i % m) * n + i / m]).collect();
    let dw_abs = abs_product(&dy_t, &x, n, m, k, false);
    let put = |data: &[f32], dims: &[usize]| Tensor::from_slice(data, dims.to_vec(), device);
    let (xd, wd, bd, dyd) = (put(&x, &[m, k])?, put(&w, &[n, k])?, put(&b, &[n])?, put(&dy, &[m, n])?);
    let y = Tensor::matmul(Matrix::new(&xd, m, k)?, Matrix::new(&wd, n, k)?.t(), Some(&bd), [m, n], device)?;
    ensure!(y.device().same_device(device) && y.dims() == [m, n]);
    let bound = |abs: &[f32], c0: &[f32], i: usize, inner: usize| {
        2.0 * (inner + 1) as f32 * U * (abs[i] + c0.get(i).map_or(0.0, |c| c.abs()))
    };
    let bias_rows: Vec<f32> = (0..m * n).map(|i| b[i % n]).collect();
    assert_close("x·wᵀ + b", &on_host(&y)?, &y_cpu.to_vec_f32(), 0.0, |i| bound(&y_abs, &bias_rows, i, k))?;
    let dx = Tensor::matmul(Matrix::new(&dyd, m, n)?, Matrix::new(&wd, n, k)?, None, [m, k], device)?;
    assert_close("dy·w", &on_host(&dx)?, &dx_cpu.to_vec_f32(), 0.0, |i| bound(&dx_abs, &[], i, n))?;
    let mut dw = put(&dw0, &[n, k])?;
    dw.matmul_accumulate(Matrix::new(&dyd, m, n)?.t(), Matrix::new(&xd, m, k)?)?;
    assert_close("dw += dyᵀ·x", &on_host(&dw)?, &dw_cpu.to_vec_f32(), 0.0, |i| bound(&dw_abs, &dw0, i, m))?;
    let mut db = put(&b, &[n])?;
    db.accumulate_column_sums(&dyd)?;
    let column_abs: Vec<f32> = (0..n).map(|j| (0..m).map(|r| dy[r * n + j].abs()).sum::<f32>() + b[j].abs()).collect();
    let column_bound = |j: usize| 2.0 * (m + 1) as f32 * U * column_abs[j];
    assert_close("db += Σ dy", &on_host(&db)?, &db_cpu.to_vec_f32(), 0.0, column_bound)?;
    Ok(())
}

fn activations_and_cross_entropy_match_the_cpu(device: &Device) -> Result<()> {
    let (rows, classes) = (6, 10);
    let host = Device::host();
    let (x, dy) = (values(7, rows * classes), values(8, rows * classes));
    let labels: Vec<usize> = (0..rows).map(|r| (r * 3) % classes).collect();
    let x_cpu = Tensor::from_slice(&x, [rows, classes], &host)?;
    let dy_cpu = Tensor::from_slice(&dy, [rows, classes], &host)?;
    let (loss_cpu, grad_cpu) = x_cpu.softmax_cross_entropy(&labels, 12.0)?;
    let xd = Tensor::from_slice(&x, [rows, classes], device)?;
    let dyd = Tensor::from_slice(&dy, [rows, classes], device)?;
    for activation in [Activation::Relu, Activation::Gelu, Activation::Tanh] {
        let (rtol, atol) = if activation == Activation::Relu { (0.0, 0.0) } else { (4e-6, 1e-6) };
        let y_cpu = x_cpu.activation(activation)?;
        let kept_cpu = if activation == Activation::Gelu { &x_cpu } else { &y_cpu };
        let dx_cpu = Tensor::activation_grad(activation, kept_cpu, &dy_cpu)?;
        let y = xd.activation(activation)?;
        ensure!(y.device().same_device(device));
        let kept = if activation == Activation::Gelu { &xd } else { &y };
        let dx = Tensor::activation_grad(activation, kept, &dyd)?;
        assert_close(&format!("{activation:?}"), &on_host(&y)?, &y_cpu.to_vec_f32(), rtol, |_| atol)?;
        // The gradient reads the kept tensor, itself within the forward tolerance: for tanh
        // (y off by 4e-6·|y|), 1 - y² moves by 2y²·4e-6, under 3 · 4e-6 of 1 - y² for |x| < 1.
        let grad_rtol = if activation == Activation::Relu { 0.0 } else { 4.0 * rtol };
        assert_close(&format!("{activation:?} grad"), &on_host(&dx)?, &dx_cpu.to_vec_f32(), grad_rtol, |_| atol)?;
    }
    let (loss, grad) = xd.softmax_cross_entropy(&labels, 12.0)?;
    ensure!(grad.device().same_device(device));
    ensure!((loss - loss_cpu).abs() <= 1e-5 * loss_cpu.abs() + 1e-6, "loss {loss} vs {loss_cpu}");
    assert_close("cross-entropy grad", &on_host(&grad)?, &grad_cpu.to_vec_f32(), 1e-5, |_| 1e-6)?;
    Ok(())
}

fn optimizers_and_clipping_match_the_cpu_bit_for_bit(device: &Device) -> Result<()> {
    let n = 1000;
    let configs = [
        OptimizerConfig::Sgd(SgdConfig::new(0.1)),
        OptimizerConfig::Sgd(SgdConfig::new(0.1).with_momentum(0.9).with_weight_decay(0.01)),
        OptimizerConfig::Sgd(SgdConfig::new(0.1).with_momentum(0.9).with_nesterov(true)),
        OptimizerConfig::Adam(AdamConfig::adam(1e-2).with_weight_decay(0.1)),
        OptimizerConfig::AdamW(AdamConfig::adamw(1e-2)),
    ];
    // Three steps on `device`; returns the parameter and the gradient's sum of squares.
    let run = |config: OptimizerConfig, device: &Device| -> Result<(Vec<f32>, f64)> {
        let mut param = Tensor::from_slice(&values(9, n), [n], device)?;
        let mut optimizer = Optimizer::new(config, 1)?;
        let mut sum = 0.0;
        for step in 0..3u64 {
            let grad = Tensor::from_slice(&values(10 + step, n), [n], device)?;
            sum = grad_sum_of_squares(&[&grad])?;
            optimizer.step(&mut [&mut param], &[&grad])?;
        }
        ensure!(optimizer.state(0).is_some_and(|s| s.step() == 3));
        Ok((on_host(&param)?, sum))
    };
    for config in configs {
        let (expected, expected_sum) = run(config, &Device::host())?;
        let (got, sum) = run(config, device)?;
        assert_exact(&format!("{config:?}"), &got, &expected)?;
        ensure!((sum - expected_sum).abs() <= 1e-12 * expected_sum, "sum of squares {sum} vs {expected_sum}");
    }
    let mut grad = Tensor::from_slice(&[3.0, 4.0], [2], device)?;
    let norm = clip_grad_norm(&mut [&mut grad], 1.0)?;
    ensure!((norm - 5.0).abs() < 1e-12, "norm {norm}");
    let factor = (1.0f64 / (5.0 + 1e-6)) as f32;
    assert_exact("clipped", &on_host(&grad)?, &[3.0 * factor, 4.0 * factor])
}

fn a_cuda_device_without_the_feature_or_a_driver_is_a_clear_error() -> Result<()> {
    // Runs everywhere: on a machine that can open cuda:0 there is nothing to refuse.
    if let Err(err) = Device::cuda(0, None) {
        let message = err.to_string();
        assert!(matches!(err, Error::CudaUnavailable(_)), "{err:?}");
        if cfg!(feature = "cuda") {
            assert!(message.contains("no CUDA driver") || message.contains("could not be opened"), "{message}");
        } else {
            assert!(message.contains("built without the `cuda` feature"), "{message}");
        }
    }
    // The error a host-only access to a GPU tensor gives says where the elements are and the fix.
    let err = Error::NotOnHost { op: "as_f32".into(), device: "cuda:0".into() };
    let message = err.to_string();
    assert!(message.starts_with("as_f32: the elements live on cuda:0"), "{message}");
    assert!(message.contains("to_device(&Device::host())"), "{message}");
    Ok(())
}

fn main() -> ExitCode {
    let plain = [Plain {
        name: "a_cuda_device_without_the_feature_or_a_driver_is_a_clear_error",
        body: a_cuda_device_without_the_feature_or_a_driver_is_a_clear_error,
    }];
    let cases: [Case<Device>; 6] = [
        Case::every_device(
            "round_trips_are_exact_and_counted_on_the_ledger",
            round_trips_are_exact_and_counted_on_the_ledger,
        ),
        Case::every_device(
            "writes_through_a_share_never_reach_the_other_handle",
            writes_through_a_share_never_reach_the_other_handle,
        ),
        Case::gpus(
            "host_access_to_a_gpu_tensor_is_a_structured_error",
            host_access_to_a_gpu_tensor_is_a_structured_error,
        ),
        Case::every_device("products_and_sums_match_the_cpu", products_and_sums_match_the_cpu),
        Case::every_device("activations_and_cross_entropy_match_the_cpu", activations_and_cross_entropy_match_the_cpu),
        Case::every_device(
            "optimizers_and_clipping_match_the_cpu_bit_for_bit",
            optimizers_and_clipping_match_the_cpu_bit_for_bit,
        ),
    ];
    device_cases::run(&plain, &cases, device_cases::devices())
}
