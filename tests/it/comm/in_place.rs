//! The in-place collectives (`all_gather_in_place`, `reduce_scatter_in_place`): bit-identical to the
//! out-of-place forms and to the serial reference for world sizes 1 to 8, every dtype and op, odd
//! lengths; ranks mixing the two forms; the trait's default implementations (a backend that does
//! not override them); and traffic counters equal to the out-of-place forms'.

use half::{bf16, f16};
use std::sync::Arc;
use zerodp::comm::reduce::reduce_reference;
use zerodp::comm::{
    run_ranks, shard_range, CollectiveKind, CommError, CommHandle, CommOptions, Communicator,
    InprocComm, ReduceOp, TrafficCounters,
};
use zerodp::flat::{Buffer, DType};

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];
const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];

/// Empty, shorter than the world, not divisible, and shards spanning several 2048-element blocks.
fn lengths(n: usize) -> Vec<usize> {
    let mut v = vec![0, n.saturating_sub(1), 3 * n + 2, 2048 * 2 * n + 3 * n + 1];
    v.sort_unstable();
    v.dedup();
    v
}

/// Sign-, exponent- and mantissa-varied values, so that the order of summation shows in the bits.
fn make(dtype: DType, len: usize, rank: usize, salt: usize) -> Buffer {
    let vals = (0..len).map(|i| {
        let h = (i as u64 * 2654435761 + rank as u64 * 40503 + salt as u64 * 7919) % 1_000_003;
        let sign = if h % 3 == 0 { -1.0 } else { 1.0 };
        sign * (1.0 + (h % 977) as f32 / 977.0) * 2f32.powi((h % 7) as i32 - 3)
    });
    match dtype {
        DType::F32 => Buffer::F32(vals.collect()),
        DType::BF16 => Buffer::BF16(vals.map(bf16::from_f32).collect()),
        DType::F16 => Buffer::F16(vals.map(f16::from_f32).collect()),
    }
}

/// A buffer of `len` elements whose range `keep` comes from `src` and whose other elements are a
/// filler that must not leak into any result.
fn with_only(src: &Buffer, keep: std::ops::Range<usize>) -> Buffer {
    let mut b = make(src.dtype(), src.len(), 99, 12345);
    b.write_at(keep.start, &src.copy_range(keep));
    b
}

/// One case: what every rank issues, in a fixed order.
#[derive(Clone, Copy, Debug)]
enum Case {
    ReduceScatter(DType, ReduceOp, usize),
    AllGather(DType, usize),
}

fn cases(n: usize) -> Vec<Case> {
    let mut v = Vec::new();
    for len in lengths(n) {
        for dtype in DTYPES {
            for op in OPS {
                v.push(Case::ReduceScatter(dtype, op, len));
            }
            v.push(Case::AllGather(dtype, len));
        }
    }
    v
}

/// Issues every case in place and out of place on `comm` (all issued before any wait, so many are
/// in flight), returning per case `(in-place result, out-of-place result)`: for reduce-scatter this
/// rank's shard, for all-gather the full buffer.
fn run_cases(
    comm: &dyn Communicator,
    cases: &[Case],
    in_place_on: impl Fn(usize) -> bool,
) -> Result<Vec<(Buffer, Buffer)>, CommError> {
    let (n, rank) = (comm.world_size(), comm.rank());
    let mut handles: Vec<(CommHandle, CommHandle)> = Vec::new();
    for (salt, &case) in cases.iter().enumerate() {
        let pair = match case {
            Case::ReduceScatter(dtype, op, len) => {
                let input = make(dtype, len, rank, salt);
                let mine = shard_range(len, n, rank);
                let out = Buffer::zeros(dtype, mine.len());
                let a = if in_place_on(rank) {
                    comm.reduce_scatter_in_place(input.clone(), op)
                } else {
                    comm.reduce_scatter(input.clone(), out.clone(), op)
                };
                (a, comm.reduce_scatter(input, out, op))
            }
            Case::AllGather(dtype, len) => {
                let full = make(dtype, len, 0, salt);
                let mine = shard_range(len, n, rank);
                let a = if in_place_on(rank) {
                    comm.all_gather_in_place(with_only(&full, mine.clone()))
                } else {
                    comm.all_gather(full.copy_range(mine.clone()), Buffer::zeros(dtype, len))
                };
                let b = comm.all_gather(full.copy_range(mine), Buffer::zeros(dtype, len));
                (a, b)
            }
        };
        handles.push(pair);
    }
    cases
        .iter()
        .zip(handles)
        .map(|(&case, (a, b))| {
            let mut a = a.wait()?;
            let a = if in_place_on(rank) {
                assert_eq!(a.len(), 1, "in-place collectives hand back one buffer");
                let buf = a.pop().expect("one buffer");
                match case {
                    Case::ReduceScatter(_, _, len) => buf.copy_range(shard_range(len, n, rank)),
                    Case::AllGather(..) => buf,
                }
            } else {
                a.pop().expect("output")
            };
            let (_, b) = b.wait_pair()?;
            Ok((a, b))
        })
        .collect()
}

fn bits(b: &Buffer) -> Vec<u32> {
    (0..b.len()).map(|i| b.get_f32(i).to_bits()).collect()
}

