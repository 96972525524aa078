//! The GPT reference model: gradients (complete, correct against finite differences, equal between
//! unit-by-unit and end-to-end backward, equal under NoGrad + recompute), initialisation, layout.

use candle_core::{DType, Tensor};
use zerodp::data::TokenBatch as Batch;
use zerodp::model::{GptConfig, GptModel};
use zerodp::rng::SplitMix64;
use zerodp::zero::unit::{ForwardMode, ModelError, UnitModel};

fn init_all(model: &GptModel, seed: u64) -> Vec<Vec<f32>> {
    model
        .spec()
        .units
        .iter()
        .enumerate()
        .map(|(u, spec)| {
            let mut buf = vec![0.0; spec.numel()];
            model.init_params(u, seed, &mut buf);
            buf
        })
        .collect()
}

/// Random tokens; targets are a fixed function of the tokens so the loss is learnable.
fn random_batch(cfg: &GptConfig, batch_size: usize, seq_len: usize, seed: u64) -> Batch {
    let mut rng = SplitMix64::new(seed);
    let n = batch_size * seq_len;
    let tokens: Vec<u32> = (0..n).map(|_| rng.below(cfg.vocab_size) as u32).collect();
    let targets = (0..n).map(|_| rng.below(cfg.vocab_size) as u32).collect();
    Batch {
        tokens,
        targets,
        batch_size,
        seq_len,
        segment_starts: Vec::new(),
    }
}

/// The parameter slices unit `u` reads: its own buffer, then those of the units it uses.
fn groups<'a>(model: &GptModel, params: &'a [Vec<f32>], u: usize) -> Vec<&'a [f32]> {
    std::iter::once(u)
        .chain(model.spec().units[u].uses.iter().copied())
        .map(|g| params[g].as_slice())
        .collect()
}

/// Backward of unit `u` adding into `grads` (own buffer, then the used units' buffers).
fn backward_into(
    model: &GptModel,
    u: usize,
    saved: zerodp::model::GptSaved,
    grad_output: Option<&Tensor>,
    loss_weight: f32,
    grads: &mut [Vec<f32>],
) -> Option<Tensor> {
    let uses = model.spec().units[u].uses.clone();
    // Split the gradient buffers into disjoint mutable slices: own first, then each used unit.
    let mut own: Option<&mut [f32]> = None;
    let mut used: Vec<(usize, &mut [f32])> = Vec::new();
    for (g, buf) in grads.iter_mut().enumerate() {
        if g == u {
            own = Some(buf.as_mut_slice());
        } else if uses.contains(&g) {
            used.push((g, buf.as_mut_slice()));
        }
    }
    let mut slices: Vec<&mut [f32]> = vec![own.expect("own gradient buffer")];
    for want in &uses {
        let pos = used
            .iter()
            .position(|(g, _)| g == want)
            .expect("used buffer");
        slices.push(used.swap_remove(pos).1);
    }
    model
        .backward(u, saved, grad_output, loss_weight, &mut slices)
        .expect("backward")
}

/// The engine's path: forward unit by unit (Train, or NoGrad then recompute in backward, as stage 3
/// and activation checkpointing do), then backward in reverse passing the output gradient along.
fn unit_by_unit(
    model: &GptModel,
    params: &[Vec<f32>],
    batch: &Batch,
    loss_weight: f32,
    recompute: bool,
) -> (f32, Vec<Vec<f32>>) {
    let n = model.spec().units.len();
    let mode = if recompute {
        ForwardMode::NoGrad
    } else {
        ForwardMode::Train
    };
    let mut inputs: Vec<Option<Tensor>> = vec![None];
    let mut saved = Vec::new();
    let mut loss = None;
    for u in 0..n {
        let out = model
            .forward(
                u,
                &groups(model, params, u),
                inputs[u].as_ref(),
                batch,
                mode,
            )
            .expect("forward");
        assert_eq!(out.saved.is_some(), !recompute);
        saved.push(out.saved);
        if u + 1 < n {
            inputs.push(Some(out.output.expect("output of a non-last unit")));
        } else {
            loss = out.loss;
        }
    }
    let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    let mut upstream: Option<Tensor> = None;
    for u in (0..n).rev() {
        let s = match saved[u].take() {
            Some(s) => s,
            None => model
                .forward(
                    u,
                    &groups(model, params, u),
                    inputs[u].as_ref(),
                    batch,
                    ForwardMode::Train,
                )
                .expect("recompute")
                .saved
                .expect("saved after a Train forward"),
        };
        upstream = backward_into(model, u, s, upstream.as_ref(), loss_weight, &mut grads);
        assert_eq!(upstream.is_some(), u > 0, "unit {u} input gradient");
    }
    (loss.expect("loss from the last unit"), grads)
}

