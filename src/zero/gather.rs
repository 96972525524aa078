//! Stage 3: the parameter fetch/release coordinator and its bounded gather pool.
//!
//! Between uses a rank holds only its parameter shards. The step's visits (see
//! [`schedule`](super::schedule)) are known in advance, so the coordinator all-gathers each visit's
//! units just before it runs, prefetches the following visits' units while it computes (up to
//! `prefetch_bucket_size` elements ahead) and releases units the next visits do not need. Units under
//! the persistence threshold stay gathered until the optimizer step changes them.
//!
//! Every fetch, demand or prefetch, must fit in the pool (`max_live_parameters`, raised to the
//! largest working set): a prefetch that does not fit waits for a later visit, and because prefetches
//! are issued strictly in visit order a demand fetch always fits. Gathered buffers are slabs recycled
//! through the pool, so steady-state steps allocate nothing. Under `offload_param` to NVMe a
//! fetch also needs one of the [`ShardStore`]'s staging buffers (the shard read from the swap
//! file travels in it): a prefetch waits for a free one, and there are at least as many as a
//! visit needs units, so a demand fetch always finds one.

use super::layout::FlatLayout;
use super::quantize;
use super::shards::ShardStore;
use crate::comm::{shard_range, CommError, CommHandle, Communicator, Partition};
use crate::flat::{Buffer, DType};
use crate::memory::accounting::{MemoryKind, MemoryLedger};
use crate::offload::OffloadError;

/// A gather failed: its collective, or reading its shard from the parameter swap file.
#[derive(Debug, thiserror::Error)]
pub enum GatherError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Offload(#[from] OffloadError),
}

/// Recycled gathered-parameter slabs whose capacities never add up to more than `limit` elements.
#[derive(Debug)]
pub(crate) struct GatherPool {
    limit: usize,
    /// The parameters' dtype: slabs hold gathered parameters as they travel.
    dtype: DType,
    free: Vec<Buffer>,
    /// Elements of every slab in existence, free or in use.
    held: usize,
}

impl GatherPool {
    pub fn new(limit: usize, dtype: DType) -> Self {
        GatherPool {
            limit,
            dtype,
            free: Vec::new(),
            held: 0,
        }
    }
    /// A slab of `len` elements (contents unspecified). Only a free slab of exactly that size is
    /// reused (units recur with the same sizes every step, so this is the common case), so the slabs
    /// in use add up to exactly the live elements, which the coordinator keeps within the limit;
    /// free slabs are dropped when a new one is needed to keep to it.
    fn take(&mut self, len: usize, ledger: &mut MemoryLedger) -> Buffer {
        let size = self.dtype.size() as u64;
        if let Some(i) = self.free.iter().position(|v| v.capacity() == len) {
            let mut v = self.free.swap_remove(i);
            v.resize_zeroed(len);
            return v;
        }
        while self.held + len > self.limit {
            let Some(v) = self.free.pop() else { break };
            self.held -= v.capacity();
            ledger.free(MemoryKind::Gather, v.capacity() as u64 * size);
        }
        assert!(
            self.held + len <= self.limit,
            "gather pool over its limit: {} + {} > {} elements",
            self.held,
            len,
            self.limit
        );
        let v = Buffer::zeros(self.dtype, len);
        self.held += v.capacity();
        ledger.alloc(MemoryKind::Gather, v.capacity() as u64 * size);
        v
    }
    fn give(&mut self, v: Buffer) {
        self.free.push(v);
    }
}

/// Whether unit `unit`, used by visit `pos`, stays gathered after it: persistent units do, and so do
/// units the next visit needs (the last unit from its forward into its backward, a tied unit
/// between its users); every other unit is released (FSDP2's reshard after forward).
pub(crate) fn stays_gathered(
    needs: &[Vec<usize>],
    persistent: &[bool],
    pos: usize,
    unit: usize,
) -> bool {
    persistent[unit] || needs.get(pos + 1).is_some_and(|n| n.contains(&unit))
}

enum Residency {
    Released,
    /// The gather is in flight; the shard travels inside it (a primary gather's) or its
    /// secondary copy was written into the slab (hpZ).
    InFlight(CommHandle, Source),
    Ready(Buffer),
}

/// Where a gather's shards come from.
enum Source {
    /// The ranks' own shards, over the whole world.
    Primary,
    /// hpZ's secondary shards, within this rank's host.
    Secondary,
    /// qwZ: the ranks' own shards as block-wise int8, widened on arrival into this slab.
    Quantized(Buffer),
}

