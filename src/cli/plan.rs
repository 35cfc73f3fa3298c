//! `conveyor plan`: places a zoo model on devices (automatically, or from a placement file) and
//! prints each stage's layers, memory and predicted times, then the step time and bubble fraction
//! the schedule simulator predicts for that placement.
use super::console::outln;
use std::path::Path;

use anyhow::Context;
use conveyor::engine::graph::Graph;
use conveyor::engine::placement::{Plan, ReplicaPlan, format_bytes, format_seconds, predicted_costs, replica_plan};
use conveyor::engine::runtime::Recompute;
use conveyor::limits::{MAX_BATCH_ROWS, MAX_SIMULATED_PAIRS, MAX_STAGES};
use conveyor::pipeline::{PipelineConfig, memory_notes, plan, plan_manually};
use conveyor::schedules::{OpKind, Schedule, ScheduleKind, SimulationReport, StepOverlap, simulate, simulate_steps};
use conveyor::zoo::ModelSpec;

use super::messages::{engine_input_error, schedule_message};
use super::placement_file::read_placement_file;
use super::train::{parse_devices, parse_optimizer, parse_size};
use super::usage;

/// Stages listing more layers than this are shown as `first..last (n layers)` in the table.
const MAX_LISTED_LAYERS: usize = 4;

/// The settings `conveyor plan` plans with, resolved from its flags and `--config`
/// ([`super::plan_flags::PlanFlags::resolve`]); each field is the flag of the same name.
#[derive(Debug)]
pub struct PlanArgs {
    pub model: String,
    pub devices: String,
    pub device_memory: Option<String>,
    pub optimizer: String,
    pub schedule: ScheduleKind,
    pub microbatches: usize,
    pub batch: usize,
    pub chunks: usize,
    pub recompute: Recompute,
    pub weight_cache: conveyor::engine::placement::WeightCache,
    pub precision: conveyor::spec::Precision,
    pub placement: String,
    pub data_parallel: usize,
    pub tensor_parallel: usize,
    pub sequence_parallel: bool,
    pub zero: u8,
    pub bucket_size: conveyor::spec::BucketSize,
    pub json: bool,
    /// `--schedule auto`: `schedule`, `chunks`, `microbatches` and `recompute` are chosen.
    pub auto_schedule: bool,
    pub explain: bool,
}

