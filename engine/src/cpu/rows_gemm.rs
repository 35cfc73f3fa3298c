//! Our own matrix product for the shapes of a Linear layer at micro-batch sizes: few left rows
//! against a deep weight (`x · Wᵀ`, `dy · W`), or a shallow depth with a wide output (the weight
//! gradient `dyᵀ · x`). [`suits`] says which shapes take it, [`product`] runs it; `cpu::matmul`
//! and `cpu::packed::matmul_packed` both route those shapes here, so a product's bits are the
//! same with the weight cache or without.
//!
//! Every output element is one chain of fused multiply-adds over the depth in order, from zero,
//! then added to the destination when accumulating (`dst + Σ`, the sum made whole first): the
//! bits depend neither on the ISA (AVX-512, AVX2 + FMA or scalar, chosen at run time through
//! [`super::vecmath::dispatch_on`]) nor on the tiling, the row count or the operands' layouts. A
//! weight gradient summed over micro-batches is so `g + P` per micro-batch, as `cpu::matmul`
//! promises for the `gemm` crate's path.
//!
//! Blocking (BLIS's, without a depth block): the left operand is packed once into row blocks of
//! `R` rows interleaved by depth (6 on AVX2, 8 on AVX-512); the right one is copied into strips
//! of `2 x lanes` columns (`depth x 16` floats on AVX2, contiguous), from a row-major weight or a
//! transposed one (8x8 register transposes). Few rows: 64 columns are packed at a time and each
//! strip is then run by every row block while it is in L2. Shallow: the whole right operand is
//! packed first, then each row block runs over every strip, so the destination streams in order.
//! One `R x 2·lanes` tile of accumulators lives in registers over the whole depth (12 of AVX2's
//! 16), so each output element is read and written once.
//!
//! A weight used by several products between two updates (a Linear's, once per micro-batch) can
//! be packed into those strips once ([`pack_strips`], the weight cache of `cpu::packed`): the
//! products then read the strips in place and copy nothing.
use std::cell::Cell;

use super::MatRef;
use super::vecmath::{Isa, Job, Lanes, dispatch_on};

/// Whether [`product`] takes an `m x k` by `k x n` product: few rows against a depth a strip
/// keeps in L2 (`x · Wᵀ` and `dy · W` from 1 to 256 rows), or a shallow depth with a wide output
/// (the weight gradient from 1 to 256 rows). Shapes only, so every device picks the same kernel.
pub fn suits(m: usize, k: usize, n: usize) -> bool {
    let few_rows = m <= 256 && (256..=4096).contains(&k) && n >= 64;
    let shallow = k <= 256 && m >= 256 && n >= 256;
    m > 0 && n > 0 && k > 0 && (few_rows || shallow)
}

/// The right operand.
#[derive(Clone, Copy, Debug)]
pub enum Rhs<'a> {
    /// `b[p][j] = data[p·row_stride + j·col_stride]`.
    Strided(MatRef<'a>),
    /// [`pack_strips`]'s strips of a `k x n` operand.
    Strips {
        /// The strips, one after another.
        data: &'a [f32],
        /// Columns per strip: [`strip_width`] of the ISA that packed them, which the product
        /// then runs on.
        width: usize,
    },
}

/// Columns per strip on this CPU: two vectors of its widest ISA (32 with AVX-512, 16 with AVX2,
/// 8 with NEON, 2 without SIMD).
pub fn strip_width() -> usize {
    2 * Isa::detect().lanes()
}

/// Elements of [`pack_strips`]'s layout of a `k x n` operand: `ceil(n / w)` strips of `k x w`,
/// `w` = [`strip_width`] (zero past column `n`).
pub fn strips_len(k: usize, n: usize) -> usize {
    let width = strip_width();
    k * n.div_ceil(width) * width
}

/// Packs `src` (`k x n`, any strides) into `dst` ([`strips_len`] elements) as the strips
/// [`product`] reads: strip `s` holds columns `s·w..(s + 1)·w` as `k` rows of `w`, contiguous,
/// zero past column `n`.
pub fn pack_strips(src: MatRef<'_>, dst: &mut [f32]) -> crate::Result<()> {
    let (k, n) = (src.rows(), src.cols());
    if dst.len() != strips_len(k, n) {
        return Err(crate::Error::shape(
            "pack_strips",
            format!("{} elements for {k}x{n}", strips_len(k, n)),
            dst.len().to_string(),
        ));
    }
    if k > 0 && n > 0 {
        dispatch_on(Isa::detect(), PackStrips { src, dst });
    }
    Ok(())
}

