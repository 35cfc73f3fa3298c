//! A worker's gradient groups: the workers it sums gradients with before the optimizer step.
//! Two kinds: the same pipeline device in every data-parallel replica ([`GradientGroups::replica`],
//! all of a stage's gradients), and, per tied parameter, the workers holding its copies
//! ([`GradientGroups::ties`], Megatron's embedding group: a token embedding on the first stage and
//! the output projection that shares its weight on the last).
//!
//! Tied parameters: every copy lives in its own layer with its own gradient and optimizer state;
//! at the optimizer step each worker first sums its local copies' gradients (copy order), then
//! all-reduces that sum with the other workers holding copies (after the replicas' all-reduce,
//! so each copy's gradient is already the whole batch's). Every copy then holds the sum, which is
//! the logical parameter's gradient; the copies start equal (the first copy's values) and take
//! the same update from the same state, so they stay equal bit for bit. The gradient norm counts
//! the first copy only. With two copies the sum is `a + b` in either order, which is one device's
//! sum bit for bit; the ring of more workers adds in another order (equal within rounding).
use std::sync::Arc;

use super::stage::Stage;
use crate::collective::{Communicator, GroupAbort, ProcessGroup, RankHandle, TransportGroup};
use crate::device::CudaDevice;
use crate::graph::{Graph, NodeId};
use crate::transport::Transport;
use crate::{Device, Error, Result, Tensor};

/// A group of workers summing gradients: threads of this process, or ranks.
pub(crate) enum GroupComm {
    /// Workers on threads of this process.
    InProcess(RankHandle),
    /// Workers on threads of this process, each on its own GPU, meeting in an NCCL group (the
    /// gradients are summed on the GPUs, never through the host), and the handle that aborts it.
    Nccl(Box<dyn Communicator>, GroupAbort),
    /// Workers on other ranks.
    Ranks(TransportGroup),
}

impl GroupComm {
    pub(crate) fn comm(&self) -> &dyn Communicator {
        match self {
            GroupComm::InProcess(handle) => handle,
            GroupComm::Nccl(rank, _) => rank.as_ref(),
            GroupComm::Ranks(group) => group,
        }
    }

    /// What ends this worker's waits in the group when its step is abandoned (`None` across
    /// ranks: `collective::interrupt_waits` does that there).
    pub(crate) fn abort_handle(&self) -> Option<GroupAbort> {
        match self {
            GroupComm::InProcess(handle) => Some(handle.abort_handle()),
            GroupComm::Nccl(_, abort) => Some(abort.clone()),
            GroupComm::Ranks(_) => None,
        }
    }
}

/// One in-process group of workers on `devices` (worker `i` on `devices[i]`): an NCCL group when
/// every device is a different GPU and NCCL is built and installed, else an in-process group
/// (whose collectives take GPU tensors through the host). NCCL sums in its own order: two
/// workers add `a + b`, the same bits as the in-process group; more may differ within rounding.
fn in_process_group(devices: &[Device]) -> Result<Vec<GroupComm>> {
    let distinct_gpus = devices.iter().enumerate().all(|(i, d)| {
        matches!(d, Device::Cuda(_))
            && !devices[..i]
                .iter()
                .any(|e| matches!((d, e), (Device::Cuda(a), Device::Cuda(b)) if a.ordinal() == b.ordinal()))
    });
    if distinct_gpus && devices.len() > 1 {
        match CudaDevice::nccl_group_abortable(devices) {
            Ok((ranks, abort)) => {
                return Ok(ranks.into_iter().map(|rank| GroupComm::Nccl(rank, abort.clone())).collect());
            }
            Err(error) => tracing::debug!(%error, "gradient sums between GPUs go through the host"),
        }
    }
    Ok(ProcessGroup::new(devices)?.into_iter().map(GroupComm::InProcess).collect())
}

/// One copy of a tied parameter: parameter `param_idx` of the node at `node_pos` of stage
/// `stage_idx`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TiedCopy {
    pub stage_idx: usize,
    pub node_pos: usize,
    pub param_idx: usize,
}

