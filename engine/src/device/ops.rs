//! Device ops: the tensor-level arithmetic the layers compute with, each op dispatched on its
//! device in one `match`: matrix products ([`Tensor::matmul`], [`Tensor::matmul_accumulate`]),
//! bias-gradient column sums ([`Tensor::accumulate_column_sums`]), elementwise activations and
//! their gradients ([`Tensor::activation`], [`Activation`]) and softmax cross-entropy
//! ([`Tensor::softmax_cross_entropy`]), and the elementwise products a custom layer composes with
//! ([`Tensor::mul`], [`Tensor::mul_rows`]). They are methods of [`Tensor`]; this module holds them and
//! the two types they take. Child modules hold the ops of one layer family each: `norm.rs` layer
//! normalisation, embedding lookups and the token reductions of the sequence layers
//! ([`Tensor::layer_norm`], [`Tensor::embedding`], [`Tensor::add_positions`],
//! [`Tensor::mean_over_tokens`] and their gradients), `squared_error.rs` the MSE loss
//! ([`Tensor::squared_error`]), `split_cross_entropy.rs` softmax cross-entropy over logits split
//! by classes ([`Tensor::logit_shard_stats`] and its two partners), `columns.rs` the column blocks of tensor-parallel layouts
//! ([`Tensor::narrow_columns`], [`Tensor::cat_columns`], [`Tensor::pack_columns`]).
//!
//! # Dispatch rule
//!
//! An op runs where its result lives: the device given for a new tensor, or the device of the
//! tensor accumulated into. On a CPU device the operands are read from host memory (f16/bf16
//! converted to f32, as the layers always did; an operand on a GPU is [`Error::NotOnHost`]) and
//! the CPU kernels of [`crate::cpu`] run exactly as the layers ran them before, so CPU results are
//! unchanged bit for bit. On a CUDA device every operand must be on that same device
//! (`DeviceMismatch` otherwise) and the op is queued on this thread's stream (cuBLAS for
//! products, the kernels of `device/kernels/*.cu` for the rest). The kernels compute in f32: an
//! f16/bf16 operand is read through an exact f32 copy made for the op (as the CPU arms read it
//! through `host_f32`), except that a product of two half operands of one type goes to cuBLAS
//! with half inputs and f32 accumulation (the tensor cores); a result is rounded to the half type
//! on the GPU wherever the CPU arm rounds it, with the CPU's bits (`Tensor::to_dtype`), and
//! accumulated-into gradients are f32. Layers therefore
//! never ask where a tensor lives; only Linear's packed-weight CPU fast path is chosen by the
//! layer, because it is a layout of the CPU GEMM.
//!
//! GPU results differ from CPU results by summation order (cuBLAS, the reductions) and by the
//! CUDA math library's transcendentals; elementwise operations without transcendentals round
//! exactly as on the CPU (the kernels are compiled with `--fmad=false`).
mod attention;
mod columns;
mod conv;
mod norm;
mod pool;
mod split_cross_entropy;
mod squared_error;

pub use attention::attention_gpu_scratch;
pub use conv::conv2d_gpu_scratch;
pub use split_cross_entropy::LOGIT_SHARD_STATS;

use crate::cpu::activation::{self, relu, relu_grad, tanh_grad};
use crate::cpu::softmax::log_softmax_rows;
use crate::cpu::{MatRef, elementwise, matmul, matmul_uninit, uninit};
use crate::device::{CudaBuffer, CudaStream, DeviceMatRef, GemmElement};
use crate::tensor::{CudaF32, F32Mut};
use crate::{DType, Device, Error, Result, Shape, Tensor};

/// An elementwise activation with a kernel on every device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `max(x, 0)`; its gradient reads the forward output (or input: the sign is the same).
    Relu,
    /// The exact GELU `x · Φ(x)`; its gradient reads the forward input.
    Gelu,
    /// PyTorch's `GELU(approximate='tanh')`, `x/2 · (1 + tanh(√(2/π)(x + 0.044715x³)))`; its
    /// gradient reads the forward input.
    GeluTanh,
    /// `tanh(x)`; its gradient reads the forward output.
    Tanh,
}

