//! Bad input gets a specific error, never a panic.

use cannabis_protocol::*;

use crate::known_answers::fixed_bid;

fn keys(n: u8) -> Keypair {
    Keypair::from_secret([n; 32])
}

fn signed_bid_bytes() -> Vec<u8> {
    let mut bid = fixed_bid();
    bid.worker = keys(1).address();
    Signed::sign(&keys(1), &bid).to_bytes()
}

#[test]
fn oversized_input_is_refused_before_decoding() {
    let mut bytes = signed_bid_bytes();
    bytes.resize(<Signed<Bid>>::MAX_SIZE + 1, 0);
    assert_eq!(
        Signed::<Bid>::from_bytes(&bytes),
        Err(DecodeError::TooLarge {
            kind: "bid",
            size: <Signed<Bid>>::MAX_SIZE + 1,
            limit: <Signed<Bid>>::MAX_SIZE
        })
    );
}

#[test]
fn unknown_versions_are_refused() {
    // Envelope version 2.
    let mut bytes = signed_bid_bytes();
    assert_eq!(bytes[..2], [0x82, 0x01]);
    bytes[1] = 0x02;
    assert_eq!(
        Signed::<Bid>::from_bytes(&bytes),
        Err(DecodeError::UnsupportedVersion {
            kind: "bid",
            got: 2,
            supported: 1
        })
    );
    // Payload version 7, correctly signed: the signature is fine, the version is not.
    let mut payload = encode(&fixed_bid());
    payload[1] = 0x07;
    assert_eq!(
        decode::<Bid>(&payload),
        Err(DecodeError::UnsupportedVersion {
            kind: "bid",
            got: 7,
            supported: 1
        })
    );
}

#[test]
fn trailing_bytes_are_refused() {
    let mut bytes = signed_bid_bytes();
    bytes.extend_from_slice(&[0xf6, 0xf6]);
    assert_eq!(
        Signed::<Bid>::from_bytes(&bytes),
        Err(DecodeError::TrailingBytes {
            kind: "bid",
            count: 2
        })
    );
}

#[test]
fn non_canonical_encodings_are_refused() {
    let canonical = encode(&fixed_bid());
    // The body map (0xa8, 8 entries) rewritten with an indefinite length.
    assert_eq!(canonical[2], 0xa8);
    let mut indefinite = canonical.clone();
    indefinite[2] = 0xbf;
    indefinite.push(0xff);
    assert_eq!(
        decode::<Bid>(&indefinite),
        Err(DecodeError::NonCanonical { kind: "bid" })
    );
    // `task: 0` written as a two-byte integer.
    let key = b"\x64task\x00";
    let at = canonical.windows(key.len()).position(|w| w == key).unwrap();
    let mut wide = canonical[..at + 5].to_vec();
    wide.extend_from_slice(&[0x18, 0x00]);
    wide.extend_from_slice(&canonical[at + 6..]);
    assert_eq!(
        decode::<Bid>(&wide),
        Err(DecodeError::NonCanonical { kind: "bid" })
    );
}

#[test]
fn a_signature_by_another_key_than_the_claimed_address_is_refused() {
    // The body says keys(1) is the worker, keys(2) signs.
    let mut bid = fixed_bid();
    bid.worker = keys(1).address();
    let forged = Signed::sign(&keys(2), &bid);
    assert_eq!(
        forged.verify(),
        Err(OpenError::SignerMismatch {
            claimed: keys(1).address(),
            actual: keys(2).address()
        })
    );
    // The signer field swapped for the claimed key: the signature no longer verifies.
    let (payload, _, sig) = forged.into_parts();
    let swapped = Signed::<Bid>::from_parts(
        payload,
        PublicKeyBytes(*keys(1).address().public_key()),
        sig,
    );
    assert!(matches!(swapped.verify(), Err(OpenError::BadSignature(_))));
    // verify_from pins the expected signer.
    let honest = Signed::sign(&keys(1), &bid);
    assert!(honest.verify_from(&keys(1).address()).is_ok());
    assert!(matches!(
        honest.verify_from(&keys(3).address()),
        Err(OpenError::SignerMismatch { .. })
    ));
}

