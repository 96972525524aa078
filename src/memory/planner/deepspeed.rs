//! The few DeepSpeed config keys the planner reads, from the raw JSON. zerodp's full config parser
//! (`zerodp::config`) was not available when the planner was written; this reads only what sizes
//! memory and traffic, with DeepSpeed's key names and aliases, and treats `"auto"` as unset.

use super::{BufferOverrides, Offload, PlanError, Precision, ZeroChoice};
use serde_json::Value;

/// What a DeepSpeed config says about the planner's inputs; `None` where it says nothing.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct ConfigKeys {
    pub stage: Option<u8>,
    pub offload_optimizer: Option<Offload>,
    pub offload_param: Option<Offload>,
    pub precision: Option<Precision>,
    pub micro_batch: Option<u64>,
    pub grad_accum: Option<u64>,
    pub buffers: BufferOverrides,
}

impl ConfigKeys {
    /// Reads the keys from a config's JSON text; `source` names the file in errors.
    pub fn from_json_str(text: &str, source: &str) -> Result<ConfigKeys, PlanError> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| PlanError::Config(format!("{source}: not valid JSON: {e}")))?;
        Self::from_value(&v, source)
    }

    pub fn from_value(v: &Value, source: &str) -> Result<ConfigKeys, PlanError> {
        let root = v.as_object().ok_or_else(|| {
            PlanError::Config(format!("{source}: the top level must be a JSON object"))
        })?;
        let mut k = ConfigKeys::default();
        let enabled = |section: &str| -> Result<bool, PlanError> {
            match root.get(section).and_then(|s| s.get("enabled")) {
                None | Some(Value::Null) => Ok(false),
                Some(Value::Bool(b)) => Ok(*b),
                Some(Value::String(s)) if s == "auto" => Ok(false),
                Some(other) => Err(PlanError::Config(format!(
                    "{source}: {section}.enabled must be true or false, found {other}"
                ))),
            }
        };
        let (bf16, fp16) = (enabled("bf16")? || enabled("bfloat16")?, enabled("fp16")?);
        if bf16 && fp16 {
            return Err(PlanError::Config(format!(
                "{source}: both bf16.enabled and fp16.enabled are true; enable one"
            )));
        }
        k.precision = Some(if bf16 {
            Precision::Bf16
        } else if fp16 {
            Precision::Fp16
        } else {
            Precision::Fp32
        });
        k.micro_batch = count(
            root.get("train_micro_batch_size_per_gpu"),
            "train_micro_batch_size_per_gpu",
            source,
        )?;
        k.grad_accum = count(
            root.get("gradient_accumulation_steps"),
            "gradient_accumulation_steps",
            source,
        )?;
        if let Some(z) = root.get("zero_optimization") {
            let z = z.as_object().ok_or_else(|| {
                PlanError::Config(format!("{source}: zero_optimization must be an object"))
            })?;
            let get = |names: &[&str]| names.iter().find_map(|n| z.get(*n));
            if let Some(s) = count(z.get("stage"), "zero_optimization.stage", source)? {
                if s > 3 {
                    return Err(PlanError::Config(format!(
                        "{source}: zero_optimization.stage is {s}; it must be 0, 1, 2 or 3"
                    )));
                }
                k.stage = Some(s as u8);
            }
            k.buffers.reduce_bucket_size =
                count(z.get("reduce_bucket_size"), "reduce_bucket_size", source)?;
            k.buffers.overlap_comm = match z.get("overlap_comm") {
                None | Some(Value::Null) => None,
                Some(Value::Bool(b)) => Some(*b),
                Some(other) => {
                    return Err(PlanError::Config(format!(
                    "{source}: zero_optimization.overlap_comm must be true or false, found {other}"
                )))
                }
            };
            k.buffers.max_live_parameters = count(
                get(&["stage3_max_live_parameters", "max_live_parameters"]),
                "stage3_max_live_parameters",
                source,
            )?;
            k.buffers.param_persistence_threshold = count(
                get(&[
                    "stage3_param_persistence_threshold",
                    "param_persistence_threshold",
                ]),
                "stage3_param_persistence_threshold",
                source,
            )?;
            k.offload_optimizer = offload(z.get("offload_optimizer"), "offload_optimizer", source)?;
            if k.offload_optimizer.is_none() && z.get("cpu_offload") == Some(&Value::Bool(true)) {
                k.offload_optimizer = Some(Offload::Cpu);
            }
            k.offload_param = offload(z.get("offload_param"), "offload_param", source)?;
            if k.offload_param.is_none() && z.get("cpu_offload_param") == Some(&Value::Bool(true)) {
                k.offload_param = Some(Offload::Cpu);
            }
        }
        Ok(k)
    }

    /// The stage and offload choice the config makes (DeepSpeed ignores offload_param below stage 3).
    pub fn choice(&self) -> ZeroChoice {
        let stage = self.stage.unwrap_or(0);
        ZeroChoice::new(
            stage,
            self.offload_optimizer.unwrap_or(Offload::None),
            if stage == 3 {
                self.offload_param.unwrap_or(Offload::None)
            } else {
                Offload::None
            },
        )
    }
}

