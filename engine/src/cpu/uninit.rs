//! Kernels that write every element of an uninitialised output, for tensors made by
//! `Tensor::from_f32_init` without a zero-fill. Each takes the output as `&mut [MaybeUninit<f32>]`
//! and, having written all of it, returns it as `&mut [f32]`: that returned slice is the proof of
//! initialisation `from_f32_init` checks. No `&mut [f32]` ever covers memory not yet written.
//! The matrix product of this kind is `gemm::matmul_uninit`.
use std::mem::MaybeUninit;

use super::window::check_len;
use crate::{Error, Result};

/// `dst` as `&mut [f32]`.
///
/// # Safety
/// Every element of `dst` must have been written.
pub(crate) unsafe fn assume_init(dst: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    // SAFETY: `MaybeUninit<f32>` has the layout of `f32`, and the caller guarantees every element
    // is initialised.
    unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<f32>(), dst.len()) }
}

/// Writes `value` into every element.
pub fn fill(dst: &mut [MaybeUninit<f32>], value: f32) -> &mut [f32] {
    dst.iter_mut().for_each(|d| {
        d.write(value);
    });
    // SAFETY: every element was written just above.
    unsafe { assume_init(dst) }
}

/// `dst = src`.
pub fn copy<'a>(dst: &'a mut [MaybeUninit<f32>], src: &[f32]) -> Result<&'a mut [f32]> {
    check_len("uninit::copy", "dst", src.len(), dst.len())?;
    // SAFETY: both slices hold `src.len()` elements, `dst` is exclusively borrowed so the two
    // cannot overlap, and `MaybeUninit<f32>` has the layout of `f32`.
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<f32>(), src.len());
        Ok(assume_init(dst))
    }
}

/// `dst[i] = f(src[i])`.
pub fn map<'a>(dst: &'a mut [MaybeUninit<f32>], src: &[f32], f: impl Fn(f32) -> f32) -> Result<&'a mut [f32]> {
    check_len("uninit::map", "dst", src.len(), dst.len())?;
    for (d, &s) in dst.iter_mut().zip(src) {
        d.write(f(s));
    }
    // SAFETY: the lengths are equal, so the loop wrote every element.
    Ok(unsafe { assume_init(dst) })
}

/// `dst[i] = f(lhs[i], rhs[i])`.
pub fn map2<'a>(
    dst: &'a mut [MaybeUninit<f32>],
    lhs: &[f32],
    rhs: &[f32],
    f: impl Fn(f32, f32) -> f32,
) -> Result<&'a mut [f32]> {
    check_len("uninit::map2", "rhs", lhs.len(), rhs.len())?;
    check_len("uninit::map2", "dst", lhs.len(), dst.len())?;
    for ((d, &a), &b) in dst.iter_mut().zip(lhs).zip(rhs) {
        d.write(f(a, b));
    }
    // SAFETY: the three lengths are equal, so the loop wrote every element.
    Ok(unsafe { assume_init(dst) })
}

/// Copies `row` into every row of `dst` (rows of `row.len()` elements): the bias pre-fill that a
/// matrix product then accumulates onto.
pub fn broadcast_rows<'a>(row: &[f32], dst: &'a mut [MaybeUninit<f32>]) -> Result<&'a mut [f32]> {
    if row.is_empty() || !dst.len().is_multiple_of(row.len()) {
        return Err(Error::shape(
            "broadcast_rows",
            format!("rows of {} elements", row.len()),
            format!("{} elements", dst.len()),
        ));
    }
    for chunk in dst.chunks_exact_mut(row.len()) {
        copy(chunk, row)?;
    }
    // SAFETY: `dst` is a whole number of rows, each written by `copy`.
    Ok(unsafe { assume_init(dst) })
}

/// Fills each of the `dst.len() / plane_len` consecutive planes with its own value from
/// `values`, cycling (`dst` holds whole repetitions of `values.len()` planes): a per-channel
/// bias pre-fill.
pub fn fill_planes<'a>(values: &[f32], plane_len: usize, dst: &'a mut [MaybeUninit<f32>]) -> Result<&'a mut [f32]> {
    let block = values.len() * plane_len;
    if block == 0 || !dst.len().is_multiple_of(block) {
        return Err(Error::shape(
            "fill_planes",
            format!("a multiple of {} planes of {plane_len} elements", values.len()),
            format!("{} elements", dst.len()),
        ));
    }
    for (plane, &value) in dst.chunks_exact_mut(plane_len).zip(values.iter().cycle()) {
        fill(plane, value);
    }
    // SAFETY: `dst` is a whole number of planes, each filled.
    Ok(unsafe { assume_init(dst) })
}

