//! `Trainer` (API Boundary): builds stages from a graph and a placement, starts one worker thread
//! per device, and runs training steps, evaluation and parameter transfer through them.
use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use conveyor_schedules::{Instruction, Schedule, ScheduleKind};
use crossbeam::channel::{self, Sender};

use super::coordinator::Dispatched;
use super::core_slots::CoreSlots;
use super::stage::{NodeExec, Payload, Route, Stage};
use super::worker::{self, Command, Links, StepJob};
use super::{CoreSlotPolicy, FaultInjection, Recompute, StallInjection, StepReport};
use crate::graph::{Graph, NodeId};
use crate::optim::{Optimizer, OptimizerConfig};
use crate::transport::{Tag, Transport};
use crate::{Device, Error, Loss, Result, Targets, Tensor};

// Placement on the builder (`TrainerBuilder::placement`, `plan`, `Trainer::plan`): runtime/placement.rs.
#[path = "placement.rs"]
mod placement;

// Save, load, checkpoint and resume (`Trainer::save`, `load`, `checkpoint`, `TrainerBuilder::resume`):
// runtime/state_io.rs.
#[path = "state_io.rs"]
mod state_io;

/// How long the coordinator waits for a worker's report before declaring the step hung.
pub(super) const REPORT_TIMEOUT: Duration = Duration::from_secs(600);

/// Builds a [`Trainer`].
pub struct TrainerBuilder {
    graph: Graph,
    loss: Arc<dyn Loss>,
    devices: Vec<Device>,
    tensor_parallel: usize,
    stages: Option<Vec<Vec<NodeId>>>,
    schedule: ScheduleKind,
    n_chunks: usize,
    n_micro_batches: usize,
    optimizer: OptimizerConfig,
    recompute: Vec<Recompute>,
    seed: u64,
    max_grad_norm: Option<f64>,
    core_slots: CoreSlotPolicy,
    commit_snapshot: Option<Vec<bool>>,
    derived_caches: Vec<(NodeId, bool)>,
    placement: placement::PlacementChoice,
    state: state_io::StateChoice,
    transport: Arc<dyn Transport>,
}

impl TrainerBuilder {
    /// How this process reaches the other ranks of the job (default: the process's transport,
    /// [`crate::transport::process_transport`], which is [`crate::transport::InProcess`] unless set: one process,
    /// every pipeline device a thread of it). With [`crate::transport::MpiTransport`] each rank
    /// runs the worker of the pipeline device with its rank's index (device groups with tensor
    /// parallelism), so the job needs one rank per pipeline device; or, with a tensor-parallel
    /// degree `k` and one rank per device, rank `d * k + r` runs shard `r` of pipeline device `d`
    /// (its split layers must then hold only that shard: `conveyor_layers::Shards::Rank`). Every
    /// rank builds the same trainer from the same arguments and calls the same methods in the same
    /// order.
    pub fn transport(mut self, transport: Arc<dyn Transport>) -> Self {
        self.transport = transport;
        self
    }

    /// Devices, device 0 first. Stage `s` runs on device `s % n_devices` (with chunks, Megatron's
    /// virtual-pipeline mapping; without, stage s on device s).
    ///
    /// With a tensor-parallel degree `k` ([`TrainerBuilder::tensor_parallel`]) the pipeline's
    /// devices are groups of `k` consecutive devices: group `g` is `devices[g*k..(g+1)*k]`, stage
    /// `s` runs on group `s % n_groups`, and the group's first device is the stage's device (its
    /// worker thread, its inputs and outputs, its unsplit layers).
    pub fn devices(mut self, devices: Vec<Device>) -> Self {
        self.devices = devices;
        self
    }

    /// Tensor-parallel degree `k` (default 1): each stage holds a group of `k` devices, and its
    /// split layers (built on exactly those devices, e.g. `conveyor_layers::ColumnParallelLinear`)
    /// keep their shards, gradients and optimizer state there. The number of devices must be a
    /// multiple of `k`.
    pub fn tensor_parallel(mut self, k: usize) -> Self {
        self.tensor_parallel = k;
        self
    }

    /// The layer nodes of each stage, in execution order (for example from a [`crate::placement::Plan`]).
    pub fn stages(mut self, stages: Vec<Vec<NodeId>>) -> Self {
        self.stages = Some(stages);
        self
    }

    /// The schedule and its number of chunks per device (1 except for interleaved).
    pub fn schedule(mut self, kind: ScheduleKind, n_chunks: usize) -> Self {
        self.schedule = kind;
        self.n_chunks = n_chunks;
        self
    }

    /// Micro-batches per batch.
    pub fn micro_batches(mut self, n_micro_batches: usize) -> Self {
        self.n_micro_batches = n_micro_batches;
        self
    }

    /// The optimizer (one instance per stage, owning that stage's state).
    pub fn optimizer(mut self, optimizer: OptimizerConfig) -> Self {
        self.optimizer = optimizer;
        self
    }

    /// Recomputation for every stage.
    pub fn recompute(mut self, recompute: Recompute) -> Self {
        self.recompute = vec![recompute];
        self
    }

    /// Recomputation per stage (stage 0 first).
    pub fn recompute_per_stage(mut self, recompute: Vec<Recompute>) -> Self {
        self.recompute = recompute;
        self
    }