fn fd_config() -> GptConfig {
    GptConfig::sized(11, 6, 2, 2, 8)
}

#[test]
fn small_preset_is_the_benchmark_model() {
    let model = GptModel::new(GptConfig::preset("small").unwrap()).unwrap();
    assert_eq!(model.spec().num_params(), 3_257_856);
    assert_eq!(model.spec().units.len(), 6);
    assert_eq!(model.spec().units[5].uses, vec![0]);
    let names: Vec<&str> = model.spec().units[1]
        .params
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "h.0.ln_1.weight",
            "h.0.ln_1.bias",
            "h.0.attn.c_attn.weight",
            "h.0.attn.c_attn.bias",
            "h.0.attn.c_proj.weight",
            "h.0.attn.c_proj.bias",
            "h.0.ln_2.weight",
            "h.0.ln_2.bias",
            "h.0.mlp.c_fc.weight",
            "h.0.mlp.c_fc.bias",
            "h.0.mlp.c_proj.weight",
            "h.0.mlp.c_proj.bias",
        ]
    );
    assert_eq!(model.spec().units[1].params[2].shape, vec![768, 256]);
    assert_eq!(model.spec().units[1].params[10].shape, vec![256, 1024]);
    for name in GptConfig::PRESETS {
        let cfg = GptConfig::preset(name).unwrap();
        assert_eq!(
            GptModel::new(cfg.clone()).unwrap().spec().num_params(),
            cfg.num_params()
        );
    }
    let err = GptConfig::preset("huge").unwrap_err().to_string();
    assert!(err.contains("huge") && err.contains("small"), "{err}");
    let bad = GptConfig {
        width: 30,
        heads: 4,
        ..GptConfig::tiny()
    };
    assert!(GptModel::new(bad).is_err());
}

