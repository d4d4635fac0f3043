//! Packet mode's configuration and operator surface against the real
//! daemon (issue 12): packet services (`forward` other than proxy) are
//! validated by start, the API and `weir check` as by the file; `[packet]`
//! and a packet service's `forward` and `sloppy_tcp` survive `weir save`;
//! a reload cannot change `[packet]` or a live service's `forward`.
//!
//! The tests that run packet mode start the daemon in a network namespace
//! of their own (its `lo`), so nothing attaches to the host's interfaces;
//! they need root and skip, saying so, without it.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use serde_json::json;

use weir::cli::client::CliError;
use weir::config::{Forward, PacketConfig, PacketIo, Protocol};
use weir::daemon::Daemon;

mod cli_util;
mod daemon_util;
use daemon_util::admin::{Running, TOKEN};
use daemon_util::process::free_addr;
use daemon_util::{Echo, backend, config, echo_once, service};

/// Run `f` on a thread in a new network namespace with its `lo` up (the
/// daemon's threads, started from it, live there too); `None` (after saying
/// why) where this process may not make one.
fn in_own_netns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    std::thread::spawn(move || {
        if let Err(e) = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET) {
            eprintln!("skipped: a network namespace of its own needs root ({e})");
            return None;
        }
        let up = std::process::Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status();
        if !up.as_ref().is_ok_and(|s| s.success()) {
            eprintln!("skipped: `ip link set lo up` failed in the new namespace: {up:?}");
            return None;
        }
        Some(f())
    })
    .join()
    .unwrap_or_else(|e| std::panic::resume_unwind(e))
}

/// `[packet]` on `lo`, which every network namespace has.
fn packet_on_lo() -> PacketConfig {
    PacketConfig {
        interfaces: vec!["lo".into()],
        backend_interfaces: Vec::new(),
        io: PacketIo::Afpacket,
        // Not 127.0.0.1, where the tests' VIPs are (a VIP on a local address
        // must keep out of fnat_ports).
        local_addresses: vec!["127.0.0.9".parse().unwrap(), "::1".parse().unwrap()],
        fnat_ports: "40000-40999".parse().unwrap(),
        workers: 1,
        xdp_ring_size: weir::config::DEFAULT_XDP_RING_SIZE,
    }
}

/// A loopback address no one listens on (bound once to find it, then freed).
/// Nothing accepts on `addr`, and it is free to bind.
fn nothing_listens(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_err()
        && TcpListener::bind(addr).is_ok()
}

/// Without `[packet]`, a packet service stops the start (nothing opened
/// for it) with what to add.
#[test]
fn start_refuses_a_packet_service_without_packet_section() {
    let echo = Echo::start();
    let vip = free_addr();
    let mut nat = service("nat", Protocol::Tcp, "rr", vec![backend(echo.addr, 1)]);
    nat.listen = vip;
    nat.forward = Forward::Nat;
    let err = Daemon::start(config(vec![nat]), None).expect_err("a packet service is refused");
    let msg = format!("{err:#}");
    assert!(
        msg.contains(
            "service[0].forward: forward = \"nat\" needs packet mode: add a [packet] section"
        ),
        "{msg}"
    );
    assert!(nothing_listens(vip), "{vip} was opened");
}