/// A tensor read as a row-major matrix, or as the transpose of one (no copy), for
/// [`Tensor::matmul`] and [`Tensor::matmul_accumulate`].
#[derive(Clone, Copy, Debug)]
pub struct Matrix<'a> {
    tensor: &'a Tensor,
    /// Rows and columns as stored (row-major), before `transposed`.
    stored_rows: usize,
    stored_cols: usize,
    transposed: bool,
}

impl<'a> Matrix<'a> {
    /// `tensor`'s elements as a row-major `rows x cols` matrix (`rows · cols` must be its element
    /// count).
    pub fn new(tensor: &'a Tensor, rows: usize, cols: usize) -> Result<Matrix<'a>> {
        if rows.checked_mul(cols) != Some(tensor.numel()) {
            return Err(Error::shape(
                "Matrix::new",
                format!("{rows}x{cols} = {} elements", rows.saturating_mul(cols)),
                format!("a tensor of shape {} ({} elements)", tensor.shape(), tensor.numel()),
            ));
        }
        Ok(Matrix { tensor, stored_rows: rows, stored_cols: cols, transposed: false })
    }

    /// The transposed matrix (no copy).
    pub fn t(self) -> Matrix<'a> {
        Matrix { transposed: !self.transposed, ..self }
    }

    /// Rows of the matrix as read (after any transposition).
    pub fn rows(&self) -> usize {
        if self.transposed { self.stored_cols } else { self.stored_rows }
    }

    /// Columns of the matrix as read (after any transposition).
    pub fn cols(&self) -> usize {
        if self.transposed { self.stored_rows } else { self.stored_cols }
    }

    /// The CPU view over `values` (this matrix's elements in host memory).
    fn host<'v>(&self, values: &'v [f32]) -> Result<MatRef<'v>> {
        let view = MatRef::row_major(values, self.stored_rows, self.stored_cols)?;
        Ok(if self.transposed { view.t() } else { view })
    }

    /// The cuBLAS view over `buffer` (this matrix's elements on a GPU).
    fn gpu<'b, T: GemmElement>(&self, buffer: &'b CudaBuffer<T>) -> Result<DeviceMatRef<'b, T>> {
        let view = DeviceMatRef::row_major(buffer, self.stored_rows, self.stored_cols)?;
        Ok(if self.transposed { view.t() } else { view })
    }
}

/// `tensor`'s elements as an f32 operand on `device` (a GPU): its own buffer, or an exact f32
/// copy of an f16/bf16 tensor for this op ([`CudaF32`]).
fn gpu_f32<'a>(op: &str, tensor: &'a Tensor, device: &Device) -> Result<CudaF32<'a>> {
    let mismatch =
        || Error::DeviceMismatch { op: op.to_string(), lhs: device.to_string(), rhs: tensor.device().to_string() };
    if !tensor.device().same_device(device) {
        return Err(mismatch());
    }
    tensor.cuda_f32_operand()?.ok_or_else(mismatch)
}

/// When `lhs` and `rhs` are both f16 or both bf16 on the GPU `device`: `dst (+)= lhs · rhs`
/// straight from their buffers, cuBLAS multiplying the half operands with f32 accumulation (the
/// tensor cores; the same products as the f32 path on their exact f32 values, summed in another
/// order), and `true`. `false`, with nothing done, for other dtypes (the f32 path).
fn half_product_on_gpu(
    op: &str,
    stream: &CudaStream,
    dst: &mut CudaBuffer<f32>,
    lhs: &Matrix<'_>,
    rhs: &Matrix<'_>,
    accumulate: bool,
    device: &Device,
) -> Result<bool> {
    match (lhs.tensor.dtype(), rhs.tensor.dtype()) {
        (DType::F16, DType::F16) => {
            let (a, b) = (gpu_f16(op, lhs.tensor, device)?, gpu_f16(op, rhs.tensor, device)?);
            stream.matmul(dst, lhs.gpu(a)?, rhs.gpu(b)?, accumulate)?;
            Ok(true)
        }
        (DType::BF16, DType::BF16) => {
            let (a, b) = (gpu_bf16(op, lhs.tensor, device)?, gpu_bf16(op, rhs.tensor, device)?);
            stream.matmul(dst, lhs.gpu(a)?, rhs.gpu(b)?, accumulate)?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// `tensor`'s f16 buffer on the GPU `device` (`DeviceMismatch` elsewhere, `UnsupportedDType` for
/// another dtype).
fn gpu_f16<'a>(op: &str, tensor: &'a Tensor, device: &Device) -> Result<&'a CudaBuffer<half::f16>> {
    on_gpu(op, tensor, device, Tensor::cuda_f16)
}

/// `tensor`'s bf16 buffer on the GPU `device`, as [`gpu_f16`].
fn gpu_bf16<'a>(op: &str, tensor: &'a Tensor, device: &Device) -> Result<&'a CudaBuffer<half::bf16>> {
    on_gpu(op, tensor, device, Tensor::cuda_bf16)
}

