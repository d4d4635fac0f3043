//! Listing one tenant that shares the table: from its own expiry
//! references when it holds a small part of the table (a walk of the
//! shared table would read everyone's entries to fill its page), by a walk
//! otherwise, and exact either way — also when a dump changes ways between
//! pages and entries are filed, refiled, expired or removed in between.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use weir_flowtable::*;

mod common;

const BIG: u32 = 1;
const SMALL: u32 = 2;

fn key(tenant: u32, i: u32) -> FlowKey {
    common::spread_key(tenant, i, 3)
}

fn init(i: u32) -> FlowInit<'static> {
    common::spread_init(i, 3, 5, i)
}

/// Tenants `BIG` and `SMALL`, both on the shared table.
fn table(buckets: usize) -> FlowTable {
    let t = FlowTable::new(TableConfig {
        shared_buckets: buckets,
        memory_budget: 1 << 20,
        seed: Some(7),
        ..TableConfig::default()
    });
    for id in [BIG, SMALL] {
        t.add_tenant(TenantId(id), TenantConfig::default()).unwrap();
    }
    t
}

/// Cookies of a whole dump with `filter`, in pages of `page`, and the dump
/// work it did (bucket reads, references read).
fn dump_all(t: &FlowTable, filter: &DumpFilter, page: usize) -> (Vec<u64>, (u64, u64), usize) {
    let w0 = FlowTable::dump_work_on_this_thread();
    let mut got = Vec::new();
    let mut out = Vec::new();
    let mut cur = None;
    let mut pages = 0;
    loop {
        out.clear();
        cur = t.dump(cur.as_ref(), filter, page, &mut out);
        pages += 1;
        assert!(out.len() <= page);
        got.extend(out.iter().map(|s| s.cookie.0));
        if cur.is_none() {
            break;
        }
        assert!(pages < 100_000, "the dump never ended");
    }
    let w1 = FlowTable::dump_work_on_this_thread();
    (got, (w1.0 - w0.0, w1.1 - w0.1), pages)
}

fn tenant(id: u32) -> DumpFilter {
    DumpFilter {
        tenant: Some(TenantId(id)),
        ..DumpFilter::default()
    }
}

#[test]
fn a_small_tenant_that_shares_the_table_is_listed_from_its_own_references() {
    let t = table(4096);
    for i in 0..20_000 {
        t.insert(key(BIG, i), init(i), Millis(0)).unwrap();
    }
    // Six filed in the wheel by an expiry pass, six still on the filing
    // lists, two of the filed ones refiled (a state change: referenced
    // from the wheel and a list at once).
    for i in 0..6 {
        t.insert(key(SMALL, i), init(i), Millis(0)).unwrap();
    }
    assert_eq!(t.expire(Millis(1_000), 1_000, &mut Vec::new()), 0);
    for i in 6..12 {
        t.insert(key(SMALL, i), init(i), Millis(1_000)).unwrap();
    }
    for i in [1, 4] {
        assert!(t.set_state(&key(SMALL, i), FlowState::FinWait, Millis(1_000)));
    }

    // What a walk of the whole table returns for the small tenant, in order.
    let (everything, _, _) = dump_all(&t, &DumpFilter::default(), 1_000);
    assert_eq!(everything.len(), 20_012);
    let mine: HashSet<u64> = (0..12)
        .map(|i| t.get(&key(SMALL, i)).unwrap().cookie.0)
        .collect();
    let expected: Vec<u64> = everything
        .iter()
        .copied()
        .filter(|c| mine.contains(c))
        .collect();
    assert_eq!(expected.len(), 12);

    for page in [1, 2, 5, 100] {
        let (got, (buckets, refs), pages) = dump_all(&t, &tenant(SMALL), page);
        assert_eq!(
            got, expected,
            "pages of {page}: the walk's entries in the walk's order"
        );
        assert_eq!(buckets, 0, "pages of {page}: the shared table was walked");
        // Each page reads the tenant's own references: 12 entries, 2 of
        // them referenced twice until the next expiry pass drops the old.
        assert!(
            refs <= 14 * pages as u64,
            "pages of {page}: {refs} references read in {pages} pages"
        );
    }

    // The big tenant is most of the table: walked, not listed by reference.
    let (got, (buckets, refs), _) = dump_all(&t, &tenant(BIG), 500);
    assert_eq!(got.len(), 20_000);
    assert!(buckets > 0);
    assert_eq!(refs, 0);
}

