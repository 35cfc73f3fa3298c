//! Normalisation, lookup and token-reduction device ops, dispatched as every op in [`super`]:
//! layer normalisation ([`Tensor::layer_norm`], [`Tensor::layer_norm_input_grad`],
//! [`Tensor::layer_norm_weight_grad_accumulate`]), the embedding gather and its scatter-add
//! ([`Tensor::embedding`], [`Tensor::embedding_grad_accumulate`]), the positional table's add and
//! its gradient ([`Tensor::add_positions`], [`Tensor::positions_grad_accumulate`]) and the mean
//! over tokens ([`Tensor::mean_over_tokens`], [`Tensor::mean_over_tokens_grad`]).
//!
//! On a CPU device each op runs exactly the code the `LayerNorm`, `Embedding`,
//! `PositionalEmbedding` and `MeanOverTokens` layers ran before (the kernels of
//! [`crate::cpu::layer_norm`] and the same loops), so CPU results are unchanged bit for bit; the
//! gradient accumulations sum this call's part apart and then add it (the layers' rule that keeps
//! data-parallel replicas bit-exact). On a GPU the kernels of `device/kernels/norm.cu` run one
//! thread per output (or per row) looping over its inputs in the CPU's order: deterministic, with
//! no atomics, and rounding as the CPU does (`--fmad=false`).
//!
//! Results are f32 (the layers convert them to their input's dtype), except the accumulations,
//! which add onto gradients of any dtype on a CPU device (f16/bf16 through an f32 copy).
use std::collections::HashMap;

use super::{accumulate_part, gpu_f32, gpu_f32_mut};
use crate::cpu::layer_norm::{layer_norm_backward_input, layer_norm_backward_weight, layer_norm_forward};
use crate::cpu::uninit;
use crate::{DType, Device, Error, Result, Shape, Tensor};

/// Runs `add` on the gradient's elements as f32 in place (through an f32 copy for f16/bf16), on a
/// CPU device: for a caller that adds sums it made apart itself.
fn add_on_host(grad: &mut Tensor, add: impl FnOnce(&mut [f32]) -> Result<()>) -> Result<()> {
    if grad.dtype() == DType::F32 {
        return add(grad.as_f32_mut()?);
    }
    let mut acc = grad.to_vec_f32();
    add(&mut acc)?;
    *grad = Tensor::from_f32_values(acc, grad.dtype(), grad.shape().clone(), grad.device())?;
    Ok(())
}

/// The rows of a layer-norm operand: its element count over `dim`, which must divide it.
fn norm_rows(op: &str, input: &Tensor, dim: usize) -> Result<usize> {
    if dim == 0 || !input.numel().is_multiple_of(dim) {
        return Err(Error::shape(op, format!("rows of {dim} elements (dim > 0)"), input.shape().to_string()));
    }
    Ok(input.numel() / dim)
}

/// `ids` (integers held in f32, read from host memory) as row indices of a table of `n_rows`
/// rows, or an error naming the first id that is not an integer in `0..n_rows`.
fn embedding_indices(ids: &[f32], n_rows: usize) -> Result<Vec<usize>> {
    ids.iter()
        .enumerate()
        .map(|(position, &id)| {
            if id.fract() == 0.0 && id >= 0.0 && (id as usize) < n_rows {
                Ok(id as usize)
            } else {
                Err(Error::invalid(
                    "Embedding ids",
                    format!(
                        "id {id} at flat position {position} is not an integer in 0..{n_rows}; pass integer-valued ids below num_embeddings"
                    ),
                ))
            }
        })
        .collect()
}

/// The ids' elements in host memory (downloaded from a GPU: the ids are checked on the host).
fn ids_on_host(op: &str, ids: &Tensor) -> Result<Vec<f32>> {
    match ids.device() {
        Device::Cpu(_) => Ok(ids.host_f32(op)?.into_owned()),
        Device::Cuda(_) => ids.try_to_vec_f32(),
    }
}

/// Each id's row in a table holding ids `first..first + n_rows` of a vocabulary of `vocab`
/// (`None`: another shard's row). Every id must be an integer in `0..vocab`.
fn shard_indices(ids: &[f32], first: usize, n_rows: usize, vocab: usize) -> Result<Vec<Option<usize>>> {
    let rows = first..first + n_rows;
    Ok(embedding_indices(ids, vocab)?.into_iter().map(|id| rows.contains(&id).then(|| id - first)).collect())
}