#[test]
fn every_parameter_gets_a_gradient_and_the_tied_weight_gets_both() {
    let cfg = GptConfig::tiny();
    let model = GptModel::new(cfg.clone()).unwrap();
    let params = init_all(&model, 1);
    let batch = random_batch(&cfg, 2, cfg.context, 2);
    let (loss, grads) = unit_by_unit(&model, &params, &batch, 1.0, false);
    // A fresh GPT predicts nearly uniformly: loss close to ln(vocab).
    assert!(
        (loss - (cfg.vocab_size as f32).ln()).abs() < 0.1,
        "loss {loss}"
    );
    for (u, spec) in model.spec().units.iter().enumerate() {
        for (p, off) in spec.params.iter().zip(spec.offsets()) {
            let g = &grads[u][off..off + p.numel()];
            assert!(
                g.iter().all(|x| x.is_finite()),
                "{} has a non-finite gradient",
                p.name
            );
            assert!(g.iter().any(|&x| x != 0.0), "{} has no gradient", p.name);
        }
    }
    // Rows of wte whose token never occurs get gradient only through the tied LM head.
    let c = cfg.width;
    let unused = (0..cfg.vocab_size as u32)
        .find(|t| !batch.tokens.contains(t))
        .expect("a token absent from the batch") as usize;
    assert!(grads[0][unused * c..(unused + 1) * c]
        .iter()
        .any(|&x| x != 0.0));
    // The head alone writes its wte contribution into unit 0's buffer.
    let last = model.spec().units.len() - 1;
    let x = {
        let mut x = None;
        for u in 0..last {
            x = model
                .forward(
                    u,
                    &groups(&model, &params, u),
                    x.as_ref(),
                    &batch,
                    ForwardMode::NoGrad,
                )
                .unwrap()
                .output;
        }
        x.unwrap()
    };
    let out = model
        .forward(
            last,
            &groups(&model, &params, last),
            Some(&x),
            &batch,
            ForwardMode::Train,
        )
        .unwrap();
    let mut head_grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    backward_into(&model, last, out.saved.unwrap(), None, 1.0, &mut head_grads);
    let wte = cfg.vocab_size * c;
    assert!(head_grads[0][..wte].iter().any(|&x| x != 0.0));
    assert!(
        head_grads[0][wte..].iter().all(|&x| x == 0.0),
        "the head must not touch wpe"
    );
    // Gradients accumulate (+=): a second backward doubles them.
    let mut twice: Vec<Vec<f32>> = head_grads.clone();
    let out = model
        .forward(
            last,
            &groups(&model, &params, last),
            Some(&x),
            &batch,
            ForwardMode::Train,
        )
        .unwrap();
    backward_into(&model, last, out.saved.unwrap(), None, 1.0, &mut twice);
    for (a, b) in twice[0].iter().zip(&head_grads[0]) {
        assert_eq!(*a, 2.0 * b);
    }
}

#[test]
fn gradients_match_finite_differences_in_f64_fused() {
    check_finite_differences(true);
}

#[test]
fn gradients_match_finite_differences_in_f64_composite() {
    check_finite_differences(false);
}

