//! Every collective of the in-process backend against a serial reference written here (independently
//! of the backend's kernels), for world sizes 1 to 8, every dtype and reduce op, and lengths that do
//! and do not divide by the world size (zero and shorter than the world included), plus the
//! bit-identity of results across ranks and runs and the ring-formula byte counters.

use half::{bf16, f16};
use std::sync::Arc;
use zerodp::comm::{
    run_ranks, shard_range, CollectiveKind, CommError, CommOptions, Communicator, InprocComm,
    ReduceOp,
};
use zerodp::flat::{Buffer, DType};

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];
const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];

/// Lengths tried at world size `n`: empty, shorter than the world, divisible, not divisible, and one
/// whose shards span several of the kernels' 2048-element blocks.
fn lengths(n: usize) -> Vec<usize> {
    let big = 2048 * 2 * n + 3 * n + 1;
    let mut v = vec![0, 1, n.saturating_sub(1), n, n + 1, 3 * n + 2, 257, big];
    v.sort_unstable();
    v.dedup();
    v
}

/// A deterministic, sign- and exponent-varied value for (rank, element, salt), so that the order of
/// summation matters in the last bits.
fn value(rank: usize, i: usize, salt: usize) -> f32 {
    let mut h = (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9)
        ^ (salt as u64).wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^= h >> 31;
    h = h.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    h ^= h >> 29;
    let mant = (h & 0xFFFF) as f32 / 65536.0; // [0, 1)
    let exp = ((h >> 16) % 9) as i32 - 4; // 2^-4 .. 2^4
    let sign = if (h >> 40) & 1 == 1 { -1.0 } else { 1.0 };
    sign * (1.0 + mant) * 2f32.powi(exp)
}

fn make(dtype: DType, len: usize, rank: usize, salt: usize) -> Buffer {
    let vals = (0..len).map(|i| value(rank, i, salt));
    match dtype {
        DType::F32 => Buffer::F32(vals.collect()),
        DType::BF16 => Buffer::BF16(vals.map(bf16::from_f32).collect()),
        DType::F16 => Buffer::F16(vals.map(f16::from_f32).collect()),
    }
}

fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F32 => x,
        DType::BF16 => bf16::from_f32(x).to_f32(),
        DType::F16 => f16::from_f32(x).to_f32(),
    }
}

/// Serial reference: element by element, f32 accumulation in rank order 0..n-1, one rounding.
fn reference(inputs: &[Buffer], op: ReduceOp) -> Vec<f32> {
    let dtype = inputs[0].dtype();
    let n = inputs.len();
    (0..inputs[0].len())
        .map(|i| {
            let mut acc = inputs[0].get_f32(i);
            for b in &inputs[1..] {
                let x = b.get_f32(i);
                acc = match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc + x,
                    ReduceOp::Max => acc.max(x),
                };
            }
            if op == ReduceOp::Avg {
                acc /= n as f32;
            }
            round_to(dtype, acc)
        })
        .collect()
}

