//! `MultiheadSelfAttention`: scaled dot-product self-attention over `[batch, tokens, embed_dim]`
//! with PyTorch's `nn.MultiheadAttention(embed_dim, n_heads, batch_first=True)` parameters.
//!
//! # Layout
//!
//! The forward pass keeps q, k and v *head-major*, `[3, n_heads, batch · tokens, head_dim]`:
//! block `(w, h)` (w = 0 for q, 1 for k, 2 for v) is the product of the input with rows
//! `w·D + h·head_dim ..` of `in_proj_weight`, which are contiguous, so every projection and every
//! `in_proj_weight` gradient block is a GEMM on contiguous row-major views (transposes are
//! views, never copies). The attention itself is one fused kernel over every (head, sample)
//! block ([`conveyor_engine::cpu::attention`]): it writes the heads' outputs straight into the
//! concatenated context `[batch, tokens, D]` and keeps the f32 logsumexp of each score row
//! `[n_heads, batch, tokens]`, never the `[tokens, tokens]` probabilities; the backward pass
//! recomputes them from it (FlashAttention-2). Saved: the input, q/k/v, the logsumexp and the
//! context, O(tokens) per row instead of O(tokens²).
//!
//! # One `∂L/∂qkv` for both backward calls
//!
//! `in_proj_weight`'s gradient and the input gradient both need ∂L/∂q, ∂L/∂k and ∂L/∂v, which sit
//! behind the softmax: the chain `dctx → dP, dV → dS → dQ, dK` is most of the backward. Whichever
//! of `backward_input` and `backward_weight` runs first computes it and leaves it in a pending
//! slot (a tensor on the device, so on its memory ledger); the second call for the same `Saved`
//! and gradient takes it out, so it is dropped when that call returns. `Saved` is immutable, so
//! the slot lives in the layer, keyed by the storage of the saved logsumexp and of the output
//! gradient (the slot holds shares of both, so neither storage can be reused by another call
//! while the slot exists). A slot whose `Saved` has been dropped without the second call is
//! freed on the layer's next call. [`Layer::backward`] computes the chain once and keeps nothing.
//!
//! The memory plan counts the slot: [`LayerCost::backward_held_bytes_per_sample`] declares it
//! (`3 · tokens · D` floats per sample), and the planner's replay of a stage holds it from the
//! layer's input-gradient call to the end of the micro-batch's weight pass. The kernel's other
//! scratch (`∂L/∂ctx`, the per-block tiles) is plain host memory, off the ledger, like a
//! convolution's im2col columns.
use std::cell::{RefCell, RefMut};

use conveyor_engine::cpu::attention::AttentionDims;
use conveyor_engine::device::ops::{Matrix, attention_gpu_scratch};
use conveyor_engine::{
    CallScratch, Device, Error, ForwardCtx, Layer, LayerCost, Parameter, Precision, Result, Saved, Shape, Tensor, init,
};
use rand::rngs::StdRng;

use crate::tensor_io::{
    check_grad_shape, check_param_grads, check_same_device, expect_inputs, expect_shapes, f32_bytes, into_dtype,
    largest_parameter_bytes, saved_tensor, zeros_f32,
};

const KIND: &str = "MultiheadSelfAttention";

/// Multi-head self-attention on `x` `[batch, tokens, embed_dim]`, output of the same shape:
///
/// ```text
/// [q | k | v] = x · in_proj_weightᵀ + in_proj_bias                 (each [batch, tokens, D])
/// P_h        = softmax(q_h · k_hᵀ / sqrt(head_dim) + mask)          per head h, [tokens, tokens]
/// y          = concat_h(P_h · v_h) · out_proj.weightᵀ + out_proj.bias
/// ```
///
/// with `head_dim = embed_dim / n_heads`; the causal mask is `-inf` where key position > query
/// position (PyTorch's `generate_square_subsequent_mask`), otherwise no mask.
///
/// Parameters, in PyTorch's order and layout: `in_proj_weight` `[3D, D]` (q rows, then k, then v),
/// `in_proj_bias` `[3D]`, `out_proj.weight` `[D, D]`, `out_proj.bias` `[D]`. The forward pass saves
/// the input, q/k/v, the logsumexp of every score row `[n_heads, batch, tokens]` and the
/// concatenated head outputs.
///
/// ```
/// use conveyor_engine::{Device, ForwardCtx, Layer, Tensor, init};
/// use conveyor_layers::MultiheadSelfAttention;
/// let attn = MultiheadSelfAttention::new(8, 2, true, &mut init::rng(0))?;
/// let x = Tensor::from_vec(vec![0.1; 2 * 3 * 8], [2, 3, 8], &Device::host())?;
/// let (y, _saved) = attn.forward(&[&x], &ForwardCtx::eval())?;
/// assert_eq!(y.dims(), &[2, 3, 8]);
/// # Ok::<(), conveyor_engine::Error>(())
/// ```
#[derive(Debug)]
pub struct MultiheadSelfAttention {
    embed_dim: usize,
    n_heads: usize,
    causal: bool,
    params: Vec<Parameter>,
    /// `∂L/∂qkv` computed by one backward call and waiting for the other (module docs).
    pending: RefCell<Vec<PendingGrad>>,
}

