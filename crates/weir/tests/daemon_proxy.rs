//! The daemon on loopback with real backends and clients: TCP (large
//! transfers with half-close, retry, slow reader), UDP, schedulers,
//! persistence, quiesce, health failover and tenant deletion.

mod daemon_util;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use daemon_util::*;
use weir::config::{HealthSpec, Protocol, TenantSpec};
use weir::control::{BackendPatch, ConnFilter, ConnInfo, Control};
use weir::daemon::{Daemon, DaemonHandle};

const T: Duration = Duration::from_secs(10);

fn conns_per_backend(c: &dyn Control, name: &str) -> Vec<u64> {
    c.services()
        .into_iter()
        .find(|s| s.name == name)
        .map(|s| s.backends.iter().map(|b| b.stats.conns).collect())
        .unwrap_or_default()
}

/// Every connection `c` lists (a page far larger than a test holds).
fn listed(c: &dyn Control) -> Vec<ConnInfo> {
    c.connections(&ConnFilter::default(), None, 1000)
        .unwrap()
        .connections
}

/// The virtual address of every connection `c` lists, sorted.
fn virtuals(c: &dyn Control) -> Vec<String> {
    let mut v: Vec<String> = listed(c).into_iter().map(|x| x.virtual_).collect();
    v.sort();
    v
}

/// A one-worker daemon holding `max_connections` in all, with tenants a
/// and b (`max_new_per_s` from `rates`, 0 for none), each with a UDP
/// service of its own (u-a, u-b) on one echo backend. The daemon and the
/// addresses of u-a and u-b.
fn udp_tenants_a_and_b(
    max_connections: u64,
    rates: [u64; 2],
) -> (DaemonHandle, std::net::SocketAddr, std::net::SocketAddr) {
    let b = udp_echo();
    let mut cfg = config(vec![]);
    cfg.daemon.workers = 1;
    cfg.daemon.max_connections = max_connections;
    for (t, rate) in [("a", rates[0]), ("b", rates[1])] {
        cfg.tenants.push(TenantSpec {
            name: t.into(),
            max_new_per_s: rate,
            ..Default::default()
        });
        let mut s = service(&format!("u-{t}"), Protocol::Udp, "rr", vec![backend(b, 1)]);
        s.tenant = t.into();
        cfg.services.push(s);
    }
    let d = Daemon::start(cfg, None).unwrap();
    let va = d.service_addr("a", "u-a").unwrap();
    let vb = d.service_addr("b", "u-b").unwrap();
    (d, va, vb)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn tcp_large_transfers_both_ways_with_half_close() {
    // Backend: read everything until the client's FIN, then answer with a
    // different large payload and close. Only works if weir passes the FIN
    // on while keeping the other direction open.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let baddr = l.local_addr().unwrap();
    const UP: usize = 8 << 20;
    const DOWN: usize = 6 << 20;
    let server = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        s.write_all(&pattern(DOWN, 7)).unwrap();
        got
    });
    let d = start_service("t", Protocol::Tcp, "rr", &[baddr]);
    let vip = d.service_addr("default", "t").unwrap();
    let mut c = TcpStream::connect(vip).unwrap();
    c.set_read_timeout(Some(T)).unwrap();
    let up = pattern(UP, 3);
    let writer = {
        let mut c2 = c.try_clone().unwrap();
        let up = up.clone();
        std::thread::spawn(move || {
            c2.write_all(&up).unwrap();
            c2.shutdown(Shutdown::Write).unwrap();
        })
    };
    let mut down = Vec::new();
    c.read_to_end(&mut down).unwrap();
    writer.join().unwrap();
    let got = server.join().unwrap();
    assert_eq!(got.len(), UP);
    assert!(got == up, "upstream bytes corrupted");
    assert_eq!(down.len(), DOWN);
    assert!(down == pattern(DOWN, 7), "downstream bytes corrupted");
    let control = d.control();
    assert!(wait_until(T, || control.global_stats().active_conns == 0));
    let g = control.global_stats();
    assert_eq!(g.stats.inbytes, UP as u64);
    assert_eq!(g.stats.outbytes, DOWN as u64);
    d.shutdown();
}

#[test]
fn a_backend_answer_with_its_fin_passes_on_and_the_client_may_still_send() {
    // The backend answers at once and half-closes, so its last bytes and
    // its FIN usually reach weir together: weir then sends them on with the
    // FIN in one segment. The client must still get every byte, then EOF,
    // and its own bytes sent after that must still reach the backend.
    // Sizes: below, at and above the 32 KiB copy buffer, and at the 64
    // KiB loopback segment.
    for len in [5usize, 32 * 1024, 64 * 1024, 200_000] {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let baddr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.set_read_timeout(Some(T)).unwrap();
            s.write_all(&pattern(len, 9)).unwrap();
            s.shutdown(Shutdown::Write).unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).unwrap();
            got
        });
        let d = start_service("t", Protocol::Tcp, "rr", &[baddr]);
        let vip = d.service_addr("default", "t").unwrap();
        let mut c = TcpStream::connect(vip).unwrap();
        c.set_read_timeout(Some(T)).unwrap();
        let mut down = Vec::new();
        c.read_to_end(&mut down).unwrap();
        assert_eq!(down.len(), len);
        assert!(
            down == pattern(len, 9),
            "downstream bytes corrupted ({len})"
        );
        c.write_all(b"after the backend's FIN").unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        let got = server.join().unwrap();
        assert_eq!(got, b"after the backend's FIN", "({len})");
        let control = d.control();
        assert!(wait_until(T, || control.global_stats().active_conns == 0));
        assert_eq!(control.global_stats().stats.outbytes, len as u64);
        d.shutdown();
    }
}

