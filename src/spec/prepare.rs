//! [`RunSpec::prepare`]: from a spec to a trainer ready for its first step (what `conveyor train`
//! does before its loop): the data splits fitted to the model, the devices, the placement, the
//! built [`Trainer`] and its [`Plan`]; and [`PreparedRun`], which feeds the trainer the run's
//! batches at the run's learning rates, so a library loop trains exactly as the command does.
use conveyor_engine::graph::Graph;
use conveyor_engine::optim::OptimizerConfig;
use conveyor_engine::placement::{AutoPlacement, Plan, plan_auto};
use conveyor_engine::runtime::{StepReport, Trainer};
use conveyor_engine::{Device, Tensor};

use super::validate::{model_spec, reason};
use super::{PlacementSpec, RunSpec, SpecError, data, devices_used, total_steps};
use crate::cli_input::{parse_devices, read_placement_file};
use crate::data::Dataset;
use crate::pipeline::{
    DataParallel, PipelineConfig, build_trainer_replicated, builder, plan_by_time, plan_manually, with_replicas,
};
use crate::zoo::ModelSpec;
use conveyor_engine::placement::Placement;

/// A run ready to train: the trainer, its plan and data, and the run's schedule of batches and
/// learning rates. [`PreparedRun::train_step`] takes one step of the run; the fields are public
/// for a loop of one's own (evaluation, checkpoints, logging).
pub struct PreparedRun {
    /// The spec with its model filled in (the data's default model when none was named).
    pub spec: RunSpec,
    /// The parsed model.
    pub model: ModelSpec,
    /// Rows batches are drawn from, fitted to the model.
    pub train: Dataset,
    /// Held-out rows, if the data has them.
    pub test: Option<Dataset>,
    /// Where every layer runs.
    pub plan: Plan,
    /// The trainer, at step 0 with the seed's initial parameters (load `init` or `resume` into it
    /// before the first step).
    pub trainer: Trainer,
    /// The optimizer with its defaults filled in.
    pub optimizer: conveyor_engine::optim::OptimizerConfig,
    /// Batches per epoch (training rows / batch).
    pub steps_per_epoch: u64,
    /// The run's total steps (`steps`, or `epochs` x `steps_per_epoch`).
    pub total_steps: u64,
    /// Pipeline devices: workers, each a group of `tensor_parallel` devices.
    pub pipeline_devices: usize,
    /// How `placement = "auto"` placed the model: from the cost model, or with a profile of its
    /// layers ([`conveyor_engine::placement::plan_auto`]); `None` for other placements and split
    /// models.
    pub auto_placement: Option<AutoPlacement>,
    /// The epoch whose batch order is cached, and that order.
    order: Option<(u64, Vec<usize>)>,
    /// The learning rate the optimizers run with now.
    current_lr: f64,
}

impl RunSpec {
    /// Prepares the run: validates the spec ([`RunSpec::validate`]), loads and splits the data,
    /// parses the devices, builds the model from the seed, fits the data to it, places it
    /// (`auto`, `time`, a file or listed stages; `tensor_parallel` groups with `auto`) and starts
    /// the trainer. `init` and `resume` are not loaded here: the trainer starts from the seed.
    /// A spec that trains through the data-parallel strategies (`sync` other than `allreduce`,
    /// `compress`, `interleaving`) is refused: [`RunSpec::prepare_replicas`] prepares it.
    ///
    /// ```
    /// use conveyor::RunSpec;
    ///
    /// let mut spec = RunSpec::default();
    /// spec.model.spec = Some("mlp:4,8,2".into());
    /// spec.data.source = "synthetic:32,4,2".into();
    /// spec.training.batch = 8;
    /// spec.pipeline.microbatches = 2;
    /// let run = spec.prepare()?;
    /// assert_eq!(run.plan.stages.len(), 2);
    /// assert_eq!(run.total_steps, 30 * 4);
    /// # Ok::<(), conveyor::spec::SpecError>(())
    /// ```
    pub fn prepare(&self) -> Result<PreparedRun, SpecError> {
        if self.pipeline.uses_strategy() {
            return Err(SpecError::StrategyRun { strategy: self.pipeline.strategy_flags() });
        }
        let Loaded { model_text, model, graph, train, test, devices, optimizer, steps_per_epoch, total_steps, config } =
            self.load()?;
        let (pipeline, training) = (&self.pipeline, &self.training);
        let k = pipeline.tensor_parallel;
        let replicas = pipeline.data_parallel;
        let data_parallel = DataParallel {
            replicas,
            zero: pipeline.zero,
            shares: pipeline.replica_shares.clone(),
            bucket_bytes: pipeline.bucket_size.bytes(),
        };
        let pipeline_devices = devices.len() / k / replicas;
        let (plan, trainer, auto_placement) = if k > 1 {
            drop(graph);
            let (plan, trainer) = build_trainer_replicated(&model, training.seed, devices, k, &data_parallel, &config)?;
            (plan, trainer, None)
        } else {
            let replicated =
                Replicated { data_parallel, model: model.clone(), seed: training.seed, in_this_process: false };
            place_and_build(graph, devices, &config, &pipeline.placement, replicated)?
        };
        let mut spec = self.clone();
        spec.model.spec = Some(model_text);
        // Every checkpoint of the run carries what the run is (not its output files).
        let mut trainer = trainer;
        trainer.set_overlap_steps(pipeline.overlap_steps.is_on());
        trainer.set_max_grad_norm(self.optimizer.clip_grad_norm)?;
        trainer.set_metadata(crate::cli_input::SPEC_KEY, spec.for_checkpoint().to_toml_string()?)?;
        Ok(PreparedRun {
            spec,
            model,
            train,
            test,
            plan,
            trainer,
            optimizer,
            steps_per_epoch,
            total_steps,
            pipeline_devices,
            auto_placement,
            order: None,
            current_lr: optimizer.lr(),
        })
    }
}

