//! Fuzzing of every reader of outside input, a fixed number of seeded iterations each, so CI runs
//! the same inputs every time: safetensors data files, MNIST IDX files, the digits CSV, placement
//! files, a checkpoint's run-state metadata, and the command line's values (sizes, device lists,
//! model specs, learning-rate schedules, the non-finite policy, generated-data sizes).
//!
//! Each iteration takes a valid input, mutates it (flipped, inserted and deleted bytes,
//! truncation, header numbers replaced by extremes such as `u64::MAX`, 2^32 or 0, dropped keys)
//! and calls the reader under `catch_unwind`: it must return `Ok` or `Err`, never panic, and
//! answer within a second. Inputs are small (a size cap of 64 KiB), and a global allocator refuses
//! any single allocation over 1 GiB, so a reader that trusts a size from its input fails here
//! instead of exhausting the machine. Crashes found are kept in `tests/fixtures/fuzz_regressions/`
//! (the file name's prefix names the reader) and replayed by [`regressions_replay_without_panics`].
use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use conveyor::cli_input::{LrSchedule, OnNonFinite, RunState, parse_devices, parse_placement, parse_size};
use conveyor::data;
use conveyor::zoo::ModelSpec;
use safetensors::tensor::{Dtype, TensorView};

/// The largest single allocation a reader may ask for.
const ALLOCATION_CAP: usize = 1 << 30;
/// The largest mutated input.
const INPUT_CAP: usize = 64 << 10;
/// The slowest a single call may be.
const CALL_LIMIT: Duration = Duration::from_secs(1);

/// The system allocator, refusing (so the process aborts, naming the size) any single request over
/// [`ALLOCATION_CAP`], and recording the largest request seen.
struct CappedAllocator;

static LARGEST_REQUEST: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for CappedAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST_REQUEST.fetch_max(layout.size(), Ordering::Relaxed);
        if layout.size() > ALLOCATION_CAP {
            return std::ptr::null_mut();
        }
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST_REQUEST.fetch_max(new_size, Ordering::Relaxed);
        if new_size > ALLOCATION_CAP {
            return std::ptr::null_mut();
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: CappedAllocator = CappedAllocator;

/// SplitMix64: a seeded generator, so every run mutates the same way.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// A number a reader might not expect: 0, 1, powers of two near the integer widths,
    /// `u64::MAX`, past it, negative, fractional, or random.
    fn extreme_number(&mut self) -> String {
        let fixed = [
            "0",
            "1",
            "2",
            "255",
            "65536",
            "2147483647",
            "2147483648",
            "4294967295",
            "4294967296",
            "1099511627776",
            "9223372036854775807",
            "9223372036854775808",
            "18446744073709551615",
            "18446744073709551616",
            "340282366920938463463374607431768211456",
            "-1",
            "-9223372036854775808",
            "1.5",
            "1e308",
            "NaN",
            "inf",
            "",
        ];
        match self.below(3) {
            0 => self.pick(&fixed).to_string(),
            1 => (self.next() >> self.below(64)).to_string(),
            _ => self.below(100).to_string(),
        }
    }
}

/// Byte-level mutations: flip, insert, delete, truncate, duplicate a range, or overwrite a
/// little-endian or big-endian integer with an extreme.
fn mutate_bytes(rng: &mut Rng, input: &[u8]) -> Vec<u8> {
    let mut bytes = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(bytes.len() + 1);
        match rng.below(7) {
            0 if at < bytes.len() => bytes[at] ^= 1 << rng.below(8),
            1 => bytes.insert(at, rng.next() as u8),
            2 if at < bytes.len() => {
                bytes.remove(at);
            }
            3 => bytes.truncate(at),
            4 if at < bytes.len() => {
                let end = (at + rng.below(64)).min(bytes.len());
                let copy = bytes[at..end].to_vec();
                bytes.splice(at..at, copy);
            }
            5 if at + 4 <= bytes.len() => {
                let value = *rng.pick(&[0u32, 1, 255, 0x7fff_ffff, 0x8000_0000, u32::MAX]);
                let encoded = if rng.below(2) == 0 { value.to_be_bytes() } else { value.to_le_bytes() };
                bytes[at..at + 4].copy_from_slice(&encoded);
            }
            6 if at + 8 <= bytes.len() => {
                let value = *rng.pick(&[0u64, 1, 1 << 32, 1 << 40, i64::MAX as u64, u64::MAX]);
                bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
            }
            _ => {}
        }
    }
    bytes.truncate(INPUT_CAP);
    bytes
}

