//! Owner slots: how the flow table reaches the task that holds a proxied
//! connection's sockets.
//!
//! A connection or UDP session *is* its flow-table entry; the only other
//! thing it has is a task holding its sockets. Every entry of a proxied
//! flow names its task by an owner token ([`weir_flowtable::FlowInit::owner`]),
//! an index into this slab. Whoever ends a flow from outside — the expiry
//! wheel, a kill by cookie or filter, a tenant's or service's deletion, the
//! daemon stopping — finds the token in the entry (a dump or expiry
//! snapshot) and calls [`Owners::kill`] with the entry's cookie; the task
//! wakes from [`Owner::closed`], closes its sockets and removes its entry.
//!
//! Only the slot's task waits on it, so the slot keeps one waker
//! (`AtomicWaker`: two compare-and-swaps to register, no clone when the
//! task polls again with the same waker) rather than a `Notify`, whose
//! waiter list took a lock on every poll of the connection's task and
//! another when the wait was dropped: the `Notify` cost ~850 instructions per
//! proxied connection, the waker ~400 (docs/BENCHMARKS.md, "The connect
//! timer and the clock").
//!
//! A slot's state is one word, `(cookie + 1) << 8 | reason`, changed only by
//! compare-and-swap, so a kill names exactly one flow: a kill for a flow that
//! ended (its slot free or taken by a later flow with another cookie) finds
//! another word and does nothing. Cookies come from the flow table and stay
//! below 2^56 (a table hands out far fewer in its life).

use std::sync::atomic::{
    AtomicU32, AtomicU64, Ordering::AcqRel, Ordering::Acquire, Ordering::Release,
};
use std::sync::{Arc, OnceLock};
use std::task::Poll;

use atomic_waker::AtomicWaker;
use parking_lot::Mutex;
use weir_flowtable::ChunkGeometry;

/// Why an owner was told to close (the access log's `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Close {
    Killed = 1,
    IdleTimeout,
    BackendDown,
    BackendRemoved,
    Drained,
    ServiceDeleted,
    TenantDeleted,
    Replaced,
    /// A packet flow or UDP session that never got going, ended to make
    /// room for a new one at a limit.
    EarlyDrop,
}

impl Close {
    const ALL: [Close; 9] = [
        Close::Killed,
        Close::IdleTimeout,
        Close::BackendDown,
        Close::BackendRemoved,
        Close::Drained,
        Close::ServiceDeleted,
        Close::TenantDeleted,
        Close::Replaced,
        Close::EarlyDrop,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Close::Killed => "killed",
            Close::IdleTimeout => "idle_timeout",
            Close::BackendDown => "backend_down",
            Close::BackendRemoved => "backend_removed",
            Close::Drained => "drained",
            Close::ServiceDeleted => "service_deleted",
            Close::TenantDeleted => "tenant_deleted",
            Close::Replaced => "replaced",
            Close::EarlyDrop => "early_drop",
        }
    }

    fn from_code(c: u8) -> Option<Close> {
        Close::ALL.get(usize::from(c).checked_sub(1)?).copied()
    }
}

/// Chunks grow geometrically (512, 512, 1 Ki, 2 Ki ... 32 Ki slots), then
/// hold 64 Ki slots each: an idle daemon holds none, a small one a few
/// KiB, and at most half of what is allocated is unused.
const GEOMETRY: ChunkGeometry = ChunkGeometry::new(512);
/// At most 16 Mi owned flows at once: each holds at least one descriptor,
/// far below any open-files limit's reach.
const MAX_SLOTS: u32 = 1 << 24;
const CHUNKS: usize = GEOMETRY.chunks(MAX_SLOTS);

/// (chunk, offset, chunk length) of slot `i`.
fn locate(i: u32) -> (usize, usize, usize) {
    GEOMETRY.locate(i)
}

/// A slot claimed by a task that has no entry yet (between claim and bind,
/// and between one attempt's entry and the next).
const UNBOUND: u64 = u64::MAX;
/// A free slot.
const FREE: u64 = 0;
const REASON: u64 = 0xFF;

#[derive(Debug, Default)]
struct Slot {
    state: AtomicU64,
    /// The owning task's, while it waits in [`Owner::closed`].
    waker: AtomicWaker,
}

