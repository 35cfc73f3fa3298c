//! The per-shard arithmetic of `ParallelTransformerBlock`'s three calls (see `block.rs` for the
//! layout and the exchanges): the forward pass over the shard's tokens, heads and hidden features;
//! the input-gradient chain; the weight gradients from the chain's intermediate gradients.
use conveyor_engine::collective::{Communicator, Partition};
use conveyor_engine::cpu::attention::AttentionDims;
use conveyor_engine::device::ops::{Activation, Matrix};
use conveyor_engine::{DType, Device, Error, Result, Saved, Shape, Tensor};

use super::attention::check_sequence_input;
use super::block::{FIRST_SHARD, KIND, OTHER_SHARD, ParallelTransformerBlock};
use super::exchange::{all_gather_columns, columns_for_shard, gather_columns, input_for_shard, reduce_scatter_columns};
use super::layout::column_block;
use super::linear_shard;
use super::pending::Half;
use crate::tensor_io::{check_grad_shape, expect_inputs};

/// Saved tensors per shard, in this order: `x_r`, ln1's mean and rstd, `h1_r`, q/k/v, the
/// logsumexp, the context, `s_r`, ln2's mean and rstd, `h2_r`, the hidden block (before GELU), the
/// LayerNorm weights `[ln1.weight; ln1.bias; ln2.weight; ln2.bias]`.
const SAVED_PER_SHARD: usize = 13;

/// What the input-gradient chain leaves per shard for the weight pass, in this order: the hidden
/// gradient, `∂L/∂qkv`, the residual stream's gradient `ds_r` (the attention's output gradient,
/// token block) and the LayerNorms' weight gradients over the shard's tokens
/// (`[ln1.weight; ln1.bias; ln2.weight; ln2.bias]`, `4·D` floats: summed here rather than keeping
/// their output gradients, two token blocks).
const CHAIN_PER_SHARD: usize = 4;

/// The sizes of one call: `[batch, tokens, D]` with the tokens split over the shards.
struct CallDims {
    batch: usize,
    tokens: usize,
    /// Tokens per shard.
    split: Partition,
    /// The token blocks as column blocks of `[batch, tokens · D]`.
    flat: Partition,
}

impl CallDims {
    fn full(&self, dim: usize) -> Vec<usize> {
        vec![self.batch, self.tokens, dim]
    }

    fn block(&self, rank: usize, dim: usize) -> Vec<usize> {
        vec![self.batch, self.split.len(rank), dim]
    }
}

/// A gradient every shard holds (the parameter list is checked against `parameters()`).
fn every(grad: Option<&mut Tensor>) -> Result<&mut Tensor> {
    grad.ok_or_else(|| Error::invalid(KIND, "a shard's gradient is missing"))
}

/// The chain's gradients of one shard.
struct Chain {
    grad_hidden: Tensor,
    grad_qkv: Tensor,
    grad_s: Tensor,
    norm_grads: Tensor,
}

impl Chain {
    fn into_vec(self) -> [Tensor; CHAIN_PER_SHARD] {
        [self.grad_hidden, self.grad_qkv, self.grad_s, self.norm_grads]
    }

    fn from_slice(tensors: &mut Vec<Tensor>) -> Chain {
        let mut take = || tensors.remove(0);
        Chain { grad_hidden: take(), grad_qkv: take(), grad_s: take(), norm_grads: take() }
    }
}

impl ParallelTransformerBlock {
    fn call_dims(&self, batch: usize, tokens: usize) -> Result<CallDims> {
        let k = self.group.k();
        if tokens < k {
            return Err(Error::invalid(
                format!("{KIND} input"),
                format!(
                    "{tokens} tokens cannot be split over {k} devices by sequence parallelism: each needs at least \
                     one; use at most {tokens} devices or turn sequence parallelism off"
                ),
            ));
        }
        let split = Partition::even(tokens, k)?;
        let flat = split.scaled(self.dim);
        Ok(CallDims { batch, tokens, split, flat })
    }

    fn kernel(&self, dims: &CallDims, rank: usize) -> AttentionDims {
        AttentionDims {
            batch: dims.batch,
            tokens: dims.tokens,
            n_heads: self.heads.len(rank),
            head_dim: self.head_dim,
            causal: self.causal,
        }
    }

