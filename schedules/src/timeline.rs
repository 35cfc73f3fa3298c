//! `Timeline`: what each device did when, from a simulation or (filled by the engine) a measured
//! run, and the figures derived from it: makespan, busy time, bubble fraction, peak in-flight.
//!
//! **API Boundary**: runtime-neutral. Events carry device, stage, op, micro-batch and times in
//! seconds from the start of the step; nothing here knows whether they were simulated.
use serde::Serialize;

/// What an event records. Compute kinds count as busy time; the rest do not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    /// Forward pass.
    Forward,
    /// Input gradient (split backward's `B`).
    BackwardInput,
    /// Weight gradient (split backward's `W`).
    BackwardWeight,
    /// Fused backward (input and weight gradients).
    Backward,
    /// Optimizer step.
    OptimizerStep,
    /// A message in transit, recorded on the sending device (not compute).
    Send,
    /// A receive the device spent time in (not compute).
    Recv,
    /// The device idled waiting for an input (not compute).
    Wait,
    /// The device's op was ready but waited for a core slot, with more workers than cores (not
    /// compute).
    CoreWait,
    /// Recomputing a forward for activation checkpointing (compute).
    Recompute,
    /// The stage's gradients summed across data-parallel replicas before the optimizer step
    /// (communication, not compute).
    AllReduce,
}

impl OpKind {
    /// Whether time in this op counts as busy for the bubble fraction.
    pub fn is_compute(self) -> bool {
        matches!(
            self,
            OpKind::Forward
                | OpKind::BackwardInput
                | OpKind::BackwardWeight
                | OpKind::Backward
                | OpKind::OptimizerStep
                | OpKind::Recompute
        )
    }
}

/// One interval of one device's time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TimelineEvent {
    /// The device.
    #[serde(rename = "device")]
    pub device_idx: usize,
    /// The stage, where the op belongs to one.
    #[serde(rename = "stage")]
    pub stage_idx: Option<usize>,
    /// What happened.
    pub op: OpKind,
    /// The micro-batch, where the op belongs to one.
    #[serde(rename = "micro_batch")]
    pub micro_batch_idx: Option<usize>,
    /// Start, seconds.
    #[serde(rename = "start")]
    pub start_s: f64,
    /// End, seconds.
    #[serde(rename = "end")]
    pub end_s: f64,
}

impl TimelineEvent {
    /// `end_s - start_s`.
    pub fn duration_s(&self) -> f64 {
        self.end_s - self.start_s
    }
}

/// Every event of one optimizer step across `n_devices` devices.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Timeline {
    /// Devices in the pipeline.
    pub n_devices: usize,
    /// Stages in the pipeline.
    pub n_stages: usize,
    /// The events, in any order.
    pub events: Vec<TimelineEvent>,
}

impl Timeline {
    /// An empty timeline.
    pub fn new(n_devices: usize, n_stages: usize) -> Timeline {
        Timeline { n_devices, n_stages, events: Vec::new() }
    }

    /// Compute events, less optimizer steps that take no time: a cost model without an optimizer
    /// cost still places the step after the commit barrier, which must not stretch the makespan.
    fn compute_events(&self) -> impl Iterator<Item = &TimelineEvent> {
        self.events.iter().filter(|event| {
            event.op.is_compute() && !(event.op == OpKind::OptimizerStep && event.end_s <= event.start_s)
        })
    }

    /// Compute events and gradient all-reduces: what a step's span runs from and to.
    fn span_events(&self) -> impl Iterator<Item = &TimelineEvent> {
        self.compute_events().chain(self.events.iter().filter(|event| event.op == OpKind::AllReduce))
    }

    /// Time from the first compute start to the last compute end, seconds. A gradient all-reduce
    /// (data parallelism) ends a step as an op would: the span includes it.
    pub fn makespan_s(&self) -> f64 {
        let start = self.compute_events().map(|event| event.start_s).fold(f64::INFINITY, f64::min);
        let end = self.span_events().map(|event| event.end_s).fold(f64::NEG_INFINITY, f64::max);
        if end > start { end - start } else { 0.0 }
    }

    /// Seconds each device spent in compute ops, device 0 first.
    pub fn busy_s(&self) -> Vec<f64> {
        let mut busy = vec![0.0; self.n_devices];
        for event in self.compute_events() {
            busy[event.device_idx] += event.duration_s();
        }
        busy
    }

    /// Idle time over `n_devices * makespan`, counting only compute ops as busy.
    pub fn bubble_fraction(&self) -> f64 {
        let total = self.n_devices as f64 * self.makespan_s();
        if total == 0.0 { 0.0 } else { 1.0 - self.busy_s().iter().sum::<f64>() / total }
    }

    /// Idle time inside each device's own span (its first compute start to its last compute
    /// end), over the sum of those spans. This excludes the fill and drain offsets that a
    /// single step cannot avoid, and is the bubble that remains once consecutive steps overlap
    /// (Zero Bubble's "zero bubble" is zero in this sense).
    pub fn interior_bubble_fraction(&self) -> f64 {
        let mut spans = vec![(f64::INFINITY, f64::NEG_INFINITY); self.n_devices];
        for event in self.span_events() {
            let span = &mut spans[event.device_idx];
            span.0 = span.0.min(event.start_s);
            span.1 = span.1.max(event.end_s);
        }
        let total: f64 = spans.iter().filter(|(start, end)| end > start).map(|(start, end)| end - start).sum();
        if total == 0.0 { 0.0 } else { 1.0 - self.busy_s().iter().sum::<f64>() / total }
    }

    /// Peak number of micro-batches whose activations each stage holds, stage 0 first: +1 when
    /// a `Forward` starts, -1 when the micro-batch's last backward part (`BackwardWeight`, or
    /// the fused `Backward`) ends.
    pub fn peak_inflight(&self) -> Vec<usize> {
        peaks(&self.events, self.n_stages, |event| event.stage_idx)
    }

    /// Peak number of (micro-batch, stage) activation sets each device holds, device 0 first;
    /// the same counting as [`Timeline::peak_inflight`], summed over the device's stages.
    pub fn peak_inflight_per_device(&self) -> Vec<usize> {
        peaks(&self.events, self.n_devices, |event| Some(event.device_idx))
    }
}

fn peaks(events: &[TimelineEvent], n_keys: usize, key: impl Fn(&TimelineEvent) -> Option<usize>) -> Vec<usize> {
    // (key, time, delta); at equal times releases (-1) come before acquisitions (+1).
    let mut changes: Vec<(usize, f64, i64)> = events
        .iter()
        .filter_map(|event| {
            let key = key(event)?;
            match event.op {
                OpKind::Forward => Some((key, event.start_s, 1)),
                OpKind::BackwardWeight | OpKind::Backward => Some((key, event.end_s, -1)),
                _ => None,
            }
        })
        .collect();
    changes.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut peak = vec![0usize; n_keys];
    let mut current = vec![0i64; n_keys];
    for (key, _, delta) in changes {
        current[key] += delta;
        peak[key] = peak[key].max(current[key].max(0) as usize);
    }
    peak
}
