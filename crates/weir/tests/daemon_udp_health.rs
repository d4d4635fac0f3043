//! The daemon on loopback: UDP session lifetime, UDP health checks, the
//! passive check and rr retries, and what the metrics say about UDP.

mod daemon_util;

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

use daemon_util::*;
use weir::config::{HealthSpec, Protocol};
use weir::control::Control;
use weir::daemon::{Daemon, DaemonHandle};

const T: Duration = Duration::from_secs(10);

/// This process's UDP sockets connected to `addr` (from
/// `/proc/self/net/udp`, matched by inode against `/proc/self/fd`); exact
/// even while other tests open and close sockets in parallel.
fn udp_sockets_connected_to(addr: SocketAddr) -> usize {
    let mine: std::collections::HashSet<String> = std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|e| {
            let link = std::fs::read_link(e.ok()?.path()).ok()?;
            let link = link.to_str()?;
            Some(link.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect();
    proc_net_udp_rows(UdpEnd::Remote, addr)
        .expect("/proc/self/net/udp")
        .iter()
        .filter(|f| f.get(9).is_some_and(|i| mine.contains(i)))
        .count()
}

fn health_of(c: &dyn Control, addr: SocketAddr) -> Option<(String, Option<String>)> {
    c.health()
        .into_iter()
        .find(|h| h.backend == addr.to_string())
        .map(|h| (h.state, h.last_error))
}

/// Issue 10 #3: a session's socket lived on in the worker's session map
/// after the session expired (until the map grew enough to be swept).
#[test]
fn udp_session_sockets_close_when_sessions_expire() {
    let b = udp_echo();
    let mut spec = service("u", Protocol::Udp, "rr", vec![backend(b, 1)]);
    spec.options.udp_timeout = Some("1s".parse().unwrap());
    let d = Daemon::start(config(vec![spec]), None).unwrap();
    let vip = d.service_addr("default", "u").unwrap();
    let control = d.control();
    const N: usize = 200;
    let clients: Vec<UdpSocket> = (0..N)
        .map(|_| {
            let c = UdpSocket::bind("127.0.0.1:0").unwrap();
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            c
        })
        .collect();
    let mut buf = [0u8; 64];
    for c in &clients {
        c.send_to(b"hello", vip).unwrap();
        let (n, _) = c.recv_from(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"hello");
    }
    assert_eq!(udp_sockets_connected_to(b), N, "one socket per session");
    drop(clients);
    assert!(
        wait_until(T, || control.global_stats().active_conns == 0),
        "sessions expire after 1 s idle"
    );
    assert!(
        wait_until(T, || udp_sockets_connected_to(b) == 0),
        "{} session sockets still open with no session left",
        udp_sockets_connected_to(b)
    );
    d.shutdown();
}

/// Issue 10 #27: the HELP text said UDP sessions count as active; they
/// count as inactive (as in IPVS).
#[test]
fn metrics_count_udp_sessions_as_inactive_and_say_so() {
    let b = udp_echo();
    let d = start_service("u", Protocol::Udp, "rr", &[b]);
    let vip = d.service_addr("default", "u").unwrap();
    let c = UdpSocket::bind("127.0.0.1:0").unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    c.send_to(b"x", vip).unwrap();
    let mut buf = [0u8; 8];
    c.recv_from(&mut buf).unwrap();
    let text = weir::admin::metrics::render(&*d.control()).unwrap();
    let value = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("{name}{{")))
            .and_then(|l| l.rsplit(' ').next())
            .map(str::to_owned)
    };
    let help = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("# HELP {name} ")))
            .unwrap_or_default()
            .to_owned()
    };
    assert_eq!(
        value("weir_backend_active_connections").as_deref(),
        Some("0")
    );
    assert_eq!(
        value("weir_backend_inactive_connections").as_deref(),
        Some("1")
    );
    let active = help("weir_backend_active_connections");
    let inactive = help("weir_backend_inactive_connections");
    assert!(!active.contains("UDP"), "{active}");
    assert!(inactive.contains("UDP sessions"), "{inactive}");
    d.shutdown();
}