    /// Seed for dropout masks.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Clip gradients to this global L2 norm (torch's `clip_grad_norm_`), across all stages.
    pub fn max_grad_norm(mut self, max_norm: Option<f64>) -> Self {
        self.max_grad_norm = max_norm;
        self
    }

    /// How many compute ops may run at once across the workers: with `n` slots each op takes one,
    /// first come first served, for as long as it computes. [`CoreSlotPolicy::Auto`] (the
    /// default) gives one slot per core when CPU workers outnumber the machine's cores (and there
    /// is no tensor parallelism, whose shards compute on threads of their own), otherwise none.
    ///
    /// Why: with four stages on two cores, time-slicing makes an op's wall time depend on what
    /// else runs, and the measured timeline stops matching any schedule prediction; with slots
    /// an op runs on a core of its own and the wait for a core is a FIFO queue that
    /// [`conveyor_schedules::simulate_with_core_slots`] reproduces.
    pub fn core_slots(mut self, policy: CoreSlotPolicy) -> Self {
        self.core_slots = policy;
        self
    }

    /// Which stages keep an undo snapshot for the commit (stage 0 first; default: every stage).
    ///
    /// A step is all-or-nothing: every stage prepares its update (everything that can fail), votes,
    /// and only then applies. A stage with a snapshot copies its parameters and optimizer state
    /// while preparing (its parameters' and state's bytes again, on their devices), so that a
    /// failure while any stage applies (a GPU error, a panicking custom layer) is rolled back on
    /// every stage exactly. A stage without one saves that memory; if its apply fails after others
    /// applied, the trainer is [`Error::Poisoned`]. The memory plan decides this per stage.
    pub fn commit_snapshot(mut self, per_stage: Vec<bool>) -> Self {
        self.commit_snapshot = Some(per_stage);
        self
    }

    /// Per node, whether its layer keeps the caches it derives from its parameters
    /// ([`crate::Layer::set_derived_cache`], such as Linear's packed weights); nodes not listed keep
    /// theirs. Set before the layers move to their devices, so a dropped cache is never allocated
    /// there. The memory plan decides this per node (`Plan::derived_caches`).
    pub fn derived_caches(mut self, per_node: Vec<(NodeId, bool)>) -> Self {
        self.derived_caches = per_node;
        self
    }

