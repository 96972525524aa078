//! The static order of a training step, derived from the model's units and their `uses` alone, so
//! that every rank issues the same collectives in the same order without talking about it.
//!
//! A micro-step visits units forward `0..U` then backward `U-1..=0`; each visit needs the unit's own
//! parameters and those of the units it [`uses`](crate::zero::unit::UnitSpec::uses). A tied unit's
//! gradient is complete only after the backward of its last user, so its reduction waits for that.

use crate::zero::unit::ModelSpec;

/// Forward or backward visit of a unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Forward,
    Backward,
}

/// One visit of a unit in the step's sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Visit {
    pub unit: usize,
    pub pass: Pass,
    /// Units whose parameters must be gathered: the unit itself, then its `uses`.
    pub needs: Vec<usize>,
}

/// The units that a visit reads (the unit, then its `uses`, in the order the model expects).
pub(crate) fn needs_of(spec: &ModelSpec, unit: usize) -> Vec<usize> {
    let mut v = vec![unit];
    v.extend(spec.units[unit].uses.iter().copied().filter(|&u| u != unit));
    v
}

/// The visits of `micro_steps` micro-steps, in execution order.
pub fn visits(spec: &ModelSpec, micro_steps: usize) -> Vec<Visit> {
    let n = spec.units.len();
    let mut out = Vec::with_capacity(2 * n * micro_steps);
    for _ in 0..micro_steps {
        for u in 0..n {
            out.push(Visit {
                unit: u,
                pass: Pass::Forward,
                needs: needs_of(spec, u),
            });
        }
        for u in (0..n).rev() {
            out.push(Visit {
                unit: u,
                pass: Pass::Backward,
                needs: needs_of(spec, u),
            });
        }
    }
    out
}

/// The units each of `visits` must have gathered at stage 3: the visit's `needs`, except for the
/// backward of a unit whose forward graph was kept (`kept_graph[unit] > 0`, see
/// [`kept_graph_elems`](super::buffers::kept_graph_elems)), which needs nothing gathered.
pub(crate) fn gather_needs(visits: &[Visit], kept_graph: &[usize]) -> Vec<Vec<usize>> {
    visits
        .iter()
        .map(|v| match (v.pass, kept_graph[v.unit] > 0) {
            (Pass::Backward, true) => Vec::new(),
            _ => v.needs.clone(),
        })
        .collect()
}

/// For each unit k, the units whose gradients become complete once the backward of unit k is done.
/// Backward runs from the last unit to the first, so a unit is complete after the backward of the
/// lowest-indexed unit among itself and its users.
pub(crate) fn complete_after(spec: &ModelSpec) -> Vec<Vec<usize>> {
    let n = spec.units.len();
    let mut last_touch: Vec<usize> = (0..n).collect();
    for (user, u) in spec.units.iter().enumerate() {
        for &owner in &u.uses {
            last_touch[owner] = last_touch[owner].min(user);
        }
    }
    let mut out = vec![Vec::new(); n];
    // Descending owner order inside a visit keeps the reduction order equal to backward order.
    for owner in (0..n).rev() {
        out[last_touch[owner]].push(owner);
    }
    out
}

/// The largest number of units whose full gradients are held at once during a backward when each
/// unit's gradient is released as soon as it is complete (stages 2 and 3).
pub(crate) fn max_grads_held(spec: &ModelSpec) -> usize {
    let n = spec.units.len();
    let done = complete_after(spec);
    let mut held = vec![false; n];
    let mut count = 0;
    let mut peak = 0;
    for k in (0..n).rev() {
        for u in needs_of(spec, k) {
            if !held[u] {
                held[u] = true;
                count += 1;
            }
        }
        peak = peak.max(count);
        for &u in &done[k] {
            held[u] = false;
            count -= 1;
        }
    }
    peak
}

