//! `conveyor plan --schedule auto`: the schedule, micro-batch count, recompute mode and stage
//! split chosen jointly by the engine's [`choose_schedule`] (measured layer times, the schedule
//! simulator, the memory plan under the budgets); `--explain` prints every candidate weighed as a
//! Pareto table of predicted step time against peak memory and why the chosen one won, and
//! `--json` adds the same under `"auto"`.
use super::console::outln;

use conveyor::engine::Device;
use conveyor::engine::graph::Graph;
use conveyor::engine::placement::{PlaceBy, ScheduleChoice, choose_schedule, format_bytes};
use conveyor::pipeline::PipelineConfig;

use super::plan::{PlanArgs, explain_memory, plan_json, print_table, simulate_plan};
use super::usage;
use conveyor::engine::placement::format_seconds;

/// Chooses, then prints the chosen plan as `conveyor plan` prints a fixed one.
pub fn run(
    mut args: PlanArgs,
    graph: &Graph,
    devices: &[Device],
    base: &PipelineConfig,
    budget: Option<u64>,
) -> anyhow::Result<()> {
    if args.placement != "auto" {
        return Err(usage(format!(
            "--schedule auto chooses the stage split itself; it cannot take --placement {}: drop --placement or name a schedule",
            args.placement
        )));
    }
    let choice = choose_schedule(graph, devices, base, PlaceBy::Time).map_err(|e| explain_memory(e, &args, budget))?;
    let chosen = choice.chosen();
    args.schedule = chosen.schedule;
    args.chunks = chosen.n_chunks;
    args.microbatches = chosen.n_micro_batches;
    args.recompute = chosen.recompute;
    let plan = choice.plan();
    let prediction = simulate_plan(plan, &args, devices.len(), None)?;
    if args.json {
        let mut json = plan_json(plan, &prediction, &args, graph, devices.len());
        json["auto"] = auto_json(&choice);
        outln!("{}", serde_json::to_string(&json)?);
        return Ok(());
    }
    if args.explain {
        print_candidates(&choice);
    }
    print_table(plan, &prediction, &args, plan.config.micro_batch_rows, devices.len());
    outln!("--schedule auto chose {}: {}", chosen.label(), choice.why());
    Ok(())
}

/// The candidates, fitting ones fastest first, then the refused ones with their reasons.
fn print_candidates(choice: &ScheduleChoice) {
    let front = choice.pareto_front();
    let mut order: Vec<usize> = (0..choice.candidates.len()).collect();
    order.sort_by(|&a, &b| {
        let key = |i: usize| choice.candidates[i].planned().map_or(f64::INFINITY, |p| p.step_s);
        key(a).total_cmp(&key(b)).then(a.cmp(&b))
    });
    outln!(
        "--schedule auto weighed {} candidates (layer times measured here, steps simulated, memory planned under the budgets); \
         * Pareto front of predicted step time against peak memory, > chosen:",
        choice.candidates.len()
    );
    let width = choice.candidates.iter().map(|c| c.label().len()).max().unwrap_or(0);
    outln!("   {:<width$}  {:>10}  {:>7}  {:>11}", "candidate", "step", "bubble", "peak memory");
    for i in order {
        let candidate = &choice.candidates[i];
        let mark = match (i == choice.chosen, front.contains(&i)) {
            (true, _) => ">*",
            (false, true) => " *",
            (false, false) => "  ",
        };
        match &candidate.outcome {
            Ok(planned) => outln!(
                "{mark} {:<width$}  {:>10}  {:>7.4}  {:>11}",
                candidate.label(),
                format_seconds(planned.step_s),
                planned.bubble_fraction,
                format_bytes(planned.peak_bytes)
            ),
            Err(reason) => outln!("{mark} {:<width$}  refused: {reason}", candidate.label()),
        }
    }
}

