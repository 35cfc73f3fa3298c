//! The in-process all-reduce, broadcast, all-gather, scatter, gather and reduce-scatter without
//! messages: the ranks are threads of one process, so each reads the others' buffers in place
//! ([`all_reduce`], [`broadcast`], [`all_gather`], [`scatter`], [`gather`], [`reduce_scatter`];
//! all but the first are phase 1, every rank reading what it needs from the published buffers
//! into its own, and phase 3). It adds every element in the ring's order, so its results are the
//! ring all-reduce's and reduce-scatter's bit for bit (the transport group, across ranks, runs
//! the ring), with no copies, no allocations and no bytes on any ledger.
//!
//! The protocol, for `n` ranks on one call (phases numbered from the call's sequence number):
//! 1. each rank publishes its buffer's address and length and waits for every rank's;
//! 2. rank `c` reduces chunk `c` into its own buffer, reading chunk `c` of every other buffer:
//!    `v_c + (v_{c-1} + (... + (v_{c+2} + v_{c+1})))`, the nesting the ring's reduce-scatter
//!    produces; then waits for every rank;
//! 3. rank `c` copies every other chunk `c'` from rank `c'`'s buffer, then waits for every rank
//!    before it returns (no rank's buffer is read after its owner returned).
//!
//! Why it is sound: in phase 2 rank `c` writes only chunk `c` of its own buffer and every other
//! rank reads only other chunks of it; in phase 3 rank `c` writes only chunks other than `c` of its
//! own buffer while the others read only chunk `c` of it. Within a phase no location is written by
//! one thread and touched by another; the barriers order the phases. Every access to a published
//! buffer (its owner's too) goes through the published pointer. A rank that leaves early (the
//! group aborted) first waits until no rank is inside a read phase, which never blocks, so no
//! buffer is read after its owner let go of it.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::Partition;
use crate::{Error, Result};

/// One rank's entry on the board: its buffer and how far it got.
#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    ptr: usize,
    len: usize,
    phase: u64,
    /// The rank's handle was dropped (its thread ended): it will never arrive.
    dropped: bool,
}

/// Where the ranks of one in-process group meet for a direct all-reduce.
#[derive(Debug)]
pub(super) struct Board {
    slots: Mutex<Vec<Slot>>,
    changed: Condvar,
    /// Ranks inside a phase that reads other ranks' buffers.
    readers: AtomicUsize,
}

impl Board {
    pub(super) fn new(n_ranks: usize) -> Board {
        Board {
            slots: Mutex::new(vec![Slot::default(); n_ranks]),
            changed: Condvar::new(),
            readers: AtomicUsize::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Slot>> {
        self.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Wakes every waiting rank (to see an abort).
    pub(super) fn wake(&self) {
        let _guard = self.lock();
        self.changed.notify_all();
    }

    /// After a recovery: every rank's phase back to 0 (the ranks' sequence numbers were realigned).
    pub(super) fn reset(&self) {
        self.lock().iter_mut().for_each(|slot| *slot = Slot { dropped: slot.dropped, ..Slot::default() });
    }

    /// Records that `rank`'s handle was dropped, and wakes every waiting rank.
    pub(super) fn drop_rank(&self, rank: usize) {
        let mut slots = self.lock();
        if let Some(slot) = slots.get_mut(rank) {
            slot.dropped = true;
        }
        self.changed.notify_all();
    }
}

/// What a call needs from its rank's handle.
pub(super) struct Ctx<'a> {
    pub board: &'a Board,
    pub rank: usize,
    pub seq: u64,
    /// The collective's name, for messages.
    pub op: &'static str,
    pub timeout: Duration,
    /// The group's failure, once it aborted: (failed rank, reason).
    pub failure: &'a dyn Fn() -> Option<(usize, String)>,
    pub aborted: &'a dyn Fn((usize, String)) -> Error,
    pub failed: &'a dyn Fn(String) -> Error,
}

impl Ctx<'_> {
    fn phase(&self, step: u64) -> u64 {
        self.seq * 4 + step
    }

    /// Records this rank at `step` (and its buffer, at step 1), then waits until every rank got
    /// there, the group aborts, or the timeout passes. With `then_read`, counts this rank as a
    /// reader in the same critical section that sees the barrier met (so a rank leaving on an
    /// abort, which checks the readers after it saw the abort, cannot miss it).
    fn arrive_and_wait(&self, step: u64, buffer: Option<(usize, usize)>, then_read: bool) -> Result<Vec<Slot>> {
        let target = self.phase(step);
        let deadline = Instant::now() + self.timeout;
        let mut slots = self.board.lock();
        if let Some((ptr, len)) = buffer {
            slots[self.rank].ptr = ptr;
            slots[self.rank].len = len;
        }
        slots[self.rank].phase = target;
        self.board.changed.notify_all();
        loop {
            if let Some(failure) = (self.failure)() {
                return Err((self.aborted)(failure));
            }
            if let Some(gone) = (0..slots.len()).find(|&r| slots[r].dropped && slots[r].phase < target) {
                return Err((self.failed)(format!(
                    "rank {gone}'s handle was dropped (its thread ended or panicked) before it reached {}",
                    self.op
                )));
            }
            if slots.iter().all(|s| s.phase >= target) {
                if then_read {
                    self.board.readers.fetch_add(1, Ordering::AcqRel);
                }
                return Ok(slots.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..slots.len()).filter(|&r| slots[r].phase < target).collect();
                return Err((self.failed)(format!(
                    "no message from ranks {missing:?} within {:?}: they did not reach {}; did every rank call it?",
                    self.timeout, self.op
                )));
            }
            let wait = super::in_process::ABORT_POLL.min(deadline - now);
            slots = self.board.changed.wait_timeout(slots, wait).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Leaves the call after an error: first waits until no rank reads a buffer (reads never block).
    fn leave(&self, error: Error) -> Error {
        while self.board.readers.load(Ordering::Acquire) > 0 {
            std::thread::yield_now();
        }
        error
    }
}

/// Ends this rank's read phase (counted by [`Ctx::arrive_and_wait`]) when dropped.
struct Reading<'a>(&'a Board);

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        self.0.readers.fetch_sub(1, Ordering::AcqRel);
    }
}

