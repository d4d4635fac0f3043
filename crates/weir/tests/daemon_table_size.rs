//! A tenant's flow table sized from its config: `table_entries` is where it
//! starts, `max_table_entries` its cap. Driven by UDP sessions (one entry
//! each, and no client fd to keep open per session): the table grows past
//! its starting size while sessions arrive, then holds exactly its cap and
//! refuses the next sessions as `table_full`.

mod daemon_util;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::time::Duration;

use daemon_util::*;
use weir::config::{Protocol, TenantSpec};
use weir::control::{Control, TableReport};
use weir::daemon::Daemon;

const START: usize = 256;
const CAP: usize = 1024;

/// Client `i` sends from its own loopback address (127.1.x.y answers as
/// loopback), so every session has its own key whatever port it gets.
fn client(i: usize) -> UdpSocket {
    let ip = Ipv4Addr::new(127, 1, (i / 250) as u8, (i % 250) as u8 + 1);
    let s = UdpSocket::bind(SocketAddr::new(IpAddr::V4(ip), 0)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

fn report(c: &dyn Control) -> TableReport {
    c.table()
        .into_iter()
        .find(|t| t.tenant == "big")
        .expect("tenant big has a table report")
}

#[test]
fn a_tenant_table_grows_from_table_entries_and_holds_max_table_entries() {
    let b = udp_echo();
    let mut svc = service("u", Protocol::Udp, "rr", vec![backend(b, 1)]);
    svc.tenant = "big".into();
    let mut cfg = config(vec![svc]);
    // One worker: sessions are inserted one after another, so the table
    // holds exactly its cap (concurrent inserts may overshoot it a little).
    cfg.daemon.workers = 1;
    cfg.tenants.push(TenantSpec {
        name: "big".into(),
        table_entries: START,
        max_table_entries: CAP,
        ..TenantSpec::default()
    });
    let d = Daemon::start(cfg, None).unwrap();
    let c = d.control();
    let vip = d.service_addr("big", "u").unwrap();
    let first = report(&*c);
    assert_eq!((first.placement.as_str(), first.entries), ("own", 0));

    // Up to the cap: every session is answered (a round trip each, so the
    // service's socket never drops a datagram), so every one is an entry.
    let mut buf = [0u8; 16];
    for i in 0..CAP {
        let s = client(i);
        s.send_to(b"hello", vip).unwrap();
        let (n, from) = s
            .recv_from(&mut buf)
            .unwrap_or_else(|e| panic!("session {i} unanswered: {e}; {:?}", report(&*c)));
        assert_eq!((&buf[..n], from), (&b"hello"[..], vip));
    }
    let full = report(&*c);
    assert_eq!(full.entries, CAP as u64, "{full:?}");
    assert!(
        full.buckets >= 2 * first.buckets,
        "the table did not grow from {} buckets: {full:?}",
        first.buckets
    );
    assert_eq!(full.refused_inserts, 0, "{full:?}");

    // Past the cap: refused, counted as table_full, and the table stays.
    const MORE: usize = 40;
    let extra: Vec<UdpSocket> = (CAP..CAP + MORE).map(client).collect();
    for s in &extra {
        s.send_to(b"hello", vip).unwrap();
    }
    let refused = || c.global_stats().refused.get("table_full").copied();
    assert!(
        wait_until(Duration::from_secs(10), || refused() == Some(MORE as u64)),
        "table_full refusals: {:?}, table {:?}",
        refused(),
        report(&*c)
    );
    let after = report(&*c);
    assert_eq!(
        (after.entries, after.refused_inserts),
        (CAP as u64, MORE as u64),
        "{after:?}"
    );
    extra[0]
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    assert!(
        extra[0].recv_from(&mut buf).is_err(),
        "a refused session was answered"
    );
    let big = c.tenants().into_iter().find(|t| t.spec.name == "big");
    assert_eq!(big.map(|t| t.refused), Some(MORE as u64));
    d.shutdown();
}