/// Each distinct index in order of first appearance, and each position's slot in that list
/// (`None` for a position without an index here).
fn slots_of(indices: &[Option<usize>]) -> (Vec<usize>, Vec<Option<usize>>) {
    let mut slot_of: HashMap<usize, usize> = HashMap::new();
    let mut distinct = Vec::new();
    let slots = indices
        .iter()
        .map(|index| {
            index.map(|index| {
                *slot_of.entry(index).or_insert_with(|| {
                    distinct.push(index);
                    distinct.len() - 1
                })
            })
        })
        .collect();
    (distinct, slots)
}

/// `[batch, tokens, dim]` with `tokens` and `dim` above 0 (a positional table's operand), or a
/// shape error.
fn position_dims(op: &str, shape: &Shape) -> Result<[usize; 3]> {
    match token_dims(op, shape)? {
        [_, _, 0] => Err(Error::shape(op, "[batch, tokens, dim] with tokens, dim >= 1", shape.to_string())),
        dims => Ok(dims),
    }
}

/// `[batch, tokens, features]` with `tokens > 0`, or a shape error.
fn token_dims(op: &str, shape: &Shape) -> Result<[usize; 3]> {
    match shape.dims() {
        &[batch, tokens, features] if tokens > 0 => Ok([batch, tokens, features]),
        _ => Err(Error::shape(op, "[batch, tokens, features] with tokens >= 1", shape.to_string())),
    }
}

impl Tensor {
    /// Layer normalisation of every row of `weight.numel()` elements of `self`:
    /// `y = (x - mean) · rstd · weight + bias` with `rstd = 1 / sqrt(var + eps)` (biased
    /// variance, statistics in f64). Returns the output (f32, `self`'s shape) and each row's
    /// `mean` and `rstd` (f32 `[rows]`), all on `self`'s device.
    ///
    /// ```
    /// use conveyor_engine::{Device, Tensor};
    /// let host = Device::host();
    /// let x = Tensor::from_vec(vec![1.0, 3.0], [1, 2], &host)?;
    /// let (w, b) = (Tensor::from_vec(vec![1.0, 1.0], [2], &host)?, Tensor::from_vec(vec![0.0, 0.0], [2], &host)?);
    /// let (y, mean, _rstd) = x.layer_norm(&w, &b, 0.0)?;
    /// assert_eq!((y.to_vec_f32(), mean.to_vec_f32()), (vec![-1.0, 1.0], vec![2.0]));
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn layer_norm(&self, weight: &Tensor, bias: &Tensor, eps: f32) -> Result<(Tensor, Tensor, Tensor)> {
        let op = "layer_norm";
        let dim = weight.numel();
        let rows = norm_rows(op, self, dim)?;
        if bias.numel() != dim {
            return Err(Error::shape(op, format!("a bias of {dim} elements"), bias.shape().to_string()));
        }
        let device = self.device();
        match device {
            Device::Cpu(_) => {
                let mut output = Tensor::zeros(self.shape().clone(), DType::F32, device)?;
                let mut mean = Tensor::zeros([rows], DType::F32, device)?;
                let mut rstd = Tensor::zeros([rows], DType::F32, device)?;
                layer_norm_forward(
                    &self.host_f32(op)?,
                    &weight.host_f32(op)?,
                    &bias.host_f32(op)?,
                    eps,
                    output.as_f32_mut()?,
                    mean.as_f32_mut()?,
                    rstd.as_f32_mut()?,
                )?;
                Ok((output, mean, rstd))
            }
            Device::Cuda(cuda) => {
                let x = gpu_f32(op, self, device)?;
                let (weight, bias) = (gpu_f32(op, weight, device)?, gpu_f32(op, bias, device)?);
                let stream = cuda.thread_stream()?;
                let mut output = cuda.alloc_zeros::<f32>(x.len())?;
                let mut mean = cuda.alloc_zeros::<f32>(rows)?;
                let mut rstd = cuda.alloc_zeros::<f32>(rows)?;
                stream.layer_norm_forward(&x, &weight, &bias, eps, &mut output, &mut mean, &mut rstd)?;
                Ok((
                    Tensor::from_cuda_f32(output, self.shape().clone(), device)?,
                    Tensor::from_cuda_f32(mean, Shape::new([rows]), device)?,
                    Tensor::from_cuda_f32(rstd, Shape::new([rows]), device)?,
                ))
            }
        }
    }

