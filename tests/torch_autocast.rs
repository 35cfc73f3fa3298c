//! `--precision bf16` against PyTorch's CPU autocast: one SGD step of a small MLP under
//! `torch.autocast("cpu", dtype=torch.bfloat16)` (the loss on f32 logits, as autocast's fp32 list
//! runs it) from the same weights and batch. Runs when `python3 -c 'import torch'` works and is
//! skipped (passing, with a note) otherwise.
//!
//! # Tolerance
//!
//! Both sides round the products' operands and outputs to bf16 (u = 2⁻⁸) but sum in different
//! orders, and torch rounds the weight gradient to bf16 where Conveyor keeps it in f32. So the
//! weights' updates agree to a few bf16 roundings of the update, per tensor:
//!
//! ```text
//! |got − want| ≤ 2⁻⁵ · max_i |want_i − initial_i|      (and the loss to 2⁻⁷ relative)
//! ```
//!
//! Measured: the bf16 step is 2.7e-3 of the update away from torch's, an f32 step 0.25.
mod common;

use std::process::Command;
use std::sync::Arc;

use common::{data, weights};
use conveyor::engine::Precision;
use conveyor::engine::optim::{OptimizerConfig, SgdConfig};
use conveyor::engine::runtime::Trainer;
use conveyor::layers::CrossEntropyLoss;
use conveyor::zoo::mlp;

const SCRIPT: &str = r#"
import json, sys
import torch
from torch import nn
import torch.nn.functional as F
torch.set_num_threads(1)
case = json.load(open(sys.argv[1]))
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
with torch.no_grad():
    for name, p in model.named_parameters():
        p.copy_(torch.tensor(case["weights"][name], dtype=torch.float32).reshape(p.shape))
x = torch.tensor(case["inputs"], dtype=torch.float32).reshape(-1, 8)
y = torch.tensor(case["labels"], dtype=torch.int64)
opt = torch.optim.SGD(model.parameters(), lr=0.5)
with torch.autocast("cpu", dtype=torch.bfloat16):
    logits = model(x)
loss = F.cross_entropy(logits.float(), y)
loss.backward()
opt.step()
out = {"loss": loss.item(), "weights": {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}}
print(json.dumps(out))
"#;

fn torch_available() -> bool {
    Command::new("python3").args(["-c", "import torch"]).output().is_ok_and(|out| out.status.success())
}

#[test]
fn one_bf16_step_matches_torch_autocast() {
    if !torch_available() {
        eprintln!("skipped: python3 cannot import torch");
        return;
    }
    let build = |precision| {
        Trainer::builder(mlp(&[8, 32, 32, 4], 5).unwrap(), Arc::new(CrossEntropyLoss::new()))
            .optimizer(OptimizerConfig::Sgd(SgdConfig::new(0.5)))
            .precision(precision)
            .build()
            .unwrap()
    };
    let mut half = build(Precision::Bf16);
    let mut full = build(Precision::F32);
    let initial = weights(&half);
    let (x, y) = data(24, &[8], 4, 9);
    let case = serde_json::json!({
        "weights": initial.iter().cloned().collect::<std::collections::BTreeMap<_, _>>(),
        "inputs": x.to_vec_f32(),
        "labels": y,
    });
    let dir = std::env::temp_dir().join(format!("conveyor-torch-autocast-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (case_path, script_path) = (dir.join("case.json"), dir.join("step.py"));
    std::fs::write(&case_path, case.to_string()).unwrap();
    std::fs::write(&script_path, SCRIPT).unwrap();
    let out = Command::new("python3").arg(&script_path).arg(&case_path).output().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let want: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();

    let half_loss = half.train_step(&x, &y).unwrap().loss;
    full.train_step(&x, &y).unwrap();
    let want_loss = want["loss"].as_f64().unwrap();
    assert!((half_loss - want_loss).abs() <= want_loss.abs() / 128.0, "loss {half_loss} vs torch {want_loss}");
    let (mut worst_half, mut worst_full) = (0.0f64, 0.0f64);
    for (((name, got), (_, got_f32)), (_, start)) in weights(&half).iter().zip(&weights(&full)).zip(&initial) {
        let want: Vec<f64> = want["weights"][name].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        let update = want.iter().zip(start).map(|(w, s)| (w - f64::from(*s)).abs()).fold(0.0, f64::max);
        let error = |values: &[f32]| {
            values.iter().zip(&want).map(|(g, w)| (f64::from(*g) - w).abs()).fold(0.0, f64::max) / update
        };
        worst_half = worst_half.max(error(got));
        worst_full = worst_full.max(error(got_f32));
    }
    println!("update error against torch autocast: bf16 {worst_half:.2e}, f32 {worst_full:.2e}");
    assert!(worst_half <= 1.0 / 32.0, "bf16 step differs from torch autocast by {worst_half} of the update");
    assert!(worst_full > worst_half, "the comparison tells bf16 from f32");
}
