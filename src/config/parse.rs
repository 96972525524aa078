//! The top level: walks the parsed tree into [`Settings`], block by block.

use super::error::ConfigError;
use super::json::{Node, Value};
use super::reader::{Obj, Reader, HINT};
use super::settings::*;
use super::{batch, optimizer, precision, scheduler, zero};

/// Top-level keys zerodp reads. Anything else is listed in the "ignored" warning.
const TOP_KEYS: &[&str] = &[
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_optimization",
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "bfloat16",
    "gradient_clipping",
    "steps_per_print",
    "wall_clock_breakdown",
    "communication_data_type",
    "comms_logger",
    "checkpoint",
    "activation_checkpointing",
    "data_types",
    "zerodp",
];

pub(crate) fn settings(r: &mut Reader<'_>, root: &Node) -> Result<Settings, ConfigError> {
    let root = r.object("", root)?;
    r.collect_unknown(root, TOP_KEYS);

    let zero = zero::parse(r, root.get("zero_optimization"))?;
    let batch = batch::resolve(r, root)?;
    let (precision, fp16, bf16) = precision::precision(r, root, zero.stage)?;
    let optimizer = match root.get("optimizer") {
        Some(m) if !matches!(m.node.value, Value::Null) => Some(optimizer::optimizer(r, m)?),
        _ => None,
    };
    let scheduler = match root.get("scheduler") {
        Some(m) if !matches!(m.node.value, Value::Null) => {
            Some(scheduler::scheduler(r, m, optimizer.as_ref())?)
        }
        _ => None,
    };
    let gradient_clipping = r.read(
        "gradient_clipping",
        root.get("gradient_clipping"),
        0.0,
        None,
        "write the max gradient norm (Hugging Face fills it from --max_grad_norm, default 1.0)",
        |r, p, n| r.nonneg_f64(p, n),
    )?;
    let steps_per_print = r.opt_u64(root, "steps_per_print")?;
    let wall_clock_breakdown = r.bool_or(root, "wall_clock_breakdown", false)?;
    let (communication_data_type, grad_accum_dtype) =
        reduction_dtypes(r, root, (precision, zero.stage), &bf16)?;
    let comms_logger = comms_logger(r, root)?;
    let checkpoint = checkpoint(r, root)?;
    let activation_checkpointing = activation_checkpointing(r, root)?;
    let zerodp = zerodp_block(r, root)?;

    warn_on_what_does_not_act(
        r,
        (&fp16, &bf16, &checkpoint, &activation_checkpointing),
        (precision, zero.stage),
    );
    Ok(Settings {
        zero_optimization: zero,
        batch,
        precision,
        fp16,
        bf16,
        optimizer,
        scheduler,
        gradient_clipping,
        steps_per_print,
        wall_clock_breakdown,
        communication_data_type,
        grad_accum_dtype,
        comms_logger,
        checkpoint,
        activation_checkpointing,
        zerodp,
        unresolved: std::mem::take(&mut r.unresolved),
    })
}

/// `communication_data_type` and the gradient accumulation dtype (`data_types.grad_accum_dtype`,
/// or `bf16.bf16_master_weights_and_grads`, or DeepSpeed's default for the precision and stage).
fn reduction_dtypes(
    r: &mut Reader<'_>,
    root: Obj<'_>,
    (precision, stage): (Precision, u8),
    bf16: &Bf16Settings,
) -> Result<(Precision, Precision), ConfigError> {
    let communication_data_type = r
        .read(
            "communication_data_type",
            root.get("communication_data_type"),
            None,
            None,
            HINT,
            |r, p, n| match n.value {
                Value::Null => Ok(None),
                _ => dtype(r, p, n, &["fp32", "fp16", "bf16"]).map(Some),
            },
        )?
        .unwrap_or(super::defaults::communication_data_type(precision));
    let mut grad_accum_dtype = super::defaults::grad_accum_dtype(precision, stage);
    if precision == Precision::Bf16 && bf16.bf16_master_weights_and_grads {
        // "and grads": bf16 gradients at every stage (stage 0 would accumulate in fp32 otherwise);
        // data_types.grad_accum_dtype still decides when given.
        grad_accum_dtype = Precision::Bf16;
    }
    if let Some(m) = root.get("data_types") {
        let dt = r.object("data_types", &m.node)?;
        r.collect_unknown(dt, &["grad_accum_dtype"]);
        let p = "data_types.grad_accum_dtype";
        if let Some(v) = r.read(
            p,
            dt.get("grad_accum_dtype"),
            None,
            None,
            HINT,
            |r, p, n| match n.value {
                Value::Null => Ok(None),
                _ => dtype(
                    r,
                    p,
                    n,
                    &[
                        "fp32", "float32", "float", "fp16", "float16", "half", "bf16", "bfloat16",
                        "bfloat",
                    ],
                )
                .map(Some),
            },
        )? {
            grad_accum_dtype = v;
        }
    }
    Ok((communication_data_type, grad_accum_dtype))
}

