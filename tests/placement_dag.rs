//! Placement of a graph with residual skips (the zoo's `resnet`): every edge runs forward through
//! the stages, skip edges may cross several, and automatic placement matches a brute force over
//! every contiguous cut of the topological order, with and without memory budgets.
use anyhow::Result;
use conveyor::engine::Error;
use conveyor::engine::graph::Graph;
use conveyor::engine::placement::{
    DeviceSpec, Link, NodeCosts, OptimizerMemory, Plan, PlanConfig, place_automatically, place_manually,
};
use conveyor::pipeline::{CPU_FLOPS_PER_S, simulated_inflight};
use conveyor::schedules::ScheduleKind;
use conveyor::zoo::resnet;

const N_MICRO_BATCHES: usize = 8;
const MAX_STAGES: usize = 5;

/// Relative tolerance of bottleneck comparisons: `|a - b| <= 1e-12 * max(a, b)`. Manual placement
/// recomputes its prefix sums in its own order, so equal plans may differ in the last bits.
fn same_time(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * a.max(b)
}

/// 1F1B in-flight counts from the schedule simulator, Adam state, the default link.
fn config() -> PlanConfig {
    PlanConfig::new(
        8,
        MAX_STAGES,
        |p| simulated_inflight(ScheduleKind::OneFOneB, p, N_MICRO_BATCHES, 1).expect("1F1B is defined for every p"),
        OptimizerMemory::Adam,
        Link::default(),
    )
}

fn devices(n_stages: usize, budget_bytes: Option<u64>) -> Vec<DeviceSpec> {
    (0..n_stages).map(|i| DeviceSpec::cpu(i, CPU_FLOPS_PER_S, budget_bytes)).collect()
}

/// Every way of cutting `n` nodes into `p` non-empty contiguous stages, as cut points `0 = c0 < c1 < ... < cp = n`.
fn all_cuts(n: usize, p: usize) -> Vec<Vec<usize>> {
    fn extend(cuts: &mut Vec<usize>, n: usize, left: usize, out: &mut Vec<Vec<usize>>) {
        let last = *cuts.last().expect("cuts start with 0");
        if left == 1 {
            out.push(cuts.iter().copied().chain([n]).collect());
            return;
        }
        for next in last + 1..=n - (left - 1) {
            cuts.push(next);
            extend(cuts, n, left - 1, out);
            cuts.pop();
        }
    }
    let mut out = Vec::new();
    extend(&mut vec![0], n, p, &mut out);
    out
}

/// The stages of a cut as manual-placement ranges `first..last` of the planner's topological order.
fn ranges(names: &[String], cuts: &[usize]) -> Vec<Vec<String>> {
    cuts.windows(2).map(|w| vec![format!("{}..{}", names[w[0]], names[w[1] - 1])]).collect()
}

/// Asserts every graph edge between layer nodes runs from an earlier-or-same stage to a
/// later-or-same one; returns how many residual skip edges cross a stage boundary.
fn check_edges_forward(graph: &Graph, plan: &Plan) -> usize {
    let stage_of = plan.stage_of_nodes();
    let stage = |node| stage_of.iter().find(|(n, _)| *n == node).map(|&(_, s)| s);
    let mut crossing_skips = 0;
    for id in graph.node_ids() {
        let Some(consumer_stage) = stage(id) else { continue };
        let preds = graph.predecessors(id);
        for &p in &preds {
            let Some(producer_stage) = stage(p) else { continue };
            assert!(
                producer_stage <= consumer_stage,
                "edge {} (stage {producer_stage}) -> {} (stage {consumer_stage}) runs backwards",
                graph.node(p).unwrap().name,
                graph.node(id).unwrap().name,
            );
            // A skip edge is the second input of a residual join.
            if preds.len() == 2 && p == preds[1] && producer_stage < consumer_stage {
                crossing_skips += 1;
            }
        }
    }
    crossing_skips
}

/// The smallest bottleneck over every contiguous cut that fits the budgets, and how many cuts put
/// a residual skip across stages (all of them accepted).
fn brute_force(graph: &Graph, names: &[String], n_stages: usize, budget: Option<u64>) -> (Option<f64>, usize) {
    let mut best: Option<f64> = None;
    let mut crossing = 0;
    for cuts in all_cuts(names.len(), n_stages) {
        match place_manually(graph, &ranges(names, &cuts), &devices(n_stages, budget), &config()) {
            Ok(plan) => {
                crossing += usize::from(check_edges_forward(graph, &plan) > 0);
                best = Some(best.map_or(plan.bottleneck_s(), |b| b.min(plan.bottleneck_s())));
            }
            Err(Error::DoesNotFit { .. }) if budget.is_some() => {}
            Err(other) => panic!("cuts {cuts:?}: {other}"),
        }
    }
    (best, crossing)
}

