//! Many tenants (seed 000: one tenant's entries must not slow the
//! others): `expire` visits only the tenants with something due, every
//! tenant's entries still expire within a tick of their deadline, a tenant
//! with a few entries holds a small part of an expiry wheel, and a batch of
//! tenants is added as each lone add would be.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};

use weir_flowtable::*;

fn table() -> FlowTable {
    FlowTable::new(TableConfig {
        shared_buckets: 1 << 14,
        memory_budget: 1 << 24,
        seed: Some(11),
        ..TableConfig::default()
    })
}

/// Timeouts of `udp_s` seconds for UDP, `est_s` for established TCP and
/// 2 s for a closed one.
fn timeouts(udp_s: u64, est_s: u64) -> Timeouts {
    Timeouts {
        udp: Millis(udp_s * 1000),
        established: Millis(est_s * 1000),
        close: Millis(2_000),
        ..Timeouts::default()
    }
}

fn shared(udp_s: u64, est_s: u64) -> TenantConfig {
    TenantConfig {
        timeouts: timeouts(udp_s, est_s),
        ..TenantConfig::default()
    }
}

fn key(tenant: u32, i: u32, proto: Proto) -> FlowKey {
    FlowKey {
        tenant: TenantId(tenant),
        proto,
        client: SocketAddr::new(Ipv4Addr::from(0x0a00_0000 | i).into(), 1000),
        virt: "192.0.2.1:80".parse().unwrap(),
    }
}

fn flow(state: FlowState) -> FlowInit<'static> {
    FlowInit {
        owner: 0,
        profile: ProfileRef::NONE,
        service: ServiceId(0),
        backend: BackendId(0),
        state,
    }
}

/// 2,000 tenants with an entry due at 61 s and one with an entry due at
/// 11 s: the calls in between visit that one tenant's wheel once, not
/// 2,001 wheels a call (what `expire` did before the due index: every
/// tenant's wheel on every call, 30 ms a call at 100,000 tenants), and the
/// call that finds the rest due visits each of them once.
#[test]
fn expire_visits_only_tenants_with_something_due() {
    const N: u32 = 2_000;
    const SHORT: u32 = N + 1;
    let t = table();
    let mut batch: Vec<_> = (1..=N).map(|id| (TenantId(id), shared(60, 900))).collect();
    batch.push((TenantId(SHORT), shared(10, 900)));
    assert!(t.add_tenants(&batch).iter().all(Result::is_ok));
    for id in 1..=SHORT {
        t.insert(key(id, id, Proto::Udp), flow(FlowState::Udp), Millis(1_000))
            .unwrap();
    }
    let mut out = Vec::new();
    // Files every entry; nothing is due.
    assert_eq!(t.expire(Millis(1_500), usize::MAX, &mut out), 0);
    let v0 = t.wheel_visits();
    assert_eq!(v0, 0, "the filing call visited wheels");
    for s in 2..=60 {
        t.expire(Millis(s * 1_000 + 500), usize::MAX, &mut out);
        assert!(!t.retiming());
    }
    assert_eq!(out.len(), 1, "the 10 s entry, and only it");
    assert_eq!(out[0].key.tenant, TenantId(SHORT));
    assert_eq!(out[0].expires_at, Millis(11_000));
    assert_eq!(
        t.wheel_visits() - v0,
        1,
        "59 calls with one tenant due in all"
    );
    out.clear();
    // Deadline 61 s, in tick 61: due from 62 s.
    assert_eq!(t.expire(Millis(62_000), usize::MAX, &mut out), N as usize);
    assert_eq!(t.wheel_visits() - v0, 1 + u64::from(N));
    // Every wheel is empty again and out of the index.
    for s in 63..70 {
        assert_eq!(t.expire(Millis(s * 1_000), usize::MAX, &mut out), 0);
    }
    assert_eq!(t.wheel_visits() - v0, 1 + u64::from(N));
    for id in 1..=SHORT {
        assert_eq!(t.wheel_refs(TenantId(id)), Some(0));
    }
}

