//! The `Layer` trait: what the graph, the placement planner and the pipeline runtime need from a
//! layer (the `Loss` trait is in `loss.rs`). Concrete layers live in `conveyor-layers`; the engine
//! never names one.
//!
//! The backward pass is two calls, [`Layer::backward_input`] and [`Layer::backward_weight`], so
//! zero-bubble schedules can run them at different times. A layer may instead implement the one
//! combined [`Layer::backward`]; each side has defaults in terms of the other (see
//! [`Layer::backward`] for the rule and its cost).
//!
//! A custom layer needs only `forward` and one backward: every other method has a default (its
//! kind from its type name, a shape-preserving `output_shape`, no parameters, a cost estimate).
//!
//! ```
//! use conveyor_engine::{DType, ForwardCtx, Layer, Parameter, Result, Saved, Tensor};
//!
//! /// LayerScale (CaiT): `y = x * gamma`, one learned factor per feature.
//! #[derive(Debug)]
//! struct LayerScale(Vec<Parameter>);
//!
//! impl Layer for LayerScale {
//!     fn parameters(&self) -> &[Parameter] { &self.0 }
//!     fn parameters_mut(&mut self) -> &mut [Parameter] { &mut self.0 }
//!     fn forward(&self, x: &[&Tensor], _: &ForwardCtx) -> Result<(Tensor, Saved)> {
//!         Ok((x[0].mul_rows(&self.0[0].value)?, Saved { tensors: vec![x[0].share()] }))
//!     }
//!     fn backward(&self, saved: &Saved, grad: &Tensor, param_grads: &mut [Tensor]) -> Result<Vec<Option<Tensor>>> {
//!         param_grads[0].accumulate_column_sums(&saved.tensors[0].mul(grad)?)?;
//!         Ok(vec![Some(grad.mul_rows(&self.0[0].value)?)])
//!     }
//! }
//!
//! let gamma = Tensor::full(0.1, [4], DType::F32, &conveyor_engine::Device::host())?;
//! let layer = LayerScale(vec![Parameter { name: "gamma".into(), value: gamma }]);
//! assert_eq!(layer.kind(), "LayerScale");
//! # Ok::<(), conveyor_engine::Error>(())
//! ```
use std::cell::RefCell;

use crate::{Device, Error, Result, Shape, Tensor};

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
    /// The autocast policy: which dtype products compute and store in
    /// ([`crate::Precision`]; f32 unless the trainer runs mixed precision).
    pub precision: crate::Precision,
}

impl ForwardCtx {
    /// Training mode with the given seed.
    pub fn train(seed: u64) -> Self {
        ForwardCtx { training: true, seed, precision: crate::Precision::F32 }
    }

    /// Evaluation mode.
    pub fn eval() -> Self {
        ForwardCtx { training: false, seed: 0, precision: crate::Precision::F32 }
    }

    /// The same context under the autocast policy `precision`.
    pub fn with_precision(self, precision: crate::Precision) -> Self {
        ForwardCtx { precision, ..self }
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
    /// Bytes, per sample, that the input-gradient call leaves on the device for the weight
    /// call of the same micro-batch, beyond the saved tensors and the output gradient (e.g. a
    /// gradient both calls need, computed once). The memory plan holds them from the
    /// input-gradient call to the end of the micro-batch's weight pass. Usually 0.
    pub backward_held_bytes_per_sample: u64,
    /// Bytes per sample of the temporary buffers the layer's ops take on a GPU during each call
    /// ([`CallScratch`]); the memory plan adds them to the calls' peaks on GPU devices. 0 for
    /// layers whose GPU ops allocate only what they return.
    pub gpu_scratch_bytes_per_sample: CallScratch,
}

/// Temporary device memory of one layer's three calls (forward, input gradient, weight gradient):
/// buffers an op reserves on the device's ledger and frees before it returns, such as a GPU
/// convolution's batched im2col columns or the per-sample partial gradients it sums
/// deterministically. The CPU kernels keep their scratch in plain host memory, off the ledger,
/// so only GPU ops declare it (`Tensor::conv2d_gpu_scratch` and its neighbours compute it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallScratch {
    /// During the forward call.
    pub forward: u64,
    /// During the input-gradient call.
    pub backward_input: u64,
    /// During the weight-gradient call.
    pub backward_weight: u64,
}

