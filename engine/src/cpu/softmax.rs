//! Row-wise softmax and log-softmax over the last dimension, numerically stable (the row maximum
//! is subtracted before exponentiating), in f32 on `cpu::vecmath`'s vector `exp`; sums in a fixed
//! lane order, so every ISA gives the same bits.
#[cfg(test)]
use super::vecmath::Isa;
#[cfg(test)]
use super::vecmath::dispatch_on;
use super::vecmath::{Job, Lanes, dispatch, exp2parts, sum_halves_in_place};
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

/// Lanes of the canonical sum: element `i` of a row is added into partial sum `i % SUM_LANES`,
/// the partials then added pairwise (8 + 8, 4 + 4, ...). Every ISA follows this order, so row
/// sums, and so the results, have the same bits on all of them.
const SUM_LANES: usize = 16;

/// Softmax (or log-softmax) of every row of `cols` elements, on one ISA.
struct Rows<'a> {
    input: &'a [f32],
    output: &'a mut [f32],
    cols: usize,
    log: bool,
}

impl Job for Rows<'_> {
    type Output = ();
    #[inline(always)]
    fn run<V: Lanes>(self) {
        for (row, out) in self.input.chunks_exact(self.cols).zip(self.output.chunks_exact_mut(self.cols)) {
            softmax_row::<V>(row, out, self.log);
        }
    }
}

/// `e^(x - max)` with `x - max` carried exactly (TwoSum), so the rounding of a large difference
/// does not reach the result.
#[inline(always)]
fn exp_minus<V: Lanes>(x: V, max: V) -> V {
    let neg_max = V::splat(0.0).sub(max);
    let diff = x.add(neg_max);
    let back = diff.sub(x);
    let error = x.sub(diff.sub(back)).add(neg_max.sub(back));
    // The error is NaN where the difference is infinite (x = -inf: e^-inf = 0) or NaN (then the
    // result is NaN through `diff` alone).
    let zero = V::splat(0.0);
    exp2parts(diff, V::select(error.is_nan(), zero, error))
}

/// A row's maximum and `Σ e^(x - max)`, summed in the canonical lane order; with `out`, each
/// `e^(x - max)` is stored there too (`out.len() == row.len()`).
#[inline(always)]
fn max_and_sum_exp<V: Lanes>(row: &[f32], out: Option<&mut [f32]>) -> (f32, f32) {
    let n = row.len();
    let whole = n - n % SUM_LANES;
    let src = row.as_ptr();
    let dst = out.map(|out| out.as_mut_ptr());
    // SAFETY: every index below is < n = row.len() (= out.len() when stored), whole vectors of
    // V::N (which divides SUM_LANES) only below `whole`.
    unsafe {
        let mut max_v = V::splat(f32::NEG_INFINITY);
        let mut i = 0;
        while i + V::N <= n {
            max_v = V::load(src.add(i)).max(max_v);
            i += V::N;
        }
        // (The vector's lanes never hold a NaN: `max` keeps its right operand where either is.)
        let mut max = max_v.reduce_max();
        for &x in &row[i..] {
            max = x.max(max);
        }
        // A NaN is skipped by `max` but reaches the sum through its own exp, so the row is NaN.
        let max_splat = V::splat(max);
        let mut acc = [V::splat(0.0); SUM_LANES];
        let per_group = SUM_LANES / V::N;
        let mut i = 0;
        while i < whole {
            for (j, a) in acc.iter_mut().enumerate().take(per_group) {
                let e = exp_minus(V::load(src.add(i + j * V::N)), max_splat);
                if let Some(dst) = dst {
                    e.store(dst.add(i + j * V::N));
                }
                *a = a.add(e);
            }
            i += SUM_LANES;
        }
        let sum = if whole == n {
            // The canonical order in registers: whole vectors pairwise by halves, then the lanes
            // of the last one by halves.
            let mut groups = per_group;
            while groups > 1 {
                groups /= 2;
                for k in 0..groups {
                    acc[k] = acc[k].add(acc[k + groups]);
                }
            }
            acc[0].sum_halves()
        } else {
            let mut lanes = [0.0f32; SUM_LANES];
            for (j, a) in acc.iter().enumerate().take(per_group) {
                a.store(lanes.as_mut_ptr().add(j * V::N));
            }
            for k in whole..n {
                let e = exp_minus(row[k], max);
                if let Some(dst) = dst {
                    *dst.add(k) = e;
                }
                lanes[k % SUM_LANES] += e;
            }
            sum_halves_in_place(&mut lanes)
        };
        (max, sum)
    }
}

