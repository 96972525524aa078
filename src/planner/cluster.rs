//! The cluster and the latency-bandwidth (alpha-beta) model of ring and hierarchical collectives.
//!
//! A collective over `n` ranks on a tensor of `S` bytes (the full, unsharded size) costs, on a ring,
//! `(n-1)·α + (n-1)/n · S / B` for an all-gather or a reduce-scatter and twice that for an
//! all-reduce (reduce-scatter then all-gather), the nccl-tests "bus bandwidth" factors. Across nodes
//! a ring's bandwidth is bounded by the slower of a device's intra-node link and its node's network
//! (NCCL runs one ring per NIC, so a node's rings together use all of its NICs), and every step pays
//! the inter-node latency. The hierarchical algorithm reduce-scatters inside the node first, runs the
//! inter-node collective on the 1/g-sized pieces (all g devices of a node in parallel, sharing the
//! node's NICs), then all-gathers inside the node: fewer latency terms, more bandwidth terms.

use super::PlanError;

/// One kind of link: bandwidth in bytes/s and a per-step latency in seconds.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Link {
    /// Bytes/s: per device for intra-node links, per node (all NICs together) for the network.
    pub bandwidth: f64,
    /// Seconds per ring step (link latency plus the collective library's per-step overhead).
    pub latency: f64,
}

/// Interconnect presets: name, link, what the numbers are. Bandwidths are achievable bus bandwidths
/// (roughly 80-90% of the line rate), not line rates.
pub const INTERCONNECTS: &[(&str, Link, &str)] = &[
    (
        "nvlink",
        Link {
            bandwidth: 360e9,
            latency: 3e-6,
        },
        "intra-node, per device: H100 NVLink 4 (450 GB/s per direction line rate), 360 GB/s, 3 us",
    ),
    (
        "pcie",
        Link {
            bandwidth: 24e9,
            latency: 8e-6,
        },
        "intra-node, per device: PCIe Gen4 x16 (32 GB/s line rate), 24 GB/s, 8 us",
    ),
    (
        "ib-hdr",
        Link {
            bandwidth: 8.0 * 23e9,
            latency: 6e-6,
        },
        "network, per node: 8 x InfiniBand HDR 200 Gb/s (DGX A100), 184 GB/s, 6 us",
    ),
    (
        "ib-ndr",
        Link {
            bandwidth: 8.0 * 46e9,
            latency: 5e-6,
        },
        "network, per node: 8 x InfiniBand NDR 400 Gb/s (DGX H100), 368 GB/s, 5 us",
    ),
    (
        "eth-100g",
        Link {
            bandwidth: 11e9,
            latency: 30e-6,
        },
        "network, per node: one 100 GbE NIC (TCP/RoCE), 11 GB/s, 30 us",
    ),
    (
        "eth-200g",
        Link {
            bandwidth: 22e9,
            latency: 25e-6,
        },
        "network, per node: one 200 GbE NIC, 22 GB/s, 25 us",
    ),
    (
        "eth-400g",
        Link {
            bandwidth: 44e9,
            latency: 20e-6,
        },
        "network, per node: one 400 GbE NIC, 44 GB/s, 20 us",
    ),
];

/// Looks an interconnect preset up; the error lists the names.
pub fn interconnect(name: &str) -> Result<Link, PlanError> {
    INTERCONNECTS
        .iter()
        .find(|(n, _, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, l, _)| *l)
        .ok_or_else(|| {
            let names: Vec<&str> = INTERCONNECTS.iter().map(|(n, _, _)| *n).collect();
            PlanError::Input(format!(
                "interconnect {name:?} is not a known preset; choose one of {} or give the bandwidth and latency",
                names.join(", ")
            ))
        })
}

/// Where offloaded state goes and how fast it gets there.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct HostLinks {
    /// Device to host copies, bytes/s per device (pinned PCIe Gen4 x16 ≈ 24 GB/s).
    pub device_to_host: f64,
    /// NVMe read/write bandwidth per node, bytes/s (a few striped Gen4 drives ≈ 12 GB/s).
    pub nvme: f64,
    /// Adam updates per second a node's CPUs sustain (DeepSpeed's SIMD CPU Adam on a
    /// two-socket server ≈ 2e9 params/s).
    pub host_adam_params_per_s: f64,
    /// Whether `host_adam_params_per_s` was measured on this machine (`plan --host-adam-rate
    /// measure`) rather than assumed.
    pub host_adam_measured: bool,
}

impl Default for HostLinks {
    fn default() -> Self {
        HostLinks {
            device_to_host: 24e9,
            nvme: 12e9,
            host_adam_params_per_s: 2e9,
            host_adam_measured: false,
        }
    }
}

/// The machines: `nodes` × `devices_per_node`, memory per device and per node, the links.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Cluster {
    pub nodes: u64,
    pub devices_per_node: u64,
    /// Bytes of accelerator memory per device.
    pub device_memory: u64,
    /// Bytes of host memory per node.
    pub host_memory: u64,
    pub intra: Link,
    pub inter: Link,
    pub host: HostLinks,
    /// Sustained FLOP/s per device for the model's matmuls.
    pub device_flops: f64,
}

