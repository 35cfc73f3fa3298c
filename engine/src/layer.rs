//! The `Layer` trait: what the graph, the placement planner and the pipeline runtime need from a
//! layer (the `Loss` trait is in `loss.rs`). Concrete layers live in `conveyor-layers`; the engine
//! never names one.
//!
//! The backward pass is two calls, [`Layer::backward_input`] and [`Layer::backward_weight`], so
//! zero-bubble schedules can run them at different times.
use crate::{Device, Result, Shape, Tensor};

/// A named parameter, with the name PyTorch's module would give it (`weight`, `bias`).
#[derive(Debug)]
pub struct Parameter {
    /// The name within the layer, e.g. `weight`.
    pub name: String,
    /// The value, in PyTorch's layout (Linear weight `[out, in]`).
    pub value: Tensor,
}

/// What a forward pass keeps for its backward pass.
#[derive(Debug, Default)]
pub struct Saved {
    /// Tensors (inputs, masks, statistics), counted against their device's budget while held.
    pub tensors: Vec<Tensor>,
}

impl Saved {
    /// Bytes held by the saved tensors.
    pub fn size_in_bytes(&self) -> usize {
        self.tensors.iter().map(Tensor::size_in_bytes).sum()
    }
}

/// Per-call context of a forward pass.
#[derive(Clone, Copy, Debug)]
pub struct ForwardCtx {
    /// Training mode (dropout active) or evaluation.
    pub training: bool,
    /// Seed for any randomness (dropout masks); the same seed reproduces the same mask, which is
    /// what makes activation recomputation exact.
    pub seed: u64,
}

impl ForwardCtx {
    /// Training mode with the given seed.
    pub fn train(seed: u64) -> Self {
        ForwardCtx { training: true, seed }
    }

    /// Evaluation mode.
    pub fn eval() -> Self {
        ForwardCtx { training: false, seed: 0 }
    }
}

/// Cost estimates of a layer for given input shapes (per sample, without the batch dimension).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LayerCost {
    /// Floating-point operations of the forward pass per sample.
    pub forward_flops_per_sample: u64,
    /// Floating-point operations of the input-gradient pass per sample.
    pub backward_input_flops_per_sample: u64,
    /// Floating-point operations of the weight-gradient pass per sample.
    pub backward_weight_flops_per_sample: u64,
    /// Bytes of parameters (f32).
    pub param_bytes: u64,
    /// Bytes the forward pass saves for backward, per sample.
    pub activation_bytes_per_sample: u64,
    /// Bytes of the output, per sample.
    pub output_bytes_per_sample: u64,
    /// Bytes the layer keeps beside its parameters, derived from them (e.g. Linear's transposed
    /// weight for the fast GEMM layout), independent of the batch.
    pub workspace_bytes: u64,
}

/// A differentiable layer. Shapes passed to [`Layer::output_shape`] and [`Layer::cost`] are per
/// sample (no batch dimension); tensors passed to forward and backward carry the batch first.
pub trait Layer: Send + std::fmt::Debug {
    /// The layer's kind, e.g. `Linear`.
    fn kind(&self) -> &'static str;

    /// How many inputs the layer takes (1 for most; 2 for residual Add).
    fn n_inputs(&self) -> usize {
        1
    }

    /// Whether the layer's inputs are integer ids carried as f32 (token ids for an embedding),
    /// not values: code that runs a layer on made-up inputs (the profiler, the memory probe)
    /// feeds such a layer zeros, an id every table has. Default: false.
    fn takes_indices(&self) -> bool {
        false
    }

    /// The per-sample output shape for per-sample input shapes, or a shape error naming what was expected.
    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape>;

    /// The parameters, in PyTorch's order.
    fn parameters(&self) -> &[Parameter];

    /// The parameters, mutable (for optimizers and checkpoint loading).
    fn parameters_mut(&mut self) -> &mut [Parameter];

    /// Forward pass on a batch; returns the output and what backward needs.
    fn forward(&self, inputs: &[&Tensor], ctx: &ForwardCtx) -> Result<(Tensor, Saved)>;

    /// Gradients with respect to each input (`None` for inputs that take no gradient).
    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>>;

