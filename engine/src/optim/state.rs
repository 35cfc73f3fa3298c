//! Per-parameter optimizer state ([`ParamState`]) and its checkpoint form: export to named tensors,
//! import from a [`Checkpoint`], and the expected-tensor list for strict loads.
//!
//! # Naming convention
//!
//! For a parameter named `<param>` (e.g. `layers.3.weight`), the state is saved as:
//!
//! | name                              | dtype | shape            | present for            |
//! |-----------------------------------|-------|------------------|------------------------|
//! | `optimizer.<param>.step`          | F32   | `[]` (scalar)    | every optimizer        |
//! | `optimizer.<param>.momentum_buffer` | F32 | the parameter's  | SGD with momentum ≠ 0  |
//! | `optimizer.<param>.exp_avg`       | F32   | the parameter's  | Adam, AdamW            |
//! | `optimizer.<param>.exp_avg_sq`    | F32   | the parameter's  | Adam, AdamW            |
//!
//! The step is an f32 scalar as in torch's Adam state (exact up to 2^24 steps). Every field the
//! configuration uses is always written, as zeros before the first step, so the expected list of a
//! strict load ([`Optimizer::state_specs`]) depends only on the configuration and the parameters.
//! On import, a step of 0 means "no state yet" (SGD's first step then clones the gradient into the
//! buffer, as torch does when its buffer is `None`).
use crate::checkpoint::{Checkpoint, TensorSpec};
use crate::optim::Optimizer;
use crate::{DType, Device, Error, Result, Shape, Tensor};

/// The prefix of every optimizer-state tensor name in a checkpoint.
pub const OPTIMIZER_STATE_PREFIX: &str = "optimizer.";
/// Field name of the step count.
pub const STEP: &str = "step";
/// Field name of SGD's momentum buffer.
pub const MOMENTUM_BUFFER: &str = "momentum_buffer";
/// Field name of Adam's first moment.
pub const EXP_AVG: &str = "exp_avg";
/// Field name of Adam's second moment.
pub const EXP_AVG_SQ: &str = "exp_avg_sq";

/// Largest step count an f32 scalar holds exactly.
const MAX_EXACT_F32_STEP: u64 = 1 << 24;

/// The checkpoint name of `field` of `param_name`'s state: `optimizer.<param_name>.<field>`.
pub fn optimizer_state_name(param_name: &str, field: &str) -> String {
    format!("{OPTIMIZER_STATE_PREFIX}{param_name}.{field}")
}

/// The optimizer state of one parameter tensor: the number of updates it has had and the buffers
/// its optimizer keeps (allocated on the parameter's device at the first update).
#[derive(Debug, Default)]
pub struct ParamState {
    pub(crate) step: u64,
    pub(crate) momentum_buffer: Option<Tensor>,
    pub(crate) exp_avg: Option<Tensor>,
    pub(crate) exp_avg_sq: Option<Tensor>,
}

impl ParamState {
    /// Updates applied so far (torch's `state["step"]`).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// SGD's momentum buffer, once allocated.
    pub fn momentum_buffer(&self) -> Option<&Tensor> {
        self.momentum_buffer.as_ref()
    }

    /// Adam's exponential moving average of gradients, once allocated.
    pub fn exp_avg(&self) -> Option<&Tensor> {
        self.exp_avg.as_ref()
    }

    /// Adam's exponential moving average of squared gradients, once allocated.
    pub fn exp_avg_sq(&self) -> Option<&Tensor> {
        self.exp_avg_sq.as_ref()
    }

    /// Bytes of the buffers held, on the parameter's device.
    pub fn size_in_bytes(&self) -> usize {
        self.buffers().map(|(_, tensor)| tensor.size_in_bytes()).sum()
    }

    /// The allocated buffers with their field names.
    pub(crate) fn buffers(&self) -> impl Iterator<Item = (&'static str, &Tensor)> {
        [(MOMENTUM_BUFFER, &self.momentum_buffer), (EXP_AVG, &self.exp_avg), (EXP_AVG_SQ, &self.exp_avg_sq)]
            .into_iter()
            .filter_map(|(field, tensor)| tensor.as_ref().map(|tensor| (field, tensor)))
    }

