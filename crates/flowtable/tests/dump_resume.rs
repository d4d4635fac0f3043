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

fn init(i: u32) -> FlowInit {
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
            for (page, cur, got, done) in dumps.iter_mut().filter(|d| !d.3) {
                let before = got.len();
                let next = t.dump(cur.as_ref(), &filter, *page, got);
                prop_assert!(got.len() - before <= *page);
                match next {
                    Some(c) => *cur = Some(c),
                    None => *done = true,
                }
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
