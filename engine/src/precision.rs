//! The mixed-precision policy (`--precision f32|bf16|f16`): which dtype each kind of op computes
//! and stores in, decided here once, after PyTorch's autocast rules; and the dynamic loss scale of
//! f16 training ([`LossScaler`], after `torch.cuda.amp.GradScaler`).
//!
//! # Autocast rules
//!
//! Master weights, their gradients and the optimizer state are always f32; only activations (the
//! tensors between layers, what layers save for backward, the messages between stages) and the
//! operands of products change. Under [`Precision::Bf16`] or [`Precision::F16`]:
//!
//! - **Matmul-like ops** (Linear, Conv2d, attention's projections, whose q/k/v and heads are then
//!   half too; PyTorch's lower-precision list) round their input, weight and bias to the half
//!   type ([`Precision::round_operand`]), multiply with f32 accumulation, and store the output in
//!   the half type. On the CPU the rounding happens first
//!   and the f32 kernels run on the rounded values: numerically PyTorch's CPU autocast (bf16
//!   inputs, f32 accumulation). What they save for backward is the rounded input, so saved
//!   activations take half the bytes. Their backward rounds the output gradient and the weight
//!   the same way: a layer whose saved input is in a half type computes its backward in it.
//! - **Ops on PyTorch's fp32 list** (softmax, log-softmax and cross-entropy, layer norm, the
//!   losses, sums) read half inputs as f32, compute in f32 and return f32
//!   ([`Precision::fp32_output_dtype`]).
//! - **Every other op** (activations, pooling, dropout, reshapes, residual adds) computes in f32
//!   and returns its input's dtype, as PyTorch runs them in their input's dtype.
//!
//! A gradient takes the dtype of the tensor it is the gradient of, as in PyTorch.
//!
//! Layers read the policy from [`crate::ForwardCtx::precision`], which the runtime fills from
//! `TrainerBuilder::precision`; there is no global switch. We rejected a cast of every layer's
//! outputs and saved tensors by the runtime: it would round the fp32-list ops' saved statistics
//! and could not round a product's operands before it multiplies.
use std::fmt;

use crate::{DType, Result, Tensor};

/// The number format of a run's activations and products.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// f32 throughout.
    #[default]
    F32,
    /// bfloat16 autocast: f32's exponent range, so no loss scaling.
    Bf16,
    /// float16 autocast with dynamic loss scaling ([`LossScaler`]).
    F16,
}

impl Precision {
    /// The half type of a mixed precision; `None` for f32.
    pub fn half_dtype(self) -> Option<DType> {
        match self {
            Precision::F32 => None,
            Precision::Bf16 => Some(DType::BF16),
            Precision::F16 => Some(DType::F16),
        }
    }

    /// Whether activations and products are in a half type.
    pub fn is_mixed(self) -> bool {
        self != Precision::F32
    }

    /// Whether training needs a dynamic loss scale (f16's narrow exponent range).
    pub fn scales_loss(self) -> bool {
        self == Precision::F16
    }

    /// Bytes of one activation element of a matmul-like op's output (4 for f32, 2 for the half
    /// types): what the memory plan counts for such outputs and what they save.
    pub fn activation_bytes_per_element(self) -> u64 {
        self.half_dtype().unwrap_or(DType::F32).size_in_bytes() as u64
    }

    /// The dtype a matmul-like op multiplies in, for an input of dtype `input`: the policy's half
    /// type, else the input's own half type (a layer given half inputs multiplies as autocast
    /// does), else f32.
    pub fn matmul_dtype(self, input: DType) -> DType {
        match (self.half_dtype(), input) {
            (Some(half), _) => half,
            (None, DType::F16 | DType::BF16) => input,
            (None, DType::F32) => DType::F32,
        }
    }

    /// The output dtype of an op on PyTorch's fp32 list given an input of dtype `input`: f32 under
    /// a mixed precision, else the input's dtype (what such ops always returned).
    pub fn fp32_output_dtype(self, input: DType) -> DType {
        if self.is_mixed() { DType::F32 } else { input }
    }