#[test]
fn many_small_round_trips_never_stall_and_close_cleanly() {
    // Request/response traffic is where weir skips the read that would
    // only return EAGAIN after a short read: a lost wakeup there shows up
    // as a round trip that never completes (the read times out).
    let echo = Echo::start();
    let d = start_service("pp", Protocol::Tcp, "rr", &[echo.addr]);
    let vip = d.service_addr("default", "pp").unwrap();
    let mut sent = 0u64;
    for conn in 0..4u8 {
        let mut c = TcpStream::connect(vip).unwrap();
        c.set_read_timeout(Some(T)).unwrap();
        let mut buf = vec![0u8; 70 * 1024];
        for i in 0..750usize {
            // 1 byte .. 69 KiB: below, at and above the 32 KiB copy buffer
            // and the 64 KiB loopback segment.
            let len = 1 + (i * 7919 + conn as usize * 104_729) % (69 * 1024);
            let msg = pattern(len, i as u8);
            c.write_all(&msg).unwrap();
            c.read_exact(&mut buf[..len])
                .unwrap_or_else(|e| panic!("round trip {i} of {len} bytes: {e}"));
            assert!(buf[..len] == msg[..], "round trip {i} corrupted");
            sent += len as u64;
        }
        // Our FIN reaches the backend, whose FIN comes back: a clean EOF,
        // not a reset, whichever side weir sees end first.
        c.shutdown(Shutdown::Write).unwrap();
        assert_eq!(c.read(&mut buf).unwrap(), 0);
    }
    let control = d.control();
    assert!(wait_until(T, || control.global_stats().active_conns == 0));
    let g = control.global_stats();
    assert_eq!((g.stats.inbytes, g.stats.outbytes), (sent, sent));
    d.shutdown();
}

#[test]
fn udp_echo_and_session_listing() {
    let b = udp_echo();
    let mut spec = service("u", Protocol::Udp, "rr", vec![backend(b, 1)]);
    spec.options.udp_responses = Some(2);
    let d = Daemon::start(config(vec![spec]), None).unwrap();
    let vip = d.service_addr("default", "u").unwrap();
    let c = UdpSocket::bind("127.0.0.1:0").unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 1500];
    c.send_to(b"one", vip).unwrap();
    let (n, from) = c.recv_from(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"one");
    assert_eq!(from, vip, "reply must come from the virtual address");
    let control = d.control();
    let listed = listed(&*control);
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].state, "UDP");
    assert_eq!(listed[0].client, c.local_addr().unwrap().to_string());
    // The second response ends the session (udp_responses = 2).
    c.send_to(b"two", vip).unwrap();
    let (n, _) = c.recv_from(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"two");
    assert!(wait_until(T, || control.global_stats().active_conns == 0));
    // A new datagram makes a new session.
    c.send_to(b"three", vip).unwrap();
    let (n, _) = c.recv_from(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"three");
    assert_eq!(control.global_stats().stats.conns, 2);
    d.shutdown();
}

#[test]
fn rr_and_wrr_distribute_by_weight() {
    let (a, b) = (Echo::start(), Echo::start());
    let d = Daemon::start(
        config(vec![
            service(
                "rr",
                Protocol::Tcp,
                "rr",
                vec![backend(a.addr, 1), backend(b.addr, 5)],
            ),
            service(
                "wrr",
                Protocol::Tcp,
                "wrr",
                vec![backend(a.addr, 1), backend(b.addr, 3)],
            ),
        ]),
        None,
    )
    .unwrap();
    let c = d.control();
    for (name, n) in [("rr", 20), ("wrr", 40)] {
        let vip = d.service_addr("default", name).unwrap();
        for _ in 0..n {
            assert!(echo_once(vip, b"x"));
        }
    }
    assert_eq!(conns_per_backend(&*c, "rr"), vec![10, 10]);
    assert_eq!(conns_per_backend(&*c, "wrr"), vec![10, 30]);
    d.shutdown();
}

