//! Automatic placement: a dynamic programme over cut points of the topological order that
//! minimises the slowest stage's time subject to every stage fitting its device's budget.
//!
//! `best[k][j]` is the smallest bottleneck of placing the first `j` nodes on the first `k` devices;
//! `best[k][j] = min over i of max(best[k-1][i], time(stage k-1 = nodes i..j))`, taking only stages
//! that fit. Each stage's time and memory depend only on its own range, its device and its
//! position (the schedule's in-flight count), so the recurrence is exact: the result is optimal
//! for the cost model among contiguous placements, which for a chain are all placements.
use super::cost::{NodeCosts, PlanConfig, plan_from_cuts};
use super::fit::{PlacedBy, automatic_hints, does_not_fit};
use super::{DeviceSpec, Plan};
use crate::graph::Graph;
use crate::{Error, Result};

/// Places `graph` on `devices` (one stage per device, in order), minimising the bottleneck stage
/// time under the memory budgets; [`Error::DoesNotFit`] when no placement fits.
pub fn place_automatically(graph: &Graph, devices: &[DeviceSpec], config: &PlanConfig) -> Result<Plan> {
    place_with_costs(&NodeCosts::of_graph(graph)?, devices, config)
}

/// [`place_automatically`] with given node costs (for example measured ones, see
/// [`super::profile_graph`] and [`NodeCosts::with_measured_times`]).
pub fn place_with_costs(costs: &NodeCosts, devices: &[DeviceSpec], config: &PlanConfig) -> Result<Plan> {
    let n_stages = devices.len();
    let n_nodes = costs.len();
    if n_stages == 0 {
        return Err(Error::invalid("devices", "no devices given; give at least one"));
    }
    if n_nodes < n_stages {
        return Err(Error::invalid(
            "stages",
            format!(
                "{n_stages} stages asked for but the model has only {n_nodes} layers; use at most {n_nodes} devices"
            ),
        ));
    }
    let mut best = vec![vec![f64::INFINITY; n_nodes + 1]; n_stages + 1];
    let mut choice = vec![vec![usize::MAX; n_nodes + 1]; n_stages + 1];
    best[0][0] = 0.0;
    for k in 1..=n_stages {
        // Leave at least one node for each later stage.
        for j in k..=n_nodes - (n_stages - k) {
            for i in (k - 1)..j {
                if !best[k - 1][i].is_finite() {
                    continue;
                }
                let estimate = costs.stage(config, &devices[k - 1], n_stages, k - 1, (i, j), None)?;
                if !estimate.fits(devices[k - 1].budget_bytes) {
                    continue;
                }
                let [f, b, w, _] = estimate.times;
                let candidate = best[k - 1][i].max(f + b + w);
                if candidate < best[k][j] {
                    best[k][j] = candidate;
                    choice[k][j] = i;
                }
            }
        }
    }
    if !best[n_stages][n_nodes].is_finite() {
        return Err(closest_placement(costs, devices, config)?);
    }
    let mut cuts = vec![n_nodes];
    let mut j = n_nodes;
    for k in (1..=n_stages).rev() {
        j = choice[k][j];
        cuts.push(j);
    }
    cuts.reverse();
    plan_from_cuts(costs, config, devices, &cuts)
}

/// The error for a model that fits no placement: the placement whose worst need-to-budget ratio is
/// smallest, its worst stage, every stage's need, and what would help.
fn closest_placement(costs: &NodeCosts, devices: &[DeviceSpec], config: &PlanConfig) -> Result<Error> {
    let n_stages = devices.len();
    let n_nodes = costs.len();
    let ratio = |need: u64, device: &DeviceSpec| device.budget_bytes.map_or(0.0, |b| need as f64 / b.max(1) as f64);
    let mut best = vec![vec![f64::INFINITY; n_nodes + 1]; n_stages + 1];
    let mut choice = vec![vec![0; n_nodes + 1]; n_stages + 1];
    best[0][0] = 0.0;
    for k in 1..=n_stages {
        for j in k..=n_nodes - (n_stages - k) {
            for i in (k - 1)..j {
                let estimate = costs.stage(config, &devices[k - 1], n_stages, k - 1, (i, j), None)?;
                let candidate = best[k - 1][i].max(ratio(estimate.largest_total(), &devices[k - 1]));
                if candidate < best[k][j] {
                    best[k][j] = candidate;
                    choice[k][j] = i;
                }
            }
        }
    }
    let mut cuts = vec![n_nodes];
    let mut j = n_nodes;
    for k in (1..=n_stages).rev() {
        j = choice[k][j];
        cuts.push(j);
    }
    cuts.reverse();
    let plan = plan_from_cuts(costs, config, devices, &cuts)?;
    // The stage with the largest need against its budget (a stage without a budget always fits).
    let worst = (0..plan.stages.len())
        .filter(|&s| devices[s].budget_bytes.is_some())
        .max_by(|&a, &b| {
            let of = |s: usize| ratio(plan.stages[s].largest_total(), &devices[s]);
            of(a).total_cmp(&of(b))
        })
        .unwrap_or(0);
    Ok(does_not_fit(&plan, worst, PlacedBy::Automatic, automatic_hints(costs, devices, config)))
}
