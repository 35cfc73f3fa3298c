//! `ParallelTransformerBlock`: one pre-norm transformer block (`ln1`, attention, residual, `ln2`,
//! MLP, residual) split over `k` devices with Megatron's tensor *and sequence* parallelism
//! (Korthikanti et al., arXiv 2205.05198): between the split matrix products the activations stay
//! split along the sequence, so the LayerNorms, the residual adds and what they save are spread
//! over the group instead of sitting whole on its first device. This file owns the layer's
//! parameters (construction, the unsplit names, checkpoints) and its `Layer` surface; the per-shard
//! arithmetic of each call is in `block_pass.rs`.
//!
//! # Layout
//!
//! Shard `r` owns the tokens `tokens.range(r)` of every sample (split like `torch.tensor_split`,
//! so `T` need not be a multiple of `k`), the heads `heads.range(r)` (a packed `[3·D_r, D]`
//! `in_proj` and the `[D, D_r]` columns of `out_proj.weight`, as in `ParallelSelfAttention`) and
//! the hidden features `hidden.range(r)` (rows of `fc1`, columns of `fc2`, as in `ParallelMlp`).
//! The LayerNorms' parameters and the two output biases stay whole on the first shard, which
//! broadcasts the LayerNorm weights to the others once per forward call (`4·D` floats).
//!
//! # One forward call
//!
//! ```text
//! x_r  = x[:, tokens_r]                 scatter from the first device (cut locally over MPI ranks)
//! h1_r = ln1(x_r)
//! g    = all_gather(h1_r)               [B, T, D]
//! y    = attention_r(g)·out_projᵀ_r     partial sums of the heads held here
//! s_r  = x_r + reduce_scatter(y)
//! h2_r = ln2(s_r)
//! g2   = all_gather(h2_r)
//! z    = gelu(g2·fc1ᵀ_r)·fc2ᵀ_r         partial sums of the hidden features held here
//! o_r  = s_r + reduce_scatter(z)
//! o    = gather(o_r)                    on the first device (all-gathered over MPI ranks)
//! ```
//!
//! So the block exchanges two all-gathers and two reduce-scatters, where the unsplit-sequence
//! form (`ParallelSelfAttention`, `ParallelMlp`) makes two all-reduces: the same bytes on a ring,
//! as the paper says, plus the scatter and gather at the node's edges. What a shard saves is
//! `1/k` of every activation (`x_r`, `h1_r`, `s_r`, `h2_r`, its heads' q/k/v and context, its
//! hidden block); `g` and `g2` are not saved but gathered again by the weight-gradient pass, as
//! Megatron's column layers do.
//!
//! # Backward
//!
//! The input-gradient chain (`backward_input`) mirrors the forward: the MLP's input gradient is
//! reduce-scattered into `ln2`'s token blocks, the attention's into `ln1`'s, and the input
//! gradient is gathered at the edge. The weight-gradient pass needs the chain's intermediate
//! gradients (the hidden gradient, `∂L/∂qkv`, the residual stream's, the LayerNorms' weight
//! gradients), so whichever call runs first computes the chain and leaves what the other needs in
//! the layer's pending slots (`pending.rs`), as the attention and MLP layers do; the memory plan
//! counts them through `backward_held_bytes_per_sample`. The LayerNorms' weight gradients over a
//! shard's tokens are summed in the chain (`4·D` floats kept instead of two token blocks of their
//! output gradients), then over the shards by one all-reduce in the weight pass, and added on the
//! first shard.
use conveyor_engine::collective::{Partition, Traffic};
use conveyor_engine::device::ops::attention_gpu_scratch;
use conveyor_engine::{
    CallScratch, DType, Device, Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor,
};

use super::attention::{split_heads, stride3_rows, unpack_stride3};
use super::exchange::{all_gather_columns, grads_per_rank};
use super::group::{ShardGroup, Shards};
use super::layout::column_block;
use super::pending::PendingSlots;
use super::{check_linear_params, gather_rows, linear_cost, load_shard, shard_rows, split_features, unsplit_columns};
use crate::attention::{self_attention_flops, self_attention_output_shape};
use crate::tensor_io::{check_param_grads, f32_bytes, into_dtype};
use crate::{LayerNorm, Linear, MultiheadSelfAttention};

