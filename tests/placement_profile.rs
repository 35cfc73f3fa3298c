//! The profiling pass (torchgpipe's balance_by_time): measured per-layer times are positive,
//! ordered like the work, and drive automatic placement.
use conveyor::engine::placement::{
    DeviceSpec, Link, NodeCosts, OptimizerMemory, PlanConfig, place_with_costs, profile_graph,
};
use conveyor::zoo::mlp;

#[test]
fn measured_times_follow_the_work_and_drive_placement() {
    let graph = mlp(&[16, 512, 512, 512, 16, 10], 1).unwrap();
    let times = profile_graph(&graph, 64, 5).unwrap();
    let layer_count = graph.node_ids().iter().filter(|&&id| graph.layer(id).is_some()).count();
    assert_eq!(times.len(), layer_count);
    let time_of = |name: &str| times.iter().find(|(id, _)| *id == graph.find(name).unwrap()).unwrap().1;
    for (_, t) in &times {
        assert!(t.forward_s > 0.0 && t.backward_input_s > 0.0 && t.backward_weight_s >= 0.0);
    }
    // Linear 512x512 (node 2) does 50 times the work of Linear 512x10 (node 8).
    assert!(time_of("2").forward_s > 5.0 * time_of("8").forward_s, "{:?} vs {:?}", time_of("2"), time_of("8"));

    let flops = 50e9;
    let costs = NodeCosts::of_graph(&graph).unwrap().with_measured_times(&times, flops).unwrap();
    let devices: Vec<DeviceSpec> = (0..2).map(|i| DeviceSpec::cpu(i, flops, None)).collect();
    let config = PlanConfig::new(8, 2, |p| vec![1; p], OptimizerMemory::Sgd, Link::default());
    let plan = place_with_costs(&costs, &devices, &config).unwrap();
    let placed: usize = plan.stages.iter().map(|s| s.nodes.len()).sum();
    assert_eq!(placed, layer_count);
    // The two 512x512 layers dominate; the cut separates them.
    let stage_of = |name: &str| plan.stages.iter().position(|s| s.node_names.iter().any(|n| n == name)).unwrap();
    assert_ne!(stage_of("2"), stage_of("4"), "{:?}", plan.stages.iter().map(|s| &s.node_names).collect::<Vec<_>>());
}

#[test]
fn conveyor_train_places_by_measured_time() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_conveyor"))
        .args(["train", "--model", "mlp:16,256,256,16,10", "--data", "synthetic:256,16,10", "--placement", "time"])
        .args(["--steps", "4", "--batch", "32", "--log-every", "0"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("stage 0 on cpu:0") && stdout.contains("stage 1 on cpu:1"), "{stdout}");
}