/// Central differences on 4 elements of every parameter tensor, F64 compute.
fn check_finite_differences(fused: bool) {
    let cfg = fd_config();
    let model = GptModel::with_options(cfg.clone(), DType::F64, fused).unwrap();
    let mut params = init_all(&model, 3);
    // Perturb LayerNorm weights and all biases away from 1 and 0 so their gradients are generic.
    let mut rng = SplitMix64::new(9);
    for buf in params.iter_mut() {
        for x in buf.iter_mut() {
            *x += (0.05 * rng.normal()) as f32;
        }
    }
    let batch = random_batch(&cfg, 2, cfg.context, 4);
    let loss_weight = 0.7;
    let (_, analytic) = unit_by_unit(&model, &params, &batch, loss_weight, false);
    let loss_at = |p: &[Vec<f32>]| {
        let refs: Vec<&[f32]> = p.iter().map(Vec::as_slice).collect();
        model.end_to_end(&refs, &batch, 1.0).unwrap().0 * f64::from(loss_weight)
    };
    let eps = 1e-3f32;
    let mut checked = 0;
    for (u, spec) in model.spec().units.iter().enumerate() {
        for (p, off) in spec.params.iter().zip(spec.offsets()) {
            let n = p.numel();
            for idx in [0, n / 3, (2 * n) / 3, n - 1] {
                let i = off + idx;
                let orig = params[u][i];
                let (hi, lo) = (orig + eps, orig - eps);
                params[u][i] = hi;
                let l_hi = loss_at(&params);
                params[u][i] = lo;
                let l_lo = loss_at(&params);
                params[u][i] = orig;
                let numeric = (l_hi - l_lo) / (f64::from(hi) - f64::from(lo));
                let a = f64::from(analytic[u][i]);
                let tol = 1e-5 + 1e-3 * a.abs().max(numeric.abs());
                assert!(
                    (a - numeric).abs() <= tol,
                    "{}[{idx}]: analytic {a:e} vs numeric {numeric:e}",
                    p.name
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 4 * (2 + 12 * cfg.layers + 2));
}

#[test]
fn unit_by_unit_equals_end_to_end_and_recompute_is_identical() {
    let cfg = GptConfig::tiny();
    let model = GptModel::new(cfg.clone()).unwrap();
    let params = init_all(&model, 5);
    let batch = random_batch(&cfg, 3, cfg.context - 3, 6);
    let loss_weight = 0.25;
    let refs: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
    let (loss_e2e, grads_e2e) = model.end_to_end(&refs, &batch, loss_weight).unwrap();
    let (loss, grads) = unit_by_unit(&model, &params, &batch, loss_weight, false);
    assert!(
        (f64::from(loss) - loss_e2e).abs() < 1e-6,
        "{loss} vs {loss_e2e}"
    );
    for (u, (a, b)) in grads.iter().zip(&grads_e2e).enumerate() {
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            diff <= 1e-6 * scale,
            "unit {u}: max diff {diff} (scale {scale})"
        );
    }
    let (loss_rc, grads_rc) = unit_by_unit(&model, &params, &batch, loss_weight, true);
    assert_eq!(loss_rc, loss);
    assert_eq!(
        grads_rc, grads,
        "NoGrad forward + Train recompute must be bitwise identical"
    );
}

/// The blocks on slices (the default) compute exactly what the same kernels compute through
/// candle's graph: the same loss and every gradient bit for bit, through recomputation too, at a
/// width and head count where every kernel runs its vector loops.
#[test]
fn direct_blocks_equal_the_candle_graph_bit_for_bit() {
    let cfg = GptConfig::sized(64, 24, 2, 4, 64);
    let direct = GptModel::with_direct_blocks(cfg.clone(), true).unwrap();
    let graph = GptModel::with_direct_blocks(cfg.clone(), false).unwrap();
    let params = init_all(&direct, 9);
    let batch = random_batch(&cfg, 3, cfg.context - 4, 10);
    for recompute in [false, true] {
        let (loss_d, grads_d) = unit_by_unit(&direct, &params, &batch, 0.5, recompute);
        let (loss_g, grads_g) = unit_by_unit(&graph, &params, &batch, 0.5, recompute);
        assert_eq!(loss_d.to_bits(), loss_g.to_bits(), "{loss_d} vs {loss_g}");
        for (u, (a, b)) in grads_d.iter().zip(&grads_g).enumerate() {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "unit {u}: gradients differ");
            assert!(a.iter().any(|&x| x != 0.0), "unit {u}: no gradient");
        }
    }
}

#[test]
fn fused_kernels_match_the_composite_candle_ops() {
    let cfg = GptConfig {
        context: 24,
        ..GptConfig::tiny()
    };
    let fused = GptModel::with_options(cfg.clone(), DType::F32, true).unwrap();
    let composite = GptModel::with_options(cfg.clone(), DType::F32, false).unwrap();
    let mut params = init_all(&fused, 8);
    let mut rng = SplitMix64::new(10);
    for x in params.iter_mut().flatten() {
        *x += (0.05 * rng.normal()) as f32;
    }
    let batch = random_batch(&cfg, 3, 20, 11);
    let (loss_f, grads_f) = unit_by_unit(&fused, &params, &batch, 1.0, false);
    let (loss_c, grads_c) = unit_by_unit(&composite, &params, &batch, 1.0, false);
    assert!(
        (loss_f - loss_c).abs() <= 1e-5 * loss_c.abs(),
        "{loss_f} vs {loss_c}"
    );
    for (u, spec) in fused.spec().units.iter().enumerate() {
        for (p, off) in spec.params.iter().zip(spec.offsets()) {
            let (a, b) = (
                &grads_f[u][off..off + p.numel()],
                &grads_c[u][off..off + p.numel()],
            );
            let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
            let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                scale > 0.0 && diff <= 1e-4 * scale,
                "{}: max diff {diff} (scale {scale})",
                p.name
            );
        }
    }
}