pub(super) const KIND: &str = "ParallelTransformerBlock";

/// The first shard's parameters, in `parameters()` order.
pub(super) const FIRST_SHARD: [&str; 12] = [
    "ln1.weight",
    "ln1.bias",
    "attn.in_proj_weight",
    "attn.in_proj_bias",
    "attn.out_proj.weight",
    "attn.out_proj.bias",
    "ln2.weight",
    "ln2.bias",
    "fc1.weight",
    "fc1.bias",
    "fc2.weight",
    "fc2.bias",
];

/// Every other shard's parameters, in `parameters()` order.
pub(super) const OTHER_SHARD: [&str; 6] =
    ["attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight", "fc1.weight", "fc1.bias", "fc2.weight"];

/// A pre-norm transformer block `x + mlp(ln2(x + attn(ln1(x))))` (the zoo transformer's
/// `blocks.i`, with PyTorch's child names: `ln1`, `attn` as `nn.MultiheadAttention(batch_first)`,
/// `ln2`, `fc1`, exact GELU, `fc2`) split over `k` devices by heads, hidden features and, between
/// them, tokens (see the module docs). Input and output `[batch, tokens, D]` on the first device.
///
/// `parameters()` is rank-major over the shards held here, the first shard's in the order of
/// `FIRST_SHARD` (`ln1.weight`, `ln1.bias`, `attn.in_proj_weight`, ...), every other's in the order
/// of `OTHER_SHARD`. [`Self::gather_parameters`] gives the unsplit tensors under the names above.
///
/// A group of one device is the unsplit block (the planner's view of the node before it is split);
/// it alone can move to another device.
#[derive(Debug)]
pub struct ParallelTransformerBlock {
    pub(super) dim: usize,
    pub(super) n_heads: usize,
    pub(super) head_dim: usize,
    pub(super) hidden_features: usize,
    pub(super) causal: bool,
    /// `ln1`'s and `ln2`'s epsilons.
    pub(super) eps: [f32; 2],
    /// Heads per shard.
    pub(super) heads: Partition,
    /// Hidden features per shard.
    pub(super) hidden: Partition,
    pub(super) params: Vec<Parameter>,
    /// Index in `params` of the first parameter of each shard held here.
    pub(super) offsets: Vec<usize>,
    pub(super) group: ShardGroup,
    /// The backward chain's gradients, left by one backward call for the other.
    pub(super) pending: PendingSlots,
}

