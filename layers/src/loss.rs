//! `CrossEntropyLoss`: softmax cross-entropy over the last dimension with integer class labels
//! (PyTorch's `nn.CrossEntropyLoss` with class-index targets), numerically stable via log-softmax.
use conveyor_engine::cpu::softmax::log_softmax_rows;
use conveyor_engine::{Error, Loss, Result, Tensor};

use crate::tensor_io::{into_dtype, values, zeros_f32};

/// Softmax cross-entropy: for logits `z` `[N, C]` (or `[N, ..., C]`, one label per row) and labels
/// `y`, returns `Σ_rows (logsumexp(z_r) - z_r[y_r]) / normalizer` and its gradient
/// `(softmax(z_r) - onehot(y_r)) / normalizer`, in the logits' dtype. The sum accumulates in f64.
#[derive(Debug, Default, Clone, Copy)]
pub struct CrossEntropyLoss;

impl CrossEntropyLoss {
    /// The loss (it has no configuration).
    pub fn new() -> CrossEntropyLoss {
        CrossEntropyLoss
    }
}

impl Loss for CrossEntropyLoss {
    fn loss_and_grad(&self, output: &Tensor, labels: &[usize], normalizer: f32) -> Result<(f64, Tensor)> {
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
        if let Some((row, &label)) = labels.iter().enumerate().find(|&(_, &label)| label >= n_classes) {
            return Err(Error::invalid(
                "CrossEntropyLoss label",
                format!("label {label} at row {row} is out of range for {n_classes} classes; labels must lie in 0..{n_classes}"),
            ));
        }
        if !(normalizer > 0.0 && normalizer.is_finite()) {
            return Err(Error::invalid(
                "CrossEntropyLoss normalizer",
                format!("{normalizer}: must be positive and finite (e.g. the full batch size)"),
            ));
        }
        let mut grad = zeros_f32(output.shape().clone(), output.device())?;
        let grad_values = grad.as_f32_mut()?;
        log_softmax_rows(&values(output), n_classes, grad_values)?;
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
        Ok((loss_sum / normalizer as f64, into_dtype(grad, output.dtype())?))
    }
}
