//! What `conveyor train` records after each step it took: the run's step count, throughput, the
//! progress line and bar, the metrics line, the trace's events, the last step's events for the
//! chart, and the reports the bubble summary averages. The training loop (`mod.rs`) calls
//! [`StepBooks::after_step`] from inside `Trainer::fit`'s callback, so a step is recorded as soon
//! as it is reported, also when steps overlap.
use std::collections::VecDeque;

use conveyor::engine::runtime::StepReport;
use conveyor::engine::trace::TimelineRecorder;
use conveyor::schedules::TimelineEvent;
use conveyor::spec::LrSchedule;

use super::checkpointing::RunState;
use super::outputs::{LineOutput, TraceStream};
use super::progress::Progress;

/// How many of the last reports the bubble summary averages (one step's figures move by several
/// points).
pub(super) const BUBBLE_STEPS: usize = 5;

/// The run's fixed facts the books need.
pub(super) struct RunFacts {
    pub batch: usize,
    pub total_steps: u64,
    pub steps_per_epoch: u64,
    pub log_every: u64,
    pub base_lr: f64,
    pub lr_schedule: LrSchedule,
    /// Ranks per worker, when the trace is written from the steps' gathered timelines (MPI).
    pub gathered_trace: Option<usize>,
}

impl RunFacts {
    pub fn epoch(&self, step: u64) -> u64 {
        step / self.steps_per_epoch.max(1)
    }

    pub fn lr(&self, step: u64) -> f64 {
        self.lr_schedule.lr(self.base_lr, step, self.total_steps)
    }
}

/// What the books keep of the run for its summary and outputs, handed back by
/// [`StepBooks::into_records`] when the loop ends.
#[derive(Default)]
pub(super) struct StepRecords {
    /// The last [`BUBBLE_STEPS`] reports, for the bubble summary.
    pub recent_reports: VecDeque<StepReport>,
    pub last_report: Option<StepReport>,
    /// Samples trained, and the seconds their steps took (throughput).
    pub samples: u64,
    pub compute_s: f64,
    /// Steps skipped in all, and in a row up to now.
    pub skipped_steps: u64,
    pub skipped_in_a_row: u64,
    /// Overlapped steps that ran twice: applied before their norm was known, then clipped.
    pub replayed_steps: u64,
    /// The last step's events, for --svg (start times from the recorder's origin), and that origin.
    pub last_step_events: Vec<TimelineEvent>,
    pub last_step_origin_s: f64,
}

/// The loop's books: the run's facts, the outputs it writes step by step (borrowed for the run)
/// and its [`StepRecords`].
pub(super) struct StepBooks<'a> {
    facts: RunFacts,
    pub state: &'a mut RunState,
    progress: &'a Progress,
    metrics: &'a mut Option<LineOutput>,
    trace: &'a mut Option<TraceStream>,
    recorder: Option<&'a TimelineRecorder>,
    /// Across ranks, the trace's zero: the first step's start (rank 0's clock).
    trace_origin_s: Option<f64>,
    /// When the step being recorded started on the recorder's clock.
    last_step_start_s: f64,
    /// When it ended, if noted before something else ran (an evaluation).
    step_end_s: Option<f64>,
    /// Whether steps overlap: a step's time is then the wall time since the step before it was
    /// reported (its own `step_s` runs from its launch, which overlaps the step before).
    overlapped: bool,
    /// When the last step was reported, in this stretch.
    last_reported: Option<std::time::Instant>,
    pub records: StepRecords,
}

impl<'a> StepBooks<'a> {
    /// Books for a run with these facts, writing to these outputs (metrics, trace);
    /// `overlapped` says whether the trainer overlaps steps.
    pub fn new(
        facts: RunFacts,
        state: &'a mut RunState,
        progress: &'a Progress,
        outputs: (&'a mut Option<LineOutput>, &'a mut Option<TraceStream>),
        recorder: Option<&'a TimelineRecorder>,
        overlapped: bool,
    ) -> StepBooks<'a> {
        let (metrics, trace) = outputs;
        StepBooks {
            facts,
            state,
            progress,
            metrics,
            trace,
            recorder,
            trace_origin_s: None,
            last_step_start_s: 0.0,
            step_end_s: None,
            overlapped,
            last_reported: None,
            records: StepRecords::default(),
        }
    }

    /// The records, once the loop is over.
    pub fn into_records(self) -> StepRecords {
        self.records
    }
}

