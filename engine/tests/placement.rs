//! Graph building and stage placement: shape inference errors, manual placement checks, automatic
//! placement against brute force, and memory budgets.
use conveyor_engine::device::DeviceKind;
use conveyor_engine::graph::Graph;
use conveyor_engine::placement::{
    DeviceSpec, FLOPS_PER_BYTE_MOVED, FitHint, Link, OptimizerMemory, PlacedBy, PlanConfig, WeightCache,
    place_automatically, place_manually,
};
use conveyor_engine::{CallScratch, Error, ForwardCtx, Layer, LayerCost, Parameter, Result, Saved, Shape, Tensor};

/// A layer that only has costs: `flops` per sample for each pass, `params` f32 parameters,
/// width-preserving shapes. Enough for the planner, which never runs a layer.
#[derive(Debug)]
struct CostLayer {
    width: usize,
    flops: u64,
    params: u64,
    n_inputs: usize,
    workspace: u64,
    /// Per sample, the input-gradient call's scratch on a GPU.
    gpu_scratch: u64,
}

impl Layer for CostLayer {
    fn kind(&self) -> &'static str {
        "Cost"
    }
    fn n_inputs(&self) -> usize {
        self.n_inputs
    }
    fn output_shape(&self, input_shapes: &[Shape]) -> Result<Shape> {
        for s in input_shapes {
            if s.dims() != [self.width] {
                return Err(Error::shape("Cost", format!("[{}]", self.width), s.to_string()));
            }
        }
        Ok(Shape::new([self.width]))
    }
    fn parameters(&self) -> &[Parameter] {
        &[]
    }
    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut []
    }
    fn forward(&self, _: &[&Tensor], _: &ForwardCtx) -> Result<(Tensor, Saved)> {
        unreachable!("the planner never runs layers")
    }
    fn backward_input(&self, _: &Saved, _: &Tensor) -> Result<Vec<Option<Tensor>>> {
        unreachable!("the planner never runs layers")
    }
    fn backward_weight(&self, _: &Saved, _: &Tensor, _: &mut [Tensor]) -> Result<()> {
        unreachable!("the planner never runs layers")
    }
    fn cost(&self, _: &[Shape]) -> Result<LayerCost> {
        Ok(LayerCost {
            workspace_bytes: self.workspace,
            forward_flops_per_sample: self.flops,
            backward_input_flops_per_sample: self.flops,
            backward_weight_flops_per_sample: self.flops,
            param_bytes: self.params * 4,
            activation_bytes_per_sample: self.width as u64 * 4,
            output_bytes_per_sample: self.width as u64 * 4,
            backward_held_bytes_per_sample: 0,
            gpu_scratch_bytes_per_sample: CallScratch { backward_input: self.gpu_scratch, ..CallScratch::default() },
        })
    }
}

fn cost_layer(flops: u64, params: u64) -> CostLayer {
    CostLayer { width: 8, flops, params, n_inputs: 1, workspace: 0, gpu_scratch: 0 }
}

fn chain(flops: &[u64], params: &[u64]) -> Graph {
    let mut g = Graph::new();
    let mut x = g.input("x", [8]).unwrap();
    for (i, (&f, &p)) in flops.iter().zip(params).enumerate() {
        x = g.add(&format!("l{i}"), cost_layer(f, p), &[x]).unwrap();
    }
    g.set_output(x).unwrap();
    g
}

fn devices(n: usize, budget: Option<u64>) -> Vec<DeviceSpec> {
    (0..n).map(|i| DeviceSpec::cpu(i, 1e9, budget)).collect()
}

/// 1F1B in-flight counts: stage s of p holds min(m, p - s) micro-batches.
fn config(micro_batches: usize, optimizer: OptimizerMemory) -> PlanConfig {
    PlanConfig::new(
        4,
        8,
        |p| (0..p).map(|s| micro_batches.min(p - s)).collect(),
        optimizer,
        Link { latency_s: 0.0, bandwidth_bytes_per_s: f64::INFINITY },
    )
}

