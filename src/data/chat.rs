//! Chat and instruction data: JSONL examples into token ids and a mask of the tokens that are
//! trained, as `transformers` and TRL make them (the data half of supervised fine-tuning; the
//! loss masking and packing are the trainer's).
//!
//! A JSONL line is recognised by its keys, in this order:
//!
//! * `messages`: a list of `{"role": ..., "content": ...}` (other keys, such as `name` or
//!   `reasoning_content`, are passed to the template too; keys whose value is null are dropped,
//!   as transformers does). Rendered with the tokenizer's chat template ([`ChatTemplate`],
//!   `add_generation_prompt` false) and tokenized without adding special tokens (the template
//!   writes the BOS), exactly as `tokenizer.apply_chat_template(messages, tokenize=True,
//!   return_dict=True, return_assistant_tokens_mask=True)`. The trained tokens are
//!   `assistant_masks`: a token is trained iff its span overlaps the output of a
//!   `{% generation %}...{% endgeneration %}` block (see [`trained_mask`]). A template without
//!   such blocks falls back to finding the assistant messages' content in the text
//!   ([`ChatTemplate::render`] says how).
//! * `prompt` and `completion`, both strings (TRL's "standard" prompt-completion format; a list of
//!   messages, TRL's conversational form, is refused: write the conversation as `messages`):
//!   `prompt + completion` encoded with the tokenizer's special tokens (its BOS, say), a token
//!   trained iff its span lies in the completion (starts at or after the end of the prompt and is
//!   not empty: a token merging the prompt's last characters with the completion's first belongs
//!   to the prompt, since at generation time the prompt is encoded alone and no such token ever
//!   follows it), then the EOS appended and trained, as TRL appends it to completions; when the
//!   tokenizer already ends the ids with the EOS, that one is trained instead.
//! * `text`: the same as an empty prompt and `text` as the completion: every token of the text is
//!   trained (not a BOS the tokenizer adds, which is never a target anyway), and the EOS.
//!
//! No chat template is involved in the last two, even when the tokenizer has one.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use minijinja::Value;

use super::token_data::TextTokenizer;

mod jinja;
mod template;

pub use template::{ChatTemplate, Rendered};

/// Why an example or a template was refused.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {msg}")]
    Config { path: PathBuf, msg: String },
    /// minijinja cannot parse or render the template (a construct it lacks, a bad expression).
    #[error("chat template {path}{}: {msg}", line.map_or(String::new(), |l| format!(": line {l} of the template")))]
    Template {
        path: PathBuf,
        line: Option<usize>,
        msg: String,
    },
    /// The template called `raise_exception` (roles that do not alternate, say).
    #[error("chat template {path} refused the conversation: {msg}")]
    Raised { path: PathBuf, msg: String },
    #[error(
        "chat template {path} has no {{% generation %}} blocks, and the content of message {index} \
         (assistant) is not in the rendered text as written or trimmed (the template rewrites it), \
         so zerodp cannot tell which tokens to train; use a template that marks the assistant's \
         part with {{% generation %}}...{{% endgeneration %}}"
    )]
    ContentNotFound { path: PathBuf, index: usize },
    #[error(
        "`messages` data needs a chat template: give a tokenizer whose directory has one (the \
         `chat_template` of its tokenizer_config.json, or chat_template.jinja)"
    )]
    NoTemplate,
    /// A malformed example (a missing role, an unknown format, ...).
    #[error("{0}")]
    Example(String),
    #[error("the tokenizer failed: {0}")]
    Tokenizer(String),
    /// Any of the above at a line of a JSONL file.
    #[error("{path}: line {line}: {source}")]
    AtLine {
        path: PathBuf,
        line: usize,
        source: Box<ChatError>,
    },
}

