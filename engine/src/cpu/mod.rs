//! CPU kernels on f32 slices, single-threaded (one device is one core). Tensors and layers call these.
pub mod gemm;

pub use gemm::{MatRef, matmul};
