//! The data-parallel all-reduce in buckets (`TrainerBuilder::bucket_size`): gradients handed to a
//! communication thread as soon as the step's last weight pass makes them final. Whatever the
//! bucket size (one node per bucket, a few KiB, DDP's 25 MiB) the losses, weights and optimizer
//! state are bit for bit those of the all-reduce at the optimizer step, on every schedule (zero
//! bubble ones defer the weight passes) and for three replicas (each tensor keeps its ring
//! nesting); two replicas of one micro-batch equal one device with two, bit for bit; the timeline
//! shows one all-reduce per bucket; a fault in one replica while buckets are in flight fails the
//! step everywhere with nothing changed, and the next step trains; workers sharing fewer core
//! slots than there are workers never wait in a sum holding a slot.
mod common;

use std::sync::Arc;

use common::{data, even_stages, weights};
use conveyor::Sequential;
use conveyor::engine::graph::Graph;
use conveyor::engine::optim::{OptimizerConfig, SgdConfig};
use conveyor::engine::runtime::{
    CoreSlotPolicy, DEFAULT_BUCKET_BYTES, FaultInjection, FaultPoint, StepReport, Trainer,
};
use conveyor::engine::{Device, Error};
use conveyor::layers::CrossEntropyLoss;
use conveyor::schedules::{OpKind, ScheduleKind};

const ROWS: usize = 24;

fn mlp() -> Graph {
    Sequential::new([10]).linear(16).relu().linear(16).relu().linear(12).relu().linear(4).build(5).unwrap()
}

/// Bucket sizes under test: at the optimizer step, one node per bucket, a few nodes, one bucket.
const SIZES: [Option<usize>; 4] = [None, Some(1), Some(1200), Some(DEFAULT_BUCKET_BYTES)];

struct Layout {
    replicas: usize,
    stages: usize,
    micro_batches: usize,
    schedule: ScheduleKind,
}

fn trainer(layout: &Layout, optimizer: OptimizerConfig, bucket_bytes: Option<usize>) -> Trainer {
    slotted(layout, optimizer, bucket_bytes, CoreSlotPolicy::Auto)
}

/// [`trainer`] with the workers' core slots as `slots` says.
fn slotted(layout: &Layout, optimizer: OptimizerConfig, bucket_bytes: Option<usize>, slots: CoreSlotPolicy) -> Trainer {
    let graph = mlp();
    let stage_nodes = even_stages(&graph, layout.stages);
    let chunks = if layout.schedule == ScheduleKind::Interleaved { 2 } else { 1 };
    let devices = layout.replicas * layout.stages / chunks;
    let builder = Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices((0..devices).map(Device::cpu).collect())
        .stages(stage_nodes)
        .schedule(layout.schedule, chunks)
        .micro_batches(layout.micro_batches)
        .optimizer(optimizer)
        .bucket_size(bucket_bytes)
        .core_slots(slots)
        .seed(11);
    let builder = if layout.replicas > 1 { builder.data_parallel(layout.replicas, |_, _| Ok(mlp())) } else { builder };
    builder.build().unwrap()
}

fn step(trainer: &mut Trainer, step: u64) -> StepReport {
    let (x, y) = data(ROWS, &[10], 4, step);
    trainer.train_step(&x, &y).unwrap()
}

fn state_bits(trainer: &Trainer) -> Vec<(String, Vec<u32>)> {
    let tensors = trainer.optimizer_state().unwrap();
    tensors.into_iter().map(|(n, t)| (n, t.to_vec_f32().iter().map(|v| v.to_bits()).collect())).collect()
}

/// What a run ends with: the losses' bits, the weights and the optimizer state's bits.
type Outcome = (Vec<u64>, Vec<(String, Vec<f32>)>, Vec<(String, Vec<u32>)>);

/// Trains `steps` steps.
fn run(trainer: &mut Trainer, steps: u64) -> Outcome {
    let losses = (0..steps).map(|s| step(trainer, s).loss.to_bits()).collect();
    (losses, weights(trainer), state_bits(trainer))
}

#[test]
fn every_bucket_size_trains_what_the_all_reduce_at_the_step_trains_bit_for_bit() {
    let adam = OptimizerConfig::adam(0.01);
    let momentum = OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.9));
    let layouts = [
        (Layout { replicas: 2, stages: 2, micro_batches: 2, schedule: ScheduleKind::OneFOneB }, adam),
        (Layout { replicas: 2, stages: 2, micro_batches: 3, schedule: ScheduleKind::ZbH1 }, adam),
        (Layout { replicas: 2, stages: 2, micro_batches: 2, schedule: ScheduleKind::GPipe }, momentum),
        (Layout { replicas: 2, stages: 4, micro_batches: 2, schedule: ScheduleKind::Interleaved }, adam),
        (Layout { replicas: 3, stages: 1, micro_batches: 2, schedule: ScheduleKind::OneFOneB }, momentum),
    ];
    for (layout, optimizer) in &layouts {
        let want = run(&mut trainer(layout, *optimizer, None), 3);
        for bytes in &SIZES[1..] {
            let mut bucketed = trainer(layout, *optimizer, *bytes);
            assert_eq!(bucketed.bucket_size(), *bytes);
            let got = run(&mut bucketed, 3);
            let what = format!("{:?} x{} replicas, buckets of {bytes:?}", layout.schedule, layout.replicas);
            assert_eq!(got.0, want.0, "{what}: losses");
            assert_eq!(got.1, want.1, "{what}: weights");
            assert_eq!(got.2, want.2, "{what}: optimizer state");
        }
    }
}

