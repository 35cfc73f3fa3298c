//! Data-parallel replicas in one process (`TrainerBuilder::data_parallel`): two replicas of one
//! device each train bit for bit what one device trains on the whole batch in two micro-batches;
//! replicas of pipelines and of tensor-parallel groups train what one pipeline trains (within
//! f32 rounding: the gradients are summed in another order); a fault in one replica fails the step
//! in every replica with no parameter changed, and the next step trains; parameters, checkpoints
//! and resumes go through replica 0 and reach every replica. With ZeRO-1 (optimizer state sharded
//! across the replicas) the weights and the optimizer state are bit for bit the unsharded ones,
//! with each replica holding part of the state. Unequal shares of the batch (fixed weights, or
//! measured throughput) train what one device trains on the whole batch.
mod common;

use std::sync::Arc;

use common::{data, even_stages, max_rel_diff, max_rel_diff_above, weights};
use conveyor::Sequential;
use conveyor::engine::graph::Graph;
use conveyor::engine::optim::{OptimizerConfig, SgdConfig};
use conveyor::engine::runtime::{AUTO_SHARE_STEPS, FaultInjection, FaultPoint, ReplicaShares, Trainer};
use conveyor::engine::{Device, Error};
use conveyor::layers::CrossEntropyLoss;
use conveyor::schedules::{OpKind, ScheduleKind};

const ROWS: usize = 24;

fn mlp() -> Graph {
    Sequential::new([10]).linear(16).relu().linear(16).relu().linear(12).relu().linear(4).build(5).unwrap()
}

fn optimizers() -> [OptimizerConfig; 2] {
    [OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.9)), OptimizerConfig::adam(0.01)]
}

/// `replicas` replicas of a pipeline of `stages` CPU devices, `micro_batches` each.
fn replicated(
    replicas: usize,
    stages: usize,
    micro_batches: usize,
    schedule: ScheduleKind,
    optimizer: OptimizerConfig,
) -> Trainer {
    resumed(replicas, stages, micro_batches, schedule, optimizer, None)
}

/// [`replicated`], resumed from a checkpoint when `path` is given.
fn resumed(
    replicas: usize,
    stages: usize,
    micro_batches: usize,
    schedule: ScheduleKind,
    optimizer: OptimizerConfig,
    path: Option<&std::path::Path>,
) -> Trainer {
    with_zero(replicas, stages, micro_batches, schedule, optimizer, path, 0)
}

/// [`resumed`] with ZeRO stage `zero`.
fn with_zero(
    replicas: usize,
    stages: usize,
    micro_batches: usize,
    schedule: ScheduleKind,
    optimizer: OptimizerConfig,
    path: Option<&std::path::Path>,
    zero: u8,
) -> Trainer {
    let graph = mlp();
    let stage_nodes = even_stages(&graph, stages);
    let builder = Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices((0..replicas * stages).map(Device::cpu).collect())
        .stages(stage_nodes)
        .schedule(schedule, 1)
        .micro_batches(micro_batches)
        .optimizer(optimizer)
        .zero(zero)
        .seed(11);
    let builder = if replicas > 1 { builder.data_parallel(replicas, |_, _| Ok(mlp())) } else { builder };
    let builder = match path {
        Some(path) => builder.resume(path),
        None => builder,
    };
    builder.build().unwrap()
}

fn train(trainer: &mut Trainer, steps: usize) -> Vec<f64> {
    (0..steps)
        .map(|step| {
            let (x, y) = data(ROWS, &[10], 4, step as u64);
            trainer.train_step(&x, &y).unwrap().loss
        })
        .collect()
}

fn bits(losses: &[f64]) -> Vec<u64> {
    losses.iter().map(|l| l.to_bits()).collect()
}

