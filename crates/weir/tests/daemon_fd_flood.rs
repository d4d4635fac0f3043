//! Issue 10 #22: at fd exhaustion every new UDP client logged a WARN (one
//! line per datagram); each such client is counted as refused. Its own test binary: it lowers the process's fd
//! limit and captures the process's log output.

mod daemon_util;

use std::io::Write;
use std::net::UdpSocket;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use daemon_util::*;
use weir::config::Protocol;
use weir::daemon::Daemon;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Bytes waiting in the receive queue of the UDP socket bound to `addr`
/// (from `/proc/self/net/udp`; 0 if there is none).
fn rx_queue(addr: std::net::SocketAddr) -> u64 {
    proc_net_udp_rows(UdpEnd::Local, addr)
        .unwrap_or_default()
        .iter()
        .filter_map(|f| {
            let queues = f.get(4)?;
            u64::from_str_radix(queues.split(':').nth(1)?, 16).ok()
        })
        .sum()
}

/// Datagrams the kernel dropped at the UDP socket bound to `addr` (its
/// receive queue full).
fn kernel_drops(addr: std::net::SocketAddr) -> u64 {
    proc_net_udp_rows(UdpEnd::Local, addr)
        .unwrap()
        .iter()
        .filter_map(|f| f.get(12)?.parse::<u64>().ok())
        .sum()
}

#[test]
fn fd_exhaustion_logs_a_line_a_second_not_one_per_client() {
    let logs = Captured::default();
    let sink = logs.clone();
    tracing_subscriber::fmt()
        .with_writer(move || sink.clone())
        .with_ansi(false)
        .init();
    let b = udp_echo();
    let mut cfg = config(vec![service("u", Protocol::Udp, "rr", vec![backend(b, 1)])]);
    // One worker: one listening socket, so datagrams are handled in order.
    cfg.daemon.workers = 1;
    let d = Daemon::start(cfg, None).unwrap();
    let vip = d.service_addr("default", "u").unwrap();
    const N: usize = 300;
    let clients: Vec<UdpSocket> = (0..N)
        .map(|_| UdpSocket::bind("127.0.0.1:0").unwrap())
        .collect();
    let probe = UdpSocket::bind("127.0.0.1:0").unwrap();
    probe
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();

    // Exhaust: a limit just above the highest fd, and every hole below it
    // filled, so the daemon's next socket fails with EMFILE.
    let fds = FdsTaken::all_but(0);
    for c in &clients {
        let _ = c.send_to(b"x", vip);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut buf = [0u8; 16];
    let after_flood = |logs: &Captured| {
        let text = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
        text.lines()
            .filter(|l| l.contains("udp session socket"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    // Wait until the daemon has read the whole flood (its socket's receive
    // queue is empty) while fds are still short.
    while (after_flood(&logs).is_empty() || rx_queue(vip) != 0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    fds.release();
    // What the kernel dropped for want of room in the listening socket's
    // receive queue never reached weir: once weir has read the rest (the
    // file is readable again), the count is final, as nothing else is
    // sent before the probe.
    let deadline = Instant::now() + Duration::from_secs(10);
    while rx_queue(vip) != 0 {
        assert!(Instant::now() < deadline, "the flood was never read");
        std::thread::sleep(Duration::from_millis(20));
    }
    let dropped = kernel_drops(vip);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut answered = false;
    while !answered && Instant::now() < deadline {
        let _ = probe.send_to(b"probe", vip);
        answered = probe.recv_from(&mut buf).is_ok();
    }
    assert!(answered, "the daemon serves again once fds are back");
    // Every client weir read is either served (a session: `conns`) or
    // refused under a reason; the probe, served after the whole flood (one
    // worker reads its socket in order), is the one more.
    let g = d.control().global_stats();
    let refused = g.refused.get("fd_exhausted").copied().unwrap_or(0);
    assert!(refused > 0, "no client refused for want of descriptors");
    assert_eq!(
        refused + g.stats.conns,
        N as u64 - dropped + 1,
        "clients neither served nor counted as refused ({:?}, {} sessions, {dropped} dropped by the kernel)",
        g.refused,
        g.stats.conns
    );
    let tenants = d.control().tenants();
    let t = tenants.iter().find(|t| t.spec.name == "default").unwrap();
    assert_eq!(t.refused, refused, "the tenant's count of refusals");
    let lines = after_flood(&logs);
    assert!(!lines.is_empty(), "the exhaustion was logged");
    assert!(
        lines.len() <= 3,
        "{} lines for {N} clients:\n{}",
        lines.len(),
        lines.join("\n")
    );
    assert!(
        lines.iter().any(|l| l.contains("suppressed")),
        "{}",
        lines.join("\n")
    );
    drop(clients);
    d.shutdown();
}
