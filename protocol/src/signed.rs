//! `Signed<T>`: a payload, its signer's public key and an ed25519 signature over
//! domain-separated bytes.
//!
//! The signature covers `T::DOMAIN || 0x00 || payload`, where `payload` is the canonical
//! encoding of `[T::VERSION, body]`. A receiver verifies the signature before it decodes the
//! payload, then checks that the address the body claims as its author is the signer, then
//! runs the type's semantic checks. Only a [`Verified`] value reaches the market.

use std::marker::PhantomData;

use serde::{Deserialize, Serialize};

use crate::codec::{self, DecodeError, Invalid, Message, Wire};
use crate::identity::{AddressError, BadSignature};
use crate::{Address, Digest, Keypair, PublicKeyBytes, SignatureBytes};

/// Bytes added by the envelope around the payload, with room to spare.
pub const ENVELOPE_OVERHEAD: usize = 128;

/// A signed message of kind `T`, as it travels on the wire.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct Signed<T> {
    #[serde(with = "serde_bytes")]
    payload: Vec<u8>,
    signer: PublicKeyBytes,
    signature: SignatureBytes,
    #[serde(skip)]
    kind: PhantomData<fn() -> T>,
}

/// Why a signed message was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// The signer field is not a usable public key.
    #[error("signer is not a valid key: {0}")]
    BadSigner(#[from] AddressError),
    /// The signature does not verify for the signer over this kind's domain.
    #[error(transparent)]
    BadSignature(#[from] BadSignature),
    /// The signed payload does not decode.
    #[error("signed payload: {0}")]
    Decode(#[from] DecodeError),
    /// The body names a different author than the key that signed it.
    #[error("message claims to be from {claimed} but is signed by {actual}")]
    SignerMismatch {
        /// The author named in the body.
        claimed: Address,
        /// The key that signed.
        actual: Address,
    },
    /// The body breaks a rule of its type.
    #[error(transparent)]
    Invalid(#[from] Invalid),
}

/// A message whose signature, encoding, author and rules have been checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified<T> {
    /// Who signed it.
    pub signer: Address,
    /// The message.
    pub body: T,
    /// The message id: SHA-256 of the domain-separated signed bytes.
    pub id: Digest,
}

/// A message decoded, whose author and rules are checked but whose signature is not yet.
///
/// What a receiver looks at first, to drop duplicates, expired and stale messages (and bids
/// from workers the offer did not draw) before it spends a signature check on them. It
/// proves nothing: nothing is kept, forwarded or acted on before [`Received::check_signature`]
/// passed.
///
/// It keeps the decoded message and the signature, not the signed bytes: decoding checked
/// that the body re-encodes to exactly those bytes, so [`Received::signed`] gives them back
/// when they are needed (to check the signature, to serve a sync page), and a message held
/// for days costs its decoded form only, not that and its wire bytes too.
#[derive(Debug, Clone)]
pub struct Received<T> {
    /// The key the envelope names as signer (which the body's author must be).
    pub signer: Address,
    /// The decoded message.
    pub body: T,
    /// Its message id.
    pub id: Digest,
    signature: SignatureBytes,
    size: usize,
}

impl<T: Message> Received<T> {
    /// Checks the signature: the last step before the message is believed.
    pub fn check_signature(&self) -> Result<(), OpenError> {
        self.signer
            .verify(
                &signing_input(T::DOMAIN, &codec::encode(&self.body)),
                &self.signature,
            )
            .map_err(OpenError::from)
    }

    /// The envelope, byte for byte as it arrived: the canonical payload re-encoded from the
    /// body, the signer's key and the signature.
    pub fn signed(&self) -> Signed<T> {
        Signed::from_parts(
            codec::encode(&self.body),
            PublicKeyBytes(*self.signer.public_key()),
            self.signature,
        )
    }

    /// The signature, as it arrived.
    pub fn signature(&self) -> &SignatureBytes {
        &self.signature
    }

    /// The length of the signed payload as it arrived, in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// A message as if received from `signer`, with an all-zero signature that never
    /// verifies: for simulations that model the cost of cryptography instead of paying it.
    pub fn assumed(body: T, signer: Address) -> Self {
        let payload = codec::encode(&body);
        Self {
            id: Digest::of_parts(&[T::DOMAIN.as_bytes(), &[0], &payload]),
            size: payload.len(),
            signature: SignatureBytes([0; 64]),
            signer,
            body,
        }
    }
}

/// The id a message will have once signed, by anyone: SHA-256 of `T::DOMAIN || 0x00 ||`
/// its canonical payload. Lets the sans-IO market refer to the awards it asks the node to
/// sign.
pub fn message_id<T: Message>(body: &T) -> Digest {
    Digest::of_parts(&[T::DOMAIN.as_bytes(), &[0], &codec::encode(body)])
}

/// The bytes an ed25519 signature covers: `domain || 0x00 || payload`.
pub fn signing_input(domain: &str, payload: &[u8]) -> Vec<u8> {
    let mut input = Vec::with_capacity(domain.len() + 1 + payload.len());
    input.extend_from_slice(domain.as_bytes());
    input.push(0);
    input.extend_from_slice(payload);
    input
}

impl<T: Message> Signed<T> {
    /// Encodes `body` canonically and signs it under `T::DOMAIN`.
    pub fn sign(keys: &Keypair, body: &T) -> Self {
        let payload = codec::encode(body);
        let signature = keys.sign_raw(&signing_input(T::DOMAIN, &payload));
        Self {
            payload,
            signer: PublicKeyBytes(*keys.address().public_key()),
            signature,
            kind: PhantomData,
        }
    }

    /// The message id: SHA-256 of `T::DOMAIN || 0x00 || payload`. It does not depend on the
    /// signature, so a re-signed copy of the same message has the same id.
    pub fn id(&self) -> Digest {
        Digest::of_parts(&[T::DOMAIN.as_bytes(), &[0], &self.payload])
    }

    /// The signer's address, if the key is usable. Not a proof of anything until
    /// [`Signed::verify`] succeeded.
    pub fn signer(&self) -> Result<Address, AddressError> {
        Address::from_public_key(self.signer.0)
    }

    /// Whether the envelope names `who` as its signer: a byte comparison, no key parsing
    /// and no signature check.
    pub fn names_signer(&self, who: &Address) -> bool {
        self.signer.0 == *who.public_key()
    }

    /// The signature, as it arrived.
    pub fn signature(&self) -> &SignatureBytes {
        &self.signature
    }

    /// The signed payload bytes (canonical `[version, body]`).
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// Checks the signature, then decodes the payload, then checks the claimed author and
    /// the type's rules. Nothing looks at the payload before the signature verified.
    pub fn verify(&self) -> Result<Verified<T>, OpenError> {
        let signer = self.signer()?;
        signer.verify(&signing_input(T::DOMAIN, &self.payload), &self.signature)?;
        let body: T = codec::decode(&self.payload)?;
        if let Some(claimed) = body.claimed_signer()
            && *claimed != signer
        {
            return Err(OpenError::SignerMismatch {
                claimed: *claimed,
                actual: signer,
            });
        }
        body.validate()?;
        Ok(Verified {
            signer,
            body,
            id: self.id(),
        })
    }

    /// Decodes the payload and makes every check of [`Signed::verify`] but the signature:
    /// the signer key is usable, the body's author is that key, the type's rules hold.
    /// Check the signature ([`Received::check_signature`]) before believing it.
    pub fn open(self) -> Result<Received<T>, OpenError> {
        let signer = self.signer()?;
        let body: T = codec::decode(&self.payload)?;
        if let Some(claimed) = body.claimed_signer()
            && *claimed != signer
        {
            return Err(OpenError::SignerMismatch {
                claimed: *claimed,
                actual: signer,
            });
        }
        body.validate()?;
        Ok(Received {
            id: self.id(),
            size: self.payload.len(),
            signature: self.signature,
            signer,
            body,
        })
    }

    /// Like [`Signed::verify`], and also requires a particular signer.
    pub fn verify_from(&self, expected: &Address) -> Result<Verified<T>, OpenError> {
        let verified = self.verify()?;
        if verified.signer != *expected {
            return Err(OpenError::SignerMismatch {
                claimed: *expected,
                actual: verified.signer,
            });
        }
        Ok(verified)
    }

    /// Wire bytes of the envelope.
    pub fn to_bytes(&self) -> Vec<u8> {
        codec::encode(self)
    }

    /// Decodes an envelope (size cap, version, canonical form). Verify it next.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, DecodeError> {
        codec::decode(bytes)
    }

    /// Builds an envelope from parts, e.g. to test that tampering is caught.
    pub fn from_parts(payload: Vec<u8>, signer: PublicKeyBytes, signature: SignatureBytes) -> Self {
        Self {
            payload,
            signer,
            signature,
            kind: PhantomData,
        }
    }

    /// The envelope's parts: payload, signer key, signature.
    pub fn into_parts(self) -> (Vec<u8>, PublicKeyBytes, SignatureBytes) {
        (self.payload, self.signer, self.signature)
    }
}

impl<T: Message> Wire for Signed<T> {
    const KIND: &'static str = T::KIND;
    const VERSION: u16 = 1;
    const MAX_SIZE: usize = T::MAX_SIZE + ENVELOPE_OVERHEAD;
}

impl<T> Clone for Signed<T> {
    fn clone(&self) -> Self {
        Self {
            payload: self.payload.clone(),
            signer: self.signer,
            signature: self.signature,
            kind: PhantomData,
        }
    }
}

impl<T> PartialEq for Signed<T> {
    fn eq(&self, other: &Self) -> bool {
        self.payload == other.payload
            && self.signer == other.signer
            && self.signature == other.signature
    }
}

impl<T> Eq for Signed<T> {}

impl<T> std::fmt::Debug for Signed<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signed")
            .field("payload_len", &self.payload.len())
            .field("signer", &self.signer)
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "arbitrary")]
impl<T: Message + proptest::arbitrary::Arbitrary + 'static> proptest::arbitrary::Arbitrary
    for Signed<T>
{
    type Parameters = ();
    type Strategy = proptest::strategy::BoxedStrategy<Self>;
    fn arbitrary_with(_: ()) -> Self::Strategy {
        use proptest::strategy::Strategy;
        (
            proptest::arbitrary::any::<[u8; 32]>(),
            proptest::arbitrary::any::<T>(),
        )
            .prop_map(|(seed, body)| Signed::sign(&Keypair::from_secret(seed), &body))
            .boxed()
    }
}
