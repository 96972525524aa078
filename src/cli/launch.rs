//! `--backend`: whether this process runs every rank as a thread or is one rank of an MPI job.
//!
//! `auto` (the default) picks MPI when the process was started by an MPI launcher
//! (`OMPI_COMM_WORLD_SIZE` or `PMI_SIZE` set) and the binary has the `mpi` feature; started by
//! `mpirun` without the feature it refuses (each process would otherwise train alone, all writing
//! the same files) and says how to build with MPI.

use anyhow::bail;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use zerodp::comm::launch::{detect_mpi_launch, MPI_AVAILABLE, MPI_BUILD_HINT};
use zerodp::comm::{CommOptions, Communicator};

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// MPI when started by mpirun (or another MPI launcher), else in-process.
    #[default]
    Auto,
    /// Every rank a thread of this process (`--world-size` of them).
    #[value(alias = "in-process")]
    Inprocess,
    /// One rank per process of an MPI job (`mpirun -np N zerodp ...`).
    Mpi,
}

/// The backend resolved against the environment, with the world size it implies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolved {
    InProcess {
        world: usize,
    },
    /// `world` processes, as the launcher says (1 when forced without a launcher: a singleton).
    Mpi {
        world: usize,
    },
}

impl Resolved {
    pub fn world(self) -> usize {
        match self {
            Resolved::InProcess { world } | Resolved::Mpi { world } => world,
        }
    }

    /// The ranks this process runs, which share its memory: all of them in-process, one under
    /// MPI.
    pub fn ranks_in_process(self) -> usize {
        match self {
            Resolved::InProcess { world } => world,
            Resolved::Mpi { .. } => 1,
        }
    }
}

/// Resolves `--backend` and `--world-size` (`None` when not given).
pub fn resolve(choice: BackendChoice, world_size: Option<usize>) -> anyhow::Result<Resolved> {
    let launch = detect_mpi_launch();
    let mpi = match choice {
        BackendChoice::Inprocess => false,
        BackendChoice::Mpi => {
            if !MPI_AVAILABLE {
                bail!("--backend mpi: {MPI_BUILD_HINT}");
            }
            true
        }
        BackendChoice::Auto => match launch {
            Some(l) if !MPI_AVAILABLE => bail!(
                "started by an MPI launcher ({} processes) but {MPI_BUILD_HINT}; or pass \
                 --backend inprocess to run every process as an independent in-process job",
                l.size
            ),
            Some(_) => true,
            None => false,
        },
    };
    if !mpi {
        let world = world_size.unwrap_or(1);
        if world == 0 {
            bail!("--world-size must be at least 1");
        }
        return Ok(Resolved::InProcess { world });
    }
    let size = launch.map_or(1, |l| l.size);
    if let Some(w) = world_size {
        if w != size {
            bail!(
                "--world-size {w} does not match the MPI job's {size} processes: under MPI every \
                 process is one rank, so omit --world-size or set it to the process count \
                 (mpirun -np {w} ...)"
            );
        }
    }
    Ok(Resolved::Mpi { world: size })
}

/// The metrics (or other per-rank output) file of `rank`: rank 0 keeps `path`, rank k writes
/// `<stem>.rank<k>.<ext>` next to it (`metrics.jsonl` -> `metrics.rank1.jsonl`).
pub fn per_rank_path(path: &Path, rank: usize) -> PathBuf {
    if rank == 0 {
        return path.to_path_buf();
    }
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name = match path.extension() {
        Some(ext) => format!("{stem}.rank{rank}.{}", ext.to_string_lossy()),
        None => format!("{stem}.rank{rank}"),
    };
    path.with_file_name(name)
}

/// This process's rank of the MPI job, with its communication thread running.
#[cfg(feature = "mpi")]
pub fn start_mpi(
    options: CommOptions,
    expected_world: usize,
) -> anyhow::Result<(Arc<dyn Communicator>, zerodp::comm::MpiTopology)> {
    let comm = zerodp::comm::MpiComm::init(options)?;
    let topo = comm.topology();
    if topo.size != expected_world {
        bail!(
            "MPI reports {} processes but the launcher's environment said {expected_world}",
            topo.size
        );
    }
    Ok((Arc::new(comm), topo))
}

/// Without the `mpi` feature `resolve` never picks MPI.
#[cfg(not(feature = "mpi"))]
pub fn start_mpi(
    _options: CommOptions,
    _expected_world: usize,
) -> anyhow::Result<(Arc<dyn Communicator>, NoTopology)> {
    bail!("{MPI_BUILD_HINT}")
}

/// Stand-in for `MpiTopology` in builds without MPI.
#[cfg(not(feature = "mpi"))]
#[derive(Clone, Copy, Debug)]
pub struct NoTopology {
    pub local_size: usize,
    pub local_rank: usize,
}

/// Rayon threads for one rank process: the host's cores shared among the ranks on this host.
pub fn threads_for_local_ranks(local_ranks: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / local_ranks.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_zero_keeps_the_metrics_name_and_others_get_a_suffix() {
        let p = Path::new("/tmp/run/metrics.jsonl");
        assert_eq!(per_rank_path(p, 0), p);
        assert_eq!(
            per_rank_path(p, 3),
            Path::new("/tmp/run/metrics.rank3.jsonl")
        );
        assert_eq!(per_rank_path(Path::new("m"), 1), Path::new("m.rank1"));
    }
}
