//! Every **Architecture Invariant:** line of `ARCHITECTURE.md`, as a test that fails when the
//! invariant breaks, naming the file and line that broke it.
//!
//! Rules the compiler does not enforce (which crate names what, where a `cfg` may stand, where a
//! lock may live) are checked by scanning the source with the scanners of
//! `architecture_support/rules.rs`, each of which is unit-tested there on a synthetic violation.
//! The message rule is checked by behaviour: the schedule's rule, the simulator and a real
//! trainer of probe layers must agree on every message.
//!
//! Where an invariant is broken today, the break is listed in a `KNOWN_*` table with the reason,
//! so the rest of the tree stays checked; an entry that no longer matches fails the test too, so
//! the table shrinks as the code is fixed.
mod architecture_support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use architecture_support::host_reads::{function_body, host_reads};
use architecture_support::probe::{received_per_channel, run_probes};
use architecture_support::rules;
use architecture_support::scan::{
    SourceFile, Violation, assert_none, is_lock, is_shared_state, rust_files, sites, without_test_files,
};
use conveyor::schedules::{
    ChannelId, CostModel, Direction, Instruction, Link, MessageBytes, OpKind, Schedule, ScheduleKind, StageCosts,
    simulate, validate,
};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> SourceFile {
    let text = std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    SourceFile::new(path, &text)
}

/// Violations not explained by `known` (path, a fragment of the offending line, why it is
/// tolerated for now); panics on an unexplained one, and on a known entry nothing matches (fixed:
/// remove it).
fn check_with_known(invariant: &str, violations: Vec<Violation>, known: &[(&str, &str, &str)]) {
    let (tolerated, new): (Vec<Violation>, Vec<Violation>) = violations
        .into_iter()
        .partition(|v| known.iter().any(|(path, fragment, _)| v.path == *path && v.text.contains(fragment)));
    assert_none(invariant, &new);
    for (path, fragment, why) in known {
        assert!(
            tolerated.iter().any(|v| v.path == *path && v.text.contains(fragment)),
            "the known departure at {path} (`{fragment}`) is gone; remove it from the KNOWN table ({why})"
        );
    }
    for v in &tolerated {
        eprintln!("known departure from \"{invariant}\": {v}");
    }
}

// ---------------------------------------------------------------------------------------------
// schedules/: "this crate knows nothing of tensors, devices or threads. It depends on no other
// Conveyor crate."

#[test]
fn schedules_know_nothing_of_tensors_devices_or_threads() {
    let invariant = "schedules know nothing of tensors, devices or threads and depend on no other Conveyor crate";
    let mut violations = rules::schedules_manifest(&read("schedules/Cargo.toml"));
    violations.extend(rules::schedules_sources(&rust_files(&root(), "schedules/src")));
    assert_none(invariant, &violations);
}

// ---------------------------------------------------------------------------------------------
// schedules/: "sends and receives are never listed in a schedule. The validator and every
// simulator derive them from one rule, `Instruction::recv_from` / `send_to` ... Which tensors cross
// between which stages comes from the graph's edges ... When they cross is the same rule applied to
// the routes ... For a chain ... the runtime's messages are the rule's, channel by channel and in
// order. An edge that skips stages adds a channel the rule does not list. The validator's proof
// still covers it."

/// The files that must take their messages from the rule.
const RULE_USERS: [&str; 3] =
    ["schedules/src/validate.rs", "schedules/src/simulate.rs", "schedules/src/shared_cores.rs"];

#[test]
fn schedules_derive_every_message_from_the_one_rule() {
    let files = rust_files(&root(), "schedules/src");
    let mut violations = rules::messages_built_outside_the_rule(&files, "schedules/src/instruction.rs");
    violations.extend(rules::rule_users_call_the_rule(&files, &RULE_USERS));
    assert_none("sends and receives are derived by one rule (Instruction::recv_from / send_to)", &violations);
}

/// Per channel, the micro-batches in program order of the instructions that receive (`recv`) or
/// send them by the schedule's rule.
fn by_the_rule(schedule: &Schedule, recv: bool) -> BTreeMap<ChannelId, Vec<usize>> {
    let n_stages = schedule.n_stages();
    let mut out: BTreeMap<ChannelId, Vec<usize>> = BTreeMap::new();
    for program in schedule.programs() {
        for instruction in program {
            let message = if recv { instruction.recv_from(n_stages) } else { instruction.send_to(n_stages) };
            if let Some(message) = message {
                out.entry(message.channel()).or_default().push(message.micro_batch_idx);
            }
        }
    }
    out
}

