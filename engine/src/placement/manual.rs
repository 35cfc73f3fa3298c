//! Manual placement: the user names the nodes of each stage (or ranges `first..last` of the
//! topological order); we check the placement respects the graph order and report its costs.
use super::cost::{NodeCosts, PlanConfig, plan_from_cuts};
use super::fit::{PlacedBy, does_not_fit, manual_hints};
use super::{DeviceSpec, Plan};
use crate::graph::Graph;
use crate::{Error, Result};

/// Places the nodes named in `stages[k]` on stage k (device k). An entry `a..b` names every layer
/// node from `a` to `b` inclusive in topological order. Every layer node must be named exactly
/// once, and no stage may consume from a later stage. Stages over budget are refused with
/// [`Error::DoesNotFit`].
pub fn place_manually(
    graph: &Graph,
    stages: &[Vec<String>],
    devices: &[DeviceSpec],
    config: &PlanConfig,
) -> Result<Plan> {
    place_manually_with_costs(graph, &NodeCosts::of_graph(graph)?, stages, devices, config)
}

/// [`place_manually`] with given node costs of `graph` (for example with measured memory, see
/// [`NodeCosts::with_measured_memory`]).
pub fn place_manually_with_costs(
    graph: &Graph,
    costs: &NodeCosts,
    stages: &[Vec<String>],
    devices: &[DeviceSpec],
    config: &PlanConfig,
) -> Result<Plan> {
    if stages.len() != devices.len() {
        return Err(Error::invalid(
            "placement",
            format!("{} stages given for {} devices; give one stage per device", stages.len(), devices.len()),
        ));
    }
    let position = |name: &str| -> Result<usize> {
        let id = graph.find(name)?;
        costs.order.iter().position(|&o| o == id).ok_or_else(|| {
            Error::invalid(
                "placement",
                format!("`{name}` is a graph input, not a layer; inputs are fed to the stage that uses them"),
            )
        })
    };
    let mut stage_of = vec![usize::MAX; costs.len()];
    for (stage_idx, names) in stages.iter().enumerate() {
        if names.is_empty() {
            return Err(Error::invalid(
                "placement",
                format!("stage {stage_idx} is empty; every stage needs at least one layer"),
            ));
        }
        for entry in names {
            let members: Vec<usize> = match entry.split_once("..") {
                Some((first, last)) => {
                    let (a, b) = (position(first.trim())?, position(last.trim())?);
                    if a > b {
                        return Err(Error::invalid(
                            "placement",
                            format!("range `{entry}` runs backwards in graph order"),
                        ));
                    }
                    (a..=b).collect()
                }
                None => vec![position(entry.trim())?],
            };
            for m in members {
                if stage_of[m] != usize::MAX {
                    return Err(Error::invalid(
                        "placement",
                        format!("node `{}` is placed twice (stages {} and {stage_idx})", costs.names[m], stage_of[m]),
                    ));
                }
                stage_of[m] = stage_idx;
            }
        }
    }
    if let Some(m) = stage_of.iter().position(|&s| s == usize::MAX) {
        return Err(Error::invalid("placement", format!("node `{}` is not placed on any stage", costs.names[m])));
    }
    // Graph order: every producer on the same or an earlier stage than its consumers.
    for (node, &stage) in stage_of.iter().enumerate() {
        let id = costs.order[node];
        for producer in graph.predecessors(id) {
            if let Some(p) = costs.order.iter().position(|&o| o == producer)
                && stage_of[p] > stage
            {
                return Err(Error::invalid(
                    "placement",
                    format!(
                        "stage {stage} holds `{}` which consumes `{}` from the later stage {}; a stage may only consume from itself or earlier stages",
                        costs.names[node], costs.names[p], stage_of[p]
                    ),
                ));
            }
        }
    }
    // Stages are contiguous in a topological order consistent with the placement: sort by stage.
    let mut nodes: Vec<usize> = (0..costs.len()).collect();
    nodes.sort_by_key(|&n| (stage_of[n], n));
    let reordered = costs.reorder(&nodes);
    let mut cuts = vec![0];
    for stage_idx in 0..stages.len() {
        cuts.push(cuts[stage_idx] + stage_of.iter().filter(|&&s| s == stage_idx).count());
    }
    let plan = plan_from_cuts(&reordered, config, devices, &cuts)?;
    for stage in &plan.stages {
        if let Some(budget) = plan.devices[stage.device_idx].budget_bytes
            && stage.largest_total() > budget
        {
            return Err(does_not_fit(&plan, stage.stage_idx, PlacedBy::Manual, manual_hints()));
        }
    }
    Ok(plan)
}
