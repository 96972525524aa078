//! Axis ticks at round numbers (1, 2 or 5 times a power of ten) and their labels: SI suffixes
//! for large counts (`1.5k`, `3M`), powers of ten for small ones (`3e-4`, learning rates), binary
//! units for bytes (`1.5 GiB`). Labels of one axis share one scale and one number of decimals, so
//! that they read as a column.

/// What an axis counts, which decides how its labels read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Units {
    Plain,
    Bytes,
}

/// An axis: the range it spans (its first and last tick) and its ticks with their labels.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Axis {
    pub lo: f64,
    pub hi: f64,
    pub ticks: Vec<(f64, String)>,
}

impl Axis {
    /// An axis over the finite data range `[min, max]`, with about `target` intervals.
    pub fn new(min: f64, max: f64, target: usize, units: Units) -> Axis {
        let (min, max) = widen(min, max);
        let (div, suffix) = match units {
            Units::Bytes => binary_unit(min.abs().max(max.abs())),
            Units::Plain => (1.0, ""),
        };
        let (ks, step) = nice_ticks(min / div, max / div, target);
        let scale = (ks[0] as f64 * step)
            .abs()
            .max((ks[ks.len() - 1] as f64 * step).abs());
        let ticks: Vec<(f64, String)> = ks
            .iter()
            .map(|&k| {
                let v = k as f64 * step;
                let label = match units {
                    Units::Bytes if v == 0.0 => "0".to_string(),
                    Units::Bytes => format!("{} {suffix}", decimal(v, step)),
                    Units::Plain => si(v, step, scale),
                };
                (v * div, label)
            })
            .collect();
        Axis {
            lo: ticks[0].0,
            hi: ticks[ticks.len() - 1].0,
            ticks,
        }
    }
}

/// A range with some width: a single value `v` becomes `v ± |v|/2` (or `± 1` around 0), and a
/// range too narrow for an f64 tick step the same around its middle.
fn widen(min: f64, max: f64) -> (f64, f64) {
    if max - min > max.abs().max(min.abs()) * 1e-9 {
        return (min, max);
    }
    let mid = (min + max) / 2.0;
    let d = if mid == 0.0 { 1.0 } else { mid.abs() / 2.0 };
    (mid - d, mid + d)
}

/// The largest binary unit (B, KiB, ... PiB) not above `max`, as its size and its name.
fn binary_unit(max: f64) -> (f64, &'static str) {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut i = 0;
    while i + 1 < UNITS.len() && max >= 1024f64.powi(i as i32 + 1) {
        i += 1;
    }
    (1024f64.powi(i as i32), UNITS[i])
}

/// The ticks covering `[lo, hi]` (with `hi > lo`) at a round step near `(hi - lo) / target`:
/// the tick values are `k * step` for the returned integers `k`, so that labels do not carry
/// the rounding of repeated additions.
pub(crate) fn nice_ticks(lo: f64, hi: f64, target: usize) -> (Vec<i64>, f64) {
    let raw = (hi - lo) / target.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    // (With a margin for the rounding of `raw / mag`: 0.2 / 0.1 is a 2.)
    let step = match raw / mag - 1e-9 {
        n if n <= 1.0 => 1.0,
        n if n <= 2.0 => 2.0,
        n if n <= 5.0 => 5.0,
        _ => 10.0,
    } * mag;
    // A data bound a hair past a tick (rounding) does not add a whole interval.
    let first = (lo / step + 1e-9).floor() as i64;
    let last = (hi / step - 1e-9).ceil() as i64;
    ((first..=last.max(first + 1)).collect(), step)
}

/// Decimals that show a multiple of `step` exactly (at most 12).
fn decimals(step: f64) -> usize {
    (-(step.log10() + 1e-9).floor()).clamp(0.0, 12.0) as usize
}

/// `v` with the decimals of `step`.
fn decimal(v: f64, step: f64) -> String {
    let text = format!("{:.*}", decimals(step), v);
    // `-0.0` reads as noise on an axis.
    match text
        .trim_start_matches('-')
        .chars()
        .all(|c| c == '0' || c == '.')
    {
        true => text.trim_start_matches('-').to_string(),
        false => text,
    }
}

