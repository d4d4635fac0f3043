//! Scheduling through the live daemon: what `sh` / `mh` do with clients
//! whose backend cannot take them, and that they map clients the same way
//! in every process started from the same config.

mod daemon_util;

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::time::Duration;

use daemon_util::*;
use weir::config::Protocol;
use weir::control::Control;
use weir::daemon::Daemon;

const T: Duration = Duration::from_secs(10);

/// A connection to `vip` from the loopback address `127.0.0.<host>` (sh
/// and mh hash the client address; loopback answers the whole /8).
fn connect_from(host: u8, vip: SocketAddr) -> std::io::Result<TcpStream> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    let src = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, host)), 0);
    s.bind(&src.into())?;
    s.connect_timeout(&vip.into(), T)?;
    let s: TcpStream = s.into();
    s.set_read_timeout(Some(T))?;
    Ok(s)
}

/// Whether one round trip from `127.0.0.<host>` echoes; the stream stays
/// open when it did.
fn echo_from(host: u8, vip: SocketAddr) -> Option<TcpStream> {
    let mut s = connect_from(host, vip).ok()?;
    let mut b = [0u8; 2];
    (s.write_all(b"hi").is_ok() && s.read_exact(&mut b).is_ok() && &b == b"hi").then_some(s)
}

/// Live connections (active + inactive) on the backends of `name`.
fn live(c: &dyn Control, name: &str) -> u64 {
    c.services()
        .into_iter()
        .filter(|s| s.name == name)
        .flat_map(|s| s.backends)
        .map(|b| b.active_conns + b.inactive_conns)
        .sum()
}

/// docs/sched.md: without fallback, a client whose `sh` / `mh` backend
/// cannot take it is refused; with the fallback flag it is served elsewhere. It used to go to the first usable backend in
/// list order, so every displaced client landed on one backend.
#[test]
fn sh_and_mh_refuse_a_client_whose_backend_is_at_its_limit() {
    for kind in ["sh", "mh"] {
        let (a, b) = (Echo::start(), Echo::start());
        // The limited backend last: the old fallback took the first usable
        // one, `a`, so a refusal is visible as "no new accept anywhere".
        let mut limited = backend(b.addr, 1);
        limited.max_connections = 1;
        let d = Daemon::start(
            config(vec![service(
                kind,
                Protocol::Tcp,
                kind,
                vec![backend(a.addr, 1), limited],
            )]),
            None,
        )
        .unwrap();
        let c = d.control();
        let vip = d.service_addr("default", kind).unwrap();
        // Find two client addresses that map to the limited backend.
        let mut on_b = Vec::new();
        for host in 2..=200u8 {
            let before = b.accepted.load(std::sync::atomic::Ordering::Relaxed);
            let s = echo_from(host, vip).expect("an idle backend serves");
            drop(s);
            assert!(
                wait_until(T, || live(&*c, kind) == 0),
                "{kind}: closed connection not settled"
            );
            if b.accepted.load(std::sync::atomic::Ordering::Relaxed) > before {
                on_b.push(host);
                if on_b.len() == 2 {
                    break;
                }
            }
        }
        assert_eq!(on_b.len(), 2, "{kind}: no two clients on one backend");
        let _hold = echo_from(on_b[0], vip).expect("first client of the limited backend");
        let (acc_a, acc_b) = (
            a.accepted.load(std::sync::atomic::Ordering::Relaxed),
            b.accepted.load(std::sync::atomic::Ordering::Relaxed),
        );
        assert!(
            echo_from(on_b[1], vip).is_none(),
            "{kind}: a client of a full backend was served elsewhere"
        );
        assert_eq!(
            (
                a.accepted.load(std::sync::atomic::Ordering::Relaxed),
                b.accepted.load(std::sync::atomic::Ordering::Relaxed)
            ),
            (acc_a, acc_b),
            "{kind}: the refused client reached a backend"
        );
        assert_eq!(
            c.global_stats().refused.get("backend_limit").copied(),
            Some(1),
            "{kind}: {:?}",
            c.global_stats().refused
        );
        // With `sh_fallback` / `mh_fallback` (ipvsadm's flags) the same
        // client is served by the other backend.
        let mut spec = c.running_config().services[0].clone();
        if kind == "sh" {
            spec.options.sh_fallback = true;
        } else {
            spec.options.mh_fallback = true;
        }
        c.edit_service("default", kind, spec).unwrap();
        let _served = echo_from(on_b[1], vip).expect("fallback serves the client");
        assert_eq!(
            a.accepted.load(std::sync::atomic::Ordering::Relaxed),
            acc_a + 1,
            "{kind}: the fallback went to the other backend"
        );
        d.shutdown();
    }
}

