//! Settings shared by every backend: timeout, tracing, the straggler threshold and how long a rank
//! busy-waits for its peers.
//!
//! Precedence, most specific last: [`CommOptions::default`] (DeepSpeed's 30-minute timeout, tracing
//! off), then the config's `comms_logger` (set by the engine), then the environment
//! ([`CommOptions::with_env`]: `ZERODP_DEBUG`, `ZERODP_TIMEOUT`, `ZERODP_STRAGGLER_MS`,
//! `ZERODP_SPIN_US`), then the command line (the CLI sets
//! the fields directly after reading the environment).

use std::fmt;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// DeepSpeed's (and torch.distributed's) default collective timeout.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// A rank that reaches a collective this much later than the first rank is reported as a straggler.
pub(crate) const DEFAULT_STRAGGLER_THRESHOLD: Duration = Duration::from_secs(1);

/// How long a communication thread busy-waits at a meeting before it sleeps, when its world has no
/// more ranks than the machine has cores. A sleeping thread takes tens of microseconds to wake on a
/// VM (about 50 us per collective here, four wake-ups deep), a spinning one well under one; 50 us
/// covers a peer that issues the same collective a little later, and bounds the CPU a waiting
/// rank takes from compute when its peer is far behind.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// Busy-waiting at meetings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Spin {
    /// [`DEFAULT_SPIN`] when every rank's communication thread can have a core of its own, none
    /// otherwise: with more ranks than cores a spinning thread holds the core that the peer it
    /// waits for needs (measured: 3x slower small collectives at 4 ranks on 2 cores).
    #[default]
    Auto,
    /// At most this long (zero: sleep at once).
    For(Duration),
}

impl Spin {
    /// The spin of a world of `world_size` ranks on a machine with `cores` cores.
    pub fn resolve(self, world_size: usize, cores: usize) -> Duration {
        match self {
            Spin::Auto if world_size <= cores => DEFAULT_SPIN,
            Spin::Auto => Duration::ZERO,
            Spin::For(d) => d,
        }
    }

    /// Parses `ZERODP_SPIN_US` values: `auto`, or whole microseconds (0 = never spin).
    pub fn parse(s: &str) -> Option<Spin> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("auto") {
            return Some(Spin::Auto);
        }
        let us: u64 = s.parse().ok()?;
        (us <= 1_000_000).then(|| Spin::For(Duration::from_micros(us)))
    }
}

/// How much the communicator writes to the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum TraceLevel {
    /// Nothing (the byte counters and the summary statistics are still kept).
    #[default]
    Off,
    /// Straggler notes only.
    Warn,
    /// One line per collective (op, dtype, elements, bytes, time, algbw, busbw) and straggler notes.
    Info,
}

impl TraceLevel {
    /// Parses `ZERODP_DEBUG`-style values: `INFO`, `WARN`, `OFF` (case-insensitive; empty = off).
    pub fn parse(s: &str) -> Option<TraceLevel> {
        match s.trim().to_ascii_uppercase().as_str() {
            "INFO" | "DEBUG" | "TRACE" => Some(TraceLevel::Info),
            "WARN" | "WARNING" => Some(TraceLevel::Warn),
            "" | "OFF" | "NONE" | "0" => Some(TraceLevel::Off),
            _ => None,
        }
    }
}

/// Where trace lines go.
#[derive(Clone, Default)]
pub enum TraceSink {
    /// One line per event on standard error (the default, like NCCL_DEBUG).
    #[default]
    Stderr,
    /// Appended to a shared vector (tests, or callers that forward lines to their own logger).
    Memory(Arc<Mutex<Vec<String>>>),
}

impl TraceSink {
    /// A fresh in-memory sink and the vector it fills.
    pub fn memory() -> (TraceSink, Arc<Mutex<Vec<String>>>) {
        let lines = Arc::new(Mutex::new(Vec::new()));
        (TraceSink::Memory(lines.clone()), lines)
    }

    pub(crate) fn emit(&self, line: String) {
        match self {
            // Not eprintln!: it panics when standard error is gone; a lost trace line is not.
            TraceSink::Stderr => {
                let _ = writeln!(std::io::stderr().lock(), "{line}");
            }
            TraceSink::Memory(v) => v.lock().unwrap_or_else(|e| e.into_inner()).push(line),
        }
    }
}

impl fmt::Debug for TraceSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceSink::Stderr => f.write_str("Stderr"),
            TraceSink::Memory(_) => f.write_str("Memory"),
        }
    }
}