    /// Plans the placement if one was given ([`TrainerBuilder::placement`]), checks the layout
    /// (stages, schedule, devices), moves the layers onto their devices and starts the workers;
    /// restores a checkpoint if [`TrainerBuilder::resume`] named one. See [`Trainer::builder`]
    /// for an example.
    pub fn build(mut self) -> Result<Trainer> {
        let state = std::mem::take(&mut self.state);
        state.check()?;
        self.graph.validate()?;
        self.optimizer.validate()?;
        if self.devices.is_empty() {
            return Err(Error::invalid("devices", "no devices given; give at least one (e.g. cpu:0)"));
        }
        let k = self.tensor_parallel;
        if k == 0 || !self.devices.len().is_multiple_of(k) {
            return Err(Error::invalid(
                "tensor_parallel",
                format!(
                    "degree {k} with {} devices: the devices must be a whole number of groups of k",
                    self.devices.len()
                ),
            ));
        }
        let groups: Vec<Vec<Device>> = self.devices.chunks(k).map(<[Device]>::to_vec).collect();
        let (rank, world) = (self.transport.rank(), self.transport.world_size());
        // A rank per pipeline device (a tensor-parallel group stays inside its rank, on threads),
        // or a rank per device: rank `device * k + shard`, tensor-parallel fastest.
        if world > 1 && world != groups.len() && world != groups.len() * k {
            return Err(Error::WorldSize {
                world_size: world,
                needed: groups.len(),
                n_devices: self.devices.len(),
                tensor_parallel: k,
            });
        }
        let ranks_per_device = if world > 1 { world / groups.len() } else { 1 };
        let (pipeline_rank, shard) = (rank / ranks_per_device, rank % ranks_per_device);
        let plan = self.apply_placement()?;
        // The schedule's devices are the groups.
        let n_devices = groups.len();
        let schedule = Schedule::new(self.schedule, n_devices, self.n_micro_batches, self.n_chunks)?;
        // Channels hold one message per micro-batch; prove the programs complete under that.
        conveyor_schedules::validate(&schedule, self.n_micro_batches)?;
        let n_stages = schedule.n_stages();
        let layer_order: Vec<NodeId> =
            self.graph.topological_order()?.into_iter().filter(|&id| self.graph.layer(id).is_some()).collect();
        let stage_nodes = match self.stages.take() {
            Some(stages) => stages,
            None if n_stages == 1 => vec![layer_order.clone()],
            None => {
                return Err(Error::invalid(
                    "stages",
                    format!("{n_stages} stages need a placement; call .placement(...) or .stages(...)"),
                ));
            }
        };
        if stage_nodes.len() != n_stages {
            return Err(Error::invalid(
                "stages",
                format!(
                    "{} stages given but the schedule runs {n_stages} ({n_devices} devices x {} chunks)",
                    stage_nodes.len(),
                    self.n_chunks
                ),
            ));
        }
        let mut stage_of: HashMap<NodeId, usize> = HashMap::new();
        for (stage_idx, nodes) in stage_nodes.iter().enumerate() {
            if nodes.is_empty() {
                return Err(Error::invalid("stages", format!("stage {stage_idx} has no layers")));
            }
            for &id in nodes {
                if self.graph.layer(id).is_none() {
                    return Err(Error::invalid("stages", format!("node #{} is not a layer of this graph", id.index())));
                }
                if stage_of.insert(id, stage_idx).is_some() {
                    return Err(Error::invalid(
                        "stages",
                        format!("node `{}` is placed twice", self.graph.node(id)?.name),
                    ));
                }
            }
        }
        if let Some(missing) = layer_order.iter().find(|id| !stage_of.contains_key(id)) {
            return Err(Error::invalid(
                "stages",
                format!("node `{}` is not placed on any stage", self.graph.node(*missing)?.name),
            ));
        }
        if world > 1 {
            agree_on_stages(self.transport.as_ref(), &stage_nodes)?;
        }
        let output = self.graph.output()?;
        // Checkpoint names: the unsplit tensors' names, in node order.
        let param_order: Vec<String> = self
            .graph
            .node_ids()
            .into_iter()
            .filter_map(|id| Some((self.graph.node(id).ok()?.name.clone(), self.graph.layer(id)?)))
            .flat_map(|(node, layer)| {
                layer.export_parameter_shapes().into_iter().map(move |(name, _)| format!("{node}.{name}"))
            })
            .collect();
        let data_inputs = self.graph.inputs();
        // A stage's device here: its group's first, or this rank's shard's with a rank per shard.
        let stage_devices: Vec<Device> =
            (0..n_stages).map(|s| groups[schedule.device_of_stage(s)][shard].clone()).collect();
        let mut stages: Vec<Stage> = Vec::with_capacity(n_stages);
        let mut send_to: Vec<Vec<Route>> = vec![Vec::new(); n_stages];
        let mut recv_from: Vec<Vec<Route>> = vec![Vec::new(); n_stages];
        let mut stage_data_inputs: Vec<Vec<NodeId>> = vec![Vec::new(); n_stages];
        for (stage_idx, nodes) in stage_nodes.iter().enumerate() {
            for (position, &id) in nodes.iter().enumerate() {
                for pred in self.graph.predecessors(id) {
                    if data_inputs.contains(&pred) {
                        if !stage_data_inputs[stage_idx].contains(&pred) {
                            stage_data_inputs[stage_idx].push(pred);
                        }
                        continue;
                    }
                    let pred_stage = stage_of[&pred];
                    let earlier_here = pred_stage == stage_idx && nodes[..position].contains(&pred);
                    if pred_stage > stage_idx || (pred_stage == stage_idx && !earlier_here) {
                        return Err(Error::invalid(
                            "stages",
                            format!(
                                "node `{}` on stage {stage_idx} consumes `{}` which runs later (stage {pred_stage}); stages must follow graph order",
                                self.graph.node(id)?.name,
                                self.graph.node(pred)?.name
                            ),
                        ));
                    }
                    if pred_stage < stage_idx {
                        add_route(&mut recv_from[stage_idx], pred_stage, pred);
                        add_route(&mut send_to[pred_stage], stage_idx, pred);
                    }
                }
            }
        }
        // Mean flops per sample of one compute op (F, B or W) over the stages, for the automatic
        // core-slot policy; `None` when a layer cannot say.
        let op_flops_per_sample: Option<f64> = stage_nodes
            .iter()
            .map(|nodes| {
                nodes.iter().try_fold(0.0, |sum, &id| {
                    let cost = self.graph.cost(id).ok()?;
                    let flops = cost.forward_flops_per_sample
                        + cost.backward_input_flops_per_sample
                        + cost.backward_weight_flops_per_sample;
                    Some(sum + flops as f64 / 3.0)
                })
            })
            .sum::<Option<f64>>()
            .map(|total| total / n_stages as f64);
        // Another rank's stages: what the coordinator needs to route their messages, nothing more.
        // Their layers (built here as on that rank, so every rank draws the same initial values)
        // are dropped without touching that rank's devices.
        let mut stage_info = Vec::with_capacity(n_stages);
        for (stage_idx, nodes) in stage_nodes.iter().enumerate() {
            if world > 1 && schedule.device_of_stage(stage_idx) != pipeline_rank {
                nodes.iter().for_each(|&id| drop(self.graph.take_layer(id)));
                stage_info.push(StageInfo {
                    stage_idx,
                    data_inputs: std::mem::take(&mut stage_data_inputs[stage_idx]),
                    send_to: send_to[stage_idx].iter().map(|r| r.peer_stage_idx).collect(),
                    holds_output: nodes.contains(&output),
                });
                continue;
            }
            let device = &stage_devices[stage_idx];
            let group = &groups[schedule.device_of_stage(stage_idx)];
            let mut execs = Vec::with_capacity(nodes.len());
            let mut n_params = 0;
            for &id in nodes {
                let mut layer = self.graph.take_layer(id).expect("checked above");
                if let Some(&(_, keep)) = self.derived_caches.iter().find(|(node, _)| *node == id) {
                    layer.set_derived_cache(keep);
                }
                layer.to_device(device)?;
                if ranks_per_device > 1
                    && let Some(p) = layer.parameters().iter().find(|p| !p.value.device().same_device(device))
                {
                    return Err(Error::invalid(
                        "stages",
                        format!(
                            "node `{}` on stage {stage_idx} holds `{}` on {}, but with a rank per tensor-parallel \
                             shard rank {rank} holds only {device}'s shard; build split layers with \
                             Shards::Rank (conveyor::pipeline does)",
                            self.graph.node(id)?.name,
                            p.name,
                            p.value.device(),
                        ),
                    ));
                }
                if let Some(p) =
                    layer.parameters().iter().find(|p| !group.iter().any(|d| d.same_device(p.value.device())))
                {
                    return Err(Error::invalid(
                        "stages",
                        format!(
                            "node `{}` on stage {stage_idx} holds `{}` on {}, outside the stage's devices [{}]; build split layers on their stage's group",
                            self.graph.node(id)?.name,
                            p.name,
                            p.value.device(),
                            group.iter().map(Device::to_string).collect::<Vec<_>>().join(", ")
                        ),
                    ));
                }
                // Gradients live beside their parameters: on the shard's device for split layers.
                let grads = layer
                    .parameters()
                    .iter()
                    .map(|p| Tensor::zeros(p.value.shape().clone(), p.value.dtype(), p.value.device()))
                    .collect::<Result<Vec<_>>>()?;
                n_params += grads.len();
                execs.push(NodeExec {
                    id,
                    name: self.graph.node(id)?.name.clone(),
                    inputs: self.graph.predecessors(id),
                    layer,
                    grads,
                });
            }
            let recompute = self.recompute.get(stage_idx).or(self.recompute.last()).copied().unwrap_or_default();
            let mut stage = Stage::new(
                stage_idx,
                device.clone(),
                execs,
                std::mem::take(&mut stage_data_inputs[stage_idx]),
                std::mem::take(&mut recv_from[stage_idx]),
                std::mem::take(&mut send_to[stage_idx]),
                stage_nodes[stage_idx].contains(&output).then_some(output),
                recompute,
                Optimizer::new(self.optimizer, n_params)?,
                self.commit_snapshot.as_ref().and_then(|keep| keep.get(stage_idx).copied()).unwrap_or(true),
            );
            // The other shards' ranks hold copies of the unsplit layers: counted once, on shard 0.
            stage.counts_unsplit = shard == 0;
            stages.push(stage);
        }
        let mut per_device: Vec<Vec<Stage>> = (0..n_devices).map(|_| Vec::new()).collect();
        for stage in stages {
            per_device[schedule.device_of_stage(stage.stage_idx)].push(stage);
        }
        for stages in &per_device {
            for s in stages {
                stage_info.push(StageInfo {
                    stage_idx: s.stage_idx,
                    data_inputs: s.data_inputs.clone(),
                    send_to: s.send_to.iter().map(|r| r.peer_stage_idx).collect(),
                    holds_output: s.output_node.is_some(),
                });
            }
        }
        stage_info.sort_by_key(|s| s.stage_idx);
        let n_slots = match self.core_slots {
            CoreSlotPolicy::Slots(n) => Some(n.max(1)),
            CoreSlotPolicy::Off => None,
            CoreSlotPolicy::Auto => {
                let cores = std::thread::available_parallelism().map_or(1, usize::from);
                let all_cpu = groups.iter().all(|g| matches!(g[0], Device::Cpu(_)));
                (k == 1 && all_cpu && world == 1 && n_devices > cores).then_some(cores)
            }
        };
        let slots = n_slots.map(|n| Arc::new(CoreSlots::new(n, n_devices)));
        let auto_slots_op_flops = match self.core_slots {
            CoreSlotPolicy::Auto => op_flops_per_sample,
            _ => None,
        };
        let mut workers = Vec::with_capacity(n_devices);
        // Workers report op spans to the subscriber of the thread that built the trainer.
        let dispatch = tracing::dispatcher::get_default(|d| d.clone());
        for (device_idx, stages) in per_device.into_iter().enumerate() {
            if world > 1 && device_idx != pipeline_rank {
                // Another rank's pipeline device: that rank holds its stages.
                workers.push(None);
                continue;
            }
            let (tx, rx) = channel::unbounded();
            let loss = Arc::clone(&self.loss);
            let dispatch = dispatch.clone();
            let slots = slots.clone();
            let handle = std::thread::Builder::new()
                .name(format!("conveyor-{}", groups[device_idx][0]))
                .spawn(move || {
                    tracing::dispatcher::with_default(&dispatch, || worker::run(device_idx, stages, loss, rx, slots))
                })
                .map_err(|e| Error::invalid("worker thread", format!("could not start: {e}")))?;
            workers.push(Some(WorkerHandle { commands: tx, thread: Some(handle) }));
        }
        state.apply(Trainer {
            workers,
            transport: self.transport,
            round: 0,
            devices: self.devices,
            tensor_parallel: k,
            ranks_per_device,
            shard,
            stage_devices: Arc::new(stage_devices),
            stage_workers: Arc::new((0..schedule.n_stages()).map(|s| schedule.device_of_stage(s)).collect()),
            stage_info,
            schedule,
            seed: self.seed,
            max_grad_norm: self.max_grad_norm,
            core_slots: n_slots,
            slots,
            auto_slots_op_flops,
            step_idx: 0,
            fault: None,
            stall: None,
            poisoned: None,
            graph: self.graph,
            param_order,
            plan,
            loss: self.loss,
            metadata: Default::default(),
        })
    }
}

