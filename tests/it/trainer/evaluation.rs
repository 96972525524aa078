//! Held-out evaluation (issue 44): the loss after training equals `transformers`' on the same
//! windows, is the same number at every world size and stage, and `--eval-split` never trains on
//! a held-out document.

use crate::model::hf_fixture::*;
use serde_json::Value;
use std::ops::Range;
use std::path::{Path, PathBuf};
use zerodp::data::token_data::TokenCorpus;
use zerodp::data::{split_documents, Corpus, DataLoader, EvalWindows, TokenBatch, TokenSource};
use zerodp::model::hf::{self, LlamaConfig};
use zerodp::model::llama::Llama;
use zerodp::model::Candle;
use zerodp::trainer::{BatchIndex, EvalData, Evaluation, LrSchedule, Trainer};
use zerodp::zero::unit::UnitModel;
use zerodp::zero::{EvalLoss, Stage};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama-tiny")
}

/// The fixture's first batch, one window per row: what `transformers` scored after its 10 steps.
struct FirstBatch(Value);

impl EvalData<TokenBatch> for FirstBatch {
    fn len(&self) -> usize {
        self.0["batch"].as_u64().unwrap() as usize
    }
    fn batch(&self, range: Range<usize>) -> Result<TokenBatch, String> {
        Ok(batch(&self.0, 0, range.start, range.len()))
    }
}

/// The held-out losses of a run of 10 AdamW steps on the fixture's batches at `stage` on
/// `world` ranks, evaluated every `every` steps.
fn evals(stage: Stage, world: usize, every: u64) -> Vec<(u64, EvalLoss)> {
    let exp = read_json(&fixture_dir().with_file_name("llama-tiny-expected.json"));
    let config = LlamaConfig::from_hf_json(
        &read_json(&fixture_dir().join("config.json")),
        Path::new("config.json"),
    )
    .unwrap();
    let model = Candle::new(Llama::new(config).unwrap());
    let weights = hf::load_weights(&fixture_dir(), model.spec()).unwrap();
    let o = &exp["optimizer"];
    let cfg = adamw_config(&exp, stage, world);
    let source = |at: BatchIndex| -> Result<TokenBatch, String> {
        let n = at.micro_batch_size;
        Ok(batch(
            &exp,
            at.step as usize,
            (at.micro * at.world_size + at.rank) * n,
            n,
        ))
    };
    let held_out = FirstBatch(exp.clone());
    let every = Some(every);
    let outcome = Trainer::new(&model, cfg)
        .with_init(weights)
        .with_schedule(LrSchedule::Constant(o["lr"].as_f64().unwrap() as f32))
        .with_eval(Evaluation {
            data: &held_out,
            every,
        })
        .run(&source, 10, &[])
        .unwrap_or_else(|e| panic!("{stage:?} world {world}: {e}"));
    outcome.evals
}

#[test]
fn the_held_out_loss_equals_transformers_at_every_world_size_and_stage() {
    let exp = read_json(&fixture_dir().with_file_name("llama-tiny-expected.json"));
    let want = exp["loss_after_steps_on_batch_0"].as_f64().unwrap();
    let base = evals(Stage::Zero0, 1, 5);
    assert_eq!(
        base.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        [5, 10],
        "every 5 steps and after the last"
    );
    let (_, last) = base[1];
    assert_eq!(last.tokens, 4 * 16, "every target of the 4 windows");
    eprintln!("after 10 steps: zerodp {}, transformers {want}", last.loss);
    assert!(
        rel(last.loss, want) <= 1e-5,
        "zerodp {}, transformers {want}",
        last.loss
    );
    assert!(
        rel(base[0].1.loss, last.loss) > 1e-4,
        "each evaluation scores the parameters of its own step"
    );
    for (stage, world) in [
        (Stage::Zero1, 2),
        (Stage::Zero2, 4),
        (Stage::Zero3, 2),
        (Stage::Zero3, 4),
    ] {
        let got = evals(stage, world, 5);
        for ((step, a), (_, b)) in got.iter().zip(&base) {
            let d = rel(a.loss, b.loss);
            assert!(
                d <= 1e-6,
                "{stage:?} world {world} step {step}: {} vs {} ({d:.1e})",
                a.loss,
                b.loss
            );
            assert_eq!(a.tokens, b.tokens);
        }
    }
}

