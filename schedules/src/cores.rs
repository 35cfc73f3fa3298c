//! The one entry point for simulating a step on a machine: [`simulate_on`] with a [`Cores`] model
//! says how the devices get their cores, and picks the simulator that models it ([`simulate`] for
//! a core per device, [`simulate_on_cores`] for threads sharing fewer cores, and
//! [`simulate_with_core_slots`] for the runtime's core slots). A caller that measured a step asks
//! one function, whatever the machine.
use crate::cost::CostModel;
use crate::error::ScheduleError;
use crate::schedule::Schedule;
use crate::shared_cores::{simulate_on_cores, simulate_with_core_slots};
use crate::simulate::{SimulationReport, simulate};

/// How the devices of a simulated step get their cores.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Cores {
    /// Each device has a core (or an accelerator) of its own.
    OnePerDevice,
    /// The devices' threads share `n_cores` cores, left to the operating system (processor
    /// sharing).
    Shared {
        /// Cores the devices share.
        n_cores: usize,
    },
    /// The devices take turns on `n_slots` core slots, first come first served, as the runtime's
    /// core slots do; a device that slept starts `wake_latency_s` after its slot is handed over.
    Slots {
        /// Slots (cores) the devices share.
        n_slots: usize,
        /// Seconds from a slot's handover to the sleeping device running.
        wake_latency_s: f64,
    },
}

/// Simulates `schedule` under `costs` on `cores`.
pub fn simulate_on(schedule: &Schedule, costs: &CostModel, cores: Cores) -> Result<SimulationReport, ScheduleError> {
    match cores {
        Cores::OnePerDevice => simulate(schedule, costs),
        Cores::Shared { n_cores } => simulate_on_cores(schedule, costs, n_cores),
        Cores::Slots { n_slots, wake_latency_s } => simulate_with_core_slots(schedule, costs, n_slots, wake_latency_s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ScheduleKind, StageCosts};

    #[test]
    fn enough_cores_give_the_dedicated_simulators_makespan() {
        let schedule = Schedule::new(ScheduleKind::OneFOneB, 4, 8, 1).unwrap();
        let costs = CostModel::uniform(StageCosts::UNIT);
        let dedicated = simulate_on(&schedule, &costs, Cores::OnePerDevice).unwrap().makespan_s;
        for cores in [Cores::Shared { n_cores: 4 }, Cores::Slots { n_slots: 4, wake_latency_s: 0.0 }] {
            let makespan = simulate_on(&schedule, &costs, cores).unwrap().makespan_s;
            assert!((makespan - dedicated).abs() < 1e-9, "{cores:?}: {makespan} vs {dedicated}");
        }
        let two = simulate_on(&schedule, &costs, Cores::Shared { n_cores: 2 }).unwrap().makespan_s;
        assert!(two > dedicated, "two cores for four devices take longer");
    }
}
