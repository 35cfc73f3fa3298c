//! `LayerNorm`: normalisation over the last dimension with an elementwise affine transform
//! (PyTorch's `nn.LayerNorm(normalized_len)`, eps 1e-5). It computes through the engine's device
//! ops ([`Tensor::layer_norm`] and its gradients), so it runs on CPUs and GPUs alike.
use conveyor_engine::{Device, Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor};

use crate::tensor_io::{
    check_grad_shape, check_param_grads, check_same_device, expect_inputs, expect_shapes, f32_bytes, into_dtype,
    largest_parameter_bytes, saved_tensor,
};

/// PyTorch's default epsilon.
pub const LAYER_NORM_EPS: f32 = 1e-5;

/// `y = (x - mean) / sqrt(var + eps) · weight + bias` per row of the last dimension (biased
/// variance). Parameters: `weight` (ones) and `bias` (zeros), both `[normalized_len]`. Saves the
/// input and each row's mean and reciprocal standard deviation.
#[derive(Debug)]
pub struct LayerNorm {
    normalized_len: usize,
    eps: f32,
    params: Vec<Parameter>,
}

impl LayerNorm {
    /// A layer over a last dimension of `normalized_len`, weight ones and bias zeros, on the host.
    pub fn new(normalized_len: usize) -> Result<LayerNorm> {
        let host = Device::host();
        let weight = Tensor::full(1.0, [normalized_len], conveyor_engine::DType::F32, &host)?;
        let bias = Tensor::zeros([normalized_len], conveyor_engine::DType::F32, &host)?;
        LayerNorm::from_parameters(weight, bias)
    }

    /// A layer from given `weight` and `bias`, both `[normalized_len]`.
    pub fn from_parameters(weight: Tensor, bias: Tensor) -> Result<LayerNorm> {
        let &[normalized_len] = weight.dims() else {
            return Err(Error::shape("LayerNorm weight", "[normalized_len]", weight.shape().to_string()));
        };
        if normalized_len == 0 {
            return Err(Error::invalid(
                "LayerNorm normalized_len",
                "0: the normalised dimension must have at least 1 element",
            ));
        }
        if bias.dims() != [normalized_len] {
            return Err(Error::shape("LayerNorm bias", format!("[{normalized_len}]"), bias.shape().to_string()));
        }
        let params =
            vec![Parameter { name: "weight".into(), value: weight }, Parameter { name: "bias".into(), value: bias }];
        Ok(LayerNorm { normalized_len, eps: LAYER_NORM_EPS, params })
    }

    /// The epsilon added to the variance.
    pub fn eps(&self) -> f32 {
        self.eps
    }

    /// The same layer with another epsilon.
    pub fn with_eps(mut self, eps: f32) -> Result<LayerNorm> {
        if !(eps > 0.0 && eps.is_finite()) {
            return Err(Error::invalid("LayerNorm eps", format!("{eps}: must be positive and finite")));
        }
        self.eps = eps;
        Ok(self)
    }

    fn check_input(&self, shape: &Shape) -> Result<usize> {
        match shape.dims().last() {
            Some(&last) if last == self.normalized_len && shape.rank() >= 2 => Ok(shape.numel() / last),
            _ => Err(Error::shape(
                "LayerNorm",
                format!("an input [batch, ..., {}]", self.normalized_len),
                shape.to_string(),
            )),
        }
    }
}

impl Layer for LayerNorm {
    fn kind(&self) -> &'static str {
        "LayerNorm"
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        let shape = &expect_shapes("LayerNorm", input_shapes, 1)?[0];
        match shape.dims().last() {
            Some(&last) if last == self.normalized_len => Ok(shape.clone()),
            _ => Err(Error::shape(
                "LayerNorm",
                format!("a per-sample shape [..., {}]", self.normalized_len),
                shape.to_string(),
            )),
        }
    }

    fn parameters(&self) -> &[Parameter] {
        &self.params
    }

    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut self.params
    }

    fn forward(&self, inputs: &[&Tensor], ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        expect_inputs("LayerNorm", inputs, 1)?;
        let input = inputs[0];
        self.check_input(input.shape())?;
        check_same_device("LayerNorm", input, &self.params[0].value)?;
        let (output, mean, rstd) = input.layer_norm(&self.params[0].value, &self.params[1].value, self.eps)?;
        let saved = Saved { tensors: vec![input.share(), mean, rstd] };
        // On autocast's fp32 list: f32 out under a mixed precision ([`conveyor_engine::Precision`]).
        Ok((into_dtype(output, ctx.precision.fp32_output_dtype(input.dtype()))?, saved))
    }

    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let input = saved_tensor("LayerNorm", saved, 0)?;
        let (mean, rstd) = (saved_tensor("LayerNorm", saved, 1)?, saved_tensor("LayerNorm", saved, 2)?);
        check_grad_shape("LayerNorm", grad_output, input.shape())?;
        let grad_input = grad_output.layer_norm_input_grad(input, &self.params[0].value, mean, rstd)?;
        Ok(vec![Some(into_dtype(grad_input, input.dtype())?)])
    }

    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()> {
        check_param_grads("LayerNorm", &self.params, param_grads)?;
        let input = saved_tensor("LayerNorm", saved, 0)?;
        let (mean, rstd) = (saved_tensor("LayerNorm", saved, 1)?, saved_tensor("LayerNorm", saved, 2)?);
        check_grad_shape("LayerNorm", grad_output, input.shape())?;
        let (weight_grad, bias_grad) = param_grads.split_at_mut(1);
        grad_output.layer_norm_weight_grad_accumulate(input, mean, rstd, &mut weight_grad[0], &mut bias_grad[0])
    }

    fn weight_pass_scratch_bytes(&self) -> u64 {
        // The CPU sums each parameter's part apart, one parameter at a time.
        largest_parameter_bytes(&self.params)
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let output = self.output_shape(input_shapes)?;
        let numel = output.numel() as u64;
        let rows = output.numel() / self.normalized_len;
        Ok(LayerCost {
            workspace_bytes: 0,
            forward_flops_per_sample: 8 * numel,
            backward_input_flops_per_sample: 10 * numel,
            backward_weight_flops_per_sample: 4 * numel,
            param_bytes: f32_bytes(2 * self.normalized_len),
            activation_bytes_per_sample: f32_bytes(output.numel() + 2 * rows),
            output_bytes_per_sample: f32_bytes(output.numel()),
            backward_held_bytes_per_sample: 0,
            gpu_scratch_bytes_per_sample: Default::default(),
        })
    }
}
