//! Undo snapshots of optimizer state, for the runtime's all-or-nothing commit: a copy of every
//! parameter's state (step count and buffers) taken before an update, into buffers kept from step
//! to step, and swapped back in O(1) when the step must be rolled back.
use super::Optimizer;
use super::state::ParamState;
use crate::{Result, Tensor};

/// A copy of an [`Optimizer`]'s state ([`Optimizer::snapshot_state`]); its buffers are reused by
/// the next snapshot, so only the first one allocates.
#[derive(Debug, Default)]
pub struct StateSnapshot {
    states: Vec<ParamState>,
    valid: bool,
}

impl StateSnapshot {
    /// Bytes of buffers the snapshot holds.
    pub fn size_in_bytes(&self) -> usize {
        self.states.iter().map(ParamState::size_in_bytes).sum()
    }
}

/// Copies `src` into `dst`, reusing `dst`'s buffer when it has the same shape and device.
fn copy_buffer(dst: &mut Option<Tensor>, src: Option<&Tensor>) -> Result<()> {
    match (dst.as_mut(), src) {
        (Some(d), Some(s)) if d.shape() == s.shape() && d.device().same_device(s.device()) => d.copy_from(s),
        (_, Some(s)) => {
            *dst = None; // free the old buffer before reserving the new one
            *dst = Some(s.try_clone()?);
            Ok(())
        }
        (_, None) => {
            *dst = None;
            Ok(())
        }
    }
}

impl Optimizer {
    /// Copies every parameter's state into `into` (step counts and buffers). Fails only when a
    /// first snapshot's buffers do not fit their device; `into` is then not valid for a restore.
    pub fn snapshot_state(&self, into: &mut StateSnapshot) -> Result<()> {
        into.valid = false;
        into.states.resize_with(self.states.len(), ParamState::default);
        for (dst, src) in into.states.iter_mut().zip(&self.states) {
            dst.step = src.step;
            copy_buffer(&mut dst.momentum_buffer, src.momentum_buffer.as_ref())?;
            copy_buffer(&mut dst.exp_avg, src.exp_avg.as_ref())?;
            copy_buffer(&mut dst.exp_avg_sq, src.exp_avg_sq.as_ref())?;
        }
        into.valid = true;
        Ok(())
    }

    /// Puts the state of the last [`Optimizer::snapshot_state`] back, in O(1) (the buffers are
    /// swapped, never copied, so this cannot fail), and marks the snapshot used. False when
    /// `from` holds no valid snapshot of this optimizer (nothing changed then).
    pub fn restore_state(&mut self, from: &mut StateSnapshot) -> bool {
        if !from.valid || from.states.len() != self.states.len() {
            return false;
        }
        std::mem::swap(&mut self.states, &mut from.states);
        from.valid = false;
        true
    }

    /// Gives every state buffer private elements (see [`Tensor::make_unique`]), so that the next
    /// update writes in place without allocating.
    pub fn make_state_unique(&mut self) -> Result<()> {
        for state in &mut self.states {
            for buffer in [&mut state.momentum_buffer, &mut state.exp_avg, &mut state.exp_avg_sq].into_iter().flatten()
            {
                buffer.make_unique()?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;
    use crate::optim::OptimizerConfig;

    #[test]
    fn a_restored_snapshot_undoes_an_adam_update_bit_for_bit() {
        let device = Device::cpu(0);
        let mut param = Tensor::from_slice(&[1.0, -2.0, 3.0], [3], &device).unwrap();
        let grad = Tensor::from_slice(&[0.25, 0.5, -1.0], [3], &device).unwrap();
        let mut optimizer = Optimizer::new(OptimizerConfig::adam(0.1), 1).unwrap();
        optimizer.step(&mut [&mut param], &[&grad]).unwrap();
        let before_param = param.try_clone().unwrap();
        let before_avg = optimizer.state(0).unwrap().exp_avg().unwrap().try_clone().unwrap();
        let mut snapshot = StateSnapshot::default();
        optimizer.snapshot_state(&mut snapshot).unwrap();
        let saved_param = param.try_clone().unwrap();
        optimizer.step(&mut [&mut param], &[&grad]).unwrap();
        assert_eq!(optimizer.state(0).unwrap().step(), 2);
        assert!(optimizer.restore_state(&mut snapshot));
        param = saved_param;
        assert_eq!(optimizer.state(0).unwrap().step(), 1);
        assert!(optimizer.state(0).unwrap().exp_avg().unwrap().bit_eq(&before_avg));
        assert!(param.bit_eq(&before_param));
        // A snapshot restores once.
        assert!(!optimizer.restore_state(&mut snapshot));
    }
}
