//! The `Loss` trait and what a loss compares the model's output with, [`Targets`]: one class
//! label per row (classification) or a real-valued tensor with one row per input row
//! (regression, autoencoders, any custom objective). Concrete losses live in `conveyor-layers`.
//!
//! The runtime splits a batch's targets into the micro-batches' rows and hands each micro-batch's
//! slice to the loss on the stage holding the graph's output, with the full batch's row count as
//! the normalizer, so the micro-batches' losses and gradients sum to the full batch's.
use crate::{DType, Device, Error, Result, Shape, Tensor};

/// What a loss compares the model's output with, one row per input row.
///
/// ```
/// use conveyor_engine::{Device, Targets, Tensor};
///
/// let labels = Targets::Classes(vec![2, 0, 1]);
/// let values = Targets::Values(Tensor::from_vec(vec![0.5; 6], [3, 2], &Device::host())?);
/// assert_eq!((labels.rows(), values.rows()), (3, 3));
/// // A micro-batch's slice: rows 1..3.
/// assert_eq!(labels.slice_rows(1, 2)?.classes_for("my loss")?, &[0, 1]);
/// assert_eq!(values.slice_rows(1, 2)?.values_for("my loss")?.dims(), &[2, 2]);
/// // A loss asking for the other kind gets an error it can return as is.
/// assert!(labels.values_for("my loss").is_err());
/// # Ok::<(), conveyor_engine::Error>(())
/// ```
#[derive(Debug)]
pub enum Targets {
    /// One class index per row (PyTorch's class-index targets of `nn.CrossEntropyLoss`).
    Classes(Vec<usize>),
    /// Real values, f32, shape `[rows, ...]` (for `nn.MSELoss` the output's shape).
    Values(Tensor),
}

/// Which kind of [`Targets`] a loss was given or needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TargetKind {
    /// [`Targets::Classes`].
    Classes,
    /// [`Targets::Values`].
    Values,
}

impl std::fmt::Display for TargetKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TargetKind::Classes => "class labels (Targets::Classes)",
            TargetKind::Values => "real values (Targets::Values)",
        })
    }
}

impl Targets {
    /// Which kind of targets these are.
    pub fn kind(&self) -> TargetKind {
        match self {
            Targets::Classes(_) => TargetKind::Classes,
            Targets::Values(_) => TargetKind::Values,
        }
    }

    /// The number of rows: labels, or the values' leading dimension.
    pub fn rows(&self) -> usize {
        match self {
            Targets::Classes(labels) => labels.len(),
            Targets::Values(values) => values.shape().leading(),
        }
    }

    /// Rows `start..start + len` (a micro-batch's targets); values are copied on their device.
    pub fn slice_rows(&self, start: usize, len: usize) -> Result<Targets> {
        match self {
            Targets::Classes(labels) => match labels.get(start..start.saturating_add(len)) {
                Some(rows) => Ok(Targets::Classes(rows.to_vec())),
                None => Err(Error::shape(
                    "Targets::slice_rows",
                    format!("rows {start}..{} within {} labels", start.saturating_add(len), labels.len()),
                    format!("{} labels", labels.len()),
                )),
            },
            Targets::Values(values) => Ok(Targets::Values(values.narrow_rows(start, len)?)),
        }
    }

    /// These targets with their values moved onto `device` ([`Tensor::move_to_device`]; labels
    /// need no device).
    pub fn move_to_device(self, device: &Device) -> Result<Targets> {
        match self {
            Targets::Classes(labels) => Ok(Targets::Classes(labels)),
            Targets::Values(values) => Ok(Targets::Values(values.move_to_device(device)?)),
        }
    }

    /// The class labels, or [`Error::WrongTargets`] naming `loss` when these are values.
    pub fn classes_for(&self, loss: &str) -> Result<&[usize]> {
        match self {
            Targets::Classes(labels) => Ok(labels),
            Targets::Values(_) => Err(self.wrong_kind(loss, TargetKind::Classes)),
        }
    }

    /// The values, or [`Error::WrongTargets`] naming `loss` when these are class labels.
    pub fn values_for(&self, loss: &str) -> Result<&Tensor> {
        match self {
            Targets::Values(values) => Ok(values),
            Targets::Classes(_) => Err(self.wrong_kind(loss, TargetKind::Values)),
        }
    }

    fn wrong_kind(&self, loss: &str, expected: TargetKind) -> Error {
        Error::WrongTargets { loss: loss.to_string(), expected, got: self.kind() }
    }

