//! Faults of the in-process backend: each ends in the described error, never a hang. Timeouts in
//! these tests are either short (the timeout under test) or long enough (60 s) that a fault that is
//! not detected promptly shows up as the wrong error instead of a pass.

use std::thread::sleep;
use std::time::Duration;
use zerodp::comm::{
    run_ranks, run_ranks_on, shard_range, CollectiveKind, CommError, CommOptions, Communicator,
    RankFailure, ReduceOp, TraceLevel, TraceSink,
};
use zerodp::flat::{Buffer, DType};

fn opts(timeout: Duration) -> CommOptions {
    CommOptions {
        timeout,
        ..CommOptions::default()
    }
}

/// The error each rank's function returned (the test functions return their CommError on purpose).
fn errors(r: Result<Vec<()>, zerodp::comm::RanksError<CommError>>) -> Vec<(usize, CommError)> {
    let e = r.expect_err("the world must fail");
    e.failures
        .into_iter()
        .map(|(rank, f)| match f {
            RankFailure::Error(e) => (rank, e),
            RankFailure::Panic(m) => panic!("rank {rank} panicked: {m}"),
        })
        .collect()
}

#[test]
fn a_missing_rank_times_out_every_waiting_rank_with_the_full_story() {
    let timeout = Duration::from_millis(300);
    let errs = errors(run_ranks(4, opts(timeout), |comm, rank| {
        comm.barrier().wait()?; // sequence #0: everybody
        if rank == 3 {
            // Rank 3 is busy elsewhere well past the timeout, then arrives at #1 too late.
            sleep(Duration::from_millis(900));
        }
        comm.all_reduce(Buffer::zeros(DType::F32, 8), ReduceOp::Sum)
            .wait()?;
        Ok(())
    }));
    assert_eq!(errs.len(), 4, "{errs:?}");
    // The first rank to reach its deadline fails the world; the others stop with it, a little short
    // of their own deadlines.
    let mut longest = Duration::ZERO;
    for (rank, e) in &errs {
        match e {
            CommError::Timeout {
                op,
                seq,
                rank: r,
                waited,
                arrived,
                missing,
            } => {
                assert_eq!(*op, CollectiveKind::AllReduce);
                assert_eq!(*seq, 1);
                assert_eq!(r, rank);
                assert_eq!(arrived, &vec![0, 1, 2]);
                assert_eq!(missing, &vec![3]);
                if *rank != 3 {
                    longest = longest.max(*waited);
                }
                let msg = e.to_string();
                assert!(msg.contains("all_reduce") && msg.contains("#1"), "{msg}");
            }
            other => panic!("rank {rank}: expected a timeout, got {other}"),
        }
    }
    assert!(
        longest >= timeout,
        "no rank waited the timeout: {longest:?}"
    );
}

#[test]
fn a_panicking_rank_fails_the_others_promptly_naming_it() {
    // With a 60 s timeout, a peer failure that was not propagated would surface as a Timeout.
    let r = run_ranks(3, opts(Duration::from_secs(60)), |comm, rank| {
        comm.barrier().wait()?;
        if rank == 1 {
            panic!("boom in rank one");
        }
        comm.all_reduce(Buffer::zeros(DType::BF16, 100), ReduceOp::Avg)
            .wait()?;
        Ok::<(), CommError>(())
    });
    let e = r.expect_err("rank 1 panicked");
    assert_eq!(e.first_failed, 1);
    assert!(e.to_string().contains("boom in rank one"), "{e}");
    for (rank, f) in &e.failures {
        match (rank, f) {
            (1, RankFailure::Panic(m)) => assert!(m.contains("boom")),
            (
                _,
                RankFailure::Error(CommError::PeerFailed {
                    failed_rank,
                    reason,
                    op,
                    seq,
                    ..
                }),
            ) => {
                assert_eq!(*failed_rank, 1);
                assert!(reason.contains("boom in rank one"), "{reason}");
                assert_eq!((*op, *seq), (CollectiveKind::AllReduce, 1));
            }
            other => panic!("unexpected failure {other:?}"),
        }
    }
    assert_eq!(e.failures.len(), 3);
}

