//! The `Schedule` value: which device runs which instructions in which order, and the
//! stage-to-device mapping.
use serde::Serialize;

use crate::error::ScheduleError;
use crate::instruction::Instruction;
use crate::kind::ScheduleKind;
use crate::layout::StageLayout;
use crate::{chunked_zero_bubble, dualpipe_v, gpipe, interleaved, one_f_one_b, zero_bubble};

/// A pipeline schedule: one instruction list per device. **API Boundary**: the engine's runtime
/// executes `program(device_idx)` in order, communicating by the rule of
/// [`Instruction::recv_from`] / [`Instruction::send_to`] applied to its graph's routes.
///
/// Stages: `n_stages = n_devices * n_chunks`, placed by the kind's [`StageLayout`]: looped, stage
/// `s` on device `s % n_devices` as its chunk `s / n_devices` (Megatron's virtual-pipeline
/// mapping; with one chunk, stage `s` is device `s`), or in a V for ZB-V and DualPipe-V (stage `s`
/// on device `s` for `s < p`, on device `2p - 1 - s` otherwise). Every user of the mapping calls
/// [`Schedule::device_of_stage`], [`Schedule::chunk_of_stage`] or [`Schedule::stages_of_device`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Schedule {
    kind: ScheduleKind,
    layout: StageLayout,
    n_devices: usize,
    n_chunks: usize,
    n_micro_batches: usize,
    programs: Vec<Vec<Instruction>>,
}

impl Schedule {
    /// Generates the `kind` schedule for `n_devices` devices, `n_micro_batches` micro-batches and
    /// `n_chunks` chunks per device (1 except for the interleaved kinds; 2 for the V kinds).
    ///
    /// Errors: any count of 0; `n_chunks > 1` for a kind that places one stage per device;
    /// `n_chunks != 2` for ZB-V and DualPipe-V; interleaved with `n_chunks > 1` and
    /// `n_micro_batches` not a multiple of `n_devices`; DualPipe-V with fewer than `2 n_devices`
    /// micro-batches.
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
        if let Some(required) = kind.required_chunks() {
            if n_chunks != required {
                return Err(ScheduleError::ChunksRequired { kind, required, n_chunks });
            }
        } else if n_chunks > 1 && !kind.supports_chunks() {
            return Err(ScheduleError::ChunksUnsupported { kind, n_chunks });
        }
        if kind == ScheduleKind::DualPipeV && n_micro_batches < 2 * n_devices {
            return Err(ScheduleError::TooFewMicroBatches { kind, n_micro_batches, n_devices, minimum: 2 * n_devices });
        }
        if kind == ScheduleKind::Interleaved && n_chunks > 1 && !n_micro_batches.is_multiple_of(n_devices) {
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
            ScheduleKind::ZbV | ScheduleKind::InterleavedZb if n_chunks == 1 => {
                zero_bubble::programs(zero_bubble::Variant::H1, n_devices, n_micro_batches)
            }
            ScheduleKind::ZbV | ScheduleKind::InterleavedZb => {
                chunked_zero_bubble::programs(kind.layout(), n_devices, n_micro_batches, n_chunks)
            }
            ScheduleKind::DualPipeV => dualpipe_v::programs(n_devices, n_micro_batches),
        };
        Ok(Schedule { kind, layout: kind.layout(), n_devices, n_chunks, n_micro_batches, programs })
    }

    /// Wraps hand-written programs without checking them; run [`crate::validate`] before executing.
    pub fn from_programs(
        kind: ScheduleKind,
        n_devices: usize,
        n_micro_batches: usize,
        n_chunks: usize,
        programs: Vec<Vec<Instruction>>,
    ) -> Schedule {
        Schedule { kind, layout: kind.layout(), n_devices, n_chunks, n_micro_batches, programs }
    }

    /// The schedule's kind.
    pub fn kind(&self) -> ScheduleKind {
        self.kind
    }

    /// Where the stages sit: looped or in a V.
    pub fn layout(&self) -> StageLayout {
        self.layout
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

    /// The device that holds `stage_idx` ([`StageLayout::device_of_stage`]).
    pub fn device_of_stage(&self, stage_idx: usize) -> usize {
        self.layout.device_of_stage(stage_idx, self.n_devices)
    }

    /// The chunk index of `stage_idx` on its device: `stage_idx / n_devices`.
    pub fn chunk_of_stage(&self, stage_idx: usize) -> usize {
        self.layout.chunk_of_stage(stage_idx, self.n_devices)
    }

    /// The stages held by `device_idx`, chunk 0 first.
    pub fn stages_of_device(&self, device_idx: usize) -> impl Iterator<Item = usize> + use<> {
        let (layout, n_devices) = (self.layout, self.n_devices);
        (0..self.n_chunks).map(move |chunk_idx| layout.stage_of(device_idx, chunk_idx, n_devices))
    }

    /// A label per device naming the stages it holds, chunk 0 first: `stages 0, 7` (device 0 of
    /// four in a V), `stage 2` with one chunk. The SVG and trace rows show it.
    pub fn device_stage_labels(&self) -> Vec<String> {
        (0..self.n_devices)
            .map(|device_idx| {
                let stages: Vec<String> = self.stages_of_device(device_idx).map(|s| s.to_string()).collect();
                let noun = if stages.len() == 1 { "stage" } else { "stages" };
                format!("{noun} {}", stages.join(", "))
            })
            .collect()
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
        let v = Schedule::new(ScheduleKind::ZbV, 4, 8, 2).unwrap();
        assert_eq!((v.device_of_stage(5), v.chunk_of_stage(5)), (2, 1));
        assert_eq!(v.stages_of_device(0).collect::<Vec<_>>(), vec![0, 7]);
        assert_eq!(v.stages_of_device(3).collect::<Vec<_>>(), vec![3, 4]);
        assert_eq!(v.device_stage_labels(), ["stages 0, 7", "stages 1, 6", "stages 2, 5", "stages 3, 4"]);
    }

    #[test]
    fn v_schedules_need_two_chunks() {
        for kind in [ScheduleKind::ZbV, ScheduleKind::DualPipeV] {
            for n_chunks in [1, 3] {
                let err = Schedule::new(kind, 4, 8, n_chunks).unwrap_err();
                assert_eq!(err, ScheduleError::ChunksRequired { kind, required: 2, n_chunks });
                assert!(err.to_string().contains("give n_chunks = 2"), "{err}");
            }
        }
        let few = Schedule::new(ScheduleKind::DualPipeV, 4, 7, 2).unwrap_err();
        assert!(few.to_string().contains("at least 8 micro-batches"), "{few}");
        assert!(Schedule::new(ScheduleKind::InterleavedZb, 4, 6, 2).is_ok());
    }
}
