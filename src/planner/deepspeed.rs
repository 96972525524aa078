//! The DeepSpeed config keys the planner reads, taken from zerodp's resolved config
//! ([`crate::config::Settings`]): stage, offload devices, buffer knobs, precision and batch.

use super::{BufferOverrides, DtypeOverrides, Offload, Precision, ZeroChoice};
use crate::config::{self, OffloadDevice, Settings};

/// What a resolved DeepSpeed config says about the planner's inputs.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ConfigKeys {
    pub stage: u8,
    pub offload_optimizer: Offload,
    pub offload_param: Offload,
    pub precision: Precision,
    pub micro_batch: u64,
    pub grad_accum: u64,
    /// Every knob is set: the config's value or DeepSpeed's default for its stage.
    pub buffers: BufferOverrides,
    /// As the config resolved them.
    pub dtypes: DtypeOverrides,
}

impl ConfigKeys {
    pub fn from_settings(s: &Settings) -> ConfigKeys {
        let z = &s.zero_optimization;
        ConfigKeys {
            stage: z.stage,
            offload_optimizer: offload(z.offload_optimizer.device),
            offload_param: offload(z.offload_param.device),
            precision: precision(s.precision),
            micro_batch: s.batch.micro_batch_per_gpu as u64,
            grad_accum: s.batch.gradient_accumulation_steps as u64,
            buffers: BufferOverrides {
                reduce_bucket_size: Some(z.reduce_bucket_size),
                prefetch_bucket_size: Some(z.prefetch_bucket_size),
                overlap_comm: Some(z.overlap_comm),
                max_live_parameters: Some(z.max_live_parameters),
                param_persistence_threshold: Some(z.param_persistence_threshold),
                max_reuse_distance: Some(z.max_reuse_distance),
                max_in_cpu: Some(z.offload_param.max_in_cpu),
                offload_ratio: Some(z.offload_optimizer.ratio),
            },
            dtypes: DtypeOverrides {
                communication: Some(precision(s.communication_data_type)),
                grad_accum: Some(precision(s.grad_accum_dtype)),
                bf16_master: s.bf16.enabled && s.bf16.bf16_master_weights_and_grads,
                optimizer_states: match s.zerodp.optimizer_states_dtype {
                    Some(p) => Some(precision(p)),
                    None if s.bf16.enabled && s.bf16.bf16_optimizer_states => Some(Precision::Bf16),
                    None => None,
                },
            },
        }
    }

    /// The stage and offload choice the config makes (DeepSpeed ignores offload_param below
    /// stage 3, and offload_optimizer at stage 0).
    pub fn choice(&self) -> ZeroChoice {
        ZeroChoice::new(
            self.stage,
            if self.stage == 0 {
                Offload::None
            } else {
                self.offload_optimizer
            },
            if self.stage == 3 {
                self.offload_param
            } else {
                Offload::None
            },
        )
    }
}

fn offload(d: OffloadDevice) -> Offload {
    match d {
        OffloadDevice::None => Offload::None,
        OffloadDevice::Cpu => Offload::Cpu,
        OffloadDevice::Nvme => Offload::Nvme,
    }
}

/// The config's compute precision as the planner's.
pub fn precision(p: config::Precision) -> Precision {
    match p {
        config::Precision::Bf16 => Precision::Bf16,
        config::Precision::Fp16 => Precision::Fp16,
        config::Precision::Fp32 => Precision::Fp32,
    }
}

/// The planner's precision as the config's (for the config's `"auto"` precision).
pub fn config_precision(p: Precision) -> config::Precision {
    match p {
        Precision::Bf16 => config::Precision::Bf16,
        Precision::Fp16 => config::Precision::Fp16,
        Precision::Fp32 => config::Precision::Fp32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ResolveContext;

    fn keys(text: &str, world_size: usize) -> ConfigKeys {
        let ctx = ResolveContext {
            world_size,
            ..ResolveContext::default()
        };
        ConfigKeys::from_settings(&config::load_str(text, "ds.json", &ctx).unwrap().settings)
    }

    #[test]
    fn reads_stage_offload_buckets_precision_and_batch() {
        let k = keys(
            r#"{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": true},
                "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e7, "overlap_comm": false,
                  "stage3_max_live_parameters": 1e8, "offload_optimizer": {"device": "cpu"},
                  "offload_param": {"device": "nvme", "nvme_path": "/x"}}}"#,
            4,
        );
        assert_eq!(k.precision, Precision::Bf16);
        assert_eq!((k.micro_batch, k.grad_accum), (4, 2));
        assert_eq!(k.buffers.reduce_bucket_size, Some(50_000_000));
        assert_eq!(k.buffers.overlap_comm, Some(false));
        assert_eq!(k.buffers.max_live_parameters, Some(100_000_000));
        assert_eq!(k.choice(), ZeroChoice::new(3, Offload::Cpu, Offload::Nvme));
    }

    #[test]
    fn offload_param_is_ignored_below_stage_3() {
        let k = keys(
            r#"{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2,
                "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}"#,
            1,
        );
        assert_eq!(k.precision, Precision::Fp32);
        assert_eq!(k.choice(), ZeroChoice::new(2, Offload::Cpu, Offload::None));
        // DeepSpeed's default: overlap_comm off below stage 3.
        assert_eq!(k.buffers.overlap_comm, Some(false));
    }
}
