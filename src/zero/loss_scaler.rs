//! fp16 loss scaling with DeepSpeed's semantics, and the Inf/NaN guard for bf16 and fp32.
//!
//! fp16 has 5 exponent bits: small gradients underflow to zero unless the loss is multiplied by
//! a large scale before backward (and the gradients divided by it before the optimizer step,
//! which [`crate::optim::adam::adam_step`] does through its `grad_scale` argument). Too large a
//! scale overflows to Inf/NaN instead; then the step is skipped and the scale lowered.
//!
//! [`LossScaler`] reproduces `deepspeed/runtime/fp16/loss_scaler.py` (`DynamicLossScaler`,
//! `LossScaler`) decision for decision: the same hysteresis, the same window arithmetic, the same
//! error at the minimum scale, so a DeepSpeed fp16 config behaves the same here. It is driven by
//! plain numbers ([`DynamicScaleParams`], a static scale) so that it does not depend on the
//! config module; the engine maps the `fp16` block onto them.
//!
//! [`NonFiniteGuard`] is the check DeepSpeed lacks for bf16 and fp32: a step whose gradients hold
//! Inf/NaN is skipped instead of being written into the weights, and a run of such steps ends the
//! training with an error naming the units involved.

use std::fmt;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// What to try when steps keep overflowing, whatever the precision.
const COMMON_ADVICE: &str = "a lower learning rate or a longer warmup; `gradient_clipping` (for \
     example 1.0); checking the data for empty, corrupt or extreme samples";

/// Moving off fp16, for fp16 runs only.
const BF16_ADVICE: &str = "bf16 instead of fp16 (`\"bf16\": {\"enabled\": true}`, same range as \
     fp32, no loss scaling needed)";

/// What to try when steps of a `precision` run (`"fp16"`, `"bf16"`, `"fp32"`) keep overflowing:
/// only fp16 runs are told to move to bf16 and about loss scaling. A static fp16 scale is told to
/// scale dynamically, a dynamic one at its floor to let the scale fall further.
fn advice(precision: &str, dynamic_scale: bool) -> String {
    match (precision, dynamic_scale) {
        ("fp16", true) => format!(
            "try: {BF16_ADVICE}; {COMMON_ADVICE}; and a lower `fp16.min_loss_scale` (for example \
             0.0001) so the scale can fall further, or a lower `fp16.initial_scale_power`"
        ),
        ("fp16", false) => format!(
            "try: {BF16_ADVICE}; {COMMON_ADVICE}; and dynamic loss scaling (`fp16.loss_scale: 0`) \
             or a lower static `fp16.loss_scale`"
        ),
        // bf16 has fp32's range: Inf/NaN here is divergence or bad data, not a range problem.
        _ => format!("try: {COMMON_ADVICE}"),
    }
}

/// Errors of loss scaling and of the non-finite guard.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum LossScaleError {
    /// A loss-scaling setting is out of range.
    #[error("invalid loss-scaling setting `{key}` = {value}: {reason}")]
    InvalidSetting {
        /// The DeepSpeed `fp16` key the value comes from.
        key: &'static str,
        /// The rejected value, as given.
        value: String,
        /// What the value must be.
        reason: &'static str,
    },
    /// An fp16 step overflowed while the scale was already at `min_loss_scale` (DeepSpeed:
    /// "Current loss scale already at minimum - cannot decrease scale anymore").
    #[error(
        "fp16 loss scale is already at its minimum ({min_scale}) and optimizer step {iteration} \
         overflowed again: {consecutive_overflows} optimizer steps in a row had Inf/NaN \
         gradients (units: {}); the run cannot make progress. To recover, {}",
        list_units(units),
        advice("fp16", true)
    )]
    MinimumScaleReached {
        /// `min_loss_scale`.
        min_scale: f64,
        /// Optimizer-step count (0-based, counting skipped steps) of the failing step.
        iteration: u64,
        /// Overflowed steps in a row, including this one.
        consecutive_overflows: u64,
        /// Units whose gradients held Inf/NaN during those steps, in order of first appearance.
        units: Vec<String>,
    },
    /// Too many bf16/fp32 steps in a row had non-finite gradients.
    #[error(
        "{consecutive} optimizer steps in a row had Inf/NaN {precision} gradients (units: {}) \
         and were skipped; stopping after the limit of {limit}. To recover, {}",
        list_units(units),
        advice(precision, false)
    )]
    NonFiniteGradients {
        /// The training precision (`"bf16"` or `"fp32"`), for the message.
        precision: &'static str,
        /// Skipped steps in a row.
        consecutive: u64,
        /// The configured limit.
        limit: u64,
        /// Units whose gradients held Inf/NaN during those steps, in order of first appearance.
        units: Vec<String>,
    },
}

