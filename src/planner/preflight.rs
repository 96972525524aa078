//! `zerodp train`'s pre-flight check (and any program's that trains through the `Trainer`). Before any rank starts, the planner sizes the run as
//! configured (the actual model, stage, buckets, batch and activation checkpointing) with the
//! engine's own rules ([`ModelSize::from_model_spec`]), adds what the process holds beyond the
//! engine's ledger (the GPT's activations and candle's weight copies, the process's runtime and
//! training text: [`crate::planner::TrainProcess`]), and compares the total with the memory each
//! rank may use. A run that cannot fit is refused with the
//! planner's explanation: the bytes by kind, the lowest stage that would fit, and what to change in
//! the config. Ranks are threads sharing this machine's memory, so the capacity of a rank defaults
//! to the machine's total memory divided by the world size.

use crate::config::Settings;
use crate::planner::{
    self, format_capacity, format_gb, parse_bytes, recommend, Cluster, ConfigKeys, GptShape,
    HostLinks, Link, ModelSize, Offload, PlanError, PlanInput, PlanOption, TrainProcess,
};
use crate::zero::unit::ModelSpec;
use crate::zero::{device_tier, EngineConfig, OptimizerTier, ParamTier};

/// Why a run is refused before it starts.
#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    /// The run does not fit; the planner's explanation (bytes by kind, what would fit, what to
    /// change).
    #[error("{0}")]
    DoesNotFit(String),
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The memory a rank may use could not be read from the system.
    #[error("{0}")]
    HostMemory(String),
}

/// How this process was launched, which decides whose memory the ranks share and who reports.
#[derive(Clone, Copy, Debug)]
pub struct Launch {
    /// The ranks of the job on this host when a launcher says so (mpirun); else every rank of
    /// the world is a thread of this process.
    pub ranks_on_host: Option<usize>,
    /// Whether this process reports (rank 0, or the only process).
    pub reports: bool,
}

/// In-process ranks copy through shared memory. The pre-flight check only compares bytes, so the
/// link only has to be valid for the planner; its predicted times are not reported.
const SHARED_MEMORY: Link = Link {
    bandwidth: 10e9,
    latency: 1e-6,
};

/// Plans the configured run and logs its size; refuses it, with the planner's explanation, when it
/// cannot fit.
/// `device_memory` is `--device-memory`'s text. Returns the line to print when the run fits and
/// this process reports.
pub fn check(
    device_memory: Option<&str>,
    settings: &Settings,
    (engine, spec, shape): (&EngineConfig, &ModelSpec, &GptShape),
    process: TrainProcess,
    launch: Launch,
) -> Result<Option<String>, PreflightError> {
    let (host, limit) = host_memory()?;
    // The ranks that share this machine's memory: all of them in-process; under MPI the job's
    // processes on this host.
    let (on_host, share) = match launch.ranks_on_host {
        Some(n) => (n, "/ the ranks on this host"),
        None => (engine.world_size, "/ --world-size"),
    };
    let share = format!("{limit} {share}");
    let (capacity, source) = match (device_memory, engine.device_budget) {
        (Some(s), _) => (parse_bytes(s, "--device-memory")?, "--device-memory"),
        (None, Some(b)) => (b, "zerodp.device_memory"),
        (None, None) => (host / on_host.max(1) as u64, share.as_str()),
    };
    let input = plan_input(settings, engine, spec, shape, capacity, host, process);
    let plan = planner::plan(&input)?;
    // The stages without offload, as the planner sizes them; the configured offload is then
    // applied with the engine's own tier rules (`offload_tiers`).
    let stages: Vec<PlanOption> = plan
        .options
        .into_iter()
        .filter(|o| o.offload_optimizer == Offload::None && o.offload_param == Offload::None)
        .collect();
    let configured = stages
        .iter()
        .find(|o| o.stage == engine.stage.index())
        .cloned()
        .ok_or_else(|| {
            PreflightError::DoesNotFit("the planner has no option for the configured stage".into())
        })?;
    let budget = device_memory.is_some() || engine.device_budget.is_some();
    let configured = offload_tiers(configured, engine, spec, budget, capacity);
    // Under mpirun, rank 0 alone says it.
    if configured.fits_device && !launch.reports {
        return Ok(None);
    }
    if configured.fits_device {
        return Ok(Some(format!(
            "pre-flight: ZeRO {} needs {} per rank of the {} each rank may use ({source}): {}; {}",
            configured.label,
            size(configured.bytes_per_device.total),
            capacity_text(capacity),
            by_kind(&configured),
            estimate_remark(&configured)
        )));
    }
    let mut text = refusal(&input, &stages, &configured, source);
    if let Some(e) = device_tier_refusal(engine, spec, capacity) {
        text.push_str(&format!(
            "\n  the engine's device tier alone does not fit either: {e}"
        ));
    }
    Err(PreflightError::DoesNotFit(text))
}

