//! Matrix transpose in cache-sized blocks.
use crate::{Error, Result};

/// Writes the `cols x rows` transpose of the row-major `rows x cols` matrix `src` into `dst`.
pub fn transpose(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) -> Result<()> {
    if src.len() != rows * cols || dst.len() != rows * cols {
        return Err(Error::shape(
            "transpose",
            format!("{} elements for {rows}x{cols}", rows * cols),
            format!("src {} and dst {}", src.len(), dst.len()),
        ));
    }
    const BLOCK: usize = 32;
    for row_block in (0..rows).step_by(BLOCK) {
        for col_block in (0..cols).step_by(BLOCK) {
            for r in row_block..(row_block + BLOCK).min(rows) {
                let src_row = &src[r * cols..(r + 1) * cols];
                for c in col_block..(col_block + BLOCK).min(cols) {
                    dst[c * rows + r] = src_row[c];
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn transposes_non_square_matrices() {
        let (rows, cols) = (37, 70);
        let src: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let mut dst = vec![0.0; rows * cols];
        super::transpose(&src, rows, cols, &mut dst).unwrap();
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(dst[c * rows + r], src[r * cols + c]);
            }
        }
        assert!(super::transpose(&src, rows, cols + 1, &mut dst).is_err());
    }
}
