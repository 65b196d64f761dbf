//! [`NodeHandle`]: how the API, the CLI and tests talk to a running node.

use std::time::Instant;

use anyhow::Context as _;
use cannabis_api::{self as api, OfferTemplate};
use cannabis_protocol::{Address, MarketRequest, MarketResponse};
use libp2p::{Multiaddr, PeerId};
use tokio::sync::{mpsc, oneshot};

use super::Command;

/// The local executor once it opened, or why it did not.
pub(crate) type Opened = Option<std::sync::Arc<Result<crate::exec::ExecutorHandle, String>>>;

/// Where the local executor appears once it opened (in the background, at start).
pub(crate) type ExecutorSlot = tokio::sync::watch::Receiver<Opened>;

/// How long a caller waits for the executor to open at start.
const EXECUTOR_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// A cheap-to-clone handle on a running node.
#[derive(Clone)]
pub struct NodeHandle {
    tx: mpsc::Sender<Command>,
    peer_id: PeerId,
    address: Address,
    executor: ExecutorSlot,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
}

impl NodeHandle {
    pub(super) fn new(
        tx: mpsc::Sender<Command>,
        peer_id: PeerId,
        address: Address,
        executor: ExecutorSlot,
        metrics: std::sync::Arc<crate::metrics::Metrics>,
    ) -> Self {
        Self {
            tx,
            peer_id,
            address,
            executor,
            metrics,
        }
    }

    /// `/metrics`: the gauges set from the node's state and the executor's attempts, then
    /// every metric in Prometheus' text format.
    pub async fn metrics(&self) -> anyhow::Result<String> {
        use crate::metrics::{reason_label, set_all};
        self.ask(Command::Metrics).await?;
        if let Ok(ex) = self.executor().await {
            let attempts = tokio::task::spawn_blocking(move || ex.attempts())
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default();
            let mut states = std::collections::BTreeMap::<String, i64>::new();
            let mut refused = std::collections::BTreeMap::<String, i64>::new();
            for a in &attempts {
                *states.entry(a.state.name().to_string()).or_default() += 1;
                if a.refused {
                    let why = reason_label(a.reason.as_deref().unwrap_or(""));
                    *refused.entry(why).or_default() += 1;
                }
            }
            set_all(
                &self.metrics.attempts,
                "state",
                &states.into_iter().collect::<Vec<_>>(),
            );
            set_all(
                &self.metrics.refusals,
                "reason",
                &refused.into_iter().collect::<Vec<_>>(),
            );
        }
        // NVML is asked at each scrape (off the async threads): the utilisation while
        // jobs run is what operators watch.
        if let Ok(report) = tokio::task::spawn_blocking(|| {
            cannabis_runtime::gpu::probe(&cannabis_runtime::gpu::Nvml, &[])
        })
        .await
        {
            self.metrics.set_gpus(&report);
        }
        Ok(self.metrics.encode())
    }

    /// The node's executor (its own or its supervisor's), or why it has none; waits while it
    /// is still opening.
    /// Only the local API reaches it: nothing on the network side can change its settings.
    pub async fn executor(&self) -> Result<crate::exec::ExecutorHandle, String> {
        let mut slot = self.executor.clone();
        let opened = tokio::time::timeout(EXECUTOR_WAIT, slot.wait_for(Option::is_some))
            .await
            .map_err(|_| "the executor is still opening".to_string())?
            .map_err(|_| "the node stopped".to_string())?
            .clone();
        match opened.as_deref() {
            Some(Ok(ex)) => Ok(ex.clone()),
            Some(Err(why)) => Err(why.clone()),
            None => Err("the executor is still opening".to_string()),
        }
    }

    /// The node's peer id.
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// The node's address.
    pub fn address(&self) -> Address {
        self.address
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> anyhow::Result<T> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(make(tx))
            .await
            .map_err(|_| anyhow::anyhow!("the node has stopped"))?;
        rx.await.context("the node stopped before answering")
    }

    /// Status.
    pub async fn status(&self) -> anyhow::Result<api::Status> {
        self.ask(Command::Status).await
    }

