//! A symbolic replay of one micro-batch through a stage, step for step as `runtime/stage.rs` runs
//! it, over storages with reference counts (a share costs nothing, the last release frees the
//! bytes, a write to shared bytes copies them first), giving what the micro-batch holds between
//! ops and the most it holds during each.
//!
//! **Keep in step with `runtime/stage.rs`**: which outputs a forward keeps (those sent on and the
//! graph output), the loss gradient kept until the backward, one message per route (copies for
//! all but the last), inputs kept only for recomputation, every output gradient kept from the
//! input-gradient pass to the weight pass, gradients accumulated in place unless shared, and
//! what a layer's input-gradient call leaves for its weight call (`NodeMemory::backward_held`,
//! held until the micro-batch's weight pass ends).
use super::{InputGradMemory, NodeMemory, OutputMemory, Rank, SavedMemory, at};

/// Where a node's input comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StageInput {
    /// The output of the stage's `j`-th node.
    Local(usize),
    /// The `i`-th received tensor (from an earlier stage).
    Received(usize),
    /// The `i`-th data input (a graph input: takes no gradient).
    Data(usize),
}

/// A stage as the replay needs it.
#[derive(Clone, Debug)]
pub(crate) struct StageShape<'a> {
    /// The nodes in execution order, for micro-batches of the planned rows.
    pub nodes: Vec<&'a NodeMemory>,
    /// Per node, its inputs in input order.
    pub inputs: Vec<Vec<StageInput>>,
    /// Per node, how many other stages receive its output (each gets its own message and sends
    /// its own gradient back).
    pub routes: Vec<usize>,
    /// The node whose output is the graph's (its loss is computed here).
    pub output_node: Option<usize>,
    /// Bytes per micro-batch of each received tensor.
    pub received: Vec<u64>,
    /// Bytes per micro-batch of each data input.
    pub data: Vec<u64>,
    /// Devices of the stage's group (1 without tensor parallelism).
    pub n_ranks: usize,
    /// Under a mixed precision the runtime sums two gradients of one output through f32 copies
    /// (`runtime/stage.rs`, `add_gradient`) instead of in place.
    pub half_gradient_sums: bool,
}

/// What one micro-batch holds on a stage, per rank (all byte counts per micro-batch).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct StageFootprint {
    /// After its forward, activations kept for the backward.
    pub stash_forward: Vec<u64>,
    /// After its forward with recomputation: the kept inputs (and the loss gradient).
    pub stash_kept: Vec<u64>,
    /// After its input-gradient pass, before the weight pass: saved tensors and output gradients.
    pub stash_backward: Vec<u64>,
    /// Most held during the forward, inputs included.
    pub peak_forward: Vec<u64>,
    /// Most held during an evaluation step's forward: the same but for an output layer that
    /// computes its own loss in training, which runs its plain forward there (its output, not
    /// the loss's state).
    pub peak_evaluation: Vec<u64>,
    /// Most held during the input-gradient pass, from the forward's stash and the received
    /// gradients to the gradients sent on.
    pub peak_backward_input: Vec<u64>,
    /// The same for a recomputed micro-batch (the recomputation included).
    pub peak_backward_input_recompute: Vec<u64>,
    /// Most held during the weight pass (from the backward's stash).
    pub peak_backward_weight: Vec<u64>,
    /// The gradients the input-gradient pass sends to producer stages: a fused backward holds
    /// them through its weight pass (`Stage::backward_input` returns them when both are done).
    pub sent_backward: Vec<u64>,
}

impl StageFootprint {
    /// Most held during a fused backward (input-gradient and weight passes in one op, the
    /// gradients for producer stages sent after both).
    pub fn peak_backward(&self, recompute: bool) -> Vec<u64> {
        let input = if recompute { &self.peak_backward_input_recompute } else { &self.peak_backward_input };
        input
            .iter()
            .zip(&self.peak_backward_weight)
            .zip(&self.sent_backward)
            .map(|((a, b), sent)| (*a).max(b + sent))
            .collect()
    }
}

type Sid = usize;

/// Storages with reference counts, bytes in use and the peak, per rank.
struct Arena {
    storages: Vec<(Rank, u64, u32)>,
    live: Vec<u64>,
    peak: Vec<u64>,
    /// [`StageShape::half_gradient_sums`].
    half_sums: bool,
}

impl Arena {
    fn new(n_ranks: usize, half_sums: bool) -> Self {
        Arena { storages: Vec::new(), live: vec![0; n_ranks], peak: vec![0; n_ranks], half_sums }
    }

