//! `zerodp bench ops --threads 1,2,...`: how each op of a rank's step scales with the rank's
//! threads, and where a rank with many more threads would spend its step.
//!
//! WHY: the 16-core check of a rank's scaling needs a machine this project reaches rarely. From
//! two thread counts `a < b` that a small machine has, each op's measured speedup
//! `S = t(a) / t(b)` gives its serial fraction by the Karp-Flatt metric,
//! `e = (1/S - a/b) / (1 - a/b)` (the part of its time that did not divide over the added threads:
//! a single-threaded region, packing, a barrier, memory bandwidth already spent), and Amdahl's law
//! then projects its time on `P` threads, `t(a) * (e + (1 - e) * a / P)`. The projection is only as
//! good as the assumption that `e` stays fixed (bandwidth-bound ops saturate sooner on a real
//! server, and fixed-cost regions cost more with more threads), so it ranks where a `P`-thread rank
//! loses rather than predicting its speed; the 16-core machine measures it.

use super::bench_ops::OpsReport;

/// One op (or phase of the measured step) across the thread counts.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ScalingRow {
    pub op: String,
    /// Milliseconds per training step at each thread count (`threads`), the op's count included.
    pub ms: Vec<f64>,
    /// `ms` at the fewest threads over `ms` at the most.
    pub speedup: f64,
    /// The Karp-Flatt serial fraction from the fewest to the most threads, clamped to [0, 1].
    pub serial_fraction: f64,
    /// Amdahl's projection of `ms` to `project_threads`.
    pub projected_ms: f64,
}

/// The scaling table (`scaling` in `--format json`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Scaling {
    pub threads: Vec<usize>,
    pub project_threads: usize,
    /// Every op of the step, then the measured step's phases and the step itself.
    pub rows: Vec<ScalingRow>,
    /// Sum of the ops' `projected_ms`, and the speedup of that sum over the ops at the fewest
    /// threads.
    pub ops_projected_ms: f64,
    pub ops_projected_speedup: f64,
}

/// The Karp-Flatt serial fraction of a speedup `speedup` from `a` to `b > a` threads, clamped to
/// [0, 1] (a superlinear or slower-with-more-threads measurement says 0 or 1).
pub fn serial_fraction(speedup: f64, a: usize, b: usize) -> f64 {
    let ratio = a as f64 / b as f64;
    if speedup <= 0.0 || ratio >= 1.0 {
        return 1.0;
    }
    ((1.0 / speedup - ratio) / (1.0 - ratio)).clamp(0.0, 1.0)
}

/// Amdahl's time on `p` threads of work that took `ms` on `a` threads with serial fraction `e`.
pub fn projected_ms(ms: f64, e: f64, a: usize, p: usize) -> f64 {
    ms * (e + (1.0 - e) * a as f64 / p as f64)
}

/// Milliseconds of one phase of a report's measured step.
type PhaseOf = fn(&OpsReport) -> f64;

fn row(op: String, ms: Vec<f64>, threads: &[usize], project: usize) -> ScalingRow {
    let (first, last) = (ms[0], ms[ms.len() - 1]);
    let (a, b) = (threads[0], threads[threads.len() - 1]);
    let speedup = if last > 0.0 { first / last } else { 0.0 };
    let e = serial_fraction(speedup, a, b);
    ScalingRow {
        op,
        projected_ms: projected_ms(first, e, a, project),
        ms,
        speedup,
        serial_fraction: e,
    }
}

/// The table from reports of the same model at increasing thread counts (at least two; the
/// reports list the same ops in the same order, as `bench ops` measures them).
pub fn scaling(reports: &[OpsReport], project_threads: usize) -> Scaling {
    let mut order: Vec<&OpsReport> = reports.iter().collect();
    order.sort_by_key(|r| r.threads);
    let threads: Vec<usize> = order.iter().map(|r| r.threads).collect();
    let mut rows: Vec<ScalingRow> = order[0]
        .ops
        .iter()
        .enumerate()
        .map(|(i, op)| {
            let ms = order.iter().map(|r| r.ops[i].step_ms).collect();
            row(op.op.clone(), ms, &threads, project_threads)
        })
        .collect();
    let phases: [(&str, PhaseOf); 4] = [
        ("step: forward", |r| r.step_phases.forward * 1e3),
        ("step: backward", |r| r.step_phases.backward * 1e3),
        ("step: optimizer", |r| r.step_phases.optimizer * 1e3),
        ("step (measured)", |r| r.step_ms),
    ];
    for (name, of) in phases {
        let ms = order.iter().map(|r| of(r)).collect();
        rows.push(row(name.to_string(), ms, &threads, project_threads));
    }
    let ops = &rows[..order[0].ops.len()];
    let ops_projected_ms: f64 = ops.iter().map(|r| r.projected_ms).sum();
    let ops_first_ms: f64 = ops.iter().map(|r| r.ms[0]).sum();
    Scaling {
        threads,
        project_threads,
        ops_projected_speedup: ops_first_ms / ops_projected_ms,
        ops_projected_ms,
        rows,
    }
}

