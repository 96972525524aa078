//! What the Hugging Face parity tests share: their fixtures' JSON, token batches and the
//! relative difference they bound.

use serde_json::Value;
use std::path::Path;
use zerodp::data::TokenBatch;

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