/// Every way of cutting `n` nodes into `p` non-empty contiguous stages.
fn all_cuts(n: usize, p: usize) -> Vec<Vec<usize>> {
    fn rec(start: usize, n: usize, left: usize, cuts: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if left == 1 {
            let mut c = cuts.clone();
            c.push(n);
            out.push(c);
            return;
        }
        for next in start + 1..=n - (left - 1) {
            cuts.push(next);
            rec(next, n, left - 1, cuts, out);
            cuts.pop();
        }
    }
    let mut out = Vec::new();
    rec(0, n, p, &mut vec![0], &mut out);
    out
}

/// What the planner charges node `i` of a [`chain`] for its three passes: their FLOPs, plus
/// `FLOPS_PER_BYTE_MOVED` for every byte each pass reads and writes (width 8: 32 bytes in and 32
/// out; the input-gradient pass of the first node writes no gradient for the data).
fn node_flop_equivalents(flops: u64, i: usize) -> f64 {
    let per_byte = FLOPS_PER_BYTE_MOVED;
    let input_grad_bytes = if i == 0 { 32.0 } else { 64.0 };
    3.0 * flops as f64 + per_byte * (64.0 + input_grad_bytes + 64.0)
}

fn brute_force_bottleneck(flops: &[u64], p: usize) -> f64 {
    let cost: Vec<f64> = flops.iter().enumerate().map(|(i, &f)| node_flop_equivalents(f, i)).collect();
    all_cuts(flops.len(), p)
        .iter()
        .map(|cuts| cuts.windows(2).map(|w| cost[w[0]..w[1]].iter().sum::<f64>() * 4.0 / 1e9).fold(0.0, f64::max))
        .fold(f64::INFINITY, f64::min)
}

#[test]
fn automatic_placement_matches_brute_force_on_uneven_chains() {
    let mut seed = 12345u64;
    let mut next = || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) % 1000 + 1
    };
    for case in 0..40 {
        let n = 4 + case % 9;
        let p = 1 + case % 4;
        let flops: Vec<u64> = (0..n).map(|_| next() * 1000).collect();
        let g = chain(&flops, &vec![0; n]);
        let plan = place_automatically(&g, &devices(p, None), &config(8, OptimizerMemory::Sgd)).unwrap();
        let optimal = brute_force_bottleneck(&flops, p);
        assert!(
            (plan.bottleneck_s() - optimal).abs() <= 1e-12 * optimal,
            "case {case}: {} vs {optimal}",
            plan.bottleneck_s()
        );
        assert_eq!(plan.stages.len(), p);
    }
}

#[test]
fn sixteen_uneven_layers_on_four_devices_within_five_percent_of_optimal() {
    let widths = [64u64, 512, 128, 1024, 32, 256, 2048, 64, 96, 768, 512, 16, 1024, 384, 128, 10];
    let flops: Vec<u64> = widths.windows(2).map(|w| 2 * w[0] * w[1]).chain([2 * 10 * 64]).collect();
    let g = chain(&flops, &vec![0; flops.len()]);
    let plan = place_automatically(&g, &devices(4, None), &config(8, OptimizerMemory::Sgd)).unwrap();
    let optimal = brute_force_bottleneck(&flops, 4);
    assert!(plan.bottleneck_s() <= optimal * 1.05, "{} vs optimal {optimal}", plan.bottleneck_s());
}

#[test]
fn model_four_times_one_budget_fits_on_four_devices_not_one() {
    // 16 layers of 1M parameters with Adam: 16 MiB x 4 (param, grad, two moments) = 256 MiB.
    let params = [1 << 20; 16];
    let g = chain(&[1000; 16], &params);
    let budget = 72 << 20; // a quarter of 256 MiB plus room for activations
    let cfg = config(8, OptimizerMemory::Adam);
    let plan = place_automatically(&g, &devices(4, Some(budget)), &cfg).unwrap();
    for stage in &plan.stages {
        assert!(stage.memory.total() <= budget, "stage {} needs {}", stage.stage_idx, stage.memory.total());
        assert_eq!(stage.memory.optimizer_state, 2 * stage.memory.params);
    }
    let err = place_automatically(&g, &devices(1, Some(budget)), &cfg).unwrap_err();
    match &err {
        Error::DoesNotFit { n_stages: 1, hints, .. } => assert!(hints.contains(&FitHint::MoreStages), "{err}"),
        other => panic!("expected DoesNotFit, got {other}"),
    }
}