    /// `tensor` as an operand of a product in `dtype`: another handle when it already is of that
    /// dtype (no copy), else a copy rounded to nearest even.
    pub fn round_operand(tensor: &Tensor, dtype: DType) -> Result<Tensor> {
        if tensor.dtype() == dtype { Ok(tensor.share()) } else { tensor.to_dtype(dtype) }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        })
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    /// `f32`, `bf16` or `f16`; the error says what would fix the text.
    fn from_str(text: &str) -> std::result::Result<Self, String> {
        match text {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            "f16" => Ok(Precision::F16),
            other => Err(format!("`{other}`: use f32, bf16 or f16")),
        }
    }
}

/// The settings of dynamic loss scaling, with `torch.cuda.amp.GradScaler`'s defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaleConfig {
    /// The first step's scale (2^16).
    pub init_scale: f32,
    /// The factor after `growth_interval` committed steps in a row (2).
    pub growth_factor: f32,
    /// The factor after a step with a non-finite gradient (0.5).
    pub backoff_factor: f32,
    /// Committed steps in a row before the scale grows (2000).
    pub growth_interval: u32,
}

impl Default for LossScaleConfig {
    fn default() -> Self {
        LossScaleConfig { init_scale: 65536.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2000 }
    }
}

/// The dynamic loss scale of f16 training: the loss gradient is multiplied by [`LossScaler::scale`]
/// before the backward pass and every parameter gradient divided by it before clipping and the
/// optimizer. A step whose gradients are not finite is skipped (nothing committed) and the scale
/// multiplied by the backoff factor; after `growth_interval` committed steps in a row it grows.
/// Every rank takes the same decisions from the same vote, so every rank holds the same scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaler {
    config: LossScaleConfig,
    scale: f32,
    good_steps: u32,
}

impl LossScaler {
    /// A scaler starting at `config.init_scale`.
    pub fn new(config: LossScaleConfig) -> LossScaler {
        LossScaler { config, scale: config.init_scale, good_steps: 0 }
    }

    /// The scale of the next step.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Committed steps in a row since the scale last changed.
    pub fn good_steps(&self) -> u32 {
        self.good_steps
    }

    /// Puts back a scale and count a checkpoint recorded (`Trainer::checkpoint`).
    pub fn restore(&mut self, scale: f32, good_steps: u32) {
        self.scale = scale;
        self.good_steps = good_steps;
    }

    /// After a committed step: counts it, and grows the scale after `growth_interval` in a row
    /// (kept finite).
    pub fn committed(&mut self) {
        self.good_steps += 1;
        if self.good_steps >= self.config.growth_interval {
            let grown = self.scale * self.config.growth_factor;
            if grown.is_finite() {
                self.scale = grown;
            }
            self.good_steps = 0;
        }
    }

    /// After a step skipped for a non-finite gradient: lowers the scale (kept above zero).
    pub fn overflowed(&mut self) {
        let lowered = self.scale * self.config.backoff_factor;
        if lowered > 0.0 {
            self.scale = lowered;
        }
        self.good_steps = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scaler_follows_grad_scaler() {
        let mut scaler = LossScaler::new(LossScaleConfig { growth_interval: 3, ..Default::default() });
        assert_eq!(scaler.scale(), 65536.0);
        scaler.committed();
        scaler.committed();
        assert_eq!(scaler.scale(), 65536.0);
        scaler.committed();
        assert_eq!(scaler.scale(), 131072.0, "x2 after growth_interval good steps");
        scaler.committed();
        scaler.overflowed();
        assert_eq!(scaler.scale(), 65536.0, "x0.5 on an overflow");
        assert_eq!(scaler.good_steps(), 0, "an overflow restarts the count");
    }

    #[test]
    fn the_policy_picks_dtypes() {
        assert_eq!(Precision::Bf16.matmul_dtype(DType::F32), DType::BF16);
        assert_eq!(Precision::F32.matmul_dtype(DType::F16), DType::F16);
        assert_eq!(Precision::F32.matmul_dtype(DType::F32), DType::F32);
        assert_eq!(Precision::F16.fp32_output_dtype(DType::F16), DType::F32);
        assert_eq!(Precision::F32.fp32_output_dtype(DType::BF16), DType::BF16);
        assert_eq!("bf16".parse::<Precision>(), Ok(Precision::Bf16));
        assert!("f64".parse::<Precision>().unwrap_err().contains("use f32, bf16 or f16"));
    }
}