/// Checks every rank's results against the out-of-place ones and the serial reference.
fn check(n: usize, cases: &[Case], results: &[Vec<(Buffer, Buffer)>], what: &str) {
    for (c, &case) in cases.iter().enumerate() {
        for (rank, per_rank) in results.iter().enumerate() {
            let (got, out_of_place) = &per_rank[c];
            let want = match case {
                Case::ReduceScatter(dtype, op, len) => {
                    let inputs: Vec<Buffer> = (0..n).map(|r| make(dtype, len, r, c)).collect();
                    let refs: Vec<&Buffer> = inputs.iter().collect();
                    reduce_reference(&refs, op).copy_range(shard_range(len, n, rank))
                }
                Case::AllGather(dtype, len) => make(dtype, len, 0, c),
            };
            assert_eq!(got.dtype(), want.dtype());
            assert_eq!(
                bits(got),
                bits(out_of_place),
                "{what}, world {n}, rank {rank}: {case:?} in place differs from out of place"
            );
            assert_eq!(
                bits(got),
                bits(&want),
                "{what}, world {n}, rank {rank}: {case:?} differs from the reference"
            );
        }
    }
}

#[test]
fn in_place_collectives_match_out_of_place_and_the_reference_for_world_sizes_1_to_8() {
    for n in 1..=8 {
        let cs = cases(n);
        let results = run_ranks(n, CommOptions::default(), |comm, _| {
            run_cases(&*comm, &cs, |_| true)
        })
        .unwrap_or_else(|e| panic!("world of {n}: {e}"));
        check(n, &cs, &results, "native");
    }
}

#[test]
fn ranks_may_mix_in_place_and_out_of_place_forms() {
    for n in [2, 3, 5] {
        let cs = cases(n);
        let results = run_ranks(n, CommOptions::default(), |comm, _| {
            run_cases(&*comm, &cs, |r| r % 2 == 0)
        })
        .unwrap_or_else(|e| panic!("world of {n}: {e}"));
        check(n, &cs, &results, "mixed");
    }
}

/// Shards of several MiB take the streaming-store paths (the all-gather's fan-out copy, the
/// reduce-scatter's streamed output) at lengths that leave every shard boundary unaligned.
#[test]
fn large_messages_on_the_streaming_path_match_the_reference() {
    for n in [2, 3] {
        let cs = [
            Case::AllGather(DType::F32, n * (1 << 20) + 5),
            Case::AllGather(DType::BF16, n * (2 << 20) + 7),
            Case::ReduceScatter(DType::F32, ReduceOp::Sum, n * (1 << 20) + 5),
            Case::ReduceScatter(DType::BF16, ReduceOp::Avg, n * (2 << 20) + 7),
        ];
        for (what, in_place_on) in [("all in place", 1), ("mixed", 2)] {
            let results = run_ranks(n, CommOptions::default(), |comm, _| {
                run_cases(&*comm, &cs, |r| r % in_place_on == 0)
            })
            .unwrap_or_else(|e| panic!("world of {n}: {e}"));
            check(n, &cs, &results, what);
        }
    }
}

/// A backend that implements only the required methods, so the trait's default in-place methods run.
struct OutOfPlaceOnly(Arc<InprocComm>);

impl Communicator for OutOfPlaceOnly {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_reduce(&self, buf: Buffer, op: ReduceOp) -> CommHandle {
        self.0.all_reduce(buf, op)
    }
    fn reduce_scatter(&self, input: Buffer, output: Buffer, op: ReduceOp) -> CommHandle {
        self.0.reduce_scatter(input, output, op)
    }
    fn all_gather(&self, input: Buffer, output: Buffer) -> CommHandle {
        self.0.all_gather(input, output)
    }
    fn broadcast(&self, buf: Buffer, root: usize) -> CommHandle {
        self.0.broadcast(buf, root)
    }
    fn barrier(&self) -> CommHandle {
        self.0.barrier()
    }
    fn traffic(&self) -> TrafficCounters {
        self.0.traffic()
    }
}

#[test]
fn default_in_place_methods_fall_back_to_the_out_of_place_collectives() {
    for n in [1, 3, 4] {
        let cs = cases(n);
        let results = run_ranks(n, CommOptions::default(), |comm, _| {
            run_cases(&OutOfPlaceOnly(comm), &cs, |_| true)
        })
        .unwrap_or_else(|e| panic!("world of {n}: {e}"));
        check(n, &cs, &results, "default methods");
    }
}

#[test]
fn in_place_traffic_counters_equal_the_out_of_place_ones() {
    let n = 4;
    let len = 1001; // shards 251, 250, 250, 250
    let per_rank = run_ranks(n, CommOptions::default(), |comm, rank| {
        let shard = shard_range(len, n, rank).len();
        let t0 = comm.traffic();
        comm.reduce_scatter(
            Buffer::zeros(DType::F32, len),
            Buffer::zeros(DType::F32, shard),
            ReduceOp::Sum,
        )
        .wait()?;
        comm.all_gather(
            Buffer::zeros(DType::BF16, shard),
            Buffer::zeros(DType::BF16, len),
        )
        .wait()?;
        let t1 = comm.traffic();
        comm.reduce_scatter_in_place(Buffer::zeros(DType::F32, len), ReduceOp::Sum)
            .wait()?;
        comm.all_gather_in_place(Buffer::zeros(DType::BF16, len))
            .wait()?;
        let t2 = comm.traffic();
        Ok::<_, CommError>((t1.since(&t0), t2.since(&t1)))
    })
    .unwrap();
    for (rank, (out_of_place, in_place)) in per_rank.iter().enumerate() {
        assert_eq!(in_place, out_of_place, "rank {rank}");
        let ring = len as u64 - shard_range(len, n, rank).len() as u64;
        assert_eq!(in_place.sent(CollectiveKind::ReduceScatter), 4 * ring);
        assert_eq!(in_place.recv(CollectiveKind::AllGather), 2 * ring);
        assert_eq!(in_place.calls(CollectiveKind::AllGather), 1);
    }
}
