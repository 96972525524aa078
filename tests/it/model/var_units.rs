//! Units built by closures from a `candle_nn::VarBuilder` (`zerodp::model::VarUnits`): the
//! example's MLP built that way trains bit for bit as the same MLP written the explicit way (every
//! parameter listed by hand), at every stage; tied weights through `uses`; and the mistakes
//! (no parameters, a name twice, a shape that changes, a fused op without backward) are refused
//! naming the unit and the parameter.

use crate::mlp;

use candle_core::{Device, Tensor, D};
use candle_nn::{linear, Init, Module, VarBuilder};
use mlp::{mlp_units, MlpConfig, Rows, Spirals};
use zerodp::model::{init_values, Candle, CandleUnits, VarUnits};
use zerodp::rng::{mix_seed, SplitMix64};
use zerodp::trainer::{BatchIndex, LrSchedule, ReportLog, Trainer};
use zerodp::zero::unit::{
    BatchCounts, ForwardMode, ModelError, ModelSpec, ParamSpec, UnitModel, UnitSpec,
};
use zerodp::zero::{EngineConfig, Stage};

const GLOBAL: usize = 24;
const STAGES: [Stage; 4] = [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3];
const CFG: MlpConfig = MlpConfig {
    features: Spirals::FEATURES,
    hidden: 16,
    layers: 2,
    classes: 3,
};

/// The same MLP written the explicit way: every parameter's name and shape listed, the forward on
/// the parameter tensors, and the initial values `candle_nn::linear` asks for (Kaiming-normal
/// weights, biases uniform in ±1/sqrt(in)) drawn from `VarUnits`' documented streams.
struct ExplicitMlp {
    spec: ModelSpec,
}

impl ExplicitMlp {
    fn new(cfg: MlpConfig) -> Self {
        let units = cfg
            .layers()
            .into_iter()
            .map(|(name, inp, out)| UnitSpec {
                params: vec![
                    ParamSpec {
                        name: format!("{name}.weight"),
                        shape: vec![out, inp],
                    },
                    ParamSpec {
                        name: format!("{name}.bias"),
                        shape: vec![out],
                    },
                ],
                name,
                uses: vec![],
            })
            .collect();
        ExplicitMlp {
            spec: ModelSpec { units },
        }
    }
}

impl CandleUnits for ExplicitMlp {
    type Batch = Rows;

    fn spec(&self) -> &ModelSpec {
        &self.spec
    }
    fn batch_counts(&self, b: &Rows) -> BatchCounts {
        BatchCounts {
            samples: b.n,
            tokens: b.n,
        }
    }
    fn init_params(&self, unit: usize, seed: u64, out: &mut [f32]) {
        let w = &self.spec.units[unit].params[0];
        let bound = 1.0 / (w.shape[1] as f64).sqrt();
        let inits = [
            candle_nn::init::DEFAULT_KAIMING_NORMAL,
            Init::Uniform {
                lo: -bound,
                up: bound,
            },
        ];
        let (weight, bias) = out.split_at_mut(w.numel());
        for (i, (init, out)) in inits.into_iter().zip([weight, bias]).enumerate() {
            let shape = &self.spec.units[unit].params[i].shape;
            let mut rng = SplitMix64::new(mix_seed(&[seed, unit as u64, i as u64]));
            init_values(init, shape, &mut rng, out);
        }
    }
    fn forward_unit(
        &self,
        unit: usize,
        p: &[Tensor],
        input: Option<&Tensor>,
        b: &Rows,
    ) -> candle_core::Result<Tensor> {
        let x = match input {
            Some(x) => x.clone(),
            None => Tensor::from_slice(&b.features, (b.n, CFG.features), &Device::Cpu)?,
        };
        let y = x.matmul(&p[0].t()?)?.broadcast_add(&p[1])?;
        if unit + 1 < self.spec.units.len() {
            return y.relu();
        }
        let labels = Tensor::from_slice(&b.labels, b.n, &Device::Cpu)?;
        candle_nn::loss::cross_entropy(&y, &labels)
    }
}

