//! Multi-head self-attention as device ops, in the head-major layout of `cpu::attention`
//! ([`AttentionDims`]): the q/k/v projection ([`Tensor::attention_qkv`]) and its two gradients
//! ([`Tensor::attention_qkv_input_grad`], [`Tensor::attention_qkv_weight_grads`]), the fused
//! attention ([`Tensor::attention`], [`Tensor::attention_backward`]) and the output projection's
//! parameter gradients ([`Tensor::attention_out_grads`]). The `MultiheadSelfAttention` layer
//! computes only through these and [`Tensor::matmul`].
//!
//! On a CPU device each op is the code the layer ran before, unchanged (bit for bit, including
//! the accumulate-apart rule for parameter gradients). On a GPU the per-(q/k/v, head) products are
//! one strided-batched cuBLAS product each (block `b` of `in_proj_weight` is `dh` contiguous rows,
//! so the blocks are a batch with stride `dh·D`), the biases are spread by rank-1 batched
//! products, the input gradient sums its `3·H` per-block products by column sums (a `[3H, rows, D]`
//! scratch on the device's ledger), and the attention runs the kernels of `attention.cu`.
use super::{accumulate_part, gpu_f32, gpu_f32_mut, ones};
use crate::cpu::attention::{AttentionDims, attention_backward, attention_forward};
use crate::cpu::elementwise::accumulate_column_sums;
use crate::cpu::{MatRef, matmul, matmul_uninit, uninit};
use crate::device::DeviceMatRef;
use crate::{CallScratch, DType, Device, Error, Result, Shape, Tensor};

/// Per sample, the scratch the GPU arms of the attention ops reserve on the device's ledger
/// while they run (f32), for a layer that computes through them (`MultiheadSelfAttention`): the
/// bias spreads' ones-vectors (`tokens` per sample, forward and weight pass) and the input
/// gradient's `[3H, rows, D]` per-block products. The CPU arms keep their scratch off the ledger.
pub fn attention_gpu_scratch(tokens: usize, embed_dim: usize, n_heads: usize) -> CallScratch {
    let f32_bytes = DType::F32.size_in_bytes() as u64;
    let ones = tokens as u64;
    let partial = (3 * n_heads * tokens * embed_dim) as u64;
    CallScratch { forward: ones * f32_bytes, backward_input: partial * f32_bytes, backward_weight: ones * f32_bytes }
}

/// Rows of the flattened input, `batch · tokens`.
fn rows(dims: &AttentionDims) -> usize {
    dims.batch * dims.tokens
}

/// The input width `D_in` of a projection whose weight `weight` has `groups · width` rows of
/// `D_in` columns (`width = H · dh` the heads' width): a layer holding every head has
/// `D_in = width`, one shard of a head-split layer (`ParallelSelfAttention`) `D_in > width`.
fn input_width(op: &str, what: &str, weight: &Tensor, groups: usize, width: usize) -> Result<usize> {
    let rows = groups * width;
    if rows == 0 || weight.numel() == 0 || !weight.numel().is_multiple_of(rows) {
        return Err(Error::shape(
            op,
            format!("{what} of {rows} rows of D_in >= 1 columns"),
            weight.shape().to_string(),
        ));
    }
    Ok(weight.numel() / rows)
}

/// Checks that `tensor` holds `expected` elements.
fn check_numel(op: &str, what: &str, tensor: &Tensor, expected: usize) -> Result<()> {
    if tensor.numel() != expected {
        return Err(Error::shape(op, format!("{what} of {expected} elements"), tensor.shape().to_string()));
    }
    Ok(())
}

