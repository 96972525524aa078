//! Generation (issue 44): greedy decoding over the KV cache writes `transformers`'
//! `generate(do_sample=False)` tokens for every family (fixtures made by
//! scripts/make_generate_fixtures.py), the cache gives the logits of a full forward, and seeded
//! sampling repeats.

use super::hf_fixture::*;
use std::path::{Path, PathBuf};
use zerodp::model::generate::{GenerateOptions, KvCache, Sampling, UnitTensors};
use zerodp::model::hf::{self, HfConfig};
use zerodp::model::train_model::{build_model, HfModel, TrainModel};
use zerodp::zero::unit::UnitModel;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf")
}

fn load(name: &str) -> (TrainModel, UnitTensors) {
    load_dir(&fixtures().join(name))
}

fn load_dir(dir: &Path) -> (TrainModel, UnitTensors) {
    let dir = dir.to_path_buf();
    let config = HfConfig::read(&dir.join("config.json")).unwrap();
    let hf_model = HfModel {
        config,
        dir: Some(dir.clone()),
    };
    let cpu = (candle_core::Device::Cpu, candle_core::DType::F32);
    let model = build_model(&hf_model.config.gpt, Some(&hf_model), cpu.clone()).unwrap();
    let weights = hf::load_weights(&dir, model.spec()).unwrap();
    let w = UnitTensors::new(model.spec(), &weights, (&cpu.0, cpu.1)).unwrap();
    (model, w)
}

#[test]
fn greedy_generation_equals_transformers_for_every_family() {
    let exp = read_json(&fixtures().join("generate-expected.json"));
    let models = exp["models"].as_object().unwrap();
    assert_eq!(models.len(), 8);
    for (name, case) in models {
        let (model, w) = load(name);
        let prompt: Vec<u32> = case["prompt"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let want: Vec<u32> = case["greedy"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let options = GenerateOptions {
            max_new_tokens: want.len(),
            ..Default::default()
        };
        let got = model.generate(&w, &prompt, &options, |_| true).unwrap();
        assert_eq!(got.tokens, want, "{name}: zerodp against transformers");
    }
}

#[test]
fn the_cache_gives_the_logits_of_one_pass_over_the_whole_sequence() {
    for name in ["gpt2-tiny", "mistral-tiny", "qwen3-tiny"] {
        let (model, w) = load(name);
        let tokens: Vec<u32> = (0..20).map(|i| (i * 37 + 5) % 300).collect();
        let whole = model
            .decode_step(&w, &tokens, &mut KvCache::new(8))
            .unwrap();
        let mut cache = KvCache::new(8);
        model.decode_step(&w, &tokens[..7], &mut cache).unwrap();
        let mut last = Vec::new();
        for &t in &tokens[7..] {
            last = model.decode_step(&w, &[t], &mut cache).unwrap();
        }
        let worst = whole
            .iter()
            .zip(&last)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst <= 1e-5, "{name}: {worst}");
        assert_eq!(cache.len(), 20);
    }
}

#[test]
fn seeded_sampling_repeats_and_another_seed_differs() {
    let (model, w) = load("llama-tiny");
    let run = |seed: u64| {
        let options = GenerateOptions {
            max_new_tokens: 20,
            sampling: Sampling {
                temperature: 1.5,
                top_k: Some(50),
                top_p: Some(0.95),
                seed,
            },
            stop: vec![],
        };
        model
            .generate(&w, &[3, 4, 5], &options, |_| true)
            .unwrap()
            .tokens
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8));
    // A stop token ends the text without being part of it.
    let first = run(7)[0];
    let options = GenerateOptions {
        max_new_tokens: 20,
        sampling: Sampling {
            temperature: 1.5,
            top_k: Some(50),
            top_p: Some(0.95),
            seed: 7,
        },
        stop: vec![first],
    };
    let g = model.generate(&w, &[3, 4, 5], &options, |_| true).unwrap();
    assert!(g.tokens.is_empty());
    // A prompt as long as the positions is refused.
    assert!(model.generate(&w, &[1; 32], &options, |_| true).is_err());
}