#[test]
fn small_order_signer_keys_are_refused() {
    let (payload, _, sig) = Signed::sign(&keys(1), &fixed_bid()).into_parts();
    let mut identity = [0u8; 32];
    identity[0] = 1;
    let bad = Signed::<Bid>::from_parts(payload, PublicKeyBytes(identity), sig);
    assert_eq!(
        bad.verify(),
        Err(OpenError::BadSigner(AddressError::BadKey))
    );
}

#[test]
fn a_signature_for_one_kind_never_verifies_as_another() {
    // A LeaseAccept's signature reused on identical payload bytes claimed as a different
    // kind fails because the domain strings differ.
    let accept = LeaseAccept {
        award: Digest::of(b"award"),
        job_id: fixed_bid().job_id,
        task: 0,
        rank: 0,
        worker: keys(1).address(),
        epoch: 1,
        issued_at: Timestamp(5),
    };
    let (payload, signer, sig) = Signed::sign(&keys(1), &accept).into_parts();
    let input = signing_input(<LeaseAccept as Message>::DOMAIN, &payload);
    assert!(keys(1).address().verify(&input, &sig).is_ok());
    let other = signing_input(<Bid as Message>::DOMAIN, &payload);
    assert!(keys(1).address().verify(&other, &sig).is_err());
    let _ = signer;
}

#[test]
fn rule_violations_are_named() {
    let mut bid = fixed_bid();
    bid.worker = keys(1).address();
    bid.valid_until = bid.issued_at;
    assert_eq!(
        Signed::sign(&keys(1), &bid).verify(),
        Err(OpenError::Invalid(Invalid::new(
            "valid_until",
            "must be after issued_at"
        )))
    );
}

#[test]
fn submit_result_checks_the_seed_rules() {
    let worker = keys(4);
    let result = ComputeResult::signed(&worker, Uuid([9; 16]), Digest::of(b"r"), None, Some(1));
    let tx = Transaction::submit_result(result.clone(), 0, 1000).unwrap();
    assert_eq!(tx.gas_limit, 80_000);
    assert_eq!(tx.fee, Amount(80_000_000));
    assert_eq!(tx.tx_type().name(), "SUBMIT_RESULT");
    assert!(Signed::sign(&worker, &tx).verify().is_ok());

    // worker_address must equal from_address: a result submitted by someone else.
    let thief = keys(5);
    let mut stolen = tx.clone();
    stolen.from_address = thief.address();
    assert!(matches!(
        Signed::sign(&thief, &stolen).verify(),
        Err(OpenError::Invalid(Invalid {
            field: "payload.worker_address",
            ..
        }))
    ));

    // The gas limit is fixed.
    let mut cheap = tx.clone();
    cheap.gas_limit = 79_999;
    cheap.fee = Amount(79_999_000);
    assert!(matches!(
        Signed::sign(&worker, &cheap).verify(),
        Err(OpenError::Invalid(Invalid {
            field: "gas_limit",
            ..
        }))
    ));

    // The fee is gas_limit * gas_price.
    let mut wrong_fee = tx.clone();
    wrong_fee.fee = Amount(1);
    assert!(matches!(
        Signed::sign(&worker, &wrong_fee).verify(),
        Err(OpenError::Invalid(Invalid { field: "fee", .. }))
    ));

    // A result whose hash was changed after signing.
    let mut altered = tx.clone();
    if let TxPayload::SubmitResult(r) = &mut altered.payload {
        r.result_hash = Digest::of(b"other");
    }
    assert!(matches!(
        Signed::sign(&worker, &altered).verify(),
        Err(OpenError::Invalid(Invalid {
            field: "payload.signature",
            ..
        }))
    ));

    // An unsigned result.
    let mut unsigned = result;
    unsigned.signature = None;
    assert_eq!(unsigned.verify(), Err(ComputeResultError::Unsigned));
}

