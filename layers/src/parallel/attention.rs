//! `ParallelSelfAttention`: multi-head self-attention split by heads over `k` devices, Megatron's
//! attention block: the q/k/v projection column-parallel (each device owns whole heads), the
//! attention local to each device, the output projection row-parallel, one all-reduce in the
//! forward pass and one in the input-gradient pass.
//!
//! # Layout
//!
//! PyTorch packs `in_proj_weight` `[3D, D]` as q rows, then k rows, then v rows, head `h` being
//! rows `h·dh ..` of each third. Device `r`, owning heads `heads.range(r)` (`D_r` features), holds
//! the rows of its heads from each third, packed the same way: `[3·D_r, D]` (q_r; k_r; v_r), so
//! its shard is itself a PyTorch-layout attention over its heads with input width `D`, and the
//! engine's attention ops run on it unchanged (Megatron's stride-3 partition). `out_proj.weight`
//! `[D, D]` is split by columns (device `r` holds the columns of its heads' context, `[D, D_r]`)
//! and `out_proj.bias` stays whole on the first device, added once before the all-reduce.
//!
//! # The backward chain, once
//!
//! As in `MultiheadSelfAttention`, `∂L/∂qkv` (the chain behind the softmax) is needed by both
//! backward calls. Whichever runs first computes every shard's part and leaves it in a pending
//! slot keyed by the saved logsumexp and the output gradient; the other call takes it out. The
//! memory plan counts the slot as the unsplit layer's (`backward_held_bytes_per_sample`).
use conveyor_engine::collective::{Partition, Traffic};
use conveyor_engine::cpu::attention::AttentionDims;
use conveyor_engine::device::ops::{Matrix, attention_gpu_scratch};
use conveyor_engine::{
    CallScratch, DType, Device, Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor,
};

use super::exchange::{all_gather_columns, grads_per_rank, input_for_shard};
use super::group::{ShardGroup, Shards};
use super::layout::column_block;
use super::pending::{Half, PendingSlots};
use super::{gather_rows, linear_shard, load_shard, shard_rows, unsplit_columns};
use crate::MultiheadSelfAttention;
use crate::attention::{self_attention_flops, self_attention_output_shape};
use crate::tensor_io::{check_grad_shape, check_param_grads, expect_inputs, f32_bytes, into_dtype};

const KIND: &str = "ParallelSelfAttention";

/// Saved tensors per shard: the input copy, q/k/v, the logsumexp, the heads' context.
const SAVED_PER_SHARD: usize = 4;

/// [`MultiheadSelfAttention`] (PyTorch's `nn.MultiheadAttention`, batch first) split by heads:
/// device `r` computes `y_r = attention_r(x) · out_proj.weight_rᵀ` over its heads, and one
/// all-reduce sums the `y_r` (`out_proj.bias` added on the first device). The head count must be a
/// multiple of `k`, as in Megatron.
///
/// Exchanges per call: forward broadcasts `x` and all-reduces `y`; `backward_input` broadcasts `dy`
/// and all-reduces the partial input gradients; `backward_weight` broadcasts `dy`. With one shard
/// per rank (MPI) every rank is called with the same `x` and `dy`, so nothing is broadcast.
///
/// `parameters()` is rank-major over the shards held here: each shard's `in_proj_weight`
/// `[3·D_r, D]`, `in_proj_bias` `[3·D_r]`, `out_proj.weight` `[D, D_r]`, and after shard 0's,
/// `out_proj.bias` `[D]`. [`Self::gather_parameters`] gives the unsplit tensors under PyTorch's
/// names and shapes.
#[derive(Debug)]
pub struct ParallelSelfAttention {
    embed_dim: usize,
    n_heads: usize,
    head_dim: usize,
    causal: bool,
    /// Heads per shard.
    heads: Partition,
    params: Vec<Parameter>,
    group: ShardGroup,
    /// Every local shard's `∂L/∂qkv`, computed by one backward call and waiting for the other.
    pending: PendingSlots,
}

