//! `conveyor simulate`: builds a schedule, validates it and prints the simulated timeline;
//! optionally writes it as an SVG Gantt chart (`--svg`) and a Chrome trace (`--trace`), and
//! draws a compact chart (`--show`). With `--steps N` it times N optimizer steps in a row,
//! synchronous or overlapped (`--overlap-steps`), and prints the step period.
use super::console::outln;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use conveyor::limits::{MAX_SIMULATED_MICRO_BATCHES, MAX_SIMULATED_PAIRS, MAX_STAGES, MAX_TERMINAL_COLUMNS};
use conveyor_schedules::export::{SvgOptions, TraceOptions, chrome_trace, svg_gantt, terminal_chart};
use conveyor_schedules::{
    CostModel, Link, MessageBytes, Schedule, ScheduleKind, SimulationReport, StageCosts, StageLayout, StepOverlap,
    render_timeline, simulate_steps, validate,
};

/// Channel capacity the schedule is validated with before it is simulated: the tightest
/// bounded channel, one message in flight per (from stage, to stage, direction).
const VALIDATION_CHANNEL_CAPACITY: usize = 1;

/// Arguments of `conveyor simulate`.
#[derive(Args, Debug)]
pub struct SimulateArgs {
    /// Schedule to simulate: gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, dualpipe-v or interleaved-zb.
    #[arg(long, value_name = "NAME")]
    pub schedule: ScheduleKind,
    /// Pipeline depth P: the number of devices (with interleaved, each device holds V chunks). At
    /// most 1024 stages (P x V), 65,536 micro-batches and 2^18 (micro-batch, stage) pairs: a run
    /// past them would take more than about a second.
    #[arg(long, value_name = "P")]
    pub stages: usize,
    /// Micro-batches M per optimizer step.
    #[arg(long, value_name = "M")]
    pub microbatches: usize,
    /// Chunks (virtual stages) per device V; interleaved only, default 2.
    #[arg(long, value_name = "V")]
    pub chunks: Option<usize>,
    /// Seconds per micro-batch per stage of forward, backward-input and backward-weight; a fused
    /// backward costs B + W.
    #[arg(long, value_name = "F,B,W", default_value = "1,1,1")]
    pub costs: String,
    /// Link latency per message between devices, seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 0.0, allow_negative_numbers = true)]
    pub latency: f64,
    /// Link bandwidth, bytes per second (default: unlimited).
    #[arg(long, value_name = "BYTES_PER_S", allow_negative_numbers = true)]
    pub bandwidth: Option<f64>,
    /// Bytes of every activation and gradient message between stages.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub message_bytes: u64,
    /// Data-parallel replicas R of the pipeline: each device all-reduces its stages' gradients
    /// (--gradient-bytes each, a ring over R ranks on the --latency/--bandwidth link:
    /// 2(R-1) messages and 2(R-1)/R of the bytes) when it reaches the optimizer step, before the
    /// commit.
    #[arg(long, value_name = "R", default_value_t = 1)]
    pub data_parallel: usize,
    /// Gradient bytes of each stage, all-reduced across --data-parallel replicas.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub gradient_bytes: u64,
    /// With --data-parallel: `off` runs each device's all-reduce at its optimizer step; a size
    /// (as `train --bucket-size`) runs it in buckets, beside the device's final weight pass
    /// [default: 25MiB].
    #[arg(long, value_name = "SIZE|off")]
    pub bucket_size: Option<String>,
    /// Optimizer steps to time in a row (the figures are then over the whole run, and the step
    /// period is printed). At most 2^18 (micro-batch, stage) pairs over all steps.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub steps: usize,
    /// `on`: overlapped steps (`TrainerBuilder::overlap_steps`): each device applies its update
    /// once it has voted, without waiting for the commit, and starts its next step once it has
    /// applied; `off`: synchronous steps, a barrier after the commit.
    #[arg(long, value_name = "on|off", default_value = "off")]
    pub overlap_steps: String,
    /// Seconds of each device's optimizer step.
    #[arg(long, value_name = "SECONDS", default_value_t = 0.0, allow_negative_numbers = true)]
    pub optimizer_step: f64,
    /// Seconds from the last device's vote to the commit reaching each device (the coordinator's
    /// round trip), which synchronous optimizer steps wait for.
    #[arg(long, value_name = "SECONDS", default_value_t = 0.0, allow_negative_numbers = true)]
    pub commit_latency: f64,
    /// Print one JSON object (makespan, bubble_fraction, peak_inflight, events, ...) instead of text.
    #[arg(long)]
    pub json: bool,
    /// Write the timeline as an SVG Gantt chart (bubbles hatched, bubble fraction in the title).
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Write the timeline as Chrome trace / Perfetto JSON (open in ui.perfetto.dev).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Draw a compact Gantt chart sized to the terminal ($COLUMNS, default 100, at most 1000).
    #[arg(long, conflicts_with = "json")]
    pub show: bool,
}

