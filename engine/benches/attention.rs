//! Attention forward+backward (H = 4, T ∈ {16, 128, 512}, head dim 8 and 64) and 2×2 max pooling
//! on the zoo CNN's and ResNet's shapes (batch 256: 32×8×8, 8×8×8), one thread. PyTorch's peer
//! is `engine/benches/attention_torch.py`; `engine/benches/attention_compare.sh` runs both in
//! interleaved rounds and prints the median per-round ratio.
//!
//! Batch: 256 at T = 16, 32 at T = 128, 8 at T = 512 (so a call stays under a second; the work per
//! (head, sample) is what is compared). `attn_*` is `cpu::attention`'s fused kernel (forward, then
//! backward from the logsumexp); `attn_old_*` is the per-(head, sample) loop the layer ran before
//! it (two GEMMs forward, five backward, probabilities `[H, B, T, T]` kept), copied here as the
//! "before" figure. `maxpool_*_bwd` is the layer's input gradient (`max_pool2d_input_grad`, plane
//! by plane into an uninitialised buffer); `maxpool_*_bwd_scatter` is a zero-fill of the whole
//! buffer followed by `max_pool2d_backward` (no PyTorch peer).
//!
//! Run alone: `cargo bench -p conveyor-engine --bench attention` (prints `op ns_per_call` lines;
//! `BENCH_ONLY=attn` or `BENCH_ONLY=maxpool` runs one half).
use std::hint::black_box;
use std::mem::MaybeUninit;

use conveyor_engine::cpu::attention::{AttentionDims, attention_backward, attention_forward};
use conveyor_engine::cpu::pool::{max_pool2d_backward, max_pool2d_forward, max_pool2d_input_grad};
use conveyor_engine::cpu::softmax::softmax_rows;
use conveyor_engine::cpu::{MatRef, Window2d, matmul};

#[path = "support/mod.rs"]
mod support;

/// See [`support::time`].
fn time(f: impl FnMut()) -> f64 {
    support::time(f, true)
}

use support::values;

/// The layer's attention before the fused kernel, forward and backward (non-causal).
fn attention_old(
    dims: AttentionDims,
    qkv: &[f32],
    grad_ctx: &[f32],
    probs: &mut [f32],
    ctx: &mut [f32],
    grad_qkv: &mut [f32],
) {
    let (t, dh, d) = (dims.tokens, dims.head_dim, dims.embed_dim());
    let sample = |which: usize, h: usize, b: usize| {
        let start = ((which * dims.n_heads + h) * dims.batch + b) * t * dh;
        start..start + t * dh
    };
    let prob = |h: usize, b: usize| (h * dims.batch + b) * t * t..(h * dims.batch + b + 1) * t * t;
    let scale = dims.scale();
    let mut scores = vec![0.0f32; t * t];
    let mut head = vec![0.0f32; t * dh];
    for h in 0..dims.n_heads {
        for b in 0..dims.batch {
            let q = MatRef::row_major(&qkv[sample(0, h, b)], t, dh).unwrap();
            let k = MatRef::row_major(&qkv[sample(1, h, b)], t, dh).unwrap();
            let v = MatRef::row_major(&qkv[sample(2, h, b)], t, dh).unwrap();
            matmul(&mut scores, q, k.t(), false).unwrap();
            scores.iter_mut().for_each(|s| *s *= scale);
            let p = &mut probs[prob(h, b)];
            softmax_rows(&scores, t, p).unwrap();
            matmul(&mut head, MatRef::row_major(p, t, t).unwrap(), v, false).unwrap();
            for (i, src) in head.chunks_exact(dh).enumerate() {
                ctx[(b * t + i) * d + h * dh..][..dh].copy_from_slice(src);
            }
        }
    }
    for h in 0..dims.n_heads {
        for b in 0..dims.batch {
            for (i, dst) in head.chunks_exact_mut(dh).enumerate() {
                dst.copy_from_slice(&grad_ctx[(b * t + i) * d + h * dh..][..dh]);
            }
            let p = &probs[prob(h, b)];
            let q = MatRef::row_major(&qkv[sample(0, h, b)], t, dh).unwrap();
            let k = MatRef::row_major(&qkv[sample(1, h, b)], t, dh).unwrap();
            let v = MatRef::row_major(&qkv[sample(2, h, b)], t, dh).unwrap();
            let grad_head = MatRef::row_major(&head, t, dh).unwrap();
            matmul(&mut grad_qkv[sample(2, h, b)], MatRef::row_major(p, t, t).unwrap().t(), grad_head, false).unwrap();
            matmul(&mut scores, grad_head, v.t(), false).unwrap();
            for (grad_row, p_row) in scores.chunks_exact_mut(t).zip(p.chunks_exact(t)) {
                let dot: f32 = grad_row.iter().zip(p_row).map(|(g, p)| g * p).sum();
                grad_row.iter_mut().zip(p_row).for_each(|(g, &p)| *g = p * (*g - dot) * scale);
            }
            let grad_scores = MatRef::row_major(&scores, t, t).unwrap();
            matmul(&mut grad_qkv[sample(0, h, b)], grad_scores, k, false).unwrap();
            matmul(&mut grad_qkv[sample(1, h, b)], grad_scores.t(), q, false).unwrap();
        }
    }
}

