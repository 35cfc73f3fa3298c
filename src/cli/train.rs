//! `conveyor train`: trains a model from the zoo on a dataset across devices with a pipeline
//! schedule, printing progress, accuracy, throughput and the bubble summary.
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use conveyor::data::{self, DIGITS_TRAIN_ROWS, Dataset};
use conveyor::engine::Device;
use conveyor::engine::optim::{AdamConfig, OptimizerConfig, SgdConfig};
use conveyor::engine::runtime::Recompute;
use conveyor::pipeline::{PipelineConfig, build_trainer, simulated_inflight};
use conveyor::engine::trace::{TimelineRecorder, timeline_filter};
use conveyor::schedules::export::{MemorySample, SvgOptions, TraceOptions, chrome_trace, svg_gantt};
use conveyor::schedules::{CostModel, Schedule, ScheduleKind, StageCosts, simulate};
use conveyor::zoo::ModelSpec;

use super::usage;

/// Arguments of `conveyor train`.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Model: `mlp:D0,D1,...,Dn` (Linear/ReLU stack), `cnn` (LeNet-like, 1x8x8 inputs) or `resnet`.
    /// Default: `cnn` for the digits data, `mlp:D,128,128,C` for synthetic data.
    #[arg(long)]
    pub model: Option<String>,
    /// Data: `digits` (built in: 1,437 train and 360 test images) or `synthetic:N,D,C`
    /// (N samples, D features, C classes, seeded by --seed).
    #[arg(long, default_value = "digits")]
    pub data: String,
    /// Devices: `cpu:N` for N CPU devices (one core each), or `cuda:0,1` for GPUs.
    #[arg(long, default_value = "cpu:2")]
    pub devices: String,
    /// Memory budget of each device, e.g. `512MiB` or `2GiB` (default: unlimited).
    #[arg(long)]
    pub device_memory: Option<String>,
    /// Pipeline stages per chunk; default one per device. Uses the first P devices.
    #[arg(long)]
    pub stages: Option<usize>,
    /// Schedule: gpipe, 1f1b, interleaved, zb-h1 or zb-h2.
    #[arg(long, default_value = "1f1b")]
    pub schedule: String,
    /// Model chunks per device (interleaved schedule only).
    #[arg(long, default_value_t = 1)]
    pub chunks: usize,
    /// Micro-batches per batch.
    #[arg(long, default_value_t = 8)]
    pub microbatches: usize,
    /// Rows per batch (one optimizer step).
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Total optimizer steps (overrides --epochs).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Passes over the training data (when --steps is not given).
    #[arg(long, default_value_t = 20)]
    pub epochs: u64,
    /// Optimizer: sgd, momentum (SGD with momentum 0.9, or --momentum), adam or adamw.
    #[arg(long, default_value = "adam")]
    pub optimizer: String,
    /// Learning rate (default 0.005 for adam/adamw, 0.05 for sgd/momentum).
    #[arg(long, allow_negative_numbers = true)]
    pub lr: Option<f64>,
    /// Momentum for `--optimizer momentum` (default 0.9).
    #[arg(long)]
    pub momentum: Option<f64>,
    /// Weight decay (L2 for sgd/adam, decoupled for adamw).
    #[arg(long, allow_negative_numbers = true)]
    pub weight_decay: Option<f64>,
    /// Activation recomputation: never, except-last or always.
    #[arg(long, default_value = "never")]
    pub recompute: String,
    /// Seed for initialisation, shuffling, synthetic data and dropout.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Take batches in data order from the first row instead of shuffling.
    #[arg(long)]
    pub no_shuffle: bool,
    /// Save the trained model (all stages gathered, PyTorch names) to this safetensors file.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Write one JSON object per optimizer step to this file, then a summary object.
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Write a Chrome / Perfetto trace of every op of the whole run (open in ui.perfetto.dev).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Write an SVG Gantt chart of the last step: one row per device, bubbles marked.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Print progress every this many steps (0: only the summary).
    #[arg(long, default_value_t = 10)]
    pub log_every: u64,
}