/// Replaces one run of digits in `text` with an extreme number.
fn mutate_a_number(rng: &mut Rng, text: &str) -> String {
    let runs: Vec<(usize, usize)> = {
        let bytes = text.as_bytes();
        let mut runs = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i].is_ascii_digit() {
                let start = i;
                while i < bytes.len() && bytes[i].is_ascii_digit() {
                    i += 1;
                }
                runs.push((start, i));
            } else {
                i += 1;
            }
        }
        runs
    };
    if runs.is_empty() {
        return text.to_string();
    }
    let (start, end) = *rng.pick(&runs);
    format!("{}{}{}", &text[..start], rng.extreme_number(), &text[end..])
}

/// A safetensors file whose JSON header had numbers replaced (shapes, offsets), its length prefix
/// fixed up to the new header, or left as it was.
fn mutate_safetensors_header(rng: &mut Rng, file: &[u8]) -> Vec<u8> {
    let header_len = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&file[8..8 + header_len]).unwrap();
    let mut mutated = header.to_string();
    for _ in 0..1 + rng.below(3) {
        mutated = mutate_a_number(rng, &mutated);
    }
    let prefix = if rng.below(4) == 0 { header_len as u64 } else { mutated.len() as u64 };
    let mut bytes = prefix.to_le_bytes().to_vec();
    bytes.extend_from_slice(mutated.as_bytes());
    bytes.extend_from_slice(&file[8 + header_len..]);
    bytes.truncate(INPUT_CAP);
    bytes
}

/// Calls `body` on `iterations` inputs from `make_input` in a worker thread, each under
/// `catch_unwind` and timed; fails naming the inputs that panicked or were slow. Returns how many
/// calls returned `Ok`.
fn fuzz<I: std::fmt::Debug + Send + 'static>(
    reader: &str,
    iterations: usize,
    seed: u64,
    make_input: impl Fn(&mut Rng) -> I + Send + 'static,
    body: impl Fn(&I) -> bool + Send + 'static,
) -> usize {
    let (sender, receiver) = std::sync::mpsc::channel();
    let reader_name = reader.to_string();
    std::thread::spawn(move || {
        let mut rng = Rng(seed);
        let mut failures = Vec::new();
        let mut accepted = 0;
        for iteration in 0..iterations {
            let input = make_input(&mut rng);
            let started = Instant::now();
            match catch_unwind(AssertUnwindSafe(|| body(&input))) {
                Ok(ok) => accepted += usize::from(ok),
                Err(_) => failures.push(format!("iteration {iteration} panicked on {input:?}")),
            }
            let elapsed = started.elapsed();
            if elapsed > CALL_LIMIT {
                failures.push(format!("iteration {iteration} took {elapsed:?} on {input:?}"));
            }
            if failures.len() >= 5 {
                break;
            }
        }
        let _ = sender.send((failures, accepted));
    });
    let (failures, accepted) = receiver
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("{reader_name}: the fuzz loop hung for more than 60 s"));
    assert!(failures.is_empty(), "{reader}:\n{}", failures.join("\n"));
    assert!(LARGEST_REQUEST.load(Ordering::Relaxed) <= ALLOCATION_CAP);
    accepted
}

/// A data file: `inputs` f32 `[N, features...]` and `labels` (i64 or i32) `[N]`.
fn data_file(inputs: &[f32], feature_shape: &[usize], labels: &[i64], wide_labels: bool) -> Vec<u8> {
    let mut shape = vec![labels.len()];
    shape.extend_from_slice(feature_shape);
    let input_bytes: Vec<u8> = inputs.iter().flat_map(|v| v.to_le_bytes()).collect();
    let (dtype, label_bytes): (Dtype, Vec<u8>) = if wide_labels {
        (Dtype::I64, labels.iter().flat_map(|v| v.to_le_bytes()).collect())
    } else {
        (Dtype::I32, labels.iter().flat_map(|&v| (v as i32).to_le_bytes()).collect())
    };
    let views = vec![
        ("inputs", TensorView::new(Dtype::F32, shape, &input_bytes).unwrap()),
        ("labels", TensorView::new(dtype, vec![labels.len()], &label_bytes).unwrap()),
    ];
    safetensors::serialize(views, None).unwrap()
}

/// The reader behind a data file: the file with no class count, a class count, and (when it
/// loads) the token-id check against a small vocabulary.
fn read_data_file(bytes: &[u8], classes: Option<usize>) -> bool {
    match data::from_safetensors_bytes(bytes, "fuzz.safetensors", classes) {
        Ok(dataset) => {
            let _ = dataset.check_token_ids(16, "fuzz.safetensors");
            true
        }
        Err(_) => false,
    }
}

