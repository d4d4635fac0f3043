//! The daemon on loopback: UDP session lifetime and what the metrics say
//! about UDP.

mod daemon_util;

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

use daemon_util::*;
use weir::config::Protocol;
use weir::daemon::Daemon;

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
    let SocketAddr::V4(a) = addr else {
        panic!("IPv4 only")
    };
    let want = format!(
        "{:08X}:{:04X}",
        u32::from_le_bytes(a.ip().octets()),
        a.port()
    );
    std::fs::read_to_string("/proc/self/net/udp")
        .expect("/proc/self/net/udp")
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.get(2) == Some(&want.as_str()) && f.get(9).is_some_and(|i| mine.contains(*i))
        })
        .count()
}

/// Issue 10 #3: a session's socket lived on in the worker's session map
/// after the session expired (until the map grew enough to be swept).
#[test]
fn udp_session_sockets_close_when_sessions_expire() {
    let b = udp_echo();
    let mut spec = service("u", Protocol::Udp, "rr", vec![backend(b, 1)]);
    spec.options.udp_timeout = Some("1s".into());
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
    let d = Daemon::start(
        config(vec![service("u", Protocol::Udp, "rr", vec![backend(b, 1)])]),
        None,
    )
    .unwrap();
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
