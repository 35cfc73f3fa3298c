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

/// The f32 scalars of one SGD update.
struct SgdScalars {
    weight_decay: Option<f32>,
    momentum: f32,
    one_minus_dampening: f32,
    neg_lr: f32,
    nesterov: bool,
}

impl SgdScalars {
    fn new(config: &SgdConfig) -> SgdScalars {
        SgdScalars {
            weight_decay: (config.weight_decay != 0.0).then_some(config.weight_decay as f32),
            momentum: config.momentum as f32,
            one_minus_dampening: (1.0 - config.dampening) as f32,
            neg_lr: (-config.lr) as f32,
            nesterov: config.nesterov,
        }
    }
}

/// One element of an SGD update without momentum: the new parameter.
#[inline(always)]
fn sgd_element(s: &SgdScalars, p: f32, grad: f32) -> f32 {
    let g = match s.weight_decay {
        Some(weight_decay) => grad + weight_decay * p,
        None => grad,
    };
    p + s.neg_lr * g
}

/// One element of an SGD update with momentum: the new parameter and momentum buffer.
#[inline(always)]
fn sgd_momentum_element(s: &SgdScalars, first_step: bool, p: f32, grad: f32, buf: f32) -> (f32, f32) {
    let g = match s.weight_decay {
        Some(weight_decay) => grad + weight_decay * p,
        None => grad,
    };
    let buf = if first_step { g } else { buf * s.momentum + s.one_minus_dampening * g };
    let direction = if s.nesterov { g + s.momentum * buf } else { buf };
    (p + s.neg_lr * direction, buf)
}

/// One SGD update of one parameter, in place (`momentum_buffer` when momentum is on).
pub(crate) fn sgd_update(
    config: &SgdConfig,
    param: &mut [f32],
    grad: &[f32],
    momentum_buffer: Option<&mut [f32]>,
    first_step: bool,
) {
    let s = SgdScalars::new(config);
    match momentum_buffer {
        None => {
            for (p, &g) in param.iter_mut().zip(grad) {
                *p = sgd_element(&s, *p, g);
            }
        }
        Some(buffer) => {
            for ((p, &g), buf) in param.iter_mut().zip(grad).zip(buffer.iter_mut()) {
                (*p, *buf) = sgd_momentum_element(&s, first_step, *p, g, *buf);
            }
        }
    }
}

/// The same update out of place: reads the old parameter (and momentum buffer), writes the new
/// ones into `new_param` (and `new_buffer`), leaving the old values as the commit's undo snapshot.
/// Bit for bit what [`sgd_update`] computes.
pub(crate) fn sgd_update_into(
    config: &SgdConfig,
    old_param: &[f32],
    grad: &[f32],
    new_param: &mut [f32],
    buffers: Option<(&[f32], &mut [f32])>,
    first_step: bool,
) {
    let s = SgdScalars::new(config);
    match buffers {
        None => {
            for ((&p, &g), np) in old_param.iter().zip(grad).zip(new_param.iter_mut()) {
                *np = sgd_element(&s, p, g);
            }
        }
        Some((old_buffer, new_buffer)) => {
            let olds = old_param.iter().zip(grad).zip(old_buffer);
            for (((&p, &g), &buf), (np, nb)) in olds.zip(new_param.iter_mut().zip(new_buffer.iter_mut())) {
                (*np, *nb) = sgd_momentum_element(&s, first_step, p, g, buf);
            }
        }
    }
}
