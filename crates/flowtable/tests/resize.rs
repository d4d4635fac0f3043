//! Online resize, handles and batched lookups.
//!
//! * A table grows while inserts go on and shrinks back when entries leave,
//!   every entry findable throughout.
//! * A paged dump returns every entry present for the whole dump exactly
//!   once although the table resizes between (and during) its pages.
//! * Concurrently: lookups of stable entries never miss and full dumps see
//!   each stable entry exactly once while a writer grows and shrinks the
//!   table (bounded in iterations and time).
//! * Handles reach their entry without hashing and never another entry.
//! * A batched lookup answers exactly as one-at-a-time lookups.

use std::collections::HashMap;
use std::sync::Arc;

use weir_flowtable::*;

mod common;

fn key(tenant: u32, i: u32) -> FlowKey {
    common::spread_key(tenant, i, 5)
}

fn init(i: u32) -> FlowInit<'static> {
    common::spread_init(i, 3, 5, i)
}

fn small_table(entries: usize) -> FlowTable {
    let t = FlowTable::new(TableConfig {
        shared_buckets: entries,
        max_shared_entries: 0,
        max_chain: 64,
        memory_budget: 1 << 26,
        seed: Some(11),
    });
    t.add_tenant(TenantId(1), TenantConfig::default()).unwrap();
    t
}

fn buckets(t: &FlowTable) -> usize {
    t.tenant_stats(TenantId(1)).unwrap().buckets
}

/// Runs maintenance until no resize is running (bounded).
fn settle(t: &FlowTable) {
    for _ in 0..10_000 {
        t.maintain();
        if !t.resize_state(TenantId(1)).unwrap().0 {
            return;
        }
    }
    panic!("resize did not finish");
}

#[test]
fn grows_and_shrinks_online_every_entry_found() {
    let t = small_table(64);
    let b0 = buckets(&t);
    let n = 50_000;
    for i in 0..n {
        t.insert(key(1, i), init(i), Millis(0)).unwrap();
        // Every 1000 inserts, everything so far is still there, resize or not.
        if i % 1000 == 999 {
            for j in (0..=i).step_by(97) {
                assert!(
                    t.get(&key(1, j)).is_some(),
                    "key {j} lost after {i} inserts"
                );
            }
        }
    }
    settle(&t);
    let (resizing, resizes) = t.resize_state(TenantId(1)).unwrap();
    assert!(!resizing);
    assert!(resizes >= 6, "only {resizes} resizes for 64 -> 50k entries");
    let grown = buckets(&t);
    assert!(grown > 50 * b0, "{b0} -> {grown} buckets");
    let st = t.tenant_stats(TenantId(1)).unwrap();
    assert_eq!(st.entries, u64::from(n));
    assert!(st.load_factor <= 0.9, "load {}", st.load_factor);
    for i in 0..n {
        let s = t.get(&key(1, i)).unwrap();
        assert_eq!((s.owner, s.backend), (i, BackendId(i % 5)));
    }
    // Down to 100 entries: the table shrinks back (not below its start).
    for i in 100..n {
        assert!(t.remove(&key(1, i)).is_some());
    }
    for _ in 0..64 {
        settle(&t);
    }
    let shrunk = buckets(&t);
    assert!(shrunk < grown / 16, "{grown} -> {shrunk} buckets");
    assert!(shrunk >= b0);
    for i in 0..n {
        assert_eq!(t.get(&key(1, i)).is_some(), i < 100, "key {i}");
    }
}

#[test]
fn dump_is_exact_across_resizes() {
    let t = small_table(256);
    let stable = 5_000u32;
    for i in 0..stable {
        t.insert(key(1, i), init(i), Millis(0)).unwrap();
    }
    settle(&t);
    let b0 = buckets(&t);
    // Between pages: grow with 40k more entries (inserts move buckets as
    // they go, so pages are read while a resize is half done), then remove
    // them again and let the table shrink.
    let mut next = stable;
    let seen = common::paged_dump(&t, 7, |p| {
        if p < 400 {
            for _ in 0..100 {
                t.insert(key(1, next), init(next), Millis(0)).unwrap();
                next += 1;
            }
        } else if next > stable {
            for _ in 0..200 {
                if next == stable {
                    break;
                }
                next -= 1;
                assert!(t.remove(&key(1, next)).is_some());
            }
            t.maintain();
        }
    });
    let grown = t.resize_state(TenantId(1)).unwrap().1;
    assert!(grown >= 3, "the table resized only {grown} times");
    assert!(buckets(&t) >= b0);
    for i in 0..stable {
        assert_eq!(
            seen.get(&i),
            Some(&1),
            "stable entry {i} seen {:?} times",
            seen.get(&i)
        );
    }
    assert!(
        seen.values().all(|&c| c == 1),
        "an entry was returned twice"
    );
}

