//! The `conveyor` command line: parses arguments and dispatches to one module per subcommand.
//!
//! Exit codes: 0 success, 2 bad input (a usage error naming what was wrong and how to fix it),
//! 3 training stopped at a non-finite loss or gradient (`--on-nonfinite`; the outputs were still
//! written from the last good step), 130 / 143 training stopped by SIGINT / SIGTERM (the outputs
//! were written at the last whole step; a second signal exits at once), 1 any other failure,
//! including a stdout or stderr that could not be written (a closed pipe is not a failure: output
//! stops quietly, as ripgrep does; see `cli::console`).
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
    Plan(cli::plan_flags::PlanFlags),
    /// Run the benchmark suites (seeds, gemm, schedules, all) and write report.json and a
    /// self-contained report.html.
    Bench(cli::bench::BenchArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match cli.command {
        Command::Simulate(args) => cli::simulate::run(args),
        Command::Train(args) => cli::train::run(*args),
        Command::Plan(flags) => flags.resolve().and_then(cli::plan::run),
        Command::Bench(args) => cli::bench::run(args),
    }))
    // A panic (already printed by the panic hook) under MPI ends the job rather than leaving the
    // other ranks waiting for this one; otherwise it exits as an unwinding panic does.
    .unwrap_or_else(|_| cli::ranks::panicked());
    let code = match &result {
        Ok(()) => 0,
        Err(err) => cli::report(err),
    };
    // Under MPI: finalise with the other ranks, or end the job when this rank failed alone.
    let code = cli::ranks::finish(&result, code);
    std::process::exit(cli::console::exit_code(code));
}
