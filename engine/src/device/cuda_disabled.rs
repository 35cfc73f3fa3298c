//! The CUDA backend when Conveyor is built without the `cuda` feature: the same names and
//! signatures as `cuda_enabled.rs` (and `device/cuda/`), so code and tests written against the
//! backend compile in every build. The constructors return `Error::CudaUnavailable`; no value of
//! the device, stream or buffer types can exist, so every method is statically unreachable. This
//! file and `cuda_enabled.rs` are the one CUDA switch point.
use std::convert::Infallible;
use std::fmt;
use std::marker::PhantomData;
use std::rc::Rc;
use std::sync::Arc;

use half::{bf16, f16};

use super::{HostStorage, MemoryAccount};
use crate::collective::{Communicator, GroupAbort};
use crate::cpu::Window2d;
use crate::optim::{AdamConfig, SgdConfig};
use crate::{DType, Device, Error, Result};

/// The error every constructor returns in this build.
fn not_compiled(what: &str) -> Error {
    Error::CudaUnavailable(format!(
        "{what} requested, but Conveyor was built without the `cuda` feature; \
         rebuild with `cargo build --release --features cuda` or use cpu devices"
    ))
}

/// A CUDA device. Without the `cuda` feature no value of this type can exist.
#[derive(Clone, Debug)]
pub struct CudaDevice {
    never: Infallible,
}

impl CudaDevice {
    /// Always fails: this build has no CUDA support.
    pub fn new(ordinal: usize, _budget_bytes: Option<u64>) -> Result<Self> {
        Err(not_compiled(&format!("cuda:{ordinal}")))
    }

    /// Always fails: this build has no CUDA support.
    pub fn with_free_memory_budget(
        ordinal: usize,
        _budget_bytes: Option<u64>,
        slice: Option<crate::device::LogicalSlice>,
    ) -> Result<Self> {
        let name = match slice {
            Some(slice) => format!("cuda:{ordinal}x{}#{}", slice.count, slice.index),
            None => format!("cuda:{ordinal}"),
        };
        Err(not_compiled(&name))
    }

    /// The memory free on the GPU.
    pub fn free_memory(&self) -> Result<u64> {
        match self.never {}
    }

    /// Which logical device of its GPU this handle is, if it is one.
    pub fn logical_slice(&self) -> Option<crate::device::LogicalSlice> {
        match self.never {}
    }

    /// The handle's name.
    pub fn label(&self) -> String {
        match self.never {}
    }

    /// Always fails: this build has no CUDA support.
    pub fn count() -> Result<usize> {
        Err(not_compiled("CUDA GPUs"))
    }

    /// Always fails: this build has no CUDA support.
    pub fn nccl_group(devices: &[Device]) -> Result<Vec<Box<dyn Communicator>>> {
        Err(not_compiled(&format!("an NCCL group of {} device(s)", devices.len())))
    }

    /// Always fails: this build has no CUDA support.
    pub fn nccl_group_abortable(devices: &[Device]) -> Result<(Vec<Box<dyn Communicator>>, GroupAbort)> {
        Err(not_compiled(&format!("an NCCL group of {} device(s)", devices.len())))
    }

    /// The GPU ordinal.
    pub fn ordinal(&self) -> usize {
        match self.never {}
    }

    /// The device's memory ledger.
    pub fn memory(&self) -> &Arc<MemoryAccount> {
        match self.never {}
    }

    /// The GPU's name.
    pub fn name(&self) -> &str {
        match self.never {}
    }