#[test]
fn dump_is_exact_with_a_resize_started_mid_page() {
    let t = small_table(4096);
    for i in 0..3_000 {
        t.insert(key(1, i), init(i), Millis(0)).unwrap();
    }
    // Alternate forced grow and shrink resizes, each left half done
    // (a few buckets moved by maintenance-free inserts and removes).
    let mut flip = false;
    let mut extra = 100_000u32;
    let (mut started, mut mid) = (0, 0);
    let seen = common::paged_dump(&t, 13, |p| {
        if p % 20 == 0 && !t.resize_state(TenantId(1)).unwrap().0 {
            flip = !flip;
            assert!(t.start_resize(TenantId(1), if flip { 40_000 } else { 3_000 }));
            started += 1;
        }
        mid += usize::from(t.resize_state(TenantId(1)).unwrap().0);
        // Each insert and remove moves two buckets.
        t.insert(key(1, extra), init(extra), Millis(0)).unwrap();
        assert!(t.remove(&key(1, extra)).is_some());
        extra += 1;
    });
    for i in 0..3_000 {
        assert_eq!(seen.get(&i), Some(&1), "entry {i}");
    }
    // Pages were read with resizes half done, and at least one finished.
    assert!(
        started >= 2 && mid >= 100,
        "{started} resizes, {mid} pages mid-resize"
    );
    assert!(t.resize_state(TenantId(1)).unwrap().1 >= 1);
}

#[test]
fn concurrent_lookups_and_dumps_while_the_table_grows_and_shrinks() {
    let t = Arc::new(small_table(512));
    let stable = 2_000u32;
    for i in 0..stable {
        t.insert(key(1, i), init(i), Millis(0)).unwrap();
    }
    let round = move |t: &FlowTable| {
        for i in stable..stable + 60_000 {
            t.insert(key(1, i), init(i), Millis(0)).unwrap();
        }
        for i in stable..stable + 60_000 {
            assert!(t.remove(&key(1, i)).is_some());
        }
    };
    let check = |t: &FlowTable, i| assert!(t.get(&key(1, i)).is_some(), "stable key {i} missed");
    common::dumps_under_resizes(&t, 50, stable, round, check);
}

#[test]
fn handles_reach_their_entry_and_never_another() {
    let t = small_table(1024);
    let other = small_table(1024);
    let k = key(1, 7);
    let h = t.insert_handle(k, init(7), Millis(1000)).unwrap();
    assert!(t.touch_handle(h, Millis(2000), Dir::In, 100));
    assert!(t.touch_handle(h, Millis(3000), Dir::Out, 40));
    assert!(t.set_state_handle(h, FlowState::FinWait, Millis(3500)));
    assert!(t.set_nat(h, 0x0001_9c40));
    let s = t.get_handle(h).unwrap();
    assert_eq!(
        (s.bytes_in, s.bytes_out, s.packets_in, s.packets_out),
        (100, 40, 1, 1)
    );
    assert_eq!(
        (s.state, s.last_active, s.owner),
        (FlowState::FinWait, Millis(3500), 7)
    );
    assert_eq!(t.nat(h), Some(0x0001_9c40));
    assert_eq!(t.handle(&k), Some(h));
    assert_eq!(t.get(&k), Some(s));
    // A handle from another table finds nothing there.
    assert_eq!(other.get_handle(h), None);
    assert!(!other.touch_handle(h, Millis(0), Dir::In, 1));
    // Removed and re-inserted: the old handle names nothing, the new one works.
    assert_eq!(t.remove_handle(h).map(|s| s.cookie), Some(h.cookie));
    assert_eq!(t.remove_handle(h), None);
    let h2 = t.insert_handle(k, init(8), Millis(4000)).unwrap();
    assert_ne!(h2.cookie, h.cookie);
    assert!(!t.touch_handle(h, Millis(5000), Dir::In, 1));
    assert!(!t.set_state_handle(h, FlowState::Close, Millis(5000)));
    assert_eq!(t.get_handle(h), None);
    let s2 = t.get_handle(h2).unwrap();
    assert_eq!(
        (s2.bytes_in, s2.owner, s2.state),
        (0, 8, FlowState::Established)
    );
    // Handles survive resizes (nodes never move).
    for i in 100..20_000 {
        t.insert(key(1, i), init(i), Millis(0)).unwrap();
    }
    settle(&t);
    assert!(t.resize_state(TenantId(1)).unwrap().1 >= 1);
    assert!(t.touch_handle(h2, Millis(6000), Dir::In, 5));
    assert_eq!(t.get(&k).unwrap().bytes_in, 5);
}

