//! `docs/protocol.md` names every field and enum value that appears on the wire. The names
//! are collected from real encodings of many arbitrary values of every message, so a field
//! added to a type without a line in the spec fails here.

use std::collections::BTreeSet;

use cannabis_protocol::*;
use cbor4ii::core::Value;
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::TestRunner;

fn collect(v: &Value, names: &mut BTreeSet<String>) {
    match v {
        Value::Map(entries) => {
            for (k, v) in entries {
                if let Value::Text(k) = k {
                    names.insert(k.clone());
                }
                collect(v, names);
            }
        }
        Value::Array(items) => items.iter().for_each(|i| collect(i, names)),
        _ => {}
    }
}

fn variant_names<T: serde::Serialize + proptest::arbitrary::Arbitrary>(
    runner: &mut TestRunner,
    names: &mut BTreeSet<String>,
) {
    let strategy = proptest::arbitrary::any::<T>();
    for _ in 0..64 {
        let value = strategy.new_tree(runner).unwrap().current();
        match cbor4ii::serde::from_slice::<Value>(&to_canonical(&value)).unwrap() {
            Value::Text(t) => {
                names.insert(t);
            }
            Value::Map(entries) => {
                for (k, _) in entries {
                    if let Value::Text(k) = k {
                        names.insert(k);
                    }
                }
            }
            other => panic!("enum encoded as {other:?}"),
        }
    }
}

fn names_of<T: Wire + proptest::arbitrary::Arbitrary>(
    runner: &mut TestRunner,
    fields: &mut BTreeSet<String>,
) {
    let strategy = proptest::arbitrary::any::<T>();
    for _ in 0..48 {
        let value = strategy.new_tree(runner).unwrap().current();
        let v: Value = cbor4ii::serde::from_slice(&to_canonical(&value)).unwrap();
        collect(&v, fields);
    }
}

#[test]
fn protocol_doc_names_every_field_and_variant() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/protocol.md"))
        .expect("docs/protocol.md exists");
    let mut runner = TestRunner::deterministic();
    let mut fields = BTreeSet::new();
    let mut variants = BTreeSet::new();
    names_of::<CapabilityAd>(&mut runner, &mut fields);
    names_of::<JobOffer>(&mut runner, &mut fields);
    names_of::<Bid>(&mut runner, &mut fields);
    names_of::<ChallengePass>(&mut runner, &mut fields);
    names_of::<Decline>(&mut runner, &mut fields);
    names_of::<Award>(&mut runner, &mut fields);
    names_of::<LeaseAccept>(&mut runner, &mut fields);
    names_of::<LeaseRenewal>(&mut runner, &mut fields);
    names_of::<Cancel>(&mut runner, &mut fields);
    names_of::<DeliveryManifest>(&mut runner, &mut fields);
    names_of::<ComputeResult>(&mut runner, &mut fields);
    names_of::<Transaction>(&mut runner, &mut fields);
    names_of::<BlockHeader>(&mut runner, &mut fields);
    names_of::<Signed<Bid>>(&mut runner, &mut fields);
    names_of::<SyncResponse>(&mut runner, &mut fields);
    variant_names::<AdapterKind>(&mut runner, &mut variants);
    variant_names::<GpuVendor>(&mut runner, &mut variants);
    variant_names::<Collective>(&mut runner, &mut variants);
    variant_names::<IsolationLayer>(&mut runner, &mut variants);
    variant_names::<AttestationKind>(&mut runner, &mut variants);
    variant_names::<OutputRights>(&mut runner, &mut variants);
    variant_names::<Comparison>(&mut runner, &mut variants);
    variant_names::<TaskInput>(&mut runner, &mut variants);
    variant_names::<TxPayload>(&mut runner, &mut variants);
    variant_names::<Outcome>(&mut runner, &mut variants);
    variant_names::<MarketRequest>(&mut runner, &mut variants);
    variant_names::<MarketResponse>(&mut runner, &mut variants);
    variant_names::<SyncRequest>(&mut runner, &mut variants);
    assert!(fields.len() > 100, "collected only {} names", fields.len());
    assert!(
        variants.len() > 40,
        "collected only {} variants",
        variants.len()
    );
    let missing: Vec<_> = fields
        .iter()
        .chain(variants.iter())
        .filter(|n| !doc.contains(&format!("`{n}`")) && !doc.contains(&format!("`{n} ")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/protocol.md does not mention: {missing:?}"
    );

    // Every domain string is in the spec.
    for domain in [
        <CapabilityAd as Message>::DOMAIN,
        <JobOffer as Message>::DOMAIN,
        <Bid as Message>::DOMAIN,
        <ChallengePass as Message>::DOMAIN,
        <Decline as Message>::DOMAIN,
        <Award as Message>::DOMAIN,
        <LeaseAccept as Message>::DOMAIN,
        <LeaseRenewal as Message>::DOMAIN,
        <Cancel as Message>::DOMAIN,
        <DeliveryManifest as Message>::DOMAIN,
        <Transaction as Message>::DOMAIN,
        <BlockHeader as Message>::DOMAIN,
        COMPUTE_RESULT_DOMAIN,
    ] {
        assert!(
            doc.contains(&format!("`{domain}`")),
            "{domain} missing from docs/protocol.md"
        );
    }
}
