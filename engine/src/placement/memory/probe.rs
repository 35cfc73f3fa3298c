//! Measuring a layer's [`NodeMemory`] by running it once: forward, input gradient and weight
//! gradient on one micro-batch, noting which returned and saved tensors are new and which share
//! the layer's inputs or output.
//!
//! Layers on the host are measured by what they return and save (sizes and storage identity):
//! the host's ledger is shared by every thread of the process, so its counts cannot be read for
//! one call. The layers' ops reserve ledger bytes only for the tensors they return (scratch such
//! as im2col columns is plain host memory, off the ledger), so that is what the ledger sees.
//! A layer whose input-gradient call leaves a tensor for its weight call (attention's dq/dk/dv)
//! declares those bytes in [`crate::LayerCost::backward_held_bytes_per_sample`]; the probe adds
//! them to the input-gradient call's peak and to `NodeMemory::backward_held`.
//!
//! Layers whose parameters live on devices (tensor-parallel layers, already built on their group)
//! are measured on those devices' own ledgers, which nothing else uses before the trainer starts.
//! A split layer's call runs one thread per device, and the peak one run reaches depends on how
//! they interleave (a collective's message is reserved on the receiver's ledger when its sender
//! gets there). What counts as the call's working set on a device is the sum over threads of each
//! thread's highest net bytes on that ledger ([`crate::device::ThreadTally::bound`]): each shard
//! reserves and releases in its own program's order whatever the others do, so each thread's
//! highest is the same in every interleaving, and their sum bounds the device at every moment of
//! every interleaving. It counts a message from its send to the end of the call (its sender
//! never releases it): for a split conv's input gradient that is 20 KiB against a worst
//! interleaving of 16 KiB (the old bound, every byte the call reserved, was 28 KiB).
use super::{InputGradMemory, NodeMemory, OutputMemory, OwnLossMemory, Rank, SavedMemory};
use crate::device::ThreadTally;
use crate::graph::{Graph, NodeId};
use crate::{DType, Device, ForwardCtx, Layer, Precision, Result, Saved, Tensor, init};

/// Layers with more parameter bytes than this, or more bytes of inputs and output on one
/// micro-batch, are not run to be measured (see [`measure_node_memory_on`]); their memory figures
/// come from their [`crate::LayerCost`].
pub const MAX_PROBED_PARAMETER_BYTES: u64 = 256 << 20;

/// [`NodeMemory`] of every layer node of `graph` (whose layers are on the host) on micro-batches
/// of `rows` rows, measured by running each once (each with at most
/// `MAX_PROBED_PARAMETER_BYTES` (256 MiB) of parameters, and of inputs and output; larger ones are left out).
pub fn measure_node_memory(graph: &Graph, rows: usize) -> Result<Vec<(NodeId, NodeMemory)>> {
    measure_node_memory_on(graph, rows, |_| None)
}

/// [`measure_node_memory`] under an autocast policy: each layer runs with `precision` in its
/// forward context, on inputs of the dtype its producers' outputs have (graph inputs f32), so a
/// product's half-typed output and saved input are measured at their bytes.
pub fn measure_node_memory_at(graph: &Graph, rows: usize, precision: Precision) -> Result<Vec<(NodeId, NodeMemory)>> {
    measure(graph, rows, precision, None, |_| None, false)
}

/// [`measure_node_memory`] for a graph whose layers are all on `device` (moved there by the
/// caller): every layer runs there on inputs made there, measured on its ledger as split layers
/// are. On a GPU this shows what the ops reserve while they run, scratch included (what
/// [`crate::LayerCost::gpu_scratch_bytes_per_sample`] declares); `device`'s ledger must not be
/// in use by anything else meanwhile.
pub fn measure_node_memory_on_device(graph: &Graph, rows: usize, device: &Device) -> Result<Vec<(NodeId, NodeMemory)>> {
    measure(graph, rows, Precision::F32, Some(device), |_| None, false)
}

/// [`measure_node_memory`] for a graph whose tensor-parallel layers are already built on their
/// devices: `group_of(node)` gives the devices of the node's stage (the first one is where its
/// inputs arrive). Layers with parameters off the host are measured on those devices' ledgers,
/// which must not be in use by anything else meanwhile.
pub fn measure_node_memory_on(
    graph: &Graph,
    rows: usize,
    group_of: impl Fn(NodeId) -> Option<Vec<Device>>,
) -> Result<Vec<(NodeId, NodeMemory)>> {
    measure(graph, rows, Precision::F32, None, group_of, false)
}