    /// The compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> (i32, i32) {
        match self.never {}
    }

    /// The GPU's physical memory in bytes.
    pub fn total_memory(&self) -> u64 {
        match self.never {}
    }

    /// A new stream on this GPU, for one worker thread.
    pub fn new_stream(&self) -> Result<CudaStream> {
        match self.never {}
    }

    /// True when this GPU can access `other`'s memory directly.
    pub fn can_access_peer(&self, _other: &CudaDevice) -> Result<bool> {
        match self.never {}
    }

    /// This thread's stream on this GPU.
    pub fn thread_stream(&self) -> Result<Rc<CudaStream>> {
        match self.never {}
    }

    /// `len` zeroed elements on this GPU, counted on this device's ledger.
    pub fn alloc_zeros<T: CudaElement>(&self, _len: usize) -> Result<CudaBuffer<T>> {
        match self.never {}
    }

    /// A copy of `host` on this GPU, counted on this device's ledger.
    pub fn upload<T: CudaElement>(&self, _host: &[T]) -> Result<CudaBuffer<T>> {
        match self.never {}
    }
}

/// A tensor's elements on a GPU. Without the `cuda` feature no value of this type can exist, so
/// `Tensor`'s CUDA storage variant is statically unreachable.
#[derive(Debug)]
pub(crate) struct CudaStorage {
    never: Infallible,
}

// The same crate-internal methods as the `cuda` build's `CudaStorage` (device/cuda/storage.rs).
impl CudaStorage {
    pub(crate) fn from_f32(buffer: CudaBuffer<f32>) -> CudaStorage {
        match buffer.never {}
    }
    pub(crate) fn dtype(&self) -> DType {
        match self.never {}
    }
    pub(crate) fn f32(&self, _op: &str) -> Result<&CudaBuffer<f32>> {
        match self.never {}
    }
    pub(crate) fn f32_mut(&mut self, _op: &str) -> Result<&mut CudaBuffer<f32>> {
        match self.never {}
    }
    pub(crate) fn f16(&self, _op: &str) -> Result<&CudaBuffer<half::f16>> {
        match self.never {}
    }
    pub(crate) fn bf16(&self, _op: &str) -> Result<&CudaBuffer<half::bf16>> {
        match self.never {}
    }
    pub(crate) fn to_dtype(&self, _dtype: DType) -> Result<CudaStorage> {
        match self.never {}
    }
    pub(crate) fn upcast_f32(&self) -> Result<Option<CudaBuffer<f32>>> {
        match self.never {}
    }
    pub(crate) fn zeros(device: &CudaDevice, _dtype: DType, _len: usize) -> Result<CudaStorage> {
        match device.never {}
    }
    pub(crate) fn zeros_past_budget(device: &CudaDevice, _dtype: DType, _len: usize) -> Result<CudaStorage> {
        match device.never {}
    }
    pub(crate) fn upload(device: &CudaDevice, _host: &HostStorage) -> Result<CudaStorage> {
        match device.never {}
    }
    pub(crate) fn upload_into(&mut self, _host: &HostStorage) -> Result<()> {
        match self.never {}
    }
    pub(crate) fn download(&self) -> Result<HostStorage> {
        match self.never {}
    }
    pub(crate) fn copy_to(&self, _device: &CudaDevice) -> Result<CudaStorage> {
        match self.never {}
    }
    pub(crate) fn duplicate(&self) -> Result<CudaStorage> {
        match self.never {}
    }
    pub(crate) fn copy_range(&self, _start: usize, _len: usize) -> Result<CudaStorage> {
        match self.never {}
    }
    pub(crate) fn copy_from(&mut self, _src: &CudaStorage) -> Result<()> {
        match self.never {}
    }
    pub(crate) fn fill_zero(&mut self) -> Result<()> {
        match self.never {}
    }
}

mod sealed {
    pub trait Sealed {}
}

/// An element type a [`CudaBuffer`] can hold.
pub trait CudaElement: Copy + Default + Send + Sync + fmt::Debug + sealed::Sealed + 'static {
    /// The C name of the type, for messages.
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

/// Elements on a GPU. Without the `cuda` feature no value of this type can exist.
#[derive(Debug)]
pub struct CudaBuffer<T> {
    never: Infallible,
    _marker: PhantomData<T>,
}

