//! The admin API under attack and misconfiguration (issue 10): one token
//! per role, tenant tokens see only their own table figures, slow or
//! oversized requests cannot shut operators out, token files planted by
//! other users are refused, and `weir run` does not start without its API.

mod admin_fake;

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::{Value, json};
use tower::ServiceExt;

use admin_fake::Fake;
use weir::admin::auth::Tokens;
use weir::admin::{self};
use weir::control::Control;

const FULL: &str = "full-secret";
const RO: &str = "ro-secret";

fn app() -> (Arc<Fake>, Router) {
    let f = Arc::new(Fake::sample());
    (
        f.clone(),
        admin::router(f, Tokens::new(FULL, Some(RO.into())), false),
    )
}

fn call(
    app: &Router,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut b = Request::builder().method(method).uri(path);
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    let req = b
        .body(body.map_or_else(Body::empty, |v| Body::from(v.to_string())))
        .expect("request");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let resp = app.clone().oneshot(req).await.expect("infallible");
        let status = resp.status();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .expect("body");
        let v = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        (status, v)
    })
}

// ---- defect 17: a tenant sees only its own load -----------------------------

#[test]
fn tenant_token_sees_no_shared_table_load_of_others() {
    let (_, app) = app();
    // globex lives in the shared table.
    let (s, full) = call(&app, "GET", "/v1/table", Some(FULL), None);
    assert_eq!(s, StatusCode::OK);
    let shared = full
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["tenant"] == "globex")
        .unwrap()
        .clone();
    assert_eq!(shared["placement"], "shared");
    assert!(!shared["chain_histogram"].as_array().unwrap().is_empty());

    let (s, v) = call(&app, "GET", "/v1/table", Some("globex-token"), None);
    assert_eq!(s, StatusCode::OK);
    let rows = v.as_array().unwrap();
    assert_eq!(rows.len(), 1, "{v}");
    let r = &rows[0];
    assert_eq!(r["tenant"], "globex");
    assert_eq!(r["max_chain"], 0, "{r}");
    assert_eq!(r["chain_histogram"], json!([]), "{r}");
    // Its own entries per way, on the scale of the table's own figure.
    let own = r["entries"].as_f64().unwrap()
        / (r["buckets"].as_f64().unwrap() * weir_flowtable::BUCKET_WAYS as f64);
    assert_eq!(r["load_factor"].as_f64().unwrap(), own, "{r}");

    // A tenant with its own table sees that table's figures, which are its own.
    let (_, v) = call(&app, "GET", "/v1/table", Some("acme-token"), None);
    assert_eq!(v[0]["placement"], "own");
    assert_eq!(v[0]["max_chain"], 3, "{v}");
}

// ---- defect 18: one token, one role ------------------------------------------

#[test]
fn api_refuses_a_tenant_token_that_another_role_holds() {
    let (fake, app) = app();
    for (token, role) in [
        ("acme-token", "tenant \"acme\""),
        (FULL, "full-access"),
        (RO, "read-only"),
    ] {
        let (s, v) = call(
            &app,
            "POST",
            "/v1/tenants",
            Some(FULL),
            Some(json!({"name": "initech", "token": token})),
        );
        assert_eq!(s, StatusCode::CONFLICT, "{token}: {v}");
        let m = v["message"].as_str().unwrap();
        assert!(m.contains(role) && !m.contains(token), "{m}");
        let (s, v) = call(
            &app,
            "PUT",
            "/v1/tenants/globex",
            Some(FULL),
            Some(json!({"token": token})),
        );
        assert_eq!(s, StatusCode::CONFLICT, "{token}: {v}");
    }
    assert!(
        !fake
            .running_config()
            .tenants
            .iter()
            .any(|t| t.name == "initech")
    );
    // globex keeps its token; acme may keep (re-send) its own.
    let (s, _) = call(&app, "GET", "/v1/tenants", Some("globex-token"), None);
    assert_eq!(s, StatusCode::OK);
    let (s, v) = call(
        &app,
        "PUT",
        "/v1/tenants/acme",
        Some(FULL),
        Some(json!({"token": "acme-token", "max_connections": 5})),
    );
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = call(
        &app,
        "POST",
        "/v1/tenants",
        Some(FULL),
        Some(json!({"name": "initech", "token": "initech-token"})),
    );
    assert_eq!(s, StatusCode::CREATED, "{v}");
}

