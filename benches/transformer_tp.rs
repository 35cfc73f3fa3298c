//! Tensor parallelism for the transformer on two cores: a transformer large enough for the split
//! to pay (`transformer:64,64,256,8,2,10`, D = 256, 8 heads, 2 blocks, 1.6 M parameters; batch 32
//! sequences of 64 tokens, Adam) trained on one device, split by `--tensor-parallel 2` over
//! `cpu:2` (attention by heads, the MLP block as one `ParallelMlp` node: column-then-row with its
//! hidden activation kept on its shard, the head column-parallel), the same with
//! `--sequence-parallel` (each block one `ParallelTransformerBlock` node, its LayerNorm and
//! residual regions split by tokens), and as a
//! 2-stage 1F1B pipeline of 4 micro-batches for comparison; then each block's communication, with
//! and without sequence parallelism: the
//! exact collectives a split block makes per step (broadcasts, scatters, all-reduces and
//! all-gathers of its activations, as the layers' docs list them) replayed alone on a 2-rank
//! in-process group on the same cores (measured), against `collective::cost_s` on
//! `Link::default()` (predicted, what the planner and the simulator use).
//!
//! Run: `cargo bench --bench transformer_tp` (`CONVEYOR_BENCH_STEPS=N` timed steps per round).
//! The configurations run in interleaved rounds; the table gives each one's median step over all
//! rounds and the medians of the per-round ratios to one device.
#[path = "support/mod.rs"]
mod support;

use std::sync::{Arc, Barrier};
use std::time::Instant;

use conveyor::engine::collective::{CollectiveOp, Communicator, Partition, ProcessGroup, cost_s};
use conveyor::engine::optim::OptimizerConfig;
use conveyor::engine::placement::Link;
use conveyor::engine::runtime::Trainer;
use conveyor::engine::{DType, Device, Tensor};
use conveyor::layers::CrossEntropyLoss;
use conveyor::schedules::ScheduleKind;
use conveyor::zoo::{ModelSpec, TensorParallelSplits, TransformerConfig};

const ROUNDS: usize = 5;
const WARMUP: usize = 2;
const ROWS: usize = 32;
const CONFIG: TransformerConfig = TransformerConfig {
    vocab: 64,
    tokens: 64,
    dim: 256,
    n_heads: 8,
    n_layers: 2,
    classes: 10,
    tied: false,
    sequence_parallel: false,
};

fn spec() -> ModelSpec {
    ModelSpec::Transformer(CONFIG)
}

fn sequence_parallel_spec() -> ModelSpec {
    ModelSpec::Transformer(TransformerConfig { sequence_parallel: true, ..CONFIG })
}

/// Seeded token ids and labels.
fn batch() -> (Tensor, Vec<usize>) {
    let ids = (0..ROWS * CONFIG.tokens).map(|i| ((i * 13 + i / 7) % CONFIG.vocab) as f32).collect();
    let labels = (0..ROWS).map(|r| (r * 7 + 3) % CONFIG.classes).collect();
    (Tensor::from_vec(ids, [ROWS, CONFIG.tokens], &Device::host()).unwrap(), labels)
}