impl<T: CudaElement> CudaBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self.never {}
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        match self.never {}
    }

    /// Bytes reserved on the device's ledger.
    pub fn size_in_bytes(&self) -> u64 {
        match self.never {}
    }

    /// The GPU the buffer lives on.
    pub fn device(&self) -> &CudaDevice {
        match self.never {}
    }
}

/// A strided matrix view of a [`CudaBuffer`]. Without the `cuda` feature no value can exist.
#[derive(Debug)]
pub struct DeviceMatRef<'a, T> {
    never: Infallible,
    _marker: PhantomData<&'a T>,
}

impl<T> Clone for DeviceMatRef<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DeviceMatRef<'_, T> {}

impl<'a, T: CudaElement> DeviceMatRef<'a, T> {
    /// `buffer` as a row-major `rows x cols` matrix.
    pub fn row_major(buffer: &'a CudaBuffer<T>, _rows: usize, _cols: usize) -> Result<Self> {
        match buffer.never {}
    }

    /// A row-major matrix at `offset` with rows `row_stride` elements apart.
    pub fn row_major_at(
        buffer: &'a CudaBuffer<T>,
        _offset: usize,
        _rows: usize,
        _cols: usize,
        _row_stride: usize,
    ) -> Result<Self> {
        match buffer.never {}
    }

    /// The transposed view.
    pub fn t(self) -> Self {
        match self.never {}
    }

    /// The same view with a batch stride.
    pub fn with_batch_stride(self, _batch_stride: usize) -> Self {
        match self.never {}
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        match self.never {}
    }

    /// Number of columns.
    pub fn cols(&self) -> usize {
        match self.never {}
    }
}

/// A stream on a GPU. Without the `cuda` feature no value of this type can exist.
#[derive(Debug)]
pub struct CudaStream {
    never: Infallible,
}

type Buf<T> = CudaBuffer<T>;

