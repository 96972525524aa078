//! Curves of training runs as one SVG: the metrics files `train --metrics` writes, read back
//! ([`read_metrics`], [`Run`]) and drawn as a grid of panels ([`render_svg`], [`write_svg`]):
//! training and evaluation loss against steps and against tokens, the learning rate, tokens/s and
//! peak memory, several runs overlaid. `zerodp plot` draws finished files; [`LivePlot`] redraws one
//! run while it trains (`train --plot`), so a browser reloading the file follows the run.
//!
//! The SVG is written by hand (no plotting crate) and is meant to be checked by machines as well as
//! read by people: every curve is a `<polyline class="series">` that carries, besides its pixel
//! `points`, the data it was drawn from (`data-run`, `data-metric`, `data-x` and `data-points`,
//! the numbers at full precision), so a test can compare a plot with its metrics file exactly.
//!
//! Depends on nothing in the crate but [`crate::atomic_file`], which writes the SVG whole.

mod live;
mod metrics;
mod svg;
mod ticks;

pub use live::{write_svg, LivePlot};
pub use metrics::{read_metrics, unique_names, Point, Run};
pub use svg::render_svg;

use std::path::PathBuf;

/// Why a metrics file could not be read or a plot not written. Every message names the file (or
/// the run) and, for a bad line, its line number, so that the line can be found and fixed.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("cannot read metrics file {path}: {source}", path = .path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A line of a file (or the `line`-th value given to [`Run::from_lines`]) that is not a
    /// metrics line.
    #[error("{file}: line {line}: {msg}")]
    Line {
        file: String,
        line: usize,
        msg: String,
    },
    /// A line given alone ([`Run::push_line`], [`LivePlot::push`]), whose place only the caller
    /// knows.
    #[error("metrics line of run {run}: {msg}")]
    BadLine { run: String, msg: String },
    #[error(
        "{file}: no metrics lines (JSON objects with `step` and `loss`, as `train --metrics` \
         writes them); nothing to plot"
    )]
    Empty { file: String },
    #[error("cannot write the plot {path}: {source}", path = .path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}
