//! The sizing rules of every buffer the engine allocates besides the model states, in one pure
//! function, so that the engine and the planner (`planner`) cannot disagree.
//!
//! * Reduction buckets: `min(reduce_bucket_size, Ψ)` elements (padded Ψ, rounded down to a multiple
//!   of the world size so that a bucket splits into equal rank regions) in the communication dtype;
//!   two when `overlap_comm` (one fills while the other is in flight), else one. The sharded
//!   collectives run in place in the bucket, so it needs no second buffer for the rank's shard: a
//!   bucket costs exactly its own bytes, which is also what DeepSpeed's `reduce_bucket_size` means.
//!   None at all where no collective needs one ([`reduction_plan`]): the gradient reduction
//!   where a unit's own buffer serves, and the stage 1-2 all-gather of parameters, run in place in
//!   each unit's own buffer, one collective per unit (FSDP2's way), with nothing to copy.
//!   `reduce_bucket_size` 0 asks for no bucket (DeepSpeed then reduces each gradient on its own):
//!   each unit's gradient is reduced on its own, in place where its dtypes allow at any unit size,
//!   else through a staging bucket of one unit where it must be converted to the communication
//!   dtype (bf16 and fp16 reductions of f32 gradients).
//! * Stage 3 with qgZ: each unit's gradient reduced on its own (no bucket), two units in flight
//!   with `overlap_comm`, each with a send and a receive buffer of int8 payloads.
//! * Stages 2-3 (and 0-1 with non-f32 gradients): transient full-unit f32 gradient buffers, each
//!   the size of the largest padded unit, as many as a backward holds at once (a tied unit's
//!   gradient waits for its last user), and at stages 2-3 reducing in place with `overlap_comm`
//!   `units_in_flight` more, in reduce-scatters still in flight.
//! * Mixed precision: one f32 scratch that a visit's 16-bit parameters are widened into for the
//!   model, the unit's and then those of the units it uses side by side, as large as the most any
//!   one visit reads. Stages 0-1 with 16-bit gradients
//!   also use the transient f32 gradient buffers (the model writes f32; they are added into the
//!   kept 16-bit gradients when complete).
//! * Stage 3: the gathered-parameter budget, `max(working set, min(max_live_parameters, Ψ))`
//!   elements in the parameter dtype, where the working set is the largest visit (a unit plus the
//!   units it uses) plus the persistent units. Units within `max_reuse_distance` keep their forward
//!   graph (and so a copy of their weights) until backward instead of being recomputed: the last
//!   units first, while their weights fit in the budget beside the working set. What is left is
//!   the gather pool, which bounds every fetch, prefetch or not.

use super::engine_config::{EngineConfig, Stage};
use super::layout::FlatLayout;
use super::schedule;
use crate::flat::DType;
use crate::zero::unit::ModelSpec;

/// The buffers a configuration allocates, in elements, with their dtypes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferPlan {
    /// Elements per reduction bucket (a multiple of the world size).
    pub bucket_elems: usize,
    /// Number of buckets (2 with `overlap_comm`; 0 where the reduction runs in place).
    pub bucket_count: usize,
    /// Whether the gradient reduction runs in place in each unit's kept gradient
    /// ([`reduction_plan`]) instead of through the buckets.
    pub reduce_in_place: bool,
    /// `reduce_bucket_size` 0: each unit's gradient is reduced on its own, one collective per
    /// unit (a bucket, where there is one, holds one unit and is launched at once).
    pub per_unit: bool,
    /// Stages 2-3 reducing in place: transient gradients in reduce-scatters in flight at most
    /// (`units_in_flight`; counted in `grad_scratch`).
    pub units_in_flight: usize,
    /// Dtype of the buckets.
    pub comm_dtype: DType,
    /// Elements of each transient full-unit gradient buffer (stages 2-3; 0-1 with 16-bit
    /// gradients), one entry per buffer ([`transient_grad_buffers`]).
    pub grad_scratch: Vec<usize>,
    /// For each unit, the entry of `grad_scratch` its gradient is written into (a buffer of that
    /// size; every unit's is the first where they are all alike).
    pub grad_buffer_of: Vec<usize>,
    /// Stage 3: elements of the gather pool (0 otherwise).
    pub gather_pool_elems: usize,
    /// Stage 3: units that keep their forward graph until backward (no second gather, no
    /// recompute); the last unit always does.
    pub keep_graph: Vec<bool>,
    /// Stage 3: elements of weights held by kept graphs at most (beside the pool).
    pub kept_graph_elems: usize,
    /// Stage 3 with qwZ (`zero_quantized_weights`): 16-bit elements of the int8 payloads the
    /// gathers travel in, at most (planned high: a shard's and the gathered payload for every
    /// unit the pool can hold).
    pub quantized_payload_elems: usize,
    /// Stage 3 with qgZ (`zero_quantized_gradients`): 16-bit elements of each buffer the
    /// gradients' int8 payloads travel in (a quantized shard per rank of the largest unit)...
    pub qgz_payload_elems: usize,
    /// ... and how many pairs of them (a send and a receive buffer per unit in flight).
    pub qgz_payload_pairs: usize,
    /// Stage 3 with hpZ (`zero_hpz_partition_size`): elements of this rank's secondary shards,
    /// its slice of every non-persistent unit over its host's ranks (0 where hpZ is off).
    pub secondary_elems: usize,
    /// Stage 3: which units stay gathered for the whole step.
    pub persistent: Vec<bool>,
    /// Dtype of the gathered parameters.
    pub param_dtype: DType,
    /// Mixed precision: elements of the f32 scratch a visit's 16-bit parameters are widened into
    /// before the model runs ([`param_scratch`]; 0 in fp32).
    pub param_scratch: usize,
}

