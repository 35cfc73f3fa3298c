//! Convolution as device ops: [`Tensor::conv2d`] (forward), [`Tensor::conv2d_input_grad`] and
//! [`Tensor::conv2d_weight_grad_accumulate`], dispatched as every op in [`super`]: the CPU kernels
//! the `Conv2d` layer ran before (unchanged, bit for bit) on a CPU device, a batched im2col and
//! cuBLAS strided-batched products (col2im for the input gradient) on a GPU.
//!
//! The layer validates shapes against its configuration; these ops check what they rely on
//! (element counts against the window and channel counts) and return `Error::Shape` otherwise.
//! Every result is f32 (the layer converts it to its input's dtype); on a GPU every operand must
//! be an f32 tensor on that GPU.
use super::{accumulate_part, gpu_f32, gpu_f32_mut, ones};
use crate::cpu::conv::{Im2col, col2im, flip_kernels};
use crate::cpu::conv_lanes::{conv2d_lanes, conv2d_lanes_fits};
use crate::cpu::conv_weight::{conv2d_bias_grad, conv2d_weight_grad};
use crate::cpu::{MatRef, Window2d, matmul, matmul_uninit, uninit};
use crate::device::{CudaBuffer, DeviceMatRef};
use crate::{CallScratch, DType, Device, Error, Result, Shape, Tensor};

/// Per sample, the scratch the GPU arms of [`Tensor::conv2d`] and its two gradients reserve on
/// the device's ledger while they run (f32): the batched im2col columns (none for a pointwise
/// window) in every call, the bias spread's ones-vector in the forward (per micro-batch, counted
/// per sample: a bound), and in the weight pass the per-sample partial gradients and, with a bias,
/// the per-plane sums. The CPU arms keep their scratch off the ledger. Layers put this in
/// [`crate::LayerCost::gpu_scratch_bytes_per_sample`].
pub fn conv2d_gpu_scratch(window: &Window2d, out_channels: usize, bias: bool) -> CallScratch {
    let f32_bytes = DType::F32.size_in_bytes() as u64;
    let cols = if window.is_pointwise() { 0 } else { (window.col_rows() * window.out_plane_len()) as u64 };
    let ones = if bias { window.out_plane_len() as u64 } else { 0 };
    let partial = (out_channels * window.col_rows()) as u64;
    let plane_sums = if bias { out_channels as u64 } else { 0 };
    CallScratch {
        forward: (cols + ones) * f32_bytes,
        backward_input: cols * f32_bytes,
        backward_weight: (cols + partial + plane_sums) * f32_bytes,
    }
}

/// The batch of `input` (whole samples of `window.input_len()` elements) and a check that
/// `weight` holds `out_channels x window.col_rows()` elements.
fn conv_batch(op: &str, input: &Tensor, weight: &Tensor, window: &Window2d, out_channels: usize) -> Result<usize> {
    let sample = window.input_len();
    if sample == 0 || !input.numel().is_multiple_of(sample) {
        return Err(Error::shape(op, format!("whole samples of {sample} elements"), input.shape().to_string()));
    }
    if weight.numel() != out_channels * window.col_rows() {
        return Err(Error::shape(
            op,
            format!("a weight of {out_channels} x {} elements", window.col_rows()),
            weight.shape().to_string(),
        ));
    }
    Ok(input.numel() / sample)
}

