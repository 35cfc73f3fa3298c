//! `Tensor`: a shape, a dtype and contiguous row-major storage on a device, counted against the
//! device's memory budget for as long as the tensor lives.
//!
//! Storage is shared, copy-on-write: [`Tensor::share`] hands out another handle to the same bytes
//! in O(1) (layers keep their inputs and outputs for backward this way), the bytes are counted
//! once on the device's ledger and freed when the last handle drops, and every mutating method
//! first gives the tensor a private copy when another handle still sees the bytes (reserving that
//! copy on the ledger, so it can fail with `OutOfDeviceMemory`). Tensors thus behave as values:
//! no handle ever observes another's writes. We rejected views with offsets and strides: every
//! kernel here reads contiguous row-major slices, and sharing whole buffers is all the layers need.
//!
//! [`Tensor::from_f32_init`] allocates an f32 tensor without zero-filling it, for kernels that
//! write every element (GEMM outputs, elementwise maps); `cpu::uninit` holds such kernels.
//!
//! # Where the elements live
//!
//! The private `Storage` enum is the closed set of places: `Host` (`HostStorage`, the storage of
//! CPU devices, with its reservation held beside it) or `Cuda` (`CudaStorage`, a GPU buffer that
//! holds its own reservation on the GPU's ledger). The CUDA variant exists in every build; without
//! the `cuda` feature its payload type is uninhabited (`device/cuda_disabled.rs`), so its match
//! arms compile and are statically unreachable: no `cfg` here. A tensor's storage always matches
//! its device (host storage on `Device::Cpu`, CUDA storage on `Device::Cuda` with that device's
//! ledger).
//!
//! On a CUDA tensor, the methods that hand out host slices ([`Tensor::as_f32`],
//! [`Tensor::as_f32_mut`]) and host-side initialisation ([`Tensor::from_f32_init`]) return
//! [`Error::NotOnHost`] (never a panic); everything else works on the GPU: constructors upload,
//! [`Tensor::to_vec_f32`] and [`Tensor::to_le_bytes`] download, moves and copies between host and
//! GPU or between GPUs, narrowing, accumulation, scaling, zero-filling and copy-on-write are
//! device operations. The arithmetic layers need (matrix products, activations, cross-entropy) is
//! in `device/ops.rs`, one dispatch per op. The rule
//! that orders GPU work between threads is in `device/cuda/thread_streams.rs`: in short, a tensor
//! returned by [`Tensor::to_device`] or [`Tensor::move_to_device`] is complete for any thread.
#[cfg(test)]
mod tests;

use std::borrow::Cow;
use std::mem::{ManuallyDrop, MaybeUninit};
use std::sync::Arc;

use half::{bf16, f16};

use crate::device::{CudaBuffer, CudaStorage, HostStorage, Reservation};
use crate::{DType, Device, Error, Result, Shape};

/// Where a tensor's elements live.
#[derive(Debug)]
enum Storage {
    /// In host memory (CPU devices).
    Host(HostStorage),
    /// On a GPU (uninhabited without the `cuda` feature).
    Cuda(CudaStorage),
}

impl Storage {
    fn dtype(&self) -> DType {
        match self {
            Storage::Host(host) => host.dtype(),
            Storage::Cuda(cuda) => cuda.dtype(),
        }
    }
}

/// Elements and the ledger reservation that counts them, shared by every handle to them.
#[derive(Debug)]
struct Buffer {
    storage: Storage,
    /// The reservation of host elements; `None` for CUDA elements, whose buffer holds its own.
    _reservation: Option<Reservation>,
}

/// A tensor's f32 elements wherever they live, for the engine's per-op device dispatch.
pub(crate) enum F32Ref<'a> {
    Host(&'a [f32]),
    Cuda(&'a CudaBuffer<f32>),
}

/// A GPU tensor's elements as an f32 operand: its own buffer, or for f16/bf16 an exact f32 copy
/// made for the op and freed after it (the GPU side of reading half tensors through
/// `host_f32`, as the CPU arms do).
pub(crate) enum CudaF32<'a> {
    Own(&'a CudaBuffer<f32>),
    Upcast(CudaBuffer<f32>),
}

impl std::ops::Deref for CudaF32<'_> {
    type Target = CudaBuffer<f32>;
    fn deref(&self) -> &CudaBuffer<f32> {
        match self {
            CudaF32::Own(buffer) => buffer,
            CudaF32::Upcast(buffer) => buffer,
        }
    }
}