/// The engine's own refusal of its device-tier bytes (model states and buffers, without the
/// process's activations) under `capacity`, for the first rank that cannot hold them.
fn device_tier_refusal(engine: &EngineConfig, spec: &ModelSpec, capacity: u64) -> Option<String> {
    let cfg = EngineConfig {
        device_budget: Some(capacity),
        ..engine.clone()
    };
    (0..cfg.world_size).find_map(|rank| {
        crate::zero::check_device_budget(spec, &cfg, rank)
            .err()
            .map(|e| e.to_string())
    })
}

/// `o` (the configured stage without offload) with the bytes the engine's offload takes out of
/// what is compared with the capacity. NVMe offload moves Adam's m and v (and at stage 3 the
/// parameter shards) into swap files and adds the buffers they stream through. Host offload (the
/// master, m and v; at stage 3 the parameter shards) leaves the device tier, which matters against
/// a `--device-memory` budget; without one, the capacity is this machine's memory, which the host
/// tier shares, so those bytes still count.
fn offload_tiers(
    mut o: PlanOption,
    engine: &EngineConfig,
    spec: &ModelSpec,
    device_budget: bool,
    capacity: u64,
) -> PlanOption {
    let b = &mut o.bytes_per_device;
    let before = b.master + b.adam_m + b.adam_v + b.params + b.scratch_buffers;
    let mut label = Vec::new();
    // A partial offload (offload_optimizer.ratio) moves only its units' share.
    let share = crate::zero::offloaded_share(spec, engine, 0);
    let moved = |bytes: &mut u64| {
        let off = (*bytes as f64 * share).round() as u64;
        *bytes -= off.min(*bytes);
    };
    match &engine.offload_optimizer {
        OptimizerTier::Device => {}
        OptimizerTier::Host => {
            label.push("+opt cpu");
            if device_budget {
                [&mut b.master, &mut b.adam_m, &mut b.adam_v]
                    .into_iter()
                    .for_each(moved);
            }
        }
        OptimizerTier::Nvme { .. } => {
            label.push("+opt nvme");
            b.scratch_buffers += crate::zero::moment_stream_bytes(spec, engine);
            [&mut b.adam_m, &mut b.adam_v].into_iter().for_each(moved);
            if device_budget {
                moved(&mut b.master);
            }
        }
    }
    if share > 0.0 && share < 1.0 {
        label.push("(partial)");
    }
    match (&engine.offload_param, engine.stage.shards_params()) {
        (ParamTier::Host, true) => {
            label.push("+param cpu");
            if device_budget {
                b.params = 0;
            }
        }
        (ParamTier::Nvme { .. }, true) => {
            label.push("+param nvme");
            // The shards max_in_cpu keeps in memory are in the host tier, which shares this
            // machine's memory unless a device budget is what is compared.
            b.params = match device_budget {
                true => 0,
                false => crate::zero::resident_param_bytes(spec, engine),
            };
            b.scratch_buffers += crate::zero::param_staging_bytes(spec, engine);
        }
        _ => {}
    }
    let after = b.master + b.adam_m + b.adam_v + b.params + b.scratch_buffers;
    b.total = b.total + after - before;
    b.model_states = b.params + b.grads + b.master + b.adam_m + b.adam_v;
    o.fits_device = b.total <= capacity;
    if !label.is_empty() {
        o.label = format!("{} {}", o.label, label.join(" "));
    }
    o
}

