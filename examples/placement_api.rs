//! The placement API by example: build a graph with a residual skip, place it by hand, place it
//! automatically under per-device memory budgets, see what a model that does not fit reports, and
//! train a few steps on CPU devices with the automatic placement.
//!
//! Run it with `cargo run --release --example placement_api` (a few seconds).
//!
//! The same planner sits behind `conveyor plan` (which prints this example's table for zoo models)
//! and `conveyor train` (which places automatically before it trains).
use std::sync::Arc;

use anyhow::Result;
use conveyor::engine::graph::Graph;
use conveyor::engine::optim::{AdamConfig, OptimizerConfig};
use conveyor::engine::placement::{
    DeviceSpec, Link, OptimizerMemory, Plan, PlanConfig, format_bytes, place_automatically, place_manually,
};
use conveyor::engine::runtime::Trainer;
use conveyor::engine::{Device, Error, init};
use conveyor::layers::{Add, CrossEntropyLoss, Linear, Relu};
use conveyor::pipeline::{CPU_FLOPS_PER_S, simulated_inflight};
use conveyor::schedules::ScheduleKind;

/// Input features, hidden width and classes of the example model: three equal 256x256 layers and
/// a small head, so memory splits evenly over three stages.
const N_FEATURES: usize = 256;
const HIDDEN: usize = 256;
const N_CLASSES: usize = 4;
/// Rows per optimizer step, split into micro-batches that flow through the pipeline.
const BATCH_ROWS: usize = 32;
const N_MICRO_BATCHES: usize = 4;
const SCHEDULE: ScheduleKind = ScheduleKind::OneFOneB;
/// Optimizer steps to train (the synthetic classes are well separated: a small learning rate
/// keeps the loss curve visible).
const N_STEPS: usize = 12;

fn main() -> Result<()> {
    // 1. A graph. Nodes are named (the names prefix parameters, `fc1.weight`, and are how a
    //    placement refers to them); `g.add` infers each node's output shape from its inputs and
    //    refuses mismatches at once, naming the node.
    //
    //        x -> fc1 -> relu1 -> fc2 -> relu2 -> fc3 -> add(fc3, relu1) -> relu3 -> head
    //                       \______________ skip ______________/
    let graph = build_graph()?;
    println!("graph: {}", graph.names().join(" "));

    // 2. What the planner assumes. In-flight counts come from simulating the schedule: under
    //    1F1B with p stages, stage s holds at most min(m, p - s) micro-batches' activations, so
    //    early stages need more activation memory than late ones. Adam keeps two state tensors per
    //    parameter; the link model (latency + bytes / bandwidth) prices transfers between stages.
    let micro_batch_rows = BATCH_ROWS / N_MICRO_BATCHES;
    let max_stages = 4;
    let config = PlanConfig::new(
        micro_batch_rows,
        max_stages,
        |p| simulated_inflight(SCHEDULE, p, N_MICRO_BATCHES, 1).expect("1F1B is defined for any p"),
        OptimizerMemory::Adam,
        Link::default(),
    );

    // 3. Manual placement: one list of node names per stage (stage k on device k). A range
    //    `first..last` names every layer between them in graph order. The planner checks that
    //    every layer is placed once and that no stage consumes from a later one; the skip edge
    //    relu1 -> add may cross from stage 0 to stage 1.
    let manual = vec![vec!["fc1".to_string(), "relu1".to_string(), "fc2".to_string()], vec!["relu2..head".to_string()]];
    let plan = place_manually(&graph, &manual, &devices(2, None), &config)?;
    print_plan("manual placement on 2 devices", &plan);

    // A placement that breaks graph order is refused with an error saying which edge runs backwards.
    let backwards = vec![vec!["fc1".to_string(), "fc2..head".to_string()], vec!["relu1".to_string()]];
    if let Err(err) = place_manually(&graph, &backwards, &devices(2, None), &config) {
        println!("refused: {err}\n");
    }

    // 4. Automatic placement: the planner cuts the graph's topological order into contiguous
    //    stages, minimising the slowest stage's predicted time subject to every stage fitting its
    //    device's budget (an exact dynamic programme over cut points). Here the budget is 45% of
    //    what the whole model needs on one device, so it takes at least three devices.
    let one_device = place_automatically(&graph, &devices(1, None), &config)?;
    let whole = one_device.stages[0].memory.total();
    let budget = whole * 45 / 100;
    println!(
        "the whole model needs {} on one device; budget per device {}\n",
        format_bytes(whole),
        format_bytes(budget)
    );
    let plan = place_automatically(&graph, &devices(3, Some(budget)), &config)?;
    print_plan("automatic placement on 3 devices", &plan);

    // 5. A model that fits nowhere (two devices of half that budget): the error carries the best
    //    placement's worst stage, its need by kind against its budget, every stage's need, and what
    //    would help (more devices, larger budgets, recomputation, less state), as numbers a
    //    program can act on.
    match place_automatically(&graph, &devices(2, Some(budget / 2)), &config) {
        Err(Error::DoesNotFit { n_stages, stage, device, needed_bytes, budget_bytes, breakdown, hints, .. }) => {
            println!(
                "on {n_stages} devices it does not fit: stage {stage} on {device} needs {} against {} \
                 (parameters {}, gradients {}, Adam state {}, activations {})",
                format_bytes(needed_bytes),
                format_bytes(budget_bytes),
                format_bytes(breakdown.parameters),
                format_bytes(breakdown.gradients),
                format_bytes(breakdown.optimizer_state),
                format_bytes(breakdown.activations),
            );
            println!("what would help: {hints:?}\n");
        }
        other => println!("unexpectedly: {other:?}\n"),
    }

    // 6. Train with the automatic plan. The trainer takes the node ids of each stage
    //    (`plan.stages[k].nodes`) and runs stage k on device k, one worker thread per device,
    //    micro-batches moving through channels under the 1F1B schedule. The devices get the same
    //    budgets the planner placed for, and the runtime enforces them.
    let stages = plan.stages.iter().map(|stage| stage.nodes.clone()).collect();
    let devices: Vec<Device> = (0..plan.stages.len()).map(|i| Device::cpu_with_budget(i, Some(budget))).collect();
    let mut trainer = Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices(devices)
        .stages(stages)
        .schedule(SCHEDULE, 1)
        .micro_batches(N_MICRO_BATCHES)
        .optimizer(OptimizerConfig::Adam(AdamConfig::adam(1e-4)))
        .seed(0)
        .build()?;
    let data = conveyor::data::synthetic(256, N_FEATURES, N_CLASSES, 0)?;
    for step in 0..N_STEPS {
        let start = (step * BATCH_ROWS) % data.len();
        let rows: Vec<usize> = (start..start + BATCH_ROWS).collect();
        let (inputs, labels) = data.batch(&rows)?;
        let report = trainer.train_step(&inputs, &labels)?;
        if step % 2 == 0 || step + 1 == N_STEPS {
            let peak: Vec<String> = report.peak_memory.iter().map(|&b| format_bytes(b)).collect();
            println!("step {:>2}  loss {:.4}  peak memory per device [{}]", step + 1, report.loss, peak.join(", "));
        }
    }
    Ok(())
}