/// Writes the items of `values` in order; an error (with `dst` left unusable) when it yields
/// fewer items than `dst` holds. Extra items are not consumed.
pub fn collect(dst: &mut [MaybeUninit<f32>], values: impl IntoIterator<Item = f32>) -> Result<&mut [f32]> {
    let mut values = values.into_iter();
    for (written, d) in dst.iter_mut().enumerate() {
        let Some(value) = values.next() else {
            return Err(Error::shape(
                "uninit::collect",
                format!("{} values", written + 1),
                format!("{written} values"),
            ));
        };
        d.write(value);
    }
    // SAFETY: the loop wrote every element (it returns early otherwise).
    Ok(unsafe { assume_init(dst) })
}

/// Runs `init(index, chunk)` on consecutive chunks of `chunk_len` elements (`dst` must hold a
/// whole number of them); each call must return its chunk written in full, as the kernels here
/// and `gemm::matmul_uninit` do. Then returns all of `dst`.
pub fn chunks<'a, F>(dst: &'a mut [MaybeUninit<f32>], chunk_len: usize, mut init: F) -> Result<&'a mut [f32]>
where
    F: for<'c> FnMut(usize, &'c mut [MaybeUninit<f32>]) -> Result<&'c mut [f32]>,
{
    if chunk_len == 0 || !dst.len().is_multiple_of(chunk_len) {
        return Err(Error::shape(
            "uninit::chunks",
            format!("a multiple of {chunk_len} elements"),
            format!("{}", dst.len()),
        ));
    }
    for (index, chunk) in dst.chunks_exact_mut(chunk_len).enumerate() {
        let start = chunk.as_ptr() as *const f32;
        let written = init(index, chunk)?;
        if written.as_ptr() != start || written.len() != chunk_len {
            return Err(Error::invalid(
                "uninit::chunks",
                "each call must return the chunk it was given, written in full",
            ));
        }
    }
    // SAFETY: every chunk was returned as `&mut [f32]` over exactly its own memory, which safe
    // code can only obtain by writing all of it; the chunks tile `dst`.
    Ok(unsafe { assume_init(dst) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buffer(n: usize) -> Vec<MaybeUninit<f32>> {
        (0..n).map(|_| MaybeUninit::uninit()).collect()
    }

    #[test]
    fn every_kernel_writes_its_whole_output() {
        let mut out = buffer(6);
        assert_eq!(fill(&mut out, 2.0), &[2.0; 6]);
        let src = [1.0, -2.0, 3.0, -4.0, 5.0, -6.0];
        assert_eq!(copy(&mut buffer(6), &src).unwrap(), &src);
        assert_eq!(map(&mut buffer(6), &src, f32::abs).unwrap(), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(map2(&mut buffer(6), &src, &src, |a, b| a * b).unwrap()[5], 36.0);
        assert_eq!(broadcast_rows(&[7.0, 8.0], &mut buffer(6)).unwrap(), &[7.0, 8.0, 7.0, 8.0, 7.0, 8.0]);
        assert_eq!(fill_planes(&[1.0, 2.0], 2, &mut buffer(8)).unwrap(), &[1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0]);
        assert_eq!(collect(&mut buffer(3), [1.0, 2.0, 3.0, 4.0]).unwrap(), &[1.0, 2.0, 3.0]);
        let mut out = buffer(6);
        let tiled = chunks(&mut out, 2, |i, chunk| Ok(fill(chunk, i as f32))).unwrap();
        assert_eq!(tiled, &[0.0, 0.0, 1.0, 1.0, 2.0, 2.0]);
    }

    #[test]
    fn chunks_reject_a_slice_other_than_the_chunk() {
        let mut taken = Some(Box::leak(vec![0.0f32; 2].into_boxed_slice()));
        let mut out = buffer(4);
        let result = chunks(&mut out, 2, |_, chunk| match taken.take() {
            Some(elsewhere) => Ok(elsewhere),
            None => Ok(fill(chunk, 1.0)),
        });
        assert!(result.is_err());
        assert!(collect(&mut buffer(3), [1.0, 2.0]).is_err());
    }

    #[test]
    fn mismatched_lengths_are_errors() {
        assert!(copy(&mut buffer(5), &[0.0; 6]).is_err());
        assert!(map(&mut buffer(5), &[0.0; 6], |x| x).is_err());
        assert!(map2(&mut buffer(6), &[0.0; 6], &[0.0; 5], |a, _| a).is_err());
        assert!(broadcast_rows(&[1.0, 2.0], &mut buffer(5)).is_err());
        assert!(fill_planes(&[1.0, 2.0], 2, &mut buffer(6)).is_err());
    }
}
