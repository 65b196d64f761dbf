//! The capability challenge over the network: answering one (proving off the driver
//! thread, one at a time) and setting one to a peer, sized from its ad and verified off the
//! driver thread. A verifier that saw a pass signs a [`ChallengePass`] and sends it to the
//! worker, which keeps it (durably) and carries it in its ads.

use std::time::Instant;

use cannabis_api::ChallengeReport;
use cannabis_protocol::challenge::{Challenge, Claim, Sizing};
use std::collections::BTreeMap;

use cannabis_protocol::{
    Address, ChallengePass, ChallengeRequest, ChallengeResponse, Digest, MAX_AD_PASSES,
    MarketRequest, Signed, Timestamp,
};
use libp2p::PeerId;
use libp2p::request_response::{Event, Message};
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use super::{Command, Node, now};
use crate::store::Records;
use crate::swarm;

/// A challenge this node set, waiting for its answer.
pub(crate) struct Pending {
    sizing: Sizing,
    challenge: Challenge,
    claim: Claim,
    sent: Instant,
    reply: oneshot::Sender<anyhow::Result<ChallengeReport>>,
}

/// How many answered challenges are remembered, waiting for their pass.
const ANSWERED_KEPT: usize = 8;

/// Passes other nodes signed for this one, by verifier.
pub(crate) type OwnPasses = BTreeMap<Address, (Signed<ChallengePass>, ChallengePass)>;

fn random_digest() -> anyhow::Result<Digest> {
    Ok(Digest(*crate::keystore::random_bytes::<32>()?))
}

