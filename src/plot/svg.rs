//! The SVG: five panels in a grid of two columns, the legend in the sixth cell. Every curve is a
//! `<polyline class="series">` with its data beside its pixels (see the module docs of
//! [`crate::plot`]); eval curves are dashed, with a marker at each evaluation (evaluations are
//! sparse, and one evaluation alone would be an invisible line).

use super::ticks::{Axis, Units};
use super::{Point, Run};
use std::fmt::Write;

const WIDTH: f64 = 1200.0;
const HEADER_H: f64 = 56.0;
const CELL_W: f64 = 600.0;
const CELL_H: f64 = 330.0;
/// The plot area inside a cell: room for the title above, tick labels and the axis label below
/// and to the left.
const PAD_LEFT: f64 = 80.0;
const PAD_RIGHT: f64 = 28.0;
const PAD_TOP: f64 = 40.0;
const PAD_BOTTOM: f64 = 54.0;
const LEGEND_ROW: f64 = 20.0;
/// Legend rows per column before a second column starts (what fits in a cell).
const LEGEND_ROWS: usize = 13;

/// Tableau 10: distinct for the first ten runs, then repeated.
const COLOURS: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac",
];

/// A quantity drawn against steps or tokens; `name()` is its `data-metric`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Metric {
    Loss,
    EvalLoss,
    Lr,
    TokensPerS,
    PeakBytes,
}

impl Metric {
    fn name(self) -> &'static str {
        match self {
            Metric::Loss => "loss",
            Metric::EvalLoss => "eval_loss",
            Metric::Lr => "lr",
            Metric::TokensPerS => "tokens_per_s",
            Metric::PeakBytes => "peak_bytes",
        }
    }

    fn value(self, p: &Point) -> Option<f64> {
        match self {
            Metric::Loss => p.loss,
            Metric::EvalLoss => p.eval_loss,
            Metric::Lr => p.lr,
            Metric::TokensPerS => p.tokens_per_s,
            Metric::PeakBytes => p.peak_bytes,
        }
    }
}

/// The horizontal quantity; `name()` is the `data-x` of a curve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum XAxis {
    Step,
    Tokens,
}

impl XAxis {
    fn name(self) -> &'static str {
        match self {
            XAxis::Step => "step",
            XAxis::Tokens => "tokens",
        }
    }

    fn value(self, p: &Point) -> f64 {
        match self {
            XAxis::Step => p.step as f64,
            XAxis::Tokens => p.tokens,
        }
    }
}

struct Panel {
    title: &'static str,
    x: XAxis,
    metrics: &'static [Metric],
    y_label: &'static str,
    units: Units,
    /// The y axis reaches 0: rates and sizes compare by ratio (a memory curve starting at
    /// 1.1 GiB would make 5% look like a doubling); a loss axis spans its data only.
    from_zero: bool,
}

const PANELS: [Panel; 5] = [
    Panel {
        title: "Loss by step",
        x: XAxis::Step,
        metrics: &[Metric::Loss, Metric::EvalLoss],
        y_label: "loss",
        units: Units::Plain,
        from_zero: false,
    },
    Panel {
        title: "Loss by tokens trained",
        x: XAxis::Tokens,
        metrics: &[Metric::Loss, Metric::EvalLoss],
        y_label: "loss",
        units: Units::Plain,
        from_zero: false,
    },
    Panel {
        title: "Learning rate",
        x: XAxis::Step,
        metrics: &[Metric::Lr],
        y_label: "learning rate",
        units: Units::Plain,
        from_zero: true,
    },
    Panel {
        title: "Throughput",
        x: XAxis::Step,
        metrics: &[Metric::TokensPerS],
        y_label: "tokens/s",
        units: Units::Plain,
        from_zero: true,
    },
    Panel {
        title: "Peak model-state memory per rank",
        x: XAxis::Step,
        metrics: &[Metric::PeakBytes],
        y_label: "peak bytes",
        units: Units::Bytes,
        from_zero: true,
    },
];