    /// The LayerNorm weights on shard `rank`'s device: the first shard's, broadcast.
    fn norm_weights(&self, rank: usize, comm: &dyn Communicator, device: &Device) -> Result<Tensor> {
        let mut packed = if rank == 0 {
            let held: Vec<&Tensor> =
                ["ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias"].iter().map(|n| self.param(0, n)).collect();
            Tensor::cat_rows(&held, device)?
        } else {
            Tensor::zeros([4 * self.dim], DType::F32, device)?
        };
        comm.broadcast_tensor(&mut packed, 0)?;
        Ok(packed)
    }

    /// Part `i` (0 ln1.weight, 1 ln1.bias, 2 ln2.weight, 3 ln2.bias) of the packed LayerNorm weights.
    fn norm_part(&self, packed: &Tensor, i: usize) -> Result<Tensor> {
        packed.narrow_rows(i * self.dim, self.dim)
    }

    /// The unsplit `[batch, tokens, D]` from every shard's token block: on the first shard (with
    /// every shard here), or on every rank (one shard per rank, each returning the output).
    fn assemble(&self, comm: &dyn Communicator, block: &Tensor, dims: &CallDims) -> Result<Option<Tensor>> {
        let device = block.device().clone();
        if self.group.inputs_replicated() {
            return all_gather_columns(comm, block, dims.batch, &dims.flat, dims.full(self.dim), &device).map(Some);
        }
        gather_columns(comm, block, dims.batch, &dims.flat, dims.full(self.dim), &device)
    }

    /// Checks the saved state and `dy`; returns the call's sizes.
    fn check_saved(&self, saved: &Saved, grad_output: &Tensor) -> Result<CallDims> {
        let n = self.group.n_local();
        let bad = || {
            Error::invalid(
                format!("{KIND} saved state"),
                format!(
                    "expected {SAVED_PER_SHARD} tensors for each of {n} shards; pass the Saved returned by this \
                     layer's forward"
                ),
            )
        };
        if saved.tensors.len() != SAVED_PER_SHARD * n || saved.tensors[0].dims().len() != 3 {
            return Err(bad());
        }
        let hidden = &saved.tensors[11];
        let (batch, tokens) = match hidden.dims() {
            &[batch, tokens, _] => (batch, tokens),
            _ => return Err(bad()),
        };
        let dims = self.call_dims(batch, tokens)?;
        for rank in self.group.local() {
            if self.saved(saved, rank)[0].dims() != dims.block(rank, self.dim) {
                return Err(bad());
            }
        }
        check_grad_shape(KIND, grad_output, &Shape::new(dims.full(self.dim)))?;
        self.group.check_input(KIND, grad_output)?;
        Ok(dims)
    }

