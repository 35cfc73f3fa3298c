//! Tests of `cpu::attention`: against an f64 reference (forward, logsumexp and gradients), the
//! same bits on every ISA, and shape errors.
use super::*;

/// Seeded values in [-2, 2).
fn values(n: usize, seed: u64) -> Vec<f32> {
    crate::cpu::test_values(n, seed, 2.0)
}

/// f64 attention of one call: (ctx, logsumexp, grad_qkv).
fn reference(dims: AttentionDims, qkv: &[f32], grad_ctx: &[f32]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (t, dh) = (dims.tokens, dims.head_dim);
    let scale = 1.0 / (dh as f64).sqrt();
    let mut ctx = vec![0.0; dims.context_len()];
    let mut lse = vec![0.0; dims.logsumexp_len()];
    let mut grad = vec![0.0; dims.qkv_len()];
    for h in 0..dims.n_heads {
        for b in 0..dims.batch {
            let [q, k, v] = [0, 1, 2].map(|w| &qkv[dims.sample(w, h, b)]);
            let at = |m: &[f32], i: usize, d: usize| f64::from(m[i * dh + d]);
            let mut p = vec![0.0f64; t * t];
            for i in 0..t {
                let visible = if dims.causal { i + 1 } else { t };
                let scores: Vec<f64> =
                    (0..visible).map(|j| (0..dh).map(|d| at(q, i, d) * at(k, j, d)).sum::<f64>() * scale).collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                lse[(h * dims.batch + b) * t + i] = max + sum.ln();
                for (j, s) in scores.iter().enumerate() {
                    p[i * t + j] = (s - max).exp() / sum;
                }
            }
            let grad_out = |i: usize, d: usize| f64::from(grad_ctx[dims.context_at(h, b, i) + d]);
            let mut grad_scores = vec![0.0f64; t * t];
            for i in 0..t {
                for d in 0..dh {
                    ctx[dims.context_at(h, b, i) + d] = (0..t).map(|j| p[i * t + j] * at(v, j, d)).sum();
                }
                let grad_p: Vec<f64> = (0..t).map(|j| (0..dh).map(|d| grad_out(i, d) * at(v, j, d)).sum()).collect();
                let dot: f64 = (0..t).map(|j| p[i * t + j] * grad_p[j]).sum();
                for j in 0..t {
                    grad_scores[i * t + j] = p[i * t + j] * (grad_p[j] - dot) * scale;
                }
            }
            let [gq, gk, gv] = [0, 1, 2].map(|w| dims.sample(w, h, b).start);
            for i in 0..t {
                for d in 0..dh {
                    grad[gq + i * dh + d] = (0..t).map(|j| grad_scores[i * t + j] * at(k, j, d)).sum();
                    grad[gk + i * dh + d] = (0..t).map(|j| grad_scores[j * t + i] * at(q, j, d)).sum();
                    grad[gv + i * dh + d] = (0..t).map(|j| p[j * t + i] * grad_out(j, d)).sum();
                }
            }
        }
    }
    (ctx, lse, grad)
}

/// `|got - want| <= tolerance · (1 + |want|)`.
fn assert_close_within(what: &str, got: &[f32], want: &[f64], tolerance: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((f64::from(g) - w).abs() <= tolerance * (1.0 + w.abs()), "{what}[{i}]: {g} vs {w}");
    }
}

fn assert_close(what: &str, got: &[f32], want: &[f64]) {
    assert_close_within(what, got, want, 2e-5);
}

const CASES: [(usize, usize, usize, usize); 7] =
    [(1, 1, 1, 1), (2, 2, 5, 3), (1, 2, 16, 8), (2, 1, 17, 5), (1, 1, 70, 4), (1, 1, 129, 2), (1, 1, 300, 3)];

