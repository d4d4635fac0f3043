//! Entry layout and the node arena.
//!
//! Every entry is a fixed 112-byte [`Node`] (a 64-byte hot part a lookup
//! reads and a 48-byte cold part of clocks, counters and TCP sequence
//! numbers, in two arrays) made only of atomics, so a
//! lock-free reader may read any field while a writer changes others,
//! without a data race and without `unsafe`. The node *is* the flow: key,
//! service, backend, state, timers, counters each way, the owner's token and
//! the NAT mapping slot. A packet-mode entry may also be indexed under its
//! reply key ([`PackedReply`], computed from the node's own fields). Nodes
//! live in a [`Slab`] of never-freed chunks and
//! are named by `u32` index from the bucket index (`index.rs`); an index is
//! recycled only after an epoch grace period (see `table.rs`), so a reader
//! that found a node through the index under its pin never sees it change
//! identity under its feet. A reader holding a node index from elsewhere
//! (a handle, a dump's remembered bucket, read without the pin) names the
//! entry by its cookie and copies it with [`Node::snapshot_of`], which
//! tells a node reused meanwhile, even in the middle of the copy.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::sync::OnceLock;

use crate::chunks::ChunkGeometry;
use crate::raw::HugeArray;
use crate::sync::{
    AtomicU32, AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release, fence,
};
use crate::types::{
    BackendId, Cookie, FlowInit, FlowKey, FlowSnapshot, FlowState, Millis, Proto, ReplyDst,
    ReplyKey, ServiceId, TenantId,
};

/// Bits of a node index; the table holds at most `NIL` (2^28 - 1) entries.
pub(crate) const IDX_BITS: u32 = 28;
/// Never a valid node index.
pub(crate) const NIL: u32 = (1 << IDX_BITS) - 1;

// `meta` word layout.
pub(crate) const LIVE: u32 = 1;
const UDP: u32 = 1 << 1;
const C6: u32 = 1 << 2;
const V6: u32 = 1 << 3;
const KEY_BITS: u32 = UDP | C6 | V6;
const STATE_SHIFT: u32 = 4;
const STATE_MASK: u32 = 0xF << STATE_SHIFT;
const SLOT_SHIFT: u32 = 8;
/// Wheel slot numbers (0..=1024) must fit in 11 bits; this value means "not
/// filed".
pub(crate) const UNFILED: u32 = 0x7FF;
/// The entry is also indexed under its reply key (packet mode's nat and
/// fnat); the key follows from the node's tenant, protocol, backend and
/// client or NAT slot, which never change while it is live.
const REPLY: u32 = 1 << 19;
/// The timeout profile, in the top 12 bits.
const PROFILE_SHIFT: u32 = 20;
const _: () = assert!(REPLY > UNFILED << SLOT_SHIFT && REPLY < 1 << PROFILE_SHIFT);
/// Hashed with a reply key so that reply keys and forward keys (which never
/// have it) hash apart.
const REPLY_HASH: u32 = 1 << 8;
const _: () = assert!(crate::types::MAX_PROFILES == 1 << (32 - PROFILE_SHIFT));

/// A key packed the way nodes store it: compared and hashed as words.
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default)]
pub(crate) struct PackedKey {
    pub(crate) tenant: u32,
    pub(crate) bits: u32,
    pub(crate) ports: u32,
    pub(crate) caddr: [u64; 2],
    pub(crate) vaddr: [u64; 2],
}

fn pack_ip(ip: IpAddr) -> ([u64; 2], bool) {
    match ip {
        IpAddr::V4(a) => ([0, u64::from(u32::from(a))], false),
        IpAddr::V6(a) => {
            let v = u128::from(a);
            ([(v >> 64) as u64, v as u64], true)
        }
    }
}

fn unpack_ip(w: [u64; 2], v6: bool, port: u16) -> SocketAddr {
    if v6 {
        let v = (u128::from(w[0]) << 64) | u128::from(w[1]);
        SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(v), port, 0, 0))
    } else {
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(w[1] as u32), port))
    }
}

impl PackedKey {
    pub(crate) fn new(k: &FlowKey) -> PackedKey {
        let (caddr, c6) = pack_ip(k.client.ip());
        let (vaddr, v6) = pack_ip(k.virt.ip());
        let mut bits = 0;
        if k.proto == Proto::Udp {
            bits |= UDP;
        }
        if c6 {
            bits |= C6;
        }
        if v6 {
            bits |= V6;
        }
        PackedKey {
            tenant: k.tenant.0,
            bits,
            ports: (u32::from(k.client.port()) << 16) | u32::from(k.virt.port()),
            caddr,
            vaddr,
        }
    }

    pub(crate) fn unpack(&self) -> FlowKey {
        FlowKey {
            tenant: TenantId(self.tenant),
            proto: if self.bits & UDP != 0 {
                Proto::Udp
            } else {
                Proto::Tcp
            },
            client: unpack_ip(self.caddr, self.bits & C6 != 0, (self.ports >> 16) as u16),
            virt: unpack_ip(self.vaddr, self.bits & V6 != 0, self.ports as u16),
        }
    }
}

