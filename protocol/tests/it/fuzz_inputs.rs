//! The fuzz targets' inputs in the normal test suite: every input under
//! `fuzz/regressions/wire/` (findings of `cargo fuzz run wire`, kept once fixed) goes through
//! the same decoders, as do arbitrary valid encodings of every kind. The ignored test writes
//! those encodings as the fuzzer's starting corpus (see docs/security.md, "Fuzzing").

use std::path::PathBuf;

use cannabis_protocol::fuzzing::{KINDS, decode_any};
use cannabis_protocol::*;
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::TestRunner;

fn fuzz_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

#[test]
fn every_kept_fuzz_finding_decodes_without_panicking() {
    let dir = fuzz_dir().join("regressions/wire");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        decode_any(&bytes);
        seen += 1;
    }
    assert!(seen > 0, "no regression inputs under {}", dir.display());
}

fn encodings<T: Message + proptest::arbitrary::Arbitrary>(
    kind: &str,
    runner: &mut TestRunner,
    signed: bool,
    keys: &Keypair,
    out: &mut Vec<Vec<u8>>,
) {
    let tag = KINDS.iter().position(|k| *k == kind).unwrap() as u8;
    let strategy = proptest::arbitrary::any::<T>();
    for _ in 0..4 {
        let value = strategy.new_tree(runner).unwrap().current();
        let bytes = if signed {
            Signed::sign(keys, &value).to_bytes()
        } else {
            encode(&value)
        };
        out.push([vec![tag], bytes].concat());
    }
}

fn corpus() -> Vec<Vec<u8>> {
    let mut runner = TestRunner::deterministic();
    let keys = Keypair::from_secret([3; 32]);
    let mut out = Vec::new();
    let r = &mut runner;
    encodings::<CapabilityAd>("capability-ad", r, true, &keys, &mut out);
    encodings::<JobOffer>("job-offer", r, true, &keys, &mut out);
    encodings::<Bid>("bid", r, true, &keys, &mut out);
    encodings::<Decline>("decline", r, true, &keys, &mut out);
    encodings::<Award>("award", r, true, &keys, &mut out);
    encodings::<LeaseAccept>("lease-accept", r, true, &keys, &mut out);
    encodings::<LeaseRenewal>("lease-renewal", r, true, &keys, &mut out);
    encodings::<Cancel>("cancel", r, true, &keys, &mut out);
    encodings::<ChallengePass>("challenge-pass", r, true, &keys, &mut out);
    encodings::<DeliveryManifest>("delivery-manifest", r, true, &keys, &mut out);
    encodings::<Transaction>("transaction", r, true, &keys, &mut out);
    let plain = |kind: &str, bytes: Vec<u8>| {
        let tag = KINDS.iter().position(|k| *k == kind).unwrap() as u8;
        [vec![tag], bytes].concat()
    };
    let bid = Signed::sign(
        &keys,
        &proptest::arbitrary::any::<Bid>()
            .new_tree(r)
            .unwrap()
            .current(),
    );
    out.push(plain("market-request", encode(&MarketRequest::Bid(bid))));
    out.push(plain(
        "market-request",
        encode(&MarketRequest::Ping { nonce: 7 }),
    ));
    out.push(plain("market-response", encode(&MarketResponse::Ack)));
    out.push(plain(
        "sync-request",
        encode(&SyncRequest::Ads { after: None }),
    ));
    let page = proptest::arbitrary::any::<SyncResponse>()
        .new_tree(r)
        .unwrap()
        .current();
    out.push(plain("sync-response", encode(&page)));
    out.push(plain(
        "challenge-request",
        encode(&ChallengeRequest {
            seed: Digest::of(b"s"),
            n: 8,
            rounds: 2,
        }),
    ));
    let c = challenge::Challenge::new(Digest::of(b"s"), 8, 2).unwrap();
    out.push(plain(
        "challenge-response",
        encode(&ChallengeResponse::answer(&c.prove())),
    ));
    let block = proptest::arbitrary::any::<Block>()
        .new_tree(r)
        .unwrap()
        .current();
    out.push(plain("block", encode(&block)));
    out
}

#[test]
fn valid_encodings_of_every_kind_decode_without_panicking() {
    for input in corpus() {
        decode_any(&input);
    }
}

/// `cargo test -p cannabis-protocol --test it write_fuzz_corpus -- --ignored` writes the
/// fuzzer's starting corpus to `fuzz/corpus/wire/`.
#[test]
#[ignore = "writes the fuzz corpus; run by hand before fuzzing"]
fn write_fuzz_corpus() {
    let dir = fuzz_dir().join("corpus/wire");
    std::fs::create_dir_all(&dir).unwrap();
    for (i, input) in corpus().into_iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i:03}")), input).unwrap();
    }
}
