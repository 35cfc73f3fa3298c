//! A model too big for one device: an MLP whose parameters, gradients and Adam state need more
//! than twice one device's memory budget. Planning on one device fails with `DoesNotFit`; on
//! four devices the planner finds a placement, and training reports each device's peak memory,
//! every one under its budget (the budget is enforced: an allocation past it is an error).
//!
//! Run: `cargo run --release --example too_big_for_one_device`
use conveyor::data;
use conveyor::engine::Device;
use conveyor::engine::optim::OptimizerConfig;
use conveyor::engine::placement::format_bytes;
use conveyor::engine::runtime::Recompute;
use conveyor::pipeline::{PipelineConfig, build_trainer, plan};
use conveyor::schedules::ScheduleKind;
use conveyor::zoo::mlp;

fn main() -> anyhow::Result<()> {
    // 64 -> 6 x 768 -> 10: about 3.0 M parameters = 11.4 MiB; with gradients and Adam's two
    // moments, about 46 MiB, plus Linear's two packed weight copies (23 MiB): more than twice one
    // device's 32 MiB. Split four ways, each stage holds one or two 768x768 layers (13.5 MiB each
    // with their state and copies) plus its activations.
    let widths = [64, 768, 768, 768, 768, 768, 768, 10];
    let budget: u64 = 32 << 20;
    let config = PipelineConfig {
        schedule: ScheduleKind::OneFOneB,
        n_chunks: 1,
        n_micro_batches: 8,
        batch_rows: 64,
        optimizer: OptimizerConfig::adam(1e-3),
        recompute: Recompute::Never,
        seed: 0,
        core_slots: Default::default(),
    };

    let one = vec![Device::cpu_with_budget(0, Some(budget))];
    match plan(&mlp(&widths, 0)?, &one, &config) {
        Ok(_) => anyhow::bail!("expected the model not to fit one device"),
        Err(err) => println!("on one device of {}: {err}\n", format_bytes(budget)),
    }

    let devices: Vec<Device> = (0..4).map(|i| Device::cpu_with_budget(i, Some(budget))).collect();
    let (plan, mut trainer) = build_trainer(mlp(&widths, 0)?, devices, &config)?;
    println!("on four devices of {} each:", format_bytes(budget));
    for stage in &plan.stages {
        println!(
            "  stage {} (layers {}): planned {} = params {} + packed copies {} + grads {} + Adam {} + activations {}",
            stage.stage_idx,
            stage.node_names.join(" "),
            format_bytes(stage.memory.total()),
            format_bytes(stage.memory.params),
            format_bytes(stage.memory.workspace),
            format_bytes(stage.memory.grads),
            format_bytes(stage.memory.optimizer_state),
            format_bytes(stage.memory.activations),
        );
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
    for (device, peak) in trainer.devices().iter().zip(&peaks) {
        println!("{device}: peak {} of a {} budget", format_bytes(*peak), format_bytes(budget));
        anyhow::ensure!(*peak <= budget, "{device} went over its budget");
    }
    Ok(())
}
