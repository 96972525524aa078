//! What a command reads is never written, and what it trains on is what the user gave: every
//! file of a Hugging Face directory, a tokenizer and the `tokenizer_config.json` beside it, a
//! `--model-config` and the token cache are inputs of the output checks; `ckpt export` puts a
//! whole directory in place or nothing; a token cache damaged in place is rebuilt; a tokenizer
//! whose ids pass the model's vocabulary is refused before any step; refusals come before any
//! directory is made and name the right thing; `--resume` on an empty `--save-dir` starts the
//! run, so one command line serves every start of a job.
//!
//! Each case checks the exit status, the message naming the file, and that every input file is
//! byte for byte unchanged.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// The fixture tokenizer cut to the ids below `keep` (its byte alphabet and first merges), so
/// that it fits the tiny GPT-2's vocabulary of 300; `moved` gives one merged token the id 400
/// (a tokenizer of 290 tokens whose ids reach past 300).
fn tokenizer_json(keep: u64, moved: bool) -> String {
    let text = std::fs::read_to_string(fixture("tokens/tokenizer.json")).unwrap();
    let mut t: serde_json::Value = serde_json::from_str(&text).unwrap();
    let model = &mut t["model"];
    let vocab = model["vocab"].as_object_mut().unwrap();
    vocab.retain(|_, id| id.as_u64().unwrap() < keep);
    if moved {
        let key = vocab.iter().find(|(_, v)| v.as_u64() == Some(260)).unwrap();
        let key = key.0.clone();
        vocab.insert(key, 400.into());
    }
    let kept: Vec<String> = vocab.keys().cloned().collect();
    let merges = model["merges"].as_array_mut().unwrap();
    merges.retain(|m| {
        let (a, b) = (m[0].as_str().unwrap(), m[1].as_str().unwrap());
        [a.to_string(), b.to_string(), format!("{a}{b}")]
            .iter()
            .all(|p| kept.contains(p))
    });
    t.to_string()
}

struct Setup {
    dir: tempfile::TempDir,
    /// A GPT-2 directory: config, weights, tokenizer.json and tokenizer_config.json.
    model: PathBuf,
    data: PathBuf,
    config: PathBuf,
}

impl Setup {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("gpt2");
    std::fs::create_dir(&model).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("hf/gpt2-tiny").join(f), model.join(f)).unwrap();
    }
    std::fs::write(model.join("tokenizer.json"), tokenizer_json(290, false)).unwrap();
    std::fs::write(
        model.join("tokenizer_config.json"),
        r#"{"eos_token": "<|endoftext|>"}"#,
    )
    .unwrap();
    let data = dir.path().join("data.jsonl");
    let lines: String = (0..120)
        .map(|i| format!("{{\"text\": \"to be or not to be, that is question {i}.\"}}\n"))
        .collect();
    std::fs::write(&data, lines).unwrap();
    let config = dir.path().join("ds.json");
    std::fs::write(
        &config,
        r#"{ "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
             "optimizer": { "type": "AdamW", "params": { "lr": 1e-3 } },
             "zero_optimization": { "stage": 2 } }"#,
    )
    .unwrap();
    Setup {
        dir,
        model,
        data,
        config,
    }
}

/// Every file under `dir` (hidden ones and the token cache included) and its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                files.insert(p.clone(), std::fs::read(&p).unwrap());
            }
        }
    }
    files
}

fn zerodp(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(args)
        .output()
        .unwrap()
}

/// `zerodp train` on the setup's config and data, one step, with `extra`.
fn train(s: &Setup, extra: &[&std::ffi::OsStr]) -> Output {
    let mut args: Vec<&std::ffi::OsStr> = ["train", "--no-progress", "--steps", "1", "--config"]
        .iter()
        .map(|a| a.as_ref())
        .collect();
    args.push(s.config.as_os_str());
    args.push("--data".as_ref());
    args.push(s.data.as_os_str());
    args.extend_from_slice(extra);
    zerodp(&args)
}

