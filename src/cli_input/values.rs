//! Flag values: `--device-memory` sizes, `--devices` lists, `--lr-schedule`, `--on-nonfinite`.
use conveyor_engine::device::DeviceListProblem;
use conveyor_engine::{Device, Error};

use super::{UsageError, usage};

/// Parses a size like `512MiB`, `2GiB`, `1000000` (bytes), `64KiB`, `1.5GB`: at least one byte and
/// below 2^64 bytes.
pub fn parse_size(text: &str) -> Result<u64, UsageError> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 =
        number.parse().map_err(|_| usage(format!("--device-memory `{text}`: expected a size like 512MiB or 2GiB")))?;
    let factor = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" | "k" => 1024.0,
        "mib" | "m" => 1024.0 * 1024.0,
        "gib" | "g" => 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        other => {
            return Err(usage(format!("--device-memory `{text}`: unknown unit `{other}`; use B, KiB, MiB or GiB")));
        }
    };
    let bytes = value * factor;
    if bytes.is_nan() || bytes < 1.0 {
        return Err(usage(format!("--device-memory `{text}`: the size must be at least one byte, e.g. 512MiB")));
    }
    // 2^64 as f64; `as u64` would saturate silently.
    if bytes >= 18_446_744_073_709_551_616.0 {
        return Err(usage(format!(
            "--device-memory `{text}`: over the largest size, 2^64 - 1 bytes; leave the flag out for no budget"
        )));
    }
    Ok(bytes as u64)
}

/// Parses `--devices` with the engine's device grammar ([`Device::parse_list_with_budget`]):
/// `cpu:N` (N devices), `cpu:0-3`, `cuda:0,1` (a list of GPUs) or a list of single devices such
/// as `cpu:0,cpu:1` or `cpu:0,cuda:0`, each with the budget; at most [`MAX_DEVICES`](crate::limits::MAX_DEVICES) devices.
/// The message names the flag and the value.
pub fn parse_devices(spec: &str, budget: Option<u64>) -> Result<Vec<Device>, UsageError> {
    Device::parse_list_with_budget(spec, budget).map_err(|e| match e {
        Error::InvalidDeviceList { problem: DeviceListProblem::TooMany { count, limit }, .. } => usage(format!(
            "--devices `{}...`: {count} devices are over the limit of {limit} devices (MAX_DEVICES)",
            spec.chars().take(40).collect::<String>()
        )),
        Error::InvalidDeviceList { problem, .. } => usage(format!("--devices `{spec}`: {problem}")),
        other => usage(format!("--devices `{spec}`: {other}")),
    })
}

/// `--bucket-size`: how data-parallel replicas all-reduce their gradients
/// (`TrainerBuilder::bucket_size`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BucketSize {
    /// Buckets of about this many bytes, each all-reduced as soon as its gradients are final,
    /// while the backward pass goes on.
    Bytes(u64),
    /// Every gradient all-reduced when its worker reaches the optimizer step (`off`).
    Off,
}

impl Default for BucketSize {
    fn default() -> Self {
        BucketSize::Bytes(conveyor_engine::runtime::DEFAULT_BUCKET_BYTES as u64)
    }
}

impl BucketSize {
    /// The trainer's setting: `Some(bytes)` for buckets, `None` for `off`.
    pub fn bytes(self) -> Option<usize> {
        match self {
            BucketSize::Bytes(bytes) => Some(usize::try_from(bytes).unwrap_or(usize::MAX)),
            BucketSize::Off => None,
        }
    }
}

impl BucketSize {
    /// When the all-reduce runs, in words (`plan` and `simulate` say it).
    pub fn when(self) -> String {
        match self {
            BucketSize::Bytes(_) => format!("in {self} buckets beside each device's final weight pass"),
            BucketSize::Off => "at each device's optimizer step".to_string(),
        }
    }
}

impl std::fmt::Display for BucketSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            BucketSize::Bytes(bytes) => f.write_str(&exact_size(bytes).unwrap_or_else(|| bytes.to_string())),
            BucketSize::Off => f.write_str("off"),
        }
    }
}

/// `bytes` as a whole number of the largest unit that divides it (`"2GiB"`, `"512MiB"`,
/// `"4KiB"`), or `None` when no unit does: how sizes are written back (`--print-config`).
pub fn exact_size(bytes: u64) -> Option<String> {
    [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)]
        .into_iter()
        .find(|&(_, size)| bytes.is_multiple_of(size))
        .map(|(unit, size)| format!("{}{unit}", bytes / size))
}

impl std::str::FromStr for BucketSize {
    type Err = UsageError;
    fn from_str(text: &str) -> Result<Self, UsageError> {
        if text.trim() == "off" {
            return Ok(BucketSize::Off);
        }
        parse_size(text).map(BucketSize::Bytes).map_err(|_| {
            usage(format!(
                "--bucket-size `{text}`: expected a size of at least one byte such as 25MiB or 4MiB, or off (all-reduce \
                 at the optimizer step)"
            ))
        })
    }
}

/// `--on-nonfinite`: what a step with a non-finite loss or gradient does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnNonFinite {
    /// Stop the run (after writing the outputs from the last good step).
    #[default]
    Error,
    /// Skip the step; stop after this many skipped in a row.
    Skip {
        /// Skipped steps in a row after which the run stops.
        max_in_a_row: u64,
    },
}

