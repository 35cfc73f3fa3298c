//! `Add`: the residual join `y = a + b` of two tensors of one shape (`n_inputs() == 2`),
//! computed by the device op `Tensor::add`, so it runs on every device (CPU: in f32, rounded back
//! to the inputs' dtype, or f32 when they differ, as PyTorch promotes; GPU: f32).
use conveyor_engine::{Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor};

use crate::tensor_io::{expect_inputs, expect_shapes, f32_bytes, into_dtype};

/// Elementwise sum of two inputs of the same shape; both get the output gradient unchanged (two
/// shares of it, no copies). Saves nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct Add;

impl Add {
    /// The layer (it has no configuration).
    pub fn new() -> Add {
        Add
    }
}

impl Layer for Add {
    fn kind(&self) -> &'static str {
        "Add"
    }

    fn n_inputs(&self) -> usize {
        2
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        let shapes = expect_shapes("Add", input_shapes, 2)?;
        if shapes[0] != shapes[1] {
            return Err(Error::shape("Add", format!("both inputs of shape {}", shapes[0]), shapes[1].to_string()));
        }
        Ok(shapes[0].clone())
    }

    fn parameters(&self) -> &[Parameter] {
        &[]
    }

    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut []
    }

    fn forward(&self, inputs: &[&Tensor], _ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        expect_inputs("Add", inputs, 2)?;
        let (lhs, rhs) = (inputs[0], inputs[1]);
        if lhs.shape() != rhs.shape() {
            return Err(Error::shape("Add", format!("both inputs of shape {}", lhs.shape()), rhs.shape().to_string()));
        }
        if !lhs.device().same_device(rhs.device()) {
            return Err(Error::DeviceMismatch {
                op: "Add".into(),
                lhs: lhs.device().to_string(),
                rhs: rhs.device().to_string(),
            });
        }
        // Mixed dtypes promote to f32, as PyTorch adds a half tensor and an f32 one.
        let sum = lhs.add(rhs)?;
        let sum = if lhs.dtype() == rhs.dtype() { sum } else { into_dtype(sum, conveyor_engine::DType::F32)? };
        Ok((sum, Saved::default()))
    }

    fn backward_input(&self, _saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(grad_output.share()), Some(grad_output.share())])
    }

    fn backward_weight(&self, _saved: &Saved, _grad_output: &Tensor, _param_grads: &mut [Tensor]) -> Result<()> {
        Ok(())
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let numel = self.output_shape(input_shapes)?.numel();
        Ok(LayerCost {
            forward_flops_per_sample: numel as u64,
            output_bytes_per_sample: f32_bytes(numel),
            ..LayerCost::default()
        })
    }
}
