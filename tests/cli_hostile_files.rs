//! Hostile files, streams and signals: outputs never replace what is not a regular file (device
//! nodes are written straight through, symbolic links followed and kept, directories refused),
//! never overwrite an input of the run, are checked before training starts, leave no temporary
//! file behind; a closed or full stdout or stderr never stops a run; SIGINT and SIGTERM stop it
//! between steps with every output written and whole.
//!
//! The table (`cases`) runs through the CLI suite's harness (`cli_cases_support`): exit status,
//! a phrase, files that must come through unchanged (by hash and file type, so `/dev/null` must
//! still be a character device), no panic, a time limit. Cases that refuse an output before
//! training give `--steps 1000000`: were the run to train first, it would pass the time limit.
//! Streams and signals need more than the harness gives (redirections, a signal mid-run) and have
//! their own tests below.
mod cli_cases_support;
mod train_cli_support;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use cli_cases_support::{Case, nothing, run_table};
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};

/// `conveyor train` on a small model and data set (three steps), then the case's flags.
macro_rules! train {
    ($($extra:expr),* $(,)?) => {
        &["train", "--model", "mlp:8,16,4", "--data", "synthetic:64,8,4", "--batch", "16", "--steps", "3",
          "--devices", "cpu:2", "--log-every", "0", $($extra),*]
    };
}

/// `conveyor train` that would train for minutes: a case using it must be refused before step 1.
macro_rules! train_long {
    ($($extra:expr),* $(,)?) => {
        &["train", "--model", "mlp:8,16,4", "--data", "synthetic:64,8,4", "--batch", "16", "--steps", "1000000",
          "--devices", "cpu:2", "--log-every", "0", $($extra),*]
    };
}

/// `conveyor train` on the data file `data.st` (see [`data_file`]), then the case's flags.
macro_rules! train_on_file {
    ($($extra:expr),* $(,)?) => {
        &["train", "--model", "mlp:8,16,4", "--data", "data.st", "--batch", "16", "--steps", "1000000",
          "--devices", "cpu:2", "--log-every", "0", $($extra),*]
    };
}

/// `conveyor train` on the small model with the data, steps and logging given, then `extra`.
fn train_args<'a>(data: &'a str, steps: &'a str, log_every: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["train", "--model", "mlp:8,16,4", "--data", data, "--batch", "16", "--steps", steps];
    args.extend(["--devices", "cpu:2", "--log-every", log_every]);
    args.extend(extra);
    args
}