fn main() {
    // `BENCH_ONLY=maxpool` (or `attn`) runs one half.
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    for (tokens, batch) in [(16usize, 256usize), (128, 32), (512, 8)].into_iter().filter(|_| "attn".contains(&*only)) {
        for head_dim in [8usize, 64] {
            let dims = AttentionDims { batch, tokens, n_heads: 4, head_dim, causal: false };
            let qkv = values(dims.qkv_len(), 1.0);
            let grad_ctx = values(dims.context_len(), 1.0);
            let (mut ctx, mut lse) = (vec![0.0f32; dims.context_len()], vec![0.0f32; dims.logsumexp_len()]);
            let mut grad_qkv = vec![0.0f32; dims.qkv_len()];
            let new = time(|| {
                attention_forward(dims, black_box(&qkv), &mut ctx, &mut lse).unwrap();
                attention_backward(dims, &qkv, &ctx, &lse, black_box(&grad_ctx), &mut grad_qkv).unwrap();
            });
            println!("attn_t{tokens}_d{head_dim} {new:.0}");
            let mut probs = vec![0.0f32; dims.n_heads * batch * tokens * tokens];
            let old = time(|| attention_old(dims, black_box(&qkv), &grad_ctx, &mut probs, &mut ctx, &mut grad_qkv));
            println!("attn_old_t{tokens}_d{head_dim} {old:.0}");
        }
    }
    for (name, channels) in [("cnn", 32usize), ("resnet", 8)].into_iter().filter(|_| "maxpool".contains(&*only)) {
        let planes = 256 * channels;
        let window = Window2d::new(channels, (8, 8), (2, 2), (2, 2), (0, 0)).unwrap();
        let x = values(planes * 64, 1.0);
        let dy = values(planes * 16, 1.0);
        let (mut y, mut arg, mut dx) =
            (vec![0.0f32; planes * 16], vec![0.0f32; planes * 16], vec![MaybeUninit::<f32>::uninit(); planes * 64]);
        let fwd = time(|| max_pool2d_forward(black_box(&x), planes, &window, &mut y, &mut arg).unwrap());
        // The layer's input gradient: written in full into a fresh (uninitialised) buffer, as
        // torch's backward fills a new tensor.
        let bwd = time(|| {
            black_box(max_pool2d_input_grad(black_box(&dy), &arg, planes, &window, &mut dx).unwrap());
        });
        // The path before it: zero-fill, then the scatter (no PyTorch peer line).
        let mut dx_zeroed = vec![0.0f32; planes * 64];
        let scatter = time(|| {
            dx_zeroed.fill(0.0);
            max_pool2d_backward(black_box(&dy), &arg, planes, &window, &mut dx_zeroed).unwrap()
        });
        println!("maxpool_{name}_fwd {fwd:.0}");
        println!("maxpool_{name}_bwd_scatter {scatter:.0}");
        println!("maxpool_{name}_bwd {bwd:.0}");
        println!("maxpool_{name}_fwd_bwd {:.0}", fwd + bwd);
    }
}
