//! A spoofed datagram flood against a UDP proxy service that exhausts the
//! descriptors. Its own test binary: it lowers the process's fd limit,
//! which the daemon shares with the test, and the exhaustion's log line,
//! one a second for the process, would hide `daemon_fd_flood`'s.

mod daemon_util;

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use daemon_util::*;
use weir::config::Protocol;
use weir::daemon::Daemon;

/// Spoofed datagram flood defence at fd exhaustion: with no
/// `max_connections`, a flood of single datagrams from forged sources
/// opens a session (a socket) per source until the descriptors run out;
/// then a real client's datagram, refused for want of a socket, ends one
/// of those sessions (`udp_early_drops`), and its retry gets a session.
/// The flood's sessions held every descriptor for `udp_timeout` (300 s),
/// and every new client was refused meanwhile.
#[test]
fn a_udp_client_at_fd_exhaustion_gets_a_session_on_retry() {
    let b = udp_echo();
    let mut cfg = config(vec![service("u", Protocol::Udp, "rr", vec![backend(b, 1)])]);
    cfg.daemon.workers = 1;
    let d = Daemon::start(cfg, None).unwrap();
    let c = d.control();
    let vip = d.service_addr("default", "u").unwrap();
    // The flood's sources and the real client, made while there are fds.
    const FLOOD: usize = 40;
    let flood: Vec<UdpSocket> = (0..FLOOD)
        .map(|_| UdpSocket::bind("127.0.0.1:0").unwrap())
        .collect();
    let real = UdpSocket::bind("127.0.0.1:0").unwrap();
    real.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();

    // Room for a few sessions only: the flood takes them all.
    let fds = FdsTaken::all_but(8);
    for f in &flood {
        f.send_to(b"x", vip).unwrap();
    }
    // Every datagram of the flood read (40 small ones fit the listening
    // socket's receive queue: none is lost before weir reads it), and the
    // sessions it ended closed (their tasks give their slots back once
    // their sockets are gone).
    let settled = || {
        let g = c.global_stats();
        let read = g.stats.conns + g.refused.get("fd_exhausted").copied().unwrap_or(0);
        read == FLOOD as u64 && g.active_conns == g.stats.conns - g.udp_early_drops
    };
    assert!(
        wait_until(Duration::from_secs(10), settled),
        "{:?}",
        c.global_stats()
    );
    let g = c.global_stats();
    assert!(
        g.refused.get("fd_exhausted").copied().unwrap_or(0) > 0,
        "the flood did not exhaust the descriptors: {g:?}"
    );
    // The flood's datagrams refused in one burst did not each end a
    // session for the one descriptor the next needed: the receive loop
    // let each ended session close before reading on.
    assert!(g.active_conns > 0, "the flood ended every session: {g:?}");
    // Whatever descriptors the flood's last early drops freed, taken
    // again: the real client meets the exhaustion.
    let mut refill = Vec::new();
    while let Ok(f) = std::fs::File::open("/dev/null") {
        refill.push(f);
        assert!(refill.len() < FLOOD, "bounded");
    }
    let drops_before = g.udp_early_drops;
    let mut buf = [0u8; 16];
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut tries = 0;
    let answered = loop {
        if Instant::now() >= deadline {
            break false;
        }
        tries += 1;
        real.send_to(b"real", vip).unwrap();
        if matches!(real.recv_from(&mut buf), Ok((n, _)) if &buf[..n] == b"real") {
            break true;
        }
    };
    let g = c.global_stats();
    assert!(
        answered,
        "the real client was never served ({tries} tries): {g:?}"
    );
    // Its first datagram frees a descriptor (one worker: the ended
    // session's socket closes before the next datagram is read), a retry
    // takes it.
    assert!(
        g.udp_early_drops > drops_before,
        "no session ended for the real client: {g:?}"
    );
    assert!(tries <= 3, "{tries} tries: {g:?}");
    drop(refill);
    fds.release();
    drop(flood);
    d.shutdown();
}
