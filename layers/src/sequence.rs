//! Layers over the token dimension of `[batch, tokens, features]` sequences:
//! `PositionalEmbedding`, which tells tokens apart by position (attention alone is
//! permutation-equivariant), and `MeanOverTokens`, the pooling a sequence classifier puts before
//! its head.
use conveyor_engine::cpu::uninit;
use conveyor_engine::{Device, Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor, init};
use rand::rngs::StdRng;

use crate::tensor_io::{
    accumulate_into, check_grad_shape, check_param_grads, check_same_device, expect_inputs, expect_shapes, f32_bytes,
    into_dtype, largest_parameter_bytes, read_shape_marker, saved_tensor, shape_marker, values, zeros_f32,
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
        let tokens = self.check(input.dims(), true)?;
        check_same_device("PositionalEmbedding", input, &self.params[0].value)?;
        let table = values(&self.params[0].value);
        let table = &table[..tokens * self.dim];
        let (x, len) = (values(input), tokens * self.dim);
        let output = Tensor::from_f32_init(input.shape().clone(), input.device(), |dst| {
            uninit::chunks(dst, len, |sample, out| {
                uninit::map2(out, &x[sample * len..(sample + 1) * len], table, |x, p| x + p)
            })
        })?;
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
        let tokens = self.check(input_shape.dims(), true)?;
        check_grad_shape("PositionalEmbedding", grad_output, &input_shape)?;
        let grad = values(grad_output);
        let len = tokens * self.dim;
        accumulate_into(&mut param_grads[0], |dst| {
            for sample in grad.chunks_exact(len) {
                dst[..len].iter_mut().zip(sample).for_each(|(d, &g)| *d += g);
            }
            Ok(())
        })
    }

    fn weight_pass_scratch_bytes(&self) -> u64 {
        // `accumulate_into` sums each parameter's part apart, one parameter at a time.
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
        let [batch, tokens, features] = batched_dims(input.shape())?;
        let x = values(input);
        let mut output = zeros_f32([batch, features], input.device())?;
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
        let saved = Saved { tensors: vec![shape_marker(input.shape(), input.device())?] };
        Ok((into_dtype(output, input.dtype())?, saved))
    }

    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let input_shape = read_shape_marker(KIND, saved_tensor(KIND, saved, 0)?)?;
        let [batch, tokens, features] = batched_dims(&input_shape)?;
        check_grad_shape(KIND, grad_output, &Shape::new(vec![batch, features]))?;
        let grad = values(grad_output);
        let inv = 1.0 / tokens as f32;
        // Every token row of sample b is dy[b] / T: written in full, no zero-fill.
        let grad_input = if features == 0 {
            zeros_f32(input_shape, grad_output.device())?
        } else {
            Tensor::from_f32_init(input_shape, grad_output.device(), |dst| {
                uninit::chunks(dst, features, |row, out| {
                    let b = row / tokens;
                    uninit::map(out, &grad[b * features..(b + 1) * features], |g| g * inv)
                })
            })?
        };
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
        })
    }
}