impl BufferPlan {
    /// Bytes of the reduction buckets (the collectives run in place: nothing beside them); the
    /// rest of [`BufferPlan::buffer_bytes`] is scratch (full-unit gradient buffers).
    pub fn bucket_bytes(&self) -> u64 {
        let qgz = 2 * self.qgz_payload_pairs * self.qgz_payload_elems * 2;
        (self.bucket_count * self.bucket_elems * self.comm_dtype.size() + qgz) as u64
    }
    /// Bytes of the f32 scratch the model reads and writes: transient gradient buffers and, under
    /// mixed precision, the widened parameters.
    pub(crate) fn scratch_bytes(&self) -> u64 {
        ((self.grad_scratch.iter().sum::<usize>() + self.param_scratch) * 4) as u64
    }
    /// Bytes of the communication buckets and the scratch (the `buffers` kind).
    pub fn buffer_bytes(&self) -> u64 {
        self.bucket_bytes() + self.scratch_bytes()
    }
    /// Bytes of gathered parameters at the fullest, pool and kept graphs (the `gather` kind). The
    /// pool holds parameters as they travel (the parameter dtype); a kept graph holds the f32
    /// weights the model computed with.
    pub fn gather_bytes(&self) -> u64 {
        let pool = self.gather_pool_elems + self.secondary_elems;
        let payloads = self.quantized_payload_elems * 2;
        (pool * self.param_dtype.size() + self.kept_graph_elems * 4 + payloads) as u64
    }
}

/// Elements of weights each unit's kept stage-3 forward graph holds until its backward: the padded
/// units it reads, for units that keep their graph, but not the last unit, whose gathered
/// parameters simply stay for its backward; 0 for every unit below stage 3.
pub(crate) fn kept_graph_elems(
    spec: &ModelSpec,
    layout: &FlatLayout,
    plan: &BufferPlan,
) -> Vec<usize> {
    let n = spec.units.len();
    (0..n)
        .map(|u| match plan.keep_graph[u] && u + 1 != n {
            true => schedule::needs_of(spec, u)
                .into_iter()
                .map(|k| layout.units[k].padded)
                .sum(),
            false => 0,
        })
        .collect()
}

/// The dtypes a gradient reduction involves: where gradients are kept (accumulated) and what the
/// collective moves (`data_types.grad_accum_dtype`, `communication_data_type`, resolved).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReductionDtypes {
    pub grad_accum: DType,
    pub comm: DType,
}

/// How a stage reduces its gradients, and what that holds beside the model states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReductionPlan {
    /// In place in each unit's own gradient buffer (stages 0-1 with gradients kept in the
    /// communication dtype; stages 2-3 with f32 reductions and a bucket that holds the largest
    /// unit, or no bucket asked for), or through buckets.
    pub in_place: bool,
    /// No bucket asked for (`reduce_bucket_size` 0): one collective per unit.
    pub per_unit: bool,
    /// Elements of each bucket: as asked, or the largest unit where no bucket was asked for but
    /// the gradients must be converted on their way to the collective (a staging bucket of one
    /// unit).
    pub bucket_elems: usize,
    /// Buckets: 2 with `overlap_comm`, else 1; none in place.
    pub bucket_count: usize,
    /// Stages 2-3 in place: transient gradients in flight at most (`units_in_flight`).
    pub units_in_flight: usize,
}