#[test]
fn a_rank_returning_an_error_fails_the_others_naming_it() {
    #[derive(Debug)]
    struct Oops;
    impl std::fmt::Display for Oops {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("out of batches")
        }
    }
    #[derive(Debug)]
    enum E {
        Mine(Oops),
        Comm(CommError),
    }
    impl From<CommError> for E {
        fn from(e: CommError) -> E {
            E::Comm(e)
        }
    }
    impl std::fmt::Display for E {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            match self {
                E::Mine(o) => write!(f, "{o}"),
                E::Comm(c) => write!(f, "{c}"),
            }
        }
    }
    let r = run_ranks(2, opts(Duration::from_secs(60)), |comm, rank| {
        if rank == 0 {
            return Err(E::Mine(Oops));
        }
        comm.barrier().wait()?;
        Ok(())
    });
    let e = r.expect_err("rank 0 failed");
    assert_eq!(e.first_failed, 0);
    match &e.failures[1].1 {
        RankFailure::Error(E::Comm(CommError::PeerFailed {
            failed_rank: 0,
            reason,
            ..
        })) => assert!(reason.contains("out of batches"), "{reason}"),
        other => panic!("rank 1: {other:?}"),
    }
}

#[test]
fn a_rank_that_finishes_early_fails_the_ranks_still_waiting_for_it() {
    let errs = errors(run_ranks(2, opts(Duration::from_secs(60)), |comm, rank| {
        comm.barrier().wait()?;
        if rank == 0 {
            comm.barrier().wait()?; // rank 1 never issues this one
        }
        Ok(())
    }));
    assert_eq!(errs.len(), 1);
    match &errs[0] {
        (
            0,
            CommError::PeerFailed {
                failed_rank: 1,
                seq: 1,
                reason,
                ..
            },
        ) => assert!(reason.contains("finished after issuing 1"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

/// Runs `call(rank)` on two ranks and returns both errors, which must be mismatches.
fn mismatch(call: impl Fn(&dyn Communicator, usize) -> CommError + Sync) -> Vec<String> {
    let errs = errors(run_ranks(2, opts(Duration::from_secs(60)), |comm, rank| {
        comm.barrier().wait()?;
        Err(call(&*comm, rank))
    }));
    assert_eq!(errs.len(), 2, "{errs:?}");
    errs.into_iter()
        .map(|(rank, e)| match &e {
            CommError::Mismatch {
                seq: 1,
                rank: r,
                other_rank,
                ..
            } if *r == rank && *other_rank == 1 - rank => e.to_string(),
            other => panic!("rank {rank}: expected a mismatch at #1, got {other}"),
        })
        .collect()
}

#[test]
fn different_collectives_sizes_dtypes_or_roots_are_mismatches_showing_both_calls() {
    let msgs = mismatch(|c, rank| {
        let h = if rank == 0 {
            c.all_reduce(Buffer::zeros(DType::F32, 10), ReduceOp::Sum)
        } else {
            c.all_gather(Buffer::zeros(DType::F32, 5), Buffer::zeros(DType::F32, 10))
        };
        h.wait().unwrap_err()
    });
    for m in &msgs {
        assert!(
            m.contains("all_reduce(sum, 10 x f32)") && m.contains("all_gather(10 x f32)"),
            "{m}"
        );
    }
    let msgs = mismatch(|c, rank| {
        let len = 10 + 2 * rank;
        c.all_reduce(Buffer::zeros(DType::F32, len), ReduceOp::Sum)
            .wait()
            .unwrap_err()
    });
    assert!(msgs[0].contains("10 x f32") && msgs[0].contains("12 x f32"));
    let msgs = mismatch(|c, rank| {
        let dtype = [DType::BF16, DType::F16][rank];
        let out = Buffer::zeros(dtype, shard_range(8, 2, rank).len());
        c.reduce_scatter(Buffer::zeros(dtype, 8), out, ReduceOp::Max)
            .wait()
            .unwrap_err()
    });
    assert!(msgs[1].contains("8 x bf16") && msgs[1].contains("8 x f16"));
    let msgs = mismatch(|c, rank| {
        c.broadcast(Buffer::zeros(DType::F32, 4), rank)
            .wait()
            .unwrap_err()
    });
    assert!(msgs[0].contains("root 0") && msgs[0].contains("root 1"));
}

#[test]
fn an_invalid_call_is_reported_to_the_caller_and_fails_the_peers() {
    let errs = errors(run_ranks(2, opts(Duration::from_secs(60)), |comm, rank| {
        let out_len = if rank == 0 { 3 } else { 5 }; // rank 0's shard of 10 is 5
        comm.reduce_scatter(
            Buffer::zeros(DType::F32, 10),
            Buffer::zeros(DType::F32, out_len),
            ReduceOp::Sum,
        )
        .wait()?;
        Ok(())
    }));
    assert_eq!(errs.len(), 2);
    assert!(
        matches!(&errs[0].1, CommError::InvalidArgument { rank: 0, what } if what.contains("shard of 5")),
        "{:?}",
        errs[0]
    );
    assert!(
        matches!(&errs[1].1, CommError::PeerFailed { failed_rank: 0, .. }),
        "{:?}",
        errs[1]
    );
}

#[test]
fn traces_log_each_collective_and_note_stragglers() {
    let (sink, lines) = TraceSink::memory();
    let options = CommOptions {
        trace: TraceLevel::Info,
        straggler_threshold: Duration::from_millis(200),
        trace_sink: sink,
        ..CommOptions::default()
    };
    run_ranks(2, options, |comm, rank| {
        comm.all_reduce(Buffer::zeros(DType::BF16, 1000), ReduceOp::Sum)
            .wait()?;
        if rank == 1 {
            sleep(Duration::from_millis(800));
        }
        comm.barrier().wait()?;
        Ok::<(), CommError>(())
    })
    .unwrap();
    let lines = lines.lock().unwrap().clone();
    let ar: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("all_reduce #0"))
        .collect();
    assert_eq!(ar.len(), 2, "{lines:#?}");
    for l in &ar {
        for field in [
            "dtype=bf16",
            "elements=1000",
            "bytes=2000",
            "time=",
            "algbw=",
            "busbw=",
        ] {
            assert!(l.contains(field), "missing {field} in {l}");
        }
    }
    // Rank 1 reached the barrier 800 ms after rank 0: it, and only it, is noted there.
    let late: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("straggler at barrier"))
        .collect();
    assert_eq!(late.len(), 1, "{lines:#?}");
    assert!(
        late[0].contains("rank 1:") && late[0].contains("barrier #1"),
        "{}",
        late[0]
    );
}

#[test]
fn summary_table_lists_each_op_and_size() {
    let tables = run_ranks(2, CommOptions::default(), |comm, rank| {
        for _ in 0..3 {
            comm.all_reduce(Buffer::zeros(DType::F32, 256), ReduceOp::Sum)
                .wait()?;
        }
        let out = Buffer::zeros(DType::F16, shard_range(64, 2, rank).len());
        comm.reduce_scatter(Buffer::zeros(DType::F16, 64), out, ReduceOp::Sum)
            .wait()?;
        let s = comm.stats();
        Ok::<_, CommError>((s, comm.summary()))
    })
    .unwrap();
    let (stats, table) = &tables[0];
    assert_eq!(stats.rows.len(), 2);
    assert_eq!(stats.rows[0].stats.calls, 3);
    assert_eq!(stats.rows[0].bytes, 1024);
    assert!(table.contains("all_reduce") && table.contains("reduce_scatter"));
    assert!(table.contains("1024") && table.contains("128"), "{table}");
}

#[test]
fn calls_return_at_once_so_callers_overlap_work_even_with_tracing_on() {
    // Rank 1 issues its all-reduce only after rank 0's all_reduce() call has returned and rank 0
    // has told it so over a channel. If issuing blocked until the collective finished (or tracing
    // synchronised), rank 0 would never send and the world would time out instead of passing.
    let (sink, lines) = TraceSink::memory();
    let options = CommOptions {
        timeout: Duration::from_secs(60),
        trace: TraceLevel::Info,
        trace_sink: sink,
        ..CommOptions::default()
    };
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (tx, rx) = (std::sync::Mutex::new(Some(tx)), std::sync::Mutex::new(rx));
    let sums = run_ranks(2, options, |comm, rank| {
        let b = Buffer::F32(vec![rank as f32 + 1.0; 64]);
        let h = if rank == 0 {
            let h = comm.all_reduce(b, ReduceOp::Sum);
            tx.lock().unwrap().take().unwrap().send(()).unwrap();
            h
        } else {
            rx.lock().unwrap().recv().unwrap();
            comm.all_reduce(b, ReduceOp::Sum)
        };
        Ok::<_, CommError>(h.wait_one()?.get_f32(63))
    })
    .unwrap();
    assert_eq!(sums, vec![3.0, 3.0]);
    assert_eq!(lines.lock().unwrap().len(), 2);
}

#[test]
fn a_rank_failing_while_its_collective_runs_never_corrupts_its_peers() {
    // Rank 1 issues a large all-reduce and fails at once without waiting for it. Its communication
    // thread still takes part, so rank 0 either completes the collective with the right sums (the
    // collective got past its arrival before the failure) or is told that rank 1 failed; it never
    // sees freed or half-written buffers.
    for _ in 0..5 {
        let len = 1 << 20;
        let r = run_ranks(2, opts(Duration::from_secs(60)), |comm, rank| {
            let h = comm.all_reduce(Buffer::F32(vec![rank as f32 + 1.0; len]), ReduceOp::Sum);
            if rank == 1 {
                drop(h);
                return Err(CommError::Closed("rank 1 gives up".into()));
            }
            let v = h.wait_one()?.into_f32().unwrap();
            assert!(v.iter().all(|&x| x == 3.0), "rank 0 saw a partial result");
            Ok(())
        });
        let e = r.expect_err("rank 1 failed");
        assert_eq!(e.first_failed, 1);
        match &e.failures[..] {
            [(1, _)] => {}
            [(0, RankFailure::Error(CommError::PeerFailed { failed_rank: 1, .. })), (1, _)] => {}
            other => panic!("{other:?}"),
        }
    }
}

/// A rank's own error, or a collective's.
#[derive(Debug)]
enum RankError {
    Comm(CommError),
    Own(&'static str),
}

impl std::fmt::Display for RankError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RankError::Comm(e) => write!(f, "{e}"),
            RankError::Own(m) => f.write_str(m),
        }
    }
}