/// One logical parameter held by several layers, as the trainer resolved it (the same in every
/// replica): its copies' names (`node.parameter`) and places, the first one first.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct TiedParameter {
    pub names: Vec<String>,
    pub copies: Vec<TiedCopy>,
}

/// This worker's part of one tied parameter: its copies (copy order) and the other workers
/// holding copies (`None` when every copy is here).
pub(crate) struct TieGroup {
    pub copies: Vec<TiedCopy>,
    pub comm: Option<GroupComm>,
}

/// Every group a worker sums gradients in.
#[derive(Default)]
pub(crate) struct GradientGroups {
    /// The same pipeline device (and shard) in every data-parallel replica.
    pub replica: Option<GroupComm>,
    /// The tied parameters with a copy on this worker, in tie order.
    pub ties: Vec<TieGroup>,
}

impl GradientGroups {
    /// Sums every tied parameter's copies into each of its copies here (see the module comment).
    pub(crate) fn sum_tied(&self, stages: &mut [Stage]) -> Result<()> {
        for tie in &self.ties {
            let Some((first, rest)) = tie.copies.split_first() else { continue };
            let mut sum = grad_of(stages, first)?.share();
            for copy in rest {
                sum.add_assign(grad_of(stages, copy)?)?;
            }
            if let Some(comm) = &tie.comm {
                comm.comm().all_reduce_tensor(&mut sum)?;
            }
            for copy in &tie.copies {
                *grad_of(stages, copy)? = sum.share();
            }
        }
        Ok(())
    }

    /// Makes the groups over ranks usable after an abandoned step (every rank does this).
    pub(crate) fn recover(&mut self) -> Result<()> {
        let ties = self.ties.iter_mut().filter_map(|t| t.comm.as_mut());
        for comm in self.replica.iter_mut().chain(ties) {
            if let GroupComm::Ranks(group) = comm {
                group.recover()?;
            }
        }
        Ok(())
    }

    /// What ends the waits of this worker's in-process groups when a step is abandoned.
    pub(crate) fn aborts(&self) -> Vec<GroupAbort> {
        let ties = self.ties.iter().filter_map(|t| t.comm.as_ref());
        self.replica.iter().chain(ties).filter_map(GroupComm::abort_handle).collect()
    }
}

fn grad_of<'a>(stages: &'a mut [Stage], copy: &TiedCopy) -> Result<&'a mut Tensor> {
    stages
        .iter_mut()
        .find(|s| s.stage_idx == copy.stage_idx)
        .and_then(|s| s.nodes.get_mut(copy.node_pos))
        .and_then(|n| n.grads.get_mut(copy.param_idx))
        .ok_or_else(|| Error::invalid("tied parameters", format!("no gradient for the tied copy {copy:?} here")))
}

/// Where the workers are: worker `replica * n_devices + device_of_stage[s]` holds stage `s` of
/// `replica`.
#[derive(Clone, Debug)]
pub(crate) struct WorkerLayout {
    pub n_devices: usize,
    pub replicas: usize,
    pub device_of_stage: Vec<usize>,
}

impl WorkerLayout {
    fn worker_of(&self, replica: usize, stage_idx: usize) -> usize {
        replica * self.n_devices + self.device_of_stage[stage_idx]
    }

    /// The workers of `replica` holding copies of `tie`, in the order of their first copy.
    fn tie_workers(&self, replica: usize, tie: &TiedParameter) -> Vec<usize> {
        let mut workers = Vec::new();
        for copy in &tie.copies {
            let w = self.worker_of(replica, copy.stage_idx);
            if !workers.contains(&w) {
                workers.push(w);
            }
        }
        workers
    }

    /// The copies of `tie` worker `worker` holds.
    fn copies_on(&self, worker: usize, tie: &TiedParameter) -> Vec<TiedCopy> {
        let replica = worker / self.n_devices;
        tie.copies.iter().copied().filter(|c| self.worker_of(replica, c.stage_idx) == worker).collect()
    }
}

