//! `MseLoss`: mean squared error over real-valued targets of the output's shape (PyTorch's
//! `nn.MSELoss()`, `reduction="mean"`), for regression. The arithmetic is the device op
//! `Tensor::squared_error`, which runs where the output lives.
use conveyor_engine::{Error, Loss, Result, Shape, Targets, Tensor};

use crate::loss::check_normalizer;

/// Mean squared error over every element: for an output `o` and targets `t` of one shape
/// `[rows, ...]` with `D` elements per row, returns `Σ (o - t)² / (normalizer · D)` and its
/// gradient `2 (o - t) / (normalizer · D)` (PyTorch's `2 / numel · (o - t)`), in the output's dtype
/// on the output's device. The loss is computed and summed in f64.
///
/// With the runtime's normalizer, the full batch's row count `N`, each micro-batch contributes
/// its share and the micro-batches sum to the full batch's `nn.MSELoss()`: the mean over all
/// `N · D` elements. Class labels are an [`Error::WrongTargets`]; targets of another shape than
/// the output an [`Error::TargetShape`].
///
/// ```
/// use conveyor_engine::{Device, Loss, Targets, Tensor};
/// use conveyor_layers::MseLoss;
///
/// let host = Device::host();
/// let output = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3], &host)?;
/// let targets = Targets::Values(Tensor::from_vec(vec![1.0, 0.0, 3.0, 4.0, 5.0, 9.0], [2, 3], &host)?);
/// // torch.nn.MSELoss()(output, targets) = (2² + 3²) / 6
/// let (loss, grad) = MseLoss::new().loss_and_grad(&output, &targets, 2.0)?;
/// assert!((loss - 13.0 / 6.0).abs() < 1e-12);
/// assert_eq!(grad.to_vec_f32(), [0.0, 2.0 * 2.0 / 6.0, 0.0, 0.0, 0.0, 2.0 * -3.0 / 6.0]);
/// // Class labels are not real values.
/// assert!(MseLoss::new().loss_and_grad(&output, &Targets::Classes(vec![0, 1]), 2.0).is_err());
/// # Ok::<(), conveyor_engine::Error>(())
/// ```
#[derive(Debug, Default, Clone, Copy)]
pub struct MseLoss;

impl MseLoss {
    /// The loss (PyTorch's default, `reduction="mean"`).
    pub fn new() -> MseLoss {
        MseLoss
    }
}

impl Loss for MseLoss {
    fn loss_and_grad(&self, output: &Tensor, targets: &Targets, normalizer: f32) -> Result<(f64, Tensor)> {
        let values = targets.values_for("MseLoss")?;
        if values.dims() != output.dims() || output.shape().rank() == 0 {
            return Err(Error::TargetShape {
                loss: "MseLoss".to_string(),
                output: output.dims().to_vec(),
                targets: values.dims().to_vec(),
            });
        }
        check_normalizer("MseLoss", normalizer)?;
        let per_row = output.shape().trailing_numel();
        let scale = f64::from(normalizer) * per_row as f64;
        output.squared_error(values, scale)
    }

    /// Real values of the output's per-sample shape.
    fn check_targets(&self, output_shape: &Shape, targets: &Targets) -> Result<()> {
        let values = targets.values_for("MseLoss")?;
        if values.dims().get(1..) != Some(output_shape.dims()) {
            let rows = values.shape().leading();
            return Err(Error::TargetShape {
                loss: "MseLoss".to_string(),
                output: output_shape.with_leading_dim(rows).dims().to_vec(),
                targets: values.dims().to_vec(),
            });
        }
        Ok(())
    }
}
