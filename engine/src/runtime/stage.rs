//! One pipeline stage on its worker: its layers, gradients, optimizer and the per-micro-batch
//! state between forward and backward. Knows nothing of channels; the worker moves messages.
use std::collections::BTreeSet;

use super::Recompute;
use super::gradient_buckets::BucketQueue;
use crate::graph::NodeId;
use crate::optim::Optimizer;
use crate::{Device, Error, ForwardCtx, Layer, Loss, Result, Saved, Targets, Tensor};

/// A layer node as its stage runs it.
#[derive(Debug)]
pub(crate) struct NodeExec {
    pub id: NodeId,
    pub name: String,
    pub layer: Box<dyn Layer>,
    /// Producers of the node's inputs, in input order.
    pub inputs: Vec<NodeId>,
    /// Gradients, aligned with the layer's parameters.
    pub grads: Vec<Tensor>,
}

/// Node outputs that cross from one stage to another, for one peer stage.
#[derive(Clone, Debug)]
pub(crate) struct Route {
    pub peer_stage_idx: usize,
    pub nodes: Vec<NodeId>,
}

/// Tensors of one message, each tagged with the node whose output (or output gradient) it is.
pub(crate) type Payload = Vec<(NodeId, Tensor)>;

/// What a forward pass produces: messages for consumer stages `(stage, payload)`, the
/// micro-batch's loss when the output is here, and in evaluation mode the graph output.
pub(crate) type ForwardOutcome = (Vec<(usize, Payload)>, Option<f64>, Option<Tensor>);

#[derive(Debug, Default)]
struct MicroBatchState {
    /// Stage inputs kept for recomputation.
    kept_inputs: Payload,
    /// The labels of a loss the output layer computes itself, kept for recomputation.
    kept_labels: Option<Vec<usize>>,
    /// Per local node: what its forward saved.
    saved: Vec<Option<Saved>>,
    /// Per local node: gradient of its output (accumulated, then kept for the weight pass).
    grad_out: Vec<Option<Tensor>>,
}

impl MicroBatchState {
    fn activation_bytes(&self) -> u64 {
        let kept: usize = self.kept_inputs.iter().map(|(_, t)| t.size_in_bytes()).sum();
        let saved: usize = self.saved.iter().flatten().map(Saved::size_in_bytes).sum();
        (kept + saved) as u64
    }
}

/// A stage: its nodes in execution order, routes to other stages, and step state.
#[derive(Debug)]
pub(crate) struct Stage {
    pub stage_idx: usize,
    pub device: Device,
    pub nodes: Vec<NodeExec>,
    /// Producer stages and which of their node outputs this stage receives.
    pub recv_from: Vec<Route>,
    /// Consumer stages and which of this stage's node outputs they receive.
    pub send_to: Vec<Route>,
    /// The graph's output node, when it lives here.
    pub output_node: Option<NodeId>,
    pub recompute: Recompute,
    pub optimizer: Optimizer,
    /// Whether the gradient norm counts the unsplit layers here (false on the ranks of a stage's
    /// shards other than shard 0, which hold copies of them).
    pub counts_unsplit: bool,
    /// Whether the gradient norm counts this stage at all (false in data-parallel replicas other
    /// than 0, whose gradients equal replica 0's after the all-reduce).
    pub counts_in_norm: bool,
    /// ZeRO-1 across data-parallel replicas: which replica updates each node's parameters (and
    /// alone keeps their optimizer state), and this stage's replica. `None`: every replica
    /// updates every parameter.
    pub zero: Option<ZeroShards>,
    /// Tied copies the gradient norm leaves out, as (node position, parameter index): every
    /// tied parameter's copies but its first (`gradient_groups.rs`).
    pub norm_skips: Vec<(usize, usize)>,
    /// Per node, per input: whether the input takes a gradient. An input neither on this stage
    /// nor received from another (a graph input, such as the data) takes none.
    input_needs_grad: Vec<Vec<bool>>,
    micro_batches: Vec<MicroBatchState>,
    /// The commit's undo snapshot; `None` when the memory plan dropped it.
    undo: Option<UndoSnapshot>,
    next_weight_micro_batch: usize,
    deferred_weight: BTreeSet<usize>,
    pub peak_activation_bytes: u64,
}

