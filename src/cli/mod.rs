//! The command line. Each subcommand lives in its own file; this file wires them and holds what
//! they share: the output macros, the error text and the `--timeout` flag.
//!
//! No write panics. `println!` panics when standard output is gone (`zerodp plan | head`), so
//! subcommands write through [`outln!`] and [`out!`] instead: a closed standard output (EPIPE)
//! ends the command quietly with status 0, as a Unix filter ends, and any other write error
//! becomes the command's error. [`errln!`] writes to standard error and ignores failures: there is
//! nowhere left to report them.

use std::fmt;
use std::io::{self, Write};
use std::time::Duration;

use clap::{Parser, Subcommand};

/// `print!` that returns [`StdoutClosed`] or the write error from the enclosing function (which
/// returns `anyhow::Result`) instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::write_stdout(format_args!($($arg)*))?
    };
}

/// `println!` that returns [`StdoutClosed`] or the write error from the enclosing function (which
/// returns `anyhow::Result`) instead of panicking.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::cli::write_stdout(format_args!("{}\n", format_args!($($arg)*)))?
    };
}

/// `eprintln!` that ignores write errors instead of panicking.
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::cli::write_stderr(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub mod bench_adam;
pub mod bench_comm;
pub mod bench_ops;
pub mod bench_train;
pub mod ckpt;
pub mod config;
pub mod data_args;
pub mod device_args;
pub mod eval;
pub mod eval_args;
pub mod generate;
pub mod hf_model;
pub mod launch;
mod nccl;
pub mod op_scaling;
pub mod plan;
pub mod plot;
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
    // Boxed: its flags outweigh every other command's.
    Train(Box<train::TrainArgs>),
    /// Per-device memory and traffic for every stage and offload choice, before a run.
    Plan(plan::PlanArgs),
    /// Benchmarks: collectives, training throughput, the step's ops and the Adam step.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Inspect checkpoints and consolidate their weights into one file.
    #[command(subcommand)]
    Ckpt(ckpt::CkptCommand),
    /// Inspect DeepSpeed configs.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// The held-out loss and perplexity of a model or checkpoint on data, without training.
    Eval(Box<eval::EvalCmdArgs>),
    /// Text from a model or checkpoint, streamed as it is written (a KV cache).
    Generate(Box<generate::GenerateArgs>),
    /// Draw training and evaluation curves of metrics files as one SVG.
    Plot(plot::PlotArgs),
}

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// nccl-tests-style bandwidth table of the collectives.
    Comm(bench_comm::BenchCommArgs),
    /// Training throughput (tokens/s) per stage and world size.
    // Boxed: its flags outweigh every other benchmark's.
    Train(Box<bench_train::BenchTrainArgs>),
    /// CPU Adam step: parameters per second per shard size, thread count and state dtype, next
    /// to this machine's memory bandwidth.
    Adam(bench_adam::BenchAdamArgs),
    /// Where one rank's training step spends its time: every op of the GPT alone on one rank's
    /// shapes, forward and backward, against the FLOPs and bytes it must move.
    Ops(bench_ops::BenchOpsArgs),
}

#[derive(Subcommand, Debug)]
pub enum ConfigCommand {
    /// Resolve and validate a DeepSpeed config; print the settings and the warnings.
    Check(config::CheckArgs),
}

/// Runs the parsed command; returns the process exit code.
pub fn run(cli: Cli) -> anyhow::Result<i32> {
    // A cap on the kernels' instruction set is refused at once when misspelt, and said when set.
    if let Some(isa) = zerodp::isa::cap_from_env().map_err(anyhow::Error::msg)? {
        errln!(
            "note: {}={} holds zerodp's kernels to {} (the gemm crate's f32 products use AVX2 \
             either way)",
            zerodp::isa::ISA_ENV,
            isa.name(),
            isa.name()
        );
    }
    match cli.command {
        Command::Train(a) => train::run(*a),
        Command::Plan(a) => plan::run(a),
        Command::Bench(BenchCommand::Comm(a)) => bench_comm::run(a),
        Command::Bench(BenchCommand::Train(a)) => bench_train::run(*a),
        Command::Bench(BenchCommand::Adam(a)) => bench_adam::run(a),
        Command::Bench(BenchCommand::Ops(a)) => bench_ops::run(a),
        Command::Config(ConfigCommand::Check(a)) => config::run(a),
        Command::Ckpt(c) => ckpt::run(c),
        Command::Eval(a) => eval::run(*a),
        Command::Generate(a) => generate::run(*a),
        Command::Plot(a) => plot::run(a),
    }
}

