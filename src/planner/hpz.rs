//! ZeRO++'s hierarchical partitioning (hpZ, `zero_hpz_partition_size`) priced for a stage-3
//! option across nodes: what it saves on the network, what it costs in memory, and whether to
//! turn it on.
//!
//! With hpZ each node keeps a secondary partition of the parameters (every unit split over the
//! node's devices). A unit's first all-gather of a step crosses nodes as plain stage 3's does;
//! every later one (the other micro-steps' forwards, the backward, a recomputation) gathers the
//! secondary partition inside the node. The gradients' reduce-scatter is unchanged by hpZ; qgZ
//! replaces it by int8 all-to-alls within and across nodes.

use super::cluster::{Cluster, Collective};
use super::traffic::{priced, CollectiveTraffic};
use super::{PlanInput, PlanOption};

/// Step time below which (as a share of plain stage 3's) hpZ is recommended.
const WORTH: f64 = 0.9;

/// A stage-3 option with hpZ over its nodes' devices.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct HpzEffect {
    /// `zero_hpz_partition_size`: the devices of a node.
    pub ranks_per_host: u64,
    /// Bytes a device sends to other nodes per step, without and with hpZ.
    pub inter_node_bytes: u64,
    pub inter_node_bytes_hpz: u64,
    /// Predicted communication and step time with hpZ (the option's own are without).
    pub comm_s: f64,
    pub step_s: f64,
    /// With qwZ too (`zero_quantized_weights`: the crossing gathers in int8): bytes to other
    /// nodes and the step time.
    pub inter_node_bytes_with_qwz: u64,
    pub step_s_with_qwz: f64,
    /// With qwZ and qgZ too (`zero_quantized_gradients`: the gradients reduced by int8
    /// all-to-alls within the node, then across nodes on a node's 1/g): bytes to other nodes
    /// and the step time.
    pub inter_node_bytes_with_qgz: u64,
    pub step_s_with_qgz: f64,
    /// Memory per device of the secondary partition.
    pub secondary_bytes: u64,
    /// Whether the option still fits its devices with the secondary partition.
    pub fits: bool,
    /// Predicted faster by enough to turn it on ([`WORTH`]), and fits.
    pub worth_it: bool,
}

/// Bytes one device exchanges with other nodes in one collective of `full_bytes` over the whole
/// cluster, point to point: the share of the data held on other nodes, twice for an all-reduce.
fn inter_node(op: Collective, full_bytes: u64, c: &Cluster) -> u64 {
    let n = c.world_size().max(1);
    let remote = n - c.devices_per_node.min(n);
    let share = full_bytes as u128 * remote as u128 / n as u128;
    let share = u64::try_from(share).unwrap_or(u64::MAX);
    match op {
        Collective::AllReduce => share.saturating_mul(2),
        Collective::ReduceScatter | Collective::AllGather => share,
    }
}

/// hpZ's effect on `option`: `None` unless it is a stage-3 option on more than one node.
pub fn hpz_effect(input: &PlanInput, option: &PlanOption) -> Option<HpzEffect> {
    let c = &input.cluster;
    if option.stage != 3 || c.nodes < 2 || c.devices_per_node < 2 {
        return None;
    }
    let node = Cluster {
        nodes: 1,
        ..c.clone()
    };
    let ga = input.grad_accum.max(1);
    let mut plain_inter = 0u64;
    let mut hpz_inter = 0u64;
    let mut comm_s = 0.0;
    let mut first_gathers = 0u64;
    // qwZ: int8 and a 4-byte scale per block instead of the parameters' own bytes.
    let param = input.precision.param_bytes() as f64;
    let qwz = (1.0 + 4.0 / crate::zero::quantize::BLOCK as f64) / param;
    let (mut qwz_inter, mut qwz_comm_s) = (0u64, 0.0);
    let (mut qgz_inter, mut qgz_comm_s) = (0u64, 0.0);
    // qgZ: int8 and a scale per block instead of the gradients' communication bytes.
    let qgz =
        (1.0 + 4.0 / crate::zero::quantize::BLOCK as f64) / input.precision.param_bytes() as f64;
    for t in &option.collectives {
        let crossing = inter_node(t.op, t.full_bytes, c);
        plain_inter = plain_inter.saturating_add(crossing);
        let (first, later): (Option<CollectiveTraffic>, Option<CollectiveTraffic>) = match t.what {
            // Each micro-step gathers every unit for its forward: the first crosses nodes.
            "params (forward)" => {
                let first = t.full_bytes / ga;
                first_gathers = first;
                (
                    Some(priced(t.op, t.what, first, t.calls.div_ceil(ga), c)),
                    (ga > 1).then(|| {
                        let calls = t.calls - t.calls.div_ceil(ga);
                        priced(t.op, t.what, t.full_bytes - first, calls, &node)
                    }),
                )
            }
            "params (backward)" => (
                None,
                Some(priced(t.op, t.what, t.full_bytes, t.calls, &node)),
            ),
            _ => (Some(t.clone()), None),
        };
        if let Some(f) = &first {
            comm_s += f.predicted_s;
            let crossing = inter_node(f.op, f.full_bytes, c);
            hpz_inter = hpz_inter.saturating_add(crossing);
            let (bytes, secs) = match f.op == Collective::AllGather {
                true => {
                    let b = (f.full_bytes as f64 * qwz) as u64;
                    (b, priced(f.op, f.what, b, f.calls, c).predicted_s)
                }
                false => (f.full_bytes, f.predicted_s),
            };
            qwz_inter = qwz_inter.saturating_add(inter_node(f.op, bytes, c));
            qwz_comm_s += secs;
            let (bytes, secs) = match f.op == Collective::ReduceScatter {
                // Within the node on the whole gradient, then across on the node's 1/g share,
                // the node's links shared by its g devices: the hierarchical algorithm's time.
                true => {
                    let q = (f.full_bytes as f64 * qgz) as u64;
                    let t = c.hierarchical_time(f.op, q as f64 / f.calls.max(1) as f64);
                    (
                        inter_node(f.op, q, c) / c.devices_per_node,
                        t * f.calls.max(1) as f64,
                    )
                }
                false => (inter_node(f.op, bytes, c), secs),
            };
            qgz_inter = qgz_inter.saturating_add(bytes);
            qgz_comm_s += secs;
        }
        if let Some(l) = &later {
            comm_s += l.predicted_s;
            qwz_comm_s += l.predicted_s;
            qgz_comm_s += l.predicted_s;
        }
    }
    let secondary_bytes = first_gathers / c.devices_per_node;
    let step_s = option.predicted_compute_s + comm_s + option.offload.predicted_s;
    let fits = option.fits && secondary_bytes as i64 <= option.device_margin_bytes;
    Some(HpzEffect {
        ranks_per_host: c.devices_per_node,
        inter_node_bytes: plain_inter,
        inter_node_bytes_hpz: hpz_inter,
        comm_s,
        step_s,
        inter_node_bytes_with_qwz: qwz_inter,
        step_s_with_qwz: option.predicted_compute_s + qwz_comm_s + option.offload.predicted_s,
        inter_node_bytes_with_qgz: qgz_inter,
        step_s_with_qgz: option.predicted_compute_s + qgz_comm_s + option.offload.predicted_s,
        secondary_bytes,
        fits,
        worth_it: fits && step_s < WORTH * option.predicted_step_s,
    })
}
