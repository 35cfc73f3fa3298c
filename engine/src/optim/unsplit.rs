//! Optimizer state of one layer under the layer's exported (unsplit) parameter names, so the state
//! of a tensor-parallel layer, kept per shard, is saved and loaded independent of the split.
//!
//! # Design
//!
//! Momentum buffers and Adam's moments are elementwise in their parameter, so a shard's buffer is
//! exactly the shard of the unsplit buffer. We therefore reuse the layer's own gathering: for each
//! state field, the layer's parameter values are swapped for that field's buffers, the layer's
//! [`Layer::export_parameters`] (or [`Layer::import_parameter`]) gathers (or splits) them under the
//! unsplit names, and the parameters are swapped back. The engine never learns how a layer splits.
//! The step count is per unsplit tensor: the step of the first parameter carrying its name (every
//! shard of one tensor is updated together). For an unsplit layer this gives exactly
//! [`Optimizer::export_state`]'s names and values.
use crate::checkpoint::Checkpoint;
use crate::optim::Optimizer;
use crate::optim::state::{STEP, optimizer_state_name};
use crate::{DType, Device, Error, Layer, Result, Shape, Tensor};

impl Optimizer {
    /// The state of `layer`'s parameters (this optimizer's parameters `offset..offset + n`, `n`
    /// the layer's parameter count) on the host, named `optimizer.<prefix>.<name>.<field>` for
    /// each name of [`Layer::export_parameter_shapes`]. Fields not yet allocated are zeros.
    pub fn export_layer_state(
        &self,
        prefix: &str,
        layer: &mut dyn Layer,
        offset: usize,
    ) -> Result<Vec<(String, Tensor)>> {
        let n_params = self.check_layer_range(layer, offset)?;
        let host = Device::host();
        let mut out = Vec::new();
        for (name, _) in layer.export_parameter_shapes() {
            let step = self.step_of(layer, offset, &name);
            let full = format!("{prefix}.{name}");
            out.push((
                optimizer_state_name(&full, STEP),
                Tensor::from_vec(vec![step as f32], Shape::new(Vec::new()), &host)?,
            ));
        }
        for &field in self.config.state_tensor_fields() {
            let mut buffers = Vec::with_capacity(n_params);
            for (param, state) in layer.parameters().iter().zip(&self.states[offset..offset + n_params]) {
                let buffer = state.buffers().find(|(f, _)| *f == field).map(|(_, t)| t.try_clone()).transpose()?;
                buffers.push(match buffer {
                    Some(buffer) => buffer,
                    None => Tensor::zeros(param.value.shape().clone(), DType::F32, param.value.device())?,
                });
            }
            swap_values(layer, &mut buffers);
            let gathered = layer.export_parameters();
            swap_values(layer, &mut buffers);
            layer.refresh()?;
            for (name, tensor) in gathered? {
                out.push((optimizer_state_name(&format!("{prefix}.{name}"), field), tensor));
            }
        }
        Ok(out)
    }

