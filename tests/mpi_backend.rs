//! The MPI backend under `mpirun` (needs `--features mpi`; every test skips with a message when
//! `mpirun` is not installed):
//! * collectives of every dtype, op and form, bitwise equal to the serial reference (and so to the
//!   in-process backend), through both the point-to-point and the shared-memory paths;
//! * `zerodp train` under `mpirun -np 2` and `-np 4`: losses and gradient norms bitwise equal to
//!   an in-process run of the same config, stages 0-3, fp32 and bf16;
//! * a timeout names the collective, its sequence number and the missing rank; a mismatch shows
//!   both calls; a rank killed mid-training ends the job promptly, named.
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use zerodp::comm::reduce::reduce_reference;
use zerodp::comm::{
    shard_range, CollectiveKind, CommError, CommOptions, Communicator, MpiComm, Partition, ReduceOp,
};
use zerodp::flat::{Buffer, DType};

// As in the zerodp binary: large buffers in shared memory under mpirun.
#[global_allocator]
static ALLOC: zerodp::comm::ShmAlloc = zerodp::comm::ShmAlloc;

const WORKER_ENV: &str = "ZERODP_MPI_TEST_WORKER";

fn mpirun() -> Option<PathBuf> {
    let out = Command::new("sh")
        .args(["-c", "command -v mpirun"])
        .output()
        .ok()?;
    let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !p.is_empty()).then(|| PathBuf::from(p))
}

/// `mpirun -np <np> <program> <args>` as root, oversubscribed, with `env`.
fn mpirun_cmd(np: usize, program: &Path, args: &[&str], env: &[(&str, &str)]) -> Option<Command> {
    let Some(mpirun) = mpirun() else {
        eprintln!("SKIPPED: mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
        return None;
    };
    let mut c = Command::new(mpirun);
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &np.to_string(),
    ])
    .arg(program)
    .args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    Some(c)
}

/// Runs this test binary's `worker` test (filtered by name) on `np` ranks.
fn run_worker(np: usize, worker: &str, env: &[(&str, &str)]) -> Option<Output> {
    let exe = std::env::current_exe().unwrap();
    let mut all_env = vec![(WORKER_ENV, worker)];
    all_env.extend_from_slice(env);
    let mut c = mpirun_cmd(
        np,
        &exe,
        &[worker, "--exact", "--nocapture", "--test-threads", "1"],
        &all_env,
    )?;
    Some(c.output().unwrap())
}

fn is_worker(name: &str) -> bool {
    std::env::var(WORKER_ENV).is_ok_and(|v| v == name)
}

/// Deterministic inputs of rank `rank`: values spread over a few binades, signs mixed, so that the
/// summation order shows in the bits.
fn input(dtype: DType, len: usize, rank: usize, salt: u64) -> Buffer {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (rank as u64 * 7919 + salt * 104729 + len as u64);
    let vals: Vec<f32> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let m = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            m * [1.0, 3.0e-3, 250.0, 0.07][(x & 3) as usize]
        })
        .collect();
    match dtype {
        DType::F32 => Buffer::F32(vals),
        DType::BF16 => Buffer::BF16(vals.iter().map(|&v| half::bf16::from_f32(v)).collect()),
        DType::F16 => Buffer::F16(vals.iter().map(|&v| half::f16::from_f32(v)).collect()),
    }
}

fn bits(b: &Buffer) -> Vec<u32> {
    match b {
        Buffer::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
        Buffer::BF16(v) => v.iter().map(|x| u32::from(x.to_bits())).collect(),
        Buffer::F16(v) => v.iter().map(|x| u32::from(x.to_bits())).collect(),
    }
}