// Each method is documented on the `cuda` build's `CudaStream` (device/cuda/); here none can be
// called, since no `CudaStream` exists.
#[allow(missing_docs, clippy::too_many_arguments)]
impl CudaStream {
    pub fn device(&self) -> &CudaDevice {
        match self.never {}
    }
    pub fn synchronize(&self) -> Result<()> {
        match self.never {}
    }
    pub fn alloc_zeros<T: CudaElement>(&self, _len: usize) -> Result<Buf<T>> {
        match self.never {}
    }
    pub fn upload<T: CudaElement>(&self, _host: &[T]) -> Result<Buf<T>> {
        match self.never {}
    }
    pub fn upload_into<T: CudaElement>(&self, _host: &[T], _dst: &mut Buf<T>) -> Result<()> {
        match self.never {}
    }
    pub fn download<T: CudaElement>(&self, _src: &Buf<T>) -> Result<Vec<T>> {
        match self.never {}
    }
    pub fn download_into<T: CudaElement>(&self, _src: &Buf<T>, _host: &mut [T]) -> Result<()> {
        match self.never {}
    }
    pub fn copy_from<T: CudaElement>(&self, _src: &Buf<T>) -> Result<Buf<T>> {
        match self.never {}
    }
    pub fn copy_into<T: CudaElement>(&self, _src: &Buf<T>, _dst: &mut Buf<T>) -> Result<()> {
        match self.never {}
    }
    pub fn copy_rows(
        &self,
        _src: &Buf<f32>,
        _src_at: usize,
        _src_stride: usize,
        _dst: &mut Buf<f32>,
        _dst_at: usize,
        _dst_stride: usize,
        _rows: usize,
        _width: usize,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn matmul<T: GemmElement>(
        &self,
        _dst: &mut Buf<f32>,
        _lhs: DeviceMatRef<'_, T>,
        _rhs: DeviceMatRef<'_, T>,
        _accumulate: bool,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn matmul_batched<T: GemmElement>(
        &self,
        _dst: &mut Buf<f32>,
        _lhs: DeviceMatRef<'_, T>,
        _rhs: DeviceMatRef<'_, T>,
        _batch: usize,
        _accumulate: bool,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn add(&self, _lhs: &Buf<f32>, _rhs: &Buf<f32>, _output: &mut Buf<f32>) -> Result<()> {
        match self.never {}
    }
    pub fn mul(&self, _lhs: &Buf<f32>, _rhs: &Buf<f32>, _output: &mut Buf<f32>) -> Result<()> {
        match self.never {}
    }
    pub fn add_assign(&self, _dst: &mut Buf<f32>, _src: &Buf<f32>) -> Result<()> {
        match self.never {}
    }
    pub fn scale(&self, _x: &mut Buf<f32>, _factor: f32) -> Result<()> {
        match self.never {}
    }
    pub fn relu_forward(&self, _input: &Buf<f32>, _output: &mut Buf<f32>) -> Result<()> {
        match self.never {}
    }
    pub fn relu_backward(&self, _output: &Buf<f32>, _grad_output: &Buf<f32>, _input_grad: &mut Buf<f32>) -> Result<()> {
        match self.never {}
    }
    pub fn gelu_forward(&self, _input: &Buf<f32>, _output: &mut Buf<f32>) -> Result<()> {
        match self.never {}
    }
    pub fn gelu_backward(&self, _input: &Buf<f32>, _grad_output: &Buf<f32>, _input_grad: &mut Buf<f32>) -> Result<()> {
        match self.never {}
    }
    pub fn gelu_tanh_forward(&self, _input: &Buf<f32>, _output: &mut Buf<f32>) -> Result<()> {
        match self.never {}
    }
    pub fn gelu_tanh_backward(
        &self,
        _input: &Buf<f32>,
        _grad_output: &Buf<f32>,
        _input_grad: &mut Buf<f32>,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn tanh_forward(&self, _input: &Buf<f32>, _output: &mut Buf<f32>) -> Result<()> {
        match self.never {}
    }
    pub fn tanh_backward(&self, _output: &Buf<f32>, _grad_output: &Buf<f32>, _input_grad: &mut Buf<f32>) -> Result<()> {
        match self.never {}
    }
    pub fn dropout_apply(
        &self,
        _input: &Buf<f32>,
        _mask: &Buf<half::f16>,
        _scale: f32,
        _output: &mut Buf<f32>,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn accumulate_column_sums(&self, _matrix: &Buf<f32>, _column_sums: &mut Buf<f32>) -> Result<()> {
        match self.never {}
    }
    pub fn accumulate_row_sums(&self, _matrix: &Buf<f32>, _row_sums: &mut Buf<f32>) -> Result<()> {
        match self.never {}
    }
    pub fn broadcast_rows(&self, _row: &Buf<f32>, _dst: &mut Buf<f32>) -> Result<()> {
        match self.never {}
    }
    pub fn sum_of_squares(&self, _x: &Buf<f32>) -> Result<f64> {
        match self.never {}
    }
    pub fn log_softmax_rows(&self, _input: &Buf<f32>, _cols: usize, _output: &mut Buf<f32>) -> Result<()> {
        match self.never {}
    }
    pub fn cross_entropy(
        &self,
        _logits: &Buf<f32>,
        _labels: &Buf<i64>,
        _cols: usize,
        _normalizer: f32,
        _loss: &mut Buf<f32>,
        _grad: &mut Buf<f32>,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn im2col(&self, _input: &Buf<f32>, _batch: usize, _window: &Window2d, _cols: &mut Buf<f32>) -> Result<()> {
        match self.never {}
    }
    pub fn col2im(
        &self,
        _cols: &Buf<f32>,
        _batch: usize,
        _window: &Window2d,
        _input_grad: &mut Buf<f32>,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn max_pool_forward(
        &self,
        _input: &Buf<f32>,
        _n_planes: usize,
        _window: &Window2d,
        _output: &mut Buf<f32>,
        _argmax: &mut Buf<f32>,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn max_pool_backward(
        &self,
        _grad_output: &Buf<f32>,
        _argmax: &Buf<f32>,
        _n_planes: usize,
        _window: &Window2d,
        _input_grad: &mut Buf<f32>,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn avg_pool_forward(
        &self,
        _input: &Buf<f32>,
        _n_planes: usize,
        _window: &Window2d,
        _output: &mut Buf<f32>,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn avg_pool_backward(
        &self,
        _grad_output: &Buf<f32>,
        _n_planes: usize,
        _window: &Window2d,
        _input_grad: &mut Buf<f32>,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn attention_forward(
        &self,
        _dims: &crate::cpu::attention::AttentionDims,
        _qkv: &Buf<f32>,
        _ctx: &mut Buf<f32>,
        _logsumexp: &mut Buf<f32>,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn attention_backward(
        &self,
        _dims: &crate::cpu::attention::AttentionDims,
        _qkv: &Buf<f32>,
        _ctx: &Buf<f32>,
        _logsumexp: &Buf<f32>,
        _grad_ctx: &Buf<f32>,
        _grad_qkv: &mut Buf<f32>,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn sgd_step(
        &self,
        _param: &mut Buf<f32>,
        _grad: &Buf<f32>,
        _momentum_buffer: Option<&mut Buf<f32>>,
        _config: &SgdConfig,
        _first_step: bool,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn adam_step(
        &self,
        _param: &mut Buf<f32>,
        _grad: &Buf<f32>,
        _exp_avg: &mut Buf<f32>,
        _exp_avg_sq: &mut Buf<f32>,
        _config: &AdamConfig,
        _decoupled: bool,
        _step: u64,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn layer_norm_forward(
        &self,
        _input: &Buf<f32>,
        _weight: &Buf<f32>,
        _bias: &Buf<f32>,
        _eps: f32,
        _output: &mut Buf<f32>,
        _mean: &mut Buf<f32>,
        _rstd: &mut Buf<f32>,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn layer_norm_backward_input(
        &self,
        _input: &Buf<f32>,
        _grad_output: &Buf<f32>,
        _weight: &Buf<f32>,
        _mean: &Buf<f32>,
        _rstd: &Buf<f32>,
        _input_grad: &mut Buf<f32>,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn layer_norm_backward_weight(
        &self,
        _input: &Buf<f32>,
        _grad_output: &Buf<f32>,
        _mean: &Buf<f32>,
        _rstd: &Buf<f32>,
        _weight_grad: &mut Buf<f32>,
        _bias_grad: &mut Buf<f32>,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn embedding_gather(
        &self,
        _ids: &Buf<f32>,
        _table: &Buf<f32>,
        _n_rows: usize,
        _output: &mut Buf<f32>,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn embedding_scatter_add(
        &self,
        _grad_output: &Buf<f32>,
        _ids: &Buf<i64>,
        _offsets: &Buf<i64>,
        _positions: &Buf<i64>,
        _grad: &mut Buf<f32>,
        _dim: usize,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn add_positions(
        &self,
        _input: &Buf<f32>,
        _table: &Buf<f32>,
        _len: usize,
        _output: &mut Buf<f32>,
    ) -> Result<()> {
        match self.never {}
    }
    pub fn positions_grad_accumulate(&self, _grad_output: &Buf<f32>, _len: usize, _grad: &mut Buf<f32>) -> Result<()> {
        match self.never {}
    }
    pub fn mean_over_tokens(&self, _input: &Buf<f32>, _dims: [usize; 3], _output: &mut Buf<f32>) -> Result<()> {
        match self.never {}
    }
    pub fn mean_over_tokens_backward(
        &self,
        _grad_output: &Buf<f32>,
        _dims: [usize; 3],
        _input_grad: &mut Buf<f32>,
    ) -> Result<()> {
        match self.never {}
    }
}
