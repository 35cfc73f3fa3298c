//! Matrix products on the GPU through cuBLAS, with the CPU's row-major semantics
//! (`cpu::matmul(dst, lhs, rhs, accumulate)`) over strided and transposed [`DeviceMatRef`] views.
//!
//! # Row-major products on column-major cuBLAS
//!
//! cuBLAS reads a matrix with leading dimension `ld` as column-major: element `(p, q)` at
//! `p + q * ld`. A row-major view `X` (`col_stride == 1`, element `(i, j)` at `i * s + j`) is
//! therefore, to cuBLAS, the column-major matrix `Xᵀ` with `ld = s`; a transposed view
//! (`row_stride == 1`, element `(i, j)` at `i + j * s`) is the column-major `X` itself, so `Xᵀ` is
//! `op = T` of it with `ld = s`. The row-major `dst = A·B` (`m x n`, contiguous) is the
//! column-major `dstᵀ = Bᵀ·Aᵀ` (`n x m`, `ld = n`), so we ask cuBLAS for
//! `C(n x m) = op(B)·op(A)` with each operand's `op` and `ld` from the rule above.
//!
//! f32, f16 and bf16 operands all go through `cublasGemmEx` with `CUBLAS_COMPUTE_32F` and an f32
//! result: f32 is then exactly `cublasSgemm` (no TF32), and f16/bf16 products accumulate in f32.
use std::ffi::c_void;

use cudarc::cublas::result as blas;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t};
use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::buffer::{CudaBuffer, DeviceMatRef, GemmElement};
use super::errors::{self, to_i32};
use super::stream::CudaStream;
use crate::{DType, Error, Result};

/// How cuBLAS reads one operand: whether to transpose the column-major matrix it sees, and its
/// leading dimension.
struct BlasOperand {
    op: cublasOperation_t,
    ld: i32,
}

/// The cuBLAS reading of `view` such that `op(matrix)` is `viewᵀ` (see the module docs).
fn blas_operand<T: GemmElement>(op_name: &str, view: &DeviceMatRef<'_, T>) -> Result<BlasOperand> {
    let (rows, cols) = (view.rows, view.cols);
    if view.col_stride == 1 && (rows <= 1 || view.row_stride >= cols) {
        // The column-major `viewᵀ` (cols x rows): ld >= cols; with one row any ld >= cols works.
        let ld = if rows <= 1 { cols.max(1) } else { view.row_stride };
        return Ok(BlasOperand { op: cublasOperation_t::CUBLAS_OP_N, ld: to_i32(op_name, "leading dimension", ld)? });
    }
    if view.row_stride == 1 && (cols <= 1 || view.col_stride >= rows) {
        // The column-major `view` (rows x cols), transposed by cuBLAS: ld >= rows.
        let ld = if cols <= 1 { rows.max(1) } else { view.col_stride };
        return Ok(BlasOperand { op: cublasOperation_t::CUBLAS_OP_T, ld: to_i32(op_name, "leading dimension", ld)? });
    }
    Err(Error::invalid(
        "matrix view",
        format!(
            "{op_name}: a {rows}x{cols} view with strides ({}, {}) has no unit stride; cuBLAS needs a row-major \
             matrix or its transpose (copy the operand to a contiguous buffer first)",
            view.row_stride, view.col_stride
        ),
    ))
}

/// The cuBLAS data type of a dtype.
fn cuda_type(dtype: DType) -> cudaDataType_t {
    match dtype {
        DType::F32 => cudaDataType_t::CUDA_R_32F,
        DType::F16 => cudaDataType_t::CUDA_R_16F,
        DType::BF16 => cudaDataType_t::CUDA_R_16BF,
    }
}

impl CudaStream {
    /// `dst = lhs · rhs`, or `dst += lhs · rhs` when `accumulate`; `dst` row-major
    /// `lhs.rows() x rhs.cols()`. f16 and bf16 operands accumulate in f32. Like `cpu::matmul`.
    pub fn matmul<T: GemmElement>(
        &self,
        dst: &mut CudaBuffer<f32>,
        lhs: DeviceMatRef<'_, T>,
        rhs: DeviceMatRef<'_, T>,
        accumulate: bool,
    ) -> Result<()> {
        self.matmul_batched(dst, lhs, rhs, 1, accumulate)
    }

