//! The long-lived threads of a split layer's shards held in this process: shard 0 runs on the
//! calling (pipeline worker) thread, shard `i >= 1` always on the group's thread `i - 1`.
//!
//! The shards used to run on threads spawned for each call. On a GPU that costs far more than the
//! thread: every GPU-touching thread gets its own CUDA stream and cuBLAS handle on first use
//! (`device/cuda/thread_streams.rs`), so each call created and destroyed a stream and a handle per
//! shard (a 2-way tensor-parallel transformer step took 249 ms on two logical devices of an H200,
//! against 6.4 ms unsplit). A thread that lives as long as the layer keeps its stream, its handle
//! and its kernel cache, and on the CPU saves a thread start per shard per call.
//!
//! # Why borrowing across these threads is sound
//!
//! [`ShardThreads::run`] hands each thread a closure that may borrow the caller's data (the
//! shard's state, its communicator, the layer), so its lifetime is erased to send it. That is
//! sound because `run` does not return, and does not unwind, until every closure it sent has
//! either finished or been dropped unrun: each job catches its own panic and sends exactly one
//! result after its closure is consumed, nothing borrowed is touched after that send, and `run`
//! receives until it has one result per job sent or every job's sender is gone (a job dropped
//! unrun drops its sender without touching what it borrows). The caller's own shard runs under
//! `catch_unwind` too, so a panic there waits for the others before it resumes.
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

/// A job as a thread receives it (its borrows erased; see the module docs).
type Job = Box<dyn FnOnce() + Send + 'static>;

/// One thread per shard after the first, each waiting for its shard's next call.
#[derive(Debug, Default)]
pub(crate) struct ShardThreads {
    jobs: Vec<SyncSender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

/// Why a shard produced no result: its panic's message.
pub(crate) type ShardPanic = String;

impl ShardThreads {
    /// Threads for shards `1..n_shards` (none when there is one shard). A thread that cannot be
    /// started is left out: its shard then runs on a thread started for the call.
    pub(crate) fn new(n_shards: usize) -> ShardThreads {
        let mut pool = ShardThreads::default();
        for shard in 1..n_shards {
            let (sender, receiver) = sync_channel::<Job>(1);
            let thread =
                std::thread::Builder::new().name(format!("conveyor-shard-{shard}")).spawn(move || serve(&receiver));
            if let Ok(thread) = thread {
                pool.jobs.push(sender);
                pool.threads.push(thread);
            }
        }
        pool
    }

    /// Runs `first` here and `rest[i]` on shard `i + 1`'s thread, all at once, and returns once
    /// every one has finished: `first`'s result, then the others' in order; a panic becomes its
    /// message.
    pub(crate) fn run<'a, T, F>(&self, first: impl FnOnce() -> T, rest: Vec<F>) -> Vec<Result<T, ShardPanic>>
    where
        T: Send + 'a,
        F: FnOnce() -> T + Send + 'a,
    {
        let n = rest.len();
        let (results_tx, results_rx) = sync_channel::<(usize, Result<T, ShardPanic>)>(n);
        let mut results: Vec<Option<Result<T, ShardPanic>>> = (0..=n).map(|_| None).collect();
        let mut sent = 0;
        for (i, f) in rest.into_iter().enumerate() {
            let tx = results_tx.clone();
            let job: Box<dyn FnOnce() + Send + 'a> = Box::new(move || {
                let result = catch_unwind(AssertUnwindSafe(f)).map_err(|payload| panic_message(&*payload));
                let _ = tx.send((i + 1, result));
            });
            // SAFETY: the job borrows for 'a; this function waits below until it has finished or
            // been dropped unrun before returning or unwinding (module docs), so no borrow
            // outlives its data.
            let job: Job = unsafe { std::mem::transmute::<Box<dyn FnOnce() + Send + 'a>, Job>(job) };
            let unsent = match self.jobs.get(i) {
                Some(sender) => sender.send(job).err().map(|failed| failed.0),
                None => Some(job),
            };
            sent += 1;
            if let Some(job) = unsent {
                // No long-lived thread for this shard (it could not be started, or it is gone): a
                // thread for this call. If even that cannot start, the job is dropped unrun and
                // its sender with it, which the receiving loop below sees.
                let _ = std::thread::Builder::new().name(format!("conveyor-shard-{}", i + 1)).spawn(job);
            }
        }
        drop(results_tx);
        let first = catch_unwind(AssertUnwindSafe(first));
        let mut received = 0;
        while received < sent {
            match results_rx.recv() {
                Ok((shard, result)) => {
                    results[shard] = Some(result);
                    received += 1;
                }
                // Every job still out was dropped unrun.
                Err(_) => break,
            }
        }
        let first = match first {
            Ok(value) => value,
            Err(payload) => std::panic::resume_unwind(payload),
        };
        results[0] = Some(Ok(first));
        results.into_iter().map(|r| r.unwrap_or_else(|| Err("its thread could not be started".to_string()))).collect()
    }
}

