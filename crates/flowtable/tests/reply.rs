//! Reply keys (packet mode's nat and fnat): an entry inserted with
//! `insert_reply` is found by the reply a backend sends, through a second
//! index entry that points at the same node.
//!
//! * Lookups by reply key find exactly the flows that have one, by every
//!   field of the key; forward lookups are unchanged.
//! * An insert is all or nothing: a full reply chain or a taken reply key
//!   leaves nothing behind.
//! * Every removal path (key, cookie, handle, expiry, tenant removal) takes
//!   both index entries out: the reply key is free again at once.
//! * Resizes move both; counts, chain statistics, load and memory include
//!   the reply entries; dumps list each flow once.
//! * A paged dump across resizes stays exact with reply entries present
//!   while writers churn reply flows and readers look replies up.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::Arc;

use weir_flowtable::*;

mod common;

fn table(buckets: usize, max_chain: usize) -> FlowTable {
    let t = FlowTable::new(TableConfig {
        shared_buckets: buckets,
        max_shared_entries: 0,
        max_chain,
        memory_budget: 1 << 26,
        seed: Some(5),
    });
    t.add_tenant(TenantId(1), TenantConfig::default()).unwrap();
    t.add_tenant(
        TenantId(2),
        TenantConfig {
            own_buckets: 64,
            ..Default::default()
        },
    )
    .unwrap();
    t
}

/// Client `i` (v4 for even `i`, v6 for odd) of `tenant` to the VIP.
fn key(tenant: u32, i: u32) -> FlowKey {
    let client: SocketAddr = if i.is_multiple_of(2) {
        SocketAddr::from(([10, 9, (i >> 8) as u8, i as u8], 20_000 + (i % 1000) as u16))
    } else {
        SocketAddr::new(
            std::net::Ipv6Addr::new(0x2001, 0xdb8, 9, 0, 0, 0, (i >> 16) as u16, i as u16).into(),
            20_000 + (i % 1000) as u16,
        )
    };
    FlowKey {
        tenant: TenantId(tenant),
        proto: if i.is_multiple_of(3) {
            Proto::Udp
        } else {
            Proto::Tcp
        },
        client,
        virt: "10.0.0.100:80".parse().unwrap(),
    }
}

/// Flow `i` on backend `i % 4`, owner token `i`.
fn init(i: u32) -> FlowInit<'static> {
    common::spread_init(i, 2, 4, i)
}

/// The fnat slot of flow `i`: local address `i % 3`, port 1024 + `i`.
fn slot(i: u32) -> NonZeroU32 {
    NonZeroU32::new(((i % 3) << 16) | (1024 + (i & 0xffff) % 60_000)).unwrap()
}

/// nat for even `i`, fnat for odd.
fn mode(i: u32) -> ReplyMode {
    if i.is_multiple_of(2) {
        ReplyMode::Nat
    } else {
        ReplyMode::FullNat(slot(i))
    }
}

/// The reply key of flow `i` inserted with `mode(i)`.
fn reply_of(k: &FlowKey, i: u32, m: ReplyMode) -> ReplyKey {
    ReplyKey {
        tenant: k.tenant,
        proto: k.proto,
        backend: BackendId(i % 4),
        dst: match m {
            ReplyMode::Nat => ReplyDst::Client(k.client),
            ReplyMode::FullNat(n) => ReplyDst::Nat(n),
        },
    }
}

fn reply(tenant: u32, i: u32) -> ReplyKey {
    reply_of(&key(tenant, i), i, mode(i))
}

