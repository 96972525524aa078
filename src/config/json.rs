//! The tolerant reader: config text to an owned tree whose every node and key keeps its byte
//! range, so that later checks can report line and column.
//!
//! DeepSpeed reads config files with hjson. What real configs use of that is `//`, `/* */` and `#`
//! comments, trailing commas, and now and then an unquoted key or a missing comma between lines.
//! `jsonc-parser` handles all of these except `#`; we blank `#` comments out first (byte for byte,
//! so positions do not move). Duplicate keys stay visible in its AST and are rejected here, as
//! DeepSpeed does for files.

use jsonc_parser::ast;
use jsonc_parser::common::Ranged;
use jsonc_parser::{CollectOptions, ParseOptions};

use super::error::{ConfigError, Location, Where};

/// Byte range in the config text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub start: usize,
}

#[derive(Debug, Clone)]
pub(crate) enum Value {
    Null,
    Bool(bool),
    /// The number as written (`5e8`, `65536.0`, `-1`): integer fields check it exactly.
    Number(String),
    String(String),
    Array(Vec<Node>),
    Object(Vec<Member>),
}

#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub value: Value,
    pub span: Span,
}

#[derive(Debug, Clone)]
pub(crate) struct Member {
    pub key: String,
    pub key_span: Span,
    pub node: Node,
}

impl Node {
    /// A short description of the value for "expected X, found Y" messages.
    pub fn describe(&self) -> String {
        match &self.value {
            Value::Null => "null".into(),
            Value::Bool(b) => b.to_string(),
            Value::Number(n) => format!("the number {n}"),
            Value::String(s) => format!("the string \"{s}\""),
            Value::Array(_) => "a list".into(),
            Value::Object(_) => "an object".into(),
        }
    }

    pub(crate) fn is_auto(&self) -> bool {
        matches!(&self.value, Value::String(s) if s == "auto")
    }
}

/// The config text and its origin label; turns byte offsets into line and column.
pub(crate) struct Source {
    pub origin: String,
    pub text: String,
    line_starts: Vec<usize>,
}

impl Source {
    pub fn new(origin: &str, text: &str) -> Source {
        let mut line_starts = vec![0];
        for (i, b) in text.bytes().enumerate() {
            if b == b'\n' {
                line_starts.push(i + 1);
            }
        }
        Source {
            origin: origin.to_string(),
            text: text.to_string(),
            line_starts,
        }
    }

    pub fn location(&self, offset: usize) -> Location {
        let offset = offset.min(self.text.len());
        let line = self.line_starts.partition_point(|&s| s <= offset);
        let start = self.line_starts[line - 1];
        let column = match self.text.get(start..offset) {
            Some(s) => s.chars().count() + 1,
            None => offset - start + 1,
        };
        Location {
            origin: self.origin.clone(),
            line,
            column,
        }
    }

    pub fn at(&self, path: &str, span: Span) -> Where {
        Where {
            path: path.to_string(),
            location: Some(self.location(span.start)),
        }
    }
}

/// Blanks `#` comments (outside strings and other comments) with spaces, keeping every byte
/// offset, so the JSONC parser sees only syntax it knows.
pub(crate) fn blank_hash_comments(text: &str) -> String {
    #[derive(Clone, Copy)]
    enum State {
        Normal,
        Str(u8),
        Line,
        Block,
        Hash,
    }
    let mut out = text.as_bytes().to_vec();
    let bytes = text.as_bytes();
    let mut state = State::Normal;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        let next = bytes.get(i + 1).copied();
        match state {
            State::Normal => match b {
                b'"' | b'\'' => state = State::Str(b),
                b'/' if next == Some(b'/') => {
                    state = State::Line;
                    i += 1;
                }
                b'/' if next == Some(b'*') => {
                    state = State::Block;
                    i += 1;
                }
                b'#' => {
                    state = State::Hash;
                    out[i] = b' ';
                }
                _ => {}
            },
            State::Str(q) => {
                if b == b'\\' {
                    i += 1;
                } else if b == q || b == b'\n' {
                    state = State::Normal;
                }
            }
            State::Line => {
                if b == b'\n' {
                    state = State::Normal;
                }
            }
            State::Block => {
                if b == b'*' && next == Some(b'/') {
                    state = State::Normal;
                    i += 1;
                }
            }
            State::Hash => {
                if b == b'\n' {
                    state = State::Normal;
                } else {
                    out[i] = b' ';
                }
            }
        }
        i += 1;
    }
    // Only whole characters up to a newline were replaced, so the bytes stay UTF-8.
    String::from_utf8(out).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

