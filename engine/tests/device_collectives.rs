//! The tensor-level collectives (`Communicator::*_tensor`), the squared-error op and the column
//! ops, written once and run as one trial per device (`common::device_cases`).
//!
//! Collectives: two ranks of an in-process group on the trial's device (on a GPU, the same GPU
//! twice: the group's host fallback), each rank's tensor results against the slice collectives run
//! on the same values in host memory, bit for bit (the fallback runs the same algorithm on the same
//! values; on the CPU the tensor entry is the slice call itself). On a GPU an NCCL group of the one
//! GPU (a group of one rank) checks the device path where NCCL is built and installed.
//!
//! Squared error: the gradient bit for bit against the CPU's (one f32 subtraction and product per
//! element on both), the loss within `4·u·loss` (`u = 2⁻²⁴`: the GPU squares in f32 and sums in
//! f64, the CPU squares and sums in f64). Column ops: copies, so bit for bit on every device.
mod common;

use std::process::ExitCode;

use anyhow::{Result, ensure};
use common::device_cases::{self, Case};
use common::values;
use conveyor_engine::collective::{Communicator, Partition, ProcessGroup};
use conveyor_engine::{CudaDevice, Device, Error, Tensor};

/// Unit roundoff of f32.
const U: f64 = 1.0 / 16_777_216.0;

fn bits(tensor: &Tensor) -> Result<Vec<u32>> {
    Ok(tensor.try_to_vec_f32()?.iter().map(|v| v.to_bits()).collect())
}

/// One rank's results of every tensor collective, downloaded.
fn tensor_collectives(comm: &dyn Communicator, device: &Device) -> Result<Vec<Vec<f32>>> {
    let rank = comm.rank() as u64;
    let parts = Partition::from_counts(&[3, 2])?;
    let mut all_reduced = Tensor::from_vec(values(10 + rank, 7), [7], device)?;
    comm.all_reduce_tensor(&mut all_reduced)?;
    let mut broadcast = Tensor::from_vec(values(20 + rank, 5), [5], device)?;
    comm.broadcast_tensor(&mut broadcast, 1)?;
    let send = Tensor::from_vec(values(30 + rank, 5), [5], device)?;
    let mut scattered = Tensor::zeros([parts.len(comm.rank())], conveyor_engine::DType::F32, device)?;
    comm.scatter_tensor((rank == 0).then_some(&send), &mut scattered, 0, &parts)?;
    let own = Tensor::from_vec(values(40 + rank, parts.len(comm.rank())), [parts.len(comm.rank())], device)?;
    let mut gathered = Tensor::zeros([5], conveyor_engine::DType::F32, device)?;
    comm.gather_tensor(&own, (rank == 0).then_some(&mut gathered), 0, &parts)?;
    let mut all_gathered = Tensor::zeros([5], conveyor_engine::DType::F32, device)?;
    comm.all_gather_tensor(&own, &mut all_gathered, &parts)?;
    let mut reduce_scattered = Tensor::zeros([parts.len(comm.rank())], conveyor_engine::DType::F32, device)?;
    comm.reduce_scatter_tensor(&send, &mut reduce_scattered, &parts)?;
    let results = [all_reduced, broadcast, scattered, gathered, all_gathered, reduce_scattered];
    for result in &results {
        ensure!(result.device().same_device(device), "a result moved to {}", result.device());
    }
    results.iter().map(|t| Ok(t.try_to_vec_f32()?)).collect()
}

/// The same collectives through the slice methods, on host values.
fn slice_collectives(comm: &dyn Communicator) -> Result<Vec<Vec<f32>>> {
    let rank = comm.rank() as u64;
    let parts = Partition::from_counts(&[3, 2])?;
    let mut all_reduced = values(10 + rank, 7);
    comm.all_reduce(&mut all_reduced)?;
    let mut broadcast = values(20 + rank, 5);
    comm.broadcast(&mut broadcast, 1)?;
    let send = values(30 + rank, 5);
    let mut scattered = vec![0.0; parts.len(comm.rank())];
    comm.scatter(if rank == 0 { &send } else { &[] }, &mut scattered, 0, &parts)?;
    let own = values(40 + rank, parts.len(comm.rank()));
    let mut gathered = vec![0.0; 5];
    comm.gather(&own, if rank == 0 { &mut gathered } else { &mut [] }, 0, &parts)?;
    let mut all_gathered = vec![0.0; 5];
    comm.all_gather(&own, &mut all_gathered, &parts)?;
    let mut reduce_scattered = vec![0.0; parts.len(comm.rank())];
    comm.reduce_scatter(&send, &mut reduce_scattered, &parts)?;
    Ok(vec![all_reduced, broadcast, scattered, gathered, all_gathered, reduce_scattered])
}

/// Runs `body` on both ranks of an in-process group over `devices`, each on its own thread.
fn on_two_ranks(
    devices: &[Device; 2],
    body: impl Fn(&dyn Communicator) -> Result<Vec<Vec<f32>>> + Sync,
) -> Result<Vec<Vec<Vec<f32>>>> {
    let handles = ProcessGroup::new(devices)?;
    std::thread::scope(|scope| {
        let body = &body;
        let threads: Vec<_> = handles.iter().map(|handle| scope.spawn(move || body(handle))).collect();
        threads.into_iter().map(|t| t.join().map_err(|_| anyhow::anyhow!("a rank panicked"))?).collect()
    })
}

