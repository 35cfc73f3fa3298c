//! The weight gradient of a 2-D convolution over a whole batch,
//! `dweight [out, in·kh·kw] += Σ_samples dy [out, P] · im2col(x)ᵀ [P, in·kh·kw]` (P = output pixels),
//! by a small-output kernel instead of one GEMM per sample.
//!
//! Why: the output is tiny (8x72 for the zoo's 8→8 3x3 convolution) and the reduction long (every
//! pixel of every sample), a shape general GEMMs handle badly (measured 20–29 GFLOP/s per sample,
//! 10 GFLOP/s on 32x32 planes where `colᵀ` is a strided operand). Here both operands are read along
//! their contiguous pixel axis: a chunk of samples gets its im2col and output gradient laid out as
//! rows over all of its pixels, then a tile of `dweight` is held in accumulators of 16 lanes (4x4
//! of one register each on AVX-512, 2x3 of two registers on AVX2) while the kernel streams those
//! rows, and each accumulator's lanes are summed in a fixed order and added to `dweight`. With
//! stride 1 on output planes of at least [`VIEWS_MIN_PLANE`] pixels (32x32), im2col is not built:
//! each sample's rows are read from its shifted views (`conv_lanes::ShiftedViews`, about `kw`
//! copies of the input instead of `kh·kw`) and its output gradient in place, in the same order, so
//! the bits are those of the im2col path.
//!
//! With at least 64 im2col rows and output channels in whole blocks of 16 (or of 8 on planes
//! below 32x32), `dweightᵀ` is formed instead by the lanes product (`TransposedJob`): output
//! channels in lanes, the output gradient transposed, no lane sums. For stride 1 the chunk's
//! samples sit side by side in shifted views read through a row table (the left operand's rows),
//! so no im2col is built there either.
//!
//! Determinism: lane `l` of an accumulator sums, with fused multiply-adds in order, the positions
//! `p ≡ l (mod 16)` of a chunk's pixels (its samples' pixels one after another; a last partial
//! block of 16 is zero-padded); the transposed path chains every pixel of the batch in order (per
//! chunk: output row, sample, output column for stride 1; sample, row, column otherwise). The
//! chunk size and the path depend only on the shapes. The same code is compiled for AVX-512, AVX2
//! and plain x86-64 (where `f32::mul_add` is a software FMA) and every lane rounds like the
//! scalar code, so the result does not depend on the CPU features found, nor on threads (there
//! are none).
use super::conv::Im2col;
use super::conv_lanes::ShiftedViews;
use super::lanes_gemm::{gemm, gemm_indirect_a};
use super::transpose::transpose_strided;
use super::vecmath::{Isa, Job, Lanes, dispatch, dispatch_on, sum_halves_in_place};
use super::window::{Window2d, check_len};
use crate::{Error, Result};

/// Lanes per accumulator (one AVX-512 vector of f32).
const LANES: usize = 16;
/// Rows (output channels) per tile.
const TILE_ROWS: usize = 4;
/// Columns (im2col rows) per tile.
const TILE_COLS: usize = 4;
/// Smallest output plane read through shifted views (below it a tile's per-sample setup costs
/// more than im2col saves: 8x8 planes measured 1.9x slower, 32x32 1.3-1.4x faster).
const VIEWS_MIN_PLANE: usize = 256;
/// Fewest im2col rows for the transposed path (`TransposedJob`): with fewer the transpose of the
/// output gradient costs more than the product saves (1->16 at 8x8, 9 rows: measured 1.7x slower;
/// 16->32, 144 rows: 1.25x faster).
const TRANSPOSED_MIN_ROWS: usize = 64;
/// Target size of one chunk's im2col, in floats (256 KiB: it stays in L2 while every tile reads it).
const CHUNK_FLOATS: usize = 64 * 1024;

