//! Hostile input, table-driven (issue 16): sizes and counts past `conveyor::limits` (labels of
//! 2^40, widths near `u64::MAX`, IDX headers that multiply past `usize`, epochs that would wrap
//! the step count, 100,000 devices or stages, a billion micro-batches), token ids and labels
//! outside the model found when the data is loaded, resumes that would change the training, and
//! messages that name the flag, the value and the fix. Every case runs `conveyor` on small inputs
//! and must end with its exit status and phrase, without a panic, within the harness's time limit,
//! leaving its input files unchanged.
mod cli_cases_support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use cli_cases_support::{Case, nothing, run_table};
use safetensors::tensor::{Dtype, TensorView};

/// A string that lives as long as the table (for arguments built at run time).
fn leak(text: String) -> &'static str {
    Box::leak(text.into_boxed_str())
}

/// A safetensors file from a raw JSON header and data, whatever shapes the header claims.
fn write_raw_safetensors(path: &Path, header: &str, data: &[u8]) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

/// A data file: `inputs` f32 `[N, features...]` and `labels` i64 `[N]`.
fn write_data(path: &Path, inputs: &[f32], feature_shape: &[usize], labels: &[i64]) {
    let mut shape = vec![labels.len()];
    shape.extend_from_slice(feature_shape);
    let input_bytes: Vec<u8> = inputs.iter().flat_map(|v| v.to_le_bytes()).collect();
    let label_bytes: Vec<u8> = labels.iter().flat_map(|v| v.to_le_bytes()).collect();
    let views = vec![
        ("inputs", TensorView::new(Dtype::F32, shape, &input_bytes).unwrap()),
        ("labels", TensorView::new(Dtype::I64, vec![labels.len()], &label_bytes).unwrap()),
    ];
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// 16 rows of 4 features in 2 classes, learnable.
fn small_data(dir: &Path) {
    let labels: Vec<i64> = (0..16).map(|row| row % 2).collect();
    let inputs: Vec<f32> = (0..16 * 4).map(|i| if (i / 4) % 2 == i % 2 { 1.0 } else { 0.1 * (i % 5) as f32 }).collect();
    write_data(&dir.join("data.safetensors"), &inputs, &[4], &labels);
}

fn label_2_pow_40(dir: &Path) {
    write_data(&dir.join("data.safetensors"), &[0.0; 8], &[2], &[0, 1, 0, 1 << 40]);
}

fn label_i64_max(dir: &Path) {
    write_data(&dir.join("data.safetensors"), &[0.0; 8], &[2], &[0, 1, i64::MAX, 1]);
}

fn labels_up_to_5(dir: &Path) {
    write_data(&dir.join("data.safetensors"), &[0.5; 12], &[2], &[0, 1, 5, 1, 0, 2]);
}

/// A sample shape with a zero and `u64::MAX`: no bytes, but a product that overflows.
fn shape_near_u64_max(dir: &Path) {
    let header = r#"{"inputs":{"dtype":"F32","shape":[1,0,18446744073709551615,2],"data_offsets":[0,0]},"labels":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}"#;
    write_raw_safetensors(&dir.join("data.safetensors"), header, &[0; 8]);
}

/// A header whose shape multiplies past `usize`.
fn shape_past_usize(dir: &Path) {
    let header = r#"{"inputs":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,16]},"labels":{"dtype":"I64","shape":[2],"data_offsets":[16,32]}}"#;
    write_raw_safetensors(&dir.join("data.safetensors"), header, &[0; 32]);
}

/// A header claiming more bytes than the file holds.
fn truncated_data_file(dir: &Path) {
    let header = r#"{"inputs":{"dtype":"F32","shape":[1000000,1000],"data_offsets":[0,4000000000]},"labels":{"dtype":"I64","shape":[1000000],"data_offsets":[4000000000,4008000000]}}"#;
    write_raw_safetensors(&dir.join("data.safetensors"), header, &[0; 64]);
}

/// An IDX header: type 0x08 (unsigned bytes), the dimensions, then `data`.
fn idx(dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut bytes = vec![0, 0, 8, dims.len() as u8];
    for d in dims {
        bytes.extend_from_slice(&d.to_be_bytes());
    }
    bytes.extend_from_slice(data);
    bytes
}

/// An MNIST directory with valid 2-image splits of 2x2 pixels, then `images` as the train images.
fn mnist_with_train_images(dir: &Path, images: &[u8]) {
    let mnist = dir.join("mnist");
    std::fs::create_dir_all(&mnist).unwrap();
    std::fs::write(mnist.join("train-images-idx3-ubyte"), images).unwrap();
    std::fs::write(mnist.join("train-labels-idx1-ubyte"), idx(&[2], &[3, 7])).unwrap();
    std::fs::write(mnist.join("t10k-images-idx3-ubyte"), idx(&[2, 2, 2], &[9; 8])).unwrap();
    std::fs::write(mnist.join("t10k-labels-idx1-ubyte"), idx(&[2], &[1, 2])).unwrap();
}

fn idx_dims_past_usize(dir: &Path) {
    mnist_with_train_images(dir, &idx(&[u32::MAX, u32::MAX, u32::MAX], &[1, 2, 3, 4]));
}

fn idx_claims_more_than_it_holds(dir: &Path) {
    mnist_with_train_images(dir, &idx(&[2, 60000, 60000], &[1, 2, 3, 4]));
}

fn idx_zero_pixels(dir: &Path) {
    mnist_with_train_images(dir, &idx(&[2, 0, 4000000], &[]));
}

/// Token ids `[4 rows, 3 tokens]` with `bad` at row 2, token 1.
fn tokens_with(dir: &Path, bad: f32) {
    let mut ids = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 0.0, 1.0, 2.0, 3.0, 4.0];
    ids[2 * 3 + 1] = bad;
    write_data(&dir.join("tokens.safetensors"), &ids, &[3], &[0, 1, 0, 1]);
}