#[test]
fn does_not_fit_carries_numbers_a_program_can_act_on_and_the_same_message() {
    // 4 layers of 1M parameters with Adam: 16 MiB each with gradients and both moments.
    let g = chain(&[1000; 4], &[1 << 20; 4]);
    let cfg = config(8, OptimizerMemory::Adam);
    let err = place_automatically(&g, &devices(2, Some(12 << 20)), &cfg).unwrap_err();
    let Error::DoesNotFit {
        n_stages,
        stage,
        device,
        needed_bytes,
        budget_bytes,
        breakdown,
        stages,
        hints,
        placed_by,
        ..
    } = &err
    else {
        panic!("expected DoesNotFit, got {err}");
    };
    assert_eq!((*n_stages, *placed_by, stages.len()), (2, PlacedBy::Automatic, 2));
    assert!(*stage < 2);
    assert_eq!(*device, format!("cpu:{stage}"));
    assert!(needed_bytes > budget_bytes, "{needed_bytes} <= {budget_bytes}");
    assert_eq!(*budget_bytes, 12 << 20);
    assert_eq!(breakdown.total(), *needed_bytes);
    // Two layers a stage: 8 MiB of parameters, as much gradient, twice as much Adam state.
    assert_eq!(breakdown.parameters, 8 << 20);
    assert_eq!((breakdown.gradients, breakdown.optimizer_state), (8 << 20, 16 << 20));
    assert!(breakdown.activations > 0 && breakdown.activations < 1 << 20);
    assert_eq!(stages[*stage].needed_bytes, *needed_bytes);
    assert!(stages.iter().all(|s| s.needed_bytes <= *needed_bytes && s.budget_bytes == Some(12 << 20)));
    assert_eq!(hints[0], FitHint::SplitLayer { layer: "l0".into(), bytes: 16 << 20 });
    assert!(hints.contains(&FitHint::MoreStages) && hints.contains(&FitHint::LighterOptimizer));
    // The message is the one the error carried as text before it carried numbers.
    assert_eq!(
        err.to_string(),
        "the model does not fit: on 2 stage(s) the best placement needs [32.0 MiB, 32.0 MiB] on its largest stage \
         against budgets [12.0 MiB, 12.0 MiB]; what would help: one layer alone needs 16.0 MiB for parameters, \
         gradients and optimizer state: split it with tensor parallelism; more stages (devices), larger budgets, \
         activation recomputation, smaller micro-batches, or an optimizer with less state (plain SGD)"
    );
    let sgd = place_automatically(&g, &devices(2, Some(10 << 20)), &config(8, OptimizerMemory::Sgd)).unwrap_err();
    assert!(
        sgd.to_string().ends_with(
            "needs [16.0 MiB, 16.0 MiB] on its largest stage against budgets [10.0 MiB, 10.0 MiB]; what would help: \
             more stages (devices), larger budgets, activation recomputation, smaller micro-batches"
        ),
        "{sgd}"
    );

    // A manual placement names its stage over budget: l1..l3 on stage 1 need 48 MiB.
    let names = vec![vec!["l0".to_string()], vec!["l1".to_string(), "l2".to_string(), "l3".to_string()]];
    let err = place_manually(&g, &names, &devices(2, Some(40 << 20)), &cfg).unwrap_err();
    let Error::DoesNotFit { stage: 1, device, needed_bytes, breakdown, placed_by: PlacedBy::Manual, hints, .. } = &err
    else {
        panic!("expected stage 1 not to fit, got {err}");
    };
    assert_eq!((device.as_str(), breakdown.total(), breakdown.parameters), ("cpu:1", *needed_bytes, 12 << 20));
    assert!(hints.contains(&FitHint::MoveLayers));
    assert_eq!(
        err.to_string(),
        "the model does not fit: on 2 stage(s) the best placement needs 48.0 MiB on stage 1 (cpu:1) on its largest \
         stage against budgets 40.0 MiB; what would help: move layers to another stage, use automatic placement, \
         recomputation or smaller micro-batches"
    );
}