    /// The input gradient of [`Tensor::layer_norm`] from this output gradient, the forward
    /// `input`, `weight` and the saved `mean` and `rstd`:
    /// `dx = rstd · (g - mean(g) - x̂ · mean(g · x̂))` with `g = dy · weight`,
    /// `x̂ = (x - mean) · rstd`. A new f32 tensor of `input`'s shape on `input`'s device.
    pub fn layer_norm_input_grad(
        &self,
        input: &Tensor,
        weight: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
    ) -> Result<Tensor> {
        let op = "layer_norm_input_grad";
        norm_rows(op, input, weight.numel())?;
        if self.shape() != input.shape() {
            return Err(Error::shape(op, input.shape().to_string(), self.shape().to_string()));
        }
        let device = input.device();
        match device {
            Device::Cpu(_) => {
                let mut grad_input = Tensor::zeros(input.shape().clone(), DType::F32, device)?;
                layer_norm_backward_input(
                    &input.host_f32(op)?,
                    &self.host_f32(op)?,
                    &weight.host_f32(op)?,
                    &mean.host_f32(op)?,
                    &rstd.host_f32(op)?,
                    grad_input.as_f32_mut()?,
                )?;
                Ok(grad_input)
            }
            Device::Cuda(cuda) => {
                let (x, dy) = (gpu_f32(op, input, device)?, gpu_f32(op, self, device)?);
                let weight = gpu_f32(op, weight, device)?;
                let (mean, rstd) = (gpu_f32(op, mean, device)?, gpu_f32(op, rstd, device)?);
                let stream = cuda.thread_stream()?;
                let mut grad_input = cuda.alloc_zeros::<f32>(x.len())?;
                stream.layer_norm_backward_input(&x, &dy, &weight, &mean, &rstd, &mut grad_input)?;
                Tensor::from_cuda_f32(grad_input, input.shape().clone(), device)
            }
        }
    }

    /// `weight_grad += Σ_rows dy · x̂` and `bias_grad += Σ_rows dy` for this output gradient
    /// `dy` of [`Tensor::layer_norm`] (`x̂` from the forward `input`, `mean` and `rstd`), on the
    /// gradients' device. Each sum is formed apart and then added.
    pub fn layer_norm_weight_grad_accumulate(
        &self,
        input: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        weight_grad: &mut Tensor,
        bias_grad: &mut Tensor,
    ) -> Result<()> {
        let op = "layer_norm_weight_grad_accumulate";
        let dim = weight_grad.numel();
        norm_rows(op, input, dim)?;
        if bias_grad.numel() != dim || self.shape() != input.shape() {
            return Err(Error::shape(
                op,
                format!("a bias gradient of {dim} elements and an output gradient of shape {}", input.shape()),
                format!("{} and {}", bias_grad.shape(), self.shape()),
            ));
        }
        if let Device::Cpu(_) = weight_grad.device() {
            let (x, dy) = (input.host_f32(op)?, self.host_f32(op)?);
            let (mean, rstd) = (mean.host_f32(op)?, rstd.host_f32(op)?);
            accumulate_part(weight_grad, |dw| layer_norm_backward_weight(&x, &dy, &mean, &rstd, Some(dw), None))?;
            return accumulate_part(bias_grad, |db| layer_norm_backward_weight(&x, &dy, &mean, &rstd, None, Some(db)));
        }
        let device = weight_grad.device().clone();
        let (x, dy) = (gpu_f32(op, input, &device)?, gpu_f32(op, self, &device)?);
        let (mean, rstd) = (gpu_f32(op, mean, &device)?, gpu_f32(op, rstd, &device)?);
        if !bias_grad.device().same_device(&device) {
            return Err(Error::DeviceMismatch {
                op: op.to_string(),
                lhs: device.to_string(),
                rhs: bias_grad.device().to_string(),
            });
        }
        let dw = gpu_f32_mut(op, weight_grad)?;
        let stream = dw.device().thread_stream()?;
        stream.layer_norm_backward_weight(&x, &dy, &mean, &rstd, dw, gpu_f32_mut(op, bias_grad)?)
    }