impl ParallelTransformerBlock {
    /// The block of these unsplit layers, split over `shards` (all shards here, or this rank's one).
    /// The head count must be a multiple of `k`, and `fc1` must map `D` to the hidden width and
    /// `fc2` back, both with biases.
    pub fn from_layers_on(
        ln1: &LayerNorm,
        attention: &MultiheadSelfAttention,
        ln2: &LayerNorm,
        fc1: &Linear,
        fc2: &Linear,
        shards: &Shards,
    ) -> Result<Self> {
        let group = ShardGroup::new(KIND, shards)?;
        let (dim, n_heads, k) = (attention.embed_dim(), attention.n_heads(), group.k());
        let heads = split_heads(KIND, n_heads, k)?;
        for (name, norm) in [("ln1", ln1), ("ln2", ln2)] {
            let len = norm.parameters()[0].value.numel();
            if len != dim {
                return Err(Error::shape(format!("{KIND} {name}"), format!("LayerNorm({dim})"), len.to_string()));
            }
        }
        let (hidden_features, fc1_in) = check_linear_params(KIND, fc1.weight(), fc1.bias())?;
        let (fc2_out, fc2_in) = check_linear_params(KIND, fc2.weight(), fc2.bias())?;
        if fc1_in != dim || fc2_in != hidden_features || fc2_out != dim {
            return Err(Error::shape(
                format!("{KIND} fc1/fc2"),
                format!("Linear({dim}, H) then Linear(H, {dim})"),
                format!("Linear({fc1_in}, {hidden_features}) then Linear({fc2_in}, {fc2_out})"),
            ));
        }
        let (Some(fc1_bias), Some(fc2_bias)) = (fc1.bias(), fc2.bias()) else {
            return Err(Error::invalid(
                format!("{KIND} fc1/fc2"),
                "both Linears need a bias, as the zoo's blocks have",
            ));
        };
        let head_dim = attention.head_dim();
        let hidden = split_features(KIND, "hidden_features", hidden_features, k)?;
        let features = heads.scaled(head_dim);
        let source = attention.parameters();
        let [in_weight, in_bias, out_weight, out_bias] = [0, 1, 2, 3].map(|i| &source[i].value);
        let out_weight = into_dtype(out_weight.share(), DType::F32)?;
        let fc2_weight = into_dtype(fc2.weight().share(), DType::F32)?;
        let whole = |value: &Tensor, device: &Device| shard_rows(value, 0..dim, [dim], device);
        let mut params = Vec::new();
        let mut offsets = Vec::new();
        for (rank, device) in group.local_devices() {
            offsets.push(params.len());
            let (head_features, hidden_range) = (features.range(rank), hidden.range(rank));
            let width = head_features.len();
            let mut values = Vec::with_capacity(FIRST_SHARD.len());
            if rank == 0 {
                values.push(whole(&ln1.parameters()[0].value, device)?);
                values.push(whole(&ln1.parameters()[1].value, device)?);
            }
            values.push(stride3_rows(in_weight, dim, head_features.clone(), device)?);
            values.push(stride3_rows(in_bias, dim, head_features, device)?);
            values.push(column_block(&out_weight, dim, &features, rank, vec![dim, width], device)?);
            if rank == 0 {
                values.push(whole(out_bias, device)?);
                values.push(whole(&ln2.parameters()[0].value, device)?);
                values.push(whole(&ln2.parameters()[1].value, device)?);
            }
            let rows = hidden_range.len();
            values.push(shard_rows(fc1.weight(), hidden_range.clone(), [rows, dim], device)?);
            values.push(shard_rows(fc1_bias, hidden_range, [rows], device)?);
            values.push(column_block(&fc2_weight, dim, &hidden, rank, vec![dim, rows], device)?);
            if rank == 0 {
                values.push(whole(fc2_bias, device)?);
            }
            let names: &[&str] = if rank == 0 { &FIRST_SHARD } else { &OTHER_SHARD };
            params.extend(names.iter().zip(values).map(|(name, value)| Parameter { name: (*name).into(), value }));
        }
        Ok(ParallelTransformerBlock {
            dim,
            n_heads,
            head_dim,
            hidden_features,
            causal: attention.is_causal(),
            eps: [ln1.eps(), ln2.eps()],
            heads,
            hidden,
            params,
            offsets,
            group,
            pending: PendingSlots::default(),
        })
    }

    /// The same block split over `devices` (every shard here).
    pub fn from_layers(
        ln1: &LayerNorm,
        attention: &MultiheadSelfAttention,
        ln2: &LayerNorm,
        fc1: &Linear,
        fc2: &Linear,
        devices: &[Device],
    ) -> Result<Self> {
        Self::from_layers_on(ln1, attention, ln2, fc1, fc2, &Shards::Local(devices.to_vec()))
    }

    /// The devices of the shards held here, in shard order; inputs arrive on and outputs leave
    /// from the first.
    pub fn devices(&self) -> &[Device] {
        self.group.devices()
    }

