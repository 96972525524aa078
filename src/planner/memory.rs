//! Bytes per device and per node, by kind, for one stage and offload choice.

use super::model::{GptShape, ModelSize};
use crate::config::defaults;
use crate::zero::buffers;
pub use crate::zero::buffers::ReductionDtypes;

/// Training precision. Mixed precision keeps 16-bit params and grads plus an fp32 master copy;
/// fp32 training has no separate master (the params are the master).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    Bf16,
    Fp16,
    Fp32,
}

impl Precision {
    /// Bytes per element of the training copy of the params, of the grads, and of communication.
    pub(crate) fn param_bytes(self) -> u64 {
        match self {
            Precision::Bf16 | Precision::Fp16 => 2,
            Precision::Fp32 => 4,
        }
    }
    /// Bytes per element of the fp32 master copy (0 when the params are already fp32).
    pub(crate) fn master_bytes(self) -> u64 {
        match self {
            Precision::Bf16 | Precision::Fp16 => 4,
            Precision::Fp32 => 0,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
            Precision::Fp32 => "fp32",
        }
    }
}

/// Where offloaded state lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Offload {
    None,
    Cpu,
    Nvme,
}

impl Offload {
    pub fn name(self) -> &'static str {
        match self {
            Offload::None => "none",
            Offload::Cpu => "cpu",
            Offload::Nvme => "nvme",
        }
    }
}

/// One stage and offload choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ZeroChoice {
    pub stage: u8,
    pub offload_optimizer: Offload,
    /// Stage 3 only.
    pub offload_param: Offload,
}

impl ZeroChoice {
    pub const fn new(stage: u8, offload_optimizer: Offload, offload_param: Offload) -> Self {
        ZeroChoice {
            stage,
            offload_optimizer,
            offload_param,
        }
    }

    /// Short label: `stage 2`, `stage 3 +opt cpu +param nvme`.
    pub fn label(&self) -> String {
        let mut s = format!("stage {}", self.stage);
        if self.offload_optimizer != Offload::None {
            s.push_str(&format!(" +opt {}", self.offload_optimizer.name()));
        }
        if self.offload_param != Offload::None {
            s.push_str(&format!(" +param {}", self.offload_param.name()));
        }
        s
    }

    /// Every choice the planner compares, in table order. Optimizer offload exists from stage 1,
    /// NVMe optimizer offload and parameter offload at stage 3 only (DeepSpeed's ZeRO-Offload and
    /// ZeRO-Infinity), and params are offloaded only with the optimizer, never to a faster tier
    /// than it (as DeepSpeed's estimators assume).
    pub fn all() -> Vec<ZeroChoice> {
        use Offload::*;
        vec![
            ZeroChoice::new(0, None, None),
            ZeroChoice::new(1, None, None),
            ZeroChoice::new(1, Cpu, None),
            ZeroChoice::new(2, None, None),
            ZeroChoice::new(2, Cpu, None),
            ZeroChoice::new(3, None, None),
            ZeroChoice::new(3, Cpu, None),
            ZeroChoice::new(3, Cpu, Cpu),
            ZeroChoice::new(3, Nvme, None),
            ZeroChoice::new(3, Nvme, Cpu),
            ZeroChoice::new(3, Nvme, Nvme),
        ]
    }

    /// Preference order when several fit, from DeepSpeed's guidance (speed: 0 > 1 > 2 > 2+offload
    /// > 3 > 3+offload): the lowest rank that fits is recommended.
    pub fn preference_rank(&self) -> u32 {
        let offload = self.offload_optimizer as u32 * 3 + self.offload_param as u32;
        match self.stage {
            0..=2 if offload == 0 => self.stage as u32,
            0..=2 => 10 + self.stage as u32,
            _ => 20 + offload,
        }
    }
}

