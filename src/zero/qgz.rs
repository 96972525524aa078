//! ZeRO++'s quantized gradients (qgZ, `zero_quantized_gradients`): stage 3's reduce-scatter of
//! each unit's gradient becomes two all-to-alls of block-wise int8 payloads ([`super::quantize`]),
//! the first within each host and the second across hosts, each reduced in f32 on arrival.
//!
//! The world is `hosts x per_host` ranks numbered host by host; rank `r = n x per_host + l` owns
//! shard `r` of every unit (`S` elements of a padded unit of `world x S`). The first all-to-all
//! sends to local rank `l'` the shards `n' x per_host + l'` of every host `n'` (ZeRO++'s slice
//! reordering), so that after it local rank `l` holds its host's sums of exactly the shards that
//! the ranks `l` of every host own. The second sends each of those sums to its owner: what crosses
//! a host boundary is one quantized `S` per remote host, 1/8 of a plain f32 reduce-scatter's
//! bytes at two hosts. A phase whose group is one rank is skipped (one host: no second phase;
//! one rank per host: no first).
//!
//! The gradient's own buffer holds the partial sums between the phases and the final shard at
//! its place, so the result is handed back exactly as an in-place reduce-scatter's (the average
//! over the world in the rank's shard range). Payloads travel in two 16-bit buffers per unit in
//! flight, sized once for the largest unit ([`payload_elems`]).

use super::quantize::{accumulate_f32, bytes, bytes_mut, payload_elems as quantized_elems};
use crate::comm::{CommError, CommHandle, Communicator, Partition};
use crate::flat::{Buffer, DType};

/// How the world splits into hosts for qgZ's two phases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Hosts {
    pub world: usize,
    /// Ranks per host (a divisor of the world).
    pub per_host: usize,
}

impl Hosts {
    /// `per_host` ranks per host where that splits the world; one host otherwise.
    pub(crate) fn new(world: usize, per_host: Option<usize>) -> Hosts {
        let per_host = per_host
            .filter(|&h| h >= 1 && world % h == 0)
            .unwrap_or(world);
        Hosts { world, per_host }
    }
    fn count(self) -> usize {
        self.world / self.per_host
    }
}

/// 16-bit elements of one payload buffer for a unit of `padded` elements over `world` ranks: a
/// quantized shard per rank.
pub(crate) fn payload_elems(padded: usize, world: usize) -> usize {
    world * quantized_elems(padded / world.max(1))
}

/// Which all-to-all a unit's gradient is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Within,
    Across,
}

/// One unit's gradient in qgZ: its f32 buffer (kept here, not lent to the collective) and the
/// all-to-all in flight, which holds the two payload buffers.
pub(crate) struct Flight {
    pub unit: usize,
    grad: Vec<f32>,
    phase: Phase,
    handle: CommHandle,
}

/// What [`advance`] left: the next phase in flight, or the reduced gradient (this rank's shard
/// at its place) with the payload buffers to reuse.
pub(crate) enum Advanced {
    InFlight(Flight),
    Done {
        unit: usize,
        grad: Vec<f32>,
        payloads: (Buffer, Buffer),
    },
}

/// Quantizes unit `unit`'s full f32 gradient into `payloads.0` in the first phase's order and
/// issues that phase (the second at once where hosts have one rank each).
pub(crate) fn start(
    comm: &dyn Communicator,
    hosts: Hosts,
    unit: usize,
    grad: Vec<f32>,
    payloads: (Buffer, Buffer),
) -> Result<Flight, CommError> {
    let (h, n) = (hosts.per_host, hosts.count());
    if h == 1 {
        // Every rank its own host: the shards are the host's sums already.
        return issue_across(comm, hosts, unit, grad, 0..n, payloads);
    }
    // Chunk l' holds, for every host n', shard n' x h + l': slot l' x n + n'.
    let order = (0..h * n).map(|slot| (slot % n) * h + slot / n);
    let handle = issue(comm, (&grad, hosts), order, Partition::Within(h), payloads);
    Ok(Flight {
        unit,
        grad,
        phase: Phase::Within,
        handle,
    })
}

