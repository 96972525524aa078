//! Chat and instruction data: ids and trained masks against `transformers`' own
//! (`apply_chat_template(..., return_assistant_tokens_mask=True)`; fixtures made by
//! `scripts/make_chat_fixtures.py`), the fallback for templates without generation blocks, the
//! prompt/completion rule, and the errors for bad lines and templates.

use std::path::{Path, PathBuf};

use zerodp::data::chat::{
    encode_example, read_examples, ChatError, ChatTemplate, Example, Message,
};
use zerodp::data::token_data::TextTokenizer;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/chat");

fn fixture(name: &str) -> PathBuf {
    Path::new(FIXTURES).join(name)
}

fn expected() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn tokenizer(dir: &str) -> TextTokenizer {
    TextTokenizer::from_file(&fixture(dir).join("tokenizer.json"), None).unwrap()
}

/// The one id `text` encodes to.
fn id_of(tok: &TextTokenizer, text: &str) -> u32 {
    let (ids, _) = tok.encode_with_offsets(text, false).unwrap();
    assert_eq!(ids.len(), 1, "{text:?}");
    ids[0]
}

fn numbers(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// The fixture's examples of `template` (`input_ids`, `assistant_masks`).
fn expected_chat(template: &str) -> Vec<Example> {
    expected()[template]
        .as_array()
        .unwrap()
        .iter()
        .map(|case| Example {
            ids: numbers(&case["input_ids"])
                .into_iter()
                .map(|i| i as u32)
                .collect(),
            trained: numbers(&case["assistant_masks"])
                .into_iter()
                .map(|m| m == 1)
                .collect(),
        })
        .collect()
}

fn conversations() -> Vec<Vec<Message>> {
    let text = std::fs::read_to_string(fixture("messages.jsonl")).unwrap();
    text.lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let list = v["messages"].as_array().unwrap();
            list.iter()
                .enumerate()
                .map(|(i, m)| Message::from_json(m, i).unwrap())
                .collect()
        })
        .collect()
}

/// Reads `messages.jsonl` with the template of `dir` and compares with transformers.
fn check_against_transformers(dir: &str) {
    let template = ChatTemplate::from_tokenizer_dir(&fixture(dir)).unwrap();
    assert!(template.marks_generation());
    let tok = tokenizer(dir);
    let got = read_examples(&fixture("messages.jsonl"), Some(&template), &tok).unwrap();
    let want = expected_chat(dir);
    assert_eq!(got.len(), want.len());
    let texts = expected()[dir].as_array().unwrap().clone();
    for (i, ((g, w), messages)) in got.iter().zip(&want).zip(conversations()).enumerate() {
        let rendered = template.render(&messages, false).unwrap();
        assert_eq!(
            rendered.text,
            texts[i]["text"].as_str().unwrap(),
            "{dir} case {i}"
        );
        assert_eq!(g.ids, w.ids, "{dir} case {i}: ids");
        assert_eq!(g.trained, w.trained, "{dir} case {i}: mask");
    }
}

#[test]
fn llama3_ids_and_masks_equal_transformers() {
    check_against_transformers("llama3");
}

#[test]
fn chatml_ids_and_masks_equal_transformers() {
    check_against_transformers("chatml");
    // The directory's chat_template.jinja (with generation blocks) wins over the config's.
    let template = ChatTemplate::from_tokenizer_dir(&fixture("chatml")).unwrap();
    assert!(template.path().ends_with("chat_template.jinja"));
    assert_eq!(template.special_token("eos_token"), Some("<|im_end|>"));
}