#[test]
fn two_replicas_with_buckets_equal_one_device_with_two_micro_batches_bit_for_bit() {
    let adam = OptimizerConfig::adam(0.01);
    let one = Layout { replicas: 1, stages: 1, micro_batches: 2, schedule: ScheduleKind::OneFOneB };
    let two = Layout { replicas: 2, stages: 1, micro_batches: 1, schedule: ScheduleKind::OneFOneB };
    let want = run(&mut trainer(&one, adam, None), 3);
    for bytes in SIZES {
        assert_eq!(run(&mut trainer(&two, adam, bytes), 3), want, "buckets of {bytes:?}");
    }
}

#[test]
fn the_timeline_shows_one_all_reduce_per_bucket() {
    // Two stages of two Linear layers each; per worker, per bucket size, the all-reduces.
    let layout = Layout { replicas: 2, stages: 2, micro_batches: 2, schedule: ScheduleKind::OneFOneB };
    // Stage 0: Linear(10,16) 704 bytes, Linear(16,16) 1088; stage 1: Linear(16,12) 816,
    // Linear(12,4) 208. Last node first; a bucket launches once it holds its size.
    for (bytes, per_device) in
        [(None, [1, 1]), (Some(1), [2, 2]), (Some(1000), [2, 1]), (Some(DEFAULT_BUCKET_BYTES), [1, 1])]
    {
        let mut trainer = trainer(&layout, OptimizerConfig::adam(0.01), bytes);
        let report = step(&mut trainer, 0);
        for (device, &want) in per_device.iter().enumerate() {
            let all_reduces: Vec<_> =
                report.timeline.events.iter().filter(|e| e.device_idx == device && e.op == OpKind::AllReduce).collect();
            assert_eq!(all_reduces.len(), want, "buckets of {bytes:?}, device {device}: {all_reduces:?}");
            assert!(all_reduces.iter().all(|e| e.end_s >= e.start_s && e.stage_idx == Some(device)));
            // Every bucket is summed before the optimizer step reads it.
            let optimizer =
                report.timeline.events.iter().find(|e| e.device_idx == device && e.op == OpKind::OptimizerStep);
            let optimizer = optimizer.expect("an optimizer step");
            assert!(all_reduces.iter().all(|e| e.end_s <= optimizer.start_s), "buckets of {bytes:?}: {all_reduces:?}");
        }
    }
}

#[test]
fn a_fault_while_buckets_are_in_flight_fails_the_step_everywhere_and_the_next_step_trains() {
    let layout = Layout { replicas: 2, stages: 2, micro_batches: 2, schedule: ScheduleKind::ZbH1 };
    let adam = OptimizerConfig::adam(0.01);
    for (at, micro_batch_idx, panic) in [
        (FaultPoint::Op(OpKind::BackwardWeight), 1, false),
        (FaultPoint::Op(OpKind::BackwardInput), 1, true),
        (FaultPoint::Prepare, 0, false),
        (FaultPoint::Apply, 0, false),
    ] {
        for faulty_replica in [0, 1] {
            let what = format!("{at:?} in replica {faulty_replica}");
            let mut trainer = trainer(&layout, adam, Some(1));
            step(&mut trainer, 0);
            let before = (weights(&trainer), state_bits(&trainer));
            // Stage 0's last weight pass: its own buckets and the other replica's are in flight.
            let fault = FaultInjection { stage_idx: 0, at, micro_batch_idx, panic };
            trainer.inject_fault_in_replica(Some(fault), faulty_replica);
            let (x, y) = data(ROWS, &[10], 4, 9);
            let started = std::time::Instant::now();
            let error = trainer.train_step(&x, &y).unwrap_err();
            assert!(started.elapsed().as_secs_f64() < 5.0, "{what}: the failed step took {:?}", started.elapsed());
            assert!(matches!(error, Error::StageFailed { stage_idx: 0, .. }), "{what}: {error}");
            assert_eq!((weights(&trainer), state_bits(&trainer)), before, "{what}: the state changed");
            trainer.inject_fault(None);
            // The gradients came back: the next steps train what a run without the fault trains.
            let mut reference = self::trainer(&layout, adam, Some(1));
            step(&mut reference, 0);
            for s in 1..3 {
                assert_eq!(step(&mut trainer, s).loss.to_bits(), step(&mut reference, s).loss.to_bits(), "{what}");
            }
            assert_eq!(weights(&trainer), weights(&reference), "{what}: weights after the next steps");
        }
    }
}

#[test]
fn replicas_sharing_fewer_core_slots_than_workers_train_what_they_train_without() {
    // 2 replicas x 2 stages on 2 slots: a worker waiting in the all-reduce (either way) must not
    // hold a slot the other replica's workers need to get there (this hung for the collective's
    // 60 s timeout before).
    let layout = Layout { replicas: 2, stages: 2, micro_batches: 4, schedule: ScheduleKind::OneFOneB };
    let adam = OptimizerConfig::adam(0.01);
    let want = run(&mut trainer(&layout, adam, None), 3);
    for bytes in [None, Some(1), Some(DEFAULT_BUCKET_BYTES)] {
        let started = std::time::Instant::now();
        let got = run(&mut slotted(&layout, adam, bytes, CoreSlotPolicy::Slots(2)), 3);
        assert!(started.elapsed().as_secs_f64() < 10.0, "buckets of {bytes:?}: {:?}", started.elapsed());
        assert_eq!(got, want, "buckets of {bytes:?} on 2 core slots");
    }
}
