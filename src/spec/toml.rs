//! The TOML form of a [`RunSpec`]: reading ([`RunSpec::from_toml_str`], [`RunSpec::from_file`])
//! with errors that name the key (`pipeline.schedule`), its flag and the fix, writing
//! ([`RunSpec::to_toml_string`]), and the serde forms of the typed fields (names such as `1f1b`,
//! sizes such as `512MiB`, placements, integers past TOML's signed 64 bits as strings).
use std::io::Read;
use std::path::Path;

use conveyor_engine::placement::WeightCache;
use conveyor_engine::runtime::{CoreSlotPolicy, Recompute, ReplicaShares};
use conveyor_schedules::ScheduleKind;
use serde::{Deserialize, Deserializer, Serializer};

use super::{BucketSize, LrSchedule, OnNonFinite, OptimizerKind, Precision, RunSpec, SpecError};

/// The largest run spec file [`RunSpec::from_file`] reads (1 MiB): a spec is a page of text.
pub const MAX_SPEC_FILE_BYTES: u64 = 1 << 20;

/// Every key of the TOML form with the `conveyor train` flag that sets it.
const FLAGS: &[(&str, &str)] = &[
    ("model.spec", "--model"),
    ("data.source", "--data"),
    ("data.test_fraction", "--test-fraction"),
    ("data.classes", "--classes"),
    ("pipeline.devices", "--devices"),
    ("pipeline.device_memory", "--device-memory"),
    ("pipeline.stages", "--stages"),
    ("pipeline.tensor_parallel", "--tensor-parallel"),
    ("pipeline.sequence_parallel", "--sequence-parallel"),
    ("pipeline.data_parallel", "--data-parallel"),
    ("pipeline.zero", "--zero"),
    ("pipeline.replica_shares", "--replica-shares"),
    ("pipeline.bucket_size", "--bucket-size"),
    ("pipeline.sync", "--sync"),
    ("pipeline.compress", "--compress"),
    ("pipeline.compress_after", "--compress-after"),
    ("pipeline.interleaving", "--interleaving"),
    ("pipeline.placement", "--placement"),
    ("pipeline.schedule", "--schedule"),
    ("pipeline.chunks", "--chunks"),
    ("pipeline.microbatches", "--microbatches"),
    ("pipeline.recompute", "--recompute"),
    ("pipeline.core_slots", "--core-slots"),
    ("pipeline.weight_cache", "--weight-cache"),
    ("pipeline.overlap_steps", "--overlap-steps"),
    ("training.batch", "--batch"),
    ("training.steps", "--steps"),
    ("training.epochs", "--epochs"),
    ("training.seed", "--seed"),
    ("training.shuffle", "--no-shuffle"),
    ("training.precision", "--precision"),
    ("training.on_nonfinite", "--on-nonfinite"),
    ("training.eval_every", "--eval-every"),
    ("training.log_every", "--log-every"),
    ("optimizer.name", "--optimizer"),
    ("optimizer.lr", "--lr"),
    ("optimizer.momentum", "--momentum"),
    ("optimizer.weight_decay", "--weight-decay"),
    ("optimizer.lr_schedule", "--lr-schedule"),
    ("optimizer.clip_grad_norm", "--clip-grad-norm"),
    ("checkpoint.init", "--init"),
    ("checkpoint.resume", "--resume"),
    ("checkpoint.path", "--checkpoint"),
    ("checkpoint.every", "--checkpoint-every"),
    ("outputs.save", "--save"),
    ("outputs.metrics", "--metrics"),
    ("outputs.trace", "--trace"),
    ("outputs.svg", "--svg"),
    ("outputs.record_interleaving", "--record-interleaving"),
];

/// The `conveyor train` flag that sets a key of the TOML form (`"pipeline.chunks"` → `--chunks`).
pub fn flag_of_key(key: &str) -> Option<&'static str> {
    FLAGS.iter().find(|(k, _)| *k == key).map(|(_, flag)| *flag)
}