    /// `batch` products at once (`cublasGemmStridedBatchedEx`): product `b` multiplies the
    /// matrices `b * lhs_batch_stride` and `b * rhs_batch_stride` elements past the views' starts
    /// (a stride of 0 reuses one matrix) into `dst[b * m * n..(b + 1) * m * n]`.
    pub fn matmul_batched<T: GemmElement>(
        &self,
        dst: &mut CudaBuffer<f32>,
        lhs: DeviceMatRef<'_, T>,
        rhs: DeviceMatRef<'_, T>,
        batch: usize,
        accumulate: bool,
    ) -> Result<()> {
        let op = "matmul";
        let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
        if rhs.rows != k {
            return Err(Error::shape(op, format!("rhs with {k} rows"), format!("{}x{}", rhs.rows, rhs.cols)));
        }
        let dst_len = m.checked_mul(n).and_then(|mn| mn.checked_mul(batch));
        if dst_len != Some(dst.len()) {
            return Err(Error::shape(
                op,
                format!(
                    "dst of {batch} x {m}x{n} = {} elements",
                    dst_len.map_or_else(|| "overflowing".into(), |l| l.to_string())
                ),
                format!("{}", dst.len()),
            ));
        }
        for buffer_device in [lhs.buffer.device(), rhs.buffer.device(), dst.device()] {
            if !buffer_device.same_gpu(self.device()) {
                return Err(Error::DeviceMismatch {
                    op: op.to_string(),
                    lhs: format!("cuda:{}", self.device().ordinal()),
                    rhs: format!("cuda:{}", buffer_device.ordinal()),
                });
            }
        }
        lhs.check_fits(op, batch)?;
        rhs.check_fits(op, batch)?;
        if m == 0 || n == 0 || batch == 0 {
            return Ok(());
        }
        if k == 0 {
            if !accumulate {
                self.raw.memset_zeros(&mut dst.slice).map_err(|err| self.driver_error("zeroing a product", err))?;
            }
            return Ok(());
        }
        let a = blas_operand(op, &rhs)?;
        let b = blas_operand(op, &lhs)?;
        let (m_blas, n_blas, k_blas) =
            (to_i32(op, "columns", n)?, to_i32(op, "rows", m)?, to_i32(op, "inner dimension", k)?);
        let batch_count = to_i32(op, "batch", batch)?;
        let stride = |what: &str, stride: usize| {
            i64::try_from(stride).map_err(|_| Error::invalid(what, format!("{op}: batch stride {stride} exceeds i64")))
        };
        let (stride_a, stride_b, stride_c) =
            (stride("rhs", rhs.batch_stride)?, stride("lhs", lhs.batch_stride)?, stride("dst", m * n)?);
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0f32 });
        let data_type = cuda_type(T::DTYPE);
        let blas_handle = self.blas()?;
        let ordinal = self.device().ordinal();
        self.device().context().bind_to_thread().map_err(|err| self.driver_error("binding the context", err))?;

        let rhs_view = rhs
            .buffer
            .slice
            .try_slice(rhs.offset..)
            .ok_or_else(|| Error::shape(op, "rhs inside its buffer", "an offset past its end"))?;
        let lhs_view = lhs
            .buffer
            .slice
            .try_slice(lhs.offset..)
            .ok_or_else(|| Error::shape(op, "lhs inside its buffer", "an offset past its end"))?;
        let (a_ptr, _record_a) = rhs_view.device_ptr(&self.raw);
        let (b_ptr, _record_b) = lhs_view.device_ptr(&self.raw);
        let (c_ptr, _record_c) = dst.slice.device_ptr_mut(&self.raw);
        let (a_ptr, b_ptr, c_ptr) = (a_ptr as *const c_void, b_ptr as *const c_void, c_ptr as *mut c_void);
        let (alpha, beta) = (&alpha as *const f32 as *const c_void, &beta as *const f32 as *const c_void);
        // SAFETY: the views were checked to lie inside their buffers for every batch (check_fits),
        // the dimensions and leading dimensions follow the module docs' rule (blas_operand checks
        // ld against the operand's extent), dst holds batch x m x n f32 elements, alpha and beta
        // are host f32 scalars as CUBLAS_COMPUTE_32F requires, and the handle is bound to this
        // stream, on which the pointers' read and write events are recorded when the guards drop.
        let outcome = unsafe {
            if batch == 1 {
                blas::gemm_ex(
                    *blas_handle.handle(),
                    a.op,
                    b.op,
                    m_blas,
                    n_blas,
                    k_blas,
                    alpha,
                    a_ptr,
                    data_type,
                    a.ld,
                    b_ptr,
                    data_type,
                    b.ld,
                    beta,
                    c_ptr,
                    cudaDataType_t::CUDA_R_32F,
                    m_blas,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            } else {
                blas::gemm_strided_batched_ex(
                    *blas_handle.handle(),
                    a.op,
                    b.op,
                    m_blas,
                    n_blas,
                    k_blas,
                    alpha,
                    a_ptr,
                    data_type,
                    a.ld,
                    stride_a,
                    b_ptr,
                    data_type,
                    b.ld,
                    stride_b,
                    beta,
                    c_ptr,
                    cudaDataType_t::CUDA_R_32F,
                    m_blas,
                    stride_c,
                    batch_count,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
        };
        outcome.map_err(|err| {
            errors::cublas(ordinal, &format!("GEMM ({m}x{k} · {k}x{n}, batch {batch}, {})", T::DTYPE), err)
        })
    }
}
