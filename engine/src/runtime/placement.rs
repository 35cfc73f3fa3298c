//! Placement on the builder: [`TrainerBuilder::placement`] chooses the stages (by hand, from a
//! file, or automatically), [`TrainerBuilder::plan`] shows the plan without building, `build`
//! applies it (stages, derived caches, commit snapshots), and [`Trainer::plan`] keeps it. The
//! planner sees the builder's devices (their budgets), schedule, chunks, micro-batches, optimizer,
//! recomputation and [`TrainerBuilder::batch_rows`].
//!
//! A child module of `trainer.rs` (declared there with `#[path]`), so it reads the builder's
//! fields without widening their visibility.
use super::{Trainer, TrainerBuilder};
use crate::placement::{PipelineConfig, Placement, Plan, plan_placement};
use crate::runtime::Recompute;
use crate::{Error, Result};

/// The builder's placement settings.
#[derive(Default)]
pub(super) struct PlacementChoice {
    placement: Option<Placement>,
    batch_rows: Option<usize>,
}

impl TrainerBuilder {
    /// How the layers are put on stages: by hand ([`Placement::Manual`], names or `first..last`
    /// ranges per stage), from a placement file ([`Placement::File`]), automatically
    /// ([`Placement::Auto`]: by FLOP estimates under the devices' memory budgets, or by measured
    /// layer times), as node ids without planning ([`Placement::Stages`], what
    /// [`TrainerBuilder::stages`] does), or a plan made before ([`Placement::Plan`]).
    ///
    /// Every placement but `Stages` is planned by `build` with the builder's devices, schedule,
    /// chunks, micro-batches, optimizer and recomputation, and needs
    /// [`TrainerBuilder::batch_rows`]; the plan's derived caches and commit snapshots replace
    /// any set with [`TrainerBuilder::derived_caches`] and [`TrainerBuilder::commit_snapshot`],
    /// and [`Trainer::plan`] returns it. Planned placements need tensor-parallel degree 1 (the
    /// facade's `build_trainer_tensor_parallel` plans split models).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use conveyor_engine::graph::Graph;
    /// use conveyor_engine::placement::{PlaceBy, Placement};
    /// use conveyor_engine::runtime::Trainer;
    /// use conveyor_engine::{Device, Tensor, init};
    /// use conveyor_layers::{CrossEntropyLoss, Linear, Relu};
    ///
    /// let mut rng = init::rng(0);
    /// let mut g = Graph::new();
    /// let x = g.input("x", [16])?;
    /// let h = g.add("fc1", Linear::new(16, 32, true, &mut rng)?, &[x])?;
    /// let h = g.add("relu", Relu::new(), &[h])?;
    /// let y = g.add("fc2", Linear::new(32, 4, true, &mut rng)?, &[h])?;
    /// g.set_output(y)?;
    /// let mut trainer = Trainer::builder(g, Arc::new(CrossEntropyLoss::new()))
    ///     .devices(Device::parse_list("cpu:2")?)
    ///     .micro_batches(4)
    ///     .batch_rows(8)
    ///     // Or by hand: Placement::Manual(vec![vec!["fc1..relu".into()], vec!["fc2".into()]]).
    ///     .placement(Placement::Auto { by: PlaceBy::Memory })
    ///     .build()?;
    /// let plan = trainer.plan().expect("a planned placement keeps its plan");
    /// assert_eq!(plan.stages.len(), 2);
    /// let inputs = Tensor::from_slice(&[0.5f32; 8 * 16], [8, 16], &Device::host())?;
    /// let report = trainer.train_step(&inputs, &[0, 1, 2, 3, 0, 1, 2, 3])?;
    /// assert!(report.loss.is_finite());
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn placement(mut self, placement: Placement) -> Self {
        self.placement.placement = Some(placement);
        self
    }

    /// Rows per batch the planner budgets for: each micro-batch holds `rows / micro_batches`
    /// (rounded up). Needed by every planned [`Placement`]; the trainer itself takes batches of
    /// any size.
    pub fn batch_rows(mut self, rows: usize) -> Self {
        self.placement.batch_rows = Some(rows);
        self
    }