fn os<P: AsRef<std::ffi::OsStr> + ?Sized>(p: &P) -> &std::ffi::OsStr {
    p.as_ref()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The run failed with a message holding every one of `words`.
fn refused(out: &Output, words: &[&str]) -> String {
    let err = stderr(out);
    assert!(!out.status.success(), "not refused: {err}");
    assert_eq!(out.status.code(), Some(1), "{err}");
    for w in words {
        assert!(err.contains(w), "the message should name {w:?}: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn ok(out: &Output) {
    assert!(out.status.success(), "{}", stderr(out));
}

#[test]
fn files_read_beside_the_named_ones_are_inputs() {
    let s = setup();
    let before = snapshot(s.dir.path());
    let (config, tokenizer) = (s.model.join("config.json"), s.model.join("tokenizer.json"));
    // The tokenizer_config.json read for the EOS token.
    let target = s.model.join("tokenizer_config.json");
    let out = train(
        &s,
        &[
            os("--model-config"),
            os(&config),
            os("--tokenizer"),
            os(&tokenizer),
            os("--metrics"),
            os(&target),
        ],
    );
    refused(
        &out,
        &["--metrics", "tokenizer_config.json", "beside --tokenizer"],
    );
    // --save onto the weights beside a --model-config: refused, naming ckpt export.
    let weights = s.model.join("model.safetensors");
    let out = train(
        &s,
        &[
            os("--model-config"),
            os(&config),
            os("--save"),
            os(&weights),
        ],
    );
    refused(&out, &["--save", "model.safetensors", "zerodp ckpt export"]);
    // plan's chart onto the --model-config it reads.
    let out = zerodp(&[
        os("plan"),
        os("--model-config"),
        os(&config),
        os("--devices"),
        os("2"),
        os("--chart"),
        os(&config),
    ]);
    refused(&out, &["--chart", "--model-config"]);
    // A file inside a model directory read: named as what it is, not as a checkpoint.
    let inside = s.model.join("metrics.jsonl");
    let out = train(
        &s,
        &[
            os("--model-dir"),
            os(&s.model),
            os("--metrics"),
            os(&inside),
        ],
    );
    let err = refused(&out, &["--metrics", "lies inside --model-dir"]);
    assert!(!err.contains("checkpoint"), "{err}");
    // A hard link elsewhere to the directory's weights is the same file.
    let link = s.path("weights-link.safetensors");
    std::fs::hard_link(&weights, &link).unwrap();
    let out = train(
        &s,
        &[os("--model-dir"), os(&s.model), os("--metrics"), os(&link)],
    );
    refused(&out, &["--metrics", "same file as --model-dir"]);
    std::fs::remove_file(&link).unwrap();
    // The token cache (built by a good run) is an input too.
    let cache = s.dir.path().join(".zerodp-tokens");
    ok(&train(&s, &[os("--model-dir"), os(&s.model)]));
    let before = {
        let mut b = before;
        b.extend(snapshot(&cache));
        b
    };
    let token_file = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "u32"))
        .unwrap();
    let out = train(
        &s,
        &[
            os("--model-dir"),
            os(&s.model),
            os("--metrics"),
            os(&token_file),
        ],
    );
    refused(&out, &["--metrics", "the token cache"]);
    assert_eq!(snapshot(s.dir.path()), before, "an input changed");
}

#[test]
fn flags_the_model_source_makes_meaningless_are_refused() {
    let s = setup();
    let before = snapshot(s.dir.path());
    let out = zerodp(&[
        os("plan"),
        os("--model-config"),
        os(&s.model),
        os("--devices"),
        os("2"),
        os("--width"),
        os("4096"),
        os("--heads"),
        os("8"),
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--model-config") && err.contains("--width"),
        "{err}"
    );
    // A tokenizer that overrides the directory's own, different one: said, naming both.
    let other = s.path("other-tokenizer.json");
    std::fs::write(&other, tokenizer_json(280, false)).unwrap();
    let out = train(
        &s,
        &[
            os("--model-dir"),
            os(&s.model),
            os("--tokenizer"),
            os(&other),
        ],
    );
    ok(&out);
    let err = stderr(&out);
    assert!(
        err.contains("warning: --tokenizer")
            && err.contains("other-tokenizer.json")
            && err.contains(&*s.model.join("tokenizer.json").to_string_lossy()),
        "{err}"
    );
    // The directory's own tokenizer named again is no override.
    let own = s.model.join("tokenizer.json");
    let out = train(
        &s,
        &[os("--model-dir"), os(&s.model), os("--tokenizer"), os(&own)],
    );
    ok(&out);
    assert!(!stderr(&out).contains("warning: --tokenizer"));
    for (path, bytes) in before {
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "{}", path.display());
    }
}

#[test]
fn ids_past_the_vocabulary_are_refused_before_any_step_naming_the_tokenizer() {
    let s = setup();
    // 290 tokens, one of them id 400: the count fits 300 rows, the ids do not.
    let wide = s.path("wide.json");
    std::fs::write(&wide, tokenizer_json(290, true)).unwrap();
    let config = s.model.join("config.json");
    let metrics = s.path("m.jsonl");
    let out = train(
        &s,
        &[
            os("--model-config"),
            os(&config),
            os("--tokenizer"),
            os(&wide),
            os("--metrics"),
            os(&metrics),
        ],
    );
    refused(&out, &["wide.json", "400", "vocab_size 300"]);
    assert!(!metrics.exists(), "a step ran");
    // The data's own largest id is checked too: a byte corpus for a model of 100 rows.
    let small = s.path("small.json");
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("\"vocab_size\": 300", "\"vocab_size\": 100");
    std::fs::write(&small, text).unwrap();
    let corpus = s.path("bytes.txt");
    std::fs::write(&corpus, "zzzz ".repeat(200)).unwrap();
    let mut args = vec![os("--model-config"), os(&small)];
    args.extend([os("--metrics"), os(&metrics)]);
    let out = zerodp(
        &[
            os("train"),
            os("--no-progress"),
            os("--config"),
            os(&s.config),
            os("--data"),
            os(&corpus),
        ]
        .into_iter()
        .chain(args)
        .collect::<Vec<_>>(),
    );
    refused(&out, &["bytes.txt", "token id 122", "vocabulary of 100"]);
    assert!(!metrics.exists(), "a step ran");
}

#[test]
fn a_token_cache_damaged_in_place_is_rebuilt() {
    let s = setup();
    let cache = s.path("cache");
    let run = |extra: &[&std::ffi::OsStr]| {
        let mut a = vec![
            os("--model-dir"),
            os(&s.model),
            os("--data-cache"),
            os(&cache),
        ];
        a.extend_from_slice(extra);
        train(&s, &a)
    };
    let first = run(&[]);
    ok(&first);
    assert!(stderr(&first).contains("built (no token file yet)"));
    let token_file = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "u32"))
        .unwrap();
    let good = std::fs::read(&token_file).unwrap();
    // Zeros over it, its size kept; then other ids past the vocabulary.
    let past: Vec<u8> = (0..good.len() / 4)
        .flat_map(|_| 5000u32.to_le_bytes())
        .collect();
    for damage in [vec![0u8; good.len()], past] {
        std::fs::write(&token_file, &damage).unwrap();
        let out = run(&[]);
        ok(&out);
        assert!(
            stderr(&out).contains("built (the token file was damaged"),
            "{}",
            stderr(&out)
        );
        assert_eq!(std::fs::read(&token_file).unwrap(), good);
    }
    let again = run(&[]);
    ok(&again);
    assert!(
        stderr(&again).contains("tokens: reusing"),
        "{}",
        stderr(&again)
    );
}

