//! Typed launch wrappers for `attention.cu`: the attention forward pass (context and row
//! logsumexp) and its backward pass (the gradient of the head-major q, k and v), in the layouts of
//! `cpu::attention` ([`AttentionDims`]).
use cudarc::driver::PushKernelArg;

use super::buffer::CudaBuffer;
use super::compile::Kernel;
use super::errors::to_i32;
use super::stream::CudaStream;
use crate::Result;
use crate::cpu::attention::AttentionDims;

/// The kernels' integer arguments: batch, tokens, heads, head_dim, causal.
fn int_args(op: &str, dims: &AttentionDims) -> Result<[i32; 5]> {
    Ok([
        to_i32(op, "batch", dims.batch)?,
        to_i32(op, "tokens", dims.tokens)?,
        to_i32(op, "heads", dims.n_heads)?,
        to_i32(op, "head_dim", dims.head_dim)?,
        i32::from(dims.causal),
    ])
}

impl CudaStream {
    /// `ctx = concat_h softmax(q_h k_hᵀ · scale + mask) v_h` and the rows' logsumexp, as
    /// `cpu::attention::attention_forward` (one thread per context element).
    pub fn attention_forward(
        &self,
        dims: &AttentionDims,
        qkv: &CudaBuffer<f32>,
        ctx: &mut CudaBuffer<f32>,
        logsumexp: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        let kernel = Kernel::AttentionForwardF32;
        let op = kernel.name();
        self.check_len(op, "qkv", dims.qkv_len(), qkv.len())?;
        self.check_len(op, "ctx", dims.context_len(), ctx.len())?;
        self.check_len(op, "logsumexp", dims.logsumexp_len(), logsumexp.len())?;
        self.check_on_device(op, qkv)?;
        self.check_on_device(op, ctx)?;
        self.check_on_device(op, logsumexp)?;
        if ctx.is_empty() {
            return Ok(());
        }
        let [batch, tokens, heads, head_dim, causal] = int_args(op, dims)?;
        let scale = dims.scale();
        let config = self.grid_stride(ctx.len());
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&qkv.slice).arg(&mut ctx.slice).arg(&mut logsumexp.slice);
        launch.arg(&batch).arg(&tokens).arg(&heads).arg(&head_dim).arg(&causal).arg(&scale);
        // SAFETY: the kernel reads qkv_len floats of qkv and writes context_len floats of ctx and
        // logsumexp_len of logsumexp (lengths checked above, all on this GPU).
        unsafe { launch.launch(config) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// `∂L/∂[q, k, v]` (head-major, written in full) from the forward pass's `qkv`, `ctx` and
    /// `logsumexp` and `∂L/∂ctx`, as `cpu::attention::attention_backward`: one kernel for `dQ`
    /// (one thread per element, over the keys) and one for `dK` and `dV` (over the queries).
    pub fn attention_backward(
        &self,
        dims: &AttentionDims,
        qkv: &CudaBuffer<f32>,
        ctx: &CudaBuffer<f32>,
        logsumexp: &CudaBuffer<f32>,
        grad_ctx: &CudaBuffer<f32>,
        grad_qkv: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        for kernel in [Kernel::AttentionBackwardQF32, Kernel::AttentionBackwardKvF32] {
            let op = kernel.name();
            self.check_len(op, "qkv", dims.qkv_len(), qkv.len())?;
            self.check_len(op, "ctx", dims.context_len(), ctx.len())?;
            self.check_len(op, "logsumexp", dims.logsumexp_len(), logsumexp.len())?;
            self.check_len(op, "grad_ctx", dims.context_len(), grad_ctx.len())?;
            self.check_len(op, "grad_qkv", dims.qkv_len(), grad_qkv.len())?;
            for buffer in [qkv, ctx, logsumexp, grad_ctx] {
                self.check_on_device(op, buffer)?;
            }
            self.check_on_device(op, grad_qkv)?;
            if ctx.is_empty() {
                return Ok(());
            }
            let [batch, tokens, heads, head_dim, causal] = int_args(op, dims)?;
            let scale = dims.scale();
            let function = self.kernels()?.get(kernel);
            let mut launch = self.raw.launch_builder(function);
            launch.arg(&qkv.slice).arg(&ctx.slice).arg(&logsumexp.slice).arg(&grad_ctx.slice).arg(&mut grad_qkv.slice);
            launch.arg(&batch).arg(&tokens).arg(&heads).arg(&head_dim).arg(&causal).arg(&scale);
            // SAFETY: reads the forward buffers and grad_ctx and writes grad_qkv, each of the
            // length checked above on this GPU; one thread per q (or k/v) row element.
            unsafe { launch.launch(self.grid_stride(dims.context_len())) }
                .map(drop)
                .map_err(|err| self.launch_error(kernel, err))?;
        }
        Ok(())
    }
}
