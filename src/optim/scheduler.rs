//! Learning rate (and OneCycle momentum) per optimizer step, with the semantics of DeepSpeed's
//! schedulers (deepspeed/runtime/lr_schedules.py).
//!
//! Step indexing: `step` is the 0-based index of the optimizer step about to run, i.e. how many
//! optimizer steps have completed. DeepSpeed sets the lr for the first step when it builds the
//! scheduler (`last_batch_iteration = -1`) and calls `scheduler.step()` after every optimizer
//! step, so optimizer step `k` runs with DeepSpeed's `last_batch_iteration = k - 1`. These
//! functions are pure: resuming at step `k` gives the same value as counting up to it.

use crate::config::{SchedulerSettings, WarmupType};

/// DeepSpeed clamps the warmup length to at least 2 (so that ln(warmup) > 0).
fn warmup_len(n: u64) -> f64 {
    n.max(2) as f64
}

/// Warmup progress in [0, 1) for iteration `it` (>= 0) of an `n`-step warmup.
fn warmup_gamma(it: i64, n: u64, kind: WarmupType) -> f64 {
    let n = warmup_len(n);
    match kind {
        WarmupType::Log => ((it + 1) as f64).ln() / n.ln(),
        WarmupType::Linear => it as f64 / n,
    }
}

/// OneCycle position in its cycle: 0 at cycle_min, 1 at the peak.
fn one_cycle_scale(first: u64, second: Option<u64>, stairs: (u64, Option<u64>), step: u64) -> f64 {
    let first = first as f64;
    let second = second.map_or(first, |s| s as f64);
    let total = first + second;
    let ratio = first / total;
    let b = step as f64;
    let cycle = (1.0 + b / total).floor();
    let x = 1.0 + b / total - cycle;
    let (mut scale, stair_count) = if x <= ratio {
        (x / ratio, stairs.0)
    } else {
        ((x - 1.0) / (ratio - 1.0), stairs.1.unwrap_or(stairs.0))
    };
    if stair_count > 0 {
        // DeepSpeed quantises from the integer batch offset, not from the float scale.
        let ci = b % total;
        let pos = if ci <= first {
            ci * stair_count as f64 / first
        } else {
            (total - ci) * stair_count as f64 / second
        };
        scale = pos.floor() / stair_count as f64;
    }
    scale
}

/// The learning rate for optimizer step `step`. `base_lr` is the optimizer's configured lr:
/// WarmupCosineLR scales it, and WarmupLR without `warmup_max_lr` warms up to it.
pub fn lr_at(s: &SchedulerSettings, base_lr: f64, step: u64) -> f64 {
    let it = i64::try_from(step).unwrap_or(i64::MAX) - 1;
    match *s {
        SchedulerSettings::WarmupLR {
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
        } => {
            if it < 0 {
                return warmup_min_lr;
            }
            let max = warmup_max_lr.unwrap_or(base_lr);
            let gamma = if (it as f64) < warmup_len(warmup_num_steps) {
                warmup_gamma(it, warmup_num_steps, warmup_type)
            } else {
                1.0
            };
            warmup_min_lr + (max - warmup_min_lr) * gamma
        }
        SchedulerSettings::WarmupDecayLR {
            total_num_steps,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
        } => {
            if it < 0 {
                return warmup_min_lr;
            }
            let n = warmup_len(warmup_num_steps);
            let gamma = if (it as f64) < n {
                warmup_gamma(it, warmup_num_steps, warmup_type)
            } else {
                let total = total_num_steps as f64;
                ((total - it as f64) / (total - n).max(1.0)).max(0.0)
            };
            warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma
        }
        SchedulerSettings::WarmupCosineLR {
            total_num_steps,
            warmup_min_ratio,
            warmup_num_steps,
            cos_min_ratio,
            warmup_type,
        } => {
            if it < 0 {
                return 0.0;
            }
            let n = warmup_len(warmup_num_steps);
            let ratio = if (it as f64) < n {
                let r = warmup_gamma(it, warmup_num_steps, warmup_type);
                warmup_min_ratio + r * (1.0 - warmup_min_ratio)
            } else {
                let real_last = it as f64 - n + 1.0;
                let real_total = (total_num_steps as f64 - n).max(1.0);
                let progress = (real_last / real_total).min(1.0);
                let c = (1.0 + (std::f64::consts::PI * progress).cos()) / 2.0;
                (cos_min_ratio + (1.0 - cos_min_ratio) * c).max(0.0)
            };
            base_lr * ratio
        }
        SchedulerSettings::OneCycle {
            cycle_min_lr,
            cycle_max_lr,
            decay_lr_rate,
            cycle_first_step_size,
            cycle_second_step_size,
            cycle_first_stair_count,
            cycle_second_stair_count,
            decay_step_size,
            ..
        } => {
            let total = cycle_first_step_size as f64
                + cycle_second_step_size.unwrap_or(cycle_first_step_size) as f64;
            if (it as f64) < total {
                let scale = one_cycle_scale(
                    cycle_first_step_size,
                    cycle_second_step_size,
                    (cycle_first_stair_count, cycle_second_stair_count),
                    step,
                );
                cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale
            } else if decay_step_size == 0 || decay_lr_rate == 0.0 {
                cycle_min_lr
            } else {
                let decay_it = it as f64 - total + 1.0;
                cycle_min_lr / (1.0 + decay_lr_rate * decay_it / decay_step_size as f64)
            }
        }
        SchedulerSettings::LRRangeTest {
            lr_range_test_min_lr,
            lr_range_test_step_size,
            lr_range_test_step_rate,
            lr_range_test_staircase,
        } => {
            let raw = (it + 1) as f64 / lr_range_test_step_size as f64;
            let interval = if lr_range_test_staircase {
                raw.floor()
            } else {
                raw
            };
            lr_range_test_min_lr * (1.0 + lr_range_test_step_rate * interval)
        }
    }
}