/// A non-negative integer that DeepSpeed configs often write as a float (`5e8`); `"auto"` is unset.
fn count(v: Option<&Value>, key: &str, source: &str) -> Result<Option<u64>, PlanError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s == "auto" => Ok(None),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(u) => Ok(Some(u)),
            None => match n.as_f64() {
                Some(f) if f >= 0.0 && f.fract() == 0.0 && f < u64::MAX as f64 => {
                    Ok(Some(f as u64))
                }
                _ => Err(PlanError::Config(format!(
                    "{source}: {key} is {n}; it must be a whole number of at least 0"
                ))),
            },
        },
        Some(other) => Err(PlanError::Config(format!(
            "{source}: {key} must be a number (or \"auto\"), found {other}"
        ))),
    }
}

fn offload(v: Option<&Value>, key: &str, source: &str) -> Result<Option<Offload>, PlanError> {
    let Some(section) = v else { return Ok(None) };
    if section.is_null() {
        return Ok(None);
    }
    match section.get("device") {
        None | Some(Value::Null) => Ok(Some(Offload::None)),
        Some(Value::String(s)) => match s.as_str() {
            "none" => Ok(Some(Offload::None)),
            "cpu" => Ok(Some(Offload::Cpu)),
            "nvme" => Ok(Some(Offload::Nvme)),
            other => Err(PlanError::Config(format!(
                "{source}: zero_optimization.{key}.device is {other:?}; use \"none\", \"cpu\" or \"nvme\""
            ))),
        },
        Some(other) => Err(PlanError::Config(format!(
            "{source}: zero_optimization.{key}.device must be a string, found {other}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_stage_offload_buckets_and_precision() {
        let k = ConfigKeys::from_json_str(
            r#"{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto",
                "bf16": {"enabled": true},
                "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "overlap_comm": false,
                  "stage3_max_live_parameters": 1e9, "offload_optimizer": {"device": "cpu"},
                  "offload_param": {"device": "nvme", "nvme_path": "/x"}}}"#,
            "ds.json",
        )
        .unwrap();
        assert_eq!(k.precision, Some(Precision::Bf16));
        assert_eq!((k.micro_batch, k.grad_accum), (Some(4), None));
        assert_eq!(k.buffers.reduce_bucket_size, Some(500_000_000));
        assert_eq!(k.buffers.overlap_comm, Some(false));
        assert_eq!(k.choice(), ZeroChoice::new(3, Offload::Cpu, Offload::Nvme));
    }

    #[test]
    fn offload_param_is_ignored_below_stage_3_and_errors_name_the_key() {
        let k = ConfigKeys::from_json_str(
            r#"{"zero_optimization": {"stage": 2, "cpu_offload": true, "offload_param": {"device": "cpu"}}}"#,
            "ds.json",
        )
        .unwrap();
        assert_eq!(k.choice(), ZeroChoice::new(2, Offload::Cpu, Offload::None));
        let e = ConfigKeys::from_json_str(
            r#"{"zero_optimization": {"reduce_bucket_size": "big"}}"#,
            "ds.json",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("ds.json") && e.contains("reduce_bucket_size"),
            "{e}"
        );
    }
}
