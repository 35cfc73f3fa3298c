//! Device memory: [`CudaBuffer`] (elements on one GPU holding a reservation on its ledger), the
//! element traits ([`CudaElement`], [`GemmElement`]) and [`DeviceMatRef`], a strided matrix view of
//! a buffer for cuBLAS.
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream as RawStream, DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};

use super::device::CudaDevice;
use super::errors;
use crate::device::Reservation;
use crate::{DType, Error, Result};

mod sealed {
    pub trait Sealed {}
}

/// An element type a [`CudaBuffer`] can hold: the tensor types f32, f16 and bf16, and the
/// auxiliary types kernels take (i32 argmax positions, i64 labels, f64 partial sums).
pub trait CudaElement:
    DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync + fmt::Debug + sealed::Sealed + 'static
{
    /// The C name of the type, for messages (`float`, `half`, ...).
    const NAME: &'static str;
}

/// An element type cuBLAS multiplies with f32 accumulation into an f32 result.
pub trait GemmElement: CudaElement {
    /// The tensor dtype.
    const DTYPE: DType;
}

macro_rules! element {
    ($t:ty, $name:literal) => {
        impl sealed::Sealed for $t {}
        impl CudaElement for $t {
            const NAME: &'static str = $name;
        }
    };
}
element!(f32, "float");
element!(f16, "half");
element!(bf16, "bfloat16");
element!(f64, "double");
element!(i32, "int");
element!(i64, "long long");

impl GemmElement for f32 {
    const DTYPE: DType = DType::F32;
}
impl GemmElement for f16 {
    const DTYPE: DType = DType::F16;
}
impl GemmElement for bf16 {
    const DTYPE: DType = DType::BF16;
}

/// `len` elements of `T` on one GPU. Its bytes are reserved on the device's ledger for as long as
/// it lives, so a buffer past the budget is `Error::OutOfDeviceMemory` before the driver is asked.
pub struct CudaBuffer<T> {
    /// The allocation: `len` elements, or one unused element when `len` is 0 (the driver refuses
    /// empty allocations).
    pub(crate) slice: CudaSlice<T>,
    len: usize,
    device: CudaDevice,
    _reservation: Reservation,
}

impl<T> fmt::Debug for CudaBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaBuffer<{}>(cuda:{}, {} elements)", std::any::type_name::<T>(), self.device.ordinal(), self.len)
    }
}

impl<T: CudaElement> CudaBuffer<T> {
    /// Allocates `len` zeroed elements on `device`, ordered on `stream`.
    pub(crate) fn zeros(device: &CudaDevice, stream: &Arc<RawStream>, len: usize) -> Result<Self> {
        let reservation = reserve::<T>(device, len)?;
        CudaBuffer::zeros_reserved(device, stream, len, reservation)
    }

    /// Allocates `len` zeroed elements on `device` under a `reservation` already made for them
    /// (e.g. past the budget, for `Tensor::fill_zero`), ordered on `stream`.
    pub(crate) fn zeros_reserved(
        device: &CudaDevice,
        stream: &Arc<RawStream>,
        len: usize,
        reservation: Reservation,
    ) -> Result<Self> {
        let slice =
            stream.alloc_zeros::<T>(len.max(1)).map_err(|err| allocation_error::<T>(device, len, &reservation, err))?;
        Ok(CudaBuffer { slice, len, device: device.clone(), _reservation: reservation })
    }

