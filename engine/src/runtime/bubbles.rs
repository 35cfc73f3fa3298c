//! The bubble report (API Boundary): measured steps set beside schedule theory and beside the
//! simulator fed each step's measured op costs, per device busy, idle and waiting time, and what
//! explains the gap between the measured bubble and theory. [`StepReport::bubbles`] reports one
//! step, [`Trainer::bubbles`] and [`bubbles_over`] average several (one step's figures move by
//! several points); `conveyor train` prints [`BubbleReport`]'s `Display`.
//!
//! The simulator is given the machine the steps ran on ([`CostBasis`]): with core slots, the
//! measured op times queued for the slots with the measured wake-up latency; with more workers
//! than cores and no slots, each op's thread CPU time on cores the operating system shares; with a
//! core per worker, the measured op times with messages delivered after the measured mean
//! latency (chiefly the operating system waking the sleeping receiver).
use std::fmt;

use conveyor_schedules::{Cores, CostModel, Link, OpKind, Schedule, StageCosts, Timeline, simulate, simulate_on};

use super::measured_costs::{cpu_costs, delivery_latency_s, measured_costs, span_costs};
use super::{StepReport, Trainer};
use crate::placement::format_bytes;
use crate::{Error, Result};

/// The machine model the simulator ran a measured step's op costs on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CostBasis {
    /// A core per worker: the measured op times (each op occupying its device until its next
    /// event), messages delivered after the measured mean delivery latency.
    Delivery {
        /// Mean seconds from a message's send to its receiver running.
        latency_s: f64,
    },
    /// Compute ops took turns on core slots: the measured op times, queued first come first served.
    CoreSlots {
        /// Slots the workers shared.
        n_slots: usize,
        /// Mean seconds from a slot's handover to the sleeping worker running.
        wake_latency_s: f64,
    },
    /// More workers than cores, without slots: each op's thread CPU time, the cores shared by the
    /// operating system.
    SharedCores {
        /// Cores of the machine.
        n_cores: usize,
    },
}

impl CostBasis {
    /// The cores the simulator gave the devices.
    pub fn cores(&self) -> Cores {
        match *self {
            CostBasis::Delivery { .. } => Cores::OnePerDevice,
            CostBasis::CoreSlots { n_slots, wake_latency_s } => Cores::Slots { n_slots, wake_latency_s },
            CostBasis::SharedCores { n_cores } => Cores::Shared { n_cores },
        }
    }
}

impl fmt::Display for CostBasis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            CostBasis::Delivery { latency_s } => write!(f, "measured op times, {:.2} ms delivery", latency_s * 1e3),
            CostBasis::CoreSlots { n_slots, wake_latency_s } => {
                write!(f, "measured op times, {n_slots} core slots, {:.2} ms wake-up", wake_latency_s * 1e3)
            }
            CostBasis::SharedCores { n_cores } => write!(f, "op CPU times, {n_cores} cores shared"),
        }
    }
}

/// One worker's time in the last step reported: `busy_s + idle_s` is the step's makespan, and the
/// idle time holds the waits for messages and for a core (what remains is the fill before its
/// first input arrived that it did not spend waiting, the commit's round trip, and bookkeeping).
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceTime {
    /// The worker's device, or its tensor-parallel group's devices joined with `+`.
    pub label: String,
    /// Seconds in compute ops.
    pub busy_s: f64,
    /// The rest of the makespan.
    pub idle_s: f64,
    /// Of the idle time, seconds spent waiting for messages (within the makespan).
    pub waiting_s: f64,
    /// Of the idle time, seconds a ready op waited for a core slot (within the makespan).
    pub core_wait_s: f64,
    /// Seconds in the gradient all-reduce across data-parallel replicas (within the makespan).
    pub all_reduce_s: f64,
    /// Of `all_reduce_s`, the seconds the all-reduce ran beside this worker's compute ops
    /// (buckets launched during the backward pass, `TrainerBuilder::bucket_size`); the rest kept
    /// the worker idle.
    pub all_reduce_hidden_s: f64,
    /// The highest peak memory among the worker's devices, bytes.
    pub peak_memory_bytes: u64,
    /// Micro-batches in flight at most on the worker's first stage (schedule theory).
    pub in_flight: usize,
}

