//! The candle helper (`zerodp::model::Candle` over a `CandleUnits`) keeps the unit contract for a
//! model that is not the GPT: a tied weight read by a non-adjacent unit gets both gradient
//! contributions, unit-by-unit backward equals one end-to-end backward and finite differences,
//! NoGrad + recompute changes nothing, and bad calls are reported naming the unit.

use candle_core::{DType, Device, Tensor};
use zerodp::model::{Candle, CandleUnits};
use zerodp::rng::{mix_seed, SplitMix64};
use zerodp::zero::unit::{
    BatchCounts, ForwardMode, ModelError, ModelSpec, ParamSpec, UnitModel, UnitSpec,
};

const F: usize = 5;
const H: usize = 3;

/// Three units: `embed` (`h = x W^T`, `W [H, F]`), `mix` (`tanh(h * s + b)`), and `head`, which
/// owns `c` and reads `W` from unit 0 (`uses = [0]`, two units back) to reconstruct
/// `x_hat = h W + c`, with the mean squared error as the loss.
struct Chain {
    spec: ModelSpec,
    dtype: DType,
    /// Make the head return a per-row loss instead of the mean (a contract violation).
    vector_loss: bool,
}

struct Points {
    x: Vec<f32>,
    n: usize,
}

fn p(name: &str, shape: &[usize]) -> ParamSpec {
    ParamSpec {
        name: name.into(),
        shape: shape.to_vec(),
    }
}

impl Chain {
    fn new(dtype: DType) -> Self {
        let units = vec![
            UnitSpec {
                name: "embed".into(),
                params: vec![p("embed.w", &[H, F])],
                uses: vec![],
            },
            UnitSpec {
                name: "mix".into(),
                params: vec![p("mix.s", &[H]), p("mix.b", &[H])],
                uses: vec![],
            },
            UnitSpec {
                name: "head".into(),
                params: vec![p("head.c", &[F])],
                uses: vec![0],
            },
        ];
        Chain {
            spec: ModelSpec { units },
            dtype,
            vector_loss: false,
        }
    }
}

impl CandleUnits for Chain {
    type Batch = Points;

