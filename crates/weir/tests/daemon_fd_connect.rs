//! A connection whose backend connect found weir out of descriptors waits
//! and tries again (docs/daemon.md, step 4), its flow-table entry kept
//! meanwhile: it is listed, a kill reaches it, and so does a deletion of
//! its service. Its own test binary: it lowers the process's fd limit (one
//! test at a time, under `FDS`).

mod daemon_util;

use std::time::Duration;

use daemon_util::*;
use weir::config::Protocol;
use weir::daemon::Daemon;

const T: Duration = Duration::from_secs(10);

/// The process's fd limit, lowered by one test at a time.
static FDS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A daemon with one rr TCP service `s` (one worker) before `n` echo
/// backends, and a client connection it has accepted with every descriptor taken
/// but the one its accept takes: its socket towards the backend finds none
/// (EMFILE) and it waits. `waiting`: whether the service counted it opened
/// within `T` (its first attempt opened an entry: it is in the descriptor
/// wait now, or about to be); the descriptors are still taken.
struct Waiting {
    echoes: Vec<Echo>,
    d: weir::daemon::DaemonHandle,
    client: socket2::Socket,
    fds: FdsTaken,
    waiting: bool,
}

impl Waiting {
    fn start(n: usize) -> Self {
        let echoes: Vec<Echo> = (0..n).map(|_| Echo::start()).collect();
        let mut cfg = config(vec![service(
            "s",
            Protocol::Tcp,
            "rr",
            echoes.iter().map(|e| backend(e.addr, 1)).collect(),
        )]);
        cfg.daemon.workers = 1;
        let d = Daemon::start(cfg, None).unwrap();
        let c = d.control();
        let vip = d.service_addr("default", "s").unwrap();
        // The client's socket first: its connect then needs no descriptor.
        let client =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let fds = FdsTaken::all_but(1);
        client.connect(&vip.into()).unwrap();
        let waiting = wait_until(T, || {
            c.services()
                .iter()
                .any(|s| s.name == "s" && s.stats.conns >= 1)
        });
        Self {
            echoes,
            d,
            client,
            fds,
            waiting,
        }
    }
}

/// Deleted while the connection waited for a descriptor, the service's
/// connection must not go on to open a new entry and proxy to the deleted
/// service's backend once descriptors are back.
#[test]
fn a_connection_waiting_for_descriptors_ends_with_its_deleted_service() {
    let _fds = FDS.lock().unwrap_or_else(|e| e.into_inner());
    let w = Waiting::start(1);
    let c = w.d.control();
    c.delete_service("default", "s").unwrap();
    let Waiting {
        echoes: _echoes,
        d,
        client,
        fds,
        waiting,
    } = w;
    fds.release();
    assert!(waiting, "the connection never reached its backend connect");
    let mut s: std::net::TcpStream = client.into();
    assert!(
        !still_echoes(&mut s),
        "a connection of the deleted service was proxied to its backend"
    );
    assert!(wait_until(T, || c.global_stats().active_conns == 0));
    d.shutdown();
}

/// While it waits for a descriptor, the connection is in the table: listed
/// (in `SYN_RECV`, towards its backend) and killed by its cookie, which
/// ends it there and then; it never reaches the backend. Before, its entry
/// was removed for the wait: the listing missed it and the kill found
/// nothing (404).
#[test]
fn a_connection_waiting_for_descriptors_is_listed_and_can_be_killed() {
    let _fds = FDS.lock().unwrap_or_else(|e| e.into_inner());
    let Waiting {
        echoes,
        d,
        client,
        fds,
        waiting,
    } = Waiting::start(1);
    let c = d.control();
    let listed = || {
        c.connections(&Default::default(), None, 10)
            .unwrap()
            .connections
    };
    // From its first failed attempt until the tries run out (~1.3 s) it
    // waits, and must be listed all along.
    let seen = listed();
    let killed = seen.first().map(|conn| c.kill(conn.cookie, None));
    fds.release();
    assert!(waiting, "the connection never reached its backend connect");
    assert_eq!(seen.len(), 1, "not listed while it waits: {seen:?}");
    assert_eq!(seen[0].state, "SYN_RECV");
    assert_eq!(seen[0].backend, echoes[0].addr.to_string());
    assert_eq!(killed, Some(Ok(())));
    let mut s: std::net::TcpStream = client.into();
    assert!(!still_echoes(&mut s), "a killed connection was proxied");
    assert!(wait_until(T, || c.global_stats().active_conns == 0));
    assert!(listed().is_empty());
    d.shutdown();
}

/// The connect that found no descriptor is retried on the same backend,
/// as docs/daemon.md says ("the same choice is retried"), and served there
/// once descriptors are back: rr over two backends does not move on to
/// the second for the retry, and the first counts one attempt, not one
/// per try. (Ported from a review's test: each retry used to ask the
/// scheduler again, and the retry went to the second backend.)
#[test]
fn a_connect_short_of_descriptors_retries_the_same_backend() {
    let _fds = FDS.lock().unwrap_or_else(|e| e.into_inner());
    let Waiting {
        echoes,
        d,
        client,
        fds,
        waiting,
    } = Waiting::start(2);
    fds.release();
    assert!(waiting, "the connection never reached its backend connect");
    let mut s: std::net::TcpStream = client.into();
    assert!(still_echoes(&mut s), "served once descriptors are back");
    let c = d.control();
    let attempts: Vec<u64> = c
        .services()
        .into_iter()
        .find(|s| s.name == "s")
        .map(|s| s.backends.iter().map(|b| b.stats.conns).collect())
        .unwrap_or_default();
    let accepted = |e: &Echo| e.accepted.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        (accepted(&echoes[0]), accepted(&echoes[1]), attempts),
        (1, 0, vec![1, 0]),
        "the retry went to another backend, or counted again"
    );
    d.shutdown();
}