/// The one rule for the engine and the planner: how a stage that shards gradients or not
/// (`shards_grads`) reduces them, for units of at most `largest` elements (`units` of them, when
/// known) and buckets of `bucket_elems` (0: no bucket asked for, each unit on its own).
pub fn reduction_plan(
    shards_grads: bool,
    dtypes: ReductionDtypes,
    largest: usize,
    bucket_elems: usize,
    units: Option<usize>,
    overlap: bool,
) -> ReductionPlan {
    let in_place = reduces_in_place(shards_grads, dtypes, largest, bucket_elems);
    let per_unit = bucket_elems == 0;
    ReductionPlan {
        in_place,
        per_unit,
        bucket_elems: match per_unit && !in_place {
            true => largest,
            false => bucket_elems,
        },
        bucket_count: match (in_place, overlap) {
            (true, _) => 0,
            (false, true) => 2,
            (false, false) => 1,
        },
        units_in_flight: match in_place && shards_grads {
            true => units_in_flight(overlap, largest, bucket_elems, units),
            false => 0,
        },
    }
}

/// Whether a stage's gradient reduction runs in place in each unit's own gradient buffer, one
/// collective per unit with no bucket:
/// - stages 0-1 (which keep full gradients until they are reduced) when they are kept in the
///   communication dtype: it costs nothing, the kept gradient is the buffer;
/// - stages 2-3 (which reduce the transient f32 gradients of every micro-step) when the
///   communication dtype is f32 and the largest unit is no larger than a bucket: each transient
///   buffer is held until its reduce-scatter is done, up to `units_in_flight` of them beside
///   those the backward holds, in place of the buckets, so never more memory; or when no bucket
///   is asked for (`bucket_elems` 0), at any unit size, as DeepSpeed then reduces each gradient
///   in its own tensor.
///
/// Other dtypes convert as they are copied into a bucket.
fn reduces_in_place(
    shards_grads: bool,
    dtypes: ReductionDtypes,
    largest_unit: usize,
    bucket_elems: usize,
) -> bool {
    match shards_grads {
        false => dtypes.grad_accum == dtypes.comm,
        true => dtypes.comm == DType::F32 && (bucket_elems == 0 || largest_unit <= bucket_elems),
    }
}

/// Stages 2-3 reducing in place with `overlap_comm`: the transient gradient buffers (of the
/// largest unit, `largest`) in flight at most, as many as the memory of the two buckets of
/// `bucket_elems` they replace holds, and no more than the `units` (when known). Waiting for one
/// mid-backward stalls the rank until every rank has reached that collective: two in flight ran
/// the small GPT's stages 2-3 no faster than copying into buckets, one per unit 1-3% faster.
/// Without overlap each is waited for at once (0). At least 2 where it applies, since the
/// largest unit fits a bucket. With no bucket asked for (`bucket_elems` 0) there is no bucket
/// memory to fill: one, whose reduce-scatter runs during the next unit's backward (FSDP2's
/// overlap), for the price of one more transient gradient.
fn units_in_flight(
    overlap: bool,
    largest: usize,
    bucket_elems: usize,
    units: Option<usize>,
) -> usize {
    match overlap {
        true => {
            let fit = match bucket_elems {
                0 => 1,
                b => (2 * b) / largest.max(1),
            };
            units.map_or(fit, |n| fit.min(n))
        }
        false => 0,
    }
}

