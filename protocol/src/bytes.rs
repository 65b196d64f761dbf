//! Fixed-size byte strings that travel as CBOR byte strings and print as hex.

/// Defines a fixed-size byte newtype that encodes as a CBOR byte string (never as an
/// array of integers) and displays as lowercase hex.
macro_rules! fixed_bytes {
    ($(#[$meta:meta])* $name:ident, $len:expr) => {
        $(#[$meta])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub [u8; $len]);

        impl $name {
            /// Length in bytes.
            pub const LEN: usize = $len;

            /// The raw bytes.
            pub fn as_bytes(&self) -> &[u8; $len] {
                &self.0
            }

            /// Parses lowercase or uppercase hex of exactly the right length.
            pub fn from_hex(s: &str) -> Result<Self, $crate::bytes::HexError> {
                let mut out = [0u8; $len];
                hex::decode_to_slice(s, &mut out).map_err(|_| $crate::bytes::HexError {
                    what: stringify!($name),
                    expected_len: $len,
                })?;
                Ok(Self(out))
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&hex::encode(self.0))
            }
        }

        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}({})", stringify!($name), hex::encode(self.0))
            }
        }

        impl serde::Serialize for $name {
            /// A byte string in CBOR; lowercase hex in human-readable formats (JSON).
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                if s.is_human_readable() {
                    s.collect_str(self)
                } else {
                    s.serialize_bytes(&self.0)
                }
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl serde::de::Visitor<'_> for V {
                    type Value = $name;
                    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                        write!(f, "a byte string of {} bytes", $len)
                    }
                    fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<$name, E> {
                        <[u8; $len]>::try_from(v)
                            .map($name)
                            .map_err(|_| E::invalid_length(v.len(), &self))
                    }
                    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<$name, E> {
                        $name::from_hex(v).map_err(E::custom)
                    }
                }
                if d.is_human_readable() {
                    d.deserialize_str(V)
                } else {
                    d.deserialize_bytes(V)
                }
            }
        }

        #[cfg(feature = "arbitrary")]
        impl proptest::arbitrary::Arbitrary for $name {
            type Parameters = ();
            type Strategy = proptest::strategy::BoxedStrategy<Self>;
            fn arbitrary_with(_: ()) -> Self::Strategy {
                use proptest::strategy::Strategy;
                proptest::collection::vec(proptest::arbitrary::any::<u8>(), $len)
                    .prop_map(|v| {
                        let mut a = [0u8; $len];
                        a.copy_from_slice(&v);
                        $name(a)
                    })
                    .boxed()
            }
        }
    };
}

/// A hex string that did not hold the expected number of bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} must be {expected_len} bytes of hex ({} hex digits)", expected_len * 2)]
pub struct HexError {
    /// The type being parsed.
    pub what: &'static str,
    /// Expected length in bytes.
    pub expected_len: usize,
}

fixed_bytes!(
    /// A SHA-256 digest: content addresses, message ids, merkle nodes.
    Digest,
    32
);

fixed_bytes!(
    /// An ed25519 signature (R || S).
    SignatureBytes,
    64
);

fixed_bytes!(
    /// An ed25519 public key as it appears in a signed envelope.
    PublicKeyBytes,
    32
);

impl Digest {
    /// SHA-256 of `data`.
    pub fn of(data: &[u8]) -> Self {
        use sha2::Digest as _;
        Self(sha2::Sha256::digest(data).into())
    }

    /// SHA-256 of the concatenation of `parts`.
    pub fn of_parts(parts: &[&[u8]]) -> Self {
        use sha2::Digest as _;
        let mut h = sha2::Sha256::new();
        for p in parts {
            h.update(p);
        }
        Self(h.finalize().into())
    }

    /// The `0x`-prefixed hex form used by the ledger's JSON-shaped fields.
    pub fn to_0x(&self) -> String {
        format!("0x{self}")
    }
}

impl std::str::FromStr for Digest {
    type Err = HexError;
    /// Accepts plain hex, `0x`-prefixed hex, or `sha256:`-prefixed hex.
    fn from_str(s: &str) -> Result<Self, HexError> {
        let s = s
            .strip_prefix("0x")
            .or_else(|| s.strip_prefix("sha256:"))
            .unwrap_or(s);
        Self::from_hex(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_encodes_as_cbor_byte_string() {
        let d = Digest([0xab; 32]);
        let bytes = cbor4ii::serde::to_vec(Vec::new(), &d).unwrap();
        // major type 2 (bytes), one-byte length 32
        assert_eq!(&bytes[..2], &[0x58, 32]);
        assert_eq!(bytes.len(), 34);
        let back: Digest = cbor4ii::serde::from_slice(&bytes).unwrap();
        assert_eq!(back, d);
    }

    #[test]
    fn wrong_length_is_refused() {
        let bytes =
            cbor4ii::serde::to_vec(Vec::new(), &serde_bytes::Bytes::new(&[1, 2, 3])).unwrap();
        assert!(cbor4ii::serde::from_slice::<Digest>(&bytes).is_err());
    }

    #[test]
    fn parses_prefixed_hex() {
        let d = Digest::of(b"x");
        assert_eq!(d.to_0x().parse::<Digest>().unwrap(), d);
        assert_eq!(format!("sha256:{d}").parse::<Digest>().unwrap(), d);
        assert!("0x12".parse::<Digest>().is_err());
    }
}

/// Serde helpers for the `0x`-prefixed lowercase hex strings of the ledger's seed layout.
pub(crate) mod hex0x {
    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(crate) fn parse<const N: usize>(s: &str) -> Result<[u8; N], String> {
        let digits = s
            .strip_prefix("0x")
            .ok_or_else(|| format!("{s:?} must start with 0x"))?;
        if digits.bytes().any(|b| b.is_ascii_uppercase()) {
            return Err(format!("{s:?} must be lowercase hex"));
        }
        let mut out = [0u8; N];
        hex::decode_to_slice(digits, &mut out)
            .map_err(|_| format!("{s:?} must be 0x and {} hex digits", N * 2))?;
        Ok(out)
    }

    pub(crate) mod digest {
        use super::*;
        use crate::Digest;

        pub(crate) fn serialize<S: Serializer>(d: &Digest, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_str(&d.to_0x())
        }

        pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Digest, D::Error> {
            let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
            parse::<32>(&s).map(Digest).map_err(D::Error::custom)
        }
    }

    pub(crate) mod opt_signature {
        use super::*;
        use crate::SignatureBytes;

        pub(crate) fn serialize<S: Serializer>(
            sig: &Option<SignatureBytes>,
            s: S,
        ) -> Result<S::Ok, S::Error> {
            match sig {
                Some(sig) => s.serialize_some(&format!("0x{sig}")),
                None => s.serialize_none(),
            }
        }

        pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Option<SignatureBytes>, D::Error> {
            let s = <Option<std::borrow::Cow<'de, str>>>::deserialize(d)?;
            s.map(|s| {
                parse::<64>(&s)
                    .map(SignatureBytes)
                    .map_err(D::Error::custom)
            })
            .transpose()
        }
    }
}