/// Terminal width for `--show` when `$COLUMNS` is unset or not a number.
const DEFAULT_TERMINAL_COLUMNS: usize = 100;

/// Runs `conveyor simulate`.
pub fn run(args: SimulateArgs) -> anyhow::Result<()> {
    let n_chunks = match (args.chunks, args.schedule.supports_chunks()) {
        (Some(_), false) => {
            return Err(super::usage(format!(
                "--chunks applies only to --schedule interleaved, interleaved-zb, zb-v or dualpipe-v; {} places one \
                 stage per device, drop --chunks",
                args.schedule
            )));
        }
        (Some(n_chunks), true) => n_chunks,
        (None, true) => args.schedule.default_chunks(),
        (None, false) => 1,
    };
    let stage_costs = parse_costs(&args.costs)?;
    if !(args.latency.is_finite() && args.latency >= 0.0) {
        return Err(super::usage(format!("--latency must be a finite number of seconds >= 0, got {}", args.latency)));
    }
    let bandwidth = args.bandwidth.unwrap_or(f64::INFINITY);
    if bandwidth.is_nan() || bandwidth <= 0.0 {
        return Err(super::usage(format!("--bandwidth must be > 0 bytes per second, got {bandwidth}")));
    }
    for (flag, seconds) in [("--optimizer-step", args.optimizer_step), ("--commit-latency", args.commit_latency)] {
        if !(seconds.is_finite() && seconds >= 0.0) {
            return Err(super::usage(format!("{flag} must be a finite number of seconds >= 0, got {seconds}")));
        }
    }
    let overlap = parse_overlap(&args.overlap_steps)?;
    check_size(args.stages, n_chunks, args.microbatches)?;
    check_steps(args.steps, args.stages.saturating_mul(n_chunks).saturating_mul(args.microbatches))?;
    // Undefined shapes are the user's to fix: the message names the flag.
    let schedule = Schedule::new(args.schedule, args.stages, args.microbatches, n_chunks)
        .map_err(|err| super::usage(super::messages::schedule_message(&err)))?;
    validate(&schedule, VALIDATION_CHANNEL_CAPACITY)
        .with_context(|| format!("generated {} schedule failed validation", schedule.kind()))?;
    if args.data_parallel == 0 {
        return Err(super::usage("--data-parallel 0: give at least 1 replica"));
    }
    let buckets: conveyor::spec::BucketSize = match &args.bucket_size {
        Some(text) => text.parse()?,
        None => Default::default(),
    };
    // Each stage's gradients in one all-reduce over the replicas, on the same link model.
    let link = conveyor::engine::placement::Link { latency_s: args.latency, bandwidth_bytes_per_s: bandwidth };
    let stage_all_reduce_s = conveyor::engine::collective::cost_s(
        conveyor::engine::collective::CollectiveOp::AllReduce,
        args.gradient_bytes,
        args.data_parallel,
        &link,
    );
    let device_all_reduce_s: Vec<f64> =
        (0..schedule.n_devices()).map(|d| schedule.stages_of_device(d).count() as f64 * stage_all_reduce_s).collect();
    let costs = CostModel::uniform(stage_costs)
        .with_link(Link { latency_s: args.latency, bandwidth_bytes_per_s: bandwidth })
        .with_message_bytes(MessageBytes { activation_bytes: args.message_bytes, gradient_bytes: args.message_bytes })
        .with_device_all_reduce_s(device_all_reduce_s)
        .with_all_reduce_in_buckets(buckets.bytes().is_some())
        .with_optimizer_step_s(args.optimizer_step)
        .with_commit_latency_s(args.commit_latency);
    let run = simulate_steps(&schedule, &costs, args.steps, overlap).context("simulating the schedule")?;
    // One synchronous step is `simulate`'s timeline; the figures below are over the whole run.
    let step_ends_s: Vec<f64> = run.steps.iter().map(|step| step.end_s).collect();
    let step_period_s = run.step_period_s;
    let report = SimulationReport::from_timeline(run.timeline);
    // The step fields appear only when asked for, so a plain run prints what it always did.
    let several_steps = args.steps > 1 || overlap == StepOverlap::Overlapped;
    let optimizer_costs = args.optimizer_step > 0.0 || args.commit_latency > 0.0;
    if !report.makespan_s.is_finite() {
        return Err(super::usage(format!(
            "--costs {} --latency {} --message-bytes {} over --bandwidth {bandwidth}: the step's time overflows to {} s; \
             give smaller costs or latency, or more bandwidth",
            args.costs, args.latency, args.message_bytes, report.makespan_s
        )));
    }
    if let (Some(svg), Some(trace)) = (&args.svg, &args.trace)
        && super::train::same_output(svg, trace)
    {
        return Err(super::usage(format!(
            "--svg {} and --trace {} name the same file; give each its own path",
            svg.display(),
            trace.display()
        )));
    }
    if let Some(path) = &args.svg {
        let options = SvgOptions {
            title: chart_title(&schedule),
            device_labels: schedule.device_stage_labels(),
            ..SvgOptions::default()
        };
        super::write_atomically(path, "--svg", &svg_gantt(&report.timeline, &options))?;
    }
    if let Some(path) = &args.trace {
        let options = TraceOptions { device_labels: schedule.device_stage_labels(), ..TraceOptions::default() };
        super::write_atomically(path, "--trace", &chrome_trace(&report.timeline, &options))?;
    }
    if args.json {
        let mut output = serde_json::json!({
            "schedule": schedule.kind(),
            "stages": schedule.n_devices(),
            "microbatches": schedule.n_micro_batches(),
            "chunks": schedule.n_chunks(),
            "data_parallel": args.data_parallel,
            "all_reduce_s_per_stage": stage_all_reduce_s,
            "bucket_size": buckets.to_string(),
            "layout": schedule.layout(),
            "stages_of_device": (0..schedule.n_devices())
                .map(|d| schedule.stages_of_device(d).collect::<Vec<_>>())
                .collect::<Vec<_>>(),
            "makespan": report.makespan_s,
            "bubble_fraction": report.bubble_fraction,
            "interior_bubble_fraction": report.interior_bubble_fraction,
            "busy": report.busy_s,
            "peak_inflight": report.peak_inflight,
            "peak_inflight_per_device": report.peak_inflight_per_device,
            "events": report.timeline.events,
        });
        if several_steps || optimizer_costs {
            let fields = output.as_object_mut().context("the JSON output is an object")?;
            fields.insert("steps".into(), args.steps.into());
            fields.insert("overlap_steps".into(), (overlap == StepOverlap::Overlapped).into());
            fields.insert("step_period_s".into(), step_period_s.into());
            fields.insert("step_ends_s".into(), serde_json::to_value(&step_ends_s)?);
            fields.insert("optimizer_step_s".into(), args.optimizer_step.into());
            fields.insert("commit_latency_s".into(), args.commit_latency.into());
        }
        outln!("{}", serde_json::to_string(&output)?);
        return Ok(());
    }
    outln!(
        "schedule {}: p = {} devices, m = {} micro-batches, v = {} chunks per device ({} stages)",
        schedule.kind(),
        schedule.n_devices(),
        schedule.n_micro_batches(),
        schedule.n_chunks(),
        schedule.n_stages()
    );
    outln!(
        "costs F = {} s, B = {} s, W = {} s; F forward, B fused backward, I input gradient, W weight gradient, \
         :c chunk, . idle",
        stage_costs.forward_s,
        stage_costs.backward_input_s,
        stage_costs.backward_weight_s
    );
    if args.data_parallel > 1 {
        outln!(
            "data parallel: {} replicas; each stage all-reduces {} bytes of gradients in {} s (ring on the link), \
             A on the chart, {}, before the commit",
            args.data_parallel,
            args.gradient_bytes,
            stage_all_reduce_s,
            buckets.when()
        );
    }
    if schedule.n_chunks() > 1 {
        let rows: Vec<String> = schedule
            .device_stage_labels()
            .iter()
            .enumerate()
            .map(|(device_idx, label)| format!("dev{device_idx} {label}"))
            .collect();
        let layout = match schedule.layout() {
            StageLayout::Loop => "looped",
            StageLayout::V => "V",
        };
        outln!("placement ({layout}): {}", rows.join("; "));
    }
    if optimizer_costs {
        outln!(
            "optimizer step {} s on every device (O on the chart), commit latency {} s",
            args.optimizer_step,
            args.commit_latency
        );
    }
    if several_steps {
        let how = match overlap {
            StepOverlap::Synchronous => {
                "synchronous (each optimizer step waits for the commit; a barrier between steps)"
            }
            StepOverlap::Overlapped => {
                "overlapped (each device applies once it has voted and starts its next step once it has applied)"
            }
        };
        outln!("{} steps, {how}", args.steps);
    }
    crate::cli::console::out(&render_timeline(&report.timeline));
    outln!("makespan: {} s", report.makespan_s);
    outln!(
        "bubble fraction: {:.4} (inside each device's busy span: {:.4})",
        report.bubble_fraction,
        report.interior_bubble_fraction
    );
    if several_steps {
        outln!("step period: {} s (between the ends of the last two steps; one step: its length)", step_period_s);
    }
    outln!("peak in-flight micro-batches per stage: {:?}", report.peak_inflight);
    if schedule.n_chunks() > 1 {
        outln!("peak in-flight (micro-batch, stage) pairs per device: {:?}", report.peak_inflight_per_device);
    }
    if args.show {
        let columns = std::env::var("COLUMNS")
            .ok()
            .and_then(|columns| columns.trim().parse::<usize>().ok())
            .unwrap_or(DEFAULT_TERMINAL_COLUMNS)
            .min(MAX_TERMINAL_COLUMNS);
        crate::cli::console::out(&terminal_chart(&report.timeline, columns));
    }
    Ok(())
}