    /// Heads per device.
    pub fn head_partition(&self) -> &Partition {
        &self.heads
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

    /// Bytes of backward-chain gradients waiting in slots for their second backward call.
    pub fn pending_gradient_bytes(&self) -> usize {
        self.pending.bytes()
    }

    /// Index in `parameters()` of shard `rank`'s parameter `name` (a shard held here; `None` for
    /// a parameter only the first shard holds).
    pub(super) fn slot(&self, rank: usize, name: &str) -> Option<usize> {
        let names: &[&str] = if rank == 0 { &FIRST_SHARD } else { &OTHER_SHARD };
        let at = self.offsets[self.group.local_index(rank)];
        names.iter().position(|n| *n == name).map(|i| at + i)
    }

    /// Shard `rank`'s parameter `name`, which it holds.
    pub(super) fn param(&self, rank: usize, name: &str) -> &Tensor {
        let index = self.slot(rank, name).unwrap_or_else(|| unreachable!("shard {rank} holds no `{name}`"));
        &self.params[index].value
    }

    /// The parameters of each shard held here.
    pub(super) fn counts(&self) -> Vec<usize> {
        self.group.local().map(|r| if r == 0 { FIRST_SHARD.len() } else { OTHER_SHARD.len() }).collect()
    }

    /// Every parameter's unsplit shape under its name, in `FIRST_SHARD` order.
    fn unsplit_shapes(&self) -> Vec<(&'static str, Vec<usize>)> {
        let (d, h) = (self.dim, self.hidden_features);
        let shapes = [
            vec![d],
            vec![d],
            vec![3 * d, d],
            vec![3 * d],
            vec![d, d],
            vec![d],
            vec![d],
            vec![d],
            vec![h, d],
            vec![h],
            vec![d, h],
            vec![d],
        ];
        FIRST_SHARD.into_iter().zip(shapes).collect()
    }

    /// The unsplit parameters on the host under PyTorch's names (`ln1.weight` ... `fc2.bias`).
    /// With one shard per rank this is a collective: every rank of the group calls it, and every
    /// rank gets the unsplit tensors.
    pub fn gather_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let (d, h) = (self.dim, self.hidden_features);
        let host = Device::host();
        let features = self.heads.scaled(self.head_dim);
        let local: Vec<usize> = self.group.local().collect();
        let pick = |name: &str| local.iter().map(|&r| self.param(r, name)).collect::<Vec<&Tensor>>();
        let in_weight = gather_rows(&self.group, &pick("attn.in_proj_weight"), &features.scaled(3 * d), [3 * d, d])?;
        let in_bias = gather_rows(&self.group, &pick("attn.in_proj_bias"), &features.scaled(3), [3 * d, 1])?;
        let fc1_weight = gather_rows(&self.group, &pick("fc1.weight"), &self.hidden.scaled(d), [h, d])?;
        let fc1_bias = gather_rows(&self.group, &pick("fc1.bias"), &self.hidden, [h])?;
        // The first shard's whole parameters, broadcast over ranks when it is elsewhere.
        let singles = ["ln1.weight", "ln1.bias", "attn.out_proj.bias", "ln2.weight", "ln2.bias", "fc2.bias"];
        let (out_weight, fc2_weight, mut singles_packed) = if self.group.n_local() == self.group.k() {
            let packed: Vec<&Tensor> = singles.iter().map(|name| self.param(0, name)).collect();
            (
                unsplit_columns(&pick("attn.out_proj.weight"), d, &features)?,
                unsplit_columns(&pick("fc2.weight"), d, &self.hidden)?,
                Tensor::cat_rows(&packed, &host)?,
            )
        } else {
            let mut gathered = self.group.run(vec![(); 1], |rank, comm, ()| {
                let block = |name: &str| self.param(rank, name).to_device(&host);
                let out_weight =
                    all_gather_columns(comm, &block("attn.out_proj.weight")?, d, &features, vec![d, d], &host)?;
                let fc2_weight = all_gather_columns(comm, &block("fc2.weight")?, d, &self.hidden, vec![d, h], &host)?;
                let mut packed = if rank == 0 {
                    let held: Vec<&Tensor> = singles.iter().map(|name| self.param(0, name)).collect();
                    Tensor::cat_rows(&held, &host)?
                } else {
                    Tensor::zeros([singles.len() * d], DType::F32, &host)?
                };
                comm.broadcast_tensor(&mut packed, 0)?;
                Ok((out_weight, fc2_weight, packed))
            })?;
            gathered.swap_remove(0)
        };
        singles_packed = singles_packed.reshape([singles.len() * d])?;
        let single = |name: &str| -> Result<Tensor> {
            let i = singles.iter().position(|n| *n == name).unwrap_or_else(|| unreachable!("`{name}` is listed"));
            singles_packed.narrow_rows(i * d, d)
        };
        Ok(vec![
            ("ln1.weight".to_string(), single("ln1.weight")?),
            ("ln1.bias".to_string(), single("ln1.bias")?),
            ("attn.in_proj_weight".to_string(), unpack_stride3(&in_weight, &features)?),
            ("attn.in_proj_bias".to_string(), unpack_stride3(&in_bias, &features)?.reshape([3 * d])?),
            ("attn.out_proj.weight".to_string(), out_weight),
            ("attn.out_proj.bias".to_string(), single("attn.out_proj.bias")?),
            ("ln2.weight".to_string(), single("ln2.weight")?),
            ("ln2.bias".to_string(), single("ln2.bias")?),
            ("fc1.weight".to_string(), fc1_weight),
            ("fc1.bias".to_string(), fc1_bias),
            ("fc2.weight".to_string(), fc2_weight),
            ("fc2.bias".to_string(), single("fc2.bias")?),
        ])
    }