#[test]
fn blocks_commit_to_their_compute_results() {
    let sequencer = keys(6);
    let mut txs = Vec::new();
    let mut results = Vec::new();
    for n in 0..5u8 {
        let w = keys(10 + n);
        let r = ComputeResult::signed(&w, Uuid([n; 16]), Digest::of(&[n]), None, Some(n.into()));
        results.push(r.clone());
        let tx = Transaction::submit_result(r, 0, 1000).unwrap();
        txs.push((Signed::sign(&w, &tx), tx));
    }
    let block = Block::build(&sequencer, 1, Digest([0; 32]), Timestamp(1), txs).unwrap();
    let (header, verified) = block.verify().unwrap();
    assert_eq!(verified.len(), 5);

    // Each result's inclusion proof checks against the header's compute_root.
    let ids: Vec<[u8; 32]> = results.iter().map(|r| r.id().0).collect();
    for (i, r) in results.iter().enumerate() {
        let proof = merkle::prove(&ids, i).unwrap();
        assert!(proof.verify(&r.id().0, &header.body.compute_root).is_ok());
        assert!(Block::proves_compute_result(&header.body, &r.id(), &proof).is_ok());
        // A proof that claims another tree size is judged by the header's size.
        let resized = merkle::InclusionProof {
            tree_size: 7,
            ..proof
        };
        assert!(Block::proves_compute_result(&header.body, &r.id(), &resized).is_ok());
    }
    assert_eq!(header.body.compute_count, 5);

    // A block whose header claims another compute_root is refused.
    let mut forged_header = header.body.clone();
    forged_header.compute_root = Digest::of(b"nothing");
    let forged = Block {
        header: Signed::sign(&sequencer, &forged_header),
        txs: block.txs.clone(),
    };
    assert_eq!(forged.verify().unwrap_err(), BlockError::ComputeRoot);

    // Dropping a transaction is caught.
    let mut short = block.clone();
    short.txs.pop();
    assert!(matches!(short.verify(), Err(BlockError::TxCount { .. })));

    // And the block survives the wire.
    let back: Block = decode(&encode(&block)).unwrap();
    assert_eq!(back, block);
    assert_eq!(back.hash(), block.hash());
}

#[test]
fn empty_block_has_the_empty_compute_root() {
    let block = Block::build(&keys(6), 0, Digest([0; 32]), Timestamp(0), Vec::new()).unwrap();
    let (header, _) = block.verify().unwrap();
    assert_eq!(header.body.compute_root, merkle::empty_root());
}

fn task(name: &str, budget: u64) -> TaskSpec {
    TaskSpec {
        restarts: 0,
        name: name.into(),
        workload: Workload {
            adapter: AdapterKind::Process,
            digest: Digest::of(b"bundle"),
            entrypoint: vec!["python3".into(), "main.py".into()],
        },
        inputs: Vec::new(),
        outputs: vec![OutputDecl {
            name: "model.safetensors".into(),
            max_bytes: 1 << 30,
            rights: OutputRights::Exclusive,
        }],
        resources: Resources::default(),
        requirements: Requirements::default(),
        group_size: 1,
        depends_on: Vec::new(),
        budget: Amount(budget),
        checkpoint: None,
    }
}

fn offer(tasks: Vec<TaskSpec>, budget: u64) -> JobOffer {
    let nonce = Uuid([1; 16]);
    JobOffer {
        job_id: job_id_of(&keys(7).address(), &nonce),
        nonce,
        requester: keys(7).address(),
        seq: 1,
        issued_at: Timestamp(0),
        expires_at: Timestamp(60_000),
        deadline: Timestamp(3_600_000),
        delivery: DeliveryIdentity::from_secret([8; 32]).recipient(),
        budget: Amount(budget),
        fee: FeeTerms::founder(keys(9).address()),
        review_window_ms: 86_400_000,
        acceptance: Vec::new(),
        evaluation: None,
        calls: vec![cannabis_protocol::BidCall::EVERYONE; tasks.len()],
        tasks,
    }
}

fn offer_error(o: &JobOffer) -> Option<Invalid> {
    match Signed::sign(&keys(7), o).verify() {
        Ok(_) => None,
        Err(OpenError::Invalid(i)) => Some(i),
        Err(e) => panic!("unexpected {e}"),
    }
}

