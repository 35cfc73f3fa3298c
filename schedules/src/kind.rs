//! The closed set of schedules this crate generates, and their command-line names.
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::ScheduleError;

/// Which pipeline schedule to generate.
///
/// Names (for [`FromStr`] and [`Display`](fmt::Display)): `gpipe`, `1f1b`, `interleaved`,
/// `zb-h1`, `zb-h2`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ScheduleKind {
    /// GPipe: all forwards, then all (fused) backwards.
    #[serde(rename = "gpipe")]
    GPipe,
    /// 1F1B (PipeDream-Flush): warm-up forwards, then one forward one backward, then cool-down.
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Megatron's interleaved 1F1B over `n_chunks` virtual stages per device.
    #[serde(rename = "interleaved")]
    Interleaved,
    /// Zero Bubble H1: split backward, 1F1B's peak memory (`p`), weight gradients fill the bubbles.
    #[serde(rename = "zb-h1")]
    ZbH1,
    /// Zero Bubble H2: split backward, about twice 1F1B's memory, no idle inside a device's busy span
    /// once `m >= 2p - 1`.
    #[serde(rename = "zb-h2")]
    ZbH2,
}

impl ScheduleKind {
    /// Every kind, in the order of the list above.
    pub const ALL: [ScheduleKind; 5] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbH2,
    ];

    /// The command-line name, e.g. `zb-h1`.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZbH1 => "zb-h1",
            ScheduleKind::ZbH2 => "zb-h2",
        }
    }

    /// Whether the schedule can place several chunks (virtual stages) on one device.
    pub fn supports_chunks(self) -> bool {
        matches!(self, ScheduleKind::Interleaved)
    }

    /// Whether the schedule splits backward into `BackwardInput` and `BackwardWeight`.
    pub fn splits_backward(self) -> bool {
        matches!(self, ScheduleKind::ZbH1 | ScheduleKind::ZbH2)
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScheduleKind {
    type Err = ScheduleError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        ScheduleKind::ALL
            .into_iter()
            .find(|kind| kind.name().eq_ignore_ascii_case(name))
            .ok_or_else(|| ScheduleError::UnknownScheduleKind { name: name.to_owned() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for kind in ScheduleKind::ALL {
            assert_eq!(kind.name().parse::<ScheduleKind>(), Ok(kind));
            assert_eq!(kind.to_string(), kind.name());
        }
        let err = "pipedream".parse::<ScheduleKind>().unwrap_err();
        assert!(err.to_string().contains("expected one of gpipe, 1f1b"), "{err}");
    }
}
