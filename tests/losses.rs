//! Losses beyond cross-entropy: `MseLoss` against a hand computation and finite differences, a
//! regression model on a pipeline equal to one device bit for bit, an `FnLoss` written as MSE
//! equal to `MseLoss`, and the errors for targets that do not fit the loss or the batch.
//!
//! Gradient tolerance: the analytic f32 gradient `a` passes against the f64 central difference
//! `r` (step 1e-4; exact up to rounding for a quadratic) when `|a - r| ≤ 1e-4 · ‖r‖∞ + 1e-7`:
//! one f32 subtraction and one product round to about 2⁻²³ relative, far inside that.
mod common;

use std::sync::Arc;

use common::{SCHEDULES, data, even_stages, max_rel_diff, weights};
use conveyor::Sequential;
use conveyor::engine::optim::{OptimizerConfig, SgdConfig};
use conveyor::engine::runtime::Trainer;
use conveyor::engine::{DType, Device, Error, Loss, Result, TargetKind, Targets, Tensor};
use conveyor::layers::{CrossEntropyLoss, FnLoss, MseLoss};
use conveyor::schedules::ScheduleKind;

/// Rows per batch: a power of two, so dividing by it is exact (see the `FnLoss` test).
const ROWS: usize = 16;
const STEPS: u64 = 3;

fn host_tensor(values: Vec<f32>, dims: &[usize]) -> Tensor {
    Tensor::from_vec(values, dims.to_vec(), &Device::host()).unwrap()
}

/// Inputs `[rows, 4]` and real-valued targets `[rows, 3]`: `(x0 x1, sin x2, x3 - x0)`.
fn regression_batch(rows: usize, seed: u64) -> (Tensor, Tensor) {
    let (x, _) = data(rows, &[4], 2, seed);
    let targets = x.to_vec_f32().chunks(4).flat_map(|x| [x[0] * x[1], x[2].sin(), x[3] - x[0]]).collect();
    (x, host_tensor(targets, &[rows, 3]))
}

/// A 4-16-16-3 tanh MLP on `n_devices` CPU devices (stages cut evenly) with `loss`.
fn regression_trainer(
    loss: Arc<dyn Loss>,
    n_devices: usize,
    kind: ScheduleKind,
    n_chunks: usize,
    n_micro_batches: usize,
) -> Trainer {
    let graph = Sequential::new([4]).linear(16).tanh().linear(16).tanh().linear(3).build(5).unwrap();
    let stages = even_stages(&graph, n_devices * n_chunks);
    Trainer::builder(graph, loss)
        .devices((0..n_devices).map(Device::cpu).collect())
        .stages(stages)
        .schedule(kind, n_chunks)
        .micro_batches(n_micro_batches)
        .optimizer(OptimizerConfig::Sgd(SgdConfig::new(0.1).with_momentum(0.9)))
        .seed(11)
        .build()
        .unwrap()
}

/// The weights after [`STEPS`] steps on the regression batches, and each step's loss.
fn train(
    loss: Arc<dyn Loss>,
    n_devices: usize,
    kind: ScheduleKind,
    n_chunks: usize,
    n_micro_batches: usize,
) -> (Vec<(String, Vec<f32>)>, Vec<f64>) {
    let mut trainer = regression_trainer(loss, n_devices, kind, n_chunks, n_micro_batches);
    let losses = (0..STEPS).map(|step| trainer.step(regression_batch(ROWS, step)).unwrap().loss).collect();
    (weights(&trainer), losses)
}

