//! `Linear`: `y = x · weightᵀ + bias` over the last dimension, with PyTorch's names, layout and
//! default initialisation.
//!
//! The products go through the engine's device ops ([`Tensor::matmul`],
//! [`Tensor::matmul_accumulate`], [`Tensor::accumulate_column_sums`]), so the layer runs wherever
//! its parameters live: the CPU kernels on a CPU device, cuBLAS and the reduction kernels on a GPU.
//! The one CPU-specific path is the packed weight (see the `packed` field), used only for f32
//! weights in host memory.
use conveyor_engine::cpu::{MatRef, packed, rows_gemm, uninit};
use conveyor_engine::device::ops::Matrix;
use conveyor_engine::{
    DType, Device, Error, ForwardCtx, Layer, LayerCost, Parameter, Precision, Result, Saved, Shape, Tensor, init,
};
use rand::rngs::StdRng;

use crate::tensor_io::{
    check_grad_shape, check_param_grads, check_same_device, expect_inputs, expect_shapes, f32_bytes, into_dtype,
    saved_tensor, values, zeros_f32,
};

/// A fully connected layer: `y = x · weightᵀ + bias`, applied to the last dimension of an input of
/// rank ≥ 2 (`[batch, in]` or `[batch, ..., in]`).
///
/// Parameters (PyTorch's `nn.Linear`): `weight` `[out_features, in_features]`, then `bias`
/// `[out_features]` when enabled. Both default to U(±1/sqrt(in_features)).
///
/// Mixed precision ([`Precision`], autocast's rules): under `ctx.precision` bf16 or f16, or given
/// an f16/bf16 input, the layer rounds input, weight and bias to that half type, multiplies with
/// f32 accumulation and returns the half type; it saves the rounded input, and its backward
/// rounds the output gradient and the weight the same way (the weight gradient stays f32). The
/// result differs from an f32 layer by the roundings of the operands and of the output; the test
/// `half_precision_linear` bounds the relative error by `4 · u · sqrt(in_features)` with unit
/// roundoff u = 2⁻¹¹ (f16) or 2⁻⁸ (bf16).
///
/// ```
/// use conveyor_engine::{Device, ForwardCtx, Layer, Tensor, init};
/// use conveyor_layers::Linear;
/// let layer = Linear::new(3, 2, true, &mut init::rng(0))?;
/// let x = Tensor::from_vec(vec![1.0, 2.0, 3.0], [1, 3], &Device::host())?;
/// let (y, _saved) = layer.forward(&[&x], &ForwardCtx::eval())?;
/// assert_eq!(y.dims(), &[1, 2]);
/// # Ok::<(), conveyor_engine::Error>(())
/// ```
#[derive(Debug)]
pub struct Linear {
    in_features: usize,
    out_features: usize,
    params: Vec<Parameter>,
    /// The weight packed for the two products that use it (f32 weights only), when enabled
    /// ([`Layer::set_derived_cache`], `--weight-cache on|auto`; off by default): rebuilt by
    /// [`Layer::refresh`] after every optimizer step and reused for every micro-batch of the
    /// next one: `weightᵀ` (`[in, out]`) for the forward `x · weightᵀ` and `weight` (`[out, in]`)
    /// for the input gradient `dy · weight`, each in the strips of our small-row kernel
    /// ([`conveyor_engine::cpu::packed`]). Only the products that kernel takes (a micro-batch's)
    /// read them, so the results never depend on them. Read in place they make a 1024x1024
    /// product 1.2-1.7x faster at 32-64 rows, but their rebuild (two weight-sized copies per
    /// step) measured more than that saves in training (`benches/README.md`), hence off by
    /// default. Stale (and unused) after `parameters_mut` hands the weight out, until the next
    /// refresh; the products then read `weight` directly. The buffers are reused across
    /// refreshes.
    packed: Option<PackedWeight>,
    packed_fresh: bool,
    /// Whether `refresh` builds `packed` ([`Layer::set_derived_cache`]: off unless the run asks
    /// for the copies, and the planner turns it off again where they do not fit the device).
    packing: bool,
}

/// A Linear weight packed for its forward and input-gradient products.
#[derive(Debug)]
struct PackedWeight {
    /// `weightᵀ` (`k = in`, `n = out`) in strips.
    forward: Tensor,
    /// `weight` (`k = out`, `n = in`) in strips.
    backward_input: Tensor,
}

impl Linear {
    /// A layer with PyTorch's default initialisation (weight kaiming-uniform with a = sqrt(5), bias
    /// U(±1/sqrt(in_features))), parameters on the host.
    pub fn new(in_features: usize, out_features: usize, bias: bool, rng: &mut StdRng) -> Result<Linear> {
        if in_features == 0 || out_features == 0 {
            return Err(Error::invalid(
                "Linear features",
                format!("in_features={in_features}, out_features={out_features}: both must be at least 1"),
            ));
        }
        let host = Device::host();
        let weight = init::kaiming_uniform_default([out_features, in_features], in_features, rng, &host)?;
        let bias = if bias { Some(init::bias_uniform_default([out_features], in_features, rng, &host)?) } else { None };
        Linear::from_parameters(weight, bias)
    }

