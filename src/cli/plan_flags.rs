//! The flags of `conveyor plan` and how they resolve into [`PlanArgs`]: a flag given on the
//! command line wins, then the run spec of `--config` (the same `RunSpec` `conveyor train
//! --config` runs, so a run is planned as it will train), then plan's own defaults.
use std::path::PathBuf;

use clap::Args;
use conveyor::RunSpec;
use conveyor::engine::placement::WeightCache;
use conveyor::engine::runtime::Recompute;
use conveyor::schedules::ScheduleKind;
use conveyor::spec::{PlacementSpec, Precision};

use super::plan::PlanArgs;
use super::usage;

/// Arguments of `conveyor plan`.
#[derive(Args, Debug)]
pub struct PlanFlags {
    /// A run spec (TOML, as `conveyor train --config` reads and `--print-config` writes): plan the
    /// run it describes; flags given here override its fields.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Model: `mlp:D0,D1,...,Dn` (Linear/ReLU stack), `cnn` (LeNet-like, 1x8x8 inputs), `resnet`
    /// (`resnet:SIDE` for SIDE x SIDE images) or `transformer[:VOCAB,T,D,H,L,C]`. Required unless --config names one.
    #[arg(long)]
    pub model: Option<String>,
    /// Devices: `cpu:N` for N CPU devices, or `cuda:0,1` for GPUs. Required unless --config is given.
    #[arg(long)]
    pub devices: Option<String>,
    /// Memory budget of each device, e.g. `40MiB`, `512KiB` or `2GiB` (default: unlimited).
    #[arg(long, value_name = "SIZE")]
    pub device_memory: Option<String>,
    /// Optimizer whose state is budgeted: sgd (none), momentum (one buffer), adam or adamw (two)
    /// [default: adam].
    #[arg(long)]
    pub optimizer: Option<String>,
    /// Schedule: gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, dualpipe-v or interleaved-zb (sets
    /// the activations held per stage), or `auto`: the schedule, micro-batch count, recompute mode
    /// and stage split with the shortest predicted step that fits, from measured layer times and
    /// the simulator [default: 1f1b].
    #[arg(long, value_name = "NAME|auto")]
    pub schedule: Option<String>,
    /// Micro-batches per batch [default: 8].
    #[arg(long, value_name = "M")]
    pub microbatches: Option<usize>,
    /// Rows per batch; a micro-batch has ceil(B / M) rows [default: 64, or the spec's batch].
    #[arg(long, value_name = "B")]
    pub batch: Option<usize>,
    /// Model chunks per device (interleaved and interleaved-zb; zb-v and dualpipe-v need 2): devices
    /// x chunks stages [default: 1, 2 for zb-v and dualpipe-v].
    #[arg(long, value_name = "V")]
    pub chunks: Option<usize>,
    /// Activation recomputation: never, except-last or always (sets what a stage keeps between
    /// forward and backward) [default: never].
    #[arg(long, value_name = "MODE")]
    pub recompute: Option<Recompute>,
    /// Which packed weight copies the stages keep, as `train --weight-cache`: off (none), auto
    /// (where the memory plan has room) or on (all) [default: off].
    #[arg(long, value_name = "MODE")]
    pub weight_cache: Option<WeightCache>,
    /// Number format of activations, as `train --precision`: f32, bf16 or f16 (the memory plan
    /// counts half-typed activations at 2 bytes) [default: f32].
    #[arg(long, value_name = "NAME")]
    pub precision: Option<String>,
    /// `auto` (minimise the slowest stage under the budgets), or a file with one line per stage
    /// listing node names or ranges `first..last` separated by spaces (`#` starts a comment)
    /// [default: auto].
    #[arg(long, value_name = "auto|FILE")]
    pub placement: Option<String>,
    /// Data parallelism: R replicas of the pipeline, each on its own devices (--devices lists all
    /// R x stages of them, replica-major); the plan is each replica's, with the gradient
    /// all-reduce on the predicted step and each replica's optimizer state [default: 1].
    #[arg(long, value_name = "R")]
    pub data_parallel: Option<usize>,
    /// Tensor parallelism: each stage holds a group of K devices with its layers split over them
    /// (as `train --tensor-parallel K`); the plan shows every device's memory and prices the split
    /// layers' collectives [default: 1].
    #[arg(long, value_name = "K")]
    pub tensor_parallel: Option<usize>,
    /// With --tensor-parallel K and a transformer: sequence parallelism (as `train
    /// --sequence-parallel`); the plan shows each device's share of the blocks' activations.
    #[arg(long)]
    pub sequence_parallel: bool,
    /// ZeRO stage with --data-parallel: 1 shards the optimizer state across the replicas; the
    /// plan shows each device's share [default: 0].
    #[arg(long, value_name = "STAGE")]
    pub zero: Option<u8>,
    /// With --data-parallel: the gradient buckets' size (their all-reduce runs beside the final
    /// weight pass), or `off` (the all-reduce at the optimizer step), as `train --bucket-size`
    /// [default: 25MiB].
    #[arg(long, value_name = "SIZE|off")]
    pub bucket_size: Option<String>,
    /// Print one JSON object (stages, predicted_step_s, predicted_bubble_fraction, ...) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// With --schedule auto: print every candidate weighed (predicted step time against peak
    /// memory, the Pareto front marked) and why the chosen one won.
    #[arg(long)]
    pub explain: bool,
}

