//! Small elementwise and reduction kernels the layers share: sums, bias broadcast and bias-gradient
//! column sums.
use super::window::check_len;
use crate::{Error, Result};

/// `output = lhs + rhs`, elementwise.
pub fn add(lhs: &[f32], rhs: &[f32], output: &mut [f32]) -> Result<()> {
    check_len("add", "rhs", lhs.len(), rhs.len())?;
    check_len("add", "output", lhs.len(), output.len())?;
    for ((o, &a), &b) in output.iter_mut().zip(lhs).zip(rhs) {
        *o = a + b;
    }
    Ok(())
}

/// Copies `row` into every row of `dst` (rows of `row.len()` elements): the bias pre-fill that a
/// matrix product then accumulates onto.
pub fn broadcast_rows(row: &[f32], dst: &mut [f32]) -> Result<()> {
    if row.is_empty() || !dst.len().is_multiple_of(row.len()) {
        return Err(Error::shape(
            "broadcast_rows",
            format!("rows of {} elements", row.len()),
            format!("{} elements", dst.len()),
        ));
    }
    for chunk in dst.chunks_exact_mut(row.len()) {
        chunk.copy_from_slice(row);
    }
    Ok(())
}

/// `column_sums[j] += Σ_r matrix[r, j]` for a row-major matrix with `column_sums.len()` columns
/// (the bias gradient of a Linear layer).
pub fn accumulate_column_sums(matrix: &[f32], column_sums: &mut [f32]) -> Result<()> {
    let cols = column_sums.len();
    if cols == 0 || !matrix.len().is_multiple_of(cols) {
        return Err(Error::shape(
            "accumulate_column_sums",
            format!("rows of {cols} elements"),
            format!("{} elements", matrix.len()),
        ));
    }
    // This matrix's sums first, then added: a batch's sums are the same whether its rows come in
    // one matrix or in several (micro-batches, or data-parallel replicas whose sums are added).
    let mut sums = vec![0.0f32; cols];
    for row in matrix.chunks_exact(cols) {
        sums.iter_mut().zip(row).for_each(|(s, &v)| *s += v);
    }
    column_sums.iter_mut().zip(&sums).for_each(|(s, &v)| *s += v);
    Ok(())
}

/// `row_sums[r] += Σ_j matrix[r, j]` for a row-major matrix with `row_sums.len()` rows (the bias
/// gradient of a convolution, one row per output channel).
pub fn accumulate_row_sums(matrix: &[f32], row_sums: &mut [f32]) -> Result<()> {
    let rows = row_sums.len();
    if rows == 0 || !matrix.len().is_multiple_of(rows) {
        return Err(Error::shape("accumulate_row_sums", format!("{rows} rows"), format!("{} elements", matrix.len())));
    }
    let cols = matrix.len() / rows;
    if cols == 0 {
        return Ok(());
    }
    for (s, row) in row_sums.iter_mut().zip(matrix.chunks_exact(cols)) {
        *s += row.iter().sum::<f32>();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_and_broadcasts() {
        let m = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut cols = [1.0f32; 3];
        accumulate_column_sums(&m, &mut cols).unwrap();
        assert_eq!(cols, [6.0, 8.0, 10.0]);
        let mut rows = [0.0f32; 2];
        accumulate_row_sums(&m, &mut rows).unwrap();
        assert_eq!(rows, [6.0, 15.0]);
        let mut dst = [0.0f32; 6];
        broadcast_rows(&[7.0, 8.0], &mut dst).unwrap();
        assert_eq!(dst, [7.0, 8.0, 7.0, 8.0, 7.0, 8.0]);
        let mut out = [0.0f32; 6];
        add(&m, &dst, &mut out).unwrap();
        assert_eq!(out[5], 14.0);
        assert!(accumulate_column_sums(&m, &mut [0.0; 4]).is_err());
    }
}
