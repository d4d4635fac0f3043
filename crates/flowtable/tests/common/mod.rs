//! Keys, entries and tables shared by the flow table's integration tests.
//! Each test binary uses only some of them.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use weir_flowtable::*;

/// Client number `i` of `tenant` (10.0.x.y, port 1024 + the low byte) to
/// 192.0.2.1:80; every `udp_every`-th one UDP, the rest TCP.
pub fn spread_key(tenant: u32, i: u32, udp_every: u32) -> FlowKey {
    FlowKey {
        tenant: TenantId(tenant),
        proto: if i.is_multiple_of(udp_every) {
            Proto::Udp
        } else {
            Proto::Tcp
        },
        client: SocketAddr::new(
            Ipv4Addr::from(0x0a00_0000 | (i >> 8)).into(),
            (i & 0xff) as u16 + 1024,
        ),
        virt: "192.0.2.1:80".parse().unwrap(),
    }
}

/// An established entry number `i`: service `i % services`, backend
/// `i % backends`.
pub fn spread_init(i: u32, services: u32, backends: u32, owner: u32) -> FlowInit<'static> {
    FlowInit {
        owner,
        profile: ProfileRef::NONE,
        service: ServiceId(i % services),
        backend: BackendId(i % backends),
        state: FlowState::Established,
    }
}

/// TCP client number `i` (10.x.y.z:40000) of tenant 1 to 127.0.0.1:80.
pub fn tenant_one_key(i: u32) -> FlowKey {
    FlowKey {
        tenant: TenantId(1),
        proto: Proto::Tcp,
        client: SocketAddr::from(([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 40000)),
        virt: "127.0.0.1:80".parse().unwrap(),
    }
}

/// A table of `shared_buckets` buckets, a 1 MiB budget and hash `seed`,
/// holding tenant 1 on the shared table.
pub fn tenant_one_table(shared_buckets: usize, seed: u64) -> FlowTable {
    let table = FlowTable::new(TableConfig {
        shared_buckets,
        memory_budget: 1 << 20,
        seed: Some(seed),
        ..TableConfig::default()
    });
    table
        .add_tenant(TenantId(1), TenantConfig::default())
        .unwrap();
    table
}

/// An entry of service 1 on backend 1 in `state`.
pub fn one_flow(state: FlowState) -> FlowInit<'static> {
    FlowInit {
        owner: 0,
        profile: ProfileRef::NONE,
        service: ServiceId(1),
        backend: BackendId(1),
        state,
    }
}

/// Dumps `t` page by page, calling `between` after each page; returns
/// how often each owner token was seen.
pub fn paged_dump(t: &FlowTable, page: usize, mut between: impl FnMut(usize)) -> HashMap<u32, u32> {
    let mut seen = HashMap::new();
    let mut cur: Option<Cursor> = None;
    let mut out = Vec::new();
    for p in 0..1_000_000 {
        out.clear();
        let next = t.dump(cur.as_ref(), &DumpFilter::default(), page, &mut out);
        for s in &out {
            *seen.entry(s.owner).or_insert(0) += 1;
        }
        match next {
            // Round-trip through the text form, as the admin API does.
            Some(c) => cur = Some(c.to_string().parse().unwrap()),
            None => return seen,
        }
        between(p);
    }
    panic!("dump did not end");
}

/// For 3 s at most, three threads: a writer runs `round` and then 1,000
/// maintenance steps, at least once (however late it is scheduled) and at
/// most 6 times, so that tenant 1's table resizes; a reader `check`s each
/// stable flow `0..stable`, one pass at least; and this one dumps the table
/// in pages of `page` until the writer is done (once at least, 2,000 times
/// at most), each dump seeing the owners `0..stable` once and no owner
/// twice. Then each must have done its part, and the table resized twice.
pub fn dumps_under_resizes(
    t: &Arc<FlowTable>,
    page: usize,
    stable: u32,
    round: impl Fn(&FlowTable) + Send + 'static,
    check: impl Fn(&FlowTable, u32) + Send + 'static,
) {
    let stop = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + Duration::from_secs(3);
    let writer = {
        let (t, stop) = (Arc::clone(t), Arc::clone(&stop));
        thread::spawn(move || {
            let mut rounds = 0;
            while rounds == 0 || (!stop.load(Ordering::Relaxed) && rounds < 6) {
                round(&t);
                for _ in 0..1000 {
                    t.maintain();
                }
                rounds += 1;
            }
            rounds
        })
    };
    let reader = {
        let (t, stop) = (Arc::clone(t), Arc::clone(&stop));
        thread::spawn(move || {
            let mut n = 0u64;
            while n == 0 || (!stop.load(Ordering::Relaxed) && Instant::now() < deadline) {
                for i in 0..stable {
                    check(&t, i);
                    n += 1;
                }
            }
            n
        })
    };
    let mut dumps = 0;
    while dumps == 0 || (!writer.is_finished() && Instant::now() < deadline && dumps < 2_000) {
        let seen = paged_dump(t, page, |_| {});
        for i in 0..stable {
            assert_eq!(seen.get(&i), Some(&1), "dump {dumps}: stable flow {i}");
        }
        assert!(
            seen.values().all(|&c| c == 1),
            "dump {dumps} returned a flow twice"
        );
        dumps += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let rounds = writer.join().unwrap();
    let lookups = reader.join().unwrap();
    let resizes = t.resize_state(TenantId(1)).unwrap().1;
    assert!(rounds >= 1 && lookups > 0 && dumps > 0);
    assert!(
        resizes >= 2,
        "no resize happened under the dumps ({resizes})"
    );
}

/// The model tests' tenants, (id, own buckets): 1 and 3 share the global
/// table, 2 has its own.
pub const TENANTS: [(u32, usize); 3] = [(1, 0), (2, 4), (3, 0)];

/// A tenant of the model tests: `own` buckets of its own (0: on the shared
/// table), no cap, the default timeouts.
pub fn tenant_cfg(own: usize) -> TenantConfig {
    TenantConfig {
        own_buckets: own,
        max_entries: 0,
        timeouts: Timeouts::default(),
    }
}

/// Address `i` of the model tests' small space, so that keys collide often:
/// 10.0.0.i for an even `i`, 2001:db8::i for an odd one.
pub fn model_addr(i: u8, port: u16) -> SocketAddr {
    let ip: std::net::IpAddr = if i.is_multiple_of(2) {
        Ipv4Addr::new(10, 0, 0, i).into()
    } else {
        std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, u16::from(i)).into()
    };
    SocketAddr::new(ip, port)
}
