//! `zero_optimization`: every key of DeepSpeedZeroConfig with its code default, the offload
//! blocks, the `stage3_` aliases, the legacy forms, and the "no effect at this stage" warnings.

use super::defaults;
use super::error::ConfigError;
use super::json::{Member, Node, Value};
use super::reader::{join, Obj, Reader, HINT};
use super::settings::{
    LocoSettings, OffloadDevice, OffloadOptimizerSettings, OffloadParamSettings, ZeroSettings,
};

const ZERO_KEYS: &[&str] = &[
    "stage",
    "contiguous_gradients",
    "reduce_scatter",
    "reduce_bucket_size",
    "use_multi_rank_bucket_allreduce",
    "allgather_partitions",
    "allgather_bucket_size",
    "overlap_comm",
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "offload_param",
    "offload_optimizer",
    "sub_group_size",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
    "cpu_offload",
    "prefetch_bucket_size",
    "stage3_prefetch_bucket_size",
    "param_persistence_threshold",
    "stage3_param_persistence_threshold",
    "model_persistence_threshold",
    "stage3_model_persistence_threshold",
    "max_live_parameters",
    "stage3_max_live_parameters",
    "max_reuse_distance",
    "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "module_granularity_threshold",
    "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params",
    "ignore_unused_parameters",
    "legacy_stage1",
    "round_robin_gradients",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "zeropp_loco_param",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
    // Newer DeepSpeed releases (after the 2025 snapshot our defaults follow): accepted and type
    // checked, listed in the "ignored" warning.
    "allgather_sequential",
    "stage3_allgather_sequential",
    "partition_stream_chunk_size",
    "stage3_partition_stream_chunk_size",
    "enable_sanity_checks",
    "save_muon_momentum_buffer_in_memory",
    "zenflow",
    "leaf_module",
];

/// Keys that act only at stage 3 (the stage-3 coordinator, partitioned parameters, its optimizer
/// tiling). Listed by the name written in the config.
const STAGE3_ONLY: &[&str] = &[
    "sub_group_size",
    "prefetch_bucket_size",
    "stage3_prefetch_bucket_size",
    "param_persistence_threshold",
    "stage3_param_persistence_threshold",
    "model_persistence_threshold",
    "stage3_model_persistence_threshold",
    "max_live_parameters",
    "stage3_max_live_parameters",
    "max_reuse_distance",
    "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "module_granularity_threshold",
    "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params",
    "memory_efficient_linear",
    "override_module_apply",
    "log_trace_cache_warnings",
    "offload_param",
    "cpu_offload_param",
];

const PARAM_KEYS: &[&str] = &[
    "device",
    "nvme_path",
    "buffer_count",
    "buffer_size",
    "max_in_cpu",
    "pin_memory",
];
const OPTIMIZER_KEYS: &[&str] = &[
    "device",
    "nvme_path",
    "buffer_count",
    "pin_memory",
    "pipeline_read",
    "pipeline_write",
    "fast_init",
    "ratio",
];

/// Returns the member given under either name; both given is an error.
fn aliased<'n>(
    r: &Reader<'_>,
    obj: Obj<'n>,
    plain: &str,
    prefixed: &str,
) -> Result<Option<(&'n Member, String)>, ConfigError> {
    match (obj.get(plain), obj.get(prefixed)) {
        (Some(_), Some(b)) => Err(ConfigError::AliasConflict {
            at: r.key_at(&join(obj.path, prefixed), b),
            first: plain.into(),
            second: prefixed.into(),
        }),
        (Some(a), None) => Ok(Some((a, join(obj.path, plain)))),
        (None, Some(b)) => Ok(Some((b, join(obj.path, prefixed)))),
        (None, None) => Ok(None),
    }
}

fn u64_aliased(
    r: &mut Reader<'_>,
    obj: Obj<'_>,
    plain: &str,
    default: u64,
    auto: Option<u64>,
    hint: &str,
) -> Result<u64, ConfigError> {
    let prefixed = format!("stage3_{plain}");
    match aliased(r, obj, plain, &prefixed)? {
        Some((m, path)) => r.read(&path, Some(m), default, auto, hint, |r, p, n| {
            r.node_u64(p, n)
        }),
        None => Ok(default),
    }
}