#[test]
fn forward_and_backward_match_an_f64_reference_with_and_without_the_causal_mask() {
    for (batch, n_heads, tokens, head_dim) in CASES {
        for causal in [false, true] {
            let dims = AttentionDims { batch, tokens, n_heads, head_dim, causal };
            let what = format!("{dims:?}");
            let qkv = values(dims.qkv_len(), tokens as u64);
            let grad_ctx = values(dims.context_len(), 7 + tokens as u64);
            let (mut ctx, mut lse) = (vec![0.0; dims.context_len()], vec![0.0; dims.logsumexp_len()]);
            attention_forward(dims, &qkv, &mut ctx, &mut lse).unwrap();
            let mut grad = vec![f32::NAN; dims.qkv_len()];
            attention_backward(dims, &qkv, &ctx, &lse, &grad_ctx, &mut grad).unwrap();
            let (want_ctx, want_lse, want_grad) = reference(dims, &qkv, &grad_ctx);
            assert_close(&format!("{what} ctx"), &ctx, &want_ctx);
            assert_close(&format!("{what} logsumexp"), &lse, &want_lse);
            assert_close(&format!("{what} grad_qkv"), &grad, &want_grad);
        }
    }
}

#[test]
fn every_isa_gives_the_same_bits() {
    for (batch, n_heads, tokens, head_dim) in CASES {
        for causal in [false, true] {
            let dims = AttentionDims { batch, tokens, n_heads, head_dim, causal };
            let qkv = values(dims.qkv_len(), 3 + tokens as u64);
            let grad_ctx = values(dims.context_len(), 5 + tokens as u64);
            let run = |isa: Isa| {
                let (mut ctx, mut lse) = (vec![0.0; dims.context_len()], vec![0.0; dims.logsumexp_len()]);
                forward_on(isa, dims, &qkv, &mut ctx, &mut lse);
                let mut grad = vec![0.0; dims.qkv_len()];
                backward_on(isa, dims, &qkv, &ctx, &lse, &grad_ctx, &mut grad);
                [ctx, lse, grad].map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            };
            let scalar = run(Isa::Scalar);
            for isa in Isa::ALL.into_iter().filter(|&isa| isa != Isa::Scalar && isa.available()) {
                assert!(run(isa) == scalar, "{isa:?} {dims:?}");
            }
        }
    }
}

#[test]
fn large_scores_stay_finite_and_accurate() {
    // Scores around ±400: the online maximum keeps every exp in range. An f32 score that large
    // carries an absolute rounding error near 3e-5, which exp turns into a relative one, hence
    // the wider tolerance.
    let dims = AttentionDims { batch: 1, tokens: 300, n_heads: 1, head_dim: 4, causal: false };
    let qkv: Vec<f32> = values(dims.qkv_len(), 11).iter().map(|x| x * 10.0).collect();
    let (mut ctx, mut lse) = (vec![0.0; dims.context_len()], vec![0.0; dims.logsumexp_len()]);
    attention_forward(dims, &qkv, &mut ctx, &mut lse).unwrap();
    assert!(ctx.iter().chain(&lse).all(|x| x.is_finite()));
    let (want_ctx, _, _) = reference(dims, &qkv, &vec![0.0; dims.context_len()]);
    assert_close_within("ctx", &ctx, &want_ctx, 1e-4);
}

#[test]
fn wrong_lengths_and_empty_sizes_are_errors() {
    let dims = AttentionDims { batch: 1, tokens: 4, n_heads: 2, head_dim: 2, causal: false };
    let qkv = vec![0.0; dims.qkv_len()];
    let (mut ctx, mut lse) = (vec![0.0; dims.context_len()], vec![0.0; dims.logsumexp_len()]);
    assert!(attention_forward(dims, &qkv[1..], &mut ctx, &mut lse).is_err());
    assert!(attention_forward(dims, &qkv, &mut ctx[1..], &mut lse).is_err());
    let mut grad = vec![0.0; dims.qkv_len()];
    assert!(attention_backward(dims, &qkv, &ctx, &lse[1..], &ctx, &mut grad).is_err());
    let empty = AttentionDims { tokens: 0, ..dims };
    assert!(attention_forward(empty, &[], &mut [], &mut []).is_err());
}
