//! `--data tokens:N,T,VOCAB,C` trains the transformer of the zoo from the command line and learns
//! the task (the label is the first token mod C), and malformed token specs exit 2.
use std::process::Command;

#[test]
fn the_transformer_learns_the_token_task() {
    let out = Command::new(env!("CARGO_BIN_EXE_conveyor"))
        .args(["train", "--data", "tokens:1024,8,16,4", "--test-fraction", "0.25", "--devices", "cpu:2"])
        .args(["--steps", "120", "--batch", "32", "--microbatches", "4", "--log-every", "0", "--seed", "1"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("transformer:16,8,32,4,2,4"), "{stdout}");
    let accuracy: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("test accuracy ")?.split('%').next()?.parse().ok())
        .expect("an accuracy line");
    assert!(accuracy >= 90.0, "accuracy {accuracy}% on a task chance gets 25% of");
}

#[test]
fn malformed_token_specs_exit_2() {
    for spec in ["tokens:10,4", "tokens:10,4,1,2", "tokens:a,b,c,d"] {
        let out = Command::new(env!("CARGO_BIN_EXE_conveyor")).args(["train", "--data", spec]).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{spec}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stderr).contains("tokens:N,T,VOCAB,C"), "{spec}");
    }
}
