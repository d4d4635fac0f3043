//! TLS for the admin API (issue 13, item 4) and panics caught by the
//! router's `CatchPanicLayer` (item 5), over real sockets on 127.0.0.1:
//! the CLI verifies the daemon with `--cacert` and says what to do without
//! it, plain HTTP to the TLS port gets a clear 400, stalled handshakes
//! cannot shut the operator out, `weir check` checks the certificate files,
//! and a non-loopback plain-HTTP listen is refused unless allowed.

mod admin_fake;
mod daemon_util;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use admin_fake::Served;
use weir::cli::client::{CliError, Client};

const FULL: &str = "full-secret";
use daemon_util::process::BIN;

/// A self-signed certificate for 127.0.0.1 and localhost, and its key, as
/// PEM files in `dir`.
fn make_cert(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()])
        .expect("rcgen");
    let cert = dir.join(format!("{name}.crt"));
    let key = dir.join(format!("{name}.key"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    (cert, key)
}

/// The admin API over TLS on 127.0.0.1, in front of the fake control.
fn serve_tls(cert: &Path, key: &Path) -> Served {
    admin_fake::serve(&[weir::config::AdminConfig {
        tls_cert: Some(cert.to_owned()),
        tls_key: Some(key.to_owned()),
        ..admin_fake::admin_config("127.0.0.1:0", FULL)
    }])
}

/// Run the `weir` binary with `args` and `env`, bounded in time: exit code
/// (None if it had to be killed), stdout, stderr.
fn run_weir(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let mut cmd = std::process::Command::new(BIN);
    cmd.args(args)
        .env_remove("WEIR_ADMIN")
        .env_remove("WEIR_TOKEN")
        .env_remove("WEIR_CACERT")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let code = daemon_util::process::exit_code_within(&mut child, Duration::from_secs(30));
    let (mut out, mut err) = (String::new(), String::new());
    let _ = child.stdout.take().unwrap().read_to_string(&mut out);
    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
    (code, out, err)
}

#[test]
fn cli_verifies_the_daemon_with_cacert() {
    let tmp = tempfile::tempdir().unwrap();
    let (cert, key) = make_cert(tmp.path(), "admin");
    let srv = serve_tls(&cert, &key);
    let url = format!("https://{}", srv.addr);

    // The library client, as the commands use it.
    let c = Client::with_cacert(url.clone(), Some(FULL.into()), Some(&cert)).unwrap();
    let tenants: Value = c.get("/v1/tenants").expect("GET over TLS");
    assert!(
        tenants
            .as_array()
            .is_some_and(|a| a.iter().any(|t| t["name"] == "acme")),
        "{tenants}"
    );

    // The binary: --cacert, and the same through WEIR_CACERT.
    let cert_s = cert.display().to_string();
    let (code, out, err) = run_weir(
        &[
            "tenant", "list", "--admin", &url, "--token", FULL, "--cacert", &cert_s,
        ],
        &[],
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("acme"), "{out}");
    let (code, out, err) = run_weir(
        &["tenant", "list", "--admin", &url, "--token", FULL],
        &[("WEIR_CACERT", &cert_s)],
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("acme"), "{out}");

    // --config with tls_cert: https:// and the certificate as trust anchor.
    let cfg = tmp.path().join("weir.toml");
    std::fs::write(
        &cfg,
        format!(
            "[admin]\nlisten = \"{}\"\ntoken = \"{FULL}\"\ntls_cert = \"{}\"\ntls_key = \"{}\"\n",
            srv.addr,
            cert.display(),
            key.display()
        ),
    )
    .unwrap();
    let (code, out, err) = run_weir(
        &["tenant", "list", "--config", &cfg.display().to_string()],
        &[],
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("acme"), "{out}");
}

#[test]
fn without_the_right_cacert_verification_fails_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let (cert, key) = make_cert(tmp.path(), "admin");
    let (other, _) = make_cert(tmp.path(), "other");
    let srv = serve_tls(&cert, &key);
    let url = format!("https://{}", srv.addr);
    for cacert in [None, Some(other.as_path())] {
        let c = Client::with_cacert(url.clone(), Some(FULL.into()), cacert).unwrap();
        match c.call("GET", "/v1/tenants", None) {
            Err(CliError::Local(m)) => {
                assert!(m.contains("TLS with the admin API"), "{m}");
                assert!(m.contains("not signed by a CA this client trusts"), "{m}");
                assert!(m.contains("--cacert"), "{m}");
            }
            other => panic!("expected a verification error, got {other:?}"),
        }
    }
    // The binary says the same and exits 2 (could not talk to the daemon).
    let (code, _, err) = run_weir(&["tenant", "list", "--admin", &url, "--token", FULL], &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--cacert"), "{err}");
    // A certificate that does not name the host in the URL.
    let c = Client::with_cacert(
        format!("https://localhost.invalid:{}", srv.addr.port()),
        Some(FULL.into()),
        Some(&cert),
    )
    .unwrap();
    let e = c.call("GET", "/v1/tenants", None).unwrap_err();
    assert!(matches!(e, CliError::Local(_)), "{e:?}");
    // A --cacert file without a certificate is refused before connecting.
    let junk = tmp.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate\n").unwrap();
    match Client::with_cacert(url, None, Some(&junk)) {
        Err(CliError::Local(m)) => assert!(m.contains("holds no PEM certificate"), "{m}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn plain_http_to_the_tls_port_is_told_to_use_https() {
    let tmp = tempfile::tempdir().unwrap();
    let (cert, key) = make_cert(tmp.path(), "admin");
    let srv = serve_tls(&cert, &key);
    let c = Client::new(format!("http://{}", srv.addr), Some(FULL.into()));
    match c.call("GET", "/v1/tenants", None) {
        Err(CliError::Api {
            status, message, ..
        }) => {
            assert_eq!(status, 400);
            assert!(
                message.contains("speaks TLS") && message.contains("https://"),
                "{message}"
            );
        }
        other => panic!("expected a 400 naming https://, got {other:?}"),
    }
    // And a TLS client to a plain-HTTP port is told the reverse.
    let plain = admin_fake::serve(&[admin_fake::admin_config("127.0.0.1:0", FULL)]);
    let addr = plain.addr;
    let c = Client::with_cacert(format!("https://{addr}"), None, Some(&cert)).unwrap();
    let e = c.call("GET", "/v1/tenants", None).unwrap_err();
    let CliError::Local(m) = e else {
        panic!("{e:?}")
    };
    assert!(m.contains("TLS with the admin API"), "{m}");
    drop(plain);
}

/// A TLS request that must be answered within `within`.
fn operator_get(srv: &Served, cert: &Path) -> Result<Value, CliError> {
    Client::with_cacert(
        format!("https://{}", srv.addr),
        Some(FULL.into()),
        Some(cert),
    )?
    .get("/v1/tenants")
}

/// A connection that started a TLS handshake (the first bytes of a
/// ClientHello record) and stalls.
fn stalled_handshake(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(&[0x16, 0x03, 0x01, 0x02]).unwrap();
    s
}

/// True once the server has closed `s` (EOF or reset), within `t`.
fn closed_within(s: &mut TcpStream, t: Duration) -> bool {
    s.set_read_timeout(Some(t)).unwrap();
    let mut b = [0u8; 256];
    let deadline = Instant::now() + t;
    while Instant::now() < deadline {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => {
                return !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                );
            }
        }
    }
    false
}

/// The slowloris test with TLS: 300 connections (more than the cap of 128)
/// hold stalled handshakes or send nothing, and the operator still gets
/// in, again and again; a source's oldest stalled handshake is evicted by
/// its 17th connection; a stalled handshake is cut at the head deadline.
#[test]
fn stalled_tls_handshakes_do_not_shut_out_the_operator() {
    let tmp = tempfile::tempdir().unwrap();
    let (cert, key) = make_cert(tmp.path(), "admin");
    let srv = serve_tls(&cert, &key);
    let started = Instant::now();
    let mut first = stalled_handshake(srv.addr);
    let mut held = Vec::new();
    for i in 0..300 {
        if i % 2 == 0 {
            held.push(stalled_handshake(srv.addr));
        } else {
            held.push(TcpStream::connect(srv.addr).unwrap());
        }
    }
    for i in 0..5 {
        let t = Instant::now();
        let v = operator_get(&srv, &cert)
            .unwrap_or_else(|e| panic!("operator request {i} not answered: {e}"));
        assert!(v.is_array(), "{v}");
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "took {:?}",
            t.elapsed()
        );
        held.push(stalled_handshake(srv.addr));
    }
    // The first stalled handshake was evicted long ago (per-source cap).
    assert!(
        closed_within(&mut first, Duration::from_secs(2)),
        "the oldest stalled handshake still holds its place"
    );
    drop(held);

    // Alone, a stalled handshake is cut at the 10 s head deadline.
    let mut s = stalled_handshake(srv.addr);
    let t = Instant::now();
    assert!(
        closed_within(&mut s, Duration::from_secs(15)),
        "a stalled handshake was never cut"
    );
    let took = t.elapsed();
    assert!(
        took >= Duration::from_secs(9) && took < Duration::from_secs(15),
        "cut after {took:?}, want about 10 s (test started {:?} ago)",
        started.elapsed()
    );
}

