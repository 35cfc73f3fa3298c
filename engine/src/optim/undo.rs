//! Out-of-place updates for the runtime's all-or-nothing commit. A [`StateSnapshot`] holds a spare
//! buffer for every optimizer-state buffer; [`Optimizer::apply_swapping`] writes a parameter's
//! new value and new state into spares and swaps them in, so that the old values stay behind, in
//! the spares, as the undo snapshot, for no more memory traffic than an update in place.
//! [`Optimizer::unswap`] puts the old state back in O(1).
use super::state::ParamState;
use super::{Optimizer, OptimizerConfig, adam, sgd};
use crate::tensor::{F32Mut, F32Ref};
use crate::{DType, Error, Result, Tensor};

/// Spare state buffers, one set per parameter ([`StateSnapshot::reserve`]); after
/// [`Optimizer::apply_swapping`] a parameter's entry holds its state from before the update.
#[derive(Debug, Default)]
pub struct StateSnapshot {
    states: Vec<ParamState>,
}

impl StateSnapshot {
    /// Bytes of buffers held.
    pub fn size_in_bytes(&self) -> usize {
        self.states.iter().map(ParamState::size_in_bytes).sum()
    }

    /// Allocates a spare like each of `optimizer`'s state buffers (same shape and device) where
    /// none fits yet; only the first call for a parameter allocates.
    pub fn reserve(&mut self, optimizer: &Optimizer) -> Result<()> {
        self.states.resize_with(optimizer.states.len(), ParamState::default);
        for (spare, state) in self.states.iter_mut().zip(&optimizer.states) {
            for (spare, buffer) in [
                (&mut spare.momentum_buffer, &state.momentum_buffer),
                (&mut spare.exp_avg, &state.exp_avg),
                (&mut spare.exp_avg_sq, &state.exp_avg_sq),
            ] {
                match (spare.as_ref(), buffer) {
                    (Some(s), Some(b)) if s.shape() == b.shape() && s.device().same_device(b.device()) => {}
                    (_, Some(b)) => {
                        *spare = None; // free the old spare before reserving the new one
                        *spare = Some(Tensor::zeros(b.shape().clone(), DType::F32, b.device())?);
                    }
                    (_, None) => *spare = None,
                }
            }
        }
        Ok(())
    }
}

fn mismatch(param_idx: usize) -> Error {
    Error::invalid(
        "undo snapshot",
        format!("parameter {param_idx}: its spare buffers were not reserved like the parameter and its state"),
    )
}

impl Optimizer {
    /// Updates parameter `param_idx` (after [`Optimizer::prepare_all`]) so that the old values are
    /// kept: the new parameter goes into `spare` and the new state into `snapshot`'s spares
    /// ([`StateSnapshot::reserve`]), which are then swapped in. Afterwards `spare` and the
    /// snapshot hold the parameter and state from before, and `*holds_old` is true (it is set as
    /// soon as they do, so a caller can undo a partial failure). Host tensors are updated out of
    /// place, bit for bit as in place; other storage copies the old values to the spares and
    /// updates in place.
    pub fn apply_swapping(
        &mut self,
        param_idx: usize,
        param: &mut Tensor,
        grad: &Tensor,
        spare: &mut Tensor,
        snapshot: &mut StateSnapshot,
        holds_old: &mut bool,
    ) -> Result<()> {
        *holds_old = false;
        let op = "optimizer step";
        let (Some(state), Some(spare_state)) = (self.states.get_mut(param_idx), snapshot.states.get_mut(param_idx))
        else {
            return Err(mismatch(param_idx));
        };
        if spare.shape() != param.shape() || !spare.device().same_device(param.device()) {
            return Err(mismatch(param_idx));
        }
        let step = state.step + 1;
        let first_step = state.step == 0;
        let done_out_of_place = {
            let old_p = param.f32_ref(op)?;
            let new_p = spare.f32_mut(op)?;
            let grad = grad.f32_ref(op)?;
            match (&self.config, old_p, new_p, grad) {
                (OptimizerConfig::Sgd(config), F32Ref::Host(old_p), F32Mut::Host(new_p), F32Ref::Host(grad)) => {
                    match (state.momentum_buffer.as_ref(), spare_state.momentum_buffer.as_mut()) {
                        (None, _) => {
                            sgd::sgd_update_into(config, old_p, grad, new_p, None, first_step);
                            true
                        }
                        (Some(old_b), Some(new_b)) => match (old_b.f32_ref(op)?, new_b.f32_mut(op)?) {
                            (F32Ref::Host(old_b), F32Mut::Host(new_b)) => {
                                sgd::sgd_update_into(config, old_p, grad, new_p, Some((old_b, new_b)), first_step);
                                true
                            }
                            _ => false,
                        },
                        (Some(_), None) => return Err(mismatch(param_idx)),
                    }
                }
                (
                    config @ (OptimizerConfig::Adam(adam_config) | OptimizerConfig::AdamW(adam_config)),
                    F32Ref::Host(old_p),
                    F32Mut::Host(new_p),
                    F32Ref::Host(grad),
                ) => {
                    let decoupled = matches!(config, OptimizerConfig::AdamW(_));
                    let (Some(m), Some(v), Some(new_m), Some(new_v)) = (
                        state.exp_avg.as_ref(),
                        state.exp_avg_sq.as_ref(),
                        spare_state.exp_avg.as_mut(),
                        spare_state.exp_avg_sq.as_mut(),
                    ) else {
                        return Err(mismatch(param_idx));
                    };
                    match (m.f32_ref(op)?, v.f32_ref(op)?, new_m.f32_mut(op)?, new_v.f32_mut(op)?) {
                        (F32Ref::Host(m), F32Ref::Host(v), F32Mut::Host(new_m), F32Mut::Host(new_v)) => {
                            adam::adam_update_into(
                                adam_config,
                                decoupled,
                                step,
                                (old_p, m, v),
                                grad,
                                (new_p, new_m, new_v),
                            );
                            true
                        }
                        _ => false,
                    }
                }
                _ => false,
            }
        };
        if done_out_of_place {
            std::mem::swap(param, spare);
            std::mem::swap(state, spare_state);
            state.step = step;
            spare_state.step = step - 1;
            *holds_old = true;
            return Ok(());
        }
        // Elsewhere (a GPU): keep copies of the old values, then update in place.
        spare.copy_from(param)?;
        for (spare, buffer) in [
            (&mut spare_state.momentum_buffer, &state.momentum_buffer),
            (&mut spare_state.exp_avg, &state.exp_avg),
            (&mut spare_state.exp_avg_sq, &state.exp_avg_sq),
        ] {
            if let (Some(spare), Some(buffer)) = (spare.as_mut(), buffer) {
                spare.copy_from(buffer)?;
            }
        }
        spare_state.step = state.step;
        *holds_old = true;
        self.apply(param_idx, param, grad)
    }

