//! Conveyor against an independent reference: a 3-layer MLP trained for 5 steps on one CPU device
//! (and on two devices with 1F1B) matches PyTorch's losses and final weights to 1e-5 relative.
//!
//! The reference is `tests/fixtures/mlp_reference*`, made by `tests/fixtures/make_mlp_reference.py`
//! (`nn.Sequential(Linear(8,16), ReLU, Linear(16,16), ReLU, Linear(16,4))`, CrossEntropyLoss with
//! mean reduction, full-batch steps on 12 rows, float32, one thread).
//!
//! # Tolerance
//!
//! One formula for every compared number, `got` against torch's `want`:
//!
//! ```text
//! |got − want| ≤ RTOL · max(|want|, FLOOR)      RTOL = 1e-5, FLOOR = 1e-3
//! ```
//!
//! Relative error is the measure the issue asks for; the floor keeps it meaningful for the few
//! weights and biases that sit near zero, where a difference of a few f32 ulps of the layer's
//! typical weight (≈ 0.1–0.3 here) would otherwise read as a large relative one. 1e-3 is the floor
//! `common::max_rel_diff` uses and lies far below the typical magnitude, so for all but near-zero
//! entries this is plain 1e-5 relative. Sources of the difference: torch's vectorised kernels sum
//! in another order and may fuse multiply-adds, and the pipeline run sums per-micro-batch
//! gradients, so results agree to a few ulps per operation rather than bit for bit; five steps
//! leave that far below 1e-5.
mod common;

use std::path::PathBuf;
use std::sync::Arc;

use conveyor::engine::checkpoint;
use conveyor::engine::optim::{OptimizerConfig, SgdConfig};
use conveyor::engine::runtime::Trainer;
use conveyor::engine::{Device, Tensor};
use conveyor::layers::CrossEntropyLoss;
use conveyor::schedules::ScheduleKind;
use conveyor::zoo::mlp;

/// Relative tolerance (see the module docs for the formula).
const RTOL: f64 = 1e-5;
/// Magnitude below which differences are measured against `FLOOR` instead of `|want|`.
const FLOOR: f64 = 1e-3;
const WIDTHS: [usize; 4] = [8, 16, 16, 4];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// `(got − want) / max(|want|, FLOOR)`, the quantity bounded by `RTOL`.
fn scaled_error(got: f64, want: f64) -> f64 {
    (got - want).abs() / want.abs().max(FLOOR)
}

struct Reference {
    initial: Vec<(String, Tensor)>,
    inputs: Tensor,
    labels: Vec<usize>,
    losses: Vec<f64>,
    final_weights: Vec<(String, Vec<f32>)>,
}

fn reference(run: &str) -> Reference {
    let host = Device::host();
    let mut init = checkpoint::load(fixture("mlp_reference_init.safetensors"), &host).unwrap();
    let inputs = init.take("inputs").expect("fixture holds the input batch");
    let initial: Vec<(String, Tensor)> = init.into_tensors().into_iter().collect();
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("mlp_reference.json")).unwrap()).unwrap();
    let labels = record["labels"].as_array().unwrap().iter().map(|l| l.as_u64().unwrap() as usize).collect();
    let losses = record["losses"][run].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect();
    let final_weights = checkpoint::load(fixture(&format!("mlp_reference_{run}.safetensors")), &host)
        .unwrap()
        .into_tensors()
        .into_iter()
        .map(|(name, t)| (name, t.to_vec_f32()))
        .collect();
    Reference { initial, inputs, labels, losses, final_weights }
}

