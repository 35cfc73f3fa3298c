//! Unit tests of `Tensor` on CPU devices: sharing, copy-on-write, ledger accounting and the
//! uninitialised constructor. The same behaviour on GPUs is tested per device in
//! `engine/tests/cuda_tensor.rs`.
use super::*;
use crate::cpu::uninit;

fn on(device: &Device, values: &[f32]) -> Tensor {
    Tensor::from_slice(values, [values.len()], device).unwrap()
}

#[test]
fn shares_are_counted_once_and_freed_with_the_last_handle() {
    let device = Device::cpu(0);
    let a = on(&device, &[1.0, 2.0, 3.0, 4.0]);
    let b = a.share().reshape([2, 2]).unwrap();
    assert!(a.shares_storage_with(&b));
    assert_eq!(device.memory_in_use(), 16);
    drop(a);
    assert_eq!(device.memory_in_use(), 16, "b still holds the bytes");
    assert_eq!(b.as_f32().unwrap(), &[1.0, 2.0, 3.0, 4.0]);
    drop(b);
    assert_eq!(device.memory_in_use(), 0);
}

#[test]
fn every_write_to_a_shared_tensor_leaves_the_other_handle_unchanged() {
    let device = Device::cpu(0);
    let original = on(&device, &[1.0, 2.0]);
    let writes: [fn(&mut Tensor); 6] = [
        |t| t.as_f32_mut().unwrap()[0] = 9.0,
        |t| t.add_assign(&Tensor::from_slice(&[1.0, 1.0], [2], t.device()).unwrap()).unwrap(),
        |t| t.scale_in_place(3.0).unwrap(),
        Tensor::fill_zero,
        |t| t.try_fill_zero().unwrap(),
        |t| t.copy_from(&Tensor::from_slice(&[5.0, 6.0], [2], t.device()).unwrap()).unwrap(),
    ];
    let expected: [&[f32]; 6] = [&[9.0, 2.0], &[2.0, 3.0], &[3.0, 6.0], &[0.0, 0.0], &[0.0, 0.0], &[5.0, 6.0]];
    for (write, expected) in writes.iter().zip(expected) {
        let mut copy = original.share();
        write(&mut copy);
        assert_eq!(copy.as_f32().unwrap(), expected);
        assert_eq!(original.as_f32().unwrap(), &[1.0, 2.0], "the other handle never sees the write");
        assert!(!copy.shares_storage_with(&original));
        assert_eq!(device.memory_in_use(), 16, "the private copy is on the ledger");
    }
    assert_eq!(device.memory_in_use(), 8);
}

#[test]
fn writes_to_an_unshared_tensor_reuse_its_bytes() {
    let device = Device::cpu(0);
    let mut t = on(&device, &[1.0, 2.0]);
    let before = t.as_f32().unwrap().as_ptr();
    t.as_f32_mut().unwrap()[1] = 7.0;
    t.add_assign(&on(&device, &[1.0, 1.0])).unwrap();
    t.fill_zero();
    assert_eq!(t.as_f32().unwrap().as_ptr(), before);
    assert_eq!(device.memory_in_use(), 8);
}

#[test]
fn the_private_copy_of_a_shared_tensor_respects_the_budget() {
    let device = Device::cpu_with_budget(0, Some(12));
    let a = on(&device, &[1.0, 2.0]);
    let mut b = a.share();
    assert!(matches!(b.as_f32_mut(), Err(Error::OutOfDeviceMemory { requested: 8, in_use: 8, .. })));
    assert!(matches!(b.try_fill_zero(), Err(Error::OutOfDeviceMemory { .. })));
    assert_eq!(b.as_f32().unwrap(), &[1.0, 2.0]);
    // fill_zero cannot fail: it counts its fresh bytes past the budget.
    b.fill_zero();
    assert_eq!((device.memory_in_use(), device.peak_memory()), (16, 16));
    assert_eq!(a.as_f32().unwrap(), &[1.0, 2.0]);
}

#[test]
fn moving_a_shared_tensor_copies_it_onto_the_target() {
    let (source, target) = (Device::cpu(0), Device::cpu(1));
    let a = on(&source, &[1.0, 2.0]);
    let moved = a.share().move_to_device(&target).unwrap();
    assert!(!moved.shares_storage_with(&a));
    assert_eq!((source.memory_in_use(), target.memory_in_use()), (8, 8));
    let moved_again = a.move_to_device(&source).unwrap().move_to_device(&target).unwrap();
    assert_eq!((source.memory_in_use(), target.memory_in_use()), (0, 16));
    assert_eq!(moved_again.as_f32().unwrap(), moved.as_f32().unwrap());
}

#[test]
fn try_clone_is_a_real_copy() {
    let device = Device::cpu(0);
    let a = on(&device, &[1.0, 2.0]);
    let b = a.try_clone().unwrap();
    assert!(!a.shares_storage_with(&b));
    assert_eq!(device.memory_in_use(), 16);
}

#[test]
fn from_f32_init_reserves_first_and_demands_the_whole_slice_back() {
    let device = Device::cpu_with_budget(0, Some(16));
    let t = Tensor::from_f32_init([2, 2], &device, |out| uninit::map(out, &[1.0, -2.0, 3.0, -4.0], f32::abs)).unwrap();
    assert_eq!(t.as_f32().unwrap(), &[1.0, 2.0, 3.0, 4.0]);
    assert!(matches!(
        Tensor::from_f32_init([1], &device, |out| Ok(uninit::fill(out, 0.0))),
        Err(Error::OutOfDeviceMemory { .. })
    ));
    drop(t);
    let elsewhere = Box::leak(vec![0.0f32; 4].into_boxed_slice());
    assert!(matches!(Tensor::from_f32_init([4], &device, |_| Ok(elsewhere)), Err(Error::InvalidArgument { .. })));
    let short = Tensor::from_f32_init([4], &device, |out| Ok(uninit::fill(&mut out[..2], 0.0)));
    assert!(matches!(short, Err(Error::InvalidArgument { .. })));
    assert_eq!(device.memory_in_use(), 0, "a refused initialiser releases its reservation");
    let empty = Tensor::from_f32_init([0, 3], &device, |out| Ok(uninit::fill(out, 1.0))).unwrap();
    assert_eq!(empty.numel(), 0);
}
