//! The admin API: HTTP/JSON under `/v1/`, plus Prometheus `/metrics`.
//!
//! # Design
//! The API is a thin translation layer: every handler authenticates (see
//! [`auth`]), checks the caller's scope, calls one [`Control`] method and turns
//! the result into JSON. The daemon owns all state; this module keeps none
//! except the tokens, so a reload or a runtime change is visible to the next
//! request without any cache to invalidate.
//!
//! # Contracts
//! * Every route needs `Authorization: Bearer <token>`; `/metrics` is public
//!   only with `[admin] metrics_public = true`. No token or a wrong one: 401.
//! * The read-only token may only GET; anything else is 403.
//! * A token is checked when the request's head arrives; a tenant token
//!   again once a body is in (a request whose tenant token was changed,
//!   or whose tenant was deleted, meanwhile: 401, nothing done), a
//!   kill's or a connection listing's once the daemon has found the tenant
//!   it acts on, and a service or backend write's with the daemon's edits
//!   held (so a tenant deleted and created again since the token was
//!   checked is out of its reach: 401).
//! * A tenant-scoped token sees only its tenant (lists are filtered) and may
//!   change only its tenant's services, backends and connections; naming
//!   another tenant, or a daemon-wide resource (tenant create/edit/delete,
//!   `/v1/config`, `/v1/reload`, `/metrics`), is 403.
//! * Bodies are JSON, at most [`BODY_LIMIT`] bytes (413 beyond); malformed
//!   input gets 400 with a message. Errors are always
//!   `{"error": kind, "message": ...}` (see [`error::ApiError`]); control
//!   errors map NotFound→404, Conflict→409, Invalid→400, Unavailable→503.
//! * Nothing a client sends panics: handlers parse with fallible APIs, and a
//!   panic in a handler or a [`Control`] call is caught (tower-http's
//!   `CatchPanicLayer`), logged, and answered with a JSON 500.
//! * At most 128 admin connections are open at once, 16 per source address
//!   (the admin API shares the daemon's file-descriptor budget with the data
//!   path); a request head must arrive within 10 s; past a cap, a new
//!   connection evicts the oldest not yet authenticated, so slow or idle
//!   clients cannot shut the operator out, nor can a tenant holding more
//!   than its share of the places, nor tenants holding more than three
//!   quarters of them together (see [`limit`]); a connection
//!   idle for 60 s is closed. A `Content-Length` over [`BODY_LIMIT`] gets
//!   413 before the body is read.
//! * `/ui/` serves the web dashboard's static files without a token (they
//!   hold no data; see [`ui`]); the page calls the API with the user's token.
//! * `/v1/openapi.json` documents exactly the routes in [`route_table`]; a
//!   test walks both.

pub mod auth;
pub mod error;
mod handlers;
mod limit;
pub mod metrics;
pub mod openapi;
pub mod tls;
pub mod ui;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{Method, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, on};
use tokio_util::sync::CancellationToken;
use tower_http::catch_panic::CatchPanicLayer;

use crate::config::AdminConfig;
use crate::control::Control;

use self::auth::{Access, Tokens};
use self::error::ApiError;

/// Largest request body accepted, in bytes.
pub const BODY_LIMIT: usize = 1 << 20;

/// Serve the admin API where `cfg.listen` says until `shutdown` is cancelled.
///
/// Resolves the full-access token first (generating one into a 0600 file on
/// first start when the config names none, and logging where), then binds
/// `IP:PORT` or `unix:/path`. Returns an error if the token file cannot be
/// read or written or the address cannot be bound.
pub async fn serve(
    cfg: &AdminConfig,
    control: Arc<dyn Control>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    bind(cfg, control).await?.run(shutdown).await
}