/// Trains the zoo MLP from the reference's initial weights; returns per-step losses and final weights.
fn train(
    reference: &Reference,
    optimizer: OptimizerConfig,
    n_devices: usize,
    n_micro_batches: usize,
) -> (Vec<f64>, Vec<(String, Vec<f32>)>) {
    // A different seed than torch's: every parameter is overwritten by the fixture's.
    let graph = mlp(&WIDTHS, 99).unwrap();
    let stages = common::even_stages(&graph, n_devices);
    let mut trainer = Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices((0..n_devices).map(Device::cpu).collect())
        .stages(stages)
        .schedule(ScheduleKind::OneFOneB, 1)
        .micro_batches(n_micro_batches)
        .optimizer(optimizer)
        .build()
        .unwrap();
    let initial = reference.initial.iter().map(|(n, t)| (n.clone(), t.try_clone().unwrap())).collect();
    trainer.load_parameters(initial).unwrap();
    let losses = (0..reference.losses.len())
        .map(|_| trainer.train_step(&reference.inputs, &reference.labels).unwrap().loss)
        .collect();
    let mut weights = common::weights(&trainer);
    weights.sort_by(|a, b| a.0.cmp(&b.0));
    (losses, weights)
}

/// Asserts losses and weights are within the tolerance of the reference; returns the worst error.
fn check(label: &str, reference: &Reference, losses: &[f64], weights: &[(String, Vec<f32>)]) -> f64 {
    let mut worst: f64 = 0.0;
    assert_eq!(losses.len(), reference.losses.len());
    for (step, (&got, &want)) in losses.iter().zip(&reference.losses).enumerate() {
        let error = scaled_error(got, want);
        assert!(error <= RTOL, "{label}: loss of step {step} is {got}, torch's {want} (scaled error {error:e})");
        worst = worst.max(error);
    }
    let names: Vec<&str> = weights.iter().map(|(n, _)| n.as_str()).collect();
    let expected: Vec<&str> = reference.final_weights.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, expected, "{label}: parameter names differ from torch's state dict");
    for ((name, got), (_, want)) in weights.iter().zip(&reference.final_weights) {
        assert_eq!(got.len(), want.len(), "{label}: `{name}` has the wrong size");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let error = scaled_error(g as f64, w as f64);
            assert!(error <= RTOL, "{label}: `{name}`[{i}] is {g}, torch's {w} (scaled error {error:e})");
            worst = worst.max(error);
        }
    }
    worst
}

fn check_run(run: &str, optimizer: OptimizerConfig) {
    let reference = reference(run);
    assert_eq!(reference.inputs.dims(), &[12, WIDTHS[0]]);
    let (losses, weights) = train(&reference, optimizer, 1, 1);
    let worst = check(&format!("{run}, one device"), &reference, &losses, &weights);
    eprintln!("{run}, one device: worst scaled error {worst:e}");
    let (losses, weights) = train(&reference, optimizer, 2, 3);
    let worst = check(&format!("{run}, two devices 1F1B M=3"), &reference, &losses, &weights);
    eprintln!("{run}, two devices 1F1B M=3: worst scaled error {worst:e}");
}

#[test]
fn sgd_with_momentum_matches_pytorch() {
    check_run("sgd", SgdConfig::new(0.1).with_momentum(0.9).into());
}

#[test]
fn adam_matches_pytorch() {
    check_run("adam", OptimizerConfig::adam(0.01));
}

#[test]
fn fixture_initial_weights_are_loaded_not_the_seeded_ones() {
    // Guards the test itself: a trainer that ignored load_parameters would start elsewhere.
    let reference = reference("sgd");
    let graph = mlp(&WIDTHS, 99).unwrap();
    let mut trainer = Trainer::builder(graph, Arc::new(CrossEntropyLoss::new())).build().unwrap();
    let before = common::weights(&trainer);
    let initial = reference.initial.iter().map(|(n, t)| (n.clone(), t.try_clone().unwrap())).collect();
    trainer.load_parameters(initial).unwrap();
    let after = common::weights(&trainer);
    assert_ne!(before, after);
    for (name, values) in &after {
        let (_, want) = reference.initial.iter().find(|(n, _)| n == name).unwrap();
        assert_eq!(values, &want.to_vec_f32(), "`{name}` was not loaded from the fixture");
    }
}