/// One device's peak memory in the last step reported.
#[derive(Clone, Debug, PartialEq)]
pub struct DevicePeak {
    /// The device.
    pub name: String,
    /// Peak bytes in use.
    pub peak_memory_bytes: u64,
}

/// The cores' idle time on a step whose workers shared fewer cores without slots: a worker then
/// "idles" while its thread waits for a core too, so the cores' idle time, `1 - CPU time of all
/// ops / (cores x makespan)`, is the fairer comparison.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CoresIdle {
    /// Workers (pipeline devices).
    pub n_workers: usize,
    /// Cores they shared.
    pub n_cores: usize,
    /// The cores' idle fraction measured.
    pub measured_fraction: f64,
    /// The same simulated with shared cores.
    pub simulated_fraction: f64,
}

/// What separates the measured bubble from schedule theory, in fractions of the step (each the
/// mean over the steps): `op_costs + machine + unexplained` is `measured - theory`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BubbleGap {
    /// The ops' measured, unequal costs on a core per device with instant messages, against
    /// theory's equal ones: a slow stage makes the others wait.
    pub op_costs: f64,
    /// The machine on top of the ops' costs ([`CostBasis`]): delivery or wake-up latency, devices
    /// starting at different times, the commit's round trip, time an op holds its device past its
    /// span, and shared cores or core slots.
    pub machine: f64,
    /// Measured minus simulated: what the simulator does not model.
    pub unexplained: f64,
}

impl fmt::Display for BubbleGap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "measured minus theory {:+.1} points: unequal op costs {:+.1}, latency and cores {:+.1}, not modelled {:+.1}",
            (self.op_costs + self.machine + self.unexplained) * 100.0,
            self.op_costs * 100.0,
            self.machine * 100.0,
            self.unexplained * 100.0
        )
    }
}

/// Measured bubbles against theory and the simulator, over one or more steps (see the module
/// documentation). The fractions are idle time over `devices x makespan`, compute ops counting as
/// busy, averaged over the steps; the per-device figures are the last step's.
#[derive(Clone, Debug, PartialEq)]
pub struct BubbleReport {
    /// Steps averaged.
    pub n_steps: usize,
    /// The measured bubble fraction.
    pub measured_fraction: f64,
    /// The simulator's, from each step's measured op costs on [`BubbleReport::cost_basis`].
    pub simulated_fraction: f64,
    /// Schedule theory's: the simulator with equal op costs and free messages
    /// (`(p - 1) / (m + p - 1)` for GPipe and 1F1B).
    pub theory_fraction: f64,
    /// How the last step's op costs were simulated.
    pub cost_basis: CostBasis,
    /// What explains `measured - theory`.
    pub gap: BubbleGap,
    /// With workers sharing fewer cores without slots (last step): the cores' idle time.
    pub cores_idle: Option<CoresIdle>,
    /// The last step's makespan (first compute start to last compute end), seconds.
    pub makespan_s: f64,
    /// Per worker, worker 0 first: the last step's time.
    pub devices: Vec<DeviceTime>,
    /// Every device's peak memory in the last step ([`Trainer::devices`] order).
    pub peak_memory: Vec<DevicePeak>,
    /// Devices per worker (the tensor-parallel degree).
    pub group_size: usize,
}

