//! loom model checks of the bucket index protocol (`index.rs`): lock-free
//! lookups and dump reads racing with inserts and removes under the bucket
//! lock bit, with a second writer, and with a resize moving the bucket.
//! Compiled only with `--cfg loom`; `tests/loom.rs` runs each check:
//!
//! `RUSTFLAGS="--cfg loom" cargo test -p weir-flowtable --release --test loom`
//!
//! What is checked, on every interleaving loom explores: a lookup of an
//! entry present throughout always finds it — in the head line or an
//! overflow line, before, during or after its bucket moves to the successor
//! index; a lookup racing with the insert of an entry finds either nothing
//! or the fully initialised entry (never a torn key or a zero cookie); a
//! lookup racing with a remove finds either the whole entry or nothing; two
//! writers on one bucket never lose an entry; a bucket read for a dump
//! holds every entry present throughout.
//!
//! Reply keys (packet mode, `FlowTable::insert_reply`): an insert with a
//! reply key racing with reply lookups and with the removal of another
//! reply entry in the same bucket — a reply lookup finds a flow only once
//! it is fully in and live, never after its removal returned, and never a
//! flow whose insert is refused (rolled back) because its reply key is
//! taken; a reply way and a forward way with the same tag never match each
//! other's lookups.
//!
//! Held templates (`FlowTable::hold`, `release`, `insert_held`): holds and
//! releases racing with expiry's final check, all under the bucket lock —
//! a template is never removed by expiry while a hold is counted, a hold
//! either counts before expiry looks or finds the template gone, and the
//! last release restarts the timeout so a racing expiry keeps it.
//!
//! Handles (`FlowTable::handle_node`): a stale handle checked while its
//! node is reused for a new entry never takes the new entry for its own.
//!
//! Snapshots by cookie (`Node::snapshot_of`, what dumps list with, some
//! pages without the epoch pin): a snapshot taken while the entry is
//! removed and its node initialised for a new entry is either the old
//! entry's whole or refused, never the old key and cookie with the new
//! entry's fields.

use loom::sync::Arc;
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::thread;

use crate::index::{Hash, Index, Put};
use crate::node::{Arena, NodeVec, PackedKey, PackedReply};
use crate::types::{BackendId, FlowInit, FlowState, Millis, ServiceId};

/// `loom::model` with at most 3 preemptions unless `LOOM_MAX_PREEMPTIONS`
/// says otherwise. (Under loom a writer waits for a bucket's lock bit on a
/// loom mutex, see `index::Bucket`.)
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(3);
    }
    b.check(f);
}

struct World {
    nodes: NodeVec,
    index: Index,
}

fn key(i: u32) -> PackedKey {
    PackedKey {
        tenant: 7,
        bits: 0,
        ports: 1000 + i,
        caddr: [u64::from(i), 0xdead_0000 + u64::from(i)],
        vaddr: [0, 0x0a00_0001],
    }
}

/// Entry `i`'s hash: every entry lands in bucket 0 of a one-bucket index;
/// in a two-bucket successor, even entries go to bucket 0, odd to 1. Tags
/// of entries 0..4 repeat (i % 2) so tag matches that are not key matches
/// are explored; entries from 4 on have a tag of their own (one no summary
/// admits unless it holds that entry, or its bucket moved).
fn hash(i: u32) -> u64 {
    let hi: u64 = if i.is_multiple_of(2) {
        0x1000_0000
    } else {
        0x9000_0000
    };
    let tag = if i < 4 { i % 2 } else { i };
    (hi << 32) | u64::from(tag)
}

/// The cookie of node `i`'s first entry (use count 1): an unpublished node
/// reads as use count 0, so comparing with this catches a torn publish.
fn cookie_of(i: u32) -> u64 {
    crate::table::next_cookie(0, i)
}