/// The transient gradient buffers a backward needs, and which of them each unit's gradient is
/// written into, when each unit takes its buffer just before the first backward that writes its
/// gradient and gives it back as soon as the gradient is complete, every give before the next
/// take. The backward is replayed: a unit takes the smallest free buffer that holds its gradient
/// (`sizes[u]` elements), else the largest free one, grown to hold it, else a new one. WHY: sized
/// as [`max_grads_held`] buffers of the largest unit, a tied token embedding held through the
/// whole backward made every block's buffer as large as the embedding.
pub(crate) fn grad_buffers(spec: &ModelSpec, sizes: &[usize]) -> (Vec<usize>, Vec<usize>) {
    let n = spec.units.len();
    let done = complete_after(spec);
    let mut capacity: Vec<usize> = Vec::new();
    let mut free: Vec<usize> = Vec::new();
    let mut held = vec![false; n];
    let mut buffer_of = vec![0; n];
    for k in (0..n).rev() {
        for u in needs_of(spec, k) {
            if std::mem::replace(&mut held[u], true) {
                continue;
            }
            let fits = free.iter().filter(|&&b| capacity[b] >= sizes[u]);
            let b = match fits.min_by_key(|&&b| capacity[b]) {
                Some(&b) => b,
                None => match free.iter().max_by_key(|&&b| capacity[b]) {
                    Some(&b) => b,
                    None => {
                        capacity.push(0);
                        capacity.len() - 1
                    }
                },
            };
            capacity[b] = capacity[b].max(sizes[u]);
            free.retain(|&f| f != b);
            buffer_of[u] = b;
        }
        for &u in &done[k] {
            held[u] = false;
            free.push(buffer_of[u]);
        }
    }
    (capacity, buffer_of)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zero::unit::test_unit;

    fn tied(n: usize) -> ModelSpec {
        ModelSpec {
            units: (0..n)
                .map(|i| test_unit(i, 4, if i == n - 1 { vec![0] } else { vec![] }))
                .collect(),
        }
    }

    #[test]
    fn tied_owner_completes_after_its_own_backward() {
        let s = tied(4);
        let c = complete_after(&s);
        assert_eq!(c, vec![vec![0], vec![1], vec![2], vec![3]]);
        assert_eq!(max_grads_held(&s), 2);
        let v = visits(&s, 1);
        assert_eq!(v.len(), 8);
        assert_eq!(v[3].needs, vec![3, 0]);
        assert_eq!(
            v[4],
            Visit {
                unit: 3,
                pass: Pass::Backward,
                needs: vec![3, 0]
            }
        );
    }

    #[test]
    fn a_backward_user_delays_completion() {
        // Unit 0 uses unit 2: unit 2's gradient is complete only after unit 0's backward.
        let mut s = tied(3);
        s.units[2].uses.clear();
        s.units[0].uses = vec![2];
        let c = complete_after(&s);
        assert_eq!(c, vec![vec![2, 0], vec![1], vec![]]);
        assert_eq!(max_grads_held(&s), 2);
    }

    #[test]
    fn a_tied_embedding_holds_a_buffer_of_its_own_and_the_blocks_share_one() {
        // An embedding of 1000, three blocks of 100, a head of 10 reading the embedding.
        let s = tied(5);
        let (capacity, buffer_of) = grad_buffers(&s, &[1000, 100, 100, 100, 10]);
        assert_eq!(capacity, vec![100, 1000]);
        assert_eq!(buffer_of, vec![1, 0, 0, 0, 0]);
        // Untied, with the largest unit last in backward: one buffer, grown to it.
        let mut untied = tied(5);
        untied.units[4].uses.clear();
        assert_eq!(
            grad_buffers(&untied, &[1000, 100, 100, 100, 10]).0,
            vec![1000]
        );
    }

    #[test]
    fn gradients_held_at_once_never_share_a_buffer_and_always_fit_it() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = |m: usize| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as usize % m
        };
        for _ in 0..200 {
            let n = 2 + next(8);
            let mut s = tied(n);
            for u in 0..n {
                s.units[u].uses = (0..n).filter(|&o| o != u && next(6) == 0).collect();
            }
            let sizes: Vec<usize> = (0..n).map(|_| 1 + next(1000)).collect();
            let (capacity, buffer_of) = grad_buffers(&s, &sizes);
            let largest = sizes.iter().max().copied().unwrap_or(0);
            assert!(capacity.iter().sum::<usize>() <= max_grads_held(&s) * largest);
            // Replay the backward: the gradients held at once have distinct buffers that fit.
            let done = complete_after(&s);
            let mut held: Vec<usize> = Vec::new();
            for k in (0..n).rev() {
                for u in needs_of(&s, k) {
                    if !held.contains(&u) {
                        assert!(capacity[buffer_of[u]] >= sizes[u]);
                        assert!(held.iter().all(|&h| buffer_of[h] != buffer_of[u]));
                        held.push(u);
                    }
                }
                held.retain(|u| !done[k].contains(u));
            }
        }
    }
}
