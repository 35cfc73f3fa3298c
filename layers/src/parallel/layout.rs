//! Moving between a full row-major `[outer, inner]` buffer and its column blocks laid out one rank
//! after another (the layout collectives use): splitting weights by input features, features of
//! activations across ranks, and channels of NCHW tensors (`inner` = channels · H · W).
use conveyor_engine::collective::Partition;
use conveyor_engine::{DType, Device, Error, Result, Shape, Tensor};

/// `full` `[outer, parts.total()]` → rank `r`'s block `[outer, parts.len(r)]` at
/// `parts.scaled(outer).range(r)` of the result.
pub(crate) fn pack_columns(full: &[f32], outer: usize, parts: &Partition, dst: &mut [f32]) -> Result<()> {
    let inner = parts.total();
    check(full.len(), dst.len(), outer * inner)?;
    let mut at = 0;
    for rank in 0..parts.n_ranks() {
        let range = parts.range(rank);
        for row in full.chunks_exact(inner.max(1)).take(outer) {
            let block = &row[range.clone()];
            dst[at..at + block.len()].copy_from_slice(block);
            at += block.len();
        }
    }
    Ok(())
}

/// The inverse of [`pack_columns`].
pub(crate) fn unpack_columns(rank_major: &[f32], outer: usize, parts: &Partition, dst: &mut [f32]) -> Result<()> {
    let inner = parts.total();
    check(rank_major.len(), dst.len(), outer * inner)?;
    let mut at = 0;
    for rank in 0..parts.n_ranks() {
        let range = parts.range(rank);
        for row in dst.chunks_exact_mut(inner.max(1)).take(outer) {
            row[range.clone()].copy_from_slice(&rank_major[at..at + range.len()]);
            at += range.len();
        }
    }
    Ok(())
}

fn check(src: usize, dst: usize, expected: usize) -> Result<()> {
    if src != expected || dst != expected {
        return Err(Error::shape("tensor-parallel layout", format!("{expected} elements"), format!("{src} and {dst}")));
    }
    Ok(())
}

/// Rank `rank`'s block of columns of `full` `[outer, parts.total()]`, as a tensor of `dims` on `device`.
pub(crate) fn column_block(
    full: &[f32],
    outer: usize,
    parts: &Partition,
    rank: usize,
    dims: Vec<usize>,
    device: &Device,
) -> Result<Tensor> {
    let inner = parts.total();
    let range = parts.range(rank);
    let mut block = Tensor::zeros(dims, DType::F32, device)?;
    let dst = block.as_f32_mut()?;
    if dst.len() != outer * range.len() || full.len() != outer * inner {
        return Err(Error::shape(
            "tensor-parallel split",
            format!("{} elements", outer * range.len()),
            dst.len().to_string(),
        ));
    }
    for (row, out) in full.chunks_exact(inner.max(1)).zip(dst.chunks_exact_mut(range.len().max(1))) {
        out.copy_from_slice(&row[range.clone()]);
    }
    Ok(block)
}

/// Writes `block` `[outer, parts.len(rank)]` into its columns of `full` `[outer, parts.total()]`.
pub(crate) fn write_column_block(full: &mut [f32], outer: usize, parts: &Partition, rank: usize, block: &[f32]) {
    let inner = parts.total();
    let range = parts.range(rank);
    for (row, src) in full.chunks_exact_mut(inner.max(1)).take(outer).zip(block.chunks_exact(range.len().max(1))) {
        row[range.clone()].copy_from_slice(src);
    }
}

/// `dims` with the last dimension replaced by `last`.
pub(crate) fn with_last(shape: &Shape, last: usize) -> Vec<usize> {
    let mut dims = shape.dims().to_vec();
    if let Some(d) = dims.last_mut() {
        *d = last;
    }
    dims
}

/// `dims` with dimension 1 (channels) replaced by `channels`.
pub(crate) fn with_channels(shape: &Shape, channels: usize) -> Vec<usize> {
    let mut dims = shape.dims().to_vec();
    if let Some(d) = dims.get_mut(1) {
        *d = channels;
    }
    dims
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_and_unpack_are_inverse() {
        let parts = Partition::even(5, 3).unwrap(); // 2, 2, 1
        let full: Vec<f32> = (0..10).map(|i| i as f32).collect(); // [2, 5]
        let mut packed = vec![0.0; 10];
        pack_columns(&full, 2, &parts, &mut packed).unwrap();
        assert_eq!(packed, [0., 1., 5., 6., 2., 3., 7., 8., 4., 9.]);
        let mut back = vec![0.0; 10];
        unpack_columns(&packed, 2, &parts, &mut back).unwrap();
        assert_eq!(back, full);
    }
}
