//! The collectives' algorithms, written once over [`Exchange`] (one rank's sends and receives
//! within one collective call), so that every group that moves f32 buffers between ranks (the
//! in-process group, the transport group) sends the same messages in the same order and adds in
//! the same order: their results are the same bit for bit.
//!
//! All-reduce is a ring reduce-scatter then a ring all-gather; broadcast, scatter, gather and reduce
//! go directly between the root and each rank; all-to-all is pairwise. `README.md` argues why none
//! of them can deadlock when sends never block.
use super::Partition;
use crate::device::Reservation;
use crate::{Device, Error, Result};

/// One rank's point-to-point side of one collective call: all an algorithm needs.
pub(super) trait Exchange {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn n_ranks(&self) -> usize;
    /// Where this rank's scratch buffers are counted.
    fn device(&self) -> &Device;
    /// Sends a copy of `data` to `dst` (never this rank); never blocks.
    fn send(&self, dst: usize, data: &[f32]) -> Result<()>;
    /// Waits for the next message of this call from `src`, which must hold `expected_len` elements.
    fn recv(&self, src: usize, expected_len: usize) -> Result<Vec<f32>>;
    /// The error of this call failing on this rank for `reason`.
    fn failed(&self, reason: String) -> Error;
}

pub(super) fn check_root(x: &impl Exchange, root: usize) -> Result<()> {
    if root >= x.n_ranks() {
        return Err(x.failed(format!("root {root} is not a rank of a group of {}", x.n_ranks())));
    }
    Ok(())
}

pub(super) fn check_len(x: &impl Exchange, what: &str, expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(x.failed(format!("{what} has {got} elements, expected {expected}")));
    }
    Ok(())
}

/// A scratch buffer of `len` f32, counted on this rank's device while it lives.
fn scratch(x: &impl Exchange, len: usize) -> Result<(Vec<f32>, Reservation)> {
    let reservation = x.device().reserve((len * std::mem::size_of::<f32>()) as u64)?;
    Ok((vec![0.0; len], reservation))
}

fn next(x: &impl Exchange) -> usize {
    (x.rank() + 1) % x.n_ranks()
}

fn prev(x: &impl Exchange) -> usize {
    (x.rank() + x.n_ranks() - 1) % x.n_ranks()
}

/// Ring reduce-scatter in place: afterwards `buf[parts.range(rank)]` holds the sum over ranks.
/// At step `s` rank `r` sends chunk `r-1-s` to `r+1` and adds chunk `r-2-s` from `r-1`.
fn ring_reduce_scatter(x: &impl Exchange, buf: &mut [f32], parts: &Partition) -> Result<()> {
    let (n, rank) = (x.n_ranks(), x.rank());
    for step in 0..n.saturating_sub(1) {
        let send_chunk = (rank + 2 * n - 1 - step) % n;
        let recv_chunk = (rank + 2 * n - 2 - step) % n;
        x.send(next(x), &buf[parts.range(send_chunk)])?;
        let data = x.recv(prev(x), parts.len(recv_chunk))?;
        for (acc, v) in buf[parts.range(recv_chunk)].iter_mut().zip(&data) {
            *acc += *v;
        }
    }
    Ok(())
}

/// Ring all-gather in place: rank `r` starts with `buf[parts.range(r)]` and ends with all of
/// `buf`. At step `s` rank `r` sends chunk `r-s` to `r+1` and stores chunk `r-1-s` from `r-1`.
fn ring_all_gather(x: &impl Exchange, buf: &mut [f32], parts: &Partition) -> Result<()> {
    let (n, rank) = (x.n_ranks(), x.rank());
    for step in 0..n.saturating_sub(1) {
        let send_chunk = (rank + n - step) % n;
        let recv_chunk = (rank + 2 * n - 1 - step) % n;
        x.send(next(x), &buf[parts.range(send_chunk)])?;
        let data = x.recv(prev(x), parts.len(recv_chunk))?;
        buf[parts.range(recv_chunk)].copy_from_slice(&data);
    }
    Ok(())
}

/// See [`super::Communicator::broadcast`].
pub(super) fn broadcast(x: &impl Exchange, buf: &mut [f32], root: usize) -> Result<()> {
    check_root(x, root)?;
    if x.rank() == root {
        for dst in (0..x.n_ranks()).filter(|&d| d != root) {
            x.send(dst, buf)?;
        }
    } else {
        buf.copy_from_slice(&x.recv(root, buf.len())?);
    }
    Ok(())
}