fn to_f32s(b: &Buffer) -> Vec<f32> {
    (0..b.len()).map(|i| b.get_f32(i)).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every case, in a fixed order; `salt` numbers them so inputs differ between cases.
fn cases(n: usize) -> Vec<(CollectiveKind, DType, ReduceOp, usize, usize)> {
    let mut v = Vec::new();
    for &len in &lengths(n) {
        for &dtype in &DTYPES {
            for &op in &OPS {
                v.push((CollectiveKind::AllReduce, dtype, op, len, 0));
                v.push((CollectiveKind::ReduceScatter, dtype, op, len, 0));
            }
            v.push((CollectiveKind::AllGather, dtype, ReduceOp::Sum, len, 0));
            // Equal chunks: the length rounded down to a multiple of the world.
            let even = len / n * n;
            v.push((CollectiveKind::AllToAll, dtype, ReduceOp::Sum, even, 0));
            v.push((
                CollectiveKind::Broadcast,
                dtype,
                ReduceOp::Sum,
                len,
                len % n,
            ));
        }
    }
    v
}

/// Runs every case on every rank, issuing all collectives before waiting on any (so many are in
/// flight at once), and returns each rank's results as f32 vectors.
fn run_world(n: usize) -> Vec<Vec<Vec<f32>>> {
    let cs = cases(n);
    run_ranks(n, CommOptions::default(), |comm, rank| {
        let handles: Vec<_> = cs
            .iter()
            .enumerate()
            .map(|(salt, &(kind, dtype, op, len, root))| match kind {
                CollectiveKind::AllReduce => comm.all_reduce(make(dtype, len, rank, salt), op),
                CollectiveKind::ReduceScatter => {
                    let out = Buffer::zeros(dtype, shard_range(len, n, rank).len());
                    comm.reduce_scatter(make(dtype, len, rank, salt), out, op)
                }
                CollectiveKind::AllGather => {
                    // Rank r's shard holds elements shard_range(len, n, r) of the "rank 0" tensor.
                    let full = make(dtype, len, 0, salt);
                    let r = shard_range(len, n, rank);
                    let shard = slice(&full, r);
                    comm.all_gather(shard, Buffer::zeros(dtype, len))
                }
                CollectiveKind::Broadcast => comm.broadcast(make(dtype, len, rank, salt), root),
                CollectiveKind::Barrier => comm.barrier(),
                CollectiveKind::AllToAll => comm.all_to_all_group(
                    zerodp::comm::Partition::World,
                    make(dtype, len, rank, salt),
                    Buffer::zeros(dtype, len),
                ),
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                let mut bufs = h.wait()?;
                Ok(to_f32s(&bufs.pop().expect("one buffer at least")))
            })
            .collect::<Result<Vec<_>, CommError>>()
    })
    .unwrap_or_else(|e| panic!("world of {n}: {e}"))
}

fn slice(b: &Buffer, r: std::ops::Range<usize>) -> Buffer {
    match b {
        Buffer::F32(v) => Buffer::F32(v[r].to_vec()),
        Buffer::BF16(v) => Buffer::BF16(v[r].to_vec()),
        Buffer::F16(v) => Buffer::F16(v[r].to_vec()),
    }
}

#[test]
fn every_collective_matches_the_serial_reference_for_world_sizes_1_to_8() {
    for n in 1..=8 {
        let results = run_world(n);
        for (c, &(kind, dtype, op, len, root)) in cases(n).iter().enumerate() {
            let inputs: Vec<Buffer> = (0..n).map(|r| make(dtype, len, r, c)).collect();
            for (rank, per_rank) in results.iter().enumerate() {
                let got = &per_rank[c];
                let want: Vec<f32> = match kind {
                    CollectiveKind::AllReduce => reference(&inputs, op),
                    CollectiveKind::ReduceScatter => {
                        reference(&inputs, op)[shard_range(len, n, rank)].to_vec()
                    }
                    CollectiveKind::AllGather => to_f32s(&make(dtype, len, 0, c)),
                    CollectiveKind::Broadcast => to_f32s(&inputs[root]),
                    CollectiveKind::Barrier => vec![],
                    // Chunk j is chunk `rank` of rank j's input.
                    CollectiveKind::AllToAll => (0..n)
                        .flat_map(|j| {
                            let chunk = len / n;
                            to_f32s(&inputs[j])[rank * chunk..(rank + 1) * chunk].to_vec()
                        })
                        .collect(),
                };
                assert_eq!(
                    bits(got),
                    bits(&want),
                    "world {n}, rank {rank}: {kind} {dtype} {op:?} len {len}"
                );
            }
        }
    }
}

#[test]
fn results_are_bit_identical_across_ranks_and_runs() {
    for n in [3, 4] {
        let a = run_world(n);
        let b = run_world(n);
        assert_eq!(a, b, "world {n}: two runs differ");
        for (c, &(kind, ..)) in cases(n).iter().enumerate() {
            if kind == CollectiveKind::AllReduce {
                for r in 1..n {
                    assert_eq!(bits(&a[r][c]), bits(&a[0][c]), "case {c}, rank {r} vs 0");
                }
            }
        }
    }
}

#[test]
fn byte_counters_follow_the_ring_formulas() {
    // 1 MiB f32 tensor plus an odd-sized bf16 one, world of 4: per rank reduce-scatter and
    // all-gather move (n-1)/n of the full buffer each way, all-reduce twice that.
    let n = 4;
    let len = 1 << 18;
    let odd = 1001; // shards 251, 250, 250, 250
    let per_rank = run_ranks(n, CommOptions::default(), |comm, rank| {
        let before = comm.traffic();
        comm.all_reduce(Buffer::zeros(DType::F32, len), ReduceOp::Sum)
            .wait()?;
        let shard = shard_range(len, n, rank).len();
        comm.reduce_scatter(
            Buffer::zeros(DType::F32, len),
            Buffer::zeros(DType::F32, shard),
            ReduceOp::Sum,
        )
        .wait()?;
        comm.all_gather(
            Buffer::zeros(DType::F32, shard),
            Buffer::zeros(DType::F32, len),
        )
        .wait()?;
        let oshard = shard_range(odd, n, rank).len();
        comm.reduce_scatter(
            Buffer::zeros(DType::BF16, odd),
            Buffer::zeros(DType::BF16, oshard),
            ReduceOp::Avg,
        )
        .wait()?;
        comm.broadcast(Buffer::zeros(DType::F16, 10), 2).wait()?;
        comm.barrier().wait()?;
        Ok::<_, CommError>(comm.traffic().since(&before))
    })
    .unwrap();
    let full = (len * 4) as u64;
    for (rank, t) in per_rank.iter().enumerate() {
        let ring = full * (n as u64 - 1) / n as u64;
        assert_eq!(t.sent(CollectiveKind::AllReduce), 2 * ring);
        assert_eq!(t.recv(CollectiveKind::AllReduce), 2 * ring);
        let odd_shard = shard_range(odd, n, rank).len() as u64 * 2;
        assert_eq!(
            t.sent(CollectiveKind::ReduceScatter),
            ring + odd as u64 * 2 - odd_shard
        );
        assert_eq!(t.recv(CollectiveKind::AllGather), ring);
        let (bs, br) = if rank == 2 { (60, 0) } else { (0, 20) };
        assert_eq!(t.sent(CollectiveKind::Broadcast), bs);
        assert_eq!(t.recv(CollectiveKind::Broadcast), br);
        assert_eq!(t.calls(CollectiveKind::Barrier), 1);
        assert_eq!(t.calls(CollectiveKind::ReduceScatter), 2);
        assert_eq!(t.total_sent() - t.sent(CollectiveKind::Broadcast), {
            4 * ring + odd as u64 * 2 - odd_shard
        });
    }
}

#[test]
fn world_of_one_is_a_copy_and_counts_no_traffic() {
    let out = run_ranks(1, CommOptions::default(), |comm, _| {
        let x = make(DType::BF16, 33, 0, 7);
        let y = comm.all_reduce(x.clone(), ReduceOp::Avg).wait_one()?;
        let (_, z) = comm
            .reduce_scatter(x.clone(), Buffer::zeros(DType::BF16, 33), ReduceOp::Max)
            .wait_pair()?;
        let (_, g) = comm
            .all_gather(x.clone(), Buffer::zeros(DType::BF16, 33))
            .wait_pair()?;
        Ok::<_, CommError>((x == y && x == z && x == g, comm.traffic()))
    })
    .unwrap();
    assert!(out[0].0, "a world of one must return its input unchanged");
    assert_eq!(out[0].1.total_sent() + out[0].1.total_recv(), 0);
    assert_eq!(out[0].1.calls(CollectiveKind::AllReduce), 1);
}

#[test]
fn communicators_work_as_trait_objects_on_caller_threads() {
    // The lower-level constructor: the caller runs its own threads.
    let comms = InprocComm::create_world(2, CommOptions::default()).unwrap();
    let results: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let c: Arc<dyn Communicator> = Arc::new(c);
                    let b = Buffer::F32(vec![c.rank() as f32 + 1.0; 5]);
                    c.all_reduce(b, ReduceOp::Sum)
                        .wait_one()
                        .unwrap()
                        .into_f32()
                        .unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results, vec![vec![3.0; 5], vec![3.0; 5]]);
}