/// Writes a valid data file: 64 rows of 8 features in 4 classes.
fn write_data_file(path: &Path) {
    let inputs: Vec<u8> = (0..64 * 8).flat_map(|i| ((i % 7) as f32 * 0.1).to_le_bytes()).collect();
    let labels: Vec<u8> = (0..64i64).flat_map(|i| (i % 4).to_le_bytes()).collect();
    let views = vec![
        ("inputs", TensorView::new(Dtype::F32, vec![64, 8], &inputs).unwrap()),
        ("labels", TensorView::new(Dtype::I64, vec![64], &labels).unwrap()),
    ];
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

fn data_file(dir: &Path) {
    write_data_file(&dir.join("data.st"));
}

fn data_file_and_hard_link(dir: &Path) {
    data_file(dir);
    std::fs::hard_link(dir.join("data.st"), dir.join("hard.st")).unwrap();
}

fn data_file_and_symlink(dir: &Path) {
    data_file(dir);
    std::os::unix::fs::symlink("data.st", dir.join("link.st")).unwrap();
}

fn data_file_and_subdir(dir: &Path) {
    data_file(dir);
    std::fs::create_dir(dir.join("sub")).unwrap();
}

fn subdir(dir: &Path) {
    std::fs::create_dir(dir.join("sub")).unwrap();
}

fn a_file(dir: &Path) {
    std::fs::write(dir.join("file.txt"), "not a directory").unwrap();
}

fn previous_outputs(dir: &Path) {
    for name in ["model.st", "metrics.jsonl", "trace.json", "chart.svg"] {
        std::fs::write(dir.join(name), "previous").unwrap();
    }
}

fn symlink_to_missing_file(dir: &Path) {
    std::fs::create_dir(dir.join("real")).unwrap();
    std::os::unix::fs::symlink("real/out", dir.join("link")).unwrap();
}

fn symlink_chain(dir: &Path) {
    std::fs::create_dir(dir.join("real")).unwrap();
    std::fs::write(dir.join("real/out"), "previous").unwrap();
    std::os::unix::fs::symlink("real/out", dir.join("link1")).unwrap();
    std::os::unix::fs::symlink(dir.join("link1"), dir.join("link2")).unwrap();
}

fn symlink_to_dev_null(dir: &Path) {
    std::os::unix::fs::symlink("/dev/null", dir.join("link")).unwrap();
}

fn symlink_loop(dir: &Path) {
    std::os::unix::fs::symlink("b", dir.join("a")).unwrap();
    std::os::unix::fs::symlink("a", dir.join("b")).unwrap();
}

fn symlink_to_directory(dir: &Path) {
    subdir(dir);
    std::os::unix::fs::symlink("sub", dir.join("link")).unwrap();
}

fn some_input_files(dir: &Path) {
    for name in ["ck.st", "init.st"] {
        std::fs::write(dir.join(name), "an input").unwrap();
    }
    std::fs::write(dir.join("placement.txt"), "0\n1 2\n").unwrap();
}

fn mnist_directory(dir: &Path) {
    std::fs::create_dir(dir.join("mnist")).unwrap();
    for name in conveyor::data::MNIST_FILES {
        std::fs::write(dir.join("mnist").join(name), "idx bytes").unwrap();
    }
}

/// A checkpoint at step 2 of the `train!` run, written by conveyor itself.
fn checkpoint_at_step_2(dir: &Path) {
    let status = Command::new(env!("CARGO_BIN_EXE_conveyor"))
        .args(train_args("synthetic:64,8,4", "2", "0", &["--checkpoint", "ck.st"]))
        .current_dir(dir)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
}

/// The name of a temporary file of process `pid`, as conveyor names them.
fn temporary(target: &str, pid: u32) -> String {
    format!(".{target}.conveyor-tmp-{pid}-0")
}

/// A process id no process has (above any `pid_max`).
const DEAD_PID: u32 = i32::MAX as u32 - 1;

fn set_age(path: &Path, age: Duration) {
    let file = std::fs::File::options().write(true).open(path).unwrap();
    file.set_modified(SystemTime::now() - age).unwrap();
}

/// Temporary files conveyor must keep: a live process's (init's, pid 1), and a dead process's
/// written a moment ago (it may be a writer in another PID namespace sharing the directory).
fn temporaries_to_keep(dir: &Path) {
    std::fs::write(dir.join(temporary("model.st", 1)), "partial").unwrap();
    set_age(&dir.join(temporary("model.st", 1)), Duration::from_secs(3600));
    std::fs::write(dir.join(temporary("model.st", DEAD_PID)), "partial").unwrap();
}

#[rustfmt::skip]
fn cases() -> Vec<Case> {
    vec![
        // Device nodes: written straight through, still device nodes afterwards.
        Case { name: "save_dev_null", args: train!["--save", "/dev/null"], setup: nothing, exit: 0,
               phrase: "saved the parameters at step 3 to /dev/null", unchanged: &["/dev/null"] },
        Case { name: "checkpoint_dev_null", args: train!["--checkpoint", "/dev/null"], setup: nothing, exit: 0,
               phrase: "saved a training checkpoint at step 3", unchanged: &["/dev/null"] },
        Case { name: "metrics_dev_null", args: train!["--metrics", "/dev/null"], setup: nothing, exit: 0,
               phrase: "wrote the metrics of 3 steps to /dev/null", unchanged: &["/dev/null"] },
        Case { name: "trace_dev_null", args: train!["--trace", "/dev/null"], setup: nothing, exit: 0,
               phrase: "wrote a trace of", unchanged: &["/dev/null"] },
        Case { name: "svg_dev_null", args: train!["--svg", "/dev/null"], setup: nothing, exit: 0,
               phrase: "wrote the last step's chart to /dev/null", unchanged: &["/dev/null"] },
        Case { name: "every_output_on_dev_null",
               args: train!["--save", "/dev/null", "--checkpoint", "/dev/null", "--metrics", "/dev/null",
                             "--trace", "/dev/null", "--svg", "/dev/null"],
               setup: nothing, exit: 0, phrase: "saved the parameters", unchanged: &["/dev/null"] },
        Case { name: "save_through_a_link_to_dev_null", args: train!["--save", "link"], setup: symlink_to_dev_null,
               exit: 0, phrase: "saved the parameters", unchanged: &["/dev/null", "link"] },
        Case { name: "metrics_to_dev_stdout_a_pipe", args: train!["--metrics", "/dev/stdout"], setup: nothing, exit: 0,
               phrase: "\"summary\":true", unchanged: &["/dev/stdout"] },
        Case { name: "save_dev_full", args: train!["--save", "/dev/full"], setup: nothing, exit: 2,
               phrase: "no space left on device", unchanged: &["/dev/full"] },
        Case { name: "metrics_dev_full", args: train!["--metrics", "/dev/full"], setup: nothing, exit: 1,
               phrase: "no space left on device", unchanged: &["/dev/full"] },
        Case { name: "simulate_svg_dev_null",
               args: &["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--svg", "/dev/null"],
               setup: nothing, exit: 0, phrase: "makespan", unchanged: &["/dev/null"] },
        Case { name: "simulate_trace_dev_null",
               args: &["simulate", "--schedule", "zb-h1", "--stages", "2", "--microbatches", "4", "--trace", "/dev/null"],
               setup: nothing, exit: 0, phrase: "makespan", unchanged: &["/dev/null"] },

        // Symbolic links: the target is written, the link stays.
        Case { name: "save_through_a_dangling_link", args: train!["--save", "link"], setup: symlink_to_missing_file,
               exit: 0, phrase: "saved the parameters", unchanged: &["link"] },
        Case { name: "checkpoint_through_a_chain_of_links", args: train!["--checkpoint", "link2"], setup: symlink_chain,
               exit: 0, phrase: "saved a training checkpoint", unchanged: &["link1", "link2"] },
        Case { name: "metrics_through_a_link", args: train!["--metrics", "link"], setup: symlink_to_missing_file,
               exit: 0, phrase: "wrote the metrics", unchanged: &["link"] },
        Case { name: "trace_and_svg_through_links", args: train!["--trace", "link1", "--svg", "link"],
               setup: symlink_to_missing_file_and_chain, exit: 0, phrase: "wrote the last step's chart",
               unchanged: &["link", "link1", "link2"] },
        Case { name: "simulate_svg_through_a_link",
               args: &["simulate", "--schedule", "gpipe", "--stages", "2", "--microbatches", "2", "--svg", "link"],
               setup: symlink_to_missing_file, exit: 0, phrase: "makespan", unchanged: &["link"] },
        Case { name: "a_link_loop_is_refused", args: train_long!["--save", "a"], setup: symlink_loop, exit: 2,
               phrase: "symbolic links", unchanged: &["a", "b"] },
        Case { name: "a_link_to_a_directory_is_refused", args: train_long!["--metrics", "link"],
               setup: symlink_to_directory, exit: 2, phrase: "is a directory", unchanged: &["link", "sub"] },

        // Directories and paths that name no file.
        Case { name: "save_is_the_case_directory", args: train_long!["--save", "{dir}"], setup: nothing, exit: 2,
               phrase: "is a directory", unchanged: &[] },
        Case { name: "save_is_dot", args: train_long!["--save", "."], setup: nothing, exit: 2,
               phrase: "is a directory", unchanged: &[] },
        Case { name: "checkpoint_is_a_directory", args: train_long!["--checkpoint", "sub"], setup: subdir, exit: 2,
               phrase: "--checkpoint sub: it is a directory", unchanged: &["sub"] },
        Case { name: "metrics_is_a_directory", args: train_long!["--metrics", "sub"], setup: subdir, exit: 2,
               phrase: "cannot write --metrics sub: it is a directory", unchanged: &["sub"] },
        Case { name: "trace_is_a_directory", args: train_long!["--trace", "sub/"], setup: subdir, exit: 2,
               phrase: "is a directory", unchanged: &["sub"] },
        Case { name: "svg_is_dot_dot", args: train_long!["--svg", "sub/.."], setup: subdir, exit: 2,
               phrase: "is a directory", unchanged: &["sub"] },
        Case { name: "save_under_a_file", args: train_long!["--save", "file.txt/model.st"], setup: a_file, exit: 2,
               phrase: "not a directory", unchanged: &["file.txt"] },
        Case { name: "simulate_svg_is_a_directory",
               args: &["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--svg", "."],
               setup: nothing, exit: 2, phrase: "is a directory", unchanged: &[] },

        // Directories that do not exist or cannot be written: refused before step 1.
        Case { name: "save_in_a_missing_directory", args: train_long!["--save", "nodir/model.st"], setup: nothing,
               exit: 2, phrase: "directory nodir does not exist", unchanged: &["nodir"] },
        Case { name: "checkpoint_in_a_missing_directory", args: train_long!["--checkpoint", "nodir/ck.st"],
               setup: nothing, exit: 2, phrase: "cannot write --checkpoint nodir/ck.st", unchanged: &["nodir"] },
        Case { name: "metrics_in_a_missing_directory", args: train_long!["--metrics", "nodir/m.jsonl"],
               setup: nothing, exit: 2, phrase: "does not exist", unchanged: &["nodir"] },
        Case { name: "trace_in_a_missing_directory", args: train_long!["--trace", "nodir/t.json"], setup: nothing,
               exit: 2, phrase: "does not exist", unchanged: &["nodir"] },
        Case { name: "svg_in_a_missing_directory", args: train_long!["--svg", "nodir/x.svg"], setup: nothing,
               exit: 2, phrase: "cannot write --svg nodir/x.svg: directory nodir does not exist", unchanged: &["nodir"] },
        Case { name: "svg_in_a_missing_directory_after_good_outputs",
               args: train_long!["--save", "model.st", "--svg", "nodir/x.svg"], setup: nothing, exit: 2,
               phrase: "--svg", unchanged: &["model.st", "nodir"] },
        Case { name: "metrics_on_proc", args: train_long!["--metrics", "/proc/conveyor-metrics.jsonl"],
               setup: nothing, exit: 2, phrase: "cannot create a file in directory /proc", unchanged: &[] },

        // An output onto an input of the run, or two outputs on one file.
        Case { name: "save_onto_the_data_file", args: train_on_file!["--save", "data.st"], setup: data_file, exit: 2,
               phrase: "--save data.st is the --data file", unchanged: &["data.st"] },
        Case { name: "metrics_onto_the_data_file", args: train_on_file!["--metrics", "./data.st"], setup: data_file,
               exit: 2, phrase: "is the --data file", unchanged: &["data.st"] },
        Case { name: "save_onto_a_hard_link_of_the_data", args: train_on_file!["--save", "hard.st"],
               setup: data_file_and_hard_link, exit: 2, phrase: "--save hard.st is the --data file (data.st)",
               unchanged: &["data.st", "hard.st"] },
        Case { name: "save_onto_a_symlink_to_the_data", args: train_on_file!["--checkpoint", "link.st"],
               setup: data_file_and_symlink, exit: 2, phrase: "--checkpoint link.st is the --data file",
               unchanged: &["data.st", "link.st"] },
        Case { name: "trace_onto_the_data_by_a_roundabout_path", args: train_on_file!["--trace", "sub/../data.st"],
               setup: data_file_and_subdir, exit: 2, phrase: "is the --data file", unchanged: &["data.st"] },
        Case { name: "metrics_onto_the_resume_file", args: train_long!["--resume", "ck.st", "--metrics", "ck.st"],
               setup: some_input_files, exit: 2, phrase: "--metrics ck.st is the --resume file", unchanged: &["ck.st"] },
        Case { name: "save_onto_the_resume_file", args: train_long!["--resume", "ck.st", "--save", "ck.st"],
               setup: some_input_files, exit: 2, phrase: "--save ck.st is the --resume file", unchanged: &["ck.st"] },
        Case { name: "save_onto_the_init_file", args: train_long!["--init", "init.st", "--save", "init.st"],
               setup: some_input_files, exit: 2, phrase: "--save init.st is the --init file", unchanged: &["init.st"] },
        Case { name: "checkpoint_onto_the_init_file", args: train_long!["--init", "init.st", "--checkpoint", "init.st"],
               setup: some_input_files, exit: 2, phrase: "is the --init file", unchanged: &["init.st"] },
        Case { name: "svg_onto_the_placement_file", args: train_long!["--placement", "placement.txt", "--svg", "placement.txt"],
               setup: some_input_files, exit: 2, phrase: "--svg placement.txt is the --placement file",
               unchanged: &["placement.txt"] },
        Case { name: "save_onto_an_mnist_file",
               args: &["train", "--data", "mnist", "--steps", "1000000", "--save", "mnist/train-images-idx3-ubyte"],
               setup: mnist_directory, exit: 2, phrase: "is the --data file",
               unchanged: &["mnist/train-images-idx3-ubyte"] },
        Case { name: "save_and_checkpoint_on_one_file", args: train_long!["--save", "out.st", "--checkpoint", "out.st"],
               setup: nothing, exit: 2, phrase: "--save out.st and --checkpoint out.st are the same file",
               unchanged: &["out.st"] },
        Case { name: "metrics_and_trace_on_one_existing_file", args: train_long!["--metrics", "model.st", "--trace", "./model.st"],
               setup: previous_outputs, exit: 2, phrase: "are the same file", unchanged: &["model.st"] },
        Case { name: "trace_and_svg_through_a_link", args: train_long!["--trace", "link", "--svg", "real/out"],
               setup: symlink_to_missing_file, exit: 2, phrase: "are the same file", unchanged: &["link"] },
        Case { name: "checkpoint_onto_the_resume_file_continues_in_place",
               args: train!["--resume", "ck.st", "--checkpoint", "ck.st"], setup: checkpoint_at_step_2, exit: 0,
               phrase: "saved a training checkpoint at step 3 to ck.st", unchanged: &[] },

        // Regular files are replaced; others' temporary files are left alone.
        Case { name: "previous_outputs_are_replaced",
               args: train!["--save", "model.st", "--metrics", "metrics.jsonl", "--trace", "trace.json", "--svg", "chart.svg"],
               setup: previous_outputs, exit: 0, phrase: "wrote the last step's chart to chart.svg", unchanged: &[] },
        Case { name: "live_or_recent_temporaries_are_kept", args: train!["--save", "model.st"],
               setup: temporaries_to_keep, exit: 0, phrase: "saved the parameters",
               unchanged: &[".model.st.conveyor-tmp-1-0", ".model.st.conveyor-tmp-2147483646-0"] },
    ]
}

fn symlink_to_missing_file_and_chain(dir: &Path) {
    symlink_to_missing_file(dir);
    std::fs::write(dir.join("real/chained"), "previous").unwrap();
    std::os::unix::fs::symlink("real/chained", dir.join("link1")).unwrap();
    std::os::unix::fs::symlink("link1", dir.join("link2")).unwrap();
}

#[test]
fn hostile_output_paths() {
    let cases = cases();
    assert!(cases.len() >= 40, "{} cases", cases.len());
    run_table(&cases);
}

// ---------------------------------------------------------------------------------------------
// What the table cannot see: the files written, the temporary files removed.

fn conveyor_in(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_conveyor")).args(args).current_dir(dir).output().unwrap()
}

/// The step a checkpoint holds, after checking it parses with every tensor whole.
fn checkpoint_step(path: &Path) -> u64 {
    let bytes = std::fs::read(path).unwrap();
    let (_, metadata) = SafeTensors::read_metadata(&bytes).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    assert!(tensors.names().contains(&"0.weight"), "{}", path.display());
    let metadata = metadata.metadata().clone().unwrap();
    metadata["conveyor.train.step"].parse().unwrap()
}

#[test]
fn a_link_is_kept_and_its_target_holds_the_model() {
    let dir = train_cli_support::temp_dir("hostile-link-target");
    symlink_chain(&dir);
    let out = conveyor_in(&dir, train!["--checkpoint", "link2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::symlink_metadata(dir.join("link2")).unwrap().file_type().is_symlink());
    assert!(std::fs::symlink_metadata(dir.join("link1")).unwrap().file_type().is_symlink());
    assert_eq!(checkpoint_step(&dir.join("real/out")), 3);
    assert!(std::fs::symlink_metadata("/dev/null").unwrap().file_type().is_char_device());
}

#[test]
fn a_stale_temporary_file_of_a_killed_run_is_removed_by_the_next_run_writing_there() {
    let dir = train_cli_support::temp_dir("hostile-stale");
    let stale = dir.join(temporary("model.st", DEAD_PID));
    std::fs::write(&stale, "half a checkpoint").unwrap();
    set_age(&stale, Duration::from_secs(3600));
    let out = conveyor_in(&dir, train!["--save", "model.st", "--metrics", "m.jsonl"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(dir.entries(), ["m.jsonl", "model.st"], "the stale file is gone, no new one left");
}

#[test]
fn an_output_that_fails_at_the_end_does_not_stop_the_others() {
    let dir = train_cli_support::temp_dir("hostile-one-fails");
    let out = conveyor_in(&dir, train!["--metrics", "/dev/full", "--save", "model.st", "--svg", "chart.svg"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--metrics /dev/full"), "{stderr}");
    assert!(dir.join("chart.svg").exists(), "the chart after the failed metrics is written");
    assert!(std::fs::symlink_metadata("/dev/full").unwrap().file_type().is_char_device());
    let bytes = std::fs::read(dir.join("model.st")).unwrap();
    SafeTensors::deserialize(&bytes).unwrap();
}

#[test]
fn a_fifo_is_written_straight_through_to_its_reader() {
    let dir = train_cli_support::temp_dir("hostile-fifo");
    let fifo = dir.join("metrics.fifo");
    let c_path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read_to_string(fifo).unwrap())
    };
    let out = conveyor_in(&dir, train!["--metrics", "metrics.fifo"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> =
        reader.join().unwrap().lines().map(|line| serde_json::from_str(line).unwrap()).collect();
    assert_eq!(lines.len(), 4, "three steps and the summary");
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(), "still a FIFO");
}

#[test]
fn a_directory_without_write_permission_is_refused_before_step_1() {
    // Root writes anywhere: run conveyor as `nobody` then (with setpriv), or skip.
    let dir = train_cli_support::temp_dir("hostile-read-only");
    std::fs::create_dir(dir.join("ro")).unwrap();
    std::fs::write(dir.join("ro/ck.st"), "previous").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.join("ro"), std::fs::Permissions::from_mode(0o555)).unwrap();
    let args = train_args("synthetic:64,8,4", "1000000", "0", &["--checkpoint", "ro/ck.st"]);
    let root = unsafe { libc::geteuid() } == 0;
    let mut command = if root {
        let setpriv = Path::new("/usr/bin/setpriv");
        let binary = Path::new(env!("CARGO_BIN_EXE_conveyor"));
        let nobody_can_run = |path: &Path| {
            path.ancestors().skip(1).all(|a| {
                a.as_os_str().is_empty() || std::fs::metadata(a).is_ok_and(|m| m.permissions().mode() & 0o001 != 0)
            })
        };
        if !setpriv.exists() || !nobody_can_run(binary) || !nobody_can_run(&dir.join("ro/ck.st")) {
            eprintln!("skipped: running as root without a way to run conveyor as nobody");
            return;
        }
        let mut command = Command::new(setpriv);
        command.args(["--reuid=65534", "--regid=65534", "--clear-groups"]).arg(binary);
        command
    } else {
        Command::new(env!("CARGO_BIN_EXE_conveyor"))
    };
    let started = Instant::now();
    let out = command.args(&args).current_dir(&dir).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("cannot write --checkpoint ro/ck.st"), "{stderr}");
    assert!(stderr.contains("permission denied"), "{stderr}");
    assert!(stderr.contains("the previous checkpoint there is unchanged"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(20), "refused before training");
    assert_eq!(std::fs::read_to_string(dir.join("ro/ck.st")).unwrap(), "previous");
    std::fs::set_permissions(dir.join("ro"), std::fs::Permissions::from_mode(0o755)).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Streams: a closed or full stdout or stderr.

/// Where a stream goes.
#[derive(Clone, Copy, Debug)]
enum Sink {
    /// A pipe nobody reads: closed before the run writes anything.
    ClosedPipe,
    /// `/dev/full`: every write fails with ENOSPC.
    Full,
    /// A pipe the test reads.
    Captured,
}

fn stdio(sink: Sink) -> Stdio {
    match sink {
        Sink::Full => Stdio::from(std::fs::File::options().write(true).open("/dev/full").unwrap()),
        Sink::ClosedPipe | Sink::Captured => Stdio::piped(),
    }
}

/// Runs the three-step training with `--save model.st` and the streams as given (a checkpoint every
/// step, logged at `info`, so stderr has something to say); returns the exit status and stderr.
fn run_with_streams(dir: &Path, stdout: Sink, stderr: Sink) -> (Option<i32>, String) {
    let extra = ["--save", "model.st", "--checkpoint", "ck.st", "--checkpoint-every", "1"];
    let mut child = Command::new(env!("CARGO_BIN_EXE_conveyor"))
        .args(train_args("synthetic:64,8,4", "3", "1", &extra))
        .env("RUST_LOG", "info")
        .current_dir(dir)
        .stdout(stdio(stdout))
        .stderr(stdio(stderr))
        .spawn()
        .unwrap();
    // Closing our end of a pipe first: its writes then fail with EPIPE.
    if let Sink::ClosedPipe = stdout {
        drop(child.stdout.take());
    }
    if let Sink::ClosedPipe = stderr {
        drop(child.stderr.take());
    }
    let captured = child.stderr.take().map(|mut pipe| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut pipe, &mut text);
            text
        })
    });
    let captured_out = child.stdout.take().map(|mut pipe| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut pipe, &mut text);
            text
        })
    });
    let status = child.wait().unwrap();
    let stderr_text = captured.map(|t| t.join().unwrap()).unwrap_or_default();
    let _ = captured_out.map(|t| t.join().unwrap());
    (status.code(), stderr_text)
}

