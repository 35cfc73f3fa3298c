//! `conveyor train`: trains a model from the zoo on a dataset across devices with a pipeline
//! schedule, printing progress, accuracy, throughput and the bubble summary.
//!
//! A thin layer over the run spec: flags -> [`conveyor::RunSpec`] (over `--config`) -> validate ->
//! prepare (data, model, placement, trainer; `conveyor::spec`) -> the training loop here.
//!
//! Code map: `args.rs` holds the flags and how they override the spec (and the optimizer parser
//! `conveyor plan` shares); `checkpointing.rs` holds `--save`, `--resume` and `--init`;
//! `outputs.rs` checks every output path before the run and streams the metrics and the trace;
//! `progress.rs` the progress bars; `summary.rs` the accuracy (the bubble summary is the engine's
//! `Trainer::bubbles`); `strategies.rs` the run through the data-parallel strategies (`--sync`
//! other than allreduce, `--compress`, `--interleaving`). This file wires them into one run.
//!
//! Whatever ends the run (its last step, a non-finite step, Ctrl-C or SIGTERM), the outputs are
//! written in order of value: `--save`, `--checkpoint`, `--metrics`, `--trace`, `--svg`; one that
//! fails does not stop the others. Everything printed goes through `console` (a closed or full
//! stdout never stops the run).
//!
//! Under MPI (`cli::ranks`) every rank runs this same loop and makes the same trainer calls in the
//! same order (steps, evaluations, `--save`, `--checkpoint`: each is a collective), and nothing
//! rank-dependent may change that sequence: a stop asked by a signal is agreed by every rank before
//! each step and evaluation chunk ([`agreed_stop`]), so all stop at the same point. Rank 0 owns the
//! user's view: it alone prints (the others are silenced), writes `--metrics`, `--trace` and `--svg`
//! (`Trainer::writes_files`; the trainer's saves gather on every rank and write on rank 0), and
//! draws no progress bars. The trace and the chart come from the steps' gathered timelines
//! (every rank's ops on rank 0's clock) instead of this process's op recorder, which sees only
//! rank 0's worker.
mod args;
mod books;
mod checkpointing;
mod outputs;
mod progress;
mod strategies;
pub(crate) mod summary;

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use args::{LrSchedule, OnNonFinite, TrainArgs, parse_devices, parse_optimizer, parse_size};
use checkpointing::RunState;
use conveyor::data;
use conveyor::engine::Device;
use conveyor::engine::placement::{AutoPlacement, format_seconds};
use conveyor::engine::runtime::ReplicaShares;
use conveyor::engine::trace::{MemoryPoint, TimelineRecorder, timeline_filter};
use conveyor::engine::transport::Transport;
use conveyor::schedules::export::{MemorySample, SvgOptions, svg_gantt};
use conveyor::schedules::{Schedule, Timeline, TimelineEvent};
use conveyor::spec::SpecError;
pub(crate) use outputs::same_output;
use progress::Progress;

use super::console::{self, errln, outln};
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
        Ok(device) => outln!(
            "cuda: {device} is available; `--devices cuda:0,1` lists GPUs, `cuda:0x4` splits one into 4 logical devices"
        ),
        Err(e) => outln!("cuda: unavailable ({e})"),
    }
}

/// How long a rank waits for the others to agree on stopping: as long as the trainer waits in its
/// own collectives (a rank may be writing a large checkpoint while the others wait).
const AGREE_TIMEOUT: Duration = Duration::from_secs(600);

/// The signal that stops the run before its next step or evaluation chunk, if any. In one process,
/// the first signal received ([`interrupt::requested`]); across ranks (`ranks`: an MPI job of more
/// than one rank), the first rank's that received one, agreed by an all-gather every rank makes at
/// the same point, so every rank stops at the same step and makes the same trainer calls. (A signal
/// reaches each rank at its own moment; a rank stopping alone would leave the others waiting in
/// its next collective.)
fn agreed_stop(ranks: Option<&Arc<dyn Transport>>) -> anyhow::Result<Option<i32>> {
    let mine = interrupt::requested();
    let Some(ranks) = ranks else { return Ok(mine) };
    let all = ranks.all_gather(mine.unwrap_or(0).to_le_bytes().to_vec(), AGREE_TIMEOUT)?;
    Ok(all
        .iter()
        .filter_map(|bytes| Some(i32::from_le_bytes(bytes.as_slice().try_into().ok()?)))
        .find(|&signal| signal != 0))
}

