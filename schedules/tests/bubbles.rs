//! Bubble fractions and peak in-flight counts against their closed forms.
//!
//! Unit costs: `F = B = W = 1`, a fused backward costs `B + W = 2`, communication is free. Each
//! device then computes `3 m` units per (stage it holds) per micro-batch, so its idle time is
//! `makespan - 3 m v` and `bubble = idle / makespan`. Times are small integers, exact in `f64`,
//! so makespans are compared exactly and fractions to `1e-12`.
use conveyor_schedules::{CostModel, Schedule, ScheduleKind, SimulationReport, StageCosts, simulate, validate};

const EPS: f64 = 1e-12;

fn run(
    kind: ScheduleKind,
    n_devices: usize,
    n_micro_batches: usize,
    n_chunks: usize,
    costs: StageCosts,
) -> SimulationReport {
    let schedule = Schedule::new(kind, n_devices, n_micro_batches, n_chunks).unwrap();
    validate(&schedule, 1).unwrap();
    simulate(&schedule, &CostModel::uniform(costs)).unwrap()
}

/// Every (p, m) with p in 1..=8 and m in 1..=32.
fn shapes() -> impl Iterator<Item = (usize, usize)> {
    (1..=8).flat_map(|p| (1..=32).map(move |m| (p, m)))
}

/// GPipe and 1F1B: the forward wave takes `m + p - 1` units and the backward wave, at 2 units
/// per op, `2 (m + p - 1)`, so makespan `= 3 (m + p - 1)` and bubble `= (p - 1) / (m + p - 1)`:
/// the classic formula holds exactly because F and fused B stretch the same pipeline shape.
#[test]
fn gpipe_and_one_f_one_b_bubble_is_p_minus_1_over_m_plus_p_minus_1() {
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        for (p, m) in shapes() {
            let report = run(kind, p, m, 1, StageCosts::UNIT);
            assert_eq!(report.makespan_s, 3.0 * (m + p - 1) as f64, "{kind} p={p} m={m}");
            let expected = (p - 1) as f64 / (m + p - 1) as f64;
            assert!((report.bubble_fraction - expected).abs() < EPS, "{kind} p={p} m={m}: {}", report.bubble_fraction);
        }
    }
}

/// Interleaved with `v` chunks: per-chunk costs `F = 1`, fused `B = 2`; each device computes
/// `3 m v` and the fill/drain costs `(p - 1)` per-chunk units of `F + B`, i.e. Megatron's
/// `(p - 1)(t_f + t_b) / v` in whole-device units. Makespan `= 3 (m v + p - 1)`, bubble
/// `= (p - 1) / (m v + p - 1)`.
#[test]
fn interleaved_bubble_shrinks_by_v() {
    for n_chunks in 1..=4 {
        for (p, m) in shapes().filter(|(p, m)| n_chunks == 1 || m % p == 0) {
            let report = run(ScheduleKind::Interleaved, p, m, n_chunks, StageCosts::UNIT);
            let units = m * n_chunks + p - 1;
            assert_eq!(report.makespan_s, 3.0 * units as f64, "p={p} m={m} v={n_chunks}");
            let expected = (p - 1) as f64 / units as f64;
            assert!((report.bubble_fraction - expected).abs() < EPS, "p={p} m={m} v={n_chunks}");
        }
    }
}

/// Idle time per device: ZB-H1 `(p - 1)(F + B - W)` against 1F1B's `(p - 1)(F + B + W)` for
/// `m >= p`; with fewer micro-batches than stages the drain cannot be filled and ZB-H1 idles
/// `2p - 1 - m`, still below 1F1B.
#[test]
fn zb_h1_idle_is_p_minus_1_times_f_plus_b_minus_w() {
    for (p, m) in shapes() {
        let zb = run(ScheduleKind::ZbH1, p, m, 1, StageCosts::UNIT);
        let one_f_one_b = run(ScheduleKind::OneFOneB, p, m, 1, StageCosts::UNIT);
        let idle = |report: &SimulationReport| report.makespan_s - 3.0 * m as f64;
        assert_eq!(idle(&one_f_one_b), 3.0 * (p - 1) as f64, "1f1b p={p} m={m}");
        let expected = if m >= p { p - 1 } else { 2 * p - 1 - m };
        assert_eq!(idle(&zb), expected as f64, "zb-h1 p={p} m={m}");
        for busy in &zb.busy_s {
            assert_eq!(*busy, 3.0 * m as f64);
        }
    }
}