#[test]
fn mse_loss_matches_a_hand_computation_and_finite_differences() {
    let loss = MseLoss::new();
    // By hand: squared errors 0, 4, 0 | 0, 0, 9 over 6 elements.
    let output = host_tensor(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let targets = Targets::Values(host_tensor(vec![1.0, 0.0, 3.0, 4.0, 5.0, 9.0], &[2, 3]));
    let (value, grad) = loss.loss_and_grad(&output, &targets, 2.0).unwrap();
    assert!((value - 13.0 / 6.0).abs() < 1e-12, "{value}");
    assert_eq!(grad.to_vec_f32(), [0.0, 4.0 / 6.0, 0.0, 0.0, 0.0, -1.0]);
    // Each row as a micro-batch with the full batch's normalizer: the parts add up to the whole.
    let halves: Vec<(f64, Tensor)> = (0..2)
        .map(|row| loss.loss_and_grad(&output.narrow_rows(row, 1).unwrap(), &targets.slice_rows(row, 1).unwrap(), 2.0))
        .collect::<Result<_>>()
        .unwrap();
    assert!((halves[0].0 + halves[1].0 - value).abs() < 1e-12);
    assert!(Tensor::cat_rows(&[&halves[0].1, &halves[1].1], &Device::host()).unwrap().bit_eq(&grad));
    // A half-precision output gets its gradient in half precision.
    let (_, half_grad) = loss.loss_and_grad(&output.to_dtype(DType::F16).unwrap(), &targets, 2.0).unwrap();
    assert_eq!(half_grad.dtype(), DType::F16);

    // Finite differences of L(o) = Σ (o - t)² / (normalizer · D) in f64, rows [3, 4], normalizer 6
    // (as for the first micro-batch of a batch of 6 rows).
    let (rows, per_row, normalizer) = (3, 4, 6.0f32);
    let o: Vec<f32> = (0..rows * per_row).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3).collect();
    let t: Vec<f32> = (0..rows * per_row).map(|i| ((i * 17 % 7) as f32 - 3.0) * 0.5).collect();
    let reference = |o: &[f64]| -> f64 {
        o.iter().zip(&t).map(|(o, &t)| (o - f64::from(t)).powi(2)).sum::<f64>() / f64::from(normalizer) / per_row as f64
    };
    let targets = Targets::Values(host_tensor(t.clone(), &[rows, per_row]));
    let (value, grad) = loss.loss_and_grad(&host_tensor(o.clone(), &[rows, per_row]), &targets, normalizer).unwrap();
    let mut point: Vec<f64> = o.iter().map(|&v| f64::from(v)).collect();
    assert!((value - reference(&point)).abs() <= 1e-12 * reference(&point).abs(), "{value}");
    let step = 1e-4;
    let numeric: Vec<f64> = (0..point.len())
        .map(|k| {
            let original = point[k];
            point[k] = original + step;
            let plus = reference(&point);
            point[k] = original - step;
            let minus = reference(&point);
            point[k] = original;
            (plus - minus) / (2.0 * step)
        })
        .collect();
    let largest = numeric.iter().fold(0.0f64, |m, r| m.max(r.abs()));
    for (k, (a, r)) in grad.to_vec_f32().iter().zip(&numeric).enumerate() {
        assert!((f64::from(*a) - r).abs() <= 1e-4 * largest + 1e-7, "element {k}: analytic {a}, numeric {r}");
    }
}

#[test]
fn regression_on_two_stages_and_four_micro_batches_equals_one_device() {
    let mse: Arc<dyn Loss> = Arc::new(MseLoss::new());
    let (single, single_losses) = train(Arc::clone(&mse), 1, ScheduleKind::GPipe, 1, 4);
    for (kind, chunks) in SCHEDULES {
        let (piped, losses) = train(Arc::clone(&mse), 2, kind, chunks, 4);
        assert!(piped == single, "{kind}: weights differ from one device by up to {}", max_rel_diff(&piped, &single));
        assert_eq!(losses, single_losses, "{kind}");
    }
    // Against full-batch training on one device: only the order of f32 sums differs.
    let (full_batch, _) = train(Arc::clone(&mse), 1, ScheduleKind::GPipe, 1, 1);
    assert!(max_rel_diff(&single, &full_batch) <= 1e-5);
    // The reported loss is nn.MSELoss() of the whole batch: the micro-batches add up to its mean.
    let mut trainer = regression_trainer(mse, 2, ScheduleKind::OneFOneB, 1, 4);
    let initial = weights(&trainer);
    let (x, t) = regression_batch(ROWS, 0);
    let output = trainer.predict(&x).unwrap().to_vec_f32();
    let expected: f64 =
        output.iter().zip(t.to_vec_f32()).map(|(o, t)| f64::from(o - t).powi(2)).sum::<f64>() / (ROWS * 3) as f64;
    let report = trainer.step((x, t)).unwrap();
    assert!((report.loss - expected).abs() <= 1e-6 * expected, "loss {} against {expected}", report.loss);
    assert!(weights(&trainer) != initial, "a step changed no weight");
    assert!(single_losses[STEPS as usize - 1] < single_losses[0], "the loss did not fall: {single_losses:?}");
}