#[test]
fn a_dump_that_changes_ways_between_pages_stays_exact() {
    let t = table(256);
    for i in 0..2_000 {
        t.insert(key(BIG, i), init(i), Millis(0)).unwrap();
    }
    for i in 0..40 {
        t.insert(key(SMALL, i), init(i), Millis(0)).unwrap();
    }
    let filter = tenant(SMALL);
    for grow in [true, false] {
        let present: HashSet<u64> = (0..40)
            .map(|i| t.get(&key(SMALL, i)).unwrap().cookie.0)
            .collect();
        let mut seen = Vec::new();
        let mut out = Vec::new();
        let mut cur = None;
        let mut pages = 0;
        let mut ways = HashSet::new();
        loop {
            out.clear();
            let w0 = FlowTable::dump_work_on_this_thread();
            cur = t.dump(cur.as_ref(), &filter, 3, &mut out);
            let w1 = FlowTable::dump_work_on_this_thread();
            ways.insert(w1.0 > w0.0);
            seen.extend(out.iter().map(|s| s.cookie.0));
            pages += 1;
            if pages == 4 {
                // The small tenant grows past the point where a walk is
                // cheaper (or shrinks back below it): entries of its own
                // come and go around the cursor.
                if grow {
                    for i in 1_000..4_000 {
                        t.insert(key(SMALL, i), init(i), Millis(0)).unwrap();
                    }
                } else {
                    for i in 1_000..4_000 {
                        t.remove(&key(SMALL, i)).unwrap();
                    }
                }
            }
            if cur.is_none() {
                break;
            }
        }
        assert_eq!(ways.len(), 2, "grow {grow}: the dump took both ways");
        let unique: HashSet<u64> = seen.iter().copied().collect();
        assert_eq!(
            unique.len(),
            seen.len(),
            "grow {grow}: an entry came back twice"
        );
        for c in &present {
            assert!(
                unique.contains(c),
                "grow {grow}: entry {c:#x} present throughout was missed"
            );
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Insert(u32, u32),
    Remove(u32, u32),
    /// A state change: the entry is refiled.
    Restate(u32, u32),
    /// Inserts or removes a block of the big tenant's entries, moving the
    /// small tenant across the point where a walk is cheaper.
    Bulk(bool),
    /// An expiry pass `ms` later (short timeouts: some entries expire).
    Expire(u16),
    Nothing,
}

const SMALL_KEYS: u32 = 120;

fn arb_op() -> impl Strategy<Value = Op> {
    let who = prop_oneof![3 => Just(SMALL), 1 => Just(BIG)];
    prop_oneof![
        4 => (who.clone(), 0..SMALL_KEYS).prop_map(|(w, k)| Op::Insert(w, k)),
        3 => (who.clone(), 0..SMALL_KEYS).prop_map(|(w, k)| Op::Remove(w, k)),
        2 => (who, 0..SMALL_KEYS).prop_map(|(w, k)| Op::Restate(w, k)),
        1 => any::<bool>().prop_map(Op::Bulk),
        2 => (0u16..3_000).prop_map(Op::Expire),
        4 => Just(Op::Nothing),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Between every two pages of a dump of the small tenant, entries of
    /// both tenants come and go, change state and expire, and the big
    /// tenant grows or shrinks by a block: every entry of the small tenant
    /// present for the whole dump is listed exactly once, nothing twice,
    /// nothing of another tenant, nothing that was never there.
    #[test]
    fn listing_a_tenant_that_shares_the_table_is_exact(
        start in proptest::collection::vec(0..SMALL_KEYS, 0..100),
        big_start in any::<bool>(),
        page in 1usize..5,
        ops in proptest::collection::vec(arb_op(), 1..300),
    ) {
        let t = table(64);
        // Short timeouts so expiry passes remove some entries.
        t.set_timeouts(
            TenantId(SMALL),
            Timeouts {
                established: Millis(2_500),
                fin_wait: Millis(1_500),
                udp: Millis(2_500),
                ..Timeouts::default()
            },
        )
        .unwrap();
        let mut now = 0u64;
        // Live entries by (tenant, key) -> cookie, as the table has them.
        let mut live: HashMap<(u32, u32), u64> = HashMap::new();
        for &k in &start {
            if let Ok(c) = t.insert(key(SMALL, k), init(k), Millis(now)) {
                live.insert((SMALL, k), c.0);
            }
        }
        let mut bulk_in = false;
        let bulk = |t: &FlowTable, add: bool, now: u64| {
            for i in 10_000..10_400 {
                if add {
                    t.insert(key(BIG, i), init(i), Millis(now)).unwrap();
                } else {
                    t.remove(&key(BIG, i)).unwrap();
                }
            }
        };
        if big_start {
            bulk(&t, true, now);
            bulk_in = true;
        }
        let at_start: HashSet<u64> = live.iter().filter(|(k, _)| k.0 == SMALL).map(|(_, &c)| c).collect();
        let mut ever: HashSet<u64> = at_start.clone();
        let mut gone: HashSet<u64> = HashSet::new();
        let mut seen: Vec<u64> = Vec::new();
        let mut ops = ops.into_iter();
        let filter = tenant(SMALL);
        let mut cur: Option<Cursor> = None;
        let mut out = Vec::new();
        loop {
            out.clear();
            cur = t.dump(cur.as_ref(), &filter, page, &mut out);
            for s in &out {
                prop_assert_eq!(s.key.tenant, TenantId(SMALL));
                seen.push(s.cookie.0);
            }
            if cur.is_none() {
                break;
            }
            let Some(op) = ops.next() else { continue };
            match op {
                Op::Insert(w, k) => {
                    if let Ok(c) = t.insert(key(w, k), init(k), Millis(now)) {
                        live.insert((w, k), c.0);
                        if w == SMALL {
                            ever.insert(c.0);
                        }
                    }
                }
                Op::Remove(w, k) => {
                    if let Some(s) = t.remove(&key(w, k)) {
                        live.remove(&(w, k));
                        gone.insert(s.cookie.0);
                    }
                }
                Op::Restate(w, k) => {
                    t.set_state(&key(w, k), FlowState::FinWait, Millis(now));
                }
                Op::Bulk(add) => {
                    if add != bulk_in {
                        bulk(&t, add, now);
                        bulk_in = add;
                    }
                }
                Op::Expire(ms) => {
                    now += u64::from(ms);
                    let mut out = Vec::new();
                    t.expire(Millis(now), 100_000, &mut out);
                    for s in out {
                        gone.insert(s.cookie.0);
                        live.retain(|_, c| *c != s.cookie.0);
                    }
                }
                Op::Nothing => {}
            }
        }
        let unique: HashSet<u64> = seen.iter().copied().collect();
        prop_assert_eq!(unique.len(), seen.len(), "an entry came back twice");
        for c in &unique {
            prop_assert!(ever.contains(c), "listed {:#x}, never an entry of the tenant", c);
        }
        for c in at_start.difference(&gone) {
            prop_assert!(unique.contains(c), "entry {:#x} present throughout was missed", c);
        }
    }
}
