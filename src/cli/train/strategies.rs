//! `conveyor train` through the data-parallel strategies: `--sync` other than `allreduce`, or any
//! `--compress` or `--interleaving` (the spec's `PipelineSection::uses_strategy`). The run spec
//! is validated as ever (`conveyor::spec`'s `strategy.rs` refuses what this path cannot honour),
//! then `RunSpec::prepare_replicas` builds `--data-parallel` replica trainers and a
//! `SyncTrainer` trains them here.
//!
//! The loop runs the strategy an epoch at a time (cut short at each `--eval-every` evaluation and
//! at the run's end): asynchronous workers run free within a stretch and meet at its end, so a
//! replayed run (`--interleaving replay:PATH`) must have the data, `--batch`, `--steps`/`--epochs`
//! and `--eval-every` of the run it recorded. A signal stops the run at the end of a stretch, with
//! its outputs written. Each stretch's steps are then printed (`--log-every`) and written to
//! `--metrics` with the bytes sent and the staleness of their pushes.
//!
//! Outputs, most valuable first: `--save` (the strategy's model, `SyncTrainer::parameters`, with
//! the run's metadata, through the checkpoint writer `Trainer::save` uses: atomic),
//! `--record-interleaving` (the order of turns as a JSON array, atomically), `--metrics`. A step
//! that fails (a replay that does not fit the run, a non-finite loss) stops the run with no model
//! saved: the workers' parameters are then no single step's.
//!
//! Under `mpirun` (`cli::ranks`) each rank runs one worker: the job needs `--data-parallel` ranks,
//! each rank builds only its worker's replica (`RunSpec::prepare_replica_of`), and the strategy
//! exchanges through the transport (`SyncTrainer::over_ranks`; the server shards on the ranks, see
//! the engine's `strategies/remote.rs`). Every rank makes the same calls (a signal is agreed at
//! each stretch's end, as the runtime's loop does), and rank 0 prints and writes the files.
use std::sync::Arc;
use std::time::Instant;

use conveyor::RunSpec;
use conveyor::data::Dataset;
use conveyor::engine::checkpoint;
use conveyor::engine::placement::format_bytes;
use conveyor::engine::runtime::Batch;
use conveyor::engine::strategies::{StepRecord, SyncTrainer};
use conveyor::engine::transport::Transport;
use conveyor::spec::InterleavingSpec;

use super::checkpointing::{self, RunState};
use super::progress::Progress;
use super::{interrupt, outputs, spec_error};
use crate::cli::console::{errln, outln};
use crate::cli::{output_error, usage};

