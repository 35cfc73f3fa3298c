//! `VocabParallelEmbedding`: an `Embedding` whose table is split by vocabulary rows over `k`
//! devices (Megatron's `VocabParallelEmbedding`): each device looks up the ids in its range, gives
//! rows of zeros for the others, and one all-reduce sums the shards' outputs.
use conveyor_engine::collective::{Partition, Traffic};
use conveyor_engine::{Device, Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor};

use super::exchange::{grads_per_rank, input_for_shard};
use super::group::{ShardGroup, Shards};
use super::{check_saved_replicated_dims, gather_rows, load_shard, shard_rows, split_features};
use crate::Embedding;
use crate::tensor_io::{check_grad_shape, check_param_grads, expect_inputs, expect_shapes, f32_bytes};

const KIND: &str = "VocabParallelEmbedding";

/// [`Embedding`] (PyTorch's `nn.Embedding`) with `weight` `[vocab, dim]` split by rows: device `r`
/// holds the rows of ids `parts.range(r)` (a vocabulary not divisible by `k` is split like
/// `torch.tensor_split`, the first `vocab % k` devices one row more: no padding, so the
/// checkpoint keeps the true vocabulary). Each id's row comes from exactly one device and the
/// others add zeros, so the all-reduced output has the unsplit table's bits, and each row's
/// gradient is summed in the unsplit order: the split trains bit for bit what one device trains.
///
/// Exchanges per call: forward broadcasts the ids and all-reduces the output; `backward_weight`
/// broadcasts `dy` (with one shard per rank, every rank has both already). The ids take no
/// gradient, so `backward_input` exchanges nothing.
///
/// `parameters()` is rank-major over the shards held here: each shard's `weight` rows.
#[derive(Debug)]
pub struct VocabParallelEmbedding {
    vocab: usize,
    dim: usize,
    parts: Partition,
    params: Vec<Parameter>,
    group: ShardGroup,
}

impl VocabParallelEmbedding {
    /// `embedding`'s table split by rows over `devices`.
    pub fn from_embedding(embedding: &Embedding, devices: &[Device]) -> Result<Self> {
        VocabParallelEmbedding::from_embedding_on(embedding, &Shards::Local(devices.to_vec()))
    }

    /// `embedding`'s table split as `shards` says (all shards here, or this rank's one).
    pub fn from_embedding_on(embedding: &Embedding, shards: &Shards) -> Result<Self> {
        let group = ShardGroup::new(KIND, shards)?;
        let (vocab, dim) = (embedding.num_embeddings(), embedding.dim());
        let parts = split_features(KIND, "num_embeddings", vocab, group.k())?;
        let weight = &embedding.parameters()[0].value;
        let mut params = Vec::new();
        for (rank, device) in group.local_devices() {
            let range = parts.range(rank);
            let value = shard_rows(weight, range.clone(), [range.len(), dim], device)?;
            params.push(Parameter { name: "weight".into(), value });
        }
        Ok(VocabParallelEmbedding { vocab, dim, parts, params, group })
    }

    /// Vocabulary rows per device.
    pub fn partition(&self) -> &Partition {
        &self.parts
    }

    /// The devices of the shards held here, in shard order; inputs arrive on and outputs leave
    /// from the first.
    pub fn devices(&self) -> &[Device] {
        self.group.devices()
    }

    /// Messages and bytes each device (in rank order) has sent in this layer's collectives.
    pub fn traffic(&self) -> Vec<Traffic> {
        self.group.traffic()
    }

    fn weight(&self, rank: usize) -> &Tensor {
        &self.params[self.group.local_index(rank)].value
    }

    fn output_dims(&self, ids: &Shape) -> Vec<usize> {
        let mut dims = ids.dims().to_vec();
        dims.push(self.dim);
        dims
    }

    /// The unsplit table on the host under PyTorch's name, `weight` `[vocab, dim]`. With one shard
    /// per rank this is a collective (an all-gather): every rank of the group calls it.
    pub fn gather_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let shards: Vec<&Tensor> = self.params.iter().map(|p| &p.value).collect();
        let flat = self.parts.scaled(self.dim);
        Ok(vec![("weight".to_string(), gather_rows(&self.group, &shards, &flat, [self.vocab, self.dim])?)])
    }

    /// Splits the unsplit table (`weight`) into the shards, in place.
    pub fn load_unsplit(&mut self, name: &str, value: &Tensor) -> Result<()> {
        if name != "weight" {
            return Err(Error::invalid(format!("{KIND} parameter"), format!("`{name}`: expected weight")));
        }
        if value.dims() != [self.vocab, self.dim] {
            return Err(Error::shape(
                format!("{KIND} weight"),
                format!("[{}, {}]", self.vocab, self.dim),
                value.shape().to_string(),
            ));
        }
        for rank in self.group.local() {
            let range = self.parts.range(rank);
            let at = self.group.local_index(rank);
            load_shard(&mut self.params[at].value, value.narrow_rows(range.start, range.len())?)?;
        }
        Ok(())
    }
}