#[test]
fn reply_lookups_find_nat_and_fnat_flows_by_every_field() {
    let t = table(1024, 64);
    let mut hs = Vec::new();
    for tn in [1, 2] {
        for i in 0..200 {
            let h = t
                .insert_reply(key(tn, i), init(i), mode(i), Millis(1000))
                .unwrap();
            hs.push((tn, i, h));
        }
        // Plain entries beside them: never found by a reply key.
        for i in 1000..1100 {
            t.insert(key(tn, i), init(i), Millis(1000)).unwrap();
            assert_eq!(t.lookup_reply(&reply(tn, i)), None, "plain entry {i}");
        }
    }
    for &(tn, i, h) in &hs {
        let k = key(tn, i);
        let r = reply(tn, i);
        let f = t
            .lookup_reply(&r)
            .unwrap_or_else(|| panic!("reply of {tn}/{i}"));
        assert_eq!(
            f,
            Found {
                handle: h,
                backend: BackendId(i % 4),
                key: k
            }
        );
        assert_eq!(t.lookup(&k), Some((h, BackendId(i % 4))));
        // Each field of the reply key counts.
        // The other tenant has a flow with the same reply key but its own.
        let other = t
            .lookup_reply(&ReplyKey {
                tenant: TenantId(3 - tn),
                ..r
            })
            .unwrap();
        assert_eq!(other.key, key(3 - tn, i));
        assert_ne!(other.handle, h);
        let wrong = [
            ReplyKey {
                tenant: TenantId(9),
                ..r
            },
            ReplyKey {
                backend: BackendId(i % 4 + 1),
                ..r
            },
            ReplyKey {
                proto: if k.proto == Proto::Tcp {
                    Proto::Udp
                } else {
                    Proto::Tcp
                },
                ..r
            },
            ReplyKey {
                dst: match r.dst {
                    // nat flow: another client port, or its client taken for a slot.
                    ReplyDst::Client(c) => ReplyDst::Client(SocketAddr::new(c.ip(), c.port() + 1)),
                    ReplyDst::Nat(n) => ReplyDst::Nat(NonZeroU32::new(n.get() + 1).unwrap()),
                },
                ..r
            },
            ReplyKey {
                dst: match r.dst {
                    ReplyDst::Client(_) => ReplyDst::Nat(slot(i)),
                    ReplyDst::Nat(_) => ReplyDst::Client(k.client),
                },
                ..r
            },
        ];
        for w in wrong {
            assert_eq!(t.lookup_reply(&w), None, "{w:?} found flow {tn}/{i}");
        }
        // The reader and the handle path agree; replies count as Out.
        assert_eq!(t.reader().lookup_reply(&r), Some(f));
        assert!(t.touch_handle(f.handle, Millis(2000), Dir::Out, 60));
        let s = t.get_handle(h).unwrap();
        assert_eq!((s.packets_out, s.bytes_out, s.packets_in), (1, 60, 0));
        assert!(s.reply);
        match mode(i) {
            ReplyMode::Nat => assert_eq!(s.nat, 0),
            ReplyMode::FullNat(n) => assert_eq!(s.nat, n.get()),
        }
        assert_eq!(t.nat(h), Some(s.nat));
        // The slot is part of the reply key: it cannot change.
        assert!(!t.set_nat(h, 77));
        assert_eq!(t.nat(h), Some(s.nat));
    }
    for tn in [1, 2] {
        let st = t.tenant_stats(TenantId(tn)).unwrap();
        assert_eq!((st.entries, st.reply_entries), (300, 200), "tenant {tn}");
    }
    // Dumps list each flow once, reply entries or not.
    let mut out = Vec::new();
    assert_eq!(
        t.dump(None, &DumpFilter::default(), usize::MAX, &mut out),
        None
    );
    assert_eq!(out.len(), 600);
    let mut cookies: Vec<_> = out.iter().map(|s| s.cookie).collect();
    cookies.sort_unstable();
    cookies.dedup();
    assert_eq!(cookies.len(), 600);
    assert_eq!(out.iter().filter(|s| s.reply).count(), 400);
}

#[test]
fn a_taken_reply_key_refuses_the_insert_and_leaves_nothing() {
    let t = table(1024, 64);
    let a = key(1, 2);
    let ha = t
        .insert_reply(a, init(2), ReplyMode::Nat, Millis(0))
        .unwrap();
    // The same client port to another VIP, scheduled to the same backend:
    // its replies would be the same packets.
    let b = FlowKey {
        virt: "10.0.0.101:80".parse().unwrap(),
        ..a
    };
    assert_eq!(
        t.insert_reply(b, init(2), ReplyMode::Nat, Millis(0)),
        Err(InsertError::ReplyExists(ha.cookie))
    );
    assert_eq!(t.lookup(&b), None);
    assert_eq!(t.lookup_reply(&reply(1, 2)).map(|f| f.handle), Some(ha));
    // Another backend is another reply key; so is fnat on the same backend.
    let other = FlowInit {
        backend: BackendId(3),
        ..init(2)
    };
    let hb = t.insert_reply(b, other, ReplyMode::Nat, Millis(0)).unwrap();
    let c = FlowKey {
        virt: "10.0.0.102:80".parse().unwrap(),
        ..a
    };
    let s = NonZeroU32::new(5 << 16 | 4000).unwrap();
    let hc = t
        .insert_reply(c, init(2), ReplyMode::FullNat(s), Millis(0))
        .unwrap();
    // fnat slots are per backend: the same slot on the same backend is taken.
    let d = FlowKey {
        virt: "10.0.0.103:80".parse().unwrap(),
        ..a
    };
    assert_eq!(
        t.insert_reply(d, init(2), ReplyMode::FullNat(s), Millis(0)),
        Err(InsertError::ReplyExists(hc.cookie))
    );
    // An existing forward key is reported as before, whatever the reply.
    assert_eq!(
        t.insert_reply(a, other, ReplyMode::FullNat(s), Millis(0)),
        Err(InsertError::Exists(ha.cookie))
    );
    let st = t.tenant_stats(TenantId(1)).unwrap();
    assert_eq!((st.entries, st.reply_entries), (3, 3));
    assert_eq!(st.refused_inserts, 0, "a taken key is not a refusal");
    assert_eq!(t.lookup(&d), None);
    let f = t
        .lookup_reply(&ReplyKey {
            tenant: TenantId(1),
            proto: a.proto,
            backend: BackendId(3),
            dst: ReplyDst::Client(a.client),
        })
        .unwrap();
    assert_eq!((f.handle, f.key), (hb, b));
}