#[test]
fn least_connection_schedulers_follow_weights_under_held_load() {
    let (a, b) = (Echo::start(), Echo::start());
    let mut services = Vec::new();
    for s in ["lc", "wlc", "sed", "nq", "p2c"] {
        services.push(service(
            s,
            Protocol::Tcp,
            s,
            vec![backend(a.addr, 1), backend(b.addr, 3)],
        ));
    }
    let d = Daemon::start(config(services), None).unwrap();
    let c = d.control();
    for s in ["lc", "wlc", "sed", "nq", "p2c"] {
        let vip = d.service_addr("default", s).unwrap();
        // Held connections: each pick sees the load of the previous ones.
        let held: Vec<_> = (0..40).map(|_| held(vip)).collect();
        let per = conns_per_backend(&*c, s);
        assert_eq!(per.iter().sum::<u64>(), 40, "{s}: {per:?}");
        match s {
            "lc" => assert_eq!(per, vec![20, 20], "lc ignores weights"),
            "wlc" | "sed" | "nq" => {
                assert!((9..=11).contains(&per[0]), "{s}: {per:?} not ~1:3")
            }
            _ => assert!(per[0] >= 3 && per[1] >= 20, "p2c: {per:?}"),
        }
        drop(held);
    }
    d.shutdown();
}

#[test]
fn source_hash_schedulers_and_persistence_keep_a_client_on_one_backend() {
    let (a, b) = (Echo::start(), Echo::start());
    let mut persist = service(
        "persist",
        Protocol::Tcp,
        "rr",
        vec![backend(a.addr, 1), backend(b.addr, 1)],
    );
    persist.persistence = "60s".parse().unwrap();
    persist.persistence_netmask = Some("255.255.255.0".into());
    let d = Daemon::start(
        config(vec![
            service(
                "sh",
                Protocol::Tcp,
                "sh",
                vec![backend(a.addr, 1), backend(b.addr, 1)],
            ),
            service(
                "mh",
                Protocol::Tcp,
                "mh",
                vec![backend(a.addr, 1), backend(b.addr, 1)],
            ),
            persist,
        ]),
        None,
    )
    .unwrap();
    let c = d.control();
    for name in ["sh", "mh", "persist"] {
        let vip = d.service_addr("default", name).unwrap();
        for _ in 0..12 {
            assert!(echo_once(vip, b"x"));
        }
        let mut per = conns_per_backend(&*c, name);
        per.sort();
        assert_eq!(
            per,
            vec![0, 12],
            "{name}: one client IP must stick to one backend"
        );
    }
    // The persistence template lives in the flow table, keyed by the
    // netmask-grouped client address, and is listed like ipvsadm -Lnc does.
    let page = c
        .connections(
            &ConnFilter {
                service: Some("persist".into()),
                ..Default::default()
            },
            None,
            100,
        )
        .unwrap();
    assert!(
        page.connections.iter().any(|x| x.client == "127.0.0.0:0"),
        "no template in {:?}",
        page.connections
    );
    d.shutdown();
}

#[test]
fn weight_zero_quiesces_without_dropping_established() {
    let (a, b) = (Echo::start(), Echo::start());
    let d = start_service("q", Protocol::Tcp, "rr", &[a.addr, b.addr]);
    let c = d.control();
    let vip = d.service_addr("default", "q").unwrap();
    let mut first = held(vip); // goes to a (rr starts at the first)
    let mut second = held(vip);
    c.edit_backend(
        "default",
        "q",
        &a.addr.to_string(),
        BackendPatch {
            weight: Some(0),
            drain: None,
        },
    )
    .unwrap();
    for _ in 0..10 {
        assert!(echo_once(vip, b"y"));
    }
    let per = conns_per_backend(&*c, "q");
    assert_eq!(per[0], 1, "quiesced backend got new connections: {per:?}");
    assert_eq!(per[1], 11);
    for s in [&mut first, &mut second] {
        s.write_all(b"ok").unwrap();
        let mut buf = [0u8; 2];
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"ok");
    }
    d.shutdown();
}

#[test]
fn connect_failure_retries_the_next_backend() {
    // A port with nothing listening refuses at once; a non-routable address
    // times out after connect_timeout. Either way the next backend is tried.
    let refusing = RefusingPort::new();
    let dead = refusing.addr;
    let good = Echo::start();
    let mut spec = service(
        "r",
        Protocol::Tcp,
        "rr",
        vec![
            backend(dead, 1),
            backend("192.0.2.1:9".parse().unwrap(), 1),
            backend(good.addr, 1),
        ],
    );
    spec.options.connect_timeout = Some("300ms".parse().unwrap());
    let d = Daemon::start(config(vec![spec]), None).unwrap();
    let vip = d.service_addr("default", "r").unwrap();
    for _ in 0..4 {
        assert!(echo_once(vip, b"retry"));
    }
    assert_eq!(good.accepted.load(Relaxed), 4);
    d.shutdown();
}

