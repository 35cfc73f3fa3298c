//! The files `conveyor train` writes (`--save`, `--checkpoint`, `--metrics`, `--trace`, `--svg`,
//! `--record-interleaving`): checked before training starts, and the two written as the run goes
//! (the metrics log and the trace), each into a temporary file renamed over its target at the end.
//!
//! [`check`] refuses, with exit status 2 and before any data is loaded or step trained:
//! - an output that cannot be written: a directory, a block device, a directory that does not
//!   exist or where no file can be created (`conveyor::engine::output_file::check_output` probes it);
//! - an output that is one of the run's inputs (`--data` and the files of an MNIST directory,
//!   `--init`, `--resume`, `--placement`, the record of `--interleaving replay:PATH`), compared by
//!   device and inode (so symbolic and hard links count) or, for a file not there yet, by its
//!   canonical directory and name. One pair is allowed:
//!   `--checkpoint` onto the `--resume` file, the usual way to continue a run in place;
//! - two outputs on one file.
//!
//! Character devices (`/dev/null`) are written straight through, so they may be named by any
//! number of outputs.
//!
//! Under MPI only rank 0 creates and writes these files (`Trainer::writes_files`); every rank
//! checks the paths, so a bad path ends the job before it starts. The trace then holds the steps'
//! gathered timelines ([`TraceStream::write_step`]): every rank's ops, one process row per rank.
use std::io::{BufWriter, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use conveyor::engine::output_file::{self, OutputFile, OutputKind};
use conveyor::schedules::export::{ChromeTraceWriter, MemorySample};
use conveyor::schedules::{Timeline, TimelineEvent};

use crate::cli::{output_error, usage};
use conveyor::RunSpec;
use conveyor::spec::{InterleavingSpec, PlacementSpec};

/// How a file is told apart from another.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Identity {
    /// An existing file: its device and inode (after following symbolic links).
    Inode(u64, u64),
    /// A file not there yet: its canonical directory joined with its name.
    Name(PathBuf),
}

fn identity(path: &Path) -> Option<Identity> {
    if let Ok(metadata) = std::fs::metadata(path) {
        return Some(Identity::Inode(metadata.dev(), metadata.ino()));
    }
    let target = output_file::resolve_output(path).ok()?;
    let directory = std::fs::canonicalize(target.directory()).ok()?;
    Some(Identity::Name(directory.join(target.resolved.file_name()?)))
}

/// True when two output paths name the same file (for `simulate --svg X --trace X` and the like).
pub(crate) fn same_output(a: &Path, b: &Path) -> bool {
    matches!((identity(a), identity(b)), (Some(x), Some(y)) if x == y)
}

/// The outputs of a run, by flag.
fn outputs(spec: &RunSpec) -> Vec<(&'static str, &Path)> {
    [
        ("--save", &spec.outputs.save),
        ("--checkpoint", &spec.checkpoint.path),
        ("--metrics", &spec.outputs.metrics),
        ("--trace", &spec.outputs.trace),
        ("--svg", &spec.outputs.svg),
        ("--record-interleaving", &spec.outputs.record_interleaving),
    ]
    .into_iter()
    .filter_map(|(flag, path)| path.as_deref().map(|path| (flag, path)))
    .collect()
}

/// The files a run reads, by flag.
fn inputs(spec: &RunSpec) -> Vec<(&'static str, PathBuf)> {
    let mut inputs = Vec::new();
    let source = &spec.data.source;
    let built_in = source == "digits" || source.starts_with("synthetic:") || source.starts_with("tokens:");
    if !built_in {
        let data = PathBuf::from(source);
        if data.is_dir() {
            for name in conveyor::data::MNIST_FILES {
                inputs.push(("--data", data.join(name)));
                inputs.push(("--data", data.join(format!("{name}.gz"))));
            }
        } else {
            inputs.push(("--data", data));
        }
    }
    for (flag, path) in [("--init", &spec.checkpoint.init), ("--resume", &spec.checkpoint.resume)] {
        if let Some(path) = path {
            inputs.push((flag, path.clone()));
        }
    }
    if let PlacementSpec::File(path) = &spec.pipeline.placement {
        inputs.push(("--placement", path.clone()));
    }
    if let InterleavingSpec::Replay(path) = &spec.pipeline.interleaving {
        inputs.push(("--interleaving", path.clone()));
    }
    inputs
}