/// Issue 10 #24: with rr, a retry moved the rotation so the refusing
/// backend came first for every client; and nothing took it out without
/// an explicit health check.
#[test]
fn rr_retries_keep_the_rotation_and_a_failing_backend_is_taken_out() {
    // A port nothing listens on: connects are refused.
    let refusing = RefusingPort::new();
    let dead = refusing.addr;
    let good = Echo::start();
    let d = start_service("p", Protocol::Tcp, "rr", &[dead, good.addr]);
    let c = d.control();
    let vip = d.service_addr("default", "p").unwrap();
    let tries = |c: &dyn Control| -> Vec<u64> {
        c.services()
            .into_iter()
            .find(|s| s.name == "p")
            .map(|s| s.backends.iter().map(|b| b.stats.conns).collect())
            .unwrap_or_default()
    };
    for _ in 0..4 {
        assert!(echo_once(vip, b"x"));
    }
    assert_eq!(
        tries(&*c)[0],
        2,
        "every other client starts at the dead backend, not every client"
    );
    assert_eq!(health_of(&*c, dead).unwrap().0, "unchecked");
    for _ in 0..16 {
        assert!(echo_once(vip, b"x"));
    }
    let t = tries(&*c);
    assert_eq!(
        t[0],
        u64::from(weir::health::PASSIVE_FALL),
        "out after {} failures in a row",
        weir::health::PASSIVE_FALL
    );
    assert_eq!(t[1], 20, "every client was served by the good backend");
    let (state, err) = health_of(&*c, dead).unwrap();
    assert_eq!(state, "down");
    let err = err.unwrap_or_default();
    assert!(err.contains("passive check"), "{err}");
    assert_eq!(health_of(&*c, good.addr).unwrap().0, "unchecked");
    d.shutdown();
}

/// A client connection whose first backend refused it and that the next
/// one served is one connection of the service, its tenant and the daemon
/// (each backend counts the attempt it got). Every attempt used to count
/// as a connection of all of them, so a failing backend inflated the
/// service's connection count and rate.
#[test]
fn a_retried_connection_counts_once_for_its_service() {
    let refusing = RefusingPort::new();
    let good = Echo::start();
    let d = start_service("p", Protocol::Tcp, "rr", &[refusing.addr, good.addr]);
    let c = d.control();
    let vip = d.service_addr("default", "p").unwrap();
    // rr starts at the refusing backend: tried, then the good one.
    assert!(echo_once(vip, b"x"));
    let svc = c.services().into_iter().find(|s| s.name == "p").unwrap();
    let tries: Vec<u64> = svc.backends.iter().map(|b| b.stats.conns).collect();
    assert_eq!(tries, [1, 1], "each backend got one attempt");
    assert_eq!(svc.stats.conns, 1, "the service's connections");
    assert_eq!(c.global_stats().stats.conns, 1, "the daemon's connections");
    d.shutdown();
}

/// A daemon with UDP service default/u, rr over a UDP echo backend and
/// `other`, checked every `interval` by a UDP check (payload "ping", a
/// reply within 100 ms; up after 1 success, down after `fall` failures).
/// The daemon and the echo backend's address.
fn udp_checked(other: SocketAddr, interval: &str, fall: u32) -> (DaemonHandle, SocketAddr) {
    let live = udp_echo();
    let mut spec = service(
        "u",
        Protocol::Udp,
        "rr",
        vec![backend(live, 1), backend(other, 1)],
    );
    spec.options.health = Some(HealthSpec {
        interval: interval.parse().unwrap(),
        timeout: "100ms".parse().unwrap(),
        rise: 1,
        fall,
        protocol: Some(Protocol::Udp),
        send: Some("ping".into()),
        ..Default::default()
    });
    (Daemon::start(config(vec![spec]), None).unwrap(), live)
}

