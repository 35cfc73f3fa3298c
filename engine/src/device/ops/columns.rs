//! Column blocks as device ops: a tensor read as a row-major `[outer, inner]` matrix, cut into
//! blocks of columns or joined from them, on the tensor's device. These are the layouts of
//! tensor-parallel layers (a weight split by input features, activations split by features or
//! channels, blocks laid one after another for a collective): [`Tensor::narrow_columns`],
//! [`Tensor::cat_columns`], [`Tensor::pack_columns`] and [`Tensor::unpack_columns`].
//!
//! Every op is a copy (f32 tensors only), so results are the same bits on every device. On a CPU
//! device the rows are copied with `copy_from_slice`; on a GPU each block is one device-to-device
//! copy per row on this thread's stream (`CudaStream::copy_rows`).
use crate::tensor::{F32Mut, F32Ref};
use crate::{DType, Device, Error, Result, Shape, Tensor};

/// One block copy: `rows` rows of `width` elements from `src` (rows `src_stride` apart, starting
/// at `src_at`) to `dst` (rows `dst_stride` apart, starting at `dst_at`).
#[derive(Clone, Copy, Debug)]
struct Block {
    rows: usize,
    width: usize,
    src_at: usize,
    src_stride: usize,
    dst_at: usize,
    dst_stride: usize,
}

impl Block {
    fn on_host(&self, src: &[f32], dst: &mut [f32]) {
        if self.width == 0 {
            return;
        }
        for row in 0..self.rows {
            let (from, to) = (self.src_at + row * self.src_stride, self.dst_at + row * self.dst_stride);
            dst[to..to + self.width].copy_from_slice(&src[from..from + self.width]);
        }
    }
}

/// Checks that `tensor` holds `outer · inner` elements.
fn check_matrix(op: &str, tensor: &Tensor, outer: usize, inner: usize) -> Result<()> {
    if outer.checked_mul(inner) != Some(tensor.numel()) {
        return Err(Error::shape(op, format!("{outer} x {inner} elements"), tensor.shape().to_string()));
    }
    Ok(())
}

/// Checks that `shape` holds `expected` elements.
fn check_result(op: &str, shape: &Shape, expected: usize) -> Result<()> {
    if shape.numel() != expected {
        return Err(Error::shape(op, format!("a result of {expected} elements"), shape.to_string()));
    }
    Ok(())
}

/// A new f32 tensor of `shape` on `device` written by `blocks` copies from `src`, which must live
/// on `device`.
fn copy_blocks(op: &str, src: &Tensor, blocks: &[Block], shape: Shape, device: &Device) -> Result<Tensor> {
    if src.dtype() != DType::F32 {
        return Err(Error::UnsupportedDType { op: op.to_string(), dtype: src.dtype() });
    }
    let mut out = Tensor::zeros(shape, DType::F32, device)?;
    copy_blocks_into(op, src, blocks, &mut out)?;
    Ok(out)
}

/// `blocks` copies from `src` into `dst` (f32 tensors on one device).
fn copy_blocks_into(op: &str, src: &Tensor, blocks: &[Block], dst: &mut Tensor) -> Result<()> {
    let mismatch = |src: &Tensor, dst: &Tensor| Error::DeviceMismatch {
        op: op.to_string(),
        lhs: dst.device().to_string(),
        rhs: src.device().to_string(),
    };
    if !src.device().same_device(dst.device()) {
        return Err(mismatch(src, dst));
    }
    let error = mismatch(src, dst);
    match (src.f32_ref(op)?, dst.f32_mut(op)?) {
        (F32Ref::Host(src), F32Mut::Host(dst)) => {
            blocks.iter().for_each(|block| block.on_host(src, dst));
            Ok(())
        }
        (F32Ref::Cuda(src), F32Mut::Cuda(dst)) => {
            let stream = dst.device().thread_stream()?;
            for b in blocks {
                stream.copy_rows(src, b.src_at, b.src_stride, dst, b.dst_at, b.dst_stride, b.rows, b.width)?;
            }
            Ok(())
        }
        _ => Err(error),
    }
}

impl Tensor {
    /// Columns `start..start + len` of `self` read as a row-major `[outer, inner]` matrix (`inner`
    /// is `self.numel() / outer`): a new f32 tensor `[outer, len]`, shaped `shape`, on `self`'s
    /// device.
    ///
    /// ```
    /// use conveyor_engine::{Device, Tensor};
    /// let host = Device::host();
    /// let x = Tensor::from_vec((0..6).map(|i| i as f32).collect(), [2, 3], &host)?;
    /// assert_eq!(x.narrow_columns(2, 1, 2, [2, 2])?.to_vec_f32(), [1.0, 2.0, 4.0, 5.0]);
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn narrow_columns(&self, outer: usize, start: usize, len: usize, shape: impl Into<Shape>) -> Result<Tensor> {
        let op = "narrow_columns";
        let inner = self.numel().checked_div(outer).unwrap_or(0);
        check_matrix(op, self, outer, inner)?;
        if start + len > inner {
            return Err(Error::shape(
                op,
                format!("columns {start}..{} within {inner}", start + len),
                self.shape().to_string(),
            ));
        }
        let shape = shape.into();
        check_result(op, &shape, outer * len)?;
        let block = Block { rows: outer, width: len, src_at: start, src_stride: inner, dst_at: 0, dst_stride: len };
        copy_blocks(op, self, &[block], shape, self.device())
    }

