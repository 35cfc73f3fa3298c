//! Matrix products on one core, over strided f32 views so either operand may be transposed
//! without a copy: through the `gemm` crate (`Parallelism::None`), or for a Linear layer's shapes
//! at micro-batch sizes through our own kernel ([`super::rows_gemm`]).
use std::mem::MaybeUninit;

use gemm::Parallelism;

use crate::{Error, Result};

/// A read-only strided view of an f32 matrix.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> MatRef<'a> {
    /// `data` as a row-major `rows x cols` matrix.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Result<Self> {
        if data.len() < rows * cols {
            return Err(Error::shape(
                "MatRef::row_major",
                format!("{} elements for {rows}x{cols}", rows * cols),
                format!("{}", data.len()),
            ));
        }
        Ok(MatRef { data, rows, cols, row_stride: cols, col_stride: 1 })
    }

    /// The transposed view (no copy).
    pub fn t(self) -> Self {
        MatRef {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `(row_stride, col_stride)` in elements.
    pub fn strides(&self) -> (usize, usize) {
        (self.row_stride, self.col_stride)
    }

    /// The underlying elements.
    pub fn data(&self) -> &'a [f32] {
        self.data
    }
}

/// `dst = lhs · rhs` (or `dst += lhs · rhs` when `accumulate`), `dst` row-major `lhs.rows x rhs.cols`.
///
/// The shapes of a Linear layer at micro-batch sizes ([`super::rows_gemm::suits`]) run our own
/// kernel ([`super::rows_gemm`]), the rest the `gemm` crate: a choice by shape alone.
///
/// Accumulating, the product is added to `dst` whole: our kernel sums each element apart and adds
/// it last; the `gemm` crate adds a product of depth past [`GEMM_DEPTH_BLOCK`] to its destination
/// block by block, so for such depths the product is made apart (a buffer inside the kernel, like
/// the crate's packing buffers) and then added. A
/// weight gradient summed over micro-batches is so the same bits however its rows are cut into
/// micro-batches and data-parallel replicas (`a + b` for two parts either way).
pub fn matmul(dst: &mut [f32], lhs: MatRef<'_>, rhs: MatRef<'_>, accumulate: bool) -> Result<()> {
    check_dims(dst.len(), lhs, rhs)?;
    if accumulate && lhs.cols > GEMM_DEPTH_BLOCK && !super::rows_gemm::suits(lhs.rows, lhs.cols, rhs.cols) {
        let mut part = vec![MaybeUninit::<f32>::uninit(); dst.len()];
        let part = matmul_uninit(&mut part, lhs, rhs)?;
        dst.iter_mut().zip(part.iter()).for_each(|(d, &p)| *d += p);
        return Ok(());
    }
    // SAFETY: `dst` holds `lhs.rows x rhs.cols` initialised elements (checked above), so reading
    // them to accumulate is sound.
    unsafe { product(dst.as_mut_ptr(), lhs, rhs, accumulate) };
    Ok(())
}

/// The depth (inner dimension) the `gemm` crate multiplies in one block at least: it cuts a
/// product's depth into blocks of `max(512, cache-derived)` (`gemm-common`'s `kernel_params`),
/// so up to this depth a product is added to its destination once, whole.
pub const GEMM_DEPTH_BLOCK: usize = 512;

/// `dst = lhs · rhs` into an uninitialised `dst` (row-major `lhs.rows x rhs.cols`), which it
/// writes in full (the GEMM does not read its output when not accumulating) and returns as
/// `&mut [f32]`: for tensors made by `Tensor::from_f32_init` without a zero-fill.
pub fn matmul_uninit<'a>(dst: &'a mut [MaybeUninit<f32>], lhs: MatRef<'_>, rhs: MatRef<'_>) -> Result<&'a mut [f32]> {
    check_dims(dst.len(), lhs, rhs)?;
    // SAFETY: `dst` holds `lhs.rows x rhs.cols` elements (checked above); without accumulation
    // `product` writes each of them and reads none (see its contract).
    unsafe {
        product(dst.as_mut_ptr().cast::<f32>(), lhs, rhs, false);
        Ok(super::uninit::assume_init(dst))
    }
}