#[test]
fn offers_are_checked_field_by_field() {
    let mut second = task("eval", 400);
    second.depends_on = vec![0];
    second.inputs = vec![TaskInput::FromTask {
        task: 0,
        output: "model.safetensors".into(),
        name: "model.safetensors".into(),
    }];
    let good = offer(vec![task("train", 600), second.clone()], 1000);
    assert_eq!(offer_error(&good), None);

    // A job id not derived from the requester and nonce: another requester's id, taken.
    let mut squatted = good.clone();
    squatted.job_id = job_id_of(&keys(9).address(), &good.nonce);
    assert_eq!(offer_error(&squatted).unwrap().field, "job_id");
    let mut huge = good.clone();
    huge.tasks[1].group_size = u32::MAX;
    assert_eq!(offer_error(&huge).unwrap().field, "tasks.group_size");
    let mut renonced = good.clone();
    renonced.nonce = Uuid([2; 16]);
    assert_eq!(offer_error(&renonced).unwrap().field, "job_id");

    let bad_budget = offer(vec![task("train", 600), second.clone()], 999);
    assert_eq!(offer_error(&bad_budget).unwrap().field, "budget");

    let mut forward = second.clone();
    forward.depends_on = vec![1];
    assert_eq!(
        offer_error(&offer(vec![task("train", 600), forward], 1000))
            .unwrap()
            .field,
        "tasks.depends_on"
    );

    let mut undeclared = second.clone();
    undeclared.depends_on = vec![];
    assert_eq!(
        offer_error(&offer(vec![task("train", 600), undeclared], 1000))
            .unwrap()
            .field,
        "tasks.inputs"
    );

    let mut sneaky = task("train", 1000);
    sneaky.outputs[0].name = "../etc/passwd".into();
    assert_eq!(
        offer_error(&offer(vec![sneaky], 1000)).unwrap().field,
        "tasks.outputs.name"
    );

    let mut empty_group = task("train", 1000);
    empty_group.group_size = 0;
    assert_eq!(
        offer_error(&offer(vec![empty_group], 1000)).unwrap().field,
        "tasks.group_size"
    );

    assert_eq!(offer_error(&offer(vec![], 0)).unwrap().field, "tasks");
}

#[test]
fn awards_for_groups_list_the_worker_at_its_rank() {
    let requester = keys(7);
    let workers: Vec<Address> = (20..23).map(|n| keys(n).address()).collect();
    let roster: Vec<RosterEntry> = workers
        .iter()
        .enumerate()
        .map(|(rank, w)| RosterEntry {
            rank: rank as u32,
            worker: *w,
        })
        .collect();
    let award = |rank: u32, worker: Address, roster: Vec<RosterEntry>| Award {
        job_id: Uuid([1; 16]),
        task: 0,
        rank,
        requester: requester.address(),
        worker,
        epoch: 1,
        bid: Digest::of(b"bid"),
        price: Amount(10),
        issued_at: Timestamp(0),
        expires_at: Timestamp(30_000),
        renew_every_ms: 10_000,
        rendezvous: Some(Rendezvous {
            id: Uuid([2; 16]),
            roster,
        }),
        inputs: Vec::new(),
        resume: None,
    };
    assert!(
        Signed::sign(&requester, &award(1, workers[1], roster.clone()))
            .verify()
            .is_ok()
    );
    assert!(
        Signed::sign(&requester, &award(1, workers[2], roster.clone()))
            .verify()
            .is_err()
    );
    let mut shuffled = roster.clone();
    shuffled.swap(0, 1);
    assert!(
        Signed::sign(&requester, &award(2, workers[2], shuffled))
            .verify()
            .is_err()
    );
}

fn ad_of(k: &Keypair) -> CapabilityAd {
    CapabilityAd {
        node: k.address(),
        seq: 1,
        issued_at: Timestamp(1_000),
        expires_at: Timestamp(2_000),
        delivery: DeliveryIdentity::from_secret([1; 32]).recipient(),
        hardware: Hardware {
            cpu_model: "cpu".into(),
            cpu_cores: 2,
            memory_bytes: 1 << 30,
            swap_bytes: 0,
            storage_bytes: 1 << 30,
            gpus: Vec::new(),
        },
        os: OsInfo {
            name: "linux".into(),
            kernel: "6".into(),
        },
        runtimes: Vec::new(),
        adapters: vec![AdapterKind::Synthetic],
        collectives: Vec::new(),
        isolation: Vec::new(),
        network: NetworkLimits::default(),
        prices: PriceSheet::default(),
        attestation: None,
        challenges: Vec::new(),
    }
}

