//! `--device`: where the ranks of `train` and `bench train` compute ([`zerodp::device`]).

use candle_core::{DType, Device};
use zerodp::config::Precision;
use zerodp::device::{ComputeDevice, GpuInfo};

#[derive(clap::Args, Debug, Clone, Default)]
pub struct DeviceArgs {
    /// Where each rank's units compute: cpu, cuda (the process's local rank's GPU; in-process
    /// ranks spread over the GPUs) or cuda:N (every rank of the process there). On a GPU the
    /// model's forward and backward run there (bf16/fp16 runs compute in 16 bits); without
    /// offload at stages 0-2, or on one rank, Adam and its state too (at stages 1-2 each rank's
    /// shard of it). Needs a build with the `cuda`
    /// feature (docs/gpus.md).
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: ComputeDevice,
    /// Let f32 matrix products on a GPU use TF32 tensor cores (as torch.backends.cuda.matmul.
    /// allow_tf32): faster, with 10-bit mantissas in the products. Off by default, as in PyTorch.
    #[arg(long)]
    pub tf32: bool,
}

fn parse_device(s: &str) -> Result<ComputeDevice, String> {
    s.parse()
        .map_err(|e: zerodp::device::DeviceError| e.to_string())
}

/// Set to 0 to keep a bf16 run's products in f32 on a CPU with AVX512-BF16.
pub const BF16_PRODUCTS_ENV: &str = "ZERODP_BF16_PRODUCTS";

/// The device a run computes on, opened.
pub struct OpenDevice {
    pub device: Device,
    /// The dtype the units compute in there.
    pub dtype: DType,
    /// The GPU, when there is one.
    pub gpu: Option<GpuInfo>,
}

impl OpenDevice {
    /// Where a model is built: the device and the dtype its units compute in.
    pub fn on(&self) -> (Device, DType) {
        (self.device.clone(), self.dtype)
    }
}

/// How many in-process ranks of `args.device` compute on its busiest GPU (0 on the CPU).
pub fn ranks_per_gpu(args: &DeviceArgs, ranks: usize) -> anyhow::Result<usize> {
    if !args.device.is_cuda() {
        return Ok(0);
    }
    let gpus = zerodp::device::gpu_count()?;
    Ok(zerodp::device::ranks_per_gpu(args.device, gpus, ranks))
}

impl OpenDevice {
    /// One line for the run's banner: `cpu`, or the GPU's ordinal, name and memory.
    pub fn describe(&self) -> String {
        match &self.gpu {
            None if zerodp::model::gemm_path() == "avx512-bf16" => {
                "cpu, products with bf16 operands and f32 sums (AVX512-BF16)".into()
            }
            None => "cpu".into(),
            Some(g) => format!(
                "cuda:{} ({}, compute {}.{}, {} free of {}), computing in {}",
                g.ordinal,
                g.name,
                g.compute_capability.0,
                g.compute_capability.1,
                zerodp::planner::format_gb(g.free_bytes),
                zerodp::planner::format_gb(g.total_bytes),
                self.dtype.as_str()
            ),
        }
    }
}

impl DeviceArgs {
    /// Open the device for a run of `precision`: the GPU checked against the driver (a clear error
    /// without one or without the `cuda` feature), TF32 set as asked.
    pub fn open(&self, precision: Precision) -> anyhow::Result<OpenDevice> {
        self.open_rank(precision, 0)
    }

    /// [`Self::open`] for in-process rank `rank` (`cuda` spreads the ranks over the GPUs,
    /// [`zerodp::device::ComputeDevice::rank_ordinal`]).
    pub fn open_rank(&self, precision: Precision, rank: usize) -> anyhow::Result<OpenDevice> {
        if self.tf32 && !self.device.is_cuda() {
            anyhow::bail!("--tf32 applies to GPU matrix products; add --device cuda or drop it");
        }
        let gpu = zerodp::device::resolve_rank(self.device, rank)?;
        let device = zerodp::model::candle_device(gpu.as_ref())?;
        #[cfg(feature = "cuda")]
        candle_core::cuda::set_gemm_reduced_precision_f32(self.tf32);
        let half = match precision {
            Precision::Fp32 => None,
            Precision::Bf16 => Some(DType::BF16),
            Precision::Fp16 => Some(DType::F16),
        };
        let dtype = zerodp::model::compute_dtype(&device, half);
        // A bf16 run on a CPU with native bf16 dot products computes its products as PyTorch's
        // bf16 autocast does: bf16 operands, f32 sums (ZERODP_BF16_PRODUCTS=0 keeps them f32).
        let wanted = std::env::var(BF16_PRODUCTS_ENV).map_or(true, |v| v.trim() != "0");
        zerodp::model::set_bf16_products(gpu.is_none() && precision == Precision::Bf16 && wanted);
        Ok(OpenDevice { device, dtype, gpu })
    }
}
