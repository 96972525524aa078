//! DeepSpeed's batch arithmetic, `train_batch_size = micro * gas * world_size`, with exact
//! division (DeepSpeed floor-divides and then reports a confusing mismatch) and errors that give
//! the numbers, the world size and its source, and the nearest valid choices.

use super::error::{ConfigError, Where};
use super::json::Member;
use super::reader::{Obj, Reader};
use super::settings::BatchSettings;

const TB: &str = "train_batch_size";
const MB: &str = "train_micro_batch_size_per_gpu";
const GAS: &str = "gradient_accumulation_steps";
/// Upper bound for each batch number (keeps the arithmetic exact and the suggestions cheap);
/// `zerodp plan` bounds its batch flags by it too.
pub const MAX_BATCH: u64 = 1 << 31;

/// One of the three keys after "auto" and the command line are applied.
struct Key {
    value: Option<u64>,
    auto: bool,
    at: Where,
}

fn read_key(
    r: &mut Reader<'_>,
    root: Obj<'_>,
    key: &str,
    cli: Option<usize>,
    flag: &str,
) -> Result<Key, ConfigError> {
    let m: Option<&Member> = root.get(key);
    let at = match m {
        Some(m) => r.key_at(key, m),
        None => Where {
            path: key.into(),
            location: None,
        },
    };
    let cli = cli.map(|v| v as u64);
    if let Some(c) = cli {
        if c == 0 || c > MAX_BATCH {
            return Err(ConfigError::OutOfRange {
                at,
                message: format!("{flag} {c} must be between 1 and 2^31"),
            });
        }
    }
    let Some(m) = m else {
        return Ok(Key {
            value: cli,
            auto: false,
            at,
        });
    };
    if m.node.is_auto() {
        return Ok(Key {
            value: cli,
            auto: true,
            at,
        });
    }
    let v = r.node_u64(key, &m.node)?;
    if v > MAX_BATCH {
        return Err(ConfigError::OutOfRange {
            at,
            message: format!("{v} is larger than 2^31; batch sizes count samples"),
        });
    }
    if v == 0 {
        return Err(ConfigError::OutOfRange {
            at,
            message: "must be at least 1".into(),
        });
    }
    if let Some(c) = cli {
        if c != v {
            return Err(ConfigError::Invalid {
                at,
                message: format!(
                    "the config says {v} but {flag} says {c}; change one of them (or write \
                     \"auto\" in the config to take the command line's value)"
                ),
            });
        }
    }
    Ok(Key {
        value: Some(v),
        auto: false,
        at,
    })
}

/// Multiples of `m` around `x` (below and above), excluding 0.
fn multiples_near(x: u128, m: u128) -> Vec<u128> {
    let lo = x / m * m;
    let mut out = Vec::new();
    if lo > 0 {
        out.push(lo);
    }
    out.push(lo + m);
    out
}

/// Divisors of `n` nearest to `target` (one at or below, one above).
fn divisors_near(n: u128, target: u128) -> Vec<u128> {
    let mut below = None;
    let mut above = None;
    let mut d = 1;
    while d * d <= n {
        if n % d == 0 {
            for c in [d, n / d] {
                if c <= target && below.is_none_or(|b| c > b) {
                    below = Some(c);
                }
                if c > target && above.is_none_or(|a| c < a) {
                    above = Some(c);
                }
            }
        }
        d += 1;
    }
    below.into_iter().chain(above).collect()
}

fn list(name: &str, values: &[u128], note: &str) -> Option<String> {
    if values.is_empty() {
        return None;
    }
    let v: Vec<String> = values.iter().map(|v| v.to_string()).collect();
    Some(format!("{name} {}{note}", v.join(" or ")))
}