#[test]
fn check_refuses_one_token_in_several_roles() {
    let text = r#"
[admin]
token = "tok-a"
readonly_token = "tok-a"

[[tenant]]
name = "acme"
token = "t1"

[[tenant]]
name = "beta"
token = "t1"
"#;
    let errs = weir::config::parse(text, "dup.toml").expect_err("duplicates refused");
    let keys: Vec<_> = errs.iter().map(|e| e.key.as_str()).collect();
    assert!(keys.contains(&"admin.readonly_token"), "{errs:?}");
    assert!(keys.contains(&"tenant[1].token"), "{errs:?}");
    for e in &errs {
        assert!(e.message.contains("one role"), "{e}");
        assert!(
            !e.message.contains("t1") && !e.message.contains("tok-a"),
            "{e}"
        );
    }
    let line = errs
        .iter()
        .find(|e| e.key == "tenant[1].token")
        .and_then(|e| e.line);
    assert_eq!(line, Some(12), "{errs:?}");
}

// ---- defects 4 and 7: token files and an admin API that cannot start ---------

mod daemon_util;

use daemon_util::process::BIN;

fn free_port() -> u16 {
    daemon_util::process::free_addr().port()
}

/// Run `weir ARGS` with `env` and wait (bounded) for it to exit; a daemon
/// that keeps running is killed and reported as `None`.
fn run_weir(args: &[&str], env: &[(&str, &std::path::Path)]) -> (Option<i32>, String) {
    use std::io::Read;
    let mut cmd = std::process::Command::new(BIN);
    cmd.args(args)
        .env_remove("HOME")
        .env_remove("XDG_RUNTIME_DIR")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let code =
        daemon_util::process::exit_code_within(&mut child, std::time::Duration::from_secs(15));
    let mut err = String::new();
    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
    (code, err)
}

fn write_config(dir: &std::path::Path, admin: &str) -> String {
    let p = dir.join("weir.toml");
    std::fs::write(&p, format!("[daemon]\nworkers = 1\n[admin]\n{admin}\n")).unwrap();
    p.display().to_string()
}