#[test]
fn closed_or_full_streams_never_stop_a_run_and_the_status_says_what_failed() {
    // (stdout, stderr, exit status, phrase on stderr): a broken pipe is quiet (the reader left, as
    // `| head -1` does); a full device lost output the user wanted: exit 1.
    let table = [
        (Sink::ClosedPipe, Sink::Captured, 0, ""),
        (Sink::Full, Sink::Captured, 1, "could not write to stdout"),
        (Sink::Captured, Sink::ClosedPipe, 0, ""),
        (Sink::Captured, Sink::Full, 1, ""),
        (Sink::ClosedPipe, Sink::ClosedPipe, 0, ""),
        (Sink::Full, Sink::Full, 1, ""),
    ];
    for (k, (stdout, stderr, exit, phrase)) in table.into_iter().enumerate() {
        let dir = train_cli_support::temp_dir(&format!("hostile-streams-{k}"));
        let (code, stderr_text) = run_with_streams(&dir, stdout, stderr);
        let case = format!("stdout {stdout:?}, stderr {stderr:?}");
        assert_eq!(code, Some(exit), "{case}: {stderr_text}");
        assert!(!stderr_text.contains("panicked"), "{case}: {stderr_text}");
        assert!(stderr_text.contains(phrase), "{case}: `{phrase}` not in {stderr_text}");
        let bytes = std::fs::read(dir.join("model.st")).unwrap_or_else(|e| panic!("{case}: no model saved: {e}"));
        SafeTensors::deserialize(&bytes).unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// Signals.

/// Starts a long run on `data` in `dir` writing every output, and waits for its first step line.
fn start_long_run(dir: &Path, data: &str, extra: &[&str]) -> (Child, std::thread::JoinHandle<String>) {
    let outputs =
        ["--save", "model.st", "--checkpoint", "ck.st", "--metrics", "m.jsonl", "--trace", "t.json", "--svg", "s.svg"];
    let mut child = Command::new(env!("CARGO_BIN_EXE_conveyor"))
        .args(train_args(data, "1000000", "1", &outputs))
        .args(extra)
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let started = Instant::now();
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        assert!(stdout.read_line(&mut line).unwrap() > 0, "the run ended before its first step: {seen}");
        seen.push_str(&line);
        if line.starts_with("step ") {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "no step line: {seen}");
    }
    let rest = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut text);
        seen + &text
    });
    (child, rest)
}