fn worker_collectives() -> Result<(), CommError> {
    let comm = MpiComm::init(CommOptions::default())?;
    let (n, r) = (comm.world_size(), comm.rank());
    let mut checked = 0;
    // 1001: odd shards, point-to-point; 700_001 f32 (2.8 MB): shared memory on one host.
    for len in [1001usize, 700_001] {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let salt = checked as u64;
                let all: Vec<Buffer> = (0..n).map(|k| input(dtype, len, k, salt)).collect();
                let refs: Vec<&Buffer> = all.iter().collect();
                let expect = reduce_reference(&refs, op);
                let mine = shard_range(len, n, r);
                let ctx = format!("{dtype} {op:?} len {len} rank {r}");

                let got = comm.all_reduce(all[r].clone(), op).wait_one()?;
                assert_eq!(bits(&got), bits(&expect), "all_reduce {ctx}");

                let out = Buffer::zeros(dtype, mine.len());
                let (_, got) = comm.reduce_scatter(all[r].clone(), out, op).wait_pair()?;
                assert_eq!(
                    bits(&got),
                    bits(&expect.copy_range(mine.clone())),
                    "reduce_scatter {ctx}"
                );
                let got = comm
                    .reduce_scatter_in_place(all[r].clone(), op)
                    .wait_one()?;
                assert_eq!(
                    bits(&got.copy_range(mine.clone())),
                    bits(&expect.copy_range(mine.clone())),
                    "reduce_scatter_in_place {ctx}"
                );
                checked += 1;
            }
            // All-gather: every rank contributes its shard of rank 0's input.
            let full = input(dtype, len, 0, 99);
            let mine = shard_range(len, n, r);
            let (_, got) = comm
                .all_gather(full.copy_range(mine.clone()), Buffer::zeros(dtype, len))
                .wait_pair()?;
            assert_eq!(bits(&got), bits(&full), "all_gather {dtype} {len}");
            let mut buf = Buffer::zeros(dtype, len);
            buf.write_at(mine.start, &full.copy_range(mine.clone()));
            let got = comm.all_gather_in_place(buf).wait_one()?;
            assert_eq!(bits(&got), bits(&full), "all_gather_in_place {dtype} {len}");
            let root = 1 % n;
            let b = if r == root {
                full.clone()
            } else {
                Buffer::zeros(dtype, len)
            };
            let got = comm.broadcast(b, root).wait_one()?;
            assert_eq!(bits(&got), bits(&full), "broadcast {dtype} {len}");
        }
    }
    comm.barrier().wait()?;
    let t = comm.traffic();
    assert_eq!(t.calls(CollectiveKind::AllReduce), 18);
    assert_eq!(t.calls(CollectiveKind::ReduceScatter), 36);
    assert_eq!(t.calls(CollectiveKind::AllGather), 12);
    // Ring formula: all-gather of (len - shard) elements each way, twice per dtype and length.
    let ag: u64 = [1001usize, 700_001]
        .iter()
        .flat_map(|&len| {
            [4u64, 2, 2].map(move |esz| 2 * esz * (len - shard_range(len, n, r).len()) as u64)
        })
        .sum();
    assert_eq!(t.sent(CollectiveKind::AllGather), ag);
    let topo = comm.topology();
    // Across hosts numbered host by host, part of those bytes went to the other host.
    assert_eq!(t.inter_host_sent() > 0, topo.ranks_per_host().is_some());
    // Gathers within groups (hpZ's within a host; across hosts): each group gathers its own
    // shards of the same tensor; within a host, nothing crosses to another.
    for part in [Partition::Within(2), Partition::Across(2)] {
        if !part.fits(n) {
            continue;
        }
        for len in [1001usize, 700_001] {
            let full = input(DType::F32, len, 0, 7);
            let mine = shard_range(len, part.group_size(n), part.index(r));
            let mut buf = Buffer::zeros(DType::F32, len);
            buf.write_at(mine.start, &full.copy_range(mine));
            let before = comm.traffic();
            let got = comm.all_gather_group_in_place(part, buf).wait_one()?;
            assert_eq!(
                bits(&got),
                bits(&full),
                "all_gather {part:?} {len} rank {r}"
            );
            let crossed = comm.traffic().since(&before).inter_host_sent();
            if topo.ranks_per_host() == Some(2) && part == Partition::Within(2) {
                assert_eq!(crossed, 0, "{part:?} {len} rank {r}");
            }
        }
    }
    check_all_to_all(&comm, n, r)?;
    let (hosts, shm) = (topo.hosts, comm.shared_memory_calls());
    println!(
        "WORKER-OK rank {r} on {hosts} host(s): {checked} reductions bitwise equal, \
         {shm} collectives through shared memory"
    );
    Ok(())
}

/// All-to-all within the world and within and across hosts of two: every chunk arrives where it
/// was sent, bit for bit, and the counters book every chunk but the own one each way.
fn check_all_to_all(comm: &MpiComm, n: usize, r: usize) -> Result<(), CommError> {
    let value = |from: usize, to: usize, i: usize| ((from * 31 + to * 7 + i) % 2000) as f32;
    for part in [Partition::World, Partition::Within(2), Partition::Across(2)] {
        if !part.fits(n) {
            continue;
        }
        let g = part.group_size(n);
        for (dtype, chunk) in [(DType::F32, 1001usize), (DType::F16, 350_001)] {
            let fill = |f: &dyn Fn(usize, usize) -> f32| {
                let v: Vec<f32> = (0..g * chunk).map(|e| f(e / chunk, e % chunk)).collect();
                Buffer::from_f32(dtype, &v)
            };
            let input = fill(&|j, i| value(r, part.member(r, j), i));
            let want = fill(&|j, i| value(part.member(r, j), r, i));
            let before = comm.traffic();
            let out = Buffer::zeros(dtype, g * chunk);
            let (_, got) = comm.all_to_all_group(part, input, out).wait_pair()?;
            assert_eq!(
                bits(&got),
                bits(&want),
                "all_to_all {part:?} {dtype} rank {r}"
            );
            let t = comm.traffic().since(&before);
            let each = ((g - 1) * chunk * dtype.size()) as u64;
            assert_eq!(t.sent(CollectiveKind::AllToAll), each, "{part:?} rank {r}");
        }
    }
    Ok(())
}