/// One curve: a run's finite values of one metric.
struct Series<'a> {
    run: usize,
    name: &'a str,
    metric: Metric,
    x: XAxis,
    points: Vec<(f64, f64)>,
}

/// The curves of `panel`, one per run and metric with at least one finite point.
fn series_of<'a>(runs: &'a [Run], panel: &Panel) -> Vec<Series<'a>> {
    let mut out = Vec::new();
    for (i, run) in runs.iter().enumerate() {
        for &metric in panel.metrics {
            let points: Vec<(f64, f64)> = run
                .points
                .iter()
                .filter_map(|p| Some((panel.x.value(p), metric.value(p)?)))
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .collect();
            if !points.is_empty() {
                out.push(Series {
                    run: i,
                    name: &run.name,
                    metric,
                    x: panel.x,
                    points,
                });
            }
        }
    }
    out
}

/// A legend line: a run's solid curves, or its dashed eval curve.
struct LegendEntry<'a> {
    run: usize,
    name: &'a str,
    eval: bool,
    summary: String,
}

/// Draws the runs' curves as one SVG document (about 1200 by 1050 pixels, more with a long
/// legend); runs without any finite value, and empty curves, are left out of panels and legend.
pub fn render_svg(runs: &[Run]) -> String {
    let panels: Vec<Vec<Series<'_>>> = PANELS.iter().map(|p| series_of(runs, p)).collect();
    let legend = legend_entries(runs, &panels);
    let (legend_x, legend_y) = cell(PANELS.len());
    let cols = legend.len().div_ceil(LEGEND_ROWS).clamp(1, 3);
    let rows = legend.len().div_ceil(cols);
    let height =
        (HEADER_H + 3.0 * CELL_H).max(legend_y + PAD_TOP + rows as f64 * LEGEND_ROW + 20.0);
    let mut s = String::new();
    header(&mut s, runs, height);
    for (i, (panel, series)) in PANELS.iter().zip(&panels).enumerate() {
        let (cx, cy) = cell(i);
        draw_panel(&mut s, cx, cy, panel, series);
    }
    draw_legend(&mut s, legend_x, legend_y, &legend, cols);
    s.push_str("</svg>\n");
    s
}

/// The top-left corner of grid cell `i` (two columns).
fn cell(i: usize) -> (f64, f64) {
    ((i % 2) as f64 * CELL_W, HEADER_H + (i / 2) as f64 * CELL_H)
}

/// One entry per run that has any curve, and one more for its eval curve when it has one, with
/// the last values, so the legend doubles as a summary.
fn legend_entries<'a>(runs: &'a [Run], panels: &[Vec<Series<'a>>]) -> Vec<LegendEntry<'a>> {
    let has = |run: usize, eval: bool| {
        panels
            .iter()
            .flatten()
            .any(|s| s.run == run && (s.metric == Metric::EvalLoss) == eval)
    };
    let last = |run: &Run, metric: Metric| {
        run.points
            .iter()
            .rev()
            .find_map(|p| Some((p.step, metric.value(p)?)))
    };
    let mut out = Vec::new();
    for (i, run) in runs.iter().enumerate() {
        for eval in [false, true] {
            if !has(i, eval) {
                continue;
            }
            let metric = if eval { Metric::EvalLoss } else { Metric::Loss };
            let summary = match last(run, metric) {
                Some((step, v)) if eval => format!("{v:.4} at step {step}"),
                Some((step, v)) => {
                    format!("{} steps, loss {v:.4} at step {step}", run.points.len())
                }
                None => format!("{} steps", run.points.len()),
            };
            out.push(LegendEntry {
                run: i,
                name: &run.name,
                eval,
                summary,
            });
        }
    }
    out
}

/// The SVG element, the white background and the title.
fn header(s: &mut String, runs: &[Run], height: f64) {
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="Helvetica, Arial, sans-serif" font-size="12">"#
    );
    let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
    let title = format!("Training curves: {}", names.join(", "));
    let _ = writeln!(s, "<title>{}</title>", escape(&title));
    let _ = writeln!(
        s,
        r##"<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#ffffff"/>"##
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="34" font-size="18" font-weight="bold" text-anchor="middle">{}</text>"#,
        WIDTH / 2.0,
        escape(&truncate(&title, 110))
    );
}

