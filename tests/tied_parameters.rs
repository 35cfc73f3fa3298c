//! Tied parameters (`Graph::tie`, `TrainerBuilder::tie_parameters`): the zoo transformer with its
//! output projection tied to its token embedding (`transformer:...,tied`) takes, on one device,
//! the step PyTorch's rule gives (the copies' gradients summed: checked against the untied
//! model's two gradients); every schedule on two and four devices trains bit for bit what one
//! device trains, and so do two data-parallel replicas, the copies equal throughout; a
//! fault while the copies' gradients are summed fails the step with nothing changed and the next
//! step trains; ties that cannot hold are refused, and loading keeps the copies one parameter.
mod common;

use std::sync::Arc;

use common::{SCHEDULES, even_stages, weights};
use conveyor::engine::graph::Graph;
use conveyor::engine::optim::{OptimizerConfig, SgdConfig};
use conveyor::engine::runtime::{FaultInjection, FaultPoint, Recompute, Trainer, TrainerBuilder};
use conveyor::engine::{Device, Error, Tensor};
use conveyor::layers::CrossEntropyLoss;
use conveyor::schedules::ScheduleKind;
use conveyor::zoo::ModelSpec;

/// 8 token ids, 4 tokens, width 16, 2 heads, 2 blocks, 8 classes: the head [8, 16] is the
/// embedding's shape.
const TIED: &str = "transformer:8,4,16,2,2,8,tied";
const UNTIED: &str = "transformer:8,4,16,2,2,8";
const ROWS: usize = 16;

fn graph(spec: &str) -> Graph {
    spec.parse::<ModelSpec>().unwrap().build(3).unwrap()
}

/// Seeded token ids `[rows, 4]` in `0..8` and labels in `0..8`.
fn tokens(step: u64) -> (Tensor, Vec<usize>) {
    let mut state = step.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(7);
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % 8) as usize
    };
    let ids: Vec<usize> = (0..ROWS * 4).map(|_| next()).collect();
    let labels = ids.chunks(4).map(|row| (row[0] + row[3]) % 8).collect();
    (Tensor::from_vec(ids.iter().map(|&i| i as f32).collect(), [ROWS, 4], &Device::host()).unwrap(), labels)
}

fn builder(
    graph: Graph,
    devices: usize,
    schedule: ScheduleKind,
    chunks: usize,
    micro_batches: usize,
) -> TrainerBuilder {
    let stages = even_stages(&graph, devices * chunks);
    Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices((0..devices).map(Device::cpu).collect())
        .stages(stages)
        .schedule(schedule, chunks)
        .micro_batches(micro_batches)
        .optimizer(OptimizerConfig::adam(0.01))
        .recompute(Recompute::Never)
        .seed(11)
}

fn train(trainer: &mut Trainer, steps: u64) -> Vec<u64> {
    (0..steps)
        .map(|step| {
            let (x, y) = tokens(step);
            trainer.train_step(&x, &y).unwrap().loss.to_bits()
        })
        .collect()
}

fn param(trainer: &Trainer, name: &str) -> Vec<f32> {
    weights(trainer).into_iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no {name}")).1
}

#[test]
fn a_tied_step_sums_the_copies_gradients() {
    // One SGD step without momentum: untied, each copy moves by its own gradient; tied, both move
    // by the sum. So tied = untied embed + untied head - start, to rounding.
    let sgd = OptimizerConfig::Sgd(SgdConfig::new(0.1));
    let mut untied = builder(graph(UNTIED), 1, ScheduleKind::OneFOneB, 1, 1).optimizer(sgd).build().unwrap();
    let start = param(&untied, "embed.weight");
    untied
        .load_parameters(vec![(
            "head.weight".into(),
            Tensor::from_vec(start.clone(), [8, 16], &Device::host()).unwrap(),
        )])
        .unwrap();
    let mut tied = builder(graph(TIED), 1, ScheduleKind::OneFOneB, 1, 1).optimizer(sgd).build().unwrap();
    assert_eq!(param(&tied, "head.weight"), start, "the copies start with the embedding's values");
    let (x, y) = tokens(0);
    let a = untied.train_step(&x, &y).unwrap();
    let b = tied.train_step(&x, &y).unwrap();
    assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "the same model before the step");
    let (embed, head) = (param(&untied, "embed.weight"), param(&untied, "head.weight"));
    let expected: Vec<f32> = embed.iter().zip(&head).zip(&start).map(|((e, h), s)| e + h - s).collect();
    for name in ["embed.weight", "head.weight"] {
        let got = param(&tied, name);
        let worst = got.iter().zip(&expected).map(|(g, e)| (g - e).abs()).fold(0.0f32, f32::max);
        assert!(worst < 1e-6, "{name}: off by {worst}");
    }
    assert_eq!(param(&tied, "embed.weight"), param(&tied, "head.weight"), "the copies stay one parameter");
    // The norm counts the parameter once: the untied model's norm has both gradients apart.
    assert!(b.grad_norm < a.grad_norm * 1.5 && b.grad_norm > 0.0);
}

