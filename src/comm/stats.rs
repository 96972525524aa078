//! Bandwidth conventions (nccl-tests'), the ring-formula byte counts, and the per-op/per-size
//! statistics behind the on-demand summary table.

use crate::comm::{shard_range, CollectiveKind, Partition, TrafficCounters};
use crate::flat::DType;
use std::fmt::Write as _;
use std::time::Duration;

/// nccl-tests' bus-bandwidth factor: busbw = algbw * factor, with the message size taken as the full
/// tensor. All-reduce 2(n-1)/n, reduce-scatter and all-gather (n-1)/n, broadcast 1, barrier 0.
pub(crate) fn bus_factor(kind: CollectiveKind, world: usize) -> f64 {
    let n = world as f64;
    match kind {
        CollectiveKind::AllReduce => 2.0 * (n - 1.0) / n,
        CollectiveKind::ReduceScatter | CollectiveKind::AllGather | CollectiveKind::AllToAll => {
            (n - 1.0) / n
        }
        CollectiveKind::Broadcast => 1.0,
        CollectiveKind::Barrier => 0.0,
    }
}

/// `(algbw, busbw)` in GB/s (1e9 bytes per second) for a full tensor of `bytes` moved in `time`.
pub fn bandwidths(kind: CollectiveKind, world: usize, bytes: u64, time: Duration) -> (f64, f64) {
    let secs = time.as_secs_f64();
    if secs <= 0.0 {
        return (0.0, 0.0);
    }
    let algbw = bytes as f64 / secs / 1e9;
    (algbw, algbw * bus_factor(kind, world))
}

/// Where a collective ran, for its byte counts: the world, this rank, the group it ran in, and
/// the hosts the world spans (`None`: one host).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Placement {
    pub world: usize,
    pub rank: usize,
    pub group: Partition,
    pub ranks_per_host: Option<usize>,
}

impl Placement {
    /// Whether world rank `peer` is on another host than this rank.
    fn remote(&self, peer: usize) -> bool {
        self.ranks_per_host
            .is_some_and(|h| h > 0 && peer / h != self.rank / h)
    }
}

/// Adds one collective's ring-formula traffic to `c`: for a full tensor of `len` elements of
/// `elem_bytes` bytes over a group of n ranks, reduce-scatter and all-gather send and receive the
/// full buffer minus this rank's shard (all-to-all too: every chunk but its own), all-reduce
/// twice that, broadcast the buffer (received by
/// every non-root, sent by the root once per other rank), barrier nothing. Of those, the bytes
/// exchanged with ranks on other hosts (`inter_host_*`), as point-to-point exchanges move them:
/// a shard from or to each such peer (the same as the ring's when the shards are equal, as the
/// engine's padded buffers make them).
pub(crate) fn count_traffic(
    c: &mut TrafficCounters,
    kind: CollectiveKind,
    at: Placement,
    len: usize,
    elem_bytes: usize,
    root: Option<usize>,
) {
    let n = at.group.group_size(at.world);
    let me = at.group.index(at.rank);
    let full = (len * elem_bytes) as u64;
    let shard_of = |i: usize| (shard_range(len, n, i).len() * elem_bytes) as u64;
    let shard = shard_of(me);
    let (sent, recv) = match kind {
        CollectiveKind::ReduceScatter | CollectiveKind::AllGather | CollectiveKind::AllToAll => {
            (full - shard, full - shard)
        }
        CollectiveKind::AllReduce => (2 * (full - shard), 2 * (full - shard)),
        CollectiveKind::Broadcast => match root == Some(me) {
            true => (full * (n as u64 - 1), 0),
            false => (0, full),
        },
        CollectiveKind::Barrier => (0, 0),
    };
    // Peers on other hosts, and the sum of their shards (no allocation: this runs per call).
    let (others, theirs) = (0..n)
        .filter(|&i| i != me && at.remote(at.group.member(at.rank, i)))
        .fold((0u64, 0u64), |(k, b), i| (k + 1, b + shard_of(i)));
    let (inter_sent, inter_recv) = match kind {
        CollectiveKind::AllGather => (others * shard, theirs),
        CollectiveKind::ReduceScatter | CollectiveKind::AllToAll => (theirs, others * shard),
        CollectiveKind::AllReduce => (theirs + others * shard, theirs + others * shard),
        CollectiveKind::Broadcast => match root {
            Some(r) if r == me => (full * others, 0),
            Some(r) if at.remote(at.group.member(at.rank, r)) => (0, full),
            _ => (0, 0),
        },
        CollectiveKind::Barrier => (0, 0),
    };
    let k = kind as usize;
    c.sent_bytes[k] += sent;
    c.recv_bytes[k] += recv;
    c.inter_host_sent_bytes[k] += inter_sent;
    c.inter_host_recv_bytes[k] += inter_recv;
    c.calls[k] += 1;
}

/// Timing of every call of one op, dtype and size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpStats {
    pub calls: u64,
    pub total: Duration,
    pub min: Duration,
    pub max: Duration,
    /// Calls in which this rank arrived last by more than the straggler threshold.
    pub straggled: u64,
}

/// One row of [`CommStats`]: an op, dtype (none for barriers) and full-tensor size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpRow {
    pub kind: CollectiveKind,
    pub dtype: Option<DType>,
    pub bytes: u64,
    pub stats: OpStats,
}

/// Per-rank statistics, one row per (op, dtype, full-tensor bytes), in order of first use.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CommStats {
    pub world_size: usize,
    pub rows: Vec<OpRow>,
}