/// `buffer(tensor)` when `tensor` lives on the GPU `device`, else `DeviceMismatch`.
fn on_gpu<'a, T>(
    op: &str,
    tensor: &'a Tensor,
    device: &Device,
    buffer: impl FnOnce(&'a Tensor, &str) -> Result<Option<&'a CudaBuffer<T>>>,
) -> Result<&'a CudaBuffer<T>> {
    let mismatch =
        || Error::DeviceMismatch { op: op.to_string(), lhs: device.to_string(), rhs: tensor.device().to_string() };
    if !tensor.device().same_device(device) {
        return Err(mismatch());
    }
    buffer(tensor, op)?.ok_or_else(mismatch)
}

/// Runs `add` on `dst`'s elements as f32 in host memory: in place for f32, through an f32 copy
/// converted back afterwards for f16/bf16 (the layers' gradient accumulation).
fn accumulate_on_host(dst: &mut Tensor, add: impl FnOnce(&mut [f32]) -> Result<()>) -> Result<()> {
    if dst.dtype() == DType::F32 {
        return add(dst.as_f32_mut()?);
    }
    let mut acc = dst.to_vec_f32();
    add(&mut acc)?;
    *dst = Tensor::from_f32_values(acc, dst.dtype(), dst.shape().clone(), dst.device())?;
    Ok(())
}

/// `grad += part` where `add` computes `part` into zeros: each step's gradient is summed apart and
/// then added, so a gradient gets the same bits whether its micro-batches run on one device one
/// after another or on two data-parallel replicas whose sums the all-reduce adds (`a + b` either
/// way), as the layers' `accumulate_into`. f16/bf16 gradients are added through an f32 copy.
fn accumulate_part(grad: &mut Tensor, add: impl FnOnce(&mut [f32]) -> Result<()>) -> Result<()> {
    let mut part = Tensor::zeros(grad.shape().clone(), DType::F32, grad.device())?;
    add(part.as_f32_mut()?)?;
    if grad.dtype() == DType::F32 {
        return grad.add_assign(&part);
    }
    let mut acc = grad.to_vec_f32();
    acc.iter_mut().zip(part.as_f32()?).for_each(|(a, &p)| *a += p);
    *grad = Tensor::from_f32_values(acc, grad.dtype(), grad.shape().clone(), grad.device())?;
    Ok(())
}

/// `len` f32 ones on `device`: the operand of the rank-1 products that spread a bias over rows or
/// planes, or sum rows, on a GPU (conv, attention).
fn ones(device: &Device, len: usize) -> Result<Tensor> {
    Tensor::full(1.0, [len], DType::F32, device)
}

/// `dst`'s f32 buffer on its GPU, writable (copied first when shared).
fn gpu_f32_mut<'a>(op: &str, dst: &'a mut Tensor) -> Result<&'a mut CudaBuffer<f32>> {
    let device = dst.device().to_string();
    match dst.f32_mut(op)? {
        F32Mut::Cuda(buffer) => Ok(buffer),
        F32Mut::Host(_) => Err(Error::DeviceMismatch { op: op.to_string(), lhs: device.clone(), rhs: device }),
    }
}