/// Paragraphs that each hold a word no other holds.
fn paragraphs(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("doc{i:03} {}", "lorem ipsum dolor ".repeat(1 + i % 5)))
        .collect()
}

/// The stream's tokens.
fn ids(source: &TokenSource) -> Vec<u32> {
    source.to_vec()
}

/// A byte stream's text.
fn stream_text(source: &TokenSource) -> String {
    String::from_utf8(ids(source).iter().map(|&t| t as u8).collect()).unwrap()
}

#[test]
fn eval_split_never_trains_on_a_held_out_paragraph() {
    let docs = paragraphs(40);
    let text = docs.join("\n\n");
    let source: TokenSource = Corpus::from_text("corpus", &text).into();
    let split = split_documents(source, 0.25, 7).unwrap();
    assert_eq!((split.train_documents, split.held_out_documents), (30, 10));
    let train = stream_text(&split.train);
    let held = stream_text(&split.held_out);
    assert_eq!(
        train.len() + held.len(),
        text.len(),
        "every byte on one side"
    );
    let held_docs: Vec<&String> = docs.iter().filter(|d| held.contains(d.as_str())).collect();
    assert_eq!(held_docs.len(), 10);
    for d in &held_docs {
        assert!(
            !train.contains(&d[..6]),
            "{} is held out and trained on",
            &d[..6]
        );
    }
    // Another seed holds out other paragraphs; the same seed the same ones.
    let again = split_documents(Corpus::from_text("c", &text).into(), 0.25, 7).unwrap();
    assert_eq!(stream_text(&again.held_out), held);
    let other = split_documents(Corpus::from_text("c", &text).into(), 0.25, 8).unwrap();
    assert_ne!(stream_text(&other.held_out), held);
    // The loader trains on the training part's windows only.
    let loader = DataLoader::new(split.train, 8, 1).unwrap();
    assert_eq!(loader.num_windows(), train.len() / 9);
}

#[test]
fn eval_split_of_a_token_file_cuts_at_the_eos_and_keeps_documents_whole() {
    let dir = tempfile::tempdir().unwrap();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokens");
    let tok = dir.path().join("tokenizer.json");
    std::fs::copy(fixtures.join("tokenizer.json"), &tok).unwrap();
    let lines: Vec<String> = paragraphs(30)
        .iter()
        .map(|d| serde_json::json!({ "text": d }).to_string())
        .collect();
    let data = dir.path().join("docs.jsonl");
    std::fs::write(&data, lines.join("\n")).unwrap();
    let corpus = TokenCorpus::build(&[data], &tok, None, None).unwrap();
    let (all, eos) = (corpus.to_vec(), corpus.manifest().eos_id);
    let split = split_documents(corpus.into(), 0.2, 3).unwrap();
    assert_eq!((split.train_documents, split.held_out_documents), (24, 6));
    let (train, held) = (ids(&split.train), ids(&split.held_out));
    assert_eq!(train.len() + held.len(), all.len());
    // Documents as the token file holds them: the runs between EOS ids.
    let docs = |ids: &[u32]| -> Vec<Vec<u32>> {
        ids.split(|&t| t == eos)
            .filter(|d| !d.is_empty())
            .map(<[u32]>::to_vec)
            .collect()
    };
    let (train_docs, held_docs) = (docs(&train), docs(&held));
    assert_eq!((train_docs.len(), held_docs.len()), (24, 6));
    for d in &held_docs {
        assert!(
            !train_docs.contains(d),
            "a held-out document is in the training stream"
        );
        assert!(docs(&all).contains(d), "a held-out document is whole");
    }
    let windows = EvalWindows::new(split.held_out, 4, Some(3)).unwrap();
    assert_eq!((windows.windows(), windows.tokens()), (3, 12));
    let b = windows.batch(1..3);
    assert_eq!(
        b.tokens[..4],
        held[5..9],
        "window 1 starts at token 5 of the held-out stream"
    );
    assert_eq!(b.targets[..4], held[6..10]);
}

fn zerodp(dir: &Path, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

/// The `eval_loss` of `zerodp eval`'s standard output.
fn printed_loss(stdout: &str) -> f64 {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("eval_loss "))
        .unwrap();
    line["eval_loss ".len()..].parse().unwrap()
}

