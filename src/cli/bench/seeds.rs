//! The `seeds` suite, the figures the studies behind Conveyor started from:
//! 1. per device (the CPU always; each GPU of `--devices` when present): a matrix product, a
//!    convolution, and one training step of every zoo model in f32 and bf16;
//! 2. the zoo's ResNet trained on a real image set on 1 device, a 2-stage pipeline and 2
//!    data-parallel replicas: Fashion-MNIST (28x28, 60,000 training images, `resnet:28`) when
//!    Debian's `dataset-fashion-mnist` is installed (read from its IDX files by the MNIST reader),
//!    else the shipped 8x8 digits; test accuracy against training time, one line each,
//!    and each step's time split into phases (data, forward, backward, optimizer, communication,
//!    idle) from the step's own timeline;
//! 3. energy per step and per sample where the CPU's RAPL counters can be read, and each GPU
//!    step's joules from NVML where a GPU is measured.
use std::time::Instant;

use conveyor::RunSpec;
use conveyor::engine::cpu::Window2d;
use conveyor::engine::device::ops::Matrix;
use conveyor::engine::{DType, Device, Precision, Tensor};
use conveyor::schedules::{OpKind, Timeline};
use serde_json::{Value, json};

use super::Bench;
use super::gemm::{median_seconds, values};
use super::html::{Chart, ChartBody, Section, Table, figure};
use crate::cli::train::summary::accuracy;

/// The product measured per device: `[n, n] · [n, n]`.
const GEMM_N: usize = 512;

/// The convolution measured per device: 3x3, padding 1, 32 -> 32 channels on 16x16 images.
const CONV: (usize, usize, usize) = (32, 32, 16);

/// Batch of the convolution.
const CONV_BATCH: usize = 16;

/// The zoo models, as the run spec names them, with the data each trains on.
const MODELS: [(&str, &str, &str); 4] = [
    ("mlp", "mlp:64,128,128,10", "digits"),
    ("cnn", "cnn", "digits"),
    ("resnet", "resnet", "digits"),
    ("transformer", "transformer:64,16,32,4,2,10", "tokens:512,16,64,10"),
];

/// Seconds per call of `run` on `device`: the median of timed calls on a CPU; on a GPU, whose
/// calls return before they finish, the mean of `repeats` calls closed by a download.
fn seconds_per_call(
    device: &Device,
    repeats: usize,
    mut run: impl FnMut() -> anyhow::Result<Tensor>,
) -> anyhow::Result<f64> {
    if matches!(device, Device::Cpu(_)) {
        return median_seconds(repeats, || run().map(drop));
    }
    run()?.to_vec_f32();
    let start = Instant::now();
    let mut last = None;
    for _ in 0..repeats.max(1) {
        last = Some(run()?);
    }
    if let Some(last) = last {
        last.to_vec_f32();
    }
    Ok(start.elapsed().as_secs_f64() / repeats.max(1) as f64)
}

/// The product and the convolution on `device` with operands of `dtype` (f32, or bf16 as
/// Conveyor computes it: on a CPU upcast to f32 products, on a GPU cuBLAS's bf16 inputs with f32
/// sums): (GEMM GFLOP/s, convolution GFLOP/s).
fn ops_on(device: &Device, dtype: DType, quick: bool) -> anyhow::Result<(f64, f64)> {
    let n = GEMM_N;
    let repeats = if quick { 5 } else { 11 };
    let values =
        |seed: u64, dims: &[usize]| -> anyhow::Result<Tensor> { Ok(values(seed, dims, device)?.to_dtype(dtype)?) };
    let (a, b) = (values(1, &[n, n])?, values(2, &[n, n])?);
    let gemm_s = seconds_per_call(device, repeats, || {
        Ok(Tensor::matmul(Matrix::new(&a, n, n)?, Matrix::new(&b, n, n)?, None, [n, n], device)?)
    })?;
    let (channels, out_channels, side) = CONV;
    let batch = CONV_BATCH;
    let window = Window2d::new(channels, (side, side), (3, 3), (1, 1), (1, 1))?;
    let x = values(3, &[batch, channels, side, side])?;
    let w = values(4, &[out_channels, channels, 3, 3])?;
    let conv_s = seconds_per_call(device, repeats, || Ok(x.conv2d(&w, None, &window, out_channels)?))?;
    let conv_flops = 2.0 * (batch * out_channels * window.col_rows() * window.out_plane_len()) as f64;
    Ok((2.0 * (n * n * n) as f64 / gemm_s / 1e9, conv_flops / conv_s / 1e9))
}