/// The knobs that size zerodp's engine buffers (DeepSpeed's names and defaults).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct BufferSettings {
    /// Elements per gradient-reduction bucket (`reduce_bucket_size`, default 5e8; 0: none, each
    /// unit's gradient reduced on its own).
    pub reduce_bucket_size: u64,
    /// Two buckets instead of one, so one reduces while the next fills (`overlap_comm`).
    pub overlap_comm: bool,
    /// Elements of parameters gathered at once at stage 3 (`stage3_max_live_parameters`, 1e9).
    pub max_live_parameters: u64,
    /// Units with at most this many elements stay gathered at stage 3
    /// (`stage3_param_persistence_threshold`, 1e5).
    pub param_persistence_threshold: u64,
    /// Stage 3: units this close to their backward keep their forward graph instead of being
    /// gathered again (`stage3_max_reuse_distance`, 1e9). Only zerodp's engine path uses it (its
    /// traffic); the estimates assume every unit is gathered again.
    pub max_reuse_distance: u64,
}

impl BufferSettings {
    /// DeepSpeed's defaults for `stage` (`overlap_comm` defaults to true only at stage 3).
    pub fn deepspeed_defaults(stage: u8) -> Self {
        BufferSettings {
            reduce_bucket_size: defaults::REDUCE_BUCKET_SIZE,
            overlap_comm: defaults::overlap_comm(stage),
            max_live_parameters: defaults::MAX_LIVE_PARAMETERS,
            param_persistence_threshold: defaults::PARAM_PERSISTENCE_THRESHOLD,
            max_reuse_distance: defaults::MAX_REUSE_DISTANCE,
        }
    }
}

/// The engine's communication and gather buffers, in bytes per device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct EngineBuffers {
    /// Reduction buckets (on zerodp's engine path too, exactly the buckets: their collectives run
    /// in place).
    pub reduce_buckets: u64,
    /// zerodp's engine path: transient full-unit scratch buffers (gradients at stages 2-3); 0 in
    /// the estimates.
    pub scratch_buffers: u64,
    /// Stage 3: the preallocated gather pool (bounds every fetch, prefetch included).
    pub gather_pool: u64,
    /// Stage 3: units at or under the persistence threshold, kept gathered.
    pub persistent_params: u64,
}

/// zerodp's engine buffer rules, in one place so that they can be reconciled with the engine:
/// - reduce bucket: min(reduce_bucket_size, Ψ) elements in the communication dtype (f32 for fp32
///   runs, the 16-bit type for mixed precision), two of them when `overlap_comm` is on; none when
///   the reduction runs in place in the units' own gradients (by
///   [`crate::zero::buffers::reduction_plan`]), which at stages 2-3 with `overlap_comm` holds
///   the plan's `units_in_flight` transient f32 gradients of the largest unit instead
///   (scratch; the estimates count no other); `reduce_bucket_size` 0 (each unit on its own)
///   holds none in place, else staging buckets of the largest unit;
/// - stage 3: a gather pool of max(largest unit, min(max_live_parameters, Ψ)) elements in the
///   parameter dtype, which bounds every fetch including prefetch;
/// - stage 3: every unit of at most `param_persistence_threshold` elements stays gathered (known only
///   when the unit sizes are; with a bare parameter count it is 0).
///
/// Padding of each unit to a multiple of the world size is ignored: at most world-1 elements per
/// unit, far below the planner's resolution.
pub fn engine_buffer_bytes(
    stage: u8,
    precision: Precision,
    model: &ModelSize,
    s: &BufferSettings,
    reduction: ReductionDtypes,
) -> EngineBuffers {
    let dtype = precision.param_bytes();
    let bucket_elems = s.reduce_bucket_size.min(model.params);
    let size = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
    let units = model.unit_numels.len();
    let r = buffers::reduction_plan(
        stage >= 2,
        reduction,
        size(model.largest_unit),
        size(bucket_elems),
        (units > 0).then_some(units),
        s.overlap_comm,
    );
    let mut out = EngineBuffers {
        reduce_buckets: r.bucket_elems as u64
            * reduction.comm.size() as u64
            * r.bucket_count as u64,
        scratch_buffers: r.units_in_flight as u64 * model.largest_unit * 4,
        ..EngineBuffers::default()
    };
    if stage == 3 {
        out.gather_pool = model
            .largest_unit
            .max(s.max_live_parameters.min(model.params))
            * dtype;
        out.persistent_params = persistent_elements(model, s) * dtype;
    }
    out
}

