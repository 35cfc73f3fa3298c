//! The data-parallel gradient all-reduce in buckets, overlapping the backward pass (PyTorch
//! DDP's reducer): each node's gradients are handed over as soon as they are final (the weight
//! pass of the step's last micro-batch, nodes in reverse order), gathered into buckets of about
//! [`TrainerBuilder::bucket_size`](super::TrainerBuilder::bucket_size) bytes (the first one
//! smaller, [`FIRST_BUCKET_BYTES`], so communication starts early), and all-reduced by a
//! communication thread beside the worker while the worker goes on computing; the optimizer step
//! waits for the last bucket.
//!
//! **Same sums as without buckets.** A bucket is the unit of launch, not of arithmetic: each of
//! its tensors is all-reduced in place on its own, with the ring's nesting for that tensor, so
//! every element is the sum it is without buckets (and on one device with the replicas'
//! micro-batches, where the unbucketed sum is), whatever the bucket size. Every replica runs the
//! same program, so gradients become final in the same order everywhere and every member of the
//! group issues the same collectives in the same order.
//!
//! **Ownership.** A node's gradient tensors move into the bucket (the node's list is left empty)
//! and come back when the worker [`BucketReducer::finish`]es, also when a reduction failed or the
//! step is abandoned: the communication thread always returns every tensor it got.
//!
//! **No hang on failure.** The communication thread waits only for the worker's next bucket or
//! for a collective with its peers. When the worker fails or is aborted it closes the queue and
//! aborts its replica group ([`BucketReducer::abandon`]) before joining the thread, so a thread
//! waiting in a collective for a peer that will never come is freed at once (the coordinator
//! would abort the group for the abandoned step anyway; doing it first keeps the worker's join
//! from waiting on the coordinator, which waits on the worker's report).
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::thread::{Scope, ScopedJoinHandle};
use std::time::Instant;

use conveyor_schedules::{OpKind, TimelineEvent};
use crossbeam::channel::{self, Receiver, Sender};

use super::gradient_groups::GroupComm;
use super::stage::Stage;
use crate::collective::Communicator as _;
use crate::{Error, Result, Tensor};

/// The default bucket size, PyTorch DDP's `bucket_cap_mb=25`.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// The first bucket's size when the bucket size is larger (DDP's `_DEFAULT_FIRST_BUCKET_BYTES`):
/// the last layers' gradients are final first and small, so their all-reduce can start at once.
pub const FIRST_BUCKET_BYTES: usize = 1 << 20;

/// One node's gradients on their way through the communication thread.
pub(crate) struct NodeGrads {
    pub stage_idx: usize,
    pub node_pos: usize,
    pub grads: Vec<Tensor>,
}

/// Gradients of nodes gathered for one launch.
#[derive(Default)]
struct Bucket {
    items: Vec<NodeGrads>,
    bytes: usize,
}

/// What the communication thread gives back: every tensor it got, each bucket's all-reduce as a
/// timeline event of its worker, and the
/// first failure (after which it only returns what it gets).
struct Returned {
    items: Vec<NodeGrads>,
    events: Vec<TimelineEvent>,
    error: Option<Error>,
}

/// Where the weight pass hands over final gradients: gathers them into buckets and queues each
/// full one for the communication thread.
pub(crate) struct BucketQueue {
    sender: Option<Sender<Bucket>>,
    pending: Bucket,
    cap_bytes: usize,
    first_cap_bytes: usize,
    launched: usize,
}

impl BucketQueue {
    /// Takes node `node_pos`'s gradients of stage `stage_idx` (they are final), leaving its list
    /// empty until [`BucketReducer::finish`] puts them back.
    pub(crate) fn push(&mut self, stage_idx: usize, node_pos: usize, grads: &mut Vec<Tensor>) {
        if grads.is_empty() {
            return;
        }
        let grads = std::mem::take(grads);
        self.pending.bytes += grads.iter().map(Tensor::size_in_bytes).sum::<usize>();
        self.pending.items.push(NodeGrads { stage_idx, node_pos, grads });
        let cap = if self.launched == 0 { self.first_cap_bytes } else { self.cap_bytes };
        if self.pending.bytes >= cap {
            self.launch();
        }
    }

    /// Queues what is pending, however small.
    fn launch(&mut self) {
        if self.pending.items.is_empty() {
            return;
        }
        let bucket = std::mem::take(&mut self.pending);
        self.launched += 1;
        if let Some(sender) = &self.sender {
            // The thread only ends after the queue closes, so the send cannot fail.
            let _ = sender.send(bucket);
        }
    }
}

/// A worker's bucketed all-reduce for one step: the queue the weight pass fills and the
/// communication thread that reduces what it queues.
pub(crate) struct BucketReducer<'scope> {
    pub queue: BucketQueue,
    thread: ScopedJoinHandle<'scope, Returned>,
    comm: &'scope GroupComm,
}

