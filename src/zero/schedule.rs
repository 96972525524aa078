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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zero::unit::{ParamSpec, UnitSpec};

    fn tied(n: usize) -> ModelSpec {
        ModelSpec {
            units: (0..n)
                .map(|i| UnitSpec {
                    name: format!("u{i}"),
                    params: vec![ParamSpec {
                        name: format!("p{i}"),
                        shape: vec![4],
                    }],
                    uses: if i == n - 1 { vec![0] } else { vec![] },
                })
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
}
