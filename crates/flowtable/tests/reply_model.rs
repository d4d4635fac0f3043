//! Property test of reply keys: random sequences of inserts with and
//! without a reply key (nat and fnat, over a small space so that forward
//! and reply keys collide often), removes by key and by handle, reply and
//! forward lookups, expiry, forced resizes, tenant removal and paged dumps,
//! against a `HashMap` model. After every step every flow is found by its
//! forward key and, if it has one, by its reply key, with its own handle;
//! the reply-entry counts match.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::num::NonZeroU32;

use common::{TENANTS, tenant_cfg};
use proptest::prelude::*;
use weir_flowtable::*;

mod common;

fn client(i: u8, port: u8) -> SocketAddr {
    common::model_addr(i, 1000 + u16::from(port))
}

/// tenant index, UDP, client, client port, VIP.
#[derive(Clone, Debug)]
struct K(u8, bool, u8, u8, u8);

fn tenant(i: u8) -> TenantId {
    TenantId(TENANTS[usize::from(i) % 3].0)
}

fn proto(udp: bool) -> Proto {
    if udp { Proto::Udp } else { Proto::Tcp }
}

impl K {
    fn key(&self) -> FlowKey {
        FlowKey {
            tenant: tenant(self.0),
            proto: proto(self.1),
            client: client(self.2, self.3),
            virt: SocketAddr::from(([10, 0, 0, 100 + self.4], 80)),
        }
    }
}

fn arb_key() -> impl Strategy<Value = K> {
    (0u8..3, any::<bool>(), 0u8..3, 0u8..2, 0u8..2).prop_map(|(a, b, c, d, e)| K(a, b, c, d, e))
}

/// None: no reply key; Some(0): nat; Some(n): fnat with slot n.
fn mode(m: Option<u32>) -> Option<ReplyMode> {
    m.map(|n| match NonZeroU32::new(n) {
        None => ReplyMode::Nat,
        Some(n) => ReplyMode::FullNat(n),
    })
}

#[derive(Clone, Debug)]
enum Op {
    Insert(K, u32, Option<u32>),
    Remove(K),
    RemoveHandle(K),
    Lookup(K),
    /// tenant, UDP, backend, client (or `None`: fnat slot 1..3).
    LookupReply(u8, bool, u32, Result<(u8, u8), u32>),
    Advance(u64),
    Expire(usize),
    Resize(u8, usize),
    Maintain,
    Dump(usize),
    RemoveTenant(u8),
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (arb_key(), 0u32..2, proptest::option::of(0u32..3)).prop_map(|(k, b, m)| Op::Insert(k, b, m)),
        2 => arb_key().prop_map(Op::Remove),
        1 => arb_key().prop_map(Op::RemoveHandle),
        1 => arb_key().prop_map(Op::Lookup),
        3 => (0u8..3, any::<bool>(), 0u32..2, prop_oneof![
                (0u8..3, 0u8..2).prop_map(Ok),
                (1u32..3).prop_map(Err),
            ]).prop_map(|(t, u, b, d)| Op::LookupReply(t, u, b, d)),
        2 => (0u64..400_000).prop_map(Op::Advance),
        2 => (0usize..6).prop_map(Op::Expire),
        1 => (0u8..3, 1usize..300).prop_map(|(t, n)| Op::Resize(t, n)),
        2 => Just(Op::Maintain),
        1 => (1usize..7).prop_map(Op::Dump),
        1 => (0u8..3).prop_map(Op::RemoveTenant),
    ]
}

#[derive(Clone, Debug)]
struct M {
    handle: Handle,
    backend: u32,
    reply: Option<ReplyMode>,
    last: u64,
}

fn reply_key(k: &FlowKey, m: &M) -> Option<ReplyKey> {
    reply_of(k, m.backend, m.reply)
}

fn reply_of(k: &FlowKey, backend: u32, reply: Option<ReplyMode>) -> Option<ReplyKey> {
    Some(ReplyKey {
        tenant: k.tenant,
        proto: k.proto,
        backend: BackendId(backend),
        dst: match reply? {
            ReplyMode::Nat => ReplyDst::Client(k.client),
            ReplyMode::FullNat(n) => ReplyDst::Nat(n),
        },
    })
}