/// Which backward call filled a [`PendingGrad`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Half {
    Input,
    Weight,
}

/// `∂L/∂qkv` for one (`Saved`, output gradient) pair, held between the two backward calls.
#[derive(Debug)]
struct PendingGrad {
    /// A share of the saved logsumexp: identifies the `Saved`.
    logsumexp: Tensor,
    /// A share of the output gradient the slot was computed from.
    grad_output: Tensor,
    grad_qkv: Tensor,
    filled_by: Half,
}

impl PendingGrad {
    fn is_for(&self, logsumexp: &Tensor, grad_output: &Tensor) -> bool {
        self.logsumexp.shares_storage_with(logsumexp) && self.grad_output.shares_storage_with(grad_output)
    }
}

/// Per-call sizes: batch, tokens, embed dim, heads, head dim.
#[derive(Clone, Copy)]
struct Dims {
    batch: usize,
    tokens: usize,
    embed_dim: usize,
    n_heads: usize,
    head_dim: usize,
}

impl Dims {
    /// Rows of the flattened input, `batch · tokens`.
    fn rows(&self) -> usize {
        self.batch * self.tokens
    }

    /// The attention kernel's sizes.
    fn kernel(&self, causal: bool) -> AttentionDims {
        AttentionDims { batch: self.batch, tokens: self.tokens, n_heads: self.n_heads, head_dim: self.head_dim, causal }
    }
}

impl MultiheadSelfAttention {
    /// A layer with PyTorch's initialisation: `in_proj_weight` xavier-uniform
    /// (U(±sqrt(6 / (D + 3D)))), `out_proj.weight` like `Linear`'s default (U(±1/sqrt(D))), both
    /// biases zero; parameters on the host. `embed_dim` must be a positive multiple of `n_heads`.
    pub fn new(embed_dim: usize, n_heads: usize, causal: bool, rng: &mut StdRng) -> Result<MultiheadSelfAttention> {
        check_heads(embed_dim, n_heads)?;
        let host = Device::host();
        let bound = (6.0 / (4 * embed_dim) as f32).sqrt();
        let in_proj_weight = init::uniform([3 * embed_dim, embed_dim], -bound, bound, rng, &host)?;
        let in_proj_bias = zeros_f32([3 * embed_dim], &host)?;
        let out_weight = init::kaiming_uniform_default([embed_dim, embed_dim], embed_dim, rng, &host)?;
        let out_bias = zeros_f32([embed_dim], &host)?;
        MultiheadSelfAttention::from_parameters(n_heads, causal, in_proj_weight, in_proj_bias, out_weight, out_bias)
    }

    /// A layer from given tensors: `in_proj_weight` `[3D, D]`, `in_proj_bias` `[3D]`,
    /// `out_weight` `[D, D]` and `out_bias` `[D]` (PyTorch's `out_proj.weight`/`out_proj.bias`).
    pub fn from_parameters(
        n_heads: usize,
        causal: bool,
        in_proj_weight: Tensor,
        in_proj_bias: Tensor,
        out_weight: Tensor,
        out_bias: Tensor,
    ) -> Result<MultiheadSelfAttention> {
        let embed_dim = match in_proj_weight.dims() {
            &[rows, cols] if rows == 3 * cols && cols > 0 => cols,
            _ => {
                return Err(Error::shape(
                    "MultiheadSelfAttention in_proj_weight",
                    "[3 * embed_dim, embed_dim] with embed_dim >= 1",
                    in_proj_weight.shape().to_string(),
                ));
            }
        };
        check_heads(embed_dim, n_heads)?;
        let expect = |name: &str, tensor: &Tensor, dims: &[usize]| -> Result<()> {
            if tensor.dims() != dims {
                return Err(Error::shape(
                    format!("MultiheadSelfAttention {name}"),
                    Shape::new(dims.to_vec()).to_string(),
                    tensor.shape().to_string(),
                ));
            }
            Ok(())
        };
        expect("in_proj_bias", &in_proj_bias, &[3 * embed_dim])?;
        expect("out_proj.weight", &out_weight, &[embed_dim, embed_dim])?;
        expect("out_proj.bias", &out_bias, &[embed_dim])?;
        let params = vec![
            Parameter { name: "in_proj_weight".into(), value: in_proj_weight },
            Parameter { name: "in_proj_bias".into(), value: in_proj_bias },
            Parameter { name: "out_proj.weight".into(), value: out_weight },
            Parameter { name: "out_proj.bias".into(), value: out_bias },
        ];
        Ok(MultiheadSelfAttention { embed_dim, n_heads, causal, params, pending: RefCell::new(Vec::new()) })
    }

