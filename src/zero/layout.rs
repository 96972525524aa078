//! Flat buffers and their partition (FSDP2-style per-unit sharding).
//!
//! Each unit's parameters live in one contiguous flat buffer in [`UnitSpec`](crate::zero::unit::UnitSpec) order, padded with
//! zeros to a multiple of `world_size * SHARD_ALIGN` elements and split into `world_size` equal
//! shards: rank r owns shard r of every unit. So one unit costs exactly one all-gather and one
//! reduce-scatter, and every shard starts on an aligned element.

use crate::comm::shard_range;
use crate::zero::unit::ModelSpec;
use std::ops::Range;

/// Every shard is a multiple of this many elements (32 bytes of f32, 16-bit friendly too).
pub(crate) const SHARD_ALIGN: usize = 8;

/// The sizes of one unit's flat buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitLayout {
    /// Elements the model uses.
    pub numel: usize,
    /// Elements after padding (`shard_len * world_size`).
    pub padded: usize,
    /// Elements per shard.
    pub shard_len: usize,
}

/// The flat layout of a model on one rank of a world.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatLayout {
    pub world_size: usize,
    pub rank: usize,
    pub units: Vec<UnitLayout>,
    /// Offset of each unit's shard in a rank's concatenated shard buffers (Adam states, gradient
    /// shards).
    pub shard_offsets: Vec<usize>,
    /// Offset of each unit in a concatenation of the padded unit buffers.
    pub padded_offsets: Vec<usize>,
}

impl FlatLayout {
    pub fn new(spec: &ModelSpec, world_size: usize, rank: usize) -> Self {
        assert!(
            world_size > 0 && rank < world_size,
            "rank {rank} out of world {world_size}"
        );
        let quantum = world_size * SHARD_ALIGN;
        let units: Vec<UnitLayout> = spec
            .units
            .iter()
            .map(|u| {
                let numel = u.numel();
                let padded = numel.div_ceil(quantum) * quantum;
                UnitLayout {
                    numel,
                    padded,
                    shard_len: padded / world_size,
                }
            })
            .collect();
        let prefix = |f: fn(&UnitLayout) -> usize| {
            let mut off = 0;
            units
                .iter()
                .map(|u| {
                    let o = off;
                    off += f(u);
                    o
                })
                .collect::<Vec<_>>()
        };
        let shard_offsets = prefix(|u| u.shard_len);
        let padded_offsets = prefix(|u| u.padded);
        FlatLayout {
            world_size,
            rank,
            units,
            shard_offsets,
            padded_offsets,
        }
    }

    /// Elements of the longest shard of any unit (0 without units).
    pub fn longest_shard(&self) -> usize {
        self.units.iter().map(|u| u.shard_len).max().unwrap_or(0)
    }
    pub fn num_units(&self) -> usize {
        self.units.len()
    }
    /// Ψ: parameters the model uses.
    pub fn numel(&self) -> usize {
        self.units.iter().map(|u| u.numel).sum()
    }
    /// Ψ plus padding: the size of all full flat buffers together.
    pub fn padded_numel(&self) -> usize {
        self.units.iter().map(|u| u.padded).sum()
    }
    /// Elements of all of this rank's shards together (`padded_numel / world_size`).
    pub(crate) fn shard_numel(&self) -> usize {
        self.units.iter().map(|u| u.shard_len).sum()
    }
    /// The range of unit `unit`'s flat buffer that rank `rank` owns.
    pub(crate) fn shard_of(&self, unit: usize, rank: usize) -> Range<usize> {
        let u = &self.units[unit];
        let r = shard_range(u.padded, self.world_size, rank);
        debug_assert_eq!(r.len(), u.shard_len);
        r
    }
    /// The range of unit `unit`'s flat buffer that this rank owns.
    pub fn own_shard(&self, unit: usize) -> Range<usize> {
        self.shard_of(unit, self.rank)
    }
    /// The range of this rank's concatenated shard buffers that holds unit `unit`'s shard.
    pub(crate) fn shard_slot(&self, unit: usize) -> Range<usize> {
        let o = self.shard_offsets[unit];
        o..o + self.units[unit].shard_len
    }
    /// The largest padded unit.
    pub fn largest_padded(&self) -> usize {
        self.units.iter().map(|u| u.padded).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zero::unit::{ParamSpec, UnitSpec};

    fn spec(sizes: &[usize]) -> ModelSpec {
        ModelSpec {
            units: sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| UnitSpec {
                    name: format!("u{i}"),
                    params: vec![ParamSpec {
                        name: format!("u{i}.w"),
                        shape: vec![n],
                    }],
                    uses: vec![],
                })
                .collect(),
        }
    }

    #[test]
    fn units_pad_to_aligned_equal_shards() {
        let l = FlatLayout::new(&spec(&[10, 64, 1]), 3, 1);
        assert_eq!(
            l.units[0],
            UnitLayout {
                numel: 10,
                padded: 24,
                shard_len: 8
            }
        );
        assert_eq!(
            l.units[1],
            UnitLayout {
                numel: 64,
                padded: 72,
                shard_len: 24
            }
        );
        assert_eq!(l.units[2].padded, 24);
        assert_eq!(l.own_shard(1), 24..48);
        assert_eq!(l.shard_slot(1), 8..32);
        assert_eq!(l.shard_numel() * 3, l.padded_numel());
        assert_eq!(l.numel(), 75);
    }

    #[test]
    fn shards_tile_every_unit() {
        for world in 1..=5 {
            let l = FlatLayout::new(&spec(&[1, 17, 100]), world, 0);
            for u in 0..3 {
                let mut next = 0;
                for r in 0..world {
                    let s = l.shard_of(u, r);
                    assert_eq!(s.start, next);
                    assert_eq!(s.len(), l.units[u].shard_len);
                    assert_eq!(s.start % SHARD_ALIGN, 0);
                    next = s.end;
                }
                assert_eq!(next, l.units[u].padded);
            }
        }
    }
}
