//! Typed launch wrappers for `norm.cu`: layer normalisation (`cpu::layer_norm`), the embedding
//! gather and its scatter-add, and the sequence layers' position add and token mean. Each checks
//! its operands' lengths and GPU, picks one thread per output (or per row) and queues the kernel;
//! every sum is one thread's loop in the CPU's order, so the results are deterministic.
use cudarc::driver::PushKernelArg;

use super::buffer::CudaBuffer;
use super::compile::Kernel;
use super::stream::CudaStream;
use crate::{Error, Result};

/// `len / part` when `part > 0` divides `len`, else a shape error naming `what`.
fn whole_parts(op: &str, what: &str, len: usize, part: usize) -> Result<usize> {
    if part == 0 || !len.is_multiple_of(part) {
        return Err(Error::shape(op, format!("{what} of {part} elements (> 0)"), format!("{len} elements")));
    }
    Ok(len / part)
}

impl CudaStream {
    /// `output = (x - mean) · rstd · weight + bias` per row of `weight.len()` elements, writing
    /// each row's `mean` and `rstd` (`cpu::layer_norm::layer_norm_forward`; one thread per row,
    /// statistics in f64).
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm_forward(
        &self,
        input: &CudaBuffer<f32>,
        weight: &CudaBuffer<f32>,
        bias: &CudaBuffer<f32>,
        eps: f32,
        output: &mut CudaBuffer<f32>,
        mean: &mut CudaBuffer<f32>,
        rstd: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        let kernel = Kernel::LayerNormForwardF32;
        let op = kernel.name();
        let dim = weight.len();
        let rows = whole_parts(op, "rows", input.len(), dim)?;
        self.check_len(op, "bias", dim, bias.len())?;
        self.check_len(op, "output", input.len(), output.len())?;
        self.check_len(op, "mean", rows, mean.len())?;
        self.check_len(op, "rstd", rows, rstd.len())?;
        for buffer in [input, weight, bias] {
            self.check_on_device(op, buffer)?;
        }
        for buffer in [&*output, &*mean, &*rstd] {
            self.check_on_device(op, buffer)?;
        }
        if rows == 0 {
            return Ok(());
        }
        let config = self.thread_per_item(op, rows)?;
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&input.slice).arg(&weight.slice).arg(&bias.slice).arg(&eps);
        launch.arg(&mut output.slice).arg(&mut mean.slice).arg(&mut rstd.slice).arg(&rows).arg(&dim);
        // SAFETY: one thread per row r < rows, reading row r of input (rows x dim, checked), dim
        // floats of weight and bias, and writing row r of output, mean[r] and rstd[r].
        unsafe { launch.launch(config) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// `input_grad = rstd · (g - mean(g) - x̂ · mean(g · x̂))` with `g = grad_output · weight`, per
    /// row (`cpu::layer_norm::layer_norm_backward_input`; one thread per row).
    pub fn layer_norm_backward_input(
        &self,
        input: &CudaBuffer<f32>,
        grad_output: &CudaBuffer<f32>,
        weight: &CudaBuffer<f32>,
        mean: &CudaBuffer<f32>,
        rstd: &CudaBuffer<f32>,
        input_grad: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        let kernel = Kernel::LayerNormBackwardInputF32;
        let op = kernel.name();
        let dim = weight.len();
        let rows = whole_parts(op, "rows", input.len(), dim)?;
        self.check_len(op, "grad_output", input.len(), grad_output.len())?;
        self.check_len(op, "input_grad", input.len(), input_grad.len())?;
        self.check_len(op, "mean", rows, mean.len())?;
        self.check_len(op, "rstd", rows, rstd.len())?;
        for buffer in [input, grad_output, weight, mean, rstd] {
            self.check_on_device(op, buffer)?;
        }
        self.check_on_device(op, input_grad)?;
        if rows == 0 {
            return Ok(());
        }
        let config = self.thread_per_item(op, rows)?;
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&input.slice).arg(&grad_output.slice).arg(&weight.slice).arg(&mean.slice).arg(&rstd.slice);
        launch.arg(&mut input_grad.slice).arg(&rows).arg(&dim);
        // SAFETY: one thread per row r < rows, reading row r of input and grad_output (rows x dim,
        // checked), dim floats of weight, mean[r] and rstd[r], and writing row r of input_grad.
        unsafe { launch.launch(config) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// `weight_grad += Σ_rows grad_output · x̂` and `bias_grad += Σ_rows grad_output`
    /// (`cpu::layer_norm::layer_norm_backward_weight`; one thread per column, each sum formed
    /// apart and then added).
    pub fn layer_norm_backward_weight(
        &self,
        input: &CudaBuffer<f32>,
        grad_output: &CudaBuffer<f32>,
        mean: &CudaBuffer<f32>,
        rstd: &CudaBuffer<f32>,
        weight_grad: &mut CudaBuffer<f32>,
        bias_grad: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        let kernel = Kernel::LayerNormBackwardWeightF32;
        let op = kernel.name();
        let dim = weight_grad.len();
        let rows = whole_parts(op, "rows", input.len(), dim)?;
        self.check_len(op, "bias_grad", dim, bias_grad.len())?;
        self.check_len(op, "grad_output", input.len(), grad_output.len())?;
        self.check_len(op, "mean", rows, mean.len())?;
        self.check_len(op, "rstd", rows, rstd.len())?;
        for buffer in [input, grad_output, mean, rstd] {
            self.check_on_device(op, buffer)?;
        }
        self.check_on_device(op, weight_grad)?;
        self.check_on_device(op, bias_grad)?;
        let config = self.thread_per_item(op, dim)?;
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&input.slice).arg(&grad_output.slice).arg(&mean.slice).arg(&rstd.slice);
        launch.arg(&mut weight_grad.slice).arg(&mut bias_grad.slice).arg(&rows).arg(&dim);
        // SAFETY: one thread per column c < dim (dim > 0 checked), reading column c of input and
        // grad_output (rows x dim) and every mean and rstd (rows each), updating element c of
        // both gradients.
        unsafe { launch.launch(config) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// `output[p, :] = table[ids[p], :]` for a row-major `table` of `n_rows` rows (ids are
    /// integers held in f32, checked by the caller; an id out of range gives a row of zeros).
    pub fn embedding_gather(
        &self,
        ids: &CudaBuffer<f32>,
        table: &CudaBuffer<f32>,
        n_rows: usize,
        output: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        let kernel = Kernel::EmbeddingGatherF32;
        let op = kernel.name();
        let dim = whole_parts(op, "a table of rows", table.len(), n_rows)?;
        self.check_len(op, "output", ids.len() * dim, output.len())?;
        self.check_on_device(op, ids)?;
        self.check_on_device(op, table)?;
        self.check_on_device(op, output)?;
        if output.is_empty() {
            return Ok(());
        }
        let (n_ids, config) = (ids.len(), self.grid_stride(output.len()));
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&ids.slice).arg(&table.slice).arg(&mut output.slice).arg(&n_ids).arg(&n_rows).arg(&dim);
        // SAFETY: reads n_ids floats of ids and, for ids in 0..n_rows only, rows of the
        // n_rows x dim table; writes n_ids x dim floats of output (checked).
        unsafe { launch.launch(config) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// `grad[ids[s], :] += Σ_k grad_output[positions[k], :]` over `k` in
    /// `offsets[s]..offsets[s + 1]`, for each distinct id `s` (the embedding weight gradient:
    /// `grad` is `[n_rows, dim]`, `grad_output` `[n_positions, dim]`). One thread per (id,
    /// column) sums its positions in order and then adds. The caller guarantees that the ids are
    /// distinct and below `grad.len() / dim`, that `offsets` rises from 0 to `positions.len()`, and
    /// that every position is below `grad_output.len() / dim`.
    pub fn embedding_scatter_add(
        &self,
        grad_output: &CudaBuffer<f32>,
        ids: &CudaBuffer<i64>,
        offsets: &CudaBuffer<i64>,
        positions: &CudaBuffer<i64>,
        grad: &mut CudaBuffer<f32>,
        dim: usize,
    ) -> Result<()> {
        let kernel = Kernel::EmbeddingScatterAddF32;
        let op = kernel.name();
        let n_slots = ids.len();
        whole_parts(op, "rows", grad.len(), dim)?;
        whole_parts(op, "rows", grad_output.len(), dim)?;
        self.check_len(op, "offsets", n_slots + 1, offsets.len())?;
        self.check_on_device(op, grad_output)?;
        for buffer in [ids, offsets, positions] {
            self.check_on_device(op, buffer)?;
        }
        self.check_on_device(op, grad)?;
        if n_slots == 0 {
            return Ok(());
        }
        let config = self.thread_per_item(op, n_slots * dim)?;
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&grad_output.slice).arg(&ids.slice).arg(&offsets.slice).arg(&positions.slice);
        launch.arg(&mut grad.slice).arg(&n_slots).arg(&dim);
        // SAFETY: one thread per (slot, column) below n_slots x dim; it reads offsets[s] and
        // offsets[s + 1] (n_slots + 1 entries, checked), the positions between them and those rows
        // of grad_output, and updates element c of row ids[s] of grad, all in range by the
        // caller's guarantee; distinct ids mean no two threads write one element.
        unsafe { launch.launch(config) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// `output[i] = input[i] + table[i % len]`: the first `len` elements of `table` added to
    /// every sample of `len` elements of `input` (the positional embedding's forward).
    pub fn add_positions(
        &self,
        input: &CudaBuffer<f32>,
        table: &CudaBuffer<f32>,
        len: usize,
        output: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        let kernel = Kernel::AddPositionsF32;
        let op = kernel.name();
        whole_parts(op, "samples", input.len(), len)?;
        if table.len() < len {
            return Err(Error::shape(op, format!("a table of at least {len} elements"), table.len().to_string()));
        }
        self.check_len(op, "output", input.len(), output.len())?;
        self.check_on_device(op, input)?;
        self.check_on_device(op, table)?;
        self.check_on_device(op, output)?;
        let n = input.len();
        if n == 0 {
            return Ok(());
        }
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&input.slice).arg(&table.slice).arg(&mut output.slice).arg(&n).arg(&len);
        // SAFETY: reads n floats of input and the first len (> 0) floats of table (checked),
        // writes n floats of output.
        unsafe { launch.launch(self.grid_stride(n)) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// `grad[c] += Σ_b grad_output[b · len + c]` for `c < len`: the sum over samples of `len`
    /// elements, added onto the first `len` elements of `grad` (the positional embedding's weight
    /// gradient; one thread per element, summed apart and then added).
    pub fn positions_grad_accumulate(
        &self,
        grad_output: &CudaBuffer<f32>,
        len: usize,
        grad: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        let kernel = Kernel::PositionsGradAccumulateF32;
        let op = kernel.name();
        let batch = whole_parts(op, "samples", grad_output.len(), len)?;
        if grad.len() < len {
            return Err(Error::shape(op, format!("a gradient of at least {len} elements"), grad.len().to_string()));
        }
        self.check_on_device(op, grad_output)?;
        self.check_on_device(op, grad)?;
        let config = self.thread_per_item(op, len)?;
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&grad_output.slice).arg(&mut grad.slice).arg(&batch).arg(&len);
        // SAFETY: one thread per element c < len, reading batch x len floats of grad_output
        // (checked) and updating grad[c] (grad holds at least len).
        unsafe { launch.launch(config) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// `output[b, f] = (Σ_t input[b, t, f]) · (1 / tokens)` for `input` `[batch, tokens, features]`
    /// and `output` `[batch, features]` (one thread per output element, tokens in order).
    pub fn mean_over_tokens(
        &self,
        input: &CudaBuffer<f32>,
        [batch, tokens, features]: [usize; 3],
        output: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        let kernel = Kernel::MeanOverTokensF32;
        let op = kernel.name();
        self.check_len(op, "input", batch * tokens * features, input.len())?;
        self.check_len(op, "output", batch * features, output.len())?;
        self.check_on_device(op, input)?;
        self.check_on_device(op, output)?;
        if output.is_empty() || tokens == 0 {
            return Ok(());
        }
        let inv_tokens = 1.0 / tokens as f32;
        let config = self.thread_per_item(op, output.len())?;
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&input.slice).arg(&mut output.slice).arg(&batch).arg(&tokens).arg(&features).arg(&inv_tokens);
        // SAFETY: one thread per output element below batch x features; each reads tokens floats
        // of its sample of input (batch x tokens x features, checked) and writes its own element.
        unsafe { launch.launch(config) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// `input_grad[b, t, f] = grad_output[b, f] · (1 / tokens)` (the token mean's gradient) for
    /// `grad_output` `[batch, features]` and `input_grad` `[batch, tokens, features]`.
    pub fn mean_over_tokens_backward(
        &self,
        grad_output: &CudaBuffer<f32>,
        [batch, tokens, features]: [usize; 3],
        input_grad: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        let kernel = Kernel::MeanOverTokensBackwardF32;
        let op = kernel.name();
        self.check_len(op, "grad_output", batch * features, grad_output.len())?;
        self.check_len(op, "input_grad", batch * tokens * features, input_grad.len())?;
        self.check_on_device(op, grad_output)?;
        self.check_on_device(op, input_grad)?;
        let n = input_grad.len();
        if n == 0 {
            return Ok(());
        }
        let inv_tokens = 1.0 / tokens as f32;
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&grad_output.slice).arg(&mut input_grad.slice).arg(&batch).arg(&tokens).arg(&features);
        launch.arg(&inv_tokens);
        // SAFETY: writes batch x tokens x features floats of input_grad, each reading one element
        // of grad_output (batch x features, checked); n > 0 means tokens and features are > 0.
        unsafe { launch.launch(self.grid_stride(n)) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }
}
