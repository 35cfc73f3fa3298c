//! The device grammar (see [`DeviceList`]): one syntax for devices by kind and ordinal, read by
//! [`Device::parse`], [`Device::parse_list`], the CLI's `--devices` and the run spec, and written
//! back by [`DeviceList`]'s `Display`.
//!
//! Parsing is in two steps: the text becomes [`DeviceId`]s (kind and ordinal, no device opened,
//! so the grammar is checked the same on every machine), which [`DeviceId::open`] turns into
//! [`Device`]s with a memory budget.
use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;

use super::{CudaDevice, Device};
use crate::{Error, Result};

/// The most devices a list may name (`--devices`, the run spec, [`Device::parse_list`]).
pub const MAX_DEVICES: usize = 1024;

/// A kind of device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceKind {
    /// A CPU core (`cpu`).
    Cpu,
    /// A CUDA GPU (`cuda`).
    Cuda,
}

impl DeviceKind {
    /// The kind's name in the grammar: `cpu` or `cuda`.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        }
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One of `count` logical devices that share one GPU (`cuda:0x4` names four): each is a worker
/// with its own stream and its own memory ledger, so a pipeline's stages, bubbles and memory plan
/// can be developed on one card.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LogicalSlice {
    /// Which one, `0..count`.
    pub index: usize,
    /// How many logical devices split the GPU.
    pub count: usize,
}

/// A device named by kind and ordinal (`cuda:1`), or a logical device on a GPU (`cuda:0x4#1`),
/// before it is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId {
    /// CPU or CUDA.
    pub kind: DeviceKind,
    /// The index among devices of that kind.
    pub ordinal: usize,
    /// For a logical device, which share of the GPU it is; `None` for a whole device.
    pub slice: Option<LogicalSlice>,
}

impl DeviceId {
    /// CPU device `ordinal`.
    pub fn cpu(ordinal: usize) -> DeviceId {
        DeviceId { kind: DeviceKind::Cpu, ordinal, slice: None }
    }

    /// CUDA device `ordinal`.
    pub fn cuda(ordinal: usize) -> DeviceId {
        DeviceId { kind: DeviceKind::Cuda, ordinal, slice: None }
    }

    /// Logical device `index` of `count` on CUDA device `ordinal` (`cuda:ORDINALxCOUNT#INDEX`).
    pub fn cuda_logical(ordinal: usize, index: usize, count: usize) -> DeviceId {
        DeviceId { kind: DeviceKind::Cuda, ordinal, slice: Some(LogicalSlice { index, count }) }
    }

    /// Opens the device with a memory budget; an error for a CUDA device in a build without the
    /// `cuda` feature or on a machine without a driver. Without a budget a CPU device is
    /// unlimited, a GPU gets the memory free on it when opened (`cuMemGetInfo`), and a logical
    /// device that free memory divided by the logical devices sharing the GPU.
    pub fn open(self, budget_bytes: Option<u64>) -> Result<Device> {
        match (self.kind, self.slice) {
            (DeviceKind::Cpu, _) => Ok(Device::cpu_with_budget(self.ordinal, budget_bytes)),
            (DeviceKind::Cuda, slice) => {
                Ok(Device::Cuda(CudaDevice::with_free_memory_budget(self.ordinal, budget_bytes, slice)?))
            }
        }
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.kind, self.ordinal)?;
        if let Some(LogicalSlice { index, count }) = self.slice {
            write!(f, "x{count}#{index}")?;
        }
        Ok(())
    }
}

impl FromStr for DeviceId {
    type Err = Error;
    /// One device, `kind:N` (as [`Device::parse`], without opening it).
    fn from_str(text: &str) -> Result<DeviceId> {
        let ids = parse_ids(text, false)?;
        match ids.as_slice() {
            [id] => Ok(*id),
            _ => Err(list_error(text, None, DeviceListProblem::NotOne { count: ids.len() })),
        }
    }
}