#[test]
fn manual_placement_checks_graph_order_and_names() {
    let g = chain(&[1, 2, 3, 4], &[0; 4]);
    let cfg = config(4, OptimizerMemory::Sgd);
    let names = |stages: &[&[&str]]| -> Vec<Vec<String>> {
        stages.iter().map(|s| s.iter().map(|n| n.to_string()).collect()).collect()
    };
    let plan = place_manually(&g, &names(&[&["l0..l2"], &["l3"]]), &devices(2, None), &cfg).unwrap();
    assert_eq!(plan.stages[0].node_names, ["l0", "l1", "l2"]);
    assert_eq!(plan.stages[1].node_names, ["l3"]);

    let err = place_manually(&g, &names(&[&["l0", "l2", "l3"], &["l1"]]), &devices(2, None), &cfg).unwrap_err();
    assert!(err.to_string().contains("consumes `l1` from the later stage 1"), "{err}");
    let err = place_manually(&g, &names(&[&["l0", "l1"], &["l2", "fc9"]]), &devices(2, None), &cfg).unwrap_err();
    assert!(err.to_string().contains("no node named `fc9`"), "{err}");
    let err = place_manually(&g, &names(&[&["l0", "l1"], &["l2"]]), &devices(2, None), &cfg).unwrap_err();
    assert!(err.to_string().contains("`l3` is not placed"), "{err}");
}

#[test]
fn graph_builder_infers_shapes_and_rejects_bad_graphs() {
    let mut g = Graph::new();
    let x = g.input("x", [8]).unwrap();
    let a = g.add("a", cost_layer(1, 0), &[x]).unwrap();
    let b = g.add("b", cost_layer(1, 0), &[a]).unwrap();
    // A residual join: one output (a) feeds two nodes.
    let sum = g
        .add("sum", CostLayer { width: 8, flops: 1, params: 0, n_inputs: 2, workspace: 0, gpu_scratch: 0 }, &[a, b])
        .unwrap();
    assert_eq!(g.predecessors(sum), vec![a, b]);
    assert_eq!(g.successors(a), vec![b, sum]);
    g.set_output(sum).unwrap();
    g.validate().unwrap();

    let err = g
        .add("wide", CostLayer { width: 16, flops: 1, params: 0, n_inputs: 1, workspace: 0, gpu_scratch: 0 }, &[sum])
        .unwrap_err();
    assert!(err.to_string().contains("node `wide`") && err.to_string().contains("expected [16], got [8]"), "{err}");
    // `wide` was refused, so the graph is still valid; a dangling node is not.
    g.add("dangling", cost_layer(1, 0), &[x]).unwrap();
    assert!(g.validate().unwrap_err().to_string().contains("`dangling` is dangling"));
    assert!(g.add("a", cost_layer(1, 0), &[x]).unwrap_err().to_string().contains("already in the graph"));
    let mut other = Graph::new();
    assert!(other.add("z", cost_layer(1, 0), &[sum]).unwrap_err().to_string().contains("not in this graph"));
}

#[test]
fn skip_edges_go_straight_to_their_consumer_stage() {
    // x -> a -> b -> c -> add(a, c): the edge a -> add skips stage 1 when placed on 3 stages.
    let mut g = Graph::new();
    let x = g.input("x", [8]).unwrap();
    let a = g.add("a", cost_layer(10, 0), &[x]).unwrap();
    let b = g.add("b", cost_layer(10, 0), &[a]).unwrap();
    let c = g.add("c", cost_layer(10, 0), &[b]).unwrap();
    let out = g
        .add("add", CostLayer { width: 8, flops: 10, params: 0, n_inputs: 2, workspace: 0, gpu_scratch: 0 }, &[a, c])
        .unwrap();
    g.set_output(out).unwrap();
    let plan = place_automatically(&g, &devices(3, None), &config(4, OptimizerMemory::Sgd)).unwrap();
    let stage_of = plan.stage_of_nodes();
    for (node, stage) in &stage_of {
        for p in g.predecessors(*node) {
            if let Some((_, ps)) = stage_of.iter().find(|(n, _)| *n == p) {
                assert!(ps <= stage);
            }
        }
    }
}

