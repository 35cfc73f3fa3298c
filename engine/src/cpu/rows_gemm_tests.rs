//! Tests of `cpu::rows_gemm`: within f32 rounding of an f64 reference on ragged shapes (rows not
//! a multiple of a tile, depth not a multiple of the SIMD width, columns not a multiple of a
//! panel), the same bits on every ISA, every operand layout and through `matmul` and
//! `matmul_packed`, and an accumulation that adds the whole product last.
use super::*;
use crate::cpu::packed::{matmul_packed, pack_rhs, packed_len};
use crate::cpu::rows_gemm::strip_width;
use crate::cpu::{matmul, test_values};

const ISAS: [Isa; 4] = Isa::ALL;

/// `(m, k, n)`: few rows against a deep operand (the two deepest packed a panel at a time, the
/// rest whole), and shallow products with a wide output; each ragged somewhere (6- and 8-row
/// blocks, 8 and 16 lanes, 64-column groups, strips packed once).
const SHAPES: [(usize, usize, usize); 10] = [
    (1, 256, 64),
    (20, 1100, 300),
    (9, 2049, 130),
    (7, 300, 130),
    (13, 257, 200),
    (37, 512, 96),
    (64, 1024, 256),
    (300, 5, 260),
    (257, 33, 300),
    (262, 256, 257),
];

/// The operands of one shape: `a` (`m x k`), `b` (`k x n`), both row-major, and their
/// transposes.
struct Operands {
    a: Vec<f32>,
    a_t: Vec<f32>,
    b: Vec<f32>,
    b_t: Vec<f32>,
    strips: Vec<f32>,
}

fn operands(m: usize, k: usize, n: usize) -> Operands {
    let a = test_values(m * k, 1, 1.0);
    let b = test_values(k * n, 2, 0.5);
    let a_t = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
    let b_t = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
    let mut strips = vec![0.0; packed_len(k, n)];
    pack_rhs(MatRef::row_major(&b, k, n).unwrap(), &mut strips).unwrap();
    Operands { a, a_t, b, b_t, strips }
}

/// The product over every layout pair on `isa`: `[a · b, a · bᵀᵀ, a · strips, aᵀᵀ · b, ...]`.
fn products(
    ops: &Operands,
    (m, k, n): (usize, usize, usize),
    isa: Isa,
    start: &[f32],
    accumulate: bool,
) -> Vec<Vec<f32>> {
    let lhs = [MatRef::row_major(&ops.a, m, k).unwrap(), MatRef::row_major(&ops.a_t, k, m).unwrap().t()];
    let rhs = [
        Rhs::Strided(MatRef::row_major(&ops.b, k, n).unwrap()),
        Rhs::Strided(MatRef::row_major(&ops.b_t, n, k).unwrap().t()),
        Rhs::Strips { data: &ops.strips, width: strip_width() },
    ];
    let mut out = Vec::new();
    for lhs in lhs {
        for rhs in rhs {
            let mut dst = start.to_vec();
            // SAFETY: dst holds m x n initialised elements; the operands are k x n.
            unsafe { product_on(isa, dst.as_mut_ptr(), lhs, rhs, n, accumulate) };
            out.push(dst);
        }
    }
    out
}

#[test]
fn within_f32_rounding_of_the_f64_product() {
    for (m, k, n) in SHAPES {
        let ops = operands(m, k, n);
        let start = test_values(m * n, 3, 4.0);
        let got = products(&ops, (m, k, n), Isa::detect(), &start, true);
        let fresh = products(&ops, (m, k, n), Isa::detect(), &start, false);
        // A chain of k fused multiply-adds errs by at most γ_k·Σ|a·b| ≈ k·u·Σ|a·b| (u = 2⁻²⁴), the final
        // addition by u·|result|.
        let u = f64::from(f32::EPSILON) / 2.0;
        for i in 0..m {
            for j in 0..n {
                let terms = (0..k).map(|p| f64::from(ops.a[i * k + p]) * f64::from(ops.b[p * n + j]));
                let (sum, magnitude) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                let expected = f64::from(start[i * n + j]) + sum;
                let bound = 1.01 * k as f64 * u * magnitude;
                let bound_accumulated = bound + u * (expected.abs() + bound);
                assert!(
                    (f64::from(fresh[0][i * n + j]) - sum).abs() <= bound,
                    "{m}x{k}x{n} ({i}, {j}): {} against {sum}",
                    fresh[0][i * n + j]
                );
                assert!(
                    (f64::from(got[0][i * n + j]) - expected).abs() <= bound_accumulated,
                    "{m}x{k}x{n} ({i}, {j}) accumulated: {} against {expected}",
                    got[0][i * n + j]
                );
            }
        }
    }
}

#[test]
fn same_bits_on_every_isa_and_layout_and_the_whole_product_added_last() {
    for (m, k, n) in SHAPES {
        let ops = operands(m, k, n);
        let start = test_values(m * n, 4, 4.0);
        let reference = products(&ops, (m, k, n), Isa::Scalar, &start, false);
        for isa in ISAS.into_iter().filter(|isa| isa.available()) {
            for accumulate in [false, true] {
                let got = products(&ops, (m, k, n), isa, &start, accumulate);
                for (layout, dst) in got.iter().enumerate() {
                    let want: Vec<f32> = if accumulate {
                        start.iter().zip(&reference[0]).map(|(s, p)| s + p).collect()
                    } else {
                        reference[0].clone()
                    };
                    assert!(dst == &want, "{m}x{k}x{n} {isa:?} layout {layout} accumulate={accumulate}");
                }
            }
        }
    }
}

#[test]
fn matmul_and_matmul_packed_take_it_for_the_shapes_it_suits() {
    for (m, k, n) in SHAPES {
        assert!(suits(m, k, n), "{m}x{k}x{n}");
        let ops = operands(m, k, n);
        let lhs = MatRef::row_major(&ops.a, m, k).unwrap();
        let start = test_values(m * n, 5, 1.0);
        let mut expected = start.clone();
        // SAFETY: expected holds m x n initialised elements; b is k x n.
        unsafe { product(expected.as_mut_ptr(), lhs, Rhs::Strided(MatRef::row_major(&ops.b, k, n).unwrap()), n, true) };
        let mut unpacked = start.clone();
        matmul(&mut unpacked, lhs, MatRef::row_major(&ops.b_t, n, k).unwrap().t(), true).unwrap();
        let mut packed = start.clone();
        matmul_packed(&mut packed, lhs, &ops.strips, k, n, true).unwrap();
        assert!(unpacked == expected && packed == expected, "{m}x{k}x{n}");
    }
    // The gemm crate's shapes: many rows against a deep operand, a narrow or shallow output.
    assert!(!suits(257, 1024, 1024) && !suits(64, 128, 1024) && !suits(16, 1024, 32) && !suits(64, 64, 1024));
    assert!(suits(256, 1024, 1024) && suits(16, 1024, 1024) && suits(1024, 16, 1024) && suits(1024, 256, 1024));
}