/// `dst[i] = v_c[i] + (v_{c-1}[i] + (... + (v_{c+2}[i] + v_{c+1}[i])))` for `i < len`, where `v_r`
/// is the `len` elements at `at(r)` and `c = rank`: the nesting the ring's reduce-scatter produces
/// for chunk `c` (f32 addition commutes, so `a + b` and `b + a` are the same bits). `dst` may be
/// `at(rank)` (the all-reduce sums in place).
///
/// # Safety
/// Every `at(r)` is valid for `len` reads and `dst` for `len` writes, and no other thread writes
/// them during the call.
unsafe fn sum_in_ring_order(at: impl Fn(usize) -> *const f32, rank: usize, n: usize, len: usize, dst: *mut f32) {
    // Blocks on the stack: v_{c+1}, then v_{c+2} + acc, ..., then v_c + acc into dst.
    const BLOCK: usize = 1024;
    let mut acc = [0.0f32; BLOCK];
    let mut start = 0;
    while start < len {
        let count = BLOCK.min(len - start);
        // SAFETY: the caller's contract; each element of `dst` is written after its `v_c` element
        // was read.
        unsafe {
            if n == 1 {
                std::ptr::copy(at(rank).add(start), dst.add(start), count);
            } else {
                let acc = &mut acc[..count];
                acc.copy_from_slice(std::slice::from_raw_parts(at((rank + 1) % n).add(start), count));
                for k in 2..n {
                    let v = std::slice::from_raw_parts(at((rank + k) % n).add(start), count);
                    acc.iter_mut().zip(v).for_each(|(a, &x)| *a += x);
                }
                let own = at(rank).add(start);
                for (i, &a) in acc.iter().enumerate() {
                    *dst.add(start + i) = *own.add(i) + a;
                }
            }
        }
        start += count;
    }
}

/// The broadcast of the module comment: every rank's buffer becomes the root's. Returns the
/// elements this rank would have sent by messages (the root: its buffer to each other rank), or
/// `None` for a rank that sends nothing.
pub(super) fn broadcast(ctx: &Ctx<'_>, buf: &mut [f32], root: usize) -> Result<Option<usize>> {
    let (ptr, len) = (buf.as_mut_ptr(), buf.len());
    let reads = ctx.rank != root;
    let slots = ctx.arrive_and_wait(1, Some((ptr as usize, len)), reads).map_err(|e| ctx.leave(e))?;
    let n = slots.len();
    if reads {
        let reading = Reading(ctx.board);
        if slots[root].len != len {
            let error = (ctx.failed)(format!("the root gave {} elements where this rank gave {len}", slots[root].len));
            drop(reading);
            return Err(ctx.leave(error));
        }
        // SAFETY: the root writes nothing during the call; this rank alone writes its own buffer,
        // through the pointer it published.
        unsafe {
            let src = std::slice::from_raw_parts(slots[root].ptr as *const f32, len);
            std::slice::from_raw_parts_mut(ptr, len).copy_from_slice(src);
        }
    }
    // Phase 3 (the root waits until every rank copied; a length mismatch fails every reader).
    ctx.arrive_and_wait(3, None, false).map_err(|e| ctx.leave(e))?;
    Ok((!reads).then_some((n - 1) * len))
}