/// A reply key packed for matching against nodes: what a reply packet of a
/// packet-mode flow carries, as the caller maps it ([`ReplyKey`]).
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default)]
pub(crate) struct PackedReply {
    pub(crate) tenant: u32,
    /// `UDP`, and `C6` for a client destination.
    pub(crate) bits: u32,
    pub(crate) backend: u32,
    /// The NAT slot (fnat), or 0 for a client destination (nat).
    pub(crate) nat: u32,
    /// Client port (nat); 0 for fnat.
    pub(crate) port: u32,
    /// Client address (nat); zeros for fnat.
    pub(crate) caddr: [u64; 2],
}

impl PackedReply {
    pub(crate) fn new(k: &ReplyKey) -> PackedReply {
        let mut r = PackedReply {
            tenant: k.tenant.0,
            bits: if k.proto == Proto::Udp { UDP } else { 0 },
            backend: k.backend.0,
            ..PackedReply::default()
        };
        match k.dst {
            ReplyDst::Client(c) => {
                let (a, v6) = pack_ip(c.ip());
                r.caddr = a;
                r.port = u32::from(c.port());
                if v6 {
                    r.bits |= C6;
                }
            }
            ReplyDst::Nat(n) => r.nat = n.get(),
        }
        r
    }

    /// The words the table's keyed hash takes (`Table::hash`).
    pub(crate) fn hash_key(&self) -> PackedKey {
        PackedKey {
            tenant: self.tenant,
            bits: self.bits | REPLY_HASH,
            ports: self.port,
            caddr: self.caddr,
            vaddr: [u64::from(self.backend), u64::from(self.nat)],
        }
    }
}

/// The part of an entry a lookup reads: key, cookie, NAT slot, service and
/// backend, exactly one cache line (the hot array is 64-byte aligned), so a
/// lookup that finds its entry touches one line of it.
#[repr(C, align(64))]
#[derive(Debug, Default)]
pub(crate) struct Hot {
    pub(crate) meta: AtomicU32,
    tenant: AtomicU32,
    ports: AtomicU32,
    /// Packet mode's NAT mapping slot (full-NAT: local address index << 16
    /// | local port); 0 = none. Here, not with the counters, because an
    /// fnat reply lookup compares it.
    nat: AtomicU32,
    caddr: [AtomicU64; 2],
    vaddr: [AtomicU64; 2],
    /// The node's use count: with the node's index it makes the entry's
    /// cookie (see `table::next_cookie`), so the cookie costs 4 bytes.
    uses: AtomicU32,
    /// Opaque token of whoever owns the flow (a proxy connection's task);
    /// expiry and kills hand it back so the owner can be told to close.
    /// (The UDP proxy reads it with `touch_hit`.)
    owner: AtomicU32,
    service: AtomicU32,
    backend: AtomicU32,
}

/// The part the data path writes (clocks and counters) and listings read.
#[repr(C)]
#[derive(Debug, Default)]
pub(crate) struct Cold {
    /// The low 32 bits of the last activity's time in ms; [`widen`] gives
    /// back the full time from any time near it (as conntrack keeps its
    /// timeout in 32-bit jiffies).
    last_active: AtomicU32,
    /// Insert time in whole seconds of the caller's clock.
    created_s: AtomicU32,
    /// Bytes in, bytes out. A persistence template (state `Persist`)
    /// carries no traffic, so its bytes-out word is free: there it counts
    /// the connections holding the template (IPVS's `n_control`, see
    /// [`Node::hold_locked`]), at no extra memory per entry. `touch` never
    /// adds bytes out to a template, so the word holds only holds there.
    /// Packet mode's TCP sequence tracking, in and out: the sequence
    /// number just past the last segment noted in that direction (0: none
    /// yet). What a RST is checked against (see `weir_packet::tcp_state`).
    seq: [AtomicU32; 2],
    bytes: [AtomicU64; 2],
    packets: [AtomicU64; 2],
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Hot>() == 64 && std::mem::size_of::<Cold>() == 48);

/// How far (ms) a stored activity time may be *ahead* of the time it is
/// widened against: threads touch with their own `now`, and listings widen
/// against the table's latest clock. 2^30 ms is 12.4 days.
const AHEAD: u64 = 1 << 30;

/// The longest idle time the 32-bit activity clock can represent: a
/// stored time is read back exactly while it lies in
/// `(near + AHEAD - 2^32, near + AHEAD]`, i.e. up to ~37.3 days before the
/// time it is widened against. Timeouts are capped below it
/// ([`crate::types::MAX_TIMEOUT_MS`]), and expiry runs long before an entry
/// gets that idle, so a live entry's time is always read back exactly.
pub(crate) const MAX_IDLE_MS: u64 = (1 << 32) - AHEAD;
// A day of slack for expiry running late.
const _: () = assert!(crate::types::MAX_TIMEOUT_MS + 86_400_000 < MAX_IDLE_MS);

