//! What a placement that does not fit reports, as data: the bytes the failing stage needs by kind
//! ([`MemoryBreakdown`]), every stage's need against its budget ([`StageFit`]), and what would
//! help ([`FitHint`]); the fields of [`Error::DoesNotFit`], whose message [`DoesNotFitMessage`]
//! renders. The errors themselves are built here too, from a [`Plan`], for `auto.rs` and
//! `manual.rs`.
use std::fmt;

use super::cost::{NodeCosts, PlanConfig, StageMemory, format_bytes};
use super::{DeviceSpec, Plan};
use crate::Error;

/// Bytes one device of a stage holds at its busiest moment, by kind: the memory plan's figures
/// ([`StageMemory`]) under the names a reader looks for. [`MemoryBreakdown::total`] is the need
/// the budget is checked against.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryBreakdown {
    /// Parameters.
    pub parameters: u64,
    /// Gradients (the size of the parameters).
    pub gradients: u64,
    /// Optimizer state (0, 1 or 2 times the parameters: SGD, momentum, Adam).
    pub optimizer_state: u64,
    /// Activations kept for the backward at the busiest moment (saved tensors, kept inputs,
    /// output gradients awaiting the weight pass).
    pub activations: u64,
    /// Copies layers derive from their parameters and keep (Linear's packed weights); optional:
    /// the plan drops them where they do not fit, and this counts only those kept.
    pub caches: u64,
    /// Messages moved onto the device and data not yet consumed, at the busiest moment.
    pub messages: u64,
    /// The commit's undo snapshot (a copy of parameters and optimizer state); 0 when dropped.
    pub undo_snapshot: u64,
    /// The running op's working set at its peak.
    pub scratch: u64,
}

impl MemoryBreakdown {
    /// Everything together: the device's need.
    pub fn total(&self) -> u64 {
        self.parameters
            + self.gradients
            + self.optimizer_state
            + self.activations
            + self.caches
            + self.messages
            + self.undo_snapshot
            + self.scratch
    }
}

impl From<&StageMemory> for MemoryBreakdown {
    fn from(memory: &StageMemory) -> Self {
        MemoryBreakdown {
            parameters: memory.params,
            gradients: memory.grads,
            optimizer_state: memory.optimizer_state,
            activations: memory.activations,
            caches: memory.workspace,
            messages: memory.messages,
            undo_snapshot: memory.commit_snapshot,
            scratch: memory.scratch,
        }
    }
}

/// One stage of the placement a [`Error::DoesNotFit`] reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageFit {
    /// The device (or tensor-parallel group) the stage was placed on.
    pub device: String,
    /// The largest need among the stage's devices, bytes.
    pub needed_bytes: u64,
    /// The device's budget, bytes (`None`: unlimited).
    pub budget_bytes: Option<u64>,
}

/// How the placement a [`Error::DoesNotFit`] reports was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlacedBy {
    /// The planner searched every placement ([`super::place_automatically`]); the one reported is
    /// the one whose worst stage is smallest against its budget.
    Automatic,
    /// The user gave the stages ([`super::place_manually`]).
    Manual,
}

/// Something that would make a model fit, in the order the message gives them.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FitHint {
    /// One layer alone needs more than the smallest budget for its parameters, gradients and
    /// optimizer state: only splitting it (tensor parallelism) helps.
    SplitLayer {
        /// The layer.
        layer: String,
        /// What it needs for parameters, gradients and optimizer state, bytes.
        bytes: u64,
    },
    /// More stages, on more devices.
    MoreStages,
    /// Larger memory budgets.
    LargerBudgets,
    /// Activation recomputation (keep only each stage's inputs between forward and backward).
    Recompute,
    /// Smaller micro-batches (more of them, or a smaller batch).
    SmallerMicroBatches,
    /// An optimizer with less state (plain SGD keeps none).
    LighterOptimizer,
    /// Move layers from the stage that does not fit to another.
    MoveLayers,
    /// Let the planner choose the stages.
    AutomaticPlacement,
}