/// The all-reduce of the module comment. Returns the elements this rank would have sent in the
/// ring (for the traffic counters).
pub(super) fn all_reduce(ctx: &Ctx<'_>, buf: &mut [f32]) -> Result<Option<usize>> {
    let ptr = buf.as_mut_ptr();
    let len = buf.len();
    let slots = ctx.arrive_and_wait(1, Some((ptr as usize, len)), true).map_err(|e| ctx.leave(e))?;
    let n = slots.len();
    let reading = Reading(ctx.board);
    if let Some(other) = slots.iter().position(|s| s.len != len) {
        drop(reading);
        let error = (ctx.failed)(format!("rank {other} gave {} elements where this rank gave {len}", slots[other].len));
        // Every rank sees the same lengths, so every rank fails here, before any read.
        return Err(ctx.leave(error));
    }
    let parts = Partition::even(len, n)?;
    let rank = ctx.rank;
    {
        let _reading = reading;
        let mine = parts.range(rank);
        // SAFETY: see the module comment: chunk `rank` of every published buffer is read by this
        // rank alone in this phase, and written (its own) by this rank alone.
        unsafe {
            let at = |r: usize| (slots[r].ptr as *const f32).add(mine.start);
            sum_in_ring_order(at, rank, n, mine.len(), (slots[rank].ptr as *mut f32).add(mine.start));
        }
    }
    ctx.arrive_and_wait(2, None, true).map_err(|e| ctx.leave(e))?;
    {
        let _reading = Reading(ctx.board);
        for owner in (0..n).filter(|&c| c != rank) {
            let range = parts.range(owner);
            // SAFETY: chunk `owner` of `owner`'s buffer is final and nobody writes it in this
            // phase; this rank alone writes its own chunks other than `rank`.
            unsafe {
                let src = std::slice::from_raw_parts((slots[owner].ptr as *const f32).add(range.start), range.len());
                let dst = std::slice::from_raw_parts_mut((slots[rank].ptr as *mut f32).add(range.start), range.len());
                dst.copy_from_slice(src);
            }
        }
    }
    ctx.arrive_and_wait(3, None, false).map_err(|e| ctx.leave(e))?;
    // What the ring would have sent: chunks r-1-s (reduce-scatter) and r-s (all-gather).
    let sent = (0..n.saturating_sub(1)).map(|s| parts.len((rank + 2 * n - 1 - s) % n) + parts.len((rank + n - s) % n));
    Ok(Some(sent.sum()))
}

/// The all-gather without messages: every rank publishes its block `send` (read only during the
/// call), copies every rank's block into its own `recv` at the block's place (its own too), then
/// waits for every rank before it returns. Each rank writes only its own `recv`, which nobody
/// else touches. Returns the elements the ring all-gather would have sent from this rank (every
/// block but the next rank's).
pub(super) fn all_gather(ctx: &Ctx<'_>, send: &[f32], recv: &mut [f32], parts: &Partition) -> Result<Option<usize>> {
    let rank = ctx.rank;
    let slots = ctx.arrive_and_wait(1, Some((send.as_ptr() as usize, send.len())), true).map_err(|e| ctx.leave(e))?;
    let n = slots.len();
    // Every rank sees the same published lengths, so every rank fails alike, before any read (each
    // checked its own block and `recv` against `parts` before publishing).
    collect_blocks(ctx, &slots, recv, parts)?;
    ctx.arrive_and_wait(3, None, false).map_err(|e| ctx.leave(e))?;
    Ok(Some(parts.total() - parts.len((rank + 1) % n)))
}

/// The read phase of [`all_gather`] and [`gather`], for a rank counted as a reader: every rank's
/// published block copied into `recv` at its place, after checking every block's length against
/// `parts` (an error, before any read, names the first rank whose block differs).
fn collect_blocks(ctx: &Ctx<'_>, slots: &[Slot], recv: &mut [f32], parts: &Partition) -> Result<()> {
    let reading = Reading(ctx.board);
    if let Some(other) = (0..slots.len()).find(|&r| slots[r].len != parts.len(r)) {
        drop(reading);
        let error = (ctx.failed)(format!(
            "rank {other} gave {} elements for its block of {}",
            slots[other].len,
            parts.len(other)
        ));
        return Err(ctx.leave(error));
    }
    for (owner, slot) in slots.iter().enumerate() {
        // SAFETY: every published `send` is read only during the call (its owner returns only
        // after the phase-3 barrier, which this rank reaches after this read); this rank alone
        // writes its own `recv`.
        let src = unsafe { std::slice::from_raw_parts(slot.ptr as *const f32, slot.len) };
        recv[parts.range(owner)].copy_from_slice(src);
    }
    drop(reading);
    Ok(())
}

