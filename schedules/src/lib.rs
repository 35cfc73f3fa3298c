//! Pipeline schedules as pure data: generators, a validator and a discrete-event simulator
//! (see `README.md` beside this crate for why each schedule cannot deadlock and what bounds its
//! memory).
//!
//! A [`Schedule`] is one list of [`Instruction`]s per device: forwards, backwards (fused, or
//! split into input and weight gradients) and a final optimizer step. Sends and receives are
//! not listed; they follow from one rule ([`Instruction::recv_from`], [`Instruction::send_to`])
//! that the validator and the simulators use and the engine's runtime applies to its graph's
//! routes. **Architecture
//! Invariant:** this crate knows nothing of tensors, devices or threads; the engine executes
//! the lists.
//!
//! Design: programs are static lists fixed before the step runs, so they can be validated
//! (every op once, dependencies, no deadlock under bounded channels) and simulated before any
//! device computes. We rejected a dynamic scheduler that picks the next op at run time: its
//! behaviour depends on timing, so it can be neither snapshot-tested nor proved deadlock-free
//! ahead of time. Zero Bubble schedules, which the paper finds by search, are built here by a
//! greedy unit-cost simulation and then frozen into the same static lists.
//!
//! ```
//! use conveyor_schedules::{simulate, validate, CostModel, Schedule, ScheduleKind, StageCosts};
//!
//! let schedule = Schedule::new(ScheduleKind::OneFOneB, 4, 8, 1)?;
//! validate(&schedule, 1)?;
//! let report = simulate(&schedule, &CostModel::uniform(StageCosts::UNIT))?;
//! // F = B = W = 1, fused backward 2: bubble (p - 1) / (m + p - 1) = 3 / 11.
//! assert!((report.bubble_fraction - 3.0 / 11.0).abs() < 1e-12);
//! assert_eq!(report.peak_inflight, vec![4, 3, 2, 1]);
//! # Ok::<(), conveyor_schedules::ScheduleError>(())
//! ```
#![deny(missing_docs)]

mod chunked_zero_bubble;
mod cores;
mod cost;
mod dualpipe_v;
mod error;
pub mod export;
mod gpipe;
pub mod instruction;
mod interleaved;
mod kind;
mod layout;
mod one_f_one_b;
mod render;
mod schedule;
mod shared_cores;
mod simulate;
mod steps;
mod timeline;
mod validate;
mod zero_bubble;

pub use cores::{Cores, simulate_on};
pub use cost::{CostModel, Link, MessageBytes, OpKey, StageCosts};
pub use error::{BlockedDevice, ScheduleError, Wait};
pub use instruction::{ChannelId, Direction, Instruction, Message};
pub use kind::ScheduleKind;
pub use layout::StageLayout;
pub use render::{render_timeline, render_timeline_with_cell};
pub use schedule::Schedule;
pub use shared_cores::{simulate_on_cores, simulate_with_core_slots};
pub use simulate::{SimulationReport, simulate};
pub use steps::{StepOverlap, StepSpan, StepsReport, simulate_steps};
pub use timeline::{OpKind, Timeline, TimelineEvent};
pub use validate::validate;