/// Runs `conveyor plan`.
pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let mut spec: ModelSpec =
        args.model.parse().map_err(|e| usage(format!("--model: invalid model spec {}", engine_reason(e))))?;
    if args.sequence_parallel {
        if args.tensor_parallel < 2 {
            return Err(usage(format!(
                "--sequence-parallel with --tensor-parallel {}: it splits each transformer block's tokens across a \
                 stage's tensor-parallel group; give --tensor-parallel 2 or more, or drop --sequence-parallel",
                args.tensor_parallel
            )));
        }
        spec = spec.with_sequence_parallel().map_err(|_| {
            usage(format!(
                "--sequence-parallel with --model {}: it splits a transformer's LayerNorm and residual regions along \
                 the tokens, and this model has none; use --model transformer[:VOCAB,T,D,H,L,C] or drop \
                 --sequence-parallel",
                args.model
            ))
        })?;
    }
    if args.chunks == 0 {
        return Err(usage("--chunks 0: each device needs at least 1 chunk; give --chunks 1 or more"));
    }
    if let Some(required) = args.schedule.required_chunks()
        && args.chunks != required
    {
        return Err(usage(format!(
            "--chunks {} with --schedule {}: it places exactly {required} chunks per device in a V; give --chunks \
             {required} or leave it out",
            args.chunks, args.schedule
        )));
    }
    if args.chunks > 1 && !args.schedule.supports_chunks() {
        return Err(usage(format!("--chunks {} needs --schedule interleaved or interleaved-zb", args.chunks)));
    }
    if args.microbatches == 0 || args.batch == 0 {
        return Err(usage(format!(
            "--batch {} --microbatches {}: a batch needs at least 1 row and 1 micro-batch; give both at least 1",
            args.batch, args.microbatches
        )));
    }
    if args.batch > MAX_BATCH_ROWS {
        return Err(usage(format!(
            "--batch {} is over the limit of {MAX_BATCH_ROWS} rows (MAX_BATCH_ROWS); give a smaller batch",
            args.batch
        )));
    }
    if args.microbatches > args.batch {
        return Err(usage(format!(
            "--microbatches {} is more than the {} rows of a batch; use at most --microbatches {}",
            args.microbatches, args.batch, args.batch
        )));
    }
    let optimizer = parse_optimizer(&args.optimizer, None, None, None)?;
    let budget = args.device_memory.as_deref().map(parse_size).transpose()?;
    let all_devices = parse_devices(&args.devices, budget)?;
    let replicas = args.data_parallel;
    if args.zero > 1 {
        return Err(usage(format!(
            "--zero {}: give 0 (no sharding) or 1 (optimizer state sharded across replicas)",
            args.zero
        )));
    }
    if replicas == 0 || !all_devices.len().is_multiple_of(replicas) {
        return Err(usage(format!(
            "--data-parallel {replicas}: the {} devices of --devices {} do not split into {replicas} replicas; give \
             replicas x stages devices",
            all_devices.len(),
            args.devices
        )));
    }
    if args.batch < replicas * args.microbatches {
        return Err(usage(format!(
            "--batch {} cannot give each of {replicas} replicas {} micro-batches; give a batch of at least {}",
            args.batch,
            args.microbatches,
            replicas * args.microbatches
        )));
    }
    // Every replica runs the plan of the first replica's devices on its share of the batch.
    let devices = all_devices[..all_devices.len() / replicas].to_vec();
    if devices.len().checked_mul(args.chunks).is_none_or(|n| n > MAX_STAGES) {
        return Err(usage(format!(
            "--chunks {} on {} devices makes more than {MAX_STAGES} stages, the limit (MAX_STAGES); give fewer chunks",
            args.chunks,
            devices.len()
        )));
    }
    // (A tensor-parallel group of devices runs one stage.)
    let stages = (devices.len() / args.tensor_parallel.max(1)).max(1) * args.chunks;
    let pairs = stages * args.microbatches;
    if pairs > MAX_SIMULATED_PAIRS {
        return Err(usage(format!(
            "--microbatches {} on {stages} stages makes {pairs} (micro-batch, stage) pairs, over the limit of \
             {MAX_SIMULATED_PAIRS} (MAX_SIMULATED_PAIRS: the memory plan and the simulator walk every pair); give at \
             most --microbatches {}, or fewer stages",
            args.microbatches,
            MAX_SIMULATED_PAIRS / stages
        )));
    }
    // The graph is built for its shapes: its parameters are zeros the operating system maps only
    // when written, so planning a model costs no memory for its weights. The memory plan runs
    // each layer up to `MAX_PROBED_PARAMETER_BYTES` once on a micro-batch to see which tensors it
    // shares (reading zeros), and bounds larger ones from their shapes.
    let graph = conveyor::engine::init::with_unwritten_parameters(|| spec.build(0))
        .map_err(|e| usage(format!("--model {}: {}", args.model, engine_reason(e))))?;
    let config = PipelineConfig {
        schedule: args.schedule,
        n_chunks: args.chunks,
        n_micro_batches: args.microbatches,
        batch_rows: args.batch.div_ceil(replicas),
        optimizer,
        recompute: args.recompute,
        seed: 0,
        core_slots: Default::default(),
        precision: args.precision,
        weight_cache: args.weight_cache,
    };
    if args.tensor_parallel > 1 {
        return super::plan_tp::run(&args, &spec, &devices, &config, budget);
    }
    if args.auto_schedule {
        return super::plan_auto::run(args, &graph, &devices, &config, budget);
    }
    let plan = if args.placement == "auto" {
        plan(&graph, &devices, &config).map_err(|e| explain_memory(e, &args, budget))?
    } else {
        let path = Path::new(&args.placement);
        let stages = read_placement_file(path)?;
        plan_manually(&graph, &stages, &devices, &config)
            .map_err(|e| explain_memory(e, &args, budget))
            .with_context(|| format!("--placement {}", path.display()))?
    };
    let replica_plan = (replicas > 1)
        .then(|| replica_plan(&plan, &graph, replicas, args.zero == 1, &plan.config.link))
        .transpose()
        .map_err(engine_input_error)?;
    let prediction = simulate_plan(&plan, &args, devices.len(), replica_plan.as_ref())?;
    if args.json {
        let mut json = plan_json(&plan, &prediction, &args, &graph, devices.len());
        if let Some(replica_plan) = &replica_plan {
            json["data_parallel"] = replica_json(&plan, replica_plan, &prediction.one_step, args.bucket_size);
        }
        outln!("{}", serde_json::to_string(&json)?);
    } else {
        print_table(&plan, &prediction, &args, plan.config.micro_batch_rows, devices.len());
        if let Some(replica_plan) = &replica_plan {
            print_replicas(&plan, replica_plan, &prediction.one_step, args.bucket_size);
        }
    }
    Ok(())
}