    /// A layer from given tensors: `weight` `[out, in]` and optionally `bias` `[out]`.
    pub fn from_parameters(weight: Tensor, bias: Option<Tensor>) -> Result<Linear> {
        let &[out_features, in_features] = weight.dims() else {
            return Err(Error::shape("Linear weight", "[out_features, in_features]", weight.shape().to_string()));
        };
        if in_features == 0 || out_features == 0 {
            return Err(Error::shape(
                "Linear weight",
                "[out_features, in_features] with both at least 1",
                weight.shape().to_string(),
            ));
        }
        let mut params = vec![Parameter { name: "weight".into(), value: weight }];
        if let Some(bias) = bias {
            if bias.dims() != [out_features] {
                return Err(Error::shape(
                    "Linear bias",
                    format!("[{out_features}] (out_features)"),
                    bias.shape().to_string(),
                ));
            }
            params.push(Parameter { name: "bias".into(), value: bias });
        }
        let mut layer = Linear { in_features, out_features, params, packed: None, packed_fresh: false, packing: false };
        // A model built only for its shapes gets no packed copies (they are rebuilt by the first
        // refresh once the weights are real).
        if !init::building_unwritten() {
            layer.refresh()?;
        }
        Ok(layer)
    }

    /// Input features (the last input dimension).
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// The weight, `[out_features, in_features]`.
    pub fn weight(&self) -> &Tensor {
        &self.params[0].value
    }

    /// The bias, `[out_features]`, if the layer has one.
    pub fn bias(&self) -> Option<&Tensor> {
        self.params.get(1).map(|p| &p.value)
    }

    /// Checks a batched input and returns its number of rows (all dims but the last).
    fn input_rows(&self, shape: &Shape) -> Result<usize> {
        match shape.dims().split_last() {
            Some((&last, leading)) if !leading.is_empty() && last == self.in_features => Ok(leading.iter().product()),
            _ => Err(Error::shape(
                "Linear",
                format!("an input [batch, ..., {}] of rank >= 2", self.in_features),
                shape.to_string(),
            )),
        }
    }

    fn output_dims(&self, input: &Shape) -> Vec<usize> {
        let mut dims = input.dims().to_vec();
        *dims.last_mut().expect("checked rank >= 1") = self.out_features;
        dims
    }
}

