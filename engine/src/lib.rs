//! Conveyor's engine: tensors, devices with memory budgets, CPU kernels, the `Layer` trait,
//! initialisation, optimizers and checkpoints. The pipeline runtime builds on these.
//!
//! Design: tensors own contiguous row-major storage and a reservation on their device's memory
//! ledger, so every byte a stage holds is counted and a budget overrun is an error, not an abort.
//! We rejected a global allocator hook: it cannot tell which device a byte belongs to.
#![deny(missing_docs)]

pub mod checkpoint;
pub mod collective;
pub mod cpu;
pub mod device;
mod dtype;
mod error;
pub mod graph;
pub mod init;
mod layer;
mod loss;
pub mod optim;
pub mod output_file;
pub mod placement;
mod precision;
pub mod runtime;
pub mod strategies;
mod shape;
mod tensor;
pub mod testing;
pub mod trace;
pub mod transport;

pub use device::{CpuDevice, CudaDevice, Device};
pub use dtype::DType;
pub use error::{Error, NonFinite, Result};
pub use layer::{CallScratch, ForwardCtx, Layer, LayerCost, Parameter, Saved};
pub use loss::{Loss, TargetKind, Targets};
pub use precision::{LossScaleConfig, LossScaler, Precision};
pub use shape::Shape;
pub use tensor::Tensor;