/// The runtime's rule applied to stage-to-stage `edges` (producer, consumer): a forward of
/// (m, s) receives on every edge into s; a backward-input or fused backward of (m, s) receives a
/// gradient on every edge out of s. Per channel, micro-batches in receiving program order.
fn by_the_routes(schedule: &Schedule, edges: &[(usize, usize)]) -> BTreeMap<ChannelId, Vec<usize>> {
    let mut out: BTreeMap<ChannelId, Vec<usize>> = BTreeMap::new();
    for program in schedule.programs() {
        for instruction in program {
            let (channels, micro_batch_idx): (Vec<ChannelId>, usize) = match *instruction {
                Instruction::Forward { micro_batch_idx, stage_idx } => (
                    edges
                        .iter()
                        .filter(|(_, to)| *to == stage_idx)
                        .map(|&(from, to)| ChannelId {
                            from_stage_idx: from,
                            to_stage_idx: to,
                            direction: Direction::Activation,
                        })
                        .collect(),
                    micro_batch_idx,
                ),
                Instruction::BackwardInput { micro_batch_idx, stage_idx }
                | Instruction::Backward { micro_batch_idx, stage_idx } => (
                    edges
                        .iter()
                        .filter(|(from, _)| *from == stage_idx)
                        .map(|&(from, to)| ChannelId {
                            from_stage_idx: to,
                            to_stage_idx: from,
                            direction: Direction::Gradient,
                        })
                        .collect(),
                    micro_batch_idx,
                ),
                Instruction::BackwardWeight { .. } | Instruction::OptimizerStep => continue,
            };
            for channel in channels {
                out.entry(channel).or_default().push(micro_batch_idx);
            }
        }
    }
    out
}

/// Per channel, the micro-batches the simulator sends, in the order it sends them. Activations
/// cost 1 s on the link and gradients 2 s, so each `Send` event's length gives its direction.
fn simulated_sends(schedule: &Schedule) -> BTreeMap<ChannelId, Vec<usize>> {
    let costs = CostModel::uniform(StageCosts::UNIT)
        .with_link(Link { latency_s: 0.0, bandwidth_bytes_per_s: 1.0 })
        .with_message_bytes(MessageBytes { activation_bytes: 1, gradient_bytes: 2 });
    let report = simulate(schedule, &costs).expect("the schedule simulates");
    let mut out: BTreeMap<ChannelId, Vec<usize>> = BTreeMap::new();
    for event in report.timeline.events.iter().filter(|e| e.op == OpKind::Send) {
        let from = event.stage_idx.expect("a send has a stage");
        let (to, direction) = if event.end_s - event.start_s < 1.5 {
            (from + 1, Direction::Activation)
        } else {
            (from - 1, Direction::Gradient)
        };
        let channel = ChannelId { from_stage_idx: from, to_stage_idx: to, direction };
        out.entry(channel).or_default().push(event.micro_batch_idx.expect("a send has a micro-batch"));
    }
    out
}

/// Every schedule on 2 and 3 devices (interleaved with 2 chunks), 6 micro-batches.
fn every_schedule() -> Vec<Schedule> {
    let mut out = Vec::new();
    for kind in ScheduleKind::ALL {
        for n_devices in [2, 3] {
            let n_chunks = if kind.supports_chunks() { 2 } else { 1 };
            out.push(Schedule::new(kind, n_devices, 6, n_chunks).expect("the schedule exists"));
        }
    }
    out
}

fn describe(schedule: &Schedule) -> String {
    format!("{:?} on {} devices x {} chunks", schedule.kind(), schedule.n_devices(), schedule.n_chunks())
}

