//! Every device op, written once and run on every available device, against the CPU kernels.
//!
//! Each case builds seeded inputs, computes the expected result with the engine's CPU kernels
//! (`conveyor_engine::cpu`, `optim`), and runs the op on every [`Backend`]: the CPU always (the
//! CPU kernels themselves, through the same host-slice interface), and each CUDA GPU when built
//! with `--features cuda` and a GPU is present (upload, launch, download): one trial per case and
//! device (`case[cpu]`, `case[cuda:0]`; `common::device_cases`). Without a GPU each case's
//! `[cuda]` trial is listed as ignored, by name, and the reason printed once.
//!
//! # Tolerances
//!
//! One formula everywhere: element `i` passes when `|got_i - expected_i| <= atol_i + rtol·|expected_i|`.
//! - Data movement and single IEEE operations (copies, im2col, broadcast, ReLU, dropout, add,
//!   scale, average and global average pooling forward, max pooling forward and its f32 argmax,
//!   tanh's gradient) and the optimizer updates: `rtol = atol = 0`, bit for bit. The kernels are compiled with
//!   `--fmad=false`, so each `a * b + c` rounds twice as in Rust, and sqrt and division are IEEE.
//! - Matrix products: `atol_ij = c·(k + 1)·u·((|A|·|B|)_ij + |C0_ij|)`, `rtol = 0`, with `u = 2⁻²⁴`,
//!   `k` the inner dimension and `C0` the accumulated-onto destination: twice the worst-case
//!   forward error bound of a length-`k` dot product (both results carry one), `c = 2` for f32
//!   and `c = 8` for f16/bf16 inputs (tensor-core accumulators align products with truncation).
//!   Products of two f16 or two bf16 values are exact in f32, so the CPU reference multiplies
//!   the half inputs converted to f32.
//! - Sums in another order (column/row sums, col2im and pooling gradients, scatter with atomics):
//!   `atol_i = 2·n·u·Σ|terms_i|` for `n` terms, passed as `rtol = 0` and an `atol` from the
//!   largest term sum of the case.
//! - Transcendentals (GELU, tanh; CUDA's `erfcf`/`expf`/`tanhf` are within 2–4 ulp, the CPU's
//!   are computed in f64): `rtol = 4e-6`, `atol = 1e-6`.
//! - Log-softmax and cross-entropy over rows of 1000: the GPU sums the exponentials in f32, the CPU
//!   in f64, so the log-sum-exp may differ by about `cols·u` relative: `atol = 1e-4` on
//!   log-probabilities and losses (divided by the normalizer), `rtol = 1e-4` on probabilities.
mod common;

use common::device_cases::{self, Case, Opener, Targets};
use common::values;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Result, bail, ensure};
use conveyor_engine::cpu::{self, MatRef, Window2d};
use conveyor_engine::device::{CudaBuffer, CudaStream, DeviceMatRef};
use conveyor_engine::optim::{AdamConfig, Optimizer, OptimizerConfig, SgdConfig};
use conveyor_engine::{DType, Device, Error, Tensor};
use half::{bf16, f16};

/// Unit roundoff of f32.
const U: f32 = 1.0 / 16_777_216.0;

/// `|got - expected| <= atol + rtol·|expected|`, elementwise.
#[derive(Clone, Copy, Debug)]
struct Tolerance {
    rtol: f32,
    atol: f32,
}

const EXACT: Tolerance = Tolerance { rtol: 0.0, atol: 0.0 };
const TRANSCENDENTAL: Tolerance = Tolerance { rtol: 4e-6, atol: 1e-6 };

/// The tolerance of a sum of `n` terms whose absolute values add up to at most `abs_sum`.
fn reordered_sum(n: usize, abs_sum: f32) -> Tolerance {
    Tolerance { rtol: 0.0, atol: 2.0 * n as f32 * U * abs_sum }
}

fn assert_close(what: &str, backend: &Backend, got: &[f32], expected: &[f32], tolerance: Tolerance) -> Result<()> {
    assert_close_each(what, backend, got, expected, |_| tolerance)
}

fn assert_close_each(
    what: &str,
    backend: &Backend,
    got: &[f32],
    expected: &[f32],
    tolerance: impl Fn(usize) -> Tolerance,
) -> Result<()> {
    ensure!(
        got.len() == expected.len(),
        "{what} on {}: {} elements, expected {}",
        backend.name(),
        got.len(),
        expected.len()
    );
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        let Tolerance { rtol, atol } = tolerance(i);
        let same = g.to_bits() == e.to_bits() || (g.is_nan() && e.is_nan());
        ensure!(
            same || (g - e).abs() <= atol + rtol * e.abs(),
            "{what} on {}: element {i} is {g:e}, expected {e:e} (|diff| {:e} > {atol:e} + {rtol:e}·|expected|)",
            backend.name(),
            (g - e).abs()
        );
    }
    Ok(())
}

/// A device the cases run on: the CPU kernels, or one stream on one GPU.
enum Backend {
    Cpu,
    Cuda(CudaStream),
}

/// A fresh stream on a fresh handle of `cuda:ordinal`.
fn cuda_stream(ordinal: usize) -> Result<CudaStream> {
    match Device::cuda(ordinal, None)? {
        Device::Cuda(cuda) => Ok(cuda.new_stream()?),
        Device::Cpu(_) => bail!("Device::cuda returned a CPU device"),
    }
}

/// The CPU kernels, and a fresh stream on every usable GPU for each trial.
fn backends() -> Targets<Backend> {
    let devices = device_cases::devices();
    Targets {
        cpu: Arc::new(|| Ok(Backend::Cpu)),
        gpus: devices
            .gpus
            .into_iter()
            .map(|(label, _)| {
                let ordinal: usize = label.trim_start_matches("cuda:").parse().expect("labels are cuda:N");
                let open: Opener<Backend> = Arc::new(move || Ok(Backend::Cuda(cuda_stream(ordinal)?)));
                (label, open)
            })
            .collect(),
        missing: devices.missing,
    }
}