    /// The embedding width `D` (last input dimension).
    pub fn embed_dim(&self) -> usize {
        self.embed_dim
    }

    /// Number of heads.
    pub fn n_heads(&self) -> usize {
        self.n_heads
    }

    /// Width of one head, `embed_dim / n_heads`.
    pub fn head_dim(&self) -> usize {
        self.embed_dim / self.n_heads
    }

    /// Whether each position attends only to itself and earlier positions.
    pub fn is_causal(&self) -> bool {
        self.causal
    }

    /// Checks a batched input `[batch, tokens, D]` and returns its sizes.
    fn dims(&self, shape: &Shape) -> Result<Dims> {
        match shape.dims() {
            &[batch, tokens, embed_dim] if embed_dim == self.embed_dim && tokens > 0 => {
                Ok(Dims { batch, tokens, embed_dim, n_heads: self.n_heads, head_dim: self.head_dim() })
            }
            _ => Err(Error::shape(
                KIND,
                format!("an input [batch, tokens, {}] with tokens >= 1", self.embed_dim),
                shape.to_string(),
            )),
        }
    }

    /// `∂L/∂[q, k, v]` in the head-major layout, from the saved state and `∂L/∂y`: the chain
    /// both backward calls need, as a tensor on the input's device.
    fn grad_qkv(&self, dims: Dims, saved: &Saved, grad_output: &Tensor) -> Result<Tensor> {
        let qkv = saved_tensor(KIND, saved, 1)?;
        let logsumexp = saved_tensor(KIND, saved, 2)?;
        let ctx = saved_tensor(KIND, saved, 3)?;
        let (rows, d) = (dims.rows(), dims.embed_dim);
        // A half saved input: the forward ran in that type, and so do the backward's products.
        let dtype = saved_tensor(KIND, saved, 0)?.dtype();
        let grad = Precision::round_operand(grad_output, dtype)?;
        // dctx [rows, D] = dy [rows, D] · out_proj.weight [D, D]
        let out_weight = Precision::round_operand(&self.params[2].value, dtype)?;
        let out_weight = Matrix::new(&out_weight, d, d)?;
        let grad_ctx = Tensor::matmul(Matrix::new(&grad, rows, d)?, out_weight, None, [rows, d], qkv.device())?;
        let grad_qkv = grad_ctx.attention_backward(qkv, ctx, logsumexp, dims.kernel(self.causal))?;
        into_dtype(grad_qkv, dtype)
    }

