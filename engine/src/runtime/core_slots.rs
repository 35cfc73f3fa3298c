//! Core slots: when more CPU workers than cores share a machine (four pipeline stages on two
//! cores), the workers schedule themselves onto `n_cores` slots instead of leaving it to the
//! operating system. A worker holds a slot while it runs (its ops and the bookkeeping between
//! them) and gives it up only to block: waiting for a message, it registers the channel it waits
//! on and sleeps; the sender of that message (sending under the same lock, so no notice can go
//! stale) puts it in the slot queue; a free slot goes to the
//! oldest queued worker, which is woken already holding it. So no more workers are runnable than
//! there are cores, an op's wall time stays its cost, and the order in which waiting workers get a
//! core is first come first served, exactly what
//! [`conveyor_schedules::simulate_with_core_slots`] models; that is what makes measured and
//! predicted bubbles comparable on an oversubscribed machine.
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::worker::ChannelKey;

/// How often a worker blocked for a message or a slot checks whether the step was aborted.
const ABORT_POLL: Duration = Duration::from_millis(50);

/// The slots and the queue for them, shared by all workers of a trainer.
#[derive(Debug)]
pub(crate) struct CoreSlots {
    state: Mutex<SlotState>,
    /// One per worker: a worker sleeps on its own, so a grant wakes only the worker it is for.
    wake: Vec<Condvar>,
}

#[derive(Debug)]
struct SlotState {
    free: usize,
    /// Workers waiting for a slot, oldest first.
    queue: VecDeque<usize>,
    /// Per worker: a slot was handed to it and it has not taken it up yet.
    granted: Vec<bool>,
    /// Per worker: the channel it sleeps on until a message arrives.
    awaiting: Vec<Option<ChannelKey>>,
    /// Per worker: when its awaited message was sent and it joined the queue.
    queued_at: Vec<Option<Instant>>,
    /// Per worker: when a slot was handed to it.
    granted_at: Vec<Option<Instant>>,
    /// Seconds from a grant to the sleeping worker taking it up, since the last
    /// [`CoreSlots::take_wake_latencies`].
    wake_latencies: Vec<f64>,
}

impl SlotState {
    /// Hands free slots to the oldest queued workers and wakes each of them.
    fn dispatch(&mut self, wake: &[Condvar]) {
        while self.free > 0 {
            let Some(worker) = self.queue.pop_front() else { break };
            self.free -= 1;
            self.granted[worker] = true;
            self.granted_at[worker] = Some(Instant::now());
            wake[worker].notify_one();
        }
    }

    /// Undoes a worker's place in the queue, or its grant, after an abort.
    fn withdraw(&mut self, worker: usize, wake: &[Condvar]) {
        self.awaiting[worker] = None;
        self.queued_at[worker] = None;
        if std::mem::take(&mut self.granted[worker]) {
            self.free += 1;
            self.dispatch(wake);
        } else {
            self.queue.retain(|&w| w != worker);
        }
    }
}

impl CoreSlots {
    /// `n_slots` slots (at least 1) for `n_workers` workers.
    pub(crate) fn new(n_slots: usize, n_workers: usize) -> CoreSlots {
        CoreSlots {
            state: Mutex::new(SlotState {
                free: n_slots.max(1),
                queue: VecDeque::new(),
                granted: vec![false; n_workers],
                awaiting: vec![None; n_workers],
                queued_at: vec![None; n_workers],
                granted_at: vec![None; n_workers],
                wake_latencies: Vec::new(),
            }),
            wake: (0..n_workers).map(|_| Condvar::new()).collect(),
        }
    }

    /// Waits in line for a slot. Returns false (holding none) if `aborted` turns true first.
    pub(crate) fn acquire(&self, worker: usize, aborted: &dyn Fn() -> bool) -> bool {
        let mut state = self.state.lock();
        state.queue.push_back(worker);
        state.dispatch(&self.wake);
        self.wait_for_grant(&mut state, worker, aborted)
    }

    /// Gives a held slot back.
    pub(crate) fn release(&self) {
        let mut state = self.state.lock();
        state.free += 1;
        state.dispatch(&self.wake);
    }

    /// Called holding a slot when the next message is not there yet: unless `has_message` (checked
    /// under the lock) now finds it, gives the slot up and sleeps until a message is sent on `key`
    /// and a slot is handed back. Returns when the worker joined the queue (now, if it kept its
    /// slot), or `None` (holding no slot) if `aborted` turns true first.
    pub(crate) fn block_until_message(
        &self,
        worker: usize,
        key: ChannelKey,
        has_message: &dyn Fn() -> bool,
        aborted: &dyn Fn() -> bool,
    ) -> Option<Instant> {
        let mut state = self.state.lock();
        if has_message() {
            return Some(Instant::now());
        }
        state.awaiting[worker] = Some(key);
        state.free += 1;
        state.dispatch(&self.wake);
        if !self.wait_for_grant(&mut state, worker, aborted) {
            return None;
        }
        Some(state.queued_at[worker].take().unwrap_or_else(Instant::now))
    }

