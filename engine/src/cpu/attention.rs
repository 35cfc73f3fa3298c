//! Fused scaled dot-product attention over every (head, sample) block: the forward pass writes
//! the context and the row logsumexp, never the `[T, T]` probabilities; the backward pass
//! recomputes them from the logsumexp (FlashAttention-2, arXiv 2307.08691).
//!
//! # Layout
//!
//! `qkv` is head-major, `[3, n_heads, batch, tokens, head_dim]` (q, then k, then v); the context
//! is `[batch, tokens, n_heads · head_dim]` (heads concatenated, ready for the output
//! projection); the logsumexp is `[n_heads, batch, tokens]`.
//!
//! # Blocking
//!
//! Forward, per block of up to [`FORWARD_QUERY_BLOCK`] queries, over key blocks of up to
//! [`FORWARD_KEY_BLOCK`]: scores, a running row maximum and sum, the partial output rescaled when
//! the maximum grows. With `tokens ≤ FORWARD_KEY_BLOCK` there is one key block, so the softmax is
//! exact (no rescaling). Backward, per key block of [`BACKWARD_KEY_BLOCK`] (its `dK`, `dV`
//! accumulated over the query blocks) and query block of [`BACKWARD_QUERY_BLOCK`]:
//! `P = exp(S − L)`, `dV += Pᵀ dO`, `dS = P ∘ (dO Vᵀ − D)` with `D = rowsum(dO ∘ O)`,
//! `dK += dSᵀ Q`, `dQ += dS K`. Scratch per call is O(tokens · head_dim + tile), never
//! O(tokens²).
//!
//! # Same bits everywhere
//!
//! Every product is one small GEMM whose output columns run in SIMD lanes (queries in the
//! forward pass, keys in the backward pass; the one tile `dQ` needs the other way round is
//! transposed), so each output element is one chain of fused multiply-adds in a fixed order, and
//! every row statistic is a lane-wise running max or sum in key order. No horizontal sums: the
//! results have the same bits on AVX-512, AVX2+FMA and scalar code (`cpu::vecmath`), and they
//! do not depend on the blocking of columns. The kernel is single-threaded (one device is one
//! core), so there is nothing a thread count could change.
//!
//! The causal mask hides key `j > i` from query `i` (PyTorch's `is_causal=True`); key blocks
//! entirely above the diagonal are skipped.
use super::lanes_gemm::gemm;
#[cfg(test)]
use super::vecmath::{Isa, dispatch_on};
use super::vecmath::{Job, Lanes, dispatch, exp};
use crate::{Error, Result};

/// Queries per forward block (PyTorch's CPU flash kernel uses 32 below 192 tokens, 64 below 768).
pub const FORWARD_QUERY_BLOCK: usize = 64;
/// Keys per forward block: one block (an exact softmax) up to this many tokens.
pub const FORWARD_KEY_BLOCK: usize = 256;
/// Keys per backward block (their `dK`, `dV` stay in a `[head_dim, block]` accumulator).
pub const BACKWARD_KEY_BLOCK: usize = 64;
/// Queries per backward block.
pub const BACKWARD_QUERY_BLOCK: usize = 64;
/// Padding granularity of lane dimensions: a multiple of every ISA's lane count.
const LANE_PAD: usize = 16;

fn pad(n: usize) -> usize {
    n.next_multiple_of(LANE_PAD)
}

/// Sizes of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDims {
    /// Samples.
    pub batch: usize,
    /// Tokens per sample (queries and keys).
    pub tokens: usize,
    /// Heads.
    pub n_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Whether query `i` sees only keys `j ≤ i`.
    pub causal: bool,
}

impl AttentionDims {
    /// `n_heads · head_dim`.
    pub fn embed_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Elements of `qkv` (and of its gradient): `3 · n_heads · batch · tokens · head_dim`.
    pub fn qkv_len(&self) -> usize {
        3 * self.n_heads * self.batch * self.tokens * self.head_dim
    }

    /// Elements of the context: `batch · tokens · embed_dim`.
    pub fn context_len(&self) -> usize {
        self.batch * self.tokens * self.embed_dim()
    }

    /// Elements of the logsumexp: `n_heads · batch · tokens`.
    pub fn logsumexp_len(&self) -> usize {
        self.n_heads * self.batch * self.tokens
    }

