//! `conveyor bench`: the benchmarks behind the reports in one command. It checks every input
//! before any work (the suite, the devices, the output directory: a bad one exits 2 naming the
//! flag and what it accepts), runs the suites with a progress line per measured item on stderr,
//! and writes `DIR/report.json` (every figure, the machine and the build) and `DIR/report.html`
//! (inline CSS and SVG, nothing fetched), each atomically (`cli::write_atomically`), so a run
//! that fails leaves the previous report whole.
//!
//! Code map: `gemm.rs`, `schedules.rs`, `seeds.rs` and `sync.rs` are the suites; `machine.rs` reads the
//! machine, the build and the RAPL energy counters; `html.rs` draws the page.
mod gemm;
mod html;
mod machine;
mod schedules;
mod seeds;
mod sync;

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use conveyor::engine::{CudaDevice, Device};
use serde_json::{Value, json};

use super::console::{errln, outln};
use super::usage;
use html::Table;
use machine::EnergyMeter;

/// The suites, as `--suite` names them.
const SUITES: &str = "seeds, gemm, schedules, sync or all";

/// Arguments of `conveyor bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Which benchmarks: seeds (devices, zoo models, ResNet training, energy), gemm (GFLOP/s by
    /// matrix shape, with PyTorch's beside it), schedules (measured against simulated bubbles),
    /// sync (data-parallel strategies side by side: accuracy against time and bytes) or all.
    #[arg(long, value_name = "NAME")]
    pub suite: String,
    /// Fewer shapes, micro-batch counts, steps and epochs (the seeds suite within 3 minutes on 2 cores).
    #[arg(long)]
    pub quick: bool,
    /// Devices for the seeds suite's per-device figures, in `train --devices`'s grammar (`cpu:1`,
    /// `cpu:0-0,cuda:0`, ...); every one must be present. gemm and schedules run on the CPU
    /// whatever this says.
    #[arg(long, value_name = "LIST", default_value = "cpu:1")]
    pub devices: String,
    /// Directory for report.json and report.html (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

/// A suite `--suite` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Suite {
    Seeds,
    Gemm,
    Schedules,
    Sync,
}

impl Suite {
    fn name(self) -> &'static str {
        match self {
            Suite::Seeds => "seeds",
            Suite::Gemm => "gemm",
            Suite::Schedules => "schedules",
            Suite::Sync => "sync",
        }
    }
}

/// `--suite`: the suites to run, in report order.
fn parse_suites(text: &str) -> anyhow::Result<Vec<Suite>> {
    match text {
        "seeds" => Ok(vec![Suite::Seeds]),
        "gemm" => Ok(vec![Suite::Gemm]),
        "schedules" => Ok(vec![Suite::Schedules]),
        "sync" => Ok(vec![Suite::Sync]),
        "all" => Ok(vec![Suite::Gemm, Suite::Schedules, Suite::Seeds, Suite::Sync]),
        other => Err(usage(format!("--suite `{other}` is not a suite; give one of {SUITES}"))),
    }
}

/// The GPUs this machine offers, by name, or why there are none.
fn gpus() -> (Vec<String>, String) {
    match CudaDevice::count() {
        Err(e) => (Vec::new(), format!("no GPU found ({e})")),
        Ok(0) => (Vec::new(), "no GPU found: the CUDA driver sees no GPU".into()),
        Ok(n) => {
            let names = (0..n)
                .map(|i| match CudaDevice::new(i, None) {
                    Ok(device) => format!("cuda:{i} {}", device.name()),
                    Err(e) => format!("cuda:{i} (cannot open: {e})"),
                })
                .collect();
            (names, format!("{n} GPU(s) found"))
        }
    }
}

/// `--devices`: parsed with the one device grammar and opened, so a device that is not here is
/// refused now; duplicates dropped.
fn parse_devices(text: &str, gpu_names: &[String]) -> anyhow::Result<Vec<Device>> {
    let gpus = if gpu_names.is_empty() { "no GPU".to_string() } else { gpu_names.join(", ") };
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let devices = conveyor::engine::Device::parse_list(text).map_err(|e| {
        usage(format!(
            "--devices `{text}`: {e}; this machine offers cpu devices (cpu:1 for one, cpu:0-0,cuda:0 for a list; \
             {cores} core(s)) and {gpus}"
        ))
    })?;
    let mut unique: Vec<Device> = Vec::new();
    for device in devices {
        if !unique.iter().any(|d| d.to_string() == device.to_string()) {
            unique.push(device);
        }
    }
    Ok(unique)
}

