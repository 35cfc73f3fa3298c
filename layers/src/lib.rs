//! Conveyor's layers: forward passes, the split backward pass, cost estimates, and PyTorch's
//! parameter names, layouts and default initialisation.
//!
//! # The split backward
//!
//! Every layer implements [`conveyor_engine::Layer`], whose backward pass is two independent
//! calls on the same `Saved` state:
//!
//! * `backward_input(saved, dy)` returns `∂L/∂x` for each input (`None` where an input takes no
//!   gradient, such as [`Embedding`] ids). It is on the pipeline's critical path: the previous
//!   stage waits for it.
//! * `backward_weight(saved, dy, grads)` *adds* `∂L/∂θ` into `grads`, aligned with
//!   `parameters()`. Nothing downstream waits for it, so zero-bubble schedules defer it into
//!   pipeline bubbles; adding (not overwriting) lets micro-batches accumulate into one buffer.
//!
//! Neither call mutates `Saved`, so they may run in either order. The rejected alternative, a single
//! `backward` returning both, would force every schedule to compute weight gradients at the moment
//! the input gradient is needed.
//!
//! # Conventions
//!
//! Tensors are batch-first (NCHW for [`Conv2d`] and the pools); `output_shape` and `cost` take
//! per-sample shapes without the batch. Constructors build parameters on `Device::host()` from a
//! seeded `StdRng` (`conveyor_engine::init::rng(seed)`) with PyTorch's defaults. Kernels are the
//! engine's single-threaded f32 CPU kernels (`conveyor_engine::cpu`); matrix products go through
//! its GEMM with transposed views rather than materialised transposes. f16/bf16 tensors are read
//! as f32 and results are returned in the input's dtype. Bad shapes, ids and labels are errors,
//! never panics.
//!
//! # How the tests check gradients
//!
//! Each layer's forward pass is compared against a straightforward f64 reference written in the
//! test, and its analytic f32 gradients against central finite differences of that reference:
//! with the scalar objective `L = Σ g ⊙ f(x, θ)` for a random `g`,
//! `∂L/∂v ≈ (L(v + h) - L(v - h)) / 2h` with `h = 1e-4` in f64 (truncation error O(h²) ≈ 1e-8,
//! rounding ≈ 1e-16·|L|/h ≈ 1e-11). An analytic value `a` passes against the reference `r` when
//!
//! `|a - r| ≤ 1e-3 · (|r| + ‖r‖∞) + 1e-6`,
//!
//! where `‖r‖∞` is the largest reference magnitude in that tensor: f32 rounding contributes about
//! `n · 2⁻²⁴` relative error for sums of `n ≤ 100` terms (≈ 6e-6), so 1e-3 leaves a wide margin
//! while a wrong formula misses by O(‖r‖∞). Forward outputs use the same bound. Half-precision
//! [`Linear`] is compared with the f32 layer on the same rounded values by
//! `|y_half - y_f32| ≤ 4 · u · sqrt(in_features) · (|y_f32| + ‖y_f32‖∞)` with unit roundoff
//! `u = 2⁻¹¹` for f16 and `2⁻⁸` for bf16 (the output is rounded once to the half format).
//!
//! ```
//! use conveyor_engine::{Device, ForwardCtx, Layer, Loss, Targets, Tensor, init};
//! use conveyor_layers::{CrossEntropyLoss, Linear, Relu};
//! let mut rng = init::rng(0);
//! let (hidden, head) = (Linear::new(4, 8, true, &mut rng)?, Linear::new(8, 3, true, &mut rng)?);
//! let x = Tensor::from_vec(vec![0.5; 8], [2, 4], &Device::host())?;
//! let ctx = ForwardCtx::train(1);
//! let (h, saved_hidden) = hidden.forward(&[&x], &ctx)?;
//! let (a, saved_relu) = Relu::new().forward(&[&h], &ctx)?;
//! let (logits, saved_head) = head.forward(&[&a], &ctx)?;
//! let (loss, dlogits) = CrossEntropyLoss::new().loss_and_grad(&logits, &Targets::Classes(vec![0, 2]), 2.0)?;
//! assert!(loss > 0.0);
//! let da = head.backward_input(&saved_head, &dlogits)?.remove(0).unwrap();
//! let mut head_grads: Vec<Tensor> =
//!     head.parameters().iter().map(|p| Tensor::zeros(p.value.shape().clone(), p.value.dtype(), &Device::host())).collect::<Result<_, _>>()?;
//! head.backward_weight(&saved_head, &dlogits, &mut head_grads)?; // may run later
//! let dh = Relu::new().backward_input(&saved_relu, &da)?.remove(0).unwrap();
//! let dx = hidden.backward_input(&saved_hidden, &dh)?.remove(0).unwrap();
//! assert_eq!(dx.dims(), &[2, 4]);
//! # Ok::<(), conveyor_engine::Error>(())
//! ```
#![deny(missing_docs)]

mod activation;
mod attention;
mod conv2d;
mod dropout;
mod embedding;
mod flatten;
mod fn_loss;
mod layer_norm;
mod linear;
mod loss;
mod mse;
mod parallel;
mod pool;
mod residual;
mod sequence;
mod tensor_io;

pub use activation::{Gelu, GeluTanh, Relu, Tanh};
pub use attention::MultiheadSelfAttention;
pub use conv2d::{Conv2d, Conv2dOptions};
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use flatten::Flatten;
pub use fn_loss::FnLoss;
pub use layer_norm::{LAYER_NORM_EPS, LayerNorm};
pub use linear::Linear;
pub use loss::CrossEntropyLoss;
pub use mse::MseLoss;
pub use parallel::{
    ChannelParallelConv2d, ChannelParallelConvStack, ColumnParallelLinear, ConvStackLayer, MlpActivation, ParallelMlp,
    ParallelSelfAttention, ParallelTransformerBlock, RankShard, RowParallelLinear, Shards, VocabParallelEmbedding,
};
pub use pool::{AvgPool2d, GlobalAvgPool2d, MaxPool2d};
pub use residual::Add;
pub use sequence::{MeanOverTokens, PositionalEmbedding};