#[test]
fn tied_pipelines_and_replicas_train_what_one_device_trains() {
    let mut one = builder(graph(TIED), 1, ScheduleKind::OneFOneB, 1, 4).build().unwrap();
    let reference = train(&mut one, 3);
    let want = weights(&one);
    assert_eq!(param(&one, "embed.weight"), param(&one, "head.weight"));
    for devices in [2, 4] {
        for (schedule, chunks) in SCHEDULES {
            let mut piped = builder(graph(TIED), devices, schedule, chunks, 4).build().unwrap();
            assert_eq!(train(&mut piped, 3), reference, "{schedule:?} on {devices}: losses");
            assert!(weights(&piped) == want, "{schedule:?} on {devices} devices: weights differ from one device's");
        }
    }
    // Two replicas of a 2-stage pipeline, one micro-batch each, against one device with two
    // micro-batches (the same sums in the same order): the replicas' sums, then the copies'.
    let mut one = builder(graph(TIED), 1, ScheduleKind::OneFOneB, 1, 2).build().unwrap();
    let reference = train(&mut one, 3);
    let mut replicated = builder(graph(TIED), 4, ScheduleKind::OneFOneB, 1, 1)
        .stages(even_stages(&graph(TIED), 2))
        .data_parallel(2, |_, _| Ok(graph(TIED)))
        .build()
        .unwrap();
    assert_eq!(train(&mut replicated, 3), reference, "2 replicas x 2 stages: losses");
    assert!(weights(&replicated) == weights(&one), "2 replicas x 2 stages: weights differ from one device's");
    assert_eq!(param(&replicated, "embed.weight"), param(&replicated, "head.weight"));
}

#[test]
fn a_fault_while_the_copies_are_summed_changes_nothing_and_the_next_step_trains() {
    let mut trainer = builder(graph(TIED), 2, ScheduleKind::OneFOneB, 1, 2).build().unwrap();
    let mut reference = builder(graph(TIED), 2, ScheduleKind::OneFOneB, 1, 2).build().unwrap();
    train(&mut trainer, 1);
    train(&mut reference, 1);
    let before = weights(&trainer);
    // Stage 1 (the head's) fails in its prepare phase: the tie sum, while stage 0 waits in it.
    trainer.inject_fault(Some(FaultInjection {
        stage_idx: 1,
        at: FaultPoint::Prepare,
        micro_batch_idx: 0,
        panic: false,
    }));
    let (x, y) = tokens(5);
    let started = std::time::Instant::now();
    let error = trainer.train_step(&x, &y).unwrap_err();
    assert!(started.elapsed().as_secs_f64() < 5.0, "the failed step took {:?}", started.elapsed());
    assert!(matches!(error, Error::StageFailed { stage_idx: 1, .. }), "{error}");
    assert!(weights(&trainer) == before, "a parameter changed");
    trainer.inject_fault(None);
    let (x, y) = tokens(1);
    let got = trainer.train_step(&x, &y).unwrap().loss;
    let want = reference.train_step(&x, &y).unwrap().loss;
    assert_eq!(got.to_bits(), want.to_bits(), "the step after the fault");
    assert!(weights(&trainer) == weights(&reference));
}

#[test]
fn ties_that_cannot_hold_are_refused_and_loading_keeps_one_parameter() {
    let refused = |names: &[&str]| {
        let names = vec![names.iter().map(|n| n.to_string()).collect()];
        builder(graph(UNTIED), 1, ScheduleKind::OneFOneB, 1, 1).tie_parameters(names).build().err().unwrap().to_string()
    };
    assert!(refused(&["embed.weight"]).contains("at least two"));
    assert!(refused(&["embed.weight", "nope.weight"]).contains("no parameter `nope.weight`"));
    assert!(refused(&["embed.weight", "pos.weight"]).contains("tied copies share one shape"));
    assert!(refused(&["embed.weight", "embed.weight"]).contains("twice"));
    let spec = "transformer:8,4,16,2,2,4,tied".parse::<ModelSpec>().unwrap_err().to_string();
    assert!(spec.contains("tied needs C = VOCAB"), "{spec}");
    // A checkpoint that names one copy sets both; copies with different values are refused.
    let mut tied = builder(graph(TIED), 2, ScheduleKind::OneFOneB, 1, 2).build().unwrap();
    let ones = Tensor::from_vec(vec![1.0; 8 * 16], [8, 16], &Device::host()).unwrap();
    tied.load_parameters(vec![("head.weight".into(), ones.share())]).unwrap();
    assert_eq!(param(&tied, "embed.weight"), vec![1.0; 128]);
    let twos = Tensor::from_vec(vec![2.0; 8 * 16], [8, 16], &Device::host()).unwrap();
    let error = tied.load_parameters(vec![("embed.weight".into(), ones), ("head.weight".into(), twos)]).unwrap_err();
    assert!(error.to_string().contains("are tied (one parameter) but given different values"), "{error}");
    assert_eq!(param(&tied, "head.weight"), vec![1.0; 128], "nothing loaded from the refused set");
}