/// Settings of a communicator.
#[derive(Clone, Debug)]
pub struct CommOptions {
    /// How long a rank waits inside one collective for the others before every waiting rank fails
    /// with [`crate::comm::CommError::Timeout`] (NCCL's ranks, which cannot tell which peers
    /// arrived, with a `CommError::Closed` naming the timeout); [`NO_TIMEOUT`] waits as long as
    /// they take.
    pub timeout: Duration,
    /// Per-collective trace lines (`ZERODP_DEBUG=INFO`, or `comms_logger.enabled`).
    pub trace: TraceLevel,
    /// Lateness (behind the first rank to arrive) above which the last rank to arrive is noted as a
    /// straggler in the trace (at level `Warn` and above).
    pub straggler_threshold: Duration,
    pub trace_sink: TraceSink,
    /// Busy-waiting for peers at meetings (`ZERODP_SPIN_US`).
    pub spin: Spin,
    /// Ranks per host when the world spans hosts, numbered host by host: the traffic counters
    /// and traces tell bytes to other hosts apart. `None`: one host. The MPI backend sets it from
    /// its topology; an in-process world may set it to stand for hosts (tests, ZeRO++'s hpZ).
    pub ranks_per_host: Option<usize>,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            timeout: DEFAULT_TIMEOUT,
            trace: TraceLevel::Off,
            straggler_threshold: DEFAULT_STRAGGLER_THRESHOLD,
            trace_sink: TraceSink::Stderr,
            spin: Spin::Auto,
            ranks_per_host: None,
        }
    }
}

/// A bad value in one of the `ZERODP_*` environment variables.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommOptionsError {
    #[error("{var}={value:?} is not valid: {expected}")]
    BadEnv {
        var: &'static str,
        value: String,
        expected: &'static str,
    },
}

impl CommOptions {
    /// Default options with the environment applied (see [`CommOptions::with_env`]).
    pub fn from_env() -> Result<CommOptions, CommOptionsError> {
        CommOptions::default().with_env()
    }

    /// Applies `ZERODP_DEBUG` (`INFO`, `WARN` or `OFF`), `ZERODP_TIMEOUT` (seconds, may be
    /// fractional), `ZERODP_STRAGGLER_MS` (milliseconds) and `ZERODP_SPIN_US` (`auto` or
    /// microseconds) when they are set; unset variables leave the field as it is.
    pub fn with_env(self) -> Result<CommOptions, CommOptionsError> {
        let var = |name: &str| std::env::var(name).ok();
        self.with_vars(
            var("ZERODP_DEBUG").as_deref(),
            var("ZERODP_TIMEOUT").as_deref(),
        )?
        .with_straggler_var(var("ZERODP_STRAGGLER_MS").as_deref())?
        .with_spin_var(var("ZERODP_SPIN_US").as_deref())
    }

    /// Applies a `ZERODP_STRAGGLER_MS` value when given.
    pub(crate) fn with_straggler_var(
        mut self,
        straggler_ms: Option<&str>,
    ) -> Result<CommOptions, CommOptionsError> {
        if let Some(v) = straggler_ms {
            self.straggler_threshold = env_value(
                "ZERODP_STRAGGLER_MS",
                v,
                |v| parse_positive(v).map(|ms| Duration::from_secs_f64(ms / 1000.0)),
                "give the lateness that marks a straggler in milliseconds, a positive number \
                 such as 1000",
            )?;
        }
        Ok(self)
    }

    /// Applies a `ZERODP_SPIN_US` value when given.
    pub(crate) fn with_spin_var(
        mut self,
        spin_us: Option<&str>,
    ) -> Result<CommOptions, CommOptionsError> {
        if let Some(v) = spin_us {
            self.spin = env_value(
                "ZERODP_SPIN_US",
                v,
                Spin::parse,
                "use auto, or whole microseconds from 0 (never spin) to 1000000",
            )?;
        }
        Ok(self)
    }

    /// [`CommOptions::with_env`] with the values passed in (testable without touching the process
    /// environment).
    pub(crate) fn with_vars(
        mut self,
        debug: Option<&str>,
        timeout_secs: Option<&str>,
    ) -> Result<CommOptions, CommOptionsError> {
        if let Some(v) = debug {
            self.trace = env_value(
                "ZERODP_DEBUG",
                v,
                TraceLevel::parse,
                "use INFO (one line per collective), WARN (stragglers only) or OFF",
            )?;
        }
        if let Some(v) = timeout_secs {
            self.timeout = env_value(
                "ZERODP_TIMEOUT",
                v,
                parse_timeout_secs,
                "give the collective timeout in seconds, a positive number such as 1800, or inf for \
                 none",
            )?;
        }
        Ok(self)
    }
}

