//! What the engine's kernel benchmarks share: timing a call by the median of repetitions, and a
//! fixed pseudo-random input.
use std::time::Instant;

/// Median nanoseconds per call of `f`, over 15 repetitions (5 when `few_for_slow` and a call
/// takes over 50 ms) of enough calls to fill ~20 ms.
pub fn time(mut f: impl FnMut(), few_for_slow: bool) -> f64 {
    let start = Instant::now();
    f();
    let once = start.elapsed().as_secs_f64().max(1e-7);
    let calls = ((0.02 / once) as usize).clamp(1, 10_000);
    let reps = if few_for_slow && once > 0.05 { 5 } else { 15 };
    let mut samples: Vec<f64> = (0..reps)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..calls {
                f();
            }
            start.elapsed().as_secs_f64() * 1e9 / calls as f64
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// `n` values of a fixed pseudo-random sequence (xorshift), roughly normal (a sum of uniforms)
/// with standard deviation about `scale`.
pub fn values(n: usize, scale: f32) -> Vec<f32> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    (0..n).map(|_| ((0..4).map(|_| uniform()).sum::<f32>() - 2.0) * scale * 1.73).collect()
}