fn chmod(p: &std::path::Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

const NOBODY: u32 = 65534;

#[test]
fn token_files_others_could_plant_change_or_read_are_refused() {
    use weir::admin::auth::read_token_file;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("weir");
    std::fs::create_dir(&dir).unwrap();
    chmod(&dir, 0o700);
    let f = dir.join("admin.token");
    std::fs::write(&f, "secret\n").unwrap();
    chmod(&f, 0o644);
    let why = |p: &std::path::Path| format!("{:#}", read_token_file(p).unwrap_err());
    assert!(
        why(&f).contains("open to group or others (mode 0644)"),
        "{}",
        why(&f)
    );
    chmod(&f, 0o600);
    assert_eq!(read_token_file(&f).unwrap().as_deref(), Some("secret"));
    // Another user's file, even with a tight mode.
    std::os::unix::fs::chown(&f, Some(NOBODY), None).unwrap();
    assert!(why(&f).contains("belongs to uid 65534"), "{}", why(&f));
    std::os::unix::fs::chown(&f, Some(rustix_uid()), None).unwrap();
    // A directory others may write to (not sticky), or another user's.
    chmod(&dir, 0o777);
    assert!(
        why(&f).contains("writable by group or others"),
        "{}",
        why(&f)
    );
    let missing = dir.join("not-yet");
    assert!(
        read_token_file(&missing).is_err(),
        "no token may be generated into a directory others can write"
    );
    chmod(&dir, 0o700);
    std::os::unix::fs::chown(&dir, Some(NOBODY), None).unwrap();
    assert!(why(&f).contains("belongs to uid 65534"), "{}", why(&f));
    std::os::unix::fs::chown(&dir, Some(rustix_uid()), None).unwrap();
    assert!(read_token_file(&f).is_ok());
}

fn rustix_uid() -> u32 {
    use std::os::unix::fs::MetadataExt;
    // The test's own uid: whoever owns a file it just created.
    let tmp = tempfile::NamedTempFile::new().unwrap();
    std::fs::metadata(tmp.path()).unwrap().uid()
}

/// The attack of issue 10: no HOME, no XDG_RUNTIME_DIR, no token
/// configured, and a `nobody`-owned 0644 token in a 0777 `$TMPDIR/weir`.
#[test]
fn run_refuses_a_token_planted_in_tmpdir() {
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let cfg = write_config(tmp.path(), &format!("listen = \"127.0.0.1:{port}\""));
    let planted_dir = tmp.path().join("weir");
    std::fs::create_dir(&planted_dir).unwrap();
    let planted = planted_dir.join(format!("admin-127_0_0_1_{port}.token"));
    std::fs::write(&planted, "attacker-knows-this\n").unwrap();
    chmod(&planted, 0o644);
    chmod(&planted_dir, 0o777);
    std::os::unix::fs::chown(&planted, Some(NOBODY), Some(NOBODY)).unwrap();
    std::os::unix::fs::chown(&planted_dir, Some(NOBODY), Some(NOBODY)).unwrap();
    let env = [("TMPDIR", tmp.path())];
    let (code, err) = run_weir(&["check", "--config", &cfg], &env);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("belongs to uid 65534"), "{err}");
    let (code, err) = run_weir(&["run", "--config", &cfg], &env);
    assert_eq!(code, Some(1), "weir run must refuse to start: {err}");
    assert!(err.contains("belongs to uid 65534"), "{err}");
}

#[test]
fn run_exits_when_the_admin_api_cannot_start() {
    let tmp = tempfile::tempdir().unwrap();
    // 1. The admin address is taken.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let cfg = write_config(
        tmp.path(),
        &format!(
            "listen = \"{}\"\ntoken = \"t\"",
            taken.local_addr().unwrap()
        ),
    );
    let (code, err) = run_weir(&["run", "--config", &cfg], &[]);
    assert_eq!(code, Some(1), "port taken: {err}");
    assert!(err.contains("binding the admin API"), "{err}");
    // 2. The token file is a directory; 3. it is empty. `weir check`
    // catches both, and `weir run` does not start.
    let as_dir = tmp.path().join("tokdir");
    std::fs::create_dir(&as_dir).unwrap();
    let empty = tmp.path().join("empty.token");
    std::fs::write(&empty, "").unwrap();
    chmod(&empty, 0o600);
    for (file, why) in [(&as_dir, "not a regular file"), (&empty, "is empty")] {
        let cfg = write_config(
            tmp.path(),
            &format!(
                "listen = \"127.0.0.1:{}\"\ntoken_file = \"{}\"",
                free_port(),
                file.display()
            ),
        );
        let (code, err) = run_weir(&["check", "--config", &cfg], &[]);
        assert_eq!(code, Some(1), "check {why}: {err}");
        assert!(err.contains(why), "{err}");
        let (code, err) = run_weir(&["run", "--config", &cfg], &[]);
        assert_eq!(code, Some(1), "run {why}: {err}");
        assert!(err.contains(why), "{err}");
    }
}

// ---- defect 1: slow, idle or oversized clients cannot shut the operator out --

/// The admin API over real TCP on 127.0.0.1, in front of the fake control.
fn serve_tcp() -> admin_fake::Served {
    admin_fake::serve(&[admin_fake::admin_config("127.0.0.1:0", FULL)])
}

/// An authenticated GET that must be answered within `within`.
fn operator_get(addr: std::net::SocketAddr, within: std::time::Duration) -> Result<String, String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, within).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(within)).unwrap();
    write!(
        s,
        "GET /v1/tenants HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {FULL}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)
        .map_err(|e| format!("read: {e}"))?;
    Ok(resp)
}

