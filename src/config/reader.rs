//! Typed reads from the parsed tree: integral floats for integer keys, sign checks, `"auto"`
//! resolution, unknown-key checks with "did you mean". Each read knows the JSON path and the
//! text position, so its errors do too.

use super::error::{ConfigError, Where};
use super::json::{Member, Node, Source, Value};
use super::ResolveContext;

/// One JSON object of the config, with its path.
#[derive(Clone, Copy)]
pub(crate) struct Obj<'n> {
    pub path: &'n str,
    pub node: &'n Node,
    pub members: &'n [Member],
}

impl<'n> Obj<'n> {
    pub fn get(&self, key: &str) -> Option<&'n Member> {
        self.members.iter().find(|m| m.key == key)
    }

    pub fn has(&self, key: &str) -> bool {
        self.get(key).is_some()
    }
}

pub(crate) fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// The closest known key, if it is close enough to be a plausible typo.
pub(crate) fn suggest(key: &str, known: &[&str]) -> Option<String> {
    known
        .iter()
        .map(|k| (strsim::jaro_winkler(key, k), *k))
        .filter(|(score, _)| *score >= 0.85)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k.to_string())
}

/// Parses the text of a JSON number as an exact integer: plain integers exactly, other forms
/// (`5e8`, `65536.0`) through f64 when the value is whole.
fn integer_of(raw: &str) -> Option<i128> {
    let digits = raw.strip_prefix('-').unwrap_or(raw);
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        return raw.parse::<i128>().ok();
    }
    let f: f64 = raw.parse().ok()?;
    if f.is_finite() && f.fract() == 0.0 && f.abs() < 1.7e38 {
        Some(f as i128)
    } else {
        None
    }
}

pub(crate) struct Reader<'s> {
    pub src: &'s Source,
    pub ctx: &'s ResolveContext,
    pub warnings: Vec<String>,
    pub unresolved: Vec<String>,
    /// Keys DeepSpeed reads with a plain `.get` (so it ignores unknown ones) that zerodp does
    /// not implement; reported in one warning at the end.
    pub ignored: Vec<String>,
}

impl<'s> Reader<'s> {
    pub fn at(&self, path: &str, node: &Node) -> Where {
        self.src.at(path, node.span)
    }

    pub(crate) fn key_at(&self, path: &str, m: &Member) -> Where {
        self.src.at(path, m.key_span)
    }

    pub(crate) fn warn(&mut self, msg: impl Into<String>) {
        self.warnings.push(msg.into());
    }

    /// Views `node` as an object, or fails with a type error at `path`.
    pub fn object<'n>(&self, path: &'n str, node: &'n Node) -> Result<Obj<'n>, ConfigError> {
        match &node.value {
            Value::Object(members) => Ok(Obj {
                path,
                node,
                members,
            }),
            _ => Err(self.wrong_type(path, node, "an object { ... }")),
        }
    }

    pub(crate) fn wrong_type(&self, path: &str, node: &Node, expected: &str) -> ConfigError {
        ConfigError::WrongType {
            at: self.at(path, node),
            expected: expected.to_string(),
            found: node.describe(),
        }
    }

    /// Strict blocks (DeepSpeed's pydantic models forbid extra keys): any key not in `known`
    /// is an error with a suggestion.
    pub(crate) fn deny_unknown(&self, obj: Obj<'_>, known: &[&str]) -> Result<(), ConfigError> {
        for m in obj.members {
            if !known.contains(&m.key.as_str()) {
                return Err(ConfigError::UnknownKey {
                    at: self.key_at(&join(obj.path, &m.key), m),
                    key: m.key.clone(),
                    block: if obj.path.is_empty() {
                        "the config".into()
                    } else {
                        format!("\"{}\"", obj.path)
                    },
                    suggestion: suggest(&m.key, known),
                });
            }
        }
        Ok(())
    }

    /// Lenient blocks (DeepSpeed reads them with `.get`): unknown keys are collected for the
    /// "ignored" warning.
    pub(crate) fn collect_unknown(&mut self, obj: Obj<'_>, known: &[&str]) {
        for m in obj.members {
            if !known.contains(&m.key.as_str()) {
                // A typo here (`zero_optimisation`) would silently drop a whole block, so the
                // warning carries the suggestion.
                let path = join(obj.path, &m.key);
                self.ignored.push(match suggest(&m.key, known) {
                    Some(s) => format!("{path} (did you mean \"{s}\"?)"),
                    None => path,
                });
            }
        }
    }

    /// An `"auto"` nothing resolved: an error for training, a warning plus a stand-in value in
    /// check mode.
    pub(crate) fn unresolved_auto<T>(
        &mut self,
        path: &str,
        m: &Member,
        hint: &str,
        standin: T,
    ) -> Result<T, ConfigError> {
        if self.ctx.check_mode {
            self.warn(format!("{path}: \"auto\" is unresolved; {hint}"));
            self.unresolved.push(path.to_string());
            Ok(standin)
        } else {
            Err(ConfigError::UnresolvedAuto {
                at: self.key_at(path, m),
                hint: hint.to_string(),
            })
        }
    }

    // ---- conversions of one node ----

    pub(crate) fn node_bool(&self, path: &str, node: &Node) -> Result<bool, ConfigError> {
        match node.value {
            Value::Bool(b) => Ok(b),
            _ => Err(self.wrong_type(path, node, "true or false")),
        }
    }

