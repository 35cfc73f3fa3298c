//! Core slots: when more CPU workers than cores share a machine (four pipeline stages on two
//! cores), each compute op first takes one of `n_cores` slots, first come first served, and holds
//! it until the op ends. At most `n_cores` ops compute at once, each with a core to itself, so the
//! operating system never time-slices two ops on one core: an op's wall time stays its cost, and
//! the wait for a core is a queue that [`conveyor_schedules::simulate_with_core_slots`] models
//! exactly (the same FIFO), which is what makes measured and predicted bubbles comparable.
use std::collections::VecDeque;

use parking_lot::{Condvar, Mutex};

/// A first-come-first-served counting semaphore of `n_slots` slots.
#[derive(Debug)]
pub(crate) struct CoreSlots {
    state: Mutex<SlotState>,
    changed: Condvar,
}

#[derive(Debug)]
struct SlotState {
    free: usize,
    next_ticket: u64,
    /// Tickets waiting, oldest first.
    queue: VecDeque<u64>,
}

/// A held slot; dropping it (also while unwinding from a panicking op) frees the slot.
pub(crate) struct SlotGuard<'a> {
    slots: &'a CoreSlots,
}

impl CoreSlots {
    /// `n_slots` slots (at least 1).
    pub(crate) fn new(n_slots: usize) -> CoreSlots {
        let n_slots = n_slots.max(1);
        CoreSlots {
            state: Mutex::new(SlotState { free: n_slots, next_ticket: 0, queue: VecDeque::new() }),
            changed: Condvar::new(),
        }
    }

    /// Waits until this caller is the oldest waiter and a slot is free, then takes it.
    pub(crate) fn acquire(&self) -> SlotGuard<'_> {
        let mut state = self.state.lock();
        let ticket = state.next_ticket;
        state.next_ticket += 1;
        state.queue.push_back(ticket);
        while !(state.free > 0 && state.queue.front() == Some(&ticket)) {
            self.changed.wait(&mut state);
        }
        state.queue.pop_front();
        state.free -= 1;
        // The next waiter may take another free slot.
        if state.free > 0 && !state.queue.is_empty() {
            self.changed.notify_all();
        }
        SlotGuard { slots: self }
    }
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        let mut state = self.slots.state.lock();
        state.free += 1;
        if !state.queue.is_empty() {
            self.slots.changed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[test]
    fn never_more_holders_than_slots() {
        let slots = Arc::new(CoreSlots::new(2));
        let holding = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..6)
            .map(|_| {
                let (slots, holding, most) = (Arc::clone(&slots), Arc::clone(&holding), Arc::clone(&most));
                std::thread::spawn(move || {
                    for _ in 0..20 {
                        let _slot = slots.acquire();
                        let now = holding.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_micros(50));
                        holding.fetch_sub(1, Ordering::SeqCst);
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
        let slots = Arc::new(CoreSlots::new(1));
        let order = Arc::new(Mutex::new(Vec::new()));
        let first = slots.acquire();
        let mut threads = Vec::new();
        for i in 0..4 {
            let (slots_c, order_c) = (Arc::clone(&slots), Arc::clone(&order));
            threads.push(std::thread::spawn(move || {
                let _slot = slots_c.acquire();
                order_c.lock().push(i);
            }));
            // Wait until thread i is queued before starting the next one.
            while slots.state.lock().queue.len() < i + 1 {
                std::thread::yield_now();
            }
        }
        drop(first);
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*order.lock(), vec![0, 1, 2, 3]);
    }

    #[test]
    fn a_panicking_holder_frees_its_slot() {
        let slots = Arc::new(CoreSlots::new(1));
        let s = Arc::clone(&slots);
        let result = std::thread::spawn(move || {
            let _slot = s.acquire();
            panic!("op failed");
        })
        .join();
        assert!(result.is_err());
        drop(slots.acquire());
    }
}
