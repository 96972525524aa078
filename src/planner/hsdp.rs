//! HSDP priced for a stage-3 option across nodes: PyTorch FSDP's hybrid sharding (and DeepSpeed's
//! MiCS), stage 3 within each node and data parallelism across nodes. Every node holds a whole
//! replica of the model states, sharded over its devices; the parameters' all-gathers and the
//! gradients' reduce-scatter stay inside the node, and only each device's gradient shard crosses
//! nodes, in an all-reduce with its peers of the other nodes.
//!
//! zerodp's engine does not run HSDP (its hosts share one stage-3 partition, with hpZ's
//! secondary copy beside it): this is a comparison the planner makes so a user can tell when
//! the memory of the other nodes is worth less than their network.

use super::cluster::{Cluster, Collective};
use super::memory::model_state_bytes;
use super::traffic::priced;
use super::{PlanInput, PlanOption};

/// Step time below which (as a share of plain stage 3's) HSDP is worth naming.
const WORTH: f64 = 0.9;

/// A stage-3 option as HSDP over its nodes.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct HsdpEffect {
    /// Devices each replica is sharded over: a node's.
    pub shard_size: u64,
    /// Model states per device, sharded over a node instead of the world.
    pub model_state_bytes: u64,
    /// Device bytes in all: the option's with those model states.
    pub total_bytes: u64,
    /// Bytes a device sends to other nodes per step: its gradient shard's all-reduce.
    pub inter_node_bytes: u64,
    /// Predicted communication and step time.
    pub comm_s: f64,
    pub step_s: f64,
    /// Whether it fits the devices.
    pub fits: bool,
    /// Faster than the option by enough ([`WORTH`]), and fits.
    pub worth_it: bool,
}

/// HSDP's effect on `option`: `None` unless it is a stage-3 option on more than one node.
pub fn hsdp_effect(input: &PlanInput, option: &PlanOption) -> Option<HsdpEffect> {
    let c = &input.cluster;
    let (g, m) = (c.devices_per_node, c.nodes);
    if option.stage != 3 || m < 2 || g < 1 {
        return None;
    }
    let node = Cluster {
        nodes: 1,
        ..c.clone()
    };
    // One device per node: the ring of a device's peers on the other nodes.
    let peers = Cluster {
        devices_per_node: 1,
        ..c.clone()
    };
    let (mut comm_s, mut inter) = (0.0, 0u64);
    for t in &option.collectives {
        comm_s += match t.op {
            Collective::AllGather => priced(t.op, t.what, t.full_bytes, t.calls, &node).predicted_s,
            Collective::ReduceScatter => {
                let within = priced(t.op, t.what, t.full_bytes, t.calls, &node).predicted_s;
                // The g devices' all-reduces run at once over the node's links: g times one.
                let shard = t.full_bytes / g;
                let across = priced(Collective::AllReduce, t.what, shard, t.calls, &peers);
                inter = inter.saturating_add(across.bytes_per_device);
                within + across.predicted_s * g as f64
            }
            Collective::AllReduce => t.predicted_s,
        };
    }
    let (states, _) = model_state_bytes(option.choice(), input.precision, input.model.params, g);
    let b = &option.bytes_per_device;
    let total = b.total - b.model_states.min(b.total) + states.model_states;
    let fits = option.fits_host && total <= c.device_memory;
    let step_s = option.predicted_compute_s + comm_s + option.offload.predicted_s;
    Some(HsdpEffect {
        shard_size: g,
        model_state_bytes: states.model_states,
        total_bytes: total,
        inter_node_bytes: inter,
        comm_s,
        step_s,
        fits,
        worth_it: fits && step_s < WORTH * option.predicted_step_s,
    })
}