/// The full time (ms) whose low 32 bits are `stored`, taken in the window
/// `(near + AHEAD - 2^32, near + AHEAD]`.
#[inline]
pub(crate) fn widen(stored: u32, near: u64) -> u64 {
    let top = near.saturating_add(AHEAD);
    let back = (top as u32).wrapping_sub(stored);
    top.saturating_sub(u64::from(back))
}

/// One entry: 112 bytes made only of atomics, so a lock-free reader may read
/// any field while a writer changes others, without a data race and without
/// `unsafe`. Its two parts live in two arrays at the same index (see
/// [`Slab`]); this is a view of both.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Node<'a> {
    h: &'a Hot,
    c: &'a Cold,
    /// The node's index (part of its cookie).
    idx: u32,
}

impl Node<'_> {
    /// Writes a fresh entry. Only for a node no lookup can reach (just
    /// allocated); the writer then publishes it with a Release store.
    /// Readers still holding the node's index from an earlier entry (a
    /// handle, a dump) name that entry by its cookie and check it (see
    /// below).
    /// `reply`: the entry gets a reply index entry; it then starts *pending*
    /// (not live, so no lookup returns it) until both its index entries are
    /// in and [`set_live`](Self::set_live) publishes it.
    pub(crate) fn init(
        &self,
        k: &PackedKey,
        init: &FlowInit,
        cookie: u64,
        now: Millis,
        nat: u32,
        reply: bool,
    ) {
        debug_assert_eq!(crate::table::cookie_idx(cookie), self.idx);
        // The use count first, then the fence, then every other field: a
        // reader copying the previous entry by its cookie
        // ([`snapshot_of`](Self::snapshot_of), a seqlock with the use count
        // as its sequence) that reads any field written below reads this
        // count, not the previous entry's, when it checks again after its
        // Acquire fence, and drops the copy.
        self.h.uses.store((cookie >> IDX_BITS) as u32, Relaxed);
        fence(Release);
        self.h.tenant.store(k.tenant, Relaxed);
        self.h.ports.store(k.ports, Relaxed);
        self.h.owner.store(init.owner, Relaxed);
        self.h.caddr[0].store(k.caddr[0], Relaxed);
        self.h.caddr[1].store(k.caddr[1], Relaxed);
        self.h.vaddr[0].store(k.vaddr[0], Relaxed);
        self.h.vaddr[1].store(k.vaddr[1], Relaxed);
        self.c.last_active.store(now.0 as u32, Relaxed);
        self.c
            .created_s
            .store(u32::try_from(now.0 / 1000).unwrap_or(u32::MAX), Relaxed);
        self.h.nat.store(nat, Relaxed);
        for c in self.c.bytes.iter().chain(self.c.packets.iter()) {
            c.store(0, Relaxed);
        }
        for c in &self.c.seq {
            c.store(0, Relaxed);
        }
        self.h.service.store(init.service.0, Relaxed);
        self.h.backend.store(init.backend.0, Relaxed);
        let (live, reply) = if reply { (0, REPLY) } else { (LIVE, 0) };
        // Release: a reader that sees this entry's live bit without going
        // through the bucket index (a handle, a dump resuming from node
        // indices it read earlier: [`is_live`](Self::is_live) is Acquire)
        // sees every field above, its cookie included, not the previous
        // entry's. Later writes of `meta` are read-modify-writes, which
        // continue this release sequence.
        self.h.meta.store(
            live | reply
                | k.bits
                | (init.state.code() << STATE_SHIFT)
                | (UNFILED << SLOT_SHIFT)
                | ((u32::from(init.profile.number()) & 0xFFF) << PROFILE_SHIFT),
            Release,
        );
    }

    /// Prefetches the line a lookup reads.
    #[inline]
    pub(crate) fn prefetch(&self) {
        crate::raw::prefetch(self.h);
    }

    /// Prefetches everything a snapshot reads: the hot line and the cold
    /// part (48 bytes at a 48-byte stride, so up to two lines).
    #[inline]
    pub(crate) fn prefetch_all(&self) {
        crate::raw::prefetch(self.h);
        crate::raw::prefetch(self.c);
        crate::raw::prefetch(&self.c.packets[1]);
    }

    /// Full key compare, cheapest-to-differ words first.
    #[inline]
    pub(crate) fn matches(&self, k: &PackedKey) -> bool {
        self.h.ports.load(Relaxed) == k.ports
            && self.h.caddr[1].load(Relaxed) == k.caddr[1]
            && self.h.tenant.load(Relaxed) == k.tenant
            && self.h.vaddr[1].load(Relaxed) == k.vaddr[1]
            && self.h.caddr[0].load(Relaxed) == k.caddr[0]
            && self.h.vaddr[0].load(Relaxed) == k.vaddr[0]
            && self.h.meta.load(Relaxed) & KEY_BITS == k.bits
    }

    /// Whether this entry's reply key is `r` (live or not: the caller
    /// checks).
    #[inline]
    pub(crate) fn matches_reply(&self, r: &PackedReply) -> bool {
        let m = self.h.meta.load(Relaxed);
        if m & REPLY == 0
            || self.h.nat.load(Relaxed) != r.nat
            || self.h.backend.load(Relaxed) != r.backend
            || self.h.tenant.load(Relaxed) != r.tenant
            || m & UDP != r.bits & UDP
        {
            return false;
        }
        r.nat != 0
            || (self.h.ports.load(Relaxed) >> 16 == r.port
                && self.h.caddr[1].load(Relaxed) == r.caddr[1]
                && self.h.caddr[0].load(Relaxed) == r.caddr[0]
                && m & C6 == r.bits & C6)
    }

    /// Whether the entry has a reply index entry.
    #[inline]
    pub(crate) fn has_reply(&self) -> bool {
        self.h.meta.load(Relaxed) & REPLY != 0
    }

    /// The reply key of an entry that has one ([`has_reply`](Self::has_reply)):
    /// from its own fields, so insert, remove and resize always agree.
    pub(crate) fn reply_key(&self) -> PackedReply {
        let m = self.h.meta.load(Relaxed);
        let nat = self.h.nat.load(Relaxed);
        let mut r = PackedReply {
            tenant: self.h.tenant.load(Relaxed),
            bits: m & UDP,
            backend: self.h.backend.load(Relaxed),
            nat,
            ..PackedReply::default()
        };
        if nat == 0 {
            r.bits |= m & C6;
            r.port = self.h.ports.load(Relaxed) >> 16;
            r.caddr = [self.h.caddr[0].load(Relaxed), self.h.caddr[1].load(Relaxed)];
        }
        r
    }

    /// Publishes a pending entry (see [`init`](Self::init)) once both its
    /// index entries are in: from now on lookups return it.
    pub(crate) fn set_live(&self) {
        self.h.meta.fetch_or(LIVE, Release);
    }

    pub(crate) fn key(&self) -> PackedKey {
        PackedKey {
            tenant: self.h.tenant.load(Relaxed),
            bits: self.h.meta.load(Relaxed) & KEY_BITS,
            ports: self.h.ports.load(Relaxed),
            caddr: [self.h.caddr[0].load(Relaxed), self.h.caddr[1].load(Relaxed)],
            vaddr: [self.h.vaddr[0].load(Relaxed), self.h.vaddr[1].load(Relaxed)],
        }
    }

    pub(crate) fn tenant(&self) -> u32 {
        self.h.tenant.load(Relaxed)
    }

    pub(crate) fn cookie(&self) -> u64 {
        u64::from(self.h.uses.load(Relaxed)) << IDX_BITS | u64::from(self.idx)
    }

    /// Acquire, pairing with [`init`](Self::init)'s Release: once the live
    /// bit of a node's new entry is seen, so are its fields and cookie.
    pub(crate) fn is_live(&self) -> bool {
        self.h.meta.load(Acquire) & LIVE != 0
    }

    /// Whether the node holds the live entry `cookie` names (a handle's
    /// check, with no bucket read to order it). The live bit first: a
    /// reader that sees a reused node's new entry live then reads its new
    /// cookie. (Cookie first, a stale read of the old cookie followed by
    /// the new entry's live bit took the new entry for the old one.)
    pub(crate) fn is_entry(&self, cookie: u64) -> bool {
        self.is_live() && self.cookie() == cookie
    }

    pub(crate) fn state(&self) -> FlowState {
        FlowState::from_code((self.h.meta.load(Relaxed) & STATE_MASK) >> STATE_SHIFT)
    }

    /// Timeout profile (see [`crate::TimeoutOverrides`]).
    pub(crate) fn profile(&self) -> u16 {
        (self.h.meta.load(Relaxed) >> PROFILE_SHIFT) as u16
    }

    /// The last activity's time, widened against `near` (see [`widen`]):
    /// the caller's `now`, or the table's latest clock for listings.
    pub(crate) fn last_active(&self, near: u64) -> u64 {
        widen(self.c.last_active.load(Relaxed), near)
    }

    pub(crate) fn backend(&self) -> BackendId {
        BackendId(self.h.backend.load(Relaxed))
    }

    pub(crate) fn service(&self) -> ServiceId {
        ServiceId(self.h.service.load(Relaxed))
    }

    /// Wheel slot this node was last filed in (`UNFILED` if none).
    pub(crate) fn filed_slot(&self) -> u32 {
        (self.h.meta.load(Relaxed) >> SLOT_SHIFT) & UNFILED
    }

    pub(crate) fn owner(&self) -> u32 {
        self.h.owner.load(Relaxed)
    }

    /// What [`FlowTable::evict_due_first`](crate::FlowTable::evict_due_first)'s
    /// pick sees of the entry.
    pub(crate) fn candidate(&self) -> crate::Candidate {
        crate::Candidate {
            state: self.state(),
            owner: self.owner(),
            reply: self.has_reply(),
            packets_in: self.c.packets[0].load(Relaxed),
            packets_out: self.c.packets[1].load(Relaxed),
        }
    }

    pub(crate) fn nat(&self) -> u32 {
        self.h.nat.load(Relaxed)
    }

    /// Only for an entry without a reply index entry (its reply key would
    /// change).
    pub(crate) fn set_nat(&self, v: u32) {
        debug_assert!(!self.has_reply());
        self.h.nat.store(v, Relaxed);
    }

    pub(crate) fn set_filed_slot(&self, slot: u32) {
        debug_assert!(slot <= UNFILED);
        let _ = self.h.meta.fetch_update(Relaxed, Relaxed, |m| {
            Some((m & !(UNFILED << SLOT_SHIFT)) | (slot << SLOT_SHIFT))
        });
    }

    /// Any thread; the last writer wins.
    pub(crate) fn set_state(&self, st: FlowState) {
        let _ = self.h.meta.fetch_update(Relaxed, Relaxed, |m| {
            Some((m & !STATE_MASK) | (st.code() << STATE_SHIFT))
        });
    }

    /// Compare-and-swap of the state of a live entry: `f` maps the current
    /// state to the next (`None`: no change). Fails once the entry is
    /// unpublished (its LIVE bit is cleared before its final snapshot), so
    /// a transition is either in that snapshot or not made at all.
    pub(crate) fn transition(
        &self,
        f: impl Fn(FlowState) -> Option<FlowState>,
    ) -> Option<(FlowState, FlowState)> {
        let mut m = self.h.meta.load(Relaxed);
        loop {
            if m & LIVE == 0 {
                return None;
            }
            let from = FlowState::from_code((m & STATE_MASK) >> STATE_SHIFT);
            let to = f(from)?;
            let new = (m & !STATE_MASK) | (to.code() << STATE_SHIFT);
            match self.h.meta.compare_exchange_weak(m, new, Relaxed, Relaxed) {
                Ok(_) => return Some((from, to)),
                Err(cur) => m = cur,
            }
        }
    }

    /// Under the bucket lock, after unpublishing.
    pub(crate) fn clear_live(&self) {
        self.h.meta.fetch_and(!LIVE, Relaxed);
    }

    /// Lock-free hot path; returns (cookie, backend). Bytes out are not
    /// counted on a template (the word is its hold count).
    #[inline]
    pub(crate) fn touch(&self, now: Millis, dir_out: bool, bytes: u64) -> (Cookie, BackendId) {
        self.count(dir_out, bytes);
        self.bump_last_active(now);
        (Cookie(self.cookie()), self.backend())
    }

    /// [`touch`](Self::touch)'s counting, without restarting the timer.
    #[inline]
    pub(crate) fn count(&self, dir_out: bool, bytes: u64) {
        let d = usize::from(dir_out);
        if bytes != 0 && !(dir_out && self.is_template()) {
            self.c.bytes[d].fetch_add(bytes, Relaxed);
        }
        self.c.packets[d].fetch_add(1, Relaxed);
    }

    /// The state and the sequence number noted in direction `dir_out`
    /// (0: none); stores `f`'s answer to them, if any. Two threads noting
    /// the same direction at once may leave either's value: the caller's
    /// check allows for a window, and a flow's packets each way are
    /// normally steered to one worker.
    pub(crate) fn track_seq(
        &self,
        dir_out: bool,
        f: impl FnOnce(FlowState, u32) -> Option<u32>,
    ) -> (FlowState, u32) {
        let state = self.state();
        let cell = &self.c.seq[usize::from(dir_out)];
        let known = cell.load(Relaxed);
        if let Some(v) = f(state, known) {
            cell.store(v, Relaxed);
        }
        (state, known)
    }

    /// Whether the entry is a persistence template (state `Persist`).
    #[inline]
    pub(crate) fn is_template(&self) -> bool {
        self.h.meta.load(Relaxed) & STATE_MASK == FlowState::Persist.code() << STATE_SHIFT
    }

    /// Connections holding this template (0 for any other entry).
    pub(crate) fn held(&self) -> u64 {
        if self.is_template() {
            self.c.bytes[1].load(Relaxed)
        } else {
            0
        }
    }

    /// A fresh template's hold count, before it is published (see
    /// [`init`](Self::init)).
    pub(crate) fn init_held(&self, n: u64) {
        self.c.bytes[1].store(n, Relaxed);
    }

    /// Under the entry's bucket lock: one more connection holds this
    /// template. `false` (nothing changed) unless it is a live template.
    ///
    /// Holds, releases and expiry's [`expirable`](Self::expirable) check
    /// all run under the bucket lock, so a hold either lands before the
    /// expiry looks (which then keeps the entry) or finds it gone.
    pub(crate) fn hold_locked(&self) -> bool {
        if !self.is_live() || !self.is_template() {
            return false;
        }
        self.c.bytes[1].fetch_add(1, Relaxed);
        true
    }

    /// Under the entry's bucket lock: one connection holding this template
    /// ended; at the last one its timeout starts from `now`. The holds
    /// left, or `None` (nothing changed) unless it is a live, held template.
    pub(crate) fn release_locked(&self, now: Millis) -> Option<u64> {
        if !self.is_live() || !self.is_template() {
            return None;
        }
        let n = self.c.bytes[1].load(Relaxed);
        if n == 0 {
            return None;
        }
        if n == 1 {
            self.bump_last_active(now);
        }
        self.c.bytes[1].store(n - 1, Relaxed);
        Some(n - 1)
    }

    /// Under the entry's bucket lock: a live template now places its
    /// client group on `backend`, its timeout restarted from `now`; its
    /// hold count is kept. `false` (nothing changed) unless it is a live
    /// template without a reply key (the reply key is computed from the
    /// backend: changing it would strand the reply index entry).
    pub(crate) fn rebind_locked(&self, backend: BackendId, now: Millis) -> bool {
        if !self.is_live() || !self.is_template() || self.has_reply() {
            return false;
        }
        self.h.backend.store(backend.0, Relaxed);
        self.bump_last_active(now);
        true
    }

    /// Under the bucket lock: whether expiry may remove the entry at `now`
    /// with idle timeout `timeout` (a held template never goes).
    #[cfg(loom)]
    pub(crate) fn expirable(&self, now: u64, timeout: u64) -> bool {
        now >= self.last_active(now).saturating_add(timeout) && self.held() == 0
    }

    /// Moves the activity time forward to `now` (never back: threads touch
    /// with their own clocks). The common case, a time already at `now`,
    /// is one load.
    #[inline]
    pub(crate) fn bump_last_active(&self, now: Millis) {
        let cur = self.c.last_active.load(Relaxed);
        if widen(cur, now.0) < now.0 {
            let _ = self.c.last_active.fetch_update(Relaxed, Relaxed, |c| {
                (widen(c, now.0) < now.0).then_some(now.0 as u32)
            });
        }
    }

    /// Copies the entry; `timeout` maps a state and a timeout profile to
    /// the idle timeout.
    /// `near`: a time near now (the table's latest clock), to widen the
    /// 32-bit activity time against.
    ///
    /// Only where the node cannot be reused during the copy: the caller
    /// found it through the bucket index under its pin (a grace period
    /// keeps it), or holds its bucket lock and is removing it. Anywhere
    /// else, [`snapshot_of`](Self::snapshot_of).
    pub(crate) fn snapshot(
        &self,
        near: u64,
        timeout: impl Fn(FlowState, u16) -> u64,
    ) -> FlowSnapshot {
        self.copy(self.h.meta.load(Relaxed), self.cookie(), near, timeout)
    }

    /// [`snapshot`](Self::snapshot) of entry `cookie` (which names this
    /// node), if the node holds it live: `None` if it is not live, holds
    /// another entry, or was reused for another entry while it was being
    /// copied. For a node whose index the caller did not find through the
    /// bucket index under its pin (a handle, a dump's remembered bucket,
    /// the dump's resume without the pin): it may have been reused since,
    /// or be reused during the copy.
    ///
    /// A seqlock with the node's use count as its sequence. The live bit
    /// (Acquire, paired with `init`'s publishing store) and the count are
    /// read first, and the count must be `cookie`'s; then the fields; an
    /// Acquire fence; the count again. [`init`](Self::init) stores a new
    /// entry's count first and its other fields after a Release fence, so
    /// if any read before our fence (the caller's filter checks included)
    /// saw a field of a later entry, the two fences pair and the second
    /// read sees that entry's count, or a later one: the copy is dropped.
    /// A count still `cookie`'s says every field read was written for
    /// that entry (by its init, or since by the data path). Other threads
    /// write a later entry's fields only after finding it published
    /// (Acquire), so those writes too come after its count in the one
    /// order x86 and ARMv8 (multi-copy atomic) give all threads; the C++
    /// model's fence pairing covers `init`'s own stores and the
    /// read-modify-writes that follow them.
    /// Removal does not write the fields, only the live bit: a copy of a
    /// removed entry whose node is not reused yet is that entry's whole,
    /// from while it was live, which a dump may list (removed meanwhile).
    /// A count read back equal after the node was reused 2^28 - 1 times
    /// during one copy would pass; cookies are unique only up to that.
    #[inline]
    pub(crate) fn snapshot_of(
        &self,
        cookie: u64,
        near: u64,
        timeout: impl Fn(FlowState, u16) -> u64,
    ) -> Option<FlowSnapshot> {
        debug_assert_eq!(crate::table::cookie_idx(cookie), self.idx);
        let uses = (cookie >> IDX_BITS) as u32;
        let m = self.h.meta.load(Acquire);
        if m & LIVE == 0 || self.h.uses.load(Relaxed) != uses {
            return None;
        }
        #[cfg(test)]
        if let Some(f) = MID_SNAPSHOT.take() {
            f(self.idx);
        }
        let s = self.copy(m, cookie, near, timeout);
        fence(Acquire);
        (self.h.uses.load(Relaxed) == uses).then_some(s)
    }

    /// The copy of both snapshots, with `meta` already read (state, key
    /// bits, profile and reply bit from one read of it) and the cookie.
    #[inline(always)]
    fn copy(
        &self,
        m: u32,
        cookie: u64,
        near: u64,
        timeout: impl Fn(FlowState, u16) -> u64,
    ) -> FlowSnapshot {
        let state = FlowState::from_code((m & STATE_MASK) >> STATE_SHIFT);
        let last = self.last_active(near);
        let key = PackedKey {
            tenant: self.h.tenant.load(Relaxed),
            bits: m & KEY_BITS,
            ports: self.h.ports.load(Relaxed),
            caddr: [self.h.caddr[0].load(Relaxed), self.h.caddr[1].load(Relaxed)],
            vaddr: [self.h.vaddr[0].load(Relaxed), self.h.vaddr[1].load(Relaxed)],
        };
        FlowSnapshot {
            key: key.unpack(),
            cookie: Cookie(cookie),
            service: self.service(),
            backend: self.backend(),
            state,
            created: Millis(u64::from(self.c.created_s.load(Relaxed)) * 1000),
            last_active: Millis(last),
            expires_at: Millis(last.saturating_add(timeout(state, (m >> PROFILE_SHIFT) as u16))),
            bytes_in: self.c.bytes[0].load(Relaxed),
            bytes_out: if state == FlowState::Persist {
                0
            } else {
                self.c.bytes[1].load(Relaxed)
            },
            held: if state == FlowState::Persist {
                u32::try_from(self.c.bytes[1].load(Relaxed)).unwrap_or(u32::MAX)
            } else {
                0
            },
            packets_in: self.c.packets[0].load(Relaxed),
            packets_out: self.c.packets[1].load(Relaxed),
            owner: self.owner(),
            nat: self.nat(),
            reply: m & REPLY != 0,
        }
    }
}

