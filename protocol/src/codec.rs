//! Canonical CBOR: the one byte form of every wire value.
//!
//! cbor4ii's encoder is deterministic for a given Rust type (shortest integers, definite
//! lengths, struct fields as text keys in declaration order), but its decoder is lenient: it
//! accepts non-shortest integers, indefinite lengths and trailing bytes. So [`decode`] caps
//! the input size, decodes, refuses trailing bytes, and accepts the value only if it encodes
//! back to exactly the bytes received. Wire types use no hash maps and no floats, so the
//! encoder has nothing non-deterministic to work with.
//!
//! Every top-level value travels as a two-element array `[version, body]`; an unknown
//! version is refused before the body is looked at.

use cbor4ii::core::dec::{Read as _, Reference};
use serde::Serialize;
use serde::de::{DeserializeOwned, IgnoredAny};

use crate::Address;

/// A type that travels on the wire as `[VERSION, body]` in canonical CBOR.
pub trait Wire: Serialize + DeserializeOwned {
    /// Human name of the type, used in error messages and docs.
    const KIND: &'static str;
    /// The version this build speaks; any other is refused.
    const VERSION: u16;
    /// Largest encoding accepted; larger input is refused before it is decoded.
    const MAX_SIZE: usize;
}

/// A wire type that is signed inside a [`crate::Signed`] envelope.
pub trait Message: Wire {
    /// Domain separation string: signatures over one kind never verify as another.
    const DOMAIN: &'static str;

    /// The address this message claims as its author, which must be the signer.
    fn claimed_signer(&self) -> Option<&Address> {
        None
    }

    /// Semantic checks beyond the structure (time order, ranges, cross-field rules).
    fn validate(&self) -> Result<(), Invalid> {
        Ok(())
    }
}

/// A message that decoded but breaks a rule of its type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field}: {reason}")]
pub struct Invalid {
    /// The field (or field path) at fault.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

impl Invalid {
    /// An `Invalid` for `field` with `reason`.
    pub fn new(field: &'static str, reason: impl Into<String>) -> Self {
        Self {
            field,
            reason: reason.into(),
        }
    }
}

/// Why bytes were not accepted as a value of some wire type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The input is over the type's size cap; nothing was decoded.
    #[error("{kind} is {size} bytes, over the {limit}-byte limit")]
    TooLarge {
        /// The wire type.
        kind: &'static str,
        /// Input size.
        size: usize,
        /// The cap.
        limit: usize,
    },
    /// The input is not CBOR of the expected shape.
    #[error("{kind} is not well-formed: {reason}")]
    Malformed {
        /// The wire type.
        kind: &'static str,
        /// The decoder's description.
        reason: String,
    },
    /// A value was decoded but bytes follow it.
    #[error("{kind} has {count} trailing bytes after the value")]
    TrailingBytes {
        /// The wire type.
        kind: &'static str,
        /// How many bytes follow.
        count: usize,
    },
    /// The value decoded but does not re-encode to the same bytes (non-shortest integers,
    /// indefinite lengths, fields out of order, absent optional fields, unknown fields...).
    #[error("{kind} is not in canonical form: it must re-encode to exactly the bytes received")]
    NonCanonical {
        /// The wire type.
        kind: &'static str,
    },
    /// The version in front of the body is not the one this build speaks.
    #[error("{kind} version {got} is not supported (this node speaks version {supported})")]
    UnsupportedVersion {
        /// The wire type.
        kind: &'static str,
        /// The version received.
        got: u16,
        /// The version spoken here.
        supported: u16,
    },
}

/// Canonical CBOR of any serializable value (no version prefix).
pub fn to_canonical<T: Serialize>(value: &T) -> Vec<u8> {
    // Encoding our wire types cannot fail: none has a fallible `Serialize` and a `Vec`
    // writer fails only when allocation fails, which aborts anyway.
    cbor4ii::serde::to_vec(Vec::new(), value)
        .unwrap_or_else(|e| panic!("CBOR encoding into memory failed: {e:?}"))
}

/// Encodes a wire value as `[T::VERSION, value]`.
pub fn encode<T: Wire>(value: &T) -> Vec<u8> {
    to_canonical(&(T::VERSION, value))
}

/// Decodes `[T::VERSION, value]`, enforcing the size cap, the version, no trailing bytes and
/// canonical form.
pub fn decode<T: Wire>(bytes: &[u8]) -> Result<T, DecodeError> {
    decode_with_limit(bytes, T::MAX_SIZE)
}

/// Like [`decode`] with an explicit (usually smaller) size cap.
pub fn decode_with_limit<T: Wire>(bytes: &[u8], limit: usize) -> Result<T, DecodeError> {
    check_size(T::KIND, bytes, limit)?;
    let (got, _): (u16, IgnoredAny) = decode_prefix(T::KIND, bytes)?;
    if got != T::VERSION {
        return Err(DecodeError::UnsupportedVersion {
            kind: T::KIND,
            got,
            supported: T::VERSION,
        });
    }
    let (_, value): (u16, T) = decode_canonical(T::KIND, bytes, limit)?;
    Ok(value)
}

