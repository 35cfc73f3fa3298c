//! [`CudaStream`]: one worker's ordered queue of work on one GPU, with its cuBLAS handle and the
//! GPU's compiled kernels; allocation, host↔device copies, and the launch configurations and
//! operand checks the launch wrappers share.
use std::fmt;
use std::sync::{Arc, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaStream as RawStream, DriverError, LaunchConfig};

use super::buffer::{CudaBuffer, CudaElement};
use super::compile::{Kernel, KernelSet};
use super::device::CudaDevice;
use super::errors;
use crate::{Error, Result};

/// Threads per block of every launch (the kernels with a shared array assume exactly this).
pub(crate) const BLOCK_THREADS: u32 = 256;

/// A stream on one GPU, for one worker thread. Work issued through it runs in issue order;
/// methods return once the work is queued, except the downloads and [`CudaStream::synchronize`],
/// which wait for it.
pub struct CudaStream {
    device: CudaDevice,
    pub(crate) raw: Arc<RawStream>,
    blas: OnceLock<CudaBlas>,
    kernels: OnceLock<Arc<KernelSet>>,
}

impl fmt::Debug for CudaStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaStream(cuda:{})", self.device.ordinal())
    }
}

impl CudaStream {
    pub(crate) fn new(device: CudaDevice, raw: Arc<RawStream>) -> Self {
        CudaStream { device, raw, blas: OnceLock::new(), kernels: OnceLock::new() }
    }

    /// The GPU this stream runs on.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// Waits until every operation issued on this stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.raw.synchronize().map_err(|err| self.driver_error("synchronizing the stream", err))
    }

    /// `len` zeroed elements on this stream's GPU.
    pub fn alloc_zeros<T: CudaElement>(&self, len: usize) -> Result<CudaBuffer<T>> {
        CudaBuffer::zeros(&self.device, &self.raw, len)
    }

    /// A new buffer on this stream's GPU holding a copy of `host`.
    pub fn upload<T: CudaElement>(&self, host: &[T]) -> Result<CudaBuffer<T>> {
        CudaBuffer::from_host(&self.device, &self.raw, host)
    }

    /// Copies `host` into `dst` (of the same length, on this stream's GPU).
    pub fn upload_into<T: CudaElement>(&self, host: &[T], dst: &mut CudaBuffer<T>) -> Result<()> {
        self.check_len("upload_into", "dst", host.len(), dst.len())?;
        self.check_on_device("upload_into", dst)?;
        if host.is_empty() {
            return Ok(());
        }
        self.raw.memcpy_htod(host, &mut dst.slice).map_err(|err| self.driver_error("copying host to device", err))
    }

    /// The contents of `src` (on this stream's GPU), once every earlier write to it has finished.
    pub fn download<T: CudaElement>(&self, src: &CudaBuffer<T>) -> Result<Vec<T>> {
        let mut host = vec![T::default(); src.len()];
        self.download_into(src, &mut host)?;
        Ok(host)
    }

    /// Copies `src` (on this stream's GPU) into `host` (of the same length) and waits for the copy.
    pub fn download_into<T: CudaElement>(&self, src: &CudaBuffer<T>, host: &mut [T]) -> Result<()> {
        self.check_len("download_into", "host", src.len(), host.len())?;
        self.check_on_device("download_into", src)?;
        if host.is_empty() {
            return Ok(());
        }
        self.raw.memcpy_dtoh(&src.slice, host).map_err(|err| self.driver_error("copying device to host", err))?;
        self.synchronize()
    }

    /// The cuBLAS handle bound to this stream, created on first use.
    pub(crate) fn blas(&self) -> Result<&CudaBlas> {
        if let Some(blas) = self.blas.get() {
            return Ok(blas);
        }
        // SAFETY: only a dlopen probe.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(Error::CudaUnavailable(format!(
                "cuda:{}: matrix products need cuBLAS, but libcublas was not found; install the CUDA toolkit's \
                 cuBLAS (or PyPI's nvidia-cublas-cu12) and put its library directory on LD_LIBRARY_PATH",
                self.device.ordinal()
            )));
        }
        let created = CudaBlas::new(Arc::clone(&self.raw))
            .map_err(|err| errors::cublas(self.device.ordinal(), "handle creation", err))?;
        super::thread_streams::exit_guard::register(super::thread_streams::exit_guard::Library::Cublas);
        // Another thread may have won the race; its handle is kept and this one dropped.
        Ok(self.blas.get_or_init(|| created))
    }

    /// The GPU's compiled kernels (compiled by NVRTC on the GPU's first launch).
    pub(crate) fn kernels(&self) -> Result<&KernelSet> {
        if let Some(kernels) = self.kernels.get() {
            return Ok(kernels.as_ref());
        }
        let loaded = self.device.kernels()?;
        Ok(self.kernels.get_or_init(|| loaded).as_ref())
    }

    /// A grid-stride launch over `n` elements: 256-thread blocks, at most 32 per multiprocessor.
    pub(crate) fn grid_stride(&self, n: usize) -> LaunchConfig {
        let blocks = n.div_ceil(BLOCK_THREADS as usize).clamp(1, self.device.max_grid_blocks() as usize);
        LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (BLOCK_THREADS, 1, 1), shared_mem_bytes: 0 }
    }

    /// One 256-thread block per item (row), for kernels that index by `blockIdx.x`.
    pub(crate) fn block_per_item(&self, op: &str, items: usize) -> Result<LaunchConfig> {
        let blocks = errors::to_i32(op, "rows", items)? as u32;
        Ok(LaunchConfig { grid_dim: (blocks.max(1), 1, 1), block_dim: (BLOCK_THREADS, 1, 1), shared_mem_bytes: 0 })
    }

    /// One thread per item, in 256-thread blocks, for kernels without a grid-stride loop.
    pub(crate) fn thread_per_item(&self, op: &str, items: usize) -> Result<LaunchConfig> {
        let blocks = errors::to_i32(op, "items / 256", items.div_ceil(BLOCK_THREADS as usize))? as u32;
        Ok(LaunchConfig { grid_dim: (blocks.max(1), 1, 1), block_dim: (BLOCK_THREADS, 1, 1), shared_mem_bytes: 0 })
    }

    /// A driver failure of `op` on this stream's GPU.
    pub(crate) fn driver_error(&self, op: &str, err: DriverError) -> Error {
        errors::driver(self.device.ordinal(), op, err)
    }

    /// A failed launch of `kernel`.
    pub(crate) fn launch_error(&self, kernel: Kernel, err: DriverError) -> Error {
        self.driver_error(&format!("launching {}", kernel.name()), err)
    }

    /// Checks that an operand named `what` of `op` has `expected` elements.
    pub(crate) fn check_len(&self, op: &str, what: &str, expected: usize, got: usize) -> Result<()> {
        if expected != got {
            return Err(Error::shape(op, format!("{what} of {expected} elements"), format!("{got} elements")));
        }
        Ok(())
    }

    /// Checks that `buffer` lives on this stream's GPU (a kernel cannot address another GPU's memory).
    pub(crate) fn check_on_device<T: CudaElement>(&self, op: &str, buffer: &CudaBuffer<T>) -> Result<()> {
        if !buffer.device().same_gpu(&self.device) {
            return Err(Error::DeviceMismatch {
                op: op.to_string(),
                lhs: format!("cuda:{}", self.device.ordinal()),
                rhs: format!("cuda:{}", buffer.device().ordinal()),
            });
        }
        Ok(())
    }
}
