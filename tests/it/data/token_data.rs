//! Tokenized data: the token file against Hugging Face `tokenizers`' own ids (fixtures made by
//! `scripts/make_token_fixtures.py`), the cache's reuse and rebuilds, the input errors, and the
//! data order over a token file at several world sizes.

use std::path::{Path, PathBuf};

use zerodp::data::token_data::{CacheStatus, TextTokenizer, TokenCorpus, TokenDataOptions};
use zerodp::data::{DataError, DataLoader};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tokens");

fn expected() -> serde_json::Value {
    let text = std::fs::read_to_string(Path::new(FIXTURES).join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Copies fixture `name` into `dir` (as `as_name`), so that the cache lands in the temporary.
fn copy(dir: &Path, name: &str, as_name: &str) -> PathBuf {
    let to = dir.join(as_name);
    std::fs::copy(Path::new(FIXTURES).join(name), &to).unwrap();
    to
}

fn options() -> TokenDataOptions {
    TokenDataOptions::default()
}

fn ids_of(case: &serde_json::Value) -> Vec<u32> {
    case["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

/// The token file's raw bytes, read back as little-endian u32.
fn file_ids(corpus: &TokenCorpus) -> Vec<u32> {
    std::fs::read(corpus.token_file())
        .unwrap()
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn the_token_file_equals_python_tokenizers_output() {
    let want = expected();
    // GPT-2 style: a text file then a JSONL file, EOS `<|endoftext|>` found by name.
    let dir = tempfile::tempdir().unwrap();
    let case = &want["gpt2_text_and_jsonl"];
    let tok = copy(dir.path(), "tokenizer.json", "tokenizer.json");
    let files = vec![
        copy(dir.path(), "a.txt", "a.txt"),
        copy(dir.path(), "b.jsonl", "b.jsonl"),
    ];
    let corpus = TokenCorpus::build(&files, &tok, None, None).unwrap();
    assert_eq!(corpus.to_vec(), ids_of(case));
    assert_eq!(file_ids(&corpus), ids_of(case));
    assert_eq!(corpus.manifest().eos_token, "<|endoftext|>");
    assert_eq!(
        corpus.vocab_size() as u64,
        want["vocab"]["tokenizer.json"].as_u64().unwrap()
    );
    assert_eq!(
        corpus.manifest().documents,
        4,
        "a.txt and b.jsonl's 3 non-empty texts"
    );

    // Llama style: `<s>` before each document, EOS `</s>` from tokenizer_config.json, a named
    // field, JSONL first.
    let dir = tempfile::tempdir().unwrap();
    let case = &want["bos_named_field"];
    let tok = copy(dir.path(), "tokenizer_bos.json", "tokenizer.json");
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"eos_token": {"content": "</s>", "special": true}}"#,
    )
    .unwrap();
    let files = vec![
        copy(dir.path(), "c.jsonl", "c.jsonl"),
        copy(dir.path(), "a.txt", "a.txt"),
    ];
    let corpus = TokenCorpus::build(&files, &tok, Some("body"), None).unwrap();
    assert_eq!(corpus.manifest().eos_token, "</s>");
    assert_eq!(corpus.to_vec(), ids_of(case));

    // Llama 3 style: a regex split with look-ahead and Unicode classes (fancy-regex here,
    // Oniguruma in Python), `<|begin_of_text|>` first, EOS `<|end_of_text|>` found by name.
    let dir = tempfile::tempdir().unwrap();
    let case = &want["regex_split"];
    let tok = copy(dir.path(), "tokenizer_regex.json", "tokenizer.json");
    let files = vec![
        copy(dir.path(), "a.txt", "a.txt"),
        copy(dir.path(), "b.jsonl", "b.jsonl"),
    ];
    let corpus = TokenCorpus::build(&files, &tok, None, None).unwrap();
    assert_eq!(corpus.manifest().eos_token, "<|end_of_text|>");
    assert_eq!(corpus.to_vec(), ids_of(case));
    assert_eq!(corpus.vocab_size(), 300);
}

#[test]
fn the_cache_is_reused_and_rebuilt_when_an_input_changes() {
    let dir = tempfile::tempdir().unwrap();
    let tok_path = copy(dir.path(), "tokenizer.json", "tokenizer.json");
    let data = copy(dir.path(), "a.txt", "a.txt");
    let files = vec![data.clone()];
    let build = || TokenCorpus::build(&files, &tok_path, None, None).unwrap();

    let first = build();
    assert!(matches!(first.status(), CacheStatus::Built(_)));
    assert!(first
        .token_file()
        .starts_with(dir.path().join(".zerodp-tokens")));
    let ids = first.to_vec();
    let second = build();
    assert_eq!(second.status(), &CacheStatus::Reused);
    assert_eq!(second.to_vec(), ids);

    // The data file changes: rebuilt, with the file named.
    std::fs::write(&data, "Other text, other tokens.\n").unwrap();
    let changed = build();
    let CacheStatus::Built(reason) = changed.status() else {
        panic!("a changed file must rebuild the token file")
    };
    assert!(reason.contains("a.txt"), "{reason}");
    assert_ne!(changed.to_vec(), ids);
    assert_eq!(build().status(), &CacheStatus::Reused);

    // The tokenizer changes (another file at the same path): rebuilt.
    copy(dir.path(), "tokenizer_bos.json", "tokenizer.json");
    let retok = build();
    let CacheStatus::Built(reason) = retok.status() else {
        panic!("a changed tokenizer must rebuild the token file")
    };
    assert!(reason.contains("tokenizer changed"), "{reason}");
    let bos = TextTokenizer::from_file(&tok_path, None).unwrap();
    assert_eq!(
        retok.to_vec()[0],
        bos.encode("x").unwrap()[0],
        "starts with <s>"
    );
    assert_eq!(build().status(), &CacheStatus::Reused);

    // A token file cut short (a disk that filled up) is rebuilt, not read.
    let len = std::fs::metadata(retok.token_file()).unwrap().len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(retok.token_file())
        .unwrap();
    f.set_len(len - 4).unwrap();
    assert!(matches!(build().status(), CacheStatus::Built(_)));
}

#[test]
fn an_explicit_cache_dir_and_a_directory_of_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(data.join("sub")).unwrap();
    copy(&data, "a.txt", "a.txt");
    copy(&data.join("sub"), "b.jsonl", "b.jsonl");
    std::fs::write(data.join("notes.bin"), [0xffu8, 0xfe]).unwrap();
    std::os::unix::fs::symlink(&data, data.join("sub/loop")).unwrap();
    let tok = TextTokenizer::from_file(&Path::new(FIXTURES).join("tokenizer.json"), None).unwrap();
    let cache = dir.path().join("cache");
    let options = TokenDataOptions {
        cache_dir: Some(cache.clone()),
        ..options()
    };
    let corpus = TokenCorpus::build_with(&[data], &tok, &options).unwrap();
    assert!(corpus.token_file().starts_with(&cache));
    assert_eq!(
        corpus.to_vec(),
        ids_of(&expected()["gpt2_text_and_jsonl"]),
        "a.txt then sub/b.jsonl, the .bin and the link back up skipped"
    );
}

/// The error `TokenCorpus::build` gives for one file holding `bytes`.
fn error_for(name: &str, bytes: &[u8], field: Option<&str>) -> DataError {
    let dir = tempfile::tempdir().unwrap();
    let tok = copy(dir.path(), "tokenizer.json", "tokenizer.json");
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    TokenCorpus::build(&[path], &tok, field, None).unwrap_err()
}

#[test]
fn bad_inputs_name_the_file_and_the_line() {
    let cases: [(&str, &[u8], &str); 7] = [
        (
            "a.jsonl",
            b"{\"text\": \"ok\"}\n\n{\"body\": \"x\"}\n",
            "line 3: no \"text\" field (the object has: body)",
        ),
        (
            "b.jsonl",
            b"{\"text\": \"ok\"}\n{\"text\": 5}\n",
            "line 2: field \"text\" is a number, not a string",
        ),
        (
            "c.jsonl",
            b"{\"text\": \"ok\"}\n{\"text\": \"cut\n",
            "line 2: not JSON",
        ),
        ("d.jsonl", b"[\"text\"]\n", "line 1: expected a JSON object"),
        (
            "e.txt",
            b"fine\ncaf\xe9\n",
            "line 2: not valid UTF-8 (first bad byte at file offset 8)",
        ),
        (
            "f.jsonl",
            b"{\"text\": \"ok\"}\n{\"text\": \"caf\xe9\"}\n",
            "line 2: not valid UTF-8 (first bad byte at file offset 28)",
        ),
        ("g.txt", b"", "line 1: the file is empty"),
    ];
    for (name, bytes, want) in cases {
        let err = error_for(name, bytes, None).to_string();
        assert!(err.contains(name) && err.contains(want), "{name}: {err}");
    }
    let err = error_for("j.jsonl", b"{\"text\": 1,,}\n", None).to_string();
    assert!(
        err.contains("j.jsonl: line 1: not JSON: ")
            && err.contains("(column ")
            && !err.contains(" at line "),
        "the column inside the line, not serde's line count: {err}"
    );
    let err = error_for("h.jsonl", b"\n  \n", None);
    assert!(matches!(err, DataError::EmptyFile { .. }), "{err}");
    let err = error_for("i.jsonl", b"{\"text\": \"ok\"}\n", Some("body")).to_string();
    assert!(err.contains("i.jsonl: line 1: no \"body\" field"), "{err}");
}

#[test]
fn bad_tokenizers_and_missing_inputs_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let tok = copy(dir.path(), "tokenizer.json", "tokenizer.json");
    let err = TokenCorpus::build(&[], &tok, None, None).unwrap_err();
    assert!(matches!(err, DataError::NoInputs(_)), "{err}");
    let empty_dir = dir.path().join("empty");
    std::fs::create_dir(&empty_dir).unwrap();
    let err = TokenCorpus::build(&[empty_dir], &tok, None, None).unwrap_err();
    assert!(err.to_string().contains("holds no"), "{err}");
    let missing = dir.path().join("missing.txt");
    let err = TokenCorpus::build(&[missing], &tok, None, None).unwrap_err();
    assert!(err.to_string().contains("missing.txt"), "{err}");

    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{\"model\": 1}").unwrap();
    let err = TextTokenizer::from_file(&bad, None).unwrap_err();
    assert!(matches!(err, DataError::Tokenizer { .. }), "{err}");
    assert!(err.to_string().contains("bad.json"), "{err}");
    let err = TextTokenizer::from_file(&tok, Some("<nope>")).unwrap_err();
    assert!(err.to_string().contains("<nope>"), "{err}");
}

#[test]
fn a_model_smaller_than_the_vocabulary_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let tok = copy(dir.path(), "tokenizer.json", "tokenizer.json");
    let corpus =
        TokenCorpus::build(&[copy(dir.path(), "a.txt", "a.txt")], &tok, None, None).unwrap();
    let vocab = corpus.vocab_size();
    assert!(vocab > 256);
    let err = corpus.check_vocab(256).unwrap_err();
    assert!(matches!(err, DataError::VocabTooSmall { .. }), "{err}");
    corpus.check_vocab(vocab).unwrap();
}