    /// `1 / sqrt(head_dim)`.
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// Range of sample `b`'s `[tokens, head_dim]` rows of block `which` (0 q, 1 k, 2 v) of head `h`.
    fn sample(&self, which: usize, h: usize, b: usize) -> std::ops::Range<usize> {
        let len = self.tokens * self.head_dim;
        let start = ((which * self.n_heads + h) * self.batch + b) * len;
        start..start + len
    }

    /// Offset of head `h`'s columns in row `(b, i)` of the context.
    fn context_at(&self, h: usize, b: usize, i: usize) -> usize {
        (b * self.tokens + i) * self.embed_dim() + h * self.head_dim
    }

    fn check(&self, op: &str, lens: &[(&str, usize, usize)]) -> Result<()> {
        if self.tokens == 0 || self.head_dim == 0 || self.n_heads == 0 {
            return Err(Error::invalid(
                op,
                format!(
                    "tokens={}, head_dim={}, n_heads={}: each must be at least 1",
                    self.tokens, self.head_dim, self.n_heads
                ),
            ));
        }
        for &(what, expected, got) in lens {
            super::window::check_len(op, what, expected, got)?;
        }
        Ok(())
    }
}

/// Attention forward: `ctx[b, i, h·dh ..] = softmax(q kᵀ / sqrt(dh) + mask) v` per head `h` and
/// sample `b`, and `logsumexp[h, b, i] = log Σ_j exp(s_ij)` of the scaled, masked scores.
pub fn attention_forward(dims: AttentionDims, qkv: &[f32], ctx: &mut [f32], logsumexp: &mut [f32]) -> Result<()> {
    dims.check(
        "attention_forward",
        &[
            ("qkv", dims.qkv_len(), qkv.len()),
            ("ctx", dims.context_len(), ctx.len()),
            ("logsumexp", dims.logsumexp_len(), logsumexp.len()),
        ],
    )?;
    dispatch(Forward { dims, qkv, ctx, logsumexp });
    Ok(())
}

/// Attention backward: writes `grad_qkv` (every element; layout of `qkv`) from the saved `qkv`,
/// context and logsumexp of [`attention_forward`] and the context's gradient `grad_ctx`.
pub fn attention_backward(
    dims: AttentionDims,
    qkv: &[f32],
    ctx: &[f32],
    logsumexp: &[f32],
    grad_ctx: &[f32],
    grad_qkv: &mut [f32],
) -> Result<()> {
    dims.check(
        "attention_backward",
        &[
            ("qkv", dims.qkv_len(), qkv.len()),
            ("ctx", dims.context_len(), ctx.len()),
            ("logsumexp", dims.logsumexp_len(), logsumexp.len()),
            ("grad_ctx", dims.context_len(), grad_ctx.len()),
            ("grad_qkv", dims.qkv_len(), grad_qkv.len()),
        ],
    )?;
    dispatch(Backward { dims, qkv, ctx, logsumexp, grad_ctx, grad_qkv });
    Ok(())
}

/// `dst[d·ld + i] = src[i·cols + d] · factor` for `i < rows`, `d < cols` (a transposed copy).
fn transpose_into(src: &[f32], rows: usize, cols: usize, factor: f32, dst: &mut [f32], ld: usize) {
    for (i, row) in src.chunks_exact(cols).take(rows).enumerate() {
        for (d, &x) in row.iter().enumerate() {
            dst[d * ld + i] = x * factor;
        }
    }
}

/// The forward pass on one ISA.
struct Forward<'a> {
    dims: AttentionDims,
    qkv: &'a [f32],
    ctx: &'a mut [f32],
    logsumexp: &'a mut [f32],
}

/// Per-call scratch of the forward pass.
struct ForwardScratch {
    /// Scaled queries transposed, `[head_dim, pad(tokens)]` (padding columns stay zero).
    q_t: Vec<f32>,
    /// Values transposed, `[head_dim, tokens]`.
    v_t: Vec<f32>,
    /// Scores, then probabilities, of one tile: `[key block, query block]`.
    tile: Vec<f32>,
    /// Output accumulator `[head_dim, query block]`.
    acc: Vec<f32>,
    row_max: Vec<f32>,
    row_sum: Vec<f32>,
    /// `exp(old max − new max)` per query.
    rescale: Vec<f32>,
    /// `0, 1, 2, ..` as f32, for the causal mask.
    iota: Vec<f32>,
}