#[test]
fn safetensors_data_files() {
    let seeds = [
        data_file(&[0.5, 1.0, -2.0, 3.0, 0.0, 1.0], &[3], &[0, 1], true),
        data_file(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], &[1, 2, 2], &[1, 0], false),
        data_file(&[3.0, 1.0, 4.0, 1.0, 5.0, 9.0], &[2], &[2, 0, 1], true),
    ];
    let seeds_for_bytes = seeds.clone();
    let accepted = fuzz(
        "safetensors data file (bytes)",
        40_000,
        1,
        move |rng| {
            let seed = rng_pick_owned(rng, &seeds_for_bytes);
            mutate_bytes(rng, seed)
        },
        |bytes| read_data_file(bytes, None),
    );
    eprintln!("safetensors bytes: {accepted} of 40000 mutated files loaded");
    let accepted = fuzz(
        "safetensors data file (header numbers)",
        40_000,
        2,
        move |rng| {
            let seed = rng_pick_owned(rng, &seeds);
            let classes = [None, Some(0), Some(1), Some(3), Some(usize::MAX)][rng.below(5)];
            (mutate_safetensors_header(rng, seed), classes)
        },
        |(bytes, classes)| read_data_file(bytes, *classes),
    );
    eprintln!("safetensors headers: {accepted} of 40000 mutated files loaded");
}

fn rng_pick_owned<'a>(rng: &mut Rng, items: &'a [Vec<u8>]) -> &'a [u8] {
    &items[rng.below(items.len())]
}

/// An IDX file of unsigned bytes with these dimensions and data.
fn idx(dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut bytes = vec![0, 0, 8, dims.len() as u8];
    for d in dims {
        bytes.extend_from_slice(&d.to_be_bytes());
    }
    bytes.extend_from_slice(data);
    bytes
}

#[test]
fn idx_files() {
    let images = idx(&[3, 2, 2], &[0, 50, 100, 150, 200, 250, 1, 2, 3, 4, 5, 6]);
    let labels = idx(&[3], &[7, 0, 9]);
    let accepted = fuzz(
        "IDX images and labels",
        50_000,
        3,
        move |rng| {
            let (mut images, mut labels) = (images.clone(), labels.clone());
            match rng.below(3) {
                0 => images = mutate_bytes(rng, &images),
                1 => labels = mutate_bytes(rng, &labels),
                _ => {
                    // A header of random dimensions over the same data.
                    let n_dims = rng.below(5);
                    let dims: Vec<u32> =
                        (0..n_dims).map(|_| *rng.pick(&[0, 1, 2, 3, 255, 60000, 0x7fff_ffff, u32::MAX])).collect();
                    images = idx(&dims, &images[16..]);
                }
            }
            (images, labels)
        },
        |(images, labels)| data::idx_split(images, labels, "images", "labels").is_ok(),
    );
    eprintln!("IDX: {accepted} of 50000 mutated pairs loaded");
}

#[test]
fn digits_csv() {
    let line = |label: u8| {
        let pixels: Vec<String> = (0..64).map(|i| ((i * 7 + label as usize) % 17).to_string()).collect();
        format!("{},{label}", pixels.join(","))
    };
    let valid = (0..4).map(line).collect::<Vec<_>>().join("\n");
    assert!(data::digits_from_csv(&valid).is_ok(), "the seed loads");
    let accepted = fuzz(
        "digits CSV",
        20_000,
        4,
        move |rng| {
            let mut text = valid.clone();
            for _ in 0..1 + rng.below(3) {
                text = match rng.below(3) {
                    0 => mutate_a_number(rng, &text),
                    1 => String::from_utf8_lossy(&mutate_bytes(rng, text.as_bytes())).into_owned(),
                    _ => {
                        let &separator = rng.pick(&["", ",,", ";", ",-,"]);
                        text.replacen(',', separator, 1 + rng.below(3))
                    }
                };
            }
            text
        },
        |text| data::digits_from_csv(text).is_ok(),
    );
    eprintln!("digits CSV: {accepted} of 20000 mutated files loaded");
}