impl Node {
    /// Sets `peer` a challenge sized from the cores its capability ad claims.
    pub(super) fn start_challenge(
        &mut self,
        peer: PeerId,
        reply: oneshot::Sender<anyhow::Result<ChallengeReport>>,
    ) {
        let claim = swarm::address_of(&peer)
            .and_then(|a| self.view.ad(&a))
            .map(|e| Claim {
                cpu_cores: e.ad.hardware.cpu_cores,
            });
        let Some(claim) = claim else {
            let _ = reply.send(Err(anyhow::anyhow!(
                "no capability ad from {peer}: nothing to check its claim against"
            )));
            return;
        };
        let sizing = self.config.challenge.sizing();
        let challenge = match random_digest().and_then(|seed| Ok(sizing.challenge(seed, &claim)?)) {
            Ok(c) => c,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        let id = self.swarm.behaviour_mut().challenge.send_request(
            &peer,
            ChallengeRequest {
                seed: challenge.seed,
                n: challenge.n,
                rounds: challenge.rounds,
            },
        );
        info!(%peer, n = challenge.n, rounds = challenge.rounds, "challenge sent");
        self.challenges.insert(
            id,
            Pending {
                sizing,
                challenge,
                claim,
                sent: Instant::now(),
                reply,
            },
        );
    }

    pub(super) fn on_challenge(&mut self, event: Event<ChallengeRequest, ChallengeResponse>) {
        match event {
            Event::Message {
                peer,
                message:
                    Message::Request {
                        request, channel, ..
                    },
                ..
            } => self.answer_challenge(peer, request, channel),
            Event::Message {
                peer,
                message:
                    Message::Response {
                        request_id,
                        response,
                    },
                ..
            } => {
                if let Some(pending) = self.challenges.remove(&request_id) {
                    self.check_answer(peer, pending, response);
                }
            }
            Event::OutboundFailure {
                peer,
                request_id,
                error,
                ..
            } => {
                if let Some(p) = self.challenges.remove(&request_id) {
                    let _ = p
                        .reply
                        .send(Err(anyhow::anyhow!("challenge to {peer} failed: {error}")));
                }
            }
            Event::InboundFailure { peer, error, .. } => {
                debug!(%peer, %error, "challenge request failed");
            }
            Event::ResponseSent { .. } => {}
        }
    }

    fn answer_challenge(
        &mut self,
        peer: PeerId,
        request: ChallengeRequest,
        channel: libp2p::request_response::ResponseChannel<ChallengeResponse>,
    ) {
        let refusal = if self.proving.is_some() {
            Err("busy with another challenge; try again later".to_string())
        } else {
            Challenge::new(request.seed, request.n, request.rounds).map_err(|e| e.to_string())
        };
        let challenge = match refusal {
            Ok(c) => c,
            Err(reason) => {
                let _ = self
                    .swarm
                    .behaviour_mut()
                    .challenge
                    .send_response(channel, ChallengeResponse::Refused { reason });
                return;
            }
        };
        info!(%peer, n = challenge.n, rounds = challenge.rounds, "answering a challenge");
        self.proving = Some(channel);
        if self.answered.len() == ANSWERED_KEPT {
            self.answered.pop_front();
        }
        self.answered.push_back((peer, challenge.seed));
        let tx = self.self_tx.clone();
        tokio::task::spawn_blocking(move || {
            let threads = cannabis_runtime::challenge::available_threads();
            let answer = cannabis_runtime::challenge::prove(&challenge, threads);
            let _ = tx.blocking_send(Command::ChallengeProved(ChallengeResponse::answer(&answer)));
        });
    }

    /// Sends the proved answer back on the channel it was asked on.
    pub(super) fn send_proved(&mut self, response: ChallengeResponse) {
        if let Some(channel) = self.proving.take()
            && self
                .swarm
                .behaviour_mut()
                .challenge
                .send_response(channel, response)
                .is_err()
        {
            warn!("the verifier went away before the challenge answer");
        }
    }

    fn check_answer(&mut self, peer: PeerId, pending: Pending, response: ChallengeResponse) {
        let took = pending.sent.elapsed();
        let address = swarm::address_of(&peer);
        let seed = pending.challenge.seed;
        let tx = self.self_tx.clone();
        tokio::task::spawn_blocking(move || {
            let sizing = pending.sizing;
            let deadline_ms = sizing.deadline_ms(&pending.challenge, &pending.claim);
            let took_ms = u64::try_from(took.as_millis()).unwrap_or(u64::MAX);
            let started = Instant::now();
            let verdict = match (response.to_answer(), random_digest()) {
                (None, _) => Err(format!("refused: {response:?}")),
                (_, Err(e)) => Err(format!("{e:#}")),
                (Some(answer), Ok(r_seed)) => sizing
                    .check(
                        &pending.challenge,
                        &pending.claim,
                        &answer,
                        Timestamp(0),
                        Timestamp(took_ms),
                        &r_seed,
                    )
                    .map_err(|e| e.to_string()),
            };
            let report = ChallengeReport {
                peer_id: peer.to_string(),
                address: address.map(|a| a.to_string()).unwrap_or_default(),
                claimed_cores: pending.claim.cpu_cores,
                n: pending.challenge.n,
                rounds: pending.challenge.rounds,
                took_ms,
                deadline_ms,
                verify_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                passed: verdict.is_ok(),
                failure: verdict.err(),
            };
            let _ = tx.blocking_send(Command::ChallengeChecked(report, seed, pending.reply));
        });
    }

    /// Records a verified challenge, sends the worker a signed pass if it passed, and
    /// answers whoever asked for it.
    pub(super) fn record_challenge(
        &mut self,
        report: ChallengeReport,
        seed: Digest,
        reply: oneshot::Sender<anyhow::Result<ChallengeReport>>,
    ) {
        if report.passed
            && let Ok(worker) = report.address.parse::<Address>()
            && let Ok(peer) = report.peer_id.parse::<PeerId>()
        {
            let passed_at = now().0;
            self.challenge_passes.insert(worker, passed_at);
            let pass = ChallengePass {
                verifier: self.address,
                worker,
                seed,
                n: report.n,
                rounds: report.rounds,
                claimed_cores: report.claimed_cores,
                took_ms: report.took_ms,
                deadline_ms: report.deadline_ms,
                passed_at,
            };
            let signed = Signed::sign(&self.keys.signing, &pass);
            // Fire and forget: the worker's answer only says whether it kept the pass.
            self.swarm
                .behaviour_mut()
                .market
                .send_request(&peer, MarketRequest::ChallengePass(signed));
        }
        info!(peer = %report.peer_id, passed = report.passed, took_ms = report.took_ms,
              deadline_ms = report.deadline_ms, "challenge checked");
        let _ = reply.send(Ok(report));
    }
}

impl Node {
    /// A pass a verifier sent: kept when it verifies, names this node, and answers a
    /// challenge this node answered for that peer with that seed. The next ad carries it.
    pub(super) fn take_pass(
        &mut self,
        peer: PeerId,
        signed: Signed<ChallengePass>,
    ) -> Result<(), String> {
        let verified = signed.verify().map_err(|e| e.to_string())?;
        let pass = verified.body;
        if pass.worker != self.address {
            return Err("the pass names another worker".into());
        }
        if swarm::address_of(&peer) != Some(pass.verifier) {
            return Err("a pass is taken only from its verifier".into());
        }
        if !self.answered.contains(&(peer, pass.seed)) {
            return Err("this node answered no such challenge for you".into());
        }
        self.answered.retain(|a| a != &(peer, pass.seed));
        self.store
            .put_record(
                Records::Passes,
                pass.verifier.to_string().as_bytes(),
                &signed.to_bytes(),
            )
            .map_err(|e| format!("cannot keep the pass: {e:#}"))?;
        info!(verifier = %pass.verifier, n = pass.n, "challenge pass received");
        self.own_passes.insert(pass.verifier, (signed, pass));
        self.prune_passes();
        if let Err(e) = self.publish_ad() {
            warn!(error = %format!("{e:#}"), "cannot publish the capability ad");
        }
        Ok(())
    }

