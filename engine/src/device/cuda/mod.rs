//! The CUDA backend (built with the `cuda` feature): one [`CudaDevice`] per GPU ordinal, one
//! [`CudaStream`] per stage worker, device buffers counted on the device's memory ledger, cuBLAS
//! GEMMs over strided views, and the repository's kernels compiled at run time by NVRTC.
//!
//! # Design
//!
//! A [`CudaDevice`] is a handle on a GPU's primary context and on a memory ledger shared by its
//! clones, exactly as a CPU device is a core and a ledger: every [`CudaBuffer`] reserves its bytes
//! on the ledger before the driver allocates them and releases them when dropped, so budgets,
//! peaks and `Error::OutOfDeviceMemory` mean on a GPU what they mean on a CPU. A worker thread
//! creates its own [`CudaStream`] ([`CudaDevice::new_stream`]); the stream owns a cuBLAS handle
//! bound to it, and every allocation, copy, GEMM and kernel launch goes through a stream, so two
//! workers on one GPU never serialise on each other. cudarc records a read and a write event on
//! every buffer, so a buffer written on one stream and read on another is ordered correctly.
//!
//! Kernels are compiled once per GPU (per primary context) on first use, for that GPU's compute
//! capability, and the loaded module is cached for the process (`compile.rs`). The rejected
//! alternative, PTX compiled at build time, would need a CUDA toolkit on every build machine.
//!
//! GEMMs keep the CPU's row-major semantics (`cpu::matmul(dst, lhs, rhs, accumulate)`): a
//! row-major matrix is, to column-major cuBLAS, its own transpose, so `C = A·B` is issued as
//! `Cᵀ = Bᵀ·Aᵀ` with the operands swapped (`gemm.rs` has the argument). f16 and bf16 inputs
//! multiply with f32 accumulation into an f32 result (`cublasGemmEx`, `CUBLAS_COMPUTE_32F`).
//!
//! # Code map
//!
//! - `device.rs`: [`CudaDevice`] (context, ledger, properties, peer access, stream creation).
//! - `buffer.rs`: [`CudaBuffer`], the element traits, [`DeviceMatRef`] (strided matrix views).
//! - `stream.rs`: [`CudaStream`], host↔device copies, launch configurations.
//! - `strided.rs`: copies of blocks of rows on one GPU (the column ops).
//! - `transfer.rs`: device-to-device copies, between GPUs by peer access or staged through
//!   pinned host memory.
//! - `thread_streams.rs`: each thread's stream per GPU ([`CudaDevice::thread_stream`]) and the
//!   synchronisation rule that makes tensors safe to hand between threads.
//! - `storage.rs`: `CudaStorage`, a tensor's elements on a GPU (the payload of `Tensor`'s CUDA
//!   storage), with upload, download, copies and zero-filling.
//! - `gemm.rs`: cuBLAS matrix products. `compile.rs`: NVRTC and the kernel table.
//! - `elementwise.rs`, `conv.rs`, `norm.rs`, `optim.rs`: the typed launch wrappers, one per kernel in
//!   `device/kernels/*.cu`.
//! - `errors.rs`: cudarc errors as the engine's `Error`.
//! - `nccl.rs` (the `nccl` feature): the NCCL `Communicator`, with collectives on host slices
//!   and on device buffers (`DeviceCollectives`, what the tensor collectives use).
//!
//! **Architecture Invariant:** nothing here panics on a machine without a driver or without a
//! CUDA library: each library (libcuda, libcublas, libnvrtc, libnccl) is probed with cudarc's
//! `is_culib_present` before its first call, and its absence is `Error::CudaUnavailable`.
mod attention;
mod buffer;
mod compile;
mod conv;
mod device;
mod elementwise;
mod errors;
mod gemm;
mod norm;
mod optim;
mod storage;
mod stream;
mod strided;
mod thread_streams;
mod transfer;

pub use buffer::{CudaBuffer, CudaElement, DeviceMatRef, GemmElement};
pub use device::CudaDevice;
pub(crate) use storage::CudaStorage;
pub use stream::CudaStream;