/// A small deterministic generator (tests stay reproducible).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// 300 tenants with their own timeouts (1-40 s), entries inserted,
/// touched, closed (a shorter timeout: refiled), removed; tenants removed
/// and added again, timeouts shortened (a retime pass) now and then;
/// `expire` every 250 ms. After every call, no entry is past the tick of
/// its deadline (the table's own `expires_at`), and none went early: a
/// tenant the due index forgot, or left too late, fails here.
#[test]
fn every_tenant_expires_within_a_tick_of_its_deadline() {
    const TENANTS: u32 = 300;
    const PERIOD: u64 = 250;
    let t = table();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut cfg: HashMap<u32, (u64, u64)> = HashMap::new();
    let mut batch = Vec::new();
    for id in 1..=TENANTS {
        let c = (1 + rng.below(40), 1 + rng.below(40));
        cfg.insert(id, c);
        batch.push((TenantId(id), shared(c.0, c.1)));
    }
    assert!(t.add_tenants(&batch).iter().all(Result::is_ok));
    let mut live: Vec<FlowKey> = Vec::new();
    let mut next_i = 0u32;
    let mut out = Vec::new();
    let mut expired = 0;
    let mut now = 1_000;
    while now < 150_000 {
        now += PERIOD;
        if now < 100_000 {
            for _ in 0..rng.below(40) {
                let id = 1 + rng.below(u64::from(TENANTS)) as u32;
                next_i += 1;
                let (k, st) = if rng.below(2) == 0 {
                    (key(id, next_i, Proto::Udp), FlowState::Udp)
                } else {
                    (key(id, next_i, Proto::Tcp), FlowState::Established)
                };
                t.insert(k, flow(st), Millis(now)).unwrap();
                live.push(k);
            }
            for _ in 0..rng.below(10) {
                if live.is_empty() {
                    break;
                }
                let j = rng.below(live.len() as u64) as usize;
                let k = live[j];
                match rng.below(4) {
                    0 | 1 => assert!(t.touch(&k, Millis(now), Dir::In, 1).is_some()),
                    2 => assert!(t.set_state(&k, FlowState::Close, Millis(now))),
                    _ => {
                        assert!(t.remove(&k).is_some());
                        live.swap_remove(j);
                    }
                }
            }
            if rng.below(40) == 0 {
                // A tenant removed with its entries, and added again.
                let id = 1 + rng.below(u64::from(TENANTS)) as u32;
                let mut gone = Vec::new();
                t.remove_tenant(TenantId(id), &mut gone).unwrap();
                let before = live.len();
                live.retain(|k| k.tenant.0 != id);
                assert_eq!(gone.len(), before - live.len());
                let c = cfg[&id];
                t.add_tenant(TenantId(id), shared(c.0, c.1)).unwrap();
            }
            if rng.below(40) == 0 {
                // Shorter timeouts: a retime pass, done in the next call
                // (which expires what it finds overdue).
                let id = 1 + rng.below(u64::from(TENANTS)) as u32;
                let c = cfg[&id];
                let c = ((c.0 / 2).max(1), (c.1 / 2).max(1));
                cfg.insert(id, c);
                t.set_timeouts(TenantId(id), timeouts(c.0, c.1)).unwrap();
            }
        }
        out.clear();
        t.expire(Millis(now), usize::MAX, &mut out);
        assert!(!t.retiming(), "a pass over a few entries takes one call");
        for s in &out {
            assert!(now >= s.expires_at.0, "early: {now} < {}", s.expires_at.0);
            let j = live.iter().position(|k| *k == s.key).expect("a live key");
            live.swap_remove(j);
            expired += 1;
        }
        for k in &live {
            let s = t.get(k).expect("a live entry");
            // Tick T is processed from (T + 1) s on: by the call then.
            let due = (s.expires_at.0 / 1_000 + 1) * 1_000;
            assert!(
                now < due,
                "tenant {}: an entry due at {} still there at {now}",
                k.tenant.0,
                s.expires_at.0
            );
        }
    }
    assert!(live.is_empty(), "{} entries never expired", live.len());
    assert!(expired > 1_000, "the test expired only {expired} entries");
}