/// The slot word naming flow `cookie`; `None` for a cookie no flow can have
/// (2^56 - 1 and above: a caller, e.g. `weir kill`, may pass any number).
fn word(cookie: u64) -> Option<u64> {
    cookie
        .checked_add(1)
        .filter(|&c| c < 1 << 56)
        .map(|c| c << 8)
}

/// The slab of owner slots (one per live proxied flow).
#[derive(Debug)]
pub(crate) struct Owners {
    dir: Box<[OnceLock<Box<[Slot]>>]>,
    next: AtomicU32,
    /// Freed slots, one list per worker: a task claims and frees on its own
    /// worker thread, so its list's lock is never contended.
    free: Box<[Mutex<Vec<u32>>]>,
    /// Flows told to close for an early drop ([`Close::EarlyDrop`]) whose
    /// owners have not let go of their slots yet: [`Self::early_drops_closing`].
    early_closing: AtomicU64,
}

impl Owners {
    pub(crate) fn new(workers: usize) -> Self {
        Owners {
            dir: (0..CHUNKS).map(|_| OnceLock::new()).collect(),
            next: AtomicU32::new(0),
            free: (0..workers.max(1)).map(|_| Mutex::default()).collect(),
            early_closing: AtomicU64::new(0),
        }
    }

    /// Flows told to close for an early drop whose owners still hold them:
    /// descriptors on their way back. An owner lets go of its slot after
    /// its sockets (the UDP session task drops its socket first), so once
    /// this reads 0 every such flow's descriptors are closed. A session
    /// is ended on one worker and closes on its own, maybe another: until
    /// then a refused datagram must not end one more for the descriptor
    /// already coming (`udp::free_a_descriptor`).
    pub(crate) fn early_drops_closing(&self) -> u64 {
        self.early_closing.load(Acquire)
    }

    /// A slot's word `w` was replaced (its owner bound another flow, let
    /// go of its flow or of the slot): if it told a flow to close for an
    /// early drop, that flow's owner no longer holds it.
    fn replaced(&self, w: u64) {
        if w != UNBOUND && w & REASON == Close::EarlyDrop as u64 {
            self.early_closing.fetch_sub(1, AcqRel);
        }
    }

    fn slot(&self, i: u32) -> Option<&Slot> {
        if i >= MAX_SLOTS {
            return None;
        }
        let (c, off, _) = locate(i);
        self.dir.get(c)?.get()?.get(off)
    }

    /// A slot for a new flow on this worker (`None` when all 16 Mi are
    /// taken). Its token (index + 1) goes into the flow's entry.
    pub(crate) fn claim(self: &Arc<Self>) -> Option<Owner> {
        let list = super::stats::worker_index() % self.free.len();
        let i = match self.free[list].lock().pop() {
            Some(i) => i,
            None => {
                let i = self.next.fetch_add(1, AcqRel);
                if i >= MAX_SLOTS {
                    self.next.store(MAX_SLOTS, Release);
                    return None;
                }
                let (c, _, len) = locate(i);
                self.dir[c].get_or_init(|| (0..len).map(|_| Slot::default()).collect());
                i
            }
        };
        self.slot(i)?.state.store(UNBOUND, Release);
        Some(Owner {
            owners: Arc::clone(self),
            index: i,
            list,
        })
    }

    /// Tell the owner `token` to close the flow `cookie`; `false` if that
    /// flow no longer has that owner (it ended) or was told already. A
    /// flow whose task has not bound the cookie yet is told as soon as it
    /// does.
    pub(crate) fn kill(&self, token: u32, cookie: u64, why: Close) -> bool {
        let Some(slot) = token.checked_sub(1).and_then(|i| self.slot(i)) else {
            return false;
        };
        let Some(open) = word(cookie) else {
            return false;
        };
        let told = open | why as u64;
        // Counted before the owner can see the word (it may let go at once,
        // on another thread), taken back if it was not told.
        let early = why == Close::EarlyDrop;
        if early {
            self.early_closing.fetch_add(1, AcqRel);
        }
        let mut cur = slot.state.load(Acquire);
        loop {
            // Not yet bound: leave the word for `bind` to find; any other
            // cookie, or a reason already there: nothing to do.
            if cur != open && cur != UNBOUND {
                if early {
                    self.early_closing.fetch_sub(1, AcqRel);
                }
                return false;
            }
            match slot.state.compare_exchange_weak(cur, told, AcqRel, Acquire) {
                Ok(_) => {
                    slot.waker.wake();
                    return true;
                }
                Err(now) => cur = now,
            }
        }
    }