/// Size every buffer for `spec` under `cfg`.
pub fn plan(spec: &ModelSpec, cfg: &EngineConfig) -> BufferPlan {
    let world = cfg.world_size.max(1);
    let layout = FlatLayout::new(spec, world, 0);
    let total = layout.padded_numel();
    // 0 asks for no bucket; any other size is rounded down to equal rank regions, at least 1.
    let asked = match cfg.reduce_bucket_size {
        0 => 0,
        b => (b.min(total) / world).max(1) * world,
    };
    let qgz = cfg.qgz_active();
    let mut reduction = reduction_plan(
        cfg.stage.shards_grads(),
        ReductionDtypes {
            grad_accum: cfg.grad_accum_dtype,
            // qgZ quantizes the f32 gradients itself.
            comm: if qgz { DType::F32 } else { cfg.comm_dtype },
        },
        layout.largest_padded(),
        // qgZ reduces each unit on its own, as DeepSpeed's qgZ each gradient.
        if qgz { 0 } else { asked },
        Some(spec.units.len()),
        cfg.overlap_comm,
    );
    if qgz && cfg.overlap_comm {
        // Two in flight, so a unit's second (inter-host) phase overlaps the next unit's backward.
        reduction.units_in_flight = 2.min(spec.units.len()).max(1);
    }
    let stage = cfg.stage;
    let (grad_scratch, grad_buffer_of) = match cfg.transient_grads() {
        true => transient_grad_buffers(spec, &layout, reduction.units_in_flight),
        false => (Vec::new(), Vec::new()),
    };
    let persistent: Vec<bool> = layout
        .units
        .iter()
        .map(|u| stage == Stage::Zero3 && u.numel <= cfg.param_persistence_threshold)
        .collect();
    let n = spec.units.len();
    let mut keep_graph = vec![false; n];
    let mut kept_graph_elems = 0;
    let gather_pool_elems = if stage == Stage::Zero3 && n > 0 {
        keep_graph[n - 1] = true;
        let padded = |k: usize| layout.units[k].padded;
        let persistent_elems: usize = (0..n).filter(|&k| persistent[k]).map(padded).sum();
        let largest_visit = (0..n)
            .map(|u| {
                schedule::needs_of(spec, u)
                    .into_iter()
                    .filter(|&k| !persistent[k])
                    .map(padded)
                    .sum::<usize>()
            })
            .max()
            .unwrap_or(0);
        // The most that can be live at once is every unit's kept graph plus the visit being
        // gathered: capping the budget there (rather than at Ψ) lets a model that fits under
        // `max_live_parameters` keep every graph, as DeepSpeed keeps such a model gathered,
        // instead of releasing and recomputing its first units for want of one visit's room.
        let most_live = total + largest_visit;
        let budget = (persistent_elems + largest_visit).max(cfg.max_live_parameters.min(most_live));
        let mut room = budget - persistent_elems - largest_visit;
        if !cfg.activation_checkpointing {
            // Units closest to the end first: their reuse distance is the shortest.
            for u in (0..n - 1).rev() {
                let distance: usize = (u + 1..n).map(padded).sum();
                let cost: usize = schedule::needs_of(spec, u).into_iter().map(padded).sum();
                if distance > cfg.max_reuse_distance || cost > room {
                    break;
                }
                keep_graph[u] = true;
                kept_graph_elems += cost;
                room -= cost;
            }
        }
        // The pool never needs more than the whole model, whatever the budget.
        (budget - kept_graph_elems).min(total)
    } else {
        0
    };
    let h = cfg.hpz_partition_size;
    let secondary_elems = match cfg.hpz_active() {
        true => (0..n)
            .filter(|&u| !persistent[u])
            .map(|u| layout.units[u].padded / h)
            .sum(),
        false => 0,
    };
    let quantized_payload_elems = match cfg.qwz_active() {
        true => {
            let shard = gather_pool_elems / cfg.world_size;
            crate::zero::quantize::payload_elems(gather_pool_elems)
                + crate::zero::quantize::payload_elems(shard)
        }
        false => 0,
    };
    let (qgz_payload_elems, qgz_payload_pairs) = match qgz {
        true => (
            super::qgz::payload_elems(layout.largest_padded(), world),
            reduction.units_in_flight.max(1),
        ),
        false => (0, 0),
    };
    BufferPlan {
        qgz_payload_elems,
        qgz_payload_pairs,
        bucket_elems: reduction.bucket_elems,
        bucket_count: reduction.bucket_count,
        reduce_in_place: reduction.in_place,
        per_unit: reduction.per_unit,
        units_in_flight: reduction.units_in_flight,
        comm_dtype: cfg.comm_dtype,
        grad_scratch,
        grad_buffer_of,
        gather_pool_elems,
        keep_graph,
        kept_graph_elems,
        quantized_payload_elems,
        secondary_elems,
        persistent,
        param_dtype: cfg.param_dtype,
        param_scratch: match cfg.is_mixed() {
            true => param_scratch(spec, &layout),
            false => 0,
        },
    }
}

/// The transient f32 gradient buffers, by elements, and the one each unit's gradient uses. Where
/// every gradient is given back before the next is taken (no reduce-scatter left in flight), each
/// buffer as large as the gradients that reuse it need ([`schedule::grad_buffers`]): a model with
/// a large tied embedding holds one buffer of its size and one of a block's. Reductions in flight
/// give their buffers back in the order the collectives finish, so there every buffer is the
/// largest unit's, as many as the backward holds at once plus those in flight.
fn transient_grad_buffers(
    spec: &ModelSpec,
    layout: &FlatLayout,
    in_flight: usize,
) -> (Vec<usize>, Vec<usize>) {
    match in_flight {
        0 => {
            let padded: Vec<usize> = layout.units.iter().map(|u| u.padded).collect();
            schedule::grad_buffers(spec, &padded)
        }
        n => (
            vec![layout.largest_padded(); schedule::max_grads_held(spec) + n],
            vec![0; spec.units.len()],
        ),
    }
}

