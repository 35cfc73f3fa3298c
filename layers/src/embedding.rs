//! `Embedding`: a lookup table mapping integer ids (carried in an f32 tensor) to rows of `weight`
//! (PyTorch's `nn.Embedding`, weight `[num_embeddings, dim]` drawn from N(0, 1)). It computes
//! through the engine's device ops ([`Tensor::embedding`], [`Tensor::embedding_grad_accumulate`]),
//! so it runs on CPUs and GPUs alike (on a GPU the ids are downloaded to be checked).
use conveyor_engine::{Device, Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor, init};
use rand::rngs::StdRng;

use crate::tensor_io::{
    check_grad_shape, check_param_grads, check_same_device, expect_inputs, expect_shapes, f32_bytes, into_dtype,
    largest_parameter_bytes, saved_tensor,
};

/// Lookup of rows of `weight` `[num_embeddings, dim]`: input ids `[B, T]` (f32 holding integers in
/// `0..num_embeddings`, exact below 2^24) give output `[B, T, dim]` in the weight's dtype. Ids get
/// no gradient (`None`); the weight gradient adds each output-gradient row onto the row of its id.
/// Saves the ids.
#[derive(Debug)]
pub struct Embedding {
    num_embeddings: usize,
    dim: usize,
    params: Vec<Parameter>,
}

impl Embedding {
    /// A table with PyTorch's default initialisation N(0, 1), on the host.
    pub fn new(num_embeddings: usize, dim: usize, rng: &mut StdRng) -> Result<Embedding> {
        Embedding::from_parameters(init::normal([num_embeddings, dim], 1.0, rng, &Device::host())?)
    }

    /// A table from a given `weight` `[num_embeddings, dim]`.
    pub fn from_parameters(weight: Tensor) -> Result<Embedding> {
        let &[num_embeddings, dim] = weight.dims() else {
            return Err(Error::shape("Embedding weight", "[num_embeddings, dim]", weight.shape().to_string()));
        };
        if num_embeddings == 0 || dim == 0 {
            return Err(Error::shape(
                "Embedding weight",
                "[num_embeddings, dim] with both at least 1",
                weight.shape().to_string(),
            ));
        }
        if num_embeddings > 1 << 24 {
            return Err(Error::invalid(
                "Embedding num_embeddings",
                format!("{num_embeddings} exceeds 2^24, beyond which f32 ids are not exact"),
            ));
        }
        Ok(Embedding { num_embeddings, dim, params: vec![Parameter { name: "weight".into(), value: weight }] })
    }

    /// Number of rows in the table.
    pub fn num_embeddings(&self) -> usize {
        self.num_embeddings
    }

    /// Width of each row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    fn output_dims(&self, ids: &Shape) -> Vec<usize> {
        let mut dims = ids.dims().to_vec();
        dims.push(self.dim);
        dims
    }
}

impl Layer for Embedding {
    fn kind(&self) -> &'static str {
        "Embedding"
    }

    fn takes_indices(&self) -> bool {
        true
    }

    fn index_count(&self) -> usize {
        self.num_embeddings
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        Ok(Shape::new(self.output_dims(&expect_shapes("Embedding", input_shapes, 1)?[0])))
    }

    fn parameters(&self) -> &[Parameter] {
        &self.params
    }

    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut self.params
    }

    fn forward(&self, inputs: &[&Tensor], _ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        expect_inputs("Embedding", inputs, 1)?;
        let ids = inputs[0];
        if ids.shape().rank() == 0 {
            return Err(Error::shape(
                "Embedding",
                "ids with a batch dimension, e.g. [batch, tokens]",
                ids.shape().to_string(),
            ));
        }
        let weight = &self.params[0].value;
        check_same_device("Embedding", ids, weight)?;
        let output = into_dtype(weight.embedding(ids)?, weight.dtype())?;
        Ok((output, Saved { tensors: vec![ids.share()] }))
    }

    fn backward_input(&self, _saved: &Saved, _grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![None])
    }

    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()> {
        check_param_grads("Embedding", &self.params, param_grads)?;
        let ids = saved_tensor("Embedding", saved, 0)?;
        check_grad_shape("Embedding", grad_output, &Shape::new(self.output_dims(ids.shape())))?;
        // This micro-batch's rows are summed per id on their own, then added: the same bits
        // however the batch is cut into micro-batches and replicas.
        grad_output.embedding_grad_accumulate(ids, &mut param_grads[0])
    }

    fn weight_pass_scratch_bytes(&self) -> u64 {
        // The CPU sums each parameter's part apart, one parameter at a time.
        largest_parameter_bytes(&self.params)
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let output = self.output_shape(input_shapes)?;
        Ok(LayerCost {
            workspace_bytes: 0,
            forward_flops_per_sample: 0,
            backward_input_flops_per_sample: 0,
            backward_weight_flops_per_sample: output.numel() as u64,
            param_bytes: f32_bytes(self.num_embeddings * self.dim),
            activation_bytes_per_sample: f32_bytes(input_shapes[0].numel()),
            output_bytes_per_sample: f32_bytes(output.numel()),
            backward_held_bytes_per_sample: 0,
            gpu_scratch_bytes_per_sample: Default::default(),
        })
    }
}
