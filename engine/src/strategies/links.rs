//! What the workers of a [`super::SyncTrainer`] run share: the abort flag every wait polls, the
//! all-gather of `allreduce` and `average:K` ([`WorkerExchange`]: in-process here, across MPI ranks
//! in `ranks.rs`), the turnstile that fixes an asynchronous run's interleaving, and the per-step
//! statistics.
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::{Condvar, Mutex, MutexGuard};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use super::Interleaving;
use crate::{Error, Result};

/// How long a wait sleeps before it looks at the abort flag again.
const POLL: Duration = Duration::from_millis(20);

/// Raised by the first worker or server that fails (recording which); every wait of the run then
/// ends with an error, so no thread waits for one that will never come.
#[derive(Clone, Debug)]
pub(super) struct Abort(Arc<AtomicUsize>);

impl Default for Abort {
    fn default() -> Abort {
        Abort(Arc::new(AtomicUsize::new(NOBODY)))
    }
}

/// [`Abort`]'s value while nobody has failed.
const NOBODY: usize = usize::MAX;

impl Abort {
    /// Thread `who` failed; only the first to raise is kept.
    pub fn raise(&self, who: usize) {
        let _ = self.0.compare_exchange(NOBODY, who, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// The thread that failed first, if any.
    pub fn first(&self) -> Option<usize> {
        Some(self.0.load(Ordering::SeqCst)).filter(|&who| who != NOBODY)
    }

    pub fn check(&self) -> Result<()> {
        if self.first().is_some() {
            return Err(Error::invalid("data-parallel strategy", "another worker or server failed; this run stopped"));
        }
        Ok(())
    }

    /// Waits on `cv` until `done(state)`, polling the flag.
    pub fn wait_until<T>(
        &self,
        cv: &Condvar,
        guard: &mut MutexGuard<'_, T>,
        mut done: impl FnMut(&T) -> bool,
    ) -> Result<()> {
        while !done(guard) {
            self.check()?;
            cv.wait_for(guard, POLL);
        }
        Ok(())
    }
}

/// The all-gather of `allreduce` and `average:K`: worker `worker` gives its bytes and gets every
/// worker's, in worker order, the same on every worker. Two implementations: [`Exchange`] (the
/// workers are threads of this process) and `ranks::RankExchange` (one worker per MPI rank); the
/// math around it (encode, decode, sum in worker order) is one code path for both.
pub(super) trait WorkerExchange: Sync {
    /// Everyone's bytes in worker order; fails when the run aborts (or a peer rank times out).
    fn all_gather(&self, worker: usize, bytes: Vec<u8>, abort: &Abort) -> Result<Arc<Vec<Vec<u8>>>>;
}

impl WorkerExchange for Exchange {
    fn all_gather(&self, worker: usize, bytes: Vec<u8>, abort: &Abort) -> Result<Arc<Vec<Vec<u8>>>> {
        Exchange::all_gather(self, worker, bytes, abort)
    }
}

/// An all-gather among the in-process workers: each gives its bytes, each gets everyone's in
/// worker order (the same `Arc` for all), so every worker decodes and sums the same values in the
/// same order.
#[derive(Debug)]
pub(super) struct Exchange {
    state: Mutex<ExchangeState>,
    ready: Condvar,
}

#[derive(Debug)]
struct ExchangeState {
    slots: Vec<Option<Vec<u8>>>,
    deposited: usize,
    generation: u64,
    published: Arc<Vec<Vec<u8>>>,
}

impl Exchange {
    pub fn new(workers: usize) -> Exchange {
        Exchange {
            state: Mutex::new(ExchangeState {
                slots: vec![None; workers],
                deposited: 0,
                generation: 0,
                published: Arc::new(Vec::new()),
            }),
            ready: Condvar::new(),
        }
    }

    /// A generation is published only when every worker gave its part, and the next can only be
    /// published after every worker gave again, so the one kept is never replaced while a worker
    /// has yet to read it.
    pub fn all_gather(&self, worker: usize, bytes: Vec<u8>, abort: &Abort) -> Result<Arc<Vec<Vec<u8>>>> {
        let mut state = self.state.lock();
        let generation = state.generation;
        state.slots[worker] = Some(bytes);
        state.deposited += 1;
        if state.deposited == state.slots.len() {
            let parts = state.slots.iter_mut().map(|slot| slot.take().unwrap_or_default()).collect();
            state.published = Arc::new(parts);
            state.deposited = 0;
            state.generation += 1;
            self.ready.notify_all();
        } else {
            abort.wait_until(&self.ready, &mut state, |s| s.generation != generation)?;
        }
        Ok(Arc::clone(&state.published))
    }
}

/// One message a worker sends a server, in its turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Action {
    Pull { step: usize },
    Push { step: usize },
}

/// The deterministic mode's gate: a worker sends a pull or a push only in its turn, and turns are
/// drawn (or replayed) one at a time among the workers allowed to go. A turn covers sending the
/// message, not waiting for its answer, and servers handle messages in the order they arrive, so
/// the servers see every message in the drawn order whatever the threads' timing.
///
/// Why it cannot deadlock: the drawn worker always gets there (it only computes before its next
/// action), and some worker is always allowed to go: the one with the fewest pushes, whose next
/// pull is within any staleness bound and whose pushes are never held back.
#[derive(Debug)]
pub(super) struct Turnstile {
    state: Mutex<TurnState>,
    moved: Condvar,
}

#[derive(Debug)]
struct TurnState {
    draw: Draw,
    /// Every worker's actions of this run, and how many it has taken.
    actions: Vec<Vec<Action>>,
    taken: Vec<usize>,
    /// Pushes sent per worker, from the start of training.
    pushed: Vec<usize>,
    staleness: Option<usize>,
    current: Option<usize>,
    record: Vec<u16>,
}

#[derive(Debug)]
enum Draw {
    Seeded(Box<StdRng>),
    Replay { turns: Vec<u16>, next: usize },
}

impl Turnstile {
    /// `interleaving` must be seeded or a replay; `start` is the step the run starts at.
    pub fn new(
        interleaving: &Interleaving,
        actions: Vec<Vec<Action>>,
        start: usize,
        staleness: Option<usize>,
        turns_so_far: usize,
    ) -> Turnstile {
        let draw = match interleaving {
            Interleaving::Replay(turns) => Draw::Replay { turns: turns.clone(), next: turns_so_far },
            // One generator per run segment, from the seed and the turns drawn before it (a free
            // run has no turnstile; seed 0 stands in).
            Interleaving::Seeded(_) | Interleaving::Free => {
                let seed = if let Interleaving::Seeded(seed) = interleaving { *seed } else { 0 };
                Draw::Seeded(Box::new(StdRng::seed_from_u64(
                    seed ^ (turns_so_far as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                )))
            }
        };
        let workers = actions.len();
        Turnstile {
            state: Mutex::new(TurnState {
                draw,
                taken: vec![0; workers],
                actions,
                pushed: vec![start; workers],
                staleness,
                current: None,
                record: Vec::new(),
            }),
            moved: Condvar::new(),
        }
    }

    /// Waits for `worker`'s turn for its next action.
    pub fn acquire(&self, worker: usize, abort: &Abort) -> Result<()> {
        let mut state = self.state.lock();
        loop {
            if state.current.is_none() {
                state.draw_next()?;
                self.moved.notify_all();
            }
            if state.current == Some(worker) {
                return Ok(());
            }
            abort.check()?;
            self.moved.wait_for(&mut state, POLL);
        }
    }

    /// Ends `worker`'s turn once its message is sent.
    pub fn release(&self, worker: usize) {
        let mut state = self.state.lock();
        let action = state.actions[worker][state.taken[worker]];
        state.taken[worker] += 1;
        if let Action::Push { .. } = action {
            state.pushed[worker] += 1;
        }
        state.current = None;
        self.moved.notify_all();
    }

    /// The turns drawn so far in this run, in order.
    pub fn into_record(self) -> Vec<u16> {
        self.state.into_inner().record
    }
}

impl TurnState {
    fn allowed(&self, worker: usize) -> bool {
        let Some(&action) = self.actions[worker].get(self.taken[worker]) else { return false };
        match (action, self.staleness) {
            (Action::Pull { step }, Some(staleness)) => {
                // Workers with no actions left count as done with everything.
                let slowest = (0..self.actions.len())
                    .filter(|&w| self.taken[w] < self.actions[w].len())
                    .map(|w| self.pushed[w])
                    .min()
                    .unwrap_or(usize::MAX / 2);
                slowest + staleness >= step
            }
            _ => true,
        }
    }