impl Tensor {
    /// q, k and v of `self` (`[batch, tokens, D_in]`), head-major `[3, H, batch, tokens, dh]`:
    /// block `(w, h)` is `x · W[w·D + h·dh ..]ᵀ + b[w·D + h·dh ..]` for `in_weight` `[3D, D_in]`
    /// and `in_bias` `[3D]` (`D = H · dh`; `D_in = D` but for a shard of a head-split layer); a
    /// new f32 tensor on `self`'s device.
    pub fn attention_qkv(&self, in_weight: &Tensor, in_bias: &Tensor, dims: AttentionDims) -> Result<Tensor> {
        let op = "attention_qkv";
        let (rows, width, dh, blocks) = (rows(&dims), dims.embed_dim(), dims.head_dim, 3 * dims.n_heads);
        let d = input_width(op, "in_proj_weight", in_weight, 3, width)?;
        check_numel(op, "an input", self, rows * d)?;
        check_numel(op, "in_proj_bias", in_bias, 3 * width)?;
        let shape = Shape::new([3, dims.n_heads, dims.batch, dims.tokens, dh]);
        match self.device() {
            Device::Cpu(_) => {
                let (x, in_weight, in_bias) = (self.host_f32(op)?, in_weight.host_f32(op)?, in_bias.host_f32(op)?);
                let x_view = MatRef::row_major(&x, rows, d)?;
                // The blocks tile the buffer in (w, h) order, each written in full: no zero-fill.
                Tensor::from_f32_init(shape, self.device(), |qkv| {
                    uninit::chunks(qkv, rows * dh, |block, dst| {
                        let first = block * dh;
                        let dst = uninit::broadcast_rows(&in_bias[first..first + dh], dst)?;
                        let weight = MatRef::row_major(&in_weight[first * d..(first + dh) * d], dh, d)?;
                        matmul(dst, x_view, weight.t(), true)?;
                        Ok(dst)
                    })
                })
            }
            Device::Cuda(cuda) => {
                let device = self.device();
                let (x, w, b) =
                    (gpu_f32(op, self, device)?, gpu_f32(op, in_weight, device)?, gpu_f32(op, in_bias, device)?);
                let ones = ones(device, rows)?;
                let stream = cuda.thread_stream()?;
                let mut qkv = cuda.alloc_zeros::<f32>(shape.numel())?;
                // Block b [rows, dh] = 1 [rows, 1] · b_b [1, dh], then += x · W_bᵀ.
                stream.matmul_batched(
                    &mut qkv,
                    DeviceMatRef::row_major(&*gpu_f32(op, &ones, device)?, rows, 1)?,
                    DeviceMatRef::row_major(&b, 1, dh)?.with_batch_stride(dh),
                    blocks,
                    false,
                )?;
                stream.matmul_batched(
                    &mut qkv,
                    DeviceMatRef::row_major(&x, rows, d)?,
                    DeviceMatRef::row_major(&w, dh, d)?.with_batch_stride(dh * d).t(),
                    blocks,
                    true,
                )?;
                Tensor::from_cuda_f32(qkv, shape, device)
            }
        }
    }

    /// The attention of `self` (q/k/v head-major): the context `[batch, tokens, D]` (heads
    /// concatenated) and the rows' logsumexp `[H, batch, tokens]`, new f32 tensors on `self`'s
    /// device (`cpu::attention::attention_forward`, or `attention.cu` on a GPU).
    pub fn attention(&self, dims: AttentionDims) -> Result<(Tensor, Tensor)> {
        let op = "attention";
        check_numel(op, "q/k/v", self, dims.qkv_len())?;
        let ctx_shape = Shape::new([dims.batch, dims.tokens, dims.embed_dim()]);
        let lse_shape = Shape::new([dims.n_heads, dims.batch, dims.tokens]);
        let device = self.device();
        let mut ctx = Tensor::zeros(ctx_shape, DType::F32, device)?;
        let mut logsumexp = Tensor::zeros(lse_shape, DType::F32, device)?;
        match device {
            Device::Cpu(_) => {
                let qkv = self.host_f32(op)?;
                attention_forward(dims, &qkv, ctx.as_f32_mut()?, logsumexp.as_f32_mut()?)?;
            }
            Device::Cuda(cuda) => {
                let qkv = gpu_f32(op, self, device)?;
                let stream = cuda.thread_stream()?;
                stream.attention_forward(&dims, &qkv, gpu_f32_mut(op, &mut ctx)?, gpu_f32_mut(op, &mut logsumexp)?)?;
            }
        }
        Ok((ctx, logsumexp))
    }

    /// `∂L/∂[q, k, v]` (head-major) from `self` (`∂L/∂ctx`, `[batch, tokens, D]`) and the forward
    /// pass's `qkv`, `ctx` and `logsumexp`: a new f32 tensor on `self`'s device.
    pub fn attention_backward(
        &self,
        qkv: &Tensor,
        ctx: &Tensor,
        logsumexp: &Tensor,
        dims: AttentionDims,
    ) -> Result<Tensor> {
        let op = "attention_backward";
        check_numel(op, "∂L/∂ctx", self, dims.context_len())?;
        check_numel(op, "q/k/v", qkv, dims.qkv_len())?;
        check_numel(op, "a context", ctx, dims.context_len())?;
        check_numel(op, "a logsumexp", logsumexp, dims.logsumexp_len())?;
        let device = self.device();
        let mut grad_qkv = Tensor::zeros(qkv.shape().clone(), DType::F32, device)?;
        match device {
            Device::Cpu(_) => {
                let (grad_ctx, qkv, ctx, lse) =
                    (self.host_f32(op)?, qkv.host_f32(op)?, ctx.host_f32(op)?, logsumexp.host_f32(op)?);
                attention_backward(dims, &qkv, &ctx, &lse, &grad_ctx, grad_qkv.as_f32_mut()?)?;
            }
            Device::Cuda(cuda) => {
                let (grad_ctx, qkv, ctx, lse) = (
                    gpu_f32(op, self, device)?,
                    gpu_f32(op, qkv, device)?,
                    gpu_f32(op, ctx, device)?,
                    gpu_f32(op, logsumexp, device)?,
                );
                let stream = cuda.thread_stream()?;
                stream.attention_backward(&dims, &qkv, &ctx, &lse, &grad_ctx, gpu_f32_mut(op, &mut grad_qkv)?)?;
            }
        }
        Ok(grad_qkv)
    }

