//! Where one GPT micro-step's time goes, op by op, forward and backward, against the FLOPs and
//! bytes each op must do (issue 15, item 1).
//!
//! `cargo run --release --example gpt_op_profile -- [preset] [batch] [reps]` (defaults: small 8 11;
//! sequence length = the preset's context).
//!
//! Each op runs in isolation on tensors of the real shapes through the very code the GPT's units
//! run (`Gpt::{embed, layer_norm, linear, attention_core, gelu, lm_logits, cross_entropy}`, the
//! fused kernels), with its inputs as candle `Var`s. Forward is the op call; backward is candle's
//! `backward()` from the op's output seeded with ones, less the time of allocating that seed (so
//! it includes what the real graph pays per node: the zero allocations and gradient accumulation
//! adds of candle's backward, and the op's gradient allocations). Median of `reps`
//! after one warm-up. Then the same micro-step is timed whole through the unit API (as
//! `examples/gpt_step_time.rs` does) and the ops' sum is compared with it: the remainder is graph
//! building, parameter copies into candle tensors, gradient copies out, allocation.
//!
//! FLOPs and bytes are the minimum the op must do (f32, each tensor read or written once; the
//! elementwise ops' FLOPs per element are nominal). n = batch x seq rows, c width, V vocab,
//! B batch, T seq, H heads, d = c / H. Attention counts the causal half: forward QK^T and AV are
//! 4BHT^2d dense, 2BHT^2d causal; backward dV, dP, dQ, dK 8BHT^2d dense, 4BHT^2d causal (the
//! kernel also recomputes P, another 2BHT^2d dense, not counted). Model FLOPs of a step:
//! 6 x params x tokens + 6 x L x BHT^2d (causal attention, forward + backward).
//!
//! Measured on this machine (2 cores, otherwise idle, `small 8`, release; run to run the op times
//! and the remainder move by about 10%, so a remainder within +-10% means "the ops are the step"):
//!
//! ```text
//! small: 3257856 params, 4 layers, width 256, 4 heads, vocab 256; batch 8 x 128 = 1024 tokens; median of 11
//!
//! == one thread (1 thread(s)); ms per step = per call x count ==
//! op                       x pass  ms/step  share    MFLOP      MB  GFLOP/s    GB/s  FLOPs
//! embedding (wte+wpe)      1  fwd     0.11   0.0%      0.3     2.2      2.4    20.5  f nc, b 2nc (scatter-add)
//!                             bwd     1.21   0.3%      0.5     1.4      0.4     1.2
//! layernorm (ln_1, ln_2)   8  fwd     3.98   1.1%     16.8    16.8      4.2     4.2  f ~8nc, b ~12nc
//!                             bwd     7.01   1.9%     25.2    25.2      3.6     3.6
//! qkv linear c->3c         4  fwd    17.73   4.7%   1610.6    19.9     90.8     1.1  f 2n*c*3c, b 4n*c*3c
//!                             bwd    39.44  10.5%   3224.4    27.3     81.8     0.7
//! attention core           4  fwd    14.30   3.8%    268.4    16.8     18.8     1.2  f 4BHT^2d/2, b 8BHT^2d/2
//!                             bwd    31.94   8.5%    536.9    29.4     16.8     0.9
//! attn proj c->c           4  fwd     5.34   1.4%    536.9     9.4    100.5     1.8  f 2n*c*c, b 4n*c*c
//!                             bwd    11.60   3.1%   1074.8    14.7     92.6     1.3
//! residual add             8  fwd     0.38   0.1%      2.1    25.2      5.5    66.5  f nc, b nc (grad sum)
//!                             bwd     0.99   0.3%      2.1    25.2      2.1    25.5
//! mlp up c->4c             4  fwd    23.71   6.3%   2147.5    25.2     90.6     1.1  f 2n*c*4c, b 4n*c*4c
//!                             bwd    47.60  12.6%   4299.2    33.6     90.3     0.7
//! gelu (n x 4c)            4  fwd    13.84   3.7%     33.6    33.6      2.4     2.4  f ~8*4nc, b ~12*4nc
//!                             bwd    37.20   9.9%     50.3    50.3      1.4     1.4
//! mlp down 4c->c           4  fwd    27.51   7.3%   2147.5    25.2     78.1     0.9  f 2n*4c*c, b 4n*4c*c
//!                             bwd    79.44  21.1%   4296.0    46.1     54.1     0.6
//! final layernorm          1  fwd     0.50   0.1%      2.1     2.1      4.2     4.2  f ~8nc, b ~12nc
//!                             bwd     0.87   0.2%      3.1     3.1      3.6     3.6
//! lm head h@wte^T          1  fwd     1.46   0.4%    134.2     2.4     92.1     1.6  f 2ncV, b 4ncV
//!                             bwd     3.27   0.9%    268.4     3.7     82.1     1.1
//! cross-entropy            1  fwd     1.03   0.3%      0.8     1.0      0.8     1.0  f ~3nV, b ~3nV
//!                             bwd     1.88   0.5%      0.8     2.1      0.4     1.1
//! ops forward 109.9 ms (62.8 GFLOP/s), backward 262.4 ms (52.5 GFLOP/s), backward/forward 2.39
//! real step (unit API): forward 118.5 ms, backward 258.2 ms, total 376.8 ms; ops sum 372.3 ms; unaccounted 4.4 ms (1%; forward 8.6, backward -4.2)
//! model FLOPs 6*P*tokens + 6*L*BHT^2d = 20.82 GFLOP (ops count 20.68); 55.3 GFLOP/s on the real step = 24.0% of 230 GFLOP/s peak
//!
//! == default pool (2 thread(s)); ms per step = per call x count ==
//! op                       x pass  ms/step  share    MFLOP      MB  GFLOP/s    GB/s  FLOPs
//! embedding (wte+wpe)      1  fwd     0.19   0.1%      0.3     2.2      1.4    11.5  f nc, b 2nc (scatter-add)
//!                             bwd     1.47   0.5%      0.5     1.4      0.4     1.0
//! layernorm (ln_1, ln_2)   8  fwd     2.56   0.9%     16.8    16.8      6.5     6.5  f ~8nc, b ~12nc
//!                             bwd     4.91   1.7%     25.2    25.2      5.1     5.1
//! qkv linear c->3c         4  fwd    12.97   4.4%   1610.6    19.9    124.2     1.5  f 2n*c*3c, b 4n*c*3c
//!                             bwd    25.25   8.6%   3224.4    27.3    127.7     1.1
//! attention core           4  fwd    19.65   6.7%    268.4    16.8     13.7     0.9  f 4BHT^2d/2, b 8BHT^2d/2
//!                             bwd    69.22  23.7%    536.9    29.4      7.8     0.4
//! attn proj c->c           4  fwd     4.56   1.6%    536.9     9.4    117.7     2.1  f 2n*c*c, b 4n*c*c
//!                             bwd    10.07   3.4%   1074.8    14.7    106.7     1.5
//! residual add             8  fwd     0.38   0.1%      2.1    25.2      5.6    66.9  f nc, b nc (grad sum)
//!                             bwd     0.97   0.3%      2.1    25.2      2.2    26.0
//! mlp up c->4c             4  fwd    16.56   5.7%   2147.5    25.2    129.7     1.5  f 2n*c*4c, b 4n*c*4c
//!                             bwd    34.74  11.9%   4299.2    33.6    123.8     1.0
//! gelu (n x 4c)            4  fwd     9.87   3.4%     33.6    33.6      3.4     3.4  f ~8*4nc, b ~12*4nc
//!                             bwd    24.56   8.4%     50.3    50.3      2.0     2.0
//! mlp down 4c->c           4  fwd    17.19   5.9%   2147.5    25.2    124.9     1.5  f 2n*4c*c, b 4n*4c*c
//!                             bwd    46.73  16.0%   4296.0    46.1     91.9     1.0
//! final layernorm          1  fwd     0.31   0.1%      2.1     2.1      6.8     6.8  f ~8nc, b ~12nc
//!                             bwd     0.56   0.2%      3.1     3.1      5.6     5.6
//! lm head h@wte^T          1  fwd     1.07   0.4%    134.2     2.4    126.0     2.2  f 2ncV, b 4ncV
//!                             bwd     2.36   0.8%    268.4     3.7    113.9     1.6
//! cross-entropy            1  fwd     1.04   0.4%      0.8     1.0      0.8     1.0  f ~3nV, b ~3nV
//!                             bwd     1.19   0.4%      0.8     2.1      0.7     1.8
//! ops forward 86.3 ms (79.9 GFLOP/s), backward 222.0 ms (62.1 GFLOP/s), backward/forward 2.57
//! real step (unit API): forward 86.2 ms, backward 206.0 ms, total 292.2 ms; ops sum 308.3 ms; unaccounted -16.1 ms (-6%; forward -0.1, backward -16.0)
//! model FLOPs 6*P*tokens + 6*L*BHT^2d = 20.82 GFLOP (ops count 20.68); 71.3 GFLOP/s on the real step = 15.5% of 460 GFLOP/s peak
//! ```
//!
//! Reading it: the five matmuls (four linears per block and the LM head) are 60-70% of the step
//! and run at 55-100 GFLOP/s on one core (25-45% of peak) and 90-130 on two; everything else
//! is far below any roofline (elementwise ops at 1-7 GB/s). The attention core is 12% of the step
//! on one thread at under 20 GFLOP/s and gets *slower* on the default pool (its backward doubles
//! to about a quarter of the step); GELU's backward (~1.5-2 GFLOP/s on a nominal count) is about
//! a tenth. LayerNorm, residual adds, embedding and cross-entropy together are about 5%.
//! Backward/forward is about 2.4, the matmuls' too, against 2 in FLOPs. The ops add up to the unit-API step
//! within the noise, so graph building, parameter copies into candle tensors and gradient copies
//! out are not where the time goes; the step reaches about a quarter of one core's FMA peak.

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use zerodp::model::{Gpt, GptConfig, GptModel, SplitMix64, TokenBatch};
use zerodp::zero::unit::{ForwardMode, UnitModel};

