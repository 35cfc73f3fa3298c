//! State in and out of a trainer, through the library: `Trainer::save` and `load` (a PyTorch state
//! dict, loaded strictly or not), `Trainer::checkpoint` and `TrainerBuilder::resume` (a run that
//! continues bit for bit, on other stages too), the metadata stored with them and read back from
//! the header alone, and saves that fail without harming the file already there. The model has
//! dropout, so a resume that lost the seed or the step would draw other masks.
mod common;
mod train_cli_support;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{data, even_stages};
use conveyor::Sequential;
use conveyor::engine::checkpoint::{self, LoadOptions, SEED_KEY, STEP_KEY, WrongShape};
use conveyor::engine::optim::{OptimizerConfig, SgdConfig};
use conveyor::engine::runtime::{Trainer, TrainerBuilder};
use conveyor::engine::{DType, Device, Error, Shape, Tensor};
use conveyor::layers::CrossEntropyLoss;
use train_cli_support::temp_dir;

/// Parameters `0.*`, `3.*` and `5.*` (`[16, 6]`, `[16, 16]`, `[4, 16]` weights), dropout at node 2.
fn builder(init_seed: u64, n_stages: usize, optimizer: OptimizerConfig) -> TrainerBuilder {
    let graph =
        Sequential::new([6]).linear(16).relu().dropout(0.25).linear(16).relu().linear(4).build(init_seed).unwrap();
    let stages = even_stages(&graph, n_stages);
    Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices((0..n_stages).map(Device::cpu).collect())
        .stages(stages)
        .micro_batches(2)
        .optimizer(optimizer)
        .seed(5)
}

fn sgd_momentum() -> OptimizerConfig {
    OptimizerConfig::Sgd(SgdConfig::new(0.1).with_momentum(0.9))
}

/// Parameters, then optimizer state, as bytes.
fn full_state(trainer: &Trainer) -> Vec<(String, Vec<u8>)> {
    let parameters = trainer.parameters().unwrap().into_iter();
    parameters.chain(trainer.optimizer_state().unwrap()).map(|(name, t)| (name, t.to_le_bytes())).collect()
}

fn parameters(trainer: &Trainer) -> BTreeMap<String, Vec<u8>> {
    trainer.parameters().unwrap().into_iter().map(|(name, t)| (name, t.to_le_bytes())).collect()
}

fn train(trainer: &mut Trainer, steps: std::ops::Range<u64>) {
    for step in steps {
        let (x, y) = data(8, &[6], 4, step);
        trainer.train_step(&x, &y).unwrap();
    }
}

#[test]
fn save_then_load_into_a_fresh_trainer_gives_the_same_bits_and_predictions() {
    let dir = temp_dir("state-io-save-load");
    let path = dir.join("model.safetensors");
    let mut trained = builder(1, 2, sgd_momentum()).build().unwrap();
    train(&mut trained, 0..3);
    trained.save(&path).unwrap();

    // Exactly the state dict: the parameters, no optimizer state, no step.
    let file = checkpoint::load(&path, &Device::host()).unwrap();
    assert_eq!(file.names().collect::<Vec<_>>(), ["0.bias", "0.weight", "3.bias", "3.weight", "5.bias", "5.weight"]);
    assert!(!file.metadata().contains_key(STEP_KEY));

    // Other initial weights, on three stages instead of two.
    let mut fresh = builder(2, 3, sgd_momentum()).build().unwrap();
    assert_ne!(parameters(&fresh), parameters(&trained), "the fresh trainer must start elsewhere");
    fresh.load(&path).unwrap();
    assert_eq!(parameters(&fresh), parameters(&trained));
    let (x, _) = data(8, &[6], 4, 99);
    assert!(fresh.predict(&x).unwrap().bit_eq(&trained.predict(&x).unwrap()));
    // A weights load leaves the step and the optimizer state alone.
    assert_eq!(fresh.step_idx(), 0);
}