/// Parses a size like `512MiB`, `2GiB`, `1000000` (bytes), `64KiB`, `1.5GB`.
pub fn parse_size(text: &str) -> anyhow::Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 =
        number.parse().map_err(|_| usage(format!("--device-memory `{text}`: expected a size like 512MiB or 2GiB")))?;
    let factor = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" | "k" => 1024.0,
        "mib" | "m" => 1024.0 * 1024.0,
        "gib" | "g" => 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        other => return Err(usage(format!("--device-memory `{text}`: unknown unit `{other}`; use B, KiB, MiB or GiB"))),
    };
    if value <= 0.0 || !value.is_finite() {
        return Err(usage(format!("--device-memory `{text}`: the size must be positive")));
    }
    Ok((value * factor) as u64)
}

/// Parses `cpu:N` (N devices) or `cuda:0,1` (a list of GPUs), each with the budget.
pub fn parse_devices(spec: &str, budget: Option<u64>) -> anyhow::Result<Vec<Device>> {
    let bad = || usage(format!("--devices `{spec}`: use cpu:N for N CPU devices or cuda:0,1 for GPUs"));
    let (kind, rest) = spec.split_once(':').ok_or_else(bad)?;
    match kind {
        "cpu" => {
            let n: usize = rest.trim().parse().map_err(|_| bad())?;
            if n == 0 {
                return Err(usage(format!("--devices `{spec}`: at least one device is needed")));
            }
            Ok((0..n).map(|i| Device::cpu_with_budget(i, budget)).collect())
        }
        "cuda" => rest
            .split(',')
            .map(|idx| {
                let ordinal: usize = idx.trim().parse().map_err(|_| bad())?;
                Device::cuda(ordinal, budget).map_err(|e| usage(e.to_string()))
            })
            .collect(),
        _ => Err(bad()),
    }
}

/// Parses the optimizer flags into a configuration, refusing invalid values with exit code 2.
pub fn parse_optimizer(name: &str, lr: Option<f64>, momentum: Option<f64>, weight_decay: Option<f64>) -> anyhow::Result<OptimizerConfig> {
    let wd = weight_decay.unwrap_or(0.0);
    let config = match name {
        "sgd" => OptimizerConfig::Sgd(SgdConfig::new(lr.unwrap_or(0.05)).with_weight_decay(wd)),
        "momentum" => OptimizerConfig::Sgd(
            SgdConfig::new(lr.unwrap_or(0.05)).with_momentum(momentum.unwrap_or(0.9)).with_weight_decay(wd),
        ),
        "adam" => OptimizerConfig::Adam(AdamConfig::adam(lr.unwrap_or(0.005)).with_weight_decay(wd)),
        "adamw" => OptimizerConfig::AdamW(AdamConfig::adamw(lr.unwrap_or(0.005)).with_weight_decay(weight_decay.unwrap_or(0.01))),
        other => return Err(usage(format!("--optimizer `{other}`: use sgd, momentum, adam or adamw"))),
    };
    config.validate().map_err(|e| usage(format!("--lr/--momentum/--weight-decay: {e}")))?;
    Ok(config)
}

fn load_data(spec: &str, seed: u64) -> anyhow::Result<(Dataset, Option<Dataset>)> {
    if spec == "digits" {
        let all = data::digits()?;
        let (mut train, mut test) = (all.slice(0, DIGITS_TRAIN_ROWS), all.slice(DIGITS_TRAIN_ROWS, all.len()));
        // Standardise each pixel with statistics of the training rows only.
        let (mean, std) = train.feature_stats();
        train.standardize(&mean, &std);
        test.standardize(&mean, &std);
        return Ok((train, Some(test)));
    }
    if let Some(rest) = spec.strip_prefix("synthetic:") {
        let parts: Vec<usize> = rest
            .split(',')
            .map(|p| p.trim().parse::<usize>())
            .collect::<Result<_, _>>()
            .map_err(|_| usage(format!("--data `{spec}`: use synthetic:N,D,C with positive integers")))?;
        let [n, d, c] = parts[..] else {
            return Err(usage(format!("--data `{spec}`: use synthetic:N,D,C (samples, features, classes)")));
        };
        let all = data::synthetic(n, d, c, seed).map_err(|e| usage(e.to_string()))?;
        return Ok((all, None));
    }
    Err(usage(format!("--data `{spec}`: use digits or synthetic:N,D,C")))
}