/// The planner's input for this run: the engine's own model and settings on one node of `world`
/// ranks with `capacity` bytes each.
pub(crate) fn plan_input(
    settings: &Settings,
    engine: &EngineConfig,
    spec: &ModelSpec,
    shape: &GptShape,
    capacity: u64,
    host: u64,
    process: TrainProcess,
) -> PlanInput {
    let keys = ConfigKeys::from_settings(settings);
    PlanInput {
        model: ModelSize::from_model_spec(spec, Some(*shape)),
        cluster: Cluster {
            nodes: 1,
            devices_per_node: engine.world_size as u64,
            device_memory: capacity,
            host_memory: host,
            intra: SHARED_MEMORY,
            inter: SHARED_MEMORY,
            host: HostLinks::default(),
            device_flops: 1e11,
        },
        precision: keys.precision,
        micro_batch: engine.micro_batch as u64,
        seq_len: shape.context,
        grad_accum: engine.grad_accum as u64,
        activation_checkpointing: engine.activation_checkpointing,
        configured: Some(keys.choice()),
        buffers: keys.buffers,
        dtypes: keys.dtypes,
        process: Some(process),
    }
}

/// Which part of the total is an estimate rather than the engine's exact count.
fn estimate_remark(o: &PlanOption) -> String {
    let b = &o.bytes_per_device;
    format!(
        "includes an estimate of {} for activations, candle's weight copies and process overhead \
         (planned high; the rest is the engine's exact count)",
        size(b.activations + b.param_copies + b.overhead)
    )
}

/// Why the run is refused, in the planner's words.
fn refusal(
    input: &PlanInput,
    stages: &[PlanOption],
    configured: &PlanOption,
    source: &str,
) -> String {
    let capacity = input.cluster.device_memory;
    let b = &configured.bytes_per_device;
    let mut out = format!(
        "pre-flight check: ZeRO {} needs {} per rank, more than the {} each rank may use ({source}); \
         over by {}\n",
        configured.label,
        size(b.total),
        capacity_text(capacity),
        size(b.total - capacity)
    );
    out.push_str(&format!("  {}\n", by_kind(configured)));
    out.push_str(&format!("  {}\n", estimate_remark(configured)));
    match stages
        .iter()
        .filter(|o| o.fits_device)
        .min_by_key(|o| o.stage)
    {
        Some(o) => out.push_str(&format!(
            "  the lowest stage that fits: {} ({} per rank)\n",
            o.label,
            size(o.bytes_per_device.total)
        )),
        None => out.push_str("  no ZeRO stage fits this capacity\n"),
    }
    let rec = recommend(input, stages);
    // When a stage fits, the lines above say it all (the planner's timing remarks would be about a
    // made-up link); when none does, its reasons say how far off the run is.
    if rec.choice.is_none() {
        for r in &rec.reasons {
            out.push_str(&format!("  - {r}\n"));
        }
    }
    for a in &rec.config_advice {
        out.push_str(&format!("  config: {a}\n"));
    }
    out.push_str(
        "  give --device-memory SIZE if each rank may use more; `zerodp plan` shows the options in full",
    );
    out
}

fn capacity_text(bytes: u64) -> String {
    if bytes >= 100_000_000 {
        format_capacity(bytes)
    } else {
        size(bytes)
    }
}

/// `params 1.2 MB, grads ..., ... = total`, the kinds that are not zero.
fn by_kind(o: &PlanOption) -> String {
    let b = &o.bytes_per_device;
    let parts: Vec<String> = [
        ("params", b.params),
        ("grads", b.grads),
        ("fp32 master", b.master),
        ("Adam m+v", b.adam_m + b.adam_v),
        ("reduce buckets", b.reduce_buckets),
        ("scratch buffers", b.scratch_buffers),
        ("gather pool", b.gather_pool),
        ("persistent params", b.persistent_params),
        ("activations (estimate)", b.activations),
        ("candle weight copies (estimate)", b.param_copies),
        ("process overhead (estimate)", b.overhead),
    ]
    .iter()
    .filter(|(_, v)| *v > 0)
    .map(|(k, v)| format!("{k} {}", size(*v)))
    .collect();
    format!("{} = {}", parts.join(", "), size(b.total))
}

