//! Column blocks of a row-major `[outer, inner]` tensor, the layout of split layers: weights split
//! by input features, features of activations across ranks, and channels of NCHW tensors (`inner`
//! = channels · H · W). The copies are the engine's column ops (`Tensor::narrow_columns`,
//! `pack_columns`, `unpack_columns`, `cat_columns`), which run where the tensors live.
use conveyor_engine::collective::Partition;
use conveyor_engine::{Device, Result, Shape, Tensor};

/// The width of every rank's block.
pub(crate) fn widths(parts: &Partition) -> Vec<usize> {
    (0..parts.n_ranks()).map(|rank| parts.len(rank)).collect()
}

/// Rank `rank`'s block of columns of `full` `[outer, parts.total()]`, as a tensor of `dims` on
/// `device` (cut where `full` lives, then moved: no copy when that is `device`).
pub(crate) fn column_block(
    full: &Tensor,
    outer: usize,
    parts: &Partition,
    rank: usize,
    dims: Vec<usize>,
    device: &Device,
) -> Result<Tensor> {
    let range = parts.range(rank);
    full.narrow_columns(outer, range.start, range.len(), dims)?.move_to_device(device)
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
    use conveyor_engine::{Device, Tensor};

    use super::*;

    #[test]
    fn pack_and_unpack_are_inverse() {
        let parts = Partition::even(5, 3).unwrap(); // 2, 2, 1
        let host = Device::host();
        let full = Tensor::from_vec((0..10).map(|i| i as f32).collect(), [2, 5], &host).unwrap();
        let packed = full.pack_columns(2, &widths(&parts)).unwrap();
        assert_eq!(packed.to_vec_f32(), [0., 1., 5., 6., 2., 3., 7., 8., 4., 9.]);
        let back = Tensor::unpack_columns(&packed, 2, &widths(&parts), [2, 5]).unwrap();
        assert!(back.bit_eq(&full));
        let block = column_block(&full, 2, &parts, 1, vec![2, 2], &host).unwrap();
        assert_eq!(block.to_vec_f32(), [2., 3., 7., 8.]);
    }
}