/// Refuses a schedule past the limits before it is built: at most [`MAX_STAGES`] stages (devices
/// x chunks), [`MAX_SIMULATED_MICRO_BATCHES`] micro-batches and [`MAX_SIMULATED_PAIRS`]
/// (micro-batch, stage) pairs. Zeros pass, for `Schedule::new` to name.
fn check_size(n_devices: usize, n_chunks: usize, n_micro_batches: usize) -> anyhow::Result<()> {
    let stages = n_devices.checked_mul(n_chunks).filter(|&n| n <= MAX_STAGES).ok_or_else(|| {
        super::usage(format!(
            "--stages {n_devices} with {n_chunks} chunk(s) per device is over the limit of {MAX_STAGES} stages (MAX_STAGES); \
             give fewer stages or chunks"
        ))
    })?;
    if n_micro_batches > MAX_SIMULATED_MICRO_BATCHES {
        return Err(super::usage(format!(
            "--microbatches {n_micro_batches} is over the limit of {MAX_SIMULATED_MICRO_BATCHES} micro-batches \
             (MAX_SIMULATED_MICRO_BATCHES); give fewer"
        )));
    }
    if stages * n_micro_batches > MAX_SIMULATED_PAIRS {
        return Err(super::usage(format!(
            "--stages {n_devices} x --chunks {n_chunks} x --microbatches {n_micro_batches} = {} (micro-batch, stage) pairs \
             is over the limit of {MAX_SIMULATED_PAIRS} (MAX_SIMULATED_PAIRS, about a second of simulation); \
             give fewer stages or micro-batches",
            stages * n_micro_batches
        )));
    }
    Ok(())
}