impl fmt::Display for BubbleReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(cores) = &self.cores_idle {
            writeln!(
                f,
                "cores idle on the last step ({} workers on {} cores): measured {:.1}%, simulated with shared cores {:.1}%",
                cores.n_workers,
                cores.n_cores,
                cores.measured_fraction * 100.0,
                cores.simulated_fraction * 100.0
            )?;
        }
        write!(
            f,
            "bubble (mean of the last {} steps): measured {:.1}%, simulator with {} {:.1}%, schedule theory (equal costs) {:.1}%",
            self.n_steps,
            self.measured_fraction * 100.0,
            self.cost_basis,
            self.simulated_fraction * 100.0,
            self.theory_fraction * 100.0
        )?;
        for device in &self.devices {
            let mut core_part = if device.core_wait_s > 0.0 {
                format!(", for a core {:.1} ms", device.core_wait_s * 1e3)
            } else {
                String::new()
            };
            if device.all_reduce_s > 0.0 {
                core_part.push_str(&format!(
                    ", gradient all-reduce {:.1} ms, {:.0}% of it under compute",
                    device.all_reduce_s * 1e3,
                    100.0 * device.all_reduce_hidden_s / device.all_reduce_s
                ));
            }
            write!(
                f,
                "\n  {}: busy {:.1} ms, idle {:.1} ms (waiting for messages {:.1} ms{core_part}) of a {:.1} ms step, peak memory {} (micro-batches in flight on its first stage: {})",
                device.label,
                device.busy_s * 1e3,
                device.idle_s * 1e3,
                device.waiting_s * 1e3,
                self.makespan_s * 1e3,
                format_bytes(device.peak_memory_bytes),
                device.in_flight,
            )?;
        }
        if self.group_size > 1 {
            for device in &self.peak_memory {
                write!(f, "\n  {}: peak memory {}", device.name, format_bytes(device.peak_memory_bytes))?;
            }
        }
        Ok(())
    }
}

impl StepReport {
    /// This step's bubbles under `schedule` (the one it ran: [`Trainer::schedule`]), on this
    /// machine's cores; workers are labelled `device 0`, `device 1`, ... ([`Trainer::bubbles`]
    /// names them and averages several steps).
    ///
    /// ```
    /// use conveyor_engine::runtime::StepReport;
    /// use conveyor_schedules::{CostModel, Schedule, ScheduleKind, StageCosts, simulate};
    ///
    /// // A step as a trainer reports it; here one simulated with equal op costs on 2 devices.
    /// let schedule = Schedule::new(ScheduleKind::OneFOneB, 2, 4, 1)?;
    /// let step = simulate(&schedule, &CostModel::uniform(StageCosts::new(0.01, 0.01, 0.01)))?;
    /// let bubbles = StepReport::from_timeline(step.timeline).bubbles(&schedule)?;
    /// // 1F1B: (p - 1) / (m + p - 1) of the step idles.
    /// assert!((bubbles.theory_fraction - 1.0 / 5.0).abs() < 1e-12);
    /// assert!((bubbles.measured_fraction - bubbles.theory_fraction).abs() < 1e-9);
    /// for device in &bubbles.devices {
    ///     assert!((device.busy_s + device.idle_s - bubbles.makespan_s).abs() < 1e-12);
    /// }
    /// println!("{bubbles}");
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn bubbles(&self, schedule: &Schedule) -> Result<BubbleReport> {
        bubbles_over(std::slice::from_ref(self), schedule, available_cores(), &[])
    }

    /// A report holding only `timeline` (a simulated step, or one read back from a trace), for
    /// [`StepReport::bubbles`]: zero loss and gradient norm, no memory figures, no CPU times, no
    /// core slots, started at time 0.
    pub fn from_timeline(timeline: Timeline) -> StepReport {
        StepReport {
            started_s: 0.0,
            loss: 0.0,
            peak_memory: Vec::new(),
            peak_activation_bytes: Vec::new(),
            step_s: timeline.makespan_s(),
            timeline,
            other_events: Vec::new(),
            grad_norm: 0.0,
            op_cpu_times: Vec::new(),
            core_slots: None,
            core_wake_latency_s: None,
            loss_scale: None,
            skipped: false,
            replayed: false,
        }
    }
}

impl Trainer {
    /// The bubbles of `reports` (steps of this trainer, oldest first; the per-device figures are
    /// the last one's), under its schedule, on this machine's cores, with its devices' names.
    /// `conveyor train` prints this for its last 5 steps.
    pub fn bubbles(&self, reports: &[StepReport]) -> Result<BubbleReport> {
        // The time line is replica 0's pipeline (its devices named), on the machine's cores.
        let n_devices = self.schedule().n_devices() * self.tensor_parallel();
        let names: Vec<String> = self.devices()[..n_devices].iter().map(ToString::to_string).collect();
        let cores = match self.transport.world_size() {
            1 => available_cores(),
            // Ranks are processes the launcher binds to cores of their own (a rank sees only its
            // own); they share the machine's cores only when there are more ranks than cores.
            _ => online_cores().min(self.schedule().n_devices()),
        };
        bubbles_over(reports, self.schedule(), cores, &names)
    }
}