/// `udp_checked` whose other backend is a socket bound but never answering
/// (silence, not a refusal), once its checks have taken it down. The
/// daemon, that socket (a test may make it answer later), its address
/// and the echo backend's address.
fn udp_checked_with_a_mute_backend(
    interval: &str,
    fall: u32,
) -> (DaemonHandle, UdpSocket, SocketAddr, SocketAddr) {
    let mute = UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = mute.local_addr().unwrap();
    let (d, live) = udp_checked(addr, interval, fall);
    let c = d.control();
    assert!(wait_until(T, || health_of(&*c, addr).is_some_and(|(s, _)| s == "down")));
    (d, mute, addr, live)
}

/// Issue 10 #15: a UDP service got a TCP connect check, which marks a
/// UDP-only backend down. A UDP check sends a payload and wants a reply.
#[test]
fn udp_health_check_keeps_a_udp_backend_up_and_takes_a_silent_one_down() {
    let (d, mute, silent, live) = udp_checked_with_a_mute_backend("100ms", 2);
    let c = d.control();
    let (_, err) = health_of(&*c, silent).unwrap();
    assert!(err.is_some_and(|e| e.contains("no reply")));
    // Checked as often as the silent one, and still up.
    assert_eq!(health_of(&*c, live).unwrap().0, "up");
    let vip = d.service_addr("default", "u").unwrap();
    for _ in 0..4 {
        let cl = UdpSocket::bind("127.0.0.1:0").unwrap();
        cl.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        cl.send_to(b"q", vip).unwrap();
        let mut buf = [0u8; 8];
        let (n, _) = cl.recv_from(&mut buf).expect("served by the live backend");
        assert_eq!(&buf[..n], b"q");
    }
    drop(mute);
    d.shutdown();
}

/// Any edit of a service's backends restarts its health checks. A
/// restarted check began as "up" whatever the backend's state, so one
/// that was down never saw a change when it recovered (its successes
/// agreed with the check's own state) and stayed out of scheduling for good.
#[test]
fn a_down_backend_comes_back_up_after_its_checks_restart() {
    // Down at the first check. One check at start, the next long after
    // this test is done with the first check task: only the restarted
    // checks see the recovery.
    let (d, mute, flaky, _live) = udp_checked_with_a_mute_backend("1h", 1);
    let c = d.control();
    // The down one recovers: it answers from now on...
    std::thread::spawn(move || {
        let mut buf = [0u8; 512];
        while let Ok((n, peer)) = mute.recv_from(&mut buf) {
            let _ = mute.send_to(&buf[..n], peer);
        }
    });
    // ...and an unrelated edit (another backend joins) restarts the checks,
    // whose first round runs at once.
    c.add_backend("default", "u", backend(udp_echo(), 1))
        .unwrap();
    assert!(
        wait_until(T, || health_of(&*c, flaky).is_some_and(|(s, _)| s == "up")),
        "a recovered backend stayed down: {:?}",
        health_of(&*c, flaky)
    );
    d.shutdown();
}

