//! Softmax cross-entropy over logits split by classes across devices (a vocabulary-parallel
//! output layer, Megatron's `vocab_parallel_cross_entropy`), as device ops: each shard reduces its
//! own columns to three numbers per row ([`Tensor::logit_shard_stats`]), the shards' numbers are
//! combined into each row's maximum and log-sum and the loss ([`Tensor::combine_logit_shard_stats`]),
//! and each shard turns its own logits into their gradient ([`Tensor::logit_shard_grad`]). The
//! full logits never exist on one device: what crosses between shards is `3 · rows` numbers each.
//!
//! The arithmetic follows [`Tensor::softmax_cross_entropy`]'s on a CPU: a log-probability is
//! `(z - max) - ln Σ` in f32 (the log of the f64 sum, rounded), the gradient its `exp` times
//! `1 / normalizer`, the loss the f64 sum of the labels' negated log-probabilities. With one
//! shard the results are that op's bit for bit; with several only the sum `Σ` differs, by the
//! order its terms are added in.
//!
//! Unlike Megatron's two all-reduces (the maximum, then the sum of exponentials), a shard's sum
//! is taken about its own maximum and rescaled when combined
//! (`Σ_r s_r · e^(m_r - M)`), so one exchange of the statistics suffices.
//!
//! On a CPU device the ops run on `cpu::softmax`'s vector kernels. On a GPU they run on host
//! copies of the logits (downloaded, computed, the gradient uploaded): there is no kernel for
//! them yet, so a GPU head pays a round trip through the host but still never gathers the logits.
use std::borrow::Cow;

use crate::cpu::softmax::row_max_and_sum_exp;
use crate::{Device, Error, Result, Tensor};

/// Numbers per row in [`Tensor::logit_shard_stats`]: the shard's maximum, its sum of
/// `e^(z - max)`, and the label's logit when this shard holds the label's class (else 0).
pub const LOGIT_SHARD_STATS: usize = 3;

impl Tensor {
    /// Per row of this shard of logits (`[rows, ..., C_r]`, classes `first..first + C_r` of the
    /// whole), `[max, Σ e^(z - max), z[label - first] or 0]` as a `[rows, 3]` f32 tensor on this
    /// tensor's device. `labels` hold one class of the whole per row.
    ///
    /// ```
    /// use conveyor_engine::{Device, Tensor};
    /// let host = Device::host();
    /// // Classes 2..4 of a row whose label is class 3, and of one whose label is class 0.
    /// let shard = Tensor::from_vec(vec![1.0, 2.0, 0.0, 0.0], [2, 2], &host)?;
    /// let stats = shard.logit_shard_stats(&[3, 0], 2)?.to_vec_f32();
    /// assert_eq!(stats[0], 2.0);
    /// assert!((stats[1] - (1.0 + (-1.0f32).exp())).abs() < 1e-6);
    /// assert_eq!((stats[2], stats[5]), (2.0, 0.0)); // row 1's label lives on another shard
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn logit_shard_stats(&self, labels: &[usize], first: usize) -> Result<Tensor> {
        let op = "logit_shard_stats";
        let cols = shard_cols(op, self, labels.len())?;
        let values = self.values_for(op)?;
        let stats = row_max_and_sum_exp(&values, cols)?;
        let mut out = Vec::with_capacity(labels.len() * LOGIT_SHARD_STATS);
        for ((row, (max, sum)), &label) in values.chunks_exact(cols).zip(stats).zip(labels) {
            let picked = label.checked_sub(first).and_then(|j| row.get(j)).copied().unwrap_or(0.0);
            out.extend_from_slice(&[max, sum, picked]);
        }
        Tensor::from_vec(out, [labels.len(), LOGIT_SHARD_STATS], self.device())
    }

