//! `--schedule auto`: the schedule, the micro-batch count, the recompute mode and the stage split
//! chosen jointly, to minimise the predicted step time under the devices' memory budgets.
//!
//! Every candidate (each schedule kind, with its chunks; micro-batch counts `p`, `2p`, `4p` and the
//! one asked for, up to the batch's rows; each recompute mode) is planned as `conveyor plan` plans
//! it: the dynamic programme cuts the layers into stages under the budgets, from measured layer
//! times ([`PlaceBy::Time`]) or FLOP estimates. Its step is then predicted by the schedule
//! simulator with the plan's per-stage `F`, `B`, `W`, each recomputed micro-batch's input-gradient
//! op costing one more forward of its stage. The choice is the fastest candidate that fits; ties
//! go to the smaller peak memory, then to the earlier candidate. Candidates that do not fit stay
//! in the list with the reason, so `plan --explain` can show what was refused.
//!
//! Rejected alternative: choosing the schedule by a closed-form bubble formula. The formulas
//! assume equal stage costs and `F = B = W`; the simulator with the plan's own stage times sees
//! the imbalance the cut leaves, the cost of recomputation, and the V's half-size stages.
use std::collections::HashMap;

use conveyor_schedules::{CostModel, Instruction, OpKind, Schedule, ScheduleKind, StageCosts, simulate};

use super::pipeline_plan::{CPU_FLOPS_PER_S, PipelineConfig, PlaceBy, node_costs_at, planner_inputs_for};
use super::{NodeCosts, Plan, place_with_costs, profile_graph};
use crate::graph::Graph;
use crate::runtime::Recompute;
use crate::{Device, Error, Result};

/// How often each pass of each layer is timed when the choice uses measured times.
const PROFILE_REPEATS: usize = 3;

/// Every recompute mode, cheapest in time first.
const RECOMPUTE_MODES: [Recompute; 3] = [Recompute::Never, Recompute::ExceptLast, Recompute::Always];

/// One configuration the automatic choice weighed.
#[derive(Clone, Debug)]
pub struct ScheduleCandidate {
    /// The schedule.
    pub schedule: ScheduleKind,
    /// Chunks per device.
    pub n_chunks: usize,
    /// Micro-batches per batch.
    pub n_micro_batches: usize,
    /// Activation recomputation.
    pub recompute: Recompute,
    /// The plan and its predictions, or why the candidate was refused (it does not fit, or the
    /// model has too few layers for its stages).
    pub outcome: std::result::Result<PlannedCandidate, String>,
}

/// A candidate that fits: its plan and what the simulator predicts for it.
#[derive(Clone, Debug)]
pub struct PlannedCandidate {
    /// The stage split under the budgets.
    pub plan: Plan,
    /// Predicted step time, seconds (the simulated makespan).
    pub step_s: f64,
    /// Predicted bubble fraction.
    pub bubble_fraction: f64,
    /// The plan's peak memory on its busiest device, bytes.
    pub peak_bytes: u64,
}

impl ScheduleCandidate {
    /// `zb-v x2, m=8, recompute never`.
    pub fn label(&self) -> String {
        let chunks = if self.n_chunks > 1 { format!(" x{}", self.n_chunks) } else { String::new() };
        let recompute = match self.recompute {
            Recompute::Never => "never",
            Recompute::ExceptLast => "except-last",
            Recompute::Always => "always",
        };
        format!("{}{chunks}, m={}, recompute {recompute}", self.schedule, self.n_micro_batches)
    }

    /// The planned figures, `None` when refused.
    pub fn planned(&self) -> Option<&PlannedCandidate> {
        self.outcome.as_ref().ok()
    }

    /// `base` with this candidate's schedule, chunks, micro-batches and recompute mode.
    pub fn config(&self, base: &PipelineConfig) -> PipelineConfig {
        PipelineConfig {
            schedule: self.schedule,
            n_chunks: self.n_chunks,
            n_micro_batches: self.n_micro_batches,
            recompute: self.recompute,
            ..base.clone()
        }
    }
}

/// What the automatic choice weighed and what it chose.
#[derive(Clone, Debug)]
pub struct ScheduleChoice {
    /// Every candidate, in the order weighed (schedule kinds in [`ScheduleKind::ALL`] order).
    pub candidates: Vec<ScheduleCandidate>,
    /// Index of the chosen candidate.
    pub chosen: usize,
}

impl ScheduleChoice {
    /// The chosen candidate.
    pub fn chosen(&self) -> &ScheduleCandidate {
        &self.candidates[self.chosen]
    }