/// A datagram from source port 0 (which cannot be answered: RFC 768's
/// "no reply expected") had the flow key of its client group's persistence
/// template, `(group, 0)`: its session took the template's entry over, so
/// the group's next session was scheduled afresh, and while the port-0
/// session lived no template could be stored. One spoofed datagram from a
/// group's address broke persistence for the whole group. Such datagrams
/// are now dropped.
#[test]
fn a_source_port_0_datagram_does_not_take_a_persistence_template_over() {
    let (a, b) = (udp_echo(), udp_echo());
    let mut spec = service("p", Protocol::Udp, "rr", vec![backend(a, 1), backend(b, 1)]);
    spec.persistence = "300s".parse().unwrap();
    // One worker, one socket: the datagrams are handled in the order sent.
    let mut cfg = config(vec![spec]);
    cfg.daemon.workers = 1;
    let d = Daemon::start(cfg, None).unwrap();
    let c = d.control();
    let vip = d.service_addr("default", "p").unwrap();
    let backend_of = |client: SocketAddr| {
        c.connections(&weir::control::ConnFilter::default(), None, 100)
            .unwrap()
            .connections
            .into_iter()
            .find(|x| x.client == client.to_string() && x.state == "UDP")
            .map(|x| x.backend)
    };
    let session = || {
        let s = UdpSocket::bind("127.0.0.7:0").unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        s.send_to(b"hi", vip).unwrap();
        let mut buf = [0u8; 8];
        let (n, _) = s.recv_from(&mut buf).expect("echoed");
        assert_eq!(&buf[..n], b"hi");
        let at = backend_of(s.local_addr().unwrap()).expect("a session");
        (s, at)
    };
    let (_first, placed) = session();
    // A raw UDP datagram from 127.0.0.7:0 (the kernel adds the IP header;
    // checksum 0: none). Needs CAP_NET_RAW: skipped without.
    let Ok(raw) = socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::RAW,
        Some(socket2::Protocol::UDP),
    ) else {
        eprintln!("skipped: needs CAP_NET_RAW for a raw socket");
        d.shutdown();
        return;
    };
    let src: SocketAddr = "127.0.0.7:0".parse().unwrap();
    raw.bind(&src.into()).unwrap();
    let mut dgram = Vec::new();
    dgram.extend_from_slice(&0u16.to_be_bytes());
    dgram.extend_from_slice(&vip.port().to_be_bytes());
    dgram.extend_from_slice(&(8u16 + 2).to_be_bytes());
    dgram.extend_from_slice(&0u16.to_be_bytes());
    dgram.extend_from_slice(b"x0");
    raw.send_to(&dgram, &vip.into()).unwrap();
    // Another session of the group, after the spoofed datagram was handled
    // (one socket): it goes where the template says.
    let (_second, again) = session();
    let spoofed = backend_of(src);
    assert_eq!(
        again, placed,
        "the group's next session was not placed by its template (port-0 session: {spoofed:?})"
    );
    assert_eq!(
        spoofed, None,
        "a session for an unanswerable port-0 datagram"
    );
    d.shutdown();
}

fn udp_service_with_health(health: &str) -> String {
    format!(
        "[[service]]\nname = \"dns\"\nprotocol = \"udp\"\nlisten = \"127.0.0.1:5353\"\n\
         [service.health]\n{health}\n\
         [[service.backend]]\naddress = \"127.0.0.1:53\"\n"
    )
}

#[test]
fn check_refuses_a_tcp_check_on_a_udp_service_unless_it_names_a_port() {
    let errors = |health: &str| -> String {
        match weir::config::parse(&udp_service_with_health(health), "t.toml") {
            Ok(_) => String::new(),
            Err(e) => e
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("\n"),
        }
    };
    let e = errors("interval = \"2s\"");
    assert!(e.contains("TCP connect check on a UDP service"), "{e}");
    let e = errors("protocol = \"tcp\"");
    assert!(e.contains("TCP connect check on a UDP service"), "{e}");
    assert_eq!(errors("port = 8053"), "", "a TCP port of each backend");
    assert_eq!(errors("protocol = \"udp\"\nsend = \"ping\""), "");
    let e = errors("protocol = \"udp\"");
    assert!(e.contains("send"), "{e}");
    let e = errors("port = 0");
    assert!(e.contains("1-65535"), "{e}");
    // The API validates the same way.
    let d = Daemon::start(config(vec![]), None).unwrap();
    let mut spec = service(
        "u",
        Protocol::Udp,
        "rr",
        vec![backend("127.0.0.1:53".parse().unwrap(), 1)],
    );
    spec.options.health = Some(HealthSpec::default());
    let err = d.control().add_service(spec).expect_err("refused");
    assert!(
        err.to_string()
            .contains("TCP connect check on a UDP service"),
        "{err}"
    );
    d.shutdown();
}

