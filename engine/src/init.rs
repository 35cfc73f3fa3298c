//! Seeded random initialisation with PyTorch's defaults for Linear and Conv2d.
//!
//! PyTorch initialises `weight` with `kaiming_uniform_(a = sqrt(5))`: gain = sqrt(2 / (1 + a²)) =
//! sqrt(1/3), bound = gain · sqrt(3 / fan_in) = 1 / sqrt(fan_in); and `bias` uniform in
//! ±1 / sqrt(fan_in). Both therefore draw from U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::{Device, Result, Shape, Tensor};

/// A seeded random generator (the one type every initialiser takes).
pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

thread_local! {
    /// Set by [`with_unwritten_parameters`] on this thread.
    static UNWRITTEN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `build` with every initialiser of this module returning zeros, in zeroed allocations the
/// operating system maps only when they are written: a model built inside (for instance to plan
/// its placement from its shapes) costs next to no memory however large its parameters are, as
/// long as nothing writes them. The random generator is not advanced, so such a model is for
/// shapes and costs, not for training.
pub fn with_unwritten_parameters<T>(build: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            UNWRITTEN.with(|flag| flag.set(self.0));
        }
    }
    let _restore = Restore(UNWRITTEN.with(|flag| flag.replace(true)));
    build()
}

/// True inside [`with_unwritten_parameters`] on this thread: a layer being built then derives
/// nothing from its parameters (which would write memory for a model built only for its shapes).
pub fn building_unwritten() -> bool {
    UNWRITTEN.with(std::cell::Cell::get)
}

/// Zeros in place of random values under [`with_unwritten_parameters`].
fn unwritten(shape: &Shape, device: &Device) -> Option<Result<Tensor>> {
    UNWRITTEN.with(std::cell::Cell::get).then(|| Tensor::zeros(shape.clone(), crate::DType::F32, device))
}

/// An f32 tensor with elements drawn from U(low, high).
pub fn uniform(shape: impl Into<Shape>, low: f32, high: f32, rng: &mut StdRng, device: &Device) -> Result<Tensor> {
    let shape = shape.into();
    if let Some(zeros) = unwritten(&shape, device) {
        return zeros;
    }
    let data = (0..shape.numel()).map(|_| if low < high { rng.random_range(low..high) } else { low }).collect();
    Tensor::from_vec(data, shape, device)
}

/// An f32 tensor with elements drawn from N(0, std²) (Box-Muller).
pub fn normal(shape: impl Into<Shape>, std: f32, rng: &mut StdRng, device: &Device) -> Result<Tensor> {
    let shape = shape.into();
    if let Some(zeros) = unwritten(&shape, device) {
        return zeros;
    }
    let data = (0..shape.numel())
        .map(|_| {
            let u1: f32 = rng.random_range(f32::EPSILON..1.0);
            let u2: f32 = rng.random_range(0.0..1.0);
            std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
        })
        .collect();
    Tensor::from_vec(data, shape, device)
}

/// PyTorch's `kaiming_uniform_(a = sqrt(5))` for a weight with `fan_in` inputs per output.
pub fn kaiming_uniform_default(
    shape: impl Into<Shape>,
    fan_in: usize,
    rng: &mut StdRng,
    device: &Device,
) -> Result<Tensor> {
    let bound = fan_in_bound(fan_in);
    uniform(shape, -bound, bound, rng, device)
}

/// PyTorch's default bias initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
pub fn bias_uniform_default(
    shape: impl Into<Shape>,
    fan_in: usize,
    rng: &mut StdRng,
    device: &Device,
) -> Result<Tensor> {
    let bound = fan_in_bound(fan_in);
    uniform(shape, -bound, bound, rng, device)
}

fn fan_in_bound(fan_in: usize) -> f32 {
    if fan_in == 0 { 0.0 } else { 1.0 / (fan_in as f32).sqrt() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kaiming_default_stays_in_bound_and_is_seeded() {
        let device = Device::cpu(0);
        let a = kaiming_uniform_default([64, 100], 100, &mut rng(7), &device).unwrap();
        let b = kaiming_uniform_default([64, 100], 100, &mut rng(7), &device).unwrap();
        assert!(a.bit_eq(&b));
        let values = a.as_f32().unwrap();
        assert!(values.iter().all(|v| v.abs() <= 0.1));
        // Uniform on ±0.1 has variance 0.01 / 3.
        let var = values.iter().map(|v| v * v).sum::<f32>() / values.len() as f32;
        assert!((var - 0.01 / 3.0).abs() < 0.0005, "variance {var}");
    }
}