#[test]
fn strict_loads_list_every_mismatch_and_non_strict_loads_load_the_rest() {
    let dir = temp_dir("state-io-strict");
    let source = builder(1, 1, sgd_momentum()).build().unwrap();
    let mut tensors: Vec<(String, Tensor)> = source.parameters().unwrap();
    tensors.retain(|(name, _)| name != "3.bias");
    let ones = |dims: &[usize]| Tensor::full(1.0, dims.to_vec(), DType::F32, &Device::host()).unwrap();
    for (name, tensor) in &mut tensors {
        if name == "5.weight" {
            *tensor = ones(&[16, 4]);
        }
    }
    tensors.push(("extra.weight".to_string(), ones(&[3])));
    // Optimizer state is passed over by a weights load, not unexpected.
    tensors.push((
        "optimizer.0.weight.step".to_string(),
        Tensor::from_vec(vec![1.0], Shape::new(Vec::new()), &Device::host()).unwrap(),
    ));
    let path = dir.join("mismatched.safetensors");
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    checkpoint::save(&path, &named).unwrap();

    let mut trainer = builder(2, 2, sgd_momentum()).build().unwrap();
    let before = parameters(&trainer);
    let expected_wrong = [WrongShape { name: "5.weight".to_string(), expected: vec![4, 16], got: vec![16, 4] }];
    match trainer.load(&path) {
        Err(Error::StateDictMismatch { path: p, missing, unexpected, wrong_shape }) => {
            assert_eq!(p, path.display().to_string());
            assert_eq!(missing, ["3.bias"]);
            assert_eq!(unexpected, ["extra.weight"]);
            assert_eq!(wrong_shape, expected_wrong);
        }
        other => panic!("a strict load must refuse the file with every name: {other:?}"),
    }
    let message = trainer.load(&path).unwrap_err().to_string();
    for phrase in [
        "tensor `3.bias` is missing",
        "tensor `extra.weight` is in the file but not expected",
        "tensor `5.weight` has shape [16, 4] but [4, 16] was expected",
    ] {
        assert!(message.contains(phrase), "{message}");
    }
    assert_eq!(parameters(&trainer), before, "a refused load changes nothing");

    let report = trainer.load_with(&path, LoadOptions { strict: false }).unwrap();
    assert_eq!(report.missing, ["3.bias"]);
    assert_eq!(report.unexpected, ["extra.weight"]);
    assert_eq!(report.wrong_shape, expected_wrong);
    assert_eq!(report.loaded, ["0.weight", "0.bias", "3.weight", "5.bias"]);
    assert!(!report.is_exact());
    let after = parameters(&trainer);
    let source = parameters(&source);
    for name in ["0.weight", "0.bias", "3.weight", "5.bias"] {
        assert_eq!(after[name], source[name], "{name} is loaded");
    }
    for name in ["3.bias", "5.weight"] {
        assert_eq!(after[name], before[name], "{name} keeps its value");
    }
}

#[test]
fn a_load_refuses_non_finite_weights_and_changes_nothing() {
    let dir = temp_dir("state-io-non-finite");
    let mut tensors = builder(1, 1, sgd_momentum()).build().unwrap().parameters().unwrap();
    let mut values = tensors[2].1.to_vec_f32();
    values[5] = f32::NAN;
    tensors[2].1 = Tensor::from_vec(values, tensors[2].1.shape().clone(), &Device::host()).unwrap();
    let path = dir.join("nan.safetensors");
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    checkpoint::save(&path, &named).unwrap();
    let mut trainer = builder(2, 2, sgd_momentum()).build().unwrap();
    let before = parameters(&trainer);
    match trainer.load(&path) {
        Err(Error::NonFiniteCheckpoint { found, .. }) => {
            assert_eq!((found.name.as_str(), found.index), ("3.weight", 5))
        }
        other => panic!("NaN weights must be refused: {other:?}"),
    }
    assert_eq!(parameters(&trainer), before);
}

