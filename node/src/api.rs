//! The local control API: JSON over HTTP on loopback, for the CLI and scripts.
//!
//! Every request must carry `Authorization: Bearer <token>`, where the token is the content
//! of `api.token` in the data directory (created with mode 0600 on first start). Anyone who
//! can read that file can control the node; nobody else can. The web dashboard ([`ui`])
//! logs in with that token and then calls the same endpoints with a session cookie, a CSRF
//! token and its own origin.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::Context as _;
use axum::extract::{Path as UrlPath, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use cannabis_api::{self as api, ApiError};
use serde::Deserialize;

use crate::keystore;

pub mod exec;
pub mod ui;
use crate::service::{NodeHandle, OfferTemplate};

/// The token file's name in the data directory.
pub const TOKEN_FILE: &str = "api.token";

/// Reads the API token, creating it (0600) on first use.
pub fn ensure_token(data_dir: &Path) -> anyhow::Result<String> {
    let path = data_dir.join(TOKEN_FILE);
    if path.exists() {
        return read_token(data_dir);
    }
    let token = hex::encode(*keystore::random_bytes::<32>()?);
    keystore::write_private(&path, token.as_bytes())?;
    Ok(token)
}

/// Reads the API token of the node whose data directory is `data_dir`.
pub fn read_token(data_dir: &Path) -> anyhow::Result<String> {
    let path = data_dir.join(TOKEN_FILE);
    let bytes = keystore::read_private(&path).with_context(|| {
        format!(
            "reading the API token (is a node running with data dir {}?)",
            data_dir.display()
        )
    })?;
    Ok(String::from_utf8_lossy(&bytes).trim().to_string())
}

struct Error(StatusCode, String);

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        (self.0, Json(ApiError { error: self.1 })).into_response()
    }
}

impl From<anyhow::Error> for Error {
    fn from(e: anyhow::Error) -> Self {
        Error(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}"))
    }
}

#[derive(Clone)]
struct AppState {
    node: NodeHandle,
    token: std::sync::Arc<str>,
    /// The dashboard's sessions ([`ui`]).
    sessions: std::sync::Arc<ui::Sessions>,
    /// Turns true when the API stops: streams that would never end by themselves (the
    /// dashboard's events) end then.
    stopping: tokio::sync::watch::Receiver<bool>,
}

/// The running API: [`Server::stop`] ends it.
pub struct Server {
    task: tokio::task::JoinHandle<()>,
    stop: tokio::sync::watch::Sender<bool>,
}

impl Server {
    /// Stops taking connections, closes idle ones, ends the event streams and waits (a
    /// few seconds at most) for requests under way; the node's handles the connections
    /// held are then gone, so the node can stop.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let mut task = self.task;
        if tokio::time::timeout(std::time::Duration::from_secs(3), &mut task)
            .await
            .is_err()
        {
            task.abort();
            let _ = task.await;
        }
    }
}

