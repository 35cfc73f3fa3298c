//! The training half of `scripts/gpu-check`: every zoo model trained for `--steps` steps of SGD
//! on the CPU (`cpu:0`, the reference) and on every GPU, from the same seed and the same batches,
//! printed as one table: the step time on each device (median of the steps after the first), the
//! largest norm-wise relative weight difference `‖w_gpu - w_cpu‖ / ‖w_cpu‖` over the parameter
//! tensors after the last step, and whether it is within `--tolerance` (1e-5 by default, f32);
//! and each run's largest measured peak memory over its memory plan's (`peak/plan`: a device's
//! ledger high-water mark over the steps against `Plan::device_peaks`, which must not exceed 1 on
//! a GPU either; the CPU reference row shows the CPU's figure).
//! The element-wise worst case is printed beside it but not held to 1e-5: cuBLAS sums in another
//! order, so a pre-activation within rounding of zero can take the other side of a ReLU on the
//! GPU, and the weights that sample touches then differ by far more than rounding (seen on an
//! H200: 3.5e-3 element-wise, relative to max(|w|, 1e-3), for `mlp:1024,4096,4096,10`). A model
//! that cannot train on a device says why in its row (a layer without a GPU path). The CPU also
//! trains each model in bf16 and f16 (rows `cpu:0 bf16`, `cpu:0 f16`, whose `|dw|/|w|` is their
//! distance from the f32 reference: what the half type itself costs), and each whole GPU gets bf16
//! and f16 rows against the CPU in the same precision. Those are held to
//! `max(--half-tolerance, 2 x the CPU's own half-vs-f32 distance)`: the two runs round the same
//! operands to the same type, but sum the f32 products in another order, and one half-ulp flip
//! early in a step (2^-9 relative for bf16) moves the rest as much as the rounding itself does;
//! a GPU half run as far from the CPU's as that is no less accurate. With `--torch FILE` (lines `MODEL DEVICE MS`, as
//! `scripts/gpu_check_torch.py` writes them) PyTorch's step time for the same model, batch and
//! device is printed beside Conveyor's.
//!
//! Each model also trains tensor-parallel and in two data-parallel replicas (`cpu:0,cpu:1 tp2`,
//! `cpu:0,cpu:1 dp2`; on the first GPU `cuda:0x2 tp2` and `dp2`: two logical devices, one stage,
//! and `cuda:0x4 tp2`: two stages of two), held to the same f32 tolerance and plan. Rows `ovl`
//! train the 2-stage pipelines (`cpu:0,cpu:1`, `cpu:0,cuda:0`, `cuda:0x2`) with overlapped steps
//! (`Trainer::fit`, `conveyor train`'s default), which must give the synchronous run's bits there.
//!
//! Run: `cargo run --release --features cuda --example gpu_check -- [--steps N] [--batch N]
//! [--torch FILE] [MODEL ...]`; exit status 1 when any GPU row fails its tolerance or cannot train, unless
//! `--allow-missing-layers` (which reports a row whose layer has no GPU path instead of failing
//! on it; every zoo layer has one now, and the script still passes it).
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use conveyor::engine::optim::{OptimizerConfig, SgdConfig};
use conveyor::engine::placement::{Placement, Plan};
use conveyor::engine::runtime::{Recompute, Trainer};
use conveyor::engine::{CudaDevice, Device, Precision, Tensor};
use conveyor::layers::CrossEntropyLoss;
use conveyor::pipeline::{DataParallel, PipelineConfig, build_trainer_replicated};
use conveyor::schedules::ScheduleKind;
use conveyor::zoo::ModelSpec;