/// Standard output was closed by its reader: the command stops early and quietly, with status 0.
#[derive(Debug)]
pub struct StdoutClosed;

impl fmt::Display for StdoutClosed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("standard output was closed")
    }
}

impl std::error::Error for StdoutClosed {}

/// Writes to standard output and flushes, so that a failure shows here and not at exit: a closed
/// pipe becomes [`StdoutClosed`], anything else an error naming standard output.
pub fn write_stdout(args: fmt::Arguments<'_>) -> anyhow::Result<()> {
    let mut stdout = io::stdout().lock();
    match stdout.write_fmt(args).and_then(|()| stdout.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Err(StdoutClosed.into()),
        Err(e) => Err(anyhow::Error::new(e).context("writing to standard output")),
    }
}

/// Writes to standard error, ignoring failures (there is nowhere left to report them).
pub fn write_stderr(args: fmt::Arguments<'_>) {
    let _ = io::stderr().lock().write_fmt(args);
}

/// Whether `e` is, or was caused by, a closed standard output.
pub fn is_stdout_closed(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| cause.is::<StdoutClosed>())
}

/// `e` and its causes joined by `": "`, each said once: a cause whose text the message before it
/// already contains (an error whose Display includes its source, such as the config reader's I/O
/// error) is left out.
pub fn error_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    let mut previous = String::new();
    for cause in e.chain() {
        let message = cause.to_string();
        if !previous.contains(&message) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&message);
        }
        previous = message;
    }
    text
}

/// `--timeout SECONDS` as the communicator's timeout: positive and below 1e12, or `inf` for none.
pub fn timeout_flag(secs: f64) -> anyhow::Result<Duration> {
    zerodp::comm::timeout_from_secs(secs).ok_or_else(|| {
        anyhow::anyhow!(
            "--timeout {secs:?}: give a positive number of seconds below 1e12, or inf for no timeout"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cause_is_said_once() {
        let io = std::io::Error::from_raw_os_error(21);
        let os = io.to_string();
        // A Display that already includes its source: the source is not repeated.
        let e = anyhow::Error::new(zerodp::config::ConfigError::Io {
            path: "/tmp".into(),
            source: io,
        });
        let text = error_text(&e);
        assert_eq!(text.matches(&os).count(), 1, "{text}");
        // Context over a cause it does not mention: both are said.
        let e = anyhow::anyhow!("inner").context("outer");
        assert_eq!(error_text(&e), "outer: inner");
    }

    #[test]
    fn a_closed_stdout_is_recognised_through_context() {
        let e = anyhow::Error::new(StdoutClosed).context("printing the table");
        assert!(is_stdout_closed(&e));
        assert!(!is_stdout_closed(&anyhow::anyhow!("other")));
    }

    #[test]
    fn infinite_timeout_is_none_and_huge_ones_are_refused() {
        assert_eq!(
            timeout_flag(f64::INFINITY).unwrap(),
            zerodp::comm::NO_TIMEOUT
        );
        assert_eq!(timeout_flag(2.5).unwrap(), Duration::from_millis(2500));
        for bad in [0.0, -1.0, f64::NAN, 1e300, f64::NEG_INFINITY] {
            let e = timeout_flag(bad).unwrap_err().to_string();
            assert!(e.contains("--timeout") && e.contains("inf"), "{e}");
        }
    }
}