/// One row: `out = e^(x - max) / Σ e^(x - max)`, or `(x - max) - ln Σ e^(x - max)` when `log`.
/// NaN anywhere in the row, `+inf`, or a row of `-inf` give a row of NaN (as torch).
#[inline(always)]
fn softmax_row<V: Lanes>(row: &[f32], out: &mut [f32], log: bool) {
    let n = row.len();
    let (max, sum) = max_and_sum_exp::<V>(row, (!log).then_some(&mut *out));
    let (src, dst) = (row.as_ptr(), out.as_mut_ptr());
    // SAFETY: every index below is < n = row.len() = out.len() (the caller's chunks).
    unsafe {
        if log {
            let shift = V::splat(max);
            let log_sum = ((sum as f64).ln() as f32, V::splat((sum as f64).ln() as f32));
            let mut i = 0;
            while i + V::N <= n {
                V::load(src.add(i)).sub(shift).sub(log_sum.1).store(dst.add(i));
                i += V::N;
            }
            for (k, &x) in row.iter().enumerate().skip(i) {
                *dst.add(k) = (x - max) - log_sum.0;
            }
        } else {
            let sum_splat = V::splat(sum);
            let mut i = 0;
            while i + V::N <= n {
                V::load(dst.add(i)).div(sum_splat).store(dst.add(i));
                i += V::N;
            }
            for k in i..n {
                *dst.add(k) /= sum;
            }
        }
    }
}

/// `output[r, :] = softmax(input[r, :])` for rows of `cols` elements (f32, vectorised; the same
/// bits on every ISA).
pub fn softmax_rows(input: &[f32], cols: usize, output: &mut [f32]) -> Result<()> {
    check_rows("softmax", input, cols, output)?;
    dispatch(Rows { input, output, cols, log: false });
    Ok(())
}

/// `output[r, :] = log_softmax(input[r, :]) = x - max - log Σ exp(x - max)` for rows of `cols`
/// elements (f32, vectorised; the same bits on every ISA).
pub fn log_softmax_rows(input: &[f32], cols: usize, output: &mut [f32]) -> Result<()> {
    check_rows("log_softmax", input, cols, output)?;
    dispatch(Rows { input, output, cols, log: true });
    Ok(())
}

/// Each row's maximum and `Σ e^(x - max)` (the canonical sum, as [`softmax_rows`] sums), for
/// rows of `cols` elements: the per-shard statistics of a softmax over columns split across
/// devices.
pub fn row_max_and_sum_exp(input: &[f32], cols: usize) -> Result<Vec<(f32, f32)>> {
    check_rows("row_max_and_sum_exp", input, cols, input)?;
    Ok(dispatch(MaxSums { input, cols }))
}

/// [`row_max_and_sum_exp`] on one ISA.
struct MaxSums<'a> {
    input: &'a [f32],
    cols: usize,
}

impl Job for MaxSums<'_> {
    type Output = Vec<(f32, f32)>;
    #[inline(always)]
    fn run<V: Lanes>(self) -> Vec<(f32, f32)> {
        // A loop, not a closure: a closure would not inherit the ISA's target features, and the
        // vector code would run through calls.
        let mut out = Vec::with_capacity(self.input.len() / self.cols);
        for row in self.input.chunks_exact(self.cols) {
            out.push(max_and_sum_exp::<V>(row, None));
        }
        out
    }
}

