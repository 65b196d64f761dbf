//! The web dashboard: a page the node serves on its API's (loopback) address, for the owner
//! to glance at the node and for a requester to watch jobs.
//!
//! It is the API itself, seen from a browser. A login by the API token (the content of
//! `api.token`, typed into a form: never in a URL) opens a session, kept in a cookie that is
//! `HttpOnly` (no script reads it) and `SameSite=Strict` (no other site's page sends it).
//! The page then calls the same `/v1` endpoints as the CLI, with the cookie instead of the
//! bearer token; every change (a POST) must also carry the session's CSRF token in
//! `X-CSRF-Token` and come from the page's own origin (`Origin`). Live updates come over
//! server-sent events (`/ui/events`): a summary of the node, sent when it changes, after
//! which the page fetches what it shows. The assets are compiled into the binary; the page
//! builds every element with the DOM (no HTML from data), and a strict content security
//! policy allows only its own script and style.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use serde::{Deserialize, Serialize};

use super::{AppState, Error, constant_time_eq};
use crate::keystore;

/// The session cookie's name.
pub const COOKIE: &str = "cannabis_session";
/// The header that carries a session's CSRF token on every change.
pub const CSRF_HEADER: &str = "x-csrf-token";

/// How long a session lasts.
const SESSION_LIFE: Duration = Duration::from_secs(12 * 3600);
/// Most sessions held at once (the oldest goes first).
const MAX_SESSIONS: usize = 32;
/// How often the events stream looks for a change.
const PULSE_EVERY: Duration = Duration::from_secs(1);

const INDEX: &str = include_str!("ui/index.html");
const LOGIN: &str = include_str!("ui/login.html");
const SCRIPT: &str = include_str!("ui/app.js");
const STYLE: &str = include_str!("ui/style.css");

/// Only the page's own script and style; no frames, no plug-ins, no other origin.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                      img-src 'self'; connect-src 'self'; form-action 'self'; \
                      frame-ancestors 'none'; base-uri 'none'";

/// The dashboard's sessions: a random id (the cookie) to its CSRF token and expiry.
#[derive(Default)]
pub(super) struct Sessions {
    map: Mutex<HashMap<String, Session>>,
}

#[derive(Clone)]
struct Session {
    csrf: String,
    opened: Instant,
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn open(&self) -> anyhow::Result<(String, Session)> {
        let id = hex::encode(*keystore::random_bytes::<32>()?);
        let session = Session {
            csrf: hex::encode(*keystore::random_bytes::<32>()?),
            opened: Instant::now(),
        };
        let mut map = self.lock();
        map.retain(|_, s| s.opened.elapsed() < SESSION_LIFE);
        while map.len() >= MAX_SESSIONS {
            let oldest = map
                .iter()
                .min_by_key(|(_, s)| s.opened)
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => map.remove(&k),
                None => break,
            };
        }
        map.insert(id.clone(), session.clone());
        Ok((id, session))
    }

    fn get(&self, id: &str) -> Option<Session> {
        let map = self.lock();
        // Found by comparing every id in constant time, not by a hash lookup whose timing
        // could hint at a prefix.
        map.iter()
            .find(|(k, _)| constant_time_eq(k.as_bytes(), id.as_bytes()))
            .map(|(_, s)| s.clone())
            .filter(|s| s.opened.elapsed() < SESSION_LIFE)
    }

    fn close(&self, id: &str) {
        self.lock().remove(id);
    }
}

/// The session id a request's cookie names, if any.
fn cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| c.trim().strip_prefix(COOKIE)?.strip_prefix('='))
        .map(str::to_string)
}

/// The live session of a request's cookie.
fn session_of(state: &AppState, headers: &HeaderMap) -> Option<(String, Session)> {
    let id = cookie(headers)?;
    state.sessions.get(&id).map(|s| (id, s))
}

/// Whether a request comes from the dashboard's own origin: its `Origin` (sent by browsers
/// on every POST and on cross-origin reads) names the host it was sent to, and the fetch
/// metadata, when sent, says same-origin. `required`: a missing `Origin` fails too.
fn same_origin(headers: &HeaderMap, required: bool) -> Result<(), String> {
    if let Some(site) = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok())
        && !matches!(site, "same-origin" | "none")
    {
        return Err(format!(
            "a {site} request: the dashboard takes only its own"
        ));
    }
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    match (headers.get(header::ORIGIN).map(|v| v.to_str()), host) {
        (Some(Ok(origin)), Some(host)) if origin == format!("http://{host}") => Ok(()),
        (Some(origin), _) => Err(format!(
            "a request from origin {:?}: the dashboard takes only its own",
            origin.unwrap_or("?")
        )),
        (None, _) if required => Err("a change without an Origin header".into()),
        (None, _) => Ok(()),
    }
}