fn init(w: &World, i: u32, cookie: u64) {
    let init = FlowInit {
        service: ServiceId(i),
        backend: BackendId(100 + i),
        state: FlowState::Established,
        owner: i,
        profile: crate::types::ProfileRef::NONE,
    };
    w.nodes
        .node(i)
        .init(&key(i), &init, cookie, Millis(5), 0, false);
}

fn insert(w: &World, i: u32) {
    init(w, i, cookie_of(i));
    let h = Hash::new(hash(i));
    let (home, mut l) = w.index.lock_home(h);
    let r = home.put(&mut l, &w.nodes, h, Some(&key(i)), i, 64);
    assert!(matches!(r, Put::Done(_)), "insert {i}: {r:?}");
}

fn remove(w: &World, i: u32) {
    let h = Hash::new(hash(i));
    let (home, mut l) = w.index.lock_home(h);
    assert!(home.unput(&mut l, h, i), "remove {i}");
    w.nodes.node(i).clear_live();
}

/// `nodes` nodes, entries `0..present` inserted before threads start;
/// `succ` = a two-bucket successor exists (a resize has started).
fn world(nodes: u32, present: u32, succ: bool) -> Arc<World> {
    let w = World {
        nodes: NodeVec::new(nodes as usize),
        index: Index::try_new(1).unwrap(),
    };
    if succ {
        assert!(
            w.index
                .set_successor(std::sync::Arc::new(Index::try_new(2).unwrap()))
        );
    }
    for i in 0..present {
        insert(&w, i);
    }
    Arc::new(w)
}

/// A found node must be exactly entry `i`.
fn check_found(w: &World, i: u32) -> bool {
    match w.index.find(&w.nodes, Hash::new(hash(i)), &key(i)) {
        None => false,
        Some(idx) => {
            // `find` compared the whole key already; the cookie and the
            // backend (written before and after it by `init`) must be there.
            assert_eq!(idx, i);
            let n = w.nodes.node(idx);
            assert_eq!(n.cookie(), cookie_of(i), "cookie not published");
            assert_eq!(n.backend(), BackendId(100 + i), "backend not published");
            true
        }
    }
}

/// What a dump reads of bucket 0 (following the move): only initialised
/// entries; returns their numbers.
fn check_bucket_read(w: &World) -> Vec<u32> {
    let mut ids = Vec::new();
    if !w.index.read_bucket(0, &mut ids) {
        let s = w.index.successor().unwrap();
        assert!(s.read_bucket(0, &mut ids) && s.read_bucket(1, &mut ids));
    }
    for &i in &ids {
        let n = w.nodes.node(i);
        assert_eq!(n.key(), key(i), "dump read a torn key");
        assert_eq!(n.cookie(), cookie_of(i), "dump read an unpublished cookie");
    }
    ids
}

/// Lookup and dump read racing with an insert into an overflow line (two
/// ways per line under loom, one in each tag word, so every line read
/// loads both words).
pub fn lookup_vs_insert_into_overflow() {
    model(|| {
        // 0, 1 fill the head line, 2 sits in an overflow line (present
        // throughout). The writer inserts 3 (into the overflow line).
        let w = world(4, 3, false);
        let wr = Arc::clone(&w);
        let writer = thread::spawn(move || insert(&wr, 3));
        let rd = Arc::clone(&w);
        let reader = thread::spawn(move || {
            assert!(check_found(&rd, 2), "stable overflow entry missed");
            let _ = check_found(&rd, 3);
        });
        writer.join().unwrap();
        reader.join().unwrap();
        assert!(check_found(&w, 3));
    });
}

