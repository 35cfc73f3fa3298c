//! The streaming step API of [`Trainer`]: [`Batch`] (inputs and [`Targets`]), [`Trainer::step`]
//! for one batch from anywhere, [`Trainer::fit`] over any iterator of batches with a callback that
//! sees every [`StepReport`] and may stop the run, and [`Trainer::evaluate`], the loss (and for
//! class labels the correct predictions) of a batch with no parameter changed. With these a user
//! writes their own training loop, evaluation and logging; the CLI's loop is one such loop.
use std::ops::ControlFlow;
use std::time::Instant;

use super::{StepReport, Trainer};
use crate::{Device, Error, Result, Targets, Tensor};

/// One batch: inputs `[rows, ...]` and one target row per input row.
///
/// Made from `(inputs, labels)` (class labels, `Vec<usize>`), `(inputs, values)` (a real-valued
/// `Tensor`) or `(inputs, targets)`.
///
/// ```
/// use conveyor_engine::runtime::Batch;
/// use conveyor_engine::{Device, TargetKind, Tensor};
///
/// let inputs = || Tensor::zeros([4, 3], conveyor_engine::DType::F32, &Device::host());
/// let classes = Batch::from((inputs()?, vec![0, 1, 1, 0]));
/// let values = Batch::from((inputs()?, Tensor::zeros([4, 2], conveyor_engine::DType::F32, &Device::host())?));
/// assert_eq!((classes.rows(), classes.targets.kind()), (4, TargetKind::Classes));
/// assert_eq!(values.targets.kind(), TargetKind::Values);
/// # Ok::<(), conveyor_engine::Error>(())
/// ```
#[derive(Debug)]
pub struct Batch {
    /// The inputs, `[rows, ...]` (the graph input's per-sample shape after the rows).
    pub inputs: Tensor,
    /// The targets, one row per input row.
    pub targets: Targets,
    /// The learning rate of this batch's step, set on every stage's optimizer as the step applies
    /// (a learning-rate schedule); `None` keeps the optimizer's ([`Batch::at_lr`]).
    pub lr: Option<f64>,
}

impl Batch {
    /// A batch of `inputs` and `targets` (labels or values; see [`Targets`]).
    pub fn new(inputs: Tensor, targets: impl Into<Targets>) -> Batch {
        Batch { inputs, targets: targets.into(), lr: None }
    }

    /// This batch, its step taken at learning rate `lr`: the rate travels with the step, so a
    /// schedule's rates stay in step order even when steps overlap
    /// ([`super::TrainerBuilder::overlap_steps`]). A rate the optimizer refuses (negative, not
    /// finite) fails the step, with nothing applied.
    pub fn at_lr(mut self, lr: f64) -> Batch {
        self.lr = Some(lr);
        self
    }

    /// The number of rows of the inputs.
    pub fn rows(&self) -> usize {
        self.inputs.shape().leading()
    }
}

impl From<(Tensor, Vec<usize>)> for Batch {
    fn from((inputs, labels): (Tensor, Vec<usize>)) -> Batch {
        Batch::new(inputs, Targets::Classes(labels))
    }
}

impl From<(Tensor, Tensor)> for Batch {
    fn from((inputs, values): (Tensor, Tensor)) -> Batch {
        Batch::new(inputs, Targets::Values(values))
    }
}

impl From<(Tensor, Targets)> for Batch {
    fn from((inputs, targets): (Tensor, Targets)) -> Batch {
        Batch::new(inputs, targets)
    }
}

/// What [`Trainer::fit`] takes from its iterator: anything that converts into a [`Batch`], or a
/// `Result` of one, so a data loader that can fail hands its error on (and `fit` stops with it).
pub trait IntoBatch {
    /// The batch, or the loader's error.
    fn into_batch(self) -> Result<Batch>;
}

impl<B: Into<Batch>> IntoBatch for B {
    fn into_batch(self) -> Result<Batch> {
        Ok(self.into())
    }
}

impl<B: Into<Batch>, E: Into<Error>> IntoBatch for std::result::Result<B, E> {
    fn into_batch(self) -> Result<Batch> {
        self.map(Into::into).map_err(Into::into)
    }
}

/// What [`Trainer::fit`] did.
#[derive(Clone, Debug)]
pub struct FitSummary {
    /// Optimizer steps run.
    pub steps: usize,
    /// Rows trained on, over all steps.
    pub samples: usize,
    /// The mean of the steps' losses (each a full-batch mean); NaN when no step ran.
    pub mean_loss: f64,
    /// The last step's report, if any step ran.
    pub last: Option<StepReport>,
    /// Wall time of the whole run, seconds (the iterator's work and the callback included).
    pub elapsed_s: f64,
    /// `samples / elapsed_s`: throughput as the caller saw it, data loading included.
    pub samples_per_s: f64,
    /// Whether the callback stopped the run before the iterator ran out.
    pub stopped_early: bool,
    /// Steps that ran twice: with overlapped steps
    /// ([`super::TrainerBuilder::overlap_steps`]), a step applied before its norm was known and
    /// then found to clip is rolled back and run again with the barrier. After such a step the
    /// steps run with the barrier until one does not clip, so a run that clips every step replays
    /// one. Always 0 for synchronous steps.
    pub replayed_steps: usize,
}

