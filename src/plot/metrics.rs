//! Metrics files (`train --metrics`, JSON Lines: one object per optimizer step and rank) read
//! back into one [`Run`] per file: one [`Point`] per step, from rank 0's lines (the loss and the
//! learning rate are the same on every rank; throughput and memory are rank 0's), the last line of
//! a step winning, because a resumed run appends the steps it trains again.

use super::PlotError;
use serde_json::Value;
use std::collections::HashSet;
use std::path::Path;

/// One optimizer step of a run. `None` (and NaN in `tokens`) means the line held no finite number
/// there (a `null`, a non-finite loss, a key older files lack): such values are left out of the
/// curves, never drawn as 0.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    /// The optimizer step, counted from 1.
    pub step: u64,
    /// Tokens trained up to and including this step: the line's `tokens`, or derived (see
    /// [`Point::tokens_derived`]); NaN when neither is possible.
    pub tokens: f64,
    pub loss: Option<f64>,
    /// The held-out loss, on the steps where an evaluation ran.
    pub eval_loss: Option<f64>,
    pub eval_ppl: Option<f64>,
    pub lr: Option<f64>,
    pub tokens_per_s: Option<f64>,
    pub step_time_s: Option<f64>,
    /// The largest model-state bytes of the rank so far.
    pub peak_bytes: Option<f64>,
    /// `model_state_bytes.total`: what the rank holds after the step.
    pub model_state_bytes: Option<f64>,
    pub world_size: Option<u64>,
    /// The line had no `tokens` (files of older builds): `tokens` is the previous point's plus
    /// `tokens_per_s * step_time_s` (the global batch's tokens) for each step since it, a running
    /// sum over contiguous steps; a gap (a file that starts after step 1) counts this step's batch
    /// for each missing step.
    pub tokens_derived: bool,
}

/// One training run: its name (in the legend) and its steps, in increasing step order, each step
/// once.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    pub name: String,
    pub points: Vec<Point>,
}

/// A parsed line: whose it is and what it says.
struct Line {
    rank: u64,
    point: Point,
}

/// Reads a metrics file into a run named after the file's stem (callers that plot several files
/// with one stem rename them, see [`unique_names`]). Blank lines are skipped; a line that is not a
/// JSON object with `step` and `loss` is an error naming the file and the line.
pub fn read_metrics(path: &Path) -> Result<Run, PlotError> {
    let text = std::fs::read_to_string(path).map_err(|source| PlotError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let file = path.display().to_string();
    let name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| file.clone());
    let mut lines = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        if raw.trim().is_empty() {
            continue;
        }
        let err = |msg| PlotError::Line {
            file: file.clone(),
            line: i + 1,
            msg,
        };
        let value = parse_json(raw).map_err(|e| err(format!("not a JSON object ({e})")))?;
        lines.push(parse_line(&value).map_err(err)?);
    }
    Run::from_parsed(name, &file, lines)
}

/// Parses one line of JSON. Python's `json` writes non-finite floats as bare `NaN` and
/// `Infinity`, which are not JSON: a line that fails to parse is tried once more with them read as
/// `null`, so that a file post-processed in Python still plots (those values are skipped anyway).
fn parse_json(raw: &str) -> Result<Value, serde_json::Error> {
    serde_json::from_str(raw).or_else(|e| {
        if !(raw.contains("NaN") || raw.contains("Infinity")) {
            return Err(e);
        }
        let fixed = raw
            .replace("-Infinity", "null")
            .replace("Infinity", "null")
            .replace("NaN", "null");
        serde_json::from_str(&fixed).map_err(|_| e)
    })
}

impl Run {
    /// A run with no steps yet, for [`Run::push_line`].
    pub fn new(name: impl Into<String>) -> Run {
        Run {
            name: name.into(),
            points: Vec::new(),
        }
    }