/// A connection that has sent part of a request head and then stalls.
fn slow_client(addr: std::net::SocketAddr) -> std::net::TcpStream {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /v1/tenants HTTP/1.1\r\nHo").unwrap();
    s
}

/// True once the server has closed `s` (EOF or reset), within `t`.
fn closed_within(s: &mut std::net::TcpStream, t: std::time::Duration) -> bool {
    use std::io::Read;
    s.set_read_timeout(Some(t)).unwrap();
    let mut b = [0u8; 256];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue, // an error response before the close
            Err(e) => {
                return !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                );
            }
        }
    }
}

/// The slowloris test: 300 connections (more than the 128-connection cap)
/// hold partial request heads open, and the operator still gets an answer
/// at once, again and again.
#[test]
fn slowloris_does_not_shut_out_the_operator() {
    let srv = serve_tcp();
    let mut held = Vec::new();
    for _ in 0..300 {
        held.push(slow_client(srv.addr));
    }
    for i in 0..5 {
        let resp = operator_get(srv.addr, std::time::Duration::from_secs(3))
            .unwrap_or_else(|e| panic!("operator request {i} not answered: {e}"));
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        held.push(slow_client(srv.addr));
    }
    drop(held);
}

/// One source holds at most 16 unauthenticated connections: the 17th
/// evicts the oldest.
#[test]
fn per_source_cap_evicts_the_oldest_unauthenticated() {
    let srv = serve_tcp();
    let mut first = slow_client(srv.addr);
    let mut rest: Vec<_> = (0..15).map(|_| slow_client(srv.addr)).collect();
    // Let the server accept them (a new connection is only admitted after).
    assert!(operator_get(srv.addr, std::time::Duration::from_secs(3)).is_ok());
    rest.push(slow_client(srv.addr));
    assert!(
        closed_within(&mut first, std::time::Duration::from_secs(5)),
        "the oldest unauthenticated connection of the source stays open"
    );
}

/// A request head trickled one byte at a time is cut at the head deadline
/// (10 s), not kept alive by every byte.
#[test]
fn request_head_has_a_deadline() {
    use std::io::Write;
    let srv = serve_tcp();
    let mut s = std::net::TcpStream::connect(srv.addr).unwrap();
    let started = std::time::Instant::now();
    let head = b"GET /v1/tenants HTTP/1.1\r\nX-Pad: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut cut = false;
    for b in head.iter().cycle().take(80) {
        if s.write_all(&[*b]).is_err() {
            cut = true;
            break;
        }
        s.set_read_timeout(Some(std::time::Duration::from_millis(250)))
            .unwrap();
        let mut buf = [0u8; 64];
        match std::io::Read::read(&mut s, &mut buf) {
            Ok(_) => {
                cut = true;
                break;
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => {
                cut = true;
                break;
            }
        }
    }
    let took = started.elapsed();
    assert!(cut, "a trickled head was never cut ({took:?})");
    assert!(
        took >= std::time::Duration::from_secs(9) && took < std::time::Duration::from_secs(15),
        "cut after {took:?}, want about 10 s"
    );
}

/// A declared body over the limit gets 413 before any of it is sent.
#[test]
fn oversized_content_length_is_refused_up_front() {
    use std::io::{Read, Write};
    let srv = serve_tcp();
    let mut s = std::net::TcpStream::connect(srv.addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    write!(
        s,
        "POST /v1/tenants HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {FULL}\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n{{"
    )
    .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).expect("answered without the body");
    let resp = String::from_utf8_lossy(&buf[..n]);
    assert!(resp.starts_with("HTTP/1.1 413"), "{resp}");
}

/// A keep-alive connection that made one request with `token` and read its answer.
fn authed_keepalive(addr: std::net::SocketAddr, token: &str) -> std::net::TcpStream {
    authed(std::net::TcpStream::connect(addr).unwrap(), token)
}

/// `s`, once it made one request with `token` and read its (200) answer.
fn authed(mut s: std::net::TcpStream, token: &str) -> std::net::TcpStream {
    use std::io::{Read, Write};
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    write!(
        s,
        "GET /v1/whoami HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n"
    )
    .unwrap();
    let mut buf = [0u8; 4096];
    let n = s.read(&mut buf).unwrap();
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    s
}

/// A tenant token must not shut the operator out: 16 idle keep-alive
/// connections that authenticated with a tenant token hold a source's
/// every place (every local client is 127.0.0.1), and the operator's
/// request from there still gets in (a tenant's connection gives way once
/// no unauthenticated one is left; the operator's never do).
#[test]
fn tenant_keepalives_do_not_shut_out_the_operator() {
    let srv = serve_tcp();
    // The per-source cap is 16.
    let held: Vec<std::net::TcpStream> = (0..16)
        .map(|_| authed_keepalive(srv.addr, "acme-token"))
        .collect();
    let resp = operator_get(srv.addr, std::time::Duration::from_secs(3));
    assert!(
        resp.as_ref().is_ok_and(|r| r.starts_with("HTTP/1.1 200")),
        "the operator is shut out by a tenant's 16 idle keep-alive connections: {resp:?}"
    );
    drop(held);
}

/// A connection to `addr` from source address `from` (any 127.0.0.0/8
/// address is this host's loopback).
fn connect_from(from: std::net::IpAddr, addr: std::net::SocketAddr) -> std::net::TcpStream {
    let s = socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )
    .unwrap();
    s.bind(&std::net::SocketAddr::new(from, 0).into()).unwrap();
    s.connect(&addr.into()).unwrap();
    s.into()
}

