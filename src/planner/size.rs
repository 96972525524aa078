//! Human sizes in and out: `80GiB`, `80GB`, `1.5TiB`, `7.5e9`, `70B` (a count), and back.

use super::PlanError;

/// Parses a byte size: a number with an optional unit. Binary units (`KiB`, `MiB`, `GiB`, `TiB`) are
/// powers of 1024; decimal units (`KB`, `MB`, `GB`, `TB`, also `K`, `M`, `G`, `T`) powers of 1000;
/// no unit means bytes. `what` names the flag for the error message.
pub fn parse_bytes(text: &str, what: &str) -> Result<u64, PlanError> {
    let (number, unit) = split_number(text);
    let scale: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        _ => {
            return Err(bad_size(
                text,
                what,
                "a byte size such as 80GiB, 80GB, 1.5TiB or 8e10",
            ))
        }
    };
    to_u64(
        number,
        scale,
        text,
        what,
        "a byte size such as 80GiB, 80GB, 1.5TiB or 8e10",
    )
}

/// Parses a count (parameters, elements): `7.5e9`, `70B`, `350M`, `1.5K`, `125000000`.
pub fn parse_count(text: &str, what: &str) -> Result<u64, PlanError> {
    let (number, unit) = split_number(text);
    let scale: f64 = match unit {
        "" => 1.0,
        "K" | "k" => 1e3,
        "M" | "m" => 1e6,
        "B" | "b" | "G" | "g" => 1e9,
        "T" | "t" => 1e12,
        _ => return Err(bad_size(text, what, "a count such as 7.5e9, 70B or 350M")),
    };
    to_u64(
        number,
        scale,
        text,
        what,
        "a count such as 7.5e9, 70B or 350M",
    )
}

/// Parses a bandwidth in bytes per second: `450GB/s`, `400Gbps` / `400Gb/s` (bits), `2.5e10`.
pub fn parse_bandwidth(text: &str, what: &str) -> Result<f64, PlanError> {
    let t = text.trim();
    let hint = "a bandwidth such as 450GB/s, 400Gbps or 5e10 (bytes/s)";
    let (number, unit) = split_number(t);
    let value: f64 = number.parse().map_err(|_| bad_size(text, what, hint))?;
    let scale = match unit {
        "" | "B/s" => 1.0,
        "GB/s" | "GBps" => 1e9,
        "MB/s" | "MBps" => 1e6,
        "TB/s" | "TBps" => 1e12,
        "Gb/s" | "Gbps" | "Gbit/s" => 1e9 / 8.0,
        "Mb/s" | "Mbps" => 1e6 / 8.0,
        _ => return Err(bad_size(text, what, hint)),
    };
    let v = value * scale;
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(bad_size(text, what, hint))
    }
}

/// Parses a latency: `5us`, `5µs`, `0.01ms`, `2e-6` (seconds).
pub fn parse_latency(text: &str, what: &str) -> Result<f64, PlanError> {
    let hint = "a latency such as 5us, 0.02ms or 5e-6 (seconds)";
    let (number, unit) = split_number(text.trim());
    let value: f64 = number.parse().map_err(|_| bad_size(text, what, hint))?;
    let scale = match unit {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "us" | "µs" => 1e-6,
        "ns" => 1e-9,
        _ => return Err(bad_size(text, what, hint)),
    };
    let v = value * scale;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(bad_size(text, what, hint))
    }
}

/// Bytes as decimal GB with enough digits to read the paper's numbers (31.4 GB, 1.9 GB).
pub fn format_gb(bytes: u64) -> String {
    let gb = bytes as f64 / 1e9;
    if gb >= 100.0 {
        format!("{gb:.0} GB")
    } else if gb >= 0.1 || bytes == 0 {
        format!("{gb:.1} GB")
    } else {
        format!("{:.1} MB", bytes as f64 / 1e6)
    }
}

/// A capacity as the user probably wrote it: `80 GiB (85.9 GB)` for whole GiB, else decimal GB.
pub fn format_capacity(bytes: u64) -> String {
    const GIB: u64 = 1 << 30;
    if bytes >= GIB && bytes % GIB == 0 {
        format!("{} GiB ({})", bytes / GIB, format_gb(bytes))
    } else {
        format_gb(bytes)
    }
}