/// `dweight += Σ_samples dy_s · im2col(x_s)ᵀ` for a batch `x` (`batch x window.input_len()`) and
/// output gradient `dy` (`batch x out_channels x out_plane`); `dweight` is
/// `out_channels x window.col_rows()`, row-major (PyTorch's `[out, in, kh, kw]`).
pub fn conv2d_weight_grad(
    x: &[f32],
    dy: &[f32],
    window: &Window2d,
    out_channels: usize,
    dweight: &mut [f32],
) -> Result<()> {
    let (col_rows, out_plane) = (window.col_rows(), window.out_plane_len());
    let input_len = window.input_len();
    if input_len == 0 || !x.len().is_multiple_of(input_len) {
        return Err(Error::shape(
            "conv2d_weight_grad",
            format!("a whole number of samples of {input_len} elements"),
            format!("{} elements", x.len()),
        ));
    }
    let batch = x.len() / input_len;
    check_len("conv2d_weight_grad", "dy", batch * out_channels * out_plane, dy.len())?;
    check_len("conv2d_weight_grad", "dweight", out_channels * col_rows, dweight.len())?;
    if batch == 0 || out_channels == 0 {
        return Ok(());
    }
    if transposed_fits(window, out_channels) {
        let job = TransposedJob { x, dy, window: *window, out_channels, batch, dweight };
        // Output channels in whole AVX2 registers but not AVX-512 ones run the AVX2 code there:
        // the bits are the same on every instruction set.
        let isa = match Isa::detect() {
            Isa::Avx512 if !out_channels.is_multiple_of(LANES) => Isa::Avx2,
            isa => isa,
        };
        return dispatch_on(isa, job);
    }
    let sample_col = col_rows * out_plane;
    let chunk = (CHUNK_FLOATS / sample_col).clamp(1, batch);
    let dy_sample = out_channels * out_plane;
    if ShiftedViews::fits(window) && out_plane.is_multiple_of(LANES) && out_plane >= VIEWS_MIN_PLANE {
        // Stride 1, planes of whole lane blocks: each sample's im2col rows are read from its
        // shifted views through their row table, and its output gradient in place. A tile
        // streams the chunk's samples one after another, as it streams one im2col row over the
        // chunk's pixels below: the same chunks and the same sums, term for term.
        let mut views: Vec<ShiftedViews> = (0..chunk).map(|_| ShiftedViews::new(window)).collect();
        for first in (0..batch).step_by(chunk) {
            let samples = chunk.min(batch - first);
            let x_chunk = &x[first * input_len..(first + samples) * input_len];
            for (v, x_sample) in views.iter_mut().zip(x_chunk.chunks_exact(input_len)) {
                v.fill(x_sample, window);
            }
            let a =
                Dense { data: &dy[first * dy_sample..(first + samples) * dy_sample], rows: out_channels, k: out_plane };
            let b = Views { views: &views[..samples], k: out_plane };
            let dims = Dims { samples, m: out_channels, n: col_rows, k: out_plane };
            accumulate_abt(dweight, a, b, dims);
        }
        return Ok(());
    }
    // A chunk's im2col is laid out `[col_rows, samples · out_plane]` (each sample's rows side by
    // side) and its output gradient `[out_channels, samples · out_plane]`, so every tile streams
    // rows of the whole chunk.
    let mut scratch = Im2col::new(window);
    let mut col = vec![0.0; chunk * sample_col];
    let mut dy_rows = vec![0.0; chunk * out_channels * out_plane];
    for first in (0..batch).step_by(chunk) {
        let samples = chunk.min(batch - first);
        let row_len = samples * out_plane;
        let x_chunk = &x[first * input_len..(first + samples) * input_len];
        for (s, x_sample) in x_chunk.chunks_exact(input_len).enumerate() {
            scratch.run_strided(x_sample, &mut col[s * out_plane..], row_len)?;
        }
        let dy_chunk = &dy[first * dy_sample..(first + samples) * dy_sample];
        for (s, dy_s) in dy_chunk.chunks_exact(dy_sample).enumerate() {
            for (o, src) in dy_s.chunks_exact(out_plane).enumerate() {
                dy_rows[o * row_len + s * out_plane..][..out_plane].copy_from_slice(src);
            }
        }
        let dims = Dims { samples: 1, m: out_channels, n: col_rows, k: row_len };
        let a = Dense { data: &dy_rows[..out_channels * row_len], rows: out_channels, k: row_len };
        let b = Dense { data: &col[..col_rows * row_len], rows: col_rows, k: row_len };
        accumulate_abt(dweight, a, b, dims);
    }
    Ok(())
}

/// Whether the weight gradient of `window` with `out_channels` filters takes the transposed path
/// (`TransposedJob`): at least [`TRANSPOSED_MIN_ROWS`] im2col rows, and output channels in whole
/// lane blocks of 16, or of 8 on planes below [`VIEWS_MIN_PLANE`] (8->8 at 32x32 measured 1.2x
/// slower there than the lane sums over shifted views; 8->8 at 8x8 1.2x faster, 16->32 at 32x32
/// 1.25x faster). It depends on the shapes alone, never on the instruction set.
fn transposed_fits(window: &Window2d, out_channels: usize) -> bool {
    let (col_rows, out_plane) = (window.col_rows(), window.out_plane_len());
    col_rows >= TRANSPOSED_MIN_ROWS
        && (out_channels.is_multiple_of(LANES) || (out_channels.is_multiple_of(8) && out_plane < VIEWS_MIN_PLANE))
}