/// ZeRO++'s quantized weights (qwZ): the primary gathers carry the shards of `world` ranks as
/// int8 payloads ([`quantize`]), in buffers recycled through `payloads`.
struct QuantizedGathers {
    world: usize,
    payloads: GatherPool,
}

/// ZeRO++'s hierarchical partitioning (hpZ): a second shard of every unit held within each
/// host. A unit's first gather of a step crosses hosts as always, and leaves each rank its slice
/// of the unit over its host's ranks; the step's later gathers of that unit (backward, and a
/// recomputation) gather those slices within the host, where the bytes move over shared memory
/// rather than the network. The gathered parameters are the first gather's bits, so training is
/// bit for bit plain stage 3's. The slices cost the unit's size over the ranks per host, for
/// every unit that is gathered and released (DeepSpeed's hpZ holds the same).
pub(crate) struct Secondary {
    /// Ranks per host: the groups are `Partition::Within(per_host)`.
    per_host: usize,
    /// This rank's index in its host group.
    index: usize,
    /// Per unit, this rank's slice (empty for persistent units, which stay gathered).
    slices: Vec<Buffer>,
    /// The slice holds this step's parameters: set by the unit's first gather of the step.
    fresh: Vec<bool>,
}

impl Secondary {
    /// Slices of `ranks_per_host`-rank hosts for the non-persistent units of `padded` sizes, on
    /// rank `rank` (hpZ on: [`crate::zero::EngineConfig::hpz_active`]).
    pub(crate) fn new(
        rank: usize,
        ranks_per_host: usize,
        padded: &[usize],
        persistent: &[bool],
        dtype: DType,
    ) -> Secondary {
        let mut sec = Secondary {
            per_host: ranks_per_host,
            index: Partition::Within(ranks_per_host).index(rank),
            slices: Vec::with_capacity(padded.len()),
            fresh: vec![false; padded.len()],
        };
        for (&len, &keep) in padded.iter().zip(persistent) {
            let elems = if keep { 0 } else { sec.range(len).len() };
            sec.slices.push(Buffer::zeros(dtype, elems));
        }
        sec
    }

    /// This rank's slice of a unit of `len` (padded) elements.
    fn range(&self, len: usize) -> std::ops::Range<usize> {
        shard_range(len, self.per_host, self.index)
    }
}

/// Gathers, prefetches and releases the units of a stage-3 step.
pub struct Coordinator {
    /// The rank's parameter shard of every unit (in memory, empty while its gather is in flight,
    /// or in the parameter swap file).
    shards: ShardStore,
    residency: Vec<Residency>,
    persistent: Vec<bool>,
    padded: Vec<usize>,
    pool: GatherPool,
    /// Padded elements of units in flight or ready.
    live: usize,
    prefetch_limit: usize,
    /// Units needed by each visit of the step.
    needs: Vec<Vec<usize>>,
    /// Every visit before this one has all its units issued.
    issued_upto: usize,
    /// hpZ's secondary shards, where it is on (boxed: most runs have none).
    secondary: Option<Box<Secondary>>,
    /// qwZ's state, where it is on (boxed: most runs have none).
    quantized: Option<Box<QuantizedGathers>>,
}

impl Coordinator {
    pub fn new(
        shards: ShardStore,
        layout: &FlatLayout,
        persistent: Vec<bool>,
        pool_elems: usize,
        prefetch_limit: usize,
        needs: Vec<Vec<usize>>,
    ) -> Self {
        let n = layout.num_units();
        let dtype = shards.dtype();
        Coordinator {
            shards,
            residency: (0..n).map(|_| Residency::Released).collect(),
            persistent,
            padded: layout.units.iter().map(|u| u.padded).collect(),
            pool: GatherPool::new(pool_elems, dtype),
            live: 0,
            prefetch_limit,
            needs,
            issued_upto: 0,
            secondary: None,
            quantized: None,
        }
    }

    /// Turns qwZ on for a world of `world` ranks: payload buffers up to the pool's limit.
    pub(crate) fn with_quantized_weights(mut self, world: usize) -> Self {
        // A unit's payloads (its shard's and the gathered ones) are about half its 16-bit
        // elements; twice the pool's limit can never be reached.
        let limit = 2 * self.pool.limit;
        let payloads = GatherPool::new(limit, DType::F16);
        self.quantized = Some(Box::new(QuantizedGathers { world, payloads }));
        self
    }