    /// Gives every state buffer private elements (see [`Tensor::make_unique`]), so that the next
    /// update writes without allocating.
    pub fn make_state_unique(&mut self) -> Result<()> {
        for state in &mut self.states {
            for buffer in [&mut state.momentum_buffer, &mut state.exp_avg, &mut state.exp_avg_sq].into_iter().flatten()
            {
                buffer.make_unique()?;
            }
        }
        Ok(())
    }

    /// Puts back the state of parameter `param_idx` from before [`Optimizer::apply_swapping`]
    /// (O(1): the buffers are swapped); the caller swaps the parameter back.
    pub fn unswap(&mut self, param_idx: usize, snapshot: &mut StateSnapshot) {
        if let (Some(state), Some(old)) = (self.states.get_mut(param_idx), snapshot.states.get_mut(param_idx)) {
            std::mem::swap(state, old);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;
    use crate::optim::SgdConfig;

    /// Three updates in place and out of place agree bit for bit, and an unswap after the third
    /// gives back the second's parameter and state.
    #[test]
    fn out_of_place_updates_equal_in_place_ones_and_undo_exactly() {
        let device = Device::cpu(0);
        let configs = [
            OptimizerConfig::Sgd(SgdConfig::new(0.1)),
            OptimizerConfig::Sgd(SgdConfig::new(0.1).with_momentum(0.9).with_weight_decay(0.01).with_nesterov(true)),
            OptimizerConfig::adam(0.01),
            OptimizerConfig::adamw(0.01),
        ];
        for config in configs {
            let values = [1.0, -2.0, 3.0, 0.5];
            let mut a = Tensor::from_slice(&values, [4], &device).unwrap();
            let mut b = a.try_clone().unwrap();
            let mut in_place = Optimizer::new(config, 1).unwrap();
            let mut swapping = Optimizer::new(config, 1).unwrap();
            let mut spare = Tensor::zeros([4], DType::F32, &device).unwrap();
            let mut snapshot = StateSnapshot::default();
            let mut before = None;
            for step in 0..3 {
                let grad = Tensor::from_slice(&[0.25, -0.5 * step as f32, 1.0, -1.0], [4], &device).unwrap();
                in_place.step(&mut [&mut a], &[&grad]).unwrap();
                swapping.prepare_all(&[&b], &[&grad]).unwrap();
                snapshot.reserve(&swapping).unwrap();
                before = Some(b.try_clone().unwrap());
                let mut holds_old = false;
                swapping.apply_swapping(0, &mut b, &grad, &mut spare, &mut snapshot, &mut holds_old).unwrap();
                assert!(holds_old);
                assert!(a.bit_eq(&b), "{config:?} step {step}");
                assert_eq!(in_place.state(0).unwrap().step(), swapping.state(0).unwrap().step());
                for (x, y) in in_place.state(0).unwrap().buffers().zip(swapping.state(0).unwrap().buffers()) {
                    assert!(x.1.bit_eq(y.1), "{config:?} step {step}: {}", x.0);
                }
            }
            std::mem::swap(&mut b, &mut spare);
            swapping.unswap(0, &mut snapshot);
            assert!(b.bit_eq(before.as_ref().unwrap()));
            assert_eq!(swapping.state(0).unwrap().step(), 2, "{config:?}");
        }
    }
}