    fn spec(&self) -> &ModelSpec {
        &self.spec
    }
    fn batch_counts(&self, b: &Points) -> BatchCounts {
        BatchCounts {
            samples: b.n,
            tokens: b.n,
        }
    }
    fn init_params(&self, unit: usize, seed: u64, out: &mut [f32]) {
        let mut rng = SplitMix64::new(mix_seed(&[seed, unit as u64]));
        out.iter_mut()
            .for_each(|v| *v = (0.5 * rng.normal()) as f32);
    }
    fn forward_unit(
        &self,
        unit: usize,
        p: &[Tensor],
        input: Option<&Tensor>,
        b: &Points,
    ) -> candle_core::Result<Tensor> {
        let x = Tensor::from_slice(&b.x, (b.n, F), &Device::Cpu)?.to_dtype(self.dtype)?;
        match unit {
            0 => x.matmul(&p[0].t()?),
            1 => input
                .unwrap()
                .broadcast_mul(&p[0])?
                .broadcast_add(&p[1])?
                .tanh(),
            _ => {
                // p: head.c, then unit 0's embed.w.
                let err = (input.unwrap().matmul(&p[1])?.broadcast_add(&p[0])? - x)?.sqr()?;
                if self.vector_loss {
                    err.mean(1)
                } else {
                    err.mean_all()
                }
            }
        }
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
}

fn points(n: usize, seed: u64) -> Points {
    let mut rng = SplitMix64::new(seed);
    Points {
        x: (0..n * F).map(|_| rng.normal() as f32).collect(),
        n,
    }
}

fn init_all(model: &Candle<Chain>, seed: u64) -> Vec<Vec<f32>> {
    (0..3)
        .map(|u| {
            let mut buf = vec![0.0; model.spec().units[u].numel()];
            model.init_params(u, seed, &mut buf);
            buf
        })
        .collect()
}

/// Forward unit by unit (Train, or NoGrad with a Train recompute before each backward), then
/// backward in reverse, as the engine does; the head's gradient slices are its own and unit 0's.
fn unit_by_unit(
    model: &Candle<Chain>,
    params: &[Vec<f32>],
    batch: &Points,
    loss_weight: f32,
    recompute: bool,
) -> (f32, Vec<Vec<f32>>) {
    let groups = |u: usize| -> Vec<&[f32]> {
        std::iter::once(u)
            .chain(model.spec().units[u].uses.iter().copied())
            .map(|g| params[g].as_slice())
            .collect()
    };
    let mode = if recompute {
        ForwardMode::NoGrad
    } else {
        ForwardMode::Train
    };
    let mut inputs: Vec<Option<Tensor>> = vec![None];
    let mut saved = Vec::new();
    let mut loss = None;
    for u in 0..3 {
        let mode = if u == 2 { ForwardMode::Train } else { mode };
        let out = model
            .forward(u, &groups(u), inputs[u].as_ref(), batch, mode)
            .unwrap();
        assert_eq!(out.saved.is_some(), mode == ForwardMode::Train);
        saved.push(out.saved);
        match out.output {
            Some(o) => inputs.push(Some(o)),
            None => loss = out.loss,
        }
    }
    let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    let mut upstream: Option<Tensor> = None;
    for u in (0..3).rev() {
        let s = saved[u].take().unwrap_or_else(|| {
            model
                .forward(u, &groups(u), inputs[u].as_ref(), batch, ForwardMode::Train)
                .unwrap()
                .saved
                .unwrap()
        });
        let (g0, rest) = grads.split_at_mut(1);
        let mut slices: Vec<&mut [f32]> = match u {
            0 => vec![&mut g0[0]],
            1 => vec![&mut rest[0]],
            _ => vec![&mut rest[1], &mut g0[0]],
        };
        upstream = model
            .backward(u, s, upstream.as_ref(), loss_weight, &mut slices)
            .unwrap();
        assert_eq!(upstream.is_some(), u > 0, "unit {u}'s input gradient");
    }
    (loss.unwrap(), grads)
}

fn close(a: &[Vec<f32>], b: &[Vec<f32>], rel: f32) {
    for (u, (x, y)) in a.iter().zip(b).enumerate() {
        for (i, (p, q)) in x.iter().zip(y).enumerate() {
            assert!(
                (p - q).abs() <= rel * p.abs().max(q.abs()) + 1e-7,
                "unit {u} element {i}: {p} vs {q}"
            );
        }
    }
}

#[test]
fn tied_gradients_match_end_to_end_and_finite_differences() {
    let model = Candle::new(Chain::new(DType::F64));
    let mut params = init_all(&model, 1);
    let batch = points(4, 2);
    let loss_weight = 0.6;
    let (loss, analytic) = unit_by_unit(&model, &params, &batch, loss_weight, false);
    let refs: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
    let (loss_e2e, e2e) = model.end_to_end(&refs, &batch, loss_weight).unwrap();
    assert!((f64::from(loss) - loss_e2e).abs() < 1e-6);
    close(&analytic, &e2e, 1e-6);

    // The head's use of embed.w matters: without it the embedding gradient would differ.
    let eps = 1e-3f32;
    for u in 0..3 {
        for i in 0..params[u].len() {
            let orig = params[u][i];
            let loss_at = |p: &[Vec<f32>]| {
                let refs: Vec<&[f32]> = p.iter().map(Vec::as_slice).collect();
                model.end_to_end(&refs, &batch, 1.0).unwrap().0 * f64::from(loss_weight)
            };
            params[u][i] = orig + eps;
            let hi = loss_at(&params);
            params[u][i] = orig - eps;
            let lo = loss_at(&params);
            params[u][i] = orig;
            let numeric = (hi - lo) / (f64::from(orig + eps) - f64::from(orig - eps));
            let a = f64::from(analytic[u][i]);
            assert!(
                (a - numeric).abs() <= 1e-5 + 1e-3 * a.abs().max(numeric.abs()),
                "unit {u} element {i}: analytic {a:e} vs numeric {numeric:e}"
            );
        }
    }
}

#[test]
fn recompute_is_identical_and_gradients_accumulate() {
    let model = Candle::new(Chain::new(DType::F32));
    let params = init_all(&model, 3);
    let batch = points(6, 4);
    let (l1, g1) = unit_by_unit(&model, &params, &batch, 1.0, false);
    let (l2, g2) = unit_by_unit(&model, &params, &batch, 1.0, true);
    assert_eq!(l1, l2);
    assert_eq!(
        g1, g2,
        "NoGrad + recompute must give bitwise the same gradients"
    );
    assert!(g1.iter().all(|g| g.iter().all(|&x| x != 0.0)));

    // Backward adds (`+=`): a second backward into the same slice doubles it exactly.
    let groups: Vec<&[f32]> = vec![&params[0]];
    let mut buf = vec![0.0f32; params[0].len()];
    let mut once = Vec::new();
    for _ in 0..2 {
        let fwd = model
            .forward(0, &groups, None, &batch, ForwardMode::Train)
            .unwrap();
        let ones = fwd.output.unwrap().ones_like().unwrap();
        model
            .backward(0, fwd.saved.unwrap(), Some(&ones), 1.0, &mut [&mut buf])
            .unwrap();
        if once.is_empty() {
            once = buf.clone();
        }
    }
    assert!(once.iter().any(|&x| x != 0.0));
    let doubled: Vec<f32> = once.iter().map(|x| 2.0 * x).collect();
    assert_eq!(buf, doubled);
}

#[test]
fn bad_calls_name_the_unit() {
    let model = Candle::new(Chain::new(DType::F32));
    let params = init_all(&model, 5);
    let batch = points(2, 6);

    // The head reads two groups (its own and unit 0's): one is not enough.
    let x = Tensor::zeros((2, H), DType::F32, &Device::Cpu).unwrap();
    let err = model
        .forward(2, &[&params[2]], Some(&x), &batch, ForwardMode::Train)
        .err()
        .unwrap();
    assert!(
        matches!(&err, ModelError::ParamShape { unit, .. } if unit == "head"),
        "{err}"
    );

    let err = model
        .forward(1, &[&params[1]], None, &batch, ForwardMode::Train)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("mix") && err.contains("input"), "{err}");

