//! Node identities: the ed25519 signing key, its `cpc1...` address, and the X25519 (age)
//! identity that receives encrypted packages.
//!
//! An address is the bech32m encoding (human-readable part `cpc`) of the 32-byte ed25519
//! public key, so anyone holding an address can check a signature against it without a
//! lookup. The delivery identity uses age's own text forms (`age1...` recipients,
//! `AGE-SECRET-KEY-1...` identities), so the `age` tool can read what a node encrypts.

use bech32::{Bech32, Bech32m, Hrp, primitives::decode::CheckedHrpstring};
use ed25519_dalek::{Signer as _, SigningKey, VerifyingKey};
use zeroize::Zeroizing;

use crate::SignatureBytes;

/// Human-readable part of node addresses.
pub const ADDRESS_HRP: &str = "cpc";
const AGE_RECIPIENT_HRP: &str = "age";
const AGE_SECRET_HRP: &str = "age-secret-key-";

/// Problems with key material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The key bytes have the wrong length.
    #[error("{what} must be exactly {expected} bytes, found {got}")]
    WrongLength {
        /// Which key.
        what: &'static str,
        /// Required length.
        expected: usize,
        /// Length found.
        got: usize,
    },
    /// A text-encoded key did not parse.
    #[error("{what} is not valid: {reason}")]
    Malformed {
        /// Which key.
        what: &'static str,
        /// What is wrong.
        reason: String,
    },
}

/// Why a string or key is not a usable address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    /// Not bech32m, wrong checksum, or uppercase.
    #[error("not a cpc1 address: {0}")]
    Encoding(String),
    /// The human-readable part is not `cpc`.
    #[error("address prefix is {0:?}, expected \"cpc\"")]
    WrongPrefix(String),
    /// The payload is not 32 bytes.
    #[error("address holds {0} bytes, expected 32")]
    WrongLength(usize),
    /// The 32 bytes are not a usable ed25519 public key (off the curve or of small order).
    #[error("address does not hold a usable ed25519 public key")]
    BadKey,
}

/// Why a signature did not verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("signature does not verify for {signer}")]
pub struct BadSignature {
    /// The address the signature was checked against.
    pub signer: Address,
}

/// A node's ed25519 signing key.
#[derive(Clone)]
pub struct Keypair {
    signing: SigningKey,
}

impl Keypair {
    /// The keypair whose secret is `secret` (32 bytes, as stored in the node's key file).
    pub fn from_secret(secret: [u8; 32]) -> Self {
        Self {
            signing: SigningKey::from_bytes(&secret),
        }
    }

    /// Like [`Keypair::from_secret`] from a slice, refusing any length but 32.
    pub fn from_secret_slice(bytes: &[u8]) -> Result<Self, KeyError> {
        let secret: [u8; 32] = bytes.try_into().map_err(|_| KeyError::WrongLength {
            what: "node signing key",
            expected: 32,
            got: bytes.len(),
        })?;
        Ok(Self::from_secret(secret))
    }

    /// The secret bytes, wiped from memory when dropped.
    pub fn secret(&self) -> Zeroizing<[u8; 32]> {
        Zeroizing::new(self.signing.to_bytes())
    }

    /// The public address.
    pub fn address(&self) -> Address {
        Address {
            key: self.signing.verifying_key().to_bytes(),
        }
    }

    /// Signs raw bytes. Callers sign domain-separated input (see [`crate::Signed`]).
    pub(crate) fn sign_raw(&self, msg: &[u8]) -> SignatureBytes {
        SignatureBytes(self.signing.sign(msg).to_bytes())
    }
}

impl std::fmt::Debug for Keypair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Keypair({})", self.address())
    }
}

/// A node address: `cpc1` + bech32m of the ed25519 public key.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Address {
    key: [u8; 32],
}

/// Most decompressed keys remembered; the memory is cleared when it is full.
const KEYS_REMEMBERED: usize = 16_384;

/// The decompressed form of a public key, if it is a usable (valid, not small-order) key.
///
/// Decompressing a key costs about as much as a third of a signature check, and a node
/// checks many messages from the same few thousand signers: the result is remembered (a
/// cache of a pure function: bounded, and the same answer either way).
fn usable_key(key: &[u8; 32]) -> Option<VerifyingKey> {
    use std::collections::HashMap;
    use std::sync::{LazyLock, Mutex};
    static KEYS: LazyLock<Mutex<HashMap<[u8; 32], Option<VerifyingKey>>>> =
        LazyLock::new(|| Mutex::new(HashMap::new()));
    if let Ok(keys) = KEYS.lock()
        && let Some(known) = keys.get(key)
    {
        return *known;
    }
    let vk = VerifyingKey::from_bytes(key)
        .ok()
        .filter(|vk| !vk.is_weak());
    if let Ok(mut keys) = KEYS.lock() {
        if keys.len() >= KEYS_REMEMBERED {
            keys.clear();
        }
        keys.insert(*key, vk);
    }
    vk
}

impl Address {
    /// The address of a public key; refuses bytes that are not a usable key.
    pub fn from_public_key(key: [u8; 32]) -> Result<Self, AddressError> {
        usable_key(&key).ok_or(AddressError::BadKey)?;
        Ok(Self { key })
    }

