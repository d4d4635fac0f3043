//! loom model checks of the chain protocol (`chain.rs`): lock-free lookups
//! racing with inserts and removes done under the stripe lock. Compiled only
//! with `--cfg loom`; `tests/loom.rs` runs each check:
//!
//! `RUSTFLAGS="--cfg loom" cargo test -p weir-flowtable --release --test loom`
//!
//! What is checked, on every interleaving loom explores: a lookup of an
//! entry present throughout always finds it, whatever is unlinked around it;
//! a lookup racing with the insert of an entry finds either nothing or the
//! fully initialised entry (never a torn key or a zero cookie); a lookup
//! racing with a remove finds either the whole entry or nothing.

use loom::sync::{Arc, Mutex};
use loom::thread;

use crate::chain;
use crate::chain::EMPTY;
use crate::node::{Node, PackedKey};
use crate::sync::AtomicU32;
use crate::types::{BackendId, FlowInit, FlowState, Millis, ServiceId};

/// `loom::model` with at most 3 preemptions unless `LOOM_MAX_PREEMPTIONS`
/// says otherwise (unbounded, the two-writer check takes about a minute;
/// bounded, about a second; the hand-made mutants listed in
/// docs/flowtable.md all fail within the bound).
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(3);
    }
    b.check(f);
}

struct World {
    nodes: Box<[Node]>,
    head: AtomicU32,
    lock: Mutex<()>,
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

/// Bloom tags: entries 0 and 2 share a bit, 1 has its own, so both the
/// "bit set by another node" and "bit cleared on unlink" paths are explored.
fn tag(i: u32) -> u32 {
    i % 2
}

fn init(w: &World, idx: u32, cookie: u64) {
    let k = key(idx);
    let init = FlowInit {
        owner: 0,
        service: ServiceId(idx),
        backend: BackendId(100 + idx),
        state: FlowState::Established,
    };
    w.nodes[idx as usize].init(&k, tag(idx), &init, cookie, Millis(5));
}

/// Chain `0 -> 1 -> ... -> n-1`, built before threads start.
fn world(nodes: u32, linked: u32) -> Arc<World> {
    let w = World {
        nodes: (0..nodes).map(|_| Node::default()).collect(),
        head: AtomicU32::new(EMPTY),
        lock: Mutex::new(()),
    };
    for i in 0..linked {
        init(&w, i, u64::from(i) + 1);
        chain::append(&*w.nodes, &w.head, i, tag(i));
    }
    Arc::new(w)
}

/// A found node must be exactly entry `i`.
fn check_found(w: &World, i: u32) -> bool {
    match chain::find(&*w.nodes, &w.head, &key(i), tag(i)) {
        None => false,
        Some((idx, n)) => {
            assert_eq!(idx, i);
            assert_eq!(n.key(), key(i), "torn key");
            assert_eq!(n.cookie(), u64::from(i) + 1, "cookie not published");
            assert_eq!(n.backend(), BackendId(100 + i), "backend not published");
            true
        }
    }
}

/// A lock-free walk (what dumps do) sees only fully initialised nodes.
fn check_walk(w: &World) -> usize {
    let mut n = 0;
    chain::walk(&*w.nodes, &w.head, 0, u64::MAX, |node| {
        let c = node.cookie();
        assert!(c != 0, "cookie not published");
        let i = (c - 1) as u32;
        assert_eq!(node.key(), key(i), "key not published");
        assert_eq!(node.backend(), BackendId(100 + i), "backend not published");
        n += 1;
        true
    });
    n
}

/// Lookup and walk racing with an insert and a remove.
pub fn lookup_vs_insert_and_remove() {
    model(|| {
        // 0 (stable) -> 1 (removed by the writer); 2 is inserted. Reader and
        // writer are both spawned so loom schedules them symmetrically.
        let w = world(3, 2);
        let wr = Arc::clone(&w);
        let writer = thread::spawn(move || {
            {
                let _g = wr.lock.lock().unwrap();
                init(&wr, 2, 3);
                chain::append(&*wr.nodes, &wr.head, 2, tag(2));
            }
            {
                let _g = wr.lock.lock().unwrap();
                assert!(chain::unlink(&*wr.nodes, &wr.head, 1).is_some());
                wr.nodes[1].clear_live();
            }
        });
        let rd = Arc::clone(&w);
        let reader = thread::spawn(move || {
            assert!(check_found(&rd, 0), "stable entry missed");
            let _ = check_found(&rd, 2);
            let _ = check_found(&rd, 1);
            assert!(check_walk(&rd) >= 1);
        });
        writer.join().unwrap();
        reader.join().unwrap();
        assert!(check_found(&w, 2));
        assert!(!check_found(&w, 1));
    });
}

/// Lookup of a stable entry while its predecessors are unlinked.
pub fn lookup_survives_unlink_of_predecessors() {
    model(|| {
        // 0 -> 1 -> 2 (stable); the writer removes 1 then 0 while the reader
        // may stand on either.
        let w = world(3, 3);
        let wr = Arc::clone(&w);
        let writer = thread::spawn(move || {
            for i in [1, 0] {
                let _g = wr.lock.lock().unwrap();
                assert!(chain::unlink(&*wr.nodes, &wr.head, i).is_some());
            }
        });
        let rd = Arc::clone(&w);
        let reader = thread::spawn(move || {
            assert!(check_found(&rd, 2), "stable entry missed");
        });
        writer.join().unwrap();
        reader.join().unwrap();
        assert!(check_found(&w, 2));
        assert!(!check_found(&w, 0));
    });
}

/// Two appending writers (serialised by the lock) and a reader.
pub fn two_writers_and_a_reader() {
    model(|| {
        // Two writers append under the lock; the reader must find the
        // stable head and either nothing or the complete new entries.
        let w = world(3, 1);
        let spawn = |i: u32| {
            let wr = Arc::clone(&w);
            thread::spawn(move || {
                let _g = wr.lock.lock().unwrap();
                init(&wr, i, u64::from(i) + 1);
                chain::append(&*wr.nodes, &wr.head, i, tag(i));
            })
        };
        let a = spawn(1);
        let b = spawn(2);
        let rd = Arc::clone(&w);
        let reader = thread::spawn(move || {
            assert!(check_found(&rd, 0));
            let _ = check_found(&rd, 1);
            let _ = check_found(&rd, 2);
            assert!(check_walk(&rd) >= 1);
        });
        a.join().unwrap();
        b.join().unwrap();
        reader.join().unwrap();
        assert!(check_found(&w, 1) && check_found(&w, 2));
    });
}