/// What a stage may drop to fit: the commit's undo snapshot is kept first (it makes a failed
/// update recoverable), then derived caches, the largest-FLOP layer's first, as long as they fit;
/// what is dropped is reported, and nothing required is ever dropped.
#[test]
fn the_plan_keeps_the_snapshot_then_the_caches_that_fit_and_says_what_it_dropped() {
    let mut g = Graph::new();
    let mut x = g.input("x", [8]).unwrap();
    // 1 MiB of parameters each; the second layer does the most work; each cache is 2 MiB.
    for (i, flops) in [1000u64, 5000, 2000].into_iter().enumerate() {
        let layer = CostLayer { width: 8, flops, params: 1 << 18, n_inputs: 1, workspace: 2 << 20, gpu_scratch: 0 };
        x = g.add(&format!("l{i}"), layer, &[x]).unwrap();
    }
    g.set_output(x).unwrap();
    let mut cfg = config(8, OptimizerMemory::Adam);
    assert_eq!(cfg.weight_cache, WeightCache::Off, "no caches unless asked for");
    cfg.weight_cache = WeightCache::Auto;
    let free = place_automatically(&g, &devices(1, None), &cfg).unwrap();
    let stage = &free.stages[0];
    assert_eq!(stage.memory.workspace, 6 << 20, "no budget: every cache kept");
    assert_eq!(stage.memory.commit_snapshot, 9 << 20, "parameters and Adam's two moments");
    // Required: 3 MiB x (parameters, gradients, two moments) plus activations. With the snapshot
    // (9 MiB) and room for one 2 MiB cache but not two:
    let required = stage.memory.required();
    let budget = required + (9 << 20) + (3 << 20);
    let plan = place_automatically(&g, &devices(1, Some(budget)), &cfg).unwrap();
    let stage = &plan.stages[0];
    assert_eq!(stage.memory.commit_snapshot, 9 << 20);
    assert_eq!(stage.derived_caches, [false, true, false], "the busiest layer keeps its cache");
    assert_eq!(stage.dropped_caches, ["l0", "l2"]);
    assert_eq!(stage.memory.workspace_dropped, 4 << 20);
    assert!(stage.memory.total() <= budget);
    assert_eq!(plan.commit_snapshots(), [true]);
    // Without room for the snapshot, the caches fill what there is.
    let plan = place_automatically(&g, &devices(1, Some(required + (4 << 20))), &cfg).unwrap();
    let stage = &plan.stages[0];
    assert_eq!((stage.memory.commit_snapshot, stage.memory.commit_snapshot_dropped), (0, 9 << 20));
    assert_eq!(stage.derived_caches, [false, true, true]);
    assert_eq!(plan.commit_snapshots(), [false]);
    // Below what is required, the model does not fit.
    assert!(place_automatically(&g, &devices(1, Some(required - 1)), &cfg).is_err());
}

/// The scratch a layer's GPU ops take (`LayerCost::gpu_scratch_bytes_per_sample`) is in a GPU
/// stage's peak, a call's worth at once, and not in a CPU stage's (CPU kernels keep it off the
/// ledger).
#[test]
fn gpu_scratch_counts_on_gpu_stages_only() {
    const SCRATCH: u64 = 1 << 20;
    let mut g = Graph::new();
    let mut x = g.input("x", [8]).unwrap();
    for i in 0..3 {
        let layer = CostLayer { width: 8, flops: 10, params: 64, n_inputs: 1, workspace: 0, gpu_scratch: SCRATCH };
        x = g.add(&format!("l{i}"), layer, &[x]).unwrap();
    }
    g.set_output(x).unwrap();
    let cfg = config(2, OptimizerMemory::Sgd);
    let stages = vec![vec!["l0".to_string(), "l1".to_string(), "l2".to_string()]];
    let total = |kind: DeviceKind| {
        let device = DeviceSpec { name: "d".into(), flops_per_s: 1e9, budget_bytes: None, kind };
        place_manually(&g, &stages, &[device], &cfg).unwrap().stages[0].memory.total()
    };
    let (cpu, gpu) = (total(DeviceKind::Cpu), total(DeviceKind::Cuda));
    let rows = 4; // `config`'s micro-batch rows
    assert!(cpu < SCRATCH, "a CPU stage counts no GPU scratch: {cpu} bytes");
    // One call runs at a time: one layer's scratch on top, never three.
    assert!(gpu >= rows * SCRATCH && gpu <= cpu + rows * SCRATCH, "GPU stage {gpu} bytes against CPU {cpu}");
}