#[test]
fn fn_loss_written_as_mse_gives_the_weights_of_mse_loss() {
    // The per-row loss is the row's mean squared error; its gradient 2 (o - t) / D. The wrapper
    // divides by the normalizer (16 rows, a power of two, so exactly), which gives MseLoss's
    // 2 / (N D) · (o - t) to the bit.
    let mse_by_hand = FnLoss::new(|output: &Tensor, targets: &Targets| -> Result<(f64, Tensor)> {
        let (o, t) = (output.to_vec_f32(), targets.values_for("mean squared error")?.to_vec_f32());
        let per_row = output.shape().trailing_numel();
        let sum = o.iter().zip(&t).map(|(&o, &t)| (f64::from(o) - f64::from(t)).powi(2)).sum::<f64>() / per_row as f64;
        let scale = 2.0 / per_row as f32;
        let grad = o.iter().zip(&t).map(|(o, t)| scale * (o - t)).collect();
        Ok((sum, Tensor::from_vec(grad, output.shape().clone(), output.device())?))
    });
    let (by_hand, by_hand_losses) = train(Arc::new(mse_by_hand), 2, ScheduleKind::OneFOneB, 1, 4);
    let (mse, mse_losses) = train(Arc::new(MseLoss::new()), 2, ScheduleKind::OneFOneB, 1, 4);
    assert!(by_hand == mse, "weights differ by up to {}", max_rel_diff(&by_hand, &mse));
    for (a, b) in by_hand_losses.iter().zip(&mse_losses) {
        assert!((a - b).abs() <= 1e-12 * b.abs(), "loss {a} against {b}");
    }
}

#[test]
fn targets_that_do_not_fit_are_errors_naming_the_numbers() {
    let mut trainer = regression_trainer(Arc::new(MseLoss::new()), 2, ScheduleKind::OneFOneB, 1, 4);
    let initial = weights(&trainer);
    let (x, t) = regression_batch(ROWS, 0);

    // Class labels for a loss over real values.
    let error = trainer.step((x.share(), vec![0; ROWS])).unwrap_err();
    assert!(
        matches!(&error, Error::WrongTargets { loss, expected: TargetKind::Values, got: TargetKind::Classes } if loss == "MseLoss"),
        "{error:?}"
    );
    assert!(error.to_string().contains("MseLoss needs real values"), "{error}");
    // Values of another width than the output's 3.
    let narrow = host_tensor(vec![0.0; ROWS * 2], &[ROWS, 2]);
    let error = trainer.step((x.share(), narrow)).unwrap_err();
    assert!(
        matches!(&error, Error::TargetShape { output, targets, .. } if output == &[ROWS, 3] && targets == &[ROWS, 2]),
        "{error:?}"
    );
    assert!(error.to_string().contains("[16, 2]") && error.to_string().contains("[16, 3]"), "{error}");
    // One target row too few.
    let error = trainer.step((x.share(), t.narrow_rows(0, ROWS - 1).unwrap())).unwrap_err();
    assert!(matches!(error, Error::TargetRows { input_rows: 16, target_rows: 15, .. }), "{error:?}");
    assert!(error.to_string().contains("15 target rows for 16 input rows"), "{error}");
    // Values must be f32.
    let half = t.to_dtype(DType::F16).unwrap();
    assert!(matches!(trainer.step((x.share(), half)), Err(Error::UnsupportedDType { dtype: DType::F16, .. })));
    // The loss itself says the same when called directly.
    let output = host_tensor(vec![0.0; 6], &[2, 3]);
    let wrong = Targets::Values(host_tensor(vec![0.0; 4], &[2, 2]));
    let error = MseLoss::new().loss_and_grad(&output, &wrong, 2.0).unwrap_err();
    assert!(matches!(error, Error::TargetShape { .. }), "{error:?}");
    // Nothing ran: no parameter changed, no step counted.
    assert!(weights(&trainer) == initial);
    assert_eq!(trainer.step_idx(), 0);
    assert!(trainer.step((x.share(), t)).is_ok());

    // Real values for cross-entropy.
    let graph = Sequential::new([4]).linear(3).build(0).unwrap();
    let mut classifier = Trainer::builder(graph, Arc::new(CrossEntropyLoss::new())).build().unwrap();
    let values = host_tensor(vec![0.0; ROWS * 3], &[ROWS, 3]);
    let error = classifier.step((x.share(), values)).unwrap_err();
    assert!(matches!(error, Error::WrongTargets { expected: TargetKind::Classes, got: TargetKind::Values, .. }));
    // A label past the output's 3 classes, at row 5.
    let mut labels = vec![0; ROWS];
    labels[5] = 7;
    let error = classifier.train_step(&x, &labels).unwrap_err();
    assert!(error.to_string().contains("label 7 at row 5") && error.to_string().contains("3 classes"), "{error}");

    // A closure that checks the kind reports through the stage that ran it.
    let strict = FnLoss::new(|_: &Tensor, targets: &Targets| -> Result<(f64, Tensor)> {
        targets.values_for("my loss")?;
        unreachable!("given class labels")
    });
    let graph = Sequential::new([4]).linear(3).build(0).unwrap();
    let mut custom = Trainer::builder(graph, Arc::new(strict)).build().unwrap();
    let error = custom.train_step(&x, &[0; ROWS]).unwrap_err();
    assert!(error.to_string().contains("my loss needs real values (Targets::Values)"), "{error}");
    assert_eq!(custom.step_idx(), 0);
}