/// Sizes of a batched `dst [m, n] += Σ_s A_s [m, k] · B_sᵀ [k, n]` (`A_s`, `B_s` row-major, the
/// samples one after another).
#[derive(Clone, Copy)]
struct Dims {
    samples: usize,
    m: usize,
    n: usize,
    k: usize,
}

/// `dweightᵀ [col_rows, out] += Σ_chunks im2col [col_rows, pixels] · dyᵀ [pixels, out]` by the
/// lanes product (`lanes_gemm`), the output channels in lanes, so a block of `dweightᵀ` (8 x 32 on
/// AVX-512, 6 x 16 on AVX2) stays in registers over a chunk's pixels and no lanes are summed
/// across. Each element is one chain of fused multiply-adds over the batch's pixels (from zero, in
/// the order of the module header), added to `dweight` at the end: the same bits on every
/// instruction set. `out` must be a multiple of the lanes of the instruction set it runs on.
struct TransposedJob<'a> {
    x: &'a [f32],
    dy: &'a [f32],
    window: Window2d,
    out_channels: usize,
    batch: usize,
    dweight: &'a mut [f32],
}

impl Job for TransposedJob<'_> {
    type Output = Result<()>;

    #[inline(always)]
    fn run<V: Lanes>(self) -> Result<()> {
        let TransposedJob { x, dy, window, out_channels: out, batch, dweight } = self;
        let (col_rows, plane, input_len) = (window.col_rows(), window.out_plane_len(), window.input_len());
        let out_w = window.out_width();
        if !out.is_multiple_of(V::N) {
            return Err(Error::invalid("conv2d_weight_grad", format!("{out} output channels in lanes of {}", V::N)));
        }
        let chunk = (CHUNK_FLOATS / (col_rows * plane)).clamp(1, batch);
        // Stride 1: the chunk's samples side by side in shifted views, read through a row table
        // (im2col's pixels in the order output row, sample, output column); otherwise the chunk's
        // im2col (pixels in the order sample, output row, output column).
        let views = ShiftedViews::fits(&window);
        let mut scratch = Im2col::new(&window);
        let mut col = if views { Vec::new() } else { vec![0.0; chunk * col_rows * plane] };
        let mut chunk_views = ShiftedViews::default();
        let mut dy_t = vec![0.0; chunk * plane * out];
        let mut acc_t = vec![0.0; col_rows * out];
        for first in (0..batch).step_by(chunk) {
            let samples = chunk.min(batch - first);
            let row_len = samples * plane;
            if views && chunk_views.samples != samples {
                chunk_views = ShiftedViews::interleaved(&window, samples);
            }
            // Pixel (sample s, output row i, column j) of the chunk is row
            // `s·sample_step + i·row_step + j` of `dy_t`.
            let (sample_step, row_step) = if views { (out_w, samples * out_w) } else { (plane, out_w) };
            for s in 0..samples {
                let x_s = &x[(first + s) * input_len..][..input_len];
                if views {
                    chunk_views.fill_sample(x_s, &window, s);
                } else {
                    scratch.run_strided(x_s, &mut col[s * plane..], row_len)?;
                }
                let dy_s = &dy[(first + s) * out * plane..][..out * plane];
                transpose_into(dy_s, out, out_w, &mut dy_t[s * sample_step * out..], row_step * out)?;
            }
            // SAFETY: the left operand holds `col_rows` rows of `row_len` pixels (the chunk's
            // im2col, `row_len` apart, or the views' rows from their table, each `out_h ·
            // samples · out_w = row_len` long inside `data`), `dy_t` `row_len` rows of `out` (a
            // multiple of 16, so of `V::N`), `acc_t` `col_rows x out`.
            unsafe {
                let (b, c) = (dy_t.as_ptr(), acc_t.as_mut_ptr());
                if views {
                    let a = chunk_views.data.as_ptr();
                    gemm_indirect_a::<V>(col_rows, out, row_len, a, &chunk_views.offsets, b, out, c, out, true);
                } else {
                    gemm::<V>(col_rows, out, row_len, col.as_ptr(), row_len, b, out, c, out, true);
                }
            }
        }
        for (o, dst) in dweight.chunks_exact_mut(col_rows).enumerate() {
            for (p, d) in dst.iter_mut().enumerate() {
                *d += acc_t[p * out + o];
            }
        }
        Ok(())
    }
}

/// `dst[i·row_stride + j·out + o] = src[o, i·out_w + j]`: one sample's output gradient
/// (`out x plane`, planes of rows `out_w` long) transposed into rows of `out` floats, its plane
/// rows `row_stride` floats apart.
#[inline(always)]
fn transpose_into(src: &[f32], out: usize, out_w: usize, dst: &mut [f32], row_stride: usize) -> Result<()> {
    let plane = src.len() / out;
    for i in 0..plane / out_w {
        transpose_strided(&src[i * out_w..], plane, (out, out_w), &mut dst[i * row_stride..], out)?;
    }
    Ok(())
}