fn pass_for(verifier: &Keypair, worker: &Address) -> ChallengePass {
    ChallengePass {
        verifier: verifier.address(),
        worker: *worker,
        seed: Digest([7; 32]),
        n: 256,
        rounds: 3,
        claimed_cores: 2,
        took_ms: 900,
        deadline_ms: 1000,
        passed_at: Timestamp(1_500),
    }
}

fn ad_error(worker: &Keypair, ad: &CapabilityAd) -> String {
    match Signed::sign(worker, ad).verify() {
        Ok(_) => String::new(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn challenge_passes_in_an_ad_are_checked() {
    let worker = keys(1);
    let mut ad = ad_of(&worker);
    ad.challenges = vec![Signed::sign(
        &keys(2),
        &pass_for(&keys(2), &worker.address()),
    )];
    assert_eq!(ad_error(&worker, &ad), "");

    // A pass earned by another node.
    ad.challenges = vec![Signed::sign(
        &keys(2),
        &pass_for(&keys(2), &keys(3).address()),
    )];
    assert!(ad_error(&worker, &ad).contains("names another worker"));

    // A pass whose signature is not the verifier's.
    let (payload, _, signature) =
        Signed::sign(&keys(2), &pass_for(&keys(2), &worker.address())).into_parts();
    let (_, other_key, _) =
        Signed::sign(&keys(4), &pass_for(&keys(4), &worker.address())).into_parts();
    ad.challenges = vec![Signed::from_parts(payload, other_key, signature)];
    assert!(ad_error(&worker, &ad).contains("does not verify"));

    // Two from one verifier, or more than four.
    let p = Signed::sign(&keys(2), &pass_for(&keys(2), &worker.address()));
    ad.challenges = vec![p.clone(), p];
    assert!(ad_error(&worker, &ad).contains("two passes from one verifier"));
    ad.challenges = (2..7)
        .map(|n| Signed::sign(&keys(n), &pass_for(&keys(n), &worker.address())))
        .collect();
    assert!(ad_error(&worker, &ad).contains("at most 4"));

    // A node cannot vouch for itself, and a late answer is no pass.
    let own = pass_for(&worker, &worker.address());
    assert!(Signed::sign(&worker, &own).verify().is_err());
    let mut late = pass_for(&keys(2), &worker.address());
    late.took_ms = 1001;
    assert!(Signed::sign(&keys(2), &late).verify().is_err());
}

/// An `ESCROW_ASSIGN_MANY` of `n` assignments at the largest values every field takes.
fn assign_many(n: usize) -> Signed<Transaction> {
    let requester = keys(7);
    let many = EscrowAssignMany {
        job_id: Uuid([0xff; 16]),
        assignments: (0..n)
            .map(|i| Assigned {
                task: u32::MAX,
                rank: u32::MAX - i as u32,
                worker: keys(8).address(),
                epoch: u64::MAX,
                price: Amount(u64::MAX),
            })
            .collect(),
    };
    let tx = Transaction::new(
        requester.address(),
        None,
        Amount::ZERO,
        u64::MAX,
        u64::MAX / TxType::EscrowAssignMany.gas_limit(),
        TxPayload::EscrowAssignMany(many),
    )
    .unwrap();
    Signed::sign(&requester, &tx)
}

#[test]
fn the_largest_escrow_assign_many_fits_a_transaction_and_one_more_is_refused() {
    // Every transaction fits the transaction's wire cap: the most assignments one carries
    // is sized to it (a first cap of 1,024 made a group of 99 a 10 KB transaction, which
    // the sequencer refused).
    let full = assign_many(MAX_ASSIGNED);
    assert!(full.verify().is_ok(), "{:?}", full.verify().err());
    let bytes = full.to_bytes();
    assert!(
        bytes.len() <= <Signed<Transaction>>::MAX_SIZE,
        "{}",
        bytes.len()
    );
    assert!(Signed::<Transaction>::from_bytes(&bytes).is_ok());
    assert_eq!(
        assign_many(MAX_ASSIGNED + 1).verify().err(),
        Some(OpenError::Invalid(Invalid::new(
            "payload.assignments",
            "must hold 1 to 56 assignments"
        )))
    );
    assert_eq!(
        assign_many(0).verify().err(),
        Some(OpenError::Invalid(Invalid::new(
            "payload.assignments",
            "must hold 1 to 56 assignments"
        )))
    );
}