/// What is wrong with a device list ([`Error::InvalidDeviceList`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeviceListProblem {
    /// The text names no device at all.
    Empty,
    /// An item between commas is empty (`cpu:0,,cpu:1`).
    EmptyItem,
    /// The first item has no kind (`0,1`, `cpu`).
    MissingKind {
        /// The item as written.
        text: String,
    },
    /// The kind is neither `cpu` nor `cuda`.
    UnknownKind {
        /// The kind as written.
        kind: String,
    },
    /// An ordinal is not a non-negative integer.
    BadOrdinal {
        /// The ordinal as written.
        text: String,
    },
    /// The count of the `cpu:N` shorthand is not a positive integer.
    BadCount {
        /// The count as written.
        text: String,
    },
    /// The `cpu:N` shorthand with N = 0.
    NoDevices,
    /// The count of the `cpu:N` shorthand is over [`MAX_DEVICES`].
    CountOverLimit {
        /// The count asked for (saturated at `u64::MAX`).
        count: u64,
        /// [`MAX_DEVICES`].
        limit: usize,
    },
    /// A range `N-M` with M < N.
    ReversedRange {
        /// N.
        first: usize,
        /// M.
        last: usize,
    },
    /// A device is named twice.
    Duplicate {
        /// The device.
        device: DeviceId,
    },
    /// The list names more devices than [`MAX_DEVICES`].
    TooMany {
        /// Devices named (saturated at `usize::MAX`).
        count: usize,
        /// [`MAX_DEVICES`].
        limit: usize,
    },
    /// One device was asked for ([`Device::parse`]) but the text names another number.
    NotOne {
        /// Devices named.
        count: usize,
    },
    /// A logical split (`xK`, `xK#I`) is malformed: K not from 1 to [`MAX_DEVICES`], I not below
    /// K, or `#I` after a range.
    BadSplit {
        /// The split as written.
        text: String,
    },
    /// A CPU device split into logical devices (`cpu:0x2`); CPU devices are cores already.
    SplitCpu,
    /// One GPU named both whole and split, or split two ways (`cuda:0,cuda:0x2`).
    SplitConflict {
        /// The GPU's ordinal.
        ordinal: usize,
    },
}

impl fmt::Display for DeviceListProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceListProblem::Empty => f.write_str("no device is named; write e.g. cpu:4, cpu:0-3, cuda:0,1"),
            DeviceListProblem::EmptyItem => {
                f.write_str("an item between commas is empty; separate devices with one comma")
            }
            DeviceListProblem::MissingKind { text } => {
                write!(f, "`{text}` does not say its kind; write kind:N, e.g. cpu:0 or cuda:1")
            }
            DeviceListProblem::UnknownKind { kind } => {
                write!(f, "unknown device kind `{kind}`; use cpu:N or cuda:N")
            }
            DeviceListProblem::BadOrdinal { text } => {
                write!(f, "`{text}` is not a device index; write e.g. cpu:0, cuda:1 or cpu:0-3")
            }
            DeviceListProblem::BadCount { text } => {
                write!(f, "`{text}` is not a positive integer; give cpu:N with N from 1 to {MAX_DEVICES} CPU devices")
            }
            DeviceListProblem::NoDevices => {
                write!(f, "at least one device is needed; give cpu:N with N from 1 to {MAX_DEVICES}")
            }
            DeviceListProblem::CountOverLimit { count, limit } => write!(
                f,
                "{count} is over the limit of {limit} (MAX_DEVICES); give cpu:N with N from 1 to {limit} CPU devices"
            ),
            DeviceListProblem::ReversedRange { first, last } => {
                write!(f, "the range {first}-{last} runs backwards; write the smaller ordinal first ({last}-{first})")
            }
            DeviceListProblem::Duplicate { device } => write!(f, "{device} is listed twice; list each device once"),
            DeviceListProblem::TooMany { count, limit } => {
                write!(f, "{count} devices are over the limit of {limit} devices (MAX_DEVICES)")
            }
            DeviceListProblem::NotOne { count } => {
                write!(f, "{count} devices named where one is needed; write one device such as cuda:1")
            }
            DeviceListProblem::BadSplit { text } => write!(
                f,
                "`{text}` is not a logical split; write cuda:NxK for K logical devices on GPU N (K from 1 to \
                 {MAX_DEVICES}), or cuda:NxK#I for the one numbered I (I below K)"
            ),
            DeviceListProblem::SplitCpu => {
                f.write_str("only GPUs split into logical devices (cuda:0x4); for N CPU devices write cpu:N or cpu:0-3")
            }
            DeviceListProblem::SplitConflict { ordinal } => write!(
                f,
                "cuda:{ordinal} is named both whole and split, or split two ways; name it once, as cuda:{ordinal} or \
                 cuda:{ordinal}xK"
            ),
        }
    }
}