/// Rows `r` of sample `s` of an operand, each `k` long.
trait Operand: Copy {
    fn row(&self, s: usize, r: usize) -> &[f32];
}

/// Samples of `rows x k`, row-major, one after another.
#[derive(Clone, Copy)]
struct Dense<'a> {
    data: &'a [f32],
    rows: usize,
    k: usize,
}

impl Operand for Dense<'_> {
    #[inline(always)]
    fn row(&self, s: usize, r: usize) -> &[f32] {
        &self.data[(s * self.rows + r) * self.k..][..self.k]
    }
}

/// Each sample's im2col rows as its shifted views' rows.
#[derive(Clone, Copy)]
struct Views<'a> {
    views: &'a [ShiftedViews],
    k: usize,
}

impl Operand for Views<'_> {
    #[inline(always)]
    fn row(&self, s: usize, r: usize) -> &[f32] {
        let view = &self.views[s];
        &view.data[view.offsets[r]..][..self.k]
    }
}

/// `dst [m, n] += Σ_s A_s · B_sᵀ` on the widest instruction set present; every one gives the same
/// bits (the tile shape below changes which elements share a pass, never an element's sums).
fn accumulate_abt<A: Operand, B: Operand>(dst: &mut [f32], a: A, b: B, dims: Dims) {
    dispatch(AbtJob { dst, a, b, dims });
}

/// The operands of one [`accumulate_abt`].
struct AbtJob<'d, A, B> {
    dst: &'d mut [f32],
    a: A,
    b: B,
    dims: Dims,
}

impl<A: Operand, B: Operand> Job for AbtJob<'_, A, B> {
    type Output = ();

    /// A tile's accumulators fill at most 16 of the ISA's registers: each holds [`LANES`] lanes,
    /// `LANES / V::N` registers. AVX-512 (32 registers): 4 x 4 accumulators of one register.
    /// AVX2 (16): 2 x 3 of two registers, 12 in all (a 4 x 4 tile of two-register accumulators
    /// spilled to the stack on every multiply-add: measured 2x slower). NEON (32) and the
    /// scalar path keep 2 x 2.
    #[inline(always)]
    fn run<V: Lanes>(self) {
        let AbtJob { dst, a, b, dims } = self;
        match V::N {
            16 => abt::<V, A, B, 1, TILE_ROWS, TILE_COLS>(dst, a, b, dims),
            8 => abt::<V, A, B, 2, 2, 3>(dst, a, b, dims),
            // NEON (32 registers of 4 lanes): 2 x 2 accumulators of four registers.
            4 => abt::<V, A, B, 4, 2, 2>(dst, a, b, dims),
            _ => abt::<V, A, B, LANES, 2, 2>(dst, a, b, dims),
        }
    }
}

/// [`accumulate_abt`] in `R x C` tiles of accumulators of `W` registers of `V` (`W · V::N` must
/// be [`LANES`]); edge tiles re-read their last row or column and drop those results.
#[inline(always)]
fn abt<V: Lanes, A: Operand, B: Operand, const W: usize, const R: usize, const C: usize>(
    dst: &mut [f32],
    a: A,
    b: B,
    dims: Dims,
) {
    assert_eq!(W * V::N, LANES, "an accumulator is LANES lanes");
    let Dims { samples, m, n, k } = dims;
    for row0 in (0..m).step_by(R) {
        let rows: [usize; R] = std::array::from_fn(|t| (row0 + t).min(m - 1));
        for col0 in (0..n).step_by(C) {
            let cols: [usize; C] = std::array::from_fn(|u| (col0 + u).min(n - 1));
            let mut acc = [[[V::splat(0.0); W]; C]; R];
            for s in 0..samples {
                let a_rows: [&[f32]; R] = std::array::from_fn(|t| a.row(s, rows[t]));
                let b_rows: [&[f32]; C] = std::array::from_fn(|u| b.row(s, cols[u]));
                acc = stream::<V, W, R, C>(acc, &a_rows, &b_rows, k);
            }
            for (t, acc_row) in acc.iter().enumerate().take(m - row0) {
                for (u, regs) in acc_row.iter().enumerate().take(n - col0) {
                    let mut lanes = [0.0f32; LANES];
                    for (w, reg) in regs.iter().enumerate() {
                        // SAFETY: register `w` holds lanes `w·V::N..(w+1)·V::N` of `LANES`.
                        unsafe { reg.store(lanes.as_mut_ptr().add(w * V::N)) };
                    }
                    dst[(row0 + t) * n + col0 + u] += sum_lanes(&lanes);
                }
            }
        }
    }
}