/// `value` of the environment variable `var` parsed, or the error that names both and says what
/// is `expected`.
fn env_value<T>(
    var: &'static str,
    value: &str,
    parse: impl Fn(&str) -> Option<T>,
    expected: &'static str,
) -> Result<T, CommOptionsError> {
    parse(value).ok_or_else(|| CommOptionsError::BadEnv {
        var,
        value: value.to_string(),
        expected,
    })
}

/// No timeout (`inf` seconds): a rank waits inside a collective as long as its peers take.
pub const NO_TIMEOUT: Duration = Duration::MAX;

/// Finite timeouts stay below this many seconds (about 31,700 years), so that a start instant plus
/// the timeout is still a time the clock can hold.
const MAX_TIMEOUT_SECS: f64 = 1e12;

/// A collective timeout given in seconds: above 0 and below 1e12, or infinite for [`NO_TIMEOUT`];
/// `None` for anything else (0, negative, NaN, too large).
pub fn timeout_from_secs(secs: f64) -> Option<Duration> {
    if secs == f64::INFINITY {
        return Some(NO_TIMEOUT);
    }
    (secs > 0.0 && secs < MAX_TIMEOUT_SECS).then(|| Duration::from_secs_f64(secs))
}

/// Seconds (integer or fractional, > 0), or `inf` for no timeout, as a duration.
pub(crate) fn parse_timeout_secs(s: &str) -> Option<Duration> {
    timeout_from_secs(s.trim().parse().ok()?)
}

/// A positive, finite number below 1e12 (integer or fractional).
fn parse_positive(s: &str) -> Option<f64> {
    let x: f64 = s.trim().parse().ok()?;
    (x.is_finite() && x > 0.0 && x < 1e12).then_some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_overrides_apply_and_bad_values_are_explained() {
        let o = CommOptions::default()
            .with_vars(Some("info"), Some("2.5"))
            .unwrap();
        assert_eq!(o.trace, TraceLevel::Info);
        assert_eq!(o.timeout, Duration::from_millis(2500));
        let o = CommOptions::default().with_vars(None, None).unwrap();
        assert_eq!(o.timeout, DEFAULT_TIMEOUT);
        assert_eq!(o.trace, TraceLevel::Off);
        let e = CommOptions::default()
            .with_vars(None, Some("soon"))
            .unwrap_err();
        assert!(e.to_string().contains("ZERODP_TIMEOUT"), "{e}");
        assert!(CommOptions::default()
            .with_vars(Some("loud"), None)
            .is_err());
        assert!(parse_timeout_secs("0").is_none());
        assert!(parse_timeout_secs("-3").is_none());
        // Infinite is "no timeout"; huge, NaN and negative infinity are refused, never a panic.
        assert_eq!(parse_timeout_secs("inf"), Some(NO_TIMEOUT));
        assert_eq!(parse_timeout_secs(" Infinity "), Some(NO_TIMEOUT));
        for bad in ["1e300", "NaN", "-inf", "1e12"] {
            assert!(parse_timeout_secs(bad).is_none(), "{bad}");
        }
        let o = CommOptions::default().with_vars(None, Some("inf")).unwrap();
        assert_eq!(o.timeout, NO_TIMEOUT);
    }

    #[test]
    fn spin_is_auto_by_default_and_off_when_ranks_outnumber_cores() {
        let o = CommOptions::default().with_spin_var(None).unwrap();
        assert_eq!(o.spin, Spin::Auto);
        assert_eq!(Spin::Auto.resolve(2, 2), DEFAULT_SPIN);
        assert_eq!(Spin::Auto.resolve(4, 2), Duration::ZERO);
        let o = CommOptions::default().with_spin_var(Some("0")).unwrap();
        assert_eq!(o.spin.resolve(2, 8), Duration::ZERO);
        let o = CommOptions::default().with_spin_var(Some(" 200 ")).unwrap();
        assert_eq!(o.spin.resolve(16, 2), Duration::from_micros(200));
        assert_eq!(
            CommOptions::default()
                .with_spin_var(Some("AUTO"))
                .unwrap()
                .spin,
            Spin::Auto
        );
        let o = CommOptions::default()
            .with_straggler_var(Some("250"))
            .unwrap();
        assert_eq!(o.straggler_threshold, Duration::from_millis(250));
        let e = CommOptions::default()
            .with_straggler_var(Some("late"))
            .unwrap_err();
        assert!(e.to_string().contains("ZERODP_STRAGGLER_MS"), "{e}");
        for bad in ["-1", "fast", "2000000"] {
            let e = CommOptions::default().with_spin_var(Some(bad)).unwrap_err();
            assert!(e.to_string().contains("ZERODP_SPIN_US"), "{e}");
        }
    }
}
