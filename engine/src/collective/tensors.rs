//! Collectives on tensors, wherever their elements live: the bodies of the `*_tensor` methods of
//! [`Communicator`].
//!
//! Each call picks one of three paths from the tensors' devices and the communicator:
//!
//! - **CPU tensors**: the communicator's slice collective on the tensors' host elements, in place,
//!   exactly the call the engine made before tensors had this entry (the same bits, no copy).
//! - **GPU tensors and a communicator with [`DeviceCollectives`]** (NCCL's): the collective on the
//!   tensors' device buffers, with no host copy.
//! - **Otherwise** (GPU tensors in an in-process or transport group, which move host slices, or
//!   tensors on different kinds of device): the host fallback. Every tensor is copied to the host
//!   (`Device::host()`'s ledger counts the copies), the slice collective runs on the copies, and
//!   the results are copied back into the tensors (uploaded, on the GPU's ledger).
//!
//! Only f32 tensors take part (`Error::UnsupportedDType` otherwise).
use super::{Communicator, Partition};
use crate::device::CudaBuffer;
use crate::tensor::{F32Mut, F32Ref};
use crate::{DType, Device, Error, Result, Tensor};

/// Collectives over f32 buffers already on the rank's GPU, for communicators that move device
/// memory themselves (NCCL's). The arguments mean what the slice collectives of
/// [`Communicator`] say; buffers absent off the root (`send` of a scatter, `recv` of a gather)
/// are `None`.
pub trait DeviceCollectives {
    /// [`Communicator::all_reduce`] on a GPU buffer.
    fn all_reduce_device(&self, buf: &mut CudaBuffer<f32>) -> Result<()>;

    /// [`Communicator::broadcast`] on a GPU buffer.
    fn broadcast_device(&self, buf: &mut CudaBuffer<f32>, root: usize) -> Result<()>;

    /// [`Communicator::scatter`] on GPU buffers (`send` on the root only).
    fn scatter_device(
        &self,
        send: Option<&CudaBuffer<f32>>,
        recv: &mut CudaBuffer<f32>,
        root: usize,
        parts: &Partition,
    ) -> Result<()>;

    /// [`Communicator::gather`] on GPU buffers (`recv` on the root only).
    fn gather_device(
        &self,
        send: &CudaBuffer<f32>,
        recv: Option<&mut CudaBuffer<f32>>,
        root: usize,
        parts: &Partition,
    ) -> Result<()>;

    /// [`Communicator::all_gather`] on GPU buffers.
    fn all_gather_device(&self, send: &CudaBuffer<f32>, recv: &mut CudaBuffer<f32>, parts: &Partition) -> Result<()>;

    /// [`Communicator::reduce_scatter`] on GPU buffers.
    fn reduce_scatter_device(
        &self,
        send: &CudaBuffer<f32>,
        recv: &mut CudaBuffer<f32>,
        parts: &Partition,
    ) -> Result<()>;
}

/// Where a call's tensors are, and so which path it takes.
enum Path<'a> {
    Host,
    Device(&'a dyn DeviceCollectives),
    Staged,
}

fn path<'a>(op: &str, comm: &'a (impl Communicator + ?Sized), tensors: &[&Tensor]) -> Result<Path<'a>> {
    if let Some(tensor) = tensors.iter().find(|t| t.dtype() != DType::F32) {
        return Err(Error::UnsupportedDType { op: op.to_string(), dtype: tensor.dtype() });
    }
    let on_gpu = |t: &&Tensor| matches!(t.device(), Device::Cuda(_));
    if !tensors.iter().any(on_gpu) {
        return Ok(Path::Host);
    }
    match comm.device_collectives() {
        Some(device) if tensors.iter().all(on_gpu) => Ok(Path::Device(device)),
        _ => Ok(Path::Staged),
    }
}

fn gpu<'a>(op: &str, tensor: &'a Tensor) -> Result<&'a CudaBuffer<f32>> {
    match tensor.f32_ref(op)? {
        F32Ref::Cuda(buffer) => Ok(buffer),
        F32Ref::Host(_) => Err(not_on_gpu(op, tensor)),
    }
}

fn gpu_mut<'a>(op: &str, tensor: &'a mut Tensor) -> Result<&'a mut CudaBuffer<f32>> {
    let error = not_on_gpu(op, tensor);
    match tensor.f32_mut(op)? {
        F32Mut::Cuda(buffer) => Ok(buffer),
        F32Mut::Host(_) => Err(error),
    }
}

fn not_on_gpu(op: &str, tensor: &Tensor) -> Error {
    Error::DeviceMismatch { op: op.to_string(), lhs: "a GPU".to_string(), rhs: tensor.device().to_string() }
}

/// A host copy of `tensor` (the host fallback's operand).
fn staged(tensor: &Tensor) -> Result<Tensor> {
    tensor.to_device(&Device::host())
}

/// `sum` over ranks of every rank's `tensor`, into `tensor` on every rank.
pub(super) fn all_reduce(comm: &(impl Communicator + ?Sized), tensor: &mut Tensor) -> Result<()> {
    let op = "all_reduce_tensor";
    match path(op, comm, &[&*tensor])? {
        Path::Host => comm.all_reduce(tensor.as_f32_mut()?),
        Path::Device(device) => device.all_reduce_device(gpu_mut(op, tensor)?),
        Path::Staged => {
            let mut host = staged(tensor)?;
            comm.all_reduce(host.as_f32_mut()?)?;
            tensor.copy_from(&host)
        }
    }
}