    fn pending_slots(&self) -> RefMut<'_, Vec<PendingGrad>> {
        // A layer belongs to one worker (`Layer` is `Send`, not `Sync`), and no borrow is held
        // across a call that could come back here.
        self.pending.borrow_mut()
    }

    /// [`Self::grad_qkv`] shared between the two backward calls (module docs): taken from the slot
    /// the other call filled, or computed and left in a slot for it.
    fn shared_grad_qkv(&self, dims: Dims, saved: &Saved, grad_output: &Tensor, half: Half) -> Result<Tensor> {
        let logsumexp = saved_tensor(KIND, saved, 2)?;
        {
            let mut pending = self.pending_slots();
            // A slot whose `Saved` is gone (only the slot still holds its logsumexp) is stale.
            pending.retain(|slot| slot.logsumexp.is_shared());
            if let Some(i) = pending.iter().position(|p| p.is_for(logsumexp, grad_output) && p.filled_by != half) {
                return Ok(pending.swap_remove(i).grad_qkv);
            }
        }
        let grad_qkv = self.grad_qkv(dims, saved, grad_output)?;
        let mut pending = self.pending_slots();
        if !pending.iter().any(|p| p.is_for(logsumexp, grad_output)) {
            pending.push(PendingGrad {
                logsumexp: logsumexp.share(),
                grad_output: grad_output.share(),
                grad_qkv: grad_qkv.share(),
                filled_by: half,
            });
        }
        Ok(grad_qkv)
    }

    /// Bytes of `∂L/∂qkv` waiting in slots for their second backward call.
    pub fn pending_gradient_bytes(&self) -> usize {
        self.pending_slots().iter().map(|p| p.grad_qkv.size_in_bytes()).sum()
    }

    /// `∂L/∂x` from `∂L/∂qkv`.
    fn input_grad(&self, dims: Dims, input: &Tensor, grad_qkv: &Tensor) -> Result<Tensor> {
        let in_weight = Precision::round_operand(&self.params[0].value, input.dtype())?;
        let grad_input = grad_qkv.attention_qkv_input_grad(&in_weight, input.shape(), dims.kernel(self.causal))?;
        into_dtype(grad_input, input.dtype())
    }

    /// Adds the parameter gradients, given `∂L/∂qkv`.
    fn add_weight_grads(
        &self,
        dims: Dims,
        saved: &Saved,
        grad_output: &Tensor,
        grad_qkv: &Tensor,
        param_grads: &mut [Tensor],
    ) -> Result<()> {
        let x = saved_tensor(KIND, saved, 0)?;
        let ctx = saved_tensor(KIND, saved, 3)?;
        let [in_weight_grad, in_bias_grad, out_weight_grad, out_bias_grad] = param_grads else {
            unreachable!("check_param_grads checked four gradients");
        };
        let kernel = dims.kernel(self.causal);
        grad_qkv.attention_qkv_weight_grads(x, kernel, in_weight_grad, in_bias_grad)?;
        Precision::round_operand(grad_output, x.dtype())?.attention_out_grads(
            ctx,
            kernel,
            out_weight_grad,
            out_bias_grad,
        )
    }

    fn saved_dims(&self, saved: &Saved, grad_output: &Tensor) -> Result<Dims> {
        let input = saved_tensor(KIND, saved, 0)?;
        let dims = self.dims(input.shape())?;
        check_grad_shape(KIND, grad_output, input.shape())?;
        Ok(dims)
    }
}

/// The per-sample output shape of self-attention of width `embed_dim`: its input's, `[tokens,
/// embed_dim]` (shared with the head-split layer, `kind` naming the caller in errors).
pub(crate) fn self_attention_output_shape(kind: &str, input_shapes: &[Shape], embed_dim: usize) -> Result<Shape> {
    let shape = &expect_shapes(kind, input_shapes, 1)?[0];
    match shape.dims() {
        &[tokens, d] if d == embed_dim && tokens > 0 => Ok(shape.clone()),
        _ => Err(Error::shape(
            kind,
            format!("a per-sample shape [tokens, {embed_dim}] with tokens >= 1"),
            shape.to_string(),
        )),
    }
}

/// FLOPs per sample of self-attention over `t` tokens of width `d` with `h` heads, all heads
/// together: (forward, input-gradient call, weight-gradient call).
pub(crate) fn self_attention_flops(t: u64, d: u64, h: u64) -> (u64, u64, u64) {
    // Projections: in_proj 2·T·D·3D (+ 3TD bias), out_proj 2·T·D·D (+ TD bias).
    // Attention: q kᵀ and P v are 2·T²·D each over all heads; scale, mask and softmax ≈ 5 per score.
    let projections = 8 * t * d * d + 4 * t * d;
    let attention = 4 * t * t * d + 5 * h * t * t;
    // The backward chain, run once by whichever backward call comes first (the runtime's order
    // puts it in backward_input): dctx (2TD²); S recomputed, dP, dV, dQ, dK (2T²D each); exp and
    // dS ≈ 8 per score.
    let chain = 2 * t * d * d + 10 * t * t * d + 8 * h * t * t;
    (projections + attention, chain + 6 * t * d * d, 8 * t * d * d + 4 * t * d)
}

fn check_heads(embed_dim: usize, n_heads: usize) -> Result<()> {
    if embed_dim == 0 || n_heads == 0 || !embed_dim.is_multiple_of(n_heads) {
        return Err(Error::invalid(
            "MultiheadSelfAttention heads",
            format!(
                "embed_dim={embed_dim}, n_heads={n_heads}: both must be at least 1 and n_heads must divide embed_dim"
            ),
        ));
    }
    Ok(())
}

