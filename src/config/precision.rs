//! The `fp16` and `bf16` blocks (and the deprecated `bfloat16`) and the one training precision
//! they and the command line resolve to.

use super::error::ConfigError;
use super::json::Member;
use super::reader::{join, Obj, Reader, HINT};
use super::settings::*;

const FP16_KEYS: &[&str] = &[
    "enabled",
    "auto_cast",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "fp16_master_weights_and_grads",
];

/// The fp16 keys that configure the dynamic loss scaler.
const FP16_DYNAMIC_KEYS: &[&str] = &[
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
];

const BF16_KEYS: &[&str] = &[
    "enabled",
    "immediate_grad_update",
    "bf16_optimizer_states",
    "bf16_master_weights_and_grads",
];

/// How `enabled` was given in the fp16 / bf16 block.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Enabled {
    Absent,
    Auto,
    Is(bool),
}

/// A block's `enabled` and its member (for error positions).
type EnabledAt<'n> = (Enabled, Option<&'n Member>);

fn enabled<'n>(r: &Reader<'_>, obj: Obj<'n>) -> Result<EnabledAt<'n>, ConfigError> {
    let Some(m) = obj.get("enabled") else {
        return Ok((Enabled::Absent, None));
    };
    if m.node.is_auto() {
        return Ok((Enabled::Auto, Some(m)));
    }
    Ok((
        Enabled::Is(r.node_bool(&join(obj.path, "enabled"), &m.node)?),
        Some(m),
    ))
}

/// The training precision with the fp16 and bf16 settings; `stage` for the warnings that depend
/// on it.
pub(super) fn precision(
    r: &mut Reader<'_>,
    root: Obj<'_>,
    stage: u8,
) -> Result<(Precision, Fp16Settings, Bf16Settings), ConfigError> {
    let (mut fp16, fp16_en) = match root.get("fp16") {
        Some(m) => fp16_block(r, m)?,
        None => (Fp16Settings::default(), (Enabled::Absent, None)),
    };
    let (mut bf16, bf16_en) = bf16_block(r, root)?;
    let precision = resolve(r, root, fp16_en, bf16_en)?;
    fp16.enabled = precision == Precision::Fp16;
    bf16.enabled = precision == Precision::Bf16;
    if fp16.fp16_master_weights_and_grads && stage != 2 {
        r.warn("fp16.fp16_master_weights_and_grads only acts at stage 2 with CPU offload");
    }
    Ok((precision, fp16, bf16))
}

fn fp16_block<'n>(
    r: &mut Reader<'_>,
    m: &'n Member,
) -> Result<(Fp16Settings, EnabledAt<'n>), ConfigError> {
    let mut fp16 = Fp16Settings::default();
    let o = r.object("fp16", &m.node)?;
    r.collect_unknown(o, FP16_KEYS);
    let en = enabled(r, o)?;
    fp16.auto_cast = r.bool_or(o, "auto_cast", false)?;
    fp16.loss_scale = r.nonneg_f64_or(o, "loss_scale", 0.0)?;
    let ipath = "fp16.initial_scale_power";
    fp16.initial_scale_power = r.read(
        ipath,
        o.get("initial_scale_power"),
        16,
        None,
        HINT,
        |r, p, n| {
            let v = r.node_u64(p, n)?;
            u32::try_from(v)
                .ok()
                .filter(|v| *v <= 64)
                .ok_or_else(|| ConfigError::OutOfRange {
                    at: r.at(p, n),
                    message: format!("{v} is too large; the scale is 2^{v}, keep it <= 64"),
                })
        },
    )?;
    fp16.loss_scale_window = r.u64_or(o, "loss_scale_window", 1000)?;
    fp16.hysteresis = r.u64_or(o, "hysteresis", 2)?;
    fp16.consecutive_hysteresis = r.bool_or(o, "consecutive_hysteresis", false)?;
    fp16.min_loss_scale = r.nonneg_f64_or(o, "min_loss_scale", 1.0)?;
    fp16.fp16_master_weights_and_grads = r.bool_or(o, "fp16_master_weights_and_grads", false)?;
    fp16.dynamic_args_given = FP16_DYNAMIC_KEYS.iter().any(|k| o.has(k));
    Ok((fp16, en))
}

/// The `bf16` block, or the deprecated `bfloat16` (not both).
fn bf16_block<'n>(
    r: &mut Reader<'_>,
    root: Obj<'n>,
) -> Result<(Bf16Settings, EnabledAt<'n>), ConfigError> {
    let mut bf16 = Bf16Settings::default();
    let (name, m) = match (root.get("bf16"), root.get("bfloat16")) {
        (Some(_), Some(old)) => {
            return Err(ConfigError::DeprecatedConflict {
                at: r.key_at("bfloat16", old),
                old: "bfloat16".into(),
                new: "bf16".into(),
            })
        }
        (Some(m), None) => ("bf16", m),
        (None, Some(m)) => {
            r.warn("bfloat16 is a deprecated name; rename the block to \"bf16\"");
            ("bfloat16", m)
        }
        (None, None) => return Ok((bf16, (Enabled::Absent, None))),
    };
    let o = r.object(name, &m.node)?;
    r.collect_unknown(o, BF16_KEYS);
    let en = enabled(r, o)?;
    bf16.immediate_grad_update = r.bool_or(o, "immediate_grad_update", false)?;
    bf16.bf16_optimizer_states = r.bool_or(o, "bf16_optimizer_states", false)?;
    bf16.bf16_master_weights_and_grads = r.bool_or(o, "bf16_master_weights_and_grads", false)?;
    Ok((bf16, en))
}

/// The precision: the command line's (which an explicit `enabled` must not contradict), else the
/// enabled block's (at most one), else fp32.
fn resolve(
    r: &Reader<'_>,
    root: Obj<'_>,
    fp16: EnabledAt<'_>,
    bf16: EnabledAt<'_>,
) -> Result<Precision, ConfigError> {
    let conflict = |name: &str, m: Option<&Member>, message: String| ConfigError::Invalid {
        at: match m {
            Some(m) => r.key_at(&format!("{name}.enabled"), m),
            None => r.src.at(name, root.node.span),
        },
        message,
    };
    let Some(p) = r.ctx.precision_override else {
        return match (fp16.0 == Enabled::Is(true), bf16.0 == Enabled::Is(true)) {
            (true, true) => Err(conflict(
                "bf16",
                bf16.1,
                "fp16 and bf16 are both enabled; enable at most one".into(),
            )),
            (true, false) => Ok(Precision::Fp16),
            (false, true) => Ok(Precision::Bf16),
            (false, false) => Ok(Precision::Fp32),
        };
    };
    for (name, (en, m), me) in [
        ("fp16", fp16, Precision::Fp16),
        ("bf16", bf16, Precision::Bf16),
    ] {
        let contradicts =
            (en == Enabled::Is(true) && p != me) || (en == Enabled::Is(false) && p == me);
        if contradicts {
            return Err(conflict(
                name,
                m,
                format!(
                    "the config sets {name}.enabled to {} but the command line asks for {}; \
                     write \"auto\" there or drop the command-line precision",
                    en == Enabled::Is(true),
                    p.as_str()
                ),
            ));
        }
    }
    Ok(p)
}