/// A connection refused because the flow table is full is counted once,
/// as `table_full`, against its tenant; it used to be counted as
/// `backend_unreachable` too.
#[test]
fn a_table_full_refusal_is_counted_once() {
    let e = Echo::start();
    let mut cfg = config(vec![service(
        "one",
        Protocol::Tcp,
        "rr",
        vec![backend(e.addr, 1)],
    )]);
    // A shared table capped at 64 entries.
    cfg.daemon.shared_table_entries = 1;
    cfg.daemon.max_shared_table_entries = 64;
    let d = Daemon::start(cfg, None).unwrap();
    let c = d.control();
    let vip = d.service_addr("default", "one").unwrap();
    let mut held = Vec::new();
    while let Some(s) = (held.len() < 200).then(|| echo_from(1, vip)).flatten() {
        held.push(s);
    }
    assert!(held.len() < 200, "the table never filled");
    let refused = c.global_stats().refused;
    assert_eq!(
        refused,
        [("table_full".to_owned(), 1)].into_iter().collect(),
        "{refused:?}"
    );
    let tenant = c.tenants().into_iter().find(|t| t.spec.name == "default");
    assert_eq!(tenant.map(|t| t.refused), Some(1));
    d.shutdown();
}

/// docs/sched.md: a persistence template does not expire while connections
/// it created are alive. A connection held past the persistence timeout
/// used to let the template lapse, so a neighbour in the same /24 went to
/// another backend.
#[test]
fn a_persistence_template_lives_while_its_connections_do() {
    let (a, b) = (Echo::start(), Echo::start());
    let mut svc = service(
        "p",
        Protocol::Tcp,
        "rr",
        vec![backend(a.addr, 1), backend(b.addr, 1)],
    );
    svc.persistence = "1s".parse().unwrap();
    svc.persistence_netmask = Some("255.255.255.0".into());
    let d = Daemon::start(config(vec![svc]), None).unwrap();
    let vip = d.service_addr("default", "p").unwrap();
    let backends = [&a, &b];
    let count = || backends.map(|e| e.accepted.load(std::sync::atomic::Ordering::Relaxed));
    let _held = echo_from(2, vip).expect("first client served");
    let first = count();
    let on_a = first[0] == 1;
    // The template's timeout has to pass for this test to mean anything:
    // twice the persistence plus one expiry round of the flow table.
    std::thread::sleep(Duration::from_millis(3_200));
    let _next = echo_from(3, vip).expect("neighbour served");
    let now = count();
    assert_eq!(
        (now[0] - first[0], now[1] - first[1]),
        if on_a { (1, 0) } else { (0, 1) },
        "the neighbour left the held connection's backend"
    );
    d.shutdown();
}

/// A second daemon (or any process with `SO_REUSEPORT`) used to join the
/// listening group of a service address and take a share of its
/// connections; now binding an address another socket serves is refused.
#[test]
fn a_service_address_served_elsewhere_is_refused() {
    let e = Echo::start();
    for proto in [Protocol::Tcp, Protocol::Udp] {
        let first = Daemon::start(
            config(vec![service("s", proto, "rr", vec![backend(e.addr, 1)])]),
            None,
        )
        .unwrap();
        let vip = first.service_addr("default", "s").unwrap();
        let mut taken = service("s", proto, "rr", vec![backend(e.addr, 1)]);
        taken.listen = vip;
        let Err(err) = Daemon::start(config(vec![taken.clone()]), None) else {
            panic!("{proto:?}: a second daemon joined the first one's address");
        };
        let msg = format!("{err:#}");
        assert!(msg.contains("another process serves this address"), "{msg}");
        // The first one's own re-add of the address (delete, add) works.
        let c = first.control();
        c.delete_service("default", "s").unwrap();
        c.add_service(taken.clone()).unwrap();
        first.shutdown();

        // Any socket with SO_REUSEPORT, held by this test.
        let (ty, p) = match proto {
            Protocol::Tcp => (socket2::Type::STREAM, socket2::Protocol::TCP),
            Protocol::Udp => (socket2::Type::DGRAM, socket2::Protocol::UDP),
        };
        let other = socket2::Socket::new(socket2::Domain::IPV4, ty, Some(p)).unwrap();
        other.set_reuse_port(true).unwrap();
        other
            .bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
            .unwrap();
        if proto == Protocol::Tcp {
            other.listen(16).unwrap();
        }
        taken.listen = other.local_addr().unwrap().as_socket().unwrap();
        let Err(err) = Daemon::start(config(vec![taken]), None) else {
            panic!("{proto:?}: joined a foreign SO_REUSEPORT socket");
        };
        assert!(format!("{err:#}").contains("another process serves this address"));
    }
}