#[test]
fn two_replicas_equal_one_device_with_two_micro_batches_bit_for_bit() {
    for optimizer in optimizers() {
        let mut one = replicated(1, 1, 2, ScheduleKind::OneFOneB, optimizer);
        let mut two = replicated(2, 1, 1, ScheduleKind::OneFOneB, optimizer);
        assert_eq!(two.replicas(), 2);
        let (a, b) = (train(&mut one, 4), train(&mut two, 4));
        assert_eq!(bits(&a), bits(&b), "{optimizer:?}: losses {a:?} against {b:?}");
        assert_eq!(weights(&one), weights(&two), "{optimizer:?}: weights differ");
        // The optimizer state too: what a checkpoint holds.
        let state = |t: &Trainer| -> Vec<(String, Vec<u32>)> {
            let tensors = t.optimizer_state().unwrap();
            tensors.into_iter().map(|(n, t)| (n, t.to_vec_f32().iter().map(|v| v.to_bits()).collect())).collect()
        };
        assert_eq!(state(&one), state(&two), "{optimizer:?}: optimizer state differs");
    }
}

#[test]
fn replicated_pipelines_train_what_one_pipeline_trains() {
    // 2 replicas x 2 stages x 2 micro-batches against one 2-stage pipeline with 4 micro-batches:
    // the same samples in each micro-batch, the gradients summed in another order.
    for schedule in [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::ZbH2] {
        let optimizer = OptimizerConfig::adam(0.01);
        let mut one = replicated(1, 2, 4, schedule, optimizer);
        let mut two = replicated(2, 2, 2, schedule, optimizer);
        let (a, b) = (train(&mut one, 4), train(&mut two, 4));
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-6 * x.abs().max(1.0), "{schedule:?}: losses {a:?} against {b:?}");
        }
        // The gradients are summed in another order: rounding, except where a gradient cancels to
        // 0 in one order and not in the other, which Adam turns into up to lr·δ/(δ + eps) (up to
        // 3.4e-6 here): within 1e-5 in absolute terms below 1, relative above.
        let diff = max_rel_diff_above(&weights(&two), &weights(&one), 1.0);
        assert!(diff < 1e-5, "{schedule:?}: weights differ by {diff}");
    }
}

#[test]
fn a_fault_in_one_replica_fails_the_step_in_every_replica_and_the_next_step_trains() {
    for (at, panic) in [
        (FaultPoint::Op(OpKind::Forward), false),
        (FaultPoint::Op(OpKind::Backward), true),
        (FaultPoint::Prepare, false),
        (FaultPoint::Apply, false),
    ] {
        let mut trainer = replicated(2, 2, 2, ScheduleKind::OneFOneB, OptimizerConfig::adam(0.01));
        train(&mut trainer, 2);
        let before = weights(&trainer);
        let fault = FaultInjection { stage_idx: 1, at, micro_batch_idx: 1, panic };
        trainer.inject_fault_in_replica(Some(fault), 1);
        let (x, y) = data(ROWS, &[10], 4, 9);
        let started = std::time::Instant::now();
        let error = trainer.train_step(&x, &y).unwrap_err();
        assert!(started.elapsed().as_secs_f64() < 5.0, "{at:?}: the failed step took {:?}", started.elapsed());
        assert!(matches!(error, Error::StageFailed { stage_idx: 1, .. }), "{at:?}: {error}");
        assert_eq!(weights(&trainer), before, "{at:?}: a parameter changed");
        trainer.inject_fault(None);
        // Every replica trains on: the next step succeeds, and the replicas still agree (a step
        // on replica 0's parameters alone would give another loss than this reference's).
        let mut reference = replicated(2, 2, 2, ScheduleKind::OneFOneB, OptimizerConfig::adam(0.01));
        train(&mut reference, 2);
        let (x, y) = data(ROWS, &[10], 4, 3);
        let got = trainer.train_step(&x, &y).unwrap().loss;
        let want = reference.train_step(&x, &y).unwrap().loss;
        assert_eq!(got.to_bits(), want.to_bits(), "{at:?}: the step after the fault");
        assert_eq!(weights(&trainer), weights(&reference), "{at:?}: weights after the next step");
    }
}

