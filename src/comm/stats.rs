//! Bandwidth conventions (nccl-tests'), the ring-formula byte counts, and the per-op/per-size
//! statistics behind the on-demand summary table.

use crate::comm::{shard_range, CollectiveKind, TrafficCounters};
use crate::flat::DType;
use std::fmt::Write as _;
use std::time::Duration;

/// nccl-tests' bus-bandwidth factor: busbw = algbw * factor, with the message size taken as the full
/// tensor. All-reduce 2(n-1)/n, reduce-scatter and all-gather (n-1)/n, broadcast 1, barrier 0.
pub(crate) fn bus_factor(kind: CollectiveKind, world: usize) -> f64 {
    let n = world as f64;
    match kind {
        CollectiveKind::AllReduce => 2.0 * (n - 1.0) / n,
        CollectiveKind::ReduceScatter | CollectiveKind::AllGather => (n - 1.0) / n,
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

/// Adds one collective's ring-formula traffic to `c`: for a full tensor of `len` elements of
/// `elem_bytes` bytes, reduce-scatter and all-gather send and receive the full buffer minus this
/// rank's shard, all-reduce twice that, broadcast the buffer (received by every non-root, sent by
/// the root once per other rank), barrier nothing.
pub(crate) fn count_traffic(
    c: &mut TrafficCounters,
    kind: CollectiveKind,
    world: usize,
    rank: usize,
    len: usize,
    elem_bytes: usize,
    root: Option<usize>,
) {
    let full = (len * elem_bytes) as u64;
    let shard = (shard_range(len, world, rank).len() * elem_bytes) as u64;
    let (sent, recv) = match kind {
        CollectiveKind::ReduceScatter | CollectiveKind::AllGather => (full - shard, full - shard),
        CollectiveKind::AllReduce => (2 * (full - shard), 2 * (full - shard)),
        CollectiveKind::Broadcast => {
            if root == Some(rank) {
                (full * (world as u64 - 1), 0)
            } else {
                (0, full)
            }
        }
        CollectiveKind::Barrier => (0, 0),
    };
    let k = kind as usize;
    c.sent_bytes[k] += sent;
    c.recv_bytes[k] += recv;
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
        // 10 f32 over 4 ranks: shards 3,3,2,2.
        count_traffic(&mut c, CollectiveKind::ReduceScatter, 4, 0, 10, 4, None);
        assert_eq!(c.sent(CollectiveKind::ReduceScatter), 28);
        count_traffic(&mut c, CollectiveKind::AllReduce, 4, 3, 10, 4, None);
        assert_eq!(c.recv(CollectiveKind::AllReduce), 64);
        count_traffic(&mut c, CollectiveKind::Broadcast, 4, 1, 10, 2, Some(1));
        assert_eq!(c.sent(CollectiveKind::Broadcast), 60);
        assert_eq!(c.recv(CollectiveKind::Broadcast), 0);
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
}
