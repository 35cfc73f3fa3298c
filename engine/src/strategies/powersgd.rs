//! PowerSGD as Vogels et al. (2019) and PyTorch's `powerSGD_hook` run it over an all-reduce, for
//! the exchanges every worker takes part in (`allreduce`, `average:K`): per matrix `M` (a
//! worker's values plus its error-feedback residual), `P = M Q` is summed over the workers and
//! orthonormalised, `Q = Mᵀ P` is averaged over the workers, and every worker takes `P Qᵀ`, a
//! rank-`r` approximation of the workers' *mean*, keeping `M - P Qᵀ` as its residual and `Q` as
//! the next warm start. Every worker starts from the same `Q` (seeded by tensor, not by worker),
//! and sums run in worker order, so all workers compute the same bits. Tensors PowerSGD cannot
//! shrink (vectors, small matrices) travel as f32 in the first exchange. Server pushes, which no
//! other worker shares, use the per-worker codec of `compress.rs` instead.
use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use super::compress::{for_each_low_rank, low_rank_shape, orthonormalise_columns};
use crate::Result;

/// One worker's PowerSGD state: per tensor, its residual and the warm-start `Q`.
#[derive(Debug)]
pub(super) struct CollectivePowerSgd {
    rank: usize,
    seed: u64,
    tensors: BTreeMap<usize, (Vec<f32>, Vec<f32>)>,
}

/// What one worker sends in an exchange, and how the workers' parts combine.
pub(super) trait AllGather {
    /// Everyone's bytes, in worker order (the same for every worker); `bytes` counted as sent.
    fn all_gather(&self, bytes: Vec<u8>) -> Result<std::sync::Arc<Vec<Vec<u8>>>>;
}

impl CollectivePowerSgd {
    pub fn new(rank: usize, seed: u64) -> CollectivePowerSgd {
        CollectivePowerSgd { rank, seed, tensors: BTreeMap::new() }
    }

    /// The workers' mean of `values` (one per tensor of `dims`), compressed as above; the same on
    /// every worker.
    pub fn mean(
        &mut self,
        dims: &[&[usize]],
        values: &[Vec<f32>],
        group: &dyn AllGather,
        workers: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let rank = self.rank;
        let shapes: Vec<Option<(usize, usize)>> = dims.iter().map(|d| low_rank_shape(d, rank)).collect();
        // Round 1: P = M Q for the matrices, the values themselves for the rest.
        let mut matrices: Vec<Option<Vec<f32>>> = Vec::with_capacity(values.len());
        let mut first = Vec::new();
        for (i, (v, shape)) in values.iter().zip(&shapes).enumerate() {
            let Some((rows, cols)) = *shape else {
                first.extend(v.iter().flat_map(|x| x.to_le_bytes()));
                matrices.push(None);
                continue;
            };
            let (residual, q) = self.state(i, rows * cols, cols * rank);
            let m: Vec<f32> = residual.iter().zip(v).map(|(r, v)| r + v).collect();
            let p = product(&m, rows, cols, q, rank);
            first.extend(p.iter().flat_map(|x| x.to_le_bytes()));
            matrices.push(Some(m));
        }
        let sizes1: Vec<usize> =
            values.iter().zip(&shapes).map(|(v, s)| s.map_or(v.len(), |(rows, _)| rows * rank)).collect();
        let sums1 = sum_parts(&group.all_gather(first)?, &sizes1)?;
        // Round 2: Q = Mᵀ P with P the orthonormalised sum.
        let mut ps = Vec::with_capacity(values.len());
        let mut second = Vec::new();
        for ((sum, shape), m) in sums1.iter().zip(&shapes).zip(&matrices) {
            let (Some((rows, cols)), Some(m)) = (*shape, m) else {
                ps.push(Vec::new());
                continue;
            };
            let mut p: Vec<f64> = sum.iter().map(|&x| f64::from(x)).collect();
            orthonormalise_columns(&mut p, rows, rank);
            let p: Vec<f32> = p.iter().map(|&x| x as f32).collect();
            let q = transposed_product(m, rows, cols, &p, rank);
            second.extend(q.iter().flat_map(|x| x.to_le_bytes()));
            ps.push(p);
        }
        let sizes2: Vec<usize> = shapes.iter().filter_map(|s| s.map(|(_, cols)| cols * rank)).collect();
        let mut sums2 = sum_parts(&group.all_gather(second)?, &sizes2)?.into_iter();
        let n = workers as f32;
        let mut out = Vec::with_capacity(values.len());
        for (i, ((sum, shape), (m, p))) in sums1.into_iter().zip(&shapes).zip(matrices.into_iter().zip(ps)).enumerate()
        {
            let (Some((rows, cols)), Some(mut m)) = (*shape, m) else {
                out.push(sum.into_iter().map(|x| x / n).collect());
                continue;
            };
            let q: Vec<f32> = sums2.next().unwrap_or_default().into_iter().map(|x| x / n).collect();
            let mut approx = vec![0.0f32; rows * cols];
            for_each_low_rank(&p, &q, cols, rank, |j, a| approx[j] = a);
            m.iter_mut().zip(&approx).for_each(|(m, a)| *m -= a);
            self.tensors.insert(i, (m, q));
            out.push(approx);
        }
        Ok(out)
    }