/// [`measure_node_memory_on`] for a trainer whose loss is softmax cross-entropy
/// ([`crate::Loss::is_softmax_cross_entropy`]): the graph's output node, when its layer computes
/// that loss itself ([`Layer::forward_cross_entropy`], a vocabulary-parallel head), is also
/// measured that way ([`NodeMemory::own_loss`]), as a training step runs it.
pub fn measure_node_memory_on_cross_entropy(
    graph: &Graph,
    rows: usize,
    group_of: impl Fn(NodeId) -> Option<Vec<Device>>,
) -> Result<Vec<(NodeId, NodeMemory)>> {
    measure(graph, rows, Precision::F32, None, group_of, true)
}

fn measure(
    graph: &Graph,
    rows: usize,
    precision: Precision,
    every_layer_on: Option<&Device>,
    group_of: impl Fn(NodeId) -> Option<Vec<Device>>,
    cross_entropy: bool,
) -> Result<Vec<(NodeId, NodeMemory)>> {
    let output = graph.output()?;
    // The dtype of each probed node's output, for its consumers' inputs.
    let mut output_dtypes: std::collections::HashMap<NodeId, DType> = std::collections::HashMap::new();
    let rows = rows.max(1);
    let host = Device::host();
    let inputs = graph.inputs();
    let mut rng = init::rng(0x5EED);
    let mut out = Vec::new();
    for id in graph.topological_order()? {
        let Some(layer) = graph.layer(id) else { continue };
        // Running a layer this large would allocate its gradient (and read all its weights) just
        // to measure it: its memory stays the `LayerCost` bound, which holds without measuring.
        let param_bytes: usize = layer.parameters().iter().map(|p| p.value.size_in_bytes()).sum();
        // Likewise a layer whose inputs and output on one micro-batch are that large.
        let cost = graph.cost(id)?;
        let mut data_bytes = cost.output_bytes_per_sample.saturating_mul(rows as u64);
        for pred in graph.predecessors(id) {
            let per_sample = graph.node(pred)?.output_shape.numel() as u64 * 4;
            data_bytes = data_bytes.saturating_add(per_sample.saturating_mul(rows as u64));
        }
        if param_bytes as u64 > MAX_PROBED_PARAMETER_BYTES || data_bytes > MAX_PROBED_PARAMETER_BYTES {
            continue;
        }
        let on_host =
            every_layer_on.is_none() && layer.parameters().iter().all(|p| p.value.device().same_device(&host));
        let group = if let Some(device) = every_layer_on {
            vec![device.clone()]
        } else if on_host {
            vec![host.clone()]
        } else {
            let name = &graph.node(id)?.name;
            group_of(id).ok_or_else(|| {
                crate::Error::invalid(
                    "memory probe",
                    format!("node `{name}` has parameters off the host but no device group"),
                )
            })?
        };
        let predecessors = graph.predecessors(id);
        let mut values = Vec::with_capacity(predecessors.len());
        for pred in &predecessors {
            let shape = graph.node(*pred)?.output_shape.with_leading_dim(rows);
            let dtype = output_dtypes.get(pred).copied().unwrap_or(DType::F32);
            values.push(if layer.takes_indices() {
                // Every id in turn: the weight pass then meets as many distinct ids as a
                // micro-batch can hold (`Layer::index_count`).
                let count = layer.index_count().max(1);
                let ids = (0..shape.numel()).map(|i| (i % count) as f32).collect();
                Tensor::from_vec(ids, shape, &group[0])?
            } else {
                init::uniform(shape, -1.0, 1.0, &mut rng, &group[0])?.into_dtype(dtype)?
            });
        }
        let needed: Vec<bool> = predecessors.iter().map(|p| !inputs.contains(p)).collect();
        // What the input-gradient call leaves for the weight call is declared, not measured: on
        // the host it is neither returned nor saved, and the host's ledger cannot be read for
        // one call.
        let held = cost.backward_held_bytes_per_sample.saturating_mul(rows as u64);
        let (mut memory, output_dtype) = probe(layer, &values, &needed, &group, !on_host, rows, held, precision)?;
        if cross_entropy && id == output {
            memory.own_loss = probe_own_loss(layer, &values, &group, !on_host, rows)?;
        }
        output_dtypes.insert(id, output_dtype);
        out.push((id, memory));
    }
    Ok(out)
}

/// One [`ThreadTally`] per device of the group while a call runs, or none without ledgers.
fn start(group: &[Device], ledger: bool) -> Result<Vec<ThreadTally>> {
    if !ledger {
        return Ok(Vec::new());
    }
    group.iter().map(|d| d.memory().tally_threads()).collect()
}