/// Resolves the three batch numbers for `r.ctx.world_size`.
pub(crate) fn resolve(r: &mut Reader<'_>, root: Obj<'_>) -> Result<BatchSettings, ConfigError> {
    let ctx = r.ctx;
    // u128: three values below 2^31 times any world size cannot overflow.
    let w = ctx.world_size.max(1) as u128;
    let tb = read_key(r, root, TB, ctx.train_batch_size, "--train-batch-size")?;
    let mb = read_key(r, root, MB, ctx.micro_batch, "--micro-batch")?;
    let gas = read_key(r, root, GAS, None, "")?;
    let wide = |v: Option<u64>| v.map(u128::from);
    let Some(solved) = solve(wide(tb.value), wide(mb.value), wide(gas.value), w) else {
        return no_batch_size(r, [&tb, &mb, &gas]);
    };
    let (t, m, g) = solved.map_err(|e| ConfigError::BatchMismatch {
        at: tb.at.clone(),
        detail: e.detail,
        world_size: ctx.world_size.max(1),
        world_size_source: ctx.world_size_source.clone(),
        suggestions: e.suggestions.into_iter().flatten().collect(),
    })?;
    if gas.auto {
        r.warn(format!(
            "{GAS}: \"auto\" resolved to {g} from {TB} {t}, {MB} {m} and world size {w}"
        ));
    }
    let fits = |v: u128| usize::try_from(v).ok();
    let (Some(tu), Some(mu), Some(gu)) = (fits(t), fits(m), fits(g)) else {
        return Err(ConfigError::OutOfRange {
            at: tb.at,
            message: format!("train_batch_size {t} is too large"),
        });
    };
    Ok(BatchSettings {
        train_batch_size: tu,
        micro_batch_per_gpu: mu,
        gradient_accumulation_steps: gu,
        world_size: ctx.world_size.max(1),
    })
}

/// Why the given batch sizes do not multiply out, and the nearest values that would.
#[derive(Debug)]
struct Mismatch {
    detail: String,
    suggestions: Vec<Option<String>>,
}

/// DeepSpeed's batch rule `t = m x g x w` with the missing sizes derived (g defaults to 1):
/// `(t, m, g)`, a mismatch, or `None` when neither `t` nor `m` is given.
fn solve(
    t: Option<u128>,
    m: Option<u128>,
    g: Option<u128>,
    w: u128,
) -> Option<Result<(u128, u128, u128), Mismatch>> {
    let mismatch = |detail: String, suggestions| {
        Some(Err(Mismatch {
            detail,
            suggestions,
        }))
    };
    Some(Ok(match (t, m, g) {
        (Some(t), Some(m), Some(g)) if t != m * g * w => {
            return mismatch(
                format!(
                    "{TB} {t} must equal {MB} {m} x {GAS} {g} x world size {w} = {}",
                    m * g * w
                ),
                vec![
                    list(TB, &[m * g * w], ""),
                    (t % (m * w) == 0).then(|| format!("{GAS} {}", t / (m * w))),
                    (t % (g * w) == 0).then(|| format!("{MB} {}", t / (g * w))),
                    (t % (m * g) == 0).then(|| format!("world size {}", t / (m * g))),
                ],
            )
        }
        (Some(t), Some(m), Some(g)) => (t, m, g),
        (Some(t), Some(m), None) if t % (m * w) != 0 => {
            return Some(Err(indivisible(t, (MB, m), w)))
        }
        (Some(t), Some(m), None) => (t, m, t / (m * w)),
        (Some(t), None, Some(g)) if t % (g * w) != 0 => {
            return Some(Err(indivisible(t, (GAS, g), w)))
        }
        (Some(t), None, Some(g)) => (t, t / (g * w), g),
        (None, Some(m), Some(g)) => (m * g * w, m, g),
        (Some(t), None, None) if t % w != 0 => {
            return mismatch(
                format!(
                    "{TB} {t} must equal {MB} x {GAS} 1 x world size {w}, but {t} is not a \
                     multiple of {w}"
                ),
                vec![
                    list(TB, &multiples_near(t, w), ""),
                    list("world size", &divisors_near(t, w), ""),
                ],
            )
        }
        (Some(t), None, None) => (t, t / w, 1),
        (None, Some(m), None) => (m * w, m, 1),
        (None, None, _) => return None,
    }))
}

/// `t` is not a multiple of `k x w`, where `k` is the given one of the micro-batch and the
/// accumulation steps (`key`), so the other would not be whole: the nearest totals, values of `key`
/// and world sizes that would be.
fn indivisible(t: u128, (key, k): (&str, u128), w: u128) -> Mismatch {
    let (other, sizes) = match key {
        MB => (GAS, format!("{MB} {k} x {GAS}")),
        _ => (MB, format!("{MB} x {GAS} {k}")),
    };
    Mismatch {
        detail: format!(
            "{TB} {t} must equal {sizes} x world size {w}, but {t} is not a multiple of {k} x {w} \
             = {}, so {other} would be {:.2}",
            k * w,
            t as f64 / (k * w) as f64
        ),
        suggestions: vec![
            list(TB, &multiples_near(t, k * w), ""),
            (t % w == 0)
                .then(|| list(key, &divisors_near(t / w, k), ""))
                .flatten(),
            (t % k == 0)
                .then(|| list("world size", &divisors_near(t / k, w), ""))
                .flatten(),
        ],
    }
}

