//! Tensor parallelism composed with the pipeline: stages that each hold a group of `k` CPU
//! devices, with their Linear and Conv2d layers split over the group, train the same weights as
//! one device; a layer too large for one device's budget trains split, every device under its
//! budget; checkpoints carry the unsplit tensors under the unsplit names and load back.
//!
//! Tolerance: a split layer sums the same products in another order (per-shard partial sums, then
//! the ring's order), so after a few SGD steps each weight differs from one device's by f32
//! rounding only. We use the formula of `tests/pipeline_equivalence.rs`: the largest
//! `|a - b| / max(|b|, 1e-3)` over all weights must be at most 1e-5.
mod common;

use std::sync::Arc;

use common::{data, even_stages, max_rel_diff, trainer, weights};
use conveyor::engine::optim::{OptimizerConfig, SgdConfig};
use conveyor::engine::runtime::{Recompute, Trainer};
use conveyor::engine::{Device, Error};
use conveyor::layers::CrossEntropyLoss;
use conveyor::pipeline::{PipelineConfig, build_trainer, build_trainer_tensor_parallel};
use conveyor::schedules::ScheduleKind;
use conveyor::zoo::{ModelSpec, TensorParallelSplits};

const STEPS: usize = 3;
const RELATIVE: f32 = 1e-5;
const MICRO_BATCHES: usize = 4;

fn optimizer() -> OptimizerConfig {
    OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.9))
}

/// `n_stages` stages of `k` devices each over `spec`, every layer split over its stage's group.
fn split_trainer(spec: &ModelSpec, n_stages: usize, k: usize, kind: ScheduleKind) -> Trainer {
    common::split_trainer(spec, n_stages, k, kind, MICRO_BATCHES, optimizer())
}

fn train(trainer: &mut Trainer, spec: &ModelSpec) -> Vec<(String, Vec<f32>)> {
    for step in 0..STEPS {
        let (x, y) = data(16, &spec.input_shape(), 10, step as u64);
        let report = trainer.train_step(&x, &y).unwrap();
        assert_eq!(report.peak_memory.len(), trainer.devices().len(), "a peak for every device of every group");
        assert!(report.peak_memory.iter().all(|&p| p > 0), "every device holds shards: {:?}", report.peak_memory);
    }
    weights(trainer)
}

fn one_device(spec: &ModelSpec) -> Vec<(String, Vec<f32>)> {
    let mut t = trainer(spec.build(3).unwrap(), 1, ScheduleKind::GPipe, 1, MICRO_BATCHES, Recompute::Never);
    train(&mut t, spec)
}

fn config(kind: ScheduleKind) -> PipelineConfig {
    PipelineConfig {
        schedule: kind,
        n_chunks: 1,
        n_micro_batches: MICRO_BATCHES,
        batch_rows: 16,
        optimizer: optimizer(),
        recompute: Recompute::Never,
        seed: 11,
        core_slots: Default::default(),
        precision: Default::default(),
        weight_cache: Default::default(),
    }
}

/// `--stages 2 --tensor-parallel 2` on cpu:4, by hand-cut stages and through the planner.
fn check_two_stages_two_way(spec: &ModelSpec) {
    let reference = one_device(spec);
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        let split = train(&mut split_trainer(spec, 2, 2, kind), spec);
        let rel = max_rel_diff(&split, &reference);
        assert!(rel <= RELATIVE, "{kind}, 2 stages x 2 devices: weights differ from one device by {rel}");

        let devices: Vec<Device> = (0..4).map(Device::cpu).collect();
        let (plan, mut planned) = build_trainer_tensor_parallel(spec, 3, devices, 2, &config(kind)).unwrap();
        assert_eq!(plan.stages.len(), 2);
        assert_eq!(planned.device_groups().len(), 2);
        let rel = max_rel_diff(&train(&mut planned, spec), &reference);
        assert!(rel <= RELATIVE, "{kind}, planned 2 x 2: weights differ from one device by {rel}");
    }
}

#[test]
fn mlp_column_row_pairs_on_two_stages_of_two_devices_train_like_one_device() {
    check_two_stages_two_way(&ModelSpec::Mlp(vec![12, 32, 32, 32, 10]));
}

#[test]
fn channel_split_conv_stack_on_two_stages_of_two_devices_trains_like_one_device() {
    check_two_stages_two_way(&ModelSpec::Cnn);
}