    /// The ed25519 public key.
    pub fn public_key(&self) -> &[u8; 32] {
        &self.key
    }

    /// Verifies `signature` over `msg` strictly (no small-order keys or non-canonical
    /// encodings accepted).
    pub fn verify(&self, msg: &[u8], signature: &SignatureBytes) -> Result<(), BadSignature> {
        let bad = || BadSignature { signer: *self };
        let vk = usable_key(&self.key).ok_or_else(bad)?;
        let sig = ed25519_dalek::Signature::from_bytes(&signature.0);
        vk.verify_strict(msg, &sig).map_err(|_| bad())
    }
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hrp = Hrp::parse_unchecked(ADDRESS_HRP);
        bech32::encode_lower_to_fmt::<Bech32m, _>(f, hrp, &self.key).map_err(|_| std::fmt::Error)
    }
}

impl std::fmt::Debug for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Address({self})")
    }
}

impl std::str::FromStr for Address {
    type Err = AddressError;

    /// Parses the lowercase bech32m form. Uppercase is refused so that every address has
    /// exactly one text form on the wire.
    fn from_str(s: &str) -> Result<Self, AddressError> {
        if s.bytes().any(|b| b.is_ascii_uppercase()) {
            return Err(AddressError::Encoding("addresses are lowercase".into()));
        }
        let checked = CheckedHrpstring::new::<Bech32m>(s)
            .map_err(|e| AddressError::Encoding(e.to_string()))?;
        if checked.hrp().as_str() != ADDRESS_HRP {
            return Err(AddressError::WrongPrefix(checked.hrp().to_string()));
        }
        let data: Vec<u8> = checked.byte_iter().collect();
        let key: [u8; 32] = data
            .as_slice()
            .try_into()
            .map_err(|_| AddressError::WrongLength(data.len()))?;
        Self::from_public_key(key)
    }
}

impl serde::Serialize for Address {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Address {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Address;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a cpc1 address")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Address, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_str(V)
    }
}

#[cfg(feature = "arbitrary")]
impl proptest::arbitrary::Arbitrary for Address {
    type Parameters = ();
    type Strategy = proptest::strategy::BoxedStrategy<Self>;
    fn arbitrary_with(_: ()) -> Self::Strategy {
        use proptest::strategy::Strategy;
        proptest::arbitrary::any::<[u8; 32]>()
            .prop_map(|seed| Keypair::from_secret(seed).address())
            .boxed()
    }
}

/// The X25519 identity that decrypts packages sent to this node (age format).
#[derive(Clone)]
pub struct DeliveryIdentity {
    secret: x25519_dalek::StaticSecret,
}

impl DeliveryIdentity {
    /// The identity whose secret scalar is `secret` (as in age).
    pub fn from_secret(secret: [u8; 32]) -> Self {
        Self {
            secret: x25519_dalek::StaticSecret::from(secret),
        }
    }

    /// The public recipient others encrypt to.
    pub fn recipient(&self) -> DeliveryRecipient {
        DeliveryRecipient(x25519_dalek::PublicKey::from(&self.secret).to_bytes())
    }

    /// age's text form, `AGE-SECRET-KEY-1...`.
    pub fn to_age_string(&self) -> Zeroizing<String> {
        let hrp = Hrp::parse_unchecked(AGE_SECRET_HRP);
        let bytes = Zeroizing::new(self.secret.to_bytes());
        let mut s = Zeroizing::new(String::new());
        // Writing into a String cannot fail and the data is 32 bytes, well within limits.
        let _ = bech32::encode_upper_to_fmt::<Bech32, _>(&mut *s, hrp, &bytes[..]);
        s
    }

    /// Parses age's `AGE-SECRET-KEY-1...` form.
    pub fn from_age_string(s: &str) -> Result<Self, KeyError> {
        let malformed = |reason: String| KeyError::Malformed {
            what: "age identity",
            reason,
        };
        let checked =
            CheckedHrpstring::new::<Bech32>(s.trim()).map_err(|e| malformed(e.to_string()))?;
        if checked.hrp().to_lowercase() != AGE_SECRET_HRP {
            return Err(malformed("expected AGE-SECRET-KEY-1...".into()));
        }
        let data = Zeroizing::new(checked.byte_iter().collect::<Vec<u8>>());
        let secret: [u8; 32] = data
            .as_slice()
            .try_into()
            .map_err(|_| KeyError::WrongLength {
                what: "age identity",
                expected: 32,
                got: data.len(),
            })?;
        Ok(Self::from_secret(secret))
    }
}

impl std::fmt::Debug for DeliveryIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeliveryIdentity({})", self.recipient())
    }
}

/// An X25519 public key that packages are encrypted to; printed as age's `age1...`.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeliveryRecipient(pub [u8; 32]);

impl std::fmt::Display for DeliveryRecipient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hrp = Hrp::parse_unchecked(AGE_RECIPIENT_HRP);
        bech32::encode_lower_to_fmt::<Bech32, _>(f, hrp, &self.0).map_err(|_| std::fmt::Error)
    }
}