/// An engine error's reason alone when it is an invalid argument (the message names the flag
/// itself), else the whole message.
pub(super) fn engine_reason(e: conveyor::engine::Error) -> String {
    match e {
        conveyor::engine::Error::InvalidArgument { reason, .. } => reason,
        other => other.to_string(),
    }
}

/// Puts the flags that set the budget in front of a [`conveyor::engine::Error::DoesNotFit`], so the
/// message says it is about memory and which flag to change; other errors pass unchanged.
pub(super) fn explain_memory(err: conveyor::engine::Error, args: &PlanArgs, budget: Option<u64>) -> anyhow::Error {
    let is_memory = matches!(err, conveyor::engine::Error::DoesNotFit { .. });
    if !is_memory {
        return engine_input_error(err);
    }
    let budget = budget.map_or("unlimited".to_string(), format_bytes);
    anyhow::Error::new(err).context(format!(
        "{} with {} does not fit the memory of --devices {} (--device-memory {budget} each)",
        args.model, args.optimizer, args.devices
    ))
}

/// Runs the schedule simulator with each stage's predicted F, B and W (and the recomputation's
/// extra forward on each recomputed micro-batch's input-gradient op). The planner already folds
/// each stage's incoming transfers into its F and B, so the simulator's link stays free: adding
/// the link model again would count every transfer twice.
/// With replicas, each device all-reduces its stages' gradients before the commit.
pub(super) fn simulate_plan(
    plan: &Plan,
    args: &PlanArgs,
    n_devices: usize,
    replicas: Option<&ReplicaPlan>,
) -> anyhow::Result<Prediction> {
    let schedule = Schedule::new(args.schedule, n_devices, args.microbatches, args.chunks)
        .map_err(|e| usage(schedule_message(&e)))?;
    // Each recomputed micro-batch's input-gradient op costs one more forward of its stage.
    let mut costs = predicted_costs(plan, &schedule, args.recompute);
    if let Some(replicas) = replicas {
        costs = costs
            .with_device_all_reduce_s(replicas.device_all_reduce_s(n_devices, |s| schedule.device_of_stage(s)))
            .with_all_reduce_in_buckets(args.bucket_size.bytes().is_some());
    }
    let one_step =
        simulate(&schedule, &costs).context("simulating the schedule with the plan's predicted stage costs")?;
    // `conveyor train` overlaps steps by default: its steady-state period, over a few steps.
    // (Fewer steps where a step has many pairs: the period is steady from the second.)
    let pairs = schedule.n_stages() * schedule.n_micro_batches();
    let n_steps = OVERLAPPED_STEPS_SIMULATED.min(MAX_SIMULATED_PAIRS / pairs.max(1)).max(2);
    let overlapped = simulate_steps(&schedule, &costs, n_steps, StepOverlap::Overlapped)
        .context("simulating overlapped steps with the plan's predicted stage costs")?;
    Ok(Prediction { one_step, overlapped_step_s: overlapped.step_period_s })
}

/// Steps simulated for the overlapped period (its steady state is reached from the second step).
const OVERLAPPED_STEPS_SIMULATED: usize = 4;

/// What the plan predicts of a step: one step alone (as `conveyor simulate` draws it), and the
/// period of overlapped steps in steady state (`train --overlap-steps on`, its default).
pub(super) struct Prediction {
    pub one_step: SimulationReport,
    pub overlapped_step_s: f64,
}

