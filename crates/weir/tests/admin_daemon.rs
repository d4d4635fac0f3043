//! The admin API against the real daemon (`Daemon::start`): backend churn
//! under client load with no failed or cut connections, reload with a broken
//! file keeping the running config, and save → restart round trip.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use weir::cli::client::CliError;
use weir::config::Config;

mod cli_util;
mod daemon_util;
use daemon_util::admin::{Running, TOKEN};
use daemon_util::{Echo, held, still_echoes};

fn echo_once(addr: SocketAddr, msg: &[u8]) -> Result<(), String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(msg).map_err(|e| format!("write: {e}"))?;
    let mut buf = vec![0u8; msg.len()];
    s.read_exact(&mut buf).map_err(|e| format!("read: {e}"))?;
    if buf != msg {
        return Err("echo mismatch".into());
    }
    Ok(())
}

fn config(text: &str) -> Config {
    toml::from_str(text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

fn service_toml(name: &str, backends: &[SocketAddr]) -> String {
    let mut s = format!(
        "[[service]]\nname = \"{name}\"\nprotocol = \"tcp\"\nlisten = \"127.0.0.1:0\"\nscheduler = \"rr\"\n"
    );
    for b in backends {
        s.push_str(&format!("[[service.backend]]\naddress = \"{b}\"\n"));
    }
    s
}

/// Add, edit, drain and delete a backend 100 times while clients keep
/// connecting: no client connection fails and no established connection is
/// cut, except the one killed on purpose.
#[test]
fn backend_churn_under_load_drops_nothing() {
    churn(100);
}

/// The same, 2,000 cycles (stress; run with `--ignored`).
#[test]
#[ignore]
fn backend_churn_under_load_drops_nothing_long() {
    churn(2_000);
}

fn churn(cycles: u64) {
    let a = Echo::start();
    let b = Echo::start();
    let mut cfg = config(&service_toml("web", &[a.addr]));
    cfg.daemon.workers = 2;
    let r = Running::start(cfg, None);
    let vip = r.d().service_addr("default", "web").expect("service bound");

    let mut long_lived: Vec<TcpStream> = (0..10).map(|_| held(vip)).collect();

    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let first_error = Arc::new(std::sync::Mutex::new(None::<String>));
    let clients: Vec<_> = (0..2)
        .map(|i| {
            let (stop, ok, failed, first_error) = (
                stop.clone(),
                ok.clone(),
                failed.clone(),
                first_error.clone(),
            );
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(600);
                let msg = format!("client {i} says hello");
                // Bounded in count and time.
                for _ in 0..200_000 {
                    if stop.load(Relaxed) || Instant::now() > deadline {
                        break;
                    }
                    match echo_once(vip, msg.as_bytes()) {
                        Ok(()) => ok.fetch_add(1, Relaxed),
                        Err(e) => {
                            first_error.lock().unwrap().get_or_insert(e);
                            failed.fetch_add(1, Relaxed)
                        }
                    };
                }
            })
        })
        .collect();

    // Wait (bounded) until the clients completed `n` more connections, so
    // every step of the churn overlaps live traffic.
    let progress = |n: u64| {
        let target = ok.load(Relaxed) + n;
        let deadline = Instant::now() + Duration::from_secs(20);
        while ok.load(Relaxed) < target && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    let base = "/v1/services/default/web/backends";
    let addr = b.addr.to_string();
    for i in 0..cycles {
        r.ok("POST", base, Some(json!({ "address": addr, "weight": 1 })));
        progress(2);
        if i % 10 == 0 {
            // Some connections may land on the churned backend and must
            // survive its drain and removal.
            long_lived.push(held(vip));
        }
        r.ok(
            "PUT",
            &format!("{base}/{addr}"),
            Some(json!({ "weight": 3 })),
        );
        progress(2);
        r.ok(
            "PUT",
            &format!("{base}/{addr}"),
            Some(json!({ "weight": 0 })),
        );
        progress(1);
        r.ok("DELETE", &format!("{base}/{addr}"), None);
        progress(1);
    }
    // Let clients run a little past the last change (bounded by progress, not time).
    let target = ok.load(Relaxed) + 50;
    let deadline = Instant::now() + Duration::from_secs(30);
    while ok.load(Relaxed) < target && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.store(true, Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    let (n_ok, n_failed) = (ok.load(Relaxed), failed.load(Relaxed));
    assert_eq!(
        n_failed,
        0,
        "{n_failed} of {} client connections failed; first: {:?}",
        n_ok + n_failed,
        first_error.lock().unwrap()
    );
    assert!(n_ok >= 6 * cycles, "clients made progress: {n_ok}");
    assert!(
        b.accepted.load(Relaxed) > 0,
        "the churned backend took connections"
    );
    eprintln!(
        "churn: {cycles} add/edit/drain/delete cycles, {n_ok} client connections ({} to the churned backend), 0 failed, {} held",
        b.accepted.load(Relaxed),
        long_lived.len()
    );
    for (i, s) in long_lived.iter_mut().enumerate() {
        assert!(still_echoes(s), "established connection {i} was cut");
    }

    // The backend set is back to A only.
    let services = r.ok("GET", "/v1/services", None);
    let backends: Vec<&str> = services[0]["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["address"].as_str().unwrap())
        .collect();
    assert_eq!(backends, [a.addr.to_string()]);

    // Kill exactly one connection by cookie: that one is cut, the rest are not.
    let page = r.ok(
        "GET",
        "/v1/connections?tenant=default&state=ESTABLISHED&limit=10000",
        None,
    );
    let conns = page["connections"].as_array().unwrap();
    assert!(
        conns.len() >= long_lived.len(),
        "{} listed, {} held",
        conns.len(),
        long_lived.len()
    );
    let victim_port = long_lived[0].local_addr().unwrap().port();
    let victim = conns
        .iter()
        .find(|c| {
            c["client"]
                .as_str()
                .is_some_and(|a| a.ends_with(&format!(":{victim_port}")))
        })
        .expect("the held connection is listed");
    let cookie = victim["cookie"].as_u64().unwrap();
    r.ok("DELETE", &format!("/v1/connections/{cookie}"), None);
    let mut b4 = [0u8; 4];
    let cut = long_lived[0].write_all(b"ping").is_err()
        || !matches!(long_lived[0].read(&mut b4), Ok(n) if n > 0);
    assert!(cut, "the killed connection still echoes");
    for (i, s) in long_lived.iter_mut().enumerate().skip(1) {
        assert!(still_echoes(s), "connection {i} was cut by killing another");
    }
    r.shutdown();
}

#[test]
fn reload_with_a_broken_config_keeps_serving_the_old_one() {
    let a = Echo::start();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("weir.toml");
    let good = format!(
        "[daemon]\nworkers = 1\n\n{}",
        service_toml("web", &[a.addr])
    );
    std::fs::write(&path, &good).unwrap();
    let r = Running::start(config(&good), Some(path.clone()));
    let vip = r.d().service_addr("default", "web").unwrap();
    echo_once(vip, b"before").unwrap();
    let mut conn = held(vip);

    for broken in [
        "this is = = not toml".to_string(),
        format!("{good}\n[[service]]\nname = \"x\"\nprotocol = \"sctp\"\nlisten = \"1.2.3.4:5\"\n"),
        good.replace("scheduler = \"rr\"", "scheduler = \"bogus\""),
    ] {
        std::fs::write(&path, &broken).unwrap();
        match r.api("POST", "/v1/reload", None) {
            Err(CliError::Api { status, errors, .. }) => {
                assert_eq!(status, 400);
                assert!(!errors.is_empty(), "every error is returned");
            }
            other => panic!("reload of a broken file: {other:?}\n{broken}"),
        }
        echo_once(vip, b"still serving").unwrap();
        assert!(still_echoes(&mut conn));
        let cfg: Config = serde_json::from_value(r.ok("GET", "/v1/config", None)).unwrap();
        assert_eq!(cfg.services.len(), 1);
        assert_eq!(
            cfg.services[0].scheduler.as_str(),
            "rr",
            "running config kept"
        );
    }
    // A good file with a second service reloads.
    let b = Echo::start();
    let two = format!("{good}\n{}", service_toml("api", &[b.addr]));
    std::fs::write(&path, &two).unwrap();
    r.ok("POST", "/v1/reload", None);
    let names: Vec<String> = r
        .ok("GET", "/v1/services", None)
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, ["api", "web"]);
    assert!(
        still_echoes(&mut conn),
        "reload keeps established connections"
    );
    r.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}

fn cli(url: &str, args: &[&str]) -> String {
    let (code, out, err) = cli_util::run(url, TOKEN, args);
    assert_eq!(code, ExitCode::SUCCESS, "{args:?}: {err}");
    out
}

/// Changes made at runtime survive `weir save` → restart from the saved file.
#[test]
fn save_then_restart_reproduces_the_running_state() {
    let a = Echo::start();
    let b = Echo::start();
    let mut cfg = config(&service_toml("web", &[a.addr]));
    cfg.daemon.workers = 1;
    // The estimator thread pinned to CPU 0 at a lower priority: the daemon
    // runs and `weir save` keeps both settings.
    cfg.daemon.estimator_cpu = Some(0);
    cfg.daemon.estimator_nice = Some(5);
    let r = Running::start(cfg, None);
    cli(
        &r.url,
        &[
            "tenant",
            "add",
            "acme",
            "--table-entries",
            "1024",
            "--max-connections",
            "50",
        ],
    );
    cli(
        &r.url,
        &[
            "service",
            "add",
            "acme/api",
            "--listen",
            "127.0.0.1:0",
            "--scheduler",
            "wrr",
            "--persistence",
            "300s",
            "--backend",
            &format!("{}@4", b.addr),
        ],
    );
    cli(
        &r.url,
        &[
            "backend",
            "add",
            "default/web",
            &b.addr.to_string(),
            "--weight",
            "2",
        ],
    );
    cli(
        &r.url,
        &[
            "backend",
            "edit",
            "default/web",
            &a.addr.to_string(),
            "--weight",
            "5",
        ],
    );
    // A live tenant edit through the CLI and the API (limits and timeouts).
    cli(
        &r.url,
        &[
            "tenant",
            "edit",
            "acme",
            "--max-connections",
            "60",
            "--timeout",
            "fin_wait=30s",
        ],
    );
    let listed = cli(&r.url, &["list"]);
    assert!(
        listed.contains("[acme/api]") && listed.contains(&b.addr.to_string()),
        "{listed}"
    );
    let api_vip = r.d().service_addr("acme", "api").unwrap();
    echo_once(api_vip, b"x").unwrap();

    let saved = cli(&r.url, &["save"]);
    let before = r.ok("GET", "/v1/services", None);
    let tenants_before = r.ok("GET", "/v1/tenants", None);
    r.shutdown();

    let restored: Config = toml::from_str(&saved).unwrap_or_else(|e| panic!("{e}\n{saved}"));
    assert!(
        saved.contains("estimator_cpu = 0\n") && saved.contains("estimator_nice = 5\n"),
        "{saved}"
    );
    assert_eq!(
        (
            restored.daemon.estimator_cpu,
            restored.daemon.estimator_nice
        ),
        (Some(0), Some(5))
    );
    // A service configured on port 0 gets a new port on restart; compare
    // addresses only when the saved file pins them.
    let pinned = restored.services.iter().all(|s| s.listen.port() != 0);
    let r2 = Running::start(restored, None);
    let after = r2.ok("GET", "/v1/services", None);
    let shape = |v: &Value| -> Vec<Value> {
        v.as_array().unwrap().iter().map(|s| json!({
            "tenant": s["tenant"], "name": s["name"], "protocol": s["protocol"],
            "listen": if pinned { s["listen"].clone() } else { Value::Null }, "scheduler": s["scheduler"], "persistence": s["persistence"],
            "backends": s["backends"].as_array().unwrap().iter()
                .map(|b| json!({ "address": b["address"], "weight": b["weight"] })).collect::<Vec<_>>(),
        })).collect()
    };
    assert_eq!(shape(&after), shape(&before), "saved:\n{saved}");
    let tshape = |v: &Value| -> Vec<Value> {
        v.as_array().unwrap().iter().map(|t| json!({
            "name": t["name"], "table_entries": t["table_entries"], "max_connections": t["max_connections"],
            "timeouts": t["timeouts"],
        })).collect()
    };
    let acme = |v: &Value| {
        v.as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == "acme")
            .cloned()
            .unwrap()
    };
    let before_acme = acme(&tenants_before);
    assert_eq!(before_acme["max_connections"], 60, "{before_acme}");
    assert_eq!(before_acme["timeouts"]["fin_wait"], "30s", "{before_acme}");
    assert_eq!(
        tshape(&r2.ok("GET", "/v1/tenants", None)),
        tshape(&tenants_before)
    );
    let vip = r2.d().service_addr("acme", "api").unwrap();
    echo_once(vip, b"after restart").unwrap();
    r2.shutdown();
}

/// A tenant's totals are its own counters: deleting one of its services
/// takes nothing off them, in `GET /v1/stats` and in `/metrics` (where a
/// counter that goes down reads as a reset, and a rate over it as a burst
/// of everything that is left). Before, both summed the services there
/// now: with 3 connections through `a` and 2 through `b`, the tenant's
/// count went from 5 to 2 when `a` was deleted.
#[test]
fn a_tenants_totals_survive_the_deletion_of_its_services() {
    let e = Echo::start();
    let mut text = service_toml("a", &[e.addr]);
    text.push_str(&service_toml("b", &[e.addr]));
    let r = Running::start(config(&text), None);
    let (a, b) = (
        r.d().service_addr("default", "a").unwrap(),
        r.d().service_addr("default", "b").unwrap(),
    );
    for vip in [a, a, a, b, b] {
        echo_once(vip, b"hello").unwrap();
    }
    let control = r.d().control();
    assert!(daemon_util::wait_until(Duration::from_secs(10), || control
        .global_stats()
        .active_conns
        == 0));
    let tenant = |stats: &Value| {
        stats["tenants"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["tenant"] == "default")
            .unwrap()["stats"]
            .clone()
    };
    let metric = |name: &str| {
        let text = weir::admin::metrics::render(control.as_ref()).unwrap();
        let prefix = format!("{name}{{tenant=\"default\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .unwrap_or_else(|| panic!("no {prefix:?} in:\n{text}"))
            .parse::<u64>()
            .unwrap()
    };
    let before = tenant(&r.ok("GET", "/v1/stats", None));
    assert_eq!(before["conns"], 5);
    assert_eq!(before["inbytes"], 25);
    assert_eq!(metric("weir_tenant_connections_total"), 5);
    r.ok("DELETE", "/v1/services/default/a", None);
    let after = tenant(&r.ok("GET", "/v1/stats", None));
    assert_eq!(after, before, "the tenant's totals after deleting a");
    assert_eq!(metric("weir_tenant_connections_total"), 5);
    assert_eq!(metric("weir_tenant_in_bytes_total"), 25);
    // A tenant deleted and made again under its old name starts from 0.
    let body = json!({
        "tenant": "t2", "name": "s", "protocol": "tcp", "listen": "127.0.0.1:0",
        "backend": [{ "address": e.addr.to_string() }],
    });
    let t2_conns = || {
        r.ok("GET", "/v1/stats", None)["tenants"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["tenant"] == "t2")
            .unwrap()["stats"]["conns"]
            .clone()
    };
    r.ok("POST", "/v1/tenants", Some(json!({ "name": "t2" })));
    r.ok("POST", "/v1/services", Some(body.clone()));
    echo_once(r.d().service_addr("t2", "s").unwrap(), b"hi").unwrap();
    assert_eq!(t2_conns(), 1);
    r.ok("DELETE", "/v1/tenants/t2", None);
    r.ok("POST", "/v1/tenants", Some(json!({ "name": "t2" })));
    assert_eq!(t2_conns(), 0, "a new tenant inherits nothing");
    r.ok("POST", "/v1/services", Some(body));
    assert_eq!(t2_conns(), 0);
}

/// The connections still going to a removed backend can be listed and
/// killed by its address. Entries name their backend by id, and listings
/// and backend filters resolved the id among the service's backends of
/// the moment: once the backend was removed its connections listed as
/// "-", and `backend=ADDR` (a listing or a kill) found none of them, so
/// an operator could not name them.
#[test]
fn the_connections_of_a_removed_backend_are_listed_and_killed_by_its_address() {
    let (a, b) = (Echo::start(), Echo::start());
    let r = Running::start(config(&service_toml("s", &[a.addr, b.addr])), None);
    let vip = r.d().service_addr("default", "s").unwrap();
    // Round robin: two connections, one on each backend.
    let mut conns = [held(vip), held(vip)];
    assert_eq!(
        (a.accepted.load(Relaxed), b.accepted.load(Relaxed)),
        (1, 1),
        "one connection on each backend"
    );
    let gone = b.addr.to_string();
    r.ok(
        "DELETE",
        &format!("/v1/services/default/s/backends/{gone}"),
        None,
    );
    let listed = |q: &str| -> Vec<String> {
        let page = r.ok("GET", &format!("/v1/connections?tenant=default{q}"), None);
        page["connections"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["backend"].as_str().unwrap().to_owned())
            .collect()
    };
    let mut all = listed("");
    all.sort();
    let mut want = vec![a.addr.to_string(), gone.clone()];
    want.sort();
    assert_eq!(all, want, "the listing names each connection's backend");
    assert_eq!(listed(&format!("&backend={gone}")), [gone.as_str()]);
    let killed = r.ok(
        "POST",
        "/v1/connections/kill",
        Some(json!({ "tenant": "default", "backend": gone })),
    );
    assert_eq!(killed["killed"], 1, "{killed}");
    // The removed backend's connection is cut, the other one is not.
    let which = conns.iter_mut().map(still_echoes).collect::<Vec<_>>();
    assert_eq!(which.iter().filter(|up| !**up).count(), 1, "{which:?}");
    assert!(daemon_util::wait_until(Duration::from_secs(10), || {
        listed("") == [a.addr.to_string()]
    }));
    r.shutdown();
}
