//! Changes through the admin API against the real daemon that must apply
//! whole or not at all (issue 10): a failed service edit keeps the service,
//! the default tenant cannot be deleted, reloads validate before applying
//! and report what they change, tenant tokens are fenced by address.

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Value, json};

use weir::cli::client::{CliError, Client};
use weir::config::Protocol;

mod cli_util;
mod daemon_util;
use daemon_util::admin::{Running, TOKEN};
use daemon_util::{Echo, backend, config, echo_once, held, service, still_echoes, wait_until};

/// Defect 2: an edit that moves a service to an address it cannot have is
/// refused (409 for another weir service's address, 503 for another
/// process's) and leaves the service, its address and its live
/// connections as they were.
#[test]
fn failed_service_move_keeps_the_service() {
    let echo = Echo::start();
    let r = Running::start(
        config(vec![
            service("web", Protocol::Tcp, "rr", vec![backend(echo.addr, 1)]),
            service("other", Protocol::Tcp, "rr", vec![backend(echo.addr, 1)]),
        ]),
        None,
    );
    let vip = r.d().service_addr("default", "web").unwrap();
    let other = r.d().service_addr("default", "other").unwrap();
    let mut live = held(vip);
    let path = "/v1/services/default/web";
    let spec = r.ok("GET", path, None);

    let foreign = TcpListener::bind("127.0.0.1:0").unwrap();
    let taken: [(SocketAddr, u16); 2] = [(other, 409), (foreign.local_addr().unwrap(), 503)];
    for (addr, want) in taken {
        let mut body = spec.clone();
        body["listen"] = json!(addr.to_string());
        let (status, message) = r.status("PUT", path, Some(body));
        assert_eq!(status, want, "moving to {addr}: {message}");
        assert_eq!(
            r.d().service_addr("default", "web"),
            Some(vip),
            "the service is still there, on its old address"
        );
        assert!(echo_once(vip, b"still here"), "old address accepts");
        assert!(still_echoes(&mut live), "live connection kept");
        assert_eq!(r.ok("GET", path, None), spec, "spec unchanged");
    }

    // A move to a free address still works (and only then replaces it).
    // (Port 0 on the same IP means "keep the port": use another loopback IP.)
    let mut body = spec.clone();
    body["listen"] = json!("127.0.0.2:0");
    r.ok("PUT", path, Some(body));
    let moved = r.d().service_addr("default", "web").unwrap();
    assert_ne!(moved, vip);
    assert!(echo_once(moved, b"moved"));
    drop(foreign);
}

/// Defect 6: the default tenant cannot be deleted (409, saying why); its
/// services stay.
#[test]
fn default_tenant_cannot_be_deleted() {
    let echo = Echo::start();
    let r = Running::start(
        config(vec![service(
            "web",
            Protocol::Tcp,
            "rr",
            vec![backend(echo.addr, 1)],
        )]),
        None,
    );
    let (status, message) = r.status("DELETE", "/v1/tenants/default", None);
    assert_eq!(status, 409, "{message}");
    assert!(message.contains("cannot be deleted"), "{message}");
    let vip = r.d().service_addr("default", "web").expect("service kept");
    assert!(echo_once(vip, b"hello"));
    let tenants = r.ok("GET", "/v1/tenants", None);
    assert!(
        tenants
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["name"] == "default"),
        "{tenants}"
    );
}

impl Running {
    /// Run `weir ARGS --admin URL --token TOKEN`; (exit code, stdout, stderr).
    fn weir(&self, args: &[&str]) -> (std::process::ExitCode, String, String) {
        cli_util::run(&self.url, TOKEN, args)
    }

    /// The admin API's address, which a tenant's backend must not reach.
    fn admin_addr(&self) -> SocketAddr {
        self.url
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .parse()
            .unwrap()
    }
}

/// The message of `res`, which must be the API's refusal with `status`
/// naming each of `want`; `case` names the request in a failure.
fn refused(case: &str, res: Result<Value, CliError>, status: u16, want: &[&str]) -> String {
    match res {
        Err(CliError::Api {
            status: got,
            message,
            ..
        }) => {
            assert_eq!(got, status, "{case}: {message}");
            for w in want {
                assert!(message.contains(w), "{case}: {w:?} not in {message}");
            }
            message
        }
        other => panic!("{case}: expected {status}, got {other:?}"),
    }
}

/// A loopback address nothing listens on (bound, then let go).
fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn tenant_toml(name: &str, extra: &str) -> String {
    format!("[[tenant]]\nname = \"{name}\"\n{extra}\n")
}

fn service_toml(tenant: &str, name: &str, backends: &[SocketAddr]) -> String {
    let mut s = format!(
        "[[service]]\ntenant = \"{tenant}\"\nname = \"{name}\"\nprotocol = \"tcp\"\nlisten = \"127.0.0.1:0\"\nscheduler = \"rr\"\n"
    );
    for b in backends {
        s.push_str(&format!("[[service.backend]]\naddress = \"{b}\"\n"));
    }
    s
}

/// Tenant acme (token `acme-tok`, then `extra`) beside the default
/// tenant's service g on `echo`: the file the tests of a tenant token
/// pointing at weir itself start from.
fn acme_beside_g(echo: &Echo, extra: &str) -> String {
    format!(
        "{}{}",
        tenant_toml("acme", &format!("token = \"acme-tok\"\n{extra}")),
        service_toml("default", "g", &[echo.addr]),
    )
}

/// A daemon started from `text` written to a file it reloads from.
fn from_file(text: &str) -> (Running, tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weir.toml");
    let text = format!("[daemon]\nworkers = 2\n{text}");
    std::fs::write(&path, &text).unwrap();
    let cfg = weir::config::load(&path).unwrap_or_else(|e| panic!("{e:?}\n{text}"));
    (Running::start(cfg, Some(path.clone())), dir, path)
}

fn write(path: &PathBuf, text: &str) {
    std::fs::write(path, format!("[daemon]\nworkers = 2\n{text}")).unwrap();
}

fn names(v: &Value, key: &str) -> Vec<String> {
    let mut n: Vec<String> = v[key]
        .as_array()
        .unwrap_or_else(|| panic!("no {key} in {v}"))
        .iter()
        .map(|x| x.as_str().unwrap().to_owned())
        .collect();
    n.sort();
    n
}

/// Defect 10: a reload that changes a tenant's `table_entries` (which
/// cannot change live) together with adding a service is refused as a
/// whole: the service is not added, nothing else changes.
#[test]
fn reload_applies_everything_or_nothing() {
    let echo = Echo::start();
    let base = tenant_toml("acme", "table_entries = 1024\nmax_connections = 5");
    let (r, _dir, path) = from_file(&format!(
        "{base}{}",
        service_toml("acme", "web", &[echo.addr])
    ));
    let vip = r.d().service_addr("acme", "web").unwrap();
    write(
        &path,
        &format!(
            "{}{}{}",
            tenant_toml("acme", "table_entries = 2048\nmax_connections = 9"),
            service_toml("acme", "web", &[echo.addr]),
            service_toml("acme", "added", &[echo.addr]),
        ),
    );
    match r.api("POST", "/v1/reload", None) {
        Err(CliError::Api {
            status,
            message,
            errors,
        }) => {
            assert_eq!(status, 400, "{message}");
            assert!(message.contains("nothing was applied"), "{message}");
            assert_eq!(errors.len(), 1, "{errors:?}");
            assert!(
                errors[0].contains("table_entries cannot change"),
                "{errors:?}"
            );
        }
        other => panic!("expected a refused reload, got {other:?}"),
    }
    assert_eq!(r.d().service_addr("acme", "added"), None, "service added");
    let tenants = r.ok("GET", "/v1/tenants", None);
    let acme = tenants
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "acme")
        .unwrap();
    assert_eq!(acme["max_connections"], 5, "limit changed: {acme}");
    assert_eq!(acme["table_entries"], 1024);
    assert!(echo_once(vip, b"unchanged"));
}