/// One-core AVX-512 FMA peak of this machine in GFLOP/s (project notes).
const PEAK_GFLOPS_PER_CORE: f64 = 230.0;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// One op of the step: how many times it runs per step, its minimum work, and how to run it.
struct Op<'a> {
    name: &'static str,
    count: usize,
    fwd_flops: f64,
    fwd_bytes: f64,
    bwd_flops: f64,
    bwd_bytes: f64,
    formula: &'static str,
    run: Box<dyn Fn() -> candle_core::Result<Tensor> + 'a>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median forward and backward milliseconds of one op call.
fn time_op(run: &dyn Fn() -> candle_core::Result<Tensor>, reps: usize) -> Res<(f64, f64)> {
    let (mut f, mut b) = (Vec::new(), Vec::new());
    for rep in 0..=reps {
        let t0 = Instant::now();
        let out = run()?;
        let t1 = Instant::now();
        let grads = out.backward()?;
        let t2 = Instant::now();
        drop(grads);
        // `backward()` starts by allocating a ones seed the size of the output, which the real
        // graph gets from upstream instead: time that alone and take it off.
        let t3 = Instant::now();
        let seed = out.ones_like()?.contiguous()?;
        let seed_s = t3.elapsed().as_secs_f64();
        drop(seed);
        if rep > 0 {
            f.push((t1 - t0).as_secs_f64() * 1e3);
            b.push(((t2 - t1).as_secs_f64() - seed_s).max(0.0) * 1e3);
        }
    }
    Ok((median(f), median(b)))
}