impl std::str::FromStr for OnNonFinite {
    type Err = UsageError;
    fn from_str(text: &str) -> Result<Self, UsageError> {
        let bad =
            || usage(format!("--on-nonfinite `{text}`: use error, skip or skip:N with N at least 1 (e.g. skip:5)"));
        match text.split_once(':') {
            None if text == "error" => Ok(OnNonFinite::Error),
            None if text == "skip" => Ok(OnNonFinite::Skip { max_in_a_row: 10 }),
            Some(("skip", n)) => {
                let max_in_a_row = n.trim().parse().ok().filter(|&n: &u64| n > 0).ok_or_else(bad)?;
                Ok(OnNonFinite::Skip { max_in_a_row })
            }
            _ => Err(bad()),
        }
    }
}

/// A learning-rate schedule with torch's semantics: the rate of step `t` (0-based) of `total`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum LrSchedule {
    /// The base rate throughout.
    Constant,
    /// `CosineAnnealingLR(T_max = total, eta_min = 0)`: `base · (1 + cos(π·t / total)) / 2`.
    #[default]
    Cosine,
    /// `StepLR(step_size, gamma)`: `base · gamma^⌊t / step_size⌋`.
    Step {
        /// Steps between decays.
        step_size: u64,
        /// Factor per decay.
        gamma: f64,
    },
}

impl LrSchedule {
    /// The learning rate of step `step_idx` of a run of `total_steps`.
    pub fn lr(&self, base: f64, step_idx: u64, total_steps: u64) -> f64 {
        match *self {
            LrSchedule::Constant => base,
            LrSchedule::Cosine => {
                let t = step_idx.min(total_steps) as f64 / total_steps.max(1) as f64;
                base * (1.0 + (std::f64::consts::PI * t).cos()) / 2.0
            }
            LrSchedule::Step { step_size, gamma } => {
                // Past i32::MAX decays the power is 0 or infinite already; clamped, never wrapped.
                let decays = (step_idx / step_size).min(i32::MAX as u64) as i32;
                base * gamma.powi(decays)
            }
        }
    }
}

impl std::str::FromStr for LrSchedule {
    type Err = UsageError;
    fn from_str(text: &str) -> Result<Self, UsageError> {
        let bad = || usage(format!("--lr-schedule `{text}`: use constant, cosine or step:N,GAMMA (e.g. step:100,0.5)"));
        match text.split_once(':') {
            None if text == "constant" => Ok(LrSchedule::Constant),
            None if text == "cosine" => Ok(LrSchedule::Cosine),
            Some(("step", rest)) => {
                let (n, gamma) = rest.split_once(',').ok_or_else(bad)?;
                let step_size: u64 = n.trim().parse().ok().filter(|&n| n > 0).ok_or_else(bad)?;
                let gamma: f64 =
                    gamma.trim().parse().ok().filter(|g: &f64| g.is_finite() && *g > 0.0).ok_or_else(bad)?;
                Ok(LrSchedule::Step { step_size, gamma })
            }
            _ => Err(bad()),
        }
    }
}

impl std::fmt::Display for LrSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LrSchedule::Constant => f.write_str("constant"),
            LrSchedule::Cosine => f.write_str("cosine"),
            LrSchedule::Step { step_size, gamma } => write!(f, "step:{step_size},{gamma}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_follow_torch() {
        let cosine: LrSchedule = "cosine".parse().unwrap();
        assert_eq!(cosine.lr(0.1, 0, 10), 0.1);
        assert!((cosine.lr(0.1, 5, 10) - 0.05).abs() < 1e-12);
        let step: LrSchedule = "step:3,0.5".parse().unwrap();
        assert_eq!([0, 2, 3, 6].map(|t| step.lr(1.0, t, 10)), [1.0, 1.0, 0.5, 0.25]);
        assert_eq!(step.to_string().parse::<LrSchedule>().unwrap(), step);
        assert!("linear".parse::<LrSchedule>().is_err());
        // A step count past i32::MAX decays does not wrap around to a huge rate.
        let every_step: LrSchedule = "step:1,0.5".parse().unwrap();
        assert_eq!(every_step.lr(1.0, 1 << 33, 1 << 34), 0.0);
    }

    #[test]
    fn device_lists() {
        let devices = parse_devices("cpu:0,cpu:1", None).unwrap();
        assert_eq!(devices.iter().map(ToString::to_string).collect::<Vec<_>>(), ["cpu:0", "cpu:1"]);
        assert_eq!(parse_devices("cpu:3", None).unwrap().len(), 3);
        assert!(parse_devices("cpu:0,cpu:0", None).is_err());
        assert!(parse_devices("tpu:0,cpu:1", None).is_err());
        assert!(parse_devices("cpu:100000", None).unwrap_err().0.contains("over the limit of 1024"));
        assert!(parse_devices("cpu:0", None).unwrap_err().0.contains("at least one device"));
        assert!(parse_devices("cpu:-1", None).unwrap_err().0.contains("not a positive integer"));
        assert_eq!(
            parse_devices("gpu:2", None).unwrap_err().0,
            "--devices `gpu:2`: unknown device kind `gpu`; use cpu:N or cuda:N"
        );
        assert_eq!(parse_devices("cpu:0-2,cuda:0", None).map(|d| d.len()).unwrap_or(4), 4);
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("2KiB").unwrap(), 2048);
        assert!(parse_size("0.1").unwrap_err().0.contains("at least one byte"));
        assert!(parse_size("99999999999999999999GiB").unwrap_err().0.contains("largest size"));
    }
}
