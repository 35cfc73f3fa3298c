//! 2-D convolution of a whole batch as one dispatched kernel, for output planes of a multiple of
//! 16 pixels (the zoo's 8×8 and 32×32): per sample, the fast im2col ([`Im2col`]), then
//! `weight [out, in·kh·kw] · col [in·kh·kw, out_plane]` by the lanes product
//! (`lanes_gemm`), written straight into the sample's output (from its bias, or from zero).
//!
//! Why: at 8×8 a sample's product is tiny (32×144×64 for the CNN's 16→32 convolution), and a
//! general GEMM spends as long choosing its kernel, packing and allocating per call as it spends
//! multiplying. Here the instruction set is chosen once per batch, nothing is packed (a weight
//! element is broadcast per term, a `col` row is loaded in lanes), nothing is allocated per sample,
//! and an `8 × 32` output tile (AVX-512) stays in registers over the whole reduction.
//!
//! Determinism: each output element is its bias (or 0) followed by one fused multiply-add per
//! (input channel, kernel row, kernel column), in that order; lanes are output pixels. The bits
//! are the same on AVX-512, AVX2+FMA and scalar code, and each sample is computed alone, so they do
//! not depend on the batch size or on how a batch is split into micro-batches.
use std::mem::MaybeUninit;

use super::conv::Im2col;
use super::lanes_gemm::{gemm, gemm_indirect};
use super::uninit::assume_init;
#[cfg(test)]
use super::vecmath::{Isa, dispatch_on};
use super::vecmath::{Job, Lanes, dispatch};
use super::window::{Window2d, check_len};
use crate::{Error, Result};

/// Output planes must hold a multiple of this many pixels (every ISA's lane count divides it).
pub const PLANE_MULTIPLE: usize = 16;

/// Most im2col rows per pass of the product: 32->16 at 32x32 (288 rows, 420 KB of shifted views
/// per sample, read once per row block) measured 1.25x faster in blocks of 144, 32->16 at 8x8 4%;
/// 72 was no better. The bits do not depend on it.
const K_BLOCK: usize = 144;

/// Whether [`conv2d_lanes`] takes this window: a non-empty output plane of a multiple of
/// [`PLANE_MULTIPLE`] pixels.
pub fn conv2d_lanes_fits(window: &Window2d) -> bool {
    let plane = window.out_plane_len();
    plane > 0 && plane.is_multiple_of(PLANE_MULTIPLE)
}

/// `output[s, o] = bias[o] + Σ weight[o, ·] · im2col(x[s])` for every sample `s` of `x`
/// (`batch x window.input_len()`), writing every element of `output`
/// (`batch x out_channels x out_plane`); `weight` is `out_channels x window.col_rows()`
/// (PyTorch's `[out, in, kh, kw]`). The window must satisfy [`conv2d_lanes_fits`].
pub fn conv2d_lanes<'a>(
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    window: &Window2d,
    out_channels: usize,
    output: &'a mut [MaybeUninit<f32>],
) -> Result<&'a mut [f32]> {
    let mut job = ConvJob::new(x, weight, bias, window, out_channels, output)?;
    if !job.output.is_empty() {
        job = dispatch(job)?;
    }
    // SAFETY: the job wrote every element of every sample's output.
    Ok(unsafe { assume_init(job.output) })
}

/// One call's operands, checked.
struct ConvJob<'a, 'o> {
    x: &'a [f32],
    weight: &'a [f32],
    bias: Option<&'a [f32]>,
    window: Window2d,
    out_channels: usize,
    output: &'o mut [MaybeUninit<f32>],
}