/// `a, b, c` for at most 12 names, then `and N more`; `none reported` when empty.
fn list_units(units: &[String]) -> String {
    const SHOWN: usize = 12;
    if units.is_empty() {
        return "none reported".to_owned();
    }
    let mut out = units
        .iter()
        .take(SHOWN)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    if units.len() > SHOWN {
        out.push_str(&format!(" and {} more", units.len() - SHOWN));
    }
    out
}

/// Adds the names in `new` to `seen`, keeping the order of first appearance.
fn remember_units<S: AsRef<str>>(seen: &mut Vec<String>, new: &[S]) {
    for u in new {
        let u = u.as_ref();
        if !seen.iter().any(|s| s == u) {
            seen.push(u.to_owned());
        }
    }
}

/// Settings of dynamic loss scaling, one field per DeepSpeed `fp16` key.
///
/// # Why the defaults differ from DeepSpeed's ZeRO behaviour
///
/// DeepSpeed documents `initial_scale_power = 16`, `hysteresis = 2`, `loss_scale_window = 1000`,
/// `min_loss_scale = 1`. But when an `fp16` block sets none of the five dynamic keys, DeepSpeed's
/// config returns no dynamic arguments at all and the ZeRO stage 1-3 optimizers fall back to the
/// class defaults of `DynamicLossScaler`: a start at 2^32 with hysteresis 1. A user who wrote just
/// `"fp16": {"enabled": true}` then silently gets a run that starts 65536x higher than the docs
/// say and halves on the very first overflow, which produces the familiar wall of "OVERFLOW!
/// Skipping step" lines at start-up and, with hysteresis 1, more "loss scale already at minimum"
/// crashes. zerodp always uses the documented values, whichever keys are present, so that the
/// documentation is the behaviour. Give `initial_scale_power: 32, hysteresis: 1` to reproduce
/// DeepSpeed's hidden default exactly.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DynamicScaleParams {
    /// `fp16.initial_scale_power`: the scale starts at `2^initial_scale_power`.
    pub initial_scale_power: u32,
    /// `fp16.loss_scale_window`: clean steps after the last overflow before the scale doubles.
    pub scale_window: u64,
    /// `fp16.hysteresis` (DeepSpeed's `delayed_shift`): overflows tolerated before halving.
    pub hysteresis: u32,
    /// `fp16.consecutive_hysteresis`: refill the hysteresis on every clean step (otherwise only
    /// when the scale grows).
    pub consecutive_hysteresis: bool,
    /// `fp16.min_loss_scale`: the scale never goes below this; an overflow at it is an error.
    pub min_scale: f64,
}

impl DynamicScaleParams {
    /// The documented DeepSpeed defaults: 2^16, window 1000, hysteresis 2, min 1.
    pub(crate) const DOCUMENTED_DEFAULTS: Self = Self {
        initial_scale_power: 16,
        scale_window: 1000,
        hysteresis: 2,
        consecutive_hysteresis: false,
        min_scale: 1.0,
    };

    /// Largest accepted `initial_scale_power`: the scale multiplies an `f32` loss, and 2^127 is
    /// the largest power of two an `f32` holds.
    pub(crate) const MAX_INITIAL_SCALE_POWER: u32 = 127;

