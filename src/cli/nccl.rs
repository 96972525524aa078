//! `--nccl` (`bench comm`, `train`): the collectives through NCCL on the GPUs (a `cuda` build),
//! in-process one rank per GPU as threads, or under MPI one process per GPU (its local rank's),
//! MPI carrying NCCL's unique id.

use std::sync::Arc;

use zerodp::comm::{CommError, CommOptions, Communicator};

/// `--nccl` in this build: an error saying how to get it where the build has no `cuda` feature.
pub fn available() -> anyhow::Result<()> {
    match cfg!(feature = "cuda") {
        true => Ok(()),
        false => Err(not_built()),
    }
}

/// The GPUs this process sees, for `--nccl` (an error naming the flag where there are none).
pub fn gpus() -> anyhow::Result<usize> {
    match zerodp::device::gpu_count() {
        Ok(0) => Err(anyhow::anyhow!("--nccl: this process sees no GPU")),
        Ok(n) => Ok(n),
        Err(zerodp::device::DeviceError::NoGpu { reason }) => Err(anyhow::anyhow!(
            "--nccl found no usable GPU: {reason}. Check nvidia-smi and CUDA_VISIBLE_DEVICES, or \
             drop --nccl to use the host backends"
        )),
        Err(e) => Err(anyhow::anyhow!("--nccl: {e}")),
    }
}

fn not_built() -> anyhow::Error {
    anyhow::anyhow!(
        "--nccl needs a GPU build: this zerodp was built without the `cuda` feature (NCCL comes \
         with it); build it with scripts/cuda-build.sh (docs/gpus.md)"
    )
}

/// Each in-process rank's times of every case (what `all_cases` returns), `n` ranks on GPUs
/// `0..n` as threads.
#[cfg(feature = "cuda")]
pub fn in_process<T: Send>(
    n: usize,
    options: CommOptions,
    all_cases: &(dyn Fn(&dyn Communicator) -> Result<T, CommError> + Sync),
) -> anyhow::Result<Vec<T>> {
    let gpus = gpus()?;
    if n > gpus {
        anyhow::bail!(
            "--nccl --world-size {n}: this process sees {gpus} GPU(s) and NCCL takes one rank per \
             GPU; use --world-size {gpus} or fewer (or drop --nccl: the in-process backend lets \
             ranks share memory)"
        );
    }
    let ordinals: Vec<usize> = (0..n).collect();
    let comms = zerodp::comm::NcclComm::group(&ordinals, options)?;
    std::thread::scope(|s| {
        let ranks: Vec<_> = (comms.iter())
            .map(|comm| s.spawn(move || all_cases(comm)))
            .collect();
        ranks
            .into_iter()
            .map(|rank| match rank.join() {
                Ok(times) => times.map_err(anyhow::Error::from),
                Err(_) => Err(anyhow::anyhow!("an NCCL rank's thread panicked")),
            })
            .collect()
    })
}

/// `train --nccl` in-process: one NCCL rank per in-process rank, rank r on `ordinals[r]` (the
/// GPU its model computes on), refused where two ranks would share a GPU.
#[cfg(feature = "cuda")]
pub fn group(
    ordinals: &[usize],
    options: CommOptions,
) -> anyhow::Result<Vec<Arc<dyn Communicator>>> {
    check_one_rank_per_gpu(ordinals)?;
    let comms = zerodp::comm::NcclComm::group(ordinals, options)?;
    Ok(comms
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Communicator>)
        .collect())
}

#[cfg(not(feature = "cuda"))]
pub fn group(
    ordinals: &[usize],
    _options: CommOptions,
) -> anyhow::Result<Vec<Arc<dyn Communicator>>> {
    check_one_rank_per_gpu(ordinals)?;
    Err(not_built())
}

/// NCCL takes one rank per GPU: refuses two ranks on one (`--device cuda:N` with more than one
/// rank, or more ranks than GPUs).
pub fn check_one_rank_per_gpu(ordinals: &[usize]) -> anyhow::Result<()> {
    for (r, o) in ordinals.iter().enumerate() {
        if let Some(first) = ordinals[..r].iter().position(|x| x == o) {
            anyhow::bail!(
                "--nccl takes one rank per GPU, but ranks {first} and {r} both compute on \
                 cuda:{o}; use --device cuda with at most one rank per GPU (--world-size), or \
                 drop --nccl (the host backends let ranks share a GPU)"
            );
        }
    }
    Ok(())
}

/// This MPI process's NCCL rank on GPU `ordinal`, keeping `carrier` (MPI) for as long as it
/// lives; refused where the host's `local_size` processes outnumber its GPUs, or all compute on
/// one GPU (`pinned`: `--device cuda:N`).
#[cfg(feature = "cuda")]
pub fn over_mpi(
    carrier: Arc<dyn Communicator>,
    (ordinal, local_size, pinned): (usize, usize, bool),
    options: CommOptions,
) -> anyhow::Result<Box<dyn Communicator>> {
    check_processes_per_gpu(local_size, pinned)?;
    let comm = zerodp::comm::NcclComm::over(carrier, ordinal, options)?;
    Ok(Box::new(comm))
}

/// NCCL takes one rank per GPU: refuses more processes on a host than it has GPUs, or several
/// processes of a host all pinned to one GPU.
#[cfg(feature = "cuda")]
fn check_processes_per_gpu(local_size: usize, pinned: bool) -> anyhow::Result<()> {
    let gpus = gpus()?;
    if local_size > gpus {
        anyhow::bail!(
            "--nccl: {local_size} processes on this host but it has {gpus} GPU(s), and NCCL takes \
             one rank per GPU; start at most {gpus} processes per host (mpirun -npernode {gpus})"
        );
    }
    if pinned && local_size > 1 {
        anyhow::bail!(
            "--nccl: the {local_size} processes on this host all compute on one GPU (--device \
             cuda:N), and NCCL takes one rank per GPU; use --device cuda (each process on its \
             local rank's GPU)"
        );
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn in_process<T: Send>(
    _n: usize,
    _options: CommOptions,
    _all_cases: &(dyn Fn(&dyn Communicator) -> Result<T, CommError> + Sync),
) -> anyhow::Result<Vec<T>> {
    Err(not_built())
}

#[cfg(not(feature = "cuda"))]
pub fn over_mpi(
    _carrier: Arc<dyn Communicator>,
    _at: (usize, usize, bool),
    _options: CommOptions,
) -> anyhow::Result<Box<dyn Communicator>> {
    Err(not_built())
}
