//! Shared helpers for the behaviour tests: seeded data and trainers on CPU devices.
#![allow(dead_code)]
use std::sync::Arc;

use conveyor::engine::graph::{Graph, NodeId};
use conveyor::engine::optim::{OptimizerConfig, SgdConfig};
use conveyor::engine::runtime::{Recompute, Trainer};
use conveyor::engine::{Device, Tensor};
use conveyor::layers::CrossEntropyLoss;
use conveyor::schedules::ScheduleKind;

/// Every schedule with the chunk count it runs with.
pub const SCHEDULES: [(ScheduleKind, usize); 5] = [
    (ScheduleKind::GPipe, 1),
    (ScheduleKind::OneFOneB, 1),
    (ScheduleKind::Interleaved, 2),
    (ScheduleKind::ZbH1, 1),
    (ScheduleKind::ZbH2, 1),
];

/// Deterministic inputs `[rows, features...]` and labels in `0..classes`.
pub fn data(rows: usize, features: &[usize], classes: usize, seed: u64) -> (Tensor, Vec<usize>) {
    let per_row: usize = features.iter().product();
    let mut state = seed.wrapping_mul(2654435761).wrapping_add(1);
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % 10_000) as f32 / 5_000.0 - 1.0
    };
    let values: Vec<f32> = (0..rows * per_row).map(|_| next()).collect();
    let labels = (0..rows).map(|r| (r * 7 + seed as usize) % classes).collect();
    let mut shape = vec![rows];
    shape.extend_from_slice(features);
    (Tensor::from_vec(values, shape, &Device::host()).unwrap(), labels)
}

/// Cuts the graph's layers, in topological order, into `n` contiguous groups of near-equal count.
pub fn even_stages(graph: &Graph, n: usize) -> Vec<Vec<NodeId>> {
    let layers: Vec<NodeId> =
        graph.topological_order().unwrap().into_iter().filter(|&id| graph.layer(id).is_some()).collect();
    let (base, extra) = (layers.len() / n, layers.len() % n);
    let mut out = Vec::new();
    let mut start = 0;
    for i in 0..n {
        let len = base + usize::from(i < extra);
        out.push(layers[start..start + len].to_vec());
        start += len;
    }
    out
}

/// A trainer for `graph` on `n_devices` CPU devices.
pub fn trainer(
    graph: Graph,
    n_devices: usize,
    schedule: ScheduleKind,
    n_chunks: usize,
    n_micro_batches: usize,
    recompute: Recompute,
) -> Trainer {
    let stages = even_stages(&graph, n_devices * n_chunks);
    Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices((0..n_devices).map(Device::cpu).collect())
        .stages(stages)
        .schedule(schedule, n_chunks)
        .micro_batches(n_micro_batches)
        .optimizer(OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.9)))
        .recompute(recompute)
        .seed(11)
        .build()
        .unwrap()
}

/// All parameters as f32 vectors, in graph order.
pub fn weights(trainer: &Trainer) -> Vec<(String, Vec<f32>)> {
    trainer.parameters().unwrap().into_iter().map(|(n, t)| (n, t.to_vec_f32())).collect()
}

/// Largest relative difference `|a - b| / max(|b|, 1e-3)` over all parameters.
pub fn max_rel_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    max_rel_diff_above(a, b, 1e-3)
}

/// Largest relative difference `|a - b| / max(|b|, floor)` over all parameters (absolute below
/// `floor`). Adam divides each gradient by its root mean square plus `eps` (1e-8), so a gradient
/// that cancels to exactly 0 in one summation order and to a rounding residue δ in another moves
/// its weight by about `lr·δ / (δ + eps)` in one run only: runs that sum gradients in different
/// orders agree in absolute terms to a small fraction of `lr`, not to f32 rounding of each weight.
pub fn max_rel_diff_above(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)], floor: f32) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0.0f32;
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        for (x, y) in va.iter().zip(vb) {
            worst = worst.max((x - y).abs() / y.abs().max(floor));
        }
    }
    worst
}

/// `n_stages` stages of `k` CPU devices each over `spec`, every layer split over its stage's
/// group, stages cut evenly (tensor parallelism inside a pipeline).
pub fn split_trainer(
    spec: &conveyor::zoo::ModelSpec,
    n_stages: usize,
    k: usize,
    kind: ScheduleKind,
    n_micro_batches: usize,
    optimizer: OptimizerConfig,
) -> Trainer {
    let devices: Vec<Device> = (0..n_stages * k).map(Device::cpu).collect();
    // The tensor-parallel form, unsplit: the nodes the split graph has.
    let whole = spec.build_split(3, &conveyor::zoo::TensorParallelSplits::new()).unwrap();
    let stages = even_stages(&whole, n_stages);
    let mut splits = conveyor::zoo::TensorParallelSplits::new();
    for (stage_idx, nodes) in stages.iter().enumerate() {
        for &id in nodes {
            splits.insert(whole.node(id).unwrap().name.clone(), devices[stage_idx * k..(stage_idx + 1) * k].to_vec());
        }
    }
    let graph = spec.build_split(3, &splits).unwrap();
    Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices(devices)
        .tensor_parallel(k)
        .stages(stages)
        .schedule(kind, 1)
        .micro_batches(n_micro_batches)
        .optimizer(optimizer)
        .seed(11)
        .build()
        .unwrap()
}
