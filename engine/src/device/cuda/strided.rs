//! Strided copies on one GPU: rows of a block of columns between two buffers
//! ([`CudaStream::copy_rows`]), the GPU side of the column ops (`device/ops/columns.rs`).
use super::buffer::CudaBuffer;
use super::stream::CudaStream;
use crate::{Error, Result};

impl CudaStream {
    /// Copies `rows` rows of `width` elements from `src` (rows `src_stride` apart, the first at
    /// `src_at`) to `dst` (rows `dst_stride` apart, the first at `dst_at`), both on this stream's
    /// GPU: one device-to-device copy when both sides are contiguous, otherwise one per row.
    #[allow(clippy::too_many_arguments)]
    pub fn copy_rows(
        &self,
        src: &CudaBuffer<f32>,
        src_at: usize,
        src_stride: usize,
        dst: &mut CudaBuffer<f32>,
        dst_at: usize,
        dst_stride: usize,
        rows: usize,
        width: usize,
    ) -> Result<()> {
        let op = "copy_rows";
        self.check_on_device(op, src)?;
        self.check_on_device(op, dst)?;
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let end = |at: usize, stride: usize| at + (rows - 1) * stride + width;
        if end(src_at, src_stride) > src.len() || end(dst_at, dst_stride) > dst.len() {
            return Err(Error::shape(
                op,
                format!("{rows} rows of {width} within {} and {} elements", src.len(), dst.len()),
                format!("rows {src_stride} and {dst_stride} apart from {src_at} and {dst_at}"),
            ));
        }
        let runs = if src_stride == width && dst_stride == width { 1 } else { rows };
        let len = if runs == 1 { rows * width } else { width };
        for row in 0..runs {
            let (from, to) = (src_at + row * src_stride, dst_at + row * dst_stride);
            self.raw
                .memcpy_dtod(&src.slice.slice(from..from + len), &mut dst.slice.slice_mut(to..to + len))
                .map_err(|err| self.driver_error("copying rows on the GPU", err))?;
        }
        Ok(())
    }
}