pub(super) fn plan_json(
    plan: &Plan,
    prediction: &Prediction,
    args: &PlanArgs,
    graph: &Graph,
    n_devices: usize,
) -> serde_json::Value {
    let stages: Vec<serde_json::Value> = plan
        .stages
        .iter()
        .map(|s| {
            let device = &plan.devices[s.device_idx];
            serde_json::json!({
                "stage": s.stage_idx,
                "device": device.name,
                "layers": s.node_names,
                "params": s.n_params,
                "memory": {
                    "params": s.memory.params,
                    "grads": s.memory.grads,
                    "optimizer_state": s.memory.optimizer_state,
                    "commit_snapshot": s.memory.commit_snapshot,
                    "workspace": s.memory.workspace,
                    "activations": s.memory.activations,
                    "messages": s.memory.messages,
                    "scratch": s.memory.scratch,
                },
                "memory_bytes": s.memory.total(),
                "commit_snapshot_kept": s.keeps_commit_snapshot(),
                "commit_snapshot_dropped_bytes": s.memory.commit_snapshot_dropped,
                "dropped_caches": s.dropped_caches,
                "dropped_cache_bytes": s.memory.workspace_dropped,
                "budget_bytes": device.budget_bytes,
                "forward_s": s.forward_s,
                "backward_input_s": s.backward_input_s,
                "backward_weight_s": s.backward_weight_s,
                "transfer_s": s.transfer_s,
                "predicted_time_s": s.time_per_micro_batch_s(),
            })
        })
        .collect();
    serde_json::json!({
        "model": args.model,
        "n_layers": graph.n_nodes() - graph.inputs().len(),
        "devices": args.devices,
        "schedule": args.schedule.name(),
        "microbatches": args.microbatches,
        "batch": args.batch,
        "micro_batch_rows": plan.config.micro_batch_rows,
        "chunks": args.chunks,
        "optimizer": args.optimizer,
        "placement": args.placement,
        "stages": stages,
        "bottleneck_s": plan.bottleneck_s(),
        "predicted_step_s": prediction.one_step.makespan_s,
        "predicted_overlapped_step_s": prediction.overlapped_step_s,
        "predicted_bubble_fraction": prediction.one_step.bubble_fraction,
        "recompute": recompute_name(args.recompute),
        "weight_cache": args.weight_cache.name(),
        "device_peak_bytes": plan.device_peaks(n_devices).iter().map(|d| d[0]).collect::<Vec<_>>(),
        "memory_notes": memory_notes(plan),
    })
}

pub(super) fn recompute_name(recompute: Recompute) -> &'static str {
    match recompute {
        Recompute::Never => "never",
        Recompute::ExceptLast => "except-last",
        Recompute::Always => "always",
    }
}