/// Once an insert has returned, every lookup finds its entry, also one
/// that read the bucket's summary before any way: the insert's summary
/// bits go in before its tag, so a lookup that saw the insert finished
/// (here a flag the writer sets after it) sees them.
pub fn completed_insert_is_found() {
    model(|| {
        let w = world(2, 1, false);
        let done = Arc::new(AtomicBool::new(false));
        let (wr, d) = (Arc::clone(&w), Arc::clone(&done));
        let writer = thread::spawn(move || {
            insert(&wr, 1);
            d.store(true, Ordering::Release);
        });
        let (rd, d) = (Arc::clone(&w), Arc::clone(&done));
        let reader = thread::spawn(move || {
            let seen = check_found(&rd, 1);
            if d.load(Ordering::Acquire) {
                assert!(check_found(&rd, 1), "a finished insert missed");
            }
            if seen {
                assert!(check_found(&rd, 1), "found, then missed");
            }
        });
        writer.join().unwrap();
        reader.join().unwrap();
    });
}

/// Lookup and dump read racing with a remove from the head line.
pub fn lookup_vs_remove() {
    model(|| {
        let w = world(3, 3, false);
        let wr = Arc::clone(&w);
        let writer = thread::spawn(move || remove(&wr, 0));
        let rd = Arc::clone(&w);
        let reader = thread::spawn(move || {
            let _ = check_found(&rd, 0);
            let ids = check_bucket_read(&rd);
            assert!(
                ids.contains(&1) && ids.contains(&2),
                "dump read missed a stable entry"
            );
        });
        writer.join().unwrap();
        reader.join().unwrap();
        assert!(!check_found(&w, 0));
        assert!(check_found(&w, 2));
    });
}

/// Two writers on one bucket (the lock bit) and a reader.
pub fn two_writers_and_a_reader() {
    model(|| {
        let w = world(3, 1, false);
        let spawn = |i: u32| {
            let wr = Arc::clone(&w);
            thread::spawn(move || insert(&wr, i))
        };
        let a = spawn(1);
        let b = spawn(2);
        let rd = Arc::clone(&w);
        let reader = thread::spawn(move || {
            assert!(check_found(&rd, 0));
            let _ = check_found(&rd, 1);
            let _ = check_found(&rd, 2);
        });
        a.join().unwrap();
        b.join().unwrap();
        reader.join().unwrap();
        assert!(check_found(&w, 1) && check_found(&w, 2));
        let mut ids = check_bucket_read(&w);
        ids.sort_unstable();
        assert_eq!(ids, [0, 1, 2], "a writer's entry was lost");
    });
}

/// A resize moves the bucket while a reader looks up and a writer inserts
/// (its home decided under the old bucket's lock) an entry whose tag no
/// other entry has, so only the moved bucket's all-ones summary lets a
/// lookup through the old index once the insert went to the successor.
pub fn lookup_and_insert_vs_migration() {
    model(|| {
        let w = world(5, 3, true);
        let mv = Arc::clone(&w);
        let mover = thread::spawn(move || {
            assert!(mv.index.claim() == Some(0));
            mv.index.migrate(0, &mv.nodes, &hash);
        });
        let done = Arc::new(AtomicBool::new(false));
        let (wr, d) = (Arc::clone(&w), Arc::clone(&done));
        let writer = thread::spawn(move || {
            insert(&wr, 4);
            d.store(true, Ordering::Release);
        });
        let (rd, d) = (Arc::clone(&w), Arc::clone(&done));
        let reader = thread::spawn(move || {
            // 2 sits in the old index's overflow line (two ways per line).
            assert!(check_found(&rd, 2), "entry 2 missed during the move");
            assert!(check_found(&rd, 1), "entry 1 missed during the move");
            // Once the insert returned (into either index), the old
            // bucket's summary admits it: all ones before MOVED.
            let finished = d.load(Ordering::Acquire);
            let found = check_found(&rd, 4);
            assert!(
                found || !finished,
                "a finished insert missed during the move"
            );
        });
        mover.join().unwrap();
        writer.join().unwrap();
        reader.join().unwrap();
        assert!(w.index.fully_moved());
        // Everything, the racing insert included, is in the successor once.
        let s = w.index.successor().unwrap();
        let mut ids = Vec::new();
        assert!(s.read_bucket(0, &mut ids) && s.read_bucket(1, &mut ids));
        ids.sort_unstable();
        assert_eq!(ids, [0, 1, 2, 4]);
        for i in [0, 1, 2, 4] {
            assert!(check_found(&w, i));
        }
    });
}

