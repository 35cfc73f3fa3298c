//! One step of a device's program, and the single rule that derives its communication.
//!
//! # The communication rule
//!
//! Programs list compute only; every send and receive follows from one rule, which the
//! validator and the simulators take from [`Instruction::recv_from`] and
//! [`Instruction::send_to`]. The engine's runtime applies the same rule to the routes its graph's
//! edges give (a chain's routes are exactly these neighbours; a skip edge adds a channel the
//! rule orders the same way):
//!
//! - `Forward { m, s }` with `s > 0` first **receives** micro-batch `m`'s activation from stage
//!   `s - 1`; after computing it **sends** its activation to stage `s + 1` if that stage exists.
//! - `BackwardInput { m, s }` and the fused `Backward { m, s }` with `s < n_stages - 1` first
//!   **receive** the gradient of stage `s`'s output from stage `s + 1`; after computing they
//!   **send** the gradient of stage `s`'s input to stage `s - 1` if `s > 0`.
//! - `BackwardWeight` and `OptimizerStep` never communicate.
//!
//! Each (from stage, to stage, direction) is one FIFO channel; a stage walks micro-batches in
//! the order its neighbour sent them, which the validator checks.
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::timeline::OpKind;

/// One compute step of one device's program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Instruction {
    /// Forward pass of `micro_batch_idx` through stage `stage_idx`.
    Forward {
        /// The micro-batch.
        micro_batch_idx: usize,
        /// The (virtual) stage.
        stage_idx: usize,
    },
    /// Gradient with respect to the stage's input (Zero Bubble's `B`); keeps the activations the
    /// weight gradient needs.
    BackwardInput {
        /// The micro-batch.
        micro_batch_idx: usize,
        /// The (virtual) stage.
        stage_idx: usize,
    },
    /// Gradient with respect to the stage's weights (Zero Bubble's `W`); frees the micro-batch's
    /// activations. Always after the matching `BackwardInput` on the same device.
    BackwardWeight {
        /// The micro-batch.
        micro_batch_idx: usize,
        /// The (virtual) stage.
        stage_idx: usize,
    },
    /// Input and weight gradients together; frees the micro-batch's activations.
    Backward {
        /// The micro-batch.
        micro_batch_idx: usize,
        /// The (virtual) stage.
        stage_idx: usize,
    },
    /// Apply the accumulated gradients of every stage on the device; last on every device.
    OptimizerStep,
}

impl Instruction {
    /// The stage this instruction computes, `None` for [`Instruction::OptimizerStep`].
    pub fn stage_idx(&self) -> Option<usize> {
        match *self {
            Instruction::Forward { stage_idx, .. }
            | Instruction::BackwardInput { stage_idx, .. }
            | Instruction::BackwardWeight { stage_idx, .. }
            | Instruction::Backward { stage_idx, .. } => Some(stage_idx),
            Instruction::OptimizerStep => None,
        }
    }

    /// The micro-batch this instruction computes, `None` for [`Instruction::OptimizerStep`].
    pub fn micro_batch_idx(&self) -> Option<usize> {
        match *self {
            Instruction::Forward { micro_batch_idx, .. }
            | Instruction::BackwardInput { micro_batch_idx, .. }
            | Instruction::BackwardWeight { micro_batch_idx, .. }
            | Instruction::Backward { micro_batch_idx, .. } => Some(micro_batch_idx),
            Instruction::OptimizerStep => None,
        }
    }

    /// The timeline op kind this instruction records as.
    pub fn op_kind(&self) -> OpKind {
        match self {
            Instruction::Forward { .. } => OpKind::Forward,
            Instruction::BackwardInput { .. } => OpKind::BackwardInput,
            Instruction::BackwardWeight { .. } => OpKind::BackwardWeight,
            Instruction::Backward { .. } => OpKind::Backward,
            Instruction::OptimizerStep => OpKind::OptimizerStep,
        }
    }

    /// Whether this instruction produces the input gradient (`BackwardInput` or fused `Backward`).
    pub fn is_backward_input(&self) -> bool {
        matches!(self, Instruction::BackwardInput { .. } | Instruction::Backward { .. })
    }

    /// Whether this instruction is the last backward part of its (micro-batch, stage), after which
    /// the stage frees that micro-batch's activations (`BackwardWeight` or fused `Backward`).
    pub fn releases_activations(&self) -> bool {
        matches!(self, Instruction::BackwardWeight { .. } | Instruction::Backward { .. })
    }

    /// The message this instruction must receive before computing, by the module's rule.
    pub fn recv_from(&self, n_stages: usize) -> Option<Message> {
        match *self {
            Instruction::Forward { micro_batch_idx, stage_idx } if stage_idx > 0 => Some(Message {
                micro_batch_idx,
                from_stage_idx: stage_idx - 1,
                to_stage_idx: stage_idx,
                direction: Direction::Activation,
            }),
            Instruction::BackwardInput { micro_batch_idx, stage_idx }
            | Instruction::Backward { micro_batch_idx, stage_idx }
                if stage_idx + 1 < n_stages =>
            {
                Some(Message {
                    micro_batch_idx,
                    from_stage_idx: stage_idx + 1,
                    to_stage_idx: stage_idx,
                    direction: Direction::Gradient,
                })
            }
            _ => None,
        }
    }

