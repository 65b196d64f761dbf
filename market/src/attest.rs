//! Confidential-execution evidence: which workers' attestations count on this node.
//!
//! A job that requires confidential execution goes only to workers whose ad carries
//! evidence that a [`Verifier`] for its kind accepts. This build has one verifier: the
//! `dev` attestation's, for testnets only. It proves nothing about the machine (anyone can
//! make it); it exists so that confidential jobs can be exercised end to end on a testnet,
//! and it is refused everywhere else. What a verifier for a real TEE must check is in
//! `docs/confidential.md`; evidence of a kind without a verifier never counts.

use std::fmt;

use cannabis_protocol::{Address, Attestation, AttestationKind, CapabilityAd};

/// The fixed part of a `dev` attestation's evidence; the worker's 32-byte public key
/// follows it.
pub const DEV_EVIDENCE_LABEL: &[u8] = b"cannabis dev attestation: INSECURE, for testnets only: ";

/// How a `dev` attestation is named wherever it is shown.
pub const DEV_INSECURE: &str = "dev (INSECURE: testnets only, proves nothing)";

/// The `dev` evidence of `worker`: the label, then its public key.
pub fn dev_evidence(worker: &Address) -> Vec<u8> {
    [DEV_EVIDENCE_LABEL, worker.public_key()].concat()
}

/// The `dev` attestation of `worker`.
pub fn dev_attestation(worker: &Address) -> Attestation {
    Attestation {
        kind: AttestationKind::Dev,
        evidence: dev_evidence(worker),
    }
}

/// Why an ad's evidence does not count here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttestError {
    /// The ad carries none.
    Missing,
    /// A `dev` attestation on a node that is not on a testnet.
    DevOutsideTestnet,
    /// No verifier for this kind in this build.
    NoVerifier(AttestationKind),
    /// The verifier refused it.
    Refused(AttestationKind, String),
}

impl fmt::Display for AttestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing => write!(f, "no confidential-execution evidence"),
            Self::DevOutsideTestnet => write!(
                f,
                "a dev attestation, which is insecure and counts on testnets only"
            ),
            Self::NoVerifier(kind) => write!(
                f,
                "{} evidence, which this build has no verifier for",
                kind_name(*kind)
            ),
            Self::Refused(kind, why) => write!(f, "{} evidence refused: {why}", kind_name(*kind)),
        }
    }
}

/// The kind's name on the wire (`dev`, `tdx`, `sev-snp`, `nvidia-cc`).
pub fn kind_name(kind: AttestationKind) -> &'static str {
    match kind {
        AttestationKind::Dev => "dev",
        AttestationKind::Tdx => "tdx",
        AttestationKind::SevSnp => "sev-snp",
        AttestationKind::NvidiaCc => "nvidia-cc",
    }
}

/// How an attestation is shown to people: a `dev` one always says it is insecure.
pub fn describe(a: &Attestation) -> &'static str {
    match a.kind {
        AttestationKind::Dev => DEV_INSECURE,
        kind => kind_name(kind),
    }
}

/// Checks one kind of evidence for the worker whose signed ad carries it. A verifier for a
/// TEE checks the evidence's signature chain to the vendor's root, the measurements against
/// approved ones, the debug and policy bits, freshness, and that the evidence binds the
/// worker's key (see `docs/confidential.md`); the ad's signature binds the rest of the ad.
pub trait Verifier {
    /// The kind it checks.
    fn kind(&self) -> AttestationKind;
    /// Whether `evidence` holds for `worker`.
    fn verify(&self, worker: &Address, evidence: &[u8]) -> Result<(), String>;
}

/// The `dev` attestation's verifier: the evidence is the label and the worker's key, so a
/// worker cannot carry another's. That is all it checks; it is insecure by design.
#[derive(Clone, Copy, Debug, Default)]
pub struct DevVerifier;

impl Verifier for DevVerifier {
    fn kind(&self) -> AttestationKind {
        AttestationKind::Dev
    }

    fn verify(&self, worker: &Address, evidence: &[u8]) -> Result<(), String> {
        // Matching runs this for every ad a confidential task meets: no allocation.
        match evidence.strip_prefix(DEV_EVIDENCE_LABEL) {
            Some(key) if key == worker.public_key() => Ok(()),
            Some(_) => Err("it names another worker's key".into()),
            None => Err("it is not a dev attestation's evidence".into()),
        }
    }
}