    /// The rows of this table (`[n_rows, dim]`) picked by `ids` (integer values held in an f32
    /// tensor of any shape, on the table's device): a new f32 tensor of shape `ids.dims() + [dim]`
    /// on the ids' device.
    /// Every id must be an integer in `0..n_rows` (`Error::Invalid` names the first that is not;
    /// on a GPU the ids are downloaded to be checked).
    pub fn embedding(&self, ids: &Tensor) -> Result<Tensor> {
        let n_rows = self.dims().first().copied().unwrap_or(0);
        self.embedding_shard(ids, 0, n_rows)
    }

    /// [`Tensor::embedding`] for one shard of a vocabulary-parallel table: this table holds the
    /// rows of ids `first..first + n_rows` of a vocabulary of `vocab`; the ids of other rows give
    /// rows of zeros (summed over the shards, the rows of the whole table). Every id must be an
    /// integer in `0..vocab`.
    pub fn embedding_shard(&self, ids: &Tensor, first: usize, vocab: usize) -> Result<Tensor> {
        let op = "embedding";
        let &[n_rows, dim] = self.dims() else {
            return Err(Error::shape(op, "a table [n_rows, dim]", self.shape().to_string()));
        };
        if first + n_rows > vocab {
            return Err(Error::invalid(
                op,
                format!("rows {first}..{} outside a vocabulary of {vocab}", first + n_rows),
            ));
        }
        let mut dims = ids.dims().to_vec();
        dims.push(dim);
        let device = ids.device();
        match device {
            Device::Cpu(_) => {
                let indices = shard_indices(&ids.host_f32(op)?, first, n_rows, vocab)?;
                let table = self.host_f32(op)?;
                let mut output = Vec::with_capacity(indices.len() * dim);
                for index in &indices {
                    match index {
                        Some(index) => output.extend_from_slice(&table[index * dim..(index + 1) * dim]),
                        None => output.resize(output.len() + dim, 0.0),
                    }
                }
                Tensor::from_vec(output, dims, device)
            }
            Device::Cuda(cuda) => {
                let table = gpu_f32(op, self, device)?;
                let indices = shard_indices(&ids.try_to_vec_f32()?, first, n_rows, vocab)?;
                // The kernel gives a row of zeros for an id outside the table: this shard's ids
                // are uploaded shifted, other shards' as -1 (the whole table's as they are).
                let local = match (first, n_rows == vocab) {
                    (0, true) => ids.share(),
                    _ => {
                        let shifted = indices.iter().map(|i| i.map_or(-1.0, |i| i as f32)).collect();
                        Tensor::from_vec(shifted, ids.shape().clone(), device)?
                    }
                };
                let id_values = gpu_f32(op, &local, device)?;
                let stream = cuda.thread_stream()?;
                let mut output = cuda.alloc_zeros::<f32>(ids.numel() * dim)?;
                stream.embedding_gather(&id_values, &table, n_rows, &mut output)?;
                Tensor::from_cuda_f32(output, Shape::new(dims), device)
            }
        }
    }

    /// `grad[ids[p], :] += dy[p, :]` for this output gradient `dy` (`ids.dims() + [dim]`) of
    /// [`Tensor::embedding`], on `grad`'s device (`[n_rows, dim]`). The rows of each distinct id
    /// are summed apart, in order, and then added onto that id's row (ids in order of first
    /// appearance); rows of absent ids are untouched.
    pub fn embedding_grad_accumulate(&self, ids: &Tensor, grad: &mut Tensor) -> Result<()> {
        let n_rows = grad.dims().first().copied().unwrap_or(0);
        self.embedding_shard_grad_accumulate(ids, 0, n_rows, grad)
    }