    /// The plan [`TrainerBuilder::build`] would use, without building: stages, per-stage memory
    /// and predicted times (what `conveyor plan` prints). An error without a planned
    /// [`TrainerBuilder::placement`] (none, or [`Placement::Stages`]).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use conveyor_engine::graph::Graph;
    /// use conveyor_engine::placement::Placement;
    /// use conveyor_engine::runtime::Trainer;
    /// use conveyor_engine::{Device, init};
    /// use conveyor_layers::{CrossEntropyLoss, Linear, Relu};
    ///
    /// let mut rng = init::rng(0);
    /// let mut g = Graph::new();
    /// let x = g.input("x", [16])?;
    /// let h = g.add("fc1", Linear::new(16, 32, true, &mut rng)?, &[x])?;
    /// let h = g.add("relu", Relu::new(), &[h])?;
    /// let y = g.add("fc2", Linear::new(32, 4, true, &mut rng)?, &[h])?;
    /// g.set_output(y)?;
    /// let builder = Trainer::builder(g, Arc::new(CrossEntropyLoss::new()))
    ///     .devices(Device::parse_list("cpu:0-1")?)
    ///     .micro_batches(2)
    ///     .batch_rows(8)
    ///     .placement(Placement::Manual(vec![vec!["fc1".into(), "relu".into()], vec!["fc2".into()]]));
    /// let plan = builder.plan()?;
    /// assert_eq!(plan.stages[1].node_names, ["fc2"]);
    /// println!("stage 0 needs {} bytes", plan.stages[0].memory.total());
    /// let trainer = builder.build()?; // trains with the same plan
    /// assert_eq!(trainer.plan().map(|p| p.stages.len()), Some(2));
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn plan(&self) -> Result<Plan> {
        self.make_plan()?.ok_or_else(|| {
            Error::invalid(
                "placement",
                "nothing to plan: give a planned placement with .placement(Placement::Manual(..)), \
                 Placement::Auto { .. } or Placement::File(..)",
            )
        })
    }

    /// The plan of the builder's placement; `None` without one or for [`Placement::Stages`].
    fn make_plan(&self) -> Result<Option<Plan>> {
        let placement = match &self.placement.placement {
            None | Some(Placement::Stages(_)) => return Ok(None),
            Some(Placement::Plan(plan)) => return Ok(Some((**plan).clone())),
            Some(placement) => placement,
        };
        if self.tensor_parallel != 1 {
            return Err(Error::invalid(
                "placement",
                format!(
                    "a planned placement with tensor-parallel degree {}: plan split models from their spec \
                     (conveyor::pipeline::build_trainer_tensor_parallel) or give .stages(...)",
                    self.tensor_parallel
                ),
            ));
        }
        if self.devices.is_empty() {
            return Err(Error::invalid("devices", "no devices given; give at least one (e.g. cpu:0)"));
        }
        let batch_rows = self.placement.batch_rows.ok_or_else(|| {
            Error::invalid(
                "batch_rows",
                "planning a placement needs the batch size the memory plan budgets for: call .batch_rows(rows)",
            )
        })?;
        let config = PipelineConfig {
            schedule: self.schedule,
            n_chunks: self.n_chunks,
            n_micro_batches: self.n_micro_batches,
            batch_rows,
            optimizer: self.optimizer,
            recompute: planning_recompute(&self.recompute),
            seed: self.seed,
            core_slots: self.core_slots,
        };
        plan_placement(&self.graph, &self.devices, &config, placement)
    }

    /// Resolves the placement for `build`: sets the stages (and, for a planned placement, the
    /// derived caches and commit snapshots) and returns the plan.
    pub(super) fn apply_placement(&mut self) -> Result<Option<Plan>> {
        if self.placement.placement.is_some() && self.stages.is_some() {
            return Err(Error::invalid("stages", "both .stages(...) and .placement(...) given; give one"));
        }
        if let Some(Placement::Stages(stages)) = &self.placement.placement {
            self.stages = Some(stages.clone());
            return Ok(None);
        }
        let plan = self.make_plan()?;
        if let Some(plan) = &plan {
            self.stages = Some(plan.stages.iter().map(|s| s.nodes.clone()).collect());
            self.derived_caches = plan.derived_caches();
            self.commit_snapshot = Some(plan.commit_snapshots());
        }
        Ok(plan)
    }
}

/// The one recomputation mode the planner budgets for: the stages' mode when they share one,
/// else the one that keeps the most (a bound for every stage).
fn planning_recompute(per_stage: &[Recompute]) -> Recompute {
    let keeps = |r: &Recompute| match r {
        Recompute::Never => 2,
        Recompute::ExceptLast => 1,
        Recompute::Always => 0,
    };
    per_stage.iter().copied().max_by_key(keeps).unwrap_or_default()
}

impl Trainer {
    /// The plan the trainer was built with ([`TrainerBuilder::placement`]); `None` for stages
    /// given as node ids or a single stage.
    pub fn plan(&self) -> Option<&Plan> {
        self.plan.as_ref()
    }
}