/// Quantizes the host sums of the shards `owners` (one per host, in host order) into the send
/// payload and issues the all-to-all across hosts.
fn issue_across(
    comm: &dyn Communicator,
    hosts: Hosts,
    unit: usize,
    grad: Vec<f32>,
    owners: impl ExactSizeIterator<Item = usize>,
    payloads: (Buffer, Buffer),
) -> Result<Flight, CommError> {
    let part = Partition::Across(hosts.per_host);
    let handle = issue(comm, (&grad, hosts), owners, part, payloads);
    Ok(Flight {
        unit,
        grad,
        phase: Phase::Across,
        handle,
    })
}

/// Quantizes the gradient's shards `order` one after the other into the send payload (both
/// payloads fitted to that many) and issues the all-to-all within `part`'s groups.
fn issue(
    comm: &dyn Communicator,
    (grad, hosts): (&[f32], Hosts),
    order: impl ExactSizeIterator<Item = usize>,
    part: Partition,
    (mut send, mut recv): (Buffer, Buffer),
) -> CommHandle {
    let shard = grad.len() / hosts.world;
    let each = quantized_elems(shard);
    fit(&mut send, order.len() * each);
    fit(&mut recv, order.len() * each);
    let out = bytes_mut(&mut send);
    for (slot, s) in order.enumerate() {
        let at = slot * each * 2;
        let src = &grad[s * shard..(s + 1) * shard];
        super::quantize::quantize_f32(src, &mut out[at..at + each * 2]);
    }
    comm.all_to_all_group(part, send, recv)
}

/// Waits for a unit's phase, reduces what arrived in f32, and issues the next phase or
/// finishes: the average over the world of this rank's shard sits at its place in the gradient.
pub(crate) fn advance(
    comm: &dyn Communicator,
    hosts: Hosts,
    flight: Flight,
) -> Result<Advanced, CommError> {
    let Flight {
        unit,
        mut grad,
        phase,
        handle,
    } = flight;
    let (send, recv) = handle.wait_pair()?;
    let (h, n, r) = (hosts.per_host, hosts.count(), comm.rank());
    let local = r % h;
    let shard = grad.len() / hosts.world;
    let each = quantized_elems(shard) * 2;
    let arrived = bytes(&recv);
    match phase {
        Phase::Within => {
            // From each local peer l'', chunk l'' holds its quantized shards n' x h + local.
            let owners = (0..n).map(|host| host * h + local);
            for (slot, s) in owners.clone().enumerate() {
                let dst = &mut grad[s * shard..(s + 1) * shard];
                dst.fill(0.0);
                for peer in 0..h {
                    let at = (peer * n + slot) * each;
                    accumulate_f32(&arrived[at..at + each], dst);
                }
            }
            match n {
                1 => Ok(finish(unit, grad, hosts, r, (send, recv))),
                _ => issue_across(comm, hosts, unit, grad, owners, (send, recv))
                    .map(Advanced::InFlight),
            }
        }
        Phase::Across => {
            let dst = &mut grad[r * shard..(r + 1) * shard];
            dst.fill(0.0);
            for from in 0..n {
                accumulate_f32(&arrived[from * each..(from + 1) * each], dst);
            }
            Ok(finish(unit, grad, hosts, r, (send, recv)))
        }
    }
}

/// The sum over the world in rank `r`'s shard becomes the average, as `ReduceOp::Avg`.
fn finish(
    unit: usize,
    mut grad: Vec<f32>,
    hosts: Hosts,
    r: usize,
    payloads: (Buffer, Buffer),
) -> Advanced {
    let shard = grad.len() / hosts.world;
    let inv = 1.0 / hosts.world as f32;
    grad[r * shard..(r + 1) * shard]
        .iter_mut()
        .for_each(|v| *v *= inv);
    Advanced::Done {
        unit,
        grad,
        payloads,
    }
}