impl<'a, 'o> ConvJob<'a, 'o> {
    fn new(
        x: &'a [f32],
        weight: &'a [f32],
        bias: Option<&'a [f32]>,
        window: &Window2d,
        out_channels: usize,
        output: &'o mut [MaybeUninit<f32>],
    ) -> Result<Self> {
        if !conv2d_lanes_fits(window) {
            return Err(Error::invalid(
                "conv2d_lanes",
                format!(
                    "an output plane of {}x{}: it must be a positive multiple of {PLANE_MULTIPLE} pixels",
                    window.out_height(),
                    window.out_width()
                ),
            ));
        }
        let input_len = window.input_len();
        if input_len == 0 || !x.len().is_multiple_of(input_len) {
            return Err(Error::shape(
                "conv2d_lanes",
                format!("a whole number of samples of {input_len} elements"),
                format!("{} elements", x.len()),
            ));
        }
        let batch = x.len() / input_len;
        check_len("conv2d_lanes", "weight", out_channels * window.col_rows(), weight.len())?;
        if let Some(bias) = bias {
            check_len("conv2d_lanes", "bias", out_channels, bias.len())?;
        }
        check_len("conv2d_lanes", "output", batch * out_channels * window.out_plane_len(), output.len())?;
        Ok(ConvJob { x, weight, bias, window: *window, out_channels, output })
    }
}

impl<'o> Job for ConvJob<'_, 'o> {
    type Output = Result<Self>;

    #[inline(always)]
    fn run<V: Lanes>(self) -> Result<Self> {
        let w = self.window;
        let (col_rows, plane) = (w.col_rows(), w.out_plane_len());
        let shifted = ShiftedViews::fits(&w);
        let mut scratch = Im2col::new(&w);
        let mut col = if w.is_pointwise() || shifted { Vec::new() } else { vec![0.0; col_rows * plane] };
        let mut views = if shifted { ShiftedViews::new(&w) } else { ShiftedViews::default() };
        let samples = self.x.chunks_exact(w.input_len()).zip(self.output.chunks_exact_mut(self.out_channels * plane));
        for (x_sample, y_sample) in samples {
            let b: &[f32] = if w.is_pointwise() {
                x_sample
            } else if shifted {
                views.fill(x_sample, &w);
                &views.data
            } else {
                scratch.run(x_sample, &mut col)?;
                &col
            };
            if let Some(bias) = self.bias {
                for (y_plane, &value) in y_sample.chunks_exact_mut(plane).zip(bias) {
                    y_plane.iter_mut().for_each(|y| {
                        y.write(value);
                    });
                }
            }
            // The reduction in blocks of at most `K_BLOCK` im2col rows, each block continuing the
            // chains of the one before from the output (an f32 store and load are exact, so the
            // sums and bits are those of one pass), so that a block's rows stay in cache while
            // every row block of the output reads them.
            let (a, c) = (self.weight.as_ptr(), y_sample.as_mut_ptr().cast::<f32>());
            let m = self.out_channels;
            let mut k0 = 0;
            loop {
                let k = K_BLOCK.min(col_rows - k0);
                let accumulate = self.bias.is_some() || k0 > 0;
                // SAFETY: `weight` is `out_channels x col_rows`, `b` is `col_rows x plane`, the
                // sample's output `out_channels x plane` (all checked in `new`; `plane` is a
                // multiple of 16, so of `V::N`); rows `k0..k0 + k` are inside. Without a bias
                // the first block only writes the output; with one, it reads the bias just
                // written; later blocks read what the first wrote. The shifted views' row table
                // covers `col_rows` rows of `plane` elements inside `views.data` (see
                // `ShiftedViews`).
                unsafe {
                    if shifted {
                        let offsets = &views.offsets[k0..];
                        gemm_indirect::<V>(m, plane, k, a.add(k0), col_rows, b.as_ptr(), offsets, c, plane, accumulate);
                    } else {
                        let b = b.as_ptr().add(k0 * plane);
                        gemm::<V>(m, plane, k, a.add(k0), col_rows, b, plane, c, plane, accumulate);
                    }
                }
                k0 += k;
                if k0 >= col_rows {
                    break;
                }
            }
        }
        Ok(self)
    }
}

/// For stride 1: per (input channel `c`, kernel column `kc`), the sample's plane shifted left by
/// `kc` and cropped to the output width, with the padding rows and columns as zeros:
/// `view[c, kc][r, j] = padded(x[c])[r, j + kc]` for `r < out_h + kh - 1`, `j < out_w`. Row `p =
/// (c, kr, kc)` of im2col is then the `out_h · out_w` contiguous elements from row `kr` of
/// `view[c, kc]`: the product reads them through a table of row offsets (in im2col's row order, so
/// the sums are the same as over im2col), from about `kw` copies of the input instead of `kh·kw`.
///
/// Several samples can sit side by side ([`ShiftedViews::interleaved`]): each view row is then
/// the samples' rows one after another, `view[c, kc][r][s][j]`, and row `(c, kr, kc)` of the
/// samples' im2col, its pixels in the order (output row, sample, output column), is the
/// `out_h · samples · out_w` contiguous elements from view row `kr`.
#[derive(Debug, Default)]
pub(crate) struct ShiftedViews {
    /// `channels x kw x (out_h + kh - 1) x samples x out_w`; only the interior is ever written,
    /// so the padding stays zero.
    pub(crate) data: Vec<f32>,
    /// Start of im2col row `(c, kr, kc)` in `data`.
    pub(crate) offsets: Vec<usize>,
    /// Samples side by side.
    pub(crate) samples: usize,
}