async fn auth(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match presented {
        Some(t) if constant_time_eq(t.as_bytes(), state.token.as_bytes()) => {
            next.run(request).await
        }
        // The dashboard: a session's cookie, from its own origin, with its CSRF token.
        None => match ui::check_session(&state, &request) {
            Some(Ok(())) => next.run(request).await,
            Some(Err(e)) => e.into_response(),
            None => Error(
                StatusCode::UNAUTHORIZED,
                "missing or wrong API token: send `Authorization: Bearer <contents of api.token>`"
                    .into(),
            )
            .into_response(),
        },
        _ => Error(
            StatusCode::UNAUTHORIZED,
            "missing or wrong API token: send `Authorization: Bearer <contents of api.token>`"
                .into(),
        )
        .into_response(),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Binds the API listener. Refuses anything but a loopback address.
pub async fn bind(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    anyhow::ensure!(
        addr.ip().is_loopback(),
        "the local API must listen on loopback (127.0.0.1 or ::1), not {addr}"
    );
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the local API on {addr}"))
}

/// Serves the API on `listener` until the task is dropped.
pub fn serve(listener: tokio::net::TcpListener, node: NodeHandle, token: String) -> Server {
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let state = AppState {
        node,
        token: token.into(),
        sessions: Default::default(),
        stopping: stopping.clone(),
    };
    let app = Router::new()
        .route("/v1/status", get(status))
        .route("/v1/peers", get(peers))
        .route("/v1/peers/{peer}/ping", post(ping))
        .route("/v1/peers/{peer}/challenge", post(challenge))
        .route("/v1/market/ads", get(ads))
        .route("/v1/market/offers", get(offers))
        .route("/v1/market/bids", get(bids))
        .route("/v1/offers", post(publish_offer))
        .route("/v1/jobs", get(jobs).post(submit_job))
        .route("/v1/jobs/explain", post(explain))
        .route("/v1/jobs/{id}", get(job))
        .route("/v1/jobs/{id}/cancel", post(cancel_job))
        .route("/v1/jobs/{id}/accept", post(judge_job))
        .route("/v1/jobs/{id}/dispute", post(judge_job))
        .route("/v1/jobs/{id}/evaluate", post(judge_job))
        .route("/v1/leases", get(leases))
        .route("/v1/testnet/partition", post(partition))
        .route("/v1/testnet/corrupt", post(corrupt))
        .route("/v1/testnet/slow", post(slow))
        .route("/v1/ledger", get(ledger_status))
        .route("/v1/ledger/blocks", get(ledger_blocks))
        .route("/v1/ledger/blocks/{height}", get(ledger_block))
        .route("/v1/ledger/compute", post(ledger_compute))
        .route("/v1/ledger/results/{id}/proof", get(ledger_prove))
        .route("/v1/ledger/txs/{id}", get(ledger_tx))
        .route("/v1/ledger/escrows/{job}", get(ledger_escrow))
        .route("/v1/ledger/submit", post(ledger_submit))
        .route("/v1/wallet/send", post(wallet_send))
        .route("/v1/wallet/faucet", post(wallet_faucet))
        .route("/v1/wallet/{address}", get(wallet_balance))
        .merge(exec::routes())
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        // Prometheus scrapes without the token: the API listens on loopback only, and
        // the figures name no secret.
        .route("/metrics", get(metrics))
        .merge(ui::routes())
        .with_state(state);
    let mut until = stopping;
    let task = tokio::spawn(async move {
        let stopped = async move {
            let _ = until.wait_for(|s| *s).await;
        };
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(stopped)
            .await
        {
            tracing::error!(error = %e, "local API stopped");
        }
    });
    Server { task, stop }
}

async fn ledger_status(State(s): State<AppState>) -> Result<Json<api::LedgerStatus>, Error> {
    s.node
        .ledger()
        .await
        .map(Json)
        .map_err(|e| Error(StatusCode::NOT_FOUND, format!("{e:#}")))
}

#[derive(Deserialize)]
struct BlocksQuery {
    limit: Option<u32>,
}

async fn ledger_blocks(
    State(s): State<AppState>,
    Query(q): Query<BlocksQuery>,
) -> Result<Json<Vec<api::BlockSummary>>, Error> {
    s.node
        .blocks(q.limit.unwrap_or(20))
        .await
        .map(Json)
        .map_err(|e| Error(StatusCode::NOT_FOUND, format!("{e:#}")))
}

async fn ledger_block(
    State(s): State<AppState>,
    UrlPath(height): UrlPath<u64>,
) -> Result<Json<api::BlockDetail>, Error> {
    s.node
        .block(height)
        .await
        .map(Json)
        .map_err(|e| Error(StatusCode::NOT_FOUND, format!("{e:#}")))
}

#[derive(Deserialize)]
struct ComputeQuery {
    size: Option<u32>,
}

async fn ledger_compute(
    State(s): State<AppState>,
    Query(q): Query<ComputeQuery>,
) -> Result<Json<api::Computed>, Error> {
    s.node
        .compute(q.size.unwrap_or(1024))
        .await
        .map(Json)
        .map_err(|e| Error(StatusCode::BAD_REQUEST, format!("{e:#}")))
}

async fn ledger_prove(
    State(s): State<AppState>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<api::ResultProof>, Error> {
    let id = id.parse().map_err(|e| {
        Error(
            StatusCode::BAD_REQUEST,
            format!("{id:?} is not a result id: {e}"),
        )
    })?;
    s.node
        .prove(id)
        .await
        .map(Json)
        .map_err(|e| Error(StatusCode::NOT_FOUND, format!("{e:#}")))
}

async fn ledger_escrow(
    State(s): State<AppState>,
    UrlPath(job): UrlPath<String>,
) -> Result<Json<cannabis_market::ledger::Escrow>, Error> {
    let job = job_id(&job)?;
    s.node
        .escrow(job)
        .await
        .map(Json)
        .map_err(|e| Error(StatusCode::NOT_FOUND, format!("{e:#}")))
}

async fn ledger_submit(
    State(s): State<AppState>,
    Json(req): Json<api::SubmitTx>,
) -> Result<Json<api::Submitted>, Error> {
    let bad = |e: String| Error(StatusCode::BAD_REQUEST, e);
    let bytes = hex::decode(req.tx.trim()).map_err(|e| bad(format!("tx is not hex: {e}")))?;
    let signed = cannabis_protocol::Signed::<cannabis_protocol::Transaction>::from_bytes(&bytes)
        .map_err(|e| bad(format!("tx is not a signed transaction: {e}")))?;
    s.node
        .submit_tx(signed)
        .await
        .map(Json)
        .map_err(|e| bad(format!("{e:#}")))
}

async fn ledger_tx(
    State(s): State<AppState>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<api::TxDetail>, Error> {
    let id = id.parse().map_err(|e| {
        Error(
            StatusCode::BAD_REQUEST,
            format!("{id:?} is not a transaction id: {e}"),
        )
    })?;
    s.node
        .tx(id)
        .await
        .map(Json)
        .map_err(|e| Error(StatusCode::NOT_FOUND, format!("{e:#}")))
}

fn address(text: &str) -> Result<cannabis_protocol::Address, Error> {
    text.parse().map_err(|e| {
        Error(
            StatusCode::BAD_REQUEST,
            format!("{text:?} is not a cpc1 address: {e}"),
        )
    })
}

async fn wallet_balance(
    State(s): State<AppState>,
    UrlPath(who): UrlPath<String>,
) -> Result<Json<api::Balance>, Error> {
    let who = if who == "me" {
        None
    } else {
        Some(address(&who)?)
    };
    s.node
        .balance(who)
        .await
        .map(Json)
        .map_err(|e| Error(StatusCode::NOT_FOUND, format!("{e:#}")))
}

async fn wallet_send(
    State(s): State<AppState>,
    Json(req): Json<api::SendRequest>,
) -> Result<Json<api::Submitted>, Error> {
    let to = address(&req.to)?;
    s.node
        .send(to, req.amount)
        .await
        .map(Json)
        .map_err(|e| Error(StatusCode::BAD_REQUEST, format!("{e:#}")))
}

async fn wallet_faucet(State(s): State<AppState>) -> Result<Json<api::Submitted>, Error> {
    s.node
        .faucet()
        .await
        .map(Json)
        .map_err(|e| Error(StatusCode::BAD_REQUEST, format!("{e:#}")))
}

async fn status(State(s): State<AppState>) -> Result<Json<api::Status>, Error> {
    Ok(Json(s.node.status().await?))
}

async fn peers(State(s): State<AppState>) -> Result<Json<Vec<api::Peer>>, Error> {
    Ok(Json(s.node.peers().await?))
}

async fn ads(State(s): State<AppState>) -> Result<Json<Vec<api::Ad>>, Error> {
    Ok(Json(s.node.ads().await?))
}

async fn offers(State(s): State<AppState>) -> Result<Json<Vec<api::Offer>>, Error> {
    Ok(Json(s.node.offers().await?))
}

async fn bids(State(s): State<AppState>) -> Result<Json<Vec<api::ReceivedBid>>, Error> {
    Ok(Json(s.node.bids().await?))
}

async fn publish_offer(
    State(s): State<AppState>,
    Json(template): Json<OfferTemplate>,
) -> Result<Json<api::Published>, Error> {
    s.node
        .publish_offer(template)
        .await
        .map(Json)
        .map_err(|e| Error(StatusCode::BAD_REQUEST, format!("{e:#}")))
}

async fn submit_job(
    State(s): State<AppState>,
    Json(template): Json<OfferTemplate>,
) -> Result<Json<api::JobSummary>, Error> {
    s.node
        .submit_job(template)
        .await
        .map(Json)
        .map_err(|e| Error(StatusCode::BAD_REQUEST, format!("{e:#}")))
}

async fn explain(
    State(s): State<AppState>,
    Json(template): Json<OfferTemplate>,
) -> Result<Json<Vec<api::TaskExplanation>>, Error> {
    Ok(Json(s.node.explain(template).await?))
}

async fn leases(State(s): State<AppState>) -> Result<Json<Vec<api::HeldLease>>, Error> {
    Ok(Json(s.node.leases().await?))
}

async fn jobs(State(s): State<AppState>) -> Result<Json<Vec<api::JobSummary>>, Error> {
    Ok(Json(s.node.jobs().await?))
}

fn job_id(id: &str) -> Result<cannabis_protocol::Uuid, Error> {
    id.parse().map_err(|e| {
        Error(
            StatusCode::BAD_REQUEST,
            format!("{id:?} is not a job id: {e}"),
        )
    })
}

async fn job(
    State(s): State<AppState>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<api::JobDetail>, Error> {
    let id = job_id(&id)?;
    s.node
        .job(id)
        .await
        .map(Json)
        .map_err(|e| Error(StatusCode::NOT_FOUND, format!("{e:#}")))
}

async fn cancel_job(
    State(s): State<AppState>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<api::JobSummary>, Error> {
    let id = job_id(&id)?;
    s.node
        .cancel_job(id)
        .await
        .map(Json)
        .map_err(|e| Error(StatusCode::BAD_REQUEST, format!("{e:#}")))
}

async fn metrics(State(s): State<AppState>) -> Result<impl IntoResponse, Error> {
    let text = s
        .node
        .metrics()
        .await
        .map_err(|e| Error(StatusCode::SERVICE_UNAVAILABLE, format!("{e:#}")))?;
    Ok((
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    ))
}

async fn partition(
    State(s): State<AppState>,
    Json(body): Json<api::Partition>,
) -> Result<Json<api::Partition>, Error> {
    let peers = body
        .peers
        .iter()
        .map(|p| p.parse::<libp2p::PeerId>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error(StatusCode::BAD_REQUEST, format!("a peer id: {e}")))?;
    s.node
        .partition(peers)
        .await
        .map(|_| Json(body))
        .map_err(|e| Error(StatusCode::BAD_REQUEST, format!("{e:#}")))
}

async fn corrupt(
    State(s): State<AppState>,
    Json(body): Json<api::Corrupt>,
) -> Result<Json<api::Corrupt>, Error> {
    s.node
        .corrupt(body.on)
        .await
        .map(|_| Json(body))
        .map_err(|e| Error(StatusCode::BAD_REQUEST, format!("{e:#}")))
}

async fn slow(
    State(s): State<AppState>,
    Json(body): Json<api::Slow>,
) -> Result<Json<api::Slow>, Error> {
    if body.loss_ppm > 1_000_000 || body.delay_ms > 60_000 {
        return Err(Error(
            StatusCode::BAD_REQUEST,
            "delay_ms is at most 60000 and loss_ppm at most 1000000".into(),
        ));
    }
    s.node
        .slow(body.clone())
        .await
        .map(|_| Json(body))
        .map_err(|e| Error(StatusCode::BAD_REQUEST, format!("{e:#}")))
}

async fn judge_job(
    State(s): State<AppState>,
    UrlPath(id): UrlPath<String>,
    Json(verdict): Json<api::Verdict>,
) -> Result<Json<api::JobDetail>, Error> {
    let id = job_id(&id)?;
    s.node
        .judge_job(id, verdict)
        .await
        .map(Json)
        .map_err(|e| Error(StatusCode::BAD_REQUEST, format!("{e:#}")))
}

#[derive(Deserialize)]
struct PingQuery {
    count: Option<u32>,
}

async fn ping(
    State(s): State<AppState>,
    UrlPath(peer): UrlPath<String>,
    Query(q): Query<PingQuery>,
) -> Result<Json<api::PingReport>, Error> {
    let peer = peer.parse().map_err(|e| {
        Error(
            StatusCode::BAD_REQUEST,
            format!("{peer:?} is not a peer id: {e}"),
        )
    })?;
    let count = q.count.unwrap_or(10).clamp(1, 10_000);
    Ok(Json(s.node.ping(peer, count).await?))
}

async fn challenge(
    State(s): State<AppState>,
    UrlPath(peer): UrlPath<String>,
) -> Result<Json<api::ChallengeReport>, Error> {
    let peer = peer.parse().map_err(|e| {
        Error(
            StatusCode::BAD_REQUEST,
            format!("{peer:?} is not a peer id: {e}"),
        )
    })?;
    Ok(Json(s.node.challenge(peer).await?))
}
