//! Typed launch wrappers for `conv.cu`: batched im2col/col2im and max/average pooling, over the
//! same [`Window2d`] geometry and layouts as `cpu::conv` and `cpu::pool`. A 2-D convolution of a
//! batch is one im2col launch and one strided-batched GEMM (`CudaStream::matmul_batched`).
use cudarc::driver::PushKernelArg;

use super::buffer::CudaBuffer;
use super::compile::Kernel;
use super::errors::to_i32;
use super::stream::CudaStream;
use crate::cpu::Window2d;
use crate::cpu::pool::MAX_POOL_PLANE_LIMIT;
use crate::{Error, Result};

/// A window's sizes as the C `int`s the kernels take.
struct WindowArgs {
    channels: i32,
    h: i32,
    w: i32,
    kh: i32,
    kw: i32,
    sh: i32,
    sw: i32,
    ph: i32,
    pw: i32,
    oh: i32,
    ow: i32,
}

impl WindowArgs {
    fn new(op: &str, window: &Window2d) -> Result<Self> {
        let int = |what: &str, value: usize| to_i32(op, what, value);
        Ok(WindowArgs {
            channels: int("channels", window.channels)?,
            h: int("input height", window.in_height)?,
            w: int("input width", window.in_width)?,
            kh: int("kernel height", window.kernel_height)?,
            kw: int("kernel width", window.kernel_width)?,
            sh: int("stride", window.stride_height)?,
            sw: int("stride", window.stride_width)?,
            ph: int("padding", window.pad_height)?,
            pw: int("padding", window.pad_width)?,
            oh: int("output height", window.out_height())?,
            ow: int("output width", window.out_width())?,
        })
    }
}

/// Checks that every position of `window`'s input plane is exact as an f32 argmax (at most
/// [`MAX_POOL_PLANE_LIMIT`] = 2^24 positions), with the CPU kernel's error otherwise.
fn check_argmax_plane(op: &str, window: &Window2d) -> Result<()> {
    if window.in_plane_len() > MAX_POOL_PLANE_LIMIT {
        return Err(Error::invalid(
            "max pooling input",
            format!(
                "{op}: a {}x{} plane exceeds 2^24 positions, which f32 argmax indices cannot address",
                window.in_height, window.in_width
            ),
        ));
    }
    Ok(())
}

