//! The `zerodp` binary: parse the command line, run, map errors to an exit status.

use clap::Parser;

mod cli;

fn main() {
    let parsed = cli::Cli::parse();
    match cli::run(parsed) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}