#[derive(Parser, Debug)]
#[command(about = "Every zoo model trained on the CPU and on every GPU: step times and weight agreement")]
struct Args {
    /// Training steps per run (the first is a warm-up for the timing).
    #[arg(long, default_value_t = 10)]
    steps: u64,
    /// Samples per step.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Largest `‖w_gpu - w_cpu‖ / ‖w_cpu‖` over the parameter tensors that passes.
    #[arg(long, default_value_t = 1e-5)]
    tolerance: f64,
    /// The same for the bf16 and f16 rows, against the CPU in the same precision.
    #[arg(long, default_value_t = 1e-3)]
    half_tolerance: f64,
    /// PyTorch's step times, lines `MODEL DEVICE MS`.
    #[arg(long)]
    torch: Option<PathBuf>,
    /// Rows that cannot train on a GPU (a layer without a GPU path) do not fail the run.
    #[arg(long)]
    allow_missing_layers: bool,
    /// Models to train (zoo specs).
    #[arg(default_values_t = [
        "mlp:64,128,128,10".to_string(), "mlp:1024,4096,4096,10".to_string(),
        "cnn".to_string(), "resnet".to_string(), "transformer".to_string(),
    ])]
    models: Vec<String>,
}

/// What one run produced.
struct Run {
    weights: Vec<(String, Vec<f32>)>,
    step_ms: f64,
    /// The largest measured peak over planned peak of any device (the ledger's high-water mark
    /// over the steps against `Plan::device_peaks`): above 1 the memory plan is not a bound.
    peak_over_plan: f64,
}

/// Seeded inputs for `spec` (token ids for a transformer) and labels in `0..classes`.
fn batch(spec: &ModelSpec, rows: usize, seed: u64) -> Result<(Tensor, Vec<usize>)> {
    let shape = spec.input_shape();
    let per_row: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(2654435761).wrapping_add(1);
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (values, classes): (Vec<f32>, usize) = match spec {
        ModelSpec::Transformer(config) => {
            ((0..rows * per_row).map(|_| (next() % config.vocab as u64) as f32).collect(), config.classes)
        }
        ModelSpec::Mlp(dims) => {
            ((0..rows * per_row).map(|_| (next() % 10_000) as f32 / 5_000.0 - 1.0).collect(), dims[dims.len() - 1])
        }
        ModelSpec::Cnn | ModelSpec::Resnet | ModelSpec::ResnetImages(_) => {
            ((0..rows * per_row).map(|_| (next() % 10_000) as f32 / 5_000.0 - 1.0).collect(), 10)
        }
    };
    let labels = (0..rows).map(|_| (next() % classes as u64) as usize).collect();
    let mut dims = vec![rows];
    dims.extend(shape);
    Ok((Tensor::from_vec(values, dims, &Device::host())?, labels))
}

/// Trains `spec` for `args.steps` steps, one stage per device (layers cut evenly, 1F1B with two
/// micro-batches).
fn train(spec: &ModelSpec, devices: Vec<Device>, args: &Args, precision: Precision) -> Result<Run> {
    train_with(spec, devices, args, precision, false)
}

/// [`train`], with overlapped steps (`Trainer::fit` with post-validation, `conveyor train`'s
/// default) when `overlap`.
fn train_with(spec: &ModelSpec, devices: Vec<Device>, args: &Args, precision: Precision, overlap: bool) -> Result<Run> {
    let graph = spec.build(7)?;
    let layers: Vec<String> = graph
        .topological_order()?
        .into_iter()
        .filter(|&id| graph.layer(id).is_some())
        .map(|id| graph.node(id).map(|node| node.name.clone()))
        .collect::<conveyor::engine::Result<_>>()?;
    let per_stage = layers.len().div_ceil(devices.len());
    // Planned by hand (the same cut on every device kind) so that the trainer keeps its memory
    // plan, which each device's measured peak is held to, as `tests/memory_plan_bound.rs` does on
    // the CPU.
    let stages: Vec<Vec<String>> = layers.chunks(per_stage).map(<[_]>::to_vec).collect();
    let n_devices = devices.len();
    // Two micro-batches for every run, one device or two: Dropout draws one mask per
    // micro-batch, so runs compare only at the same micro-batch count.
    let micro_batches = 2;
    let trainer = Trainer::builder(graph, Arc::new(CrossEntropyLoss::new()))
        .devices(devices)
        .schedule(ScheduleKind::OneFOneB, 1)
        .micro_batches(micro_batches)
        .batch_rows(args.batch)
        .placement(Placement::Manual(stages))
        .optimizer(optimizer())
        .precision(precision)
        .seed(11)
        .build()?;
    steps(trainer, None, spec, args, n_devices, overlap)
}