/// Inserts entry `i` (key `k`, backend `backend`) with a nat reply key as
/// `FlowTable::insert_reply` does: pending node, forward way, then the
/// reply way (which makes it live), or the forward way taken out again.
/// The reply way's hash is `hash(rh)`, the same bucket and tag as forward
/// ways, so the reply bit is what tells them apart. Returns the outcome of
/// the reply step.
fn insert_reply(w: &World, i: u32, k: &PackedKey, backend: u32, rh: u32) -> Put {
    let init = FlowInit {
        service: ServiceId(i),
        backend: BackendId(backend),
        state: FlowState::Established,
        owner: i,
        profile: crate::types::ProfileRef::NONE,
    };
    w.nodes
        .node(i)
        .init(k, &init, cookie_of(i), Millis(5), 0, true);
    let h = Hash::new(hash(i));
    {
        let (home, mut l) = w.index.lock_home(h);
        let r = home.put(&mut l, &w.nodes, h, Some(k), i, 64);
        assert!(matches!(r, Put::Done(_)), "insert {i}: {r:?}");
    }
    let rk = w.nodes.node(i).reply_key();
    let r = w
        .index
        .publish_reply(&w.nodes, Hash::new(hash(rh)), &rk, i, 64);
    if !matches!(r, Put::Done(_)) {
        assert!(w.index.unpublish(h, i), "roll back {i}");
    }
    r
}

/// Removes entry `i` (which has a reply key) as `FlowTable` does: the
/// forward way under its lock decides, then the reply way and the live bit.
fn remove_reply(w: &World, i: u32, rh: u32) {
    let h = Hash::new(hash(i));
    {
        let (home, mut l) = w.index.lock_home(h);
        assert!(home.unput(&mut l, h, i), "remove {i}");
    }
    assert!(w.index.retire_reply(&w.nodes, Hash::new(hash(rh)), i));
}

/// The reply key entry `i` would have (nat: its client, backend 100 + i).
fn reply_key(i: u32) -> PackedReply {
    let k = key(i);
    PackedReply {
        tenant: k.tenant,
        bits: 0,
        backend: 100 + i,
        nat: 0,
        port: k.ports >> 16,
        caddr: k.caddr,
    }
}

/// A reply lookup of `rk` (hash of entry `rh`): `None`, or a live,
/// fully initialised entry with that reply key; its number.
fn find_reply(w: &World, rk: &PackedReply, rh: u32) -> Option<u32> {
    let i = w.index.find(&w.nodes, Hash::new(hash(rh)), rk)?;
    let n = w.nodes.node(i);
    assert_eq!(n.cookie(), cookie_of(i), "cookie not published");
    assert_eq!(n.owner(), i, "owner not published");
    assert_eq!(n.reply_key(), *rk, "found another flow's reply entry");
    Some(i)
}

/// `loom::model` with at most `n` preemptions unless `LOOM_MAX_PREEMPTIONS`
/// says otherwise.
fn model_bounded(n: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(n);
    }
    b.check(f);
}

/// A one-bucket index with room for two entries, entry 0 in it with its
/// reply key.
fn reply_flow_world() -> Arc<World> {
    let w = Arc::new(World {
        nodes: NodeVec::new(2),
        index: Index::try_new(1).unwrap(),
    });
    assert!(matches!(insert_reply(&w, 0, &key(0), 100, 0), Put::Done(_)));
    w
}

/// A thread inserting entry 1 with its reply key into `w`, which succeeds.
fn insert_reply_flow_1(w: &Arc<World>) -> thread::JoinHandle<()> {
    let w = Arc::clone(w);
    thread::spawn(move || {
        assert!(matches!(insert_reply(&w, 1, &key(1), 101, 1), Put::Done(_)));
    })
}

