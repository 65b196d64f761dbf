//! The private channel between two ranks of a group: Noise
//! (`Noise_KKpsk0_25519_ChaChaPoly_BLAKE2s`, with the `snow` crate), sans-IO.
//!
//! Each member's static key is pinned by the award's roster: a member's Noise static key
//! is its ed25519 node key in X25519 form (the public key by the birational map of RFC
//! 7748, the secret as the clamped SHA-512 of the seed, as libsodium's
//! `crypto_sign_ed25519_*_to_curve25519`), so the roster's addresses are all a member needs
//! to know. KK: both sides know the other's static key before the first message, so a
//! peer that is not the roster's member for its rank cannot complete the handshake. The
//! pre-shared key (position 0) is derived from the rendezvous id and the epoch, and the
//! prologue binds the whole roster: a handshake of one group attempt never completes in
//! another, or at another epoch.
//!
//! Two messages (`-> psk, e, es, ss` then `<- e, ee, se`), then transport messages, each
//! at most [`MAX_MESSAGE`] bytes on the wire. The caller moves the bytes (over the swarm)
//! and passes in the randomness the ephemeral key is made of: nothing here reads a socket,
//! a clock or the system's random source.

use sha2::{Digest as _, Sha256, Sha512};
use snow::params::NoiseParams;
use snow::resolvers::{CryptoResolver, DefaultResolver, RingResolver};
use snow::types::{Cipher, Dh, Hash, Random};
use zeroize::Zeroizing;

use crate::Rendezvous;
use crate::identity::{Address, Keypair};

/// The Noise protocol name.
pub const PATTERN: &str = "Noise_KKpsk0_25519_ChaChaPoly_BLAKE2s";

/// The domain of the pre-shared key ([`psk`]).
pub const PSK_DOMAIN: &str = "cannabis/channel-psk/v1";

/// The domain of the prologue ([`prologue`]).
pub const PROLOGUE_DOMAIN: &str = "cannabis/channel/v1";

/// The largest Noise message (the Noise limit).
pub const MAX_MESSAGE: usize = 65_535;

/// The largest plaintext one transport message carries (the message less its 16-byte tag).
pub const MAX_PLAINTEXT: usize = MAX_MESSAGE - 16;

/// Why a channel could not be set up or a message not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChannelError {
    /// This node, or the peer, holds no rank in the roster.
    #[error("{0} holds no rank in this group's roster")]
    NotInRoster(Address),
    /// An address whose key has no X25519 form (not a valid ed25519 point).
    #[error("{0} has no usable key")]
    BadKey(Address),
    /// The handshake or a transport message failed: a wrong key, pre-shared key, roster,
    /// epoch, or a message tampered with, replayed or out of order.
    #[error("noise: {0}")]
    Noise(String),
    /// A message over [`MAX_MESSAGE`] (or a payload over [`MAX_PLAINTEXT`]).
    #[error("a message of {0} bytes is over the channel's limit")]
    TooLarge(usize),
}

impl From<snow::Error> for ChannelError {
    fn from(e: snow::Error) -> Self {
        Self::Noise(e.to_string())
    }
}

/// A member's Noise static public key: its address's ed25519 key in X25519 form.
pub fn static_public(address: &Address) -> Result<[u8; 32], ChannelError> {
    let key = ed25519_dalek::VerifyingKey::from_bytes(address.public_key())
        .map_err(|_| ChannelError::BadKey(*address))?;
    Ok(key.to_montgomery().to_bytes())
}

/// This node's Noise static secret: its signing key's scalar (the clamped first half of
/// SHA-512 of the seed), the secret of [`static_public`] of its address.
pub fn static_secret(keys: &Keypair) -> Zeroizing<[u8; 32]> {
    let seed = keys.secret();
    let h = Sha512::digest(seed.as_slice());
    let mut s = Zeroizing::new([0u8; 32]);
    s.copy_from_slice(&h[..32]);
    s[0] &= 248;
    s[31] &= 127;
    s[31] |= 64;
    s
}

/// The pre-shared key of a group attempt: `SHA-256("cannabis/channel-psk/v1" || id ||
/// u64_le(epoch))`, unique to the rendezvous id and the epoch.
pub fn psk(rendezvous: &Rendezvous, epoch: u64) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(PSK_DOMAIN.as_bytes());
    h.update(rendezvous.id.0);
    h.update(epoch.to_le_bytes());
    h.finalize().into()
}