    /// Checks that these targets can go with a batch of `input_rows` rows: one target row per
    /// input row ([`Error::TargetRows`] otherwise), values f32 with at least one dimension.
    /// `op` names the caller in errors.
    pub fn check_rows(&self, op: &str, input_rows: usize) -> Result<()> {
        if let Targets::Values(values) = self {
            if values.shape().rank() == 0 {
                return Err(Error::shape(op, "target values [rows, ...]", values.shape().to_string()));
            }
            if values.dtype() != DType::F32 {
                return Err(Error::UnsupportedDType { op: format!("{op} target values"), dtype: values.dtype() });
            }
        }
        if self.rows() != input_rows {
            return Err(Error::TargetRows { op: op.to_string(), input_rows, target_rows: self.rows() });
        }
        Ok(())
    }
}

/// Another handle to the same targets: labels are copied, values shared ([`Tensor::share`]).
impl Clone for Targets {
    fn clone(&self) -> Targets {
        match self {
            Targets::Classes(labels) => Targets::Classes(labels.clone()),
            Targets::Values(values) => Targets::Values(values.share()),
        }
    }
}

impl From<Vec<usize>> for Targets {
    fn from(labels: Vec<usize>) -> Targets {
        Targets::Classes(labels)
    }
}

impl From<&[usize]> for Targets {
    fn from(labels: &[usize]) -> Targets {
        Targets::Classes(labels.to_vec())
    }
}

impl From<Tensor> for Targets {
    fn from(values: Tensor) -> Targets {
        Targets::Values(values)
    }
}

/// A loss over a batch of outputs and their [`Targets`].
///
/// A loss written from scratch implements this trait; most need only say how one micro-batch's
/// rows add up, and `conveyor_layers::FnLoss` turns such a closure into a `Loss`.
///
/// ```
/// use conveyor_engine::{Device, Loss, Result, Targets, Tensor};
///
/// /// Mean absolute error over every element (PyTorch's `nn.L1Loss()`).
/// #[derive(Debug)]
/// struct L1;
///
/// impl Loss for L1 {
///     fn loss_and_grad(&self, output: &Tensor, targets: &Targets, normalizer: f32) -> Result<(f64, Tensor)> {
///         let (o, t) = (output.to_vec_f32(), targets.values_for("L1")?.to_vec_f32());
///         let scale = normalizer * (output.numel() / output.shape().leading()) as f32;
///         let loss = o.iter().zip(&t).map(|(o, t)| f64::from((o - t).abs())).sum::<f64>() / f64::from(scale);
///         let grad = o.iter().zip(&t).map(|(o, t)| (o - t).signum() / scale).collect();
///         Ok((loss, Tensor::from_vec(grad, output.shape().clone(), output.device())?))
///     }
/// }
///
/// let host = Device::host();
/// let output = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0], [2, 2], &host)?;
/// let targets = Targets::Values(Tensor::from_vec(vec![0.0, 1.0, 3.5, 6.0], [2, 2], &host)?);
/// let (loss, grad) = L1.loss_and_grad(&output, &targets, 2.0)?;
/// assert_eq!(loss, (1.0 + 1.0 + 0.5 + 2.0) / 4.0);
/// assert_eq!(grad.to_vec_f32(), [0.25, 0.25, -0.25, -0.25]);
/// # Ok::<(), conveyor_engine::Error>(())
/// ```
pub trait Loss: Send + Sync + std::fmt::Debug {
    /// Returns the summed loss divided by `normalizer`, and the gradient of that value with respect
    /// to `output`. With `normalizer` = the full batch size, summing over micro-batches gives the
    /// full-batch mean (PyTorch's `reduction="mean"`). `targets` hold the micro-batch's rows, one
    /// per output row; a loss given the wrong kind returns [`Error::WrongTargets`] (see
    /// [`Targets::classes_for`] and [`Targets::values_for`]).
    fn loss_and_grad(&self, output: &Tensor, targets: &Targets, normalizer: f32) -> Result<(f64, Tensor)>;

    /// Whether this loss is softmax cross-entropy over the output's last dimension with class
    /// labels, normalised as [`Loss::loss_and_grad`] says (PyTorch's `nn.CrossEntropyLoss`). A
    /// training step may then let an output layer split over devices compute it where its pieces
    /// live ([`crate::Layer::forward_cross_entropy`]). Default: false.
    fn is_softmax_cross_entropy(&self) -> bool {
        false
    }

    /// Checks, before a step runs, that a batch's `targets` suit this loss for outputs of the
    /// per-sample shape `output_shape` (the graph output's, without the rows): the kind, and for
    /// real values their per-sample shape. The trainer calls it on every batch it is given, so a
    /// mistake is reported as this error before any work, rather than as a failed stage.
    /// Default: nothing checked here ([`Loss::loss_and_grad`] still checks).
    fn check_targets(&self, output_shape: &Shape, targets: &Targets) -> Result<()> {
        let _ = (output_shape, targets);
        Ok(())
    }
}