fn var(rng: &mut SplitMix64, shape: &[usize], scale: f64) -> Res<Var> {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|_| (rng.normal() * scale) as f32).collect();
    Ok(Var::from_tensor(&Tensor::from_vec(
        data,
        shape,
        &Device::Cpu,
    )?)?)
}

/// Median forward and backward milliseconds of a whole micro-step through the unit API.
fn time_step(model: &GptModel, batch: &TokenBatch, reps: usize) -> Res<(f64, f64)> {
    let spec = model.spec().clone();
    let params: Vec<Vec<f32>> = (0..spec.units.len())
        .map(|u| {
            let mut b = vec![0.0; spec.units[u].numel()];
            model.init_params(u, 0, &mut b);
            b
        })
        .collect();
    let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    let (mut f, mut b) = (Vec::new(), Vec::new());
    for rep in 0..=reps {
        let t0 = Instant::now();
        let mut x: Option<Tensor> = None;
        let mut saved = Vec::new();
        for u in 0..spec.units.len() {
            let groups: Vec<&[f32]> = std::iter::once(u)
                .chain(spec.units[u].uses.iter().copied())
                .map(|g| params[g].as_slice())
                .collect();
            let out = model.forward(u, &groups, x.as_ref(), batch, ForwardMode::Train)?;
            saved.push(out.saved);
            x = out.output;
        }
        let t1 = Instant::now();
        let mut up: Option<Tensor> = None;
        for u in (0..spec.units.len()).rev() {
            let s = saved.pop().flatten().ok_or("missing saved state")?;
            let (head, tail) = grads.split_at_mut(u);
            let mut slices: Vec<&mut [f32]> = vec![tail[0].as_mut_slice()];
            if !spec.units[u].uses.is_empty() {
                slices.push(head[0].as_mut_slice());
            }
            up = model.backward(u, s, up.as_ref(), 1.0, &mut slices)?;
        }
        let t2 = Instant::now();
        if rep > 0 {
            f.push((t1 - t0).as_secs_f64() * 1e3);
            b.push((t2 - t1).as_secs_f64() * 1e3);
        }
    }
    Ok((median(f), median(b)))
}

