//! [`CudaStorage`]: a tensor's elements on a GPU (f32, f16 or bf16), the payload of `Tensor`'s
//! CUDA storage variant, with the data movement tensors need: allocation, upload and download
//! through [`HostStorage`], copies on one GPU and to another, and zero-filling.
//!
//! Every buffer reserves its bytes on the ledger of the `CudaDevice` it is allocated for, so a
//! CUDA tensor holds no reservation of its own. Copies and transfers follow the synchronisation
//! rule of `thread_streams.rs`: uploads synchronize the destination, downloads and transfers to
//! another device settle the source first and synchronize the destination after; copies within one
//! device (copy-on-write, narrowing) are ordered on this thread's stream by the buffers' events.
//! Arithmetic lives elsewhere: `Tensor`'s ops take the f32 buffer ([`CudaStorage::f32`]) and call
//! the stream's launchers.
use half::{bf16, f16};

use super::buffer::{CudaBuffer, CudaElement};
use super::device::CudaDevice;
use super::thread_streams::settle;
use crate::device::HostStorage;
use crate::{DType, Error, Result};

/// Contiguous row-major elements of one dtype on one GPU.
#[derive(Debug)]
pub(crate) enum CudaStorage {
    F32(CudaBuffer<f32>),
    F16(CudaBuffer<f16>),
    BF16(CudaBuffer<bf16>),
}

/// Runs `$body` with `$buffer` bound to the storage's buffer, whatever its element type, and wraps
/// a returned buffer in the same variant (`map`) or returns the body's value (`each`).
macro_rules! each {
    ($storage:expr, $buffer:ident => $body:expr) => {
        match $storage {
            CudaStorage::F32($buffer) => $body,
            CudaStorage::F16($buffer) => $body,
            CudaStorage::BF16($buffer) => $body,
        }
    };
}

macro_rules! map {
    ($storage:expr, $buffer:ident => $body:expr) => {
        match $storage {
            CudaStorage::F32($buffer) => CudaStorage::F32($body),
            CudaStorage::F16($buffer) => CudaStorage::F16($body),
            CudaStorage::BF16($buffer) => CudaStorage::BF16($body),
        }
    };
}

impl CudaStorage {
    /// An f32 buffer as storage.
    pub(crate) fn from_f32(buffer: CudaBuffer<f32>) -> CudaStorage {
        CudaStorage::F32(buffer)
    }