/// The prologue both sides mix in: `SHA-256("cannabis/channel/v1" || id || u64_le(epoch)
/// || for each roster entry in order: u32_le(rank) || its 32-byte key)`.
pub fn prologue(rendezvous: &Rendezvous, epoch: u64) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(PROLOGUE_DOMAIN.as_bytes());
    h.update(rendezvous.id.0);
    h.update(epoch.to_le_bytes());
    for e in &rendezvous.roster {
        h.update(e.rank.to_le_bytes());
        h.update(e.worker.public_key());
    }
    h.finalize().into()
}

/// Randomness from a seed the caller gives (a ChaCha20 stream), for the ephemeral key.
struct Seeded(chacha20::ChaCha20);

impl Random for Seeded {
    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), snow::Error> {
        use chacha20::cipher::StreamCipher as _;
        dest.fill(0);
        self.0.apply_keystream(dest);
        Ok(())
    }
}

/// snow's own X25519 and BLAKE2s, ring's ChaChaPoly (the same cipher, assembly-optimised:
/// 2.4 against 1.5 GB/s for snow's own on 65,000-byte messages, on the machine of
/// docs/benchmarks.md), with the caller's randomness. (`ring: false`: snow's own
/// ChaChaPoly, which a peer may use: the wire is the same.)
struct Resolver {
    random: Zeroizing<[u8; 32]>,
    ring: bool,
}

impl CryptoResolver for Resolver {
    fn resolve_rng(&self) -> Option<Box<dyn Random>> {
        use chacha20::cipher::KeyIvInit as _;
        let key: [u8; 32] = *self.random;
        Some(Box::new(Seeded(chacha20::ChaCha20::new(
            &key.into(),
            &[0u8; 12].into(),
        ))))
    }
    fn resolve_dh(&self, choice: &snow::params::DHChoice) -> Option<Box<dyn Dh>> {
        DefaultResolver.resolve_dh(choice)
    }
    fn resolve_hash(&self, choice: &snow::params::HashChoice) -> Option<Box<dyn Hash>> {
        DefaultResolver.resolve_hash(choice)
    }
    fn resolve_cipher(&self, choice: &snow::params::CipherChoice) -> Option<Box<dyn Cipher>> {
        if self.ring {
            RingResolver.resolve_cipher(choice)
        } else {
            DefaultResolver.resolve_cipher(choice)
        }
    }
}

/// One side of a channel's handshake.
pub struct Handshake {
    state: snow::HandshakeState,
    peer: Address,
}

impl std::fmt::Debug for Handshake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Handshake(with {})", self.peer)
    }
}

impl Handshake {
    /// This node's side of a handshake with `peer` in the group attempt `rendezvous` at
    /// `epoch`: the initiator (a rank above 0 dials rank 0) or the responder. `random`:
    /// fresh secret randomness for the ephemeral key. Refused when either side holds no
    /// rank in the roster.
    pub fn new(
        keys: &Keypair,
        peer: &Address,
        rendezvous: &Rendezvous,
        epoch: u64,
        initiator: bool,
        random: [u8; 32],
    ) -> Result<Self, ChannelError> {
        let resolver = Resolver {
            random: Zeroizing::new(random),
            ring: true,
        };
        Self::with_resolver(keys, peer, rendezvous, epoch, initiator, resolver)
    }

    fn with_resolver(
        keys: &Keypair,
        peer: &Address,
        rendezvous: &Rendezvous,
        epoch: u64,
        initiator: bool,
        resolver: Resolver,
    ) -> Result<Self, ChannelError> {
        let me = keys.address();
        for who in [&me, peer] {
            if !rendezvous.roster.iter().any(|e| e.worker == *who) {
                return Err(ChannelError::NotInRoster(*who));
            }
        }
        let params: NoiseParams = PATTERN.parse()?;
        let secret = static_secret(keys);
        let remote = static_public(peer)?;
        let psk = psk(rendezvous, epoch);
        let prologue = prologue(rendezvous, epoch);
        let builder = snow::Builder::with_resolver(params, Box::new(resolver))
            .local_private_key(secret.as_slice())?
            .remote_public_key(&remote)?
            .psk(0, &psk)?
            .prologue(&prologue)?;
        let state = if initiator {
            builder.build_initiator()?
        } else {
            builder.build_responder()?
        };
        Ok(Self { state, peer: *peer })
    }

    /// The peer this handshake is with.
    pub fn peer(&self) -> &Address {
        &self.peer
    }

    /// Whether it is this side's turn to write.
    pub fn is_my_turn(&self) -> bool {
        self.state.is_my_turn()
    }

    /// Whether both messages went.
    pub fn is_finished(&self) -> bool {
        self.state.is_handshake_finished()
    }

    /// The next handshake message to send.
    pub fn write(&mut self) -> Result<Vec<u8>, ChannelError> {
        let mut buf = vec![0u8; MAX_MESSAGE];
        let n = self.state.write_message(&[], &mut buf)?;
        buf.truncate(n);
        Ok(buf)
    }