    /// The chosen plan.
    pub fn plan(&self) -> &Plan {
        &self.chosen().planned().expect("the chosen candidate fits").plan
    }

    /// Indices of the candidates on the Pareto front of (predicted step time, peak memory): those
    /// that fit and that no other candidate beats on one figure without losing on the other;
    /// fastest first.
    pub fn pareto_front(&self) -> Vec<usize> {
        let fitting: Vec<(usize, &PlannedCandidate)> =
            self.candidates.iter().enumerate().filter_map(|(i, c)| Some((i, c.planned()?))).collect();
        let mut front: Vec<usize> = fitting
            .iter()
            .filter(|(_, a)| {
                !fitting.iter().any(|(_, b)| {
                    b.step_s <= a.step_s
                        && b.peak_bytes <= a.peak_bytes
                        && (b.step_s < a.step_s || b.peak_bytes < a.peak_bytes)
                })
            })
            .map(|&(i, _)| i)
            .collect();
        front.sort_by(|&a, &b| {
            let (a, b) = (self.candidates[a].planned().unwrap(), self.candidates[b].planned().unwrap());
            a.step_s.total_cmp(&b.step_s).then(a.peak_bytes.cmp(&b.peak_bytes))
        });
        front.dedup_by(|a, b| {
            let (a, b) = (self.candidates[*a].planned().unwrap(), self.candidates[*b].planned().unwrap());
            a.step_s == b.step_s && a.peak_bytes == b.peak_bytes
        });
        front
    }

    /// Why the chosen candidate won, in one sentence.
    pub fn why(&self) -> String {
        let planned = self.chosen().planned().expect("the chosen candidate fits");
        let n_fit = self.candidates.iter().filter(|c| c.planned().is_some()).count();
        let mut why = format!(
            "the shortest predicted step ({}) of the {n_fit} candidates that fit the budgets ({} weighed)",
            super::format_seconds(planned.step_s),
            self.candidates.len()
        );
        let runner_up = self
            .candidates
            .iter()
            .filter(|c| c.schedule != self.chosen().schedule)
            .filter_map(|c| Some((c, c.planned()?)))
            .min_by(|a, b| a.1.step_s.total_cmp(&b.1.step_s));
        if let Some((other, figures)) = runner_up {
            if figures.step_s > planned.step_s {
                why.push_str(&format!(
                    "; the best other schedule, {}, is predicted {:.1}% slower",
                    other.label(),
                    100.0 * (figures.step_s / planned.step_s - 1.0)
                ));
            } else {
                why.push_str(&format!(
                    "; {} ties on step time and {}",
                    other.label(),
                    if figures.peak_bytes > planned.peak_bytes {
                        "holds more memory"
                    } else {
                        "comes later in the list (equal memory)"
                    }
                ));
            }
        }
        why
    }
}

/// Chooses the schedule, micro-batch count, recompute mode and stage split for `graph` on
/// `devices` that minimise the predicted step time under the budgets. `base` gives the batch
/// rows, optimizer and micro-batch count asked for (one of the counts tried); `by` whether stage
/// times come from measured layer times or FLOP estimates. [`Error::DoesNotFit`] (of the base
/// configuration) when no candidate fits.
pub fn choose_schedule(
    graph: &Graph,
    devices: &[Device],
    base: &PipelineConfig,
    by: PlaceBy,
) -> Result<ScheduleChoice> {
    let n_devices = devices.len().max(1);
    let mut micro_batch_counts: Vec<usize> = [n_devices, 2 * n_devices, 4 * n_devices, base.n_micro_batches]
        .into_iter()
        .filter(|&m| (1..=base.batch_rows.max(1)).contains(&m))
        .collect();
    micro_batch_counts.sort_unstable();
    micro_batch_counts.dedup();
    // Node costs per micro-batch size (measured once per size).
    let mut costs_by_rows: HashMap<usize, NodeCosts> = HashMap::new();
    let mut candidates = Vec::new();
    for schedule in ScheduleKind::ALL {
        let n_chunks = schedule.required_chunks().unwrap_or(if schedule.supports_chunks() { 2 } else { 1 });
        for &n_micro_batches in &micro_batch_counts {
            if Schedule::new(schedule, n_devices, n_micro_batches, n_chunks).is_err() {
                continue; // an undefined shape (interleaved's groups, DualPipe-V's 2p), not a candidate
            }
            for recompute in RECOMPUTE_MODES {
                let mut candidate =
                    ScheduleCandidate { schedule, n_chunks, n_micro_batches, recompute, outcome: Err(String::new()) };
                let config = candidate.config(base);
                candidate.outcome = match plan_candidate(graph, devices, &config, by, &mut costs_by_rows) {
                    Ok(planned) => Ok(planned),
                    Err(Error::DoesNotFit { .. }) => Err("does not fit the memory budgets".to_string()),
                    Err(Error::InvalidArgument { reason, .. }) => Err(reason),
                    Err(other) => return Err(other),
                };
                candidates.push(candidate);
            }
        }
    }
    let chosen = candidates
        .iter()
        .enumerate()
        .filter_map(|(i, c)| Some((i, c.planned()?)))
        .min_by(|(i, a), (j, b)| a.step_s.total_cmp(&b.step_s).then(a.peak_bytes.cmp(&b.peak_bytes)).then(i.cmp(j)))
        .map(|(i, _)| i);
    match chosen {
        Some(chosen) => Ok(ScheduleChoice { candidates, chosen }),
        // Nothing fits: the base configuration's own error says by how much.
        None => Err(super::pipeline_plan::plan(graph, devices, base).err().unwrap_or_else(|| {
            Error::invalid("schedule", "no schedule, micro-batch count and recompute mode fits; see `plan --explain`")
        })),
    }
}