/// Everything a forward or backward needs from the step, shared by all stages.
pub(crate) struct StepCtx<'a> {
    pub step_idx: u64,
    pub seed: u64,
    pub n_micro_batches: usize,
    pub normalizer: f32,
    pub loss: &'a dyn Loss,
    pub training: bool,
    /// This replica's first micro-batch in the whole batch (data parallelism): dropout draws by
    /// the batch-wide index, so replicas draw what one device draws for the same rows.
    pub micro_batch_offset: usize,
    /// The autocast policy every layer's forward gets ([`crate::ForwardCtx::precision`]).
    pub precision: crate::Precision,
    /// The loss scale (f16 training; 1 otherwise): the loss gradient is multiplied by it.
    pub loss_scale: f32,
}

impl StepCtx<'_> {
    /// What the loss divides its sum by. A loss divides by its normalizer, so dividing that by
    /// the loss scale multiplies the gradient by it; the scale is a power of two, so the reported
    /// loss is the unscaled one to the bit (barring overflow, which the vote catches).
    fn loss_normalizer(&self) -> f32 {
        self.normalizer / self.loss_scale
    }

    /// The dropout seed of one node on one micro-batch of this step: the same wherever the node
    /// runs and whether or not it is recomputed.
    fn node_seed(&self, micro_batch_idx: usize, node: NodeId) -> u64 {
        let mut h = self.seed ^ 0x9E37_79B9_7F4A_7C15;
        let micro_batch_idx = self.micro_batch_offset + micro_batch_idx;
        for v in [self.step_idx, micro_batch_idx as u64, node.index() as u64] {
            h = (h ^ v).wrapping_mul(0x0100_0000_01B3).rotate_left(17) ^ (h >> 29);
        }
        h
    }
}

