//! `Dropout`: in training, zeroes each element with probability p and scales the rest by
//! 1/(1-p) (PyTorch's inverted dropout); the identity in evaluation. The mask is drawn from a
//! generator seeded with `ForwardCtx::seed`, so recomputing a forward pass reproduces it exactly.
//!
//! The mask is drawn on the host on every device (so a GPU drops the same elements as a CPU) and
//! applied by the device ops `Tensor::dropout_forward` and `Tensor::dropout_apply`, so the layer
//! runs on every device: on a CPU in the input's dtype, on a GPU in f32.
use conveyor_engine::{Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::tensor_io::{check_grad_shape, expect_inputs, expect_shapes, saved_tensor};

/// Inverted dropout with drop probability `p`.
///
/// The keep mask is a pure function of `(ctx.seed, input shape)`: element `i` is dropped when the
/// `i`-th draw of `StdRng::seed_from_u64(ctx.seed)` from U[0, 1) is below `p`. The same seed gives
/// the same mask (activation recomputation relies on this), a different seed a different one. The
/// caller gives each layer and micro-batch its own seed. The mask is saved as f16 zeros and ones
/// on a CPU (2 bytes per element), as f32 on a GPU (4 bytes, the kernel's operand type).
#[derive(Debug, Clone, Copy)]
pub struct Dropout {
    p: f32,
}

impl Dropout {
    /// Dropout with drop probability `p` in [0, 1].
    pub fn new(p: f32) -> Result<Dropout> {
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::invalid("Dropout p", format!("{p}: the drop probability must lie in [0, 1]")));
        }
        Ok(Dropout { p })
    }

    /// The drop probability.
    pub fn p(&self) -> f32 {
        self.p
    }

    /// The factor kept elements are multiplied by: 1/(1-p), or 0 when every element is dropped.
    fn scale(&self) -> f32 {
        if self.p >= 1.0 { 0.0 } else { 1.0 / (1.0 - self.p) }
    }

    /// The keep mask (1 keep, 0 drop) for `numel` elements under `seed`.
    pub fn mask(&self, numel: usize, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..numel).map(|_| if rng.random::<f32>() < self.p { 0.0 } else { 1.0 }).collect()
    }
}

impl Layer for Dropout {
    fn kind(&self) -> &'static str {
        "Dropout"
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        Ok(expect_shapes("Dropout", input_shapes, 1)?[0].clone())
    }

    fn parameters(&self) -> &[Parameter] {
        &[]
    }

    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut []
    }

    fn forward(&self, inputs: &[&Tensor], ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        expect_inputs("Dropout", inputs, 1)?;
        let input = inputs[0];
        if !ctx.training || self.p == 0.0 {
            return Ok((input.share(), Saved::default()));
        }
        let keep = self.mask(input.numel(), ctx.seed);
        let (output, mask) = input.dropout_forward(&keep, self.scale())?;
        Ok((output, Saved { tensors: vec![mask] }))
    }

    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        if saved.tensors.is_empty() {
            // Evaluation mode or p = 0: the identity.
            return Ok(vec![Some(grad_output.share())]);
        }
        let mask = saved_tensor("Dropout", saved, 0)?;
        check_grad_shape("Dropout", grad_output, mask.shape())?;
        Ok(vec![Some(grad_output.dropout_apply(mask, self.scale())?)])
    }

    fn backward_weight(&self, _saved: &Saved, _grad_output: &Tensor, _param_grads: &mut [Tensor]) -> Result<()> {
        Ok(())
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let numel = expect_shapes("Dropout", input_shapes, 1)?[0].numel() as u64;
        Ok(LayerCost {
            workspace_bytes: 0,
            forward_flops_per_sample: 2 * numel,
            backward_input_flops_per_sample: 2 * numel,
            backward_weight_flops_per_sample: 0,
            param_bytes: 0,
            activation_bytes_per_sample: 2 * numel,
            output_bytes_per_sample: 4 * numel,
            backward_held_bytes_per_sample: 0,
            gpu_scratch_bytes_per_sample: Default::default(),
        })
    }
}
