//! Layers over the token dimension of `[batch, tokens, features]` sequences:
//! `PositionalEmbedding`, which tells tokens apart by position (attention alone is
//! permutation-equivariant), and `MeanOverTokens`, the pooling a sequence classifier puts before
//! its head. Both compute through the engine's device ops ([`Tensor::add_positions`],
//! [`Tensor::mean_over_tokens`] and their gradients), so they run on CPUs and GPUs alike.
use conveyor_engine::{Device, Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor, init};
use rand::rngs::StdRng;

use crate::tensor_io::{
    check_grad_shape, check_param_grads, check_same_device, expect_inputs, expect_shapes, f32_bytes, into_dtype,
    largest_parameter_bytes, read_shape_marker, saved_tensor, shape_marker,
};

/// A learned position table added to a sequence: `y[b, t, :] = x[b, t, :] + weight[t, :]` for `x`
/// `[batch, tokens, dim]` with `tokens ≤ max_tokens`. The parameter `weight` `[max_tokens, dim]`
/// is drawn from N(0, 1), as PyTorch's `nn.Embedding(max_tokens, dim)` applied to
/// `arange(tokens)` would hold it (so its state-dict name is `<node>.weight`).
/// `∂L/∂x = ∂L/∂y`; `∂L/∂weight[t, :] = Σ_b ∂L/∂y[b, t, :]` (rows past `tokens` get nothing).
/// Saves only the input's shape.
#[derive(Debug)]
pub struct PositionalEmbedding {
    max_tokens: usize,
    dim: usize,
    params: Vec<Parameter>,
}

impl PositionalEmbedding {
    /// A table for up to `max_tokens` positions of width `dim`, drawn from N(0, 1), on the host.
    pub fn new(max_tokens: usize, dim: usize, rng: &mut StdRng) -> Result<PositionalEmbedding> {
        PositionalEmbedding::from_parameters(init::normal([max_tokens, dim], 1.0, rng, &Device::host())?)
    }

    /// A table from a given `weight` `[max_tokens, dim]`.
    pub fn from_parameters(weight: Tensor) -> Result<PositionalEmbedding> {
        match weight.dims() {
            &[max_tokens, dim] if max_tokens > 0 && dim > 0 => Ok(PositionalEmbedding {
                max_tokens,
                dim,
                params: vec![Parameter { name: "weight".into(), value: weight }],
            }),
            _ => Err(Error::shape(
                "PositionalEmbedding weight",
                "[max_tokens, dim] with both at least 1",
                weight.shape().to_string(),
            )),
        }
    }

    /// Most positions an input may have.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Width of each position's row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    fn check(&self, dims: &[usize], batched: bool) -> Result<usize> {
        let (tokens, dim) = match (dims, batched) {
            (&[_, tokens, dim], true) | (&[tokens, dim], false) => (tokens, dim),
            _ => (0, 0),
        };
        if tokens == 0 || tokens > self.max_tokens || dim != self.dim {
            let what = if batched { "an input [batch, tokens, " } else { "a per-sample shape [tokens, " };
            return Err(Error::shape(
                "PositionalEmbedding",
                format!("{what}{}] with 1 <= tokens <= {}", self.dim, self.max_tokens),
                Shape::new(dims.to_vec()).to_string(),
            ));
        }
        Ok(tokens)
    }
}