/// A host matrix as an operand: `rows x cols`, stored row-major, or (when `transposed`) stored as
/// its transpose and viewed through `.t()`.
struct Operand {
    data: Vec<f32>,
    rows: usize,
    cols: usize,
    transposed: bool,
}

impl Operand {
    fn new(seed: u64, rows: usize, cols: usize, transposed: bool) -> Operand {
        Operand { data: values(seed, rows * cols), rows, cols, transposed }
    }

    fn cpu(&self) -> MatRef<'_> {
        if self.transposed {
            MatRef::row_major(&self.data, self.cols, self.rows).expect("sized by new").t()
        } else {
            MatRef::row_major(&self.data, self.rows, self.cols).expect("sized by new")
        }
    }

    fn device<'a, T: conveyor_engine::device::GemmElement>(
        &self,
        buffer: &'a CudaBuffer<T>,
    ) -> Result<DeviceMatRef<'a, T>> {
        Ok(if self.transposed {
            DeviceMatRef::row_major(buffer, self.cols, self.rows)?.t()
        } else {
            DeviceMatRef::row_major(buffer, self.rows, self.cols)?
        })
    }

    /// The same operand with every element rounded through `round`.
    fn rounded(&self, round: impl Fn(f32) -> f32) -> Operand {
        Operand { data: self.data.iter().map(|&x| round(x)).collect(), ..*self }
    }

    fn abs(&self) -> Operand {
        self.rounded(f32::abs)
    }
}

/// The GEMM tolerance of `dst = C0 + A·B` (module docs), per element.
fn gemm_tolerance(lhs: &Operand, rhs: &Operand, initial: &[f32], factor: f32) -> Result<Vec<f32>> {
    let (abs_lhs, abs_rhs) = (lhs.abs(), rhs.abs());
    let mut bound: Vec<f32> = initial.iter().map(|x| x.abs()).collect();
    cpu::matmul(&mut bound, abs_lhs.cpu(), abs_rhs.cpu(), true)?;
    Ok(bound.iter().map(|b| factor * (lhs.cols + 1) as f32 * U * b).collect())
}

/// Which element type the device GEMM multiplies in.
#[derive(Clone, Copy, Debug)]
enum Precision {
    F32,
    F16,
    Bf16,
}

impl Backend {
    fn name(&self) -> String {
        match self {
            Backend::Cpu => "cpu".to_string(),
            Backend::Cuda(stream) => format!("cuda:{} ({})", stream.device().ordinal(), stream.device().name()),
        }
    }

    /// `dst (= or +=) lhs · rhs` with the operands rounded to `precision` (the CPU multiplies the
    /// rounded values in f32).
    fn matmul(
        &self,
        dst: &mut [f32],
        lhs: &Operand,
        rhs: &Operand,
        accumulate: bool,
        precision: Precision,
    ) -> Result<()> {
        match self {
            Backend::Cpu => Ok(cpu::matmul(dst, lhs.cpu(), rhs.cpu(), accumulate)?),
            Backend::Cuda(stream) => {
                let mut out = stream.upload(dst)?;
                match precision {
                    Precision::F32 => {
                        let (a, b) = (stream.upload(&lhs.data)?, stream.upload(&rhs.data)?);
                        stream.matmul(&mut out, lhs.device(&a)?, rhs.device(&b)?, accumulate)?;
                    }
                    Precision::F16 => {
                        let a = stream.upload(&lhs.data.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>())?;
                        let b = stream.upload(&rhs.data.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>())?;
                        stream.matmul(&mut out, lhs.device(&a)?, rhs.device(&b)?, accumulate)?;
                    }
                    Precision::Bf16 => {
                        let a = stream.upload(&lhs.data.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>())?;
                        let b = stream.upload(&rhs.data.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>())?;
                        stream.matmul(&mut out, lhs.device(&a)?, rhs.device(&b)?, accumulate)?;
                    }
                }
                stream.download_into(&out, dst)?;
                Ok(())
            }
        }
    }

    /// Runs a CUDA op on uploaded inputs and downloads its output; on the CPU runs `cpu_op`.
    fn unary(
        &self,
        input: &[f32],
        output: &mut [f32],
        cpu_op: impl FnOnce(&[f32], &mut [f32]) -> conveyor_engine::Result<()>,
        cuda_op: impl FnOnce(&CudaStream, &CudaBuffer<f32>, &mut CudaBuffer<f32>) -> conveyor_engine::Result<()>,
    ) -> Result<()> {
        match self {
            Backend::Cpu => Ok(cpu_op(input, output)?),
            Backend::Cuda(stream) => {
                let x = stream.upload(input)?;
                let mut y = stream.upload(output)?;
                cuda_op(stream, &x, &mut y)?;
                Ok(stream.download_into(&y, output)?)
            }
        }
    }

    /// As [`Backend::unary`] with two inputs.
    fn binary(
        &self,
        a: &[f32],
        b: &[f32],
        output: &mut [f32],
        cpu_op: impl FnOnce(&[f32], &[f32], &mut [f32]) -> conveyor_engine::Result<()>,
        cuda_op: impl FnOnce(
            &CudaStream,
            &CudaBuffer<f32>,
            &CudaBuffer<f32>,
            &mut CudaBuffer<f32>,
        ) -> conveyor_engine::Result<()>,
    ) -> Result<()> {
        match self {
            Backend::Cpu => Ok(cpu_op(a, b, output)?),
            Backend::Cuda(stream) => {
                let (x, y) = (stream.upload(a)?, stream.upload(b)?);
                let mut z = stream.upload(output)?;
                cuda_op(stream, &x, &y, &mut z)?;
                Ok(stream.download_into(&z, output)?)
            }
        }
    }
}