    fn validate(&self) -> Result<(), LossScaleError> {
        if self.initial_scale_power > Self::MAX_INITIAL_SCALE_POWER {
            return Err(LossScaleError::InvalidSetting {
                key: "initial_scale_power",
                value: self.initial_scale_power.to_string(),
                reason: "must be at most 127 (2^127 is the largest power of two in f32); 16 is the usual start",
            });
        }
        if self.scale_window == 0 {
            return Err(LossScaleError::InvalidSetting {
                key: "loss_scale_window",
                value: "0".to_owned(),
                reason: "must be at least 1 (the default is 1000 steps)",
            });
        }
        if self.hysteresis == 0 {
            return Err(LossScaleError::InvalidSetting {
                key: "hysteresis",
                value: "0".to_owned(),
                reason: "must be at least 1 (1 halves on every overflow; the default is 2)",
            });
        }
        if !(self.min_scale.is_finite() && self.min_scale > 0.0) {
            return Err(LossScaleError::InvalidSetting {
                key: "min_loss_scale",
                value: self.min_scale.to_string(),
                reason: "must be a finite number above 0 (the default is 1)",
            });
        }
        Ok(())
    }
}

impl Default for DynamicScaleParams {
    fn default() -> Self {
        Self::DOCUMENTED_DEFAULTS
    }
}

/// What [`LossScaler::update_scale`] decided for one optimizer step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ScaleUpdate {
    /// The step must be skipped (its gradients overflowed): no optimizer update, no step count.
    pub skipped: bool,
    /// The scale the step's loss was multiplied by.
    pub attempted_scale: f64,
    /// The scale for the next step.
    pub next_scale: f64,
    /// Hysteresis left after this step (overflows still tolerated before halving).
    pub hysteresis: u32,
}

impl fmt::Display for ScaleUpdate {
    /// DeepSpeed's log line for overflows; a short status otherwise.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.skipped {
            if self.next_scale > self.attempted_scale {
                return write!(
                    f,
                    "no overflow for a full window, raising loss scale from {} to {}",
                    self.attempted_scale, self.next_scale
                );
            }
            return write!(f, "loss scale {}", self.next_scale);
        }
        if self.next_scale < self.attempted_scale {
            write!(
                f,
                "OVERFLOW! Skipping step. Attempted loss scale: {}, reducing to {}",
                self.attempted_scale, self.next_scale
            )
        } else if self.next_scale == self.attempted_scale && self.hysteresis > 0 {
            write!(
                f,
                "OVERFLOW! Skipping step. Attempted loss scale: {}, but hysteresis is {}. \
                 Reducing hysteresis to {}",
                self.attempted_scale,
                self.hysteresis + 1,
                self.hysteresis
            )
        } else {
            write!(
                f,
                "OVERFLOW! Skipping step. Loss scale: {}",
                self.attempted_scale
            )
        }
    }
}

/// Static or dynamic fp16 loss scaling with DeepSpeed's rules. Serialisable so that a
/// checkpoint can resume with the same scale, hysteresis and window position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    cur_scale: f64,
    /// `None` for a static scale.
    dynamic: Option<DynamicScaleParams>,
    cur_hysteresis: u32,
    /// Optimizer steps seen (skipped ones included), DeepSpeed's `cur_iter`.
    cur_iter: u64,
    /// Iteration of the last overflow, `-1` before the first: DeepSpeed's `last_overflow_iter`.
    last_overflow_iter: i64,
    consecutive_overflows: u64,
    overflow_units: Vec<String>,
}

impl LossScaler {
    /// Scaling as the `fp16` block asks: a static scale when `loss_scale > 0`, dynamic scaling
    /// with `dynamic` when `loss_scale == 0` (DeepSpeed's rule).
    pub fn new(loss_scale: f64, dynamic: DynamicScaleParams) -> Result<Self, LossScaleError> {
        if loss_scale == 0.0 {
            Self::dynamic(dynamic)
        } else {
            Self::fixed(loss_scale)
        }
    }

    /// Dynamic scaling starting at `2^initial_scale_power`.
    pub fn dynamic(params: DynamicScaleParams) -> Result<Self, LossScaleError> {
        params.validate()?;
        Ok(Self {
            cur_scale: 2f64.powi(params.initial_scale_power as i32),
            dynamic: Some(params),
            cur_hysteresis: params.hysteresis,
            cur_iter: 0,
            last_overflow_iter: -1,
            consecutive_overflows: 0,
            overflow_units: Vec::new(),
        })
    }