/// Installs the process's `tracing` subscriber: logs to stderr filtered by `RUST_LOG` (default
/// `warn`), and, when a trace or chart is asked for, the op-span recorder.
fn install_subscriber(record_ops: bool) -> Option<TimelineRecorder> {
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_filter(filter);
    let (recorder, timeline) = if record_ops {
        let (recorder, layer) = TimelineRecorder::new();
        (Some(recorder), Some(layer.with_filter(timeline_filter())))
    } else {
        (None, None)
    };
    let subscriber = tracing_subscriber::registry().with(logs).with(timeline);
    // Only the first call in a process installs; later ones (tests running `run` twice) keep it.
    let _ = tracing::subscriber::set_global_default(subscriber);
    recorder
}

/// Runs `conveyor train`.
pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let recorder = install_subscriber(args.trace.is_some() || args.svg.is_some());
    let (train, test) = load_data(&args.data, args.seed)?;
    let n_classes = train.n_classes;
    let model_text = args.model.clone().unwrap_or_else(|| match train.feature_shape.as_slice() {
        [d] => format!("mlp:{d},128,128,{n_classes}"),
        _ => "cnn".to_string(),
    });
    let spec: ModelSpec = model_text.parse().map_err(|e: conveyor::engine::Error| usage(e.to_string()))?;
    if spec.input_shape() != train.feature_shape {
        return Err(usage(format!(
            "--model {model_text} takes inputs of shape {:?} but --data {} has {:?}",
            spec.input_shape(),
            args.data,
            train.feature_shape
        )));
    }
    let schedule: ScheduleKind = args.schedule.parse().map_err(|e| usage(format!("--schedule: {e}")))?;
    if args.chunks > 1 && !schedule.supports_chunks() {
        return Err(usage(format!("--chunks {} needs --schedule interleaved", args.chunks)));
    }
    let recompute: Recompute = args.recompute.parse().map_err(|e: conveyor::engine::Error| usage(e.to_string()))?;
    let budget = args.device_memory.as_deref().map(parse_size).transpose()?;
    let mut devices = parse_devices(&args.devices, budget)?;
    if let Some(stages) = args.stages {
        if stages == 0 || stages > devices.len() {
            return Err(usage(format!("--stages {stages}: give between 1 and the {} devices of --devices", devices.len())));
        }
        devices.truncate(stages);
    }
    if args.microbatches == 0 || args.batch == 0 {
        return Err(usage("--batch and --microbatches must be at least 1"));
    }
    if args.microbatches > args.batch {
        return Err(usage(format!(
            "--microbatches {} is more than the {} rows of a batch; use at most --microbatches {}",
            args.microbatches, args.batch, args.batch
        )));
    }
    if args.batch > train.len() {
        return Err(usage(format!("--batch {} is larger than the {} training rows", args.batch, train.len())));
    }
    let optimizer = parse_optimizer(&args.optimizer, args.lr, args.momentum, args.weight_decay)?;
    let config = PipelineConfig {
        schedule,
        n_chunks: args.chunks,
        n_micro_batches: args.microbatches,
        batch_rows: args.batch,
        optimizer,
        recompute,
        seed: args.seed,
    };
    let graph = spec.build(args.seed).map_err(|e| usage(e.to_string()))?;
    let n_devices = devices.len();
    let (plan, mut trainer) = build_trainer(graph, devices, &config).map_err(|e| match e {
        conveyor::engine::Error::Schedule(_) | conveyor::engine::Error::DoesNotFit { .. } | conveyor::engine::Error::InvalidArgument { .. } => {
            usage(e.to_string())
        }
        other => anyhow::Error::new(other),
    })?;
    println!(
        "conveyor train: {model_text} on {} ({} train rows{}), {n_devices} device(s), {schedule}{}, {} micro-batches of {} rows",
        args.data,
        train.len(),
        test.as_ref().map(|t| format!(", {} test rows", t.len())).unwrap_or_default(),
        if args.chunks > 1 { format!(" x{} chunks", args.chunks) } else { String::new() },
        args.microbatches,
        args.batch.div_ceil(args.microbatches),
    );
    for stage in &plan.stages {
        println!(
            "  stage {} on {}: {} ({} parameters)",
            stage.stage_idx,
            trainer.devices()[stage.stage_idx % n_devices],
            stage.node_names.join(" "),
            stage.n_params
        );
    }
    let steps_per_epoch = (train.len() / args.batch) as u64;
    let total_steps = args.steps.unwrap_or(args.epochs * steps_per_epoch).max(1);
    let mut metrics = match &args.metrics {
        Some(path) => Some(std::io::BufWriter::new(
            std::fs::File::create(path).map_err(|e| usage(format!("--metrics {}: {e}", path.display())))?,
        )),
        None => None,
    };
    let started = Instant::now();
    let mut last_report = None;
    let mut samples = 0u64;
    let mut compute_s = 0.0;
    let mut order = Vec::new();
    let (mut last_step_start_s, mut last_step_end_s) = (0.0, 0.0);
    for step in 0..total_steps {
        if let Some(recorder) = &recorder {
            last_step_start_s = recorder.now_s();
        }
        let epoch = step / steps_per_epoch.max(1);
        let within = (step % steps_per_epoch.max(1)) as usize;
        if within == 0 {
            order = data::epoch_order(train.len(), !args.no_shuffle, args.seed, epoch);
        }
        let indices = &order[within * args.batch..(within + 1) * args.batch];
        let (x, y) = train.batch(indices)?;
        let report = trainer.train_step(&x, &y)?;
        if let Some(recorder) = &recorder {
            last_step_end_s = recorder.now_s();
        }
        samples += args.batch as u64;
        compute_s += report.step_s;
        if let Some(out) = metrics.as_mut() {
            writeln!(
                out,
                "{}",
                serde_json::json!({
                    "step": step + 1,
                    "epoch": epoch,
                    "loss": report.loss,
                    "step_s": report.step_s,
                    "samples_per_s": args.batch as f64 / report.step_s,
                    "grad_norm": report.grad_norm,
                    "bubble_fraction": report.timeline.bubble_fraction(),
                })
            )?;
        }
        if args.log_every > 0 && ((step + 1) % args.log_every == 0 || step + 1 == total_steps) {
            println!(
                "step {:>5}/{total_steps}  epoch {epoch}  loss {:.4}  {:.0} samples/s",
                step + 1,
                report.loss,
                args.batch as f64 / report.step_s
            );
        }
        last_report = Some(report);
    }
    let wall_s = started.elapsed().as_secs_f64();
    let report = last_report.expect("at least one step ran");
    let accuracy = match &test {
        Some(test) => {
            let (x, y) = test.batch(&(0..test.len()).collect::<Vec<_>>())?;
            let logits = trainer.predict(&x)?;
            let values = logits.to_vec_f32();
            let correct = y
                .iter()
                .enumerate()
                .filter(|(row, label)| {
                    let row_values = &values[row * n_classes..(row + 1) * n_classes];
                    let best = row_values.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i);
                    best == Some(**label)
                })
                .count();
            Some(correct as f64 / test.len() as f64)
        }
        None => None,
    };
    // Bubble summary: measured on the last step, against theory and the simulator fed the
    // measured per-stage op costs.
    let measured_bubble = report.timeline.bubble_fraction();
    let sched = Schedule::new(schedule, n_devices, args.microbatches, args.chunks)?;
    let theory = simulate(&sched, &CostModel::uniform(StageCosts::UNIT))?.bubble_fraction;
    let predicted = simulate(&sched, &measured_costs(&report.timeline, sched.n_stages()))?.bubble_fraction;
    let inflight = simulated_inflight(schedule, n_devices, args.microbatches, args.chunks)?;
    println!("\ntrained {total_steps} steps in {wall_s:.2} s: {:.0} samples/s", samples as f64 / compute_s);
    println!("final loss {:.4}", report.loss);
    if let Some(acc) = accuracy {
        println!("test accuracy {:.2}% ({} rows)", acc * 100.0, test.as_ref().map_or(0, Dataset::len));
    }
    println!(
        "bubble: measured {:.1}%, simulator with measured costs {:.1}%, schedule theory (equal costs) {:.1}%",
        measured_bubble * 100.0,
        predicted * 100.0,
        theory * 100.0
    );
    let busy = report.timeline.busy_s();
    let makespan = report.timeline.makespan_s();
    for (device_idx, device) in trainer.devices().iter().enumerate() {
        let waiting: f64 = report
            .timeline
            .events
            .iter()
            .filter(|e| e.device_idx == device_idx && e.op == conveyor::schedules::OpKind::Wait)
            .map(|e| e.duration_s())
            .sum::<f64>()
            + 0.0; // an empty f64 sum is -0.0
        println!(
            "  {device}: busy {:.1} ms, idle {:.1} ms (waiting for messages {:.1} ms) of a {:.1} ms step, peak memory {} (micro-batches in flight on its first stage: {})",
            busy[device_idx] * 1e3,
            (makespan - busy[device_idx]) * 1e3,
            waiting * 1e3,
            makespan * 1e3,
            conveyor::engine::placement::format_bytes(report.peak_memory[device_idx]),
            inflight.get(device_idx).copied().unwrap_or(0),
        );
    }
    if let Some(out) = metrics.as_mut() {
        writeln!(
            out,
            "{}",
            serde_json::json!({
                "summary": true,
                "steps": total_steps,
                "final_loss": report.loss,
                "test_accuracy": accuracy,
                "peak_memory_bytes": report.peak_memory,
                "bubble_fraction": measured_bubble,
                "predicted_bubble_fraction": predicted,
                "samples_per_s": samples as f64 / compute_s,
            })
        )?;
        out.flush()?;
    }
    if let Some(recorder) = &recorder {
        let labels: Vec<String> = trainer.devices().iter().map(|d| d.to_string()).collect();
        if let Some(path) = &args.svg {
            let last_step = recorder.timeline_window(last_step_start_s, last_step_end_s, n_devices, sched.n_stages());
            let title = format!("{schedule}, p={n_devices}, m={}, measured (last step)", args.microbatches);
            let options = SvgOptions { title, device_labels: labels.clone(), ..SvgOptions::default() };
            super::write_atomically(path, "--svg", &svg_gantt(&last_step, &options))?;
            println!("wrote the last step's chart to {}", path.display());
        }
        if let Some(path) = &args.trace {
            let memory_samples = recorder
                .memory()
                .into_iter()
                .map(|m| MemorySample { device_idx: m.device_idx, time_s: m.time_s, bytes: m.bytes })
                .collect();
            let options = TraceOptions { device_labels: labels, memory_samples };
            let whole_run = recorder.timeline(n_devices, sched.n_stages());
            super::write_atomically(path, "--trace", &chrome_trace(&whole_run, &options))?;
            println!("wrote a trace of {} ops to {}", whole_run.events.len(), path.display());
        }
    }
    if let Some(path) = &args.save {
        let params = trainer.parameters()?;
        let named: Vec<(String, &conveyor::engine::Tensor)> = params.iter().map(|(n, t)| (n.clone(), t)).collect();
        conveyor::engine::checkpoint::save(path, &named)?;
        println!("saved {} tensors to {}", named.len(), path.display());
    }
    Ok(())
}