pub fn print(s: &Scaling) -> anyhow::Result<()> {
    let counts: Vec<String> = s.threads.iter().map(|t| format!("{t}t ms")).collect();
    outln!(
        "scaling over the rank's threads ({}), serial fraction by Karp-Flatt from {} to {} threads, \
         projected to {} threads by Amdahl (a ranking of where a {}-thread rank loses, not a \
         prediction of its speed)",
        s.threads
            .iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        s.threads[0],
        s.threads[s.threads.len() - 1],
        s.project_threads,
        s.project_threads
    );
    let head: String = counts.iter().map(|c| format!(" {c:>9}")).collect();
    outln!(
        "{:<26}{head} {:>8} {:>8} {:>10} {:>7}",
        "op",
        "speedup",
        "serial",
        format!("@{} ms", s.project_threads),
        "share"
    );
    let n_ops = s.rows.len() - 4;
    for (i, r) in s.rows.iter().enumerate() {
        if i == n_ops {
            outln!(
                "{:<26} ops projected: {:.2} ms per step, {:.2}x the {} thread(s)",
                "",
                s.ops_projected_ms,
                s.ops_projected_speedup,
                s.threads[0]
            );
        }
        let ms: String = r.ms.iter().map(|m| format!(" {m:>9.2}")).collect();
        let share = match i < n_ops {
            true => format!("{:>6.1}%", r.projected_ms / s.ops_projected_ms * 100.0),
            false => "-".into(),
        };
        outln!(
            "{:<26}{ms} {:>7.2}x {:>8.3} {:>10.2} {:>7}",
            r.op,
            r.speedup,
            r.serial_fraction,
            r.projected_ms,
            share
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serial_fraction_is_zero_for_perfect_scaling_and_one_for_none() {
        assert_eq!(serial_fraction(2.0, 1, 2), 0.0);
        assert_eq!(serial_fraction(1.0, 1, 2), 1.0);
        assert_eq!(serial_fraction(8.0, 2, 16), 0.0);
        // Slower with more threads, or faster than linear: clamped.
        assert_eq!(serial_fraction(0.8, 1, 2), 1.0);
        assert_eq!(serial_fraction(2.5, 1, 2), 0.0);
    }

    #[test]
    fn karp_flatt_recovers_the_serial_fraction_amdahl_was_given() {
        // Work with serial fraction 0.2: on 2 threads it takes 0.2 + 0.8 / 2 = 0.6 of 1 thread.
        for e in [0.0, 0.05, 0.2, 0.5, 0.9] {
            let t2 = projected_ms(100.0, e, 1, 2);
            let got = serial_fraction(100.0 / t2, 1, 2);
            assert!((got - e).abs() < 1e-12, "{e} -> {got}");
            // From 2 to 8 threads as well.
            let (t2, t8) = (projected_ms(100.0, e, 1, 2), projected_ms(100.0, e, 1, 8));
            let from_two = serial_fraction(t2 / t8, 2, 8);
            // Relative to 2 threads the serial part is e / (e + (1 - e) / 2) of the time.
            let expected = e / (e + (1.0 - e) / 2.0);
            assert!(
                (from_two - expected).abs() < 1e-12,
                "{e}: {from_two} vs {expected}"
            );
        }
    }

    #[test]
    fn projection_to_sixteen_threads() {
        // Half serial: 16 threads take 0.5 + 0.5 / 16 of one thread's time.
        assert!((projected_ms(160.0, 0.5, 1, 16) - 85.0).abs() < 1e-12);
        assert!((projected_ms(160.0, 0.0, 2, 16) - 20.0).abs() < 1e-12);
    }
}