    /// Tell every owner to close (the daemon is stopping); returns how many
    /// were told.
    pub(crate) fn kill_all(&self, why: Close) -> u64 {
        let mut n = 0;
        let end = self.next.load(Acquire).min(MAX_SLOTS);
        for i in 0..end {
            let Some(slot) = self.slot(i) else { continue };
            let cur = slot.state.load(Acquire);
            if cur == FREE || cur == UNBOUND || cur & REASON != 0 {
                continue;
            }
            if self.kill(i + 1, (cur >> 8) - 1, why) {
                n += 1;
            }
        }
        n
    }

    /// The owner token of the live flow `cookie`, if a task owns it
    /// (O(owned flows); the daemon reaches a flow from its cookie through
    /// the table instead: `Shared::kill_cookie`).
    #[cfg(test)]
    pub(crate) fn find(&self, cookie: u64) -> Option<u32> {
        let w = word(cookie)?;
        let end = self.next.load(Acquire).min(MAX_SLOTS);
        (0..end)
            .find(|&i| {
                self.slot(i)
                    .is_some_and(|s| s.state.load(Acquire) & !REASON == w)
            })
            .map(|i| i + 1)
    }
}

/// A claimed slot, held by the task that owns a flow; freed on drop. The
/// task drops it after the flow's sockets, so that a flow told to close
/// for an early drop counts as closing ([`Owners::early_drops_closing`])
/// until its descriptors are back.
#[derive(Debug)]
pub(crate) struct Owner {
    owners: Arc<Owners>,
    index: u32,
    /// The free list it goes back to (its worker's).
    list: usize,
}

impl Owner {
    fn slot(&self) -> &Slot {
        self.owners
            .slot(self.index)
            .expect("a claimed slot's chunk exists")
    }

    /// The token to put in the flow's entry.
    pub(crate) fn token(&self) -> u32 {
        self.index + 1
    }

    /// The entry `cookie` now names this owner. `Err` with the reason if it
    /// was told to close before this (then the flow should close at once).
    pub(crate) fn bind(&self, cookie: u64) -> Result<(), Close> {
        // The table hands out cookies in order from 1: 2^56 of them would
        // take centuries. Such a flow could not be told by cookie; it keeps
        // its slot unbound (closed with the daemon only).
        let Some(w) = word(cookie) else {
            debug_assert!(false, "cookie {cookie} beyond 2^56");
            return Ok(());
        };
        let state = &self.slot().state;
        let mut cur = UNBOUND;
        loop {
            if cur != UNBOUND && cur & !REASON == w {
                return Err(Close::from_code((cur & REASON) as u8).unwrap_or(Close::Killed));
            }
            // UNBOUND, or a kill meant for its previous flow (a retry's):
            // not this one's.
            match state.compare_exchange(cur, w, AcqRel, Acquire) {
                Ok(was) => {
                    self.owners.replaced(was);
                    return Ok(());
                }
                Err(now) => cur = now,
            }
        }
    }

    /// The flow ended (its task removed the entry): the slot waits for the
    /// next [`bind`](Self::bind) (a retry to another backend).
    pub(crate) fn unbind(&self) {
        let was = self.slot().state.swap(UNBOUND, AcqRel);
        self.owners.replaced(was);
    }

    /// Why the bound flow was told to close, if it was.
    pub(crate) fn told(&self) -> Option<Close> {
        let cur = self.slot().state.load(Acquire);
        if cur == UNBOUND {
            return None;
        }
        Close::from_code((cur & REASON) as u8)
    }