/// The optimizer of every run.
fn optimizer() -> OptimizerConfig {
    OptimizerConfig::Sgd(SgdConfig::new(0.05).with_momentum(0.9))
}

/// Trains `spec` split Megatron-style over groups of `tensor_parallel` devices (a stage per
/// group, planned as `conveyor train --tensor-parallel K` plans it) in `replicas` data-parallel
/// replicas, with the schedule, batches, seeds and optimizer of [`train`]: each replica takes
/// `2 / replicas` of the two micro-batches, so the weights compare with the unsplit CPU reference.
fn train_split(
    spec: &ModelSpec,
    devices: Vec<Device>,
    tensor_parallel: usize,
    replicas: usize,
    args: &Args,
) -> Result<Run> {
    let config = PipelineConfig {
        schedule: ScheduleKind::OneFOneB,
        n_chunks: 1,
        n_micro_batches: 2 / replicas,
        batch_rows: args.batch,
        optimizer: optimizer(),
        recompute: Recompute::Never,
        seed: 11,
        core_slots: Default::default(),
        precision: Precision::F32,
        weight_cache: Default::default(),
    };
    let n_stages = devices.len() / (tensor_parallel * replicas);
    let data_parallel = DataParallel::replicas(replicas);
    let (plan, trainer) = build_trainer_replicated(spec, 7, devices, tensor_parallel, &data_parallel, &config)?;
    steps(trainer, Some(plan), spec, args, n_stages, false)
}

/// Runs `args.steps` steps of `trainer` and collects what [`Run`] holds. Its memory plan (`plan`,
/// or the one the trainer keeps) places the stages on `n_stages` pipeline devices, each a group
/// of one or more devices. With `overlap` the steps run through `Trainer::fit` with overlapped
/// steps (refused when the trainer cannot overlap them), and a step's time is the wall time
/// between two reports.
fn steps(
    mut trainer: Trainer,
    plan: Option<Plan>,
    spec: &ModelSpec,
    args: &Args,
    n_stages: usize,
    overlap: bool,
) -> Result<Run> {
    let n_devices = trainer.devices().len();
    let mut times = Vec::new();
    let mut measured = vec![0u64; n_devices];
    let mut record = |report: &conveyor::engine::runtime::StepReport, ms: f64| {
        times.push(ms);
        for (peak, &bytes) in measured.iter_mut().zip(&report.peak_memory) {
            *peak = (*peak).max(bytes);
        }
    };
    if overlap {
        trainer.set_overlap_steps(true);
        if let Some(why) = trainer.overlap_unavailable() {
            anyhow::bail!("steps cannot overlap here: {why}");
        }
        let batches: Vec<(Tensor, Vec<usize>)> =
            (0..args.steps).map(|step| batch(spec, args.batch, step)).collect::<Result<_>>()?;
        let mut last = Instant::now();
        trainer.fit(batches, |report| {
            record(report, last.elapsed().as_secs_f64() * 1e3);
            last = Instant::now();
        })?;
    } else {
        for step in 0..args.steps {
            let (x, y) = batch(spec, args.batch, step)?;
            let start = Instant::now();
            let report = trainer.train_step(&x, &y)?;
            record(&report, start.elapsed().as_secs_f64() * 1e3);
        }
    }
    // One figure per device: each pipeline device's group members in order.
    let plan = match plan {
        Some(plan) => plan,
        None => trainer.plan().context("a planned placement keeps its plan")?.clone(),
    };
    // One figure per device: each pipeline device's group members in order, for replica 0 (every
    // replica has the same plan), repeated for each replica.
    let per_replica: Vec<u64> = plan.device_peaks(n_stages).into_iter().flatten().collect();
    anyhow::ensure!(
        !per_replica.is_empty() && n_devices.is_multiple_of(per_replica.len()),
        "the plan has {} device figures for {n_devices} devices",
        per_replica.len()
    );
    let planned: Vec<u64> = per_replica.iter().copied().cycle().take(n_devices).collect();
    let peak_over_plan =
        measured.iter().zip(&planned).map(|(&bytes, &plan)| bytes as f64 / plan.max(1) as f64).fold(0.0, f64::max);
    let mut timed = times.split_off(usize::from(times.len() > 1));
    timed.sort_by(f64::total_cmp);
    let weights = trainer.parameters()?.into_iter().map(|(name, t)| (name, t.to_vec_f32())).collect();
    Ok(Run { weights, step_ms: timed[timed.len() / 2], peak_over_plan })
}