fn signal(child: &Child, signal: i32) {
    // SAFETY: kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, signal) };
    assert_eq!(rc, 0);
}

fn wait_with_limit(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("the run did not stop within {limit:?} of the signal");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Checks the outputs of a run stopped at a whole step: the model and checkpoint load at that
/// step, the metrics are whole lines ending in a summary that says so, the trace is valid JSON.
fn assert_outputs_whole_at_one_step(dir: &train_cli_support::TempDir, signal_name: &str) -> u64 {
    let step = checkpoint_step(&dir.join("ck.st"));
    assert!(step >= 1, "at least the first step (its line was printed)");
    let model = std::fs::read(dir.join("model.st")).unwrap();
    SafeTensors::deserialize(&model).unwrap();
    let metrics = std::fs::read_to_string(dir.join("m.jsonl")).unwrap();
    assert!(metrics.ends_with('\n'), "whole lines");
    let lines: Vec<serde_json::Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let summary = lines.last().unwrap();
    assert_eq!(summary["summary"], true);
    assert_eq!(summary["steps"], step);
    assert_eq!(summary["interrupted"], signal_name);
    assert_eq!(lines.len() as u64, step + 1, "one line per step and the summary");
    let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("t.json")).unwrap()).unwrap();
    assert!(trace["traceEvents"].as_array().unwrap().iter().any(|e| e["ph"] == "X"));
    assert!(std::fs::read_to_string(dir.join("s.svg")).unwrap().contains("</svg>"));
    assert_eq!(dir.entries(), ["ck.st", "m.jsonl", "model.st", "s.svg", "t.json"], "no temporary file left");
    step
}

