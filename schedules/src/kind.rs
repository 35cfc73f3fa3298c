//! The closed set of schedules this crate generates, and their command-line names.
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::ScheduleError;
use crate::layout::StageLayout;

/// Which pipeline schedule to generate.
///
/// Names (for [`FromStr`] and [`Display`](fmt::Display)): `gpipe`, `1f1b`, `interleaved`,
/// `zb-h1`, `zb-h2`, `zb-v`, `dualpipe-v`, `interleaved-zb`.
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
    /// Zero Bubble V: split backward, two chunks per device placed in a V ([`StageLayout::V`]),
    /// ZB-H1's peak memory (`p` whole-device micro-batches), no bubble inside a device's busy span
    /// to speak of once `m >= 2p`.
    #[serde(rename = "zb-v")]
    ZbV,
    /// DeepSeek's DualPipe folded onto a V (DualPipe-V): two chunks per device in a V, the forward
    /// of one micro-batch paired with the backward of another, split backward at the edges of the
    /// step. Needs `m >= 2p`.
    #[serde(rename = "dualpipe-v")]
    DualPipeV,
    /// Interleaved 1F1B with split backward: Megatron's looped placement of `v` chunks, weight
    /// gradients filling the bubbles, at most `p` whole-device micro-batches per device.
    #[serde(rename = "interleaved-zb")]
    InterleavedZb,
}

impl ScheduleKind {
    /// Every kind, in the order of the list above.
    pub const ALL: [ScheduleKind; 8] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbH2,
        ScheduleKind::ZbV,
        ScheduleKind::DualPipeV,
        ScheduleKind::InterleavedZb,
    ];

    /// The command-line name, e.g. `zb-h1`.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZbH1 => "zb-h1",
            ScheduleKind::ZbH2 => "zb-h2",
            ScheduleKind::ZbV => "zb-v",
            ScheduleKind::DualPipeV => "dualpipe-v",
            ScheduleKind::InterleavedZb => "interleaved-zb",
        }
    }

    /// Every name, comma-separated, for messages: `gpipe, 1f1b, ...`.
    pub fn names() -> String {
        ScheduleKind::ALL.map(ScheduleKind::name).join(", ")
    }

    /// Whether the schedule can place several chunks (virtual stages) on one device.
    pub fn supports_chunks(self) -> bool {
        matches!(
            self,
            ScheduleKind::Interleaved | ScheduleKind::InterleavedZb | ScheduleKind::ZbV | ScheduleKind::DualPipeV
        )
    }

    /// The chunk count the schedule needs, where it allows only one: 2 for the V schedules.
    pub fn required_chunks(self) -> Option<usize> {
        match self.layout() {
            StageLayout::V => Some(2),
            StageLayout::Loop => None,
        }
    }

    /// The chunk count to use when none is given: the required one, 2 for the interleaved
    /// schedules, 1 otherwise.
    pub fn default_chunks(self) -> usize {
        match self {
            ScheduleKind::Interleaved | ScheduleKind::InterleavedZb => 2,
            other => other.required_chunks().unwrap_or(1),
        }
    }

    /// Where the schedule places its stages ([`StageLayout::V`] for ZB-V and DualPipe-V).
    pub fn layout(self) -> StageLayout {
        match self {
            ScheduleKind::ZbV | ScheduleKind::DualPipeV => StageLayout::V,
            _ => StageLayout::Loop,
        }
    }

    /// Whether the schedule splits backward into `BackwardInput` and `BackwardWeight` (DualPipe-V
    /// splits some backwards and fuses the others).
    pub fn splits_backward(self) -> bool {
        matches!(
            self,
            ScheduleKind::ZbH1
                | ScheduleKind::ZbH2
                | ScheduleKind::ZbV
                | ScheduleKind::DualPipeV
                | ScheduleKind::InterleavedZb
        )
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
