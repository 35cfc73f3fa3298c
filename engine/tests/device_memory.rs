//! Device memory accounting: budgets refuse over-allocation with a structured error, and the
//! peak is exact for a known sequence of allocations and frees.
use conveyor_engine::{DType, Device, Error, Tensor};

#[test]
fn allocation_past_budget_is_out_of_device_memory() {
    let device = Device::cpu_with_budget(3, Some(1000));
    let first = Tensor::zeros([200], DType::F32, &device).unwrap(); // 800 bytes
    let err = Tensor::zeros([100], DType::F32, &device).unwrap_err(); // 400 more: over
    match err {
        Error::OutOfDeviceMemory { device, requested, in_use, budget } => {
            assert_eq!((device.as_str(), requested, in_use, budget), ("cpu:3", 400, 800, 1000));
        }
        other => panic!("expected OutOfDeviceMemory, got {other:?}"),
    }
    // A refused allocation leaves the ledger unchanged; f16 fits in what is left.
    assert_eq!(device.memory_in_use(), 800);
    let half = Tensor::zeros([100], DType::F16, &device).unwrap(); // 200 bytes: exactly full
    assert_eq!(device.memory_in_use(), 1000);
    drop((first, half));
    assert_eq!(device.memory_in_use(), 0);
}

#[test]
fn peak_is_exact_for_a_known_sequence() {
    let device = Device::cpu(0);
    let a = Tensor::zeros([10], DType::F32, &device).unwrap(); // 40
    let b = Tensor::zeros([25], DType::F32, &device).unwrap(); // 100 -> 140
    drop(a); // 100
    let c = Tensor::zeros([30], DType::BF16, &device).unwrap(); // 60 -> 160
    let d = c.to_dtype(DType::F32).unwrap(); // 120 -> 280
    assert_eq!(device.peak_memory(), 280);
    drop((b, c));
    assert_eq!(device.memory_in_use(), 120);
    device.reset_peak_memory();
    assert_eq!(device.peak_memory(), 120);
    let e = d.narrow_rows(0, 5).unwrap(); // 20 -> 140
    assert_eq!(device.peak_memory(), 140);
    drop((d, e));
    assert_eq!(device.memory_in_use(), 0);
}

#[test]
fn devices_have_separate_ledgers_and_copies_count_on_the_target() {
    let cpu0 = Device::cpu(0);
    let cpu1 = Device::cpu_with_budget(1, Some(64));
    let t = Tensor::from_slice(&[1.0; 8], [8], &cpu0).unwrap();
    let moved = t.to_device(&cpu1).unwrap();
    assert_eq!((cpu0.memory_in_use(), cpu1.memory_in_use()), (32, 32));
    let third = t.to_device(&cpu1).unwrap();
    assert!(matches!(t.to_device(&cpu1), Err(Error::OutOfDeviceMemory { .. })));
    drop((moved, third));
    assert_eq!(cpu1.memory_in_use(), 0);
}

#[test]
fn cuda_without_the_feature_or_a_driver_is_a_clear_error() {
    match Device::parse("cuda:0") {
        Err(err) if cfg!(feature = "cuda") => {
            assert!(err.to_string().contains("no CUDA driver") || err.to_string().contains("could not be opened"), "{err}")
        }
        Err(err) => assert!(err.to_string().contains("built without the `cuda` feature"), "{err}"),
        // A machine with a GPU and the feature on: the device opens.
        Ok(device) => assert!(cfg!(feature = "cuda") && device.to_string() == "cuda:0"),
    }
    let err = Device::parse("tpu:0").unwrap_err();
    assert!(err.to_string().contains("unknown device kind"), "{err}");
}

#[test]
fn f16_and_bf16_round_trip() {
    let device = Device::cpu(0);
    // Values exactly representable in both half formats survive the round trip bit-for-bit.
    let exact = [0.0f32, 1.0, -2.5, 0.15625, 1024.0, -0.0078125];
    let t = Tensor::from_slice(&exact, [6], &device).unwrap();
    for dtype in [DType::F16, DType::BF16] {
        let back = t.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
        assert!(back.bit_eq(&t), "{dtype}");
        let bytes = t.to_dtype(dtype).unwrap().to_le_bytes();
        let again = Tensor::from_le_bytes(&bytes, dtype, [6], &device).unwrap();
        assert_eq!(again.to_vec_f32(), exact.to_vec());
    }
    // Arbitrary values: relative error within half a unit in the last place (2^-11 f16, 2^-8 bf16).
    let values: Vec<f32> = (1..200).map(|i| (i as f32 * 0.731).sin() * 37.0).collect();
    let t = Tensor::from_slice(&values, [values.len()], &device).unwrap();
    for (dtype, rel) in [(DType::F16, 2f32.powi(-11)), (DType::BF16, 2f32.powi(-8))] {
        let back = t.to_dtype(dtype).unwrap().to_vec_f32();
        for (b, v) in back.iter().zip(&values) {
            assert!((b - v).abs() <= rel * v.abs() + 1e-7, "{dtype}: {v} -> {b}");
        }
    }
}