/// What [`MID_SNAPSHOT`] runs, given the node's index.
#[cfg(test)]
pub(crate) type MidSnapshot = Box<dyn FnOnce(u32)>;

#[cfg(test)]
thread_local! {
    /// Tests: run once, on this thread, inside its next
    /// [`Node::snapshot_of`] (given the node's index), once the entry's use
    /// count is checked: to reuse the node in the middle of the copy,
    /// without a race.
    pub(crate) static MID_SNAPSHOT: std::cell::Cell<Option<MidSnapshot>> =
        const { std::cell::Cell::new(None) };
}

/// Something that maps node indices to nodes (the slab, or plain vectors in
/// model-checking tests).
pub(crate) trait Arena {
    fn node(&self, i: u32) -> Node<'_>;
}

/// Nodes in two plain vectors (model-checking tests).
#[cfg(loom)]
#[derive(Debug)]
pub(crate) struct NodeVec {
    hot: Box<[Hot]>,
    cold: Box<[Cold]>,
}

#[cfg(loom)]
impl NodeVec {
    pub(crate) fn new(n: usize) -> NodeVec {
        NodeVec {
            hot: (0..n).map(|_| Hot::default()).collect(),
            cold: (0..n).map(|_| Cold::default()).collect(),
        }
    }
}

