//! A spoofed datagram flood against a UDP proxy service that exhausts the
//! descriptors. Its own test binary: it lowers the process's fd limit,
//! which the daemon shares with the test (one test at a time, under
//! `FDS`), and the exhaustion's log line, one a second for the process,
//! would hide `daemon_fd_flood`'s.

mod daemon_util;

use std::io::{Read, Write};
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use daemon_util::*;
use weir::config::Protocol;
use weir::control::{Control, GlobalStats};
use weir::daemon::Daemon;

/// The process's fd limit, lowered by one test at a time.
static FDS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// How many forged sources flood: 40 small datagrams fit the listening
/// socket's receive queue, so none is lost before weir reads it.
const FLOOD: usize = 40;

/// The flood's sources, one socket each (made while there are fds).
fn flood_sources() -> Vec<UdpSocket> {
    (0..FLOOD)
        .map(|_| UdpSocket::bind("127.0.0.1:0").unwrap())
        .collect()
}

/// Floods `vip` with a datagram from each of `flood`'s sources with room
/// for a few sessions only (the flood takes them all), waits for it to
/// settle and checks that it exhausted the descriptors, then takes again
/// whatever descriptors the flood's last early drops freed, so that the
/// next client meets the exhaustion. Returns the descriptors taken and
/// the refill (drop the refill, then `release`), and the daemon's figures
/// once the flood settled.
fn flood_to_exhaustion(
    c: &dyn Control,
    vip: SocketAddr,
    flood: &[UdpSocket],
) -> (FdsTaken, Vec<std::fs::File>, GlobalStats) {
    let fds = FdsTaken::all_but(8);
    for f in flood {
        f.send_to(b"x", vip).unwrap();
    }
    // Every datagram of the flood read. Counted from figures that never
    // touched a descriptor: `global_stats` counts the open ones, which
    // opened /proc/self/fd at each call before, and took the descriptor
    // an ended session had just given back (the test below guards that).
    let read = || {
        let t = c.tenants();
        let t = t.iter().find(|t| t.spec.name == "default").unwrap();
        let conns: u64 = c
            .services()
            .iter()
            .filter(|s| s.protocol == "udp")
            .map(|s| s.stats.conns)
            .sum();
        conns + t.refused == flood.len() as u64
    };
    assert!(
        wait_until(Duration::from_secs(10), read),
        "{:?}",
        c.global_stats()
    );
    // And the sessions it ended closed (their tasks give their slots back
    // once their sockets are gone).
    let settled = || {
        let g = c.global_stats();
        g.active_conns == g.stats.conns - g.udp_early_drops
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
    let mut refill = Vec::new();
    while let Ok(f) = std::fs::File::open("/dev/null") {
        refill.push(f);
        assert!(refill.len() < flood.len(), "bounded");
    }
    (fds, refill, g)
}

/// Spoofed datagram flood defence at fd exhaustion: with no
/// `max_connections`, a flood of single datagrams from forged sources
/// opens a session (a socket) per source until the descriptors run out;
/// then a real client's datagram, refused for want of a socket, ends one
/// of those sessions (`udp_early_drops`), and its retry gets a session.
/// The flood's sessions held every descriptor for `udp_timeout` (300 s),
/// and every new client was refused meanwhile.
#[test]
fn a_udp_client_at_fd_exhaustion_gets_a_session_on_retry() {
    let _fds = FDS.lock().unwrap_or_else(|e| e.into_inner());
    let b = udp_echo();
    let mut cfg = config(vec![service("u", Protocol::Udp, "rr", vec![backend(b, 1)])]);
    cfg.daemon.workers = 1;
    let d = Daemon::start(cfg, None).unwrap();
    let c = d.control();
    let vip = d.service_addr("default", "u").unwrap();
    // The flood's sources and the real client, made while there are fds.
    let flood = flood_sources();
    let real = UdpSocket::bind("127.0.0.1:0").unwrap();
    real.set_read_timeout(Some(Duration::from_secs(1))).unwrap();

    // The real client meets the exhaustion.
    let (fds, refill, g) = flood_to_exhaustion(c.as_ref(), vip, &flood);
    // The flood's datagrams refused in one burst did not each end a
    // session for the one descriptor the next needed: the receive loop
    // let each ended session close before reading on.
    assert!(g.active_conns > 0, "the flood ended every session: {g:?}");
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

/// The same flood holding every descriptor does not lock the TCP services
/// out: a TCP client's accept, and its connect to the backend, each end a
/// single-datagram UDP session to free the descriptor they need
/// (`udp::free_a_descriptor`). Before, accept backed off until the flood's
/// sessions timed out (`udp_timeout`, 300 s): no TCP client of any tenant
/// got in meanwhile.
#[test]
fn a_tcp_client_is_served_while_a_udp_flood_holds_every_descriptor() {
    let _fds = FDS.lock().unwrap_or_else(|e| e.into_inner());
    let b = udp_echo();
    let e = Echo::start();
    let mut cfg = config(vec![
        service("u", Protocol::Udp, "rr", vec![backend(b, 1)]),
        service("t", Protocol::Tcp, "rr", vec![backend(e.addr, 1)]),
    ]);
    cfg.daemon.workers = 1;
    let d = Daemon::start(cfg, None).unwrap();
    let c = d.control();
    let uvip = d.service_addr("default", "u").unwrap();
    let tvip = d.service_addr("default", "t").unwrap();
    let flood = flood_sources();
    // The TCP client's socket first: its connect then needs no descriptor.
    let mut client =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();

    // The TCP client meets the exhaustion.
    let (fds, refill, g) = flood_to_exhaustion(c.as_ref(), uvip, &flood);
    let drops_before = g.udp_early_drops;
    client.connect(&tvip.into()).unwrap();
    // Accepted and connected to its backend (the backend's kernel
    // finishes the handshake; the test's echo thread accepts it once
    // descriptors are back): ESTABLISHED in weir.
    let established = || {
        c.services()
            .iter()
            .any(|s| s.name == "t" && s.backends.iter().any(|b| b.active_conns == 1))
    };
    let served = wait_until(Duration::from_secs(10), established);
    let g = c.global_stats();
    assert!(served, "the TCP client never got through: {g:?}");
    assert!(
        g.udp_early_drops > drops_before,
        "no UDP session ended for it: {g:?}"
    );
    drop(refill);
    fds.release();
    // And it is a working connection.
    client.write_all(b"tcp").unwrap();
    let mut buf = [0u8; 3];
    client.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"tcp");
    drop(client);
    drop(flood);
    d.shutdown();
}

/// Reading the stats takes no descriptor: they count the open ones through
/// a handle kept for it. Before, each call opened /proc/self/fd, which took
/// the lowest free descriptor while it read: an operator (or this suite)
/// polling the stats during an fd exhaustion took the descriptors ended
/// UDP sessions gave back, and a flood then ended a session per datagram.
/// Here a thread polls the stats while this one opens a file again and
/// again: it must get the same, lowest, descriptor every time.
#[test]
fn reading_the_stats_takes_no_descriptor() {
    let _fds = FDS.lock().unwrap_or_else(|e| e.into_inner());
    let d = Daemon::start(config(Vec::new()), None).unwrap();
    let c = d.control();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (polls, moved) = std::thread::scope(|s| {
        let poller = s.spawn(|| {
            let mut polls = 0u32;
            let mut counted = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && polls < 1_000_000 {
                counted = c.global_stats().open_fds;
                polls += 1;
            }
            assert!(counted > 0, "no descriptor counted");
            polls
        });
        let first = std::fs::File::open("/dev/null").unwrap();
        let lowest = std::os::fd::AsRawFd::as_raw_fd(&first);
        drop(first);
        let mut moved = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(2);
        for _ in 0..200_000 {
            if Instant::now() >= deadline {
                break;
            }
            let f = std::fs::File::open("/dev/null").unwrap();
            let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
            if fd != lowest {
                moved.push(fd);
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (poller.join().unwrap(), moved)
    });
    assert!(polls > 100, "the stats were read {polls} times only");
    assert!(
        moved.is_empty(),
        "{} of the opens found their descriptor taken (got {:?}...) while the stats were read {polls} times",
        moved.len(),
        &moved[..moved.len().min(5)]
    );
    d.shutdown();
}
