//! The meeting point of the in-process ranks: a reusable barrier that also publishes each rank's
//! buffer addresses, checks that every rank issued the same collective, and turns every way a world
//! can go wrong (a timeout, a failed or departed rank, a mismatch) into an error on every waiting
//! rank instead of a hang.
//!
//! One mutex and one condition variable guard the whole state. Collectives meet here two or three
//! times each, so the state is tiny and the critical sections are a few dozen instructions.

use crate::comm::{CollectiveKind, CommError, Partition, ReduceOp};
use crate::flat::DType;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What a rank asked for: every rank must present an equal descriptor at the same sequence number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CallDesc {
    pub kind: CollectiveKind,
    pub dtype: Option<DType>,
    /// Elements of the full tensor.
    pub len: usize,
    pub op: Option<ReduceOp>,
    pub root: Option<usize>,
    /// The groups it runs in ([`Partition::World`] but for grouped collectives).
    pub group: Partition,
}

impl CallDesc {
    pub fn barrier() -> CallDesc {
        CallDesc {
            kind: CollectiveKind::Barrier,
            dtype: None,
            len: 0,
            op: None,
            root: None,
            group: Partition::World,
        }
    }
}

impl fmt::Display for CallDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(", self.kind)?;
        let mut parts: Vec<String> = Vec::new();
        if let Some(op) = self.op {
            parts.push(format!("{op:?}").to_lowercase());
        }
        if let Some(d) = self.dtype {
            parts.push(format!("{} x {}", self.len, d));
        }
        if let Some(r) = self.root {
            parts.push(format!("root {r}"));
        }
        match self.group {
            Partition::World => {}
            Partition::Within(h) => parts.push(format!("within groups of {h}")),
            Partition::Across(h) => parts.push(format!("across groups of {h}")),
        }
        write!(f, "{})", parts.join(", "))
    }
}

/// Addresses a rank exposes to its peers for one collective.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Exposed {
    /// Where the rank's contribution starts: its input (its own shard for an all-gather).
    pub input: usize,
    /// Where the rank's result starts: the full output of an all-gather (pushed into by every
    /// rank), the shard output of a reduce-scatter, the buffer itself for all-reduce and broadcast.
    pub output: usize,
}

/// The first thing that went wrong in a world; every later wait fails with it.
#[derive(Clone, Debug)]
enum Failure {
    Peer {
        rank: usize,
        reason: String,
    },
    Mismatch {
        seq: u64,
        a: (usize, CallDesc),
        b: (usize, CallDesc),
    },
    Timeout {
        op: CollectiveKind,
        seq: u64,
        arrived: Vec<usize>,
        missing: Vec<usize>,
    },
}

struct State {
    /// Completed meetings so far.
    generation: u64,
    arrived: Vec<bool>,
    count: usize,
    /// The first rank of this meeting, when it came, and what it asked for.
    first: Option<(usize, Instant, CallDesc)>,
    exposed: Vec<Exposed>,
    /// `Some(collectives issued)` once a rank's communication thread has exited.
    departed: Vec<Option<u64>>,
    failure: Option<Failure>,
}

/// A note for the trace: this rank came last, `late` after the first one.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Straggler {
    pub late: Duration,
    pub first_rank: usize,
}

pub(crate) struct Rendezvous {
    world: usize,
    /// `State::generation`, mirrored for waiters that poll it without the lock.
    completed: AtomicU64,
    /// How long a waiter polls `completed` before sleeping on the condition variable.
    spin: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

/// One meeting of one collective, as seen by one rank.
pub(crate) struct Meeting<'a> {
    pub rank: usize,
    pub seq: u64,
    pub desc: &'a CallDesc,
    /// When this rank started the collective (the timeout covers all its meetings).
    pub started: Instant,
    pub timeout: Duration,
}

impl Rendezvous {
    pub fn new(world: usize, spin: Duration) -> Rendezvous {
        Rendezvous {
            world,
            completed: AtomicU64::new(0),
            spin,
            state: Mutex::new(State {
                generation: 0,
                arrived: vec![false; world],
                count: 0,
                first: None,
                exposed: vec![Exposed::default(); world],
                departed: vec![None; world],
                failure: None,
            }),
            cv: Condvar::new(),
        }
    }

    /// Ends the current meeting (the last rank has arrived): the next generation starts, and
    /// every waiter, polling or sleeping, is released.
    fn complete(&self, mut st: MutexGuard<'_, State>) {
        st.generation += 1;
        self.completed.store(st.generation, Ordering::Release);
        st.count = 0;
        st.first = None;
        st.arrived.iter_mut().for_each(|a| *a = false);
        drop(st);
        self.cv.notify_all();
    }

