//! The convolution device ops (`Tensor::conv2d`, `conv2d_input_grad`,
//! `conv2d_weight_grad_accumulate`), written once and run as one trial per device
//! (`common::device_cases`): each device's result against the CPU's, for the window shapes the
//! CPU dispatches differently (the 16-lane kernel, im2col per sample, 1x1 pointwise, stride 2
//! through col2im, with and without bias).
//!
//! # Tolerance
//!
//! The CPU result is exact on the CPU trial (the ops are the CPU kernels). A GPU sums the products
//! in another order: element `i` passes when `|got_i - cpu_i| <= 2·(k + 1)·u·abs_i`, with `u = 2⁻²⁴`,
//! `k` the longest sum of the op (`in·kh·kw` forward, `out·kh·kw` input gradient,
//! `batch·H_out·W_out` weight gradient, plus one for the bias) and `abs_i` the same op computed
//! on the CPU on absolute values (`Σ |a|·|b|` of that element, plus `|bias|` and the `|initial|`
//! accumulated onto): twice the worst-case error bound of a dot product.
mod common;

use std::process::ExitCode;

use anyhow::{Result, ensure};
use common::device_cases::{self, Case};
use common::values;
use conveyor_engine::cpu::Window2d;
use conveyor_engine::{Device, Shape, Tensor};

/// Unit roundoff of f32.
const U: f32 = 1.0 / 16_777_216.0;

/// One geometry: batch, in and out channels, plane, kernel, stride, padding, bias.
struct Geometry {
    batch: usize,
    in_channels: usize,
    out_channels: usize,
    plane: (usize, usize),
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
    bias: bool,
}

const GEOMETRIES: [Geometry; 5] = [
    // 8x8 output planes (a multiple of 16 pixels): the CPU's lane kernel, as in the zoo's CNN.
    Geometry {
        batch: 3,
        in_channels: 4,
        out_channels: 6,
        plane: (8, 8),
        kernel: (3, 3),
        stride: (1, 1),
        padding: (1, 1),
        bias: true,
    },
    // 5x7 planes: im2col and one product per sample; the gather-form input gradient.
    Geometry {
        batch: 2,
        in_channels: 3,
        out_channels: 5,
        plane: (5, 7),
        kernel: (3, 2),
        stride: (1, 1),
        padding: (0, 1),
        bias: false,
    },
    // 1x1 stride 1: the input is its own col matrix.
    Geometry {
        batch: 2,
        in_channels: 5,
        out_channels: 3,
        plane: (3, 5),
        kernel: (1, 1),
        stride: (1, 1),
        padding: (0, 0),
        bias: true,
    },
    // Stride 2: the input gradient through col2im.
    Geometry {
        batch: 2,
        in_channels: 2,
        out_channels: 4,
        plane: (7, 6),
        kernel: (3, 3),
        stride: (2, 2),
        padding: (1, 1),
        bias: true,
    },
    // More output than input channels with stride 1: col2im rather than the gather form on the CPU.
    Geometry {
        batch: 2,
        in_channels: 1,
        out_channels: 8,
        plane: (6, 6),
        kernel: (3, 3),
        stride: (1, 1),
        padding: (1, 1),
        bias: true,
    },
];

/// What one device computed: forward output, input gradient, weight and bias gradients (the
/// gradients accumulated onto seeded initial values).
struct Results {
    output: Vec<f32>,
    input_grad: Vec<f32>,
    weight_grad: Vec<f32>,
    bias_grad: Vec<f32>,
}

