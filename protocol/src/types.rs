//! Small value types shared by the messages: time, ids, fixed-point numbers.

use serde::{Deserialize, Serialize};

/// A point in time: milliseconds since the Unix epoch (UTC). The pure crates never read a
/// clock; callers pass the current time in.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(transparent)]
pub struct Timestamp(pub u64);

impl Timestamp {
    /// `self + ms`, saturating at the end of time.
    pub fn plus_ms(self, ms: u64) -> Timestamp {
        Timestamp(self.0.saturating_add(ms))
    }

    /// Milliseconds from `earlier` to `self`, or 0 if `earlier` is later.
    pub fn ms_since(self, earlier: Timestamp) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

impl std::fmt::Display for Timestamp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}ms", self.0)
    }
}

/// A 128-bit id written as a lowercase hyphenated UUID string (`8-4-4-4-12` hex digits),
/// the form the seeds use for `task_id`. Job, task and rendezvous ids use it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Uuid(pub [u8; 16]);

/// Text that is not a lowercase hyphenated UUID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a lowercase hyphenated UUID (xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")]
pub struct UuidError(pub String);

impl Uuid {
    /// A version-4 (random) UUID from 16 random bytes the caller supplies.
    pub fn from_random(mut bytes: [u8; 16]) -> Self {
        bytes[6] = (bytes[6] & 0x0f) | 0x40;
        bytes[8] = (bytes[8] & 0x3f) | 0x80;
        Self(bytes)
    }
}

impl std::fmt::Display for Uuid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let h = hex::encode(self.0);
        write!(
            f,
            "{}-{}-{}-{}-{}",
            &h[0..8],
            &h[8..12],
            &h[12..16],
            &h[16..20],
            &h[20..32]
        )
    }
}

impl std::fmt::Debug for Uuid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Uuid({self})")
    }
}

impl std::str::FromStr for Uuid {
    type Err = UuidError;
    fn from_str(s: &str) -> Result<Self, UuidError> {
        let err = || UuidError(s.to_string());
        let b = s.as_bytes();
        if b.len() != 36 || [8, 13, 18, 23].iter().any(|&i| b[i] != b'-') {
            return Err(err());
        }
        let digits: String = s.chars().filter(|c| *c != '-').collect();
        if digits.bytes().any(|c| c.is_ascii_uppercase()) {
            return Err(err());
        }
        let mut out = [0u8; 16];
        hex::decode_to_slice(&digits, &mut out).map_err(|_| err())?;
        Ok(Self(out))
    }
}

impl Serialize for Uuid {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Uuid {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Uuid;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a lowercase hyphenated UUID")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Uuid, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_str(V)
    }
}

#[cfg(feature = "arbitrary")]
impl proptest::arbitrary::Arbitrary for Uuid {
    type Parameters = ();
    type Strategy = proptest::strategy::BoxedStrategy<Self>;
    fn arbitrary_with(_: ()) -> Self::Strategy {
        use proptest::strategy::Strategy;
        proptest::arbitrary::any::<[u8; 16]>()
            .prop_map(Uuid)
            .boxed()
    }
}

/// A signed fixed-point number with six decimal places (`Fixed(1_500_000)` is 1.5), used for
/// metrics and thresholds so that signed messages hold no floats.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(transparent)]
pub struct Fixed(pub i64);

impl Fixed {
    /// Units per whole.
    pub const SCALE: i64 = 1_000_000;
}

impl std::fmt::Display for Fixed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sign = if self.0 < 0 { "-" } else { "" };
        let abs = self.0.unsigned_abs();
        let scale = Self::SCALE.unsigned_abs();
        write!(f, "{sign}{}.{:06}", abs / scale, abs % scale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_text_form() {
        let u = Uuid::from_random([0xab; 16]);
        let s = u.to_string();
        assert_eq!(s, "abababab-abab-4bab-abab-abababababab");
        assert_eq!(s.parse::<Uuid>().unwrap(), u);
        assert!(s.to_uppercase().parse::<Uuid>().is_err());
        assert!(
            "abababab-abab-4bab-abab-ababababab"
                .parse::<Uuid>()
                .is_err()
        );
        assert!(
            "abababababab-4bab-abab-abab-abababab"
                .parse::<Uuid>()
                .is_err()
        );
    }

    #[test]
    fn fixed_display() {
        assert_eq!(Fixed(1_500_000).to_string(), "1.500000");
        assert_eq!(Fixed(-250_000).to_string(), "-0.250000");
        assert_eq!(Fixed(i64::MIN).to_string(), "-9223372036854.775808");
    }
}