/// Adam betas for optimizer step `step` when the scheduler cycles momentum (OneCycle with
/// `cycle_momentum`, its default); None otherwise. DeepSpeed writes `(momentum, 0.99)`, so
/// beta2 becomes 0.99 whatever the optimizer said; we reproduce that. At step 0 DeepSpeed
/// installs `cycle_min_mom`, and from step 1 on the cycle (which starts at `cycle_max_mom`).
pub fn betas_at(s: &SchedulerSettings, step: u64) -> Option<[f64; 2]> {
    const BETA2: f64 = 0.99;
    let SchedulerSettings::OneCycle {
        cycle_first_step_size,
        cycle_second_step_size,
        cycle_first_stair_count,
        cycle_second_stair_count,
        decay_step_size,
        cycle_momentum,
        cycle_min_mom,
        cycle_max_mom,
        decay_mom_rate,
        ..
    } = *s
    else {
        return None;
    };
    if !cycle_momentum {
        return None;
    }
    if step == 0 {
        return Some([cycle_min_mom, BETA2]);
    }
    let it = step as f64 - 1.0;
    let total = cycle_first_step_size as f64
        + cycle_second_step_size.unwrap_or(cycle_first_step_size) as f64;
    let mom = if it < total {
        let scale = one_cycle_scale(
            cycle_first_step_size,
            cycle_second_step_size,
            (cycle_first_stair_count, cycle_second_stair_count),
            step,
        );
        cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale
    } else if decay_step_size == 0 || decay_mom_rate == 0.0 {
        cycle_max_mom
    } else {
        let decay_it = it - total + 1.0;
        cycle_max_mom * (1.0 + decay_mom_rate * decay_it / decay_step_size as f64)
    };
    Some([mom, BETA2])
}

#[cfg(test)]
mod tests {
    //! Expected values come from DeepSpeed's formulas evaluated in Python (f64), step by step.
    use super::*;

    fn close(got: f64, want: f64) {
        let tol = 1e-12 * want.abs().max(1e-12);
        assert!((got - want).abs() <= tol, "got {got}, want {want}");
    }

    fn table(s: &SchedulerSettings, base: f64, cases: &[(u64, f64)]) {
        for &(step, want) in cases {
            let got = lr_at(s, base, step);
            assert!(
                (got - want).abs() <= 1e-12 * want.abs().max(1e-12),
                "step {step}: got {got}, want {want}"
            );
        }
    }

    #[test]
    fn warmup_lr_log_is_the_default_shape() {
        let s = SchedulerSettings::WarmupLR {
            warmup_min_lr: 0.0,
            warmup_max_lr: Some(1e-3),
            warmup_num_steps: 10,
            warmup_type: WarmupType::Log,
        };
        table(
            &s,
            5.0,
            &[
                (0, 0.0),
                (1, 0.0),
                (2, 0.000_301_029_995_663_981_13),
                (5, 0.000_698_970_004_336_018_8),
                (10, 0.001),
                (11, 0.001),
                (50, 0.001),
            ],
        );
    }

    #[test]
    fn warmup_lr_linear_and_default_max_is_the_optimizer_lr() {
        let s = SchedulerSettings::WarmupLR {
            warmup_min_lr: 1e-5,
            warmup_max_lr: Some(1e-3),
            warmup_num_steps: 10,
            warmup_type: WarmupType::Linear,
        };
        table(
            &s,
            5.0,
            &[
                (0, 1e-5),
                (1, 1e-5),
                (2, 0.000109),
                (5, 0.000406),
                (10, 0.000901),
                (11, 0.001),
            ],
        );
        let s = SchedulerSettings::WarmupLR {
            warmup_min_lr: 0.0,
            warmup_max_lr: None,
            warmup_num_steps: 4,
            warmup_type: WarmupType::Linear,
        };
        close(lr_at(&s, 0.02, 3), 0.01);
        close(lr_at(&s, 0.02, 100), 0.02);
    }