/// Runs `args` (a command and its arguments), and panics with its stderr
/// unless it succeeds: the root tests' `ip` and `tc` steps.
fn sh(args: &[&str]) {
    let out = std::process::Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A connect that fails because weir has no local port left towards a
/// backend (`EADDRNOTAVAIL`: the port range spent on connections and
/// TIME_WAIT to its address, the way a busy proxy runs out) is weir's
/// side, not the backend's: the passive check must not take a backend out
/// for it, or a busy but healthy backend leaves the rotation for 10 s.
/// In a network namespace of its own (run as root; skipped otherwise),
/// whose port range is narrowed to two ports once the listeners are up:
/// two connections held through weir take both ports towards the
/// backend, then more clients than `PASSIVE_FALL` each find none. Before,
/// the backend was "down" ("passive check") after the third.
#[test]
fn running_out_of_local_ports_does_not_take_the_backend_out() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root (a network namespace of its own)");
        return;
    }
    let ns = format!("weir-ports-{}", std::process::id());
    sh(&["ip", "netns", "add", &ns]);
    struct Gone(String);
    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", &self.0])
                .status();
        }
    }
    let _gone = Gone(ns.clone());
    sh(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
    let path = format!("/run/netns/{ns}");
    // Everything below runs on a thread inside the namespace; the daemon's
    // threads, started from it, are in it too.
    std::thread::spawn(move || {
        let f = std::fs::File::open(&path).unwrap();
        nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        let good = Echo::start();
        let mut cfg = config(vec![service(
            "p",
            Protocol::Tcp,
            "rr",
            vec![backend(good.addr, 1)],
        )]);
        cfg.daemon.workers = 1;
        let d = Daemon::start(cfg, None).unwrap();
        let c = d.control();
        let vip = d.service_addr("default", "p").unwrap();
        // Listeners took their ports from the default range; connects now
        // get two, outside it.
        std::fs::write("/proc/sys/net/ipv4/ip_local_port_range", "61000 61001").unwrap();
        let _held: Vec<_> = (0..2).map(|_| held(vip)).collect();
        // Clients on ports of their own (the two are the held ones').
        let refused = (0..2 * weir::health::PASSIVE_FALL)
            .filter(|i| {
                let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
                    .unwrap();
                s.set_reuse_address(true).unwrap();
                let port = 62000 + *i as u16;
                s.bind(&SocketAddr::from(([127, 0, 0, 1], port)).into())
                    .unwrap();
                s.set_read_timeout(Some(T)).unwrap();
                s.connect(&vip.into()).unwrap();
                let mut s: std::net::TcpStream = s.into();
                !still_echoes(&mut s)
            })
            .count();
        assert_eq!(
            refused as u32,
            2 * weir::health::PASSIVE_FALL,
            "no port was left"
        );
        let (state, err) = health_of(&*c, good.addr).unwrap();
        assert_eq!(state, "unchecked", "taken out: {err:?}");
        let conns = c
            .services()
            .into_iter()
            .find(|s| s.name == "p")
            .map(|s| s.backends[0].stats.conns)
            .unwrap();
        assert_eq!(
            conns,
            2 + 2 * u64::from(weir::health::PASSIVE_FALL),
            "each was tried"
        );
        d.shutdown();
    })
    .join()
    .unwrap();
}