fn token_past_vocab(dir: &Path) {
    tokens_with(dir, 40.0);
}

fn token_fractional(dir: &Path) {
    tokens_with(dir, 1.5);
}

fn token_negative(dir: &Path) {
    tokens_with(dir, -3.0);
}

fn placement_too_big(dir: &Path) {
    std::fs::write(dir.join("placement.txt"), "0 1\n".repeat(300_000)).unwrap();
}

fn placement_too_many_stages(dir: &Path) {
    std::fs::write(dir.join("placement.txt"), "0\n".repeat(1025)).unwrap();
}

fn placement_not_text(dir: &Path) {
    std::fs::write(dir.join("placement.txt"), [0xff, 0xfe, 0x00, 0x80, b'\n']).unwrap();
}

/// A transformer of vocabulary 32 over the 3-token rows of `tokens.safetensors`.
const TOKEN_RUN: &[&str] = &[
    "train",
    "--data",
    "tokens.safetensors",
    "--model",
    "transformer:32,3,8,2,1,2",
    "--batch",
    "2",
    "--microbatches",
    "1",
    "--steps",
    "1",
];

/// The run every resume case continues.
const RUN: [&str; 12] = [
    "train",
    "--model",
    "mlp:4,8,2",
    "--data",
    "data.safetensors",
    "--batch",
    "8",
    "--log-every",
    "0",
    "--optimizer",
    "momentum",
    "--no-shuffle",
];

/// [`small_data`] and a checkpoint of 2 steps of [`RUN`] at `ck.safetensors`.
fn checkpoint_of_run(dir: &Path) {
    small_data(dir);
    let out = Command::new(env!("CARGO_BIN_EXE_conveyor"))
        .args(RUN)
        .args(["--steps", "2", "--checkpoint", "ck.safetensors"])
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "the checkpoint run failed: {}", String::from_utf8_lossy(&out.stderr));
}