/// A run spec on `devices` for `steps` steps (or `epochs`), batch 64, Adam.
fn spec(model: &str, data: &str, devices: &str, precision: Precision, steps: Option<u64>) -> RunSpec {
    let mut spec = RunSpec::default();
    spec.model.spec = Some(model.to_string());
    spec.data.source = data.to_string();
    spec.pipeline.devices = devices.to_string();
    spec.pipeline.microbatches = 1;
    spec.training.batch = 64;
    spec.training.steps = steps;
    spec.training.precision = precision;
    spec
}

/// Median seconds of one training step of `model` on `device` in `precision`.
fn step_on(device: &Device, model: &str, data: &str, precision: Precision, quick: bool) -> anyhow::Result<f64> {
    let devices = match device {
        Device::Cpu(_) => "cpu:1".to_string(),
        other => other.to_string(),
    };
    let (warmup, measured) = if quick { (2u64, 5u64) } else { (3, 15) };
    let mut run = spec(model, data, &devices, precision, Some(warmup + measured)).prepare()?;
    let mut times = Vec::new();
    for step in 0..warmup + measured {
        let report = run.train_step(step)?;
        if step >= warmup {
            times.push(report.step_s);
        }
    }
    Ok(super::gemm::median(&mut times))
}

/// One step's time by phase on `device_idx` of its timeline: compute by kind, communication not
/// under compute, and the rest of the makespan as idle. Disjoint, so they sum to the makespan.
fn phases(timeline: &Timeline, device_idx: usize) -> [f64; 5] {
    let events: Vec<_> = timeline.events.iter().filter(|e| e.device_idx == device_idx).collect();
    let sum = |f: fn(OpKind) -> bool| events.iter().filter(|e| f(e.op)).map(|e| e.duration_s()).sum::<f64>();
    let forward = sum(|op| matches!(op, OpKind::Forward | OpKind::Recompute));
    let backward = sum(|op| matches!(op, OpKind::Backward | OpKind::BackwardInput | OpKind::BackwardWeight));
    let optimizer = sum(|op| op == OpKind::OptimizerStep);
    // The makespan's window: from the first compute start on any device.
    let start = timeline.events.iter().filter(|e| e.op.is_compute()).map(|e| e.start_s).fold(f64::INFINITY, f64::min);
    let end = start + timeline.makespan_s();
    let span = |e: &conveyor::schedules::TimelineEvent| (e.start_s.max(start), e.end_s.min(end));
    let is_comm = |op: OpKind| matches!(op, OpKind::Send | OpKind::Recv | OpKind::AllReduce);
    let compute: Vec<(f64, f64)> = events.iter().filter(|e| e.op.is_compute()).map(|e| span(e)).collect();
    let not_idle: Vec<(f64, f64)> =
        events.iter().filter(|e| e.op.is_compute() || is_comm(e.op)).map(|e| span(e)).collect();
    let busy = covered(not_idle);
    let communication = (busy - covered(compute)).max(0.0);
    let idle = (timeline.makespan_s() - busy).max(0.0);
    [forward, backward, optimizer, communication, idle]
}