#[test]
fn refusals_come_before_any_work_and_name_the_right_thing() {
    let s = setup();
    let save = s.path("ckpt");
    let cache = s.dir.path().join(".zerodp-tokens");
    // A missing tokenizer is a tokenizer, not a corpus.
    let out = train(&s, &[os("--tokenizer"), os(&s.path("missing.json"))]);
    let err = refused(&out, &["tokenizer", "missing.json"]);
    assert!(!err.contains("corpus"), "{err}");
    // A broken weights file: found from its header before the data is tokenized.
    let broken = s.path("broken");
    std::fs::create_dir(&broken).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(s.model.join(f), broken.join(f)).unwrap();
    }
    let bytes = std::fs::read(s.model.join("model.safetensors")).unwrap();
    std::fs::write(broken.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let out = train(
        &s,
        &[os("--model-dir"), os(&broken), os("--save-dir"), os(&save)],
    );
    refused(&out, &["model.safetensors", "not a valid safetensors file"]);
    assert!(!cache.exists(), "the data was tokenized before the refusal");
    assert!(!save.exists(), "--save-dir was created before the refusal");
    // A tensor of the wrong shape, in a whole file: named from the header too.
    let fixture_llama = fixture("hf/llama-tiny/model.safetensors");
    std::fs::copy(&fixture_llama, broken.join("model.safetensors")).unwrap();
    let out = train(&s, &[os("--model-dir"), os(&broken)]);
    refused(&out, &["tensors"]);
    assert!(!cache.exists(), "the data was tokenized before the refusal");
    // A GPU asked of a build without one: refused before --save-dir exists.
    if !cfg!(feature = "cuda") {
        let out = train(
            &s,
            &[
                os("--model-dir"),
                os(&s.model),
                os("--device"),
                os("cuda"),
                os("--save-dir"),
                os(&save),
            ],
        );
        refused(&out, &["cuda"]);
        assert!(!save.exists(), "--save-dir was created before the refusal");
    }
    // Too little data for one window: the hint is a fix this command takes.
    let tiny = s.path("tiny.jsonl");
    std::fs::write(&tiny, "{\"text\": \"to be\"}\n").unwrap();
    let out = zerodp(&[
        os("train"),
        os("--no-progress"),
        os("--config"),
        os(&s.config),
        os("--model-dir"),
        os(&s.model),
        os("--data"),
        os(&tiny),
    ]);
    // The hint is a fix this command takes: shorter windows of the model's positions.
    refused(&out, &["one window of 32 tokens", "--context N"]);
    // Windows longer than the model's positions are refused, naming them.
    let out = zerodp(&[
        os("train"),
        os("--no-progress"),
        os("--config"),
        os(&s.config),
        os("--model-dir"),
        os(&s.model),
        os("--context"),
        os("64"),
        os("--data"),
        os(&tiny),
    ]);
    refused(&out, &["--context 64", "32 positions"]);
}

