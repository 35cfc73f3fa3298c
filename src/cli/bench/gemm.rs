//! The `gemm` suite: GFLOP/s of Conveyor's single-threaded CPU matrix product (`cpu::matmul`, the
//! kernel every CPU Linear and convolution runs) against the matrix shape, the median of several
//! timed repeats, with PyTorch's figure for the same shapes beside it (one thread,
//! `torch.set_num_threads(1)`) when `python3` can import torch.
use std::time::Instant;

use conveyor::engine::cpu::{self, MatRef};
use conveyor::engine::{Device, Tensor};
use serde_json::{Value, json};

use super::Bench;
use super::html::{Chart, ChartBody, Section};

/// One product `[m, k] · [k, n]`.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub m: usize,
    pub k: usize,
    pub n: usize,
}

impl Shape {
    fn label(&self) -> String {
        format!("{}x{}x{}", self.m, self.k, self.n)
    }

    fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.k as f64 * self.n as f64
    }
}

/// The shapes measured: rows of activations through a 1024-wide layer, and square products.
pub fn shapes(quick: bool) -> Vec<Shape> {
    let all: &[(usize, usize, usize)] = if quick {
        &[(32, 1024, 1024), (256, 1024, 1024), (256, 256, 256), (512, 512, 512)]
    } else {
        &[(32, 1024, 1024), (128, 1024, 1024), (256, 1024, 1024), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024)]
    };
    all.iter().map(|&(m, k, n)| Shape { m, k, n }).collect()
}

/// Timed repeats per shape (after one untimed warm-up).
fn repeats(quick: bool) -> usize {
    if quick { 5 } else { 11 }
}

/// `shape`'s seeded values in `[-1, 1)` on `device` (the engine's initialiser).
pub fn values(seed: u64, shape: &[usize], device: &Device) -> anyhow::Result<Tensor> {
    Ok(conveyor::engine::init::uniform(shape.to_vec(), -1.0, 1.0, &mut conveyor::engine::init::rng(seed), device)?)
}

/// The median of `samples` (sorted in place); `NaN` for none.
pub fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    match samples.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => samples[n / 2],
        n => (samples[n / 2 - 1] + samples[n / 2]) / 2.0,
    }
}

/// Median seconds of `repeats` timed calls of `run` after one untimed one.
pub fn median_seconds(repeats: usize, mut run: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    run()?;
    let mut samples = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        let start = Instant::now();
        run()?;
        samples.push(start.elapsed().as_secs_f64());
    }
    Ok(median(&mut samples))
}

/// Conveyor's median seconds for one product of `shape`.
fn conveyor_seconds(shape: Shape, repeats: usize) -> anyhow::Result<f64> {
    let host = Device::host();
    let (a, b) = (values(1, &[shape.m, shape.k], &host)?, values(2, &[shape.k, shape.n], &host)?);
    let mut c = vec![0.0f32; shape.m * shape.n];
    let (a, b) = (a.to_vec_f32(), b.to_vec_f32());
    let (lhs, rhs) = (MatRef::row_major(&a, shape.m, shape.k)?, MatRef::row_major(&b, shape.k, shape.n)?);
    median_seconds(repeats, || Ok(cpu::matmul(&mut c, lhs, rhs, false)?))
}

/// The Python run for PyTorch's figures: one line of JSON, `{"m,k,n": median seconds, ...}`.
const TORCH_SCRIPT: &str = r#"
import json, sys, time, torch
torch.set_num_threads(1)
shapes, repeats = json.loads(sys.argv[1]), int(sys.argv[2])
out = {"version": torch.__version__, "seconds": {}}
for m, k, n in shapes:
    a, b = torch.rand(m, k) * 2 - 1, torch.rand(k, n) * 2 - 1
    c = torch.empty(m, n)
    torch.matmul(a, b, out=c)
    times = []
    for _ in range(repeats):
        t = time.perf_counter(); torch.matmul(a, b, out=c); times.append(time.perf_counter() - t)
    times.sort()
    mid = len(times) // 2
    out["seconds"][f"{m},{k},{n}"] = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
print(json.dumps(out))
"#;

/// PyTorch's figures, or why there are none.
pub enum Torch {
    Ran { version: String, seconds: serde_json::Map<String, Value> },
    Missing(String),
}