/// A replica's worker that fails after its last backward but before its gradient bucket was
/// launched (buckets of 1 MiB and more hold this model's every gradient until the step's end) gives
/// the pending gradients back: the next step trains, and equals a run without the fault.
#[test]
fn an_abandoned_step_gives_back_the_gradients_of_a_bucket_not_yet_launched() {
    let build = || {
        let graph = mlp();
        let stage_nodes = even_stages(&graph, 2);
        Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
            .devices((0..4).map(Device::cpu).collect())
            .stages(stage_nodes)
            .schedule(ScheduleKind::OneFOneB, 1)
            .micro_batches(2)
            .optimizer(OptimizerConfig::adam(0.01))
            .bucket_size(Some(64 << 20))
            .seed(11)
            .data_parallel(2, |_, _| Ok(mlp()))
            .build()
            .unwrap()
    };
    let mut trainer = build();
    let mut reference = build();
    train(&mut trainer, 1);
    train(&mut reference, 1);
    // Stage 1's last op of the step is its backward of micro-batch 1, then the send of its input
    // gradient: failing that send leaves stage 1's final gradients in the pending bucket.
    let fault = FaultInjection { stage_idx: 1, at: FaultPoint::Send, micro_batch_idx: 1, panic: false };
    for replica in [0, 1] {
        trainer.inject_fault_in_replica(Some(fault), replica);
        let (x, y) = data(ROWS, &[10], 4, 9);
        assert!(trainer.train_step(&x, &y).is_err(), "replica {replica}: the fault did not strike");
        trainer.inject_fault(None);
        let (x, y) = data(ROWS, &[10], 4, 3 + replica as u64);
        let got = trainer.train_step(&x, &y).unwrap().loss;
        let want = reference.train_step(&x, &y).unwrap().loss;
        assert_eq!(got.to_bits(), want.to_bits(), "replica {replica}: the step after the abandoned one");
        assert_eq!(weights(&trainer), weights(&reference), "replica {replica}: weights");
    }
}