/// `k` steps, a checkpoint, a resume on `resumed_stages` stages, `n` more steps: the same bits as
/// `k + n` steps without a break.
fn resume_case(optimizer: OptimizerConfig, resumed_stages: usize) {
    let (k, n) = (3, 3);
    let dir = temp_dir(&format!("state-io-resume-{}-{resumed_stages}", optimizer.name()));
    let path = dir.join("ck.safetensors");
    let mut whole = builder(1, 2, optimizer).build().unwrap();
    train(&mut whole, 0..k + n);

    let mut first = builder(1, 2, optimizer).build().unwrap();
    train(&mut first, 0..k);
    first.checkpoint(&path).unwrap();
    drop(first);
    // Another initialisation and another seed: the checkpoint decides both.
    let mut resumed = builder(2, resumed_stages, optimizer).seed(77).resume(&path).build().unwrap();
    assert_eq!((resumed.step_idx(), resumed.seed()), (k, 5));
    train(&mut resumed, k..k + n);
    assert!(
        full_state(&resumed) == full_state(&whole),
        "{} resumed on {resumed_stages} stage(s) differs from the uninterrupted run",
        optimizer.name()
    );
}

#[test]
fn a_resumed_run_continues_bit_for_bit_with_sgd_momentum_on_other_stages() {
    resume_case(sgd_momentum(), 3);
    resume_case(sgd_momentum(), 1);
}

#[test]
fn a_resumed_run_continues_bit_for_bit_with_adam_on_other_stages() {
    resume_case(OptimizerConfig::adam(0.01), 3);
    resume_case(OptimizerConfig::adam(0.01), 2);
}

#[test]
fn resume_refuses_a_weights_file_and_another_optimizers_state() {
    let dir = temp_dir("state-io-resume-refused");
    let mut trainer = builder(1, 2, sgd_momentum()).build().unwrap();
    train(&mut trainer, 0..2);
    let weights = dir.join("weights.safetensors");
    trainer.save(&weights).unwrap();
    let ck = dir.join("ck.safetensors");
    trainer.checkpoint(&ck).unwrap();

    match builder(1, 2, sgd_momentum()).resume(&weights).build() {
        Err(Error::StateDictMismatch { missing, unexpected, wrong_shape, .. }) => {
            assert_eq!(missing.len(), 12, "a step and a momentum buffer per parameter: {missing:?}");
            assert_eq!(&missing[..2], ["optimizer.0.weight.step", "optimizer.0.weight.momentum_buffer"]);
            assert!(unexpected.is_empty() && wrong_shape.is_empty());
        }
        other => panic!("a weights file is no checkpoint: {:?}", other.err()),
    }
    match builder(1, 2, OptimizerConfig::adam(0.01)).resume(&ck).build() {
        Err(Error::StateDictMismatch { missing, unexpected, .. }) => {
            assert_eq!(missing.len(), 12, "{missing:?}");
            assert!(missing.iter().all(|n| n.ends_with(".exp_avg") || n.ends_with(".exp_avg_sq")), "{missing:?}");
            assert_eq!(unexpected.len(), 6, "{unexpected:?}");
            assert!(unexpected.iter().all(|n| n.ends_with(".momentum_buffer")), "{unexpected:?}");
        }
        other => panic!("Adam cannot continue SGD's state: {:?}", other.err()),
    }
    // A refused restore leaves the trainer as it was.
    let mut adam = builder(1, 2, OptimizerConfig::adam(0.01)).build().unwrap();
    let before = full_state(&adam);
    assert!(adam.restore(&ck).is_err());
    assert!(full_state(&adam) == before && adam.step_idx() == 0);
}