#[test]
fn automatic_placement_of_a_residual_graph_matches_brute_force() -> Result<()> {
    let graph = resnet(0)?;
    let names = NodeCosts::of_graph(&graph)?.names;
    assert_eq!(names.len(), 15, "stem, relu, two blocks of five, pool, flatten, fc");
    for n_stages in 1..=MAX_STAGES {
        let plan = place_automatically(&graph, &devices(n_stages, None), &config())?;
        assert_eq!(plan.stages.len(), n_stages);
        check_edges_forward(&graph, &plan);
        let (optimal, crossing) = brute_force(&graph, &names, n_stages, None);
        let optimal = optimal.expect("without budgets every cut fits");
        assert!(
            same_time(plan.bottleneck_s(), optimal),
            "{n_stages} stages: {} vs brute force {optimal}",
            plan.bottleneck_s()
        );
        if n_stages > 1 {
            assert!(crossing > 0, "{n_stages} stages: some placements put a skip edge across stages");
        }
    }
    Ok(())
}

#[test]
fn under_budgets_automatic_placement_matches_brute_force_among_cuts_that_fit() -> Result<()> {
    let graph = resnet(0)?;
    let names = NodeCosts::of_graph(&graph)?.names;
    let (mut forced_slower, mut refused) = (0, 0);
    for n_stages in 2..=4 {
        // Budgets just below what the unconstrained optimum's largest stage needs force other cuts.
        let free = place_automatically(&graph, &devices(n_stages, None), &config())?;
        let largest = free.stages.iter().map(|s| s.memory.total()).max().unwrap_or(0);
        for budget in [largest * 9 / 10, largest * 3 / 4, largest / 2] {
            let (optimal, _) = brute_force(&graph, &names, n_stages, Some(budget));
            match (place_automatically(&graph, &devices(n_stages, Some(budget)), &config()), optimal) {
                (Ok(plan), Some(optimal)) => {
                    assert!(plan.stages.iter().all(|s| s.memory.total() <= budget));
                    check_edges_forward(&graph, &plan);
                    assert!(same_time(plan.bottleneck_s(), optimal), "{n_stages} stages, budget {budget}");
                    forced_slower += usize::from(plan.bottleneck_s() > free.bottleneck_s());
                }
                (Err(Error::DoesNotFit { n_stages: n, .. }), None) => {
                    assert_eq!(n, n_stages);
                    refused += 1;
                }
                (auto, brute) => {
                    panic!("{n_stages} stages, budget {budget}: automatic {auto:?}, brute force {brute:?}")
                }
            }
        }
    }
    // The budgets exercise both outcomes: a slower placement that fits, and none that fits.
    assert!(forced_slower > 0 && refused > 0, "forced slower {forced_slower}, refused {refused}");
    Ok(())
}

#[test]
fn a_skip_edge_may_cross_several_stages() -> Result<()> {
    // block1's skip (stem_relu -> block1.add) crosses from stage 0 over stage 1 into stage 2.
    let graph = resnet(0)?;
    let stages: Vec<Vec<String>> = [&["stem..stem_relu"][..], &["block1.conv1", "block1.relu1"], &["block1.conv2..fc"]]
        .iter()
        .map(|s| s.iter().map(|n| n.to_string()).collect())
        .collect();
    let plan = place_manually(&graph, &stages, &devices(3, None), &config())?;
    assert_eq!(check_edges_forward(&graph, &plan), 1);
    // Stage 2 (from block1.conv2, position 4 of the order, to the end) receives both the main path
    // and the skip, each an 8x8x8 f32 tensor per sample, and sends nothing on.
    let costs = NodeCosts::of_graph(&graph)?;
    assert_eq!(costs.names[4], "block1.conv2");
    assert_eq!(costs.boundary_bytes(4, costs.len()), (2 * 8 * 8 * 8 * 4, 0));
    assert_eq!(plan.stages[2].node_names.first().map(String::as_str), Some("block1.conv2"));
    Ok(())
}