impl RunSpec {
    /// Reads a spec from TOML text. Every table and key is optional (a missing one takes its
    /// default); an unknown key, a value of the wrong type or a value its parser refuses is a
    /// [`SpecError::Toml`] naming the key, its flag, the line and what would fix it. The result
    /// is not yet [validated](RunSpec::validate).
    ///
    /// ```
    /// use conveyor::RunSpec;
    /// use conveyor::schedules::ScheduleKind;
    ///
    /// let spec = RunSpec::from_toml_str("[pipeline]\nschedule = \"zb-h1\"\nmicrobatches = 4\n")?;
    /// assert_eq!(spec.pipeline.schedule, ScheduleKind::ZbH1);
    /// assert_eq!(spec.training.batch, RunSpec::default().training.batch);
    ///
    /// let error = RunSpec::from_toml_str("[pipeline]\nshedule = \"gpipe\"\n").unwrap_err();
    /// assert!(error.to_string().contains("pipeline.shedule"), "{error}");
    /// # Ok::<(), conveyor::spec::SpecError>(())
    /// ```
    pub fn from_toml_str(text: &str) -> Result<RunSpec, SpecError> {
        parse(text, "the run spec")
    }

    /// Reads a spec from a TOML file (at most [`MAX_SPEC_FILE_BYTES`]); errors name the path.
    ///
    /// ```
    /// use conveyor::RunSpec;
    ///
    /// // The default run, every key written out and explained.
    /// let spec = RunSpec::from_file("examples/run.toml")?;
    /// assert_eq!(spec, RunSpec::default());
    /// assert!(RunSpec::from_file("no/such/run.toml").unwrap_err().to_string().contains("no/such/run.toml"));
    /// # Ok::<(), conveyor::spec::SpecError>(())
    /// ```
    pub fn from_file(path: impl AsRef<Path>) -> Result<RunSpec, SpecError> {
        let path = path.as_ref();
        let unreadable = |reason: String| SpecError::Read { path: path.to_path_buf(), reason };
        let file = std::fs::File::open(path).map_err(|e| unreadable(e.to_string()))?;
        let mut bytes = Vec::new();
        file.take(MAX_SPEC_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(|e| unreadable(e.to_string()))?;
        if bytes.len() as u64 > MAX_SPEC_FILE_BYTES {
            return Err(unreadable(format!(
                "the file is over the limit of {MAX_SPEC_FILE_BYTES} bytes (MAX_SPEC_FILE_BYTES); a run spec is a page of TOML"
            )));
        }
        let text = String::from_utf8(bytes).map_err(|e| unreadable(format!("not UTF-8 text ({e})")))?;
        parse(&text, &path.display().to_string())
    }

    /// The spec a checkpoint was trained with: what `conveyor train --checkpoint` and a
    /// [`RunSpec::prepare`]d trainer's [`Trainer::checkpoint`](conveyor_engine::runtime::Trainer::checkpoint)
    /// store under `conveyor.spec` (without the run's output files). Reads the file's header only.
    ///
    /// ```
    /// use conveyor::RunSpec;
    ///
    /// let mut spec = RunSpec::default();
    /// spec.model.spec = Some("mlp:4,8,2".into());
    /// spec.data.source = "synthetic:32,4,2".into();
    /// spec.training.batch = 8;
    /// spec.pipeline.microbatches = 2;
    /// let mut run = spec.prepare()?;
    /// run.train_step(0)?;
    /// let path = std::env::temp_dir().join(format!("conveyor-doc-spec-{}.safetensors", std::process::id()));
    /// run.trainer.checkpoint(&path)?;
    /// assert_eq!(RunSpec::from_checkpoint(&path)?, run.spec.for_checkpoint());
    /// # std::fs::remove_file(&path).unwrap();
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn from_checkpoint(path: impl AsRef<Path>) -> Result<RunSpec, SpecError> {
        let path = path.as_ref();
        let metadata = conveyor_engine::checkpoint::read_metadata(path)?;
        let text = metadata
            .get(crate::cli_input::SPEC_KEY)
            .ok_or_else(|| SpecError::NoSpecInCheckpoint { path: path.to_path_buf() })?;
        parse(text, &format!("{} (conveyor.spec)", path.display()))
    }

    /// The spec as TOML: every value that is set, defaults included, so the text reads as the
    /// whole run; [`RunSpec::from_toml_str`] gives this spec back.
    ///
    /// ```
    /// use conveyor::RunSpec;
    ///
    /// let mut spec = RunSpec::default();
    /// spec.training.steps = Some(10);
    /// let text = spec.to_toml_string()?;
    /// assert!(text.contains("steps = 10"), "{text}");
    /// assert_eq!(RunSpec::from_toml_str(&text)?, spec);
    /// # Ok::<(), conveyor::spec::SpecError>(())
    /// ```
    pub fn to_toml_string(&self) -> Result<String, SpecError> {
        ::toml::to_string(self).map_err(|e| SpecError::Serialize { reason: e.to_string() })
    }
}

fn parse(text: &str, origin: &str) -> Result<RunSpec, SpecError> {
    let toml_error = |key: String, error: &::toml::de::Error| {
        let (line, column) = match error.span() {
            Some(span) => {
                let before = &text[..span.start.min(text.len())];
                let line = before.matches('\n').count() + 1;
                (Some(line), Some(before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1))
            }
            None => (None, None),
        };
        let flag = flag_of_key(&key);
        SpecError::Toml { origin: origin.to_string(), key, flag, line, column, message: error.message().to_string() }
    };
    let deserializer = ::toml::Deserializer::parse(text).map_err(|e| toml_error(String::new(), &e))?;
    serde_path_to_error::deserialize(deserializer).map_err(|e| toml_error(e.path().to_string(), e.inner()))
}

/// A typed value written in TOML as its name (`1f1b`, `except-last`, `skip:5`).
pub(super) trait SpecText: Sized {
    /// The value's name.
    fn to_text(&self) -> String;
    /// Parses a name; the error says what would fix it.
    fn from_text(text: &str) -> Result<Self, String>;
}

impl SpecText for ScheduleKind {
    fn to_text(&self) -> String {
        self.name().to_string()
    }
    fn from_text(text: &str) -> Result<Self, String> {
        text.parse().map_err(|e: conveyor_schedules::ScheduleError| e.to_string())
    }
}

/// An engine error's reason (its argument name dropped).
pub(super) fn reason(error: conveyor_engine::Error) -> String {
    match error {
        conveyor_engine::Error::InvalidArgument { reason, .. } => reason,
        other => other.to_string(),
    }
}

impl SpecText for Recompute {
    fn to_text(&self) -> String {
        match self {
            Recompute::Never => "never",
            Recompute::ExceptLast => "except-last",
            Recompute::Always => "always",
        }
        .to_string()
    }
    fn from_text(text: &str) -> Result<Self, String> {
        text.parse().map_err(reason)
    }
}

impl SpecText for CoreSlotPolicy {
    fn to_text(&self) -> String {
        match self {
            CoreSlotPolicy::Auto => "auto".to_string(),
            CoreSlotPolicy::Off => "off".to_string(),
            CoreSlotPolicy::Slots(n) => n.to_string(),
        }
    }
    fn from_text(text: &str) -> Result<Self, String> {
        text.parse().map_err(reason)
    }
}

impl SpecText for WeightCache {
    fn to_text(&self) -> String {
        self.name().to_string()
    }
    fn from_text(text: &str) -> Result<Self, String> {
        text.parse().map_err(reason)
    }
}

impl SpecText for super::OverlapSteps {
    fn to_text(&self) -> String {
        self.to_string()
    }
    fn from_text(text: &str) -> Result<Self, String> {
        text.parse().map_err(reason)
    }
}

impl SpecText for ReplicaShares {
    fn to_text(&self) -> String {
        self.to_string()
    }
    fn from_text(text: &str) -> Result<Self, String> {
        text.parse().map_err(reason)
    }
}

impl SpecText for BucketSize {
    fn to_text(&self) -> String {
        self.to_string()
    }
    fn from_text(text: &str) -> Result<Self, String> {
        text.parse().map_err(|e: crate::cli_input::UsageError| e.0)
    }
}

impl SpecText for LrSchedule {
    fn to_text(&self) -> String {
        self.to_string()
    }
    fn from_text(text: &str) -> Result<Self, String> {
        text.parse().map_err(|e: crate::cli_input::UsageError| e.0)
    }
}

impl SpecText for OnNonFinite {
    fn to_text(&self) -> String {
        match self {
            OnNonFinite::Error => "error".to_string(),
            OnNonFinite::Skip { max_in_a_row } => format!("skip:{max_in_a_row}"),
        }
    }
    fn from_text(text: &str) -> Result<Self, String> {
        text.parse().map_err(|e: crate::cli_input::UsageError| e.0)
    }
}

impl SpecText for Precision {
    fn to_text(&self) -> String {
        self.to_string()
    }
    fn from_text(text: &str) -> Result<Self, String> {
        text.parse()
    }
}

impl SpecText for OptimizerKind {
    fn to_text(&self) -> String {
        self.to_string()
    }
    fn from_text(text: &str) -> Result<Self, String> {
        text.parse()
    }
}

/// Serde by name ([`SpecText`]).
pub(super) mod text {
    use super::*;