#[test]
fn placement_files() {
    let valid = "# two stages\n0..2  3\n\n4 # the head\nconv1 relu1\n";
    let accepted = fuzz(
        "placement file",
        30_000,
        5,
        move |rng| {
            let mut bytes = mutate_bytes(rng, valid.as_bytes());
            if rng.below(10) == 0 {
                // Many lines: past the stage limit.
                bytes = b"a\n".repeat(rng.below(3000));
            }
            String::from_utf8_lossy(&bytes).into_owned()
        },
        |text| parse_placement(text, "placement.txt").is_ok(),
    );
    eprintln!("placement: {accepted} of 30000 mutated files parsed");
}

#[test]
fn checkpoint_run_state_metadata() {
    let valid: BTreeMap<String, String> = [
        ("step", "3"),
        ("epoch", "1"),
        ("batch_in_epoch", "1"),
        ("steps_per_epoch", "2"),
        ("seed", "0"),
        ("batch", "8"),
        ("shuffle", "true"),
        ("train_rows", "16"),
        ("model", "mlp:4,8,2"),
        ("data", "synthetic:16,4,2"),
        ("optimizer", "momentum"),
        ("lr", "0.05"),
        ("lr_schedule", "cosine"),
        ("total_steps", "6"),
        ("microbatches", "4"),
        ("momentum", "0.9"),
        ("weight_decay", "0"),
        ("data_fingerprint", "fnv1a64:0123456789abcdef"),
    ]
    .into_iter()
    .map(|(key, value)| (format!("conveyor.train.{key}"), value.to_string()))
    .collect();
    let reference = RunState::from_metadata(&valid, "ck").expect("the seed parses");
    let accepted = fuzz(
        "checkpoint run state",
        50_000,
        6,
        move |rng| {
            let mut metadata = valid.clone();
            let keys: Vec<String> = metadata.keys().cloned().collect();
            for _ in 0..1 + rng.below(3) {
                let key = rng.pick(&keys).clone();
                match rng.below(4) {
                    0 => {
                        metadata.remove(&key);
                    }
                    1 => {
                        metadata.insert(key, rng.extreme_number());
                    }
                    2 => {
                        let value = metadata.get(&key).cloned().unwrap_or_default();
                        let bytes = mutate_bytes(rng, value.as_bytes());
                        metadata.insert(key, String::from_utf8_lossy(&bytes).into_owned());
                    }
                    _ => {
                        metadata.insert(key, "x".repeat(rng.below(10000)));
                    }
                }
            }
            metadata
        },
        move |metadata| match RunState::from_metadata(metadata, "ck") {
            Ok(state) => {
                let _ = state.differences(&reference);
                let _ = state.to_metadata();
                true
            }
            Err(_) => false,
        },
    );
    eprintln!("run state: {accepted} of 50000 mutated maps parsed");
}

/// A command-line value: pieces of the valid forms joined with extreme numbers and separators.
fn value_text(rng: &mut Rng, forms: &[&str]) -> String {
    let mut text = rng.pick(forms).to_string();
    for _ in 0..rng.below(4) {
        text = match rng.below(4) {
            0 => mutate_a_number(rng, &text),
            1 => format!("{text}{}{}", rng.pick(&[",", ":", ".", " ", ",,", ""]), rng.extreme_number()),
            2 => String::from_utf8_lossy(&mutate_bytes(rng, text.as_bytes())).into_owned(),
            _ => text.replacen(',', "", 1),
        };
    }
    text
}

/// A parsed model spec is built when it is small, so the sizes it accepted are checked too.
fn parse_and_maybe_build(text: &str) -> bool {
    let Ok(spec) = text.parse::<ModelSpec>() else { return false };
    let parameters = match &spec {
        ModelSpec::Mlp(dims) => dims.windows(2).map(|w| w[0].saturating_mul(w[1])).fold(0usize, usize::saturating_add),
        ModelSpec::Transformer(c) => c
            .vocab
            .saturating_add(c.tokens)
            .saturating_add(c.classes)
            .saturating_mul(c.dim)
            .saturating_add(c.n_layers.saturating_mul(12).saturating_mul(c.dim).saturating_mul(c.dim)),
        _ => 0,
    };
    if parameters <= 20_000 {
        let _ = spec.build(0);
        let _ = spec.input_shape();
    }
    true
}