/// A tenant with one entry holds one chunk of its wheel's slots (64 slot
/// headers), not all 1,025 (~25 KB a tenant before: 2.5 GB at 100,000
/// tenants of one entry each); an emptied wheel holds none.
#[test]
fn a_tenant_with_one_entry_holds_a_small_part_of_a_wheel() {
    const N: u32 = 1_000;
    let t = table();
    let batch: Vec<_> = (1..=N).map(|id| (TenantId(id), shared(60, 900))).collect();
    assert!(t.add_tenants(&batch).iter().all(Result::is_ok));
    for id in 1..=N {
        t.insert(key(id, id, Proto::Udp), flow(FlowState::Udp), Millis(1_000))
            .unwrap();
    }
    let unfiled = t.memory_bytes();
    let mut out = Vec::new();
    t.expire(Millis(1_000), usize::MAX, &mut out);
    let filed = t.memory_bytes();
    let per_tenant = filed.saturating_sub(unfiled) / N as usize;
    assert!(
        (64..4_096).contains(&per_tenant),
        "{per_tenant} bytes of wheel per tenant of one entry"
    );
    assert_eq!(t.expire(Millis(62_000), usize::MAX, &mut out), N as usize);
    assert!(
        t.memory_bytes() <= unfiled,
        "the emptied wheels kept {} bytes",
        t.memory_bytes() - unfiled
    );
}

/// A batch fails each tenant exactly as a lone `add_tenant` would, in
/// order (duplicates in the batch, an id present, a bad size, a table over
/// the budget), adds the rest, and the own tables dump in id order.
#[test]
fn add_tenants_fails_each_as_add_tenant_would() {
    let own = |b: usize| TenantConfig {
        own_buckets: b,
        ..TenantConfig::default()
    };
    let specs = vec![
        (TenantId(9), own(1 << 10)),
        (TenantId(1), TenantConfig::default()),
        (TenantId(7), own(1 << 12)),
        (TenantId(1), own(1 << 10)),
        (TenantId(3), own(1000)),
        (TenantId(4), own(1 << 24)),
        (TenantId(5), own(1 << 10)),
        (TenantId(6), TenantConfig::default()),
    ];
    let lone = table();
    let batched = table();
    for t in [&lone, &batched] {
        t.add_tenant(TenantId(6), own(1 << 10)).unwrap();
    }
    let want: Vec<_> = specs
        .iter()
        .map(|(id, c)| lone.add_tenant(*id, c.clone()))
        .collect();
    let got = batched.add_tenants(&specs);
    assert_eq!(got, want);
    assert!(matches!(got[3], Err(TenantError::Exists(TenantId(1)))));
    assert!(matches!(got[4], Err(TenantError::BadSize(1000))));
    assert!(matches!(
        got[5],
        Ok(Placement::Shared {
            reason: FallbackReason::OverBudget { .. },
            ..
        })
    ));
    assert!(matches!(got[7], Err(TenantError::Exists(TenantId(6)))));
    assert_eq!(batched.add_tenants(&[]), vec![]);
    // Every tenant added works; a dump lists the shared table, then the
    // own tables by id.
    let ids = [1, 4, 5, 6, 7, 9];
    for (i, &id) in ids.iter().enumerate() {
        let k = key(id, i as u32, Proto::Tcp);
        batched
            .insert(k, flow(FlowState::Established), Millis(1_000))
            .unwrap();
    }
    let mut all = Vec::new();
    let mut cur = None;
    loop {
        cur = batched.dump(cur.as_ref(), &DumpFilter::default(), 2, &mut all);
        if cur.is_none() {
            break;
        }
    }
    let order: Vec<u32> = all.iter().map(|s| s.key.tenant.0).collect();
    let shared_first: Vec<u32> = order.iter().copied().take(2).collect();
    let mut sorted_shared = shared_first.clone();
    sorted_shared.sort();
    assert_eq!(
        sorted_shared,
        vec![1, 4],
        "the shared table first: {order:?}"
    );
    assert_eq!(&order[2..], &[5, 6, 7, 9], "own tables by id: {order:?}");
}