/// The machine's online cores, whatever this process is bound to (1 when the system does not say).
fn online_cores() -> usize {
    // SAFETY: sysconf reads a system constant and has no other effect.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(online).unwrap_or(1).max(1)
}

/// The machine's cores (1 when the operating system does not say).
fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// One step's fractions.
struct StepBubbles {
    measured: f64,
    simulated: f64,
    op_costs_only: f64,
    basis: CostBasis,
}

/// How the simulator times `report`'s step on `n_cores` cores (see the module documentation).
fn simulate_step(report: &StepReport, schedule: &Schedule, n_cores: usize) -> Result<StepBubbles> {
    let n_stages = schedule.n_stages();
    let (basis, costs, op_costs_only) = if let Some(n_slots) = report.core_slots {
        let wake_latency_s = report.core_wake_latency_s.unwrap_or(0.0);
        let basis = CostBasis::CoreSlots { n_slots, wake_latency_s };
        (basis, measured_costs(&report.timeline, n_stages), span_costs(&report.timeline, n_stages))
    } else if schedule.n_devices() > n_cores {
        let costs = cpu_costs(report, n_stages);
        (CostBasis::SharedCores { n_cores }, costs.clone(), costs)
    } else {
        // Each device sleeps while it waits: a message reaches it when the OS wakes it.
        let latency_s = delivery_latency_s(&report.timeline);
        let costs = measured_costs(&report.timeline, n_stages)
            .with_link(Link { latency_s, bandwidth_bytes_per_s: f64::INFINITY });
        (CostBasis::Delivery { latency_s }, costs, span_costs(&report.timeline, n_stages))
    };
    Ok(StepBubbles {
        measured: report.timeline.bubble_fraction(),
        simulated: simulate_on(schedule, &costs, basis.cores())?.bubble_fraction,
        op_costs_only: simulate(schedule, &op_costs_only)?.bubble_fraction,
        basis,
    })
}