    /// `∂L/∂x` (`input_shape`, `[batch, tokens, D_in]`) from `self` (`∂L/∂[q, k, v]`, head-major):
    /// `Σ_(w, h) dqkv_(w, h) · W[w·D + h·dh ..]` for `in_weight` `[3D, D_in]`; a new f32 tensor on
    /// `self`'s device.
    pub fn attention_qkv_input_grad(
        &self,
        in_weight: &Tensor,
        input_shape: &Shape,
        dims: AttentionDims,
    ) -> Result<Tensor> {
        let op = "attention_qkv_input_grad";
        let (rows, width, dh, blocks) = (rows(&dims), dims.embed_dim(), dims.head_dim, 3 * dims.n_heads);
        check_numel(op, "∂L/∂qkv", self, dims.qkv_len())?;
        let d = input_width(op, "in_proj_weight", in_weight, 3, width)?;
        if input_shape.numel() != rows * d {
            return Err(Error::shape(op, format!("an input of {} elements", rows * d), input_shape.to_string()));
        }
        match self.device() {
            Device::Cpu(_) => {
                let (grad_qkv, in_weight) = (self.host_f32(op)?, in_weight.host_f32(op)?);
                let block_len = rows * dh;
                let term = |block: usize| -> Result<(MatRef<'_>, MatRef<'_>)> {
                    let first = block * dh;
                    let grad_block =
                        MatRef::row_major(&grad_qkv[block * block_len..(block + 1) * block_len], rows, dh)?;
                    Ok((grad_block, MatRef::row_major(&in_weight[first * d..(first + dh) * d], dh, d)?))
                };
                // The first product writes every element (no zero-fill); the others accumulate.
                Tensor::from_f32_init(input_shape.clone(), self.device(), |dst| {
                    let (grad_block, weight) = term(0)?;
                    let dst = matmul_uninit(dst, grad_block, weight)?;
                    for block in 1..blocks {
                        let (grad_block, weight) = term(block)?;
                        matmul(dst, grad_block, weight, true)?;
                    }
                    Ok(dst)
                })
            }
            Device::Cuda(cuda) => {
                let device = self.device();
                let (grad_qkv, w) = (gpu_f32(op, self, device)?, gpu_f32(op, in_weight, device)?);
                let stream = cuda.thread_stream()?;
                // Per-block products [3H, rows, D], then their sum over the blocks.
                let mut partial = cuda.alloc_zeros::<f32>(blocks * rows * d)?;
                stream.matmul_batched(
                    &mut partial,
                    DeviceMatRef::row_major(&grad_qkv, rows, dh)?.with_batch_stride(rows * dh),
                    DeviceMatRef::row_major(&w, dh, d)?.with_batch_stride(dh * d),
                    blocks,
                    false,
                )?;
                let mut dx = cuda.alloc_zeros::<f32>(rows * d)?;
                stream.accumulate_column_sums(&partial, &mut dx)?;
                Tensor::from_cuda_f32(dx, input_shape.clone(), device)
            }
        }
    }