/// Elements of the units kept gathered at stage 3.
pub fn persistent_elements(model: &ModelSize, s: &BufferSettings) -> u64 {
    model
        .unit_numels
        .iter()
        .filter(|&&n| n <= s.param_persistence_threshold)
        .sum()
}

/// Activation memory per device for one micro-batch of a GPT shape, in the activation dtype: the
/// generic estimate for a framework that saves only what backward needs (`zerodp plan`). zerodp's own
/// GPT keeps more and computes in f32 whatever the precision; its pre-flight check uses
/// [`super::process::gpt_step_memory`] instead.
///
/// Per block, the tensors saved for backward (no dropout, attention probabilities materialised,
/// Korthikanti et al. 2022 without the dropout terms): ln_1 input, c_attn input, q, k, v, softmax
/// output (heads·s² per row), attention output, ln_2 input, c_fc input, c_fc output (4w), GELU
/// output (4w): b·s·(16w + heads·s) elements; a Llama's by [`block_row_elements`]. The head keeps ln_f's input and output and the logits
/// with their softmax: b·s·(2w + 2·vocab) (a framework that materialises them; zerodp's own head
/// holds one chunk of rows at a time, see [`super::TrainProcess`]). With activation checkpointing each block keeps only its
/// input (b·s·w) and one block at a time is recomputed in full during backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Activations {
    pub full: u64,
    pub checkpointed: u64,
}

pub fn activation_bytes(
    shape: &GptShape,
    micro_batch: u64,
    seq_len: u64,
    precision: Precision,
) -> Activations {
    // Saturating: a batch too large for u64 reads as u64::MAX bytes, which the planner refuses.
    let mul = super::saturating_product;
    let bs = mul(&[micro_batch, seq_len]);
    let dtype = precision.param_bytes();
    let per_row = block_row_elements(shape).saturating_add(mul(&[shape.heads, seq_len]));
    let block = mul(&[bs, per_row]);
    let head = mul(&[bs, 2, shape.width.saturating_add(shape.vocab)]);
    let kept_inputs = mul(&[shape.layers, bs, shape.width]);
    Activations {
        full: mul(&[shape.layers, block])
            .saturating_add(head)
            .saturating_mul(dtype),
        checkpointed: kept_inputs
            .saturating_add(block)
            .saturating_add(head)
            .saturating_mul(dtype),
    }
}

/// Elements a block saves for backward per row, attention probabilities aside: the GPT's 16w;
/// a Llama's 4 of its width (both norms' inputs and outputs), q, k and v, the attention output
/// (as wide as q), and 4 of its MLP's (gate, up, the activated gate and the product).
fn block_row_elements(shape: &GptShape) -> u64 {
    let c = shape.width;
    match &shape.llama {
        Some(l) => {
            let (q, kv) = l.qk(shape.heads);
            4 * c + 2 * q + 2 * kv + 4 * l.intermediate
        }
        None => 16 * c,
    }
}

/// Bytes per device by kind. `model_states` is the ZeRO paper's count: 16-bit params + grads +
/// optimizer states (fp32 master, m, v) held on the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeviceBytes {
    pub params: u64,
    pub grads: u64,
    pub master: u64,
    pub adam_m: u64,
    pub adam_v: u64,
    pub model_states: u64,
    pub reduce_buckets: u64,
    /// Transient full-unit scratch buffers (zerodp's engine: gradients at stages 2-3).
    pub scratch_buffers: u64,
    pub gather_pool: u64,
    pub persistent_params: u64,
    /// Activations: the generic estimate ([`activation_bytes`]) or, for zerodp's own GPT, what its
    /// candle graphs and backward hold at the fullest moment of a micro-step
    /// ([`super::process::gpt_step_memory`]).
    pub activations: u64,
    /// zerodp's GPT only: candle's f32 copies of the weights held by the graphs at that moment
    /// (those the engine's ledger does not already count).
    pub param_copies: u64,
    /// A `zerodp train` process only: this rank's share of what the process holds besides its
    /// ranks' model states, buffers and activations ([`super::process::TrainProcess`]).
    pub overhead: u64,
    pub total: u64,
}

