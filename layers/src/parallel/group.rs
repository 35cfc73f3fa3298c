//! `ShardGroup`: the devices of a tensor-parallel layer and their collective handles, and the one
//! place that runs a per-rank closure on `k` threads (rank 0 on the caller's thread).
use std::sync::Mutex;

use conveyor_engine::collective::{Communicator, ProcessGroup, RankHandle, Traffic};
use conveyor_engine::{Device, Error, Result, Tensor};

/// The `k` devices of a split layer and one collective handle per device.
///
/// Calls are serialised by a lock (a layer's forward and backward calls come from one pipeline
/// worker anyway), and a failed call recovers the group before returning, so one budget overrun
/// does not poison the layer for the next step.
#[derive(Debug)]
pub(crate) struct ShardGroup {
    devices: Vec<Device>,
    handles: Mutex<Vec<RankHandle>>,
}

impl ShardGroup {
    pub(crate) fn new(kind: &str, devices: &[Device]) -> Result<ShardGroup> {
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
        Ok(ShardGroup { devices: devices.to_vec(), handles: Mutex::new(ProcessGroup::new(devices)?) })
    }

    pub(crate) fn k(&self) -> usize {
        self.devices.len()
    }

    pub(crate) fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// What each rank has sent since construction or the last reset.
    pub(crate) fn traffic(&self) -> Vec<Traffic> {
        self.handles.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).iter().map(|h| h.traffic()).collect()
    }

    /// Sets every rank's sent-traffic counters to zero.
    pub(crate) fn reset_traffic(&self) {
        self.handles.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).iter().for_each(|h| h.reset_traffic());
    }

    /// The device inputs arrive on and outputs leave from (the pipeline stage's device).
    pub(crate) fn first(&self) -> &Device {
        &self.devices[0]
    }

    /// Runs `f(rank, handle, state)` for every rank at once, rank `r` with `states[r]`, and returns
    /// the results in rank order. On failure returns the root cause (a rank's own error rather than
    /// the aborts it caused on its peers) after recovering the group.
    pub(crate) fn run<S: Send, T: Send>(
        &self,
        states: Vec<S>,
        f: impl Fn(usize, &RankHandle, S) -> Result<T> + Sync,
    ) -> Result<Vec<T>> {
        let mut handles = self.handles.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if states.len() != handles.len() {
            return Err(Error::invalid(
                "ShardGroup::run states",
                format!("{} for {} ranks", states.len(), handles.len()),
            ));
        }
        let results: Vec<Result<T>> = std::thread::scope(|scope| {
            let mut states = states.into_iter();
            let first_state = states.next().expect("a group has at least one rank");
            let f = &f;
            let threads: Vec<_> = handles[1..]
                .iter()
                .zip(states)
                .enumerate()
                .map(|(i, (handle, state))| scope.spawn(move || f(i + 1, handle, state)))
                .collect();
            let mut results = vec![f(0, &handles[0], first_state)];
            for (i, thread) in threads.into_iter().enumerate() {
                results.push(thread.join().unwrap_or_else(|payload| {
                    let message = payload
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| payload.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    Err(Error::CollectiveFailed {
                        op: "tensor-parallel shard".into(),
                        rank: i + 1,
                        n_ranks: self.devices.len(),
                        reason: format!("its thread panicked: {message}"),
                    })
                }));
            }
            results
        });
        if results.iter().all(Result::is_ok) {
            return Ok(results.into_iter().map(|r| r.expect("checked ok")).collect());
        }
        ProcessGroup::recover(&mut handles)?;
        let mut errors: Vec<Error> = results.into_iter().filter_map(Result::err).collect();
        let cause = errors.iter().position(|e| !matches!(e, Error::CollectiveAborted { .. })).unwrap_or(0);
        Err(errors.swap_remove(cause))
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
        tensor.as_f32().map(|_| ()).map_err(|_| Error::UnsupportedDType { op: kind.into(), dtype: tensor.dtype() })
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