#[test]
fn sequence_places_are_kept_per_direction_and_start_empty() {
    let t = small_table(1024);
    let k = key(1, 7);
    let h = t.insert_handle(k, init(7), Millis(1000)).unwrap();
    let note = |h, dir, v| t.track_seq_handle(h, dir, |_, _| Some(v));
    assert_eq!(note(h, Dir::In, 100), Some((FlowState::Established, 0)));
    assert_eq!(note(h, Dir::In, 200), Some((FlowState::Established, 100)));
    assert_eq!(note(h, Dir::Out, 9), Some((FlowState::Established, 0)));
    assert_eq!(
        t.track_seq_handle(h, Dir::In, |_, _| None),
        Some((FlowState::Established, 200)),
        "None leaves the place"
    );
    assert_eq!(t.track_seq_handle(h, Dir::In, |_, _| None).unwrap().1, 200);
    assert!(t.remove_handle(h).is_some());
    assert_eq!(note(h, Dir::In, 1), None, "a stale handle notes nothing");
    // Nodes are reused once their grace period is over: every new entry,
    // on a reused node or not, starts with nothing noted either way.
    for i in 0..20_000u32 {
        let h = t.insert_handle(key(1, 10 + i), init(i), Millis(0)).unwrap();
        assert_eq!(note(h, Dir::In, 555).unwrap().1, 0, "entry {i}");
        assert_eq!(note(h, Dir::Out, 555).unwrap().1, 0, "entry {i}");
        assert!(t.remove_handle(h).is_some());
        if i % 1000 == 0 {
            settle(&t);
        }
    }
}

#[test]
fn batched_lookup_matches_single_lookups() {
    let t = small_table(256);
    t.add_tenant(
        TenantId(2),
        TenantConfig {
            own_buckets: 1024,
            ..Default::default()
        },
    )
    .unwrap();
    for i in (0..20_000).step_by(2) {
        t.insert(key(1, i), init(i), Millis(0)).unwrap();
        t.insert(key(2, i + 1), init(i + 1), Millis(0)).unwrap();
    }
    // Mid-resize for part of the run.
    assert!(t.start_resize(TenantId(1), 200_000) || t.resize_state(TenantId(1)).unwrap().0);
    let keys: Vec<FlowKey> = (0..2_000)
        .flat_map(|i| [key(1, i), key(2, i), key(9, i)])
        .collect();
    let r = t.reader();
    let mut out = Vec::new();
    for round in 0..3 {
        r.lookup_batch(&keys, &mut out);
        assert_eq!(out.len(), keys.len());
        for (k, got) in keys.iter().zip(&out) {
            let want = t.get(k).map(|s| (s.cookie, s.backend));
            assert_eq!(
                got.map(|(h, b)| (h.cookie, b)),
                want,
                "round {round} key {k:?}"
            );
        }
        t.maintain();
    }
}

#[test]
fn a_cap_stops_growth_and_refuses_inserts_past_it() {
    // Shared table capped at its starting size; an own table capped at 4x.
    let t = FlowTable::new(TableConfig {
        shared_buckets: 64,
        max_shared_entries: 64,
        max_chain: 16,
        memory_budget: 1 << 26,
        seed: Some(3),
    });
    t.add_tenant(TenantId(1), TenantConfig::default()).unwrap();
    t.add_tenant(
        TenantId(2),
        TenantConfig {
            own_buckets: 1024,
            max_entries: 4096,
            ..Default::default()
        },
    )
    .unwrap();
    let b1 = buckets(&t);
    let mut refused = 0;
    for i in 0..10_000 {
        if t.insert(key(1, i), init(i), Millis(0)).is_err() {
            refused += 1;
        }
        let _ = t.insert(key(2, i), init(i), Millis(0));
        t.maintain();
    }
    assert_eq!(buckets(&t), b1, "the capped shared table grew");
    let st = t.tenant_stats(TenantId(1)).unwrap();
    assert!(
        refused > 0 && st.refused_inserts == refused,
        "{refused} refused, {st:?}"
    );
    let own = t.tenant_stats(TenantId(2)).unwrap();
    // Sized for its cap at a load of 0.75, give or take a doubling.
    let at_cap = (4096.0 / (BUCKET_WAYS as f64 * 0.75)) as usize;
    assert!(
        own.buckets >= at_cap && own.buckets <= 2 * at_cap + 1,
        "own table at {} buckets",
        own.buckets
    );
    assert!(
        own.refused_inserts > 0,
        "the capped own table never refused"
    );
    assert!(
        t.resize_state(TenantId(2)).unwrap().1 >= 1,
        "the own table never grew"
    );
    // The caps are caps on entries, not only on growth: one thread, so
    // exactly the cap is held and everything past it was refused.
    assert_eq!(st.entries, 64, "{st:?}");
    assert_eq!(own.entries, 4096, "{own:?}");
    assert_eq!(own.refused_inserts, 10_000 - 4096, "{own:?}");
}