    /// The embedded ledger as this node holds it.
    pub async fn ledger(&self) -> anyhow::Result<api::LedgerStatus> {
        self.ask(Command::LedgerStatus).await?
    }

    /// An account (this node's when `None`).
    pub async fn balance(
        &self,
        who: Option<cannabis_protocol::Address>,
    ) -> anyhow::Result<api::Balance> {
        self.ask(|tx| Command::Balance(who, tx)).await?
    }

    /// The newest blocks, newest first.
    pub async fn blocks(&self, limit: u32) -> anyhow::Result<Vec<api::BlockSummary>> {
        self.ask(|tx| Command::LedgerBlocks(limit, tx)).await?
    }

    /// One block with its transactions.
    pub async fn block(&self, height: u64) -> anyhow::Result<api::BlockDetail> {
        self.ask(|tx| Command::LedgerBlock(height, tx)).await?
    }

    /// Sends `amount` from this node's account to `to`: answered once the sequencer kept it.
    pub async fn send(
        &self,
        to: cannabis_protocol::Address,
        amount: cannabis_protocol::Amount,
    ) -> anyhow::Result<api::Submitted> {
        self.ask(|tx| Command::WalletSend(to, amount, tx)).await?
    }

    /// Asks the testnet's faucet for a grant to this node's account.
    pub async fn faucet(&self) -> anyhow::Result<api::Submitted> {
        self.ask(Command::WalletFaucet).await?
    }

    /// Computes the task the newest block seeds for this node and sends its result.
    pub async fn compute(&self, n: u32) -> anyhow::Result<api::Computed> {
        self.ask(|tx| Command::Compute(n, tx)).await?
    }

    /// A transaction the ledger took, and where.
    pub async fn tx(&self, id: cannabis_protocol::Digest) -> anyhow::Result<api::TxDetail> {
        self.ask(|tx| Command::Tx(id, tx)).await?
    }

    /// A job's escrow as this node's ledger holds it.
    pub async fn escrow(
        &self,
        job: cannabis_protocol::Uuid,
    ) -> anyhow::Result<cannabis_market::ledger::Escrow> {
        self.ask(|tx| Command::Escrow(job, tx)).await?
    }

    /// Hands a transaction signed elsewhere to the sequencer.
    pub async fn submit_tx(
        &self,
        signed: cannabis_protocol::Signed<cannabis_protocol::Transaction>,
    ) -> anyhow::Result<api::Submitted> {
        self.ask(|tx| Command::SubmitTx(Box::new(signed), tx))
            .await?
    }

    /// Where a result is in the ledger, with its inclusion proof.
    pub async fn prove(&self, id: cannabis_protocol::Digest) -> anyhow::Result<api::ResultProof> {
        self.ask(|tx| Command::Prove(id, tx)).await?
    }

    /// Connected peers.
    pub async fn peers(&self) -> anyhow::Result<Vec<api::Peer>> {
        self.ask(Command::Peers).await
    }

    /// Live capability ads.
    pub async fn ads(&self) -> anyhow::Result<Vec<api::Ad>> {
        self.ask(Command::Ads).await
    }

    /// Open offers.
    pub async fn offers(&self) -> anyhow::Result<Vec<api::Offer>> {
        self.ask(Command::Offers).await
    }

    /// Bids received for this node's offers.
    pub async fn bids(&self) -> anyhow::Result<Vec<api::ReceivedBid>> {
        self.ask(Command::Bids).await
    }

    /// Publishes an offer.
    pub async fn publish_offer(&self, template: OfferTemplate) -> anyhow::Result<api::Published> {
        self.ask(|tx| Command::PublishOffer(template, tx)).await?
    }

    /// Publishes an offer and starts its job: bids, placement, leases.
    pub async fn submit_job(&self, template: OfferTemplate) -> anyhow::Result<api::JobSummary> {
        self.ask(|tx| Command::SubmitJob(template, tx)).await?
    }

    /// Jobs this node published.
    pub async fn jobs(&self) -> anyhow::Result<Vec<api::JobSummary>> {
        self.ask(Command::Jobs).await
    }