/// The heads' rows of each third of a packed `[3·D, ...]` tensor (q, k, v) for the features
/// `features`, packed `[3·len, ...]` on `device`: a shard's part of `in_proj_weight` or
/// `in_proj_bias`.
pub(super) fn stride3_rows(
    value: &Tensor,
    embed_dim: usize,
    features: std::ops::Range<usize>,
    device: &Device,
) -> Result<Tensor> {
    let trailing: Vec<usize> = value.dims()[1..].to_vec();
    let thirds = (0..3)
        .map(|w| {
            let mut dims = vec![features.len()];
            dims.extend(&trailing);
            shard_rows(value, w * embed_dim + features.start..w * embed_dim + features.end, dims, &Device::host())
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat_rows(&thirds.iter().collect::<Vec<_>>(), device)
}

/// The inverse of [`stride3_rows`] over every shard: `rank_major` holds the shards' packed blocks
/// one after the other (`3·parts.len(r)` rows each, on the host); the result is PyTorch's packing.
pub(super) fn unpack_stride3(rank_major: &Tensor, parts: &Partition) -> Result<Tensor> {
    let mut blocks = Vec::with_capacity(3 * parts.n_ranks());
    for w in 0..3 {
        for rank in 0..parts.n_ranks() {
            let len = parts.len(rank);
            blocks.push(rank_major.narrow_rows(3 * parts.range(rank).start + w * len, len)?);
        }
    }
    Tensor::cat_rows(&blocks.iter().collect::<Vec<_>>(), &Device::host())
}

/// `n_heads` heads split evenly over `k` devices; an error naming the valid degrees when `k` does
/// not divide them (each device needs whole heads and the same number, as in Megatron).
pub(super) fn split_heads(kind: &str, n_heads: usize, k: usize) -> Result<Partition> {
    if !n_heads.is_multiple_of(k) {
        let valid: Vec<String> = (1..=n_heads).filter(|d| n_heads.is_multiple_of(*d)).map(|d| d.to_string()).collect();
        return Err(Error::invalid(
            format!("{kind} devices"),
            format!(
                "{n_heads} heads cannot be split over {k} devices: each device needs whole heads and the same \
                 number of them; use a tensor-parallel degree of {}",
                valid.join(", ")
            ),
        ));
    }
    Partition::even(n_heads, k)
}

/// Checks a `[batch, tokens, dim]` f32 input (tokens at least 1) on `group`'s first device.
pub(super) fn check_sequence_input(kind: &str, group: &ShardGroup, input: &Tensor, dim: usize) -> Result<()> {
    match input.dims() {
        &[_, tokens, d] if d == dim && tokens > 0 => group.check_input(kind, input),
        _ => Err(Error::shape(
            kind,
            format!("an input [batch, tokens, {dim}] with tokens >= 1"),
            input.shape().to_string(),
        )),
    }
}

impl ParallelSelfAttention {
    /// `attention`'s parameters split by heads over `devices` (each shard created on its device).
    pub fn from_attention(attention: &MultiheadSelfAttention, devices: &[Device]) -> Result<Self> {
        ParallelSelfAttention::from_attention_on(attention, &Shards::Local(devices.to_vec()))
    }

    /// `attention`'s parameters split as `shards` says (all shards here, or this rank's one).
    pub fn from_attention_on(attention: &MultiheadSelfAttention, shards: &Shards) -> Result<Self> {
        let group = ShardGroup::new(KIND, shards)?;
        let (embed_dim, n_heads) = (attention.embed_dim(), attention.n_heads());
        let heads = split_heads(KIND, n_heads, group.k())?;
        let head_dim = attention.head_dim();
        let features = heads.scaled(head_dim);
        let source = attention.parameters();
        let [in_weight, in_bias, out_weight, out_bias] = [0, 1, 2, 3].map(|i| &source[i].value);
        let out_weight = into_dtype(out_weight.share(), DType::F32)?;
        let mut params = Vec::new();
        for (rank, device) in group.local_devices() {
            let range = features.range(rank);
            let width = range.len();
            params.push(Parameter {
                name: "in_proj_weight".into(),
                value: stride3_rows(in_weight, embed_dim, range.clone(), device)?,
            });
            params.push(Parameter {
                name: "in_proj_bias".into(),
                value: stride3_rows(in_bias, embed_dim, range, device)?,
            });
            let value = column_block(&out_weight, embed_dim, &features, rank, vec![embed_dim, width], device)?;
            params.push(Parameter { name: "out_proj.weight".into(), value });
            if rank == 0 {
                let value = shard_rows(out_bias, 0..embed_dim, [embed_dim], device)?;
                params.push(Parameter { name: "out_proj.bias".into(), value });
            }
        }
        Ok(ParallelSelfAttention {
            embed_dim,
            n_heads,
            head_dim,
            causal: attention.is_causal(),
            heads,
            params,
            group,
            pending: PendingSlots::default(),
        })
    }

    /// Heads per device.
    pub fn partition(&self) -> &Partition {
        &self.heads
    }

    /// The devices of the shards held here, in shard order; inputs arrive on and outputs leave
    /// from the first.
    pub fn devices(&self) -> &[Device] {
        self.group.devices()
    }

    /// Messages and bytes each device (in rank order) has sent in this layer's collectives since
    /// construction or the last [`Self::reset_traffic`].
    pub fn traffic(&self) -> Vec<Traffic> {
        self.group.traffic()
    }

    /// Sets the sent-traffic counters to zero.
    pub fn reset_traffic(&self) {
        self.group.reset_traffic()
    }

    /// Bytes of `∂L/∂qkv` waiting in slots for their second backward call.
    pub fn pending_gradient_bytes(&self) -> usize {
        self.pending.bytes()
    }

    /// Index in `params` of shard `rank`'s `in_proj_weight` (shard 0 has one more parameter).
    fn first_param(&self, rank: usize) -> usize {
        let before = self.group.local_index(rank);
        3 * before + usize::from(before > 0 && self.group.local().start == 0)
    }

    /// Shard `rank`'s (`in_proj_weight`, `in_proj_bias`, `out_proj.weight`, `out_proj.bias` on
    /// shard 0).
    fn shard(&self, rank: usize) -> (&Tensor, &Tensor, &Tensor, Option<&Tensor>) {
        let at = self.first_param(rank);
        let bias = (rank == 0).then(|| &self.params[at + 3].value);
        (&self.params[at].value, &self.params[at + 1].value, &self.params[at + 2].value, bias)
    }

    /// The parameters of each shard held here.
    fn counts(&self) -> Vec<usize> {
        self.group.local().map(|r| if r == 0 { 4 } else { 3 }).collect()
    }

    /// The attention kernel's sizes for shard `rank` on an input `[batch, tokens, D]`.
    fn kernel(&self, input: &Shape, rank: usize) -> AttentionDims {
        let dims = input.dims();
        AttentionDims {
            batch: dims[0],
            tokens: dims[1],
            n_heads: self.heads.len(rank),
            head_dim: self.head_dim,
            causal: self.causal,
        }
    }

    /// Checks the saved state (4 tensors per shard held here) and `dy`; returns the input shape.
    fn check_saved(&self, saved: &Saved, grad_output: &Tensor) -> Result<Shape> {
        let n = self.group.n_local();
        if saved.tensors.len() != SAVED_PER_SHARD * n
            || (0..n).any(|i| saved.tensors[SAVED_PER_SHARD * i].dims() != saved.tensors[0].dims())
        {
            return Err(Error::invalid(
                format!("{KIND} saved state"),
                format!(
                    "expected {SAVED_PER_SHARD} tensors for each of {n} shards; pass the Saved returned by this \
                     layer's forward"
                ),
            ));
        }
        let input_shape = saved.tensors[0].shape().clone();
        check_grad_shape(KIND, grad_output, &input_shape)?;
        self.group.check_input(KIND, grad_output)?;
        Ok(input_shape)
    }

    /// Shard `rank`'s saved (input, q/k/v, logsumexp, context).
    fn saved<'a>(&self, saved: &'a Saved, rank: usize) -> [&'a Tensor; SAVED_PER_SHARD] {
        let at = SAVED_PER_SHARD * self.group.local_index(rank);
        [&saved.tensors[at], &saved.tensors[at + 1], &saved.tensors[at + 2], &saved.tensors[at + 3]]
    }

    /// Shard `rank`'s `∂L/∂qkv` from its saved state and its copy of `dy`:
    /// `dctx_r = dy · out_proj.weight_r`, then the attention's backward chain.
    fn shard_grad_qkv(&self, rank: usize, saved: &Saved, dy: &Tensor) -> Result<Tensor> {
        let [x, qkv, logsumexp, context] = self.saved(saved, rank);
        let (_, _, out_weight, _) = self.shard(rank);
        let kernel = self.kernel(x.shape(), rank);
        let (rows, width) = (kernel.batch * kernel.tokens, kernel.embed_dim());
        let grad_context = Tensor::matmul(
            Matrix::new(dy, rows, self.embed_dim)?,
            Matrix::new(out_weight, self.embed_dim, width)?,
            None,
            [rows, width],
            x.device(),
        )?;
        grad_context.attention_backward(qkv, context, logsumexp, kernel)
    }

    /// Every local shard's `∂L/∂qkv` taken from the slot the other backward call filled, if any
    /// (keyed by the first local shard's saved logsumexp).
    fn take_pending(&self, saved: &Saved, grad_output: &Tensor, half: Half) -> Option<Vec<Tensor>> {
        self.pending.take(&saved.tensors[2], grad_output, half)
    }

    /// Leaves `grad_qkv` for the other backward call of the same `Saved` and `dy`.
    fn leave_pending(&self, saved: &Saved, grad_output: &Tensor, grad_qkv: &[Tensor], half: Half) {
        self.pending.leave(&saved.tensors[2], grad_output, grad_qkv, half)
    }

    /// The unsplit parameters on the host under PyTorch's names and shapes: `in_proj_weight`
    /// `[3D, D]`, `in_proj_bias` `[3D]`, `out_proj.weight` `[D, D]`, `out_proj.bias` `[D]`. With
    /// one shard per rank this is a collective: every rank of the group calls it, and every rank
    /// gets the unsplit tensors.
    pub fn gather_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let d = self.embed_dim;
        let features = self.heads.scaled(self.head_dim);
        let local = self.group.local();
        let shards: Vec<_> = local.clone().map(|r| self.shard(r)).collect();
        let pick = |i: usize| shards.iter().map(move |s| [s.0, s.1, s.2][i]).collect::<Vec<&Tensor>>();
        let in_weight = gather_rows(&self.group, &pick(0), &features.scaled(3 * d), [3 * d, d])?;
        let in_bias = gather_rows(&self.group, &pick(1), &features.scaled(3), [3 * d, 1])?;
        let out_weight = if self.group.n_local() == self.group.k() {
            unsplit_columns(&pick(2), d, &features)?
        } else {
            let host = Device::host();
            let block = pick(2)[0].to_device(&host)?;
            let mut gathered = self
                .group
                .run(vec![(); 1], |_, comm, ()| all_gather_columns(comm, &block, d, &features, vec![d, d], &host))?;
            gathered.swap_remove(0)
        };
        let mut out_bias = match shards.first().and_then(|s| s.3) {
            Some(bias) if local.start == 0 => bias.to_device(&Device::host())?,
            _ => Tensor::zeros([d], DType::F32, &Device::host())?,
        };
        if self.group.n_local() != self.group.k() {
            self.group.run(vec![&mut out_bias], |_, comm, bias| comm.broadcast_tensor(bias, 0))?;
        }
        Ok(vec![
            ("in_proj_weight".to_string(), unpack_stride3(&in_weight, &features)?),
            ("in_proj_bias".to_string(), unpack_stride3(&in_bias, &features)?.reshape([3 * d])?),
            ("out_proj.weight".to_string(), out_weight),
            ("out_proj.bias".to_string(), out_bias),
        ])
    }

    /// Splits the unsplit tensor `name` (PyTorch's names and shapes) into the shards, in place.
    pub fn load_unsplit(&mut self, name: &str, value: &Tensor) -> Result<()> {
        let d = self.embed_dim;
        let (slot, expected): (usize, Vec<usize>) = match name {
            "in_proj_weight" => (0, vec![3 * d, d]),
            "in_proj_bias" => (1, vec![3 * d]),
            "out_proj.weight" => (2, vec![d, d]),
            "out_proj.bias" => (3, vec![d]),
            _ => {
                return Err(Error::invalid(
                    format!("{KIND} parameter"),
                    format!("`{name}`: expected in_proj_weight, in_proj_bias, out_proj.weight or out_proj.bias"),
                ));
            }
        };
        if value.dims() != expected {
            return Err(Error::shape(format!("{KIND} {name}"), format!("{expected:?}"), value.shape().to_string()));
        }
        let value = into_dtype(value.share(), DType::F32)?;
        let features = self.heads.scaled(self.head_dim);
        for rank in self.group.local() {
            if slot == 3 && rank != 0 {
                continue;
            }
            let index = self.first_param(rank) + slot;
            let device = self.params[index].value.device().clone();
            let range = features.range(rank);
            let block = match slot {
                0 | 1 => stride3_rows(&value, d, range, &device)?,
                2 => column_block(&value, d, &features, rank, vec![d, range.len()], &device)?,
                _ => value.share(),
            };
            load_shard(&mut self.params[index].value, block)?;
        }
        Ok(())
    }
}