pub(super) fn print_table(
    plan: &Plan,
    prediction: &Prediction,
    args: &PlanArgs,
    micro_batch_rows: usize,
    n_devices: usize,
) {
    let placement = if args.placement == "auto" { "automatic placement".to_string() } else { args.placement.clone() };
    outln!(
        "conveyor plan: {} on {} ({} stages), {}{}, {} micro-batches of {micro_batch_rows} rows, {}, recompute {}, weight cache {}; {placement}",
        args.model,
        args.devices,
        plan.stages.len(),
        args.schedule,
        if args.chunks > 1 { format!(" x{} chunks", args.chunks) } else { String::new() },
        args.microbatches,
        args.optimizer,
        recompute_name(args.recompute),
        args.weight_cache,
    );
    let header = [
        "stage",
        "device",
        "layers",
        "params",
        "param mem",
        "grads",
        "optimizer",
        "snapshot",
        "caches",
        "activations",
        "messages",
        "scratch",
        "total",
        "budget",
        "F",
        "B",
        "W",
    ];
    let rows: Vec<Vec<String>> = plan
        .stages
        .iter()
        .map(|s| {
            let device = &plan.devices[s.device_idx];
            vec![
                s.stage_idx.to_string(),
                device.name.clone(),
                compact_layers(&s.node_names),
                format_count(s.n_params),
                format_bytes(s.memory.params),
                format_bytes(s.memory.grads),
                format_bytes(s.memory.optimizer_state),
                format_bytes(s.memory.commit_snapshot),
                format_bytes(s.memory.workspace),
                format_bytes(s.memory.activations),
                format_bytes(s.memory.messages),
                format_bytes(s.memory.scratch),
                format_bytes(s.memory.total()),
                device.budget_bytes.map_or("unlimited".to_string(), format_bytes),
                format_seconds(s.forward_s),
                format_seconds(s.backward_input_s),
                format_seconds(s.backward_weight_s),
            ]
        })
        .collect();
    crate::cli::console::out(&render_table(&header, &rows));
    outln!(
        "memory: the most each stage holds at once (persistent: parameters, gradients, optimizer state, \
         the commit's undo snapshot, packed weight caches; at its busiest moment of a step: activations kept for \
         backward, messages waiting, the running op's working set)"
    );
    if args.chunks > 1 {
        let peaks: Vec<String> = plan.device_peaks(n_devices).iter().map(|d| format_bytes(d[0])).collect();
        outln!("per device (chunks together): [{}]", peaks.join(", "));
    }
    for note in memory_notes(plan) {
        outln!("{note}");
    }
    let bottleneck = plan
        .stages
        .iter()
        .max_by(|a, b| a.time_per_micro_batch_s().total_cmp(&b.time_per_micro_batch_s()))
        .expect("a plan has at least one stage");
    outln!(
        "times per micro-batch: F forward, B input gradient, W weight gradient (F and B include transfers in); \
         slowest stage {} at {} (F+B+W)",
        bottleneck.stage_idx,
        format_seconds(bottleneck.time_per_micro_batch_s())
    );
    outln!(
        "predicted step: {} ({} simulated with these stage times); with overlapped steps (`train`'s default) {} \
         per step in steady state",
        format_seconds(prediction.one_step.makespan_s),
        args.schedule,
        format_seconds(prediction.overlapped_step_s)
    );
    outln!("predicted bubble fraction: {:.4}", prediction.one_step.bubble_fraction);
}

/// The data-parallel view of the plan: each replica's memory per stage (with ZeRO-1, its share of
/// the optimizer state), the gradients each stage all-reduces and the predicted cost.
fn print_replicas(plan: &Plan, replicas: &ReplicaPlan, report: &SimulationReport, buckets: conveyor::spec::BucketSize) {
    outln!(
        "data parallel: {} replicas of this pipeline, each on its own devices{}; each stage's gradients are \
         all-reduced (ring, {} per message, {}/s) when its device reaches the optimizer step",
        replicas.replicas,
        if replicas.zero { ", ZeRO-1: optimizer state sharded" } else { ", optimizer state replicated" },
        format_seconds(replicas.link.latency_s),
        format_bytes(replicas.link.bandwidth_bytes_per_s as u64),
    );
    let header = ["stage", "device", "optimizer", "snapshot", "total", "budget", "all-reduce (gradients: time)"];
    let rows: Vec<Vec<String>> = replicas
        .stages
        .iter()
        .zip(&plan.stages)
        .map(|(r, s)| {
            let device = &plan.devices[s.device_idx];
            vec![
                r.stage_idx.to_string(),
                format!("{} (each replica's)", device.name),
                format_bytes(r.optimizer_state),
                format_bytes(r.commit_snapshot),
                format_bytes(r.total),
                device.budget_bytes.map_or("unlimited".to_string(), format_bytes),
                format!(
                    "{} in {} tensors: {}",
                    format_bytes(r.gradient_bytes),
                    r.gradient_tensors,
                    format_seconds(r.all_reduce_s)
                ),
            ]
        })
        .collect();
    crate::cli::console::out(&render_table(&header, &rows));
    for (r, s) in replicas.stages.iter().zip(&plan.stages) {
        if let Some(budget) = plan.devices[s.device_idx].budget_bytes.filter(|&b| r.total > b) {
            outln!(
                "warning: stage {} needs {} with the all-reduce's buffers, over its budget of {}",
                r.stage_idx,
                format_bytes(r.total),
                format_bytes(budget)
            );
        }
    }
    let unsharded = replicas.replicas as u64 * plan.stages.iter().map(|s| s.memory.optimizer_state).sum::<u64>();
    outln!(
        "optimizer state in all replicas: {}{}",
        format_bytes(replicas.optimizer_state_in_all(plan)),
        if replicas.zero { format!(" (replicated: {})", format_bytes(unsharded)) } else { String::new() }
    );
    let all_reduce_s: f64 =
        report.timeline.events.iter().filter(|e| e.op == OpKind::AllReduce).map(|e| e.duration_s()).fold(0.0, f64::max);
    outln!(
        "the predicted step above includes the gradient all-reduce ({}, before the commit; the longest device's: \
         {}); each replica takes 1/{} of every batch",
        buckets.when(),
        format_seconds(all_reduce_s),
        replicas.replicas
    );
}