/// An insert with a reply key races with a reply lookup of a flow present
/// throughout (always found) and of the flow being inserted (found only
/// fully in and live).
pub fn insert_reply_vs_lookup_reply() {
    model(|| {
        let w = reply_flow_world();
        let inserter = insert_reply_flow_1(&w);
        let rd = Arc::clone(&w);
        let reader = thread::spawn(move || {
            assert_eq!(
                find_reply(&rd, &reply_key(0), 0),
                Some(0),
                "stable reply missed"
            );
            let _ = find_reply(&rd, &reply_key(1), 1);
            assert!(check_found(&rd, 0), "stable flow missed");
        });
        inserter.join().unwrap();
        reader.join().unwrap();
        assert_eq!(find_reply(&w, &reply_key(1), 1), Some(1));
        assert!(check_found(&w, 1));
    });
}

/// An insert with a reply key races with reply lookups and with the
/// removal of another reply flow in the same bucket (three threads: at
/// most two preemptions, about 3 minutes; three did not end in 20).
pub fn insert_reply_vs_lookup_reply_vs_remove() {
    model_bounded(2, || {
        // Entry 0 (forward + reply way: the head line's two ways) is
        // removed while entry 1 is inserted with its reply key.
        let w = reply_flow_world();
        let inserter = insert_reply_flow_1(&w);
        let rm = Arc::clone(&w);
        let remover = thread::spawn(move || {
            remove_reply(&rm, 0, 0);
            // Once the removal returned, its reply key never finds it.
            assert_eq!(find_reply(&rm, &reply_key(0), 0), None);
        });
        let rd = Arc::clone(&w);
        let reader = thread::spawn(move || {
            if let Some(i) = find_reply(&rd, &reply_key(1), 1) {
                assert_eq!(i, 1);
            }
            if let Some(i) = find_reply(&rd, &reply_key(0), 0) {
                assert_eq!(i, 0);
            }
        });
        inserter.join().unwrap();
        remover.join().unwrap();
        reader.join().unwrap();
        assert_eq!(find_reply(&w, &reply_key(1), 1), Some(1));
        assert!(check_found(&w, 1));
        assert_eq!(find_reply(&w, &reply_key(0), 0), None);
        assert!(!check_found(&w, 0));
        let ids = check_bucket_read(&w);
        assert_eq!(ids, [1], "dump reads list each live flow once");
    });
}

/// An insert whose reply key is taken is rolled back: no lookup by either
/// key ever returns it, and the flow holding the reply key is found
/// throughout.
pub fn refused_reply_insert_is_never_seen() {
    model(|| {
        let w = reply_flow_world();
        // Entry 1: entry 0's client to another VIP port, same backend, so
        // the same reply key.
        let k1 = PackedKey {
            ports: key(0).ports + 7,
            ..key(0)
        };
        let wr = Arc::clone(&w);
        let inserter = thread::spawn(move || {
            assert_eq!(insert_reply(&wr, 1, &k1, 100, 0), Put::Exists(0));
        });
        let rd = Arc::clone(&w);
        let reader = thread::spawn(move || {
            assert_eq!(
                rd.index.find(&rd.nodes, Hash::new(hash(1)), &k1),
                None,
                "a refused insert was found"
            );
            assert_eq!(find_reply(&rd, &reply_key(0), 0), Some(0));
        });
        inserter.join().unwrap();
        reader.join().unwrap();
        assert_eq!(w.index.find(&w.nodes, Hash::new(hash(1)), &k1), None);
        assert!(check_found(&w, 0));
        assert_eq!(check_bucket_read(&w), [0]);
        assert_eq!(w.index.count(0), Some(2), "the refused insert left a way");
    });
}