/// Runs [`TORCH_SCRIPT`] over `shapes` with `python3` (one thread).
fn torch_seconds(shapes: &[Shape], repeats: usize) -> Torch {
    let list: Vec<[usize; 3]> = shapes.iter().map(|s| [s.m, s.k, s.n]).collect();
    let output = std::process::Command::new("python3")
        .args(["-c", TORCH_SCRIPT, &json!(list).to_string(), &repeats.to_string()])
        .env("OMP_NUM_THREADS", "1")
        .output();
    let output = match output {
        Ok(output) => output,
        Err(e) => return Torch::Missing(format!("PyTorch not installed: python3 could not be started ({e})")),
    };
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        if stderr.contains("No module named 'torch'") || stderr.contains("ModuleNotFoundError") {
            return Torch::Missing("PyTorch not installed (python3 cannot import torch)".into());
        }
        let last = stderr.lines().last().unwrap_or("").to_string();
        return Torch::Missing(format!("PyTorch's run failed: {last}"));
    }
    let parsed: Option<Value> = serde_json::from_slice(&output.stdout).ok();
    match parsed {
        Some(Value::Object(mut map)) => match (map.remove("version"), map.remove("seconds")) {
            (Some(Value::String(version)), Some(Value::Object(seconds))) => Torch::Ran { version, seconds },
            _ => Torch::Missing("PyTorch's run printed an unexpected result".into()),
        },
        _ => Torch::Missing("PyTorch's run printed no JSON".into()),
    }
}

/// Runs the suite: the report's `gemm` object and its section.
pub fn run(bench: &mut Bench) -> anyhow::Result<(Value, Section)> {
    let shapes = shapes(bench.quick);
    let repeats = repeats(bench.quick);
    let mut rows = Vec::new();
    let mut conveyor_gflops = Vec::new();
    for shape in &shapes {
        bench.progress(&format!("gemm {} (Conveyor, 1 thread)", shape.label()));
        let energy = bench.energy.start();
        let seconds = conveyor_seconds(*shape, repeats)?;
        let joules = bench.energy.joules_since(&energy);
        let gflops = shape.flops() / seconds / 1e9;
        conveyor_gflops.push(gflops);
        rows.push(json!({
            "m": shape.m, "k": shape.k, "n": shape.n, "flops": shape.flops(),
            "conveyor_median_s": seconds, "conveyor_gflops": gflops,
            "energy": super::machine::energy_json(&joules),
        }));
    }
    bench.progress("gemm: PyTorch, the same shapes (1 thread)");
    let torch = torch_seconds(&shapes, repeats);
    let mut torch_gflops: Vec<Option<f64>> = vec![None; shapes.len()];
    let torch_json = match &torch {
        Torch::Ran { version, seconds } => {
            for ((shape, row), slot) in shapes.iter().zip(&mut rows).zip(&mut torch_gflops) {
                let key = format!("{},{},{}", shape.m, shape.k, shape.n);
                if let Some(s) = seconds.get(&key).and_then(Value::as_f64).filter(|s| *s > 0.0) {
                    row["torch_median_s"] = s.into();
                    row["torch_gflops"] = (shape.flops() / s / 1e9).into();
                    *slot = Some(shape.flops() / s / 1e9);
                }
            }
            json!({ "available": true, "version": version, "threads": 1 })
        }
        Torch::Missing(reason) => json!({ "available": false, "reason": reason }),
    };
    let mut series = vec![("Conveyor (1 thread)".to_string(), conveyor_gflops.into_iter().map(Some).collect())];
    let mut notes = vec![format!(
        "Single-threaded f32 products [m, k] x [k, n], the median of {repeats} timed repeats after one warm-up; \
         GFLOP/s = 2mkn / median seconds."
    )];
    match &torch {
        Torch::Ran { version, .. } => series.push((format!("PyTorch {version} (1 thread)"), torch_gflops)),
        Torch::Missing(reason) => notes.push(format!("{reason}: no PyTorch figures.")),
    }
    let chart = Chart {
        title: "Matrix product throughput by shape".into(),
        x_label: "shape m x k x n".into(),
        y_label: "GFLOP/s".into(),
        body: ChartBody::Bars { categories: shapes.iter().map(Shape::label).collect(), series },
    };
    let section = Section { title: "gemm: GFLOP/s by matrix shape".into(), notes, charts: vec![chart], tables: vec![] };
    Ok((json!({ "repeats": repeats, "threads": 1, "shapes": rows, "torch": torch_json }), section))
}