    /// Accumulates `in_proj_weight`'s and `in_proj_bias`'s gradients from `self` (`∂L/∂[q, k, v]`,
    /// head-major) and the forward input `x` (`[batch, tokens, D_in]`): `dW[w·D + h·dh ..] +=
    /// dqkv_(w, h)ᵀ · x` and `db[w·D + h·dh ..] += Σ_rows dqkv_(w, h)`, on the gradients' device.
    pub fn attention_qkv_weight_grads(
        &self,
        x: &Tensor,
        dims: AttentionDims,
        in_weight_grad: &mut Tensor,
        in_bias_grad: &mut Tensor,
    ) -> Result<()> {
        let op = "attention_qkv_weight_grads";
        let (rows, width, dh, blocks) = (rows(&dims), dims.embed_dim(), dims.head_dim, 3 * dims.n_heads);
        check_numel(op, "∂L/∂qkv", self, dims.qkv_len())?;
        let d = input_width(op, "an in_proj_weight gradient", in_weight_grad, 3, width)?;
        check_numel(op, "an input", x, rows * d)?;
        check_numel(op, "an in_proj_bias gradient", in_bias_grad, 3 * width)?;
        if let Device::Cpu(_) = in_weight_grad.device() {
            let (grad_qkv, x) = (self.host_f32(op)?, x.host_f32(op)?);
            let x_view = MatRef::row_major(&x, rows, d)?;
            let block_len = rows * dh;
            let grad_block = |block: usize| &grad_qkv[block * block_len..(block + 1) * block_len];
            accumulate_part(in_weight_grad, |dst| {
                for block in 0..blocks {
                    let first = block * dh;
                    let grad = MatRef::row_major(grad_block(block), rows, dh)?;
                    matmul(&mut dst[first * d..(first + dh) * d], grad.t(), x_view, true)?;
                }
                Ok(())
            })?;
            return accumulate_part(in_bias_grad, |dst| {
                for block in 0..blocks {
                    let first = block * dh;
                    accumulate_column_sums(grad_block(block), &mut dst[first..first + dh])?;
                }
                Ok(())
            });
        }
        let device = in_weight_grad.device().clone();
        let (grad_qkv, x) = (gpu_f32(op, self, &device)?, gpu_f32(op, x, &device)?);
        let Device::Cuda(cuda) = &device else { unreachable!("a CPU device returned above") };
        let stream = cuda.thread_stream()?;
        let grad_blocks = DeviceMatRef::row_major(&grad_qkv, rows, dh)?.with_batch_stride(rows * dh);
        // dW_b [dh, D] += dqkv_bᵀ · x: the blocks of dW are the batch's contiguous outputs.
        stream.matmul_batched(
            gpu_f32_mut(op, in_weight_grad)?,
            grad_blocks.t(),
            DeviceMatRef::row_major(&x, rows, d)?,
            blocks,
            true,
        )?;
        // db_b [1, dh] += 1 [1, rows] · dqkv_b.
        let ones = ones(&device, rows)?;
        stream.matmul_batched(
            gpu_f32_mut(op, in_bias_grad)?,
            DeviceMatRef::row_major(&*gpu_f32(op, &ones, &device)?, 1, rows)?,
            grad_blocks,
            blocks,
            true,
        )
    }

    /// Accumulates the output projection's gradients from `self` (`∂L/∂y`, `[batch, tokens,
    /// D_out]`) and the context (`[batch, tokens, D]`): `dW_out` `[D_out, D]` `+= dyᵀ · ctx`,
    /// `db_out` `[D_out]` `+= Σ_rows dy`, on the gradients' device. `D_out = D` but for a shard of a
    /// head-split layer.
    pub fn attention_out_grads(
        &self,
        ctx: &Tensor,
        dims: AttentionDims,
        out_weight_grad: &mut Tensor,
        out_bias_grad: &mut Tensor,
    ) -> Result<()> {
        let op = "attention_out_grads";
        let (rows, width) = (rows(&dims), dims.embed_dim());
        let d = input_width(op, "an out_proj.weight gradient", out_weight_grad, 1, width)?;
        check_numel(op, "∂L/∂y", self, rows * d)?;
        check_numel(op, "a context", ctx, rows * width)?;
        check_numel(op, "an out_proj.bias gradient", out_bias_grad, d)?;
        if let Device::Cpu(_) = out_weight_grad.device() {
            let (grad, ctx) = (self.host_f32(op)?, ctx.host_f32(op)?);
            let grad_t = MatRef::row_major(&grad, rows, d)?.t();
            accumulate_part(out_weight_grad, |dst| matmul(dst, grad_t, MatRef::row_major(&ctx, rows, width)?, true))?;
            return accumulate_part(out_bias_grad, |dst| accumulate_column_sums(&grad, dst));
        }
        let device = out_weight_grad.device().clone();
        let (grad, ctx) = (gpu_f32(op, self, &device)?, gpu_f32(op, ctx, &device)?);
        let Device::Cuda(cuda) = &device else { unreachable!("a CPU device returned above") };
        let stream = cuda.thread_stream()?;
        stream.matmul(
            gpu_f32_mut(op, out_weight_grad)?,
            DeviceMatRef::row_major(&grad, rows, d)?.t(),
            DeviceMatRef::row_major(&ctx, rows, width)?,
            true,
        )?;
        stream.accumulate_column_sums(&grad, gpu_f32_mut(op, out_bias_grad)?)
    }
}
