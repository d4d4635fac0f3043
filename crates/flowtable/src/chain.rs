//! The chain protocol: singly linked lists of node indices hanging off one
//! `AtomicU32` bucket head.
//!
//! A bucket head packs the index of the first node (26 bits) with a 6-bit
//! bloom filter of the chain's nodes (each node has a tag `< 6` derived from
//! its hash). A lookup whose tag bit is clear stops at the head without
//! touching a node: most misses (the first packet of every new flow) cost
//! one cache miss instead of one per chained node.
//!
//! * Readers (`find`, `walk`) take no lock and write nothing: they load the
//!   head and links with `Acquire`, pairing with the writers' `Release`
//!   stores, so a node reached through a link is fully initialised.
//! * Writers hold the bucket's stripe lock. `append` sets the node's bloom
//!   bit in the head, then publishes the initialised node with one `Release`
//!   store into the tail link; chains therefore stay in insertion (= cookie)
//!   order. `unlink` swings the predecessor's link past the node with one
//!   `Release` store and leaves the node's own `next` intact, so a reader
//!   standing on the removed node still reaches the rest of the chain; then
//!   it recomputes the bloom bits from the remaining nodes. A bloom filter is
//!   only ever a superset of the chain's tags while a reader could rely on
//!   it. The node index is recycled only after an epoch grace period
//!   (caller's job), so no reader sees it reused.
//!
//! These functions are generic over [`Arena`] so that `src/loom_checks.rs`
//! model-checks exactly this code.

use crate::node::{Arena, IDX_BITS, NIL, Node, PackedKey};
use crate::sync::{AtomicU32, Ordering::Acquire, Ordering::Relaxed, Ordering::Release};

/// An empty bucket head.
pub(crate) const EMPTY: u32 = NIL;

#[inline]
fn first(head: u32) -> u32 {
    head & NIL
}

#[inline]
fn bit(tag: u32) -> u32 {
    1 << (IDX_BITS + tag)
}

/// Lock-free lookup.
#[inline]
pub(crate) fn find<'a, A: Arena + ?Sized>(
    arena: &'a A,
    head: &AtomicU32,
    key: &PackedKey,
    tag: u32,
) -> Option<(u32, &'a Node)> {
    let h = head.load(Acquire);
    if h & bit(tag) == 0 {
        return None;
    }
    let mut i = first(h);
    while i != NIL {
        let n = arena.node(i);
        if n.matches(key) {
            return Some((i, n));
        }
        i = n.next.load(Acquire);
    }
    None
}

/// Outcome of [`scan`].
pub(crate) enum Scan {
    /// The key is present at this index.
    Found(u32),
    /// Absent; the chain has this many entries.
    Absent(usize),
}

/// Under the stripe lock: duplicate check and chain length.
pub(crate) fn scan<A: Arena + ?Sized>(
    arena: &A,
    head: &AtomicU32,
    key: &PackedKey,
    tag: u32,
) -> Scan {
    let h = head.load(Relaxed);
    let check = h & bit(tag) != 0;
    let mut len = 0;
    let mut i = first(h);
    while i != NIL {
        let n = arena.node(i);
        if check && n.matches(key) {
            return Scan::Found(i);
        }
        len += 1;
        i = n.next.load(Relaxed);
    }
    Scan::Absent(len)
}

/// Under the stripe lock: publishes initialised node `idx` (bloom tag
/// `tag`) at the tail.
pub(crate) fn append<A: Arena + ?Sized>(arena: &A, head: &AtomicU32, idx: u32, tag: u32) {
    let h = head.load(Relaxed);
    if first(h) == NIL {
        head.store((h & !NIL) | bit(tag) | idx, Release);
        return;
    }
    if h & bit(tag) == 0 {
        head.store(h | bit(tag), Release);
    }
    let mut link = &arena.node(first(h)).next;
    loop {
        let i = link.load(Relaxed);
        if i == NIL {
            link.store(idx, Release);
            return;
        }
        link = &arena.node(i).next;
    }
}

/// Under the stripe lock: unlinks node `idx`; returns the chain length
/// before the unlink, or `None` if `idx` is not on this chain.
pub(crate) fn unlink<A: Arena + ?Sized>(arena: &A, head: &AtomicU32, idx: u32) -> Option<usize> {
    let h = head.load(Relaxed);
    let mut len = 0;
    let mut found = false;
    let mut bloom = 0;
    // The predecessor's link, `None` while it is the head.
    let mut prev: Option<&AtomicU32> = None;
    let mut i = first(h);
    while i != NIL {
        let n = arena.node(i);
        let next = n.next.load(Relaxed);
        len += 1;
        if i == idx {
            found = true;
            // The successor was published under the lock we hold; the
            // Release store passes that on to readers.
            match prev {
                None => head.store((h & !NIL) | next, Release),
                Some(l) => l.store(next, Release),
            }
        } else {
            bloom |= bit(n.tag());
            prev = Some(&n.next);
        }
        i = next;
    }
    if !found {
        return None;
    }
    // Drop the bloom bits no remaining node needs.
    let h = head.load(Relaxed);
    if h & !NIL != bloom {
        head.store(bloom | first(h), Release);
    }
    Some(len)
}

/// Prefetches the first node of a chain (dumps call it a few buckets ahead).
#[inline]
pub(crate) fn prefetch_first<A: Arena + ?Sized>(arena: &A, head: &AtomicU32) {
    let i = first(head.load(Relaxed));
    if i != NIL {
        arena.node(i).prefetch();
    }
}

/// Lock-free walk for dumps: calls `f(node)` for every node reachable from
/// `head` whose cookie is in `(after, below)`; stops at the first cookie
/// `>= below` (chains are cookie-ordered, so nothing after it qualifies) or
/// when `f` returns `false`. Returns `false` iff `f` stopped it.
pub(crate) fn walk<A: Arena + ?Sized>(
    arena: &A,
    head: &AtomicU32,
    after: u64,
    below: u64,
    mut f: impl FnMut(&Node) -> bool,
) -> bool {
    let mut i = first(head.load(Acquire));
    while i != NIL {
        let n = arena.node(i);
        let c = n.cookie();
        if c >= below {
            return true;
        }
        if c > after && !f(n) {
            return false;
        }
        i = n.next.load(Acquire);
    }
    true
}