impl Job for Forward<'_> {
    type Output = ();
    #[inline(always)]
    fn run<V: Lanes>(self) {
        let Forward { dims, qkv, ctx, logsumexp } = self;
        let (t, dh) = (dims.tokens, dims.head_dim);
        let tp = pad(t);
        let qb = FORWARD_QUERY_BLOCK.min(tp);
        let kb = FORWARD_KEY_BLOCK.min(t);
        let mut s = ForwardScratch {
            q_t: vec![0.0; dh * tp],
            v_t: vec![0.0; dh * t],
            tile: vec![0.0; kb * qb],
            acc: vec![0.0; dh * qb],
            row_max: vec![0.0; qb],
            row_sum: vec![0.0; qb],
            rescale: vec![0.0; qb],
            iota: (0..tp).map(|i| i as f32).collect(),
        };
        for h in 0..dims.n_heads {
            for b in 0..dims.batch {
                transpose_into(&qkv[dims.sample(0, h, b)], t, dh, dims.scale(), &mut s.q_t, tp);
                transpose_into(&qkv[dims.sample(2, h, b)], t, dh, 1.0, &mut s.v_t, t);
                let k = &qkv[dims.sample(1, h, b)];
                for i0 in (0..t).step_by(qb) {
                    let nq = qb.min(t - i0);
                    forward_query_block::<V>(dims, &mut s, k, i0, nq, qb, kb);
                    let lse = &mut logsumexp[(h * dims.batch + b) * t + i0..][..nq];
                    for (i, lse) in lse.iter_mut().enumerate() {
                        *lse = s.row_max[i] + (f64::from(s.row_sum[i]).ln() as f32);
                        let at = dims.context_at(h, b, i0 + i);
                        for (d, out) in ctx[at..at + dh].iter_mut().enumerate() {
                            *out = s.acc[d * qb + i];
                        }
                    }
                }
            }
        }
    }
}

/// Queries `i0 .. i0 + nq` of one (head, sample): leaves the normalised output `[head_dim, qb]`
/// in `s.acc`, the row maxima and sums in `s.row_max`, `s.row_sum`.
#[inline(always)]
fn forward_query_block<V: Lanes>(
    dims: AttentionDims,
    s: &mut ForwardScratch,
    k: &[f32],
    i0: usize,
    nq: usize,
    qb: usize,
    kb: usize,
) {
    let (t, dh) = (dims.tokens, dims.head_dim);
    let tp = pad(t);
    let nqp = pad(nq);
    let key_end = if dims.causal { i0 + nq } else { t };
    s.row_max[..nqp].fill(f32::NEG_INFINITY);
    s.row_sum[..nqp].fill(0.0);
    for j0 in (0..key_end).step_by(kb) {
        let nk = kb.min(key_end - j0);
        let first = j0 == 0;
        // SAFETY: k holds t·dh ≥ (j0 + nk)·dh elements; q_t is [dh, tp] with i0 + nqp ≤ tp
        // (i0 a multiple of qb, itself a multiple of 16 or tp); the tile is [kb, qb], nqp ≤ qb.
        unsafe {
            gemm::<V>(
                nk,
                nqp,
                dh,
                k.as_ptr().add(j0 * dh),
                dh,
                s.q_t.as_ptr().add(i0),
                tp,
                s.tile.as_mut_ptr(),
                qb,
                false,
            )
        };
        online_softmax::<V>(dims.causal, s, i0, j0, nk, nqp, qb);
        if !first {
            for row in s.acc.chunks_exact_mut(qb) {
                let mut c = 0;
                while c < nqp {
                    // SAFETY: c + V::N ≤ nqp ≤ qb = row.len() = rescale.len().
                    unsafe {
                        V::load(row.as_ptr().add(c))
                            .mul(V::load(s.rescale.as_ptr().add(c)))
                            .store(row.as_mut_ptr().add(c))
                    };
                    c += V::N;
                }
            }
        }
        // acc [dh, nqp] (+)= v_t[:, j0..j0+nk] · P [nk, nqp].
        // SAFETY: v_t is [dh, t] with j0 + nk ≤ t; the tile holds nk rows of qb; acc is [dh, qb].
        unsafe {
            gemm::<V>(dh, nqp, nk, s.v_t.as_ptr().add(j0), t, s.tile.as_ptr(), qb, s.acc.as_mut_ptr(), qb, !first)
        };
    }
    // Normalise: acc[d, i] /= row_sum[i].
    for row in s.acc.chunks_exact_mut(qb) {
        let mut c = 0;
        while c < nqp {
            // SAFETY: c + V::N ≤ nqp ≤ qb.
            unsafe {
                V::load(row.as_ptr().add(c)).div(V::load(s.row_sum.as_ptr().add(c))).store(row.as_mut_ptr().add(c))
            };
            c += V::N;
        }
    }
}

