//! Tensor-parallel layers: one layer split over the `k` devices of a group, each device holding a
//! shard of the weights and computing its share on its own thread, with the shards exchanging
//! data through the engine's collectives (`conveyor_engine::collective`).
//!
//! # Design
//!
//! A split layer is one `Layer` object. The pipeline sees an ordinary layer on its stage's device
//! (the group's first device): the input arrives there, the output and the input gradient leave
//! from there. Inside each call the layer runs one closure per shard on `k` scoped threads (the
//! first on the caller's thread), each on its own device, and the shards meet only in
//! collectives. So a stage of tensor-parallel degree `k` uses `k` devices and the runtime needs no
//! change. Shards, saved activations, messages and scratch buffers live on their shard's device and
//! count against its budget, so a layer too large for one device is built and trained split.
//!
//! * [`ColumnParallelLinear`]: weight split by output features; output all-gathered, or, as a
//!   model's output layer under softmax cross-entropy, never gathered: the loss is computed over
//!   the split logits (Megatron's vocabulary-parallel cross-entropy, `Layer::forward_cross_entropy`).
//! * [`RowParallelLinear`]: weight split by input features; partial outputs all-reduced.
//! * [`ParallelSelfAttention`]: multi-head self-attention split by heads (Megatron's attention
//!   block): q/k/v column-parallel, attention local, the output projection row-parallel, one
//!   all-reduce forward and one in `backward_input`.
//! * [`VocabParallelEmbedding`]: an embedding table split by vocabulary rows (Megatron's), the
//!   shards' outputs (rows of zeros for other shards' ids) all-reduced.
//! * [`ParallelMlp`]: Megatron's pairing, column then activation then row inside one layer, so
//!   the hidden activation stays split: one all-reduce forward and one in `backward_input`.
//! * [`ParallelTransformerBlock`]: a whole pre-norm transformer block (LayerNorm, attention by
//!   heads, residual, LayerNorm, MLP by hidden features, residual) with Megatron's sequence
//!   parallelism: between the products its activations are token blocks (all-gather before,
//!   reduce-scatter after), so the LayerNorm and residual regions are split too.
//! * [`ChannelParallelConv2d`]: AlexNet's split, each device computing its share of the output
//!   filters; outputs gathered by concatenating channels.
//! * [`ChannelParallelConvStack`]: AlexNet's stack of split convs as one layer, each conv either
//!   exchanging its input (all-gather) or grouped (`nn.Conv2d(groups=k)`: no exchange), so
//!   activations stay split between the exchange points.
//!
//! Features and channels not divisible by `k` are split like `torch.tensor_split`: the first
//! `n % k` devices get one more.
//!
//! # Parameters
//!
//! `parameters()` returns the shards, rank-major, each under PyTorch's name (`weight`, `bias`;
//! `fc1.weight` ... for the MLP), so optimizers and gradient buffers work per shard on the shard's
//! device. Each layer documents its exact order. The unsplit tensors, under the unsplit names, come
//! from `gather_parameters()` (on the host) and go back with `load_unsplit(name, tensor)`; that is
//! the surface for checkpoints. Cuts and joins are device ops (`narrow_rows`, `narrow_columns`,
//! `cat_rows`, `cat_columns`, `copy_from`) and tensor collectives, never host slices. We rejected
//! shard names such as `weight.shard0`: checkpoints would then depend on `k`.
//!
//! # Exchanges at the edges
//!
//! Because the pipeline hands a layer one tensor on one device, a split layer's forward starts by
//! broadcasting (or scattering) its input from the first device, and its backward passes start by
//! broadcasting (or scattering) `dy`. Outputs are all-gathered or all-reduced as in Megatron, so
//! every shard holds the full result, ready for a pipeline that one day passes replicated tensors
//! between tensor-parallel stages; today only the first device's copy is returned. The Layer API's
//! two backward calls cannot share state through `Saved` (it is immutable), so `backward_weight`
//! repeats the exchange of `dy` that `backward_input` made; what both need and is costly to
//! compute (the attention's `∂L/∂qkv`, the MLP's hidden gradient) the first call leaves in the
//! layer's pending slots (`pending.rs`) for the second.
//!
//! # Devices
//!
//! Each shard computes through the engine's device ops (`Tensor::matmul`, `conv2d`, `activation`
//! and the column ops of `layout.rs`) and exchanges through the tensor collectives
//! (`Communicator::all_gather_tensor` ...), so the layers run on any devices: on CPU devices the
//! collectives work on the tensors' host elements in place; with every shard on its own GPU they go
//! through NCCL when Conveyor is built with `nccl` and libnccl is found (`ShardGroup`), and through
//! the in-process group's host fallback otherwise (each exchange downloads and uploads).
//!
//! The threads are spawned per call (`std::thread::scope`); the alternative, a persistent pool of
//! `k - 1` threads per layer, saves the spawns (tens of microseconds per call, see the test
//! `thread_overhead_on_a_small_layer`) at the price of parked threads per layer.
mod attention;
mod block;
mod block_pass;
mod column;
mod conv;
mod conv_shard;
mod conv_stack;
mod embedding;
mod exchange;
mod group;
mod layout;
mod linear_shard;
mod mlp;
mod pending;
mod row;
mod shard_threads;

