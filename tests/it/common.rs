//! Test support for the engine tests: a small pure-Rust [`UnitModel`] (embedding, tanh layers, a
//! head tied to the embedding or with its own output matrix, softmax cross-entropy) and a harness
//! that trains it on every rank of an in-process world.
#![allow(dead_code)]

use std::sync::Arc;
use zerodp::data::TokenBatch as Batch;
use zerodp::trainer::{BatchIndex, LrSchedule, ReportLog, Trainer};
use zerodp::zero::unit::{
    BatchCounts, ForwardMode, ModelError, ModelSpec, ParamSpec, UnitForward, UnitModel, UnitSpec,
};
use zerodp::zero::{EngineConfig, Stage, StepReport};

/// Embedding (unit 0), `layers` tanh layers, head (gain `s`, logits `(x*s) E^T`, tied to unit 0's
/// table when `tied`, else its own `[vocab, dim]` matrix).
pub struct Toy {
    spec: ModelSpec,
    pub vocab: usize,
    pub dim: usize,
    pub layers: usize,
    pub tied: bool,
}

/// Activations: `[tokens, dim]` row-major.
pub type Act = Arc<Vec<f32>>;

/// What backward needs, weights included: the contract passes parameters only to forward.
pub enum Saved {
    Embed {
        tokens: Vec<u32>,
    },
    Layer {
        x: Act,
        y: Vec<f32>,
        w: Vec<f32>,
    },
    Head {
        x: Act,
        probs: Vec<f32>,
        targets: Vec<u32>,
        s: Vec<f32>,
        e: Vec<f32>,
    },
}

