//! `conveyor simulate`: builds a schedule, validates it and prints the simulated timeline.
use clap::Args;

/// Arguments of `conveyor simulate`.
#[derive(Args, Debug)]
pub struct SimulateArgs {}

/// Runs `conveyor simulate`.
pub fn run(_args: SimulateArgs) -> anyhow::Result<()> {
    Err(super::usage("conveyor simulate is not built yet"))
}