impl Tensor {
    /// The convolution of `self` (`[batch, window.channels, H, W]`) with `weight`
    /// (`[out_channels, window.channels, kh, kw]`) plus the per-channel `bias`: a new f32 tensor
    /// `[batch, out_channels, H_out, W_out]` on `self`'s device.
    ///
    /// On a CPU device: where the output plane is a multiple of 16 pixels one lane kernel over
    /// the batch, otherwise im2col and one product per sample onto the bias pre-fill (the
    /// `Conv2d` layer's kernels). On a GPU: one batched im2col (none for a 1x1 stride-1 window)
    /// and one strided-batched product onto the bias spread by a rank-1 product.
    pub fn conv2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        window: &Window2d,
        out_channels: usize,
    ) -> Result<Tensor> {
        let op = "conv2d";
        let batch = conv_batch(op, self, weight, window, out_channels)?;
        if let Some(bias) = bias
            && bias.numel() != out_channels
        {
            return Err(Error::shape(op, format!("a bias of {out_channels} elements"), bias.shape().to_string()));
        }
        let (col_rows, out_plane) = (window.col_rows(), window.out_plane_len());
        let shape = Shape::new([batch, out_channels, window.out_height(), window.out_width()]);
        match self.device() {
            Device::Cpu(_) => {
                let (x, weight) = (self.host_f32(op)?, weight.host_f32(op)?);
                let bias = bias.map(|bias| bias.host_f32(op)).transpose()?;
                if conv2d_lanes_fits(window) {
                    // Output planes of a multiple of 16 pixels: one dispatched kernel over the batch.
                    return Tensor::from_f32_init(shape, self.device(), |dst| {
                        conv2d_lanes(&x, &weight, bias.as_deref(), window, out_channels, dst)
                    });
                }
                let weight_view = MatRef::row_major(&weight, out_channels, col_rows)?;
                let mut col = if window.is_pointwise() { Vec::new() } else { vec![0.0; col_rows * out_plane] };
                let mut scratch = Im2col::new(window);
                let mut x_samples = x.chunks_exact(window.input_len());
                // Each sample's output is written in full: the per-channel bias pre-fill that the
                // product accumulates onto, or the product alone. No zero-fill first.
                Tensor::from_f32_init(shape, self.device(), |dst| {
                    uninit::chunks(dst, out_channels * out_plane, |_, y_sample| {
                        let x_sample =
                            x_samples.next().ok_or_else(|| Error::invalid(op, "fewer input samples than outputs"))?;
                        let col_view = if window.is_pointwise() {
                            MatRef::row_major(x_sample, col_rows, out_plane)?
                        } else {
                            scratch.run(x_sample, &mut col)?;
                            MatRef::row_major(&col, col_rows, out_plane)?
                        };
                        match &bias {
                            Some(bias) => {
                                let y_sample = uninit::fill_planes(bias, out_plane, y_sample)?;
                                matmul(y_sample, weight_view, col_view, true)?;
                                Ok(y_sample)
                            }
                            None => matmul_uninit(y_sample, weight_view, col_view),
                        }
                    })
                })
            }
            Device::Cuda(cuda) => {
                let device = self.device();
                let (x, w) = (gpu_f32(op, self, device)?, gpu_f32(op, weight, device)?);
                let stream = cuda.thread_stream()?;
                let mut out = cuda.alloc_zeros::<f32>(shape.numel())?;
                let accumulate = match bias {
                    Some(bias) => {
                        let ones = ones(device, out_plane)?;
                        let (bias, ones_buffer) = (gpu_f32(op, bias, device)?, gpu_f32(op, &ones, device)?);
                        stream.matmul_batched(
                            &mut out,
                            DeviceMatRef::row_major(&bias, out_channels, 1)?,
                            DeviceMatRef::row_major(&ones_buffer, 1, out_plane)?,
                            batch,
                            false,
                        )?;
                        true
                    }
                    None => false,
                };
                let cols = gpu_cols(&x, batch, window, cuda)?;
                let cols_view = DeviceMatRef::row_major(cols.as_ref().unwrap_or(&x), col_rows, out_plane)?
                    .with_batch_stride(col_rows * out_plane);
                stream.matmul_batched(
                    &mut out,
                    DeviceMatRef::row_major(&w, out_channels, col_rows)?,
                    cols_view,
                    batch,
                    accumulate,
                )?;
                Tensor::from_cuda_f32(out, shape, device)
            }
        }
    }

    /// The gradient of [`Tensor::conv2d`] with respect to its input, from `self` (the output
    /// gradient `[batch, out_channels, H_out, W_out]`) and `weight`: a new f32 tensor of
    /// `input_shape` on `self`'s device.
    ///
    /// On a CPU device the `Conv2d` layer's kernels: for stride 1 with `in >= out / 2` the gather
    /// form (the flipped kernels convolved with the output gradient, writing every element), a
    /// direct product for 1x1 windows, otherwise a product and `col2im` per sample. On a GPU one
    /// strided-batched product `weightᵀ · dy` and one batched (gathering, deterministic) col2im.
    pub fn conv2d_input_grad(
        &self,
        weight: &Tensor,
        window: &Window2d,
        out_channels: usize,
        input_shape: &Shape,
    ) -> Result<Tensor> {
        let op = "conv2d_input_grad";
        let in_channels = window.channels;
        let (col_rows, out_plane) = (window.col_rows(), window.out_plane_len());
        if weight.numel() != out_channels * col_rows {
            return Err(Error::shape(
                op,
                format!("a weight of {out_channels} x {col_rows} elements"),
                weight.shape().to_string(),
            ));
        }
        let sample = window.input_len();
        if sample == 0 || !input_shape.numel().is_multiple_of(sample) {
            return Err(Error::shape(op, format!("whole samples of {sample} elements"), input_shape.to_string()));
        }
        let batch = input_shape.numel() / sample;
        if self.numel() != batch * out_channels * out_plane {
            return Err(Error::shape(
                op,
                format!("{batch} x {out_channels} x {out_plane} output-gradient elements"),
                self.shape().to_string(),
            ));
        }
        match self.device() {
            Device::Cpu(_) => {
                let (grad, weight) = (self.host_f32(op)?, weight.host_f32(op)?);
                let weight_t = MatRef::row_major(&weight, out_channels, col_rows)?.t();
                let sample_grads = grad.chunks_exact(out_channels * out_plane);
                // The gather form copies out·kh·kw rows per sample where col2im adds in·kh·kw
                // rows, and its product has `in` rows (a one-row product is slow): take it when
                // `in >= out / 2`.
                if let Some(gather) = window.input_grad_window(out_channels)
                    && !window.is_pointwise()
                    && 2 * in_channels >= out_channels
                {
                    // Gather form (stride 1): dx = flipped kernels [in, out·kh·kw] · im2col(dy),
                    // which writes every element of each sample: no zero-fill, no scatter.
                    let mut flipped = vec![0.0; weight.len()];
                    flip_kernels(&weight, out_channels, window, &mut flipped)?;
                    if conv2d_lanes_fits(&gather) {
                        return Tensor::from_f32_init(input_shape.clone(), self.device(), |dst| {
                            conv2d_lanes(&grad, &flipped, None, &gather, in_channels, dst)
                        });
                    }
                    let flipped_view = MatRef::row_major(&flipped, in_channels, gather.col_rows())?;
                    let mut scratch = Im2col::new(&gather);
                    let mut col = vec![0.0; gather.col_rows() * gather.out_plane_len()];
                    let mut dy_samples = sample_grads;
                    return Tensor::from_f32_init(input_shape.clone(), self.device(), |dst| {
                        uninit::chunks(dst, sample, |_, dx_sample| {
                            let dy_sample = dy_samples
                                .next()
                                .ok_or_else(|| Error::invalid(op, "fewer output gradients than inputs"))?;
                            scratch.run(dy_sample, &mut col)?;
                            matmul_uninit(
                                dx_sample,
                                flipped_view,
                                MatRef::row_major(&col, gather.col_rows(), gather.out_plane_len())?,
                            )
                        })
                    });
                }
                if window.is_pointwise() {
                    // dx = weightᵀ · dy writes every element of each sample: no zero-fill.
                    let mut dy_samples = sample_grads;
                    return Tensor::from_f32_init(input_shape.clone(), self.device(), |dst| {
                        uninit::chunks(dst, sample, |_, dx_sample| {
                            let dy_sample = dy_samples
                                .next()
                                .ok_or_else(|| Error::invalid(op, "fewer output gradients than inputs"))?;
                            matmul_uninit(dx_sample, weight_t, MatRef::row_major(dy_sample, out_channels, out_plane)?)
                        })
                    });
                }
                // Strides above 1: dcol [in·kh·kw, out_plane] = weightᵀ · dy, then scatter-add
                // onto the (zeroed) input positions.
                let mut grad_input = Tensor::zeros(input_shape.clone(), DType::F32, self.device())?;
                let mut col = vec![0.0; col_rows * out_plane];
                let dx_samples = grad_input.as_f32_mut()?.chunks_exact_mut(sample);
                for (dy_sample, dx_sample) in sample_grads.zip(dx_samples) {
                    matmul(&mut col, weight_t, MatRef::row_major(dy_sample, out_channels, out_plane)?, false)?;
                    col2im(&col, window, dx_sample)?;
                }
                Ok(grad_input)
            }
            Device::Cuda(cuda) => {
                let device = self.device();
                let (dy, w) = (gpu_f32(op, self, device)?, gpu_f32(op, weight, device)?);
                let stream = cuda.thread_stream()?;
                let weight_t = DeviceMatRef::row_major(&w, out_channels, col_rows)?.t();
                let dy_view =
                    DeviceMatRef::row_major(&dy, out_channels, out_plane)?.with_batch_stride(out_channels * out_plane);
                let mut dx = cuda.alloc_zeros::<f32>(input_shape.numel())?;
                if window.is_pointwise() {
                    stream.matmul_batched(&mut dx, weight_t, dy_view, batch, false)?;
                } else {
                    let mut cols = cuda.alloc_zeros::<f32>(batch * col_rows * out_plane)?;
                    stream.matmul_batched(&mut cols, weight_t, dy_view, batch, false)?;
                    stream.col2im(&cols, batch, window, &mut dx)?;
                }
                Tensor::from_cuda_f32(dx, input_shape.clone(), device)
            }
        }
    }

    /// Accumulates the gradients of [`Tensor::conv2d`] with respect to its weight and bias:
    /// `weight_grad [out, in·kh·kw] += Σ_samples dy · im2col(x)ᵀ` and `bias_grad[o] += Σ dy[·, o, ·]`,
    /// from `input` (the forward input `x`) and `self` (the output gradient), on the gradients'
    /// device.
    ///
    /// On a CPU device the small-output weight kernel over the whole batch and the bias
    /// gradient's lane sums (`cpu::conv_weight`). On a GPU one batched im2col, one strided-batched
    /// product into per-sample partial gradients and their column sums (deterministic, no atomics).
    pub fn conv2d_weight_grad_accumulate(
        &self,
        input: &Tensor,
        window: &Window2d,
        weight_grad: &mut Tensor,
        bias_grad: Option<&mut Tensor>,
    ) -> Result<()> {
        let op = "conv2d_weight_grad_accumulate";
        let out_channels = if window.col_rows() == 0 { 0 } else { weight_grad.numel() / window.col_rows() };
        let batch = conv_batch(op, input, weight_grad, window, out_channels)?;
        let (col_rows, out_plane) = (window.col_rows(), window.out_plane_len());
        if self.numel() != batch * out_channels * out_plane {
            return Err(Error::shape(
                op,
                format!("{batch} x {out_channels} x {out_plane} output-gradient elements"),
                self.shape().to_string(),
            ));
        }
        if let Some(bias_grad) = &bias_grad
            && bias_grad.numel() != out_channels
        {
            return Err(Error::shape(
                op,
                format!("a bias gradient of {out_channels} elements"),
                bias_grad.shape().to_string(),
            ));
        }
        if let Device::Cpu(_) = weight_grad.device() {
            let (grad, x) = (self.host_f32(op)?, input.host_f32(op)?);
            // dweight [out, in·kh·kw] += Σ_samples dy [out, out_plane] · im2col(x)ᵀ, by the
            // small-output kernel over the whole batch.
            accumulate_part(weight_grad, |dst| conv2d_weight_grad(&x, &grad, window, out_channels, dst))?;
            if let Some(bias_grad) = bias_grad {
                accumulate_part(bias_grad, |dst| conv2d_bias_grad(&grad, out_plane, dst))?;
            }
            return Ok(());
        }
        let device = weight_grad.device().clone();
        let (dy, x) = (gpu_f32(op, self, &device)?, gpu_f32(op, input, &device)?);
        let Device::Cuda(cuda) = &device else { unreachable!("a CPU device returned above") };
        let stream = cuda.thread_stream()?;
        let cols = gpu_cols(&x, batch, window, cuda)?;
        let cols_view = DeviceMatRef::row_major(cols.as_ref().unwrap_or(&x), col_rows, out_plane)?
            .with_batch_stride(col_rows * out_plane)
            .t();
        let dy_view =
            DeviceMatRef::row_major(&dy, out_channels, out_plane)?.with_batch_stride(out_channels * out_plane);
        // Per-sample partial gradients [batch, out·in·kh·kw], then their sum over the batch.
        let mut partial = cuda.alloc_zeros::<f32>(batch * out_channels * col_rows)?;
        stream.matmul_batched(&mut partial, dy_view, cols_view, batch, false)?;
        stream.accumulate_column_sums(&partial, gpu_f32_mut(op, weight_grad)?)?;
        if let Some(bias_grad) = bias_grad {
            // Σ over each plane ([batch·out] sums), then over the batch.
            let mut plane_sums = cuda.alloc_zeros::<f32>(batch * out_channels)?;
            stream.accumulate_row_sums(&dy, &mut plane_sums)?;
            stream.accumulate_column_sums(&plane_sums, gpu_f32_mut(op, bias_grad)?)?;
        }
        Ok(())
    }
}

/// The batched im2col of `x` on the GPU, or `None` for a 1x1 stride-1 window without padding
/// (whose col matrix is the input itself).
fn gpu_cols(
    x: &CudaBuffer<f32>,
    batch: usize,
    window: &Window2d,
    cuda: &crate::device::CudaDevice,
) -> Result<Option<CudaBuffer<f32>>> {
    if window.is_pointwise() {
        return Ok(None);
    }
    let mut cols = cuda.alloc_zeros::<f32>(batch * window.col_rows() * window.out_plane_len())?;
    cuda.thread_stream()?.im2col(x, batch, window, &mut cols)?;
    Ok(Some(cols))
}