/// The ops of one micro-step of `gpt` on `batch`, with their inputs.
fn ops<'a>(gpt: &'a Gpt, batch: &'a TokenBatch, v: &'a Vars) -> Vec<Op<'a>> {
    let cfg = gpt.config();
    let (bsz, t) = (batch.batch_size, batch.seq_len);
    let n = (bsz * t) as f64;
    let (c, vv, tt, l) = (
        cfg.width as f64,
        cfg.vocab_size as f64,
        t as f64,
        cfg.layers,
    );
    let (h, d) = (cfg.heads as f64, (cfg.width / cfg.heads) as f64);
    let bsz_f = bsz as f64;
    let f4 = 4.0; // bytes per f32
    let lin_fwd = |i: f64, o: f64| 2.0 * n * i * o;
    let lin_fwd_b = |i: f64, o: f64| f4 * (n * i + i * o + o + n * o);
    let lin_bwd = |i: f64, o: f64| 4.0 * n * i * o + n * o;
    let lin_bwd_b = |i: f64, o: f64| f4 * (2.0 * n * i + 2.0 * i * o + n * o + o);
    let linear = |name, formula, x: &'a Var, w: &'a Var, b: &'a Var, i: f64, o: f64| Op {
        name,
        count: l,
        fwd_flops: lin_fwd(i, o),
        fwd_bytes: lin_fwd_b(i, o),
        bwd_flops: lin_bwd(i, o),
        bwd_bytes: lin_bwd_b(i, o),
        formula,
        run: Box::new(move || gpt.linear(x.as_tensor(), w.as_tensor(), b.as_tensor())),
    };
    let att = bsz_f * h * tt * tt * d;
    vec![
        Op {
            name: "embedding (wte+wpe)",
            count: 1,
            fwd_flops: n * c,
            fwd_bytes: f4 * (2.0 * n * c + tt * c),
            bwd_flops: 2.0 * n * c,
            bwd_bytes: f4 * (n * c + vv * c + tt * c),
            formula: "f nc, b 2nc (scatter-add)",
            run: Box::new(move || {
                gpt.embed(v.wte.as_tensor(), v.wpe.as_tensor(), &batch.tokens, bsz, t)
            }),
        },
        Op {
            name: "layernorm (ln_1, ln_2)",
            count: 2 * l,
            fwd_flops: 8.0 * n * c,
            fwd_bytes: f4 * 2.0 * n * c,
            bwd_flops: 12.0 * n * c,
            bwd_bytes: f4 * 3.0 * n * c,
            formula: "f ~8nc, b ~12nc",
            run: Box::new(move || {
                gpt.layer_norm(v.x.as_tensor(), v.ln_w.as_tensor(), v.ln_b.as_tensor())
            }),
        },
        linear(
            "qkv linear c->3c",
            "f 2n*c*3c, b 4n*c*3c",
            &v.x,
            &v.w_qkv,
            &v.b_qkv,
            c,
            3.0 * c,
        ),
        Op {
            name: "attention core",
            count: l,
            fwd_flops: 2.0 * att,
            fwd_bytes: f4 * 4.0 * n * c,
            bwd_flops: 4.0 * att,
            bwd_bytes: f4 * 7.0 * n * c,
            formula: "f 4BHT^2d/2, b 8BHT^2d/2",
            run: Box::new(move || gpt.attention_core(v.qkv.as_tensor(), bsz, t)),
        },
        linear(
            "attn proj c->c",
            "f 2n*c*c, b 4n*c*c",
            &v.x,
            &v.w_proj,
            &v.b_c,
            c,
            c,
        ),
        Op {
            name: "residual add",
            count: 2 * l,
            fwd_flops: n * c,
            fwd_bytes: f4 * 3.0 * n * c,
            bwd_flops: n * c,
            bwd_bytes: f4 * 3.0 * n * c,
            formula: "f nc, b nc (grad sum)",
            run: Box::new(move || v.x.as_tensor() + v.x2.as_tensor()),
        },
        linear(
            "mlp up c->4c",
            "f 2n*c*4c, b 4n*c*4c",
            &v.x,
            &v.w_fc,
            &v.b_fc,
            c,
            4.0 * c,
        ),
        Op {
            name: "gelu (n x 4c)",
            count: l,
            fwd_flops: 8.0 * n * 4.0 * c,
            fwd_bytes: f4 * 2.0 * n * 4.0 * c,
            bwd_flops: 12.0 * n * 4.0 * c,
            bwd_bytes: f4 * 3.0 * n * 4.0 * c,
            formula: "f ~8*4nc, b ~12*4nc",
            run: Box::new(move || gpt.gelu(v.h4.as_tensor())),
        },
        linear(
            "mlp down 4c->c",
            "f 2n*4c*c, b 4n*4c*c",
            &v.h4,
            &v.w_fc_proj,
            &v.b_c,
            4.0 * c,
            c,
        ),
        Op {
            name: "final layernorm",
            count: 1,
            fwd_flops: 8.0 * n * c,
            fwd_bytes: f4 * 2.0 * n * c,
            bwd_flops: 12.0 * n * c,
            bwd_bytes: f4 * 3.0 * n * c,
            formula: "f ~8nc, b ~12nc",
            run: Box::new(move || {
                gpt.layer_norm(v.x.as_tensor(), v.ln_w.as_tensor(), v.ln_b.as_tensor())
            }),
        },
        Op {
            name: "lm head h@wte^T",
            count: 1,
            fwd_flops: 2.0 * n * c * vv,
            fwd_bytes: f4 * (n * c + vv * c + n * vv),
            bwd_flops: 4.0 * n * c * vv,
            bwd_bytes: f4 * (n * vv + 2.0 * n * c + 2.0 * vv * c),
            formula: "f 2ncV, b 4ncV",
            run: Box::new(move || gpt.lm_logits(v.x.as_tensor(), v.wte.as_tensor())),
        },
        Op {
            name: "cross-entropy",
            count: 1,
            fwd_flops: 3.0 * n * vv,
            fwd_bytes: f4 * n * vv,
            bwd_flops: 3.0 * n * vv,
            bwd_bytes: f4 * 2.0 * n * vv,
            formula: "f ~3nV, b ~3nV",
            run: Box::new(move || gpt.cross_entropy(v.logits.as_tensor(), &v.targets)),
        },
    ]
}

