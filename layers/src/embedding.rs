//! `Embedding`: a lookup table mapping integer ids (carried in an f32 tensor) to rows of `weight`
//! (PyTorch's `nn.Embedding`, weight `[num_embeddings, dim]` drawn from N(0, 1)).
use conveyor_engine::{Device, Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor, init};
use rand::rngs::StdRng;

use crate::tensor_io::{
    add_rows_into, check_grad_shape, check_param_grads, check_same_device, expect_inputs, expect_shapes, f32_bytes,
    largest_parameter_bytes, saved_tensor, tensor_from_f32, values,
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

    /// The ids as indices, or an error naming the first id that is not an integer in range.
    fn indices(&self, ids: &Tensor) -> Result<Vec<usize>> {
        values(ids)
            .iter()
            .enumerate()
            .map(|(position, &id)| {
                if id.fract() == 0.0 && id >= 0.0 && (id as usize) < self.num_embeddings {
                    Ok(id as usize)
                } else {
                    Err(Error::invalid(
                        "Embedding ids",
                        format!("id {id} at flat position {position} is not an integer in 0..{}; pass integer-valued ids below num_embeddings", self.num_embeddings),
                    ))
                }
            })
            .collect()
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
        let indices = self.indices(ids)?;
        let table = values(weight);
        let mut output = Vec::with_capacity(indices.len() * self.dim);
        for &index in &indices {
            output.extend_from_slice(&table[index * self.dim..(index + 1) * self.dim]);
        }
        let output = tensor_from_f32(output, self.output_dims(ids.shape()), weight.dtype(), ids.device())?;
        Ok((output, Saved { tensors: vec![ids.share()] }))
    }

    fn backward_input(&self, _saved: &Saved, _grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![None])
    }

    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()> {
        check_param_grads("Embedding", &self.params, param_grads)?;
        let ids = saved_tensor("Embedding", saved, 0)?;
        check_grad_shape("Embedding", grad_output, &Shape::new(self.output_dims(ids.shape())))?;
        let indices = self.indices(ids)?;
        let grad = values(grad_output);
        // This micro-batch's rows summed per id on their own (ids in order of first appearance),
        // then added: the same bits however the batch is cut into micro-batches and replicas (see
        // `accumulate_into`), with a buffer for the ids present rather than the whole table.
        let mut slot_of: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
        let mut ids = Vec::new();
        let slots: Vec<usize> = indices
            .iter()
            .map(|&index| {
                *slot_of.entry(index).or_insert_with(|| {
                    ids.push(index);
                    ids.len() - 1
                })
            })
            .collect();
        let mut part = Tensor::zeros([ids.len(), self.dim], conveyor_engine::DType::F32, grad_output.device())?;
        let sums = part.as_f32_mut()?;
        for (&slot, row) in slots.iter().zip(grad.chunks_exact(self.dim)) {
            sums[slot * self.dim..(slot + 1) * self.dim].iter_mut().zip(row).for_each(|(d, &g)| *d += g);
        }
        let sums = part.as_f32()?;
        let dim = self.dim;
        add_rows_into(&mut param_grads[0], |dst| {
            for (slot, &index) in ids.iter().enumerate() {
                dst[index * dim..(index + 1) * dim]
                    .iter_mut()
                    .zip(&sums[slot * dim..(slot + 1) * dim])
                    .for_each(|(d, &s)| *d += s);
            }
            Ok(())
        })
    }

    fn weight_pass_scratch_bytes(&self) -> u64 {
        // `accumulate_into` sums each parameter's part apart, one parameter at a time.
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
        })
    }
}