struct PackStrips<'a, 'b> {
    src: MatRef<'a>,
    dst: &'b mut [f32],
}

impl Job for PackStrips<'_, '_> {
    type Output = ();

    #[inline(always)]
    fn run<V: Lanes>(self) {
        let PackStrips { src, dst } = self;
        pack_all::<V>(src, dst);
    }
}

/// Packs the whole `k x n` operand `view` into `out` as consecutive strips of `2·V::N` columns,
/// one [`GROUP`] of columns at a time.
fn pack_all<V: Lanes>(view: MatRef<'_>, out: &mut [f32]) {
    let (k, n) = (view.rows(), view.cols());
    let strip_len = k * 2 * V::N;
    for g0 in (0..n).step_by(GROUP) {
        let end = (g0 + GROUP).min(n).div_ceil(2 * V::N) * strip_len;
        pack_group::<V>(view, k, n, g0, &mut out[g0 / (2 * V::N) * strip_len..end]);
    }
}

/// `dst = lhs · rhs`, or `dst += lhs · rhs` (the product made whole, then added) when
/// `accumulate`; `dst` row-major `lhs.rows() x n`, `k = lhs.cols()`.
///
/// # Safety
/// `dst` must be valid for writes of `lhs.rows() x n` elements (and initialised when
/// `accumulate`); `rhs` must cover `k x n` elements (a `Strided` view `k` rows by `n` columns, or
/// [`strips_len`]`(k, n)` elements of strips). Without `accumulate` every element is written and
/// none read.
pub(crate) unsafe fn product(dst: *mut f32, lhs: MatRef<'_>, rhs: Rhs<'_>, n: usize, accumulate: bool) {
    // SAFETY: as the caller guarantees.
    unsafe { product_on(Isa::detect(), dst, lhs, rhs, n, accumulate) }
}

/// [`product`] on `isa` (which must be [`Isa::available`], else the scalar path runs): the same
/// bits on every ISA.
///
/// # Safety
/// As for [`product`].
unsafe fn product_on(isa: Isa, dst: *mut f32, lhs: MatRef<'_>, rhs: Rhs<'_>, n: usize, accumulate: bool) {
    let (m, k) = (lhs.rows(), lhs.cols());
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for i in 0..m * n {
            // SAFETY: `dst` is valid for `m x n` writes (and reads when accumulating).
            unsafe { dst.add(i).write(if accumulate { dst.add(i).read() } else { 0.0 }) };
        }
        return;
    }
    // Strips are read with the strip width they were packed for: on the ISA that packed them.
    let isa = match rhs {
        Rhs::Strips { width, .. } if 2 * isa.lanes() != width => {
            Isa::ALL.into_iter().find(|i| i.available() && 2 * i.lanes() == width).unwrap_or(isa)
        }
        _ => isa,
    };
    dispatch_on(isa, Product { dst, lhs, rhs, m, n, k, accumulate });
}

/// Buffers reused across calls on a thread: the packed left operand and right-operand strips.
struct Scratch {
    lhs: Vec<f32>,
    strips: Vec<f32>,
}

thread_local! {
    static SCRATCH: Cell<Option<Scratch>> = const { Cell::new(None) };
}

struct Product<'a> {
    dst: *mut f32,
    lhs: MatRef<'a>,
    rhs: Rhs<'a>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
}

