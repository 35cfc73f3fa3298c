//! The normalisation, lookup and token-reduction device ops (`Tensor::layer_norm` and its two
//! gradients, `embedding` and `embedding_grad_accumulate`, `add_positions` and
//! `positions_grad_accumulate`, `mean_over_tokens` and `mean_over_tokens_grad`), written once and
//! run as one trial per device (`common::device_cases`): each device's result against the CPU's,
//! gradients accumulated onto seeded initial values, and bad ids refused on every device.
//!
//! # Tolerance
//!
//! The CPU result is exact on the CPU trial (the ops are the CPU kernels). The GPU kernels repeat
//! the CPU's operations in the CPU's order, one thread per output (f64 statistics for layer
//! normalisation, f32 elsewhere); each is an IEEE-rounded addition, multiplication, division or
//! square root on both sides and `--fmad=false` forbids contractions, so the results are expected
//! to be equal bit for bit. Element `i` of a result `r` passes when its bits equal the CPU's or
//! `|got_i - cpu_i| <= 4·u·max_j |cpu_j|` (`u = 2⁻²⁴`): a few roundings of the result's scale,
//! should one f64 statistic round to the other f32 neighbour (the layer-norm input gradient
//! subtracts nearly equal terms, so an element-relative bound would not be meaningful there).
mod common;

use std::process::ExitCode;

use anyhow::{Result, ensure};
use common::device_cases::{self, Case};
use common::values;
use conveyor_engine::{Device, Tensor};

/// Unit roundoff of f32.
const U: f32 = 1.0 / 16_777_216.0;

/// Named results of one device's run.
type Results = Vec<(&'static str, Tensor)>;

fn check(what: &str, device: &Device, got: &Tensor, expected: &Tensor) -> Result<()> {
    ensure!(got.device().same_device(device), "{what}: the result is on {}, not {device}", got.device());
    ensure!(
        got.shape() == expected.shape(),
        "{what} on {device}: shape {}, expected {}",
        got.shape(),
        expected.shape()
    );
    let (got, expected) = (got.try_to_vec_f32()?, expected.try_to_vec_f32()?);
    let scale = expected.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let atol = 4.0 * U * scale;
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        ensure!(
            g.to_bits() == e.to_bits() || (g - e).abs() <= atol,
            "{what} on {device}: element {i} is {g:e}, the CPU's {e:e} (|diff| {:e} > {atol:e})",
            (g - e).abs()
        );
    }
    Ok(())
}

/// Layer norm over rows of 8: output, mean, rstd, input gradient, weight and bias gradients.
fn layer_norm_runs(device: &Device) -> Result<Results> {
    let (rows_shape, dim) = ([2, 3, 8], 8);
    let x = Tensor::from_vec(values(1, 48).iter().map(|v| 3.0 * v + 0.5).collect(), rows_shape, device)?;
    let weight = Tensor::from_vec(values(2, dim), [dim], device)?;
    let bias = Tensor::from_vec(values(3, dim), [dim], device)?;
    let dy = Tensor::from_vec(values(4, 48), rows_shape, device)?;
    let (y, mean, rstd) = x.layer_norm(&weight, &bias, 1e-5)?;
    let dx = dy.layer_norm_input_grad(&x, &weight, &mean, &rstd)?;
    let mut weight_grad = Tensor::from_vec(values(5, dim), [dim], device)?;
    let mut bias_grad = Tensor::from_vec(values(6, dim), [dim], device)?;
    dy.layer_norm_weight_grad_accumulate(&x, &mean, &rstd, &mut weight_grad, &mut bias_grad)?;
    // A second call accumulates onto the first.
    dy.layer_norm_weight_grad_accumulate(&x, &mean, &rstd, &mut weight_grad, &mut bias_grad)?;
    Ok(vec![
        ("layer_norm output", y),
        ("layer_norm mean", mean),
        ("layer_norm rstd", rstd),
        ("layer_norm input grad", dx),
        ("layer_norm weight grad", weight_grad),
        ("layer_norm bias grad", bias_grad),
    ])
}

