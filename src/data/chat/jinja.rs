//! The Jinja environment transformers renders chat templates in, rebuilt on minijinja: its
//! whitespace settings, the globals it adds (`raise_exception`, `strftime_now`), its `tojson`
//! (Python's `json.dumps`, not Jinja's HTML-safe one), Python's string and dict methods
//! (`minijinja-contrib`'s pycompat), and Python's printing of `None`, `True` and `False`.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Output, State, Value};

/// What `raise_exception(msg)` fails the render with, so that the caller can tell a template's
/// own refusal (roles that do not alternate, a missing system message) from an engine error.
#[derive(Debug)]
pub(super) struct Raised(pub String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// An environment set up as transformers' `ImmutableSandboxedEnvironment(trim_blocks=True,
/// lstrip_blocks=True, extensions=[loopcontrols])` with its filters and globals.
pub(super) fn environment() -> Result<Environment<'static>, minijinja::Error> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(python_formatter);
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    Ok(env)
}

/// `{{ none }}` prints `None` and booleans `True`/`False` in Jinja2 (Python's `str`); minijinja
/// prints `none`, `true`, `false`. Everything else as minijinja prints it (no auto-escaping: the
/// template's name has no HTML extension).
fn python_formatter(out: &mut Output, state: &mut State, value: &Value) -> Result<(), Error> {
    let text = match value.kind() {
        ValueKind::None => "None",
        ValueKind::Bool if value.is_true() => "True",
        ValueKind::Bool => "False",
        _ => return minijinja::escape_formatter(out, state, value),
    };
    out.write_str(text)
        .map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()))
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg.clone()).with_source(Raised(msg)))
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// which is `json.dumps` with those arguments: `", "` and `": "` between items (`","` and `": "`
/// with an indent), non-ASCII characters as they are, no HTML escaping.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let mut w = PyJson {
        out: String::new(),
        indent: kwargs.get::<Option<usize>>("indent")?,
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        item_sep: String::new(),
        key_sep: String::new(),
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    (w.item_sep, w.key_sep) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be two strings",
            ))
        }
        None if w.indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    w.value(value, 0)?;
    Ok(Value::from_safe_string(w.out))
}

/// A `json.dumps` writer.
struct PyJson {
    out: String,
    indent: Option<usize>,
    ensure_ascii: bool,
    sort_keys: bool,
    item_sep: String,
    key_sep: String,
}

impl PyJson {
    fn value(&mut self, v: &Value, depth: usize) -> Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => self.number(v),
            ValueKind::String => self.string(v.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container(('[', ']'), items.len(), depth, |w, i| {
                    w.value(&items[i], depth + 1)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                self.container(('{', '}'), keys.len(), depth, |w, i| {
                    w.string(&keys[i].to_string());
                    w.out.push_str(&w.key_sep.clone());
                    w.value(&v.get_item(&keys[i])?, depth + 1)
                })?;
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a {} is not JSON", v.kind()),
                ))
            }
        }
        Ok(())
    }

    /// `open`, the items (`item(w, i)`) with the separators and indentation, `close`.
    fn container(
        &mut self,
        (open, close): (char, char),
        len: usize,
        depth: usize,
        mut item: impl FnMut(&mut Self, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.out.push(open);
        for i in 0..len {
            if i > 0 {
                self.out.push_str(&self.item_sep.clone());
            }
            self.newline(depth + 1);
            item(self, i)?;
        }
        if len > 0 {
            self.newline(depth);
        }
        self.out.push(close);
        Ok(())
    }

    fn newline(&mut self, depth: usize) {
        if let Some(n) = self.indent {
            self.out.push('\n');
            self.out.extend(std::iter::repeat_n(' ', n * depth));
        }
    }

    /// Python prints an integral float with `.0` (`1.0`, not `1`).
    fn number(&mut self, v: &Value) {
        if v.is_integer() {
            let _ = write!(self.out, "{v}");
            return;
        }
        let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
        let _ = match f {
            f if f.is_nan() => write!(self.out, "NaN"),
            f if f.is_infinite() => write!(self.out, "{}Infinity", if f < 0.0 { "-" } else { "" }),
            f if f.fract() == 0.0 && f.abs() < 1e16 => write!(self.out, "{f:.1}"),
            f => write!(self.out, "{f}"),
        };
    }

    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{8}' => self.out.push_str("\\b"),
                '\u{c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        let _ = write!(self.out, "\\u{u:04x}");
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

/// `strftime_now(format)`: the current time (UTC; Python's `datetime.now()` is local time) in the
/// `strftime` directives templates use (Llama 3.1's "Today Date: %d %b %Y"): `%Y %y %m %d %e
/// %H %M %S %b %B %a %A %j %%`. Another directive is refused rather than printed wrong. Note
/// that a template that prints the date renders differently from one day to the next.
fn strftime_now(format: &str) -> Result<Value, Error> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime(format, secs).map(Value::from)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// `format` at `secs` seconds after the Unix epoch (UTC).
pub(super) fn strftime(format: &str, secs: i64) -> Result<String, Error> {
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let yday = days - days_from_civil(y, 1, 1) + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('Y') => write!(out, "{y}"),
            Some('y') => write!(out, "{:02}", y.rem_euclid(100)),
            Some('m') => write!(out, "{m:02}"),
            Some('d') => write!(out, "{d:02}"),
            Some('e') => write!(out, "{d:2}"),
            Some('j') => write!(out, "{yday:03}"),
            Some('H') => write!(out, "{:02}", tod / 3600),
            Some('M') => write!(out, "{:02}", tod / 60 % 60),
            Some('S') => write!(out, "{:02}", tod % 60),
            Some('B') => write!(out, "{}", MONTHS[m as usize - 1]),
            Some('b') => write!(out, "{}", &MONTHS[m as usize - 1][..3]),
            Some('A') => write!(out, "{}", WEEKDAYS[weekday]),
            Some('a') => write!(out, "{}", &WEEKDAYS[weekday][..3]),
            Some('%') => write!(out, "%"),
            other => {
                let directive = other.map_or(String::new(), String::from);
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: the directive %{directive} is not supported"),
                ));
            }
        };
    }
    Ok(out)
}