impl PlanFlags {
    /// The settings to plan with: each flag given, else the `--config` spec's field, else plan's
    /// default. A usage error for an unreadable spec, a spec without a model when `--model` is
    /// not given, or a placement `plan` cannot take.
    pub fn resolve(self) -> anyhow::Result<PlanArgs> {
        let spec = match &self.config {
            Some(path) => Some(RunSpec::from_file(path).map_err(|e| usage(format!("--config: {e}")))?),
            None => None,
        };
        let missing =
            |flag: &str| usage(format!("{flag} is required: give {flag}, or --config with a run spec that sets it"));
        let model = match (self.model, &spec) {
            (Some(model), _) => model,
            (None, Some(spec)) => spec.model.spec.clone().ok_or_else(|| {
                usage("--config: the spec names no model (`[model] spec`; the data decides it when training); give --model")
            })?,
            (None, None) => return Err(missing("--model")),
        };
        let devices = match (self.devices, &spec) {
            (Some(devices), _) => devices,
            (None, Some(spec)) => spec.pipeline.devices.clone(),
            (None, None) => return Err(missing("--devices")),
        };
        let placement = match (self.placement, &spec) {
            (Some(placement), _) => placement,
            (None, Some(spec)) => match &spec.pipeline.placement {
                PlacementSpec::Auto => "auto".to_string(),
                PlacementSpec::File(path) => path.display().to_string(),
                other => {
                    return Err(usage(format!(
                        "--config: `conveyor plan` takes placement auto or a file, not {other:?}; give --placement"
                    )));
                }
            },
            (None, None) => "auto".to_string(),
        };
        let pipeline = spec.as_ref().map(|spec| &spec.pipeline);
        let auto_schedule = self.schedule.as_deref().is_some_and(|s| s.eq_ignore_ascii_case("auto"));
        if self.explain && !auto_schedule {
            return Err(usage("--explain shows the candidates of --schedule auto; give --schedule auto"));
        }
        let schedule = match self.schedule.as_deref().filter(|_| !auto_schedule) {
            Some(text) => text.parse::<ScheduleKind>().map_err(|e| usage(format!("--schedule: {e}, or auto")))?,
            None => pipeline.map(|p| p.schedule).unwrap_or(ScheduleKind::OneFOneB),
        };
        // The V schedules run exactly two chunks: the default when --chunks is not given.
        let chunks = match (self.chunks, schedule.required_chunks()) {
            (Some(chunks), _) => chunks,
            (None, Some(required)) => required,
            (None, None) => pipeline.map(|p| p.chunks).unwrap_or(1),
        };
        Ok(PlanArgs {
            model,
            devices,
            device_memory: self
                .device_memory
                .or_else(|| pipeline.and_then(|p| p.device_memory).map(|bytes| bytes.to_string())),
            optimizer: self
                .optimizer
                .or_else(|| spec.as_ref().map(|s| s.optimizer.name.to_string()))
                .unwrap_or_else(|| "adam".to_string()),
            schedule,
            microbatches: self.microbatches.or(pipeline.map(|p| p.microbatches)).unwrap_or(8),
            batch: self.batch.or(spec.as_ref().map(|s| s.training.batch)).unwrap_or(64),
            chunks,
            recompute: self.recompute.or(pipeline.map(|p| p.recompute)).unwrap_or(Recompute::Never),
            weight_cache: self.weight_cache.or(pipeline.map(|p| p.weight_cache)).unwrap_or_default(),
            precision: match &self.precision {
                Some(text) => text.parse::<Precision>().map_err(|why| usage(format!("--precision {why}")))?,
                None => spec.as_ref().map(|s| s.training.precision).unwrap_or_default(),
            },
            placement,
            data_parallel: self.data_parallel.or(pipeline.map(|p| p.data_parallel)).unwrap_or(1),
            tensor_parallel: self.tensor_parallel.or(pipeline.map(|p| p.tensor_parallel)).unwrap_or(1),
            sequence_parallel: self.sequence_parallel || pipeline.is_some_and(|p| p.sequence_parallel),
            zero: self.zero.or(pipeline.map(|p| p.zero)).unwrap_or(0),
            bucket_size: match &self.bucket_size {
                Some(text) => text.parse()?,
                None => pipeline.map(|p| p.bucket_size).unwrap_or_default(),
            },
            json: self.json,
            auto_schedule,
            explain: self.explain,
        })
    }
}