    /// Bytes of hpZ's secondary shards (0 where it is off).
    pub(crate) fn secondary_bytes(&self) -> u64 {
        self.secondary
            .as_ref()
            .map_or(0, |s| s.slices.iter().map(|b| b.bytes() as u64).sum())
    }

    /// Turns hpZ on with `secondary`'s shards.
    pub(crate) fn with_secondary(mut self, secondary: Option<Secondary>) -> Self {
        self.secondary = secondary.map(Box::new);
        self
    }

    /// The shards, for the optimizer step and restores. Only valid after
    /// [`Coordinator::invalidate`] (every shard home).
    pub(crate) fn shards_mut(&mut self) -> &mut ShardStore {
        debug_assert!(self
            .residency
            .iter()
            .all(|r| matches!(r, Residency::Released)));
        &mut self.shards
    }
    pub fn shards(&self) -> &ShardStore {
        &self.shards
    }

    /// The gathered parameters of `unit` (padded), which must be ready.
    pub fn params(&self, unit: usize) -> &Buffer {
        match &self.residency[unit] {
            Residency::Ready(v) => v,
            _ => panic!("unit {unit} used while not gathered"),
        }
    }

    fn issue(
        &mut self,
        comm: &dyn Communicator,
        unit: usize,
        ledger: &mut MemoryLedger,
    ) -> Result<(), OffloadError> {
        let len = self.padded[unit];
        let from_host = self.secondary.as_ref().filter(|s| s.fresh[unit]);
        let flight = match from_host {
            Some(sec) => {
                let mut out = self.pool.take(len, ledger);
                out.write_at(sec.range(len).start, &sec.slices[unit]);
                let h = comm.all_gather_group_in_place(Partition::Within(sec.per_host), out);
                Residency::InFlight(h, Source::Secondary)
            }
            None => match self.quantized.as_deref_mut() {
                Some(QuantizedGathers { world, payloads }) => {
                    let shard = self.shards.take(unit)?;
                    let each = quantize::payload_elems(shard.len());
                    let mut send = payloads.take(each, ledger);
                    quantize::quantize_into(&shard, &mut send);
                    self.shards.give_back(unit, shard);
                    let recv = payloads.take(each * *world, ledger);
                    let slab = self.pool.take(len, ledger);
                    let h = comm.all_gather(send, recv);
                    Residency::InFlight(h, Source::Quantized(slab))
                }
                None => {
                    let shard = self.shards.take(unit)?;
                    let out = self.pool.take(len, ledger);
                    Residency::InFlight(comm.all_gather(shard, out), Source::Primary)
                }
            },
        };
        self.residency[unit] = flight;
        self.live += len;
        Ok(())
    }

    fn wait(&mut self, unit: usize) -> Result<(), CommError> {
        if let Residency::InFlight(..) = self.residency[unit] {
            let Residency::InFlight(h, source) =
                std::mem::replace(&mut self.residency[unit], Residency::Released)
            else {
                unreachable!()
            };
            let full = match source {
                Source::Secondary => h.wait_one()?,
                Source::Primary => {
                    let (shard, full) = h.wait_pair()?;
                    self.shards.give_back(unit, shard);
                    self.keep_secondary(unit, &full);
                    full
                }
                Source::Quantized(mut slab) => {
                    let (send, recv) = h.wait_pair()?;
                    if let Some(QuantizedGathers { world, payloads }) =
                        self.quantized.as_deref_mut()
                    {
                        let shard = slab.len() / *world;
                        quantize::dequantize_gathered(&recv, shard, &mut slab);
                        payloads.give(send);
                        payloads.give(recv);
                    }
                    self.keep_secondary(unit, &slab);
                    slab
                }
            };
            self.residency[unit] = Residency::Ready(full);
        }
        Ok(())
    }

    /// hpZ: after a unit's first gather of the step, keep this rank's slice of it for the later
    /// gathers within the host.
    fn keep_secondary(&mut self, unit: usize, full: &Buffer) {
        let Some(sec) = &mut self.secondary else {
            return;
        };
        let range = sec.range(full.len());
        let slice = &mut sec.slices[unit];
        if !slice.is_empty() {
            slice.copy_from_range(full, range);
            sec.fresh[unit] = true;
        }
    }