#[test]
fn init_is_deterministic_and_gpt2_shaped() {
    let cfg = GptConfig {
        layers: 3,
        ..GptConfig::tiny()
    };
    let model = GptModel::new(cfg.clone()).unwrap();
    let a = init_all(&model, 11);
    assert_eq!(a, init_all(&model, 11));
    // Another model object (another rank) gets the same values.
    assert_eq!(a, init_all(&GptModel::new(cfg.clone()).unwrap(), 11));
    assert_ne!(a, init_all(&model, 12));
    let std = |x: &[f32]| {
        let n = x.len() as f64;
        let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        (x.iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / n)
            .sqrt()
    };
    for (u, spec) in model.spec().units.iter().enumerate() {
        for (p, off) in spec.params.iter().zip(spec.offsets()) {
            let x = &a[u][off..off + p.numel()];
            if p.name.ends_with(".bias") {
                assert!(x.iter().all(|&v| v == 0.0), "{}", p.name);
            } else if p.name.contains("ln_") {
                assert!(x.iter().all(|&v| v == 1.0), "{}", p.name);
            } else {
                let want = if p.name.ends_with("c_proj.weight") {
                    0.02 / (2.0 * cfg.layers as f64).sqrt()
                } else {
                    0.02
                };
                let got = std(x);
                assert!(
                    (got / want - 1.0).abs() < 0.1,
                    "{}: std {got} want {want}",
                    p.name
                );
            }
        }
    }
    // Distinct tensors draw distinct streams.
    assert_ne!(&a[1][2 * 32..2 * 32 + 64], &a[2][2 * 32..2 * 32 + 64]);
}

#[test]
fn bad_calls_are_reported() {
    let cfg = GptConfig::tiny();
    let model = GptModel::new(cfg.clone()).unwrap();
    let params = init_all(&model, 1);
    let batch = random_batch(&cfg, 1, 4, 1);
    let err = model
        .forward(1, &[&params[1][1..]], None, &batch, ForwardMode::Train)
        .err()
        .unwrap();
    assert!(matches!(err, ModelError::ParamShape { .. }), "{err}");
    let err = model
        .forward(
            1,
            &groups(&model, &params, 1),
            None,
            &batch,
            ForwardMode::Train,
        )
        .err()
        .unwrap();
    assert!(err.to_string().contains("input"), "{err}");
    let long = random_batch(&cfg, 1, cfg.context + 1, 1);
    let err = model
        .forward(
            0,
            &groups(&model, &params, 0),
            None,
            &long,
            ForwardMode::Train,
        )
        .err()
        .unwrap();
    assert!(err.to_string().contains("context"), "{err}");
    assert!(model
        .forward(
            9,
            &groups(&model, &params, 0),
            None,
            &batch,
            ForwardMode::Train
        )
        .is_err());
    let mut bad_token = batch.clone();
    bad_token.tokens[0] = cfg.vocab_size as u32;
    let err = model
        .forward(
            0,
            &groups(&model, &params, 0),
            None,
            &bad_token,
            ForwardMode::NoGrad,
        )
        .err()
        .unwrap();
    assert!(err.to_string().contains("vocabulary"), "{err}");
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let cfg = GptConfig {
        width: 64,
        heads: 4,
        context: 32,
        ..GptConfig::tiny()
    };
    let model = GptModel::new(cfg.clone()).unwrap();
    let params = init_all(&model, 21);
    // 3 x 32 rows: more than one fixed-size chunk in every row-parallel kernel.
    let batch = random_batch(&cfg, 3, 32, 22);
    let run = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| unit_by_unit(&model, &params, &batch, 1.0, false))
    };
    let (loss_1, grads_1) = run(1);
    let (loss_2, grads_2) = run(2);
    assert_eq!(loss_1, loss_2);
    assert_eq!(
        grads_1, grads_2,
        "gradients must be bitwise equal on 1 and 2 threads"
    );
}