/// The online-softmax step on a score tile `[nk, qb]` (keys `j0 ..`, queries `i0 ..` in lanes):
/// masks, raises the running maxima, turns the scores into `exp(s − max)` in place, and updates
/// the running sums; `rescale` receives `exp(old max − new max)`.
#[inline(always)]
fn online_softmax<V: Lanes>(
    causal: bool,
    s: &mut ForwardScratch,
    i0: usize,
    j0: usize,
    nk: usize,
    nqp: usize,
    qb: usize,
) {
    let tile = s.tile.as_mut_ptr();
    let mut c = 0;
    while c < nqp {
        // SAFETY: c + V::N ≤ nqp ≤ qb; rows jj < nk of the [kb, qb] tile; iota has pad(t) ≥ i0 + nqp.
        unsafe {
            let old_max = V::load(s.row_max.as_ptr().add(c));
            let mut max = old_max;
            let first_query = i0 + c;
            for jj in 0..nk {
                let at = tile.add(jj * qb + c);
                let mut x = V::load(at);
                let j = j0 + jj;
                if causal && j > first_query {
                    let hidden = V::load(s.iota.as_ptr().add(first_query)).lt(V::splat(j as f32));
                    x = V::select(hidden, V::splat(f32::NEG_INFINITY), x);
                    x.store(at);
                }
                max = x.max(max);
            }
            let neg_max = V::splat(0.0).sub(max);
            let rescale = exp(old_max.add(neg_max));
            let mut sum = V::splat(0.0);
            for jj in 0..nk {
                let at = tile.add(jj * qb + c);
                let p = exp(V::load(at).add(neg_max));
                p.store(at);
                sum = sum.add(p);
            }
            let old_sum = V::load(s.row_sum.as_ptr().add(c));
            old_sum.fma(rescale, sum).store(s.row_sum.as_mut_ptr().add(c));
            max.store(s.row_max.as_mut_ptr().add(c));
            rescale.store(s.rescale.as_mut_ptr().add(c));
        }
        c += V::N;
    }
}

/// The backward pass on one ISA.
struct Backward<'a> {
    dims: AttentionDims,
    qkv: &'a [f32],
    ctx: &'a [f32],
    logsumexp: &'a [f32],
    grad_ctx: &'a [f32],
    grad_qkv: &'a mut [f32],
}

/// Per-call scratch of the backward pass; `_t` buffers are transposed, `[head_dim, pad(tokens)]`
/// with zero padding columns.
struct BackwardScratch {
    /// Scaled queries `[tokens, head_dim]`.
    q: Vec<f32>,
    q_t: Vec<f32>,
    k_t: Vec<f32>,
    v_t: Vec<f32>,
    /// This head's context gradient `[tokens, head_dim]`.
    grad_out: Vec<f32>,
    grad_out_t: Vec<f32>,
    /// `D = rowsum(dO ∘ O)` per query.
    delta: Vec<f32>,
    grad_q_t: Vec<f32>,
    /// Probabilities of one tile `[query block, key block]`.
    probs: Vec<f32>,
    /// `dP`, then `dS`, of one tile `[query block, key block]`.
    grad_scores: Vec<f32>,
    /// `dS` transposed `[key block, pad(query block)]`.
    grad_scores_t: Vec<f32>,
    grad_k_t: Vec<f32>,
    grad_v_t: Vec<f32>,
    iota: Vec<f32>,
}