    fn saved<'a>(&self, saved: &'a Saved, rank: usize) -> &'a [Tensor] {
        let at = SAVED_PER_SHARD * self.group.local_index(rank);
        &saved.tensors[at..at + SAVED_PER_SHARD]
    }

    /// `[Layer::forward]`: every shard's pass over its tokens, heads and hidden features.
    pub(super) fn forward_split(&self, inputs: &[&Tensor]) -> Result<(Tensor, Saved)> {
        expect_inputs(KIND, inputs, 1)?;
        let input = inputs[0];
        check_sequence_input(KIND, &self.group, input, self.dim)?;
        let dims = self.call_dims(input.dims()[0], input.dims()[1])?;
        let replicated = self.group.inputs_replicated();
        let d = self.dim;
        let results = self.group.run(vec![(); self.group.n_local()], |rank, comm, ()| {
            let device = self.group.device(rank);
            let block = dims.block(rank, d);
            let x = columns_for_shard(comm, input, dims.batch, &dims.flat, block.clone(), device, replicated)?;
            let norms = self.norm_weights(rank, comm, device)?;
            let (h1, mean1, rstd1) =
                x.layer_norm(&self.norm_part(&norms, 0)?, &self.norm_part(&norms, 1)?, self.eps[0])?;
            let gathered = all_gather_columns(comm, &h1, dims.batch, &dims.flat, dims.full(d), device)?;
            let kernel = self.kernel(&dims, rank);
            let qkv = gathered.attention_qkv(
                self.param(rank, "attn.in_proj_weight"),
                self.param(rank, "attn.in_proj_bias"),
                kernel,
            )?;
            drop(gathered);
            let (context, logsumexp) = qkv.attention(kernel)?;
            let (rows, width) = (dims.batch * dims.tokens, kernel.embed_dim());
            let out_bias = self.slot(rank, "attn.out_proj.bias").filter(|_| rank == 0).map(|i| &self.params[i].value);
            let partial = Tensor::matmul(
                Matrix::new(&context, rows, width)?,
                Matrix::new(self.param(rank, "attn.out_proj.weight"), d, width)?.t(),
                out_bias,
                dims.full(d),
                device,
            )?;
            let attended = reduce_scatter_columns(comm, &partial, dims.batch, &dims.flat, block.clone(), device)?;
            drop(partial);
            let s = x.add(&attended)?;
            let (h2, mean2, rstd2) =
                s.layer_norm(&self.norm_part(&norms, 2)?, &self.norm_part(&norms, 3)?, self.eps[1])?;
            let gathered = all_gather_columns(comm, &h2, dims.batch, &dims.flat, dims.full(d), device)?;
            let hidden =
                linear_shard::forward(&gathered, self.param(rank, "fc1.weight"), Some(self.param(rank, "fc1.bias")))?;
            drop(gathered);
            let activated = hidden.activation(Activation::Gelu)?;
            let fc2_bias = if rank == 0 { Some(self.param(0, "fc2.bias")) } else { None };
            let partial = linear_shard::forward(&activated, self.param(rank, "fc2.weight"), fc2_bias)?;
            drop(activated);
            let mlp = reduce_scatter_columns(comm, &partial, dims.batch, &dims.flat, block, device)?;
            drop(partial);
            let out = s.add(&mlp)?;
            let output = self.assemble(comm, &out, &dims)?;
            let kept = [x, mean1, rstd1, h1, qkv, logsumexp, context, s, mean2, rstd2, h2, hidden, norms];
            Ok((kept, output.filter(|_| self.group.returns_output(rank))))
        })?;
        let mut tensors = Vec::with_capacity(SAVED_PER_SHARD * results.len());
        let mut output = None;
        for (kept, y) in results {
            tensors.extend(kept);
            output = output.or(y);
        }
        let output = output.ok_or_else(|| Error::invalid(KIND, "rank 0 returned no output"))?;
        Ok((output, Saved { tensors }))
    }

    /// Shard `rank`'s input-gradient chain from its copy of the whole `dy`: returns its token block
    /// of the input gradient and what the weight pass needs.
    fn chain(
        &self,
        rank: usize,
        comm: &dyn Communicator,
        saved: &Saved,
        dy: &Tensor,
        dims: &CallDims,
    ) -> Result<(Tensor, Chain)> {
        let [x, mean1, rstd1, _h1, qkv, logsumexp, context, s, mean2, rstd2, _h2, hidden, norms] =
            <&[Tensor; SAVED_PER_SHARD]>::try_from(self.saved(saved, rank))
                .map_err(|_| Error::invalid(KIND, "saved"))?;
        let (d, device) = (self.dim, self.group.device(rank));
        let block = dims.block(rank, d);
        let full = Shape::new(dims.full(d));
        // The residual's gradient at the block's output, this shard's tokens.
        let grad_out = column_block(dy, dims.batch, &dims.flat, rank, block.clone(), device)?;
        // The MLP: its output gradient is the whole dy (the reduce-scatter's backward is a gather).
        let grad_activated = linear_shard::input_grad(dy, self.param(rank, "fc2.weight"), hidden.shape())?;
        let grad_hidden = Tensor::activation_grad(Activation::Gelu, hidden, &grad_activated)?;
        drop(grad_activated);
        let partial = linear_shard::input_grad(&grad_hidden, self.param(rank, "fc1.weight"), &full)?;
        let grad_h2 = reduce_scatter_columns(comm, &partial, dims.batch, &dims.flat, block.clone(), device)?;
        drop(partial);
        let ln2_weight = self.norm_part(norms, 2)?;
        let grad_s = grad_out.add(&grad_h2.layer_norm_input_grad(s, &ln2_weight, mean2, rstd2)?)?;
        // The attention: its output gradient is ds, gathered.
        let grad_attended = all_gather_columns(comm, &grad_s, dims.batch, &dims.flat, dims.full(d), device)?;
        let kernel = self.kernel(dims, rank);
        let (rows, width) = (dims.batch * dims.tokens, kernel.embed_dim());
        let grad_context = Tensor::matmul(
            Matrix::new(&grad_attended, rows, d)?,
            Matrix::new(self.param(rank, "attn.out_proj.weight"), d, width)?,
            None,
            [rows, width],
            device,
        )?;
        drop(grad_attended);
        let grad_qkv = grad_context.attention_backward(qkv, context, logsumexp, kernel)?;
        drop(grad_context);
        let partial = grad_qkv.attention_qkv_input_grad(self.param(rank, "attn.in_proj_weight"), &full, kernel)?;
        let grad_h1 = reduce_scatter_columns(comm, &partial, dims.batch, &dims.flat, block, device)?;
        drop(partial);
        let ln1_weight = self.norm_part(norms, 0)?;
        let grad_x = grad_s.add(&grad_h1.layer_norm_input_grad(x, &ln1_weight, mean1, rstd1)?)?;
        // The LayerNorms' weight gradients over this shard's tokens.
        let zeros = || Tensor::zeros([d], DType::F32, device);
        let (mut w1, mut b1, mut w2, mut b2) = (zeros()?, zeros()?, zeros()?, zeros()?);
        grad_h1.layer_norm_weight_grad_accumulate(x, mean1, rstd1, &mut w1, &mut b1)?;
        grad_h2.layer_norm_weight_grad_accumulate(s, mean2, rstd2, &mut w2, &mut b2)?;
        let norm_grads = Tensor::cat_rows(&[&w1, &b1, &w2, &b2], device)?;
        Ok((grad_x, Chain { grad_hidden, grad_qkv, grad_s, norm_grads }))
    }

    /// `[Layer::backward_input]`: the chain (or the one the weight pass left), the input gradient
    /// gathered on the first device.
    pub(super) fn input_grad_split(&self, saved: &Saved, grad_output: &Tensor) -> Result<Tensor> {
        let dims = self.check_saved(saved, grad_output)?;
        let replicated = self.group.inputs_replicated();
        let n = self.group.n_local();
        let key = &saved.tensors[0];
        let left = self.pending.take(key, grad_output, Half::Input);
        let was_pending = left.is_some();
        let states: Vec<Option<Tensor>> = match left {
            Some(grads) if grads.len() == n => grads.into_iter().map(Some).collect(),
            _ => (0..n).map(|_| None).collect(),
        };
        let results = self.group.run(states, |rank, comm, grad_x| {
            let device = self.group.device(rank);
            let (grad_x, chain) = match grad_x {
                Some(grad_x) => (grad_x, None),
                None => {
                    let dy = input_for_shard(comm, grad_output, device, replicated)?;
                    let (grad_x, chain) = self.chain(rank, comm, saved, &dy, &dims)?;
                    (grad_x, Some(chain))
                }
            };
            let output = self.assemble(comm, &grad_x, &dims)?;
            Ok((chain, output.filter(|_| self.group.returns_output(rank))))
        })?;
        let mut left_for_weight = Vec::with_capacity(CHAIN_PER_SHARD * n);
        let mut output = None;
        for (chain, grad_x) in results {
            left_for_weight.extend(chain.into_iter().flat_map(Chain::into_vec));
            output = output.or(grad_x);
        }
        if !was_pending {
            self.pending.leave(key, grad_output, &left_for_weight, Half::Input);
        }
        output.ok_or_else(|| Error::invalid(KIND, "rank 0 returned no input gradient"))
    }

    /// `[Layer::backward_weight]`: the weight gradients of every shard held here from the chain
    /// (the one the input call left, or computed here and left for it).
    pub(super) fn weight_grads_split(
        &self,
        saved: &Saved,
        grad_output: &Tensor,
        grads: Vec<&mut [Tensor]>,
    ) -> Result<()> {
        let dims = self.check_saved(saved, grad_output)?;
        let replicated = self.group.inputs_replicated();
        let n = self.group.n_local();
        let key = &saved.tensors[0];
        let left = self.pending.take(key, grad_output, Half::Weight);
        let was_pending = left.is_some();
        let mut chains: Vec<Option<Chain>> = match left {
            Some(mut tensors) if tensors.len() == CHAIN_PER_SHARD * n => {
                (0..n).map(|_| Some(Chain::from_slice(&mut tensors))).collect()
            }
            _ => (0..n).map(|_| None).collect(),
        };
        let states: Vec<_> = grads.into_iter().zip(chains.iter_mut().map(Option::take)).collect();
        let computed = self.group.run(states, |rank, comm, (grads, chain)| {
            let device = self.group.device(rank);
            let dy = input_for_shard(comm, grad_output, device, replicated)?;
            let (grad_x, chain) = match chain {
                Some(chain) => (None, chain),
                None => {
                    let (grad_x, chain) = self.chain(rank, comm, saved, &dy, &dims)?;
                    (Some(grad_x), chain)
                }
            };
            self.shard_weight_grads(rank, comm, saved, &dy, &chain, &dims, grads)?;
            Ok(grad_x)
        })?;
        if !was_pending {
            let left_for_input: Vec<Tensor> = computed.into_iter().flatten().collect();
            self.pending.leave(key, grad_output, &left_for_input, Half::Weight);
        }
        Ok(())
    }

    /// Adds shard `rank`'s weight gradients into `grads` (its run of `parameters()`), and on the
    /// first shard the LayerNorms' gradients summed over every shard's tokens.
    #[allow(clippy::too_many_arguments)]
    fn shard_weight_grads(
        &self,
        rank: usize,
        comm: &dyn Communicator,
        saved: &Saved,
        dy: &Tensor,
        chain: &Chain,
        dims: &CallDims,
        grads: &mut [Tensor],
    ) -> Result<()> {
        let [_, _, _, h1, _, _, context, _, _, _, h2, hidden, _] =
            <&[Tensor; SAVED_PER_SHARD]>::try_from(self.saved(saved, rank))
                .map_err(|_| Error::invalid(KIND, "saved"))?;
        let (d, device) = (self.dim, self.group.device(rank));
        let names: &[&str] = if rank == 0 { &FIRST_SHARD } else { &OTHER_SHARD };
        // Each gradient by name, mutably (they are distinct elements of `grads`).
        let mut by_name: Vec<(&str, &mut Tensor)> = names.iter().copied().zip(grads.iter_mut()).collect();
        let mut take = |name: &str| by_name.iter().position(|(n, _)| *n == name).map(|i| by_name.swap_remove(i).1);
        let fc2_weight = every(take("fc2.weight"))?;
        let fc2_bias = take("fc2.bias");
        let fc1_weight = every(take("fc1.weight"))?;
        let fc1_bias = every(take("fc1.bias"))?;
        let in_weight = every(take("attn.in_proj_weight"))?;
        let in_bias = every(take("attn.in_proj_bias"))?;
        let out_weight = every(take("attn.out_proj.weight"))?;
        let out_bias = take("attn.out_proj.bias");
        let norm_grads = ["ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias"].map(&mut take);
        let activated = hidden.activation(Activation::Gelu)?;
        linear_shard::weight_grad(dy, &activated, fc2_weight, fc2_bias)?;
        drop(activated);
        let gathered = all_gather_columns(comm, h2, dims.batch, &dims.flat, dims.full(d), device)?;
        linear_shard::weight_grad(&chain.grad_hidden, &gathered, fc1_weight, Some(fc1_bias))?;
        drop(gathered);
        let gathered = all_gather_columns(comm, h1, dims.batch, &dims.flat, dims.full(d), device)?;
        let kernel = self.kernel(dims, rank);
        chain.grad_qkv.attention_qkv_weight_grads(&gathered, kernel, in_weight, in_bias)?;
        drop(gathered);
        let grad_attended = all_gather_columns(comm, &chain.grad_s, dims.batch, &dims.flat, dims.full(d), device)?;
        linear_shard::weight_grad(&grad_attended, context, out_weight, out_bias)?;
        drop(grad_attended);
        // The LayerNorms' gradients, summed over the shards' tokens.
        let mut summed = chain.norm_grads.try_clone()?;
        comm.all_reduce_tensor(&mut summed)?;
        for (i, grad) in norm_grads.into_iter().enumerate() {
            if let Some(grad) = grad {
                grad.add_assign(&summed.narrow_rows(i * d, d)?)?;
            }
        }
        Ok(())
    }
}