impl From<CommError> for RankError {
    fn from(e: CommError) -> Self {
        RankError::Comm(e)
    }
}

#[test]
fn ranks_failing_alike_are_reported_once_with_the_first_named() {
    // Rank 2 fails at once; the others a little later with the same message (as every rank does
    // when all see the same non-finite gradients).
    let e = run_ranks(4, opts(Duration::from_secs(60)), |_comm, rank| {
        if rank != 2 {
            sleep(Duration::from_millis(200));
        }
        Err::<(), _>(RankError::Own("gradients diverged"))
    })
    .unwrap_err();
    assert_eq!(e.first_failed, 2);
    assert_eq!(
        e.to_string(),
        "ranks 0, 1, 2, 3 failed (rank 2 first): gradients diverged"
    );

    // Different messages: the root cause first, then each other message once with its ranks.
    let e = run_ranks(4, opts(Duration::from_secs(60)), |_comm, rank| {
        if rank == 1 {
            return Err::<(), _>(RankError::Own("bad data"));
        }
        sleep(Duration::from_millis(200));
        Err(RankError::Own("gradients diverged"))
    })
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "rank 1 failed: bad data (then ranks 0, 2, 3: gradients diverged)"
    );
}

/// `run_ranks_on` (the caller's communicators, as `train --nccl` passes NCCL's): a rank that
/// fails outside a collective is reported to the others through its communicator, which fail
/// promptly naming it, as under `run_ranks`.
#[test]
fn a_failing_rank_on_the_caller_s_communicators_fails_the_others_naming_it() {
    let comms = zerodp::comm::InprocComm::create_world(3, opts(Duration::from_secs(60))).unwrap();
    let comms: Vec<std::sync::Arc<dyn Communicator>> = comms
        .into_iter()
        .map(|c| std::sync::Arc::new(c) as std::sync::Arc<dyn Communicator>)
        .collect();
    let r = run_ranks_on(comms, |comm, rank| {
        if rank == 1 {
            panic!("rank 1 lost its data");
        }
        comm.barrier().wait()?;
        Ok::<_, CommError>(())
    });
    let e = r.expect_err("rank 1 failed");
    assert_eq!(e.first_failed, 1);
    for (rank, f) in &e.failures {
        match (rank, f) {
            (1, RankFailure::Panic(m)) => assert!(m.contains("lost its data"), "{m}"),
            (_, RankFailure::Error(CommError::PeerFailed { failed_rank: 1, .. })) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(e.failures.len(), 3, "{e}");
}