    fn alloc(&mut self, rank: Rank, bytes: u64) -> Sid {
        let rank = rank.min(self.live.len() - 1);
        self.storages.push((rank, bytes, 1));
        self.live[rank] += bytes;
        self.note();
        self.storages.len() - 1
    }

    fn share(&mut self, sid: Sid) -> Sid {
        self.storages[sid].2 += 1;
        sid
    }

    fn release(&mut self, sid: Sid) {
        let (rank, bytes, refs) = &mut self.storages[sid];
        *refs -= 1;
        if *refs == 0 {
            self.live[*rank] -= *bytes;
        }
    }

    fn bytes(&self, sid: Sid) -> u64 {
        self.storages[sid].1
    }

    fn note(&mut self) {
        for (p, l) in self.peak.iter_mut().zip(&self.live) {
            *p = (*p).max(*l);
        }
    }

    /// A call reserving up to `extra` beyond what is in use now.
    fn note_call(&mut self, extra: &[u64]) {
        for (rank, (p, l)) in self.peak.iter_mut().zip(&self.live).enumerate() {
            *p = (*p).max(l + at(extra, rank));
        }
    }

    fn reset_peak(&mut self) {
        self.peak.clone_from(&self.live);
    }

    /// `slot += grad` as `runtime/stage.rs` accumulates: the first gradient is moved in; a later
    /// one is added in place, after copying the slot's bytes if they are shared. Under a mixed
    /// precision both are copied to f32 (at most twice their bytes each), summed there and the
    /// sum rounded back into a new tensor (the slot's dtype when both share it, else f32).
    fn accumulate(&mut self, slot: &mut Option<Sid>, grad: Sid) {
        match *slot {
            None => *slot = Some(grad),
            Some(existing) if self.half_sums => {
                let (rank, e, g) = (self.storages[existing].0, self.bytes(existing), self.bytes(grad));
                let mut extra = vec![0; self.live.len()];
                extra[rank] = 2 * e + 2 * g + 2 * e.max(g);
                self.note_call(&extra);
                let sum = if e == g { e } else { 2 * e.max(g) };
                self.release(existing);
                self.release(grad);
                *slot = Some(self.alloc(rank, sum));
            }
            Some(existing) => {
                if self.storages[existing].2 > 1 {
                    let copy = self.alloc(self.storages[existing].0, self.bytes(existing));
                    self.release(existing);
                    *slot = Some(copy);
                }
                self.release(grad);
            }
        }
    }
}

/// One micro-batch's state on the stage between ops.
struct MicroBatch {
    kept_inputs: Vec<Sid>,
    saved: Vec<Vec<Sid>>,
    grad_out: Vec<Option<Sid>>,
    /// What input-gradient calls left for the weight calls.
    held: Vec<Sid>,
}

/// The stage's inputs of one micro-batch, as they arrive: received tensors, then data.
fn arrive(arena: &mut Arena, shape: &StageShape<'_>) -> (Vec<Sid>, Vec<Sid>) {
    let received = shape.received.iter().map(|&b| arena.alloc(0, b)).collect();
    let data = shape.data.iter().map(|&b| arena.alloc(0, b)).collect();
    (received, data)
}

/// `Stage::run_layers`: every node's forward, all outputs held until the end; returns the saved
/// shares per node and the outputs something needs (sent on, or the graph output). The graph's
/// output node, when it computes the loss itself and nothing else reads its output
/// ([`NodeMemory::own_loss`]), holds what that call saves and leaves an output of no bytes.
fn run_layers(
    arena: &mut Arena,
    shape: &StageShape<'_>,
    received: &[Sid],
    data: &[Sid],
) -> (Vec<Vec<Sid>>, Vec<Option<Sid>>) {
    let mut values: Vec<Sid> = Vec::with_capacity(shape.nodes.len());
    let mut saved = Vec::with_capacity(shape.nodes.len());
    for (j, node) in shape.nodes.iter().enumerate() {
        let args: Vec<Sid> = shape.inputs[j]
            .iter()
            .map(|input| match *input {
                StageInput::Local(k) => values[k],
                StageInput::Received(i) => received[i],
                StageInput::Data(i) => data[i],
            })
            .collect();
        let own_loss = node.own_loss.as_ref().filter(|_| own_loss_at(shape) == Some(j));
        let (forward_peak, node_saves) = match own_loss {
            Some(own) => (&own.forward_peak, &own.saved),
            None => (&node.forward_peak, &node.saved),
        };
        arena.note_call(forward_peak);
        let out = match (own_loss, &node.output) {
            (Some(_), _) => arena.alloc(0, 0),
            (None, OutputMemory::New(bytes)) => arena.alloc(0, *bytes),
            (None, OutputMemory::ShareOfInput(i)) => arena.share(args[*i]),
        };
        let node_saved = node_saves
            .iter()
            .map(|s| match *s {
                SavedMemory::Input(i) => arena.share(args[i]),
                SavedMemory::Output => arena.share(out),
                SavedMemory::Own { rank, bytes } => arena.alloc(rank, bytes),
            })
            .collect();
        values.push(out);
        saved.push(node_saved);
    }
    arena.note();
    let outputs = values
        .into_iter()
        .enumerate()
        .map(|(j, value)| {
            if shape.routes[j] > 0 || shape.output_node == Some(j) {
                Some(value)
            } else {
                arena.release(value);
                None
            }
        })
        .collect();
    (saved, outputs)
}

