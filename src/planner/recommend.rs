//! The recommendation: the lowest stage that fits, what the network does to the alternatives, and
//! what to change in the given config. "The choice between ZeRO stages is about capacity, not speed."

use super::size::{format_at_most, format_capacity, format_gb, format_seconds};
use super::{EngineRun, Offload, PlanInput, PlanOption, ZeroChoice};
use crate::zero::buffers;

/// The chosen option (none when nothing fits) and the reasons, one sentence each.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Recommendation {
    pub choice: Option<ZeroChoice>,
    pub label: Option<String>,
    pub reasons: Vec<String>,
    /// Changes to the given DeepSpeed config.
    pub config_advice: Vec<String>,
}

/// Picks the most preferred option that fits ([`ZeroChoice::preference_rank`]) and explains it.
pub fn recommend(input: &PlanInput, options: &[PlanOption]) -> Recommendation {
    let mem = input.cluster.device_memory;
    let mut ranked: Vec<&PlanOption> = options.iter().collect();
    ranked.sort_by_key(|o| o.choice().preference_rank());
    let chosen = ranked.iter().copied().find(|o| o.fits);
    let mut reasons = Vec::new();
    match chosen {
        Some(best) => {
            reasons.push(format!(
                "{} is the lowest option that fits: {} of {} per device ({} spare){}",
                best.label,
                format_gb(best.bytes_per_device.total),
                format_capacity(mem),
                format_gb(best.device_margin_bytes as u64),
                host_note(best)
            ));
            for o in ranked.iter().take_while(|o| o.label != best.label) {
                reasons.push(why_not(o, mem, input.cluster.host_memory));
            }
            reasons.push(format!(
                "predicted per step: compute {}, communication {} ({} per device){}",
                format_seconds(best.predicted_compute_s),
                format_seconds(best.predicted_comm_s),
                format_gb(best.comm_bytes_per_step),
                if best.offload.predicted_s > 0.0 {
                    format!(", offload {}", format_seconds(best.offload.predicted_s))
                } else {
                    String::new()
                }
            ));
            if best.predicted_comm_s > best.predicted_compute_s {
                reasons.push(format!(
                    "the network dominates this step: communication takes {:.1}x the compute; more tokens per step (micro-batch or accumulation) amortise it",
                    best.predicted_comm_s / best.predicted_compute_s
                ));
            }
            reasons.extend(network_comparisons(best, &ranked));
            reasons.extend(hpz_reason(best));
            reasons.extend(hsdp_reason(best));
        }
        None => {
            reasons.push(format!(
                "no stage or offload choice fits {} devices of {}",
                input.cluster.world_size(),
                format_capacity(mem)
            ));
            if let Some(smallest) = options.iter().min_by_key(|o| o.bytes_per_device.total) {
                reasons.push(why_not(smallest, mem, input.cluster.host_memory));
                let b = &smallest.bytes_per_device;
                if let Some(a) = smallest.activation_options {
                    if !input.activation_checkpointing
                        && b.total - b.activations - b.param_copies + a.checkpointed <= mem
                    {
                        reasons.push("enabling activation checkpointing would make it fit".into());
                    } else if b.activations > mem / 4 {
                        reasons.push(
                            "activations are a large share: lower the micro-batch or the sequence length"
                                .into(),
                        );
                    }
                }
            }
            if let Some(s3) = options
                .iter()
                .find(|o| o.choice() == ZeroChoice::new(3, Offload::None, Offload::None))
            {
                let b = &s3.bytes_per_device;
                let rest = b.total - b.model_states;
                if rest < mem {
                    // Stage 3's model states on all devices together, as this run sizes them
                    // (moment and master dtypes included).
                    let states_full = b.model_states * input.cluster.world_size();
                    let devices = states_full.div_ceil(mem - rest);
                    reasons.push(format!(
                        "stage 3 without offload needs about {devices} devices of this size for its model states plus the buffers and activations"
                    ));
                }
            }
        }
    }
    Recommendation {
        choice: chosen.map(PlanOption::choice),
        label: chosen.map(|o| o.label.clone()),
        reasons,
        config_advice: config_advice(input, options, chosen),
    }
}

