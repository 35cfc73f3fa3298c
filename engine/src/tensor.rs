//! `Tensor`: a shape, a dtype and contiguous row-major storage on a device, counted against the
//! device's memory budget for as long as the tensor lives.
use half::{bf16, f16};

use crate::device::Reservation;
use crate::{DType, Device, Error, Result, Shape};

/// Contiguous element storage of one dtype.
#[derive(Debug)]
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

/// An n-dimensional array on a device. Owning: dropping it frees its bytes on the device's ledger.
#[derive(Debug)]
pub struct Tensor {
    shape: Shape,
    storage: Storage,
    device: Device,
    _reservation: Reservation,
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
        Ok(Tensor { shape, storage, device: device.clone(), _reservation: reservation })
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
        Ok(Tensor { shape, storage, device: device.clone(), _reservation: reservation })
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
        match &self.storage {
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
        self.storage.dtype()
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
        match &self.storage {
            Storage::F32(v) => Ok(v),
            other => Err(Error::UnsupportedDType { op: "as_f32".into(), dtype: other.dtype() }),
        }
    }

    /// The f32 elements, mutable; an error for other dtypes.
    pub fn as_f32_mut(&mut self) -> Result<&mut [f32]> {
        match &mut self.storage {
            Storage::F32(v) => Ok(v),
            other => Err(Error::UnsupportedDType { op: "as_f32_mut".into(), dtype: other.dtype() }),
        }
    }

    /// The elements converted to f32, on the host.
    pub fn to_vec_f32(&self) -> Vec<f32> {
        match &self.storage {
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
        let storage = match &self.storage {
            Storage::F32(v) => Storage::F32(v.clone()),
            Storage::F16(v) => Storage::F16(v.clone()),
            Storage::BF16(v) => Storage::BF16(v.clone()),
        };
        Tensor::from_storage(storage, self.shape.clone(), device)
    }

    /// Moves this tensor onto `device` without copying its elements: the bytes are reserved on
    /// the target's ledger and released from the source's (a host-memory stand-in for a
    /// device-to-device transfer).
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
        Ok(Tensor { shape: self.shape, storage: self.storage, device: device.clone(), _reservation: reservation })
    }

    /// A copy on the same device.
    pub fn try_clone(&self) -> Result<Tensor> {
        self.to_device(&self.device)
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
        let storage = match &self.storage {
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

    /// `self += other`, elementwise (f32; shapes must match). Used to accumulate gradients.
    pub fn add_assign(&mut self, other: &Tensor) -> Result<()> {
        if self.shape != other.shape {
            return Err(Error::shape("add_assign", self.shape.to_string(), other.shape.to_string()));
        }
        let src = other.as_f32()?;
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

    /// Sets every element to zero in place.
    pub fn fill_zero(&mut self) {
        match &mut self.storage {
            Storage::F32(v) => v.fill(0.0),
            Storage::F16(v) => v.fill(f16::ZERO),
            Storage::BF16(v) => v.fill(bf16::ZERO),
        }
    }

    /// Copies `other`'s elements into this tensor (same shape and dtype), reusing the allocation.
    pub fn copy_from(&mut self, other: &Tensor) -> Result<()> {
        if self.shape != other.shape || self.dtype() != other.dtype() {
            return Err(Error::shape(
                "copy_from",
                format!("{} {}", self.dtype(), self.shape),
                format!("{} {}", other.dtype(), other.shape),
            ));
        }
        match (&mut self.storage, &other.storage) {
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