    /// Reads the peer's handshake message.
    pub fn read(&mut self, message: &[u8]) -> Result<(), ChannelError> {
        if message.len() > MAX_MESSAGE {
            return Err(ChannelError::TooLarge(message.len()));
        }
        let mut buf = vec![0u8; MAX_MESSAGE];
        self.state.read_message(message, &mut buf)?;
        Ok(())
    }

    /// The channel, once both messages went.
    pub fn finish(self) -> Result<Channel, ChannelError> {
        let peer = self.peer;
        Ok(Channel {
            state: self.state.into_transport_mode()?,
            peer,
        })
    }
}

/// An established channel: messages sealed to the peer and opened from it, in order.
pub struct Channel {
    state: snow::TransportState,
    peer: Address,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Channel(with {})", self.peer)
    }
}

impl Channel {
    /// The peer.
    pub fn peer(&self) -> &Address {
        &self.peer
    }

    /// Seals `plaintext` (at most [`MAX_PLAINTEXT`] bytes) into one message.
    pub fn seal(&mut self, plaintext: &[u8]) -> Result<Vec<u8>, ChannelError> {
        let mut buf = Vec::new();
        self.seal_into(plaintext, &mut buf)?;
        Ok(buf)
    }

    /// Seals `plaintext` (at most [`MAX_PLAINTEXT`] bytes) into one message appended to
    /// `out`: its length.
    pub fn seal_into(
        &mut self,
        plaintext: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<usize, ChannelError> {
        if plaintext.len() > MAX_PLAINTEXT {
            return Err(ChannelError::TooLarge(plaintext.len()));
        }
        let at = out.len();
        out.resize(at + plaintext.len() + 16, 0);
        match self.state.write_message(plaintext, &mut out[at..]) {
            Ok(n) => {
                out.truncate(at + n);
                Ok(n)
            }
            Err(e) => {
                out.truncate(at);
                Err(e.into())
            }
        }
    }

    /// Opens the peer's next message: fails on anything tampered with, replayed or out of
    /// order. After a message fails, so does every later one (the nonces no longer agree):
    /// the caller ends the channel.
    pub fn open(&mut self, message: &[u8]) -> Result<Vec<u8>, ChannelError> {
        if message.len() > MAX_MESSAGE {
            return Err(ChannelError::TooLarge(message.len()));
        }
        let mut buf = vec![0u8; message.len()];
        let n = self.state.read_message(message, &mut buf)?;
        buf.truncate(n);
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RosterEntry, Uuid};

    fn keys(n: u8) -> Keypair {
        Keypair::from_secret([n; 32])
    }

    fn group(members: &[&Keypair]) -> Rendezvous {
        Rendezvous {
            id: Uuid::from_random([9; 16]),
            roster: members
                .iter()
                .enumerate()
                .map(|(i, k)| RosterEntry {
                    rank: i as u32,
                    worker: k.address(),
                })
                .collect(),
        }
    }

    /// Runs a handshake between `a` (initiator) and `b`; the two channels.
    fn handshake(mut a: Handshake, mut b: Handshake) -> Result<(Channel, Channel), ChannelError> {
        let m1 = a.write()?;
        b.read(&m1)?;
        let m2 = b.write()?;
        a.read(&m2)?;
        assert!(a.is_finished() && b.is_finished());
        Ok((a.finish()?, b.finish()?))
    }

    #[test]
    fn the_x25519_forms_of_two_node_keys_agree() {
        use x25519_dalek::{PublicKey, StaticSecret};
        let (a, b) = (keys(1), keys(2));
        let sa = StaticSecret::from(*static_secret(&a));
        let sb = StaticSecret::from(*static_secret(&b));
        assert_eq!(
            PublicKey::from(&sa).to_bytes(),
            static_public(&a.address()).unwrap()
        );
        let ab = sa.diffie_hellman(&PublicKey::from(static_public(&b.address()).unwrap()));
        let ba = sb.diffie_hellman(&PublicKey::from(static_public(&a.address()).unwrap()));
        assert_eq!(ab.to_bytes(), ba.to_bytes());
    }

    #[test]
    fn two_members_of_the_roster_talk_privately_in_order() {
        let (r0, r1) = (keys(1), keys(2));
        let g = group(&[&r0, &r1]);
        let a = Handshake::new(&r1, &r0.address(), &g, 3, true, [5; 32]).unwrap();
        let b = Handshake::new(&r0, &r1.address(), &g, 3, false, [6; 32]).unwrap();
        let (mut a, mut b) = handshake(a, b).unwrap();
        let sealed = a.seal(b"MASTER_PORT=29500").unwrap();
        assert!(!sealed.windows(6).any(|w| w == b"MASTER"));
        assert_eq!(b.open(&sealed).unwrap(), b"MASTER_PORT=29500");
        let back = b.seal(&[7; MAX_PLAINTEXT]).unwrap();
        assert_eq!(back.len(), MAX_MESSAGE);
        assert_eq!(a.open(&back).unwrap(), vec![7; MAX_PLAINTEXT]);
        // A replay is refused, and the channel goes on.
        let one = a.seal(b"one").unwrap();
        assert_eq!(b.open(&one).unwrap(), b"one");
        assert!(b.open(&one).is_err(), "a replay is refused");
        let two = a.seal(b"two").unwrap();
        assert_eq!(b.open(&two).unwrap(), b"two");
        // A message tampered with is refused, and so is everything after it: the caller
        // ends the channel (its transport is ordered and reliable, so this is an attack).
        let mut bad = a.seal(b"x").unwrap();
        bad[0] ^= 1;
        assert!(b.open(&bad).is_err());
        let after = a.seal(b"after").unwrap();
        assert!(b.open(&after).is_err());
        assert!(matches!(
            a.seal(&vec![0; MAX_PLAINTEXT + 1]),
            Err(ChannelError::TooLarge(_))
        ));
    }

    #[test]
    fn a_peer_with_another_chachapoly_implementation_talks_to_this_one() {
        // ring's ChaChaPoly here, snow's own (RustCrypto) there: the same standard cipher,
        // so the same bytes on the wire.
        let (r0, r1) = (keys(1), keys(2));
        let g = group(&[&r0, &r1]);
        let a = Handshake::new(&r1, &r0.address(), &g, 3, true, [5; 32]).unwrap();
        let other = Resolver {
            random: Zeroizing::new([6; 32]),
            ring: false,
        };
        let b = Handshake::with_resolver(&r0, &r1.address(), &g, 3, false, other).unwrap();
        let (mut a, mut b) = handshake(a, b).unwrap();
        for n in [0, 1, 1500, MAX_PLAINTEXT] {
            let m = vec![n as u8; n];
            assert_eq!(b.open(&a.seal(&m).unwrap()).unwrap(), m);
            assert_eq!(a.open(&b.seal(&m).unwrap()).unwrap(), m);
        }
    }

    #[test]
    fn a_key_outside_the_roster_a_wrong_key_or_another_epoch_fails_the_handshake() {
        let (r0, r1, stranger) = (keys(1), keys(2), keys(3));
        let g = group(&[&r0, &r1]);
        // Nobody sets up a channel with a peer outside the roster, nor outside it itself.
        assert_eq!(
            Handshake::new(&r0, &stranger.address(), &g, 1, false, [1; 32]).unwrap_err(),
            ChannelError::NotInRoster(stranger.address())
        );
        assert!(Handshake::new(&stranger, &r0.address(), &g, 1, true, [1; 32]).is_err());
        // A stranger that claims rank 1's place (its own key, rank 1 pinned): rank 0 fails
        // to read its first message.
        let forged = {
            // The stranger's view: a roster naming it where rank 1 is.
            let mut g2 = g.clone();
            g2.roster[1].worker = stranger.address();
            Handshake::new(&stranger, &r0.address(), &g2, 1, true, [2; 32]).unwrap()
        };
        let honest = Handshake::new(&r0, &r1.address(), &g, 1, false, [3; 32]).unwrap();
        assert!(handshake(forged, honest).is_err());
        // The right keys at another epoch (or another group attempt): no channel.
        let a = Handshake::new(&r1, &r0.address(), &g, 1, true, [4; 32]).unwrap();
        let b = Handshake::new(&r0, &r1.address(), &g, 2, false, [5; 32]).unwrap();
        assert!(handshake(a, b).is_err());
        let mut other = g.clone();
        other.id = Uuid::from_random([8; 16]);
        let a = Handshake::new(&r1, &r0.address(), &g, 1, true, [4; 32]).unwrap();
        let b = Handshake::new(&r0, &r1.address(), &other, 1, false, [5; 32]).unwrap();
        assert!(handshake(a, b).is_err());
    }

    #[test]
    fn the_ephemeral_key_comes_from_the_callers_randomness() {
        let (r0, r1) = (keys(1), keys(2));
        let g = group(&[&r0, &r1]);
        let first = |random| {
            Handshake::new(&r1, &r0.address(), &g, 1, true, random)
                .unwrap()
                .write()
                .unwrap()
        };
        assert_eq!(first([1; 32]), first([1; 32]));
        assert_ne!(first([1; 32]), first([2; 32]));
    }
}