/// `POST /v1/services` runs the file's checks (400, with the key; here
/// also that there is no `[packet]`); nothing of a refused service is left.
/// `PUT` cannot change `forward`.
#[test]
fn api_validates_packet_services() {
    let echo = Echo::start();
    let mut cfg = config(vec![service(
        "web",
        Protocol::Tcp,
        "rr",
        vec![backend(echo.addr, 1)],
    )]);
    cfg.daemon.workers = 1;
    let r = Running::start(cfg, None);
    let vip = free_addr();
    let body = |forward: &str, extra: serde_json::Value| {
        let mut b = json!({
            "name": "pkt", "protocol": "tcp", "listen": vip.to_string(),
            "forward": forward, "scheduler": "rr",
            "backend": [{ "address": echo.addr.to_string() }],
        });
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let cases = [
        (
            body("nat", json!({ "sloppy_tcp": true })),
            400,
            "forward: forward = \"nat\" needs packet mode: add a [packet] section",
        ),
        (body("masq", json!({})), 400, "unknown variant `masq`"),
        (
            body("dr", json!({})),
            400,
            "backend[0].address: dr only rewrites the MAC address",
        ),
        (
            body("nat", json!({ "connect_timeout": "1s" })),
            400,
            "connect_timeout: is a proxy option",
        ),
        (
            body("proxy", json!({ "sloppy_tcp": true })),
            400,
            "sloppy_tcp: only applies to packet services",
        ),
        (
            body("nat", json!({ "listen": "0.0.0.0:80" })),
            400,
            "listen: 0.0.0.0:80 is not a virtual address",
        ),
    ];
    for (b, want, words) in cases {
        let (status, message) = r.status("POST", "/v1/services", Some(b.clone()));
        assert_eq!(status, want, "{b}: {message}");
        assert!(message.contains(words), "{b}: {message}");
        assert!(nothing_listens(vip), "{b}: {vip} was opened");
        let names: Vec<_> = r
            .ok("GET", "/v1/services", None)
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["name"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(names, ["web"], "{b}");
    }
    // `forward` cannot change on a live service (its connections are
    // sockets); the service and its connections stay as they were.
    let path = "/v1/services/default/web";
    let mut spec = r.ok("GET", path, None);
    assert_eq!(spec.get("forward"), None, "proxy is not written: {spec}");
    spec["forward"] = json!("fnat");
    let (status, message) = r.status("PUT", path, Some(spec));
    assert_eq!(status, 400, "{message}");
    assert!(
        message.contains("forward cannot change on a live service"),
        "{message}"
    );
    let web = r.d().service_addr("default", "web").unwrap();
    assert!(echo_once(web, b"still proxied"));
}

/// Without `[packet]` the API says what is missing.
#[test]
fn api_packet_service_without_packet_section() {
    let r = Running::start(config(Vec::new()), None);
    let (status, message) = r.status(
        "POST",
        "/v1/services",
        Some(json!({
            "name": "pkt", "protocol": "udp", "listen": "127.0.0.1:5353", "forward": "dr",
            "backend": [{ "address": "127.0.0.2:5353" }],
        })),
    );
    assert_eq!(status, 400, "{message}");
    assert!(
        message.contains("forward: forward = \"dr\" needs packet mode: add a [packet] section"),
        "{message}"
    );
}

/// `weir save` writes `[packet]` as the daemon runs it, and the saved file
/// parses back to the same configuration.
#[test]
fn save_round_trips_the_packet_section() {
    in_own_netns(|| {
        let echo = Echo::start();
        let mut nat = service("nat", Protocol::Tcp, "rr", vec![backend(echo.addr, 1)]);
        nat.listen = "127.0.0.1:8080".parse().unwrap();
        nat.forward = Forward::Nat;
        nat.options.sloppy_tcp = true;
        let web = service("web", Protocol::Tcp, "rr", vec![backend(echo.addr, 1)]);
        let mut cfg = config(vec![nat.clone(), web]);
        cfg.packet = Some(packet_on_lo());
        let r = Running::start(cfg.clone(), None);
        let (code, saved, err) = cli_util::run(&r.url, TOKEN, &["save"]);
        assert_eq!(code, ExitCode::SUCCESS, "{err}");
        assert!(saved.contains("[packet]\n"), "{saved}");
        assert!(saved.contains("fnat_ports = \"40000-40999\""), "{saved}");
        assert_eq!(saved.matches("forward = \"nat\"").count(), 1, "{saved}");
        assert_eq!(saved.matches("sloppy_tcp = true").count(), 1, "{saved}");
        let back =
            weir::config::parse(&saved, "saved.toml").unwrap_or_else(|e| panic!("{e:?}\n{saved}"));
        assert_eq!(back.packet, cfg.packet, "{saved}");
        let find = |name: &str| back.services.iter().find(|s| s.name == name).unwrap();
        assert_eq!(*find("nat"), nat, "{saved}");
        assert_eq!(find("web").forward, Forward::Proxy);
        assert!(!find("web").options.sloppy_tcp);
    });
}

fn from_file(text: &str) -> (Running, tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weir.toml");
    std::fs::write(&path, text).unwrap();
    let cfg = weir::config::load(&path).unwrap_or_else(|e| panic!("{e:?}\n{text}"));
    (Running::start(cfg, Some(path.clone())), dir, path)
}

fn reload_errors(r: &Running) -> Vec<String> {
    match r.api("POST", "/v1/reload", None) {
        Err(CliError::Api {
            status,
            errors,
            message,
        }) => {
            assert_eq!(status, 400, "{message}");
            errors
        }
        other => panic!("expected a refused reload, got {other:?}"),
    }
}

/// A reload may keep `[packet]` as it is (and change the rest), but not
/// change, add or remove it, nor a live service's `forward`.
#[test]
fn reload_refuses_packet_section_changes() {
    in_own_netns(reload_refuses_packet_section_changes_here);
}

fn reload_refuses_packet_section_changes_here() {
    let echo = Echo::start();
    let packet = "[daemon]\nworkers = 2\n[packet]\ninterfaces = [\"lo\"]\n";
    let svc = |name: &str, extra: &str| {
        format!(
            "[[service]]\nname = \"{name}\"\nprotocol = \"tcp\"\nlisten = \"127.0.0.1:0\"\n{extra}\n\
             [[service.backend]]\naddress = \"{}\"\n",
            echo.addr
        )
    };
    let (r, _dir, path) = from_file(&format!("{packet}{}", svc("web", "")));
    // Unchanged [packet], a new proxy service: applied.
    std::fs::write(
        &path,
        format!("{packet}{}{}", svc("web", ""), svc("two", "")),
    )
    .unwrap();
    let ok = r.ok("POST", "/v1/reload", None);
    assert_eq!(ok["reloaded"], true, "{ok}");
    let two = r
        .d()
        .service_addr("default", "two")
        .expect("added by reload");
    assert!(echo_once(two, b"reloaded"));

    let both = format!("{}{}", svc("web", ""), svc("two", ""));
    for changed in [
        "[daemon]\nworkers = 2\n[packet]\ninterfaces = [\"lo\"]\nio = \"xdp\"\n".to_owned(),
        "[daemon]\nworkers = 2\n".to_owned(),
    ] {
        std::fs::write(&path, format!("{changed}{both}{}", svc("three", ""))).unwrap();
        let errors = reload_errors(&r);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].contains("[packet] differs") && errors[0].contains("restart weir"),
            "{errors:?}"
        );
        assert_eq!(
            r.d().service_addr("default", "three"),
            None,
            "applied in part"
        );
    }
    // Changing a live service's forward by reload: refused as by the API.
    let web = r.d().service_addr("default", "web").unwrap();
    let web_nat = format!(
        "[[service]]\nname = \"web\"\nprotocol = \"tcp\"\nlisten = \"{web}\"\nforward = \"nat\"\n\
         [[service.backend]]\naddress = \"{}\"\n",
        echo.addr
    );
    std::fs::write(&path, format!("{packet}{web_nat}{}", svc("two", ""))).unwrap();
    let errors = reload_errors(&r);
    assert!(
        errors.iter().any(|e| e.contains("forward cannot change")),
        "{errors:?}"
    );
    assert!(echo_once(two, b"still here") && echo_once(web, b"still proxied"));
}