/// What [`Trainer::evaluate`] measured on one batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    /// The loss's full-batch mean (its `reduction="mean"`).
    pub loss: f64,
    /// Rows evaluated.
    pub rows: usize,
    /// For class labels: the rows whose output's largest entry (the first, on ties) is at the
    /// label. `None` for real-valued targets.
    pub correct: Option<usize>,
}

impl Evaluation {
    /// `correct / rows`, for class labels.
    pub fn accuracy(&self) -> Option<f64> {
        self.correct.map(|correct| correct as f64 / self.rows.max(1) as f64)
    }
}

impl Trainer {
    /// One optimizer step on `batch` (from `(inputs, labels)`, `(inputs, values)` or a [`Batch`]):
    /// [`Trainer::train_step`] for any [`Targets`]. The loss is the full-batch mean; on any
    /// failure the step is abandoned with no parameter changed. Targets must have one row per
    /// input row ([`Error::TargetRows`]) and be of the kind the loss takes
    /// ([`Error::WrongTargets`]).
    ///
    /// ```
    #[doc = include_str!("doc_model.md")]
    /// let mut trainer = model()?; // y = w x, w = 0, squared error, SGD with lr 0.5
    /// let (x, y) = data(8, 0)?;   // targets y = 2 x
    /// let first = trainer.step((x, y))?;
    /// for seed in 1..20 {
    ///     let report = trainer.step(data(8, seed)?)?;
    ///     assert!(report.loss <= first.loss);
    /// }
    /// assert_eq!(trainer.step_idx(), 20);
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn step(&mut self, batch: impl Into<Batch>) -> Result<StepReport> {
        self.train_batch(&batch.into())
    }

    /// The step's gradients without the update: runs the forward and backward passes of
    /// [`Trainer::step`] on `batch` (replicas summed, tied parameters summed, f16 loss scale
    /// removed) and returns the report with every parameter's gradient, as
    /// `(node.param, tensor)` in [`Trainer::parameters`]' order, on the host. No parameter and no
    /// optimizer state changes; [`Trainer::step_idx`] advances (dropout masks differ per step).
    /// Gradients are unclipped. Strategies that exchange gradients themselves (a parameter
    /// server, asynchronous SGD: [`crate::strategies`]) compute them with this.
    ///
    /// Layouts with tensor-parallel shards are refused (their gradients are not gathered yet).
    ///
    /// ```
    #[doc = include_str!("doc_model.md")]
    /// let mut trainer = model()?; // y = w x, w = 0, squared error
    /// let before = trainer.parameters()?;
    /// let (report, grads) = trainer.gradient_step(data(8, 1)?)?;
    /// assert!(report.loss > 0.0);
    /// assert_eq!(grads.len(), before.len());
    /// assert!(grads[0].1.to_vec_f32().iter().any(|g| *g != 0.0));
    /// assert!(trainer.parameters()?[0].1.bit_eq(&before[0].1)); // nothing applied
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn gradient_step(&mut self, batch: impl Into<Batch>) -> Result<(StepReport, Vec<(String, Tensor)>)> {
        if self.tensor_parallel() > 1 {
            return Err(Error::invalid(
                "gradient_step",
                "gradients of tensor-parallel layouts are not gathered; use a layout without --tensor-parallel",
            ));
        }
        let batch = batch.into();
        self.gradients_only = true;
        let outcome = self.dispatch(&batch.inputs, Some(&batch.targets), true);
        self.gradients_only = false;
        let report = outcome?.report;
        self.step_idx += 1;
        Ok((report, self.gradients()?))
    }

    /// Trains on every batch `batches` yields, in order, calling `on_step` with each step's report;
    /// stops when the iterator runs out or `on_step` returns [`ControlFlow::Break`] (a callback
    /// that only logs returns `()`: `|report| println!("{}", report.loss)`; see [`StepControl`]).
    ///
    /// Items are anything [`IntoBatch`]: a [`Batch`], `(inputs, labels)`, `(inputs, values)`, or a
    /// `Result` of one from a data loader that can fail. The first error (the loader's or a
    /// step's) ends the run and is returned; the steps before it stay applied
    /// ([`Trainer::step_idx`] counts them). Each step is exactly [`Trainer::step`], so a `fit`
    /// gives the same weights, bit for bit, as `step` in a loop over the same batches; with
    /// [`super::TrainerBuilder::overlap_steps`] each next step starts before the last one is
    /// validated, with the same weights, reports and errors (the iterator is then read one batch
    /// ahead: a run that stops has taken one item more than it trained on).
    ///
    /// ```
    /// use std::ops::ControlFlow;
    #[doc = include_str!("doc_model.md")]
    /// let mut trainer = model()?;
    /// let batches = (0..100).map(|seed| data(8, seed)); // any iterator; items may be `Result`s
    /// let mut losses = Vec::new();
    /// let summary = trainer.fit(batches, |report| {
    ///     losses.push(report.loss);
    ///     if report.loss < 1e-6 { ControlFlow::Break(()) } else { ControlFlow::Continue(()) }
    /// })?;
    /// assert!(summary.stopped_early && summary.steps == losses.len() && summary.steps < 100);
    /// assert_eq!(summary.samples, 8 * summary.steps);
    /// assert!(summary.last.unwrap().loss < 1e-6);
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn fit<I, C>(&mut self, batches: I, mut on_step: impl FnMut(&StepReport) -> C) -> Result<FitSummary>
    where
        I: IntoIterator,
        I::Item: IntoBatch,
        C: StepControl,
    {
        if self.overlaps_steps() {
            return self.fit_overlapped(batches, on_step);
        }
        let started = Instant::now();
        let mut tally = Tally::default();
        for item in batches {
            let batch = item.into_batch()?;
            let report = self.train_batch(&batch)?;
            tally.add(batch.rows(), report.loss);
            let flow = on_step(&report).control_flow();
            tally.last = Some(report);
            if flow.is_break() {
                return Ok(tally.finish(started, true));
            }
        }
        Ok(tally.finish(started, false))
    }