impl Stage {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        stage_idx: usize,
        device: Device,
        nodes: Vec<NodeExec>,
        recv_from: Vec<Route>,
        send_to: Vec<Route>,
        output_node: Option<NodeId>,
        recompute: Recompute,
        optimizer: Optimizer,
        keep_undo: bool,
    ) -> Stage {
        let input_needs_grad = nodes
            .iter()
            .map(|node| {
                node.inputs
                    .iter()
                    .map(|input| {
                        nodes.iter().any(|n| n.id == *input) || recv_from.iter().any(|r| r.nodes.contains(input))
                    })
                    .collect()
            })
            .collect();
        Stage {
            input_needs_grad,
            stage_idx,
            device,
            nodes,
            recv_from,
            send_to,
            output_node,
            recompute,
            optimizer,
            micro_batches: Vec::new(),
            undo: keep_undo.then(UndoSnapshot::default),
            next_weight_micro_batch: 0,
            deferred_weight: BTreeSet::new(),
            peak_activation_bytes: 0,
            counts_unsplit: true,
            counts_in_norm: true,
            zero: None,
            norm_skips: Vec::new(),
        }
    }

    /// Clears step state and zeroes the gradients for a step of `n_micro_batches`. Fails (instead
    /// of panicking) when a gradient cannot be zeroed: a shared one needs fresh bytes past the
    /// budget, or a GPU memset fails. With `drop_undo` false the last update's undo snapshot stays
    /// usable (an overlapped step's, not yet validated); the prepare phase replaces it.
    pub fn begin_step(&mut self, n_micro_batches: usize, drop_undo: bool) -> Result<()> {
        self.micro_batches = (0..n_micro_batches).map(|_| MicroBatchState::default()).collect();
        self.next_weight_micro_batch = 0;
        self.deferred_weight.clear();
        self.peak_activation_bytes = 0;
        if let Some(undo) = self.undo.as_mut().filter(|_| drop_undo) {
            undo.valid = false; // a rollback only ever restores this step's snapshot
        }
        for node in &mut self.nodes {
            node.grads.iter_mut().try_for_each(Tensor::try_fill_zero)?;
        }
        Ok(())
    }

    /// Drops all step state (after a step or an abort); parameters are untouched.
    pub fn end_step(&mut self) {
        self.micro_batches.clear();
        self.deferred_weight.clear();
    }

    fn local_index(&self, id: NodeId) -> Option<usize> {
        self.nodes.iter().position(|n| n.id == id)
    }

    fn micro_batch(&mut self, micro_batch_idx: usize) -> Result<&mut MicroBatchState> {
        let stage_idx = self.stage_idx;
        self.micro_batches.get_mut(micro_batch_idx).ok_or_else(|| {
            Error::invalid(
                "micro_batch_idx",
                format!("stage {stage_idx} has no micro-batch {micro_batch_idx} in this step"),
            )
        })
    }

    fn note_activation_bytes(&mut self) {
        let bytes: u64 = self.micro_batches.iter().map(MicroBatchState::activation_bytes).sum();
        self.peak_activation_bytes = self.peak_activation_bytes.max(bytes);
    }

    fn recomputes(&self, micro_batch_idx: usize, n_micro_batches: usize) -> bool {
        match self.recompute {
            Recompute::Never => false,
            Recompute::Always => true,
            Recompute::ExceptLast => micro_batch_idx + 1 < n_micro_batches,
        }
    }

    /// Runs the stage's layers on `inputs`; returns each node's saved state and the outputs other
    /// stages or the loss need. With `output_labels`, the output node computes the softmax
    /// cross-entropy against them itself when it offers to ([`Layer::forward_cross_entropy`]):
    /// then its output is not among the outputs and its loss (scaled, as the loss's would be) is
    /// returned.
    fn run_layers(
        &self,
        ctx: &StepCtx<'_>,
        micro_batch_idx: usize,
        inputs: &Payload,
        output_labels: Option<&[usize]>,
    ) -> Result<(Vec<Saved>, Payload, Option<f64>)> {
        let mut values: Vec<Option<Tensor>> = Vec::with_capacity(self.nodes.len());
        let mut saved = Vec::with_capacity(self.nodes.len());
        let mut layer_loss = None;
        for node in &self.nodes {
            let mut args: Vec<&Tensor> = Vec::with_capacity(node.inputs.len());
            for input in &node.inputs {
                let tensor = match self.local_index(*input) {
                    Some(j) => values[j].as_ref(),
                    None => inputs.iter().find(|(id, _)| id == input).map(|(_, t)| t),
                };
                args.push(tensor.ok_or_else(|| {
                    Error::invalid(
                        "stage inputs",
                        format!("node `{}` on stage {} lacks an input", node.name, self.stage_idx),
                    )
                })?);
            }
            let fctx = ForwardCtx {
                training: ctx.training,
                seed: ctx.node_seed(micro_batch_idx, node.id),
                precision: ctx.precision,
            };
            let own_loss = match output_labels.filter(|_| self.output_node == Some(node.id)) {
                Some(labels) => node.layer.forward_cross_entropy(&args, labels, ctx.loss_normalizer(), &fctx),
                None => None,
            };
            if let Some(own_loss) = own_loss {
                let (loss, node_saved) = own_loss?;
                layer_loss = Some(loss);
                values.push(None);
                saved.push(node_saved);
                continue;
            }
            let (out, node_saved) = node.layer.forward(&args, &fctx)?;
            values.push(Some(out));
            saved.push(node_saved);
        }
        let mut outputs = Payload::new();
        let wanted = |id: NodeId| self.send_to.iter().any(|r| r.nodes.contains(&id)) || self.output_node == Some(id);
        for (node, value) in self.nodes.iter().zip(values) {
            if wanted(node.id)
                && let Some(value) = value
            {
                outputs.push((node.id, value));
            }
        }
        Ok((saved, outputs, layer_loss))
    }

    /// Forward of one micro-batch. Returns the messages for consumer stages (on this device; the
    /// worker moves them), the loss of the micro-batch when the output is here, and in evaluation
    /// mode the graph output.
    pub fn forward(
        &mut self,
        ctx: &StepCtx<'_>,
        micro_batch_idx: usize,
        inputs: Payload,
        targets: Option<Targets>,
    ) -> Result<ForwardOutcome> {
        // The output layer may compute a softmax cross-entropy itself (a vocabulary-parallel
        // head, whose logits then never meet on one device) when nothing else reads its output.
        let output_labels = match (&targets, self.output_node) {
            (Some(Targets::Classes(labels)), Some(output_id))
                if ctx.training
                    && ctx.loss.is_softmax_cross_entropy()
                    && !self.send_to.iter().any(|r| r.nodes.contains(&output_id)) =>
            {
                Some(labels.as_slice())
            }
            _ => None,
        };
        let (saved, mut outputs, layer_loss) = self.run_layers(ctx, micro_batch_idx, &inputs, output_labels)?;
        let mut loss_value = None;
        let mut eval_output = None;
        let n_nodes = self.nodes.len();
        let recompute = ctx.training && self.recomputes(micro_batch_idx, ctx.n_micro_batches);
        let mut grad_out: Vec<Option<Tensor>> = (0..n_nodes).map(|_| None).collect();
        let kept_labels = layer_loss.and(output_labels).filter(|_| recompute).map(<[usize]>::to_vec);
        if let (Some(loss), Some(output_id)) = (layer_loss, self.output_node) {
            loss_value = Some(loss / f64::from(ctx.loss_scale));
            let ones = Tensor::full(1.0, [1], crate::DType::F32, &self.device)?;
            grad_out[self.local_index(output_id).expect("output node is local")] = Some(ones);
        } else if let Some(output_id) = self.output_node {
            let position = outputs.iter().position(|(id, _)| *id == output_id).expect("output node is always kept");
            let sent_elsewhere = self.send_to.iter().any(|r| r.nodes.contains(&output_id));
            let output = if sent_elsewhere { outputs[position].1.try_clone()? } else { outputs.remove(position).1 };
            if ctx.training {
                let targets = targets
                    .ok_or_else(|| Error::invalid("targets", "a training step's output stage was given no targets"))?
                    .move_to_device(&self.device)?;
                let (loss, grad) = ctx.loss.loss_and_grad(&output, &targets, ctx.loss_normalizer())?;
                loss_value = Some(loss / f64::from(ctx.loss_scale));
                grad_out[self.local_index(output_id).expect("output node is local")] = Some(grad);
            } else {
                eval_output = Some(output);
            }
        }
        let mut messages = Vec::with_capacity(self.send_to.len());
        for (k, route) in self.send_to.iter().enumerate() {
            let last_route_for = |id: NodeId| !self.send_to[k + 1..].iter().any(|r| r.nodes.contains(&id));
            let mut payload = Payload::with_capacity(route.nodes.len());
            for id in &route.nodes {
                let position = outputs.iter().position(|(o, _)| o == id).expect("routed outputs are kept");
                let tensor =
                    if last_route_for(*id) { outputs.remove(position).1 } else { outputs[position].1.try_clone()? };
                payload.push((*id, tensor));
            }
            messages.push((route.peer_stage_idx, payload));
        }
        if ctx.training {
            let state = self.micro_batch(micro_batch_idx)?;
            state.grad_out = grad_out;
            if recompute {
                state.kept_inputs = inputs;
                state.kept_labels = kept_labels;
                state.saved = (0..n_nodes).map(|_| None).collect();
            } else {
                state.saved = saved.into_iter().map(Some).collect();
            }
            self.note_activation_bytes();
        }
        Ok((messages, loss_value, eval_output))
    }

    /// True when the micro-batch's activations were dropped and must be recomputed before backward.
    pub fn needs_recompute(&self, micro_batch_idx: usize) -> bool {
        self.micro_batches.get(micro_batch_idx).is_some_and(|s| s.saved.iter().any(Option::is_none))
    }

    /// Re-runs the forward of a micro-batch from its kept inputs to restore what backward needs.
    pub fn recompute(&mut self, ctx: &StepCtx<'_>, micro_batch_idx: usize) -> Result<()> {
        let state = self.micro_batch(micro_batch_idx)?;
        let (inputs, labels) = (std::mem::take(&mut state.kept_inputs), state.kept_labels.take());
        let (saved, _, _) = self.run_layers(ctx, micro_batch_idx, &inputs, labels.as_deref())?;
        let state = self.micro_batch(micro_batch_idx)?;
        state.saved = saved.into_iter().map(Some).collect();
        self.note_activation_bytes();
        Ok(())
    }

    /// Input-gradient pass of one micro-batch. `received` holds gradient messages from consumer
    /// stages, highest stage first. With `fused`, the weight pass runs right after. Returns the
    /// gradient messages for producer stages (on this device).
    pub fn backward_input(
        &mut self,
        micro_batch_idx: usize,
        received: Vec<Payload>,
        fused: bool,
        final_grads: Option<&mut BucketQueue>,
    ) -> Result<Vec<(usize, Payload)>> {
        let stage_idx = self.stage_idx;
        let n_nodes = self.nodes.len();
        let mut grad_out = std::mem::take(&mut self.micro_batch(micro_batch_idx)?.grad_out);
        if grad_out.len() != n_nodes {
            return Err(Error::invalid(
                "backward",
                format!("stage {stage_idx}: micro-batch {micro_batch_idx} has no forward"),
            ));
        }
        for payload in received {
            for (id, grad) in payload {
                let j = self.local_index(id).ok_or_else(|| {
                    Error::invalid(
                        "gradient message",
                        format!("stage {stage_idx} got a gradient for a node it does not hold"),
                    )
                })?;
                accumulate(&mut grad_out[j], grad)?;
            }
        }
        let mut outgoing: Vec<(usize, Payload)> =
            self.recv_from.iter().map(|r| (r.peer_stage_idx, Payload::new())).collect();
        let saved = std::mem::take(&mut self.micro_batch(micro_batch_idx)?.saved);
        for j in (0..n_nodes).rev() {
            let node = &self.nodes[j];
            let grad = grad_out[j].as_ref().ok_or_else(|| {
                Error::invalid("backward", format!("stage {stage_idx}: no gradient reached node `{}`", node.name))
            })?;
            let node_saved = saved[j].as_ref().ok_or_else(|| {
                Error::invalid("backward", format!("stage {stage_idx}: node `{}` has no saved activations", node.name))
            })?;
            let input_grads = node.layer.backward_input_for(node_saved, grad, &self.input_needs_grad[j])?;
            for (&input, input_grad) in node.inputs.iter().zip(input_grads) {
                let Some(input_grad) = input_grad else { continue };
                if let Some(k) = self.local_index(input) {
                    accumulate(&mut grad_out[k], input_grad)?;
                } else if let Some(r) = self.recv_from.iter().position(|r| r.nodes.contains(&input)) {
                    let payload = &mut outgoing[r].1;
                    match payload.iter_mut().find(|(id, _)| *id == input) {
                        Some((_, existing)) => add_gradient(existing, &input_grad)?,
                        None => payload.push((input, input_grad)),
                    }
                }
            }
        }
        let state = self.micro_batch(micro_batch_idx)?;
        state.saved = saved;
        state.grad_out = grad_out;
        if fused {
            self.backward_weight(micro_batch_idx, final_grads)?;
        }
        Ok(outgoing)
    }

    /// Weight-gradient pass of one micro-batch; frees its activations. Gradients are accumulated
    /// in micro-batch order on every schedule, so the sums are the same bit for bit: a
    /// micro-batch whose turn has not come keeps its activations and is computed as soon as every
    /// earlier micro-batch's weight pass has run.
    ///
    /// Nodes go last to first. With `final_grads` (data-parallel buckets), the step's last
    /// micro-batch hands each node's gradients over as soon as its weight pass is done: they are
    /// final (see `gradient_buckets.rs`).
    pub fn backward_weight(&mut self, micro_batch_idx: usize, mut final_grads: Option<&mut BucketQueue>) -> Result<()> {
        if micro_batch_idx != self.next_weight_micro_batch {
            self.micro_batch(micro_batch_idx)?;
            self.deferred_weight.insert(micro_batch_idx);
            return Ok(());
        }
        let n_micro_batches = self.micro_batches.len();
        let mut next = Some(micro_batch_idx);
        while let Some(mb) = next {
            let state = std::mem::take(self.micro_batch(mb)?);
            let last = mb + 1 == n_micro_batches;
            for (j, node) in self.nodes.iter_mut().enumerate().rev() {
                let (Some(saved), Some(grad)) =
                    (state.saved.get(j).and_then(Option::as_ref), state.grad_out.get(j).and_then(Option::as_ref))
                else {
                    return Err(Error::invalid(
                        "backward_weight",
                        format!(
                            "stage {}: node `{}` has no input-gradient pass for micro-batch {mb}",
                            self.stage_idx, node.name
                        ),
                    ));
                };
                node.layer.backward_weight(saved, grad, &mut node.grads)?;
                if let (true, Some(queue)) = (last, final_grads.as_deref_mut()) {
                    queue.push(self.stage_idx, j, &mut node.grads);
                }
            }
            self.next_weight_micro_batch = mb + 1;
            next = self.deferred_weight.remove(&(mb + 1)).then_some(mb + 1);
        }
        Ok(())
    }

    /// Sums every gradient across the data-parallel replicas of this stage (`comm`: one rank per
    /// replica), in the group's fixed order, so every replica holds the same sum.
    pub fn all_reduce_gradients(&mut self, comm: &dyn crate::collective::Communicator) -> Result<()> {
        for node in &mut self.nodes {
            for grad in &mut node.grads {
                comm.all_reduce_tensor(grad)?;
            }
        }
        Ok(())
    }

    /// Sum of squares of this stage's gradients (for global-norm clipping and the reported norm),
    /// accumulated in f64 ([`crate::optim::grad_sum_of_squares`]).
    pub fn grad_sum_of_squares(&self) -> Result<f64> {
        if !self.counts_in_norm {
            return Ok(0.0);
        }
        let counted = |(_, n): &(usize, &NodeExec)| self.counts_unsplit || n.layer.is_split();
        let grads: Vec<&Tensor> = self
            .nodes
            .iter()
            .enumerate()
            .filter(counted)
            .flat_map(|(pos, n)| {
                n.grads.iter().enumerate().filter(move |(i, _)| !self.norm_skips.contains(&(pos, *i))).map(|(_, g)| g)
            })
            .collect();
        crate::optim::grad_sum_of_squares(&grads)
    }

    /// The commit's *prepare* phase: everything about the update that can fail, done before the
    /// stage votes (see `runtime/README.md`). Reports the gradients' sum of squares and, when it
    /// is not finite, the first parameter whose gradient is not (nothing else is done then: the
    /// step will not be committed). Otherwise allocates the optimizer state, gives gradients,
    /// parameters and state private elements, and, when the stage keeps an undo snapshot, reserves
    /// its spare buffers (allocated once, kept from step to step), so that the apply phase
    /// allocates nothing. Changes no parameter and no state value.
    ///
    /// With a `loss_scale` other than 1 (f16 training) every gradient is first divided by it, so
    /// the norm, the clipping and the optimizer see the unscaled gradients.
    pub fn prepare_commit(&mut self, loss_scale: f32) -> Result<StageVote> {
        for node in &mut self.nodes {
            node.grads.iter_mut().try_for_each(Tensor::make_unique)?;
            if loss_scale != 1.0 {
                node.grads.iter_mut().try_for_each(|grad| grad.scale_in_place(1.0 / loss_scale))?;
            }
        }
        let sum_of_squares = self.grad_sum_of_squares()?;
        if !sum_of_squares.is_finite() {
            let mut first = None;
            'find: for node in &self.nodes {
                for (param, grad) in node.layer.parameters().iter().zip(&node.grads) {
                    if grad.has_non_finite()? {
                        first = Some(format!("{}.{}", node.name, param.name));
                        break 'find;
                    }
                }
            }
            return Ok(StageVote { sum_of_squares, non_finite_parameter: first.or(Some("(unknown)".into())) });
        }
        {
            let params: Vec<&Tensor> =
                self.nodes.iter().flat_map(|n| n.layer.parameters().iter().map(|p| &p.value)).collect();
            let grad_refs: Vec<&Tensor> = self.nodes.iter().flat_map(|n| n.grads.iter()).collect();
            match &self.zero {
                Some(zero) => self.optimizer.prepare_owned(&params, &grad_refs, &zero.owned_params(&self.nodes))?,
                None => self.optimizer.prepare_all(&params, &grad_refs)?,
            }
        }
        for node in &mut self.nodes {
            // Only a shared parameter needs `parameters_mut` (which marks derived copies stale).
            if node.layer.parameters().iter().any(|p| p.value.is_shared()) {
                node.layer.parameters_mut().iter_mut().try_for_each(|p| p.value.make_unique())?;
            }
        }
        self.optimizer.make_state_unique()?;
        if let Some(undo) = self.undo.as_mut() {
            let params = self.nodes.iter().flat_map(|n| n.layer.parameters().iter().map(|p| &p.value));
            undo.reserve(params, &self.optimizer)?;
        }
        Ok(StageVote { sum_of_squares, non_finite_parameter: None })
    }

    /// The commit's *apply* phase, after every stage voted ready: clips (when `max_norm` is set)
    /// with the global norm and applies the optimizer. After [`Stage::prepare_commit`] nothing
    /// here allocates; an error (or panic) is still possible from a GPU kernel launch, a custom
    /// layer or an injected fault, and [`Stage::roll_back`] then restores the stage exactly.
    ///
    /// With ZeRO-1 ([`Stage::zero`]) only this replica's nodes are updated; every other parameter is
    /// then broadcast from the replica that updated it (`replicas`, one rank per replica), the old
    /// values kept in the undo snapshot as for an update.
    ///
    /// `lr`, when the step carries a learning rate ([`super::Batch::at_lr`]), is set first and
    /// stays for later steps; the rate it replaced is kept in the undo snapshot, so a rollback
    /// puts it back with the parameters.
    pub fn apply_commit(
        &mut self,
        lr: Option<f64>,
        max_norm: Option<f64>,
        global_norm: f64,
        replicas: Option<&dyn crate::collective::Communicator>,
    ) -> Result<()> {
        if let Some(lr) = lr {
            let before = self.optimizer.lr();
            self.optimizer.set_lr(lr)?;
            if let Some(undo) = self.undo.as_mut() {
                undo.lr.get_or_insert(before);
            }
        }
        let mut grads: Vec<&mut Tensor> = self.nodes.iter_mut().flat_map(|n| n.grads.iter_mut()).collect();
        if let Some(max_norm) = max_norm {
            crate::optim::clip_grads_with_norm(&mut grads, max_norm, global_norm)?;
        }
        let zero = self.zero.clone();
        // Each layer refreshes its derived copies right after its own update, while its weight
        // is still in cache. A refresh that fails leaves the copies stale, which layers treat as
        // absent (they are an optimization): the update itself stands.
        let mut param_idx = 0;
        for (node_idx, node) in self.nodes.iter_mut().enumerate() {
            let NodeExec { layer, grads, name, .. } = node;
            if zero.as_ref().is_some_and(|z| !z.owns(node_idx)) {
                // Another replica updates this node; its new values arrive below.
                for p in layer.parameters_mut().iter_mut() {
                    if let Some(undo) = self.undo.as_mut() {
                        std::mem::swap(&mut p.value, &mut undo.params[param_idx]);
                        undo.holds_old[param_idx] = true;
                    }
                    param_idx += 1;
                }
                continue;
            }
            for (p, g) in layer.parameters_mut().iter_mut().zip(grads.iter()) {
                match self.undo.as_mut() {
                    // Out of place: the old values stay in the snapshot's spares.
                    Some(undo) => {
                        let (spare, holds_old) = (&mut undo.params[param_idx], &mut undo.holds_old[param_idx]);
                        self.optimizer.apply_swapping(
                            param_idx,
                            &mut p.value,
                            g,
                            spare,
                            &mut undo.optimizer,
                            holds_old,
                        )?;
                    }
                    None => self.optimizer.apply_prepared(param_idx, &mut p.value, g)?,
                }
                param_idx += 1;
            }
            // With ZeRO-1 every node refreshes once, after the broadcast below.
            if zero.is_none()
                && let Err(error) = layer.refresh()
            {
                tracing::warn!(node = %name, %error, "derived copies not refreshed; the layer runs without them");
            }
        }
        let Some(zero) = zero else { return Ok(()) };
        let comm = replicas.ok_or_else(|| {
            Error::invalid("ZeRO-1", "a stage with sharded optimizer state has no group of its replicas")
        })?;
        for (node_idx, node) in self.nodes.iter_mut().enumerate() {
            let owner = zero.owners[node_idx];
            for p in node.layer.parameters_mut().iter_mut() {
                comm.broadcast_tensor(&mut p.value, owner)?;
            }
            // `parameters_mut` marked the derived copies stale, the owner's too (its values did
            // not change, but a stale copy is treated as absent, which changes the arithmetic).
            if let Err(error) = node.layer.refresh() {
                tracing::warn!(node = %node.name, %error, "derived copies not refreshed; the layer runs without them");
            }
        }
        Ok(())
    }

    /// Puts back the parameters and optimizer state of the last [`Stage::prepare_commit`], in
    /// O(1) per tensor (swaps, no copies, no allocation). False when the stage keeps no undo
    /// snapshot or holds none from this step: the stage then cannot be rolled back.
    pub fn roll_back(&mut self) -> bool {
        let Some(undo) = self.undo.as_mut().filter(|u| u.valid) else { return false };
        if let Some(lr) = undo.lr.take() {
            // The rate this step replaced, which the optimizer accepted before.
            let restored = self.optimizer.set_lr(lr);
            debug_assert!(restored.is_ok(), "a rate the optimizer held is refused: {restored:?}");
        }
        let mut param_idx = 0;
        for node in &mut self.nodes {
            for p in node.layer.parameters_mut() {
                if std::mem::take(&mut undo.holds_old[param_idx]) {
                    std::mem::swap(&mut p.value, &mut undo.params[param_idx]);
                    self.optimizer.unswap(param_idx, &mut undo.optimizer);
                }
                param_idx += 1;
            }
            // The parameters are back whatever refresh does: a layer whose parameters were handed
            // out by `parameters_mut` ignores its derived copies until a refresh succeeds.
            let refreshed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| node.layer.refresh()));
            if !matches!(refreshed, Ok(Ok(()))) {
                tracing::warn!(node = %node.name, "derived copies not refreshed after a rollback");
            }
        }
        undo.valid = false;
        true
    }

    /// `(node.param, tensor)` for every parameter of the stage.
    pub fn named_parameters(&self) -> impl Iterator<Item = (String, &Tensor)> {
        self.nodes
            .iter()
            .flat_map(|n| n.layer.parameters().iter().map(move |p| (format!("{}.{}", n.name, p.name), &p.value)))
    }
}