/// A connection from `127.0.0.<host>` to `127.0.0.<dest>:<port>`.
fn echo_between(host: u8, dest: u8, port: u16) -> Option<TcpStream> {
    echo_from(
        host,
        SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, dest)), port),
    )
}

/// `tcp_max_connections_per_client`: the client over its cap is reset and
/// counted as `tcp_client_limit` while another client is served; closing one
/// of its connections gives the place back.
#[test]
fn tcp_connections_per_client_are_capped() {
    let e = Echo::start();
    let mut s = service("capped", Protocol::Tcp, "rr", vec![backend(e.addr, 1)]);
    s.options.tcp_max_connections_per_client = 2;
    let d = Daemon::start(config(vec![s]), None).unwrap();
    let c = d.control();
    let vip = d.service_addr("default", "capped").unwrap();
    let refused = |c: &dyn Control| {
        c.global_stats()
            .refused
            .get("tcp_client_limit")
            .copied()
            .unwrap_or(0)
    };
    let first = echo_from(2, vip).expect("first connection");
    let _second = echo_from(2, vip).expect("second connection");
    let accepted = e.accepted.load(std::sync::atomic::Ordering::Relaxed);
    assert!(echo_from(2, vip).is_none(), "third connection was served");
    assert_eq!(refused(&*c), 1);
    assert_eq!(
        e.accepted.load(std::sync::atomic::Ordering::Relaxed),
        accepted,
        "the refused connection reached the backend"
    );
    // Another client is not affected.
    let _other = echo_from(3, vip).expect("another client is served");
    assert_eq!(live(&*c, "capped"), 3);
    // Closing one connection of the capped client returns its place. The
    // backend's count goes down when weir closes the connection, before
    // its task gives the client's place back; `active_conns` after.
    drop(first);
    assert!(
        wait_until(T, || live(&*c, "capped") == 2),
        "closed connection not settled"
    );
    assert!(
        wait_until(T, || c.global_stats().active_conns == 2),
        "{:?}",
        c.global_stats()
    );
    let _again = echo_from(2, vip).expect("a place came back after a close");
    assert_eq!(refused(&*c), 1);
    assert!(echo_from(2, vip).is_none(), "the cap holds again");
    assert_eq!(refused(&*c), 2);
    d.shutdown();
}

/// `dh` on a wildcard listener keys on the local address the client
/// dialled: each destination always reaches the same backend, whoever the
/// client, and different destinations spread over the backends.
#[test]
fn dh_on_a_wildcard_listener_maps_each_destination_to_one_backend() {
    let (a, b) = (Echo::start(), Echo::start());
    let mut s = service(
        "dh",
        Protocol::Tcp,
        "dh",
        vec![backend(a.addr, 1), backend(b.addr, 1)],
    );
    s.listen = "0.0.0.0:0".parse().unwrap();
    let d = Daemon::start(config(vec![s]), None).unwrap();
    let port = d.service_addr("default", "dh").unwrap().port();
    let accepted = || {
        (
            a.accepted.load(std::sync::atomic::Ordering::Relaxed),
            b.accepted.load(std::sync::atomic::Ordering::Relaxed),
        )
    };
    let mut on_a = 0;
    for dest in 1..=16u8 {
        let mut seen = Vec::new();
        for host in [2u8, 3, 4] {
            let before = accepted();
            let _s = echo_between(host, dest, port).expect("served");
            let after = accepted();
            seen.push(after.0 > before.0);
            assert_eq!(after.0 + after.1, before.0 + before.1 + 1);
        }
        assert!(
            seen.iter().all(|&x| x == seen[0]),
            "destination 127.0.0.{dest} went to both backends: {seen:?}"
        );
        on_a += usize::from(seen[0]);
    }
    assert!(
        (1..16).contains(&on_a),
        "16 destinations all on one backend"
    );
    d.shutdown();
}

