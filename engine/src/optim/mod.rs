//! Optimizers with torch.optim's exact update rules (SGD, Adam, AdamW), their per-parameter state,
//! and gradient-norm clipping.
//!
//! Code map: [`sgd`](SgdConfig) and [`adam`](AdamConfig) hold each rule's configuration and its
//! elementwise update (the formulas are in those modules' docs); `state.rs` holds [`ParamState`]
//! and the checkpoint naming of optimizer state; `clip.rs` holds [`clip_grad_norm`] and its
//! two-phase form. This file holds [`OptimizerConfig`] and [`Optimizer`], which checks operands
//! and dispatches by `match` on the configuration, then on the parameter's device: host slices go
//! to the CPU updates, CUDA buffers to the `sgd_step`/`adam_step` kernels (`device/cuda/optim.rs`),
//! which follow the same rules with the same f32 roundings.
//!
//! Design: the pipeline runtime holds one [`Optimizer`] per stage. It owns the state of that
//! stage's parameters only, indexed like the stage's parameter list, and steps once after all
//! micro-batches' gradients are accumulated. State tensors live on the parameter's device and
//! count against its memory budget; [`OptimizerConfig::state_bytes_per_param_byte`] lets the
//! planner count them in advance. We rejected an optimizer that owns the parameters (as torch's
//! holds references): layers own their parameters, and the runtime lends them for the step.
//!
//! **Architecture Invariant:** an optimizer never names a layer; it sees parameters as indexed
//! tensors and their names only when exporting or importing state.
//!
//! **API Boundary:** [`Optimizer::step`] either updates every parameter or, when an operand is
//! wrong (count, dtype, shape, device) or the state does not fit the budget, returns the error
//! before touching any parameter.
pub(crate) mod adam;
mod clip;
mod sgd;
mod state;
mod undo;
mod unsplit;

pub use adam::AdamConfig;
pub use clip::{
    CLIP_NORM_EPSILON, check_max_norm, clip_grad_norm, clip_grads_with_norm, clips, grad_sum_of_squares,
    total_norm_from_sums_of_squares,
};
pub use sgd::SgdConfig;
pub use state::{EXP_AVG, EXP_AVG_SQ, MOMENTUM_BUFFER, OPTIMIZER_STATE_PREFIX, ParamState, STEP, optimizer_state_name};
pub use undo::StateSnapshot;

use crate::tensor::{F32Mut, F32Ref};
use crate::{DType, Error, Result, Tensor};

/// Which optimizer, with its hyperparameters. Every field uses f64, as torch's Python floats do;
/// values are rounded to f32 exactly where torch hands them to an f32 kernel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimizerConfig {
    /// `torch.optim.SGD`.
    Sgd(SgdConfig),
    /// `torch.optim.Adam`: weight decay is an L2 term added to the gradient.
    Adam(AdamConfig),
    /// `torch.optim.AdamW`: weight decay is decoupled, `p *= 1 − lr·λ` before the Adam update.
    AdamW(AdamConfig),
}

impl From<SgdConfig> for OptimizerConfig {
    fn from(config: SgdConfig) -> Self {
        OptimizerConfig::Sgd(config)
    }
}

impl OptimizerConfig {
    /// Plain SGD with learning rate `lr` (see [`SgdConfig`] for momentum and the rest).
    pub fn sgd(lr: f64) -> Self {
        OptimizerConfig::Sgd(SgdConfig::new(lr))
    }

    /// Adam with learning rate `lr` and torch's defaults (betas (0.9, 0.999), eps 1e-8, no weight decay).
    pub fn adam(lr: f64) -> Self {
        OptimizerConfig::Adam(AdamConfig::adam(lr))
    }

    /// AdamW with learning rate `lr` and torch's defaults (betas (0.9, 0.999), eps 1e-8, weight decay 0.01).
    pub fn adamw(lr: f64) -> Self {
        OptimizerConfig::AdamW(AdamConfig::adamw(lr))
    }

