//! Helpers shared by the engine's integration tests: seeded test values.
#![allow(dead_code)]

/// Seeded values in `[-1, 1)` (a 64-bit LCG, high bits).
pub fn values(seed: u64, len: usize) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}
