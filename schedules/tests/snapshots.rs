//! Snapshot tests of small timelines drawn as text (`F = B = W = 1`, fused backward 2, free
//! communication). Update with `UPDATE_EXPECT=1 cargo test -p conveyor-schedules`.
use conveyor_schedules::{CostModel, Schedule, ScheduleKind, render_timeline, simulate, validate};
use expect_test::{Expect, expect};

fn check(kind: ScheduleKind, n_devices: usize, n_micro_batches: usize, n_chunks: usize, expected: Expect) {
    let schedule = Schedule::new(kind, n_devices, n_micro_batches, n_chunks).unwrap();
    validate(&schedule, 1).unwrap();
    let report = simulate(&schedule, &CostModel::default()).unwrap();
    let text = format!(
        "{}makespan {} bubble {:.4} peak in-flight {:?}\n",
        render_timeline(&report.timeline),
        report.makespan_s,
        report.bubble_fraction,
        report.peak_inflight
    );
    expected.assert_eq(&text);
}

#[test]
fn gpipe_p2_m2() {
    check(
        ScheduleKind::GPipe,
        2,
        2,
        1,
        expect![[r#"
            dev0 |F0 F1 .  .  .  B0 -  B1 -  |
            dev1 |.  F0 F1 B0 -  B1 -  .  .  |
            makespan 9 bubble 0.3333 peak in-flight [2, 2]
        "#]],
    );
}

#[test]
fn one_f_one_b_p3_m4() {
    check(
        ScheduleKind::OneFOneB,
        3,
        4,
        1,
        expect![[r#"
        dev0 |F0 F1 F2 .  .  .  .  B0 -  F3 B1 -  .  B2 -  .  B3 -  |
        dev1 |.  F0 F1 .  .  B0 -  F2 B1 -  F3 B2 -  .  B3 -  .  .  |
        dev2 |.  .  F0 B0 -  F1 B1 -  F2 B2 -  F3 B3 -  .  .  .  .  |
        makespan 18 bubble 0.3333 peak in-flight [3, 2, 1]
    "#]],
    );
}

#[test]
fn interleaved_p2_v2_m4() {
    check(
        ScheduleKind::Interleaved,
        2,
        4,
        2,
        expect![[r#"
        dev0 |F0:0 F1:0 F0:1 F1:1 F2:0 .    B0:1 -    F3:0 B1:1 -    F2:1 B0:0 -    F3:1 B1:0 -    .    B2:1 -    .    B3:1 -    B2:0 -    B3:0 -    |
        dev1 |.    F0:0 F1:0 F0:1 B0:1 -    F1:1 B1:1 -    F2:0 B0:0 -    F3:0 B1:0 -    F2:1 B2:1 -    F3:1 B3:1 -    B2:0 -    B3:0 -    .    .    |
        makespan 27 bubble 0.1111 peak in-flight [4, 3, 2, 1]
    "#]],
    );
}

#[test]
fn zb_h1_p3_m4() {
    check(
        ScheduleKind::ZbH1,
        3,
        4,
        1,
        expect![[r#"
        dev0 |F0 F1 F2 .  .  I0 W0 F3 I1 W1 I2 W2 I3 W3 |
        dev1 |.  F0 F1 .  I0 F2 I1 W0 F3 I2 W1 I3 W2 W3 |
        dev2 |.  .  F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3 |
        makespan 14 bubble 0.1429 peak in-flight [3, 3, 3]
    "#]],
    );
}

#[test]
fn zb_h2_p3_m6() {
    check(
        ScheduleKind::ZbH2,
        3,
        6,
        1,
        expect![[r#"
        dev0 |F0 F1 F2 F3 F4 I0 W0 F5 I1 I2 W1 W2 I3 I4 W3 W4 I5 W5 .  .  |
        dev1 |.  F0 F1 F2 I0 F3 I1 F4 I2 W0 F5 I3 I4 W1 W2 I5 W3 W4 W5 .  |
        dev2 |.  .  F0 I0 F1 I1 F2 I2 F3 I3 F4 I4 W0 F5 I5 W1 W2 W3 W4 W5 |
        makespan 20 bubble 0.1000 peak in-flight [5, 5, 5]
    "#]],
    );
}

#[test]
fn zb_v_p2_m4() {
    check(
        ScheduleKind::ZbV,
        2,
        4,
        2,
        expect![[r#"
        dev0 |F0:0 F1:0 F2:0 F0:1 I0:1 W0:1 F1:1 I1:1 I0:0 W1:1 F3:0 I1:0 W0:0 F2:1 I2:1 W1:0 W2:1 I2:0 W2:0 F3:1 I3:1 W3:1 .    I3:0 W3:0 |
        dev1 |.    F0:0 F0:1 F1:0 F1:1 I0:1 I0:0 W0:1 F2:0 I1:1 I1:0 W0:0 F2:1 W1:1 F3:0 I2:1 I2:0 W1:0 F3:1 W2:1 W2:0 I3:1 I3:0 W3:1 W3:0 |
        makespan 25 bubble 0.0400 peak in-flight [4, 3, 2, 1]
    "#]],
    );
}

#[test]
fn dualpipe_v_p2_m4() {
    check(
        ScheduleKind::DualPipeV,
        2,
        4,
        2,
        expect![[r#"
        dev0 |F0:0 F1:0 F2:0 F0:1 I0:1 W0:1 F1:1 F3:0 B1:1 -    F2:1 B0:0 -    B2:1 -    F3:1 .    B1:0 -    B3:1 -    I2:0 W2:0 I3:0 W3:0 |
        dev1 |.    F0:0 F0:1 F1:0 F1:1 F2:0 B0:1 -    F2:1 B0:0 -    F3:0 B1:1 -    F3:1 B1:0 -    B2:1 -    B2:0 -    I3:1 I3:0 W3:1 W3:0 |
        makespan 25 bubble 0.0400 peak in-flight [4, 3, 2, 1]
    "#]],
    );
}

#[test]
fn interleaved_zb_p2_v2_m4() {
    check(
        ScheduleKind::InterleavedZb,
        2,
        4,
        2,
        expect![[r#"
        dev0 |F0:0 F1:0 F0:1 F1:1 .    I0:1 W0:1 F2:0 I1:1 I0:0 W1:1 F2:1 I1:0 W0:0 F3:0 I2:1 W1:0 F3:1 I2:0 W2:1 I3:1 W2:0 I3:0 W3:1 W3:0 |
        dev1 |.    F0:0 F1:0 F0:1 I0:1 F1:1 I1:1 I0:0 W0:1 F2:0 I1:0 W1:1 F2:1 I2:1 W0:0 F3:0 I2:0 W1:0 F3:1 I3:1 W2:1 I3:0 W2:0 W3:1 W3:0 |
        makespan 25 bubble 0.0400 peak in-flight [3, 3, 2, 2]
    "#]],
    );
}