/// Warnings for settings that act other than a DeepSpeed user may expect, or not at all, and the
/// list of keys zerodp ignores.
fn warn_on_what_does_not_act(
    r: &mut Reader<'_>,
    (fp16, bf16, checkpoint, ac): (
        &Fp16Settings,
        &Bf16Settings,
        &CheckpointSettings,
        &ActivationCheckpointingSettings,
    ),
    (precision, stage): (Precision, u8),
) {
    if fp16.enabled && fp16.is_dynamic() && !fp16.dynamic_args_given && stage >= 1 {
        r.warn(
            "fp16: none of initial_scale_power, loss_scale_window, hysteresis, \
             consecutive_hysteresis, min_loss_scale is given; DeepSpeed's ZeRO optimizers would \
             then start the loss scale at 2^32 with hysteresis 1, zerodp uses the documented \
             2^16 and hysteresis 2 (write the keys to make the choice explicit)",
        );
    }
    inert_keys(r, fp16, bf16, checkpoint, ac);
    if bf16.bf16_master_weights_and_grads && precision != Precision::Bf16 {
        r.warn(
            "bf16.bf16_master_weights_and_grads has no effect unless the bf16 block is enabled \
             (the run keeps its parameters as the precision says)",
        );
    }
    if !r.ignored.is_empty() {
        let list = r.ignored.join(", ");
        r.warn(format!(
            "ignored (zerodp does not implement these keys; DeepSpeed reads them but they change \
             nothing here): {list}"
        ));
    }
}

/// A dtype name, case-insensitive, `torch.` prefix allowed; `allowed` lists the spellings the
/// key accepts (communication_data_type takes only the short ones, as in DeepSpeed).
fn dtype(
    r: &Reader<'_>,
    path: &str,
    node: &Node,
    allowed: &[&str],
) -> Result<Precision, ConfigError> {
    let s = r.node_str(path, node)?;
    let lower = s.to_ascii_lowercase();
    let name = lower.strip_prefix("torch.").unwrap_or(&lower);
    let p = match name {
        "fp32" | "float32" | "float" => Some(Precision::Fp32),
        "fp16" | "float16" | "half" => Some(Precision::Fp16),
        "bf16" | "bfloat16" | "bfloat" => Some(Precision::Bf16),
        _ => None,
    };
    match p {
        Some(p) if allowed.contains(&name) => Ok(p),
        _ => Err(ConfigError::InvalidChoice {
            at: r.at(path, node),
            value: s.into(),
            allowed: allowed.join(", "),
        }),
    }
}

/// zerodp's own block (DeepSpeed has no such keys): `device_memory`, the device tier's bytes per
/// rank; `optimizer_states_dtype`, Adam's moments in `fp32` or `bf16` whatever the training
/// precision (DeepSpeed's `bf16.bf16_optimizer_states` says the same for bf16 runs only).
fn zerodp_block(r: &mut Reader<'_>, root: Obj<'_>) -> Result<ZerodpSettings, ConfigError> {
    let mut z = ZerodpSettings::default();
    let Some(m) = root.get("zerodp") else {
        return Ok(z);
    };
    let o = r.object("zerodp", &m.node)?;
    r.deny_unknown(o, &["device_memory", "optimizer_states_dtype"])?;
    z.optimizer_states_dtype = r.read(
        "zerodp.optimizer_states_dtype",
        o.get("optimizer_states_dtype"),
        None,
        None,
        HINT,
        |r, p, n| dtype(r, p, n, &["fp32", "bf16"]).map(Some),
    )?;
    if let Some(node) = o.get("device_memory") {
        let bytes = r.u64_or(o, "device_memory", 0)?;
        if bytes == 0 {
            return Err(ConfigError::OutOfRange {
                at: r.key_at("zerodp.device_memory", node),
                message: "device_memory must be a positive number of bytes (for example 2e9)"
                    .into(),
            });
        }
        z.device_memory = Some(bytes);
    }
    Ok(z)
}

fn comms_logger(r: &mut Reader<'_>, root: Obj<'_>) -> Result<CommsLoggerSettings, ConfigError> {
    let mut c = CommsLoggerSettings::default();
    let Some(m) = root.get("comms_logger") else {
        return Ok(c);
    };
    let o = r.object("comms_logger", &m.node)?;
    r.deny_unknown(o, &["enabled", "verbose", "prof_all", "debug", "prof_ops"])?;
    c.enabled = r.bool_or(o, "enabled", false)?;
    c.verbose = r.bool_or(o, "verbose", false)?;
    c.prof_all = r.bool_or(o, "prof_all", true)?;
    c.debug = r.bool_or(o, "debug", false)?;
    c.prof_ops = r.read(
        "comms_logger.prof_ops",
        o.get("prof_ops"),
        Vec::new(),
        None,
        HINT,
        |r, p, n| {
            let Value::Array(items) = &n.value else {
                return Err(r.wrong_type(p, n, "a list of operation names"));
            };
            items
                .iter()
                .enumerate()
                .map(|(i, it)| r.node_str(&format!("{p}[{i}]"), it).map(str::to_string))
                .collect()
        },
    )?;
    if !c.enabled {
        r.warn(
            "comms_logger: the block is present with enabled false; DeepSpeed turns logging on \
             whenever the block exists, zerodp honours \"enabled\" and leaves it off",
        );
    }
    Ok(c)
}