/// Resolve tokens and bind, without serving yet; [`Bound::run`] serves.
/// Lets a caller learn the bound address first (`listen = "127.0.0.1:0"`).
pub async fn bind(cfg: &AdminConfig, control: Arc<dyn Control>) -> anyhow::Result<Bound> {
    let (full, generated) = auth::resolve_full_token(cfg)?;
    if let Some(path) = generated {
        tracing::warn!(
            path = %path.display(),
            "no admin token configured: generated one into {} (mode 0600); \
             the CLI reads it from there, or pass --token",
            path.display()
        );
    }
    let tokens = Tokens::new(full, cfg.readonly_token.clone());
    // `weir check` compares the tokens written in the file; a token_file's
    // contents are only known here. One token, one role.
    for t in control.running_config().tenants {
        if let Some(role) = t
            .token
            .as_deref()
            .and_then(|tok| tokens.role_of(tok.trim()))
        {
            anyhow::bail!(
                "tenant {:?}'s token is the same as {role}: a token may hold one role only; give each its own",
                t.name
            );
        }
    }
    {
        let tokens = tokens.clone();
        control.reserve_tokens(Arc::new(move |tok: &str| tokens.role_of(tok)));
    }
    let admin_addr: Arc<std::sync::OnceLock<SocketAddr>> = Default::default();
    let app = router_at(control, tokens, cfg.metrics_public, admin_addr.clone());
    let listener = if let Some(path) = cfg.listen.strip_prefix("unix:") {
        let path = std::path::PathBuf::from(path);
        if cfg.tls_cert.is_some() || cfg.tls_key.is_some() {
            anyhow::bail!(
                "[admin] tls_cert/tls_key apply to an IP:PORT listen, not unix socket {}",
                path.display()
            );
        }
        remove_stale_socket(&path)?;
        let l = tokio::net::UnixListener::bind(&path)
            .with_context(|| format!("binding the admin API to unix socket {}", path.display()))?;
        Listener::Unix(l, path)
    } else {
        let addr: SocketAddr = cfg.listen.parse().with_context(|| {
            format!(
                "[admin] listen = {:?} is neither IP:PORT nor unix:/path",
                cfg.listen
            )
        })?;
        let tls = tls::server_config(cfg)?;
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the admin API to {addr}"))?;
        if let Ok(bound) = l.local_addr() {
            let _ = admin_addr.set(bound);
        }
        Listener::Tcp(l, tls)
    };
    Ok(Bound { app, listener })
}

/// A bound, not yet serving, admin API.
#[derive(Debug)]
pub struct Bound {
    app: Router,
    listener: Listener,
}

#[derive(Debug)]
enum Listener {
    Tcp(tokio::net::TcpListener, Option<Arc<rustls::ServerConfig>>),
    Unix(tokio::net::UnixListener, std::path::PathBuf),
}

impl Bound {
    /// The TCP address bound, if TCP.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        match &self.listener {
            Listener::Tcp(l, _) => l.local_addr().ok(),
            Listener::Unix(..) => None,
        }
    }

    /// Serve until `shutdown` is cancelled, then finish in-flight requests
    /// (see [`limit`] for the admission rules).
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        match self.listener {
            Listener::Tcp(l, tls) => {
                tracing::info!(addr = ?l.local_addr().ok(), tls = tls.is_some(), "admin API listening");
                let tls = tls.map(tokio_rustls::TlsAcceptor::from);
                limit::serve(limit::Reserved::new(l), self.app, tls, shutdown).await;
            }
            Listener::Unix(l, path) => {
                tracing::info!(path = %path.display(), "admin API listening");
                limit::serve(limit::Reserved::new(l), self.app, None, shutdown).await;
                let _ = std::fs::remove_file(&path);
            }
        }
        Ok(())
    }
}

fn remove_stale_socket(path: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)
            .with_context(|| format!("removing stale admin socket {}", path.display())),
        Ok(_) => anyhow::bail!(
            "{} exists and is not a socket: choose another [admin] listen path",
            path.display()
        ),
        Err(_) => Ok(()),
    }
}

/// Shared state of the handlers.
#[derive(Clone)]
pub(crate) struct AppState {
    pub(crate) control: Arc<dyn Control>,
    tokens: Arc<Tokens>,
    metrics_public: bool,
    /// The admin API's own TCP address, once bound (no tenant's backend
    /// may point at it).
    admin_addr: Arc<std::sync::OnceLock<SocketAddr>>,
    /// The last `/metrics` render, served again for a while when the
    /// route is public (see [`metrics::Cache`]).
    pub(crate) metrics: Arc<metrics::Cache>,
    /// Permits for the walks and renders [`AppState::off_runtime`] runs on
    /// the blocking pool ([`WALKS_AT_ONCE`]).
    walks: Arc<tokio::sync::Semaphore>,
    /// Where a test keeps a tenant token's write between its fence check
    /// and its change ([`Gate`]).
    #[cfg(test)]
    pub(crate) fence_gate: Arc<Gate>,
    /// Where a test keeps a tenant edit between its merge of the current
    /// settings and its change.
    #[cfg(test)]
    pub(crate) merge_gate: Arc<Gate>,
    /// Where a test keeps a tenant's creation between its token check
    /// and its change.
    #[cfg(test)]
    pub(crate) token_gate: Arc<Gate>,
    /// Where a test keeps a kill or a connection listing between the
    /// checks of its token and its act.
    #[cfg(test)]
    pub(crate) act_gate: Arc<Gate>,
}

