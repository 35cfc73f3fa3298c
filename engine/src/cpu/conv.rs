//! im2col and col2im for one NCHW sample: they turn a 2-D convolution into one matrix product
//! (`weight [out_ch, in_ch*kh*kw] · col [in_ch*kh*kw, out_h*out_w]`) and its input gradient into a
//! product followed by a scatter-add, or (stride 1) into a product over the output gradient's
//! im2col with flipped kernels ([`flip_kernels`], [`Window2d::input_grad_window`]).
//!
//! The col matrix is row-major with row `(channel, kernel_row, kernel_col)` and column
//! `(out_row, out_col)`, matching PyTorch's weight layout `[out_ch, in_ch, kh, kw]` flattened.
use super::window::{Window2d, check_len};
use crate::{Error, Result};

/// im2col through a zero-bordered copy of each sample: the sample's planes are copied once into a
/// scratch whose border stays zero, then every col row is a sequence of branch-free row copies
/// (fixed-width copies for the common output widths). Reuse one per batch: the scratch is
/// allocated once.
#[derive(Debug)]
pub struct Im2col {
    window: Window2d,
    /// `channels x padded_height x padded_width`; empty when the window has no padding (the input
    /// is read in place). Only the interior is ever written, so the border stays zero.
    padded: Vec<f32>,
}

impl Im2col {
    /// A scratch for `window` (zeroed once here).
    pub fn new(window: &Window2d) -> Im2col {
        let padded =
            if window.pad_height == 0 && window.pad_width == 0 { Vec::new() } else { vec![0.0; padded_len(window)] };
        Im2col { window: *window, padded }
    }

    /// The window this scratch was made for.
    pub fn window(&self) -> &Window2d {
        &self.window
    }

    /// Writes the im2col matrix of one sample `input` (`channels x in_h x in_w`) into `col`
    /// (`col_rows x out_h*out_w`), every element; padded positions become zero.
    pub fn run(&mut self, input: &[f32], col: &mut [f32]) -> Result<()> {
        let w = self.window;
        check_len("im2col", "col", w.col_rows() * w.out_plane_len(), col.len())?;
        self.run_strided(input, col, w.out_plane_len())
    }

    /// Like [`Im2col::run`], with col row `r` at `col[r * row_stride..][..out_h*out_w]` (so that
    /// several samples' rows can sit side by side); elements between rows are left alone.
    pub fn run_strided(&mut self, input: &[f32], col: &mut [f32], row_stride: usize) -> Result<()> {
        let w = self.window;
        let plane = w.out_plane_len();
        check_len("im2col", "input", w.input_len(), input.len())?;
        if row_stride < plane || col.len() < (w.col_rows().max(1) - 1) * row_stride + plane {
            return Err(Error::shape(
                "im2col",
                format!("{} rows of {plane} elements {row_stride} apart", w.col_rows()),
                format!("{} elements", col.len()),
            ));
        }
        if self.padded.is_empty() {
            gather_rows(input, (w.in_height, w.in_width), &w, col, row_stride);
            return Ok(());
        }
        let (padded_height, padded_width) = padded_dims(&w);
        let padded_plane = padded_height * padded_width;
        for (src, dst) in input.chunks_exact(w.in_plane_len()).zip(self.padded.chunks_exact_mut(padded_plane)) {
            for (row, src_row) in src.chunks_exact(w.in_width).enumerate() {
                let start = (row + w.pad_height) * padded_width + w.pad_width;
                dst[start..start + w.in_width].copy_from_slice(src_row);
            }
        }
        gather_rows(&self.padded, (padded_height, padded_width), &w, col, row_stride);
        Ok(())
    }
}

fn padded_dims(w: &Window2d) -> (usize, usize) {
    (w.in_height + 2 * w.pad_height, w.in_width + 2 * w.pad_width)
}

fn padded_len(w: &Window2d) -> usize {
    let (h, wd) = padded_dims(w);
    w.channels * h * wd
}