#[test]
fn worker() {
    if is_worker("worker") {
        worker_collectives().unwrap();
    }
}

#[test]
fn collectives_are_bitwise_equal_to_the_reference_on_2_and_4_ranks() {
    for np in [2, 4] {
        for shm in ["1", "0"] {
            let Some(out) = run_worker(np, "worker", &[("ZERODP_SHM", shm)]) else {
                return;
            };
            let stdout = String::from_utf8_lossy(&out.stdout);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success(),
                "np {np} shm {shm}: {stdout}\n{stderr}"
            );
            assert_eq!(
                stdout.matches("WORKER-OK").count(),
                np,
                "np {np} shm {shm}: {stdout}"
            );
        }
    }
}

#[test]
fn worker_faults() {
    if !is_worker("worker_faults") {
        return;
    }
    let options = CommOptions {
        timeout: Duration::from_secs(1),
        ..CommOptions::default()
    };
    let comm = MpiComm::init(options).unwrap();
    let r = comm.rank();
    // A mismatch: different lengths at sequence #0.
    let e = comm
        .all_reduce(Buffer::F32(vec![1.0; 10 + r]), ReduceOp::Sum)
        .wait_one()
        .unwrap_err();
    println!("FAULT rank {r}: {e}");
    std::process::exit(if matches!(e, CommError::Mismatch { .. }) {
        3
    } else {
        4
    });
}

#[test]
fn worker_timeout() {
    if !is_worker("worker_timeout") {
        return;
    }
    let options = CommOptions {
        timeout: Duration::from_secs(1),
        ..CommOptions::default()
    };
    let comm = MpiComm::init(options).unwrap();
    let r = comm.rank();
    comm.barrier().wait().unwrap();
    if r == 1 {
        // Never comes to collective #1; exits after rank 0 has timed out.
        std::thread::sleep(Duration::from_secs(4));
        std::process::exit(5);
    }
    let e = comm.barrier().wait().unwrap_err();
    println!("FAULT rank {r}: {e}");
    std::process::exit(if matches!(e, CommError::Timeout { .. }) {
        3
    } else {
        4
    });
}

