//! Typed launch wrappers for `elementwise.cu`, `reduce.cu` and `softmax.cu`: each checks its
//! operands' lengths and GPU as the CPU kernel in `engine/src/cpu` checks them, picks the launch
//! configuration from the sizes, and queues the kernel on the stream.
use cudarc::driver::PushKernelArg;

use half::{bf16, f16};

use super::buffer::{CudaBuffer, CudaElement};
use super::compile::Kernel;
use super::stream::{BLOCK_THREADS, CudaStream};
use crate::{Error, Result};

/// Most blocks `sum_of_squares` uses (its partial sums are added on the host in f64).
const SUM_OF_SQUARES_MAX_BLOCKS: usize = 1024;

impl CudaStream {
    /// Launches a kernel with signature `(const float* x, float* y, size_t n)` over `n` elements.
    fn unary(&self, kernel: Kernel, input: &CudaBuffer<f32>, output: &mut CudaBuffer<f32>) -> Result<()> {
        self.convert(kernel, input, output)
    }

    /// Launches a conversion kernel with signature `(const A* x, B* y, size_t n)`.
    fn convert<A: CudaElement, B: CudaElement>(
        &self,
        kernel: Kernel,
        input: &CudaBuffer<A>,
        output: &mut CudaBuffer<B>,
    ) -> Result<()> {
        let op = kernel.name();
        self.check_len(op, "output", input.len(), output.len())?;
        self.check_on_device(op, input)?;
        self.check_on_device(op, output)?;
        let n = input.len();
        if n == 0 {
            return Ok(());
        }
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&input.slice).arg(&mut output.slice).arg(&n);
        // SAFETY: the kernel reads n elements of x and writes n of y (both checked to hold n
        // elements on this GPU; f16 and bf16 are 16-bit, as the kernels' unsigned short).
        unsafe { launch.launch(self.grid_stride(n)) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// `output = input` rounded to f16, bit for bit `half::f16::from_f32` (round to nearest even).
    pub fn f32_to_f16(&self, input: &CudaBuffer<f32>, output: &mut CudaBuffer<f16>) -> Result<()> {
        self.convert(Kernel::F32ToF16, input, output)
    }

    /// `output = input` rounded to bf16, bit for bit `half::bf16::from_f32`.
    pub fn f32_to_bf16(&self, input: &CudaBuffer<f32>, output: &mut CudaBuffer<bf16>) -> Result<()> {
        self.convert(Kernel::F32ToBf16, input, output)
    }

    /// `output = input` as f32 (exact).
    pub fn f16_to_f32(&self, input: &CudaBuffer<f16>, output: &mut CudaBuffer<f32>) -> Result<()> {
        self.convert(Kernel::F16ToF32, input, output)
    }

    /// `output = input` as f32 (exact).
    pub fn bf16_to_f32(&self, input: &CudaBuffer<bf16>, output: &mut CudaBuffer<f32>) -> Result<()> {
        self.convert(Kernel::Bf16ToF32, input, output)
    }

    /// Launches a kernel with signature `(const float* a, const float* b, float* out, size_t n)`.
    fn binary(
        &self,
        kernel: Kernel,
        a: &CudaBuffer<f32>,
        b: &CudaBuffer<f32>,
        output: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        let op = kernel.name();
        self.check_len(op, "second operand", a.len(), b.len())?;
        self.check_len(op, "output", a.len(), output.len())?;
        for buffer in [a, b] {
            self.check_on_device(op, buffer)?;
        }
        self.check_on_device(op, output)?;
        let n = a.len();
        if n == 0 {
            return Ok(());
        }
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&a.slice).arg(&b.slice).arg(&mut output.slice).arg(&n);
        // SAFETY: reads n floats of a and b, writes n floats of out (lengths checked above).
        unsafe { launch.launch(self.grid_stride(n)) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// `output = lhs + rhs`, elementwise (`cpu::elementwise::add`).
    pub fn add(&self, lhs: &CudaBuffer<f32>, rhs: &CudaBuffer<f32>, output: &mut CudaBuffer<f32>) -> Result<()> {
        self.binary(Kernel::AddF32, lhs, rhs, output)
    }

    /// `output = lhs * rhs`, elementwise.
    pub fn mul(&self, lhs: &CudaBuffer<f32>, rhs: &CudaBuffer<f32>, output: &mut CudaBuffer<f32>) -> Result<()> {
        self.binary(Kernel::MulF32, lhs, rhs, output)
    }

    /// `dst += src`, elementwise.
    pub fn add_assign(&self, dst: &mut CudaBuffer<f32>, src: &CudaBuffer<f32>) -> Result<()> {
        let kernel = Kernel::AddAssignF32;
        self.check_len(kernel.name(), "src", dst.len(), src.len())?;
        self.check_on_device(kernel.name(), dst)?;
        self.check_on_device(kernel.name(), src)?;
        let n = dst.len();
        if n == 0 {
            return Ok(());
        }
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&mut dst.slice).arg(&src.slice).arg(&n);
        // SAFETY: reads and writes n floats of dst, reads n floats of src.
        unsafe { launch.launch(self.grid_stride(n)) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// `x *= factor`, elementwise.
    pub fn scale(&self, x: &mut CudaBuffer<f32>, factor: f32) -> Result<()> {
        let kernel = Kernel::ScaleF32;
        self.check_on_device(kernel.name(), x)?;
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&mut x.slice).arg(&factor).arg(&n);
        // SAFETY: reads and writes n floats of x.
        unsafe { launch.launch(self.grid_stride(n)) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// `output = max(input, 0)` (`cpu::activation::relu_forward`).
    pub fn relu_forward(&self, input: &CudaBuffer<f32>, output: &mut CudaBuffer<f32>) -> Result<()> {
        self.unary(Kernel::ReluForwardF32, input, output)
    }

    /// `input_grad = grad_output * [output > 0]`; `output` may also be the forward input (the
    /// sign is the same). Like `cpu::activation::relu_backward`.
    pub fn relu_backward(
        &self,
        output: &CudaBuffer<f32>,
        grad_output: &CudaBuffer<f32>,
        input_grad: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        self.binary(Kernel::ReluBackwardF32, output, grad_output, input_grad)
    }

    /// `output = x · Φ(x)`, exact GELU (`cpu::activation::gelu_forward`).
    pub fn gelu_forward(&self, input: &CudaBuffer<f32>, output: &mut CudaBuffer<f32>) -> Result<()> {
        self.unary(Kernel::GeluForwardF32, input, output)
    }

    /// `input_grad = grad_output · (Φ(x) + x·φ(x))` from the forward input `x`.
    pub fn gelu_backward(
        &self,
        input: &CudaBuffer<f32>,
        grad_output: &CudaBuffer<f32>,
        input_grad: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        self.binary(Kernel::GeluBackwardF32, input, grad_output, input_grad)
    }

    /// PyTorch's tanh-approximate GELU (`cpu::activation::gelu_tanh_forward`).
    pub fn gelu_tanh_forward(&self, input: &CudaBuffer<f32>, output: &mut CudaBuffer<f32>) -> Result<()> {
        self.unary(Kernel::GeluTanhForwardF32, input, output)
    }

    /// The tanh-approximate GELU's input gradient from the forward input `x`.
    pub fn gelu_tanh_backward(
        &self,
        input: &CudaBuffer<f32>,
        grad_output: &CudaBuffer<f32>,
        input_grad: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        self.binary(Kernel::GeluTanhBackwardF32, input, grad_output, input_grad)
    }

    /// `output = tanh(input)`.
    pub fn tanh_forward(&self, input: &CudaBuffer<f32>, output: &mut CudaBuffer<f32>) -> Result<()> {
        self.unary(Kernel::TanhForwardF32, input, output)
    }

    /// `input_grad = grad_output · (1 - output²)` from the forward output.
    pub fn tanh_backward(
        &self,
        output: &CudaBuffer<f32>,
        grad_output: &CudaBuffer<f32>,
        input_grad: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        self.binary(Kernel::TanhBackwardF32, output, grad_output, input_grad)
    }

    /// `output = input · mask · scale` with a 0/1 `mask` and `scale = 1 / (1 - p)` (PyTorch's dropout).
    pub fn dropout_apply(
        &self,
        input: &CudaBuffer<f32>,
        mask: &CudaBuffer<f16>,
        scale: f32,
        output: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        let kernel = Kernel::DropoutApplyF32;
        let op = kernel.name();
        self.check_len(op, "mask", input.len(), mask.len())?;
        self.check_len(op, "output", input.len(), output.len())?;
        self.check_on_device(op, input)?;
        self.check_on_device(op, mask)?;
        self.check_on_device(op, output)?;
        let n = input.len();
        if n == 0 {
            return Ok(());
        }
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&input.slice).arg(&mask.slice).arg(&scale).arg(&mut output.slice).arg(&n);
        // SAFETY: reads n floats of x and n halves of mask, writes n floats of y.
        unsafe { launch.launch(self.grid_stride(n)) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// `(rows, cols)` of a row-major `matrix` with `cols` columns, checked as the CPU checks it.
    fn matrix_shape(&self, op: &str, matrix_len: usize, cols: usize, what: &str) -> Result<usize> {
        if cols == 0 || !matrix_len.is_multiple_of(cols) {
            return Err(Error::shape(op, format!("{what} of {cols} elements"), format!("{matrix_len} elements")));
        }
        Ok(matrix_len / cols)
    }

    /// `column_sums[j] += Σ_r matrix[r, j]` (the Linear bias gradient;
    /// `cpu::elementwise::accumulate_column_sums`).
    pub fn accumulate_column_sums(&self, matrix: &CudaBuffer<f32>, column_sums: &mut CudaBuffer<f32>) -> Result<()> {
        let kernel = Kernel::ColumnSumsAccumulateF32;
        let op = kernel.name();
        let cols = column_sums.len();
        let rows = self.matrix_shape(op, matrix.len(), cols, "rows")?;
        self.check_on_device(op, matrix)?;
        self.check_on_device(op, column_sums)?;
        let config = self.thread_per_item(op, cols)?;
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&matrix.slice).arg(&mut column_sums.slice).arg(&rows).arg(&cols);
        // SAFETY: one thread per column (cols > 0 checked), each reading rows x 1 floats of the
        // rows x cols matrix and updating its own column sum.
        unsafe { launch.launch(config) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// `row_sums[r] += Σ_j matrix[r, j]` (the Conv2d bias gradient;
    /// `cpu::elementwise::accumulate_row_sums`).
    pub fn accumulate_row_sums(&self, matrix: &CudaBuffer<f32>, row_sums: &mut CudaBuffer<f32>) -> Result<()> {
        let kernel = Kernel::RowSumsAccumulateF32;
        let op = kernel.name();
        let rows = row_sums.len();
        let cols = self.matrix_shape(op, matrix.len(), rows, "rows of a matrix with one row per sum")?;
        self.check_on_device(op, matrix)?;
        self.check_on_device(op, row_sums)?;
        if cols == 0 {
            return Ok(());
        }
        let config = self.block_per_item(op, rows)?;
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&matrix.slice).arg(&mut row_sums.slice).arg(&rows).arg(&cols);
        // SAFETY: one 256-thread block per row (the kernel's shared array has 256 entries), each
        // reading its row of cols floats and updating its own sum.
        unsafe { launch.launch(config) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// Copies `row` into every row of `dst` (`cpu::elementwise::broadcast_rows`).
    pub fn broadcast_rows(&self, row: &CudaBuffer<f32>, dst: &mut CudaBuffer<f32>) -> Result<()> {
        let kernel = Kernel::BroadcastRowsF32;
        let op = kernel.name();
        let cols = row.len();
        let rows = self.matrix_shape(op, dst.len(), cols, "rows")?;
        self.check_on_device(op, row)?;
        self.check_on_device(op, dst)?;
        if rows == 0 {
            return Ok(());
        }
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&row.slice).arg(&mut dst.slice).arg(&rows).arg(&cols);
        // SAFETY: reads cols floats of row, writes rows x cols floats of dst (checked divisible).
        unsafe { launch.launch(self.grid_stride(rows * cols)) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// `Σ x²` in f64 (for gradient-norm clipping, like `optim::grad_sum_of_squares`): per-block
    /// partial sums on the GPU, added on the host. Waits for the result.
    pub fn sum_of_squares(&self, x: &CudaBuffer<f32>) -> Result<f64> {
        let kernel = Kernel::SumOfSquaresF32;
        self.check_on_device(kernel.name(), x)?;
        let n = x.len();
        if n == 0 {
            return Ok(0.0);
        }
        let blocks = n.div_ceil(BLOCK_THREADS as usize).min(SUM_OF_SQUARES_MAX_BLOCKS);
        let mut partial = self.alloc_zeros::<f64>(blocks)?;
        let config = cudarc::driver::LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (BLOCK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&x.slice).arg(&mut partial.slice).arg(&n);
        // SAFETY: `blocks` blocks of exactly 256 threads (the shared array's size) read n floats
        // of x; block b writes partial[b] (partial holds `blocks` doubles).
        unsafe { launch.launch(config) }.map_err(|err| self.launch_error(kernel, err))?;
        Ok(self.download(&partial)?.iter().sum())
    }

    /// `output[r, :] = log_softmax(input[r, :])` for rows of `cols` elements
    /// (`cpu::softmax::log_softmax_rows`).
    pub fn log_softmax_rows(&self, input: &CudaBuffer<f32>, cols: usize, output: &mut CudaBuffer<f32>) -> Result<()> {
        let kernel = Kernel::LogSoftmaxRowsF32;
        let op = kernel.name();
        let rows = self.matrix_shape(op, input.len(), cols, "rows (cols > 0)")?;
        self.check_len(op, "output", input.len(), output.len())?;
        self.check_on_device(op, input)?;
        self.check_on_device(op, output)?;
        if rows == 0 {
            return Ok(());
        }
        let config = self.block_per_item(op, rows)?;
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&input.slice).arg(&mut output.slice).arg(&rows).arg(&cols);
        // SAFETY: one 256-thread block per row (the block reduction's size); block r reads and
        // writes row r of cols floats.
        unsafe { launch.launch(config) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// Softmax cross-entropy of `logits` (rows of `cols`) against `labels` (one per row):
    /// `loss[r] = -log_softmax(logits)[r, labels[r]] / normalizer` and
    /// `grad = (softmax(logits) - onehot(labels)) / normalizer`. A label outside `0..cols` gives
    /// its row NaN loss and gradient.
    pub fn cross_entropy(
        &self,
        logits: &CudaBuffer<f32>,
        labels: &CudaBuffer<i64>,
        cols: usize,
        normalizer: f32,
        loss: &mut CudaBuffer<f32>,
        grad: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        let kernel = Kernel::CrossEntropyF32;
        let op = kernel.name();
        let rows = self.matrix_shape(op, logits.len(), cols, "rows (cols > 0)")?;
        self.check_len(op, "labels", rows, labels.len())?;
        self.check_len(op, "loss", rows, loss.len())?;
        self.check_len(op, "grad", logits.len(), grad.len())?;
        self.check_on_device(op, logits)?;
        self.check_on_device(op, labels)?;
        self.check_on_device(op, loss)?;
        self.check_on_device(op, grad)?;
        if rows == 0 {
            return Ok(());
        }
        let config = self.block_per_item(op, rows)?;
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch
            .arg(&logits.slice)
            .arg(&labels.slice)
            .arg(&normalizer)
            .arg(&mut loss.slice)
            .arg(&mut grad.slice)
            .arg(&rows)
            .arg(&cols);
        // SAFETY: one 256-thread block per row; block r reads row r of logits and labels[r]
        // (long long = i64) and writes loss[r] and row r of grad, all lengths checked above.
        unsafe { launch.launch(config) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }
}
