//! im2col and col2im for one NCHW sample: they turn a 2-D convolution into one matrix product
//! (`weight [out_ch, in_ch*kh*kw] · col [in_ch*kh*kw, out_h*out_w]`) and its input gradient into a
//! product followed by a scatter-add.
//!
//! The col matrix is row-major with row `(channel, kernel_row, kernel_col)` and column
//! `(out_row, out_col)`, matching PyTorch's weight layout `[out_ch, in_ch, kh, kw]` flattened.
use super::window::{Window2d, check_len};
use crate::Result;

/// Writes the im2col matrix of one sample `input` (`channels x in_h x in_w`) into `col`
/// (`col_rows x out_h*out_w`); padded positions become zero.
pub fn im2col(input: &[f32], window: &Window2d, col: &mut [f32]) -> Result<()> {
    let (out_h, out_w) = (window.out_height(), window.out_width());
    check_len("im2col", "input", window.input_len(), input.len())?;
    check_len("im2col", "col", window.col_rows() * out_h * out_w, col.len())?;
    let out_plane = out_h * out_w;
    let mut rows = col.chunks_exact_mut(out_plane);
    for plane in input.chunks_exact(window.in_plane_len()) {
        for kernel_row in 0..window.kernel_height {
            for kernel_col in 0..window.kernel_width {
                let col_row = rows.next().expect("col holds col_rows rows, checked above");
                for (out_row, dst) in col_row.chunks_exact_mut(out_w).enumerate() {
                    let Some(in_row) = window.input_row(out_row, kernel_row) else {
                        dst.fill(0.0);
                        continue;
                    };
                    let src = &plane[in_row * window.in_width..(in_row + 1) * window.in_width];
                    if window.stride_width == 1 {
                        copy_shifted_row(src, kernel_col as isize - window.pad_width as isize, dst);
                    } else {
                        for (out_col, d) in dst.iter_mut().enumerate() {
                            *d = window.input_col(out_col, kernel_col).map_or(0.0, |c| src[c]);
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Adds the columns of `col` (`col_rows x out_h*out_w`, as produced by [`im2col`]) back onto the
/// input positions they were read from: `input_grad += col2im(col)`.
pub fn col2im(col: &[f32], window: &Window2d, input_grad: &mut [f32]) -> Result<()> {
    let (out_h, out_w) = (window.out_height(), window.out_width());
    check_len("col2im", "input_grad", window.input_len(), input_grad.len())?;
    check_len("col2im", "col", window.col_rows() * out_h * out_w, col.len())?;
    let out_plane = out_h * out_w;
    let mut rows = col.chunks_exact(out_plane);
    for plane in input_grad.chunks_exact_mut(window.in_plane_len()) {
        for kernel_row in 0..window.kernel_height {
            for kernel_col in 0..window.kernel_width {
                let col_row = rows.next().expect("col holds col_rows rows, checked above");
                for (out_row, src) in col_row.chunks_exact(out_w).enumerate() {
                    let Some(in_row) = window.input_row(out_row, kernel_row) else { continue };
                    let dst = &mut plane[in_row * window.in_width..(in_row + 1) * window.in_width];
                    for (out_col, s) in src.iter().enumerate() {
                        if let Some(c) = window.input_col(out_col, kernel_col) {
                            dst[c] += *s;
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// `dst[j] = src[j + shift]` where that index is inside `src`, else 0 (stride-1 rows).
fn copy_shifted_row(src: &[f32], shift: isize, dst: &mut [f32]) {
    let first_valid = (-shift).clamp(0, dst.len() as isize) as usize;
    let last_valid = (src.len() as isize - shift).clamp(first_valid as isize, dst.len() as isize) as usize;
    dst[..first_valid].fill(0.0);
    let start = (first_valid as isize + shift) as usize;
    dst[first_valid..last_valid].copy_from_slice(&src[start..start + (last_valid - first_valid)]);
    dst[last_valid..].fill(0.0);
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
        for (stride, pad) in [((1, 1), (1, 1)), ((2, 2), (1, 1)), ((1, 2), (0, 2)), ((3, 1), (2, 0))] {
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
    fn rejects_wrong_lengths() {
        let w = Window2d::new(1, (4, 4), (3, 3), (1, 1), (0, 0)).unwrap();
        assert!(im2col(&[0.0; 15], &w, &mut [0.0; 36]).is_err());
        assert!(col2im(&[0.0; 35], &w, &mut [0.0; 16]).is_err());
    }
}