impl StepBooks<'_> {
    /// Notes on the recorder's clock that a step starts now (its events are those after this).
    pub fn step_starts(&mut self) {
        self.last_reported = None;
        if let Some(recorder) = self.recorder {
            self.last_step_start_s = recorder.now_s();
        }
    }

    /// Notes that the step being recorded ended now, before an evaluation runs.
    pub fn step_ends(&mut self) {
        self.step_end_s = self.recorder.map(TimelineRecorder::now_s);
    }

    /// The time step `report` took, taken when it is reported: its `step_s`, or with overlapped
    /// steps the wall time since the step before it was reported (the first of a stretch: its
    /// `step_s`).
    pub fn step_time(&mut self, report: &StepReport) -> f64 {
        let now = std::time::Instant::now();
        let since = self.last_reported.replace(now).map(|before| (now - before).as_secs_f64());
        match (self.overlapped, since) {
            (true, Some(seconds)) => seconds,
            _ => report.step_s,
        }
    }

    /// Records step `step` (0-based) of the run, reported as `report`, with the test accuracy
    /// measured right after it, if any.
    pub fn after_step(&mut self, step: u64, report: &StepReport, step_s: f64, eval_accuracy: Option<f64>) {
        self.records.skipped_in_a_row = 0;
        // An f16 step whose gradient overflowed the loss scale: not committed, the scale lowered
        // (GradScaler's skip); the run goes on.
        self.records.skipped_steps += u64::from(report.skipped);
        self.records.replayed_steps += u64::from(report.replayed);
        let facts = &self.facts;
        let (epoch, lr, batch) = (facts.epoch(step), facts.lr(step), facts.batch);
        self.state.step = step + 1;
        self.records.samples += batch as u64;
        self.records.compute_s += step_s;
        self.progress.step_done(step + 1, facts.steps_per_epoch, report.loss);
        if let Some(recorder) = self.recorder {
            let end_s = self.step_end_s.take().unwrap_or_else(|| recorder.now_s());
            let (events, memory) = recorder.drain();
            self.records.last_step_events =
                events.iter().filter(|e| e.start_s >= self.last_step_start_s && e.start_s < end_s).copied().collect();
            self.records.last_step_origin_s = self.last_step_start_s;
            self.last_step_start_s = recorder.now_s();
            if let Some(trace) = self.trace.as_mut() {
                trace.write(&events, &super::memory_samples(&memory));
            }
        }
        if let (Some(ranks_per_worker), Some(trace)) = (facts.gathered_trace, self.trace.as_mut()) {
            let origin_s = *self.trace_origin_s.get_or_insert(report.started_s);
            trace.write_step(&report.timeline, &report.other_events, ranks_per_worker, report.started_s - origin_s);
        }
        if let Some(out) = self.metrics.as_mut() {
            let mut line = serde_json::json!({
                "step": step + 1,
                "epoch": epoch,
                "loss": report.loss,
                "lr": lr,
                "step_s": step_s,
                "samples_per_s": batch as f64 / step_s,
                "grad_norm": report.grad_norm,
                "bubble_fraction": report.timeline.bubble_fraction(),
                "skipped_steps": self.records.skipped_steps,
            });
            if let Some(accuracy) = eval_accuracy {
                line["test_accuracy"] = accuracy.into();
            }
            if let Some(scale) = report.loss_scale {
                line["loss_scale"] = scale.into();
            }
            if report.replayed {
                line["replayed"] = true.into();
            }
            if report.skipped {
                line["skipped"] = true.into();
            }
            out.line(&line);
        }
        let total_steps = facts.total_steps;
        let log_now = facts.log_every > 0 && ((step + 1).is_multiple_of(facts.log_every) || step + 1 == total_steps);
        if log_now || eval_accuracy.is_some() {
            let mut line = format!(
                "step {:>5}/{total_steps}  epoch {epoch}  loss {:.4}  lr {lr:.2e}  {:.0} samples/s",
                step + 1,
                report.loss,
                batch as f64 / step_s
            );
            if let Some(accuracy) = eval_accuracy {
                line.push_str(&format!("  test accuracy {:.2}%", accuracy * 100.0));
            }
            self.progress.println(line);
        }
        let records = &mut self.records;
        if records.recent_reports.len() == BUBBLE_STEPS {
            records.recent_reports.pop_front();
        }
        records.recent_reports.push_back(report.clone());
        records.last_report = Some(report.clone());
    }

    /// Records step `step` as skipped (a non-finite step under `--on-nonfinite skip`): the batch
    /// is consumed and nothing changes.
    pub fn skipped(&mut self, step: u64, error: &conveyor::engine::Error) {
        self.records.skipped_steps += 1;
        self.records.skipped_in_a_row += 1;
        self.state.step = step + 1;
        self.progress.println(format!("step {} skipped: {error}", step + 1));
        if let Some(out) = self.metrics.as_mut() {
            out.line(&serde_json::json!({
                "step": step + 1,
                "epoch": self.facts.epoch(step),
                "skipped": true,
                "skipped_steps": self.records.skipped_steps,
                "lr": self.facts.lr(step),
            }));
        }
        if let Some(recorder) = self.recorder {
            self.last_step_start_s = recorder.now_s();
        }
    }
}