fn matmul_in_all_four_layouts_with_and_without_accumulate(backend: &Backend) -> Result<()> {
    for (m, k, n) in [(7, 5, 3), (33, 70, 18), (1, 64, 1), (64, 1, 9)] {
        for (lhs_t, rhs_t) in [(false, false), (true, false), (false, true), (true, true)] {
            for precision in [Precision::F32, Precision::F16, Precision::Bf16] {
                let (lhs, rhs) = (Operand::new(1 + m as u64, m, k, lhs_t), Operand::new(2 + n as u64, k, n, rhs_t));
                let (lhs, rhs, factor) = match precision {
                    Precision::F32 => (lhs, rhs, 2.0),
                    Precision::F16 => {
                        (lhs.rounded(|x| f16::from_f32(x).to_f32()), rhs.rounded(|x| f16::from_f32(x).to_f32()), 8.0)
                    }
                    Precision::Bf16 => {
                        (lhs.rounded(|x| bf16::from_f32(x).to_f32()), rhs.rounded(|x| bf16::from_f32(x).to_f32()), 8.0)
                    }
                };
                let initial = values(3, m * n);
                for accumulate in [false, true] {
                    let mut expected = initial.clone();
                    cpu::matmul(&mut expected, lhs.cpu(), rhs.cpu(), accumulate)?;
                    let mut got = initial.clone();
                    backend.matmul(&mut got, &lhs, &rhs, accumulate, precision)?;
                    let zero = vec![0.0; m * n];
                    let tolerance = gemm_tolerance(&lhs, &rhs, if accumulate { &initial } else { &zero }, factor)?;
                    let what =
                        format!("{m}x{k}·{k}x{n} {precision:?} lhs_t={lhs_t} rhs_t={rhs_t} accumulate={accumulate}");
                    assert_close_each(&what, backend, &got, &expected, |i| Tolerance {
                        rtol: 0.0,
                        atol: tolerance[i],
                    })?;
                }
            }
        }
    }
    Ok(())
}

fn matmul_of_strided_blocks_and_batches(backend: &Backend) -> Result<()> {
    let Backend::Cuda(stream) = backend else { return Ok(()) };
    // A 6x4 block of columns 3..7 of a 6x10 matrix, times a 4x5 matrix.
    let (wide, rhs) = (values(11, 6 * 10), Operand::new(12, 4, 5, false));
    let block: Vec<f32> = (0..6).flat_map(|r| wide[r * 10 + 3..r * 10 + 7].to_vec()).collect();
    let lhs = Operand { data: block, rows: 6, cols: 4, transposed: false };
    let mut expected = vec![0.0; 30];
    cpu::matmul(&mut expected, lhs.cpu(), rhs.cpu(), false)?;
    let (a, b) = (stream.upload(&wide)?, stream.upload(&rhs.data)?);
    let mut out = stream.alloc_zeros::<f32>(30)?;
    stream.matmul(&mut out, DeviceMatRef::row_major_at(&a, 3, 6, 4, 10)?, rhs.device(&b)?, false)?;
    let tolerance = gemm_tolerance(&lhs, &rhs, &[0.0; 30], 2.0)?;
    assert_close_each("strided block", backend, &stream.download(&out)?, &expected, |i| Tolerance {
        rtol: 0.0,
        atol: tolerance[i],
    })?;

    // 3 products sharing one left matrix (batch stride 0), right matrices 20 elements apart.
    let (shared, stacked) = (Operand::new(13, 2, 4, false), values(14, 3 * 20));
    let (a, b) = (stream.upload(&shared.data)?, stream.upload(&stacked)?);
    let mut out = stream.alloc_zeros::<f32>(3 * 10)?;
    let rhs_view = DeviceMatRef::row_major(&b, 4, 5)?.with_batch_stride(20);
    stream.matmul_batched(&mut out, shared.device(&a)?, rhs_view, 3, false)?;
    let got = stream.download(&out)?;
    for batch in 0..3 {
        let rhs = Operand { data: stacked[batch * 20..batch * 20 + 20].to_vec(), rows: 4, cols: 5, transposed: false };
        let mut expected = vec![0.0; 10];
        cpu::matmul(&mut expected, shared.cpu(), rhs.cpu(), false)?;
        let tolerance = gemm_tolerance(&shared, &rhs, &[0.0; 10], 2.0)?;
        let what = format!("batched product {batch}");
        assert_close_each(&what, backend, &got[batch * 10..batch * 10 + 10], &expected, |i| Tolerance {
            rtol: 0.0,
            atol: tolerance[i],
        })?;
    }
    // A view past its buffer is refused before cuBLAS sees it.
    ensure!(matches!(DeviceMatRef::row_major(&b, 61, 1), Err(Error::ShapeMismatch { .. })));
    Ok(())
}