#[test]
fn a_template_without_generation_blocks_falls_back_to_the_assistant_content() {
    // The ChatML config's template is the .jinja one without its generation tags, which covered
    // the content, `<|im_end|>` (the EOS) and the newline after it: the fallback finds the same
    // tokens but that newline...
    let config = fixture("chatml").join("tokenizer_config.json");
    let template = ChatTemplate::from_files(&config, None).unwrap();
    assert!(!template.marks_generation());
    let tok = tokenizer("chatml");
    let im_end = id_of(&tok, "<|im_end|>");
    let newline = id_of(&tok, "\n");
    let convs = conversations();
    for (i, (messages, mut want)) in convs
        .iter()
        .zip(expected_chat("chatml"))
        .enumerate()
        .take(4)
    {
        for t in 1..want.ids.len() {
            if want.ids[t - 1] == im_end && want.trained[t - 1] && want.trained[t] {
                assert_eq!(want.ids[t], newline);
                want.trained[t] = false;
            }
        }
        let got = zerodp::data::chat::encode_messages(messages, &template, &tok).unwrap();
        assert_eq!(got, want, "chatml fallback case {i}");
    }
    // ...except where the template rewrites the reply (drops its `<think>` part).
    let err = zerodp::data::chat::encode_messages(&convs[4], &template, &tok).unwrap_err();
    assert!(
        matches!(err, ChatError::ContentNotFound { index: 1, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("generation"), "{err}");

    // Llama 3's template trims the content: found trimmed, and `<|eot_id|>` after it.
    let dir = tempfile::tempdir().unwrap();
    let source = std::fs::read_to_string(fixture("llama3").join("tokenizer_config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&source).unwrap();
    let stripped = config["chat_template"]
        .as_str()
        .unwrap()
        .replace("{%- generation %}", "")
        .replace("{%- endgeneration %}", "");
    config["chat_template"] = stripped.into();
    let path = dir.path().join("tokenizer_config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    let template = ChatTemplate::from_files(&path, None).unwrap();
    assert!(!template.marks_generation());
    let tok = tokenizer("llama3");
    for (i, (messages, want)) in convs.iter().zip(expected_chat("llama3")).enumerate() {
        let got = zerodp::data::chat::encode_messages(messages, &template, &tok).unwrap();
        assert_eq!(got, want, "llama3 fallback case {i}");
    }
}

#[test]
fn prompt_completion_follows_the_documented_rule() {
    let tok = tokenizer("llama3");
    let got = read_examples(&fixture("prompt_completion.jsonl"), None, &tok).unwrap();
    let want: Vec<Example> = expected()["prompt_completion_llama3"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Example {
            ids: numbers(&c["ids"]).into_iter().map(|i| i as u32).collect(),
            trained: numbers(&c["trained"]).into_iter().map(|m| m == 1).collect(),
        })
        .collect();
    assert_eq!(got, want);
    // The BOS the tokenizer adds is never trained, the appended EOS always.
    for e in &got {
        assert_eq!(e.ids[0], id_of(&tok, "<|begin_of_text|>"));
        assert!(!e.trained[0]);
        assert_eq!(*e.ids.last().unwrap(), tok.eos_id());
        assert!(*e.trained.last().unwrap());
    }
    // A template changes nothing for prompt/completion lines.
    let template = ChatTemplate::from_tokenizer_dir(&fixture("llama3")).unwrap();
    let with = read_examples(&fixture("prompt_completion.jsonl"), Some(&template), &tok).unwrap();
    assert_eq!(with, want);
}

#[test]
fn a_text_line_trains_every_token_and_the_eos() {
    let tok = tokenizer("llama3");
    let line = serde_json::json!({"text": "The quick brown fox."});
    let e = encode_example(&line, None, &tok).unwrap();
    let (ids, _) = tok
        .encode_with_offsets("The quick brown fox.", true)
        .unwrap();
    assert_eq!(e.ids[..ids.len()], ids[..]);
    assert_eq!(e.ids[ids.len()..], [tok.eos_id()]);
    let mut want = vec![true; e.ids.len()];
    want[0] = false; // <|begin_of_text|>, added by the tokenizer
    assert_eq!(e.trained, want);
}

/// The error `read_examples` gives for a file of `lines`.
fn error_for(lines: &str, template: Option<&ChatTemplate>) -> (PathBuf, ChatError) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.jsonl");
    std::fs::write(&path, lines).unwrap();
    let err = read_examples(&path, template, &tokenizer("chatml")).unwrap_err();
    (path, err)
}

#[test]
fn bad_lines_are_refused_naming_the_file_and_the_line() {
    let template = ChatTemplate::from_tokenizer_dir(&fixture("chatml")).unwrap();
    let good = r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}"#;
    let cases = [
        ("{\"messages\": [,]}", "not valid JSON"),
        (
            r#"{"messages": [{"content": "no role"}]}"#,
            "message 0: has no `role`",
        ),
        (
            r#"{"messages": [{"role": "user"}]}"#,
            "message 0: has no `content`",
        ),
        (
            r#"{"messages": [{"role": "user", "content": [{"type": "text"}]}]}"#,
            "`content` is not a string",
        ),
        (r#"{"messages": "hi"}"#, "`messages` is not a list"),
        (r#"{"messages": []}"#, "`messages` is empty"),
        (
            r#"{"input": "x"}"#,
            "a JSONL line needs `text`, `messages` or `prompt`/`completion`",
        ),
        (r#"{"prompt": "x"}"#, "`prompt` without a `completion`"),
        (
            r#"{"prompt": [{"role": "user", "content": "x"}], "completion": "y"}"#,
            "write the conversation as `messages`",
        ),
        ("[1, 2]", "must be a JSON object"),
    ];
    for (bad, want) in cases {
        let (path, err) = error_for(&format!("{good}\n\n{bad}\n{good}\n"), Some(&template));
        let msg = err.to_string();
        assert!(
            msg.starts_with(&format!("{}: line 3: ", path.display())),
            "{msg}"
        );
        assert!(msg.contains(want), "{bad}: {msg}");
    }
    // `messages` without a template.
    let (_, err) = error_for(&format!("{good}\n"), None);
    assert!(
        err.to_string()
            .contains("line 1: `messages` data needs a chat template"),
        "{err}"
    );
    // A message holding the sentinel characters.
    let sentinel = "{\"messages\": [{\"role\": \"user\", \"content\": \"a\u{F0001}\"}]}";
    let (_, err) = error_for(&format!("{sentinel}\n"), Some(&template));
    assert!(err.to_string().contains("U+F0000"), "{err}");
}

#[test]
fn the_templates_own_exception_is_reported_as_its_refusal() {
    let template = ChatTemplate::from_tokenizer_dir(&fixture("llama3")).unwrap();
    let line = r#"{"messages": [{"role": "tool", "content": "42"}]}"#;
    let (path, err) = error_for(&format!("{line}\n"), Some(&template));
    let msg = err.to_string();
    assert!(
        msg.starts_with(&format!("{}: line 1: ", path.display())),
        "{msg}"
    );
    assert!(
        msg.contains("refused the conversation: Unknown role: tool"),
        "{msg}"
    );
}

/// A template from `source`, in a tokenizer_config.json of a temporary directory.
fn template_from(source: &str) -> Result<ChatTemplate, ChatError> {
    let dir = tempfile::tempdir().unwrap();
    let config = serde_json::json!({"eos_token": "<|im_end|>", "chat_template": source});
    let path = dir.path().join("tokenizer_config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    ChatTemplate::from_files(&path, None)
}

#[test]
fn a_template_minijinja_cannot_handle_is_refused_naming_the_construct() {
    // At load: a statement minijinja does not know (Jinja's i18n extension).
    let err = template_from(
        "{% for m in messages %}\n{% trans %}{{ m.content }}{% endtrans %}\n{% endfor %}",
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, ChatError::Template { line: Some(2), .. }),
        "{msg}"
    );
    assert!(
        msg.contains("tokenizer_config.json: line 2 of the template"),
        "{msg}"
    );
    assert!(msg.contains("trans"), "{msg}");
    // At render: a Python method pycompat does not provide.
    let template =
        template_from("{% for m in messages %}\n\n{{ m.content.zfill(3) }}\n{% endfor %}").unwrap();
    let err = template
        .render(&[Message::new("user", "x")], false)
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, ChatError::Template { line: Some(3), .. }),
        "{msg}"
    );
    assert!(msg.contains("zfill"), "{msg}");
    // Generation tags that do not pair up.
    let err = template_from("{% for m in messages %}{% generation %}{{ m.content }}{% endfor %}")
        .unwrap_err();
    assert!(err.to_string().contains("never closed"), "{err}");
    // A config without a template.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer_config.json");
    std::fs::write(&path, r#"{"eos_token": "</s>"}"#).unwrap();
    let err = ChatTemplate::from_files(&path, None).unwrap_err();
    assert!(err.to_string().contains("no `chat_template`"), "{err}");
}

#[test]
fn generation_blocks_keep_jinjas_whitespace_control() {
    // trim_blocks and lstrip_blocks act on the generation tags as on any block tag, and `-`
    // strips around them, as transformers renders it.
    let template = template_from(
        "{% for m in messages %}\n  {% if m.role == 'assistant' %}\n  {% generation %}\n[{{ m.content }}]\n  {% endgeneration %}\n  {% else %}\n({{ m.content }})  {%- generation -%}  \n  {%- endgeneration %}\n  {% endif %}\n{% endfor %}",
    )
    .unwrap();
    let r = template
        .render(
            &[Message::new("user", "q"), Message::new("assistant", "a")],
            false,
        )
        .unwrap();
    assert_eq!(r.text, "(q)[a]\n");
    assert_eq!(r.generation, vec![3..3, 3..7]);
}

#[test]
fn templates_render_as_jinja2_renders_them() {
    // Macros, namespaces, loop variables, filters, tests, Python methods, `tojson`, tool calls,
    // `+`/`-` on generation tags: text and generation ranges as transformers' Jinja2 gives them.
    let all = expected()["render_cases"].clone();
    let special: std::collections::BTreeMap<String, String> =
        [("bos_token", "<s>"), ("eos_token", "</s>")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
    let cases = all["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 14);
    for case in cases {
        let name = format!(
            "{} / {} / {}",
            case["template"], case["messages"], case["add_generation_prompt"]
        );
        let source = all["templates"][case["template"].as_str().unwrap()]
            .as_str()
            .unwrap();
        let template =
            ChatTemplate::from_source(source, PathBuf::from("case.jinja"), special.clone())
                .unwrap();
        let messages: Vec<Message> = all["conversations"][case["messages"].as_str().unwrap()]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, m)| Message::from_json(m, i).unwrap())
            .collect();
        let agp = case["add_generation_prompt"].as_bool().unwrap();
        let rendered = template.render(&messages, agp).unwrap();
        assert_eq!(rendered.text, case["text"].as_str().unwrap(), "{name}");
        let ranges: Vec<[usize; 2]> = rendered
            .generation
            .iter()
            .map(|r| [r.start, r.end])
            .collect();
        let want: Vec<[usize; 2]> = serde_json::from_value(case["ranges"].clone()).unwrap();
        assert_eq!(ranges, want, "{name}");
    }
}