/// What every way of preparing a run starts from ([`RunSpec::prepare`], and
/// [`RunSpec::prepare_replicas`] for the data-parallel strategies).
pub(super) struct Loaded {
    /// The model spec's text (the data's default model when none was named).
    pub model_text: String,
    /// The parsed model.
    pub model: ModelSpec,
    /// The model built from the seed.
    pub graph: Graph,
    /// Rows batches are drawn from, fitted to the model.
    pub train: Dataset,
    /// Held-out rows, if the data has them.
    pub test: Option<Dataset>,
    /// The devices the run uses (every replica's).
    pub devices: Vec<Device>,
    /// The optimizer with its defaults filled in.
    pub optimizer: OptimizerConfig,
    /// Batches per epoch (training rows / batch).
    pub steps_per_epoch: u64,
    /// The run's total steps.
    pub total_steps: u64,
    /// The trainer's settings (`batch_rows` the whole batch).
    pub config: PipelineConfig,
}

impl RunSpec {
    /// Validates the spec, loads and splits the data, parses the devices (those the run uses,
    /// checked to split into tensor-parallel groups), builds the model from the seed and fits the
    /// data to it, and works out the run's length.
    pub(super) fn load(&self) -> Result<Loaded, SpecError> {
        self.validate()?;
        let (pipeline, training) = (&self.pipeline, &self.training);
        let mut splits = data::load_data(&self.data.source, training.seed, self.data.test_fraction, self.data.classes)?;
        let model_text = match &self.model.spec {
            Some(text) => text.clone(),
            None => data::default_model(&self.data.source, &splits.train),
        };
        let mut model = model_spec(&model_text)?;
        if pipeline.sequence_parallel {
            model = model
                .with_sequence_parallel()
                .map_err(|_| SpecError::SequenceParallelModel { model: model_text.clone() })?;
        }
        let mut devices = parse_devices(&pipeline.devices, pipeline.device_memory)?;
        let k = pipeline.tensor_parallel;
        devices.truncate(devices_used(self, devices.len())?);
        if devices.len() % k != 0 {
            return Err(SpecError::TensorParallelGroups { tensor_parallel: k, devices: devices.len() });
        }
        let optimizer = self.optimizer.config()?;
        let graph = model
            .build(training.seed)
            .map_err(|e| SpecError::ModelBuild { text: model_text.clone(), reason: reason(e) })?;
        let n_outputs = graph.node(graph.output()?)?.output_shape.dims().iter().product::<usize>();
        data::fit_to_model(&mut splits, &model, &model_text, n_outputs, self.data.classes)?;
        let data::Splits { train, test } = splits;
        if training.batch > train.len() {
            return Err(SpecError::BatchOverRows { batch: training.batch, rows: train.len() });
        }
        let steps_per_epoch = (train.len() / training.batch) as u64;
        let total_steps = total_steps(training, steps_per_epoch)?;
        let config = PipelineConfig {
            schedule: pipeline.schedule,
            n_chunks: pipeline.chunks,
            n_micro_batches: pipeline.microbatches,
            batch_rows: training.batch,
            optimizer,
            recompute: pipeline.recompute,
            seed: training.seed,
            core_slots: pipeline.core_slots,
            precision: training.precision,
            weight_cache: pipeline.weight_cache,
        };
        Ok(Loaded { model_text, model, graph, train, test, devices, optimizer, steps_per_epoch, total_steps, config })
    }
}