/// Run the `weir` binary with `args`; (exit code, stdout, stderr).
fn run_weir(args: &[&str]) -> (Option<i32>, String, String) {
    let mut argv = vec![env!("CARGO_BIN_EXE_weir")];
    argv.extend_from_slice(args);
    run_cmd(&argv)
}

/// `weir check` names the interface that is missing (and that names are
/// per network namespace) with the file's other packet-mode problems, each
/// with its line; a good file passes.
#[test]
fn check_reports_packet_problems_with_lines() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[packet]\ninterfaces = [\"lo\", \"weir-nosuch0\"]\n\
         [[service]]\nname = \"web\"\nprotocol = \"tcp\"\nlisten = \"10.0.0.100:80\"\n\
         forward = \"dr\"\n[[service.backend]]\naddress = \"10.0.1.2:8080\"\n\
         [[service]]\nname = \"f\"\nprotocol = \"udp\"\nlisten = \"10.0.0.100:53\"\n\
         forward = \"fnat\"\n",
    )
    .unwrap();
    let (code, _, err) = run_weir(&["check", "--config", bad.to_str().unwrap()]);
    assert_eq!(code, Some(1), "{err}");
    let at = bad.display();
    for line in [
        format!(
            "{at}:2: packet.interfaces[1]: interface \"weir-nosuch0\" does not exist in this \
             network namespace (interface names are per network namespace"
        ),
        format!("{at}:9: service[0].backend[0].address: dr only rewrites the MAC address"),
        format!("{at}:14: service[1].forward: fnat rewrites the source"),
        format!("{at}: 3 error(s)"),
    ] {
        assert!(
            err.lines().any(|l| l.starts_with(&line)),
            "no {line:?} in\n{err}"
        );
    }
    let good = dir.path().join("good.toml");
    std::fs::write(
        &good,
        "[packet]\ninterfaces = [\"lo\"]\nlocal_addresses = [\"10.0.1.1\"]\n\
         [[service]]\nname = \"f\"\nprotocol = \"udp\"\nlisten = \"10.0.0.100:53\"\n\
         forward = \"fnat\"\n[[service.backend]]\naddress = \"10.0.1.2:5353\"\n",
    )
    .unwrap();
    let (code, out, err) = run_weir(&["check", "--config", good.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("OK (0 tenant(s), 1 service(s), 1 backend(s))"),
        "{out}"
    );
}