/// A panic in a Control call (here in `health()`) over a real TLS
/// connection: a JSON 500, and the API keeps serving.
#[test]
fn a_panicking_handler_answers_500_json_over_the_wire() {
    let tmp = tempfile::tempdir().unwrap();
    let (cert, key) = make_cert(tmp.path(), "admin");
    let srv = serve_tls(&cert, &key);
    srv.fake.st.lock().unwrap().panic_in_health = true;
    let c = Client::with_cacert(
        format!("https://{}", srv.addr),
        Some(FULL.into()),
        Some(&cert),
    )
    .unwrap();
    match c.call("GET", "/v1/health", None) {
        Err(CliError::Api {
            status, message, ..
        }) => {
            assert_eq!(status, 500);
            assert!(
                message.contains("internal error in the daemon"),
                "{message}"
            );
        }
        other => panic!("expected a 500, got {other:?}"),
    }
    let v: Value = c.get("/v1/tenants").expect("still serving");
    assert!(v.is_array());
}

fn write_config(dir: &Path, admin: &str) -> String {
    let p = dir.join("weir.toml");
    std::fs::write(
        &p,
        format!("[daemon]\nworkers = 1\n[admin]\ntoken = \"t\"\n{admin}\n"),
    )
    .unwrap();
    p.display().to_string()
}