/// Decimal units fine enough for the small models `train` runs, to three or more significant
/// digits (the planner's [`format_gb`] stops at tenths of a GB).
fn size(bytes: u64) -> String {
    match bytes {
        b if b >= 10_000_000_000 => format_gb(b),
        b if b >= 1_000_000_000 => format!("{:.3} GB", b as f64 / 1e9),
        b if b >= 1_000_000 => format!("{:.2} MB", b as f64 / 1e6),
        b => format!("{:.1} KB", b as f64 / 1e3),
    }
}

/// The memory this process may use: this machine's total (`MemTotal` in /proc/meminfo), lowered
/// by a limit on the process, when one is set: its cgroup's `memory.max` (v2) or
/// `memory.limit_in_bytes` (v1), and its address-space limit (`RLIMIT_AS`). Returns the bytes and
/// where they come from.
fn host_memory() -> Result<(u64, &'static str), PreflightError> {
    let text = std::fs::read_to_string("/proc/meminfo").map_err(|e| {
        PreflightError::HostMemory(format!(
            "reading /proc/meminfo for the memory each rank may use: {e}; give --device-memory \
             SIZE instead"
        ))
    })?;
    let total = meminfo_total(&text).ok_or_else(|| {
        PreflightError::HostMemory(
            "/proc/meminfo has no MemTotal line in kB; give --device-memory SIZE instead".into(),
        )
    })?;
    let mut out = (total, "this machine's memory");
    if let Some(limit) = cgroup_limit().filter(|&l| l < out.0) {
        out = (limit, "this process's cgroup memory limit");
    }
    if let Some(limit) = address_space_limit().filter(|&l| l < out.0) {
        out = (limit, "this process's address-space limit (ulimit -v)");
    }
    Ok(out)
}

fn meminfo_total(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|kb| kb.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// The memory limit of this process's cgroup, v2 (`0::/path`) or v1 (`N:memory:/path`); None when
/// there is none or it cannot be read.
fn cgroup_limit() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    own.lines().find_map(|line| {
        let mut f = line.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        let file = match controllers {
            "" => format!("/sys/fs/cgroup{path}/memory.max"),
            c if c.split(',').any(|c| c == "memory") => {
                format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
            }
            _ => return None,
        };
        // "max" (v2) and v1's page-rounded i64::MAX both mean no limit.
        let v: u64 = std::fs::read_to_string(file).ok()?.trim().parse().ok()?;
        (v < 1 << 62).then_some(v)
    })
}

/// `RLIMIT_AS`, when it is finite.
fn address_space_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut r) } == 0;
    (ok && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
}