/// Without root (here: as `nobody`, through `setpriv`, when the test runs
/// as root), `weir run` with packet services fails and says what is
/// missing, rather than starting half of packet mode.
#[test]
fn run_without_root_says_what_is_missing() {
    use std::os::unix::fs::PermissionsExt as _;
    let root = rustix::process::geteuid().is_root();
    if root
        && std::process::Command::new("setpriv")
            .arg("--version")
            .output()
            .is_err()
    {
        eprintln!("skipped: needs setpriv (util-linux) to drop root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let cfg = dir.path().join("weir.toml");
    std::fs::write(
        &cfg,
        "[daemon]\nworkers = 1\n[packet]\ninterfaces = [\"lo\"]\n\
         [[service]]\nname = \"web\"\nprotocol = \"tcp\"\nlisten = \"10.0.0.100:80\"\n\
         forward = \"nat\"\n[[service.backend]]\naddress = \"10.0.1.2:80\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&cfg, std::fs::Permissions::from_mode(0o644)).unwrap();
    let weir = env!("CARGO_BIN_EXE_weir");
    let cfg = cfg.to_str().unwrap();
    let (code, _out, err) = if root {
        run_cmd(&[
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            weir,
            "run",
            "--config",
            cfg,
        ])
    } else {
        run_weir(&["run", "--config", cfg])
    };
    assert_ne!(code, Some(0), "weir run succeeded without root:\n{err}");
    assert!(
        code.is_some(),
        "weir run did not exit within the bound:\n{err}"
    );
    assert!(
        err.contains("weir run: packet mode:") && err.contains("needs root"),
        "the error does not say what is missing:\n{err}"
    );
}

/// [`run_weir`] for any command.
fn run_cmd(argv: &[&str]) -> (Option<i32>, String, String) {
    use std::io::Read as _;
    let mut child = std::process::Command::new(argv[0])
        .args(&argv[1..])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let code = daemon_util::process::exit_code_within(&mut child, Duration::from_secs(30));
    let (mut out, mut err) = (String::new(), String::new());
    let _ = child.stdout.take().unwrap().read_to_string(&mut out);
    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
    (code, out, err)
}