/// One message of a conversation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// The message's other keys (`name`, `tool_calls`, `reasoning_content`, ...), given to the
    /// template as they are.
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            extra: BTreeMap::new(),
        }
    }

    /// Message `index` of a `messages` list: an object with string `role` and `content`.
    pub fn from_json(v: &serde_json::Value, index: usize) -> Result<Self, ChatError> {
        let bad = |what: &str| ChatError::Example(format!("message {index}: {what}"));
        let obj = v.as_object().ok_or_else(|| bad("is not a JSON object"))?;
        let field = |key: &str| match obj.get(key) {
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            None | Some(serde_json::Value::Null) => Err(bad(&format!("has no `{key}`"))),
            Some(_) => Err(bad(&format!(
                "`{key}` is not a string (content given as a list of parts is not supported)"
            ))),
        };
        let (role, content) = (field("role")?, field("content")?);
        let extra = obj
            .iter()
            .filter(|(k, v)| k.as_str() != "role" && k.as_str() != "content" && !v.is_null())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Ok(Self {
            role,
            content,
            extra,
        })
    }

    /// The message as the template sees it: a map of `role`, `content` and the other keys in
    /// that order (as a message is usually written; `.items()` and `tojson` show the order).
    fn to_value(&self) -> Value {
        let mut map = indexmap::IndexMap::with_capacity(self.extra.len() + 2);
        map.insert(Value::from("role"), Value::from(self.role.as_str()));
        map.insert(Value::from("content"), Value::from(self.content.as_str()));
        for (k, v) in &self.extra {
            map.insert(Value::from(k.as_str()), json_to_value(v));
        }
        Value::from(map)
    }
}

/// A JSON value as a template value (objects as maps, in serde_json's key order).
fn json_to_value(v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (None, Some(u)) => Value::from(u),
            _ => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        serde_json::Value::String(s) => Value::from(s.as_str()),
        serde_json::Value::Array(a) => a.iter().map(json_to_value).collect(),
        serde_json::Value::Object(o) => Value::from(
            o.iter()
                .map(|(k, v)| (k.clone(), json_to_value(v)))
                .collect::<BTreeMap<String, Value>>(),
        ),
    }
}

/// One training example: its token ids, and which of them are trained (`trained[i]` says whether
/// token `i` is a target whose loss counts; the trainer shifts it with the targets).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Example {
    pub ids: Vec<u32>,
    pub trained: Vec<bool>,
}

/// The mask `apply_chat_template(..., return_assistant_tokens_mask=True)` computes, in the same
/// single pass over the tokens: a token `[start, end)` is trained iff it overlaps a range
/// (`end > range.start` for the first range not wholly before it, `start >= range.end` being
/// before). `ranges` must be in order. Offsets and ranges are bytes here, characters in
/// transformers: both sit on character boundaries, so the same tokens overlap.
pub fn trained_mask(offsets: &[(usize, usize)], ranges: &[Range<usize>]) -> Vec<bool> {
    let mut mask = vec![false; offsets.len()];
    let mut r = 0;
    for (i, &(start, end)) in offsets.iter().enumerate() {
        while r < ranges.len() && start >= ranges[r].end {
            r += 1;
        }
        if r == ranges.len() {
            break;
        }
        mask[i] = end > ranges[r].start;
    }
    mask
}

/// One JSONL line's example (the formats are in the module docs), recognised by its keys.
pub fn encode_example(
    line: &serde_json::Value,
    template: Option<&ChatTemplate>,
    tokenizer: &TextTokenizer,
) -> Result<Example, ChatError> {
    let obj = line
        .as_object()
        .ok_or_else(|| ChatError::Example("a JSONL line must be a JSON object".into()))?;
    if let Some(messages) = obj.get("messages") {
        let list = messages
            .as_array()
            .ok_or_else(|| ChatError::Example("`messages` is not a list".into()))?;
        let messages = list
            .iter()
            .enumerate()
            .map(|(i, m)| Message::from_json(m, i))
            .collect::<Result<Vec<_>, _>>()?;
        return encode_messages(&messages, template.ok_or(ChatError::NoTemplate)?, tokenizer);
    }
    let string = |key: &str| match obj.get(key) {
        Some(serde_json::Value::String(s)) => Ok(Some(s.as_str())),
        None => Ok(None),
        Some(serde_json::Value::Array(_)) if key != "text" => Err(ChatError::Example(format!(
            "`{key}` is a list: conversational prompt/completion is not supported; write the \
             conversation as `messages`"
        ))),
        Some(_) => Err(ChatError::Example(format!("`{key}` is not a string"))),
    };
    match (string("prompt")?, string("completion")?, string("text")?) {
        (Some(p), Some(c), _) => encode_prompt_completion(p, c, tokenizer),
        (Some(_), None, _) => Err(ChatError::Example("`prompt` without a `completion`".into())),
        (None, Some(_), _) => Err(ChatError::Example("`completion` without a `prompt`".into())),
        (None, None, Some(t)) => encode_prompt_completion("", t, tokenizer),
        (None, None, None) => Err(ChatError::Example(
            "a JSONL line needs `text`, `messages` or `prompt`/`completion`".into(),
        )),
    }
}

