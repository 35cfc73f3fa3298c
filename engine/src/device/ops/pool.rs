//! Pooling and the small elementwise ops the zoo's CNNs need, as device ops: max pooling
//! ([`Tensor::max_pool2d`], [`Tensor::max_pool2d_input_grad`]), average pooling
//! ([`Tensor::avg_pool2d`], [`Tensor::avg_pool2d_input_grad`]), global average pooling
//! ([`Tensor::global_avg_pool2d`], [`Tensor::global_avg_pool2d_input_grad`]), the dropout mask
//! product ([`Tensor::dropout_forward`], [`Tensor::dropout_apply`]) and the residual sum
//! ([`Tensor::add`]), dispatched as every op in [`super`].
//!
//! On a CPU device each op runs the kernels of [`crate::cpu::pool`] (or the elementwise map) the
//! layers ran before, in the same order, so CPU results are unchanged bit for bit; results are
//! computed in f32 and rounded back to the input's dtype. On a GPU the kernels of `conv.cu` and
//! `elementwise.cu` run on this thread's stream in f32 (a half input read through an exact f32
//! copy, the result rounded back as on the CPU). Forward passes and the elementwise
//! products round exactly as the CPU does; the pooling gradients of overlapping windows sum in
//! another order (max pooling's scatter by atomics), so they may differ by rounding there.
//!
//! Max pooling's argmax is an f32 tensor on both devices: each output's winning position within
//! its input plane (`row * in_width + col`, -1 for a window entirely in the padding), exact for
//! planes of at most 2^24 positions ([`crate::cpu::pool::MAX_POOL_PLANE_LIMIT`]; larger planes are
//! an error on both devices). Global average pooling on a GPU is average pooling with one window
//! covering the whole plane, which sums in the CPU kernel's order.
use super::{gpu_f16, gpu_f32};
use crate::cpu::pool::{
    avg_pool2d_backward, avg_pool2d_forward, global_avg_pool_backward, global_avg_pool_forward, max_pool2d_forward,
    max_pool2d_input_grad,
};
use crate::cpu::{Window2d, uninit};
use crate::{DType, Device, Error, Result, Shape, Tensor};
use half::f16;

/// The batch size of an NCHW `shape` whose samples are `window`'s input
/// (`[batch, window.channels, window.in_height, window.in_width]`).
fn batch_of(op: &str, shape: &Shape, window: &Window2d) -> Result<usize> {
    match shape.dims() {
        &[batch, channels, height, width]
            if (channels, height, width) == (window.channels, window.in_height, window.in_width) =>
        {
            Ok(batch)
        }
        _ => Err(Error::shape(
            op,
            format!("an NCHW tensor [batch, {}, {}, {}]", window.channels, window.in_height, window.in_width),
            shape.to_string(),
        )),
    }
}

/// Checks that `grad_output` has the pooled shape `[batch, channels, out_height, out_width]`.
fn check_pooled(op: &str, grad_output: &Tensor, batch: usize, window: &Window2d) -> Result<()> {
    let expected = Shape::new([batch, window.channels, window.out_height(), window.out_width()]);
    if grad_output.shape() != &expected {
        return Err(Error::shape(
            op,
            format!("an output gradient of shape {expected}"),
            grad_output.shape().to_string(),
        ));
    }
    Ok(())
}

/// The window covering a whole `[batch, channels, height, width]` plane: average pooling with it
/// is global average pooling, in the same summation order (rows, then columns, from +0.0) and
/// with the same divisor.
fn whole_plane(op: &str, shape: &Shape) -> Result<(usize, Window2d)> {
    match shape.dims() {
        &[batch, channels, height, width] if height > 0 && width > 0 => {
            Ok((batch, Window2d::new(channels, (height, width), (height, width), (1, 1), (0, 0))?))
        }
        _ => Err(Error::shape(
            op,
            "an NCHW tensor [batch, channels, height, width] with non-empty planes",
            shape.to_string(),
        )),
    }
}

