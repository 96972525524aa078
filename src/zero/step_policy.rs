//! The per-step overflow policy of mixed precision: [`StepPolicy`] decides, once per optimizer step
//! and with the verdict agreed across ranks, whether a step is skipped. fp16 uses DeepSpeed's
//! [`LossScaler`], bf16 and fp32 (and fp16 with a static scale) a [`NonFiniteGuard`] that stops the
//! run after too many skipped steps in a row.

use super::loss_scaler::{DynamicScaleParams, LossScaleError, LossScaler, NonFiniteGuard};

/// How a run treats Inf/NaN gradients and, for fp16, the loss scale.
#[derive(Clone, Debug, PartialEq)]
pub enum OverflowPolicy {
    /// Skip non-finite steps; error after `max_skipped_steps` in a row (bf16, fp32).
    Guard,
    /// fp16: multiply the loss by a scale (`loss_scale > 0`: that static scale, skipped steps
    /// counted by the guard; `0`: DeepSpeed's dynamic scaling with `dynamic`).
    LossScale {
        loss_scale: f64,
        dynamic: DynamicScaleParams,
    },
}

/// The per-step decision: the loss scale to use and whether a step is skipped.
#[derive(Clone, Debug)]
pub struct StepPolicy {
    scaler: Option<LossScaler>,
    /// Counts skipped steps in a row wherever the scale does not (everything but dynamic fp16).
    guard: Option<NonFiniteGuard>,
}

/// The loss scaler's and the skip guard's state, as a checkpoint keeps it.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PolicySnapshot {
    /// The fp16 loss scaler (scale, hysteresis, window position); `None` without loss scaling.
    pub scaler: Option<LossScaler>,
    pub consecutive_skipped: u64,
    pub total_skipped: u64,
}

/// The verdict on one optimizer step.
#[derive(Clone, Debug, PartialEq)]
pub struct StepVerdict {
    pub skipped: bool,
    /// The scale the step's loss was multiplied by.
    pub loss_scale: f64,
    /// DeepSpeed's log line for an fp16 step (overflow or scale change), if any.
    pub message: Option<String>,
}

impl StepPolicy {
    /// `precision` names the gradients in the guard's error (`"bf16"`, `"fp32"`, `"fp16"`).
    pub fn new(
        policy: &OverflowPolicy,
        max_skipped_steps: u64,
        precision: &'static str,
    ) -> Result<Self, LossScaleError> {
        Ok(match policy {
            OverflowPolicy::Guard => StepPolicy {
                scaler: None,
                guard: Some(NonFiniteGuard::new(max_skipped_steps, precision)?),
            },
            OverflowPolicy::LossScale {
                loss_scale,
                dynamic,
            } => {
                let scaler = LossScaler::new(*loss_scale, *dynamic)?;
                let guard = match scaler.is_dynamic() {
                    true => None,
                    false => Some(NonFiniteGuard::new(max_skipped_steps, precision)?),
                };
                StepPolicy {
                    scaler: Some(scaler),
                    guard,
                }
            }
        })
    }

    /// The scale to multiply the next step's loss by (1 without loss scaling).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, LossScaler::loss_scale)
    }

    /// What a checkpoint must keep to resume the policy exactly.
    pub fn snapshot(&self) -> PolicySnapshot {
        PolicySnapshot {
            scaler: self.scaler.clone(),
            consecutive_skipped: self.guard.as_ref().map_or(0, |g| g.consecutive_skipped()),
            total_skipped: self.guard.as_ref().map_or(0, |g| g.total_skipped()),
        }
    }

    /// Resume from a snapshot. The scaler is taken only if this policy scales too (a checkpoint of
    /// another precision resumes with this run's own scaling from its start).
    pub(crate) fn restore(&mut self, s: &PolicySnapshot) {
        if let (Some(mine), Some(saved)) = (&mut self.scaler, &s.scaler) {
            *mine = saved.clone();
        }
        if let Some(g) = &mut self.guard {
            g.set_counts(s.consecutive_skipped, s.total_skipped);
        }
    }

    /// Record one step: `finite` as agreed across ranks, `bad_units` the units whose gradients
    /// held Inf/NaN. Errors at the minimum fp16 scale or after too many skipped steps in a row.
    pub fn record(
        &mut self,
        finite: bool,
        bad_units: &[String],
    ) -> Result<StepVerdict, LossScaleError> {
        let loss_scale = self.loss_scale();
        let mut message = None;
        if let Some(s) = &mut self.scaler {
            let update = s.update_scale(!finite, bad_units)?;
            if update.skipped || update.next_scale != update.attempted_scale {
                message = Some(update.to_string());
            }
        }
        if let Some(g) = &mut self.guard {
            g.check(finite, bad_units)?;
        }
        Ok(StepVerdict {
            skipped: !finite,
            loss_scale,
            message,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guard_skips_and_stops_after_the_limit() {
        let mut p = StepPolicy::new(&OverflowPolicy::Guard, 2, "bf16").unwrap();
        assert_eq!(p.loss_scale(), 1.0);
        let units = vec!["layer1".to_string()];
        assert!(p.record(false, &units).unwrap().skipped);
        assert!(!p.record(true, &[]).unwrap().skipped);
        assert!(p.record(false, &units).unwrap().skipped);
        let err = p.record(false, &units).unwrap_err();
        assert!(err.to_string().contains("layer1"), "{err}");
    }

    #[test]
    fn dynamic_fp16_halves_after_the_hysteresis() {
        let policy = OverflowPolicy::LossScale {
            loss_scale: 0.0,
            dynamic: DynamicScaleParams::DOCUMENTED_DEFAULTS,
        };
        let mut p = StepPolicy::new(&policy, 1, "fp16").unwrap();
        assert_eq!(p.loss_scale(), 65536.0);
        let v = p.record(false, &[]).unwrap();
        assert!(v.skipped && v.message.is_some());
        assert_eq!(p.loss_scale(), 65536.0);
        assert_eq!(p.record(false, &[]).unwrap().loss_scale, 65536.0);
        assert_eq!(p.loss_scale(), 32768.0);
    }
}