/// A backend whose way cannot take any more datagrams (its session's socket
/// has a full send buffer) stalls none of the listener's other clients:
/// their datagrams reach their own backend and are answered, and the ones
/// the full socket could not take are dropped and counted as
/// `backend_busy`. The receive loop used to await each send to a backend,
/// so once one session's send buffer was full it waited there, and every
/// other client of the listener got nothing until that backend's queue
/// moved.
///
/// In a network namespace of its own (run as root; skipped otherwise):
/// the stuck backend is an address behind a veth whose queue holds what it
/// is given (a `tbf` qdisc at 8 bit/s, a static neighbour entry so nothing
/// waits for ARP); a datagram held there still counts against the sending
/// socket's send buffer, so after a hundred or so the session's socket
/// cannot take more. (On loopback a send never waits: its buffer is
/// released as the datagram is handed over.)
#[test]
fn a_backend_that_takes_no_more_datagrams_stalls_no_other_client() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root (a network namespace of its own)");
        return;
    }
    // Everything below runs on a thread in a namespace of its own (the
    // daemon's threads, started from it, are in it too); the namespace and
    // its links go when the last of them ends.
    std::thread::spawn(move || {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        sh(&["ip", "link", "set", "lo", "up"]);
        sh(&[
            "ip", "link", "add", "wv0", "type", "veth", "peer", "name", "wv1",
        ]);
        sh(&["ip", "link", "set", "wv0", "up"]);
        sh(&["ip", "link", "set", "wv1", "up"]);
        sh(&["ip", "addr", "add", "10.77.0.1/24", "dev", "wv0"]);
        sh(&[
            "ip",
            "neigh",
            "add",
            "10.77.0.2",
            "lladdr",
            "02:00:00:00:00:02",
            "dev",
            "wv0",
            "nud",
            "permanent",
        ]);
        sh(&[
            "tc", "qdisc", "add", "dev", "wv0", "root", "tbf", "rate", "8bit", "burst", "1600",
            "limit", "10000000",
        ]);
        let stuck: SocketAddr = "10.77.0.2:9".parse().unwrap();
        // An echo backend that stops with the test (its thread would keep
        // the namespace otherwise).
        let echo = UdpSocket::bind("127.0.0.1:0").unwrap();
        echo.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let echo_addr = echo.local_addr().unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let echo_thread = std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok((n, peer)) = echo.recv_from(&mut buf) {
                    let _ = echo.send_to(&buf[..n], peer);
                }
            }
        });
        let mut cfg = config(vec![service(
            "u",
            Protocol::Udp,
            "rr",
            vec![backend(stuck, 1), backend(echo_addr, 1)],
        )]);
        // One worker: both clients are this one receive loop's.
        cfg.daemon.workers = 1;
        let d = Daemon::start(cfg, None).unwrap();
        let c = d.control();
        let vip = d.service_addr("default", "u").unwrap();
        let client = || {
            let s = UdpSocket::bind("127.0.0.1:0").unwrap();
            s.set_read_timeout(Some(Duration::from_millis(100)))
                .unwrap();
            s
        };
        let (a, b) = (client(), client());
        a.send_to(b"hello", vip).unwrap();
        b.send_to(b"hello", vip).unwrap();
        // rr gave the two sessions one backend each: which is which.
        let mut sessions = Vec::new();
        assert!(
            wait_until(T, || {
                sessions = c
                    .connections(&Default::default(), None, 10)
                    .unwrap()
                    .connections;
                sessions.len() == 2
            }),
            "two sessions: {sessions:?}"
        );
        let backend_of = |s: &UdpSocket| {
            let me = s.local_addr().unwrap().to_string();
            sessions
                .iter()
                .find(|x| x.client == me)
                .map(|x| x.backend.clone())
                .unwrap()
        };
        let (slow, fine) = if backend_of(&a) == stuck.to_string() {
            (a, b)
        } else {
            (b, a)
        };
        assert_eq!(backend_of(&fine), echo_addr.to_string());
        let mut buf = [0u8; 2048];
        while fine.recv_from(&mut buf).is_ok() {}
        // The slow client sends until its session's socket is full and
        // the daemon says it dropped what it could not send.
        let busy = || {
            c.global_stats()
                .udp_dropped
                .get("backend_busy")
                .copied()
                .unwrap_or(0)
        };
        let payload = [7u8; 1000];
        assert!(
            wait_until(T, || {
                for _ in 0..50 {
                    let _ = slow.send_to(&payload, vip);
                }
                busy() > 0
            }),
            "no datagram was dropped as backend_busy: {:?}",
            c.global_stats().udp_dropped
        );
        // The other client is answered at once, while the slow one keeps
        // sending (a datagram of the fine one the listener's full receive
        // buffer lost is sent again after 100 ms).
        let t0 = std::time::Instant::now();
        let mut answered = false;
        for i in 0..50u32 {
            for _ in 0..20 {
                let _ = slow.send_to(&payload, vip);
            }
            let msg = format!("ping {i}");
            fine.send_to(msg.as_bytes(), vip).unwrap();
            // (A late answer to its "hello" does not count.)
            if let Ok((n, from)) = fine.recv_from(&mut buf)
                && from == vip
                && buf[..n].starts_with(b"ping ")
            {
                answered = true;
                break;
            }
        }
        assert!(
            answered,
            "no answer in {:?}: the slow backend stalled the listener",
            t0.elapsed()
        );
        d.shutdown();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        echo_thread.join().unwrap();
    })
    .join()
    .unwrap();
}