impl std::fmt::Debug for DeliveryRecipient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeliveryRecipient({self})")
    }
}

impl std::str::FromStr for DeliveryRecipient {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, KeyError> {
        let malformed = |reason: String| KeyError::Malformed {
            what: "age recipient",
            reason,
        };
        if s.bytes().any(|b| b.is_ascii_uppercase()) {
            return Err(malformed("recipients are lowercase".into()));
        }
        let checked = CheckedHrpstring::new::<Bech32>(s).map_err(|e| malformed(e.to_string()))?;
        if checked.hrp().as_str() != AGE_RECIPIENT_HRP {
            return Err(malformed("expected age1...".into()));
        }
        let data: Vec<u8> = checked.byte_iter().collect();
        let key = data
            .as_slice()
            .try_into()
            .map_err(|_| KeyError::WrongLength {
                what: "age recipient",
                expected: 32,
                got: data.len(),
            })?;
        Ok(Self(key))
    }
}

impl serde::Serialize for DeliveryRecipient {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for DeliveryRecipient {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = DeliveryRecipient;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an age1 recipient")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<DeliveryRecipient, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_str(V)
    }
}

#[cfg(feature = "arbitrary")]
impl proptest::arbitrary::Arbitrary for DeliveryRecipient {
    type Parameters = ();
    type Strategy = proptest::strategy::BoxedStrategy<Self>;
    fn arbitrary_with(_: ()) -> Self::Strategy {
        use proptest::strategy::Strategy;
        proptest::arbitrary::any::<[u8; 32]>()
            .prop_map(DeliveryRecipient)
            .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_round_trips_and_starts_with_cpc1() {
        let k = Keypair::from_secret([7; 32]);
        let a = k.address();
        let s = a.to_string();
        assert!(s.starts_with("cpc1"), "{s}");
        assert_eq!(s.len(), 62);
        assert_eq!(s.parse::<Address>().unwrap(), a);
    }

    #[test]
    fn address_parse_errors_are_specific() {
        let a = Keypair::from_secret([7; 32]).address().to_string();
        assert!(matches!(
            a.to_uppercase().parse::<Address>(),
            Err(AddressError::Encoding(_))
        ));
        let mut flipped = a.clone().into_bytes();
        let last = flipped.len() - 1;
        flipped[last] = if flipped[last] == b'q' { b'p' } else { b'q' };
        assert!(matches!(
            String::from_utf8(flipped).unwrap().parse::<Address>(),
            Err(AddressError::Encoding(_))
        ));
        let other = bech32::encode::<Bech32m>(Hrp::parse("xyz").unwrap(), &[1u8; 32]).unwrap();
        assert!(matches!(
            other.parse::<Address>(),
            Err(AddressError::WrongPrefix(_))
        ));
        let short = bech32::encode::<Bech32m>(Hrp::parse("cpc").unwrap(), &[1u8; 31]).unwrap();
        assert_eq!(short.parse::<Address>(), Err(AddressError::WrongLength(31)));
        // The identity point is a small-order key: refused.
        let mut identity = [0u8; 32];
        identity[0] = 1;
        assert_eq!(
            Address::from_public_key(identity),
            Err(AddressError::BadKey)
        );
        // Bech32 (not bech32m) checksum is refused.
        let wrong_checksum = bech32::encode::<Bech32>(
            Hrp::parse("cpc").unwrap(),
            Keypair::from_secret([7; 32]).address().public_key(),
        )
        .unwrap();
        assert!(matches!(
            wrong_checksum.parse::<Address>(),
            Err(AddressError::Encoding(_))
        ));
    }

    #[test]
    fn signatures_verify_only_for_their_key_and_message() {
        let k = Keypair::from_secret([1; 32]);
        let sig = k.sign_raw(b"hello");
        assert!(k.address().verify(b"hello", &sig).is_ok());
        assert!(k.address().verify(b"hellO", &sig).is_err());
        let other = Keypair::from_secret([2; 32]).address();
        assert!(other.verify(b"hello", &sig).is_err());
    }

    #[test]
    fn secret_slice_length_is_checked() {
        assert_eq!(
            Keypair::from_secret_slice(&[0; 31]).unwrap_err(),
            KeyError::WrongLength {
                what: "node signing key",
                expected: 32,
                got: 31
            }
        );
        assert!(Keypair::from_secret_slice(&[0; 32]).is_ok());
    }

    #[test]
    fn delivery_identity_uses_age_text_forms() {
        let id = DeliveryIdentity::from_secret([9; 32]);
        let s = id.to_age_string();
        assert!(s.starts_with("AGE-SECRET-KEY-1"), "{}", *s);
        let back = DeliveryIdentity::from_age_string(&s).unwrap();
        assert_eq!(back.recipient(), id.recipient());
        let r = id.recipient().to_string();
        assert!(r.starts_with("age1"), "{r}");
        assert_eq!(r.parse::<DeliveryRecipient>().unwrap(), id.recipient());
        assert!(DeliveryIdentity::from_age_string("AGE-SECRET-KEY-1QQQ").is_err());
    }
}
