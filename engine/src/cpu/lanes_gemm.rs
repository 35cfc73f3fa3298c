//! A small matrix product with its output columns in SIMD lanes, for kernels that run inside one
//! dispatched [`super::vecmath::Job`] (fused attention, small convolutions): no packing, no
//! allocation, each output element one chain of fused multiply-adds in `k` order, so the bits
//! depend neither on the ISA nor on how the columns are tiled.
//!
//! The right operand's rows are either evenly spaced ([`gemm`]) or given by a table of row
//! pointers ([`gemm_indirect`], the indirect GEMM of XNNPACK and Dukhan, arXiv 1907.02129: a
//! convolution's rows are shifted views of its input, so no im2col matrix is built); the left
//! operand's rows can come from such a table too ([`gemm_indirect_a`]: a weight gradient's im2col
//! read from shifted views).
use super::vecmath::Lanes;

/// Where row `p` of the right operand starts (its columns are contiguous from there).
trait Rows: Copy {
    /// # Safety
    /// `p` must be a row of the operand.
    unsafe fn row(self, p: usize) -> *const f32;
    /// The rows from `p` on.
    ///
    /// # Safety
    /// `p` must be at most the operand's row count.
    unsafe fn skip(self, p: usize) -> Self;
}

/// Rows `ld` elements apart.
#[derive(Clone, Copy)]
struct Strided {
    base: *const f32,
    ld: usize,
}

impl Rows for Strided {
    #[inline(always)]
    unsafe fn row(self, p: usize) -> *const f32 {
        // SAFETY: the caller keeps `p` inside the operand.
        unsafe { self.base.add(p * self.ld) }
    }
    #[inline(always)]
    unsafe fn skip(self, p: usize) -> Self {
        // SAFETY: the caller keeps `p` inside the operand.
        Strided { base: unsafe { self.base.add(p * self.ld) }, ld: self.ld }
    }
}

/// Rows at the offsets of a table from one base.
#[derive(Clone, Copy)]
struct Indirect {
    base: *const f32,
    offsets: *const usize,
}

impl Rows for Indirect {
    #[inline(always)]
    unsafe fn row(self, p: usize) -> *const f32 {
        // SAFETY: the caller keeps `p` inside the table, whose offsets are inside the operand.
        unsafe { self.base.add(*self.offsets.add(p)) }
    }
    #[inline(always)]
    unsafe fn skip(self, p: usize) -> Self {
        // SAFETY: the caller keeps `p` inside the table.
        Indirect { base: self.base, offsets: unsafe { self.offsets.add(p) } }
    }
}

/// `c[r·ldc + col] (+)= Σ_p a[r·lda + p] · b[p·ldb + col]` for `r < m`, `col < n`: the sum over
/// `p < k` in order, one fused multiply-add per term, from `c` (`accumulate`) or from zero.
/// Columns run in lanes, so every element is its own chain: the bits depend neither on the ISA
/// nor on the tiling. `n` must be a multiple of `V::N`.
///
/// # Safety
/// `a` must be readable at `r·lda + p`, `b` at `p·ldb + col`, `c` readable and writable at
/// `r·ldc + col`, for every `r < m`, `p < k`, `col < n`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm<V: Lanes>(
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    // SAFETY: as the caller guarantees.
    unsafe {
        let (a, b) = (Strided { base: a, ld: lda }, Strided { base: b, ld: ldb });
        gemm_rows_of::<V, _, _>(m, n, k, a, b, c, ldc, accumulate)
    }
}

/// [`gemm`] with row `p` of `b` at `b + offsets[p]`: the same sums, in the same order.
///
/// # Safety
/// `offsets` must hold `k` entries; `a` must be readable at `r·lda + p`, `b` at
/// `offsets[p] + col`, `c` readable and writable at `r·ldc + col`, for every `r < m`, `p < k`,
/// `col < n`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_indirect<V: Lanes>(
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    offsets: &[usize],
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    debug_assert!(offsets.len() >= k);
    let rows = Indirect { base: b, offsets: offsets.as_ptr() };
    // SAFETY: as the caller guarantees.
    unsafe { gemm_rows_of::<V, _, _>(m, n, k, Strided { base: a, ld: lda }, rows, c, ldc, accumulate) }
}