impl Toy {
    pub fn new(vocab: usize, dim: usize, layers: usize, tied: bool) -> Self {
        let mut units = vec![UnitSpec {
            name: "embed".into(),
            params: vec![ParamSpec {
                name: "wte".into(),
                shape: vec![vocab, dim],
            }],
            uses: vec![],
        }];
        for i in 0..layers {
            units.push(UnitSpec {
                name: format!("layer{i}"),
                params: vec![
                    ParamSpec {
                        name: format!("l{i}.w"),
                        shape: vec![dim, dim],
                    },
                    ParamSpec {
                        name: format!("l{i}.b"),
                        shape: vec![dim],
                    },
                ],
                uses: vec![],
            });
        }
        let mut head = vec![ParamSpec {
            name: "head.s".into(),
            shape: vec![dim],
        }];
        if !tied {
            head.push(ParamSpec {
                name: "head.w".into(),
                shape: vec![vocab, dim],
            });
        }
        units.push(UnitSpec {
            name: "head".into(),
            params: head,
            uses: if tied { vec![0] } else { vec![] },
        });
        Toy {
            spec: ModelSpec { units },
            vocab,
            dim,
            layers,
            tied,
        }
    }
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn uniform(state: &mut u64) -> f32 {
    (splitmix(state) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
}

impl UnitModel for Toy {
    type Batch = Batch;
    type Act = Act;
    type Saved = Saved;

    fn batch_counts(&self, batch: &Batch) -> BatchCounts {
        batch.counts()
    }

    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn init_params(&self, unit: usize, seed: u64, out: &mut [f32]) {
        let mut st = seed ^ (unit as u64 + 1).wrapping_mul(0x1234_5678_9ABC_DEF1);
        let d = self.dim;
        if unit == 0 {
            out.iter_mut().for_each(|x| *x = 0.5 * uniform(&mut st));
        } else if unit <= self.layers {
            let a = 1.5 / (d as f32).sqrt();
            out[..d * d]
                .iter_mut()
                .for_each(|x| *x = a * uniform(&mut st));
            out[d * d..]
                .iter_mut()
                .for_each(|x| *x = 0.1 * uniform(&mut st));
        } else {
            out[..d]
                .iter_mut()
                .for_each(|x| *x = 1.0 + 0.1 * uniform(&mut st));
            out[d..]
                .iter_mut()
                .for_each(|x| *x = 0.5 * uniform(&mut st));
        }
    }

    fn forward(
        &self,
        unit: usize,
        params: &[&[f32]],
        input: Option<&Act>,
        batch: &Batch,
        mode: ForwardMode,
    ) -> Result<UnitForward<Act, Saved>, ModelError> {
        let d = self.dim;
        let train = mode == ForwardMode::Train;
        if unit == 0 {
            let e = params[0];
            let mut h = Vec::with_capacity(batch.tokens.len() * d);
            for &t in &batch.tokens {
                h.extend_from_slice(&e[t as usize * d..(t as usize + 1) * d]);
            }
            return Ok(UnitForward {
                output: Some(Arc::new(h)),
                loss: None,
                saved: train.then(|| Saved::Embed {
                    tokens: batch.tokens.clone(),
                }),
            });
        }
        let x = input.expect("input").clone();
        let n = x.len() / d;
        if unit <= self.layers {
            let (w, b) = params[0].split_at(d * d);
            let mut y = vec![0.0f32; n * d];
            for r in 0..n {
                for j in 0..d {
                    let mut acc = b[j];
                    for i in 0..d {
                        acc += x[r * d + i] * w[i * d + j];
                    }
                    y[r * d + j] = acc.tanh();
                }
            }
            let out = Arc::new(y.clone());
            return Ok(UnitForward {
                output: Some(out),
                loss: None,
                saved: train.then(|| Saved::Layer {
                    x,
                    y,
                    w: w.to_vec(),
                }),
            });
        }
        let s = &params[0][..d];
        let e = if self.tied {
            params[1]
        } else {
            &params[0][d..]
        };
        let v = self.vocab;
        let mut probs = vec![0.0f32; n * v];
        let mut loss = 0.0f64;
        for r in 0..n {
            let row = &mut probs[r * v..(r + 1) * v];
            for (k, p) in row.iter_mut().enumerate() {
                let mut acc = 0.0;
                for i in 0..d {
                    acc += x[r * d + i] * s[i] * e[k * d + i];
                }
                *p = acc;
            }
            let mx = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let mut z = 0.0;
            for p in row.iter_mut() {
                *p = (*p - mx).exp();
                z += *p;
            }
            for p in row.iter_mut() {
                *p /= z;
            }
            loss -= f64::from(row[batch.targets[r] as usize].ln());
        }
        Ok(UnitForward {
            output: None,
            loss: Some((loss / n as f64) as f32),
            saved: train.then(|| Saved::Head {
                x,
                probs,
                targets: batch.targets.clone(),
                s: s.to_vec(),
                e: e.to_vec(),
            }),
        })
    }

    fn backward(
        &self,
        _unit: usize,
        saved: Saved,
        grad_output: Option<&Act>,
        loss_weight: f32,
        grads: &mut [&mut [f32]],
    ) -> Result<Option<Act>, ModelError> {
        let d = self.dim;
        match saved {
            Saved::Embed { tokens } => {
                let g = grad_output.expect("grad");
                for (r, &t) in tokens.iter().enumerate() {
                    let dst = &mut grads[0][t as usize * d..(t as usize + 1) * d];
                    for i in 0..d {
                        dst[i] += g[r * d + i];
                    }
                }
                Ok(None)
            }
            Saved::Layer { x, y, w } => {
                let g = grad_output.expect("grad");
                let n = y.len() / d;
                let dz: Vec<f32> = (0..n * d).map(|k| g[k] * (1.0 - y[k] * y[k])).collect();
                let mut dx = vec![0.0f32; n * d];
                let (gw, gb) = grads[0].split_at_mut(d * d);
                for r in 0..n {
                    for i in 0..d {
                        let xi = x[r * d + i];
                        let mut acc = 0.0;
                        for j in 0..d {
                            gw[i * d + j] += xi * dz[r * d + j];
                            acc += dz[r * d + j] * w[i * d + j];
                        }
                        dx[r * d + i] = acc;
                    }
                    for j in 0..d {
                        gb[j] += dz[r * d + j];
                    }
                }
                Ok(Some(Arc::new(dx)))
            }
            Saved::Head {
                x,
                probs,
                targets,
                s,
                e,
            } => {
                let v = self.vocab;
                let n = targets.len();
                let scale = loss_weight / n as f32;
                let mut dx = vec![0.0f32; n * d];
                let mut ds = vec![0.0f32; d];
                let mut de = vec![0.0f32; v * d];
                for r in 0..n {
                    let xs: Vec<f32> = (0..d).map(|i| x[r * d + i] * s[i]).collect();
                    let mut dxs = vec![0.0f32; d];
                    for k in 0..v {
                        let mut dl = probs[r * v + k];
                        if k == targets[r] as usize {
                            dl -= 1.0;
                        }
                        dl *= scale;
                        for i in 0..d {
                            de[k * d + i] += dl * xs[i];
                            dxs[i] += dl * e[k * d + i];
                        }
                    }
                    for i in 0..d {
                        ds[i] += dxs[i] * x[r * d + i];
                        dx[r * d + i] = dxs[i] * s[i];
                    }
                }
                for i in 0..d {
                    grads[0][i] += ds[i];
                }
                let de_dst: &mut [f32] = if self.tied {
                    &mut *grads[1]
                } else {
                    &mut grads[0][d..]
                };
                for (a, b) in de_dst.iter_mut().zip(&de) {
                    *a += *b;
                }
                Ok(Some(Arc::new(dx)))
            }
        }
    }
}

/// Sequence `index` of step `step`'s global batch: random tokens, targets a fixed function of the
/// token (so the loss can fall).
pub fn sequence(step: usize, index: usize, seq: usize, vocab: usize) -> (Vec<u32>, Vec<u32>) {
    let mut st = (step as u64) << 32 | index as u64;
    let tokens: Vec<u32> = (0..seq)
        .map(|_| (splitmix(&mut st) % vocab as u64) as u32)
        .collect();
    let targets = tokens.iter().map(|&t| (t * 7 + 3) % vocab as u32).collect();
    (tokens, targets)
}

/// Rank `rank`'s micro-batches of step `step`: the global batch of `global` sequences split into
/// `world * ga` equal micro-batches, whatever the split the same sequences overall.
pub fn rank_batches(
    step: usize,
    rank: usize,
    world: usize,
    ga: usize,
    global: usize,
    seq: usize,
    vocab: usize,
) -> Vec<Batch> {
    assert_eq!(global % (world * ga), 0, "global batch must split evenly");
    let micro = global / (world * ga);
    (0..ga)
        .map(|m| {
            let first = (m * world + rank) * micro;
            let mut tokens = Vec::new();
            let mut targets = Vec::new();
            for i in first..first + micro {
                let (t, y) = sequence(step, i, seq, vocab);
                tokens.extend(t);
                targets.extend(y);
            }
            Batch {
                tokens,
                targets,
                batch_size: micro,
                seq_len: seq,
                segment_starts: Vec::new(),
            }
        })
        .collect()
}

/// What every rank saw.
pub struct Run {
    /// `reports[rank][step]`.
    pub reports: Vec<Vec<StepReport>>,
    /// Final full parameters (rank 0's; every rank is checked to agree).
    pub params: Vec<Vec<f32>>,
}

impl Run {
    pub fn losses(&self) -> Vec<f32> {
        self.reports[0].iter().map(|r| r.loss).collect()
    }
}

/// A small engine configuration for tests: fp32, Adam with a fixed learning rate.
pub fn test_config(stage: Stage, world: usize, ga: usize, global: usize) -> EngineConfig {
    let mut cfg = EngineConfig::new(stage, world);
    cfg.grad_accum = ga;
    cfg.micro_batch = global / (world * ga);
    cfg.seed = 7;
    cfg.adam.weight_decay = 0.01;
    cfg
}

pub const LR: f32 = 0.01;

/// Train `model` for `steps` steps on every rank of a world of `cfg.world_size`, through the
/// library's [`Trainer`] (which checks that every rank ends with the same parameters).
pub fn train(model: &Toy, cfg: &EngineConfig, steps: usize, global: usize, seq: usize) -> Run {
    let source = |at: BatchIndex| -> Result<Batch, String> {
        let step = at.step as usize;
        let batches = rank_batches(
            step,
            at.rank,
            at.world_size,
            at.grad_accum,
            global,
            seq,
            model.vocab,
        );
        Ok(batches[at.micro].clone())
    };
    let log = ReportLog::new();
    let outcome = Trainer::new(model, cfg.clone())
        .with_schedule(LrSchedule::Constant(LR))
        .keep_params(true)
        .run(&source, steps as u64, &[&log])
        .unwrap_or_else(|e| panic!("training failed: {e}"));
    Run {
        reports: log.into_reports(),
        params: outcome.params.expect("kept parameters"),
    }
}

/// `max |a - b| / max |a|` over all parameters.
pub fn max_rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    let scale = a
        .iter()
        .flatten()
        .fold(0.0f32, |m, x| m.max(x.abs()))
        .max(1e-12);
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}