    /// Allocates `data.len()` elements on `device` and copies `data` into them, ordered on `stream`.
    pub(crate) fn from_host(device: &CudaDevice, stream: &Arc<RawStream>, data: &[T]) -> Result<Self> {
        if data.is_empty() {
            return CudaBuffer::zeros(device, stream, 0);
        }
        let reservation = reserve::<T>(device, data.len())?;
        let slice =
            stream.clone_htod(data).map_err(|err| allocation_error::<T>(device, data.len(), &reservation, err))?;
        Ok(CudaBuffer { slice, len: data.len(), device: device.clone(), _reservation: reservation })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes reserved on the device's ledger.
    pub fn size_in_bytes(&self) -> u64 {
        (self.len * size_of::<T>()) as u64
    }

    /// The GPU the buffer lives on.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }
}

/// Reserves `len` elements of `T` on the device's ledger.
fn reserve<T>(device: &CudaDevice, len: usize) -> Result<Reservation> {
    let bytes = len.checked_mul(size_of::<T>()).ok_or_else(|| {
        Error::invalid(
            "CudaBuffer length",
            format!("{len} elements of {} bytes overflow the address space", size_of::<T>()),
        )
    })?;
    device.memory().reserve(bytes as u64)
}

/// A failed allocation: out of GPU memory is `OutOfDeviceMemory` with the GPU's physical memory as
/// the budget when the ledger has none; anything else a driver error.
fn allocation_error<T: CudaElement>(
    device: &CudaDevice,
    len: usize,
    reservation: &Reservation,
    err: cudarc::driver::DriverError,
) -> Error {
    if errors::is_out_of_memory(&err) {
        let memory = device.memory();
        return Error::OutOfDeviceMemory {
            device: format!("cuda:{}", device.ordinal()),
            requested: reservation.bytes(),
            in_use: memory.in_use().saturating_sub(reservation.bytes()),
            budget: memory.budget().unwrap_or(device.total_memory()).min(device.total_memory()),
        };
    }
    errors::driver(device.ordinal(), &format!("allocating {len} {} elements", T::NAME), err)
}

/// A read-only strided view of a matrix in a [`CudaBuffer`]: `rows x cols` elements starting at
/// `offset`, element `(i, j)` at `offset + i * row_stride + j * col_stride`. cuBLAS needs one of
/// the two strides to be 1: a row-major matrix (`col_stride == 1`) or its transpose
/// ([`DeviceMatRef::t`]). For batched products, consecutive matrices are `batch_stride` apart (0:
/// every product uses the same matrix).
pub struct DeviceMatRef<'a, T> {
    pub(crate) buffer: &'a CudaBuffer<T>,
    pub(crate) offset: usize,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) row_stride: usize,
    pub(crate) col_stride: usize,
    pub(crate) batch_stride: usize,
    _marker: PhantomData<&'a T>,
}

impl<T> Clone for DeviceMatRef<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DeviceMatRef<'_, T> {}

impl<T> fmt::Debug for DeviceMatRef<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DeviceMatRef({}x{} at {} of {:?}, strides {}/{}, batch stride {})",
            self.rows, self.cols, self.offset, self.buffer, self.row_stride, self.col_stride, self.batch_stride
        )
    }
}

impl<'a, T: CudaElement> DeviceMatRef<'a, T> {
    /// The whole of `buffer` (or its first `rows * cols` elements) as a row-major `rows x cols` matrix.
    pub fn row_major(buffer: &'a CudaBuffer<T>, rows: usize, cols: usize) -> Result<Self> {
        DeviceMatRef::row_major_at(buffer, 0, rows, cols, cols)
    }

    /// A row-major `rows x cols` matrix at `offset` whose rows are `row_stride` elements apart
    /// (`row_stride >= cols`), e.g. a block of columns of a wider matrix.
    pub fn row_major_at(
        buffer: &'a CudaBuffer<T>,
        offset: usize,
        rows: usize,
        cols: usize,
        row_stride: usize,
    ) -> Result<Self> {
        let op = "DeviceMatRef::row_major_at";
        if rows > 1 && row_stride < cols {
            return Err(Error::shape(
                op,
                format!("a row stride of at least {cols} (the column count)"),
                row_stride.to_string(),
            ));
        }
        let view = DeviceMatRef {
            buffer,
            offset,
            rows,
            cols,
            row_stride,
            col_stride: 1,
            batch_stride: 0,
            _marker: PhantomData,
        };
        view.check_fits(op, 1)?;
        Ok(view)
    }

    /// The transposed view (no copy).
    pub fn t(self) -> Self {
        DeviceMatRef {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    /// The same view, with consecutive matrices of a batched product `batch_stride` elements apart.
    pub fn with_batch_stride(self, batch_stride: usize) -> Self {
        DeviceMatRef { batch_stride, ..self }
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Elements from the view's first to one past its last element, for one matrix.
    pub(crate) fn extent(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            return 0;
        }
        (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride + 1
    }

    /// Checks that `batch` matrices of this view lie inside the buffer.
    pub(crate) fn check_fits(&self, op: &str, batch: usize) -> Result<()> {
        if self.extent() == 0 || batch == 0 {
            return Ok(());
        }
        let end = (batch - 1)
            .checked_mul(self.batch_stride)
            .and_then(|last| last.checked_add(self.offset))
            .and_then(|start| start.checked_add(self.extent()));
        match end {
            Some(end) if end <= self.buffer.len() => Ok(()),
            _ => Err(Error::shape(
                op,
                format!(
                    "a buffer of at least {} elements",
                    end.map_or_else(|| "usize::MAX".to_string(), |e| e.to_string())
                ),
                format!("{} elements", self.buffer.len()),
            )),
        }
    }
}