    /// The loss of `batch` (its full-batch mean, in evaluation mode: no dropout) and, for class
    /// labels, how many rows the model predicts right; no parameter, optimizer state or step count
    /// changes. Runs [`Trainer::predict`], then the trainer's loss on the host over all rows.
    ///
    /// ```
    #[doc = include_str!("doc_model.md")]
    /// let mut trainer = model()?;
    /// let before = trainer.evaluate(data(16, 99)?)?;
    /// assert_eq!(trainer.evaluate(data(16, 99)?)?, before); // evaluating changes nothing
    /// trainer.fit((0..20).map(|seed| data(8, seed)), |_| std::ops::ControlFlow::Continue(()))?;
    /// let after = trainer.evaluate(data(16, 99)?)?;
    /// assert!(after.loss < before.loss / 100.0);
    /// assert_eq!((after.rows, after.correct), (16, None)); // no accuracy for real values
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn evaluate(&mut self, batch: impl Into<Batch>) -> Result<Evaluation> {
        let Batch { inputs, targets, .. } = batch.into();
        let rows = inputs.shape().leading();
        self.check_targets("evaluate", rows, &targets)?;
        let output = self.predict(&inputs)?;
        let targets = targets.move_to_device(&Device::host())?;
        let (loss, _) = self.loss.loss_and_grad(&output, &targets, rows as f32)?;
        let correct = match &targets {
            Targets::Classes(labels) => Some(count_correct(&output, labels)?),
            Targets::Values(_) => None,
        };
        Ok(Evaluation { loss, rows, correct })
    }
}

/// Rows of `output` (`[rows, ..., classes]`, one label per row of the last dimension) whose
/// largest entry comes first at the label; NaN is never the largest.
fn count_correct(output: &Tensor, labels: &[usize]) -> Result<usize> {
    let n_classes = output.dims().last().copied().filter(|&c| c > 0 && output.shape().rank() >= 2);
    let Some(n_classes) = n_classes.filter(|c| output.numel() / c == labels.len()) else {
        return Err(Error::shape(
            "evaluate",
            format!("an output [rows, ..., classes] with {} rows, one per label", labels.len()),
            output.shape().to_string(),
        ));
    };
    let values = output.try_to_vec_f32()?;
    Ok(values.chunks(n_classes).zip(labels).filter(|&(row, &label)| argmax(row) == Some(label)).count())
}

/// The index of the first largest entry of `row`, skipping NaN (`None` when all are NaN).
fn argmax(row: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in row.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}

/// What a [`Trainer::fit`] callback returns: [`ControlFlow`] to decide whether training goes on,
/// or `()` for a callback that only watches (training goes on).
pub trait StepControl {
    /// Whether to go on.
    fn control_flow(self) -> ControlFlow<()>;
}

impl StepControl for ControlFlow<()> {
    fn control_flow(self) -> ControlFlow<()> {
        self
    }
}

impl StepControl for () {
    fn control_flow(self) -> ControlFlow<()> {
        ControlFlow::Continue(())
    }
}

/// What [`Trainer::fit`] sums over its steps.
#[derive(Default)]
pub(super) struct Tally {
    steps: usize,
    samples: usize,
    loss_sum: f64,
    pub(super) last: Option<StepReport>,
    pub(super) replayed: usize,
}

impl Tally {
    pub(super) fn add(&mut self, rows: usize, loss: f64) {
        self.steps += 1;
        self.samples += rows;
        self.loss_sum += loss;
    }

    pub(super) fn finish(self, started: Instant, stopped_early: bool) -> FitSummary {
        let elapsed_s = started.elapsed().as_secs_f64();
        let Tally { steps, samples, loss_sum, last, replayed } = self;
        FitSummary {
            steps,
            samples,
            mean_loss: if steps == 0 { f64::NAN } else { loss_sum / steps as f64 },
            last,
            elapsed_s,
            samples_per_s: if elapsed_s > 0.0 { samples as f64 / elapsed_s } else { 0.0 },
            stopped_early,
            replayed_steps: replayed,
        }
    }
}