fn health_failover(expire_nodest_conn: bool) {
    let mut a = Echo::start();
    let b = Echo::start();
    let mut spec = service(
        "h",
        Protocol::Tcp,
        "rr",
        vec![backend(a.addr, 1), backend(b.addr, 1)],
    );
    spec.options.expire_nodest_conn = expire_nodest_conn;
    spec.options.health = Some(HealthSpec {
        interval: "100ms".parse().unwrap(),
        timeout: "100ms".parse().unwrap(),
        rise: 1,
        fall: 2,
        ..Default::default()
    });
    let d = Daemon::start(config(vec![spec]), None).unwrap();
    let c = d.control();
    let vip = d.service_addr("default", "h").unwrap();
    let mut on_a = held(vip);
    a.kill();
    assert!(wait_until(T, || c
        .health()
        .iter()
        .any(|h| h.backend == a.addr.to_string() && h.state == "down")));
    for _ in 0..6 {
        assert!(echo_once(vip, b"z"));
    }
    assert_eq!(
        conns_per_backend(&*c, "h")[0],
        1,
        "down backend got new connections"
    );
    let _ = on_a.write_all(b"ok");
    let mut buf = [0u8; 2];
    let r = on_a.read(&mut buf);
    if expire_nodest_conn {
        assert!(
            matches!(r, Ok(0) | Err(_)),
            "connection to the down backend should be closed: {r:?}"
        );
    } else {
        assert_eq!(
            r.unwrap(),
            2,
            "connection to the down backend should continue"
        );
    }
    d.shutdown();
}

#[test]
fn health_failover_keeps_existing_connections() {
    health_failover(false);
}

#[test]
fn health_failover_with_expire_nodest_conn_closes_them() {
    health_failover(true);
}

#[test]
fn deleting_a_tenant_closes_and_purges_only_its_connections() {
    let e = Echo::start();
    let mut cfg = config(vec![]);
    for t in ["a", "b"] {
        cfg.tenants.push(TenantSpec {
            name: t.into(),
            table_entries: if t == "a" { 1024 } else { 0 },
            ..Default::default()
        });
        let mut s = service(
            &format!("svc-{t}"),
            Protocol::Tcp,
            "rr",
            vec![backend(e.addr, 1)],
        );
        s.tenant = t.into();
        cfg.services.push(s);
    }
    let d = Daemon::start(cfg, None).unwrap();
    let c = d.control();
    let va = d.service_addr("a", "svc-a").unwrap();
    let vb = d.service_addr("b", "svc-b").unwrap();
    let mut ha: Vec<_> = (0..3).map(|_| held(va)).collect();
    let mut hb: Vec<_> = (0..2).map(|_| held(vb)).collect();
    // A tenant that no longer exists lists nothing (the API says 404).
    let count = |t: &str| {
        c.connections(
            &ConnFilter {
                tenant: Some(t.into()),
                ..Default::default()
            },
            None,
            100,
        )
        .map_or(0, |p| p.connections.len())
    };
    let entries = |t: &str| c.table().iter().find(|r| r.tenant == t).map(|r| r.entries);
    assert_eq!((count("a"), count("b")), (3, 2));
    assert_eq!(
        c.table()
            .iter()
            .find(|r| r.tenant == "a")
            .map(|r| r.placement.as_str()),
        Some("own")
    );
    assert_eq!((entries("a"), entries("b")), (Some(3), Some(2)));
    assert_eq!(c.delete_tenant("a").unwrap(), 3);
    assert!(wait_until(T, || count("a") == 0));
    assert_eq!(count("b"), 2);
    assert_eq!((entries("a"), entries("b")), (None, Some(2)));
    for s in ha.iter_mut() {
        let mut buf = [0u8; 1];
        let r = s.read(&mut buf);
        assert!(
            matches!(r, Ok(0) | Err(_)),
            "tenant a's connection still open: {r:?}"
        );
    }
    for s in hb.iter_mut() {
        s.write_all(b"ok").unwrap();
        let mut buf = [0u8; 2];
        s.read_exact(&mut buf).unwrap();
    }
    assert!(
        TcpStream::connect(va).is_err() || !echo_once(va, b"x"),
        "tenant a still listening"
    );
    assert!(c.tenants().iter().all(|t| t.spec.name != "a"));
    d.shutdown();
}

#[test]
fn tenant_connection_limit_refuses_and_counts() {
    let e = Echo::start();
    let mut cfg = config(vec![service(
        "l",
        Protocol::Tcp,
        "rr",
        vec![backend(e.addr, 1)],
    )]);
    cfg.tenants.push(default_tenant(2, 0));
    let d = Daemon::start(cfg, None).unwrap();
    let c = d.control();
    let vip = d.service_addr("default", "l").unwrap();
    let _h: Vec<_> = (0..2).map(|_| held(vip)).collect();
    assert!(!echo_once(vip, b"x"), "third connection should be refused");
    assert_eq!(c.global_stats().refused.get("tenant_limit"), Some(&1));
    assert_eq!(c.tenants()[0].refused, 1);
    d.shutdown();
}

