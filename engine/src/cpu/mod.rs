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
pub mod rows_gemm;
pub mod softmax;
pub mod transpose;
pub mod uninit;
pub(crate) mod vecmath;
pub mod window;

/// Seeded test values in `[-amplitude, amplitude)` (xorshift), shared by the kernels' tests.
#[cfg(test)]
pub(crate) fn test_values(n: usize, seed: u64, amplitude: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 * amplitude - amplitude
        })
        .collect()
}

pub use gemm::{MatRef, matmul, matmul_uninit};
pub use window::Window2d;