/// On a GPU (`--device cuda`): what the run keeps there at least, against the GPU's free memory at
/// the start, for each of the `ranks` ranks computing there (each with its model). With the device
/// tier there ([`device_tier::refusal`]: stages 0-2, or one rank, without offload) the
/// parameters, the gradients, and the fp32 master and Adam's moments (of the rank's shard at
/// stages 1-2). Otherwise at stages 0-2 every unit's parameters stay on the GPU between steps in
/// the compute dtype; at stage 3 each rank's largest
/// unit's parameters and gradients are there while it runs. Beside them each rank's activations
/// of one micro-step and the graph's copies of the weights, sized as the planner sizes the GPT's
/// on the fused CPU kernels in the compute dtype (with the engine's recomputation): a lower bound,
/// since the composite ops a GPU runs keep more. A run whose
/// lower bound does not fit is refused before any work, naming what to change; otherwise the
/// estimate is logged.
pub fn check_gpu(
    gpu: &crate::device::GpuInfo,
    (dtype_bytes, ranks): (u64, u64),
    engine: &EngineConfig,
    spec: &ModelSpec,
    shape: &GptShape,
) -> Result<String, PreflightError> {
    let (params, activations) = gpu_need((dtype_bytes, ranks), engine, spec, shape);
    let need = params + activations;
    let kept = match (device_tier::refusal(engine), engine.stage.shards_params()) {
        (None, _) if engine.world_size > 1 && engine.stage != crate::zero::Stage::Zero0 => {
            "the parameters and gradients, and each rank's shard of the fp32 master and Adam's \
             moments, kept there"
        }
        (None, _) => "the parameters, fp32 master, gradients and Adam's moments, kept there",
        (Some(_), false) => "the parameters, kept there at stages 0-2",
        (Some(_), true) => "the largest unit's parameters and gradients",
    };
    let summary = format!(
        "cuda:{} ({}): at least {} ({} {kept}, {} activations and weight copies of one \
         micro-step) of {} free",
        gpu.ordinal,
        gpu.name,
        format_gb(need),
        format_gb(params),
        format_gb(activations),
        format_gb(gpu.free_bytes)
    );
    if need > gpu.free_bytes {
        let fix = match device_tier::refusal(engine) {
            None => {
                "Set offload_optimizer to cpu (the fp32 master and Adam's moments then live in \
                 host memory, and at ZeRO stage 3 the parameters are copied to the GPU unit by \
                 unit), lower train_micro_batch_size_per_gpu, turn on activation checkpointing, \
                 or train in bf16"
            }
            Some(_) => {
                "Lower train_micro_batch_size_per_gpu, turn on activation checkpointing, train in \
                 bf16, or use ZeRO stage 3 (the parameters are then copied to the GPU unit by \
                 unit, not kept there)"
            }
        };
        return Err(PreflightError::DoesNotFit(format!(
            "the run does not fit on the GPU: {summary}. {fix}"
        )));
    }
    Ok(summary)
}