    /// A run from the lines of a metrics file, already parsed; the n-th value is "line n" in
    /// errors, which name the run. Uses rank 0's lines, or, when no line is rank 0's (a file of
    /// other ranks only), the lowest rank's.
    pub fn from_lines(
        name: impl Into<String>,
        lines: impl IntoIterator<Item = Value>,
    ) -> Result<Run, PlotError> {
        let name = name.into();
        let mut parsed = Vec::new();
        for (i, value) in lines.into_iter().enumerate() {
            parsed.push(parse_line(&value).map_err(|msg| PlotError::Line {
                file: name.clone(),
                line: i + 1,
                msg,
            })?);
        }
        let file = name.clone();
        Run::from_parsed(name, &file, parsed)
    }

    /// Adds one metrics line as the run goes (a live plot): rank 0's line becomes the point of
    /// its step, replacing the one there; other ranks' lines are checked and ignored.
    pub fn push_line(&mut self, line: &Value) -> Result<(), PlotError> {
        let parsed = parse_line(line).map_err(|msg| PlotError::BadLine {
            run: self.name.clone(),
            msg,
        })?;
        if parsed.rank == 0 {
            self.insert(parsed.point);
        }
        Ok(())
    }

    /// The run of the lowest rank present among `lines`; `file` names the source in errors.
    fn from_parsed(name: String, file: &str, lines: Vec<Line>) -> Result<Run, PlotError> {
        let Some(rank) = lines.iter().map(|l| l.rank).min() else {
            return Err(PlotError::Empty { file: file.into() });
        };
        let mut run = Run::new(name);
        for line in lines.into_iter().filter(|l| l.rank == rank) {
            run.insert(line.point);
        }
        Ok(run)
    }

    /// Puts `point` at its step's place, replacing an earlier point of the same step, and
    /// derives the tokens of the points from there on again (they depend on the ones before).
    fn insert(&mut self, point: Point) {
        let at = match self.points.binary_search_by_key(&point.step, |p| p.step) {
            Ok(i) => {
                self.points[i] = point;
                i
            }
            Err(i) => {
                self.points.insert(i, point);
                i
            }
        };
        self.derive_tokens(at);
    }

    /// Recomputes the derived `tokens` of `points[from..]` from the last point before them whose
    /// tokens are known (or step 0, 0 tokens); see [`Point::tokens_derived`].
    fn derive_tokens(&mut self, from: usize) {
        let (mut base_step, mut base_tokens) = self.points[..from]
            .iter()
            .rev()
            .find(|p| p.tokens.is_finite())
            .map_or((0, 0.0), |p| (p.step, p.tokens));
        for p in &mut self.points[from..] {
            if p.tokens_derived {
                let batch = p.tokens_per_s.unwrap_or(f64::NAN) * p.step_time_s.unwrap_or(f64::NAN);
                p.tokens = base_tokens + batch * p.step.saturating_sub(base_step) as f64;
            }
            if p.tokens.is_finite() {
                (base_step, base_tokens) = (p.step, p.tokens);
            }
        }
    }
}

/// Checks and reads one metrics line: a JSON object with an integer `step` and a `loss` (a number,
/// or `null` for a non-finite one); the other keys, when present, must be numbers or `null`.
fn parse_line(v: &Value) -> Result<Line, String> {
    if !v.is_object() {
        return Err(format!("not a JSON object but {}", kind(v)));
    }
    let step = integer(v, "step")?.ok_or("no `step` (every metrics line has one)")?;
    if v.get("loss").is_none() {
        return Err("no `loss` (every metrics line has one)".into());
    }
    let tokens = number(v.get("tokens"), "tokens")?;
    Ok(Line {
        rank: integer(v, "rank")?.unwrap_or(0),
        point: Point {
            step,
            tokens: tokens.unwrap_or(f64::NAN),
            loss: number(v.get("loss"), "loss")?,
            eval_loss: number(v.get("eval_loss"), "eval_loss")?,
            eval_ppl: number(v.get("eval_ppl"), "eval_ppl")?,
            lr: number(v.get("lr"), "lr")?,
            tokens_per_s: number(v.get("tokens_per_s"), "tokens_per_s")?,
            step_time_s: number(v.get("step_time_s"), "step_time_s")?,
            peak_bytes: number(v.get("peak_bytes"), "peak_bytes")?,
            model_state_bytes: number(
                v.get("model_state_bytes").and_then(|m| m.get("total")),
                "model_state_bytes.total",
            )?,
            world_size: integer(v, "world_size")?,
            tokens_derived: tokens.is_none(),
        },
    })
}

