//! The device tier's budget. Before [`super::Engine::new`] allocates anything, the rank's
//! device-tier bytes are laid out in the order the engine allocates them (each unit's parameters,
//! fp32 master, gradients and Adam moments, then the communication buffers, then the stage-3
//! gather pool at its limit, which the coordinator never exceeds) and compared with
//! [`EngineConfig::device_budget`]. The first allocation that would not fit is refused, naming the
//! unit, the bytes asked, the bytes free, what holds the rest, and the smallest config change
//! that would fit, found by sizing the other stages and offloads with the same rules.

use super::{updated_part, EngineError};
use crate::memory::accounting::{MemoryKind, MemoryLedger, ModelStateBytes, Tier};
use crate::zero::buffers::plan;
use crate::zero::engine_config::{EngineConfig, OptimizerTier, ParamTier, Stage};
use crate::zero::layout::FlatLayout;
use crate::zero::unit::ModelSpec;

/// A device-tier allocation the budget cannot hold: which, how much, what holds the rest, and the
/// config change that would fit.
#[derive(Debug, thiserror::Error)]
#[error(
    "the device memory budget of rank {rank} cannot hold {what}: {asked} bytes asked, {free} of \
     the {budget}-byte budget free; held: params {}, master {}, grads {}, optimizer_states {}, \
     buffers {}, gather {}; {advice}",
    held.params, held.master, held.grads, held.optimizer_states, held.buffers, held.gather
)]
pub struct OverDeviceBudget {
    pub rank: usize,
    pub what: String,
    pub asked: u64,
    pub free: u64,
    pub budget: u64,
    pub held: ModelStateBytes,
    pub advice: String,
}

/// Bytes of one unit's model states on this rank, by kind, and the tier each kind lives in.
struct UnitBytes {
    params: (Tier, u64),
    master: (Tier, u64),
    grads: u64,
    moments: (Tier, u64),
}

/// Each unit's model-state bytes on rank `layout.rank` under `cfg`.
fn unit_bytes(cfg: &EngineConfig, layout: &FlatLayout) -> Vec<UnitBytes> {
    let (pdt, gdt) = (
        cfg.param_dtype.size() as u64,
        cfg.grad_accum_dtype.size() as u64,
    );
    // The parameters' tier for the first `resident` units; the rest are in the swap file (NVMe
    // offload keeps the first units' shards in host memory under max_in_cpu).
    let (param_tier, resident) = match (&cfg.offload_param, cfg.stage.shards_params()) {
        (_, false) | (ParamTier::Device, true) => (Tier::Device, usize::MAX),
        (ParamTier::Host, true) => (Tier::Host, usize::MAX),
        (ParamTier::Nvme { max_in_cpu, .. }, true) => {
            (Tier::Host, super::param_residency(layout, *max_in_cpu))
        }
    };
    let n = layout.num_units();
    (0..n)
        .map(|u| {
            let (master_tier, moment_tier) = match cfg.unit_optimizer_tier(u, n) {
                OptimizerTier::Device => (Tier::Device, Tier::Device),
                OptimizerTier::Host => (Tier::Host, Tier::Host),
                OptimizerTier::Nvme { .. } => (Tier::Host, Tier::Nvme),
            };
            let ul = &layout.units[u];
            let elems = |sharded: bool| match sharded {
                true => ul.shard_len,
                false => ul.padded,
            } as u64;
            let updated = updated_part(layout, cfg.stage, u).len() as u64;
            UnitBytes {
                params: (
                    if u < resident { param_tier } else { Tier::Nvme },
                    elems(cfg.stage.shards_params()) * pdt,
                ),
                master: (master_tier, cfg.keeps_fp32_master() as u64 * updated * 4),
                grads: elems(cfg.stage.shards_grads()) * gdt,
                moments: (
                    moment_tier,
                    updated * 2 * cfg.optimizer_states_dtype.size() as u64,
                ),
            }
        })
        .collect()
}

/// One allocation in the engine's order: what it is for, its kind, tier and bytes.
pub(super) struct Allocation {
    pub what: String,
    pub kind: MemoryKind,
    pub tier: Tier,
    pub bytes: u64,
}

/// Every device- and host-tier allocation [`super::Engine`] makes for `cfg`, in its order; the
/// gather pool is at its limit. NVMe-tier bytes are the swap files' and are charged by the engine,
/// with the host buffers they stream through.
pub(super) fn allocations(spec: &ModelSpec, cfg: &EngineConfig, rank: usize) -> Vec<Allocation> {
    let layout = FlatLayout::new(spec, cfg.world_size, rank);
    let buffers = plan(spec, cfg);
    let mut out = Vec::new();
    for (u, b) in unit_bytes(cfg, &layout).into_iter().enumerate() {
        let name = &spec.units[u].name;
        for (kind, (tier, bytes)) in [
            (MemoryKind::Params, b.params),
            (MemoryKind::Master, b.master),
            (MemoryKind::Grads, (Tier::Device, b.grads)),
            (MemoryKind::OptimizerStates, b.moments),
        ] {
            if bytes > 0 && tier != Tier::Nvme {
                out.push(Allocation {
                    what: format!("unit {u} ({name})'s {}", kind.name()),
                    kind,
                    tier,
                    bytes,
                });
            }
        }
    }
    let largest = (0..layout.num_units())
        .max_by_key(|&u| layout.units[u].padded)
        .map_or(String::new(), |u| {
            format!(", largest unit {}", spec.units[u].name)
        });
    out.push(Allocation {
        what: "the communication buffers (buckets and scratch)".into(),
        kind: MemoryKind::Buffers,
        tier: Tier::Device,
        bytes: buffers.buffer_bytes(),
    });
    out.push(Allocation {
        what: format!("the stage-3 gather pool{largest}"),
        kind: MemoryKind::Gather,
        tier: Tier::Device,
        bytes: buffers.gather_bytes(),
    });
    out
}