impl Job for Product<'_> {
    type Output = ();

    #[inline(always)]
    fn run<V: Lanes>(self) {
        let Product { dst, lhs, rhs, m, n, k, accumulate } = self;
        let nr = 2 * V::N;
        let blocks = row_blocks::<V>(m);
        let mut scratch = SCRATCH.take().unwrap_or(Scratch { lhs: Vec::new(), strips: Vec::new() });
        grow(&mut scratch.lhs, m * k);
        pack_lhs(lhs, &blocks, &mut scratch.lhs[..m * k]);
        let packed_lhs = &scratch.lhs[..m * k];
        let dims = Dims { dst, n, k, accumulate };
        let strip_len = k * nr;
        match rhs {
            Rhs::Strips { data, width } => {
                // Packed once for many products: each strip read in place by every row block.
                // (`product_on` runs strips on the ISA that packed them; `packed::check` sized them.)
                assert!(width == nr && data.len() >= n.div_ceil(nr) * strip_len, "strips packed for this ISA");
                for (s, strip) in data.chunks_exact(strip_len).take(n.div_ceil(nr)).enumerate() {
                    for &block in &blocks {
                        run_tile::<V>(&dims, block, packed_lhs, (strip, nr), s * nr);
                    }
                }
            }
            Rhs::Strided(rhs) if k * n <= SHALLOW_RHS => {
                // A shallow product (the weight gradient): the whole right operand packed (at
                // most 1 MiB), then row block by row block, so the destination's rows stream in
                // order.
                let strips = n.div_ceil(nr);
                grow(&mut scratch.strips, strips * strip_len);
                pack_all::<V>(rhs, &mut scratch.strips[..strips * strip_len]);
                for &block in &blocks {
                    for (s, strip) in scratch.strips[..strips * strip_len].chunks_exact(strip_len).enumerate() {
                        run_tile::<V>(&dims, block, packed_lhs, (strip, nr), s * nr);
                    }
                }
            }
            Rhs::Strided(rhs) => {
                // Few rows against a deep operand: `GROUP` columns packed at a time (at most 1 MiB
                // for a depth of 4096), each strip then run by every row block while it is in L2.
                // (Depth blocks of 256 steps, so that a strip's block stays in L1 with the sums
                // passed on through memory, measured 5% slower at 1024x1024.)
                grow(&mut scratch.strips, GROUP.div_ceil(nr) * strip_len);
                for g0 in (0..n).step_by(GROUP) {
                    let width = GROUP.min(n - g0);
                    let group = &mut scratch.strips[..width.div_ceil(nr) * strip_len];
                    pack_group::<V>(rhs, k, n, g0, group);
                    for (s, strip) in group.chunks_exact(strip_len).enumerate() {
                        for &block in &blocks {
                            run_tile::<V>(&dims, block, packed_lhs, (strip, nr), g0 + s * nr);
                        }
                    }
                }
            }
        }
        SCRATCH.set(Some(scratch));
    }
}

/// What every tile of one product shares.
#[derive(Clone, Copy)]
struct Dims {
    dst: *mut f32,
    n: usize,
    k: usize,
    accumulate: bool,
}

/// Runs the row block `(r0, rows)` over one strip (`k x 2·V::N`, rows `ldb` apart; columns
/// `j0..`).
#[inline(always)]
fn run_tile<V: Lanes>(
    dims: &Dims,
    (r0, rows): (usize, usize),
    packed_lhs: &[f32],
    (strip, ldb): (&[f32], usize),
    j0: usize,
) {
    let Dims { dst, n, k, accumulate } = *dims;
    let nr = 2 * V::N;
    let a = &packed_lhs[r0 * k..(r0 + rows) * k];
    let b = &strip[..(k - 1) * ldb + nr];
    let width = nr.min(n - j0);
    // SAFETY: `a` holds `rows x k` packed elements, `b` `k x nr`; rows `r0..r0 + rows` and
    // columns `j0..j0 + width` of the `m x n` dst are inside it ([`product`]'s contract; the
    // blocks and strips cover `m x n`).
    unsafe {
        let c = dst.add(r0 * n + j0);
        match rows {
            8 => tile8::<V>(a, (b, ldb), c, n, width, accumulate),
            6 => tile6::<V>(a, (b, ldb), c, n, width, accumulate),
            4 => tile4::<V>(a, (b, ldb), c, n, width, accumulate),
            _ => tile1::<V>(a, (b, ldb), c, n, width, accumulate),
        }
    }
}

/// Columns of the right operand packed into strips at a time: a group's strips stay in L2 while
/// every row block runs over them.
const GROUP: usize = 64;

/// Largest right operand (`k x n` elements, 1 MiB) packed whole, row blocks outside: a shallow
/// product.
const SHALLOW_RHS: usize = 1 << 18;

fn grow(buffer: &mut Vec<f32>, len: usize) {
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
}