/// ZB-H2, `m >= p`: the only idle time is the fill offset `(p - 1) F` that no schedule avoids in
/// a single step, so bubble `= (p - 1) / (3 m + p - 1)`, below `1 / 7` once `m >= 2p`. Once the
/// `2p - 1` warm-up forwards fit (`m >= 2p - 1`), no device idles between its first and last op
/// (interior bubble exactly 0): overlapping consecutive steps would leave no bubble at all.
#[test]
fn zb_h2_has_no_interior_bubble() {
    for (p, m) in shapes().filter(|(p, m)| m >= p) {
        let report = run(ScheduleKind::ZbH2, p, m, 1, StageCosts::UNIT);
        if m >= 2 * p - 1 {
            assert_eq!(report.interior_bubble_fraction, 0.0, "p={p} m={m}");
        }
        let expected = (p - 1) as f64 / (3 * m + p - 1) as f64;
        assert!((report.bubble_fraction - expected).abs() < EPS, "p={p} m={m}");
        if m >= 2 * p {
            assert!(report.bubble_fraction < 1.0 / 7.0, "p={p} m={m}");
        }
    }
}

/// With `B` twice `F` and `W` (`F = 1, B = 2, W = 1`) the two Zero Bubble schedules part: ZB-H1
/// idles `(p - 1)(F + B - W) = 2 (p - 1)`, ZB-H2 only the fill `(p - 1) F`; 1F1B idles
/// `(p - 1)(F + B + W) = 4 (p - 1)`.
#[test]
fn zb_h2_beats_zb_h1_when_b_is_expensive() {
    let costs = StageCosts::new(1.0, 2.0, 1.0);
    for (p, m) in shapes().filter(|(p, m)| *m >= 2 * p) {
        let idle = |kind| run(kind, p, m, 1, costs).makespan_s - 4.0 * m as f64;
        assert_eq!(idle(ScheduleKind::OneFOneB), 4.0 * (p - 1) as f64, "1f1b p={p} m={m}");
        assert_eq!(idle(ScheduleKind::ZbH1), 2.0 * (p - 1) as f64, "zb-h1 p={p} m={m}");
        assert_eq!(idle(ScheduleKind::ZbH2), (p - 1) as f64, "zb-h2 p={p} m={m}");
    }
}

/// GPipe holds every micro-batch on every stage; 1F1B holds `min(m, p - s)` on stage `s`;
/// ZB-H1 never exceeds 1F1B's peak `min(m, p)` and reaches it on stage 0; ZB-H2 holds at most
/// `min(m, 2p - 1)`. Interleaved device `d` holds at most Megatron's warm-up count plus one,
/// `min(m v, 2 (p - d - 1) + (v - 1) p + 1)`, (micro-batch, chunk) pairs.
#[test]
fn peak_inflight_per_stage() {
    for (p, m) in shapes() {
        let gpipe = run(ScheduleKind::GPipe, p, m, 1, StageCosts::UNIT);
        assert_eq!(gpipe.peak_inflight, vec![m; p], "gpipe p={p} m={m}");
        let one_f_one_b = run(ScheduleKind::OneFOneB, p, m, 1, StageCosts::UNIT);
        let expected: Vec<usize> = (0..p).map(|s| m.min(p - s)).collect();
        assert_eq!(one_f_one_b.peak_inflight, expected, "1f1b p={p} m={m}");
        let zb_h1 = run(ScheduleKind::ZbH1, p, m, 1, StageCosts::UNIT);
        assert_eq!(zb_h1.peak_inflight[0], m.min(p), "zb-h1 p={p} m={m}");
        assert!(zb_h1.peak_inflight.iter().all(|&peak| peak <= m.min(p)), "zb-h1 p={p} m={m}");
        for n_chunks in 2..=4 {
            if m % p == 0 {
                let interleaved = run(ScheduleKind::Interleaved, p, m, n_chunks, StageCosts::UNIT);
                let expected: Vec<usize> =
                    (0..p).map(|d| (m * n_chunks).min(2 * (p - d - 1) + (n_chunks - 1) * p + 1)).collect();
                assert_eq!(interleaved.peak_inflight_per_device, expected, "interleaved p={p} m={m} v={n_chunks}");
            }
        }
        let zb_h2 = run(ScheduleKind::ZbH2, p, m, 1, StageCosts::UNIT);
        assert!(zb_h2.peak_inflight.iter().all(|&peak| peak <= m.min(2 * p - 1)), "zb-h2 p={p} m={m}");
    }
}