/// Defect 9: a reload reports what it adds, changes and removes; a dry run
/// reports the same and applies nothing.
#[test]
fn reload_reports_changes_and_dry_run_applies_nothing() {
    let echo = Echo::start();
    let other = Echo::start();
    let (r, _dir, path) = from_file(&format!(
        "{}{}{}",
        tenant_toml("acme", ""),
        service_toml("acme", "web", &[echo.addr]),
        service_toml("default", "old", &[echo.addr]),
    ));
    let web = r.d().service_addr("acme", "web").unwrap();
    let mut live = held(web);
    write(
        &path,
        &format!(
            "{}{}{}",
            tenant_toml("acme", "max_connections = 7"),
            service_toml("acme", "web", &[other.addr]),
            service_toml("default", "new", &[echo.addr]),
        ),
    );
    let expect_added = vec![
        format!("backend acme/web/{}", other.addr),
        "service default/new".to_owned(),
    ];
    let expect_changed = vec!["service acme/web".to_owned(), "tenant acme".to_owned()];
    let expect_removed = vec![
        format!("backend acme/web/{}", echo.addr),
        "service default/old".to_owned(),
    ];

    let dry = r.ok("POST", "/v1/reload?dry_run=true", None);
    assert_eq!(dry["reloaded"], false, "{dry}");
    assert_eq!(dry["dry_run"], true, "{dry}");
    assert_eq!(names(&dry, "added"), expect_added);
    assert_eq!(names(&dry, "changed"), expect_changed);
    assert_eq!(names(&dry, "removed"), expect_removed);
    assert!(
        r.d().service_addr("default", "new").is_none(),
        "dry run applied"
    );
    assert!(
        r.d().service_addr("default", "old").is_some(),
        "dry run applied"
    );
    assert!(still_echoes(&mut live));

    let (code, out, err) = r.weir(&["reload", "--dry-run"]);
    assert_eq!(code, std::process::ExitCode::SUCCESS, "{err}");
    assert!(
        out.starts_with(
            "dry run, nothing applied: a reload would make 2 added, 2 changed, 2 removed\n"
        ),
        "{out}"
    );
    assert!(out.contains("  + service default/new\n"), "{out}");
    assert!(out.contains("  - service default/old\n"), "{out}");
    assert!(
        r.d().service_addr("default", "new").is_none(),
        "dry run applied"
    );

    let (code, out, err) = r.weir(&["reload"]);
    assert_eq!(code, std::process::ExitCode::SUCCESS, "{err}");
    assert!(
        out.starts_with("reloaded: 2 added, 2 changed, 2 removed\n"),
        "{out}"
    );
    assert!(out.contains("  ~ tenant acme\n"), "{out}");
    assert!(r.d().service_addr("default", "new").is_some());
    assert!(r.d().service_addr("default", "old").is_none());
    // The file unchanged: nothing to do, and the edited service kept its
    // address (port 0 in the file is the port it got).
    let again = r.ok("POST", "/v1/reload", None);
    assert_eq!(again["reloaded"], true, "{again}");
    for key in ["added", "changed", "removed"] {
        assert!(names(&again, key).is_empty(), "{again}");
    }
    assert_eq!(r.d().service_addr("acme", "web"), Some(web));
}