/// Mixed precision: the f32 scratch 16-bit parameters are widened into for the model, the most
/// elements any one visit reads (the unit and the units it uses, side by side). One scratch carved
/// per visit rather than one per place in a visit's reads, each as large as the largest unit read
/// there: a tied head reads the token embedding second, and the embedding's own visit reads it
/// first, so per-place scratch held two embeddings where one visit never needs more than one.
fn param_scratch(spec: &ModelSpec, layout: &FlatLayout) -> usize {
    (0..spec.units.len())
        .map(|u| {
            schedule::needs_of(spec, u)
                .into_iter()
                .map(|k| layout.units[k].numel)
                .sum::<usize>()
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ModelSpec {
        let unit = crate::zero::unit::test_unit;
        ModelSpec {
            units: vec![
                unit(0, 64, vec![]),
                unit(1, 128, vec![]),
                unit(2, 8, vec![0]),
            ],
        }
    }

    #[test]
    fn widened_parameters_get_one_scratch_as_large_as_the_largest_visit_reads() {
        let mut cfg = EngineConfig::new(Stage::Zero1, 2);
        assert_eq!(plan(&spec(), &cfg).param_scratch, 0, "fp32 reads its own");
        cfg.param_dtype = DType::BF16;
        let p = plan(&spec(), &cfg);
        // Visits read 64, 128 and 8 + 64 elements: the largest, unit 1, sizes it.
        assert_eq!(p.param_scratch, 128);
        assert_eq!(p.scratch_bytes(), 128 * 4);
        // A tied head as large as the unit it reads: its visit (8 + 120) is the largest.
        let mut tied = spec();
        tied.units[0].params[0].shape = vec![120];
        assert_eq!(plan(&tied, &cfg).param_scratch, 128);
        tied.units[2].params[0].shape = vec![16];
        assert_eq!(plan(&tied, &cfg).param_scratch, 136);
    }

    #[test]
    fn buckets_are_capped_by_the_model_and_doubled_by_overlap() {
        // bf16 reductions: stage 2 goes through the buckets whatever their size.
        let mut cfg = EngineConfig::new(Stage::Zero2, 2);
        cfg.comm_dtype = DType::BF16;
        let p = plan(&spec(), &cfg);
        assert_eq!(p.bucket_elems, 64 + 128 + 16);
        assert_eq!(p.bucket_count, 2);
        assert_eq!(p.bucket_bytes(), 2 * 208 * 2);
        // Backward from the last unit: unit 2's (16) and unit 0's (64, held until its own
        // backward), then unit 1's (128) in unit 2's, grown to hold it.
        assert_eq!(p.grad_scratch, vec![128, 64]);
        assert_eq!(p.grad_buffer_of, vec![1, 0, 0]);
        // f32 reductions with a bucket smaller than the largest unit (128) too.
        cfg.comm_dtype = DType::F32;
        cfg.overlap_comm = false;
        cfg.reduce_bucket_size = 33;
        let p = plan(&spec(), &cfg);
        assert!(!p.reduce_in_place);
        assert_eq!((p.bucket_elems, p.bucket_count), (32, 1));
        // The bucket alone (its collectives run in place) and the gradient buffers.
        assert_eq!(p.bucket_bytes(), 32 * 4);
        assert_eq!(p.buffer_bytes(), (32 + 128 + 64) * 4);
    }

    #[test]
    fn reductions_run_in_place_where_the_units_own_buffers_serve() {
        for stage in [Stage::Zero0, Stage::Zero1] {
            let mut cfg = EngineConfig::new(stage, 2);
            let p = plan(&spec(), &cfg);
            assert!(p.reduce_in_place, "{stage:?}");
            assert_eq!((p.bucket_count, p.bucket_bytes()), (0, 0), "{stage:?}");
            assert_eq!(p.scratch_bytes(), 0, "{stage:?}");
            // bf16 reductions of f32-kept gradients convert as they are copied into buckets.
            cfg.comm_dtype = DType::BF16;
            let p = plan(&spec(), &cfg);
            assert!(!p.reduce_in_place, "{stage:?}");
            assert_eq!(p.bucket_bytes(), 2 * 208 * 2, "{stage:?}");
        }
        // Stages 2-3 with f32 reductions and a bucket that holds the largest unit: the two
        // buckets (of 208) become transient gradients (of the largest unit, 128) in flight, as
        // many as their memory holds (3), and no more than the units (3).
        for stage in [Stage::Zero2, Stage::Zero3] {
            let mut cfg = EngineConfig::new(stage, 2);
            let p = plan(&spec(), &cfg);
            assert!(p.reduce_in_place, "{stage:?}");
            assert_eq!(p.bucket_count, 0, "{stage:?}");
            assert_eq!(p.grad_scratch, vec![128; 2 + 3]);
            assert_eq!(p.units_in_flight, 3);
            // Without overlap each is waited for at once: nothing more is held.
            cfg.overlap_comm = false;
            let p = plan(&spec(), &cfg);
            assert_eq!((p.bucket_count, &p.grad_scratch[..]), (0, &[128, 64][..]));
            // A bucket smaller than the largest unit keeps the buckets (and their bound).
            cfg.reduce_bucket_size = 100;
            assert!(!plan(&spec(), &cfg).reduce_in_place, "{stage:?}");
        }
    }

    #[test]
    fn bucket_size_zero_reduces_each_unit_on_its_own() {
        for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            // f32 reductions: in place at every stage, whatever the unit sizes, no bucket.
            let mut cfg = EngineConfig::new(stage, 2);
            cfg.reduce_bucket_size = 0;
            let p = plan(&spec(), &cfg);
            assert!(p.per_unit && p.reduce_in_place, "{stage:?}");
            assert_eq!((p.bucket_count, p.bucket_bytes()), (0, 0), "{stage:?}");
            if stage.shards_grads() {
                // With overlap one reduce-scatter in flight beside the backward's two gradients.
                assert_eq!(
                    (p.units_in_flight, p.grad_scratch.len()),
                    (1, 3),
                    "{stage:?}"
                );
                cfg.overlap_comm = false;
                assert_eq!(plan(&spec(), &cfg).grad_scratch.len(), 2, "{stage:?}");
            }
            // bf16 reductions of f32 gradients convert through a staging bucket of one unit.
            cfg.comm_dtype = DType::BF16;
            cfg.overlap_comm = true;
            let p = plan(&spec(), &cfg);
            assert!(p.per_unit && !p.reduce_in_place, "{stage:?}");
            assert_eq!((p.bucket_elems, p.bucket_count), (128, 2), "{stage:?}");
            assert_eq!(p.bucket_bytes(), 2 * 128 * 2, "{stage:?}");
        }
    }

    #[test]
    fn units_in_flight_fill_the_memory_of_the_buckets_they_replace() {
        // Two buckets of 1000 hold 20 gradients of 100, capped by the units when known.
        assert_eq!(units_in_flight(true, 100, 1000, None), 20);
        assert_eq!(units_in_flight(true, 100, 1000, Some(4)), 4);
        assert_eq!(units_in_flight(true, 1000, 1000, None), 2);
        // Without overlap each is waited for at once.
        assert_eq!(units_in_flight(false, 100, 1000, Some(4)), 0);
        // No bucket asked for: one in flight during the next unit's backward.
        assert_eq!(units_in_flight(true, 100, 0, Some(4)), 1);
        assert_eq!(units_in_flight(true, 100, 0, Some(0)), 0);
    }

    #[test]
    fn gather_pool_holds_at_least_the_largest_visit() {
        let mut cfg = EngineConfig::new(Stage::Zero3, 2);
        cfg.param_persistence_threshold = 0;
        cfg.max_live_parameters = 10;
        cfg.max_reuse_distance = 0;
        let p = plan(&spec(), &cfg);
        // The head (16 padded) reads unit 0 (64): 80 < unit 1 (128).
        assert_eq!(p.gather_pool_elems, 128);
        cfg.param_persistence_threshold = 8;
        let p = plan(&spec(), &cfg);
        assert_eq!(p.persistent, vec![false, false, true]);
        assert_eq!(p.gather_pool_elems, 16 + 128);
        cfg.max_live_parameters = 1_000_000;
        assert_eq!(plan(&spec(), &cfg).gather_pool_elems, 208);
        assert_eq!(
            plan(&spec(), &EngineConfig::new(Stage::Zero2, 2)).gather_pool_elems,
            0
        );
    }
}