    /// The message this instruction sends after computing, by the module's rule.
    pub fn send_to(&self, n_stages: usize) -> Option<Message> {
        match *self {
            Instruction::Forward { micro_batch_idx, stage_idx } if stage_idx + 1 < n_stages => Some(Message {
                micro_batch_idx,
                from_stage_idx: stage_idx,
                to_stage_idx: stage_idx + 1,
                direction: Direction::Activation,
            }),
            Instruction::BackwardInput { micro_batch_idx, stage_idx }
            | Instruction::Backward { micro_batch_idx, stage_idx }
                if stage_idx > 0 =>
            {
                Some(Message {
                    micro_batch_idx,
                    from_stage_idx: stage_idx,
                    to_stage_idx: stage_idx - 1,
                    direction: Direction::Gradient,
                })
            }
            _ => None,
        }
    }
}

impl fmt::Display for Instruction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, micro_batch_idx, stage_idx) = match *self {
            Instruction::Forward { micro_batch_idx, stage_idx } => ("forward", micro_batch_idx, stage_idx),
            Instruction::BackwardInput { micro_batch_idx, stage_idx } => ("backward-input", micro_batch_idx, stage_idx),
            Instruction::BackwardWeight { micro_batch_idx, stage_idx } => {
                ("backward-weight", micro_batch_idx, stage_idx)
            }
            Instruction::Backward { micro_batch_idx, stage_idx } => ("backward", micro_batch_idx, stage_idx),
            Instruction::OptimizerStep => return f.write_str("optimizer step"),
        };
        write!(f, "{name} of micro-batch {micro_batch_idx} on stage {stage_idx}")
    }
}

/// Which way a message travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// A forward activation, from stage `s` to stage `s + 1`.
    Activation,
    /// A backward gradient, from stage `s` to stage `s - 1`.
    Gradient,
}

/// One message between adjacent stages, implied by an instruction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Message {
    /// The micro-batch the message carries.
    pub micro_batch_idx: usize,
    /// Sending stage.
    pub from_stage_idx: usize,
    /// Receiving stage.
    pub to_stage_idx: usize,
    /// Activation (forward) or gradient (backward).
    pub direction: Direction,
}

impl Message {
    /// The FIFO channel this message travels on.
    pub fn channel(&self) -> ChannelId {
        ChannelId { from_stage_idx: self.from_stage_idx, to_stage_idx: self.to_stage_idx, direction: self.direction }
    }
}

impl fmt::Display for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.direction {
            Direction::Activation => "activation",
            Direction::Gradient => "gradient",
        };
        write!(
            f,
            "the {what} of micro-batch {} from stage {} to stage {}",
            self.micro_batch_idx, self.from_stage_idx, self.to_stage_idx
        )
    }
}

/// One FIFO channel: all messages from one stage to another in one direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ChannelId {
    /// Sending stage.
    pub from_stage_idx: usize,
    /// Receiving stage.
    pub to_stage_idx: usize,
    /// Activation (forward) or gradient (backward).
    pub direction: Direction,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn communication_rule() {
        let n_stages = 3;
        let first = Instruction::Forward { micro_batch_idx: 1, stage_idx: 0 };
        assert_eq!(first.recv_from(n_stages), None);
        assert_eq!(first.send_to(n_stages).map(|m| m.to_stage_idx), Some(1));
        let last = Instruction::Forward { micro_batch_idx: 1, stage_idx: 2 };
        assert_eq!(last.recv_from(n_stages).map(|m| m.from_stage_idx), Some(1));
        assert_eq!(last.send_to(n_stages), None);
        let b_last = Instruction::BackwardInput { micro_batch_idx: 0, stage_idx: 2 };
        assert_eq!(b_last.recv_from(n_stages), None);
        assert_eq!(
            b_last.send_to(n_stages),
            Some(Message { micro_batch_idx: 0, from_stage_idx: 2, to_stage_idx: 1, direction: Direction::Gradient })
        );
        let b_first = Instruction::Backward { micro_batch_idx: 0, stage_idx: 0 };
        assert_eq!(b_first.recv_from(n_stages).map(|m| m.from_stage_idx), Some(1));
        assert_eq!(b_first.send_to(n_stages), None);
        let w = Instruction::BackwardWeight { micro_batch_idx: 0, stage_idx: 1 };
        assert_eq!((w.recv_from(n_stages), w.send_to(n_stages)), (None, None));
        assert_eq!(Instruction::OptimizerStep.send_to(n_stages), None);
    }
}
