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
use std::mem::{ManuallyDrop, MaybeUninit};
use std::sync::Arc;

use half::{bf16, f16};

use crate::device::Reservation;
use crate::{DType, Device, Error, Result, Shape};

/// Contiguous element storage of one dtype.
#[derive(Clone, Debug)]
enum Storage {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl Storage {
    fn dtype(&self) -> DType {
        match self {
            Storage::F32(_) => DType::F32,
            Storage::F16(_) => DType::F16,
            Storage::BF16(_) => DType::BF16,
        }
    }

    fn len(&self) -> usize {
        match self {
            Storage::F32(v) => v.len(),
            Storage::F16(v) => v.len(),
            Storage::BF16(v) => v.len(),
        }
    }
}

/// Elements and the ledger reservation that counts them, shared by every handle to them.
#[derive(Debug)]
struct Buffer {
    storage: Storage,
    _reservation: Reservation,
}

/// An n-dimensional array on a device. Dropping the last handle to its elements (see
/// [`Tensor::share`]) frees their bytes on the device's ledger.
#[derive(Debug)]
pub struct Tensor {
    shape: Shape,
    device: Device,
    buffer: Arc<Buffer>,
}

/// `numel` zeros of `dtype`.
fn zeroed(dtype: DType, numel: usize) -> Storage {
    match dtype {
        DType::F32 => Storage::F32(vec![0.0; numel]),
        DType::F16 => Storage::F16(vec![f16::ZERO; numel]),
        DType::BF16 => Storage::BF16(vec![bf16::ZERO; numel]),
    }
}

fn check_len(op: &str, shape: &Shape, len: usize) -> Result<()> {
    if shape.numel() != len {
        return Err(Error::shape(op, format!("{} elements for shape {shape}", shape.numel()), format!("{len} elements")));
    }
    Ok(())
}

impl Tensor {
    fn from_storage(storage: Storage, shape: Shape, device: &Device) -> Result<Tensor> {
        check_len("Tensor::new", &shape, storage.len())?;
        if let Device::Cuda(_) = device {
            return Err(Error::CudaUnavailable(format!(
                "{device}: CUDA tensors are not implemented yet in this build; use cpu devices"
            )));
        }
        let bytes = (storage.len() * storage.dtype().size_in_bytes()) as u64;
        let reservation = device.reserve(bytes)?;
        Ok(Tensor::assemble(shape, storage, device, reservation))
    }

    fn assemble(shape: Shape, storage: Storage, device: &Device, reservation: Reservation) -> Tensor {
        Tensor { shape, device: device.clone(), buffer: Arc::new(Buffer { storage, _reservation: reservation }) }
    }

    fn storage(&self) -> &Storage {
        &self.buffer.storage
    }

    /// The storage, writable: first a private copy (reserved on the ledger) when other handles
    /// share it.
    fn storage_mut(&mut self) -> Result<&mut Storage> {
        if Arc::get_mut(&mut self.buffer).is_none() {
            let reservation = self.device.reserve(self.size_in_bytes() as u64)?;
            let storage = self.buffer.storage.clone();
            self.buffer = Arc::new(Buffer { storage, _reservation: reservation });
        }
        Ok(&mut Arc::get_mut(&mut self.buffer).expect("unique after the copy above").storage)
    }

    /// True when no other handle shares the elements, so writes need no copy.
    fn is_unique(&mut self) -> bool {
        Arc::get_mut(&mut self.buffer).is_some()
    }

    /// Reserves the bytes for `shape` of `dtype` on `device` before allocating them, so an
    /// over-budget request fails without touching host memory.
    fn alloc_with(shape: Shape, dtype: DType, device: &Device, make: impl FnOnce(usize) -> Storage) -> Result<Tensor> {
        let numel = shape.numel();
        if let Device::Cuda(_) = device {
            return Err(Error::CudaUnavailable(format!(
                "{device}: CUDA tensors are not implemented yet in this build; use cpu devices"
            )));
        }
        let reservation = device.reserve((numel * dtype.size_in_bytes()) as u64)?;
        let storage = make(numel);
        Ok(Tensor::assemble(shape, storage, device, reservation))
    }

    /// An f32 tensor of `shape` whose elements `init` writes, with no zero-fill first: the bytes
    /// are reserved on `device`'s ledger, then allocated uninitialised and handed to `init`,
    /// which must return the same slice as `&mut [f32]`. Safe code can only produce that slice
    /// by writing every element (the kernels of [`crate::cpu::uninit`] and
    /// [`crate::cpu::gemm::matmul_uninit`] do, and return it), so the tensor never holds
    /// uninitialised elements; any other slice is an error.
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
            return Err(Error::CudaUnavailable(format!(
                "{device}: CUDA tensors are not implemented yet in this build; use cpu devices"
            )));
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
        Ok(Tensor::assemble(shape, Storage::F32(data), device, reservation))
    }