/// The shapes each new schedule is defined for: DualPipe-V needs `m >= 2p`; interleaved zero
/// bubble takes `v` in `2..=4`, the V kinds exactly 2.
fn new_kind_shapes() -> impl Iterator<Item = (ScheduleKind, usize, usize, usize)> {
    shapes().flat_map(|(p, m)| {
        let v_kinds = [ScheduleKind::ZbV, ScheduleKind::DualPipeV]
            .into_iter()
            .filter(move |&kind| kind != ScheduleKind::DualPipeV || m >= 2 * p)
            .map(move |kind| (kind, p, m, 2));
        v_kinds.chain((2..=4).map(move |v| (ScheduleKind::InterleavedZb, p, m, v)))
    })
}

/// The three schedules with chunks and split backward, at `p = 4, m = 8` and `F = B = W = 1` per
/// stage: interior bubble below 5% (ZB-V 1/49, DualPipe-V and interleaved zero bubble 3/99 at
/// `v = 2`), against ZB-H1's 1/17 on whole-device stages.
#[test]
fn chunked_zero_bubble_interior_bubble_is_below_5_percent() {
    let expected = [(ScheduleKind::ZbV, 51.0, 1.0 / 49.0), (ScheduleKind::DualPipeV, 51.0, 3.0 / 99.0)];
    for (kind, makespan, interior) in expected.into_iter().chain([(ScheduleKind::InterleavedZb, 51.0, 3.0 / 99.0)]) {
        let report = run(kind, 4, 8, 2, StageCosts::UNIT);
        assert_eq!(report.makespan_s, makespan, "{kind}");
        assert!(
            (report.interior_bubble_fraction - interior).abs() < EPS,
            "{kind}: {}",
            report.interior_bubble_fraction
        );
        assert!(report.interior_bubble_fraction < 0.05, "{kind}");
        assert!(report.busy_s.iter().all(|&busy| busy == 48.0), "{kind}");
    }
    let zb_h1 = run(ScheduleKind::ZbH1, 4, 8, 1, StageCosts::UNIT);
    assert!((zb_h1.interior_bubble_fraction - 1.0 / 17.0).abs() < EPS);
}

/// Memory: ZB-V and interleaved zero bubble hold at most `p v` (micro-batch, stage) activation
/// sets per device, `p` micro-batches of the whole device's layers: ZB-H1's peak. DualPipe-V holds
/// exactly `2p + 1` on every device (one more than ZB-V: the forward of a pair runs before its
/// backward frees).
/// Every shape validates at channel capacity 1 and completes in the simulator.
#[test]
fn chunked_zero_bubble_memory_is_bounded() {
    for (kind, p, m, v) in new_kind_shapes() {
        let report = run(kind, p, m, v, StageCosts::UNIT);
        let bound = match kind {
            ScheduleKind::DualPipeV => 2 * p + 1,
            _ => p * v,
        }
        .min(m * v);
        let peak = report.peak_inflight_per_device.iter().copied().max().unwrap();
        assert!(peak <= bound, "{kind} p={p} m={m} v={v}: peak {peak} over {bound}");
        if kind == ScheduleKind::DualPipeV {
            // Every device runs phase 4, its forward before its paired backward: exactly 2p + 1.
            assert_eq!(report.peak_inflight_per_device, vec![2 * p + 1; p], "{kind} p={p} m={m}");
        }
        assert!(report.busy_s.iter().all(|&busy| busy == (3 * m * v) as f64), "{kind} p={p} m={m} v={v}");
    }
}
