//! The exchanges of split layers, one function per pattern, each run by every rank of the group:
//! replicate a tensor from the first device, scatter its column blocks, all-gather column blocks,
//! and cut per-rank gradient slices out of the flat `param_grads`.
use conveyor_engine::collective::{Communicator, Partition};
use conveyor_engine::{DType, Device, Error, Result, Tensor};

use super::layout::{pack_columns, unpack_columns};

/// Rank 0's `full` copied to every rank (broadcast); rank `r` gets a tensor of `full`'s shape on `device`.
pub(crate) fn broadcast_from_first(
    comm: &(impl Communicator + ?Sized),
    full: &Tensor,
    device: &Device,
) -> Result<Tensor> {
    let mut copy =
        if comm.rank() == 0 { full.try_clone()? } else { Tensor::zeros(full.shape().clone(), DType::F32, device)? };
    comm.broadcast(copy.as_f32_mut()?, 0)?;
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
        let mut packed = Tensor::zeros([flat_parts.total()], DType::F32, device)?;
        pack_columns(full.as_f32()?, outer, parts, packed.as_f32_mut()?)?;
        comm.scatter(packed.as_f32()?, block.as_f32_mut()?, 0, &flat_parts)?;
    } else {
        comm.scatter(&[], block.as_f32_mut()?, 0, &flat_parts)?;
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
    comm.all_gather(block.as_f32()?, gathered.as_f32_mut()?, &flat_parts)?;
    let mut full = Tensor::zeros(dims, DType::F32, device)?;
    unpack_columns(gathered.as_f32()?, outer, parts, full.as_f32_mut()?)?;
    Ok(full)
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
        comm.gather(block.as_f32()?, &mut [], 0, &flat_parts)?;
        return Ok(None);
    }
    let mut packed = Tensor::zeros([flat_parts.total()], DType::F32, device)?;
    comm.gather(block.as_f32()?, packed.as_f32_mut()?, 0, &flat_parts)?;
    let mut full = Tensor::zeros(dims, DType::F32, device)?;
    unpack_columns(packed.as_f32()?, outer, parts, full.as_f32_mut()?)?;
    Ok(Some(full))
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
    let mut packed = Tensor::zeros([flat_parts.total()], DType::F32, device)?;
    pack_columns(full.as_f32()?, outer, parts, packed.as_f32_mut()?)?;
    let mut block = Tensor::zeros(dims, DType::F32, device)?;
    comm.reduce_scatter(packed.as_f32()?, block.as_f32_mut()?, &flat_parts)?;
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
        return super::layout::column_block(full.as_f32()?, outer, parts, comm.rank(), dims, device);
    }
    scatter_columns(comm, full, outer, parts, dims, device)
}