    pub fn serialize<S: Serializer, T: SpecText>(value: &T, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&value.to_text())
    }

    pub fn deserialize<'de, D: Deserializer<'de>, T: SpecText>(deserializer: D) -> Result<T, D::Error> {
        let text = String::deserialize(deserializer)?;
        T::from_text(&text).map_err(serde::de::Error::custom)
    }
}

/// A count that may exceed TOML's signed 64-bit integers.
pub(super) trait Wide: Copy {
    fn to_u64(self) -> u64;
    fn from_u64(value: u64) -> Option<Self>;
}

impl Wide for u64 {
    fn to_u64(self) -> u64 {
        self
    }
    fn from_u64(value: u64) -> Option<Self> {
        Some(value)
    }
}

impl Wide for usize {
    fn to_u64(self) -> u64 {
        self as u64
    }
    fn from_u64(value: u64) -> Option<Self> {
        usize::try_from(value).ok()
    }
}

/// Serde of a count: a TOML integer, or above `i64::MAX` a string of digits (both read back).
pub(super) mod wide {
    use std::fmt;

    use serde::de::{Error, Visitor};

    use super::*;

    pub fn serialize<S: Serializer, T: Wide>(value: &T, serializer: S) -> Result<S::Ok, S::Error> {
        match i64::try_from(value.to_u64()) {
            Ok(small) => serializer.serialize_i64(small),
            Err(_) => serializer.serialize_str(&value.to_u64().to_string()),
        }
    }

