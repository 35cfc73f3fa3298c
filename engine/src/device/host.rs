//! [`HostStorage`]: a tensor's elements in host memory, one `Vec` per dtype. It is the storage of
//! tensors on CPU devices, and the host side of every upload to and download from a GPU
//! (`CudaStorage::upload` and `CudaStorage::download` take and give it), so a dtype conversion or a
//! byte encoding is written once here for every device.
use half::{bf16, f16};

use crate::DType;

/// Contiguous row-major elements of one dtype in host memory.
#[derive(Clone, Debug)]
pub(crate) enum HostStorage {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl HostStorage {
    /// `numel` zeros of `dtype`.
    pub(crate) fn zeroed(dtype: DType, numel: usize) -> HostStorage {
        match dtype {
            DType::F32 => HostStorage::F32(vec![0.0; numel]),
            DType::F16 => HostStorage::F16(vec![f16::ZERO; numel]),
            DType::BF16 => HostStorage::BF16(vec![bf16::ZERO; numel]),
        }
    }

    /// `values` rounded to `dtype` (round-to-nearest-even when narrowing; no copy for f32).
    pub(crate) fn from_f32(values: Vec<f32>, dtype: DType) -> HostStorage {
        match dtype {
            DType::F32 => HostStorage::F32(values),
            DType::F16 => HostStorage::F16(values.iter().map(|&x| f16::from_f32(x)).collect()),
            DType::BF16 => HostStorage::BF16(values.iter().map(|&x| bf16::from_f32(x)).collect()),
        }
    }

    /// The element type.
    pub(crate) fn dtype(&self) -> DType {
        match self {
            HostStorage::F32(_) => DType::F32,
            HostStorage::F16(_) => DType::F16,
            HostStorage::BF16(_) => DType::BF16,
        }
    }

    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        match self {
            HostStorage::F32(v) => v.len(),
            HostStorage::F16(v) => v.len(),
            HostStorage::BF16(v) => v.len(),
        }
    }

    /// The elements converted to f32 (a copy).
    pub(crate) fn to_vec_f32(&self) -> Vec<f32> {
        match self {
            HostStorage::F32(v) => v.clone(),
            HostStorage::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            HostStorage::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// The elements converted to f32, taking ownership (no copy for f32).
    pub(crate) fn into_vec_f32(self) -> Vec<f32> {
        match self {
            HostStorage::F32(v) => v,
            other => other.to_vec_f32(),
        }
    }

    /// The elements as little-endian bytes of their dtype (the safetensors encoding).
    pub(crate) fn to_le_bytes(&self) -> Vec<u8> {
        match self {
            HostStorage::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            HostStorage::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            HostStorage::BF16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// Elements `range` (a copy).
    pub(crate) fn slice(&self, range: std::ops::Range<usize>) -> HostStorage {
        match self {
            HostStorage::F32(v) => HostStorage::F32(v[range].to_vec()),
            HostStorage::F16(v) => HostStorage::F16(v[range].to_vec()),
            HostStorage::BF16(v) => HostStorage::BF16(v[range].to_vec()),
        }
    }

    /// Sets every element to zero.
    pub(crate) fn fill_zero(&mut self) {
        match self {
            HostStorage::F32(v) => v.fill(0.0),
            HostStorage::F16(v) => v.fill(f16::ZERO),
            HostStorage::BF16(v) => v.fill(bf16::ZERO),
        }
    }

    /// Copies `src` into `self`; false (nothing copied) when the dtypes or lengths differ.
    pub(crate) fn copy_from(&mut self, src: &HostStorage) -> bool {
        match (self, src) {
            (HostStorage::F32(d), HostStorage::F32(s)) if d.len() == s.len() => d.copy_from_slice(s),
            (HostStorage::F16(d), HostStorage::F16(s)) if d.len() == s.len() => d.copy_from_slice(s),
            (HostStorage::BF16(d), HostStorage::BF16(s)) if d.len() == s.len() => d.copy_from_slice(s),
            _ => return false,
        }
        true
    }
}