impl Drop for ShardThreads {
    fn drop(&mut self) {
        // Closing the queues ends the threads; joining waits for their thread-local destructors
        // (the CUDA streams) too.
        self.jobs.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// A shard thread's loop: each job catches its own panics, so the thread lives until its queue
/// closes.
fn serve(jobs: &Receiver<Job>) {
    while let Ok(job) = jobs.recv() {
        job();
    }
}

/// The message of a panic payload (`&str` or `String`), or an empty string.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shard_runs_once_on_its_own_thread_with_borrowed_data() {
        let pool = ShardThreads::new(3);
        let data = vec![10, 20, 30];
        for _ in 0..3 {
            let rest: Vec<_> = (1..3)
                .map(|i| {
                    let data = &data;
                    move || (data[i], std::thread::current().name().map(str::to_string))
                })
                .collect();
            let results = pool.run(|| (data[0], std::thread::current().name().map(str::to_string)), rest);
            let values: Vec<i32> = results.iter().map(|r| r.as_ref().unwrap().0).collect();
            assert_eq!(values, [10, 20, 30]);
            assert_eq!(results[1].as_ref().unwrap().1.as_deref(), Some("conveyor-shard-1"));
            assert_eq!(results[2].as_ref().unwrap().1.as_deref(), Some("conveyor-shard-2"));
        }
    }

    #[test]
    fn a_shard_panic_becomes_its_message_and_the_threads_live_on() {
        let pool = ShardThreads::new(2);
        let results = pool.run(|| 1, vec![|| -> i32 { panic!("shard one failed") }]);
        assert_eq!(results[0], Ok(1));
        assert_eq!(results[1], Err("shard one failed".to_string()));
        let results = pool.run(|| 1, vec![|| 2]);
        assert_eq!(results, [Ok(1), Ok(2)]);
    }

    #[test]
    fn shards_meet_each_other_while_they_run() {
        // Both sides wait for the other: only concurrent execution finishes.
        let pool = ShardThreads::new(2);
        let barrier = std::sync::Barrier::new(2);
        let results = pool.run(
            || {
                barrier.wait();
                0
            },
            vec![|| {
                barrier.wait();
                1
            }],
        );
        assert_eq!(results, [Ok(0), Ok(1)]);
    }

    #[test]
    fn a_panic_on_the_calling_thread_waits_for_the_others_then_resumes() {
        let pool = ShardThreads::new(2);
        let finished = std::sync::atomic::AtomicBool::new(false);
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            pool.run(
                || -> i32 { panic!("shard zero failed") },
                vec![|| {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    finished.store(true, std::sync::atomic::Ordering::SeqCst);
                    1
                }],
            )
        }));
        assert!(outcome.is_err(), "the caller's panic resumes");
        assert!(finished.load(std::sync::atomic::Ordering::SeqCst), "after the other shard finished");
    }
}