/// See [`super::Communicator::reduce`]: the root adds every rank's buffer to zeros in rank order.
pub(super) fn reduce(x: &impl Exchange, buf: &mut [f32], root: usize) -> Result<()> {
    check_root(x, root)?;
    if x.rank() != root {
        return x.send(root, buf);
    }
    let (mut sum, _reservation) = scratch(x, buf.len())?;
    for src in 0..x.n_ranks() {
        let received;
        let part: &[f32] = if src == root {
            buf
        } else {
            received = x.recv(src, buf.len())?;
            &received
        };
        for (acc, v) in sum.iter_mut().zip(part) {
            *acc += *v;
        }
    }
    buf.copy_from_slice(&sum);
    Ok(())
}

/// See [`super::Communicator::all_reduce`].
pub(super) fn all_reduce(x: &impl Exchange, buf: &mut [f32]) -> Result<()> {
    let parts = Partition::even(buf.len(), x.n_ranks())?;
    ring_reduce_scatter(x, buf, &parts)?;
    ring_all_gather(x, buf, &parts)
}

/// See [`super::Communicator::scatter`].
pub(super) fn scatter(x: &impl Exchange, send: &[f32], recv: &mut [f32], root: usize, parts: &Partition) -> Result<()> {
    check_root(x, root)?;
    parts.check_ranks("scatter", x.n_ranks())?;
    check_len(x, "recv", parts.len(x.rank()), recv.len())?;
    if x.rank() == root {
        check_len(x, "the root's send", parts.total(), send.len())?;
        for dst in (0..x.n_ranks()).filter(|&d| d != root) {
            x.send(dst, &send[parts.range(dst)])?;
        }
        recv.copy_from_slice(&send[parts.range(root)]);
    } else {
        recv.copy_from_slice(&x.recv(root, recv.len())?);
    }
    Ok(())
}

/// See [`super::Communicator::gather`].
pub(super) fn gather(x: &impl Exchange, send: &[f32], recv: &mut [f32], root: usize, parts: &Partition) -> Result<()> {
    check_root(x, root)?;
    parts.check_ranks("gather", x.n_ranks())?;
    check_len(x, "send", parts.len(x.rank()), send.len())?;
    if x.rank() != root {
        return x.send(root, send);
    }
    check_len(x, "the root's recv", parts.total(), recv.len())?;
    recv[parts.range(root)].copy_from_slice(send);
    for src in (0..x.n_ranks()).filter(|&s| s != root) {
        recv[parts.range(src)].copy_from_slice(&x.recv(src, parts.len(src))?);
    }
    Ok(())
}

/// See [`super::Communicator::all_gather`].
pub(super) fn all_gather(x: &impl Exchange, send: &[f32], recv: &mut [f32], parts: &Partition) -> Result<()> {
    parts.check_ranks("all_gather", x.n_ranks())?;
    check_len(x, "send", parts.len(x.rank()), send.len())?;
    check_len(x, "recv", parts.total(), recv.len())?;
    recv[parts.range(x.rank())].copy_from_slice(send);
    ring_all_gather(x, recv, parts)
}

/// See [`super::Communicator::reduce_scatter`].
pub(super) fn reduce_scatter(x: &impl Exchange, send: &[f32], recv: &mut [f32], parts: &Partition) -> Result<()> {
    parts.check_ranks("reduce_scatter", x.n_ranks())?;
    check_len(x, "send", parts.total(), send.len())?;
    check_len(x, "recv", parts.len(x.rank()), recv.len())?;
    let (mut work, _reservation) = scratch(x, send.len())?;
    work.copy_from_slice(send);
    ring_reduce_scatter(x, &mut work, parts)?;
    recv.copy_from_slice(&work[parts.range(x.rank())]);
    Ok(())
}

/// See [`super::Communicator::all_to_all`].
pub(super) fn all_to_all(
    x: &impl Exchange,
    send: &[f32],
    send_parts: &Partition,
    recv: &mut [f32],
    recv_parts: &Partition,
) -> Result<()> {
    let rank = x.rank();
    send_parts.check_ranks("all_to_all send", x.n_ranks())?;
    recv_parts.check_ranks("all_to_all recv", x.n_ranks())?;
    check_len(x, "send", send_parts.total(), send.len())?;
    check_len(x, "recv", recv_parts.total(), recv.len())?;
    check_len(x, "this rank's part for itself", send_parts.len(rank), recv_parts.len(rank))?;
    // Sends never block, so sending every part before receiving cannot deadlock.
    for dst in (0..x.n_ranks()).filter(|&d| d != rank) {
        x.send(dst, &send[send_parts.range(dst)])?;
    }
    recv[recv_parts.range(rank)].copy_from_slice(&send[send_parts.range(rank)]);
    for src in (0..x.n_ranks()).filter(|&s| s != rank) {
        recv[recv_parts.range(src)].copy_from_slice(&x.recv(src, recv_parts.len(src))?);
    }
    Ok(())
}