    /// The element type.
    pub(crate) fn dtype(&self) -> DType {
        match self {
            CudaStorage::F32(_) => DType::F32,
            CudaStorage::F16(_) => DType::F16,
            CudaStorage::BF16(_) => DType::BF16,
        }
    }

    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        each!(self, buffer => buffer.len())
    }

    /// The GPU (and ledger) the elements live on.
    pub(crate) fn device(&self) -> &CudaDevice {
        each!(self, buffer => buffer.device())
    }

    /// The f32 buffer; `UnsupportedDType` for f16/bf16 storage (compute on a GPU is f32).
    pub(crate) fn f32(&self, op: &str) -> Result<&CudaBuffer<f32>> {
        match self {
            CudaStorage::F32(buffer) => Ok(buffer),
            other => Err(Error::UnsupportedDType { op: op.to_string(), dtype: other.dtype() }),
        }
    }

    /// The bf16 buffer; `UnsupportedDType` for f32/f16 storage.
    pub(crate) fn bf16(&self, op: &str) -> Result<&CudaBuffer<bf16>> {
        match self {
            CudaStorage::BF16(buffer) => Ok(buffer),
            other => Err(Error::UnsupportedDType { op: op.to_string(), dtype: other.dtype() }),
        }
    }

    /// The f16 buffer; `UnsupportedDType` for f32/bf16 storage.
    pub(crate) fn f16(&self, op: &str) -> Result<&CudaBuffer<half::f16>> {
        match self {
            CudaStorage::F16(buffer) => Ok(buffer),
            other => Err(Error::UnsupportedDType { op: op.to_string(), dtype: other.dtype() }),
        }
    }

    /// The f32 buffer, writable; `UnsupportedDType` for f16/bf16 storage.
    pub(crate) fn f32_mut(&mut self, op: &str) -> Result<&mut CudaBuffer<f32>> {
        match self {
            CudaStorage::F32(buffer) => Ok(buffer),
            other => Err(Error::UnsupportedDType { op: op.to_string(), dtype: other.dtype() }),
        }
    }

    /// `len` zeros of `dtype` on `device`, reserved on its ledger (`OutOfDeviceMemory` past the budget).
    pub(crate) fn zeros(device: &CudaDevice, dtype: DType, len: usize) -> Result<CudaStorage> {
        Ok(match dtype {
            DType::F32 => CudaStorage::F32(device.alloc_zeros(len)?),
            DType::F16 => CudaStorage::F16(device.alloc_zeros(len)?),
            DType::BF16 => CudaStorage::BF16(device.alloc_zeros(len)?),
        })
    }

    /// `len` zeros of `dtype` on `device`, counted on its ledger even past the budget (for
    /// `Tensor::fill_zero`, which cannot fail on the budget); the allocation itself can still fail.
    pub(crate) fn zeros_past_budget(device: &CudaDevice, dtype: DType, len: usize) -> Result<CudaStorage> {
        let stream = device.thread_stream()?;
        let reservation = device.memory().reserve_past_budget(len.saturating_mul(dtype.size_in_bytes()) as u64);
        let raw = &stream.raw;
        Ok(match dtype {
            DType::F32 => CudaStorage::F32(CudaBuffer::zeros_reserved(device, raw, len, reservation)?),
            DType::F16 => CudaStorage::F16(CudaBuffer::zeros_reserved(device, raw, len, reservation)?),
            DType::BF16 => CudaStorage::BF16(CudaBuffer::zeros_reserved(device, raw, len, reservation)?),
        })
    }

    /// A copy of `host` on `device` (synchronized: complete for every thread when it returns).
    pub(crate) fn upload(device: &CudaDevice, host: &HostStorage) -> Result<CudaStorage> {
        Ok(match host {
            HostStorage::F32(values) => CudaStorage::F32(device.upload(values)?),
            HostStorage::F16(values) => CudaStorage::F16(device.upload(values)?),
            HostStorage::BF16(values) => CudaStorage::BF16(device.upload(values)?),
        })
    }

    /// Copies `host` (same dtype and length) into these elements; synchronized.
    pub(crate) fn upload_into(&mut self, host: &HostStorage) -> Result<()> {
        let op = "upload_into";
        let expected = format!("{} elements of {}", self.len(), self.dtype());
        let got = format!("{} elements of {}", host.len(), host.dtype());
        let stream = self.device().thread_stream()?;
        match (self, host) {
            (CudaStorage::F32(dst), HostStorage::F32(src)) => stream.upload_into(src, dst)?,
            (CudaStorage::F16(dst), HostStorage::F16(src)) => stream.upload_into(src, dst)?,
            (CudaStorage::BF16(dst), HostStorage::BF16(src)) => stream.upload_into(src, dst)?,
            _ => return Err(Error::shape(op, expected, got)),
        }
        stream.synchronize()
    }

    /// The elements in host memory, once every earlier write to them has finished.
    pub(crate) fn download(&self) -> Result<HostStorage> {
        Ok(match self {
            CudaStorage::F32(buffer) => HostStorage::F32(download(buffer)?),
            CudaStorage::F16(buffer) => HostStorage::F16(download(buffer)?),
            CudaStorage::BF16(buffer) => HostStorage::BF16(download(buffer)?),
        })
    }

    /// A copy on `device` (this GPU under another ledger, or another GPU: peer access or staged
    /// through pinned host memory), counted on `device`'s ledger. The source is settled first and
    /// the destination stream synchronized after, so the copy is complete for every thread.
    pub(crate) fn copy_to(&self, device: &CudaDevice) -> Result<CudaStorage> {
        Ok(map!(self, buffer => transfer(buffer, device)?))
    }

    /// A copy on the same device and ledger (copy-on-write), ordered on this thread's stream.
    pub(crate) fn duplicate(&self) -> Result<CudaStorage> {
        Ok(map!(self, buffer => copy_range(buffer, 0, buffer.len())?))
    }

    /// The elements as `dtype` on the same GPU and ledger, converted on this thread's stream: f32
    /// to a half type rounds bit for bit as the `half` crate does on the CPU, a half type to f32
    /// is exact, and f16 to bf16 (or back) goes through f32 as on the CPU.
    pub(crate) fn to_dtype(&self, dtype: DType) -> Result<CudaStorage> {
        if self.dtype() == dtype {
            return self.duplicate();
        }
        let device = self.device();
        let stream = device.thread_stream()?;
        Ok(match (self, dtype) {
            (CudaStorage::F32(x), DType::F16) => {
                let mut y = device.alloc_zeros(x.len())?;
                stream.f32_to_f16(x, &mut y)?;
                CudaStorage::F16(y)
            }
            (CudaStorage::F32(x), DType::BF16) => {
                let mut y = device.alloc_zeros(x.len())?;
                stream.f32_to_bf16(x, &mut y)?;
                CudaStorage::BF16(y)
            }
            (half, DType::F32) => match half.upcast_f32()? {
                Some(upcast) => CudaStorage::F32(upcast),
                None => half.duplicate()?,
            },
            (half, target) => half.to_dtype(DType::F32)?.to_dtype(target)?,
        })
    }

    /// For f16 or bf16 storage, an f32 copy (exact) on the same GPU and ledger; `None` for f32.
    pub(crate) fn upcast_f32(&self) -> Result<Option<CudaBuffer<f32>>> {
        let device = self.device();
        Ok(match self {
            CudaStorage::F32(_) => None,
            CudaStorage::F16(x) => {
                let mut y = device.alloc_zeros(x.len())?;
                device.thread_stream()?.f16_to_f32(x, &mut y)?;
                Some(y)
            }
            CudaStorage::BF16(x) => {
                let mut y = device.alloc_zeros(x.len())?;
                device.thread_stream()?.bf16_to_f32(x, &mut y)?;
                Some(y)
            }
        })
    }

    /// Elements `start..start + len` as new storage on the same device and ledger.
    pub(crate) fn copy_range(&self, start: usize, len: usize) -> Result<CudaStorage> {
        Ok(map!(self, buffer => copy_range(buffer, start, len)?))
    }

    /// Copies `src` (same dtype and length, on any GPU) into these elements.
    pub(crate) fn copy_from(&mut self, src: &CudaStorage) -> Result<()> {
        let expected = format!("{} elements of {}", self.len(), self.dtype());
        let got = format!("{} elements of {}", src.len(), src.dtype());
        match (self, src) {
            (CudaStorage::F32(dst), CudaStorage::F32(src)) => copy_into(src, dst),
            (CudaStorage::F16(dst), CudaStorage::F16(src)) => copy_into(src, dst),
            (CudaStorage::BF16(dst), CudaStorage::BF16(src)) => copy_into(src, dst),
            _ => Err(Error::shape("copy_from", expected, got)),
        }
    }

    /// Sets every element to zero, ordered on this thread's stream.
    pub(crate) fn fill_zero(&mut self) -> Result<()> {
        each!(self, buffer => {
            let stream = buffer.device().thread_stream()?;
            stream.raw.memset_zeros(&mut buffer.slice).map_err(|err| stream.driver_error("zero-filling a buffer", err))
        })
    }
}