fn elementwise_ops_and_activations(backend: &Backend) -> Result<()> {
    let n = 1000;
    let (x, dy) = (values(21, n).iter().map(|v| v * 6.0).collect::<Vec<_>>(), values(22, n));
    let mut out = vec![0.0; n];

    let mut expected = vec![0.0; n];
    cpu::elementwise::add(&x, &dy, &mut expected)?;
    backend.binary(&x, &dy, &mut out, cpu::elementwise::add, |s, a, b, o| s.add(a, b, o))?;
    assert_close("add", backend, &out, &expected, EXACT)?;

    type Forward = fn(&[f32], &mut [f32]) -> conveyor_engine::Result<()>;
    let unary_cases: [(&str, Forward, Tolerance); 3] = [
        ("relu_forward", cpu::activation::relu_forward, EXACT),
        ("gelu_forward", cpu::activation::gelu_forward, TRANSCENDENTAL),
        ("tanh_forward", cpu::activation::tanh_forward, TRANSCENDENTAL),
    ];
    for (name, cpu_op, tolerance) in unary_cases {
        cpu_op(&x, &mut expected)?;
        backend.unary(&x, &mut out, cpu_op, |s, a, o| match name {
            "relu_forward" => s.relu_forward(a, o),
            "gelu_forward" => s.gelu_forward(a, o),
            _ => s.tanh_forward(a, o),
        })?;
        assert_close(name, backend, &out, &expected, tolerance)?;
    }

    // Backward ops take the forward output (ReLU, tanh) or input (GELU), as on the CPU.
    let mut relu_y = vec![0.0; n];
    cpu::activation::relu_forward(&x, &mut relu_y)?;
    let mut tanh_y = vec![0.0; n];
    cpu::activation::tanh_forward(&x, &mut tanh_y)?;
    type Backward = fn(&[f32], &[f32], &mut [f32]) -> conveyor_engine::Result<()>;
    let backward_cases: [(&str, &[f32], Backward, Tolerance); 3] = [
        ("relu_backward", &relu_y, cpu::activation::relu_backward, EXACT),
        ("gelu_backward", &x, cpu::activation::gelu_backward, TRANSCENDENTAL),
        ("tanh_backward", &tanh_y, cpu::activation::tanh_backward, EXACT),
    ];
    for (name, forward, cpu_op, tolerance) in backward_cases {
        cpu_op(forward, &dy, &mut expected)?;
        backend.binary(forward, &dy, &mut out, cpu_op, |s, a, b, o| match name {
            "relu_backward" => s.relu_backward(a, b, o),
            "gelu_backward" => s.gelu_backward(a, b, o),
            _ => s.tanh_backward(a, b, o),
        })?;
        assert_close(name, backend, &out, &expected, tolerance)?;
    }

    // In-place ops and dropout, against their one-line definitions.
    let mask: Vec<f32> = values(23, n).iter().map(|v| if *v > 0.2 { 1.0 } else { 0.0 }).collect();
    let scale = 1.0 / (1.0 - 0.4f32);
    let dropout: Vec<f32> = x.iter().zip(&mask).map(|(a, m)| a * m * scale).collect();
    let added: Vec<f32> = x.iter().zip(&dy).map(|(a, b)| a + b).collect();
    let scaled: Vec<f32> = x.iter().map(|a| a * 0.37).collect();
    match backend {
        Backend::Cpu => {}
        Backend::Cuda(stream) => {
            let mask_f16: Vec<half::f16> = mask.iter().map(|&m| half::f16::from_f32(m)).collect();
            let (xb, mb, dyb) = (stream.upload(&x)?, stream.upload(&mask_f16)?, stream.upload(&dy)?);
            let mut y = stream.alloc_zeros::<f32>(n)?;
            stream.dropout_apply(&xb, &mb, scale, &mut y)?;
            assert_close("dropout_apply", backend, &stream.download(&y)?, &dropout, EXACT)?;
            let mut acc = stream.upload(&x)?;
            stream.add_assign(&mut acc, &dyb)?;
            assert_close("add_assign", backend, &stream.download(&acc)?, &added, EXACT)?;
            let mut scaled_buffer = stream.upload(&x)?;
            stream.scale(&mut scaled_buffer, 0.37)?;
            assert_close("scale", backend, &stream.download(&scaled_buffer)?, &scaled, EXACT)?;
            ensure!(matches!(stream.add(&xb, &dyb, &mut stream.alloc_zeros(n - 1)?), Err(Error::ShapeMismatch { .. })));
        }
    }
    Ok(())
}

fn reductions_broadcast_and_sum_of_squares(backend: &Backend) -> Result<()> {
    let (rows, cols) = (37, 300);
    let matrix = values(31, rows * cols);
    let (initial_cols, initial_rows) = (values(32, cols), values(33, rows));
    let col_abs_sum = rows as f32 + 1.0;
    let row_abs_sum = cols as f32 + 1.0;

    let mut expected = initial_cols.clone();
    cpu::elementwise::accumulate_column_sums(&matrix, &mut expected)?;
    let mut got = initial_cols.clone();
    backend
        .unary(&matrix, &mut got, cpu::elementwise::accumulate_column_sums, |s, m, o| s.accumulate_column_sums(m, o))?;
    assert_close("accumulate_column_sums", backend, &got, &expected, reordered_sum(rows + 1, col_abs_sum))?;

    let mut expected = initial_rows.clone();
    cpu::elementwise::accumulate_row_sums(&matrix, &mut expected)?;
    let mut got = initial_rows.clone();
    backend.unary(&matrix, &mut got, cpu::elementwise::accumulate_row_sums, |s, m, o| s.accumulate_row_sums(m, o))?;
    assert_close("accumulate_row_sums", backend, &got, &expected, reordered_sum(cols + 1, row_abs_sum))?;

    let mut expected = vec![0.0; rows * cols];
    cpu::elementwise::broadcast_rows(&initial_cols, &mut expected)?;
    let mut got = vec![0.0; rows * cols];
    backend.unary(&initial_cols, &mut got, cpu::elementwise::broadcast_rows, |s, r, o| s.broadcast_rows(r, o))?;
    assert_close("broadcast_rows", backend, &got, &expected, EXACT)?;

    let tensor = Tensor::from_slice(&matrix, [rows * cols], &Device::cpu(0))?;
    let expected = conveyor_engine::optim::grad_sum_of_squares(&[&tensor])?;
    let got = match backend {
        Backend::Cpu => expected,
        Backend::Cuda(stream) => stream.sum_of_squares(&stream.upload(&matrix)?)?,
    };
    ensure!((got - expected).abs() <= 1e-12 * expected, "sum_of_squares on {}: {got} vs {expected}", backend.name());
    Ok(())
}