impl FitHint {
    /// The hint as the message words it.
    fn phrase(&self, placed_by: PlacedBy) -> String {
        match (self, placed_by) {
            (FitHint::SplitLayer { bytes, .. }, _) => format!(
                "one layer alone needs {} for parameters, gradients and optimizer state: split it with tensor parallelism",
                format_bytes(*bytes)
            ),
            (FitHint::MoreStages, _) => "more stages (devices)".into(),
            (FitHint::LargerBudgets, _) => "larger budgets".into(),
            (FitHint::Recompute, PlacedBy::Automatic) => "activation recomputation".into(),
            (FitHint::Recompute, PlacedBy::Manual) => "recomputation".into(),
            (FitHint::SmallerMicroBatches, _) => "smaller micro-batches".into(),
            (FitHint::LighterOptimizer, _) => "an optimizer with less state (plain SGD)".into(),
            (FitHint::MoveLayers, _) => "move layers to another stage".into(),
            (FitHint::AutomaticPlacement, _) => "use automatic placement".into(),
        }
    }
}

/// The message of [`Error::DoesNotFit`], from its fields.
pub(crate) struct DoesNotFitMessage<'a> {
    /// How the placement was chosen.
    pub placed_by: PlacedBy,
    /// The stage that does not fit.
    pub stage: usize,
    /// Every stage's need and budget.
    pub stages: &'a [StageFit],
    /// What would help.
    pub hints: &'a [FitHint],
}

impl fmt::Display for DoesNotFitMessage<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bytes = |b: Option<u64>| b.map_or("unlimited".to_string(), format_bytes);
        let list = |items: Vec<String>| format!("[{}]", items.join(", "));
        let (need, budgets) = match self.placed_by {
            PlacedBy::Automatic => (
                list(self.stages.iter().map(|s| format_bytes(s.needed_bytes)).collect()),
                list(self.stages.iter().map(|s| bytes(s.budget_bytes)).collect()),
            ),
            PlacedBy::Manual => {
                let failing = self.stages.get(self.stage);
                (
                    failing.map_or_else(String::new, |s| {
                        format!("{} on stage {} ({})", format_bytes(s.needed_bytes), self.stage, s.device)
                    }),
                    bytes(failing.and_then(|s| s.budget_bytes)),
                )
            }
        };
        write!(
            f,
            "the model does not fit: on {} stage(s) the best placement needs {need} on its largest stage against \
             budgets {budgets}; what would help: ",
            self.stages.len()
        )?;
        // The tensor-parallel hint stands before the rest; the rest is one list.
        let (split, rest): (Vec<&FitHint>, Vec<&FitHint>) =
            self.hints.iter().partition(|h| matches!(h, FitHint::SplitLayer { .. }));
        for hint in split {
            write!(f, "{}; ", hint.phrase(self.placed_by))?;
        }
        let phrases: Vec<String> = rest.iter().map(|h| h.phrase(self.placed_by)).collect();
        match (self.placed_by, phrases.split_last()) {
            (_, None) => Ok(()),
            (_, Some((last, []))) => f.write_str(last),
            // "a, b, c or d"
            (PlacedBy::Manual, Some((last, first))) => write!(f, "{} or {last}", first.join(", ")),
            // "a, b, c, d", with ", or" before the lighter optimizer.
            (PlacedBy::Automatic, Some((last, first))) => {
                let or = if matches!(rest.last(), Some(FitHint::LighterOptimizer)) { "or " } else { "" };
                write!(f, "{}, {or}{last}", first.join(", "))
            }
        }
    }
}

/// The error for `plan`'s stage `stage_idx`, over its budget: its figures on its device with the
/// largest need, every stage's need against its budget, and `hints`.
pub(crate) fn does_not_fit(plan: &Plan, stage_idx: usize, placed_by: PlacedBy, hints: Vec<FitHint>) -> Error {
    let stage = &plan.stages[stage_idx];
    let largest = stage.device_memory().max_by_key(|m| m.total()).copied().unwrap_or_default();
    let stages = plan
        .stages
        .iter()
        .map(|s| StageFit {
            device: plan.devices[s.device_idx].name.clone(),
            needed_bytes: s.largest_total(),
            budget_bytes: plan.devices[s.device_idx].budget_bytes,
        })
        .collect::<Vec<_>>();
    Error::DoesNotFit {
        n_stages: plan.stages.len(),
        stage: stage_idx,
        device: stages[stage_idx].device.clone(),
        needed_bytes: largest.total(),
        budget_bytes: stages[stage_idx].budget_bytes.unwrap_or(u64::MAX),
        breakdown: Box::new(MemoryBreakdown::from(&largest)),
        stages,
        hints,
        placed_by,
    }
}