/// The same for UDP: a session on a wildcard listener is scheduled on the
/// local address the client sent to, as TCP's connections are. It used to
/// be scheduled on the service's address (`0.0.0.0`), so every destination
/// hashed into one `dh` bucket and went to one backend.
#[test]
fn udp_dh_on_a_wildcard_listener_keys_on_the_address_sent_to() {
    let (a, b) = (udp_echo(), udp_echo());
    let mut s = service(
        "udh",
        Protocol::Udp,
        "dh",
        vec![backend(a, 1), backend(b, 1)],
    );
    s.listen = "0.0.0.0:0".parse().unwrap();
    let d = Daemon::start(config(vec![s]), None).unwrap();
    let c = d.control();
    let port = d.service_addr("default", "udh").unwrap().port();
    let client = std::net::UdpSocket::bind("127.0.0.5:0").unwrap();
    client.set_read_timeout(Some(T)).unwrap();
    let mut buf = [0u8; 64];
    for dest in 1..=16u8 {
        let vip = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, dest)), port);
        client.send_to(b"hi", vip).unwrap();
        let (n, from) = client.recv_from(&mut buf).unwrap();
        assert_eq!((&buf[..n], from), (&b"hi"[..], vip));
    }
    let sessions = c
        .connections(&weir::control::ConnFilter::default(), None, 100)
        .unwrap()
        .connections;
    assert_eq!(sessions.len(), 16);
    let on_a = sessions
        .iter()
        .filter(|x| x.backend == a.to_string())
        .count();
    assert!(
        (1..16).contains(&on_a),
        "16 destinations all on one backend: {on_a} on the first"
    );
    d.shutdown();
}

/// `fo` sends every connection to the highest weight; draining it fails
/// over to the next; `ovf` refuses once every backend is above its weight.
#[test]
fn fo_fails_over_and_ovf_overflows() {
    let (a, b) = (Echo::start(), Echo::start());
    let d = Daemon::start(
        config(vec![
            service(
                "fo",
                Protocol::Tcp,
                "fo",
                vec![backend(a.addr, 1), backend(b.addr, 5)],
            ),
            service(
                "ovf",
                Protocol::Tcp,
                "ovf",
                vec![backend(a.addr, 1), backend(b.addr, 2)],
            ),
        ]),
        None,
    )
    .unwrap();
    let c = d.control();
    let count = |e: &Echo| e.accepted.load(std::sync::atomic::Ordering::Relaxed);
    let fo = d.service_addr("default", "fo").unwrap();
    for _ in 0..4 {
        assert!(echo_once(fo, b"fo"));
    }
    assert_eq!((count(&a), count(&b)), (0, 4));
    c.edit_backend(
        "default",
        "fo",
        &b.addr.to_string(),
        weir::control::BackendPatch {
            weight: Some(0),
            drain: None,
        },
    )
    .unwrap();
    assert!(echo_once(fo, b"fo"));
    assert_eq!((count(&a), count(&b)), (1, 4));
    // ovf: b (weight 2) takes up to 3 active connections, then a (weight
    // 1) up to 2, then nothing.
    let ovf = d.service_addr("default", "ovf").unwrap();
    let held: Vec<TcpStream> = (0..5).map(|_| held(ovf)).collect();
    assert_eq!((count(&a), count(&b)), (3, 7));
    assert!(!echo_once(ovf, b"full"), "ovf served above every weight");
    assert_eq!(c.global_stats().refused.get("no_backend").copied(), Some(1));
    drop(held);
    d.shutdown();
}

/// `ovf` skips a backend at its `max_connections` and overflows to the
/// next weight, as IPVS's `ip_vs_ovf.c` skips an overloaded destination
/// (its connection limit reached). It used to refuse the client while the
/// lower-weight backend was idle.
#[test]
fn ovf_overflows_past_a_backend_at_its_connection_limit() {
    let (a, b) = (Echo::start(), Echo::start());
    let mut top = backend(a.addr, 5);
    top.max_connections = 1;
    let d = Daemon::start(
        config(vec![service(
            "ovf",
            Protocol::Tcp,
            "ovf",
            vec![top, backend(b.addr, 1)],
        )]),
        None,
    )
    .unwrap();
    let c = d.control();
    let count = |e: &Echo| e.accepted.load(std::sync::atomic::Ordering::Relaxed);
    let vip = d.service_addr("default", "ovf").unwrap();
    let _first = held(vip);
    assert_eq!((count(&a), count(&b)), (1, 0));
    // `a` is at its limit (1) though under its weight (5): `b` (weight 1,
    // idle) takes the next client.
    let second = echo_once(vip, b"next");
    assert!(
        second,
        "refused ({:?}) while a backend could take it",
        c.global_stats().refused
    );
    assert_eq!((count(&a), count(&b)), (1, 1));
    d.shutdown();
}