impl CommStats {
    pub(crate) fn record(
        &mut self,
        kind: CollectiveKind,
        dtype: Option<DType>,
        bytes: u64,
        time: Duration,
        straggled: bool,
    ) {
        // A training run uses a few dozen distinct (op, size) pairs: a linear scan is cheapest.
        let i = match self
            .rows
            .iter()
            .position(|r| r.kind == kind && r.dtype == dtype && r.bytes == bytes)
        {
            Some(i) => i,
            None => {
                self.rows.push(OpRow {
                    kind,
                    dtype,
                    bytes,
                    stats: OpStats {
                        calls: 0,
                        total: Duration::ZERO,
                        min: Duration::MAX,
                        max: Duration::ZERO,
                        straggled: 0,
                    },
                });
                self.rows.len() - 1
            }
        };
        let e = &mut self.rows[i].stats;
        e.calls += 1;
        e.total += time;
        e.min = e.min.min(time);
        e.max = e.max.max(time);
        e.straggled += u64::from(straggled);
    }

    /// A table, one row per op, dtype and size (sorted by op, then size): calls, total and mean time, min and max, algbw and
    /// busbw at the mean time (nccl-tests conventions), straggler count.
    pub(crate) fn summary_table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<15} {:>5} {:>12} {:>7} {:>11} {:>11} {:>11} {:>11} {:>9} {:>9} {:>5}",
            "op",
            "dtype",
            "bytes",
            "calls",
            "total(ms)",
            "mean(us)",
            "min(us)",
            "max(us)",
            "algbw",
            "busbw",
            "late"
        );
        let mut rows: Vec<&OpRow> = self.rows.iter().collect();
        rows.sort_by_key(|r| (r.kind, r.dtype.map(|d| d.size()), r.bytes));
        for &OpRow {
            kind,
            dtype,
            bytes,
            stats: ref st,
        } in rows
        {
            let mean = st.total / st.calls.max(1) as u32;
            let (alg, bus) = bandwidths(kind, self.world_size, bytes, mean);
            let _ = writeln!(
                s,
                "{:<15} {:>5} {:>12} {:>7} {:>11.3} {:>11.1} {:>11.1} {:>11.1} {:>9.2} {:>9.2} {:>5}",
                kind.name(),
                dtype.map_or("-", |d| d.name()),
                bytes,
                st.calls,
                st.total.as_secs_f64() * 1e3,
                mean.as_secs_f64() * 1e6,
                st.min.as_secs_f64() * 1e6,
                st.max.as_secs_f64() * 1e6,
                alg,
                bus,
                st.straggled
            );
        }
        s.push_str(
            "(algbw and busbw in GB/s at the mean time; late = calls where this rank straggled)\n",
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_formulas_and_bus_factors() {
        let mut c = TrafficCounters::default();
        let at = |rank| Placement {
            world: 4,
            rank,
            group: Partition::World,
            ranks_per_host: None,
        };
        // 10 f32 over 4 ranks: shards 3,3,2,2.
        count_traffic(&mut c, CollectiveKind::ReduceScatter, at(0), 10, 4, None);
        assert_eq!(c.sent(CollectiveKind::ReduceScatter), 28);
        count_traffic(&mut c, CollectiveKind::AllReduce, at(3), 10, 4, None);
        assert_eq!(c.recv(CollectiveKind::AllReduce), 64);
        count_traffic(&mut c, CollectiveKind::Broadcast, at(1), 10, 2, Some(1));
        assert_eq!(c.sent(CollectiveKind::Broadcast), 60);
        assert_eq!(c.recv(CollectiveKind::Broadcast), 0);
        // One host: nothing crosses hosts.
        assert_eq!(c.inter_host_sent_bytes, [0; crate::comm::COLLECTIVE_KINDS]);
        assert_eq!(bus_factor(CollectiveKind::AllReduce, 4), 1.5);
        assert_eq!(bus_factor(CollectiveKind::AllGather, 2), 0.5);
        let (a, b) = bandwidths(
            CollectiveKind::AllReduce,
            2,
            2_000_000_000,
            Duration::from_secs(1),
        );
        assert_eq!((a, b), (2.0, 2.0));
    }

    #[test]
    fn bytes_to_other_hosts_are_counted_apart() {
        // 8 f32 over 4 ranks on two hosts of two: shards of 2 elements (8 bytes).
        let at = |rank, group| Placement {
            world: 4,
            rank,
            group,
            ranks_per_host: Some(2),
        };
        let mut c = TrafficCounters::default();
        count_traffic(
            &mut c,
            CollectiveKind::AllGather,
            at(1, Partition::World),
            8,
            4,
            None,
        );
        let k = CollectiveKind::AllGather as usize;
        assert_eq!((c.sent_bytes[k], c.recv_bytes[k]), (24, 24));
        // Ranks 2 and 3 are on the other host: one shard to and from each.
        assert_eq!(c.inter_host_sent_bytes[k], 16);
        assert_eq!(c.inter_host_recv_bytes[k], 16);
        // Within the host (ranks 0 and 1), the group's shards are 4 elements.
        let mut c = TrafficCounters::default();
        count_traffic(
            &mut c,
            CollectiveKind::AllGather,
            at(1, Partition::Within(2)),
            8,
            4,
            None,
        );
        assert_eq!((c.sent_bytes[k], c.inter_host_sent_bytes[k]), (16, 0));
        // Across hosts (ranks 1 and 3): everything crosses.
        let mut c = TrafficCounters::default();
        count_traffic(
            &mut c,
            CollectiveKind::AllGather,
            at(1, Partition::Across(2)),
            8,
            4,
            None,
        );
        assert_eq!((c.sent_bytes[k], c.inter_host_sent_bytes[k]), (16, 16));
        let r = CollectiveKind::AllReduce as usize;
        count_traffic(
            &mut c,
            CollectiveKind::AllReduce,
            at(0, Partition::World),
            8,
            4,
            None,
        );
        assert_eq!(c.inter_host_recv_bytes[r], 32);
    }
}
