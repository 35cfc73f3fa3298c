//! Where each stage lives: the stage-to-device mapping of a schedule, looped (Megatron's
//! virtual pipeline) or V-shaped (Zero Bubble's ZB-V, DeepSeek's DualPipe-V).
use serde::{Deserialize, Serialize};

/// How a schedule's `n_devices * n_chunks` stages sit on its devices. The one mapping every user
/// of stage placement calls ([`crate::Schedule::device_of_stage`] and friends, or this type when
/// no schedule is built yet); nothing else may compute a stage's device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StageLayout {
    /// Stage `s` on device `s % p` as its chunk `s / p`: the stages loop over the devices, chunk
    /// after chunk (with one chunk, stage `s` on device `s`).
    Loop,
    /// Chunks alternate direction: chunk `c` covers stages `c p .. (c + 1) p`, on devices `0..p`
    /// for even `c` and `p - 1..=0` for odd `c`. With two chunks, stage `s` is on device `s` for
    /// `s < p` and on device `2p - 1 - s` otherwise, so device 0 holds the first and the last
    /// stage and device `p - 1` the two middle ones (the V's turn, a message a device sends itself).
    V,
}

impl StageLayout {
    /// The device holding `stage_idx` among `n_devices`.
    pub fn device_of_stage(self, stage_idx: usize, n_devices: usize) -> usize {
        let n_devices = n_devices.max(1);
        let position = stage_idx % n_devices;
        match self {
            StageLayout::Loop => position,
            StageLayout::V if (stage_idx / n_devices).is_multiple_of(2) => position,
            StageLayout::V => n_devices - 1 - position,
        }
    }

    /// The chunk index of `stage_idx` on its device: `stage_idx / n_devices` in both layouts.
    pub fn chunk_of_stage(self, stage_idx: usize, n_devices: usize) -> usize {
        stage_idx / n_devices.max(1)
    }

    /// The stage that is chunk `chunk_idx` of `device_idx`.
    pub fn stage_of(self, device_idx: usize, chunk_idx: usize, n_devices: usize) -> usize {
        let position = match self {
            StageLayout::V if !chunk_idx.is_multiple_of(2) => n_devices - 1 - device_idx,
            _ => device_idx,
        };
        chunk_idx * n_devices + position
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mappings_are_inverse() {
        for layout in [StageLayout::Loop, StageLayout::V] {
            for n_devices in 1..=5 {
                for n_chunks in 1..=3 {
                    for stage_idx in 0..n_devices * n_chunks {
                        let device_idx = layout.device_of_stage(stage_idx, n_devices);
                        let chunk_idx = layout.chunk_of_stage(stage_idx, n_devices);
                        assert!(device_idx < n_devices);
                        assert_eq!(layout.stage_of(device_idx, chunk_idx, n_devices), stage_idx);
                    }
                }
            }
        }
    }

    #[test]
    fn v_puts_first_and_last_stage_on_device_0() {
        let devices: Vec<usize> = (0..8).map(|s| StageLayout::V.device_of_stage(s, 4)).collect();
        assert_eq!(devices, [0, 1, 2, 3, 3, 2, 1, 0]);
        let looped: Vec<usize> = (0..8).map(|s| StageLayout::Loop.device_of_stage(s, 4)).collect();
        assert_eq!(looped, [0, 1, 2, 3, 0, 1, 2, 3]);
    }
}