/// Year, month (1-12) and day of day `z` after 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// The inverse of [`civil_from_days`].
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = i64::from((m + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, ctx: Value) -> String {
        let env = environment().unwrap();
        env.render_str(source, ctx).unwrap()
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        // What `json.dumps` prints for the same dict: insertion order, Python's separators,
        // non-ASCII kept, `1.0` a float, no HTML escaping.
        let src = r#"{{ {"z": 1.0, "a": [1, "<é>\n", none, true], "e": {}} | tojson }}"#;
        assert_eq!(
            render(src, Value::from(())),
            r#"{"z": 1.0, "a": [1, "<é>\n", null, true], "e": {}}"#
        );
        let src = r#"{{ {"z": [1, 2], "a": "é"} | tojson(indent=2, ensure_ascii=true, sort_keys=true) }}"#;
        assert_eq!(
            render(src, Value::from(())),
            "{\n  \"a\": \"\\u00e9\",\n  \"z\": [\n    1,\n    2\n  ]\n}"
        );
    }

    #[test]
    fn none_and_booleans_print_as_in_python() {
        assert_eq!(
            render("{{ none }} {{ true }} {{ 1 == 2 }}", Value::from(())),
            "None True False"
        );
    }

    #[test]
    fn python_string_methods_work() {
        let out = render(
            "{{ ' a b '.strip() }}|{{ 'x</think>y'.split('</think>')[-1] }}|{{ 'abc'.startswith('ab') }}",
            Value::from(()),
        );
        assert_eq!(out, "a b|y|True");
    }

    #[test]
    fn strftime_formats_a_known_date() {
        // 2024-07-23 14:05:09 UTC, a Tuesday, day 205 of a leap year.
        let secs = 1_721_743_509;
        assert_eq!(
            strftime("%d %b %Y|%A %a %B %m %y %j %H:%M:%S %e %%", secs).unwrap(),
            "23 Jul 2024|Tuesday Tue July 07 24 205 14:05:09 23 %"
        );
        assert_eq!(strftime("%Y-%m-%d", 0).unwrap(), "1970-01-01");
        assert!(strftime("%Z", secs).is_err());
    }

    #[test]
    fn raise_exception_carries_its_message() {
        let env = environment().unwrap();
        let err = env
            .render_str("{{ raise_exception('roles must alternate') }}", ())
            .unwrap_err();
        let raised = std::error::Error::source(&err).and_then(|s| s.downcast_ref::<Raised>());
        assert_eq!(raised.map(|r| r.0.as_str()), Some("roles must alternate"));
    }
}