    #[test]
    fn warmup_decay_lr_reaches_zero_at_total_steps() {
        let s = SchedulerSettings::WarmupDecayLR {
            total_num_steps: 20,
            warmup_min_lr: 0.0,
            warmup_max_lr: 1e-3,
            warmup_num_steps: 10,
            warmup_type: WarmupType::Linear,
        };
        table(
            &s,
            0.0,
            &[
                (0, 0.0),
                (1, 0.0),
                (5, 0.0004),
                (10, 0.000_900_000_000_000_000_1),
                (11, 0.001),
                (15, 0.0006),
                (20, 0.0001),
                (21, 0.0),
                (25, 0.0),
            ],
        );
    }

    #[test]
    fn warmup_cosine_lr_scales_the_base_lr_and_clamps_at_the_end() {
        let s = SchedulerSettings::WarmupCosineLR {
            total_num_steps: 20,
            warmup_min_ratio: 0.1,
            warmup_num_steps: 10,
            cos_min_ratio: 0.01,
            warmup_type: WarmupType::Linear,
        };
        table(
            &s,
            2e-3,
            &[
                (0, 0.0),
                (1, 0.0002),
                (5, 0.000_920_000_000_000_000_1),
                (10, 0.00182),
                (11, 0.001_951_545_951_132_202_1),
                (15, 0.00101),
                (20, 2e-5),
                (30, 2e-5),
            ],
        );
    }

    fn one_cycle() -> SchedulerSettings {
        SchedulerSettings::OneCycle {
            cycle_min_lr: 1e-4,
            cycle_max_lr: 1e-3,
            decay_lr_rate: 0.5,
            cycle_first_step_size: 4,
            cycle_second_step_size: Some(6),
            cycle_first_stair_count: 0,
            cycle_second_stair_count: None,
            decay_step_size: 2,
            cycle_momentum: true,
            cycle_min_mom: 0.8,
            cycle_max_mom: 0.9,
            decay_mom_rate: 0.1,
        }
    }

    #[test]
    fn one_cycle_rises_falls_then_decays() {
        table(
            &one_cycle(),
            0.0,
            &[
                (0, 1e-4),
                (1, 0.000_325_000_000_000_000_2),
                (2, 0.000_549_999_999_999_999_9),
                (4, 0.000_999_999_999_999_999_8),
                (6, 0.000_699_999_999_999_999_9),
                (9, 0.000_250_000_000_000_000_17),
                (10, 1e-4),
                (11, 8e-5),
                (12, 6.666_666_666_666_667e-5),
                (14, 5e-5),
            ],
        );
    }

    #[test]
    fn one_cycle_momentum_moves_against_the_lr() {
        let s = one_cycle();
        let want = [
            (0, 0.8),
            (1, 0.875),
            (2, 0.850_000_000_000_000_1),
            (4, 0.8),
            (6, 0.833_333_333_333_333_4),
            (9, 0.883_333_333_333_333_3),
            (10, 0.9),
            (11, 0.945_000_000_000_000_1),
            (14, 1.08),
        ];
        for (step, m) in want {
            let b = betas_at(&s, step).unwrap();
            close(b[0], m);
            assert_eq!(b[1], 0.99);
        }
        let warm = SchedulerSettings::WarmupLR {
            warmup_min_lr: 0.0,
            warmup_max_lr: None,
            warmup_num_steps: 10,
            warmup_type: WarmupType::Log,
        };
        assert_eq!(betas_at(&warm, 3), None);
    }

    #[test]
    fn one_cycle_staircase() {
        let s = SchedulerSettings::OneCycle {
            cycle_min_lr: 0.0,
            cycle_max_lr: 1.0,
            decay_lr_rate: 0.0,
            cycle_first_step_size: 4,
            cycle_second_step_size: None,
            cycle_first_stair_count: 2,
            cycle_second_stair_count: None,
            decay_step_size: 0,
            cycle_momentum: false,
            cycle_min_mom: 0.8,
            cycle_max_mom: 0.9,
            decay_mom_rate: 0.0,
        };
        let got: Vec<f64> = (0..10).map(|k| lr_at(&s, 0.0, k)).collect();
        assert_eq!(got, vec![0.0, 0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn lr_range_test_continuous_and_staircase() {
        let mk = |staircase| SchedulerSettings::LRRangeTest {
            lr_range_test_min_lr: 1e-3,
            lr_range_test_step_size: 4,
            lr_range_test_step_rate: 2.0,
            lr_range_test_staircase: staircase,
        };
        table(
            &mk(false),
            0.0,
            &[
                (0, 0.001),
                (1, 0.0015),
                (3, 0.0025),
                (4, 0.003),
                (9, 0.0055),
            ],
        );
        table(
            &mk(true),
            0.0,
            &[(0, 0.001), (1, 0.001), (3, 0.001), (4, 0.003), (9, 0.005)],
        );
    }
}
