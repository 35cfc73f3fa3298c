//! `PendingSlots`: the gradients a split layer's two backward calls share. Whichever of
//! `backward_input` and `backward_weight` runs first computes every local shard's tensor (the
//! attention's `∂L/∂qkv`, the MLP block's hidden gradient) and leaves it here, keyed by a saved
//! tensor of the forward (which identifies its `Saved`) and the output gradient; the other call
//! takes it out, so it is dropped when that call returns. `Saved` is immutable, so the slots live
//! in the layer. A slot whose `Saved` is gone (only the slot still holds its key) is stale and
//! dropped on the next call. The memory plan counts a slot through the layer's
//! `backward_held_bytes_per_sample`.
use std::sync::{Mutex, MutexGuard};

use conveyor_engine::Tensor;

/// Which backward call filled a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Half {
    Input,
    Weight,
}

/// Every local shard's shared gradient for one (`Saved`, output gradient) pair.
#[derive(Debug)]
struct Slot {
    /// A share of a tensor of the `Saved` the slot was computed from.
    key: Tensor,
    /// A share of the output gradient the slot was computed from.
    grad_output: Tensor,
    tensors: Vec<Tensor>,
    filled_by: Half,
}

impl Slot {
    fn is_for(&self, key: &Tensor, grad_output: &Tensor) -> bool {
        self.key.shares_storage_with(key) && self.grad_output.shares_storage_with(grad_output)
    }
}

/// The slots of one layer. A `Mutex` because the layer is shared with its shard threads; only the
/// calling pipeline worker's thread takes it, so it is never contended.
#[derive(Debug, Default)]
pub(crate) struct PendingSlots {
    slots: Mutex<Vec<Slot>>,
}

impl PendingSlots {
    fn slots(&self) -> MutexGuard<'_, Vec<Slot>> {
        self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Bytes waiting in slots for their second backward call.
    pub(crate) fn bytes(&self) -> usize {
        self.slots().iter().flat_map(|s| &s.tensors).map(Tensor::size_in_bytes).sum()
    }

    /// The tensors the other backward call (not `half`) left for `key` and `grad_output`, if any.
    pub(crate) fn take(&self, key: &Tensor, grad_output: &Tensor, half: Half) -> Option<Vec<Tensor>> {
        let mut slots = self.slots();
        slots.retain(|slot| slot.key.is_shared());
        let i = slots.iter().position(|s| s.is_for(key, grad_output) && s.filled_by != half)?;
        Some(slots.swap_remove(i).tensors)
    }

    /// Leaves `tensors` (shares of them) for the other backward call of the same `key` and `grad_output`.
    pub(crate) fn leave(&self, key: &Tensor, grad_output: &Tensor, tensors: &[Tensor], half: Half) {
        let mut slots = self.slots();
        if !slots.iter().any(|s| s.is_for(key, grad_output)) {
            slots.push(Slot {
                key: key.share(),
                grad_output: grad_output.share(),
                tensors: tensors.iter().map(Tensor::share).collect(),
                filled_by: half,
            });
        }
    }
}