    /// A tensor of zeros.
    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::full(0.0, shape, dtype, device)
    }

    /// A tensor with every element `value` (rounded to `dtype`).
    pub fn full(value: f32, shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::alloc_with(shape.into(), dtype, device, |n| match dtype {
            DType::F32 => Storage::F32(vec![value; n]),
            DType::F16 => Storage::F16(vec![f16::from_f32(value); n]),
            DType::BF16 => Storage::BF16(vec![bf16::from_f32(value); n]),
        })
    }

    /// An f32 tensor taking ownership of `data` (row-major).
    pub fn from_vec(data: Vec<f32>, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        Tensor::from_storage(Storage::F32(data), shape.into(), device)
    }

    /// An f32 tensor copied from `data` (row-major).
    pub fn from_slice(data: &[f32], shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        check_len("Tensor::from_slice", &shape, data.len())?;
        Tensor::alloc_with(shape, DType::F32, device, |_| Storage::F32(data.to_vec()))
    }

    /// An f16 tensor taking ownership of `data`.
    pub fn from_f16_vec(data: Vec<f16>, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        Tensor::from_storage(Storage::F16(data), shape.into(), device)
    }

    /// A bf16 tensor taking ownership of `data`.
    pub fn from_bf16_vec(data: Vec<bf16>, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        Tensor::from_storage(Storage::BF16(data), shape.into(), device)
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
            DType::F32 => Storage::F32(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
            DType::F16 => Storage::F16(bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])).collect()),
            DType::BF16 => Storage::BF16(bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]])).collect()),
        };
        Tensor::from_storage(storage, shape, device)
    }

    /// The elements as little-endian bytes of the tensor's dtype (the safetensors encoding).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match self.storage() {
            Storage::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Storage::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Storage::BF16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
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

    /// The f32 elements; an error for other dtypes.
    pub fn as_f32(&self) -> Result<&[f32]> {
        match self.storage() {
            Storage::F32(v) => Ok(v),
            other => Err(Error::UnsupportedDType { op: "as_f32".into(), dtype: other.dtype() }),
        }
    }

    /// The f32 elements, mutable; an error for other dtypes. A tensor whose elements another
    /// handle shares first gets a private copy, which can fail with `OutOfDeviceMemory`.
    pub fn as_f32_mut(&mut self) -> Result<&mut [f32]> {
        if self.dtype() != DType::F32 {
            return Err(Error::UnsupportedDType { op: "as_f32_mut".into(), dtype: self.dtype() });
        }
        match self.storage_mut()? {
            Storage::F32(v) => Ok(v),
            _ => unreachable!("dtype checked above"),
        }
    }

    /// The elements converted to f32, on the host.
    pub fn to_vec_f32(&self) -> Vec<f32> {
        match self.storage() {
            Storage::F32(v) => v.clone(),
            Storage::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Storage::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// A copy converted to `dtype` (round-to-nearest-even when narrowing), on the same device.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return self.try_clone();
        }
        let values = self.to_vec_f32();
        let storage = match dtype {
            DType::F32 => Storage::F32(values),
            DType::F16 => Storage::F16(values.iter().map(|&x| f16::from_f32(x)).collect()),
            DType::BF16 => Storage::BF16(values.iter().map(|&x| bf16::from_f32(x)).collect()),
        };
        Tensor::from_storage(storage, self.shape.clone(), &self.device)
    }

    /// A copy of this tensor on `device` (counted against that device's budget).
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        Tensor::from_storage(self.storage().clone(), self.shape.clone(), device)
    }

    /// Moves this tensor onto `device` without copying its elements: the bytes are reserved on
    /// the target's ledger and released from the source's (a host-memory stand-in for a
    /// device-to-device transfer). Elements another handle shares stay on the source device
    /// for that handle, so they are copied instead, and then counted on both ledgers.
    pub fn move_to_device(self, device: &Device) -> Result<Tensor> {
        if self.device.same_device(device) {
            return Ok(self);
        }
        if let Device::Cuda(_) = device {
            return Err(Error::CudaUnavailable(format!(
                "{device}: CUDA tensors are not implemented yet in this build; use cpu devices"
            )));
        }
        let reservation = device.reserve(self.size_in_bytes() as u64)?;
        match Arc::try_unwrap(self.buffer) {
            Ok(buffer) => Ok(Tensor::assemble(self.shape, buffer.storage, device, reservation)),
            Err(shared) => Ok(Tensor::assemble(self.shape, shared.storage.clone(), device, reservation)),
        }
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

    /// Rows `start..start + len` of the leading dimension, copied (micro-batch slicing).
    pub fn narrow_rows(&self, start: usize, len: usize) -> Result<Tensor> {
        let rows = self.shape.leading();
        if self.shape.rank() == 0 || start + len > rows {
            return Err(Error::shape("narrow_rows", format!("rows {start}..{} within {rows}", start + len), self.shape.to_string()));
        }
        let per_row = self.shape.trailing_numel();
        let range = start * per_row..(start + len) * per_row;
        let storage = match self.storage() {
            Storage::F32(v) => Storage::F32(v[range].to_vec()),
            Storage::F16(v) => Storage::F16(v[range].to_vec()),
            Storage::BF16(v) => Storage::BF16(v[range].to_vec()),
        };
        Tensor::from_storage(storage, self.shape.with_leading(len), &self.device)
    }

    /// Concatenates f32 tensors along the leading dimension onto `device`.
    pub fn cat_rows(parts: &[&Tensor], device: &Device) -> Result<Tensor> {
        let first = parts.first().ok_or_else(|| Error::invalid("cat_rows", "no tensors given"))?;
        let mut rows = 0;
        let mut data = Vec::new();
        for part in parts {
            if part.dims().get(1..) != first.dims().get(1..) {
                return Err(Error::shape("cat_rows", format!("trailing dims of {}", first.shape()), part.shape().to_string()));
            }
            rows += part.shape().leading();
            data.extend_from_slice(part.as_f32()?);
        }
        Tensor::from_vec(data, first.shape().with_leading(rows), device)
    }

    /// `self += other`, elementwise (f32; shapes must match). Used to accumulate gradients. A
    /// shared `self` gets its private copy in the same pass (no copy, then add).
    pub fn add_assign(&mut self, other: &Tensor) -> Result<()> {
        if self.shape != other.shape {
            return Err(Error::shape("add_assign", self.shape.to_string(), other.shape.to_string()));
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

    /// Multiplies every element by `factor` in place (f32).
    pub fn scale_in_place(&mut self, factor: f32) -> Result<()> {
        self.as_f32_mut()?.iter_mut().for_each(|x| *x *= factor);
        Ok(())
    }

    /// Sets every element to zero in place. A shared tensor instead takes fresh zeroed bytes,
    /// counted on the ledger even past its budget (this method cannot fail; see
    /// [`Tensor::try_fill_zero`]).
    pub fn fill_zero(&mut self) {
        if self.try_fill_zero().is_err() {
            let reservation = self.device.memory().reserve_past_budget(self.size_in_bytes() as u64);
            let storage = zeroed(self.dtype(), self.numel());
            self.buffer = Arc::new(Buffer { storage, _reservation: reservation });
        }
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
            Storage::F32(v) => v.fill(0.0),
            Storage::F16(v) => v.fill(f16::ZERO),
            Storage::BF16(v) => v.fill(bf16::ZERO),
        }
        Ok(())
    }

    /// Copies `other`'s elements into this tensor (same shape and dtype), reusing the allocation.
    /// A shared tensor instead becomes another handle to `other`'s elements when both are on one
    /// device (no copy), or takes a fresh copy of them.
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
        match (self.storage_mut()?, other.storage()) {
            (Storage::F32(d), Storage::F32(s)) => d.copy_from_slice(s),
            (Storage::F16(d), Storage::F16(s)) => d.copy_from_slice(s),
            (Storage::BF16(d), Storage::BF16(s)) => d.copy_from_slice(s),
            _ => unreachable!("dtypes checked equal above"),
        }
        Ok(())
    }

    /// True when both tensors have the same shape, dtype and bit-identical elements.
    pub fn bit_eq(&self, other: &Tensor) -> bool {
        self.shape == other.shape && self.dtype() == other.dtype() && self.to_le_bytes() == other.to_le_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::uninit;

    fn on(device: &Device, values: &[f32]) -> Tensor {
        Tensor::from_slice(values, [values.len()], device).unwrap()
    }

    #[test]
    fn shares_are_counted_once_and_freed_with_the_last_handle() {
        let device = Device::cpu(0);
        let a = on(&device, &[1.0, 2.0, 3.0, 4.0]);
        let b = a.share().reshape([2, 2]).unwrap();
        assert!(a.shares_storage_with(&b));
        assert_eq!(device.memory_in_use(), 16);
        drop(a);
        assert_eq!(device.memory_in_use(), 16, "b still holds the bytes");
        assert_eq!(b.as_f32().unwrap(), &[1.0, 2.0, 3.0, 4.0]);
        drop(b);
        assert_eq!(device.memory_in_use(), 0);
    }

    #[test]
    fn every_write_to_a_shared_tensor_leaves_the_other_handle_unchanged() {
        let device = Device::cpu(0);
        let original = on(&device, &[1.0, 2.0]);
        let writes: [fn(&mut Tensor); 6] = [
            |t| t.as_f32_mut().unwrap()[0] = 9.0,
            |t| t.add_assign(&Tensor::from_slice(&[1.0, 1.0], [2], t.device()).unwrap()).unwrap(),
            |t| t.scale_in_place(3.0).unwrap(),
            Tensor::fill_zero,
            |t| t.try_fill_zero().unwrap(),
            |t| t.copy_from(&Tensor::from_slice(&[5.0, 6.0], [2], t.device()).unwrap()).unwrap(),
        ];
        let expected: [&[f32]; 6] = [&[9.0, 2.0], &[2.0, 3.0], &[3.0, 6.0], &[0.0, 0.0], &[0.0, 0.0], &[5.0, 6.0]];
        for (write, expected) in writes.iter().zip(expected) {
            let mut copy = original.share();
            write(&mut copy);
            assert_eq!(copy.as_f32().unwrap(), expected);
            assert_eq!(original.as_f32().unwrap(), &[1.0, 2.0], "the other handle never sees the write");
            assert!(!copy.shares_storage_with(&original));
            assert_eq!(device.memory_in_use(), 16, "the private copy is on the ledger");
        }
        assert_eq!(device.memory_in_use(), 8);
    }

    #[test]
    fn writes_to_an_unshared_tensor_reuse_its_bytes() {
        let device = Device::cpu(0);
        let mut t = on(&device, &[1.0, 2.0]);
        let before = t.as_f32().unwrap().as_ptr();
        t.as_f32_mut().unwrap()[1] = 7.0;
        t.add_assign(&on(&device, &[1.0, 1.0])).unwrap();
        t.fill_zero();
        assert_eq!(t.as_f32().unwrap().as_ptr(), before);
        assert_eq!(device.memory_in_use(), 8);
    }

    #[test]
    fn the_private_copy_of_a_shared_tensor_respects_the_budget() {
        let device = Device::cpu_with_budget(0, Some(12));
        let a = on(&device, &[1.0, 2.0]);
        let mut b = a.share();
        assert!(matches!(b.as_f32_mut(), Err(Error::OutOfDeviceMemory { requested: 8, in_use: 8, .. })));
        assert!(matches!(b.try_fill_zero(), Err(Error::OutOfDeviceMemory { .. })));
        assert_eq!(b.as_f32().unwrap(), &[1.0, 2.0]);
        // fill_zero cannot fail: it counts its fresh bytes past the budget.
        b.fill_zero();
        assert_eq!((device.memory_in_use(), device.peak_memory()), (16, 16));
        assert_eq!(a.as_f32().unwrap(), &[1.0, 2.0]);
    }

    #[test]
    fn moving_a_shared_tensor_copies_it_onto_the_target() {
        let (source, target) = (Device::cpu(0), Device::cpu(1));
        let a = on(&source, &[1.0, 2.0]);
        let moved = a.share().move_to_device(&target).unwrap();
        assert!(!moved.shares_storage_with(&a));
        assert_eq!((source.memory_in_use(), target.memory_in_use()), (8, 8));
        let moved_again = a.move_to_device(&source).unwrap().move_to_device(&target).unwrap();
        assert_eq!((source.memory_in_use(), target.memory_in_use()), (0, 16));
        assert_eq!(moved_again.as_f32().unwrap(), moved.as_f32().unwrap());
    }

    #[test]
    fn try_clone_is_a_real_copy() {
        let device = Device::cpu(0);
        let a = on(&device, &[1.0, 2.0]);
        let b = a.try_clone().unwrap();
        assert!(!a.shares_storage_with(&b));
        assert_eq!(device.memory_in_use(), 16);
    }

    #[test]
    fn from_f32_init_reserves_first_and_demands_the_whole_slice_back() {
        let device = Device::cpu_with_budget(0, Some(16));
        let t =
            Tensor::from_f32_init([2, 2], &device, |out| uninit::map(out, &[1.0, -2.0, 3.0, -4.0], f32::abs)).unwrap();
        assert_eq!(t.as_f32().unwrap(), &[1.0, 2.0, 3.0, 4.0]);
        assert!(matches!(
            Tensor::from_f32_init([1], &device, |out| Ok(uninit::fill(out, 0.0))),
            Err(Error::OutOfDeviceMemory { .. })
        ));
        drop(t);
        let elsewhere = Box::leak(vec![0.0f32; 4].into_boxed_slice());
        assert!(matches!(Tensor::from_f32_init([4], &device, |_| Ok(elsewhere)), Err(Error::InvalidArgument { .. })));
        let short = Tensor::from_f32_init([4], &device, |out| Ok(uninit::fill(&mut out[..2], 0.0)));
        assert!(matches!(short, Err(Error::InvalidArgument { .. })));
        assert_eq!(device.memory_in_use(), 0, "a refused initialiser releases its reservation");
        let empty = Tensor::from_f32_init([0, 3], &device, |out| Ok(uninit::fill(out, 1.0))).unwrap();
        assert_eq!(empty.numel(), 0);
    }
}