/// `{"candidates": [...], "pareto_front": [...], "chosen": i, "why": ...}`.
fn auto_json(choice: &ScheduleChoice) -> serde_json::Value {
    let candidates: Vec<serde_json::Value> = choice
        .candidates
        .iter()
        .map(|c| {
            let mut json = serde_json::json!({
                "schedule": c.schedule.name(),
                "chunks": c.n_chunks,
                "microbatches": c.n_micro_batches,
                "recompute": super::plan::recompute_name(c.recompute),
                "fits": c.planned().is_some(),
            });
            match &c.outcome {
                Ok(planned) => {
                    json["predicted_step_s"] = planned.step_s.into();
                    json["predicted_bubble_fraction"] = planned.bubble_fraction.into();
                    json["peak_bytes"] = planned.peak_bytes.into();
                }
                Err(reason) => json["refused"] = reason.clone().into(),
            }
            json
        })
        .collect();
    serde_json::json!({
        "candidates": candidates,
        "pareto_front": choice.pareto_front(),
        "chosen": choice.chosen,
        "why": choice.why(),
    })
}

/// `conveyor train --schedule auto`: chooses as `plan --schedule auto` does for the spec's model,
/// devices, batch and optimizer, writes the chosen schedule, chunks, micro-batch count and
/// recompute mode into the spec, and places by measured times (`placement = "time"`), the times
/// the choice was made from. Under an MPI launcher with several ranks it chooses and places from
/// FLOP estimates instead, which every rank computes alike. One pipeline only: not with tensor or
/// data parallelism yet.
pub fn resolve_for_train(mut spec: conveyor::RunSpec) -> anyhow::Result<conveyor::RunSpec> {
    use conveyor::spec::PlacementSpec;
    let pipeline = &spec.pipeline;
    if pipeline.tensor_parallel > 1 || pipeline.data_parallel > 1 {
        return Err(usage(
            "--schedule auto plans one pipeline; it does not yet weigh --tensor-parallel or --data-parallel: name a schedule",
        ));
    }
    if !matches!(pipeline.placement, PlacementSpec::Auto | PlacementSpec::Time) {
        return Err(usage("--schedule auto chooses the stage split itself; drop --placement or name a schedule"));
    }
    let model_text =
        spec.model.spec.clone().ok_or_else(|| usage("--schedule auto needs --model (the model to plan)"))?;
    let model: conveyor::zoo::ModelSpec = model_text
        .parse()
        .map_err(|e| usage(format!("--model: invalid model spec {}", super::plan::engine_reason(e))))?;
    let mut devices = super::train::parse_devices(&pipeline.devices, pipeline.device_memory)?;
    devices.truncate(conveyor::spec::devices_used(&spec, devices.len()).map_err(|e| usage(e.to_string()))?);
    let optimizer = spec.optimizer.config().map_err(|e| usage(e.to_string()))?;
    let graph = conveyor::engine::init::with_unwritten_parameters(|| model.build(spec.training.seed))
        .map_err(|e| usage(format!("--model {model_text}: {}", super::plan::engine_reason(e))))?;
    let base = PipelineConfig {
        schedule: pipeline.schedule,
        n_chunks: pipeline.chunks,
        n_micro_batches: pipeline.microbatches,
        batch_rows: spec.training.batch,
        optimizer,
        recompute: pipeline.recompute,
        seed: spec.training.seed,
        core_slots: pipeline.core_slots,
        precision: spec.training.precision,
        weight_cache: pipeline.weight_cache,
    };
    // Under an MPI launcher every rank chooses for itself: FLOP estimates, not this rank's
    // timings, so that every rank makes the same choice.
    let several_ranks = conveyor::engine::transport::launcher_world_size().is_some_and(|n| n > 1);
    let by = if several_ranks { PlaceBy::Memory } else { PlaceBy::Time };
    let choice = choose_schedule(&graph, &devices, &base, by).map_err(super::messages::engine_input_error)?;
    let chosen = choice.chosen();
    outln!("--schedule auto chose {}: {}", chosen.label(), choice.why());
    let pipeline = &mut spec.pipeline;
    pipeline.schedule = chosen.schedule;
    pipeline.chunks = chosen.n_chunks;
    pipeline.microbatches = chosen.n_micro_batches;
    pipeline.recompute = chosen.recompute;
    pipeline.placement = if several_ranks { PlacementSpec::Auto } else { PlacementSpec::Time };
    Ok(spec)
}
