//! The capability challenge over the network: answering one (proving off the driver
//! thread, one at a time) and setting one to a peer, sized from its ad and verified off the
//! driver thread. A verifier that saw a pass signs a [`ChallengePass`] and sends it to the
//! worker; the worker's market engine keeps it (durably) and its ads carry it.

use std::time::Instant;

use cannabis_api::ChallengeReport;
use cannabis_protocol::challenge::{Challenge, Claim, Sizing};
use cannabis_protocol::{
    Address, ChallengePass, ChallengeRequest, ChallengeResponse, Digest, MarketRequest, Signed,
    Timestamp,
};
use libp2p::PeerId;
use libp2p::request_response::{Event, Message};
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use super::{Command, Node, now};
use crate::swarm;

/// A challenge this node set, waiting for its answer.
pub(crate) struct Pending {
    sizing: Sizing,
    challenge: Challenge,
    claim: Claim,
    sent: Instant,
    reply: oneshot::Sender<anyhow::Result<ChallengeReport>>,
}

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
            .and_then(|a| self.market.view().ad(&a))
            .map(|e| Claim {
                cpu_cores: e.ad().hardware.cpu_cores,
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
        if let Some(verifier) = swarm::address_of(&peer) {
            // A pass for it will be kept: the engine remembers who asked, with which seed.
            let _ = self.market.command(
                now().0,
                cannabis_market::Command::ChallengeAnswered {
                    verifier,
                    seed: challenge.seed,
                },
            );
        }
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
            let _ = self.market.command(
                passed_at,
                cannabis_market::Command::ChallengePassed {
                    worker,
                    at: passed_at,
                },
            );
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
