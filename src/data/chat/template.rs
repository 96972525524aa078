//! A tokenizer's chat template: found as transformers finds it, rendered with minijinja as
//! transformers renders it with Jinja2, and the `{% generation %}` blocks' byte ranges in the text.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use minijinja::{Environment, Value};

use super::jinja::{environment, Raised};
use super::{ChatError, Message};

/// Put around a generation block's output by the filter that replaces the tag (Supplementary
/// Private Use Area-A: no tokenizer's text holds them; a message that does is refused).
pub(super) const GEN_START: char = '\u{F0000}';
pub(super) const GEN_END: char = '\u{F0001}';

/// The filter `{% generation %}` becomes (`{% filter zerodp_generation %}`).
const GEN_FILTER: &str = "zerodp_generation";
const TEMPLATE_NAME: &str = "chat_template";

/// A chat template, compiled.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The source as written, for the line an error quotes.
    source: String,
    /// Where it was read from: a `chat_template.jinja`, or the `tokenizer_config.json` that holds it.
    path: PathBuf,
    /// `bos_token`, `eos_token`, ... from `tokenizer_config.json`, as the template sees them.
    special: BTreeMap<String, String>,
    marks_generation: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("path", &self.path)
            .field("special", &self.special)
            .field("marks_generation", &self.marks_generation)
            .finish()
    }
}

/// A rendered conversation: the text, and the byte ranges of it that are trained (in order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    pub generation: Vec<Range<usize>>,
}

impl ChatTemplate {
    /// The template of a Hugging Face tokenizer directory: `chat_template.jinja` when there is one
    /// (it takes precedence, as in transformers), else `chat_template` of `tokenizer_config.json`;
    /// the special tokens from `tokenizer_config.json` either way.
    pub fn from_tokenizer_dir(dir: &Path) -> Result<Self, ChatError> {
        let jinja = dir.join("chat_template.jinja");
        let jinja = jinja.is_file().then_some(jinja);
        Self::from_files(&dir.join("tokenizer_config.json"), jinja.as_deref())
    }

    /// The template in `jinja` if given, else in `tokenizer_config`'s `chat_template` (a string,
    /// or a list of `{name, template}` of which the one named `default` is taken, as transformers
    /// does without tools). Special tokens: every top-level `*_token` of `tokenizer_config` that
    /// is a string or an `{"content": ...}` object, and the string entries of its
    /// `extra_special_tokens` map. A template minijinja cannot parse is refused here, naming the
    /// line and the construct.
    pub fn from_files(tokenizer_config: &Path, jinja: Option<&Path>) -> Result<Self, ChatError> {
        let config = read_json(tokenizer_config)?;
        let special = special_tokens(&config);
        let (source, path) = match jinja {
            Some(p) => (read_text(p)?, p.to_path_buf()),
            None => (
                config_template(tokenizer_config, &config)?,
                tokenizer_config.to_path_buf(),
            ),
        };
        Self::from_source(&source, path, special)
    }

    /// A template from its source text; `path` is what errors name.
    pub fn from_source(
        source: &str,
        path: PathBuf,
        special: BTreeMap<String, String>,
    ) -> Result<Self, ChatError> {
        let (compiled, marks_generation) =
            replace_generation_tags(source).map_err(|(line, msg)| ChatError::Template {
                path: path.clone(),
                line: Some(line),
                msg,
            })?;
        let mut env = environment().map_err(|e| template_error(&path, source, &e))?;
        env.add_filter(GEN_FILTER, |body: String| {
            format!("{GEN_START}{body}{GEN_END}")
        });
        env.add_template_owned(TEMPLATE_NAME, compiled)
            .map_err(|e| template_error(&path, source, &e))?;
        Ok(Self {
            env,
            source: source.to_string(),
            path,
            special,
            marks_generation,
        })
    }

    /// Where the template was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the template has `{% generation %}` blocks; without, [`Self::render`] finds the
    /// assistant's messages in the text itself (see there).
    pub fn marks_generation(&self) -> bool {
        self.marks_generation
    }

