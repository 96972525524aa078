//! The command line. Each subcommand lives in its own file; this file only wires them.

use clap::{Parser, Subcommand};

pub mod bench_comm;
pub mod bench_train;
pub mod config;
pub mod launch;
pub mod plan;
pub mod preflight;
pub mod train;

#[derive(Parser, Debug)]
#[command(name = "zerodp", version, about = "ZeRO sharded data-parallel training", long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Train the GPT reference model with a DeepSpeed config.
    Train(train::TrainArgs),
    /// Per-device memory and traffic for every stage and offload choice, before a run.
    Plan(plan::PlanArgs),
    /// Benchmarks: collectives and training throughput.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Inspect DeepSpeed configs.
    #[command(subcommand)]
    Config(ConfigCommand),
}

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// nccl-tests-style bandwidth table of the collectives.
    Comm(bench_comm::BenchCommArgs),
    /// Training throughput (tokens/s) per stage and world size.
    Train(bench_train::BenchTrainArgs),
}

#[derive(Subcommand, Debug)]
pub enum ConfigCommand {
    /// Resolve and validate a DeepSpeed config; print the settings and the warnings.
    Check(config::CheckArgs),
}

/// Runs the parsed command; returns the process exit code.
pub fn run(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Command::Train(a) => train::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Bench(BenchCommand::Comm(a)) => bench_comm::run(a),
        Command::Bench(BenchCommand::Train(a)) => bench_train::run(a),
        Command::Config(ConfigCommand::Check(a)) => config::run(a),
    }
}
