//! `Trainer` (API Boundary): builds stages from a graph and a placement, starts one worker thread
//! per device, and runs training steps, evaluation and parameter transfer through them.
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use conveyor_schedules::{Schedule, ScheduleKind};
use crossbeam::channel::Sender;

use super::core_slots::CoreSlots;
use super::worker::Command;
use super::{CoreSlotPolicy, FaultInjection, Recompute, StallInjection, StepReport};
use crate::graph::{Graph, NodeId};
use crate::optim::OptimizerConfig;
use crate::transport::Transport;
use crate::{Device, Loss, Result, Targets, Tensor};

// Placement on the builder (`TrainerBuilder::placement`, `plan`, `Trainer::plan`): runtime/placement.rs.
#[path = "placement.rs"]
mod placement;

// Save, load, checkpoint and resume (`Trainer::save`, `load`, `checkpoint`, `TrainerBuilder::resume`):
// runtime/state_io.rs.
#[path = "state_io.rs"]
mod state_io;

// `TrainerBuilder::build`: stages, workers and their devices: runtime/build.rs.
#[path = "build.rs"]
mod build;

// One step's jobs for the workers (`Trainer::dispatch`): runtime/dispatch.rs.
#[path = "dispatch.rs"]
mod dispatch;
pub(super) use dispatch::{InFlight, Launch};

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
    retain_freed_host_memory: bool,
    overlap_steps: bool,
    placement: placement::PlacementChoice,
    state: state_io::StateChoice,
    transport: Arc<dyn Transport>,
    replicas: usize,
    replica_graphs: Option<ReplicaGraphs>,
    zero: u8,
    replica_shares: super::ReplicaShares,
    bucket_bytes: Option<usize>,
    tied: Vec<Vec<String>>,
    precision: crate::Precision,
    loss_scale: crate::LossScaleConfig,
}

