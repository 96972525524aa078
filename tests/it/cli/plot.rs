//! `zerodp plot`: every curve of the SVG holds exactly its metrics file's values (rank 0's, the
//! last line of a repeated step, non-finite values left out), the legend has one entry per curve
//! kind, a run without evaluations has no eval curve, and bad input is named by file and line.

use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

/// (run, metric, x) -> data points.
type Curves = BTreeMap<(String, String, String), Vec<(f64, f64)>>;

fn zerodp(args: &[&str], files: &[&Path]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(args)
        .args(files)
        .output()
        .expect("run zerodp")
}

/// Writes JSON Lines; returns the file's path.
fn write_lines(path: &Path, lines: &[serde_json::Value]) {
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(path, text).unwrap();
}

/// Run `a`: two ranks, 20 steps, an evaluation every 5 steps, a non-finite loss at step 7 (null),
/// no `tokens` key (derived from tokens/s and step time), and steps 16-20 written again by a
/// resumed run with other values. Returns its lines and the curves they must give.
fn run_a() -> (Vec<serde_json::Value>, Curves) {
    let line = |rank: u64, step: u64, shift: f64| {
        let s = step as f64;
        let mut v = json!({
            "rank": rank, "world_size": 2, "stage": 2, "step": step,
            "loss": 5.0 / (1.0 + 0.1 * s) + shift + rank as f64 * 100.0,
            "lr": 1e-3 * (s / 20.0).min(1.0) / 3.0,
            "tokens_per_s": 12345.678 + s * 1.1 + rank as f64,
            "step_time_s": 0.25 + s / 997.0,
            "peak_bytes": 1.5e9 + s * 1.0e6 + shift * 1e9 + rank as f64,
            "model_state_bytes": {"total": 1.0e9},
        });
        if step == 7 {
            v["loss"] = serde_json::Value::Null;
        }
        if step % 5 == 0 {
            v["eval_loss"] = json!(5.5 / (1.0 + 0.1 * s) + shift);
            v["eval_ppl"] = json!((5.5 / (1.0 + 0.1 * s) + shift).exp());
        } else if step % 2 == 0 {
            v["eval_loss"] = serde_json::Value::Null;
        }
        v
    };
    let mut lines = Vec::new();
    for step in 1..=20 {
        lines.push(line(0, step, 0.0));
        lines.push(line(1, step, 0.0));
    }
    for step in 16..=20 {
        lines.push(line(1, step, 0.01));
        lines.push(line(0, step, 0.01));
    }
    let mut curves = Curves::new();
    let mut tokens = 0.0;
    for step in 1..=20 {
        let v = line(0, step, if step >= 16 { 0.01 } else { 0.0 });
        let f = |k: &str| v[k].as_f64();
        tokens += f("tokens_per_s").unwrap() * f("step_time_s").unwrap();
        let s = step as f64;
        for (metric, value) in [
            ("loss", f("loss")),
            ("eval_loss", f("eval_loss")),
            ("lr", f("lr")),
            ("tokens_per_s", f("tokens_per_s")),
            ("peak_bytes", f("peak_bytes")),
        ] {
            let Some(y) = value else { continue };
            let mut xs = vec![("step", s)];
            if metric.contains("loss") {
                xs.push(("tokens", tokens));
            }
            for (x, xv) in xs {
                let key = ("a".to_string(), metric.to_string(), x.to_string());
                curves.entry(key).or_default().push((xv, y));
            }
        }
    }
    (lines, curves)
}

/// Run `b`: one rank, 12 steps, `tokens` given, no evaluation at all.
fn run_b() -> (Vec<serde_json::Value>, Curves) {
    let mut lines = Vec::new();
    let mut curves = Curves::new();
    for step in 1..=12u64 {
        let s = step as f64;
        let (loss, lr, tps, peak) = (4.0 - s.ln(), 3e-4, 2.0e5 / 3.0, 2.0f64.powi(30) * 0.75);
        lines.push(json!({
            "rank": 0, "world_size": 1, "step": step, "loss": loss, "lr": lr,
            "tokens_per_s": tps, "step_time_s": 0.1, "peak_bytes": peak, "tokens": 4096 * step,
        }));
        let mut add = |metric: &str, x: &str, xv: f64, y: f64| {
            let key = ("b".to_string(), metric.to_string(), x.to_string());
            curves.entry(key).or_default().push((xv, y));
        };
        add("loss", "step", s, loss);
        add("loss", "tokens", 4096.0 * s, loss);
        add("lr", "step", s, lr);
        add("tokens_per_s", "step", s, tps);
        add("peak_bytes", "step", s, peak);
    }
    (lines, curves)
}

/// The value of attribute `name` in the element text `tag` (attributes are double-quoted).
fn attr<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let key = format!(" {name}=\"");
    let start = tag.find(&key)? + key.len();
    Some(&tag[start..start + tag[start..].find('"')?])
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

fn pairs(text: &str) -> Vec<(f64, f64)> {
    text.split(' ')
        .map(|p| {
            let (x, y) = p.split_once(',').unwrap_or_else(|| panic!("point {p:?}"));
            (x.parse().unwrap(), y.parse().unwrap())
        })
        .collect()
}

/// The start tags of every element `<name ...>` in `svg`.
fn tags<'a>(svg: &'a str, name: &str) -> Vec<&'a str> {
    let open = format!("<{name} ");
    svg.match_indices(&open)
        .map(|(i, _)| &svg[i..i + svg[i..].find('>').unwrap()])
        .collect()
}