#[test]
fn a_mismatch_shows_both_calls_and_a_timeout_names_the_missing_rank() {
    let Some(out) = run_worker(2, "worker_faults", &[]) else {
        return;
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(
        stdout.contains("collective mismatch at sequence #0")
            && stdout.contains("all_reduce(sum, 10 x f32)")
            && stdout.contains("all_reduce(sum, 11 x f32)"),
        "{stdout}"
    );
    let started = Instant::now();
    let out = run_worker(2, "worker_timeout", &[]).unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(
        stdout.contains("collective timed out: barrier (sequence #1)")
            && stdout.contains("ranks that did not: [1]"),
        "{stdout}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// A private copy of the zerodp binary: the target directory may be shared with other builds
/// that replace `target/debug/zerodp` while the test runs.
fn zerodp_bin(dir: &Path) -> PathBuf {
    let copy = dir.join("zerodp");
    std::fs::copy(env!("CARGO_BIN_EXE_zerodp"), &copy).unwrap();
    copy
}

fn corpus(dir: &Path) -> PathBuf {
    let text = dir.join("text.txt");
    let words = [
        "zero",
        "redundancy",
        "optimizer",
        "shards",
        "states",
        "gradients",
        "and",
        "params",
    ];
    let mut s = String::new();
    let mut x = 7u32;
    for _ in 0..6000 {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
        s.push_str(words[(x >> 16) as usize % words.len()]);
        s.push(' ');
    }
    std::fs::write(&text, s).unwrap();
    text
}

fn config(dir: &Path, stage: usize, bf16: bool) -> PathBuf {
    config_with(dir, stage, bf16, "")
}

/// [`config`] with `extra` keys in `zero_optimization` (each followed by a comma).
fn config_with(dir: &Path, stage: usize, bf16: bool, extra: &str) -> PathBuf {
    let tag = extra.len();
    let p = dir.join(format!(
        "s{stage}{}-{tag}.json",
        if bf16 { "bf16" } else { "" }
    ));
    let bf16 = if bf16 {
        r#""bf16": { "enabled": true },"#
    } else {
        ""
    };
    std::fs::write(
        &p,
        format!(
            r#"{{ "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, {bf16}
                 "optimizer": {{ "type": "AdamW", "params": {{ "lr": 3e-3 }} }},
                 "gradient_clipping": 1.0,
                 "zero_optimization": {{ "stage": {stage}, {extra} "reduce_bucket_size": 300000,
                   "stage3_param_persistence_threshold": 0 }} }}"#
        ),
    )
    .unwrap();
    p
}

/// `(rank, step, loss bits, grad_norm)` of every metrics line in `files`, sorted.
fn metrics(files: &[PathBuf]) -> Vec<(u64, u64, String, String)> {
    let mut v: Vec<_> = files
        .iter()
        .flat_map(|f| {
            std::fs::read_to_string(f)
                .unwrap_or_else(|e| panic!("{}: {e}", f.display()))
                .lines()
                .map(|l| {
                    let j: serde_json::Value = serde_json::from_str(l).unwrap();
                    (
                        j["rank"].as_u64().unwrap(),
                        j["step"].as_u64().unwrap(),
                        j["loss"].to_string(),
                        j["grad_norm"].to_string(),
                    )
                })
                .collect::<Vec<_>>()
        })
        .collect();
    v.sort();
    v
}

const TRAIN_ARGS: [&str; 10] = [
    "--model", "tiny", "--width", "160", "--layers", "2", "--steps", "3", "--seed", "5",
];

#[test]
fn training_under_mpirun_equals_in_process_bitwise_stages_0_to_3() {
    if mpirun().is_none() {
        eprintln!("SKIPPED: mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for (np, stages) in [(2usize, vec![0usize, 1, 2, 3]), (4, vec![1, 3])] {
        for &stage in &stages {
            for bf16 in [false, true] {
                if !(bf16 && np == 4) {
                    train_and_compare(None, dir.path(), np, stage, bf16);
                }
            }
        }
    }
}

/// Trains the tiny GPT under `mpirun` (on this host, or across `hosts`) and in-process at the
/// same world size, and asserts that every rank's losses and gradient norms are bitwise equal.
fn train_and_compare(hosts: Option<&NetnsHosts>, dir: &Path, np: usize, stage: usize, bf16: bool) {
    train_and_compare_with(hosts, dir, (np, stage, bf16), "");
}

/// [`train_and_compare`] with `extra` keys in the config's `zero_optimization`.
fn train_and_compare_with(
    hosts: Option<&NetnsHosts>,
    dir: &Path,
    (np, stage, bf16): (usize, usize, bool),
    extra: &str,
) {
    let bin = &zerodp_bin(dir);
    let text = corpus(dir);
    let cfg = config_with(dir, stage, bf16, extra);
    let tag = format!(
        "np{np}-s{stage}-{bf16}-{}-{}",
        hosts.map_or(1, |_| 2),
        extra.len()
    );
    let m_mpi = dir.join(format!("{tag}-mpi.jsonl"));
    let m_inp = dir.join(format!("{tag}-inp.jsonl"));
    let common = |m: &Path| -> Vec<String> {
        let mut a: Vec<String> = vec!["train".into(), "--config".into()];
        a.push(cfg.display().to_string());
        a.extend(TRAIN_ARGS.iter().map(|s| s.to_string()));
        a.extend(["--no-progress".into(), "--data".into()]);
        a.push(text.display().to_string());
        a.push("--metrics".into());
        a.push(m.display().to_string());
        a
    };
    let args = common(&m_mpi);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = launch_cmd(hosts, np, bin, &args, &[])
        .unwrap()
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{tag}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    if extra.contains("hpz") {
        assert!(stderr.contains("ZeRO++ hpZ"), "{tag}: hpZ is off\n{stderr}");
    }
    if extra.contains("quantized_gradients") {
        assert!(
            stderr.contains("int8 all-to-alls (qgZ)"),
            "{tag}: qgZ is off\n{stderr}"
        );
    }
    let mut args = common(&m_inp);
    args.extend(["--world-size".into(), np.to_string()]);
    args.extend(["--backend".into(), "inprocess".into()]);
    let out = Command::new(bin).args(&args).output().unwrap();
    assert!(
        out.status.success(),
        "{tag}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut files = vec![m_mpi.clone()];
    for k in 1..np {
        files.push(dir.join(format!("{tag}-mpi.rank{k}.jsonl")));
    }
    let a = metrics(&files);
    let b = metrics(&[m_inp]);
    assert_eq!(a.len(), 3 * np, "{tag}");
    assert_eq!(a, b, "{tag}: MPI and in-process runs differ");
}

/// The pid of the process of `rank` among `mpirun`'s descendants (found by its environment)
/// whose command line holds `marker`.
fn rank_pid(rank: usize, marker: &str) -> Option<u32> {
    let want = format!("OMPI_COMM_WORLD_RANK={rank}");
    let me = std::process::id();
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let is_zerodp = String::from_utf8_lossy(&cmd).contains(marker);
        if is_zerodp && env.split(|&b| b == 0).any(|v| v == want.as_bytes()) {
            return Some(pid);
        }
    }
    None
}

#[test]
fn killing_one_rank_ends_every_other_promptly_naming_it() {
    if mpirun().is_none() {
        eprintln!("SKIPPED: mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
        return;
    }
    kill_one_rank(None, 1);
}

/// Starts a long training run on 4 ranks (on this host, or 2 on each of `hosts`), kills rank
/// `victim`'s process with SIGKILL once training is under way, and asserts that the job ends
/// non-zero within 30 s with output naming the rank.
fn kill_one_rank(hosts: Option<&NetnsHosts>, victim: usize) {
    let dir = tempfile::tempdir().unwrap();
    let bin = &zerodp_bin(dir.path());
    let text = corpus(dir.path());
    let cfg = config(dir.path(), 2, false);
    let m = dir.path().join("kill-test-marker.jsonl");
    let (c, t, m_s) = (
        cfg.display().to_string(),
        text.display().to_string(),
        m.display().to_string(),
    );
    let args = [
        "train",
        "--config",
        &c,
        "--model",
        "tiny",
        "--steps",
        "100000",
        "--no-progress",
        "--data",
        &t,
        "--metrics",
        &m_s,
    ];
    let log = dir.path().join("log.txt");
    let mut child = Job(launch_cmd(hosts, 4, bin, &args, &[])
        .unwrap()
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::from(
            std::fs::File::create(dir.path().join("err.txt")).unwrap(),
        ))
        .spawn()
        .unwrap());
    let output = || {
        format!(
            "{}{}",
            std::fs::read_to_string(&log).unwrap_or_default(),
            std::fs::read_to_string(dir.path().join("err.txt")).unwrap_or_default()
        )
    };
    // Wait until training is under way.
    let until = Instant::now() + Duration::from_secs(120);
    while std::fs::read_to_string(&m).map_or(0, |s| s.lines().count()) < 3 {
        if let Some(s) = child.0.try_wait().unwrap() {
            panic!("the job ended before the kill ({s}): {}", output());
        }
        assert!(
            Instant::now() < until,
            "training did not start: {}",
            output()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let pid = rank_pid(victim, "kill-test-marker").expect("the victim rank's process");
    // SAFETY: sending a signal to a process this test started (through mpirun).
    unsafe { libc_kill(pid as i32, 9) };
    let killed_at = Instant::now();
    let status = loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            break s;
        }
        if killed_at.elapsed() > Duration::from_secs(30) {
            panic!("the other ranks did not exit within 30 s of rank {victim}'s death");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let all = output();
    assert!(!status.success(), "{all}");
    assert!(
        all.contains(&format!("rank {victim}")),
        "the output should name rank {victim}: {all}"
    );
    eprintln!(
        "job ended {:.1} s after rank {victim} was killed",
        killed_at.elapsed().as_secs_f64()
    );
}

/// A job that a scheduler restarts after every death: one command line (`--resume` with
/// `--save-dir`, a checkpoint each step) serves the first start and every restart. Rank 1 is
/// killed (SIGKILL) at five different steps, the same command is run again after each death,
/// and the final weights and every rank's loss and gradient norm at every step equal an
/// uninterrupted run's bit for bit.
#[test]
fn a_job_restarted_after_five_rank_deaths_ends_as_if_never_stopped() {
    if mpirun().is_none() {
        eprintln!("SKIPPED: mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
        return;
    }
    const STEPS: u64 = 36;
    let dir = tempfile::tempdir().unwrap();
    let bin = &zerodp_bin(dir.path());
    let text = corpus(dir.path());
    let cfg = config(dir.path(), 2, false);
    let command = |tag: &str, restartable: bool| -> Vec<String> {
        let p = |name: &str| dir.path().join(name).display().to_string();
        let mut a: Vec<String> = [
            "train", "--model", "tiny", "--width", "160", "--layers", "2",
        ]
        .map(String::from)
        .to_vec();
        a.extend(["--seed", "5", "--no-progress", "--steps"].map(String::from));
        a.push(STEPS.to_string());
        a.extend(["--config".into(), cfg.display().to_string()]);
        a.extend(["--data".into(), text.display().to_string()]);
        a.extend(["--metrics".into(), p(&format!("{tag}.jsonl"))]);
        a.extend(["--save".into(), p(&format!("{tag}.safetensors"))]);
        if restartable {
            a.extend([
                "--save-dir".into(),
                p("ck"),
                "--save-every".into(),
                "1".into(),
            ]);
            a.push("--resume".into());
        }
        a
    };
    let run_to_end = |args: &[String]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = mpirun_cmd(2, bin, &args, &[])
            .unwrap()
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run_to_end(&command("straight", false));
    let job = command("restart-marker", true);
    let rank1_metrics = dir.path().join("restart-marker.rank1.jsonl");
    let (mut deaths, mut starts) = (0, Vec::new());
    for kill_after in [3u64, 9, 15, 21, 27] {
        let args: Vec<&str> = job.iter().map(String::as_str).collect();
        let err = dir.path().join(format!("err-{kill_after}.txt"));
        let mut child = Job(mpirun_cmd(2, bin, &args, &[])
            .unwrap()
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap());
        let until = Instant::now() + Duration::from_secs(180);
        let last_step = || {
            let text = std::fs::read_to_string(&rank1_metrics).unwrap_or_default();
            let last = text
                .lines()
                .rev()
                .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok());
            last.and_then(|j| j["step"].as_u64()).unwrap_or(0)
        };
        while last_step() < kill_after && child.0.try_wait().unwrap().is_none() {
            assert!(
                Instant::now() < until,
                "{}",
                std::fs::read_to_string(&err).unwrap()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        if let Some(pid) = rank_pid(1, "restart-marker") {
            // SAFETY: a signal to a process this test started (through mpirun).
            unsafe { libc_kill(pid as i32, 9) };
        }
        let status = loop {
            if let Some(s) = child.0.try_wait().unwrap() {
                break s;
            }
            assert!(
                Instant::now() < until,
                "the job did not end after rank 1's death"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let log = std::fs::read_to_string(&err).unwrap();
        assert!(
            !status.success(),
            "the job finished before rank 1 was killed: {log}"
        );
        assert!(!log.contains("panicked"), "{log}");
        starts.push(resumed_at(&log));
        deaths += 1;
    }
    assert_eq!(deaths, 5);
    // The first start began at step 0; each restart went on from a later checkpoint.
    eprintln!("the five starts began after steps {starts:?}");
    assert_eq!(starts[0], Some(0));
    assert!(starts.windows(2).all(|w| w[0] < w[1]), "{starts:?}");
    run_to_end(&job);
    let files = |tag: &str| {
        [
            dir.path().join(format!("{tag}.jsonl")),
            dir.path().join(format!("{tag}.rank1.jsonl")),
        ]
    };
    let want = metrics(&files("straight"));
    assert_eq!(want.len(), 2 * STEPS as usize);
    assert_eq!(
        metrics(&files("restart-marker")),
        want,
        "a restarted step differs"
    );
    assert_eq!(
        std::fs::read(dir.path().join("restart-marker.safetensors")).unwrap(),
        std::fs::read(dir.path().join("straight.safetensors")).unwrap(),
        "the final weights differ"
    );
}

/// The step a run's log says it resumed after (0 for a start from the beginning).
fn resumed_at(log: &str) -> Option<u64> {
    if log.contains("holds no checkpoint yet") {
        return Some(0);
    }
    let rest = log.split("resuming from ").nth(1)?;
    let step = rest.split(" at step ").nth(1)?;
    step.split_whitespace().next()?.parse().ok()
}

/// Kills the job (mpirun, which takes its ranks down) if the test ends early.
struct Job(std::process::Child);

impl Drop for Job {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            // SIGTERM: mpirun forwards it to the ranks and reaps them (SIGKILL would orphan them).
            // SAFETY: a signal to the process this test started.
            unsafe { libc_kill(self.0.id() as i32, 15) };
            let until = Instant::now() + Duration::from_secs(10);
            while self.0.try_wait().ok().flatten().is_none() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// Checkpoints are the same under MPI: a run saved by `mpirun -np 2` at step 2 resumes in-process
/// (world size 2, bitwise as the unbroken run; world size 1, resharded), and an in-process save
/// resumes under `mpirun`.
#[test]
fn checkpoints_saved_under_mpirun_resume_in_process_and_back() {
    if mpirun().is_none() {
        eprintln!("SKIPPED: mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let bin = &zerodp_bin(dir.path());
    let text = corpus(dir.path());
    let cfg = config(dir.path(), 3, true);
    let args = |steps: &str, m: &Path, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = vec!["train".into(), "--config".into()];
        a.push(cfg.display().to_string());
        // TRAIN_ARGS without its `--steps 3`.
        let model = TRAIN_ARGS[..6].iter().chain(&TRAIN_ARGS[8..]);
        a.extend(model.map(|s| s.to_string()));
        a.extend(["--steps".into(), steps.into(), "--no-progress".into()]);
        a.extend(["--data".into(), text.display().to_string()]);
        a.extend(["--metrics".into(), m.display().to_string()]);
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let run_inproc = |a: Vec<String>, world: &str| {
        let out = Command::new(bin)
            .args(&a)
            .args(["--world-size", world, "--backend", "inprocess"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let straight = dir.path().join("straight.jsonl");
    run_inproc(args("4", &straight, &[]), "2");

    // Saved under mpirun at step 2, resumed in-process to step 4.
    let ck = dir.path().join("ck-mpi");
    let ck_s = ck.display().to_string();
    let m1 = dir.path().join("mpi.jsonl");
    let a = args("2", &m1, &["--save-dir", &ck_s]);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let out = mpirun_cmd(2, bin, &a, &[])
        .unwrap()
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(ck.join("step000002").join("manifest.json").exists());
    let m2 = dir.path().join("resumed.jsonl");
    run_inproc(args("4", &m2, &["--resume", &ck_s]), "2");
    let want: Vec<_> = metrics(std::slice::from_ref(&straight))
        .into_iter()
        .filter(|r| r.1 > 2)
        .collect();
    assert_eq!(metrics(&[m2]), want, "resumed in-process after an MPI save");
    let m3 = dir.path().join("resharded.jsonl");
    run_inproc(args("4", &m3, &["--resume", &ck_s]), "1");
    assert_eq!(metrics(&[m3]).len(), 2);

    // Saved in-process, resumed under mpirun.
    let ck2 = dir.path().join("ck-inp");
    let ck2_s = ck2.display().to_string();
    run_inproc(
        args("2", &dir.path().join("i.jsonl"), &["--save-dir", &ck2_s]),
        "2",
    );
    let m4 = dir.path().join("mpi-resumed.jsonl");
    let a = args("4", &m4, &["--resume", &ck2_s]);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let out = mpirun_cmd(2, bin, &a, &[])
        .unwrap()
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let files = [m4, dir.path().join("mpi-resumed.rank1.jsonl")];
    assert_eq!(
        metrics(&files),
        want,
        "resumed under mpirun after an in-process save"
    );
}

// ---------------------------------------------------------------------------------------------
// Several hosts on this one machine.

/// `mpirun` on this host (`None`) or across the two namespace hosts (`np / 2` ranks on each).
fn launch_cmd(
    hosts: Option<&NetnsHosts>,
    np: usize,
    program: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> Option<Command> {
    match hosts {
        None => mpirun_cmd(np, program, args, env),
        Some(h) => Some(h.mpirun(np, program, args, env)),
    }
}

/// Two hosts made on this machine: two network namespaces joined by a veth pair (10.77.0.1 and
/// 10.77.0.2), each run under its own hostname (a UTS namespace), as two machines on one
/// Ethernet segment would be. Open MPI starts its daemon on the second host through a launch
/// agent that plays ssh's part (`agent HOST COMMAND`: the command inside that host's namespace),
/// and its TCP transport carries the bytes between them, while ranks on the same host share
/// memory. Both namespaces (and the veth pair with them) are removed on drop.
struct NetnsHosts {
    names: [String; 2],
    agent: PathBuf,
    _dir: tempfile::TempDir,
}

const NETNS_IPS: [&str; 2] = ["10.77.0.1", "10.77.0.2"];

impl NetnsHosts {
    /// The two hosts, or why this environment cannot make them (the caller skips the test).
    fn new() -> Result<NetnsHosts, String> {
        mpirun().ok_or("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)")?;
        let id = std::process::id();
        let names = [format!("zdp{id}a"), format!("zdp{id}b")];
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let agent = dir.path().join("netns-agent.sh");
        let hosts = NetnsHosts {
            names: names.clone(),
            agent: agent.clone(),
            _dir: dir,
        };
        let (va, vb) = (format!("zv{id}a"), format!("zv{id}b"));
        let steps: Vec<Vec<String>> = vec![
            vec!["netns".into(), "add".into(), names[0].clone()],
            vec!["netns".into(), "add".into(), names[1].clone()],
            vec!["link", "add", &va, "type", "veth", "peer", "name", &vb]
                .into_iter()
                .map(String::from)
                .collect(),
        ];
        let mut steps = steps;
        for (i, (ns, veth)) in names.iter().zip([&va, &vb]).enumerate() {
            let ip = format!("{}/24", NETNS_IPS[i]);
            for s in [
                vec!["link", "set", veth, "netns", ns],
                vec!["-n", ns, "addr", "add", &ip, "dev", veth],
                vec!["-n", ns, "link", "set", veth, "up"],
                vec!["-n", ns, "link", "set", "lo", "up"],
            ] {
                steps.push(s.into_iter().map(String::from).collect());
            }
        }
        for s in &steps {
            let out = Command::new("ip")
                .args(s)
                .output()
                .map_err(|e| format!("cannot run `ip` (iproute2): {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "`ip {}` failed (network namespaces need root or CAP_SYS_ADMIN): {}",
                    s.join(" "),
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
        }
        let script = format!(
            "#!/bin/sh\n\
             # Open MPI's launch agent for the namespace hosts: `agent HOST COMMAND`, as ssh.\n\
             host=\"$1\"; shift\n\
             case \"$host\" in\n  {} ) ns={} ;;\n  {} ) ns={} ;;\n\
             \x20 * ) echo \"no such namespace host: $host\" >&2; exit 255 ;;\nesac\n\
             exec ip netns exec \"$ns\" unshare --uts sh -c \"hostname $ns && $*\"\n",
            NETNS_IPS[0], names[0], NETNS_IPS[1], names[1]
        );
        std::fs::write(&agent, script).map_err(|e| e.to_string())?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| e.to_string())?;
        Ok(hosts)
    }

    /// `mpirun` started on the first host with `np / 2` ranks on each host; `env` is exported
    /// to every rank (`-x`), as it must be for ranks on other hosts.
    fn mpirun(&self, np: usize, program: &Path, args: &[&str], env: &[(&str, &str)]) -> Command {
        assert!(np % 2 == 0, "ranks are split evenly over the two hosts");
        let mut c = Command::new("ip");
        c.args([
            "netns",
            "exec",
            &self.names[0],
            "unshare",
            "--uts",
            "sh",
            "-c",
        ])
        .arg("hostname \"$0\" && exec \"$@\"")
        .arg(&self.names[0])
        .arg(mpirun().unwrap())
        .args(["--allow-run-as-root", "--oversubscribe", "--host"])
        .arg(format!(
            "{}:{},{}:{}",
            NETNS_IPS[0],
            np / 2,
            NETNS_IPS[1],
            np / 2
        ))
        .args(["-np", &np.to_string(), "--mca", "plm_rsh_agent"])
        .arg(&self.agent)
        .args(["--mca", "btl_tcp_if_include", "10.77.0.0/24"])
        .args(["--mca", "oob_tcp_if_include", "10.77.0.0/24"]);
        for (k, v) in env {
            c.env(k, v).args(["-x", k]);
        }
        c.arg(program).args(args);
        c
    }
}

impl Drop for NetnsHosts {
    fn drop(&mut self) {
        for ns in &self.names {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

/// The hosts, or `None` after saying why the test skips.
fn netns_hosts() -> Option<NetnsHosts> {
    NetnsHosts::new()
        .map_err(|why| eprintln!("SKIPPED: cannot make namespace hosts: {why}"))
        .ok()
}

#[test]
fn collectives_across_two_namespace_hosts_are_bitwise_equal_to_the_reference() {
    let Some(hosts) = netns_hosts() else {
        return;
    };
    let exe = std::env::current_exe().unwrap();
    // 1 + 1 ranks: every message crosses hosts; 2 + 2: pairs on a host and pairs across.
    for np in [2, 4] {
        let args = ["worker", "--exact", "--nocapture", "--test-threads", "1"];
        let out = hosts
            .mpirun(np, &exe, &args, &[(WORKER_ENV, "worker")])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "np {np}: {stdout}\n{stderr}");
        assert_eq!(
            stdout.matches("on 2 host(s): ").count(),
            np,
            "np {np}: every rank should see two hosts: {stdout}"
        );
        // With 2 ranks on a host, the large collectives pair them through shared memory.
        let shm_lines = stdout
            .lines()
            .filter(|l| l.contains("WORKER-OK") && !l.contains(" 0 collectives through shared"));
        assert_eq!(shm_lines.count(), if np == 4 { np } else { 0 }, "{stdout}");
    }
}

#[test]
fn training_across_two_namespace_hosts_equals_in_process_bitwise() {
    let Some(hosts) = netns_hosts() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    for (np, stage, bf16) in [(2, 2, true), (4, 1, false), (4, 3, false), (4, 2, true)] {
        train_and_compare(Some(&hosts), dir.path(), np, stage, bf16);
    }
    // ZeRO++'s hpZ: "auto" is the launcher's 2 ranks per host under mpirun (the backward's
    // gathers stay in the host) and 1 in one process (plain stage 3): the same bits.
    let hpz = r#""zero_hpz_partition_size": "auto","#;
    for bf16 in [false, true] {
        train_and_compare_with(Some(&hosts), dir.path(), (4, 3, bf16), hpz);
    }
    // All of ZeRO++ (hpZ, qwZ, qgZ) on hosts of 2: in one process the partition stands for the
    // hosts, so qgZ's two all-to-alls (within, then across) run alike and give the same bits.
    let zeropp = r#""zero_hpz_partition_size": 2, "zero_quantized_weights": true,
        "zero_quantized_gradients": true,"#;
    train_and_compare_with(Some(&hosts), dir.path(), (4, 3, false), zeropp);
}

#[test]
fn killing_a_rank_on_another_host_ends_the_job_naming_it() {
    let Some(hosts) = netns_hosts() else {
        return;
    };
    // Ranks 2 and 3 run on the second host.
    kill_one_rank(Some(&hosts), 3);
}
