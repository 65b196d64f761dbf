//! A blocking client of a node's local API, found through the node's data directory
//! (`node.json` says where the API listens, `api.token` holds the token).

use std::path::Path;
use std::time::Duration;

use crate::types as api;
use anyhow::Context as _;
use serde::de::DeserializeOwned;

/// A client of one node's local API.
#[derive(Clone)]
pub struct ApiClient {
    base: String,
    token: String,
    agent: ureq::Agent,
}

/// What a node writes to `node.json` in its data directory once it listens.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct NodeInfo {
    /// libp2p peer id.
    pub peer_id: String,
    /// `cpc1...` address.
    pub address: String,
    /// Swarm listen addresses.
    pub listen_addrs: Vec<String>,
    /// Local API address.
    pub api: Option<String>,
    /// Process id.
    pub pid: u32,
}

impl NodeInfo {
    /// Reads `node.json` from a data directory.
    pub fn read(data_dir: &Path) -> anyhow::Result<NodeInfo> {
        let path = data_dir.join("node.json");
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "reading {} (is a node running with --data-dir {}? start one with `cannabis node run`)",
                path.display(),
                data_dir.display()
            )
        })?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }
}

impl ApiClient {
    /// A client for `http://{api}` with `token`.
    pub fn new(api: &str, token: &str) -> Self {
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(60)))
            .http_status_as_error(false)
            .build()
            .into();
        Self {
            base: format!("http://{api}"),
            token: token.to_string(),
            agent,
        }
    }

    /// The client of the node whose data directory is `data_dir`.
    pub fn from_data_dir(data_dir: &Path) -> anyhow::Result<Self> {
        let info = NodeInfo::read(data_dir)?;
        let api = info
            .api
            .context("the node's local API is not listening (node.json has no api)")?;
        let token_path = data_dir.join("api.token");
        let token = std::fs::read_to_string(&token_path)
            .with_context(|| format!("reading the API token {}", token_path.display()))?;
        Ok(Self::new(&api, token.trim()))
    }

    /// `GET path`, decoded from JSON.
    pub fn get<T: DeserializeOwned>(&self, path: &str) -> anyhow::Result<T> {
        let response = self
            .agent
            .get(format!("{}{path}", self.base))
            .header("Authorization", format!("Bearer {}", self.token))
            .call()
            .with_context(|| format!("calling the node's API at {}", self.base))?;
        Self::read(response, path)
    }

    /// `POST path` with a JSON body, decoded from JSON.
    pub fn post<B: serde::Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> anyhow::Result<T> {
        let response = self
            .agent
            .post(format!("{}{path}", self.base))
            .header("Authorization", format!("Bearer {}", self.token))
            .send_json(body)
            .with_context(|| format!("calling the node's API at {}", self.base))?;
        Self::read(response, path)
    }

    fn read<T: DeserializeOwned>(
        mut response: ureq::http::Response<ureq::Body>,
        path: &str,
    ) -> anyhow::Result<T> {
        let status = response.status();
        if !status.is_success() {
            let body: Result<api::ApiError, _> = response.body_mut().read_json();
            match body {
                Ok(e) => anyhow::bail!("{path}: {}", e.error),
                Err(_) => anyhow::bail!("{path}: HTTP {status}"),
            }
        }
        response
            .body_mut()
            .read_json()
            .with_context(|| format!("reading the answer to {path}"))
    }

    /// `GET /v1/status`
    pub fn status(&self) -> anyhow::Result<api::Status> {
        self.get("/v1/status")
    }

    /// `GET /v1/peers`
    pub fn peers(&self) -> anyhow::Result<Vec<api::Peer>> {
        self.get("/v1/peers")
    }

    /// `GET /v1/market/ads`
    pub fn ads(&self) -> anyhow::Result<Vec<api::Ad>> {
        self.get("/v1/market/ads")
    }

    /// `GET /v1/market/offers`
    pub fn offers(&self) -> anyhow::Result<Vec<api::Offer>> {
        self.get("/v1/market/offers")
    }

    /// `GET /v1/market/bids`
    pub fn bids(&self) -> anyhow::Result<Vec<api::ReceivedBid>> {
        self.get("/v1/market/bids")
    }

    /// `POST /v1/offers`
    pub fn publish_offer(&self, template: &api::OfferTemplate) -> anyhow::Result<api::Published> {
        self.post("/v1/offers", template)
    }

    /// `POST /v1/jobs`
    pub fn submit_job(&self, template: &api::OfferTemplate) -> anyhow::Result<api::JobSummary> {
        self.post("/v1/jobs", template)
    }

    /// `POST /v1/jobs/explain`
    pub fn explain(
        &self,
        template: &api::OfferTemplate,
    ) -> anyhow::Result<Vec<api::TaskExplanation>> {
        self.post("/v1/jobs/explain", template)
    }

    /// `GET /v1/leases`
    pub fn leases(&self) -> anyhow::Result<Vec<api::HeldLease>> {
        self.get("/v1/leases")
    }

    /// `GET /v1/jobs`
    pub fn jobs(&self) -> anyhow::Result<Vec<api::JobSummary>> {
        self.get("/v1/jobs")
    }

    /// `GET /v1/jobs/{id}`
    pub fn job(&self, id: &str) -> anyhow::Result<api::JobDetail> {
        self.get(&format!("/v1/jobs/{id}"))
    }

    /// `POST /v1/jobs/{id}/cancel`
    pub fn cancel_job(&self, id: &str) -> anyhow::Result<api::JobSummary> {
        self.post(&format!("/v1/jobs/{id}/cancel"), &())
    }

    /// `POST /v1/jobs/{id}/accept`, `/dispute` or `/evaluate`
    pub fn judge_job(&self, id: &str, verdict: &api::Verdict) -> anyhow::Result<api::JobDetail> {
        let what = match verdict {
            api::Verdict::Accept { .. } => "accept",
            api::Verdict::Dispute { .. } => "dispute",
            api::Verdict::Evaluate => "evaluate",
        };
        self.post(&format!("/v1/jobs/{id}/{what}"), verdict)
    }

    /// `POST /v1/peers/{peer}/challenge`
    pub fn challenge(&self, peer: &str) -> anyhow::Result<api::ChallengeReport> {
        self.post(&format!("/v1/peers/{peer}/challenge"), &())
    }

    /// `POST /v1/peers/{peer}/ping?count=N`
    pub fn ping(&self, peer: &str, count: u32) -> anyhow::Result<api::PingReport> {
        self.post(&format!("/v1/peers/{peer}/ping?count={count}"), &())
    }

    /// The embedded ledger as the node holds it.
    pub fn ledger(&self) -> anyhow::Result<api::LedgerStatus> {
        self.get("/v1/ledger")
    }

    /// An account (the node's own when `address` is `None`).
    pub fn balance(&self, address: Option<&str>) -> anyhow::Result<api::Balance> {
        self.get(&format!("/v1/wallet/{}", address.unwrap_or("me")))
    }

    /// Sends `amount` from the node's account to `to`.
    pub fn send(
        &self,
        to: &str,
        amount: cannabis_protocol::Amount,
    ) -> anyhow::Result<api::Submitted> {
        let body = api::SendRequest {
            to: to.to_string(),
            amount,
        };
        self.post("/v1/wallet/send", &body)
    }

    /// Asks the testnet's faucet for a grant to the node's account.
    pub fn faucet(&self) -> anyhow::Result<api::Submitted> {
        self.post("/v1/wallet/faucet", &())
    }

    /// The latest blocks, newest first (at most `limit`).
    pub fn blocks(&self, limit: u32) -> anyhow::Result<Vec<api::BlockSummary>> {
        self.get(&format!("/v1/ledger/blocks?limit={limit}"))
    }

    /// One block with its transactions.
    pub fn block(&self, height: u64) -> anyhow::Result<api::BlockDetail> {
        self.get(&format!("/v1/ledger/blocks/{height}"))
    }

    /// Computes the proof-of-compute task the newest block seeds for this node, and sends
    /// its result to the ledger.
    pub fn compute(&self, n: u32) -> anyhow::Result<api::Computed> {
        self.post(&format!("/v1/ledger/compute?size={n}"), &())
    }

    /// Where a result is in the ledger, with its inclusion proof.
    pub fn prove(&self, result_id: &str) -> anyhow::Result<api::ResultProof> {
        self.get(&format!("/v1/ledger/results/{result_id}/proof"))
    }

    /// A transaction the ledger took, and where.
    pub fn tx(&self, id: &str) -> anyhow::Result<api::TxDetail> {
        self.get(&format!("/v1/ledger/txs/{id}"))
    }

    /// `GET /v1/ledger/escrows/{job}`
    pub fn escrow(&self, job: &str) -> anyhow::Result<cannabis_market::ledger::Escrow> {
        self.get(&format!("/v1/ledger/escrows/{job}"))
    }

    /// `POST /v1/ledger/submit`
    pub fn submit_tx(&self, tx: &api::SubmitTx) -> anyhow::Result<api::Submitted> {
        self.post("/v1/ledger/submit", tx)
    }
}