/// The stage's node that computes the loss itself (`Stage::forward`'s rule): the graph's output
/// node, when its layer offers to ([`NodeMemory::own_loss`]) and no other stage reads its output.
fn own_loss_at(shape: &StageShape<'_>) -> Option<usize> {
    shape.output_node.filter(|&o| shape.routes[o] == 0 && shape.nodes[o].own_loss.is_some())
}

/// `Stage::forward` in training, then the sends.
fn forward(arena: &mut Arena, shape: &StageShape<'_>, recompute: bool) -> MicroBatch {
    let (received, data) = arrive(arena, shape);
    let (saved, mut outputs) = run_layers(arena, shape, &received, &data);
    let mut grad_out: Vec<Option<Sid>> = vec![None; shape.nodes.len()];
    if let Some(o) = shape.output_node {
        let value = outputs[o].expect("the output node's value is kept");
        let output = if shape.routes[o] > 0 {
            arena.alloc(0, arena.bytes(value))
        } else {
            outputs[o] = None;
            value
        };
        // The loss gradient has the output's shape; the gradient of a loss a layer computed
        // itself is one f32.
        let grad_bytes = if own_loss_at(shape).is_some() { 4 } else { arena.bytes(output) };
        grad_out[o] = Some(arena.alloc(0, grad_bytes));
        arena.release(output);
    }
    // One message per route: copies for all but the last.
    let mut messages = Vec::new();
    for (j, value) in outputs.into_iter().enumerate() {
        let Some(value) = value else { continue };
        for _ in 1..shape.routes[j] {
            messages.push(arena.alloc(0, arena.bytes(value)));
        }
        messages.push(value);
    }
    arena.note();
    let mut state = MicroBatch { kept_inputs: Vec::new(), saved, grad_out, held: Vec::new() };
    if recompute {
        state.kept_inputs = received.into_iter().chain(data).collect();
        for sid in std::mem::take(&mut state.saved).into_iter().flatten() {
            arena.release(sid);
        }
    } else {
        received.into_iter().chain(data).for_each(|sid| arena.release(sid));
    }
    // Sent: the bytes move to the receivers.
    messages.into_iter().for_each(|sid| arena.release(sid));
    state
}

/// `Stage::recompute` (when the saved state was dropped) and `Stage::backward_input`; returns the
/// gradients to send (the caller releases them when they are sent).
fn backward_input(arena: &mut Arena, shape: &StageShape<'_>, state: &mut MicroBatch) -> Vec<Sid> {
    // The gradients may arrive while the micro-batch is recomputed.
    let mut received: Vec<(usize, Sid)> = Vec::new();
    for (j, node) in shape.nodes.iter().enumerate() {
        for _ in 0..shape.routes[j] {
            received.push((j, arena.alloc(0, node.output_bytes)));
        }
    }
    if state.saved.is_empty() {
        let n_received = shape.received.len();
        let inputs = std::mem::take(&mut state.kept_inputs);
        let (saved, outputs) = run_layers(arena, shape, &inputs[..n_received], &inputs[n_received..]);
        outputs.into_iter().flatten().for_each(|sid| arena.release(sid));
        inputs.into_iter().for_each(|sid| arena.release(sid));
        state.saved = saved;
    }
    for (j, grad) in received {
        let mut slot = state.grad_out[j];
        arena.accumulate(&mut slot, grad);
        state.grad_out[j] = slot;
    }
    let mut outgoing: Vec<Option<Sid>> = vec![None; shape.received.len()];
    for j in (0..shape.nodes.len()).rev() {
        let node = shape.nodes[j];
        let Some(grad) = state.grad_out[j] else { continue };
        arena.note_call(&node.backward_input_peak);
        for (rank, &bytes) in node.backward_held.iter().enumerate() {
            if bytes > 0 {
                let sid = arena.alloc(rank, bytes);
                state.held.push(sid);
            }
        }
        let results: Vec<Option<Sid>> = node
            .input_grads
            .iter()
            .map(|g| match *g {
                InputGradMemory::None => None,
                InputGradMemory::New(bytes) => Some(arena.alloc(0, bytes)),
                InputGradMemory::ShareOfGradOutput => Some(arena.share(grad)),
            })
            .collect();
        for (input, result) in shape.inputs[j].iter().zip(results) {
            let Some(result) = result else { continue };
            match *input {
                StageInput::Local(k) => {
                    let mut slot = state.grad_out[k];
                    arena.accumulate(&mut slot, result);
                    state.grad_out[k] = slot;
                }
                StageInput::Received(i) => {
                    let mut slot = outgoing[i];
                    arena.accumulate(&mut slot, result);
                    outgoing[i] = slot;
                }
                StageInput::Data(_) => arena.release(result),
            }
        }
        arena.note();
    }
    outgoing.into_iter().flatten().collect()
}