#[test]
fn parameters_load_and_checkpoints_reach_every_replica() {
    let dir = std::env::temp_dir().join(format!("conveyor-data-parallel-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("one.safetensors");
    // One device trains 2 steps and checkpoints; 2 replicas resume from it and train 2 more, as
    // one device does: the same bits (each replica took the parameters and optimizer state).
    let mut one = replicated(1, 1, 2, ScheduleKind::OneFOneB, OptimizerConfig::adam(0.01));
    train(&mut one, 2);
    one.checkpoint(&path).unwrap();
    let mut two = resumed(2, 1, 1, ScheduleKind::OneFOneB, OptimizerConfig::adam(0.01), Some(&path));
    let next = |t: &mut Trainer| -> Vec<f64> {
        (2..4)
            .map(|step| {
                let (x, y) = data(ROWS, &[10], 4, step);
                t.train_step(&x, &y).unwrap().loss
            })
            .collect()
    };
    let (a, b) = (next(&mut one), next(&mut two));
    assert_eq!(bits(&a), bits(&b));
    assert_eq!(weights(&one), weights(&two));
    // Predictions are every replica's rows in order.
    let (x, _) = data(ROWS, &[10], 4, 7);
    assert!(one.predict(&x).unwrap().bit_eq(&two.predict(&x).unwrap()));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn layouts_that_do_not_fit_are_refused() {
    let build = |devices: usize, replicas: usize| {
        Trainer::builder(mlp(), Arc::new(CrossEntropyLoss::new()))
            .devices((0..devices).map(Device::cpu).collect())
            .data_parallel(replicas, |_, _| Ok(mlp()))
            .build()
    };
    let error = build(3, 2).err().expect("3 devices for 2 replicas");
    assert!(error.to_string().contains("replicas"), "{error}");
    let error = build(2, 0).err().expect("0 replicas");
    assert!(error.to_string().contains("replicas"), "{error}");
    // A replica whose graph differs from replica 0's.
    let error = Trainer::builder(mlp(), Arc::new(CrossEntropyLoss::new()))
        .devices(vec![Device::cpu(0), Device::cpu(1)])
        .data_parallel(2, |_, _| Ok(Sequential::new([10]).linear(4).build(5).unwrap()))
        .build()
        .err()
        .expect("a different replica graph");
    assert!(error.to_string().contains("differs from replica 0"), "{error}");
    // Too few rows for every replica's micro-batches.
    let mut two = replicated(2, 1, 2, ScheduleKind::OneFOneB, OptimizerConfig::adam(0.01));
    let (x, y) = data(3, &[10], 4, 0);
    let error = two.train_step(&x, &y).unwrap_err();
    assert!(error.to_string().contains("replicas"), "{error}");
}

/// Every optimizer-state tensor, sorted by name, as bits.
fn state_bits(trainer: &Trainer) -> Vec<(String, Vec<u32>)> {
    let mut tensors = trainer.optimizer_state().unwrap();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    tensors.into_iter().map(|(n, t)| (n, t.to_vec_f32().iter().map(|v| v.to_bits()).collect())).collect()
}

#[test]
fn zero_one_trains_what_unsharded_replicas_train_with_part_of_the_state_on_each() {
    for optimizer in optimizers() {
        for stages in [1, 2] {
            let mut plain = with_zero(2, stages, 2, ScheduleKind::OneFOneB, optimizer, None, 0);
            let mut sharded = with_zero(2, stages, 2, ScheduleKind::OneFOneB, optimizer, None, 1);
            assert_eq!((plain.zero(), sharded.zero()), (0, 1));
            let (a, b) = (train(&mut plain, 4), train(&mut sharded, 4));
            assert_eq!(bits(&a), bits(&b), "{optimizer:?}, {stages} stages: losses");
            assert_eq!(weights(&plain), weights(&sharded), "{optimizer:?}, {stages} stages: weights");
            assert_eq!(state_bits(&plain), state_bits(&sharded), "{optimizer:?}, {stages} stages: state");
            // Optimizer state bytes per stage, replica 0's stages first: every layer's state is
            // kept once over the replicas, and neither replica keeps all of it.
            let bytes = |t: &Trainer| t.with_optimizers(|o, _| o.state_size_in_bytes()).unwrap();
            let (whole, parts) = (bytes(&plain), bytes(&sharded));
            let per_replica = |v: &[usize]| -> Vec<usize> { v.chunks(stages).map(|c| c.iter().sum()).collect() };
            let (whole, parts) = (per_replica(&whole), per_replica(&parts));
            assert_eq!(whole[0], whole[1], "unsharded replicas hold the same state");
            assert_eq!(parts.iter().sum::<usize>(), whole[0], "{optimizer:?}: sharded {parts:?}, unsharded {whole:?}");
            assert!(parts.iter().all(|&p| p < whole[0]), "{optimizer:?}: sharded {parts:?}, unsharded {whole:?}");
        }
    }
}

#[test]
fn zero_one_rolls_back_a_failed_apply_and_resumes_from_a_checkpoint() {
    let adam = OptimizerConfig::adam(0.01);
    let mut trainer = with_zero(2, 2, 2, ScheduleKind::OneFOneB, adam, None, 1);
    train(&mut trainer, 2);
    let (before, state) = (weights(&trainer), state_bits(&trainer));
    // Replica 1 fails while applying: replica 0 has applied and broadcast nothing yet, or waits.
    let fault = FaultInjection { stage_idx: 0, at: FaultPoint::Apply, micro_batch_idx: 0, panic: false };
    trainer.inject_fault_in_replica(Some(fault), 1);
    let (x, y) = data(ROWS, &[10], 4, 9);
    assert!(trainer.train_step(&x, &y).is_err());
    trainer.inject_fault(None);
    assert_eq!(weights(&trainer), before, "a parameter changed");
    assert_eq!(state_bits(&trainer), state, "optimizer state changed");
    // A checkpoint of the sharded replicas resumes one device, and the other way round.
    let dir = std::env::temp_dir().join(format!("conveyor-zero-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sharded.safetensors");
    trainer.checkpoint(&path).unwrap();
    let mut one = resumed(1, 1, 4, ScheduleKind::OneFOneB, adam, Some(&path));
    let mut again = with_zero(2, 2, 2, ScheduleKind::OneFOneB, adam, Some(&path), 1);
    let mut reference = with_zero(2, 2, 2, ScheduleKind::OneFOneB, adam, None, 0);
    train(&mut reference, 2);
    for step in 3..5 {
        let (x, y) = data(ROWS, &[10], 4, step);
        let losses: Vec<f64> =
            [&mut trainer, &mut again, &mut reference].map(|t| t.train_step(&x, &y).unwrap().loss).to_vec();
        assert_eq!(bits(&losses[..1]), bits(&losses[1..2]), "resumed sharded replicas");
        assert_eq!(bits(&losses[..1]), bits(&losses[2..]), "unsharded replicas");
        one.train_step(&x, &y).unwrap();
    }
    assert_eq!(weights(&trainer), weights(&again));
    assert_eq!(weights(&trainer), weights(&reference));
    let diff = max_rel_diff(&weights(&one), &weights(&trainer));
    assert!(diff < 1e-5, "one device resumed from the sharded checkpoint: {diff}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Two one-device replicas sharing each batch by `shares`, `micro_batches` each.
fn shared(shares: ReplicaShares, micro_batches: usize, optimizer: OptimizerConfig) -> Trainer {
    let graph = mlp();
    let stage_nodes = even_stages(&graph, 1);
    Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices(vec![Device::cpu(0), Device::cpu(1)])
        .stages(stage_nodes)
        .micro_batches(micro_batches)
        .optimizer(optimizer)
        .seed(11)
        .data_parallel(2, |_, _| Ok(mlp()))
        .replica_shares(shares)
        .build()
        .unwrap()
}

#[test]
fn unequal_replica_shares_train_what_one_device_trains_on_the_whole_batch() {
    // 3:1 gives 18 and 6 of 24 rows: each replica's losses are still divided by all 24 rows, so
    // the summed gradient is the whole batch's.
    for optimizer in optimizers() {
        let mut one = replicated(1, 1, 1, ScheduleKind::OneFOneB, optimizer);
        let mut uneven = shared(ReplicaShares::Weights(vec![3.0, 1.0]), 2, optimizer);
        assert_eq!(uneven.replica_fractions(), vec![0.75, 0.25]);
        let (a, b) = (train(&mut one, 4), train(&mut uneven, 4));
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-6 * x.abs().max(1.0), "{optimizer:?}: losses {a:?} against {b:?}");
        }
        // Summed in another order: as in `replicated_pipelines_train_what_one_pipeline_trains`.
        let diff = max_rel_diff_above(&weights(&uneven), &weights(&one), 1.0);
        assert!(diff < 1e-5, "{optimizer:?}: weights differ by {diff}");
    }
    // A share smaller than the micro-batch count is refused at the step, naming the replica.
    let mut short = shared(ReplicaShares::Weights(vec![20.0, 1.0]), 2, OptimizerConfig::adam(0.01));
    let (x, y) = data(ROWS, &[10], 4, 0);
    let error = short.train_step(&x, &y).unwrap_err().to_string();
    assert!(error.contains("replica 1's share of 24 rows is 1 rows, fewer than its 2 micro-batches"), "{error}");
    // One weight per replica.
    let graph = mlp();
    let refused = Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices(vec![Device::cpu(0), Device::cpu(1)])
        .data_parallel(2, |_, _| Ok(mlp()))
        .replica_shares(ReplicaShares::Weights(vec![1.0, 2.0, 3.0]))
        .build()
        .err()
        .expect("three weights for two replicas")
        .to_string();
    assert!(refused.contains("3 weights for 2 replicas"), "{refused}");
}

#[test]
fn auto_shares_are_measured_over_the_first_steps_then_fixed() {
    // SGD: the measured shares depend on timing, so the sums group differently from run to run,
    // and Adam's step on a gradient of rounding size is as large as on any other.
    let optimizer = OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.9));
    let mut one = replicated(1, 1, 1, ScheduleKind::OneFOneB, optimizer);
    let mut auto = shared(ReplicaShares::Auto, 2, optimizer);
    assert_eq!(auto.replica_fractions(), vec![0.5, 0.5], "even until something is measured");
    let steps = AUTO_SHARE_STEPS + 2;
    let mut fractions = Vec::new();
    let (a, b) = (train(&mut one, steps), {
        (0..steps)
            .map(|step| {
                let (x, y) = data(ROWS, &[10], 4, step as u64);
                let loss = auto.train_step(&x, &y).unwrap().loss;
                fractions.push(auto.replica_fractions());
                loss
            })
            .collect::<Vec<f64>>()
    });
    assert!(!auto.replica_shares_measuring());
    // Whatever was measured: fractions of the batch, and fixed after the measured steps.
    for f in &fractions {
        assert!((f.iter().sum::<f64>() - 1.0).abs() < 1e-12 && f.iter().all(|&x| x > 0.0), "{f:?}");
    }
    assert_eq!(fractions[AUTO_SHARE_STEPS - 1], fractions[steps - 1], "{fractions:?}");
    // And any shares train the whole batch's gradient.
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-6 * x.abs().max(1.0), "losses {a:?} against {b:?}");
    }
    let diff = max_rel_diff(&weights(&auto), &weights(&one));
    assert!(diff < 1e-5, "weights differ by {diff} (relative)");
}

