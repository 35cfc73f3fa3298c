//! The attention device ops (`Tensor::attention_qkv` and its two gradients, `Tensor::attention`,
//! `Tensor::attention_backward`, `Tensor::attention_out_grads`), written once and run as one trial
//! per device (`common::device_cases`): each device's results against the CPU's, causal and not,
//! for head counts and token counts the CPU kernel blocks differently.
//!
//! # Tolerance
//!
//! The CPU trial is exact (the ops are the CPU kernels). A GPU computes the products in another
//! order (cuBLAS) and the softmax with CUDA's `expf`/`logf` (within 2 ulp) in plain f32 sums
//! instead of the CPU's fused multiply-add chains, so each result passes when
//! `‖got − cpu‖ / ‖cpu‖ ≤ 1e-5` (norm-wise over the tensor) and every element is within
//! `1e-4 · max|cpu|` of the CPU's: errors of a few ulp in sums of at most `tokens · head_dim`
//! terms, far below both bounds for these sizes, while a wrong index or mask fails them by orders
//! of magnitude.
mod common;

use std::process::ExitCode;

use anyhow::{Result, ensure};
use common::device_cases::{self, Case};
use common::values;
use conveyor_engine::cpu::attention::AttentionDims;
use conveyor_engine::device::ops::Matrix;
use conveyor_engine::{Device, Shape, Tensor};

/// Batch, tokens, heads, head_dim, causal.
const SHAPES: [(usize, usize, usize, usize, bool); 4] =
    [(2, 5, 2, 4, false), (3, 7, 4, 3, true), (1, 1, 1, 8, true), (2, 70, 2, 8, false)];

/// Every result of one device, on the host.
fn results(device: &Device, dims: AttentionDims, data: &[Vec<f32>; 8]) -> Result<Vec<(&'static str, Vec<f32>)>> {
    let [x, w_in, b_in, w_out, dy, gw_in, gb_in, gw_out] = data;
    let d = dims.embed_dim();
    let rows = dims.batch * dims.tokens;
    let put = |values: &[f32], dims: &[usize]| Tensor::from_slice(values, dims.to_vec(), device);
    let input_shape = Shape::new([dims.batch, dims.tokens, d]);
    let x = put(x, input_shape.dims())?;
    let (w_in, b_in, w_out) = (put(w_in, &[3 * d, d])?, put(b_in, &[3 * d])?, put(w_out, &[d, d])?);
    let dy = put(dy, input_shape.dims())?;
    let qkv = x.attention_qkv(&w_in, &b_in, dims)?;
    let (ctx, lse) = qkv.attention(dims)?;
    let grad_ctx = Tensor::matmul(Matrix::new(&dy, rows, d)?, Matrix::new(&w_out, d, d)?, None, [rows, d], device)?;
    let grad_qkv = grad_ctx.attention_backward(&qkv, &ctx, &lse, dims)?;
    let grad_x = grad_qkv.attention_qkv_input_grad(&w_in, &input_shape, dims)?;
    let (mut gw, mut gb) = (put(gw_in, &[3 * d, d])?, put(gb_in, &[3 * d])?);
    grad_qkv.attention_qkv_weight_grads(&x, dims, &mut gw, &mut gb)?;
    let (mut gwo, mut gbo) = (put(gw_out, &[d, d])?, Tensor::zeros([d], conveyor_engine::DType::F32, device)?);
    dy.attention_out_grads(&ctx, dims, &mut gwo, &mut gbo)?;
    for t in [&qkv, &ctx, &lse, &grad_qkv, &grad_x, &gw, &gb, &gwo, &gbo] {
        ensure!(t.device().same_device(device), "a result left {device}");
    }
    Ok(vec![
        ("qkv", qkv.try_to_vec_f32()?),
        ("ctx", ctx.try_to_vec_f32()?),
        ("logsumexp", lse.try_to_vec_f32()?),
        ("grad qkv", grad_qkv.try_to_vec_f32()?),
        ("grad x", grad_x.try_to_vec_f32()?),
        ("grad in_proj_weight", gw.try_to_vec_f32()?),
        ("grad in_proj_bias", gb.try_to_vec_f32()?),
        ("grad out_proj.weight", gwo.try_to_vec_f32()?),
        ("grad out_proj.bias", gbo.try_to_vec_f32()?),
    ])
}

fn attention_ops_match_the_cpu(device: &Device) -> Result<()> {
    for (index, &(batch, tokens, n_heads, head_dim, causal)) in SHAPES.iter().enumerate() {
        let dims = AttentionDims { batch, tokens, n_heads, head_dim, causal };
        let d = dims.embed_dim();
        let rows = batch * tokens;
        let lens = [rows * d, 3 * d * d, 3 * d, d * d, rows * d, 3 * d * d, 3 * d, d * d];
        let data: [Vec<f32>; 8] = std::array::from_fn(|i| values(1000 * index as u64 + i as u64, lens[i]));
        let expected = results(&Device::cpu(0), dims, &data)?;
        let got = results(device, dims, &data)?;
        for ((what, g), (_, e)) in got.iter().zip(&expected) {
            ensure!(g.len() == e.len(), "{what}: {} elements, the CPU's {}", g.len(), e.len());
            let norm = |v: &mut dyn Iterator<Item = f32>| v.map(|x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt();
            let diff = norm(&mut g.iter().zip(e).map(|(a, b)| a - b));
            let scale = norm(&mut e.iter().copied());
            let max = e.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            ensure!(
                diff <= 1e-5 * scale.max(1e-30),
                "shape {index} {what} on {device}: ‖diff‖ / ‖cpu‖ = {:e}",
                diff / scale
            );
            for (i, (a, b)) in g.iter().zip(e).enumerate() {
                ensure!(
                    (a - b).abs() <= 1e-4 * max,
                    "shape {index} {what} on {device}: element {i} is {a:e}, the CPU's {b:e}"
                );
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cases = [Case::every_device("attention_ops_match_the_cpu", attention_ops_match_the_cpu)];
    device_cases::run(&[], &cases, device_cases::devices())
}