/// ZeRO++'s hpZ for a stage-3 choice across nodes: on when the network makes it pay.
fn hpz_reason(best: &PlanOption) -> Option<String> {
    let h = best.hpz.as_ref()?;
    let saving = format!(
        "{} instead of {} per step ({} instead of {} per device to other nodes), for {} per device of secondary partition",
        format_seconds(h.step_s),
        format_seconds(best.predicted_step_s),
        format_gb(h.inter_node_bytes_hpz),
        format_gb(h.inter_node_bytes),
        format_gb(h.secondary_bytes)
    );
    Some(match (h.worth_it, h.fits) {
        (true, _) => format!(
            "turn on ZeRO++'s hpZ (zero_hpz_partition_size: {}): the backward's all-gathers stay inside the node, {saving}; with zero_quantized_weights too (qwZ, int8 gathers) {} per step, {} per device to other nodes; and with zero_quantized_gradients (qgZ, int8 gradients across nodes) {} per step, {} per device to other nodes",
            h.ranks_per_host,
            format_seconds(h.step_s_with_qwz),
            format_gb(h.inter_node_bytes_with_qwz),
            format_seconds(h.step_s_with_qgz),
            format_gb(h.inter_node_bytes_with_qgz)
        ),
        (false, true) => format!(
            "hpZ (zero_hpz_partition_size: {}) would gain little on this network: {saving}",
            h.ranks_per_host
        ),
        (false, false) => format!(
            "hpZ (zero_hpz_partition_size: {}) does not fit: {saving}",
            h.ranks_per_host
        ),
    })
}

/// HSDP for a stage-3 choice across nodes, named where it would be faster by enough and fits
/// (zerodp does not run it: FSDP's and DeepSpeed's users can).
fn hsdp_reason(best: &PlanOption) -> Option<String> {
    let h = best.hsdp.as_ref().filter(|h| h.worth_it)?;
    Some(format!(
        "HSDP (stage 3 within each node of {} devices, data parallel across nodes: FSDP's HYBRID_SHARD, DeepSpeed's MiCS) would take {} instead of {} per step ({} instead of {} per device to other nodes), for {} per device of model states instead of {}; zerodp does not run it",
        h.shard_size,
        format_seconds(h.step_s),
        format_seconds(best.predicted_step_s),
        format_gb(h.inter_node_bytes),
        format_gb(best.hpz.as_ref().map_or(0, |p| p.inter_node_bytes)),
        format_gb(h.model_state_bytes),
        format_gb(best.bytes_per_device.model_states)
    ))
}

/// What the network and the host links do to the alternatives that also fit.
fn network_comparisons(best: &PlanOption, ranked: &[&PlanOption]) -> Vec<String> {
    let mut out = Vec::new();
    let later = || {
        ranked
            .iter()
            .skip_while(|o| o.label != best.label)
            .skip(1)
            .filter(|o| o.fits)
    };
    if best.stage < 3 {
        if let Some(s3) = later().find(|o| o.stage == 3 && o.offload_optimizer == Offload::None) {
            out.push(format!(
                "stage 3 also fits ({} per device) but would move {} instead of {} per step, gathering every unit twice per micro-step: {} vs {} of communication on this network",
                format_gb(s3.bytes_per_device.total),
                format_gb(s3.comm_bytes_per_step),
                format_gb(best.comm_bytes_per_step),
                format_seconds(s3.predicted_comm_s),
                format_seconds(best.predicted_comm_s)
            ));
        }
    }
    if best.offload_optimizer == Offload::None {
        if let Some(off) = later().find(|o| o.offload_optimizer != Offload::None) {
            out.push(format!(
                "offloading ({}) would free device memory but add {} per step of host copies and host-side Adam",
                off.label,
                format_seconds(off.offload.predicted_s)
            ));
        }
    } else if let Some(alt) = later()
        .filter(|o| o.predicted_step_s < 0.95 * best.predicted_step_s)
        .min_by(|a, b| a.predicted_step_s.total_cmp(&b.predicted_step_s))
    {
        out.push(format!(
            "{} also fits and is predicted faster on this cluster ({} vs {} per step): offloading costs more than sharding over this network; prefer it if speed matters more than headroom",
            alt.label,
            format_seconds(alt.predicted_step_s),
            format_seconds(best.predicted_step_s)
        ));
    }
    out
}

fn host_note(o: &PlanOption) -> String {
    if o.bytes_per_node.host > 0 {
        format!(
            ", {} of host memory per node",
            format_gb(o.bytes_per_node.host)
        )
    } else {
        String::new()
    }
}

/// Why an option is out: which memory it breaks and its biggest parts.
fn why_not(o: &PlanOption, mem: u64, host_mem: u64) -> String {
    let b = &o.bytes_per_device;
    if !o.fits_device {
        format!(
            "{} needs {} per device, over by {} (model states {}, buffers {}, activations {})",
            o.label,
            format_gb(b.total),
            format_gb(b.total - mem),
            format_gb(b.model_states),
            format_gb(o.buffer_bytes()),
            format_gb(b.activations)
        )
    } else if !o.fits_host {
        format!(
            "{} fits the device but needs {} of host memory per node, over by {}",
            o.label,
            format_gb(o.bytes_per_node.host),
            format_gb(o.bytes_per_node.host - host_mem)
        )
    } else {
        format!("{} fits too", o.label)
    }
}