/// The share of rank `rank`'s updated elements whose fp32 master and moments `cfg` offloads: 1
/// under a full offload, 0 without one, the units [`EngineConfig::offload_ratio`] covers under a
/// partial one (what a size estimate scales its optimizer bytes by).
pub fn offloaded_share(spec: &ModelSpec, cfg: &EngineConfig, rank: usize) -> f64 {
    let layout = FlatLayout::new(spec, cfg.world_size, rank);
    let n = layout.num_units();
    let (mut off, mut all) = (0usize, 0usize);
    for u in 0..n {
        let len = updated_part(&layout, cfg.stage, u).len();
        all += len;
        if cfg.optimizer_offloaded(u, n) {
            off += len;
        }
    }
    match all {
        0 => 0.0,
        _ => off as f64 / all as f64,
    }
}

/// Device-tier bytes at the fullest under `cfg` (what a budget must hold).
pub fn device_peak(spec: &ModelSpec, cfg: &EngineConfig, rank: usize) -> u64 {
    allocations(spec, cfg, rank)
        .iter()
        .filter(|a| a.tier == Tier::Device)
        .map(|a| a.bytes)
        .sum()
}

/// Refuses `cfg` on rank `rank` when its device-tier bytes exceed `cfg.device_budget`, before
/// anything is allocated ([`super::Engine::new`] calls it; a launcher may call it for every rank
/// before any starts).
pub fn check(spec: &ModelSpec, cfg: &EngineConfig, rank: usize) -> Result<(), EngineError> {
    let Some(budget) = cfg.device_budget else {
        return Ok(());
    };
    let mut ledger = MemoryLedger::with_budget(Some(budget));
    for a in allocations(spec, cfg, rank) {
        if let Err(over) = ledger.try_alloc_in(a.tier, a.kind, a.bytes) {
            return Err(EngineError::DeviceBudget(Box::new(OverDeviceBudget {
                rank,
                what: a.what,
                asked: over.asked,
                free: over.free,
                budget,
                held: over.held,
                advice: advice(spec, cfg, rank, budget),
            })));
        }
    }
    Ok(())
}

/// The smallest change to `cfg` whose device-tier peak fits `budget`: offloading the optimizer
/// first (it keeps the stage's traffic; not at stage 0, where configs ignore it), then a higher
/// stage, then stage 3 with offloads (a partial offload is offered in full first).
fn advice(spec: &ModelSpec, cfg: &EngineConfig, rank: usize, budget: u64) -> String {
    let offload_opt = |mut c: EngineConfig| {
        if c.offload_optimizer == OptimizerTier::Device {
            c.offload_optimizer = OptimizerTier::Host;
        }
        c.offload_ratio = 1.0;
        c
    };
    let at_stage = |s: Stage| EngineConfig {
        stage: s,
        ..cfg.clone()
    };
    // DeepSpeed (and the config mapping) ignore offload_optimizer at stage 0.
    let mut candidates = Vec::new();
    if cfg.stage != Stage::Zero0 {
        let text = match cfg.offload_optimizer {
            OptimizerTier::Device => "offload_optimizer.device \"cpu\"",
            _ => "offload_optimizer.ratio 1.0 (offload every unit's optimizer state)",
        };
        candidates.push((offload_opt(cfg.clone()), text));
    }
    for (s, text) in [
        (Stage::Zero1, "stage 1"),
        (Stage::Zero2, "stage 2"),
        (Stage::Zero3, "stage 3"),
    ] {
        if s > cfg.stage {
            candidates.push((at_stage(s), text));
        }
    }
    let three = offload_opt(at_stage(Stage::Zero3));
    candidates.push((
        three.clone(),
        "stage 3 with offload_optimizer.device \"cpu\"",
    ));
    let mut all = three;
    all.offload_param = ParamTier::Host;
    candidates.push((
        all,
        "stage 3 with offload_optimizer and offload_param device \"cpu\"",
    ));
    let fits = candidates
        .into_iter()
        .filter(|(c, _)| c != cfg)
        .map(|(c, text)| (device_peak(spec, &c, rank), text))
        .find(|(peak, _)| *peak <= budget);
    match fits {
        Some((peak, text)) => format!(
            "set zero_optimization {text} (it needs {peak} bytes of the device tier per rank), or \
             raise the budget"
        ),
        None => format!(
            "no stage or offload fits {budget} bytes per rank: raise the budget (--device-memory \
             or zerodp.device_memory), add ranks, or lower stage3_max_live_parameters and \
             reduce_bucket_size"
        ),
    }
}