/// [`checkpoint_of_run`], and other data (the same shape, other values) at `other.safetensors`
/// and the same data under another name at `moved.safetensors`.
fn checkpoint_and_other_data(dir: &Path) {
    checkpoint_of_run(dir);
    std::fs::copy(dir.join("data.safetensors"), dir.join("moved.safetensors")).unwrap();
    let labels: Vec<i64> = (0..16).map(|row| (row / 2) % 2).collect();
    write_data(&dir.join("other.safetensors"), &[0.25; 64], &[4], &labels);
}

/// A checkpoint file whose run-state metadata is damaged (`lr` is not a number).
fn damaged_run_state(dir: &Path) {
    small_data(dir);
    let metadata: std::collections::HashMap<String, String> = [
        ("step", "2"),
        ("steps_per_epoch", "2"),
        ("seed", "0"),
        ("batch", "8"),
        ("shuffle", "false"),
        ("train_rows", "16"),
        ("model", "mlp:4,8,2"),
        ("data", "data.safetensors"),
        ("optimizer", "momentum"),
        ("lr", "zero point one"),
        ("lr_schedule", "cosine"),
        ("total_steps", "2"),
    ]
    .into_iter()
    .map(|(k, v)| (format!("conveyor.train.{k}"), v.to_string()))
    .collect();
    let bytes = [0u8; 4];
    let views = vec![("x", TensorView::new(Dtype::F32, vec![1], &bytes).unwrap())];
    std::fs::write(dir.join("ck.safetensors"), safetensors::serialize(views, Some(metadata)).unwrap()).unwrap();
}

/// `RUN` then `extra`, with `--steps 4 --resume ck.safetensors`.
fn resume(extra: &[&str]) -> &'static [&'static str] {
    let mut args: Vec<&'static str> = RUN.iter().map(|a| leak(a.to_string())).collect();
    args.extend(["--steps", "4", "--resume", "ck.safetensors"]);
    args.extend(extra.iter().map(|a| leak(a.to_string())));
    Box::leak(args.into_boxed_slice())
}

/// `resume(extra)` with `--data data.safetensors` replaced by `--data data`.
fn resume_with_data(data: &str, extra: &[&str]) -> &'static [&'static str] {
    let args: Vec<&'static str> =
        resume(extra).iter().map(|&a| if a == "data.safetensors" { leak(data.to_string()) } else { a }).collect();
    Box::leak(args.into_boxed_slice())
}