/// Checks that `lhs · rhs` is defined and gives `numel` elements.
fn check_product(op: &str, lhs: &Matrix<'_>, rhs: &Matrix<'_>, numel: usize) -> Result<()> {
    if lhs.cols() != rhs.rows() {
        return Err(Error::shape(
            op,
            format!("a right operand with {} rows", lhs.cols()),
            format!("{}x{}", rhs.rows(), rhs.cols()),
        ));
    }
    if lhs.rows() * rhs.cols() != numel {
        return Err(Error::shape(
            op,
            format!("a result of {}x{} elements", lhs.rows(), rhs.cols()),
            format!("{numel} elements"),
        ));
    }
    Ok(())
}

impl Tensor {
    /// `lhs · rhs`, plus `bias` (one element per column) in every row when given: a new f32
    /// tensor of `shape` (of `lhs.rows() · rhs.cols()` elements) on `device`. On a CPU device
    /// operands of any dtype are read as f32; on a GPU two f16 (or two bf16) operands multiply on
    /// cuBLAS's half path with f32 accumulation, other dtypes through f32 copies.
    ///
    /// ```
    /// use conveyor_engine::device::ops::Matrix;
    /// use conveyor_engine::{Device, Tensor};
    /// let host = Device::host();
    /// let x = Tensor::from_slice(&[1.0, 2.0, 3.0, 4.0], [2, 2], &host)?;
    /// let w = Tensor::from_slice(&[1.0, 0.0, 0.0, 2.0], [2, 2], &host)?;
    /// let b = Tensor::from_slice(&[0.5, -0.5], [2], &host)?;
    /// let y = Tensor::matmul(Matrix::new(&x, 2, 2)?, Matrix::new(&w, 2, 2)?.t(), Some(&b), [2, 2], &host)?;
    /// assert_eq!(y.as_f32()?, &[1.5, 3.5, 3.5, 7.5]);
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn matmul(
        lhs: Matrix<'_>,
        rhs: Matrix<'_>,
        bias: Option<&Tensor>,
        shape: impl Into<Shape>,
        device: &Device,
    ) -> Result<Tensor> {
        let op = "matmul";
        let shape = shape.into();
        check_product(op, &lhs, &rhs, shape.numel())?;
        if let Some(bias) = bias
            && bias.numel() != rhs.cols()
        {
            return Err(Error::shape(op, format!("a bias of {} elements", rhs.cols()), bias.shape().to_string()));
        }
        match device {
            Device::Cpu(_) => {
                let (lhs_values, rhs_values) = (lhs.tensor.host_f32(op)?, rhs.tensor.host_f32(op)?);
                let bias = bias.map(|bias| bias.host_f32(op)).transpose()?;
                let (lhs, rhs) = (lhs.host(&lhs_values)?, rhs.host(&rhs_values)?);
                // Every element is written: the bias pre-fill (which the product then accumulates
                // onto, so there is no second pass) or the product alone. No zero-fill first.
                Tensor::from_f32_init(shape, device, |dst| match &bias {
                    Some(bias) => {
                        let dst = uninit::broadcast_rows(bias, dst)?;
                        matmul(dst, lhs, rhs, true)?;
                        Ok(dst)
                    }
                    None => matmul_uninit(dst, lhs, rhs),
                })
            }
            Device::Cuda(cuda) => {
                let stream = cuda.thread_stream()?;
                let mut out = cuda.alloc_zeros::<f32>(shape.numel())?;
                let accumulate = match bias {
                    Some(bias) => {
                        stream.broadcast_rows(&*gpu_f32(op, bias, device)?, &mut out)?;
                        true
                    }
                    None => false,
                };
                if !half_product_on_gpu(op, &stream, &mut out, &lhs, &rhs, accumulate, device)? {
                    let (lhs_buffer, rhs_buffer) = (gpu_f32(op, lhs.tensor, device)?, gpu_f32(op, rhs.tensor, device)?);
                    stream.matmul(&mut out, lhs.gpu(&lhs_buffer)?, rhs.gpu(&rhs_buffer)?, accumulate)?;
                }
                Tensor::from_cuda_f32(out, shape, device)
            }
        }
    }

