//! The `schedules` suite: every schedule Conveyor has, run for real on CPU devices (one worker
//! thread per device) at several micro-batch counts, its measured bubble fraction beside the
//! simulator's (fed the run's measured op costs) and schedule theory's (equal costs, free
//! messages), all three from the engine's bubble report (`Trainer::bubbles`, the figures
//! `conveyor train` prints); and throughput (samples per second) against stages and micro-batches.
use conveyor::engine::Device;
use conveyor::pipeline::{PipelineConfig, build_trainer};
use conveyor::schedules::{Schedule, ScheduleKind};
use conveyor::zoo::mlp;
use serde_json::{Value, json};

use super::Bench;
use super::html::{Chart, ChartBody, Section, Table, figure};

/// Rows per step: big enough that an op outweighs a message's latency.
const BATCH_ROWS: usize = 256;
/// The model: an MLP of 1024-wide layers (the `bubbles` example's), enough layers for 4 devices
/// of 2 chunks each.
const DIMS: [usize; 10] = [256, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 10];

/// What one (schedule, devices, micro-batches) run measured, or why it did not run.
struct Run {
    kind: ScheduleKind,
    n_devices: usize,
    n_micro_batches: usize,
    result: Result<Measured, String>,
}

struct Measured {
    measured: f64,
    simulated: f64,
    theory: f64,
    samples_per_s: f64,
    step_s: f64,
    steps: usize,
    energy: Value,
}

/// Trains `steps` steps after `warmup` and reports the engine's bubble figures over the measured ones.
fn measure(bench: &Bench, kind: ScheduleKind, n_devices: usize, n_micro_batches: usize) -> Result<Measured, String> {
    let n_chunks = kind.default_chunks();
    Schedule::new(kind, n_devices, n_micro_batches, n_chunks)
        .map_err(|e| super::super::messages::schedule_message(&e))?;
    let config = PipelineConfig::new(kind, n_micro_batches, BATCH_ROWS);
    let devices: Vec<Device> = (0..n_devices).map(Device::cpu).collect();
    let graph = mlp(&DIMS, 0).map_err(|e| e.to_string())?;
    let (_, mut trainer) = build_trainer(graph, devices, &config).map_err(|e| e.to_string())?;
    let data = conveyor::data::synthetic(BATCH_ROWS, DIMS[0], DIMS[DIMS.len() - 1], 0).map_err(|e| e.to_string())?;
    let (x, y) = data.batch(&(0..BATCH_ROWS).collect::<Vec<_>>()).map_err(|e| e.to_string())?;
    let (warmup, steps) = if bench.quick { (1, 3) } else { (2, 6) };
    for _ in 0..warmup {
        trainer.train_step(&x, &y).map_err(|e| e.to_string())?;
    }
    let energy = bench.energy.start();
    let mut reports = Vec::with_capacity(steps);
    for _ in 0..steps {
        reports.push(trainer.train_step(&x, &y).map_err(|e| e.to_string())?);
    }
    let joules = bench.energy.joules_since(&energy);
    let bubbles = trainer.bubbles(&reports).map_err(|e| e.to_string())?;
    let mut step_times: Vec<f64> = reports.iter().map(|r| r.step_s).collect();
    let step_s = super::gemm::median(&mut step_times);
    Ok(Measured {
        measured: bubbles.measured_fraction,
        simulated: bubbles.simulated_fraction,
        theory: bubbles.theory_fraction,
        samples_per_s: BATCH_ROWS as f64 / step_s,
        step_s,
        steps,
        energy: super::machine::energy_json(&joules),
    })
}