/// Finds each group of `node.parameter` names among the stages' nodes: at least two copies, of one
/// shape, none in a layer split over a tensor-parallel group, no parameter in two groups.
pub(crate) fn resolve_ties(
    groups: &[Vec<String>],
    graph: &Graph,
    stage_nodes: &[Vec<NodeId>],
) -> Result<Vec<TiedParameter>> {
    let mut seen: Vec<&str> = Vec::new();
    let mut ties = Vec::with_capacity(groups.len());
    for names in groups {
        if names.len() < 2 {
            return Err(Error::invalid(
                "tied parameters",
                format!("{names:?}: a tie names at least two parameters (`node.parameter`)"),
            ));
        }
        let mut copies = Vec::with_capacity(names.len());
        let mut shape = None;
        for name in names {
            if seen.contains(&name.as_str()) {
                return Err(Error::invalid("tied parameters", format!("`{name}` is named in two ties or twice")));
            }
            seen.push(name);
            let copy = find_parameter(graph, stage_nodes, name)?;
            let node = stage_nodes[copy.stage_idx][copy.node_pos];
            let layer = graph.layer(node).expect("found above");
            if layer.is_split() {
                return Err(Error::invalid(
                    "tied parameters",
                    format!("`{name}` belongs to a layer split over a tensor-parallel group; tie unsplit layers only"),
                ));
            }
            let this_shape = layer.parameters()[copy.param_idx].value.shape().clone();
            match &shape {
                None => shape = Some(this_shape),
                Some(first) if *first != this_shape => {
                    return Err(Error::invalid(
                        "tied parameters",
                        format!(
                            "`{name}` has shape {this_shape}, `{}` has {first}: tied copies share one shape",
                            names[0]
                        ),
                    ));
                }
                Some(_) => {}
            }
            copies.push(copy);
        }
        ties.push(TiedParameter { names: names.clone(), copies });
    }
    Ok(ties)
}

fn find_parameter(graph: &Graph, stage_nodes: &[Vec<NodeId>], name: &str) -> Result<TiedCopy> {
    for (stage_idx, nodes) in stage_nodes.iter().enumerate() {
        for (node_pos, &id) in nodes.iter().enumerate() {
            let (Ok(node), Some(layer)) = (graph.node(id), graph.layer(id)) else { continue };
            let Some(param) = name.strip_prefix(node.name.as_str()).and_then(|rest| rest.strip_prefix('.')) else {
                continue;
            };
            if let Some(param_idx) = layer.parameters().iter().position(|p| p.name == param) {
                return Ok(TiedCopy { stage_idx, node_pos, param_idx });
            }
        }
    }
    Err(Error::invalid(
        "tied parameters",
        format!("no parameter `{name}` in the graph; name each as `node.parameter`, e.g. `embed.weight`"),
    ))
}

/// Gives every copy of each tied parameter the first copy's values (before the layers go to their
/// devices: a copy shares the first one's bytes until either is written).
pub(crate) fn tie_initial_values(graph: &mut Graph, stage_nodes: &[Vec<NodeId>], ties: &[TiedParameter]) -> Result<()> {
    for tie in ties {
        let Some((first, rest)) = tie.copies.split_first() else { continue };
        let node = |c: &TiedCopy| stage_nodes[c.stage_idx][c.node_pos];
        let value = match graph.layer(node(first)) {
            Some(layer) => layer.parameters()[first.param_idx].value.share(),
            None => continue, // another rank's layer, already dropped
        };
        for copy in rest {
            if let Some(layer) = graph.layer_mut(node(copy)) {
                layer.parameters_mut()[copy.param_idx].value = value.share();
            }
        }
    }
    Ok(())
}