#[test]
fn validator_simulator_and_runtime_agree_on_every_message_of_a_chain() {
    for schedule in every_schedule() {
        let name = describe(&schedule);
        let n_stages = schedule.n_stages();
        validate(&schedule, schedule.n_micro_batches())
            .unwrap_or_else(|e| panic!("{name}: the validator refuses: {e}"));
        let received = by_the_rule(&schedule, true);
        let sent = by_the_rule(&schedule, false);
        assert_eq!(received, sent, "{name}: by the rule every channel is FIFO (what the validator checks)");
        // A message a device sends itself (the turn of a V) costs nothing and records no `Send`.
        let between_devices: BTreeMap<ChannelId, Vec<usize>> = sent
            .iter()
            .filter(|(channel, _)| {
                schedule.device_of_stage(channel.from_stage_idx) != schedule.device_of_stage(channel.to_stage_idx)
            })
            .map(|(channel, micro_batches)| (*channel, micro_batches.clone()))
            .collect();
        assert_eq!(simulated_sends(&schedule), between_devices, "{name}: the simulator sends what the rule sends");

        let (seen, edges) = run_probes(&schedule, &[]);
        let chain: Vec<(usize, usize)> = (1..n_stages).map(|s| (s - 1, s)).collect();
        assert_eq!(edges, chain);
        assert_eq!(
            by_the_routes(&schedule, &edges),
            received,
            "{name}: on a chain the routes give the rule's messages"
        );
        assert_eq!(
            received_per_channel(&seen, n_stages, &[]),
            received,
            "{name}: the runtime receives, channel by channel and in order, what the rule says"
        );
        for s in &seen {
            let expected = format!("conveyor-cpu:{}", schedule.device_of_stage(s.stage_idx));
            assert_eq!(s.thread, expected, "{name}: stage {} ran on the wrong worker", s.stage_idx);
        }
    }
}