/// The length of the union of `spans`.
fn covered(mut spans: Vec<(f64, f64)>) -> f64 {
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut total, mut end) = (0.0, f64::NEG_INFINITY);
    for (s, e) in spans {
        let s = s.max(end);
        if e > s {
            total += e - s;
            end = e;
        }
    }
    total
}

/// Where Debian's `dataset-fashion-mnist` puts the IDX files.
const FASHION_MNIST: &str = "/usr/share/datasets/fashion-mnist";

/// The image set of part 2: the model, the data source, its name, and how long to train
/// (epochs, or steps when set) and evaluate (test-set evaluations along the run).
struct ImageSet {
    model: &'static str,
    data: String,
    name: &'static str,
    epochs: u64,
    steps: Option<u64>,
    evaluations: u64,
}

/// Fashion-MNIST when installed (quick: 400 steps of 64 images; else one epoch), else the digits
/// (quick: 15 epochs; else 40).
fn image_set(quick: bool) -> ImageSet {
    let fashion = std::path::Path::new(FASHION_MNIST).join("train-images-idx3-ubyte.gz");
    if fashion.is_file() {
        let steps = quick.then_some(400);
        return ImageSet {
            model: "resnet:28",
            data: FASHION_MNIST.into(),
            name: "Fashion-MNIST",
            epochs: 1,
            steps,
            evaluations: 5,
        };
    }
    let epochs = if quick { 15 } else { 40 };
    ImageSet { model: "resnet", data: "digits".into(), name: "the digits", epochs, steps: None, evaluations: epochs }
}

/// One training configuration of part 2.
struct Config {
    label: &'static str,
    devices: &'static str,
    data_parallel: usize,
    microbatches: usize,
}

const CONFIGS: [Config; 3] = [
    Config { label: "1 device", devices: "cpu:1", data_parallel: 1, microbatches: 1 },
    Config { label: "2-stage pipeline (1F1B, 4 micro-batches)", devices: "cpu:2", data_parallel: 1, microbatches: 4 },
    Config { label: "2 data-parallel replicas", devices: "cpu:2", data_parallel: 2, microbatches: 1 },
];

const PHASES: [&str; 7] = ["data", "forward", "backward", "optimizer", "communication", "idle", "unattributed"];

/// What one configuration's training gave.
struct Trained {
    curve: Vec<(f64, f64)>,
    phase_means: [f64; 7],
    step_mean_s: f64,
    steps: u64,
    samples: u64,
    energy: Value,
    within_2_percent: bool,
}

