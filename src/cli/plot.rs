//! `zerodp plot`: the curves of one or more `train --metrics` files as one SVG. The reading and
//! drawing are [`zerodp::plot`]'s; this file names the runs, checks the output path and writes.

use anyhow::{bail, Context};
use std::path::PathBuf;
use zerodp::outputs::{check_outputs, NamedPath};
use zerodp::plot::{read_metrics, unique_names, write_svg};

#[derive(clap::Args, Debug)]
pub struct PlotArgs {
    /// Metrics files written by `train --metrics` (JSON Lines); each is one run.
    #[arg(value_name = "METRICS.jsonl", required = true, num_args = 1..)]
    pub metrics: Vec<PathBuf>,
    /// The SVG to write (under a temporary name, renamed into place).
    #[arg(short, long, value_name = "FILE", default_value = "curves.svg")]
    pub output: PathBuf,
    /// Names of the runs in the legend, comma-separated, in the order of the files (default: each
    /// file's name without its extension). Repeated names get a numeric suffix.
    #[arg(long, value_name = "A,B,...", value_delimiter = ',')]
    pub names: Vec<String>,
}

pub fn run(a: PlotArgs) -> anyhow::Result<i32> {
    if !a.names.is_empty() && a.names.len() != a.metrics.len() {
        bail!(
            "--names gives {} names for {} metrics files; give one name per file, in their order",
            a.names.len(),
            a.metrics.len()
        );
    }
    let inputs: Vec<NamedPath<'_>> = a
        .metrics
        .iter()
        .map(|p| NamedPath {
            name: "metrics file",
            path: p,
        })
        .collect();
    let output = NamedPath {
        name: "--output",
        path: &a.output,
    };
    check_outputs(&inputs, &[output])?;
    let mut runs = Vec::with_capacity(a.metrics.len());
    for path in &a.metrics {
        runs.push(read_metrics(path).context("reading the metrics")?);
    }
    let names = match a.names.is_empty() {
        true => runs.iter().map(|r| r.name.clone()).collect(),
        false => a.names,
    };
    for (run, name) in runs.iter_mut().zip(unique_names(&names)) {
        run.name = name;
    }
    write_svg(&a.output, &runs).context("drawing the curves")?;
    let steps: usize = runs.iter().map(|r| r.points.len()).sum();
    outln!(
        "wrote {}: {} run{}, {steps} steps",
        a.output.display(),
        runs.len(),
        if runs.len() == 1 { "" } else { "s" }
    );
    Ok(0)
}
