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
    /// `Manual`, `Auto` and `File` are planned by `build` with the builder's devices (their
    /// budgets), schedule, chunks, micro-batches, optimizer and recomputation (with modes per
    /// stage, the one keeping the most), and need [`TrainerBuilder::batch_rows`]; a `Plan` is
    /// used as made. The plan's derived caches and commit snapshots replace any set with
    /// [`TrainerBuilder::derived_caches`] and [`TrainerBuilder::commit_snapshot`], and
    /// [`Trainer::plan`] returns it. Giving both `.placement(..)` and `.stages(..)` is an error. Planned placements need tensor-parallel degree 1 (the
    /// facade's `build_trainer_tensor_parallel` plans split models).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use conveyor_engine::Device;
    /// use conveyor_engine::graph::Graph;
    /// use conveyor_engine::placement::{PlaceBy, Placement};
    /// use conveyor_engine::runtime::Trainer;
    /// # use conveyor_engine::{ForwardCtx, Layer, LayerCost, Loss, Parameter, Saved, Shape, Tensor};
    /// # // The engine has no layers of its own (they live in conveyor-layers): pass-through
    /// # // layers and a zero loss stand in for them here.
    /// # #[derive(Debug)]
    /// # struct Pass;
    /// # impl Layer for Pass {
    /// #     fn kind(&self) -> &'static str { "Pass" }
    /// #     fn output_shape(&self, s: &[Shape]) -> conveyor_engine::Result<Shape> { Ok(s[0].clone()) }
    /// #     fn parameters(&self) -> &[Parameter] { &[] }
    /// #     fn parameters_mut(&mut self) -> &mut [Parameter] { &mut [] }
    /// #     fn forward(&self, x: &[&Tensor], _: &ForwardCtx) -> conveyor_engine::Result<(Tensor, Saved)> {
    /// #         Ok((x[0].share(), Saved::default()))
    /// #     }
    /// #     fn backward_input(&self, _: &Saved, g: &Tensor) -> conveyor_engine::Result<Vec<Option<Tensor>>> {
    /// #         Ok(vec![Some(g.share())])
    /// #     }
    /// #     fn backward_weight(&self, _: &Saved, _: &Tensor, _: &mut [Tensor]) -> conveyor_engine::Result<()> { Ok(()) }
    /// #     fn cost(&self, _: &[Shape]) -> conveyor_engine::Result<LayerCost> { Ok(LayerCost::default()) }
    /// # }
    /// # #[derive(Debug)]
    /// # struct Zero;
    /// # impl Loss for Zero {
    /// #     fn loss_and_grad(&self, y: &Tensor, _: &conveyor_engine::Targets, _: f32) -> conveyor_engine::Result<(f64, Tensor)> {
    /// #         Ok((0.0, Tensor::zeros(y.shape().clone(), y.dtype(), y.device())?))
    /// #     }
    /// # }
    /// # fn graph() -> conveyor_engine::Result<Graph> {
    /// #     let mut g = Graph::new();
    /// #     let x = g.input("x", [16])?;
    /// #     let h = g.add("fc1", Pass, &[x])?;
    /// #     let h = g.add("relu", Pass, &[h])?;
    /// #     let y = g.add("fc2", Pass, &[h])?;
    /// #     g.set_output(y)?;
    /// #     Ok(g)
    /// # }
    /// # let loss = Arc::new(Zero);
    /// // `graph()` builds fc1 -> relu -> fc2 (layers from conveyor-layers, say); `loss` is the loss.
    /// let trainer = Trainer::builder(graph()?, loss.clone())
    ///     .devices(Device::parse_list("cpu:2")?)
    ///     .micro_batches(4)
    ///     .batch_rows(8)
    ///     .placement(Placement::Auto { by: PlaceBy::Memory })
    ///     .build()?;
    /// assert_eq!(trainer.plan().expect("a planned placement keeps its plan").stages.len(), 2);
    ///
    /// // By hand: node names or `first..last` ranges, one list per stage.
    /// let stages = vec![vec!["fc1..relu".to_string()], vec!["fc2".to_string()]];
    /// let trainer = Trainer::builder(graph()?, loss)
    ///     .devices(Device::parse_list("cpu:0-1")?)
    ///     .batch_rows(8)
    ///     .placement(Placement::Manual(stages))
    ///     .build()?;
    /// assert_eq!(trainer.plan().unwrap().stages[1].node_names, ["fc2"]);
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
    /// use conveyor_engine::Device;
    /// use conveyor_engine::graph::Graph;
    /// use conveyor_engine::placement::Placement;
    /// use conveyor_engine::runtime::Trainer;
    /// # use conveyor_engine::{ForwardCtx, Layer, LayerCost, Loss, Parameter, Saved, Shape, Tensor};
    /// # // The engine has no layers of its own (they live in conveyor-layers): pass-through
    /// # // layers and a zero loss stand in for them here.
    /// # #[derive(Debug)]
    /// # struct Pass;
    /// # impl Layer for Pass {
    /// #     fn kind(&self) -> &'static str { "Pass" }
    /// #     fn output_shape(&self, s: &[Shape]) -> conveyor_engine::Result<Shape> { Ok(s[0].clone()) }
    /// #     fn parameters(&self) -> &[Parameter] { &[] }
    /// #     fn parameters_mut(&mut self) -> &mut [Parameter] { &mut [] }
    /// #     fn forward(&self, x: &[&Tensor], _: &ForwardCtx) -> conveyor_engine::Result<(Tensor, Saved)> {
    /// #         Ok((x[0].share(), Saved::default()))
    /// #     }
    /// #     fn backward_input(&self, _: &Saved, g: &Tensor) -> conveyor_engine::Result<Vec<Option<Tensor>>> {
    /// #         Ok(vec![Some(g.share())])
    /// #     }
    /// #     fn backward_weight(&self, _: &Saved, _: &Tensor, _: &mut [Tensor]) -> conveyor_engine::Result<()> { Ok(()) }
    /// #     fn cost(&self, _: &[Shape]) -> conveyor_engine::Result<LayerCost> { Ok(LayerCost::default()) }
    /// # }
    /// # #[derive(Debug)]
    /// # struct Zero;
    /// # impl Loss for Zero {
    /// #     fn loss_and_grad(&self, y: &Tensor, _: &conveyor_engine::Targets, _: f32) -> conveyor_engine::Result<(f64, Tensor)> {
    /// #         Ok((0.0, Tensor::zeros(y.shape().clone(), y.dtype(), y.device())?))
    /// #     }
    /// # }
    /// # fn graph() -> conveyor_engine::Result<Graph> {
    /// #     let mut g = Graph::new();
    /// #     let x = g.input("x", [16])?;
    /// #     let h = g.add("fc1", Pass, &[x])?;
    /// #     let h = g.add("relu", Pass, &[h])?;
    /// #     let y = g.add("fc2", Pass, &[h])?;
    /// #     g.set_output(y)?;
    /// #     Ok(g)
    /// # }
    /// # let loss = Arc::new(Zero);
    /// // `graph()` builds fc1 -> relu -> fc2 (layers from conveyor-layers, say); `loss` is the loss.
    /// let builder = Trainer::builder(graph()?, loss)
    ///     .devices(Device::parse_list_with_budget("cpu:2", Some(1 << 30))?)
    ///     .micro_batches(2)
    ///     .batch_rows(8)
    ///     .placement(Placement::auto());
    /// let plan = builder.plan()?;
    /// for stage in &plan.stages {
    ///     println!("stage {}: {:?}, {} bytes", stage.stage_idx, stage.node_names, stage.memory.total());
    ///     assert!(stage.memory.total() <= 1 << 30);
    /// }
    /// let trainer = builder.build()?; // trains with that plan
    /// assert_eq!(trainer.plan().map(|p| p.stages.len()), Some(plan.stages.len()));
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
            precision: self.precision,
            weight_cache: Default::default(),
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