    /// Resolves once the flow is told to close. One wait at a time per
    /// owner (the slot keeps one waker: a second wait polled meanwhile
    /// would take the wake-up from the first).
    pub(crate) async fn closed(&self) -> Close {
        std::future::poll_fn(|cx| {
            if let Some(why) = self.told() {
                return Poll::Ready(why);
            }
            self.slot().waker.register(cx.waker());
            // A kill between the check above and the registration woke
            // the waker before this one: look again. A wake-up meant for
            // the slot's previous flow only costs one more check.
            match self.told() {
                Some(why) => Poll::Ready(why),
                None => Poll::Pending,
            }
        })
        .await
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        // A waker holds its task: the slot must not keep an ended task's
        // memory until the slot's next flow.
        drop(self.slot().waker.take());
        let was = self.slot().state.swap(FREE, AcqRel);
        self.owners.replaced(was);
        self.owners.free[self.list].lock().push(self.index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kill_names_one_flow_only() {
        let o = Arc::new(Owners::new(1));
        let a = o.claim().unwrap();
        let t = a.token();
        a.bind(10).unwrap();
        assert_eq!(a.told(), None);
        // Another cookie: not this flow.
        assert!(!o.kill(t, 11, Close::Killed));
        assert!(!o.kill(t + 5, 10, Close::Killed));
        assert!(!o.kill(0, 10, Close::Killed));
        assert_eq!(a.told(), None);
        assert!(o.kill(t, 10, Close::IdleTimeout));
        // Told once; the first reason stays.
        assert!(!o.kill(t, 10, Close::Killed));
        assert_eq!(a.told(), Some(Close::IdleTimeout));
        // The next attempt's flow starts untold.
        a.unbind();
        a.bind(12).unwrap();
        assert_eq!(a.told(), None);
        drop(a);
        // Freed and taken again: the old cookie reaches nothing.
        let b = o.claim().unwrap();
        assert_eq!(b.token(), t);
        b.bind(20).unwrap();
        assert!(!o.kill(t, 12, Close::Killed));
        assert_eq!(b.told(), None);
        assert_eq!(o.find(20), Some(t));
        assert_eq!(o.find(12), None);
        // Any number a caller passes is safe (the admin API's fuzzer found
        // `weir kill 18446744073709551615` overflowing here).
        for c in [u64::MAX, u64::MAX - 1, (1 << 56) - 1, 1 << 56] {
            assert!(!o.kill(t, c, Close::Killed));
            assert_eq!(o.find(c), None);
        }
        assert_eq!(b.told(), None);
    }

    #[test]
    fn a_kill_before_bind_is_kept_for_that_cookie_only() {
        let o = Arc::new(Owners::new(1));
        let a = o.claim().unwrap();
        assert!(o.kill(a.token(), 7, Close::ServiceDeleted));
        assert_eq!(a.bind(7), Err(Close::ServiceDeleted));
        let b = o.claim().unwrap();
        assert!(o.kill(b.token(), 8, Close::Killed));
        // A kill meant for another flow does not stick to this one.
        assert_eq!(b.bind(9), Ok(()));
        assert_eq!(b.told(), None);
    }

    /// An early drop counts as closing from its kill until its owner lets
    /// go: of the slot, or of the told word by binding another flow or
    /// unbinding; a kill that tells nobody, or for another reason, is not
    /// counted.
    #[test]
    fn an_early_drop_is_closing_until_its_owner_lets_go() {
        let o = Arc::new(Owners::new(1));
        let a = o.claim().unwrap();
        a.bind(1).unwrap();
        assert!(o.kill(a.token(), 1, Close::EarlyDrop));
        assert_eq!(o.early_drops_closing(), 1);
        // Told already; another flow's cookie.
        assert!(!o.kill(a.token(), 1, Close::EarlyDrop));
        assert!(!o.kill(a.token(), 2, Close::EarlyDrop));
        assert_eq!(o.early_drops_closing(), 1);
        drop(a);
        assert_eq!(o.early_drops_closing(), 0);
        // A kill for a freed slot tells nobody.
        assert!(!o.kill(1, 1, Close::EarlyDrop));
        assert_eq!(o.early_drops_closing(), 0);

        // Told before its bind, for a flow it then does not bind (a
        // retry's): let go of when the word is replaced.
        let b = o.claim().unwrap();
        assert!(o.kill(b.token(), 7, Close::EarlyDrop));
        assert_eq!(o.early_drops_closing(), 1);
        b.bind(8).unwrap();
        assert_eq!(o.early_drops_closing(), 0);
        // Unbound after it was told.
        assert!(o.kill(b.token(), 8, Close::EarlyDrop));
        assert_eq!(o.early_drops_closing(), 1);
        b.unbind();
        assert_eq!(o.early_drops_closing(), 0);
        // Other reasons are not counted, nor let go of.
        b.bind(9).unwrap();
        assert!(o.kill(b.token(), 9, Close::IdleTimeout));
        assert_eq!(o.early_drops_closing(), 0);
        drop(b);
        assert_eq!(o.early_drops_closing(), 0);
    }

    #[test]
    fn kill_all_tells_every_bound_owner() {
        let o = Arc::new(Owners::new(2));
        let held: Vec<_> = (0..10u64)
            .map(|c| {
                let s = o.claim().unwrap();
                s.bind(c).unwrap();
                s
            })
            .collect();
        let unbound = o.claim().unwrap();
        assert_eq!(o.kill_all(Close::Killed), 10);
        assert!(held.iter().all(|s| s.told() == Some(Close::Killed)));
        assert_eq!(unbound.told(), None);
        assert_eq!(o.kill_all(Close::Killed), 0);
    }

    /// The owner slab's geometry, as its documentation gives it: 512, 512,
    /// 1 Ki ... 32 Ki slots, then 64 Ki each, in 263 chunks for 16 Mi
    /// slots.
    #[test]
    fn slots_are_where_the_geometry_says() {
        assert_eq!(locate(0), (0, 0, 512));
        assert_eq!(locate(511), (0, 511, 512));
        assert_eq!(locate(512), (1, 0, 512));
        assert_eq!(locate(1024), (2, 0, 1024));
        assert_eq!(locate((1 << 16) - 1), (7, (1 << 15) - 1, 1 << 15));
        assert_eq!(locate(1 << 16), (8, 0, 1 << 16));
        assert_eq!(locate(MAX_SLOTS - 1), (262, (1 << 16) - 1, 1 << 16));
        assert_eq!(CHUNKS, 263);
    }

    #[test]
    fn slots_are_contiguous_across_chunks() {
        // Claims past the first chunks land in fresh ones and work.
        let o = Arc::new(Owners::new(1));
        let held: Vec<_> = (0..2000u64)
            .map(|c| {
                let s = o.claim().unwrap();
                s.bind(c).unwrap();
                s
            })
            .collect();
        assert!(o.kill(held[1999].token(), 1999, Close::Killed));
        assert_eq!(held[1999].told(), Some(Close::Killed));
        assert_eq!(o.find(1500), Some(held[1500].token()));
    }

    /// The slot keeps the waiting task's waker, which holds the task:
    /// it is woken by a kill, and let go when the owner is dropped (an
    /// ended connection's task must not live on in its slot).
    #[test]
    fn the_slot_wakes_its_waiter_and_lets_it_go() {
        use std::sync::atomic::AtomicUsize;
        use std::task::{Context, Wake, Waker};

        #[derive(Default)]
        struct Count(AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, AcqRel);
            }
        }

        let o = Arc::new(Owners::new(1));
        let a = o.claim().unwrap();
        a.bind(5).unwrap();
        let count = Arc::new(Count::default());
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        {
            let mut wait = std::pin::pin!(a.closed());
            assert!(wait.as_mut().poll(&mut cx).is_pending());
            // Polled again with the same waker: still one copy kept.
            assert!(wait.as_mut().poll(&mut cx).is_pending());
            assert_eq!(Arc::strong_count(&count), 3, "ours, the Waker, the slot's");
            assert!(o.kill(a.token(), 5, Close::Killed));
            assert_eq!(count.0.load(Acquire), 1);
            assert_eq!(wait.as_mut().poll(&mut cx), Poll::Ready(Close::Killed));
        }
        // The next flow of the same owner waits again; dropping the owner
        // drops the waker it left.
        a.unbind();
        a.bind(6).unwrap();
        {
            let mut wait = std::pin::pin!(a.closed());
            assert!(wait.as_mut().poll(&mut cx).is_pending());
        }
        assert_eq!(Arc::strong_count(&count), 3);
        drop(a);
        assert_eq!(
            Arc::strong_count(&count),
            2,
            "the slot kept an ended task's waker"
        );
        // A kill for the dropped owner's flow wakes nobody.
        assert!(!o.kill(1, 6, Close::Killed));
        assert_eq!(count.0.load(Acquire), 1);
    }

    #[tokio::test]
    async fn closed_wakes_on_a_kill_from_another_thread() {
        let o = Arc::new(Owners::new(1));
        let a = o.claim().unwrap();
        a.bind(3).unwrap();
        let (t, o2) = (a.token(), o.clone());
        let killer = std::thread::spawn(move || o2.kill(t, 3, Close::Drained));
        assert_eq!(a.closed().await, Close::Drained);
        assert!(killer.join().unwrap());
    }
}