/// The op inputs, at the real shapes.
struct Vars {
    wte: Var,
    wpe: Var,
    x: Var,
    x2: Var,
    ln_w: Var,
    ln_b: Var,
    w_qkv: Var,
    b_qkv: Var,
    qkv: Var,
    w_proj: Var,
    b_c: Var,
    w_fc: Var,
    b_fc: Var,
    h4: Var,
    w_fc_proj: Var,
    logits: Var,
    targets: Tensor,
}

impl Vars {
    fn new(cfg: &GptConfig, batch: &TokenBatch) -> Res<Self> {
        let mut rng = SplitMix64::new(7);
        let (n, c, v) = (batch.batch_size * batch.seq_len, cfg.width, cfg.vocab_size);
        let mut r = |shape: &[usize], scale: f64| var(&mut rng, shape, scale);
        Ok(Self {
            wte: r(&[v, c], 0.02)?,
            wpe: r(&[cfg.context, c], 0.02)?,
            x: r(&[n, c], 1.0)?,
            x2: r(&[n, c], 1.0)?,
            ln_w: r(&[c], 1.0)?,
            ln_b: r(&[c], 0.1)?,
            w_qkv: r(&[3 * c, c], 0.02)?,
            b_qkv: r(&[3 * c], 0.02)?,
            qkv: r(&[n, 3 * c], 1.0)?,
            w_proj: r(&[c, c], 0.02)?,
            b_c: r(&[c], 0.02)?,
            w_fc: r(&[4 * c, c], 0.02)?,
            b_fc: r(&[4 * c], 0.02)?,
            h4: r(&[n, 4 * c], 1.0)?,
            w_fc_proj: r(&[c, 4 * c], 0.02)?,
            logits: r(&[n, v], 1.0)?,
            targets: Tensor::from_slice(&batch.targets, n, &Device::Cpu)?,
        })
    }
}

