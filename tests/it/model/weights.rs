//! safetensors round trip and the errors for files that do not fit the model.

use std::path::Path;

use half::bf16;
use safetensors::tensor::{Dtype, TensorView};
use zerodp::model::weights::{load_safetensors, save_safetensors, WeightsError};
use zerodp::model::{GptConfig, GptModel};
use zerodp::zero::unit::{ModelSpec, UnitModel};

fn init_all(model: &GptModel, seed: u64) -> Vec<Vec<f32>> {
    (0..model.spec().units.len())
        .map(|u| {
            let mut b = vec![0.0; model.spec().units[u].numel()];
            model.init_params(u, seed, &mut b);
            b
        })
        .collect()
}

/// Write arbitrary named tensors: (name, shape, dtype, little-endian bytes).
fn write_raw(path: &Path, tensors: Vec<(String, Vec<usize>, Dtype, Vec<u8>)>) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, d, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// The spec's tensors as (name, shape, f32 values).
fn named(spec: &ModelSpec, params: &[Vec<f32>]) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut out = Vec::new();
    for (unit, buf) in spec.units.iter().zip(params) {
        for (p, off) in unit.params.iter().zip(unit.offsets()) {
            out.push((
                p.name.clone(),
                p.shape.clone(),
                buf[off..off + p.numel()].to_vec(),
            ));
        }
    }
    out
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn save_then_load_is_exact_and_bf16_is_converted() {
    let model = GptModel::new(GptConfig::tiny()).unwrap();
    let params = init_all(&model, 4);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    let refs: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
    save_safetensors(&path, model.spec(), &refs).unwrap();
    assert!(!dir.path().join("w.safetensors.tmp").exists());
    assert_eq!(load_safetensors(&path, model.spec()).unwrap(), params);

    // The same tensors stored as BF16 load as their BF16-rounded values.
    let bf = dir.path().join("bf16.safetensors");
    let tensors = named(model.spec(), &params)
        .into_iter()
        .map(|(n, s, v)| {
            let bytes = v
                .iter()
                .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                .collect();
            (n, s, Dtype::BF16, bytes)
        })
        .collect();
    write_raw(&bf, tensors);
    let loaded = load_safetensors(&bf, model.spec()).unwrap();
    for (a, b) in loaded.iter().flatten().zip(params.iter().flatten()) {
        assert_eq!(*a, bf16::from_f32(*b).to_f32());
    }
}

#[test]
fn a_tied_lm_head_must_equal_wte() {
    let model = GptModel::new(GptConfig::tiny()).unwrap();
    let params = init_all(&model, 4);
    let dir = tempfile::tempdir().unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = named(model.spec(), &params)
        .into_iter()
        .map(|(n, s, v)| (n, s, Dtype::F32, f32_bytes(&v)))
        .collect();
    let wte = tensors[0].clone();
    assert_eq!(wte.0, "wte.weight");
    tensors.push((
        "lm_head.weight".into(),
        wte.1.clone(),
        Dtype::F32,
        wte.3.clone(),
    ));
    let tied = dir.path().join("tied.safetensors");
    write_raw(&tied, tensors.clone());
    assert_eq!(load_safetensors(&tied, model.spec()).unwrap(), params);

    let last = tensors.len() - 1;
    tensors[last].3[0] ^= 0x40; // change one value
    let untied = dir.path().join("untied.safetensors");
    write_raw(&untied, tensors);
    let err = load_safetensors(&untied, model.spec()).unwrap_err();
    assert!(matches!(err, WeightsError::Untied { .. }), "{err}");
    assert!(err.to_string().contains("lm_head.weight"));
}

#[test]
fn mismatches_name_the_tensors() {
    let model = GptModel::new(GptConfig::tiny()).unwrap();
    let params = init_all(&model, 4);
    let dir = tempfile::tempdir().unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = named(model.spec(), &params)
        .into_iter()
        .filter(|(n, _, _)| n != "h.1.ln_2.bias")
        .map(|(n, s, v)| (n, s, Dtype::F32, f32_bytes(&v)))
        .collect();
    // A Conv1D-style transposed weight and an extra buffer.
    let i = tensors
        .iter()
        .position(|t| t.0 == "h.0.mlp.c_fc.weight")
        .unwrap();
    tensors[i].1.reverse();
    tensors.push((
        "h.0.attn.masked_bias".into(),
        vec![1],
        Dtype::F32,
        f32_bytes(&[0.0]),
    ));
    let path = dir.path().join("bad.safetensors");
    write_raw(&path, tensors);
    let err = load_safetensors(&path, model.spec())
        .unwrap_err()
        .to_string();
    for needle in [
        "h.1.ln_2.bias",
        "h.0.attn.masked_bias",
        "h.0.mlp.c_fc.weight",
        "Conv1D",
        "bad.safetensors",
    ] {
        assert!(err.contains(needle), "{needle} not in: {err}");
    }
    let err = load_safetensors(&dir.path().join("absent.safetensors"), model.spec()).unwrap_err();
    assert!(err.to_string().contains("absent.safetensors"), "{err}");
    std::fs::write(
        dir.path().join("junk.safetensors"),
        b"not a safetensors file",
    )
    .unwrap();
    let err = load_safetensors(&dir.path().join("junk.safetensors"), model.spec()).unwrap_err();
    assert!(matches!(err, WeightsError::Format { .. }), "{err}");
}