/// The bubbles of `reports` (steps run under `schedule`, oldest first) on a machine of `n_cores`
/// cores, averaged over the steps; the per-device figures are the last step's. `device_names`
/// names every device in [`Trainer::devices`] order (empty: `device 0`, `device 1`, ...).
///
/// Errors: no reports, `n_cores` 0, or a report whose timeline has another number of devices or
/// stages than `schedule`.
pub fn bubbles_over(
    reports: &[StepReport],
    schedule: &Schedule,
    n_cores: usize,
    device_names: &[String],
) -> Result<BubbleReport> {
    let Some(last) = reports.last() else {
        return Err(Error::invalid("reports", "no step reports given; give at least one step's report"));
    };
    if n_cores == 0 {
        return Err(Error::invalid("n_cores", "0 cores; give the machine's cores, at least 1"));
    }
    let n_workers = schedule.n_devices();
    for (idx, report) in reports.iter().enumerate() {
        let timeline = &report.timeline;
        if (timeline.n_devices, timeline.n_stages) != (n_workers, schedule.n_stages()) {
            return Err(Error::invalid(
                "reports",
                format!(
                    "report {idx} has {} devices and {} stages, the schedule {n_workers} and {}; give the schedule \
                     the steps ran (`Trainer::schedule`)",
                    timeline.n_devices,
                    timeline.n_stages,
                    schedule.n_stages()
                ),
            ));
        }
    }
    let theory = simulate(schedule, &CostModel::uniform(StageCosts::UNIT))?;
    let (mut measured, mut simulated, mut op_costs_only) = (0.0, 0.0, 0.0);
    let mut basis = CostBasis::Delivery { latency_s: 0.0 };
    let n_steps = reports.len() as f64;
    for report in reports {
        let step = simulate_step(report, schedule, n_cores)?;
        measured += step.measured / n_steps;
        simulated += step.simulated / n_steps;
        op_costs_only += step.op_costs_only / n_steps;
        basis = step.basis;
    }
    let gap = BubbleGap {
        op_costs: op_costs_only - theory.bubble_fraction,
        machine: simulated - op_costs_only,
        unexplained: measured - simulated,
    };
    let cores_idle = match basis {
        CostBasis::SharedCores { n_cores } => {
            let shared = simulate_on(schedule, &cpu_costs(last, schedule.n_stages()), basis.cores())?;
            let cpu_total: f64 = last.op_cpu_times.iter().map(|t| t.cpu_s).sum();
            let idle = |makespan_s: f64| 1.0 - cpu_total / (n_cores as f64 * makespan_s);
            Some(CoresIdle {
                n_workers,
                n_cores,
                measured_fraction: idle(last.timeline.makespan_s()),
                simulated_fraction: idle(shared.makespan_s),
            })
        }
        _ => None,
    };
    // Devices per worker: from the names given (one pipeline's devices), else from the peaks.
    let group_size = match (device_names.len(), last.peak_memory.len()) {
        (n, _) if n >= n_workers && n % n_workers == 0 => n / n_workers,
        (_, n) if n > n_workers && n % n_workers == 0 => n / n_workers,
        _ => 1,
    };
    let name = |idx: usize| device_names.get(idx).cloned().unwrap_or_else(|| format!("device {idx}"));
    let peak_memory: Vec<DevicePeak> = last
        .peak_memory
        .iter()
        .enumerate()
        .map(|(idx, &bytes)| DevicePeak { name: name(idx), peak_memory_bytes: bytes })
        .collect();
    let timeline = &last.timeline;
    let makespan_s = timeline.makespan_s();
    let busy = timeline.busy_s();
    let devices = (0..n_workers)
        .map(|worker| {
            let members = worker * group_size..(worker + 1) * group_size;
            let label = if device_names.len() >= members.end {
                device_names[members.clone()].join("+")
            } else {
                format!("device {worker}")
            };
            DeviceTime {
                label,
                busy_s: busy[worker],
                idle_s: makespan_s - busy[worker],
                waiting_s: time_in(timeline, worker, OpKind::Wait),
                core_wait_s: time_in(timeline, worker, OpKind::CoreWait),
                all_reduce_s: time_in(timeline, worker, OpKind::AllReduce),
                all_reduce_hidden_s: all_reduce_under_compute_s(timeline, worker),
                peak_memory_bytes: peak_memory
                    .get(members)
                    .into_iter()
                    .flatten()
                    .map(|p| p.peak_memory_bytes)
                    .max()
                    .unwrap_or(0),
                in_flight: theory.peak_inflight.get(worker).copied().unwrap_or(0),
            }
        })
        .collect();
    Ok(BubbleReport {
        n_steps: reports.len(),
        measured_fraction: measured,
        simulated_fraction: simulated,
        theory_fraction: theory.bubble_fraction,
        cost_basis: basis,
        gap,
        cores_idle,
        makespan_s,
        devices,
        peak_memory,
        group_size,
    })
}

/// Seconds `device_idx` spent in events of kind `op` within the makespan (the first compute
/// start to the last compute end).
/// Seconds of `device_idx`'s gradient all-reduces that overlap its own compute ops (each
/// worker's compute ops are sequential, and so are its all-reduces, so the pairwise overlaps add up).
fn all_reduce_under_compute_s(timeline: &Timeline, device_idx: usize) -> f64 {
    let on_device = || timeline.events.iter().filter(|e| e.device_idx == device_idx);
    let all_reduces: Vec<_> = on_device().filter(|e| e.op == OpKind::AllReduce).collect();
    on_device()
        .filter(|e| e.op.is_compute())
        .flat_map(|c| all_reduces.iter().map(move |a| (c.end_s.min(a.end_s) - c.start_s.max(a.start_s)).max(0.0)))
        .sum::<f64>()
        + 0.0 // an empty f64 sum is -0.0
}

fn time_in(timeline: &Timeline, device_idx: usize, op: OpKind) -> f64 {
    let compute = timeline.events.iter().filter(|e| e.op.is_compute());
    let start = compute.clone().map(|e| e.start_s).fold(f64::INFINITY, f64::min);
    let end = compute.map(|e| e.end_s).fold(f64::NEG_INFINITY, f64::max);
    timeline
        .events
        .iter()
        .filter(|e| e.device_idx == device_idx && e.op == op)
        .map(|e| (e.end_s.min(end) - e.start_s.max(start)).max(0.0))
        .sum::<f64>()
        + 0.0 // an empty f64 sum is -0.0
}