impl Layer for VocabParallelEmbedding {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn takes_indices(&self) -> bool {
        true
    }

    fn index_count(&self) -> usize {
        self.vocab
    }

    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        Ok(Shape::new(self.output_dims(&expect_shapes(KIND, input_shapes, 1)?[0])))
    }

    fn parameters(&self) -> &[Parameter] {
        &self.params
    }

    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut self.params
    }

    fn forward(&self, inputs: &[&Tensor], _ctx: &ForwardCtx) -> Result<(Tensor, Saved)> {
        expect_inputs(KIND, inputs, 1)?;
        let ids = inputs[0];
        if ids.shape().rank() == 0 {
            return Err(Error::shape(
                KIND,
                "ids with a batch dimension, e.g. [batch, tokens]",
                ids.shape().to_string(),
            ));
        }
        self.group.check_input(KIND, ids)?;
        let replicated = self.group.inputs_replicated();
        let results = self.group.run(vec![(); self.group.n_local()], |rank, comm, ()| {
            let device = self.group.device(rank);
            let ids = input_for_shard(comm, ids, device, replicated)?;
            let mut y = self.weight(rank).embedding_shard(&ids, self.parts.range(rank).start, self.vocab)?;
            comm.all_reduce_tensor(&mut y)?;
            Ok((ids, self.group.returns_output(rank).then_some(y)))
        })?;
        let mut tensors = Vec::with_capacity(results.len());
        let mut output = None;
        for (ids, y) in results {
            tensors.push(ids);
            output = output.or(y);
        }
        let output = output.ok_or_else(|| Error::invalid(KIND, "rank 0 returned no output"))?;
        Ok((output, Saved { tensors }))
    }

    fn backward_input(&self, _saved: &Saved, _grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![None])
    }

    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()> {
        check_param_grads(KIND, &self.params, param_grads)?;
        let ids_shape = check_saved_replicated_dims(KIND, saved, self.group.n_local())?;
        check_grad_shape(KIND, grad_output, &Shape::new(self.output_dims(&ids_shape)))?;
        self.group.check_input(KIND, grad_output)?;
        let grads = grads_per_rank(param_grads, &vec![1; self.group.n_local()])?;
        let replicated = self.group.inputs_replicated();
        self.group.run(grads, |rank, comm, grads| {
            let device = self.group.device(rank);
            let dy = input_for_shard(comm, grad_output, device, replicated)?;
            let ids = &saved.tensors[self.group.local_index(rank)];
            dy.embedding_shard_grad_accumulate(ids, self.parts.range(rank).start, self.vocab, &mut grads[0])
        })?;
        Ok(())
    }

    fn weight_pass_scratch_bytes(&self) -> u64 {
        // Each shard sums its rows apart before adding them (as `Embedding`), at most its table.
        f32_bytes(self.parts.max_len() * self.dim)
    }

    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let output = self.output_shape(input_shapes)?;
        Ok(LayerCost {
            workspace_bytes: 0,
            forward_flops_per_sample: output.numel() as u64,
            backward_input_flops_per_sample: 0,
            backward_weight_flops_per_sample: output.numel() as u64,
            param_bytes: f32_bytes(self.vocab * self.dim),
            // Every shard's copy of the ids.
            activation_bytes_per_sample: f32_bytes(self.group.k() * input_shapes[0].numel()),
            output_bytes_per_sample: f32_bytes(output.numel()),
            backward_held_bytes_per_sample: 0,
            gpu_scratch_bytes_per_sample: Default::default(),
        })
    }

    fn to_device(&mut self, device: &Device) -> Result<()> {
        self.group.to_device(KIND, device)
    }

    fn export_parameter_shapes(&self) -> Vec<(String, Shape)> {
        vec![("weight".to_string(), Shape::new([self.vocab, self.dim]))]
    }

    /// The unsplit table ([`Self::gather_parameters`]).
    fn export_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        self.gather_parameters()
    }

    /// Splits the unsplit table into the shards ([`Self::load_unsplit`]).
    fn import_parameter(&mut self, name: &str, value: &Tensor) -> Result<()> {
        self.load_unsplit(name, value)
    }

    fn collective_traffic(&self) -> Vec<Traffic> {
        self.group.traffic()
    }

    fn recover_collectives(&self) -> Result<()> {
        self.group.recover()
    }
}
