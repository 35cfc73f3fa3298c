//! `FnLoss`: a user-defined loss in a closure. The closure says what one micro-batch's rows add up
//! to; the wrapper does the runtime's normalisation, so the closure never sees the normalizer.
use conveyor_engine::{DType, Error, Loss, Result, Targets, Tensor};

use crate::loss::check_normalizer;
use crate::tensor_io::into_dtype;

/// A loss from a closure `f(output, targets) -> (sum, gradient)`.
///
/// The contract: given a micro-batch's `output` `[rows, ...]` (on its stage's device, in the
/// model's dtype) and the same rows of the [`Targets`], `f` returns the **sum over rows** of the
/// per-row losses and the gradient of that sum with respect to `output` (same shape, on any
/// device). The wrapper divides both by the normalizer, the full batch's row count, so the
/// micro-batches add up to the mean of the per-row losses over the full batch, whatever the
/// micro-batch count. For PyTorch's elementwise `reduction="mean"` losses, the per-row loss is
/// the mean over the row's elements. `f` returns errors (such as [`Targets::values_for`]'s for
/// the wrong kind of targets), never panics on bad input.
///
/// ```
/// use std::sync::Arc;
/// use conveyor_engine::{Device, Loss, Targets, Tensor};
/// use conveyor_layers::FnLoss;
///
/// // Per row, the squared distance ‖o - t‖² between output and target vectors.
/// let squared_distance = FnLoss::new(|output: &Tensor, targets: &Targets| {
///     let (o, t) = (output.to_vec_f32(), targets.values_for("squared distance")?.to_vec_f32());
///     let sum = o.iter().zip(&t).map(|(o, t)| f64::from((o - t) * (o - t))).sum();
///     let grad = o.iter().zip(&t).map(|(o, t)| 2.0 * (o - t)).collect();
///     Ok((sum, Tensor::from_vec(grad, output.shape().clone(), output.device())?))
/// });
///
/// let host = Device::host();
/// let output = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0], [2, 2], &host)?;
/// let targets = Targets::Values(Tensor::from_vec(vec![1.0, 0.0, 3.0, 5.0], [2, 2], &host)?);
/// let (loss, grad) = squared_distance.loss_and_grad(&output, &targets, 2.0)?;
/// assert_eq!(loss, (4.0 + 1.0) / 2.0); // the mean over 2 rows
/// assert_eq!(grad.to_vec_f32(), [0.0, 2.0, 0.0, -1.0]);
/// let loss: Arc<dyn Loss> = Arc::new(squared_distance); // ready for `Trainer::builder`
/// # let _ = loss;
/// # Ok::<(), conveyor_engine::Error>(())
/// ```
pub struct FnLoss<F> {
    f: F,
}

impl<F> FnLoss<F>
where
    F: Fn(&Tensor, &Targets) -> Result<(f64, Tensor)> + Send + Sync,
{
    /// The loss computed by `f`; see the type's documentation for the contract.
    pub fn new(f: F) -> FnLoss<F> {
        FnLoss { f }
    }
}

impl<F> std::fmt::Debug for FnLoss<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FnLoss")
    }
}

impl<F> Loss for FnLoss<F>
where
    F: Fn(&Tensor, &Targets) -> Result<(f64, Tensor)> + Send + Sync,
{
    fn loss_and_grad(&self, output: &Tensor, targets: &Targets, normalizer: f32) -> Result<(f64, Tensor)> {
        check_normalizer("FnLoss", normalizer)?;
        let (sum, grad) = (self.f)(output, targets)?;
        if grad.dims() != output.dims() {
            return Err(Error::shape(
                "FnLoss gradient",
                format!("the output's shape {}", output.shape()),
                grad.shape().to_string(),
            ));
        }
        let mut grad = into_dtype(grad.move_to_device(output.device())?, DType::F32)?;
        grad.scale_in_place(1.0 / normalizer)?;
        Ok((sum / f64::from(normalizer), into_dtype(grad, output.dtype())?))
    }
}