/// The curves of an SVG by (run, metric, x), each checked to have one pixel point per data point.
fn curves_of(svg: &str) -> Curves {
    let mut out = Curves::new();
    for tag in tags(svg, "polyline") {
        assert_eq!(attr(tag, "class"), Some("series"), "{tag}");
        let data = pairs(attr(tag, "data-points").expect("data-points"));
        let pixels = pairs(attr(tag, "points").expect("points"));
        assert_eq!(data.len(), pixels.len(), "{tag}");
        assert!(pixels
            .iter()
            .all(|(x, y)| (0.0..=1200.0).contains(x) && *y >= 0.0));
        let key = (
            unescape(attr(tag, "data-run").unwrap()),
            attr(tag, "data-metric").unwrap().to_string(),
            attr(tag, "data-x").unwrap().to_string(),
        );
        assert!(out.insert(key.clone(), data).is_none(), "{key:?} twice");
    }
    out
}

fn close(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() <= 1e-12 * a.abs().max(b.abs())
}

fn assert_same_curves(got: &Curves, want: &Curves) {
    let got_keys: Vec<_> = got.keys().collect();
    let want_keys: Vec<_> = want.keys().collect();
    assert_eq!(got_keys, want_keys, "the set of curves");
    for (key, want) in want {
        let got = &got[key];
        assert_eq!(got.len(), want.len(), "{key:?}: {got:?}");
        for (g, w) in got.iter().zip(want) {
            assert!(
                close(g.0, w.0) && close(g.1, w.1),
                "{key:?}: {g:?} != {w:?}"
            );
        }
    }
}

#[test]
fn plot_draws_every_curve_with_the_files_values() {
    let dir = tempfile::tempdir().unwrap();
    let (a_lines, a_curves) = run_a();
    let (b_lines, b_curves) = run_b();
    let (a, b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    write_lines(&a, &a_lines);
    write_lines(&b, &b_lines);
    let out = dir.path().join("out.svg");
    let run = zerodp(&["plot"], &[&a, &b, Path::new("-o"), &out]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(stdout.contains("out.svg: 2 runs, 32 steps"), "{stdout}");

    let svg = std::fs::read_to_string(&out).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    let mut want = a_curves;
    want.extend(b_curves);
    assert_eq!(want.len(), 7 + 5, "the test's own expectation");
    assert_same_curves(&curves_of(&svg), &want);

    // One legend entry per run, one more for the run with evaluations.
    let entries: Vec<(String, String)> = tags(&svg, "g")
        .into_iter()
        .filter(|t| attr(t, "class") == Some("legend-entry"))
        .map(|t| {
            let run = unescape(attr(t, "data-run").unwrap());
            (run, attr(t, "data-kind").unwrap().to_string())
        })
        .collect();
    let pair = |r: &str, k: &str| (r.to_string(), k.to_string());
    assert_eq!(
        entries,
        [pair("a", "train"), pair("a", "eval"), pair("b", "train")]
    );
    assert!(svg.contains(">a eval<"), "the eval entry is labelled");
}

#[test]
fn plot_names_runs_and_refuses_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let (b_lines, _) = run_b();
    let b = dir.path().join("b.jsonl");
    write_lines(&b, &b_lines);
    let out = dir.path().join("named.svg");
    // --names, escaped in the SVG, and a repeated name told apart.
    let run = zerodp(
        &["plot", "--names", "r<1>&'\",r<1>&'\""],
        &[&b, &b, Path::new("-o"), &out],
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let svg = std::fs::read_to_string(&out).unwrap();
    let runs: std::collections::BTreeSet<String> =
        curves_of(&svg).keys().map(|k| k.0.clone()).collect();
    let want: std::collections::BTreeSet<String> =
        ["r<1>&'\"", "r<1>&'\"-2"].map(String::from).into();
    assert_eq!(runs, want);
    assert!(!svg.contains("r<1>"));

    // A line that is not JSON: the error names the file and the line, and nothing is written.
    let bad = dir.path().join("bad.jsonl");
    let good = b_lines[0].to_string();
    std::fs::write(
        &bad,
        format!("{good}\n{{\"step\": 2, \"loss\": 1.0\n{good}\n"),
    )
    .unwrap();
    let none = dir.path().join("none.svg");
    let run = zerodp(&["plot"], &[&b, &bad, Path::new("-o"), &none]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(stderr.contains("bad.jsonl: line 2:"), "{stderr}");
    assert!(!none.exists());

    // A line without a loss, and an empty file.
    std::fs::write(&bad, format!("{good}\n{good}\n{{\"step\": 3}}\n")).unwrap();
    let stderr =
        String::from_utf8_lossy(&zerodp(&["plot"], &[&bad, Path::new("-o"), &none]).stderr)
            .to_string();
    assert!(stderr.contains("bad.jsonl: line 3: no `loss`"), "{stderr}");
    std::fs::write(&bad, "").unwrap();
    let stderr =
        String::from_utf8_lossy(&zerodp(&["plot"], &[&bad, Path::new("-o"), &none]).stderr)
            .to_string();
    assert!(stderr.contains("bad.jsonl: no metrics lines"), "{stderr}");

    // The output must not be an input.
    let before = std::fs::read(&b).unwrap();
    let run = zerodp(&["plot"], &[&b, Path::new("-o"), &b]);
    assert!(!run.status.success());
    assert!(String::from_utf8_lossy(&run.stderr).contains("same file"));
    assert_eq!(std::fs::read(&b).unwrap(), before);
}