/// The three ops on `device` from the given host values.
fn run(g: &Geometry, window: &Window2d, device: &Device, data: &[Vec<f32>; 6]) -> Result<Results> {
    let [x, w, b, dy, w0, b0] = data;
    let (oh, ow) = (window.out_height(), window.out_width());
    let input_shape = Shape::new([g.batch, g.in_channels, g.plane.0, g.plane.1]);
    let x = Tensor::from_slice(x, input_shape.clone(), device)?;
    let weight = Tensor::from_slice(w, [g.out_channels, g.in_channels, g.kernel.0, g.kernel.1], device)?;
    let bias = if g.bias { Some(Tensor::from_slice(b, [g.out_channels], device)?) } else { None };
    let dy = Tensor::from_slice(dy, [g.batch, g.out_channels, oh, ow], device)?;
    let output = x.conv2d(&weight, bias.as_ref(), window, g.out_channels)?;
    ensure!(output.device().same_device(device) && output.dims() == [g.batch, g.out_channels, oh, ow]);
    let input_grad = dy.conv2d_input_grad(&weight, window, g.out_channels, &input_shape)?;
    ensure!(input_grad.device().same_device(device) && input_grad.shape() == &input_shape);
    let mut weight_grad = Tensor::from_slice(w0, weight.shape().clone(), device)?;
    let mut bias_grad = Tensor::from_slice(b0, [g.out_channels], device)?;
    dy.conv2d_weight_grad_accumulate(&x, window, &mut weight_grad, g.bias.then_some(&mut bias_grad))?;
    Ok(Results {
        output: output.try_to_vec_f32()?,
        input_grad: input_grad.try_to_vec_f32()?,
        weight_grad: weight_grad.try_to_vec_f32()?,
        bias_grad: bias_grad.try_to_vec_f32()?,
    })
}

fn check(what: &str, device: &Device, got: &[f32], expected: &[f32], abs: &[f32], k: usize) -> Result<()> {
    ensure!(got.len() == expected.len(), "{what} on {device}: {} elements, expected {}", got.len(), expected.len());
    for (i, ((g, e), a)) in got.iter().zip(expected).zip(abs).enumerate() {
        let atol = 2.0 * (k + 1) as f32 * U * a;
        ensure!(
            g.to_bits() == e.to_bits() || (g - e).abs() <= atol,
            "{what} on {device}: element {i} is {g:e}, the CPU's {e:e} (|diff| {:e} > {atol:e})",
            (g - e).abs()
        );
    }
    Ok(())
}

fn conv_ops_match_the_cpu(device: &Device) -> Result<()> {
    let cpu = Device::cpu(0);
    for (index, g) in GEOMETRIES.iter().enumerate() {
        let window = Window2d::new(g.in_channels, g.plane, g.kernel, g.stride, g.padding)?;
        let (oh, ow) = (window.out_height(), window.out_width());
        let seed = 100 * index as u64;
        let lens = [
            g.batch * window.input_len(),
            g.out_channels * window.col_rows(),
            g.out_channels,
            g.batch * g.out_channels * oh * ow,
            g.out_channels * window.col_rows(),
            g.out_channels,
        ];
        let data: [Vec<f32>; 6] = std::array::from_fn(|i| values(seed + i as u64, lens[i]));
        let expected = run(g, &window, &cpu, &data)?;
        let got = run(g, &window, device, &data)?;
        let abs_data = data.clone().map(|v| v.into_iter().map(f32::abs).collect::<Vec<_>>());
        let abs = run(g, &window, &cpu, &abs_data)?;
        let what = |op: &str| format!("geometry {index} {op}");
        let forward_k = window.col_rows() + usize::from(g.bias);
        check(&what("conv2d"), device, &got.output, &expected.output, &abs.output, forward_k)?;
        let input_k = g.out_channels * g.kernel.0 * g.kernel.1;
        check(&what("input grad"), device, &got.input_grad, &expected.input_grad, &abs.input_grad, input_k)?;
        let weight_k = g.batch * oh * ow + 1;
        check(&what("weight grad"), device, &got.weight_grad, &expected.weight_grad, &abs.weight_grad, weight_k)?;
        check(&what("bias grad"), device, &got.bias_grad, &expected.bias_grad, &abs.bias_grad, weight_k)?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let cases = [Case::every_device("conv_ops_match_the_cpu", conv_ops_match_the_cpu)];
    device_cases::run(&[], &cases, device_cases::devices())
}