/// `transition_handle` is a compare-and-swap: from many threads, each step
/// of a chain of states is taken by exactly one caller, and a removed entry
/// takes none (so per-state counts kept by callers stay exact).
#[test]
fn transitions_are_taken_once_and_never_after_removal() {
    let t = small_table(1024);
    let h = t.insert_handle(key(1, 9), init(9), Millis(1000)).unwrap();
    let chain = [
        FlowState::Established,
        FlowState::FinWait,
        FlowState::TimeWait,
        FlowState::Close,
    ];
    let step = |s: FlowState| {
        let i = chain.iter().position(|&c| c == s)?;
        chain.get(i + 1).copied()
    };
    let taken: Vec<Vec<(FlowState, FlowState)>> = std::thread::scope(|sc| {
        let ws: Vec<_> = (0..4)
            .map(|_| {
                sc.spawn(|| {
                    let mut mine = Vec::new();
                    for _ in 0..100 {
                        if let Some(m) = t.transition_handle(h, Millis(2000), step) {
                            mine.push(m);
                        }
                    }
                    mine
                })
            })
            .collect();
        ws.into_iter().map(|w| w.join().unwrap()).collect()
    });
    let mut all: Vec<_> = taken.into_iter().flatten().collect();
    all.sort_by_key(|(from, _)| chain.iter().position(|c| c == from));
    let want: Vec<_> = chain.windows(2).map(|w| (w[0], w[1])).collect();
    assert_eq!(all, want, "each step exactly once");
    let s = t.get_handle(h).unwrap();
    assert_eq!((s.state, s.last_active), (FlowState::Close, Millis(2000)));
    // No change asked: nothing moves.
    assert_eq!(t.transition_handle(h, Millis(3000), |_| None), None);
    // After removal the handle moves nothing.
    let removed = t.remove_handle(h).unwrap();
    assert_eq!(removed.state, FlowState::Close);
    assert_eq!(
        t.transition_handle(h, Millis(4000), |_| Some(FlowState::Established)),
        None
    );
}

/// Two tables dumped page by page, alternately, on one thread: each dump
/// returns each of its entries exactly once. The tables hold the same keys
/// inserted in the same order, so the same (node, cookie) pairs, under
/// different hash keys: a dump must not use positions it remembered from
/// the other table's buckets (the per-thread dump scratch is per table).
#[test]
fn interleaved_dumps_of_two_tables_on_one_thread_stay_exact() {
    let table = |seed| {
        let t = FlowTable::new(TableConfig {
            shared_buckets: 512,
            max_shared_entries: 0,
            max_chain: 64,
            memory_budget: 1 << 26,
            seed: Some(seed),
        });
        t.add_tenant(TenantId(1), TenantConfig::default()).unwrap();
        for i in 0..2_000 {
            t.insert(key(1, i), init(i), Millis(0)).unwrap();
        }
        settle(&t);
        t
    };
    let (a, b) = (table(11), table(12));
    let (mut ca, mut cb): (Option<Cursor>, Option<Cursor>) = (None, None);
    let (mut seen_a, mut seen_b) = (HashMap::new(), HashMap::new());
    let mut out = Vec::new();
    let (mut done_a, mut done_b) = (false, false);
    for _ in 0..10_000 {
        for (t, cur, seen, done) in [
            (&a, &mut ca, &mut seen_a, &mut done_a),
            (&b, &mut cb, &mut seen_b, &mut done_b),
        ] {
            if *done {
                continue;
            }
            out.clear();
            *cur = t.dump(cur.as_ref(), &DumpFilter::default(), 1, &mut out);
            for s in &out {
                *seen.entry(s.owner).or_insert(0u32) += 1;
            }
            *done = cur.is_none();
        }
        if done_a && done_b {
            break;
        }
    }
    assert!(done_a && done_b, "the dumps did not end");
    for seen in [&seen_a, &seen_b] {
        assert_eq!(seen.len(), 2_000, "entries seen");
        assert!(seen.values().all(|&c| c == 1), "an entry returned twice");
    }
}
