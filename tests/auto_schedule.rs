//! `--schedule auto`: the joint choice of schedule, micro-batch count, recompute mode and stage
//! split is at least as fast (simulated, with the plan's stage times) as every fixed schedule that
//! fits the budgets, fits them itself, and is explained by `conveyor plan --schedule auto`.
use std::process::{Command, Output};

use anyhow::{Context, Result, ensure};
use conveyor::engine::Device;
use conveyor::engine::optim::OptimizerConfig;
use conveyor::engine::placement::{PlaceBy, choose_schedule, predicted_costs};
use conveyor::engine::runtime::Recompute;
use conveyor::pipeline::{PipelineConfig, plan};
use conveyor::schedules::{Schedule, ScheduleKind, simulate};
use conveyor::zoo::ModelSpec;
use serde_json::Value;

const MODEL: &str = "mlp:8,16,16,16,16,4";

fn base() -> PipelineConfig {
    PipelineConfig {
        schedule: ScheduleKind::OneFOneB,
        n_chunks: 1,
        n_micro_batches: 8,
        batch_rows: 64,
        optimizer: OptimizerConfig::adam(1e-3),
        recompute: Recompute::Never,
        seed: 0,
        core_slots: Default::default(),
        precision: Default::default(),
        weight_cache: Default::default(),
    }
}

#[test]
fn the_choice_is_at_least_as_fast_as_every_fixed_schedule_that_fits() -> Result<()> {
    let graph = MODEL.parse::<ModelSpec>()?.build(0)?;
    for budget in [None, Some(16 * 1024u64), Some(12 * 1024)] {
        let devices: Vec<Device> = (0..4).map(|i| Device::cpu_with_budget(i, budget)).collect();
        let choice = choose_schedule(&graph, &devices, &base(), PlaceBy::Memory)?;
        let chosen = choice.chosen().planned().context("the chosen candidate fits")?;
        if let Some(budget) = budget {
            ensure!(chosen.peak_bytes <= budget, "the choice's peak {} is over the budget", chosen.peak_bytes);
            ensure!(choice.candidates.iter().any(|c| c.planned().is_none()), "the budget {budget} refuses some");
        }
        ensure!(choice.pareto_front().contains(&choice.chosen), "the fastest is on the Pareto front");
        let mut n_fixed = 0;
        for kind in ScheduleKind::ALL {
            let n_chunks = kind.required_chunks().unwrap_or(if kind.supports_chunks() { 2 } else { 1 });
            for n_micro_batches in [4, 8, 16] {
                let Ok(schedule) = Schedule::new(kind, 4, n_micro_batches, n_chunks) else { continue };
                for recompute in [Recompute::Never, Recompute::ExceptLast, Recompute::Always] {
                    let config = PipelineConfig { schedule: kind, n_chunks, n_micro_batches, recompute, ..base() };
                    let Ok(fixed) = plan(&graph, &devices, &config) else { continue };
                    n_fixed += 1;
                    let step_s = simulate(&schedule, &predicted_costs(&fixed, &schedule, recompute))?.makespan_s;
                    ensure!(
                        chosen.step_s <= step_s * (1.0 + 1e-12),
                        "budget {budget:?}: {} ({} s) is slower than {kind} m={n_micro_batches} {recompute:?} ({step_s} s)",
                        choice.chosen().label(),
                        chosen.step_s
                    );
                }
            }
        }
        ensure!(n_fixed > 0, "some fixed schedule fits");
    }
    Ok(())
}

fn conveyor(args: &[&str]) -> Result<Output> {
    Command::new(env!("CARGO_BIN_EXE_conveyor")).args(args).output().context("running conveyor")
}

#[test]
fn plan_explains_the_choice_as_a_pareto_table_and_in_json() -> Result<()> {
    let args = ["plan", "--model", MODEL, "--devices", "cpu:4", "--device-memory", "16KiB", "--schedule", "auto"];
    let output = conveyor(&[&args[..], &["--explain"]].concat())?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    ensure!(stdout.contains("Pareto front of predicted step time against peak memory"), "{stdout}");
    ensure!(stdout.contains("refused: does not fit the memory budgets"), "{stdout}");
    ensure!(stdout.lines().filter(|line| line.starts_with(">*")).count() == 1, "one chosen row: {stdout}");
    ensure!(stdout.contains("--schedule auto chose "), "{stdout}");

    let output = conveyor(&[&args[..], &["--json"]].concat())?;
    ensure!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let json: Value = serde_json::from_slice(&output.stdout)?;
    let auto = &json["auto"];
    let candidates = auto["candidates"].as_array().context("candidates")?;
    let chosen = &candidates[auto["chosen"].as_u64().context("chosen")? as usize];
    ensure!(chosen["fits"] == true && json["schedule"] == chosen["schedule"], "{json}");
    ensure!(json["microbatches"] == chosen["microbatches"] && json["recompute"] == chosen["recompute"], "{json}");
    let fastest = candidates.iter().filter_map(|c| c["predicted_step_s"].as_f64()).fold(f64::INFINITY, f64::min);
    ensure!(chosen["predicted_step_s"].as_f64() == Some(fastest), "{chosen}");
    ensure!(auto["pareto_front"].as_array().is_some_and(|front| !front.is_empty()), "{auto}");
    ensure!(auto["why"].as_str().is_some_and(|why| why.contains("shortest predicted step")), "{auto}");

    let output = conveyor(&["plan", "--model", MODEL, "--devices", "cpu:4", "--explain"])?;
    ensure!(output.status.code() == Some(2), "--explain without auto is a usage error");
    ensure!(String::from_utf8_lossy(&output.stderr).contains("give --schedule auto"));
    Ok(())
}

#[test]
fn train_with_the_automatic_choice() -> Result<()> {
    let common = ["train", "--model", MODEL, "--data", "synthetic:64,8,4", "--devices", "cpu:4", "--batch", "16"];
    let output = conveyor(&[&common[..], &["--schedule", "auto", "--steps", "2", "--log-every", "0"]].concat())?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    ensure!(stdout.starts_with("--schedule auto chose "), "{stdout}");
    ensure!(stdout.contains("trained 2 steps"), "{stdout}");
    // The spec it runs names the choice.
    let output = conveyor(&[&common[..], &["--schedule", "auto", "--print-config"]].concat())?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(output.status.success() && stdout.contains("placement = \"time\""), "{stdout}");
    ensure!(!stdout.contains("schedule = \"auto\""), "{stdout}");
    let output = conveyor(&[&common[..], &["--schedule", "auto", "--data-parallel", "2"]].concat())?;
    ensure!(output.status.code() == Some(2), "auto with replicas is refused");
    ensure!(String::from_utf8_lossy(&output.stderr).contains("--schedule auto plans one pipeline"));
    Ok(())
}