/// How the API middleware takes a request without a bearer token: with a live session's
/// cookie, from the dashboard's origin, and for a change, with the session's CSRF token.
/// `None`: no session (the caller answers 401).
pub(super) fn check_session(state: &AppState, request: &Request) -> Option<Result<(), Error>> {
    let headers = request.headers();
    let (_, session) = session_of(state, headers)?;
    let change = !matches!(*request.method(), Method::GET | Method::HEAD);
    if let Err(why) = same_origin(headers, change) {
        return Some(Err(Error(StatusCode::FORBIDDEN, why)));
    }
    if change {
        let presented = headers.get(CSRF_HEADER).map(HeaderValue::as_bytes);
        if !presented.is_some_and(|p| constant_time_eq(p, session.csrf.as_bytes())) {
            return Some(Err(Error(
                StatusCode::FORBIDDEN,
                format!("missing or wrong CSRF token: send the page's token in {CSRF_HEADER}"),
            )));
        }
    }
    Some(Ok(()))
}

/// The dashboard's routes (taking no bearer token: each checks the session itself).
pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/", get(|| async { Redirect::to("/ui/") }))
        .route("/ui", get(|| async { Redirect::to("/ui/") }))
        .route("/ui/", get(index))
        .route("/ui/login", get(login_page).post(login))
        .route("/ui/logout", post(logout))
        .route("/ui/events", get(events))
        .route(
            "/ui/app.js",
            get(|| async { asset(SCRIPT, "text/javascript") }),
        )
        .route("/ui/style.css", get(|| async { asset(STYLE, "text/css") }))
}

