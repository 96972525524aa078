//! Where a rank computes: the CPU, or one NVIDIA GPU (the `cuda` feature).
//!
//! The device is a tier and a backend, not a fork of the engine: the engine (`zero`) keeps its flat
//! host buffers, shards, communicator and optimizer whatever the device; a model built for a GPU
//! ([`crate::model`]) runs each unit's forward and backward there. This module names the device a
//! user asks for (`--device cpu|cuda|cuda:N`), picks a GPU for a rank, and reads a GPU's memory for
//! the pre-flight and the planner. It depends on nothing in the crate (and on cudarc's driver API
//! only when built with `cuda`).

use std::fmt;
use std::str::FromStr;

/// The environment variables a launcher sets to a process's rank among those on its host, read in
/// this order: torchrun's and DeepSpeed's, Open MPI's, MPICH's (Hydra), Slurm's.
pub const LOCAL_RANK_ENV: [&str; 4] = [
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "SLURM_LOCALID",
];

/// The device a user asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ComputeDevice {
    /// The CPU (every core of the process, shared among in-process ranks).
    #[default]
    Cpu,
    /// An NVIDIA GPU: `Some(n)` is `cuda:n`; `None` (`cuda`) takes the process's local rank modulo
    /// the GPUs it sees, so that `mpirun -np 8` on an 8-GPU host gives one GPU per rank.
    Cuda(Option<usize>),
}

impl ComputeDevice {
    pub fn is_cuda(&self) -> bool {
        matches!(self, ComputeDevice::Cuda(_))
    }

    /// The GPU ordinal this process uses: `cuda:n` as given, `cuda` as the local rank (from the
    /// launcher's environment, [`LOCAL_RANK_ENV`]; 0 without one) modulo `gpus`. `None` for the CPU.
    pub fn ordinal(&self, gpus: usize) -> Result<Option<usize>, DeviceError> {
        self.rank_ordinal(gpus, 0)
    }

    /// The GPU ordinal in-process rank `rank` of this process uses: `cuda:n` as given (every rank
    /// on it), `cuda` the next GPUs after [`Self::ordinal`]'s, `(local rank + rank) % gpus`, so
    /// that the in-process ranks of one process spread over its GPUs. `None` for the CPU.
    pub fn rank_ordinal(&self, gpus: usize, rank: usize) -> Result<Option<usize>, DeviceError> {
        match *self {
            ComputeDevice::Cpu => Ok(None),
            _ if gpus == 0 => Err(DeviceError::NoGpu {
                reason: "the CUDA driver reports no GPU".into(),
            }),
            ComputeDevice::Cuda(Some(n)) if n >= gpus => {
                Err(DeviceError::Ordinal { ordinal: n, gpus })
            }
            ComputeDevice::Cuda(Some(n)) => Ok(Some(n)),
            ComputeDevice::Cuda(None) => Ok(Some((local_rank() % gpus + rank % gpus) % gpus)),
        }
    }
}

/// This process's rank on its host, from the first launcher variable set ([`LOCAL_RANK_ENV`]);
/// 0 when none is.
pub fn local_rank() -> usize {
    LOCAL_RANK_ENV
        .iter()
        .find_map(|k| std::env::var(k).ok()?.trim().parse().ok())
        .unwrap_or(0)
}

impl FromStr for ComputeDevice {
    type Err = DeviceError;
    fn from_str(s: &str) -> Result<Self, DeviceError> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "cpu" => return Ok(ComputeDevice::Cpu),
            "cuda" | "gpu" => return Ok(ComputeDevice::Cuda(None)),
            _ => {}
        }
        let n = t
            .strip_prefix("cuda:")
            .or_else(|| t.strip_prefix("gpu:"))
            .and_then(|n| n.parse::<usize>().ok());
        n.map(|n| ComputeDevice::Cuda(Some(n)))
            .ok_or_else(|| DeviceError::Parse(s.to_string()))
    }
}

impl fmt::Display for ComputeDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ComputeDevice::Cpu => f.write_str("cpu"),
            ComputeDevice::Cuda(None) => f.write_str("cuda"),
            ComputeDevice::Cuda(Some(n)) => write!(f, "cuda:{n}"),
        }
    }
}