    /// Releases the lock and polls for the end of meeting `generation` for at most `self.spin`,
    /// then takes the lock again. The caller checks (and sleeps) under the lock as usual, so a spin
    /// that ends early or late changes nothing but latency; failures and timeouts are seen after it.
    fn poll_then_lock<'a>(
        &'a self,
        st: MutexGuard<'a, State>,
        generation: u64,
    ) -> MutexGuard<'a, State> {
        if self.spin == Duration::ZERO {
            return st;
        }
        drop(st);
        let start = Instant::now();
        while self.completed.load(Ordering::Acquire) == generation && start.elapsed() < self.spin {
            std::hint::spin_loop();
        }
        self.lock()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks `rank` as failed (an error or panic in its own code, or an invalid call); every rank
    /// waiting now or later fails with `PeerFailed` naming it. The first failure wins.
    pub fn fail(&self, rank: usize, reason: String) {
        let mut st = self.lock();
        if st.failure.is_none() {
            st.failure = Some(Failure::Peer { rank, reason });
        }
        drop(st);
        self.cv.notify_all();
    }

    /// The world's failure, if any, as this rank's error in meeting `m`.
    pub fn check(&self, m: &Meeting<'_>) -> Result<(), CommError> {
        match &self.lock().failure {
            Some(f) => Err(to_error(f, m)),
            None => Ok(()),
        }
    }

    /// Marks `rank` as gone after `issued` collectives: it will never arrive again.
    pub(crate) fn depart(&self, rank: usize, issued: u64) {
        let mut st = self.lock();
        st.departed[rank] = Some(issued);
        drop(st);
        self.cv.notify_all();
    }

    /// The final meeting of a data collective: waits, without timeout and whatever failed meanwhile,
    /// until every rank has finished reading and writing its peers' buffers. Every rank that passed
    /// the collective's arrival comes here without blocking on anything else, so this cannot hang.
    pub(crate) fn depart_collective(&self, rank: usize) {
        let mut st = self.lock();
        st.arrived[rank] = true;
        st.count += 1;
        let generation = st.generation;
        if st.count == self.world {
            self.complete(st);
            return;
        }
        st = self.poll_then_lock(st, generation);
        while st.generation == generation {
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Waits until every rank reached this meeting. With `expose`, publishes this rank's addresses and
    /// copies every rank's into `peers`. Returns a straggler note when this rank completed the meeting
    /// more than `straggler_threshold` after the first one.
    pub fn meet(
        &self,
        m: &Meeting<'_>,
        expose: Option<(Exposed, &mut Vec<Exposed>)>,
        straggler_threshold: Duration,
    ) -> Result<Option<Straggler>, CommError> {
        let mut st = self.lock();
        if let Some(f) = &st.failure {
            return Err(to_error(f, m));
        }
        let now = Instant::now();
        match st.first {
            None => st.first = Some((m.rank, now, *m.desc)),
            Some((other, _, theirs)) if theirs != *m.desc => {
                let f = Failure::Mismatch {
                    seq: m.seq,
                    a: (m.rank, *m.desc),
                    b: (other, theirs),
                };
                let err = to_error(&f, m);
                st.failure = Some(f);
                drop(st);
                self.cv.notify_all();
                return Err(err);
            }
            Some(_) => {}
        }
        let (mine, peers) = match expose {
            Some((e, p)) => (Some(e), Some(p)),
            None => (None, None),
        };
        if let Some(e) = mine {
            st.exposed[m.rank] = e;
        }
        st.arrived[m.rank] = true;
        st.count += 1;
        let generation = st.generation;
        if st.count == self.world {
            let (first_rank, first_at, _) = st.first.expect("set at first arrival");
            let late = now.duration_since(first_at);
            if let Some(p) = peers {
                p.clear();
                p.extend_from_slice(&st.exposed);
            }
            self.complete(st);
            let straggler = (self.world > 1 && late > straggler_threshold)
                .then_some(Straggler { late, first_rank });
            return Ok(straggler);
        }
        // No deadline when the timeout reaches past what the clock holds (`NO_TIMEOUT`).
        let deadline = m.started.checked_add(m.timeout);
        st = self.poll_then_lock(st, generation);
        loop {
            if st.generation != generation {
                // Peers cannot republish before this rank reaches the collective's next meeting, so
                // the addresses are still this collective's.
                if let Some(p) = peers {
                    p.clear();
                    p.extend_from_slice(&st.exposed);
                }
                return Ok(None);
            }
            if let Some(f) = &st.failure {
                return Err(to_error(f, m));
            }
            if let Some((r, issued)) = (0..self.world)
                .filter(|&r| !st.arrived[r])
                .find_map(|r| st.departed[r].map(|n| (r, n)))
            {
                st.failure = Some(Failure::Peer {
                    rank: r,
                    reason: format!(
                        "it finished after issuing {issued} collective(s) while others waited in \
                         collective #{}",
                        m.seq
                    ),
                });
                self.cv.notify_all();
                continue;
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                let arrived: Vec<usize> = (0..self.world).filter(|&r| st.arrived[r]).collect();
                let missing: Vec<usize> = (0..self.world).filter(|&r| !st.arrived[r]).collect();
                st.failure = Some(Failure::Timeout {
                    op: m.desc.kind,
                    seq: m.seq,
                    arrived,
                    missing,
                });
                self.cv.notify_all();
                continue;
            }
            st = match deadline {
                Some(d) => {
                    self.cv
                        .wait_timeout(st, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => self.cv.wait(st).unwrap_or_else(|e| e.into_inner()),
            };
        }
    }
}

fn to_error(f: &Failure, m: &Meeting<'_>) -> CommError {
    match f {
        Failure::Peer { rank, reason } => CommError::PeerFailed {
            rank: m.rank,
            failed_rank: *rank,
            reason: reason.clone(),
            op: m.desc.kind,
            seq: m.seq,
        },
        Failure::Mismatch { seq, a, b } => {
            // Show this rank's call against one that differs from it.
            let (other_rank, theirs) = if m.rank == b.0 || b.1 == *m.desc {
                *a
            } else {
                *b
            };
            CommError::Mismatch {
                seq: *seq,
                rank: m.rank,
                mine: format!("{} (sequence #{})", m.desc, m.seq),
                other_rank,
                theirs: theirs.to_string(),
            }
        }
        Failure::Timeout {
            op,
            seq,
            arrived,
            missing,
        } => CommError::Timeout {
            op: *op,
            seq: *seq,
            rank: m.rank,
            waited: m.started.elapsed(),
            arrived: arrived.clone(),
            missing: missing.clone(),
        },
    }
}
