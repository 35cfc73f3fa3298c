//! `CrossEntropyLoss`: softmax cross-entropy over the last dimension with integer class labels
//! (PyTorch's `nn.CrossEntropyLoss` with class-index targets), numerically stable via log-softmax.
//! The arithmetic is the engine's device op [`Tensor::softmax_cross_entropy`] (the CPU kernel on a
//! CPU device, the `cross_entropy` kernel on a GPU); this file checks the arguments. Losses over
//! real-valued targets are in `mse.rs` ([`crate::MseLoss`]) and `fn_loss.rs` ([`crate::FnLoss`]).
use conveyor_engine::{Error, Loss, Result, Shape, Targets, Tensor};

/// Softmax cross-entropy: for logits `z` `[N, C]` (or `[N, ..., C]`, one label per row) and labels
/// `y`, returns `Σ_rows (logsumexp(z_r) - z_r[y_r]) / normalizer` and its gradient
/// `(softmax(z_r) - onehot(y_r)) / normalizer`, in the logits' dtype on the logits' device. The
/// sum accumulates in f64 (on a GPU, the per-row losses are computed in f32 and summed in f64).
#[derive(Debug, Default, Clone, Copy)]
pub struct CrossEntropyLoss;

impl CrossEntropyLoss {
    /// The loss (it has no configuration).
    pub fn new() -> CrossEntropyLoss {
        CrossEntropyLoss
    }
}

impl Loss for CrossEntropyLoss {
    fn loss_and_grad(&self, output: &Tensor, targets: &Targets, normalizer: f32) -> Result<(f64, Tensor)> {
        let labels = targets.classes_for("CrossEntropyLoss")?;
        let Some(&n_classes) = output.dims().last().filter(|_| output.shape().rank() >= 2) else {
            return Err(Error::shape("CrossEntropyLoss", "logits [batch, n_classes]", output.shape().to_string()));
        };
        if n_classes == 0 {
            return Err(Error::shape("CrossEntropyLoss", "logits with at least one class", output.shape().to_string()));
        }
        let rows = output.numel() / n_classes;
        if labels.len() != rows {
            return Err(Error::shape(
                "CrossEntropyLoss labels",
                format!("{rows} labels, one per row of logits {}", output.shape()),
                format!("{} labels", labels.len()),
            ));
        }
        check_label_range(labels, n_classes)?;
        check_normalizer("CrossEntropyLoss", normalizer)?;
        output.softmax_cross_entropy(labels, normalizer)
    }

    fn is_softmax_cross_entropy(&self) -> bool {
        true
    }

    /// Class labels, each below the output's last dimension (the class count).
    fn check_targets(&self, output_shape: &Shape, targets: &Targets) -> Result<()> {
        let labels = targets.classes_for("CrossEntropyLoss")?;
        match output_shape.dims().last() {
            Some(&n_classes) => check_label_range(labels, n_classes),
            None => Ok(()),
        }
    }
}

/// The error for the first label at or above `n_classes`, if any.
pub(crate) fn check_label_range(labels: &[usize], n_classes: usize) -> Result<()> {
    match labels.iter().enumerate().find(|&(_, &label)| label >= n_classes) {
        None => Ok(()),
        Some((row, &label)) => Err(Error::invalid(
            "CrossEntropyLoss label",
            format!(
                "label {label} at row {row} is out of range for {n_classes} classes; labels must lie in 0..{n_classes}"
            ),
        )),
    }
}

/// The error for a `normalizer` that is not positive and finite, naming `loss`.
pub(crate) fn check_normalizer(loss: &str, normalizer: f32) -> Result<()> {
    if normalizer > 0.0 && normalizer.is_finite() {
        return Ok(());
    }
    Err(Error::invalid(
        format!("{loss} normalizer"),
        format!("{normalizer}: must be positive and finite (e.g. the full batch size)"),
    ))
}