/// [`check_gpu`]'s lower bound in bytes for `ranks` ranks, each with its model, on the GPU:
/// (parameters and gradients kept on the GPU, activations and weight copies of one micro-step).
fn gpu_need(
    (dtype_bytes, ranks): (u64, u64),
    engine: &EngineConfig,
    spec: &ModelSpec,
    shape: &GptShape,
) -> (u64, u64) {
    let stage3 = engine.stage.shards_params();
    let ranks = ranks.max(1);
    let numel = spec.num_params() as u64;
    let per_rank = match (device_tier::refusal(engine), stage3) {
        (None, _) => device_tier::TierDtypes::rank_bytes(engine, spec, dtype_bytes),
        (Some(_), false) => numel * dtype_bytes,
        (Some(_), true) => 2 * spec.largest_unit() as u64 * dtype_bytes,
    };
    let params = ranks * per_rank;
    let units = spec.units.len();
    let recompute: Vec<bool> = (0..units)
        .map(|u| u + 1 < units && (stage3 || engine.activation_checkpointing))
        .collect();
    let step = planner::gpt_step_memory(
        shape,
        engine.micro_batch as u64,
        shape.context,
        &recompute,
        &[],
        0,
    );
    let step_bytes = (step.activations + step.param_copies) / 4 * dtype_bytes;
    (params, ranks * step_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{self, ResolveContext};
    use crate::model::{GptConfig, GptModel};
    use crate::planner::planned_engine_config;
    use crate::zero::buffers;
    use crate::zero::unit::UnitModel;

    /// `train`'s mapping of a config onto the engine and the planner's own agree on every buffer.
    #[test]
    fn the_planner_sizes_the_engine_train_builds() {
        let gpt = GptConfig::tiny();
        let model = GptModel::new(gpt.clone()).unwrap();
        let configs = [
            r#"{"train_batch_size": 8, "zero_optimization": {"stage": 0}}"#,
            r#"{"train_batch_size": 8, "gradient_accumulation_steps": 2,
                "zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}}"#,
            r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "overlap_comm": true,
                "reduce_bucket_size": 5e3}}"#,
            r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3,
                "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 100,
                "stage3_max_reuse_distance": 0}}"#,
            r#"{"train_batch_size": 8, "activation_checkpointing": {"number_checkpoints": 1},
                "zero_optimization": {"stage": 3}}"#,
            r#"{"train_batch_size": 8, "bf16": {"enabled": true},
                "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e3}}"#,
            r#"{"train_batch_size": 8, "fp16": {"enabled": true},
                "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0}}"#,
            r#"{"train_batch_size": 8, "bf16": {"enabled": true},
                "data_types": {"grad_accum_dtype": "bf16"}, "zero_optimization": {"stage": 1}}"#,
        ];
        for text in configs {
            let ctx = ResolveContext {
                world_size: 2,
                world_size_source: "test".into(),
                hidden_size: Some(gpt.width),
                ..Default::default()
            };
            let settings = config::load_str(text, "ds.json", &ctx).unwrap().settings;
            let engine = crate::setup::engine_config(&settings, 2, 0).unwrap();
            let input = plan_input(
                &settings,
                &engine,
                model.spec(),
                &gpt.shape(),
                1 << 30,
                1 << 34,
                TrainProcess::default(),
            );
            let planned = planned_engine_config(&input, engine.stage.index());
            assert_eq!(
                buffers::plan(model.spec(), &planned),
                buffers::plan(model.spec(), &engine),
                "{text}"
            );
            assert_eq!(
                (
                    planned.grad_accum,
                    planned.micro_batch,
                    planned.activation_checkpointing
                ),
                (
                    engine.grad_accum,
                    engine.micro_batch,
                    engine.activation_checkpointing
                ),
                "{text}"
            );
        }
    }

    #[test]
    fn host_memory_is_read_from_proc_meminfo() {
        assert_eq!(
            meminfo_total("MemTotal:       24576000 kB\nMemFree: 1 kB\n"),
            Some(24576000 * 1024)
        );
        assert_eq!(meminfo_total("MemFree: 1 kB\n"), None);
        if std::path::Path::new("/proc/meminfo").exists() {
            assert!(host_memory().unwrap().0 > 1 << 20);
        }
    }

    /// On a GPU what is kept there (the device tier, or the parameters under offload) and one
    /// micro-step's activations must fit its free memory: a GPU of 1 MB refuses the tiny GPT
    /// saying what to change, one of 80 GB takes it.
    #[test]
    fn a_run_that_cannot_fit_the_gpu_is_refused_before_any_work() {
        let gpt = GptConfig::tiny();
        let model = GptModel::new(gpt.clone()).unwrap();
        let mut engine = EngineConfig::new(crate::zero::Stage::Zero2, 1);
        engine.micro_batch = 8;
        let gpu = |free: u64| crate::device::GpuInfo {
            ordinal: 0,
            name: "test GPU".into(),
            compute_capability: (9, 0),
            free_bytes: free,
            total_bytes: free,
        };
        // One rank without offload: the device tier is on the GPU, 16 bytes a parameter in fp32.
        let spec = model.spec();
        let fits = check_gpu(&gpu(80_000_000_000), (4, 1), &engine, spec, &gpt.shape()).unwrap();
        assert!(fits.contains("Adam's moments, kept there"), "{fits}");
        let err = check_gpu(&gpu(1_000_000), (4, 1), &engine, spec, &gpt.shape()).unwrap_err();
        assert!(
            err.to_string().contains("offload_optimizer to cpu"),
            "{err}"
        );
        assert_eq!(
            gpu_need((4, 1), &engine, spec, &gpt.shape()).0,
            16 * spec.num_params() as u64
        );
        // Stage 0 on two ranks on one GPU: a device tier each.
        let two = EngineConfig {
            world_size: 2,
            stage: crate::zero::Stage::Zero0,
            ..engine.clone()
        };
        assert_eq!(
            gpu_need((4, 2), &two, spec, &gpt.shape()).0,
            2 * 16 * spec.num_params() as u64
        );
        // Stage 2 on two ranks: each keeps its parameters and gradients whole (8 bytes a
        // parameter in fp32) and about half of the master, the moments and the reduced gradient
        // (16): rank 0's shards, at most 8 elements of padding longer than half of each unit.
        let sharded = EngineConfig {
            stage: crate::zero::Stage::Zero2,
            ..two.clone()
        };
        let psi = spec.num_params() as u64;
        let per_rank = gpu_need((4, 2), &sharded, spec, &gpt.shape()).0 / 2;
        let half = 8 * psi + 16 * psi / 2;
        let slack = 16 * 8 * spec.units.len() as u64;
        assert!(
            (half..=half + slack).contains(&per_rank),
            "{per_rank} vs {half}"
        );
        let fits = check_gpu(&gpu(80_000_000_000), (4, 2), &sharded, spec, &gpt.shape()).unwrap();
        assert!(
            fits.contains("each rank's shard of the fp32 master"),
            "{fits}"
        );
        // With the optimizer offloaded only the parameters stay on the GPU.
        engine.offload_optimizer = OptimizerTier::Host;
        let fits = check_gpu(
            &gpu(80_000_000_000),
            (4, 1),
            &engine,
            model.spec(),
            &gpt.shape(),
        )
        .unwrap();
        assert!(fits.contains("kept there at stages 0-2"), "{fits}");
        let err = check_gpu(&gpu(1_000_000), (4, 1), &engine, model.spec(), &gpt.shape())
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not fit on the GPU"), "{err}");
        assert!(err.contains("ZeRO stage 3"), "{err}");
        // Stage 2 keeps every parameter (Ψ f32 values); stage 3 the largest unit's parameters
        // and gradients, and recomputes: less of both. bf16 halves them.
        // Two ranks on the GPU each keep their model's parameters and have their own step.
        let (params2, acts2) = gpu_need((4, 1), &engine, spec, &gpt.shape());
        assert_eq!(params2, 4 * spec.num_params() as u64);
        assert_eq!(
            gpu_need((2, 1), &engine, spec, &gpt.shape()),
            (params2 / 2, acts2 / 2)
        );
        assert_eq!(
            gpu_need((4, 2), &engine, spec, &gpt.shape()),
            (2 * params2, 2 * acts2)
        );
        engine.stage = crate::zero::Stage::Zero3;
        let (params3, acts3) = gpu_need((4, 1), &engine, spec, &gpt.shape());
        assert_eq!(params3, 8 * spec.largest_unit() as u64);
        assert_eq!(
            gpu_need((4, 2), &engine, spec, &gpt.shape()),
            (2 * params3, 2 * acts3)
        );
        assert!(
            params3 < params2 && acts3 < acts2,
            "{params3} {acts3} vs {params2} {acts2}"
        );
    }

    /// On a GPU the activations and weight copies are the GPU's (checked by `check_gpu`), so
    /// the host pre-flight counts everything else exactly as on the CPU and those as zero.
    #[test]
    fn a_gpu_run_plans_its_activations_on_the_gpu_not_the_host() {
        let gpt = GptConfig::tiny();
        let model = GptModel::new(gpt.clone()).unwrap();
        let ctx = ResolveContext {
            world_size: 1,
            world_size_source: "test".into(),
            ..Default::default()
        };
        let text = r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2}}"#;
        let settings = config::load_str(text, "ds.json", &ctx).unwrap().settings;
        let engine = crate::setup::engine_config(&settings, 1, 0).unwrap();
        let bytes = |compute_on_gpu: bool| {
            let process = TrainProcess {
                compute_on_gpu,
                ..TrainProcess::default()
            };
            let input = plan_input(
                &settings,
                &engine,
                model.spec(),
                &gpt.shape(),
                1 << 30,
                1 << 34,
                process,
            );
            let plan = planner::plan(&input).unwrap();
            plan.options
                .into_iter()
                .find(|o| o.stage == 2 && o.offload_optimizer == Offload::None)
                .unwrap()
                .bytes_per_device
        };
        let (cpu, gpu) = (bytes(false), bytes(true));
        assert!(cpu.activations > 0 && cpu.param_copies > 0, "{cpu:?}");
        assert_eq!((gpu.activations, gpu.param_copies), (0, 0));
        assert_eq!(gpu.total, cpu.total - cpu.activations - cpu.param_copies);
    }
}