    pub(crate) fn slot(&mut self, field: &str) -> Option<&mut Option<Tensor>> {
        match field {
            MOMENTUM_BUFFER => Some(&mut self.momentum_buffer),
            EXP_AVG => Some(&mut self.exp_avg),
            EXP_AVG_SQ => Some(&mut self.exp_avg_sq),
            _ => None,
        }
    }

    /// Allocates the buffers `fields` as zeros on `param`'s device, and checks ones already there
    /// still fit `param` (same shape, same device).
    pub(crate) fn ensure_allocated(&mut self, fields: &[&str], param: &Tensor, op: &str) -> Result<()> {
        for &field in fields {
            let Some(slot) = self.slot(field) else {
                return Err(Error::invalid("optimizer state", format!("unknown state field `{field}`")));
            };
            match slot {
                Some(buffer) if buffer.shape() != param.shape() => {
                    return Err(Error::shape(
                        op.to_string(),
                        format!("a parameter of shape {} like its {field}", buffer.shape()),
                        format!("{}; call reset_state() if the parameter was replaced", param.shape()),
                    ));
                }
                Some(buffer) if !buffer.device().same_device(param.device()) => {
                    return Err(Error::DeviceMismatch {
                        op: format!(
                            "{op}: {field} vs parameter (call reset_state() or re-import the state after moving parameters)"
                        ),
                        lhs: buffer.device().to_string(),
                        rhs: param.device().to_string(),
                    });
                }
                Some(_) => {}
                None => *slot = Some(Tensor::zeros(param.shape().clone(), DType::F32, param.device())?),
            }
        }
        Ok(())
    }
}

impl Optimizer {
    /// The tensors [`Optimizer::export_state`] writes for these parameters, for a strict load
    /// ([`crate::checkpoint::load_exact`]) of a checkpoint holding parameters and optimizer state.
    pub fn state_specs(&self, param_names: &[&str], params: &[&Tensor]) -> Result<Vec<TensorSpec>> {
        self.check_param_list(param_names, params)?;
        let fields = self.config.state_tensor_fields();
        let mut specs = Vec::with_capacity(param_names.len() * (1 + fields.len()));
        for (name, param) in param_names.iter().zip(params) {
            specs.push(TensorSpec::new(optimizer_state_name(name, STEP), Shape::new(Vec::new()), DType::F32));
            for field in fields {
                specs.push(TensorSpec::new(optimizer_state_name(name, field), param.shape().clone(), DType::F32));
            }
        }
        Ok(specs)
    }

    /// The state as named tensors (names in the module docs), copied to the host so saving does not
    /// charge the stages' memory budgets. Fields not yet allocated are written as zeros.
    pub fn export_state(&self, param_names: &[&str], params: &[&Tensor]) -> Result<Vec<(String, Tensor)>> {
        self.check_param_list(param_names, params)?;
        let host = Device::host();
        let fields = self.config.state_tensor_fields();
        let mut tensors = Vec::with_capacity(param_names.len() * (1 + fields.len()));
        for ((name, param), state) in param_names.iter().zip(params).zip(&self.states) {
            tensors.push((
                optimizer_state_name(name, STEP),
                Tensor::from_vec(vec![state.step as f32], Shape::new(Vec::new()), &host)?,
            ));
            for &field in fields {
                let buffer = state.buffers().find(|(f, _)| *f == field).map(|(_, tensor)| tensor);
                let tensor = match buffer {
                    Some(buffer) => buffer.to_device(&host)?,
                    None => Tensor::zeros(param.shape().clone(), DType::F32, &host)?,
                };
                tensors.push((optimizer_state_name(name, field), tensor));
            }
        }
        Ok(tensors)
    }

