//! `ShardGroup`: the shards of a tensor-parallel layer, where they live ([`Shards`]: every shard
//! on a thread of this process, or this rank's one shard with the others on other ranks), their
//! collective handles, and the one place that runs a per-shard closure.
use std::ops::Range;
use std::sync::{Arc, Mutex};

use conveyor_engine::collective::{Communicator, ProcessGroup, RankHandle, Traffic, TransportGroup};
use conveyor_engine::{CudaDevice, DType, Device, Error, Parameter, Result, Tensor};

use super::shard_threads::ShardThreads;

/// Where the `k` shards of a split layer live.
#[derive(Clone, Debug)]
pub enum Shards {
    /// Every shard in this process: shard `r` on `devices[r]`, each computed on its own thread,
    /// meeting in an in-process group. Inputs arrive on the first device.
    Local(Vec<Device>),
    /// One shard in this process (an MPI rank's): shard `comm.rank()` of `comm.n_ranks()`, the
    /// others on the other ranks of the group, as Megatron gives every shard a rank. Every rank of
    /// the group calls the layer with the same inputs, in the same order (the ranks of a
    /// tensor-parallel stage run the same program), so inputs are not broadcast.
    Rank(RankShard),
}

/// This rank's shard of a split layer: its device and the transport group of the stage's ranks,
/// shared by every split layer of the stage (their collectives take turns on it, in program order
/// on every rank).
#[derive(Clone, Debug)]
pub struct RankShard {
    device: Device,
    comm: Arc<Mutex<TransportGroup>>,
}

impl RankShard {
    /// Shard `comm.rank()` of `comm.n_ranks()`, on `device`.
    pub fn new(device: Device, comm: TransportGroup) -> RankShard {
        RankShard { device, comm: Arc::new(Mutex::new(comm)) }
    }

    /// This rank's shard index.
    pub fn shard(&self) -> usize {
        self.lock().rank()
    }

    /// The number of shards (ranks of the group).
    pub fn k(&self) -> usize {
        self.lock().n_ranks()
    }

