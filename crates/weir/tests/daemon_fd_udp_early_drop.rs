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

/// Sources that reach one socket each of a two-socket `SO_REUSEPORT`
/// group on `127.0.0.1`: `per[0]` for the group's first socket and
/// `per[1]` for its second, and the group's port. The kernel picks a
/// group's socket by a hash of the datagram's addresses and ports over
/// the group's size, so a daemon with two workers that listens on the
/// port next has the first sources' datagrams read by one worker and the
/// second's by the other. Learnt from a group of the test's own, on a port
/// no socket held, closed before the daemon binds it (which the caller
/// tries again on another port if something took it meanwhile).
fn sources_by_worker(per: [usize; 2]) -> (u16, [Vec<UdpSocket>; 2]) {
    use socket2::{Domain, Socket, Type};
    let port = UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let to: SocketAddr = (std::net::Ipv4Addr::LOCALHOST, port).into();
    let group: Vec<UdpSocket> = (0..2)
        .map(|_| {
            let s = Socket::new(Domain::IPV4, Type::DGRAM, None).unwrap();
            s.set_reuse_port(true).unwrap();
            s.bind(&to.into()).unwrap();
            s.set_nonblocking(true).unwrap();
            s.into()
        })
        .collect();
    let mut reach: [Vec<UdpSocket>; 2] = Default::default();
    let mut buf = [0u8; 4];
    // Bounded: each candidate reaches either socket with even odds.
    for _ in 0..(per[0] + per[1]) * 20 {
        if reach[0].len() >= per[0] && reach[1].len() >= per[1] {
            break;
        }
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        let me = s.local_addr().unwrap();
        s.send_to(b"p", to).unwrap();
        let mut got = None;
        // On loopback the datagram is queued before send_to returns.
        let reached = wait_until(Duration::from_secs(5), || {
            got = (0..2)
                .find(|&i| matches!(group[i].recv_from(&mut buf), Ok((_, from)) if from == me));
            got.is_some()
        });
        assert!(reached, "the probe from {me} reached neither socket");
        let i = got.unwrap();
        if reach[i].len() < per[i] {
            reach[i].push(s);
        }
    }
    assert!(
        reach[0].len() == per[0] && reach[1].len() == per[1],
        "{} and {} sources",
        reach[0].len(),
        reach[1].len()
    );
    (port, reach)
}

/// Descriptors free now: opened until the limit refuses, returned open.
fn free_descriptors(bound: usize) -> Vec<std::fs::File> {
    let mut free = Vec::new();
    while let Ok(f) = std::fs::File::open("/dev/null") {
        free.push(f);
        assert!(free.len() <= bound, "bounded");
    }
    free
}

/// A burst of new clients at fd exhaustion on one worker, while the
/// sessions holding the descriptors are the other worker's, ends only the
/// sessions the burst needs: a descriptor an ended session gives back goes
/// to the next new session, and while one is on its way back a refused
/// datagram ends no other. Before, the ended session's socket closed when
/// its own worker ran its task, and every datagram the first worker read
/// meanwhile, refused again, ended one more: descriptors were left free
/// that no datagram needed, each a session (a real client's, in a real
/// flood) ended for nothing (up to all 16 here, with none of the 32 new
/// clients let in). That took the other worker being slower to run the
/// ended session's task than the first to read its next datagram, which
/// more than half the rounds met here: the test runs [`ROUNDS`] of them,
/// each with a daemon of its own.
#[test]
fn a_burst_on_one_worker_ends_only_the_other_workers_sessions_it_needs() {
    let _fds = FDS.lock().unwrap_or_else(|e| e.into_inner());
    let b = udp_echo();
    for round in 0..ROUNDS {
        let (wasted, g) = burst_round(b);
        // At most the last refused datagram's, for the retry it would send.
        assert!(
            wasted <= 1,
            "round {round}: {wasted} sessions ended for nothing: {g:?}"
        );
    }
}

/// Rounds of [`a_burst_on_one_worker_ends_only_the_other_workers_sessions_it_needs`].
const ROUNDS: usize = 10;

/// One round of the burst against a new daemon in front of `backend`:
/// how many sessions its early drops ended that no session of the burst
/// took the place of, and the daemon's figures then.
fn burst_round(backend_addr: SocketAddr) -> (u64, GlobalStats) {
    const SPARE: usize = 16;
    const BURST: usize = 32;
    // The sessions holding the descriptors on one worker, the burst on the
    // other (the port taken between the probe and the daemon's bind:
    // another port, bounded).
    let (d, [holders, burst]) = (0..5)
        .find_map(|_| {
            let (port, sources) = sources_by_worker([SPARE, BURST]);
            let mut svc = service("u", Protocol::Udp, "rr", vec![backend(backend_addr, 1)]);
            svc.listen = (std::net::Ipv4Addr::LOCALHOST, port).into();
            let mut cfg = config(vec![svc]);
            cfg.daemon.workers = 2;
            Some((Daemon::start(cfg, None).ok()?, sources))
        })
        .expect("no port for the service");
    let c = d.control();
    let vip = d.service_addr("default", "u").unwrap();
    let sessions = || c.global_stats().stats.conns;

    let fds = FdsTaken::all_but(SPARE);
    for h in &holders {
        h.send_to(b"h", vip).unwrap();
    }
    assert!(
        wait_until(Duration::from_secs(10), || sessions() == SPARE as u64),
        "{:?}",
        c.global_stats()
    );
    // Whatever is left (a descriptor closed elsewhere meanwhile) is taken:
    // the burst meets the exhaustion at its first datagram.
    let taken = free_descriptors(BURST);
    let g = c.global_stats();
    assert_eq!(g.udp_early_drops, 0, "{g:?}");

    for s in &burst {
        s.send_to(b"x", vip).unwrap();
    }
    // Every datagram of the burst read (a session or a refusal), and the
    // sessions it ended closed (their tasks give their slots back once
    // their sockets are gone).
    let read = || {
        let g = c.global_stats();
        g.stats.conns + g.refused.values().sum::<u64>() == (SPARE + BURST) as u64
            && g.active_conns == g.stats.conns - g.udp_early_drops
    };
    assert!(
        wait_until(Duration::from_secs(10), read),
        "{:?}",
        c.global_stats()
    );
    let g = c.global_stats();
    let free = free_descriptors(BURST);
    let opened = g.stats.conns - SPARE as u64;
    // Each early drop gave a descriptor back and each new session took
    // one: what is free now is what early drops freed for nothing.
    assert_eq!(g.udp_early_drops, opened + free.len() as u64, "{g:?}");
    assert!(g.udp_early_drops > 0, "the burst ended no session: {g:?}");
    drop((free, taken));
    fds.release();
    drop((holders, burst));
    d.shutdown();
    (g.udp_early_drops - opened, g)
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
