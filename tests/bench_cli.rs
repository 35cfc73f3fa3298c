//! `conveyor bench` end to end: runs the built binary's quickest suite (`--suite gemm --quick`,
//! a few seconds, most of them PyTorch's start when it is installed) and checks report.json's keys
//! and figures and report.html's charts; and that every bad input exits 2 before writing anything.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, Result, ensure};
use serde_json::Value;

fn conveyor(args: &[&str]) -> Result<Output> {
    Command::new(env!("CARGO_BIN_EXE_conveyor")).args(args).output().context("running conveyor")
}

/// A directory under the system's temporary directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let path = std::env::temp_dir().join(format!("conveyor-bench-cli-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
        let _ = std::fs::remove_file(&self.0);
    }
}

fn positive(value: &Value, what: &str) -> Result<f64> {
    let x = value.as_f64().with_context(|| format!("{what} is not a number: {value}"))?;
    ensure!(x.is_finite() && x > 0.0, "{what} = {x}, not a positive figure");
    Ok(x)
}

/// Every `<svg ...>` opening tag's width and height.
fn svg_sizes(html: &str) -> Vec<(f64, f64)> {
    let attribute = |tag: &str, name: &str| -> f64 {
        let key = format!(" {name}=\"");
        tag.find(&key)
            .and_then(|at| tag[at + key.len()..].split('"').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    html.match_indices("<svg")
        .map(|(at, _)| {
            let tag = &html[at..at + html[at..].find('>').unwrap_or(0)];
            (attribute(tag, "width"), attribute(tag, "height"))
        })
        .collect()
}

#[test]
fn gemm_quick_writes_a_report_with_figures_and_drawn_charts() -> Result<()> {
    let dir = TempDir::new("gemm");
    let out = dir.0.to_str().context("a UTF-8 temporary path")?;
    let output = conveyor(&["bench", "--suite", "gemm", "--quick", "--out", out])?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(output.status.success(), "bench failed: {stderr}");
    ensure!(stderr.contains("gemm 32x1024x1024"), "no progress line on stderr: {stderr}");

    let report: Value = serde_json::from_str(&std::fs::read_to_string(dir.0.join("report.json"))?)?;
    for key in ["build", "machine", "energy", "suites", "elapsed_s"] {
        ensure!(!report[key].is_null(), "report.json lacks {key}");
    }
    ensure!(report["build"]["conveyor_version"] == env!("CARGO_PKG_VERSION"));
    positive(&report["machine"]["logical_cores_online"], "logical_cores_online")?;
    // Energy: either figures or a reason, never both missing.
    let rapl = &report["energy"]["cpu_rapl"];
    ensure!(rapl["available"] == true || rapl["reason"].as_str().is_some_and(|r| !r.is_empty()), "{rapl}");
    let gemm = &report["suites"]["gemm"];
    let shapes = gemm["shapes"].as_array().context("gemm.shapes")?;
    ensure!(shapes.len() >= 3, "{} shapes", shapes.len());
    let torch_ran = gemm["torch"]["available"] == true;
    if !torch_ran {
        let reason = gemm["torch"]["reason"].as_str().context("torch.reason")?;
        ensure!(reason.contains("PyTorch"), "{reason}");
    }
    for shape in shapes {
        let flops = positive(&shape["flops"], "flops")?;
        let seconds = positive(&shape["conveyor_median_s"], "conveyor_median_s")?;
        let gflops = positive(&shape["conveyor_gflops"], "conveyor_gflops")?;
        ensure!((gflops - flops / seconds / 1e9).abs() <= 1e-9 * gflops, "GFLOP/s is not flops / seconds: {shape}");
        if torch_ran {
            positive(&shape["torch_gflops"], "torch_gflops")?;
        }
    }

    let html = std::fs::read_to_string(dir.0.join("report.html"))?;
    ensure!(html.starts_with("<!DOCTYPE html>") && html.trim_end().ends_with("</html>"));
    ensure!(
        !html.contains("<script") && !html.contains("http://fonts") && !html.contains("<link"),
        "external resources"
    );
    let sizes = svg_sizes(&html);
    ensure!(!sizes.is_empty(), "report.html has no <svg>");
    ensure!(sizes.iter().all(|&(w, h)| w > 0.0 && h > 0.0), "an <svg> without a size: {sizes:?}");
    ensure!(html.contains("GFLOP/s") && html.contains("<rect x="), "the chart has no labelled axis or no bars");
    // No temporary file is left beside the report.
    let names: Vec<String> = std::fs::read_dir(&dir.0)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    ensure!(names.len() == 2, "expected report.json and report.html only, found {names:?}");
    Ok(())
}

/// Runs `bench` with `args` and checks it exits 2 naming `needle`, and that `out` was not
/// written (not created when it did not exist; no report in it when it did).
fn refused(args: &[&str], needle: &str, out: &Path) -> Result<()> {
    let existed = out.exists();
    let output = conveyor(args)?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(output.status.code() == Some(2), "{args:?} exited with {:?}: {stderr}", output.status.code());
    ensure!(stderr.contains(needle), "{args:?}: stderr {stderr:?} lacks {needle:?}");
    ensure!(!stderr.contains("bench ["), "{args:?} started measuring before refusing: {stderr}");
    if existed {
        ensure!(!out.join("report.json").exists() && !out.join("report.html").exists(), "{args:?} wrote a report");
    } else {
        ensure!(!out.exists(), "{args:?} created {}", out.display());
    }
    Ok(())
}

#[test]
fn bad_input_exits_2_before_any_work() -> Result<()> {
    let dir = TempDir::new("refused");
    let out = dir.0.to_str().context("a UTF-8 temporary path")?;
    refused(
        &["bench", "--suite", "speed", "--out", out],
        "--suite `speed` is not a suite; give one of seeds, gemm",
        &dir.0,
    )?;
    refused(&["bench", "--suite", "gemm", "--devices", "cuda:0", "--out", out], "--devices `cuda:0`", &dir.0)?;
    refused(&["bench", "--suite", "gemm", "--devices", "tpu:0", "--out", out], "--devices `tpu:0`", &dir.0)?;

    // --out a file: refused, and the file left as it was.
    let file = TempDir::new("a-file");
    std::fs::write(&file.0, "keep me")?;
    let output = conveyor(&["bench", "--suite", "gemm", "--quick", "--out", file.0.to_str().context("UTF-8")?])?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        output.status.code() == Some(2) && stderr.contains("--out") && stderr.contains("not a directory"),
        "{stderr}"
    );
    ensure!(std::fs::read_to_string(&file.0)? == "keep me");

    // --out under a file, or where no directory can be made.
    let under_file = file.0.join("report");
    refused(&["bench", "--suite", "gemm", "--out", under_file.to_str().context("UTF-8")?], "--out", &under_file)?;
    let in_proc = Path::new("/proc/conveyor-bench-no-such-dir");
    refused(&["bench", "--suite", "gemm", "--out", "/proc/conveyor-bench-no-such-dir"], "--out", in_proc)?;
    Ok(())
}