#[test]
fn a_full_reply_chain_refuses_the_insert_and_leaves_nothing() {
    // One bucket line and a chain cap of 1: the forward entry fits, the
    // reply entry (same bucket) does not.
    let t = FlowTable::new(TableConfig {
        shared_buckets: 1,
        max_shared_entries: 0,
        max_chain: 1,
        memory_budget: 1 << 20,
        seed: Some(9),
    });
    t.add_tenant(TenantId(1), TenantConfig::default()).unwrap();
    let k = key(1, 4);
    for round in 0..3 {
        assert_eq!(
            t.insert_reply(k, init(4), ReplyMode::Nat, Millis(0)),
            Err(InsertError::ChainFull),
            "round {round}"
        );
        assert_eq!(t.lookup(&k), None);
        assert_eq!(t.lookup_reply(&reply(1, 4)), None);
        let st = t.tenant_stats(TenantId(1)).unwrap();
        assert_eq!((st.entries, st.reply_entries), (0, 0));
        assert_eq!(st.chain_histogram, vec![1], "a way was left behind");
        assert_eq!(st.refused_inserts, round + 1);
        let mut out = Vec::new();
        t.dump(None, &DumpFilter::default(), 10, &mut out);
        assert!(out.is_empty());
    }
    // The bucket is whole again: a plain entry takes the one way.
    t.insert(k, init(4), Millis(0)).unwrap();
    let st = t.tenant_stats(TenantId(1)).unwrap();
    assert_eq!(st.chain_histogram, vec![0, 1]);
}

/// Inserts flow `i` with its reply key and checks both keys find it.
fn insert_both(t: &FlowTable, tn: u32, i: u32) -> Handle {
    let h = t
        .insert_reply(key(tn, i), init(i), mode(i), Millis(0))
        .unwrap();
    assert_eq!(t.lookup_reply(&reply(tn, i)).map(|f| f.handle), Some(h));
    h
}

/// After a removal: neither key finds the flow, and the reply key is free
/// (a new flow may take it at once).
fn gone_and_free(t: &FlowTable, tn: u32, i: u32, how: &str) {
    assert_eq!(t.lookup(&key(tn, i)), None, "{how}: forward key");
    assert_eq!(t.lookup_reply(&reply(tn, i)), None, "{how}: reply key");
    let h = insert_both(t, tn, i);
    assert!(t.remove_handle(h).is_some());
    assert_eq!(t.lookup_reply(&reply(tn, i)), None, "{how}: reply key");
}