/// Spoofed datagram flood defence: at its tenant's limit, a new UDP
/// client's datagram takes the place of a session that has carried a
/// single datagram (answered or not), never of a stream. A spoofed
/// datagram's session held its place (and a socket) for `udp_timeout`,
/// 300 s by default, and every new client was refused meanwhile.
#[test]
fn a_udp_session_at_the_limit_takes_the_place_of_a_single_datagram_one() {
    let b = udp_echo();
    let mut cfg = config(vec![service("u", Protocol::Udp, "rr", vec![backend(b, 1)])]);
    cfg.tenants.push(default_tenant(2, 0));
    let d = Daemon::start(cfg, None).unwrap();
    let c = d.control();
    let vip = d.service_addr("default", "u").unwrap();
    let client = || {
        let u = UdpSocket::bind("127.0.0.1:0").unwrap();
        u.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        u
    };
    let ask = |u: &UdpSocket, msg: &[u8]| {
        u.send_to(msg, vip).unwrap();
        let mut buf = [0u8; 64];
        matches!(u.recv_from(&mut buf), Ok((n, _)) if &buf[..n] == msg)
    };
    let stream = client();
    assert!(ask(&stream, b"s1") && ask(&stream, b"s2"));
    let once = client();
    assert!(ask(&once, b"o1"));
    let new = client();
    assert!(ask(&new, b"n1"), "the third client was refused");
    let g = c.global_stats();
    assert_eq!(g.udp_early_drops, 1);
    assert_eq!(g.refused.get("tenant_limit"), None);
    // The one-shot's session went, the stream's stays; the ended
    // session's slot comes back, so the tenant holds its limit again.
    assert!(wait_until(T, || c.global_stats().active_conns == 2));
    let listed: Vec<String> = listed(&*c).into_iter().map(|x| x.client).collect();
    let addr = |u: &UdpSocket| u.local_addr().unwrap().to_string();
    assert!(listed.contains(&addr(&stream)), "{listed:?}");
    assert!(listed.contains(&addr(&new)), "{listed:?}");
    assert!(!listed.contains(&addr(&once)), "{listed:?}");
    assert!(ask(&stream, b"s3"), "the stream goes on");
    d.shutdown();
}

/// Spoofed datagram flood defence across tenants: a flood of single
/// datagrams against tenant a that fills the daemon's `max_connections`
/// does not lock tenant b's new clients out: b's new session takes the
/// place of one of a's single-datagram sessions (a presses hardest on the
/// limit), as packet mode's flows do. The place came from the new
/// session's own tenant only, and b, holding none, was refused
/// (`global_limit`) for as long as the flood went on.
#[test]
fn a_udp_flood_at_the_daemon_limit_does_not_lock_other_tenants_out() {
    let (d, va, vb) = udp_tenants_a_and_b(4, [0, 0]);
    let c = d.control();
    // Forged sources: a fresh socket (port) per datagram, gone at once.
    let flood = |n: usize| {
        for _ in 0..n {
            let _ = UdpSocket::bind("127.0.0.1:0").unwrap().send_to(b"x", va);
        }
    };
    flood(4);
    assert!(wait_until(T, || c.global_stats().active_conns == 4));
    let real = UdpSocket::bind("127.0.0.1:0").unwrap();
    real.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut buf = [0u8; 16];
    // The flood goes on between b's tries (bounded: 40 rounds).
    let answered = (0..40).any(|_| {
        flood(8);
        real.send_to(b"b", vb).unwrap();
        matches!(real.recv_from(&mut buf), Ok((n, _)) if &buf[..n] == b"b")
    });
    let g = c.global_stats();
    assert!(answered, "tenant b was locked out: {g:?}");
    let listed = listed(&*c);
    let real_addr = real.local_addr().unwrap().to_string();
    assert!(
        listed.iter().any(|x| x.client == real_addr),
        "b's session is not listed: {listed:?}"
    );
    assert!(g.udp_early_drops > 0, "{g:?}");
    d.shutdown();
}

/// At the daemon's limit a new UDP session taking a single-datagram
/// session's place is still under its tenant's own limits: here
/// `max_new_per_s`. It was admitted past every limit (`admit_over`), so
/// at the daemon's limit the tenant's rate limit let every new client
/// through.
#[test]
fn a_udp_session_at_the_daemon_limit_is_under_its_tenant_rate() {
    let b = udp_echo();
    let mut cfg = config(vec![service("u", Protocol::Udp, "rr", vec![backend(b, 1)])]);
    cfg.daemon.workers = 1;
    cfg.daemon.max_connections = 1;
    // One new session a second: the second client, within the second,
    // is over the rate.
    cfg.tenants.push(default_tenant(0, 1));
    let d = Daemon::start(cfg, None).unwrap();
    let c = d.control();
    let vip = d.service_addr("default", "u").unwrap();
    let ask = |msg: &[u8]| {
        let u = UdpSocket::bind("127.0.0.1:0").unwrap();
        u.set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        u.send_to(msg, vip).unwrap();
        let mut buf = [0u8; 64];
        matches!(u.recv_from(&mut buf), Ok((n, _)) if &buf[..n] == msg)
    };
    let first = Instant::now();
    assert!(ask(b"first"));
    let second = ask(b"second");
    if first.elapsed() >= Duration::from_secs(1) {
        // The rate's next token came meanwhile: this run cannot tell.
        eprintln!(
            "the second client came {:?} after the first",
            first.elapsed()
        );
        d.shutdown();
        return;
    }
    assert!(!second, "the second client passed the tenant's rate");
    let g = c.global_stats();
    assert_eq!(g.refused.get("tenant_rate"), Some(&1), "{g:?}");
    assert_eq!(g.udp_early_drops, 0, "{g:?}");
    assert_eq!(g.stats.conns, 1, "{g:?}");
    d.shutdown();
}