#[test]
fn the_data_order_over_a_token_file_is_the_same_at_every_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let tok = copy(dir.path(), "tokenizer.json", "tokenizer.json");
    let files = vec![
        copy(dir.path(), "a.txt", "a.txt"),
        copy(dir.path(), "b.jsonl", "b.jsonl"),
    ];
    let (context, seed, global) = (7, 11, 8);
    let loader = |files: &[PathBuf]| {
        let corpus = TokenCorpus::build(files, &tok, None, None).unwrap();
        DataLoader::new(corpus, context, seed).unwrap()
    };
    let one = loader(&files);
    let stream = match one.source() {
        zerodp::data::TokenSource::Ids(c) => c.to_vec(),
        other => panic!("expected a token corpus, got {other:?}"),
    };
    assert_eq!(one.num_windows(), stream.len() / (context + 1));
    let again = loader(&files); // the reused cache
    for step in 0..6 {
        let reference = one.micro_batch(step, global, 1, 0, global, 0).unwrap();
        assert_eq!(
            reference,
            again.micro_batch(step, global, 1, 0, global, 0).unwrap()
        );
        for row in 0..global {
            let w = one.window_of_sample(step * global as u64 + row as u64);
            let window = &stream[w * (context + 1)..(w + 1) * (context + 1)];
            assert_eq!(
                &reference.tokens[row * context..(row + 1) * context],
                &window[..context]
            );
            assert_eq!(
                &reference.targets[row * context..(row + 1) * context],
                &window[1..]
            );
        }
        for world in [1usize, 2, 4] {
            let per_rank = global / world;
            for micro in [1, per_rank] {
                let mut tokens = Vec::new();
                for rank in 0..world {
                    for m in 0..per_rank / micro {
                        let b = one
                            .micro_batch(step, global, world, rank, micro, m)
                            .unwrap();
                        tokens.extend(b.tokens);
                    }
                }
                assert_eq!(
                    tokens, reference.tokens,
                    "step {step} world {world} micro {micro}"
                );
            }
        }
    }
}

