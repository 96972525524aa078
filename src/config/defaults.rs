//! DeepSpeed's defaults, each written once. The config reader fills unset keys from here, and the
//! engine's own defaults ([`crate::zero::EngineConfig::new`]) and the planner's per-stage knobs
//! read the same constants, so a default cannot drift between them.

use super::Precision;

/// `zero_optimization.reduce_bucket_size` and `allgather_bucket_size`, in elements (5e8).
pub(crate) const REDUCE_BUCKET_SIZE: u64 = 500_000_000;
/// `stage3_prefetch_bucket_size` in elements: DeepSpeed's code default 5e7 (its docs say 5e8).
pub(crate) const PREFETCH_BUCKET_SIZE: u64 = 50_000_000;
/// `stage3_param_persistence_threshold` in elements (1e5).
pub(crate) const PARAM_PERSISTENCE_THRESHOLD: u64 = 100_000;
/// `stage3_max_live_parameters` in elements (1e9).
pub(crate) const MAX_LIVE_PARAMETERS: u64 = 1_000_000_000;
/// `stage3_max_reuse_distance` in elements (1e9).
pub(crate) const MAX_REUSE_DISTANCE: u64 = 1_000_000_000;
/// `sub_group_size` in elements (1e9).
pub(crate) const SUB_GROUP_SIZE: u64 = 1_000_000_000;

/// `overlap_comm` when the config leaves it unset: DeepSpeed's validator turns it on at stage 3
/// only (its docs say false).
pub fn overlap_comm(stage: u8) -> bool {
    stage == 3
}

/// `data_types.grad_accum_dtype` when unset: the training precision's dtype, except bf16 at stage
/// 0, which accumulates in fp32 (DeepSpeed's rule).
pub fn grad_accum_dtype(precision: Precision, stage: u8) -> Precision {
    match (precision, stage) {
        (Precision::Bf16, 0) => Precision::Fp32,
        (p, _) => p,
    }
}

/// `communication_data_type` when unset: the training precision's dtype.
pub fn communication_data_type(precision: Precision) -> Precision {
    precision
}
