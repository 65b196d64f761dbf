//! Property tests. The seed of a failing case is printed by proptest and saved under
//! `proptest-regressions/`.

use cannabis_protocol::*;
use proptest::prelude::*;

/// Round trip, size cap and "only canonical bytes decode" for one wire type.
fn check_round_trip<T: Wire + PartialEq + std::fmt::Debug>(value: &T) -> Result<(), TestCaseError> {
    let bytes = encode(value);
    match decode::<T>(&bytes) {
        Ok(back) => {
            prop_assert!(bytes.len() <= T::MAX_SIZE);
            prop_assert_eq!(&back, value);
        }
        Err(DecodeError::TooLarge { size, limit, .. }) => {
            prop_assert!(bytes.len() > T::MAX_SIZE);
            prop_assert_eq!((size, limit), (bytes.len(), T::MAX_SIZE));
            // Under a larger cap it still round-trips.
            let back = decode_with_limit::<T>(&bytes, usize::MAX)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&back, value);
        }
        Err(e) => {
            return Err(TestCaseError::fail(format!(
                "{} failed to decode: {e}",
                T::KIND
            )));
        }
    }
    Ok(())
}

/// Whatever the bytes, decoding returns (never panics), and anything accepted is canonical.
fn check_arbitrary_bytes<T: Wire>(bytes: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(v) = decode::<T>(bytes) {
        prop_assert_eq!(encode(&v), bytes.to_vec());
    }
    Ok(())
}

/// Mutating one byte of a valid encoding either fails to decode or decodes to a value whose
/// encoding is exactly the mutated bytes (so no two byte strings decode to one value).
fn check_mutation<T: Wire>(
    value: &T,
    index: prop::sample::Index,
    delta: u8,
) -> Result<(), TestCaseError> {
    let mut bytes = encode(value);
    let i = index.index(bytes.len());
    bytes[i] ^= delta;
    check_arbitrary_bytes::<T>(&bytes)
}

macro_rules! wire_properties {
    ($($name:ident: $ty:ty, $cases:expr;)*) => {$(
        mod $name {
            use super::*;
            proptest! {
                #![proptest_config(ProptestConfig::with_cases($cases))]

                #[test]
                fn round_trip(v in any::<$ty>()) {
                    check_round_trip(&v)?;
                }

                #[test]
                fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
                    check_arbitrary_bytes::<$ty>(&bytes)?;
                }

                #[test]
                fn mutated_encodings_are_refused_or_canonical(
                    v in any::<$ty>(),
                    index in any::<prop::sample::Index>(),
                    delta in 1u8..=255,
                ) {
                    check_mutation(&v, index, delta)?;
                }
            }
        }
    )*};
}

wire_properties! {
    capability_ad: CapabilityAd, 48;
    job_offer: JobOffer, 32;
    bid: Bid, 128;
    challenge_pass: ChallengePass, 128;
    decline: Decline, 128;
    award: Award, 64;
    lease_accept: LeaseAccept, 128;
    lease_renewal: LeaseRenewal, 128;
    cancel: Cancel, 128;
    delivery_manifest: DeliveryManifest, 32;
    compute_result: ComputeResult, 128;
    transaction: Transaction, 64;
    block_header: BlockHeader, 128;
    block: Block, 16;
    signed_bid: Signed<Bid>, 64;
    signed_offer: Signed<JobOffer>, 16;
    signed_tx: Signed<Transaction>, 32;
    market_request: MarketRequest, 48;
    market_response: MarketResponse, 64;
    sync_request: SyncRequest, 64;
    sync_response: SyncResponse, 8;
    challenge_request: ChallengeRequest, 64;
    challenge_response: ChallengeResponse, 32;
    ledger_request: LedgerRequest, 32;
    ledger_response: LedgerResponse, 8;
}

/// Any single-byte change to a signed envelope's wire bytes makes it fail: to decode, or to
/// verify. Checked for every signed message kind.
fn check_tamper<T: Message + PartialEq + std::fmt::Debug>(
    seed: [u8; 32],
    body: &T,
    index: prop::sample::Index,
    delta: u8,
) -> Result<(), TestCaseError> {
    let keys = Keypair::from_secret(seed);
    let signed = Signed::sign(&keys, body);
    let mut wire = signed.to_bytes();
    // A received message keeps the body and the signature, not the bytes: it gives back
    // exactly the bytes that arrived, and its signature checks over them.
    if let Ok(Ok(received)) = Signed::<T>::from_bytes(&wire).map(Signed::open) {
        prop_assert!(received.signed().to_bytes() == wire);
        prop_assert!(received.check_signature().is_ok());
        prop_assert_eq!(received.size(), signed.payload().len());
    }
    let i = index.index(wire.len());
    wire[i] ^= delta;
    let outcome = Signed::<T>::from_bytes(&wire).map(|s| s.verify());
    prop_assert!(
        !matches!(outcome, Ok(Ok(_))),
        "byte {i} changed by {delta:#x} still verifies"
    );
    // The same holds for the payload alone, re-wrapped with the original signature.
    let (mut payload, signer, signature) = signed.into_parts();
    let j = index.index(payload.len());
    payload[j] ^= delta;
    let rewrapped = Signed::<T>::from_parts(payload, signer, signature);
    prop_assert!(matches!(
        rewrapped.verify(),
        Err(OpenError::BadSignature(_))
    ));
    Ok(())
}

