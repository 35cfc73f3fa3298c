//! `conveyor train`: trains a model from the zoo on a dataset across devices with a pipeline
//! schedule, printing progress, accuracy, throughput and the bubble summary.
//!
//! Code map: `args.rs` holds the flags and their parsers (shared with `conveyor plan`);
//! `data_source.rs` turns `--data` into splits and fits them to the model; `checkpointing.rs`
//! holds `--save`, `--resume` and `--init`; `outputs.rs` checks every output path before the run
//! and streams the metrics and the trace; `progress.rs` the progress bars; `summary.rs` the
//! accuracy and bubble summary. This file wires them into one run.
//!
//! Whatever ends the run (its last step, a non-finite step, Ctrl-C or SIGTERM), the outputs are
//! written in order of value: `--save`, `--checkpoint`, `--metrics`, `--trace`, `--svg`; one that
//! fails does not stop the others. Everything printed goes through `console` (a closed or full
//! stdout never stops the run).
mod args;
mod checkpointing;
mod checks;
mod data_source;
mod outputs;
mod progress;
mod summary;

use std::time::Instant;

pub use args::{LrSchedule, OnNonFinite, TrainArgs, parse_devices, parse_optimizer, parse_size};
use checkpointing::RunState;
use conveyor::data;
use conveyor::engine::Device;
use conveyor::engine::placement::Plan;
use conveyor::engine::runtime::{Recompute, Trainer};
use conveyor::engine::trace::{MemoryPoint, TimelineRecorder, timeline_filter};
use conveyor::pipeline::{PipelineConfig, build_trainer, build_trainer_with_plan, plan_by_time, simulated_inflight};
use conveyor::schedules::export::{MemorySample, SvgOptions, svg_gantt};
use conveyor::schedules::{
    CostModel, Schedule, ScheduleKind, StageCosts, Timeline, TimelineEvent, simulate, simulate_on_cores,
    simulate_with_core_slots,
};
use conveyor::zoo::ModelSpec;
pub(crate) use outputs::same_output;
use progress::Progress;

use super::console::{errln, outln};
use super::{interrupt, usage};

/// Installs the process's `tracing` subscriber: logs to stderr filtered by `RUST_LOG` (default
/// `warn`), and, when a trace or chart is asked for, the op-span recorder.
fn install_subscriber(record_ops: bool) -> Option<TimelineRecorder> {
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(|| super::console::StderrWriter)
        .log_internal_errors(false)
        .with_filter(filter);
    let (recorder, timeline) = if record_ops {
        let (recorder, layer) = TimelineRecorder::new();
        (Some(recorder), Some(layer.with_filter(timeline_filter())))
    } else {
        (None, None)
    };
    let subscriber = tracing_subscriber::registry().with(logs).with(timeline);
    // Only the first call in a process installs; later ones (tests running `run` twice) keep it.
    let _ = tracing::subscriber::set_global_default(subscriber);
    recorder
}

/// `--devices list`: what this build and machine offer.
fn list_devices() {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    outln!("cpu: {cores} core(s) here; `--devices cpu:N` runs N CPU devices (one worker thread each)");
    match Device::cuda(0, None) {
        Ok(device) => outln!("cuda: {device} is available; `--devices cuda:0,1` lists GPUs"),
        Err(e) => outln!("cuda: unavailable ({e})"),
    }
}

/// Maps planning and building errors the user can fix (bad schedule, does not fit, bad
/// placement) to usage errors.
fn input_error(e: conveyor::engine::Error) -> anyhow::Error {
    super::messages::engine_input_error(e)
}

/// An engine error's reason alone when it is an invalid argument (the CLI names the flag itself),
/// else the whole message.
fn engine_reason(e: conveyor::engine::Error) -> String {
    match e {
        conveyor::engine::Error::InvalidArgument { reason, .. } => reason,
        other => other.to_string(),
    }
}

