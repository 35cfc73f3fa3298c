//! AlexNet's two-GPU split, small: a conv net on synthetic 3x16x16 images whose convolutions are
//! split by output channels and whose wide Linears are split column- then row-wise, each across 2
//! devices, inside a 2-stage pipeline (4 CPU devices: stage 0 on cpu:0+cpu:1, stage 1 on
//! cpu:2+cpu:3). Trains a few steps and prints each device's peak memory and the bytes each split
//! layer's collectives moved.
//!
//! Run: `cargo run --release --example alexnet_split`
use std::sync::Arc;

use conveyor::engine::graph::{Graph, NodeId};
use conveyor::engine::optim::{OptimizerConfig, SgdConfig};
use conveyor::engine::placement::format_bytes;
use conveyor::engine::runtime::Trainer;
use conveyor::engine::{Device, Tensor, init};
use conveyor::layers::{
    ChannelParallelConv2d, ColumnParallelLinear, Conv2dOptions, CrossEntropyLoss, Flatten, MaxPool2d, Relu,
    RowParallelLinear,
};
use conveyor::schedules::ScheduleKind;

const CLASSES: usize = 10;
const SIDE: usize = 16;

/// conv(3→32) relu pool → conv(32→64) relu pool | flatten → fc(1024→256) relu → fc(256→10),
/// the convolutions on `first`'s devices and the classifier on `second`'s.
fn alexnet_split(first: &[Device], second: &[Device], seed: u64) -> anyhow::Result<(Graph, Vec<Vec<NodeId>>)> {
    let mut rng = init::rng(seed);
    let padded = Conv2dOptions { padding: (1, 1), ..Conv2dOptions::default() };
    let mut g = Graph::new();
    let x = g.input("input", [3, SIDE, SIDE])?;
    let conv1 = g.add("conv1", ChannelParallelConv2d::new(3, 32, (3, 3), padded, first, &mut rng)?, &[x])?;
    let relu1 = g.add("relu1", Relu::new(), &[conv1])?;
    let pool1 = g.add("pool1", MaxPool2d::new((2, 2), (2, 2))?, &[relu1])?;
    let conv2 = g.add("conv2", ChannelParallelConv2d::new(32, 64, (3, 3), padded, first, &mut rng)?, &[pool1])?;
    let relu2 = g.add("relu2", Relu::new(), &[conv2])?;
    let pool2 = g.add("pool2", MaxPool2d::new((2, 2), (2, 2))?, &[relu2])?;
    let flatten = g.add("flatten", Flatten::new(), &[pool2])?;
    let features = 64 * (SIDE / 4) * (SIDE / 4);
    let fc1 = g.add("fc1", ColumnParallelLinear::new(features, 256, true, second, &mut rng)?, &[flatten])?;
    let relu3 = g.add("relu3", Relu::new(), &[fc1])?;
    let fc2 = g.add("fc2", RowParallelLinear::new(256, CLASSES, true, second, &mut rng)?, &[relu3])?;
    g.set_output(fc2)?;
    Ok((g, vec![vec![conv1, relu1, pool1, conv2, relu2, pool2], vec![flatten, fc1, relu3, fc2]]))
}

/// Images of noise with a bright 4x4 square whose position and colour channel give the class.
fn synthetic_images(rows: usize, seed: u64) -> anyhow::Result<(Tensor, Vec<usize>)> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut noise = move || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.4
    };
    let plane = SIDE * SIDE;
    let mut values = Vec::with_capacity(rows * 3 * plane);
    let mut labels = Vec::with_capacity(rows);
    for row in 0..rows {
        let class = (row * 7 + seed as usize) % CLASSES;
        let (top, left, channel) = (4 * (class % 4), 4 * ((class / 4) % 4), class % 3);
        for c in 0..3 {
            for y in 0..SIDE {
                for x in 0..SIDE {
                    let lit = c == channel && (top..top + 4).contains(&y) && (left..left + 4).contains(&x);
                    values.push(noise() + if lit { 1.0 } else { 0.0 });
                }
            }
        }
        labels.push(class);
    }
    Ok((Tensor::from_vec(values, [rows, 3, SIDE, SIDE], &Device::host())?, labels))
}

fn main() -> anyhow::Result<()> {
    let devices: Vec<Device> = (0..4).map(Device::cpu).collect();
    let (graph, stages) = alexnet_split(&devices[..2], &devices[2..], 0)?;
    let mut trainer = Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices(devices)
        .tensor_parallel(2)
        .stages(stages)
        .schedule(ScheduleKind::OneFOneB, 1)
        .micro_batches(4)
        .optimizer(OptimizerConfig::Sgd(SgdConfig::new(0.1).with_momentum(0.9)))
        .build()?;
    println!("alexnet_split: 2 stages x 2 devices, 1F1B, 4 micro-batches of 8 images");
    let steps = 30;
    let mut last = None;
    for step in 0..steps {
        let (x, y) = synthetic_images(32, step as u64)?;
        let report = trainer.train_step(&x, &y)?;
        if step % 5 == 0 || step + 1 == steps {
            println!("step {step:>2}: loss {:.4}, {:.1} ms", report.loss, report.step_s * 1e3);
        }
        last = Some(report);
    }
    let report = last.expect("at least one step");
    println!("\npeak memory in the last step:");
    for (group_idx, group) in trainer.device_groups().iter().enumerate() {
        for (device, peak) in group.iter().zip(report.peak_memory.iter().skip(group_idx * group.len())) {
            println!("  stage {group_idx}  {device}  {}", format_bytes(*peak));
        }
    }
    println!("\nbytes sent by collectives over {steps} steps (per device, rank order):");
    let mut total = 0.0;
    for (node, traffic) in trainer.collective_traffic()? {
        let per_rank: Vec<String> = traffic.iter().map(|t| format_bytes(t.bytes as u64)).collect();
        total += traffic.iter().map(|t| t.bytes).sum::<f64>();
        println!("  {node:<6} {}", per_rank.join(", "));
    }
    println!("  total  {} ({} per step)", format_bytes(total as u64), format_bytes((total / steps as f64) as u64));
    Ok(())
}
