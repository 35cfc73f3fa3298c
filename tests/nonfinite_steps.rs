//! The trainer never commits a step whose loss or gradients are not finite: a NaN in one input
//! row ends the step in `Error::NonFiniteStep` naming the step, the output stage, the micro-batch
//! and the first parameter affected, on every schedule, with every parameter and optimizer state
//! bit-identical; the next finite batch trains.
mod common;

use common::{SCHEDULES, data, trainer};
use conveyor::engine::runtime::Recompute;
use conveyor::engine::{Device, Error, NonFinite, Tensor};
use conveyor::zoo::mlp;

#[test]
fn a_nan_in_the_data_is_never_committed_on_any_schedule() {
    let (x, y) = data(8, &[6], 10, 5);
    let mut values = x.to_vec_f32();
    values[6 * 5 + 2] = f32::NAN; // row 5: micro-batch 2 of 4
    let poisoned = Tensor::from_vec(values, [8, 6], &Device::host()).unwrap();
    for (kind, chunks) in SCHEDULES {
        let mut t = trainer(mlp(&[6, 8, 8, 8, 10], 1).unwrap(), 2, kind, chunks, 4, Recompute::Never);
        t.train_step(&x, &y).unwrap();
        let before: Vec<_> = t.parameters().unwrap().into_iter().chain(t.optimizer_state().unwrap()).collect();
        let err = t.train_step(&poisoned, &y).unwrap_err();
        match &err {
            Error::NonFiniteStep {
                step_idx: 1, stage_idx, what: NonFinite::Loss, micro_batch_idx, parameter, ..
            } => {
                assert_eq!(*stage_idx, 2 * chunks - 1, "{kind}: the output's stage: {err}");
                assert_eq!(*micro_batch_idx, Some(2), "{kind}: {err}");
                assert_eq!(parameter.as_deref(), Some("0.weight"), "{kind}: the first layer's gradient: {err}");
            }
            other => panic!("{kind}: expected NonFiniteStep, got {other}"),
        }
        assert!(err.to_string().contains("step 2:"), "{err}");
        let after: Vec<_> = t.parameters().unwrap().into_iter().chain(t.optimizer_state().unwrap()).collect();
        assert_eq!(before.len(), after.len());
        for ((name, a), (_, b)) in before.iter().zip(&after) {
            assert!(a.bit_eq(b), "{kind}: {name} changed");
        }
        assert_eq!(t.step_idx(), 1, "{kind}: the step was not counted");
        t.train_step(&x, &y).unwrap();
    }
}