    /// Replaces the state with the one in `checkpoint` for these parameters (aligned with the
    /// optimizer's parameter list), moving buffers onto each parameter's device. Takes the tensors
    /// it uses out of `checkpoint` and leaves any others (another stage's state, parameters).
    /// Checks every parameter's state before replacing any: on error the old state is kept.
    pub fn import_state(
        &mut self,
        param_names: &[&str],
        params: &[&Tensor],
        checkpoint: &mut Checkpoint,
    ) -> Result<()> {
        self.check_param_list(param_names, params)?;
        let fields = self.config.state_tensor_fields();
        let scalar = Shape::new(Vec::new());
        // Check everything before taking anything, so a failed import leaves the checkpoint whole.
        let mut steps = Vec::with_capacity(params.len());
        for (name, param) in param_names.iter().zip(params) {
            let step_name = optimizer_state_name(name, STEP);
            let step_tensor = checkpoint.get(&step_name).ok_or_else(|| {
                checkpoint.error(format!(
                    "tensor `{step_name}` is missing: expected the {} step count of parameter `{name}` as an f32 scalar; \
                     was the checkpoint saved with optimizer state?",
                    self.config.name()
                ))
            })?;
            if step_tensor.shape() != &scalar || step_tensor.dtype() != DType::F32 {
                return Err(checkpoint.error(format!(
                    "tensor `{step_name}` is {} {} but an f32 scalar (shape []) was expected",
                    step_tensor.dtype(),
                    step_tensor.shape()
                )));
            }
            let value = step_tensor.as_f32()?[0];
            if !(value >= 0.0 && value.fract() == 0.0 && (value as u64) <= MAX_EXACT_F32_STEP) {
                return Err(checkpoint.error(format!(
                    "tensor `{step_name}` holds {value}, which is not a step count (a whole number from 0 to 2^24)"
                )));
            }
            let step = value as u64;
            if step > 0 {
                for field in fields {
                    let field_name = optimizer_state_name(name, field);
                    let Some(buffer) = checkpoint.get(&field_name) else {
                        return Err(checkpoint.error(format!(
                            "tensor `{field_name}` is missing: parameter `{name}` has taken {step} steps, so the {} state \
                             needs its {field} (f32 {}); was it saved by a different optimizer?",
                            self.config.name(),
                            param.shape()
                        )));
                    };
                    if buffer.shape() != param.shape() || buffer.dtype() != DType::F32 {
                        return Err(checkpoint.error(format!(
                            "tensor `{field_name}` is {} {} but f32 {} (the shape of parameter `{name}`) was expected",
                            buffer.dtype(),
                            buffer.shape(),
                            param.shape()
                        )));
                    }
                }
            }
            steps.push(step);
        }
        let mut states = Vec::with_capacity(params.len());
        for ((name, param), &step) in param_names.iter().zip(params).zip(&steps) {
            let mut state = ParamState { step, ..ParamState::default() };
            if step > 0 {
                for field in fields {
                    let buffer = checkpoint
                        .get(&optimizer_state_name(name, field))
                        .ok_or_else(|| {
                            checkpoint.error(format!("tensor `{}` vanished", optimizer_state_name(name, field)))
                        })?
                        .to_device(param.device())?;
                    if let Some(slot) = state.slot(field) {
                        *slot = Some(buffer);
                    }
                }
            }
            states.push(state);
        }
        for name in param_names {
            checkpoint.take(&optimizer_state_name(name, STEP));
            for field in fields {
                checkpoint.take(&optimizer_state_name(name, field));
            }
        }
        self.states = states;
        Ok(())
    }

    fn check_param_list(&self, param_names: &[&str], params: &[&Tensor]) -> Result<()> {
        if param_names.len() != self.states.len() || params.len() != self.states.len() {
            return Err(Error::invalid(
                "param_names",
                format!(
                    "the optimizer holds state for {} parameter tensors but got {} names and {} parameters; \
                     pass the stage's parameters in the order the optimizer was built for",
                    self.states.len(),
                    param_names.len(),
                    params.len()
                ),
            ));
        }
        Ok(())
    }
}