/// `authed_keepalive` from source address `from`.
fn authed_keepalive_from(
    from: std::net::IpAddr,
    addr: std::net::SocketAddr,
    token: &str,
) -> std::net::TcpStream {
    authed(connect_from(from, addr), token)
}

/// The operator's request on `s`, a connection opened earlier: its answer
/// (`Err` if the connection was closed under it).
fn operator_request_on(s: &mut std::net::TcpStream) -> Result<String, String> {
    use std::io::{Read, Write};
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    write!(
        s,
        "GET /v1/tenants HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {FULL}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| format!("write: {e}"))?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)
        .map_err(|e| format!("read: {e}"))?;
    if resp.is_empty() {
        return Err("closed without an answer".into());
    }
    Ok(resp)
}

/// The operator's source: every local client's unless it binds another.
const LO: std::net::IpAddr = std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

/// 127.0.0.2 to 127.0.0.9: eight sources (the per-source cap apart), none
/// the operator's.
fn eight_sources() -> Vec<std::net::IpAddr> {
    (0..8)
        .map(|i| format!("127.0.0.{}", 2 + i).parse().unwrap())
        .collect()
}

/// `authed_keepalive_from`, which asserts that the server answered.
fn must_answer(
    from: std::net::IpAddr,
    addr: std::net::SocketAddr,
    token: &str,
) -> Option<std::net::TcpStream> {
    Some(authed_keepalive_from(from, addr, token))
}

/// The holders of a token fill every place of `sources` (16 keep-alives
/// from each, each of `sources[i]` authenticated with `token(i)`); the
/// operator connects from 127.0.0.1, its request not sent yet; each
/// holder connects again from its source (`again`) before the operator's
/// request is read. The operator's request must be answered (`shut_out`
/// says by whom it was not).
fn operator_answered_after_refill(
    srv: &admin_fake::Served,
    sources: &[std::net::IpAddr],
    token: impl Fn(usize) -> String,
    again: fn(std::net::IpAddr, std::net::SocketAddr, &str) -> Option<std::net::TcpStream>,
    shut_out: &str,
) {
    let mut held = Vec::new();
    for (i, from) in sources.iter().enumerate() {
        for _ in 0..16 {
            held.push(authed_keepalive_from(*from, srv.addr, &token(i)));
        }
    }
    let mut op = connect_from(LO, srv.addr);
    for (i, from) in sources.iter().enumerate() {
        held.extend(again(*from, srv.addr, &token(i)));
    }
    let resp = operator_request_on(&mut op);
    assert!(
        resp.as_ref().is_ok_and(|r| r.starts_with("HTTP/1.1 200")),
        "{shut_out}: {resp:?}"
    );
    drop(held);
}

/// Tenants that together hold every admin place cannot keep the operator
/// out, though each stays within its share: 8 tenants hold 16 keep-alives
/// each (from 8 loopback addresses, the per-source cap apart), the
/// operator connects (evicting one of them), and the tenant that lost one
/// connects again before the operator's request is read. That
/// newcomer must not evict the operator's connection.
#[test]
fn colluding_tenants_cannot_shut_out_the_operator() {
    let srv = serve_tcp();
    {
        let mut st = srv.fake.st.lock().unwrap();
        let acme = st
            .config
            .tenants
            .iter()
            .find(|t| t.name == "acme")
            .unwrap()
            .clone();
        for i in 0..8 {
            let mut t = acme.clone();
            t.name = format!("colluder{i}");
            t.token = Some(format!("colluder{i}-token"));
            st.config.tenants.push(t);
        }
    }
    // Each tenant connects again (whichever lost a place to the operator
    // gets one back), authenticating at once. Each answer means the server
    // admitted this connection, after the operator's.
    operator_answered_after_refill(
        &srv,
        &eight_sources(),
        |i| format!("colluder{i}-token"),
        must_answer,
        "the operator's connection was evicted by tenants each within its share",
    );
}

/// The same on one source address (every local client is 127.0.0.1): a
/// tenant holding that source's 16 places, within its share, reconnects
/// after the operator's connection and must not evict it.
#[test]
fn a_tenant_filling_the_operators_source_cannot_shut_it_out() {
    operator_answered_after_refill(
        &serve_tcp(),
        &[LO],
        |_| "acme-token".into(),
        must_answer,
        "the operator's connection was evicted by a tenant within its share",
    );
}

/// The admin API over real TCP on 127.0.0.1 with a read-only token too.
fn serve_tcp_with_readonly() -> admin_fake::Served {
    let mut cfg = admin_fake::admin_config("127.0.0.1:0", FULL);
    cfg.readonly_token = Some(RO.into());
    admin_fake::serve(&[cfg])
}

/// `authed_keepalive_from`, or `None` if the server did not answer (the
/// connection was refused a place).
fn try_keepalive_from(
    from: std::net::IpAddr,
    addr: std::net::SocketAddr,
    token: &str,
) -> Option<std::net::TcpStream> {
    use std::io::{Read, Write};
    let mut s = connect_from(from, addr);
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    write!(
        s,
        "GET /v1/whoami HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n"
    )
    .ok()?;
    let mut buf = [0u8; 4096];
    let n = s.read(&mut buf).ok()?;
    String::from_utf8_lossy(&buf[..n])
        .starts_with("HTTP/1.1 200")
        .then_some(s)
}

/// The read-only token only reads, and is given to whoever needs to watch
/// (dashboards, scrapers, on-call): its holder must not be able to shut
/// the full-access operator out. It holds every place (16 keep-alives
/// from each of 8 loopback addresses), the operator connects, the holder
/// reconnects on each address before the operator's request is read:
/// the operator's request must be answered.
#[test]
fn readonly_holders_cannot_shut_out_the_operator() {
    operator_answered_after_refill(
        &serve_tcp_with_readonly(),
        &eight_sources(),
        |_| RO.into(),
        try_keepalive_from,
        "the operator is shut out by read-only keep-alives holding every place",
    );
}

/// The same on one source (every local client is 127.0.0.1): 16
/// read-only keep-alives hold the source's places, the operator connects
/// and the holder reconnects before the operator's request is read.
#[test]
fn a_readonly_holder_filling_the_operators_source_cannot_shut_it_out() {
    operator_answered_after_refill(
        &serve_tcp_with_readonly(),
        &[LO],
        |_| RO.into(),
        try_keepalive_from,
        "the operator is shut out by a read-only holder filling its source",
    );
}

// ---- the control runtime's one worker is not held by one request ------------

/// A request that waits at the fake's gate (a walk of a big table, a
/// render of many services) while the API runs on one worker thread, as
/// the daemon's control runtime does; `GET /v1/whoami` must be answered
/// meanwhile. Returns once the slow request is answered.
fn slow_request_leaves_the_runtime_free(method: &str, path: &str, body: Option<&str>) {
    use std::io::{Read, Write};
    use std::sync::atomic::Ordering::SeqCst;
    let srv = admin_fake::serve_on(&[admin_fake::admin_config("127.0.0.1:0", FULL)], 1);
    let gate = Arc::new(admin_fake::Gate::default());
    srv.fake.st.lock().unwrap().gate = Some(gate.clone());
    let mut slow = std::net::TcpStream::connect(srv.addr).unwrap();
    let body = body.unwrap_or("");
    write!(
        slow,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {FULL}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while gate.waiting.load(SeqCst) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "{method} {path} never reached the gate"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let other = operator_get(srv.addr, std::time::Duration::from_secs(5));
    gate.open();
    let mut resp = String::new();
    slow.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let _ = slow.read_to_string(&mut resp);
    assert!(
        other.as_ref().is_ok_and(|r| r.starts_with("HTTP/1.1 200")),
        "GET /v1/tenants while {method} {path} works: {other:?}"
    );
    assert!(resp.starts_with("HTTP/1.1 200"), "{method} {path}: {resp}");
}

/// A page of connections walks the table until `limit` entries match:
/// with a filter few match, all of it (1M entries: 160 ms). It runs off
/// the runtime's worker, which every other admin request needs.
#[test]
fn a_connection_listing_leaves_the_runtime_free() {
    slow_request_leaves_the_runtime_free("GET", "/v1/connections?state=SYN_RECV", None);
}

/// As a listing: a kill by filter walks the whole table.
#[test]
fn a_kill_by_filter_leaves_the_runtime_free() {
    slow_request_leaves_the_runtime_free(
        "POST",
        "/v1/connections/kill",
        Some(r#"{"state":"SYN_RECV"}"#),
    );
}

/// `/metrics` renders every service (5,000: 100-350 ms).
#[test]
fn a_metrics_render_leaves_the_runtime_free() {
    slow_request_leaves_the_runtime_free("GET", "/metrics", None);
}

/// A service listing builds every service's status (5,000: 7-43
/// ms); a tenant's listing and the figures of `/v1/stats` and
/// `/v1/rates` are built the same way, and so is the lookup of a bare
/// service name in a connection filter.
#[test]
fn a_service_listing_leaves_the_runtime_free() {
    slow_request_leaves_the_runtime_free("GET", "/v1/services", None);
}

#[test]
fn a_stats_render_leaves_the_runtime_free() {
    slow_request_leaves_the_runtime_free("GET", "/v1/stats", None);
}

#[test]
fn a_bare_service_name_lookup_leaves_the_runtime_free() {
    slow_request_leaves_the_runtime_free("GET", "/v1/connections?service=web", None);
}

/// With `metrics_public`, anyone may ask `/metrics` as often as it likes:
/// a render is served again for a second, and requests meanwhile wait for
/// the one render rather than each making its own.
#[test]
fn public_metrics_are_rendered_at_most_once_a_second() {
    use std::io::{Read, Write};
    let mut cfg = admin_fake::admin_config("127.0.0.1:0", FULL);
    cfg.metrics_public = true;
    let srv = admin_fake::serve_on(&[cfg], 1);
    let get = || {
        let mut s = std::net::TcpStream::connect(srv.addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        assert!(resp.contains("weir_connections_total"), "{resp}");
    };
    let calls = || srv.fake.st.lock().unwrap().global_stats_calls;
    let start = std::time::Instant::now();
    get();
    let mut n = 1;
    while start.elapsed() < std::time::Duration::from_millis(500) && n < 20 {
        get();
        n += 1;
    }
    // Each request within the first second (whatever the machine's speed,
    // this loop stops at half a second) got the one render.
    if start.elapsed() < std::time::Duration::from_secs(1) {
        assert_eq!(calls(), 1, "{n} requests within a second");
    }
    // A second later it is rendered again.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    get();
    assert!(calls() >= 2, "never rendered again");
}