fn bool_aliased(
    r: &mut Reader<'_>,
    obj: Obj<'_>,
    plain: &str,
    default: bool,
) -> Result<Option<bool>, ConfigError> {
    let prefixed = format!("stage3_{plain}");
    match aliased(r, obj, plain, &prefixed)? {
        Some((m, path)) => r
            .read(&path, Some(m), default, None, HINT, |r, p, n| {
                r.node_bool(p, n)
            })
            .map(Some),
        None => Ok(None),
    }
}

fn device(r: &Reader<'_>, path: &str, node: &Node) -> Result<OffloadDevice, ConfigError> {
    match r.node_str(path, node)? {
        "none" => Ok(OffloadDevice::None),
        "cpu" => Ok(OffloadDevice::Cpu),
        "nvme" => Ok(OffloadDevice::Nvme),
        other => Err(ConfigError::InvalidChoice {
            at: r.at(path, node),
            value: other.into(),
            allowed: "\"none\", \"cpu\", \"nvme\"".into(),
        }),
    }
}

fn nvme_path(r: &mut Reader<'_>, obj: Obj<'_>) -> Result<Option<std::path::PathBuf>, ConfigError> {
    let path = join(obj.path, "nvme_path");
    r.read(
        &path,
        obj.get("nvme_path"),
        None,
        None,
        HINT,
        |r, p, n| match n.value {
            Value::Null => Ok(None),
            _ => r.node_str(p, n).map(|s| Some(s.into())),
        },
    )
}

fn check_nvme(
    r: &Reader<'_>,
    obj: Obj<'_>,
    dev: OffloadDevice,
    path: &Option<std::path::PathBuf>,
) -> Result<(), ConfigError> {
    if dev == OffloadDevice::Nvme && path.is_none() {
        let node = obj.get("device").map(|m| &m.node).unwrap_or(obj.node);
        return Err(ConfigError::Invalid {
            at: r.at(&join(obj.path, "device"), node),
            message: "device \"nvme\" needs \"nvme_path\" (a directory on a fast local disk, \
                      e.g. \"/local_nvme\")"
                .into(),
        });
    }
    Ok(())
}

/// Reads a block that may be null (= absent).
fn optional_block<'n>(
    r: &Reader<'_>,
    path: &'n str,
    m: Option<&'n Member>,
) -> Result<Option<Obj<'n>>, ConfigError> {
    match m {
        None => Ok(None),
        Some(m) if matches!(m.node.value, Value::Null) => Ok(None),
        Some(m) => r.object(path, &m.node).map(Some),
    }
}

fn offload_param(r: &mut Reader<'_>, obj: Obj<'_>) -> Result<OffloadParamSettings, ConfigError> {
    r.deny_unknown(obj, PARAM_KEYS)?;
    let d = OffloadParamSettings::default();
    let dpath = join(obj.path, "device");
    let device = r.read(&dpath, obj.get("device"), d.device, None, HINT, device)?;
    let nvme_path = nvme_path(r, obj)?;
    check_nvme(r, obj, device, &nvme_path)?;
    Ok(OffloadParamSettings {
        device,
        nvme_path,
        buffer_count: r.u64_or(obj, "buffer_count", d.buffer_count)?,
        buffer_size: r.u64_or(obj, "buffer_size", d.buffer_size)?,
        max_in_cpu: r.u64_or(obj, "max_in_cpu", d.max_in_cpu)?,
        pin_memory: r.bool_or(obj, "pin_memory", d.pin_memory)?,
    })
}

fn offload_optimizer(
    r: &mut Reader<'_>,
    obj: Obj<'_>,
) -> Result<OffloadOptimizerSettings, ConfigError> {
    r.deny_unknown(obj, OPTIMIZER_KEYS)?;
    let d = OffloadOptimizerSettings::default();
    let dpath = join(obj.path, "device");
    let device = r.read(&dpath, obj.get("device"), d.device, None, HINT, device)?;
    let nvme_path = nvme_path(r, obj)?;
    check_nvme(r, obj, device, &nvme_path)?;
    let rpath = join(obj.path, "ratio");
    let ratio = r.read(&rpath, obj.get("ratio"), d.ratio, None, HINT, |r, p, n| {
        let v = r.node_f64(p, n)?;
        if !(0.0..=1.0).contains(&v) {
            return Err(ConfigError::OutOfRange {
                at: r.at(p, n),
                message: format!("ratio {v} must be between 0 and 1"),
            });
        }
        Ok(v)
    })?;
    Ok(OffloadOptimizerSettings {
        device,
        nvme_path,
        buffer_count: r.u64_or(obj, "buffer_count", d.buffer_count)?,
        pin_memory: r.bool_or(obj, "pin_memory", d.pin_memory)?,
        pipeline_read: r.bool_or(obj, "pipeline_read", d.pipeline_read)?,
        pipeline_write: r.bool_or(obj, "pipeline_write", d.pipeline_write)?,
        fast_init: r.bool_or(obj, "fast_init", d.fast_init)?,
        ratio,
    })
}

