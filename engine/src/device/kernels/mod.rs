//! CUDA kernel sources kept in the repository and compiled at run time by NVRTC (plain strings
//! here, so every build carries them and a test can compile them to PTX without a GPU), and the
//! public names of the CUDA backend that launches them. GEMMs go through cuBLAS, not these kernels.
//!
//! Each `__global__` kernel has one typed launch wrapper on `CudaStream` (the table in
//! `device/cuda/compile.rs` lists them and a unit test holds it to these sources).

/// Every kernel source, by file name.
pub const SOURCES: [(&str, &str); 7] = [
    ("elementwise.cu", include_str!("elementwise.cu")),
    ("reduce.cu", include_str!("reduce.cu")),
    ("softmax.cu", include_str!("softmax.cu")),
    ("conv.cu", include_str!("conv.cu")),
    ("optim.cu", include_str!("optim.cu")),
    ("attention.cu", include_str!("attention.cu")),
    ("norm.cu", include_str!("norm.cu")),
];