    /// `self += lhs · rhs` (`self` holds `lhs.rows() · rhs.cols()` elements), on `self`'s device:
    /// a weight gradient. On a CPU device an f16/bf16 `self` accumulates through an f32 copy; on a
    /// GPU `self` must be f32 (operands as in [`Tensor::matmul`]).
    pub fn matmul_accumulate(&mut self, lhs: Matrix<'_>, rhs: Matrix<'_>) -> Result<()> {
        let op = "matmul_accumulate";
        check_product(op, &lhs, &rhs, self.numel())?;
        if let Device::Cpu(_) = self.device() {
            let (lhs_values, rhs_values) = (lhs.tensor.host_f32(op)?, rhs.tensor.host_f32(op)?);
            let (lhs, rhs) = (lhs.host(&lhs_values)?, rhs.host(&rhs_values)?);
            return accumulate_on_host(self, |dst| matmul(dst, lhs, rhs, true));
        }
        let device = self.device().clone();
        let dst = gpu_f32_mut(op, self)?;
        let stream = dst.device().thread_stream()?;
        if half_product_on_gpu(op, &stream, dst, &lhs, &rhs, true, &device)? {
            return Ok(());
        }
        let (lhs_buffer, rhs_buffer) = (gpu_f32(op, lhs.tensor, &device)?, gpu_f32(op, rhs.tensor, &device)?);
        stream.matmul(dst, lhs.gpu(&lhs_buffer)?, rhs.gpu(&rhs_buffer)?, true)
    }

    /// `self[j] += Σ_r matrix[r, j]` for a row-major `matrix` with `self.numel()` columns (a
    /// Linear bias gradient), on `self`'s device.
    pub fn accumulate_column_sums(&mut self, matrix: &Tensor) -> Result<()> {
        let op = "accumulate_column_sums";
        if let Device::Cpu(_) = self.device() {
            let values = matrix.host_f32(op)?;
            return accumulate_on_host(self, |dst| elementwise::accumulate_column_sums(&values, dst));
        }
        let matrix = gpu_f32(op, matrix, self.device())?;
        let dst = gpu_f32_mut(op, self)?;
        let stream = dst.device().thread_stream()?;
        stream.accumulate_column_sums(&matrix, dst)
    }

    /// `activation` of every element: a new tensor of this shape and dtype on this device (on a
    /// every device computed in f32 and rounded back to the dtype).
    pub fn activation(&self, activation: Activation) -> Result<Tensor> {
        let op = "activation";
        match self.device() {
            Device::Cpu(_) => {
                let x = self.host_f32(op)?;
                // The vectorised kernels of `cpu::activation` (ReLU a loop the compiler vectorises).
                let output = Tensor::from_f32_init(self.shape().clone(), self.device(), |dst| match activation {
                    Activation::Relu => uninit::map(dst, &x, relu),
                    Activation::Gelu => activation::gelu_forward_uninit(&x, dst),
                    Activation::GeluTanh => activation::gelu_tanh_forward_uninit(&x, dst),
                    Activation::Tanh => activation::tanh_forward_uninit(&x, dst),
                })?;
                output.into_dtype(self.dtype())
            }
            Device::Cuda(cuda) => {
                let x = gpu_f32(op, self, self.device())?;
                let stream = cuda.thread_stream()?;
                let mut out = cuda.alloc_zeros::<f32>(x.len())?;
                match activation {
                    Activation::Relu => stream.relu_forward(&x, &mut out)?,
                    Activation::Gelu => stream.gelu_forward(&x, &mut out)?,
                    Activation::GeluTanh => stream.gelu_tanh_forward(&x, &mut out)?,
                    Activation::Tanh => stream.tanh_forward(&x, &mut out)?,
                }
                Tensor::from_cuda_f32(out, self.shape().clone(), self.device())?.into_dtype(self.dtype())
            }
        }
    }

