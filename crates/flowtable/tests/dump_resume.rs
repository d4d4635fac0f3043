//! Property test: paged dumps whose table changes between every two pages.
//!
//! A page that ends inside a bucket is resumed there; when the bucket still
//! reads the same node indices the dump goes on from the position it
//! remembered instead of re-reading and re-sorting the bucket. Between any
//! two pages this test inserts, removes, replaces (remove then insert the
//! same key: a new entry, often in the node just freed) and resizes, and
//! checks the dump's guarantees: every entry present for the whole dump is
//! listed exactly once, no entry (cookie) twice, and nothing that was never
//! in the table; two dumps run in lockstep on one thread.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use weir_flowtable::*;

mod common;

/// Keys drawn from this many; the table starts sized for far fewer, so
/// buckets hold many entries and chains overflow.
const KEYS: u32 = 400;

fn key(i: u32) -> FlowKey {
    common::spread_key(1, i, 3)
}

fn init(i: u32) -> FlowInit<'static> {
    common::spread_init(i, 3, 5, i)
}

#[derive(Clone, Debug)]
enum Change {
    Insert(u32),
    Remove(u32),
    /// Remove and insert again: a new entry under the same key.
    Replace(u32),
    /// Maintenance calls (resizes move buckets).
    Maintain(u8),
    Nothing,
}