    /// [`Layer::backward_input`] for the inputs whose `needed` entry is true; the others get
    /// `None`. The runtime passes false for inputs nothing upstream consumes (a graph input such
    /// as the data), as PyTorch skips inputs that do not require a gradient. The default computes
    /// every gradient and drops the unneeded ones; layers whose input gradient costs real work
    /// (`Linear`, `Conv2d`) override it to skip that work. Results for needed inputs are the same
    /// bit for bit either way.
    fn backward_input_for(&self, saved: &Saved, grad_output: &Tensor, needed: &[bool]) -> Result<Vec<Option<Tensor>>> {
        let mut grads = self.backward_input(saved, grad_output)?;
        for (grad, &needed) in grads.iter_mut().zip(needed) {
            if !needed {
                *grad = None;
            }
        }
        Ok(grads)
    }

    /// Adds the gradients with respect to the parameters into `param_grads` (aligned with
    /// [`Layer::parameters`]). Layers without parameters do nothing.
    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()>;

    /// Cost estimates for per-sample input shapes.
    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost>;

    /// Rebuilds state derived from the parameters (such as a transposed copy of a weight kept
    /// for a faster GEMM layout). The runtime calls it after every optimizer step and parameter
    /// load; a layer must stay correct without it (a layer whose parameters were handed out by
    /// [`Layer::parameters_mut`] drops derived state until it is refreshed).
    fn refresh(&mut self) -> Result<()> {
        Ok(())
    }

    /// Whether the layer keeps the state [`Layer::refresh`] derives from its parameters (such as
    /// Linear's packed weights, [`LayerCost::workspace_bytes`]): with `false` it frees that state
    /// now and derives none until enabled again (the next refresh rebuilds it), running a little
    /// slower without it. The planner drops caches that do not fit a device's budget; results
    /// are the same either way. Default: nothing to keep, nothing to do.
    fn set_derived_cache(&mut self, enabled: bool) {
        let _ = enabled;
    }

    /// Moves the parameters onto `device` (counted against its budget), then refreshes.
    ///
    /// A layer whose parameters live on several devices (a tensor-parallel layer) keeps them
    /// there and accepts only the first device of its group, where its inputs arrive and its
    /// outputs leave: that device is the device of the stage holding it.
    fn to_device(&mut self, device: &Device) -> Result<()> {
        for param in self.parameters_mut() {
            param.value = param.value.to_device(device)?;
        }
        self.refresh()
    }

    /// The names and shapes of the tensors [`Layer::export_parameters`] returns, in its order,
    /// without copying anything (for checkpoints' name lists).
    ///
    /// Default: [`Layer::parameters`]. A layer whose [`Layer::parameters`] are shards of larger
    /// tensors overrides this and the two methods below to give the unsplit tensors, so a
    /// checkpoint does not depend on how the layer is split.
    fn export_parameter_shapes(&self) -> Vec<(String, Shape)> {
        self.parameters().iter().map(|p| (p.name.clone(), p.value.shape().clone())).collect()
    }

    /// The parameters as checkpoints store them, copied to the host under PyTorch's names.
    ///
    /// Default: every [`Layer::parameters`] entry copied to the host.
    fn export_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let host = Device::host();
        self.parameters().iter().map(|p| Ok((p.name.clone(), p.value.to_device(&host)?))).collect()
    }

    /// Sets the parameter `name` (a name [`Layer::export_parameters`] gives) from `value`, which
    /// may live on any device and is converted to the parameter's dtype. The caller refreshes.
    ///
    /// Default: copies into the [`Layer::parameters`] entry of that name (same shape required).
    fn import_parameter(&mut self, name: &str, value: &Tensor) -> Result<()> {
        let kind = self.kind();
        let param = self.parameters_mut().iter_mut().find(|p| p.name == name).ok_or_else(|| {
            crate::Error::invalid(
                format!("{kind} parameter"),
                format!("`{name}`: the layer has no parameter of that name"),
            )
        })?;
        if value.shape() != param.value.shape() {
            return Err(crate::Error::shape(
                format!("parameter `{name}`"),
                param.value.shape().to_string(),
                value.shape().to_string(),
            ));
        }
        let converted = value.to_dtype(param.value.dtype())?;
        param.value.copy_from(&converted)
    }

    /// What each device of a split layer has sent in its collectives since the layer was built
    /// (rank order); empty for a layer on one device (the default).
    fn collective_traffic(&self) -> Vec<crate::collective::Traffic> {
        Vec::new()
    }
}