/// ZeRO-1 for one stage of one replica: the replica that updates each node's parameters.
#[derive(Clone, Debug)]
pub(crate) struct ZeroShards {
    /// This stage's replica.
    pub replica: usize,
    /// Per node of the stage (in stage order), the replica that owns it.
    pub owners: Vec<usize>,
}

impl ZeroShards {
    /// Owners for `node_bytes` (each node's parameter bytes) over `replicas`: each node in turn
    /// to the replica with the fewest bytes so far (the lowest index on a tie), the same on every
    /// replica.
    pub fn balanced(replica: usize, replicas: usize, node_bytes: &[u64]) -> ZeroShards {
        ZeroShards { replica, owners: crate::placement::zero_owners(replicas, node_bytes) }
    }

    /// Whether this replica updates node `node_idx`.
    pub fn owns(&self, node_idx: usize) -> bool {
        self.owners.get(node_idx) == Some(&self.replica)
    }

    /// Per parameter of `nodes` (in stage order), whether this replica updates it.
    pub fn owned_params(&self, nodes: &[NodeExec]) -> Vec<bool> {
        nodes
            .iter()
            .enumerate()
            .flat_map(|(i, n)| std::iter::repeat_n(self.owns(i), n.layer.parameters().len()))
            .collect()
    }
}