/// A tensor's f32 elements wherever they live, writable (a shared tensor was copied first).
pub(crate) enum F32Mut<'a> {
    Host(&'a mut [f32]),
    Cuda(&'a mut CudaBuffer<f32>),
}

/// An n-dimensional array on a device. Dropping the last handle to its elements (see
/// [`Tensor::share`]) frees their bytes on the device's ledger.
#[derive(Debug)]
pub struct Tensor {
    shape: Shape,
    device: Device,
    buffer: Arc<Buffer>,
}

fn check_len(op: &str, shape: &Shape, len: usize) -> Result<()> {
    if shape.numel() != len {
        return Err(Error::shape(
            op,
            format!("{} elements for shape {shape}", shape.numel()),
            format!("{len} elements"),
        ));
    }
    Ok(())
}

/// The error of a host-only operation on a tensor (or for a device) whose elements are on a GPU.
fn not_on_host(op: &str, device: &Device) -> Error {
    Error::NotOnHost { op: op.to_string(), device: device.to_string() }
}

impl Tensor {
    /// A tensor of host elements on `device`: counted on a CPU device's ledger, or uploaded to a GPU.
    fn from_storage(storage: HostStorage, shape: Shape, device: &Device) -> Result<Tensor> {
        check_len("Tensor::new", &shape, storage.len())?;
        match device {
            Device::Cpu(_) => {
                let bytes = (storage.len() * storage.dtype().size_in_bytes()) as u64;
                let reservation = device.reserve(bytes)?;
                Ok(Tensor::assemble(shape, Storage::Host(storage), device, Some(reservation)))
            }
            Device::Cuda(cuda) => {
                let storage = Storage::Cuda(CudaStorage::upload(cuda, &storage)?);
                Ok(Tensor::assemble(shape, storage, device, None))
            }
        }
    }

    fn assemble(shape: Shape, storage: Storage, device: &Device, reservation: Option<Reservation>) -> Tensor {
        Tensor { shape, device: device.clone(), buffer: Arc::new(Buffer { storage, _reservation: reservation }) }
    }

    /// An f32 tensor holding `buffer` (on `device`'s GPU and ledger) with `shape`.
    pub(crate) fn from_cuda_f32(buffer: CudaBuffer<f32>, shape: Shape, device: &Device) -> Result<Tensor> {
        check_len("Tensor::from_cuda_f32", &shape, buffer.len())?;
        Ok(Tensor::assemble(shape, Storage::Cuda(CudaStorage::from_f32(buffer)), device, None))
    }

    fn storage(&self) -> &Storage {
        &self.buffer.storage
    }

    /// The storage, writable: first a private copy (reserved on the ledger) when other handles
    /// share it.
    fn storage_mut(&mut self) -> Result<&mut Storage> {
        if Arc::get_mut(&mut self.buffer).is_none() {
            let buffer = match &self.buffer.storage {
                Storage::Host(host) => {
                    let reservation = self.device.reserve(self.size_in_bytes() as u64)?;
                    Buffer { storage: Storage::Host(host.clone()), _reservation: Some(reservation) }
                }
                Storage::Cuda(cuda) => Buffer { storage: Storage::Cuda(cuda.duplicate()?), _reservation: None },
            };
            self.buffer = Arc::new(buffer);
        }
        Ok(&mut Arc::get_mut(&mut self.buffer).expect("unique after the copy above").storage)
    }

    /// True when no other handle shares the elements, so writes need no copy.
    fn is_unique(&mut self) -> bool {
        Arc::get_mut(&mut self.buffer).is_some()
    }

    /// Reserves the bytes for `shape` of `dtype` on a CPU `device` before allocating them, so an
    /// over-budget request fails without touching host memory. On a GPU the host elements `make`
    /// returns are uploaded (the GPU's ledger counts the device buffer).
    fn alloc_with(
        shape: Shape,
        dtype: DType,
        device: &Device,
        make: impl FnOnce(usize) -> HostStorage,
    ) -> Result<Tensor> {
        let numel = shape.numel();
        match device {
            Device::Cpu(_) => {
                let reservation = device.reserve((numel * dtype.size_in_bytes()) as u64)?;
                let storage = make(numel);
                Ok(Tensor::assemble(shape, Storage::Host(storage), device, Some(reservation)))
            }
            Device::Cuda(_) => Tensor::from_storage(make(numel), shape, device),
        }
    }

    /// An f32 tensor of `shape` whose elements `init` writes, with no zero-fill first: the bytes
    /// are reserved on `device`'s ledger, then allocated uninitialised and handed to `init`,
    /// which must return the same slice as `&mut [f32]`. Safe code can only produce that slice
    /// by writing every element (the kernels of [`crate::cpu::uninit`] and
    /// [`crate::cpu::gemm::matmul_uninit`] do, and return it), so the tensor never holds
    /// uninitialised elements; any other slice is an error. `init` runs on the host: a CUDA
    /// `device` is [`Error::NotOnHost`].
    ///
    /// ```
    /// use conveyor_engine::{Device, Tensor, cpu::uninit};
    /// let t = Tensor::from_f32_init([2, 2], &Device::host(), |out| Ok(uninit::fill(out, 1.5)))?;
    /// assert_eq!(t.as_f32()?, &[1.5; 4]);
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn from_f32_init<F>(shape: impl Into<Shape>, device: &Device, init: F) -> Result<Tensor>
    where
        F: for<'a> FnOnce(&'a mut [MaybeUninit<f32>]) -> Result<&'a mut [f32]>,
    {
        let shape = shape.into();
        let numel = shape.numel();
        if let Device::Cuda(_) = device {
            return Err(not_on_host("Tensor::from_f32_init", device));
        }
        let reservation = device.reserve((numel * DType::F32.size_in_bytes()) as u64)?;
        let mut data: Vec<MaybeUninit<f32>> = Vec::with_capacity(numel);
        // SAFETY: the capacity is `numel`, and `MaybeUninit` elements need no initialisation.
        unsafe { data.set_len(numel) };
        let start = data.as_ptr() as *const f32;
        let written = init(&mut data)?;
        if numel > 0 && (written.as_ptr() != start || written.len() != numel) {
            return Err(Error::invalid(
                "Tensor::from_f32_init",
                format!("the initialiser must return the {numel}-element slice it was given, written in full"),
            ));
        }
        let mut data = ManuallyDrop::new(data);
        // SAFETY: a `&mut [f32]` over exactly this allocation existed, so every element was
        // written; `MaybeUninit<f32>` has the size and alignment of `f32`, and the pointer,
        // length and capacity come from a `Vec` of the same allocator.
        let data = unsafe { Vec::from_raw_parts(data.as_mut_ptr().cast::<f32>(), data.len(), data.capacity()) };
        Ok(Tensor::assemble(shape, Storage::Host(HostStorage::F32(data)), device, Some(reservation)))
    }

    /// A tensor of zeros.
    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::full(0.0, shape, dtype, device)
    }

    /// A tensor with every element `value` (rounded to `dtype`).
    pub fn full(value: f32, shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        if let Device::Cuda(cuda) = device
            && value.to_bits() == 0
        {
            // +0.0 is all zero bits in every dtype: a device memset, no upload.
            let storage = Storage::Cuda(CudaStorage::zeros(cuda, dtype, shape.numel())?);
            return Ok(Tensor::assemble(shape, storage, device, None));
        }
        Tensor::alloc_with(shape, dtype, device, |n| match dtype {
            DType::F32 => HostStorage::F32(vec![value; n]),
            DType::F16 => HostStorage::F16(vec![f16::from_f32(value); n]),
            DType::BF16 => HostStorage::BF16(vec![bf16::from_f32(value); n]),
        })
    }

    /// An f32 tensor taking ownership of `data` (row-major); uploaded when `device` is a GPU.
    pub fn from_vec(data: Vec<f32>, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        Tensor::from_storage(HostStorage::F32(data), shape.into(), device)
    }

    /// An f32 tensor copied from `data` (row-major); uploaded when `device` is a GPU.
    pub fn from_slice(data: &[f32], shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        check_len("Tensor::from_slice", &shape, data.len())?;
        if let Device::Cuda(cuda) = device {
            let storage = Storage::Cuda(CudaStorage::from_f32(cuda.upload(data)?));
            return Ok(Tensor::assemble(shape, storage, device, None));
        }
        Tensor::alloc_with(shape, DType::F32, device, |_| HostStorage::F32(data.to_vec()))
    }

    /// An f16 tensor taking ownership of `data`.
    pub fn from_f16_vec(data: Vec<f16>, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        Tensor::from_storage(HostStorage::F16(data), shape.into(), device)
    }

    /// A bf16 tensor taking ownership of `data`.
    pub fn from_bf16_vec(data: Vec<bf16>, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        Tensor::from_storage(HostStorage::BF16(data), shape.into(), device)
    }

    /// A tensor from little-endian bytes of `dtype` (the safetensors encoding).
    pub fn from_le_bytes(bytes: &[u8], dtype: DType, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        let width = dtype.size_in_bytes();
        if bytes.len() != shape.numel() * width {
            return Err(Error::shape(
                "Tensor::from_le_bytes",
                format!("{} bytes for {dtype} shape {shape}", shape.numel() * width),
                format!("{} bytes", bytes.len()),
            ));
        }
        let storage = match dtype {
            DType::F32 => {
                HostStorage::F32(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
            }
            DType::F16 => HostStorage::F16(bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])).collect()),
            DType::BF16 => {
                HostStorage::BF16(bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]])).collect())
            }
        };
        Tensor::from_storage(storage, shape, device)
    }

    /// The elements as little-endian bytes of the tensor's dtype (the safetensors encoding),
    /// downloaded from a GPU.
    ///
    /// # Panics
    ///
    /// Only when the CUDA driver fails the download of a GPU tensor (a broken context);
    /// [`Tensor::try_to_le_bytes`] returns that error instead.
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match self.storage() {
            Storage::Host(host) => host.to_le_bytes(),
            Storage::Cuda(_) => match self.try_to_le_bytes() {
                Ok(bytes) => bytes,
                Err(err) => panic!("Tensor::to_le_bytes: {err} (use try_to_le_bytes to handle this error)"),
            },
        }
    }

    /// [`Tensor::to_le_bytes`], with a failed download as an error.
    pub fn try_to_le_bytes(&self) -> Result<Vec<u8>> {
        match self.storage() {
            Storage::Host(host) => Ok(host.to_le_bytes()),
            Storage::Cuda(cuda) => Ok(cuda.download()?.to_le_bytes()),
        }
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.storage().dtype()
    }

    /// The device the tensor lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes the tensor holds on its device.
    pub fn size_in_bytes(&self) -> usize {
        self.numel() * self.dtype().size_in_bytes()
    }

    /// The f32 elements in host memory; an error for other dtypes, and [`Error::NotOnHost`] for a
    /// tensor on a GPU (copy it with `to_device(&Device::host())` first).
    pub fn as_f32(&self) -> Result<&[f32]> {
        match self.storage() {
            Storage::Host(HostStorage::F32(v)) => Ok(v),
            Storage::Host(other) => Err(Error::UnsupportedDType { op: "as_f32".into(), dtype: other.dtype() }),
            Storage::Cuda(_) => Err(not_on_host("as_f32", &self.device)),
        }
    }

    /// The f32 elements in host memory, mutable; an error for other dtypes, and
    /// [`Error::NotOnHost`] for a tensor on a GPU. A tensor whose elements another handle shares
    /// first gets a private copy, which can fail with `OutOfDeviceMemory`.
    pub fn as_f32_mut(&mut self) -> Result<&mut [f32]> {
        if let Storage::Cuda(_) = self.storage() {
            return Err(not_on_host("as_f32_mut", &self.device));
        }
        if self.dtype() != DType::F32 {
            return Err(Error::UnsupportedDType { op: "as_f32_mut".into(), dtype: self.dtype() });
        }
        match self.storage_mut()? {
            Storage::Host(HostStorage::F32(v)) => Ok(v),
            other => Err(Error::UnsupportedDType { op: "as_f32_mut".into(), dtype: other.dtype() }),
        }
    }

    /// The f32 elements wherever they live (`UnsupportedDType` for f16/bf16), for the engine's
    /// per-op device dispatch.
    pub(crate) fn f32_ref(&self, op: &str) -> Result<F32Ref<'_>> {
        match self.storage() {
            Storage::Host(HostStorage::F32(v)) => Ok(F32Ref::Host(v)),
            Storage::Host(other) => Err(Error::UnsupportedDType { op: op.to_string(), dtype: other.dtype() }),
            Storage::Cuda(cuda) => Ok(F32Ref::Cuda(cuda.f32(op)?)),
        }
    }

    /// The elements of a tensor on a GPU as an f32 operand ([`CudaF32`]: f16/bf16 upcast
    /// exactly); `None` on the host.
    pub(crate) fn cuda_f32_operand(&self) -> Result<Option<CudaF32<'_>>> {
        match self.storage() {
            Storage::Host(_) => Ok(None),
            Storage::Cuda(cuda) => Ok(Some(match cuda.upcast_f32()? {
                Some(upcast) => CudaF32::Upcast(upcast),
                None => CudaF32::Own(cuda.f32("cuda_f32_operand")?),
            })),
        }
    }

    /// The bf16 buffer of a tensor on a GPU; `None` on the host, `UnsupportedDType` for another
    /// dtype on a GPU.
    pub(crate) fn cuda_bf16(&self, op: &str) -> Result<Option<&crate::device::CudaBuffer<half::bf16>>> {
        match self.storage() {
            Storage::Host(_) => Ok(None),
            Storage::Cuda(cuda) => cuda.bf16(op).map(Some),
        }
    }

    /// The f16 buffer of a tensor on a GPU; `None` on the host, `UnsupportedDType` for another
    /// dtype on a GPU.
    pub(crate) fn cuda_f16(&self, op: &str) -> Result<Option<&crate::device::CudaBuffer<half::f16>>> {
        match self.storage() {
            Storage::Host(_) => Ok(None),
            Storage::Cuda(cuda) => cuda.f16(op).map(Some),
        }
    }

    /// The f32 elements wherever they live, writable (a shared tensor first gets a private copy).
    pub(crate) fn f32_mut(&mut self, op: &str) -> Result<F32Mut<'_>> {
        if self.dtype() != DType::F32 {
            return Err(Error::UnsupportedDType { op: op.to_string(), dtype: self.dtype() });
        }
        match self.storage_mut()? {
            Storage::Host(HostStorage::F32(v)) => Ok(F32Mut::Host(v)),
            Storage::Host(other) => Err(Error::UnsupportedDType { op: op.to_string(), dtype: other.dtype() }),
            Storage::Cuda(cuda) => Ok(F32Mut::Cuda(cuda.f32_mut(op)?)),
        }
    }

    /// The elements as f32 in host memory: borrowed for f32, converted for f16/bf16, and
    /// [`Error::NotOnHost`] on a GPU (for the CPU side of the device ops).
    pub(crate) fn host_f32(&self, op: &str) -> Result<Cow<'_, [f32]>> {
        match self.storage() {
            Storage::Host(HostStorage::F32(values)) => Ok(Cow::Borrowed(values)),
            Storage::Host(other) => Ok(Cow::Owned(other.to_vec_f32())),
            Storage::Cuda(_) => Err(not_on_host(op, &self.device)),
        }
    }

    /// A tensor of `dtype` on `device` from f32 values (rounded to nearest even when narrowing;
    /// uploaded when `device` is a GPU).
    pub(crate) fn from_f32_values(values: Vec<f32>, dtype: DType, shape: Shape, device: &Device) -> Result<Tensor> {
        Tensor::from_storage(HostStorage::from_f32(values, dtype), shape, device)
    }

    /// The elements converted to f32, on the host (downloaded from a GPU).
    ///
    /// # Panics
    ///
    /// Only when the CUDA driver fails the download of a GPU tensor (a broken context);
    /// [`Tensor::try_to_vec_f32`] returns that error instead.
    pub fn to_vec_f32(&self) -> Vec<f32> {
        match self.storage() {
            Storage::Host(host) => host.to_vec_f32(),
            Storage::Cuda(_) => match self.try_to_vec_f32() {
                Ok(values) => values,
                Err(err) => panic!("Tensor::to_vec_f32: {err} (use try_to_vec_f32 to handle this error)"),
            },
        }
    }

    /// [`Tensor::to_vec_f32`], with a failed download as an error.
    pub fn try_to_vec_f32(&self) -> Result<Vec<f32>> {
        match self.storage() {
            Storage::Host(host) => Ok(host.to_vec_f32()),
            Storage::Cuda(cuda) => Ok(cuda.download()?.into_vec_f32()),
        }
    }

    /// A copy converted to `dtype` (round-to-nearest-even when narrowing), on the same device (a
    /// GPU tensor is converted on the host: downloaded, converted, uploaded).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return self.try_clone();
        }
        // On a GPU, converted there (the same bits as on the CPU).
        if let Storage::Cuda(cuda) = self.storage() {
            let storage = Storage::Cuda(cuda.to_dtype(dtype)?);
            return Ok(Tensor::assemble(self.shape.clone(), storage, &self.device, None));
        }
        // Host f32 narrowed in one pass, without an f32 copy first (mixed precision rounds every
        // product's operands and results this way).
        if let Storage::Host(HostStorage::F32(values)) = self.storage() {
            let narrowed = match dtype {
                DType::F16 => HostStorage::F16(values.iter().map(|&x| f16::from_f32(x)).collect()),
                DType::BF16 => HostStorage::BF16(values.iter().map(|&x| bf16::from_f32(x)).collect()),
                DType::F32 => HostStorage::F32(values.clone()),
            };
            return Tensor::from_storage(narrowed, self.shape.clone(), &self.device);
        }
        let values = self.try_to_vec_f32()?;
        Tensor::from_storage(HostStorage::from_f32(values, dtype), self.shape.clone(), &self.device)
    }

    /// `self`, or a copy converted to `dtype` when it differs.
    pub(crate) fn into_dtype(self, dtype: DType) -> Result<Tensor> {
        if self.dtype() == dtype { Ok(self) } else { self.to_dtype(dtype) }
    }

    /// A copy of this tensor on `device` (counted against that device's budget): host to host,
    /// host to GPU (upload), GPU to host (download) or GPU to GPU (the same GPU or another, by
    /// peer access or through pinned host memory). The copy is complete when this returns, so
    /// it may be handed to another thread.
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        match (self.storage(), device) {
            (Storage::Host(host), Device::Cpu(_)) => Tensor::from_storage(host.clone(), self.shape.clone(), device),
            (Storage::Host(host), Device::Cuda(cuda)) => {
                let storage = Storage::Cuda(CudaStorage::upload(cuda, host)?);
                Ok(Tensor::assemble(self.shape.clone(), storage, device, None))
            }
            (Storage::Cuda(cuda), Device::Cpu(_)) => Tensor::from_storage(cuda.download()?, self.shape.clone(), device),
            (Storage::Cuda(cuda), Device::Cuda(target)) => {
                let storage = Storage::Cuda(cuda.copy_to(target)?);
                Ok(Tensor::assemble(self.shape.clone(), storage, device, None))
            }
        }
    }

    /// Moves this tensor onto `device`. Between CPU devices the elements are not copied: the bytes
    /// are reserved on the target's ledger and released from the source's (a host-memory stand-in
    /// for a device-to-device transfer); elements another handle shares stay on the source device
    /// for that handle, so they are copied instead, and then counted on both ledgers. To or from a
    /// GPU this is [`Tensor::to_device`] followed by dropping `self`.
    pub fn move_to_device(self, device: &Device) -> Result<Tensor> {
        if self.device.same_device(device) {
            return Ok(self);
        }
        if !matches!((self.storage(), device), (Storage::Host(_), Device::Cpu(_))) {
            return self.to_device(device);
        }
        let reservation = device.reserve(self.size_in_bytes() as u64)?;
        let storage = match Arc::try_unwrap(self.buffer) {
            Ok(buffer) => buffer.storage,
            Err(shared) => match &shared.storage {
                Storage::Host(host) => Storage::Host(host.clone()),
                Storage::Cuda(cuda) => Storage::Cuda(cuda.duplicate()?),
            },
        };
        Ok(Tensor::assemble(self.shape, storage, device, Some(reservation)))
    }

    /// A copy on the same device (its own bytes, counted on the ledger); see [`Tensor::share`]
    /// for a handle that costs nothing.
    pub fn try_clone(&self) -> Result<Tensor> {
        self.to_device(&self.device)
    }

    /// Another handle to the same elements, in O(1): no bytes are copied or reserved, the
    /// ledger counts the elements once until the last handle drops, and a write through any
    /// handle first gives that handle a private copy (so neither sees the other's writes).
    pub fn share(&self) -> Tensor {
        Tensor { shape: self.shape.clone(), device: self.device.clone(), buffer: Arc::clone(&self.buffer) }
    }

    /// True when both tensors are handles to the same elements (see [`Tensor::share`]); their
    /// bytes are then counted once on the ledger.
    pub fn shares_storage_with(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.buffer, &other.buffer)
    }

    /// The same elements under another shape with the same element count (no copy).
    pub fn reshape(mut self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.numel() != self.numel() {
            return Err(Error::shape("reshape", format!("a shape of {} elements", self.numel()), shape.to_string()));
        }
        self.shape = shape;
        Ok(self)
    }

    /// Rows `start..start + len` of the leading dimension, copied (micro-batch slicing), on the
    /// same device.
    pub fn narrow_rows(&self, start: usize, len: usize) -> Result<Tensor> {
        let rows = self.shape.leading();
        if self.shape.rank() == 0 || start + len > rows {
            return Err(Error::shape(
                "narrow_rows",
                format!("rows {start}..{} within {rows}", start + len),
                self.shape.to_string(),
            ));
        }
        let per_row = self.shape.trailing_numel();
        let range = start * per_row..(start + len) * per_row;
        match self.storage() {
            Storage::Host(host) => Tensor::from_storage(host.slice(range), self.shape.with_leading(len), &self.device),
            Storage::Cuda(cuda) => {
                let storage = Storage::Cuda(cuda.copy_range(range.start, range.len())?);
                Ok(Tensor::assemble(self.shape.with_leading(len), storage, &self.device, None))
            }
        }
    }

    /// Concatenates f32 tensors along the leading dimension onto `device` (parts on a GPU are
    /// downloaded; the result is uploaded when `device` is a GPU).
    pub fn cat_rows(parts: &[&Tensor], device: &Device) -> Result<Tensor> {
        let first = parts.first().ok_or_else(|| Error::invalid("cat_rows", "no tensors given"))?;
        let mut rows = 0;
        let mut data = Vec::new();
        for part in parts {
            if part.dims().get(1..) != first.dims().get(1..) {
                return Err(Error::shape(
                    "cat_rows",
                    format!("trailing dims of {}", first.shape()),
                    part.shape().to_string(),
                ));
            }
            rows += part.shape().leading();
            match part.storage() {
                Storage::Cuda(_) if part.dtype() == DType::F32 => data.extend(part.try_to_vec_f32()?),
                _ => data.extend_from_slice(part.as_f32()?),
            }
        }
        Tensor::from_vec(data, first.shape().with_leading(rows), device)
    }

    /// `self += other`, elementwise (f32; shapes must match; on a GPU both on the same device).
    /// Used to accumulate gradients. A shared `self` gets its private copy in the same pass (no
    /// copy, then add).
    pub fn add_assign(&mut self, other: &Tensor) -> Result<()> {
        if self.shape != other.shape {
            return Err(Error::shape("add_assign", self.shape.to_string(), other.shape.to_string()));
        }
        if let Storage::Cuda(_) = self.storage() {
            return self.add_assign_on_gpu(other);
        }
        let src = other.as_f32()?;
        if !self.is_unique() {
            let sum = Tensor::from_f32_init(self.shape.clone(), &self.device, |out| {
                crate::cpu::uninit::map2(out, self.as_f32()?, src, |d, s| d + s)
            })?;
            self.buffer = sum.buffer;
            return Ok(());
        }
        for (d, s) in self.as_f32_mut()?.iter_mut().zip(src) {
            *d += *s;
        }
        Ok(())
    }

    /// [`Tensor::add_assign`] on a GPU: `other` must be f32 on the same device (the runtime sums
    /// half gradients through f32 copies). A shared `self`
    /// takes the sum as fresh elements (one pass, no copy first).
    fn add_assign_on_gpu(&mut self, other: &Tensor) -> Result<()> {
        let op = "add_assign";
        let here = self.device.to_string();
        let mismatch =
            |device: &Device| Error::DeviceMismatch { op: op.to_string(), lhs: here.clone(), rhs: device.to_string() };
        if !other.device.same_device(&self.device) {
            return Err(mismatch(&other.device));
        }
        let F32Ref::Cuda(src) = other.f32_ref(op)? else { return Err(mismatch(&other.device)) };
        if !self.is_unique() {
            let F32Ref::Cuda(lhs) = self.f32_ref(op)? else { return Err(mismatch(&self.device)) };
            let stream = lhs.device().thread_stream()?;
            let mut sum = lhs.device().alloc_zeros::<f32>(lhs.len())?;
            stream.add(lhs, src, &mut sum)?;
            let storage = Storage::Cuda(CudaStorage::from_f32(sum));
            self.buffer = Arc::new(Buffer { storage, _reservation: None });
            return Ok(());
        }
        let F32Mut::Cuda(dst) = self.f32_mut(op)? else {
            return Err(Error::DeviceMismatch { op: op.to_string(), lhs: here.clone(), rhs: here });
        };
        let stream = dst.device().thread_stream()?;
        stream.add_assign(dst, src)
    }

    /// Multiplies every element by `factor` in place (f32).
    pub fn scale_in_place(&mut self, factor: f32) -> Result<()> {
        match self.f32_mut("scale_in_place")? {
            F32Mut::Host(values) => values.iter_mut().for_each(|x| *x *= factor),
            F32Mut::Cuda(buffer) => {
                let stream = buffer.device().thread_stream()?;
                stream.scale(buffer, factor)?;
            }
        }
        Ok(())
    }

    /// Sets every element to zero in place. A shared tensor instead takes fresh zeroed bytes,
    /// counted on the ledger even past its budget (this method cannot fail on the budget; see
    /// [`Tensor::try_fill_zero`]).
    ///
    /// # Panics
    ///
    /// Only on a GPU whose driver fails the zero-fill, or has no memory left for the fresh bytes
    /// of a shared tensor (the budget aside): leaving stale values would silently corrupt the
    /// gradients this is used for. [`Tensor::try_fill_zero`] returns such errors instead.
    pub fn fill_zero(&mut self) {
        if self.try_fill_zero().is_ok() {
            return;
        }
        let (dtype, numel) = (self.dtype(), self.numel());
        let buffer = match &self.device {
            Device::Cpu(_) => {
                let reservation = self.device.memory().reserve_past_budget(self.size_in_bytes() as u64);
                Buffer { storage: Storage::Host(HostStorage::zeroed(dtype, numel)), _reservation: Some(reservation) }
            }
            Device::Cuda(cuda) => match CudaStorage::zeros_past_budget(cuda, dtype, numel) {
                Ok(storage) => Buffer { storage: Storage::Cuda(storage), _reservation: None },
                Err(err) => panic!("Tensor::fill_zero on {}: {err}", self.device),
            },
        };
        self.buffer = Arc::new(buffer);
    }

    /// Gives this handle private elements if another handle shares them (a copy reserved on the
    /// ledger, `OutOfDeviceMemory` past the budget), so that later writes need no allocation.
    pub fn make_unique(&mut self) -> Result<()> {
        self.storage_mut().map(|_| ())
    }

    /// True when another handle shares the elements ([`Tensor::share`]), so a write would copy.
    pub fn is_shared(&self) -> bool {
        Arc::strong_count(&self.buffer) > 1
    }

    /// True when some element is NaN or infinite (downloaded from a GPU; f16/bf16 converted).
    pub fn has_non_finite(&self) -> Result<bool> {
        Ok(match self.storage() {
            Storage::Host(HostStorage::F32(values)) => !values.iter().all(|v| v.is_finite()),
            _ => !self.try_to_vec_f32()?.iter().all(|v| v.is_finite()),
        })
    }

    /// Sets every element to zero in place; a shared tensor takes fresh zeroed bytes, reserved
    /// on the ledger (`OutOfDeviceMemory` past the budget).
    pub fn try_fill_zero(&mut self) -> Result<()> {
        if !self.is_unique() {
            let fresh = Tensor::zeros(self.shape.clone(), self.dtype(), &self.device)?;
            self.buffer = fresh.buffer;
            return Ok(());
        }
        match self.storage_mut()? {
            Storage::Host(host) => host.fill_zero(),
            Storage::Cuda(cuda) => cuda.fill_zero()?,
        }
        Ok(())
    }

    /// Copies `other`'s elements into this tensor (same shape and dtype, any devices), reusing the
    /// allocation. A shared tensor instead becomes another handle to `other`'s elements when both
    /// are on one device (no copy), or takes a fresh copy of them.
    pub fn copy_from(&mut self, other: &Tensor) -> Result<()> {
        if self.shape != other.shape || self.dtype() != other.dtype() {
            return Err(Error::shape(
                "copy_from",
                format!("{} {}", self.dtype(), self.shape),
                format!("{} {}", other.dtype(), other.shape),
            ));
        }
        if !self.is_unique() {
            self.buffer = if self.device.same_device(&other.device) {
                Arc::clone(&other.buffer)
            } else {
                other.to_device(&self.device)?.buffer
            };
            return Ok(());
        }
        let copied = match (self.storage_mut()?, other.storage()) {
            (Storage::Host(dst), Storage::Host(src)) => dst.copy_from(src),
            (Storage::Host(dst), Storage::Cuda(src)) => dst.copy_from(&src.download()?),
            (Storage::Cuda(dst), Storage::Host(src)) => dst.upload_into(src).map(|()| true)?,
            (Storage::Cuda(dst), Storage::Cuda(src)) => dst.copy_from(src).map(|()| true)?,
        };
        if !copied {
            return Err(Error::shape("copy_from", "elements of one dtype and length", "a different dtype or length"));
        }
        Ok(())
    }

    /// True when both tensors have the same shape, dtype and bit-identical elements (false when
    /// a GPU tensor cannot be downloaded).
    pub fn bit_eq(&self, other: &Tensor) -> bool {
        self.shape == other.shape
            && self.dtype() == other.dtype()
            && match (self.try_to_le_bytes(), other.try_to_le_bytes()) {
                (Ok(lhs), Ok(rhs)) => lhs == rhs,
                _ => false,
            }
    }
}
