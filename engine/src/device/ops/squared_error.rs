//! The squared error of an output against real-valued targets as a device op
//! ([`Tensor::squared_error`]), for `MseLoss`: the loss summed in f64 and its gradient, dispatched
//! as every op in [`super`].
use super::gpu_f32;
use crate::{Device, Error, Result, Tensor};

impl Tensor {
    /// `Σ (self - targets)² / scale` and its gradient `(2 / scale) · (self - targets)`, for an
    /// output `self` and `targets` of one shape: the loss as f64, the gradient in `self`'s dtype
    /// on `self`'s device (`scale` is the number the sum is divided by, `normalizer · D` for
    /// `MseLoss`; a `scale` of 0 gives a loss of 0).
    ///
    /// On a CPU device each difference is squared and summed in f64 and the gradient is
    /// `(2 / scale) as f32 · (o - t)` in f32, element by element. On a GPU (tensors on one
    /// device, a half output read through an exact f32 copy) the difference is `o + (-t)` (the
    /// same f32 value), the gradient the same f32 product, and the sum of squares the reduction kernel's (f32 squares, f64 partial sums), so
    /// the loss agrees with the CPU's to f32 rounding and the gradient bit for bit.
    ///
    /// ```
    /// use conveyor_engine::{Device, Tensor};
    /// let host = Device::host();
    /// let output = Tensor::from_vec(vec![1.0, 2.0, 3.0], [1, 3], &host)?;
    /// let targets = Tensor::from_vec(vec![1.0, 0.0, 4.0], [1, 3], &host)?;
    /// let (loss, grad) = output.squared_error(&targets, 3.0)?;
    /// assert!((loss - 5.0 / 3.0).abs() < 1e-12);
    /// assert_eq!(grad.to_vec_f32(), [0.0, 2.0 / 3.0 * 2.0, 2.0 / 3.0 * -1.0]);
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn squared_error(&self, targets: &Tensor, scale: f64) -> Result<(f64, Tensor)> {
        let op = "squared_error";
        if targets.dims() != self.dims() {
            return Err(Error::shape(op, format!("targets of shape {}", self.shape()), targets.shape().to_string()));
        }
        let grad_scale = (2.0 / scale) as f32;
        let mean = |sum: f64| if scale == 0.0 { 0.0 } else { sum / scale };
        match self.device() {
            Device::Cpu(_) => {
                let (output, targets) = (self.host_f32(op)?, targets.host_f32(op)?);
                let mut sum = 0.0f64;
                let grad: Vec<f32> = output
                    .iter()
                    .zip(targets.iter())
                    .map(|(&o, &t)| {
                        let exact = f64::from(o) - f64::from(t);
                        sum += exact * exact;
                        grad_scale * (o - t)
                    })
                    .collect();
                let grad = Tensor::from_vec(grad, self.shape().clone(), self.device())?.into_dtype(self.dtype())?;
                Ok((mean(sum), grad))
            }
            Device::Cuda(cuda) => {
                let device = self.device();
                let (output, targets) = (gpu_f32(op, self, device)?, gpu_f32(op, targets, device)?);
                let stream = cuda.thread_stream()?;
                let mut negated = stream.copy_from(&targets)?;
                stream.scale(&mut negated, -1.0)?;
                let mut diff = cuda.alloc_zeros::<f32>(output.len())?;
                stream.add(&output, &negated, &mut diff)?;
                let sum = stream.sum_of_squares(&diff)?;
                stream.scale(&mut diff, grad_scale)?;
                Ok((mean(sum), Tensor::from_cuda_f32(diff, self.shape().clone(), device)?.into_dtype(self.dtype())?))
            }
        }
    }
}
