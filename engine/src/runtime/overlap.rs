//! Overlapped steps with post-validation ([`super::TrainerBuilder::overlap_steps`]):
//! [`Trainer::fit`]'s loop when steps overlap. Step `k + 1` is launched before step `k` is
//! collected, its workers apply optimistically, and the coordinator validates each step after the
//! fact: a refused step is rolled back with the next one abandoned, a step that must be clipped
//! is rolled back and run again with the commit's barrier, and a next step launched under a loss
//! scale or replica split that this step's outcome changed is abandoned and launched again. The
//! argument (no deadlock, the same bits as synchronous steps) is in `runtime/README.md`,
//! "Overlapped steps".
use std::time::Instant;

use super::stepping::{Batch, FitSummary, IntoBatch, StepControl, Tally};
use super::trainer::{InFlight, Launch};
use super::{StepReport, Trainer};
use crate::Result;

impl Trainer {
    /// Why [`Trainer::fit`] runs its steps one after another although
    /// [`super::TrainerBuilder::overlap_steps`] asked for overlap, or `None` when they overlap (or
    /// overlap was not asked for).
    pub fn overlap_unavailable(&self) -> Option<&'static str> {
        self.overlap_steps.then_some(self.overlap_blocked).flatten()
    }

    /// Turns overlapped steps on or off for the next [`Trainer::fit`]
    /// ([`super::TrainerBuilder::overlap_steps`]).
    pub fn set_overlap_steps(&mut self, on: bool) {
        self.overlap_steps = on;
    }

    /// Whether [`Trainer::fit`] overlaps steps.
    pub fn overlaps_steps(&self) -> bool {
        self.overlap_steps && self.overlap_blocked.is_none()
    }

    /// [`Trainer::fit`] with overlapped steps: the same steps, reports and errors, in order.
    pub(super) fn fit_overlapped<I, C>(
        &mut self,
        batches: I,
        mut on_step: impl FnMut(&StepReport) -> C,
    ) -> Result<FitSummary>
    where
        I: IntoIterator,
        I::Item: IntoBatch,
        C: StepControl,
    {
        let started = Instant::now();
        let mut summary = Tally::default();
        let mut items = batches.into_iter();
        let Some(first) = items.next() else { return Ok(summary.finish(started, false)) };
        let mut batch = first.into_batch()?;
        // The step in flight, or `None` when this one runs synchronously: after a step whose
        // norm clipped, the next is likely to clip as well, and an optimistic step that clips is
        // rolled back and run again, so until a step does not clip they run with the barrier.
        let mut flight = Some(self.launch_optimistic(&batch, self.step_idx)?);
        loop {
            // The next batch is drawn before this step is collected (and, when this step is in
            // flight, launched). A batch that cannot be had or launched is the next step's error:
            // this step still counts, as in `step` order.
            let mut deferred_error = None;
            let mut next_batch = match items.next().map(IntoBatch::into_batch) {
                None => None,
                Some(Ok(next)) => Some(next),
                Some(Err(error)) => {
                    deferred_error = Some(error);
                    None
                }
            };
            let mut next = None;
            let (report, clipped) = match flight.take() {
                None => {
                    let report = self.train_batch(&batch)?;
                    let clipped = self.max_grad_norm.is_some_and(|max| crate::optim::clips(max, report.grad_norm));
                    (report, clipped)
                }
                Some(current) => {
                    if let Some(next_input) = &next_batch {
                        match self.launch_optimistic(next_input, self.step_idx + 1) {
                            Ok(launched) => next = Some(launched),
                            Err(error) => {
                                deferred_error = Some(error);
                                next_batch = None;
                            }
                        }
                    }
                    match self.finish(current, &mut next) {
                        // Rolled back (and the next step abandoned): once more with the barrier.
                        Ok(outcome) if outcome.replay => {
                            summary.replayed += 1;
                            let replayed = StepReport { replayed: true, ..self.train_batch(&batch)? };
                            (replayed, true)
                        }
                        Ok(outcome) => {
                            self.step_idx += 1;
                            (outcome.report, false)
                        }
                        Err(error) => {
                            let _ = self.abandon(next.take());
                            return Err(error);
                        }
                    }
                }
            };
            summary.add(batch.rows(), report.loss);
            let flow = on_step(&report).control_flow();
            summary.last = Some(report);
            if flow.is_break() {
                self.abandon(next.take())?;
                return Ok(summary.finish(started, true));
            }
            if let Some(error) = deferred_error {
                return Err(error);
            }
            let Some(next_input) = next_batch else { return Ok(summary.finish(started, false)) };
            // The next step must run under what this one decided (the f16 loss scale, the
            // replicas' shares) and on its committed update; otherwise it goes out again.
            let as_now = next.as_ref().map(|launched| self.launched_as_now(launched, next_input.rows()));
            flight = match (next, as_now) {
                (Some(launched), Some(Ok(true))) => Some(launched),
                (stale, Some(Err(error))) => {
                    // Nothing of the step launched ahead may stay applied.
                    self.abandon(stale)?;
                    return Err(error);
                }
                (stale, _) => {
                    self.abandon(stale)?;
                    match clipped {
                        true => None,
                        false => Some(self.launch_optimistic(&next_input, self.step_idx)?),
                    }
                }
            };
            batch = next_input;
        }
    }

    fn launch_optimistic(&mut self, batch: &Batch, step_idx: u64) -> Result<InFlight> {
        self.launch(&batch.inputs, Some(&batch.targets), true, Launch { step_idx, optimistic: true, lr: batch.lr })
    }
}