#[test]
fn command_line_values() {
    let mut accepted = 0;
    accepted += fuzz(
        "--device-memory",
        20_000,
        7,
        |rng| value_text(rng, &["512MiB", "2GiB", "1000000", "64KiB", "1.5GB", "3 k", "0.5b"]),
        |text| parse_size(text).is_ok(),
    );
    accepted += fuzz(
        "--devices",
        20_000,
        8,
        |rng| value_text(rng, &["cpu:4", "cpu:0,cpu:1", "cuda:0,1", "cpu:0,cuda:0", "cpu:1024", "list"]),
        |text| parse_devices(text, Some(1 << 20)).is_ok(),
    );
    accepted += fuzz(
        "--model",
        20_000,
        9,
        |rng| {
            value_text(
                rng,
                &["mlp:64,128,10", "mlp:4,2", "transformer:32,16,32,4,2,10", "cnn", "resnet", "transformer"],
            )
        },
        |text| parse_and_maybe_build(text),
    );
    accepted += fuzz(
        "--lr-schedule",
        20_000,
        10,
        |rng| value_text(rng, &["constant", "cosine", "step:100,0.5", "step:1,2"]),
        |text| match text.parse::<LrSchedule>() {
            Ok(schedule) => {
                for step in [0, 1, 1 << 31, 1 << 40, u64::MAX] {
                    let lr = schedule.lr(0.1, step, 1 << 40);
                    assert!(!lr.is_nan(), "{schedule}: lr at step {step} is NaN");
                }
                let _ = schedule.to_string().parse::<LrSchedule>().expect("Display parses back");
                true
            }
            Err(_) => false,
        },
    );
    accepted += fuzz(
        "--on-nonfinite",
        10_000,
        11,
        |rng| value_text(rng, &["error", "skip", "skip:5"]),
        |text| text.parse::<OnNonFinite>().is_ok(),
    );
    // Generated data: sizes past the limits are refused before anything is allocated; small
    // ones are generated (sizes in between would allocate what they ask for and are skipped).
    accepted += fuzz(
        "synthetic:N,D,C and tokens:N,T,VOCAB,C",
        20_000,
        12,
        |rng| {
            let mut number = || -> usize { rng.extreme_number().parse().unwrap_or(3) };
            (number(), number(), number(), number())
        },
        |&(a, b, c, d)| {
            let small = a.saturating_mul(b) <= 4096 && c <= 4096 && b.saturating_mul(c) <= 4096;
            let huge = a.checked_mul(b).is_none_or(|n| n > conveyor::limits::MAX_GENERATED_VALUES);
            if small || huge {
                let synthetic = data::synthetic(a, b, c, d as u64);
                let tokens = data::synthetic_tokens(a, b, c.max(2), d.min(c.max(2)), a as u64);
                assert!(small || (synthetic.is_err() && tokens.is_err()), "{a} x {b} values were not refused");
                synthetic.is_ok()
            } else {
                false
            }
        },
    );
    eprintln!("command-line values: {accepted} mutated values accepted");
}

/// Every file of `tests/fixtures/fuzz_regressions/` through the reader its name's prefix names:
/// each returns `Ok` or `Err` without a panic.
#[test]
fn regressions_replay_without_panics() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fuzz_regressions");
    let mut replayed = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if name == "README.md" {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let first_line = text.lines().next().unwrap_or_default().to_string();
        let outcome = catch_unwind(AssertUnwindSafe(|| match name.split('-').next().unwrap() {
            "safetensors" => {
                let _ = read_data_file(&bytes, None);
            }
            "idx" => {
                // The images file; the labels are three valid digits.
                let _ = data::idx_split(&bytes, &idx(&[3], &[1, 2, 3]), "images", "labels");
            }
            "csv" => {
                let _ = data::digits_from_csv(&text);
            }
            "placement" => {
                let _ = parse_placement(&text, &name);
            }
            "runstate" => {
                let metadata: BTreeMap<String, String> = text
                    .lines()
                    .filter_map(|line| line.split_once('='))
                    .map(|(key, value)| (format!("conveyor.train.{key}"), value.to_string()))
                    .collect();
                let _ = RunState::from_metadata(&metadata, &name);
            }
            "model" => {
                let _ = parse_and_maybe_build(&first_line);
            }
            "devices" => {
                let _ = parse_devices(&first_line, None);
            }
            "size" => {
                let _ = parse_size(&first_line);
            }
            "synthetic" => {
                let numbers: Vec<usize> = first_line.split(',').map(|n| n.trim().parse().unwrap_or(0)).collect();
                if let [n, d, c, seed] = numbers[..] {
                    let _ = data::synthetic(n, d, c, seed as u64);
                }
            }
            other => panic!("{name}: no reader is named `{other}`; prefix the file with one"),
        }));
        assert!(outcome.is_ok(), "{name} panicked");
        replayed += 1;
    }
    assert!(replayed >= 5, "only {replayed} regression files in {}", dir.display());
}