    /// Splits the unsplit tensor `name` (PyTorch's names and shapes, `ln1.weight` ... `fc2.bias`)
    /// into the shards, in place.
    pub fn load_unsplit(&mut self, name: &str, value: &Tensor) -> Result<()> {
        let Some((name, expected)) = self.unsplit_shapes().into_iter().find(|(n, _)| *n == name) else {
            return Err(Error::invalid(
                format!("{KIND} parameter"),
                format!("`{name}`: expected one of {}", FIRST_SHARD.join(", ")),
            ));
        };
        if value.dims() != expected {
            return Err(Error::shape(format!("{KIND} {name}"), format!("{expected:?}"), value.shape().to_string()));
        }
        let value = into_dtype(value.share(), DType::F32)?;
        let (d, features) = (self.dim, self.heads.scaled(self.head_dim));
        for rank in self.group.local() {
            let Some(index) = self.slot(rank, name) else { continue };
            let device = self.params[index].value.device().clone();
            let block = match name {
                "attn.in_proj_weight" | "attn.in_proj_bias" => stride3_rows(&value, d, features.range(rank), &device)?,
                "attn.out_proj.weight" => {
                    column_block(&value, d, &features, rank, vec![d, features.len(rank)], &device)?
                }
                "fc1.weight" | "fc1.bias" => {
                    let range = self.hidden.range(rank);
                    value.narrow_rows(range.start, range.len())?
                }
                "fc2.weight" => column_block(&value, d, &self.hidden, rank, vec![d, self.hidden.len(rank)], &device)?,
                _ => value.share(),
            };
            load_shard(&mut self.params[index].value, block)?;
        }
        Ok(())
    }
}