    /// Make visit `pos`'s units ready, and prefetch what fits for the following visits.
    pub fn acquire(
        &mut self,
        pos: usize,
        comm: &dyn Communicator,
        ledger: &mut MemoryLedger,
    ) -> Result<(), GatherError> {
        for i in 0..self.needs[pos].len() {
            let u = self.needs[pos][i];
            if matches!(self.residency[u], Residency::Released) {
                self.issue(comm, u, ledger)?;
            }
        }
        self.issued_upto = self.issued_upto.max(pos + 1);
        self.prefetch(pos, comm, ledger)?;
        self.read_ahead();
        for i in 0..self.needs[pos].len() {
            let u = self.needs[pos][i];
            self.wait(u)?;
        }
        Ok(())
    }

    /// Issue gathers for the visits after `pos`, in order, while they fit the prefetch limit, the
    /// pool and the free staging buffers; stop at the first unit that does not fit.
    fn prefetch(
        &mut self,
        pos: usize,
        comm: &dyn Communicator,
        ledger: &mut MemoryLedger,
    ) -> Result<(), OffloadError> {
        let mut ahead: usize = (0..self.residency.len())
            .filter(|&u| {
                !matches!(self.residency[u], Residency::Released)
                    && !self.persistent[u]
                    && !self.needs[pos].contains(&u)
            })
            .map(|u| self.padded[u])
            .sum();
        while self.issued_upto < self.needs.len() {
            let j = self.issued_upto;
            for i in 0..self.needs[j].len() {
                let u = self.needs[j][i];
                if !matches!(self.residency[u], Residency::Released) {
                    continue;
                }
                let size = self.padded[u];
                if ahead + size > self.prefetch_limit
                    || self.live + size > self.pool.limit
                    || !self.shards.can_take(u)
                {
                    return Ok(());
                }
                self.issue(comm, u, ledger)?;
                ahead += size;
            }
            self.issued_upto = j + 1;
        }
        Ok(())
    }

    /// Under NVMe parameter offload, start reading the shard of the next unit to be gathered (the
    /// first released unit of the visits not yet issued), so that the read overlaps this visit.
    fn read_ahead(&mut self) {
        let next = self.needs[self.issued_upto.min(self.needs.len())..]
            .iter()
            .flatten()
            .find(|&&u| matches!(self.residency[u], Residency::Released));
        if let Some(&u) = next {
            self.shards.read_ahead(u);
        }
    }

    /// Release visit `pos`'s units unless they persist or the next visit needs them (FSDP2's
    /// reshard after forward: backward gathers again). A released unit that a later, already
    /// prefetched visit needs sends the prefetch horizon back to that visit, so that every visit
    /// before the horizon always has all its units gathered or in flight.
    pub fn release(&mut self, pos: usize) {
        for i in 0..self.needs[pos].len() {
            let u = self.needs[pos][i];
            if stays_gathered(&self.needs, &self.persistent, pos, u) {
                continue;
            }
            self.drop_unit(u);
            if let Some(j) = (pos + 2..self.issued_upto).find(|&j| self.needs[j].contains(&u)) {
                self.issued_upto = j;
            }
        }
    }

    fn drop_unit(&mut self, unit: usize) {
        if let Residency::Ready(v) =
            std::mem::replace(&mut self.residency[unit], Residency::Released)
        {
            self.pool.give(v);
            self.live -= self.padded[unit];
        }
    }

    /// Evaluation, outside the step's plan: gather `units` now (no prefetch). Every rank calls it
    /// for the same units in the same order, since each gather is a collective.
    pub(crate) fn gather_now(
        &mut self,
        units: &[usize],
        comm: &dyn Communicator,
        ledger: &mut MemoryLedger,
    ) -> Result<(), GatherError> {
        for &u in units {
            if matches!(self.residency[u], Residency::Released) {
                self.issue(comm, u, ledger)?;
            }
        }
        for &u in units {
            self.wait(u)?;
        }
        Ok(())
    }

    /// Evaluation: release `units` unless they persist ([`Coordinator::invalidate`] ends it).
    pub(crate) fn release_now(&mut self, units: &[usize]) {
        for &u in units {
            if !self.persistent[u] {
                self.drop_unit(u);
            }
        }
    }

    /// Release everything (the parameters are about to change) and start the next step's visits.
    pub(crate) fn invalidate(&mut self) -> Result<(), CommError> {
        for u in 0..self.residency.len() {
            self.wait(u)?;
            self.drop_unit(u);
        }
        self.shards.settle();
        self.issued_upto = 0;
        if let Some(sec) = &mut self.secondary {
            // The parameters are about to change: the next step's first gathers cross hosts.
            sec.fresh.fill(false);
        }
        Ok(())
    }
}