#[test]
fn train_and_zerodp_eval_agree_at_every_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("train.txt"), paragraphs(60).join("\n\n")).unwrap();
    std::fs::write(
        d.join("held.txt"),
        "the held-out text is not trained on. ".repeat(30),
    )
    .unwrap();
    std::fs::write(
        d.join("s3.json"),
        r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}"#,
    )
    .unwrap();
    std::fs::write(
        d.join("e3.json"),
        r#"{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}"#,
    )
    .unwrap();
    let (ok, _, err) = zerodp(
        d,
        &[
            "train",
            "--config",
            "s3.json",
            "--world-size",
            "2",
            "--model",
            "tiny",
            "--steps",
            "4",
            "--no-progress",
            "--data",
            "train.txt",
            "--eval-data",
            "held.txt",
            "--eval-every",
            "2",
            "--eval-windows",
            "7",
            "--metrics",
            "m.jsonl",
            "--save-dir",
            "ck",
            "--plot",
            "run.svg",
        ],
    );
    assert!(ok, "{err}");
    let svg = std::fs::read_to_string(d.join("run.svg")).unwrap();
    for metric in ["loss", "eval_loss", "lr", "tokens_per_s", "peak_bytes"] {
        let series = format!("data-metric=\"{metric}\" data-x=\"step\"");
        assert!(svg.contains(&series), "--plot draws {metric}");
    }
    let lines: Vec<Value> = std::fs::read_to_string(d.join("m.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let evals: Vec<(u64, f64)> = lines
        .iter()
        .filter(|l| l["eval_loss"].is_number())
        .map(|l| {
            (
                l["step"].as_u64().unwrap(),
                l["eval_loss"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(evals.len(), 4, "steps 2 and 4 on both ranks: {evals:?}");
    assert_eq!(evals.iter().filter(|(s, _)| *s == 4).count(), 2);
    let last = evals.iter().find(|(s, _)| *s == 4).unwrap().1;
    assert!(
        evals
            .iter()
            .filter(|(s, _)| *s == 4)
            .all(|(_, l)| *l == last),
        "every rank agrees"
    );
    let latest = std::fs::read_to_string(d.join("ck/latest")).unwrap();
    let manifest = read_json(&d.join("ck").join(latest.trim()).join("manifest.json"));
    assert_eq!(manifest["eval"]["eval_loss"].as_f64().unwrap(), last);
    assert_eq!(
        manifest["eval"]["eval_tokens"].as_u64().unwrap(),
        7 * 16,
        "7 windows of the tiny GPT's 16"
    );
    // The checkpoint alone, on one rank at stage 0 and on three at stage 3.
    for extra in [&[][..], &["--world-size", "3", "--config", "e3.json"][..]] {
        let mut args = vec![
            "eval",
            "--checkpoint",
            "ck",
            "--model",
            "tiny",
            "--data",
            "held.txt",
        ];
        args.extend_from_slice(&["--eval-windows", "7"]);
        args.extend_from_slice(extra);
        let (ok, out, err) = zerodp(d, &args);
        assert!(ok, "{args:?}: {err}");
        let got = printed_loss(&out);
        assert!(
            rel(got, last) <= 1e-6,
            "{args:?}: {got} against train's {last}"
        );
        assert_eq!(
            out.lines().count(),
            2,
            "only the two numbers on stdout: {out}"
        );
    }
}

#[test]
fn evaluation_flags_without_held_out_data_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("t.txt"), paragraphs(10).join("\n\n")).unwrap();
    std::fs::write(d.join("c.json"), r#"{"train_batch_size": 2}"#).unwrap();
    let base = [
        "train", "--config", "c.json", "--model", "tiny", "--steps", "1", "--data", "t.txt",
    ];
    for (extra, want) in [
        (
            &["--eval-every", "2"][..],
            "--eval-every needs held-out data",
        ),
        (&["--eval-split", "1.5"][..], "strictly between 0 and 1"),
        (
            &["--eval-data", "missing.txt"][..],
            "--eval-data missing.txt: no such file",
        ),
        (
            &["--eval-split", "0.1", "--eval-windows", "0"][..],
            "--eval-windows 0",
        ),
    ] {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        let (ok, _, err) = zerodp(d, &args);
        assert!(!ok && err.contains(want), "{extra:?}: {err}");
    }
}