/// One GPU as the driver reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor): (9, 0) for H100 and H200.
    pub compute_capability: (u32, u32),
    /// Bytes free on the GPU now (other processes' allocations and the context's own excluded).
    pub free_bytes: u64,
    pub total_bytes: u64,
}

/// Errors choosing or reading a device.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error(
        "unknown device '{0}': use cpu, cuda (the local rank's GPU) or cuda:N (GPU N, from 0)"
    )]
    Parse(String),
    #[error(
        "--device {0} needs a GPU build: this zerodp was built without the `cuda` feature. \
         Rebuild with `cargo build --release --features cuda` on a machine with the CUDA 13.0 \
         toolkit, or use scripts/cuda-build.sh (docs/gpus.md); or run with --device cpu"
    )]
    NotBuilt(ComputeDevice),
    #[error(
        "no usable GPU: {reason}. Check `nvidia-smi`, CUDA_VISIBLE_DEVICES and that the NVIDIA \
         driver (CUDA 13.0 or newer) is installed; or run with --device cpu"
    )]
    NoGpu { reason: String },
    #[error(
        "cuda:{ordinal} does not exist: this process sees {gpus} GPU(s) (cuda:0..cuda:{last}); \
         check CUDA_VISIBLE_DEVICES",
        last = gpus.saturating_sub(1)
    )]
    Ordinal { ordinal: usize, gpus: usize },
    #[error("cuda:{ordinal}: {message}")]
    Driver { ordinal: usize, message: String },
}

/// How many GPUs the driver shows this process (after `CUDA_VISIBLE_DEVICES`).
#[cfg(feature = "cuda")]
pub fn gpu_count() -> Result<usize, DeviceError> {
    use cudarc::driver::CudaContext;
    let n = CudaContext::device_count().map_err(|e| DeviceError::NoGpu {
        reason: format!("the CUDA driver could not be initialised ({e})"),
    })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// How many GPUs the driver shows this process: never any without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub fn gpu_count() -> Result<usize, DeviceError> {
    Err(DeviceError::NotBuilt(ComputeDevice::Cuda(None)))
}

/// The name, compute capability and memory of GPU `ordinal`.
#[cfg(feature = "cuda")]
pub(crate) fn gpu_info(ordinal: usize) -> Result<GpuInfo, DeviceError> {
    use cudarc::driver::CudaContext;
    let gpus = gpu_count()?;
    if ordinal >= gpus {
        return Err(DeviceError::Ordinal { ordinal, gpus });
    }
    let driver = |e: cudarc::driver::DriverError| DeviceError::Driver {
        ordinal,
        message: e.to_string(),
    };
    let ctx = CudaContext::new(ordinal).map_err(driver)?;
    let (free, total) = ctx.mem_get_info().map_err(driver)?;
    let (major, minor) = ctx.compute_capability().map_err(driver)?;
    Ok(GpuInfo {
        ordinal,
        name: ctx.name().map_err(driver)?,
        compute_capability: (major.max(0) as u32, minor.max(0) as u32),
        free_bytes: free as u64,
        total_bytes: total as u64,
    })
}

/// The name and memory of GPU `ordinal`: never available without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub(crate) fn gpu_info(ordinal: usize) -> Result<GpuInfo, DeviceError> {
    Err(DeviceError::NotBuilt(ComputeDevice::Cuda(Some(ordinal))))
}

/// The GPU this process computes on for `device` (`None` for the CPU), checked against the driver:
/// [`DeviceError::NotBuilt`] without the `cuda` feature, [`DeviceError::NoGpu`] or
/// [`DeviceError::Ordinal`] when the GPU is not there.
pub fn resolve(device: ComputeDevice) -> Result<Option<GpuInfo>, DeviceError> {
    resolve_rank(device, 0)
}