/// Refuses `--steps 0`, and more steps than [`MAX_SIMULATED_PAIRS`] (micro-batch, stage) pairs
/// over the whole run (`pairs` per step).
fn check_steps(n_steps: usize, pairs: usize) -> anyhow::Result<()> {
    if n_steps == 0 {
        return Err(super::usage("--steps 0: give at least 1 optimizer step to simulate (the default is 1)"));
    }
    if n_steps.saturating_mul(pairs) > MAX_SIMULATED_PAIRS {
        return Err(super::usage(format!(
            "--steps {n_steps} x {pairs} (micro-batch, stage) pairs per step is over the limit of {MAX_SIMULATED_PAIRS} \
             pairs (MAX_SIMULATED_PAIRS, about a second of simulation); give at most {} steps, or fewer stages or \
             micro-batches",
            (MAX_SIMULATED_PAIRS / pairs.max(1)).max(1)
        )));
    }
    Ok(())
}

/// Parses `--overlap-steps on|off`.
fn parse_overlap(text: &str) -> anyhow::Result<StepOverlap> {
    match text {
        "on" => Ok(StepOverlap::Overlapped),
        "off" => Ok(StepOverlap::Synchronous),
        _ => Err(super::usage(format!(
            "--overlap-steps {text:?} is neither on nor off; give --overlap-steps on (apply first, validate after) \
             or off (synchronous steps, the default)"
        ))),
    }
}