/// A point between a write's check (a tenant token's fence, a tenant
/// edit's merge of its current settings, or a tenant creation's token
/// check) and its change, or a kill's or a listing's token check and its
/// act, where a test holding `hold` keeps the write:
/// `passed` counts the writes that reached it.
#[cfg(test)]
#[derive(Default)]
pub(crate) struct Gate {
    pub(crate) hold: parking_lot::RwLock<()>,
    pub(crate) passed: std::sync::atomic::AtomicUsize,
}

#[cfg(test)]
impl Gate {
    /// A write passed its check: waits here while a test holds the gate.
    pub(crate) fn pass(&self) {
        self.passed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        drop(self.hold.read());
    }
}

/// Flow-table walks (connection pages, kills by filter) and `/metrics`
/// renders that run at once; more wait for a permit, without holding the
/// runtime's worker. Why a bound: off the control runtime's one thread
/// they no longer wait for each other, so 128 admin connections could run
/// 128 walks of a 10M-entry table at once, on the cores the data path
/// needs.
const WALKS_AT_ONCE: usize = 2;

/// [`AppState::off_runtime`] with the permits `walks`.
async fn off_runtime<T: Send + 'static>(
    walks: &tokio::sync::Semaphore,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let _permit = walks
        .acquire()
        .await
        .map_err(|e| format!("{what} failed: {e}"))?;
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| format!("{what} failed: {e}"))
}

impl AppState {
    /// The handlers' state over `control`, for tests that call them.
    #[cfg(test)]
    pub(crate) fn for_tests(control: Arc<dyn Control>) -> Self {
        Self {
            control,
            tokens: Arc::new(Tokens::new("full-token", None)),
            metrics_public: false,
            admin_addr: Default::default(),
            metrics: Default::default(),
            walks: Arc::new(tokio::sync::Semaphore::new(WALKS_AT_ONCE)),
            fence_gate: Default::default(),
            merge_gate: Default::default(),
            token_gate: Default::default(),
            act_gate: Default::default(),
        }
    }

    /// Runs `f`, a walk of the flow table or a render of every service, on
    /// the blocking pool once one of [`WALKS_AT_ONCE`] permits is free: the
    /// control runtime has one worker thread, which serves every other
    /// admin request, the health checks and the watchdog's keep-alives.
    pub(crate) async fn off_runtime<T: Send + 'static>(
        &self,
        what: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, String> {
        off_runtime(&self.walks, what, f).await
    }

    /// Whether a TCP connection from this host to `addr` reaches the
    /// admin API.
    pub(crate) fn is_admin_address(&self, addr: SocketAddr) -> bool {
        let Some(admin) = self.admin_addr.get() else {
            return false;
        };
        let ip = addr.ip().to_canonical();
        // The listener is bound as tokio binds it, without IPV6_V6ONLY: an
        // IPv6 wildcard takes IPv4 connections too (the system's default,
        // net.ipv6.bindv6only = 0).
        admin.port() == addr.port()
            && (admin.ip().to_canonical() == ip
                || (admin.ip().is_unspecified()
                    && (admin.is_ipv6() || ip.is_ipv4())
                    && crate::daemon::host_has_ip(ip)))
    }
}

/// A route's method, as recorded in [`route_table`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RouteMethod {
    /// GET
    Get,
    /// POST
    Post,
    /// PUT
    Put,
    /// DELETE
    Delete,
}

impl RouteMethod {
    /// Lower-case name as OpenAPI spells it.
    pub fn as_openapi(self) -> &'static str {
        match self {
            RouteMethod::Get => "get",
            RouteMethod::Post => "post",
            RouteMethod::Put => "put",
            RouteMethod::Delete => "delete",
        }
    }
    /// As an HTTP method.
    pub fn as_http(self) -> Method {
        match self {
            RouteMethod::Get => Method::GET,
            RouteMethod::Post => Method::POST,
            RouteMethod::Put => Method::PUT,
            RouteMethod::Delete => Method::DELETE,
        }
    }
    fn filter(self) -> MethodFilter {
        match self {
            RouteMethod::Get => MethodFilter::GET,
            RouteMethod::Post => MethodFilter::POST,
            RouteMethod::Put => MethodFilter::PUT,
            RouteMethod::Delete => MethodFilter::DELETE,
        }
    }
}