fn replica_json(
    plan: &Plan,
    replicas: &ReplicaPlan,
    report: &SimulationReport,
    buckets: conveyor::spec::BucketSize,
) -> serde_json::Value {
    let stages: Vec<serde_json::Value> = replicas
        .stages
        .iter()
        .map(|r| {
            serde_json::json!({
                "stage": r.stage_idx,
                "optimizer_state": r.optimizer_state,
                "commit_snapshot": r.commit_snapshot,
                "memory_bytes": r.total,
                "gradient_bytes": r.gradient_bytes,
                "gradient_tensors": r.gradient_tensors,
                "all_reduce_link_bytes": r.all_reduce_link_bytes,
                "all_reduce_s": r.all_reduce_s,
            })
        })
        .collect();
    let events: Vec<serde_json::Value> = report
        .timeline
        .events
        .iter()
        .filter(|e| e.op == OpKind::AllReduce)
        .map(|e| serde_json::json!({"device": e.device_idx, "start_s": e.start_s, "end_s": e.end_s}))
        .collect();
    serde_json::json!({
        "replicas": replicas.replicas,
        "zero": u8::from(replicas.zero),
        "link": {"latency_s": replicas.link.latency_s, "bandwidth_bytes_per_s": replicas.link.bandwidth_bytes_per_s},
        "stages": stages,
        "optimizer_state_all_replicas": replicas.optimizer_state_in_all(plan),
        "all_reduce_events": events,
        "bucket_size": buckets.to_string(),
    })
}

/// Left-aligns text columns (stage, device, layers) and right-aligns the figures.
fn render_table(header: &[&str], rows: &[Vec<String>]) -> String {
    const TEXT_COLUMNS: usize = 3;
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let padded: Vec<String> = cells
            .enumerate()
            .map(|(column, cell)| {
                let pad = " ".repeat(widths[column] - cell.chars().count());
                if column < TEXT_COLUMNS { format!("{cell}{pad}") } else { format!("{pad}{cell}") }
            })
            .collect();
        format!("{}\n", padded.join("  ").trim_end())
    };
    let mut out = line(&mut header.iter().copied());
    for row in rows {
        out.push_str(&line(&mut row.iter().map(String::as_str)));
    }
    out
}

/// `a b c`, or `first..last (n layers)` when there are more than [`MAX_LISTED_LAYERS`]; the range
/// form is what a placement file accepts.
fn compact_layers(names: &[String]) -> String {
    match names {
        [first, .., last] if names.len() > MAX_LISTED_LAYERS => format!("{first}..{last} ({} layers)", names.len()),
        _ => names.join(" "),
    }
}

/// `530`, `10.3 k`, `3.15 M`.
fn format_count(n: u64) -> String {
    match n {
        0..1_000 => n.to_string(),
        1_000..1_000_000 => format!("{:.1} k", n as f64 / 1e3),
        _ => format!("{:.2} M", n as f64 / 1e6),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compact_forms() {
        let names: Vec<String> = (0..15).map(|i| i.to_string()).collect();
        assert_eq!(compact_layers(&names), "0..14 (15 layers)");
        assert_eq!(compact_layers(&names[..3]), "0 1 2");
        assert_eq!(format_count(3_148_800), "3.15 M");
        assert_eq!(format_seconds(0.00123), "1.230 ms");
    }
}