fn list_error(text: &str, item_idx: Option<usize>, problem: DeviceListProblem) -> Error {
    Error::InvalidDeviceList { text: text.to_string(), item_idx, problem }
}

/// A list of devices by kind and ordinal: [`FromStr`] reads the grammar, `Display` writes the
/// canonical form, which reads back to the same list.
///
/// ```text
/// list     := item ("," item)*
/// item     := kind ":" ordinals     e.g. cpu:0, cuda:1, cpu:0-3
///           | ordinals              an item without a kind takes the previous item's: cuda:0,1
/// ordinals := (N | N "-" M) split?  M >= N: the devices N, N+1, ..., M
/// split    := "x" K                 GPUs only: each GPU as K logical devices (cuda:0x4)
///           | "x" K "#" I           the logical device I of K (cuda:0x4#1), one GPU only
/// kind     := "cpu" | "cuda"
/// ```
///
/// A logical device is a worker with its own stream and memory ledger on a shared GPU (see
/// [`LogicalSlice`]); without a budget each gets the GPU's free memory divided by K. A GPU is
/// named whole or split one way, not both.
///
/// One shorthand, the CLI's since its first version: a list that is exactly one `cpu:N` means
/// N CPU devices, `cpu:0` to `cpu:N-1` (`--devices cpu:4`). To name the one device `cpu:3` in a
/// list write `cpu:3-3`; `cuda:N` alone is the one device `cuda:N`. [`Device::parse`] reads a
/// single device and has no shorthand: `cpu:3` is `cpu:3`. At most [`MAX_DEVICES`] devices, each
/// named once. Spaces around items, colons and dashes are ignored.
///
/// ```
/// use conveyor_engine::device::DeviceList;
///
/// let list: DeviceList = "cpu:0-1,cuda:0,1".parse()?;
/// assert_eq!(list.to_string(), "cpu:0-1,cuda:0-1");
/// assert_eq!("cpu:4".parse::<DeviceList>()?.to_string(), "cpu:4");
/// // One CPU device other than cpu:0 is written as a range, so it does not read as a count.
/// let lone: DeviceList = "cpu:3-3".parse()?;
/// assert_eq!(lone.to_string(), "cpu:3-3");
/// assert_eq!(lone.to_string().parse::<DeviceList>()?, lone);
/// // One GPU as four logical devices (a 4-stage pipeline on one card).
/// let split: DeviceList = "cuda:0x4".parse()?;
/// assert_eq!(split.0.len(), 4);
/// assert_eq!(split.0[1].to_string(), "cuda:0x4#1");
/// assert_eq!(split.to_string(), "cuda:0x4");
/// assert!("cuda:0,cuda:0x2".parse::<DeviceList>().is_err());
/// # Ok::<(), conveyor_engine::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct DeviceList(pub Vec<DeviceId>);

impl DeviceList {
    /// The ids of opened devices (the host, which has none, is left out).
    pub fn of(devices: &[Device]) -> DeviceList {
        DeviceList(devices.iter().filter_map(Device::id).collect())
    }

    /// Opens every device with the same budget (none: unlimited).
    pub fn open(&self, budget_bytes: Option<u64>) -> Result<Vec<Device>> {
        self.0.iter().map(|id| id.open(budget_bytes)).collect()
    }
}

impl FromStr for DeviceList {
    type Err = Error;
    fn from_str(text: &str) -> Result<DeviceList> {
        parse_ids(text, true).map(DeviceList)
    }
}