    struct Count;

    impl Visitor<'_> for Count {
        type Value = u64;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a whole number of at least 0")
        }
        fn visit_i64<E: Error>(self, value: i64) -> Result<u64, E> {
            u64::try_from(value)
                .map_err(|_| E::custom(format!("{value} is negative; give a whole number of at least 0")))
        }
        fn visit_u64<E: Error>(self, value: u64) -> Result<u64, E> {
            Ok(value)
        }
        fn visit_str<E: Error>(self, text: &str) -> Result<u64, E> {
            text.trim().parse().map_err(|_| E::custom(format!("`{text}` is not a whole number; give one such as 8")))
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>, T: Wide>(deserializer: D) -> Result<T, D::Error> {
        let value = deserializer.deserialize_any(Count)?;
        T::from_u64(value).ok_or_else(|| D::Error::custom(format!("{value} is too large for this machine")))
    }
}

/// [`wide`] for an optional count (absent from the TOML when `None`).
pub(super) mod wide_opt {
    use super::*;

    pub fn serialize<S: Serializer, T: Wide>(value: &Option<T>, serializer: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(value) => wide::serialize(value, serializer),
            None => serializer.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>, T: Wide>(deserializer: D) -> Result<Option<T>, D::Error> {
        wide::deserialize(deserializer).map(Some)
    }
}

/// Serde of an optional size in bytes: written as `"2GiB"`, `"512MiB"`, `"4KiB"` when exact, else
/// a byte count; read from a size string ([`crate::cli_input::parse_size`]) or a byte count.
pub(super) mod size_opt {
    use std::fmt;

