//! Adam and AdamW: their shared configuration, its validation, and the elementwise update, written
//! to follow `torch.optim.Adam` / `torch.optim.AdamW` (non-amsgrad, non-capturable, `maximize=False`)
//! operation by operation.
//!
//! # Update rule (torch's `_single_tensor_adam`)
//!
//! For each parameter `p` with gradient `grad`, learning rate `lr`, betas `(β1, β2)`, `eps` and
//! weight decay `λ`, at step `t` (1 on the first update):
//!
//! ```text
//! AdamW (decoupled):  p = p·(1 − lr·λ)                 (param.mul_(1 − lr·λ), before anything else)
//! Adam (L2):          g = grad + λ·p                   (grad.add(p, alpha=λ))
//! m = m + (1 − β1)·(g − m)                             (exp_avg.lerp_(g, 1 − β1) = β1·m + (1 − β1)·g)
//! v = β2·v + ((1 − β2)·g)·g                            (exp_avg_sq.mul_(β2).addcmul_(g, g, value=1 − β2))
//! bias_correction1 = 1 − β1^t
//! bias_correction2 = 1 − β2^t
//! step_size        = lr / bias_correction1
//! denom            = sqrt(v) / sqrt(bias_correction2) + eps
//! p = p + ((−step_size)·m) / denom                     (param.addcdiv_(m, denom, value=−step_size))
//! ```
//!
//! The scalars (`1 − lr·λ`, `β^t`, `step_size`, `sqrt(bias_correction2)`) are computed in f64 as
//! Python computes them and rounded to f32 where torch hands them to an f32 kernel. Torch's `lerp`
//! picks its formula by the weight: `m + w·(g − m)` when `|w| < 0.5`, else `g − (g − m)·(1 − w)`;
//! we do the same. Torch's vectorised CPU kernels may fuse multiply-adds, so results agree with
//! torch to within a few f32 ulps rather than bit for bit.
use crate::optim::sgd::check_non_negative;
use crate::{Error, Result};

/// Hyperparameters of Adam or AdamW, with torch's defaults: betas (0.9, 0.999), eps 1e-8, and
/// weight decay 0 for Adam, 0.01 for AdamW. Whether the weight decay is L2 (Adam) or decoupled
/// (AdamW) is decided by the [`crate::optim::OptimizerConfig`] variant that holds it.
///
/// ```
/// use conveyor_engine::optim::{AdamConfig, OptimizerConfig};
/// let config = OptimizerConfig::AdamW(AdamConfig::adamw(1e-3).with_betas(0.9, 0.95));
/// assert_eq!(config.state_bytes_per_param_byte(), 2);
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    /// Learning rate `lr` (≥ 0).
    pub lr: f64,
    /// Decay rate `β1` of the first moment, in `[0, 1)`.
    pub beta1: f64,
    /// Decay rate `β2` of the second moment, in `[0, 1)`.
    pub beta2: f64,
    /// Term added to the denominator for numerical stability (≥ 0).
    pub eps: f64,
    /// Weight decay `λ` (≥ 0): L2 for Adam, decoupled for AdamW.
    pub weight_decay: f64,
}