impl<'scope> BucketReducer<'scope> {
    /// Starts the communication thread for `comm` (the worker's replica group) with buckets of
    /// `cap_bytes`.
    pub(crate) fn start<'env>(
        scope: &'scope Scope<'scope, 'env>,
        comm: &'scope GroupComm,
        cap_bytes: usize,
        started: Instant,
        device_idx: usize,
    ) -> BucketReducer<'scope> {
        let (sender, receiver) = channel::unbounded();
        let thread = std::thread::Builder::new()
            .name("conveyor-buckets".into())
            .spawn_scoped(scope, move || reduce_buckets(&receiver, comm, started, device_idx))
            .expect("spawning the bucket all-reduce thread");
        let queue = BucketQueue {
            sender: Some(sender),
            pending: Bucket::default(),
            cap_bytes: cap_bytes.max(1),
            first_cap_bytes: cap_bytes.clamp(1, FIRST_BUCKET_BYTES),
            launched: 0,
        };
        BucketReducer { queue, thread, comm }
    }

    /// Launches the last bucket, waits for every all-reduce, and puts every gradient back into
    /// its node; each bucket's all-reduce as a timeline event, or the first failure.
    pub(crate) fn finish(mut self, stages: &mut [Stage]) -> Result<Vec<TimelineEvent>> {
        self.queue.launch();
        self.queue.sender = None;
        let returned = join(self.thread);
        put_back(stages, returned.items)?;
        match returned.error {
            Some(error) => Err(error),
            None => Ok(returned.events),
        }
    }

    /// Ends the step's all-reduces early (the worker failed or was aborted): closes the queue,
    /// aborts the replica group so that no wait for a peer outlives the step, and puts every
    /// gradient back. The group is recovered or rebuilt with the others after the abandoned step.
    pub(crate) fn abandon(mut self, stages: &mut [Stage]) {
        // Gradients gathered for a bucket not yet launched come back too (they were lost before,
        // leaving their nodes without gradients for the next step).
        let pending = std::mem::take(&mut self.queue.pending.items);
        self.queue.sender = None;
        match self.comm {
            GroupComm::InProcess(handle) => handle.abort_handle().abort(handle.rank(), "the step was abandoned"),
            GroupComm::Nccl(rank, abort) => abort.abort(rank.rank(), "the step was abandoned"),
            GroupComm::Ranks(_) => crate::collective::interrupt_waits(),
        }
        let returned = join(self.thread);
        let _ = put_back(stages, returned.items);
        let _ = put_back(stages, pending);
    }
}

/// Joins the communication thread; it catches its own panics, so this always has its tensors.
fn join(thread: ScopedJoinHandle<'_, Returned>) -> Returned {
    thread.join().unwrap_or_else(|_| Returned {
        items: Vec::new(),
        events: Vec::new(),
        error: Some(Error::invalid("gradient buckets", "the all-reduce thread panicked")),
    })
}

fn put_back(stages: &mut [Stage], items: Vec<NodeGrads>) -> Result<()> {
    for item in items {
        let node = stages
            .iter_mut()
            .find(|s| s.stage_idx == item.stage_idx)
            .and_then(|s| s.nodes.get_mut(item.node_pos))
            .ok_or_else(|| {
                Error::invalid(
                    "gradient buckets",
                    format!("stage {} node {} is not on this worker", item.stage_idx, item.node_pos),
                )
            })?;
        node.grads = item.grads;
    }
    Ok(())
}

/// The communication thread: all-reduces each bucket's tensors in queue order until the queue
/// closes; after a failure it only collects what it gets, to give it back. Each bucket is an
/// op span of worker `device_idx` (the trace and `conveyor train --svg` draw it).
fn reduce_buckets(queue: &Receiver<Bucket>, comm: &GroupComm, started: Instant, device_idx: usize) -> Returned {
    let mut returned = Returned { items: Vec::new(), events: Vec::new(), error: None };
    while let Ok(mut bucket) = queue.recv() {
        if returned.error.is_none() {
            let stage_idx = bucket.items[0].stage_idx;
            let span = super::worker::op_span(device_idx, Some(stage_idx), OpKind::AllReduce, None);
            let start_s = started.elapsed().as_secs_f64();
            let outcome = catch_unwind(AssertUnwindSafe(|| -> Result<()> {
                for grad in bucket.items.iter_mut().flat_map(|item| item.grads.iter_mut()) {
                    comm.comm().all_reduce_tensor(grad)?;
                }
                Ok(())
            }));
            let end_s = started.elapsed().as_secs_f64();
            drop(span);
            match outcome {
                Ok(Ok(())) => {
                    returned.events.push(TimelineEvent {
                        device_idx,
                        stage_idx: Some(stage_idx),
                        op: OpKind::AllReduce,
                        micro_batch_idx: None,
                        start_s,
                        end_s,
                    });
                }
                Ok(Err(error)) => returned.error = Some(error),
                Err(payload) => {
                    let message = super::worker::panic_message(payload);
                    returned.error =
                        Some(Error::invalid("gradient buckets", format!("the all-reduce panicked: {message}")));
                }
            }
        }
        returned.items.append(&mut bucket.items);
    }
    returned
}