#[test]
fn two_replicas_equal_one_device_bit_for_bit_for_every_zoo_model() {
    // Every layer sums a micro-batch's gradient on its own before adding it to the accumulated
    // one, so a replica's micro-batch meets the other's only in the all-reduce, as on one device.
    use conveyor::zoo::ModelSpec;
    for (spec, rows, features, classes) in [
        ("cnn", 16, vec![1, 8, 8], 10),
        ("resnet", 16, vec![1, 8, 8], 10),
        ("transformer:8,4,16,2,2,8", 16, vec![4], 8),
        ("transformer:8,4,16,2,2,8,tied", 16, vec![4], 8),
    ] {
        let model: ModelSpec = spec.parse().unwrap();
        let build = |replicas: usize, micro_batches: usize| {
            let graph = model.build(3).unwrap();
            let stages = even_stages(&graph, 1);
            let builder = Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
                .devices((0..replicas).map(Device::cpu).collect())
                .stages(stages)
                .micro_batches(micro_batches)
                .optimizer(OptimizerConfig::adam(0.01))
                .seed(11);
            let model = model.clone();
            match replicas {
                1 => builder,
                r => builder.data_parallel(r, move |_, _| model.build(3)),
            }
            .build()
            .unwrap()
        };
        let (mut one, mut two) = (build(1, 2), build(2, 1));
        for step in 0..3 {
            let (x, y) = data(rows, &features, classes, step);
            // Token ids for the transformer: integers in 0..8.
            let x = if spec.starts_with("transformer") {
                let ids: Vec<f32> = x.to_vec_f32().iter().map(|v| ((v + 1.0) * 3.99).floor()).collect();
                conveyor::engine::Tensor::from_vec(ids, x.dims().to_vec(), &Device::host()).unwrap()
            } else {
                x
            };
            let (a, b) = (one.train_step(&x, &y).unwrap().loss, two.train_step(&x, &y).unwrap().loss);
            assert_eq!(a.to_bits(), b.to_bits(), "{spec}, step {step}: losses {a} against {b}");
        }
        assert!(weights(&one) == weights(&two), "{spec}: weights differ");
    }
}

#[test]
fn two_replicas_equal_one_device_bit_for_bit_past_the_gemm_depth_block() {
    // 600 rows per micro-batch: a weight gradient deeper than the GEMM's depth block, which the
    // kernel adds to the accumulated gradient whole (`cpu::gemm::GEMM_DEPTH_BLOCK`).
    let rows = 2 * (conveyor::engine::cpu::gemm::GEMM_DEPTH_BLOCK + 88);
    let optimizer = OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.9));
    let (mut one, mut two) = (
        replicated(1, 1, 2, ScheduleKind::OneFOneB, optimizer),
        replicated(2, 1, 1, ScheduleKind::OneFOneB, optimizer),
    );
    for step in 0..3 {
        let (x, y) = data(rows, &[10], 4, step);
        let (a, b) = (one.train_step(&x, &y).unwrap().loss, two.train_step(&x, &y).unwrap().loss);
        assert_eq!(a.to_bits(), b.to_bits(), "step {step}");
    }
    assert!(weights(&one) == weights(&two), "weights differ");
}