    /// A fixed scale (DeepSpeed's `fp16.loss_scale > 0`). Overflowed steps are still skipped,
    /// and the scale never changes; pair it with a [`NonFiniteGuard`] to stop a run that keeps
    /// overflowing.
    pub fn fixed(scale: f64) -> Result<Self, LossScaleError> {
        if !(scale.is_finite() && scale > 0.0 && scale <= f64::from(f32::MAX)) {
            return Err(LossScaleError::InvalidSetting {
                key: "loss_scale",
                value: scale.to_string(),
                reason: "must be 0 (dynamic scaling) or a finite positive number that fits in f32, such as 128",
            });
        }
        Ok(Self {
            cur_scale: scale,
            dynamic: None,
            cur_hysteresis: 0,
            cur_iter: 0,
            last_overflow_iter: -1,
            consecutive_overflows: 0,
            overflow_units: Vec::new(),
        })
    }

    /// The scale to multiply the next step's loss by.
    pub fn loss_scale(&self) -> f64 {
        self.cur_scale
    }

    /// Whether the scale adapts (fp16 with `loss_scale == 0`).
    pub fn is_dynamic(&self) -> bool {
        self.dynamic.is_some()
    }

    /// Overflows still tolerated before the next halving (0 for a static scale).
    pub fn hysteresis(&self) -> u32 {
        self.cur_hysteresis
    }

    /// Optimizer steps seen so far, skipped ones included.
    pub fn iteration(&self) -> u64 {
        self.cur_iter
    }

    /// Overflowed steps in a row up to now.
    pub fn consecutive_overflows(&self) -> u64 {
        self.consecutive_overflows
    }

    /// Records the outcome of one optimizer step and decides the next scale; call it once per
    /// optimizer step (not per micro-step), with `overflow` agreed across all ranks and
    /// `overflowed_units` the names of the units whose gradients held Inf/NaN (for the error).
    ///
    /// The rules are DeepSpeed's `DynamicLossScaler.update_scale`, current upstream version:
    ///
    /// * Overflow: if `hysteresis == 1` (configured or remaining), the scale halves, floored at
    ///   `min_scale`; an overflow while already at `min_scale` is
    ///   [`LossScaleError::MinimumScaleReached`]. Otherwise only the remaining hysteresis drops
    ///   by one. Either way the step is skipped and the window restarts from this step.
    /// * No overflow: with `consecutive_hysteresis` the hysteresis is refilled. Then, with
    ///   `stable = iteration - last_overflow_iteration - 1`, the scale doubles when `stable` is
    ///   a positive multiple of `scale_window` (and without `consecutive_hysteresis`, only then
    ///   is the hysteresis refilled). So the first growth comes on the `window + 1`-th clean
    ///   step after an overflow (or from the start), then every `window` clean steps.
    ///
    /// DeepSpeed releases up to early 2025 tested `(iteration - last_overflow) % window == 0`
    /// instead, which grows one step earlier; upstream changed it to the form above, which is
    /// also what its fused fp16 optimizer has always done, and that is the one reproduced here.
    pub(crate) fn update_scale<S: AsRef<str>>(
        &mut self,
        overflow: bool,
        overflowed_units: &[S],
    ) -> Result<ScaleUpdate, LossScaleError> {
        let attempted_scale = self.cur_scale;
        if overflow {
            self.consecutive_overflows += 1;
            remember_units(&mut self.overflow_units, overflowed_units);
        } else {
            self.consecutive_overflows = 0;
            self.overflow_units.clear();
        }
        if let Some(p) = self.dynamic {
            if overflow {
                if p.hysteresis == 1 || self.cur_hysteresis == 1 {
                    if self.cur_scale == p.min_scale {
                        return Err(LossScaleError::MinimumScaleReached {
                            min_scale: p.min_scale,
                            iteration: self.cur_iter,
                            consecutive_overflows: self.consecutive_overflows,
                            units: self.overflow_units.clone(),
                        });
                    }
                    self.cur_scale = (self.cur_scale / 2.0).max(p.min_scale);
                } else {
                    self.cur_hysteresis -= 1;
                }
                self.last_overflow_iter = self.cur_iter as i64;
            } else {
                if p.consecutive_hysteresis {
                    self.cur_hysteresis = p.hysteresis;
                }
                let stable = self.cur_iter as i64 - self.last_overflow_iter - 1;
                if stable > 0 && stable as u64 % p.scale_window == 0 {
                    if !p.consecutive_hysteresis {
                        self.cur_hysteresis = p.hysteresis;
                    }
                    self.cur_scale *= 2.0;
                }
            }
        }
        self.cur_iter += 1;
        Ok(ScaleUpdate {
            skipped: overflow,
            attempted_scale,
            next_scale: self.cur_scale,
            hysteresis: self.cur_hysteresis,
        })
    }
}