/// `wlc` and `rr` over three backends, the middle one held at its
/// `max_connections`: new connections spread over the other two by the
/// scheduler's own rule, as IPVS's skip a destination at its threshold
/// (`OVERLOAD`). They used to go to the first usable backend in list order
/// whenever the scheduler picked the full one: 5, 1, 1 for `wlc` and
/// 4, 1, 2 for `rr` after seven connections, not 3, 1, 3.
#[test]
fn overflow_of_a_full_backend_is_spread_by_the_scheduler() {
    for kind in ["wlc", "rr"] {
        let echoes = [Echo::start(), Echo::start(), Echo::start()];
        let mut limited = backend(echoes[1].addr, 1);
        limited.max_connections = 1;
        let d = Daemon::start(
            config(vec![service(
                kind,
                Protocol::Tcp,
                kind,
                vec![
                    backend(echoes[0].addr, 1),
                    limited,
                    backend(echoes[2].addr, 1),
                ],
            )]),
            None,
        )
        .unwrap();
        let c = d.control();
        let vip = d.service_addr("default", kind).unwrap();
        // Held open, one after the other, so each pick sees the loads
        // (ESTABLISHED: an echo went through) of the ones before.
        let open: Vec<TcpStream> = (0..7).map(|_| held(vip)).collect();
        let counts = echoes
            .each_ref()
            .map(|e| e.accepted.load(std::sync::atomic::Ordering::Relaxed));
        // wlc: A, B, C, then A and C in turn (A first on ties); rr: A, B,
        // C, then A and C in turn.
        assert_eq!(counts, [3, 1, 3], "{kind}");
        assert!(
            c.global_stats().refused.is_empty(),
            "{kind}: {:?}",
            c.global_stats().refused
        );
        drop(open);
        d.shutdown();
    }
}

/// The daemon reports scheduler flags and the persistence mask, `weir list`
/// prints them as `ipvsadm -Ln` does, and `weir save` writes back every new
/// key so that the saved file loads to the same services.
#[test]
fn list_and_save_carry_scheduler_flags() {
    let e = Echo::start();
    let mut s = service("flags", Protocol::Tcp, "sh", vec![backend(e.addr, 1)]);
    s.options.sh_fallback = true;
    s.options.sh_port = true;
    s.options.tcp_max_connections_per_client = 7;
    s.persistence = "300s".parse().unwrap();
    s.persistence_netmask = Some("255.255.255.0".into());
    let mut m = service("maglev", Protocol::Tcp, "mh", vec![backend(e.addr, 1)]);
    m.options.mh_port = true;
    m.options.mh_table_size = Some(251);
    let d = Daemon::start(config(vec![s, m]), None).unwrap();
    let c = d.control();
    let vip = d.service_addr("default", "flags").unwrap();
    let status = c.services();
    assert_eq!(status[0].sched_flags, ["sh-fallback", "sh-port"]);
    assert_eq!(status[1].sched_flags, ["mh-port"]);
    let list = weir::cli::render::render_list(&status, weir::cli::render::ListMode::Plain, false);
    let want = format!(
        "TCP  {vip} sh (sh-fallback,sh-port) persistent 300 mask 255.255.255.0 [default/flags]"
    );
    assert!(list.lines().any(|l| l == want), "{list}");
    assert!(list.contains(" mh (mh-port) [default/maglev]"), "{list}");
    // weir save: running config -> TOML -> parsed again.
    let running = c.running_config();
    let text = weir::cli::config_to_toml(&running).unwrap();
    let back = weir::config::parse(&text, "saved.toml").unwrap_or_else(|e| panic!("{e:?}\n{text}"));
    assert_eq!(back.services, running.services, "{text}");
    assert!(
        text.contains("sh_port = true") && text.contains("mh_table_size = 251"),
        "{text}"
    );
    d.shutdown();
}
