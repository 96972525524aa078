//! Errors for bad configs. Every variant carries a [`Where`]: the JSON path of the offending key
//! and, when the config came from text, its line and column, so a message always says where to
//! look and (in its wording) how to fix it.

use std::fmt;
use std::path::PathBuf;

/// A position in the config text (1-based line and column, columns counted in characters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// The file name, or the origin label given to [`crate::config::load_str`].
    pub origin: String,
    pub line: usize,
    pub column: usize,
}

/// Where a problem is: the dotted JSON path (`zero_optimization.offload_param.device`) and the
/// text position of the key, when known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Where {
    pub path: String,
    pub location: Option<Location>,
}

impl fmt::Display for Where {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = if self.path.is_empty() {
            "(top level)"
        } else {
            &self.path
        };
        match &self.location {
            Some(l) => write!(f, "{}:{}:{}: {}", l.origin, l.line, l.column, path),
            None => write!(f, "{path}"),
        }
    }
}

fn did_you_mean(s: &Option<String>) -> String {
    match s {
        Some(s) => format!("; did you mean \"{s}\"?"),
        None => String::new(),
    }
}

/// Why a config was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{at}: invalid syntax: {message}")]
    Syntax { at: Where, message: String },
    #[error(
        "{at}: duplicate key \"{key}\" (first given at line {first_line}, column {first_column}); \
         DeepSpeed rejects duplicate keys: keep one of them"
    )]
    DuplicateKey {
        at: Where,
        key: String,
        first_line: usize,
        first_column: usize,
    },
    #[error("{at}: unknown key \"{key}\" in {block}{}", did_you_mean(.suggestion))]
    UnknownKey {
        at: Where,
        key: String,
        block: String,
        suggestion: Option<String>,
    },
    #[error("{at}: expected {expected}, found {found}")]
    WrongType {
        at: Where,
        expected: String,
        found: String,
    },
    #[error(
        "{at}: {value} is not a whole number; this key takes an integer (5e8 or 65536.0 are fine)"
    )]
    NotAnInteger { at: Where, value: String },
    #[error("{at}: {message}")]
    OutOfRange { at: Where, message: String },
    #[error("{at}: \"{value}\" is not one of {allowed}")]
    InvalidChoice {
        at: Where,
        value: String,
        allowed: String,
    },
    #[error("{at}: \"auto\" cannot be resolved here; {hint}")]
    UnresolvedAuto { at: Where, hint: String },
    #[error("{at}: missing key \"{key}\": {hint}")]
    Missing {
        at: Where,
        key: String,
        hint: String,
    },
    #[error(
        "{at}: the deprecated key \"{old}\" and its replacement \"{new}\" are both given; \
         keep only \"{new}\""
    )]
    DeprecatedConflict { at: Where, old: String, new: String },
    #[error(
        "{at}: \"{first}\" and \"{second}\" are both given; they are two names for the same \
         setting: keep one"
    )]
    AliasConflict {
        at: Where,
        first: String,
        second: String,
    },
    #[error("{at}: {what} is not supported by zerodp; {hint}")]
    Unsupported {
        at: Where,
        what: String,
        hint: String,
    },
    #[error("{at}: {message}")]
    Invalid { at: Where, message: String },
    #[error(
        "{at}: batch sizes do not agree at world size {world_size} (world size from {world_size_source}): \
         {detail}. Nearest valid choices: {}",
        .suggestions.join("; ")
    )]
    BatchMismatch {
        at: Where,
        detail: String,
        world_size: usize,
        world_size_source: String,
        suggestions: Vec<String>,
    },
}

impl ConfigError {
    /// Where the error is, when it is about a place in the config (not for I/O errors).
    pub fn at(&self) -> Option<&Where> {
        use ConfigError::*;
        match self {
            Io { .. } => None,
            Syntax { at, .. }
            | DuplicateKey { at, .. }
            | UnknownKey { at, .. }
            | WrongType { at, .. }
            | NotAnInteger { at, .. }
            | OutOfRange { at, .. }
            | InvalidChoice { at, .. }
            | UnresolvedAuto { at, .. }
            | Missing { at, .. }
            | DeprecatedConflict { at, .. }
            | AliasConflict { at, .. }
            | Unsupported { at, .. }
            | Invalid { at, .. }
            | BatchMismatch { at, .. } => Some(at),
        }
    }
}