/// Which evidence counts on this node: a network setting, the same on every node of it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttestationPolicy {
    /// Whether this node is on a testnet, where `dev` attestations count. Never on a
    /// network that carries value.
    pub testnet: bool,
}

impl AttestationPolicy {
    /// The policy of a testnet: `dev` attestations count.
    pub fn testnet() -> Self {
        Self { testnet: true }
    }

    /// Whether any evidence can count here at all. When not, a job that requires
    /// confidential execution can go nowhere and is refused at once.
    pub fn verifies_any(&self) -> bool {
        self.testnet
    }

    /// What a confidential job is told when no evidence can count here.
    pub fn why_none(&self) -> &'static str {
        "this node verifies no confidential-execution evidence: this build has no verifier \
         for TEE evidence (tdx, sev-snp, nvidia-cc) yet, and dev attestations are insecure \
         and count on testnets only (docs/confidential.md)"
    }

    /// Whether `ad`'s evidence verifies here, and its kind if so.
    pub fn verify(&self, ad: &CapabilityAd) -> Result<AttestationKind, AttestError> {
        let a = ad.attestation.as_ref().ok_or(AttestError::Missing)?;
        match a.kind {
            AttestationKind::Dev if !self.testnet => Err(AttestError::DevOutsideTestnet),
            AttestationKind::Dev => DevVerifier
                .verify(&ad.node, &a.evidence)
                .map(|()| a.kind)
                .map_err(|why| AttestError::Refused(a.kind, why)),
            kind => Err(AttestError::NoVerifier(kind)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::{self, Machine};
    use cannabis_protocol::Timestamp;

    fn ad(n: u64, attestation: Option<Attestation>) -> CapabilityAd {
        let mut ad = testkit::ad(
            testkit::keys(n).address(),
            &Machine::default(),
            Timestamp(1),
        );
        ad.attestation = attestation;
        ad
    }

    #[test]
    fn a_dev_attestation_counts_on_a_testnet_only_and_only_for_its_own_worker() {
        let me = testkit::keys(1).address();
        let other = testkit::keys(2).address();
        let testnet = AttestationPolicy::testnet();
        let elsewhere = AttestationPolicy::default();

        let mine = ad(1, Some(dev_attestation(&me)));
        assert_eq!(testnet.verify(&mine), Ok(AttestationKind::Dev));
        assert_eq!(elsewhere.verify(&mine), Err(AttestError::DevOutsideTestnet));
        assert!(!elsewhere.verifies_any() && testnet.verifies_any());

        // Another worker's evidence copied into an ad does not count.
        let copied = ad(1, Some(dev_attestation(&other)));
        assert!(matches!(
            testnet.verify(&copied),
            Err(AttestError::Refused(AttestationKind::Dev, why)) if why.contains("another worker")
        ));
        let garbage = ad(
            1,
            Some(Attestation {
                kind: AttestationKind::Dev,
                evidence: b"trust me".to_vec(),
            }),
        );
        assert!(matches!(
            testnet.verify(&garbage),
            Err(AttestError::Refused(..))
        ));
        assert_eq!(testnet.verify(&ad(1, None)), Err(AttestError::Missing));
    }

    #[test]
    fn evidence_without_a_verifier_never_counts() {
        for kind in [
            AttestationKind::Tdx,
            AttestationKind::SevSnp,
            AttestationKind::NvidiaCc,
        ] {
            let a = ad(
                1,
                Some(Attestation {
                    kind,
                    evidence: vec![0; 64],
                }),
            );
            for policy in [AttestationPolicy::testnet(), AttestationPolicy::default()] {
                let e = policy.verify(&a).unwrap_err();
                assert_eq!(e, AttestError::NoVerifier(kind));
                assert!(e.to_string().contains(kind_name(kind)), "{e}");
            }
        }
    }

    #[test]
    fn a_dev_attestation_says_it_is_insecure() {
        let a = dev_attestation(&testkit::keys(1).address());
        assert!(describe(&a).contains("INSECURE"));
        assert!(a.evidence.starts_with(DEV_EVIDENCE_LABEL));
        assert!(
            AttestError::DevOutsideTestnet
                .to_string()
                .contains("insecure")
        );
    }
}