/// Neither `train_batch_size` nor `train_micro_batch_size_per_gpu` has a value: under `zerodp
/// config check` an unresolved `"auto"` is reported and the sizes left 0; otherwise an error that
/// says which to give.
fn no_batch_size(
    r: &mut Reader<'_>,
    [tb, mb, gas]: [&Key; 3],
) -> Result<BatchSettings, ConfigError> {
    let any_auto = tb.auto || mb.auto;
    if any_auto && r.ctx.check_mode {
        for (k, key) in [(tb, TB), (mb, MB), (gas, GAS)] {
            if k.auto || k.value.is_none() {
                r.unresolved.push(key.to_string());
            }
        }
        r.warn(format!(
            "{TB} / {MB}: \"auto\" is unresolved; pass --train-batch-size or \
             --micro-batch to resolve the batch sizes"
        ));
        return Ok(BatchSettings {
            train_batch_size: 0,
            micro_batch_per_gpu: 0,
            gradient_accumulation_steps: gas.value.unwrap_or(0) as usize,
            world_size: r.ctx.world_size.max(1),
        });
    }
    if any_auto {
        return Err(ConfigError::UnresolvedAuto {
            at: if tb.auto {
                tb.at.clone()
            } else {
                mb.at.clone()
            },
            hint: "\"auto\" batch sizes need --train-batch-size or --micro-batch on the command \
                   line"
                .into(),
        });
    }
    Err(ConfigError::Missing {
        at: Where {
            path: String::new(),
            location: None,
        },
        key: format!("{TB} / {MB}"),
        hint: "give train_batch_size or train_micro_batch_size_per_gpu (or both)".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_choices() {
        assert_eq!(multiples_near(10, 6), vec![6, 12]);
        assert_eq!(multiples_near(3, 4), vec![4]);
        assert_eq!(divisors_near(16, 3), vec![2, 4]);
        assert_eq!(divisors_near(16, 16), vec![16]);
    }

    #[test]
    fn the_missing_sizes_are_derived_from_t_equals_m_g_w() {
        let ok = |t, m, g, w| solve(t, m, g, w).map(|r| r.ok());
        // train_batch_size 32 on 4 ranks: micro-batch 4 gives 2 accumulation steps.
        assert_eq!(ok(Some(32), Some(4), None, 4), Some(Some((32, 4, 2))));
        assert_eq!(ok(Some(32), None, Some(2), 4), Some(Some((32, 4, 2))));
        assert_eq!(ok(None, Some(4), Some(2), 4), Some(Some((32, 4, 2))));
        assert_eq!(ok(None, Some(4), None, 4), Some(Some((16, 4, 1))));
        assert_eq!(ok(Some(32), None, None, 4), Some(Some((32, 8, 1))));
        assert_eq!(ok(Some(32), Some(4), Some(2), 4), Some(Some((32, 4, 2))));
        // Neither the total nor the micro-batch: nothing to derive from.
        assert!(solve(None, None, Some(2), 4).is_none());
    }

    #[test]
    fn sizes_that_do_not_multiply_out_say_why_and_what_would() {
        let e = solve(Some(30), Some(4), None, 4).unwrap().unwrap_err();
        assert!(e.detail.contains("not a multiple of 4 x 4 = 16"), "{e:?}");
        let s: Vec<String> = e.suggestions.into_iter().flatten().collect();
        assert!(
            s.iter().any(|x| x.starts_with(TB) && x.contains("16")),
            "{s:?}"
        );
        let e = solve(Some(32), Some(4), Some(4), 4).unwrap().unwrap_err();
        assert!(e.detail.contains("= 64"), "{e:?}");
        let s: Vec<String> = e.suggestions.into_iter().flatten().collect();
        assert!(s.contains(&format!("{GAS} 2")), "{s:?}");
        assert!(s.contains(&format!("{MB} 2")), "{s:?}");
        assert!(s.contains(&"world size 2".to_string()), "{s:?}");
        assert!(solve(Some(30), None, None, 4).unwrap().is_err());
        assert!(solve(Some(30), None, Some(2), 4).unwrap().is_err());
    }
}
