//! Timeline capture through `tracing`: the runtime opens one span per executed op (target
//! [`OP_TARGET`], fields `device`, `stage`, `op`, `micro_batch`), and [`TimelineLayer`], a
//! `tracing-subscriber` layer, turns those spans into the same [`Timeline`] the simulator
//! produces. With no subscriber interested in the target, the spans cost a disabled-callsite
//! check and nothing is recorded.
use std::sync::Arc;
use std::time::Instant;

use conveyor_schedules::{OpKind, Timeline, TimelineEvent};
use parking_lot::Mutex;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::{Subscriber, span};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

/// The `tracing` target of op spans.
pub const OP_TARGET: &str = "conveyor::op";

/// The `tracing` target of memory samples: events with fields `device` and `bytes` (in use on
/// the device), emitted by the runtime after every op.
pub const MEMORY_TARGET: &str = "conveyor::memory";

/// Bytes in use on one device at one time (seconds from the recorder's origin).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryPoint {
    /// The device.
    pub device_idx: usize,
    /// Seconds from the recorder's origin.
    pub time_s: f64,
    /// Bytes in use.
    pub bytes: u64,
}

/// The name an op kind carries in span fields.
pub fn op_name(op: OpKind) -> &'static str {
    match op {
        OpKind::Forward => "forward",
        OpKind::BackwardInput => "backward_input",
        OpKind::BackwardWeight => "backward_weight",
        OpKind::Backward => "backward",
        OpKind::OptimizerStep => "optimizer_step",
        OpKind::Recompute => "recompute",
        OpKind::Send => "send",
        OpKind::Recv => "recv",
        OpKind::Wait => "wait",
        OpKind::CoreWait => "core_wait",
        OpKind::AllReduce => "all_reduce",
    }
}

fn op_from_name(name: &str) -> Option<OpKind> {
    Some(match name {
        "forward" => OpKind::Forward,
        "backward_input" => OpKind::BackwardInput,
        "backward_weight" => OpKind::BackwardWeight,
        "backward" => OpKind::Backward,
        "optimizer_step" => OpKind::OptimizerStep,
        "recompute" => OpKind::Recompute,
        "send" => OpKind::Send,
        "recv" => OpKind::Recv,
        "wait" => OpKind::Wait,
        "core_wait" => OpKind::CoreWait,
        "all_reduce" => OpKind::AllReduce,
        _ => return None,
    })
}

/// Sentinel for "no stage" / "no micro-batch" in span fields (tracing fields cannot be absent
/// per call site without `Option` support in every subscriber).
pub const NONE_FIELD: u64 = u64::MAX;

#[derive(Default)]
struct OpFields {
    bytes: Option<u64>,
    device: Option<u64>,
    stage: Option<u64>,
    micro_batch: Option<u64>,
    op: Option<OpKind>,
}

