//! Known-answer vectors: a fixed key and fixed messages give fixed bytes. Any change to
//! the wire format, the domain strings, the signature scheme, the merkle tree or the
//! synthetic task shows up here first. Do not "fix" these vectors: a change here is a
//! protocol version change. The signature and the merkle and synthetic vectors were checked
//! against independent implementations (Python `cryptography` and `hashlib`) when recorded.

use cannabis_protocol::*;

fn keys() -> Keypair {
    Keypair::from_secret([0x42; 32])
}

pub(crate) fn fixed_bid() -> Bid {
    Bid {
        job_id: "550e8400-e29b-41d4-a716-446655440000".parse().unwrap(),
        task: 0,
        offer: Digest::of(b"offer"),
        worker: keys().address(),
        price: Amount(1_000_000),
        earliest_start: Timestamp(1_767_225_600_000),
        issued_at: Timestamp(1_767_225_600_000),
        valid_until: Timestamp(1_767_225_660_000),
    }
}

fn fixed_result() -> ComputeResult {
    ComputeResult::signed(
        &keys(),
        "550e8400-e29b-41d4-a716-446655440000".parse().unwrap(),
        Digest::of(b"result"),
        None,
        Some(12345),
    )
}

const ADDRESS: &str = "cpc1y9f035vm0ywjg3fjgts47t4tdjmul7nmdf0dxqyhjc8qdxypmvfq4x86a3";
const RECIPIENT: &str = "age1ehhas7p6jx6yveqw9c0e2kvakd0ysjsqwx7jrq4nkcxssykpp3cq0wk9nt";
const BID_CBOR: &str = "8201a8666a6f625f6964782435353065383430302d653239622d343164342d613731362d343436363535343430303030647461736b00656f666665725820988180bf0c9328c9e8bd082755c647048ae82481fd06799bad05f2e1a4e1339c66776f726b6572783e63706331793966303335766d3079776a6733666a6774733437743474646a6d756c376e6d64663064787179686a633871647879706d7666713478383661336570726963651a000f42406e6561726c696573745f73746172741b0000019b76daa800696973737565645f61741b0000019b76daa8006b76616c69645f756e74696c1b0000019b76db9260";
const BID_SIGNATURE: &str = "5cf013846cf465b4c7eb5d8b3796b42596b50b0d428c3f7244c6d8998f092b5a543172eae2b693fae54cecfc40335000a9bae9460bfdaff7ebeae0be0b55620e";
const BID_ID: &str = "3b19815ad1ba657a3b7a3249abc6d35ce1e6962eeb1923278f2dd22be129f000";
const RESULT_CBOR: &str = "8201a6677461736b5f6964782435353065383430302d653239622d343164342d613731362d3434363635353434303030306e776f726b65725f61646472657373783e63706331793966303335766d3079776a6733666a6774733437743474646a6d756c376e6d64663064787179686a633871647879706d7666713478383661336b726573756c745f6861736878423078663661323134663761356663646130633263656539363630623766633239663536343965336336386161643438653230653935303133376339383931336136386570726f6f66f6656e6f6e6365193039697369676e6174757265788230783364386431333633303863393639396237303062373563613936653165613839343836336335633638323830643334366263363762383836313333663535303732393838623138373537653864303639376334623438376161383431343433373136376662623930326631343939366135326339373864313336383839653030";
const RESULT_ID: &str = "25dd7825af24da88a183b1b51abba0176b457f1ef47ceea4440f9e029f28ddc3";
const MERKLE_ROOT: &str = "fe14a5426fbd70c0fa73f52342afed0da0bd23c4838662ccf6b88a3070ead97b";
const SYNTHETIC_64: &str = "b9b2af3ca138beace20e7daf4569c0c7efe8a4b0e442a6f064534357cbfa7638";

#[test]
fn address_of_fixed_key() {
    assert_eq!(keys().address().to_string(), ADDRESS);
    assert_eq!(
        DeliveryIdentity::from_secret([0x43; 32])
            .recipient()
            .to_string(),
        RECIPIENT
    );
}

#[test]
fn bid_encoding_and_signature() {
    assert_eq!(hex::encode(encode(&fixed_bid())), BID_CBOR);
    let signed = Signed::sign(&keys(), &fixed_bid());
    let (payload, signer, sig) = signed.clone().into_parts();
    assert_eq!(hex::encode(&payload), BID_CBOR);
    assert_eq!(signer.0, *keys().address().public_key());
    assert_eq!(sig.to_string(), BID_SIGNATURE);
    assert_eq!(signed.id().to_string(), BID_ID);
    // And the vector verifies as received from the wire.
    let back = Signed::<Bid>::from_bytes(&signed.to_bytes())
        .unwrap()
        .verify()
        .unwrap();
    assert_eq!(back.body, fixed_bid());
}

#[test]
fn compute_result_in_the_seed_layout() {
    let r = fixed_result();
    let cbor = encode(&r);
    assert_eq!(hex::encode(&cbor), RESULT_CBOR);
    assert_eq!(r.id().to_string(), RESULT_ID);
    // The seed's field names, in the seed's order.
    let text = String::from_utf8_lossy(&cbor);
    let mut at = 0;
    for field in [
        "task_id",
        "worker_address",
        "result_hash",
        "proof",
        "nonce",
        "signature",
    ] {
        let pos = text[at..]
            .find(field)
            .unwrap_or_else(|| panic!("{field} missing or out of order"));
        at += pos + field.len();
    }
    assert!(r.verify().is_ok());
}

#[test]
fn merkle_root_of_five_leaves() {
    assert_eq!(
        merkle::root(&[b"a".as_slice(), b"b", b"c", b"d", b"e"]).to_string(),
        MERKLE_ROOT
    );
}

#[test]
fn synthetic_task_hash_is_pinned() {
    let t = synthetic::SyntheticTask::new(Digest::of(b"seed"), 64).unwrap();
    assert_eq!(t.run().to_string(), SYNTHETIC_64);
}

/// The bid draw (docs/protocol.md, "Bid draw"), checked against Python's `hashlib` and
/// `cryptography` when recorded.
#[test]
fn the_bid_draw_is_pinned() {
    use cannabis_protocol::draw;
    let job: Uuid = "550e8400-e29b-41d4-a716-446655440000".parse().unwrap();
    let task = draw::task_point(&job, 0);
    let worker = draw::worker_point(&keys().address());
    assert_eq!(task, 0xa585_42b2_f420_5b98);
    assert_eq!(worker, 0xc9b6_5bdd_929b_7ac1);
    assert_eq!(draw::distance(task, worker), 2_607_893_330_062_417_705);
    assert_eq!(draw::weight(Amount(1_000), Amount(2_000)), 1_024);
    assert_eq!(draw::threshold(1_000_000, 1_024), 73_786_976_294_838_206);
    let call = BidCall {
        target: 8,
        odds_ppb: 1_000_000,
        ref_price: Amount(2_000),
    };
    assert!(!draw::drawn(
        &call,
        &job,
        0,
        &keys().address(),
        Amount(1_000)
    ));
    assert_eq!(draw::shard_of(task, 16), 10);
}