/// `(first row, rows)` of each row block: 8 rows where the ISA has 32 registers; with 16 (AVX2)
/// 6 rows (12 accumulators) while at least 10 or exactly 6 remain, then 4; single rows last.
fn row_blocks<V: Lanes>(m: usize) -> Vec<(usize, usize)> {
    let mut blocks = Vec::with_capacity(m / 4 + 4);
    let mut r = 0;
    if V::N >= 16 {
        while r + 8 <= m {
            blocks.push((r, 8));
            r += 8;
        }
    } else if V::N > 1 {
        while m - r >= 10 || m - r == 6 {
            blocks.push((r, 6));
            r += 6;
        }
    }
    while r + 4 <= m {
        blocks.push((r, 4));
        r += 4;
    }
    while r < m {
        blocks.push((r, 1));
        r += 1;
    }
    blocks
}

/// Lays each row block of `lhs` out depth-major: block `(r0, rows)` at `r0·k`, element `(r, p)`
/// at `p·rows + r`, so a tile reads its `rows` values of one depth step together.
fn pack_lhs(lhs: MatRef<'_>, blocks: &[(usize, usize)], out: &mut [f32]) {
    let (k, data) = (lhs.cols(), lhs.data());
    let (rs, cs) = lhs.strides();
    for &(r0, rows) in blocks {
        let block = &mut out[r0 * k..(r0 + rows) * k];
        if rs == 1 {
            // A transposed view (the weight gradient's `dyᵀ`): a block's column is contiguous.
            for (p, dst) in block.chunks_exact_mut(rows).enumerate() {
                dst.copy_from_slice(&data[p * cs + r0..p * cs + r0 + rows]);
            }
        } else {
            for r in 0..rows {
                let row = (r0 + r) * rs;
                for (p, dst) in block.iter_mut().skip(r).step_by(rows).enumerate() {
                    *dst = data[row + p * cs];
                }
            }
        }
    }
}

/// Packs columns `g0..g0 + width` of the `k x n` right operand (`width = min(GROUP, n - g0)`,
/// `g0` a multiple of `GROUP`) into `out` as strips of `2·V::N` columns, each `k x 2·V::N`
/// row-major, one after another; zero past `width`. One pass over the source rows, so each row's
/// `width` columns are read together (a row-major weight's rows are 4 KiB apart: one page each).
fn pack_group<V: Lanes>(view: MatRef<'_>, k: usize, n: usize, g0: usize, out: &mut [f32]) {
    let nr = 2 * V::N;
    let width = GROUP.min(n - g0);
    let (rs, cs) = view.strides();
    let (data, start) = (view.data(), g0 * cs);
    if !width.is_multiple_of(nr) {
        out.fill(0.0);
    }
    if cs == 1 {
        let prefetching = rs >= 256;
        for p in 0..k {
            // Rows a page apart (a row-major weight) defeat the hardware prefetcher, which stays
            // within a page: ask for the row `AHEAD` steps on (`dy · W` unpacked at 1024x1024,
            // 1.1-1.2x faster from 16 to 64 rows).
            if prefetching && p + AHEAD < k {
                let ahead = start + (p + AHEAD) * rs;
                (0..width).step_by(16).for_each(|j| prefetch(&data[ahead + j]));
            }
            let row = &data[start + p * rs..start + p * rs + width];
            for (s, chunk) in row.chunks(nr).enumerate() {
                out[(s * k + p) * nr..][..chunk.len()].copy_from_slice(chunk);
            }
        }
    } else if rs == 1 {
        // A transposed view (`Wᵀ` of a `[out, in]` weight): a strip is the transpose of `nr`
        // rows of the weight, each `k` contiguous.
        for (s, strip) in out.chunks_exact_mut(k * nr).enumerate() {
            let rows = nr.min(width - s * nr);
            let first = start + s * nr * cs;
            let src = &data[first..first + (rows - 1) * cs + k];
            super::transpose::transpose_strided(src, cs, (rows, k), strip, nr).expect("inside both buffers");
        }
    } else {
        for (j, column) in (0..width).map(|j| start + j * cs).enumerate() {
            let (s, lane) = (j / nr, j % nr);
            for p in 0..k {
                out[(s * k + p) * nr + lane] = data[column + p * rs];
            }
        }
    }
}

/// Rows of the right operand [`pack_group`] prefetches ahead.
const AHEAD: usize = 48;