/// `1F1B, p=4, m=8` (with `, v=2` for interleaved): the SVG's title, before its bubble fraction.
fn chart_title(schedule: &Schedule) -> String {
    let name = match schedule.kind() {
        ScheduleKind::GPipe => "GPipe",
        ScheduleKind::OneFOneB => "1F1B",
        ScheduleKind::Interleaved => "Interleaved 1F1B",
        ScheduleKind::ZbH1 => "ZB-H1",
        ScheduleKind::ZbH2 => "ZB-H2",
        ScheduleKind::ZbV => "ZB-V",
        ScheduleKind::DualPipeV => "DualPipe-V",
        ScheduleKind::InterleavedZb => "Interleaved zero bubble",
    };
    let mut title = format!("{name}, p={}, m={}", schedule.n_devices(), schedule.n_micro_batches());
    if schedule.n_chunks() > 1 {
        title.push_str(&format!(", v={}", schedule.n_chunks()));
    }
    title
}

/// Parses `F,B,W` seconds.
fn parse_costs(text: &str) -> anyhow::Result<StageCosts> {
    let malformed = |why: String| {
        super::usage(format!("--costs {text:?} is malformed: {why}; give three seconds F,B,W, e.g. --costs 1,1,1"))
    };
    let parts: Vec<&str> = text.split(',').map(str::trim).collect();
    let [forward, backward_input, backward_weight] = parts.as_slice() else {
        return Err(malformed(format!("expected 3 comma-separated numbers, found {}", parts.len())));
    };
    let mut values = [0.0; 3];
    for (value, part) in values.iter_mut().zip([forward, backward_input, backward_weight]) {
        *value = part.parse::<f64>().map_err(|_| malformed(format!("{part:?} is not a number")))?;
        if !(value.is_finite() && *value >= 0.0) {
            return Err(malformed(format!("{part} is not a finite number >= 0")));
        }
    }
    Ok(StageCosts::new(values[0], values[1], values[2]))
}