/// With ledgers: each device's tally bound (at least `floor`); without: `floor`.
fn peaks_or(tallies: Vec<ThreadTally>, floor: &[u64]) -> Vec<u64> {
    if tallies.is_empty() {
        return floor.to_vec();
    }
    tallies.iter().zip(floor).map(|(t, f)| t.bound().max(*f)).collect()
}

/// What `layer`'s [`Layer::forward_cross_entropy`] takes on `inputs` (labels of class 0), or
/// `None` when the layer does not offer it. Its backward calls are bounded by the plain ones
/// [`probe`] measured: they take a one-number gradient instead of the output's.
fn probe_own_loss(
    layer: &dyn Layer,
    inputs: &[Tensor],
    group: &[Device],
    ledger: bool,
    rows: usize,
) -> Result<Option<OwnLossMemory>> {
    let refs: Vec<&Tensor> = inputs.iter().collect();
    let labels = vec![0; inputs.first().map_or(rows, |x| x.numel() / x.dims().last().copied().unwrap_or(1).max(1))];
    let in_use_before: Vec<u64> = group.iter().map(Device::memory_in_use).collect();
    let tallies = start(group, ledger)?;
    let Some(own_loss) = layer.forward_cross_entropy(&refs, &labels, rows as f32, &ForwardCtx::train(1)) else {
        return Ok(None);
    };
    let (_, saved) = own_loss?;
    let mut new_bytes = vec![0u64; group.len()];
    // No output: nothing saved can share it.
    let no_output = Tensor::zeros([0], DType::F32, &Device::host())?;
    let mut saved_memory = classify_saved(&saved, inputs, &no_output, group, &mut new_bytes);
    let forward_peak = match ledger {
        true => forward_peak_on_ledgers(tallies, group, &in_use_before, &new_bytes, &mut saved_memory),
        false => new_bytes,
    };
    Ok(Some(OwnLossMemory { saved: saved_memory, forward_peak }))
}

/// A forward call's peak per device from its ledgers' `tallies` (at least the `new_bytes` it
/// returned and saved). Bytes the call left reserved beyond those (`in_use_before` the call) are
/// held by the saved state in ways its tensors do not show: they are added to `saved_memory` as
/// the layer's own.
fn forward_peak_on_ledgers(
    tallies: Vec<ThreadTally>,
    group: &[Device],
    in_use_before: &[u64],
    new_bytes: &[u64],
    saved_memory: &mut Vec<SavedMemory>,
) -> Vec<u64> {
    let peaks: Vec<u64> = tallies.iter().map(ThreadTally::bound).collect();
    drop(tallies);
    for (rank, (d, b)) in group.iter().zip(in_use_before).enumerate() {
        let left = d.memory_in_use().saturating_sub(*b);
        if left > new_bytes[rank] {
            saved_memory.push(SavedMemory::Own { rank, bytes: left - new_bytes[rank] });
        }
    }
    peaks.iter().zip(new_bytes).map(|(p, n)| (*p).max(*n)).collect()
}

fn rank_of(group: &[Device], tensor: &Tensor) -> Rank {
    group.iter().position(|d| d.same_device(tensor.device())).unwrap_or(0)
}