impl CudaStream {
    /// The im2col matrices of `batch` NCHW samples (`input`: `batch x window.input_len()`) into
    /// `cols`: `batch` row-major `window.col_rows() x out_h*out_w` matrices, one after another
    /// (`cpu::conv::im2col` per sample); padded positions become zero.
    pub fn im2col(
        &self,
        input: &CudaBuffer<f32>,
        batch: usize,
        window: &Window2d,
        cols: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        let kernel = Kernel::Im2colF32;
        let op = kernel.name();
        self.check_len(op, "input", batch * window.input_len(), input.len())?;
        self.check_len(op, "cols", batch * window.col_rows() * window.out_plane_len(), cols.len())?;
        self.check_on_device(op, input)?;
        self.check_on_device(op, cols)?;
        if cols.is_empty() {
            return Ok(());
        }
        let a = WindowArgs::new(op, window)?;
        let batch_arg = to_i32(op, "batch", batch)?;
        let config = self.grid_stride(cols.len());
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&input.slice).arg(&mut cols.slice).arg(&batch_arg).arg(&a.channels);
        launch
            .arg(&a.h)
            .arg(&a.w)
            .arg(&a.kh)
            .arg(&a.kw)
            .arg(&a.sh)
            .arg(&a.sw)
            .arg(&a.ph)
            .arg(&a.pw)
            .arg(&a.oh)
            .arg(&a.ow);
        // SAFETY: the kernel writes every element of cols (batch x col_rows x out_plane, checked)
        // and reads input only at in-range positions of its batch x channels x h x w (checked).
        unsafe { launch.launch(config) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// The adjoint of [`CudaStream::im2col`], accumulated: `input_grad += col2im(cols)` for
    /// `batch` samples (`cpu::conv::col2im` per sample). Deterministic (a gather, no atomics).
    pub fn col2im(
        &self,
        cols: &CudaBuffer<f32>,
        batch: usize,
        window: &Window2d,
        input_grad: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        let kernel = Kernel::Col2imF32;
        let op = kernel.name();
        self.check_len(op, "cols", batch * window.col_rows() * window.out_plane_len(), cols.len())?;
        self.check_len(op, "input_grad", batch * window.input_len(), input_grad.len())?;
        self.check_on_device(op, cols)?;
        self.check_on_device(op, input_grad)?;
        if input_grad.is_empty() {
            return Ok(());
        }
        let a = WindowArgs::new(op, window)?;
        let batch_arg = to_i32(op, "batch", batch)?;
        let config = self.grid_stride(input_grad.len());
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&cols.slice).arg(&mut input_grad.slice).arg(&batch_arg).arg(&a.channels);
        launch
            .arg(&a.h)
            .arg(&a.w)
            .arg(&a.kh)
            .arg(&a.kw)
            .arg(&a.sh)
            .arg(&a.sw)
            .arg(&a.ph)
            .arg(&a.pw)
            .arg(&a.oh)
            .arg(&a.ow);
        // SAFETY: one thread per input element (batch x channels x h x w, checked) reads the
        // column entries of its own sample's matrix (batch x col_rows x out_plane, checked).
        unsafe { launch.launch(config) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// Max pooling of `n_planes` planes: `output` gets each window's maximum (padding acting as
    /// -inf), `argmax` its position within the input plane (`row * in_width + col`, -1 for a
    /// window entirely in the padding) as an f32, the layout of `cpu::pool::max_pool2d_forward`
    /// bit for bit. Planes above [`MAX_POOL_PLANE_LIMIT`] (2^24) positions, which f32 cannot
    /// address exactly, are an error, as on the CPU.
    pub fn max_pool_forward(
        &self,
        input: &CudaBuffer<f32>,
        n_planes: usize,
        window: &Window2d,
        output: &mut CudaBuffer<f32>,
        argmax: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        let kernel = Kernel::MaxPoolForwardF32;
        let op = kernel.name();
        check_argmax_plane(op, window)?;
        let out_len = n_planes * window.out_plane_len();
        self.check_len(op, "input", n_planes * window.in_plane_len(), input.len())?;
        self.check_len(op, "output", out_len, output.len())?;
        self.check_len(op, "argmax", out_len, argmax.len())?;
        self.check_on_device(op, input)?;
        self.check_on_device(op, output)?;
        self.check_on_device(op, argmax)?;
        if out_len == 0 {
            return Ok(());
        }
        let a = WindowArgs::new(op, window)?;
        let planes = n_planes as i64;
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&input.slice).arg(&mut output.slice).arg(&mut argmax.slice).arg(&planes);
        launch
            .arg(&a.h)
            .arg(&a.w)
            .arg(&a.kh)
            .arg(&a.kw)
            .arg(&a.sh)
            .arg(&a.sw)
            .arg(&a.ph)
            .arg(&a.pw)
            .arg(&a.oh)
            .arg(&a.ow);
        // SAFETY: one thread per output element (planes x oh x ow, checked) reads in-range
        // positions of its plane (planes x h x w, checked) and writes its y and argmax entries.
        unsafe { launch.launch(self.grid_stride(out_len)) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// Max pooling's input gradient, accumulated: `input_grad[p, argmax] += grad_output`
    /// (`cpu::pool::max_pool2d_backward`), reading the f32 argmax [`CudaStream::max_pool_forward`]
    /// wrote; positions outside `[0, in_plane)` (-1, NaN) route nothing. Atomic adds: where
    /// windows overlap, a position's gradients are summed in no fixed order.
    pub fn max_pool_backward(
        &self,
        grad_output: &CudaBuffer<f32>,
        argmax: &CudaBuffer<f32>,
        n_planes: usize,
        window: &Window2d,
        input_grad: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        let kernel = Kernel::MaxPoolBackwardF32;
        let op = kernel.name();
        check_argmax_plane(op, window)?;
        let out_len = n_planes * window.out_plane_len();
        self.check_len(op, "grad_output", out_len, grad_output.len())?;
        self.check_len(op, "argmax", out_len, argmax.len())?;
        self.check_len(op, "input_grad", n_planes * window.in_plane_len(), input_grad.len())?;
        self.check_on_device(op, grad_output)?;
        self.check_on_device(op, argmax)?;
        self.check_on_device(op, input_grad)?;
        if out_len == 0 {
            return Ok(());
        }
        let (planes, in_plane, out_plane) =
            (n_planes as i64, window.in_plane_len() as i64, window.out_plane_len() as i64);
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&grad_output.slice).arg(&argmax.slice).arg(&mut input_grad.slice);
        launch.arg(&planes).arg(&in_plane).arg(&out_plane);
        // SAFETY: one thread per output element reads dy and argmax (planes x out_plane, checked)
        // and adds into its plane of input_grad only at 0 <= argmax < in_plane.
        unsafe { launch.launch(self.grid_stride(out_len)) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// Average pooling of `n_planes` planes, padding counted in the divisor
    /// (`cpu::pool::avg_pool2d_forward`).
    pub fn avg_pool_forward(
        &self,
        input: &CudaBuffer<f32>,
        n_planes: usize,
        window: &Window2d,
        output: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        let kernel = Kernel::AvgPoolForwardF32;
        let op = kernel.name();
        let out_len = n_planes * window.out_plane_len();
        self.check_len(op, "input", n_planes * window.in_plane_len(), input.len())?;
        self.check_len(op, "output", out_len, output.len())?;
        self.check_on_device(op, input)?;
        self.check_on_device(op, output)?;
        if out_len == 0 {
            return Ok(());
        }
        let a = WindowArgs::new(op, window)?;
        let planes = n_planes as i64;
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&input.slice).arg(&mut output.slice).arg(&planes);
        launch
            .arg(&a.h)
            .arg(&a.w)
            .arg(&a.kh)
            .arg(&a.kw)
            .arg(&a.sh)
            .arg(&a.sw)
            .arg(&a.ph)
            .arg(&a.pw)
            .arg(&a.oh)
            .arg(&a.ow);
        // SAFETY: one thread per output element (checked) reads in-range positions of its plane.
        unsafe { launch.launch(self.grid_stride(out_len)) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// Average pooling's input gradient, accumulated (`cpu::pool::avg_pool2d_backward`).
    /// Deterministic (a gather, no atomics).
    pub fn avg_pool_backward(
        &self,
        grad_output: &CudaBuffer<f32>,
        n_planes: usize,
        window: &Window2d,
        input_grad: &mut CudaBuffer<f32>,
    ) -> Result<()> {
        let kernel = Kernel::AvgPoolBackwardF32;
        let op = kernel.name();
        let in_len = n_planes * window.in_plane_len();
        self.check_len(op, "grad_output", n_planes * window.out_plane_len(), grad_output.len())?;
        self.check_len(op, "input_grad", in_len, input_grad.len())?;
        self.check_on_device(op, grad_output)?;
        self.check_on_device(op, input_grad)?;
        if in_len == 0 {
            return Ok(());
        }
        let a = WindowArgs::new(op, window)?;
        let planes = n_planes as i64;
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&grad_output.slice).arg(&mut input_grad.slice).arg(&planes);
        launch
            .arg(&a.h)
            .arg(&a.w)
            .arg(&a.kh)
            .arg(&a.kw)
            .arg(&a.sh)
            .arg(&a.sw)
            .arg(&a.ph)
            .arg(&a.pw)
            .arg(&a.oh)
            .arg(&a.ow);
        // SAFETY: one thread per input element (checked) reads its windows' entries of its plane
        // of grad_output (planes x oh x ow, checked).
        unsafe { launch.launch(self.grid_stride(in_len)) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }
}