pub use attention::ParallelSelfAttention;
pub use block::ParallelTransformerBlock;
pub use column::ColumnParallelLinear;
pub use conv::ChannelParallelConv2d;
pub use conv_stack::{ChannelParallelConvStack, ConvStackLayer};
pub use embedding::VocabParallelEmbedding;
pub use group::{RankShard, Shards};
pub use mlp::{MlpActivation, ParallelMlp};
pub use row::RowParallelLinear;

use std::ops::Range;

use conveyor_engine::collective::Partition;
use conveyor_engine::{DType, Device, Error, LayerCost, Parameter, Result, Saved, Shape, Tensor};

use crate::tensor_io::{f32_bytes, into_dtype};
use group::ShardGroup;

/// `features` split over `k` devices; an error when some device would get none.
fn split_features(kind: &str, what: &str, features: usize, k: usize) -> Result<Partition> {
    if k > features {
        return Err(Error::invalid(
            format!("{kind} devices"),
            format!(
                "{k} devices for {what}={features}: every device needs at least one; use at most {features} devices"
            ),
        ));
    }
    Partition::even(features, k)
}

/// Checks an unsplit Linear weight `[out, in]` and bias `[out]`; returns `(out, in)`.
fn check_linear_params(kind: &str, weight: &Tensor, bias: Option<&Tensor>) -> Result<(usize, usize)> {
    let &[out_features, in_features] = weight.dims() else {
        return Err(Error::shape(format!("{kind} weight"), "[out_features, in_features]", weight.shape().to_string()));
    };
    if out_features == 0 || in_features == 0 {
        return Err(Error::shape(format!("{kind} weight"), "both features at least 1", weight.shape().to_string()));
    }
    if let Some(bias) = bias
        && bias.dims() != [out_features]
    {
        return Err(Error::shape(format!("{kind} bias"), format!("[{out_features}]"), bias.shape().to_string()));
    }
    Ok((out_features, in_features))
}

/// The per-sample output shape of a Linear-shaped layer: `[..., in_features]` -> `[..., out_features]`.
fn linear_output_shape(kind: &str, input_shapes: &[Shape], in_features: usize, out_features: usize) -> Result<Shape> {
    let shape = &crate::tensor_io::expect_shapes(kind, input_shapes, 1)?[0];
    match shape.dims().last() {
        Some(&last) if last == in_features => Ok(Shape::new(layout::with_last(shape, out_features))),
        _ => Err(Error::shape(kind, format!("a per-sample shape [..., {in_features}]"), shape.to_string())),
    }
}

/// Checks a batched `[batch, ..., in_features]` f32 input on the group's first device.
fn check_linear_input(kind: &str, group: &ShardGroup, input: &Tensor, in_features: usize) -> Result<()> {
    match input.dims().split_last() {
        Some((&last, leading)) if !leading.is_empty() && last == in_features => group.check_input(kind, input),
        _ => Err(Error::shape(
            kind,
            format!("an input [batch, ..., {in_features}] of rank >= 2"),
            input.shape().to_string(),
        )),
    }
}

fn bad_saved(kind: &str, why: String) -> Error {
    Error::invalid(format!("{kind} saved state"), format!("{why}; pass the Saved returned by this layer's forward"))
}

/// Checks `k` saved copies of a `[.., features]` input; returns its shape.
fn check_saved_replicated(kind: &str, saved: &Saved, k: usize, features: usize) -> Result<Shape> {
    if saved.tensors.len() != k || saved.tensors.iter().any(|t| t.dims() != saved.tensors[0].dims()) {
        return Err(bad_saved(kind, format!("expected {k} copies of the input, found {}", saved.tensors.len())));
    }
    let shape = saved.tensors[0].shape().clone();
    if shape.dims().last() != Some(&features) {
        return Err(bad_saved(kind, format!("the saved input {shape} does not end in {features} features")));
    }
    Ok(shape)
}

/// Checks `k` saved copies of one input (any shape); returns its shape.
fn check_saved_replicated_dims(kind: &str, saved: &Saved, k: usize) -> Result<Shape> {
    if saved.tensors.len() != k || saved.tensors.iter().any(|t| t.dims() != saved.tensors[0].dims()) {
        return Err(bad_saved(kind, format!("expected {k} copies of the input, found {}", saved.tensors.len())));
    }
    Ok(saved.tensors[0].shape().clone())
}