#[allow(clippy::too_many_arguments)]
fn probe(
    layer: &dyn Layer,
    inputs: &[Tensor],
    needed: &[bool],
    group: &[Device],
    ledger: bool,
    rows: usize,
    held: u64,
    precision: Precision,
) -> Result<(NodeMemory, DType)> {
    let k = group.len();
    let refs: Vec<&Tensor> = inputs.iter().collect();
    let mut params = vec![0u64; k];
    for p in layer.parameters() {
        params[rank_of(group, &p.value)] += p.value.size_in_bytes() as u64;
    }
    // Under a mixed precision a product rounds its parameters to the half type for the call (a
    // copy on the device's ledger, freed when it returns), in its forward and its input-gradient
    // call, and computes an f32 result it then rounds; the host's ledger cannot show either, so
    // every parameter's half copy and the f32 form of each half result are counted.
    let rounded_parameters = match (precision.half_dtype(), ledger) {
        (Some(half), false) => layer.parameters().iter().map(|p| (p.value.numel() * half.size_in_bytes()) as u64).sum(),
        _ => 0,
    };
    // Forward.
    let in_use_before: Vec<u64> = group.iter().map(Device::memory_in_use).collect();
    let tallies = start(group, ledger)?;
    let (output, saved) = layer.forward(&refs, &ForwardCtx::train(1).with_precision(precision))?;
    let output_dtype = output.dtype();
    let output_memory = match inputs.iter().position(|x| x.shares_storage_with(&output)) {
        Some(i) => OutputMemory::ShareOfInput(i),
        None => OutputMemory::New(output.size_in_bytes() as u64),
    };
    let output_bytes = output.size_in_bytes() as u64;
    let mut new_bytes = vec![0u64; k];
    if let OutputMemory::New(b) = output_memory {
        new_bytes[rank_of(group, &output)] += b;
    }
    let mut saved_memory = classify_saved(&saved, inputs, &output, group, &mut new_bytes);
    let forward_peak = if ledger {
        forward_peak_on_ledgers(tallies, group, &in_use_before, &new_bytes, &mut saved_memory)
    } else {
        // The product's f32 result before it is rounded to a half output, too.
        let f32_result = if output.dtype() == DType::F32 { 0 } else { (output.numel() * 4) as u64 };
        let mut peak = new_bytes.clone();
        peak[0] += rounded_parameters + f32_result;
        peak
    };
    // Input gradient.
    let grad_output = Tensor::full(1.0, output.shape().clone(), output.dtype(), output.device())?;
    drop(output);
    let in_use_before: Vec<u64> = group.iter().map(Device::memory_in_use).collect();
    let tallies = start(group, ledger)?;
    let input_grads = layer.backward_input_for(&saved, &grad_output, needed)?;
    let mut grad_bytes = vec![0u64; k];
    let input_grads_memory: Vec<InputGradMemory> = (0..inputs.len())
        .map(|i| match input_grads.get(i).and_then(Option::as_ref) {
            None => InputGradMemory::None,
            Some(g) if g.shares_storage_with(&grad_output) => InputGradMemory::ShareOfGradOutput,
            Some(g) => {
                grad_bytes[rank_of(group, g)] += g.size_in_bytes() as u64;
                InputGradMemory::New(g.size_in_bytes() as u64)
            }
        })
        .collect();
    let mut floor = grad_bytes.clone();
    // Half input gradients come from f32 results rounded after the product (host layers).
    let f32_results: u64 = match ledger {
        false => input_grads.iter().flatten().filter(|g| g.dtype() != DType::F32).map(|g| (g.numel() * 4) as u64).sum(),
        true => 0,
    };
    floor[0] += held + rounded_parameters + f32_results;
    let backward_input_peak = peaks_or(tallies, &floor);
    // With ledgers, what each device still holds after the call beyond the gradients it returned
    // is held for the weight call too (a split layer's shards each keep their part); on the first
    // device at least what the layer declares.
    let mut backward_held = vec![0u64; k];
    if ledger {
        for (rank, (d, before)) in group.iter().zip(&in_use_before).enumerate() {
            backward_held[rank] = d.memory_in_use().saturating_sub(*before).saturating_sub(grad_bytes[rank]);
        }
    }
    backward_held[0] = backward_held[0].max(held);
    drop(input_grads);
    // Weight gradient, into gradients allocated beside the parameters.
    let mut grads = layer
        .parameters()
        .iter()
        .map(|p| Tensor::zeros(p.value.shape().clone(), p.value.dtype(), p.value.device()))
        .collect::<Result<Vec<_>>>()?;
    let tallies = start(group, ledger)?;
    layer.backward_weight(&saved, &grad_output, &mut grads)?;
    // Without ledgers (the host), what the layer says its weight pass holds apart.
    let mut floor = vec![0; k];
    floor[0] = layer.weight_pass_scratch_bytes();
    let backward_weight_peak = peaks_or(tallies, &floor);
    let memory = NodeMemory {
        rows,
        output: output_memory,
        output_bytes,
        saved: saved_memory,
        forward_peak,
        input_grads: input_grads_memory,
        backward_input_peak,
        backward_weight_peak,
        backward_held,
        params,
        own_loss: None,
    };
    Ok((memory, output_dtype))
}

/// Each saved tensor as a share of an input, of the output, or bytes of its own (counted once
/// per storage), adding the own bytes to `new_bytes` by rank.
fn classify_saved(
    saved: &Saved,
    inputs: &[Tensor],
    output: &Tensor,
    group: &[Device],
    new_bytes: &mut [u64],
) -> Vec<SavedMemory> {
    let mut out = Vec::new();
    let mut own: Vec<&Tensor> = Vec::new();
    for tensor in &saved.tensors {
        if let Some(i) = inputs.iter().position(|x| x.shares_storage_with(tensor)) {
            out.push(SavedMemory::Input(i));
        } else if output.shares_storage_with(tensor) {
            out.push(SavedMemory::Output);
        } else if !own.iter().any(|o| o.shares_storage_with(tensor)) {
            own.push(tensor);
            let rank = rank_of(group, tensor);
            let bytes = tensor.size_in_bytes() as u64;
            new_bytes[rank] += bytes;
            out.push(SavedMemory::Own { rank, bytes });
        }
    }
    out
}
