//! Property test: random operation sequences against a `HashMap` model,
//! including expiry, tenant removal and paged dumps with filters.

use std::collections::HashMap;

use common::{TENANTS, model_addr, tenant_cfg};
use proptest::prelude::*;
use weir_flowtable::*;

mod common;

#[derive(Clone, Debug)]
struct K(u8, bool, u8, u16, u8, u16);

impl K {
    fn key(&self) -> FlowKey {
        FlowKey {
            tenant: TenantId(TENANTS[usize::from(self.0) % 3].0),
            proto: if self.1 { Proto::Udp } else { Proto::Tcp },
            client: model_addr(self.2, 1000 + self.3),
            virt: model_addr(100 + self.4, 80 + self.5),
        }
    }
}

fn arb_key() -> impl Strategy<Value = K> {
    (0u8..3, any::<bool>(), 0u8..6, 0u16..3, 0u8..2, 0u16..2)
        .prop_map(|(a, b, c, d, e, f)| K(a, b, c, d, e, f))
}

fn arb_state() -> impl Strategy<Value = FlowState> {
    (0usize..10).prop_map(|i| FlowState::ALL[i])
}

#[derive(Clone, Debug)]
enum Op {
    Insert(K, u32, u32, FlowState),
    Remove(K),
    Get(K),
    Touch(K, bool, u64),
    SetState(K, FlowState),
    Advance(u64),
    Expire(usize),
    Dump(usize, Option<u8>, Option<u32>, Option<FlowState>),
    RemoveTenant(u8),
    /// Tenant, and per state: its default timeout times 1/100, 1/10, 1 or 2.
    SetTimeouts(u8, [u8; 10]),
    Hold(K),
    Release(K),
    InsertHeld(K, u32, u32),
    Rebind(K, u32),
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (arb_key(), 0u32..3, 0u32..3, arb_state()).prop_map(|(k, s, b, st)| Op::Insert(k, s, b, st)),
        2 => arb_key().prop_map(Op::Remove),
        2 => arb_key().prop_map(Op::Get),
        3 => (arb_key(), any::<bool>(), 0u64..2000).prop_map(|(k, d, b)| Op::Touch(k, d, b)),
        1 => (arb_key(), arb_state()).prop_map(|(k, s)| Op::SetState(k, s)),
        2 => (0u64..120_000).prop_map(Op::Advance),
        2 => (0usize..6).prop_map(Op::Expire),
        1 => (1usize..6, proptest::option::of(0u8..3), proptest::option::of(0u32..3), proptest::option::of(arb_state()))
            .prop_map(|(p, t, s, st)| Op::Dump(p, t, s, st)),
        1 => (0u8..3).prop_map(Op::RemoveTenant),
        1 => (0u8..3, proptest::array::uniform10(0u8..4)).prop_map(|(t, s)| Op::SetTimeouts(t, s)),
        2 => arb_key().prop_map(Op::Hold),
        2 => arb_key().prop_map(Op::Release),
        1 => (arb_key(), 0u32..3, 0u32..3).prop_map(|(k, s, b)| Op::InsertHeld(k, s, b)),
        1 => (arb_key(), 0u32..3).prop_map(|(k, b)| Op::Rebind(k, b)),
    ]
}

#[derive(Clone, Debug)]
struct M {
    cookie: Cookie,
    service: u32,
    backend: u32,
    state: FlowState,
    created: u64,
    last: u64,
    /// Bytes in and out; on a template (state Persist) the second word is
    /// the hold count, as in the table.
    bytes: [u64; 2],
    pkts: [u64; 2],
}

impl M {
    fn template(&self) -> bool {
        self.state == FlowState::Persist
    }

    fn held(&self) -> u64 {
        if self.template() { self.bytes[1] } else { 0 }
    }
}

type Tmo = HashMap<u32, Timeouts>;

fn expect(k: &FlowKey, m: &M, tmo: &Tmo) -> FlowSnapshot {
    let last = m.last;
    FlowSnapshot {
        key: *k,
        cookie: m.cookie,
        service: ServiceId(m.service),
        backend: BackendId(m.backend),
        state: m.state,
        // The table keeps creation times in whole seconds.
        created: Millis(m.created / 1000 * 1000),
        last_active: Millis(last),
        expires_at: Millis(last + tmo[&k.tenant.0].get(m.state).0),
        bytes_in: m.bytes[0],
        bytes_out: if m.template() { 0 } else { m.bytes[1] },
        held: m.held() as u32,
        packets_in: m.pkts[0],
        packets_out: m.pkts[1],
        owner: 0,
        nat: 0,
        reply: false,
    }
}