impl AdamConfig {
    /// torch.optim.Adam's defaults with learning rate `lr`: betas (0.9, 0.999), eps 1e-8, no weight decay.
    pub fn adam(lr: f64) -> Self {
        AdamConfig { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }

    /// torch.optim.AdamW's defaults with learning rate `lr`: as Adam, but weight decay 0.01.
    pub fn adamw(lr: f64) -> Self {
        AdamConfig { weight_decay: 1e-2, ..AdamConfig::adam(lr) }
    }

    /// Sets `(β1, β2)`.
    pub fn with_betas(mut self, beta1: f64, beta2: f64) -> Self {
        self.beta1 = beta1;
        self.beta2 = beta2;
        self
    }

    /// Sets `eps`.
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// Sets the weight decay.
    pub fn with_weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Checks the hyperparameters as `torch.optim.Adam.__init__` does (and also refuses NaN and
    /// infinities, which torch lets through).
    pub fn validate(&self) -> Result<()> {
        check_non_negative("lr", "learning rate", self.lr)?;
        check_non_negative("eps", "epsilon value", self.eps)?;
        for (index, beta) in [self.beta1, self.beta2].into_iter().enumerate() {
            if !(0.0..1.0).contains(&beta) {
                return Err(Error::invalid(
                    format!("betas[{index}]"),
                    format!(
                        "Invalid beta parameter at index {index}: {beta}; betas must lie in [0, 1), e.g. (0.9, 0.999)"
                    ),
                ));
            }
        }
        check_non_negative("weight_decay", "weight_decay value", self.weight_decay)
    }
}

/// The f32 scalars of one Adam/AdamW update, rounded where torch rounds them, shared by the CPU
/// update and the CUDA kernel's launch so both devices apply the same numbers.
pub(crate) struct AdamScalars {
    /// `1 - lr · weight_decay` (AdamW's decoupled decay).
    pub decay_factor: f32,
    pub weight_decay: f32,
    /// `1 - beta1`, the weight of `lerp(m, g, ·)`.
    pub lerp_weight: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    /// `-lr / (1 - beta1^step)`.
    pub neg_step_size: f32,
    /// `sqrt(1 - beta2^step)`.
    pub bias_correction2_sqrt: f32,
    pub eps: f32,
}

impl AdamScalars {
    /// The scalars for update number `step` (1 on the first).
    pub(crate) fn new(config: &AdamConfig, step: u64) -> AdamScalars {
        // Python-float scalars, as torch computes them from `step = state["step"].item()`.
        let step = step as f64;
        let bias_correction1 = 1.0 - config.beta1.powf(step);
        let bias_correction2 = 1.0 - config.beta2.powf(step);
        AdamScalars {
            decay_factor: (1.0 - config.lr * config.weight_decay) as f32,
            weight_decay: config.weight_decay as f32,
            lerp_weight: (1.0 - config.beta1) as f32,
            beta2: config.beta2 as f32,
            one_minus_beta2: (1.0 - config.beta2) as f32,
            neg_step_size: (-(config.lr / bias_correction1)) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
            eps: config.eps as f32,
        }
    }
}

/// One element of an Adam/AdamW update: the new parameter, `exp_avg` and `exp_avg_sq` from the
/// old ones and the gradient. The in-place and the out-of-place update both call it, so they agree
/// bit for bit.
#[inline(always)]
fn adam_element(s: &AdamScalars, weight_decay: Option<bool>, p: f32, grad: f32, m: f32, v: f32) -> (f32, f32, f32) {
    let (mut p, mut g) = (p, grad);
    match weight_decay {
        Some(true) => p *= s.decay_factor,
        Some(false) => g = grad + s.weight_decay * p,
        None => {}
    }
    let m = torch_lerp(m, g, s.lerp_weight);
    let v = v * s.beta2 + s.one_minus_beta2 * g * g;
    let denom = v.sqrt() / s.bias_correction2_sqrt + s.eps;
    (p + s.neg_step_size * m / denom, m, v)
}

/// `Some(decoupled)` when weight decay applies.
fn weight_decay_mode(config: &AdamConfig, decoupled_weight_decay: bool) -> Option<bool> {
    (config.weight_decay != 0.0).then_some(decoupled_weight_decay)
}

/// One Adam/AdamW update of one parameter, in place. `step` is the step count after incrementing
/// (1 on the first update). Lengths were checked equal by the caller.
pub(crate) fn adam_update(
    config: &AdamConfig,
    decoupled_weight_decay: bool,
    step: u64,
    param: &mut [f32],
    grad: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
) {
    let scalars = AdamScalars::new(config, step);
    let decay = weight_decay_mode(config, decoupled_weight_decay);
    let elements = param.iter_mut().zip(grad).zip(exp_avg.iter_mut()).zip(exp_avg_sq.iter_mut());
    for (((p, &g), m), v) in elements {
        (*p, *m, *v) = adam_element(&scalars, decay, *p, g, *m, *v);
    }
}

/// The same update out of place: reads the old parameter and state, writes the new ones into
/// `new` (the old values stay where they are, as the commit's undo snapshot). Bit for bit what
/// [`adam_update`] computes.
pub(crate) fn adam_update_into(
    config: &AdamConfig,
    decoupled_weight_decay: bool,
    step: u64,
    old: (&[f32], &[f32], &[f32]),
    grad: &[f32],
    new: (&mut [f32], &mut [f32], &mut [f32]),
) {
    let scalars = AdamScalars::new(config, step);
    let decay = weight_decay_mode(config, decoupled_weight_decay);
    let (old_p, old_m, old_v) = old;
    let (new_p, new_m, new_v) = new;
    let olds = old_p.iter().zip(old_m).zip(old_v).zip(grad);
    let news = new_p.iter_mut().zip(new_m.iter_mut()).zip(new_v.iter_mut());
    for ((((&p, &m), &v), &g), ((np, nm), nv)) in olds.zip(news) {
        (*np, *nm, *nv) = adam_element(&scalars, decay, p, g, m, v);
    }
}

/// `torch.lerp(start, end, weight)` as ATen computes it for f32.
fn torch_lerp(start: f32, end: f32, weight: f32) -> f32 {
    if weight.abs() < 0.5 { start + weight * (end - start) } else { end - (end - start) * (1.0 - weight) }
}