impl Layer for PositionalEmbedding {
    fn kind(&self) -> &'static str {
        "PositionalEmbedding"
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        let shape = &expect_shapes("PositionalEmbedding", input_shapes, 1)?[0];
        self.check(shape.dims(), false)?;
        Ok(shape.clone())
    }

    fn parameters(&self) -> &[Parameter] {
        &self.params
    }

    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut self.params
    }

    fn forward(&self, inputs: &[&Tensor], _ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        expect_inputs("PositionalEmbedding", inputs, 1)?;
        let input = inputs[0];
        self.check(input.dims(), true)?;
        check_same_device("PositionalEmbedding", input, &self.params[0].value)?;
        let output = input.add_positions(&self.params[0].value)?;
        let saved = Saved { tensors: vec![shape_marker(input.shape(), input.device())?] };
        Ok((into_dtype(output, input.dtype())?, saved))
    }

    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let input_shape = read_shape_marker("PositionalEmbedding", saved_tensor("PositionalEmbedding", saved, 0)?)?;
        check_grad_shape("PositionalEmbedding", grad_output, &input_shape)?;
        Ok(vec![Some(grad_output.share())])
    }

    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()> {
        check_param_grads("PositionalEmbedding", &self.params, param_grads)?;
        let input_shape = read_shape_marker("PositionalEmbedding", saved_tensor("PositionalEmbedding", saved, 0)?)?;
        self.check(input_shape.dims(), true)?;
        check_grad_shape("PositionalEmbedding", grad_output, &input_shape)?;
        grad_output.positions_grad_accumulate(&mut param_grads[0])
    }

    fn weight_pass_scratch_bytes(&self) -> u64 {
        // The CPU sums each parameter's part apart, one parameter at a time.
        largest_parameter_bytes(&self.params)
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let numel = self.output_shape(input_shapes)?.numel();
        Ok(LayerCost {
            workspace_bytes: 0,
            forward_flops_per_sample: numel as u64,
            backward_input_flops_per_sample: 0,
            backward_weight_flops_per_sample: numel as u64,
            param_bytes: f32_bytes(self.max_tokens * self.dim),
            activation_bytes_per_sample: 0,
            output_bytes_per_sample: f32_bytes(numel),
            backward_held_bytes_per_sample: 0,
            gpu_scratch_bytes_per_sample: Default::default(),
        })
    }
}

const KIND: &str = "MeanOverTokens";

/// `y[b, :] = (1/T) Σ_t x[b, t, :]`: `[batch, tokens, features]` to `[batch, features]` (PyTorch's
/// `x.mean(dim=1)`). `∂L/∂x[b, t, :] = ∂L/∂y[b, :] / T`. No parameters; saves only the input's
/// shape (no bytes).
#[derive(Debug, Default, Clone, Copy)]
pub struct MeanOverTokens;

impl MeanOverTokens {
    /// The layer (it has no configuration).
    pub fn new() -> MeanOverTokens {
        MeanOverTokens
    }
}

fn batched_dims(shape: &Shape) -> Result<[usize; 3]> {
    match shape.dims() {
        &[batch, tokens, features] if tokens > 0 => Ok([batch, tokens, features]),
        _ => Err(Error::shape(KIND, "an input [batch, tokens, features] with tokens >= 1", shape.to_string())),
    }
}

impl Layer for MeanOverTokens {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        let shape = &expect_shapes(KIND, input_shapes, 1)?[0];
        match shape.dims() {
            &[tokens, features] if tokens > 0 => Ok(Shape::new(vec![features])),
            _ => Err(Error::shape(KIND, "a per-sample shape [tokens, features] with tokens >= 1", shape.to_string())),
        }
    }

    fn parameters(&self) -> &[Parameter] {
        &[]
    }

    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut []
    }

    fn forward(&self, inputs: &[&Tensor], _ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        expect_inputs(KIND, inputs, 1)?;
        let input = inputs[0];
        batched_dims(input.shape())?;
        let output = input.mean_over_tokens()?;
        let saved = Saved { tensors: vec![shape_marker(input.shape(), input.device())?] };
        Ok((into_dtype(output, input.dtype())?, saved))
    }

    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let input_shape = read_shape_marker(KIND, saved_tensor(KIND, saved, 0)?)?;
        let [batch, tokens, features] = batched_dims(&input_shape)?;
        check_grad_shape(KIND, grad_output, &Shape::new(vec![batch, features]))?;
        let grad_input = grad_output.mean_over_tokens_grad(tokens)?;
        Ok(vec![Some(into_dtype(grad_input, grad_output.dtype())?)])
    }

    fn backward_weight(&self, _saved: &Saved, _grad_output: &Tensor, _param_grads: &mut [Tensor]) -> Result<()> {
        Ok(())
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let output = self.output_shape(input_shapes)?;
        let numel = input_shapes[0].numel() as u64;
        Ok(LayerCost {
            workspace_bytes: 0,
            forward_flops_per_sample: numel + output.numel() as u64,
            backward_input_flops_per_sample: numel,
            backward_weight_flops_per_sample: 0,
            param_bytes: 0,
            activation_bytes_per_sample: 0,
            output_bytes_per_sample: f32_bytes(output.numel()),
            backward_held_bytes_per_sample: 0,
            gpu_scratch_bytes_per_sample: Default::default(),
        })
    }
}