/// The factor to multiply gradients by before the optimizer step (the `grad_scale` argument of
/// [`crate::optim::adam::adam_step`]): unscaling and clipping in one number, as DeepSpeed's
/// `unscale_and_clip_grads` computes it.
///
/// `scaled_norm` is the global L2 norm of the gradients as they are (still multiplied by
/// `loss_scale`; the norm over all shards), `clip` is `gradient_clipping` (0 = off). DeepSpeed:
/// `combined = loss_scale * max(1, (scaled_norm / loss_scale + 1e-6) / clip)`, gradients divided
/// by `combined`. Returns `1 / combined`.
pub(crate) fn unscale_and_clip_factor(scaled_norm: f64, loss_scale: f64, clip: f64) -> f32 {
    let mut combined = loss_scale;
    if clip > 0.0 {
        let coef = (scaled_norm / loss_scale + 1e-6) / clip;
        if coef > 1.0 {
            combined = coef * loss_scale;
        }
    }
    (1.0 / combined) as f32
}

/// Skips bf16/fp32 steps whose gradients hold Inf/NaN, and stops the run after too many in a
/// row. DeepSpeed checks overflow only for fp16, so under bf16 a single NaN goes straight into
/// the weights and the run is lost; here the step is skipped and reported instead.
#[derive(Debug, Clone, PartialEq)]
pub struct NonFiniteGuard {
    precision: &'static str,
    max_consecutive: u64,
    consecutive: u64,
    total_skipped: u64,
    units: Vec<String>,
}

impl NonFiniteGuard {
    /// A guard that errors when `max_consecutive_skips` steps in a row are non-finite (1: the
    /// first non-finite step is an error). `precision` (`"bf16"`, `"fp32"`) names the
    /// gradients in messages.
    pub fn new(
        max_consecutive_skips: u64,
        precision: &'static str,
    ) -> Result<Self, LossScaleError> {
        if max_consecutive_skips == 0 {
            return Err(LossScaleError::InvalidSetting {
                key: "max_consecutive_skipped_steps",
                value: "0".to_owned(),
                reason: "must be at least 1 (1 stops at the first step with Inf/NaN gradients)",
            });
        }
        Ok(Self {
            precision,
            max_consecutive: max_consecutive_skips,
            consecutive: 0,
            total_skipped: 0,
            units: Vec::new(),
        })
    }

    /// Records one optimizer step: `finite` as agreed across ranks, `bad_units` the units whose
    /// gradients held Inf/NaN. Returns whether to skip the step, or the error once the limit
    /// of consecutive skips is reached.
    pub fn check<S: AsRef<str>>(
        &mut self,
        finite: bool,
        bad_units: &[S],
    ) -> Result<bool, LossScaleError> {
        if finite {
            self.consecutive = 0;
            self.units.clear();
            return Ok(false);
        }
        self.consecutive += 1;
        self.total_skipped += 1;
        remember_units(&mut self.units, bad_units);
        if self.consecutive >= self.max_consecutive {
            return Err(LossScaleError::NonFiniteGradients {
                precision: self.precision,
                consecutive: self.consecutive,
                limit: self.max_consecutive,
                units: self.units.clone(),
            });
        }
        Ok(true)
    }

    /// Non-finite steps in a row up to now.
    pub(crate) fn consecutive_skipped(&self) -> u64 {
        self.consecutive
    }

    /// Steps skipped since the start.
    pub(crate) fn total_skipped(&self) -> u64 {
        self.total_skipped
    }