/// Shorthand for a case that must be refused with exit status 2.
fn refused(name: &'static str, args: &'static [&'static str], phrase: &'static str) -> Case {
    Case { name, args, setup: nothing, exit: 2, phrase, unchanged: &[] }
}

#[rustfmt::skip]
fn cases() -> Vec<Case> {
    let data_unchanged: &'static [&'static str] = &["data.safetensors"];
    let with_data = |name, setup: fn(&Path), args, phrase| Case { name, args, setup, exit: 2, phrase, unchanged: data_unchanged };
    let ck_unchanged: &'static [&'static str] = &["ck.safetensors", "data.safetensors"];
    let resume_case = |name, setup: fn(&Path), args, exit, phrase| Case { name, args, setup, exit, phrase, unchanged: ck_unchanged };
    let mnist_unchanged: &'static [&'static str] = &["mnist/train-images-idx3-ubyte", "mnist/train-labels-idx1-ubyte"];
    let token_unchanged: &'static [&'static str] = &["tokens.safetensors"];
    let placement_unchanged: &'static [&'static str] = &["placement.txt"];
    let device_list = leak((0..1025).map(|i| format!("cpu:{i}")).collect::<Vec<_>>().join(","));
    let deep_mlp = leak(format!("mlp:4{},2", ",8".repeat(1024)));
    vec![
        // Sizes and counts read from data files, refused before anything is allocated from them.
        with_data("train: a label of 2^40", label_2_pow_40, &["train", "--data", "data.safetensors", "--steps", "1"],
            "over the limit of 1048576 classes"),
        with_data("train: a label of i64::MAX", label_i64_max, &["train", "--data", "data.safetensors", "--steps", "1"],
            "row 2 has label 9223372036854775807, over the limit"),
        with_data("train: a sample shape near u64::MAX with a zero", shape_near_u64_max,
            &["train", "--data", "data.safetensors", "--steps", "1"], "has no features"),
        with_data("train: a data shape multiplying past usize", shape_past_usize,
            &["train", "--data", "data.safetensors", "--steps", "1"], "not a valid safetensors file"),
        with_data("train: a data header claiming 4 GB the file lacks", truncated_data_file,
            &["train", "--data", "data.safetensors", "--steps", "1"], "truncated or corrupt"),
        Case { name: "train: IDX dimensions multiplying past usize", args: &["train", "--data", "mnist", "--steps", "1"],
            setup: idx_dims_past_usize, exit: 2, phrase: "multiply past", unchanged: mnist_unchanged },
        Case { name: "train: IDX header claiming more pixels than the file holds", args: &["train", "--data", "mnist", "--steps", "1"],
            setup: idx_claims_more_than_it_holds, exit: 2, phrase: "need 7200000000 bytes of data", unchanged: mnist_unchanged },
        Case { name: "train: IDX images of zero pixels", args: &["train", "--data", "mnist", "--steps", "1"],
            setup: idx_zero_pixels, exit: 2, phrase: "nothing to train on", unchanged: mnist_unchanged },
        with_data("train: --classes near u64::MAX", small_data,
            &["train", "--data", "data.safetensors", "--classes", "18446744073709551615", "--steps", "1"],
            "--classes 18446744073709551615: give a class count from 1 to 1048576"),
        // Token ids and labels outside the model, found when the data is loaded.
        Case { name: "train: a token id past the vocabulary", args: TOKEN_RUN, setup: token_past_vocab, exit: 2,
            phrase: "row 2 token 1 is 40, not a token id in 0..32", unchanged: token_unchanged },
        Case { name: "train: a fractional token id", args: TOKEN_RUN, setup: token_fractional, exit: 2,
            phrase: "row 2 token 1 is 1.5, not a token id", unchanged: token_unchanged },
        Case { name: "train: a negative token id", args: TOKEN_RUN, setup: token_negative, exit: 2,
            phrase: "row 2 token 1 is -3, not a token id", unchanged: token_unchanged },
        with_data("train: labels past the model's outputs", labels_up_to_5,
            &["train", "--data", "data.safetensors", "--model", "mlp:2,3", "--steps", "1"],
            "row 2 has label 5 but --model mlp:2,3 has 3 outputs"),
        with_data("train: labels past --classes", labels_up_to_5,
            &["train", "--data", "data.safetensors", "--classes", "3", "--steps", "1"], "row 2 has label 5, outside 0..3"),
        // Sizes in model specs.
        refused("train: an MLP width of u64::MAX", &["train", "--model", "mlp:18446744073709551615,10", "--steps", "1"],
            "18446744073709551615 is over the limit of 1073741824 (MAX_WIDTH)"),
        refused("train: an MLP width past any integer",
            &["train", "--model", "mlp:8,999999999999999999999999999999999999999999,10"], "over the limit of 1073741824"),
        refused("train: an MLP layer over the parameter limit", &["train", "--model", "mlp:1073741824,1073741824"],
            "over the limit of 68719476736 parameters per layer"),
        refused("train: an MLP 1025 layers deep", Box::leak(vec!["train", "--model", deep_mlp].into_boxed_slice()),
            "1025 Linear layers are over the limit of 1024"),
        refused("train: a transformer of 100000 tokens", &["train", "--model", "transformer:32,100000,32,4,2,10"],
            "T: 100000 is over the limit of 65536 (MAX_TOKENS)"),
        refused("train: a transformer vocabulary table over the limit",
            &["train", "--model", "transformer:1073741824,16,1073741824,4,2,10"], "embed has 1152921504606846976 parameters"),
        // Generated data.
        refused("train: synthetic rows near u64::MAX", &["train", "--data", "synthetic:18446744073709551615,4,2"],
            "18446744073709551615 is over the limit of 268435456 (MAX_GENERATED_VALUES)"),
        refused("train: synthetic rows x features over the limit", &["train", "--data", "synthetic:100000,100000,2"],
            "N x D = 100000 x 100000 values is over the limit"),
        refused("train: synthetic classes over the limit", &["train", "--data", "synthetic:10,4,2000000"],
            "C 2000000 is over the limit of 1048576 classes"),
        refused("train: token sequences over the limit", &["train", "--data", "tokens:100000,100000,32,4"],
            "N x T = 100000 x 100000 values is over the limit"),
        Case { name: "train: a seed of u64::MAX trains", setup: nothing, exit: 0, phrase: "trained 1 steps", unchanged: &[],
            args: &["train", "--data", "synthetic:32,4,2", "--seed", "18446744073709551615", "--steps", "1", "--batch", "8", "--log-every", "0"] },
        // Counts that would wrap or loop.
        refused("train: epochs that wrap the step count", &["train", "--data", "synthetic:100,4,2", "--epochs", "4611686018427387905"],
            "--epochs 4611686018427387905 of 3 steps (training rows / --batch) is over the limit of 1099511627776 optimizer steps"),
        refused("train: --steps u64::MAX", &["train", "--data", "synthetic:100,4,2", "--steps", "18446744073709551615"],
            "--steps 18446744073709551615 is over the limit"),
        refused("train: 100000 CPU devices", &["train", "--devices", "cpu:100000"], "100000 is over the limit of 1024 (MAX_DEVICES)"),
        refused("train: a list of 1025 devices", Box::leak(vec!["train", "--devices", device_list].into_boxed_slice()),
            "1025 devices are over the limit of 1024 devices"),
        refused("train: --stages x --tensor-parallel overflowing", &["train", "--stages", "9223372036854775809", "--tensor-parallel", "2"],
            "needs more than 1024 devices"),
        refused("train: --tensor-parallel near u64::MAX", &["train", "--stages", "2", "--tensor-parallel", "18446744073709551615"],
            "--tensor-parallel 18446744073709551615 is over the limit of 1024 devices"),
        refused("train: 100000 chunks", &["train", "--schedule", "interleaved", "--chunks", "100000"],
            "--chunks 100000 on 2 pipeline devices makes more than 1024 stages"),
        refused("train: --device-memory past 2^64 bytes", &["train", "--device-memory", "99999999999999999999GiB"],
            "over the largest size"),
        refused("train: --device-memory under a byte", &["train", "--device-memory", "0.5"], "at least one byte"),
        // Messages that name the flag, the value and the fix.
        refused("train: --checkpoint-every without --checkpoint", &["train", "--checkpoint-every", "5", "--save", "out.safetensors"],
            "--checkpoint-every needs --checkpoint FILE"),
        refused("train: --stages 0", &["train", "--stages", "0"], "--stages 0: a pipeline needs at least 1 stage"),
        refused("train: more stages than devices", &["train", "--stages", "3"],
            "--stages 3 with --tensor-parallel 1 needs 3 devices but --devices cpu:2 gives 2"),
        refused("train: --batch 0", &["train", "--batch", "0"], "--batch 0 --microbatches 8"),
        refused("train: --lr -1", &["train", "--lr", "-1"], "--lr: Invalid learning rate: -1"),
        refused("train: --weight-decay NaN", &["train", "--weight-decay", "NaN"], "--weight-decay: Invalid weight_decay value: NaN"),
        refused("train: --momentum with adam", &["train", "--momentum", "0.5"], "--momentum 0.5 applies only to --optimizer momentum"),
        refused("train: --lr-schedule step:0", &["train", "--lr-schedule", "step:0,0.5"], "--lr-schedule `step:0,0.5`"),
        refused("train: --on-nonfinite skip:0", &["train", "--on-nonfinite", "skip:0"], "--on-nonfinite `skip:0`"),
        refused("train: an unknown model", &["train", "--model", "mlp"], "--model: invalid model spec `mlp`"),
        Case { name: "train: a placement file over 1 MiB", args: &["train", "--placement", "placement.txt"], setup: placement_too_big,
            exit: 2, phrase: "over the limit of 1048576 bytes", unchanged: placement_unchanged },
        Case { name: "train: a placement file of 1025 stages", args: &["train", "--placement", "placement.txt"],
            setup: placement_too_many_stages, exit: 2, phrase: "1025 stages are over the limit of 1024", unchanged: placement_unchanged },
        Case { name: "train: a placement file that is not text", args: &["train", "--placement", "placement.txt"],
            setup: placement_not_text, exit: 2, phrase: "not UTF-8 text", unchanged: placement_unchanged },
        // Resuming: what changes the training is refused with the list of differences.
        resume_case("resume: other data", checkpoint_and_other_data, resume_with_data("other.safetensors", &[]), 2,
            "--data (the training rows' contents): checkpoint data.safetensors"),
        resume_case("resume: the same data moved", checkpoint_and_other_data, resume_with_data("moved.safetensors", &[]), 0,
            "resumed from ck.safetensors at step 2"),
        resume_case("resume: another learning rate", checkpoint_of_run, resume(&["--lr", "0.1"]), 2,
            "--lr: checkpoint 0.05, this run 0.1"),
        resume_case("resume: another momentum", checkpoint_of_run, resume(&["--momentum", "0.5"]), 2,
            "--momentum: checkpoint 0.9, this run 0.5"),
        resume_case("resume: another weight decay", checkpoint_of_run, resume(&["--weight-decay", "0.01"]), 2,
            "--weight-decay: checkpoint 0, this run 0.01"),
        resume_case("resume: another lr schedule", checkpoint_of_run, resume(&["--lr-schedule", "constant"]), 2,
            "--lr-schedule: checkpoint cosine, this run constant"),
        resume_case("resume: other micro-batches", checkpoint_of_run, resume(&["--microbatches", "4"]), 2,
            "--microbatches: checkpoint 8, this run 4"),
        resume_case("resume: two differences listed", checkpoint_of_run, resume(&["--lr", "0.1", "--seed", "3"]), 2,
            "--seed: checkpoint 0, this run 3; --lr: checkpoint 0.05, this run 0.1"),
        resume_case("resume: another layout may continue", checkpoint_of_run,
            resume(&["--schedule", "gpipe", "--devices", "cpu:1", "--eval-every", "1"]), 0, "resumed from ck.safetensors at step 2"),
        resume_case("resume: damaged run state", damaged_run_state, resume(&[]), 2,
            "metadata `conveyor.train.lr` = `zero point one` is not a finite number"),
        // plan.
        refused("plan: 100000 CPU devices", &["plan", "--model", "mlp:4,8,2", "--devices", "cpu:100000"], "over the limit of 1024"),
        refused("plan: an MLP width of u64::MAX", &["plan", "--model", "mlp:18446744073709551615,10", "--devices", "cpu:1"],
            "over the limit of 1073741824 (MAX_WIDTH)"),
        refused("plan: a batch near u64::MAX", &["plan", "--model", "mlp:4,8,2", "--devices", "cpu:2", "--batch", "18446744073709551615"],
            "--batch 18446744073709551615 is over the limit of 16777216 rows"),
        refused("plan: chunks overflowing the stages", &["plan", "--model", "mlp:4,8,2", "--devices", "cpu:2", "--schedule", "interleaved",
            "--chunks", "9223372036854775809"], "makes more than 1024 stages"),
        refused("plan: --chunks 0", &["plan", "--model", "mlp:4,8,2", "--devices", "cpu:2", "--chunks", "0"], "--chunks 0: each device needs"),
        refused("plan: a transformer head over the class limit", &["plan", "--model", "transformer:32,16,32,4,2,2000000", "--devices", "cpu:2"],
            "C: 2000000 is over the limit of 1048576 (MAX_CLASSES)"),
        Case { name: "plan: a placement file of 1025 stages", args: &["plan", "--model", "mlp:4,8,2", "--devices", "cpu:2", "--placement", "placement.txt"],
            setup: placement_too_many_stages, exit: 2, phrase: "over the limit of 1024 stages (MAX_STAGES)", unchanged: placement_unchanged },
        Case { name: "plan: a model that fits still plans", args: &["plan", "--model", "mlp:1024,4096,4096,4096,4096,1024", "--devices", "cpu:4"],
            setup: nothing, exit: 0, phrase: "predicted bubble fraction", unchanged: &[] },
        // simulate.
        refused("simulate: 100000 stages", &["simulate", "--schedule", "1f1b", "--stages", "100000", "--microbatches", "4"],
            "--stages 100000 with 1 chunk(s) per device is over the limit of 1024 stages"),
        refused("simulate: a billion micro-batches", &["simulate", "--schedule", "gpipe", "--stages", "4", "--microbatches", "1000000000"],
            "--microbatches 1000000000 is over the limit of 65536"),
        refused("simulate: stages x micro-batches over the limit", &["simulate", "--schedule", "zb-h2", "--stages", "1024", "--microbatches", "1024"],
            "1048576 (micro-batch, stage) pairs is over the limit of 262144"),
        refused("simulate: chunks overflowing the stages", &["simulate", "--schedule", "interleaved", "--stages", "4", "--microbatches", "8",
            "--chunks", "4611686018427387905"], "over the limit of 1024 stages"),
        refused("simulate: --stages 0", &["simulate", "--schedule", "1f1b", "--stages", "0", "--microbatches", "4"], "--stages is 0: a pipeline needs at least one device"),
        refused("simulate: costs whose sum is infinite", &["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2",
            "--costs", "1e308,1e308,1e308"], "the step's time overflows"),
        Case { name: "simulate: the largest allowed size answers", setup: nothing, exit: 0, phrase: "bubble fraction", unchanged: &[],
            args: &["simulate", "--schedule", "1f1b", "--stages", "1024", "--microbatches", "8"] },
        refused("train: --data a device read without end", &["train", "--data", "/dev/zero", "--steps", "1"], "not a regular file"),
        Case { name: "simulate: --svg and --trace on one file", setup: nothing, exit: 2, phrase: "name the same file",
            unchanged: &["x.out"],
            args: &["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--svg", "{dir}/x.out",
                "--trace", "{dir}/./x.out"] },
    ]
}