/// A datagram refused at the daemon's limit, with no session anywhere to
/// give its place, does not spend its tenant's `max_new_per_s`: the
/// tenant's limits are checked before a place is looked for, and the
/// token they took is given back with the slot. It was spent, so at a
/// rate of 1 a second a client refused while the daemon was full was
/// refused again (`tenant_rate`) once a place was free, for the rest of
/// the second.
#[test]
fn a_udp_datagram_refused_at_the_daemon_limit_leaves_its_tenants_rate() {
    let (d, va, vb) = udp_tenants_a_and_b(1, [0, 1]);
    let c = d.control();
    let ask = |u: &UdpSocket, vip, msg: &[u8]| {
        u.send_to(msg, vip).unwrap();
        let mut buf = [0u8; 64];
        matches!(u.recv_from(&mut buf), Ok((n, _)) if &buf[..n] == msg)
    };
    // a's session, a stream (two datagrams answered): never taken, so it
    // holds the daemon's one place.
    let ua = UdpSocket::bind("127.0.0.1:0").unwrap();
    ua.set_read_timeout(Some(T)).unwrap();
    assert!(ask(&ua, va, b"a1") && ask(&ua, va, b"a2"));
    let ub = UdpSocket::bind("127.0.0.1:0").unwrap();
    ub.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    assert!(!ask(&ub, vb, b"b1"), "served past the daemon's limit");
    let g = c.global_stats();
    assert_eq!(g.refused.get("global_limit"), Some(&1), "{g:?}");
    // The place freed, b's retry comes within its second: the token spent
    // on the refusal would not be back yet.
    let refused_at = Instant::now();
    let killed = c
        .kill_matching(&ConnFilter {
            tenant: Some("a".into()),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(killed, 1);
    assert!(wait_until(T, || c.global_stats().active_conns == 0));
    ub.set_read_timeout(Some(T)).unwrap();
    let served = ask(&ub, vb, b"b2");
    let g = c.global_stats();
    if refused_at.elapsed() >= Duration::from_secs(1) {
        // The token would be back by itself: this run cannot tell.
        eprintln!("retried {:?} after the refusal", refused_at.elapsed());
    }
    assert!(served, "b's first session was refused: {g:?}");
    assert_eq!(g.refused.get("tenant_rate"), None, "{g:?}");
    d.shutdown();
}

/// A backend streaming as fast as it can to a client that reads nothing
/// for a while, through weir configured by `tune`. Returns (bytes the
/// backend managed to write before stalling, bytes weir read from it);
/// then checks every byte arrives once the client reads.
fn slow_reader_chain(tune: impl FnOnce(&mut weir::config::Config)) -> (u64, u64) {
    const TOTAL: usize = 64 << 20;
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let baddr = l.local_addr().unwrap();
    let written = Arc::new(AtomicU64::new(0));
    let w2 = written.clone();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let chunk = vec![0xabu8; 16 * 1024];
        let mut sent = 0;
        while sent < TOTAL {
            match s.write(&chunk) {
                Ok(n) => {
                    sent += n;
                    w2.store(sent as u64, Relaxed);
                }
                Err(_) => return,
            }
        }
    });
    let mut cfg = config(vec![service(
        "s",
        Protocol::Tcp,
        "rr",
        vec![backend(baddr, 1)],
    )]);
    tune(&mut cfg);
    let d = Daemon::start(cfg, None).unwrap();
    let vip = d.service_addr("default", "s").unwrap();
    let c = TcpStream::connect(vip).unwrap();
    // Wait for the chain to fill: the backend's progress stops.
    let mut last = u64::MAX;
    assert!(wait_until(T, || {
        std::thread::sleep(Duration::from_millis(200));
        let now = written.load(Relaxed);
        let stalled = now == last && now > 0;
        last = now;
        stalled
    }));
    let stalled_at = written.load(Relaxed);
    let in_weir = listed(&*d.control())[0].bytes_out;
    let mut c = c;
    c.set_read_timeout(Some(T)).unwrap();
    let mut got = 0usize;
    let mut buf = vec![0u8; 256 * 1024];
    while got < TOTAL {
        let n = c.read(&mut buf).unwrap();
        assert!(n > 0, "stream ended early at {got}");
        got += n;
    }
    assert_eq!(got, TOTAL);
    d.shutdown();
    (stalled_at, in_weir)
}