#[test]
fn sigint_stops_between_steps_and_writes_every_output() {
    let dir = train_cli_support::temp_dir("hostile-sigint");
    let (mut child, stdout) = start_long_run(&dir, "synthetic:64,8,4", &[]);
    signal(&child, libc::SIGINT);
    let status = wait_with_limit(&mut child, Duration::from_secs(20));
    let stdout = stdout.join().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted by SIGINT at step"), "{stderr}");
    let step = assert_outputs_whole_at_one_step(&dir, "SIGINT");
    // Where everything is.
    for line in [
        format!("saved the parameters at step {step} to model.st"),
        format!("saved a training checkpoint at step {step} to ck.st"),
        "to m.jsonl".to_owned(),
        "to t.json".to_owned(),
        "to s.svg".to_owned(),
    ] {
        assert!(stdout.contains(&line), "`{line}` not in {stdout}");
    }
    // And the checkpoint resumes.
    let steps = (step + 1).to_string();
    let out = conveyor_in(&dir, &train_args("synthetic:64,8,4", &steps, "0", &["--resume", "ck.st"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn sigterm_stops_the_same_way_with_status_143() {
    let dir = train_cli_support::temp_dir("hostile-sigterm");
    let (mut child, stdout) = start_long_run(&dir, "synthetic:64,8,4", &[]);
    signal(&child, libc::SIGTERM);
    let status = wait_with_limit(&mut child, Duration::from_secs(20));
    let _ = stdout.join();
    assert_eq!(status.code(), Some(143));
    assert_outputs_whole_at_one_step(&dir, "SIGTERM");
}

#[test]
fn a_signal_during_evaluation_stops_it() {
    // Evaluating 18,000 held-out rows after every step: the signal most likely lands in one.
    let dir = train_cli_support::temp_dir("hostile-sigint-eval");
    let (mut child, stdout) =
        start_long_run(&dir, "synthetic:20000,8,4", &["--test-fraction", "0.9", "--eval-every", "1"]);
    signal(&child, libc::SIGINT);
    let status = wait_with_limit(&mut child, Duration::from_secs(20));
    let _ = stdout.join();
    assert_eq!(status.code(), Some(130));
    assert_outputs_whole_at_one_step(&dir, "SIGINT");
}

#[test]
fn a_second_signal_exits_at_once_and_leaves_every_file_whole() {
    let dir = train_cli_support::temp_dir("hostile-second-signal");
    checkpoint_at_step_2(&dir);
    let (mut child, stdout) = start_long_run(&dir, "synthetic:64,8,4", &[]);
    signal(&child, libc::SIGINT);
    signal(&child, libc::SIGINT);
    let status = wait_with_limit(&mut child, Duration::from_secs(20));
    let _ = stdout.join();
    assert_eq!(status.code(), Some(130));
    // Whatever the second signal cut short, the checkpoint is the previous one or a new whole one.
    checkpoint_step(&dir.join("ck.st"));
    for entry in dir.entries() {
        let path = dir.join(&entry);
        if entry.contains(".conveyor-tmp-") {
            continue; // a write cut short: removed by the next run once stale
        }
        match entry.as_str() {
            "model.st" => drop(SafeTensors::deserialize(&std::fs::read(&path).unwrap()).unwrap()),
            "m.jsonl" => assert!(std::fs::read_to_string(&path).unwrap().ends_with('\n')),
            "t.json" => {
                drop(serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(&path).unwrap()).unwrap())
            }
            _ => {}
        }
    }
}