    /// Sends a message to `worker` on `key` with `send` (which must not block) and, if the worker
    /// sleeps on that channel, puts it in the slot queue. The send happens under the lock the
    /// receiver checks its channel under, so a worker is queued exactly when its message is there.
    pub(crate) fn send_message<E>(
        &self,
        worker: usize,
        key: ChannelKey,
        send: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let mut state = self.state.lock();
        send()?;
        if state.awaiting[worker] == Some(key) {
            state.awaiting[worker] = None;
            state.queued_at[worker] = Some(Instant::now());
            state.queue.push_back(worker);
            state.dispatch(&self.wake);
        }
        Ok(())
    }

    /// The wake-up latencies recorded since the last call (the time the operating system took to
    /// run a sleeping worker after a slot was handed to it), clearing them.
    pub(crate) fn take_wake_latencies(&self) -> Vec<f64> {
        std::mem::take(&mut self.state.lock().wake_latencies)
    }

    fn wait_for_grant(
        &self,
        state: &mut parking_lot::MutexGuard<'_, SlotState>,
        worker: usize,
        aborted: &dyn Fn() -> bool,
    ) -> bool {
        let mut slept = false;
        loop {
            if std::mem::take(&mut state.granted[worker]) {
                if let (true, Some(at)) = (slept, state.granted_at[worker].take()) {
                    state.wake_latencies.push(at.elapsed().as_secs_f64());
                }
                return true;
            }
            if aborted() {
                state.withdraw(worker, &self.wake);
                return false;
            }
            self.wake[worker].wait_for(state, ABORT_POLL);
            slept = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const NEVER: &dyn Fn() -> bool = &|| false;

    #[test]
    fn never_more_holders_than_slots() {
        let slots = Arc::new(CoreSlots::new(2, 6));
        let holding = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..6)
            .map(|worker| {
                let (slots, holding, most) = (Arc::clone(&slots), Arc::clone(&holding), Arc::clone(&most));
                std::thread::spawn(move || {
                    for _ in 0..20 {
                        assert!(slots.acquire(worker, NEVER));
                        let now = holding.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_micros(50));
                        holding.fetch_sub(1, Ordering::SeqCst);
                        slots.release();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(most.load(Ordering::SeqCst), 2);
        assert_eq!(slots.state.lock().free, 2);
    }

    #[test]
    fn waiters_are_served_in_arrival_order() {
        let slots = Arc::new(CoreSlots::new(1, 5));
        let order = Arc::new(Mutex::new(Vec::new()));
        assert!(slots.acquire(4, NEVER));
        let mut threads = Vec::new();
        for worker in 0..4 {
            let (slots_c, order_c) = (Arc::clone(&slots), Arc::clone(&order));
            threads.push(std::thread::spawn(move || {
                assert!(slots_c.acquire(worker, NEVER));
                order_c.lock().push(worker);
                slots_c.release();
            }));
            // Wait until worker i is queued before starting the next one.
            while slots.state.lock().queue.len() < worker + 1 {
                std::thread::yield_now();
            }
        }
        slots.release();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*order.lock(), vec![0, 1, 2, 3]);
    }

    #[test]
    fn a_message_wakes_its_receiver_with_a_slot() {
        let slots = Arc::new(CoreSlots::new(1, 2));
        let key: ChannelKey = (0, 1, false);
        assert!(slots.acquire(1, NEVER));
        let arrived = Arc::new(AtomicUsize::new(0));
        let (slots_c, arrived_c) = (Arc::clone(&slots), Arc::clone(&arrived));
        let receiver = std::thread::spawn(move || {
            let has = || arrived_c.load(Ordering::SeqCst) > 0;
            assert!(slots_c.block_until_message(1, key, &has, NEVER).is_some());
            assert!(has());
            slots_c.release();
        });
        // The receiver gave its slot up: worker 0 can take it, send, and give it back.
        assert!(slots.acquire(0, NEVER));
        // A message on another channel does not wake it.
        slots.send_message(1, (5, 1, true), || Ok::<(), ()>(())).unwrap();
        slots
            .send_message(1, key, || {
                arrived.store(1, Ordering::SeqCst);
                Ok::<(), ()>(())
            })
            .unwrap();
        slots.release();
        receiver.join().unwrap();
        let state = slots.state.lock();
        assert_eq!((state.free, state.queue.len()), (1, 0));
    }

    #[test]
    fn an_abort_withdraws_a_waiter_without_losing_a_slot() {
        let slots = Arc::new(CoreSlots::new(1, 2));
        assert!(slots.acquire(0, NEVER));
        let s = Arc::clone(&slots);
        let waiter = std::thread::spawn(move || s.acquire(1, &|| true));
        assert!(!waiter.join().unwrap());
        slots.release();
        let state = slots.state.lock();
        assert_eq!((state.free, state.queue.len()), (1, 0));
    }
}