/// What to change in the given config.
fn config_advice(
    input: &PlanInput,
    options: &[PlanOption],
    chosen: Option<&PlanOption>,
) -> Vec<String> {
    let Some(cfg) = input.configured else {
        return Vec::new();
    };
    let Some(o) = options.iter().find(|o| o.choice() == cfg) else {
        return vec![format!(
            "the config's {} is not a choice the planner models",
            cfg.label()
        )];
    };
    let mem = input.cluster.device_memory;
    let b = &o.bytes_per_device;
    let mut advice = Vec::new();
    if !o.fits_device {
        let without_buckets = b.total - b.reduce_buckets;
        let s = &o.buffer_settings;
        let copies = if s.overlap_comm { 2 } else { 1 };
        let dtype = input.precision.param_bytes();
        if without_buckets < mem {
            // A bucket costs exactly its own bytes, on zerodp's engine path too (its collectives
            // run in place, with no second buffer for the shard).
            let max_bucket = (mem - without_buckets) / (dtype * copies);
            advice.push(format!(
                "the reduce buckets alone break the budget: reduce_bucket_size {:.0e} x {} buffer(s) = {}; set reduce_bucket_size to at most {} (5e7 is a common choice)",
                s.reduce_bucket_size as f64,
                copies,
                format_gb(b.reduce_buckets),
                format_at_most(max_bucket)
            ));
        } else if o.stage == 3 {
            // The budget stage3_max_live_parameters sets, its smallest value and its dtype: on
            // zerodp's engine path the persistent units are inside it and the floor is the
            // largest visit beside them.
            let (budget, floor, pool_dtype) = match &input.model.spec {
                Some(spec) => {
                    let run = EngineRun::new(spec, input, 3);
                    let mut smallest = run.config.clone();
                    smallest.max_live_parameters = 0;
                    (
                        b.gather_pool + b.persistent_params,
                        buffers::plan(spec, &smallest).gather_bytes(),
                        run.buffers.param_dtype.size() as u64,
                    )
                }
                None => (b.gather_pool, input.model.largest_unit * dtype, dtype),
            };
            if without_buckets - budget < mem {
                let room = mem + budget - without_buckets;
                if room >= floor {
                    advice.push(format!(
                        "the stage-3 gather pool ({}) breaks the budget: set stage3_max_live_parameters to at most {}",
                        format_gb(budget),
                        format_at_most(room / pool_dtype)
                    ));
                }
            }
        }
        if advice.is_empty() {
            advice.push(format!(
                "the config's {} does not fit: {} per device, over by {}",
                o.label,
                format_gb(b.total),
                format_gb(b.total - mem)
            ));
        }
    } else if !o.fits_host {
        advice.push(format!(
            "the config's {} needs {} of host memory per node, over by {}",
            o.label,
            format_gb(o.bytes_per_node.host),
            format_gb(o.bytes_per_node.host - input.cluster.host_memory)
        ));
    }
    if let Some(best) = chosen {
        if best.choice() != cfg {
            let rank = |c: ZeroChoice| c.preference_rank();
            let change = changes(best.choice(), cfg);
            if rank(best.choice()) < rank(cfg) && o.fits {
                if o.predicted_step_s <= 1.05 * best.predicted_step_s {
                    advice.push(format!(
                        "the config's {} fits and is predicted about as fast as {} ({} vs {} per step): fine as is, with more headroom",
                        o.label,
                        best.label,
                        format_seconds(o.predicted_step_s),
                        format_seconds(best.predicted_step_s)
                    ));
                } else {
                    advice.push(format!(
                        "{} fits, so the config's {} buys headroom at the price of time ({} vs {} per step); to go faster set {change}",
                        best.label,
                        o.label,
                        format_seconds(o.predicted_step_s),
                        format_seconds(best.predicted_step_s)
                    ));
                }
            } else if !o.fits {
                advice.push(format!("use {} instead: set {change}", best.label));
            }
        }
    }
    advice
}

/// The config keys to change to go from `from` to `to`.
fn changes(to: ZeroChoice, from: ZeroChoice) -> String {
    let mut keys = Vec::new();
    if to.stage != from.stage {
        keys.push(format!("zero_optimization.stage = {}", to.stage));
    }
    if to.offload_optimizer != from.offload_optimizer {
        keys.push(format!(
            "zero_optimization.offload_optimizer.device = \"{}\"",
            to.offload_optimizer.name()
        ));
    }
    if to.offload_param != from.offload_param {
        keys.push(format!(
            "zero_optimization.offload_param.device = \"{}\"",
            to.offload_param.name()
        ));
    }
    keys.join(", ")
}