/// A table of 7 rows of 5 looked up by `[2, 6]` ids with repeats, and its gradient (rows 0 and 6
/// are looked up by no id: their initial gradient values must survive).
fn embedding_runs(device: &Device) -> Result<Results> {
    let table = Tensor::from_vec(values(10, 35), [7, 5], device)?;
    let ids = Tensor::from_vec(vec![3.0, 1.0, 3.0, 5.0, 1.0, 3.0, 2.0, 2.0, 4.0, 3.0, 5.0, 1.0], [2, 6], device)?;
    let output = table.embedding(&ids)?;
    let dy = Tensor::from_vec(values(11, 60), [2, 6, 5], device)?;
    let mut grad = Tensor::from_vec(values(12, 35), [7, 5], device)?;
    dy.embedding_grad_accumulate(&ids, &mut grad)?;
    dy.embedding_grad_accumulate(&ids, &mut grad)?;
    for bad in [7.0, -1.0, 1.5, f32::NAN] {
        let ids = Tensor::from_vec(vec![0.0, bad], [1, 2], device)?;
        ensure!(table.embedding(&ids).is_err(), "id {bad} was accepted by embedding on {device}");
        let dy = Tensor::zeros([1, 2, 5], conveyor_engine::DType::F32, device)?;
        ensure!(dy.embedding_grad_accumulate(&ids, &mut grad).is_err(), "id {bad} was accepted by the gradient");
    }
    Ok(vec![("embedding output", output), ("embedding grad", grad)])
}

/// A `[6, 5]` position table added to `[3, 4, 5]` (rows 4 and 5 unused), its gradient, and the
/// mean over the 4 tokens with its gradient.
fn sequence_runs(device: &Device) -> Result<Results> {
    let x = Tensor::from_vec(values(20, 60), [3, 4, 5], device)?;
    let table = Tensor::from_vec(values(21, 30), [6, 5], device)?;
    let y = x.add_positions(&table)?;
    let dy = Tensor::from_vec(values(22, 60), [3, 4, 5], device)?;
    let mut grad = Tensor::from_vec(values(23, 30), [6, 5], device)?;
    dy.positions_grad_accumulate(&mut grad)?;
    dy.positions_grad_accumulate(&mut grad)?;
    let mean = x.mean_over_tokens()?;
    let mean_dy = Tensor::from_vec(values(24, 15), [3, 5], device)?;
    let mean_dx = mean_dy.mean_over_tokens_grad(4)?;
    Ok(vec![
        ("add_positions output", y),
        ("positions grad", grad),
        ("mean_over_tokens output", mean),
        ("mean_over_tokens grad", mean_dx),
    ])
}

fn compare(device: &Device, run: fn(&Device) -> Result<Results>) -> Result<()> {
    let expected = run(&Device::cpu(0))?;
    let got = run(device)?;
    for ((what, got), (_, expected)) in got.iter().zip(&expected) {
        check(what, device, got, expected)?;
    }
    Ok(())
}

fn layer_norm_ops_match_the_cpu(device: &Device) -> Result<()> {
    compare(device, layer_norm_runs)
}

fn embedding_ops_match_the_cpu(device: &Device) -> Result<()> {
    compare(device, embedding_runs)
}

fn sequence_ops_match_the_cpu(device: &Device) -> Result<()> {
    compare(device, sequence_runs)
}

/// The CPU's results by hand on small values: the ops compute what their docs say.
fn ops_compute_their_formulas(device: &Device) -> Result<()> {
    let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], [2, 2, 2], device)?;
    ensure!(x.mean_over_tokens()?.try_to_vec_f32()? == [2.0, 3.0, 6.0, 7.0]);
    let dy = Tensor::from_vec(vec![2.0, 4.0], [1, 2], device)?;
    ensure!(dy.mean_over_tokens_grad(2)?.try_to_vec_f32()? == [1.0, 2.0, 1.0, 2.0]);
    let table = Tensor::from_vec(vec![10.0, 20.0, 30.0, 40.0, 50.0, 60.0], [3, 2], device)?;
    ensure!(x.add_positions(&table)?.try_to_vec_f32()? == [11.0, 22.0, 33.0, 44.0, 15.0, 26.0, 37.0, 48.0]);
    let ids = Tensor::from_vec(vec![2.0, 0.0, 2.0], [3], device)?;
    ensure!(table.embedding(&ids)?.try_to_vec_f32()? == [50.0, 60.0, 10.0, 20.0, 50.0, 60.0]);
    let dy = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [3, 2], device)?;
    let mut grad = Tensor::zeros([3, 2], conveyor_engine::DType::F32, device)?;
    dy.embedding_grad_accumulate(&ids, &mut grad)?;
    ensure!(grad.try_to_vec_f32()? == [3.0, 4.0, 0.0, 0.0, 6.0, 8.0]);
    Ok(())
}

fn main() -> ExitCode {
    let cases = [
        Case::every_device("layer_norm_ops_match_the_cpu", layer_norm_ops_match_the_cpu),
        Case::every_device("embedding_ops_match_the_cpu", embedding_ops_match_the_cpu),
        Case::every_device("sequence_ops_match_the_cpu", sequence_ops_match_the_cpu),
        Case::every_device("ops_compute_their_formulas", ops_compute_their_formulas),
    ];
    device_cases::run(&[], &cases, device_cases::devices())
}