impl Layer for ParallelSelfAttention {
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

    fn forward(&self, inputs: &[&Tensor], _ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        expect_inputs(KIND, inputs, 1)?;
        let input = inputs[0];
        check_sequence_input(KIND, &self.group, input, self.embed_dim)?;
        let replicated = self.group.inputs_replicated();
        let results = self.group.run(vec![(); self.group.n_local()], |rank, comm, ()| {
            let device = self.group.device(rank);
            let x = input_for_shard(comm, input, device, replicated)?;
            let (in_weight, in_bias, out_weight, out_bias) = self.shard(rank);
            let kernel = self.kernel(x.shape(), rank);
            let (rows, width) = (kernel.batch * kernel.tokens, kernel.embed_dim());
            let qkv = x.attention_qkv(in_weight, in_bias, kernel)?;
            let (context, logsumexp) = qkv.attention(kernel)?;
            let mut y = Tensor::matmul(
                Matrix::new(&context, rows, width)?,
                Matrix::new(out_weight, self.embed_dim, width)?.t(),
                out_bias,
                x.shape().clone(),
                device,
            )?;
            comm.all_reduce_tensor(&mut y)?;
            Ok(([x, qkv, logsumexp, context], self.group.returns_output(rank).then_some(y)))
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

    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let input_shape = self.check_saved(saved, grad_output)?;
        let replicated = self.group.inputs_replicated();
        let pending = self.take_pending(saved, grad_output, Half::Input);
        let states: Vec<Option<Tensor>> = match pending {
            Some(grads) => grads.into_iter().map(Some).collect(),
            None => (0..self.group.n_local()).map(|_| None).collect(),
        };
        let was_pending = states.iter().all(Option::is_some);
        let results = self.group.run(states, |rank, comm, grad_qkv| {
            let device = self.group.device(rank);
            let grad_qkv = match grad_qkv {
                Some(grad_qkv) => grad_qkv,
                None => {
                    let dy = input_for_shard(comm, grad_output, device, replicated)?;
                    self.shard_grad_qkv(rank, saved, &dy)?
                }
            };
            let (in_weight, ..) = self.shard(rank);
            let kernel = self.kernel(&input_shape, rank);
            let mut dx = grad_qkv.attention_qkv_input_grad(in_weight, &input_shape, kernel)?;
            comm.all_reduce_tensor(&mut dx)?;
            Ok((grad_qkv, self.group.returns_output(rank).then_some(dx)))
        })?;
        let (grads, outputs): (Vec<Tensor>, Vec<Option<Tensor>>) = results.into_iter().unzip();
        if !was_pending {
            self.leave_pending(saved, grad_output, &grads, Half::Input);
        }
        Ok(vec![outputs.into_iter().flatten().next()])
    }

    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()> {
        check_param_grads(KIND, &self.params, param_grads)?;
        let input_shape = self.check_saved(saved, grad_output)?;
        let replicated = self.group.inputs_replicated();
        let pending = self.take_pending(saved, grad_output, Half::Weight);
        let was_pending = pending.is_some();
        let mut pending = pending.map(|grads| grads.into_iter().map(Some).collect::<Vec<_>>());
        let grads = grads_per_rank(param_grads, &self.counts())?;
        let states: Vec<_> =
            grads.into_iter().enumerate().map(|(i, g)| (g, pending.as_mut().and_then(|p| p[i].take()))).collect();
        let computed = self.group.run(states, |rank, comm, (grads, grad_qkv)| {
            let device = self.group.device(rank);
            let dy = input_for_shard(comm, grad_output, device, replicated)?;
            let grad_qkv = match grad_qkv {
                Some(grad_qkv) => grad_qkv,
                None => self.shard_grad_qkv(rank, saved, &dy)?,
            };
            let [x, _, _, context] = self.saved(saved, rank);
            let kernel = self.kernel(&input_shape, rank);
            let (in_grads, out_grads) = grads.split_at_mut(2);
            let [in_weight_grad, in_bias_grad] = in_grads else { unreachable!("split at 2") };
            grad_qkv.attention_qkv_weight_grads(x, kernel, in_weight_grad, in_bias_grad)?;
            let (out_weight_grad, out_bias_grad) = out_grads.split_at_mut(1);
            let out_bias_grad = if rank == 0 { out_bias_grad.first_mut() } else { None };
            linear_shard::weight_grad(&dy, context, &mut out_weight_grad[0], out_bias_grad)?;
            Ok(grad_qkv)
        })?;
        if !was_pending {
            self.leave_pending(saved, grad_output, &computed, Half::Weight);
        }
        Ok(())
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let output = self.output_shape(input_shapes)?;
        let (t, h) = (output.dims()[0] as u64, self.n_heads as u64);
        let k = self.group.k();
        // The unsplit layer's FLOPs, summed over the shards.
        let (forward, backward_input, backward_weight) = self_attention_flops(t, self.embed_dim as u64, h);
        let param_count = 4 * self.embed_dim * self.embed_dim + 4 * self.embed_dim;
        let numel = output.numel();
        Ok(LayerCost {
            workspace_bytes: 0,
            forward_flops_per_sample: forward,
            backward_input_flops_per_sample: backward_input,
            backward_weight_flops_per_sample: backward_weight,
            param_bytes: f32_bytes(param_count),
            // Every shard's input copy, and q/k/v, the logsumexp and the context over all shards.
            activation_bytes_per_sample: f32_bytes(k * numel + 4 * numel + (h * t) as usize),
            output_bytes_per_sample: f32_bytes(numel),
            backward_held_bytes_per_sample: f32_bytes(3 * numel),
            gpu_scratch_bytes_per_sample: {
                let ops = attention_gpu_scratch(t as usize, self.embed_dim, self.n_heads);
                CallScratch { backward_input: ops.backward_input + f32_bytes(numel), ..ops }
            },
        })
    }

    fn to_device(&mut self, device: &Device) -> Result<()> {
        self.group.to_device(KIND, device)
    }

    fn export_parameter_shapes(&self) -> Vec<(String, Shape)> {
        let d = self.embed_dim;
        vec![
            ("in_proj_weight".to_string(), Shape::new([3 * d, d])),
            ("in_proj_bias".to_string(), Shape::new([3 * d])),
            ("out_proj.weight".to_string(), Shape::new([d, d])),
            ("out_proj.bias".to_string(), Shape::new([d])),
        ]
    }

    /// The unsplit tensors ([`Self::gather_parameters`]).
    fn export_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        self.gather_parameters()
    }

    /// Splits an unsplit tensor into the shards ([`Self::load_unsplit`]).
    fn import_parameter(&mut self, name: &str, value: &Tensor) -> Result<()> {
        self.load_unsplit(name, value)
    }

    fn collective_traffic(&self) -> Vec<Traffic> {
        self.group.traffic()
    }

    fn recover_collectives(&self) -> Result<()> {
        self.group.recover()
    }
}