    assert!(model
        .forward(3, &[&params[0]], None, &batch, ForwardMode::Train)
        .err()
        .unwrap()
        .to_string()
        .contains("does not exist"));

    // A compute error from candle (a wrong input width) comes back naming the unit.
    let wrong = Tensor::zeros((2, H + 1), DType::F32, &Device::Cpu).unwrap();
    let err = model
        .forward(1, &[&params[1]], Some(&wrong), &batch, ForwardMode::NoGrad)
        .err()
        .unwrap();
    assert!(
        matches!(&err, ModelError::Compute { unit, .. } if unit == "mix"),
        "{err}"
    );

    // The last unit must return a scalar loss.
    let mut chain = Chain::new(DType::F32);
    chain.vector_loss = true;
    let vector = Candle::new(chain);
    let err = vector
        .forward(
            2,
            &[&params[2], &params[0]],
            Some(&x),
            &batch,
            ForwardMode::NoGrad,
        )
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("head") && err.contains("scalar"), "{err}");

    // An output gradient of the wrong shape, and another unit's saved state.
    let fwd = model
        .forward(1, &[&params[1]], Some(&x), &batch, ForwardMode::Train)
        .unwrap();
    let bad_grad = Tensor::zeros((3, H), DType::F32, &Device::Cpu).unwrap();
    let mut g = vec![0.0f32; params[1].len()];
    let err = model
        .backward(1, fwd.saved.unwrap(), Some(&bad_grad), 1.0, &mut [&mut g])
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("mix") && err.contains("shape"), "{err}");
    let fwd = model
        .forward(1, &[&params[1]], Some(&x), &batch, ForwardMode::Train)
        .unwrap();
    let mut g0 = vec![0.0f32; params[0].len()];
    let err = model
        .backward(0, fwd.saved.unwrap(), Some(&x), 1.0, &mut [&mut g0])
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("saved state of unit 1"), "{err}");
}