/// im2col from planes `src` of `src_height x src_width` that already hold the padding: every
/// window position is inside `src`, so each col row is plain copies (no bounds cases).
fn gather_rows(src: &[f32], (src_height, src_width): (usize, usize), w: &Window2d, col: &mut [f32], row_stride: usize) {
    let (out_h, out_w) = (w.out_height(), w.out_width());
    let src_plane = src_height * src_width;
    let row_step = w.stride_height * src_width;
    let mut row = 0;
    for plane in src.chunks_exact(src_plane) {
        for kernel_row in 0..w.kernel_height {
            for kernel_col in 0..w.kernel_width {
                let dst = &mut col[row * row_stride..row * row_stride + out_h * out_w];
                row += 1;
                let start = kernel_row * src_width + kernel_col;
                if w.stride_width == 1 {
                    match out_w {
                        4 => copy_rows::<4>(plane, start, row_step, dst),
                        8 => copy_rows::<8>(plane, start, row_step, dst),
                        16 => copy_rows::<16>(plane, start, row_step, dst),
                        32 => copy_rows::<32>(plane, start, row_step, dst),
                        _ => {
                            for (i, d) in dst.chunks_exact_mut(out_w).enumerate() {
                                let s = start + i * row_step;
                                d.copy_from_slice(&plane[s..s + out_w]);
                            }
                        }
                    }
                } else {
                    for (i, d) in dst.chunks_exact_mut(out_w).enumerate() {
                        let s = &plane[start + i * row_step..];
                        for (j, v) in d.iter_mut().enumerate() {
                            *v = s[j * w.stride_width];
                        }
                    }
                }
            }
        }
    }
}

/// Row copies of a width known at compile time (inlined vector moves instead of `memcpy` calls).
#[inline(always)]
fn copy_rows<const N: usize>(plane: &[f32], start: usize, row_step: usize, dst: &mut [f32]) {
    for (i, d) in dst.chunks_exact_mut(N).enumerate() {
        let s = start + i * row_step;
        let d: &mut [f32; N] = d.try_into().expect("chunks of N");
        let s: &[f32; N] = plane[s..s + N].try_into().expect("a slice of N");
        *d = *s;
    }
}

/// Writes the im2col matrix of one sample `input` (`channels x in_h x in_w`) into `col`
/// (`col_rows x out_h*out_w`); padded positions become zero. Allocates a scratch when the window
/// is padded: for a batch, keep one [`Im2col`].
pub fn im2col(input: &[f32], window: &Window2d, col: &mut [f32]) -> Result<()> {
    Im2col::new(window).run(input, col)
}

