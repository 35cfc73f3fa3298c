//! The `Schedule` value: which device runs which instructions in which order, and the
//! stage-to-device mapping.
use serde::Serialize;

use crate::error::ScheduleError;
use crate::instruction::Instruction;
use crate::kind::ScheduleKind;
use crate::{gpipe, interleaved, one_f_one_b, zero_bubble};

/// A pipeline schedule: one instruction list per device. **API Boundary**: the engine's runtime
/// executes `program(device_idx)` in order, communicating by the rule of
/// [`Instruction::recv_from`] / [`Instruction::send_to`] applied to its graph's routes.
///
/// Stages: `n_stages = n_devices * n_chunks`. Stage `s` lives on device `s % n_devices` as its
/// chunk `s / n_devices` (Megatron's virtual-pipeline mapping); with one chunk, stage `s` is
/// device `s`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Schedule {
    kind: ScheduleKind,
    n_devices: usize,
    n_chunks: usize,
    n_micro_batches: usize,
    programs: Vec<Vec<Instruction>>,
}

impl Schedule {
    /// Generates the `kind` schedule for `n_devices` devices, `n_micro_batches` micro-batches and
    /// `n_chunks` chunks per device (1 except for [`ScheduleKind::Interleaved`]).
    ///
    /// Errors: any count of 0; `n_chunks > 1` for a kind other than interleaved; interleaved
    /// with `n_chunks > 1` and `n_micro_batches` not a multiple of `n_devices`.
    pub fn new(
        kind: ScheduleKind,
        n_devices: usize,
        n_micro_batches: usize,
        n_chunks: usize,
    ) -> Result<Schedule, ScheduleError> {
        for (value, parameter, noun) in [
            (n_devices, "n_devices", "device"),
            (n_micro_batches, "n_micro_batches", "micro-batch"),
            (n_chunks, "n_chunks", "chunk per device"),
        ] {
            if value == 0 {
                return Err(ScheduleError::ZeroParameter { parameter, noun });
            }
        }
        if n_chunks > 1 && !kind.supports_chunks() {
            return Err(ScheduleError::ChunksUnsupported { kind, n_chunks });
        }
        if n_chunks > 1 && !n_micro_batches.is_multiple_of(n_devices) {
            return Err(ScheduleError::MicroBatchesNotMultipleOfDevices {
                n_micro_batches,
                n_devices,
                n_chunks,
                suggested: n_micro_batches.next_multiple_of(n_devices),
            });
        }
        let programs = match kind {
            ScheduleKind::GPipe => gpipe::programs(n_devices, n_micro_batches),
            ScheduleKind::OneFOneB => one_f_one_b::programs(n_devices, n_micro_batches),
            ScheduleKind::Interleaved => interleaved::programs(n_devices, n_micro_batches, n_chunks),
            ScheduleKind::ZbH1 => zero_bubble::programs(zero_bubble::Variant::H1, n_devices, n_micro_batches),
            ScheduleKind::ZbH2 => zero_bubble::programs(zero_bubble::Variant::H2, n_devices, n_micro_batches),
        };
        Ok(Schedule { kind, n_devices, n_chunks, n_micro_batches, programs })
    }

    /// Wraps hand-written programs without checking them; run [`crate::validate`] before executing.
    pub fn from_programs(
        kind: ScheduleKind,
        n_devices: usize,
        n_micro_batches: usize,
        n_chunks: usize,
        programs: Vec<Vec<Instruction>>,
    ) -> Schedule {
        Schedule { kind, n_devices, n_chunks, n_micro_batches, programs }
    }

    /// The schedule's kind.
    pub fn kind(&self) -> ScheduleKind {
        self.kind
    }

    /// Devices (pipeline depth `p`).
    pub fn n_devices(&self) -> usize {
        self.n_devices
    }

    /// Chunks (virtual stages) per device, `v`.
    pub fn n_chunks(&self) -> usize {
        self.n_chunks
    }

    /// Stages in the model, `n_devices * n_chunks`.
    pub fn n_stages(&self) -> usize {
        self.n_devices * self.n_chunks
    }

    /// Micro-batches per optimizer step, `m`.
    pub fn n_micro_batches(&self) -> usize {
        self.n_micro_batches
    }

    /// The device that holds `stage_idx`: `stage_idx % n_devices`.
    pub fn device_of_stage(&self, stage_idx: usize) -> usize {
        stage_idx % self.n_devices
    }

    /// The chunk index of `stage_idx` on its device: `stage_idx / n_devices`.
    pub fn chunk_of_stage(&self, stage_idx: usize) -> usize {
        stage_idx / self.n_devices
    }

    /// The stages held by `device_idx`, chunk 0 first.
    pub fn stages_of_device(&self, device_idx: usize) -> impl Iterator<Item = usize> + use<> {
        let n_devices = self.n_devices;
        (0..self.n_chunks).map(move |chunk_idx| chunk_idx * n_devices + device_idx)
    }

    /// Every device's program, device 0 first.
    pub fn programs(&self) -> &[Vec<Instruction>] {
        &self.programs
    }

    /// The program of `device_idx`.
    pub fn program(&self, device_idx: usize) -> &[Instruction] {
        &self.programs[device_idx]
    }

    /// Takes the programs out of the schedule.
    pub fn into_programs(self) -> Vec<Vec<Instruction>> {
        self.programs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_undefined_shapes() {
        use ScheduleKind::*;
        let zero = Schedule::new(GPipe, 0, 4, 1).unwrap_err();
        assert!(zero.to_string().contains("n_devices must be at least 1"), "{zero}");
        assert!(matches!(Schedule::new(OneFOneB, 2, 0, 1), Err(ScheduleError::ZeroParameter { .. })));
        assert!(matches!(Schedule::new(Interleaved, 2, 4, 0), Err(ScheduleError::ZeroParameter { .. })));
        let chunks = Schedule::new(ZbH1, 2, 4, 2).unwrap_err();
        assert!(chunks.to_string().contains("use the interleaved schedule"), "{chunks}");
        let multiple = Schedule::new(Interleaved, 4, 6, 2).unwrap_err();
        assert_eq!(
            multiple,
            ScheduleError::MicroBatchesNotMultipleOfDevices {
                n_micro_batches: 6,
                n_devices: 4,
                n_chunks: 2,
                suggested: 8
            }
        );
        assert!(Schedule::new(Interleaved, 4, 6, 1).is_ok());
    }

    #[test]
    fn virtual_pipeline_mapping() {
        let schedule = Schedule::new(ScheduleKind::Interleaved, 4, 8, 2).unwrap();
        assert_eq!(schedule.n_stages(), 8);
        assert_eq!(schedule.device_of_stage(5), 1);
        assert_eq!(schedule.chunk_of_stage(5), 1);
        assert_eq!(schedule.stages_of_device(3).collect::<Vec<_>>(), vec![3, 7]);
    }
}