impl CallScratch {
    /// The same scratch times `n` (per sample to per micro-batch), saturating.
    pub fn times(self, n: u64) -> CallScratch {
        CallScratch {
            forward: self.forward.saturating_mul(n),
            backward_input: self.backward_input.saturating_mul(n),
            backward_weight: self.backward_weight.saturating_mul(n),
        }
    }

    /// Each call's larger scratch of `self` and `other` (layers whose calls run one after the
    /// other, so their scratch is never held at once).
    pub fn max(self, other: CallScratch) -> CallScratch {
        CallScratch {
            forward: self.forward.max(other.forward),
            backward_input: self.backward_input.max(other.backward_input),
            backward_weight: self.backward_weight.max(other.backward_weight),
        }
    }
}

/// A differentiable layer. Shapes passed to [`Layer::output_shape`] and [`Layer::cost`] are per
/// sample (no batch dimension); tensors passed to forward and backward carry the batch first.
pub trait Layer: Send + std::fmt::Debug {
    /// The layer's kind, e.g. `Linear`. Default: the type's name without its module path.
    fn kind(&self) -> &'static str {
        let name = std::any::type_name::<Self>();
        // `crate::module::Name<crate::Other>`: the last segment before any generic arguments.
        let base = name.split('<').next().unwrap_or(name);
        base.rsplit("::").next().unwrap_or(base)
    }

    /// How many inputs the layer takes (1 for most; 2 for residual Add).
    fn n_inputs(&self) -> usize {
        1
    }

    /// Whether the layer's inputs are integer ids carried as f32 (token ids for an embedding),
    /// not values: code that runs a layer on made-up inputs feeds such a layer ids below
    /// [`Layer::index_count`] (the profiler zeros, an id every table has; the memory probe every
    /// id in turn, see there). Default: false.
    fn takes_indices(&self) -> bool {
        false
    }

    /// For a layer that [`Layer::takes_indices`]: how many distinct ids it accepts (its table's
    /// rows). The memory probe feeds it `0, 1, 2, ...` modulo this, so that a weight pass whose
    /// buffer grows with the distinct ids it meets (an embedding's rows summed apart,
    /// [`Layer::weight_pass_scratch_bytes`]) is measured at the most a micro-batch can make it
    /// hold; ids all zero would show one row. Default: 1.
    fn index_count(&self) -> usize {
        1
    }

    /// The per-sample output shape for per-sample input shapes, or a shape error naming what was
    /// expected. Default: the first input's shape (a shape-preserving layer).
    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        input_shapes
            .first()
            .cloned()
            .ok_or_else(|| Error::invalid(format!("{} inputs", self.kind()), "no input shape given"))
    }

    /// The parameters, in PyTorch's order. Default: none.
    fn parameters(&self) -> &[Parameter] {
        &[]
    }

    /// The parameters, mutable (for optimizers and checkpoint loading). Default: none; a layer
    /// with parameters implements both this and [`Layer::parameters`].
    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut []
    }

    /// Forward pass on a batch; returns the output and what backward needs.
    fn forward(&self, inputs: &[&Tensor], ctx: &ForwardCtx) -> Result<(Tensor, Saved)>;

    /// Softmax cross-entropy of this layer's output against `labels`, computed where the output's
    /// pieces live, for a layer whose output is split over devices (a vocabulary-parallel output
    /// layer): returns `Σ_rows (logsumexp(z_r) - z_r[label_r]) / normalizer` and what the backward
    /// calls need, without ever gathering the output onto one device. `None`: not offered (the
    /// default), and the runtime runs [`Layer::forward`] and the loss.
    ///
    /// A training step calls it instead of `forward` for the graph's output node when the
    /// trainer's loss is softmax cross-entropy ([`crate::Loss::is_softmax_cross_entropy`]), the
    /// targets are class labels and no other stage consumes the output. The backward calls then
    /// get the saved state this call returned and, as `grad_output`, a `[1]` tensor holding 1
    /// (the loss's gradient with respect to itself; the normalizer already holds any loss scale).
    fn forward_cross_entropy(
        &self,
        inputs: &[&Tensor],
        labels: &[usize],
        normalizer: f32,
        ctx: &ForwardCtx,
    ) -> Option<Result<(f64, Saved)>> {
        let _ = (inputs, labels, normalizer, ctx);
        None
    }

    /// The whole backward pass: returns the gradient with respect to each input (`None` for
    /// inputs that take no gradient) and ADDS the gradients with respect to the parameters into
    /// `param_grads` (aligned with [`Layer::parameters`], on their devices).
    ///
    /// A layer implements either this or the two halves, [`Layer::backward_input`] and
    /// [`Layer::backward_weight`]; each side's default is written in terms of the other:
    /// - this default runs `backward_input`, then `backward_weight`;
    /// - the halves' defaults run this method, `backward_input` with scratch parameter gradients
    ///   it drops, `backward_weight` dropping the input gradients.
    ///
    /// So a layer with only `backward` trains under every schedule, but where a zero-bubble
    /// schedule runs the halves at different times it computes its backward twice; implement the
    /// halves when that cost matters. A layer that implements neither gets
    /// [`Error::BackwardNotImplemented`] (never an endless recursion).
    fn backward(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<Vec<Option<Tensor>>> {
        let _guard = DefaultBackwardGuard::enter(self.kind(), self as *const Self as *const ())?;
        let grads = self.backward_input(saved, grad_output)?;
        self.backward_weight(saved, grad_output, param_grads)?;
        Ok(grads)
    }

    /// Gradients with respect to each input (`None` for inputs that take no gradient).
    ///
    /// Default: [`Layer::backward`] with scratch parameter gradients (zeros like the parameters)
    /// that it drops.
    fn backward_input(&self, saved: &Saved, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let _guard = DefaultBackwardGuard::enter(self.kind(), self as *const Self as *const ())?;
        let mut scratch = self
            .parameters()
            .iter()
            .map(|p| Tensor::zeros(p.value.shape().clone(), p.value.dtype(), p.value.device()))
            .collect::<Result<Vec<_>>>()?;
        self.backward(saved, grad_output, &mut scratch)
    }

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
    ///
    /// Default: nothing for a layer without parameters; otherwise [`Layer::backward`], dropping
    /// the input gradients.
    fn backward_weight(&self, saved: &Saved, grad_output: &Tensor, param_grads: &mut [Tensor]) -> Result<()> {
        if self.parameters().is_empty() {
            return Ok(());
        }
        let _guard = DefaultBackwardGuard::enter(self.kind(), self as *const Self as *const ())?;
        self.backward(saved, grad_output, param_grads).map(drop)
    }

    /// Cost estimates for per-sample input shapes (the planner's FLOP and memory estimates; the
    /// memory plan measures activations by running the layer, so these matter for time balance).
    ///
    /// Default: an elementwise-or-dense guess from the shapes: per sample, a forward of one flop
    /// per output element plus two per parameter element, each backward half the same; the
    /// inputs as saved activations; the parameters' bytes; no workspace.
    fn cost(&self, input_shapes: &[Shape]) -> Result<LayerCost> {
        let output = self.output_shape(input_shapes)?.numel() as u64;
        let param_elements: u64 = self.parameters().iter().map(|p| p.value.numel() as u64).sum();
        let flops = output.saturating_add(param_elements.saturating_mul(2));
        let f32_bytes = crate::DType::F32.size_in_bytes() as u64;
        Ok(LayerCost {
            forward_flops_per_sample: flops,
            backward_input_flops_per_sample: flops,
            backward_weight_flops_per_sample: if param_elements == 0 { 0 } else { flops },
            param_bytes: self.parameters().iter().map(|p| p.value.size_in_bytes() as u64).sum(),
            activation_bytes_per_sample: input_shapes.iter().map(|s| s.numel() as u64 * f32_bytes).sum(),
            output_bytes_per_sample: output * f32_bytes,
            workspace_bytes: 0,
            backward_held_bytes_per_sample: 0,
            gpu_scratch_bytes_per_sample: Default::default(),
        })
    }

    /// Rebuilds state derived from the parameters (such as a transposed copy of a weight kept
    /// for a faster GEMM layout). The runtime calls it after every optimizer step and parameter
    /// load; a layer must stay correct without it (a layer whose parameters were handed out by
    /// [`Layer::parameters_mut`] drops derived state until it is refreshed).
    fn refresh(&mut self) -> Result<()> {
        Ok(())
    }

    /// Whether the layer keeps the state [`Layer::refresh`] derives from its parameters (such as
    /// Linear's packed weights, [`LayerCost::workspace_bytes`]): with `false` it frees that state
    /// now and derives none until enabled again (the next refresh rebuilds it). The planner
    /// follows `--weight-cache` (off by default) and drops caches that do not fit a device's
    /// budget. Results agree either way up to f32 rounding (bit for bit for the products
    /// `cpu::rows_gemm` takes, a Linear's at micro-batch sizes). Default: nothing to keep,
    /// nothing to do.
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

    /// The most bytes a [`Layer::backward_weight`] call reserves and frees again before it returns
    /// (beyond the gradients it adds into), for the memory plan: a layer that sums a micro-batch's
    /// gradient in a buffer of its own before adding it (so that the batch's gradient does not
    /// depend on how it is cut into micro-batches and replicas) reports that buffer, at most its
    /// largest parameter's bytes. Default: 0.
    fn weight_pass_scratch_bytes(&self) -> u64 {
        0
    }

    /// What each device of a split layer has sent in its collectives since the layer was built
    /// (rank order); empty for a layer on one device (the default).
    fn collective_traffic(&self) -> Vec<crate::collective::Traffic> {
        Vec::new()
    }

    /// Whether the layer is split over devices (tensor-parallel): by default, whether it reports
    /// collective traffic. The runtime counts a split layer's gradients on every rank of its
    /// stage (each holds other shards) and an unsplit layer's on one.
    fn is_split(&self) -> bool {
        !self.collective_traffic().is_empty()
    }

    /// Makes a split layer's collectives usable again after a step was abandoned (a failure on any
    /// rank). A layer whose shards are on other ranks must exchange with them, so the runtime calls
    /// it on every rank's layers after every abandoned step, in the same order; nothing to do for
    /// other layers (the default).
    fn recover_collectives(&self) -> Result<()> {
        Ok(())
    }
}

thread_local! {
    /// The layers (by address) whose default backward is running on this thread: a default that
    /// finds its own layer here would call itself through the other default forever.
    static DEFAULT_BACKWARD_ACTIVE: RefCell<Vec<*const ()>> = const { RefCell::new(Vec::new()) };
}

/// Marks a layer's default backward as running on this thread until dropped; refuses to enter a
/// second default of the same layer (it implements neither [`Layer::backward`] nor the halves).
struct DefaultBackwardGuard(*const ());

impl DefaultBackwardGuard {
    fn enter(kind: &'static str, layer: *const ()) -> Result<DefaultBackwardGuard> {
        DEFAULT_BACKWARD_ACTIVE.with(|active| {
            let mut active = active.borrow_mut();
            if active.contains(&layer) {
                return Err(Error::BackwardNotImplemented { layer: kind.to_string() });
            }
            active.push(layer);
            Ok(DefaultBackwardGuard(layer))
        })
    }
}

impl Drop for DefaultBackwardGuard {
    fn drop(&mut self) {
        DEFAULT_BACKWARD_ACTIVE.with(|active| {
            let mut active = active.borrow_mut();
            if let Some(position) = active.iter().rposition(|&layer| layer == self.0) {
                active.remove(position);
            }
        });
    }
}