impl fmt::Display for DeviceList {
    /// Runs of consecutive ordinals of one kind as `kind:N-M`, others as `kind:N`, comma-separated;
    /// `cpu:0` to `cpu:N-1` as the shorthand `cpu:N`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids = &self.0;
        let is_cpu_count = !ids.is_empty() && ids.iter().enumerate().all(|(i, id)| *id == DeviceId::cpu(i));
        if is_cpu_count {
            return write!(f, "cpu:{}", ids.len());
        }
        // Logical devices: a whole split in order as `cuda:NxK`, others one by one.
        if ids.iter().any(|id| id.slice.is_some()) {
            let mut i = 0;
            while i < ids.len() {
                if i > 0 {
                    f.write_str(",")?;
                }
                let id = ids[i];
                let whole_split = id.slice.is_some_and(|slice| {
                    slice.index == 0
                        && (0..slice.count)
                            .all(|k| ids.get(i + k) == Some(&DeviceId::cuda_logical(id.ordinal, k, slice.count)))
                });
                match id.slice {
                    Some(slice) if whole_split => {
                        write!(f, "{}:{}x{}", id.kind, id.ordinal, slice.count)?;
                        i += slice.count;
                    }
                    // A lone `cpu:N` would read as N devices: a CPU device is written as a range.
                    None if id.kind == DeviceKind::Cpu => {
                        write!(f, "{}:{}-{}", id.kind, id.ordinal, id.ordinal)?;
                        i += 1;
                    }
                    _ => {
                        write!(f, "{id}")?;
                        i += 1;
                    }
                }
            }
            return Ok(());
        }
        let mut runs: Vec<(DeviceKind, usize, usize)> = Vec::new();
        for id in ids {
            match runs.last_mut() {
                Some((kind, _, last)) if *kind == id.kind && id.ordinal.checked_sub(1) == Some(*last) => {
                    *last = id.ordinal
                }
                _ => runs.push((id.kind, id.ordinal, id.ordinal)),
            }
        }
        // A lone `cpu:N` would read as N devices: write the one device as a range.
        let lone_cpu = matches!(runs.as_slice(), [(DeviceKind::Cpu, _, _)]);
        for (i, (kind, first, last)) in runs.into_iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            if first == last && !lone_cpu {
                write!(f, "{kind}:{first}")?;
            } else {
                write!(f, "{kind}:{first}-{last}")?;
            }
        }
        Ok(())
    }
}

/// An item's ordinals before expansion: kind and inclusive range.
struct Run {
    kind: DeviceKind,
    first: usize,
    last: usize,
    /// `xK` (count) and `#I` (one index) of a logical split.
    split: Option<(usize, Option<usize>)>,
    item_idx: usize,
}

/// The split suffix after `x` (`K` or `K#I`): the count and the index if any.
fn parse_split(text: &str) -> Option<(usize, Option<usize>)> {
    let (count, index) = match text.split_once('#') {
        Some((count, index)) => (count, Some(parse_ordinal(index)?)),
        None => (text, None),
    };
    let count = parse_ordinal(count).filter(|&k| (1..=MAX_DEVICES).contains(&k))?;
    index.is_none_or(|i| i < count).then_some((count, index))
}

/// A device index: digits only, below `usize::MAX` (which marks the host).
fn parse_ordinal(text: &str) -> Option<usize> {
    let text = text.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok().filter(|&n| n != usize::MAX)
}