/// Checks the saved feature blocks `[.., parts.len(r)]` of the shards `local` (those held here);
/// returns the unsplit input's dims.
fn check_saved_inputs(kind: &str, saved: &Saved, parts: &Partition, local: Range<usize>) -> Result<Vec<usize>> {
    let n = local.len();
    if saved.tensors.len() != n {
        return Err(bad_saved(kind, format!("expected {n} input blocks, found {}", saved.tensors.len())));
    }
    let leading = saved.tensors[0].dims().split_last().map(|(_, l)| l.to_vec()).unwrap_or_default();
    for (rank, tensor) in local.zip(&saved.tensors) {
        if tensor.dims().split_last() != Some((&parts.len(rank), leading.as_slice())) {
            return Err(bad_saved(kind, format!("input block {rank} is {}", tensor.shape())));
        }
    }
    let mut dims = leading;
    dims.push(parts.total());
    Ok(dims)
}

/// Rows `range` of `value`'s leading dimension (an unsplit parameter), as an f32 tensor of `dims`
/// on `device`: a shard's part of a parameter split by rows (output features or channels).
fn shard_rows(value: &Tensor, range: Range<usize>, dims: impl Into<Shape>, device: &Device) -> Result<Tensor> {
    let rows = value.narrow_rows(range.start, range.len())?;
    into_dtype(rows, DType::F32)?.reshape(dims)?.move_to_device(device)
}

/// Copies `value` (any device and dtype, `shard`'s element count) into `shard` in place.
fn load_shard(shard: &mut Tensor, value: Tensor) -> Result<()> {
    let value = into_dtype(value, DType::F32)?.reshape(shard.shape().clone())?;
    shard.copy_from(&value)
}

/// The shards' host copies, in order.
fn on_host<'a>(shards: impl Iterator<Item = &'a Tensor>) -> Result<Vec<Tensor>> {
    shards.map(|shard| shard.to_device(&Device::host())).collect()
}

/// Concatenates shards along their first dimension into an unsplit host tensor of `dims`.
fn unsplit_rows<'a>(shards: impl Iterator<Item = &'a Parameter>, dims: impl Into<Shape>) -> Result<Tensor> {
    cat_flat(on_host(shards.map(|shard| &shard.value))?, dims)
}

/// Host tensors flattened and concatenated, in order, into one host tensor of `dims`.
fn cat_flat(copies: Vec<Tensor>, dims: impl Into<Shape>) -> Result<Tensor> {
    let flat: Vec<Tensor> = copies
        .into_iter()
        .map(|c| {
            let n = c.numel();
            c.reshape([n])
        })
        .collect::<Result<_>>()?;
    Tensor::cat_rows(&flat.iter().collect::<Vec<_>>(), &Device::host())?.reshape(dims)
}

/// The unsplit host tensor of `dims` whose flat elements are the shards' blocks `flat_parts`
/// concatenated: `local` holds the blocks of the shards held here. With every shard here they are
/// joined; with one shard per rank they are all-gathered (a collective: every rank of the group
/// calls it, and every rank gets the whole tensor).
fn gather_rows(
    group: &ShardGroup,
    local: &[&Tensor],
    flat_parts: &Partition,
    dims: impl Into<Shape>,
) -> Result<Tensor> {
    if group.n_local() == group.k() {
        return cat_flat(on_host(local.iter().copied())?, dims);
    }
    let host = Device::host();
    let mut gathered = group.run(vec![(); group.n_local()], |rank, comm, ()| {
        let mut values = Tensor::zeros([flat_parts.total()], DType::F32, &host)?;
        comm.all_gather_tensor(local[group.local_index(rank)], &mut values, flat_parts)?;
        Ok(values)
    })?;
    gathered.swap_remove(0).reshape(dims)
}

/// Assembles column blocks `[outer, parts.len(r)]` into an unsplit host tensor `[outer, parts.total()]`.
fn unsplit_columns(shards: &[&Tensor], outer: usize, parts: &Partition) -> Result<Tensor> {
    let copies = on_host(shards.iter().copied())?;
    let blocks: Vec<&Tensor> = copies.iter().collect();
    Tensor::cat_columns(&blocks, outer, [outer, parts.total()], &Device::host())
}

/// The cost of a Linear `[.., in] → [.., out]`, all shards together (the FLOPs and parameters of
/// the unsplit layer), saving `saved_numel` elements per sample over all devices.
fn linear_cost(
    input: &Shape,
    output: &Shape,
    in_features: usize,
    out_features: usize,
    bias: bool,
    saved_numel: usize,
) -> LayerCost {
    let positions = (input.numel() / in_features) as u64;
    let (n_in, n_out) = (in_features as u64, out_features as u64);
    let bias_flops = if bias { positions * n_out } else { 0 };
    let product = 2 * positions * n_in * n_out;
    LayerCost {
        forward_flops_per_sample: product + bias_flops,
        backward_input_flops_per_sample: product,
        backward_weight_flops_per_sample: product + bias_flops,
        param_bytes: f32_bytes(in_features * out_features + if bias { out_features } else { 0 }),
        activation_bytes_per_sample: f32_bytes(saved_numel),
        output_bytes_per_sample: f32_bytes(output.numel()),
        workspace_bytes: 0,
        backward_held_bytes_per_sample: 0,
        gpu_scratch_bytes_per_sample: Default::default(),
    }
}
