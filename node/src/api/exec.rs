//! `/v1/exec/...`: the local executor, for the owner (and the administrator's clear). The
//! network side of the node has no route here: only a holder of the API token can change
//! the owner's switch or stop work.

use axum::extract::{Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use cannabis_runtime::exec::{
    Attempt, AttemptRequest, Chunk, Control, ExecError, LimitsFile, Orphan, layer_name,
};

use crate::exec::{ExecMode, ExecutorHandle};
use serde::{Deserialize, Serialize};

use super::{AppState, Error};

/// The executor as `GET /v1/exec` shows it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExecStatus {
    /// Why there is no executor, if there is none.
    pub unavailable: Option<String>,
    /// Where work runs: in the node's process or through a supervisor.
    #[serde(default)]
    pub mode: Option<ExecMode>,
    /// The owner's switch.
    pub control: Option<Control>,
    /// Isolation layers seen in effect at start-up.
    pub layers: Vec<String>,
    /// The cgroups in use.
    pub cgroups: String,
    /// The owner's limits in force.
    pub limits: Option<cannabis_runtime::exec::Limits>,
    /// Where the ceilings came from (`None`: the machine is the ceiling).
    pub ceilings: Option<String>,
    /// Capacity held now.
    pub reserved: Option<cannabis_runtime::exec::Reservation>,
}

/// Body of `POST /v1/exec/control`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ControlBody {
    /// The switch to set.
    pub control: Control,
}

/// Body of `POST /v1/exec/attempts/{id}/retry`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RetryBody {
    /// The new attempt's request id.
    pub request_id: String,
}

#[derive(Deserialize)]
struct OutputQuery {
    offset: Option<u64>,
    max: Option<u64>,
}

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/exec", get(status))
        .route("/v1/exec/control", post(control))
        .route("/v1/exec/limits", post(limits))
        .route("/v1/exec/attempts", get(attempts).post(submit))
        .route("/v1/exec/attempts/{id}", get(attempt))
        .route("/v1/exec/attempts/{id}/stop", post(stop))
        .route("/v1/exec/attempts/{id}/retry", post(retry))
        .route("/v1/exec/attempts/{id}/clear", post(clear))
        .route("/v1/exec/attempts/{id}/output/{name}", get(output))
        .route("/v1/exec/orphans", get(orphans))
}

async fn executor(s: &AppState) -> Result<ExecutorHandle, Error> {
    s.node.executor().await.map_err(|why| {
        Error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("this node has no local executor: {why}"),
        )
    })
}

fn exec_error(e: ExecError) -> Error {
    let code = match e {
        ExecError::NotFound(_) => StatusCode::NOT_FOUND,
        ExecError::Journal(_) | ExecError::Unavailable(_) => StatusCode::INTERNAL_SERVER_ERROR,
        ExecError::WrongState(_) | ExecError::Refused(_) => StatusCode::CONFLICT,
    };
    Error(code, e.to_string())
}

/// Runs a blocking executor call off the async threads.
async fn blocking<T: Send + 'static>(
    s: &AppState,
    f: impl FnOnce(ExecutorHandle) -> Result<T, ExecError> + Send + 'static,
) -> Result<Json<T>, Error> {
    let ex = executor(s).await?;
    tokio::task::spawn_blocking(move || f(ex))
        .await
        .map_err(|e| Error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map(Json)
        .map_err(exec_error)
}

pub(super) async fn status_of(s: &AppState) -> ExecStatus {
    let unavailable = |why: String, mode: Option<ExecMode>| ExecStatus {
        unavailable: Some(why),
        mode,
        control: None,
        layers: Vec::new(),
        cgroups: String::new(),
        limits: None,
        ceilings: None,
        reserved: None,
    };
    let ex = match s.node.executor().await {
        Err(why) => return unavailable(why, None),
        Ok(ex) => ex,
    };
    let mode = ex.mode();
    let info = tokio::task::spawn_blocking(move || ex.info()).await;
    match info {
        Err(e) => unavailable(e.to_string(), Some(mode)),
        Ok(Err(e)) => unavailable(e.to_string(), Some(mode)),
        Ok(Ok(info)) => ExecStatus {
            unavailable: None,
            mode: Some(mode),
            control: Some(info.control),
            layers: info.layers.iter().map(|l| layer_name(*l)).collect(),
            cgroups: info.cgroups,
            limits: Some(info.limits),
            ceilings: info.ceilings.map(|p| p.display().to_string()),
            reserved: Some(info.reserved),
        },
    }
}

async fn status(State(s): State<AppState>) -> Json<ExecStatus> {
    Json(status_of(&s).await)
}

async fn control(
    State(s): State<AppState>,
    Json(body): Json<ControlBody>,
) -> Result<Json<ExecStatus>, Error> {
    let _ = blocking(&s, move |ex| ex.set_control(body.control)).await?;
    readvertise(&s).await;
    Ok(Json(status_of(&s).await))
}

/// The owner's new limits, each within the administrator's ceilings.
async fn limits(
    State(s): State<AppState>,
    Json(body): Json<LimitsFile>,
) -> Result<Json<ExecStatus>, Error> {
    let _ = blocking(&s, move |ex| ex.set_owner_limits(&body)).await?;
    readvertise(&s).await;
    Ok(Json(status_of(&s).await))
}

/// The ad offers what the executor takes now: after the owner changed it, a new ad.
async fn readvertise(s: &AppState) {
    if let Err(e) = s.node.publish_ad().await {
        tracing::warn!(error = %format!("{e:#}"), "the capability ad was not re-published");
    }
}

async fn attempts(State(s): State<AppState>) -> Result<Json<Vec<Attempt>>, Error> {
    blocking(&s, |ex| ex.attempts()).await
}

async fn orphans(State(s): State<AppState>) -> Result<Json<Vec<Orphan>>, Error> {
    blocking(&s, |ex| ex.orphans()).await
}

async fn submit(
    State(s): State<AppState>,
    Json(request): Json<AttemptRequest>,
) -> Result<Json<Attempt>, Error> {
    blocking(&s, move |ex| ex.submit(request)).await
}

async fn attempt(
    State(s): State<AppState>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<Attempt>, Error> {
    blocking(&s, move |ex| ex.get(&id)).await
}

async fn stop(
    State(s): State<AppState>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<Attempt>, Error> {
    blocking(&s, move |ex| ex.stop(&id, "stopped by the owner")).await
}

async fn retry(
    State(s): State<AppState>,
    UrlPath(id): UrlPath<String>,
    Json(body): Json<RetryBody>,
) -> Result<Json<Attempt>, Error> {
    blocking(&s, move |ex| ex.retry(&id, body.request_id)).await
}

async fn clear(
    State(s): State<AppState>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<serde_json::Value>, Error> {
    blocking(&s, move |ex| {
        ex.clear(&id)?;
        Ok(serde_json::json!({ "cleared": id }))
    })
    .await
}

async fn output(
    State(s): State<AppState>,
    UrlPath((id, name)): UrlPath<(String, String)>,
    Query(q): Query<OutputQuery>,
) -> Result<Json<Chunk>, Error> {
    let offset = q.offset.unwrap_or(0);
    let max = q.max.unwrap_or(cannabis_runtime::exec::MAX_CHUNK);
    blocking(&s, move |ex| ex.read_output(&id, &name, offset, max)).await
}