macro_rules! tamper_properties {
    ($($name:ident: $ty:ty;)*) => {
        proptest! {
            #![proptest_config(ProptestConfig::with_cases(48))]
            $(
                #[test]
                fn $name(
                    seed in any::<[u8; 32]>(),
                    body in any::<$ty>(),
                    index in any::<prop::sample::Index>(),
                    delta in 1u8..=255,
                ) {
                    check_tamper(seed, &body, index, delta)?;
                }
            )*
        }
    };
}

tamper_properties! {
    tamper_capability_ad: CapabilityAd;
    tamper_job_offer: JobOffer;
    tamper_bid: Bid;
    tamper_challenge_pass: ChallengePass;
    tamper_decline: Decline;
    tamper_award: Award;
    tamper_lease_accept: LeaseAccept;
    tamper_lease_renewal: LeaseRenewal;
    tamper_cancel: Cancel;
    tamper_delivery_manifest: DeliveryManifest;
    tamper_transaction: Transaction;
    tamper_block_header: BlockHeader;
}

proptest! {
    #[test]
    fn compute_result_signature_breaks_on_any_change(
        seed in any::<[u8; 32]>(),
        task in any::<Uuid>(),
        hash in any::<Digest>(),
        nonce in any::<Option<u64>>(),
        index in any::<prop::sample::Index>(),
        delta in 1u8..=255,
    ) {
        let keys = Keypair::from_secret(seed);
        let r = ComputeResult::signed(&keys, task, hash, None, nonce);
        prop_assert!(r.verify().is_ok());
        let mut bytes = encode(&r);
        let i = index.index(bytes.len());
        bytes[i] ^= delta;
        if let Ok(changed) = decode::<ComputeResult>(&bytes) {
            prop_assert!(changed.verify().is_err(), "byte {} changed still verifies", i);
        }
    }
}

fn special_amount() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(99),
        Just(100),
        Just(101),
        Just(u64::MAX),
        Just(u64::MAX - 1),
        any::<u64>(),
        0u64..1_000_000,
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn every_outcome_balances_exactly(
        locked in special_amount(),
        price_seed in special_amount(),
        outcome in any::<Outcome>(),
        rate_bps in prop_oneof![Just(FOUNDER_FEE_BPS), Just(0u16), Just(10_000u16), 0u16..=10_000],
    ) {
        let locked = Amount(locked);
        let price = Amount(price_seed.min(locked.0));
        match Split::settle(locked, price, outcome, rate_bps) {
            Ok(s) => {
                prop_assert!(s.balances());
                prop_assert_eq!(
                    u128::from(s.worker_paid.0) + u128::from(s.fee_paid.0) + u128::from(s.refunded.0),
                    u128::from(locked.0)
                );
                let paid = s.worker_paid.0 + s.fee_paid.0;
                prop_assert!(paid <= price.0);
                prop_assert_eq!(s.fee_paid, fee_on(Amount(paid), rate_bps).unwrap());
                if matches!(outcome, Outcome::Rejected | Outcome::Cancelled | Outcome::Expired) {
                    prop_assert_eq!(s.refunded, locked);
                    prop_assert_eq!(s.fee_paid, Amount::ZERO);
                }
                if matches!(outcome, Outcome::Accepted | Outcome::ReviewWindowElapsed) {
                    prop_assert_eq!(paid, price.0);
                }
            }
            Err(MoneyError::Fraction(ppm)) => prop_assert!(ppm > PPM_DENOMINATOR),
            Err(MoneyError::AwardAbovePrice { award, price: p }) => prop_assert!(award > p),
            Err(e) => return Err(TestCaseError::fail(format!("unexpected {e}"))),
        }
    }

    #[test]
    fn quote_shows_budget_share_and_fee(total in special_amount()) {
        let q = Quote::for_budget(Amount(total), FOUNDER_FEE_BPS).unwrap();
        prop_assert_eq!(u128::from(q.worker_share.0) + u128::from(q.fee.0), u128::from(total));
        prop_assert_eq!(u128::from(q.fee.0), u128::from(total) / 100);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn merkle_proofs_verify_for_every_leaf_and_fail_when_altered(
        leaves in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..40), 1..70),
        pick in any::<prop::sample::Index>(),
        delta in 1u8..=255,
    ) {
        let root = merkle::root(&leaves);
        for (i, leaf) in leaves.iter().enumerate() {
            let proof = merkle::prove(&leaves, i).unwrap();
            prop_assert_eq!(proof.verify(leaf, &root), Ok(()));
        }
        let i = pick.index(leaves.len());
        let proof = merkle::prove(&leaves, i).unwrap();
        // A changed path element.
        if !proof.path.is_empty() {
            let mut p = proof.clone();
            let k = pick.index(p.path.len());
            p.path[k].0[0] ^= delta;
            prop_assert!(p.verify(&leaves[i], &root).is_err());
        }
        // A changed leaf.
        let mut leaf = leaves[i].clone();
        leaf.push(delta);
        prop_assert!(proof.verify(&leaf, &root).is_err());
        // Another index. (The tree size is not authenticated by the path: verifiers take it
        // from the signed block header, as RFC 9162 takes it from the signed tree head.)
        // A proof moved to an index that holds an identical leaf in an identical
        // position is as valid as the real one there (`[x, x]`), so only other leaves count.
        let mut p = proof.clone();
        p.index = (p.index + 1) % (p.tree_size + 1);
        let same_leaf = leaves.get(p.index as usize) == Some(&leaves[i]);
        if !same_leaf {
            prop_assert!(p.verify(&leaves[i], &root).is_err());
        }
        // A different root.
        let mut other = root;
        other.0[31] ^= delta;
        prop_assert!(proof.verify(&leaves[i], &other).is_err());
    }
}