fn check_dims(dst_len: usize, lhs: MatRef<'_>, rhs: MatRef<'_>) -> Result<()> {
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    if rhs.rows != k {
        return Err(Error::shape("matmul", format!("rhs with {k} rows"), format!("{}x{}", rhs.rows, rhs.cols)));
    }
    if dst_len != m * n {
        return Err(Error::shape("matmul", format!("dst of {m}x{n} = {} elements", m * n), format!("{dst_len}")));
    }
    Ok(())
}

/// `dst = lhs · rhs`, or `dst += lhs · rhs` when `accumulate`. Without `accumulate` every
/// element of `dst` is written and none is read: the `gemm` crate zeroes its `alpha` when told
/// not to read the destination, and each of its paths (the k = 0 fill, gevv, gemv, the packed
/// micro-kernels with `alpha_status == 0`) then stores without loading.
///
/// # Safety
/// `dst` must be valid for writes of `lhs.rows x rhs.cols` row-major elements (and initialised
/// when `accumulate`); the views must have been checked with [`check_dims`].
unsafe fn product(dst: *mut f32, lhs: MatRef<'_>, rhs: MatRef<'_>, accumulate: bool) {
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m * n {
                // SAFETY: `dst` is valid for `m x n` writes.
                unsafe { dst.add(i).write(0.0) };
            }
        }
        return;
    }
    if super::rows_gemm::suits(m, k, n) {
        // SAFETY: as for the crate's call below; `rhs` is a checked `k x n` view.
        unsafe { super::rows_gemm::product(dst, lhs, super::rows_gemm::Rhs::Strided(rhs), n, accumulate) };
        return;
    }
    // SAFETY: the views cover rows x cols elements with their strides (row_major checks the
    // length; t() only swaps strides), and dst holds m x n row-major elements.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            n as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.col_stride as isize,
            lhs.row_stride as isize,
            rhs.data.as_ptr(),
            rhs.col_stride as isize,
            rhs.row_stride as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        out
    }

    #[test]
    fn matches_naive_in_all_layouts() {
        let (m, k, n) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        let expected = naive(&a, &b, m, k, n);
        let a_t: Vec<f32> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
        let b_t: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        let lhs_views = [MatRef::row_major(&a, m, k).unwrap(), MatRef::row_major(&a_t, k, m).unwrap().t()];
        let rhs_views = [MatRef::row_major(&b, k, n).unwrap(), MatRef::row_major(&b_t, n, k).unwrap().t()];
        for lhs in lhs_views {
            for rhs in rhs_views {
                let mut dst = vec![1.0; m * n];
                matmul(&mut dst, lhs, rhs, true).unwrap();
                for (d, e) in dst.iter().zip(&expected) {
                    assert!((d - (e + 1.0)).abs() < 1e-5, "{d} vs {}", e + 1.0);
                }
                matmul(&mut dst, lhs, rhs, false).unwrap();
                for (d, e) in dst.iter().zip(&expected) {
                    assert!((d - e).abs() < 1e-5);
                }
                let mut fresh: Vec<MaybeUninit<f32>> = (0..m * n).map(|_| MaybeUninit::uninit()).collect();
                assert_eq!(matmul_uninit(&mut fresh, lhs, rhs).unwrap(), &dst[..], "bit-identical to matmul");
            }
        }
    }

    #[test]
    fn rejects_mismatched_inner_dimension() {
        let a = vec![0.0; 6];
        let err =
            matmul(&mut [0.0; 4], MatRef::row_major(&a, 2, 3).unwrap(), MatRef::row_major(&a, 2, 3).unwrap(), false);
        assert!(matches!(err, Err(Error::ShapeMismatch { .. })));
    }
}