/// Adds one sample's pixels to the accumulators (by value, so that they stay in registers):
/// lane `l` of an accumulator takes the pixels `p ≡ l (mod LANES)` in order, a last partial block
/// zero-padded (a zero product leaves an accumulator unchanged).
#[inline(always)]
fn stream<V: Lanes, const W: usize, const R: usize, const C: usize>(
    mut acc: [[[V; W]; C]; R],
    a_rows: &[&[f32]; R],
    b_rows: &[&[f32]; C],
    k: usize,
) -> [[[V; W]; C]; R] {
    assert!(a_rows.iter().chain(b_rows).all(|row| row.len() >= k), "rows of k pixels");
    let full = k / LANES * LANES;
    let a_ptr: [*const f32; R] = std::array::from_fn(|t| a_rows[t].as_ptr());
    let b_ptr: [*const f32; C] = std::array::from_fn(|u| b_rows[u].as_ptr());
    let mut p = 0;
    while p < full {
        // SAFETY: `p + LANES <= full <= k`, and every row holds `k` elements (asserted above).
        unsafe {
            let av: [[V; W]; R] = std::array::from_fn(|t| std::array::from_fn(|w| V::load(a_ptr[t].add(p + w * V::N))));
            let bv: [[V; W]; C] = std::array::from_fn(|u| std::array::from_fn(|w| V::load(b_ptr[u].add(p + w * V::N))));
            fma_block(&mut acc, &av, &bv);
        }
        p += LANES;
    }
    if full < k {
        let a_tail: [[f32; LANES]; R] = std::array::from_fn(|t| padded_lanes(&a_rows[t][full..k]));
        let b_tail: [[f32; LANES]; C] = std::array::from_fn(|u| padded_lanes(&b_rows[u][full..k]));
        // SAFETY: every tail array holds `LANES = W · V::N` floats.
        unsafe {
            let av: [[V; W]; R] =
                std::array::from_fn(|t| std::array::from_fn(|w| V::load(a_tail[t].as_ptr().add(w * V::N))));
            let bv: [[V; W]; C] =
                std::array::from_fn(|u| std::array::from_fn(|w| V::load(b_tail[u].as_ptr().add(w * V::N))));
            fma_block(&mut acc, &av, &bv);
        }
    }
    acc
}

#[inline(always)]
fn fma_block<V: Lanes, const W: usize, const R: usize, const C: usize>(
    acc: &mut [[[V; W]; C]; R],
    av: &[[V; W]; R],
    bv: &[[V; W]; C],
) {
    for (acc_row, a) in acc.iter_mut().zip(av) {
        for (regs, b) in acc_row.iter_mut().zip(bv) {
            for w in 0..W {
                regs[w] = a[w].fma(b[w], regs[w]);
            }
        }
    }
}

/// Fewer than `LANES` values, zero-padded.
#[inline(always)]
fn padded_lanes(src: &[f32]) -> [f32; LANES] {
    let mut out = [0.0; LANES];
    out[..src.len()].copy_from_slice(src);
    out
}

/// The lanes summed as a fixed tree: halves added lane by lane, `N → N/2 → … → 1` (`N` a power
/// of two; [`sum_halves_in_place`]).
#[inline(always)]
fn sum_lanes<const N: usize>(lanes: &[f32; N]) -> f32 {
    let mut scratch = *lanes;
    sum_halves_in_place(&mut scratch)
}

/// Lanes per partial sum of the bias gradient: 8 AVX2 or 4 AVX-512 registers, so the additions of
/// a block are independent and the sum runs at the adders' throughput rather than their latency
/// (a plain sequential sum took 3-4 cycles per element: about 2 ms of the 8->8 32x32 weight pass).
const BIAS_LANES: usize = 64;

/// The bias gradient of a convolution, `bias_grad[o] += Σ_s Σ_p dy[s, o, p]`, for `dy` of
/// `batch x out_channels x plane`. Lane `l` of [`BIAS_LANES`] adds the pixels `p ≡ l (mod 64)` of
/// each sample in turn, in order (a last partial block zero-padded); the lanes are then summed as
/// a fixed tree and added to `bias_grad[o]`. The same bits on every instruction set.
pub fn conv2d_bias_grad(dy: &[f32], plane: usize, bias_grad: &mut [f32]) -> Result<()> {
    let out_channels = bias_grad.len();
    let sample = out_channels * plane;
    if sample == 0 || !dy.len().is_multiple_of(sample) {
        return Err(Error::shape(
            "conv2d_bias_grad",
            format!("whole samples of {out_channels} planes of {plane} elements"),
            format!("{} elements", dy.len()),
        ));
    }
    dispatch(BiasJob { dy, plane, bias_grad });
    Ok(())
}