/// Template `i` (state Persist, last active at 5 ms) held `held` times,
/// in a one-bucket index.
fn template_world(i: u32, held: u64) -> Arc<World> {
    let w = World {
        nodes: NodeVec::new(i as usize + 1),
        index: Index::try_new(1).unwrap(),
    };
    let init = FlowInit {
        service: ServiceId(i),
        backend: BackendId(100 + i),
        state: FlowState::Persist,
        owner: 0,
        profile: crate::types::ProfileRef::NONE,
    };
    let n = w.nodes.node(i);
    n.init(&key(i), &init, cookie_of(i), Millis(5), 0, false);
    n.init_held(held);
    let h = Hash::new(hash(i));
    let (home, mut l) = w.index.lock_home(h);
    assert!(matches!(
        home.put(&mut l, &w.nodes, h, Some(&key(i)), i, 64),
        Put::Done(_)
    ));
    drop(l);
    Arc::new(w)
}

/// `FlowTable::hold`: under the bucket lock.
fn hold(w: &World, i: u32) -> bool {
    let h = Hash::new(hash(i));
    let (home, l) = w.index.lock_home(h);
    home.find_locked(&l, &w.nodes, h, &key(i))
        .is_some_and(|idx| w.nodes.node(idx).hold_locked())
}

/// `FlowTable::release`: under the bucket lock.
fn release(w: &World, i: u32, now: u64) -> Option<u64> {
    let h = Hash::new(hash(i));
    let (home, l) = w.index.lock_home(h);
    let idx = home.find_locked(&l, &w.nodes, h, &key(i))?;
    w.nodes.node(idx).release_locked(Millis(now))
}

/// Expiry's final step (`FlowTable::unlink_node` with expire's check):
/// under the bucket lock, remove the entry if it is expirable.
fn expire_locked(w: &World, i: u32, now: u64, timeout: u64) -> bool {
    let h = Hash::new(hash(i));
    let (home, mut l) = w.index.lock_home(h);
    let Some(idx) = home.find_locked(&l, &w.nodes, h, &key(i)) else {
        return false;
    };
    let n = w.nodes.node(idx);
    if !n.is_live() || !n.expirable(now, timeout) {
        return false;
    }
    assert!(home.unput(&mut l, h, idx));
    n.clear_live();
    true
}

/// Held templates (IPVS's `n_control`): a hold and then a release (at
/// 100 ms) racing with the expiry (at 50 ms, timeout 10 ms) of an idle,
/// unheld template. Exactly one wins: either the hold finds the template
/// and expiry leaves it (the release restarted its timeout at 100 ms), or
/// expiry took it and the hold finds nothing. A lock-free reader sees a
/// count of 0 or 1, never a torn one.
pub fn hold_release_vs_expiry() {
    model(|| {
        let w = template_world(0, 0);
        let a = {
            let w = Arc::clone(&w);
            thread::spawn(move || {
                if !hold(&w, 0) {
                    return false;
                }
                assert_eq!(release(&w, 0, 100), Some(0));
                true
            })
        };
        let b = {
            let w = Arc::clone(&w);
            thread::spawn(move || expire_locked(&w, 0, 50, 10))
        };
        if let Some(idx) = w.index.find(&w.nodes, Hash::new(hash(0)), &key(0)) {
            assert!(w.nodes.node(idx).held() <= 1);
        }
        let held = a.join().unwrap();
        let expired = b.join().unwrap();
        assert!(held != expired, "held {held}, expired {expired}");
        match w.index.find(&w.nodes, Hash::new(hash(0)), &key(0)) {
            Some(idx) => {
                let n = w.nodes.node(idx);
                assert!(held);
                assert_eq!((n.held(), n.last_active(100)), (0, 100));
            }
            None => assert!(expired),
        }
    });
}