/// Bytes off the device, by kind and tier: host memory and NVMe.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct OffBytes {
    /// fp32 param copy, Adam m and v in host memory (optimizer offload to cpu).
    pub host_optimizer_states: u64,
    /// fp32 gradient partition the host-side Adam reads (any optimizer offload).
    pub host_fp32_grads: u64,
    /// 16-bit parameter shard in host memory (param offload to cpu).
    pub host_params: u64,
    /// fp32 param copy, m and v on NVMe (optimizer offload to nvme).
    pub nvme_optimizer_states: u64,
    /// 16-bit parameter shard on NVMe (param offload to nvme).
    pub nvme_params: u64,
    pub host: u64,
    pub nvme: u64,
}

impl OffBytes {
    /// `host` and `nvme` recomputed from the kinds.
    pub(crate) fn retotal(&mut self) {
        self.host = self.host_optimizer_states + self.host_fp32_grads + self.host_params;
        self.nvme = self.nvme_optimizer_states + self.nvme_params;
    }

    /// Every kind times `k` (per device to per node), totals recomputed.
    pub fn times(&self, k: u64) -> OffBytes {
        OffBytes {
            host_optimizer_states: self.host_optimizer_states * k,
            host_fp32_grads: self.host_fp32_grads * k,
            host_params: self.host_params * k,
            nvme_optimizer_states: self.nvme_optimizer_states * k,
            nvme_params: self.nvme_params * k,
            host: self.host * k,
            nvme: self.nvme * k,
        }
    }
}