/// [`softmax_rows`] or [`log_softmax_rows`] on a chosen ISA (tests compare them).
#[cfg(test)]
fn rows_on(isa: Isa, input: &[f32], cols: usize, output: &mut [f32], log: bool) {
    dispatch_on(isa, Rows { input, output, cols, log });
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

    /// f64 softmax of one row.
    fn reference(row: &[f32]) -> Vec<f64> {
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let e: Vec<f64> = row.iter().map(|&x| (x as f64 - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        e.iter().map(|v| v / sum).collect()
    }

    #[test]
    fn every_isa_gives_the_same_bits_and_f64_accuracy() {
        for cols in [1usize, 3, 8, 16, 17, 64, 100, 512] {
            let input: Vec<f32> = (0..cols * 5).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 0.013).collect();
            for log in [false, true] {
                let mut scalar = vec![0.0; input.len()];
                rows_on(Isa::Scalar, &input, cols, &mut scalar, log);
                for isa in Isa::ALL.into_iter().filter(|&isa| isa != Isa::Scalar && isa.available()) {
                    let mut got = vec![0.0; input.len()];
                    rows_on(isa, &input, cols, &mut got, log);
                    assert!(got.iter().zip(&scalar).all(|(a, b)| a.to_bits() == b.to_bits()), "{isa:?} {cols} {log}");
                }
                for (row, out) in input.chunks(cols).zip(scalar.chunks(cols)) {
                    for (got, want) in out.iter().zip(reference(row)) {
                        let want = if log { want.ln() } else { want };
                        let err = (*got as f64 - want).abs();
                        assert!(err <= 2e-6 * want.abs() + 1e-7, "cols {cols} log {log}: {got} vs {want}");
                    }
                }
            }
        }
    }

    /// A shard's statistics are the sums softmax takes, on every ISA, to the bit.
    #[test]
    fn row_statistics_are_softmaxs_sums_on_every_isa() {
        for cols in [1usize, 7, 16, 33, 100] {
            let input: Vec<f32> = (0..cols * 3).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 0.013).collect();
            let scalar = dispatch_on(Isa::Scalar, MaxSums { input: &input, cols });
            for isa in Isa::ALL.into_iter().filter(|&isa| isa.available()) {
                let got = dispatch_on(isa, MaxSums { input: &input, cols });
                assert!(got.iter().zip(&scalar).all(|(a, b)| a.0 == b.0 && a.1.to_bits() == b.1.to_bits()), "{isa:?}");
            }
            let mut p = vec![0.0; input.len()];
            softmax_rows(&input, cols, &mut p).unwrap();
            for ((row, (max, sum)), p) in
                input.chunks(cols).zip(row_max_and_sum_exp(&input, cols).unwrap()).zip(p.chunks(cols))
            {
                let top = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                assert_eq!(max, top);
                // The largest entry's probability is e^0 / sum.
                let at = row.iter().position(|&x| x == top).unwrap();
                assert_eq!(p[at], 1.0 / sum);
            }
        }
    }

    #[test]
    fn non_finite_rows_are_nan_like_torch() {
        let input = [1.0f32, f32::NAN, 2.0, f32::INFINITY, 0.0, 1.0, f32::NEG_INFINITY, f32::NEG_INFINITY];
        let mut p = [0.0; 8];
        softmax_rows(&input, 2, &mut p).unwrap();
        assert!(p[..4].iter().all(|v| v.is_nan()) && p[6..].iter().all(|v| v.is_nan()));
        assert!((p[4] - 1.0 / (1.0 + 1f32.exp())).abs() < 1e-7);
        let input = [0.0f32, f32::NEG_INFINITY];
        softmax_rows(&input, 2, &mut p[..2]).unwrap();
        assert_eq!(p[..2], [1.0, 0.0]);
    }
}