    /// Resume the counts a checkpoint recorded.
    pub(crate) fn set_counts(&mut self, consecutive: u64, total_skipped: u64) {
        self.consecutive = consecutive;
        self.total_skipped = total_skipped;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: &[&str] = &[];

    fn dynamic(
        power: u32,
        window: u64,
        hysteresis: u32,
        consecutive: bool,
        min: f64,
    ) -> LossScaler {
        LossScaler::dynamic(DynamicScaleParams {
            initial_scale_power: power,
            scale_window: window,
            hysteresis,
            consecutive_hysteresis: consecutive,
            min_scale: min,
        })
        .expect("valid settings")
    }

    /// Feeds a sequence of overflow flags and returns (skipped, next scale, hysteresis) per step.
    fn replay(s: &mut LossScaler, flags: &[bool]) -> Vec<(bool, f64, u32)> {
        flags
            .iter()
            .map(|&o| {
                let u = s.update_scale(o, &["h.0"]).expect("no error expected");
                (u.skipped, u.next_scale, u.hysteresis)
            })
            .collect()
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        let s = LossScaler::new(0.0, DynamicScaleParams::default()).unwrap();
        assert!(s.is_dynamic());
        assert_eq!(s.loss_scale(), 65536.0);
        assert_eq!(s.hysteresis(), 2);
        assert_eq!(DynamicScaleParams::default().scale_window, 1000);
        assert_eq!(DynamicScaleParams::default().min_scale, 1.0);
    }

    #[test]
    fn hysteresis_two_first_overflow_only_decrements_then_halves() {
        let mut s = dynamic(16, 1000, 2, false, 1.0);
        let h = 65536.0;
        let first = s.update_scale(true, &["h.0"]).unwrap();
        assert_eq!(
            first.to_string(),
            "OVERFLOW! Skipping step. Attempted loss scale: 65536, but hysteresis is 2. \
             Reducing hysteresis to 1"
        );
        let mut s = dynamic(16, 1000, 2, false, 1.0);
        let got = replay(&mut s, &[true, true, true, false, true]);
        assert_eq!(
            got,
            vec![
                (true, h, 1),       // hysteresis 2 -> 1, scale kept, step skipped
                (true, h / 2.0, 1), // hysteresis exhausted: halve
                (true, h / 4.0, 1), // not refilled without consecutive_hysteresis: halve again
                (false, h / 4.0, 1),
                (true, h / 8.0, 1), // a clean step did not refill it either
            ]
        );
        assert_eq!(s.iteration(), 5);
    }

    #[test]
    fn window_doubles_after_window_plus_one_clean_steps_then_every_window() {
        // As DeepSpeed's own test: window 2 from the start grows at iterations 2, 4, 6.
        let mut s = dynamic(8, 2, 2, false, 1.0);
        let scales: Vec<f64> = replay(&mut s, &[false; 7]).iter().map(|r| r.1).collect();
        assert_eq!(
            scales,
            vec![256.0, 256.0, 512.0, 512.0, 1024.0, 1024.0, 2048.0]
        );

        // After overflows, the window restarts: DeepSpeed's "scale_window + 1 clean steps to grow".
        let mut s = dynamic(8, 2, 1, false, 1.0);
        let got = replay(&mut s, &[true, true, false, false, false, true]);
        let scales: Vec<f64> = got.iter().map(|r| r.1).collect();
        assert_eq!(scales, vec![128.0, 64.0, 64.0, 64.0, 128.0, 64.0]);
    }

    #[test]
    fn growth_refills_hysteresis_and_any_overflow_restarts_the_window() {
        let mut s = dynamic(10, 3, 2, false, 1.0);
        let k = 1024.0;
        let got = replay(
            &mut s,
            &[true, false, false, false, true, false, false, false, false],
        );
        assert_eq!(
            got,
            vec![
                (true, k, 1),        // iter 0: hysteresis used, but last_overflow_iter = 0
                (false, k, 1),       // stable 0
                (false, k, 1),       // stable 1
                (false, k, 1),       // stable 2
                (true, k / 2.0, 1),  // iter 4: hysteresis 1 -> halve; window restarts
                (false, k / 2.0, 1), // stable 0
                (false, k / 2.0, 1),
                (false, k / 2.0, 1),
                (false, k, 2), // stable 3 = window: double and refill hysteresis
            ]
        );
    }

    #[test]
    fn consecutive_hysteresis_refills_on_every_clean_step() {
        let flags = [true, false, true, false, true, true];
        let mut on = dynamic(12, 1000, 2, true, 1.0);
        let mut off = dynamic(12, 1000, 2, false, 1.0);
        let s = 4096.0;
        assert_eq!(
            replay(&mut on, &flags),
            vec![
                (true, s, 1),
                (false, s, 2), // refilled
                (true, s, 1),
                (false, s, 2),
                (true, s, 1),
                (true, s / 2.0, 1), // two overflows in a row are needed to halve
            ]
        );
        assert_eq!(
            replay(&mut off, &flags),
            vec![
                (true, s, 1),
                (false, s, 1),
                (true, s / 2.0, 1),
                (false, s / 2.0, 1),
                (true, s / 4.0, 1),
                (true, s / 8.0, 1),
            ]
        );
    }

    #[test]
    fn reaching_the_minimum_is_an_error_naming_steps_and_units() {
        let mut s = dynamic(3, 1000, 1, false, 2.0);
        let u = s.update_scale(true, &["h.0"]).unwrap();
        assert_eq!(
            (u.skipped, u.attempted_scale, u.next_scale),
            (true, 8.0, 4.0)
        );
        assert!(u
            .to_string()
            .contains("Attempted loss scale: 8, reducing to 4"));
        assert_eq!(
            s.update_scale(true, &["h.1", "h.0"]).unwrap().next_scale,
            2.0
        );
        // Halving is floored at the minimum ...
        let err = s.update_scale(true, &["lm_head"]).unwrap_err();
        // ... and an overflow at the minimum is the error.
        match &err {
            LossScaleError::MinimumScaleReached {
                min_scale,
                iteration,
                consecutive_overflows,
                units,
            } => {
                assert_eq!(*min_scale, 2.0);
                assert_eq!(*iteration, 2);
                assert_eq!(*consecutive_overflows, 3);
                assert_eq!(units, &["h.0", "h.1", "lm_head"]);
            }
            other => panic!("unexpected error {other:?}"),
        }
        let msg = err.to_string();
        assert!(msg.contains("3 optimizer steps in a row"), "{msg}");
        assert!(msg.contains("units: h.0, h.1, lm_head"), "{msg}");
        assert!(
            msg.contains("bf16") && msg.contains("learning rate"),
            "{msg}"
        );
        assert!(msg.contains("min_loss_scale"), "{msg}");
    }

    #[test]
    fn floor_is_min_scale_and_hysteresis_still_applies_at_the_minimum() {
        // 2^2 = 4 with min 3: halving stops at 3, not 2.
        let mut s = dynamic(2, 1000, 2, false, 3.0);
        let got = replay(&mut s, &[true, true]);
        assert_eq!(got, vec![(true, 4.0, 1), (true, 3.0, 1)]);
        // A clean step in between resets the overflow streak.
        assert_eq!(replay(&mut s, &[false]), vec![(false, 3.0, 1)]);
        assert_eq!(s.consecutive_overflows(), 0);
        let err = s.update_scale(true, NONE).unwrap_err();
        assert!(matches!(
            err,
            LossScaleError::MinimumScaleReached {
                consecutive_overflows: 1,
                ..
            }
        ));
        assert!(err.to_string().contains("units: none reported"));

        // With hysteresis left at the minimum, the first overflow there only uses it up.
        let mut s = dynamic(0, 1000, 3, true, 1.0);
        assert_eq!(
            replay(&mut s, &[true, true]),
            vec![(true, 1.0, 2), (true, 1.0, 1)]
        );
        assert!(s.update_scale(true, NONE).is_err());
    }

    #[test]
    fn static_scale_never_changes_but_overflowed_steps_are_skipped() {
        let mut s = LossScaler::new(128.0, DynamicScaleParams::default()).unwrap();
        assert!(!s.is_dynamic());
        let got = replay(&mut s, &[true, true, true, false, false]);
        assert!(got.iter().all(|r| r.1 == 128.0));
        assert_eq!(
            got.iter().map(|r| r.0).collect::<Vec<_>>(),
            vec![true, true, true, false, false]
        );
    }

    #[test]
    fn invalid_settings_are_rejected_with_the_key() {
        let bad = |p: DynamicScaleParams| LossScaler::dynamic(p).unwrap_err().to_string();
        let d = DynamicScaleParams::default();
        assert!(bad(DynamicScaleParams {
            scale_window: 0,
            ..d
        })
        .contains("loss_scale_window"));
        assert!(bad(DynamicScaleParams { hysteresis: 0, ..d }).contains("hysteresis"));
        assert!(bad(DynamicScaleParams {
            min_scale: 0.0,
            ..d
        })
        .contains("min_loss_scale"));
        assert!(bad(DynamicScaleParams {
            initial_scale_power: 200,
            ..d
        })
        .contains("initial_scale_power"));
        for v in [-1.0, f64::INFINITY, f64::NAN, 1e300] {
            let e = LossScaler::new(v, d).unwrap_err().to_string();
            assert!(e.contains("`loss_scale`"), "{e}");
        }
        assert!(NonFiniteGuard::new(0, "bf16").is_err());
    }

    #[test]
    fn non_finite_guard_skips_and_errors_after_the_limit_in_a_row() {
        let mut g = NonFiniteGuard::new(3, "bf16").unwrap();
        assert!(!g.check(true, NONE).unwrap());
        assert!(g.check(false, &["h.2"]).unwrap());
        assert!(g.check(false, &["h.2", "h.3"]).unwrap());
        // A clean step resets the streak.
        assert!(!g.check(true, NONE).unwrap());
        assert_eq!(g.consecutive_skipped(), 0);
        assert!(g.check(false, &["wte"]).unwrap());
        assert!(g.check(false, &["h.0"]).unwrap());
        let err = g.check(false, &["wte"]).unwrap_err();
        assert_eq!(
            err,
            LossScaleError::NonFiniteGradients {
                precision: "bf16",
                consecutive: 3,
                limit: 3,
                units: vec!["wte".into(), "h.0".into()],
            }
        );
        let msg = err.to_string();
        assert!(
            msg.contains("3 optimizer steps in a row had Inf/NaN bf16 gradients"),
            "{msg}"
        );
        assert!(msg.contains("units: wte, h.0"), "{msg}");
        assert_eq!(g.total_skipped(), 5);
    }

    #[test]
    fn advice_fits_the_precision() {
        let error = |precision| {
            let mut g = NonFiniteGuard::new(1, precision).unwrap();
            g.check(false, &["wte"]).unwrap_err().to_string()
        };
        // bf16 and fp32 runs are not told to leave fp16 or to tune a loss scale they do not have.
        for precision in ["bf16", "fp32"] {
            let msg = error(precision);
            assert!(msg.contains("gradient_clipping"), "{msg}");
            assert!(
                !msg.contains("instead of fp16") && !msg.contains("fp16."),
                "{msg}"
            );
        }
        // Static fp16: bf16, or a dynamic scale.
        let msg = error("fp16");
        assert!(msg.contains("bf16 instead of fp16"), "{msg}");
        assert!(msg.contains("fp16.loss_scale: 0"), "{msg}");
        // Dynamic fp16 at its floor: bf16, or let the scale fall further.
        let msg = LossScaleError::MinimumScaleReached {
            min_scale: 1.0,
            iteration: 7,
            consecutive_overflows: 3,
            units: vec!["wte".into()],
        }
        .to_string();
        assert!(msg.contains("bf16 instead of fp16"), "{msg}");
        assert!(msg.contains("fp16.min_loss_scale"), "{msg}");
    }

    #[test]
    fn unscale_and_clip_factor_follows_deepspeed() {
        // No clipping: just 1/loss_scale.
        assert_eq!(unscale_and_clip_factor(1e9, 1024.0, 0.0), 1.0 / 1024.0);
        // Unscaled norm 0.5 below clip 1: only unscale.
        assert_eq!(unscale_and_clip_factor(512.0, 1024.0, 1.0), 1.0 / 1024.0);
        // Unscaled norm 4 above clip 1: the result has norm clip (up to DeepSpeed's 1e-6).
        let f = unscale_and_clip_factor(4096.0, 1024.0, 1.0);
        let clipped_norm = 4096.0 * f64::from(f);
        assert!((clipped_norm - 1.0).abs() < 1e-6, "{clipped_norm}");
        // bf16/fp32 (scale 1): plain clipping.
        let f = unscale_and_clip_factor(10.0, 1.0, 2.0);
        assert!((f64::from(f) - 2.0 / (10.0 + 1e-6)).abs() < 1e-7);
    }

    #[test]
    fn long_unit_lists_are_abbreviated() {
        let names: Vec<String> = (0..20).map(|i| format!("h.{i}")).collect();
        let s = list_units(&names);
        assert!(
            s.starts_with("h.0, h.1") && s.ends_with("h.11 and 8 more"),
            "{s}"
        );
    }
}