impl Visit for OpFields {
    fn record_u64(&mut self, field: &Field, value: u64) {
        let value = (value != NONE_FIELD).then_some(value);
        match field.name() {
            "device" => self.device = value,
            "stage" => self.stage = value,
            "micro_batch" => self.micro_batch = value,
            "bytes" => self.bytes = value,
            _ => {}
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.record_u64(field, value as u64);
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "op" {
            self.op = op_from_name(value);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "op" {
            self.op = op_from_name(format!("{value:?}").trim_matches('"'));
        }
    }
}

struct OpSpan {
    fields: OpFields,
    entered: Option<Instant>,
}

/// Collected events, shared between the layer and whoever reads them.
#[derive(Clone)]
pub struct TimelineRecorder {
    origin: Instant,
    events: Arc<Mutex<Vec<TimelineEvent>>>,
    memory: Arc<Mutex<Vec<MemoryPoint>>>,
}

impl TimelineRecorder {
    /// A recorder whose times count from now, and the layer that feeds it.
    pub fn new() -> (TimelineRecorder, TimelineLayer) {
        let recorder = TimelineRecorder {
            origin: Instant::now(),
            events: Arc::new(Mutex::new(Vec::new())),
            memory: Arc::new(Mutex::new(Vec::new())),
        };
        (recorder.clone(), TimelineLayer { recorder })
    }

    /// Everything recorded so far as a timeline of `n_devices` devices and `n_stages` stages.
    pub fn timeline(&self, n_devices: usize, n_stages: usize) -> Timeline {
        let mut timeline = Timeline::new(n_devices, n_stages);
        let mut events = self.events.lock().clone();
        events.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
        timeline.events = events;
        timeline
    }

    /// The events that started in `since_s..until_s`, shifted so `since_s` is time zero (one
    /// step of a longer run).
    pub fn timeline_window(&self, since_s: f64, until_s: f64, n_devices: usize, n_stages: usize) -> Timeline {
        let mut timeline = self.timeline(n_devices, n_stages);
        timeline.events.retain(|e| e.start_s >= since_s && e.start_s < until_s);
        for e in &mut timeline.events {
            e.start_s -= since_s;
            e.end_s -= since_s;
        }
        timeline
    }

    /// Seconds from the recorder's origin until now.
    pub fn now_s(&self) -> f64 {
        self.origin.elapsed().as_secs_f64()
    }

    /// Memory samples recorded so far, in time order.
    pub fn memory(&self) -> Vec<MemoryPoint> {
        let mut points = self.memory.lock().clone();
        points.sort_by(|a, b| a.time_s.total_cmp(&b.time_s));
        points
    }

    /// Takes everything recorded so far, leaving the recorder empty: the events in start order
    /// and the memory samples in time order. A long run drains after every step and streams what
    /// it took to a file (`conveyor train --trace`), so the recorder holds one step at a time
    /// however long the run.
    pub fn drain(&self) -> (Vec<TimelineEvent>, Vec<MemoryPoint>) {
        let mut events = std::mem::take(&mut *self.events.lock());
        let mut points = std::mem::take(&mut *self.memory.lock());
        events.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
        points.sort_by(|a, b| a.time_s.total_cmp(&b.time_s));
        (events, points)
    }

    /// Number of events recorded.
    pub fn len(&self) -> usize {
        self.events.lock().len()
    }

    /// True when nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets everything recorded so far.
    pub fn clear(&self) {
        self.events.lock().clear();
        self.memory.lock().clear();
    }
}

/// A per-layer filter that passes only op spans and memory samples: put it on the
/// [`TimelineLayer`] (`layer.with_filter(timeline_filter())`) so that adding the layer enables
/// nothing else, whatever other layers log.
pub fn timeline_filter() -> tracing_subscriber::filter::FilterFn {
    tracing_subscriber::filter::filter_fn(|metadata| {
        metadata.target() == OP_TARGET || metadata.target() == MEMORY_TARGET
    })
}

/// The `tracing-subscriber` layer that records op spans into a [`TimelineRecorder`].
pub struct TimelineLayer {
    recorder: TimelineRecorder,
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for TimelineLayer {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        if event.metadata().target() != MEMORY_TARGET {
            return;
        }
        let mut fields = OpFields::default();
        event.record(&mut fields);
        if let (Some(device), Some(bytes)) = (fields.device, fields.bytes) {
            let time_s = self.recorder.origin.elapsed().as_secs_f64();
            self.recorder.memory.lock().push(MemoryPoint { device_idx: device as usize, time_s, bytes });
        }
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if attrs.metadata().target() != OP_TARGET {
            return;
        }
        let mut fields = OpFields::default();
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(OpSpan { fields, entered: None });
        }
    }

    fn on_enter(&self, id: &span::Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(op) = span.extensions_mut().get_mut::<OpSpan>()
        {
            op.entered = Some(Instant::now());
        }
    }

    fn on_exit(&self, id: &span::Id, ctx: Context<'_, S>) {
        let end = Instant::now();
        let Some(span) = ctx.span(id) else { return };
        let extensions = span.extensions();
        let Some(op) = extensions.get::<OpSpan>() else { return };
        let (Some(start), Some(kind), Some(device)) = (op.entered, op.fields.op, op.fields.device) else { return };
        let origin = self.recorder.origin;
        self.recorder.events.lock().push(TimelineEvent {
            device_idx: device as usize,
            stage_idx: op.fields.stage.map(|s| s as usize),
            op: kind,
            micro_batch_idx: op.fields.micro_batch.map(|m| m as usize),
            start_s: start.saturating_duration_since(origin).as_secs_f64(),
            end_s: end.saturating_duration_since(origin).as_secs_f64(),
        });
    }
}