/// Runs the suite: the report's `schedules` object and its section.
pub fn run(bench: &mut Bench) -> anyhow::Result<(Value, Section)> {
    let micro_batch_counts: &[usize] = if bench.quick { &[4, 8] } else { &[2, 4, 8] };
    let device_counts: &[usize] = if bench.quick { &[2] } else { &[2, 4] };
    let mut runs = Vec::new();
    for &n_devices in device_counts {
        for kind in ScheduleKind::ALL {
            for &n_micro_batches in micro_batch_counts {
                bench.progress(&format!("schedules {kind}, {n_devices} devices, {n_micro_batches} micro-batches"));
                let result = measure(bench, kind, n_devices, n_micro_batches);
                runs.push(Run { kind, n_devices, n_micro_batches, result });
            }
        }
    }
    bench.progress("schedules: 1 device, the throughput baseline");
    let baseline = measure(bench, ScheduleKind::OneFOneB, 1, 1);

    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let mut notes = vec![format!(
        "An MLP {DIMS:?} (ReLU), batch {BATCH_ROWS}, SGD, f32, on cpu devices (one worker thread each) of a machine with \
         {cores} core(s). Bubble = idle time / (devices x makespan), mean over the measured steps. \"simulated\" is the \
         simulator fed each step's measured op costs on this machine's cores; \"theory\" is the simulator with equal \
         op costs and free messages."
    )];
    if device_counts.iter().any(|&d| d > cores) {
        notes.push(format!(
            "With more devices than the {cores} core(s) here the workers share cores: the measured bubble then includes \
             waits for a core, which the simulator models with core slots."
        ));
    }
    let skipped: Vec<String> = runs
        .iter()
        .filter_map(|r| {
            r.result
                .as_ref()
                .err()
                .map(|e| format!("{} on {} devices, M={}: {e}", r.kind, r.n_devices, r.n_micro_batches))
        })
        .collect();
    if !skipped.is_empty() {
        notes.push(format!("Not run (the schedule's own rules): {}", skipped.join(" | ")));
    }

    let mut charts = Vec::new();
    for &n_devices in device_counts {
        let here: Vec<&Run> = runs.iter().filter(|r| r.n_devices == n_devices && r.result.is_ok()).collect();
        let categories: Vec<String> = here.iter().map(|r| format!("{} M={}", r.kind, r.n_micro_batches)).collect();
        let pick = |f: fn(&Measured) -> f64| -> Vec<Option<f64>> {
            here.iter().map(|r| r.result.as_ref().ok().map(|m| 100.0 * f(m))).collect()
        };
        charts.push(Chart {
            title: format!("Bubble fraction, {n_devices} cpu devices: measured, simulated, theory"),
            x_label: "schedule and micro-batches M".into(),
            y_label: "bubble (% of device time)".into(),
            body: ChartBody::Bars {
                categories,
                series: vec![
                    ("measured".into(), pick(|m| m.measured)),
                    ("simulated (measured costs)".into(), pick(|m| m.simulated)),
                    ("theory (equal costs)".into(), pick(|m| m.theory)),
                ],
            },
        });
    }
    // Throughput of 1F1B against micro-batches, one line per device count.
    let mut lines = Vec::new();
    for &n_devices in device_counts {
        let points: Vec<(f64, f64)> = runs
            .iter()
            .filter(|r| r.kind == ScheduleKind::OneFOneB && r.n_devices == n_devices)
            .filter_map(|r| r.result.as_ref().ok().map(|m| (r.n_micro_batches as f64, m.samples_per_s)))
            .collect();
        lines.push((format!("1F1B, {n_devices} devices"), points));
    }
    if let Ok(base) = &baseline {
        let points = micro_batch_counts.iter().map(|&m| (m as f64, base.samples_per_s)).collect();
        lines.push(("1 device (no pipeline)".into(), points));
    }
    charts.push(Chart {
        title: "1F1B throughput against micro-batches and stages".into(),
        x_label: "micro-batches per step".into(),
        y_label: "samples per second".into(),
        body: ChartBody::Lines { series: lines },
    });
    let table = Table {
        caption: "Every run (median step time over the measured steps)".into(),
        header: ["schedule", "devices", "M", "measured %", "simulated %", "theory %", "step ms", "samples/s"]
            .map(String::from)
            .to_vec(),
        rows: runs
            .iter()
            .filter_map(|r| {
                let m = r.result.as_ref().ok()?;
                Some(vec![
                    r.kind.to_string(),
                    r.n_devices.to_string(),
                    r.n_micro_batches.to_string(),
                    figure(100.0 * m.measured),
                    figure(100.0 * m.simulated),
                    figure(100.0 * m.theory),
                    figure(1e3 * m.step_s),
                    figure(m.samples_per_s),
                ])
            })
            .collect(),
    };
    let runs_json: Vec<Value> = runs
        .iter()
        .map(|r| {
            let mut row =
                json!({ "schedule": r.kind.to_string(), "devices": r.n_devices, "micro_batches": r.n_micro_batches });
            match &r.result {
                Ok(m) => {
                    row["measured_bubble"] = m.measured.into();
                    row["simulated_bubble"] = m.simulated.into();
                    row["theory_bubble"] = m.theory.into();
                    row["median_step_s"] = m.step_s.into();
                    row["samples_per_s"] = m.samples_per_s.into();
                    row["measured_steps"] = m.steps.into();
                    row["energy"] = m.energy.clone();
                }
                Err(reason) => row["skipped"] = reason.clone().into(),
            }
            row
        })
        .collect();
    let baseline_json = match &baseline {
        Ok(m) => json!({ "devices": 1, "median_step_s": m.step_s, "samples_per_s": m.samples_per_s }),
        Err(reason) => json!({ "skipped": reason }),
    };
    let json = json!({
        "model": format!("mlp:{}", DIMS.map(|d| d.to_string()).join(",")),
        "batch_rows": BATCH_ROWS,
        "cores": cores,
        "runs": runs_json,
        "one_device_baseline": baseline_json,
    });
    let section =
        Section { title: "schedules: measured against simulated bubbles".into(), notes, charts, tables: vec![table] };
    Ok((json, section))
}