/// `maintain` (run by every `expire` call) looks only at the own tables
/// written to since it last ran, and at resizing ones until they finish:
/// it looked at every own table on every call (0.53 ms a call at 10,000
/// own tables with nothing to do). A table that grew and was emptied
/// still shrinks back, and a resize with no writes still finishes.
#[test]
fn maintain_looks_only_at_own_tables_written_to_or_resizing() {
    const N: u32 = 1_000;
    let t = FlowTable::new(TableConfig {
        shared_buckets: 1 << 10,
        memory_budget: 1 << 30,
        seed: Some(5),
        ..TableConfig::default()
    });
    let own = TenantConfig {
        own_buckets: 64,
        ..TenantConfig::default()
    };
    let batch: Vec<_> = (1..=N).map(|id| (TenantId(id), own.clone())).collect();
    assert!(
        t.add_tenants(&batch)
            .iter()
            .all(|r| matches!(r, Ok(Placement::Own { .. })))
    );
    let looked = |f: &dyn Fn()| {
        let before = t.maintained_tables();
        f();
        t.maintained_tables() - before
    };
    assert_eq!(looked(&|| t.maintain()), 0, "nothing written yet");
    let k = key(5, 1, Proto::Tcp);
    t.insert(k, flow(FlowState::Established), Millis(1_000))
        .unwrap();
    assert_eq!(looked(&|| t.maintain()), 1, "the one table written to");
    assert_eq!(looked(&|| t.maintain()), 0);
    assert!(t.remove(&k).is_some());
    assert_eq!(looked(&|| t.maintain()), 1);

    // Grown by inserts, emptied by expiry: shrinks back.
    let buckets = |id| t.tenant_stats(TenantId(id)).unwrap().buckets;
    let small = buckets(9);
    for i in 0..20_000 {
        t.insert(key(9, i, Proto::Tcp), flow(FlowState::Close), Millis(1_000))
            .unwrap();
    }
    for _ in 0..1_000 {
        t.maintain();
    }
    assert!(buckets(9) > small, "did not grow: {}", buckets(9));
    let mut out = Vec::new();
    // All expire (CLOSE: 10 s): removals by the wheel queue the table too.
    assert_eq!(t.expire(Millis(20_000), usize::MAX, &mut out), 20_000);
    let mut calls = 0;
    while buckets(9) > small {
        calls += 1;
        assert!(calls < 1_000, "never shrank back: {} buckets", buckets(9));
        t.maintain();
    }
    // Then, once the last resize was looked at after it ended, nothing.
    assert_eq!(looked(&|| t.maintain()), 1);
    assert_eq!(looked(&|| t.maintain()), 0);

    // A resize nobody writes during still finishes (and the table, empty
    // at 2^20 buckets, then shrinks back a half at a time): one table
    // looked at per call until nothing is left to do.
    let (_, done) = t.resize_state(TenantId(7)).unwrap();
    assert!(t.start_resize(TenantId(7), 1 << 20));
    let mut calls = 0;
    loop {
        calls += 1;
        assert!(calls < 10_000, "maintenance never ended");
        match looked(&|| t.maintain()) {
            0 => break,
            1 => {}
            n => panic!("{n} tables looked at, one written to"),
        }
    }
    let (resizing, resizes) = t.resize_state(TenantId(7)).unwrap();
    assert!(!resizing && resizes > done + 1, "{resizes} resizes");
    assert_eq!(buckets(7), small);
}