#[test]
fn a_long_document_cut_into_pieces_keeps_python_s_ids() {
    let want = expected();
    let text = std::fs::read_to_string(Path::new(FIXTURES).join("d.txt")).unwrap();
    for (name, ids) in want["pieces"].as_object().unwrap() {
        let dir = tempfile::tempdir().unwrap();
        let tok =
            TextTokenizer::from_file(&copy(dir.path(), name, "tokenizer.json"), None).unwrap();
        let cuts = tok.safe_cuts(&text, 64);
        // Llama 2's layout prepends `▁` to every text: no cut keeps its ids.
        assert_eq!(
            cuts.is_empty(),
            name == "tokenizer_sp.json",
            "{name}: {cuts:?}"
        );
        let options = TokenDataOptions {
            piece_bytes: 64,
            ..options()
        };
        let files = [copy(dir.path(), "d.txt", "d.txt")];
        let corpus = TokenCorpus::build_with(&files, &tok, &options).unwrap();
        assert_eq!(
            corpus.to_vec(),
            ids_of(&serde_json::json!({ "ids": ids })),
            "{name}"
        );
    }
}

#[test]
fn builders_started_together_build_once() {
    let dir = tempfile::tempdir().unwrap();
    let tok = copy(dir.path(), "tokenizer.json", "tokenizer.json");
    let files = vec![copy(dir.path(), "d.txt", "d.txt")];
    let statuses: Vec<CacheStatus> = std::thread::scope(|s| {
        let builders: Vec<_> = (0..4)
            .map(|_| s.spawn(|| TokenCorpus::build(&files, &tok, None, None).unwrap()))
            .collect();
        builders
            .into_iter()
            .map(|b| b.join().unwrap().status().clone())
            .collect()
    });
    let built = statuses
        .iter()
        .filter(|s| matches!(s, CacheStatus::Built(_)))
        .count();
    assert_eq!(built, 1, "{statuses:?}");
}