#[test]
fn slow_reader_keeps_buffering_bounded() {
    // What weir read from the backend sits in weir's buffer, weir's send
    // queue to the client and the client's receive queue; what the backend
    // wrote adds weir's receive queue and the backend's own send queue
    // (about 4 MB on loopback whatever weir does: the kernel sizes it from
    // the 64 KiB loopback segment).
    let (on_chain, on_weir) = slow_reader_chain(|_| {});
    let (off_chain, off_weir) = slow_reader_chain(|c| {
        c.daemon.notsent_lowat = 0;
        c.daemon.backend_rcvbuf = 0;
        c.daemon.blocked_window = 0;
    });
    eprintln!(
        "slow reader: bounding on: backend stalled after {on_chain} bytes, weir read {on_weir}; \
         off: {off_chain} and {off_weir}"
    );
    assert!(on_weir < 1 << 20, "weir took {on_weir} bytes: not bounded");
    assert!(
        on_weir * 4 < off_weir,
        "bounding on took {on_weir} bytes, off {off_weir}: bounding makes no difference"
    );
    assert!(
        on_chain < off_chain,
        "the whole chain holds more with bounding on"
    );
    assert!(
        on_chain < 16 << 20,
        "chain holds {on_chain} bytes: not bounded"
    );
}

#[test]
fn proxy_protocol_headers_precede_client_bytes() {
    // Two backends that record the first bytes they get, one per version.
    fn recorder() -> (std::net::SocketAddr, std::thread::JoinHandle<Vec<u8>>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let h = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).unwrap();
            got
        });
        (addr, h)
    }
    let (a1, h1) = recorder();
    let (a2, h2) = recorder();
    let mut b1 = backend(a1, 1);
    b1.proxy_protocol = Some(weir::proxy_protocol::Version::V1);
    let mut b2 = backend(a2, 1);
    b2.proxy_protocol = Some(weir::proxy_protocol::Version::V2);
    let d = Daemon::start(
        config(vec![
            service("p1", Protocol::Tcp, "rr", vec![b1]),
            service("p2", Protocol::Tcp, "rr", vec![b2]),
        ]),
        None,
    )
    .unwrap();
    let mut clients = Vec::new();
    for name in ["p1", "p2"] {
        let vip = d.service_addr("default", name).unwrap();
        let mut c = TcpStream::connect(vip).unwrap();
        c.write_all(b"payload").unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        clients.push((c.local_addr().unwrap(), vip));
    }
    let got1 = h1.join().unwrap();
    let (c1, v1) = clients[0];
    let want1 = format!(
        "PROXY TCP4 {} {} {} {}\r\npayload",
        c1.ip(),
        v1.ip(),
        c1.port(),
        v1.port()
    );
    assert_eq!(String::from_utf8_lossy(&got1), want1);
    let got2 = h2.join().unwrap();
    let (c2, v2) = clients[1];
    assert_eq!(&got2[..12], &weir::proxy_protocol::V2_SIGNATURE);
    assert_eq!(got2[12], 0x21, "v2, PROXY command");
    assert_eq!(got2[13], 0x11, "TCP over IPv4");
    assert_eq!(
        &got2[16..20],
        &c2.ip()
            .to_string()
            .parse::<std::net::Ipv4Addr>()
            .unwrap()
            .octets()
    );
    assert_eq!(u16::from_be_bytes([got2[24], got2[25]]), c2.port());
    assert_eq!(u16::from_be_bytes([got2[26], got2[27]]), v2.port());
    assert!(got2.ends_with(b"payload"));
    d.shutdown();
}

