//! Tensor plumbing shared by the layers: reading any dtype as f32, writing results back in the
//! caller's dtype, argument and device checks, gradient accumulation, and shape markers in `Saved`.
//!
//! These helpers read and write elements in host memory: they serve the layers that compute with
//! the CPU kernels directly. Every zoo layer (Linear, the activations, the cross-entropy loss,
//! Conv2d, the pooling layers, Dropout, the residual Add, LayerNorm, Embedding,
//! PositionalEmbedding, MeanOverTokens and MultiheadSelfAttention) computes through the engine's
//! device ops (`conveyor_engine::device::ops`) and so also runs on GPUs; of these helpers they use
//! only the argument, device and shape checks, [`into_dtype`] and the shape markers. A layer that
//! uses the rest, given a tensor on a GPU, fails with `Error::NotOnHost` when it creates its
//! result in `Tensor` (`from_f32_init`, `as_f32_mut`), never with a panic.
use std::borrow::Cow;

use conveyor_engine::{DType, Device, Error, Parameter, Result, Saved, Shape, Tensor};

/// The elements as f32: borrowed for f32 tensors, converted (one copy) for f16/bf16.
///
/// A tensor on a GPU is downloaded (its host-only layer then fails with `Error::NotOnHost` when it
/// creates its result on the GPU device, so these values never reach a result); should the
/// download itself fail, zeros of the right length stand in, for the same reason.
pub(crate) fn values(tensor: &Tensor) -> Cow<'_, [f32]> {
    match tensor.as_f32() {
        Ok(slice) => Cow::Borrowed(slice),
        Err(_) => Cow::Owned(tensor.try_to_vec_f32().unwrap_or_else(|_| vec![0.0; tensor.numel()])),
    }
}

/// An f32 tensor of zeros on `device`, reserved on the device's ledger before it is allocated.
pub(crate) fn zeros_f32(shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
    Tensor::zeros(shape, DType::F32, device)
}

/// Converts an f32 result to `dtype` (no copy when `dtype` is f32).
pub(crate) fn into_dtype(tensor: Tensor, dtype: DType) -> Result<Tensor> {
    if tensor.dtype() == dtype { Ok(tensor) } else { tensor.to_dtype(dtype) }
}

/// Checks that `kind` got exactly `expected` inputs.
pub(crate) fn expect_inputs(kind: &str, inputs: &[&Tensor], expected: usize) -> Result<()> {
    if inputs.len() != expected {
        return Err(Error::invalid(
            format!("{kind} inputs"),
            format!("{kind} takes {expected} input tensor(s), got {}", inputs.len()),
        ));
    }
    Ok(())
}

/// Checks that the per-sample input shapes given to `output_shape`/`cost` number `expected`.
pub(crate) fn expect_shapes<'a>(kind: &str, shapes: &'a [Shape], expected: usize) -> Result<&'a [Shape]> {
    if shapes.len() != expected {
        return Err(Error::invalid(
            format!("{kind} input shapes"),
            format!("{kind} takes {expected} input shape(s), got {}", shapes.len()),
        ));
    }
    Ok(shapes)
}

/// Checks that an input lives on the same device as the layer's parameters.
pub(crate) fn check_same_device(kind: &str, input: &Tensor, param: &Tensor) -> Result<()> {
    if !input.device().same_device(param.device()) {
        return Err(Error::DeviceMismatch {
            op: format!("{kind} (input vs parameters)"),
            lhs: input.device().to_string(),
            rhs: param.device().to_string(),
        });
    }
    Ok(())
}

/// The saved tensor at `index`, or an error saying the `Saved` did not come from this layer's forward.
pub(crate) fn saved_tensor<'a>(kind: &str, saved: &'a Saved, index: usize) -> Result<&'a Tensor> {
    saved.tensors.get(index).ok_or_else(|| {
        Error::invalid(
            format!("{kind} saved state"),
            format!(
                "expected at least {} saved tensor(s), found {}; pass the Saved returned by this layer's forward",
                index + 1,
                saved.tensors.len()
            ),
        )
    })
}

/// Checks that `grad_output` has the shape the forward pass produced.
pub(crate) fn check_grad_shape(kind: &str, grad_output: &Tensor, expected: &Shape) -> Result<()> {
    if grad_output.shape() != expected {
        return Err(Error::shape(
            format!("{kind} backward (grad_output)"),
            expected.to_string(),
            grad_output.shape().to_string(),
        ));
    }
    Ok(())
}

/// Checks that `param_grads` lines up with `params` (same count, same shapes).
pub(crate) fn check_param_grads(kind: &str, params: &[Parameter], param_grads: &[Tensor]) -> Result<()> {
    if params.len() != param_grads.len() {
        return Err(Error::invalid(
            format!("{kind} parameter gradients"),
            format!(
                "expected {} gradient tensor(s) aligned with parameters(), got {}",
                params.len(),
                param_grads.len()
            ),
        ));
    }
    for (param, grad) in params.iter().zip(param_grads) {
        if param.value.shape() != grad.shape() {
            return Err(Error::shape(
                format!("{kind} gradient of `{}`", param.name),
                param.value.shape().to_string(),
                grad.shape().to_string(),
            ));
        }
    }
    Ok(())
}

/// The f32 bytes of the largest of `params`: the buffer the device ops' accumulate-apart rule holds at most while it
/// sums one parameter's part (for [`conveyor_engine::Layer::weight_pass_scratch_bytes`]).
pub(crate) fn largest_parameter_bytes(params: &[Parameter]) -> u64 {
    params.iter().map(|p| 4 * p.value.numel() as u64).max().unwrap_or(0)
}

/// A zero-element tensor recording `shape` (its dims are `shape` followed by 0), for layers whose
/// backward needs only the input's shape. It costs no bytes on the device.
pub(crate) fn shape_marker(shape: &Shape, device: &Device) -> Result<Tensor> {
    let mut dims = shape.dims().to_vec();
    dims.push(0);
    Tensor::zeros(dims, DType::F32, device)
}

/// The shape recorded by [`shape_marker`].
pub(crate) fn read_shape_marker(kind: &str, marker: &Tensor) -> Result<Shape> {
    match marker.dims().split_last() {
        Some((0, dims)) => Ok(Shape::new(dims.to_vec())),
        _ => Err(Error::invalid(
            format!("{kind} saved state"),
            "the saved shape marker is malformed; pass the Saved returned by this layer's forward",
        )),
    }
}

/// The input's dims, checked to be rank 4 (NCHW).
pub(crate) fn nchw(kind: &str, shape: &Shape) -> Result<[usize; 4]> {
    match shape.dims() {
        &[n, c, h, w] => Ok([n, c, h, w]),
        _ => Err(Error::shape(kind, "an NCHW input [batch, channels, height, width]", shape.to_string())),
    }
}

/// The per-sample dims, checked to be rank 3 (CHW), for `output_shape`/`cost`.
pub(crate) fn chw(kind: &str, shape: &Shape) -> Result<[usize; 3]> {
    match shape.dims() {
        &[c, h, w] => Ok([c, h, w]),
        _ => Err(Error::shape(kind, "a per-sample shape [channels, height, width]", shape.to_string())),
    }
}

/// Bytes of `numel` f32 elements, as cost estimates count them.
pub(crate) fn f32_bytes(numel: usize) -> u64 {
    (numel * DType::F32.size_in_bytes()) as u64
}
