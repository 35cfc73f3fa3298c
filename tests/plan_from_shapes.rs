//! `conveyor plan` plans from shapes: a model of 2.7 billion parameters (10.8 GB of f32 weights,
//! with activations of 3.2 GB per micro-batch) is planned in moments without allocating any of it.
//! The model is built with parameters the operating system never maps (zeros nobody writes), and
//! layers too large to run once are bounded from their shapes. One test in its own binary, so the
//! peak memory of the children it waits for is its own child's.
use std::process::Command;
use std::time::Instant;

#[test]
fn a_model_larger_than_memory_is_planned_without_allocating_it() {
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_conveyor"))
        .args(["plan", "--model", "mlp:16,100000000,10", "--devices", "cpu:3"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("1700.00 M"), "the first stage's parameters: {stdout}");
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes one rusage through a valid pointer.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) }, 0);
    let peak_mib = usage.ru_maxrss as f64 / 1024.0;
    println!("planned in {:.2} s with a peak of {peak_mib:.1} MiB", started.elapsed().as_secs_f64());
    assert!(peak_mib < 256.0, "planning took {peak_mib:.0} MiB of memory");
}
