//! Admin API tests against an in-memory Control: every resource, auth (401),
//! scopes (403), malformed input (400), the OpenAPI document matching the
//! router, a property test that nothing yields a 5xx, and the unix socket.

mod admin_fake;

use std::collections::BTreeSet;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use serde_json::{Value, json};
use tower::ServiceExt;

use admin_fake::Fake;
use weir::admin::auth::Tokens;
use weir::admin::{self, RouteMethod};
use weir::control::Control;

const FULL: &str = "full-secret";
const RO: &str = "ro-secret";

fn app_with(fake: Arc<Fake>, metrics_public: bool) -> Router {
    admin::router(fake, Tokens::new(FULL, Some(RO.into())), metrics_public)
}

fn app() -> (Arc<Fake>, Router) {
    let f = Arc::new(Fake::sample());
    (f.clone(), app_with(f, false))
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// One request; returns status and the body (JSON if it parses, else a string).
fn call(
    app: &Router,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> (StatusCode, Value) {
    let mut b = Request::builder().method(method).uri(path);
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    let req = b
        .body(body.map_or_else(Body::empty, |s| Body::from(s.to_owned())))
        .expect("request");
    rt().block_on(async {
        let resp = app.clone().oneshot(req).await.expect("infallible");
        let status = resp.status();
        let bytes = axum::body::to_bytes(resp.into_body(), 64 << 20)
            .await
            .expect("body");
        let v = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        (status, v)
    })
}

/// Requests made with the full token whose answer is checked for its
/// status alone: each `(method, path, body, status)`.
fn statuses(app: &Router, requests: &[(&str, &str, Option<&str>, u16)]) {
    for &(method, path, body, want) in requests {
        let (s, v) = call(app, method, path, Some(FULL), body);
        assert_eq!(s.as_u16(), want, "{method} {path} {body:?}: {v}");
    }
}

/// A concrete path for a route template.
fn fill(path: &str) -> String {
    path.replace("{tenant}", "acme")
        .replace("{service}", "web")
        .replace("{address}", "10.1.0.1:8080")
        .replace("{cookie}", "100")
}

#[test]
fn every_route_needs_a_token() {
    let (_, app) = app();
    for (m, p) in admin::route_table() {
        let (s, v) = call(&app, m.as_http().as_str(), &fill(p), None, Some("{}"));
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{m:?} {p}: {v}");
        assert_eq!(v["error"], "unauthorized");
        let (s, _) = call(
            &app,
            m.as_http().as_str(),
            &fill(p),
            Some("wrong"),
            Some("{}"),
        );
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{m:?} {p} with a wrong token");
    }
    // A non-bearer scheme is no token either.
    let req_status = rt().block_on(async {
        app.clone()
            .oneshot(
                Request::builder()
                    .uri("/v1/services")
                    .header("authorization", format!("Basic {FULL}"))
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap()
            .status()
    });
    assert_eq!(req_status, StatusCode::UNAUTHORIZED);
}

#[test]
fn tenants_resource() {
    let (fake, app) = app();
    let (s, v) = call(&app, "GET", "/v1/tenants", Some(FULL), None);
    assert_eq!(s, StatusCode::OK);
    let names: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["acme", "default", "globex"]);
    assert!(v[0].get("token").is_none(), "tokens never listed: {v}");
    assert_eq!(v[0]["table"], "own");

    let (s, v) = call(
        &app,
        "POST",
        "/v1/tenants",
        Some(FULL),
        Some(r#"{"name":"initech","table_entries":4096,"max_connections":10}"#),
    );
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert!(fake.running_config_has_tenant("initech"));
    let (s, v) = call(
        &app,
        "POST",
        "/v1/tenants",
        Some(FULL),
        Some(r#"{"name":"initech"}"#),
    );
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"], "conflict");
    let (s, v) = call(
        &app,
        "POST",
        "/v1/tenants",
        Some(FULL),
        Some(r#"{"name":"a/b"}"#),
    );
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(v["message"].as_str().unwrap().contains("invalid"), "{v}");
    let (s, v) = call(&app, "POST", "/v1/tenants", Some(FULL), Some(r#"{"name":"#));
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(
        v["message"].as_str().unwrap().contains("invalid JSON"),
        "{v}"
    );
    let t = "/v1/tenants";
    statuses(
        &app,
        &[
            // Invalid maps to 400.
            ("POST", t, Some(r#"{"name":"x","table_entries":1000}"#), 400),
            // Unknown fields are refused.
            ("POST", t, Some(r#"{"name":"y","bogus":1}"#), 400),
        ],
    );

    // PUT: the body's keys replace, omitted keys keep their value.
    let tenant = |name: &str| {
        fake.running_config()
            .tenants
            .into_iter()
            .find(|t| t.name == name)
            .unwrap()
    };
    let (s, v) = call(
        &app,
        "PUT",
        "/v1/tenants/acme",
        Some(FULL),
        Some(r#"{"max_connections":5,"timeouts":{"established":"1h"}}"#),
    );
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["updated"], "acme");
    let t = tenant("acme");
    assert_eq!((t.max_connections, t.max_new_per_s), (5, 10));
    assert_eq!(t.table_entries, 1024);
    assert_eq!(t.token.as_deref(), Some("acme-token"), "kept when omitted");
    assert_eq!(
        t.timeouts.established.map(|d| d.to_string()).as_deref(),
        Some("1h")
    );
    let (s, v) = call(
        &app,
        "PUT",
        "/v1/tenants/acme",
        Some(FULL),
        Some(r#"{"name":"acme","token":null}"#),
    );
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(tenant("acme").token, None, "null removes the token");
    let (s, v) = call(
        &app,
        "PUT",
        "/v1/tenants/acme",
        Some(FULL),
        Some(r#"{"table_entries":2048}"#),
    );
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("table_entries cannot change"),
        "{v}"
    );
    assert_eq!(tenant("acme").table_entries, 1024);
    let (s, v) = call(
        &app,
        "PUT",
        "/v1/tenants/acme",
        Some(FULL),
        Some(r#"{"name":"other"}"#),
    );
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(v["message"].as_str().unwrap().contains("renamed"), "{v}");
    let acme = "/v1/tenants/acme";
    statuses(
        &app,
        &[
            // Unknown fields are refused.
            ("PUT", acme, Some(r#"{"bogus":1}"#), 400),
            ("PUT", acme, Some("[1]"), 400),
            (
                "PUT",
                "/v1/tenants/nobody",
                Some(r#"{"max_connections":1}"#),
                404,
            ),
        ],
    );

    let (s, v) = call(&app, "DELETE", "/v1/tenants/acme", Some(FULL), None);
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["closed_connections"], 2);
    let (s, _) = call(&app, "DELETE", "/v1/tenants/acme", Some(FULL), None);
    assert_eq!(s, StatusCode::NOT_FOUND);
}

impl Fake {
    fn running_config_has_tenant(&self, name: &str) -> bool {
        self.st
            .lock()
            .unwrap()
            .config
            .tenants
            .iter()
            .any(|t| t.name == name)
    }
    fn backend_weight(&self, tenant: &str, svc: &str, addr: &str) -> Option<u32> {
        let st = self.st.lock().unwrap();
        st.config
            .services
            .iter()
            .find(|s| s.tenant == tenant && s.name == svc)?
            .backends
            .iter()
            .find(|b| b.address.to_string() == addr)
            .map(|b| b.weight)
    }
}

#[test]
fn services_resource() {
    let (fake, app) = app();
    let (s, v) = call(&app, "GET", "/v1/services", Some(FULL), None);
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v.as_array().unwrap().len(), 2);
    assert_eq!(v[0]["backends"][0]["address"], "10.1.0.1:8080");

    let body = r#"{"tenant":"acme","name":"api","protocol":"tcp","listen":"10.0.0.1:443",
                   "scheduler":"rr","backend":[{"address":"10.1.0.9:443"}]}"#;
    let (s, v) = call(&app, "POST", "/v1/services", Some(FULL), Some(body));
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let svcs = "/v1/services";
    statuses(
        &app,
        &[
            ("POST", svcs, Some(body), 409),
            (
                "POST",
                svcs,
                Some(r#"{"tenant":"nope","name":"x","protocol":"tcp","listen":"1.2.3.4:1"}"#),
                404,
            ),
            (
                "POST",
                svcs,
                Some(r#"{"tenant":"acme","name":"x","protocol":"sctp","listen":"1.2.3.4:1"}"#),
                400,
            ),
            (
                "POST",
                svcs,
                Some(r#"{"tenant":"acme","name":"x","protocol":"tcp","listen":"not-an-address"}"#),
                400,
            ),
        ],
    );

    let (s, v) = call(&app, "GET", "/v1/services/acme/api", Some(FULL), None);
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["scheduler"], "rr");
    // Edit: tenant and name come from the path.
    let (s, v) = call(
        &app,
        "PUT",
        "/v1/services/acme/api",
        Some(FULL),
        Some(r#"{"protocol":"tcp","listen":"10.0.0.1:443","scheduler":"mh"}"#),
    );
    assert_eq!(s, StatusCode::OK, "{v}");
    let (_, v) = call(&app, "GET", "/v1/services/acme/api", Some(FULL), None);
    assert_eq!(v["scheduler"], "mh");
    let (s, v) = call(
        &app,
        "PUT",
        "/v1/services/acme/api",
        Some(FULL),
        Some(r#"{"name":"renamed","protocol":"tcp","listen":"10.0.0.1:443"}"#),
    );
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(v["message"].as_str().unwrap().contains("renamed"), "{v}");
    let api = "/v1/services/acme/api";
    let edit = r#"{"protocol":"tcp","listen":"10.0.0.1:443"}"#;
    statuses(
        &app,
        &[
            ("PUT", api, Some("[1,2]"), 400),
            ("PUT", "/v1/services/acme/nope", Some(edit), 404),
            ("DELETE", api, None, 200),
            ("DELETE", api, None, 404),
            ("GET", api, None, 404),
        ],
    );
    // Requests about one tenant or service read that one: never a copy of
    // the whole configuration (O(all services) per request before).
    assert_eq!(fake.st.lock().unwrap().running_config_calls, 0);
}

#[test]
fn backends_resource() {
    let (fake, app) = app();
    let base = "/v1/services/acme/web/backends";
    let (s, v) = call(
        &app,
        "POST",
        base,
        Some(FULL),
        Some(r#"{"address":"10.1.0.3:8080","weight":5}"#),
    );
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(fake.backend_weight("acme", "web", "10.1.0.3:8080"), Some(5));
    statuses(
        &app,
        &[
            ("POST", base, Some(r#"{"address":"10.1.0.3:8080"}"#), 409),
            ("POST", base, Some(r#"{"address":"10.1.0.3"}"#), 400),
            (
                "POST",
                "/v1/services/acme/nope/backends",
                Some(r#"{"address":"10.1.0.3:1"}"#),
                404,
            ),
        ],
    );

    let one = format!("{base}/10.1.0.3:8080");
    let (s, _) = call(&app, "PUT", &one, Some(FULL), Some(r#"{"weight":9}"#));
    assert_eq!(s, StatusCode::OK);
    assert_eq!(fake.backend_weight("acme", "web", "10.1.0.3:8080"), Some(9));
    let (s, _) = call(&app, "PUT", &one, Some(FULL), Some(r#"{"drain":false}"#));
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        fake.backend_weight("acme", "web", "10.1.0.3:8080"),
        Some(0),
        "drained"
    );
    let weight = Some(r#"{"weight":1}"#);
    statuses(
        &app,
        &[
            ("PUT", &one, Some(r#"{"weight":-1}"#), 400),
            // Typos are refused.
            ("PUT", &one, Some(r#"{"wieght":1}"#), 400),
            ("PUT", &format!("{base}/garbage"), weight, 400),
            ("PUT", &format!("{base}/10.9.9.9:1"), weight, 404),
        ],
    );

    // IPv6, percent-encoded, normalised.
    statuses(
        &app,
        &[
            ("POST", base, Some(r#"{"address":"[2001:db8::1]:80"}"#), 201),
            (
                "DELETE",
                &format!("{base}/%5B2001:db8:0::1%5D:80"),
                None,
                200,
            ),
        ],
    );

    let (s, _) = call(&app, "DELETE", &one, Some(FULL), None);
    assert_eq!(s, StatusCode::OK);
    assert_eq!(fake.backend_weight("acme", "web", "10.1.0.3:8080"), None);
    let (s, _) = call(&app, "DELETE", &one, Some(FULL), None);
    assert_eq!(s, StatusCode::NOT_FOUND);
}

#[test]
fn connections_pages_filters_and_kills() {
    let (fake, app) = app();
    fake.add_conns(25);
    // Pages of 7 over 27 acme connections: each exactly once.
    let mut seen = BTreeSet::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        let path = match &cursor {
            None => "/v1/connections?tenant=acme&limit=7".to_string(),
            Some(c) => format!("/v1/connections?tenant=acme&limit=7&cursor={c}"),
        };
        let (s, v) = call(&app, "GET", &path, Some(FULL), None);
        assert_eq!(s, StatusCode::OK, "{v}");
        let conns = v["connections"].as_array().unwrap();
        assert!(conns.len() <= 7);
        for c in conns {
            assert_eq!(c["tenant"], "acme");
            assert!(seen.insert(c["cookie"].as_u64().unwrap()), "duplicate {c}");
        }
        pages += 1;
        assert!(pages < 100, "pagination does not end");
        match v["next"].as_str() {
            Some(n) => cursor = Some(n.to_owned()),
            None => break,
        }
    }
    assert_eq!(seen.len(), 27);
    assert_eq!(pages, 4);

    let (s, v) = call(&app, "GET", "/v1/connections?state=udp", Some(FULL), None);
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["connections"].as_array().unwrap().len(), 1);
    let c = &v["connections"][0];
    for key in admin_fake::CONN_KEYS {
        assert!(c.get(key).is_some(), "key {key} missing in {c}");
    }
    for bad in ["limit=0", "limit=10001", "limit=x", "bogus=1", "limit=-1"] {
        let (s, v) = call(
            &app,
            "GET",
            &format!("/v1/connections?{bad}"),
            Some(FULL),
            None,
        );
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {v}");
    }
    let (s, _) = call(&app, "GET", "/v1/connections?cursor=zzz", Some(FULL), None);
    assert_eq!(s, StatusCode::BAD_REQUEST, "the Control's Invalid cursor");

    let kill = "/v1/connections/kill";
    statuses(
        &app,
        &[
            ("DELETE", "/v1/connections/100", None, 200),
            ("DELETE", "/v1/connections/100", None, 404),
            ("DELETE", "/v1/connections/abc", None, 400),
            // An empty filter needs all.
            ("POST", kill, Some("{}"), 400),
            ("POST", kill, Some(r#"{"all":"yes"}"#), 400),
        ],
    );
    let (s, v) = call(
        &app,
        "POST",
        "/v1/connections/kill",
        Some(FULL),
        Some(r#"{"backend":"10.1.0.2:8080"}"#),
    );
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["killed"], 25);
    let (s, v) = call(
        &app,
        "POST",
        "/v1/connections/kill",
        Some(FULL),
        Some(r#"{"all":true}"#),
    );
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["killed"], 2);
    assert!(fake.st.lock().unwrap().conns.is_empty());
}

#[test]
fn stats_rates_table_health_config_reload() {
    let (fake, app) = app();
    let (s, v) = call(&app, "GET", "/v1/stats", Some(FULL), None);
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["global"]["stats"]["conns"], 1234);
    assert_eq!(v["global"]["fd_limit"], 1024);
    let acme = v["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tenant"] == "acme")
        .unwrap();
    assert_eq!(
        acme["stats"]["inbytes"], 5_000_000_000u64,
        "tenant sums its services"
    );
    assert_eq!(acme["refused"], 7);
    assert_eq!(v["services"][0]["backends"][0]["stats"]["conns"], 617);

    let (s, v) = call(&app, "GET", "/v1/rates", Some(FULL), None);
    assert_eq!(s, StatusCode::OK);
    assert!(v["services"][0].get("stats").is_none(), "rates only: {v}");
    assert_eq!(v["services"][0]["rates"]["cps"], 12);
    assert_eq!(v["global"]["cps"], 1);

    let (s, v) = call(&app, "GET", "/v1/table", Some(FULL), None);
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v[0]["tenant"], "acme");
    assert_eq!(v[0]["chain_histogram"], json!([900, 100, 20, 4]));

    let (s, v) = call(&app, "GET", "/v1/health", Some(FULL), None);
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v.as_array().unwrap().len(), 3);
    assert_eq!(v[1]["state"], "down");

    let (s, v) = call(&app, "GET", "/v1/config", Some(FULL), None);
    assert_eq!(s, StatusCode::OK);
    let cfg: weir::config::Config = serde_json::from_value(v).expect("GET /v1/config is a Config");
    assert_eq!(cfg.services.len(), 2);
    assert_eq!(
        cfg.tenants[1].token.as_deref(),
        Some("acme-token"),
        "full token sees secrets"
    );
    let (_, v) = call(&app, "GET", "/v1/config", Some(RO), None);
    assert!(
        v["tenant"][1].get("token").is_none(),
        "read-only token sees no secrets: {v}"
    );

    let (s, v) = call(&app, "POST", "/v1/reload", Some(FULL), None);
    assert_eq!(s, StatusCode::OK, "{v}");
    fake.st.lock().unwrap().fail_reload = Some(vec!["line 3: bad".into(), "line 9: worse".into()]);
    let (s, v) = call(&app, "POST", "/v1/reload", Some(FULL), None);
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["errors"], json!(["line 3: bad", "line 9: worse"]));
    assert_eq!(fake.st.lock().unwrap().reloads, 2);
}

#[test]
fn read_only_token_reads_only() {
    let (_, app) = app();
    for (m, p) in admin::route_table() {
        let (s, v) = call(&app, m.as_http().as_str(), &fill(p), Some(RO), Some("{}"));
        if m == RouteMethod::Get {
            assert_eq!(s, StatusCode::OK, "{p}: {v}");
        } else {
            assert_eq!(s, StatusCode::FORBIDDEN, "{m:?} {p}: {v}");
            assert_eq!(v["error"], "forbidden");
        }
    }
}

#[test]
fn whoami_names_the_token_role() {
    let (fake, app) = app();
    let (s, v) = call(&app, "GET", "/v1/whoami", Some(FULL), None);
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        v,
        json!({ "role": "full", "tenant": null, "can_write": true })
    );
    let (_, v) = call(&app, "GET", "/v1/whoami", Some(RO), None);
    assert_eq!(
        v,
        json!({ "role": "readonly", "tenant": null, "can_write": false })
    );
    let (_, v) = call(&app, "GET", "/v1/whoami", Some("acme-token"), None);
    assert_eq!(
        v,
        json!({ "role": "tenant", "tenant": "acme", "can_write": true })
    );
    let (s, _) = call(&app, "GET", "/v1/whoami", Some("wrong"), None);
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    // Telling tokens apart reads the tenants' tokens alone: before, every
    // request with a tenant's or a bogus token copied the whole running
    // configuration (tens of ms at 100,000 services, unauthenticated).
    assert_eq!(fake.st.lock().unwrap().running_config_calls, 0);
}

/// The dashboard's files are served without a token, each with the CSP;
/// its data routes are not.
#[test]
fn dashboard_files_need_no_token_and_carry_the_csp() {
    let (_, app) = app();
    let get = |path: &str| {
        let req = Request::builder().uri(path).body(Body::empty()).unwrap();
        rt().block_on(async { app.clone().oneshot(req).await.expect("infallible") })
    };
    for (path, ctype) in [
        ("/ui/", "text/html"),
        ("/ui/index.html", "text/html"),
        ("/ui/app.js", "text/javascript"),
        ("/ui/style.css", "text/css"),
    ] {
        let r = get(path);
        assert_eq!(r.status(), StatusCode::OK, "{path}");
        let h = r.headers();
        assert!(
            h["content-type"].to_str().unwrap().starts_with(ctype),
            "{path}"
        );
        assert_eq!(h["content-security-policy"], admin::ui::CSP, "{path}");
        assert_eq!(h["referrer-policy"], "no-referrer", "{path}");
        assert_eq!(h["x-content-type-options"], "nosniff", "{path}");
    }
    let r = get("/ui");
    assert_eq!(r.status(), StatusCode::PERMANENT_REDIRECT);
    assert_eq!(r.headers()["location"], "/ui/");
    let r = get("/ui/secrets.json");
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    assert_eq!(r.headers()["content-security-policy"], admin::ui::CSP);
    // The CSP allows no inline script: the page loads its script by URL.
    let (_, page) = call(&app, "GET", "/ui/", None, None);
    assert!(page.as_str().unwrap().contains(r#"<script src="app.js""#));
    let (s, _) = call(&app, "GET", "/v1/whoami", None, None);
    assert_eq!(s, StatusCode::UNAUTHORIZED);
}

#[test]
fn tenant_tokens_see_and_change_only_their_tenant() {
    let (fake, app) = app();
    let t = Some("acme-token");
    let (s, v) = call(&app, "GET", "/v1/services", t, None);
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v.as_array().unwrap().len(), 1);
    assert_eq!(v[0]["tenant"], "acme");
    let (_, v) = call(&app, "GET", "/v1/tenants", t, None);
    assert_eq!(v.as_array().unwrap().len(), 1);
    let (_, v) = call(&app, "GET", "/v1/connections", t, None);
    assert!(
        v["connections"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["tenant"] == "acme")
    );
    assert_eq!(v["connections"].as_array().unwrap().len(), 2);
    let (_, v) = call(&app, "GET", "/v1/stats", t, None);
    assert!(
        v.get("global").is_none(),
        "no daemon-wide figures for a tenant: {v}"
    );
    assert_eq!(v["services"].as_array().unwrap().len(), 1);
    let (_, v) = call(&app, "GET", "/v1/table", t, None);
    assert_eq!(v.as_array().unwrap().len(), 1);
    assert_eq!(v[0]["tenant"], "acme");
    assert_eq!(
        fake.st.lock().unwrap().table_calls,
        0,
        "a tenant's table request read every tenant's tables"
    );
    let (_, v) = call(&app, "GET", "/v1/health", t, None);
    assert!(v.as_array().unwrap().iter().all(|h| h["tenant"] == "acme"));

    // Changing a tenant, even its own, needs the full-access token.
    let (s, v) = call(
        &app,
        "PUT",
        "/v1/tenants/acme",
        t,
        Some(r#"{"max_connections":1000000}"#),
    );
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(
        fake.st
            .lock()
            .unwrap()
            .config
            .tenants
            .iter()
            .find(|x| x.name == "acme")
            .unwrap()
            .max_connections,
        100
    );

    // Its own tenant: allowed.
    let (s, v) = call(
        &app,
        "PUT",
        "/v1/services/acme/web/backends/10.1.0.1:8080",
        t,
        Some(r#"{"weight":3}"#),
    );
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, _) = call(&app, "DELETE", "/v1/connections/100", t, None);
    assert_eq!(s, StatusCode::OK);

    // A service without a tenant lands in the token's tenant.
    let (s, v) = call(
        &app,
        "POST",
        "/v1/services",
        t,
        Some(r#"{"name":"mine","protocol":"tcp","listen":"10.0.0.1:81"}"#),
    );
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["created"], "acme/mine");

    // Another tenant, or daemon-wide: 403 (or 404 for a cookie it cannot see).
    let forbidden = [
        ("GET", "/v1/services/globex/dns", None),
        (
            "PUT",
            "/v1/services/globex/dns",
            Some(r#"{"protocol":"udp","listen":"10.0.0.2:53"}"#),
        ),
        ("DELETE", "/v1/services/globex/dns", None),
        (
            "POST",
            "/v1/services",
            Some(r#"{"tenant":"globex","name":"x","protocol":"tcp","listen":"1.1.1.1:1"}"#),
        ),
        (
            "POST",
            "/v1/services/globex/dns/backends",
            Some(r#"{"address":"1.1.1.1:1"}"#),
        ),
        (
            "PUT",
            "/v1/services/globex/dns/backends/10.2.0.1:53",
            Some(r#"{"weight":1}"#),
        ),
        (
            "DELETE",
            "/v1/services/globex/dns/backends/10.2.0.1:53",
            None,
        ),
        ("GET", "/v1/connections?tenant=globex", None),
        (
            "POST",
            "/v1/connections/kill",
            Some(r#"{"tenant":"globex"}"#),
        ),
        ("POST", "/v1/tenants", Some(r#"{"name":"mine"}"#)),
        ("DELETE", "/v1/tenants/globex", None),
        ("DELETE", "/v1/tenants/acme", None),
        ("GET", "/v1/config", None),
        ("POST", "/v1/reload", None),
        ("GET", "/metrics", None),
    ];
    for (m, p, b) in forbidden {
        let (s, v) = call(&app, m, p, t, b);
        assert_eq!(s, StatusCode::FORBIDDEN, "{m} {p}: {v}");
    }
    let (s, _) = call(&app, "DELETE", "/v1/connections/102", t, None);
    assert_eq!(
        s,
        StatusCode::NOT_FOUND,
        "globex's cookie is invisible to acme"
    );
    assert!(
        fake.st.lock().unwrap().conns.contains_key(&102),
        "and not killed"
    );
    // Kill with an empty filter and all=true only reaches its own tenant.
    let (s, v) = call(
        &app,
        "POST",
        "/v1/connections/kill",
        t,
        Some(r#"{"all":true}"#),
    );
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["killed"], 1);
    assert!(fake.st.lock().unwrap().conns.contains_key(&102));
    // Requests about one tenant or service read that one: never a copy of
    // the whole configuration (O(all services) per request before).
    assert_eq!(fake.st.lock().unwrap().running_config_calls, 0);
}

#[test]
fn bodies_are_size_limited() {
    let (_, app) = app();
    let big = format!(r#"{{"name":"{}"}}"#, "a".repeat(admin::BODY_LIMIT + 10));
    let (s, v) = call(&app, "POST", "/v1/tenants", Some(FULL), Some(&big));
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
}

#[test]
fn unknown_routes_and_methods_are_4xx() {
    let (_, app) = app();
    let (s, v) = call(&app, "GET", "/v2/nothing", Some(FULL), None);
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(v["message"].as_str().unwrap().contains("openapi"));
    let (s, v) = call(&app, "PATCH", "/v1/tenants", Some(FULL), None);
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(v["error"], "method_not_allowed", "{v}");
}

#[test]
fn metrics_are_prometheus_text_and_protected() {
    let (_, app) = app();
    let (s, _) = call(&app, "GET", "/metrics", None, None);
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, v) = call(&app, "GET", "/metrics", Some(FULL), None);
    assert_eq!(s, StatusCode::OK);
    let text = v.as_str().expect("text body");
    for needle in [
        r#"weir_backend_connections_total{tenant="acme",service="web",backend="10.1.0.1:8080"} 617"#,
        r#"weir_service_in_bytes_total{tenant="acme",service="web"} 5000000000"#,
        r#"weir_service_out_bytes_per_second{tenant="acme",service="web"} 2000000000"#,
        r#"weir_tenant_refused_connections_total{tenant="acme"} 7"#,
        r#"weir_backend_up{tenant="acme",service="web",backend="10.1.0.2:8080"} 0"#,
        r#"weir_refused_connections_total{reason="tenant_limit"} 7"#,
        r#"weir_table_buckets{tenant="acme",placement="own"} 1024"#,
        r#"weir_table_load_factor{tenant="acme",placement="own"} 0.25"#,
        "weir_estimator_tick_duration_seconds 0.0005",
        "# UNIT weir_estimator_tick_duration_seconds seconds",
        "process_open_fds 42",
        "weir_connections_total 1234",
        "weir_out_bytes_total 40",
        "process_max_fds 1024",
        "weir_active_connections 3",
        "# EOF",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
    let public = app_with(Arc::new(Fake::sample()), true);
    let (s, _) = call(&public, "GET", "/metrics", None, None);
    assert_eq!(s, StatusCode::OK, "metrics_public = true");
    let (s, _) = call(&public, "GET", "/v1/services", None, None);
    assert_eq!(s, StatusCode::UNAUTHORIZED, "only /metrics is public");
}

/// The test that keeps /v1/openapi.json true: the router's routes and the
/// document's operations are the same set, and every documented operation
/// is answered by a handler (not the 404 fallback or a 405).
#[test]
fn openapi_matches_router() {
    let (_, app) = app();
    let (s, doc) = call(&app, "GET", "/v1/openapi.json", Some(FULL), None);
    assert_eq!(s, StatusCode::OK);
    assert_eq!(doc["openapi"], "3.1.0");
    let mut documented = BTreeSet::new();
    for (path, ops) in doc["paths"].as_object().unwrap() {
        for (method, op) in ops.as_object().unwrap() {
            assert!(
                op["summary"].as_str().is_some_and(|s| !s.is_empty()),
                "{method} {path}"
            );
            assert!(
                op["responses"]["401"].is_object(),
                "{method} {path} documents 401"
            );
            // Every {param} of the path is documented as a path parameter.
            for seg in path.split('/').filter(|s| s.starts_with('{')) {
                let name = seg.trim_matches(|c| c == '{' || c == '}');
                assert!(
                    op["parameters"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|p| p["name"] == name && p["in"] == "path"),
                    "{method} {path}: parameter {name} undocumented"
                );
            }
            documented.insert((method.clone(), path.clone()));
        }
    }
    let routed: BTreeSet<(String, String)> = admin::route_table()
        .into_iter()
        .map(|(m, p)| (m.as_openapi().to_owned(), p.to_owned()))
        .collect();
    assert_eq!(documented, routed, "openapi.json and the router disagree");
    for (m, p) in &routed {
        let method = Method::from_bytes(m.to_uppercase().as_bytes()).unwrap();
        let (s, v) = call(&app, method.as_str(), &fill(p), Some(RO), None);
        assert_ne!(s, StatusCode::METHOD_NOT_ALLOWED, "{m} {p}");
        if s == StatusCode::NOT_FOUND {
            assert!(
                !v["message"]
                    .as_str()
                    .unwrap_or("")
                    .contains("no such route"),
                "{m} {p} not routed"
            );
        }
    }
    // The schemas name exactly the fields the handlers serialise.
    let f = Fake::sample();
    // acme carries every optional tenant field (timeouts included).
    let mut acme = f.running_config().tenants.remove(1);
    assert_eq!(acme.name, "acme");
    acme.timeouts.established = Some("1h".parse().unwrap());
    f.edit_tenant("acme", acme).unwrap();
    let svc = f.services().remove(0);
    let conn = f
        .connections(&Default::default(), None, 1)
        .unwrap()
        .connections
        .remove(0);
    let exact: Vec<(&str, Value)> = vec![
        (
            "TenantStatus",
            serde_json::to_value(&f.tenants()[0]).unwrap(),
        ),
        ("ServiceStatus", serde_json::to_value(&svc).unwrap()),
        (
            "BackendStatus",
            serde_json::to_value(&svc.backends[0]).unwrap(),
        ),
        ("ConnInfo", serde_json::to_value(&conn).unwrap()),
        ("TableReport", serde_json::to_value(&f.table()[0]).unwrap()),
        ("HealthEntry", serde_json::to_value(&f.health()[1]).unwrap()),
        ("Totals", serde_json::to_value(svc.stats).unwrap()),
        ("Rates", serde_json::to_value(svc.rates).unwrap()),
    ];
    let props = |name: &str| -> BTreeSet<String> {
        doc["components"]["schemas"][name]["properties"]
            .as_object()
            .unwrap_or_else(|| panic!("schema {name}"))
            .keys()
            .cloned()
            .collect()
    };
    for (name, sample) in exact {
        let keys: BTreeSet<String> = sample.as_object().unwrap().keys().cloned().collect();
        assert_eq!(keys, props(name), "schema {name} vs what the API sends");
    }
    // Request bodies: every field a full spec can carry is documented.
    let mut full = f.running_config().services.remove(0);
    full.persistence_netmask = Some("255.255.255.0".into());
    full.options.connect_timeout = Some("2s".parse().unwrap());
    full.options.udp_responses = Some(1);
    full.options.udp_timeout = Some("30s".parse().unwrap());
    full.options.udp_max_sessions_per_client = 3;
    full.options.hash_seed = Some("k".into());
    full.options.sh_fallback = true;
    full.options.sh_port = true;
    full.options.mh_port = true;
    full.options.mh_table_size = Some(251);
    full.options.tcp_max_connections_per_client = 2;
    full.options.client_prefix6 = Some(56);
    full.options.health = Some(Default::default());
    full.backends[0].proxy_protocol = Some(weir::proxy_protocol::Version::V2);
    full.backends[0].max_connections = 9;
    full.forward = weir::config::Forward::Nat;
    full.options.sloppy_tcp = true;
    let full_tenant = f.running_config().tenants.remove(1);
    for (name, sample) in [
        ("ServiceSpec", serde_json::to_value(&full).unwrap()),
        (
            "BackendSpec",
            serde_json::to_value(&full.backends[0]).unwrap(),
        ),
        ("TenantSpec", serde_json::to_value(&full_tenant).unwrap()),
    ] {
        let keys: BTreeSet<String> = sample.as_object().unwrap().keys().cloned().collect();
        assert_eq!(keys, props(name), "schema {name} vs the config type");
    }
    // Every $ref resolves.
    let text = doc.to_string();
    for r in text.split("\"#/components/schemas/").skip(1) {
        let name = &r[..r.find('"').unwrap()];
        assert!(
            doc["components"]["schemas"][name].is_object(),
            "dangling $ref {name}"
        );
    }
}

#[test]
fn control_panics_become_500_not_a_dead_connection() {
    #[derive(Debug)]
    struct Panicky(Fake);
    impl weir::control::Control for Panicky {
        fn tenants(&self) -> Vec<weir::control::TenantStatus> {
            panic!("boom")
        }
        fn add_tenant(&self, s: weir::config::TenantSpec) -> weir::control::ControlResult<()> {
            self.0.add_tenant(s)
        }
        fn edit_tenant(
            &self,
            t: &str,
            s: weir::config::TenantSpec,
        ) -> weir::control::ControlResult<()> {
            self.0.edit_tenant(t, s)
        }
        fn delete_tenant(&self, t: &str) -> weir::control::ControlResult<u64> {
            self.0.delete_tenant(t)
        }
        fn services(&self) -> Vec<weir::control::ServiceStatus> {
            self.0.services()
        }
        fn add_service(&self, s: weir::config::ServiceSpec) -> weir::control::ControlResult<()> {
            self.0.add_service(s)
        }
        fn edit_service(
            &self,
            t: &str,
            n: &str,
            s: weir::config::ServiceSpec,
        ) -> weir::control::ControlResult<()> {
            self.0.edit_service(t, n, s)
        }
        fn delete_service(&self, t: &str, n: &str) -> weir::control::ControlResult<()> {
            self.0.delete_service(t, n)
        }
        fn add_backend(
            &self,
            t: &str,
            s: &str,
            b: weir::config::BackendSpec,
        ) -> weir::control::ControlResult<()> {
            self.0.add_backend(t, s, b)
        }
        fn edit_backend(
            &self,
            t: &str,
            s: &str,
            a: &str,
            p: weir::control::BackendPatch,
        ) -> weir::control::ControlResult<()> {
            self.0.edit_backend(t, s, a, p)
        }
        fn delete_backend(&self, t: &str, s: &str, a: &str) -> weir::control::ControlResult<()> {
            self.0.delete_backend(t, s, a)
        }
        fn connections(
            &self,
            f: &weir::control::ConnFilter,
            c: Option<&str>,
            l: usize,
        ) -> weir::control::ControlResult<weir::control::ConnPage> {
            self.0.connections(f, c, l)
        }
        fn kill(&self, c: u64, t: Option<&str>) -> weir::control::ControlResult<()> {
            self.0.kill(c, t)
        }
        fn kill_matching(
            &self,
            f: &weir::control::ConnFilter,
        ) -> weir::control::ControlResult<u64> {
            self.0.kill_matching(f)
        }
        fn global_stats(&self) -> weir::control::GlobalStats {
            self.0.global_stats()
        }
        fn table(&self) -> Vec<weir::control::TableReport> {
            self.0.table()
        }
        fn health(&self) -> Vec<weir::control::HealthEntry> {
            self.0.health()
        }
        fn running_config(&self) -> weir::config::Config {
            self.0.running_config()
        }
        fn for_each_tenant_token(&self, f: &mut dyn FnMut(&str, &str)) {
            self.0.for_each_tenant_token(f)
        }
        fn tenant_spec(&self, t: &str) -> Option<weir::config::TenantSpec> {
            self.0.tenant_spec(t)
        }
        fn service_spec(&self, t: &str, s: &str) -> Option<weir::config::ServiceSpec> {
            self.0.service_spec(t, s)
        }
        fn reload(
            &self,
            opts: weir::control::ReloadOptions,
        ) -> Result<weir::control::ReloadReport, Vec<String>> {
            self.0.reload(opts)
        }
    }
    let app = admin::router(
        Arc::new(Panicky(Fake::sample())),
        Tokens::new(FULL, None),
        false,
    );
    // The panic is logged: capture this thread's log lines.
    #[derive(Clone, Default)]
    struct Lines(Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Lines {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let lines = Lines::default();
    let sink = lines.clone();
    let logger = tracing_subscriber::fmt()
        .with_writer(move || sink.clone())
        .with_ansi(false)
        .finish();
    let (s, v) = tracing::subscriber::with_default(logger, || {
        call(&app, "GET", "/v1/tenants", Some(FULL), None)
    });
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(v["error"], "internal");
    assert!(
        v["message"].as_str().unwrap().contains("internal error"),
        "{v}"
    );
    let logged = String::from_utf8_lossy(&lines.0.lock().unwrap()).into_owned();
    assert!(
        logged.contains("ERROR") && logged.contains("panicked") && logged.contains("boom"),
        "{logged}"
    );
    let (s, _) = call(&app, "GET", "/v1/services", Some(FULL), None);
    assert_eq!(s, StatusCode::OK, "the router keeps serving");
}

#[test]
fn serves_over_a_unix_socket_and_generates_a_token() {
    use std::io::{Read, Write};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("admin.sock");
    let token_file = dir.join("token");
    let cfg = weir::config::AdminConfig {
        listen: format!("unix:{}", sock.display()),
        token_file: Some(token_file.clone()),
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let fake: Arc<dyn weir::control::Control> = Arc::new(Fake::sample());
    let bound = rt.block_on(admin::bind(&cfg, fake)).expect("bind");
    let server = rt.spawn(bound.run(stop.clone()));
    let token = std::fs::read_to_string(&token_file)
        .expect("token generated")
        .trim()
        .to_owned();
    assert_eq!(token.len(), 64);
    let mut s = std::os::unix::net::UnixStream::connect(&sock).expect("connect");
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    write!(s, "GET /v1/tenants HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains("\"acme\""));
    stop.cancel();
    rt.block_on(server).unwrap().expect("clean shutdown");
    assert!(!sock.exists(), "socket removed on shutdown");
    let _ = std::fs::remove_dir_all(&dir);
}

mod props {
    use super::*;
    use proptest::prelude::*;

    fn segment() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("v1".to_string()),
            Just("tenants".to_string()),
            Just("services".to_string()),
            Just("backends".to_string()),
            Just("connections".to_string()),
            Just("kill".to_string()),
            Just("acme".to_string()),
            Just("globex".to_string()),
            Just("web".to_string()),
            Just("10.1.0.1:8080".to_string()),
            Just("%5B::1%5D:80".to_string()),
            Just("%ff%fe".to_string()),
            Just("..".to_string()),
            Just("".to_string()),
            "[a-zA-Z0-9%:._~-]{0,12}",
            any::<u64>().prop_map(|n| n.to_string()),
        ]
    }

    fn path() -> impl Strategy<Value = String> {
        let templated = prop::sample::select(admin::route_table())
            .prop_flat_map(|(_, p)| {
                let parts: Vec<String> = p.split('/').map(str::to_owned).collect();
                let n = parts.len();
                (Just(parts), prop::collection::vec(segment(), n))
            })
            .prop_map(|(parts, fills)| {
                parts
                    .iter()
                    .zip(fills)
                    .map(|(p, f)| if p.starts_with('{') { f } else { p.clone() })
                    .collect::<Vec<_>>()
                    .join("/")
            });
        let random =
            prop::collection::vec(segment(), 0..6).prop_map(|s| format!("/{}", s.join("/")));
        let query = prop::option::of(prop::collection::vec(
            (
                prop_oneof![
                    Just("tenant"),
                    Just("service"),
                    Just("backend"),
                    Just("state"),
                    Just("cursor"),
                    Just("limit"),
                    Just("x")
                ],
                segment(),
            ),
            0..4,
        ));
        (prop_oneof![templated, random], query).prop_map(|(p, q)| match q {
            None => p,
            Some(kv) => {
                let qs: Vec<String> = kv.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
                format!("{p}?{}", qs.join("&"))
            }
        })
    }

    fn body() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            Just(Vec::new()),
            prop::collection::vec(any::<u8>(), 0..64),
            Just(br#"{"name":"t1","table_entries":1024}"#.to_vec()),
            Just(br#"{"tenant":"acme","name":"s","protocol":"tcp","listen":"1.2.3.4:5","backend":[{"address":"1.1.1.1:1","weight":4294967295}]}"#.to_vec()),
            Just(br#"{"weight":0,"drain":true}"#.to_vec()),
            Just(br#"{"address":"1.1.1.1:1"}"#.to_vec()),
            Just(br#"{"all":true}"#.to_vec()),
            Just(br#"{"tenant":null,"all":null}"#.to_vec()),
            Just(br#"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]"#.to_vec()),
            Just(br#"{"weight":18446744073709551616}"#.to_vec()),
            "\\PC{0,40}".prop_map(String::into_bytes),
        ]
    }

    fn token() -> impl Strategy<Value = Option<String>> {
        prop_oneof![
            Just(None),
            Just(Some(format!("Bearer {FULL}"))),
            Just(Some(format!("Bearer {RO}"))),
            Just(Some("Bearer acme-token".to_string())),
            Just(Some("Bearer globex-token".to_string())),
            Just(Some("Bearer".to_string())),
            Just(Some("Basic abc".to_string())),
            "\\PC{0,20}".prop_map(Some),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

        /// No request, however odd, yields a 5xx or a panic.
        #[test]
        fn never_5xx(
            method in prop::sample::select(vec!["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
            path in path(),
            body in body(),
            auth in token(),
            ctype in prop::option::of(prop::sample::select(vec!["application/json", "text/plain", "\u{1}"])),
        ) {
            let (_, app) = app();
            let mut b = Request::builder().method(method).uri(path.as_str());
            if let Some(a) = &auth {
                b = b.header("authorization", a.as_str());
            }
            if let Some(c) = ctype {
                b = b.header("content-type", c);
            }
            // Paths or headers the http crate itself rejects never reach the server.
            let Ok(req) = b.body(Body::from(body)) else { return Ok(()); };
            let status = rt().block_on(async { app.oneshot(req).await.expect("infallible").status() });
            prop_assert!(!status.is_server_error(), "{method} {path} -> {status}");
        }
    }
}

/// A kill's filter is exactly what it says: a key the API does not know
/// (a typo) is refused with 400, not dropped. Before, it was ignored, so
/// `{"tenant":"acme","servcie":"web"}` killed every connection of acme,
/// and `{"state":"ESTABLISHED","bakend":...}` every established one.
#[test]
fn a_kill_filter_with_an_unknown_key_is_refused_and_kills_nothing() {
    let (fake, app) = app();
    let before = fake.st.lock().unwrap().conns.len();
    for body in [
        r#"{"tenant":"acme","servcie":"web"}"#,
        r#"{"state":"ESTABLISHED","bakend":"10.1.0.1:8080"}"#,
        r#"{"all":true,"tenants":"globex"}"#,
    ] {
        let (s, v) = call(&app, "POST", "/v1/connections/kill", Some(FULL), Some(body));
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}: {v}");
        let message = v["message"].as_str().unwrap_or_default();
        assert!(message.contains("unknown field"), "{body}: {v}");
        assert_eq!(
            fake.st.lock().unwrap().conns.len(),
            before,
            "{body} killed connections"
        );
    }
}
