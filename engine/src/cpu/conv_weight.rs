//! The weight gradient of a 2-D convolution over a whole batch,
//! `dweight [out, in·kh·kw] += Σ_samples dy [out, P] · im2col(x)ᵀ [P, in·kh·kw]` (P = output pixels),
//! by a small-output kernel instead of one GEMM per sample.
//!
//! Why: the output is tiny (8x72 for the zoo's 8→8 3x3 convolution) and the reduction long (every
//! pixel of every sample), a shape general GEMMs handle badly (measured 20–29 GFLOP/s per sample,
//! 10 GFLOP/s on 32x32 planes where `colᵀ` is a strided operand). Here both operands are read along
//! their contiguous pixel axis: a chunk of samples gets its im2col and output gradient laid out as
//! rows over all of its pixels, then a 4x4 tile of `dweight` is held as 16 accumulators of 16 lanes
//! while the kernel streams those rows, and each accumulator's lanes are summed in a fixed order
//! and added to `dweight`. With stride 1 on output planes of at least [`VIEWS_MIN_PLANE`] pixels
//! (32x32), im2col is not built: each sample's rows are read from its shifted views
//! (`conv_lanes::ShiftedViews`, about `kw` copies of the input instead of `kh·kw`) and its output
//! gradient in place, in the same order, so the bits are those of the im2col path. With output
//! channels in whole lane blocks on smaller planes and at least 64 im2col rows (the CNN's 16->32
//! at 8x8), `dweightᵀ` is formed instead by the lanes product over the chunk's im2col and the
//! transposed output gradient (`TransposedJob`), with no lane sums.
//!
//! Determinism: lane `l` of an accumulator sums, with fused multiply-adds in order, the positions
//! `p ≡ l (mod 16)` of a chunk's pixels (its samples' pixels one after another; a last partial
//! block of 16 is zero-padded); the chunk size depends only on the shapes. The same code is
//! compiled for AVX-512, AVX2 and plain x86-64 (where `f32::mul_add` is a software FMA) and every
//! lane rounds like the scalar code, so the result does not depend on the CPU features found, nor
//! on threads (there are none).
use super::conv::Im2col;
use super::conv_lanes::ShiftedViews;
use super::lanes_gemm::gemm;
use super::vecmath::{Job, Lanes, dispatch};
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
    if out_channels.is_multiple_of(LANES) && out_plane < VIEWS_MIN_PLANE && col_rows >= TRANSPOSED_MIN_ROWS {
        let job = TransposedJob { x, dy, window: *window, out_channels, batch, dweight };
        return dispatch(job);
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

/// Sizes of a batched `dst [m, n] += Σ_s A_s [m, k] · B_sᵀ [k, n]` (`A_s`, `B_s` row-major, the
/// samples one after another).
#[derive(Clone, Copy)]
struct Dims {
    samples: usize,
    m: usize,
    n: usize,
    k: usize,
}

/// Output channels in whole lane blocks on small planes: `dweightᵀ [col_rows, out] += Σ_chunks
/// im2col [col_rows, pixels] · dyᵀ [pixels, out]` by the lanes product (`lanes_gemm`), the output
/// channels in lanes, so an `8 x 32` block of `dweightᵀ` stays in registers over a chunk's pixels
/// and no lanes are summed across. Each element is one chain of fused multiply-adds over the
/// batch's pixels in order (from zero), added to `dweight` at the end: the same bits on every
/// instruction set and for any chunk size.
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
        let chunk = (CHUNK_FLOATS / (col_rows * plane)).clamp(1, batch);
        let mut scratch = Im2col::new(&window);
        let mut col = vec![0.0; chunk * col_rows * plane];
        let mut dy_t = vec![0.0; chunk * plane * out];
        let mut acc_t = vec![0.0; col_rows * out];
        for first in (0..batch).step_by(chunk) {
            let samples = chunk.min(batch - first);
            let row_len = samples * plane;
            for s in 0..samples {
                let x_s = &x[(first + s) * input_len..][..input_len];
                scratch.run_strided(x_s, &mut col[s * plane..], row_len)?;
                let dy_s = &dy[(first + s) * out * plane..][..out * plane];
                let dst = &mut dy_t[s * plane * out..][..plane * out];
                for (o, src) in dy_s.chunks_exact(plane).enumerate() {
                    for (pix, &v) in src.iter().enumerate() {
                        dst[pix * out + o] = v;
                    }
                }
            }
            // SAFETY: `col` holds `col_rows` rows `row_len` apart, `dy_t` `row_len` rows of `out`
            // (a multiple of 16, so of `V::N`), `acc_t` `col_rows x out`.
            unsafe {
                gemm::<V>(
                    col_rows,
                    out,
                    row_len,
                    col.as_ptr(),
                    row_len,
                    dy_t.as_ptr(),
                    out,
                    acc_t.as_mut_ptr(),
                    out,
                    true,
                );
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

/// Dispatches to the widest instruction set present; every variant gives the same bits.
fn accumulate_abt<A: Operand, B: Operand>(dst: &mut [f32], a: A, b: B, dims: Dims) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the features this function is compiled for were just detected.
            unsafe { accumulate_abt_avx512(dst, a, b, dims) };
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: as above.
            unsafe { accumulate_abt_avx2(dst, a, b, dims) };
            return;
        }
    }
    accumulate_abt_generic(dst, a, b, dims);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn accumulate_abt_avx512<A: Operand, B: Operand>(dst: &mut [f32], a: A, b: B, dims: Dims) {
    accumulate_abt_generic(dst, a, b, dims);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn accumulate_abt_avx2<A: Operand, B: Operand>(dst: &mut [f32], a: A, b: B, dims: Dims) {
    accumulate_abt_generic(dst, a, b, dims);
}

#[inline(always)]
fn accumulate_abt_generic<A: Operand, B: Operand>(dst: &mut [f32], a: A, b: B, dims: Dims) {
    for row0 in (0..dims.m).step_by(TILE_ROWS) {
        for col0 in (0..dims.n).step_by(TILE_COLS) {
            tile(dst, a, b, dims, row0, col0);
        }
    }
}

/// One `TILE_ROWS x TILE_COLS` tile of `dst` (edge tiles re-read their last row or column and drop
/// those results).
#[inline(always)]
fn tile<A: Operand, B: Operand>(dst: &mut [f32], a: A, b: B, dims: Dims, row0: usize, col0: usize) {
    let Dims { samples, m, n, k } = dims;
    let rows: [usize; TILE_ROWS] = std::array::from_fn(|t| (row0 + t).min(m - 1));
    let cols: [usize; TILE_COLS] = std::array::from_fn(|u| (col0 + u).min(n - 1));
    let mut acc: Acc = [[[0.0f32; LANES]; TILE_COLS]; TILE_ROWS];
    for s in 0..samples {
        let a_rows: [&[f32]; TILE_ROWS] = std::array::from_fn(|t| a.row(s, rows[t]));
        let b_rows: [&[f32]; TILE_COLS] = std::array::from_fn(|u| b.row(s, cols[u]));
        acc = stream(acc, &a_rows, &b_rows, k);
    }
    for (t, acc_row) in acc.iter().enumerate().take(m - row0) {
        for (u, lanes) in acc_row.iter().enumerate().take(n - col0) {
            dst[(row0 + t) * n + col0 + u] += sum_lanes(lanes);
        }
    }
}

/// The accumulators of one tile: `[row][col][lane]`.
type Acc = [[[f32; LANES]; TILE_COLS]; TILE_ROWS];

/// Adds one sample's pixels to the accumulators (by value, so that they stay in registers).
#[inline(always)]
fn stream(mut acc: Acc, a_rows: &[&[f32]; TILE_ROWS], b_rows: &[&[f32]; TILE_COLS], k: usize) -> Acc {
    let full = k / LANES * LANES;
    let a_full: [&[f32]; TILE_ROWS] = std::array::from_fn(|t| &a_rows[t][..full]);
    let b_full: [&[f32]; TILE_COLS] = std::array::from_fn(|u| &b_rows[u][..full]);
    for block in 0..full / LANES {
        let p = block * LANES;
        let av: [[f32; LANES]; TILE_ROWS] = std::array::from_fn(|t| lanes(&a_full[t][p..p + LANES]));
        let bv: [[f32; LANES]; TILE_COLS] = std::array::from_fn(|u| lanes(&b_full[u][p..p + LANES]));
        fma_block(&mut acc, &av, &bv);
    }
    if full < k {
        let av: [[f32; LANES]; TILE_ROWS] = std::array::from_fn(|t| padded_lanes(&a_rows[t][full..]));
        let bv: [[f32; LANES]; TILE_COLS] = std::array::from_fn(|u| padded_lanes(&b_rows[u][full..]));
        fma_block(&mut acc, &av, &bv);
    }
    acc
}

#[inline(always)]
fn fma_block(acc: &mut Acc, av: &[[f32; LANES]; TILE_ROWS], bv: &[[f32; LANES]; TILE_COLS]) {
    for t in 0..TILE_ROWS {
        for u in 0..TILE_COLS {
            for l in 0..LANES {
                acc[t][u][l] = av[t][l].mul_add(bv[u][l], acc[t][u][l]);
            }
        }
    }
}

#[inline(always)]
fn lanes(src: &[f32]) -> [f32; LANES] {
    src.try_into().expect("a block of LANES")
}

/// Fewer than `LANES` values, zero-padded (a zero product leaves an accumulator unchanged).
#[inline(always)]
fn padded_lanes(src: &[f32]) -> [f32; LANES] {
    let mut out = [0.0; LANES];
    out[..src.len()].copy_from_slice(src);
    out
}

/// The lanes summed as a fixed tree: halves added lane by lane, 16 → 8 → 4 → 2 → 1.
#[inline(always)]
fn sum_lanes(lanes: &[f32; LANES]) -> f32 {
    let mut v = *lanes;
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            v[l] += v[l + width];
        }
        width /= 2;
    }
    v[0]
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
        let mut generic = vec![0.0; dims.m * dims.n];
        accumulate_abt_generic(&mut generic, a, b, dims);
        let mut dispatched = vec![0.0; dims.m * dims.n];
        accumulate_abt(&mut dispatched, a, b, dims);
        assert_eq!(
            generic.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            dispatched.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
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
        use crate::cpu::vecmath::{Isa, dispatch_on};
        let (cout, batch) = (16, 3);
        let w = Window2d::new(8, (8, 8), (3, 3), (1, 1), (1, 1)).unwrap();
        let x: Vec<f32> = (0..batch * w.input_len()).map(|i| (i as f32 * 0.41).sin()).collect();
        let dy: Vec<f32> = (0..batch * cout * w.out_plane_len()).map(|i| (i as f32 * 0.23).cos()).collect();
        let run = |isa: Isa| {
            let mut dweight = vec![0.125; cout * w.col_rows()];
            let job = TransposedJob { x: &x, dy: &dy, window: w, out_channels: cout, batch, dweight: &mut dweight };
            dispatch_on(isa, job).unwrap();
            dweight.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let scalar = run(Isa::Scalar);
        for isa in [Isa::Avx2, Isa::Avx512].into_iter().filter(|isa| isa.available()) {
            assert_eq!(run(isa), scalar, "{isa:?}");
        }
    }

    #[test]
    fn rejects_wrong_lengths() {
        let w = Window2d::new(1, (4, 4), (3, 3), (1, 1), (1, 1)).unwrap();
        assert!(conv2d_weight_grad(&[0.0; 15], &[0.0; 16], &w, 1, &mut [0.0; 9]).is_err());
        assert!(conv2d_weight_grad(&[0.0; 16], &[0.0; 15], &w, 1, &mut [0.0; 9]).is_err());
        assert!(conv2d_weight_grad(&[0.0; 16], &[0.0; 16], &w, 1, &mut [0.0; 8]).is_err());
    }
}