/// [`resolve`] for in-process rank `rank` ([`ComputeDevice::rank_ordinal`]).
pub fn resolve_rank(device: ComputeDevice, rank: usize) -> Result<Option<GpuInfo>, DeviceError> {
    if !device.is_cuda() {
        return Ok(None);
    }
    if !cfg!(feature = "cuda") {
        return Err(DeviceError::NotBuilt(device));
    }
    let ordinal = device.rank_ordinal(gpu_count()?, rank)?;
    ordinal.map(gpu_info).transpose()
}

/// How many of `ranks` in-process ranks compute on the busiest GPU of `device` when the driver
/// shows `gpus` ([`ComputeDevice::rank_ordinal`]): all of them on `cuda:n`, an even share on
/// `cuda`; 0 on the CPU.
pub fn ranks_per_gpu(device: ComputeDevice, gpus: usize, ranks: usize) -> usize {
    match device {
        ComputeDevice::Cpu => 0,
        ComputeDevice::Cuda(Some(_)) => ranks,
        ComputeDevice::Cuda(None) => ranks.div_ceil(gpus.clamp(1, ranks.max(1))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_devices_users_write() {
        assert_eq!("cpu".parse::<ComputeDevice>().unwrap(), ComputeDevice::Cpu);
        assert_eq!(
            "CUDA".parse::<ComputeDevice>().unwrap(),
            ComputeDevice::Cuda(None)
        );
        assert_eq!(
            "cuda:3".parse::<ComputeDevice>().unwrap(),
            ComputeDevice::Cuda(Some(3))
        );
        assert_eq!(
            "gpu:1".parse::<ComputeDevice>().unwrap(),
            ComputeDevice::Cuda(Some(1))
        );
        for bad in ["", "cuda:", "cuda:-1", "cuda:x", "tpu", "cuda:1:2"] {
            let err = bad.parse::<ComputeDevice>().unwrap_err().to_string();
            assert!(err.contains("unknown device"), "{bad}: {err}");
        }
        for d in [
            ComputeDevice::Cpu,
            ComputeDevice::Cuda(None),
            ComputeDevice::Cuda(Some(7)),
        ] {
            assert_eq!(d.to_string().parse::<ComputeDevice>().unwrap(), d);
        }
    }

    #[test]
    fn an_ordinal_is_checked_against_the_gpus_seen() {
        assert_eq!(ComputeDevice::Cpu.ordinal(0).unwrap(), None);
        assert_eq!(ComputeDevice::Cuda(Some(1)).ordinal(2).unwrap(), Some(1));
        let err = ComputeDevice::Cuda(Some(2)).ordinal(2).unwrap_err();
        assert!(err.to_string().contains("cuda:0..cuda:1"), "{err}");
        let err = ComputeDevice::Cuda(None).ordinal(0).unwrap_err();
        assert!(err.to_string().contains("no usable GPU"), "{err}");
    }

    #[test]
    fn in_process_ranks_spread_over_the_gpus_of_cuda_and_share_cuda_n() {
        let auto = ComputeDevice::Cuda(None);
        let base = auto.rank_ordinal(4, 0).unwrap().unwrap();
        let spread: Vec<usize> = (0..6)
            .map(|r| auto.rank_ordinal(4, r).unwrap().unwrap())
            .collect();
        let want: Vec<usize> = (0..6).map(|r| (base + r) % 4).collect();
        assert_eq!(spread, want);
        let fixed = ComputeDevice::Cuda(Some(2));
        assert!((0..6).all(|r| fixed.rank_ordinal(4, r).unwrap() == Some(2)));
        assert_eq!(ranks_per_gpu(auto, 4, 6), 2);
        assert_eq!(ranks_per_gpu(auto, 8, 2), 1);
        assert_eq!(ranks_per_gpu(auto, 1, 2), 2);
        assert_eq!(ranks_per_gpu(fixed, 8, 3), 3);
        assert_eq!(ranks_per_gpu(ComputeDevice::Cpu, 0, 3), 0);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_gpu_without_the_feature_says_how_to_build_one() {
        let err = resolve(ComputeDevice::Cuda(None)).unwrap_err().to_string();
        assert!(err.contains("--features cuda"), "{err}");
        assert!(err.contains("--device cpu"), "{err}");
        assert!(resolve(ComputeDevice::Cpu).unwrap().is_none());
    }
}