/// Parses the grammar into ids; `shorthand` reads a lone `cpu:N` as N devices. Each item is
/// parsed before any is expanded, so a hostile range costs nothing before the count is checked.
fn parse_ids(text: &str, shorthand: bool) -> Result<Vec<DeviceId>> {
    let err = |item_idx: Option<usize>, problem| list_error(text, item_idx, problem);
    if text.trim().is_empty() {
        return Err(err(None, DeviceListProblem::Empty));
    }
    let items: Vec<&str> = text.split(',').map(str::trim).collect();
    let mut runs: Vec<Run> = Vec::with_capacity(items.len());
    let mut kind: Option<DeviceKind> = None;
    for (item_idx, item) in items.iter().enumerate() {
        if item.is_empty() {
            return Err(err(Some(item_idx), DeviceListProblem::EmptyItem));
        }
        let ordinals = match item.split_once(':') {
            Some((name, ordinals)) => {
                kind = Some(match name.trim() {
                    "cpu" => DeviceKind::Cpu,
                    "cuda" => DeviceKind::Cuda,
                    other => {
                        let problem = DeviceListProblem::UnknownKind { kind: other.to_string() };
                        return Err(err(Some(item_idx), problem));
                    }
                });
                ordinals.trim()
            }
            None => item,
        };
        let Some(kind) = kind else {
            return Err(err(Some(item_idx), DeviceListProblem::MissingKind { text: item.to_string() }));
        };
        let (ordinals, split) = match ordinals.split_once('x').filter(|(ordinals, _)| !ordinals.trim().is_empty()) {
            Some((ordinals, split_text)) => {
                if kind == DeviceKind::Cpu {
                    return Err(err(Some(item_idx), DeviceListProblem::SplitCpu));
                }
                let split = parse_split(split_text).ok_or_else(|| {
                    err(Some(item_idx), DeviceListProblem::BadSplit { text: format!("x{}", split_text.trim()) })
                })?;
                (ordinals.trim(), Some(split))
            }
            None => (ordinals, None),
        };
        let (first_text, last_text) = match ordinals.split_once('-') {
            Some((first, last)) => (first, Some(last)),
            None => (ordinals, None),
        };
        let is_range =
            last_text.is_some_and(|last| parse_ordinal(first_text).is_some() && parse_ordinal(last).is_some());
        if shorthand && items.len() == 1 && kind == DeviceKind::Cpu && !is_range && split.is_none() {
            return cpu_count(ordinals).map_err(|problem| err(Some(0), problem));
        }
        let ordinal = |text: &str| {
            parse_ordinal(text)
                .ok_or_else(|| err(Some(item_idx), DeviceListProblem::BadOrdinal { text: text.trim().to_string() }))
        };
        let first = ordinal(first_text)?;
        let last = last_text.map_or(Ok(first), ordinal)?;
        if last < first {
            return Err(err(Some(item_idx), DeviceListProblem::ReversedRange { first, last }));
        }
        if let Some((count, Some(_))) = split
            && first != last
        {
            let problem = DeviceListProblem::BadSplit { text: format!("{first}-{last}x{count}#...") };
            return Err(err(Some(item_idx), problem));
        }
        runs.push(Run { kind, first, last, split, item_idx });
    }
    let per_device = |r: &Run| match r.split {
        Some((count, None)) => count,
        _ => 1,
    };
    let count = runs
        .iter()
        .fold(0usize, |n, r| n.saturating_add((r.last - r.first).saturating_add(1).saturating_mul(per_device(r))));
    if count > MAX_DEVICES {
        return Err(err(None, DeviceListProblem::TooMany { count, limit: MAX_DEVICES }));
    }
    let mut seen = HashSet::with_capacity(count);
    // How each GPU is named: whole (`None`) or split `Some(K)` ways; one way per GPU.
    let mut split_of: std::collections::HashMap<(DeviceKind, usize), Option<usize>> = Default::default();
    let mut ids = Vec::with_capacity(count);
    for run in runs {
        for ordinal in run.first..=run.last {
            let count = run.split.map(|(count, _)| count);
            if *split_of.entry((run.kind, ordinal)).or_insert(count) != count {
                return Err(err(Some(run.item_idx), DeviceListProblem::SplitConflict { ordinal }));
            }
            let expanded: Vec<DeviceId> = match run.split {
                None => vec![DeviceId { kind: run.kind, ordinal, slice: None }],
                Some((count, Some(index))) => vec![DeviceId::cuda_logical(ordinal, index, count)],
                Some((count, None)) => (0..count).map(|index| DeviceId::cuda_logical(ordinal, index, count)).collect(),
            };
            for id in expanded {
                if !seen.insert(id) {
                    return Err(err(Some(run.item_idx), DeviceListProblem::Duplicate { device: id }));
                }
                ids.push(id);
            }
        }
    }
    Ok(ids)
}