    /// [`Tensor::embedding_grad_accumulate`] for one shard of a vocabulary-parallel table
    /// ([`Tensor::embedding_shard`]): the rows of this shard's ids are added, in the same order as
    /// for the whole table, and the others skipped, so each row's sum has the whole table's bits.
    pub fn embedding_shard_grad_accumulate(
        &self,
        ids: &Tensor,
        first: usize,
        vocab: usize,
        grad: &mut Tensor,
    ) -> Result<()> {
        let op = "embedding_grad_accumulate";
        let &[n_rows, dim] = grad.dims() else {
            return Err(Error::shape(op, "a gradient [n_rows, dim]", grad.shape().to_string()));
        };
        if dim == 0 {
            return Ok(());
        }
        if self.numel() != ids.numel() * dim {
            return Err(Error::shape(
                op,
                format!("an output gradient of {} x {dim} elements", ids.numel()),
                self.shape().to_string(),
            ));
        }
        if first + n_rows > vocab {
            return Err(Error::invalid(
                op,
                format!("rows {first}..{} outside a vocabulary of {vocab}", first + n_rows),
            ));
        }
        let indices = shard_indices(&ids_on_host(op, ids)?, first, n_rows, vocab)?;
        let (distinct, slots) = slots_of(&indices);
        if distinct.is_empty() {
            return Ok(()); // none of this shard's rows was picked
        }
        if let Device::Cpu(_) = grad.device() {
            let dy = self.host_f32(op)?;
            // This call's rows summed per id on their own, then added: the same bits however the
            // batch is cut into micro-batches and replicas, with a buffer for the ids present
            // rather than the whole table.
            let mut part = Tensor::zeros([distinct.len(), dim], DType::F32, self.device())?;
            let sums = part.as_f32_mut()?;
            for (slot, row) in slots.iter().zip(dy.chunks_exact(dim)) {
                if let Some(slot) = slot {
                    sums[slot * dim..(slot + 1) * dim].iter_mut().zip(row).for_each(|(d, &g)| *d += g);
                }
            }
            let sums = part.as_f32()?;
            return add_on_host(grad, |dst| {
                for (slot, &index) in distinct.iter().enumerate() {
                    dst[index * dim..(index + 1) * dim]
                        .iter_mut()
                        .zip(&sums[slot * dim..(slot + 1) * dim])
                        .for_each(|(d, &s)| *d += s);
                }
                Ok(())
            });
        }
        // The positions of each distinct id, grouped in order (offsets into `positions`).
        let mut offsets = vec![0i64; distinct.len() + 1];
        for &slot in slots.iter().flatten() {
            offsets[slot + 1] += 1;
        }
        for slot in 0..distinct.len() {
            offsets[slot + 1] += offsets[slot];
        }
        let mut next: Vec<i64> = offsets[..distinct.len()].to_vec();
        let mut positions = vec![0i64; slots.iter().flatten().count()];
        for (position, slot) in slots.iter().enumerate() {
            if let &Some(slot) = slot {
                positions[next[slot] as usize] = position as i64;
                next[slot] += 1;
            }
        }
        let distinct: Vec<i64> = distinct.iter().map(|&index| index as i64).collect();
        let device = grad.device().clone();
        let Device::Cuda(cuda) = &device else { unreachable!("a CPU device returned above") };
        let dy = gpu_f32(op, self, &device)?;
        let (distinct, offsets, positions) =
            (cuda.upload(&distinct)?, cuda.upload(&offsets)?, cuda.upload(&positions)?);
        let dst = gpu_f32_mut(op, grad)?;
        let stream = cuda.thread_stream()?;
        stream.embedding_scatter_add(&dy, &distinct, &offsets, &positions, dst, dim)
    }

    /// `y[b, t, :] = x[b, t, :] + table[t, :]` for this `[batch, tokens, dim]` input and the first
    /// `tokens` rows of `table` (`[max_tokens, dim]`, `max_tokens ≥ tokens`): a new f32 tensor of
    /// this shape on this device.
    pub fn add_positions(&self, table: &Tensor) -> Result<Tensor> {
        let op = "add_positions";
        let [_, tokens, dim] = position_dims(op, self.shape())?;
        let len = tokens * dim;
        if table.dims().last() != Some(&dim) || table.numel() < len {
            return Err(Error::shape(op, format!("a table [>= {tokens}, {dim}]"), table.shape().to_string()));
        }
        let device = self.device();
        match device {
            Device::Cpu(_) => {
                let (x, table) = (self.host_f32(op)?, table.host_f32(op)?);
                let table = &table[..len];
                Tensor::from_f32_init(self.shape().clone(), device, |dst| {
                    uninit::chunks(dst, len, |sample, out| {
                        uninit::map2(out, &x[sample * len..(sample + 1) * len], table, |x, p| x + p)
                    })
                })
            }
            Device::Cuda(cuda) => {
                let (x, table) = (gpu_f32(op, self, device)?, gpu_f32(op, table, device)?);
                let stream = cuda.thread_stream()?;
                let mut output = cuda.alloc_zeros::<f32>(x.len())?;
                stream.add_positions(&x, &table, len, &mut output)?;
                Tensor::from_cuda_f32(output, self.shape().clone(), device)
            }
        }
    }