    /// Combines every shard's [`Tensor::logit_shard_stats`], laid out shard after shard in this
    /// flat tensor (`k · rows · 3` values, as an all-gather leaves them), into each row's maximum
    /// `M` and `ln Σ_r s_r · e^(m_r - M)` over all classes (a `[rows, 2]` f32 tensor on this
    /// tensor's device) and the summed loss `-Σ_rows ((z[label] - M) - ln Σ)`, accumulated in
    /// f64. Each label's logit must come from exactly one shard (the others give 0).
    pub fn combine_logit_shard_stats(&self, k: usize, rows: usize) -> Result<(Tensor, f64)> {
        let op = "combine_logit_shard_stats";
        if self.numel() != k * rows * LOGIT_SHARD_STATS || k == 0 {
            return Err(Error::shape(
                op,
                format!("{k} shards x {rows} rows x {LOGIT_SHARD_STATS} statistics"),
                self.shape().to_string(),
            ));
        }
        let values = self.values_for(op)?;
        let stat = |shard: usize, row: usize, i: usize| values[(shard * rows + row) * LOGIT_SHARD_STATS + i];
        let mut shifts = Vec::with_capacity(rows * 2);
        let mut loss_sum = 0.0f64;
        for row in 0..rows {
            let max = (0..k).map(|shard| stat(shard, row, 0)).fold(f32::NEG_INFINITY, |m, x| x.max(m));
            // A shard whose logits are all -inf adds nothing (its own sum is NaN).
            let term = |shard: usize| match stat(shard, row, 0) {
                f32::NEG_INFINITY => 0.0,
                shard_max => f64::from(stat(shard, row, 1)) * (f64::from(shard_max) - f64::from(max)).exp(),
            };
            let log_sum = (0..k).map(term).sum::<f64>().ln() as f32;
            let picked: f32 = (0..k).map(|shard| stat(shard, row, 2)).sum();
            loss_sum -= f64::from((picked - max) - log_sum);
            shifts.extend_from_slice(&[max, log_sum]);
        }
        Ok((Tensor::from_vec(shifts, [rows, 2], self.device())?, loss_sum))
    }

    /// The gradient of the loss `-Σ_rows log softmax(z)[label] / normalizer` with respect to this
    /// shard of logits (classes `first..first + C_r`): `(softmax(z) - onehot(label)) /
    /// normalizer`, in this tensor's shape and dtype on its device. `shifts` is
    /// [`Tensor::combine_logit_shard_stats`]'s `[rows, 2]`.
    pub fn logit_shard_grad(&self, shifts: &Tensor, labels: &[usize], first: usize, normalizer: f32) -> Result<Tensor> {
        let op = "logit_shard_grad";
        let cols = shard_cols(op, self, labels.len())?;
        if shifts.dims() != [labels.len(), 2] {
            return Err(Error::shape(op, format!("[{}, 2] row shifts", labels.len()), shifts.shape().to_string()));
        }
        let (values, shifts) = (self.values_for(op)?, shifts.values_for(op)?);
        let inv_normalizer = 1.0 / normalizer;
        let mut grad = Vec::with_capacity(values.len());
        let rows = values.chunks_exact(cols).zip(shifts.chunks_exact(2)).zip(labels);
        for ((row, shift), &label) in rows {
            let (max, log_sum) = (shift[0], shift[1]);
            let start = grad.len();
            grad.extend(row.iter().map(|&z| ((z - max) - log_sum).exp() * inv_normalizer));
            if let Some(value) = label.checked_sub(first).filter(|&j| j < cols) {
                grad[start + value] -= inv_normalizer;
            }
        }
        Tensor::from_vec(grad, self.shape().clone(), self.device())?.into_dtype(self.dtype())
    }

    /// This tensor's values as f32 on the host: borrowed on a CPU device, downloaded from a GPU.
    fn values_for(&self, op: &str) -> Result<Cow<'_, [f32]>> {
        match self.device() {
            Device::Cpu(_) => self.host_f32(op),
            Device::Cuda(_) => Ok(Cow::Owned(self.try_to_vec_f32()?)),
        }
    }
}