fn new_table() -> FlowTable {
    let t = FlowTable::new(TableConfig {
        shared_buckets: 8,
        max_shared_entries: 0,
        max_chain: 1024,
        memory_budget: 1 << 20,
        seed: Some(42),
    });
    for (id, own) in TENANTS {
        let p = t.add_tenant(TenantId(id), tenant_cfg(own)).unwrap();
        if own > 0 {
            assert_eq!(p, Placement::Own { buckets: own });
        }
    }
    t
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let t = new_table();
    let mut model: HashMap<FlowKey, M> = HashMap::new();
    let mut now = 1_000u64;
    let mut cookies = std::collections::HashSet::new();
    let mut tmo: Tmo = TENANTS
        .iter()
        .map(|&(id, _)| (id, Timeouts::default()))
        .collect();
    for op in ops {
        match op {
            Op::Insert(k, s, b, st) => {
                let key = k.key();
                let init = FlowInit {
                    owner: 0,
                    profile: ProfileRef::NONE,
                    service: ServiceId(s),
                    backend: BackendId(b),
                    state: st,
                };
                let r = t.insert(key, init, Millis(now));
                match model.get(&key) {
                    Some(m) => prop_assert_eq!(r, Err(InsertError::Exists(m.cookie))),
                    None => {
                        let c = r.map_err(|e| TestCaseError::fail(format!("insert: {e}")))?;
                        prop_assert!(
                            c.0 != 0 && cookies.insert(c.0),
                            "cookies unique and non-zero"
                        );
                        model.insert(
                            key,
                            M {
                                cookie: c,
                                service: s,
                                backend: b,
                                state: st,
                                created: now,
                                last: now,
                                bytes: [0; 2],
                                pkts: [0; 2],
                            },
                        );
                    }
                }
            }
            Op::Remove(k) => {
                let key = k.key();
                let r = t.remove(&key);
                let m = model.remove(&key);
                prop_assert_eq!(r, m.map(|m| expect(&key, &m, &tmo)));
            }
            Op::Get(k) => {
                let key = k.key();
                prop_assert_eq!(t.get(&key), model.get(&key).map(|m| expect(&key, m, &tmo)));
                // A cookie names its entry: the same snapshot, one read.
                if let Some(m) = model.get(&key) {
                    prop_assert_eq!(t.get_cookie(m.cookie), Some(expect(&key, m, &tmo)));
                }
            }
            Op::Touch(k, out, bytes) => {
                let key = k.key();
                let dir = if out { Dir::Out } else { Dir::In };
                let r = t.touch(&key, Millis(now), dir, bytes);
                match model.get_mut(&key) {
                    Some(m) => {
                        prop_assert_eq!(r, Some((m.cookie, BackendId(m.backend))));
                        // Never bytes out on a template (its hold count).
                        if !(out && m.template()) {
                            m.bytes[usize::from(out)] += bytes;
                        }
                        m.pkts[usize::from(out)] += 1;
                        m.last = now;
                    }
                    None => prop_assert_eq!(r, None),
                }
            }
            Op::SetState(k, st) => {
                let key = k.key();
                let r = t.set_state(&key, st, Millis(now));
                match model.get_mut(&key) {
                    Some(m) => {
                        prop_assert!(r);
                        m.state = st;
                        m.last = now;
                    }
                    None => prop_assert!(!r),
                }
            }
            Op::Advance(ms) => now += ms,
            Op::Expire(max) => {
                let mut out = Vec::new();
                let n = t.expire(Millis(now), max, &mut out);
                prop_assert_eq!(n, out.len());
                prop_assert!(n <= max);
                for s in out {
                    let m = model.remove(&s.key);
                    prop_assert!(m.is_some(), "expired entry not in model");
                    let m = m.unwrap();
                    prop_assert!(m.held() == 0, "a held template expired");
                    prop_assert_eq!(s, expect(&s.key, &m, &tmo));
                    prop_assert!(
                        now >= s.expires_at.0,
                        "expired early: now {} deadline {}",
                        now,
                        s.expires_at.0
                    );
                }
            }
            Op::Dump(page, tenant, service, state) => {
                let filter = DumpFilter {
                    tenant: tenant.map(|i| TenantId(TENANTS[usize::from(i)].0)),
                    service: service.map(ServiceId),
                    backend: None,
                    state,
                };
                let mut got = Vec::new();
                let mut cur: Option<Cursor> = None;
                let mut calls = 0;
                loop {
                    calls += 1;
                    prop_assert!(calls < 1000, "dump does not end");
                    let before = got.len();
                    let next = t.dump(cur.as_ref(), &filter, page, &mut got);
                    prop_assert!(got.len() - before <= page);
                    match next {
                        None => break,
                        // Round-trip the cursor through its string form.
                        Some(c) => cur = Some(c.to_string().parse().unwrap()),
                    }
                }
                let mut want: Vec<FlowSnapshot> = model
                    .iter()
                    .map(|(k, m)| expect(k, m, &tmo))
                    .filter(|s| filter.matches(s))
                    .collect();
                want.sort_by_key(|s| s.cookie);
                let n = got.len();
                got.sort_by_key(|s| s.cookie);
                got.dedup_by_key(|s| s.cookie);
                prop_assert_eq!(n, got.len(), "duplicates in dump");
                prop_assert_eq!(got, want);
            }
            Op::RemoveTenant(i) => {
                let (id, own) = TENANTS[usize::from(i)];
                let mut out = Vec::new();
                t.remove_tenant(TenantId(id), &mut out).unwrap();
                let mut want: Vec<FlowSnapshot> = model
                    .iter()
                    .filter(|(k, _)| k.tenant.0 == id)
                    .map(|(k, m)| expect(k, m, &tmo))
                    .collect();
                model.retain(|k, _| k.tenant.0 != id);
                want.sort_by_key(|s| s.cookie);
                out.sort_by_key(|s| s.cookie);
                prop_assert_eq!(out, want);
                prop_assert_eq!(t.tenant_stats(TenantId(id)), None);
                t.add_tenant(TenantId(id), tenant_cfg(own)).unwrap();
                tmo.insert(id, Timeouts::default());
            }
            Op::SetTimeouts(i, scale) => {
                let id = TENANTS[usize::from(i)].0;
                let d = Timeouts::default();
                let mut a = FlowState::ALL.map(|s| d.get(s).0);
                for (v, s) in a.iter_mut().zip(scale) {
                    *v = match s {
                        0 => *v / 100,
                        1 => *v / 10,
                        2 => *v,
                        _ => *v * 2,
                    };
                }
                let new = Timeouts {
                    syn_sent: Millis(a[0]),
                    syn_recv: Millis(a[1]),
                    established: Millis(a[2]),
                    fin_wait: Millis(a[3]),
                    close_wait: Millis(a[4]),
                    last_ack: Millis(a[5]),
                    time_wait: Millis(a[6]),
                    close: Millis(a[7]),
                    udp: Millis(a[8]),
                    persist: Millis(a[9]),
                };
                t.set_timeouts(TenantId(id), new).unwrap();
                tmo.insert(id, new);
            }
            Op::Hold(k) => {
                let key = k.key();
                let r = t.hold(&key);
                match model.get_mut(&key) {
                    Some(m) if m.template() => {
                        prop_assert_eq!(r, Some(BackendId(m.backend)));
                        m.bytes[1] += 1;
                    }
                    _ => prop_assert_eq!(r, None),
                }
            }
            Op::Rebind(k, b) => {
                let key = k.key();
                let r = t.rebind(&key, BackendId(b), Millis(now));
                match model.get_mut(&key) {
                    Some(m) if m.template() => {
                        prop_assert!(r);
                        m.backend = b;
                        m.last = m.last.max(now);
                    }
                    _ => prop_assert!(!r),
                }
            }
            Op::Release(k) => {
                let key = k.key();
                let r = t.release(&key, Millis(now));
                match model.get_mut(&key) {
                    Some(m) if m.held() > 0 => {
                        m.bytes[1] -= 1;
                        prop_assert_eq!(r, Some(m.bytes[1] as u32));
                        if m.bytes[1] == 0 {
                            m.last = now;
                        }
                    }
                    _ => prop_assert_eq!(r, None),
                }
            }
            Op::InsertHeld(k, s, b) => {
                let key = k.key();
                let init = FlowInit {
                    owner: 0,
                    profile: ProfileRef::NONE,
                    service: ServiceId(s),
                    backend: BackendId(b),
                    // Ignored: a held insert is a template.
                    state: FlowState::Udp,
                };
                let r = t.insert_held(key, init, Millis(now));
                match model.get(&key) {
                    Some(m) => {
                        prop_assert_eq!(r.map(|h| h.cookie), Err(InsertError::Exists(m.cookie)))
                    }
                    None => {
                        let h = r.map_err(|e| TestCaseError::fail(format!("insert_held: {e}")))?;
                        prop_assert!(cookies.insert(h.cookie.0), "cookies unique");
                        model.insert(
                            key,
                            M {
                                cookie: h.cookie,
                                service: s,
                                backend: b,
                                state: FlowState::Persist,
                                created: now,
                                last: now,
                                bytes: [0, 1],
                                pkts: [0; 2],
                            },
                        );
                    }
                }
            }
        }
        // Stats agree with the model at every step.
        for (id, _) in TENANTS {
            let st = t.tenant_stats(TenantId(id)).unwrap();
            let n = model.keys().filter(|k| k.tenant.0 == id).count() as u64;
            prop_assert_eq!(st.entries, n);
            prop_assert_eq!(st.chain_histogram.iter().sum::<u64>(), st.buckets as u64);
        }
    }
    // Every cookie ever handed out reaches its entry while it lives and
    // nothing once it ended (its node may hold a newer entry by now).
    let live: HashMap<u64, FlowKey> = model.iter().map(|(k, m)| (m.cookie.0, *k)).collect();
    for &c in &cookies {
        let got = t.get_cookie(Cookie(c));
        match live.get(&c) {
            Some(k) => prop_assert_eq!(got, Some(expect(k, &model[k], &tmo))),
            None => prop_assert_eq!(got, None, "ended cookie {:x} still found", c),
        }
    }
    // Held templates wait for their connections: release every hold.
    let held: Vec<(FlowKey, u64)> = model.iter().map(|(k, m)| (*k, m.held())).collect();
    for (k, n) in held {
        for left in (0..n).rev() {
            prop_assert_eq!(t.release(&k, Millis(now)), Some(left as u32));
        }
        let m = model.get_mut(&k).unwrap();
        if n > 0 {
            m.bytes[1] = 0;
            m.last = now;
        }
        prop_assert_eq!(t.release(&k, Millis(now)), None);
    }
    // Every timeout cut to 1 s: the retime pass brings all entries, filed
    // under whatever timeouts, due within the next two seconds (one tick
    // late at most) — one `expire` call takes them all.
    let second = Timeouts {
        syn_sent: Millis(1_000),
        syn_recv: Millis(1_000),
        established: Millis(1_000),
        fin_wait: Millis(1_000),
        close_wait: Millis(1_000),
        last_ack: Millis(1_000),
        time_wait: Millis(1_000),
        close: Millis(1_000),
        udp: Millis(1_000),
        persist: Millis(1_000),
    };
    for (id, _) in TENANTS {
        t.set_timeouts(TenantId(id), second).unwrap();
        tmo.insert(id, second);
    }
    now += 2_000;
    let mut out = Vec::new();
    t.expire(Millis(now), usize::MAX, &mut out);
    for s in out {
        let m = model.remove(&s.key);
        prop_assert!(m.is_some(), "expired entry not in model");
        prop_assert_eq!(s, expect(&s.key, &m.unwrap(), &tmo));
        prop_assert!(now >= s.expires_at.0);
    }
    prop_assert!(
        model.is_empty(),
        "entries not expired two seconds after a cut to 1 s: {:?}",
        model.keys().collect::<Vec<_>>()
    );
    // Eventually everything expires, and never early.
    for _ in 0..3 {
        now += 1_000_000;
        let mut out = Vec::new();
        t.expire(Millis(now), usize::MAX, &mut out);
        for s in out {
            prop_assert!(model.remove(&s.key).is_some());
            prop_assert!(now >= s.expires_at.0);
        }
    }
    prop_assert!(
        model.is_empty(),
        "entries never expired: {:?}",
        model.keys().collect::<Vec<_>>()
    );
    let mut rest = Vec::new();
    prop_assert_eq!(
        t.dump(None, &DumpFilter::default(), usize::MAX, &mut rest),
        None
    );
    prop_assert!(rest.is_empty());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn table_matches_model(ops in proptest::collection::vec(arb_op(), 1..200)) {
        run(ops)?;
    }
}