#[test]
fn zerodp_generate_streams_the_greedy_text_and_nothing_else_to_stdout() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("qwen2");
    std::fs::create_dir(&d).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures().join("qwen2-tiny").join(f), d.join(f)).unwrap();
    }
    let tokens = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokens");
    std::fs::copy(
        tokens.join("tokenizer_qwen2.json"),
        d.join("tokenizer.json"),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["generate", "--model-dir"])
        .arg(&d)
        .args(["--prompt", "hello world", "--max-new-tokens", "12"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("tokens/s"),
        "statistics on stderr: {stderr}"
    );
    // The same greedy continuation through the library, decoded.
    let tokenizer =
        zerodp::data::TextTokenizer::from_file(&d.join("tokenizer.json"), None).unwrap();
    let (model, w) = load("qwen2-tiny");
    let prompt = tokenizer.encode("hello world").unwrap();
    let options = GenerateOptions {
        max_new_tokens: 12,
        stop: vec![tokenizer.eos_id()],
        ..Default::default()
    };
    let g = model.generate(&w, &prompt, &options, |_| true).unwrap();
    let want = tokenizer.decode(&g.tokens).unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{want}\n"));
    // Bad sampling flags are refused.
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["generate", "--model-dir"])
        .arg(&d)
        .args(["--prompt", "x", "--top-p", "1.5"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--top-p"));
}

#[test]
fn zerodp_generate_answers_each_conversation_through_the_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("qwen2");
    std::fs::create_dir(&d).unwrap();
    std::fs::copy(
        fixtures().join("qwen2-tiny/model.safetensors"),
        d.join("model.safetensors"),
    )
    .unwrap();
    let mut config = read_json(&fixtures().join("qwen2-tiny/config.json"));
    config["max_position_embeddings"] = 256.into(); // room for the template's system turn
    std::fs::write(d.join("config.json"), config.to_string()).unwrap();
    let chatml = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat/chatml");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        std::fs::copy(chatml.join(f), d.join(f)).unwrap();
    }
    let convs = ["hi", "what is 2 + 2?"];
    let lines: Vec<String> = convs
        .iter()
        .map(|c| serde_json::json!({"messages": [{"role": "user", "content": c}]}).to_string())
        .collect();
    std::fs::write(d.join("chat.jsonl"), lines.join("\n")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["generate", "--model-dir"])
        .arg(&d)
        .arg("--chat")
        .arg(d.join("chat.jsonl"))
        .args(["--max-new-tokens", "5"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The same through the library: rendered with a generation prompt, greedy, decoded.
    let tokenizer =
        zerodp::data::TextTokenizer::from_file(&d.join("tokenizer.json"), None).unwrap();
    let template = zerodp::data::chat::ChatTemplate::from_tokenizer_dir(&d).unwrap();
    let (model, w) = load_dir(&d);
    let stop: Vec<u32> = ["<|endoftext|>", "<|im_end|>"]
        .iter()
        .filter_map(|t| tokenizer.token_id(t))
        .collect();
    let answers: Vec<String> = convs
        .iter()
        .map(|c| {
            let messages = [zerodp::data::chat::Message::new("user", *c)];
            let text = template.render(&messages, true).unwrap().text;
            assert!(
                text.ends_with("<|im_start|>assistant\n"),
                "a generation prompt: {text:?}"
            );
            let (prompt, _) = tokenizer.encode_with_offsets(&text, false).unwrap();
            let options = GenerateOptions {
                max_new_tokens: 5,
                stop: stop.clone(),
                ..Default::default()
            };
            let g = model.generate(&w, &prompt, &options, |_| true).unwrap();
            tokenizer.decode(&g.tokens).unwrap()
        })
        .collect();
    let want = format!("{}\n\n{}\n", answers[0], answers[1]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), want);
}
