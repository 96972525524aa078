//! The `scheduler` block: DeepSpeed's five learning-rate schedules, their keys, defaults and
//! checks, one function per schedule.

use super::error::ConfigError;
use super::json::{Member, Node, Value};
use super::reader::{join, suggest, Obj, Reader, HINT};
use super::settings::*;

/// The schedules zerodp implements (DeepSpeed's names).
const SCHEDULERS: &[&str] = &[
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "LRRangeTest",
];

const LR_HINT: &str = "write a number (a command that takes a learning rate fills it)";
const STEPS_HINT: &str = "write a number (a command that takes the number of steps fills it)";

/// Reads `scheduler` (`m`); `opt` is the optimizer block, whose lr WarmupLR rises to when
/// `warmup_max_lr` is not given.
pub(super) fn scheduler(
    r: &mut Reader<'_>,
    m: &Member,
    opt: Option<&OptimizerSettings>,
) -> Result<SchedulerSettings, ConfigError> {
    let o = r.object("scheduler", &m.node)?;
    r.collect_unknown(o, &["type", "params"]);
    let name = schedule_name(r, o, m)?;
    let empty;
    let obj = match o.get("params") {
        Some(pm) => r.object("scheduler.params", &pm.node)?,
        None => {
            empty = Node {
                value: Value::Object(Vec::new()),
                span: m.node.span,
            };
            r.object("scheduler.params", &empty)?
        }
    };
    r.deny_unknown(obj, keys_of(&name))?;
    let p = Params { obj, name: &name };
    p.warn_on_ignored(r)?;
    match name.as_str() {
        "WarmupLR" => p.warmup_lr(r, opt),
        "WarmupDecayLR" => Ok(SchedulerSettings::WarmupDecayLR {
            total_num_steps: p.total_steps(r)?,
            warmup_min_lr: p.f64(r, "warmup_min_lr", 0.0)?,
            warmup_max_lr: p.lr(r, "warmup_max_lr", 1e-3)?,
            warmup_num_steps: p.warmup_steps(r)?,
            warmup_type: p.warmup_type(r)?,
        }),
        "WarmupCosineLR" => Ok(SchedulerSettings::WarmupCosineLR {
            total_num_steps: p.total_steps(r)?,
            warmup_min_ratio: p.f64(r, "warmup_min_ratio", 0.0)?,
            warmup_num_steps: p.warmup_steps(r)?,
            cos_min_ratio: p.f64(r, "cos_min_ratio", 1e-4)?,
            warmup_type: p.warmup_type(r)?,
        }),
        "OneCycle" => p.one_cycle(r),
        _ => p.lr_range_test(r),
    }
}

/// `scheduler.type`, one of [`SCHEDULERS`].
fn schedule_name(r: &mut Reader<'_>, o: Obj<'_>, m: &Member) -> Result<String, ConfigError> {
    let Some(tm) = o.get("type") else {
        return Err(ConfigError::Missing {
            at: r.at("scheduler", &m.node),
            key: "type".into(),
            hint: format!("write one of {}", SCHEDULERS.join(", ")),
        });
    };
    let name = r.node_str("scheduler.type", &tm.node)?.to_string();
    if SCHEDULERS.contains(&name.as_str()) {
        return Ok(name);
    }
    let hint = match suggest(&name, SCHEDULERS) {
        Some(s) => format!(
            "did you mean \"{s}\"? zerodp implements {}",
            SCHEDULERS.join(", ")
        ),
        None => format!(
            "zerodp implements DeepSpeed's {} (torch.optim.lr_scheduler classes are not available)",
            SCHEDULERS.join(", ")
        ),
    };
    Err(ConfigError::Unsupported {
        at: r.at("scheduler.type", &tm.node),
        what: format!("the scheduler \"{name}\""),
        hint,
    })
}

/// The `params` keys of schedule `name` (DeepSpeed's).
fn keys_of(name: &str) -> &'static [&'static str] {
    match name {
        "WarmupLR" => &[
            "warmup_min_lr",
            "warmup_max_lr",
            "warmup_num_steps",
            "warmup_type",
            "last_batch_iteration",
        ],
        "WarmupDecayLR" => &[
            "total_num_steps",
            "warmup_min_lr",
            "warmup_max_lr",
            "warmup_num_steps",
            "warmup_type",
            "last_batch_iteration",
        ],
        "WarmupCosineLR" => &[
            "total_num_steps",
            "warmup_min_ratio",
            "warmup_num_steps",
            "cos_min_ratio",
            "warmup_type",
            "last_batch_iteration",
        ],
        "OneCycle" => &[
            "cycle_min_lr",
            "cycle_max_lr",
            "decay_lr_rate",
            "cycle_first_step_size",
            "cycle_second_step_size",
            "cycle_first_stair_count",
            "cycle_second_stair_count",
            "decay_step_size",
            "cycle_momentum",
            "cycle_min_mom",
            "cycle_max_mom",
            "decay_mom_rate",
            "last_batch_iteration",
        ],
        _ => &[
            "lr_range_test_min_lr",
            "lr_range_test_step_size",
            "lr_range_test_step_rate",
            "lr_range_test_staircase",
            "last_batch_iteration",
        ],
    }
}