    /// Keeps the newest [`MAX_AD_PASSES`] passes, in memory and in the store.
    fn prune_passes(&mut self) {
        while self.own_passes.len() > MAX_AD_PASSES {
            let oldest = self
                .own_passes
                .iter()
                .min_by_key(|(_, (_, p))| p.passed_at)
                .map(|(v, _)| *v);
            let Some(oldest) = oldest else { break };
            self.own_passes.remove(&oldest);
            if let Err(e) = self
                .store
                .remove_record(Records::Passes, oldest.to_string().as_bytes())
            {
                warn!(error = %format!("{e:#}"), "store");
            }
        }
    }

    /// The passes the next ad carries: those sized for at least the cores it claims.
    pub(super) fn passes_for_ad(&self, cpu_cores: u32) -> Vec<Signed<ChallengePass>> {
        self.own_passes
            .values()
            .filter(|(_, p)| p.claimed_cores >= cpu_cores)
            .map(|(s, _)| s.clone())
            .collect()
    }

    /// Loads the kept passes, re-verified; drops any that no longer hold.
    pub(super) fn restore_passes(&mut self) -> anyhow::Result<()> {
        for (_, bytes) in self.store.records(Records::Passes)? {
            let kept = Signed::<ChallengePass>::from_bytes(&bytes)
                .ok()
                .and_then(|s| Some((s.verify().ok()?.body, s)))
                .filter(|(p, _)| p.worker == self.address);
            match kept {
                Some((pass, signed)) => {
                    self.own_passes.insert(pass.verifier, (signed, pass));
                }
                None => warn!("a kept challenge pass no longer verifies; ignored"),
            }
        }
        self.prune_passes();
        Ok(())
    }

    /// What matching needs besides the ads: now, this node, and the checks it made.
    pub(super) fn matching_context(&self) -> cannabis_market::matching::Context {
        cannabis_market::matching::Context {
            now: now().0,
            me: Some(self.address),
            local_passes: self
                .challenge_passes
                .iter()
                .map(|(a, t)| (*a, *t))
                .collect(),
        }
    }
}