/// The collectives the planner counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Collective {
    AllReduce,
    ReduceScatter,
    AllGather,
}

impl Collective {
    /// Bytes one rank sends (= receives) for a tensor of `full_bytes` on a ring of `n`:
    /// (n-1)/n · S, doubled for an all-reduce.
    pub(crate) fn ring_bytes_per_rank(self, full_bytes: f64, n: u64) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let f = (n - 1) as f64 / n as f64 * full_bytes;
        match self {
            Collective::AllReduce => 2.0 * f,
            Collective::ReduceScatter | Collective::AllGather => f,
        }
    }

    fn passes(self) -> f64 {
        match self {
            Collective::AllReduce => 2.0,
            Collective::ReduceScatter | Collective::AllGather => 1.0,
        }
    }
}

/// Which algorithm a prediction used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    Ring,
    Hierarchical,
}

impl Cluster {
    pub fn world_size(&self) -> u64 {
        self.nodes * self.devices_per_node
    }

    /// Flat ring over all ranks: `passes · [(n-1)·α + (n-1)/n · S / B]` with B the bottleneck link
    /// and α the slowest step's latency.
    pub fn ring_time(&self, op: Collective, full_bytes: f64) -> f64 {
        let n = self.world_size();
        if n <= 1 {
            return 0.0;
        }
        let (bw, lat) = if self.nodes > 1 {
            (
                self.intra.bandwidth.min(self.inter.bandwidth),
                self.inter.latency.max(self.intra.latency),
            )
        } else {
            (self.intra.bandwidth, self.intra.latency)
        };
        let steps = (n - 1) as f64;
        op.passes() * (steps * lat + steps / n as f64 * full_bytes / bw)
    }

    /// Intra-node phase, then inter-node on 1/g of the data with the node's NICs shared by its g
    /// devices (so the per-device bandwidth is B_node/g on S/g bytes: S/B_node), then intra-node again
    /// for an all-reduce. On one node this is the ring.
    pub fn hierarchical_time(&self, op: Collective, full_bytes: f64) -> f64 {
        let g = self.devices_per_node;
        let m = self.nodes;
        if m <= 1 {
            return self.ring_time(op, full_bytes);
        }
        let intra = if g > 1 {
            (g - 1) as f64 * self.intra.latency
                + (g - 1) as f64 / g as f64 * full_bytes / self.intra.bandwidth
        } else {
            0.0
        };
        let inter = (m - 1) as f64 * self.inter.latency
            + (m - 1) as f64 / m as f64 * full_bytes / self.inter.bandwidth;
        match op {
            // reduce-scatter inside, all-reduce across (on S/g), all-gather inside.
            Collective::AllReduce => 2.0 * intra + 2.0 * inter,
            Collective::ReduceScatter | Collective::AllGather => intra + inter,
        }
    }

    /// The faster of the two algorithms for `calls` equal collectives that together move
    /// `full_bytes`, as NCCL's tuner would pick.
    pub fn collective_time(&self, op: Collective, full_bytes: f64, calls: u64) -> (f64, Algorithm) {
        let calls = calls.max(1) as f64;
        let each = full_bytes / calls;
        let ring = calls * self.ring_time(op, each);
        let hier = calls * self.hierarchical_time(op, each);
        if hier < ring {
            (hier, Algorithm::Hierarchical)
        } else {
            (ring, Algorithm::Ring)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(nodes: u64, inter: &str) -> Cluster {
        Cluster {
            nodes,
            devices_per_node: 8,
            device_memory: 80 << 30,
            host_memory: 2 << 40,
            intra: interconnect("nvlink").unwrap(),
            inter: interconnect(inter).unwrap(),
            host: HostLinks::default(),
            device_flops: 400e12,
        }
    }

    #[test]
    fn ring_bytes_follow_the_bus_bandwidth_factors() {
        assert_eq!(Collective::AllGather.ring_bytes_per_rank(800.0, 8), 700.0);
        assert_eq!(
            Collective::ReduceScatter.ring_bytes_per_rank(800.0, 8),
            700.0
        );
        assert_eq!(Collective::AllReduce.ring_bytes_per_rank(800.0, 8), 1400.0);
        assert_eq!(Collective::AllReduce.ring_bytes_per_rank(800.0, 1), 0.0);
    }

    #[test]
    fn single_node_ring_is_alpha_plus_bytes_over_bandwidth() {
        let c = cluster(1, "ib-ndr");
        let t = c.ring_time(Collective::AllGather, 8e9);
        let expect = 7.0 * 3e-6 + 7.0 / 8.0 * 8e9 / 360e9;
        assert!((t - expect).abs() < 1e-12, "{t} vs {expect}");
        assert_eq!(c.hierarchical_time(Collective::AllGather, 8e9), t);
    }

    #[test]
    fn unknown_preset_lists_the_known_ones() {
        let e = interconnect("carrier-pigeon").unwrap_err().to_string();
        assert!(e.contains("ib-ndr") && e.contains("eth-100g"), "{e}");
    }
}