    /// The input gradient of `activation` from what its forward kept (`kept`: the output for ReLU
    /// and tanh, the input for both GELUs) and the output gradient: a new tensor of `kept`'s shape and
    /// dtype on `grad_output`'s device.
    pub fn activation_grad(activation: Activation, kept: &Tensor, grad_output: &Tensor) -> Result<Tensor> {
        let op = "activation_grad";
        let device = grad_output.device();
        match device {
            Device::Cpu(_) => {
                let (kept_values, grad) = (kept.host_f32(op)?, grad_output.host_f32(op)?);
                let grad_input = Tensor::from_f32_init(kept.shape().clone(), device, |dst| match activation {
                    Activation::Relu => uninit::map2(dst, &kept_values, &grad, relu_grad),
                    Activation::Gelu => activation::gelu_backward_uninit(&kept_values, &grad, dst),
                    Activation::GeluTanh => activation::gelu_tanh_backward_uninit(&kept_values, &grad, dst),
                    Activation::Tanh => uninit::map2(dst, &kept_values, &grad, tanh_grad),
                })?;
                grad_input.into_dtype(kept.dtype())
            }
            Device::Cuda(cuda) => {
                let (kept_buffer, grad) = (gpu_f32(op, kept, device)?, gpu_f32(op, grad_output, device)?);
                let stream = cuda.thread_stream()?;
                let mut out = cuda.alloc_zeros::<f32>(kept_buffer.len())?;
                match activation {
                    Activation::Relu => stream.relu_backward(&kept_buffer, &grad, &mut out)?,
                    Activation::Gelu => stream.gelu_backward(&kept_buffer, &grad, &mut out)?,
                    Activation::GeluTanh => stream.gelu_tanh_backward(&kept_buffer, &grad, &mut out)?,
                    Activation::Tanh => stream.tanh_backward(&kept_buffer, &grad, &mut out)?,
                }
                Tensor::from_cuda_f32(out, kept.shape().clone(), device)?.into_dtype(kept.dtype())
            }
        }
    }

    /// Softmax cross-entropy of these logits (`[N, C]` or `[N, ..., C]`, one label per row of
    /// `C`) against `labels`: `Σ_rows (logsumexp(z_r) - z_r[y_r]) / normalizer` (accumulated in
    /// f64) and its gradient `(softmax(z_r) - onehot(y_r)) / normalizer`, in the logits' dtype on
    /// their device (on a GPU: f32 logits only, and the per-row losses are downloaded).
    pub fn softmax_cross_entropy(&self, labels: &[usize], normalizer: f32) -> Result<(f64, Tensor)> {
        let op = "softmax_cross_entropy";
        let n_classes = match self.dims() {
            [_, .., n_classes] if *n_classes > 0 => *n_classes,
            _ => {
                return Err(Error::shape(
                    op,
                    "logits [batch, ..., n_classes] with n_classes > 0",
                    self.shape().to_string(),
                ));
            }
        };
        let rows = self.numel() / n_classes;
        if labels.len() != rows {
            return Err(Error::shape(op, format!("{rows} labels"), format!("{} labels", labels.len())));
        }
        if let Some(&label) = labels.iter().find(|&&label| label >= n_classes) {
            return Err(Error::invalid(op, format!("label {label} is out of range for {n_classes} classes")));
        }
        match self.device() {
            Device::Cpu(_) => {
                let mut grad = Tensor::zeros(self.shape().clone(), DType::F32, self.device())?;
                let grad_values = grad.as_f32_mut()?;
                log_softmax_rows(&self.host_f32(op)?, n_classes, grad_values)?;
                let inv_normalizer = 1.0 / normalizer;
                let mut loss_sum = 0.0f64;
                for (row, &label) in grad_values.chunks_exact_mut(n_classes).zip(labels) {
                    loss_sum -= row[label] as f64;
                    // Turn log-probabilities into the gradient in place: (p - onehot) / normalizer.
                    for value in row.iter_mut() {
                        *value = value.exp() * inv_normalizer;
                    }
                    row[label] -= inv_normalizer;
                }
                Ok((loss_sum / normalizer as f64, grad.into_dtype(self.dtype())?))
            }
            Device::Cuda(cuda) => {
                let logits = gpu_f32(op, self, self.device())?;
                let stream = cuda.thread_stream()?;
                let labels: Vec<i64> = labels.iter().map(|&label| label as i64).collect();
                let labels = cuda.upload(&labels)?;
                let mut loss = cuda.alloc_zeros::<f32>(rows)?;
                let mut grad = cuda.alloc_zeros::<f32>(self.numel())?;
                stream.cross_entropy(&logits, &labels, n_classes, normalizer, &mut loss, &mut grad)?;
                let loss_sum = stream.download(&loss)?.iter().map(|&loss| f64::from(loss)).sum();
                Ok((
                    loss_sum,
                    Tensor::from_cuda_f32(grad, self.shape().clone(), self.device())?.into_dtype(self.dtype())?,
                ))
            }
        }
    }