/// Checks every output path before the run starts (see the module docs).
pub fn check(spec: &RunSpec) -> anyhow::Result<()> {
    let mut checked: Vec<(&str, &Path, Option<Identity>)> = Vec::new();
    for (flag, path) in outputs(spec) {
        let target = output_file::check_output(path).map_err(|e| {
            let error = output_error(flag, path, e);
            if !path.is_file() {
                return error;
            }
            let what = if flag == "--save" || flag == "--checkpoint" { "checkpoint" } else { "file" };
            usage(format!("{error}; the previous {what} there is unchanged"))
        })?;
        // A character device is written straight through: nothing is replaced, any output may share it.
        if target.kind != OutputKind::CharDevice {
            checked.push((flag, path, identity(path)));
        }
    }
    let inputs: Vec<(&str, PathBuf, Option<Identity>)> = inputs(spec)
        .into_iter()
        .map(|(flag, path)| {
            let id = identity(&path);
            (flag, path, id)
        })
        .collect();
    for (output_flag, output_path, output_id) in &checked {
        let Some(output_id) = output_id else { continue };
        for (input_flag, input_path, input_id) in &inputs {
            if input_id.as_ref() != Some(output_id) || (*output_flag == "--checkpoint" && *input_flag == "--resume") {
                continue;
            }
            let also = if *output_path == input_path.as_path() {
                String::new()
            } else {
                format!(" ({})", input_path.display())
            };
            return Err(usage(format!(
                "{output_flag} {} is the {input_flag} file{also}: writing it would destroy an input of the run; give {output_flag} another path",
                output_path.display()
            )));
        }
    }
    for (k, (first_flag, first_path, first_id)) in checked.iter().enumerate() {
        for (second_flag, second_path, second_id) in &checked[k + 1..] {
            if first_id.is_some() && first_id == second_id {
                return Err(usage(format!(
                    "{first_flag} {} and {second_flag} {} are the same file: each output needs its own path",
                    first_path.display(),
                    second_path.display()
                )));
            }
        }
    }
    Ok(())
}

/// A file of lines (`--metrics`) written as the run goes, into a temporary file renamed over the
/// target by [`LineOutput::finish`]. A write that fails (a full disk) does not stop the run: the
/// file stops there and [`LineOutput::finish`] reports the error after the run's other outputs
/// are written. Dropped unfinished (the run failed), it is still committed with the lines written
/// so far, if any; with none, the previous file stays.
pub struct LineOutput {
    out: Option<BufWriter<OutputFile>>,
    flag: &'static str,
    path: PathBuf,
    lines: u64,
    failed: Option<std::io::Error>,
}

impl LineOutput {
    /// Opens `path` for `flag`.
    pub fn create(flag: &'static str, path: &Path) -> anyhow::Result<LineOutput> {
        let file = OutputFile::create(path).map_err(|e| output_error(flag, path, e))?;
        Ok(LineOutput { out: Some(BufWriter::new(file)), flag, path: path.to_path_buf(), lines: 0, failed: None })
    }

    /// Appends one JSON object as a line (after a failed write, nothing more).
    pub fn line(&mut self, value: &serde_json::Value) {
        if self.failed.is_some() {
            return;
        }
        let out = self.out.as_mut().expect("an unfinished output");
        match writeln!(out, "{value}") {
            Ok(()) => self.lines += 1,
            Err(e) => self.failed = Some(e),
        }
    }

    fn io_error(&self, error: std::io::Error) -> anyhow::Error {
        anyhow::Error::new(error).context(format!("writing {} {}", self.flag, self.path.display()))
    }

    /// Flushes and renames the file into place; the first failed write, if any, is the error.
    pub fn finish(mut self) -> anyhow::Result<()> {
        if let Some(error) = self.failed.take() {
            // The partial file is removed; the previous one, if any, stays.
            self.out = None;
            return Err(self.io_error(error));
        }
        let out = self.out.take().expect("an unfinished output");
        let file = out.into_inner().map_err(|e| self.io_error(e.into_error()))?;
        file.commit().map_err(|e| output_error(self.flag, &self.path, e))
    }
}

impl Drop for LineOutput {
    fn drop(&mut self) {
        if self.failed.is_none()
            && let Some(out) = self.out.take()
            && self.lines > 0
            && let Ok(file) = out.into_inner()
        {
            let _ = file.commit();
        }
    }
}