#[test]
fn runtime_routes_follow_graph_edges_even_where_they_skip_stages() {
    // Stage 2 also consumes stage 0's output: a route the rule does not list.
    let skips = [(2, 0)];
    for schedule in every_schedule().into_iter().filter(|s| s.n_stages() >= 3) {
        let name = describe(&schedule);
        let n_stages = schedule.n_stages();
        let (seen, edges) = run_probes(&schedule, &skips);
        let expected = by_the_routes(&schedule, &edges);
        let by_rule = by_the_rule(&schedule, true);
        let extra: BTreeSet<ChannelId> = expected.keys().filter(|c| !by_rule.contains_key(c)).copied().collect();
        let skip_channels: BTreeSet<ChannelId> = [
            ChannelId { from_stage_idx: 0, to_stage_idx: 2, direction: Direction::Activation },
            ChannelId { from_stage_idx: 2, to_stage_idx: 0, direction: Direction::Gradient },
        ]
        .into();
        assert_eq!(extra, skip_channels, "{name}: the routes add exactly the skip edge's channels to the rule's");
        // The skip's gradient is zero so stage 0 can decode its main one; it is not observed.
        let mut observable = expected.clone();
        observable.retain(|c, _| !(c.direction == Direction::Gradient && skip_channels.contains(c)));
        assert_eq!(
            received_per_channel(&seen, n_stages, &skips),
            observable,
            "{name}: the runtime receives on every route, in the schedule's order"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// engine/: "the engine never names a concrete layer; it sees `dyn Layer`."

/// Engine code that names a concrete layer today: (file, line fragment, why). None: the profiler
/// and the memory probe ask `Layer::takes_indices` what input to make up.
const KNOWN_LAYER_NAMES: [(&str, &str, &str); 0] = [];

#[test]
fn engine_never_names_a_concrete_layer() {
    let layers = rules::concrete_layers(&rust_files(&root(), "layers/src"));
    for expected in ["Linear", "Conv2d", "Relu", "CrossEntropyLoss"] {
        assert!(layers.types.iter().any(|t| t == expected), "layer scan lost `{expected}`: {layers:?}");
    }
    for expected in ["Linear", "Embedding", "ReLU"] {
        assert!(layers.kinds.iter().any(|k| k == expected), "kind scan lost \"{expected}\": {layers:?}");
    }
    let mut violations = rules::engine_names_concrete_layers(&rust_files(&root(), "engine/src"), &layers);
    let engine_manifest = read("engine/Cargo.toml");
    for (line, table, dep) in conveyor_dependencies(&engine_manifest) {
        if dep == "conveyor-layers" {
            violations.push(Violation::at(
                &engine_manifest,
                line,
                format!("[{table}] the engine depends on the layers"),
            ));
        }
    }
    check_with_known("the engine never names a concrete layer; it sees dyn Layer", violations, &KNOWN_LAYER_NAMES);
}

fn conveyor_dependencies(manifest: &SourceFile) -> Vec<(usize, String, String)> {
    architecture_support::scan::dependencies(&manifest.text)
        .into_iter()
        .filter(|(_, _, d)| d.starts_with("conveyor"))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// engine/: "no `cfg(feature = "cuda")` outside `device/mod.rs` (the switch) and
// `device/cuda_enabled.rs`."

#[test]
fn cuda_feature_is_switched_in_one_place() {
    // Library code of every crate; tests, benches and examples may pick CUDA cases by feature.
    let mut files = Vec::new();
    for dir in ["engine/src", "layers/src", "schedules/src", "src"] {
        files.extend(rust_files(&root(), dir));
    }
    let switch = ["engine/src/device/mod.rs", "engine/src/device/cuda_enabled.rs"];
    assert!(
        rules::cuda_cfg_outside_switch(&[read(switch[0])], &[]).len() == 2,
        "device/mod.rs no longer holds the cuda switch the scan looks for"
    );
    assert_none(
        "no cfg(feature = \"cuda\") outside device/mod.rs and device/cuda_enabled.rs",
        &rules::cuda_cfg_outside_switch(&files, &switch),
    );
}

// ---------------------------------------------------------------------------------------------
// engine/: "no `cfg(feature = "mpi")` outside `transport/mod.rs` (the switch) and
// `transport/mpi_enabled.rs`."

#[test]
fn mpi_feature_is_switched_in_one_place() {
    // Library code of every crate and the binary; tests, benches and examples may pick MPI cases
    // by feature.
    let mut files = Vec::new();
    for dir in ["engine/src", "layers/src", "schedules/src", "src"] {
        files.extend(rust_files(&root(), dir));
    }
    let switch = ["engine/src/transport/mod.rs", "engine/src/transport/mpi_enabled.rs"];
    assert!(
        rules::mpi_cfg_outside_switch(&[read(switch[0])], &[]).len() == 2,
        "transport/mod.rs no longer holds the mpi switch the scan looks for"
    );
    assert_none(
        "no cfg(feature = \"mpi\") outside transport/mod.rs and transport/mpi_enabled.rs",
        &rules::mpi_cfg_outside_switch(&files, &switch),
    );
}

// ---------------------------------------------------------------------------------------------
// engine/: "workers own their stages' parameters, gradients and optimizer state; nothing on the
// hot path is shared behind a lock. (The one shared object is runtime/core_slots.rs ...) The
// coordinator talks to workers only through channels."

/// A place a lock may stand: file, item (`*`: the whole file), and why it keeps the invariant, or
/// for a `departure`, why it breaks it and is tolerated for now.
struct LockSite {
    path: &'static str,
    item: &'static str,
    why: &'static str,
    departure: bool,
}

const LOCKS: [LockSite; 19] = [
    LockSite {
        path: "engine/src/strategies/links.rs",
        item: "*",
        why: "the data-parallel strategies' meeting points (the all-gather's generations, the \
              deterministic turnstile, per-step counters): taken once or twice per exchange, pull or push, between \
              the replicas' steps and never inside one; they guard encoded bytes and counters, no tensor of a step",
        departure: false,
    },
    LockSite {
        path: "engine/src/collective/direct.rs",
        item: "*",
        why: "the meeting point of an in-process all-reduce: each rank takes it three times per call to record its \
              phase and see the others' (a barrier), never while it adds or copies; it guards no tensor data",
        departure: false,
    },
    LockSite {
        path: "engine/src/collective/over_transport.rs",
        item: "TransportGroup",
        why: "a rank's messages taken early while it waited for another rank's, and its first failure: both used \
              by the one thread calling the rank's collective (calls are serialised), never contended",
        departure: false,
    },
    LockSite {
        path: "engine/src/collective/over_transport.rs",
        item: "split",
        why: "creates the two fields above",
        departure: false,
    },
    LockSite {
        path: "engine/src/collective/over_transport/tests.rs",
        item: "Hub",
        why: "a unit test's in-memory transport between threads, not runtime code",
        departure: false,
    },
    LockSite {
        path: "engine/src/transport/mpi_enabled.rs",
        item: "*",
        why: "the MPI mailbox, taken by the communication thread per arriving message and by the coordinator once \
              per remote channel at dispatch, never by a worker (workers receive over crossbeam channels); and the \
              thread's join handle, taken once when the transport is dropped",
        departure: false,
    },
    LockSite {
        path: "engine/src/transport/mod.rs",
        item: "PROCESS",
        why: "the process's default transport, read when a trainer is built, never during a step",
        departure: false,
    },
    LockSite {
        path: "engine/src/runtime/core_slots.rs",
        item: "*",
        why: "the one shared object ARCHITECTURE.md names: a FIFO of core slots that guards no data",
        departure: false,
    },
    LockSite {
        path: "engine/src/collective/in_process.rs",
        item: "Shared",
        why: "the group's first failure, read only after the `aborted` flag is set: the failure path",
        departure: false,
    },
    LockSite {
        path: "engine/src/collective/in_process.rs",
        item: "with_timeout",
        why: "creates the failure slot above",
        departure: false,
    },
    LockSite {
        path: "engine/src/device/cuda/nccl.rs",
        item: "NcclRank",
        why: "one rank's own communicator and counters, used by its one thread: never contended",
        departure: false,
    },
    LockSite {
        path: "engine/src/device/cuda/nccl.rs",
        item: "group_abortable",
        why: "creates the per-rank locks above",
        departure: false,
    },
    LockSite {
        path: "engine/src/device/memory.rs",
        item: "MemoryAccount",
        why: "per-thread tallies of one probed call: taken only while the memory planner tallies (an atomic flag skips it otherwise)",
        departure: false,
    },
    LockSite {
        path: "engine/src/device/memory.rs",
        item: "new",
        why: "creates the tally lock above",
        departure: false,
    },
    LockSite {
        path: "engine/src/device/memory.rs",
        item: "lock_threads",
        why: "takes the tally lock above (planning only)",
        departure: false,
    },
    LockSite {
        path: "layers/src/parallel/pending.rs",
        item: "*",
        why: "a split layer's slots for the gradient its two backward calls share (the head-split attention's \
              ∂L/∂qkv, the MLP block's hidden gradient), taken only on the calling pipeline worker's thread (a \
              Mutex rather than MultiheadSelfAttention's RefCell because the layer is shared with its shard \
              threads): never contended",
        departure: false,
    },
    LockSite {
        path: "layers/src/parallel/group.rs",
        item: "*",
        why: "a split layer's own collective handles, and a rank's transport group of its stage shared by the \
              stage's split layers, all called from the rank's one pipeline worker: never contended",
        departure: false,
    },
    LockSite {
        path: "engine/src/device/cuda/compile.rs",
        item: "CACHE",
        why: "kernels_for_process: a thread's first launch on a GPU only (a thread-local cache answers every later launch)",
        departure: false,
    },
    LockSite {
        path: "engine/src/device/cuda/device.rs",
        item: "ENABLED",
        why: "enable_peer_access: a thread's first copy between two GPUs only (a thread-local set answers later copies)",
        departure: false,
    },
];

/// The op-span recorder is shared too, but only when a trace is asked for.
const RECORDER: LockSite = LockSite {
    path: "engine/src/trace.rs",
    item: "*",
    why: "observability the user turns on (`train --trace`/`--svg`): the recorder's lock per op, which ARCHITECTURE.md excepts",
    departure: false,
};

#[test]
fn nothing_on_the_hot_path_is_shared_behind_a_lock() {
    let mut files = rust_files(&root(), "engine/src");
    files.extend(rust_files(&root(), "layers/src"));
    let allowed: Vec<&LockSite> = LOCKS.iter().chain([&RECORDER]).collect();
    let found = sites(&files, is_lock);
    let listed = |path: &str, item: &str| allowed.iter().find(|a| a.path == path && (a.item == "*" || a.item == item));
    let violations: Vec<Violation> = found
        .iter()
        .filter(|s| listed(&s.path, &s.item).is_none())
        .map(|s| {
            s.violation(format!(
                "`{}` in `{}`: a lock is shared state; give workers their own copy, or pass it by channel (or list it in LOCKS with the reason it is off the hot path)",
                s.token, s.item
            ))
        })
        .collect();
    assert_none("nothing on the hot path is shared behind a lock", &violations);
    for site in &allowed {
        assert!(
            found.iter().any(|s| s.path == site.path && (site.item == "*" || s.item == site.item)),
            "{} `{}` holds no lock any more: remove it from LOCKS ({})",
            site.path,
            site.item,
            site.why
        );
        if site.departure {
            eprintln!("known departure: a lock on the hot path at {} `{}`: {}", site.path, site.item, site.why);
        }
    }
}

/// Shared state between the coordinator and workers other than channels, today.
const COORDINATOR_SHARED_STATE: [(&str, &str, &str); 0] = [];

#[test]
fn coordinator_talks_to_workers_only_through_channels() {
    // Threads can share mutable state only through a lock, an atomic or a cell made for it; the
    // runtime may use none but core_slots.rs (the documented exception, which guards no data).
    let files: Vec<SourceFile> = rust_files(&root(), "engine/src/runtime")
        .into_iter()
        .filter(|f| f.path != "engine/src/runtime/core_slots.rs")
        .collect();
    let violations: Vec<Violation> = sites(&files, is_shared_state)
        .iter()
        .map(|s| s.violation(format!("`{}` in `{}`: the coordinator and workers share only channels", s.token, s.item)))
        .collect();
    check_with_known("the coordinator talks to workers only through channels", violations, &COORDINATOR_SHARED_STATE);
}

// ---------------------------------------------------------------------------------------------
// layers/: "layers know tensors and devices, never schedules, placement or the runtime;
// `conveyor-layers` does not depend on `conveyor-schedules`."

#[test]
fn layers_know_nothing_of_schedules_placement_or_runtime() {
    let mut violations = rules::layers_name_schedules_placement_or_runtime(&rust_files(&root(), "layers/src"));
    let manifest = read("layers/Cargo.toml");
    for (line, table, dep) in conveyor_dependencies(&manifest) {
        if dep == "conveyor-schedules" {
            violations.push(Violation::at(
                &manifest,
                line,
                format!("[{table}] conveyor-layers depends on conveyor-schedules"),
            ));
        }
    }
    assert_none("layers know tensors and devices, never schedules, placement or the runtime", &violations);
}

// ---------------------------------------------------------------------------------------------
// layers/: "no layer reads host memory: layers compute through the engine's device ops ... The one
// exception is Linear's packed weight, built and read only for f32 weights on a CPU device."

/// A place in `layers/src` that reads host memory: the file, the function as the scan names it
/// (`Type::method`, a free function's name), the exact accessors it uses there (a `Tensor` method,
/// `cpu::...` for an engine CPU kernel, `module::function` for a layers helper that reads host
/// memory), and, where the read is permitted only behind a check, that check's text in the body.
struct HostReadSite {
    path: &'static str,
    item: &'static str,
    accessors: &'static [&'static str],
    guard: Option<&'static str>,
}

const fn site(path: &'static str, item: &'static str, accessors: &'static [&'static str]) -> HostReadSite {
    HostReadSite { path, item, accessors, guard: None }
}

const fn guarded(
    path: &'static str,
    item: &'static str,
    accessors: &'static [&'static str],
    guard: &'static str,
) -> HostReadSite {
    HostReadSite { path, item, accessors, guard: Some(guard) }
}

/// Host reads with one reason; `departure`: they break the invariant and are tolerated for now.
struct HostReadGroup {
    why: &'static str,
    departure: bool,
    sites: &'static [HostReadSite],
}

/// Every host read of `layers/src`. A read anywhere else, or through another accessor, fails
/// `layers_compute_through_device_ops`; so does an entry (or one of its accessors) nothing reads
/// any more, and a permitted read whose guard is gone.
const HOST_READS: [HostReadGroup; 1] = [HostReadGroup {
    why: "the permitted exception: Linear's packed weight. `refresh` builds the strips only for an f32 weight \
              on a CPU device (`Device::Cpu(_)`), so `packed` exists only there; forward and the input gradient \
              read them only when fresh, after `check_same_device` put the input on the weight's CPU device. Any \
              other weight goes through `Tensor::matmul`, and so does any product our small-row kernel does not \
              take (`rows_gemm::suits`, a shape test). `cost` sizes the strips (`packed_len`, arithmetic on the \
              dimensions). `tensor_io::values` is the two arms' reader (the scan follows every call to it)",
    departure: false,
    sites: &[
        guarded(
            "layers/src/linear.rs",
            "Linear::refresh",
            &["as_f32", "as_f32_mut", "cpu::MatRef::row_major", "cpu::packed::pack_rhs", "cpu::packed::packed_len"],
            "matches!(weight.device(), Device::Cpu(_))",
        ),
        guarded(
            "layers/src/linear.rs",
            "Linear::forward",
            &[
                "as_f32",
                "cpu::MatRef::row_major",
                "cpu::packed::matmul_packed",
                "cpu::packed::matmul_packed_uninit",
                "cpu::rows_gemm::suits",
                "cpu::uninit::broadcast_rows",
                "from_f32_init",
                "tensor_io::values",
            ],
            "self.packed.as_ref().filter(|_| self.packed_fresh)",
        ),
        guarded(
            "layers/src/linear.rs",
            "Linear::backward_input",
            &[
                "as_f32",
                "cpu::MatRef::row_major",
                "cpu::packed::matmul_packed_uninit",
                "cpu::rows_gemm::suits",
                "from_f32_init",
                "tensor_io::values",
            ],
            "self.packed.as_ref().filter(|_| self.packed_fresh)",
        ),
        site("layers/src/linear.rs", "Linear::cost", &["cpu::packed::packed_len"]),
        site("layers/src/tensor_io.rs", "values", &["as_f32", "try_to_vec_f32"]),
    ],
}];

const NO_HOST_READS: &str = "no layer reads host memory: layers compute through the device ops (Linear's packed \
                             weight on CPU devices excepted)";

/// What a layer should do instead of a host read.
const USE_A_DEVICE_OP: &str = "compute through a device op instead (`engine/src/device/ops.rs`, `ops/*.rs`: \
                               `Tensor::matmul`, `activation`, `conv2d`, `layer_norm`, ...; add one there if none \
                               fits), which runs where the tensor lives, or list this place in HOST_READS with \
                               the reason";

/// The host reads of `files` (the layers' source) that no site of `allowed` explains, and the
/// problems with `allowed` itself: sites or accessors nothing reads any more, guards gone.
fn check_host_reads(files: &[SourceFile], allowed: &[HostReadGroup]) -> (Vec<Violation>, Vec<String>) {
    let reads = host_reads(files, "layers/src");
    let sites = || allowed.iter().flat_map(|group| group.sites.iter().map(move |site| (group, site)));
    let unexplained = reads
        .iter()
        .filter(|r| {
            !sites().any(|(_, s)| s.path == r.path && s.item == r.item && s.accessors.contains(&r.accessor.as_str()))
        })
        .map(|r| r.violation(USE_A_DEVICE_OP))
        .collect();
    let mut problems = Vec::new();
    for (group, site) in sites() {
        for accessor in site.accessors {
            if !reads.iter().any(|r| r.path == site.path && r.item == site.item && r.accessor == *accessor) {
                problems.push(format!(
                    "{} `{}` no longer reads host memory through `{accessor}`: remove it from HOST_READS ({})",
                    site.path, site.item, group.why
                ));
            }
        }
        if let Some(guard) = site.guard {
            let body = files.iter().find(|f| f.path == site.path).and_then(|f| function_body(f, site.item));
            if !body.is_some_and(|body| body.contains(guard)) {
                problems.push(format!(
                    "{} `{}` no longer holds `{guard}`, the check that keeps its host reads on CPU devices ({})",
                    site.path, site.item, group.why
                ));
            }
        }
    }
    (unexplained, problems)
}

fn layers_source() -> Vec<SourceFile> {
    without_test_files(rust_files(&root(), "layers/src"))
}

#[test]
fn layers_compute_through_device_ops() {
    let (unexplained, problems) = check_host_reads(&layers_source(), &HOST_READS);
    assert_none(NO_HOST_READS, &unexplained);
    assert!(problems.is_empty(), "HOST_READS is out of date:\n  {}", problems.join("\n  "));
    for group in HOST_READS.iter().filter(|g| g.departure) {
        for site in group.sites {
            eprintln!("known departure from \"{NO_HOST_READS}\": {} `{}`", site.path, site.item);
        }
    }
}

/// `layers_source()` with `edit` applied to the file at `path`.
fn planted(path: &str, edit: impl FnOnce(&str) -> String) -> Vec<SourceFile> {
    let mut files = layers_source();
    let file = files.iter_mut().find(|f| f.path == path).unwrap_or_else(|| panic!("{path} is gone"));
    let edited = edit(&file.text);
    assert_ne!(edited, file.text, "the plant did not change {path}");
    file.text = edited;
    files
}

#[test]
fn host_read_check_fails_on_a_planted_read() {
    // A new function reading a host slice, in a layer that has none.
    let path = "layers/src/activation.rs";
    let mut line = 0;
    let files = planted(path, |text| {
        line = text.lines().count() + 3; // after a blank line and the signature
        format!("{text}\nfn planted(t: &Tensor) -> f32 {{\n    t.as_f32().map(|v| v[0]).unwrap_or(0.0)\n}}\n")
    });
    let (unexplained, problems) = check_host_reads(&files, &HOST_READS);
    assert_eq!(unexplained.len(), 1, "{unexplained:#?}");
    let message = unexplained[0].to_string();
    let expected = format!("{path}:{line}: `t.as_f32().map(|v| v[0]).unwrap_or(0.0)`: `as_f32` in `planted` borrows");
    assert!(message.starts_with(&expected), "{message}");
    assert!(message.contains("compute through a device op instead"), "{message}");
    assert!(problems.is_empty(), "{problems:?}");

    // A download in a function allowed other accessors.
    let files = planted("layers/src/linear.rs", |text| {
        text.replacen("let saved = Saved {", "let _peek = input.to_vec_f32();\n        let saved = Saved {", 1)
    });
    let (unexplained, _) = check_host_reads(&files, &HOST_READS);
    let found: Vec<&str> = unexplained.iter().map(|v| v.why.as_str()).collect();
    assert!(matches!(found[..], [why] if why.starts_with("`to_vec_f32` in `Linear::forward`")), "{found:?}");

    // The fast path's reader called from another layer, and a CPU kernel imported there.
    let files = planted(path, |text| {
        format!(
            "{text}\nfn planted(t: &Tensor) -> usize {{\n    crate::tensor_io::values(t).len()\n}}\n\
             use conveyor_engine::cpu::softmax as planted_kernels;\nfn planted_too(x: &[f32]) {{\n    planted_kernels::softmax_rows(x);\n}}\n"
        )
    });
    let (unexplained, _) = check_host_reads(&files, &HOST_READS);
    let found: Vec<(&str, &str)> =
        unexplained.iter().map(|v| (v.path.as_str(), v.why.split('`').nth(1).unwrap_or(""))).collect();
    assert_eq!(found, [(path, "tensor_io::values"), (path, "cpu::softmax::softmax_rows")]);

    // The fast path's guard removed.
    let files = planted("layers/src/linear.rs", |text| text.replacen("Device::Cpu(_)", "Device::Cuda(_)", 1));
    let (_, problems) = check_host_reads(&files, &HOST_READS);
    assert!(
        matches!(&problems[..], [p] if p.contains("Linear::refresh") && p.contains("no longer holds")),
        "{problems:?}"
    );

    // An entry nothing matches any more.
    const STALE: [HostReadSite; 1] = [site("layers/src/activation.rs", "Relu::forward", &["as_f32"])];
    let stale = [HostReadGroup { why: "a test", departure: true, sites: &STALE }];
    let (_, problems) = check_host_reads(&layers_source(), &stale);
    assert!(matches!(&problems[..], [p] if p.contains("no longer reads host memory through `as_f32`")), "{problems:?}");
}

// ---------------------------------------------------------------------------------------------
// src/: "dependencies point one way: conveyor-schedules <- conveyor-engine <- conveyor-layers <-
// conveyor."

#[test]
fn dependencies_point_one_way() {
    let workspace = read("Cargo.toml");
    let members = rules::workspace_members(&workspace.text);
    assert!(!members.is_empty(), "no workspace members found in Cargo.toml");
    let mut manifests = vec![("conveyor".to_string(), workspace)];
    for member in members {
        let manifest = read(&format!("{member}/Cargo.toml"));
        let package = rules::package_name(&manifest.text).unwrap_or_else(|| panic!("{member}/Cargo.toml has no name"));
        manifests.push((package, manifest));
    }
    let names: BTreeSet<&str> = manifests.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, rules::CRATE_ORDER.into(), "the workspace's crates are the four of ARCHITECTURE.md");
    assert_none(
        "dependencies point one way: conveyor-schedules <- conveyor-engine <- conveyor-layers <- conveyor",
        &rules::dependency_direction(&manifests, &[("conveyor-layers", "conveyor-schedules")]),
    );
}

#[test]
fn the_tests_cover_every_invariant_line() {
    // A new **Architecture Invariant:** line needs a test here; this counts them.
    let text = std::fs::read_to_string(Path::new(&root()).join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let n_invariants = text.lines().filter(|line| line.starts_with("**Architecture Invariant:**")).count();
    assert_eq!(n_invariants, 9, "ARCHITECTURE.md's invariants changed: add or update a test in this file");
}