/// An upper bound on a count (a config value to set at most) in the `1.23e6` form, rounded down
/// to its three digits: rounding to nearest could print a value above the bound, which breaks it.
pub(crate) fn format_at_most(count: u64) -> String {
    let mut scale = 1;
    while count / scale >= 1000 {
        scale *= 10;
    }
    format!("{:.2e}", (count / scale * scale) as f64)
}

/// Seconds in the unit that keeps three significant digits readable.
pub fn format_seconds(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{:.0} us", s * 1e6)
    }
}

/// Splits `"1.5TiB"` into `("1.5", "TiB")`: the longest prefix that looks like a float literal.
fn split_number(text: &str) -> (&str, &str) {
    let t = text.trim();
    let bytes = t.as_bytes();
    let mut end = 0;
    while end < bytes.len() {
        let c = bytes[end] as char;
        let exponent_sign =
            (c == '+' || c == '-') && end > 0 && matches!(bytes[end - 1], b'e' | b'E');
        let exponent = (c == 'e' || c == 'E')
            && end > 0
            && bytes
                .get(end + 1)
                .is_some_and(|n| n.is_ascii_digit() || *n == b'-' || *n == b'+');
        if c.is_ascii_digit() || c == '.' || c == '_' || exponent || exponent_sign {
            end += 1;
        } else {
            break;
        }
    }
    (&t[..end], t[end..].trim())
}

fn to_u64(number: &str, scale: f64, text: &str, what: &str, hint: &str) -> Result<u64, PlanError> {
    let cleaned: String = number.chars().filter(|c| *c != '_').collect();
    let value: f64 = cleaned.parse().map_err(|_| bad_size(text, what, hint))?;
    let v = (value * scale).round();
    if v.is_finite() && v >= 0.0 && v < u64::MAX as f64 {
        Ok(v as u64)
    } else {
        Err(bad_size(text, what, hint))
    }
}

fn bad_size(text: &str, what: &str, hint: &str) -> PlanError {
    PlanError::Input(format!("{what}: cannot read {text:?}; give {hint}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_round_down_to_three_digits() {
        assert_eq!(format_at_most(12_399), "1.23e4");
        assert_eq!(format_at_most(999), "9.99e2");
        assert_eq!(format_at_most(7), "7.00e0");
        assert_eq!(format_at_most(50_000_000), "5.00e7");
    }

    #[test]
    fn byte_sizes_binary_and_decimal() {
        assert_eq!(parse_bytes("80GiB", "x").unwrap(), 80 * (1u64 << 30));
        assert_eq!(parse_bytes("80GB", "x").unwrap(), 80_000_000_000);
        assert_eq!(parse_bytes("1.5TiB", "x").unwrap(), 3 * (1u64 << 39));
        assert_eq!(parse_bytes("8e10", "x").unwrap(), 80_000_000_000);
        assert_eq!(parse_bytes(" 512 MiB ", "x").unwrap(), 512 << 20);
        assert!(parse_bytes("80 parsecs", "x").is_err());
        assert!(parse_bytes("-5GB", "x").is_err());
    }

    #[test]
    fn capacities_keep_the_binary_unit() {
        assert_eq!(format_capacity(80 << 30), "80 GiB (85.9 GB)");
        assert_eq!(format_capacity(80_000_000_000), "80.0 GB");
    }

    #[test]
    fn counts() {
        assert_eq!(parse_count("7.5e9", "x").unwrap(), 7_500_000_000);
        assert_eq!(parse_count("70B", "x").unwrap(), 70_000_000_000);
        assert_eq!(parse_count("350M", "x").unwrap(), 350_000_000);
        assert_eq!(parse_count("124_439_808", "x").unwrap(), 124_439_808);
        let e = parse_count("70Q", "--params").unwrap_err().to_string();
        assert!(e.contains("--params") && e.contains("70B"), "{e}");
    }

    #[test]
    fn bandwidths_and_latencies() {
        assert_eq!(parse_bandwidth("400Gbps", "x").unwrap(), 50e9);
        assert_eq!(parse_bandwidth("450GB/s", "x").unwrap(), 450e9);
        assert!((parse_latency("5us", "x").unwrap() - 5e-6).abs() < 1e-15);
        assert!((parse_latency("0.02ms", "x").unwrap() - 2e-5).abs() < 1e-15);
        assert!(parse_latency("fast", "x").is_err());
    }
}