impl Layer for Linear {
    fn kind(&self) -> &'static str {
        "Linear"
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        let shape = &expect_shapes("Linear", input_shapes, 1)?[0];
        match shape.dims().last() {
            Some(&last) if last == self.in_features => Ok(Shape::new(self.output_dims(shape))),
            _ => Err(Error::shape(
                "Linear",
                format!("a per-sample shape [..., {}]", self.in_features),
                shape.to_string(),
            )),
        }
    }

    fn parameters(&self) -> &[Parameter] {
        &self.params
    }

    fn parameters_mut(&mut self) -> &mut [Parameter] {
        self.packed_fresh = false;
        &mut self.params
    }

    fn set_derived_cache(&mut self, enabled: bool) {
        self.packing = enabled;
        if !enabled {
            self.packed = None;
            self.packed_fresh = false;
        }
    }

    fn refresh(&mut self) -> Result<()> {
        self.packed_fresh = false;
        let weight = &self.params[0].value;
        // The strips are a layout of the CPU GEMM: only f32 weights in host memory have them.
        if !self.packing || weight.dtype() != conveyor_engine::DType::F32 || !matches!(weight.device(), Device::Cpu(_))
        {
            self.packed = None;
            return Ok(());
        }
        let reusable = self.packed.as_ref().is_some_and(|p| p.forward.device().same_device(weight.device()));
        if !reusable {
            self.packed = None; // free the old buffers before reserving new ones
            let (n_in, n_out) = (self.in_features, self.out_features);
            self.packed = Some(PackedWeight {
                forward: zeros_f32([packed::packed_len(n_in, n_out)], weight.device())?,
                backward_input: zeros_f32([packed::packed_len(n_out, n_in)], weight.device())?,
            });
        }
        let packed_weight = self.packed.as_mut().expect("allocated above");
        let weight_view = MatRef::row_major(weight.as_f32()?, self.out_features, self.in_features)?;
        packed::pack_rhs(weight_view.t(), packed_weight.forward.as_f32_mut()?)?;
        packed::pack_rhs(weight_view, packed_weight.backward_input.as_f32_mut()?)?;
        self.packed_fresh = true;
        Ok(())
    }

    fn forward(&self, inputs: &[&Tensor], ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        expect_inputs("Linear", inputs, 1)?;
        let input = inputs[0];
        let rows = self.input_rows(input.shape())?;
        check_same_device("Linear", input, self.weight())?;
        let (k, n) = (self.in_features, self.out_features);
        let output_dims = self.output_dims(input.shape());
        let dtype = ctx.precision.matmul_dtype(input.dtype());
        if dtype != DType::F32 {
            // Autocast: input, weight and bias rounded to the half type, f32 accumulation, the
            // output stored in the half type; the rounded input is what backward reads.
            let x = Precision::round_operand(input, dtype)?;
            let weight = Precision::round_operand(self.weight(), dtype)?;
            let bias = self.bias().map(|b| Precision::round_operand(b, dtype)).transpose()?;
            let output = Tensor::matmul(
                Matrix::new(&x, rows, k)?,
                Matrix::new(&weight, n, k)?.t(),
                bias.as_ref(),
                output_dims,
                input.device(),
            )?;
            return Ok((into_dtype(output, dtype)?, Saved { tensors: vec![x] }));
        }
        let output = match self.packed.as_ref().filter(|_| self.packed_fresh).filter(|_| rows_gemm::suits(rows, k, n)) {
            // f32 weights in host memory, refreshed, at a micro-batch size: the product reads the
            // strips in place (the same bits as from the weight itself).
            Some(packed_weight) => {
                let x = values(input);
                let bias = self.bias().map(values);
                let x_view = MatRef::row_major(&x, rows, k)?;
                let strips = packed_weight.forward.as_f32()?;
                // Every element is written: the bias pre-fill (which the product then accumulates
                // onto, so there is no second pass over y) or the product alone. No zero-fill first.
                Tensor::from_f32_init(output_dims, input.device(), |dst| match &bias {
                    Some(bias) => {
                        let dst = uninit::broadcast_rows(bias, dst)?;
                        packed::matmul_packed(dst, x_view, strips, k, n, true)?;
                        Ok(dst)
                    }
                    None => packed::matmul_packed_uninit(dst, x_view, strips, k, n),
                })?
            }
            // Any other weight, on any device: `x · weightᵀ (+ bias)` as a device op.
            None => Tensor::matmul(
                Matrix::new(input, rows, k)?,
                Matrix::new(self.weight(), n, k)?.t(),
                self.bias(),
                output_dims,
                input.device(),
            )?,
        };
        let saved = Saved { tensors: vec![input.share()] };
        Ok((into_dtype(output, input.dtype())?, saved))
    }

    fn backward_input_for(&self, saved: &Saved, grad_output: &Tensor, needed: &[bool]) -> Result<Vec<Option<Tensor>>> {
        if needed.first().copied().unwrap_or(true) {
            return self.backward_input(saved, grad_output);
        }
        // The input takes no gradient (the data): check the shapes, skip the product.
        let input = saved_tensor("Linear", saved, 0)?;
        self.input_rows(input.shape())?;
        check_grad_shape("Linear", grad_output, &Shape::new(self.output_dims(input.shape())))?;
        Ok(vec![None])
    }

    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let input = saved_tensor("Linear", saved, 0)?;
        let rows = self.input_rows(input.shape())?;
        check_grad_shape("Linear", grad_output, &Shape::new(self.output_dims(input.shape())))?;
        // dx [rows, in] = dy [rows, out] · weight [out, in]
        let (k, n) = (self.out_features, self.in_features);
        if input.dtype() != DType::F32 {
            // A half saved input: the forward ran in that type, and so does this product.
            let grad = Precision::round_operand(grad_output, input.dtype())?;
            let weight = Precision::round_operand(self.weight(), input.dtype())?;
            let grad_input = Tensor::matmul(
                Matrix::new(&grad, rows, k)?,
                Matrix::new(&weight, k, n)?,
                None,
                input.shape().clone(),
                input.device(),
            )?;
            return Ok(vec![Some(into_dtype(grad_input, input.dtype())?)]);
        }
        let grad_input =
            match self.packed.as_ref().filter(|_| self.packed_fresh).filter(|_| rows_gemm::suits(rows, k, n)) {
                Some(packed_weight) => {
                    let grad = values(grad_output);
                    let grad_view = MatRef::row_major(&grad, rows, k)?;
                    let strips = packed_weight.backward_input.as_f32()?;
                    Tensor::from_f32_init(input.shape().clone(), input.device(), |dst| {
                        packed::matmul_packed_uninit(dst, grad_view, strips, k, n)
                    })?
                }
                None => Tensor::matmul(
                    Matrix::new(grad_output, rows, k)?,
                    Matrix::new(self.weight(), k, n)?,
                    None,
                    input.shape().clone(),
                    input.device(),
                )?,
            };
        Ok(vec![Some(into_dtype(grad_input, input.dtype())?)])
    }

    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()> {
        check_param_grads("Linear", &self.params, param_grads)?;
        let input = saved_tensor("Linear", saved, 0)?;
        let rows = self.input_rows(input.shape())?;
        check_grad_shape("Linear", grad_output, &Shape::new(self.output_dims(input.shape())))?;
        let (weight_grad, bias_grad) = param_grads.split_at_mut(1);
        // A half saved input: the output gradient is rounded to its type too (autocast's product
        // operands), accumulated in f32 into the f32 gradient.
        let rounded;
        let grad_output = if input.dtype() != DType::F32 && grad_output.dtype() != input.dtype() {
            rounded = Precision::round_operand(grad_output, input.dtype())?;
            &rounded
        } else {
            grad_output
        };
        // dweight [out, in] += dyᵀ [out, rows] · x [rows, in]
        let grad_t = Matrix::new(grad_output, rows, self.out_features)?.t();
        weight_grad[0].matmul_accumulate(grad_t, Matrix::new(input, rows, self.in_features)?)?;
        if let Some(bias_grad) = bias_grad.first_mut() {
            bias_grad.accumulate_column_sums(grad_output)?;
        }
        Ok(())
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let output = self.output_shape(input_shapes)?;
        let positions = (input_shapes[0].numel() / self.in_features) as u64;
        let (n_in, n_out) = (self.in_features as u64, self.out_features as u64);
        let bias_flops = if self.bias().is_some() { positions * n_out } else { 0 };
        let param_count: usize = self.params.iter().map(|p| p.value.numel()).sum();
        Ok(LayerCost {
            // The two packed weight copies (f32 weights; see the `packed` field).
            workspace_bytes: if self.weight().dtype() == conveyor_engine::DType::F32 {
                4 * (packed::packed_len(self.in_features, self.out_features)
                    + packed::packed_len(self.out_features, self.in_features)) as u64
            } else {
                0
            },
            forward_flops_per_sample: 2 * positions * n_in * n_out + bias_flops,
            backward_input_flops_per_sample: 2 * positions * n_in * n_out,
            backward_weight_flops_per_sample: 2 * positions * n_in * n_out + bias_flops,
            param_bytes: f32_bytes(param_count),
            activation_bytes_per_sample: f32_bytes(input_shapes[0].numel()),
            output_bytes_per_sample: f32_bytes(output.numel()),
            backward_held_bytes_per_sample: 0,
            gpu_scratch_bytes_per_sample: Default::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use conveyor_engine::cpu::packed;
    use conveyor_engine::{Device, ForwardCtx, Layer, init};

    use super::Linear;

    /// Without its packed copies (dropped by the memory plan) a Linear reserves no bytes for them
    /// on its device, and its products give the same values: the packed strips are a layout of
    /// the same weight, and both paths sum each product in the same order.
    #[test]
    fn dropping_the_packed_copies_frees_them_and_keeps_the_results() {
        let device = Device::cpu(0);
        let mut rng = init::rng(7);
        let (n_in, n_out, rows) = (300, 200, 70);
        let mut cached = Linear::new(n_in, n_out, true, &mut rng).unwrap();
        let mut plain = Linear::from_parameters(
            cached.weight().try_clone().unwrap(),
            cached.bias().map(|b| b.try_clone().unwrap()),
        )
        .unwrap();
        cached.set_derived_cache(true);
        cached.to_device(&device).unwrap();
        let with_cache = device.memory_in_use();
        plain.set_derived_cache(false);
        plain.to_device(&device).unwrap();
        let packed_bytes = 4 * (packed::packed_len(n_in, n_out) + packed::packed_len(n_out, n_in)) as u64;
        assert_eq!(device.memory_in_use() - with_cache, with_cache - packed_bytes, "parameters only");
        let x = init::uniform([rows, n_in], -1.0, 1.0, &mut rng, &device).unwrap();
        let (a, saved_a) = cached.forward(&[&x], &ForwardCtx::eval()).unwrap();
        let (b, saved_b) = plain.forward(&[&x], &ForwardCtx::eval()).unwrap();
        assert!(a.bit_eq(&b), "the forward is the same bit for bit");
        let dy = init::uniform([rows, n_out], -1.0, 1.0, &mut rng, &device).unwrap();
        let da = cached.backward_input(&saved_a, &dy).unwrap().remove(0).unwrap();
        let db = plain.backward_input(&saved_b, &dy).unwrap().remove(0).unwrap();
        assert!(da.bit_eq(&db), "the input gradient is the same bit for bit");
        // Enabled again, the next refresh rebuilds them.
        let before = device.memory_in_use();
        plain.set_derived_cache(true);
        plain.refresh().unwrap();
        assert_eq!(device.memory_in_use() - before, packed_bytes);
    }
}