/// Builds the router and records each route, so the route table cannot
/// drift from what is served.
struct Routes {
    router: Router<AppState>,
    table: Vec<(RouteMethod, &'static str)>,
}

impl Routes {
    fn add<H, T>(mut self, m: RouteMethod, path: &'static str, h: H) -> Self
    where
        H: axum::handler::Handler<T, AppState>,
        T: 'static,
    {
        self.table.push((m, path));
        self.router = self.router.route(path, on(m.filter(), h));
        self
    }
}

fn build() -> Routes {
    use RouteMethod::{Delete, Get, Post, Put};
    use handlers as h;
    Routes {
        router: Router::new(),
        table: Vec::new(),
    }
    .add(Get, "/v1/tenants", h::list_tenants)
    .add(Post, "/v1/tenants", h::add_tenant)
    .add(Put, "/v1/tenants/{tenant}", h::edit_tenant)
    .add(Delete, "/v1/tenants/{tenant}", h::delete_tenant)
    .add(Get, "/v1/services", h::list_services)
    .add(Post, "/v1/services", h::add_service)
    .add(Get, "/v1/services/{tenant}/{service}", h::get_service)
    .add(Put, "/v1/services/{tenant}/{service}", h::edit_service)
    .add(Delete, "/v1/services/{tenant}/{service}", h::delete_service)
    .add(
        Post,
        "/v1/services/{tenant}/{service}/backends",
        h::add_backend,
    )
    .add(
        Put,
        "/v1/services/{tenant}/{service}/backends/{address}",
        h::edit_backend,
    )
    .add(
        Delete,
        "/v1/services/{tenant}/{service}/backends/{address}",
        h::delete_backend,
    )
    .add(Get, "/v1/connections", h::list_connections)
    .add(Post, "/v1/connections/kill", h::kill_matching)
    .add(Delete, "/v1/connections/{cookie}", h::kill_one)
    .add(Get, "/v1/stats", h::stats)
    .add(Get, "/v1/rates", h::rates)
    .add(Get, "/v1/table", h::table)
    .add(Get, "/v1/health", h::health)
    .add(Get, "/v1/whoami", h::whoami)
    .add(Get, "/v1/config", h::config)
    .add(Post, "/v1/reload", h::reload)
    .add(Get, "/v1/openapi.json", h::openapi)
    .add(Get, "/metrics", h::metrics)
}

/// Every (method, path) the router serves, in axum path syntax.
pub fn route_table() -> Vec<(RouteMethod, &'static str)> {
    build().table
}

/// The admin API as a tower service, for embedding and for tests
/// (`tower::ServiceExt::oneshot`).
pub fn router(control: Arc<dyn Control>, tokens: Tokens, metrics_public: bool) -> Router {
    router_at(control, tokens, metrics_public, Default::default())
}

/// [`router`], for an admin API whose TCP address is set in `admin_addr`
/// once bound.
fn router_at(
    control: Arc<dyn Control>,
    tokens: Tokens,
    metrics_public: bool,
    admin_addr: Arc<std::sync::OnceLock<SocketAddr>>,
) -> Router {
    let state = AppState {
        control,
        tokens: Arc::new(tokens),
        metrics_public,
        admin_addr,
        metrics: Default::default(),
        walks: Arc::new(tokio::sync::Semaphore::new(WALKS_AT_ONCE)),
        #[cfg(test)]
        fence_gate: Default::default(),
        #[cfg(test)]
        merge_gate: Default::default(),
        #[cfg(test)]
        token_gate: Default::default(),
        #[cfg(test)]
        act_gate: Default::default(),
    };
    build()
        .router
        .fallback(|| async {
            ApiError::not_found("no such route: see GET /v1/openapi.json for the API")
        })
        .method_not_allowed_fallback(|req: Request| async move {
            ApiError::new(
                axum::http::StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                format!(
                    "{} is not allowed on {}: see GET /v1/openapi.json for the API",
                    req.method(),
                    req.uri().path()
                ),
            )
        })
        .layer(middleware::from_fn_with_state(state.clone(), authenticate))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(middleware::from_fn(refuse_oversized))
        // Added after the layers: the dashboard's static files need no token.
        .merge(ui::router())
        // Outermost: panics anywhere below (the dashboard's routes too)
        // become a JSON 500.
        .layer(CatchPanicLayer::custom(panic_response))
        .with_state(state)
}

/// A handler or a [`Control`] call panicked: log it and answer 500 in the
/// API's error shape instead of dropping the connection. The [`Control`]
/// contract says it never panics; this keeps a bug there from taking the
/// answer with it.
fn panic_response(panic: Box<dyn std::any::Any + Send + 'static>) -> Response {
    let what = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)");
    tracing::error!(panic = what, "an admin request handler panicked");
    ApiError::new(
        axum::http::StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "internal error in the daemon (logged); the request was not completed",
    )
    .into_response()
}

/// 413 at once for a declared body over [`BODY_LIMIT`], before reading a
/// byte of it (and before authentication: the answer reveals nothing), and
/// close the connection rather than drain the body.
async fn refuse_oversized(req: Request, next: Next) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(n) = declared.filter(|&n| n > BODY_LIMIT as u64) {
        let mut r = ApiError::new(
            axum::http::StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!("Content-Length {n} is over the limit of {BODY_LIMIT} bytes"),
        )
        .into_response();
        r.headers_mut().insert(
            header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
        return r;
    }
    next.run(req).await
}

/// The token of a request's `Authorization: Bearer` header, if any.
pub(crate) fn presented_token(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(auth::bearer)
}

/// Check the bearer token, enforce read-only, and attach [`Access`].
/// A tenant token is checked again once a body is in ([`handlers`]'
/// `JsonBody`): this check is made on the request's head.
async fn authenticate(State(st): State<AppState>, mut req: Request, next: Next) -> Response {
    if st.metrics_public && req.uri().path() == "/metrics" {
        req.extensions_mut().insert(Access::Full);
        return next.run(req).await;
    }
    let presented = presented_token(req.headers()).map(str::to_owned);
    let Some(presented) = presented else {
        return ApiError::unauthorized(
            "missing 'Authorization: Bearer <token>' header: pass --token or set WEIR_TOKEN",
        )
        .into_response();
    };
    let Some(access) = st.tokens.identify(&presented, st.control.as_ref()) else {
        return ApiError::unauthorized(
            "invalid token: check --token / WEIR_TOKEN against [admin] token or token_file",
        )
        .into_response();
    };
    if access == Access::ReadOnly && !matches!(*req.method(), Method::GET | Method::HEAD) {
        return ApiError::forbidden("the read-only token may only GET: use the full-access token")
            .into_response();
    }
    if let Some(a) = req.extensions().get::<limit::Authed>() {
        match &access {
            Access::Tenant(t) => a.mark_tenant(t),
            Access::ReadOnly => a.mark_readonly(),
            Access::Full => a.mark_operator(),
        }
    }
    req.extensions_mut().insert(access);
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::{Arc, Condvar, Mutex};
    use std::time::{Duration, Instant};

    /// At most [`super::WALKS_AT_ONCE`] walks run at once: off the control
    /// runtime's thread they no longer wait for each other, and admin
    /// connections could otherwise start one walk of a big table each.
    /// Four walks held at a gate: two run, the other two wait for a permit
    /// (without holding the runtime, which here polls them all), and run
    /// once the first let go.
    #[test]
    fn at_most_two_walks_run_at_once() {
        #[derive(Default)]
        struct Gate {
            open: Mutex<bool>,
            opened: Condvar,
            running: AtomicUsize,
            most: AtomicUsize,
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let walks = Arc::new(tokio::sync::Semaphore::new(super::WALKS_AT_ONCE));
        let gate = Arc::new(Gate::default());
        let asked = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let (walks, gate, asked) = (walks.clone(), gate.clone(), asked.clone());
                rt.spawn(async move {
                    asked.fetch_add(1, SeqCst);
                    super::off_runtime(&walks, "a walk", move || {
                        let now = gate.running.fetch_add(1, SeqCst) + 1;
                        gate.most.fetch_max(now, SeqCst);
                        let mut open = gate.open.lock().unwrap();
                        while !*open {
                            open = gate.opened.wait(open).unwrap();
                        }
                        gate.running.fetch_sub(1, SeqCst);
                    })
                    .await
                })
            })
            .collect();
        rt.block_on(async {
            let deadline = Instant::now() + Duration::from_secs(10);
            while asked.load(SeqCst) < 4 || gate.running.load(SeqCst) < 2 {
                assert!(Instant::now() < deadline, "two walks never started");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            // Every task has asked; a third walk, if let through, starts
            // within this (it would block at the gate, counted).
            tokio::time::sleep(Duration::from_millis(300)).await;
        });
        let running = gate.running.load(SeqCst);
        // Opened before any assertion: a failing test must not leave
        // blocking threads at the gate for the runtime's drop to wait on.
        *gate.open.lock().unwrap() = true;
        gate.opened.notify_all();
        assert_eq!(running, 2, "walks running at once");
        rt.block_on(async {
            for t in tasks {
                t.await.unwrap().unwrap();
            }
        });
        assert_eq!(gate.most.load(SeqCst), super::WALKS_AT_ONCE);
    }
}