fn page(status: StatusCode, html: String) -> Response {
    (
        status,
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            (header::CONTENT_SECURITY_POLICY, POLICY),
            (header::X_FRAME_OPTIONS, "DENY"),
            // `no-referrer` would make the browser send `Origin: null` with the page's own forms.
            (header::REFERRER_POLICY, "same-origin"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        html,
    )
        .into_response()
}

fn asset(body: &'static str, kind: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

async fn index(State(s): State<AppState>, headers: HeaderMap) -> Response {
    match session_of(&s, &headers) {
        // The CSRF token is hex: nothing to escape.
        Some((_, session)) => page(StatusCode::OK, INDEX.replace("{{CSRF}}", &session.csrf)),
        None => Redirect::to("/ui/login").into_response(),
    }
}

fn login_form(status: StatusCode, problem: &str) -> Response {
    page(status, LOGIN.replace("{{PROBLEM}}", &escape(problem)))
}

/// Text made safe to put between HTML tags (a problem may quote a request's headers).
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

async fn login_page() -> Response {
    login_form(StatusCode::OK, "")
}

#[derive(Deserialize)]
struct LoginForm {
    token: String,
}

async fn login(State(s): State<AppState>, headers: HeaderMap, form: Form<LoginForm>) -> Response {
    if let Err(why) = same_origin(&headers, false) {
        return login_form(StatusCode::FORBIDDEN, &why);
    }
    if !constant_time_eq(form.token.trim().as_bytes(), s.token.as_bytes()) {
        return login_form(
            StatusCode::UNAUTHORIZED,
            "That is not this node's token: it is the content of api.token in the node's \
             data directory.",
        );
    }
    let (id, _) = match s.sessions.open() {
        Ok(opened) => opened,
        Err(e) => {
            return Error(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")).into_response();
        }
    };
    let cookie = format!(
        "{COOKIE}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}",
        SESSION_LIFE.as_secs()
    );
    (
        StatusCode::SEE_OTHER,
        [
            (header::SET_COOKIE, cookie),
            (header::LOCATION, "/ui/".to_string()),
        ],
    )
        .into_response()
}

async fn logout(State(s): State<AppState>, request: Request) -> Response {
    match check_session(&s, &request) {
        Some(Ok(())) => {
            if let Some(id) = cookie(request.headers()) {
                s.sessions.close(&id);
            }
            (
                StatusCode::SEE_OTHER,
                [
                    (
                        header::SET_COOKIE,
                        format!("{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"),
                    ),
                    (header::LOCATION, "/ui/login".to_string()),
                ],
            )
                .into_response()
        }
        Some(Err(e)) => e.into_response(),
        None => Redirect::to("/ui/login").into_response(),
    }
}

/// What the events stream sends when it changes: enough for the page's header and lists;
/// the page fetches the rest.
#[derive(Serialize, PartialEq)]
struct Pulse {
    status: Option<cannabis_api::Status>,
    control: Option<String>,
    jobs: Vec<cannabis_api::JobSummary>,
    leases: usize,
    height: Option<u64>,
}

async fn pulse(s: &AppState) -> Pulse {
    let status = s.node.status().await.ok().map(|mut st| {
        // It changes every second and says nothing new.
        st.uptime_secs = 0;
        st
    });
    let control = super::exec::status_of(s)
        .await
        .control
        .map(|c| c.name().to_string());
    Pulse {
        status,
        control,
        jobs: s.node.jobs().await.unwrap_or_default(),
        leases: s.node.leases().await.map_or(0, |l| l.len()),
        height: s.node.ledger().await.ok().map(|l| l.height),
    }
}

async fn events(State(s): State<AppState>, headers: HeaderMap) -> Response {
    match session_of(&s, &headers) {
        None => {
            return Error(StatusCode::UNAUTHORIZED, "log in at /ui/login".into()).into_response();
        }
        Some(_) => {
            if let Err(why) = same_origin(&headers, false) {
                return Error(StatusCode::FORBIDDEN, why).into_response();
            }
        }
    }
    let stream = futures::stream::unfold((s, None::<String>), |(s, last)| async move {
        let mut first = last.is_none();
        let mut stopping = s.stopping.clone();
        loop {
            if *stopping.borrow() {
                // The node is stopping: the stream ends, and with it the connection.
                return None;
            }
            if !first {
                tokio::select! {
                    _ = tokio::time::sleep(PULSE_EVERY) => {}
                    changed = stopping.changed() => {
                        // Told to stop, or the server is gone: either way, the end.
                        if changed.is_err() {
                            return None;
                        }
                        continue;
                    }
                }
            }
            first = false;
            let json = serde_json::to_string(&pulse(&s).await).unwrap_or_default();
            if last.as_deref() != Some(json.as_str()) {
                let event = Event::default().event("pulse").data(json.clone());
                return Some((Ok::<_, std::convert::Infallible>(event), (s, Some(json))));
            }
        }
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn problems_are_escaped_before_they_reach_the_page() {
        assert_eq!(
            escape(r#"origin "<script>x</script>" & 'y'"#),
            "origin &quot;&lt;script&gt;x&lt;/script&gt;&quot; &amp; &#39;y&#39;"
        );
    }

    #[test]
    fn the_session_cookie_is_found_among_others() {
        let h = headers(&[("cookie", "a=1; cannabis_session=abc; b=2")]);
        assert_eq!(cookie(&h).as_deref(), Some("abc"));
        let h = headers(&[("cookie", "cannabis_session_x=abc")]);
        assert_eq!(cookie(&h), None);
        assert_eq!(cookie(&HeaderMap::new()), None);
    }

    #[test]
    fn only_the_pages_own_origin_passes() {
        let host = ("host", "127.0.0.1:8080");
        assert!(same_origin(&headers(&[host, ("origin", "http://127.0.0.1:8080")]), true).is_ok());
        assert!(same_origin(&headers(&[host]), false).is_ok());
        assert!(same_origin(&headers(&[host]), true).is_err());
        assert!(same_origin(&headers(&[host, ("origin", "http://evil.example")]), false).is_err());
        assert!(same_origin(&headers(&[host, ("origin", "null")]), false).is_err());
        assert!(same_origin(&headers(&[host, ("sec-fetch-site", "cross-site")]), false).is_err());
        assert!(
            same_origin(
                &headers(&[
                    host,
                    ("sec-fetch-site", "same-origin"),
                    ("origin", "http://127.0.0.1:8080")
                ]),
                true
            )
            .is_ok()
        );
    }

    #[test]
    fn sessions_are_bounded_and_found_only_by_their_id() {
        let s = Sessions::default();
        let (first, _) = s.open().unwrap();
        assert!(s.get(&first).is_some());
        assert!(s.get("nope").is_none());
        for _ in 0..MAX_SESSIONS {
            s.open().unwrap();
        }
        assert_eq!(s.lock().len(), MAX_SESSIONS);
        assert!(s.get(&first).is_none(), "the oldest went first");
        let (id, _) = s.open().unwrap();
        s.close(&id);
        assert!(s.get(&id).is_none());
    }
}