/// Places the graph (automatically, or from a `--placement` file) and starts the trainer.
fn place_and_build(
    graph: conveyor::engine::graph::Graph,
    devices: Vec<Device>,
    config: &PipelineConfig,
    placement: &str,
) -> anyhow::Result<(Plan, Trainer)> {
    if placement == "auto" {
        return build_trainer(graph, devices, config).map_err(input_error);
    }
    if placement == "time" {
        let plan = plan_by_time(&graph, &devices, config).map_err(input_error)?;
        let trainer = build_trainer_with_plan(graph, devices, &plan, config).map_err(input_error)?;
        return Ok((plan, trainer));
    }
    let path = std::path::Path::new(placement);
    let stages = super::placement_file::read_placement_file(path)?;
    // The same memory model as `auto`: measured layer memory, the recompute mode, the undo snapshot
    // and caches kept only where they fit.
    let plan = conveyor::pipeline::plan_manually(&graph, &stages, &devices, config)
        .map_err(|e| usage(format!("--placement {}: {e}", path.display())))?;
    let trainer = build_trainer_with_plan(graph, devices, &plan, config).map_err(input_error)?;
    Ok((plan, trainer))
}

/// Sets every stage's learning rate.
fn set_lr(trainer: &Trainer, lr: f64) -> anyhow::Result<()> {
    for result in trainer.with_optimizers(move |optimizer, _| optimizer.set_lr(lr))? {
        result?;
    }
    Ok(())
}