    /// The optimizer's name as torch spells it (`SGD`, `Adam`, `AdamW`).
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerConfig::Sgd(_) => "SGD",
            OptimizerConfig::Adam(_) => "Adam",
            OptimizerConfig::AdamW(_) => "AdamW",
        }
    }

    /// Checks the hyperparameters as torch's constructors do; [`Error::InvalidArgument`] otherwise.
    pub fn validate(&self) -> Result<()> {
        match self {
            OptimizerConfig::Sgd(config) => config.validate(),
            OptimizerConfig::Adam(config) | OptimizerConfig::AdamW(config) => config.validate(),
        }
    }

    /// Checks a learning rate as [`OptimizerConfig::validate`] does (PyTorch's "Invalid learning
    /// rate"): finite and at least 0.
    pub fn check_lr(lr: f64) -> Result<()> {
        sgd::check_non_negative("lr", "learning rate", lr)
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            OptimizerConfig::Sgd(config) => config.lr,
            OptimizerConfig::Adam(config) | OptimizerConfig::AdamW(config) => config.lr,
        }
    }

    /// The state tensors kept per parameter, by their checkpoint field names: none for SGD without
    /// momentum, [`MOMENTUM_BUFFER`] with momentum, [`EXP_AVG`] and [`EXP_AVG_SQ`] for Adam/AdamW.
    pub fn state_tensor_fields(&self) -> &'static [&'static str] {
        match self {
            OptimizerConfig::Sgd(config) if config.uses_momentum_buffer() => &[MOMENTUM_BUFFER],
            OptimizerConfig::Sgd(_) => &[],
            OptimizerConfig::Adam(_) | OptimizerConfig::AdamW(_) => &[EXP_AVG, EXP_AVG_SQ],
        }
    }

    /// Bytes of optimizer state per byte of (f32) parameter, for the placement planner: 0 for SGD
    /// without momentum, 1 with momentum, 2 for Adam and AdamW. The step counters are not counted
    /// (a few bytes per parameter tensor, kept on the host).
    pub fn state_bytes_per_param_byte(&self) -> u64 {
        self.state_tensor_fields().len() as u64
    }
}

/// One stage's optimizer: a configuration and the state of each of its parameters, indexed like
/// the parameter list it steps.
///
/// ```
/// use conveyor_engine::optim::{Optimizer, SgdConfig};
/// use conveyor_engine::{Device, Tensor};
/// let device = Device::cpu(0);
/// let mut weight = Tensor::from_slice(&[1.0, 2.0], [2], &device)?;
/// let grad = Tensor::from_slice(&[0.5, -0.5], [2], &device)?;
/// let mut optimizer = Optimizer::new(SgdConfig::new(0.1).with_momentum(0.9), 1)?;
/// optimizer.step(&mut [&mut weight], &[&grad])?;
/// assert_eq!(weight.as_f32()?, &[1.0 - 0.1 * 0.5, 2.0 + 0.1 * 0.5]);
/// assert_eq!(device.memory_in_use(), 3 * 8); // weight, grad and the momentum buffer
/// # Ok::<(), conveyor_engine::Error>(())
/// ```
#[derive(Debug)]
pub struct Optimizer {
    config: OptimizerConfig,
    states: Vec<ParamState>,
}

impl Optimizer {
    /// An optimizer for `n_params` parameter tensors; refuses invalid hyperparameters.
    pub fn new(config: impl Into<OptimizerConfig>, n_params: usize) -> Result<Optimizer> {
        let config = config.into();
        config.validate()?;
        Ok(Optimizer { config, states: (0..n_params).map(|_| ParamState::default()).collect() })
    }

    /// The configuration.
    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// How many parameter tensors this optimizer steps.
    pub fn n_params(&self) -> usize {
        self.states.len()
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        self.config.lr()
    }

