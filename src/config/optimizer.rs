//! The `optimizer` block: Adam and AdamW with DeepSpeed's keys, defaults and refusals.

use super::error::ConfigError;
use super::json::{Member, Node, Value};
use super::reader::{Obj, Reader, HINT};
use super::settings::*;

/// Optimizer names DeepSpeed knows besides Adam/AdamW (refused as not supported).
const OTHER_OPTIMIZERS: &[&str] = &[
    "lamb",
    "onebitadam",
    "zerooneadam",
    "onebitlamb",
    "adagrad",
    "lion",
    "muadam",
    "muadamw",
    "musgd",
    "muon",
    "sgd",
];

const ADAM_PARAMS: &[&str] = &[
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "adam_w_mode",
    "bias_correction",
    "torch_adam",
    "amsgrad",
    "max_grad_norm",
];

/// Reads `optimizer` (`m`).
pub(super) fn optimizer(r: &mut Reader<'_>, m: &Member) -> Result<OptimizerSettings, ConfigError> {
    let o = r.object("optimizer", &m.node)?;
    r.collect_unknown(o, &["type", "params", "legacy_fusion"]);
    let kind = kind(r, o, m)?;
    let mut s = OptimizerSettings {
        kind,
        ..OptimizerSettings::default()
    };
    let Some(pm) = o.get("params") else {
        return Ok(s);
    };
    let p = r.object("optimizer.params", &pm.node)?;
    r.deny_unknown(p, ADAM_PARAMS)?;
    if let Some(g) = p.get("max_grad_norm") {
        return Err(ConfigError::Unsupported {
            at: r.key_at("optimizer.params.max_grad_norm", g),
            what: "optimizer.params.max_grad_norm".into(),
            hint: "DeepSpeed rejects it too: use the top-level \"gradient_clipping\"".into(),
        });
    }
    let lr_auto = r.ctx.lr;
    s.lr = r.read(
        "optimizer.params.lr",
        p.get("lr"),
        s.lr,
        lr_auto,
        "write a number (a command that takes a learning rate fills it)",
        |r, p, n| r.nonneg_f64(p, n),
    )?;
    s.betas = r.read(
        "optimizer.params.betas",
        p.get("betas"),
        s.betas,
        None,
        HINT,
        betas,
    )?;
    s.eps = r.nonneg_f64_or(p, "eps", s.eps)?;
    s.weight_decay = r.nonneg_f64_or(p, "weight_decay", s.weight_decay)?;
    let mode = r.read(
        "optimizer.params.adam_w_mode",
        p.get("adam_w_mode"),
        true,
        None,
        HINT,
        |r, p, n| r.node_bool(p, n),
    )?;
    s.bias_correction = r.bool_or(p, "bias_correction", true)?;
    r.bool_or(p, "torch_adam", false)?;
    if let Some(a) = p.get("amsgrad") {
        if r.node_bool("optimizer.params.amsgrad", &a.node)? {
            return Err(ConfigError::Unsupported {
                at: r.key_at("optimizer.params.amsgrad", a),
                what: "amsgrad".into(),
                hint: "DeepSpeed's fused and CPU Adam refuse it too; set it to false".into(),
            });
        }
    }
    s.adam_w_mode = adam_w_mode(r, (kind, mode), p.has("adam_w_mode"), s.weight_decay);
    Ok(s)
}

/// `optimizer.type`, case-insensitive: Adam or AdamW; DeepSpeed's other optimizers are named as
/// such in the refusal.
fn kind(r: &Reader<'_>, o: Obj<'_>, m: &Member) -> Result<OptimizerKind, ConfigError> {
    let Some(tm) = o.get("type") else {
        return Err(ConfigError::Missing {
            at: r.at("optimizer", &m.node),
            key: "type".into(),
            hint: "write \"type\": \"AdamW\" (or \"Adam\")".into(),
        });
    };
    let tname = r.node_str("optimizer.type", &tm.node)?;
    match tname.to_ascii_lowercase().as_str() {
        "adam" => Ok(OptimizerKind::Adam),
        "adamw" => Ok(OptimizerKind::AdamW),
        lower => Err(ConfigError::Unsupported {
            at: r.at("optimizer.type", &tm.node),
            what: match OTHER_OPTIMIZERS.contains(&lower) {
                true => format!("the DeepSpeed optimizer \"{tname}\""),
                false => format!("the optimizer \"{tname}\""),
            },
            hint: "zerodp implements \"Adam\" and \"AdamW\"".into(),
        }),
    }
}

/// `betas`: two numbers in [0, 1).
fn betas(r: &Reader<'_>, path: &str, n: &Node) -> Result<[f64; 2], ConfigError> {
    let Value::Array(items) = &n.value else {
        return Err(r.wrong_type(path, n, "a list of two numbers [beta1, beta2]"));
    };
    if items.len() != 2 {
        return Err(r.wrong_type(path, n, "a list of two numbers [beta1, beta2]"));
    }
    let mut b = [0.0; 2];
    for (i, it) in items.iter().enumerate() {
        let v = r.node_f64(&format!("{path}[{i}]"), it)?;
        if !(0.0..1.0).contains(&v) {
            return Err(ConfigError::OutOfRange {
                at: r.at(&format!("{path}[{i}]"), it),
                message: format!("beta {v} must be in [0, 1)"),
            });
        }
        b[i] = v;
    }
    Ok(b)
}

/// Whether the weight decay is decoupled, as DeepSpeed decides it: always for AdamW, for Adam
/// as `adam_w_mode` says (true by default); warns where a user likely expects otherwise.
fn adam_w_mode(
    r: &mut Reader<'_>,
    (kind, mode): (OptimizerKind, bool),
    mode_given: bool,
    weight_decay: f64,
) -> bool {
    match kind {
        OptimizerKind::AdamW => {
            if !mode {
                r.warn(
                    "optimizer.params.adam_w_mode is false but the type is AdamW; DeepSpeed \
                     (and zerodp) still apply decoupled weight decay. Use \"type\": \"Adam\" \
                     for L2 regularisation",
                );
            }
            true
        }
        OptimizerKind::Adam => {
            if !mode_given && weight_decay > 0.0 {
                r.warn(
                    "optimizer: \"type\": \"Adam\" applies decoupled weight decay (AdamW) because \
                     DeepSpeed's adam_w_mode defaults to true; set \"adam_w_mode\": false for \
                     classic L2 weight decay",
                );
            }
            mode
        }
    }
}