    /// Tensor `i`'s residual (zeros at first) and `Q` (seeded by tensor at first).
    fn state(&mut self, i: usize, len: usize, q_len: usize) -> (&[f32], &[f32]) {
        let seed = self.seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let (residual, q) = self.tensors.entry(i).or_insert_with(|| {
            let mut rng = StdRng::seed_from_u64(seed);
            (vec![0.0; len], (0..q_len).map(|_| rng.random_range(-1.0f32..1.0)).collect())
        });
        (residual, q)
    }
}

/// `M Q` (rows × rank), sums in f64.
fn product(m: &[f32], rows: usize, cols: usize, q: &[f32], rank: usize) -> Vec<f32> {
    let mut out = vec![0f64; rows * rank];
    for (row, acc) in m.chunks_exact(cols).zip(out.chunks_exact_mut(rank)) {
        for (&v, q_row) in row.iter().zip(q.chunks_exact(rank)) {
            acc.iter_mut().zip(q_row).for_each(|(a, &q)| *a += f64::from(v) * f64::from(q));
        }
    }
    debug_assert_eq!(out.len(), rows * rank);
    out.into_iter().map(|x| x as f32).collect()
}

/// `Mᵀ P` (cols × rank), sums in f64.
fn transposed_product(m: &[f32], rows: usize, cols: usize, p: &[f32], rank: usize) -> Vec<f32> {
    let mut out = vec![0f64; cols * rank];
    for (row, p_row) in m.chunks_exact(cols).zip(p.chunks_exact(rank)).take(rows) {
        for (&v, acc) in row.iter().zip(out.chunks_exact_mut(rank)) {
            acc.iter_mut().zip(p_row).for_each(|(a, &p)| *a += f64::from(v) * f64::from(p));
        }
    }
    out.into_iter().map(|x| x as f32).collect()
}

/// The workers' parts (each the same sequence of f32 blocks of `sizes`) summed block by block in
/// worker order.
fn sum_parts(parts: &[Vec<u8>], sizes: &[usize]) -> Result<Vec<Vec<f32>>> {
    let total: usize = sizes.iter().sum();
    let mut sums: Vec<Vec<f32>> = sizes.iter().map(|&s| vec![0.0; s]).collect();
    for part in parts {
        if part.len() != 4 * total {
            return Err(crate::Error::invalid(
                "PowerSGD exchange",
                format!("a worker sent {} bytes, expected {}", part.len(), 4 * total),
            ));
        }
        let mut values = part.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        for sum in &mut sums {
            sum.iter_mut().zip(values.by_ref()).for_each(|(s, v)| *s += v);
        }
    }
    Ok(sums)
}