    /// Replaces the state of `layer`'s parameters (this optimizer's `offset..offset + n`) with the
    /// tensors [`Optimizer::export_layer_state`] names, taken out of `checkpoint` and split like the
    /// layer splits its parameters. A step of 0 means no state yet. Checks every tensor is present
    /// with the right shape before changing anything.
    pub fn import_layer_state(
        &mut self,
        prefix: &str,
        layer: &mut dyn Layer,
        offset: usize,
        checkpoint: &mut Checkpoint,
    ) -> Result<()> {
        let n_params = self.check_layer_range(layer, offset)?;
        let fields = self.config.state_tensor_fields();
        let shapes = layer.export_parameter_shapes();
        let scalar = Shape::new(Vec::new());
        for (name, shape) in &shapes {
            let full = format!("{prefix}.{name}");
            for (field, expected) in std::iter::once((STEP, &scalar)).chain(fields.iter().map(|&f| (f, shape))) {
                let tensor_name = optimizer_state_name(&full, field);
                match checkpoint.get(&tensor_name) {
                    Some(t) if t.shape() == expected && t.dtype() == DType::F32 => {}
                    Some(t) => {
                        return Err(checkpoint.error(format!(
                            "tensor `{tensor_name}` is {} {} but f32 {expected} was expected",
                            t.dtype(),
                            t.shape()
                        )));
                    }
                    None => {
                        return Err(checkpoint.error(format!(
                            "tensor `{tensor_name}` is missing: the {} state of `{full}` needs it",
                            self.config.name()
                        )));
                    }
                }
            }
        }
        let mut steps = Vec::with_capacity(shapes.len());
        for (name, _) in &shapes {
            let tensor_name = optimizer_state_name(&format!("{prefix}.{name}"), STEP);
            let value = checkpoint.take(&tensor_name).expect("checked present").as_f32()?[0];
            if !(value >= 0.0 && value.fract() == 0.0) {
                return Err(
                    checkpoint.error(format!("tensor `{tensor_name}` holds {value}, which is not a step count"))
                );
            }
            steps.push((name.clone(), value as u64));
        }
        let param_steps: Vec<u64> = layer
            .parameters()
            .iter()
            .map(|p| {
                steps
                    .iter()
                    .find(|(n, _)| *n == p.name)
                    .map_or_else(|| steps.iter().map(|s| s.1).max().unwrap_or(0), |s| s.1)
            })
            .collect();
        for &field in fields {
            let mut buffers = Vec::with_capacity(n_params);
            for param in layer.parameters() {
                buffers.push(Tensor::zeros(param.value.shape().clone(), DType::F32, param.value.device())?);
            }
            swap_values(layer, &mut buffers);
            let mut result = Ok(());
            for (name, _) in &shapes {
                let tensor_name = optimizer_state_name(&format!("{prefix}.{name}"), field);
                let tensor = checkpoint.take(&tensor_name).expect("checked present");
                result = result.and_then(|()| layer.import_parameter(name, &tensor));
            }
            swap_values(layer, &mut buffers);
            layer.refresh()?;
            result?;
            for ((state, buffer), &step) in
                self.states[offset..offset + n_params].iter_mut().zip(buffers).zip(&param_steps)
            {
                let slot = state.slot(field).expect("a state field");
                *slot = (step > 0).then_some(buffer);
            }
        }
        for (state, step) in self.states[offset..offset + n_params].iter_mut().zip(param_steps) {
            state.step = step;
            if step == 0 {
                state.momentum_buffer = None;
                state.exp_avg = None;
                state.exp_avg_sq = None;
            }
        }
        Ok(())
    }

    fn check_layer_range(&self, layer: &dyn Layer, offset: usize) -> Result<usize> {
        let n_params = layer.parameters().len();
        if offset + n_params > self.states.len() {
            return Err(Error::invalid(
                "optimizer layer state",
                format!(
                    "{} parameters at offset {offset} of an optimizer for {}; pass the layer's offset in the stage's parameter list",
                    layer.kind(),
                    self.states.len()
                ),
            ));
        }
        Ok(n_params)
    }

    /// The step of the first parameter named `name`, else the largest step of the layer.
    fn step_of(&self, layer: &dyn Layer, offset: usize, name: &str) -> u64 {
        let states = &self.states[offset..offset + layer.parameters().len()];
        layer
            .parameters()
            .iter()
            .position(|p| p.name == name)
            .map_or_else(|| states.iter().map(|s| s.step).max().unwrap_or(0), |i| states[i].step)
    }
}

/// Swaps each parameter value of `layer` with the tensor at the same index of `values`.
fn swap_values(layer: &mut dyn Layer, values: &mut [Tensor]) {
    for (param, value) in layer.parameters_mut().iter_mut().zip(values.iter_mut()) {
        std::mem::swap(&mut param.value, value);
    }
}
