//! CPU kernels on f32 slices, single-threaded (one device is one core). Tensors and layers call these.
pub mod activation;
pub mod attention;
pub mod conv;
pub mod conv_lanes;
pub mod conv_weight;
pub mod elementwise;
pub mod gemm;
pub(crate) mod lanes_gemm;
pub mod layer_norm;
pub mod packed;
pub mod pool;
pub mod softmax;
pub mod transpose;
pub mod uninit;
pub(crate) mod vecmath;
pub mod window;

pub use gemm::{MatRef, matmul, matmul_uninit};
pub use window::Window2d;