#[test]
fn every_removal_takes_the_reply_entry_out() {
    let t = table(256, 64);
    let timeouts = Timeouts {
        established: Millis(10_000),
        ..Timeouts::default()
    };
    t.set_timeouts(TenantId(2), timeouts).unwrap();
    for tn in [1, 2] {
        let i = 10;
        insert_both(&t, tn, i);
        let s = t.remove(&key(tn, i)).unwrap();
        assert!(s.reply);
        gone_and_free(&t, tn, i, "remove");

        let h = insert_both(&t, tn, i);
        assert_eq!(
            t.remove_cookie(&key(tn, i), h.cookie).map(|s| s.cookie),
            Some(h.cookie)
        );
        gone_and_free(&t, tn, i, "remove_cookie");

        let h = insert_both(&t, tn, i);
        assert_eq!(t.remove_handle(h).map(|s| s.cookie), Some(h.cookie));
        assert_eq!(t.remove_handle(h), None);
        gone_and_free(&t, tn, i, "remove_handle");
    }
    // Expiry through the wheel (tenant 2: 10 s established).
    for i in 0..50 {
        insert_both(&t, 2, i);
    }
    let mut out = Vec::new();
    t.expire(Millis(5_000), usize::MAX, &mut out);
    assert!(out.is_empty());
    t.expire(Millis(12_000), usize::MAX, &mut out);
    assert_eq!(out.len(), 50);
    for i in 0..50 {
        gone_and_free(&t, 2, i, "expire");
    }
    // Tenant removal.
    for i in 0..50 {
        insert_both(&t, 1, i);
        insert_both(&t, 2, i);
    }
    out.clear();
    t.remove_tenant(TenantId(2), &mut out).unwrap();
    assert_eq!(out.len(), 50);
    for i in 0..50 {
        assert_eq!(t.lookup_reply(&reply(2, i)), None);
        assert!(t.lookup_reply(&reply(1, i)).is_some());
    }
    t.add_tenant(TenantId(2), TenantConfig::default()).unwrap();
    gone_and_free(&t, 2, 7, "remove_tenant");
    assert_eq!(t.tenant_stats(TenantId(2)).unwrap().entries, 0);
    // The shared table (tenant 2 shares it now) holds tenant 1's 50 flows:
    // 100 index entries.
    let st = t.tenant_stats(TenantId(1)).unwrap();
    assert_eq!((st.entries, st.reply_entries), (50, 50));
    let ways: u64 = st
        .chain_histogram
        .iter()
        .enumerate()
        .map(|(n, &b)| n as u64 * b)
        .sum();
    assert_eq!(ways, 100);
}

/// Runs maintenance until no resize is running (bounded).
fn settle(t: &FlowTable, tn: u32) {
    for _ in 0..10_000 {
        t.maintain();
        if !t.resize_state(TenantId(tn)).unwrap().0 {
            return;
        }
    }
    panic!("resize did not finish");
}

#[test]
fn resizes_move_both_entries_and_count_them() {
    let t = table(64, 64);
    let n = 30_000;
    let plain = table(64, 64);
    for i in 0..n {
        insert_both(&t, 1, i);
        plain.insert(key(1, i), init(i), Millis(0)).unwrap();
        if i % 5000 == 4999 {
            for j in (0..=i).step_by(41) {
                assert!(
                    t.lookup_reply(&reply(1, j)).is_some(),
                    "reply {j} after {i}"
                );
                assert!(t.lookup(&key(1, j)).is_some(), "key {j} after {i}");
            }
        }
    }
    settle(&t, 1);
    settle(&plain, 1);
    let st = t.tenant_stats(TenantId(1)).unwrap();
    assert_eq!((st.entries, st.reply_entries), (u64::from(n), u64::from(n)));
    // The load counts both index entries: the table grew for 2n of them.
    assert!(st.load_factor <= 0.9, "{st:?}");
    assert!(
        (st.buckets * BUCKET_WAYS) as u64 >= 2 * u64::from(n),
        "{} buckets for {} index entries",
        st.buckets,
        2 * n
    );
    let pst = plain.tenant_stats(TenantId(1)).unwrap();
    assert!(
        st.buckets > pst.buckets,
        "{} vs {}",
        st.buckets,
        pst.buckets
    );
    // memory_bytes holds the bigger index: at least a way's worth (64 B
    // / BUCKET_WAYS) per reply entry more than the plain table.
    let extra = t.memory_bytes() as i64 - plain.memory_bytes() as i64;
    assert!(
        extra >= 64 * i64::from(n) / BUCKET_WAYS as i64,
        "{extra} B more for {n} reply entries"
    );
    for i in 0..n {
        let f = t.lookup_reply(&reply(1, i)).unwrap();
        assert_eq!((f.key, f.backend), (key(1, i), BackendId(i % 4)));
    }
    // Shrink back: everything that stays is found both ways.
    for i in 100..n {
        assert!(t.remove(&key(1, i)).is_some());
    }
    for _ in 0..64 {
        settle(&t, 1);
    }
    let st2 = t.tenant_stats(TenantId(1)).unwrap();
    assert!(
        st2.buckets < st.buckets / 16,
        "{} -> {}",
        st.buckets,
        st2.buckets
    );
    assert_eq!((st2.entries, st2.reply_entries), (100, 100));
    for i in 0..n {
        assert_eq!(t.lookup_reply(&reply(1, i)).is_some(), i < 100, "reply {i}");
    }
}

