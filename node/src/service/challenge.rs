//! The capability challenge over the network: answering one (proving off the driver
//! thread, one at a time) and setting one to a peer, sized from its ad and verified off the
//! driver thread. A verifier that saw a pass signs a [`ChallengePass`] and sends it to the
//! worker; the worker's market engine keeps it (durably) and its ads carry it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

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

/// The challenge this node is proving: for whom, where to answer, and how to stop it.
pub(crate) struct Proving {
    peer: PeerId,
    channel: libp2p::request_response::ResponseChannel<ChallengeResponse>,
    cancel: Arc<AtomicBool>,
}

/// How often this node answers challenges: one per peer and `TOTAL` in all per `WINDOW`.
/// A challenge costs every core for up to `MAX_CHALLENGE_SECS` at the reference rate, so
/// this caps the share of the machine that requests can take (here at most 48 s in 10
/// minutes), whoever sends them.
const WINDOW: Duration = Duration::from_secs(600);
const TOTAL: usize = 6;

/// The challenges answered lately, oldest first.
#[derive(Default)]
pub(crate) struct Answered(VecDeque<(Instant, PeerId)>);

impl Answered {
    /// Why `peer` is turned away now, if it is.
    fn refusal(&mut self, peer: &PeerId, now: Instant) -> Option<String> {
        while self
            .0
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) >= WINDOW)
        {
            self.0.pop_front();
        }
        let wait = |at: &Instant| (WINDOW - now.duration_since(*at)).as_secs() + 1;
        if let Some((at, _)) = self.0.iter().find(|(_, p)| p == peer) {
            return Some(format!(
                "one challenge per peer per {} s: try again in {} s",
                WINDOW.as_secs(),
                wait(at)
            ));
        }
        if self.0.len() >= TOTAL {
            return Some(format!(
                "{TOTAL} challenges answered in the last {} s: try again in {} s",
                WINDOW.as_secs(),
                wait(&self.0[0].0)
            ));
        }
        None
    }
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
        // The challenge is sized to this node's own claim, no larger: without an ad there
        // is no claim to size it to.
        let claim = self.market.view().ad(&self.address).map(|e| Claim {
            cpu_cores: e.ad().hardware.cpu_cores,
        });
        let refusal = if self.graylisted(&peer) {
            Err("graylisted: too many invalid messages".to_string())
        } else if self.proving.is_some() {
            Err("busy with another challenge; try again later".to_string())
        } else if let Some(why) = self.answered.refusal(&peer, Instant::now()) {
            Err(why)
        } else if let Some(claim) = claim {
            Challenge::new(request.seed, request.n, request.rounds)
                .and_then(|c| claim.admits(&c).map(|()| c))
                .map_err(|e| e.to_string())
        } else {
            Err("no capability ad yet: nothing to size a challenge against".to_string())
        };
        let challenge = match refusal {
            Ok(c) => c,
            Err(reason) => {
                info!(%peer, n = request.n, rounds = request.rounds, %reason, "challenge refused");
                let _ = self
                    .swarm
                    .behaviour_mut()
                    .challenge
                    .send_response(channel, ChallengeResponse::Refused { reason });
                return;
            }
        };
        info!(%peer, n = challenge.n, rounds = challenge.rounds, "answering a challenge");
        self.answered.0.push_back((Instant::now(), peer));
        let cancel = Arc::new(AtomicBool::new(false));
        self.proving = Some(Proving {
            peer,
            channel,
            cancel: cancel.clone(),
        });
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
            let answer = cannabis_runtime::challenge::prove_until(&challenge, threads, &cancel);
            let response = answer.as_ref().map(ChallengeResponse::answer);
            let _ = tx.blocking_send(Command::ChallengeProved(response));
        });
    }

    /// Stops the proof for `peer`, which went away: nobody is left to answer.
    pub(super) fn cancel_proving(&mut self, peer: &PeerId) {
        if let Some(p) = &self.proving
            && p.peer == *peer
            && !p.cancel.swap(true, Ordering::Relaxed)
        {
            info!(%peer, "the verifier went away: challenge stopped");
        }
    }

    /// Sends the proved answer back on the channel it was asked on (`None`: the proof was
    /// stopped, nothing to send).
    pub(super) fn send_proved(&mut self, response: Option<ChallengeResponse>) {
        if let Some(p) = self.proving.take()
            && let Some(response) = response
            && self
                .swarm
                .behaviour_mut()
                .challenge
                .send_response(p.channel, response)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges_are_answered_once_per_peer_and_a_few_in_all_per_window() {
        let mut answered = Answered::default();
        let start = Instant::now();
        let peers: Vec<PeerId> = (0..=TOTAL).map(|_| PeerId::random()).collect();
        for (i, p) in peers.iter().take(TOTAL).enumerate() {
            let at = start + Duration::from_secs(i as u64);
            assert_eq!(answered.refusal(p, at), None, "peer {i}");
            answered.0.push_back((at, *p));
        }
        let later = start + Duration::from_secs(60);
        let again = answered.refusal(&peers[0], later).unwrap();
        assert!(again.contains("one challenge per peer"), "{again}");
        let full = answered.refusal(&peers[TOTAL], later).unwrap();
        assert!(full.contains("challenges answered"), "{full}");
        // The window slides: the first answer ages out, and its peer may ask again.
        let after = start + WINDOW;
        assert_eq!(answered.refusal(&peers[0], after), None);
        assert_eq!(answered.refusal(&peers[TOTAL], after), None);
    }
}