/// Trains `spec` (which uses a strategy) through a `SyncTrainer`; `ranks`: this process is one
/// rank of an MPI job of more than one, running worker `rank`.
pub fn run(spec: RunSpec, ranks: Option<Arc<dyn Transport>>) -> anyhow::Result<()> {
    let strategy_flags = spec.pipeline.strategy_flags();
    let workers = spec.pipeline.data_parallel;
    if let Some(world) = ranks.as_ref().map(|t| t.world_size())
        && world != workers
    {
        return Err(anyhow::Error::new(crate::cli::ranks::UsageOnEveryRank(format!(
            "--data-parallel {workers}: under mpirun {strategy_flags} runs one worker per rank, and this job has \
             {world} ranks; start {workers} ranks (mpirun -n {workers}) or pass --data-parallel {world}"
        ))));
    }
    let mut run = match &ranks {
        Some(transport) => spec.prepare_replica_of(transport.rank()),
        None => spec.prepare_replicas(),
    }
    .map_err(spec_error)?;
    let first_worker = ranks.as_ref().map_or(0, |t| t.rank());
    let writes_files = first_worker == 0;
    let (batch, microbatches) = (run.spec.training.batch, run.spec.pipeline.microbatches);
    let (steps_per_epoch, total_steps) = (run.steps_per_epoch, run.total_steps);
    let lr = run.optimizer.lr();
    let model_text = run.model_text().to_string();
    let mut init_note = None;
    if let Some(path) = &spec.checkpoint.init {
        let mut n = 0;
        for trainer in &mut run.replicas {
            n = checkpointing::init(path, trainer)?;
        }
        init_note = Some(format!("initialised {n} parameter tensors from {}", path.display()));
    }
    let labels: Vec<String> = run
        .replicas
        .iter()
        .map(|trainer| trainer.devices().iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "))
        .collect();
    let test = run.test.take();
    outln!(
        "conveyor train: {model_text} on {} ({} train rows{}), {workers} worker(s) x {} device(s), {strategy_flags}, \
         {}, {microbatches} micro-batches of {} rows per worker, {} lr {lr} ({} schedule)",
        spec.data.source,
        run.train.len(),
        test.as_ref().map(|t| format!(", {} test rows", t.len())).unwrap_or_default(),
        run.pipeline_devices,
        spec.pipeline.schedule,
        run.worker_rows().div_ceil(microbatches),
        run.optimizer.name(),
        spec.optimizer.lr_schedule,
    );
    for (i, label) in labels.iter().enumerate() {
        let worker = first_worker + i;
        match &ranks {
            Some(_) => outln!("  worker {worker} on {label} (rank {worker}; each rank runs one worker)"),
            None => outln!("  worker {worker} on {label}"),
        }
    }
    for stage in &run.plan.stages {
        outln!("  stage {}: {} ({} parameters)", stage.stage_idx, stage.node_names.join(" "), stage.n_params);
    }
    if let Some(note) = init_note {
        outln!("{note}");
    }
    let mut trainer = match &ranks {
        Some(transport) => run.sync_trainer_over(Arc::clone(transport)),
        None => run.sync_trainer(),
    }
    .map_err(spec_error)?;
    let mut state =
        RunState::starting(&run.spec, &run.optimizer, &run.train, &model_text, steps_per_epoch, total_steps);
    interrupt::install().map_err(|e| anyhow::anyhow!("could not install the signal handler: {e}"))?;
    let mut metrics = match &spec.outputs.metrics {
        Some(path) if writes_files => Some(outputs::LineOutput::create("--metrics", path)?),
        _ => None,
    };
    let progress = Progress::new(0, total_steps, steps_per_epoch, ranks.is_none());
    let started = Instant::now();
    let (log_every, eval_every) = (spec.training.log_every, spec.training.eval_every);
    let mut interrupted = None;
    let mut last_loss = None;
    let (mut staleness_sum, mut staleness_max) = (0.0f64, 0u64);
    while state.step < total_steps {
        if let Some(signal) = super::agreed_stop(ranks.as_ref())? {
            interrupted = Some(signal);
            break;
        }
        let first = state.step;
        let epoch = run.epoch(first);
        let mut end = ((epoch + 1) * steps_per_epoch.max(1)).min(total_steps);
        if let Some(every) = eval_every {
            end = end.min((first / every + 1) * every);
        }
        let (schedule, base_lr, steps) = (&run.spec.optimizer.lr_schedule, run.optimizer.lr(), run.total_steps);
        let lr_at = |step: usize| schedule.lr(base_lr, step as u64, steps);
        let records =
            trainer.run_with_lr((end - first) as usize, &run.worker_batches(epoch), Some(&lr_at)).map_err(|error| {
                progress.finish();
                step_error(error, &spec.pipeline.interleaving)
            })?;
        let eval_accuracy = match (&test, eval_every) {
            (Some(test), Some(every)) if end.is_multiple_of(every) => Some(accuracy(&mut trainer, test, &run)?),
            _ => None,
        };
        for record in &records {
            let step = record.step as u64 + 1;
            if !record.loss.is_finite() {
                progress.finish();
                return Err(anyhow::anyhow!(
                    "step {step}'s loss is {} under {strategy_flags}: the run stopped with nothing saved (the workers' \
                     parameters are no single step's); lower --lr, or try another --sync or --compress",
                    record.loss
                ));
            }
            staleness_sum += record.staleness_mean;
            staleness_max = staleness_max.max(record.staleness_max);
            last_loss = Some(record.loss);
            state.step = step;
            progress.step_done(step, steps_per_epoch, record.loss);
            let accuracy = eval_accuracy.filter(|_| step == end);
            if let Some(out) = metrics.as_mut() {
                out.line(&metrics_line(record, run.epoch(step - 1), run.lr(step - 1), accuracy));
            }
            let log_now = log_every > 0 && (step.is_multiple_of(log_every) || step == total_steps);
            if log_now || accuracy.is_some() {
                let mut line = format!(
                    "step {step:>5}/{total_steps}  epoch {}  loss {:.4}  lr {:.2e}  {} sent  staleness {:.2}/{}",
                    run.epoch(step - 1),
                    record.loss,
                    run.lr(step - 1),
                    format_bytes(record.bytes),
                    record.staleness_mean,
                    record.staleness_max
                );
                if let Some(accuracy) = accuracy {
                    line.push_str(&format!("  test accuracy {:.2}%", accuracy * 100.0));
                }
                progress.println(line);
            }
        }
    }
    progress.finish();
    let wall_s = started.elapsed().as_secs_f64();
    let accuracy = match (&test, interrupted) {
        (Some(test), None) => Some(accuracy(&mut trainer, test, &run)?),
        _ => None,
    };
    outln!(
        "\ntrained {} steps in {wall_s:.2} s: {:.0} samples/s",
        state.step,
        (state.step * batch as u64) as f64 / wall_s.max(f64::MIN_POSITIVE)
    );
    if let Some(loss) = last_loss {
        outln!("final loss {loss:.4}");
    }
    if let (Some(acc), Some(test)) = (accuracy, &test) {
        outln!("test accuracy {:.2}% ({} rows)", acc * 100.0, test.len());
    }
    let total_bytes = trainer.bytes_sent();
    outln!(
        "bytes sent: {total_bytes} ({}) in {} steps, {} per step",
        format_bytes(total_bytes),
        state.step,
        format_bytes(total_bytes / state.step.max(1))
    );
    outln!(
        "staleness: mean {:.2}, max {} (server updates between a worker's pull and its push)",
        staleness_sum / state.step.max(1) as f64,
        staleness_max
    );
    // The outputs, most valuable first; a failure is reported and the others are still written.
    let mut failures: Vec<anyhow::Error> = Vec::new();
    let mut attempt = |result: anyhow::Result<()>| {
        if let Err(error) = result {
            failures.push(error);
        }
    };
    if let Some(path) = spec.outputs.save.as_ref().filter(|_| writes_files) {
        attempt(save(path, &trainer, &state).map(|()| {
            outln!("saved the parameters at step {} to {}", state.step, path.display());
        }));
    }
    if let Some(path) = spec.outputs.record_interleaving.as_ref().filter(|_| writes_files) {
        let turns = trainer.interleaving();
        let text = serde_json::to_string(turns)? + "\n";
        attempt(crate::cli::write_atomically(path, "--record-interleaving", &text).map(|()| {
            outln!("recorded the interleaving ({} turns) to {}", turns.len(), path.display());
        }));
    }
    if let (Some(mut out), Some(path)) = (metrics.take(), &spec.outputs.metrics) {
        out.line(&serde_json::json!({
            "summary": true,
            "steps": state.step,
            "interrupted": interrupted.map(interrupt::signal_name),
            "final_loss": last_loss,
            "test_accuracy": accuracy,
            "bytes_sent": total_bytes,
            "staleness_mean": staleness_sum / state.step.max(1) as f64,
            "staleness_max": staleness_max,
            "samples_per_s": (state.step * batch as u64) as f64 / wall_s.max(f64::MIN_POSITIVE),
        }));
        attempt(out.finish().map(|()| outln!("wrote the metrics of {} steps to {}", state.step, path.display())));
    }
    let first_failure = (!failures.is_empty()).then(|| failures.remove(0));
    for other in &failures {
        errln!("error: {other:#}");
    }
    // Across ranks this is agreed after rank 0 wrote its files, so no rank ends the job before.
    let interrupted = interrupted.or(super::agreed_stop(ranks.as_ref())?);
    match (first_failure, interrupted) {
        (Some(failure), _) => Err(failure),
        (None, Some(signal)) => {
            Err(anyhow::Error::new(interrupt::Interrupted { signal, step: state.step, total_steps }))
        }
        (None, None) => Ok(()),
    }
}

/// A failed stretch of steps: a record that does not fit the run names `--interleaving` (exit
/// status 2); anything else is the engine's error.
fn step_error(error: conveyor::engine::Error, interleaving: &InterleavingSpec) -> anyhow::Error {
    match error {
        conveyor::engine::Error::InvalidArgument { name, reason } if name == "interleaving" => usage(format!(
            "--interleaving {interleaving}: {reason}; replay a record with the flags of the run that wrote it \
             (the data, --data-parallel, --sync, --batch, --steps or --epochs, --eval-every); nothing was saved"
        )),
        other => anyhow::Error::new(other),
    }
}

/// One `--metrics` line: the step's loss, bytes sent and staleness.
fn metrics_line(record: &StepRecord, epoch: u64, lr: f64, accuracy: Option<f64>) -> serde_json::Value {
    let mut line = serde_json::json!({
        "step": record.step + 1,
        "epoch": epoch,
        "loss": record.loss,
        "lr": lr,
        "bytes": record.bytes,
        "staleness_mean": record.staleness_mean,
        "staleness_max": record.staleness_max,
        "elapsed_s": record.elapsed_s,
    });
    if let Some(accuracy) = accuracy {
        line["test_accuracy"] = accuracy.into();
    }
    line
}

/// `--save`: the strategy's model with the run's metadata, written atomically as `Trainer::save`
/// writes (a PyTorch state dict).
fn save(path: &std::path::Path, trainer: &SyncTrainer, state: &RunState) -> anyhow::Result<()> {
    let parameters = trainer.parameters()?;
    let named: Vec<(&str, &conveyor::engine::Tensor)> = parameters.iter().map(|(n, t)| (n.as_str(), t)).collect();
    checkpoint::save_with_metadata(path, &named, &state.to_metadata()).map_err(|e| output_error("--save", path, e))
}

/// Fraction of `test`'s rows the strategy's model classifies correctly (`SyncTrainer::evaluate`,
/// on replica 0), in chunks of a worker's rows; a chunk with fewer rows than the micro-batch
/// count is repeated whole until it has enough, and its count divided back.
fn accuracy(trainer: &mut SyncTrainer, test: &Dataset, run: &conveyor::spec::PreparedReplicas) -> anyhow::Result<f64> {
    let microbatches = run.spec.pipeline.microbatches.max(1);
    let chunk_rows = run.worker_rows().max(microbatches);
    let mut correct = 0usize;
    for start in (0..test.len()).step_by(chunk_rows) {
        let rows: Vec<usize> = (start..(start + chunk_rows).min(test.len())).collect();
        let times = microbatches.div_ceil(rows.len());
        let indices: Vec<usize> = rows.iter().copied().cycle().take(rows.len() * times).collect();
        let evaluation = trainer.evaluate(Batch::from(test.batch(&indices)?))?;
        let counted = evaluation.correct.ok_or_else(|| anyhow::anyhow!("the test labels are not classes"))?;
        correct += counted / times;
    }
    Ok(correct as f64 / test.len().max(1) as f64)
}