/// An export whose disk fills up (a file-size limit makes every write past 64 KiB fail, as a
/// full disk would) leaves OUT_DIR as it was.
fn export_with_a_full_disk(ckpt: &Path, out: &Path) -> Output {
    use std::os::unix::process::CommandExt;
    let mut c = Command::new(env!("CARGO_BIN_EXE_zerodp"));
    c.arg("ckpt").arg("export").arg(ckpt).arg(out);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        c.pre_exec(|| {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let limit = libc::rlimit {
                rlim_cur: 64 << 10,
                rlim_max: libc::RLIM_INFINITY,
            };
            match libc::setrlimit(libc::RLIMIT_FSIZE, &limit) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
    c.output().unwrap()
}

/// The names in `dir`.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn an_export_is_put_in_place_whole_or_not_at_all() {
    let s = setup();
    let ckpt = s.path("ckpt");
    let out = train(
        &s,
        &[os("--model-dir"), os(&s.model), os("--save-dir"), os(&ckpt)],
    );
    ok(&out);
    let export = |to: &Path| zerodp(&[os("ckpt"), os("export"), os(&ckpt), os(to)]);
    // --heads is meaningless for a checkpoint that records its Hugging Face config.
    let out = zerodp(&[
        os("ckpt"),
        os("export"),
        os("--heads"),
        os("2"),
        os(&ckpt),
        os(&s.path("h")),
    ]);
    refused(&out, &["--heads", "drop --heads"]);
    assert!(!s.path("h").exists());
    // A full disk: no directory appears, nothing is left beside it.
    let new = s.path("new");
    let out = export_with_a_full_disk(&ckpt, &new);
    refused(&out, &["exporting to", "new"]);
    assert!(!new.exists(), "a torn export appeared");
    let before = names(s.dir.path());
    // A whole export, then the same with a full disk over it: the first stays whole.
    let first = s.path("export");
    ok(&export(&first));
    let exported = snapshot(&first);
    assert!(exported.keys().any(|p| p.ends_with("config.json")));
    let out = export_with_a_full_disk(&ckpt, &first);
    refused(&out, &["exporting to"]);
    assert_eq!(snapshot(&first), exported, "the earlier export changed");
    let mut after = names(s.dir.path());
    after.retain(|n| n != "export");
    assert_eq!(after, before, "a temporary was left beside the export");
    // An earlier export is replaced whole (a bf16 export over the f32 one).
    let run = zerodp(&[
        os("ckpt"),
        os("export"),
        os("--dtype"),
        os("bf16"),
        os(&ckpt),
        os(&first),
    ]);
    ok(&run);
    let again = snapshot(&first);
    assert_eq!(
        again.keys().collect::<Vec<_>>(),
        exported.keys().collect::<Vec<_>>()
    );
    let weights = first.join("model.safetensors");
    assert!(
        again[&weights].len() < exported[&weights].len(),
        "not the bf16 export"
    );
    // Another model's sharded directory is refused, naming what it holds.
    let other = s.path("other-model");
    std::fs::create_dir(&other).unwrap();
    for name in [
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
    ] {
        std::fs::write(other.join(name), name).unwrap();
    }
    let held = snapshot(&other);
    let out = export(&other);
    refused(
        &out,
        &[
            "other-model",
            "not an earlier zerodp export",
            "model-00001-of-00002",
        ],
    );
    assert_eq!(snapshot(&other), held);
    // A file a user put into an earlier export would be lost: refused, naming it.
    std::fs::write(first.join("notes.txt"), "mine").unwrap();
    let out = export(&first);
    refused(&out, &["notes.txt"]);
    assert_eq!(std::fs::read(first.join("notes.txt")).unwrap(), b"mine");
}

#[test]
fn resume_on_an_empty_save_dir_starts_so_one_command_serves_every_start() {
    let s = setup();
    let save = s.path("ckpt");
    let metrics = s.path("m.jsonl");
    let job = |steps: &str| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_zerodp"));
        c.args([
            "train",
            "--no-progress",
            "--world-size",
            "2",
            "--steps",
            steps,
        ])
        .arg("--config")
        .arg(&s.config)
        .arg("--data")
        .arg(&s.data)
        .arg("--model-dir")
        .arg(&s.model)
        .args(["--save-every", "1", "--resume"])
        .arg("--save-dir")
        .arg(&save)
        .arg("--metrics")
        .arg(&metrics);
        c.output().unwrap()
    };
    let first = job("2");
    ok(&first);
    assert!(
        stderr(&first).contains("holds no checkpoint yet, so training starts from the beginning"),
        "{}",
        stderr(&first)
    );
    // The same command continues the job, keeping the metrics of the steps already trained.
    let second = job("4");
    ok(&second);
    assert!(
        stderr(&second).contains("resuming from"),
        "{}",
        stderr(&second)
    );
    let restarted = std::fs::read_to_string(&metrics).unwrap();
    // An unbroken run of 4 steps writes the same losses.
    let straight = s.path("straight.jsonl");
    let mut c = Command::new(env!("CARGO_BIN_EXE_zerodp"));
    c.args([
        "train",
        "--no-progress",
        "--world-size",
        "2",
        "--steps",
        "4",
    ])
    .arg("--config")
    .arg(&s.config)
    .arg("--data")
    .arg(&s.data)
    .arg("--model-dir")
    .arg(&s.model)
    .arg("--metrics")
    .arg(&straight);
    ok(&c.output().unwrap());
    let losses = |text: &str| -> Vec<(u64, u64, String)> {
        let mut v: Vec<_> = text
            .lines()
            .map(|l| {
                let j: serde_json::Value = serde_json::from_str(l).unwrap();
                (
                    j["step"].as_u64().unwrap(),
                    j["rank"].as_u64().unwrap(),
                    j["loss"].to_string(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let want = losses(&std::fs::read_to_string(&straight).unwrap());
    assert_eq!(want.len(), 8);
    assert_eq!(losses(&restarted), want);
    // --resume DIR naming a directory without a checkpoint stays an error.
    let typo = s.path("ckpt-typo");
    std::fs::create_dir(&typo).unwrap();
    let out = train(&s, &[os("--resume"), os(&typo)]);
    refused(&out, &["ckpt-typo", "no checkpoint"]);
}