    /// A special token's text (`"eos_token"`, ...) as the template sees it.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special.get(name).map(String::as_str)
    }

    /// Renders a conversation with the variables transformers passes (`messages`,
    /// `add_generation_prompt`, the special tokens, `tools` and `documents` none) and returns the
    /// text and its trained ranges: the `{% generation %}` blocks' output.
    ///
    /// A template without generation blocks: each assistant message's content is looked for in
    /// the text, in order, as written or else trimmed (as `| trim` or `.strip()` print it), every
    /// other message's content skipped over first so that a user's words are not taken for the
    /// reply; a range is extended over the EOS token (`eos_token`) when the text goes on with it
    /// right after the content, so that the model learns to end its turn (`<|im_end|>`,
    /// `<|eot_id|>`). This is a heuristic, and an assistant message the template rewrites (drops
    /// a `<think>` part, say) cannot be found: that conversation is refused, naming the message.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Rendered, ChatError> {
        check_no_sentinels(messages)?;
        let mut ctx: BTreeMap<String, Value> = self
            .special
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        let msgs: Vec<Value> = messages.iter().map(Message::to_value).collect();
        ctx.insert("messages".into(), Value::from(msgs));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        ctx.insert("tools".into(), Value::from(()));
        ctx.insert("documents".into(), Value::from(()));
        let template = (self.env.get_template(TEMPLATE_NAME)).map_err(|e| self.render_error(&e))?;
        let raw = template
            .render(Value::from(ctx))
            .map_err(|e| self.render_error(&e))?;
        let (text, generation) = split_generation(&raw).map_err(|msg| ChatError::Template {
            path: self.path.clone(),
            line: None,
            msg,
        })?;
        let generation = if self.marks_generation {
            generation
        } else {
            let eos = self.special_token("eos_token");
            find_assistant_content(messages, &text, eos).map_err(|index| {
                ChatError::ContentNotFound {
                    path: self.path.clone(),
                    index,
                }
            })?
        };
        Ok(Rendered { text, generation })
    }

    fn render_error(&self, e: &minijinja::Error) -> ChatError {
        let raised = std::error::Error::source(e).and_then(|s| s.downcast_ref::<Raised>());
        match raised {
            Some(r) => ChatError::Raised {
                path: self.path.clone(),
                msg: r.0.clone(),
            },
            None => template_error(&self.path, &self.source, e),
        }
    }
}

