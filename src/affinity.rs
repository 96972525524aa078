//! Which cores a rank's threads run on: each in-process rank's pool pinned to its own slice of
//! the cores this process may use (its affinity mask), so that a rank's threads stay where its
//! buffers were first touched and two ranks never share a core. Under an MPI launcher the
//! process's mask is the launcher's binding and is left as it is.
//!
//! `ZERODP_PIN=0` turns pinning off (e.g. when something else is running on the same cores).
//! Depends on nothing in the crate.

/// The environment variable that turns pinning off: `ZERODP_PIN=0`.
pub(crate) const PIN_ENV: &str = "ZERODP_PIN";

/// The cores rank `slot` of `ranks` in-process ranks pins its `threads` threads to, in order:
/// the `slot`-th run of `threads` cores of this process's affinity mask. None when pinning is
/// off, the mask cannot be read, or it has fewer than `ranks * threads` cores (the ranks'
/// threads then share the cores as the scheduler sees fit).
pub(crate) fn rank_cores(slot: usize, ranks: usize, threads: usize) -> Option<Vec<usize>> {
    if std::env::var(PIN_ENV).as_deref() == Ok("0") || threads == 0 {
        return None;
    }
    let cores = allowed_cores()?;
    if cores.len() < ranks.checked_mul(threads)? || slot >= ranks {
        return None;
    }
    Some(cores[slot * threads..(slot + 1) * threads].to_vec())
}

/// The cores this process may run on, in increasing order.
pub(crate) fn allowed_cores() -> Option<Vec<usize>> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity writes at most its
        // size, and CPU_ISSET reads within it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
                return None;
            }
            let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
            let cores: Vec<usize> = (0..max).filter(|&c| libc::CPU_ISSET(c, &set)).collect();
            (!cores.is_empty()).then_some(cores)
        }
    }
    #[cfg(not(target_os = "linux"))]
    None
}

/// Pins the calling thread to `core`; false where the system refuses (the thread then runs
/// wherever the process may, as before).
pub(crate) fn pin_current_thread(core: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        if core >= 8 * std::mem::size_of::<libc::cpu_set_t>() {
            return false;
        }
        // SAFETY: as in `allowed_cores`; `core` is inside the set (checked above).
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(core, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = core;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_get_disjoint_runs_of_the_allowed_cores() {
        let Some(all) = allowed_cores() else {
            eprintln!("skipped: the affinity mask cannot be read here");
            return;
        };
        let n = all.len();
        let a = rank_cores(0, 2, n / 2);
        let b = rank_cores(1, 2, n / 2);
        if n >= 2 && std::env::var(PIN_ENV).as_deref() != Ok("0") {
            let (a, b) = (a.unwrap(), b.unwrap());
            assert!(a.iter().all(|c| !b.contains(c)), "{a:?} {b:?}");
            assert!(a.iter().chain(&b).all(|c| all.contains(c)));
        }
        assert_eq!(
            rank_cores(0, n + 1, 1),
            None,
            "more threads than cores: no pinning"
        );
        assert_eq!(rank_cores(2, 2, 1), None, "no slot past the ranks");
    }

    #[test]
    fn a_pinned_thread_runs_on_its_core() {
        let Some(all) = allowed_cores() else {
            return;
        };
        let core = *all.last().unwrap_or(&0);
        let got = std::thread::spawn(move || {
            let pinned = pin_current_thread(core);
            (pinned, allowed_cores())
        })
        .join()
        .unwrap();
        if got.0 {
            assert_eq!(got.1, Some(vec![core]));
        }
    }
}