/// Every worker's gradient groups when all workers are threads of this process, worker 0 first
/// (`device_of(worker)` is where its group buffers are counted).
pub(crate) fn in_process_groups(
    layout: &WorkerLayout,
    ties: &[TiedParameter],
    device_of: impl Fn(usize) -> Device,
) -> Result<Vec<GradientGroups>> {
    let n_workers = layout.n_devices * layout.replicas;
    let mut groups: Vec<GradientGroups> = (0..n_workers).map(|_| GradientGroups::default()).collect();
    if layout.replicas > 1 {
        for d in 0..layout.n_devices {
            let workers: Vec<usize> = (0..layout.replicas).map(|r| r * layout.n_devices + d).collect();
            let devices: Vec<Device> = workers.iter().map(|&w| device_of(w)).collect();
            for (w, comm) in workers.into_iter().zip(in_process_group(&devices)?) {
                groups[w].replica = Some(comm);
            }
        }
    }
    for tie in ties {
        for replica in 0..layout.replicas {
            let workers = layout.tie_workers(replica, tie);
            let mut comms: Vec<Option<GroupComm>> = match workers.len() {
                1 => vec![None],
                _ => {
                    let devices: Vec<Device> = workers.iter().map(|&w| device_of(w)).collect();
                    in_process_group(&devices)?.into_iter().map(Some).collect()
                }
            };
            for (w, comm) in workers.into_iter().zip(comms.iter_mut()) {
                groups[w].ties.push(TieGroup { copies: layout.copies_on(w, tie), comm: comm.take() });
            }
        }
    }
    Ok(groups)
}

/// This rank's gradient groups when workers are ranks: rank `worker * ranks_per_worker + shard`
/// (`buffers`: where its group buffers are counted). Every rank calls it with the same layout and
/// ties (each group is a [`TransportGroup::split`], which every rank takes part in).
pub(crate) fn rank_groups(
    layout: &WorkerLayout,
    ties: &[TiedParameter],
    transport: &Arc<dyn Transport>,
    buffers: Device,
    ranks_per_worker: usize,
) -> Result<GradientGroups> {
    let worker = transport.rank() / ranks_per_worker;
    let rank_of = |w: usize, s: usize| w * ranks_per_worker + s;
    let timeout = crate::collective::DEFAULT_TIMEOUT;
    let mut groups = GradientGroups::default();
    if layout.replicas > 1 {
        let partition: Vec<Vec<usize>> = (0..layout.n_devices)
            .flat_map(|d| (0..ranks_per_worker).map(move |s| (d, s)))
            .map(|(d, s)| (0..layout.replicas).map(|r| rank_of(r * layout.n_devices + d, s)).collect())
            .collect();
        let group = TransportGroup::split(Arc::clone(transport), buffers.clone(), timeout, &partition)?;
        groups.replica = Some(GroupComm::Ranks(group));
    }
    for tie in ties {
        // The ranks holding copies, per replica and shard; every other rank alone.
        let mut partition: Vec<Vec<usize>> = Vec::new();
        for replica in 0..layout.replicas {
            let workers = layout.tie_workers(replica, tie);
            partition.extend((0..ranks_per_worker).map(|s| workers.iter().map(|&w| rank_of(w, s)).collect()));
        }
        let world = transport.world_size();
        let alone: Vec<Vec<usize>> =
            (0..world).filter(|r| !partition.iter().any(|g| g.contains(r))).map(|r| vec![r]).collect();
        partition.extend(alone);
        let group = TransportGroup::split(Arc::clone(transport), buffers.clone(), timeout, &partition)?;
        let copies = layout.copies_on(worker, tie);
        if !copies.is_empty() {
            let comm = (group.n_ranks() > 1).then_some(GroupComm::Ranks(group));
            groups.ties.push(TieGroup { copies, comm });
        }
    }
    Ok(groups)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tie_workers_follow_the_copies_and_the_replicas() {
        // 2 devices x 2 replicas, 4 stages looped over the devices (two chunks each).
        let layout = WorkerLayout { n_devices: 2, replicas: 2, device_of_stage: vec![0, 1, 0, 1] };
        let copy = |stage_idx| TiedCopy { stage_idx, node_pos: 0, param_idx: 0 };
        let tie = TiedParameter {
            names: vec!["a.w".into(), "b.w".into(), "c.w".into()],
            copies: vec![copy(3), copy(0), copy(2)],
        };
        assert_eq!(layout.tie_workers(0, &tie), vec![1, 0]);
        assert_eq!(layout.tie_workers(1, &tie), vec![3, 2]);
        assert_eq!(layout.copies_on(2, &tie), vec![copy(0), copy(2)]);
        assert_eq!(layout.copies_on(1, &tie), vec![copy(3)]);
    }
}