#[test]
fn waiting_for_the_wrong_number_of_buffers_is_an_error_not_a_panic() {
    let out = run_ranks(2, CommOptions::default(), |comm, _| {
        let one = comm.barrier().wait_one().unwrap_err();
        let pair = comm
            .all_reduce(make(DType::F32, 8, 0, 1), ReduceOp::Sum)
            .wait_pair()
            .unwrap_err();
        Ok::<_, CommError>((one.to_string(), pair.to_string()))
    })
    .unwrap();
    for (one, pair) in out {
        assert!(
            one.contains("wait_one expects") && one.contains("returned 0"),
            "{one}"
        );
        assert!(
            pair.contains("wait_pair expects") && pair.contains("returned 1"),
            "{pair}"
        );
    }
}

#[test]
fn all_to_all_sends_chunk_j_to_member_j_and_counts_the_bytes_that_cross_hosts() {
    use zerodp::comm::Partition;
    // Chunk j of rank r's input is tagged (r, j); member j must find it at chunk index(r).
    let tag = |from: usize, to: usize, i: usize| (from * 100 + to * 10 + i % 7) as f32;
    for n in 1..=6 {
        for part in [Partition::World, Partition::Within(2), Partition::Across(2)] {
            if !part.fits(n) {
                continue;
            }
            let g = part.group_size(n);
            let chunk = 2049;
            let options = CommOptions {
                ranks_per_host: (n % 2 == 0).then_some(2),
                ..CommOptions::default()
            };
            let out = run_ranks(n, options, |comm, r| {
                let fill = |f: &dyn Fn(usize, usize) -> f32| {
                    let v: Vec<f32> = (0..g * chunk).map(|e| f(e / chunk, e % chunk)).collect();
                    Buffer::from_f32(DType::BF16, &v)
                };
                let input = fill(&|j, i| tag(r, part.member(r, j), i));
                let want = fill(&|j, i| tag(part.member(r, j), r, i));
                let out = Buffer::zeros(DType::BF16, g * chunk);
                let (back, got) = comm.all_to_all_group(part, input, out).wait_pair()?;
                assert_eq!(back.len(), g * chunk);
                Ok::<_, CommError>((got == want, comm.traffic()))
            })
            .unwrap();
            for (r, (same, t)) in out.iter().enumerate() {
                assert!(same, "world {n} {part:?} rank {r}: chunks misplaced");
                let each = ((g - 1) * chunk * 2) as u64;
                assert_eq!(t.sent(CollectiveKind::AllToAll), each);
                assert_eq!(t.recv(CollectiveKind::AllToAll), each);
                // Across hosts of two, every peer of an `Across` group is on another host and no
                // peer of a `Within` group is.
                let remote = match (n % 2 == 0, part) {
                    (false, _) | (true, Partition::Within(2)) => 0,
                    (true, Partition::Across(2)) => each,
                    (true, _) => ((n - 2) * chunk * 2) as u64,
                };
                assert_eq!(t.inter_host_sent(), remote, "world {n} {part:?} rank {r}");
            }
        }
    }
    // Chunks that do not divide, or buffers that differ, are refused before any rank meets.
    let e = run_ranks(2, CommOptions::default(), |comm, _| {
        comm.all_to_all_group(
            Partition::World,
            Buffer::zeros(DType::F32, 5),
            Buffer::zeros(DType::F32, 5),
        )
        .wait_pair()
        .map(|_| ())
    })
    .unwrap_err();
    assert!(e.to_string().contains("multiple of the group size"), "{e}");
}