/// Trains the ResNet on `set` under `config`, evaluating on the test split `set.evaluations`
/// times along the run.
fn train(bench: &mut Bench, config: &Config, set: &ImageSet) -> anyhow::Result<Trained> {
    let mut spec = spec(set.model, &set.data, config.devices, Precision::F32, set.steps);
    spec.training.epochs = set.epochs;
    spec.pipeline.data_parallel = config.data_parallel;
    spec.pipeline.microbatches = config.microbatches;
    let mut run = spec.prepare()?;
    let test = run.test.clone().ok_or_else(|| anyhow::anyhow!("{} came without a test split", set.name))?;
    let batch = run.spec.training.batch;
    let chunk_micro_batches = config.data_parallel * config.microbatches;
    let mut trained_s = 0.0;
    let first = accuracy(&mut run.trainer, &test, batch, chunk_micro_batches, || Ok(false))?.unwrap_or(f64::NAN);
    let mut curve = vec![(0.0, 100.0 * first)];
    let mut sums = [0.0f64; 7];
    let mut step_sum = 0.0;
    let energy = bench.energy.start();
    for step in 0..run.total_steps {
        let started = Instant::now();
        let (inputs, labels) = run.step_batch(step)?;
        let data_s = started.elapsed().as_secs_f64();
        let report = run.trainer.train_step(&inputs, &labels)?;
        let wall_s = started.elapsed().as_secs_f64();
        trained_s += wall_s;
        let [forward, backward, optimizer, communication, idle] = phases(&report.timeline, 0);
        let named = [data_s, forward, backward, optimizer, communication, idle];
        let unattributed = wall_s - named.iter().sum::<f64>();
        for (sum, value) in sums.iter_mut().zip(named.iter().chain([unattributed].iter())) {
            *sum += value;
        }
        step_sum += wall_s;
        let every = run.total_steps.div_ceil(set.evaluations.max(1)).max(1);
        if (step + 1) % every == 0 || step + 1 == run.total_steps {
            bench.progress(&format!("seeds: ResNet, {}, step {}/{}", config.label, step + 1, run.total_steps));
            let acc = accuracy(&mut run.trainer, &test, batch, chunk_micro_batches, || Ok(false))?.unwrap_or(f64::NAN);
            curve.push((trained_s, 100.0 * acc));
        }
    }
    let joules = bench.energy.joules_since(&energy);
    let steps = run.total_steps.max(1);
    let phase_means = sums.map(|s| s / steps as f64);
    let step_mean_s = step_sum / steps as f64;
    let samples = steps * batch as u64;
    let energy = match super::machine::energy_json(&joules) {
        Value::Null => Value::Null,
        mut e => {
            let total = e["package_joules"].as_f64().unwrap_or(f64::NAN);
            e["joules_per_step"] = (total / steps as f64).into();
            e["joules_per_sample"] = (total / samples as f64).into();
            e
        }
    };
    let within_2_percent = phase_means[6].abs() <= 0.02 * step_mean_s;
    Ok(Trained { curve, phase_means, step_mean_s, steps, samples, energy, within_2_percent })
}