/// What would help an automatically placed model fit on `devices`: splitting its largest layer
/// when that alone is over the smallest budget, then more stages, larger budgets, recomputation,
/// smaller micro-batches and, with optimizer state, a lighter optimizer.
pub(crate) fn automatic_hints(costs: &NodeCosts, devices: &[DeviceSpec], config: &PlanConfig) -> Vec<FitHint> {
    let per_param = 2 + config.optimizer.state_factor();
    let smallest_budget = devices.iter().filter_map(|d| d.budget_bytes).min().unwrap_or(u64::MAX);
    let mut hints = Vec::new();
    // The first of the largest layers (`max_by_key` keeps the last of equals: walk backwards).
    let largest = (0..costs.len()).rev().map(|n| (costs.param_bytes(n, n + 1), n)).max_by_key(|&(bytes, _)| bytes);
    if let Some((bytes, n)) = largest
        && bytes * per_param > smallest_budget
    {
        hints.push(FitHint::SplitLayer { layer: costs.names[n].clone(), bytes: bytes * per_param });
    }
    hints.extend([FitHint::MoreStages, FitHint::LargerBudgets, FitHint::Recompute, FitHint::SmallerMicroBatches]);
    if config.optimizer.state_factor() > 0 {
        hints.push(FitHint::LighterOptimizer);
    }
    hints
}

/// What would help a manually placed stage fit.
pub(crate) fn manual_hints() -> Vec<FitHint> {
    vec![FitHint::MoveLayers, FitHint::AutomaticPlacement, FitHint::Recompute, FitHint::SmallerMicroBatches]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(need: u64, budget: Option<u64>) -> StageFit {
        StageFit { device: "cpu:0".into(), needed_bytes: need, budget_bytes: budget }
    }

    #[test]
    fn automatic_message_lists_every_stage_and_the_hints_as_before() {
        let stages = [stage(3 << 20, Some(2 << 20)), stage(1 << 10, None)];
        let hints = [
            FitHint::SplitLayer { layer: "l0".into(), bytes: 5 << 20 },
            FitHint::MoreStages,
            FitHint::LargerBudgets,
            FitHint::Recompute,
            FitHint::SmallerMicroBatches,
            FitHint::LighterOptimizer,
        ];
        let message = DoesNotFitMessage { placed_by: PlacedBy::Automatic, stage: 0, stages: &stages, hints: &hints };
        assert_eq!(
            message.to_string(),
            "the model does not fit: on 2 stage(s) the best placement needs [3.0 MiB, 1.0 KiB] on its largest stage \
             against budgets [2.0 MiB, unlimited]; what would help: one layer alone needs 5.0 MiB for parameters, \
             gradients and optimizer state: split it with tensor parallelism; more stages (devices), larger budgets, \
             activation recomputation, smaller micro-batches, or an optimizer with less state (plain SGD)"
        );
        let message = DoesNotFitMessage { hints: &hints[1..5], ..message };
        assert!(
            message.to_string().ends_with(
                "help: more stages (devices), larger budgets, activation recomputation, smaller micro-batches"
            )
        );
    }

    #[test]
    fn breakdown_total_is_the_stage_memory_total() {
        let memory = StageMemory {
            params: 1,
            workspace: 2,
            grads: 4,
            optimizer_state: 8,
            commit_snapshot: 16,
            activations: 32,
            messages: 64,
            scratch: 128,
            workspace_dropped: 256,
            commit_snapshot_dropped: 512,
        };
        assert_eq!(MemoryBreakdown::from(&memory).total(), memory.total());
    }
}