impl Tensor {
    /// Max pooling of this NCHW tensor (`[batch, window.channels, window.in_height,
    /// window.in_width]`), padding acting as -inf: the output `[batch, channels, out_height,
    /// out_width]` in this tensor's dtype and the argmax, an f32 tensor of the
    /// same shape holding each output's winning position within its input plane
    /// (`row * in_width + col`; the layout of [`crate::cpu::pool::max_pool2d_forward`], bit for
    /// bit on every device), for [`Tensor::max_pool2d_input_grad`].
    ///
    /// ```
    /// use conveyor_engine::cpu::Window2d;
    /// use conveyor_engine::{Device, Tensor};
    ///
    /// let x = Tensor::from_vec(vec![1.0, 5.0, 3.0, 4.0], [1, 1, 2, 2], &Device::host())?;
    /// let (y, argmax) = x.max_pool2d(&Window2d::new(1, (2, 2), (2, 2), (2, 2), (0, 0))?)?;
    /// assert_eq!((y.to_vec_f32(), argmax.to_vec_f32()), (vec![5.0], vec![1.0]));
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn max_pool2d(&self, window: &Window2d) -> Result<(Tensor, Tensor)> {
        let op = "max_pool2d";
        let batch = batch_of(op, self.shape(), window)?;
        let n_planes = batch * window.channels;
        let out_shape = Shape::new([batch, window.channels, window.out_height(), window.out_width()]);
        match self.device() {
            Device::Cpu(_) => {
                let input = self.host_f32(op)?;
                let mut output = Tensor::zeros(out_shape.clone(), DType::F32, self.device())?;
                let mut argmax = Tensor::zeros(out_shape, DType::F32, self.device())?;
                max_pool2d_forward(&input, n_planes, window, output.as_f32_mut()?, argmax.as_f32_mut()?)?;
                Ok((output.into_dtype(self.dtype())?, argmax))
            }
            Device::Cuda(cuda) => {
                let input = gpu_f32(op, self, self.device())?;
                let stream = cuda.thread_stream()?;
                let mut output = cuda.alloc_zeros::<f32>(out_shape.numel())?;
                let mut argmax = cuda.alloc_zeros::<f32>(out_shape.numel())?;
                stream.max_pool_forward(&input, n_planes, window, &mut output, &mut argmax)?;
                Ok((
                    Tensor::from_cuda_f32(output, out_shape.clone(), self.device())?.into_dtype(self.dtype())?,
                    Tensor::from_cuda_f32(argmax, out_shape, self.device())?,
                ))
            }
        }
    }

    /// Max pooling's input gradient: each element of `grad_output` added onto the input position
    /// `argmax` (from [`Tensor::max_pool2d`]) recorded for it, zeros elsewhere. A new tensor of
    /// `input_shape` in `grad_output`'s dtype on its device (on a GPU overlapping
    /// windows' gradients are summed by atomic adds, in no fixed order).
    pub fn max_pool2d_input_grad(
        grad_output: &Tensor,
        argmax: &Tensor,
        window: &Window2d,
        input_shape: &Shape,
    ) -> Result<Tensor> {
        let op = "max_pool2d_input_grad";
        let batch = batch_of(op, input_shape, window)?;
        check_pooled(op, grad_output, batch, window)?;
        if argmax.shape() != grad_output.shape() {
            return Err(Error::shape(
                op,
                format!("an argmax of shape {}", grad_output.shape()),
                argmax.shape().to_string(),
            ));
        }
        let n_planes = batch * window.channels;
        let device = grad_output.device();
        match device {
            Device::Cpu(_) => {
                let (grad, argmax) = (grad_output.host_f32(op)?, argmax.host_f32(op)?);
                // Written in full (disjoint windows gathered in one pass, others zeroed and scattered).
                let grad_input = Tensor::from_f32_init(input_shape.clone(), device, |dst| {
                    max_pool2d_input_grad(&grad, &argmax, n_planes, window, dst)
                })?;
                grad_input.into_dtype(grad_output.dtype())
            }
            Device::Cuda(cuda) => {
                let (grad, argmax) = (gpu_f32(op, grad_output, device)?, gpu_f32(op, argmax, device)?);
                let stream = cuda.thread_stream()?;
                let mut grad_input = cuda.alloc_zeros::<f32>(input_shape.numel())?;
                stream.max_pool_backward(&grad, &argmax, n_planes, window, &mut grad_input)?;
                Tensor::from_cuda_f32(grad_input, input_shape.clone(), device)?.into_dtype(grad_output.dtype())
            }
        }
    }

    /// Average pooling of this NCHW tensor (`[batch, window.channels, window.in_height,
    /// window.in_width]`): each output its window's sum divided by `kernel_height · kernel_width`
    /// (zero padding counted, PyTorch's `count_include_pad=True`). A new tensor `[batch, channels,
    /// out_height, out_width]` in this tensor's dtype, bit for bit the same on
    /// every device.
    pub fn avg_pool2d(&self, window: &Window2d) -> Result<Tensor> {
        let op = "avg_pool2d";
        let batch = batch_of(op, self.shape(), window)?;
        let n_planes = batch * window.channels;
        let out_shape = Shape::new([batch, window.channels, window.out_height(), window.out_width()]);
        match self.device() {
            Device::Cpu(_) => {
                let input = self.host_f32(op)?;
                let mut output = Tensor::zeros(out_shape, DType::F32, self.device())?;
                avg_pool2d_forward(&input, n_planes, window, output.as_f32_mut()?)?;
                output.into_dtype(self.dtype())
            }
            Device::Cuda(cuda) => {
                let input = gpu_f32(op, self, self.device())?;
                let stream = cuda.thread_stream()?;
                let mut output = cuda.alloc_zeros::<f32>(out_shape.numel())?;
                stream.avg_pool_forward(&input, n_planes, window, &mut output)?;
                Tensor::from_cuda_f32(output, out_shape, self.device())?.into_dtype(self.dtype())
            }
        }
    }

