//! `conveyor train --clip-grad-norm MAX` (`optimizer.clip_grad_norm`): gradients clipped to a
//! global L2 norm, as torch's `clip_grad_norm_`. A limit that never binds changes no bit, one that
//! binds changes the model. Overlapped steps, which replay a step that must be clipped and keep
//! the barrier while steps clip, train the synchronous model bit for bit. Bad limits exit 2.
mod train_cli_support;

use train_cli_support::{RawTensors, arg, assert_usage_error, conveyor_ok, metrics, parameters, temp_dir};

/// Trains 10 steps of a 2-stage ZB-H2 pipeline with `extra` flags; returns the saved parameters
/// and the metrics lines.
fn train(dir: &std::path::Path, tag: &str, extra: &[&str]) -> (RawTensors, Vec<serde_json::Value>) {
    let (model, metrics_path) = (dir.join(format!("{tag}.safetensors")), dir.join(format!("{tag}.jsonl")));
    let mut args = vec![
        "train",
        "--model",
        "mlp:8,32,32,4",
        "--data",
        "synthetic:240,8,4",
        "--devices",
        "cpu:2",
        "--schedule",
        "zb-h2",
        "--batch",
        "12",
        "--microbatches",
        "4",
        "--steps",
        "10",
        "--optimizer",
        "momentum",
        "--lr",
        "0.2",
        "--log-every",
        "0",
        "--save",
        arg(&model),
        "--metrics",
        arg(&metrics_path),
    ];
    args.extend_from_slice(extra);
    conveyor_ok(&args);
    (parameters(&model), metrics(&metrics_path))
}

/// Each step's gradient norm (before clipping), from the metrics.
fn norms(lines: &[serde_json::Value]) -> Vec<f64> {
    lines.iter().filter(|l| l.get("summary").is_none()).map(|l| l["grad_norm"].as_f64().unwrap()).collect()
}

/// The metrics that must agree between runs (timings differ).
fn agreed(lines: &[serde_json::Value]) -> Vec<String> {
    lines
        .iter()
        .filter(|l| l.get("summary").is_none())
        .map(|l| format!("{} {} {} {}", l["step"], l["loss"], l["lr"], l["grad_norm"]))
        .collect()
}

#[test]
fn clipping_binds_only_above_the_limit_and_overlapped_steps_clip_alike() {
    let dir = temp_dir("train-clip");
    let (free, free_metrics) = train(&dir, "free", &["--overlap-steps", "off"]);
    let mut sorted = norms(&free_metrics);
    assert_eq!(sorted.len(), 10);
    sorted.sort_by(f64::total_cmp);
    // A limit above every norm clips nothing: the same bits as no limit, overlapped or not.
    let loose = format!("{}", 2.0 * sorted[9]);
    for overlap in ["off", "on"] {
        let (loosely, _) =
            train(&dir, &format!("loose-{overlap}"), &["--clip-grad-norm", &loose, "--overlap-steps", overlap]);
        assert_eq!(loosely, free, "--clip-grad-norm {loose} --overlap-steps {overlap}: nothing clipped");
    }
    // The median binds: until the first step above it the runs agree, and that step is clipped.
    let limit = sorted[5];
    let text = format!("{limit}");
    let (off, off_metrics) = train(&dir, "clip-off", &["--clip-grad-norm", &text, "--overlap-steps", "off"]);
    let (on, on_metrics) = train(&dir, "clip-on", &["--clip-grad-norm", &text, "--overlap-steps", "on"]);
    let clipped = norms(&off_metrics).iter().filter(|&&n| conveyor::engine::optim::clips(limit, n)).count();
    assert!(clipped >= 1, "the median of the free run's norms clips a step: {:?}", norms(&off_metrics));
    assert_ne!(off, free, "clipped steps change the model");
    assert_eq!(on, off, "overlapped steps clip as synchronous ones, bit for bit");
    assert_eq!(agreed(&on_metrics), agreed(&off_metrics), "losses, rates and norms");
    // The overlapped run replays a clipping step only after one that did not clip (or first),
    // and says which; the synchronous run replays none.
    let clips: Vec<bool> = norms(&off_metrics).iter().map(|&n| conveyor::engine::optim::clips(limit, n)).collect();
    let expected: Vec<bool> = (0..clips.len()).map(|k| clips[k] && (k == 0 || !clips[k - 1])).collect();
    let replayed = |lines: &[serde_json::Value]| -> Vec<bool> {
        lines.iter().filter(|l| l.get("summary").is_none()).map(|l| l.get("replayed").is_some()).collect()
    };
    assert_eq!(replayed(&on_metrics), expected, "replayed steps, for clipping steps {clips:?}");
    assert!(replayed(&off_metrics).iter().all(|r| !r), "synchronous steps are never replayed");
    let count = |lines: &[serde_json::Value]| lines.last().and_then(|l| l["replayed_steps"].as_u64());
    assert_eq!(count(&on_metrics), Some(expected.iter().filter(|&&r| r).count() as u64), "the summary's count");
    assert_eq!(count(&off_metrics), Some(0));
}

#[test]
fn a_bad_limit_is_a_usage_error_and_the_config_key_is_read() {
    let base = ["train", "--model", "mlp:8,4", "--data", "synthetic:40,8,4", "--steps", "1", "--clip-grad-norm"];
    for bad in ["-1", "nan", "inf"] {
        let stderr = assert_usage_error(&[&base[..], &[bad]].concat(), "--clip-grad-norm");
        assert!(stderr.contains("finite number >= 0"), "{bad}: {stderr}");
    }
    let dir = temp_dir("train-clip-config");
    let config = dir.join("run.toml");
    std::fs::write(
        &config,
        "[model]\nspec = \"mlp:8,16,4\"\n[data]\nsource = \"synthetic:40,8,4\"\n[training]\nbatch = 8\nsteps = 2\n\
         [optimizer]\nclip_grad_norm = 0.25\n",
    )
    .unwrap();
    let printed = conveyor_ok(&["train", "--config", arg(&config), "--print-config"]);
    assert!(printed.contains("clip_grad_norm = 0.25"), "{printed}");
    conveyor_ok(&["train", "--config", arg(&config)]);
}