/// Parses `zero_optimization` (absent, a legacy bool, null, or an object).
pub(crate) fn parse(r: &mut Reader<'_>, m: Option<&Member>) -> Result<ZeroSettings, ConfigError> {
    let mut z = ZeroSettings::default();
    let Some(m) = m else { return Ok(z) };
    match &m.node.value {
        Value::Null => return Ok(z),
        Value::Bool(b) => {
            z.stage = u8::from(*b);
            r.warn(format!(
                "zero_optimization: the boolean form is deprecated (DeepSpeed reads true as stage 1); \
                 write \"zero_optimization\": {{\"stage\": {}}}",
                z.stage
            ));
            return Ok(z);
        }
        _ => {}
    }
    let obj = r.object("zero_optimization", &m.node)?;
    r.deny_unknown(obj, ZERO_KEYS)?;
    z.stage = stage(r, obj)?;
    reduction_keys(r, obj, &mut z)?;
    stage3_keys(r, obj, &mut z)?;
    zeropp_and_other_keys(r, obj, &mut z)?;
    newer_keys(r, obj)?;
    offloads(r, obj, &mut z)?;
    stage_warnings(r, obj, &z);
    inert_keys(r, &z);
    Ok(z)
}

/// `stage` (0-3), refusing the removed `legacy_stage1`.
fn stage(r: &mut Reader<'_>, obj: Obj<'_>) -> Result<u8, ConfigError> {
    let spath = join(obj.path, "stage");
    let stage = r.read(&spath, obj.get("stage"), 0, None, HINT, |r, p, n| {
        let v = r.node_u64(p, n)?;
        if v > 3 {
            return Err(ConfigError::InvalidChoice {
                at: r.at(p, n),
                value: v.to_string(),
                allowed: "0, 1, 2, 3".into(),
            });
        }
        Ok(v as u8)
    })?;
    if let Some(lm) = obj.get("legacy_stage1") {
        let p = join(obj.path, "legacy_stage1");
        if r.node_bool(&p, &lm.node)? {
            return Err(ConfigError::Unsupported {
                at: r.key_at(&p, lm),
                what: "legacy_stage1".into(),
                hint: "it was removed from DeepSpeed in 0.5.9; delete the key".into(),
            });
        }
    }
    Ok(stage)
}

/// Hugging Face's `"auto"` sizes are computed from the model's hidden size (`--hidden-size`).
const HINT_HIDDEN: &str =
    "pass --hidden-size so zerodp can compute it the way Hugging Face does, or write a number";