/// Seconds since the Unix epoch on this machine's clock.
fn wall_clock_s() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// Refuses a build whose ranks chose different stages (a placement from measured times differs
/// from process to process): every rank must run the same split.
fn agree_on_stages(transport: &dyn Transport, stage_nodes: &[Vec<NodeId>]) -> Result<()> {
    let mine: Vec<u8> = stage_nodes
        .iter()
        .flat_map(|nodes| nodes.iter().map(|id| id.index() as u64).chain([u64::MAX]))
        .flat_map(u64::to_le_bytes)
        .collect();
    let all = transport.all_gather(mine.clone(), REPORT_TIMEOUT)?;
    match all.iter().position(|theirs| *theirs != mine) {
        None => Ok(()),
        Some(other) => Err(Error::invalid(
            "stages",
            format!(
                "rank {} and rank {other} placed the layers on different stages; give every rank the same \
                 placement (a placement file, or planning by estimated costs rather than measured ones)",
                transport.rank()
            ),
        )),
    }
}

fn add_route(routes: &mut Vec<Route>, peer_stage_idx: usize, node: NodeId) {
    match routes.iter_mut().find(|r| r.peer_stage_idx == peer_stage_idx) {
        Some(route) => {
            if !route.nodes.contains(&node) {
                route.nodes.push(node);
            }
        }
        None => routes.push(Route { peer_stage_idx, nodes: vec![node] }),
    }
}