#[cfg(loom)]
impl Arena for NodeVec {
    fn node(&self, i: u32) -> Node<'_> {
        Node {
            h: &self.hot[i as usize],
            c: &self.cold[i as usize],
            idx: i,
        }
    }
}

/// First chunks grow geometrically (1 Ki, 1 Ki, 2 Ki ... 64 Ki nodes) so a
/// small table stays small; past 128 Ki nodes every chunk holds 128 Ki
/// nodes = 8 MiB of hot parts + 5 MiB of cold parts (see
/// `raw::HugeArray`: pages are backed as they are first written, so the
/// last chunk's unused tail costs address space, not memory).
/// Indices are 28 bits (the wheel's filing references keep 4 cookie bits
/// above them), so a `FlowTable` holds at most 2^28 - 1 (~268 M) entries.
const GEOMETRY: ChunkGeometry = ChunkGeometry::new(1024);
const CHUNKS: usize = GEOMETRY.chunks(NIL);

/// The node arena: chunks allocated on demand and never freed before the
/// table, addressed by 28-bit indices. Index `NIL` is never handed out.
#[derive(Debug)]
pub(crate) struct Slab {
    dir: Box<[OnceLock<Chunk>]>,
    high: std::sync::atomic::AtomicU64,
}

/// One chunk of nodes: the hot parts and the cold parts, same indices.
#[derive(Debug)]
struct Chunk {
    hot: HugeArray<Hot>,
    cold: HugeArray<Cold>,
}