/// Sets a payload buffer's length to `elems` within the capacity it was allocated with (the
/// largest unit's), so no collective allocates.
fn fit(buf: &mut Buffer, elems: usize) {
    if buf.len() > elems {
        buf.truncate(elems);
    } else if buf.len() < elems {
        buf.resize_zeroed(elems);
    }
}

/// A send and a receive payload buffer of `elems` 16-bit elements each ([`payload_elems`]).
pub(crate) fn payload_pair(elems: usize) -> (Buffer, Buffer) {
    (
        Buffer::zeros(DType::F16, elems),
        Buffer::zeros(DType::F16, elems),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{run_ranks, CommOptions};

    /// Rank `r`'s gradient: smooth, sign-varied, with one large element per block.
    fn grad(r: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let x = ((i * 7 + r * 131) as f32 * 0.013).sin() * 0.02;
                if (i + r) % 977 == 0 {
                    x * 20.0
                } else {
                    x
                }
            })
            .collect()
    }

    /// Runs qgZ's phases on every rank of `world` ranks in hosts of `per_host` and compares each
    /// rank's shard with the exact average.
    fn check(world: usize, per_host: Option<usize>) {
        let shard = 3 * super::super::quantize::BLOCK + 17;
        let len = world * shard;
        let options = CommOptions {
            ranks_per_host: per_host,
            ..CommOptions::default()
        };
        let hosts = Hosts::new(world, per_host);
        let out = run_ranks(world, options, |comm, r| {
            let pair = payload_pair(payload_elems(len, world));
            let mut flight = start(&*comm, hosts, 7, grad(r, len), pair)?;
            loop {
                match advance(&*comm, hosts, flight)? {
                    Advanced::InFlight(next) => flight = next,
                    Advanced::Done { unit, grad, .. } => {
                        assert_eq!(unit, 7);
                        return Ok::<_, CommError>((
                            grad[r * shard..(r + 1) * shard].to_vec(),
                            comm.traffic(),
                        ));
                    }
                }
            }
        })
        .unwrap();
        let grads: Vec<Vec<f32>> = (0..world).map(|k| grad(k, len)).collect();
        // Each rank's value and each host's sum are rounded once, by at most half a step of
        // 1/127 of its block's peak: at most the largest gradient element / 127 in all.
        let peak = grads.iter().flatten().fold(0.0f32, |m, v| m.max(v.abs()));
        for (r, (got, traffic)) in out.iter().enumerate() {
            let exact: Vec<f32> = (0..shard)
                .map(|i| grads.iter().map(|g| g[r * shard + i]).sum::<f32>() / world as f32)
                .collect();
            let err: Vec<f32> = exact.iter().zip(got).map(|(e, g)| (e - g).abs()).collect();
            let max = err.iter().fold(0.0f32, |m, &v| m.max(v));
            let rms = (err.iter().map(|e| e * e).sum::<f32>() / shard as f32).sqrt();
            let case = format!("world {world} hosts of {per_host:?} rank {r}");
            let (rel_max, rel_rms) = super::super::quantize::relative_error(&exact, got);
            eprintln!(
                "{case}: qgZ reduce-scatter against f32: max {max:.3e} rms {rms:.3e} \
                 (relative to the exact shard's peak: max {rel_max:.3e} rms {rel_rms:.3e})"
            );
            assert!(max <= peak / 127.0 * 1.001, "{case}: {max} vs {peak}");
            assert!(rms < peak / 127.0 / 4.0, "{case}: rms {rms}");
            assert!(max > 0.0, "{case}: quantized, so not exact");
            // Across hosts, a rank sends a quantized shard to each other host, nothing more.
            let h = hosts.per_host;
            let crossing = (world / h - 1) * quantized_elems(shard) * 2;
            let want = if per_host.is_some() {
                crossing as u64
            } else {
                0
            };
            assert_eq!(traffic.inter_host_sent(), want, "world {world} rank {r}");
        }
    }

    #[test]
    fn the_two_phases_give_each_rank_its_averaged_shard_within_the_int8_step() {
        check(4, Some(2));
        check(6, Some(3));
        check(6, Some(2));
        check(4, Some(1));
        check(3, None);
        check(2, Some(2));
    }
}
