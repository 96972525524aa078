//! Writing the SVG: whole, through [`crate::atomic_file`], so that a browser reloading it while a
//! run rewrites it never sees half a document; and [`LivePlot`], which redraws one run's curves
//! as its metrics lines arrive (`train --plot FILE`).

use super::{render_svg, PlotError, Run};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How often a live plot is redrawn at most: rendering and an fsync'd rename per step would slow
/// short steps for a file nobody reloads faster than this.
const REDRAW_EVERY: Duration = Duration::from_secs(1);

/// Renders `runs` ([`render_svg`]) and writes the SVG to `path` under a temporary name, renamed
/// into place.
pub fn write_svg(path: &Path, runs: &[Run]) -> Result<(), PlotError> {
    crate::atomic_file::write_atomic(path, render_svg(runs).as_bytes()).map_err(|source| {
        PlotError::Write {
            path: path.to_path_buf(),
            source,
        }
    })
}

/// One run's curves redrawn while it trains: give it every metrics line (from any rank's thread;
/// lines of ranks other than 0 are ignored). The SVG is written on the first line, then at most
/// once a second, and by [`LivePlot::finish`] at the end, so that the last steps are drawn too.
pub struct LivePlot {
    path: PathBuf,
    state: Mutex<LiveState>,
}

struct LiveState {
    run: Run,
    /// When the SVG was last written (or tried); `None` before the first line.
    last_write: Option<Instant>,
    /// Lines arrived since then.
    dirty: bool,
}

impl LivePlot {
    /// A live plot of the run `name`, written to `path` (nothing is written before a line comes).
    pub fn new(path: &Path, name: &str) -> Self {
        LivePlot {
            path: path.to_path_buf(),
            state: Mutex::new(LiveState {
                run: Run::new(name),
                last_write: None,
                dirty: false,
            }),
        }
    }

    /// Adds a metrics line and redraws when the last drawing is a second old (or there was none).
    /// A bad line is an error and changes nothing; so is a failed write, whose next try waits
    /// for the next second.
    pub fn push(&self, line: &Value) -> Result<(), PlotError> {
        if line
            .get("rank")
            .and_then(Value::as_u64)
            .is_some_and(|r| r != 0)
        {
            return Ok(());
        }
        let mut st = self.lock();
        st.run.push_line(line)?;
        st.dirty = true;
        if st.last_write.is_none_or(|t| t.elapsed() >= REDRAW_EVERY) {
            self.write(&mut st)?;
        }
        Ok(())
    }

    /// Draws what arrived since the last drawing (the end of a run); also draws an empty plot when
    /// no line ever came, so that the file exists after a run.
    pub fn finish(&self) -> Result<(), PlotError> {
        let mut st = self.lock();
        if st.dirty || st.last_write.is_none() {
            self.write(&mut st)?;
        }
        Ok(())
    }

    /// A copy of the run as drawn so far.
    pub fn run(&self) -> Run {
        self.lock().run.clone()
    }

    fn write(&self, st: &mut LiveState) -> Result<(), PlotError> {
        st.last_write = Some(Instant::now());
        st.dirty = false;
        write_svg(&self.path, std::slice::from_ref(&st.run)).inspect_err(|_| st.dirty = true)
    }

    /// The state, even after a panic of another thread holding it (the run is whole between
    /// lines, and a plot is no reason to fail a second thread).
    fn lock(&self) -> MutexGuard<'_, LiveState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn live_plot_draws_the_first_line_at_once_and_the_rest_on_finish() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("live.svg");
        let plot = LivePlot::new(&path, "live");
        assert!(!path.exists());
        plot.push(&json!({"rank": 0, "step": 1, "loss": 4.0}))
            .unwrap();
        let first = std::fs::read_to_string(&path).unwrap();
        assert!(first.contains(r#"data-points="1,4""#), "{first}");
        // Another rank's line is ignored; the next line waits for the second to pass.
        plot.push(&json!({"rank": 1, "step": 2, "loss": 9.0}))
            .unwrap();
        plot.push(&json!({"rank": 0, "step": 2, "loss": 3.0}))
            .unwrap();
        assert_eq!(plot.run().points.len(), 2);
        assert!(plot.push(&json!({"rank": 0, "loss": 3.0})).is_err());
        plot.finish().unwrap();
        let last = std::fs::read_to_string(&path).unwrap();
        assert!(last.contains(r#"data-metric="loss" data-x="step" data-points="1,4 2,3""#));
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temporary files are left");
    }

    #[test]
    fn finish_without_lines_writes_an_empty_plot() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.svg");
        LivePlot::new(&path, "r").finish().unwrap();
        assert!(std::fs::read_to_string(&path).unwrap().contains("no data"));
    }
}