/// Adds the columns of `col` (`col_rows x out_h*out_w`, as produced by [`im2col`]) back onto the
/// input positions they were read from: `input_grad += col2im(col)`. The valid output rows and
/// columns of each kernel offset are computed once, so the inner loops have no bounds cases.
pub fn col2im(col: &[f32], window: &Window2d, input_grad: &mut [f32]) -> Result<()> {
    let w = window;
    let (out_h, out_w) = (w.out_height(), w.out_width());
    check_len("col2im", "input_grad", w.input_len(), input_grad.len())?;
    check_len("col2im", "col", w.col_rows() * out_h * out_w, col.len())?;
    let mut rows = col.chunks_exact(out_h * out_w);
    for plane in input_grad.chunks_exact_mut(w.in_plane_len()) {
        for kernel_row in 0..w.kernel_height {
            let row_range = valid_range(out_h, w.in_height, w.stride_height, w.pad_height, kernel_row);
            for kernel_col in 0..w.kernel_width {
                let col_row = rows.next().expect("col holds col_rows rows, checked above");
                let cols = valid_range(out_w, w.in_width, w.stride_width, w.pad_width, kernel_col);
                if cols.is_empty() {
                    continue;
                }
                let first_in_col = cols.start * w.stride_width + kernel_col - w.pad_width;
                for out_row in row_range.clone() {
                    let in_row = out_row * w.stride_height + kernel_row - w.pad_height;
                    let src = &col_row[out_row * out_w + cols.start..out_row * out_w + cols.end];
                    let dst = &mut plane[in_row * w.in_width + first_in_col..];
                    if w.stride_width == 1 {
                        for (d, s) in dst[..src.len()].iter_mut().zip(src) {
                            *d += *s;
                        }
                    } else {
                        for (d, s) in dst.iter_mut().step_by(w.stride_width).zip(src) {
                            *d += *s;
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// The output positions `o < out_len` whose input position `o * stride + kernel - pad` lies in
/// `0..in_len`.
fn valid_range(out_len: usize, in_len: usize, stride: usize, pad: usize, kernel: usize) -> std::ops::Range<usize> {
    let lo = if pad > kernel { (pad - kernel).div_ceil(stride) } else { 0 };
    let hi = if in_len + pad > kernel { ((in_len + pad - kernel - 1) / stride + 1).min(out_len) } else { 0 };
    lo.min(hi)..hi
}

/// The kernels of `weight` (`[out_channels, in_channels, kh, kw]`) transposed and flipped for the
/// gather-form input gradient: `dst[i][o][kh-1-r][kw-1-c] = weight[o][i][r][c]`, so that
/// `dx = dst [in, out·kh·kw] · im2col(dy)` over [`Window2d::input_grad_window`].
pub fn flip_kernels(weight: &[f32], out_channels: usize, window: &Window2d, dst: &mut [f32]) -> Result<()> {
    let (kh, kw, in_channels) = (window.kernel_height, window.kernel_width, window.channels);
    let kernel = kh * kw;
    check_len("flip_kernels", "weight", out_channels * in_channels * kernel, weight.len())?;
    check_len("flip_kernels", "dst", out_channels * in_channels * kernel, dst.len())?;
    for (o, filter) in weight.chunks_exact(in_channels * kernel).enumerate() {
        for (i, src) in filter.chunks_exact(kernel).enumerate() {
            let out = &mut dst[(i * out_channels + o) * kernel..][..kernel];
            for (d, s) in out.iter_mut().zip(src.iter().rev()) {
                *d = *s;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Direct im2col by definition, for comparison.
    fn naive_im2col(input: &[f32], w: &Window2d) -> Vec<f32> {
        let (oh, ow) = (w.out_height(), w.out_width());
        let mut col = Vec::new();
        for c in 0..w.channels {
            for ki in 0..w.kernel_height {
                for kj in 0..w.kernel_width {
                    for i in 0..oh {
                        for j in 0..ow {
                            let r = (i * w.stride_height + ki) as isize - w.pad_height as isize;
                            let s = (j * w.stride_width + kj) as isize - w.pad_width as isize;
                            let inside = r >= 0 && s >= 0 && (r as usize) < w.in_height && (s as usize) < w.in_width;
                            col.push(if inside {
                                input[c * w.in_plane_len() + r as usize * w.in_width + s as usize]
                            } else {
                                0.0
                            });
                        }
                    }
                }
            }
        }
        col
    }

    #[test]
    fn im2col_matches_definition_and_col2im_is_its_adjoint() {
        for (stride, pad) in [((1, 1), (1, 1)), ((2, 2), (1, 1)), ((1, 2), (0, 2)), ((3, 1), (2, 0)), ((2, 3), (0, 0))]
        {
            let w = Window2d::new(2, (5, 6), (3, 2), stride, pad).unwrap();
            let input: Vec<f32> = (0..w.input_len()).map(|i| (i as f32 * 0.7).sin()).collect();
            let mut col = vec![f32::NAN; w.col_rows() * w.out_plane_len()];
            im2col(&input, &w, &mut col).unwrap();
            assert_eq!(col, naive_im2col(&input, &w));
            // Adjoint: <im2col(x), c> == <x, col2im(c)> for any x, c.
            let c: Vec<f32> = (0..col.len()).map(|i| (i as f32 * 0.3).cos()).collect();
            let mut back = vec![0.0; input.len()];
            col2im(&c, &w, &mut back).unwrap();
            let lhs: f64 = col.iter().zip(&c).map(|(a, b)| (*a as f64) * (*b as f64)).sum();
            let rhs: f64 = input.iter().zip(&back).map(|(a, b)| (*a as f64) * (*b as f64)).sum();
            assert!((lhs - rhs).abs() < 1e-4 * (1.0 + lhs.abs()), "{lhs} vs {rhs}");
        }
    }

    #[test]
    fn fast_im2col_matches_definition_at_every_fixed_width() {
        // Output widths 4, 8, 16, 32 take the fixed-width copies; 7 and strided ones the general rows.
        for (side, kernel, stride, pad) in
            [(8, 3, 1, 1), (4, 3, 1, 1), (16, 3, 1, 1), (32, 5, 1, 2), (30, 3, 1, 0), (9, 3, 2, 1), (8, 1, 1, 0)]
        {
            let w = Window2d::new(3, (side, side), (kernel, kernel), (stride, stride), (pad, pad)).unwrap();
            let input: Vec<f32> = (0..w.input_len()).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut scratch = Im2col::new(&w);
            for _ in 0..2 {
                // Twice: the scratch's border must stay zero across samples.
                let mut col = vec![f32::NAN; w.col_rows() * w.out_plane_len()];
                scratch.run(&input, &mut col).unwrap();
                assert_eq!(col, naive_im2col(&input, &w), "side {side} kernel {kernel} stride {stride} pad {pad}");
            }
        }
    }

    #[test]
    fn gather_form_input_gradient_equals_the_col2im_scatter() {
        for (in_ch, out_ch, side, kernel, pad) in [(1, 8, 8, 3, 1), (3, 2, 5, 3, 0), (2, 3, 6, 5, 2), (4, 2, 5, 1, 0)] {
            let w = Window2d::new(in_ch, (side, side + 1), (kernel, kernel), (1, 1), (pad, pad)).unwrap();
            let weight: Vec<f32> = (0..out_ch * w.col_rows()).map(|i| (i as f32 * 0.91).cos()).collect();
            let dy: Vec<f32> = (0..out_ch * w.out_plane_len()).map(|i| (i as f32 * 0.53).sin()).collect();
            // Scatter form: dx = col2im(weightᵀ · dy), by definition.
            let mut dcol = vec![0.0; w.col_rows() * w.out_plane_len()];
            for (r, d) in dcol.chunks_exact_mut(w.out_plane_len()).enumerate() {
                for (p, v) in d.iter_mut().enumerate() {
                    *v = (0..out_ch).map(|o| weight[o * w.col_rows() + r] * dy[o * w.out_plane_len() + p]).sum();
                }
            }
            let mut expected = vec![0.0; w.input_len()];
            col2im(&dcol, &w, &mut expected).unwrap();
            // Gather form: flipped kernels times im2col(dy) over the input-gradient window.
            let g = w.input_grad_window(out_ch).unwrap();
            assert_eq!((g.out_height(), g.out_width()), (w.in_height, w.in_width));
            let mut flipped = vec![0.0; weight.len()];
            flip_kernels(&weight, out_ch, &w, &mut flipped).unwrap();
            let mut col = vec![0.0; g.col_rows() * g.out_plane_len()];
            Im2col::new(&g).run(&dy, &mut col).unwrap();
            for (i, e) in expected.iter().enumerate() {
                let (c, p) = (i / w.in_plane_len(), i % w.in_plane_len());
                let got: f32 =
                    (0..g.col_rows()).map(|r| flipped[c * g.col_rows() + r] * col[r * g.out_plane_len() + p]).sum();
                assert!((got - e).abs() < 1e-4 * (1.0 + e.abs()), "element {i}: {got} vs {e}");
            }
        }
        let strided = Window2d::new(1, (6, 6), (3, 3), (2, 2), (1, 1)).unwrap();
        assert!(strided.input_grad_window(4).is_none());
        let wide_pad = Window2d::new(1, (6, 6), (3, 3), (1, 1), (3, 3)).unwrap();
        assert!(wide_pad.input_grad_window(4).is_none());
    }

    #[test]
    fn rejects_wrong_lengths() {
        let w = Window2d::new(1, (4, 4), (3, 3), (1, 1), (0, 0)).unwrap();
        assert!(im2col(&[0.0; 15], &w, &mut [0.0; 36]).is_err());
        assert!(col2im(&[0.0; 35], &w, &mut [0.0; 16]).is_err());
    }
}