/// A stage's vote in the commit: the sum of squares of its gradients and the first parameter
/// whose gradient is not finite, if any.
#[derive(Debug)]
pub(crate) struct StageVote {
    pub sum_of_squares: f64,
    pub non_finite_parameter: Option<String>,
}

/// A stage's undo snapshot for the commit: a spare for every parameter and optimizer-state
/// buffer, reserved in the prepare phase (only the first step allocates). The apply phase writes
/// the new values into the spares and swaps them in ([`Optimizer::apply_swapping`]), so afterwards
/// the spares hold the old values, and [`Stage::roll_back`] swaps them back, in O(1) per tensor.
#[derive(Debug, Default)]
pub(crate) struct UndoSnapshot {
    params: Vec<Tensor>,
    optimizer: crate::optim::StateSnapshot,
    /// Per parameter: its spare (and its state's) hold the values from before this step's update.
    holds_old: Vec<bool>,
    /// Reserved in this step's prepare phase (a rollback only ever undoes the current step).
    valid: bool,
    /// The learning rate before this step set its own ([`Stage::apply_commit`]'s `lr`).
    lr: Option<f64>,
}

impl UndoSnapshot {
    fn reserve<'a>(&mut self, params: impl Iterator<Item = &'a Tensor>, optimizer: &Optimizer) -> Result<()> {
        self.valid = false;
        let mut n = 0;
        for (i, param) in params.enumerate() {
            let fits = |t: &Tensor| t.shape() == param.shape() && t.device().same_device(param.device());
            match self.params.get_mut(i) {
                Some(spare) if fits(spare) => {}
                Some(spare) => *spare = Tensor::zeros(param.shape().clone(), param.dtype(), param.device())?,
                None => self.params.push(Tensor::zeros(param.shape().clone(), param.dtype(), param.device())?),
            }
            n = i + 1;
        }
        self.params.truncate(n);
        self.holds_old.clear();
        self.holds_old.resize(n, false);
        self.lr = None;
        self.optimizer.reserve(optimizer)?;
        self.valid = true;
        Ok(())
    }
}

fn accumulate(slot: &mut Option<Tensor>, grad: Tensor) -> Result<()> {
    match slot {
        Some(existing) => add_gradient(existing, &grad),
        None => {
            *slot = Some(grad);
            Ok(())
        }
    }
}

/// `existing += grad`. Under a mixed precision two consumers of one output may hand back
/// gradients of different dtypes (a product's half type, an fp32-list op's f32): both are then
/// summed in f32, and so is a pair of half gradients (f32 sums, as every op here).
fn add_gradient(existing: &mut Tensor, grad: &Tensor) -> Result<()> {
    if existing.dtype() == crate::DType::F32 && grad.dtype() == crate::DType::F32 {
        return existing.add_assign(grad);
    }
    let mut sum = existing.to_dtype(crate::DType::F32)?;
    sum.add_assign(&grad.to_dtype(crate::DType::F32)?)?;
    *existing = if existing.dtype() == grad.dtype() { sum.into_dtype(grad.dtype())? } else { sum };
    Ok(())
}