#[test]
fn hostile_inputs_are_refused_or_handled() {
    let cases = cases();
    assert!(cases.len() >= 45, "{} cases", cases.len());
    run_table(&cases);
}

/// The commands that used to hang (or allocate until killed) answer within seconds: a limit
/// refuses them, or a method that scales computes them.
#[test]
fn former_hangs_answer_quickly() {
    let quick = |args: &[&str], envs: &[(&str, &str)]| {
        let started = Instant::now();
        let out = Command::new(env!("CARGO_BIN_EXE_conveyor")).args(args).envs(envs.iter().copied()).output().unwrap();
        let elapsed = started.elapsed();
        assert!(elapsed < Duration::from_secs(5), "{args:?} took {elapsed:?}");
        out
    };
    quick(&["train", "--devices", "cpu:100000"], &[]);
    quick(&["simulate", "--schedule", "1f1b", "--stages", "100000", "--microbatches", "8"], &[]);
    quick(&["simulate", "--schedule", "gpipe", "--stages", "4", "--microbatches", "1000000000"], &[]);
    // A terminal "wider" than any: the chart is clamped to 1000 columns.
    let out = quick(
        &["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--show"],
        &[("COLUMNS", "99999999999")],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let rows: Vec<usize> =
        stdout.lines().filter(|l| l.starts_with("dev") && l.contains('|')).map(|l| l.chars().count()).collect();
    assert!(rows.iter().all(|&width| width <= 1000), "a line is wider than 1000 columns: {rows:?}");
    assert_eq!(rows.iter().filter(|&&width| width == 1000).count(), 4, "the chart is 1000 columns wide: {rows:?}");
}
