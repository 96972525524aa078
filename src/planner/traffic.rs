//! Bytes moved per step per device, by collective, and the predicted times. Byte counts saturate
//! at `u64::MAX` (a long accumulation of a huge model moves more than `u64` counts; the planner
//! only reports these, it compares none of them with a capacity).

use super::cluster::{Algorithm, Cluster, Collective};
use super::memory::{persistent_elements, BufferSettings, Offload, Precision, ZeroChoice};
use super::model::ModelSize;
use super::saturating_product as mul;

/// One collective's share of a step.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct CollectiveTraffic {
    pub op: Collective,
    /// What it moves: `grads`, `params (forward)`, ...
    pub what: &'static str,
    /// Sum over the step of the full (unsharded) tensor sizes, in bytes.
    pub full_bytes: u64,
    /// How many calls the step makes (each pays the latency terms).
    pub calls: u64,
    /// Bytes each device sends (= receives) on a ring: (n-1)/n of `full_bytes`, twice for an
    /// all-reduce; the ZeRO paper's 2Ψ / 3Ψ elements, times (n-1)/n.
    pub bytes_per_device: u64,
    pub predicted_s: f64,
    pub algorithm: Algorithm,
}

/// The collectives of one optimizer step (`grad_accum` micro-steps) under zerodp's schedule:
/// - stage 0: one all-reduce of the grads, bucketed (one call per unit with `reduce_bucket_size`
///   0), at the accumulation boundary;
/// - stages 1-2: a reduce-scatter of the grads (stage 1 at the boundary, stage 2 every micro-step
///   since it keeps only its partition), then one all-gather of the updated params per unit;
/// - stage 3, every micro-step: an all-gather per unit in forward and again in backward (units kept
///   gathered by the persistence rule excepted) and a reduce-scatter of each unit's grads; after the
///   step, an all-gather of the persistent units' params.
///
/// Elements move in the parameter/communication dtype (16-bit in mixed precision, f32 in fp32).
pub fn collectives(
    choice: ZeroChoice,
    precision: Precision,
    model: &ModelSize,
    buffers: &BufferSettings,
    grad_accum: u64,
    cluster: &Cluster,
) -> Vec<CollectiveTraffic> {
    let dtype = precision.param_bytes();
    let psi = model.params;
    let gas = grad_accum.max(1);
    let units = model.num_units();
    let buckets = match buffers.reduce_bucket_size {
        0 => units,
        b => psi.div_ceil(b.clamp(1, psi.max(1))),
    };
    let mut ops: Vec<(Collective, &'static str, u64, u64)> = Vec::new();
    match choice.stage {
        0 => ops.push((Collective::AllReduce, "grads", psi, buckets)),
        1 | 2 => {
            let reductions = if choice.stage == 1 { 1 } else { gas };
            ops.push((
                Collective::ReduceScatter,
                "grads",
                mul(&[psi, reductions]),
                mul(&[buckets, reductions]),
            ));
            ops.push((Collective::AllGather, "params (after step)", psi, units));
        }
        _ => {
            let persistent = persistent_elements(model, buffers);
            let persistent_units = model
                .unit_numels
                .iter()
                .filter(|&&n| n <= buffers.param_persistence_threshold)
                .count() as u64;
            let gathered = psi - persistent;
            let gathered_units = units - persistent_units;
            ops.push((
                Collective::AllGather,
                "params (forward)",
                mul(&[gathered, gas]),
                mul(&[gathered_units, gas]),
            ));
            ops.push((
                Collective::AllGather,
                "params (backward)",
                mul(&[gathered, gas]),
                mul(&[gathered_units, gas]),
            ));
            ops.push((
                Collective::ReduceScatter,
                "grads",
                mul(&[psi, gas]),
                mul(&[units, gas]),
            ));
            if persistent > 0 {
                ops.push((
                    Collective::AllGather,
                    "persistent params (after step)",
                    persistent,
                    persistent_units,
                ));
            }
        }
    }
    ops.into_iter()
        .filter(|(_, _, elems, _)| *elems > 0)
        .map(|(op, what, elems, calls)| priced(op, what, mul(&[elems, dtype]), calls, cluster))
        .collect()
}

/// One collective's share of a step: `calls` calls moving `full_bytes` (unsharded) in all, with its
/// ring bytes per device and its predicted time on `cluster`.
pub(super) fn priced(
    op: Collective,
    what: &'static str,
    full_bytes: u64,
    calls: u64,
    cluster: &Cluster,
) -> CollectiveTraffic {
    let (t, algorithm) = cluster.collective_time(op, full_bytes as f64, calls);
    CollectiveTraffic {
        op,
        what,
        full_bytes,
        calls,
        bytes_per_device: op
            .ring_bytes_per_rank(full_bytes as f64, cluster.world_size())
            .round() as u64,
        predicted_s: t,
        algorithm,
    }
}

/// Bytes each device moves to and from host memory and NVMe per step, and the predicted time of
/// those copies plus the host-side Adam (not overlapped with compute: an upper bound).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct OffloadTraffic {
    /// Device <-> host copies per device per step.
    pub host_link_bytes: u64,
    /// NVMe reads + writes per node per step.
    pub nvme_bytes_per_node: u64,
    pub predicted_s: f64,
}

/// ZeRO-Offload moves each device's gradient partition down (every micro-step from stage 2 on) and
/// its updated 16-bit parameter partition up; the host runs Adam on the node's partitions. NVMe adds
/// a read and a write of the fp32 copy, m and v (12 bytes per element). Parameter offload (stage 3)
/// copies the shard up before each gather, forward and backward, every micro-step; to NVMe, only
/// the `param_nvme_elems` of each device's shard that `max_in_cpu` leaves there are read for those
/// gathers and written after the step.
pub fn offload_traffic(
    choice: ZeroChoice,
    precision: Precision,
    params: u64,
    param_nvme_elems: u64,
    grad_accum: u64,
    cluster: &Cluster,
) -> OffloadTraffic {
    let g = cluster.devices_per_node;
    let shard = params.div_ceil(cluster.world_size().max(1));
    let dtype = precision.param_bytes();
    let gas = grad_accum.max(1);
    let mut out = OffloadTraffic::default();
    let mut host_s = 0.0;
    if choice.offload_optimizer != Offload::None {
        let grad_copies = if choice.stage >= 2 { gas } else { 1 };
        out.host_link_bytes = mul(&[shard, dtype, grad_copies + 1]);
        host_s += mul(&[shard, g]) as f64 / cluster.host.host_adam_params_per_s;
        if choice.offload_optimizer == Offload::Nvme {
            out.nvme_bytes_per_node = mul(&[2 * 12, shard, g]);
        }
    }
    if choice.stage == 3 && choice.offload_param != Offload::None {
        let copies = mul(&[2, gas, shard, dtype]);
        out.host_link_bytes = out.host_link_bytes.saturating_add(copies);
        if choice.offload_param == Offload::Nvme {
            // Read for each gather (forward and backward), written once after the step.
            let swapped = param_nvme_elems.min(shard);
            let written = mul(&[swapped, dtype, g]);
            let read = mul(&[2, gas, swapped, dtype, g]);
            out.nvme_bytes_per_node = out
                .nvme_bytes_per_node
                .saturating_add(read.saturating_add(written));
        }
    }
    out.predicted_s = out.host_link_bytes as f64 / cluster.host.device_to_host
        + out.nvme_bytes_per_node as f64 / cluster.host.nvme
        + host_s;
    out
}
