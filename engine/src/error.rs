//! The engine's error type: one structured enum, each variant saying what was wrong and what would fix it.
use crate::DType;

/// Result alias for the engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An allocation would exceed the device's memory budget.
    #[error(
        "out of memory on {device}: requested {requested} bytes with {in_use} in use and a budget of {budget}; \
         raise the device's memory budget, use more stages, smaller micro-batches or recomputation"
    )]
    OutOfDeviceMemory {
        /// The device, e.g. `cpu:1`.
        device: String,
        /// Bytes asked for.
        requested: u64,
        /// Bytes already in use on the device.
        in_use: u64,
        /// The device's budget in bytes.
        budget: u64,
    },
    /// Shapes of the operands of `op` do not fit together.
    #[error("shape mismatch in {op}: expected {expected}, got {got}")]
    ShapeMismatch {
        /// The operation or layer.
        op: String,
        /// What the operation needs.
        expected: String,
        /// What it was given.
        got: String,
    },
    /// A loss was given the other kind of targets than it needs (class labels or real values).
    #[error("{loss} needs {expected} but was given {got}")]
    WrongTargets {
        /// The loss, e.g. `MseLoss`.
        loss: String,
        /// The kind it needs.
        expected: crate::TargetKind,
        /// The kind it was given.
        got: crate::TargetKind,
    },
    /// A batch's targets do not have one row per input row.
    #[error("{op}: {target_rows} target rows for {input_rows} input rows; give one target row per input row")]
    TargetRows {
        /// The call, e.g. `train_step`.
        op: String,
        /// Rows of the inputs.
        input_rows: usize,
        /// Rows of the targets.
        target_rows: usize,
    },
    /// A loss's real-valued targets do not have the shape it needs (for an elementwise loss, the
    /// output's).
    #[error(
        "{loss}: targets of shape {} for an output of shape {}; give targets of the output's shape",
        crate::Shape::new(targets.clone()),
        crate::Shape::new(output.clone())
    )]
    TargetShape {
        /// The loss, e.g. `MseLoss`.
        loss: String,
        /// The output's dimensions (the micro-batch's rows first).
        output: Vec<usize>,
        /// The targets' dimensions.
        targets: Vec<usize>,
    },
    /// The operation does not support this dtype.
    #[error("{op} does not support dtype {dtype}; convert the tensor with `to_dtype(DType::F32)` first")]
    UnsupportedDType {
        /// The operation.
        op: String,
        /// The dtype given.
        dtype: DType,
    },
    /// Two tensors live on different devices.
    #[error("{op}: operands live on different devices ({lhs} and {rhs}); move one with `to_device`")]
    DeviceMismatch {
        /// The operation.
        op: String,
        /// Device of the first operand.
        lhs: String,
        /// Device of the second operand.
        rhs: String,
    },
    /// A CUDA device was asked for but this build has no CUDA support, or no driver was found.
    #[error("{0}")]
    CudaUnavailable(String),
    /// An operation that reads or writes elements in host memory (`Tensor::as_f32`, a CPU kernel,
    /// an initialiser run on the host) was given a tensor, or asked for one, on a GPU.
    #[error(
        "{op}: the elements live on {device}, not in host memory; copy the tensor to the host first with \
         `to_device(&Device::host())` (and back with `to_device`), or use an operation that runs on {device}"
    )]
    NotOnHost {
        /// The operation, e.g. `as_f32`.
        op: String,
        /// The device holding the elements, e.g. `cuda:0`.
        device: String,
    },
    /// A value given to the engine is invalid.
    #[error("invalid argument {name}: {reason}")]
    InvalidArgument {
        /// What the argument is.
        name: String,
        /// Why it is invalid and what would be valid.
        reason: String,
    },
    /// A device or list of devices does not follow the grammar of [`crate::device::DeviceList`].
    #[error("devices `{text}`: {problem}")]
    InvalidDeviceList {
        /// The text as given.
        text: String,
        /// The comma-separated item that is wrong (0 first), when it is one item.
        item_idx: Option<usize>,
        /// What is wrong.
        problem: crate::device::DeviceListProblem,
    },
    /// A placement file (one line of node names per stage) could not be used; an unreadable one
    /// is an [`Error::Io`].
    #[error("placement file {path}: {problem}")]
    PlacementFile {
        /// The file.
        path: String,
        /// What is wrong with it.
        problem: crate::placement::PlacementFileProblem,
    },
    /// A checkpoint file could not be used.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The file.
        path: String,
        /// What is wrong with it (naming the tensor where there is one).
        reason: String,
    },
    /// A state dict does not hold exactly the model's tensors (a strict
    /// [`crate::runtime::Trainer::load`], a resume): every name missing from the file, every name
    /// the model does not have, and every tensor whose shape differs, as PyTorch's
    /// `load_state_dict(strict=True)` reports them.
    #[error("checkpoint {path}: {}", crate::checkpoint::describe_mismatch(missing, unexpected, wrong_shape))]
    StateDictMismatch {
        /// The file.
        path: String,
        /// The model's tensors the file lacks, in the model's order.
        missing: Vec<String>,
        /// The file's tensors the model does not have, in name order.
        unexpected: Vec<String>,
        /// The tensors whose shapes differ, in the model's order.
        wrong_shape: Vec<crate::checkpoint::WrongShape>,
    },
    /// A file about to be trained from holds NaN or infinity: every step trained from it would be
    /// non-finite. Nothing was loaded.
    #[error("checkpoint {path}: {found}; every step trained from it would be non-finite")]
    NonFiniteCheckpoint {
        /// The file.
        path: String,
        /// The first such tensor (name order), with where and how many.
        found: Box<crate::checkpoint::NonFiniteTensor>,
    },
    /// No placement of the model on the given devices keeps every stage under its memory budget.
    /// For an automatic placement the figures are those of the placement whose worst stage is
    /// smallest against its budget, and `stage` is that worst stage.
    #[error(
        "{}",
        crate::placement::DoesNotFitMessage { placed_by: *placed_by, stage: *stage, stages, hints }
    )]
    DoesNotFit {
        /// Number of stages asked for.
        n_stages: usize,
        /// The stage that does not fit.
        stage: usize,
        /// Its device (or tensor-parallel group), e.g. `cpu:1`.
        device: String,
        /// What the stage needs on its device with the largest need, bytes (the sum of `breakdown`).
        needed_bytes: u64,
        /// That device's budget, bytes.
        budget_bytes: u64,
        /// `needed_bytes` by kind: parameters, gradients, optimizer state, activations, caches,
        /// messages, undo snapshot, scratch.
        breakdown: Box<crate::placement::MemoryBreakdown>,
        /// Every stage of the placement, stage 0 first: its device, need and budget.
        stages: Vec<crate::placement::StageFit>,
        /// What would make it fit, in the order the message gives them.
        hints: Vec<crate::placement::FitHint>,
        /// Whether the planner chose the placement or the user gave it.
        placed_by: crate::placement::PlacedBy,
    },
    /// A pipeline stage failed during a step; the step was abandoned and no parameter changed.
    #[error(
        "stage {stage_idx} on {device} failed at {op}{}: {message}; the step was abandoned and no parameter changed",
        micro_batch_idx.map(|m| format!(" of micro-batch {m}")).unwrap_or_default()
    )]
    StageFailed {
        /// The stage.
        stage_idx: usize,
        /// Its device.
        device: String,
        /// The op (forward, backward_input, ...).
        op: String,
        /// The micro-batch, when the op had one.
        micro_batch_idx: Option<usize>,
        /// What went wrong (an error's message or a panic's payload).
        message: String,
    },
    /// A step's loss or gradients were not finite (NaN or infinity): the step was not committed,
    /// so every parameter and optimizer state is that of the last good step.
    #[error(
        "step {}: the {what} is not finite on stage {stage_idx} ({device}){}{}; the step was not committed \
         and the parameters are those of the last good step; lower the learning rate, clip the gradient norm, \
         check the data for NaN or infinity, or skip such steps (`--on-nonfinite skip`)",
        step_idx + 1,
        micro_batch_idx.map(|m| format!(" in micro-batch {m}")).unwrap_or_default(),
        parameter.as_ref().map(|p| format!(", first affected parameter `{p}`")).unwrap_or_default()
    )]
    NonFiniteStep {
        /// The step: the trainer's step count before it (0-based; the message counts from 1).
        step_idx: u64,
        /// The first stage, in stage order, that reported a non-finite value.
        stage_idx: usize,
        /// Its device.
        device: String,
        /// What was not finite.
        what: NonFinite,
        /// The micro-batch whose loss was not finite, for a loss.
        micro_batch_idx: Option<usize>,
        /// The first parameter (graph order) whose gradient was not finite, if any.
        parameter: Option<String>,
    },
    /// A worker thread panicked outside any layer op (its loop, a channel, a callback); the step
    /// was abandoned and nothing was committed.
    #[error(
        "the worker of device {device_idx} ({device}) panicked: {message}; the step was abandoned and no parameter \
         changed"
    )]
    WorkerPanicked {
        /// The worker (pipeline device or tensor-parallel group).
        device_idx: usize,
        /// Its device.
        device: String,
        /// The panic's message.
        message: String,
    },
    /// An optimizer update failed on a stage that kept no undo snapshot (the memory plan dropped it),
    /// after other stages had applied theirs: the trainer's parameters are no longer one step's, and
    /// it refuses further work.
    #[error(
        "the trainer is unusable: {reason}; reload the parameters and optimizer state from the last checkpoint \
         (`--resume`) into a new trainer"
    )]
    Poisoned {
        /// What left the parameters inconsistent.
        reason: String,
    },
    /// A collective operation could not complete on one rank of a process group (a peer sent the
    /// wrong message or none in time, a peer's handle was dropped, or the arguments were invalid).
    #[error(
        "collective {op} failed on rank {rank} of {n_ranks}: {reason}; every rank of a group must call the same \
         collectives in the same order with matching lengths"
    )]
    CollectiveFailed {
        /// The collective, e.g. `all_reduce`.
        op: String,
        /// The rank that reports the failure.
        rank: usize,
        /// The group size.
        n_ranks: usize,
        /// What went wrong.
        reason: String,
    },
    /// A collective was abandoned because another rank of the group failed first (that rank's error
    /// is the cause); the group must be recovered before it is used again.
    #[error("collective {op} on rank {rank} abandoned: rank {failed_rank} failed first ({reason})")]
    CollectiveAborted {
        /// The collective this rank was in.
        op: String,
        /// The rank that reports the abandonment.
        rank: usize,
        /// The rank that failed first.
        failed_rank: usize,
        /// That rank's error, as text.
        reason: String,
    },
    /// A layer implements neither [`crate::Layer::backward`] nor the two halves
    /// [`crate::Layer::backward_input`] and [`crate::Layer::backward_weight`], whose defaults call
    /// each other.
    #[error(
        "layer {layer} has no backward pass: implement `Layer::backward` (input and weight gradients together) \
         or both `Layer::backward_input` and `Layer::backward_weight`"
    )]
    BackwardNotImplemented {
        /// The layer's kind.
        layer: String,
    },
    /// A layer's analytic gradient disagrees with finite differences of its forward pass, or two
    /// of its backward paths disagree ([`crate::testing::gradcheck`]).
    #[error(
        "gradient check of {layer} failed: {what}, element {element}: backward gives {analytic:.6e}, expected \
         {numeric:.6e} (tolerance {tolerance:.1e})"
    )]
    GradientCheck {
        /// The layer's kind.
        layer: String,
        /// Which gradient (`input 0`, `parameter `gamma``, or two paths compared).
        what: String,
        /// The flat element index.
        element: usize,
        /// The value the layer's backward gave.
        analytic: f64,
        /// The value it should be (finite differences, or the other backward path).
        numeric: f64,
        /// The tolerance it exceeded.
        tolerance: f64,
    },
    /// The schedule could not be built or validated.
    #[error(transparent)]
    Schedule(#[from] conveyor_schedules::ScheduleError),
    /// An output path that must not be written: a directory, a block device, a missing or
    /// unwritable directory (see [`crate::output_file`]).
    #[error("cannot write {path}: {reason}")]
    OutputPath {
        /// The path as given.
        path: String,
        /// Why, and what would fix it.
        reason: String,
    },
    /// This build has no MPI transport.
    #[error(
        "this conveyor was built without MPI; rebuild with `cargo build --release --features mpi` (needs Open MPI: \
         `apt-get install openmpi-bin libopenmpi-dev libclang-dev`), or run in one process (`--transport in-process`)"
    )]
    MpiNotBuilt,
    /// The transport between ranks failed (a peer stopped answering, MPI refused a call).
    #[error("transport{}: {reason}", rank.map(|r| format!(" on rank {r}")).unwrap_or_default())]
    Transport {
        /// The rank reporting it, once known.
        rank: Option<usize>,
        /// What went wrong.
        reason: String,
    },
    /// The job's world size does not match the layout: one rank per pipeline device (group of
    /// `tensor_parallel` devices), or one rank per device (every tensor-parallel shard its own rank).
    #[error(
        "the job has {world_size} ranks but the layout needs {needed} ({n_devices} devices / tensor-parallel \
         {tensor_parallel}: one rank per pipeline device) or {n_devices} (one rank per device, each \
         tensor-parallel shard its own rank); launch with `mpirun -n {needed}` or `mpirun -n {n_devices}`, or \
         give {} devices",
        world_size * tensor_parallel
    )]
    WorldSize {
        /// Ranks in the job.
        world_size: usize,
        /// Ranks the layout needs.
        needed: usize,
        /// Devices given.
        n_devices: usize,
        /// Devices per pipeline device.
        tensor_parallel: usize,
    },
    /// Another rank failed during a step; every rank abandons the step, and none changed a parameter.
    #[error("rank {rank} failed: {message}")]
    RankFailed {
        /// The rank that failed first.
        rank: usize,
        /// Its error.
        message: String,
    },
    /// An I/O error, with the path it concerns.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// What a [`Error::NonFiniteStep`] found not finite.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NonFinite {
    /// The loss of a micro-batch.
    Loss,
    /// A parameter's gradient.
    Gradient,
}

impl std::fmt::Display for NonFinite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NonFinite::Loss => "loss",
            NonFinite::Gradient => "gradient",
        })
    }
}

impl Error {
    /// Builds [`Error::ShapeMismatch`].
    pub fn shape(op: impl Into<String>, expected: impl Into<String>, got: impl Into<String>) -> Self {
        Error::ShapeMismatch { op: op.into(), expected: expected.into(), got: got.into() }
    }

    /// Builds [`Error::InvalidArgument`].
    pub fn invalid(name: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidArgument { name: name.into(), reason: reason.into() }
    }
}