/// The paper's model states for one choice on `n` devices, plus where offloaded state goes.
/// Sharded kinds hold ⌈Ψ/n⌉ elements. Offloading the optimizer moves the fp32 master (in fp32 runs:
/// the fp32 copy the host updates), m and v off the device, plus an fp32 gradient partition on the
/// host for the host-side Adam; the device then keeps no gradient partition from stage 2 on (grads
/// stream out of the reduce buckets). Offloading params (stage 3) moves the 16-bit shard off it.
pub fn model_state_bytes(
    choice: ZeroChoice,
    precision: Precision,
    params: u64,
    n: u64,
) -> (DeviceBytes, OffBytes) {
    let shard = params.div_ceil(n.max(1));
    let p = precision.param_bytes();
    let (params_e, grads_e, opt_e) = match choice.stage {
        0 => (params, params, params),
        1 => (params, params, shard),
        2 => (params, shard, shard),
        _ => (shard, shard, shard),
    };
    let mut d = DeviceBytes {
        params: params_e * p,
        grads: grads_e * p,
        master: opt_e * precision.master_bytes(),
        adam_m: opt_e * 4,
        adam_v: opt_e * 4,
        ..DeviceBytes::default()
    };
    let mut off_per_device = OffBytes::default();
    if choice.offload_optimizer != Offload::None {
        let opt_states = shard * (4 + 4 + 4); // fp32 param copy, m, v
        let fp32_grads = shard * 4;
        d.master = 0;
        d.adam_m = 0;
        d.adam_v = 0;
        if choice.stage >= 2 {
            d.grads = 0;
        }
        off_per_device.host_fp32_grads = fp32_grads;
        match choice.offload_optimizer {
            Offload::Cpu => off_per_device.host_optimizer_states = opt_states,
            _ => off_per_device.nvme_optimizer_states = opt_states,
        }
    }
    if choice.stage == 3 && choice.offload_param != Offload::None {
        d.params = 0;
        match choice.offload_param {
            Offload::Cpu => off_per_device.host_params = shard * p,
            _ => off_per_device.nvme_params = shard * p,
        }
    }
    off_per_device.retotal();
    d.model_states = d.params + d.grads + d.master + d.adam_m + d.adam_v;
    (d, off_per_device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flat::DType;

    #[test]
    fn fp32_training_is_16_bytes_per_param_without_master() {
        let (d, _) = model_state_bytes(
            ZeroChoice::new(0, Offload::None, Offload::None),
            Precision::Fp32,
            1000,
            4,
        );
        assert_eq!(
            (d.params, d.grads, d.master, d.adam_m, d.adam_v),
            (4000, 4000, 0, 4000, 4000)
        );
        assert_eq!(d.model_states, 16_000);
    }

    fn dtypes(grad_accum: DType, comm: DType) -> ReductionDtypes {
        ReductionDtypes { grad_accum, comm }
    }

    #[test]
    fn buffer_rules() {
        let m = ModelSize::from_count(1_000_000, Some(300_000)).unwrap();
        let mut s = BufferSettings::deepspeed_defaults(2);
        s.reduce_bucket_size = 200_000;
        let b = engine_buffer_bytes(2, Precision::Bf16, &m, &s, dtypes(DType::BF16, DType::BF16));
        assert_eq!(
            b,
            EngineBuffers {
                reduce_buckets: 400_000,
                scratch_buffers: 0,
                gather_pool: 0,
                persistent_params: 0
            }
        );
        s.overlap_comm = true;
        s.max_live_parameters = 100_000;
        let b = engine_buffer_bytes(3, Precision::Fp32, &m, &s, dtypes(DType::F32, DType::F32));
        // Bucket 200k f32 ×2; pool = max(largest unit 300k, min(100k, Ψ)) f32.
        assert_eq!(b.reduce_buckets, 1_600_000);
        assert_eq!(b.gather_pool, 1_200_000);
        // A bucket larger than the model is clamped to Ψ.
        s.reduce_bucket_size = 5_000_000;
        assert_eq!(
            engine_buffer_bytes(0, Precision::Bf16, &m, &s, dtypes(DType::F32, DType::BF16))
                .reduce_buckets,
            4_000_000
        );
        // Reduced in place in the units' own gradients: no bucket at all.
        assert_eq!(
            engine_buffer_bytes(0, Precision::Fp32, &m, &s, dtypes(DType::F32, DType::F32))
                .reduce_buckets,
            0
        );
        // Stage 3 in place too once a bucket holds the largest unit (300k): instead of the two
        // buckets of Ψ (1M), as many transient f32 gradients in flight as their memory holds (6).
        let b = engine_buffer_bytes(3, Precision::Fp32, &m, &s, dtypes(DType::F32, DType::F32));
        assert_eq!((b.reduce_buckets, b.scratch_buffers), (0, 6 * 300_000 * 4));
    }

    #[test]
    fn persistence_counts_small_units_only() {
        let m =
            ModelSize::from_gpt(super::super::model::GptShape::preset("gpt2").unwrap()).unwrap();
        let s = BufferSettings::deepspeed_defaults(3);
        // Only ln_f (2·768 elements) is at or under 1e5.
        assert_eq!(persistent_elements(&m, &s), 1536);
    }

    #[test]
    fn checkpointing_shrinks_activations() {
        let shape = super::super::model::GptShape::preset("gpt2").unwrap();
        let a = activation_bytes(&shape, 8, 1024, Precision::Bf16);
        assert!(a.checkpointed < a.full / 2, "{a:?}");
        let per_block = 8 * 1024 * (16 * 768 + 12 * 1024) * 2;
        let head = 8 * 1024 * (2 * 768 + 2 * 50257) * 2;
        assert_eq!(a.full, 12 * per_block + head);
        assert_eq!(a.checkpointed, 12 * 8 * 1024 * 768 * 2 + per_block + head);
        let fp32 = activation_bytes(&shape, 8, 1024, Precision::Fp32);
        assert_eq!(fp32.full, 2 * a.full);
    }
}