fn read_text(path: &Path) -> Result<String, ChatError> {
    std::fs::read_to_string(path).map_err(|source| ChatError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn read_json(path: &Path) -> Result<serde_json::Value, ChatError> {
    serde_json::from_str(&read_text(path)?).map_err(|e| ChatError::Config {
        path: path.to_path_buf(),
        msg: format!("not valid JSON: {e}"),
    })
}

/// `chat_template` of a `tokenizer_config.json`.
fn config_template(path: &Path, config: &serde_json::Value) -> Result<String, ChatError> {
    let bad = |msg: String| ChatError::Config {
        path: path.to_path_buf(),
        msg,
    };
    match config.get("chat_template") {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template")?.as_str())
            .map(str::to_string)
            .ok_or_else(|| {
                bad("its `chat_template` is a list of named templates without a `default` one".into())
            }),
        Some(_) => Err(bad("its `chat_template` is neither a string nor a list".into())),
        None => Err(bad(
            "it has no `chat_template` and no chat_template.jinja was given; `messages` data needs \
             the tokenizer's chat template (an instruction-tuned model's tokenizer has one)"
                .into(),
        )),
    }
}

/// The special tokens a template sees, from a `tokenizer_config.json` (see
/// [`ChatTemplate::from_files`]).
fn special_tokens(config: &serde_json::Value) -> BTreeMap<String, String> {
    let text = |v: &serde_json::Value| {
        v.as_str()
            .or_else(|| v.get("content")?.as_str())
            .map(str::to_string)
    };
    let mut out = BTreeMap::new();
    let Some(map) = config.as_object() else {
        return out;
    };
    for (k, v) in map {
        if k.ends_with("_token") {
            if let Some(t) = text(v) {
                out.insert(k.clone(), t);
            }
        }
    }
    if let Some(extra) = map.get("extra_special_tokens").and_then(|e| e.as_object()) {
        for (k, v) in extra {
            if let Some(t) = text(v) {
                out.entry(k.clone()).or_insert(t);
            }
        }
    }
    out
}

/// `{% generation %}` / `{% endgeneration %}` (transformers' own Jinja extension, which
/// minijinja lacks) become `{% filter zerodp_generation %}` / `{% endfilter %}`: still block
/// tags, so `trim_blocks`, `lstrip_blocks` and `-`/`+` act on them as on the originals, and the
/// filter wraps the block's output in [`GEN_START`]/[`GEN_END`]. Line numbers are kept. Returns
/// the new source and whether there was a block; unbalanced tags give `(line, message)`. Tags
/// are found by scanning `{% ... %}`, so one written inside a string literal or a `raw` block
/// would be replaced too.
pub(super) fn replace_generation_tags(source: &str) -> Result<(String, bool), (usize, String)> {
    let mut out = String::with_capacity(source.len() + 64);
    let (mut rest, mut depth, mut any) = (source, 0usize, false);
    while let Some(at) = rest.find("{%") {
        let (before, tag) = rest.split_at(at);
        out.push_str(before);
        let line = source.len() - rest.len() + at;
        let line = source[..line].matches('\n').count() + 1;
        let body_start = 2 + usize::from(tag[2..].starts_with(['-', '+']));
        let body = &tag[body_start..];
        let ws = body.len() - body.trim_start().len();
        let word: String = body
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let replacement = match word.as_str() {
            "generation" => {
                depth += 1;
                any = true;
                Some(format!("filter {GEN_FILTER}"))
            }
            "endgeneration" if depth == 0 => {
                return Err((
                    line,
                    "`{% endgeneration %}` without a `{% generation %}`".into(),
                ))
            }
            "endgeneration" => {
                depth -= 1;
                Some("endfilter".to_string())
            }
            _ => None,
        };
        let head = body_start + ws;
        out.push_str(&tag[..head]);
        match replacement {
            Some(r) => {
                out.push_str(&r);
                rest = &tag[head + word.len()..];
            }
            None => rest = &tag[head..],
        }
    }
    out.push_str(rest);
    if depth > 0 {
        return Err((
            source.lines().count(),
            "a `{% generation %}` block is never closed with `{% endgeneration %}`".into(),
        ));
    }
    Ok((out, any))
}

/// Strips the sentinels from a rendered text and returns the byte ranges between them (in the
/// stripped text). Nested blocks count as the outermost one (the union of the ranges, which is
/// what the mask sees in transformers too).
pub(super) fn split_generation(rendered: &str) -> Result<(String, Vec<Range<usize>>), String> {
    let mut text = String::with_capacity(rendered.len());
    let mut ranges = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for c in rendered.chars() {
        match c {
            GEN_START => {
                if depth == 0 {
                    start = text.len();
                }
                depth += 1;
            }
            GEN_END if depth == 0 => {
                return Err(
                    "a generation block's end came before its start (the template moved \
                            a block's output, e.g. through a `set` block)"
                        .into(),
                )
            }
            GEN_END => {
                depth -= 1;
                if depth == 0 {
                    ranges.push(start..text.len());
                }
            }
            c => text.push(c),
        }
    }
    if depth > 0 {
        return Err("a generation block's output was cut before its end".into());
    }
    Ok((text, ranges))
}

/// The fallback of [`ChatTemplate::render`] for templates without generation blocks; `Err` holds
/// the index of the assistant message not found.
pub(super) fn find_assistant_content(
    messages: &[Message],
    text: &str,
    eos: Option<&str>,
) -> Result<Vec<Range<usize>>, usize> {
    let mut ranges = Vec::new();
    let mut cursor = 0;
    for (index, m) in messages.iter().enumerate() {
        let found = [m.content.as_str(), m.content.trim()]
            .into_iter()
            .filter(|c| !c.is_empty())
            .find_map(|c| {
                text[cursor..]
                    .find(c)
                    .map(|at| cursor + at..cursor + at + c.len())
            });
        let Some(mut range) = found else {
            if m.role == "assistant" && !m.content.trim().is_empty() {
                return Err(index);
            }
            continue;
        };
        cursor = range.end;
        if m.role == "assistant" {
            if let Some(eos) = eos.filter(|e| !e.is_empty() && text[range.end..].starts_with(*e)) {
                range.end += eos.len();
                cursor = range.end;
            }
            ranges.push(range);
        }
    }
    Ok(ranges)
}

fn check_no_sentinels(messages: &[Message]) -> Result<(), ChatError> {
    let has = |s: &str| s.contains([GEN_START, GEN_END]);
    for (index, m) in messages.iter().enumerate() {
        let extra = m.extra.values().any(|v| has(&v.to_string()));
        if has(&m.role) || has(&m.content) || extra {
            return Err(ChatError::Example(format!(
                "message {index} holds U+F0000 or U+F0001, the characters zerodp marks the \
                 template's generation blocks with"
            )));
        }
    }
    Ok(())
}

/// A minijinja error as a [`ChatError::Template`]: its kind and detail, the line and the
/// line's text in `source` (the template as written: replacing the generation tags keeps the
/// line numbers), so that the construct minijinja cannot handle is named.
fn template_error(path: &Path, source: &str, e: &minijinja::Error) -> ChatError {
    let mut msg = match e.detail() {
        Some(d) => format!("{}: {d}", e.kind()),
        None => e.kind().to_string(),
    };
    if let Some(text) = e.line().and_then(|l| source.lines().nth(l.checked_sub(1)?)) {
        let short: String = text.trim().chars().take(120).collect();
        msg.push_str(&format!(" (in `{short}`)"));
    }
    ChatError::Template {
        path: path.to_path_buf(),
        line: e.line(),
        msg,
    }
}
