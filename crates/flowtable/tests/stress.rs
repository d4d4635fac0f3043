//! Multi-threaded stress: churn, touches, state changes, expiry, early
//! drops and tenant removal race with paged dumps and lookups. Checks that every dump returns
//! each stable entry exactly once and nothing twice, that every entry it
//! lists is one entry's whole (not a node's old key with the fields of the
//! entry it was reused for), and that lookups of stable entries never miss.
//!
//! The default test is short (bounded by iterations and ~2 s); the
//! `#[ignore]`d one runs for a minute:
//! `cargo test -p weir-flowtable --release --test stress -- --ignored`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use weir_flowtable::*;

mod common;

fn key(tenant: u32, i: u32) -> FlowKey {
    common::spread_key(tenant, i, 3)
}

fn init(i: u32) -> FlowInit<'static> {
    common::spread_init(i, 4, 7, 0)
}

/// Whether a listed entry is one entry's whole: the service, backend and
/// owner that its key's entry (number `i`, read back from the client
/// address, see `common::spread_key`) was inserted with. Nothing here
/// changes them later.
fn whole(s: &FlowSnapshot) -> bool {
    let std::net::SocketAddr::V4(c) = s.key.client else {
        return false;
    };
    let i = ((u32::from(*c.ip()) & 0x00ff_ffff) << 8) | u32::from(c.port().wrapping_sub(1024));
    let want = init(i);
    (s.service, s.backend, s.owner) == (want.service, want.backend, want.owner)
}