impl Job for Backward<'_> {
    type Output = ();
    #[inline(always)]
    fn run<V: Lanes>(self) {
        let Backward { dims, qkv, ctx, logsumexp, grad_ctx, grad_qkv } = self;
        let (t, dh) = (dims.tokens, dims.head_dim);
        let tp = pad(t);
        let (qb, kbp) = (BACKWARD_QUERY_BLOCK.min(t), BACKWARD_KEY_BLOCK.min(tp));
        let mut s = BackwardScratch {
            q: vec![0.0; t * dh],
            q_t: vec![0.0; dh * tp],
            k_t: vec![0.0; dh * tp],
            v_t: vec![0.0; dh * tp],
            grad_out: vec![0.0; t * dh],
            grad_out_t: vec![0.0; dh * tp],
            delta: vec![0.0; t],
            grad_q_t: vec![0.0; dh * tp],
            probs: vec![0.0; qb * kbp],
            grad_scores: vec![0.0; qb * kbp],
            grad_scores_t: vec![0.0; kbp * pad(qb)],
            grad_k_t: vec![0.0; dh * kbp],
            grad_v_t: vec![0.0; dh * kbp],
            iota: (0..tp).map(|i| i as f32).collect(),
        };
        let scale = dims.scale();
        for h in 0..dims.n_heads {
            for b in 0..dims.batch {
                let q = &qkv[dims.sample(0, h, b)];
                s.q.iter_mut().zip(q).for_each(|(dst, &x)| *dst = x * scale);
                transpose_into(&s.q, t, dh, 1.0, &mut s.q_t, tp);
                transpose_into(&qkv[dims.sample(1, h, b)], t, dh, 1.0, &mut s.k_t, tp);
                transpose_into(&qkv[dims.sample(2, h, b)], t, dh, 1.0, &mut s.v_t, tp);
                for i in 0..t {
                    let at = dims.context_at(h, b, i);
                    let (grad_row, out_row) = (&grad_ctx[at..at + dh], &ctx[at..at + dh]);
                    s.grad_out[i * dh..(i + 1) * dh].copy_from_slice(grad_row);
                    s.delta[i] = grad_row.iter().zip(out_row).fold(0.0f32, |acc, (&g, &o)| g.mul_add(o, acc));
                }
                transpose_into(&s.grad_out, t, dh, 1.0, &mut s.grad_out_t, tp);
                s.grad_q_t.fill(0.0);
                let lse = &logsumexp[(h * dims.batch + b) * t..][..t];
                for j0 in (0..t).step_by(kbp) {
                    let nk = kbp.min(t - j0);
                    backward_key_block::<V>(dims, &mut s, lse, j0, nk, qb, kbp);
                    let [grad_k, grad_v] = [1, 2].map(|which| dims.sample(which, h, b).start + j0 * dh);
                    for jj in 0..nk {
                        for d in 0..dh {
                            grad_qkv[grad_k + jj * dh + d] = s.grad_k_t[d * kbp + jj];
                            grad_qkv[grad_v + jj * dh + d] = s.grad_v_t[d * kbp + jj];
                        }
                    }
                }
                // dQ = scale · (dS K), from its transpose.
                let grad_q = &mut grad_qkv[dims.sample(0, h, b)];
                for (i, row) in grad_q.chunks_exact_mut(dh).enumerate() {
                    for (d, x) in row.iter_mut().enumerate() {
                        *x = s.grad_q_t[d * tp + i] * scale;
                    }
                }
            }
        }
    }
}