/// A hint to bring `value`'s cache line into L1 (no effect on results).
#[inline(always)]
fn prefetch(value: &f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch of a valid address (SSE, part of x86-64) reads nothing architecturally.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(value).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

/// One `R x 2·V::N` tile over `k = a.len() / R` depth steps: `c[r·ldc + j] (+)= Σ_p
/// a[p·R + r] · b[p·ldb + j]` for `j < width`, the sum one chain of fused multiply-adds from
/// zero in `p` order, added to `c` last. `$tile` names the function, `$row` the rows with their
/// two accumulators, written out so that LLVM keeps them in registers (an array of accumulators
/// indexed in a loop compiled to spills and a rotation of register moves every depth step).
///
/// # Safety (of the functions made)
/// `c` is writable (and readable when `accumulate`) at `r·ldc + j` for `r < R`, `j < width ≤
/// 2·V::N`.
macro_rules! tile {
    ($tile:ident, $rows:literal, $(($row:literal, $lo:ident, $hi:ident)),+) => {
        #[inline(always)]
        unsafe fn $tile<V: Lanes>(
            a: &[f32],
            (b, ldb): (&[f32], usize),
            c: *mut f32,
            ldc: usize,
            width: usize,
            accumulate: bool,
        ) {
            let k = a.len() / $rows;
            assert!(k > 0 && a.len() == k * $rows && b.len() >= (k - 1) * ldb + 2 * V::N);
            $(let (mut $lo, mut $hi) = (V::splat(0.0), V::splat(0.0));)+
            // SAFETY: every read is inside `a` (k·R elements) or `b` (k rows of 2·V::N, ldb
            // apart); `c` as the caller guarantees.
            unsafe {
                let mut a_step = a.as_ptr();
                let mut b_row = b.as_ptr();
                for _ in 0..k {
                    let b0 = V::load(b_row);
                    let b1 = V::load(b_row.add(V::N));
                    $(
                        let av = V::splat(*a_step.add($row));
                        $lo = av.fma(b0, $lo);
                        $hi = av.fma(b1, $hi);
                    )+
                    a_step = a_step.add($rows);
                    b_row = b_row.add(ldb);
                }
                store::<V, $rows>([$([$lo, $hi]),+], c, ldc, width, accumulate);
            }
        }
    };
}

tile!(
    tile8,
    8,
    (0, c00, c01),
    (1, c10, c11),
    (2, c20, c21),
    (3, c30, c31),
    (4, c40, c41),
    (5, c50, c51),
    (6, c60, c61),
    (7, c70, c71)
);
tile!(tile6, 6, (0, c00, c01), (1, c10, c11), (2, c20, c21), (3, c30, c31), (4, c40, c41), (5, c50, c51));
tile!(tile4, 4, (0, c00, c01), (1, c10, c11), (2, c20, c21), (3, c30, c31));
tile!(tile1, 1, (0, c00, c01));

/// Writes (or adds, `c + sum`) a tile's `R x width` sums to `c`.
///
/// # Safety
/// `c` is writable (and readable when `accumulate`) at `r·ldc + j` for `r < R`, `j < width ≤
/// 2·V::N`.
#[inline(always)]
unsafe fn store<V: Lanes, const R: usize>(acc: [[V; 2]; R], c: *mut f32, ldc: usize, width: usize, accumulate: bool) {
    // SAFETY: inside `c`'s `R x width` block, as the caller guarantees.
    unsafe {
        if width == 2 * V::N {
            for (r, row) in acc.iter().enumerate() {
                for (v, &x) in row.iter().enumerate() {
                    let out = c.add(r * ldc + v * V::N);
                    let x = if accumulate { V::load(out).add(x) } else { x };
                    x.store(out);
                }
            }
            return;
        }
        let mut spill = [0.0f32; 64];
        for (r, row) in acc.iter().enumerate() {
            row[0].store(spill.as_mut_ptr());
            row[1].store(spill.as_mut_ptr().add(V::N));
            for (j, &x) in spill.iter().enumerate().take(width) {
                let out = c.add(r * ldc + j);
                out.write(if accumulate { out.read() + x } else { x });
            }
        }
    }
}

#[cfg(test)]
#[path = "rows_gemm_tests.rs"]
mod tests;