fn profile(
    label: &str,
    threads: usize,
    model: &GptModel,
    batch: &TokenBatch,
    vars: &Vars,
    reps: usize,
) -> Res<()> {
    let gpt = model.gpt();
    let cfg = gpt.config();
    let ops = ops(gpt, batch, vars);
    let mut times = Vec::new();
    for op in &ops {
        times.push(time_op(&op.run, reps)?);
    }
    let (step_f, step_b) = time_step(model, batch, reps)?;
    let step = step_f + step_b;
    println!("\n== {label} ({threads} thread(s)); ms per step = per call x count ==");
    println!(
        "{:<23}{:>3} {:>4}{:>9}{:>7}{:>9}{:>8}{:>9}{:>8}  FLOPs",
        "op", "x", "pass", "ms/step", "share", "MFLOP", "MB", "GFLOP/s", "GB/s"
    );
    let (mut sum_f, mut sum_b, mut flops_f, mut flops_b) = (0.0, 0.0, 0.0, 0.0);
    for (op, &(tf, tb)) in ops.iter().zip(&times) {
        let k = op.count as f64;
        for (pass, t, fl, by) in [
            ("fwd", tf, op.fwd_flops, op.fwd_bytes),
            ("bwd", tb, op.bwd_flops, op.bwd_bytes),
        ] {
            let ms = t * k;
            println!(
                "{:<23}{:>3} {:>4}{:>9.2}{:>6.1}%{:>9.1}{:>8.1}{:>9.1}{:>8.1}  {}",
                if pass == "fwd" { op.name } else { "" },
                if pass == "fwd" {
                    op.count.to_string()
                } else {
                    String::new()
                },
                pass,
                ms,
                100.0 * ms / step,
                fl * k / 1e6,
                by * k / 1e6,
                fl / (t * 1e6),
                by / (t * 1e6),
                if pass == "fwd" { op.formula } else { "" },
            );
        }
        sum_f += tf * k;
        sum_b += tb * k;
        flops_f += op.fwd_flops * k;
        flops_b += op.bwd_flops * k;
    }
    let sum = sum_f + sum_b;
    let n = (batch.batch_size * batch.seq_len) as f64;
    let att = (cfg.layers * batch.batch_size * cfg.heads * batch.seq_len * batch.seq_len) as f64
        * (cfg.width / cfg.heads) as f64;
    let model_flops = 6.0 * cfg.num_params() as f64 * n + 6.0 * att;
    let peak = PEAK_GFLOPS_PER_CORE * threads as f64;
    println!(
        "ops forward {sum_f:.1} ms ({:.1} GFLOP/s), backward {sum_b:.1} ms ({:.1} GFLOP/s), \
         backward/forward {:.2}",
        flops_f / (sum_f * 1e6),
        flops_b / (sum_b * 1e6),
        sum_b / sum_f
    );
    println!(
        "real step (unit API): forward {step_f:.1} ms, backward {step_b:.1} ms, total {step:.1} ms; \
         ops sum {sum:.1} ms; unaccounted {:.1} ms ({:.0}%; forward {:.1}, backward {:.1})",
        step - sum,
        100.0 * (step - sum) / step,
        step_f - sum_f,
        step_b - sum_b
    );
    println!(
        "model FLOPs 6*P*tokens + 6*L*BHT^2d = {:.2} GFLOP (ops count {:.2}); {:.1} GFLOP/s on the \
         real step = {:.1}% of {peak:.0} GFLOP/s peak",
        model_flops / 1e9,
        (flops_f + flops_b) / 1e9,
        model_flops / (step * 1e6),
        100.0 * model_flops / (step * 1e6) / peak
    );
    Ok(())
}

