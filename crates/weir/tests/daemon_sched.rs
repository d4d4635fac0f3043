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
/// cannot take it is refused. It used to go to the first usable backend in
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
        d.shutdown();
    }
}