/// A template stored held once (`FlowTable::insert_held`): its connection
/// ends (release at 100 ms) while another connection holds it and the
/// expiry (at 200 ms, timeout 10 ms) looks. A hold that succeeds keeps the
/// template to the end; expiry only ever removes it after the release and
/// before that hold, and then the hold finds nothing.
pub fn release_and_hold_vs_expiry() {
    model(|| {
        let w = template_world(0, 1);
        let a = {
            let w = Arc::clone(&w);
            thread::spawn(move || release(&w, 0, 100))
        };
        let b = {
            let w = Arc::clone(&w);
            thread::spawn(move || hold(&w, 0))
        };
        let expired = expire_locked(&w, 0, 200, 10);
        let released = a.join().unwrap();
        let held = b.join().unwrap();
        // The release always finds the template: it holds it until then.
        assert!(released.is_some());
        assert!(!(held && expired), "expired while held");
        match w.index.find(&w.nodes, Hash::new(hash(0)), &key(0)) {
            Some(idx) => {
                assert!(!expired);
                // Unheld and idle since 100 ms, expiry at 200 ms would
                // have taken it: it ran while a hold was counted.
                assert_eq!(w.nodes.node(idx).held(), u64::from(held));
            }
            None => assert!(expired && !held && released == Some(0)),
        }
    });
}

/// A handle's check (`FlowTable::handle_node`, which has no bucket read to
/// order it) racing with the reuse of its node: entry `0` was removed (its
/// live bit cleared) and, after the grace period, the node is initialised
/// for a new entry while a reader checks the old entry's handle. The reader
/// must never take the new entry for the old one: it sees the old entry
/// gone, or the new entry's cookie.
pub fn stale_handle_vs_node_reuse() {
    model(|| {
        let w = world(1, 1, false);
        remove(&w, 0);
        let old = cookie_of(0);
        let new = crate::table::next_cookie(old, 0);
        let w2 = Arc::clone(&w);
        let writer = thread::spawn(move || init(&w2, 0, new));
        assert!(
            !w.nodes.node(0).is_entry(old),
            "a stale handle reached the node's new entry"
        );
        writer.join().unwrap();
    });
}

/// A dump's snapshot of a node it remembered (`Node::snapshot_of`, with
/// the cookie the dump read earlier; the unpinned resume has no grace
/// period to keep the node) racing with the removal of that entry and the
/// node's reuse for another entry. An accepted snapshot must be all the
/// old entry's: its key, service, backend, owner and times, no field of
/// the new entry's.
///
/// Kept small: every one of the snapshot's ~20 loads may read either
/// entry's store, and with the removal's bucket lock and 3 preemptions the
/// model took ~9 minutes (~1 as it is). So the removal is its write to the
/// node (the live bit; taking the way out of the bucket is not what is
/// checked here), and at most 2 preemptions: a torn copy needs one (the
/// reader's, after its first read of the use count).
pub fn snapshot_vs_node_reuse() {
    model_bounded(2, || {
        let w = world(1, 1, false);
        let old = cookie_of(0);
        let w2 = Arc::clone(&w);
        let writer = thread::spawn(move || {
            w2.nodes.node(0).clear_live();
            // Entry 1's fields, in node 0.
            let new = crate::table::next_cookie(old, 0);
            let init = FlowInit {
                service: ServiceId(1),
                backend: BackendId(101),
                state: FlowState::Established,
                owner: 1,
                profile: crate::types::ProfileRef::NONE,
            };
            w2.nodes
                .node(0)
                .init(&key(1), &init, new, Millis(9000), 0, false);
        });
        if let Some(s) = w.nodes.node(0).snapshot_of(old, 10, |_, _| 0) {
            assert_eq!(s.cookie.0, old);
            assert_eq!(s.key, key(0).unpack(), "torn key");
            assert_eq!(
                (s.service, s.backend, s.owner, s.created, s.last_active),
                (ServiceId(0), BackendId(100), 0, Millis(0), Millis(5)),
                "a snapshot of entry 0 with entry 1's fields"
            );
        }
        writer.join().unwrap();
    });
}