impl ShiftedViews {
    /// Whether `w` can be read through shifted views: stride 1 and not pointwise (which reads
    /// its input directly).
    pub(crate) fn fits(w: &Window2d) -> bool {
        !w.is_pointwise() && w.stride_height == 1 && w.stride_width == 1
    }

    /// Views for samples of `w` (all zero until [`ShiftedViews::fill`]).
    pub(crate) fn new(w: &Window2d) -> ShiftedViews {
        ShiftedViews::interleaved(w, 1)
    }

    /// Views for `samples` samples of `w` side by side (all zero until filled).
    pub(crate) fn interleaved(w: &Window2d, samples: usize) -> ShiftedViews {
        let (row, view_h) = (samples * w.out_width(), w.out_height() + w.kernel_height - 1);
        let mut offsets = Vec::with_capacity(w.col_rows());
        for c in 0..w.channels {
            for kr in 0..w.kernel_height {
                for kc in 0..w.kernel_width {
                    offsets.push(((c * w.kernel_width + kc) * view_h + kr) * row);
                }
            }
        }
        ShiftedViews { data: vec![0.0; w.channels * w.kernel_width * view_h * row], offsets, samples }
    }

    /// Writes the interior of every view from one sample.
    pub(crate) fn fill(&mut self, x: &[f32], w: &Window2d) {
        self.fill_sample(x, w, 0);
    }

    /// Writes the interior of every view of sample `s` (below the views' sample count).
    pub(crate) fn fill_sample(&mut self, x: &[f32], w: &Window2d, s: usize) {
        let (out_w, view_h) = (w.out_width(), w.out_height() + w.kernel_height - 1);
        let row = self.samples * out_w;
        let view_len = view_h * row;
        for (c, plane) in x.chunks_exact(w.in_plane_len()).enumerate() {
            for kc in 0..w.kernel_width {
                // Output column j reads input column j + kc - pad_width.
                let first = w.pad_width.saturating_sub(kc);
                let end = out_w.min((w.in_width + w.pad_width).saturating_sub(kc));
                if first >= end {
                    continue;
                }
                let src_first = first + kc - w.pad_width;
                let view = &mut self.data[(c * w.kernel_width + kc) * view_len..][..view_len];
                let dst = &mut view[w.pad_height * row + s * out_w + first..];
                copy_rows(&plane[src_first..], dst, end - first, (w.in_height, w.in_width, row));
            }
        }
    }
}

/// Copies the first `len` floats of each of `rows` rows of `src` (`src_step` apart) to rows of
/// `dst` (`dst_step` apart). The common widths are fixed-width copies (inlined moves: a `memcpy`
/// call per row of 7 or 8 floats took about a sixth of a 32-channel 8x8 convolution's time).
#[inline]
pub(crate) fn copy_rows(src: &[f32], dst: &mut [f32], len: usize, rows: (usize, usize, usize)) {
    match len {
        7 => copy_rows_of::<7>(src, dst, rows),
        8 => copy_rows_of::<8>(src, dst, rows),
        15 => copy_rows_of::<15>(src, dst, rows),
        16 => copy_rows_of::<16>(src, dst, rows),
        31 => copy_rows_of::<31>(src, dst, rows),
        32 => copy_rows_of::<32>(src, dst, rows),
        _ => {
            let (rows, src_step, dst_step) = rows;
            for r in 0..rows {
                dst[r * dst_step..][..len].copy_from_slice(&src[r * src_step..][..len]);
            }
        }
    }
}

