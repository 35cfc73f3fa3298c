//! The `conveyor` command line: parses arguments and dispatches to one module per subcommand.
//!
//! Exit codes: 0 success, 2 bad input (a usage error naming what was wrong and how to fix it),
//! 3 training stopped at a non-finite loss or gradient (`--on-nonfinite`; the outputs were still
//! written from the last good step), 1 any other failure.
mod cli;

use clap::{Parser, Subcommand};

/// Conveyor: pipeline- and model-parallel training, schedule simulation and stage placement.
#[derive(Parser)]
#[command(name = "conveyor", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Simulate a pipeline schedule and print its timeline, makespan and bubble fraction.
    Simulate(cli::simulate::SimulateArgs),
    /// Train a model across devices with a pipeline schedule (defaults: a CNN on the built-in digits, cpu:2, 1F1B).
    Train(Box<cli::train::TrainArgs>),
    /// Place a model on devices under memory budgets and print each stage's layers, memory and
    /// predicted times, with the predicted step time and bubble fraction.
    Plan(cli::plan::PlanArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Simulate(args) => cli::simulate::run(args),
        Command::Train(args) => cli::train::run(*args),
        Command::Plan(args) => cli::plan::run(args),
    };
    if let Err(err) = result {
        std::process::exit(cli::report(&err));
    }
}