fn arb_change() -> impl Strategy<Value = Change> {
    prop_oneof![
        3 => (0..KEYS).prop_map(Change::Insert),
        3 => (0..KEYS).prop_map(Change::Remove),
        3 => (0..KEYS).prop_map(Change::Replace),
        1 => (1u8..8).prop_map(Change::Maintain),
        4 => Just(Change::Nothing),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn paged_dump_is_exact_when_the_table_changes_between_pages(
        start in proptest::collection::vec(0..KEYS, 50..300),
        page in 1usize..4,
        other_page in 1usize..6,
        changes in proptest::collection::vec(arb_change(), 1..400),
    ) {
        let t = FlowTable::new(TableConfig {
            shared_buckets: 32,
            max_shared_entries: 0,
            max_chain: 1024,
            memory_budget: 1 << 24,
            seed: Some(7),
        });
        t.add_tenant(TenantId(1), TenantConfig::default()).unwrap();
        // key -> cookie of its entry now.
        let mut live: HashMap<u32, Cookie> = HashMap::new();
        for &i in &start {
            if let Ok(c) = t.insert(key(i), init(i), Millis(0)) {
                live.insert(i, c);
            }
        }
        // Every (key, cookie) that was in the table at some point.
        let mut ever: HashSet<(u32, u64)> = live.iter().map(|(&i, c)| (i, c.0)).collect();
        // Keys whose entry is present for the whole dump (so far).
        let mut stable: HashMap<u32, Cookie> = live.clone();

        // Two dumps in lockstep on this thread (each with its own cursor and
        // page size), so one's remembered position never serves the other.
        let filter = DumpFilter::default();
        let mut dumps: Vec<(usize, Option<Cursor>, Vec<FlowSnapshot>, bool)> =
            vec![(page, None, Vec::new(), false), (other_page, None, Vec::new(), false)];
        let mut changes = changes.into_iter().cycle();
        let mut calls = 0;
        while dumps.iter().any(|d| !d.3) {
            calls += 1;
            prop_assert!(calls < 5_000, "dump does not end");
            // The first pages by `dump`, the second by `dump_page` (the
            // cursor moved on in place): both forms keep the guarantees.
            for (n, (page, cur, got, done)) in dumps.iter_mut().enumerate().filter(|d| !d.1.3) {
                let before = got.len();
                if n == 0 {
                    *cur = t.dump(cur.as_ref(), &filter, *page, got);
                    *done = cur.is_none();
                } else {
                    let more = t.dump_page(cur, &filter, *page, got);
                    prop_assert_eq!(more, cur.is_some());
                    *done = !more;
                }
                prop_assert!(got.len() - before <= *page);
            }
            match changes.next().unwrap() {
                Change::Insert(i) => {
                    if let Ok(c) = t.insert(key(i), init(i), Millis(0)) {
                        live.insert(i, c);
                        ever.insert((i, c.0));
                    }
                }
                Change::Remove(i) => {
                    if t.remove(&key(i)).is_some() {
                        live.remove(&i);
                        stable.remove(&i);
                    }
                }
                Change::Replace(i) => {
                    if t.remove(&key(i)).is_some() {
                        live.remove(&i);
                        stable.remove(&i);
                        let c = t.insert(key(i), init(i), Millis(0)).unwrap();
                        live.insert(i, c);
                        ever.insert((i, c.0));
                    }
                }
                Change::Maintain(n) => {
                    for _ in 0..n {
                        t.maintain();
                    }
                }
                Change::Nothing => {}
            }
        }

        let index_of = |k: &FlowKey| (0..KEYS).find(|&i| key(i) == *k);
        for (_, _, got, _) in &dumps {
            let mut seen: HashSet<u64> = HashSet::new();
            let mut stable_seen: HashMap<u32, usize> = HashMap::new();
            for s in got {
                prop_assert!(seen.insert(s.cookie.0), "entry {:?} listed twice", s.cookie);
                let i = index_of(&s.key);
                prop_assert!(i.is_some(), "a key never inserted: {:?}", s.key);
                let i = i.unwrap();
                prop_assert!(ever.contains(&(i, s.cookie.0)), "key {} with a cookie it never had", i);
                if stable.get(&i) == Some(&s.cookie) {
                    *stable_seen.entry(i).or_default() += 1;
                }
            }
            for i in stable.keys() {
                prop_assert_eq!(stable_seen.get(i).copied(), Some(1), "stable key {} not listed once", i);
            }
        }
    }
}

/// The position in hash order a cursor names: (top 32 bits of the hash,
/// cookie), read back from its string form
/// `c3.<table>.<hash>.<cookie>.<dump>`.
fn position(c: &Cursor) -> (u64, u64) {
    let s = c.to_string();
    let f: Vec<u64> = s
        .split('.')
        .skip(2)
        .take(2)
        .map(|p| u64::from_str_radix(p, 16).unwrap())
        .collect();
    (f[0], f[1])
}

/// More calls than any dump of the tests below needs (pages of one over
/// at most 1,200 entries): a dump that has not ended by then fails.
const CALLS: usize = 10_000;

/// Pages of one through the whole table on a thread of its own (a fresh
/// dump scratch): every entry's (cookie, position).
fn positions(t: &FlowTable) -> Vec<(u64, (u64, u64))> {
    std::thread::scope(|s| {
        s.spawn(|| {
            let (mut out, mut all, mut cur) = (Vec::new(), Vec::new(), None);
            for _ in 0..CALLS {
                out.clear();
                cur = t.dump(cur.as_ref(), &DumpFilter::default(), 1, &mut out);
                let Some(c) = cur else { return all };
                all.extend(out.iter().map(|s| (s.cookie.0, position(&c))));
            }
            panic!("a dump of pages of one did not end in {CALLS} calls");
        })
        .join()
        .unwrap()
    })
}

/// A thread remembers where its last page ended inside a bucket, and the
/// bucket's sorted entries as it read them. That list is complete only for
/// a dump that was already running when it was read: a dump that started
/// later, whose page ends on the same entry (same filter and page sizes, or
/// pages of one), must read the bucket itself, or it misses entries
/// inserted in between although they were present for its whole run.
#[test]
fn a_dump_never_goes_on_from_a_bucket_read_before_it_started() {
    let t = FlowTable::new(TableConfig {
        shared_buckets: 1024,
        max_shared_entries: 0,
        max_chain: 1024,
        memory_budget: 1 << 24,
        seed: Some(7),
    });
    t.add_tenant(TenantId(1), TenantConfig::default()).unwrap();
    let mut cookies = HashSet::new();
    for i in 0..200 {
        cookies.insert(t.insert(key(i), init(i), Millis(0)).unwrap().0);
    }
    let n = t.tenant_stats(TenantId(1)).unwrap().buckets;
    let bucket_of = |p: (u64, u64)| (p.0 * n as u64) >> 32;
    // x: an entry with two more after it in its bucket.
    let old = positions(&t);
    let k = (0..old.len() - 2)
        .find(|&k| bucket_of(old[k].1) == bucket_of(old[k + 2].1))
        .expect("a bucket of three entries");
    let (x, last) = (old[k].1, old[k + 2].1);
    // Dump 1, on this thread: pages of one, up to and including x (it reads
    // x's bucket, sorted, and remembers its place there).
    let f = DumpFilter::default();
    let mut out = Vec::new();
    let mut cur = None;
    for _ in 0..=k {
        out.clear();
        cur = t.dump(cur.as_ref(), &f, 1, &mut out);
    }
    assert_eq!(cur.map(|c| position(&c)), Some(x));
    // Entries inserted after dump 1 read x's bucket; dump 2 starts after.
    let mut added = HashSet::new();
    for i in 200..1200 {
        added.insert(t.insert(key(i), init(i), Millis(0)).unwrap().0);
    }
    cookies.extend(&added);
    // The case this test is about: no resize since, and entries added
    // between x and the bucket's last entry as dump 1 read it.
    assert_eq!(
        t.tenant_stats(TenantId(1)).unwrap().buckets,
        n,
        "a resize would make this another case"
    );
    let between = positions(&t)
        .iter()
        .filter(|&&(c, p)| added.contains(&c) && x < p && p < last)
        .count();
    assert!(
        between > 0,
        "no entry added between x and {last:?}: the test needs one"
    );
    // Dump 2, on another thread, pages of one, until it has listed x.
    let (at, mut seen) = std::thread::scope(|s| {
        s.spawn(|| {
            let (mut out, mut seen, mut cur) = (Vec::new(), Vec::new(), None);
            for _ in 0..CALLS {
                out.clear();
                cur = t.dump(cur.as_ref(), &f, 1, &mut out);
                seen.extend(out.iter().map(|s| s.cookie.0));
                match cur {
                    Some(c) if position(&c) != x => {}
                    _ => return (cur, seen),
                }
            }
            panic!("dump 2 did not reach x in {CALLS} calls");
        })
        .join()
        .unwrap()
    });
    assert_eq!(at.map(|c| position(&c)), Some(x), "dump 2 lists x too");
    // Dump 2 goes on here, where dump 1's page ended at x.
    let mut cur = at;
    for _ in 0..CALLS {
        out.clear();
        cur = t.dump(cur.as_ref(), &f, 1, &mut out);
        seen.extend(out.iter().map(|s| s.cookie.0));
        if cur.is_none() {
            break;
        }
    }
    assert!(cur.is_none(), "dump 2 did not end in {CALLS} calls");
    let listed: HashSet<u64> = seen.iter().copied().collect();
    assert_eq!(listed.len(), seen.len(), "an entry listed twice");
    let missed = cookies.difference(&listed).count();
    assert_eq!(
        missed, 0,
        "dump 2 missed {missed} entries present for its whole run"
    );
    assert_eq!(listed, cookies);
}

/// Pages of one list most entries from the thread's remembered bucket
/// with copies of tenants' timeouts, without the tenant directory.
/// Every entry listed must still show the timeouts a lookup gives it at
/// that moment: its own tenant's (two tenants share the table), its
/// profile's, and the ones set since the last page; the tenant removed
/// and added again in the middle of the dump too.
#[test]
fn pages_of_one_show_every_entry_the_timeouts_it_has_now() {
    // The other tenant: its copy would go in tenant 1's place (ids modulo
    // 64), which it must not take for its own.
    const OTHER: u32 = 65;
    let t = FlowTable::new(TableConfig {
        shared_buckets: 32,
        max_shared_entries: 0,
        max_chain: 1024,
        memory_budget: 1 << 24,
        seed: Some(7),
    });
    for id in [1, OTHER] {
        t.add_tenant(TenantId(id), TenantConfig::default()).unwrap();
    }
    let o = TimeoutOverrides::NONE.with(FlowState::Established, Millis(2_000));
    let held = t.timeout_profile(TenantId(1), &o).unwrap();
    // Tenant 1: 0, 2, 4, ... (every 14th with the profile); the other: 1, 3, ...
    let tenant = |i: u32| if i.is_multiple_of(2) { 1 } else { OTHER };
    let mut stable = HashSet::new();
    for i in 0..300 {
        let profile = if i % 14 == 0 {
            held.for_init()
        } else {
            ProfileRef::NONE
        };
        let init = FlowInit { profile, ..init(i) };
        let c = t.insert(common::spread_key(tenant(i), i, 3), init, Millis(0));
        if tenant(i) == 1 {
            stable.insert(c.unwrap().0);
        }
    }
    let f = DumpFilter::default();
    let (mut cur, mut out, mut seen) = (None, Vec::new(), Vec::new());
    let mut pages = 0;
    loop {
        pages += 1;
        assert!(pages < CALLS, "the dump did not end in {CALLS} calls");
        out.clear();
        let more = t.dump_page(&mut cur, &f, 1, &mut out);
        for s in &out {
            let now = t.get(&s.key).expect("a listed entry is there");
            assert_eq!(now.cookie, s.cookie);
            assert_eq!(
                s.expires_at, now.expires_at,
                "page {pages}: {:?} of {:?}",
                s.cookie, s.key.tenant
            );
            seen.push(s.cookie.0);
        }
        if !more {
            break;
        }
        // Tenant 1's own timeouts change every few pages.
        if pages % 5 == 0 {
            let established = Millis(10_000 + pages as u64 * 1_000);
            t.set_timeouts(
                TenantId(1),
                Timeouts {
                    established,
                    ..Timeouts::default()
                },
            )
            .unwrap();
        }
        // The other tenant goes, and comes back with other timeouts and
        // entries.
        if pages == 100 {
            t.remove_tenant(TenantId(OTHER), &mut Vec::new()).unwrap();
            t.add_tenant(
                TenantId(OTHER),
                TenantConfig {
                    timeouts: Timeouts {
                        established: Millis(4_000),
                        ..Timeouts::default()
                    },
                    ..TenantConfig::default()
                },
            )
            .unwrap();
            for i in (301..600).step_by(2) {
                t.insert(common::spread_key(OTHER, i, 3), init(i), Millis(0))
                    .unwrap();
            }
        }
    }
    let listed: HashSet<u64> = seen.iter().copied().collect();
    assert_eq!(listed.len(), seen.len(), "an entry listed twice");
    assert!(
        stable.is_subset(&listed),
        "tenant 1's entries, there all along, not all listed"
    );
}

/// The same when the only tenant is removed in the middle of a dump of
/// pages of one and added again with other timeouts and entries: the
/// copy of its timeouts the thread kept is the old tenant's, under the
/// same id, and must not serve the new one's entries.
#[test]
fn pages_of_one_do_not_list_a_tenant_added_again_with_the_old_ones_timeouts() {
    let t = FlowTable::new(TableConfig {
        shared_buckets: 32,
        max_shared_entries: 0,
        max_chain: 1024,
        memory_budget: 1 << 24,
        seed: Some(7),
    });
    t.add_tenant(TenantId(1), TenantConfig::default()).unwrap();
    for i in 0..200 {
        t.insert(key(i), init(i), Millis(0)).unwrap();
    }
    let f = DumpFilter::default();
    let (mut cur, mut out) = (None, Vec::new());
    let mut listed = 0;
    for pages in 1..CALLS {
        out.clear();
        let more = t.dump_page(&mut cur, &f, 1, &mut out);
        for s in &out {
            let now = t.get(&s.key).expect("a listed entry is there");
            assert_eq!(now.cookie, s.cookie);
            assert_eq!(s.expires_at, now.expires_at, "page {pages}");
        }
        listed += out.len();
        if !more {
            // The new entries after the cursor (same keys, same salt:
            // the same positions as the old ones) are listed.
            assert!(listed > 100, "{listed} listed");
            return;
        }
        if pages == 50 {
            t.remove_tenant(TenantId(1), &mut Vec::new()).unwrap();
            let timeouts = Timeouts {
                established: Millis(4_000),
                ..Timeouts::default()
            };
            t.add_tenant(
                TenantId(1),
                TenantConfig {
                    timeouts,
                    ..TenantConfig::default()
                },
            )
            .unwrap();
            for i in 0..200 {
                t.insert(key(i), init(i), Millis(0)).unwrap();
            }
        }
    }
    panic!("the dump did not end in {CALLS} calls");
}
