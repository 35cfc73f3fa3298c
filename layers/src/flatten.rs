//! `Flatten`: `[B, d1, d2, ...] -> [B, d1·d2·...]` (PyTorch's `nn.Flatten()` with `start_dim=1`).
use conveyor_engine::{Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor};

use crate::tensor_io::{expect_inputs, expect_shapes, f32_bytes, read_shape_marker, saved_tensor, shape_marker};

/// Flattens every dimension after the batch into one. Saves only the input shape; backward
/// reshapes the gradient back.
#[derive(Debug, Default, Clone, Copy)]
pub struct Flatten;

impl Flatten {
    /// The layer (it has no configuration).
    pub fn new() -> Flatten {
        Flatten
    }
}

impl Layer for Flatten {
    fn kind(&self) -> &'static str {
        "Flatten"
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        Ok(Shape::new([expect_shapes("Flatten", input_shapes, 1)?[0].numel()]))
    }

    fn parameters(&self) -> &[Parameter] {
        &[]
    }

    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut []
    }

    fn forward(&self, inputs: &[&Tensor], _ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        expect_inputs("Flatten", inputs, 1)?;
        let input = inputs[0];
        if input.shape().rank() == 0 {
            return Err(Error::shape(
                "Flatten",
                "an input with a batch dimension [batch, ...]",
                input.shape().to_string(),
            ));
        }
        let batch = input.shape().leading();
        let output = input.share().reshape([batch, input.shape().trailing_numel()])?;
        Ok((output, Saved { tensors: vec![shape_marker(input.shape(), input.device())?] }))
    }

    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let input_shape = read_shape_marker("Flatten", saved_tensor("Flatten", saved, 0)?)?;
        let expected = Shape::new([input_shape.leading(), input_shape.trailing_numel()]);
        if grad_output.shape() != &expected {
            return Err(Error::shape(
                "Flatten backward (grad_output)",
                expected.to_string(),
                grad_output.shape().to_string(),
            ));
        }
        Ok(vec![Some(grad_output.share().reshape(input_shape)?)])
    }

    fn backward_weight(&self, _saved: &Saved, _grad_output: &Tensor, _param_grads: &mut [Tensor]) -> Result<()> {
        Ok(())
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let numel = expect_shapes("Flatten", input_shapes, 1)?[0].numel();
        Ok(LayerCost { output_bytes_per_sample: f32_bytes(numel), ..LayerCost::default() })
    }
}