/// `x -> fc1 -> relu1 -> fc2 -> relu2 -> fc3 -> add(fc3, relu1) -> relu3 -> head`, initialised
/// like PyTorch from a fixed seed.
fn build_graph() -> Result<Graph> {
    let mut rng = init::rng(0);
    let mut g = Graph::new();
    let x = g.input("x", [N_FEATURES])?;
    let h = g.add("fc1", Linear::new(N_FEATURES, HIDDEN, true, &mut rng)?, &[x])?;
    let skip = g.add("relu1", Relu::new(), &[h])?;
    let h = g.add("fc2", Linear::new(HIDDEN, HIDDEN, true, &mut rng)?, &[skip])?;
    let h = g.add("relu2", Relu::new(), &[h])?;
    let h = g.add("fc3", Linear::new(HIDDEN, HIDDEN, true, &mut rng)?, &[h])?;
    // The residual join: `Add` takes two inputs of one shape, here fc3's output and the skip.
    let h = g.add("add", Add::new(), &[h, skip])?;
    let h = g.add("relu3", Relu::new(), &[h])?;
    let out = g.add("head", Linear::new(HIDDEN, N_CLASSES, true, &mut rng)?, &[h])?;
    g.set_output(out)?;
    Ok(g)
}

/// `n` CPU devices as the planner sees them: a name, a speed and a memory budget.
fn devices(n: usize, budget_bytes: Option<u64>) -> Vec<DeviceSpec> {
    (0..n).map(|i| DeviceSpec::cpu(i, CPU_FLOPS_PER_S, budget_bytes)).collect()
}

/// The per-stage table: layers, memory (parameters, gradients, optimizer state, activations of
/// the micro-batches in flight) against the budget, and predicted times per micro-batch.
fn print_plan(title: &str, plan: &Plan) {
    println!("{title}: slowest stage {:.1} µs per micro-batch", plan.bottleneck_s() * 1e6);
    println!(
        "  {:<5} {:<6} {:<28} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>8}",
        "stage", "device", "layers", "params", "grads", "optim", "activ", "total", "budget", "F µs", "B µs", "W µs"
    );
    for stage in &plan.stages {
        let device = &plan.devices[stage.device_idx];
        let memory = stage.memory;
        println!(
            "  {:<5} {:<6} {:<28} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8.1} {:>8.1} {:>8.1}",
            stage.stage_idx,
            device.name,
            stage.node_names.join(" "),
            format_bytes(memory.params),
            format_bytes(memory.grads),
            format_bytes(memory.optimizer_state),
            format_bytes(memory.activations),
            format_bytes(memory.total()),
            device.budget_bytes.map_or("unlimited".to_string(), format_bytes),
            stage.forward_s * 1e6,
            stage.backward_input_s * 1e6,
            stage.backward_weight_s * 1e6,
        );
    }
    println!();
}
