//! Byte accounting per kind: parameters, gradients, master weights, optimizer states, buffers.
//!
//! The engine allocates every model-state buffer up front (llm.c style) and reports each allocation
//! and release here, so that a rank can say at any moment what it holds by kind and what its peak
//! was. Activations belong to the model and are not counted: these are the ZeRO "model states".
/// What a block of bytes is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MemoryKind {
    /// Parameters in their compute dtype (full, or the own shard at stage 3).
    Params,
    /// Gradients (full at stages 0-1, the own accumulated shard at stages 2-3).
    Grads,
    /// The fp32 master copy of the own shard, where it is separate from the parameters.
    Master,
    /// Adam's first and second moments.
    OptimizerStates,
    /// Communication buckets and transient per-unit gradient buffers.
    Buffers,
    /// The stage-3 gather pool (gathered parameters of units in use or prefetched).
    Gather,
}

impl MemoryKind {
    pub const ALL: [MemoryKind; 6] = [
        MemoryKind::Params,
        MemoryKind::Grads,
        MemoryKind::Master,
        MemoryKind::OptimizerStates,
        MemoryKind::Buffers,
        MemoryKind::Gather,
    ];
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Params => "params",
            MemoryKind::Grads => "grads",
            MemoryKind::Master => "master",
            MemoryKind::OptimizerStates => "optimizer_states",
            MemoryKind::Buffers => "buffers",
            MemoryKind::Gather => "gather",
        }
    }
}

/// Where bytes are held: the device (what ZeRO's per-rank formulas count and a device budget
/// limits), host memory, or a rank's NVMe swap file (offload).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tier {
    Device,
    Host,
    Nvme,
}

/// Device-tier bytes held now by kind and the peak of their total; host and NVMe tiers as
/// totals (what offload moved out of the device).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryLedger {
    current: [u64; 6],
    peak: [u64; 6],
    peak_total: u64,
    host: u64,
    nvme: u64,
    /// Device-tier bytes [`MemoryLedger::try_alloc_in`] may hold in all.
    budget: Option<u64>,
}

/// A device-tier allocation the budget cannot hold: what was asked, what was free, and what holds
/// the rest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct OverBudget {
    pub asked: u64,
    pub free: u64,
    pub held: ModelStateBytes,
}

