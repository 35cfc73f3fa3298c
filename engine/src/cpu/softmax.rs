//! Row-wise softmax and log-softmax over the last dimension, numerically stable (the row maximum
//! is subtracted before exponentiating; sums accumulate in f64).
use super::window::check_len;
use crate::{Error, Result};

fn check_rows(op: &str, input: &[f32], cols: usize, output: &[f32]) -> Result<()> {
    if cols == 0 || !input.len().is_multiple_of(cols) {
        return Err(Error::shape(
            op,
            format!("rows of {cols} elements (cols > 0)"),
            format!("{} elements", input.len()),
        ));
    }
    check_len(op, "output", input.len(), output.len())
}

/// The maximum of a row and `log Σ exp(x - max)`.
fn row_max_and_log_sum_exp(row: &[f32]) -> (f32, f32) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return (max, 0.0);
    }
    let sum: f64 = row.iter().map(|&x| ((x - max) as f64).exp()).sum();
    (max, sum.ln() as f32)
}

/// `output[r, :] = softmax(input[r, :])` for rows of `cols` elements.
pub fn softmax_rows(input: &[f32], cols: usize, output: &mut [f32]) -> Result<()> {
    check_rows("softmax", input, cols, output)?;
    for (row, out) in input.chunks_exact(cols).zip(output.chunks_exact_mut(cols)) {
        let (max, log_sum) = row_max_and_log_sum_exp(row);
        for (o, &x) in out.iter_mut().zip(row) {
            *o = (x - max - log_sum).exp();
        }
    }
    Ok(())
}

/// `output[r, :] = log_softmax(input[r, :]) = x - max - log Σ exp(x - max)` for rows of `cols` elements.
pub fn log_softmax_rows(input: &[f32], cols: usize, output: &mut [f32]) -> Result<()> {
    check_rows("log_softmax", input, cols, output)?;
    for (row, out) in input.chunks_exact(cols).zip(output.chunks_exact_mut(cols)) {
        let (max, log_sum) = row_max_and_log_sum_exp(row);
        for (o, &x) in out.iter_mut().zip(row) {
            *o = x - max - log_sum;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_is_stable_for_large_logits_and_sums_to_one() {
        let input = [1000.0f32, 1001.0, 1002.0, -5.0, 0.0, 5.0];
        let mut p = [0.0; 6];
        softmax_rows(&input, 3, &mut p).unwrap();
        for row in p.chunks(3) {
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        }
        // exp(0)/(1+e+e²) for the first element.
        assert!((p[0] - 1.0 / (1.0 + 1f32.exp() + 2f32.exp())).abs() < 1e-6);
        let mut lp = [0.0; 6];
        log_softmax_rows(&input, 3, &mut lp).unwrap();
        for (a, b) in lp.iter().zip(&p) {
            assert!((a.exp() - b).abs() < 1e-6);
        }
        assert!(softmax_rows(&input, 4, &mut p).is_err());
    }
}
