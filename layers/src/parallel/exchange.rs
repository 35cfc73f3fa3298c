//! The exchanges of split layers, one function per pattern, each run by every rank of the group:
//! replicate a tensor from the first device, scatter its column blocks, all-gather column blocks,
//! and cut per-rank gradient slices out of the flat `param_grads`. Every exchange is a tensor
//! collective (`Communicator::*_tensor`) on tensors laid out by the column ops, so it runs where
//! the tensors live: host slices on CPU devices, NCCL or the host fallback on GPUs.
use conveyor_engine::collective::{Communicator, Partition};
use conveyor_engine::{DType, Device, Error, Result, Tensor};

use super::layout::widths;

/// Rank 0's `full` copied to every rank (broadcast); rank `r` gets a tensor of `full`'s shape on `device`.
pub(crate) fn broadcast_from_first(
    comm: &(impl Communicator + ?Sized),
    full: &Tensor,
    device: &Device,
) -> Result<Tensor> {
    let mut copy =
        if comm.rank() == 0 { full.try_clone()? } else { Tensor::zeros(full.shape().clone(), DType::F32, device)? };
    comm.broadcast_tensor(&mut copy, 0)?;
    Ok(copy)
}

/// Rank 0's `full` `[outer, parts.total()]` split by columns (scatter): rank `r` gets its block,
/// shaped `dims`, on `device`.
pub(crate) fn scatter_columns(
    comm: &(impl Communicator + ?Sized),
    full: &Tensor,
    outer: usize,
    parts: &Partition,
    dims: Vec<usize>,
    device: &Device,
) -> Result<Tensor> {
    let flat_parts = parts.scaled(outer);
    let mut block = Tensor::zeros(dims, DType::F32, device)?;
    if comm.rank() == 0 {
        let packed = full.pack_columns(outer, &widths(parts))?;
        comm.scatter_tensor(Some(&packed), &mut block, 0, &flat_parts)?;
    } else {
        comm.scatter_tensor(None, &mut block, 0, &flat_parts)?;
    }
    Ok(block)
}

/// Every rank's `block` `[outer, parts.len(r)]` assembled into `[outer, parts.total()]` (shaped
/// `dims`) on every rank (all-gather).
pub(crate) fn all_gather_columns(
    comm: &(impl Communicator + ?Sized),
    block: &Tensor,
    outer: usize,
    parts: &Partition,
    dims: Vec<usize>,
    device: &Device,
) -> Result<Tensor> {
    let flat_parts = parts.scaled(outer);
    let mut gathered = Tensor::zeros([flat_parts.total()], DType::F32, device)?;
    comm.all_gather_tensor(block, &mut gathered, &flat_parts)?;
    Tensor::unpack_columns(&gathered, outer, &widths(parts), dims)
}

/// A row-parallel weight `[outer, parts.total()]` and its bias `[outer]` unsplit on the host, on
/// every rank of a group with one shard per rank: the weight's column blocks (`block`, this
/// rank's) all-gathered, and with `has_bias` the bias broadcast from shard 0, which holds it
/// (`held`: this rank's copy when it is shard 0).
pub(crate) fn gather_row_parallel(
    comm: &(impl Communicator + ?Sized),
    block: &Tensor,
    has_bias: bool,
    held: Option<&Tensor>,
    outer: usize,
    parts: &Partition,
) -> Result<(Tensor, Option<Tensor>)> {
    let host = Device::host();
    let weight = all_gather_columns(comm, block, outer, parts, vec![outer, parts.total()], &host)?;
    if !has_bias {
        return Ok((weight, None));
    }
    let mut bias = match held {
        Some(bias) => bias.to_device(&host)?,
        None => Tensor::zeros([outer], DType::F32, &host)?,
    };
    comm.broadcast_tensor(&mut bias, 0)?;
    Ok((weight, Some(bias)))
}

/// Splits `grads` (aligned with a split layer's `parameters()`, rank-major) into each rank's run of
/// `counts[r]` tensors.
pub(crate) fn grads_per_rank<'a>(mut grads: &'a mut [Tensor], counts: &[usize]) -> Result<Vec<&'a mut [Tensor]>> {
    if counts.iter().sum::<usize>() != grads.len() {
        return Err(Error::invalid(
            "tensor-parallel parameter gradients",
            format!("expected {} tensors aligned with parameters(), got {}", counts.iter().sum::<usize>(), grads.len()),
        ));
    }
    let mut out = Vec::with_capacity(counts.len());
    for &count in counts {
        let (head, tail) = std::mem::take(&mut grads).split_at_mut(count);
        out.push(head);
        grads = tail;
    }
    Ok(out)
}

/// The number of rows of a `[.., features]` tensor.
pub(crate) fn rows(tensor: &Tensor) -> usize {
    tensor.numel() / tensor.dims().last().copied().unwrap_or(1).max(1)
}

/// Every rank's `block` `[outer, parts.len(r)]` assembled into `[outer, parts.total()]` (shaped
/// `dims`) on rank 0 only (gather); other ranks get `None`.
pub(crate) fn gather_columns(
    comm: &(impl Communicator + ?Sized),
    block: &Tensor,
    outer: usize,
    parts: &Partition,
    dims: Vec<usize>,
    device: &Device,
) -> Result<Option<Tensor>> {
    let flat_parts = parts.scaled(outer);
    if comm.rank() != 0 {
        comm.gather_tensor(block, None, 0, &flat_parts)?;
        return Ok(None);
    }
    let mut packed = Tensor::zeros([flat_parts.total()], DType::F32, device)?;
    comm.gather_tensor(block, Some(&mut packed), 0, &flat_parts)?;
    Ok(Some(Tensor::unpack_columns(&packed, outer, &widths(parts), dims)?))
}

/// Every rank's `full` `[outer, parts.total()]` summed over ranks, rank `r` keeping its column
/// block `[outer, parts.len(r)]` (shaped `dims`) (reduce-scatter).
pub(crate) fn reduce_scatter_columns(
    comm: &(impl Communicator + ?Sized),
    full: &Tensor,
    outer: usize,
    parts: &Partition,
    dims: Vec<usize>,
    device: &Device,
) -> Result<Tensor> {
    let flat_parts = parts.scaled(outer);
    let packed = full.pack_columns(outer, &widths(parts))?;
    let mut block = Tensor::zeros(dims, DType::F32, device)?;
    comm.reduce_scatter_tensor(&packed, &mut block, &flat_parts)?;
    Ok(block)
}

/// The input a shard computes on: with replicated inputs (one shard per rank, every rank called
/// with the same input) the caller's own `full`; otherwise rank 0's `full` broadcast.
pub(crate) fn input_for_shard(
    comm: &(impl Communicator + ?Sized),
    full: &Tensor,
    device: &Device,
    replicated: bool,
) -> Result<Tensor> {
    if replicated {
        return Ok(full.share());
    }
    broadcast_from_first(comm, full, device)
}

/// A shard's column block `[outer, parts.len(r)]` (shaped `dims`) of `full` `[outer, parts.total()]`:
/// cut from the caller's own `full` with replicated inputs, scattered from rank 0's otherwise.
pub(crate) fn columns_for_shard(
    comm: &(impl Communicator + ?Sized),
    full: &Tensor,
    outer: usize,
    parts: &Partition,
    dims: Vec<usize>,
    device: &Device,
    replicated: bool,
) -> Result<Tensor> {
    if replicated {
        return super::layout::column_block(full, outer, parts, comm.rank(), dims, device);
    }
    scatter_columns(comm, full, outer, parts, dims, device)
}
