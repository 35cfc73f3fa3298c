//! Right-hand operands packed once into column panels, for products that reuse the same matrix
//! many times (a Linear layer's weight within a step): `pack_rhs` lays `B` (`k x n`) out as
//! `ceil(n / PANEL)` panels, each `k x width` row-major and contiguous, and `matmul_packed`
//! multiplies by it one panel and at most `ROW_CHUNK` rows at a time.
//!
//! Why: the `gemm` crate packs the weight-sized operand into its own panel layout on every call
//! once the other operand has more than 48 rows (`8 x NR`), and at micro-batch sizes that repacking
//! is a third of the product's time (profiled at 64 rows: 35%). A panel here is exactly that
//! layout (64 consecutive columns, unit stride within a k step), and each call stays at or under
//! 48 rows, so the crate reads the panel in place: measured on one core over eight cold 1024x1024
//! weights, x·B runs at 185/202/211/229 GFLOP/s at 32/64/128/256 rows against 110/159/193/215 with
//! the crate's own packing. The micro-kernel and its k order are the same, so for k a multiple of
//! the SIMD width the results are bit-for-bit those of [`super::matmul`] (the tests check it);
//! every device runs this same path, so pipelines stay bit-for-bit equal to one device.
//!
//! The shapes [`super::rows_gemm::suits`] (a Linear's at micro-batch sizes) run our own kernel
//! instead, reading the panels as `matmul` reads the unpacked operand: the same bits either way.
use std::mem::MaybeUninit;

use gemm::Parallelism;

use super::MatRef;
use crate::{Error, Result};

/// Columns per panel: the f32 AVX-512 micro-kernel's row block (4 vectors of 16).
pub const PANEL: usize = 64;
/// Rows of the left operand per call: at most `8 x NR` (NR = 6), under which the crate does not
/// repack the panel.
pub const ROW_CHUNK: usize = 48;

/// Elements a packed `k x n` operand takes (the same as unpacked: panels are not padded).
pub fn packed_len(k: usize, n: usize) -> usize {
    k * n
}

/// Packs `src` (`k x n`, any strides) into `dst` as panels of `PANEL` columns (the last one
/// narrower when `PANEL` does not divide `n`), each `k x width` row-major.
pub fn pack_rhs(src: MatRef<'_>, dst: &mut [f32]) -> Result<()> {
    let (k, n) = (src.rows(), src.cols());
    if dst.len() != packed_len(k, n) {
        return Err(Error::shape(
            "pack_rhs",
            format!("{} elements for {k}x{n}", packed_len(k, n)),
            dst.len().to_string(),
        ));
    }
    let (rs, cs) = src.strides();
    let data = src.data();
    let mut offset = 0;
    for col0 in (0..n).step_by(PANEL) {
        let width = PANEL.min(n - col0);
        let panel = &mut dst[offset..offset + k * width];
        if cs == 1 {
            for (row, out) in panel.chunks_exact_mut(width).enumerate() {
                let start = row * rs + col0;
                out.copy_from_slice(&data[start..start + width]);
            }
        } else if rs == 1 && cs >= k {
            // A transposed view of a row-major matrix (a Linear weight `[out, in]` seen as
            // `[in, out]`): the panel is the transpose of `width` consecutive source rows.
            let start = col0 * cs;
            if cs == k {
                super::transpose::transpose(&data[start..start + width * k], width, k, panel)?;
            } else {
                let block: Vec<f32> =
                    (0..width).flat_map(|j| data[start + j * cs..start + j * cs + k].iter().copied()).collect();
                super::transpose::transpose(&block, width, k, panel)?;
            }
        } else {
            for (row, out) in panel.chunks_exact_mut(width).enumerate() {
                for (j, value) in out.iter_mut().enumerate() {
                    *value = data[row * rs + (col0 + j) * cs];
                }
            }
        }
        offset += k * width;
    }
    Ok(())
}

/// `dst = lhs · B` (or `dst += lhs · B` when `accumulate`), `B` (`k x n`) packed by [`pack_rhs`],
/// `dst` row-major `lhs.rows x n`.
pub fn matmul_packed(
    dst: &mut [f32],
    lhs: MatRef<'_>,
    packed: &[f32],
    k: usize,
    n: usize,
    accumulate: bool,
) -> Result<()> {
    check(dst.len(), lhs, packed, k, n)?;
    // SAFETY: dims checked; dst is initialised, so reading it to accumulate is sound.
    unsafe { product_packed(dst.as_mut_ptr(), lhs, packed, k, n, accumulate) };
    Ok(())
}

/// [`matmul_packed`] into an uninitialised `dst`, which it writes in full (without accumulation
/// the GEMM stores every element and reads none) and returns initialised.
pub fn matmul_packed_uninit<'a>(
    dst: &'a mut [MaybeUninit<f32>],
    lhs: MatRef<'_>,
    packed: &[f32],
    k: usize,
    n: usize,
) -> Result<&'a mut [f32]> {
    check(dst.len(), lhs, packed, k, n)?;
    // SAFETY: dims checked; without accumulation every element of the `m x n` dst is written
    // (each (row chunk, panel) block is one product covering it) and none is read.
    unsafe {
        product_packed(dst.as_mut_ptr().cast::<f32>(), lhs, packed, k, n, false);
        Ok(std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<f32>(), dst.len()))
    }
}