    /// Average pooling's input gradient: each output gradient divided by `kernel_height ·
    /// kernel_width` and added onto every input of its window. A new tensor of `input_shape` in
    /// `grad_output`'s dtype on its device (on a GPU each input sums its windows'
    /// shares in another order than the CPU).
    pub fn avg_pool2d_input_grad(grad_output: &Tensor, window: &Window2d, input_shape: &Shape) -> Result<Tensor> {
        let op = "avg_pool2d_input_grad";
        let batch = batch_of(op, input_shape, window)?;
        check_pooled(op, grad_output, batch, window)?;
        let n_planes = batch * window.channels;
        let device = grad_output.device();
        match device {
            Device::Cpu(_) => {
                let grad = grad_output.host_f32(op)?;
                let mut grad_input = Tensor::zeros(input_shape.clone(), DType::F32, device)?;
                avg_pool2d_backward(&grad, n_planes, window, grad_input.as_f32_mut()?)?;
                grad_input.into_dtype(grad_output.dtype())
            }
            Device::Cuda(cuda) => {
                let grad = gpu_f32(op, grad_output, device)?;
                let stream = cuda.thread_stream()?;
                let mut grad_input = cuda.alloc_zeros::<f32>(input_shape.numel())?;
                stream.avg_pool_backward(&grad, n_planes, window, &mut grad_input)?;
                Tensor::from_cuda_f32(grad_input, input_shape.clone(), device)?.into_dtype(grad_output.dtype())
            }
        }
    }

    /// Global average pooling of this NCHW tensor: `[batch, channels, height, width] ->
    /// [batch, channels]`, each output the mean of its plane (summed from +0.0 in row-major
    /// order), in this tensor's dtype, bit for bit the same on every device.
    pub fn global_avg_pool2d(&self) -> Result<Tensor> {
        let op = "global_avg_pool2d";
        let (batch, window) = whole_plane(op, self.shape())?;
        let out_shape = Shape::new([batch, window.channels]);
        match self.device() {
            Device::Cpu(_) => {
                let input = self.host_f32(op)?;
                let mut output = Tensor::zeros(out_shape, DType::F32, self.device())?;
                global_avg_pool_forward(&input, window.in_plane_len(), output.as_f32_mut()?)?;
                output.into_dtype(self.dtype())
            }
            Device::Cuda(_) => {
                let pooled = self.avg_pool2d(&window)?;
                pooled.reshape(out_shape)
            }
        }
    }

    /// Global average pooling's input gradient: each `grad_output[b, c]` divided by the plane's
    /// length and spread over its plane. A new tensor of `input_shape` (`[batch, channels, height,
    /// width]`) in `grad_output`'s dtype on its device, bit for bit the same on
    /// every device.
    pub fn global_avg_pool2d_input_grad(grad_output: &Tensor, input_shape: &Shape) -> Result<Tensor> {
        let op = "global_avg_pool2d_input_grad";
        let (batch, window) = whole_plane(op, input_shape)?;
        let pooled = Shape::new([batch, window.channels]);
        if grad_output.shape() != &pooled {
            return Err(Error::shape(
                op,
                format!("an output gradient of shape {pooled}"),
                grad_output.shape().to_string(),
            ));
        }
        let device = grad_output.device();
        match device {
            Device::Cpu(_) => {
                let grad = grad_output.host_f32(op)?;
                let mut grad_input = Tensor::zeros(input_shape.clone(), DType::F32, device)?;
                global_avg_pool_backward(&grad, window.in_plane_len(), grad_input.as_f32_mut()?)?;
                grad_input.into_dtype(grad_output.dtype())
            }
            Device::Cuda(_) => {
                let grad = grad_output.share().reshape([batch, window.channels, 1, 1])?;
                Tensor::avg_pool2d_input_grad(&grad, &window, input_shape)
            }
        }
    }