fn plan_candidate(
    graph: &Graph,
    devices: &[Device],
    config: &PipelineConfig,
    by: PlaceBy,
    costs_by_rows: &mut HashMap<usize, NodeCosts>,
) -> Result<PlannedCandidate> {
    let (specs, plan_config) = planner_inputs_for(devices, config)?;
    let rows = plan_config.micro_batch_rows;
    let costs = match costs_by_rows.entry(rows) {
        std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
        std::collections::hash_map::Entry::Vacant(entry) => {
            let costs = node_costs_at(graph, rows, config.precision)?;
            entry.insert(match by {
                PlaceBy::Memory => costs,
                PlaceBy::Time => {
                    costs.with_measured_times(&profile_graph(graph, rows, PROFILE_REPEATS)?, CPU_FLOPS_PER_S)?
                }
            })
        }
    };
    let plan = place_with_costs(costs, &specs, &plan_config)?;
    let schedule = Schedule::new(config.schedule, devices.len(), config.n_micro_batches, config.n_chunks)?;
    let report = simulate(&schedule, &predicted_costs(&plan, &schedule, config.recompute))?;
    let peak_bytes = plan.device_peaks(devices.len()).iter().flatten().copied().max().unwrap_or(0);
    Ok(PlannedCandidate { step_s: report.makespan_s, bubble_fraction: report.bubble_fraction, peak_bytes, plan })
}

/// The simulator's costs for `plan` under `schedule`: each stage's predicted `F`, `B`, `W` (the
/// planner folds incoming transfers into `F` and `B`, so the link stays free), and for each
/// micro-batch `recompute` recomputes, its input-gradient op (`B` or fused) one forward longer.
pub fn predicted_costs(plan: &Plan, schedule: &Schedule, recompute: Recompute) -> CostModel {
    let stage_costs: Vec<StageCosts> =
        plan.stages.iter().map(|s| StageCosts::new(s.forward_s, s.backward_input_s, s.backward_weight_s)).collect();
    let n_micro_batches = schedule.n_micro_batches();
    let recomputes = |micro_batch_idx: usize| match recompute {
        Recompute::Never => false,
        Recompute::Always => true,
        Recompute::ExceptLast => micro_batch_idx + 1 < n_micro_batches,
    };
    let mut op_costs = Vec::new();
    for instruction in schedule.programs().iter().flatten() {
        let (micro_batch_idx, stage_idx, op, base) = match *instruction {
            Instruction::BackwardInput { micro_batch_idx, stage_idx } => {
                (micro_batch_idx, stage_idx, OpKind::BackwardInput, stage_costs[stage_idx].backward_input_s)
            }
            Instruction::Backward { micro_batch_idx, stage_idx } => {
                (micro_batch_idx, stage_idx, OpKind::Backward, stage_costs[stage_idx].backward_s())
            }
            _ => continue,
        };
        if recomputes(micro_batch_idx) {
            op_costs.push(((stage_idx, op, micro_batch_idx), base + stage_costs[stage_idx].forward_s));
        }
    }
    CostModel::per_stage(stage_costs).with_op_costs(op_costs)
}