/// `scheduler.params` of the schedule `name`, with the typed reads every schedule shares.
struct Params<'a> {
    obj: Obj<'a>,
    name: &'a str,
}

impl Params<'_> {
    /// A non-negative number, `default` when absent (no `"auto"`).
    fn f64(&self, r: &mut Reader<'_>, key: &str, default: f64) -> Result<f64, ConfigError> {
        self.f64_auto(r, key, default, None, HINT)
    }

    /// A learning rate: `"auto"` takes the command's learning rate.
    fn lr(&self, r: &mut Reader<'_>, key: &str, default: f64) -> Result<f64, ConfigError> {
        let auto = r.ctx.lr;
        self.f64_auto(r, key, default, auto, LR_HINT)
    }

    fn f64_auto(
        &self,
        r: &mut Reader<'_>,
        key: &str,
        default: f64,
        auto: Option<f64>,
        hint: &str,
    ) -> Result<f64, ConfigError> {
        let path = join(self.obj.path, key);
        r.read(&path, self.obj.get(key), default, auto, hint, |r, q, n| {
            r.nonneg_f64(q, n)
        })
    }

    /// A whole number, `default` when absent (no `"auto"`).
    fn u64(&self, r: &mut Reader<'_>, key: &str, default: u64) -> Result<u64, ConfigError> {
        let path = join(self.obj.path, key);
        r.read(&path, self.obj.get(key), default, None, HINT, |r, q, n| {
            r.node_u64(q, n)
        })
    }

    /// A whole number, or `None` when absent or null (`default` stands for an unresolved
    /// `"auto"`).
    fn optional_u64(
        &self,
        r: &mut Reader<'_>,
        key: &str,
        default: u64,
    ) -> Result<Option<u64>, ConfigError> {
        match self.obj.get(key) {
            Some(m) if !matches!(m.node.value, Value::Null) => Ok(Some(self.u64(r, key, default)?)),
            _ => Ok(None),
        }
    }

    /// `total_num_steps`, required; `"auto"` takes the command's number of steps.
    fn total_steps(&self, r: &mut Reader<'_>) -> Result<u64, ConfigError> {
        let key = "total_num_steps";
        if !self.obj.has(key) {
            return Err(ConfigError::Missing {
                at: r.at("scheduler.params", self.obj.node),
                key: key.into(),
                hint: format!("{} needs the total number of optimizer steps", self.name),
            });
        }
        let auto = r.ctx.total_steps.map(|s| s as u64);
        let path = join(self.obj.path, key);
        r.read(&path, self.obj.get(key), 0, auto, STEPS_HINT, |r, q, n| {
            r.node_u64(q, n)
        })
    }

    /// A step count that DeepSpeed divides by: at least 1.
    fn at_least_one(
        &self,
        r: &mut Reader<'_>,
        (key, default): (&str, u64),
        message: &str,
    ) -> Result<u64, ConfigError> {
        match self.u64(r, key, default)? {
            0 => Err(self.out_of_range(r, key, message)),
            v => Ok(v),
        }
    }

    /// `key`'s value is out of range: where it is (or the block, for a default) and why.
    fn out_of_range(&self, r: &Reader<'_>, key: &str, message: &str) -> ConfigError {
        let node = self.obj.get(key).map(|m| &m.node).unwrap_or(self.obj.node);
        ConfigError::OutOfRange {
            at: r.at(&join(self.obj.path, key), node),
            message: message.into(),
        }
    }

    fn warmup_steps(&self, r: &mut Reader<'_>) -> Result<u64, ConfigError> {
        self.at_least_one(
            r,
            ("warmup_num_steps", 1000),
            "warmup_num_steps must be at least 1 (DeepSpeed raises ValueError for 0)",
        )
    }

    /// `warmup_type`: `log` (the default, and DeepSpeed's fallback for unknown names) or `linear`.
    fn warmup_type(&self, r: &mut Reader<'_>) -> Result<WarmupType, ConfigError> {
        let path = "scheduler.params.warmup_type";
        r.read(
            path,
            self.obj.get("warmup_type"),
            WarmupType::Log,
            None,
            HINT,
            |r, q, n| {
                Ok(match r.node_str(q, n)? {
                    "linear" => WarmupType::Linear,
                    _ => WarmupType::Log,
                })
            },
        )
    }

    /// Warnings for what is read but not used as DeepSpeed would: a `last_batch_iteration`
    /// (zerodp resumes the schedule from its checkpoint) and an unknown `warmup_type`.
    fn warn_on_ignored(&self, r: &mut Reader<'_>) -> Result<(), ConfigError> {
        if let Some(lb) = self.obj.get("last_batch_iteration") {
            let v = r.node_i64("scheduler.params.last_batch_iteration", &lb.node)?;
            if v != -1 {
                r.warn(format!(
                    "scheduler.params.last_batch_iteration {v} is ignored; zerodp restores the \
                     schedule position from its checkpoint"
                ));
            }
        }
        if let Some(wt) = self.obj.get("warmup_type") {
            if let Value::String(s) = &wt.node.value {
                if s != "log" && s != "linear" && s != "auto" {
                    r.warn(format!(
                        "scheduler.params.warmup_type \"{s}\" is unknown; DeepSpeed (and zerodp) \
                         fall back to \"log\". Use \"log\" or \"linear\""
                    ));
                }
            }
        }
        Ok(())
    }

    /// WarmupLR: without `warmup_max_lr` it rises to the optimizer's lr (current DeepSpeed).
    fn warmup_lr(
        &self,
        r: &mut Reader<'_>,
        opt: Option<&OptimizerSettings>,
    ) -> Result<SchedulerSettings, ConfigError> {
        let warmup_max_lr = match self.obj.get("warmup_max_lr") {
            None => {
                if let Some(o) = opt.filter(|o| o.lr != 1e-3) {
                    r.warn(format!(
                        "scheduler.params.warmup_max_lr is not given: warmup rises to the \
                         optimizer's lr {} (current DeepSpeed); DeepSpeed releases before 2025 \
                         used 0.001",
                        o.lr
                    ));
                }
                None
            }
            Some(_) => Some(self.lr(r, "warmup_max_lr", 1e-3)?),
        };
        Ok(SchedulerSettings::WarmupLR {
            warmup_min_lr: self.f64(r, "warmup_min_lr", 0.0)?,
            warmup_max_lr,
            warmup_num_steps: self.warmup_steps(r)?,
            warmup_type: self.warmup_type(r)?,
        })
    }

    fn one_cycle(&self, r: &mut Reader<'_>) -> Result<SchedulerSettings, ConfigError> {
        for key in ["cycle_min_lr", "cycle_max_lr"] {
            if !self.obj.has(key) {
                return Err(ConfigError::Missing {
                    at: r.at("scheduler.params", self.obj.node),
                    key: key.into(),
                    hint: "OneCycle needs cycle_min_lr and cycle_max_lr".into(),
                });
            }
        }
        // Read in DeepSpeed's order, so that the first problem is the one reported.
        let first = self.u64(r, "cycle_first_step_size", 2000)?;
        let second = self.optional_u64(r, "cycle_second_step_size", first)?;
        if first == 0 {
            let why = "cycle_first_step_size must be at least 1 (DeepSpeed divides by it)";
            return Err(self.out_of_range(r, "cycle_first_step_size", why));
        }
        let second_stairs = self.optional_u64(r, "cycle_second_stair_count", 0)?;
        Ok(SchedulerSettings::OneCycle {
            cycle_min_lr: self.f64(r, "cycle_min_lr", 0.0)?,
            cycle_max_lr: self.lr(r, "cycle_max_lr", 0.0)?,
            decay_lr_rate: self.f64(r, "decay_lr_rate", 0.0)?,
            cycle_first_step_size: first,
            cycle_second_step_size: second,
            cycle_first_stair_count: self.u64(r, "cycle_first_stair_count", 0)?,
            cycle_second_stair_count: second_stairs,
            decay_step_size: self.u64(r, "decay_step_size", 0)?,
            cycle_momentum: r.bool_or(self.obj, "cycle_momentum", true)?,
            cycle_min_mom: self.f64(r, "cycle_min_mom", 0.8)?,
            cycle_max_mom: self.f64(r, "cycle_max_mom", 0.9)?,
            decay_mom_rate: self.f64(r, "decay_mom_rate", 0.0)?,
        })
    }

    fn lr_range_test(&self, r: &mut Reader<'_>) -> Result<SchedulerSettings, ConfigError> {
        let step_size = self.at_least_one(
            r,
            ("lr_range_test_step_size", 2000),
            "lr_range_test_step_size must be at least 1",
        )?;
        Ok(SchedulerSettings::LRRangeTest {
            lr_range_test_min_lr: self.f64(r, "lr_range_test_min_lr", 1e-3)?,
            lr_range_test_step_size: step_size,
            lr_range_test_step_rate: self.f64(r, "lr_range_test_step_rate", 1.0)?,
            lr_range_test_staircase: r.bool_or(self.obj, "lr_range_test_staircase", false)?,
        })
    }
}