/// Data-parallel replicas of an unsplit model: how many, and what every replica's graph is built from.
pub(super) struct Replicated {
    pub data_parallel: DataParallel,
    pub model: ModelSpec,
    pub seed: u64,
    /// The trainer runs all its devices in this process whatever the process's transport (a
    /// strategy's worker, which exchanges with the other ranks itself).
    pub in_this_process: bool,
}

/// Places the graph as `placement` says (for replica 0's devices) and starts the trainer, with
/// `replicated`'s replicas on the other devices; for `auto`, also how it decided. `auto` profiles
/// the layers only when no MPI launcher started several ranks (every rank must place alike).
pub(super) fn place_and_build(
    graph: Graph,
    devices: Vec<Device>,
    config: &PipelineConfig,
    placement: &PlacementSpec,
    replicated: Replicated,
) -> Result<(Plan, Trainer, Option<AutoPlacement>), SpecError> {
    let Replicated { data_parallel, model, seed, in_this_process } = replicated;
    let first = devices[..devices.len() / data_parallel.replicas.max(1)].to_vec();
    let start = |graph, placement: Placement| -> Result<Trainer, SpecError> {
        let mut builder = builder(graph, devices, config);
        if in_this_process {
            builder = builder.transport(std::sync::Arc::new(conveyor_engine::transport::InProcess));
        }
        let builder = with_replicas(builder, &data_parallel, move |_, _| model.build(seed));
        Ok(builder.placement(placement).build()?)
    };
    let (stages, name) = match placement {
        PlacementSpec::Auto => {
            let may_profile = conveyor_engine::transport::launcher_world_size().is_none_or(|n| n <= 1);
            // The chosen cut (the cost model's, or the measured one), planned under this run's
            // settings, the weight cache included, and used as planned: not planned again.
            let (plan, how) = plan_auto(&graph, &first, config, may_profile)?;
            let trainer = start(graph, Placement::Plan(Box::new(plan.clone())))?;
            return Ok((plan, trainer, Some(how)));
        }
        PlacementSpec::Time => {
            let plan = plan_by_time(&graph, &first, config)?;
            let trainer = start(graph, Placement::Plan(Box::new(plan.clone())))?;
            return Ok((plan, trainer, None));
        }
        PlacementSpec::File(path) => (read_placement_file(path)?, path.display().to_string()),
        PlacementSpec::Manual(stages) => (stages.clone(), "stages".to_string()),
    };
    // The same memory model as `auto`: measured layer memory, the recompute mode, the undo
    // snapshot and caches kept only where they fit.
    let plan = plan_manually(&graph, &stages, &first, config)
        .map_err(|source| SpecError::Placement { placement: name, source: Box::new(source) })?;
    let trainer = start(graph, Placement::Plan(Box::new(plan.clone())))?;
    Ok((plan, trainer, None))
}

impl PreparedRun {
    /// The model spec's text (`mlp:8,16,4`).
    pub fn model_text(&self) -> &str {
        self.spec.model.spec.as_deref().unwrap_or_default()
    }

    /// The optimizer's base learning rate.
    pub fn base_lr(&self) -> f64 {
        self.optimizer.lr()
    }

    /// The learning rate of step `step` (0-based) under the spec's schedule.
    pub fn lr(&self, step: u64) -> f64 {
        self.spec.optimizer.lr_schedule.lr(self.base_lr(), step, self.total_steps)
    }

    /// The epoch step `step` falls in.
    pub fn epoch(&self, step: u64) -> u64 {
        step / self.steps_per_epoch.max(1)
    }

    /// Readies step `step`: sets the optimizers' learning rate to [`PreparedRun::lr`] (when it
    /// changed) and returns the step's batch, the rows of its place in its epoch's order
    /// (shuffled from the seed and the epoch unless `shuffle` is off).
    pub fn step_batch(&mut self, step: u64) -> conveyor_engine::Result<(Tensor, Vec<usize>)> {
        let lr = self.lr(step);
        if lr != self.current_lr {
            for result in self.trainer.with_optimizers(move |optimizer, _| optimizer.set_lr(lr))? {
                result?;
            }
            self.current_lr = lr;
        }
        let epoch = self.epoch(step);
        let within = (step % self.steps_per_epoch.max(1)) as usize;
        let training = &self.spec.training;
        if self.order.as_ref().is_none_or(|(cached, _)| *cached != epoch) {
            let order = crate::data::epoch_order(self.train.len(), training.shuffle, training.seed, epoch);
            self.order = Some((epoch, order));
        }
        let order = &self.order.as_ref().expect("the epoch's order was just set").1;
        self.train.batch(&order[within * training.batch..(within + 1) * training.batch])
    }