/// Runs the suite: the report's `seeds` object and its section.
pub fn run(bench: &mut Bench) -> anyhow::Result<(Value, Section)> {
    let quick = bench.quick;
    // Part 1: per device. Every CPU device is the same processor: measured once.
    let mut targets: Vec<Device> = Vec::new();
    for device in bench.devices.clone() {
        let same_kind = targets.iter().any(|t| matches!((t, &device), (Device::Cpu(_), Device::Cpu(_))));
        if !same_kind {
            targets.push(device);
        }
    }
    let mut device_rows = Vec::new();
    let mut op_series: Vec<(String, Vec<Option<f64>>)> = Vec::new();
    let mut step_categories = Vec::new();
    let mut step_series: Vec<(String, Vec<Option<f64>>)> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    for device in &targets {
        let label = match device {
            Device::Cpu(_) => "cpu (1 core)".to_string(),
            other => other.to_string(),
        };
        bench.progress(&format!("seeds: GEMM and convolution on {label}"));
        // A device that fails an item is reported with the error; the other items still run.
        let mut gemm_gflops = Vec::new();
        let mut conv_gflops = Vec::new();
        let mut ops_errors = Vec::new();
        for (name, dtype) in [("f32", DType::F32), ("bf16", DType::BF16)] {
            match ops_on(device, dtype, quick) {
                Ok((gemm, conv)) => {
                    gemm_gflops.push(Some(gemm));
                    conv_gflops.push(Some(conv));
                }
                Err(e) => {
                    ops_errors.push(format!("{name}: {e:#}"));
                    failures.push(format!("GEMM and convolution in {name} on {label}: {e:#}"));
                    gemm_gflops.push(None);
                    conv_gflops.push(None);
                }
            }
        }
        op_series.push((label.clone(), gemm_gflops.iter().chain(&conv_gflops).copied().collect()));
        let mut steps_json = Vec::new();
        let mut values = Vec::new();
        for (name, model, data) in MODELS {
            for precision in [Precision::F32, Precision::Bf16] {
                bench.progress(&format!("seeds: one {name} training step on {label}, {precision}"));
                let energy = bench.energy.start();
                let gpu_index = match device {
                    Device::Cuda(cuda) => Some(cuda.ordinal()),
                    Device::Cpu(_) => None,
                };
                let gpu_start = gpu_index.map(|i| bench.gpu_energy.read_mj(i));
                let seconds = step_on(device, model, data, precision, quick);
                let joules = bench.energy.joules_since(&energy);
                let gpu_joules =
                    gpu_index.zip(gpu_start).and_then(|(i, start)| bench.gpu_energy.joules_since(i, start));
                if step_categories.len() < MODELS.len() * 2 {
                    step_categories.push(format!("{name} {precision}"));
                }
                let mut row = json!({ "model": model, "data": data, "precision": precision.to_string(), "batch": 64 });
                match seconds {
                    Ok(seconds) => {
                        values.push(Some(1e3 * seconds));
                        row["median_step_s"] = seconds.into();
                        row["energy_of_all_steps"] = super::machine::energy_json(&joules);
                        if let Some(gpu_joules) = gpu_joules {
                            row["gpu_joules_of_all_steps"] = gpu_joules.into();
                        }
                    }
                    Err(e) => {
                        values.push(None);
                        failures.push(format!("{name} {precision} on {label}: {e:#}"));
                        row["error"] = format!("{e:#}").into();
                    }
                }
                steps_json.push(row);
            }
        }
        step_series.push((label.clone(), values));
        device_rows.push(json!({
            "device": label,
            "ops_errors": ops_errors,
            "gemm": { "n": GEMM_N, "gflops_f32": gemm_gflops[0], "gflops_bf16": gemm_gflops[1] },
            "conv": { "batch": CONV_BATCH, "in_channels": CONV.0, "out_channels": CONV.1, "image": CONV.2, "kernel": 3, "gflops_f32": conv_gflops[0], "gflops_bf16": conv_gflops[1] },
            "train_steps": steps_json,
        }));
    }

    // Part 2: the ResNet on a real image set, three ways.
    let set = image_set(quick);
    let length = match set.steps {
        Some(steps) => format!("{steps} steps"),
        None => format!("{} epoch{}", set.epochs, if set.epochs == 1 { "" } else { "s" }),
    };
    let mut lines = Vec::new();
    let mut phase_rows = Vec::new();
    let mut phase_series: Vec<(String, Vec<Option<f64>>)> = Vec::new();
    let mut configs_json = Vec::new();
    let mut energy_rows = Vec::new();
    for config in &CONFIGS {
        bench.progress(&format!("seeds: ResNet on {}, {}, {length}", set.name, config.label));
        let trained = train(bench, config, &set)?;
        lines.push((config.label.to_string(), trained.curve.clone()));
        let mut row = vec![config.label.to_string(), figure(1e3 * trained.step_mean_s)];
        row.extend(trained.phase_means.iter().map(|s| figure(1e3 * s)));
        row.push(if trained.within_2_percent { "yes".into() } else { "no".into() });
        phase_rows.push(row);
        phase_series.push((config.label.to_string(), trained.phase_means.iter().map(|s| Some(1e3 * s)).collect()));
        if !trained.energy.is_null() {
            energy_rows.push(vec![
                config.label.to_string(),
                figure(trained.energy["joules_per_step"].as_f64().unwrap_or(f64::NAN)),
                figure(trained.energy["joules_per_sample"].as_f64().unwrap_or(f64::NAN)),
            ]);
        }
        let phases: serde_json::Map<String, Value> =
            PHASES.iter().zip(trained.phase_means).map(|(name, s)| (format!("{name}_s"), s.into())).collect();
        configs_json.push(json!({
            "config": config.label, "devices": config.devices, "data_parallel": config.data_parallel,
            "micro_batches": config.microbatches, "model": set.model, "data": set.data, "steps": trained.steps, "samples": trained.samples,
            "accuracy_curve": trained.curve.iter().map(|(t, a)| json!({"train_s": t, "test_accuracy_percent": a})).collect::<Vec<_>>(),
            "mean_step_s": trained.step_mean_s, "phases_per_step": phases,
            "named_phases_within_2_percent_of_step": trained.within_2_percent,
            "energy": trained.energy,
        }));
    }

    let mut notes = vec![
        format!(
            "Per device: a {n}x{n}x{n} product and a 3x3 convolution ({} -> {} channels, {s}x{s} images, batch {}) with \
             f32 and with bf16 operands (as Conveyor computes bf16: on a CPU the operands are widened to f32 for the \
             product, so bf16 costs the conversion and gains nothing; on a GPU cuBLAS takes bf16 inputs and sums in \
             f32), then one training step (batch 64, Adam) of each zoo model in f32 and bf16 (autocast: products in \
             bf16, sums in f32).",
            CONV.0,
            CONV.1,
            CONV_BATCH,
            n = GEMM_N,
            s = CONV.2
        ),
        "Phases per step come from device 0's own timeline of each step: forward, backward and optimizer are its \
         compute ops; communication is its send, receive and all-reduce time not under compute; idle is the rest of \
         the step's makespan; data is the batch's assembly, timed around it. \"unattributed\" is the step's wall time \
         minus all of these (the runtime's work outside the timeline: splitting the batch, starting the workers, the \
         commit)."
            .to_string(),
    ];
    if !failures.is_empty() {
        notes.push(format!("Failed (no figure): {}", failures.join(" | ")));
    }
    if !targets.iter().any(|d| matches!(d, Device::Cuda(_))) {
        notes.push(format!("No GPU measured: {}.", super::gpus().1));
    }
    let rapl = bench.energy.describe();
    if rapl["available"] != true {
        notes.push(format!(
            "Energy: not measured, the CPU's RAPL counters cannot be read here ({}). No figure is shown rather than an estimate.",
            rapl["reason"].as_str().unwrap_or("unknown reason")
        ));
    }
    let charts = vec![
        Chart {
            title: "GEMM and convolution by device".into(),
            x_label: "operation".into(),
            y_label: "GFLOP/s".into(),
            body: ChartBody::Bars {
                categories: ["GEMM f32", "GEMM bf16", "convolution f32", "convolution bf16"].map(String::from).to_vec(),
                series: op_series,
            },
        },
        Chart {
            title: "One training step by zoo model and precision".into(),
            x_label: "model and precision".into(),
            y_label: "step time (ms)".into(),
            body: ChartBody::Bars { categories: step_categories, series: step_series },
        },
        Chart {
            title: format!("ResNet on {}: test accuracy over training time ({length})", set.name),
            x_label: "training time (s, evaluation excluded)".into(),
            y_label: "test accuracy (%)".into(),
            body: ChartBody::Lines { series: lines },
        },
        Chart {
            title: "ResNet step time by phase (mean per step, device 0)".into(),
            x_label: "phase".into(),
            y_label: "time per step (ms)".into(),
            body: ChartBody::Bars { categories: PHASES.iter().map(|p| p.to_string()).collect(), series: phase_series },
        },
    ];
    let mut header = vec!["configuration".to_string(), "step ms".to_string()];
    header.extend(PHASES.iter().map(|p| format!("{p} ms")));
    header.push("named phases within 2% of the step".into());
    let mut tables =
        vec![Table { caption: "ResNet step time by phase (mean per step, device 0)".into(), header, rows: phase_rows }];
    if !energy_rows.is_empty() {
        tables.push(Table {
            caption: "Energy (CPU package, RAPL)".into(),
            header: vec!["configuration".into(), "J per step".into(), "J per sample".into()],
            rows: energy_rows,
        });
    }
    let json = json!({ "devices": device_rows, "resnet": { "data_set": set.name, "runs": configs_json } });
    Ok((json, Section { title: "seeds: devices, zoo models, ResNet training, energy".into(), notes, charts, tables }))
}