/// Builds replica `r`'s graph on its devices ([`TrainerBuilder::data_parallel`]).
pub type ReplicaGraphs = Box<dyn Fn(usize, &[Device]) -> Result<Graph>>;

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

    /// Devices, device 0 first. Stage `s` runs on the schedule's device of it
    /// (`Schedule::device_of_stage`): `s % n_devices` for the looped kinds (with chunks, Megatron's
    /// virtual-pipeline mapping; without, stage s on device s), in a V for ZB-V and DualPipe-V.
    ///
    /// With a tensor-parallel degree `k` ([`TrainerBuilder::tensor_parallel`]) the pipeline's
    /// devices are groups of `k` consecutive devices: group `g` is `devices[g*k..(g+1)*k]`, stage
    /// `s` runs on the schedule's group of it, and the group's first device is the stage's device (its
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

    /// Data parallelism: `replicas` copies of the pipeline, each on its own devices, each taking its
    /// share of every batch (rows cut into `replicas` contiguous shares, then each share into
    /// [`TrainerBuilder::micro_batches`] micro-batches). The gradients are summed across replicas
    /// (all-reduced, in a fixed order) before the optimizer step, which every replica then takes
    /// alike, so the replicas stay equal and the step commits on all or none.
    ///
    /// The devices are `replicas x pipeline devices x tensor_parallel`, replica-major, tensor
    /// parallel fastest: replica `r`'s are `devices[r * n .. (r + 1) * n]`, `n` = devices / replicas,
    /// laid out as for one pipeline. `build_replica(r, devices)` builds replica `r`'s graph
    /// (`r >= 1`) on its devices: the graph given to [`Trainer::builder`] is replica 0's, and every
    /// replica's must have the same nodes with the same parameter shapes and initial values (build
    /// them from one seed). The placement is planned for replica 0 and used by all.
    pub fn data_parallel(
        mut self,
        replicas: usize,
        build_replica: impl Fn(usize, &[Device]) -> Result<Graph> + 'static,
    ) -> Self {
        self.replicas = replicas;
        self.replica_graphs = Some(Box::new(build_replica));
        self
    }

    /// ZeRO stage (0 or 1, default 0) for data-parallel replicas ([`TrainerBuilder::data_parallel`]):
    /// with 1 the optimizer state is sharded across the replicas. Each stage's layers are dealt
    /// out to the replicas by parameter bytes (the next layer to the replica with the fewest so
    /// far); a replica keeps optimizer state and takes the update only for its own layers, and
    /// broadcasts their new values to the others. The gradients are all-reduced as without it, so
    /// the weights and the optimizer state are bit for bit those of unsharded replicas, with about
    /// `1 / replicas` of the optimizer state per device.
    pub fn zero(mut self, stage: u8) -> Self {
        self.zero = stage;
        self
    }

    /// How every batch is shared among data-parallel replicas (default [`super::ReplicaShares::Even`]):
    /// for replicas on unequal devices, fixed weights or [`super::ReplicaShares::Auto`] (by each
    /// replica's throughput measured over the first [`super::AUTO_SHARE_STEPS`] training steps).
    /// Every micro-batch's loss is divided by the whole batch's rows, so the summed gradients are
    /// one device's on the whole batch whatever the shares (to rounding: the sums group
    /// differently). Each replica must get at least one row per micro-batch.
    pub fn replica_shares(mut self, shares: super::ReplicaShares) -> Self {
        self.replica_shares = shares;
        self
    }

    /// How data-parallel replicas all-reduce their gradients (default: buckets of
    /// [`super::DEFAULT_BUCKET_BYTES`], PyTorch DDP's 25 MiB). `Some(bytes)`: each node's
    /// gradients are handed over as soon as the step's last weight pass has made them final
    /// (last node first), gathered into buckets of about `bytes` (the first at most
    /// [`super::FIRST_BUCKET_BYTES`]) and all-reduced by a communication thread while the
    /// backward pass goes on; the optimizer step waits for the last bucket. `None`: every
    /// gradient is all-reduced when the worker reaches its optimizer step, after its backward.
    /// The sums are the same bit for bit either way and for any size: each tensor is reduced on
    /// its own, with the same nesting (a bucket only decides when its tensors start).
    pub fn bucket_size(mut self, bytes: Option<usize>) -> Self {
        self.bucket_bytes = bytes;
        self
    }

    /// Tied parameters: each group names parameters (`node.parameter`, e.g. `embed.weight` and
    /// `head.weight`) that are one logical parameter held by several layers, as a language model
    /// ties its token embedding to its output projection (PyTorch: `head.weight = embed.weight`).
    /// Every copy starts with the first one's values; before each optimizer step the copies'
    /// gradients are summed into each (across stages and devices: Megatron's embedding group),
    /// so the copies take the same update and stay equal; the gradient norm counts the parameter
    /// once. Copies must share one shape and not be split over a tensor-parallel group.
    pub fn tie_parameters(mut self, groups: Vec<Vec<String>>) -> Self {
        self.tied = groups;
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

    /// Mixed precision, as `torch.autocast` (default f32): under [`crate::Precision::Bf16`] or
    /// [`crate::Precision::F16`] the products (Linear, Conv2d, attention) compute on half-rounded operands
    /// with f32 sums and keep their outputs and saved inputs in the half type, the fp32-list ops
    /// (losses, softmax, layer norm) compute in f32; parameters, gradients and optimizer state
    /// stay f32 (`crate::Precision` has the rules). F16 also scales the loss
    /// ([`TrainerBuilder::loss_scale`]). On a GPU the half products run on cuBLAS with half
    /// inputs and f32 accumulation (the tensor cores), the other ops in f32 on exact upcasts.
    pub fn precision(mut self, precision: crate::Precision) -> Self {
        self.precision = precision;
        self
    }

    /// The dynamic loss scaling of f16 training (default: `GradScaler`'s, 2^16 halved on a
    /// non-finite gradient, doubled after 2000 committed steps in a row); ignored for f32 and
    /// bf16. A step whose gradients are not finite is then not committed and not an error: it
    /// returns its report with [`super::StepReport::skipped`] set and the scale lowered.
    pub fn loss_scale(mut self, config: crate::LossScaleConfig) -> Self {
        self.loss_scale = config;
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
    /// the layer's own setting (a Linear keeps none unless enabled). Set before the layers move to their devices, so a dropped cache is never allocated
    /// there. The memory plan decides this per node (`Plan::derived_caches`).
    pub fn derived_caches(mut self, per_node: Vec<(NodeId, bool)>) -> Self {
        self.derived_caches = per_node;
        self
    }

    /// Whether building the trainer makes the process's C allocator keep freed host memory for
    /// reuse (true by default): a step then reuses the pages of the step before instead of
    /// faulting fresh ones in, and the process holds on to its high-water mark of host memory
    /// (`device::host_cache`; the ledgers still count exactly what tensors hold). The setting is
    /// process-wide and stays once made; false leaves the allocator as it is.
    pub fn retain_freed_host_memory(mut self, retain: bool) -> Self {
        self.retain_freed_host_memory = retain;
        self
    }

    /// Overlapped steps with post-validation (off by default): [`Trainer::fit`] sends step `k + 1`
    /// to the workers before it has collected step `k`, and each worker applies its update right
    /// after its vote instead of waiting for the commit, so a stage starts the next step as soon as
    /// its own update is in, with no barrier across stages. The coordinator validates each step
    /// afterwards (finite losses and gradients, no fault, the global norm under
    /// [`TrainerBuilder::max_grad_norm`]); a worker waits for that verdict only before it prepares
    /// its next update. A step that fails validation is rolled back from its undo snapshot with
    /// the next step abandoned, and a step whose gradients must be clipped is replayed with the
    /// commit's barrier, so the weights are bit for bit those of synchronous steps. After a step
    /// that clipped, steps run with the barrier until one does not clip
    /// ([`super::FitSummary::replayed_steps`] counts the replays).
    ///
    /// Needs every stage's undo snapshot ([`TrainerBuilder::commit_snapshot`]) and one process;
    /// otherwise, and in [`Trainer::step`] (one batch at a time), steps stay synchronous
    /// ([`Trainer::overlap_unavailable`] says why).
    pub fn overlap_steps(mut self, on: bool) -> Self {
        self.overlap_steps = on;
        self
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
    /// Per worker (`replica * pipeline devices + device`): its worker, when it runs in this process
    /// (every one in-process; with MPI, this rank's).
    pub(super) workers: Vec<Option<WorkerHandle>>,
    /// Data-parallel replicas of the pipeline ([`TrainerBuilder::data_parallel`]).
    pub(super) replicas: usize,
    /// Whether the replicas shard the optimizer state ([`TrainerBuilder::zero`]).
    pub(super) zero: bool,
    /// The gradient buckets' size ([`TrainerBuilder::bucket_size`]).
    pub(super) bucket_bytes: Option<usize>,
    /// How batches are shared among the replicas ([`TrainerBuilder::replica_shares`]).
    pub(super) shares: crate::runtime::replica_shares::ShareState,
    /// With workers in one process: what aborts each worker's gradient groups (replicas, tied
    /// parameters) when a step is abandoned (the groups are then rebuilt, see `coordinator.rs`);
    /// empty otherwise.
    pub(super) group_aborts: Vec<crate::collective::GroupAbort>,
    /// Where the workers are, to rebuild the gradient groups.
    pub(super) group_layout: super::gradient_groups::WorkerLayout,
    /// Tied parameters ([`TrainerBuilder::tie_parameters`]).
    pub(super) ties: Arc<Vec<super::gradient_groups::TiedParameter>>,
    /// How this process reaches the other ranks of the job ([`crate::transport`]).
    pub(super) transport: Arc<dyn Transport>,
    /// Steps and evaluations dispatched so far: the round of the next one's messages.
    round: u64,
    /// Every device, all groups (peak memory is reported for each).
    pub(super) devices: Vec<Device>,
    /// Devices per stage group.
    pub(super) tensor_parallel: usize,
    /// Ranks per worker: 1 (in-process, or a rank per worker), or the tensor-parallel degree (a
    /// rank per shard, rank `worker * k + shard`).
    pub(super) ranks_per_worker: usize,
    /// This rank's shard of its stages' split layers with a rank per shard (0 otherwise). Shard 0's
    /// rank speaks for the stage: losses, outputs, the timeline; the others only compute.
    pub(super) shard: usize,
    /// Per replica, the device of every stage.
    pub(super) stage_devices: Vec<Arc<Vec<Device>>>,
    /// Per replica, the worker of every stage (for core slots: whom a message wakes).
    stage_workers: Vec<Arc<Vec<usize>>>,
    pub(super) stage_info: Vec<StageInfo>,
    schedule: Schedule,
    seed: u64,
    pub(super) max_grad_norm: Option<f64>,
    core_slots: Option<usize>,
    pub(super) slots: Option<Arc<CoreSlots>>,
    /// Under [`CoreSlotPolicy::Auto`]: the mean flops per sample of a compute op, which decides
    /// per step whether ops are long enough for slots ([`AUTO_SLOTS_MIN_OP_FLOPS`]).
    auto_slots_op_flops: Option<f64>,
    pub(super) step_idx: u64,
    fault: Option<FaultInjection>,
    /// The replica the fault strikes (every replica when `None`).
    fault_replica: Option<usize>,
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
    /// The autocast policy ([`TrainerBuilder::precision`]).
    pub(super) precision: crate::Precision,
    /// The dynamic loss scale under f16 ([`TrainerBuilder::loss_scale`]); `None` otherwise.
    pub(super) loss_scaler: Option<crate::LossScaler>,
    /// Set while [`Trainer::gradient_step`] dispatches: the step stops after its vote, applying
    /// nothing, and leaves its gradients on the workers.
    pub(super) gradients_only: bool,
    /// [`TrainerBuilder::overlap_steps`].
    pub(super) overlap_steps: bool,
    /// Why steps cannot overlap here, if they cannot ([`Trainer::overlap_unavailable`]).
    pub(super) overlap_blocked: Option<&'static str>,
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
            retain_freed_host_memory: true,
            overlap_steps: false,
            placement: Default::default(),
            state: Default::default(),
            transport: crate::transport::process_transport(),
            replicas: 1,
            replica_graphs: None,
            zero: 0,
            replica_shares: Default::default(),
            bucket_bytes: Some(super::DEFAULT_BUCKET_BYTES),
            tied: Vec::new(),
            precision: crate::Precision::F32,
            loss_scale: Default::default(),
        }
    }

    /// The autocast policy the layers run under ([`TrainerBuilder::precision`]).
    pub fn precision(&self) -> crate::Precision {
        self.precision
    }

    /// The loss scale of the next step under f16 ([`TrainerBuilder::loss_scale`]); `None` for f32
    /// and bf16, which need none.
    pub fn loss_scale(&self) -> Option<f32> {
        self.loss_scaler.map(|scaler| scaler.scale())
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

    /// Ranks per worker (a worker runs one pipeline device of one replica): `k` with a rank per
    /// tensor-parallel shard (rank `w * k + r` runs shard `r` of worker `w`), 1 otherwise
    /// (in-process, or a rank per worker).
    pub fn ranks_per_worker(&self) -> usize {
        self.ranks_per_worker
    }

    /// Data-parallel replicas of the pipeline ([`TrainerBuilder::data_parallel`]; 1 without).
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// The gradient buckets' size in bytes, or `None` when gradients are all-reduced at the
    /// optimizer step ([`TrainerBuilder::bucket_size`]).
    pub fn bucket_size(&self) -> Option<usize> {
        self.bucket_bytes
    }

    /// The ZeRO stage in use: 1 when the replicas shard the optimizer state, else 0.
    pub fn zero(&self) -> u8 {
        u8::from(self.zero)
    }

    /// How batches are shared among the replicas ([`TrainerBuilder::replica_shares`]).
    pub fn replica_shares_policy(&self) -> &super::ReplicaShares {
        self.shares.policy()
    }

    /// Each replica's fraction of the next batch (summing to 1; rows are rounded to whole rows):
    /// under [`super::ReplicaShares::Auto`], as measured so far.
    pub fn replica_fractions(&self) -> Vec<f64> {
        self.shares.fractions()
    }

    /// Whether [`super::ReplicaShares::Auto`] is still measuring (its first
    /// [`super::AUTO_SHARE_STEPS`] training steps).
    pub fn replica_shares_measuring(&self) -> bool {
        self.shares.measuring()
    }

    /// The worker of pipeline device `device_idx` in replica `replica`.
    pub(super) fn worker_index(&self, replica: usize, device_idx: usize) -> usize {
        replica * self.schedule.n_devices() + device_idx
    }

    /// The device groups, group 0 first, one per worker: group `g` is `devices()[g*k..(g+1)*k]`;
    /// in replica `r`, group `r * n + d` (`n` pipeline devices) runs stages `d, d + n, ...`, and its
    /// first device is those stages' device.
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

    /// Clips gradients to this global L2 norm from the next step on
    /// ([`TrainerBuilder::max_grad_norm`]), or stops clipping (`None`); a limit that is not a
    /// finite number of at least 0 is refused and the old one kept.
    pub fn set_max_grad_norm(&mut self, max_norm: Option<f64>) -> Result<()> {
        max_norm.map(crate::optim::check_max_norm).transpose()?;
        self.max_grad_norm = max_norm;
        Ok(())
    }

    /// The global gradient-norm limit, if gradients are clipped.
    pub fn max_grad_norm(&self) -> Option<f64> {
        self.max_grad_norm
    }

    /// Sets the step counter (when resuming from a checkpoint; dropout seeds depend on it).
    pub fn set_step_idx(&mut self, step_idx: u64) {
        self.step_idx = step_idx;
    }

    /// Makes the next steps fail as described (for testing fault handling); `None` clears it.
    pub fn inject_fault(&mut self, fault: Option<FaultInjection>) {
        self.fault = fault;
        self.fault_replica = None;
    }

    /// [`Trainer::inject_fault`] in one data-parallel replica only (the others run the step).
    pub fn inject_fault_in_replica(&mut self, fault: Option<FaultInjection>, replica: usize) {
        self.fault = fault;
        self.fault_replica = Some(replica);
    }

    /// Makes the next steps pause one worker as described (for testing what timing decides, such
    /// as the most messages a device holds); `None` clears it.
    pub fn inject_stall(&mut self, stall: Option<StallInjection>) {
        self.stall = stall;
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

    /// One synchronous training step on `batch`, at its learning rate if it has one.
    pub(super) fn train_batch(&mut self, batch: &super::Batch) -> Result<StepReport> {
        let how = Launch { step_idx: self.step_idx, optimistic: false, lr: batch.lr };
        let step = self.launch(&batch.inputs, Some(&batch.targets), true, how)?;
        let outcome = self.finish(step, &mut None)?;
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
        // Under a mixed precision the output may be in a half type: handed out as f32.
        let parts = outcome
            .outputs
            .into_iter()
            .map(|t| t.move_to_device(&host)?.into_dtype(crate::DType::F32))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat_rows(&parts.iter().collect::<Vec<_>>(), &host)
    }
}

pub(super) struct StepOutcome {
    pub(super) report: StepReport,
    pub(super) outputs: Vec<Tensor>,
    /// An overlapped step that was applied unclipped but needs clipping: rolled back, to be run
    /// again with the commit's barrier (the report is then not the step's).
    pub(super) replay: bool,
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