/// The gradient reduction and partition keys of stages 1-3: buckets, overlap, sub-groups.
fn reduction_keys(
    r: &mut Reader<'_>,
    obj: Obj<'_>,
    z: &mut ZeroSettings,
) -> Result<(), ConfigError> {
    let h = r.ctx.hidden_size.map(|h| h as u64);
    let stage = z.stage;
    z.contiguous_gradients = r.bool_or(obj, "contiguous_gradients", z.contiguous_gradients)?;
    z.reduce_scatter = r.bool_or(obj, "reduce_scatter", z.reduce_scatter)?;
    // 0 is DeepSpeed's "no bucket, each gradient reduced on its own" (Hugging Face's test
    // configs set it); the engine then reduces each unit's gradient on its own.
    let rpath = join(obj.path, "reduce_bucket_size");
    z.reduce_bucket_size = r.read(
        &rpath,
        obj.get("reduce_bucket_size"),
        z.reduce_bucket_size,
        h.map(|h| h.saturating_mul(h)),
        HINT_HIDDEN,
        |r, p, n| r.node_u64(p, n),
    )?;
    z.use_multi_rank_bucket_allreduce = r.bool_or(
        obj,
        "use_multi_rank_bucket_allreduce",
        z.use_multi_rank_bucket_allreduce,
    )?;
    z.allgather_partitions = r.bool_or(obj, "allgather_partitions", z.allgather_partitions)?;
    z.allgather_bucket_size = r.u64_or(obj, "allgather_bucket_size", z.allgather_bucket_size)?;
    let opath = join(obj.path, "overlap_comm");
    // DeepSpeed's validator: None -> true at stage 3, false otherwise (its docs say false).
    z.overlap_comm = r.read(
        &opath,
        obj.get("overlap_comm"),
        defaults::overlap_comm(stage),
        None,
        HINT,
        |r, p, n| match n.value {
            Value::Null => Ok(defaults::overlap_comm(stage)),
            _ => r.node_bool(p, n),
        },
    )?;
    z.load_from_fp32_weights =
        r.bool_or(obj, "load_from_fp32_weights", z.load_from_fp32_weights)?;
    z.elastic_checkpoint = r.bool_or(obj, "elastic_checkpoint", z.elastic_checkpoint)?;
    z.sub_group_size = r.u64_or(obj, "sub_group_size", z.sub_group_size)?;
    Ok(())
}

/// Stage 3's keys (prefixed `stage3_` or not): prefetch, persistence, live parameters, reuse,
/// the 16-bit save.
fn stage3_keys(r: &mut Reader<'_>, obj: Obj<'_>, z: &mut ZeroSettings) -> Result<(), ConfigError> {
    let h = r.ctx.hidden_size.map(|h| h as u64);
    z.prefetch_bucket_size = u64_aliased(
        r,
        obj,
        "prefetch_bucket_size",
        z.prefetch_bucket_size,
        h.map(|h| (0.9 * h.saturating_mul(h) as f64) as u64),
        HINT_HIDDEN,
    )?;
    z.param_persistence_threshold = u64_aliased(
        r,
        obj,
        "param_persistence_threshold",
        z.param_persistence_threshold,
        h.map(|h| h.saturating_mul(10)),
        HINT_HIDDEN,
    )?;
    z.model_persistence_threshold = u64_aliased(
        r,
        obj,
        "model_persistence_threshold",
        z.model_persistence_threshold,
        None,
        HINT,
    )?;
    z.max_live_parameters = u64_aliased(
        r,
        obj,
        "max_live_parameters",
        z.max_live_parameters,
        None,
        HINT,
    )?;
    z.max_reuse_distance = u64_aliased(
        r,
        obj,
        "max_reuse_distance",
        z.max_reuse_distance,
        None,
        HINT,
    )?;
    z.module_granularity_threshold = u64_aliased(
        r,
        obj,
        "module_granularity_threshold",
        z.module_granularity_threshold,
        None,
        HINT,
    )?;
    if let Some(v) = bool_aliased(r, obj, "use_all_reduce_for_fetch_params", false)? {
        z.use_all_reduce_for_fetch_params = v;
    }
    let gather_new = bool_aliased(r, obj, "gather_16bit_weights_on_model_save", false)?;
    if let Some(old) = obj.get("stage3_gather_fp16_weights_on_model_save") {
        let p = join(obj.path, "stage3_gather_fp16_weights_on_model_save");
        if gather_new.is_some() {
            return Err(ConfigError::DeprecatedConflict {
                at: r.key_at(&p, old),
                old: "stage3_gather_fp16_weights_on_model_save".into(),
                new: "stage3_gather_16bit_weights_on_model_save".into(),
            });
        }
        z.gather_16bit_weights_on_model_save =
            r.read(&p, Some(old), false, None, HINT, |r, p, n| {
                r.node_bool(p, n)
            })?;
        r.warn(format!(
            "{p} is deprecated; use zero_optimization.stage3_gather_16bit_weights_on_model_save"
        ));
    } else if let Some(v) = gather_new {
        z.gather_16bit_weights_on_model_save = v;
    }
    Ok(())
}