fn check(dst_len: usize, lhs: MatRef<'_>, packed: &[f32], k: usize, n: usize) -> Result<()> {
    if lhs.cols() != k {
        return Err(Error::shape(
            "matmul_packed",
            format!("lhs with {k} columns"),
            format!("{}x{}", lhs.rows(), lhs.cols()),
        ));
    }
    if packed.len() != packed_len(k, n) {
        return Err(Error::shape(
            "matmul_packed",
            format!("a packed {k}x{n} operand"),
            format!("{} elements", packed.len()),
        ));
    }
    let m = lhs.rows();
    if dst_len != m * n {
        return Err(Error::shape("matmul_packed", format!("dst of {m}x{n} = {} elements", m * n), dst_len.to_string()));
    }
    Ok(())
}

/// # Safety
/// `dst` valid for writes of `lhs.rows x n` row-major elements (initialised when `accumulate`);
/// dims checked by [`check`].
unsafe fn product_packed(dst: *mut f32, lhs: MatRef<'_>, packed: &[f32], k: usize, n: usize, accumulate: bool) {
    let m = lhs.rows();
    if m == 0 || n == 0 {
        return;
    }
    let (lhs_rs, lhs_cs) = lhs.strides();
    if k == 0 {
        if !accumulate {
            for i in 0..m * n {
                // SAFETY: dst is valid for m x n writes.
                unsafe { dst.add(i).write(0.0) };
            }
        }
        return;
    }
    if super::rows_gemm::suits(m, k, n) {
        // SAFETY: dst valid for m x n (checked by the caller); the panels hold k·n elements.
        unsafe { super::rows_gemm::product(dst, lhs, super::rows_gemm::Rhs::Panels(packed), n, accumulate) };
        return;
    }
    let mut offset = 0;
    for col0 in (0..n).step_by(PANEL) {
        let width = PANEL.min(n - col0);
        let panel = &packed[offset..offset + k * width];
        for row0 in (0..m).step_by(ROW_CHUNK) {
            let rows = ROW_CHUNK.min(m - row0);
            // SAFETY: the block dst[row0.., col0..col0 + width] with row stride n lies inside the
            // m x n dst; the lhs rows row0..row0 + rows lie inside the checked view; the panel
            // holds k x width elements, row-major.
            unsafe {
                gemm::gemm(
                    rows,
                    width,
                    k,
                    dst.add(row0 * n + col0),
                    1,
                    n as isize,
                    accumulate,
                    lhs.data().as_ptr().add(row0 * lhs_rs),
                    lhs_cs as isize,
                    lhs_rs as isize,
                    panel.as_ptr(),
                    1,
                    width as isize,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    Parallelism::None,
                );
            }
        }
        offset += k * width;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::matmul;

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len).map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 - 1001.0) / 997.0).collect()
    }

    fn close(got: &[f32], expected: &[f32]) -> bool {
        got.iter().zip(expected).all(|(g, e)| (g - e).abs() <= 1e-5 * (1.0 + e.abs()))
    }

    #[test]
    fn equals_the_unpacked_product() {
        // Bit for bit where k is a multiple of the SIMD width (the micro-kernel and its k order are
        // the crate's); for other shapes the crate may pick another path, so within 1e-5.
        for (m, k, n, exact) in [
            (1, 1, 1, false),
            (5, 7, 3, false),
            (64, 96, 130, true),
            (100, 64, 64, true),
            (130, 256, 192, true),
            (49, 33, 200, false),
            (3, 0, 5, true),
        ] {
            let a = values(m * k, 1);
            let b = values(k * n, 2);
            let b_t: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
            for src in [MatRef::row_major(&b, k, n).unwrap(), MatRef::row_major(&b_t, n, k).unwrap().t()] {
                let mut packed = vec![0.0; packed_len(k, n)];
                pack_rhs(src, &mut packed).unwrap();
                let lhs = MatRef::row_major(&a, m, k).unwrap();
                for accumulate in [false, true] {
                    let mut expected = values(m * n, 3);
                    let mut got = expected.clone();
                    matmul(&mut expected, lhs, MatRef::row_major(&b, k, n).unwrap(), accumulate).unwrap();
                    matmul_packed(&mut got, lhs, &packed, k, n, accumulate).unwrap();
                    let same = if exact { got == expected } else { close(&got, &expected) };
                    assert!(same, "{m}x{k}x{n} accumulate={accumulate}");
                }
                let mut uninit = vec![MaybeUninit::uninit(); m * n];
                let got = matmul_packed_uninit(&mut uninit, lhs, &packed, k, n).unwrap().to_vec();
                let mut expected = vec![0.0; m * n];
                matmul(&mut expected, lhs, MatRef::row_major(&b, k, n).unwrap(), false).unwrap();
                let same = if exact { got == expected } else { close(&got, &expected) };
                assert!(same, "{m}x{k}x{n} uninit");
            }
        }
    }

    #[test]
    fn rejects_mismatched_shapes() {
        let a = values(6, 1);
        let lhs = MatRef::row_major(&a, 2, 3).unwrap();
        let packed = vec![0.0; 12];
        assert!(matmul_packed(&mut [0.0; 8], lhs, &packed, 3, 4, false).is_ok());
        assert!(matmul_packed(&mut [0.0; 8], lhs, &packed, 4, 3, false).is_err());
        assert!(matmul_packed(&mut [0.0; 7], lhs, &packed, 3, 4, false).is_err());
        assert!(matmul_packed(&mut [0.0; 8], lhs, &packed[..11], 3, 4, false).is_err());
        assert!(pack_rhs(MatRef::row_major(&packed, 3, 4).unwrap(), &mut [0.0; 11]).is_err());
    }
}