fn log_softmax_and_cross_entropy(backend: &Backend) -> Result<()> {
    let (rows, cols) = (9, 1000);
    let logits: Vec<f32> = values(41, rows * cols).iter().map(|v| v * 20.0).collect();
    let mut expected = vec![0.0; rows * cols];
    cpu::softmax::log_softmax_rows(&logits, cols, &mut expected)?;
    let mut got = vec![0.0; rows * cols];
    backend.unary(
        &logits,
        &mut got,
        |x, y| cpu::softmax::log_softmax_rows(x, cols, y),
        |s, x, y| s.log_softmax_rows(x, cols, y),
    )?;
    // |log_softmax| here reaches ~40; 4e-6 relative of the log-sum (~20) bounds the f32 sum.
    assert_close("log_softmax_rows", backend, &got, &expected, Tolerance { rtol: 4e-6, atol: 1e-4 })?;

    // Cross-entropy from the CPU log-softmax: loss = -logp[label] / N, grad = (p - onehot) / N.
    let labels: Vec<i64> = (0..rows as i64).map(|r| (r * 131) % cols as i64).collect();
    let normalizer = 32.0f32;
    let expected_loss: Vec<f32> = (0..rows).map(|r| -expected[r * cols + labels[r] as usize] / normalizer).collect();
    let expected_grad: Vec<f32> = (0..rows * cols)
        .map(|i| (expected[i].exp() - if (i % cols) as i64 == labels[i / cols] { 1.0 } else { 0.0 }) / normalizer)
        .collect();
    let Backend::Cuda(stream) = backend else { return Ok(()) };
    let (x, l) = (stream.upload(&logits)?, stream.upload(&labels)?);
    let (mut loss, mut grad) = (stream.alloc_zeros(rows)?, stream.alloc_zeros(rows * cols)?);
    stream.cross_entropy(&x, &l, cols, normalizer, &mut loss, &mut grad)?;
    let loss_tolerance = Tolerance { rtol: 4e-6, atol: 1e-4 / normalizer };
    assert_close("cross_entropy loss", backend, &stream.download(&loss)?, &expected_loss, loss_tolerance)?;
    let grad_tolerance = Tolerance { rtol: 1e-4, atol: 1e-4 / normalizer };
    assert_close("cross_entropy grad", backend, &stream.download(&grad)?, &expected_grad, grad_tolerance)?;
    // An out-of-range label poisons its row instead of reading out of bounds.
    let bad = stream.upload(&[cols as i64; 9])?;
    stream.cross_entropy(&x, &bad, cols, normalizer, &mut loss, &mut grad)?;
    ensure!(stream.download(&loss)?.iter().all(|v| v.is_nan()), "an invalid label must give NaN loss");
    Ok(())
}

/// Window geometries: stride 1 and 2, with and without padding, non-square.
fn windows() -> Result<Vec<Window2d>> {
    Ok(vec![
        Window2d::new(3, (9, 8), (3, 3), (1, 1), (1, 1))?,
        Window2d::new(2, (11, 7), (3, 2), (2, 2), (1, 0))?,
        Window2d::new(4, (6, 6), (2, 2), (2, 2), (0, 0))?,
        Window2d::new(1, (5, 9), (1, 3), (1, 2), (0, 1))?,
    ])
}

fn im2col_col2im_and_convolution(backend: &Backend) -> Result<()> {
    let batch = 3;
    for window in windows()? {
        let (col_len, input_len) = (window.col_rows() * window.out_plane_len(), window.input_len());
        let input = values(51, batch * input_len);
        let mut expected = vec![0.0; batch * col_len];
        for (x, col) in input.chunks(input_len).zip(expected.chunks_mut(col_len)) {
            cpu::conv::im2col(x, &window, col)?;
        }
        let cpu_im2col = |x: &[f32], cols: &mut [f32]| -> conveyor_engine::Result<()> {
            for (x, col) in x.chunks(input_len).zip(cols.chunks_mut(col_len)) {
                cpu::conv::im2col(x, &window, col)?;
            }
            Ok(())
        };
        let mut got = vec![0.0; batch * col_len];
        backend.unary(&input, &mut got, cpu_im2col, |s, x, c| s.im2col(x, batch, &window, c))?;
        assert_close(&format!("im2col {window:?}"), backend, &got, &expected, EXACT)?;

        let (columns, initial) = (values(52, batch * col_len), values(53, batch * input_len));
        let cpu_col2im = |c: &[f32], dx: &mut [f32]| -> conveyor_engine::Result<()> {
            for (c, dx) in c.chunks(col_len).zip(dx.chunks_mut(input_len)) {
                cpu::conv::col2im(c, &window, dx)?;
            }
            Ok(())
        };
        let mut expected = initial.clone();
        cpu_col2im(&columns, &mut expected)?;
        let mut got = initial.clone();
        backend.unary(&columns, &mut got, cpu_col2im, |s, c, dx| s.col2im(c, batch, &window, dx))?;
        let terms = window.kernel_height * window.kernel_width + 1;
        assert_close(&format!("col2im {window:?}"), backend, &got, &expected, reordered_sum(terms, terms as f32))?;

        // A convolution of the batch: one im2col and one strided-batched GEMM against the CPU's
        // per-sample im2col and matmul.
        let Backend::Cuda(stream) = backend else { continue };
        let out_channels = 5;
        let weight = Operand::new(54, out_channels, window.col_rows(), false);
        let out_plane = window.out_plane_len();
        let mut expected = vec![0.0; batch * out_channels * out_plane];
        let mut col = vec![0.0; col_len];
        for (x, y) in input.chunks(input_len).zip(expected.chunks_mut(out_channels * out_plane)) {
            cpu::conv::im2col(x, &window, &mut col)?;
            cpu::matmul(y, weight.cpu(), MatRef::row_major(&col, window.col_rows(), out_plane)?, false)?;
        }
        let (x, w) = (stream.upload(&input)?, stream.upload(&weight.data)?);
        let mut cols = stream.alloc_zeros(batch * col_len)?;
        stream.im2col(&x, batch, &window, &mut cols)?;
        let mut y = stream.alloc_zeros(expected.len())?;
        let cols_view = DeviceMatRef::row_major(&cols, window.col_rows(), out_plane)?.with_batch_stride(col_len);
        stream.matmul_batched(&mut y, weight.device(&w)?, cols_view, batch, false)?;
        // The GEMM tolerance with c = 2 and |W|·|cols| <= k (every value lies in [-1, 1]).
        let atol = 2.0 * (window.col_rows() + 1) as f32 * U * window.col_rows() as f32;
        assert_close("conv2d forward", backend, &stream.download(&y)?, &expected, Tolerance { rtol: 0.0, atol })?;
    }
    Ok(())
}