    /// Takes steps `steps` of the run with [`Trainer::fit`], each at its learning rate
    /// ([`conveyor_engine::runtime::Batch::at_lr`]) on its batch (as [`PreparedRun::step_batch`]
    /// draws them, on a loader thread that keeps two ready), so they overlap when the trainer overlaps steps
    /// ([`conveyor_engine::runtime::TrainerBuilder::overlap_steps`]). `on_step(step, report)` sees
    /// each step's report in order and may stop the run. Returns how many steps were taken, and
    /// the error of the step after them if one failed (those before it stay applied).
    ///
    /// ```
    /// let spec = conveyor::RunSpec::from_toml_str(
    ///     "[model]\nspec = \"mlp:4,8,2\"\n[data]\nsource = \"synthetic:64,4,2\"\n[training]\nbatch = 16\nsteps = 5",
    /// )?;
    /// let mut run = spec.prepare()?;
    /// let mut seen = Vec::new();
    /// let (taken, outcome) = run.fit_steps(0..5, |step, report| {
    ///     seen.push((step, report.loss));
    ///     std::ops::ControlFlow::Continue(())
    /// });
    /// outcome?;
    /// assert_eq!((taken, seen.len(), seen[4].0), (5, 5, 4));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn fit_steps(
        &mut self,
        steps: std::ops::Range<u64>,
        mut on_step: impl FnMut(u64, &StepReport) -> std::ops::ControlFlow<()>,
    ) -> (u64, conveyor_engine::Result<()>) {
        let lrs: Vec<f64> = steps.clone().map(|step| self.lr(step)).collect();
        // The optimizers' rate is set by each step now; the next `step_batch` sets it again.
        self.current_lr = f64::NAN;
        let (per_epoch, first) = (self.steps_per_epoch.max(1), steps.start);
        let PreparedRun { trainer, train, order, spec, .. } = self;
        let rows = spec.training.batch;
        let (shuffle, seed) = (spec.training.shuffle, spec.training.seed);
        let batches = steps.zip(lrs).map(|(step, lr)| {
            let (epoch, within) = (step / per_epoch, (step % per_epoch) as usize);
            if order.as_ref().is_none_or(|(cached, _)| *cached != epoch) {
                *order = Some((epoch, crate::data::epoch_order(train.len(), shuffle, seed, epoch)));
            }
            let order = &order.as_ref().expect("the epoch's order was just set").1;
            let (inputs, labels) = train.batch(&order[within * rows..(within + 1) * rows])?;
            Ok::<_, conveyor_engine::Error>(conveyor_engine::runtime::Batch::new(inputs, labels).at_lr(lr))
        });
        // A loader thread draws the batches ahead (two in its queue), so the next batch is ready
        // when the trainer launches it.
        let mut taken = 0;
        let outcome = std::thread::scope(|scope| {
            let (tx, rx) = std::sync::mpsc::sync_channel(2);
            scope.spawn(move || {
                for batch in batches {
                    if tx.send(batch).is_err() {
                        break; // the run stopped early
                    }
                }
            });
            let outcome = trainer.fit(rx.iter(), |report| {
                let flow = on_step(first + taken, report);
                taken += 1;
                flow
            });
            drop(rx);
            outcome
        });
        (taken, outcome.map(|_| ()))
    }

    /// Takes step `step` of the run: [`PreparedRun::step_batch`], then [`Trainer::train_step`].
    ///
    /// ```
    /// let spec = conveyor::RunSpec::from_toml_str(
    ///     "[model]\nspec = \"mlp:4,8,2\"\n[data]\nsource = \"synthetic:64,4,2\"\n[training]\nbatch = 16\nsteps = 5",
    /// )?;
    /// let mut run = spec.prepare()?;
    /// let mut losses = Vec::new();
    /// for step in 0..run.total_steps {
    ///     losses.push(run.train_step(step)?.loss);
    /// }
    /// assert_eq!(losses.len(), 5);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn train_step(&mut self, step: u64) -> conveyor_engine::Result<StepReport> {
        let (inputs, labels) = self.step_batch(step)?;
        self.trainer.train_step(&inputs, &labels)
    }
}