/// ZeRO++ (hpZ, quantized weights and gradients, LoCo), MiCS and the remaining flags.
fn zeropp_and_other_keys(
    r: &mut Reader<'_>,
    obj: Obj<'_>,
    z: &mut ZeroSettings,
) -> Result<(), ConfigError> {
    z.ignore_unused_parameters =
        r.bool_or(obj, "ignore_unused_parameters", z.ignore_unused_parameters)?;
    z.round_robin_gradients = r.bool_or(obj, "round_robin_gradients", z.round_robin_gradients)?;
    // "auto": the ranks of a host, as the launcher placed them (off on one host).
    let auto = r.ctx.ranks_per_host.map_or(1, |h| h as u64);
    let path = join(obj.path, "zero_hpz_partition_size");
    let default = z.zero_hpz_partition_size;
    z.zero_hpz_partition_size = r.read(
        &path,
        obj.get("zero_hpz_partition_size"),
        default,
        Some(auto),
        "an integer (ranks per host) or \"auto\"",
        |r, p, n| r.node_u64(p, n),
    )?;
    z.zero_quantized_weights = r.bool_or(obj, "zero_quantized_weights", false)?;
    z.zero_quantized_nontrainable_weights =
        r.bool_or(obj, "zero_quantized_nontrainable_weights", false)?;
    z.zero_quantized_gradients = r.bool_or(obj, "zero_quantized_gradients", false)?;
    let lpath = join(obj.path, "zeropp_loco_param");
    if let Some(lo) = optional_block(r, &lpath, obj.get("zeropp_loco_param"))? {
        r.collect_unknown(lo, &["err_beta", "reset_T"]);
        z.zeropp_loco_param = Some(LocoSettings {
            err_beta: r.f64_or(lo, "err_beta", 0.8)?,
            reset_t: r.u64_or(lo, "reset_T", 1024)?,
        });
    }
    let mpath = join(obj.path, "mics_shard_size");
    z.mics_shard_size = r.read(
        &mpath,
        obj.get("mics_shard_size"),
        -1,
        None,
        HINT,
        |r, p, n| r.node_i64(p, n),
    )?;
    z.mics_hierarchical_params_gather = r.bool_or(obj, "mics_hierarchical_params_gather", false)?;
    z.memory_efficient_linear =
        r.bool_or(obj, "memory_efficient_linear", z.memory_efficient_linear)?;
    z.pipeline_loading_checkpoint = r.bool_or(obj, "pipeline_loading_checkpoint", false)?;
    z.override_module_apply = r.bool_or(obj, "override_module_apply", z.override_module_apply)?;
    z.log_trace_cache_warnings = r.bool_or(obj, "log_trace_cache_warnings", false)?;
    Ok(())
}

/// Keys from DeepSpeed releases newer than the one our defaults follow: checked for type, then
/// reported as ignored.
fn newer_keys(r: &mut Reader<'_>, obj: Obj<'_>) -> Result<(), ConfigError> {
    if let Some((m, path)) = aliased(
        r,
        obj,
        "allgather_sequential",
        "stage3_allgather_sequential",
    )? {
        r.node_bool(&path, &m.node)?;
        r.ignored.push(path);
    }
    if let Some((m, path)) = aliased(
        r,
        obj,
        "partition_stream_chunk_size",
        "stage3_partition_stream_chunk_size",
    )? {
        r.node_u64(&path, &m.node)?;
        r.ignored.push(path);
    }
    for key in [
        "enable_sanity_checks",
        "save_muon_momentum_buffer_in_memory",
    ] {
        if let Some(m) = obj.get(key) {
            let path = join(obj.path, key);
            r.node_bool(&path, &m.node)?;
            r.ignored.push(path);
        }
    }
    for key in ["zenflow", "leaf_module"] {
        let path = join(obj.path, key);
        if optional_block(r, &path, obj.get(key))?.is_some() {
            r.ignored.push(path);
        }
    }
    Ok(())
}