/// The pixel frame of a panel and its axes: data to pixels.
struct Frame {
    left: f64,
    right: f64,
    top: f64,
    bottom: f64,
    x: Axis,
    y: Axis,
}

impl Frame {
    fn px(&self, x: f64) -> f64 {
        self.left + (x - self.x.lo) / (self.x.hi - self.x.lo) * (self.right - self.left)
    }

    fn py(&self, y: f64) -> f64 {
        self.bottom - (y - self.y.lo) / (self.y.hi - self.y.lo) * (self.bottom - self.top)
    }
}

/// One panel at cell corner `(cx, cy)`: frame, grid, ticks, labels, then the curves.
fn draw_panel(s: &mut String, cx: f64, cy: f64, panel: &Panel, series: &[Series<'_>]) {
    let range = |f: fn(&(f64, f64)) -> f64| {
        let mut vals = series.iter().flat_map(|s| s.points.iter().map(f));
        let first = vals.next().unwrap_or(0.0);
        vals.fold((first, first), |(lo, hi), v| (lo.min(v), hi.max(v)))
    };
    let (x_lo, x_hi) = if series.is_empty() {
        (0.0, 1.0)
    } else {
        range(|p| p.0)
    };
    let (mut y_lo, mut y_hi) = if series.is_empty() {
        (0.0, 1.0)
    } else {
        range(|p| p.1)
    };
    if panel.from_zero {
        (y_lo, y_hi) = (y_lo.min(0.0), y_hi.max(0.0));
    }
    let f = Frame {
        left: cx + PAD_LEFT,
        right: cx + CELL_W - PAD_RIGHT,
        top: cy + PAD_TOP,
        bottom: cy + CELL_H - PAD_BOTTOM,
        x: Axis::new(x_lo, x_hi, 6, Units::Plain),
        y: Axis::new(y_lo, y_hi, 5, panel.units),
    };
    let metrics: Vec<&str> = panel.metrics.iter().map(|m| m.name()).collect();
    let _ = writeln!(
        s,
        r#"<g class="panel" data-x="{}" data-metrics="{}">"#,
        panel.x.name(),
        metrics.join(" ")
    );
    draw_axes(s, &f, panel);
    if series.is_empty() {
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" fill="#888888" text-anchor="middle">no data</text>"##,
            (f.left + f.right) / 2.0,
            (f.top + f.bottom) / 2.0
        );
    }
    for se in series {
        draw_series(s, &f, se);
    }
    s.push_str("</g>\n");
}

/// The plot area's border, grid lines with tick labels, the title and the axis labels.
fn draw_axes(s: &mut String, f: &Frame, panel: &Panel) {
    let (l, r, t, b) = (f.left, f.right, f.top, f.bottom);
    for (v, label) in &f.y.ticks {
        let y = f.py(*v);
        let _ = writeln!(
            s,
            r##"<line x1="{l:.1}" y1="{y:.1}" x2="{r:.1}" y2="{y:.1}" stroke="#e6e6e6"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#333333">{}</text>"##,
            l - 6.0,
            y + 4.0,
            escape(label)
        );
    }
    for (v, label) in &f.x.ticks {
        let x = f.px(*v);
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" y1="{t:.1}" x2="{x:.1}" y2="{b:.1}" stroke="#e6e6e6"/><text x="{x:.1}" y="{:.1}" text-anchor="middle" fill="#333333">{}</text>"##,
            b + 17.0,
            escape(label)
        );
    }
    let mid_x = (l + r) / 2.0;
    let mid_y = (t + b) / 2.0;
    let _ = writeln!(
        s,
        r##"<rect x="{l:.1}" y="{t:.1}" width="{:.1}" height="{:.1}" fill="none" stroke="#999999"/>"##,
        r - l,
        b - t
    );
    let _ = writeln!(
        s,
        r#"<text x="{mid_x:.1}" y="{:.1}" font-size="14" font-weight="bold" text-anchor="middle">{}</text>"#,
        t - 12.0,
        escape(panel.title)
    );
    let _ = writeln!(
        s,
        r#"<text x="{mid_x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        b + 38.0,
        panel.x.name()
    );
    let lx = l - PAD_LEFT + 16.0;
    let _ = writeln!(
        s,
        r#"<text x="{lx:.1}" y="{mid_y:.1}" text-anchor="middle" transform="rotate(-90 {lx:.1} {mid_y:.1})">{}</text>"#,
        escape(panel.y_label)
    );
}