/// Rank 0's losses per step and the trained parameters of `model` at `stage` on `world` ranks.
fn train<M: UnitModel<Batch = Rows>>(
    model: &M,
    stage: Stage,
    world: usize,
    ga: usize,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let data = Spirals {
        seed: 5,
        classes: 3,
        noise: 0.2,
    };
    let mut cfg = EngineConfig::new(stage, world);
    cfg.grad_accum = ga;
    cfg.micro_batch = GLOBAL / (world * ga);
    cfg.gradient_clipping = 1.0;
    cfg.param_persistence_threshold = 100;
    cfg.reduce_bucket_size = 300;
    cfg.seed = 3;
    let source = |at: BatchIndex| Ok::<_, String>(data.micro_batch(at));
    let log = ReportLog::new();
    let out = Trainer::new(model, cfg)
        .with_schedule(LrSchedule::Constant(1e-2))
        .keep_params(true)
        .run(&source, 6, &[&log])
        .unwrap_or_else(|e| panic!("{stage:?} world {world}: {e}"));
    let losses = log.into_reports()[0].iter().map(|r| r.loss).collect();
    (losses, out.params.unwrap())
}

#[test]
fn closure_built_units_train_bit_for_bit_as_the_explicit_model() {
    let built = Candle::new(mlp_units(CFG).unwrap());
    let explicit = Candle::new(ExplicitMlp::new(CFG));
    // Names, shapes and order found from what `candle_nn::linear` asked for.
    assert_eq!(built.units().spec(), explicit.units().spec());
    let reference = train(&explicit, Stage::Zero0, 1, 1);
    assert!(reference.0[5] < reference.0[0], "{:?}", reference.0);
    for stage in STAGES {
        for (world, ga) in [(1, 1), (2, 1), (2, 2)] {
            let a = train(&explicit, stage, world, ga);
            let b = train(&built, stage, world, ga);
            assert_eq!(a, b, "{stage:?} world {world} ga {ga}");
            for (x, y) in a.0.iter().zip(&reference.0) {
                assert!((x - y).abs() <= 1e-5 * y.abs(), "{stage:?} world {world}");
            }
        }
    }
}

#[test]
fn initial_values_follow_each_layers_initialiser() {
    let units = mlp_units(CFG).unwrap();
    let spec = units.spec().clone();
    let mut head = vec![0.0; spec.units[3].numel()];
    units.init_params(3, 9, &mut head);
    let (w, b) = head.split_at(3 * 16);
    // Kaiming normal, fan in 16, ReLU gain: std sqrt(2/16) = 0.354; biases within 1/4.
    let std = (w.iter().map(|x| x * x).sum::<f32>() / w.len() as f32).sqrt();
    assert!((0.2..0.5).contains(&std), "{std}");
    assert!(b.iter().all(|x| x.abs() <= 0.25) && b.iter().any(|&x| x != 0.0));
    // A function of the seed alone.
    let mut again = vec![0.0; head.len()];
    units.init_params(3, 9, &mut again);
    assert_eq!(head, again);
    units.init_params(3, 10, &mut again);
    assert_ne!(head, again);
}

/// `n` points in 4 dimensions, for the small models below.
struct Points {
    x: Vec<f32>,
    n: usize,
}

fn points(n: usize) -> Points {
    let mut rng = SplitMix64::new(11);
    Points {
        x: (0..n * 4).map(|_| rng.normal() as f32).collect(),
        n,
    }
}

fn counts(b: &Points) -> BatchCounts {
    BatchCounts {
        samples: b.n,
        tokens: b.n,
    }
}

fn x_of(b: &Points) -> candle_core::Result<Tensor> {
    Tensor::from_slice(&b.x, (b.n, 4), &Device::Cpu)
}

fn mse(y: &Tensor, b: &Points) -> candle_core::Result<Tensor> {
    (y - x_of(b)?)?.sqr()?.mean_all()
}

/// A tied autoencoder: `enc` makes the code, `dec` owns a bias and reads `enc.weight` back.
fn tied() -> VarUnits<Points> {
    VarUnits::new(counts)
        .unit(
            "enc",
            |vb| linear(4, 2, vb.pp("enc")),
            |l, _, b: &Points| l.forward(&x_of(b)?)?.tanh(),
        )
        .unwrap()
        .unit_using(
            "dec",
            &[0],
            |vb: VarBuilder| Ok((vb.get((2, 4), "enc.weight")?, vb.get(4, "dec.bias")?)),
            |(w, c), h, b| mse(&h.unwrap().matmul(w)?.broadcast_add(c)?, b),
        )
        .unwrap()
}

