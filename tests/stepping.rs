//! The streaming step API: `Trainer::fit` stops when its callback breaks or its loader fails and
//! equals `train_step` in a loop bit for bit; `Trainer::evaluate` changes nothing and counts
//! correct predictions; `Dataset::batches` yields one epoch in `epoch_order`.
mod common;

use std::cell::Cell;
use std::ops::ControlFlow;

use common::{data, trainer, weights};
use conveyor::data::{self, Dataset};
use conveyor::engine::runtime::{Batch, Recompute, Trainer};
use conveyor::engine::{Error, Targets};
use conveyor::schedules::ScheduleKind;
use conveyor::zoo::mlp;

const ROWS: usize = 16;

/// A 12-24-24-10 MLP on 2 CPU devices, 1F1B with 4 micro-batches, SGD with momentum.
fn piped() -> Trainer {
    trainer(mlp(&[12, 24, 24, 10], 3).unwrap(), 2, ScheduleKind::OneFOneB, 1, 4, Recompute::Never)
}

fn batch(seed: u64) -> Batch {
    Batch::from(data(ROWS, &[12], 10, seed))
}

#[test]
fn fit_stops_after_the_step_whose_callback_breaks() {
    let mut trainer = piped();
    let (taken, mut seen) = (Cell::new(0), Vec::new());
    let endless = (0..).map(|seed| {
        taken.set(taken.get() + 1);
        batch(seed)
    });
    let summary = trainer
        .fit(endless, |report| {
            seen.push(report.loss);
            if seen.len() == 3 { ControlFlow::Break(()) } else { ControlFlow::Continue(()) }
        })
        .unwrap();
    assert_eq!((summary.steps, taken.get(), seen.len(), trainer.step_idx()), (3, 3, 3, 3));
    assert!(summary.stopped_early);
    assert_eq!(summary.samples, 3 * ROWS);
    assert_eq!(summary.last.as_ref().map(|r| r.loss), Some(seen[2]));
    assert_eq!(summary.mean_loss, seen.iter().sum::<f64>() / 3.0);
    assert!(summary.samples_per_s > 0.0 && summary.elapsed_s > 0.0);
    // An iterator that runs out ends the run without stopping early.
    let summary = trainer.fit((10..12).map(batch), |_| ControlFlow::Continue(())).unwrap();
    assert_eq!((summary.steps, summary.stopped_early, trainer.step_idx()), (2, false, 5));
}

#[test]
fn fit_over_an_iterator_equals_train_step_in_a_loop_bit_for_bit() {
    let mut by_hand = piped();
    let mut losses = Vec::new();
    for seed in 0..5 {
        let (x, y) = data(ROWS, &[12], 10, seed);
        losses.push(by_hand.train_step(&x, &y).unwrap().loss);
    }
    let mut fitted = piped();
    let mut fitted_losses = Vec::new();
    let loader = (0..5).map(|seed| Ok::<_, Error>(data(ROWS, &[12], 10, seed)));
    let summary = fitted
        .fit(loader, |report| {
            fitted_losses.push(report.loss);
            ControlFlow::Continue(())
        })
        .unwrap();
    assert!(weights(&fitted) == weights(&by_hand));
    assert_eq!(fitted_losses, losses);
    assert_eq!((summary.steps, fitted.step_idx()), (5, by_hand.step_idx()));
    // And `step` is `train_step`.
    let (x, y) = data(ROWS, &[12], 10, 5);
    let report = by_hand.train_step(&x, &y).unwrap();
    assert_eq!(fitted.step((x, y)).unwrap().loss, report.loss);
    assert!(weights(&fitted) == weights(&by_hand));
}

#[test]
fn fit_stops_at_the_first_loader_error_with_earlier_steps_kept() {
    let mut trainer = piped();
    let loader = (0..4).map(|seed| match seed {
        2 => Err(Error::invalid("loader", "file 2 is unreadable")),
        _ => Ok(batch(seed)),
    });
    let mut calls = 0;
    let error = trainer
        .fit(loader, |_| {
            calls += 1;
            ControlFlow::Continue(())
        })
        .unwrap_err();
    assert!(error.to_string().contains("file 2 is unreadable"), "{error}");
    assert_eq!((calls, trainer.step_idx()), (2, 2));
}

#[test]
fn evaluate_changes_no_parameter_and_counts_correct_predictions() {
    let mut evaluated = piped();
    let mut twin = piped();
    for seed in 0..3 {
        evaluated.step(batch(seed)).unwrap();
        twin.step(batch(seed)).unwrap();
    }
    let before = weights(&evaluated);
    let (x, y) = data(ROWS, &[12], 10, 7);
    let evaluation = evaluated.evaluate((x.share(), y.clone())).unwrap();
    assert!(weights(&evaluated) == before);
    assert_eq!(evaluated.step_idx(), 3);
    // Correct predictions: the rows whose largest logit is at the label.
    let logits = evaluated.predict(&x).unwrap().to_vec_f32();
    let correct = logits
        .chunks(10)
        .zip(&y)
        .filter(|(row, label)| {
            row.iter().all(|&v| v <= row[**label]) && row[..**label].iter().all(|&v| v < row[**label])
        })
        .count();
    assert_eq!((evaluation.rows, evaluation.correct), (ROWS, Some(correct)));
    assert_eq!(evaluation.accuracy(), Some(correct as f64 / ROWS as f64));
    // The loss is the step's loss on that batch (one full-batch sum against four micro-batch ones).
    let report = twin.train_step(&x, &y).unwrap();
    assert!((evaluation.loss - report.loss).abs() <= 1e-6 * report.loss, "{} against {}", evaluation.loss, report.loss);
    // Momentum and step count untouched: the next step is the twin's, bit for bit.
    evaluated.train_step(&x, &y).unwrap();
    assert!(weights(&evaluated) == weights(&twin));
    // Targets of another row count are refused before anything runs.
    let error = evaluated.evaluate((x, Targets::Classes(y[1..].to_vec()))).unwrap_err();
    assert!(matches!(error, Error::TargetRows { input_rows: 16, target_rows: 15, .. }), "{error:?}");
}

#[test]
fn dataset_batches_are_one_epoch_in_epoch_order_without_the_last_partial_batch() {
    let digits: Dataset = data::digits().unwrap();
    let batches: Vec<Batch> = digits.batches(100, true, 3, 1).collect::<Result<_, _>>().unwrap();
    assert_eq!(batches.len(), digits.len() / 100);
    let order = data::epoch_order(digits.len(), true, 3, 1);
    for (i, batch) in batches.iter().enumerate() {
        let (x, y) = digits.batch(&order[i * 100..(i + 1) * 100]).unwrap();
        assert!(batch.inputs.bit_eq(&x));
        assert_eq!(batch.targets.classes_for("test").unwrap(), y.as_slice());
    }
    let mut zero = digits.batches(0, false, 0, 0);
    assert!(matches!(zero.next(), Some(Err(Error::InvalidArgument { .. }))));
    assert!(zero.next().is_none());
}
