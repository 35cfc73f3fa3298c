//! A custom layer in a few lines: LayerScale (CaiT's `y = x * gamma`, one learned factor per
//! feature), checked against finite differences in one call, then trained inside a model split
//! over two pipeline stages with the custom layer at the stage boundary, under 1F1B and under
//! ZB-H1 (which runs the input and weight gradients at different times), and compared bit for bit
//! with one device.
//!
//! Run it with `cargo run --release --example custom_layer` (about a second).
use std::sync::Arc;

use anyhow::{Result, ensure};
use conveyor::Sequential;
use conveyor::engine::graph::Graph;
use conveyor::engine::optim::OptimizerConfig;
use conveyor::engine::placement::Placement;
use conveyor::engine::runtime::Trainer;
use conveyor::engine::{DType, Device, ForwardCtx, Layer, Parameter, Saved, Shape, Tensor};
use conveyor::layers::CrossEntropyLoss;
use conveyor::schedules::ScheduleKind;

/// LayerScale (CaiT): `y = x * gamma`, one learned factor per feature.
#[derive(Debug)]
pub struct LayerScale(Vec<Parameter>);

impl LayerScale {
    pub fn new(features: usize, init: f32) -> conveyor::engine::Result<LayerScale> {
        let gamma = Tensor::full(init, [features], DType::F32, &Device::host())?;
        Ok(LayerScale(vec![Parameter { name: "gamma".into(), value: gamma }]))
    }
}

impl Layer for LayerScale {
    fn parameters(&self) -> &[Parameter] {
        &self.0
    }
    fn parameters_mut(&mut self) -> &mut [Parameter] {
        &mut self.0
    }
    fn forward(&self, x: &[&Tensor], _: &ForwardCtx) -> conveyor::engine::Result<(Tensor, Saved)> {
        Ok((x[0].mul_rows(&self.0[0].value)?, Saved { tensors: vec![x[0].share()] }))
    }
    fn backward(
        &self,
        saved: &Saved,
        grad: &Tensor,
        grads: &mut [Tensor],
    ) -> conveyor::engine::Result<Vec<Option<Tensor>>> {
        grads[0].accumulate_column_sums(&saved.tensors[0].mul(grad)?)?;
        Ok(vec![Some(grad.mul_rows(&self.0[0].value)?)])
    }
}

const FEATURES: usize = 16;
const CLASSES: usize = 4;
const BATCH: usize = 32;
const STEPS: usize = 8;

/// `x -> 0 Linear -> 1 ReLU -> 2 LayerScale -> 3 Linear -> 4 ReLU -> 5 Linear`.
fn model() -> Result<Graph> {
    let scale = LayerScale::new(32, 0.1)?;
    Ok(Sequential::new([FEATURES]).linear(32).relu().then(scale).linear(32).relu().linear(CLASSES).build(0)?)
}

/// Trains [`model`] for [`STEPS`] steps on `stages` (node names per stage, one CPU device each)
/// under `schedule`; returns the final parameters.
fn train(schedule: ScheduleKind, stages: &[&[&str]]) -> Result<Vec<(String, Tensor)>> {
    let manual = stages.iter().map(|names| names.iter().map(|n| n.to_string()).collect()).collect();
    let mut trainer = Trainer::builder(model()?, Arc::new(CrossEntropyLoss::new()))
        .devices((0..stages.len()).map(Device::cpu).collect())
        .placement(Placement::Manual(manual))
        .batch_rows(BATCH)
        .schedule(schedule, 1)
        .micro_batches(4)
        .optimizer(OptimizerConfig::adam(1e-2))
        .build()?;
    let data = conveyor::data::synthetic(BATCH * STEPS, FEATURES, CLASSES, 0)?;
    for step in 0..STEPS {
        let (inputs, labels) = data.batch(&(step * BATCH..(step + 1) * BATCH).collect::<Vec<_>>())?;
        trainer.train_step(&inputs, &labels)?;
    }
    Ok(trainer.parameters()?)
}

/// Public so `tests/custom_layer.rs` runs this example in CI.
pub fn main() -> Result<()> {
    let report = conveyor::testing::gradcheck(&mut LayerScale::new(8, 0.5)?, &[Shape::from([8])])?;
    println!("gradcheck: {} derivatives, max abs error {:.1e}", report.n_checked, report.max_abs_error);

    let one_device = train(ScheduleKind::OneFOneB, &[&["0", "1", "2", "3", "4", "5"]])?;
    for (schedule, stages) in [
        // LayerScale ends stage 0: its output crosses to stage 1, its input gradient is local.
        (ScheduleKind::OneFOneB, [&["0", "1", "2"][..], &["3", "4", "5"]]),
        // LayerScale starts stage 1 under split backward: its input gradient crosses back.
        (ScheduleKind::ZbH1, [&["0", "1"][..], &["2", "3", "4", "5"]]),
    ] {
        let pipelined = train(schedule, &stages)?;
        for ((name, a), (_, b)) in one_device.iter().zip(&pipelined) {
            ensure!(a.bit_eq(b), "{schedule}: `{name}` differs from one device's");
        }
        println!("{schedule} on 2 stages {stages:?}: every parameter equals one device's, bit for bit");
    }
    Ok(())
}