/// Rank 0's losses of the tied autoencoder at `stage` on `world` ranks.
fn tied_losses(stage: Stage, world: usize) -> Vec<f32> {
    let model = Candle::new(tied());
    let mut cfg = EngineConfig::new(stage, world);
    cfg.micro_batch = 8 / world;
    cfg.param_persistence_threshold = 0;
    let source = |at: BatchIndex| {
        // The same global batch of 8 rows per step at every world size: rank r takes its rows.
        let mut rng = SplitMix64::new(mix_seed(&[at.step]));
        let all: Vec<f32> = (0..8 * 4).map(|_| rng.normal() as f32).collect();
        let n = at.micro_batch_size;
        let x = all[at.rank * n * 4..(at.rank + 1) * n * 4].to_vec();
        Ok::<_, String>(Points { x, n })
    };
    let log = ReportLog::new();
    Trainer::new(&model, cfg)
        .with_schedule(LrSchedule::Constant(2e-2))
        .run(&source, 20, &[&log])
        .unwrap_or_else(|e| panic!("{stage:?} world {world}: {e}"));
    log.into_reports()[0].iter().map(|r| r.loss).collect()
}

#[test]
fn a_tied_weight_is_read_through_uses_and_trains_alike_at_every_stage() {
    let reference = tied_losses(Stage::Zero0, 1);
    assert!(reference[19] < reference[0], "{reference:?}");
    for stage in STAGES {
        let l = tied_losses(stage, 2);
        for (a, b) in l.iter().zip(&reference) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{stage:?}: {l:?} vs {reference:?}"
            );
        }
    }
}

#[test]
fn a_tied_weight_gets_both_contributions() {
    let model = Candle::new(tied());
    let spec = model.spec();
    assert_eq!(spec.units[1].uses, vec![0]);
    let names: Vec<&str> = spec.units[1]
        .params
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(names, ["dec.bias"]);
    // Unit-by-unit backward gives the tied weight both contributions, as one graph does.
    let params: Vec<Vec<f32>> = (0..2)
        .map(|u| {
            let mut v = vec![0.0; spec.units[u].numel()];
            model.init_params(u, 4, &mut v);
            v
        })
        .collect();
    let refs: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
    let batch = points(8);
    let (_, whole) = model.end_to_end(&refs, &batch, 1.0).unwrap();
    let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    let f0 = model
        .forward(0, &[&params[0]], None, &batch, ForwardMode::Train)
        .unwrap();
    let f1 = model
        .forward(
            1,
            &[&params[1], &params[0]],
            f0.output.as_ref(),
            &batch,
            ForwardMode::Train,
        )
        .unwrap();
    let (g0, g1) = grads.split_at_mut(1);
    let dh = model
        .backward(
            1,
            f1.saved.unwrap(),
            None,
            1.0,
            &mut [&mut g1[0], &mut g0[0]],
        )
        .unwrap();
    model
        .backward(0, f0.saved.unwrap(), dh.as_ref(), 1.0, &mut [&mut g0[0]])
        .unwrap();
    for (a, b) in grads.iter().flatten().zip(whole.iter().flatten()) {
        assert!(
            (a - b).abs() <= 1e-6 * b.abs().max(1.0),
            "{grads:?} vs {whole:?}"
        );
    }
}

