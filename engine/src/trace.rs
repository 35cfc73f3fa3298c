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
        _ => return None,
    })
}

/// Sentinel for "no stage" / "no micro-batch" in span fields (tracing fields cannot be absent
/// per call site without `Option` support in every subscriber).
pub const NONE_FIELD: u64 = u64::MAX;

#[derive(Default)]
struct OpFields {
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
}

impl TimelineRecorder {
    /// A recorder whose times count from now, and the layer that feeds it.
    pub fn new() -> (TimelineRecorder, TimelineLayer) {
        let recorder = TimelineRecorder { origin: Instant::now(), events: Arc::new(Mutex::new(Vec::new())) };
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
    }
}

/// The `tracing-subscriber` layer that records op spans into a [`TimelineRecorder`].
pub struct TimelineLayer {
    recorder: TimelineRecorder,
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for TimelineLayer {
    fn enabled(&self, metadata: &tracing::Metadata<'_>, _ctx: Context<'_, S>) -> bool {
        metadata.target() == OP_TARGET
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