#[test]
fn check_validates_the_certificate_files() {
    let tmp = tempfile::tempdir().unwrap();
    let (cert, key) = make_cert(tmp.path(), "admin");
    let (_, other_key) = make_cert(tmp.path(), "other");
    let junk = tmp.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate\n").unwrap();
    let cut = tmp.path().join("cut.pem");
    std::fs::write(&cut, "-----BEGIN CERTIFICATE-----\nMIIB\n").unwrap();
    let missing = tmp.path().join("missing.pem");
    let pair = |c: &Path, k: &Path| {
        format!(
            "listen = \"127.0.0.1:9\"\ntls_cert = \"{}\"\ntls_key = \"{}\"",
            c.display(),
            k.display()
        )
    };
    let cfg = write_config(tmp.path(), &pair(&cert, &key));
    let (code, out, err) = run_weir(&["check", "--config", &cfg], &[]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("OK"), "{out}");
    for (admin, want) in [
        (pair(&missing, &key), "cannot read [admin] tls_cert"),
        (pair(&cert, &missing), "cannot read [admin] tls_key"),
        (pair(&junk, &key), "holds no PEM certificate"),
        (pair(&cut, &key), "is not closed"),
        (pair(&cert, &junk), "holds no usable PEM private key"),
        (pair(&cert, &other_key), "do not make a usable pair"),
        (
            format!(
                "listen = \"127.0.0.1:9\"\ntls_cert = \"{}\"",
                cert.display()
            ),
            "tls_key is not",
        ),
        (
            format!(
                "listen = \"unix:{}\"\ntls_cert = \"{}\"\ntls_key = \"{}\"",
                tmp.path().join("a.sock").display(),
                cert.display(),
                key.display()
            ),
            "unix socket",
        ),
    ] {
        let cfg = write_config(tmp.path(), &admin);
        let (code, _, err) = run_weir(&["check", "--config", &cfg], &[]);
        assert_eq!(code, Some(1), "{admin}: {err}");
        assert!(err.contains(want), "{admin}: want {want:?} in {err}");
    }
}

#[test]
fn non_loopback_plain_http_is_refused_unless_allowed() {
    let tmp = tempfile::tempdir().unwrap();
    for listen in ["0.0.0.0:9", "[::]:9", "192.0.2.1:9"] {
        let cfg = write_config(tmp.path(), &format!("listen = \"{listen}\""));
        for cmd in ["check", "run"] {
            let (code, _, err) = run_weir(&[cmd, "--config", &cfg], &[]);
            assert_eq!(code, Some(1), "{cmd} {listen}: {err}");
            assert!(
                err.contains("insecure_plaintext = true") && err.contains("tls_cert"),
                "{cmd} {listen}: {err}"
            );
        }
        let cfg = write_config(
            tmp.path(),
            &format!("listen = \"{listen}\"\ninsecure_plaintext = true"),
        );
        let (code, _, err) = run_weir(&["check", "--config", &cfg], &[]);
        assert_eq!(code, Some(0), "{listen} allowed: {err}");
    }
    // Loopback stays allowed in plain HTTP, and so is TLS anywhere.
    let (cert, key) = make_cert(tmp.path(), "admin");
    for admin in [
        "listen = \"127.0.0.1:9\"".to_owned(),
        "listen = \"[::1]:9\"".to_owned(),
        format!(
            "listen = \"0.0.0.0:9\"\ntls_cert = \"{}\"\ntls_key = \"{}\"",
            cert.display(),
            key.display()
        ),
    ] {
        let cfg = write_config(tmp.path(), &admin);
        let (code, _, err) = run_weir(&["check", "--config", &cfg], &[]);
        assert_eq!(code, Some(0), "{admin}: {err}");
    }
}
