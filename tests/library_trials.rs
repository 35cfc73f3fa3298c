//! The six library trial tasks of issue 17 with the library as it is now, each run and checked
//! (the same tasks written against the API before the issue, and the line counts side by side,
//! are in `docs/library-guide.md`). Each task sits between `// TASK n` and `// END n`.
use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use conveyor::Sequential;
use conveyor::engine::graph::Graph;
use conveyor::engine::optim::OptimizerConfig;
use conveyor::engine::placement::Placement;
use conveyor::engine::runtime::Trainer;
use conveyor::engine::{Device, Shape};
use conveyor::layers::CrossEntropyLoss;
use conveyor::schedules::ScheduleKind;

#[path = "../examples/custom_layer.rs"]
#[allow(dead_code)]
mod custom_layer_example;
mod train_cli_support;
use custom_layer_example::LayerScale;
use train_cli_support::temp_dir;

// TASK 1: build a model by hand
fn build_model() -> Result<Graph> {
    Ok(Sequential::new([64]).linear(128).relu().linear(128).relu().linear(10).build(0)?)
}
// END 1

// TASK 2: place it manually and automatically on two devices, and build a trainer
fn place(manual: bool) -> Result<Trainer> {
    let stages = vec![vec!["0".into(), "1".into()], vec!["2..4".into()]];
    let placement = if manual { Placement::Manual(stages) } else { Placement::auto() };
    let trainer = Trainer::builder(build_model()?, Arc::new(CrossEntropyLoss::new()))
        .devices(Device::parse_list("cpu:2")?)
        .placement(placement)
        .batch_rows(32)
        .schedule(ScheduleKind::OneFOneB, 1)
        .micro_batches(8)
        .optimizer(OptimizerConfig::adam(1e-3))
        .build()?;
    Ok(trainer)
}
// END 2

// TASK 3: train for an epoch and save the weights
fn train_and_save(trainer: &mut Trainer, path: &Path) -> Result<()> {
    let data = conveyor::data::synthetic(256, 64, 10, 0)?;
    trainer.fit(data.batches(32, true, 0, 0), |report| println!("loss {:.4}", report.loss))?;
    trainer.save(path)?;
    Ok(())
}
// END 3

// TASK 4: checkpoint a run and resume it in a new process
fn checkpoint_run(trainer: &Trainer, path: &Path) -> Result<()> {
    trainer.checkpoint(path)?;
    Ok(())
}

fn resume_run(path: &Path) -> Result<Trainer> {
    let mut trainer = place(true)?;
    trainer.restore(path)?;
    Ok(trainer)
}
// END 4

// TASK 5: a custom layer (LayerScale: y = x * gamma over the last dimension)
// LayerScale itself is `examples/custom_layer.rs` lines 21-50 (28 lines of code, counted with this task).
fn gradcheck_layer_scale() -> Result<()> {
    conveyor::testing::gradcheck(&mut LayerScale::new(8, 0.5)?, &[Shape::from([8])])?;
    Ok(())
}
// END 5

// TASK 6: read the bubble report of a step: per device busy/idle, measured against theory and simulation
fn bubble_report(trainer: &mut Trainer) -> Result<()> {
    let data = conveyor::data::synthetic(32, 64, 10, 0)?;
    let (inputs, labels) = data.batch(&(0..32).collect::<Vec<_>>())?;
    let report = trainer.train_step(&inputs, &labels)?;
    println!("{}", trainer.bubbles(&[report])?);
    Ok(())
}
// END 6

#[test]
fn the_six_trial_tasks_run() -> Result<()> {
    let dir = temp_dir("library-trials");
    let (weights, checkpoint) = (dir.join("weights.safetensors"), dir.join("checkpoint.safetensors"));

    let manual = place(true)?;
    assert_eq!(manual.plan().expect("a planned placement keeps its plan").stages[0].node_names, ["0", "1"]);
    let mut trainer = place(false)?;
    assert_eq!(trainer.plan().unwrap().stages.len(), 2);

    train_and_save(&mut trainer, &weights)?;
    assert_eq!(trainer.step_idx(), 8);
    let mut loaded = place(true)?;
    loaded.load(&weights)?;
    for ((name, a), (_, b)) in trainer.parameters()?.iter().zip(&loaded.parameters()?) {
        assert!(a.bit_eq(b), "{name} differs after save and load");
    }

    checkpoint_run(&trainer, &checkpoint)?;
    let mut resumed = resume_run(&checkpoint)?;
    assert_eq!(resumed.step_idx(), 8);
    let data = conveyor::data::synthetic(32, 64, 10, 1)?;
    let (inputs, labels) = data.batch(&(0..32).collect::<Vec<_>>())?;
    let (a, b) = (trainer.train_step(&inputs, &labels)?, resumed.train_step(&inputs, &labels)?);
    assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "a resumed run continues as the original");

    gradcheck_layer_scale()?;
    bubble_report(&mut resumed)?;
    let report = resumed.train_step(&inputs, &labels)?;
    let bubbles = resumed.bubbles(&[report])?;
    assert_eq!(bubbles.devices.len(), 2);
    Ok(())
}