/// A conversation's ids and `assistant_masks`, as transformers makes them.
pub fn encode_messages(
    messages: &[Message],
    template: &ChatTemplate,
    tokenizer: &TextTokenizer,
) -> Result<Example, ChatError> {
    if messages.is_empty() {
        return Err(ChatError::Example("`messages` is empty".into()));
    }
    let rendered = template.render(messages, false)?;
    let (ids, offsets) = tokenizer
        .encode_with_offsets(&rendered.text, false)
        .map_err(ChatError::Tokenizer)?;
    let trained = trained_mask(&offsets, &rendered.generation);
    Ok(Example { ids, trained })
}

/// A prompt and completion's ids and mask (the rule in the module docs).
pub fn encode_prompt_completion(
    prompt: &str,
    completion: &str,
    tokenizer: &TextTokenizer,
) -> Result<Example, ChatError> {
    let text = format!("{prompt}{completion}");
    let (mut ids, offsets) = tokenizer
        .encode_with_offsets(&text, true)
        .map_err(ChatError::Tokenizer)?;
    let mut trained: Vec<bool> = offsets
        .iter()
        .map(|&(start, end)| start >= prompt.len() && end > start)
        .collect();
    let eos = tokenizer.eos_id();
    match (ids.last(), trained.last_mut()) {
        (Some(&last), Some(t)) if last == eos => *t = true,
        _ => {
            ids.push(eos);
            trained.push(true);
        }
    }
    Ok(Example { ids, trained })
}

/// Every example of a JSONL file (blank lines skipped); an error names the file and the line.
pub fn read_examples(
    path: &Path,
    template: Option<&ChatTemplate>,
    tokenizer: &TextTokenizer,
) -> Result<Vec<Example>, ChatError> {
    let numbered = read_numbered_examples(path, template, tokenizer)?;
    Ok(numbered.into_iter().map(|(_, e)| e).collect())
}

/// [`read_examples`] with each example's line number (1-based), for messages about it later.
pub fn read_numbered_examples(
    path: &Path,
    template: Option<&ChatTemplate>,
    tokenizer: &TextTokenizer,
) -> Result<Vec<(usize, Example)>, ChatError> {
    let bytes = std::fs::read(path).map_err(|source| ChatError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let at = |line: usize, e: ChatError| ChatError::AtLine {
        path: path.to_path_buf(),
        line,
        source: Box::new(e),
    };
    let mut examples = Vec::new();
    for (i, raw) in bytes.split(|&b| b == b'\n').enumerate() {
        let text = std::str::from_utf8(raw)
            .map_err(|e| at(i + 1, ChatError::Example(format!("not valid UTF-8: {e}"))))?;
        if text.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| at(i + 1, ChatError::Example(format!("not valid JSON: {e}"))))?;
        let example = encode_example(&value, template, tokenizer).map_err(|e| at(i + 1, e))?;
        examples.push((i + 1, example));
    }
    Ok(examples)
}