    pub(crate) fn node_i64(&self, path: &str, node: &Node) -> Result<i64, ConfigError> {
        let Value::Number(raw) = &node.value else {
            return Err(self.wrong_type(path, node, "an integer"));
        };
        let v = integer_of(raw).ok_or_else(|| ConfigError::NotAnInteger {
            at: self.at(path, node),
            value: raw.clone(),
        })?;
        i64::try_from(v).map_err(|_| ConfigError::OutOfRange {
            at: self.at(path, node),
            message: format!("{raw} is too large for an integer"),
        })
    }

    pub(crate) fn node_u64(&self, path: &str, node: &Node) -> Result<u64, ConfigError> {
        let v = self.node_i64(path, node)?;
        u64::try_from(v).map_err(|_| ConfigError::OutOfRange {
            at: self.at(path, node),
            message: format!("{v} is negative; this key takes a non-negative integer"),
        })
    }

    pub(crate) fn node_f64(&self, path: &str, node: &Node) -> Result<f64, ConfigError> {
        let Value::Number(raw) = &node.value else {
            return Err(self.wrong_type(path, node, "a number"));
        };
        match raw.parse::<f64>() {
            Ok(f) if f.is_finite() => Ok(f),
            _ => Err(ConfigError::OutOfRange {
                at: self.at(path, node),
                message: format!("{raw} is not a finite number"),
            }),
        }
    }

    pub(crate) fn node_str<'n>(&self, path: &str, node: &'n Node) -> Result<&'n str, ConfigError> {
        match &node.value {
            Value::String(s) => Ok(s),
            _ => Err(self.wrong_type(path, node, "a string")),
        }
    }

    // ---- keyed reads with defaults and "auto" ----

    /// Reads `m` (the member for `path`, or None when absent) with `conv`. Absent -> `default`.
    /// `"auto"` -> `auto` when the caller could resolve it, else [`Self::unresolved_auto`].
    #[allow(clippy::too_many_arguments)]
    pub fn read<T: Clone>(
        &mut self,
        path: &str,
        m: Option<&Member>,
        default: T,
        auto: Option<T>,
        hint: &str,
        conv: impl Fn(&Self, &str, &Node) -> Result<T, ConfigError>,
    ) -> Result<T, ConfigError> {
        let Some(m) = m else { return Ok(default) };
        if m.node.is_auto() {
            return match auto {
                Some(v) => Ok(v),
                None => self.unresolved_auto(path, m, hint, default),
            };
        }
        conv(self, path, &m.node)
    }

    pub(crate) fn bool_or(
        &mut self,
        obj: Obj<'_>,
        key: &str,
        default: bool,
    ) -> Result<bool, ConfigError> {
        let path = join(obj.path, key);
        self.read(&path, obj.get(key), default, None, HINT, |r, p, n| {
            r.node_bool(p, n)
        })
    }

    pub(crate) fn u64_or(
        &mut self,
        obj: Obj<'_>,
        key: &str,
        default: u64,
    ) -> Result<u64, ConfigError> {
        let path = join(obj.path, key);
        self.read(&path, obj.get(key), default, None, HINT, |r, p, n| {
            r.node_u64(p, n)
        })
    }

    pub(crate) fn f64_or(
        &mut self,
        obj: Obj<'_>,
        key: &str,
        default: f64,
    ) -> Result<f64, ConfigError> {
        let path = join(obj.path, key);
        self.read(&path, obj.get(key), default, None, HINT, |r, p, n| {
            r.node_f64(p, n)
        })
    }

    /// `obj.key` as a non-negative number, `default` when absent.
    pub(crate) fn nonneg_f64_or(
        &mut self,
        obj: Obj<'_>,
        key: &str,
        default: f64,
    ) -> Result<f64, ConfigError> {
        let path = join(obj.path, key);
        self.read(&path, obj.get(key), default, None, HINT, |r, p, n| {
            r.nonneg_f64(p, n)
        })
    }

    /// A non-negative number (learning rates, ratios, clip norms).
    pub(crate) fn nonneg_f64(&self, path: &str, node: &Node) -> Result<f64, ConfigError> {
        let v = self.node_f64(path, node)?;
        if v < 0.0 {
            return Err(ConfigError::OutOfRange {
                at: self.at(path, node),
                message: format!("{v} is negative; this key takes a value >= 0"),
            });
        }
        Ok(v)
    }

    /// An integer key that may be null (DeepSpeed's `Optional[int]`).
    pub(crate) fn opt_u64(&mut self, obj: Obj<'_>, key: &str) -> Result<Option<u64>, ConfigError> {
        let path = join(obj.path, key);
        self.read(&path, obj.get(key), None, None, HINT, |r, p, n| {
            match n.value {
                Value::Null => Ok(None),
                _ => r.node_u64(p, n).map(Some),
            }
        })
    }
}

/// The generic advice for an `"auto"` zerodp cannot fill in.
pub(crate) const HINT: &str =
    "replace \"auto\" with a value (zerodp fills \"auto\" only for batch \
     sizes, bucket sizes from --hidden-size, and fp16/bf16)";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_as_people_write_them() {
        assert_eq!(integer_of("500000000"), Some(500_000_000));
        assert_eq!(integer_of("5e8"), Some(500_000_000));
        assert_eq!(integer_of("65536.0"), Some(65536));
        assert_eq!(integer_of("-1"), Some(-1));
        assert_eq!(integer_of("2.5"), None);
        assert_eq!(integer_of("1e400"), None);
    }

    #[test]
    fn suggestions_find_real_typos_only() {
        let known = [
            "stage3_param_persistence_threshold",
            "stage",
            "overlap_comm",
        ];
        assert_eq!(
            suggest("stage3_param_persitence_threshold", &known).as_deref(),
            Some("stage3_param_persistence_threshold")
        );
        assert_eq!(suggest("flops_profiler", &known), None);
    }
}