fn max_and_average_pooling(backend: &Backend) -> Result<()> {
    let batch = 2;
    for window in windows()? {
        let n_planes = batch * window.channels;
        let (in_len, out_len) = (n_planes * window.in_plane_len(), n_planes * window.out_plane_len());
        let input = values(61, in_len);
        let (dy, initial) = (values(62, out_len), values(63, in_len));
        let terms = window.kernel_height * window.kernel_width + 1;

        let mut expected = vec![0.0; out_len];
        cpu::pool::avg_pool2d_forward(&input, n_planes, &window, &mut expected)?;
        let mut got = vec![0.0; out_len];
        backend.unary(
            &input,
            &mut got,
            |x, y| cpu::pool::avg_pool2d_forward(x, n_planes, &window, y),
            |s, x, y| s.avg_pool_forward(x, n_planes, &window, y),
        )?;
        assert_close(&format!("avg_pool_forward {window:?}"), backend, &got, &expected, EXACT)?;

        let mut expected = initial.clone();
        cpu::pool::avg_pool2d_backward(&dy, n_planes, &window, &mut expected)?;
        let mut got = initial.clone();
        backend.unary(
            &dy,
            &mut got,
            |g, dx| cpu::pool::avg_pool2d_backward(g, n_planes, &window, dx),
            |s, g, dx| s.avg_pool_backward(g, n_planes, &window, dx),
        )?;
        assert_close(
            &format!("avg_pool_backward {window:?}"),
            backend,
            &got,
            &expected,
            reordered_sum(terms, terms as f32),
        )?;

        let (mut expected_y, mut expected_arg) = (vec![0.0; out_len], vec![0.0; out_len]);
        cpu::pool::max_pool2d_forward(&input, n_planes, &window, &mut expected_y, &mut expected_arg)?;
        let mut expected_dx = initial.clone();
        cpu::pool::max_pool2d_backward(&dy, &expected_arg, n_planes, &window, &mut expected_dx)?;
        let Backend::Cuda(stream) = backend else { continue };
        let x = stream.upload(&input)?;
        let (mut y, mut arg) = (stream.alloc_zeros(out_len)?, stream.alloc_zeros::<f32>(out_len)?);
        stream.max_pool_forward(&x, n_planes, &window, &mut y, &mut arg)?;
        assert_close("max_pool_forward", backend, &stream.download(&y)?, &expected_y, EXACT)?;
        // The argmax in the CPU's layout, f32 positions within the plane, bit for bit.
        let arg_host = stream.download(&arg)?;
        ensure!(
            arg_host.iter().map(|a| a.to_bits()).eq(expected_arg.iter().map(|a| a.to_bits())),
            "max_pool_forward argmax on {} differs from the CPU's bits",
            backend.name()
        );
        let mut dx = stream.upload(&initial)?;
        stream.max_pool_backward(&stream.upload(&dy)?, &arg, n_planes, &window, &mut dx)?;
        assert_close(
            "max_pool_backward",
            backend,
            &stream.download(&dx)?,
            &expected_dx,
            reordered_sum(terms, terms as f32),
        )?;
    }
    Ok(())
}

/// The device the Tensor-level ops of a backend run on: the host, or the backend's GPU.
fn tensor_device(backend: &Backend) -> Result<Device> {
    Ok(match backend {
        Backend::Cpu => Device::cpu(0),
        Backend::Cuda(stream) => Device::cuda(stream.device().ordinal(), None)?,
    })
}