/// A TCP client bound to `from` (with `SO_REUSEADDR`, so that two clients
/// may share it, as connect's own port choice lets them towards different
/// destinations) and connected to `to`.
fn connect_from(from: std::net::SocketAddr, to: std::net::SocketAddr) -> TcpStream {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    s.set_reuse_address(true).unwrap();
    s.bind(&from.into()).unwrap();
    s.connect(&to.into()).unwrap();
    let s: TcpStream = s.into();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// On a wildcard listener, one client address and port may hold a
/// connection to each local address of the host (two TCP connections, two
/// 4-tuples): the second must not take the first one's entry over and cut
/// it ("replaced").
#[test]
fn a_wildcard_service_keeps_one_client_ports_connections_to_two_addresses_apart() {
    let e = Echo::start();
    let mut spec = service("w", Protocol::Tcp, "rr", vec![backend(e.addr, 1)]);
    spec.listen = "0.0.0.0:0".parse().unwrap();
    let d = Daemon::start(config(vec![spec]), None).unwrap();
    let c = d.control();
    let port = d.service_addr("default", "w").unwrap().port();
    let from = {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.set_reuse_address(true).unwrap();
        let any: std::net::SocketAddr = "127.0.0.5:0".parse().unwrap();
        s.bind(&any.into()).unwrap();
        s.local_addr().unwrap().as_socket().unwrap()
    };
    let (v1, v2) = (
        std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        std::net::SocketAddr::from(([127, 0, 0, 2], port)),
    );
    let mut a = connect_from(from, v1);
    assert!(still_echoes(&mut a));
    let mut b = connect_from(from, v2);
    assert!(still_echoes(&mut b));
    assert_eq!(virtuals(&*c), [v1.to_string(), v2.to_string()]);
    assert!(still_echoes(&mut a), "the first connection was cut");
    assert!(still_echoes(&mut b));
    drop((a, b));
    assert!(wait_until(T, || c.global_stats().active_conns == 0));
    d.shutdown();
}

/// A UDP service on a wildcard address answers each client from the
/// address the client sent to (a client checks where a reply comes from;
/// a connected socket drops any other), and keeps one client port's
/// sessions with two of the host's addresses apart, as TCP does.
#[test]
fn a_wildcard_udp_service_answers_from_the_address_the_client_sent_to() {
    let b = udp_echo();
    let mut spec = service("uw", Protocol::Udp, "rr", vec![backend(b, 1)]);
    spec.listen = "0.0.0.0:0".parse().unwrap();
    let d = Daemon::start(config(vec![spec]), None).unwrap();
    let control = d.control();
    let port = d.service_addr("default", "uw").unwrap().port();
    let c = UdpSocket::bind("127.0.0.5:0").unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 1500];
    let vips = [
        std::net::SocketAddr::from(([127, 0, 0, 2], port)),
        std::net::SocketAddr::from(([127, 0, 0, 3], port)),
    ];
    for _ in 0..2 {
        for vip in vips {
            c.send_to(vip.to_string().as_bytes(), vip).unwrap();
            let (n, from) = c.recv_from(&mut buf).unwrap();
            assert_eq!(&buf[..n], vip.to_string().as_bytes());
            assert_eq!(from, vip, "reply must come from the address sent to");
        }
    }
    assert_eq!(
        virtuals(&*control),
        [vips[0].to_string(), vips[1].to_string()]
    );
    d.shutdown();
    // The same on an IPv6 wildcard (IPV6_PKTINFO).
    let mut spec = service("uw6", Protocol::Udp, "rr", vec![backend(b, 1)]);
    spec.listen = "[::]:0".parse().unwrap();
    let d = Daemon::start(config(vec![spec]), None).unwrap();
    let port = d.service_addr("default", "uw6").unwrap().port();
    let vip = std::net::SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port));
    let c = UdpSocket::bind("[::1]:0").unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    c.send_to(b"six", vip).unwrap();
    let (n, from) = c.recv_from(&mut buf).unwrap();
    assert_eq!((&buf[..n], from), (&b"six"[..], vip));
    d.shutdown();
}

/// `udp_max_sessions_per_client` holds when a client's first datagrams
/// from many ports reach several workers at once (SO_REUSEPORT spreads a
/// client's ports over the workers' sockets): the place is taken where it
/// is checked, not after the session is made.
#[test]
fn udp_sessions_per_client_hold_across_workers() {
    const PORTS: usize = 32;
    let b = udp_echo();
    let mut spec = service("u1", Protocol::Udp, "rr", vec![backend(b, 1)]);
    spec.options.udp_max_sessions_per_client = 1;
    let mut cfg = config(vec![spec]);
    cfg.daemon.workers = 4;
    let d = Daemon::start(cfg, None).unwrap();
    let c = d.control();
    let vip = d.service_addr("default", "u1").unwrap();
    let refused = || {
        c.global_stats()
            .refused
            .get("client_limit")
            .copied()
            .unwrap_or(0)
    };
    let sessions = || listed(&*c).len() as u64;
    let mut worst = 0;
    for _ in 0..100 {
        let before = refused();
        let socks: Vec<UdpSocket> = (0..PORTS)
            .map(|_| UdpSocket::bind("127.0.0.1:0").unwrap())
            .collect();
        // Two senders, so the workers' first datagrams arrive together.
        std::thread::scope(|s| {
            for half in socks.chunks(PORTS / 2) {
                s.spawn(move || {
                    for u in half {
                        u.send_to(b"x", vip).unwrap();
                    }
                });
            }
        });
        // Every datagram made a session or was refused.
        assert!(wait_until(T, || sessions() + (refused() - before) == PORTS as u64));
        worst = worst.max(sessions());
        c.kill_matching(&ConnFilter {
            tenant: Some("default".into()),
            ..Default::default()
        })
        .unwrap();
        assert!(wait_until(T, || c.global_stats().active_conns == 0));
    }
    assert_eq!(worst, 1, "sessions of one client over its limit of 1");
    d.shutdown();
}
