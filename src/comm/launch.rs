//! How this process was started: by an MPI launcher (`mpirun`, `srun` with PMI) or on its own.
//! Compiled with or without the `mpi` feature, so a binary without it can still say that it was
//! started by `mpirun` and how to build one that can take part.

/// What the launcher told this process through its environment (before MPI is initialised).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MpiLaunch {
    /// The job's number of processes (`OMPI_COMM_WORLD_SIZE`, `PMI_SIZE` or `PMIX_SIZE`).
    pub size: usize,
    /// This process's rank when the launcher gives it (`OMPI_COMM_WORLD_RANK`, `PMI_RANK`,
    /// `PMIX_RANK`).
    pub rank: Option<usize>,
    /// Processes of the job on this host when the launcher says (`OMPI_COMM_WORLD_LOCAL_SIZE`,
    /// `MPI_LOCALNRANKS`, `PMIX_LOCAL_SIZE`): they share this host's memory.
    pub local_size: Option<usize>,
}

/// The MPI launch this process is part of, if any: Open MPI's `mpirun` sets
/// `OMPI_COMM_WORLD_SIZE`, MPICH's Hydra and Slurm's PMI set `PMI_SIZE`.
pub fn detect_mpi_launch() -> Option<MpiLaunch> {
    detect_from(|k| std::env::var(k).ok())
}

/// [`detect_mpi_launch`] over any variable lookup (testable without touching the environment).
pub(crate) fn detect_from(var: impl Fn(&str) -> Option<String>) -> Option<MpiLaunch> {
    let num = |k: &str| var(k).and_then(|v| v.trim().parse::<usize>().ok());
    let size = num("OMPI_COMM_WORLD_SIZE")
        .or_else(|| num("PMI_SIZE"))
        .or_else(|| num("PMIX_SIZE"))?;
    let rank = num("OMPI_COMM_WORLD_RANK")
        .or_else(|| num("PMI_RANK"))
        .or_else(|| num("PMIX_RANK"));
    let local_size = num("OMPI_COMM_WORLD_LOCAL_SIZE")
        .or_else(|| num("MPI_LOCALNRANKS"))
        .or_else(|| num("PMIX_LOCAL_SIZE"));
    Some(MpiLaunch {
        size,
        rank,
        local_size,
    })
}

/// Whether this build has the MPI backend (the `mpi` cargo feature).
pub const MPI_AVAILABLE: bool = cfg!(feature = "mpi");

/// What to tell a user who asked for MPI from a build without it.
pub const MPI_BUILD_HINT: &str = "this zerodp was built without MPI support: install Open MPI and \
     libclang (Debian/Ubuntu: apt-get install libopenmpi-dev openmpi-bin libclang-dev) and build \
     with `cargo build --release --features mpi`";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launchers_are_recognised_by_their_variables() {
        let none = detect_from(|_| None);
        assert_eq!(none, None);
        let ompi = detect_from(|k| match k {
            "OMPI_COMM_WORLD_SIZE" => Some("4".into()),
            "OMPI_COMM_WORLD_RANK" => Some("2".into()),
            "OMPI_COMM_WORLD_LOCAL_SIZE" => Some("2".into()),
            _ => None,
        });
        assert_eq!(
            ompi,
            Some(MpiLaunch {
                size: 4,
                rank: Some(2),
                local_size: Some(2),
            })
        );
        let pmi = detect_from(|k| (k == "PMI_SIZE").then(|| "2".into()));
        assert_eq!(
            pmi,
            Some(MpiLaunch {
                size: 2,
                rank: None,
                local_size: None,
            })
        );
    }
}