/// `--out`: a directory (created if missing) where report.json and report.html can be written.
fn prepare_out(dir: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    match std::fs::metadata(dir) {
        Ok(metadata) if !metadata.is_dir() => {
            return Err(usage(format!(
                "--out {}: not a directory; give a directory for report.json and report.html (created if missing)",
                dir.display()
            )));
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::create_dir_all(dir).map_err(|e| {
            usage(format!("--out {}: cannot create the directory ({e}); give a writable directory", dir.display()))
        })?,
        Err(e) => {
            return Err(usage(format!("--out {}: cannot use it ({e}); give a writable directory", dir.display())));
        }
    }
    let (json_path, html_path) = (dir.join("report.json"), dir.join("report.html"));
    for path in [&json_path, &html_path] {
        conveyor::engine::output_file::check_output(path).map_err(|e| super::output_error("--out", path, e))?;
    }
    Ok((json_path, html_path))
}

/// What the suites share: the options, the energy meter, the devices and the progress display.
pub struct Bench {
    pub quick: bool,
    pub energy: EnergyMeter,
    /// NVIDIA GPUs' energy (NVML).
    pub gpu_energy: machine::GpuEnergyMeter,
    pub devices: Vec<Device>,
    started: Instant,
    items: usize,
    /// A bar over the suites on stderr with the item being measured, drawn only when stderr is a
    /// terminal; hidden otherwise (logs, CI), where each item gets a line instead.
    bar: indicatif::ProgressBar,
}

impl Bench {
    /// Shows the item about to be measured: on the bar, or as a line on stderr when the bar is
    /// hidden.
    pub fn progress(&mut self, item: &str) {
        self.items += 1;
        if self.bar.is_hidden() {
            errln!("bench [{:>3}] {:>6.1} s  {item}", self.items, self.started.elapsed().as_secs_f64());
        } else {
            self.bar.set_message(format!("[{}] {item}", self.items));
        }
    }
}

/// The bar over `n_suites` suites on stderr (hidden unless stderr is a terminal).
fn suite_bar(n_suites: usize) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::with_draw_target(Some(n_suites as u64), indicatif::ProgressDrawTarget::stderr());
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "bench {elapsed_precise} [{bar:24.cyan/dim}] {pos}/{len} suites  {wide_msg}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    bar
}

/// Runs `conveyor bench`.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let suites = parse_suites(&args.suite)?;
    let (gpu_names, gpu_note) = gpus();
    let devices = parse_devices(&args.devices, &gpu_names)?;
    let (json_path, html_path) = prepare_out(&args.out)?;

    let bar = suite_bar(suites.len());
    let mut bench = Bench {
        quick: args.quick,
        energy: EnergyMeter::open(),
        gpu_energy: machine::GpuEnergyMeter::open(),
        devices,
        started: Instant::now(),
        items: 0,
        bar,
    };
    let mut report = json!({
        "report": "conveyor bench",
        "suite": args.suite,
        "quick": args.quick,
        "devices": bench.devices.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "build": machine::build_info(),
        "machine": machine::machine_info(&gpu_names, &gpu_note),
        "energy": { "cpu_rapl": bench.energy.describe(), "gpu_nvml": bench.gpu_energy.describe() },
        "started_unix_s": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()),
        "suites": {},
    });
    let mut sections = Vec::new();
    for suite in suites {
        let (json, section) = match suite {
            Suite::Gemm => gemm::run(&mut bench)?,
            Suite::Schedules => schedules::run(&mut bench)?,
            Suite::Seeds => seeds::run(&mut bench)?,
            Suite::Sync => sync::run(&mut bench, &args.out)?,
        };
        report["suites"][suite.name()] = json;
        sections.push(section);
        bench.bar.inc(1);
    }
    bench.bar.finish_and_clear();
    report["elapsed_s"] = bench.started.elapsed().as_secs_f64().into();
    report["machine"]["load_average_at_end"] = json!(machine::load_average());

    let meta = meta_tables(&report);
    let title = format!("Conveyor bench: {}", args.suite);
    let text = serde_json::to_string_pretty(&report)? + "\n";
    super::write_atomically(&json_path, "--out", &text)?;
    super::write_atomically(&html_path, "--out", &html::page(&title, &meta, &sections))?;
    outln!(
        "wrote {} and {} ({:.1} s)",
        json_path.display(),
        html_path.display(),
        bench.started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The machine, build and energy tables at the top of the page.
fn meta_tables(report: &Value) -> Vec<Table> {
    let text = |v: &Value| match v {
        Value::String(s) => s.clone(),
        Value::Null => "not available".to_string(),
        other => other.to_string(),
    };
    let machine = &report["machine"];
    let build = &report["build"];
    let rapl = &report["energy"]["cpu_rapl"];
    let nvml = &report["energy"]["gpu_nvml"];
    let gpu_energy_text = if nvml["available"].as_bool() == Some(true) {
        format!("NVML: {}", text(&nvml["gpus"]))
    } else {
        format!("unavailable: {}", text(&nvml["reason"]))
    };
    let rapl_text = if rapl["available"].as_bool() == Some(true) {
        format!("RAPL zones {}", text(&rapl["zones"]))
    } else {
        format!("unavailable: {}", text(&rapl["reason"]))
    };
    vec![
        Table {
            caption: "Machine".into(),
            header: vec!["".into(), "".into()],
            rows: vec![
                vec!["CPU".into(), text(&machine["cpu_model"])],
                vec!["SIMD".into(), text(&machine["cpu_simd"])],
                vec!["logical cores online".into(), text(&machine["logical_cores_online"])],
                vec![
                    "load average (1, 5, 15 min)".into(),
                    format!(
                        "{} at start, {} at end",
                        text(&machine["load_average_at_start"]),
                        text(&machine["load_average_at_end"])
                    ),
                ],
                vec!["OS".into(), format!("{} (kernel {})", text(&machine["os"]), text(&machine["kernel"]))],
                vec!["GPUs".into(), text(&machine["gpu_note"])],
            ],
        },
        Table {
            caption: "Build and run".into(),
            header: vec!["".into(), "".into()],
            rows: vec![
                vec!["Conveyor".into(), text(&build["conveyor_version"])],
                vec!["commit".into(), text(&build["git_commit"])],
                vec![
                    "suite".into(),
                    format!("{}{}", text(&report["suite"]), if report["quick"] == true { " --quick" } else { "" }),
                ],
                vec!["run time".into(), format!("{:.1} s", report["elapsed_s"].as_f64().unwrap_or(f64::NAN))],
                vec!["CPU energy".into(), rapl_text],
                vec!["GPU energy".into(), gpu_energy_text],
            ],
        },
    ]
}