#[test]
fn checkpoints_carry_unsplit_tensors_under_unsplit_names_and_load_back() {
    let spec = ModelSpec::Mlp(vec![12, 32, 32, 10]);
    let mut split = split_trainer(&spec, 2, 2, ScheduleKind::OneFOneB);
    train(&mut split, &spec);
    let saved = split.parameters().unwrap();
    let single = trainer(spec.build(3).unwrap(), 1, ScheduleKind::GPipe, 1, 1, Recompute::Never);
    let expected: Vec<(String, Vec<usize>)> =
        single.parameters().unwrap().into_iter().map(|(n, t)| (n, t.dims().to_vec())).collect();
    let names: Vec<(String, Vec<usize>)> = saved.iter().map(|(n, t)| (n.clone(), t.dims().to_vec())).collect();
    assert_eq!(names, expected, "unsplit names and shapes, in graph order");
    assert_eq!(split.parameter_names(), single.parameter_names());

    // Through a safetensors file, into a fresh split trainer and into one device.
    let dir = std::env::temp_dir().join(format!("conveyor-tp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("split.safetensors");
    let refs: Vec<(&str, &conveyor::engine::Tensor)> = saved.iter().map(|(n, t)| (n.as_str(), t)).collect();
    conveyor::engine::checkpoint::save(&path, &refs).unwrap();
    let loaded: Vec<_> =
        conveyor::engine::checkpoint::load(&path, &Device::host()).unwrap().into_tensors().into_iter().collect();
    std::fs::remove_dir_all(&dir).unwrap();

    let mut fresh_split = split_trainer(&spec, 2, 2, ScheduleKind::GPipe);
    let copy = loaded.iter().map(|(n, t)| (n.clone(), t.try_clone().unwrap())).collect();
    fresh_split.load_parameters(copy).unwrap();
    let round_trip = fresh_split.parameters().unwrap();
    assert!(round_trip.iter().zip(&saved).all(|((na, a), (nb, b))| na == nb && a.bit_eq(b)), "bit-exact round trip");

    let mut fresh_single = trainer(spec.build(3).unwrap(), 1, ScheduleKind::GPipe, 1, 1, Recompute::Never);
    fresh_single.load_parameters(loaded).unwrap();
    let (x, _) = data(10, &[12], 10, 9);
    let (a, b) = (fresh_split.predict(&x).unwrap().to_vec_f32(), fresh_single.predict(&x).unwrap().to_vec_f32());
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(a.iter().zip(&b).all(|(p, q)| (p - q).abs() <= RELATIVE * scale), "split and whole predictions agree");

    // A wrong shape names the unsplit parameter.
    let bad = vec![(
        "0.weight".to_string(),
        conveyor::engine::Tensor::zeros([3, 3], conveyor::engine::DType::F32, &Device::host()).unwrap(),
    )];
    let err = fresh_split.load_parameters(bad).unwrap_err();
    assert!(err.to_string().contains("parameter `0.weight`"), "{err}");
}

/// `mlp:64,1024,10`: the first Linear's weight and bias (260 KiB) exceed a 256 KiB device budget.
/// One device per stage cannot hold it (the planner says to split it); two stages of four devices
/// train it with every device under budget.
#[test]
fn a_layer_larger_than_one_device_trains_split_with_every_device_under_budget() {
    const BUDGET: u64 = 256 * 1024;
    let spec = ModelSpec::Mlp(vec![64, 1024, 10]);
    let weight_bytes = (64 * 1024 + 1024) * 4;
    assert!(weight_bytes > BUDGET);
    let budgeted = |n: usize| (0..n).map(|i| Device::cpu_with_budget(i, Some(BUDGET))).collect::<Vec<Device>>();
    let sgd = PipelineConfig { optimizer: OptimizerConfig::sgd(0.05), ..config(ScheduleKind::OneFOneB) };

    let err = build_trainer(spec.build(3).unwrap(), budgeted(2), &sgd).err().expect("does not fit");
    assert!(matches!(err, Error::DoesNotFit { .. }), "{err}");
    assert!(err.to_string().contains("tensor parallelism"), "{err}");

    let (_, mut split) = build_trainer_tensor_parallel(&spec, 3, budgeted(8), 4, &sgd).unwrap();
    let mut losses = Vec::new();
    let (x, y) = data(16, &[64], 10, 0);
    for step in 0..4 {
        let report = split.train_step(&x, &y).unwrap();
        losses.push(report.loss);
        for (device, peak) in split.devices().iter().zip(&report.peak_memory) {
            assert!(*peak <= BUDGET, "{device}: peak {peak} over budget {BUDGET}");
        }
        if step == 3 {
            let figures: Vec<String> = split
                .devices()
                .iter()
                .zip(&report.peak_memory)
                .map(|(d, p)| format!("{d} {:.1} KiB", *p as f64 / 1024.0))
                .collect();
            println!(
                "layer {:.1} KiB, budget {:.1} KiB per device; peaks: {}",
                weight_bytes as f64 / 1024.0,
                BUDGET as f64 / 1024.0,
                figures.join(", ")
            );
        }
    }
    assert!(losses[3] < losses[0], "the loss on a repeated batch falls: {losses:?}");
}

#[test]
fn a_split_layer_outside_its_stage_group_is_refused() {
    let spec = ModelSpec::Mlp(vec![12, 16, 10]);
    let devices: Vec<Device> = (0..4).map(Device::cpu).collect();
    // Every layer split over the second group, but stage 0 runs on the first.
    let splits: TensorParallelSplits = ["0", "2"].iter().map(|n| (n.to_string(), devices[2..].to_vec())).collect();
    let graph = spec.build_split(3, &splits).unwrap();
    let stages = even_stages(&graph, 2);
    let err = Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices(devices.clone())
        .tensor_parallel(2)
        .stages(stages)
        .schedule(ScheduleKind::GPipe, 1)
        .build()
        .err()
        .expect("refused");
    assert!(err.to_string().contains("a tensor-parallel layer's shards stay on cpu:2, cpu:3"), "{err}");

    let err = Trainer::builder(spec.build(3).unwrap(), Arc::new(CrossEntropyLoss::new()))
        .devices(devices[..3].to_vec())
        .tensor_parallel(2)
        .build()
        .err()
        .expect("refused");
    assert!(err.to_string().contains("whole number of groups"), "{err}");
}

/// Megatron's fused pair (`ParallelMlp`: one all-reduce forward, one backward) as a pipeline
/// stage, then a column-parallel head on the second stage, against the unsplit modules
/// `mlp.fc1`, `mlp.act`, `mlp.fc2`, `head` on one device: same names, same weights.
#[test]
fn megatron_mlp_stage_then_split_head_trains_like_one_device() {
    use conveyor::engine::graph::Graph;
    use conveyor::engine::init;
    use conveyor::layers::{ColumnParallelLinear, Linear, MlpActivation, ParallelMlp, Relu};

    let whole = || {
        let mut rng = init::rng(5);
        let mut g = Graph::new();
        let x = g.input("input", [12]).unwrap();
        let x = g.add("mlp.fc1", Linear::new(12, 32, true, &mut rng).unwrap(), &[x]).unwrap();
        let x = g.add("mlp.act", Relu::new(), &[x]).unwrap();
        let x = g.add("mlp.fc2", Linear::new(32, 12, true, &mut rng).unwrap(), &[x]).unwrap();
        let x = g.add("head", Linear::new(12, 10, true, &mut rng).unwrap(), &[x]).unwrap();
        g.set_output(x).unwrap();
        g
    };
    // Layers move into their trainer, so each run builds its own split graph.
    let split_graph = |devices: &[Device]| {
        let mut rng = init::rng(5);
        let mut g = Graph::new();
        let x = g.input("input", [12]).unwrap();
        let mlp = ParallelMlp::new(12, 32, 12, true, MlpActivation::Relu, &devices[..2], &mut rng).unwrap();
        let mlp = g.add("mlp", mlp, &[x]).unwrap();
        let head = ColumnParallelLinear::new(12, 10, true, &devices[2..], &mut rng).unwrap();
        let head = g.add("head", head, &[mlp]).unwrap();
        g.set_output(head).unwrap();
        (g, vec![vec![mlp], vec![head]])
    };
    let spec = ModelSpec::Mlp(vec![12, 10]);
    let mut one = trainer(whole(), 1, ScheduleKind::GPipe, 1, MICRO_BATCHES, Recompute::Never);
    let reference = train(&mut one, &spec);
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        let devices: Vec<Device> = (0..4).map(Device::cpu).collect();
        let (graph, stages) = split_graph(&devices);
        let mut split = Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
            .devices(devices)
            .tensor_parallel(2)
            .stages(stages)
            .schedule(kind, 1)
            .micro_batches(MICRO_BATCHES)
            .optimizer(optimizer())
            .seed(11)
            .build()
            .unwrap();
        let rel = max_rel_diff(&train(&mut split, &spec), &reference);
        assert!(rel <= RELATIVE, "{kind}: Megatron pair differs from one device by {rel}");
    }
}