/// `root`'s `tensor` copied into `tensor` on every rank.
pub(super) fn broadcast(comm: &(impl Communicator + ?Sized), tensor: &mut Tensor, root: usize) -> Result<()> {
    let op = "broadcast_tensor";
    match path(op, comm, &[&*tensor])? {
        Path::Host => comm.broadcast(tensor.as_f32_mut()?, root),
        Path::Device(device) => device.broadcast_device(gpu_mut(op, tensor)?, root),
        Path::Staged => {
            let mut host = staged(tensor)?;
            comm.broadcast(host.as_f32_mut()?, root)?;
            tensor.copy_from(&host)
        }
    }
}

/// Rank `r` receives its part of `root`'s `send` into `recv`.
pub(super) fn scatter(
    comm: &(impl Communicator + ?Sized),
    send: Option<&Tensor>,
    recv: &mut Tensor,
    root: usize,
    parts: &Partition,
) -> Result<()> {
    let op = "scatter_tensor";
    let send = if comm.rank() == root {
        Some(send.ok_or_else(|| Error::invalid(op, format!("rank {root} is the root and has no tensor to send")))?)
    } else {
        None
    };
    let operands: Vec<&Tensor> = send.into_iter().chain([&*recv]).collect();
    match path(op, comm, &operands)? {
        Path::Host => {
            let send = send.map(Tensor::as_f32).transpose()?.unwrap_or(&[]);
            comm.scatter(send, recv.as_f32_mut()?, root, parts)
        }
        Path::Device(device) => {
            let send = send.map(|send| gpu(op, send)).transpose()?;
            device.scatter_device(send, gpu_mut(op, recv)?, root, parts)
        }
        Path::Staged => {
            let send = send.map(staged).transpose()?;
            let mut host = staged(recv)?;
            let send_values = send.as_ref().map(Tensor::as_f32).transpose()?.unwrap_or(&[]);
            comm.scatter(send_values, host.as_f32_mut()?, root, parts)?;
            recv.copy_from(&host)
        }
    }
}

/// `root`'s `recv` receives every rank's `send` at its part.
pub(super) fn gather(
    comm: &(impl Communicator + ?Sized),
    send: &Tensor,
    recv: Option<&mut Tensor>,
    root: usize,
    parts: &Partition,
) -> Result<()> {
    let op = "gather_tensor";
    let mut recv = if comm.rank() == root {
        Some(recv.ok_or_else(|| Error::invalid(op, format!("rank {root} is the root and has no tensor to receive")))?)
    } else {
        None
    };
    let operands: Vec<&Tensor> = [send].into_iter().chain(recv.as_deref()).collect();
    match path(op, comm, &operands)? {
        Path::Host => match recv {
            Some(recv) => comm.gather(send.as_f32()?, recv.as_f32_mut()?, root, parts),
            None => comm.gather(send.as_f32()?, &mut [], root, parts),
        },
        Path::Device(device) => {
            let recv = recv.as_deref_mut().map(|recv| gpu_mut(op, recv)).transpose()?;
            device.gather_device(gpu(op, send)?, recv, root, parts)
        }
        Path::Staged => {
            let send = staged(send)?;
            let Some(recv) = recv else { return comm.gather(send.as_f32()?, &mut [], root, parts) };
            let mut host = staged(recv)?;
            comm.gather(send.as_f32()?, host.as_f32_mut()?, root, parts)?;
            recv.copy_from(&host)
        }
    }
}

/// Every rank's `recv` receives every rank's `send` at its part.
pub(super) fn all_gather(
    comm: &(impl Communicator + ?Sized),
    send: &Tensor,
    recv: &mut Tensor,
    parts: &Partition,
) -> Result<()> {
    let op = "all_gather_tensor";
    match path(op, comm, &[send, &*recv])? {
        Path::Host => comm.all_gather(send.as_f32()?, recv.as_f32_mut()?, parts),
        Path::Device(device) => device.all_gather_device(gpu(op, send)?, gpu_mut(op, recv)?, parts),
        Path::Staged => {
            let send = staged(send)?;
            let mut host = staged(recv)?;
            comm.all_gather(send.as_f32()?, host.as_f32_mut()?, parts)?;
            recv.copy_from(&host)
        }
    }
}

/// Every rank's `send` summed over ranks; rank `r` keeps its part in `recv`.
pub(super) fn reduce_scatter(
    comm: &(impl Communicator + ?Sized),
    send: &Tensor,
    recv: &mut Tensor,
    parts: &Partition,
) -> Result<()> {
    let op = "reduce_scatter_tensor";
    match path(op, comm, &[send, &*recv])? {
        Path::Host => comm.reduce_scatter(send.as_f32()?, recv.as_f32_mut()?, parts),
        Path::Device(device) => device.reduce_scatter_device(gpu(op, send)?, gpu_mut(op, recv)?, parts),
        Path::Staged => {
            let send = staged(send)?;
            let mut host = staged(recv)?;
            comm.reduce_scatter(send.as_f32()?, host.as_f32_mut()?, parts)?;
            recv.copy_from(&host)
        }
    }
}
