//! Right-hand operands packed once for products that reuse the same matrix many times (a Linear
//! layer's weight within a step, the weight cache): `pack_rhs` lays `B` (`k x n`) out as
//! [`super::rows_gemm`]'s strips (`ceil(n / w)` strips of `k x w` columns, contiguous, `w` two
//! vectors of this CPU's widest ISA, zero past column `n`), and `matmul_packed` multiplies by it.
//!
//! The shapes [`super::rows_gemm::suits`] (a Linear's at micro-batch sizes) read the strips in
//! place: the product copies nothing of the weight, where the unpacked one packs the whole weight
//! into the same strips on every call. The bits are those of [`super::matmul`] (the same kernel
//! and order). Other shapes go to the `gemm` crate, which reads each strip in place as a panel of
//! `w` columns; there the bits equal `matmul`'s for depths that are a multiple of the SIMD width
//! and at most 512 (the crate's depth block), and agree within f32 rounding otherwise. A Linear
//! takes its cache only for the shapes our kernel takes, so its results never depend on it.
use std::mem::MaybeUninit;

use gemm::Parallelism;

use super::MatRef;
use super::rows_gemm::{Rhs, pack_strips, strip_width, strips_len, suits};
use crate::{Error, Result};

/// Elements a packed `k x n` operand takes: `k` rows of `n` rounded up to the strip width.
pub fn packed_len(k: usize, n: usize) -> usize {
    strips_len(k, n)
}

/// Packs `src` (`k x n`, any strides) into `dst` ([`packed_len`] elements) as strips.
pub fn pack_rhs(src: MatRef<'_>, dst: &mut [f32]) -> Result<()> {
    if dst.len() != packed_len(src.rows(), src.cols()) {
        return Err(Error::shape(
            "pack_rhs",
            format!("{} elements for {}x{}", packed_len(src.rows(), src.cols()), src.rows(), src.cols()),
            dst.len().to_string(),
        ));
    }
    pack_strips(src, dst)
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

/// Rows of the left operand per `gemm` crate call: at most `8 x NR` (NR = 6), under which the
/// crate reads a strip in place instead of repacking it.
const ROW_CHUNK: usize = 48;

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
    let strip = strip_width();
    if suits(m, k, n) {
        // SAFETY: dst valid for m x n (checked by the caller); the strips hold `packed_len(k, n)`.
        unsafe { super::rows_gemm::product(dst, lhs, Rhs::Strips { data: packed, width: strip }, n, accumulate) };
        return;
    }
    for (s, col0) in (0..n).step_by(strip).enumerate() {
        let width = strip.min(n - col0);
        let panel = &packed[s * k * strip..(s + 1) * k * strip];
        for row0 in (0..m).step_by(ROW_CHUNK) {
            let rows = ROW_CHUNK.min(m - row0);
            // SAFETY: the block dst[row0.., col0..col0 + width] with row stride n lies inside the
            // m x n dst; the lhs rows row0..row0 + rows lie inside the checked view; the strip
            // holds k rows of `strip` elements, of which the first `width` are read.
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
                    strip as isize,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    Parallelism::None,
                );
            }
        }
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
        // Bit for bit where our kernel takes the shape (the same kernel reads the strips), and
        // where the crate does with a depth that is a multiple of the SIMD width and at most its
        // depth block (the micro-kernel and its k order are the crate's); within 1e-5 otherwise.
        for (m, k, n, exact) in [
            (1, 1, 1, false),
            (5, 7, 3, false),
            (64, 96, 130, true),
            (100, 64, 64, true),
            (130, 256, 192, true),
            (49, 33, 200, false),
            (3, 0, 5, true),
            (37, 512, 100, true),
            (40, 1024, 1024, true),
            (300, 1024, 96, false),
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
        let packed = vec![0.0; packed_len(3, 4)];
        assert!(matmul_packed(&mut [0.0; 8], lhs, &packed, 3, 4, false).is_ok());
        assert!(matmul_packed(&mut [0.0; 8], lhs, &packed, 4, 3, false).is_err());
        assert!(matmul_packed(&mut [0.0; 7], lhs, &packed, 3, 4, false).is_err());
        assert!(matmul_packed(&mut [0.0; 8], lhs, &packed[..packed.len() - 1], 3, 4, false).is_err());
        let b = values(12, 2);
        assert!(pack_rhs(MatRef::row_major(&b, 3, 4).unwrap(), &mut [0.0; 11]).is_err());
    }
}