/// `buffer`'s elements in host memory (rule 3: the source is settled first).
fn download<T: CudaElement>(buffer: &CudaBuffer<T>) -> Result<Vec<T>> {
    settle(buffer)?;
    buffer.device().thread_stream()?.download(buffer)
}

/// A copy of `src` on `device` (rule 3: settle the source, copy on this thread's stream on the
/// destination GPU, synchronize that stream).
fn transfer<T: CudaElement>(src: &CudaBuffer<T>, device: &CudaDevice) -> Result<CudaBuffer<T>> {
    settle(src)?;
    let stream = device.thread_stream()?;
    let mut dst = CudaBuffer::zeros(device, &stream.raw, src.len())?;
    stream.copy_into(src, &mut dst)?;
    stream.synchronize()?;
    Ok(dst)
}

/// Copies `src` into `dst`: on one GPU ordered on this thread's stream, between GPUs by the
/// transfer rule (settle, copy, synchronize).
fn copy_into<T: CudaElement>(src: &CudaBuffer<T>, dst: &mut CudaBuffer<T>) -> Result<()> {
    let stream = dst.device().thread_stream()?;
    let other_gpu = src.device().ordinal() != dst.device().ordinal();
    if other_gpu {
        settle(src)?;
    }
    stream.copy_into(src, dst)?;
    if other_gpu {
        stream.synchronize()?;
    }
    Ok(())
}

/// Elements `start..start + len` of `src` as a new buffer on its device and ledger.
fn copy_range<T: CudaElement>(src: &CudaBuffer<T>, start: usize, len: usize) -> Result<CudaBuffer<T>> {
    let end = start.checked_add(len).filter(|&end| end <= src.len()).ok_or_else(|| {
        Error::shape("copy_range", format!("elements {start}..{start} + {len} within {}", src.len()), "out of range")
    })?;
    let device = src.device();
    let stream = device.thread_stream()?;
    let mut dst = CudaBuffer::zeros(device, &stream.raw, len)?;
    if len == 0 {
        return Ok(dst);
    }
    let part = src
        .slice
        .try_slice(start..end)
        .ok_or_else(|| Error::shape("copy_range", "a range inside the buffer", "out of range"))?;
    // `dst.slice` holds exactly `len` elements here (only an empty buffer holds a spare one).
    stream.raw.memcpy_dtod(&part, &mut dst.slice).map_err(|err| stream.driver_error("copying on the GPU", err))?;
    Ok(dst)
}
