//! `TrainerBuilder::placement`: manual, automatic (by memory and by time) and file placements
//! plan exactly what the planning functions plan, `TrainerBuilder::plan` is what `build` uses and
//! `Trainer::plan` keeps, and a trainer placed by names trains bit-for-bit like one given node ids.
use std::sync::Arc;

use conveyor::engine::graph::Graph;
use conveyor::engine::optim::{OptimizerConfig, SgdConfig};
use conveyor::engine::placement::{
    PlaceBy, Placement, Plan, place_manually_with_costs, place_with_costs, read_placement_file,
};
use conveyor::engine::runtime::{Recompute, Trainer, TrainerBuilder};
use conveyor::engine::{Device, Error, init};
use conveyor::layers::{CrossEntropyLoss, Linear, Relu};
use conveyor::pipeline::{
    PipelineConfig, build_trainer, build_trainer_with_plan, node_costs, plan, plan_manually, planner_inputs_for,
};
use conveyor::schedules::ScheduleKind;

mod common;

const BATCH_ROWS: usize = 16;

/// A five-layer MLP, seeded: 12 -> 48 -> 48 -> 6.
fn graph(seed: u64) -> Graph {
    let mut rng = init::rng(seed);
    let mut g = Graph::new();
    let x = g.input("x", [12]).unwrap();
    let h = g.add("fc1", Linear::new(12, 48, true, &mut rng).unwrap(), &[x]).unwrap();
    let h = g.add("relu1", Relu::new(), &[h]).unwrap();
    let h = g.add("fc2", Linear::new(48, 48, true, &mut rng).unwrap(), &[h]).unwrap();
    let h = g.add("relu2", Relu::new(), &[h]).unwrap();
    let y = g.add("fc3", Linear::new(48, 6, true, &mut rng).unwrap(), &[h]).unwrap();
    g.set_output(y).unwrap();
    g
}

fn config() -> PipelineConfig {
    PipelineConfig {
        schedule: ScheduleKind::OneFOneB,
        n_chunks: 1,
        n_micro_batches: 4,
        batch_rows: BATCH_ROWS,
        optimizer: OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.9)),
        recompute: Recompute::Never,
        seed: 11,
        core_slots: Default::default(),
        precision: Default::default(),
        weight_cache: Default::default(),
    }
}

/// A builder with `config()`'s settings on `devices`.
fn builder(graph: Graph, devices: &str) -> TrainerBuilder {
    let config = config();
    Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices(Device::parse_list(devices).unwrap())
        .schedule(config.schedule, config.n_chunks)
        .micro_batches(config.n_micro_batches)
        .optimizer(config.optimizer)
        .recompute(config.recompute)
        .seed(config.seed)
        .batch_rows(BATCH_ROWS)
}

/// Plans compare by every field they print (stages, memory, times, settings).
fn same(a: &Plan, b: &Plan) -> bool {
    format!("{a:?}") == format!("{b:?}")
}

fn manual_stages() -> Vec<Vec<String>> {
    vec![vec!["fc1..relu1".to_string()], vec!["fc2".to_string(), "relu2".to_string(), "fc3".to_string()]]
}

