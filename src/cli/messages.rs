//! Engine and schedule errors the user caused with a flag, rewritten to name the flag: the
//! libraries speak of `n_micro_batches` and `stages`, the command line of `--microbatches` and
//! `--devices`. Each message says the flag, the value, what is wrong and what would fix it.
use conveyor::engine::Error;
use conveyor::schedules::ScheduleError;

use super::usage;

/// A schedule error in the command line's terms.
pub fn schedule_message(error: &ScheduleError) -> String {
    match error {
        ScheduleError::ZeroParameter { parameter, noun } => {
            let flag = match *parameter {
                "n_devices" => "--stages",
                "n_micro_batches" => "--microbatches",
                "n_chunks" => "--chunks",
                other => other,
            };
            format!("{flag} is 0: a pipeline needs at least one {noun}; give 1 or more")
        }
        ScheduleError::ChunksUnsupported { kind, n_chunks } => {
            format!(
                "--chunks {n_chunks} needs --schedule interleaved or interleaved-zb; {kind} places one stage per device, \
                 give --chunks 1"
            )
        }
        ScheduleError::ChunksRequired { kind, required, n_chunks } => format!(
            "--chunks {n_chunks} with --schedule {kind}: {kind} places exactly {required} chunks per device in a V \
             (device 0 holds the first and the last stage); give --chunks {required} or leave it out"
        ),
        ScheduleError::TooFewMicroBatches { kind, n_micro_batches, n_devices, minimum } => format!(
            "--microbatches {n_micro_batches} with --schedule {kind} on {n_devices} pipeline devices: it needs at least \
             {minimum} (2 per device, DualPipe's rule); give --microbatches {minimum} or more, or --schedule zb-v"
        ),
        ScheduleError::MicroBatchesNotMultipleOfDevices { n_micro_batches, n_devices, n_chunks, suggested } => format!(
            "--microbatches {n_micro_batches} with --schedule interleaved --chunks {n_chunks} on {n_devices} pipeline devices: \
             micro-batches enter in groups of {n_devices} (Megatron's rule), so they must be a multiple of {n_devices}; \
             give --microbatches {suggested} or --chunks 1"
        ),
        other => other.to_string(),
    }
}

/// Maps an engine error from planning or building that the flags caused to a usage error (exit
/// status 2) naming the flags; other errors pass unchanged.
pub fn engine_input_error(error: Error) -> anyhow::Error {
    match error {
        Error::Schedule(schedule) => usage(schedule_message(&schedule)),
        Error::InvalidArgument { name, reason } if name == "stages" => usage(format!("--devices/--stages: {reason}")),
        error @ Error::InvalidArgument { .. } => usage(error.to_string()),
        error @ Error::DoesNotFit { .. } => usage(format!("--devices/--device-memory: {error}")),
        other => anyhow::Error::new(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_errors_name_the_flags() {
        let error = ScheduleError::MicroBatchesNotMultipleOfDevices {
            n_micro_batches: 7,
            n_devices: 2,
            n_chunks: 2,
            suggested: 8,
        };
        let message = schedule_message(&error);
        assert!(message.starts_with("--microbatches 7 with --schedule interleaved --chunks 2"), "{message}");
        assert!(message.ends_with("give --microbatches 8 or --chunks 1"), "{message}");
        let zero = ScheduleError::ZeroParameter { parameter: "n_micro_batches", noun: "micro-batch" };
        assert!(schedule_message(&zero).starts_with("--microbatches is 0"));
    }
}