    fn draw_next(&mut self) -> Result<()> {
        let allowed: Vec<usize> = (0..self.actions.len()).filter(|&w| self.allowed(w)).collect();
        if allowed.is_empty() {
            return Ok(()); // every worker is done
        }
        let worker = match &mut self.draw {
            Draw::Seeded(rng) => allowed[rng.random_range(0..allowed.len())],
            Draw::Replay { turns, next } => {
                let Some(&worker) = turns.get(*next) else {
                    return Err(Error::invalid(
                        "interleaving",
                        format!("the recorded interleaving ends after {} turns; this run needs more", turns.len()),
                    ));
                };
                *next += 1;
                let worker = usize::from(worker);
                if !allowed.contains(&worker) {
                    return Err(Error::invalid(
                        "interleaving",
                        format!(
                            "turn {} of the record is worker {worker}, which cannot go then in this run",
                            *next - 1
                        ),
                    ));
                }
                worker
            }
        };
        self.record.push(worker as u16);
        self.current = Some(worker);
        Ok(())
    }
}

/// What happened in one step (a worker's step index), summed over workers and servers.
#[derive(Clone, Debug, Default)]
pub(super) struct StepStats {
    pub loss_sum: f64,
    pub losses: usize,
    pub bytes: u64,
    pub staleness_sum: u64,
    pub staleness_max: u64,
    pub pushes: u64,
    /// Seconds from the run's start to the last worker finishing the step.
    pub finished_s: f64,
}

/// Statistics of a run, per step (index: step - the run's first step).
#[derive(Debug)]
pub(super) struct RunStats {
    pub start: usize,
    pub steps: Mutex<Vec<StepStats>>,
}

impl RunStats {
    pub fn new(start: usize, steps: usize) -> RunStats {
        RunStats { start, steps: Mutex::new(vec![StepStats::default(); steps]) }
    }

    pub fn with<T>(&self, step: usize, f: impl FnOnce(&mut StepStats) -> T) -> T {
        let mut steps = self.steps.lock();
        let idx = step.saturating_sub(self.start).min(steps.len().saturating_sub(1));
        f(&mut steps[idx])
    }
}