#[test]
fn each_placement_plans_what_the_planning_functions_plan() {
    let g = graph(1);
    let devices = Device::parse_list("cpu:2").unwrap();
    // What `pipeline::plan` and `plan_manually` computed before they moved: planner inputs from
    // the schedule, measured node memory, then the placement primitives.
    let (specs, plan_config) = planner_inputs_for(&devices, &config()).unwrap();
    let costs = node_costs(&g, plan_config.micro_batch_rows).unwrap();
    let by_hand = place_manually_with_costs(&g, &costs, &manual_stages(), &specs, &plan_config).unwrap();
    let by_memory = place_with_costs(&costs, &specs, &plan_config).unwrap();
    assert_eq!(plan_config.micro_batch_rows, BATCH_ROWS / 4);
    assert_eq!(by_hand.stages[0].node_names, ["fc1", "relu1"]);
    assert!(same(&plan_manually(&g, &manual_stages(), &devices, &config()).unwrap(), &by_hand));
    assert!(same(&plan(&g, &devices, &config()).unwrap(), &by_memory));

    let manual = builder(graph(1), "cpu:2").placement(Placement::Manual(manual_stages())).plan().unwrap();
    assert!(same(&manual, &by_hand), "Manual:\n{manual:?}\nagainst\n{by_hand:?}");
    let auto = builder(graph(1), "cpu:2").placement(Placement::auto()).plan().unwrap();
    assert!(same(&auto, &by_memory), "Auto by memory:\n{auto:?}\nagainst\n{by_memory:?}");

    // A placement file naming the same stages plans the same.
    let dir = std::env::temp_dir().join(format!("conveyor-placement-builder-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("placement.txt");
    std::fs::write(&path, "# stage 0\nfc1..relu1\nfc2 relu2 fc3 # the head\n").unwrap();
    let from_file = builder(graph(1), "cpu:2").placement(Placement::File(path.clone())).plan();
    let read_back = read_placement_file(&path);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(read_back.unwrap(), [vec!["fc1..relu1"], vec!["fc2", "relu2", "fc3"]]);
    assert!(same(&from_file.unwrap(), &by_hand));
}

#[test]
fn build_uses_and_keeps_the_plan_and_the_pipeline_functions_wrap_the_builder() {
    let planned = builder(graph(2), "cpu:2").placement(Placement::auto()).plan().unwrap();
    let trainer = builder(graph(2), "cpu:2").placement(Placement::auto()).build().unwrap();
    assert!(same(trainer.plan().unwrap(), &planned));

    let (plan, trainer) = build_trainer(graph(2), Device::parse_list("cpu:2").unwrap(), &config()).unwrap();
    assert!(same(&plan, &planned));
    assert!(same(trainer.plan().unwrap(), &planned));
    drop(trainer);
    let trainer = build_trainer_with_plan(graph(2), Device::parse_list("cpu:2").unwrap(), &plan, &config()).unwrap();
    assert!(same(trainer.plan().unwrap(), &planned));

    // Stages given as node ids are used unplanned.
    let g = graph(2);
    let ids = common::even_stages(&g, 2);
    let trainer = builder(g, "cpu:2").placement(Placement::Stages(ids)).build().unwrap();
    assert!(trainer.plan().is_none());
}

#[test]
fn placed_by_names_trains_bit_for_bit_like_node_ids() {
    let g = graph(3);
    let ids = vec![
        vec![g.find("fc1").unwrap(), g.find("relu1").unwrap()],
        vec![g.find("fc2").unwrap(), g.find("relu2").unwrap(), g.find("fc3").unwrap()],
    ];
    let mut by_ids = builder(g, "cpu:2").stages(ids.clone()).build().unwrap();
    let mut by_names = builder(graph(3), "cpu:2").placement(Placement::Manual(manual_stages())).build().unwrap();
    let plan = by_names.plan().unwrap();
    assert_eq!(plan.stages.iter().map(|s| s.nodes.clone()).collect::<Vec<_>>(), ids);
    for step in 0..3 {
        let (inputs, labels) = common::data(BATCH_ROWS, &[12], 6, step);
        let a = by_ids.train_step(&inputs, &labels).unwrap();
        let b = by_names.train_step(&inputs, &labels).unwrap();
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "step {step}");
    }
    let bits = |t: &Trainer| -> Vec<(String, Vec<u32>)> {
        common::weights(t).into_iter().map(|(n, v)| (n, v.iter().map(|x| x.to_bits()).collect())).collect()
    };
    assert_eq!(bits(&by_ids), bits(&by_names));
}

#[test]
fn placement_by_time_plans_every_layer_on_the_devices() {
    let trainer = builder(graph(4), "cpu:0-1").placement(Placement::Auto { by: PlaceBy::Time }).build().unwrap();
    let plan = trainer.plan().unwrap();
    assert_eq!(plan.stages.len(), 2);
    let placed: Vec<&str> = plan.stages.iter().flat_map(|s| s.node_names.iter().map(String::as_str)).collect();
    assert_eq!(placed, ["fc1", "relu1", "fc2", "relu2", "fc3"]);
}

#[test]
fn budgets_come_from_the_builders_devices() {
    let tight = builder(graph(5), "cpu:2").devices(Device::parse_list_with_budget("cpu:2", Some(4096)).unwrap());
    assert!(matches!(tight.placement(Placement::auto()).plan(), Err(Error::DoesNotFit { .. })));
    let roomy = builder(graph(5), "cpu:2").devices(Device::parse_list_with_budget("cpu:2", Some(1 << 30)).unwrap());
    let plan = roomy.placement(Placement::auto()).plan().unwrap();
    assert!(plan.devices.iter().all(|d| d.budget_bytes == Some(1 << 30)));
}

#[test]
fn misuse_is_an_error_that_says_what_to_do() {
    let message = |result: conveyor::engine::Result<Plan>| result.unwrap_err().to_string();
    let no_rows = Trainer::builder(graph(6), Arc::new(CrossEntropyLoss::new()))
        .devices(Device::parse_list("cpu:2").unwrap())
        .placement(Placement::auto());
    assert!(message(no_rows.plan()).contains(".batch_rows(rows)"));
    assert!(message(builder(graph(6), "cpu:2").plan()).contains("nothing to plan"));
    let unknown = builder(graph(6), "cpu:2").placement(Placement::Manual(vec![vec!["fc1".into()], vec!["fc9".into()]]));
    assert!(message(unknown.plan()).contains("fc9"));
    let missing = builder(graph(6), "cpu:2").placement(Placement::File("/no/such/placement.txt".into()));
    assert!(matches!(missing.plan(), Err(Error::Io { .. })));
    let g = graph(6);
    let ids = common::even_stages(&g, 2);
    let both = builder(g, "cpu:2").stages(ids).placement(Placement::auto()).build();
    assert!(both.err().unwrap().to_string().contains("give one"));
}