/// Keys `j0 .. j0 + nk` of one (head, sample): leaves `dKᵀ`, `dVᵀ` of the block in
/// `s.grad_k_t`, `s.grad_v_t` (`[head_dim, kbp]`) and adds the block's share of `dQᵀ` into
/// `s.grad_q_t`.
#[inline(always)]
fn backward_key_block<V: Lanes>(
    dims: AttentionDims,
    s: &mut BackwardScratch,
    lse: &[f32],
    j0: usize,
    nk: usize,
    qb: usize,
    kbp: usize,
) {
    let (t, dh) = (dims.tokens, dims.head_dim);
    let tp = pad(t);
    let nkp = pad(nk);
    let qbp = pad(qb);
    s.grad_k_t.fill(0.0);
    s.grad_v_t.fill(0.0);
    // Queries before j0 see none of these keys under the causal mask.
    let first_query = if dims.causal { j0 - j0 % qb } else { 0 };
    for i0 in (first_query..t).step_by(qb) {
        let nq = qb.min(t - i0);
        // SAFETY (the five products): q and grad_out are [t, dh] with i0 + nq ≤ t; the `_t`
        // buffers are [dh, tp] with j0 + nkp ≤ tp and i0 + pad(nq) ≤ tp; probs and grad_scores
        // are [qb, kbp] with nkp ≤ kbp; grad_scores_t is [kbp, qbp]; grad_k_t, grad_v_t are
        // [dh, kbp].
        unsafe {
            // S = (scale·Q) Kᵀ and dP = dO Vᵀ, keys in lanes.
            let (k_t, v_t) = (s.k_t.as_ptr().add(j0), s.v_t.as_ptr().add(j0));
            gemm::<V>(nq, nkp, dh, s.q.as_ptr().add(i0 * dh), dh, k_t, tp, s.probs.as_mut_ptr(), kbp, false);
            gemm::<V>(
                nq,
                nkp,
                dh,
                s.grad_out.as_ptr().add(i0 * dh),
                dh,
                v_t,
                tp,
                s.grad_scores.as_mut_ptr(),
                kbp,
                false,
            );
        }
        for ii in 0..nq {
            let i = i0 + ii;
            // Keys at or past `limit` are masked (padding, or after the query when causal).
            let limit = if dims.causal { (i + 1).min(t) } else { t };
            let (lse, delta, limit) = (V::splat(lse[i]), V::splat(s.delta[i]), V::splat(limit as f32));
            let mut c = 0;
            while c < nkp {
                // SAFETY: row ii < nq ≤ qb of the [qb, kbp] tiles, c + V::N ≤ nkp ≤ kbp; iota has
                // tp ≥ j0 + nkp entries.
                unsafe {
                    let at = ii * kbp + c;
                    let visible = V::load(s.iota.as_ptr().add(j0 + c)).lt(limit);
                    let p = exp(V::load(s.probs.as_ptr().add(at)).sub(lse));
                    let p = V::select(visible, p, V::splat(0.0));
                    let grad_p = V::load(s.grad_scores.as_ptr().add(at));
                    p.store(s.probs.as_mut_ptr().add(at));
                    p.mul(grad_p.sub(delta)).store(s.grad_scores.as_mut_ptr().add(at));
                }
                c += V::N;
            }
        }
        // SAFETY: as above.
        unsafe {
            // dVᵀ += dOᵀ P, dKᵀ += (scale·Q)ᵀ dS: keys in lanes, queries summed in order.
            let (grad_out_t, q_t) = (s.grad_out_t.as_ptr().add(i0), s.q_t.as_ptr().add(i0));
            gemm::<V>(dh, nkp, nq, grad_out_t, tp, s.probs.as_ptr(), kbp, s.grad_v_t.as_mut_ptr(), kbp, true);
            gemm::<V>(dh, nkp, nq, q_t, tp, s.grad_scores.as_ptr(), kbp, s.grad_k_t.as_mut_ptr(), kbp, true);
        }
        // dQᵀ += Kᵀ dSᵀ, queries in lanes: transpose the dS tile (padding queries zero).
        for jj in 0..nk {
            let row = &mut s.grad_scores_t[jj * qbp..(jj + 1) * qbp];
            for (ii, x) in row.iter_mut().enumerate() {
                *x = if ii < nq { s.grad_scores[ii * kbp + jj] } else { 0.0 };
            }
        }
        // SAFETY: k_t is [dh, tp] (columns j0 .. j0 + nk); grad_scores_t holds nk rows of qbp ≥
        // pad(nq); grad_q_t is [dh, tp] with i0 + pad(nq) ≤ tp.
        unsafe {
            let grad_q_t = s.grad_q_t.as_mut_ptr().add(i0);
            gemm::<V>(dh, pad(nq), nk, s.k_t.as_ptr().add(j0), tp, s.grad_scores_t.as_ptr(), qbp, grad_q_t, tp, true);
        }
    }
}

/// [`attention_forward`] on a chosen ISA (tests compare them).
#[cfg(test)]
fn forward_on(isa: Isa, dims: AttentionDims, qkv: &[f32], ctx: &mut [f32], logsumexp: &mut [f32]) {
    dispatch_on(isa, Forward { dims, qkv, ctx, logsumexp });
}

/// [`attention_backward`] on a chosen ISA (tests compare them).
#[cfg(test)]
fn backward_on(
    isa: Isa,
    dims: AttentionDims,
    qkv: &[f32],
    ctx: &[f32],
    logsumexp: &[f32],
    grad_ctx: &[f32],
    grad_qkv: &mut [f32],
) {
    dispatch_on(isa, Backward { dims, qkv, ctx, logsumexp, grad_ctx, grad_qkv });
}

#[cfg(test)]
#[path = "attention_tests.rs"]
mod tests;