impl MemoryLedger {
    pub fn new() -> Self {
        Self::default()
    }
    /// A ledger whose device tier may hold at most `budget` bytes (None: no limit).
    pub(crate) fn with_budget(budget: Option<u64>) -> Self {
        MemoryLedger {
            budget,
            ..Self::default()
        }
    }
    /// Like [`MemoryLedger::alloc_in`], but refuses (recording nothing) a device-tier allocation
    /// beyond the budget.
    pub(crate) fn try_alloc_in(
        &mut self,
        tier: Tier,
        kind: MemoryKind,
        bytes: u64,
    ) -> Result<(), OverBudget> {
        let free = self.budget.map(|b| b.saturating_sub(self.total()));
        if let (Tier::Device, Some(free)) = (tier, free) {
            if bytes > free {
                return Err(OverBudget {
                    asked: bytes,
                    free,
                    held: self.snapshot(),
                });
            }
        }
        self.alloc_in(tier, kind, bytes);
        Ok(())
    }
    /// Record `bytes` more of `kind`.
    pub(crate) fn alloc(&mut self, kind: MemoryKind, bytes: u64) {
        let i = kind as usize;
        self.current[i] += bytes;
        self.peak[i] = self.peak[i].max(self.current[i]);
        self.peak_total = self.peak_total.max(self.total());
    }
    /// Record `bytes` more of `kind` in `tier` (the device tier is [`MemoryLedger::alloc`]).
    pub(crate) fn alloc_in(&mut self, tier: Tier, kind: MemoryKind, bytes: u64) {
        match tier {
            Tier::Device => self.alloc(kind, bytes),
            Tier::Host => self.host += bytes,
            Tier::Nvme => self.nvme += bytes,
        }
    }
    /// Bytes held in the host tier (offloaded out of the device).
    pub fn host(&self) -> u64 {
        self.host
    }
    /// Bytes held in the NVMe tier.
    pub fn nvme(&self) -> u64 {
        self.nvme
    }
    /// Record that `bytes` of `kind` were released. Panics on underflow, which is an engine bug.
    pub fn free(&mut self, kind: MemoryKind, bytes: u64) {
        let i = kind as usize;
        self.current[i] = self.current[i]
            .checked_sub(bytes)
            .unwrap_or_else(|| panic!("memory ledger underflow for {}", kind.name()));
    }
    pub fn current(&self, kind: MemoryKind) -> u64 {
        self.current[kind as usize]
    }
    /// The largest value `kind` ever reached.
    pub(crate) fn peak_of(&self, kind: MemoryKind) -> u64 {
        self.peak[kind as usize]
    }
    pub fn total(&self) -> u64 {
        self.current.iter().sum()
    }
    /// The largest total ever held.
    pub fn peak(&self) -> u64 {
        self.peak_total
    }
    /// A snapshot for reports.
    pub fn snapshot(&self) -> ModelStateBytes {
        let c = |k: MemoryKind| self.current(k);
        ModelStateBytes {
            params: c(MemoryKind::Params),
            grads: c(MemoryKind::Grads),
            master: c(MemoryKind::Master),
            optimizer_states: c(MemoryKind::OptimizerStates),
            buffers: c(MemoryKind::Buffers),
            gather: c(MemoryKind::Gather),
            total: self.total(),
            offloaded_host: self.host,
            offloaded_nvme: self.nvme,
        }
    }
}

/// What a rank holds in the device tier, by kind, in bytes (the `model_state_bytes` object of a
/// metrics line), and what offload holds outside it (present only when non-zero).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelStateBytes {
    pub params: u64,
    pub grads: u64,
    pub master: u64,
    pub optimizer_states: u64,
    pub buffers: u64,
    pub gather: u64,
    pub total: u64,
    /// Host-tier bytes (offloaded master, optimizer states, parameter shards, swap buffers).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub offloaded_host: u64,
    /// NVMe-tier bytes (the swap file).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub offloaded_nvme: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ledger_tracks_current_and_peak() {
        let mut l = MemoryLedger::new();
        l.alloc(MemoryKind::Params, 100);
        l.alloc(MemoryKind::Gather, 50);
        l.free(MemoryKind::Gather, 50);
        l.alloc(MemoryKind::Gather, 20);
        assert_eq!(l.total(), 120);
        assert_eq!(l.peak(), 150);
        assert_eq!(l.peak_of(MemoryKind::Gather), 50);
        let s = l.snapshot();
        assert_eq!((s.params, s.gather, s.total), (100, 20, 120));
    }

    #[test]
    fn a_budget_refuses_device_bytes_beyond_it_and_records_nothing() {
        let mut l = MemoryLedger::with_budget(Some(100));
        l.try_alloc_in(Tier::Device, MemoryKind::Params, 60)
            .unwrap();
        l.try_alloc_in(Tier::Host, MemoryKind::Master, 500).unwrap();
        let over = l
            .try_alloc_in(Tier::Device, MemoryKind::Grads, 41)
            .unwrap_err();
        assert_eq!((over.asked, over.free, over.held.params), (41, 40, 60));
        assert_eq!((l.total(), l.host()), (60, 500));
        l.try_alloc_in(Tier::Device, MemoryKind::Grads, 40).unwrap();
        assert_eq!(l.peak(), 100);
    }

    #[test]
    #[should_panic(expected = "underflow")]
    fn ledger_underflow_is_a_bug() {
        let mut l = MemoryLedger::new();
        l.free(MemoryKind::Grads, 1);
    }
}