/// The largest `‖a - b‖ / ‖b‖` over the parameter tensors (the norm-wise relative error: the
/// measure of METHOD-style GPU checks, robust to single elements near zero), and the largest
/// element-wise `|a - b| / max(|b|, 1e-3)` (printed for information).
fn rel_diffs(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> (f64, f64) {
    let (mut normwise, mut elementwise) = (0.0f64, 0.0f64);
    for ((_, x), (_, y)) in a.iter().zip(b) {
        let (mut diff, mut norm) = (0.0f64, 0.0f64);
        for (&x, &y) in x.iter().zip(y) {
            let d = f64::from(x) - f64::from(y);
            diff += d * d;
            norm += f64::from(y) * f64::from(y);
            elementwise = elementwise.max(d.abs() / f64::from(y.abs().max(1e-3)));
        }
        normwise = normwise.max(if norm > 0.0 { (diff / norm).sqrt() } else { diff.sqrt() });
    }
    (normwise, elementwise)
}

/// A row that could not train: the first 110 characters of why.
fn print_failure(model: &str, label: &str, precision: &str, error: &anyhow::Error) {
    let why: String = format!("{error:#}").chars().take(110).collect();
    println!("{model:<24} {label:<12} {precision:<9} {:>10} {:>10} {:>12} {:>9}  FAIL: {why}", "-", "-", "-", "-");
}

/// One whole GPU (`cuda:N`), the placement PyTorch's column and the precision rows are for.
fn whole_gpu(label: &str) -> bool {
    label.starts_with("cuda") && !label.contains([',', 'x'])
}

/// PyTorch's step times by (model, device).
fn torch_times(path: &Option<PathBuf>) -> Result<HashMap<(String, String), f64>> {
    let Some(path) = path else { return Ok(HashMap::new()) };
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut times = HashMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if let [model, device, ms] = fields.as_slice() {
            times.insert((model.to_string(), device.to_string()), ms.parse()?);
        }
    }
    Ok(times)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let torch = torch_times(&args.torch)?;
    let gpus: Vec<usize> = match CudaDevice::count() {
        Ok(count) => (0..count).collect(),
        Err(err) => {
            println!("GPUs skipped: {err}");
            Vec::new()
        }
    };
    println!(
        "{:<24} {:<12} {:<9} {:>10} {:>10} {:>12} {:>9}  status",
        "model", "device", "precision", "step ms", "torch ms", "|dw|/|w|", "peak/plan"
    );
    let torch_cell = |model: &str, device: &str| {
        torch.get(&(model.to_string(), device.to_string())).map_or("-".to_string(), |ms| format!("{ms:.3}"))
    };
    let mut failures = 0;
    for model in &args.models {
        let spec: ModelSpec = model.parse().with_context(|| format!("model {model}"))?;
        let reference =
            train(&spec, vec![Device::cpu(0)], &args, Precision::F32).with_context(|| format!("{model} on cpu:0"))?;
        println!(
            "{model:<24} {:<12} {:<9} {:>10.3} {:>10} {:>12} {:>9.3}  reference",
            "cpu:0",
            "f32",
            reference.step_ms,
            torch_cell(model, "cpu"),
            "-",
            reference.peak_over_plan
        );
        // The CPU in each half precision: the yardstick for the GPU's half rows.
        let mut cpu_half = Vec::new();
        for precision in [Precision::Bf16, Precision::F16] {
            let run = train(&spec, vec![Device::cpu(0)], &args, precision)
                .with_context(|| format!("{model} on cpu:0 in {precision}"))?;
            let (from_f32, _) = rel_diffs(&run.weights, &reference.weights);
            println!(
                "{model:<24} {:<12} {:<9} {:>10.3} {:>10} {from_f32:>12.2e} {:>9.3}  reference in {precision} \
                 (|dw|/|w| against cpu:0 in f32)",
                "cpu:0",
                precision.to_string(),
                run.step_ms,
                "-",
                run.peak_over_plan
            );
            cpu_half.push((precision, run, from_f32));
        }
        // Each GPU alone, then 2-stage pipelines over the CPU and the first GPU (mixed devices,
        // activations copied between them) and over two logical devices of the first GPU (two
        // workers, streams and ledgers on one card), in the device grammar of `--devices`.
        let mut placements: Vec<String> = gpus.iter().map(|&o| format!("cuda:{o}")).collect();
        if let Some(&first) = gpus.first() {
            placements.push(format!("cpu:0,cuda:{first}"));
            placements.push(format!("cuda:{first}x2"));
        }
        // The f32 runs of these placements, for the overlapped rows to compare with.
        let mut synchronous_runs: HashMap<String, Run> = HashMap::new();
        for label in &placements {
            let run = Device::parse_list(label)
                .map_err(anyhow::Error::from)
                .and_then(|devices| train(&spec, devices, &args, Precision::F32));
            match run {
                Ok(run) => {
                    let (diff, elementwise) = rel_diffs(&run.weights, &reference.weights);
                    let within_plan = run.peak_over_plan <= 1.0;
                    let pass = diff <= args.tolerance && within_plan;
                    failures += usize::from(!pass);
                    let status = match (diff <= args.tolerance, within_plan) {
                        (true, true) => "PASS".to_string(),
                        (false, _) => format!("FAIL (over {:e})", args.tolerance),
                        (true, false) => "FAIL (peak memory over the plan)".to_string(),
                    };
                    println!(
                        "{model:<24} {label:<12} {:<9} {:>10.3} {:>10} {diff:>12.2e} {:>9.3}  {status} (element-wise \
                         {elementwise:.1e})",
                        "f32",
                        run.step_ms,
                        torch_cell(model, if whole_gpu(label) { "cuda" } else { "pipeline" }),
                        run.peak_over_plan,
                    );
                    synchronous_runs.insert(label.clone(), run);
                }
                Err(err) => {
                    let why = format!("{err:#}");
                    let missing_layer = why.contains("not in host memory") || why.contains("NotOnHost");
                    failures += usize::from(!(missing_layer && args.allow_missing_layers));
                    let why: String = why.chars().take(110).collect();
                    println!(
                        "{model:<24} {label:<12} {:<9} {:>10} {:>10} {:>12} {:>9}  CANNOT TRAIN: {why}",
                        "f32", "-", "-", "-", "-"
                    );
                }
            }
            for (precision, cpu, cpu_from_f32) in cpu_half.iter().filter(|_| whole_gpu(label)) {
                // Against the CPU in the same precision: the same rounding of the same operands.
                let name = precision.to_string();
                let gpu = Device::parse_list(label)
                    .map_err(anyhow::Error::from)
                    .and_then(|devices| train(&spec, devices, &args, *precision));
                match gpu {
                    Ok(gpu) => {
                        let (diff, elementwise) = rel_diffs(&gpu.weights, &cpu.weights);
                        let bound = args.half_tolerance.max(2.0 * cpu_from_f32);
                        let pass = diff <= bound && gpu.peak_over_plan <= 1.0;
                        failures += usize::from(!pass);
                        println!(
                            "{model:<24} {label:<12} {name:<9} {:>10.3} {:>10} {diff:>12.2e} {:>9.3}  {} \
                             (bound {bound:.1e}; element-wise {elementwise:.1e}, against cpu:0 in {name})",
                            gpu.step_ms,
                            "-",
                            gpu.peak_over_plan,
                            if pass { "PASS" } else { "FAIL" }
                        );
                    }
                    Err(error) => {
                        failures += 1;
                        print_failure(model, label, &name, &error);
                    }
                }
            }
        }
        // Tensor parallelism (tp2) and data-parallel replicas (dp2) on two CPU devices (the
        // split's own check), and on the first GPU: two logical devices holding a shard or a
        // replica each (one stage), and tensor parallelism over four in two stages of two. The
        // shards and replicas exchange through the host (two handles of one GPU are no NCCL
        // group). Against the unsplit CPU reference.
        let mut split_placements = vec![("cpu:0,cpu:1".to_string(), 2, 1), ("cpu:0,cpu:1".to_string(), 1, 2)];
        if let Some(&first) = gpus.first() {
            split_placements.extend([
                (format!("cuda:{first}x2"), 2, 1),
                (format!("cuda:{first}x4"), 2, 1),
                (format!("cuda:{first}x2"), 1, 2),
            ]);
        }
        {
            for (label, tensor_parallel, replicas) in split_placements {
                let row =
                    if replicas > 1 { format!("{label} dp{replicas}") } else { format!("{label} tp{tensor_parallel}") };
                let stages = Device::parse_list(&label).map_or(0, |d| d.len() / (tensor_parallel * replicas));
                let run = Device::parse_list(&label)
                    .map_err(anyhow::Error::from)
                    .and_then(|devices| train_split(&spec, devices, tensor_parallel, replicas, &args));
                match run {
                    Ok(run) => {
                        let (diff, elementwise) = rel_diffs(&run.weights, &reference.weights);
                        let pass = diff <= args.tolerance && run.peak_over_plan <= 1.0;
                        failures += usize::from(!pass);
                        println!(
                            "{model:<24} {row:<12} {:<9} {:>10.3} {:>10} {diff:>12.2e} {:>9.3}  {} ({stages} stage(s); \
                             element-wise {elementwise:.1e})",
                            "f32",
                            run.step_ms,
                            "-",
                            run.peak_over_plan,
                            if pass { "PASS" } else { "FAIL" }
                        );
                    }
                    Err(error) => {
                        failures += 1;
                        print_failure(model, &row, "f32", &error);
                    }
                }
            }
        }
        // Overlapped steps (`conveyor train`'s default): each 2-stage pipeline trained through
        // `Trainer::fit` with post-validation must give the bits of its synchronous steps on the
        // same devices (the f32 run above where there was one) (undo snapshots and rollbacks of device tensors, the optimistic apply on a
        // device's stream).
        let mut overlap_placements = vec!["cpu:0,cpu:1".to_string()];
        if let Some(&first) = gpus.first() {
            overlap_placements.extend([format!("cpu:0,cuda:{first}"), format!("cuda:{first}x2")]);
        }
        for label in overlap_placements {
            let row = format!("{label} ovl");
            let runs = Device::parse_list(&label).map_err(anyhow::Error::from).and_then(|devices| {
                let synchronous = match synchronous_runs.remove(&label) {
                    Some(run) => run,
                    None => train(&spec, devices.clone(), &args, Precision::F32)?,
                };
                let overlapped = train_with(&spec, devices, &args, Precision::F32, true)?;
                Ok((synchronous, overlapped))
            });
            match runs {
                Ok((synchronous, overlapped)) => {
                    let (diff, _) = rel_diffs(&overlapped.weights, &reference.weights);
                    let same_bits = overlapped.weights.iter().zip(&synchronous.weights).all(|((_, a), (_, b))| {
                        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
                    }) && overlapped.weights.len() == synchronous.weights.len();
                    let pass = same_bits && overlapped.peak_over_plan <= 1.0;
                    failures += usize::from(!pass);
                    println!(
                        "{model:<24} {row:<12} {:<9} {:>10.3} {:>10} {diff:>12.2e} {:>9.3}  {} (synchronous {:.3} ms \
                         on the same devices; {})",
                        "f32",
                        overlapped.step_ms,
                        "-",
                        overlapped.peak_over_plan,
                        if pass { "PASS" } else { "FAIL" },
                        synchronous.step_ms,
                        if same_bits { "the same bits" } else { "NOT the synchronous bits" }
                    );
                }
                Err(error) => {
                    failures += 1;
                    print_failure(model, &row, "f32", &error);
                }
            }
        }
    }
    if gpus.is_empty() {
        println!("no GPU: only the CPU reference rows ran");
    }
    anyhow::ensure!(failures == 0, "{failures} GPU row(s) failed");
    Ok(())
}