    /// Leases this node holds (or held lately) as a worker.
    pub async fn leases(&self) -> anyhow::Result<Vec<api::HeldLease>> {
        self.ask(Command::Leases).await
    }

    /// One job with every task, lease and event.
    pub async fn job(&self, id: cannabis_protocol::Uuid) -> anyhow::Result<api::JobDetail> {
        self.ask(|tx| Command::Job(id, tx)).await?
    }

    /// Cancels a job: every live lease gets a cancellation.
    pub async fn cancel_job(&self, id: cannabis_protocol::Uuid) -> anyhow::Result<api::JobSummary> {
        self.ask(|tx| Command::CancelJob(id, tx)).await?
    }

    /// On a testnet: refuses these peers until a later call leaves them out.
    pub async fn partition(&self, peers: Vec<PeerId>) -> anyhow::Result<usize> {
        self.ask(|tx| Command::Partition(peers, tx)).await?
    }

    /// On a testnet: this node's deliveries carry wrong outputs (`on`), or right ones.
    pub async fn corrupt(&self, on: bool) -> anyhow::Result<()> {
        self.ask(|tx| Command::Corrupt(on, tx)).await?
    }

    /// On a testnet: every TCP link of this node delayed and lossy, or plain again.
    pub async fn slow(&self, slow: api::Slow) -> anyhow::Result<()> {
        self.ask(|tx| Command::Slow(slow, tx)).await?
    }

    /// Accepts or disputes what a job delivered.
    pub async fn judge_job(
        &self,
        id: cannabis_protocol::Uuid,
        verdict: api::Verdict,
    ) -> anyhow::Result<api::JobDetail> {
        self.ask(|tx| Command::JudgeJob(id, verdict, tx)).await?
    }

    /// How each task of a template matches the ads this node knows.
    pub async fn explain(
        &self,
        template: OfferTemplate,
    ) -> anyhow::Result<Vec<api::TaskExplanation>> {
        self.ask(|tx| Command::Explain(template, tx)).await?
    }

    /// Re-makes and publishes this node's capability ad now.
    pub async fn publish_ad(&self) -> anyhow::Result<()> {
        self.ask(Command::PublishAd).await?
    }

    /// Sends a market request to a peer and waits for the answer.
    pub async fn market(
        &self,
        peer: PeerId,
        request: MarketRequest,
    ) -> anyhow::Result<MarketResponse> {
        self.ask(|reply| Command::Market {
            peer,
            request,
            reply,
        })
        .await?
    }

    /// Asks a peer for one chunk on the transfer protocol and waits for the answer.
    pub async fn transfer(
        &self,
        peer: PeerId,
        request: cannabis_protocol::TransferRequest,
    ) -> anyhow::Result<cannabis_protocol::TransferResponse> {
        self.ask(|reply| Command::Transfer {
            peer,
            request,
            reply,
        })
        .await?
        .map_err(anyhow::Error::msg)
    }

    /// Sets `peer` the capability challenge, sized from its ad, and checks the answer.
    pub async fn challenge(&self, peer: PeerId) -> anyhow::Result<api::ChallengeReport> {
        self.ask(|tx| Command::Challenge(peer, tx)).await?
    }

    /// Dials an address.
    pub async fn dial(&self, addr: Multiaddr) -> anyhow::Result<()> {
        self.ask(|tx| Command::Dial(addr, tx)).await?
    }

    /// `count` sequential market-protocol round trips to `peer`, in microseconds each.
    pub async fn ping(&self, peer: PeerId, count: u32) -> anyhow::Result<api::PingReport> {
        let mut rtt_us = Vec::new();
        for nonce in 0..u64::from(count) {
            let started = Instant::now();
            match self.market(peer, MarketRequest::Ping { nonce }).await? {
                MarketResponse::Pong { nonce: n } if n == nonce => {}
                other => anyhow::bail!("{peer} answered a ping with {other:?}"),
            }
            rtt_us.push(u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX));
        }
        Ok(api::PingReport {
            peer_id: peer.to_string(),
            rtt_us,
        })
    }
}