/// The modern offload blocks and their legacy spellings.
fn offloads(r: &mut Reader<'_>, obj: Obj<'_>, z: &mut ZeroSettings) -> Result<(), ConfigError> {
    let ppath = join(obj.path, "offload_param");
    let opath = join(obj.path, "offload_optimizer");
    if let Some(po) = optional_block(r, &ppath, obj.get("offload_param"))? {
        z.offload_param = offload_param(r, po)?;
    }
    if let Some(oo) = optional_block(r, &opath, obj.get("offload_optimizer"))? {
        z.offload_optimizer = offload_optimizer(r, oo)?;
    }
    let legacy = [
        ("cpu_offload", "offload_optimizer"),
        ("cpu_offload_param", "offload_param"),
    ];
    let mut legacy_pin_target = Vec::new();
    for (old, new) in legacy {
        let Some(m) = obj.get(old) else { continue };
        let p = join(obj.path, old);
        if obj.has(new) {
            return Err(ConfigError::DeprecatedConflict {
                at: r.key_at(&p, m),
                old: old.into(),
                new: new.into(),
            });
        }
        let on = r.read(&p, Some(m), false, None, HINT, |r, p, n| r.node_bool(p, n))?;
        r.warn(format!(
            "{p} is deprecated; use \"{}\": {{\"device\": \"cpu\"}}",
            join(obj.path, new)
        ));
        if on {
            if new == "offload_optimizer" {
                z.offload_optimizer.device = OffloadDevice::Cpu;
            } else {
                z.offload_param.device = OffloadDevice::Cpu;
            }
            legacy_pin_target.push(new);
        }
    }
    if let Some(m) = obj.get("cpu_offload_use_pin_memory") {
        let p = join(obj.path, "cpu_offload_use_pin_memory");
        for new in ["offload_optimizer", "offload_param"] {
            if obj.has(new) {
                return Err(ConfigError::DeprecatedConflict {
                    at: r.key_at(&p, m),
                    old: "cpu_offload_use_pin_memory".into(),
                    new: format!("{new}.pin_memory"),
                });
            }
        }
        let pin = r.read(&p, Some(m), false, None, HINT, |r, p, n| r.node_bool(p, n))?;
        r.warn(format!(
            "{p} is deprecated; use \"pin_memory\" inside zero_optimization.offload_optimizer / \
             offload_param"
        ));
        // DeepSpeed ignores this value; zerodp applies it to the offloads the legacy keys created.
        for t in legacy_pin_target {
            if t == "offload_optimizer" {
                z.offload_optimizer.pin_memory = pin;
            } else {
                z.offload_param.pin_memory = pin;
            }
        }
    }
    if z.offload_optimizer.ratio < 1.0 && z.stage != 3 {
        let m = obj
            .get("offload_optimizer")
            .map(|m| &m.node)
            .unwrap_or(obj.node);
        return Err(ConfigError::Invalid {
            at: r.at(&join(obj.path, "offload_optimizer.ratio"), m),
            message: format!(
                "partial optimizer offload (ratio {}) needs stage 3, the config has stage {}; \
                 set ratio to 1.0 or use stage 3",
                z.offload_optimizer.ratio, z.stage
            ),
        });
    }
    Ok(())
}

/// Keys DeepSpeed acts on that zerodp reads (their types are checked) but that change nothing
/// here, when a config sets them away from DeepSpeed's default: one warning naming each with why,
/// so that a tuned config does not pass silently.
fn inert_keys(r: &mut Reader<'_>, z: &ZeroSettings) {
    let d = ZeroSettings::default();
    let o = &z.offload_optimizer;
    let inert = super::parse::set_reasons(&[
        (
            z.allgather_bucket_size != d.allgather_bucket_size,
            "allgather_bucket_size",
            "each unit's parameters are all-gathered in one call, without buckets",
        ),
        (
            !z.allgather_partitions,
            "allgather_partitions",
            "DeepSpeed does not read it either",
        ),
        (
            !z.use_multi_rank_bucket_allreduce,
            "use_multi_rank_bucket_allreduce",
            "zerodp's all-reduce has no multi-rank buckets",
        ),
        (
            z.model_persistence_threshold != d.model_persistence_threshold,
            "model_persistence_threshold",
            "only the per-unit param_persistence_threshold applies",
        ),
        (
            z.module_granularity_threshold != d.module_granularity_threshold,
            "module_granularity_threshold",
            "the model's units are what is gathered",
        ),
        (
            z.use_all_reduce_for_fetch_params,
            "use_all_reduce_for_fetch_params",
            "parameters are always fetched by all-gather",
        ),
        (
            !z.ignore_unused_parameters,
            "ignore_unused_parameters",
            "a parameter without a gradient gets a zero gradient, never an error",
        ),
        (
            z.elastic_checkpoint,
            "elastic_checkpoint",
            "zerodp's checkpoints load at any world size and stage anyway",
        ),
        (
            (1..=2).contains(&z.stage) && z.round_robin_gradients,
            "round_robin_gradients",
            "it orders gradient copies to an accelerator's host; no result changes",
        ),
        (
            o.pipeline_read || o.pipeline_write,
            "offload_optimizer.pipeline_read/pipeline_write",
            "the NVMe stream always reads ahead and writes behind",
        ),
        (
            o.fast_init,
            "offload_optimizer.fast_init",
            "the swap file is reserved zeroed at start-up, without writing it",
        ),
        (
            !z.memory_efficient_linear,
            "memory_efficient_linear",
            "a PyTorch autograd function zerodp has no counterpart of",
        ),
        (
            z.pipeline_loading_checkpoint,
            "pipeline_loading_checkpoint",
            "a pipeline-parallel loader",
        ),
        (
            !z.override_module_apply,
            "override_module_apply",
            "a PyTorch module hook",
        ),
        (
            z.log_trace_cache_warnings,
            "log_trace_cache_warnings",
            "zerodp's prefetch order is fixed by the units, with no trace to invalidate",
        ),
    ]);
    if !inert.is_empty() {
        r.warn(format!(
            "zero_optimization: set, but without effect in zerodp: {inert}"
        ));
    }
}