/// `Stage::backward_weight`: each node's weight pass, then the micro-batch's state is freed (a
/// layer frees what its input-gradient call left when its weight call returns; holding it to the
/// end of the pass keeps the bound simple and costs nothing at the pass's peak, its start).
fn backward_weight(arena: &mut Arena, shape: &StageShape<'_>, state: MicroBatch) {
    for node in &shape.nodes {
        arena.note_call(&node.backward_weight_peak);
    }
    let MicroBatch { kept_inputs, saved, grad_out, held } = state;
    kept_inputs
        .into_iter()
        .chain(saved.into_iter().flatten())
        .chain(grad_out.into_iter().flatten())
        .chain(held)
        .for_each(|sid| arena.release(sid));
}

/// The footprint of one micro-batch on a stage of this shape.
pub(crate) fn footprint(shape: &StageShape<'_>) -> StageFootprint {
    let k = shape.n_ranks.max(1);
    // Kept activations: forward, input-gradient pass, weight pass.
    let mut arena = Arena::new(k, shape.half_gradient_sums);
    let mut state = forward(&mut arena, shape, false);
    let peak_forward = arena.peak.clone();
    let stash_forward = arena.live.clone();
    arena.reset_peak();
    let sent = backward_input(&mut arena, shape, &mut state);
    let peak_backward_input = arena.peak.clone();
    let with_sent = arena.live.clone();
    sent.into_iter().for_each(|sid| arena.release(sid));
    let stash_backward = arena.live.clone();
    let sent_backward = with_sent.iter().zip(&stash_backward).map(|(w, s)| w - s).collect();
    arena.reset_peak();
    backward_weight(&mut arena, shape, state);
    let peak_backward_weight = arena.peak.clone();
    // An evaluation step's forward computes no loss.
    let mut arena = Arena::new(k, shape.half_gradient_sums);
    forward(&mut arena, &StageShape { output_node: None, ..shape.clone() }, false);
    let peak_evaluation = arena.peak.clone();
    // Recomputation.
    let mut arena = Arena::new(k, shape.half_gradient_sums);
    let mut state = forward(&mut arena, shape, true);
    let stash_kept = arena.live.clone();
    arena.reset_peak();
    backward_input(&mut arena, shape, &mut state);
    let peak_backward_input_recompute = arena.peak.clone();
    StageFootprint {
        stash_forward,
        stash_kept,
        stash_backward,
        peak_forward,
        peak_evaluation,
        peak_backward_input,
        peak_backward_input_recompute,
        peak_backward_weight,
        sent_backward,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::memory::OwnLossMemory;

    fn linear(input: u64, output: u64) -> NodeMemory {
        NodeMemory {
            rows: 1,
            output: OutputMemory::New(output),
            output_bytes: output,
            saved: vec![SavedMemory::Input(0)],
            forward_peak: vec![output],
            input_grads: vec![InputGradMemory::New(input)],
            backward_input_peak: vec![input],
            backward_weight_peak: vec![0],
            backward_held: vec![0],
            params: vec![0],
            own_loss: None,
        }
    }

    fn relu(bytes: u64) -> NodeMemory {
        NodeMemory {
            rows: 1,
            output: OutputMemory::New(bytes),
            output_bytes: bytes,
            saved: vec![SavedMemory::Output],
            forward_peak: vec![bytes],
            input_grads: vec![InputGradMemory::New(bytes)],
            backward_input_peak: vec![bytes],
            backward_weight_peak: vec![0],
            backward_held: vec![0],
            params: vec![0],
            own_loss: None,
        }
    }

    /// Linear(100 -> 10 bytes) then ReLU, received input, output sent on: the stash is the
    /// received input (saved by the Linear) and the ReLU output (saved by the ReLU, also sent).
    #[test]
    fn shares_are_counted_once() {
        let (l, r) = (linear(100, 10), relu(10));
        let shape = StageShape {
            nodes: vec![&l, &r],
            inputs: vec![vec![StageInput::Received(0)], vec![StageInput::Local(0)]],
            routes: vec![0, 1],
            output_node: None,
            received: vec![100],
            data: Vec::new(),
            n_ranks: 1,
            half_gradient_sums: false,
        };
        let f = footprint(&shape);
        assert_eq!(f.stash_forward, vec![110]);
        assert_eq!(f.stash_kept, vec![100]);
        // Input 100 + Linear output 10 + ReLU output 10 (the message).
        assert_eq!(f.peak_forward, vec![120]);
        // Backward: stash 110 + received gradient 10, then the ReLU's input gradient 10 and the
        // Linear's 100 (sent).
        assert_eq!(f.peak_backward_input, vec![230]);
        // Kept: saved 110 and output gradients 10 + 10.
        assert_eq!(f.stash_backward, vec![130]);
        // A fused backward still holds the Linear's input gradient (100, sent after the weight
        // pass) while the weight pass runs.
        assert_eq!(f.sent_backward, vec![100]);
        assert_eq!(f.peak_backward(false), vec![230.max(f.peak_backward_weight[0] + 100)]);
    }

    /// A layer whose input-gradient call leaves 40 bytes for its weight call (attention's
    /// dq/dk/dv): they are held from that call, through the stash between the passes, to the
    /// end of the weight pass, and they are in the input-gradient call's peak.
    #[test]
    fn bytes_left_for_the_weight_call_are_held_between_the_passes() {
        let mut l = linear(100, 10);
        let plain = linear(100, 10);
        l.backward_held = vec![40];
        l.backward_input_peak = vec![100 + 40];
        let shape_of = |node| StageShape {
            nodes: vec![node],
            inputs: vec![vec![StageInput::Received(0)]],
            routes: vec![1],
            output_node: None,
            received: vec![100],
            data: Vec::new(),
            n_ranks: 1,
            half_gradient_sums: false,
        };
        let (with, without) = (footprint(&shape_of(&l)), footprint(&shape_of(&plain)));
        assert_eq!(with.stash_forward, without.stash_forward);
        assert_eq!(with.stash_backward[0], without.stash_backward[0] + 40);
        assert_eq!(with.peak_backward_input[0], without.peak_backward_input[0] + 40);
        assert_eq!(with.peak_backward_weight[0], without.peak_backward_weight[0] + 40);
        assert_eq!(with.sent_backward, without.sent_backward);
    }

    /// A split output layer that computes the loss itself (logits of 80 bytes over two ranks):
    /// instead of its 80-byte output and the loss gradient of the same size on rank 0, each rank
    /// holds its 40 bytes of logit gradient and rank 0 a loss gradient of 4 bytes. Routed to
    /// another stage too, the output is needed and the node runs as usual.
    #[test]
    fn an_output_layer_computing_its_own_loss_holds_its_logit_gradients_on_their_ranks() {
        let mut head = linear(100, 80);
        head.own_loss = Some(OwnLossMemory {
            saved: vec![
                SavedMemory::Input(0),
                SavedMemory::Own { rank: 0, bytes: 40 },
                SavedMemory::Own { rank: 1, bytes: 40 },
            ],
            forward_peak: vec![40, 40],
        });
        let shape_of = |routes| StageShape {
            nodes: vec![&head],
            inputs: vec![vec![StageInput::Received(0)]],
            routes: vec![routes],
            output_node: Some(0),
            received: vec![100],
            data: Vec::new(),
            n_ranks: 2,
            half_gradient_sums: false,
        };
        let own = footprint(&shape_of(0));
        // Rank 0: the input (saved) 100, its logit gradient 40 and the loss gradient 4.
        assert_eq!(own.stash_forward, vec![144, 40]);
        let routed = footprint(&shape_of(1));
        // The plain forward: the input 100 and the loss gradient 80.
        assert_eq!(routed.stash_forward, vec![180, 0]);
        // An evaluation step computes no loss: the head's plain forward, its 80-byte output on
        // rank 0 beside the received 100 (the own-loss call would have held 140 there).
        assert_eq!(own.peak_evaluation, vec![180, 0]);
        assert_eq!(own.peak_forward, vec![144, 40]);
    }
}