/// [`copy_rows`] of `N` floats.
#[inline(always)]
fn copy_rows_of<const N: usize>(src: &[f32], dst: &mut [f32], (rows, src_step, dst_step): (usize, usize, usize)) {
    for r in 0..rows {
        let s: &[f32; N] = src[r * src_step..][..N].try_into().expect("a slice of N");
        let d: &mut [f32; N] = (&mut dst[r * dst_step..][..N]).try_into().expect("a slice of N");
        *d = *s;
    }
}

/// [`conv2d_lanes`] on a given instruction set (tests compare them).
#[cfg(test)]
fn conv2d_lanes_on<'a>(
    isa: Isa,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    window: &Window2d,
    out_channels: usize,
    output: &'a mut [MaybeUninit<f32>],
) -> Result<&'a mut [f32]> {
    let job = dispatch_on(isa, ConvJob::new(x, weight, bias, window, out_channels, output)?)?;
    // SAFETY: as in `conv2d_lanes`.
    Ok(unsafe { assume_init(job.output) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        crate::cpu::test_values(n, seed, 1.0)
    }

    /// The definition, in f64: every output pixel, every tap, zero outside the input.
    fn reference(x: &[f32], weight: &[f32], bias: Option<&[f32]>, w: &Window2d, out_channels: usize) -> Vec<f64> {
        let (out_h, out_w) = (w.out_height(), w.out_width());
        let mut out = Vec::new();
        for sample in x.chunks_exact(w.input_len()) {
            for o in 0..out_channels {
                for i in 0..out_h {
                    for j in 0..out_w {
                        let mut sum = bias.map_or(0.0, |b| b[o] as f64);
                        for c in 0..w.channels {
                            for kr in 0..w.kernel_height {
                                for kc in 0..w.kernel_width {
                                    let (Some(r), Some(col)) = (w.input_row(i, kr), w.input_col(j, kc)) else {
                                        continue;
                                    };
                                    let wv =
                                        weight[((o * w.channels + c) * w.kernel_height + kr) * w.kernel_width + kc];
                                    sum += wv as f64 * sample[(c * w.in_height + r) * w.in_width + col] as f64;
                                }
                            }
                        }
                        out.push(sum);
                    }
                }
            }
        }
        out
    }

    fn windows() -> Vec<(Window2d, usize)> {
        vec![
            (Window2d::new(16, (8, 8), (3, 3), (1, 1), (1, 1)).unwrap(), 32),
            (Window2d::new(1, (8, 8), (3, 3), (1, 1), (1, 1)).unwrap(), 8),
            (Window2d::new(8, (8, 8), (3, 3), (1, 1), (1, 1)).unwrap(), 13),
            (Window2d::new(3, (8, 8), (1, 1), (1, 1), (0, 0)).unwrap(), 5),
            (Window2d::new(2, (8, 8), (3, 3), (2, 2), (1, 1)).unwrap(), 9),
            (Window2d::new(4, (10, 6), (3, 3), (1, 1), (0, 0)).unwrap(), 3),
            // More im2col rows than one pass of the product takes (`K_BLOCK`): shifted views
            // (180 rows) and im2col (153 rows).
            (Window2d::new(20, (8, 8), (3, 3), (1, 1), (1, 1)).unwrap(), 7),
            (Window2d::new(17, (8, 8), (3, 3), (2, 2), (1, 1)).unwrap(), 5),
        ]
    }

    #[test]
    fn matches_the_definition_with_and_without_bias() {
        for (seed, (w, out_channels)) in windows().into_iter().enumerate() {
            assert!(conv2d_lanes_fits(&w));
            let batch = 3;
            let x = values(batch * w.input_len(), seed as u64 + 1);
            let weight = values(out_channels * w.col_rows(), seed as u64 + 50);
            let bias = values(out_channels, seed as u64 + 90);
            for bias in [None, Some(&bias[..])] {
                let mut out = vec![MaybeUninit::uninit(); batch * out_channels * w.out_plane_len()];
                let got = conv2d_lanes(&x, &weight, bias, &w, out_channels, &mut out).unwrap();
                let want = reference(&x, &weight, bias, &w, out_channels);
                for (i, (g, r)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (*g as f64 - r).abs() <= 1e-5 * (1.0 + r.abs()),
                        "{w:?} out {out_channels} bias {}: element {i}: {g} vs {r}",
                        bias.is_some()
                    );
                }
            }
        }
    }

    /// Every ISA, and every split of the batch, gives the same bits.
    #[test]
    fn every_instruction_set_and_batch_split_gives_the_same_bits() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (seed, (w, out_channels)) in windows().into_iter().enumerate() {
            let batch = 3;
            let x = values(batch * w.input_len(), seed as u64 + 7);
            let weight = values(out_channels * w.col_rows(), seed as u64 + 8);
            let bias = values(out_channels, seed as u64 + 9);
            let n = batch * out_channels * w.out_plane_len();
            let mut scalar = vec![MaybeUninit::uninit(); n];
            let scalar =
                bits(conv2d_lanes_on(Isa::Scalar, &x, &weight, Some(&bias), &w, out_channels, &mut scalar).unwrap());
            for isa in Isa::ALL.into_iter().filter(|&isa| isa != Isa::Scalar && isa.available()) {
                let mut out = vec![MaybeUninit::uninit(); n];
                let got = conv2d_lanes_on(isa, &x, &weight, Some(&bias), &w, out_channels, &mut out).unwrap();
                assert_eq!(bits(got), scalar, "{isa:?} {w:?}");
            }
            let one = out_channels * w.out_plane_len();
            for (s, sample) in x.chunks_exact(w.input_len()).enumerate() {
                let mut out = vec![MaybeUninit::uninit(); one];
                let got = conv2d_lanes(sample, &weight, Some(&bias), &w, out_channels, &mut out).unwrap();
                assert_eq!(bits(got), scalar[s * one..][..one], "sample {s} alone");
            }
        }
    }

    /// Stride 1 reads shifted views through a row table; the sums are those of the im2col
    /// product, term for term.
    #[test]
    fn shifted_views_give_the_bits_of_the_im2col_product() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (seed, (w, out_channels)) in windows().into_iter().enumerate() {
            if w.stride_height != 1 || w.is_pointwise() {
                continue;
            }
            let x = values(2 * w.input_len(), seed as u64 + 20);
            let weight = values(out_channels * w.col_rows(), seed as u64 + 21);
            let (col_rows, plane) = (w.col_rows(), w.out_plane_len());
            let mut want = Vec::new();
            let mut scratch = Im2col::new(&w);
            for sample in x.chunks_exact(w.input_len()) {
                let mut col = vec![0.0; col_rows * plane];
                scratch.run(sample, &mut col).unwrap();
                for o in 0..out_channels {
                    for j in 0..plane {
                        let mut acc = 0.0f32;
                        for p in 0..col_rows {
                            acc = weight[o * col_rows + p].mul_add(col[p * plane + j], acc);
                        }
                        want.push(acc);
                    }
                }
            }
            let mut out = vec![MaybeUninit::uninit(); want.len()];
            let got = conv2d_lanes(&x, &weight, None, &w, out_channels, &mut out).unwrap();
            assert_eq!(bits(got), bits(&want), "{w:?}");
        }
    }

    #[test]
    fn rejects_planes_and_lengths_it_does_not_take() {
        let odd = Window2d::new(1, (7, 7), (3, 3), (1, 1), (1, 1)).unwrap();
        assert!(!conv2d_lanes_fits(&odd));
        let mut out = vec![MaybeUninit::uninit(); 49];
        assert!(conv2d_lanes(&[0.0; 49], &[0.0; 9], None, &odd, 1, &mut out).is_err());
        let w = Window2d::new(1, (8, 8), (3, 3), (1, 1), (1, 1)).unwrap();
        let mut out = vec![MaybeUninit::uninit(); 64];
        assert!(conv2d_lanes(&[0.0; 63], &[0.0; 9], None, &w, 1, &mut out).is_err());
        assert!(conv2d_lanes(&[0.0; 64], &[0.0; 8], None, &w, 1, &mut out).is_err());
        assert!(conv2d_lanes(&[0.0; 64], &[0.0; 9], Some(&[0.0; 2]), &w, 1, &mut out).is_err());
        let mut short = vec![MaybeUninit::uninit(); 63];
        assert!(conv2d_lanes(&[0.0; 64], &[0.0; 9], None, &w, 1, &mut short).is_err());
    }
}