fn new_table() -> FlowTable {
    let t = FlowTable::new(TableConfig {
        shared_buckets: 8,
        max_shared_entries: 0,
        max_chain: 1024,
        memory_budget: 1 << 20,
        seed: Some(43),
    });
    for (id, own) in TENANTS {
        t.add_tenant(TenantId(id), tenant_cfg(own)).unwrap();
    }
    t
}

/// Every invariant the table must keep with the model after a step.
fn check(t: &FlowTable, model: &HashMap<FlowKey, M>) -> Result<(), TestCaseError> {
    for (k, m) in model {
        let found = Found {
            handle: m.handle,
            backend: BackendId(m.backend),
            key: *k,
        };
        prop_assert_eq!(t.lookup(k), Some((m.handle, BackendId(m.backend))));
        if let Some(rk) = reply_key(k, m) {
            prop_assert_eq!(t.lookup_reply(&rk), Some(found), "reply of {:?}", k);
        }
        let s = t.get_handle(m.handle);
        prop_assert_eq!(s.map(|s| (s.key, s.reply)), Some((*k, m.reply.is_some())));
    }
    for (id, _) in TENANTS {
        let st = t.tenant_stats(TenantId(id)).unwrap();
        let mine = model.keys().filter(|k| k.tenant.0 == id).count() as u64;
        prop_assert_eq!(st.entries, mine);
        // Reply entries are counted per table: 1 and 3 share one.
        let same_table = |k: &FlowKey| (k.tenant.0 == 2) == (id == 2);
        let replies = model
            .iter()
            .filter(|(k, m)| same_table(k) && m.reply.is_some())
            .count() as u64;
        prop_assert_eq!(st.reply_entries, replies, "tenant {}", id);
        let ways: u64 = st
            .chain_histogram
            .iter()
            .enumerate()
            .map(|(n, &b)| n as u64 * b)
            .sum();
        let flows = model.keys().filter(|k| same_table(k)).count() as u64;
        // Exact unless a resize is under way (then only sampled buckets).
        if !t.resize_state(TenantId(id)).unwrap().0 {
            prop_assert_eq!(ways, flows + replies, "index entries of tenant {}", id);
        }
    }
    Ok(())
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let t = new_table();
    let mut model: HashMap<FlowKey, M> = HashMap::new();
    let mut now = 1_000u64;
    for op in ops {
        match op {
            Op::Insert(k, b, m) => {
                let key = k.key();
                let init = FlowInit {
                    owner: 0,
                    profile: ProfileRef::NONE,
                    service: ServiceId(1),
                    backend: BackendId(b),
                    state: FlowState::Established,
                };
                let reply = mode(m);
                let r = match reply {
                    Some(rm) => t.insert_reply(key, init, rm, Millis(now)),
                    None => t.insert_handle(key, init, Millis(now)),
                };
                let clash = reply_of(&key, b, reply).and_then(|rk| {
                    model
                        .iter()
                        .find(|(k, m)| reply_key(k, m) == Some(rk))
                        .map(|(_, m)| m.handle.cookie)
                });
                match (model.get(&key), clash) {
                    (Some(old), _) => {
                        prop_assert_eq!(r, Err(InsertError::Exists(old.handle.cookie)))
                    }
                    (None, Some(c)) => prop_assert_eq!(r, Err(InsertError::ReplyExists(c))),
                    (None, None) => {
                        let handle = r.map_err(|e| TestCaseError::fail(format!("insert: {e}")))?;
                        let m = M {
                            handle,
                            backend: b,
                            reply,
                            last: now,
                        };
                        model.insert(key, m);
                    }
                }
            }
            Op::Remove(k) => {
                let key = k.key();
                let r = t.remove(&key).map(|s| s.cookie);
                let m = model.remove(&key);
                prop_assert_eq!(r, m.as_ref().map(|m| m.handle.cookie));
                if let Some(rk) = m.as_ref().and_then(|m| reply_key(&key, m)) {
                    prop_assert_eq!(t.lookup_reply(&rk), None);
                }
            }
            Op::RemoveHandle(k) => {
                let key = k.key();
                if let Some(m) = model.remove(&key) {
                    prop_assert_eq!(t.remove_handle(m.handle).map(|s| s.key), Some(key));
                    prop_assert_eq!(t.remove_handle(m.handle), None);
                    if let Some(rk) = reply_key(&key, &m) {
                        prop_assert_eq!(t.lookup_reply(&rk), None);
                    }
                }
            }
            Op::Lookup(k) => {
                let key = k.key();
                prop_assert_eq!(
                    t.lookup(&key),
                    model.get(&key).map(|m| (m.handle, BackendId(m.backend)))
                );
            }
            Op::LookupReply(ti, udp, b, d) => {
                let rk = ReplyKey {
                    tenant: tenant(ti),
                    proto: proto(udp),
                    backend: BackendId(b),
                    dst: match d {
                        Ok((c, p)) => ReplyDst::Client(client(c, p)),
                        Err(n) => ReplyDst::Nat(NonZeroU32::new(n).unwrap()),
                    },
                };
                let want = model
                    .iter()
                    .find(|(k, m)| reply_key(k, m) == Some(rk))
                    .map(|(k, m)| Found {
                        handle: m.handle,
                        backend: BackendId(m.backend),
                        key: *k,
                    });
                prop_assert_eq!(t.lookup_reply(&rk), want);
                prop_assert_eq!(t.reader().lookup_reply(&rk), want);
            }
            Op::Advance(ms) => now += ms,
            Op::Expire(max) => {
                let mut out = Vec::new();
                let n = t.expire(Millis(now), max, &mut out);
                prop_assert_eq!(n, out.len());
                for s in out {
                    let m = model.remove(&s.key);
                    prop_assert!(m.is_some(), "expired entry not in model");
                    let m = m.unwrap();
                    prop_assert_eq!(s.cookie, m.handle.cookie);
                    prop_assert_eq!(s.reply, m.reply.is_some());
                    let deadline = m.last + Timeouts::default().established.0;
                    prop_assert!(now >= deadline, "expired early");
                    if let Some(rk) = reply_key(&s.key, &m) {
                        prop_assert_eq!(t.lookup_reply(&rk), None);
                    }
                }
            }
            Op::Resize(ti, n) => {
                t.start_resize(tenant(ti), n);
            }
            Op::Maintain => t.maintain(),
            Op::Dump(page) => {
                let mut got = Vec::new();
                let mut cur: Option<Cursor> = None;
                for calls in 0.. {
                    prop_assert!(calls < 1000, "dump does not end");
                    match t.dump(cur.as_ref(), &DumpFilter::default(), page, &mut got) {
                        None => break,
                        Some(c) => cur = Some(c),
                    }
                }
                let mut want: Vec<Cookie> = model.values().map(|m| m.handle.cookie).collect();
                want.sort_unstable();
                let mut got: Vec<Cookie> = got.iter().map(|s| s.cookie).collect();
                got.sort_unstable();
                prop_assert_eq!(got, want, "each flow once");
            }
            Op::RemoveTenant(i) => {
                let (id, own) = TENANTS[usize::from(i)];
                let mut out = Vec::new();
                t.remove_tenant(TenantId(id), &mut out).unwrap();
                let gone: Vec<(FlowKey, M)> = model
                    .iter()
                    .filter(|(k, _)| k.tenant.0 == id)
                    .map(|(k, m)| (*k, m.clone()))
                    .collect();
                model.retain(|k, _| k.tenant.0 != id);
                prop_assert_eq!(out.len(), gone.len());
                t.add_tenant(TenantId(id), tenant_cfg(own)).unwrap();
                for (k, m) in gone {
                    if let Some(rk) = reply_key(&k, &m) {
                        prop_assert_eq!(t.lookup_reply(&rk), None);
                    }
                }
            }
        }
        check(&t, &model)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn reply_keys_match_model(ops in proptest::collection::vec(arb_op(), 1..200)) {
        run(ops)?;
    }
}