#[test]
fn metadata_round_trips_through_checkpoints_and_the_header() {
    let dir = temp_dir("state-io-metadata");
    let path = dir.join("ck.safetensors");
    let spec = "[model]\nname = \"mlp:6,16,4\"\n";
    let mut trainer =
        builder(1, 1, sgd_momentum()).metadata("conveyor.spec", spec).metadata("note", "first").build().unwrap();
    train(&mut trainer, 0..2);
    trainer.set_metadata("epoch", "1").unwrap();
    trainer.checkpoint(&path).unwrap();

    let header = checkpoint::read_metadata(&path).unwrap();
    assert_eq!(header["conveyor.spec"], spec);
    assert_eq!((header["note"].as_str(), header["epoch"].as_str()), ("first", "1"));
    assert_eq!((header[STEP_KEY].as_str(), header[SEED_KEY].as_str()), ("2", "5"));
    assert_eq!(header, *checkpoint::load(&path, &Device::host()).unwrap().metadata(), "the header is the metadata");

    // Resumed: the checkpoint's metadata under the builder's keys; the step and seed are not in it.
    let resumed = builder(1, 2, sgd_momentum()).metadata("note", "second").resume(&path).build().unwrap();
    let expected: BTreeMap<String, String> = [("conveyor.spec", spec), ("epoch", "1"), ("note", "second")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    assert_eq!(*resumed.metadata(), expected);
    // The weights file carries the metadata too.
    let weights = dir.join("weights.safetensors");
    resumed.save(&weights).unwrap();
    assert_eq!(checkpoint::read_metadata(&weights).unwrap()["note"], "second");

    for reserved in [STEP_KEY, SEED_KEY, checkpoint::FORMAT_VERSION_KEY] {
        let error = builder(1, 1, sgd_momentum()).metadata(reserved, "1").build().err();
        assert!(matches!(error, Some(Error::InvalidArgument { .. })), "{reserved}: {error:?}");
        assert!(trainer.set_metadata(reserved, "1").is_err());
    }
}

#[test]
fn a_failed_save_leaves_the_previous_file_whole() {
    let dir = temp_dir("state-io-failed-save");
    let path = dir.join("ck.safetensors");
    let mut trainer = builder(1, 2, OptimizerConfig::adam(0.01)).build().unwrap();
    train(&mut trainer, 0..1);
    trainer.checkpoint(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    train(&mut trainer, 1..2);

    // The disk fills halfway through the new file.
    for weights_only in [false, true] {
        conveyor::engine::output_file::inject_write_fault(Some(good.len() as u64 / 8));
        let error = if weights_only { trainer.save(&path) } else { trainer.checkpoint(&path) }.unwrap_err();
        assert!(matches!(error, Error::Io { .. }), "{error}");
        assert_eq!(std::fs::read(&path).unwrap(), good, "the previous file was damaged");
        assert_eq!(dir.entries(), ["ck.safetensors"], "a temporary file was left behind");
    }
    // Paths that cannot be written: a directory, and a file under a missing directory.
    assert!(matches!(trainer.checkpoint(&*dir).unwrap_err(), Error::OutputPath { .. }));
    assert!(trainer.save(dir.join("no-such-dir").join("ck.safetensors")).is_err());
    assert_eq!(dir.entries(), ["ck.safetensors"]);
    // The surviving file still resumes.
    let resumed = builder(1, 2, OptimizerConfig::adam(0.01)).resume(&path).build().unwrap();
    assert_eq!(resumed.step_idx(), 1);
}

#[test]
fn a_checkpoint_from_before_the_step_and_seed_keys_resumes_from_a_given_position() {
    let dir = temp_dir("state-io-legacy");
    let path = dir.join("legacy.safetensors");
    let mut uninterrupted = builder(0, 2, sgd_momentum()).build().unwrap();
    train(&mut uninterrupted, 0..3);
    // What `conveyor train --checkpoint` wrote before this version: tensors, no conveyor.step/seed.
    let mut tensors = uninterrupted.parameters().unwrap();
    tensors.extend(uninterrupted.optimizer_state().unwrap());
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let metadata = BTreeMap::from([("conveyor.train.step".to_string(), "3".to_string())]);
    checkpoint::save_with_metadata(&path, &named, &metadata).unwrap();

    let mut resumed = builder(0, 1, sgd_momentum()).build().unwrap();
    let err = resumed.restore(&path).unwrap_err();
    assert!(err.to_string().contains(STEP_KEY), "{err}");
    resumed.restore_with_position(&path, 3, 5).unwrap();
    assert_eq!(resumed.step_idx(), 3);
    train(&mut uninterrupted, 3..5);
    train(&mut resumed, 3..5);
    assert_eq!(full_state(&resumed), full_state(&uninterrupted));
}