/// `key (why)` for each `(set, key, why)` that is set, joined with "; " (empty when none is).
pub(super) fn set_reasons(keys: &[(bool, &str, &str)]) -> String {
    let set: Vec<String> = keys
        .iter()
        .filter(|(set, _, _)| *set)
        .map(|(_, key, why)| format!("{key} ({why})"))
        .collect();
    set.join("; ")
}

/// Keys outside `zero_optimization` that DeepSpeed acts on but that change nothing here, when set
/// away from DeepSpeed's default: one warning naming each with why.
fn inert_keys(
    r: &mut Reader<'_>,
    fp16: &Fp16Settings,
    bf16: &Bf16Settings,
    c: &CheckpointSettings,
    ac: &ActivationCheckpointingSettings,
) {
    let inert = set_reasons(&[
        (
            fp16.auto_cast,
            "fp16.auto_cast",
            "the model's inputs are token ids; the engine casts what it computes",
        ),
        (
            bf16.immediate_grad_update,
            "bf16.immediate_grad_update",
            "gradients are accumulated as each unit's backward ends anyway",
        ),
        (
            c.tag_validation != TagValidation::Warn,
            "checkpoint.tag_validation",
            "loading checks every file against the manifest's sizes and CRC-32 checksums",
        ),
        (
            c.load_universal,
            "checkpoint.load_universal",
            "zerodp's checkpoints load at any world size and stage without conversion",
        ),
        (
            c.use_node_local_storage,
            "checkpoint.use_node_local_storage",
            "ranks save into the one --save-dir",
        ),
        (
            c.parallel_write_pipeline_stage,
            "checkpoint.parallel_write.pipeline_stage",
            "zerodp has no pipeline stages",
        ),
        (
            ac.synchronize_checkpoint_boundary,
            "activation_checkpointing.synchronize_checkpoint_boundary",
            "a CUDA synchronisation",
        ),
        (
            ac.profile,
            "activation_checkpointing.profile",
            "the recomputed forward's time is `recompute` in wall_clock_breakdown and bench train",
        ),
    ]);
    if !inert.is_empty() {
        r.warn(format!("set, but without effect in zerodp: {inert}"));
    }
}

fn checkpoint(r: &mut Reader<'_>, root: Obj<'_>) -> Result<CheckpointSettings, ConfigError> {
    let mut c = CheckpointSettings::default();
    let Some(m) = root.get("checkpoint") else {
        return Ok(c);
    };
    let o = r.object("checkpoint", &m.node)?;
    r.collect_unknown(
        o,
        &[
            "tag_validation",
            "load_universal",
            "use_node_local_storage",
            "parallel_write",
        ],
    );
    c.tag_validation = r.read(
        "checkpoint.tag_validation",
        o.get("tag_validation"),
        TagValidation::Warn,
        None,
        HINT,
        |r, p, n| match r.node_str(p, n)?.to_ascii_uppercase().as_str() {
            "WARN" => Ok(TagValidation::Warn),
            "IGNORE" => Ok(TagValidation::Ignore),
            "FAIL" => Ok(TagValidation::Fail),
            other => Err(ConfigError::InvalidChoice {
                at: r.at(p, n),
                value: other.into(),
                allowed: "\"Warn\", \"Ignore\", \"Fail\"".into(),
            }),
        },
    )?;
    c.load_universal = r.bool_or(o, "load_universal", false)?;
    c.use_node_local_storage = r.bool_or(o, "use_node_local_storage", false)?;
    if let Some(pw) = o.get("parallel_write") {
        let po = r.object("checkpoint.parallel_write", &pw.node)?;
        r.collect_unknown(po, &["pipeline_stage"]);
        c.parallel_write_pipeline_stage = r.bool_or(po, "pipeline_stage", false)?;
    }
    Ok(c)
}

fn activation_checkpointing(
    r: &mut Reader<'_>,
    root: Obj<'_>,
) -> Result<ActivationCheckpointingSettings, ConfigError> {
    let mut a = ActivationCheckpointingSettings::default();
    let Some(m) = root.get("activation_checkpointing") else {
        return Ok(a);
    };
    let o = r.object("activation_checkpointing", &m.node)?;
    r.collect_unknown(
        o,
        &[
            "partition_activations",
            "contiguous_memory_optimization",
            "cpu_checkpointing",
            "number_checkpoints",
            "synchronize_checkpoint_boundary",
            "profile",
        ],
    );
    a.partition_activations = r.bool_or(o, "partition_activations", false)?;
    a.contiguous_memory_optimization = r.bool_or(o, "contiguous_memory_optimization", false)?;
    a.cpu_checkpointing = r.bool_or(o, "cpu_checkpointing", false)?;
    a.number_checkpoints = r.opt_u64(o, "number_checkpoints")?;
    a.synchronize_checkpoint_boundary = r.bool_or(o, "synchronize_checkpoint_boundary", false)?;
    a.profile = r.bool_or(o, "profile", false)?;
    Ok(a)
}