impl Layer for MultiheadSelfAttention {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        self_attention_output_shape(KIND, input_shapes, self.embed_dim)
    }

    fn parameters(&self) -> &[Parameter] {
        &self.params
    }

    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut self.params
    }

    fn forward(&self, inputs: &[&Tensor], ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        expect_inputs(KIND, inputs, 1)?;
        let dims = self.dims(inputs[0].shape())?;
        check_same_device(KIND, inputs[0], &self.params[0].value)?;
        let device = inputs[0].device();
        let (rows, d) = (dims.rows(), dims.embed_dim);
        let kernel = dims.kernel(self.causal);
        // Autocast ([`Precision`]): the projections' operands rounded to the half type (f32 sums),
        // q/k/v and the heads' output stored in it; the softmax and its logsumexp stay f32.
        let dtype = ctx.precision.matmul_dtype(inputs[0].dtype());
        let round = |t: &Tensor| Precision::round_operand(t, dtype);
        let input = round(inputs[0])?;
        // q, k, v head-major, then ctx = concat_h(softmax(q_h k_hᵀ · scale + mask) v_h) and the
        // rows' logsumexp, fused.
        let qkv = input.attention_qkv(&round(&self.params[0].value)?, &round(&self.params[1].value)?, kernel)?;
        let qkv = into_dtype(qkv, dtype)?;
        let (heads, logsumexp) = qkv.attention(kernel)?;
        let heads = into_dtype(heads, dtype)?;
        // y = ctx · out_proj.weightᵀ + out_proj.bias
        let out_weight = round(&self.params[2].value)?;
        let output = Tensor::matmul(
            Matrix::new(&heads, rows, d)?,
            Matrix::new(&out_weight, d, d)?.t(),
            Some(&round(&self.params[3].value)?),
            input.shape().clone(),
            device,
        )?;
        let saved = Saved { tensors: vec![input, qkv, logsumexp, heads] };
        Ok((into_dtype(output, dtype)?, saved))
    }

    fn backward(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<Vec<Option<Tensor>>> {
        check_param_grads(KIND, &self.params, param_grads)?;
        let dims = self.saved_dims(saved, grad_output)?;
        let grad_qkv = self.grad_qkv(dims, saved, grad_output)?;
        let grad_input = self.input_grad(dims, saved_tensor(KIND, saved, 0)?, &grad_qkv)?;
        self.add_weight_grads(dims, saved, grad_output, &grad_qkv, param_grads)?;
        Ok(vec![Some(grad_input)])
    }

    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let dims = self.saved_dims(saved, grad_output)?;
        let grad_qkv = self.shared_grad_qkv(dims, saved, grad_output, Half::Input)?;
        Ok(vec![Some(self.input_grad(dims, saved_tensor(KIND, saved, 0)?, &grad_qkv)?)])
    }

    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()> {
        check_param_grads(KIND, &self.params, param_grads)?;
        let dims = self.saved_dims(saved, grad_output)?;
        let grad_qkv = self.shared_grad_qkv(dims, saved, grad_output, Half::Weight)?;
        self.add_weight_grads(dims, saved, grad_output, &grad_qkv, param_grads)
    }

    fn weight_pass_scratch_bytes(&self) -> u64 {
        // The device ops sum each parameter's part apart (on a CPU), one parameter at a time.
        largest_parameter_bytes(&self.params)
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let output = self.output_shape(input_shapes)?;
        let (t, h) = (output.dims()[0] as u64, self.n_heads as u64);
        let (forward, backward_input, backward_weight) = self_attention_flops(t, self.embed_dim as u64, h);
        let param_count: usize = self.params.iter().map(|p| p.value.numel()).sum();
        let numel = output.numel();
        Ok(LayerCost {
            workspace_bytes: 0,
            forward_flops_per_sample: forward,
            backward_input_flops_per_sample: backward_input,
            backward_weight_flops_per_sample: backward_weight,
            param_bytes: f32_bytes(param_count),
            // input, q/k/v, the logsumexp [H, T] and the concatenated heads.
            activation_bytes_per_sample: f32_bytes(5 * numel + (h * t) as usize),
            output_bytes_per_sample: f32_bytes(numel),
            // ∂L/∂qkv [3, T, D], left in the pending slot by backward_input for backward_weight.
            backward_held_bytes_per_sample: f32_bytes(3 * numel),
            // The ops' own scratch, and ∂L/∂ctx ([T, D], a tensor on the GPU's ledger from the
            // out-projection's product until the chain has used it) in the input-gradient call.
            gpu_scratch_bytes_per_sample: {
                let ops = attention_gpu_scratch(t as usize, self.embed_dim, self.n_heads);
                CallScratch { backward_input: ops.backward_input + f32_bytes(numel), ..ops }
            },
        })
    }
}