    use serde::de::{Error, Visitor};

    use super::*;

    pub fn serialize<S: Serializer>(value: &Option<u64>, serializer: S) -> Result<S::Ok, S::Error> {
        let Some(bytes) = *value else { return serializer.serialize_none() };
        match crate::cli_input::exact_size(bytes) {
            Some(text) => serializer.serialize_str(&text),
            None => wide::serialize(&bytes, serializer),
        }
    }

    struct Size;

    impl Visitor<'_> for Size {
        type Value = u64;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a size such as \"512MiB\" or a number of bytes")
        }
        fn visit_i64<E: Error>(self, value: i64) -> Result<u64, E> {
            u64::try_from(value)
                .ok()
                .filter(|&b| b > 0)
                .ok_or_else(|| E::custom(format!("{value} bytes: give a size of at least one byte, e.g. \"512MiB\"")))
        }
        fn visit_u64<E: Error>(self, value: u64) -> Result<u64, E> {
            self.visit_i64(i64::try_from(value).unwrap_or(i64::MAX))
        }
        fn visit_str<E: Error>(self, text: &str) -> Result<u64, E> {
            crate::cli_input::parse_size(text).map_err(|e| E::custom(e.0))
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
        deserializer.deserialize_any(Size).map(Some)
    }
}

/// Serde of a [`PlacementSpec`](super::PlacementSpec): `"auto"`, `"time"`, a file path, or an
/// array of stages, each an array of node names.
pub(super) mod placement {
    use std::fmt;

    use serde::de::{Error, SeqAccess, Visitor};
    use serde::ser::SerializeSeq;

    use super::super::PlacementSpec;
    use super::*;

    pub fn serialize<S: Serializer>(value: &PlacementSpec, serializer: S) -> Result<S::Ok, S::Error> {
        match value {
            PlacementSpec::Auto => serializer.serialize_str("auto"),
            PlacementSpec::Time => serializer.serialize_str("time"),
            PlacementSpec::File(path) => serializer.serialize_str(
                path.to_str().ok_or_else(|| serde::ser::Error::custom("a placement file path that is not UTF-8"))?,
            ),
            PlacementSpec::Manual(stages) => {
                let mut seq = serializer.serialize_seq(Some(stages.len()))?;
                for stage in stages {
                    seq.serialize_element(stage)?;
                }
                seq.end()
            }
        }
    }

    struct Placement;

    impl<'de> Visitor<'de> for Placement {
        type Value = PlacementSpec;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("\"auto\", \"time\", a placement file, or stages such as [[\"0\", \"1\"], [\"2..4\"]]")
        }
        fn visit_str<E: Error>(self, text: &str) -> Result<PlacementSpec, E> {
            Ok(PlacementSpec::from_text(text))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PlacementSpec, A::Error> {
            let mut stages: Vec<Vec<String>> = Vec::new();
            while let Some(stage) = seq.next_element::<Vec<String>>()? {
                if stage.is_empty() {
                    return Err(A::Error::custom(format!(
                        "stage {} lists no nodes; give each stage at least one node name",
                        stages.len()
                    )));
                }
                stages.push(stage);
            }
            if stages.is_empty() {
                return Err(A::Error::custom("no stages; list one array of node names per stage, or use \"auto\""));
            }
            if stages.len() > crate::limits::MAX_STAGES {
                return Err(A::Error::custom(format!(
                    "{} stages are over the limit of {} stages (MAX_STAGES)",
                    stages.len(),
                    crate::limits::MAX_STAGES
                )));
            }
            Ok(PlacementSpec::Manual(stages))
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<PlacementSpec, D::Error> {
        deserializer.deserialize_any(Placement)
    }
}
