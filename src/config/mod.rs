//! DeepSpeed JSON config in, validated settings out.
//!
//! ```no_run
//! use zerodp::config::{self, ResolveContext};
//! let ctx = ResolveContext { world_size: 2, world_size_source: "--world-size".into(), ..Default::default() };
//! let loaded = config::load_file("examples/stage2.json", &ctx)?;
//! for w in &loaded.warnings { eprintln!("warning: {w}"); }
//! assert_eq!(loaded.settings.zero_optimization.stage, 2);
//! # Ok::<(), zerodp::config::ConfigError>(())
//! ```
//!
//! # What is accepted, and how it differs from DeepSpeed
//!
//! * Syntax: JSON plus what DeepSpeed's hjson file reader tolerates and real configs use: `//`,
//!   `/* */` and `#` comments, trailing commas, unquoted keys, single-quoted strings, a missing
//!   comma at a line end. Duplicate keys are an error (as in DeepSpeed for files).
//! * Integer keys take integral floats (`5e8`, `65536.0`); `2.5` is an error; negative values
//!   where DeepSpeed wants non-negative integers are errors.
//! * Every `zero_optimization` key with DeepSpeed's *code* defaults (see [`ZeroSettings`]),
//!   `stage3_` aliases, legacy forms with deprecation warnings (old and new together: error).
//! * Unknown keys inside `zero_optimization`, the offload blocks, `comms_logger`, and the
//!   optimizer / scheduler `params` are errors with a "did you mean" (DeepSpeed rejects them
//!   too); unknown top-level keys and keys of lenient blocks (`fp16`, `checkpoint`, ...) are
//!   accepted with one warning listing what is ignored (DeepSpeed ignores them silently).
//! * `"auto"`: resolved from [`ResolveContext`] (batch sizes from the command line and world
//!   size, bucket sizes from the hidden size as Hugging Face does, fp16/bf16 off unless the
//!   command line asks, lr and total steps when given); anything else is an error naming the key,
//!   or in check mode a warning and a null in the JSON output.
//! * Every error carries the JSON path and the line and column of the key ([`Where`]).
//!
//! # Crates used, and why
//!
//! * `jsonc-parser` (dprint): a maintained JSONC parser whose AST keeps a byte range for every
//!   value and key and keeps duplicate keys visible, so errors get line:column and duplicates can
//!   be refused. It covers comments, trailing commas and loose keys; `#` comments (hjson) are
//!   blanked out byte for byte before it runs. The hjson crates lose positions and merge
//!   duplicates, and `serde_path_to_error` gives paths but no positions after a lenient parse.
//! * `strsim`: Jaro-Winkler similarity for "did you mean" suggestions.
//! * `serde` / `serde_json`: the `--format json` output of the resolved settings.
//!
//! The typed walk over the tree is ours: it is what lets every value carry its path and
//! position, accept `"auto"` anywhere, and tell integral floats from fractions exactly.

// A config error is built at most once per load and carries its path and position by value;
// boxing it to satisfy the size lint would only make matching on it clumsier.
#![allow(clippy::result_large_err)]

mod batch;
pub mod defaults;
mod error;
mod json;
mod optimizer;
mod parse;
mod precision;
mod reader;
mod scheduler;
mod settings;
mod zero;

use std::path::Path;

pub use batch::MAX_BATCH;
pub use error::{ConfigError, Location, Where};
pub use settings::*;

/// What the command line and the launcher know, used to fill in `"auto"` and to check the
/// batch arithmetic.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolveContext {
    /// Data-parallel world size.
    pub world_size: usize,
    /// Where the world size came from (`"--world-size"`, `"default (no --world-size given)"`);
    /// quoted in batch errors because a wrong world size is the usual cause.
    pub world_size_source: String,
    /// `--train-batch-size`: fills `train_batch_size` when absent or `"auto"`.
    pub train_batch_size: Option<usize>,
    /// `--micro-batch`: fills `train_micro_batch_size_per_gpu` when absent or `"auto"`.
    pub micro_batch: Option<usize>,
    /// Model hidden size h: `"auto"` bucket sizes become reduce_bucket_size h*h,
    /// stage3_prefetch_bucket_size 0.9*h*h, stage3_param_persistence_threshold 10*h.
    pub hidden_size: Option<usize>,
    /// Precision asked for on the command line: fills `fp16/bf16.enabled: "auto"`.
    pub precision_override: Option<Precision>,
    /// Learning rate from the command line: fills `optimizer.params.lr` and the scheduler's
    /// `warmup_max_lr` / `cycle_max_lr` when `"auto"`.
    pub lr: Option<f64>,
    /// Number of optimizer steps: fills the scheduler's `total_num_steps` when `"auto"`.
    pub total_steps: Option<usize>,
    /// `config check`: unresolved `"auto"` becomes a warning (and null in JSON), not an error.
    pub check_mode: bool,
    /// Ranks per host from the launcher (MPI's shared-memory split): fills
    /// `zero_hpz_partition_size: "auto"`; `None` (one host, or not known) makes it 1, off.
    pub ranks_per_host: Option<usize>,
}

impl Default for ResolveContext {
    fn default() -> Self {
        ResolveContext {
            world_size: 1,
            world_size_source: "the default (no --world-size given)".into(),
            train_batch_size: None,
            micro_batch: None,
            hidden_size: None,
            precision_override: None,
            lr: None,
            total_steps: None,
            check_mode: false,
            ranks_per_host: None,
        }
    }
}

/// Resolved settings plus the warnings a user should see.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    pub settings: Settings,
    pub warnings: Vec<String>,
}

impl Loaded {
    /// [`Settings::to_json`] plus `"warnings"`.
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = self.settings.to_json();
        if let Some(o) = v.as_object_mut() {
            o.insert("warnings".into(), self.warnings.clone().into());
        }
        v
    }
}

/// Reads and resolves a config file. Errors name the file, line and column.
pub fn load_file(path: impl AsRef<Path>, ctx: &ResolveContext) -> Result<Loaded, ConfigError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    load_str(&text, &path.display().to_string(), ctx)
}

/// Resolves config text; `origin` labels positions in errors (a file name, or e.g. `"<inline>"`).
/// A leading UTF-8 byte-order mark (which some Windows editors write) is skipped, as Python's
/// `utf-8-sig` does; columns are counted after it, as editors show them.
pub fn load_str(text: &str, origin: &str, ctx: &ResolveContext) -> Result<Loaded, ConfigError> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let src = json::Source::new(origin, text);
    let root = json::parse(&src)?;
    let mut reader = reader::Reader {
        src: &src,
        ctx,
        warnings: Vec::new(),
        unresolved: Vec::new(),
        ignored: Vec::new(),
    };
    let settings = parse::settings(&mut reader, &root)?;
    Ok(Loaded {
        settings,
        warnings: reader.warnings,
    })
}
