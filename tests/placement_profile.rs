//! The profiling pass (torchgpipe's balance_by_time): measured per-layer times are positive,
//! ordered like the work, and drive automatic placement; `--placement auto` times the layers
//! only when a profile is affordable and keeps the cost model's cut unless the measured one is
//! clearly faster.
use conveyor::engine::Device;
use conveyor::engine::optim::OptimizerConfig;
use conveyor::engine::placement::{
    AutoPlacement, DeviceSpec, Link, NoProfile, NodeCosts, OptimizerMemory, PipelineConfig, Plan, PlanConfig,
    pipeline_plan, place_with_costs, plan_auto, profile_graph,
};
use conveyor::engine::runtime::Recompute;
use conveyor::schedules::ScheduleKind;
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

fn config(batch_rows: usize, n_micro_batches: usize) -> PipelineConfig {
    PipelineConfig {
        schedule: ScheduleKind::OneFOneB,
        n_chunks: 1,
        n_micro_batches,
        batch_rows,
        optimizer: OptimizerConfig::sgd(0.1),
        recompute: Recompute::Never,
        seed: 0,
        core_slots: Default::default(),
        precision: Default::default(),
        weight_cache: Default::default(),
    }
}

fn cuts(plan: &Plan) -> Vec<Vec<String>> {
    plan.stages.iter().map(|s| s.node_names.clone()).collect()
}

#[test]
fn auto_placement_times_the_layers_only_when_affordable_and_keeps_the_estimate_unless_clearly_slower() {
    let devices = vec![Device::cpu(0), Device::cpu(1)];
    // A small MLP: its passes take microseconds, too short to time reliably.
    let small = mlp(&[16, 32, 10], 1).unwrap();
    let (plan, how) = plan_auto(&small, &devices, &config(32, 4), true).unwrap();
    assert!(matches!(how, AutoPlacement::Estimated(NoProfile::TooShort { step_s }) if step_s < 2e-3), "{how:?}");
    assert_eq!(cuts(&plan), cuts(&pipeline_plan::plan(&small, &devices, &config(32, 4)).unwrap()));
    // Not allowed (several MPI ranks): the cost model's cut, untimed.
    let cnn = conveyor::zoo::cnn(0).unwrap();
    let (plan, how) = plan_auto(&cnn, &devices, &config(256, 4), false).unwrap();
    assert_eq!(how, AutoPlacement::Estimated(NoProfile::NotAllowed));
    let estimated = cuts(&pipeline_plan::plan(&cnn, &devices, &config(256, 4)).unwrap());
    assert_eq!(cuts(&plan), estimated);
    // The cost model counts bytes moved: the CNN's cut falls after conv2 (where timing puts it),
    // not after the pool, which left the second stage a tenth of the work.
    assert_eq!(estimated[0], ["conv1", "relu1", "conv2"], "{estimated:?}");
    // Allowed, and long enough: the layers are timed and both cuts priced by the profile; the
    // measured cut is used only when its slowest stage is at least 10% faster.
    let (plan, how) = plan_auto(&cnn, &devices, &config(256, 4), true).unwrap();
    let AutoPlacement::Profiled { estimated_cut_s, measured_cut_s, used_measured, profile_s } = how else {
        panic!("the CNN at 64-row micro-batches is timed: {how:?}")
    };
    assert!(estimated_cut_s > 0.0 && measured_cut_s > 0.0 && profile_s > 0.0, "{how:?}");
    assert_eq!(used_measured, measured_cut_s <= 0.9 * estimated_cut_s, "{how:?}");
    if !used_measured {
        assert_eq!(cuts(&plan), estimated);
    }
}