    /// `self * other` elementwise (equal shapes): a new tensor on `self`'s device (on a CPU device
    /// computed in f32 and rounded back to `self`'s dtype, on every device).
    ///
    /// ```
    /// use conveyor_engine::{Device, Tensor};
    ///
    /// let host = Device::host();
    /// let a = Tensor::from_vec(vec![1.0, 2.0, 3.0], [3], &host)?;
    /// let b = Tensor::from_vec(vec![4.0, 5.0, 6.0], [3], &host)?;
    /// assert_eq!(a.mul(&b)?.to_vec_f32(), [4.0, 10.0, 18.0]);
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        let op = "mul";
        if self.shape() != other.shape() {
            return Err(Error::shape(op, self.shape().to_string(), other.shape().to_string()));
        }
        match self.device() {
            Device::Cpu(_) => {
                let (lhs, rhs) = (self.host_f32(op)?, other.host_f32(op)?);
                let product = Tensor::from_f32_init(self.shape().clone(), self.device(), |dst| {
                    uninit::map2(dst, &lhs, &rhs, |a, b| a * b)
                })?;
                product.into_dtype(self.dtype())
            }
            Device::Cuda(cuda) => {
                let (lhs, rhs) = (gpu_f32(op, self, self.device())?, gpu_f32(op, other, self.device())?);
                let stream = cuda.thread_stream()?;
                let mut out = cuda.alloc_zeros::<f32>(lhs.len())?;
                stream.mul(&lhs, &rhs, &mut out)?;
                Tensor::from_cuda_f32(out, self.shape().clone(), self.device())?.into_dtype(self.dtype())
            }
        }
    }

    /// Every row of `self` (its last dimension) multiplied elementwise by `row` (a vector of that
    /// length), as PyTorch broadcasts `x * gamma`: a new tensor on `self`'s device.
    ///
    /// ```
    /// use conveyor_engine::{Device, Tensor};
    ///
    /// let host = Device::host();
    /// let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0], [2, 2], &host)?;
    /// let gamma = Tensor::from_vec(vec![10.0, 0.5], [2], &host)?;
    /// assert_eq!(x.mul_rows(&gamma)?.to_vec_f32(), [10.0, 1.0, 30.0, 2.0]);
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn mul_rows(&self, row: &Tensor) -> Result<Tensor> {
        let op = "mul_rows";
        let cols = row.numel();
        if row.dims().len() != 1 || self.dims().last() != Some(&cols) {
            return Err(Error::shape(
                op,
                format!("a vector as long as the last dimension of {}", self.shape()),
                row.shape().to_string(),
            ));
        }
        match self.device() {
            Device::Cpu(_) => {
                if cols == 0 {
                    return Tensor::zeros(self.shape().clone(), self.dtype(), self.device());
                }
                let (x, row) = (self.host_f32(op)?, row.host_f32(op)?);
                let values: Vec<f32> =
                    x.chunks_exact(cols).flat_map(|x| x.iter().zip(row.iter()).map(|(a, b)| a * b)).collect();
                let product = Tensor::from_vec(values, self.shape().clone(), self.device())?;
                product.into_dtype(self.dtype())
            }
            Device::Cuda(cuda) => {
                let (x, row) = (gpu_f32(op, self, self.device())?, gpu_f32(op, row, self.device())?);
                let stream = cuda.thread_stream()?;
                let mut rows = cuda.alloc_zeros::<f32>(x.len())?;
                stream.broadcast_rows(&row, &mut rows)?;
                let mut out = cuda.alloc_zeros::<f32>(x.len())?;
                stream.mul(&x, &rows, &mut out)?;
                Tensor::from_cuda_f32(out, self.shape().clone(), self.device())?.into_dtype(self.dtype())
            }
        }
    }
}