fn main() -> Res<()> {
    zerodp::model::run_candle_elementwise_on_caller_thread();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let preset = args.first().map(String::as_str).unwrap_or("small");
    let batch_size: usize = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(8);
    let reps: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(11);
    let cfg = GptConfig::preset(preset)?;
    let model = GptModel::with_options(cfg.clone(), DType::F32, true)?;
    let mut rng = SplitMix64::new(1);
    let n = batch_size * cfg.context;
    let batch = TokenBatch {
        tokens: (0..n).map(|_| rng.below(cfg.vocab_size) as u32).collect(),
        targets: (0..n).map(|_| rng.below(cfg.vocab_size) as u32).collect(),
        batch_size,
        seq_len: cfg.context,
    };
    println!(
        "{preset}: {} params, {} layers, width {}, {} heads, vocab {}; batch {batch_size} x {} = {n} tokens; median of {reps}",
        cfg.num_params(),
        cfg.layers,
        cfg.width,
        cfg.heads,
        cfg.vocab_size,
        cfg.context
    );
    let vars = Vars::new(&cfg, &batch)?;
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
    one.install(|| {
        profile("one thread", 1, &model, &batch, &vars, reps).map_err(|e| e.to_string())
    })?;
    profile(
        "default pool",
        rayon::current_num_threads(),
        &model,
        &batch,
        &vars,
        reps,
    )?;
    Ok(())
}