/// The operands of one [`conv2d_bias_grad`], checked.
struct BiasJob<'a> {
    dy: &'a [f32],
    plane: usize,
    bias_grad: &'a mut [f32],
}

impl Job for BiasJob<'_> {
    type Output = ();

    #[inline(always)]
    fn run<V: Lanes>(self) {
        match V::N {
            16 => bias_sums::<V, 4>(self),
            8 => bias_sums::<V, 8>(self),
            4 => bias_sums::<V, 16>(self),
            _ => bias_sums::<V, BIAS_LANES>(self),
        }
    }
}

/// [`conv2d_bias_grad`] with partial sums of `W` registers of `V` (`W · V::N` = [`BIAS_LANES`]).
#[inline(always)]
fn bias_sums<V: Lanes, const W: usize>(job: BiasJob<'_>) {
    assert_eq!(W * V::N, BIAS_LANES, "a partial sum is BIAS_LANES lanes");
    let BiasJob { dy, plane, bias_grad } = job;
    let sample = bias_grad.len() * plane;
    let full = plane / BIAS_LANES * BIAS_LANES;
    let add_block = |acc: &mut [V; W], block: &[f32]| {
        assert!(block.len() >= BIAS_LANES);
        for (w, a) in acc.iter_mut().enumerate() {
            // SAFETY: the block holds BIAS_LANES = W · V::N floats (asserted above).
            *a = a.add(unsafe { V::load(block.as_ptr().add(w * V::N)) });
        }
    };
    for (o, sum) in bias_grad.iter_mut().enumerate() {
        let mut acc = [V::splat(0.0); W];
        for dy_s in dy.chunks_exact(sample) {
            let row = &dy_s[o * plane..][..plane];
            for block in row[..full].chunks_exact(BIAS_LANES) {
                add_block(&mut acc, block);
            }
            if full < plane {
                let mut tail = [0.0f32; BIAS_LANES];
                tail[..plane - full].copy_from_slice(&row[full..]);
                add_block(&mut acc, &tail);
            }
        }
        let mut lanes = [0.0f32; BIAS_LANES];
        for (w, a) in acc.iter().enumerate() {
            // SAFETY: register `w` holds lanes `w·V::N..(w+1)·V::N` of BIAS_LANES.
            unsafe { a.store(lanes.as_mut_ptr().add(w * V::N)) };
        }
        *sum += sum_lanes(&lanes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::conv::im2col;

    /// `Σ_s dy_s · im2col(x_s)ᵀ` in f64, by definition.
    fn reference(x: &[f32], dy: &[f32], w: &Window2d, out_channels: usize) -> Vec<f64> {
        let (rows, plane) = (w.col_rows(), w.out_plane_len());
        let mut out = vec![0.0f64; out_channels * rows];
        let mut col = vec![0.0; rows * plane];
        for (x_s, dy_s) in x.chunks_exact(w.input_len()).zip(dy.chunks_exact(out_channels * plane)) {
            im2col(x_s, w, &mut col).unwrap();
            for o in 0..out_channels {
                for r in 0..rows {
                    out[o * rows + r] +=
                        (0..plane).map(|p| dy_s[o * plane + p] as f64 * col[r * plane + p] as f64).sum::<f64>();
                }
            }
        }
        out
    }

    #[test]
    fn matches_the_definition_for_edge_tiles_tails_and_chunks() {
        // (in, out, side, kernel, stride, pad, batch): 9-row im2col (edge tiles), 5x5 = 25 pixels
        // (a partial lane block), strides, 1x1, and a batch larger than one chunk.
        for (cin, cout, side, kernel, stride, pad, batch) in [
            (1, 8, 8, 3, 1, 1, 3),
            (3, 5, 5, 3, 1, 0, 2),
            (2, 3, 9, 3, 2, 1, 2),
            (4, 6, 6, 1, 1, 0, 2),
            (8, 8, 32, 3, 1, 1, 10),
            // Output channels in lane blocks, 72 and 144 im2col rows: the transposed path, over
            // several chunks.
            (8, 16, 8, 3, 1, 1, 20),
            (16, 32, 4, 3, 1, 1, 5),
            // The same with stride 2 (the chunk's im2col instead of shifted views), and a
            // non-square window with uneven padding through the views.
            (8, 16, 9, 3, 2, 1, 20),
            (9, 16, 7, 3, 1, 2, 6),
            // Output channels in blocks of 8 on small planes: the transposed path too.
            (8, 8, 8, 3, 1, 1, 11),
            (8, 24, 6, 3, 2, 1, 3),
        ] {
            let w = Window2d::new(cin, (side, side), (kernel, kernel), (stride, stride), (pad, pad)).unwrap();
            let x: Vec<f32> = (0..batch * w.input_len()).map(|i| (i as f32 * 0.61).sin()).collect();
            let dy: Vec<f32> = (0..batch * cout * w.out_plane_len()).map(|i| (i as f32 * 0.29).cos()).collect();
            let mut dweight = vec![0.5; cout * w.col_rows()];
            conv2d_weight_grad(&x, &dy, &w, cout, &mut dweight).unwrap();
            for (got, want) in dweight.iter().zip(reference(&x, &dy, &w, cout)) {
                let want = want + 0.5;
                assert!((*got as f64 - want).abs() < 1e-4 * (1.0 + want.abs()), "{got} vs {want}");
            }
        }
    }

    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        let w = Window2d::new(3, (7, 7), (3, 3), (1, 1), (1, 1)).unwrap();
        let dims = Dims { samples: 2, m: 5, n: w.col_rows(), k: w.out_plane_len() };
        let a: Vec<f32> = (0..dims.samples * dims.m * dims.k).map(|i| (i as f32 * 0.77).sin()).collect();
        let b: Vec<f32> = (0..dims.samples * dims.n * dims.k).map(|i| (i as f32 * 0.13).cos()).collect();
        let (a, b) = (Dense { data: &a, rows: dims.m, k: dims.k }, Dense { data: &b, rows: dims.n, k: dims.k });
        let run = |isa: Isa| {
            let mut dst = vec![0.5; dims.m * dims.n];
            dispatch_on(isa, AbtJob { dst: &mut dst, a, b, dims });
            dst.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let scalar = run(Isa::Scalar);
        for isa in Isa::ALL.into_iter().filter(|&isa| isa != Isa::Scalar && isa.available()) {
            assert_eq!(run(isa), scalar, "{isa:?}");
        }
        // The documented order, element by element: lane l chains the pixels p ≡ l (mod LANES) of
        // every sample in order, then the lanes are summed as a tree.
        let mut want = vec![0.5f32; dims.m * dims.n];
        for i in 0..dims.m {
            for j in 0..dims.n {
                let mut lanes = [0.0f32; LANES];
                for s in 0..dims.samples {
                    for p in 0..dims.k {
                        lanes[p % LANES] = a.row(s, i)[p].mul_add(b.row(s, j)[p], lanes[p % LANES]);
                    }
                }
                want[i * dims.n + j] += sum_lanes(&lanes);
            }
        }
        assert_eq!(scalar, want.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }

    /// Stride 1 on planes of whole lane blocks reads shifted views and the output gradient in
    /// place; the sums are the im2col path's, bit for bit (batch over several chunks).
    #[test]
    fn shifted_views_give_the_bits_of_the_im2col_path() {
        for (cin, cout, side, pad, batch) in [(2, 8, 16, 1, 9), (1, 3, 32, 1, 3), (3, 5, 18, 0, 5)] {
            let w = Window2d::new(cin, (side, side), (3, 3), (1, 1), (pad, pad)).unwrap();
            assert!(ShiftedViews::fits(&w) && w.out_plane_len().is_multiple_of(LANES));
            assert!(w.out_plane_len() >= VIEWS_MIN_PLANE);
            let x: Vec<f32> = (0..batch * w.input_len()).map(|i| (i as f32 * 0.37).sin()).collect();
            let dy: Vec<f32> = (0..batch * cout * w.out_plane_len()).map(|i| (i as f32 * 0.53).cos()).collect();
            let mut fast = vec![0.25; cout * w.col_rows()];
            conv2d_weight_grad(&x, &dy, &w, cout, &mut fast).unwrap();
            // The im2col path, as the function runs it for other windows.
            let (col_rows, plane) = (w.col_rows(), w.out_plane_len());
            let chunk = (CHUNK_FLOATS / (col_rows * plane)).clamp(1, batch);
            let mut slow = vec![0.25; cout * col_rows];
            let mut scratch = Im2col::new(&w);
            for first in (0..batch).step_by(chunk) {
                let samples = chunk.min(batch - first);
                let row_len = samples * plane;
                let mut col = vec![0.0; col_rows * row_len];
                let mut dy_rows = vec![0.0; cout * row_len];
                for s in 0..samples {
                    let x_s = &x[(first + s) * w.input_len()..][..w.input_len()];
                    scratch.run_strided(x_s, &mut col[s * plane..], row_len).unwrap();
                    for o in 0..cout {
                        dy_rows[o * row_len + s * plane..][..plane]
                            .copy_from_slice(&dy[((first + s) * cout + o) * plane..][..plane]);
                    }
                }
                let dims = Dims { samples: 1, m: cout, n: col_rows, k: row_len };
                let a = Dense { data: &dy_rows, rows: cout, k: row_len };
                let b = Dense { data: &col, rows: col_rows, k: row_len };
                accumulate_abt(&mut slow, a, b, dims);
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fast), bits(&slow), "{cin}->{cout} at {side}x{side}");
        }
    }

    /// The transposed path gives the same bits on every instruction set.
    #[test]
    fn transposed_path_gives_the_same_bits_on_every_instruction_set() {
        let batch = 3;
        for (cout, stride) in [(16, 1), (16, 2), (8, 1), (24, 2)] {
            let w = Window2d::new(8, (8, 8), (3, 3), (stride, stride), (1, 1)).unwrap();
            let x: Vec<f32> = (0..batch * w.input_len()).map(|i| (i as f32 * 0.41).sin()).collect();
            let dy: Vec<f32> = (0..batch * cout * w.out_plane_len()).map(|i| (i as f32 * 0.23).cos()).collect();
            let run = |isa: Isa| {
                let mut dweight = vec![0.125; cout * w.col_rows()];
                let job = TransposedJob { x: &x, dy: &dy, window: w, out_channels: cout, batch, dweight: &mut dweight };
                dispatch_on(isa, job).unwrap();
                dweight.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            let scalar = run(Isa::Scalar);
            // AVX-512 takes whole blocks of 16 output channels (`conv2d_weight_grad` runs the
            // AVX2 code for the others).
            let isas = Isa::ALL.into_iter().filter(|&isa| isa != Isa::Scalar && isa.available());
            for isa in isas.filter(|&isa| isa != Isa::Avx512 || cout % LANES == 0) {
                assert_eq!(run(isa), scalar, "{isa:?}");
            }
            assert!(transposed_fits(&w, cout));
            let mut dispatched = vec![0.125; cout * w.col_rows()];
            conv2d_weight_grad(&x, &dy, &w, cout, &mut dispatched).unwrap();
            assert_eq!(dispatched.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), scalar);
        }
    }

    /// The bias gradient: the documented order, bit for bit, on every instruction set; close to
    /// the f64 sum; planes shorter than, equal to and longer than a block of 64 lanes.
    #[test]
    fn bias_gradient_sums_in_the_documented_order_on_every_instruction_set() {
        for (out, plane, batch) in [(3, 25, 4), (8, 64, 5), (2, 1024, 3), (5, 100, 2)] {
            let dy = crate::cpu::test_values(batch * out * plane, 77, 1.0);
            let mut want = vec![0.5f32; out];
            for (o, w) in want.iter_mut().enumerate() {
                let mut lanes = [0.0f32; BIAS_LANES];
                for s in 0..batch {
                    for p in 0..plane {
                        lanes[p % BIAS_LANES] += dy[(s * out + o) * plane + p];
                    }
                }
                *w += sum_lanes(&lanes);
                let exact: f64 = (0..batch)
                    .flat_map(|s| (0..plane).map(move |p| (s, p)))
                    .map(|(s, p)| dy[(s * out + o) * plane + p] as f64)
                    .sum();
                assert!((*w as f64 - 0.5 - exact).abs() < 1e-4 * (1.0 + exact.abs()), "{w} vs {exact}");
            }
            let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
            for isa in Isa::ALL.into_iter().filter(|isa| isa.available()) {
                let mut got = vec![0.5f32; out];
                dispatch_on(isa, BiasJob { dy: &dy, plane, bias_grad: &mut got });
                assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "{isa:?} {out}x{plane}");
            }
            let mut got = vec![0.5f32; out];
            conv2d_bias_grad(&dy, plane, &mut got).unwrap();
            assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want);
        }
        assert!(conv2d_bias_grad(&[0.0; 10], 4, &mut [0.0; 2]).is_err());
        assert!(conv2d_bias_grad(&[0.0; 10], 0, &mut [0.0; 2]).is_err());
    }

    #[test]
    fn rejects_wrong_lengths() {
        let w = Window2d::new(1, (4, 4), (3, 3), (1, 1), (1, 1)).unwrap();
        assert!(conv2d_weight_grad(&[0.0; 15], &[0.0; 16], &w, 1, &mut [0.0; 9]).is_err());
        assert!(conv2d_weight_grad(&[0.0; 16], &[0.0; 15], &w, 1, &mut [0.0; 9]).is_err());
        assert!(conv2d_weight_grad(&[0.0; 16], &[0.0; 16], &w, 1, &mut [0.0; 8]).is_err());
    }
}