pub(super) struct WorkerHandle {
    pub(super) commands: Sender<Command>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Debug)]
pub(super) struct StageInfo {
    pub(super) stage_idx: usize,
    data_inputs: Vec<NodeId>,
    send_to: Vec<usize>,
    pub(super) holds_output: bool,
}

/// Trains a graph placed on devices with a pipeline schedule. One worker thread per device (per
/// device group, with tensor parallelism) owns its stages' parameters, gradients and optimizer
/// state; a split layer's shards, their gradients and optimizer state live on the group's devices.
pub struct Trainer {
    /// Per pipeline device: its worker, when it runs in this process (every one in-process; with
    /// MPI, this rank's).
    pub(super) workers: Vec<Option<WorkerHandle>>,
    /// How this process reaches the other ranks of the job ([`crate::transport`]).
    pub(super) transport: Arc<dyn Transport>,
    /// Steps and evaluations dispatched so far: the round of the next one's messages.
    round: u64,
    /// Every device, all groups (peak memory is reported for each).
    pub(super) devices: Vec<Device>,
    /// Devices per stage group.
    pub(super) tensor_parallel: usize,
    /// Ranks per pipeline device: 1 (in-process, or a rank per pipeline device), or the
    /// tensor-parallel degree (a rank per shard, rank `device * k + shard`).
    pub(super) ranks_per_device: usize,
    /// This rank's shard of its stages' split layers with a rank per shard (0 otherwise). Shard 0's
    /// rank speaks for the stage: losses, outputs, the timeline; the others only compute.
    pub(super) shard: usize,
    pub(super) stage_devices: Arc<Vec<Device>>,
    /// The worker of every stage (for core slots: whom a message wakes).
    stage_workers: Arc<Vec<usize>>,
    pub(super) stage_info: Vec<StageInfo>,
    schedule: Schedule,
    seed: u64,
    max_grad_norm: Option<f64>,
    core_slots: Option<usize>,
    pub(super) slots: Option<Arc<CoreSlots>>,
    /// Under [`CoreSlotPolicy::Auto`]: the mean flops per sample of a compute op, which decides
    /// per step whether ops are long enough for slots ([`AUTO_SLOTS_MIN_OP_FLOPS`]).
    auto_slots_op_flops: Option<f64>,
    pub(super) step_idx: u64,
    fault: Option<FaultInjection>,
    stall: Option<StallInjection>,
    /// Why the parameters are no longer one step's (a failed apply that could not be rolled back).
    pub(super) poisoned: Option<String>,
    /// The graph's structure (its layers live on the workers).
    graph: Graph,
    /// Full parameter names in graph order, recorded before the layers moved to the workers.
    pub(super) param_order: Vec<String>,
    /// The plan of a planned placement (`TrainerBuilder::placement`).
    plan: Option<crate::placement::Plan>,
    /// The loss every worker holds (for [`Trainer::evaluate`]).
    pub(super) loss: Arc<dyn Loss>,
    /// Metadata saved with every file (`TrainerBuilder::metadata`).
    metadata: std::collections::BTreeMap<String, String>,
}

/// Under [`CoreSlotPolicy::Auto`], the smallest mean compute op (flops of one F, B or W of a
/// micro-batch on a stage) for which a step uses core slots: about 0.1 ms of single-core
/// compute, the order of the thread wake-up every slot handoff waits for (0.05-0.3 ms measured
/// on a 2-core VM). Slots buy a timeline the simulator reproduces at no cost in throughput for
/// ops of a millisecond (4 workers on 2 cores, 1024-wide MLP: within run-to-run noise of
/// `--core-slots off`); with ops of a few microseconds each handoff costs more than the op
/// (`benches/overhead.rs`: 34 µs per op with slots against 19 µs without).
pub const AUTO_SLOTS_MIN_OP_FLOPS: f64 = 1.0e7;

