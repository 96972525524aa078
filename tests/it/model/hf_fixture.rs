//! What the Hugging Face parity tests share: their fixtures' JSON, token batches and the
//! relative difference they bound.

use serde_json::Value;
use std::path::Path;
use zerodp::data::TokenBatch;
use zerodp::zero::{EngineConfig, Stage};

pub fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

pub fn numbers(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|row| row.as_array().unwrap().iter())
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Sequences `first..first + n` of step `step`'s global batch.
pub fn batch(exp: &Value, step: usize, first: usize, n: usize) -> TokenBatch {
    let seq = exp["seq"].as_u64().unwrap() as usize;
    let s = &exp["steps"][step];
    let cut = |v: Vec<u32>| v[first * seq..(first + n) * seq].to_vec();
    TokenBatch {
        tokens: cut(ids(&s["tokens"])),
        targets: cut(ids(&s["targets"])),
        batch_size: n,
        seq_len: seq,
        segment_starts: Vec::new(),
    }
}

pub fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

/// The fixture's AdamW (torch.optim.AdamW: decoupled decay, bias correction) at `stage` on
/// `world` ranks, each taking an equal share of its global batch, every unit gathered on use.
pub fn adamw_config(exp: &Value, stage: Stage, world: usize) -> EngineConfig {
    let o = &exp["optimizer"];
    let mut cfg = EngineConfig::new(stage, world);
    cfg.micro_batch = exp["batch"].as_u64().unwrap() as usize / world;
    cfg.adam.beta1 = o["betas"][0].as_f64().unwrap();
    cfg.adam.beta2 = o["betas"][1].as_f64().unwrap();
    cfg.adam.eps = o["eps"].as_f64().unwrap();
    cfg.adam.weight_decay = o["weight_decay"].as_f64().unwrap();
    cfg.adam.adam_w_mode = true;
    cfg.adam.bias_correction = true;
    cfg.param_persistence_threshold = 0;
    cfg
}