/// Stable tenants (1 shared, 2 own, and 4 shared but small, so that its
/// listings read its own references instead of walking the table) and a
/// churning tenant 3 that is removed and re-added.
/// `buckets`: few buckets give long chains (harder for the cursor), many
/// keep the long run fast. Per-thread operation caps scale with `duration`.
fn run(duration: Duration, stable: u32, dumps_max: usize, buckets: usize) {
    let scale = duration.as_secs().max(1);
    let t = Arc::new(FlowTable::new(TableConfig {
        shared_buckets: buckets,
        max_shared_entries: 0,
        max_chain: 1024,
        memory_budget: 1 << 24,
        seed: Some(7),
    }));
    // Stable (ESTABLISHED) entries must never expire while time runs on.
    let long = Timeouts {
        established: Millis(1 << 50),
        ..Timeouts::default()
    };
    let own = |own_buckets| TenantConfig {
        own_buckets,
        max_entries: 0,
        timeouts: long,
    };
    t.add_tenant(TenantId(1), own(0)).unwrap();
    t.add_tenant(TenantId(2), own(256)).unwrap();
    t.add_tenant(TenantId(3), TenantConfig::default()).unwrap();
    t.add_tenant(TenantId(4), own(0)).unwrap();
    let mut want = HashMap::new();
    for i in 0..stable {
        for tn in [1, 2] {
            let c = t.insert(key(tn, i), init(i), Millis(0)).unwrap();
            want.insert(c, key(tn, i));
        }
    }
    for i in 0..stable / 64 {
        let c = t.insert(key(4, i), init(i), Millis(0)).unwrap();
        want.insert(c, key(4, i));
    }
    let want = Arc::new(want);
    let stop = Arc::new(AtomicBool::new(false));
    let now = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    let mut hs = Vec::new();

    // Two churners: insert + remove in a private range, touch stable ones.
    for w in 0..2u32 {
        let (t, stop, now) = (Arc::clone(&t), Arc::clone(&stop), Arc::clone(&now));
        hs.push(thread::spawn(move || {
            let mut n = 0u64;
            let mut x = w.wrapping_mul(0x9E37_79B9) | 1;
            while !stop.load(Ordering::Relaxed) && n < 5_000_000 * scale {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                // Tenant 4 churns little, so it stays a small part of the table.
                let tn = if x % 16 == 5 {
                    4
                } else {
                    [1, 2, 3][(x % 3) as usize]
                };
                let i = 1_000_000 + (w << 20) + (x & 0xffff);
                let ms = Millis(now.load(Ordering::Relaxed));
                match t.insert(key(tn, i), init(i), ms) {
                    Ok(_) | Err(InsertError::Exists(_)) | Err(InsertError::NoTenant) => {}
                    Err(e) => panic!("insert: {e}"),
                }
                if x & 1 == 0 {
                    t.remove(&key(tn, i));
                } else {
                    t.set_state(&key(tn, i), FlowState::Close, ms);
                }
                t.touch(&key(1 + (x & 1), x % stable), ms, Dir::In, 100);
                n += 1;
            }
            n
        }));
    }
    // Expirer: time advances 200 ms per round; churned entries expire.
    {
        let (t, stop, now) = (Arc::clone(&t), Arc::clone(&stop), Arc::clone(&now));
        let want = Arc::clone(&want);
        hs.push(thread::spawn(move || {
            let mut n = 0u64;
            let mut out = Vec::new();
            while !stop.load(Ordering::Relaxed) && n < 100_000 * scale {
                let ms = n * 200;
                now.store(ms, Ordering::Relaxed);
                out.clear();
                t.expire(Millis(ms), 1000, &mut out);
                for s in &out {
                    assert!(!want.contains_key(&s.cookie), "stable entry expired");
                    assert!(ms >= s.expires_at.0);
                }
                if n.is_multiple_of(50) {
                    out.clear();
                    t.remove_tenant(TenantId(3), &mut out).unwrap();
                    t.add_tenant(TenantId(3), TenantConfig::default()).unwrap();
                }
                n += 1;
            }
            n
        }));
    }
    // Early drops take churned entries (CLOSE) from every tenant, racing
    // the churners, the expirer, the tenant's removal and the dumps: never
    // a stable entry, never one the pick refuses.
    {
        let (t, stop, now) = (Arc::clone(&t), Arc::clone(&stop), Arc::clone(&now));
        let want = Arc::clone(&want);
        hs.push(thread::spawn(move || {
            let mut n = 0u64;
            let mut taken = 0u64;
            let mut seed = 0x2545_f491_4f6c_dd1du64;
            while !stop.load(Ordering::Relaxed) && n < 2_000_000 * scale {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                let tn = 1 + (seed >> 62) as u32;
                let ms = Millis(now.load(Ordering::Relaxed));
                let close = |c: Candidate| c.state == FlowState::Close;
                if let Ok(s) = t.evict_due_first(TenantId(tn), ms, 64, seed, close) {
                    assert!(!want.contains_key(&s.cookie), "stable entry evicted");
                    assert_eq!(s.state, FlowState::Close);
                    assert_eq!(s.key.tenant, TenantId(tn));
                    taken += 1;
                }
                n += 1;
            }
            assert!(taken > 0, "no early drop in {n} looks");
            n
        }));
    }
    // Lookups of stable entries never miss.
    {
        let (t, stop, want) = (Arc::clone(&t), Arc::clone(&stop), Arc::clone(&want));
        hs.push(thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) && n < 20_000_000 * scale {
                for (c, k) in want.iter().take(64) {
                    let s = t.get(k).expect("stable entry missing");
                    assert_eq!(s.cookie, *c);
                    n += 1;
                }
            }
            n
        }));
    }
    // Dumpers with varying page sizes and filters.
    let mut dumps = 0;
    let mut page = 1usize;
    let mut by_refs = 0;
    while Instant::now() < deadline && dumps < dumps_max {
        let filter = match dumps % 4 {
            0 => DumpFilter::default(),
            1 => DumpFilter {
                tenant: Some(TenantId(2)),
                ..Default::default()
            },
            2 => DumpFilter {
                tenant: Some(TenantId(4)),
                ..Default::default()
            },
            _ => DumpFilter {
                tenant: Some(TenantId(1)),
                ..Default::default()
            },
        };
        let mut seen: HashMap<Cookie, u32> = HashMap::new();
        let mut cur: Option<Cursor> = None;
        let mut out = Vec::new();
        let mut calls = 0u64;
        let work = FlowTable::dump_work_on_this_thread();
        loop {
            out.clear();
            let next = t.dump(cur.as_ref(), &filter, page, &mut out);
            for s in &out {
                *seen.entry(s.cookie).or_default() += 1;
                assert!(filter.matches(s));
                assert!(whole(s), "a torn snapshot listed: {s:?}");
            }
            calls += 1;
            assert!(calls < 10_000_000, "dump does not terminate");
            match next {
                Some(c) => cur = Some(c),
                None => break,
            }
        }
        if FlowTable::dump_work_on_this_thread().1 > work.1 {
            by_refs += 1;
        }
        for (c, n) in &seen {
            assert_eq!(*n, 1, "cookie {c} returned {n} times");
        }
        for (c, k) in want.iter() {
            if filter.tenant.is_none_or(|tn| tn == k.tenant) {
                assert!(seen.contains_key(c), "stable entry {c} ({k:?}) missed");
            }
        }
        dumps += 1;
        page = [1, 3, 17, 256, 5000][dumps % 5];
    }
    stop.store(true, Ordering::Relaxed);
    let counts: Vec<u64> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    eprintln!("dumps {dumps}, worker ops {counts:?}");
    assert!(dumps >= 4, "too few dumps: {dumps}");
    assert!(by_refs > 0, "no dump listed tenant 4 from its references");
    assert!(
        counts.iter().all(|&n| n > 0),
        "a worker made no progress: {counts:?}"
    );
    for tn in [1, 2] {
        assert!(t.tenant_stats(TenantId(tn)).unwrap().entries >= u64::from(stable));
    }
}

#[test]
fn stress_short() {
    run(Duration::from_secs(2), 4000, 40, 1 << 10);
}

#[test]
#[ignore]
fn stress_long() {
    run(Duration::from_secs(60), 50_000, usize::MAX, 1 << 16);
}