impl Trainer {
    /// Starts building a trainer for `graph` with `loss` on its output. Defaults: one CPU device,
    /// 1F1B, one micro-batch, SGD with learning rate 0.01 (see each builder method).
    ///
    /// ```
    /// # include!("doc_model.rs");
    /// # fn main() -> conveyor_engine::Result<()> {
    /// use conveyor_engine::Device;
    /// use conveyor_engine::optim::OptimizerConfig;
    /// use conveyor_engine::runtime::Trainer;
    /// use conveyor_schedules::ScheduleKind;
    ///
    /// // `graph()`: x -> a -> b (two layers); `loss()`: its loss; `batch()`: 4 rows.
    /// let graph = graph();
    /// let stages = vec![vec![graph.find("a")?], vec![graph.find("b")?]];
    /// let mut trainer = Trainer::builder(graph, loss())
    ///     .devices(vec![Device::cpu(0), Device::cpu(1)])
    ///     .stages(stages) // or .placement(Placement::auto()).batch_rows(4)
    ///     .schedule(ScheduleKind::ZbH1, 1)
    ///     .micro_batches(2)
    ///     .optimizer(OptimizerConfig::sgd(0.1))
    ///     .build()?;
    /// let report = trainer.train_step(&batch(), &[0; 4])?;
    /// assert_eq!(report.peak_memory.len(), 2);
    /// assert_eq!(trainer.predict(&batch())?.dims(), [4, 4]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(graph: Graph, loss: Arc<dyn Loss>) -> TrainerBuilder {
        TrainerBuilder {
            graph,
            loss,
            devices: vec![Device::cpu(0)],
            tensor_parallel: 1,
            stages: None,
            schedule: ScheduleKind::OneFOneB,
            n_chunks: 1,
            n_micro_batches: 1,
            optimizer: OptimizerConfig::sgd(0.01),
            recompute: vec![Recompute::Never],
            seed: 0,
            max_grad_norm: None,
            core_slots: CoreSlotPolicy::Auto,
            commit_snapshot: None,
            derived_caches: Vec::new(),
            placement: Default::default(),
            state: Default::default(),
            transport: crate::transport::process_transport(),
        }
    }

    /// The number of core slots compute ops may share, if any ([`TrainerBuilder::core_slots`]).
    /// Under [`CoreSlotPolicy::Auto`] a step uses them only when its ops are long enough
    /// ([`StepReport::core_slots`] says whether one did).
    pub fn core_slots(&self) -> Option<usize> {
        self.core_slots
    }

    /// The core slots a step with micro-batches of `rows_per_micro_batch` rows uses: none
    /// without slots, and under [`CoreSlotPolicy::Auto`] none when the mean compute op is below
    /// [`AUTO_SLOTS_MIN_OP_FLOPS`] (each slot handoff waits for the operating system to wake the
    /// next worker, which tiny ops cannot pay for).
    fn slots_for(&self, rows_per_micro_batch: usize) -> Option<usize> {
        let n_slots = self.core_slots?;
        match self.auto_slots_op_flops {
            Some(flops) if flops * (rows_per_micro_batch as f64) < AUTO_SLOTS_MIN_OP_FLOPS => None,
            _ => Some(n_slots),
        }
    }

    /// Full parameter names (`node.param`) in graph order.
    pub fn parameter_names(&self) -> &[String] {
        &self.param_order
    }

    /// The devices, device 0 first (every device of every tensor-parallel group).
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// The tensor-parallel degree `k`: devices per stage group.
    pub fn tensor_parallel(&self) -> usize {
        self.tensor_parallel
    }

    /// Ranks per pipeline device: `k` with a rank per tensor-parallel shard (rank `d * k + r` runs
    /// shard `r` of pipeline device `d`), 1 otherwise (in-process, or a rank per pipeline device).
    pub fn ranks_per_device(&self) -> usize {
        self.ranks_per_device
    }

    /// The pipeline's device groups, group 0 first: group `g` is `devices()[g*k..(g+1)*k]` and
    /// runs stages `g, g + n_groups, ...`; its first device is those stages' device.
    pub fn device_groups(&self) -> Vec<&[Device]> {
        self.devices.chunks(self.tensor_parallel).collect()
    }

    /// The schedule every step runs.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// Optimizer steps taken so far.
    pub fn step_idx(&self) -> u64 {
        self.step_idx
    }

    /// Sets the step counter (when resuming from a checkpoint; dropout seeds depend on it).
    pub fn set_step_idx(&mut self, step_idx: u64) {
        self.step_idx = step_idx;
    }

    /// Makes the next steps fail as described (for testing fault handling); `None` clears it.
    pub fn inject_fault(&mut self, fault: Option<FaultInjection>) {
        self.fault = fault;
    }

    /// Makes the next steps pause one worker as described (for testing what timing decides, such
    /// as the most messages a device holds); `None` clears it.
    pub fn inject_stall(&mut self, stall: Option<StallInjection>) {
        self.stall = stall;
    }

    /// Splits `rows` into `n` micro-batches: sizes differ by at most one, the first
    /// `rows % n` get the extra row.
    fn split(&self, rows: usize) -> Result<Vec<(usize, usize)>> {
        let n = self.schedule.n_micro_batches();
        if rows < n {
            return Err(Error::invalid(
                "batch",
                format!(
                    "{rows} rows cannot make {n} micro-batches; use at most {rows} micro-batches or a larger batch"
                ),
            ));
        }
        let (base, extra) = (rows / n, rows % n);
        let mut start = 0;
        Ok((0..n)
            .map(|i| {
                let len = base + usize::from(i < extra);
                let range = (start, len);
                start += len;
                range
            })
            .collect())
    }

    fn dispatch(&mut self, inputs: &Tensor, targets: Option<&Targets>, training: bool) -> Result<StepOutcome> {
        if let Some(reason) = &self.poisoned {
            return Err(Error::Poisoned { reason: reason.clone() });
        }
        let rows = inputs.shape().leading();
        if let Some(targets) = targets {
            self.check_targets("train_step", rows, targets)?;
        }
        let input_nodes = self.graph.inputs();
        if input_nodes.len() != 1 {
            return Err(Error::invalid("graph inputs", "the trainer feeds graphs with exactly one input node"));
        }
        let input_id = input_nodes[0];
        let expected = self.graph.node(input_id)?.output_shape.clone();
        if inputs.dims().get(1..) != Some(expected.dims()) {
            return Err(Error::shape(
                "train_step",
                format!(
                    "inputs [batch, {}]",
                    expected.dims().iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")
                ),
                inputs.shape().to_string(),
            ));
        }
        let splits = self.split(rows)?;
        let n_micro_batches = splits.len();
        let round = self.round;
        self.round += 1;
        self.transport.close_rounds_before(round);
        for device in &self.devices {
            device.reset_peak_memory();
        }
        let started = Instant::now();
        let started_s = wall_clock_s() - self.transport.clock_offset_s();
        let local_workers = self.local_workers();
        let is_local = |stage_idx: usize| self.workers[self.schedule.device_of_stage(stage_idx)].is_some();
        // Channels: one per (from, to, direction), bounded by the micro-batch count, between
        // stages of this process; a stage on another rank is reached through the transport.
        let mut senders = HashMap::new();
        let mut receivers = HashMap::new();
        let mut remote_senders = HashMap::new();
        let mut remote_receivers = HashMap::new();
        for info in &self.stage_info {
            for &peer in &info.send_to {
                for (from, to, gradient) in [(info.stage_idx, peer, false), (peer, info.stage_idx, true)] {
                    let key = (from, to, gradient);
                    let tag = Tag { round, channel: ((from as u64) << 32) | ((to as u64) << 1) | u64::from(gradient) };
                    match (is_local(from), is_local(to)) {
                        (true, true) => {
                            let (tx, rx) = channel::bounded(n_micro_batches);
                            senders.insert(key, tx);
                            receivers.insert(key, rx);
                        }
                        (true, false) => {
                            // The receiving stage's rank of this rank's shard.
                            let to_rank = self.schedule.device_of_stage(to) * self.ranks_per_device + self.shard;
                            remote_senders.insert(key, (to_rank, tag));
                        }
                        (false, true) => {
                            remote_receivers.insert(key, self.transport.inbox(tag)?);
                        }
                        (false, false) => {}
                    }
                }
            }
        }
        let slots_this_step = self.slots_for(rows / n_micro_batches.max(1));
        if let Some(slots) = &self.slots {
            slots.take_wake_latencies();
        }
        let (abort_tx, abort_rx) = channel::bounded::<()>(0);
        let (report_tx, report_rx) = channel::unbounded();
        let mut commit_txs = Vec::with_capacity(local_workers.len());
        let mut programs: Vec<Vec<Instruction>> = if training {
            self.schedule.programs().to_vec()
        } else {
            forward_only_programs(&self.schedule, n_micro_batches)
        };
        for &device_idx in &local_workers {
            let program = std::mem::take(&mut programs[device_idx]);
            let my_stages: Vec<&StageInfo> =
                self.stage_info.iter().filter(|s| self.schedule.device_of_stage(s.stage_idx) == device_idx).collect();
            let mine = |stage_idx: usize| my_stages.iter().any(|s| s.stage_idx == stage_idx);
            let mut links = Links { transport: Some(Arc::clone(&self.transport)), ..Links::default() };
            links.senders.extend(senders.iter().filter(|(k, _)| mine(k.0)).map(|(k, tx)| (*k, tx.clone())));
            links.receivers.extend(receivers.iter().filter(|(k, _)| mine(k.1)).map(|(k, rx)| (*k, rx.clone())));
            links.remote_senders.extend(remote_senders.iter().filter(|(k, _)| mine(k.0)).map(|(k, v)| (*k, *v)));
            let remote_in: Vec<_> = remote_receivers.keys().filter(|k| mine(k.1)).copied().collect();
            for key in remote_in {
                links.remote_receivers.insert(key, remote_receivers.remove(&key).expect("listed"));
            }
            let mut data: HashMap<usize, Vec<Payload>> = HashMap::new();
            for info in &my_stages {
                if info.data_inputs.contains(&input_id) {
                    let device = &self.stage_devices[info.stage_idx];
                    let per_mb = splits
                        .iter()
                        .map(|&(start, len)| {
                            Ok(vec![(input_id, inputs.narrow_rows(start, len)?.move_to_device(device)?)])
                        })
                        .collect::<Result<Vec<Payload>>>()?;
                    data.insert(info.stage_idx, per_mb);
                }
            }
            let holds_output = my_stages.iter().any(|s| s.holds_output);
            let mb_targets = match (targets, holds_output) {
                (Some(targets), true) => splits
                    .iter()
                    .map(|&(start, len)| targets.slice_rows(start, len).map(Some))
                    .collect::<Result<Vec<_>>>()?,
                _ => Vec::new(),
            };
            let (commit_tx, commit_rx) = channel::bounded(1);
            commit_txs.push((device_idx, commit_tx));
            let job = StepJob {
                step_idx: self.step_idx,
                seed: self.seed,
                training,
                program,
                n_micro_batches,
                normalizer: rows as f32,
                data,
                targets: mb_targets,
                links,
                stage_devices: Arc::clone(&self.stage_devices),
                stage_workers: Arc::clone(&self.stage_workers),
                abort: abort_rx.clone(),
                commit: commit_rx,
                fault: self.fault,
                stall: self.stall,
                started,
                max_grad_norm: self.max_grad_norm,
                use_core_slots: slots_this_step.is_some(),
            };
            let worker = self.workers[device_idx].as_ref().expect("a local worker");
            worker
                .commands
                .send(Command::Step(Box::new(job), report_tx.clone()))
                .map_err(|_| Error::invalid("worker", format!("the worker of device {device_idx} has stopped")))?;
        }
        // Only workers hold report senders now: a worker that vanishes closes its end.
        drop((senders, receivers, report_tx));
        self.collect(Dispatched {
            reports: report_rx,
            abort: abort_tx,
            commits: commit_txs,
            started,
            started_s,
            training,
            slots_this_step,
            round,
        })
    }

    /// One optimizer step on a batch: `inputs` `[batch, ...]` and one class label per row. The
    /// loss is the full-batch mean (each micro-batch's summed loss divided by the batch size).
    /// On any failure the step is abandoned with no parameter changed.
    ///
    /// [`Trainer::step`] takes any [`Targets`], such as real values for regression.
    ///
    /// ```
    /// # include!("doc_model.rs");
    /// # fn main() -> conveyor_engine::Result<()> {
    /// let mut trainer = conveyor_engine::runtime::Trainer::builder(graph(), loss()).build()?;
    /// let first = trainer.train_step(&batch(), &[0; 4])?;
    /// let second = trainer.train_step(&batch(), &[0; 4])?;
    /// assert!(second.loss < first.loss); // the loss pulls every output toward zero
    /// assert_eq!(trainer.step_idx(), 2);
    /// # Ok(())
    /// # }
    /// ```
    pub fn train_step(&mut self, inputs: &Tensor, labels: &[usize]) -> Result<StepReport> {
        self.train_on(inputs, &Targets::Classes(labels.to_vec()))
    }

    /// [`Trainer::train_step`] with any targets (one row per input row).
    pub(super) fn train_on(&mut self, inputs: &Tensor, targets: &Targets) -> Result<StepReport> {
        let outcome = self.dispatch(inputs, Some(targets), true)?;
        self.step_idx += 1;
        Ok(outcome.report)
    }

    /// Checks `targets` for a batch of `rows` rows ([`Targets::check_rows`]) and against the
    /// loss ([`Loss::check_targets`]); `op` names the caller in errors.
    pub(super) fn check_targets(&self, op: &str, rows: usize, targets: &Targets) -> Result<()> {
        targets.check_rows(op, rows)?;
        self.loss.check_targets(&self.graph.node(self.graph.output()?)?.output_shape, targets)
    }

    /// Runs the forward pass only (evaluation mode: no dropout) and returns the graph's output
    /// for all rows, on the host.
    ///
    /// ```
    /// # include!("doc_model.rs");
    /// # fn main() -> conveyor_engine::Result<()> {
    /// let mut trainer = conveyor_engine::runtime::Trainer::builder(graph(), loss()).build()?;
    /// let before = trainer.predict(&batch())?;
    /// assert_eq!(before.dims(), [4, 4]);
    /// assert!(trainer.predict(&batch())?.bit_eq(&before)); // nothing changes
    /// # Ok(())
    /// # }
    /// ```
    pub fn predict(&mut self, inputs: &Tensor) -> Result<Tensor> {
        let outcome = self.dispatch(inputs, None, false)?;
        let host = Device::host();
        let parts = outcome.outputs.into_iter().map(|t| t.move_to_device(&host)).collect::<Result<Vec<_>>>()?;
        Tensor::cat_rows(&parts.iter().collect::<Vec<_>>(), &host)
    }
}

pub(super) struct StepOutcome {
    pub(super) report: StepReport,
    pub(super) outputs: Vec<Tensor>,
}

/// Forward-only programs for evaluation: each device runs its stages' forwards in
/// (micro-batch, stage) order, which depends only on lexicographically earlier work, so it
/// completes with non-blocking sends.
fn forward_only_programs(schedule: &Schedule, n_micro_batches: usize) -> Vec<Vec<Instruction>> {
    (0..schedule.n_devices())
        .map(|device_idx| {
            let stages: Vec<usize> = schedule.stages_of_device(device_idx).collect();
            (0..n_micro_batches)
                .flat_map(|micro_batch_idx| {
                    stages.iter().map(move |&stage_idx| Instruction::Forward { micro_batch_idx, stage_idx })
                })
                .collect()
        })
        .collect()
}

impl Drop for Trainer {
    fn drop(&mut self) {
        for worker in self.workers.iter().flatten() {
            let _ = worker.commands.send(Command::Shutdown);
        }
        for worker in self.workers.iter_mut().flatten() {
            if let Some(handle) = worker.thread.take() {
                let _ = handle.join();
            }
        }
    }
}