/// The `cpu:N` shorthand: N CPU devices.
fn cpu_count(text: &str) -> std::result::Result<Vec<DeviceId>, DeviceListProblem> {
    let text = text.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(DeviceListProblem::BadCount { text: text.to_string() });
    }
    let count = text.parse::<u64>().unwrap_or(u64::MAX);
    if count == 0 {
        return Err(DeviceListProblem::NoDevices);
    }
    if count > MAX_DEVICES as u64 {
        return Err(DeviceListProblem::CountOverLimit { count, limit: MAX_DEVICES });
    }
    Ok((0..count as usize).map(DeviceId::cpu).collect())
}

impl Device {
    /// Parses one device, `kind:N`: `cpu:0`, `cuda:1` (see [`DeviceList`] for the grammar), and opens it
    /// without a memory budget. A list or range naming several devices is an error.
    ///
    /// ```
    /// use conveyor_engine::Device;
    ///
    /// let device = Device::parse("cpu:2")?;
    /// assert_eq!(device.to_string(), "cpu:2");
    /// assert!(Device::parse("tpu:0").is_err());
    /// assert!(Device::parse("cpu:0,cpu:1").is_err());
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn parse(text: &str) -> Result<Device> {
        Device::parse_with_budget(text, None)
    }

    /// [`Device::parse`] with a memory budget in bytes (none: unlimited).
    pub fn parse_with_budget(text: &str, budget_bytes: Option<u64>) -> Result<Device> {
        text.parse::<DeviceId>()?.open(budget_bytes)
    }

    /// Parses a list of devices (see [`DeviceList`] for the grammar) and opens them without memory
    /// budgets: `cpu:0-3`, `cpu:0,cuda:0`, `cuda:0,1`, and the CLI's shorthand `cpu:4` for four
    /// CPU devices `cpu:0` to `cpu:3`. At most [`MAX_DEVICES`], each named once; every problem is
    /// an [`Error::InvalidDeviceList`] saying which item is wrong and how
    /// ([`DeviceListProblem`]).
    ///
    /// ```
    /// use conveyor_engine::Device;
    ///
    /// let names = |text| -> conveyor_engine::Result<Vec<String>> {
    ///     Ok(Device::parse_list(text)?.iter().map(ToString::to_string).collect())
    /// };
    /// assert_eq!(names("cpu:4")?, ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]);
    /// assert_eq!(names("cpu:1-2,cpu:5")?, ["cpu:1", "cpu:2", "cpu:5"]);
    /// assert_eq!(names("cpu:0,1")?, ["cpu:0", "cpu:1"]);
    /// assert!(Device::parse_list("cpu:0,cpu:0").is_err()); // listed twice
    /// assert!(Device::parse_list("cpu:3-1").is_err()); // a range backwards
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn parse_list(text: &str) -> Result<Vec<Device>> {
        Device::parse_list_with_budget(text, None)
    }

    /// [`Device::parse_list`] with the same memory budget in bytes for every device (none:
    /// unlimited).
    pub fn parse_list_with_budget(text: &str, budget_bytes: Option<u64>) -> Result<Vec<Device>> {
        text.parse::<DeviceList>()?.open(budget_bytes)
    }

    /// The device's kind and ordinal; `None` for the host ([`Device::host`]), which has none.
    pub fn id(&self) -> Option<DeviceId> {
        match self {
            Device::Cpu(cpu) if cpu.ordinal == usize::MAX => None,
            Device::Cpu(cpu) => Some(DeviceId::cpu(cpu.ordinal)),
            Device::Cuda(cuda) => Some(match cuda.logical_slice() {
                Some(slice) => DeviceId::cuda_logical(cuda.ordinal(), slice.index, slice.count),
                None => DeviceId::cuda(cuda.ordinal()),
            }),
        }
    }
}

#[cfg(test)]
#[path = "list_tests.rs"]
mod tests;
