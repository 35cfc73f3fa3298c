//! CPU against GPU: square matrix products over sizes 50..10000 and a 3x3 convolution (64 -> 64
//! channels, 32x32 images, padding 1) over batch sizes 1..256, on every available device, printed
//! as a table (size, device, ms, GFLOP/s) and drawn as an SVG plot (GFLOP/s against size, one line
//! per device).
//!
//! Run: `cargo run --release --example device_bench [--features cuda] -- [--max-size N]
//! [--max-batch N] [--svg FILE] [--min-time-ms MS]`.
//!
//! Everything is f32. The CPU device is one core: the engine's single-threaded GEMM
//! (`cpu::matmul`) and, for the convolution, its im2col plus one GEMM per sample. A GPU runs cuBLAS
//! (no TF32), and the convolution as one batched im2col and one strided-batched GEMM.
//! Each measurement runs once untimed (a warm-up: kernel loading and cuBLAS's workspace are no
//! part of an op's cost), then as many times as fit in `--min-time-ms` (at least once); GPU
//! timings include a synchronisation at the end.
#[path = "device_bench/svg.rs"]
mod svg;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use conveyor::engine::CudaDevice;
use conveyor::engine::cpu::{self, MatRef, Window2d};
use conveyor::engine::device::{CudaStream, DeviceMatRef};

#[derive(Parser, Debug)]
#[command(about = "Matrix products and convolutions on the CPU and every GPU: a table and an SVG plot")]
struct Args {
    /// Largest matrix size (sizes 50, 100, 200, 500, 1000, 2000, 5000, 10000 up to this).
    #[arg(long, default_value_t = 10_000)]
    max_size: usize,
    /// Largest convolution batch (batches 1, 2, 4, ..., 256 up to this).
    #[arg(long, default_value_t = 256)]
    max_batch: usize,
    /// Where to write the SVG plot.
    #[arg(long, default_value = "device_bench.svg")]
    svg: PathBuf,
    /// Time budget per measurement, in milliseconds.
    #[arg(long, default_value_t = 200)]
    min_time_ms: u64,
}

const SIZES: [usize; 8] = [50, 100, 200, 500, 1000, 2000, 5000, 10_000];
const BATCHES: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];
const CONV_CHANNELS: usize = 64;
const CONV_IMAGE: usize = 32;

/// Where a measurement runs.
enum Target {
    Cpu,
    Cuda(CudaStream),
}

impl Target {
    fn label(&self) -> String {
        match self {
            Target::Cpu => "cpu (1 core)".to_string(),
            Target::Cuda(stream) => format!("cuda:{} {}", stream.device().ordinal(), stream.device().name()),
        }
    }
}

/// One row of the table.
struct Measurement {
    op: &'static str,
    size: usize,
    target: usize,
    gflops: f64,
}

