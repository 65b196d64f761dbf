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
    names_of::<Evaluation>(&mut runner, &mut fields);
    names_of::<Transaction>(&mut runner, &mut fields);
    names_of::<BlockHeader>(&mut runner, &mut fields);
    names_of::<Signed<Bid>>(&mut runner, &mut fields);
    names_of::<SyncResponse>(&mut runner, &mut fields);
    names_of::<TransferRequest>(&mut runner, &mut fields);
    names_of::<TransferResponse>(&mut runner, &mut fields);
    names_of::<LedgerRequest>(&mut runner, &mut fields);
    names_of::<LedgerResponse>(&mut runner, &mut fields);
    variant_names::<AdapterKind>(&mut runner, &mut variants);
    variant_names::<GpuVendor>(&mut runner, &mut variants);
    variant_names::<Collective>(&mut runner, &mut variants);
    variant_names::<IsolationLayer>(&mut runner, &mut variants);
    variant_names::<AttestationKind>(&mut runner, &mut variants);
    variant_names::<OutputRights>(&mut runner, &mut variants);
    variant_names::<Comparison>(&mut runner, &mut variants);
    variant_names::<ArtifactFormat>(&mut runner, &mut variants);
    variant_names::<EvaluationOutcome>(&mut runner, &mut variants);
    variant_names::<TaskInput>(&mut runner, &mut variants);
    variant_names::<TxPayload>(&mut runner, &mut variants);
    variant_names::<Outcome>(&mut runner, &mut variants);
    variant_names::<MarketRequest>(&mut runner, &mut variants);
    variant_names::<MarketResponse>(&mut runner, &mut variants);
    variant_names::<SyncRequest>(&mut runner, &mut variants);
    variant_names::<TransferResponse>(&mut runner, &mut variants);
    variant_names::<LedgerRequest>(&mut runner, &mut variants);
    variant_names::<LedgerResponse>(&mut runner, &mut variants);
    variant_names::<ObjectKind>(&mut runner, &mut variants);
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
        <Evaluation as Message>::DOMAIN,
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

/// The group channel's names and its example pre-shared key, as the code computes them.
#[test]
fn the_group_channels_names_and_example_are_the_codes() {
    use cannabis_protocol::channel;
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/protocol.md"))
        .expect("docs/protocol.md exists");
    assert!(doc.contains(&format!("`{}`", channel::PATTERN)));
    for domain in [channel::PSK_DOMAIN, channel::PROLOGUE_DOMAIN] {
        assert!(
            doc.contains(&format!("\"{domain}\"")),
            "{domain} missing from docs/protocol.md"
        );
    }
    let r = cannabis_protocol::Rendezvous {
        id: "09090909-0909-4909-8909-090909090909".parse().unwrap(),
        roster: Vec::new(),
    };
    let psk = hex::encode(channel::psk(&r, 3));
    assert_eq!(
        psk,
        "c4c8d48f60c38774a211f1c7298a51714aa8a50c1efd00a8f2537c038afbf1ac"
    );
    assert!(doc.contains(&psk));
}

/// The examples of the spec's conventions, encoded by the code: the bytes they name are the
/// bytes the code writes.
#[test]
fn the_specs_examples_are_what_the_code_encodes() {
    let spec = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/protocol.md"),
    )
    .unwrap();
    let text = |v: &Value| match v {
        Value::Text(t) => t.clone(),
        other => panic!("not text: {other:?}"),
    };
    // A Uuid is its 36-character text, a CBOR text string.
    let uuid: Uuid = "550e8400-e29b-41d4-a716-446655440000".parse().unwrap();
    let bytes = to_canonical(&uuid);
    assert_eq!(&bytes[..2], &[0x78, 36], "a 36-byte text string");
    assert!(spec.contains("`550e8400-e29b-41d4-a716-446655440000`"));
    // Unit variants are kebab-case text.
    for (value, name) in [
        (to_canonical(&AdapterKind::Synthetic), "synthetic"),
        (
            to_canonical(&IsolationLayer::UserNamespace),
            "user-namespace",
        ),
    ] {
        let v: Value = cbor4ii::serde::from_slice(&value).unwrap();
        assert_eq!(text(&v), name);
        assert!(spec.contains(&format!("`\"{name}\"`")), "{name}");
    }
    // Variants with data are one-entry maps.
    let outcome = Outcome::PartiallyAccepted {
        accepted_ppm: 500_000,
    };
    let v: Value = cbor4ii::serde::from_slice(&to_canonical(&outcome)).unwrap();
    let Value::Map(entries) = v else {
        panic!("{v:?}")
    };
    assert_eq!(entries.len(), 1);
    assert_eq!(text(&entries[0].0), "partially-accepted");
    assert_eq!(
        entries[0].1,
        Value::Map(vec![(
            Value::Text("accepted_ppm".into()),
            Value::Integer(500_000)
        )])
    );
    let flat: String = spec.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(flat.contains(r#"`{"partially-accepted": {"accepted_ppm": 500000}}`"#));
    // `None` is null, and the field is present.
    assert_eq!(to_canonical(&Option::<u32>::None), [0xf6]);
    // Values that travel alone are `[version, value]`.
    let ping = encode(&MarketRequest::Ping { nonce: 7 });
    let v: Value = cbor4ii::serde::from_slice(&ping).unwrap();
    let Value::Array(items) = v else {
        panic!("{v:?}")
    };
    assert_eq!(items[0], Value::Integer(1));
}