fn parse_options() -> ParseOptions {
    ParseOptions {
        // What hjson (DeepSpeed's file reader) tolerates and real configs use.
        allow_comments: true,
        allow_trailing_commas: true,
        allow_loose_object_property_names: true,
        allow_missing_commas: true,
        allow_single_quoted_strings: true,
        // JSON5-only number and string forms that neither JSON nor hjson accept.
        allow_hexadecimal_numbers: false,
        allow_unary_plus_numbers: false,
        allow_bare_decimal_point_numbers: false,
        allow_non_finite_numbers: false,
        allow_extended_string_escapes: false,
    }
}

/// Parses config text into a tree. Syntax errors and duplicate keys are reported with line and
/// column.
pub(crate) fn parse(src: &Source) -> Result<Node, ConfigError> {
    let cleaned = blank_hash_comments(&src.text);
    let parsed = jsonc_parser::parse_to_ast(&cleaned, &CollectOptions::default(), &parse_options())
        .map_err(|e| ConfigError::Syntax {
            at: src.at(
                "",
                Span {
                    start: e.range().start,
                },
            ),
            message: e.kind().to_string(),
        })?;
    let Some(root) = parsed.value else {
        return Err(ConfigError::Syntax {
            at: src.at("", Span { start: 0 }),
            message: "the config is empty; it must be one JSON object".into(),
        });
    };
    convert(src, &root, "")
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn convert(src: &Source, v: &ast::Value<'_>, path: &str) -> Result<Node, ConfigError> {
    let span = Span { start: v.start() };
    let value = match v {
        ast::Value::NullKeyword(_) => Value::Null,
        ast::Value::BooleanLit(b) => Value::Bool(b.value),
        ast::Value::NumberLit(n) => Value::Number(n.value.to_string()),
        ast::Value::StringLit(s) => Value::String(s.value.to_string()),
        ast::Value::Array(a) => {
            let mut items = Vec::with_capacity(a.elements.len());
            for (i, e) in a.elements.iter().enumerate() {
                items.push(convert(src, e, &format!("{path}[{i}]"))?);
            }
            Value::Array(items)
        }
        ast::Value::Object(o) => {
            let mut members: Vec<Member> = Vec::with_capacity(o.properties.len());
            for p in &o.properties {
                let key = p.name.as_str().to_string();
                let key_span = Span {
                    start: p.name.start(),
                };
                let child = join(path, &key);
                if let Some(first) = members.iter().find(|m| m.key == key) {
                    let first_loc = src.location(first.key_span.start);
                    return Err(ConfigError::DuplicateKey {
                        at: src.at(&child, key_span),
                        key,
                        first_line: first_loc.line,
                        first_column: first_loc.column,
                    });
                }
                let node = convert(src, &p.value, &child)?;
                members.push(Member {
                    key,
                    key_span,
                    node,
                });
            }
            Value::Object(members)
        }
    };
    Ok(Node { value, span })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_comments_are_blanked_outside_strings_only() {
        let t = "{\"a#b\": 1, # note\n \"c\": '#x' /* # */ // #\n}";
        let c = blank_hash_comments(t);
        assert_eq!(c.len(), t.len());
        assert!(c.contains("\"a#b\""));
        assert!(c.contains("'#x'"));
        assert!(c.contains("/* # */"));
        assert!(!c.contains("note"));
    }

    #[test]
    fn location_counts_lines_and_characters() {
        let s = Source::new("f.json", "{\n  \"é\": 1,\n  \"b\": 2}");
        let off = s.text.find("\"b\"").unwrap();
        let l = s.location(off);
        assert_eq!((l.line, l.column), (3, 3));
        let off = s.text.find('1').unwrap();
        assert_eq!(s.location(off).column, 8);
    }

    #[test]
    fn duplicate_keys_are_errors_with_both_positions() {
        let s = Source::new("f.json", "{\"a\": 1,\n \"a\": 2}");
        match parse(&s) {
            Err(ConfigError::DuplicateKey { at, first_line, .. }) => {
                assert_eq!(at.path, "a");
                assert_eq!(at.location.unwrap().line, 2);
                assert_eq!(first_line, 1);
            }
            other => panic!("expected a duplicate key error, got {other:?}"),
        }
    }
}
