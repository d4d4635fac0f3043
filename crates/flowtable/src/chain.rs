//! The chain protocol: singly linked lists of node indices hanging off one
//! `AtomicU32` bucket head.
//!
//! * Readers (`find`, `walk`) take no lock and write nothing: they load links
//!   with `Acquire`, which pairs with the writer's `Release` publication, so a
//!   node reached through a link is fully initialised.
//! * Writers hold the bucket's stripe lock. `append` initialises the node
//!   first, then publishes it with one `Release` store into the tail link;
//!   chains therefore stay ordered by insertion (and by cookie). `unlink`
//!   swings the predecessor's link past the node with one `Release` store and
//!   leaves the node's own `next` intact, so a reader standing on the removed
//!   node still reaches the rest of the chain. The node index is recycled only
//!   after an epoch grace period (caller's job), so no reader sees it reused.
//!
//! These functions are generic over [`Arena`] so that `src/loom_tests.rs`
//! model-checks exactly this code.

use crate::node::{Arena, NIL, Node, PackedKey};
use crate::sync::{AtomicU32, Ordering::Acquire, Ordering::Relaxed, Ordering::Release};

/// Lock-free lookup.
#[inline]
pub(crate) fn find<'a, A: Arena + ?Sized>(
    arena: &'a A,
    head: &AtomicU32,
    key: &PackedKey,
) -> Option<(u32, &'a Node)> {
    let mut i = head.load(Acquire);
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
pub(crate) fn scan<A: Arena + ?Sized>(arena: &A, head: &AtomicU32, key: &PackedKey) -> Scan {
    let mut len = 0;
    let mut i = head.load(Relaxed);
    while i != NIL {
        let n = arena.node(i);
        if n.matches(key) {
            return Scan::Found(i);
        }
        len += 1;
        i = n.next.load(Relaxed);
    }
    Scan::Absent(len)
}

/// Under the stripe lock: publishes initialised node `idx` at the tail.
pub(crate) fn append<A: Arena + ?Sized>(arena: &A, head: &AtomicU32, idx: u32) {
    let mut link = head;
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
    let mut link = head;
    let mut pos = 0;
    let mut found = false;
    loop {
        let i = link.load(Relaxed);
        if i == NIL {
            return found.then_some(pos);
        }
        let n = arena.node(i);
        if i == idx && !found {
            // The successor was published before (we hold the lock that
            // every writer of this chain held), Release passes that on.
            link.store(n.next.load(Relaxed), Release);
            found = true;
            pos += 1;
            // `link` unchanged: it now holds the successor.
            continue;
        }
        pos += 1;
        link = &n.next;
    }
}

/// Lock-free walk for dumps: calls `f(idx, node)` for every node reachable
/// from `head` whose cookie is in `(after, below)`; stops at the first
/// cookie `>= below` (chains are cookie-ordered, so nothing after it
/// qualifies) or when `f` returns `false`. Returns `false` iff `f` stopped it.
pub(crate) fn walk<A: Arena + ?Sized>(
    arena: &A,
    head: &AtomicU32,
    after: u64,
    below: u64,
    mut f: impl FnMut(u32, &Node) -> bool,
) -> bool {
    let mut i = head.load(Acquire);
    while i != NIL {
        let n = arena.node(i);
        let c = n.cookie();
        if c >= below {
            return true;
        }
        if c > after && !f(i, n) {
            return false;
        }
        i = n.next.load(Acquire);
    }
    true
}