    /// The device of this rank's shard.
    pub fn device(&self) -> &Device {
        &self.device
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TransportGroup> {
        self.comm.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[derive(Debug)]
enum Members {
    /// Every shard here, meeting in an in-process group (host buffers: GPU tensors go through the
    /// host, the collectives' fallback).
    Local(Mutex<Vec<RankHandle>>),
    /// Every shard here, each on its own GPU, meeting in an NCCL group (device buffers).
    Nccl(Mutex<Vec<Box<dyn Communicator>>>),
    Rank(RankShard),
}

/// The shards of a split layer held here (all `k`, or one) and their collective handles.
///
/// Calls are serialised by a lock (a layer's forward and backward calls come from one pipeline
/// worker anyway). With every shard here a failed call recovers the group before returning (an
/// NCCL group is built anew), so one budget overrun does not poison the layer for the next step;
/// with one shard per rank the ranks recover together afterwards ([`ShardGroup::recover`]).
#[derive(Debug)]
pub(crate) struct ShardGroup {
    k: usize,
    /// The first shard held here; the others held here follow it.
    first_shard: usize,
    /// The devices of the shards held here, in shard order.
    devices: Vec<Device>,
    members: Members,
    /// The threads of shards `1..` held here (none with one shard per rank).
    threads: ShardThreads,
}

impl ShardGroup {
    pub(crate) fn new(kind: &str, shards: &Shards) -> Result<ShardGroup> {
        match shards {
            Shards::Local(devices) => ShardGroup::in_process(kind, devices),
            Shards::Rank(shard) => Ok(ShardGroup {
                k: shard.k(),
                first_shard: shard.shard(),
                devices: vec![shard.device.clone()],
                members: Members::Rank(shard.clone()),
                threads: ShardThreads::default(),
            }),
        }
    }

    fn in_process(kind: &str, devices: &[Device]) -> Result<ShardGroup> {
        if devices.is_empty() {
            return Err(Error::invalid(format!("{kind} devices"), "empty: give the k devices to split the layer over"));
        }
        for (i, device) in devices.iter().enumerate() {
            if devices[..i].iter().any(|d| d.same_device(device)) {
                return Err(Error::invalid(
                    format!("{kind} devices"),
                    format!("{device} appears twice; each shard needs its own device"),
                ));
            }
        }
        // Shards on distinct GPUs exchange through NCCL when it is built and installed; any other
        // set of devices (or NCCL missing) through the in-process group, whose collectives stage
        // GPU tensors through the host.
        let nccl = devices.iter().all(|d| matches!(d, Device::Cuda(_))).then(|| CudaDevice::nccl_group(devices));
        let members = match nccl {
            Some(Ok(comms)) => Members::Nccl(Mutex::new(comms)),
            _ => Members::Local(Mutex::new(ProcessGroup::new(devices)?)),
        };
        let threads = ShardThreads::new(devices.len());
        Ok(ShardGroup { k: devices.len(), first_shard: 0, devices: devices.to_vec(), members, threads })
    }

    /// The number of shards, here and elsewhere.
    pub(crate) fn k(&self) -> usize {
        self.k
    }

    /// The shards held here.
    pub(crate) fn local(&self) -> Range<usize> {
        self.first_shard..self.first_shard + self.devices.len()
    }

    /// How many shards are held here.
    pub(crate) fn n_local(&self) -> usize {
        self.devices.len()
    }

    /// Where shard `rank` (held here) sits among the shards held here.
    pub(crate) fn local_index(&self, rank: usize) -> usize {
        rank - self.first_shard
    }

    /// `(shard, device)` for every shard held here.
    pub(crate) fn local_devices(&self) -> impl Iterator<Item = (usize, &Device)> {
        self.devices.iter().enumerate().map(|(i, d)| (self.first_shard + i, d))
    }

    /// The device of shard `rank` (held here).
    pub(crate) fn device(&self, rank: usize) -> &Device {
        &self.devices[self.local_index(rank)]
    }

    /// The devices of the shards held here.
    pub(crate) fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// Whether shard `rank` returns the layer's output here: the first shard held here (every
    /// shard ends a call with the full result).
    pub(crate) fn returns_output(&self, rank: usize) -> bool {
        rank == self.first_shard
    }

    /// Whether every shard's caller holds the layer's input (one shard per rank, each rank called
    /// with the same input), so nothing needs broadcasting from the first shard.
    pub(crate) fn inputs_replicated(&self) -> bool {
        matches!(self.members, Members::Rank(_))
    }

    /// What each shard held here has sent since construction or the last reset.
    pub(crate) fn traffic(&self) -> Vec<Traffic> {
        match &self.members {
            Members::Local(handles) => lock(handles).iter().map(|h| h.traffic()).collect(),
            Members::Nccl(comms) => lock(comms).iter().map(|c| c.traffic()).collect(),
            Members::Rank(shard) => vec![shard.lock().traffic()],
        }
    }

    /// Sets the sent-traffic counters of the shards held here to zero.
    pub(crate) fn reset_traffic(&self) {
        match &self.members {
            Members::Local(handles) => lock(handles).iter().for_each(|h| h.reset_traffic()),
            Members::Nccl(comms) => lock(comms).iter().for_each(|c| c.reset_traffic()),
            Members::Rank(shard) => shard.lock().reset_traffic(),
        }
    }

    /// The device inputs arrive on and outputs leave from (the pipeline stage's device here).
    pub(crate) fn first(&self) -> &Device {
        &self.devices[0]
    }

    /// Runs `f(shard, comm, state)` for every shard held here at once, the shard `local().start + i`
    /// with `states[i]`, and returns the results in shard order. With every shard here, each runs
    /// on its own thread (the first on the caller's); with one shard here, on the caller's thread
    /// while the other ranks run theirs. On failure returns the root cause (a shard's own error
    /// rather than the aborts it caused on its peers) after recovering the group.
    pub(crate) fn run<S: Send, T: Send>(
        &self,
        states: Vec<S>,
        f: impl Fn(usize, &dyn Communicator, S) -> Result<T> + Sync,
    ) -> Result<Vec<T>> {
        if states.len() != self.devices.len() {
            return Err(Error::invalid(
                "ShardGroup::run states",
                format!("{} for {} shards held here", states.len(), self.devices.len()),
            ));
        }
        match &self.members {
            Members::Local(handles) => {
                let mut handles = lock(handles);
                let abort = |rank: usize, reason: &str| handles[rank].abort_handle().abort(rank, reason);
                let comms: Vec<&dyn Communicator> = handles.iter().map(|h| h as &dyn Communicator).collect();
                let outcome = self.run_threads(&comms, &abort, states, f);
                if outcome.is_err() {
                    ProcessGroup::recover(&mut handles)?;
                }
                outcome
            }
            // An NCCL rank cannot tell its peers that it failed: they end at the group's timeout,
            // and a rank that failed after issuing work refuses later calls (see `nccl.rs`), so a
            // failed call builds the group anew, as the in-process group recovers.
            Members::Nccl(comms) => {
                let mut comms = lock(comms);
                let refs: Vec<&dyn Communicator> = comms.iter().map(|c| c.as_ref()).collect();
                let outcome = self.run_threads(&refs, &|_: usize, _: &str| {}, states, f);
                if outcome.is_err() {
                    *comms = CudaDevice::nccl_group(&self.devices)?;
                }
                outcome
            }
            Members::Rank(shard) => {
                // No recovery here: the rank that failed may be in no collective at all (its
                // failure was its own), so waiting for it could last the whole timeout. The
                // runtime frees every waiting rank when a step is abandoned
                // (`collective::interrupt_waits`), and then every rank recovers every group
                // together ([`ShardGroup::recover`]).
                let comm = shard.lock();
                let state = states.into_iter().next().expect("one state (checked)");
                Ok(vec![f(self.first_shard, &*comm, state)?])
            }
        }
    }

    /// Runs `f` for every shard on its own thread (the first on the caller's, the others on the
    /// group's long-lived shard threads) with `comms[r]`;
    /// `abort(rank, reason)` ends the other shards' waits when one fails or panics outside a
    /// collective. On failure returns the root cause (a shard's own error rather than the aborts
    /// it caused on its peers); the caller recovers the group.
    fn run_threads<S: Send, T: Send>(
        &self,
        comms: &[&dyn Communicator],
        abort: &(dyn Fn(usize, &str) + Sync),
        states: Vec<S>,
        f: impl Fn(usize, &dyn Communicator, S) -> Result<T> + Sync,
    ) -> Result<Vec<T>> {
        // A shard that fails or panics outside a collective (a budget overrun while it allocates)
        // aborts the group at once, so the shards waiting for it in a collective end too.
        let guarded = |rank: usize, comm: &dyn Communicator, state: S| -> Result<T> {
            let mut guard = AbortUnlessDone { abort, rank, reason: "its thread panicked".into(), done: false };
            let result = f(rank, comm, state);
            match &result {
                Err(error) if !matches!(error, Error::CollectiveAborted { .. }) => guard.reason = error.to_string(),
                _ => guard.done = true,
            }
            result
        };
        let mut states = states.into_iter();
        let first_state = states.next().expect("a group has at least one rank");
        let guarded = &guarded;
        let rest: Vec<_> = comms[1..]
            .iter()
            .zip(states)
            .enumerate()
            .map(|(i, (&comm, state))| move || guarded(i + 1, comm, state))
            .collect();
        let results: Vec<Result<T>> = self
            .threads
            .run(|| guarded(0, comms[0], first_state), rest)
            .into_iter()
            .enumerate()
            .map(|(rank, outcome)| {
                outcome.unwrap_or_else(|message| {
                    Err(Error::CollectiveFailed {
                        op: "tensor-parallel shard".into(),
                        rank,
                        n_ranks: self.devices.len(),
                        reason: format!("its thread panicked: {message}"),
                    })
                })
            })
            .collect();
        if results.iter().all(Result::is_ok) {
            return Ok(results.into_iter().map(|r| r.expect("checked ok")).collect());
        }
        let mut errors: Vec<Error> = results.into_iter().filter_map(Result::err).collect();
        let cause = errors.iter().position(|e| !matches!(e, Error::CollectiveAborted { .. })).unwrap_or(0);
        Err(errors.swap_remove(cause))
    }

    /// Makes the group usable after an abandoned step. With one shard per rank every rank of the
    /// group must call it, after the step (it exchanges notices, see `TransportGroup::recover`);
    /// with every shard here it does nothing (a failed call recovers before returning).
    pub(crate) fn recover(&self) -> Result<()> {
        match &self.members {
            Members::Local(_) | Members::Nccl(_) => Ok(()),
            Members::Rank(shard) => shard.lock().recover(),
        }
    }

    /// Checks that a tensor handed to the layer lives on the group's first device and is f32.
    pub(crate) fn check_input(&self, kind: &str, tensor: &Tensor) -> Result<()> {
        if !tensor.device().same_device(self.first()) {
            return Err(Error::DeviceMismatch {
                op: format!("{kind} (inputs and gradients arrive on the group's first device)"),
                lhs: tensor.device().to_string(),
                rhs: self.first().to_string(),
            });
        }
        if tensor.dtype() != DType::F32 {
            return Err(Error::UnsupportedDType { op: kind.into(), dtype: tensor.dtype() });
        }
        Ok(())
    }

    /// `Layer::to_device` for a layer that may be a group of one device (the unsplit form of a
    /// block the planner has not split yet): that group moves whole, `params` with it, to a new
    /// group on `device`; a split layer answers as [`ShardGroup::to_device`].
    pub(crate) fn move_unsplit(&mut self, kind: &str, params: &mut [Parameter], device: &Device) -> Result<()> {
        if self.k == 1 && !self.inputs_replicated() && !device.same_device(self.first()) {
            for param in params.iter_mut() {
                param.value = param.value.to_device(device)?;
            }
            *self = ShardGroup::new(kind, &Shards::Local(vec![device.clone()]))?;
            return Ok(());
        }
        self.to_device(kind, device)
    }

    /// `Layer::to_device` for a split layer: its shards stay on their devices, so only the group's
    /// first device is accepted (as a no-op).
    pub(crate) fn to_device(&self, kind: &str, device: &Device) -> Result<()> {
        if device.same_device(self.first()) {
            return Ok(());
        }
        Err(Error::invalid(
            format!("{kind} device"),
            format!(
                "{device}: a tensor-parallel layer's shards stay on {}; place its stage on {}",
                self.devices.iter().map(Device::to_string).collect::<Vec<_>>().join(", "),
                self.first()
            ),
        ))
    }
}

/// Aborts the rank's group when dropped before the shard's call was marked done (an error, or a
/// panic unwinding through it).
struct AbortUnlessDone<'a> {
    abort: &'a (dyn Fn(usize, &str) + Sync),
    rank: usize,
    reason: String,
    done: bool,
}

impl Drop for AbortUnlessDone<'_> {
    fn drop(&mut self) {
        if !self.done {
            (self.abort)(self.rank, &self.reason);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