impl Layer for ParallelTransformerBlock {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        self_attention_output_shape(KIND, input_shapes, self.dim)
    }

    fn parameters(&self) -> &[Parameter] {
        &self.params
    }

    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut self.params
    }

    fn forward(&self, inputs: &[&Tensor], _ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        self.forward_split(inputs)
    }

    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(self.input_grad_split(saved, grad_output)?)])
    }

    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()> {
        check_param_grads(KIND, &self.params, param_grads)?;
        let counts = self.counts();
        let grads = grads_per_rank(param_grads, &counts)?;
        self.weight_grads_split(saved, grad_output, grads)
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let output = self.output_shape(input_shapes)?;
        let (t, d, h) = (output.dims()[0], self.dim, self.n_heads);
        let n = output.numel();
        let k = self.group.k();
        let hidden = Shape::new([t, self.hidden_features]);
        let (attn_forward, attn_input, attn_weight) = self_attention_flops(t as u64, d as u64, h as u64);
        let fc1 = linear_cost(&output, &hidden, d, self.hidden_features, true, 0);
        let fc2 = linear_cost(&hidden, &output, self.hidden_features, d, true, 0);
        let (n64, hidden64) = (n as u64, hidden.numel() as u64);
        // Two LayerNorms (LayerNorm's own figures), GELU and its gradient, the two residual adds.
        let forward = attn_forward + fc1.forward_flops_per_sample + fc2.forward_flops_per_sample + 16 * n64 + hidden64;
        // The LayerNorms' weight gradients are summed over the tokens in the input-gradient chain.
        let backward_input = attn_input
            + fc1.backward_input_flops_per_sample
            + fc2.backward_input_flops_per_sample
            + 20 * n64
            + hidden64
            + 2 * n64
            + 8 * n64;
        // The weight pass recomputes GELU.
        let backward_weight =
            attn_weight + fc1.backward_weight_flops_per_sample + fc2.backward_weight_flops_per_sample + hidden64;
        let param_count = 4 * d * d + 4 * d + 4 * d + 2 * d * self.hidden_features + self.hidden_features + d;
        // Saved over every shard: x, ln1's output, the residual s and ln2's output (token blocks),
        // q/k/v, the context, the hidden block, the logsumexp, the LayerNorms' mean and rstd, and
        // each shard's copy of the LayerNorm weights (counted per sample: a bound).
        let saved = 4 * n + 4 * n + hidden.numel() + h * t + 4 * t + k * 4 * d;
        // Gathered in forward and again in the weight pass: one [T, D] per shard at a time.
        let gathered = k * n;
        Ok(LayerCost {
            workspace_bytes: 0,
            forward_flops_per_sample: forward,
            backward_input_flops_per_sample: backward_input,
            backward_weight_flops_per_sample: backward_weight,
            param_bytes: f32_bytes(param_count),
            activation_bytes_per_sample: f32_bytes(saved),
            output_bytes_per_sample: f32_bytes(n),
            // Left by backward_input for backward_weight on the first device (the memory plan
            // puts what a layer declares there; the other shards' parts it measures): its hidden
            // gradient, its heads' ∂L/∂qkv, its token block of the residual stream's gradient and
            // its LayerNorm weight gradients (counted per sample: a bound).
            backward_held_bytes_per_sample: f32_bytes(
                t * self.hidden.len(0) + 3 * t * self.heads.len(0) * self.head_dim + t.div_ceil(k) * d + 4 * d,
            ),
            gpu_scratch_bytes_per_sample: {
                let ops = attention_gpu_scratch(t, d, h);
                CallScratch {
                    forward: ops.forward + f32_bytes(gathered),
                    backward_input: ops.backward_input + f32_bytes(gathered),
                    backward_weight: ops.backward_weight + f32_bytes(gathered),
                }
            },
        })
    }

    /// A group of one device moves whole; a split block stays on its devices.
    fn to_device(&mut self, device: &Device) -> Result<()> {
        self.group.move_unsplit(KIND, &mut self.params, device)
    }

    fn export_parameter_shapes(&self) -> Vec<(String, Shape)> {
        self.unsplit_shapes().into_iter().map(|(name, dims)| (name.to_string(), Shape::new(dims))).collect()
    }

    /// The unsplit tensors ([`Self::gather_parameters`]).
    fn export_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        self.gather_parameters()
    }

    /// Splits an unsplit tensor into the shards ([`Self::load_unsplit`]).
    fn import_parameter(&mut self, name: &str, value: &Tensor) -> Result<()> {
        self.load_unsplit(name, value)
    }

    /// Nothing for the unsplit block (a group of one device): it is not a split layer.
    fn collective_traffic(&self) -> Vec<Traffic> {
        if self.group.k() == 1 {
            return Vec::new();
        }
        self.group.traffic()
    }

    fn recover_collectives(&self) -> Result<()> {
        self.group.recover()
    }
}