    /// `grad[t, :] += Σ_b dy[b, t, :]` for this `[batch, tokens, dim]` output gradient of
    /// [`Tensor::add_positions`], on `grad`'s device (`[max_tokens, dim]`; rows past `tokens` are
    /// untouched). The sum over the batch is formed apart and then added.
    pub fn positions_grad_accumulate(&self, grad: &mut Tensor) -> Result<()> {
        let op = "positions_grad_accumulate";
        let [_, tokens, dim] = position_dims(op, self.shape())?;
        let len = tokens * dim;
        if grad.dims().last() != Some(&dim) || grad.numel() < len {
            return Err(Error::shape(op, format!("a gradient [>= {tokens}, {dim}]"), grad.shape().to_string()));
        }
        if let Device::Cpu(_) = grad.device() {
            let dy = self.host_f32(op)?;
            return accumulate_part(grad, |dst| {
                for sample in dy.chunks_exact(len) {
                    dst[..len].iter_mut().zip(sample).for_each(|(d, &g)| *d += g);
                }
                Ok(())
            });
        }
        let dy = gpu_f32(op, self, grad.device())?;
        let dst = gpu_f32_mut(op, grad)?;
        let stream = dst.device().thread_stream()?;
        stream.positions_grad_accumulate(&dy, len, dst)
    }

    /// `y[b, :] = (Σ_t x[b, t, :]) · (1 / tokens)` for this `[batch, tokens, features]` input: a
    /// new f32 tensor `[batch, features]` on this device.
    pub fn mean_over_tokens(&self) -> Result<Tensor> {
        let op = "mean_over_tokens";
        let [batch, tokens, features] = token_dims(op, self.shape())?;
        let device = self.device();
        match device {
            Device::Cpu(_) => {
                let x = self.host_f32(op)?;
                let mut output = Tensor::zeros([batch, features], DType::F32, device)?;
                let inv = 1.0 / tokens as f32;
                let dst = output.as_f32_mut()?;
                if features > 0 {
                    for (sample, out) in x.chunks_exact(tokens * features).zip(dst.chunks_exact_mut(features)) {
                        for row in sample.chunks_exact(features) {
                            out.iter_mut().zip(row).for_each(|(o, &v)| *o += v);
                        }
                        out.iter_mut().for_each(|o| *o *= inv);
                    }
                }
                Ok(output)
            }
            Device::Cuda(cuda) => {
                let x = gpu_f32(op, self, device)?;
                let stream = cuda.thread_stream()?;
                let mut output = cuda.alloc_zeros::<f32>(batch * features)?;
                stream.mean_over_tokens(&x, [batch, tokens, features], &mut output)?;
                Tensor::from_cuda_f32(output, Shape::new([batch, features]), device)
            }
        }
    }

    /// The input gradient of [`Tensor::mean_over_tokens`]: every token row of sample `b` is
    /// `dy[b, :] · (1 / tokens)`, for this `[batch, features]` output gradient and an input of
    /// `tokens` tokens. A new f32 tensor `[batch, tokens, features]` on this device.
    pub fn mean_over_tokens_grad(&self, tokens: usize) -> Result<Tensor> {
        let op = "mean_over_tokens_grad";
        let &[batch, features] = self.dims() else {
            return Err(Error::shape(op, "an output gradient [batch, features]", self.shape().to_string()));
        };
        if tokens == 0 {
            return Err(Error::invalid(op, "tokens must be at least 1"));
        }
        let shape = Shape::new([batch, tokens, features]);
        let device = self.device();
        match device {
            Device::Cpu(_) => {
                if features == 0 {
                    return Tensor::zeros(shape, DType::F32, device);
                }
                let grad = self.host_f32(op)?;
                let inv = 1.0 / tokens as f32;
                // Every token row of sample b is dy[b] / T: written in full, no zero-fill.
                Tensor::from_f32_init(shape, device, |dst| {
                    uninit::chunks(dst, features, |row, out| {
                        let b = row / tokens;
                        uninit::map(out, &grad[b * features..(b + 1) * features], |g| g * inv)
                    })
                })
            }
            Device::Cuda(cuda) => {
                let dy = gpu_f32(op, self, device)?;
                let stream = cuda.thread_stream()?;
                let mut grad_input = cuda.alloc_zeros::<f32>(shape.numel())?;
                stream.mean_over_tokens_backward(&dy, [batch, tokens, features], &mut grad_input)?;
                Tensor::from_cuda_f32(grad_input, shape, device)
            }
        }
    }
}