/// The class count of a shard of logits with one label per row.
fn shard_cols(op: &str, logits: &Tensor, n_labels: usize) -> Result<usize> {
    match logits.dims() {
        [_, .., cols] if *cols > 0 && logits.numel() / cols == n_labels => Ok(*cols),
        _ => Err(Error::shape(
            op,
            format!("logits [rows, ..., classes] with classes > 0 and {n_labels} rows, one per label"),
            logits.shape().to_string(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    /// Splits `[rows, cols]` logits into column blocks of `widths`.
    fn blocks(values: &[f32], rows: usize, widths: &[usize]) -> Vec<Tensor> {
        let cols: usize = widths.iter().sum();
        let mut first = 0;
        widths
            .iter()
            .map(|&w| {
                let block: Vec<f32> =
                    (0..rows).flat_map(|r| values[r * cols + first..r * cols + first + w].to_vec()).collect();
                first += w;
                Tensor::from_vec(block, [rows, w], &Device::host()).unwrap()
            })
            .collect()
    }

    #[test]
    fn split_cross_entropy_matches_the_whole_logits() {
        let (rows, cols) = (5, 11);
        let values: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 113) as f32 - 56.0) * 0.07).collect();
        let labels = [0usize, 10, 4, 5, 7];
        let whole = Tensor::from_vec(values.clone(), [rows, cols], &Device::host()).unwrap();
        let (want_loss, want_grad) = whole.softmax_cross_entropy(&labels, 8.0).unwrap();
        let want_grad = want_grad.to_vec_f32();
        for widths in [vec![11], vec![6, 5], vec![3, 3, 3, 2]] {
            let shards = blocks(&values, rows, &widths);
            let mut firsts = vec![0];
            for w in &widths {
                firsts.push(firsts.last().unwrap() + w);
            }
            let mut gathered = Vec::new();
            for (shard, &first) in shards.iter().zip(&firsts) {
                gathered.extend(shard.logit_shard_stats(&labels, first).unwrap().to_vec_f32());
            }
            let gathered = Tensor::from_vec(gathered, [widths.len() * rows * 3], &Device::host()).unwrap();
            let (lse, loss_sum) = gathered.combine_logit_shard_stats(widths.len(), rows).unwrap();
            if widths.len() == 1 {
                // One shard: the whole-logits op's bits.
                assert_eq!(loss_sum / 8.0, want_loss);
            }
            assert!((loss_sum / 8.0 - want_loss).abs() < 1e-6 * want_loss.abs(), "{widths:?}");
            for (shard, (&first, &w)) in shards.iter().zip(firsts.iter().zip(&widths)) {
                let grad = shard.logit_shard_grad(&lse, &labels, first, 8.0).unwrap().to_vec_f32();
                for r in 0..rows {
                    for j in 0..w {
                        let (got, want) = (grad[r * w + j], want_grad[r * cols + first + j]);
                        assert!((got - want).abs() < 1e-7, "{widths:?} row {r} class {}: {got} vs {want}", first + j);
                        if widths.len() == 1 {
                            assert_eq!(got.to_bits(), want.to_bits());
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn mismatched_shapes_are_errors() {
        let shard = Tensor::from_vec(vec![0.0; 6], [2, 3], &Device::host()).unwrap();
        assert!(shard.logit_shard_stats(&[0], 0).is_err());
        assert!(shard.combine_logit_shard_stats(2, 2).is_err());
        let lse = Tensor::from_vec(vec![0.0; 3], [3, 1], &Device::host()).unwrap();
        assert!(shard.logit_shard_grad(&lse, &[0, 1], 0, 1.0).is_err());
    }

    #[test]
    fn half_logits_give_a_gradient_of_their_dtype() {
        let shard =
            Tensor::from_vec(vec![0.5, -0.5], [1, 2], &Device::host()).unwrap().into_dtype(DType::BF16).unwrap();
        let stats = shard.logit_shard_stats(&[1], 0).unwrap();
        let (lse, _) = stats.combine_logit_shard_stats(1, 1).unwrap();
        assert_eq!(shard.logit_shard_grad(&lse, &[1], 0, 1.0).unwrap().dtype(), DType::BF16);
    }
}