/// Seeded values in `[-1, 1)`.
fn values(seed: u64, len: usize) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Milliseconds per run: `run` once untimed (a warm-up: the first launch on a GPU loads its
/// kernels and creates the cuBLAS workspace, which is no part of the op's cost), then as many
/// timed runs as fit in `budget` (at least one), then `finish`.
fn time_ms(budget: Duration, mut run: impl FnMut() -> Result<()>, finish: impl Fn() -> Result<()>) -> Result<f64> {
    run()?;
    finish()?;
    let start = Instant::now();
    let mut runs = 0u32;
    while runs == 0 || (start.elapsed() < budget && runs < 10_000) {
        run()?;
        runs += 1;
        if runs.is_power_of_two() {
            finish()?; // keep the queue of a fast GPU from running far ahead of the clock
        }
    }
    finish()?;
    Ok(start.elapsed().as_secs_f64() * 1e3 / f64::from(runs))
}

/// `n x n · n x n` on `target`, in milliseconds.
fn matmul_ms(target: &Target, n: usize, budget: Duration) -> Result<f64> {
    let (a, b) = (values(1, n * n), values(2, n * n));
    match target {
        Target::Cpu => {
            let mut c = vec![0.0f32; n * n];
            let (lhs, rhs) = (MatRef::row_major(&a, n, n)?, MatRef::row_major(&b, n, n)?);
            time_ms(budget, || Ok(cpu::matmul(&mut c, lhs, rhs, false)?), || Ok(()))
        }
        Target::Cuda(stream) => {
            let (a, b) = (stream.upload(&a)?, stream.upload(&b)?);
            let mut c = stream.alloc_zeros::<f32>(n * n)?;
            let (lhs, rhs) = (DeviceMatRef::row_major(&a, n, n)?, DeviceMatRef::row_major(&b, n, n)?);
            time_ms(budget, || Ok(stream.matmul(&mut c, lhs, rhs, false)?), || Ok(stream.synchronize()?))
        }
    }
}

/// The convolution's geometry and FLOPs per sample (`2 · out_channels · col_rows · out_plane`).
fn conv_window() -> Result<(Window2d, f64)> {
    let window = Window2d::new(CONV_CHANNELS, (CONV_IMAGE, CONV_IMAGE), (3, 3), (1, 1), (1, 1))?;
    let flops = 2.0 * CONV_CHANNELS as f64 * window.col_rows() as f64 * window.out_plane_len() as f64;
    Ok((window, flops))
}

/// A forward convolution of `batch` images on `target`, in milliseconds.
fn conv_ms(target: &Target, batch: usize, budget: Duration) -> Result<f64> {
    let (window, _) = conv_window()?;
    let (input_len, col_rows, out_plane) = (window.input_len(), window.col_rows(), window.out_plane_len());
    let input = values(3, batch * input_len);
    let weight = values(4, CONV_CHANNELS * col_rows);
    match target {
        Target::Cpu => {
            let mut col = vec![0.0f32; col_rows * out_plane];
            let mut output = vec![0.0f32; batch * CONV_CHANNELS * out_plane];
            let weight = MatRef::row_major(&weight, CONV_CHANNELS, col_rows)?;
            let run = || -> Result<()> {
                for (x, y) in input.chunks(input_len).zip(output.chunks_mut(CONV_CHANNELS * out_plane)) {
                    cpu::conv::im2col(x, &window, &mut col)?;
                    cpu::matmul(y, weight, MatRef::row_major(&col, col_rows, out_plane)?, false)?;
                }
                Ok(())
            };
            time_ms(budget, run, || Ok(()))
        }
        Target::Cuda(stream) => {
            let (x, w) = (stream.upload(&input)?, stream.upload(&weight)?);
            let mut cols = stream.alloc_zeros::<f32>(batch * col_rows * out_plane)?;
            let mut y = stream.alloc_zeros::<f32>(batch * CONV_CHANNELS * out_plane)?;
            let run = || -> Result<()> {
                stream.im2col(&x, batch, &window, &mut cols)?;
                let cols_view =
                    DeviceMatRef::row_major(&cols, col_rows, out_plane)?.with_batch_stride(col_rows * out_plane);
                stream.matmul_batched(
                    &mut y,
                    DeviceMatRef::row_major(&w, CONV_CHANNELS, col_rows)?,
                    cols_view,
                    batch,
                    false,
                )?;
                Ok(())
            };
            time_ms(budget, run, || Ok(stream.synchronize()?))
        }
    }
}

/// The CPU and every GPU (prints why there is none).
fn targets() -> Vec<Target> {
    let mut targets = vec![Target::Cpu];
    match CudaDevice::count() {
        Err(err) => println!("GPUs skipped: {err}"),
        Ok(0) => println!("GPUs skipped: the CUDA driver sees no GPU"),
        Ok(count) => {
            for ordinal in 0..count {
                let stream = CudaDevice::new(ordinal, None).and_then(|cuda| cuda.new_stream());
                match stream {
                    Ok(stream) => targets.push(Target::Cuda(stream)),
                    Err(err) => println!("cuda:{ordinal} skipped: {err}"),
                }
            }
        }
    }
    targets
}

fn main() -> Result<()> {
    let args = Args::parse();
    let budget = Duration::from_millis(args.min_time_ms);
    let targets = targets();
    let mut rows: Vec<Measurement> = Vec::new();
    println!("{:<8} {:>6}  {:<48} {:>12} {:>12}", "op", "size", "device", "ms", "GFLOP/s");
    let record = |rows: &mut Vec<Measurement>, op, size, target: usize, ms: f64, flops: f64| {
        let gflops = flops / (ms * 1e-3) / 1e9;
        println!("{op:<8} {size:>6}  {:<48} {ms:>12.3} {gflops:>12.1}", targets[target].label());
        rows.push(Measurement { op, size, target, gflops });
    };
    for &n in SIZES.iter().filter(|&&n| n <= args.max_size) {
        for (index, target) in targets.iter().enumerate() {
            let ms = matmul_ms(target, n, budget).with_context(|| format!("matmul {n} on {}", target.label()))?;
            record(&mut rows, "matmul", n, index, ms, 2.0 * (n as f64).powi(3));
        }
    }
    let (_, conv_flops) = conv_window()?;
    for &batch in BATCHES.iter().filter(|&&b| b <= args.max_batch) {
        for (index, target) in targets.iter().enumerate() {
            let ms =
                conv_ms(target, batch, budget).with_context(|| format!("conv batch {batch} on {}", target.label()))?;
            record(&mut rows, "conv2d", batch, index, ms, conv_flops * batch as f64);
        }
    }

    let chart = |op: &str, title: String, x_label: &str| svg::Chart {
        title,
        x_label: x_label.to_string(),
        series: (0..targets.len())
            .map(|index| svg::Series {
                label: targets[index].label(),
                points: rows
                    .iter()
                    .filter(|r| r.op == op && r.target == index)
                    .map(|r| (r.size as f64, r.gflops))
                    .collect(),
            })
            .filter(|series| !series.points.is_empty())
            .collect(),
    };
    let charts = [
        chart("matmul", "Matrix product n x n · n x n".to_string(), "n"),
        chart(
            "conv2d",
            format!("Conv2d 3x3, {CONV_CHANNELS} -> {CONV_CHANNELS} channels, {CONV_IMAGE}x{CONV_IMAGE}, padding 1"),
            "batch",
        ),
    ];
    std::fs::write(&args.svg, svg::render(&charts)).with_context(|| format!("writing {}", args.svg.display()))?;
    println!("wrote {}", args.svg.display());
    Ok(())
}