#[test]
fn mixed_batched_lookups_match_single_lookups() {
    let t = table(256, 64);
    for i in (0..6_000).step_by(2) {
        t.insert_reply(key(1, i), init(i), mode(i), Millis(0))
            .unwrap();
        t.insert_reply(key(2, i + 1), init(i + 1), mode(i + 1), Millis(0))
            .unwrap();
        t.insert(key(1, i + 1), init(i + 1), Millis(0)).unwrap();
    }
    assert!(t.start_resize(TenantId(1), 100_000) || t.resize_state(TenantId(1)).unwrap().0);
    let probes: Vec<Probe> = (0..1_000)
        .flat_map(|i| {
            [
                Probe::Flow(key(1, i)),
                Probe::Reply(reply(1, i)),
                Probe::Reply(reply(2, i)),
                Probe::Flow(key(2, i)),
                Probe::Reply(reply(9, i)),
            ]
        })
        .collect();
    let r = t.reader();
    let mut out = Vec::new();
    let mut hits = 0;
    for round in 0..3 {
        r.lookup_probes(&probes, &mut out);
        assert_eq!(out.len(), probes.len());
        for (p, got) in probes.iter().zip(&out) {
            let want = match p {
                Probe::Flow(k) => t.lookup(k).map(|(h, b)| Found {
                    handle: h,
                    backend: b,
                    key: *k,
                }),
                Probe::Reply(rk) => t.lookup_reply(rk),
            };
            assert_eq!(*got, want, "round {round} {p:?}");
            hits += usize::from(got.is_some());
        }
        t.maintain();
    }
    // Tenant 1: 1000 forward keys + 500 even reply keys; tenant 2: 500 + 500.
    assert_eq!(hits, 3 * 2_500);
}

#[test]
fn dump_and_reply_lookups_stay_exact_across_resizes_under_churn() {
    let t = Arc::new(table(256, 64));
    let stable = 3_000u32;
    for i in 0..stable {
        insert_both(&t, 1, i);
    }
    // A writer grows the table with reply flows and removes them again, by
    // alternating paths, so resizes run under the dumps.
    let round = move |t: &FlowTable| {
        let mut hs = Vec::new();
        for i in stable..stable + 40_000 {
            hs.push(
                t.insert_reply(key(1, i), init(i), mode(i), Millis(0))
                    .unwrap(),
            );
        }
        for (j, h) in hs.into_iter().enumerate() {
            let i = stable + j as u32;
            let ok = if j % 2 == 0 {
                t.remove_handle(h).is_some()
            } else {
                t.remove(&key(1, i)).is_some()
            };
            assert!(ok, "flow {i}");
            assert_eq!(t.lookup_reply(&reply(1, i)), None, "removed {i}");
        }
    };
    let check = |t: &FlowTable, i| {
        let f = t.lookup_reply(&reply(1, i));
        assert_eq!(f.map(|f| f.key), Some(key(1, i)), "stable reply {i}");
    };
    common::dumps_under_resizes(&t, 37, stable, round, check);
    settle(&t, 1);
    let st = t.tenant_stats(TenantId(1)).unwrap();
    assert_eq!(
        (st.entries, st.reply_entries),
        (u64::from(stable), u64::from(stable))
    );
}

/// A reply key is computed from the entry's backend, so an entry with one
/// keeps its backend: `rebind` (which moves a persistence template to
/// another backend) refuses an entry inserted with `insert_reply`, even in
/// state `Persist`. It used to change the backend under the reply way:
/// the reply lookup then missed the flow, and the removal looked for the
/// reply way under the new backend's key, left the old one in its bucket
/// pointing at a node to be recycled (debug builds stopped on the
/// "reply index entry was missing" assertion).
#[test]
fn rebind_never_moves_an_entry_that_has_a_reply_key() {
    let t = table(64, 64);
    let k = key(1, 2);
    let tpl = FlowInit {
        state: FlowState::Persist,
        ..init(2)
    };
    t.insert_reply(k, tpl, ReplyMode::Nat, Millis(1000))
        .unwrap();
    let r = reply(1, 2);
    assert!(!t.rebind(&k, BackendId(9), Millis(2000)));
    assert_eq!(t.get(&k).unwrap().backend, r.backend);
    assert_eq!(t.lookup_reply(&r).map(|f| f.key), Some(k));
    let s = t.remove(&k).expect("the entry");
    assert!(s.reply);
    assert_eq!(t.lookup_reply(&r), None);
    let st = t.tenant_stats(TenantId(1)).unwrap();
    assert_eq!((st.table_entries, st.reply_entries), (0, 0));
    // Nothing left in the buckets either.
    assert_eq!(st.chain_histogram.iter().skip(1).sum::<u64>(), 0);
}