/// [`gemm`] with row `r` of `a` at `a + a_offsets[r]` (its `k` elements contiguous from there):
/// the same sums, in the same order.
///
/// # Safety
/// `a_offsets` must hold `m` entries; `a` must be readable at `a_offsets[r] + p`, `b` at
/// `p·ldb + col`, `c` readable and writable at `r·ldc + col`, for every `r < m`, `p < k`,
/// `col < n`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_indirect_a<V: Lanes>(
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    a_offsets: &[usize],
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    debug_assert!(a_offsets.len() >= m);
    let rows = Indirect { base: a, offsets: a_offsets.as_ptr() };
    // SAFETY: as the caller guarantees.
    unsafe { gemm_rows_of::<V, _, _>(m, n, k, rows, Strided { base: b, ld: ldb }, c, ldc, accumulate) }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_rows_of<V: Lanes, A: Rows, B: Rows>(
    m: usize,
    n: usize,
    k: usize,
    a: A,
    b: B,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    debug_assert!(n.is_multiple_of(V::N));
    let mut r = 0;
    // SAFETY (all calls): rows r..r+R < m of a and c, columns < n, as the caller guarantees.
    // (Row blocks outside, column tiles inside: the other order measured 1.3x slower.)
    unsafe {
        // 8 rows where the ISA has 32 registers (16 accumulators at most). With 16 registers
        // (AVX2), 6 rows (12 accumulators, 2 loads and 6 broadcasts per 12 multiply-adds; 4 rows
        // measured up to 1.1x slower) while at least 10 rows or exactly 6 remain; then 4.
        if V::N >= 16 {
            while r + 8 <= m {
                gemm_rows::<V, A, B, 8>(n, k, a.skip(r), b, c.add(r * ldc), ldc, accumulate);
                r += 8;
            }
        } else if V::N > 1 {
            while m - r >= 10 || m - r == 6 {
                gemm_rows::<V, A, B, 6>(n, k, a.skip(r), b, c.add(r * ldc), ldc, accumulate);
                r += 6;
            }
        }
        while r + 4 <= m {
            gemm_rows::<V, A, B, 4>(n, k, a.skip(r), b, c.add(r * ldc), ldc, accumulate);
            r += 4;
        }
        while r < m {
            gemm_rows::<V, A, B, 1>(n, k, a.skip(r), b, c.add(r * ldc), ldc, accumulate);
            r += 1;
        }
    }
}

/// [`gemm`] for `R` rows, columns in tiles of two registers, then one.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_rows<V: Lanes, A: Rows, B: Rows, const R: usize>(
    n: usize,
    k: usize,
    a: A,
    b: B,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    let mut col = 0;
    // SAFETY: columns col..col + C·V::N ≤ n, as the caller guarantees for [`gemm`].
    unsafe {
        while col + 2 * V::N <= n {
            tile::<V, A, B, R, 2>(k, a, b, col, c.add(col), ldc, accumulate);
            col += 2 * V::N;
        }
        while col < n {
            tile::<V, A, B, R, 1>(k, a, b, col, c.add(col), ldc, accumulate);
            col += V::N;
        }
    }
}

/// One `R × C·V::N` output tile (columns from `col` of `b`) held in registers over the whole `k`
/// loop.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<V: Lanes, A: Rows, B: Rows, const R: usize, const C: usize>(
    k: usize,
    a: A,
    b: B,
    col: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    // SAFETY: every address is inside the tile the caller guarantees.
    unsafe {
        let a_rows: [*const f32; R] = std::array::from_fn(|r| a.row(r));
        let mut acc = [[V::splat(0.0); C]; R];
        if accumulate {
            for (r, row) in acc.iter_mut().enumerate() {
                for (v, x) in row.iter_mut().enumerate() {
                    *x = V::load(c.add(r * ldc + v * V::N));
                }
            }
        }
        for p in 0..k {
            let b_row = b.row(p).add(col);
            let bv: [V; C] = std::array::from_fn(|v| V::load(b_row.add(v * V::N)));
            for (r, row) in acc.iter_mut().enumerate() {
                let av = V::splat(*a_rows[r].add(p));
                for (x, &bv) in row.iter_mut().zip(&bv) {
                    *x = av.fma(bv, *x);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (v, x) in row.iter().enumerate() {
                x.store(c.add(r * ldc + v * V::N));
            }
        }
    }
}
