//! SGD with momentum, dampening, Nesterov momentum and L2 weight decay: its configuration, its
//! validation, and its elementwise update, written to follow `torch.optim.SGD` operation by operation.
//!
//! # Update rule (torch's `_single_tensor_sgd`, `maximize=False`)
//!
//! For each parameter `p` with gradient `grad`, learning rate `lr`, momentum `μ`, dampening `τ`,
//! weight decay `λ`:
//!
//! ```text
//! g = grad + λ·p                                  (only when λ ≠ 0)
//! if μ ≠ 0:
//!     buf = g                                     (first step: torch clones the gradient)
//!     buf = μ·buf + (1 − τ)·g                     (later steps: buf.mul_(μ).add_(g, alpha=1−τ))
//!     g   = g + μ·buf   if nesterov   else   buf
//! p = p − lr·g                                    (p.add_(g, alpha=−lr))
//! ```
//!
//! Scalars such as `1 − τ` are computed in f64 (Python floats) and rounded to f32 where torch hands
//! them to an f32 kernel; every elementwise operation is one f32 operation in torch's order. Torch's
//! vectorised CPU kernels may fuse a multiply and an add, so results agree with torch to within a
//! few f32 ulps rather than bit for bit.
use crate::{Error, Result};

/// Hyperparameters of SGD, with `torch.optim.SGD`'s defaults (momentum 0, dampening 0, no
/// Nesterov, no weight decay).
///
/// ```
/// use conveyor_engine::optim::{OptimizerConfig, SgdConfig};
/// let config: OptimizerConfig = SgdConfig::new(0.1).with_momentum(0.9).with_nesterov(true).into();
/// assert!(config.validate().is_ok());
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    /// Learning rate `lr` (≥ 0).
    pub lr: f64,
    /// Momentum factor `μ` (≥ 0; 0 turns momentum off and keeps no state).
    pub momentum: f64,
    /// Dampening `τ` of the gradient added into the momentum buffer.
    pub dampening: f64,
    /// Nesterov momentum (requires `momentum > 0` and `dampening == 0`).
    pub nesterov: bool,
    /// L2 penalty `λ` (≥ 0), added to the gradient as `λ·p`.
    pub weight_decay: f64,
}

impl SgdConfig {
    /// Plain SGD with learning rate `lr` and torch's defaults for everything else.
    pub fn new(lr: f64) -> Self {
        SgdConfig { lr, momentum: 0.0, dampening: 0.0, nesterov: false, weight_decay: 0.0 }
    }

    /// Sets the momentum factor.
    pub fn with_momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }

    /// Sets the dampening.
    pub fn with_dampening(mut self, dampening: f64) -> Self {
        self.dampening = dampening;
        self
    }

    /// Turns Nesterov momentum on or off.
    pub fn with_nesterov(mut self, nesterov: bool) -> Self {
        self.nesterov = nesterov;
        self
    }

    /// Sets the L2 weight decay.
    pub fn with_weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Checks the hyperparameters as `torch.optim.SGD.__init__` does (and also refuses NaN and
    /// infinities, which torch lets through).
    pub fn validate(&self) -> Result<()> {
        check_non_negative("lr", "learning rate", self.lr)?;
        check_non_negative("momentum", "momentum value", self.momentum)?;
        check_non_negative("weight_decay", "weight_decay value", self.weight_decay)?;
        if !self.dampening.is_finite() {
            return Err(Error::invalid(
                "dampening",
                format!("Invalid dampening value: {}; use a finite number (0 is the default)", self.dampening),
            ));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(Error::invalid(
                "nesterov",
                format!(
                    "Nesterov momentum requires a momentum and zero dampening (got momentum {} and dampening {}); \
                     set momentum > 0 and dampening = 0, or turn nesterov off",
                    self.momentum, self.dampening
                ),
            ));
        }
        Ok(())
    }

    /// Whether the optimizer keeps a momentum buffer per parameter.
    pub fn uses_momentum_buffer(&self) -> bool {
        self.momentum != 0.0
    }
}

/// Refuses a negative or non-finite hyperparameter with torch's wording plus a fix.
pub(crate) fn check_non_negative(name: &str, torch_label: &str, value: f64) -> Result<()> {
    if !(value >= 0.0 && value.is_finite()) {
        return Err(Error::invalid(name, format!("Invalid {torch_label}: {value}; it must be a finite number >= 0")));
    }
    Ok(())
}

/// One SGD update of one parameter, in place. `momentum_buffer` is `Some` exactly when the config
/// uses momentum; `first_step` says whether the buffer is still to be initialised from the gradient.
/// Lengths were checked equal by the caller.
pub(crate) fn sgd_update(
    config: &SgdConfig,
    param: &mut [f32],
    grad: &[f32],
    momentum_buffer: Option<&mut [f32]>,
    first_step: bool,
) {
    let weight_decay = config.weight_decay as f32;
    let apply_weight_decay = config.weight_decay != 0.0;
    let momentum = config.momentum as f32;
    let one_minus_dampening = (1.0 - config.dampening) as f32;
    let neg_lr = (-config.lr) as f32;
    match momentum_buffer {
        None => {
            for (p, &grad) in param.iter_mut().zip(grad) {
                let g = if apply_weight_decay { grad + weight_decay * *p } else { grad };
                *p += neg_lr * g;
            }
        }
        Some(buffer) => {
            for ((p, &grad), buf) in param.iter_mut().zip(grad).zip(buffer.iter_mut()) {
                let g = if apply_weight_decay { grad + weight_decay * *p } else { grad };
                *buf = if first_step { g } else { *buf * momentum + one_minus_dampening * g };
                let direction = if config.nesterov { g + momentum * *buf } else { *buf };
                *p += neg_lr * direction;
            }
        }
    }
}