/// Defect 9: an empty or whitespace-only file (a truncated write) is
/// refused instead of removing every service.
#[test]
fn reload_of_an_empty_file_is_refused() {
    let echo = Echo::start();
    let (r, _dir, path) = from_file(&service_toml("default", "web", &[echo.addr]));
    let vip = r.d().service_addr("default", "web").unwrap();
    for text in ["", " \n\t\n"] {
        std::fs::write(&path, text).unwrap();
        let (status, message) = r.status("POST", "/v1/reload", None);
        assert_eq!(status, 400, "{message}");
        match r.api("POST", "/v1/reload", None) {
            Err(CliError::Api { errors, .. }) => {
                assert!(errors[0].contains("is empty"), "{errors:?}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(r.d().service_addr("default", "web"), Some(vip));
        assert!(echo_once(vip, b"still"));
    }
}

/// A backend added through the API in its IPv4-mapped form
/// (`[::ffff:127.0.0.1]:PORT`) next to the same host and port written as
/// IPv4 is the same backend: 409, as the file's check lists it twice.
/// Before, it was added, a second backend (id, weight, place) for one.
#[test]
fn a_backend_added_in_its_v4_mapped_form_exists() {
    let echo = Echo::start();
    let (r, _dir, _path) = from_file(&format!(
        "{}{}",
        tenant_toml("acme", ""),
        service_toml("acme", "web", &[echo.addr])
    ));
    let mapped = format!("[::ffff:{}]:{}", echo.addr.ip(), echo.addr.port());
    refused(
        &format!("a second backend for {}", echo.addr),
        r.api(
            "POST",
            "/v1/services/acme/web/backends",
            Some(json!({ "address": mapped })),
        ),
        409,
        &["exists"],
    );
    let svc = r.ok("GET", "/v1/services/acme/web", None);
    assert_eq!(svc["backend"].as_array().map(Vec::len), Some(1), "{svc}");
}

/// A backend is one address however an IPv4-mapped one is written, for
/// its edit and its delete as for its add: added as `[::ffff:A.B.C.D]:P`,
/// it is edited as `A.B.C.D:P`, and the other way round. Before, the
/// other spelling was 409 "exists" for an add and 404 "does not exist"
/// for an edit or a delete (`weir backend del` of the address the
/// add had just refused as existing).
#[test]
fn a_backend_is_edited_and_deleted_under_either_spelling_of_its_address() {
    let echo = Echo::start();
    let other = Echo::start();
    let (r, _dir, _path) = from_file(&format!(
        "{}{}",
        tenant_toml("acme", ""),
        service_toml("acme", "web", &[echo.addr])
    ));
    let mapped = |a: SocketAddr| format!("[::ffff:{}]:{}", a.ip(), a.port());
    let at = |a: &str| {
        format!(
            "/v1/services/acme/web/backends/{}",
            weir::cli::client::seg(a)
        )
    };
    r.ok(
        "POST",
        "/v1/services/acme/web/backends",
        Some(json!({ "address": mapped(other.addr) })),
    );
    r.ok("PUT", &at(&mapped(echo.addr)), Some(json!({ "weight": 3 })));
    r.ok(
        "PUT",
        &at(&other.addr.to_string()),
        Some(json!({ "weight": 4 })),
    );
    let svc = r.ok("GET", "/v1/services/acme/web", None);
    let weights: Vec<(String, u64)> = svc["backend"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["address"].as_str().unwrap().to_owned(),
                b["weight"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        weights,
        [(echo.addr.to_string(), 3), (other.addr.to_string(), 4)],
        "{svc}"
    );
    r.ok("DELETE", &at(&other.addr.to_string()), None);
    r.ok("DELETE", &at(&mapped(echo.addr)), None);
    let svc = r.ok("GET", "/v1/services/acme/web", None);
    assert_eq!(svc["backend"].as_array().map(Vec::len), Some(0), "{svc}");
}

/// A backend is one address however a file or a service edit spells an
/// IPv4-mapped one: a reload or a whole-service `PUT` that writes
/// `A.B.C.D:P` for a backend written `[::ffff:A.B.C.D]:P` (or the other
/// way round) changes nothing: the backend keeps its counters and its
/// connections, and the reload reports no backend added or removed.
/// Before, both matched backends by exact address: the backend was
/// removed and a new one added, its counters started again from zero.
#[test]
fn a_backend_respelled_by_a_reload_or_an_edit_is_kept() {
    let echo = Echo::start();
    let mapped = format!("[::ffff:{}]:{}", echo.addr.ip(), echo.addr.port());
    let file = |addr: &str| {
        format!(
            "{}{}[[service.backend]]\naddress = \"{addr}\"\n",
            tenant_toml("acme", ""),
            service_toml("acme", "web", &[])
        )
    };
    let (r, _dir, path) = from_file(&file(&mapped));
    let vip = r.d().service_addr("acme", "web").unwrap();
    let mut live = held(vip);
    let backend = || {
        let s = r.d().control().services();
        let svc = s.iter().find(|s| s.name == "web").unwrap();
        assert_eq!(svc.backends.len(), 1, "{svc:?}");
        let b = &svc.backends[0];
        (b.address.clone(), b.stats.conns, b.active_conns)
    };
    // One connection so far, live, under the IPv4 spelling whichever way
    // the file wrote it.
    assert_eq!(backend(), (echo.addr.to_string(), 1, 1));
    for spelling in [echo.addr.to_string(), mapped.clone()] {
        write(&path, &file(&spelling));
        let report = r.ok("POST", "/v1/reload", None);
        assert_eq!(report["reloaded"], true, "{report}");
        for key in ["added", "changed", "removed"] {
            assert!(names(&report, key).is_empty(), "{spelling}: {report}");
        }
        assert_eq!(backend(), (echo.addr.to_string(), 1, 1), "{spelling}");
        assert!(still_echoes(&mut live), "{spelling}");
    }
    let mut spec = r.ok("GET", "/v1/services/acme/web", None);
    spec["backend"][0]["address"] = json!(mapped);
    spec["backend"][0]["weight"] = json!(5);
    r.ok("PUT", "/v1/services/acme/web", Some(spec));
    assert_eq!(backend(), (echo.addr.to_string(), 1, 1));
    let spec = r.ok("GET", "/v1/services/acme/web", None);
    assert_eq!(spec["backend"][0]["weight"], 5, "{spec}");
    assert!(still_echoes(&mut live));
}

/// Defect 9: a reload does not silently remove what was added through the
/// API: it is refused listing them, unless forced.
#[test]
fn reload_keeps_runtime_additions_unless_forced() {
    let echo = Echo::start();
    let extra = Echo::start();
    let file = format!(
        "{}{}",
        tenant_toml("acme", ""),
        service_toml("acme", "web", &[echo.addr])
    );
    let (r, _dir, path) = from_file(&file);
    r.ok(
        "POST",
        "/v1/services",
        Some(json!({
            "tenant": "acme", "name": "rt", "protocol": "tcp", "listen": "127.0.0.1:0",
            "backend": [{ "address": echo.addr.to_string() }]
        })),
    );
    r.ok(
        "POST",
        "/v1/services/acme/web/backends",
        Some(json!({ "address": extra.addr.to_string() })),
    );
    r.ok("POST", "/v1/tenants", Some(json!({ "name": "beta" })));
    r.ok("DELETE", "/v1/tenants/beta", None);
    let rt = r.d().service_addr("acme", "rt").unwrap();
    let mut live = held(rt);

    match r.api("POST", "/v1/reload", None) {
        Err(CliError::Api { status, errors, .. }) => {
            assert_eq!(status, 400);
            assert!(errors[0].contains("--force"), "{errors:?}");
            let mut listed = errors[1..].to_vec();
            listed.sort();
            assert_eq!(
                listed,
                vec![
                    format!("would remove backend acme/web/{}", extra.addr),
                    "would remove service acme/rt".to_owned(),
                ]
            );
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(still_echoes(&mut live), "runtime service kept");
    // A dry run says the same.
    assert_eq!(
        r.status("POST", "/v1/reload?dry_run=true", None).0,
        400,
        "dry run of a refused reload"
    );
    let (code, _, err) = r.weir(&["reload"]);
    assert_eq!(code, std::process::ExitCode::from(1), "{err}");
    assert!(err.contains("would remove service acme/rt"), "{err}");

    let forced = r.ok("POST", "/v1/reload?force=true", None);
    assert_eq!(
        names(&forced, "removed"),
        vec![
            format!("backend acme/web/{}", extra.addr),
            "service acme/rt".to_owned()
        ]
    );
    assert!(r.d().service_addr("acme", "rt").is_none());
    // Runtime state is forgotten once reloaded: the next one needs no force.
    write(&path, &file);
    r.ok("POST", "/v1/reload", None);
}

/// A reload without force does not remove a backend added through the
/// API along with a service the file no longer has (or whose tenant it no
/// longer has): it is refused naming the backend, as for a service the
/// file keeps. The reload checked only what its plan lists as removed,
/// which names a removed service but not its backends, so the backend went
/// without a word (found by `daemon::control_model`).
#[test]
fn reload_keeps_a_runtime_backend_of_a_service_the_file_drops() {
    let (echo, extra) = (Echo::start(), Echo::start());
    let acme = tenant_toml("acme", "");
    let file = format!("{acme}{}", service_toml("acme", "web", &[echo.addr]));
    let other = service_toml("default", "g", &[echo.addr]);
    // Without the service; without its tenant either.
    for dropped in [acme.clone(), other] {
        let (r, _dir, path) = from_file(&file);
        r.ok(
            "POST",
            "/v1/services/acme/web/backends",
            Some(json!({ "address": extra.addr.to_string() })),
        );
        write(&path, &dropped);
        match r.api("POST", "/v1/reload", None) {
            Err(CliError::Api { status, errors, .. }) => {
                assert_eq!(status, 400, "{errors:?}");
                assert_eq!(
                    errors[1..],
                    [format!("would remove backend acme/web/{}", extra.addr)],
                    "{dropped}"
                );
            }
            other => panic!("{dropped}: expected a refusal, got {other:?}"),
        }
        let svc = r.ok("GET", "/v1/services/acme/web", None);
        assert_eq!(svc["backend"].as_array().map(Vec::len), Some(2), "{svc}");
        // Forced, it goes with its service.
        r.ok("POST", "/v1/reload?force=true", None);
        assert!(r.d().service_addr("acme", "web").is_none(), "{dropped}");
    }
}

/// Defect 25: `--service TENANT/NAME` works for `weir conns` and `weir
/// kill`; a bare name used by several tenants is refused, listing them.
#[test]
fn service_filters_take_tenant_slash_name() {
    let echo = Echo::start();
    let (r, _dir, _path) = from_file(&format!(
        "{}{}{}{}{}",
        tenant_toml("acme", ""),
        tenant_toml("beta", ""),
        service_toml("acme", "dup", &[echo.addr]),
        service_toml("beta", "dup", &[echo.addr]),
        service_toml("acme", "persist", &[echo.addr]),
    ));
    let addr = |t: &str, n: &str| r.d().service_addr(t, n).unwrap();
    let mut acme_dup = held(addr("acme", "dup"));
    let mut beta_dup = held(addr("beta", "dup"));
    let _persist = held(addr("acme", "persist"));
    let count = |args: &[&str]| -> usize {
        let (code, out, err) = r.weir(args);
        assert_eq!(code, std::process::ExitCode::SUCCESS, "{args:?}: {err}");
        out.lines().filter(|l| l.starts_with('{')).count()
    };
    assert_eq!(count(&["conns", "--json", "--service", "acme/persist"]), 1);
    assert_eq!(count(&["conns", "--json", "--service", "persist"]), 1);
    assert_eq!(count(&["conns", "--json", "--service", "beta/dup"]), 1);
    assert_eq!(count(&["conns", "--json", "--service", "beta/persist"]), 0);

    for args in [
        &["kill", "--service", "dup"][..],
        &["conns", "--service", "dup"][..],
    ] {
        let (code, _, err) = r.weir(args);
        assert_eq!(code, std::process::ExitCode::from(1), "{args:?}");
        assert!(err.contains("in 2 tenants (acme, beta)"), "{err}");
    }
    assert!(still_echoes(&mut acme_dup) && still_echoes(&mut beta_dup));

    let (code, out, err) = r.weir(&["kill", "--service", "acme/dup"]);
    assert_eq!(code, std::process::ExitCode::SUCCESS, "{err}");
    assert_eq!(out, "killed 1 connections\n");
    assert!(still_echoes(&mut beta_dup), "beta/dup untouched");
    assert!(
        daemon_util::wait_until(Duration::from_secs(5), || !still_echoes(&mut acme_dup)),
        "acme/dup killed"
    );
    // Disagreeing tenant and TENANT/NAME.
    let (code, _, err) = r.weir(&["kill", "--tenant", "beta", "--service", "acme/dup"]);
    assert_eq!(code, std::process::ExitCode::from(1), "{err}");
}

/// Defect 16: a tenant token's services listen, and its backends point,
/// only inside the tenant's `allowed_listen` / `allowed_backends`; a
/// wildcard listen needs an entry naming it, even with no fence at all.
/// The full-access token is not fenced.
#[test]
fn tenant_tokens_are_fenced_by_address() {
    let echo = Echo::start();
    let other = Echo::start();
    let (r, _dir, _path) = from_file(&format!(
        "{}{}{}",
        tenant_toml(
            "acme",
            &format!(
                "token = \"acme-tok\"\nallowed_listen = [\"127.0.0.0/8\"]\nallowed_backends = [\"{}\"]",
                echo.addr
            )
        ),
        tenant_toml("beta", "token = \"beta-tok\""),
        tenant_toml(
            "gamma",
            "token = \"gamma-tok\"\nallowed_listen = [\"0.0.0.0\"]"
        ),
    ));
    let as_tenant = |token: &str, method: &str, path: &str, body: Value| {
        Client::new(r.url.clone(), Some(token.into())).send(method, path, Some(&body))
    };
    let svc = |tenant: &str, name: &str, listen: &str, backend: SocketAddr| {
        json!({ "tenant": tenant, "name": name, "protocol": "tcp", "listen": listen,
                "backend": [{ "address": backend.to_string() }] })
    };
    // A service added by its own tenant's token.
    let add = |tenant: &str, name: &str, listen: &str, backend: SocketAddr| {
        let body = svc(tenant, name, listen, backend);
        as_tenant(&format!("{tenant}-tok"), "POST", "/v1/services", body)
    };
    let forbidden = |res, what: &str, want: &[&str]| {
        refused(what, res, 403, want);
    };

    // acme: inside both fences.
    add("acme", "web", "127.0.0.2:0", echo.addr).expect("inside the fences");
    let web = r.d().service_addr("acme", "web").unwrap();
    assert!(echo_once(web, b"fenced"));
    forbidden(
        add("acme", "wild", "0.0.0.0:0", echo.addr),
        "wildcard",
        &["allowed_listen"],
    );
    forbidden(
        add("acme", "far", "10.0.0.1:80", echo.addr),
        "outside allowed_listen",
        &[],
    );
    forbidden(
        add("acme", "scan", "127.0.0.3:0", other.addr),
        "backend outside",
        &["allowed_backends"],
    );
    forbidden(
        as_tenant(
            "acme-tok",
            "POST",
            "/v1/services/acme/web/backends",
            json!({ "address": other.addr.to_string() }),
        ),
        "added backend outside",
        &[],
    );
    let mut moved = r.ok("GET", "/v1/services/acme/web", None);
    moved["listen"] = json!("0.0.0.0:0");
    forbidden(
        as_tenant("acme-tok", "PUT", "/v1/services/acme/web", moved),
        "edit to a wildcard",
        &[],
    );
    assert_eq!(r.d().service_addr("acme", "web"), Some(web));
    assert!(r.d().service_addr("acme", "wild").is_none());
    assert!(r.d().service_addr("acme", "scan").is_none());

    // beta: no fence: any specific address, but no wildcard.
    add("beta", "web", "127.0.0.4:0", other.addr).expect("no fence");
    forbidden(
        add("beta", "wild", "0.0.0.0:0", other.addr),
        "wildcard without an entry",
        &[],
    );
    // gamma: an entry naming the wildcard allows it.
    add("gamma", "wild", "0.0.0.0:0", other.addr).expect("wildcard named");
    forbidden(
        add("gamma", "one", "127.0.0.5:0", other.addr),
        "a wildcard entry is not every address",
        &[],
    );
    // The full-access token is not fenced.
    r.ok(
        "POST",
        "/v1/services",
        Some(svc("acme", "ops", "127.0.0.6:0", other.addr)),
    );
    // Bad entries are refused with the key named, in files and the API.
    let bad = r.status(
        "PUT",
        "/v1/tenants/acme",
        Some(json!({ "allowed_listen": ["10.0.0.0/33"] })),
    );
    assert_eq!(bad.0, 400, "{}", bad.1);
    assert!(bad.1.contains("allowed_listen[0]"), "{}", bad.1);
    let errs = weir::config::parse(
        "[[tenant]]\nname = \"x\"\nallowed_backends = [\"10.0.0.1:99999\"]\n",
        "f.toml",
    )
    .unwrap_err();
    assert!(
        errs.iter()
            .any(|e| e.to_string().contains("allowed_backends")),
        "{errs:?}"
    );
}

/// A listen on port 0 gets whatever port the kernel picks, so a tenant
/// token may use it only where its `allowed_listen` allows every port. An
/// entry whose range starts at 0 ("127.0.0.0/8:0-1023") let the add through
/// and the service was bound to an ephemeral port far outside the range.
#[test]
fn a_port_0_listen_does_not_leave_an_entry_naming_ports() {
    let echo = Echo::start();
    let (r, _dir, _path) = from_file(&tenant_toml(
        "delta",
        &format!(
            "token = \"delta-tok\"\nallowed_listen = [\"127.0.0.0/8:0-1023\", \"127.0.0.9\"]\n\
             allowed_backends = [\"{}\"]",
            echo.addr
        ),
    ));
    let add = |name: &str, listen: &str| {
        let body = json!({ "tenant": "delta", "name": name, "protocol": "tcp", "listen": listen,
                           "backend": [{ "address": echo.addr.to_string() }] });
        Client::new(r.url.clone(), Some("delta-tok".into())).send(
            "POST",
            "/v1/services",
            Some(&body),
        )
    };
    refused(
        "port 0 under an entry of ports 0-1023",
        add("low", "127.0.0.7:0"),
        403,
        &["allowed_listen"],
    );
    assert_eq!(r.d().service_addr("delta", "low"), None, "nothing bound");
    // An entry naming no port allows port 0 at its address.
    add("any", "127.0.0.9:0").expect("an entry of every port");
    let any = r.d().service_addr("delta", "any").unwrap();
    assert!(echo_once(any, b"port 0"));
}

/// Defect 11: a reload of a large file (read, parse and validate take
/// seconds) does not stall other admin requests: they are answered while
/// it runs, each in a small part of the reload's time.
#[test]
fn a_slow_reload_does_not_stall_other_requests() {
    let echo = Echo::start();
    let (r, _dir, path) = from_file(&service_toml("default", "web", &[echo.addr]));
    // A file whose parse alone takes at least 0.5 s here (doubled until it
    // does; bounded), every service with an error so nothing is applied.
    let mut n = 2_000;
    let text = loop {
        let mut t = String::new();
        for i in 0..n {
            t.push_str(&format!(
                "[[service]]\nname = \"s{i}\"\nprotocol = \"tcp\"\nlisten = \"nowhere\"\n"
            ));
        }
        let t0 = std::time::Instant::now();
        let _ = weir::config::parse(&t, "big.toml");
        if t0.elapsed() >= Duration::from_millis(500) || n >= 256_000 {
            break t;
        }
        n *= 2;
    };
    write(&path, &text);
    let reloading = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let (url, flag) = (r.url.clone(), reloading.clone());
    let reload = std::thread::spawn(move || {
        let c = Client::new(url, Some(TOKEN.into()));
        let t0 = std::time::Instant::now();
        let res = c.send("POST", "/v1/reload", None);
        flag.store(false, std::sync::atomic::Ordering::SeqCst);
        (res, t0.elapsed())
    });
    let mut during = Vec::new();
    while reloading.load(std::sync::atomic::Ordering::SeqCst) && during.len() < 1_000 {
        let t0 = std::time::Instant::now();
        r.ok("GET", "/v1/services", None);
        if reloading.load(std::sync::atomic::Ordering::SeqCst) {
            during.push(t0.elapsed());
        }
    }
    let (res, took) = reload.join().unwrap();
    assert!(
        matches!(res, Err(CliError::Api { status: 400, .. })),
        "{res:?}"
    );
    assert!(
        during.len() >= 3,
        "only {} requests answered during a {took:?} reload",
        during.len()
    );
    let slowest = during.iter().max().unwrap();
    assert!(
        *slowest < took / 4,
        "a GET took {slowest:?} during a {took:?} reload"
    );
    assert!(r.d().service_addr("default", "web").is_some());
}

/// A health check's `port` makes another port of each backend's host a
/// target: fenced as the backends are, or a tenant could port-scan past
/// its `allowed_backends` through `/v1/health` (state, last_error).
#[test]
fn health_port_cannot_leave_the_backend_fence() {
    let echo = Echo::start();
    // A port on the same host that the fence does not allow.
    let secret = TcpListener::bind("127.0.0.1:0").unwrap();
    let secret_port = secret.local_addr().unwrap().port();
    let (r, _dir, _path) = from_file(&tenant_toml(
        "acme",
        &format!(
            "token = \"acme-tok\"\nallowed_listen = [\"127.0.0.0/8\"]\nallowed_backends = [\"{}\"]\n\
             min_health_interval = \"100ms\"",
            echo.addr
        ),
    ));
    let acme = Client::new(r.url.clone(), Some("acme-tok".into()));
    // A port nothing listens on.
    let closed_port = free_addr().port();
    let body = |name: &str, listen: &str, port: u16| {
        json!({
            "tenant": "acme", "name": name, "protocol": "tcp", "listen": listen,
            "backend": [{ "address": echo.addr.to_string() }],
            "health": { "interval": "100ms", "timeout": "100ms", "rise": 1, "fall": 1,
                        "port": port },
        })
    };
    let res = acme.send(
        "POST",
        "/v1/services",
        Some(&body("open", "127.0.0.2:0", secret_port)),
    );
    if res.is_ok() {
        // Show what the tenant learns: the checker connects to ports
        // outside allowed_backends and tells open from closed.
        acme.send(
            "POST",
            "/v1/services",
            Some(&body("closed", "127.0.0.3:0", closed_port)),
        )
        .expect("second probe");
        let mut seen = Value::Null;
        wait_until(Duration::from_secs(5), || {
            seen = acme.send("GET", "/v1/health", None).unwrap();
            let by = |n: &str| {
                seen.as_array()
                    .unwrap()
                    .iter()
                    .find(|e| e["service"] == n)
                    .map(|e| e["state"].clone())
            };
            by("open") == Some(json!("up")) && by("closed") == Some(json!("down"))
        });
        panic!(
            "a tenant token whose allowed_backends is only {} made the health checker probe \
             {}:{secret_port} (open) and {}:{closed_port} (closed): /v1/health says {seen}",
            echo.addr,
            echo.addr.ip(),
            echo.addr.ip()
        );
    }
    refused(
        "a health check port outside the fence",
        res,
        403,
        &["allowed_backends"],
    );
}

/// An IPv4-mapped IPv6 backend (`[::ffff:A.B.C.D]:P`) is the IPv4 backend
/// the kernel connects to: an IPv6 fence entry (`::/0`) must not let it
/// past the IPv4 entries.
#[test]
fn v4_mapped_backend_cannot_leave_the_ipv4_fence() {
    // On 127.0.0.1, which the fence does not allow.
    let echo = Echo::start();
    let (r, _dir, _path) = from_file(
        "[[tenant]]\nname = \"acme\"\ntoken = \"acme-tok\"\n\
         allowed_listen = [\"127.0.0.0/8\"]\n\
         allowed_backends = [\"192.0.2.0/24\", \"::/0\"]\n",
    );
    let acme = Client::new(r.url.clone(), Some("acme-tok".into()));
    // Written plainly, the backend is outside the fence (as it should be).
    let plain = json!({
        "tenant": "acme", "name": "plain", "protocol": "tcp", "listen": "127.0.0.2:0",
        "backend": [{ "address": echo.addr.to_string() }],
    });
    assert!(matches!(
        acme.send("POST", "/v1/services", Some(&plain)),
        Err(CliError::Api { status: 403, .. })
    ));
    // The same backend, v4-mapped.
    let mapped = format!("[::ffff:{}]:{}", echo.addr.ip(), echo.addr.port());
    let body = json!({
        "tenant": "acme", "name": "mapped", "protocol": "tcp", "listen": "127.0.0.3:0",
        "backend": [{ "address": mapped }],
    });
    let res = acme.send("POST", "/v1/services", Some(&body));
    if res.is_ok() {
        let vip: SocketAddr = r.d().service_addr("acme", "mapped").unwrap();
        let reached = echo_once(vip, b"outside the fence");
        panic!(
            "backend {mapped} (= {}) accepted although allowed_backends has no IPv4 entry for it; \
             traffic reaches it: {reached}",
            echo.addr
        );
    }
    refused(&format!("backend {mapped}"), res, 403, &[]);
}

/// One token, one role, through a reload too: the API refuses (409) a
/// tenant token that is the full-access token and `weir run` refuses one
/// at start, but a reload (or SIGHUP) from a file applied it, and whoever
/// held the tenant's token then had full access. The reload is refused,
/// nothing applied, the tenant's token still a tenant's.
#[test]
fn a_reload_cannot_give_a_tenant_the_full_access_token() {
    let (r, _dir, path) = from_file(&tenant_toml("acme", "token = \"acme-tok\""));
    let (status, _) = r.status("PUT", "/v1/tenants/acme", Some(json!({ "token": TOKEN })));
    assert_eq!(status, 409);
    std::fs::write(
        &path,
        format!(
            "[daemon]\nworkers = 2\n{}",
            tenant_toml("acme", &format!("token = \"{TOKEN}\""))
        ),
    )
    .unwrap();
    match r.api("POST", "/v1/reload", None) {
        Err(CliError::Api {
            status: 400,
            errors,
            ..
        }) => assert!(
            errors.len() == 1
                && errors[0]
                    .contains("tenant acme: its token is the same as the full-access token"),
            "{errors:?}"
        ),
        other => panic!("the reload was not refused: {other:?}"),
    }
    let whoami = |token: &str| {
        Client::new(r.url.clone(), Some(token.into()))
            .send("GET", "/v1/whoami", None)
            .unwrap()
    };
    assert_eq!(whoami(TOKEN)["role"], "full");
    assert_eq!(whoami("acme-tok")["tenant"], "acme");
}

/// `min_health_interval`: health checks run on the admin/health runtime
/// every tenant shares, at services x backends / interval checks a second,
/// so a tenant token setting `interval = "1ms"` would take it from the
/// others. A tenant token may not give its tenant's services a check whose
/// effective interval (the default "2s" when the request names none) is
/// below the floor (default 1s), adding or editing; the operator may; a
/// raised floor leaves what is there, and keeping it is not shortening it.
#[test]
fn a_tenant_token_keeps_health_checks_above_its_floor() {
    let echo = Echo::start();
    let (r, _dir, _path) = from_file(&format!(
        "{}{}",
        tenant_toml(
            "acme",
            "token = \"acme-tok\"\nmin_health_interval = \"500ms\""
        ),
        tenant_toml("globex", "token = \"globex-tok\""),
    ));
    let acme = Client::new(r.url.clone(), Some("acme-tok".into()));
    let globex = Client::new(r.url.clone(), Some("globex-tok".into()));
    let body = |tenant: &str, name: &str, health: Option<Value>| {
        let mut b = json!({
            "tenant": tenant, "name": name, "protocol": "tcp", "listen": "127.0.0.1:0",
            "backend": [{ "address": echo.addr.to_string() }],
        });
        if let Some(h) = health {
            b["health"] = h;
        }
        b
    };
    let every = |iv: &str| Some(json!({ "interval": iv, "timeout": "50ms" }));
    let below_floor = |res, want: &[&str]| {
        refused("a check below the floor", res, 403, want);
    };
    let listed = |c: &Client| -> Vec<String> {
        let mut v: Vec<String> = c
            .send("GET", "/v1/services", None)
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                format!(
                    "{}/{}",
                    s["tenant"].as_str().unwrap(),
                    s["name"].as_str().unwrap()
                )
            })
            .collect();
        v.sort();
        v
    };
    let interval = |tenant: &str, name: &str| {
        r.ok("GET", &format!("/v1/services/{tenant}/{name}"), None)["health"]["interval"].clone()
    };

    // Below the floor: refused, naming the key, the interval and the
    // floor; nothing added.
    below_floor(
        acme.send(
            "POST",
            "/v1/services",
            Some(&body("acme", "fast", every("100ms"))),
        ),
        &[
            "min_health_interval",
            "100ms",
            "500ms",
            "tenant \"acme\"",
            "ask the operator",
        ],
    );
    assert!(listed(&acme).is_empty(), "{:?}", listed(&acme));
    assert_eq!(r.d().service_addr("acme", "fast"), None);
    // A tenant without the key has the default floor, 1s.
    below_floor(
        globex.send(
            "POST",
            "/v1/services",
            Some(&body("globex", "fast", every("999ms"))),
        ),
        &["min_health_interval", "999ms", "1s, the default"],
    );
    assert!(listed(&globex).is_empty());
    globex
        .send(
            "POST",
            "/v1/services",
            Some(&body("globex", "web", every("1s"))),
        )
        .unwrap();
    // At the floor: accepted.
    acme.send(
        "POST",
        "/v1/services",
        Some(&body("acme", "web", every("500ms"))),
    )
    .unwrap();
    assert_eq!(listed(&acme), ["acme/web"]);

    // Edited in place below the floor: refused, the service unchanged.
    let path = "/v1/services/acme/web";
    let before = r.ok("GET", path, None);
    below_floor(
        acme.send("PUT", path, Some(&body("acme", "web", every("200ms")))),
        &["min_health_interval", "200ms", "500ms"],
    );
    assert_eq!(r.ok("GET", path, None), before);
    acme.send("PUT", path, Some(&body("acme", "web", every("1s"))))
        .unwrap();
    assert_eq!(interval("acme", "web"), "1s");

    // The operator raises the floor: what is there stays.
    r.client
        .send(
            "PUT",
            "/v1/tenants/acme",
            Some(&json!({ "min_health_interval": "5s" })),
        )
        .unwrap();
    assert_eq!(
        acme.send("GET", "/v1/tenants", None).unwrap()[0]["min_health_interval"],
        "5s"
    );
    assert_eq!(interval("acme", "web"), "1s");
    // The effective interval counts: a check naming no interval gets the
    // default, 2s, below the new floor.
    below_floor(
        acme.send(
            "POST",
            "/v1/services",
            Some(&body("acme", "dflt", Some(json!({})))),
        ),
        &["min_health_interval", "2s (the default", "5s"],
    );
    assert_eq!(listed(&acme), ["acme/web"]);
    // No health check at all runs no checks.
    acme.send("POST", "/v1/services", Some(&body("acme", "plain", None)))
        .unwrap();
    acme.send(
        "POST",
        "/v1/services",
        Some(&body("acme", "slow", Some(json!({ "interval": "5s" })))),
    )
    .unwrap();
    // Editing web keeps its 1s (below the raised floor, but not shorter
    // than it was): passes; shortening it is refused.
    let mut wrr = body("acme", "web", every("1s"));
    wrr["scheduler"] = json!("wrr");
    acme.send("PUT", path, Some(&wrr)).unwrap();
    below_floor(
        acme.send("PUT", path, Some(&body("acme", "web", every("900ms")))),
        &["min_health_interval", "900ms", "5s"],
    );
    assert_eq!(interval("acme", "web"), "1s");

    // The operator's token is not held to the floor, adding or editing.
    r.client
        .send(
            "POST",
            "/v1/services",
            Some(&body("acme", "op", every("100ms"))),
        )
        .unwrap();
    r.client
        .send("PUT", path, Some(&body("acme", "web", every("100ms"))))
        .unwrap();
    assert_eq!(interval("acme", "op"), "100ms");
    assert_eq!(interval("acme", "web"), "100ms");
    assert_eq!(
        listed(&acme),
        ["acme/op", "acme/plain", "acme/slow", "acme/web"]
    );
}

/// Each backend is health-checked and has its rate estimator, on threads
/// every tenant shares: a tenant token could add backends without bound.
/// A tenant holds at most its `max_backends` over all its services,
/// whoever adds them (its token, the operator, a reload), by a new
/// service, an edit or a backend added; a change that does not add
/// backends to a service passes, so a lowered cap keeps what is there.
#[test]
fn a_tenant_holds_at_most_its_max_backends() {
    let echo = Echo::start();
    let (r, _dir, path) = from_file(&tenant_toml(
        "acme",
        "token = \"acme-tok\"\nmax_backends = 3",
    ));
    let acme = Client::new(r.url.clone(), Some("acme-tok".into()));
    // Backends at distinct addresses: 127.0.0.N:port (nothing listens but
    // echo; no health check is configured, so none is connected to).
    let addr = |n: u16| format!("127.0.0.{}:{}", 2 + n, echo.addr.port());
    let body = |name: &str, backends: &[u16]| {
        let b: Vec<_> = backends
            .iter()
            .map(|&n| json!({ "address": addr(n) }))
            .collect();
        json!({
            "tenant": "acme", "name": name, "protocol": "tcp", "listen": "127.0.0.1:0",
            "backend": b,
        })
    };
    let over_max = |what: &str, r, total: u64| {
        let over =
            format!("tenant \"acme\" would hold {total} backends, over its max_backends (3)");
        refused(what, r, 409, &[&over]);
    };
    acme.send("POST", "/v1/services", Some(&body("s1", &[0, 1])))
        .unwrap();
    // A second service of two: four in all.
    for client in [&acme, &r.client] {
        over_max(
            "a new service",
            client.send("POST", "/v1/services", Some(&body("s2", &[2, 3]))),
            4,
        );
    }
    acme.send("POST", "/v1/services", Some(&body("s2", &[2])))
        .unwrap();
    // A backend added to a service, and a service edited to more.
    over_max(
        "a backend added",
        acme.send(
            "POST",
            "/v1/services/acme/s2/backends",
            Some(&json!({ "address": addr(4) })),
        ),
        4,
    );
    over_max(
        "an edit to more",
        acme.send("PUT", "/v1/services/acme/s1", Some(&body("s1", &[0, 1, 5]))),
        4,
    );
    assert_eq!(
        r.d()
            .control()
            .service_spec("acme", "s1")
            .unwrap()
            .backends
            .len(),
        2,
        "the refused edit changed the service"
    );
    // An edit that swaps a backend (same count) passes; another tenant is
    // not counted against acme.
    acme.send("PUT", "/v1/services/acme/s1", Some(&body("s1", &[0, 6])))
        .unwrap();
    let mut other = body("s9", &[7, 8, 9, 10]);
    other["tenant"] = json!("default");
    r.client.send("POST", "/v1/services", Some(&other)).unwrap();
    // One deleted makes room.
    acme.send(
        "DELETE",
        &format!("/v1/services/acme/s1/backends/{}", addr(6)),
        None,
    )
    .unwrap();
    acme.send(
        "POST",
        "/v1/services/acme/s2/backends",
        Some(&json!({ "address": addr(4) })),
    )
    .unwrap();
    // A reload giving acme four is refused, nothing applied.
    let b = |a: &str| -> SocketAddr { a.parse().unwrap() };
    let text = [
        tenant_toml("acme", "token = \"acme-tok\"\nmax_backends = 3"),
        service_toml("acme", "s1", &[echo.addr, b("127.0.0.9:1")]),
        service_toml("acme", "s2", &[b("127.0.0.10:1"), b("127.0.0.11:1")]),
    ]
    .concat();
    write(&path, &text);
    let reload = r.api("POST", "/v1/reload", None);
    assert!(
        matches!(
            &reload,
            Err(CliError::Api { status: 400, errors, .. })
                if errors.iter().any(|e| e.contains("has 4 backends in this file, over its max_backends (3)"))
        ),
        "the reload was not refused: {reload:?}"
    );
    assert_eq!(
        r.d()
            .control()
            .service_spec("acme", "s2")
            .unwrap()
            .backends
            .len(),
        2,
        "applied in part"
    );
    // Lowered to 1: all three stay; a backend added is refused, one
    // removed is fine.
    r.client
        .send(
            "PUT",
            "/v1/tenants/acme",
            Some(&json!({ "max_backends": 1 })),
        )
        .unwrap();
    assert!(matches!(
        acme.send(
            "POST",
            "/v1/services/acme/s1/backends",
            Some(&json!({ "address": addr(11) })),
        ),
        Err(CliError::Api { status: 409, .. })
    ));
    acme.send(
        "DELETE",
        &format!("/v1/services/acme/s2/backends/{}", addr(4)),
        None,
    )
    .unwrap();
}

/// `max_services`: each service holds a socket per worker of the daemon's
/// descriptors, which every tenant shares, so a tenant token could add
/// services until no one could accept. A tenant holds at most its
/// `max_services`, whoever adds them (its token, the operator, a reload);
/// one deleted makes room; a lowered cap keeps what is there.
#[test]
fn a_tenant_holds_at_most_its_max_services() {
    let echo = Echo::start();
    let (r, _dir, path) = from_file(&tenant_toml(
        "acme",
        "token = \"acme-tok\"\nmax_services = 2",
    ));
    let acme = Client::new(r.url.clone(), Some("acme-tok".into()));
    let body = |name: &str| {
        json!({
            "tenant": "acme", "name": name, "protocol": "tcp", "listen": "127.0.0.1:0",
            "backend": [{ "address": echo.addr.to_string() }],
        })
    };
    for name in ["s1", "s2"] {
        acme.send("POST", "/v1/services", Some(&body(name)))
            .unwrap_or_else(|e| panic!("{name}: {e:?}"));
    }
    for client in [&acme, &r.client] {
        refused(
            "a third service",
            client.send("POST", "/v1/services", Some(&body("s3"))),
            409,
            &["tenant \"acme\" holds 2 services, its max_services (2)"],
        );
    }
    // Another tenant is not counted against acme, nor acme against it.
    let mut other = body("s3");
    other["tenant"] = json!("default");
    r.client.send("POST", "/v1/services", Some(&other)).unwrap();
    // Edited in place: still two.
    let mut s1 = body("s1");
    s1["scheduler"] = json!("wrr");
    acme.send("PUT", "/v1/services/acme/s1", Some(&s1)).unwrap();
    acme.send("DELETE", "/v1/services/acme/s2", None).unwrap();
    acme.send("POST", "/v1/services", Some(&body("s3")))
        .unwrap();
    let vip = r.d().service_addr("acme", "s3").unwrap();
    assert!(echo_once(vip, b"room again"));
    // A reload giving acme a third service is refused, nothing applied
    // (the file's own check; the API's additions are in it).
    write(
        &path,
        &format!(
            "{}{}{}{}{}",
            tenant_toml("acme", "token = \"acme-tok\"\nmax_services = 2"),
            service_toml("default", "s3", &[echo.addr]),
            service_toml("acme", "s1", &[echo.addr]),
            service_toml("acme", "s3", &[echo.addr]),
            service_toml("acme", "s4", &[echo.addr]),
        ),
    );
    let reload = r.api("POST", "/v1/reload", None);
    assert!(
        matches!(
            &reload,
            Err(CliError::Api { status: 400, errors, .. })
                if errors.len() == 1 && errors[0].contains("has 3 services in this file, over its max_services (2)")
        ),
        "the reload was not refused: {reload:?}"
    );
    assert_eq!(r.d().service_addr("acme", "s4"), None, "applied in part");
    // Lowered to 1: both stay, a new one is refused.
    r.client
        .send(
            "PUT",
            "/v1/tenants/acme",
            Some(&json!({ "max_services": 1 })),
        )
        .unwrap();
    assert!(r.d().service_addr("acme", "s1").is_some());
    assert!(matches!(
        acme.send("POST", "/v1/services", Some(&body("s5"))),
        Err(CliError::Api { status: 409, .. })
    ));
}

/// A tenant token cannot point a backend at weir itself: at the service
/// it is writing (a connection would open another through weir, and that
/// one another, until the limits or the descriptors ran out: one client
/// could starve every tenant), at another of weir's services (its own
/// tenant's or another's, on exactly that address or on a wildcard
/// listener the address reaches), or at the admin API (which would put it
/// on the tenant's address). Whatever `allowed_backends` says (empty
/// here: no fence); nothing is added when refused. The full-access token
/// may still chain services. Before, every one of these was accepted.
#[test]
fn a_tenant_token_cannot_point_a_backend_at_weir() {
    let echo = Echo::start();
    let (r, _dir, _path) = from_file(&format!(
        "{}{}",
        acme_beside_g(&echo, ""),
        "[[service]]\nname = \"wild\"\nprotocol = \"tcp\"\nlisten = \"0.0.0.0:0\"\n\
         [[service.backend]]\naddress = \"127.0.0.1:9\"\n",
    ));
    let acme = Client::new(r.url.clone(), Some("acme-tok".into()));
    let g = r.d().service_addr("default", "g").unwrap();
    let wild_port = r.d().service_addr("default", "wild").unwrap().port();
    let admin = r.admin_addr();
    let free = free_addr();
    let body = |name: &str, listen: SocketAddr, backend: SocketAddr| {
        json!({
            "tenant": "acme", "name": name, "protocol": "tcp", "listen": listen.to_string(),
            "backend": [{ "address": backend.to_string() }],
        })
    };
    let at_weir = |res, want: &str| {
        refused(want, res, 403, &[want]);
    };
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    // Its own address.
    at_weir(
        acme.send("POST", "/v1/services", Some(&body("loop", free, free))),
        "weir's own service acme's service being written",
    );
    // Another tenant's service, exactly, and through a wildcard listener.
    at_weir(
        acme.send("POST", "/v1/services", Some(&body("b", any, g))),
        "weir's own service default/g",
    );
    let via_wildcard = SocketAddr::from(([127, 0, 0, 5], wild_port));
    at_weir(
        acme.send("POST", "/v1/services", Some(&body("b", any, via_wildcard))),
        "weir's own service default/wild",
    );
    // The admin API.
    at_weir(
        acme.send("POST", "/v1/services", Some(&body("b", any, admin))),
        "admin API",
    );
    // Added, then pointed at itself or at weir by a backend add or an edit.
    acme.send("POST", "/v1/services", Some(&body("a", any, echo.addr)))
        .unwrap();
    let a = r.d().service_addr("acme", "a").unwrap();
    at_weir(
        acme.send(
            "POST",
            "/v1/services/acme/a/backends",
            Some(&json!({ "address": a.to_string() })),
        ),
        "weir's own service acme/a",
    );
    at_weir(
        acme.send("PUT", "/v1/services/acme/a", Some(&body("a", a, g))),
        "weir's own service default/g",
    );
    let spec = r.ok("GET", "/v1/services/acme/a", None);
    let backends: Vec<_> = spec["backend"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["address"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(backends, [echo.addr.to_string()], "nothing added");
    assert!(echo_once(a, b"still there"));
    // A UDP service may use the port of a TCP one: that does not reach it.
    let mut udp = body("u", any, g);
    udp["protocol"] = json!("udp");
    acme.send("POST", "/v1/services", Some(&udp)).unwrap();
    // Two requests at once, each pointing at the other's address: the
    // fence check and the change are one step, so they cannot both pass
    // before the other's service exists. (The admin API's runtime has one
    // worker today, so the handlers do not interleave without the fence
    // lock either; the lock keeps this true if that changes.)
    for round in 0..20 {
        let (p1, p2) = {
            let (l1, l2) = (
                TcpListener::bind("127.0.0.1:0").unwrap(),
                TcpListener::bind("127.0.0.1:0").unwrap(),
            );
            (l1.local_addr().unwrap(), l2.local_addr().unwrap())
        };
        let created: Vec<bool> = std::thread::scope(|s| {
            let one = |name: &'static str, listen, backend| {
                let acme = &acme;
                let b = body(name, listen, backend);
                s.spawn(move || acme.send("POST", "/v1/services", Some(&b)).is_ok())
            };
            let (x, y) = (one("x", p1, p2), one("y", p2, p1));
            vec![x.join().unwrap(), y.join().unwrap()]
        });
        assert!(!(created[0] && created[1]), "round {round}: a loop of two");
        for (name, made) in ["x", "y"].iter().zip(&created) {
            if *made {
                acme.send("DELETE", &format!("/v1/services/acme/{name}"), None)
                    .unwrap();
            }
        }
    }
    // The full-access token is not fenced: an operator may chain services.
    r.client
        .send(
            "POST",
            "/v1/services/acme/a/backends",
            Some(&json!({ "address": g.to_string() })),
        )
        .unwrap();
}

/// A health check's `port` is fenced against weir itself as the backends
/// are: with a backend on the host, `port` = the admin API's port made the
/// health checker connect to the admin API every interval, and `port` =
/// one of weir's services' made it open connections through weir (its
/// own listener included), whatever `allowed_backends` says (empty here:
/// no fence). Refused with 403 on a service added or edited, and on a
/// backend added to a service whose check names such a port; nothing is
/// changed. The full-access token is not fenced. Before, all were accepted.
#[test]
fn a_tenant_token_cannot_point_a_health_check_at_weir() {
    let echo = Echo::start();
    let (r, _dir, _path) = from_file(&acme_beside_g(&echo, "min_health_interval = \"1s\""));
    let acme = Client::new(r.url.clone(), Some("acme-tok".into()));
    let g = r.d().service_addr("default", "g").unwrap();
    let admin = r.admin_addr();
    let free = free_addr();
    let body = |name: &str, listen: SocketAddr, port: u16| {
        json!({
            "tenant": "acme", "name": name, "protocol": "tcp", "listen": listen.to_string(),
            "backend": [{ "address": echo.addr.to_string() }],
            "health": { "interval": "1s", "port": port },
        })
    };
    let at_weir = |res, want: &str| {
        refused(want, res, 403, &["health check", want]);
    };
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    at_weir(
        acme.send("POST", "/v1/services", Some(&body("h", any, admin.port()))),
        "admin API",
    );
    at_weir(
        acme.send("POST", "/v1/services", Some(&body("h", any, g.port()))),
        "weir's own service default/g",
    );
    at_weir(
        acme.send("POST", "/v1/services", Some(&body("h", free, free.port()))),
        "weir's own service acme's service being written",
    );
    assert_eq!(r.d().service_addr("acme", "h"), None, "added anyway");
    // Added with a check of the backend's own port, then edited to weir's.
    acme.send(
        "POST",
        "/v1/services",
        Some(&body("h", any, echo.addr.port())),
    )
    .unwrap();
    let h = r.d().service_addr("acme", "h").unwrap();
    at_weir(
        acme.send(
            "PUT",
            "/v1/services/acme/h",
            Some(&body("h", h, admin.port())),
        ),
        "admin API",
    );
    let spec = r.ok("GET", "/v1/services/acme/h", None);
    assert_eq!(
        spec["health"]["port"],
        json!(echo.addr.port()),
        "edited anyway"
    );
    // A service whose check names a port: a new backend on another
    // address of the host makes that port of it a target.
    let mut other = body("k", any, g.port());
    other["backend"] = json!([]);
    other["health"]["port"] = json!(admin.port());
    r.client.send("POST", "/v1/services", Some(&other)).unwrap();
    at_weir(
        acme.send(
            "POST",
            "/v1/services/acme/k/backends",
            Some(&json!({ "address": echo.addr.to_string() })),
        ),
        "admin API",
    );
    let spec = r.ok("GET", "/v1/services/acme/k", None);
    assert_eq!(spec["backend"], json!([]), "backend added anyway");
    // The full-access token may.
    r.client
        .send(
            "POST",
            "/v1/services/acme/k/backends",
            Some(&json!({ "address": echo.addr.to_string() })),
        )
        .unwrap();
}

/// A backend at `[::ffff:0.0.0.0]:PORT` is 0.0.0.0 written as IPv6, and
/// Linux connects a socket to 0.0.0.0 on the host itself: it is refused
/// as 0.0.0.0 and `[::]` are ("not a reachable address"), through any
/// token, and in a file. Before, it was accepted: a tenant token with no
/// `allowed_backends` fence put the admin API, bound to 127.0.0.1, on its
/// own service's address (the fence compared the admin API's address with
/// 0.0.0.0, not with the host's).
#[test]
fn a_backend_at_the_v4_mapped_unspecified_address_is_refused() {
    use std::io::{Read, Write};
    let echo = Echo::start();
    let (r, _dir, path) = from_file(&acme_beside_g(&echo, ""));
    let acme = Client::new(r.url.clone(), Some("acme-tok".into()));
    let admin = r.admin_addr();
    let mapped = format!("[::ffff:0.0.0.0]:{}", admin.port());
    // What a service of acme's at `vip` answers a request for the admin
    // API's `whoami` with (what the refusal keeps from happening).
    let through = |vip: SocketAddr| -> String {
        let mut c = std::net::TcpStream::connect(vip).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = c.write_all(b"GET /v1/whoami HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let mut got = Vec::new();
        let _ = c.read_to_end(&mut got);
        String::from_utf8_lossy(&got).into_owned()
    };
    let unreachable = |res: Result<Value, CliError>, service: &str| {
        if res.is_ok() {
            let vip = r.d().service_addr("acme", service);
            panic!(
                "{mapped} accepted ({res:?}); through acme/{service}: {:?}",
                vip.map(through)
            )
        }
        let case = format!("{mapped} in acme/{service}");
        refused(&case, res, 400, &["not a reachable address"]);
    };
    let body = json!({
        "tenant": "acme", "name": "b", "protocol": "tcp", "listen": "127.0.0.1:0",
        "backend": [{ "address": mapped }],
    });
    unreachable(acme.send("POST", "/v1/services", Some(&body)), "b");
    // Added to a service of acme's, by acme's token or the full-access one.
    let mut a = body.clone();
    a["name"] = json!("a");
    a["backend"] = json!([{ "address": echo.addr.to_string() }]);
    acme.send("POST", "/v1/services", Some(&a)).unwrap();
    let add = json!({ "address": mapped });
    unreachable(
        acme.send("POST", "/v1/services/acme/a/backends", Some(&add)),
        "a",
    );
    unreachable(
        r.client
            .send("POST", "/v1/services/acme/a/backends", Some(&add)),
        "a",
    );
    // In a file: the reload is refused.
    let text = acme_beside_g(&echo, "").replace(
        &format!("address = \"{}\"", echo.addr),
        &format!("address = \"{mapped}\""),
    );
    write(&path, &text);
    let (status, message) = r.status("POST", "/v1/reload?force=true", None);
    assert_eq!(status, 400, "{message}");
    let spec = r.ok("GET", "/v1/services/default/g", None);
    assert_eq!(
        spec["backend"][0]["address"],
        json!(echo.addr.to_string()),
        "the reload applied nothing"
    );
}

/// An admin API on `[::]` takes IPv4 connections too (its listener is
/// dual-stack): a tenant token's backend at 127.0.0.1 and the admin API's
/// port reaches it, and is refused as a backend at the admin API's own
/// address is. Before, the fence took an IPv6 wildcard to cover IPv6
/// addresses only, and let the backend through.
#[test]
fn a_tenant_token_cannot_reach_a_dual_stack_admin_api_over_ipv4() {
    let cfg = weir::config::parse(&tenant_toml("acme", "token = \"acme-tok\""), "t.toml").unwrap();
    let r = Running::start_admin_on(cfg, None, "[::]:0");
    let port = r.url.rsplit(':').next().unwrap().trim_end_matches('/');
    let backend: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    if std::net::TcpStream::connect(backend).is_err() {
        eprintln!("skipped: [::] is IPv6-only here (net.ipv6.bindv6only = 1)");
        return;
    }
    let acme = Client::new(format!("http://{backend}"), Some("acme-tok".into()));
    let body = json!({
        "tenant": "acme", "name": "b", "protocol": "tcp", "listen": "127.0.0.1:0",
        "backend": [{ "address": backend.to_string() }],
    });
    refused(
        &format!("a backend at {backend}"),
        acme.send("POST", "/v1/services", Some(&body)),
        403,
        &["admin API"],
    );
    assert_eq!(r.d().service_addr("acme", "b"), None, "nothing added");
}

/// A reload whose file keeps a tenant within its `max_backends` applies
/// whole, whatever order the file lists its changes in: a backend moved
/// from one service (listed second) to another (listed first) is within
/// the cap before and after. The reload's steps used to be checked one by
/// one against the cap, so the first service's gain was refused, the
/// second service's loss applied, and the answer said "nothing was
/// applied": the tenant was left with one backend fewer than either file.
#[test]
fn a_reload_moving_backends_within_max_backends_applies_whole() {
    let echo = Echo::start();
    let b = |n: u8| -> SocketAddr { SocketAddr::from(([127, 0, 0, 2 + n], echo.addr.port())) };
    let acme = tenant_toml("acme", "max_backends = 2");
    let (r, _dir, path) = from_file(&format!(
        "{acme}{}{}",
        service_toml("acme", "s1", &[b(0)]),
        service_toml("acme", "s2", &[b(1)]),
    ));
    write(
        &path,
        &format!(
            "{acme}{}{}",
            service_toml("acme", "s1", &[b(0), b(1)]),
            service_toml("acme", "s2", &[]),
        ),
    );
    let reload = r.api("POST", "/v1/reload", None);
    let backends = |name: &str| -> Vec<SocketAddr> {
        r.d()
            .control()
            .service_spec("acme", name)
            .unwrap()
            .backends
            .iter()
            .map(|b| b.address)
            .collect()
    };
    assert!(reload.is_ok(), "a reload within the cap: {reload:?}");
    assert_eq!(backends("s1"), vec![b(0), b(1)]);
    assert_eq!(backends("s2"), Vec::<SocketAddr>::new());
}

/// An IPv6 scope id names an interface; on an address that needs none
/// (anything but link-local and multicast) the kernel ignores it. A
/// listen of another service's address with a scope id appended
/// (`[::1%1]:PORT`) was a new address to weir (no 409), and its
/// `SO_REUSEPORT` sockets joined the other service's group in the
/// kernel: a tenant token took a share of another tenant's connections.
/// Such a listen is refused, naming the key; the file's check says so too.
#[test]
fn a_scope_id_does_not_make_another_services_address_new() {
    let echo = Echo::start();
    let (r, _dir, path) = from_file(&format!(
        "{}{}",
        tenant_toml("acme", "token = \"acme-tok\""),
        tenant_toml("beta", "token = \"beta-tok\""),
    ));
    let service = |name: &str, listen: &str| {
        json!({
            "name": name, "protocol": "tcp", "listen": listen,
            "backend": [{ "address": echo.addr.to_string() }],
        })
    };
    let beta = Client::new(r.url.clone(), Some("beta-tok".into()));
    beta.send("POST", "/v1/services", Some(&service("web", "[::1]:0")))
        .unwrap();
    let vip = r.d().service_addr("beta", "web").unwrap();
    let stolen = format!("[::1%1]:{}", vip.port());
    let acme = Client::new(r.url.clone(), Some("acme-tok".into()));
    for client in [&acme, &r.client] {
        let mut body = service("steal", &stolen);
        body["tenant"] = json!("acme");
        refused(
            &format!("a listen on {stolen}"),
            client.send("POST", "/v1/services", Some(&body)),
            400,
            &["listen", "scope"],
        );
    }
    assert_eq!(r.d().service_addr("acme", "steal"), None);
    // Nor moved there by an edit.
    beta.send("POST", "/v1/services", Some(&service("other", "[::1]:0")))
        .unwrap();
    refused(
        "an edit to a scope id",
        beta.send(
            "PUT",
            "/v1/services/beta/other",
            Some(&service("other", &format!("[::1%1]:{}", vip.port() ^ 1))),
        ),
        400,
        &[],
    );
    // Nor in a file.
    let text = format!(
        "{}[[service]]\nname = \"s\"\nprotocol = \"tcp\"\nlisten = \"{stolen}\"\n",
        tenant_toml("acme", "")
    );
    std::fs::write(&path, &text).unwrap();
    match weir::config::load(&path) {
        Err(errors) => assert!(
            errors
                .iter()
                .any(|e| e.to_string().contains("service[0].listen")),
            "{errors:?}"
        ),
        Ok(_) => panic!("a file listening on {stolen} passes its check"),
    }
}

/// A reload whose file moves a service onto the address of another one
/// that it moves only later in the file (or keeps: port 0 keeps the
/// port) is refused whole, saying which to list first; before, the check
/// passed (the address is ours, so free to probe), the first move failed
/// part-way through applying, the second applied, and the answer said
/// "nothing was applied". Listed the other way round, it applies whole.
#[test]
fn a_reload_taking_an_address_freed_later_is_refused_whole() {
    let echo = Echo::start();
    let (r, _dir, path) = from_file(&format!(
        "{}{}",
        service_toml("default", "s1", &[echo.addr]),
        service_toml("default", "s2", &[echo.addr]),
    ));
    let s1 = r.d().service_addr("default", "s1").unwrap();
    let s2 = r.d().service_addr("default", "s2").unwrap();
    let at = |name: &str, listen: &str| {
        format!(
            "[[service]]\nname = \"{name}\"\nprotocol = \"tcp\"\nlisten = \"{listen}\"\n\
             [[service.backend]]\naddress = \"{}\"\n",
            echo.addr
        )
    };
    // s1 takes s2's address; s2 moves to another IP, but only after it.
    let s1_first = format!("{}{}", at("s1", &s2.to_string()), at("s2", "127.0.0.2:0"));
    write(&path, &s1_first);
    match r.api("POST", "/v1/reload", None) {
        Err(CliError::Api {
            status: 400,
            message,
            errors,
        }) => {
            assert!(message.contains("nothing was applied"), "{message}");
            assert!(
                errors
                    .iter()
                    .any(|e| e.contains("list service default/s2 first")),
                "{errors:?}"
            );
        }
        other => panic!("expected a refused reload, got {other:?}"),
    }
    assert_eq!(r.d().service_addr("default", "s1"), Some(s1), "s1 moved");
    assert_eq!(r.d().service_addr("default", "s2"), Some(s2), "s2 moved");
    // The same moves listed the other way round apply whole.
    let s2_first = format!("{}{}", at("s2", "127.0.0.2:0"), at("s1", &s2.to_string()));
    write(&path, &s2_first);
    r.ok("POST", "/v1/reload", None);
    assert_eq!(r.d().service_addr("default", "s1"), Some(s2));
    assert_eq!(
        r.d().service_addr("default", "s2").map(|a| a.ip()),
        Some("127.0.0.2".parse().unwrap())
    );
    assert!(echo_once(s2, b"s1 on s2's old address"));
}

/// A tenant token set through the API with white space around it works
/// as the token without it, as the file's tokens do (and as the roles
/// check reads it): an HTTP header's value is trimmed, so the token as
/// stored could never be presented, and the tenant was locked out with a
/// plain 401. (Reported by helper-14's review.)
#[test]
fn a_tenant_token_with_spaces_around_it_authenticates() {
    let (r, _dir, _path) = from_file("");
    r.client
        .send(
            "POST",
            "/v1/tenants",
            Some(&json!({ "name": "sp", "token": "  sp-tok\t" })),
        )
        .unwrap();
    let sp = Client::new(r.url.clone(), Some("sp-tok".into()));
    let me = sp.send("GET", "/v1/whoami", None).unwrap();
    assert_eq!(me["tenant"], json!("sp"), "{me}");
}

/// A tenant token is checked when a request's head arrives, and the
/// write it asks for is made once its body has: a request whose body was
/// still arriving when the operator changed the tenant's token (or
/// deleted the tenant, then created it again for someone else) went
/// through with the old token, however long after the change its holder
/// sent the rest (a byte every 59 s keeps an admin connection open).
/// The body is the 100-continue's answer here, so the request has passed
/// the token check on its head before the token is changed.
#[test]
fn a_changed_tenant_token_cannot_finish_a_request_begun_with_it() {
    use std::io::{BufRead, BufReader, Write};
    let echo = Echo::start();
    let (r, _dir, _path) = from_file(&format!(
        "{}{}",
        tenant_toml(
            "acme",
            "token = \"acme-tok\"\nallowed_listen = [\"127.0.0.0/8\"]\nallowed_backends = [\"127.0.0.0/8\"]"
        ),
        service_toml("acme", "web", &[echo.addr]),
    ));
    let admin = r.url.strip_prefix("http://").unwrap();
    let mut s = std::net::TcpStream::connect(admin).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let body = json!({ "address": "127.0.0.9:80" }).to_string();
    write!(
        s,
        "POST /v1/services/acme/web/backends HTTP/1.1\r\nHost: weir\r\n\
         Authorization: Bearer acme-tok\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nExpect: 100-continue\r\n\r\n",
        body.len()
    )
    .unwrap();
    let mut answer = BufReader::new(s.try_clone().unwrap());
    let mut line = String::new();
    answer.read_line(&mut line).unwrap();
    assert!(
        line.starts_with("HTTP/1.1 100"),
        "the head was answered before its body was read: {line:?}"
    );
    // The rest of the 100 Continue: its empty line.
    line.clear();
    answer.read_line(&mut line).unwrap();
    assert_eq!(line, "\r\n");

    r.ok(
        "PUT",
        "/v1/tenants/acme",
        Some(json!({ "token": "acme-new" })),
    );
    let old = Client::new(r.url.clone(), Some("acme-tok".into()));
    assert!(matches!(
        old.send("GET", "/v1/whoami", None),
        Err(CliError::Api { status: 401, .. })
    ));

    s.write_all(body.as_bytes()).unwrap();
    line.clear();
    answer.read_line(&mut line).unwrap();
    let backends: Vec<Value> = r.ok("GET", "/v1/services/acme/web", None)["backend"]
        .as_array()
        .unwrap()
        .clone();
    assert!(
        !backends.iter().any(|b| b["address"] == "127.0.0.9:80"),
        "the old token added a backend after the operator changed it (answer {line:?}): {backends:?}"
    );
    assert!(line.starts_with("HTTP/1.1 401"), "{line:?}");
}
