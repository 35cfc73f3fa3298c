//! Typed launch wrappers for `optim.cu`: SGD and Adam/AdamW updates with torch.optim's rules. The
//! host computes every scalar in f64 and rounds it to f32 exactly where `optim::sgd` and
//! `optim::adam` round it, so with the kernels compiled without contracted multiply-adds a GPU
//! update rounds like the CPU update.
use cudarc::driver::PushKernelArg;

use super::buffer::CudaBuffer;
use super::compile::Kernel;
use super::stream::CudaStream;
use crate::Result;
use crate::optim::{AdamConfig, SgdConfig};

impl CudaStream {
    /// One SGD update of `param` from `grad`, in place. `momentum_buffer` must be given exactly
    /// when `config.momentum != 0` (as `SgdConfig::uses_momentum_buffer`); `first_step` says
    /// whether it is still to be initialised from the gradient.
    pub fn sgd_step(
        &self,
        param: &mut CudaBuffer<f32>,
        grad: &CudaBuffer<f32>,
        momentum_buffer: Option<&mut CudaBuffer<f32>>,
        config: &SgdConfig,
        first_step: bool,
    ) -> Result<()> {
        let kernel = Kernel::SgdStepF32;
        let op = kernel.name();
        config.validate()?;
        if momentum_buffer.is_some() != config.uses_momentum_buffer() {
            return Err(crate::Error::invalid(
                "momentum_buffer",
                format!(
                    "{op}: momentum {} {} a momentum buffer; pass one exactly when momentum is not 0",
                    config.momentum,
                    if config.uses_momentum_buffer() { "needs" } else { "takes no" }
                ),
            ));
        }
        let n = param.len();
        self.check_len(op, "grad", n, grad.len())?;
        self.check_on_device(op, param)?;
        self.check_on_device(op, grad)?;
        if let Some(buffer) = momentum_buffer.as_deref() {
            self.check_len(op, "momentum_buffer", n, buffer.len())?;
            self.check_on_device(op, buffer)?;
        }
        if n == 0 {
            return Ok(());
        }
        let neg_lr = (-config.lr) as f32;
        let momentum = config.momentum as f32;
        let one_minus_dampening = (1.0 - config.dampening) as f32;
        let weight_decay = config.weight_decay as f32;
        let apply_weight_decay = i32::from(config.weight_decay != 0.0);
        let use_momentum = i32::from(momentum_buffer.is_some());
        let nesterov = i32::from(config.nesterov);
        let first_step = i32::from(first_step);
        // Without momentum the kernel never touches `buf`; it gets a one-element placeholder.
        let mut placeholder;
        let buffer = match momentum_buffer {
            Some(buffer) => buffer,
            None => {
                placeholder = self.alloc_zeros::<f32>(1)?;
                &mut placeholder
            }
        };
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&mut param.slice).arg(&grad.slice).arg(&mut buffer.slice);
        launch.arg(&neg_lr).arg(&momentum).arg(&one_minus_dampening).arg(&weight_decay);
        launch.arg(&apply_weight_decay).arg(&use_momentum).arg(&nesterov).arg(&first_step).arg(&n);
        // SAFETY: reads n floats of grad, reads and writes n floats of p and, when use_momentum,
        // of buf (lengths checked above); the int flags are C ints (i32), n is size_t (usize).
        unsafe { launch.launch(self.grid_stride(n)) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }

    /// One Adam (`decoupled == false`) or AdamW (`decoupled == true`) update of `param`, in place,
    /// with its first and second moments; `step` counts this update (1 on the first).
    #[allow(clippy::too_many_arguments)]
    pub fn adam_step(
        &self,
        param: &mut CudaBuffer<f32>,
        grad: &CudaBuffer<f32>,
        exp_avg: &mut CudaBuffer<f32>,
        exp_avg_sq: &mut CudaBuffer<f32>,
        config: &AdamConfig,
        decoupled: bool,
        step: u64,
    ) -> Result<()> {
        let kernel = Kernel::AdamStepF32;
        let op = kernel.name();
        config.validate()?;
        if step == 0 {
            return Err(crate::Error::invalid("step", format!("{op}: steps count from 1 (the first update)")));
        }
        let n = param.len();
        for (what, len) in [("grad", grad.len()), ("exp_avg", exp_avg.len()), ("exp_avg_sq", exp_avg_sq.len())] {
            self.check_len(op, what, n, len)?;
        }
        self.check_on_device(op, param)?;
        self.check_on_device(op, grad)?;
        self.check_on_device(op, exp_avg)?;
        self.check_on_device(op, exp_avg_sq)?;
        if n == 0 {
            return Ok(());
        }
        // The scalars of `optim::adam::adam_update`, rounded where it rounds them.
        let weight_decay_mode: i32 = match (config.weight_decay != 0.0, decoupled) {
            (false, _) => 0,
            (true, false) => 1,
            (true, true) => 2,
        };
        let scalars = crate::optim::adam::AdamScalars::new(config, step);
        let function = self.kernels()?.get(kernel);
        let mut launch = self.raw.launch_builder(function);
        launch.arg(&mut param.slice).arg(&grad.slice).arg(&mut exp_avg.slice).arg(&mut exp_avg_sq.slice);
        launch
            .arg(&scalars.lerp_weight)
            .arg(&scalars.beta2)
            .arg(&scalars.one_minus_beta2)
            .arg(&scalars.eps)
            .arg(&scalars.weight_decay)
            .arg(&scalars.decay_factor);
        launch.arg(&weight_decay_mode).arg(&scalars.neg_step_size).arg(&scalars.bias_correction2_sqrt).arg(&n);
        // SAFETY: reads n floats of grad and reads and writes n floats of p, m and v (checked).
        unsafe { launch.launch(self.grid_stride(n)) }.map(drop).map_err(|err| self.launch_error(kernel, err))
    }
}