    /// Inverted dropout with a keep mask drawn on the host (`keep`: one 1.0 or 0.0 per element):
    /// the output `x · keep · scale` (in that order, on every device) in this tensor's dtype (f32
    /// only on a GPU), and the mask on this tensor's device for [`Tensor::dropout_apply`] in the
    /// backward pass: f16 on every device (2 bytes per element, exact for 0 and 1).
    pub fn dropout_forward(&self, keep: &[f32], scale: f32) -> Result<(Tensor, Tensor)> {
        let op = "dropout_forward";
        if keep.len() != self.numel() {
            return Err(Error::shape(
                op,
                format!("a mask of {} elements", self.numel()),
                format!("{} elements", keep.len()),
            ));
        }
        match self.device() {
            Device::Cpu(_) => {
                let x = self.host_f32(op)?;
                let output = Tensor::from_f32_init(self.shape().clone(), self.device(), |dst| {
                    uninit::map2(dst, &x, keep, |x, keep| x * keep * scale)
                })?;
                let half: Vec<f16> = keep.iter().map(|&keep| f16::from_f32(keep)).collect();
                let mask = Tensor::from_f16_vec(half, self.shape().clone(), self.device())?;
                Ok((output.into_dtype(self.dtype())?, mask))
            }
            Device::Cuda(cuda) => {
                let x = gpu_f32(op, self, self.device())?;
                let stream = cuda.thread_stream()?;
                // Saved as f16, as on the CPU: half the bytes of f32, and the plan counts them.
                let half: Vec<f16> = keep.iter().map(|&keep| f16::from_f32(keep)).collect();
                let mask = Tensor::from_f16_vec(half, self.shape().clone(), self.device())?;
                let mut output = cuda.alloc_zeros::<f32>(x.len())?;
                stream.dropout_apply(&x, gpu_f16(op, &mask, self.device())?, scale, &mut output)?;
                Ok((
                    Tensor::from_cuda_f32(output, self.shape().clone(), self.device())?.into_dtype(self.dtype())?,
                    mask,
                ))
            }
        }
    }

    /// `self · mask · scale` elementwise (in that order; equal shapes), the dropout product with
    /// a saved mask (dropout's input gradient): a new tensor in `self`'s dtype on its device (on a
    /// CPU the mask may be of any dtype; on a GPU `self` is f32 and the mask f16, as
    /// [`Tensor::dropout_forward`] saves it).
    pub fn dropout_apply(&self, mask: &Tensor, scale: f32) -> Result<Tensor> {
        let op = "dropout_apply";
        if self.shape() != mask.shape() {
            return Err(Error::shape(op, format!("a mask of shape {}", self.shape()), mask.shape().to_string()));
        }
        match self.device() {
            Device::Cpu(_) => {
                let (x, keep) = (self.host_f32(op)?, mask.host_f32(op)?);
                let output = Tensor::from_f32_init(self.shape().clone(), self.device(), |dst| {
                    uninit::map2(dst, &x, &keep, |x, keep| x * keep * scale)
                })?;
                output.into_dtype(self.dtype())
            }
            Device::Cuda(cuda) => {
                let (x, keep) = (gpu_f32(op, self, self.device())?, gpu_f16(op, mask, self.device())?);
                let stream = cuda.thread_stream()?;
                let mut output = cuda.alloc_zeros::<f32>(x.len())?;
                stream.dropout_apply(&x, keep, scale, &mut output)?;
                Tensor::from_cuda_f32(output, self.shape().clone(), self.device())?.into_dtype(self.dtype())
            }
        }
    }

    /// `self + other` elementwise (equal shapes, the same device): a new tensor in `self`'s dtype
    /// on its device (computed in f32 and rounded back), bit for bit
    /// the same on every device.
    ///
    /// ```
    /// use conveyor_engine::{Device, Tensor};
    ///
    /// let host = Device::host();
    /// let a = Tensor::from_vec(vec![1.0, 2.0], [2], &host)?;
    /// let b = Tensor::from_vec(vec![0.5, -2.0], [2], &host)?;
    /// assert_eq!(a.add(&b)?.to_vec_f32(), [1.5, 0.0]);
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        let op = "add";
        if self.shape() != other.shape() {
            return Err(Error::shape(op, self.shape().to_string(), other.shape().to_string()));
        }
        match self.device() {
            Device::Cpu(_) => {
                let (lhs, rhs) = (self.host_f32(op)?, other.host_f32(op)?);
                let sum = Tensor::from_f32_init(self.shape().clone(), self.device(), |dst| {
                    uninit::map2(dst, &lhs, &rhs, |a, b| a + b)
                })?;
                sum.into_dtype(self.dtype())
            }
            Device::Cuda(cuda) => {
                let (lhs, rhs) = (gpu_f32(op, self, self.device())?, gpu_f32(op, other, self.device())?);
                let stream = cuda.thread_stream()?;
                let mut out = cuda.alloc_zeros::<f32>(lhs.len())?;
                stream.add(&lhs, &rhs, &mut out)?;
                Tensor::from_cuda_f32(out, self.shape().clone(), self.device())?.into_dtype(self.dtype())
            }
        }
    }
}
