//! `resnet:SIDE`: the zoo's ResNet for `1 x SIDE x SIDE` images (MNIST-like data: `resnet:28`),
//! the same layers and names as `resnet` with a classifier sized for the pooled image; `resnet:8`
//! is `resnet`; sides that are odd, too small or too large are refused with the rule named.
mod common;

use common::{data, trainer, weights};
use conveyor::engine::runtime::Recompute;
use conveyor::schedules::ScheduleKind;
use conveyor::zoo::ModelSpec;

#[test]
fn resnet_for_28_by_28_images_builds_trains_and_keeps_the_names() {
    let spec: ModelSpec = "resnet:28".parse().unwrap();
    assert_eq!(spec, ModelSpec::ResnetImages(28));
    assert_eq!(spec.input_shape(), [1, 28, 28]);
    assert_eq!("resnet:8".parse::<ModelSpec>().unwrap(), ModelSpec::Resnet);
    let mut t = trainer(spec.build(1).unwrap(), 2, ScheduleKind::OneFOneB, 1, 2, Recompute::Never);
    let names = weights(&t);
    let small = weights(&trainer(ModelSpec::Resnet.build(1).unwrap(), 1, ScheduleKind::GPipe, 1, 1, Recompute::Never));
    let name_list = |w: &[(String, Vec<f32>)]| w.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(name_list(&names), name_list(&small), "the same parameters, by name");
    let fc = names.iter().find(|(n, _)| n == "fc.weight").unwrap();
    assert_eq!(fc.1.len(), 10 * 8 * 14 * 14, "the classifier takes 8 channels of 14x14");
    let (x, y) = data(8, &[1, 28, 28], 10, 3);
    let losses: Vec<f64> = (0..3).map(|_| t.train_step(&x, &y).unwrap().loss).collect();
    assert!(losses.iter().all(|l| l.is_finite()) && losses[2] < losses[0], "{losses:?}");
}

#[test]
fn image_sides_that_do_not_fit_are_refused() {
    for bad in ["resnet:7", "resnet:2", "resnet:258", "resnet:x", "resnet:"] {
        let err = bad.parse::<ModelSpec>().unwrap_err().to_string();
        assert!(err.contains("even integer from 4 to 256"), "{bad}: {err}");
    }
}