/// A spec error for the user: planning and building errors they can fix (bad schedule, does not
/// fit) named by their flags as ever; everything else a usage error (exit status 2).
fn spec_error(e: SpecError) -> anyhow::Error {
    match e {
        // Every rank of an MPI job reaches this together (`cli::ranks`).
        SpecError::Engine(e @ conveyor::engine::Error::WorldSize { .. }) => anyhow::Error::new(e),
        SpecError::Engine(e) => super::messages::engine_input_error(e),
        other => usage(other.to_string()),
    }
}

/// Runs `conveyor train`: the flags become a run spec (over `--config`), which is validated,
/// printed (`--print-config`) or prepared and trained.
pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    if args.devices.as_deref() == Some("list") {
        list_devices();
        return Ok(());
    }
    let mut spec = args.to_spec()?;
    spec.validate().map_err(spec_error)?;
    if args.auto_schedule() {
        spec = super::plan_auto::resolve_for_train(spec)?;
    }
    if args.print_config {
        console::out(&spec.to_toml_string().map_err(spec_error)?);
        return Ok(());
    }
    // Every output path, before anything is loaded or trained (on every rank under MPI: the
    // checks only probe, and a rank that fails them ends the job before it starts).
    outputs::check(&spec)?;
    // Several ranks (MPI): the trace and the chart come from the steps' gathered timelines, so no
    // rank records its ops (rank 0's recorder would see only its own worker).
    let ranks = super::ranks::start(args.transport)?.filter(|t| t.world_size() > 1);
    let record_ops = ranks.is_none() && (spec.outputs.trace.is_some() || spec.outputs.svg.is_some());
    let recorder = install_subscriber(record_ops);
    // `--sync` other than allreduce, `--compress`, `--interleaving`: the strategies' own loop.
    if spec.pipeline.uses_strategy() {
        return strategies::run(spec, ranks);
    }
    let mut run = spec.prepare().map_err(spec_error)?;
    let (schedule, lr_schedule, on_nonfinite) =
        (spec.pipeline.schedule, spec.optimizer.lr_schedule, spec.training.on_nonfinite);
    let (batch, microbatches) = (spec.training.batch, spec.pipeline.microbatches);
    let model_text = run.model_text().to_string();
    let optimizer = run.optimizer;
    let base_lr = run.base_lr();
    // The pipeline's width: one worker per group of --tensor-parallel devices (in each replica).
    let n_devices = run.pipeline_devices;
    let replicas = run.trainer.replicas();
    // One label per worker: its device, or its group of devices joined with `+`.
    let worker_labels: Vec<String> = run
        .trainer
        .device_groups()
        .iter()
        .map(|group| group.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("+"))
        .collect();
    // Rows of the trace and the chart: with several stages per device (interleaved, or the V of
    // zb-v and dualpipe-v) each names its stages, `cpu:0: stages 0, 7`.
    let stage_labels = run.trainer.schedule().device_stage_labels();
    let row_labels: Vec<String> = worker_labels
        .iter()
        .enumerate()
        .map(|(w, label)| match run.trainer.schedule().n_chunks() {
            1 => label.clone(),
            _ => format!("{label}: {}", stage_labels[w % n_devices]),
        })
        .collect();
    let (steps_per_epoch, total_steps) = (run.steps_per_epoch, run.total_steps);
    let mut state = RunState::starting(&run.spec, &optimizer, &run.train, &model_text, steps_per_epoch, total_steps);
    let mut resumed_note = None;
    if let Some(path) = &spec.checkpoint.init {
        let n = checkpointing::init(path, &mut run.trainer)?;
        resumed_note = Some(format!("initialised {n} parameter tensors from {}", path.display()));
    }
    if let Some(path) = &spec.checkpoint.resume {
        let saved = checkpointing::resume(path, &mut run.trainer, &state)?;
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
    let test = run.test.take();
    let first_step = state.step;
    outln!(
        "conveyor train: {model_text} on {} ({} train rows{}), {n_devices} device(s){}, {schedule}{}, {} micro-batches of {} rows{}, {} lr {base_lr} ({lr_schedule}){}",
        spec.data.source,
        run.train.len(),
        test.as_ref().map(|t| format!(", {} test rows", t.len())).unwrap_or_default(),
        if replicas > 1 { format!(" x {replicas} data-parallel replicas") } else { String::new() },
        if spec.pipeline.chunks > 1 { format!(" x{} chunks", spec.pipeline.chunks) } else { String::new() },
        microbatches,
        batch.div_ceil(replicas * microbatches),
        if replicas > 1 { " per replica" } else { "" },
        optimizer.name(),
        match spec.training.precision {
            conveyor::spec::Precision::F32 => String::new(),
            precision => format!(", {precision} mixed precision"),
        },
    );
    if replicas > 1 {
        for replica in 1..replicas {
            let labels = &worker_labels[replica * n_devices..(replica + 1) * n_devices];
            outln!("  replica {replica} on {}: the same stages", labels.join(", "));
        }
    }
    for stage in &run.plan.stages {
        outln!(
            "  stage {} on {}: {} ({} parameters)",
            stage.stage_idx,
            worker_labels[run.trainer.schedule().device_of_stage(stage.stage_idx)],
            stage.node_names.join(" "),
            stage.n_params
        );
    }
    for note in conveyor::pipeline::memory_notes(&run.plan) {
        outln!("  {note}");
    }
    if let Some(AutoPlacement::Profiled { estimated_cut_s, measured_cut_s, used_measured, profile_s }) =
        run.auto_placement
    {
        let (estimated, measured) = (format_seconds(estimated_cut_s), format_seconds(measured_cut_s));
        outln!(
            "  placement auto: the layers' times measured in {} put the slowest stage at {measured} per micro-batch \
             with the measured cut and {estimated} with the cost model's; {}",
            format_seconds(profile_s),
            if used_measured { "using the measured cut" } else { "keeping the cost model's cut (within 10%)" }
        );
    }
    if spec.pipeline.overlap_steps.is_on() {
        match run.trainer.overlap_unavailable() {
            Some(why) => outln!("  overlapped steps: off ({why})"),
            None => outln!(
                "  overlapped steps: each stage starts the next step once it applied its own update; steps are \
                 validated after"
            ),
        }
    }
    if let Some(note) = resumed_note {
        outln!("{note}");
    }
    if first_step >= total_steps && spec.checkpoint.resume.is_some() {
        outln!("the checkpoint is already at step {first_step} of --steps {total_steps}; nothing to train");
    }
    // From here a first SIGINT or SIGTERM stops the run between steps, with its outputs written.
    interrupt::install().map_err(|e| anyhow::anyhow!("could not install the signal handler: {e}"))?;
    let mut interrupted = None;
    // Only rank 0 writes files (every rank checked the paths above).
    let writes_files = run.trainer.writes_files();
    let mut metrics = match &spec.outputs.metrics {
        Some(path) if writes_files => Some(outputs::LineOutput::create("--metrics", path)?),
        _ => None,
    };
    // With a rank per tensor-parallel shard the trace has a row per rank, named by its device.
    // A row per worker (every replica's pipeline devices), or per device with a rank per shard.
    let ranks_per_worker = run.trainer.ranks_per_worker();
    let trace_labels: Vec<String> = match ranks_per_worker {
        1 => row_labels.clone(),
        _ => run.trainer.devices().iter().map(Device::to_string).collect(),
    };
    let mut trace = match &spec.outputs.trace {
        Some(path) if writes_files => {
            Some(outputs::TraceStream::create(path, trace_labels.len(), trace_labels, ranks.is_some())?)
        }
        _ => None,
    };
    let progress = Progress::new(first_step, total_steps, steps_per_epoch, ranks.is_none());
    let started = Instant::now();
    // A non-finite step under `--on-nonfinite error` (or too many skipped): the run stops after
    // writing its outputs from the last good step.
    let mut diverged: Option<conveyor::engine::Error> = None;
    let mut periodic_failure: Option<anyhow::Error> = None;
    let eval_every = spec.training.eval_every;
    let checkpoint_every = spec.checkpoint.path.as_ref().and(spec.checkpoint.every);
    let facts = books::RunFacts {
        batch,
        total_steps,
        steps_per_epoch,
        log_every: spec.training.log_every,
        base_lr,
        lr_schedule,
        gathered_trace: ranks.is_some().then_some(ranks_per_worker),
    };
    let overlapped = run.trainer.overlaps_steps();
    let mut books =
        books::StepBooks::new(facts, &mut state, &progress, (&mut metrics, &mut trace), recorder.as_ref(), overlapped);
    // The steps run in stretches of `Trainer::fit` (overlapped with --overlap-steps on). A
    // stretch ends where the loop needs the trainer itself: after a step followed by an
    // evaluation or a periodic checkpoint, at a failed step, at a signal, or at the end.
    let mut step = first_step;
    while step < total_steps {
        if let Some(signal) = agreed_stop(ranks.as_ref())? {
            interrupted = Some(signal);
            break;
        }
        let end = stretch_end(step, total_steps, [eval_every, checkpoint_every]);
        books.step_starts();
        let mut last_of_stretch: Option<(conveyor::engine::runtime::StepReport, f64)> = None;
        let mut stop: Option<anyhow::Result<i32>> = None;
        let (taken, outcome) = run.fit_steps(step..end, |at, report| {
            let step_s = books.step_time(report);
            if at + 1 == end {
                // Recorded after its evaluation, if one follows.
                books.step_ends();
                last_of_stretch = Some((report.clone(), step_s));
                return ControlFlow::Continue(());
            }
            books.after_step(at, report, step_s, None);
            // A signal stops the run before the next step (every rank agrees on it).
            match agreed_stop(ranks.as_ref()) {
                Ok(None) => ControlFlow::Continue(()),
                Ok(Some(signal)) => {
                    stop = Some(Ok(signal));
                    ControlFlow::Break(())
                }
                Err(error) => {
                    stop = Some(Err(error));
                    ControlFlow::Break(())
                }
            }
        });
        step += taken;
        if let Some((report, step_s)) = last_of_stretch {
            let eval_now = eval_every.is_some_and(|n| step.is_multiple_of(n));
            // None also when a signal stopped the evaluation midway.
            let eval_accuracy = match (&test, eval_now) {
                (Some(test), true) => {
                    summary::accuracy(&mut run.trainer, test, batch, replicas * microbatches, || {
                        Ok(agreed_stop(ranks.as_ref())?.is_some())
                    })?
                }
                _ => None,
            };
            books.after_step(step - 1, &report, step_s, eval_accuracy);
            if let (Some(path), Some(every)) = (&spec.checkpoint.path, spec.checkpoint.every)
                && step.is_multiple_of(every)
                && step != total_steps
            {
                // A periodic checkpoint that cannot be written (a full disk) leaves the previous
                // file whole and does not stop the training; the run still ends with that error.
                match checkpointing::save(path, &mut run.trainer, books.state, false, "--checkpoint") {
                    Ok(()) => tracing::info!(step, path = %path.display(), "checkpoint saved"),
                    Err(error) => {
                        errln!("warning: the checkpoint of step {step} was not written ({error:#}); training goes on");
                        periodic_failure.get_or_insert(error);
                    }
                }
            }
        }
        match stop {
            Some(Ok(signal)) => {
                interrupted = Some(signal);
                break;
            }
            Some(Err(error)) => return Err(error),
            None => {}
        }
        match outcome {
            Ok(()) => {}
            Err(error @ conveyor::engine::Error::NonFiniteStep { .. }) => {
                let skip = match on_nonfinite {
                    OnNonFinite::Skip { max_in_a_row } => books.records.skipped_in_a_row < max_in_a_row,
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
                run.trainer.set_step_idx(step + 1);
                books.skipped(step, &error);
                step += 1;
            }
            // The trainer's parameters are no longer one step's: nothing may be saved from them.
            Err(error @ conveyor::engine::Error::Poisoned { .. }) => return Err(error.into()),
            // Any other failed step changed nothing (steps are all-or-nothing): stop, and still
            // write every output from the last good step, so a trained model is never lost.
            Err(error) => {
                errln!("error: step {} failed: {error}; writing the outputs from step {step}", step + 1);
                diverged = Some(error);
                break;
            }
        }
    }
    let books::StepRecords {
        mut recent_reports,
        last_report,
        samples,
        compute_s,
        skipped_steps,
        replayed_steps,
        last_step_events,
        last_step_origin_s,
        ..
    } = books.into_records();
    progress.finish();
    let mut trainer = run.trainer;
    let wall_s = started.elapsed().as_secs_f64();
    // A stopped run skips the final evaluation: the user asked for the outputs, now.
    let accuracy = match (&test, interrupted) {
        (Some(test), None) => summary::accuracy(&mut trainer, test, batch, replicas * microbatches, || {
            Ok(agreed_stop(ranks.as_ref())?.is_some())
        })?,
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
    if replayed_steps > 0 {
        outln!(
            "{replayed_steps} overlapped step(s) ran twice: applied before their gradient norm was known, it clipped \
             (--clip-grad-norm), so each was rolled back and run again with the barrier"
        );
    }
    if let Some(report) = &last_report {
        outln!("final loss {:.4}", report.loss);
    }
    if let Some(acc) = accuracy {
        outln!("test accuracy {:.2}% ({} rows)", acc * 100.0, test.as_ref().map_or(0, data::Dataset::len));
    }
    let sched = Schedule::new(schedule, n_devices, spec.pipeline.microbatches, spec.pipeline.chunks)?;
    // Bubble summary: measured over the last steps, against theory and the simulator fed each
    // step's measured op costs.
    let bubble =
        if recent_reports.is_empty() { None } else { Some(trainer.bubbles(recent_reports.make_contiguous())?) };
    if let Some(bubble) = &bubble {
        outln!("{bubble}");
    }
    if replicas > 1 {
        let percent: Vec<String> = trainer.replica_fractions().iter().map(|f| format!("{:.1}%", f * 100.0)).collect();
        let how = match trainer.replica_shares_policy() {
            ReplicaShares::Auto if trainer.replica_shares_measuring() => "auto, still measuring",
            ReplicaShares::Auto => "auto: measured throughput over the first steps, then fixed",
            ReplicaShares::Even => "even",
            ReplicaShares::Weights(_) => "fixed weights",
        };
        outln!("replica shares of each batch: {} ({how})", percent.join(", "));
    }
    if replicas > 1 && ranks.is_none() {
        // What each replica's devices hold of the optimizer state (ZeRO-1 shards it).
        let per_stage = trainer.with_optimizers(|optimizer, _| optimizer.state_size_in_bytes() as u64)?;
        let per_replica: Vec<u64> = per_stage.chunks(sched.n_stages()).map(|c| c.iter().sum()).collect();
        let total: u64 = per_replica.iter().sum();
        outln!(
            "optimizer state per replica: {} ({})",
            per_replica.iter().map(|&b| conveyor::engine::placement::format_bytes(b)).collect::<Vec<_>>().join(", "),
            match trainer.zero() {
                1 => format!("ZeRO-1: sharded, {} in all", conveyor::engine::placement::format_bytes(total)),
                _ => "replicated; --zero 1 shards it".to_string(),
            }
        );
    }
    // The outputs, most valuable first; a failure is reported and the others are still written.
    let mut failures: Vec<anyhow::Error> = Vec::new();
    let mut attempt = |result: anyhow::Result<()>| {
        if let Err(error) = result {
            failures.push(error);
        }
    };
    if let Some(path) = &spec.outputs.save {
        attempt(checkpointing::save(path, &mut trainer, &state, true, "--save").map(|()| {
            outln!("saved the parameters at step {} to {}", state.step, path.display());
        }));
    }
    if let Some(path) = &spec.checkpoint.path {
        attempt(checkpointing::save(path, &mut trainer, &state, false, "--checkpoint").map(|()| {
            outln!("saved a training checkpoint at step {} to {}", state.step, path.display());
        }));
    }
    if let (Some(mut out), Some(path)) = (metrics.take(), &spec.outputs.metrics) {
        let summary = serde_json::json!({
            "summary": true,
            "steps": state.step,
            "skipped_steps": skipped_steps,
            "replayed_steps": replayed_steps,
            "stopped_non_finite": diverged.as_ref().filter(|e| matches!(e, conveyor::engine::Error::NonFiniteStep { .. })).map(|e| e.to_string()),
            "stopped_by_error": diverged.as_ref().filter(|e| !matches!(e, conveyor::engine::Error::NonFiniteStep { .. })).map(|e| e.to_string()),
            "interrupted": interrupted.map(interrupt::signal_name),
            "final_loss": last_report.as_ref().map(|r| r.loss),
            "test_accuracy": accuracy,
            "peak_memory_bytes": last_report.as_ref().map(|r| r.peak_memory.clone()),
            "bubble_fraction": bubble.as_ref().map(|b| b.measured_fraction),
            "predicted_bubble_fraction": bubble.as_ref().map(|b| b.simulated_fraction),
            "samples_per_s": samples as f64 / compute_s.max(f64::MIN_POSITIVE),
        });
        out.line(&summary);
        attempt(out.finish().map(|()| {
            outln!("wrote the metrics of {} steps to {}", state.step - first_step, path.display());
        }));
    }
    if let (Some(trace), Some(path)) = (trace.take(), &spec.outputs.trace) {
        attempt(trace.finish().map(|ops| outln!("wrote a trace of {ops} ops to {}", path.display())));
    }
    if let Some(path) = spec.outputs.svg.as_ref().filter(|_| writes_files) {
        // In one process every worker's ops (every replica's); across ranks replica 0's pipeline.
        let rows = if ranks.is_some() { n_devices } else { worker_labels.len() };
        let mut last_step = Timeline::new(rows, sched.n_stages());
        let mut device_labels: Vec<String> = row_labels
            .iter()
            .enumerate()
            .map(|(w, label)| match replicas {
                1 => label.clone(),
                _ => format!("{label}, replica {}", w / n_devices),
            })
            .collect();
        if ranks.is_some() {
            // The last step's gathered timeline, already from the step's start; rank d runs device d
            // (rows `device 1 (cpu:1, rank 1)`).
            last_step.events = last_report.as_ref().map(|r| r.timeline.events.clone()).unwrap_or_default();
            device_labels = row_labels[..n_devices]
                .iter()
                .enumerate()
                .map(|(d, label)| format!("{label}, rank {}", d * ranks_per_worker))
                .collect();
        } else {
            last_step.events = last_step_events
                .iter()
                .map(|e| TimelineEvent {
                    start_s: e.start_s - last_step_origin_s,
                    end_s: e.end_s - last_step_origin_s,
                    ..*e
                })
                .collect();
        }
        let title = format!("{schedule}, p={n_devices}, m={microbatches}, measured (last step)");
        let options = SvgOptions { title, device_labels, ..SvgOptions::default() };
        attempt(super::write_atomically(path, "--svg", &svg_gantt(&last_step, &options)).map(|()| {
            outln!("wrote the last step's chart to {}", path.display());
        }));
    }
    let first_failure = (!failures.is_empty()).then(|| failures.remove(0)).or(periodic_failure);
    for other in &failures {
        errln!("error: {other:#}");
    }
    // A signal during the final writes counts too: the run stops as if it came between steps.
    // (Across ranks this is agreed after rank 0 wrote its files, so no rank ends the job before.)
    let stop_at_end = agreed_stop(ranks.as_ref())?;
    let interrupted = interrupted.or(stop_at_end);
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
/// The end of the stretch of steps from `step`: the first step count after `step` at which one of
/// `every` (an evaluation, a periodic checkpoint) falls, or `total_steps`.
fn stretch_end(step: u64, total_steps: u64, every: [Option<u64>; 2]) -> u64 {
    every.iter().flatten().filter(|&&n| n > 0).map(|&n| (step / n + 1) * n).fold(total_steps, u64::min)
}

fn memory_samples(points: &[MemoryPoint]) -> Vec<MemorySample> {
    points.iter().map(|m| MemorySample { device_idx: m.device_idx, time_s: m.time_s, bytes: m.bytes }).collect()
}