/// Per-stage mean op costs measured in a timeline, for the simulator.
fn measured_costs(timeline: &conveyor::schedules::Timeline, n_stages: usize) -> CostModel {
    use conveyor::schedules::OpKind;
    let mut sums = vec![[0.0f64; 4]; n_stages];
    let mut counts = vec![[0usize; 4]; n_stages];
    let (mut optimizer_s, mut optimizer_n) = (0.0, 0usize);
    for event in &timeline.events {
        if event.op == OpKind::OptimizerStep {
            optimizer_s += event.duration_s();
            optimizer_n += 1;
        }
        let Some(stage) = event.stage_idx else { continue };
        let slot = match event.op {
            OpKind::Forward => 0,
            OpKind::BackwardInput => 1,
            OpKind::BackwardWeight => 2,
            OpKind::Backward => 3,
            _ => continue,
        };
        sums[stage][slot] += event.duration_s();
        counts[stage][slot] += 1;
    }
    let mean = |s: usize, k: usize| if counts[s][k] == 0 { 0.0 } else { sums[s][k] / counts[s][k] as f64 };
    let stages = (0..n_stages)
        .map(|s| {
            let (b, w) = if counts[s][3] > 0 {
                // A fused backward: split it evenly so B + W equals the measured fused cost.
                (mean(s, 3) / 2.0, mean(s, 3) / 2.0)
            } else {
                (mean(s, 1), mean(s, 2))
            };
            StageCosts { forward_s: mean(s, 0), backward_input_s: b, backward_weight_s: w }
        })
        .collect();
    CostModel::per_stage(stages).with_optimizer_step_s(if optimizer_n == 0 { 0.0 } else { optimizer_s / optimizer_n as f64 })
}