/// Warnings for keys that are accepted but change nothing at the configured stage, and for the
/// ZeRO++ / MiCS features that are not implemented.
fn stage_warnings(r: &mut Reader<'_>, obj: Obj<'_>, z: &ZeroSettings) {
    let stage = z.stage;
    if stage < 3 {
        let idle: Vec<&str> = STAGE3_ONLY.iter().copied().filter(|k| obj.has(k)).collect();
        if !idle.is_empty() {
            let (verb, have) = if idle.len() == 1 {
                ("acts", "has")
            } else {
                ("act", "have")
            };
            r.warn(format!(
                "zero_optimization: {} only {verb} at stage 3 and {have} no effect at stage \
                 {stage} (DeepSpeed ignores this silently)",
                idle.join(", ")
            ));
        }
    }
    if stage == 0 && z.offload_optimizer.device != OffloadDevice::None {
        r.warn(
            "zero_optimization.offload_optimizer has no effect at stage 0; use stage 1 or higher \
             to offload the optimizer",
        );
    }
    if (stage == 0 || stage == 3) && obj.has("round_robin_gradients") {
        r.warn(format!(
            "zero_optimization.round_robin_gradients only acts at stages 1 and 2; it has no \
             effect at stage {stage}"
        ));
    }
    let (hpz, world) = (z.zero_hpz_partition_size, r.ctx.world_size as u64);
    if hpz > 1 && stage < 3 {
        r.warn(format!(
            "zero_optimization.zero_hpz_partition_size only acts at stage 3 (it partitions the \
             gathered parameters); it has no effect at stage {stage}"
        ));
    } else if hpz > 1 && (hpz >= world || world % hpz != 0) {
        r.warn(format!(
            "zero_optimization.zero_hpz_partition_size {hpz} on {world} rank(s): hpZ needs hosts \
             of {hpz} ranks that split the world into two or more; training runs plain stage 3 \
             (set it to the ranks per host, or \"auto\")"
        ));
    }
    if z.zero_quantized_weights && stage < 3 {
        r.warn(format!(
            "zero_optimization.zero_quantized_weights only acts at stage 3 (it quantizes the \
             parameters' all-gathers); it has no effect at stage {stage}"
        ));
    }
    if z.zero_quantized_gradients && stage < 3 {
        r.warn(format!(
            "zero_optimization.zero_quantized_gradients only acts at stage 3 (it quantizes the \
             gradients' reduce-scatter); it has no effect at stage {stage}"
        ));
    }
    let mut zpp = Vec::new();
    if z.zero_quantized_nontrainable_weights {
        zpp.push("zero_quantized_nontrainable_weights");
    }
    if z.zeropp_loco_param.is_some() {
        zpp.push("zeropp_loco_param");
    }
    if z.mics_shard_size > 0 {
        zpp.push("mics_shard_size");
    }
    if z.mics_hierarchical_params_gather {
        zpp.push("mics_hierarchical_params_gather");
    }
    if !zpp.is_empty() {
        r.warn(format!(
            "zero_optimization: ZeRO++ / MiCS ({}) are not supported yet; training runs plain \
             ZeRO stage {stage} without them",
            zpp.join(", ")
        ));
    }
}