impl Chunk {
    fn zeroed(len: usize) -> Chunk {
        fn array<T: crate::raw::Zeroable + Default>(len: usize) -> HugeArray<T> {
            HugeArray::zeroed(len).unwrap_or_else(|| {
                std::alloc::handle_alloc_error(
                    std::alloc::Layout::array::<T>(len).expect("chunk layout"),
                )
            })
        }
        Chunk {
            hot: array(len),
            cold: array(len),
        }
    }

    #[inline]
    fn get(&self, off: usize, idx: u32) -> Option<Node<'_>> {
        Some(Node {
            h: self.hot.get(off)?,
            c: self.cold.get(off)?,
            idx,
        })
    }
}

/// (chunk, offset, chunk length) of an index.
#[inline]
fn locate(i: u32) -> (usize, usize, usize) {
    GEOMETRY.locate(i)
}

impl Slab {
    pub(crate) fn new() -> Slab {
        Slab {
            dir: (0..CHUNKS).map(|_| OnceLock::new()).collect(),
            high: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Reserves `n` fresh indices; `None` once the 2^28 - 1 space is used.
    pub(crate) fn alloc_block(&self, n: u32) -> Option<std::ops::Range<u32>> {
        let start = self
            .high
            .fetch_add(u64::from(n), std::sync::atomic::Ordering::Relaxed);
        let end = start + u64::from(n);
        if end > u64::from(NIL) {
            return None;
        }
        let (start, end) = (start as u32, end as u32);
        let mut i = start;
        while i < end {
            let (c, off, len) = locate(i);
            self.dir[c].get_or_init(|| Chunk::zeroed(len));
            i += (len - off) as u32;
        }
        Some(start..end)
    }

    /// Bytes held by the arena (chunks + directory).
    pub(crate) fn memory_bytes(&self) -> usize {
        let chunks: usize = self
            .dir
            .iter()
            .filter_map(|c| c.get())
            .map(|c| c.hot.bytes() + c.cold.bytes())
            .sum();
        chunks + self.dir.len() * std::mem::size_of::<OnceLock<Chunk>>()
    }
}

impl Slab {
    /// Prefetches what a snapshot of node `i` reads
    /// ([`Node::prefetch_all`]). Always inlined, the node's lookup written
    /// out in it: through `node`, which the dump's resume called out of
    /// line there, its prefetch cost ~35 instructions a page of one entry.
    #[inline(always)]
    pub(crate) fn prefetch_all(&self, i: u32) {
        let (c, off, _) = locate(i);
        // A hint: an index never handed out prefetches nothing.
        if let Some(node) = self.dir.get(c).and_then(|d| d.get()?.get(off, i)) {
            node.prefetch_all();
        }
    }

    /// The node at `i` if `i` was ever handed out (for handles, which a
    /// caller could carry from one table to another).
    pub(crate) fn node_checked(&self, i: u32) -> Option<Node<'_>> {
        let (c, off, _) = locate(i);
        self.dir.get(c)?.get()?.get(off, i)
    }
}

impl Arena for Slab {
    #[inline]
    fn node(&self, i: u32) -> Node<'_> {
        let (c, off, _) = locate(i);
        // Invariant: only indices returned by `alloc_block` (whose chunks are
        // initialised before the index is handed out) are ever linked or
        // filed, so the chunk exists.
        let ch = self.dir[c].get().expect("node index from alloc_block");
        Node {
            h: &ch.hot[off],
            c: &ch.cold[off],
            idx: i,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node slab's geometry, as its documentation gives it: 1 Ki,
    /// 1 Ki, 2 Ki ... 64 Ki nodes, then 128 Ki each, in 2055 chunks for the
    /// 2^28 - 1 indices.
    #[test]
    fn the_node_slab_geometry_is_pinned() {
        assert_eq!(locate(0), (0, 0, 1024));
        assert_eq!(locate(1023), (0, 1023, 1024));
        assert_eq!(locate(1024), (1, 0, 1024));
        assert_eq!(locate(2048), (2, 0, 2048));
        assert_eq!(locate((1 << 17) - 1), (7, (1 << 16) - 1, 1 << 16));
        assert_eq!(locate(1 << 17), (8, 0, 1 << 17));
        assert_eq!(locate(NIL - 1), (2054, (1 << 17) - 2, 1 << 17));
        assert_eq!(CHUNKS, 2055);
    }

    #[test]
    fn widen_reads_back_every_time_in_its_window() {
        for near in [0u64, 1_000, (1 << 32) - 1, 1 << 32, (1 << 40) + 12_345] {
            for back in [0u64, 1, 999, 30 * 86_400_000, MAX_IDLE_MS - 1] {
                let Some(t) = near.checked_sub(back) else {
                    continue;
                };
                assert_eq!(widen(t as u32, near), t, "{t} near {near}");
            }
            for ahead in [1u64, 1_000, AHEAD] {
                let t = near + ahead;
                assert_eq!(widen(t as u32, near), t, "{t} near {near}");
            }
        }
        // Near the start of the clock nothing reads as negative.
        assert_eq!(widen(u32::MAX, 0), 0);
    }

    #[test]
    fn pack_roundtrip() {
        let k = FlowKey {
            tenant: TenantId(7),
            proto: Proto::Udp,
            client: "[2001:db8::1]:4000".parse().unwrap(),
            virt: "10.0.0.1:53".parse().unwrap(),
        };
        assert_eq!(PackedKey::new(&k).unpack(), k);
    }
}