/// One device; `k` devices with every node split over them; or a 2-stage pipeline.
fn trainer(config: &str) -> Trainer {
    let whole = spec().build(3).unwrap();
    let layers: Vec<_> =
        whole.topological_order().unwrap().into_iter().filter(|&id| whole.layer(id).is_some()).collect();
    let builder = |graph, devices: Vec<Device>, stages: Vec<Vec<_>>, kind, micro_batches| {
        Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
            .devices(devices)
            .stages(stages)
            .schedule(kind, 1)
            .micro_batches(micro_batches)
            .optimizer(OptimizerConfig::adam(1e-4))
    };
    match config {
        "1 device" => builder(whole, vec![Device::cpu(0)], vec![layers], ScheduleKind::GPipe, 1).build().unwrap(),
        "tensor-parallel 2" | "tensor-parallel 2, sequence-parallel" => {
            // The tensor-parallel form: each MLP block (each block, with sequence parallelism) is
            // one node.
            let spec = if config == "tensor-parallel 2" { spec() } else { sequence_parallel_spec() };
            let form = spec.build_split(3, &TensorParallelSplits::new()).unwrap();
            let layers: Vec<_> =
                form.topological_order().unwrap().into_iter().filter(|&id| form.layer(id).is_some()).collect();
            let devices = vec![Device::cpu(0), Device::cpu(1)];
            let mut splits = TensorParallelSplits::new();
            for &id in &layers {
                splits.insert(form.node(id).unwrap().name.clone(), devices.clone());
            }
            let graph = spec.build_split(3, &splits).unwrap();
            builder(graph, devices, vec![layers], ScheduleKind::GPipe, 1).tensor_parallel(2).build().unwrap()
        }
        _ => {
            let half = layers.len() / 2;
            let stages = vec![layers[..half].to_vec(), layers[half..].to_vec()];
            builder(whole, vec![Device::cpu(0), Device::cpu(1)], stages, ScheduleKind::OneFOneB, 4).build().unwrap()
        }
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The collectives one split block makes per step on one micro-batch of `ROWS` sequences, with
/// the elements of each buffer: `a` = rows x T x D activations. (Attention:
/// `ParallelSelfAttention`; the MLP block: `ParallelMlp`, whose 4a hidden activations stay on
/// their shards.)
fn block_collectives() -> Vec<(&'static str, CollectiveOp, usize)> {
    let a = ROWS * CONFIG.tokens * CONFIG.dim;
    use CollectiveOp::*;
    vec![
        ("attn forward: broadcast x", Broadcast, a),
        ("attn forward: all-reduce y", AllReduce, a),
        ("attn input grad: broadcast dy", Broadcast, a),
        ("attn input grad: all-reduce dx", AllReduce, a),
        ("attn weight grad: broadcast dy", Broadcast, a),
        ("mlp forward: broadcast x", Broadcast, a),
        ("mlp forward: all-reduce y", AllReduce, a),
        ("mlp input grad: broadcast dy", Broadcast, a),
        ("mlp input grad: all-reduce dx", AllReduce, a),
        ("mlp weight grad: broadcast dy", Broadcast, a),
    ]
}

/// The same for a sequence-parallel block (`ParallelTransformerBlock`): the input scattered and
/// the output gathered by tokens at the node's edges, an all-gather before and a reduce-scatter
/// after each of the attention and the MLP, and in the weight pass the gathers Megatron's column
/// layers repeat (the LayerNorm outputs, the attention's output gradient). The LayerNorm weights'
/// broadcast and their gradients' all-reduce (4·D floats each) are left out.
fn sequence_parallel_block_collectives() -> Vec<(&'static str, CollectiveOp, usize)> {
    let a = ROWS * CONFIG.tokens * CONFIG.dim;
    use CollectiveOp::*;
    vec![
        ("forward: scatter x by tokens", Scatter, a),
        ("forward: all-gather ln1(x)", AllGather, a),
        ("forward: reduce-scatter attention", ReduceScatter, a),
        ("forward: all-gather ln2(s)", AllGather, a),
        ("forward: reduce-scatter mlp", ReduceScatter, a),
        ("forward: gather the output", Gather, a),
        ("input grad: broadcast dy", Broadcast, a),
        ("input grad: reduce-scatter mlp dx", ReduceScatter, a),
        ("input grad: all-gather ds", AllGather, a),
        ("input grad: reduce-scatter attention dx", ReduceScatter, a),
        ("input grad: gather dx", Gather, a),
        ("weight grad: broadcast dy", Broadcast, a),
        ("weight grad: all-gather ln2(s)", AllGather, a),
        ("weight grad: all-gather ln1(x)", AllGather, a),
        ("weight grad: all-gather ds", AllGather, a),
    ]
}

/// Seconds for one run of `op` on `n` f32 elements over a 2-rank in-process group, each rank on
/// its own thread as the split layers run them, buffers allocated and touched beforehand: from a
/// barrier to the last rank's return (median of `reps`).
fn replay(op: CollectiveOp, n: usize, reps: usize) -> f64 {
    let devices = [Device::cpu(0), Device::cpu(1)];
    let handles = ProcessGroup::new(&devices).unwrap();
    let barrier = Barrier::new(2);
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let spans: Vec<(Instant, Instant)> = std::thread::scope(|scope| {
            let threads: Vec<_> = handles
                .iter()
                .enumerate()
                .map(|(rank, comm)| {
                    let (device, barrier) = (&devices[rank], &barrier);
                    scope.spawn(move || {
                        let parts = Partition::even(n, 2).unwrap();
                        let mut full = Tensor::full(1.0, [n], DType::F32, device).unwrap();
                        let mut block = Tensor::full(1.0, [parts.len(rank)], DType::F32, device).unwrap();
                        barrier.wait();
                        let started = Instant::now();
                        match op {
                            CollectiveOp::Broadcast => comm.broadcast_tensor(&mut full, 0),
                            CollectiveOp::AllReduce => comm.all_reduce_tensor(&mut full),
                            CollectiveOp::Scatter => comm.scatter_tensor(Some(&full), &mut block, 0, &parts),
                            CollectiveOp::Gather => comm.gather_tensor(&block, Some(&mut full), 0, &parts),
                            CollectiveOp::AllGather => comm.all_gather_tensor(&block, &mut full, &parts),
                            CollectiveOp::ReduceScatter => comm.reduce_scatter_tensor(&full, &mut block, &parts),
                            _ => unreachable!("not made by a split block"),
                        }
                        .unwrap();
                        (started, Instant::now())
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let first = spans.iter().map(|s| s.0).min().unwrap();
        let last = spans.iter().map(|s| s.1).max().unwrap();
        times.push((last - first).as_secs_f64());
    }
    median(times)
}

fn main() {
    let steps = support::steps_from_env(3);
    let (x, y) = batch();
    let graph = spec().build(3).unwrap();
    let parameters: usize = graph
        .topological_order()
        .unwrap()
        .into_iter()
        .filter_map(|id| graph.layer(id))
        .flat_map(|layer| layer.parameters().iter().map(|p| p.value.numel()))
        .sum();
    println!(
        "transformer:{},{},{},{},{},{} ({} parameters, {:.1} MB), batch {ROWS} x {} tokens, Adam",
        CONFIG.vocab,
        CONFIG.tokens,
        CONFIG.dim,
        CONFIG.n_heads,
        CONFIG.n_layers,
        CONFIG.classes,
        parameters,
        parameters as f64 * 4.0 / 1e6,
        CONFIG.tokens
    );
    let configs = ["1 device", "tensor-parallel 2", "tensor-parallel 2, sequence-parallel", "2-stage 1F1B, m=4"];
    let mut trainers: Vec<Trainer> = configs.iter().map(|c| trainer(c)).collect();
    let mut all: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    for round in 0..ROUNDS {
        let medians: Vec<f64> = trainers
            .iter_mut()
            .map(|t| median(support::timed_steps(t, &x, &y, WARMUP, steps).into_iter().map(|(s, _)| s).collect()))
            .collect();
        println!(
            "round {}: {}",
            round + 1,
            configs.iter().zip(&medians).map(|(c, m)| format!("{c} {:.1} ms", m * 1e3)).collect::<Vec<_>>().join(", ")
        );
        for (i, m) in medians.iter().enumerate() {
            all[i].push(*m);
            ratios[i].push(medians[0] / m);
        }
    }
    println!("\n| configuration | step (median) | samples/s | speed-up over 1 device (median of per-round ratios) |");
    println!("|---|---|---|---|");
    for (i, config) in configs.iter().enumerate() {
        let step = median(all[i].clone());
        println!("| {config} | {:.1} ms | {:.0} | {:.2}x |", step * 1e3, ROWS as f64 / step, median(ratios[i].clone()));
    }

    for (title, collectives) in
        [("", block_collectives()), (" with sequence parallelism", sequence_parallel_block_collectives())]
    {
        println!("\nCommunication of one split block{title} per step (k = 2, one micro-batch of {ROWS} sequences):");
        println!("| collective | MB | measured (replayed alone) | predicted (Link::default) |");
        println!("|---|---|---|---|");
        let link = Link::default();
        let (mut measured, mut predicted) = (0.0, 0.0);
        for (what, op, n) in collectives {
            let m = replay(op, n, 7);
            let p = cost_s(op, (4 * n) as u64, 2, &link);
            measured += m;
            predicted += p;
            println!("| {what} | {:.2} | {:.3} ms | {:.3} ms |", (4 * n) as f64 / 1e6, m * 1e3, p * 1e3);
        }
        println!("| **per block** | | **{:.2} ms** | **{:.2} ms** |", measured * 1e3, predicted * 1e3);
        println!(
            "{} blocks: {:.1} ms measured, {:.1} ms predicted per step",
            CONFIG.n_layers,
            measured * 1e3 * CONFIG.n_layers as f64,
            predicted * 1e3 * CONFIG.n_layers as f64
        );
    }
}