/// A batch of removals removes each tenant and its entries, filed in its
/// wheel or still on a filing list, exactly as lone `remove_tenant` calls
/// would (an id absent, or removed earlier in the batch, fails), in one
/// copy of the directory; the other tenants and their entries stay, and
/// the removed own tables' budget comes back.
#[test]
fn remove_tenants_removes_each_as_remove_tenant_would() {
    let own = |b: usize| TenantConfig {
        own_buckets: b,
        ..TenantConfig::default()
    };
    let build = || {
        let t = FlowTable::new(TableConfig {
            shared_buckets: 1 << 12,
            memory_budget: 3 * (1 << 16) * 64,
            seed: Some(3),
            ..TableConfig::default()
        });
        let specs = [
            (TenantId(1), shared(60, 900)),
            (TenantId(2), own(1 << 16)),
            (TenantId(3), shared(60, 900)),
            (TenantId(4), own(1 << 10)),
        ];
        assert!(t.add_tenants(&specs).iter().all(Result::is_ok));
        let mut out = Vec::new();
        for id in 1..=4 {
            for i in 0..200 {
                t.insert(key(id, i, Proto::Udp), flow(FlowState::Udp), Millis(1_000))
                    .unwrap();
            }
            if id == 2 {
                // Filed: tenants 1 and 2's first 200 are in their wheels.
                t.expire(Millis(1_000), usize::MAX, &mut out);
            }
        }
        for id in 1..=4 {
            for i in 200..300 {
                t.insert(key(id, i, Proto::Udp), flow(FlowState::Udp), Millis(2_000))
                    .unwrap();
            }
        }
        t
    };
    let ids = [
        TenantId(3),
        TenantId(1),
        TenantId(3),
        TenantId(99),
        TenantId(2),
    ];
    let (lone, batched) = (build(), build());
    let mut lone_out = Vec::new();
    let mut want = Vec::new();
    for &id in &ids {
        let before = lone_out.len();
        want.push(
            lone.remove_tenant(id, &mut lone_out)
                .map(|()| lone_out.len() - before),
        );
    }
    let mut out = Vec::new();
    let got = batched.remove_tenants(&ids, &mut out);
    assert_eq!(got, want);
    assert_eq!(
        got,
        vec![
            Ok(300),
            Ok(300),
            Err(TenantError::NoTenant(TenantId(3))),
            Err(TenantError::NoTenant(TenantId(99))),
            Ok(300)
        ]
    );
    let keys = |v: &[FlowSnapshot]| v.iter().map(|s| s.key).collect::<Vec<_>>();
    assert_eq!(
        keys(&out),
        keys(&lone_out),
        "the same entries, in tenant order"
    );
    for t in [&lone, &batched] {
        assert_eq!(t.tenants(), vec![TenantId(4)]);
        assert_eq!(t.tenant_stats(TenantId(4)).unwrap().entries, 300);
        assert!(t.get(&key(4, 7, Proto::Udp)).is_some());
        // Tenant 2's own table gave its budget back: room for it again.
        assert!(matches!(
            t.add_tenant(TenantId(2), own(1 << 16)),
            Ok(Placement::Own { .. })
        ));
        // And nothing of the removed tenants expires later.
        let mut later = Vec::new();
        t.expire(Millis(400_000), usize::MAX, &mut later);
        assert!(later.iter().all(|s| s.key.tenant == TenantId(4)));
        assert_eq!(later.len(), 300);
    }
    assert_eq!(
        batched.remove_tenants(&[TenantId(1)], &mut out),
        vec![Err(TenantError::NoTenant(TenantId(1)))]
    );
}

/// A tenant's entry counts take 64 bytes, not a padded line per thread
/// slot (1,624 bytes an empty tenant before, 1,024 of them counters), and
/// stay exact and separate as tenants come and go: a tenant added after
/// others were removed starts at zero, whatever place its counters reuse.
#[test]
fn tenant_counts_are_small_exact_and_separate() {
    let t = table();
    let before = t.memory_bytes();
    let n = 1_000u32;
    let batch: Vec<_> = (1..=n).map(|id| (TenantId(id), shared(60, 60))).collect();
    assert!(t.add_tenants(&batch).iter().all(Result::is_ok));
    let per_tenant = (t.memory_bytes() - before) / n as usize;
    assert!(per_tenant < 1_000, "an empty tenant costs {per_tenant} B");
    let entries = |id: u32| t.tenant_stats(TenantId(id)).map(|s| s.entries);
    // Tenant `id` gets `id % 7` entries.
    for id in 1..=n {
        for i in 0..id % 7 {
            t.insert(key(id, i, Proto::Udp), flow(FlowState::Udp), Millis(1_000))
                .unwrap();
        }
    }
    for id in 1..=n {
        assert_eq!(entries(id), Some(u64::from(id % 7)), "tenant {id}");
    }
    // Remove every other tenant, add as many new ones; the survivors keep
    // their counts and the new ones start empty.
    let mut out = Vec::new();
    for id in (1..=n).step_by(2) {
        t.remove_tenant(TenantId(id), &mut out).unwrap();
    }
    let again: Vec<_> = (n + 1..=n + n / 2)
        .map(|id| (TenantId(id), shared(60, 60)))
        .collect();
    assert!(t.add_tenants(&again).iter().all(Result::is_ok));
    for id in (2..=n).step_by(2) {
        assert_eq!(entries(id), Some(u64::from(id % 7)), "survivor {id}");
    }
    for id in n + 1..=n + n / 2 {
        assert_eq!(entries(id), Some(0), "new tenant {id}");
        t.insert(key(id, 0, Proto::Udp), flow(FlowState::Udp), Millis(2_000))
            .unwrap();
        assert_eq!(entries(id), Some(1), "new tenant {id}");
    }
}