/// The scatter without messages: the root publishes `send` (read only during the call), every
/// rank copies its block of it into its own `recv`, then waits for every rank before it returns.
/// Returns the elements the root would have sent (every block but its own), `None` elsewhere.
pub(super) fn scatter(
    ctx: &Ctx<'_>,
    send: &[f32],
    recv: &mut [f32],
    root: usize,
    parts: &Partition,
) -> Result<Option<usize>> {
    let rank = ctx.rank;
    let published = (rank == root).then_some((send.as_ptr() as usize, send.len()));
    let slots = ctx.arrive_and_wait(1, published, true).map_err(|e| ctx.leave(e))?;
    let reading = Reading(ctx.board);
    // The root checked its `send` against `parts` before publishing; a rank that passed another
    // `parts` sees the mismatch here.
    if slots[root].len != parts.total() {
        drop(reading);
        let error = (ctx.failed)(format!(
            "the root gave {} elements where this rank's partition has {}",
            slots[root].len,
            parts.total()
        ));
        return Err(ctx.leave(error));
    }
    {
        let _reading = reading;
        let range = parts.range(rank);
        // SAFETY: the root's `send` is read only during the call (the root returns only after the
        // barrier below); this rank alone writes its own `recv`.
        let src = unsafe { std::slice::from_raw_parts((slots[root].ptr as *const f32).add(range.start), range.len()) };
        recv.copy_from_slice(src);
    }
    ctx.arrive_and_wait(3, None, false).map_err(|e| ctx.leave(e))?;
    Ok((rank == root).then(|| parts.total() - parts.len(root)))
}

/// The gather without messages: every rank publishes its block `send` (read only during the
/// call), the root copies every block into its `recv` at the block's place (its own too), then
/// every rank waits for every rank before it returns. Only the root writes, and only its own
/// `recv`. Returns the elements a rank other than the root would have sent (its block), `None` on
/// the root.
pub(super) fn gather(
    ctx: &Ctx<'_>,
    send: &[f32],
    recv: &mut [f32],
    root: usize,
    parts: &Partition,
) -> Result<Option<usize>> {
    let rank = ctx.rank;
    let reads = rank == root;
    let slots = ctx.arrive_and_wait(1, Some((send.as_ptr() as usize, send.len())), reads).map_err(|e| ctx.leave(e))?;
    if reads {
        // Each rank checked its own block against `parts` before publishing; a rank that passed
        // another `parts` shows here, and the root fails (the others end at its abort).
        collect_blocks(ctx, &slots, recv, parts)?;
    }
    ctx.arrive_and_wait(3, None, false).map_err(|e| ctx.leave(e))?;
    Ok((rank != root).then(|| parts.len(rank)))
}

/// The reduce-scatter without messages: every rank publishes its `send` (`parts.total()`
/// elements, read only during the call), and rank `c` sums block `c` of every rank's `send` into
/// its own `recv` in the ring's nesting, `v_c + (v_{c-1} + (... + (v_{c+2} + v_{c+1})))` (as
/// [`all_reduce`] does), then waits for every rank before it returns. Each rank writes only its own
/// `recv`. Returns the elements the ring reduce-scatter would have sent from this rank.
pub(super) fn reduce_scatter(
    ctx: &Ctx<'_>,
    send: &[f32],
    recv: &mut [f32],
    parts: &Partition,
) -> Result<Option<usize>> {
    let rank = ctx.rank;
    let slots = ctx.arrive_and_wait(1, Some((send.as_ptr() as usize, send.len())), true).map_err(|e| ctx.leave(e))?;
    let n = slots.len();
    let reading = Reading(ctx.board);
    // Every rank sees the same published lengths, so every rank fails here alike, before any read.
    if let Some(other) = (0..n).find(|&r| slots[r].len != parts.total()) {
        drop(reading);
        let error = (ctx.failed)(format!(
            "rank {other} gave {} elements where the partition has {}",
            slots[other].len,
            parts.total()
        ));
        return Err(ctx.leave(error));
    }
    {
        let _reading = reading;
        let mine = parts.range(rank);
        // SAFETY: every published `send` is read only during the call (its owner returns only
        // after the barrier below); this rank alone writes its own `recv`, which nobody reads.
        unsafe {
            let at = |r: usize| (slots[r].ptr as *const f32).add(mine.start);
            sum_in_ring_order(at, rank, n, mine.len(), recv.as_mut_ptr());
        }
    }
    ctx.arrive_and_wait(3, None, false).map_err(|e| ctx.leave(e))?;
    // What the ring would have sent: chunk r-1-s at step s.
    Ok(Some((0..n.saturating_sub(1)).map(|s| parts.len((rank + 2 * n - 1 - s) % n)).sum()))
}
