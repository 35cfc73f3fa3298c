//! A model too big for one device: an MLP whose parameters, gradients and Adam state need more
//! than twice one device's memory budget. Planning on one device fails with `DoesNotFit`; on
//! four devices the planner finds a placement (dropping the packed weight copies or undo
//! snapshots that do not fit, and saying so), and training reports each device's peak memory,
//! every one under its plan and its budget (the budget is enforced: an allocation past it is an
//! error).
//!
//! Run: `cargo run --release --example too_big_for_one_device`
use conveyor::data;
use conveyor::engine::optim::OptimizerConfig;
use conveyor::engine::placement::format_bytes;
use conveyor::engine::{Device, Error};
use conveyor::pipeline::{PipelineConfig, build_trainer, memory_notes, plan};
use conveyor::schedules::ScheduleKind;
use conveyor::zoo::mlp;

fn main() -> anyhow::Result<()> {
    // 64 -> 6 x 768 -> 10: about 3.0 M parameters = 11.4 MiB; with gradients and Adam's two
    // moments, about 46 MiB, plus Linear's two packed weight copies (23 MiB): more than twice one
    // device's 32 MiB. Split four ways, each stage holds one or two 768x768 layers (13.5 MiB each
    // with their state and copies) plus its activations.
    let widths = [64, 768, 768, 768, 768, 768, 768, 10];
    let budget: u64 = 32 << 20;
    let config =
        PipelineConfig { optimizer: OptimizerConfig::adam(1e-3), ..PipelineConfig::new(ScheduleKind::OneFOneB, 8, 64) };

    let one = vec![Device::cpu_with_budget(0, Some(budget))];
    match plan(&mlp(&widths, 0)?, &one, &config) {
        Ok(_) => anyhow::bail!("expected the model not to fit one device"),
        Err(err) => {
            println!("on one device of {}: {err}", format_bytes(budget));
            // The same figures as numbers, for a program to act on.
            let Error::DoesNotFit { needed_bytes, budget_bytes, breakdown, .. } = &err else { return Err(err.into()) };
            println!(
                "  needed {} against {}: parameters {}, gradients {}, Adam state {}, activations {}, packed copies {}, \
                 undo snapshot {}\n",
                format_bytes(*needed_bytes),
                format_bytes(*budget_bytes),
                format_bytes(breakdown.parameters),
                format_bytes(breakdown.gradients),
                format_bytes(breakdown.optimizer_state),
                format_bytes(breakdown.activations),
                format_bytes(breakdown.caches),
                format_bytes(breakdown.undo_snapshot),
            );
        }
    }

    let devices: Vec<Device> = (0..4).map(|i| Device::cpu_with_budget(i, Some(budget))).collect();
    let (plan, mut trainer) = build_trainer(mlp(&widths, 0)?, devices, &config)?;
    println!("on four devices of {} each:", format_bytes(budget));
    for stage in &plan.stages {
        let m = &stage.memory;
        println!(
            "  stage {} (layers {}): planned {} = params {} + packed copies {} + grads {} + Adam {} + undo snapshot {} \
             + activations {} + messages {} + scratch {}",
            stage.stage_idx,
            stage.node_names.join(" "),
            format_bytes(m.total()),
            format_bytes(m.params),
            format_bytes(m.workspace),
            format_bytes(m.grads),
            format_bytes(m.optimizer_state),
            format_bytes(m.commit_snapshot),
            format_bytes(m.activations),
            format_bytes(m.messages),
            format_bytes(m.scratch),
        );
    }
    for note in memory_notes(&plan) {
        println!("  {note}");
    }

    let train = data::synthetic(512, 64, 10, 1)?;
    let mut peaks = vec![0u64; 4];
    for step in 0..8 {
        let indices: Vec<usize> = (step * 64..(step + 1) * 64).collect();
        let (x, y) = train.batch(&indices)?;
        let report = trainer.train_step(&x, &y)?;
        for (peak, step_peak) in peaks.iter_mut().zip(&report.peak_memory) {
            *peak = (*peak).max(*step_peak);
        }
        println!("step {}: loss {:.4}", step + 1, report.loss);
    }
    let planned = plan.device_peaks(4);
    for ((device, peak), planned) in trainer.devices().iter().zip(&peaks).zip(&planned) {
        println!(
            "{device}: peak {} of a planned {} and a {} budget",
            format_bytes(*peak),
            format_bytes(planned[0]),
            format_bytes(budget)
        );
        anyhow::ensure!(*peak <= planned[0], "{device} went over its plan");
    }
    Ok(())
}