/// Decodes a whole value of any deserializable type and checks it is canonical.
pub(crate) fn decode_canonical<T: Serialize + DeserializeOwned>(
    kind: &'static str,
    bytes: &[u8],
    limit: usize,
) -> Result<T, DecodeError> {
    check_size(kind, bytes, limit)?;
    let value: T = decode_prefix(kind, bytes)?;
    if to_canonical(&value) != bytes {
        return Err(DecodeError::NonCanonical { kind });
    }
    Ok(value)
}

fn check_size(kind: &'static str, bytes: &[u8], limit: usize) -> Result<(), DecodeError> {
    if bytes.len() > limit {
        return Err(DecodeError::TooLarge {
            kind,
            size: bytes.len(),
            limit,
        });
    }
    Ok(())
}

/// Decodes one value from the front of `bytes` and refuses anything after it.
fn decode_prefix<T: DeserializeOwned>(kind: &'static str, bytes: &[u8]) -> Result<T, DecodeError> {
    let mut de = cbor4ii::serde::Deserializer::new(cbor4ii::core::utils::SliceReader::new(bytes));
    let value = T::deserialize(&mut de).map_err(|e| DecodeError::Malformed {
        kind,
        reason: e.to_string(),
    })?;
    let mut rest = de.into_inner();
    let count = match rest.fill(bytes.len()) {
        Ok(Reference::Long(b)) => b.len(),
        Ok(Reference::Short(b)) => b.len(),
        Err(never) => match never {},
    };
    if count != 0 {
        return Err(DecodeError::TrailingBytes { kind, count });
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Pair {
        a: u64,
        b: String,
    }

    impl Wire for Pair {
        const KIND: &'static str = "pair";
        const VERSION: u16 = 1;
        const MAX_SIZE: usize = 64;
    }

    fn sample() -> Vec<u8> {
        encode(&Pair {
            a: 5,
            b: "x".into(),
        })
    }

    #[test]
    fn round_trip() {
        let bytes = sample();
        // [1, {"a": 5, "b": "x"}]
        assert_eq!(
            hex::encode(&bytes),
            "8201a2616105616261 78".replace(' ', "")
        );
        assert_eq!(
            decode::<Pair>(&bytes).unwrap(),
            Pair {
                a: 5,
                b: "x".into()
            }
        );
    }

    #[test]
    fn refuses_trailing_bytes() {
        let mut bytes = sample();
        bytes.push(0);
        assert_eq!(
            decode::<Pair>(&bytes),
            Err(DecodeError::TrailingBytes {
                kind: "pair",
                count: 1
            })
        );
    }

    #[test]
    fn refuses_non_shortest_integer() {
        // a = 5 written as a one-byte-argument integer (0x18 0x05) instead of 0x05.
        let bytes = hex::decode("8201a26161180561626178").unwrap();
        assert_eq!(
            decode::<Pair>(&bytes),
            Err(DecodeError::NonCanonical { kind: "pair" })
        );
    }

    #[test]
    fn refuses_indefinite_lengths() {
        // The body map written with indefinite length (0xbf ... 0xff).
        let bytes = hex::decode("8201bf616105616261 78ff".replace(' ', "")).unwrap();
        assert_eq!(
            decode::<Pair>(&bytes),
            Err(DecodeError::NonCanonical { kind: "pair" })
        );
        // The outer array indefinite: not even the version prefix decodes.
        let bytes = hex::decode("9f01a2616105616261 78ff".replace(' ', "")).unwrap();
        assert!(matches!(
            decode::<Pair>(&bytes),
            Err(DecodeError::Malformed { kind: "pair", .. })
        ));
    }

    #[test]
    fn refuses_reordered_fields() {
        // {"b": "x", "a": 5}: same content, keys out of the canonical order.
        let bytes = hex::decode("8201a2616261786161 05".replace(' ', "")).unwrap();
        assert_eq!(
            decode::<Pair>(&bytes),
            Err(DecodeError::NonCanonical { kind: "pair" })
        );
    }

    #[test]
    fn refuses_duplicate_keys() {
        let bytes = hex::decode("8201a361610561610661626178").unwrap();
        assert!(matches!(
            decode::<Pair>(&bytes),
            Err(DecodeError::Malformed { kind: "pair", .. })
        ));
    }

    #[test]
    fn refuses_unknown_version_before_the_body() {
        // version 2 with a body that is not even a Pair
        let bytes = hex::decode("820200").unwrap();
        assert_eq!(
            decode::<Pair>(&bytes),
            Err(DecodeError::UnsupportedVersion {
                kind: "pair",
                got: 2,
                supported: 1
            })
        );
    }

    #[test]
    fn refuses_oversized_input_before_decoding() {
        let bytes = vec![0u8; 65];
        assert_eq!(
            decode::<Pair>(&bytes),
            Err(DecodeError::TooLarge {
                kind: "pair",
                size: 65,
                limit: 64
            })
        );
    }

    #[test]
    fn refuses_deep_nesting_without_overflowing_the_stack() {
        let bytes = vec![0x81u8; 60];
        assert!(decode::<Pair>(&bytes).is_err());
        let deep = vec![0x81u8; 100_000];
        assert!(decode_with_limit::<Pair>(&deep, usize::MAX).is_err());
    }
}