/// Runs `conveyor train`.
pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    if args.devices == "list" {
        list_devices();
        return Ok(());
    }
    // Every output path, before anything is loaded or trained.
    outputs::check(&args)?;
    let recorder = install_subscriber(args.trace.is_some() || args.svg.is_some());
    if args.init.is_some() && args.resume.is_some() {
        return Err(usage("--init and --resume both set the parameters; give one"));
    }
    let mut splits = data_source::load(&args.data, args.seed, args.test_fraction, args.classes)?;
    let model_text = match (&args.model, &args.resume) {
        (Some(model), _) => model.clone(),
        (None, Some(path)) => checkpointing::model_of(path)?,
        (None, None) => match args.data.strip_prefix("tokens:").map(|r| r.split(',').collect::<Vec<_>>()) {
            // Token data: a small transformer over its vocabulary and sequence length.
            Some(p) if p.len() == 4 => format!("transformer:{},{},32,4,2,{}", p[2].trim(), p[1].trim(), p[3].trim()),
            _ => data_source::default_model(&splits.train),
        },
    };
    let spec: ModelSpec =
        model_text.parse().map_err(|e| usage(format!("--model: invalid model spec {}", engine_reason(e))))?;
    let schedule: ScheduleKind = args.schedule.parse().map_err(|e| usage(format!("--schedule: {e}")))?;
    if args.chunks == 0 {
        return Err(usage("--chunks 0: each device needs at least 1 chunk; give --chunks 1 or more"));
    }
    if args.chunks > 1 && !schedule.supports_chunks() {
        return Err(usage(format!("--chunks {} needs --schedule interleaved", args.chunks)));
    }
    let recompute: Recompute =
        args.recompute.parse().map_err(|e| usage(format!("--recompute {}", engine_reason(e))))?;
    let core_slots: conveyor::engine::runtime::CoreSlotPolicy =
        args.core_slots.parse().map_err(|e| usage(format!("--core-slots {}", engine_reason(e))))?;
    let lr_schedule: LrSchedule = args.lr_schedule.parse()?;
    let on_nonfinite: OnNonFinite = args.on_nonfinite.parse()?;
    let budget = args.device_memory.as_deref().map(parse_size).transpose()?;
    let mut devices = parse_devices(&args.devices, budget)?;
    let k = args.tensor_parallel;
    devices.truncate(checks::devices_used(args.stages, k, args.chunks, &args.devices, devices.len())?);
    if devices.len() % k != 0 {
        return Err(usage(format!(
            "--tensor-parallel {k}: the {} devices do not split into groups of {k}; give stages x {k} devices",
            devices.len()
        )));
    }
    if k > 1 && args.placement != "auto" {
        return Err(usage("--placement FILE is not supported with --tensor-parallel yet; use --placement auto"));
    }
    if args.microbatches == 0 || args.batch == 0 {
        return Err(usage(format!(
            "--batch {} --microbatches {}: a batch needs at least 1 row and 1 micro-batch; give both at least 1",
            args.batch, args.microbatches
        )));
    }
    if args.microbatches > args.batch {
        return Err(usage(format!(
            "--microbatches {} is more than the {} rows of a batch; use at most --microbatches {}",
            args.microbatches, args.batch, args.batch
        )));
    }
    for (flag, value) in [("--eval-every", args.eval_every), ("--checkpoint-every", args.checkpoint_every)] {
        if value == Some(0) {
            return Err(usage(format!("{flag} must be at least 1, got 0; give {flag} N with N >= 1 or leave it out")));
        }
    }
    if args.checkpoint_every.is_some() && args.checkpoint.is_none() {
        return Err(usage(
            "--checkpoint-every needs --checkpoint FILE to write the checkpoints to; add --checkpoint FILE or drop --checkpoint-every",
        ));
    }
    let optimizer = parse_optimizer(&args.optimizer, args.lr, args.momentum, args.weight_decay)?;
    let base_lr = optimizer.lr();
    let graph = spec.build(args.seed).map_err(|e| usage(format!("--model {model_text}: {}", engine_reason(e))))?;
    let n_outputs = graph.node(graph.output()?)?.output_shape.dims().iter().product::<usize>();
    data_source::fit_to_model(&mut splits, &spec, &model_text, n_outputs, args.classes)?;
    let data_source::Splits { train, test } = splits;
    if args.batch > train.len() {
        return Err(usage(format!(
            "--batch {} is larger than the {} training rows; give --batch at most {}",
            args.batch,
            train.len(),
            train.len()
        )));
    }
    let config = PipelineConfig {
        schedule,
        n_chunks: args.chunks,
        n_micro_batches: args.microbatches,
        batch_rows: args.batch,
        optimizer,
        recompute,
        seed: args.seed,
        core_slots,
    };
    // The pipeline's width: one worker per group of `k` devices.
    let n_devices = devices.len() / k;
    let (plan, mut trainer) = if k > 1 {
        drop(graph);
        conveyor::pipeline::build_trainer_tensor_parallel(&spec, args.seed, devices, k, &config).map_err(input_error)?
    } else {
        place_and_build(graph, devices, &config, &args.placement)?
    };
    // One label per worker: its device, or its group of devices joined with `+`.
    let worker_labels: Vec<String> = trainer
        .device_groups()
        .iter()
        .map(|group| group.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("+"))
        .collect();
    let steps_per_epoch = (train.len() / args.batch) as u64;
    let total_steps = checks::total_steps(args.steps, args.epochs, steps_per_epoch)?;
    let (momentum, weight_decay) = checks::hyperparameters(&optimizer);
    let mut state = RunState {
        step: 0,
        steps_per_epoch,
        seed: args.seed,
        batch: args.batch,
        shuffle: !args.no_shuffle,
        train_rows: train.len(),
        model: model_text.clone(),
        data: args.data.clone(),
        optimizer: args.optimizer.clone(),
        lr: base_lr,
        lr_schedule: lr_schedule.to_string(),
        total_steps,
        micro_batches: Some(args.microbatches),
        momentum: Some(momentum),
        weight_decay: Some(weight_decay),
        data_fingerprint: Some(conveyor::cli_input::data_fingerprint(&train)),
    };
    let mut resumed_note = None;
    if let Some(path) = &args.init {
        let n = checkpointing::init(path, &mut trainer)?;
        resumed_note = Some(format!("initialised {n} parameter tensors from {}", path.display()));
    }
    if let Some(path) = &args.resume {
        let saved = checkpointing::resume(path, &mut trainer, &state)?;
        state.step = saved.step;
        let mut note = format!("resumed from {} at step {}", path.display(), saved.step);
        let horizon_matters = lr_schedule == LrSchedule::Cosine && saved.total_steps != total_steps;
        if (saved.lr, &saved.lr_schedule) != (base_lr, &state.lr_schedule) || horizon_matters {
            note.push_str(&format!(
                " (it ran lr {} {} over {} steps; this run uses lr {base_lr} {} over {total_steps}, so it will not match an uninterrupted run)",
                saved.lr, saved.lr_schedule, saved.total_steps, state.lr_schedule
            ));
        }
        resumed_note = Some(note);
    }
    let first_step = state.step;
    outln!(
        "conveyor train: {model_text} on {} ({} train rows{}), {n_devices} device(s), {schedule}{}, {} micro-batches of {} rows, {} lr {base_lr} ({lr_schedule})",
        args.data,
        train.len(),
        test.as_ref().map(|t| format!(", {} test rows", t.len())).unwrap_or_default(),
        if args.chunks > 1 { format!(" x{} chunks", args.chunks) } else { String::new() },
        args.microbatches,
        args.batch.div_ceil(args.microbatches),
        optimizer.name(),
    );
    for stage in &plan.stages {
        outln!(
            "  stage {} on {}: {} ({} parameters)",
            stage.stage_idx,
            worker_labels[trainer.schedule().device_of_stage(stage.stage_idx)],
            stage.node_names.join(" "),
            stage.n_params
        );
    }
    for note in conveyor::pipeline::memory_notes(&plan) {
        outln!("  {note}");
    }
    if let Some(note) = resumed_note {
        outln!("{note}");
    }
    if first_step >= total_steps && args.resume.is_some() {
        outln!("the checkpoint is already at step {first_step} of --steps {total_steps}; nothing to train");
    }
    // From here a first SIGINT or SIGTERM stops the run between steps, with its outputs written.
    interrupt::install().map_err(|e| anyhow::anyhow!("could not install the signal handler: {e}"))?;
    let mut interrupted = None;
    let mut metrics = args.metrics.as_deref().map(|path| outputs::LineOutput::create("--metrics", path)).transpose()?;
    let mut trace = match &args.trace {
        Some(path) => Some(outputs::TraceStream::create(path, n_devices, worker_labels.clone())?),
        None => None,
    };
    // The last step's events, for --svg (start times from the recorder's origin).
    let (mut last_step_events, mut last_step_origin_s): (Vec<TimelineEvent>, f64) = (Vec::new(), 0.0);
    let progress = Progress::new(first_step, total_steps, steps_per_epoch);
    let started = Instant::now();
    let mut last_report = None;
    // The bubble summary averages the last few steps: one step's figures move by several points.
    const BUBBLE_STEPS: usize = 5;
    let mut recent_reports: std::collections::VecDeque<conveyor::engine::runtime::StepReport> = Default::default();
    let mut samples = 0u64;
    let mut compute_s = 0.0;
    let mut order = Vec::new();
    let mut order_epoch = None;
    let mut current_lr = base_lr;
    let (mut last_step_start_s, mut last_step_end_s) = (0.0, 0.0);
    let (mut skipped_steps, mut skipped_in_a_row) = (0u64, 0u64);
    // A non-finite step under `--on-nonfinite error` (or too many skipped): the run stops after
    // writing its outputs from the last good step.
    let mut diverged: Option<conveyor::engine::Error> = None;
    let mut periodic_failure: Option<anyhow::Error> = None;
    for step in first_step..total_steps {
        if let Some(signal) = interrupt::requested() {
            interrupted = Some(signal);
            break;
        }
        if let Some(recorder) = &recorder {
            last_step_start_s = recorder.now_s();
        }
        let epoch = step / steps_per_epoch.max(1);
        let within = (step % steps_per_epoch.max(1)) as usize;
        if order_epoch != Some(epoch) {
            order = data::epoch_order(train.len(), !args.no_shuffle, args.seed, epoch);
            order_epoch = Some(epoch);
        }
        let lr = lr_schedule.lr(base_lr, step, total_steps);
        if lr != current_lr {
            set_lr(&trainer, lr)?;
            current_lr = lr;
        }
        let indices = &order[within * args.batch..(within + 1) * args.batch];
        let (x, y) = train.batch(indices)?;
        let report = match trainer.train_step(&x, &y) {
            Ok(report) => {
                skipped_in_a_row = 0;
                report
            }
            Err(error @ conveyor::engine::Error::NonFiniteStep { .. }) => {
                let skip = match on_nonfinite {
                    OnNonFinite::Skip { max_in_a_row } => skipped_in_a_row < max_in_a_row,
                    OnNonFinite::Error => false,
                };
                if !skip {
                    if let OnNonFinite::Skip { max_in_a_row } = on_nonfinite {
                        progress.println(format!("giving up after {max_in_a_row} non-finite steps in a row"));
                    }
                    diverged = Some(error);
                    break;
                }
                // Skipped like a loss scaler's step: the batch is consumed, nothing changes. The
                // trainer's step count follows the run's, as a resume sets it.
                skipped_steps += 1;
                skipped_in_a_row += 1;
                trainer.set_step_idx(step + 1);
                state.step = step + 1;
                progress.println(format!("step {} skipped: {error}", step + 1));
                if let Some(out) = metrics.as_mut() {
                    out.line(&serde_json::json!({
                        "step": step + 1,
                        "epoch": epoch,
                        "skipped": true,
                        "skipped_steps": skipped_steps,
                        "lr": lr,
                    }));
                }
                continue;
            }
            // The trainer's parameters are no longer one step's: nothing may be saved from them.
            Err(error @ conveyor::engine::Error::Poisoned { .. }) => return Err(error.into()),
            // Any other failed step changed nothing (steps are all-or-nothing): stop, and still
            // write every output from the last good step, so a trained model is never lost.
            Err(error) => {
                errln!("error: step {} failed: {error}; writing the outputs from step {}", step + 1, state.step);
                diverged = Some(error);
                break;
            }
        };
        if let Some(recorder) = &recorder {
            last_step_end_s = recorder.now_s();
        }
        state.step = step + 1;
        samples += args.batch as u64;
        compute_s += report.step_s;
        progress.step_done(step + 1, steps_per_epoch, report.loss);
        let eval_now = args.eval_every.is_some_and(|n| (step + 1) % n == 0);
        // None also when a signal stopped the evaluation midway.
        let eval_accuracy = match (&test, eval_now) {
            (Some(test), true) => summary::accuracy(&mut trainer, test, args.batch, args.microbatches)?,
            _ => None,
        };
        if let Some(recorder) = &recorder {
            let (events, memory) = recorder.drain();
            last_step_events = events
                .iter()
                .filter(|e| e.start_s >= last_step_start_s && e.start_s < last_step_end_s)
                .copied()
                .collect();
            last_step_origin_s = last_step_start_s;
            if let Some(trace) = trace.as_mut() {
                trace.write(&events, &memory_samples(&memory));
            }
        }
        if let Some(out) = metrics.as_mut() {
            let mut line = serde_json::json!({
                "step": step + 1,
                "epoch": epoch,
                "loss": report.loss,
                "lr": lr,
                "step_s": report.step_s,
                "samples_per_s": args.batch as f64 / report.step_s,
                "grad_norm": report.grad_norm,
                "bubble_fraction": report.timeline.bubble_fraction(),
                "skipped_steps": skipped_steps,
            });
            if let Some(accuracy) = eval_accuracy {
                line["test_accuracy"] = accuracy.into();
            }
            out.line(&line);
        }
        let log_now = args.log_every > 0 && ((step + 1) % args.log_every == 0 || step + 1 == total_steps);
        if log_now || eval_accuracy.is_some() {
            let mut line = format!(
                "step {:>5}/{total_steps}  epoch {epoch}  loss {:.4}  lr {lr:.2e}  {:.0} samples/s",
                step + 1,
                report.loss,
                args.batch as f64 / report.step_s
            );
            if let Some(accuracy) = eval_accuracy {
                line.push_str(&format!("  test accuracy {:.2}%", accuracy * 100.0));
            }
            progress.println(line);
        }
        if let (Some(path), Some(every)) = (&args.checkpoint, args.checkpoint_every)
            && (step + 1) % every == 0
            && step + 1 != total_steps
        {
            // A periodic checkpoint that cannot be written (a full disk) leaves the previous file
            // whole and does not stop the training; the run still ends with that error.
            match checkpointing::save(path, &mut trainer, &state, false, "--checkpoint") {
                Ok(()) => tracing::info!(step = step + 1, path = %path.display(), "checkpoint saved"),
                Err(error) => {
                    errln!(
                        "warning: the checkpoint of step {} was not written ({error:#}); training goes on",
                        step + 1
                    );
                    periodic_failure.get_or_insert(error);
                }
            }
        }
        if recent_reports.len() == BUBBLE_STEPS {
            recent_reports.pop_front();
        }
        recent_reports.push_back(report.clone());
        last_report = Some(report);
    }
    progress.finish();
    let wall_s = started.elapsed().as_secs_f64();
    // A stopped run skips the final evaluation: the user asked for the outputs, now.
    let accuracy = match (&test, interrupted) {
        (Some(test), None) => summary::accuracy(&mut trainer, test, args.batch, args.microbatches)?,
        _ => None,
    };
    if let Some(recorder) = &recorder {
        let (events, memory) = recorder.drain();
        if let Some(trace) = trace.as_mut() {
            trace.write(&events, &memory_samples(&memory));
        }
    }
    let steps_run = state.step.saturating_sub(first_step);
    outln!(
        "\ntrained {steps_run} steps in {wall_s:.2} s: {:.0} samples/s",
        samples as f64 / compute_s.max(f64::MIN_POSITIVE)
    );
    if let Some(report) = &last_report {
        outln!("final loss {:.4}", report.loss);
    }
    if let Some(acc) = accuracy {
        outln!("test accuracy {:.2}% ({} rows)", acc * 100.0, test.as_ref().map_or(0, data::Dataset::len));
    }
    let sched = Schedule::new(schedule, n_devices, args.microbatches, args.chunks)?;
    let mut bubble = None;
    if let Some(report) = &last_report {
        // Bubble summary: measured over the last steps, against theory and the simulator fed each
        // step's measured op costs.
        let theory = simulate(&sched, &CostModel::uniform(StageCosts::UNIT))?.bubble_fraction;
        // With a core per worker, the measured wall durations are the op costs. With more workers
        // than cores the trainer gives compute ops core slots (first come first served), so an op
        // still runs on a core of its own and the simulator queues ops for the same slots.
        // Without slots (disabled), each op's thread CPU time is its cost and the simulator shares
        // the cores between running ops.
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let predict = |report: &conveyor::engine::runtime::StepReport| -> anyhow::Result<(f64, String)> {
            Ok(if let Some(slots) = report.core_slots {
                let costs = summary::measured_costs(&report.timeline, sched.n_stages());
                let wake_s = report.core_wake_latency_s.unwrap_or(0.0);
                let simulated = simulate_with_core_slots(&sched, &costs, slots, wake_s)?;
                (
                    simulated.bubble_fraction,
                    format!("measured op times, {slots} core slots, {:.2} ms wake-up", wake_s * 1e3),
                )
            } else if n_devices > cores {
                let simulated = simulate_on_cores(&sched, &summary::cpu_costs(report, sched.n_stages()), cores)?;
                (simulated.bubble_fraction, format!("op CPU times, {cores} cores shared"))
            } else {
                // Each device sleeps while it waits: a message reaches it when the OS wakes it.
                let latency_s = summary::delivery_latency_s(&report.timeline);
                let costs = summary::measured_costs(&report.timeline, sched.n_stages())
                    .with_link(conveyor::schedules::Link { latency_s, bandwidth_bytes_per_s: f64::INFINITY });
                let simulated = simulate(&sched, &costs)?;
                (simulated.bubble_fraction, format!("measured op times, {:.2} ms delivery", latency_s * 1e3))
            })
        };
        let (mut measured, mut predicted, mut cost_basis) = (0.0, 0.0, String::new());
        for recent in &recent_reports {
            let (p, basis) = predict(recent)?;
            measured += recent.timeline.bubble_fraction() / recent_reports.len() as f64;
            predicted += p / recent_reports.len() as f64;
            cost_basis = basis;
        }
        if report.core_slots.is_none() && n_devices > cores {
            // With workers sharing cores, a device "idles" while its thread waits for a core too;
            // compare the cores' idle time instead: 1 - CPU time of all ops / (cores x makespan).
            let simulated = simulate_on_cores(&sched, &summary::cpu_costs(report, sched.n_stages()), cores)?;
            let cpu_total: f64 = report.op_cpu_times.iter().map(|t| t.cpu_s).sum();
            let measured_core_idle = 1.0 - cpu_total / (cores as f64 * report.timeline.makespan_s());
            let simulated_core_idle = 1.0 - cpu_total / (cores as f64 * simulated.makespan_s);
            outln!(
                "cores idle on the last step ({n_devices} workers on {cores} cores): measured {:.1}%, simulated with shared cores {:.1}%",
                measured_core_idle * 100.0,
                simulated_core_idle * 100.0
            );
        }
        let inflight = simulated_inflight(schedule, n_devices, args.microbatches, args.chunks)?;
        outln!(
            "bubble (mean of the last {} steps): measured {:.1}%, simulator with {cost_basis} {:.1}%, schedule theory (equal costs) {:.1}%",
            recent_reports.len(),
            measured * 100.0,
            predicted * 100.0,
            theory * 100.0
        );
        summary::print_devices(report, &worker_labels, k, &inflight, &|line| outln!("{line}"));
        if k > 1 {
            for (device, peak) in trainer.devices().iter().zip(&report.peak_memory) {
                outln!("  {device}: peak memory {}", conveyor::engine::placement::format_bytes(*peak));
            }
        }
        bubble = Some((measured, predicted));
    }
    // The outputs, most valuable first; a failure is reported and the others are still written.
    let mut failures: Vec<anyhow::Error> = Vec::new();
    let mut attempt = |result: anyhow::Result<()>| {
        if let Err(error) = result {
            failures.push(error);
        }
    };
    if let Some(path) = &args.save {
        attempt(checkpointing::save(path, &mut trainer, &state, true, "--save").map(|()| {
            outln!("saved the parameters at step {} to {}", state.step, path.display());
        }));
    }
    if let Some(path) = &args.checkpoint {
        attempt(checkpointing::save(path, &mut trainer, &state, false, "--checkpoint").map(|()| {
            outln!("saved a training checkpoint at step {} to {}", state.step, path.display());
        }));
    }
    if let (Some(mut out), Some(path)) = (metrics.take(), &args.metrics) {
        let summary = serde_json::json!({
            "summary": true,
            "steps": state.step,
            "skipped_steps": skipped_steps,
            "stopped_non_finite": diverged.as_ref().filter(|e| matches!(e, conveyor::engine::Error::NonFiniteStep { .. })).map(|e| e.to_string()),
            "stopped_by_error": diverged.as_ref().filter(|e| !matches!(e, conveyor::engine::Error::NonFiniteStep { .. })).map(|e| e.to_string()),
            "interrupted": interrupted.map(interrupt::signal_name),
            "final_loss": last_report.as_ref().map(|r| r.loss),
            "test_accuracy": accuracy,
            "peak_memory_bytes": last_report.as_ref().map(|r| r.peak_memory.clone()),
            "bubble_fraction": bubble.map(|b| b.0),
            "predicted_bubble_fraction": bubble.map(|b| b.1),
            "samples_per_s": samples as f64 / compute_s.max(f64::MIN_POSITIVE),
        });
        out.line(&summary);
        attempt(out.finish().map(|()| {
            outln!("wrote the metrics of {} steps to {}", state.step - first_step, path.display());
        }));
    }
    if let (Some(trace), Some(path)) = (trace.take(), &args.trace) {
        attempt(trace.finish().map(|ops| outln!("wrote a trace of {ops} ops to {}", path.display())));
    }
    if let Some(path) = &args.svg {
        let mut last_step = Timeline::new(n_devices, sched.n_stages());
        last_step.events = last_step_events
            .iter()
            .map(|e| TimelineEvent {
                start_s: e.start_s - last_step_origin_s,
                end_s: e.end_s - last_step_origin_s,
                ..*e
            })
            .collect();
        let title = format!("{schedule}, p={n_devices}, m={}, measured (last step)", args.microbatches);
        let options = SvgOptions { title, device_labels: worker_labels.clone(), ..SvgOptions::default() };
        attempt(super::write_atomically(path, "--svg", &svg_gantt(&last_step, &options)).map(|()| {
            outln!("wrote the last step's chart to {}", path.display());
        }));
    }
    let first_failure = (!failures.is_empty()).then(|| failures.remove(0)).or(periodic_failure);
    for other in &failures {
        errln!("error: {other:#}");
    }
    // A signal during the final writes counts too: the run stops as if it came between steps.
    let interrupted = interrupted.or_else(interrupt::requested);
    if let Some(signal) = interrupted
        && diverged.is_none()
        && first_failure.is_none()
    {
        return Err(anyhow::Error::new(interrupt::Interrupted { signal, step: state.step, total_steps }));
    }
    if let Some(failure) = first_failure {
        return Err(failure);
    }
    match diverged {
        Some(error) => Err(anyhow::Error::new(error)),
        None => Ok(()),
    }
}

/// The recorder's memory points as the trace exporter's samples.
fn memory_samples(points: &[MemoryPoint]) -> Vec<MemorySample> {
    points.iter().map(|m| MemorySample { device_idx: m.device_idx, time_s: m.time_s, bytes: m.bytes }).collect()
}