/// A label on an axis whose largest tick is `scale`: SI suffixes from a thousand up, plain
/// decimals from 0.01, a power of ten (the axis's) below.
pub(crate) fn si(v: f64, step: f64, scale: f64) -> String {
    const SI: [(f64, &str); 5] = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")];
    if v == 0.0 {
        return "0".into();
    }
    if let Some(&(div, suffix)) = SI.iter().find(|(d, _)| scale >= *d) {
        return format!("{}{suffix}", decimal(v / div, step / div));
    }
    if scale >= 1e-2 {
        return decimal(v, step);
    }
    let e = scale.log10().floor() as i32;
    let p = 10f64.powi(e);
    format!("{}e{e}", decimal(v / p, step / p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(a: &Axis) -> Vec<&str> {
        a.ticks.iter().map(|(_, l)| l.as_str()).collect()
    }

    #[test]
    fn ticks_are_round_and_cover_the_data() {
        let a = Axis::new(1.0, 150.0, 5, Units::Plain);
        assert_eq!(labels(&a), ["0", "50", "100", "150"]);
        assert_eq!((a.lo, a.hi), (0.0, 150.0));
        let a = Axis::new(1.73, 4.61, 5, Units::Plain);
        assert_eq!(labels(&a), ["1", "2", "3", "4", "5"]);
        assert!(a.lo <= 1.73 && a.hi >= 4.61);
        // Exactly on ticks: no extra interval from rounding.
        let a = Axis::new(0.0, 1.0, 5, Units::Plain);
        assert_eq!(labels(&a), ["0", "0.2", "0.4", "0.6", "0.8", "1.0"]);
        let a = Axis::new(-3.0, 3.0, 6, Units::Plain);
        assert_eq!(labels(&a), ["-3", "-2", "-1", "0", "1", "2", "3"]);
    }

    #[test]
    fn labels_carry_si_suffixes_and_powers_of_ten() {
        let a = Axis::new(0.0, 3_000_000.0, 6, Units::Plain);
        assert_eq!(
            labels(&a),
            ["0", "0.5M", "1.0M", "1.5M", "2.0M", "2.5M", "3.0M"]
        );
        let a = Axis::new(1200.0, 9800.0, 5, Units::Plain);
        assert_eq!(labels(&a), ["0", "2k", "4k", "6k", "8k", "10k"]);
        let a = Axis::new(0.0, 6e-4, 6, Units::Plain);
        assert_eq!(
            labels(&a),
            ["0", "1e-4", "2e-4", "3e-4", "4e-4", "5e-4", "6e-4"]
        );
        let a = Axis::new(1e-4, 2.5e-4, 3, Units::Plain);
        assert_eq!(labels(&a), ["1.0e-4", "1.5e-4", "2.0e-4", "2.5e-4"]);
        assert_eq!(si(12_345_678_901.0, 1e9, 2e10), "12G");
    }

    #[test]
    fn bytes_read_in_binary_units() {
        let gib = 1024f64.powi(3);
        let a = Axis::new(0.3 * gib, 2.2 * gib, 4, Units::Bytes);
        assert_eq!(
            labels(&a),
            ["0", "0.5 GiB", "1.0 GiB", "1.5 GiB", "2.0 GiB", "2.5 GiB"]
        );
        assert_eq!(a.ticks[1].0, 0.5 * gib);
        let a = Axis::new(
            100.0 * 1024.0 * 1024.0,
            400.0 * 1024.0 * 1024.0,
            3,
            Units::Bytes,
        );
        assert_eq!(labels(&a), ["100 MiB", "200 MiB", "300 MiB", "400 MiB"]);
        let a = Axis::new(10.0, 20.0, 2, Units::Bytes);
        assert_eq!(labels(&a), ["10 B", "15 B", "20 B"]);
    }

    #[test]
    fn a_single_value_gets_an_axis_around_it() {
        let a = Axis::new(3e-4, 3e-4, 4, Units::Plain);
        assert!(a.lo < 3e-4 && a.hi > 3e-4, "{a:?}");
        let a = Axis::new(0.0, 0.0, 4, Units::Plain);
        assert!(a.lo < 0.0 && a.hi > 0.0, "{a:?}");
        let a = Axis::new(7.0, 7.0, 4, Units::Plain);
        assert!(a.lo <= 3.5 && a.hi >= 10.5 && a.ticks.len() <= 8, "{a:?}");
    }
}
