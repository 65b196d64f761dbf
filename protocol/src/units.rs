//! Human units in job files and on the command line: durations (`90s`, `15m`, `2h`, `1d`,
//! `500ms`) and sizes (`512MiB`, `24GiB`, `1.5GiB`, `10GB`). Plain numbers are seconds and
//! bytes. Every result is an integer; a value that overflows is an error.

/// Why a unit value did not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UnitError {
    /// Not a number with a known unit.
    #[error("{value:?} is not a {what} (examples: {examples})")]
    Malformed {
        /// The text.
        value: String,
        /// "duration" or "size".
        what: &'static str,
        /// Accepted forms.
        examples: &'static str,
    },
    /// Too large to represent.
    #[error("{0:?} is too large")]
    Overflow(String),
}

const DURATION_EXAMPLES: &str = "500ms, 90s, 15m, 2h, 1d";
const SIZE_EXAMPLES: &str = "4096, 512MiB, 24GiB, 1.5GiB, 10GB";

/// Splits `"1.5GiB"` into the number in thousandths (`1500`) and the unit (`"GiB"`).
fn split(text: &str) -> Option<(u128, &str)> {
    let t = text.trim();
    let end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(end);
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() || frac.len() > 3 || (num.contains('.') && frac.is_empty()) {
        return None;
    }
    let int: u128 = int.parse().ok()?;
    let frac: u128 = if frac.is_empty() {
        0
    } else {
        format!("{frac:0<3}").parse().ok()?
    };
    Some((int.checked_mul(1000)?.checked_add(frac)?, unit.trim()))
}

fn scaled(milli: u128, factor: u128, text: &str) -> Result<u64, UnitError> {
    let v = milli
        .checked_mul(factor)
        .ok_or_else(|| UnitError::Overflow(text.into()))?
        / 1000;
    u64::try_from(v).map_err(|_| UnitError::Overflow(text.into()))
}

/// A duration in milliseconds.
pub fn parse_duration_ms(text: &str) -> Result<u64, UnitError> {
    let bad = || UnitError::Malformed {
        value: text.into(),
        what: "duration",
        examples: DURATION_EXAMPLES,
    };
    let (milli, unit) = split(text).ok_or_else(bad)?;
    let factor: u128 = match unit {
        "ms" => 1,
        "" | "s" => 1000,
        "m" | "min" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(bad()),
    };
    scaled(milli, factor, text)
}

/// A size in bytes.
pub fn parse_size(text: &str) -> Result<u64, UnitError> {
    let bad = || UnitError::Malformed {
        value: text.into(),
        what: "size",
        examples: SIZE_EXAMPLES,
    };
    let (milli, unit) = split(text).ok_or_else(bad)?;
    let factor: u128 = match unit {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        _ => return Err(bad()),
    };
    scaled(milli, factor, text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration_ms("90"), Ok(90_000));
        assert_eq!(parse_duration_ms("500ms"), Ok(500));
        assert_eq!(parse_duration_ms("15m"), Ok(900_000));
        assert_eq!(parse_duration_ms("1.5h"), Ok(5_400_000));
        assert_eq!(parse_duration_ms("2d"), Ok(172_800_000));
        for bad in ["", "h", "1.h", "1.2345s", "-1s", "1 fortnight", "1e3"] {
            assert!(
                matches!(parse_duration_ms(bad), Err(UnitError::Malformed { .. })),
                "{bad}"
            );
        }
        assert_eq!(
            parse_duration_ms("99999999999999999999d"),
            Err(UnitError::Overflow("99999999999999999999d".into()))
        );
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("24GiB"), Ok(24 << 30));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("10GB"), Ok(10_000_000_000));
        assert_eq!(parse_size("512 MiB"), Ok(512 << 20));
        let err = parse_size("24 gigs").unwrap_err().to_string();
        assert!(err.contains("24GiB"), "{err}");
        assert!(matches!(
            parse_size("17000000TiB"),
            Err(UnitError::Overflow(_))
        ));
    }
}