/// `--trace`: the Chrome trace streamed to a temporary file as the run goes (one step's events at a
/// time), closed and renamed over the target by [`TraceStream::finish`], or when dropped. As for
/// [`LineOutput`], a failed write stops the trace, not the run.
///
/// In one process the events come from the op recorder ([`TraceStream::write`]: every op of the
/// process, evaluations included, with memory samples). Under MPI the recorder of rank 0 sees only
/// rank 0's worker; the trace is then written from each step's gathered timeline
/// ([`TraceStream::write_step`]): every rank's ops on rank 0's clock, in one process row per rank
/// (`rank 1 (cpu:1)`), without memory samples or evaluation ops.
pub struct TraceStream {
    writer: Option<ChromeTraceWriter<BufWriter<OutputFile>>>,
    path: PathBuf,
    ops: usize,
    failed: Option<std::io::Error>,
}

impl TraceStream {
    /// Opens `path` for a trace of `n_devices` devices labelled `labels`; with `rank_per_device`
    /// (an MPI job: rank `d` runs device `d`), each device in a process row of its own named
    /// `rank d (label)`.
    pub fn create(
        path: &Path,
        n_devices: usize,
        labels: Vec<String>,
        rank_per_device: bool,
    ) -> anyhow::Result<TraceStream> {
        let file = OutputFile::create(path).map_err(|e| output_error("--trace", path, e))?;
        let out = BufWriter::new(file);
        let writer = if rank_per_device {
            let ranks: Vec<String> = (0..n_devices)
                .map(|d| match labels.get(d) {
                    Some(label) if !label.is_empty() => format!("rank {d} ({label})"),
                    _ => format!("rank {d}"),
                })
                .collect();
            ChromeTraceWriter::with_process_per_device(out, n_devices, labels, &ranks)
        } else {
            ChromeTraceWriter::new(out, n_devices, labels)
        }
        .map_err(|e| anyhow::Error::new(e).context(format!("writing --trace {}", path.display())))?;
        Ok(TraceStream { writer: Some(writer), path: path.to_path_buf(), ops: 0, failed: None })
    }

    /// Appends one step's timeline, its events placed `at_s` seconds after the trace's zero: the
    /// timeline's ops (replica 0's pipeline device `d`, shard 0) in row `d * ranks_per_worker`, and
    /// `other_events` (other replicas and shards, [`conveyor::engine::runtime::StepReport`]) in
    /// their rows: a row per rank.
    pub fn write_step(
        &mut self,
        timeline: &Timeline,
        other_events: &[(usize, TimelineEvent)],
        ranks_per_worker: usize,
        at_s: f64,
    ) {
        let shifted = |e: &TimelineEvent, row: usize| TimelineEvent {
            start_s: e.start_s + at_s,
            end_s: e.end_s + at_s,
            device_idx: row,
            ..*e
        };
        let mut events: Vec<TimelineEvent> =
            timeline.events.iter().map(|e| shifted(e, e.device_idx * ranks_per_worker)).collect();
        events.extend(other_events.iter().map(|(row, e)| shifted(e, *row)));
        events.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
        self.write(&events, &[]);
    }

    /// Appends ops and memory samples (after a failed write, nothing more).
    pub fn write(&mut self, events: &[TimelineEvent], memory: &[MemorySample]) {
        if self.failed.is_some() {
            return;
        }
        let writer = self.writer.as_mut().expect("an unfinished trace");
        match writer.write_ops(events).and_then(|()| writer.write_memory(memory)) {
            Ok(()) => self.ops += events.len(),
            Err(e) => self.failed = Some(e),
        }
    }

    /// Closes the JSON and renames the file into place; returns the number of ops written. The
    /// first failed write, if any, is the error.
    pub fn finish(mut self) -> anyhow::Result<usize> {
        let context = || format!("writing --trace {}", self.path.display());
        if let Some(error) = self.failed.take() {
            // The partial file is removed; the previous one, if any, stays.
            self.writer = None;
            return Err(anyhow::Error::new(error).context(context()));
        }
        let writer = self.writer.take().expect("an unfinished trace");
        let out = writer.finish().map_err(|e| anyhow::Error::new(e).context(context()))?;
        let file = out.into_inner().map_err(|e| anyhow::Error::new(e.into_error()).context(context()))?;
        file.commit().map_err(|e| output_error("--trace", &self.path, e))?;
        Ok(self.ops)
    }
}

impl Drop for TraceStream {
    fn drop(&mut self) {
        if self.failed.is_none()
            && let Some(writer) = self.writer.take()
            && let Ok(out) = writer.finish()
            && let Ok(file) = out.into_inner()
        {
            let _ = file.commit();
        }
    }
}