/// The Tensor-level pooling, dropout and residual-sum ops (`device::ops::pool`, what the layers
/// call) on this backend's device, against the CPU kernels: forward passes, the argmax (its f32
/// bits), dropout and add bit for bit; pooling gradients bit for bit on the CPU and within the
/// reordered-sum bound on a GPU (overlapping windows sum in another order there).
fn pool_dropout_and_add_tensor_ops(backend: &Backend) -> Result<()> {
    let device = tensor_device(backend)?;
    let batch = 2;
    let exact_on_cpu = |tolerance: Tolerance| if let Backend::Cpu = backend { EXACT } else { tolerance };
    for window in windows()? {
        let n_planes = batch * window.channels;
        let (in_len, out_len) = (n_planes * window.in_plane_len(), n_planes * window.out_plane_len());
        let in_shape = conveyor_engine::Shape::new([batch, window.channels, window.in_height, window.in_width]);
        let out_dims = [batch, window.channels, window.out_height(), window.out_width()];
        let (input, dy) = (values(91, in_len), values(92, out_len));
        let x = Tensor::from_slice(&input, in_shape.clone(), &device)?;
        let grad = Tensor::from_slice(&dy, out_dims, &device)?;
        let terms = window.kernel_height * window.kernel_width + 1;
        let what = |op: &str| format!("Tensor::{op} {window:?}");

        let (mut expected_y, mut expected_arg) = (vec![0.0; out_len], vec![0.0; out_len]);
        cpu::pool::max_pool2d_forward(&input, n_planes, &window, &mut expected_y, &mut expected_arg)?;
        let (y, argmax) = x.max_pool2d(&window)?;
        ensure!(y.dims() == out_dims && argmax.dims() == out_dims, "max_pool2d shapes");
        assert_close(&what("max_pool2d"), backend, &y.try_to_vec_f32()?, &expected_y, EXACT)?;
        ensure!(
            argmax.try_to_vec_f32()?.iter().map(|a| a.to_bits()).eq(expected_arg.iter().map(|a| a.to_bits())),
            "{}: the argmax on {} differs from the CPU's bits",
            what("max_pool2d"),
            backend.name()
        );
        let mut expected_dx = vec![0.0; in_len];
        cpu::pool::max_pool2d_backward(&dy, &expected_arg, n_planes, &window, &mut expected_dx)?;
        let dx = Tensor::max_pool2d_input_grad(&grad, &argmax, &window, &in_shape)?;
        let tolerance = exact_on_cpu(reordered_sum(terms, terms as f32));
        assert_close(&what("max_pool2d_input_grad"), backend, &dx.try_to_vec_f32()?, &expected_dx, tolerance)?;

        let mut expected_y = vec![0.0; out_len];
        cpu::pool::avg_pool2d_forward(&input, n_planes, &window, &mut expected_y)?;
        assert_close(&what("avg_pool2d"), backend, &x.avg_pool2d(&window)?.try_to_vec_f32()?, &expected_y, EXACT)?;
        let mut expected_dx = vec![0.0; in_len];
        cpu::pool::avg_pool2d_backward(&dy, n_planes, &window, &mut expected_dx)?;
        let dx = Tensor::avg_pool2d_input_grad(&grad, &window, &in_shape)?;
        let tolerance = exact_on_cpu(reordered_sum(terms, terms as f32));
        assert_close(&what("avg_pool2d_input_grad"), backend, &dx.try_to_vec_f32()?, &expected_dx, tolerance)?;

        // Global average pooling: one sum per plane, in the same order on every device.
        let mut expected_y = vec![0.0; n_planes];
        cpu::pool::global_avg_pool_forward(&input, window.in_plane_len(), &mut expected_y)?;
        let y = x.global_avg_pool2d()?;
        ensure!(y.dims() == [batch, window.channels], "global_avg_pool2d shape {}", y.shape());
        assert_close(&what("global_avg_pool2d"), backend, &y.try_to_vec_f32()?, &expected_y, EXACT)?;
        let plane_grad = values(93, n_planes);
        let mut expected_dx = vec![0.0; in_len];
        cpu::pool::global_avg_pool_backward(&plane_grad, window.in_plane_len(), &mut expected_dx)?;
        let plane_grad = Tensor::from_slice(&plane_grad, [batch, window.channels], &device)?;
        let dx = Tensor::global_avg_pool2d_input_grad(&plane_grad, &in_shape)?;
        assert_close(&what("global_avg_pool2d_input_grad"), backend, &dx.try_to_vec_f32()?, &expected_dx, EXACT)?;
    }

    // Dropout: x · keep · scale in that order, forward and with the saved mask; and the sum.
    let n = 1001;
    let (input, other) = (values(94, n), values(95, n));
    let keep: Vec<f32> = values(96, n).iter().map(|&v| if v < -0.4 { 0.0 } else { 1.0 }).collect();
    let scale = 1.0 / (1.0 - 0.3f32);
    let expected: Vec<f32> = input.iter().zip(&keep).map(|(x, k)| x * k * scale).collect();
    let x = Tensor::from_slice(&input, [7, 11, 13], &device)?;
    let (y, mask) = x.dropout_forward(&keep, scale)?;
    assert_close("Tensor::dropout_forward", backend, &y.try_to_vec_f32()?, &expected, EXACT)?;
    ensure!(mask.try_to_vec_f32()? == keep, "the saved dropout mask on {} is not the keep mask", backend.name());
    let again = x.dropout_apply(&mask, scale)?;
    assert_close("Tensor::dropout_apply", backend, &again.try_to_vec_f32()?, &expected, EXACT)?;
    let expected: Vec<f32> = input.iter().zip(&other).map(|(a, b)| a + b).collect();
    let sum = x.add(&Tensor::from_slice(&other, [7, 11, 13], &device)?)?;
    assert_close("Tensor::add", backend, &sum.try_to_vec_f32()?, &expected, EXACT)?;
    match x.dropout_forward(&keep[1..], scale) {
        Err(Error::ShapeMismatch { .. }) => Ok(()),
        other => bail!("a short dropout mask gave {other:?}, expected a shape error"),
    }
}

/// Three optimizer steps on the CPU (`Optimizer::step`, torch's rules) and on the device.
fn optimizer_case(backend: &Backend, config: OptimizerConfig) -> Result<()> {
    let n = 777;
    let host = Device::cpu(0);
    let mut param = Tensor::from_slice(&values(71, n), [n], &host)?;
    let grads: Vec<Vec<f32>> = (0..3).map(|step| values(72 + step, n)).collect();
    let start = param.to_vec_f32();
    let mut optimizer = Optimizer::new(config, 1)?;
    for grad in &grads {
        optimizer.step(&mut [&mut param], &[&Tensor::from_slice(grad, [n], &host)?])?;
    }
    let expected = param.to_vec_f32();
    let got = match backend {
        Backend::Cpu => expected.clone(),
        Backend::Cuda(stream) => {
            let mut p = stream.upload(&start)?;
            let (mut first, mut second) = (stream.alloc_zeros(n)?, stream.alloc_zeros(n)?);
            for (step, grad) in grads.iter().enumerate() {
                let g = stream.upload(grad)?;
                match &config {
                    OptimizerConfig::Sgd(sgd) => {
                        let buffer = sgd.uses_momentum_buffer().then_some(&mut first);
                        stream.sgd_step(&mut p, &g, buffer, sgd, step == 0)?;
                    }
                    OptimizerConfig::Adam(adam) | OptimizerConfig::AdamW(adam) => {
                        let decoupled = matches!(config, OptimizerConfig::AdamW(_));
                        stream.adam_step(&mut p, &g, &mut first, &mut second, adam, decoupled, step as u64 + 1)?;
                    }
                }
            }
            stream.download(&p)?
        }
    };
    assert_close(&format!("{config:?}"), backend, &got, &expected, EXACT)
}

fn optimizer_updates_follow_the_cpu_bit_for_bit(backend: &Backend) -> Result<()> {
    let configs: [OptimizerConfig; 5] = [
        SgdConfig::new(0.1).into(),
        SgdConfig::new(0.05).with_momentum(0.9).with_dampening(0.1).with_weight_decay(1e-2).into(),
        SgdConfig::new(0.05).with_momentum(0.9).with_nesterov(true).into(),
        OptimizerConfig::Adam(AdamConfig::adam(1e-3).with_weight_decay(1e-2)),
        OptimizerConfig::AdamW(AdamConfig::adamw(1e-3).with_betas(0.8, 0.95)),
    ];
    for config in configs {
        optimizer_case(backend, config)?;
    }
    Ok(())
}

