//! The one interface the worker uses for core slots: a [`CoreSeat`] is a worker's place at the
//! cores for one step. Without slots (the usual case: a core per worker) every method is a plain
//! channel operation or does nothing, so the worker's code reads the same either way; with slots
//! ([`CoreSlots`], only when CPU workers outnumber cores) the seat takes a slot before the worker
//! computes, keeps it while the worker runs, and gives it up only to block.
use std::time::Instant;

use crossbeam::channel::{Receiver, Sender, select};

use super::core_slots::CoreSlots;
use super::worker::{ChannelKey, Message};

/// The step was aborted while the worker waited.
pub(crate) struct Aborted;

/// How long a worker without a core slot polls for a message before it sleeps. A neighbour's
/// message often comes within microseconds when ops are small, and waking a sleeping thread
/// costs tens of microseconds on a VM; the poll yields the core between tries, so a worker that
/// has compute to do gets it.
pub(crate) const POLL_BEFORE_SLEEP: std::time::Duration = std::time::Duration::from_micros(50);

/// How long a worker without core slots polls for the commit before it sleeps. The commit comes
/// once the last worker has voted, usually within milliseconds, and a worker asleep then can take
/// milliseconds to be run again (measured: the optimizer step of one of two workers starting
/// 3 ms after the other's), which lengthens the step by as much.
const POLL_FOR_COMMIT: std::time::Duration = std::time::Duration::from_millis(10);

/// True once the step's abort channel was closed (or signalled).
pub(crate) fn aborted(abort: &Receiver<()>) -> bool {
    matches!(abort.try_recv(), Err(crossbeam::channel::TryRecvError::Disconnected) | Ok(()))
}

/// Receives from `rx`: polls for up to `window` (at least once), yielding the core between tries,
/// then sleeps until a value or the abort comes.
pub(crate) fn poll_then_block<T>(
    rx: &Receiver<T>,
    abort: &Receiver<()>,
    window: std::time::Duration,
) -> Result<T, Aborted> {
    let deadline = Instant::now() + window;
    loop {
        match rx.try_recv() {
            Ok(value) => return Ok(value),
            Err(crossbeam::channel::TryRecvError::Disconnected) => return Err(Aborted),
            Err(crossbeam::channel::TryRecvError::Empty) => {}
        }
        if aborted(abort) {
            return Err(Aborted);
        }
        if Instant::now() >= deadline {
            break;
        }
        std::thread::yield_now();
    }
    select! {
        recv(rx) -> value => value.map_err(|_| Aborted),
        recv(abort) -> _ => Err(Aborted),
    }
}

/// A worker's place at the cores for one step (see the module docs).
pub(crate) struct CoreSeat<'s> {
    slots: Option<&'s CoreSlots>,
    worker: usize,
    held: bool,
}

impl<'s> CoreSeat<'s> {
    /// The seat of `worker`; `slots` is `None` when this step uses no core slots.
    pub(crate) fn new(slots: Option<&'s CoreSlots>, worker: usize) -> CoreSeat<'s> {
        CoreSeat { slots, worker, held: false }
    }

    /// True when [`CoreSeat::take`] would wait in line: slots are in use and none is held.
    pub(crate) fn must_wait(&self) -> bool {
        self.slots.is_some() && !self.held
    }

    /// Makes sure the worker may compute: with slots, waits in line for one unless one is held.
    pub(crate) fn take(&mut self, abort: &Receiver<()>) -> Result<(), Aborted> {
        let Some(slots) = self.slots.filter(|_| !self.held) else { return Ok(()) };
        if !slots.acquire(self.worker, &|| aborted(abort)) {
            return Err(Aborted);
        }
        self.held = true;
        Ok(())
    }

    /// Gives a held slot up, before blocking on something other than a message (the commit).
    pub(crate) fn release(&mut self) {
        if let (Some(slots), true) = (self.slots, self.held) {
            slots.release();
            self.held = false;
        }
    }

    /// Receives the message on channel `key`. With a slot held, a message that is not there yet
    /// makes the worker give the slot up and sleep until the sender queues it for one: returns the
    /// moment it joined the queue, so the wait for the message and the wait for a core can be told
    /// apart.
    pub(crate) fn recv(
        &mut self,
        rx: &Receiver<Message>,
        key: ChannelKey,
        abort: &Receiver<()>,
    ) -> Result<(Message, Option<Instant>), Aborted> {
        if let Ok(message) = rx.try_recv() {
            return Ok((message, None));
        }
        let Some(slots) = self.slots.filter(|_| self.held) else {
            return Ok((poll_then_block(rx, abort, POLL_BEFORE_SLEEP)?, None));
        };
        self.held = false;
        let queued_at =
            slots.block_until_message(self.worker, key, &|| !rx.is_empty(), &|| aborted(abort)).ok_or(Aborted)?;
        self.held = true;
        // The message is there (or the channel closed: the step was aborted).
        Ok((rx.try_recv().map_err(|_| Aborted)?, Some(queued_at)))
    }

    /// Waits for the coordinator's decision. Without slots it polls for [`POLL_FOR_COMMIT`] first,
    /// yielding the core between tries; with slots it gives its slot up and sleeps.
    pub(crate) fn wait_for<T>(&mut self, rx: &Receiver<T>, abort: &Receiver<()>) -> Result<T, Aborted> {
        let poll = self.slots.is_none();
        self.release();
        poll_then_block(rx, abort, if poll { POLL_FOR_COMMIT } else { std::time::Duration::ZERO })
    }

    /// Sends `message` on `tx` (channel `key`, to the worker `to_worker`); with slots, a receiver
    /// sleeping on that channel is put in line for a slot. Never blocks: channels hold one message
    /// per micro-batch. A closed channel means the step was aborted.
    pub(crate) fn send(
        &self,
        tx: &Sender<Message>,
        key: ChannelKey,
        to_worker: usize,
        message: Message,
    ) -> Result<(), Aborted> {
        match self.slots {
            Some(slots) => slots.send_message(to_worker, key, || tx.send(message).map_err(|_| Aborted)),
            None => tx.send(message).map_err(|_| Aborted),
        }
    }
}

impl Drop for CoreSeat<'_> {
    fn drop(&mut self) {
        self.release();
    }
}
