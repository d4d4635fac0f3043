//! The admin API (router, authentication, handlers) over a real in-process
//! daemon: whatever a client sends, the answer is never a 500 or a panic,
//! errors have the documented `{"error", "message"}` shape and successes on
//! `/v1/` are JSON.
//!
//! Input layout: byte 0 picks the method, byte 1 the token (none, full,
//! read-only, tenant, wrong), then `PATH\nBODY`. A path not starting with
//! `/` is taken relative to `/v1/` so that short inputs reach handlers.
//! State persists between inputs (services added stay), as it does in a
//! running daemon; a crash input may need the inputs before it to replay.
#![no_main]

use std::sync::OnceLock;

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;
use weir::admin::{self, auth::Tokens};
use weir::config::{self, Config};
use weir::daemon::{Daemon, DaemonHandle};

const FULL: &str = "fuzz-full-token";
const READONLY: &str = "fuzz-readonly-token";
const TENANT: &str = "acme-token";

const CONFIG: &str = r#"
[daemon]
workers = 1
shared_table_buckets = 1024
own_tables_budget = 16777216
drain_timeout = "1s"

[admin]
listen = "127.0.0.1:0"
token = "fuzz-full-token"
readonly_token = "fuzz-readonly-token"

[[tenant]]
name = "default"

[[tenant]]
name = "acme"
table_entries = 1024
max_connections = 100
token = "acme-token"

[[service]]
tenant = "acme"
name = "web"
protocol = "tcp"
listen = "127.0.0.1:0"
scheduler = "rr"
  [[service.backend]]
  address = "127.0.0.1:9"

[[service]]
tenant = "default"
name = "dns"
protocol = "udp"
listen = "127.0.0.1:0"
  [[service.backend]]
  address = "127.0.0.1:9"
"#;

struct Fixture {
    daemon: DaemonHandle,
    app: Router,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let c: Config = config::parse(CONFIG, "fuzz.toml").expect("the fixture config is valid");
        let daemon = Daemon::start(c, None).expect("the fixture daemon starts");
        let app = admin::router(
            daemon.control(),
            Tokens::new(FULL, Some(READONLY.to_owned())),
            false,
        );
        Fixture { daemon, app }
    })
}

const METHODS: [Method; 7] = [
    Method::GET,
    Method::POST,
    Method::PUT,
    Method::DELETE,
    Method::PATCH,
    Method::HEAD,
    Method::OPTIONS,
];

fuzz_target!(|data: &[u8]| {
    let [m, a, rest @ ..] = data else { return };
    let method = METHODS[usize::from(*m) % METHODS.len()].clone();
    let token = match a % 5 {
        0 => None,
        1 => Some(FULL),
        2 => Some(READONLY),
        3 => Some(TENANT),
        _ => Some("wrong"),
    };
    let (path, body) = match rest.iter().position(|&b| b == b'\n') {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, &[][..]),
    };
    let mut uri = Vec::with_capacity(path.len() + 4);
    if !path.starts_with(b"/") {
        uri.extend_from_slice(b"/v1/");
    }
    uri.extend_from_slice(path);
    let Ok(uri) = axum::http::Uri::try_from(uri) else {
        return;
    };
    let mut req = Request::builder().method(method.clone()).uri(uri.clone());
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    if !body.is_empty() {
        req = req.header(header::CONTENT_TYPE, "application/json");
    }
    let Ok(req) = req.body(Body::from(body.to_vec())) else {
        return;
    };
    let f = fixture();
    let (status, bytes) = f.daemon.runtime().block_on(async {
        let resp = f
            .app
            .clone()
            .oneshot(req)
            .await
            .expect("the router is infallible");
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .expect("response bodies are in memory")
            .to_bytes();
        (status, bytes)
    });
    let shown = String::from_utf8_lossy(&bytes);
    assert_ne!(
        status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{method} {uri} answered 500: {shown}"
    );
    if method == Method::HEAD {
        return;
    }
    if status.is_client_error() || status.is_server_error() {
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            panic!("{method} {uri} {status}: error body is not JSON ({e}): {shown}")
        });
        assert!(
            v["error"].is_string() && v["message"].is_string(),
            "{method} {uri} {status}: error body lacks error/message: {shown}"
        );
    } else if status.is_success() && !bytes.is_empty() && uri.path().starts_with("/v1/") {
        serde_json::from_slice::<serde_json::Value>(&bytes)
            .unwrap_or_else(|e| panic!("{method} {uri} {status}: body is not JSON ({e}): {shown}"));
    }
});