    /// Sets the learning rate (for schedules); refuses a negative or non-finite one and keeps the old.
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        let mut config = self.config;
        match &mut config {
            OptimizerConfig::Sgd(sgd) => sgd.lr = lr,
            OptimizerConfig::Adam(adam) | OptimizerConfig::AdamW(adam) => adam.lr = lr,
        }
        config.validate()?;
        self.config = config;
        Ok(())
    }

    /// The state of parameter `param_idx`, if that index exists.
    pub fn state(&self, param_idx: usize) -> Option<&ParamState> {
        self.states.get(param_idx)
    }

    /// Bytes of state tensors held now, on the parameters' devices.
    pub fn state_size_in_bytes(&self) -> usize {
        self.states.iter().map(ParamState::size_in_bytes).sum()
    }

    /// Forgets all state (step counts and buffers), freeing the buffers' device memory.
    pub fn reset_state(&mut self) {
        self.states.iter_mut().for_each(|state| *state = ParamState::default());
    }

    /// Updates every parameter from its gradient (`params[i]` with `grads[i]`, f32, same shape and
    /// device). Checks every operand and allocates any missing state before updating anything, so
    /// an error leaves all parameters and state as they were.
    pub fn step(&mut self, params: &mut [&mut Tensor], grads: &[&Tensor]) -> Result<()> {
        let views: Vec<&Tensor> = params.iter().map(|p| &**p).collect();
        self.prepare_all(&views, grads)?;
        for (param_idx, (param, grad)) in params.iter_mut().zip(grads).enumerate() {
            self.apply(param_idx, param, grad)?;
        }
        Ok(())
    }

    /// The first half of [`Optimizer::step`]: checks every parameter and gradient and allocates
    /// all state, changing nothing on error (state allocated by this call is freed again). Then
    /// [`Optimizer::apply_prepared`] updates the parameters one at a time, so a caller can do
    /// per-parameter work in between (a layer's refresh while its weight is still in cache).
    pub fn prepare_all(&mut self, params: &[&Tensor], grads: &[&Tensor]) -> Result<()> {
        if params.len() != self.states.len() || grads.len() != self.states.len() {
            return Err(Error::invalid(
                "params",
                format!(
                    "the {} optimizer was built for {} parameter tensors but step got {} parameters and {} gradients; \
                     pass the stage's parameters and their gradients in the order the optimizer was built for",
                    self.config.name(),
                    self.states.len(),
                    params.len(),
                    grads.len()
                ),
            ));
        }
        for (param_idx, (param, grad)) in params.iter().zip(grads).enumerate() {
            if let Err(error) = self.prepare(param_idx, param, grad) {
                // Free state this call allocated: only never-stepped parameters lack buffers.
                for state in &mut self.states[..=param_idx] {
                    if state.step == 0 {
                        *state = ParamState::default();
                    }
                }
                return Err(error);
            }
        }
        Ok(())
    }

    /// [`Optimizer::prepare_all`] for the parameters with `owned[i]` only (ZeRO-1: this replica
    /// updates its shard of the parameters, and the others keep no state here).
    pub fn prepare_owned(&mut self, params: &[&Tensor], grads: &[&Tensor], owned: &[bool]) -> Result<()> {
        if owned.len() != params.len() {
            return Err(Error::invalid(
                "owned",
                format!("{} flags for {} parameters; give one per parameter", owned.len(), params.len()),
            ));
        }
        let pick = |all: &[&'_ Tensor]| -> Vec<usize> { (0..all.len()).filter(|&i| owned[i]).collect() };
        if params.len() != self.states.len() || grads.len() != self.states.len() {
            return self.prepare_all(params, grads);
        }
        for param_idx in pick(params) {
            if let Err(error) = self.prepare(param_idx, params[param_idx], grads[param_idx]) {
                for state in &mut self.states[..=param_idx] {
                    if state.step == 0 {
                        *state = ParamState::default();
                    }
                }
                return Err(error);
            }
        }
        Ok(())
    }

    /// Updates parameter `param_idx` after [`Optimizer::prepare_all`] checked the same operands.
    pub fn apply_prepared(&mut self, param_idx: usize, param: &mut Tensor, grad: &Tensor) -> Result<()> {
        if param_idx >= self.states.len() {
            return Err(Error::invalid(
                "param_idx",
                format!(
                    "{param_idx} is out of range: the optimizer was built for {} parameter tensors",
                    self.states.len()
                ),
            ));
        }
        self.apply(param_idx, param, grad)
    }

    /// Updates one parameter (index `param_idx` in the optimizer's list) from its gradient. For a
    /// runtime that steps parameters one at a time; [`Optimizer::step`] is the all-at-once form.
    pub fn update(&mut self, param_idx: usize, param: &mut Tensor, grad: &Tensor) -> Result<()> {
        if let Err(error) = self.prepare(param_idx, param, grad) {
            if let Some(state) = self.states.get_mut(param_idx).filter(|state| state.step == 0) {
                *state = ParamState::default();
            }
            return Err(error);
        }
        self.apply(param_idx, param, grad)
    }

    /// Checks the operands of one update and allocates its state on the parameter's device.
    fn prepare(&mut self, param_idx: usize, param: &Tensor, grad: &Tensor) -> Result<()> {
        let op = format!("{} step (parameter {param_idx})", self.config.name());
        let n_params = self.states.len();
        let fields = self.config.state_tensor_fields();
        let state = self.states.get_mut(param_idx).ok_or_else(|| {
            Error::invalid(
                "param_idx",
                format!("{param_idx} is out of range: the optimizer was built for {n_params} parameter tensors"),
            )
        })?;
        for tensor in [param, grad] {
            if tensor.dtype() != DType::F32 {
                return Err(Error::UnsupportedDType { op, dtype: tensor.dtype() });
            }
        }
        if param.shape() != grad.shape() {
            return Err(Error::shape(op, format!("a gradient of shape {}", param.shape()), grad.shape().to_string()));
        }
        if !param.device().same_device(grad.device()) {
            return Err(Error::DeviceMismatch { op, lhs: param.device().to_string(), rhs: grad.device().to_string() });
        }
        state.ensure_allocated(fields, param, &op)
    }

    /// Applies one update whose operands [`Optimizer::prepare`] checked, on the parameter's
    /// device: the CPU update of `sgd.rs`/`adam.rs` on host slices, or the same rule in the
    /// `sgd_step`/`adam_step` kernels on this thread's stream of the parameter's GPU (which round
    /// every scalar and elementwise operation as the CPU update does).
    fn apply(&mut self, param_idx: usize, param: &mut Tensor, grad: &Tensor) -> Result<()> {
        let op = "optimizer step";
        let name = self.config.name();
        // Unreachable after `prepare` (which checks the devices), but an error rather than a panic.
        let mismatch = || Error::DeviceMismatch {
            op: format!("{name} step (parameter {param_idx})"),
            lhs: format!("the gradient on {}", grad.device()),
            rhs: "the parameter or its state on another device (call reset_state() after moving parameters)".into(),
        };
        let state = &mut self.states[param_idx];
        let first_step = state.step == 0;
        let step = state.step + 1;
        let param = param.f32_mut(op)?;
        let grad = grad.f32_ref(op)?;
        match &self.config {
            OptimizerConfig::Sgd(config) => {
                let buffer = state.momentum_buffer.as_mut().map(|buffer| buffer.f32_mut(op)).transpose()?;
                match (param, grad, buffer) {
                    (F32Mut::Host(param), F32Ref::Host(grad), None) => {
                        sgd::sgd_update(config, param, grad, None, first_step);
                    }
                    (F32Mut::Host(param), F32Ref::Host(grad), Some(F32Mut::Host(buffer))) => {
                        sgd::sgd_update(config, param, grad, Some(buffer), first_step);
                    }
                    (F32Mut::Cuda(param), F32Ref::Cuda(grad), buffer) => {
                        let buffer = match buffer {
                            None => None,
                            Some(F32Mut::Cuda(buffer)) => Some(buffer),
                            Some(F32Mut::Host(_)) => return Err(mismatch()),
                        };
                        let stream = param.device().thread_stream()?;
                        stream.sgd_step(param, grad, buffer, config, first_step)?;
                    }
                    _ => return Err(mismatch()),
                }
            }
            OptimizerConfig::Adam(config) | OptimizerConfig::AdamW(config) => {
                let decoupled = matches!(self.config, OptimizerConfig::AdamW(_));
                let (Some(exp_avg), Some(exp_avg_sq)) = (state.exp_avg.as_mut(), state.exp_avg_sq.as_mut()) else {
                    return Err(Error::invalid("optimizer state", "Adam state was not allocated before the update"));
                };
                match (param, grad, exp_avg.f32_mut(op)?, exp_avg_sq.f32_mut(op)?) {
                    (F32Mut::Host(param), F32Ref::Host(grad), F32Mut::Host(exp_avg), F32Mut::Host(exp_avg_sq)) => {
                        adam::adam_update(config, decoupled, step, param, grad, exp_avg, exp_avg_sq);
                    }
                    (F32Mut::Cuda(param), F32Ref::Cuda(grad), F32Mut::Cuda(exp_avg), F32Mut::Cuda(exp_avg_sq)) => {
                        let stream = param.device().thread_stream()?;
                        stream.adam_step(param, grad, exp_avg, exp_avg_sq, config, decoupled, step)?;
                    }
                    _ => return Err(mismatch()),
                }
            }
        }
        state.step = step;
        Ok(())
    }
}