fn cuda_buffers_count_on_the_ledger_and_copy_between_devices(backend: &Backend) -> Result<()> {
    let Backend::Cuda(stream) = backend else { bail!("a GPU-only case given the CPU") };
    let streams =
        device_cases::gpu_ordinals().unwrap_or_default().into_iter().map(cuda_stream).collect::<Result<Vec<_>>>()?;
    {
        // A budgeted handle on the same GPU: its own ledger, refusing past the budget.
        let Device::Cuda(budgeted) = Device::cuda(stream.device().ordinal(), Some(4000))? else { bail!("not a GPU") };
        let worker = budgeted.new_stream()?;
        {
            let _floats = worker.alloc_zeros::<f32>(600)?; // 2400 bytes
            let halves = worker.upload(&[f16::from_f32(1.5); 800])?; // 1600 bytes: exactly full
            ensure!(budgeted.memory().in_use() == 4000);
            match worker.alloc_zeros::<bf16>(1) {
                Err(Error::OutOfDeviceMemory { requested: 2, in_use: 4000, budget: 4000, .. }) => {}
                other => bail!("expected OutOfDeviceMemory, got {other:?}"),
            }
            ensure!(worker.download(&halves)?.iter().all(|h| h.to_f32() == 1.5));
        } // both buffers dropped: their bytes are released
        ensure!(budgeted.memory().in_use() == 0 && budgeted.memory().peak() == 4000);

        // Copies to every GPU (the same one through a second stream), counted on the target.
        let data = values(81, 3 << 20);
        let source = stream.upload(&data)?;
        for target in &streams {
            let second = target.device().new_stream()?;
            let before = target.device().memory().in_use();
            let copy = second.copy_from(&source)?;
            ensure!(target.device().memory().in_use() == before + (data.len() * 4) as u64);
            ensure!(
                second.download(&copy)? == data,
                "copy cuda:{} -> cuda:{}",
                stream.device().ordinal(),
                target.device().ordinal()
            );
        }
    }
    Ok(())
}

/// `Tensor::to_dtype` between f32 and f16/bf16 on this backend's device gives the `half` crate's
/// bits (what the CPU uses): round to nearest even at every exponent, ties, subnormals, overflow
/// to infinity, infinities, signed zeros; NaN stays NaN. Each half value converts back to f32
/// exactly, and f16 to bf16 goes through f32.
fn half_conversions_match_the_half_crate(backend: &Backend) -> Result<()> {
    let device = tensor_device(backend)?;
    let mut inputs: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        -1.5,
        65504.0,
        65519.99,
        65520.0,
        -65520.0,
        1e-8,
        5.96e-8,
        2.9802322e-8,
        2.9802326e-8,
        6.1e-5,
        6.0e-5,
        1e-45,
        f32::MIN_POSITIVE,
        f32::MAX,
        -f32::MAX,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        3.0e38,
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        1.0 + 1.0 / 4096.0,
    ];
    inputs.extend(values(97, 2000).iter().enumerate().map(|(i, v)| v * 10f32.powi((i % 17) as i32 - 8)));
    let n = inputs.len();
    let x = Tensor::from_slice(&inputs, [n], &device)?;
    let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    for dtype in [DType::F16, DType::BF16] {
        let half = x.to_dtype(dtype)?;
        ensure!(half.dtype() == dtype && half.device().same_device(&device), "{dtype:?} on {}", backend.name());
        let expected: Vec<f32> = match dtype {
            DType::F16 => inputs.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect(),
            _ => inputs.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect(),
        };
        let back = half.to_dtype(DType::F32)?.try_to_vec_f32()?;
        for ((&input, &got), &want) in inputs.iter().zip(&back).zip(&expected) {
            ensure!(same(got, want), "{dtype:?} of {input:e} on {}: {got:e}, the half crate {want:e}", backend.name());
        }
    }
    // f16 -> bf16 through f32, as on the CPU.
    let via = x.to_dtype(DType::F16)?.to_dtype(DType::BF16)?.try_to_vec_f32()?;
    for (&input, &got) in inputs.iter().zip(&via) {
        let want = half::bf16::from_f32(half::f16::from_f32(input).to_f32()).to_f32();
        ensure!(same(got, want), "f16 -> bf16 of {input:e} on {}: {got:e}, expected {want:e}", backend.name());
    }
    Ok(())
}

fn main() -> ExitCode {
    let every = |name, body| Case::every_device(name, body);
    let cases: [Case<Backend>; 11] = [
        every(
            "matmul_in_all_four_layouts_with_and_without_accumulate",
            matmul_in_all_four_layouts_with_and_without_accumulate,
        ),
        every("matmul_of_strided_blocks_and_batches", matmul_of_strided_blocks_and_batches),
        every("elementwise_ops_and_activations", elementwise_ops_and_activations),
        every("reductions_broadcast_and_sum_of_squares", reductions_broadcast_and_sum_of_squares),
        every("log_softmax_and_cross_entropy", log_softmax_and_cross_entropy),
        every("im2col_col2im_and_convolution", im2col_col2im_and_convolution),
        every("max_and_average_pooling", max_and_average_pooling),
        every("pool_dropout_and_add_tensor_ops", pool_dropout_and_add_tensor_ops),
        every("optimizer_updates_follow_the_cpu_bit_for_bit", optimizer_updates_follow_the_cpu_bit_for_bit),
        every("half_conversions_match_the_half_crate", half_conversions_match_the_half_crate),
        Case::gpus(
            "cuda_buffers_count_on_the_ledger_and_copy_between_devices",
            cuda_buffers_count_on_the_ledger_and_copy_between_devices,
        ),
    ];
    device_cases::run(&[], &cases, backends())
}