/// The families' tokenizer layouts (issue 43), from `scripts/make_token_fixtures.py families`:
/// Qwen2's (NFC, its regex split with single digits, byte-level), Mistral's (the Metaspace
/// pre-tokenizer prepending `▁` to the first piece, a BPE with byte fallback, `<s>` first) and
/// Gemma's (spaces to `▁` in the normaliser, nothing prepended, byte fallback): the token stream
/// of a text and a JSONL file, and a long document cut into pieces, equal Python's ids.
#[test]
fn the_families_tokenizer_layouts_equal_python_tokenizers() {
    let text = std::fs::read_to_string(Path::new(FIXTURES).join("expected_families.json")).unwrap();
    let want: serde_json::Value = serde_json::from_str(&text).unwrap();
    let as_ids = |v: &serde_json::Value| ids_of(&serde_json::json!({ "ids": v }));
    for (name, case) in want.as_object().unwrap() {
        let dir = tempfile::tempdir().unwrap();
        let tok = copy(dir.path(), name, "tokenizer.json");
        let files = vec![
            copy(dir.path(), "a.txt", "a.txt"),
            copy(dir.path(), "b.jsonl", "b.jsonl"),
        ];
        let eos = case["eos"].as_str().unwrap();
        let tokenizer = TextTokenizer::from_file(&tok, Some(eos)).unwrap();
        let corpus = TokenCorpus::build_with(&files, &tokenizer, &options()).unwrap();
        assert_eq!(corpus.to_vec(), as_ids(&case["stream"]), "{name}");
        assert_eq!(corpus.vocab_size() as u64, case["vocab"].as_u64().unwrap());
        let options = TokenDataOptions {
            piece_bytes: 64,
            ..options()
        };
        let files = [copy(dir.path(), "d.txt", "d.txt")];
        let corpus = TokenCorpus::build_with(&files, &tokenizer, &options).unwrap();
        assert_eq!(corpus.to_vec(), as_ids(&case["pieces"]), "{name}: pieces");
    }
}