fn tensor_collectives_match_the_slice_collectives(device: &Device) -> Result<()> {
    let host = [Device::cpu(0), Device::cpu(1)];
    let expected = on_two_ranks(&host, slice_collectives)?;
    let got = on_two_ranks(&[device.clone(), device.clone()], |comm| tensor_collectives(comm, device))?;
    let names = ["all_reduce", "broadcast", "scatter", "gather", "all_gather", "reduce_scatter"];
    for rank in 0..2 {
        for (i, name) in names.iter().enumerate() {
            let (g, e) = (&got[rank][i], &expected[rank][i]);
            ensure!(
                g.iter().map(|v| v.to_bits()).eq(e.iter().map(|v| v.to_bits())),
                "{name} on {device}, rank {rank}: {g:?}, the slice collective gives {e:?}"
            );
        }
    }
    Ok(())
}

fn nccl_moves_gpu_tensors_in_place(device: &Device) -> Result<()> {
    let comms = match CudaDevice::nccl_group(std::slice::from_ref(device)) {
        Ok(comms) => comms,
        Err(Error::CudaUnavailable(why)) => {
            println!("no NCCL group on {device} ({why}); the host fallback is checked by the other case");
            return Ok(());
        }
        Err(err) => return Err(err.into()),
    };
    let comm = comms[0].as_ref();
    ensure!(comm.device_collectives().is_some(), "an NCCL rank has device collectives");
    let parts = Partition::from_counts(&[5])?;
    let x = Tensor::from_vec(values(1, 5), [5], device)?;
    let mut reduced = x.try_clone()?;
    comm.all_reduce_tensor(&mut reduced)?;
    ensure!(bits(&reduced)? == bits(&x)?, "a one-rank all-reduce keeps the values");
    let mut gathered = Tensor::zeros([5], conveyor_engine::DType::F32, device)?;
    comm.all_gather_tensor(&x, &mut gathered, &parts)?;
    ensure!(bits(&gathered)? == bits(&x)?, "a one-rank all-gather copies the values");
    let mut scattered = Tensor::zeros([5], conveyor_engine::DType::F32, device)?;
    comm.scatter_tensor(Some(&x), &mut scattered, 0, &parts)?;
    ensure!(bits(&scattered)? == bits(&x)?, "a one-rank scatter copies the root's own part");
    Ok(())
}

fn squared_error_matches_the_cpu(device: &Device) -> Result<()> {
    let host = Device::host();
    let (o, t) = (values(1, 24), values(2, 24));
    let (cpu_loss, cpu_grad) = Tensor::from_vec(o.clone(), [4, 6], &host)?
        .squared_error(&Tensor::from_vec(t.clone(), [4, 6], &host)?, 12.0)?;
    let output = Tensor::from_vec(o, [4, 6], device)?;
    let (loss, grad) = output.squared_error(&Tensor::from_vec(t, [4, 6], device)?, 12.0)?;
    ensure!(grad.device().same_device(device), "the gradient is on {}, not {device}", grad.device());
    ensure!(bits(&grad)? == bits(&cpu_grad)?, "the gradient on {device} differs from the CPU's");
    ensure!((loss - cpu_loss).abs() <= 4.0 * U * cpu_loss, "loss {loss} on {device}, the CPU's {cpu_loss}");
    // The formula: Σ (o - t)² / scale and 2 (o - t) / scale.
    let a = Tensor::from_vec(vec![1.0, 2.0, 3.0], [1, 3], device)?;
    let b = Tensor::from_vec(vec![1.0, 0.0, 5.0], [1, 3], device)?;
    let (loss, grad) = a.squared_error(&b, 4.0)?;
    ensure!((loss - 2.0).abs() < 1e-12, "loss {loss}, expected (4 + 4) / 4");
    ensure!(grad.try_to_vec_f32()? == [0.0, 1.0, -1.0], "gradient {:?}", grad.try_to_vec_f32()?);
    ensure!(a.squared_error(&Tensor::zeros([3], conveyor_engine::DType::F32, device)?, 1.0).is_err());
    Ok(())
}

fn column_ops_copy_blocks(device: &Device) -> Result<()> {
    let full = Tensor::from_vec((0..10).map(|i| i as f32).collect(), [2, 5], device)?;
    let packed = full.pack_columns(2, &[2, 2, 1])?;
    ensure!(packed.try_to_vec_f32()? == [0., 1., 5., 6., 2., 3., 7., 8., 4., 9.], "packed {:?}", packed.to_vec_f32());
    let back = Tensor::unpack_columns(&packed, 2, &[2, 2, 1], [2, 5])?;
    ensure!(bits(&back)? == bits(&full)?, "unpack inverts pack");
    let middle = full.narrow_columns(2, 2, 2, [2, 2])?;
    ensure!(middle.try_to_vec_f32()? == [2., 3., 7., 8.], "narrowed {:?}", middle.to_vec_f32());
    let (left, right) = (full.narrow_columns(2, 0, 2, [2, 2])?, full.narrow_columns(2, 4, 1, [2, 1])?);
    let joined = Tensor::cat_columns(&[&left, &middle, &right], 2, [2, 5], device)?;
    ensure!(bits(&joined)? == bits(&full)?, "cat_columns joins the blocks");
    for result in [&packed, &back, &middle, &joined] {
        ensure!(result.device().same_device(device), "a result is on {}", result.device());
    }
    ensure!(full.narrow_columns(2, 4, 2, [2, 2]).is_err(), "columns past the end are refused");
    Ok(())
}

fn main() -> ExitCode {
    let cases = [
        Case::every_device(
            "tensor_collectives_match_the_slice_collectives",
            tensor_collectives_match_the_slice_collectives,
        ),
        Case::gpus("nccl_moves_gpu_tensors_in_place", nccl_moves_gpu_tensors_in_place),
        Case::every_device("squared_error_matches_the_cpu", squared_error_matches_the_cpu),
        Case::every_device("column_ops_copy_blocks", column_ops_copy_blocks),
    ];
    device_cases::run(&[], &cases, device_cases::devices())
}