/// A key that holds a number or nothing: absent and `null` are `None`, and so is a non-finite
/// number; anything else (a string, an object) is an error naming the key.
fn number(v: Option<&Value>, key: &str) -> Result<Option<f64>, String> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64().filter(|x| x.is_finite())),
        Some(other) => Err(format!("`{key}` must be a number, got {}", kind(other))),
    }
}

/// A key that holds a non-negative integer or nothing.
fn integer(v: &Value, key: &str) -> Result<Option<u64>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("`{key}` must be a non-negative integer, got {}", kind(x))),
    }
}

/// What a JSON value is, for messages: the value itself when short.
fn kind(v: &Value) -> String {
    let text = v.to_string();
    match v {
        Value::Object(_) => "an object".into(),
        Value::Array(_) => "an array".into(),
        _ if text.chars().count() <= 40 => text,
        _ => format!("{}...", text.chars().take(40).collect::<String>()),
    }
}

/// Names for runs, one per given name, with repeats told apart by a numeric suffix (`metrics`,
/// `metrics-2`, ...): two files of one stem (`a/metrics.jsonl`, `b/metrics.jsonl`) would otherwise
/// share a legend entry. A suffix never takes a name given to another run.
pub fn unique_names(names: &[String]) -> Vec<String> {
    let given: HashSet<&str> = names.iter().map(String::as_str).collect();
    let mut taken: HashSet<String> = HashSet::new();
    names
        .iter()
        .map(|name| {
            let mut candidate = name.clone();
            let mut k = 2;
            // The name itself may be a given one (its own); a suffixed candidate may not.
            while taken.contains(&candidate) || (k > 2 && given.contains(candidate.as_str())) {
                candidate = format!("{name}-{k}");
                k += 1;
            }
            taken.insert(candidate.clone());
            candidate
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn line(rank: u64, step: u64, loss: f64) -> Value {
        json!({"rank": rank, "step": step, "loss": loss, "lr": 1e-3,
               "tokens_per_s": 1000.0, "step_time_s": 0.5})
    }

    #[test]
    fn a_repeated_step_keeps_its_last_line() {
        let lines = [line(0, 1, 5.0), line(0, 2, 4.0), line(0, 3, 3.0)]
            .into_iter()
            .chain([line(0, 2, 4.5), line(0, 3, 3.5), line(0, 4, 2.5)]);
        let run = Run::from_lines("r", lines).unwrap();
        let steps: Vec<_> = run.points.iter().map(|p| (p.step, p.loss)).collect();
        assert_eq!(
            steps,
            [
                (1, Some(5.0)),
                (2, Some(4.5)),
                (3, Some(3.5)),
                (4, Some(2.5))
            ]
        );
    }

    #[test]
    fn tokens_are_the_running_sum_of_each_steps_batch_when_absent() {
        let run = Run::from_lines("r", (1..=4).map(|s| line(0, s, 1.0))).unwrap();
        let tokens: Vec<_> = run.points.iter().map(|p| p.tokens).collect();
        assert_eq!(tokens, [500.0, 1000.0, 1500.0, 2000.0]);
        assert!(run.points.iter().all(|p| p.tokens_derived));
        // Given tokens win, and derived ones continue from them.
        let mut lines: Vec<_> = (1..=3).map(|s| line(0, s, 1.0)).collect();
        lines[1]["tokens"] = json!(10_000);
        let run = Run::from_lines("r", lines).unwrap();
        let tokens: Vec<_> = run.points.iter().map(|p| p.tokens).collect();
        assert_eq!(tokens, [500.0, 10_000.0, 10_500.0]);
        // A replaced step re-derives the steps after it; a file starting at step 3 counts the
        // missing steps at this step's batch.
        let lines = [line(0, 3, 1.0), line(0, 4, 1.0), line(0, 3, 1.0)];
        let run = Run::from_lines("r", lines).unwrap();
        let tokens: Vec<_> = run.points.iter().map(|p| p.tokens).collect();
        assert_eq!(tokens, [1500.0, 2000.0]);
    }

    #[test]
    fn rank_zero_is_used_else_the_lowest_rank() {
        let lines = [line(1, 1, 9.0), line(0, 1, 5.0), line(1, 2, 9.0)];
        let run = Run::from_lines("r", lines).unwrap();
        assert_eq!(run.points.len(), 1);
        assert_eq!(run.points[0].loss, Some(5.0));
        let lines = [line(3, 1, 3.0), line(2, 1, 2.0), line(2, 2, 2.0)];
        let run = Run::from_lines("r", lines).unwrap();
        assert_eq!(run.points.len(), 2);
        assert!(run.points.iter().all(|p| p.loss == Some(2.0)));
    }

    #[test]
    fn nulls_and_absent_keys_are_none_and_bad_lines_are_named() {
        let v = json!({"step": 1, "loss": null, "eval_loss": 2.5, "peak_bytes": 10,
                       "model_state_bytes": {"total": 7}});
        let run = Run::from_lines("r", [v]).unwrap();
        let p = &run.points[0];
        assert_eq!((p.loss, p.eval_loss, p.lr), (None, Some(2.5), None));
        assert_eq!((p.peak_bytes, p.model_state_bytes), (Some(10.0), Some(7.0)));
        assert!(p.tokens.is_nan());
        for (bad, what) in [
            (json!({"loss": 1.0}), "no `step`"),
            (json!({"step": 1}), "no `loss`"),
            (json!({"step": -1, "loss": 1.0}), "`step`"),
            (json!({"step": 1, "loss": "x"}), "`loss` must be a number"),
            (json!([1, 2]), "not a JSON object"),
        ] {
            let e = Run::from_lines("f", [line(0, 1, 1.0), bad]).unwrap_err();
            let text = e.to_string();
            assert!(
                text.starts_with("f: line 2: ") && text.contains(what),
                "{text}"
            );
        }
        let e = Run::from_lines("f", []).unwrap_err();
        assert!(matches!(e, PlotError::Empty { .. }), "{e}");
    }

    #[test]
    fn a_file_names_its_bad_line_and_python_nan_reads_as_null() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.jsonl");
        let good = line(0, 1, 1.0).to_string();
        std::fs::write(&path, format!("{good}\n\n{{\"step\": 2, \"loss\": NaN}}\n")).unwrap();
        let run = read_metrics(&path).unwrap();
        assert_eq!(run.name, "run");
        assert_eq!(run.points.len(), 2);
        assert_eq!(run.points[1].loss, None);
        std::fs::write(&path, format!("{good}\n{good}\n{{oops\n")).unwrap();
        let e = read_metrics(&path).unwrap_err().to_string();
        assert!(e.contains("run.jsonl: line 3: not a JSON object"), "{e}");
        std::fs::write(&path, "\n").unwrap();
        let e = read_metrics(&path).unwrap_err();
        assert!(matches!(e, PlotError::Empty { .. }), "{e}");
    }

    #[test]
    fn push_line_replaces_and_ignores_other_ranks() {
        let mut run = Run::new("r");
        run.push_line(&line(0, 1, 3.0)).unwrap();
        run.push_line(&line(1, 2, 9.0)).unwrap();
        run.push_line(&line(0, 1, 2.0)).unwrap();
        assert_eq!(run.points.len(), 1);
        assert_eq!(run.points[0].loss, Some(2.0));
        let e = run.push_line(&json!({"step": 1})).unwrap_err().to_string();
        assert!(e.contains("run r") && e.contains("no `loss`"), "{e}");
    }

    #[test]
    fn repeated_names_get_suffixes_that_take_no_given_name() {
        let names: Vec<String> = ["m", "m", "m-2", "x", "m"].map(String::from).into();
        assert_eq!(unique_names(&names), ["m", "m-3", "m-2", "x", "m-4"]);
    }
}