/// One curve: the polyline with its data, and markers where a single point or sparse
/// evaluations would not show as a line.
fn draw_series(s: &mut String, f: &Frame, se: &Series<'_>) {
    let colour = COLOURS[se.run % COLOURS.len()];
    let eval = se.metric == Metric::EvalLoss;
    let mut data = String::new();
    let mut pixels = String::new();
    for (i, &(x, y)) in se.points.iter().enumerate() {
        let sep = if i == 0 { "" } else { " " };
        let _ = write!(data, "{sep}{x},{y}");
        let _ = write!(pixels, "{sep}{:.2},{:.2}", f.px(x), f.py(y));
    }
    let name = escape(se.name);
    let dash = if eval {
        r#" stroke-dasharray="6 4""#
    } else {
        ""
    };
    let label = if eval {
        format!("{name} eval")
    } else {
        name.clone()
    };
    let _ = writeln!(
        s,
        r#"<polyline class="series" data-run="{name}" data-metric="{}" data-x="{}" data-points="{data}" points="{pixels}" fill="none" stroke="{colour}" stroke-width="1.6" stroke-linejoin="round"{dash}><title>{label}: {} by {}</title></polyline>"#,
        se.metric.name(),
        se.x.name(),
        se.metric.name(),
        se.x.name(),
    );
    if se.points.len() == 1 || (eval && se.points.len() <= 300) {
        let _ = write!(s, r#"<g class="markers" fill="{colour}">"#);
        for &(x, y) in &se.points {
            let _ = write!(
                s,
                r#"<circle cx="{:.2}" cy="{:.2}" r="2.6"/>"#,
                f.px(x),
                f.py(y)
            );
        }
        s.push_str("</g>\n");
    }
}

/// The legend in the cell at `(cx, cy)`: a line sample (dashed for eval) and the name, with the
/// run's last values while they fit.
fn draw_legend(s: &mut String, cx: f64, cy: f64, entries: &[LegendEntry<'_>], cols: usize) {
    let _ = writeln!(
        s,
        r#"<g class="legend"><text x="{:.1}" y="{:.1}" font-size="14" font-weight="bold">Runs</text>"#,
        cx + PAD_LEFT,
        cy + PAD_TOP - 12.0
    );
    let rows = entries.len().div_ceil(cols).max(1);
    let col_w = (CELL_W - PAD_LEFT - PAD_RIGHT) / cols as f64;
    // About 6.5 pixels per character at 12px, after the 36 pixels of the line sample.
    let chars = ((col_w - 44.0) / 6.5) as usize;
    for (i, e) in entries.iter().enumerate() {
        let x = cx + PAD_LEFT + (i / rows) as f64 * col_w;
        let y = cy + PAD_TOP + 8.0 + (i % rows) as f64 * LEGEND_ROW;
        let colour = COLOURS[e.run % COLOURS.len()];
        let dash = if e.eval {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let text = if e.eval {
            format!("{} eval", e.name)
        } else {
            e.name.to_string()
        };
        let shown = truncate(&text, chars);
        let room = chars.saturating_sub(shown.chars().count() + 3);
        let summary = if room >= e.summary.chars().count() {
            format!(
                r##"<tspan fill="#666666">  {}</tspan>"##,
                escape(&e.summary)
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            s,
            r#"<g class="legend-entry" data-run="{}" data-kind="{}"><line x1="{x:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{colour}" stroke-width="2.5"{dash}/><text x="{:.1}" y="{:.1}">{}{summary}</text></g>"#,
            escape(e.name),
            if e.eval { "eval" } else { "train" },
            x + 30.0,
            x + 36.0,
            y + 4.0,
            escape(&shown),
        );
    }
    s.push_str("</g>\n");
}

/// `text` cut to `max` characters, the cut marked with an ellipsis.
fn truncate(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let mut out: String = text.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// `text` as XML character data or an attribute value: the five special characters escaped, and
/// the characters XML 1.0 cannot hold at all (control characters, U+FFFE, U+FFFF) replaced by
/// U+FFFD, so that any run name (a file stem) leaves the document well formed.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(c),
            c if (c as u32) < 0x20 || c == '\u{FFFE}' || c == '\u{FFFF}' => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(step: u64, loss: f64, eval: Option<f64>) -> Point {
        Point {
            step,
            tokens: step as f64 * 1000.0,
            loss: Some(loss),
            eval_loss: eval,
            eval_ppl: None,
            lr: Some(1e-3),
            tokens_per_s: Some(5e4),
            step_time_s: Some(0.02),
            peak_bytes: Some(3e9),
            model_state_bytes: None,
            world_size: Some(2),
            tokens_derived: false,
        }
    }

    #[test]
    fn names_are_escaped_everywhere() {
        assert_eq!(escape(r#"a&b<c>"d'"#), "a&amp;b&lt;c&gt;&quot;d&apos;");
        assert_eq!(escape("x\u{1}y\tz"), "x\u{FFFD}y\tz");
        let run = Run {
            name: r#"<run "1" & 'x'>"#.into(),
            points: vec![point(1, 3.0, None), point(2, 2.0, None)],
        };
        let svg = render_svg(&[run]);
        assert!(!svg.contains("<run"), "{svg}");
        assert!(svg.contains(r#"data-run="&lt;run &quot;1&quot; &amp; &apos;x&apos;&gt;""#));
    }

    #[test]
    fn non_finite_values_and_empty_series_are_left_out() {
        let mut points = vec![
            point(1, 3.0, None),
            point(2, 2.0, Some(2.5)),
            point(3, 1.0, None),
        ];
        points[1].loss = None;
        points[2].lr = None;
        points[0].tokens = f64::NAN;
        let svg = render_svg(&[Run {
            name: "r".into(),
            points,
        }]);
        let data = |metric: &str, x: &str| {
            let key = format!(r#"data-metric="{metric}" data-x="{x}" data-points=""#);
            let at = svg.find(&key).map(|i| i + key.len())?;
            Some(svg[at..at + svg[at..].find('"').unwrap()].to_string())
        };
        assert_eq!(data("loss", "step").as_deref(), Some("1,3 3,1"));
        assert_eq!(data("loss", "tokens").as_deref(), Some("3000,1"));
        assert_eq!(data("eval_loss", "step").as_deref(), Some("2,2.5"));
        assert_eq!(data("lr", "step").as_deref(), Some("1,0.001 2,0.001"));
        // One legend entry per run and one for its eval curve; none for a run without eval.
        assert_eq!(svg.matches(r#"class="legend-entry""#).count(), 2);
        let no_eval = render_svg(&[Run {
            name: "q".into(),
            points: vec![point(1, 1.0, None)],
        }]);
        assert!(!no_eval.contains(r#"data-metric="eval_loss""#));
        assert!(!no_eval.contains(r#"data-kind="eval""#));
        assert_eq!(no_eval.matches(r#"class="legend-entry""#).count(), 1);
    }

    #[test]
    fn nothing_to_draw_still_makes_a_document() {
        let svg = render_svg(&[]);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("no data").count(), PANELS.len());
        assert!(!svg.contains("NaN"));
    }
}
