//! One test written once, run on every device present (as candle's `test_device!`): each case
//! becomes one libtest trial per device, named `case[cpu]`, `case[cuda:0]`, ...; each trial opens
//! its own device handle (its own ledger), so trials run in parallel without sharing counts.
//!
//! Without a GPU (no `cuda` feature, no driver, or no device) each case's GPU trial is still
//! listed, as `case[cuda]`, and reported **ignored** by name, never counted as passed; the reason
//! is printed once. With `CONVEYOR_REQUIRE_CUDA` set (as `scripts/gpu-check` does on a GPU
//! machine) those trials fail instead, naming why the GPU could not be used.
//!
//! Test files using it set `harness = false` and call [`run`] from `main`.
#![allow(dead_code)]

use std::process::ExitCode;
use std::sync::Arc;

use conveyor_engine::{CudaDevice, Device};
use libtest_mimic::{Arguments, Failed, Trial};

/// Set to make a missing GPU a failure instead of an ignored trial.
pub const REQUIRE_CUDA_ENV: &str = "CONVEYOR_REQUIRE_CUDA";

/// Which devices a case runs on.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum On {
    /// The CPU and every GPU.
    EveryDevice,
    /// Every GPU only (the case checks something only a GPU has).
    Gpus,
}

/// A case: its name, where it runs, and its body, given a freshly opened target.
pub struct Case<T> {
    pub name: &'static str,
    pub on: On,
    pub body: fn(&T) -> anyhow::Result<()>,
}

impl<T> Case<T> {
    pub const fn every_device(name: &'static str, body: fn(&T) -> anyhow::Result<()>) -> Self {
        Case { name, on: On::EveryDevice, body }
    }
    pub const fn gpus(name: &'static str, body: fn(&T) -> anyhow::Result<()>) -> Self {
        Case { name, on: On::Gpus, body }
    }
}

/// A case that needs no target (it runs once, as `name`).
pub struct Plain {
    pub name: &'static str,
    pub body: fn() -> anyhow::Result<()>,
}

/// Opens a fresh target of one kind: `Device::cpu(0)`, a handle of `cuda:N`, a stream on it.
pub type Opener<T> = Arc<dyn Fn() -> anyhow::Result<T> + Send + Sync>;

/// The devices present: the CPU's opener, one opener per usable GPU (labelled `cuda:N`), and why
/// there are none (or why one could not be opened).
pub struct Targets<T> {
    pub cpu: Opener<T>,
    pub gpus: Vec<(String, Opener<T>)>,
    pub missing: Option<String>,
}

/// The usable GPUs' ordinals, or why there are none (each ordinal is opened once to check).
pub fn gpu_ordinals() -> Result<Vec<usize>, String> {
    let count = match CudaDevice::count() {
        Ok(0) => return Err("the CUDA driver sees no GPU".to_string()),
        Ok(count) => count,
        Err(err) => return Err(err.to_string()),
    };
    let mut usable = Vec::new();
    for ordinal in 0..count {
        match Device::cuda(ordinal, None) {
            Ok(_) => usable.push(ordinal),
            Err(err) => return Err(format!("cuda:{ordinal} could not be opened: {err}")),
        }
    }
    Ok(usable)
}

/// Targets that are plain `Device`s: `cpu:0`, and a fresh handle of each GPU per trial.
pub fn devices() -> Targets<Device> {
    let cpu: Opener<Device> = Arc::new(|| Ok(Device::cpu(0)));
    match gpu_ordinals() {
        Err(why) => Targets { cpu, gpus: Vec::new(), missing: Some(why) },
        Ok(ordinals) => Targets {
            cpu,
            gpus: ordinals
                .into_iter()
                .map(|ordinal| {
                    let open: Opener<Device> = Arc::new(move || Ok(Device::cuda(ordinal, None)?));
                    (format!("cuda:{ordinal}"), open)
                })
                .collect(),
            missing: None,
        },
    }
}

/// Runs every case on every target (and the plain cases once) under libtest's command line
/// (`--list`, filters, `--test-threads`, `--nocapture`, `--ignored`).
pub fn run<T: 'static>(plain: &[Plain], cases: &[Case<T>], targets: Targets<T>) -> ExitCode {
    let args = Arguments::from_args();
    let required = std::env::var_os(REQUIRE_CUDA_ENV).is_some();
    let mut trials = Vec::new();
    for case in plain {
        let body = case.body;
        trials.push(Trial::test(case.name, move || body().map_err(failed)));
    }
    for case in cases {
        let body = case.body;
        let mut on: Vec<(&str, &Opener<T>)> = Vec::new();
        if case.on == On::EveryDevice {
            on.push(("cpu", &targets.cpu));
        }
        on.extend(targets.gpus.iter().map(|(label, open)| (label.as_str(), open)));
        for (label, open) in on {
            let open = Arc::clone(open);
            let name = format!("{}[{label}]", case.name);
            let context = name.clone();
            trials.push(Trial::test(name, move || {
                let target = open().map_err(|err| failed(err.context(format!("opening the target of {context}"))))?;
                body(&target).map_err(failed)
            }));
        }
        if let Some(why) = &targets.missing {
            let why = why.clone();
            let trial = Trial::test(format!("{}[cuda]", case.name), move || {
                Err(format!("{REQUIRE_CUDA_ENV} is set, but the CUDA case cannot run: {why}").into())
            });
            trials.push(if required { trial } else { trial.with_ignored_flag(true) });
        }
    }
    if let Some(why) = &targets.missing {
        let what = if required { "fail" } else { "are listed as ignored" };
        println!("CUDA cases ([cuda]) {what}: {why}");
    }
    libtest_mimic::run(&args, trials).exit_code()
}

/// A case's error, with its chain of causes, as libtest's failure message.
fn failed(err: anyhow::Error) -> Failed {
    format!("{err:#}").into()
}