    /// The blocks `[outer, w_i]` side by side: a new f32 tensor `[outer, Σ w_i]`, shaped `shape`,
    /// on `device` (every block must live there).
    ///
    /// ```
    /// use conveyor_engine::{Device, Tensor};
    /// let host = Device::host();
    /// let a = Tensor::from_vec(vec![0.0, 1.0, 3.0, 4.0], [2, 2], &host)?;
    /// let b = Tensor::from_vec(vec![2.0, 5.0], [2, 1], &host)?;
    /// let joined = Tensor::cat_columns(&[&a, &b], 2, [2, 3], &host)?;
    /// assert_eq!(joined.to_vec_f32(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn cat_columns(blocks: &[&Tensor], outer: usize, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        let op = "cat_columns";
        let widths: Vec<usize> = blocks.iter().map(|b| b.numel().checked_div(outer).unwrap_or(0)).collect();
        for (block, &width) in blocks.iter().zip(&widths) {
            check_matrix(op, block, outer, width)?;
            if block.dtype() != DType::F32 {
                return Err(Error::UnsupportedDType { op: op.to_string(), dtype: block.dtype() });
            }
        }
        let inner: usize = widths.iter().sum();
        let shape = shape.into();
        check_result(op, &shape, outer * inner)?;
        let mut out = Tensor::zeros(shape, DType::F32, device)?;
        let mut start = 0;
        for (block, &width) in blocks.iter().zip(&widths) {
            let copy = Block { rows: outer, width, src_at: 0, src_stride: width, dst_at: start, dst_stride: inner };
            copy_blocks_into(op, block, &[copy], &mut out)?;
            start += width;
        }
        Ok(out)
    }

    /// The column blocks of `self` (a row-major `[outer, Σ widths]` matrix) one after another:
    /// a new flat f32 tensor whose `i`-th run of `outer · widths[i]` elements is block `i`
    /// `[outer, widths[i]]`, on `self`'s device (the layout a scatter or reduce-scatter of
    /// column blocks sends).
    ///
    /// ```
    /// use conveyor_engine::{Device, Tensor};
    /// let host = Device::host();
    /// let x = Tensor::from_vec((0..10).map(|i| i as f32).collect(), [2, 5], &host)?;
    /// let packed = x.pack_columns(2, &[2, 2, 1])?;
    /// assert_eq!(packed.to_vec_f32(), [0., 1., 5., 6., 2., 3., 7., 8., 4., 9.]);
    /// assert!(Tensor::unpack_columns(&packed, 2, &[2, 2, 1], [2, 5])?.bit_eq(&x));
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn pack_columns(&self, outer: usize, widths: &[usize]) -> Result<Tensor> {
        let op = "pack_columns";
        let inner: usize = widths.iter().sum();
        check_matrix(op, self, outer, inner)?;
        let blocks = column_runs(outer, widths, inner, true);
        copy_blocks(op, self, &blocks, Shape::new([outer * inner]), self.device())
    }

    /// The inverse of [`Tensor::pack_columns`]: the blocks laid one after another in `packed`
    /// put side by side into a new f32 tensor `[outer, Σ widths]`, shaped `shape`, on `packed`'s
    /// device.
    pub fn unpack_columns(packed: &Tensor, outer: usize, widths: &[usize], shape: impl Into<Shape>) -> Result<Tensor> {
        let op = "unpack_columns";
        let inner: usize = widths.iter().sum();
        check_matrix(op, packed, outer, inner)?;
        let shape = shape.into();
        check_result(op, &shape, outer * inner)?;
        let blocks = column_runs(outer, widths, inner, false);
        copy_blocks(op, packed, &blocks, shape, packed.device())
    }
}

/// The copies between a `[outer, inner]` matrix and its blocks of `widths` laid one after
/// another: matrix to runs when `pack`, runs to matrix otherwise.
fn column_runs(outer: usize, widths: &[usize], inner: usize, pack: bool) -> Vec<Block> {
    let (mut column, mut run) = (0, 0);
    let mut blocks = Vec::with_capacity(widths.len());
    for &width in widths {
        let (matrix_at, run_at) = (column, run);
        blocks.push(if pack {
            Block { rows: outer, width, src_at: matrix_at, src_stride: inner, dst_at: run_at, dst_stride: width }
        } else {
            Block { rows: outer, width, src_at: run_at, src_stride: width, dst_at: matrix_at, dst_stride: inner }
        });
        column += width;
        run += outer * width;
    }
    blocks
}