/// Whether `path` holds chat or instruction examples: a JSONL file whose first line with text
/// is an object with `messages` or `prompt` (training then takes one example per row, with the
/// loss on the answers); any other file is text.
pub fn is_chat_file(path: &Path) -> bool {
    use std::io::BufRead;
    let Ok(file) = std::fs::File::open(path) else {
        return false;
    };
    let first = std::io::BufReader::new(file)
        .lines()
        .map_while(Result::ok)
        .find(|l| !l.trim().is_empty());
    let Some(Ok(serde_json::Value::Object(map))) =
        first.map(|l| serde_json::from_str::<serde_json::Value>(&l))
    else {
        return false;
    };
    map.contains_key("messages") || map.contains_key("prompt")
}

#[cfg(test)]
mod tests {
    use super::template::{find_assistant_content, replace_generation_tags, split_generation};
    use super::*;

    #[test]
    fn generation_tags_become_a_filter_block_on_the_same_lines() {
        let src = "a\n{%- generation -%}\n{{ x }}{% endgeneration %}\n{%+ generation%}y{%endgeneration+%}";
        let (out, any) = replace_generation_tags(src).unwrap();
        assert!(any);
        assert_eq!(
            out,
            "a\n{%- filter zerodp_generation -%}\n{{ x }}{% endfilter %}\n\
             {%+ filter zerodp_generation%}y{%endfilter+%}"
        );
        // Other tags, and words that merely start with `generation`, are left alone.
        let other = "{% if generation_x %}{% generations %}{% endif %}";
        assert_eq!(
            replace_generation_tags(other).unwrap(),
            (other.to_string(), false)
        );
    }

    #[test]
    fn unbalanced_generation_tags_are_refused_with_their_line() {
        let err = replace_generation_tags("x\n{% endgeneration %}").unwrap_err();
        assert_eq!(err.0, 2);
        assert!(err.1.contains("without"), "{}", err.1);
        let err = replace_generation_tags("{% generation %}\nx\ny").unwrap_err();
        assert!(err.1.contains("never closed"), "{}", err.1);
    }

    #[test]
    fn sentinels_give_byte_ranges_of_the_stripped_text() {
        let s =
            "<a>\u{F0000}é🙂\u{F0001}<b>\u{F0000}\u{F0000}x\u{F0001}y\u{F0001}\u{F0000}\u{F0001}";
        let (text, ranges) = split_generation(s).unwrap();
        assert_eq!(text, "<a>é🙂<b>xy");
        // é is 2 bytes, 🙂 4; nested blocks are one range; an empty block an empty range.
        assert_eq!(ranges, vec![3..9, 12..14, 14..14]);
        assert!(split_generation("\u{F0001}x").is_err());
        assert!(split_generation("\u{F0000}x").is_err());
    }

    #[test]
    fn the_mask_is_transformers_single_pass() {
        let offsets = [(0, 2), (2, 4), (4, 6), (6, 6), (6, 9), (9, 12)];
        // A range starting inside a token takes that token; an empty token is never trained.
        assert_eq!(
            trained_mask(&offsets, &[3..6, 9..10]),
            vec![false, true, true, false, false, true]
        );
        assert_eq!(trained_mask(&offsets, &[]), vec![false; 6]);
        assert_eq!(trained_mask(&offsets, &[4..4, 12..12]), vec![false; 6]);
    }

    #[test]
    fn the_fallback_finds_each_reply_after_the_words_before_it() {
        let messages = [
            Message::new("user", "say hi"),
            Message::new("assistant", " hi "),
            Message::new("user", "again"),
            Message::new("assistant", "hi"),
        ];
        let text = "U: say hi<e>A: hi<e>U: again<e>A: hi<e>";
        let ranges = find_assistant_content(&messages, text, Some("<e>")).unwrap();
        let got: Vec<&str> = ranges.iter().map(|r| &text[r.clone()]).collect();
        assert_eq!(got, ["hi<e>", "hi<e>"]);
        assert_eq!(ranges[0].start, 15);
        let missing = [Message::new("assistant", "not there")];
        assert_eq!(find_assistant_content(&missing, text, None), Err(0));
    }
}