fn refused<B: 'static>(r: Result<VarUnits<B>, ModelError>) -> String {
    match r {
        Ok(_) => panic!("expected the unit to be refused"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_unit_without_parameters_or_with_a_taken_name_is_refused() {
    let none =
        VarUnits::new(counts).unit("relu", |_vb| Ok(()), |_, x, _: &Points| x.unwrap().relu());
    let e = refused(none);
    assert!(
        e.contains("unit relu") && e.contains("created no parameters"),
        "{e}"
    );

    let first = VarUnits::new(counts)
        .unit(
            "a",
            |vb| linear(4, 4, vb.pp("fc")),
            |l, _, b: &Points| l.forward(&x_of(b)?),
        )
        .unwrap();
    let twice = first.unit(
        "b",
        |vb| linear(4, 4, vb.pp("fc")),
        |l, x, _| l.forward(x.unwrap()),
    );
    let e = refused(twice);
    assert!(
        e.contains("unit b: parameter fc.weight was already created by unit a")
            && e.contains("vb.pp"),
        "{e}"
    );

    let reshaped = VarUnits::new(counts).unit(
        "c",
        |vb: VarBuilder| Ok((vb.get((4, 4), "w")?, vb.get(4, "w")?)),
        |(w, _), _, b: &Points| x_of(b)?.matmul(w),
    );
    let e = refused(reshaped);
    assert!(
        e.contains("unit c: parameter w is asked for with shape [4]"),
        "{e}"
    );

    let ahead = VarUnits::new(counts).unit_using(
        "d",
        &[0],
        |vb| linear(4, 4, vb.pp("d")),
        |l, _, b: &Points| l.forward(&x_of(b)?),
    );
    assert!(refused(ahead).contains("not an earlier unit"));
}

/// A unit that normalises with candle-nn's `LayerNorm` module (its fused op has no backward).
fn normed(fused: bool, allow: bool) -> Candle<VarUnits<Points>> {
    let units = VarUnits::new(counts)
        .unit(
            "block",
            |vb| {
                let fc = linear(4, 4, vb.pp("fc"))?;
                let ln = candle_nn::layer_norm(4, 1e-5, vb.pp("ln"))?;
                Ok((fc, ln))
            },
            move |(fc, ln), _, b: &Points| {
                let h = fc.forward(&x_of(b)?)?;
                let y = match fused {
                    true => ln.forward(&h)?,
                    false => {
                        let (w, beta) = (ln.weight(), ln.bias().unwrap());
                        candle_nn::ops::layer_norm_slow(&h, w, beta, 1e-5)?
                    }
                };
                mse(&candle_nn::ops::softmax(&y, D::Minus1)?, b)
            },
        )
        .unwrap();
    Candle::new(if allow {
        units.allow_unused_params()
    } else {
        units
    })
}

fn step(model: &Candle<VarUnits<Points>>) -> Result<Vec<f32>, ModelError> {
    let n = model.spec().units[0].numel();
    let params = vec![0.5; n];
    let batch = points(6);
    let f = model.forward(0, &[&params], None, &batch, ForwardMode::Train)?;
    let mut grad = vec![0.0; n];
    model.backward(0, f.saved.unwrap(), None, 1.0, &mut [&mut grad])?;
    Ok(grad)
}

#[test]
fn a_fused_op_without_backward_is_named_instead_of_training_nothing() {
    let e = step(&normed(true, false)).unwrap_err().to_string();
    assert!(
        e.contains("unit block: parameter fc.weight got no gradient")
            && e.contains("layer_norm_slow"),
        "{e}"
    );
    // Allowed on purpose: the cut-off parameters get zero gradients (here all of them, since the
    // fused op cut the loss off every parameter), as the explicit way gives them.
    let g = step(&normed(true, true)).unwrap();
    assert!(g.iter().all(|&x| x == 0.0), "{g:?}");
    // The composite op has a backward: every parameter gets its gradient.
    let g = step(&normed(false, false)).unwrap();
    assert!(g[..16].iter().any(|&x| x != 0.0), "{g:?}");
}

#[test]
fn an_input_cut_off_by_a_fused_op_is_named() {
    // The head's weights get their gradients, but the fused softmax cuts its input off: the
    // first unit would never learn.
    let model = Candle::new(
        VarUnits::new(counts)
            .unit(
                "body",
                |vb| linear(4, 4, vb.pp("body")),
                |l, _, b: &Points| l.forward(&x_of(b)?),
            )
            .unwrap()
            .unit(
                "head",
                |vb| linear(4, 4, vb.pp("head")),
                |l, x, b| {
                    mse(
                        &l.forward(&candle_nn::ops::softmax_last_dim(x.unwrap())?)?,
                        b,
                    )
                },
            )
            .unwrap(),
    );
    let spec = model.spec().clone();
    let params: Vec<Vec<f32>> = spec.units.iter().map(|u| vec![0.3; u.numel()]).collect();
    let batch = points(5);
    let f0 = model
        .forward(0, &[&params[0]], None, &batch, ForwardMode::Train)
        .unwrap();
    let f1 = model
        .forward(
            1,
            &[&params[1]],
            f0.output.as_ref(),
            &batch,
            ForwardMode::Train,
        )
        .unwrap();
    let mut grad = vec![0.0; params[1].len()];
    let e = model
        .backward(1, f1.saved.unwrap(), None, 1.0, &mut [&mut grad])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unit head: the unit's input got no gradient") && e.contains("softmax_last_dim"),
        "{e}"
    );
}
