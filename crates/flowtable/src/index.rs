//! The bucket index of one table: which node holds which key.
//!
//! # Layout
//! An array of 64-byte [`Bucket`]s, one cache line each, of [`WAYS`] = 11
//! ways: a header word, a link to an overflow line, eleven one-byte tags in
//! two words (ways 0..8 in a `u64`, ways 8..11 in the low three bytes of a
//! `u32` whose top byte stays 0) and eleven `u32` node indices: 4 + 4 + 8 +
//! 4 + 44 = 64 bytes, none unused (with 8 ways, 16 bytes of every line
//! were). A key's hash gives a tag (its low byte with the top bit set, so
//! a tag is never 0 = empty) and a bucket: `(hash >> 32) * buckets >> 32`
//! ("fastrange"), which keeps buckets in the order of the hash's top 32
//! bits for every bucket count. That order is what dumps walk (`flow.rs`),
//! so a dump's position means the same thing before, during and after a
//! resize. A bucket whose ways are all taken chains overflow lines (same
//! layout) from a per-index pool; the chain is capped (`max_chain`) against
//! hash flooding. Overflow lines are never freed before their index: an
//! emptied one stays linked and is refilled first.
//!
//! # Check bits
//! A node index takes 28 bits of its way's `u32` and the reply bit one;
//! the three left over hold bits 8-10 of the key's hash. A lookup whose
//! tag matches a way compares them before it reads the way's node, so a
//! tag collision (at 8.25 entries per bucket, ~6% of absent keys meet one)
//! costs a node read only one time in eight: the node is the dependent
//! cache miss after the line. Every way value is stored with its key's
//! bits (`put`, also when a resize moves it); readers of node indices
//! mask them off with [`WAY_IDX`].
//!
//! # Summaries
//! Beside the lines, one `u64` per bucket summarises its chain: the OR of
//! three bits (of 64) per way, chosen by its tag and check bits (ten bits
//! of the hash, [`sum_bits`]). A lookup reads it first
//! and stops if the key's three bits are not all set — a miss that never
//! reads the bucket line. The summaries are 8 B per bucket (~1 B per
//! entry at the target load: 1 MB at 1M entries, where the lines are
//! 7.8 MB), so a miss reads a word from an array that stays in cache where
//! the lines do not, as a SwissTable miss reads only its control bytes.
//! At 8.25 entries per bucket ~4% of absent keys still pass (with the tag
//! alone it was ~10%, 6% of them tag collisions).
//! A summary is derived from the line alone (tags and way values), so a writer can remake it
//! from the lines it holds locked. What readers rely on: it holds the bits
//! of every way present (a superset is safe: an extra bit only sends a
//! reader on to the line). Writers keep it under the bucket's lock:
//! * an insert stores the union of the chain's tags and its own
//!   (`Release`) *before* it stores the way's index and tag: a reader that
//!   sees the tag (`Acquire`) sees the bits, and so does any lookup that
//!   starts after it; a lookup that reads the summary before is concurrent
//!   with the insert and may miss it, as it may by reading the line first.
//!   Remade from the lines (in cache: the insert just read them) rather
//!   than ORed in, it needs no load of the old value and drops the bits of
//!   entries removed since;
//! * a remove leaves the summary alone: touching it cost churn a cache
//!   miss per remove (~10% of an insert + remove pair at 1M entries, where
//!   the summaries are evicted from L2 by the lines and nodes), and the
//!   removed tag's bits stay only until the bucket's next insert;
//! * a resize sets a moved bucket's summary to all ones before the store
//!   that sets `MOVED` (both under its lock), so a lookup never stops at
//!   an old summary for a key inserted into the successor since: a key
//!   inserted after the move was homed by a writer that saw `MOVED`, hence
//!   the all-ones store too, and no writer touches a moved bucket again.
//!
//! # Reply entries
//! A packet-mode entry may have a second index entry under its reply key
//! (same table, wherever that key hashes): the same node index with
//! [`REPLY_WAY`] set in its way. A forward lookup skips such ways and a
//! reply lookup takes only them, so a reply key that collides with a
//! forward key (tag and bucket) never confuses either. Reply ways count
//! in the chain like any other (cap and load), move with resizes like any
//! other (rehashed by their reply key), and are skipped by dump reads so
//! that a dump lists each entry once.
//!
//! # Concurrency
//! * Readers take no lock and write nothing. They load the bucket's
//!   summary (`Acquire`) and stop if it rules the key's tag out (see
//!   "Summaries"); else the header (`Acquire`); if the bucket was moved to the successor index (resize),
//!   they look there instead. Otherwise they load both tag words
//!   (`Acquire`, two independent loads from the line already being read)
//!   and match them against the key's tag (SWAR, eight ways at once in the
//!   `u64`, three in the `u32`), load each candidate's way value
//!   (`Acquire`; node index and check bits, one store) and, if its check
//!   bits match, compare the full key in the node. Overflow lines are
//!   visited only if the header counts entries in them.
//! * Writers set the header's lock bit (a spin lock per bucket: no shared
//!   stripe, no lock line shared by unrelated buckets). An insert stores the
//!   node index (`Release`), then its tag (`Release`, a store of the tag
//!   word that holds the way's byte); a remove clears the tag. Entries
//!   never move between ways, so an entry present throughout a lookup is
//!   found. Unlock stores the new entry counts with `Release`.
//! * Two tag words, one argument per way. Every claim above is about one
//!   way at a time: the way's node index is stored before its tag
//!   (`Release`), so a reader whose `Acquire` load of the word holding that
//!   tag sees it also sees the index (or a later one, checked by key and
//!   live bit); a present entry's tag stays in its byte of its word for as
//!   long as it is present. A writer changes one byte of one word per store
//!   (under the lock, so no other writer's byte is lost). So a reader that
//!   loads the two words at different instants gets, for each way, what a
//!   load of that way's tag alone would give: nothing in the protocol needs
//!   the ways' tags to be read at one instant (with one word they were, but
//!   no argument used it). An entry present throughout is in its word at
//!   both loads and found; an entry being inserted or removed is seen
//!   whole or not at all, whichever word holds it.
//! * Node indices are recycled only after an epoch grace period (caller),
//!   so a reader holding a stale way still reads a node that is not reused;
//!   it checks the node's live bit and full key.
//!
//! # Resize
//! A resize creates a successor index and moves buckets one at a time under
//! each bucket's lock: copy every entry into the successor (locking the
//! target bucket), then set `MOVED` in the same store that unlocks. The old
//! bucket keeps its ways as they were, so a reader that loaded the header
//! before `MOVED` still finds everything there; a reader that sees `MOVED`
//! goes to the successor, which already holds every moved entry. Writers
//! decide a key's home under the old bucket's lock: not moved → the old
//! index; moved → the successor. Nothing stops the world: each insert
//! moves a couple of buckets and the maintenance call moves more.

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, OnceLock};

use crate::node::{Arena, NIL, Node, PackedKey, PackedReply};
use crate::raw::HugeArray;
use crate::sync::{
    AtomicU32, AtomicU64, Ordering, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
};

/// Ways (entry slots) per bucket line. Two under loom, so that a model
/// check reaches overflow lines with three entries.
pub(crate) const WAYS: usize = if cfg!(loom) { 2 } else { 11 };
/// Ways whose tags are in the low tag word (`tags`); the others' are in
/// `tags_hi`. Under loom one in each, so the model checks take both words.
const LO_WAYS: usize = if cfg!(loom) { 1 } else { 8 };
/// Ways whose tags are in the high tag word (its low bytes; its top byte
/// is never used, so it stays 0).
const HI_WAYS: usize = WAYS - LO_WAYS;
const _: () = assert!(LO_WAYS >= 1 && LO_WAYS <= 8 && HI_WAYS <= 3);
/// Set in a way's node index for a reply entry (node indices have 28 bits).
pub(crate) const REPLY_WAY: u32 = 1 << 31;
const _: () = assert!(REPLY_WAY > NIL);
/// A way value's node index bits (the rest: reply bit and check bits).
pub(crate) const WAY_IDX: u32 = NIL;
/// Bits 28-30 of a way value: three bits of the key's hash beside the tag
/// (see "Check bits" above). Never part of the node index or reply bit.
const CHECK_SHIFT: u32 = 28;
const CHECK_MASK: u32 = 0x7 << CHECK_SHIFT;
const _: () = assert!(WAY_IDX & CHECK_MASK == 0 && REPLY_WAY & CHECK_MASK == 0);
const _: () = assert!(WAY_IDX == (1 << CHECK_SHIFT) - 1);
const LOCK: u32 = 1;
const MOVED: u32 = 2;
const CNT_SHIFT: u32 = 2;
const CNT_MASK: u32 = 0x3FFF << CNT_SHIFT;
const OVF_SHIFT: u32 = 16;
const OVF_MASK: u32 = 0x3FFF << OVF_SHIFT;
const LO: u64 = 0x0101_0101_0101_0101;
const HI: u64 = 0x8080_8080_8080_8080;
const LO32: u32 = 0x0101_0101;
const HI32: u32 = 0x8080_8080;
/// The top bits of the tag bytes that exist in the low tag word.
const USED: u64 = if LO_WAYS == 8 {
    HI
} else {
    HI & ((1 << (8 * LO_WAYS)) - 1)
};
/// The top bits of the tag bytes that exist in the high tag word.
const USED_HI: u32 = HI32 & ((1 << (8 * HI_WAYS)) - 1);

/// One bucket line (or overflow line).
#[repr(C, align(64))]
#[derive(Debug, Default)]
pub(crate) struct Bucket {
    /// `LOCK | MOVED | entries << 2 | overflow entries << 16`.
    hdr: AtomicU32,
    /// Overflow line number + 1 in the index's pool; 0 = none.
    next: AtomicU32,
    /// Way `w < LO_WAYS`'s tag in byte `w`; 0 = empty.
    tags: AtomicU64,
    /// Way `LO_WAYS + j`'s tag in byte `j` (`j < HI_WAYS`); 0 = empty. The
    /// top byte is always 0.
    tags_hi: AtomicU32,
    ways: [AtomicU32; WAYS],
    /// Under loom the lock bit's waiting is done by a loom mutex: loom
    /// cannot explore a spin loop (every spin is a branch). The bit is still
    /// set and cleared around it, so readers and the header protocol are the
    /// real ones.
    #[cfg(loom)]
    mx: loom::sync::Mutex<()>,
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Bucket>() == 64);

/// Bytes of index per bucket: its line and its summary word.
pub(crate) const BUCKET_BYTES: usize = 64 + 8;

/// A key's hash as the index uses it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hash {
    /// Top 32 bits: bucket (fastrange) and dump order.
    pub(crate) hi: u32,
    tag: u8,
    /// Bits 8-10 of the hash, in place ([`CHECK_MASK`]) for way values.
    check: u32,
}

impl Hash {
    #[inline]
    pub(crate) fn new(h: u64) -> Hash {
        Hash {
            hi: (h >> 32) as u32,
            tag: (h as u8) | 0x80,
            check: ((h >> 8) as u32 & 0x7) << CHECK_SHIFT,
        }
    }
}

/// Bytes of `tags` (the low tag word) equal to `tag`, as a mask with the
/// top bit of each such byte set (only bytes of ways that exist). May also
/// flag a byte just above a true match (borrow), never misses one:
/// candidates are confirmed by the full key. Exact for `tag` 0 because
/// real tags have their top bit set.
#[inline]
fn match_byte(tags: u64, tag: u8) -> u64 {
    let x = tags ^ (LO * u64::from(tag));
    x.wrapping_sub(LO) & !x & USED
}

/// [`match_byte`] for the high tag word (bytes of its `HI_WAYS` ways).
#[inline]
fn match_byte32(tags: u32, tag: u8) -> u32 {
    let x = tags ^ (LO32 * u32::from(tag));
    x.wrapping_sub(LO32) & !x & USED_HI
}

/// Visits the ways flagged in a line's two match masks (`lo` from
/// [`match_byte`], `hi` from [`match_byte32`]), the low word's first, in
/// way order: `f(way)` until it returns `Some`. Two plain loops: a way of
/// the low word is its flag's byte (`tz / 8`, as with one word), one of
/// the high word `LO_WAYS` + its byte. (One loop over the two masks merged
/// into one `u64` needed 7 more instructions per candidate to tell the
/// words apart.)
#[inline(always)]
fn each_way<T>(lo: u64, hi: u32, mut f: impl FnMut(usize) -> Option<T>) -> Option<T> {
    let mut m = lo;
    while m != 0 {
        if let Some(t) = f((m.trailing_zeros() / 8) as usize) {
            return Some(t);
        }
        m &= m - 1;
    }
    let mut m = hi;
    while m != 0 {
        // The high word's top flagged bit or'ed in bounds the byte below
        // HI_WAYS for the compiler (no bounds check on `ways`); it changes
        // nothing, as `m` has a flag at or below it.
        let j = (m | 1 << (8 * HI_WAYS - 1)).trailing_zeros() / 8;
        if let Some(t) = f(LO_WAYS + j as usize) {
            return Some(t);
        }
        m &= m - 1;
    }
    None
}

/// Summary bits by (check bits, tag byte), index `check << 8 | tag`: three
/// distinct bits of 64 for each tag (a tag has its top bit set: entries
/// 128..256 of each group of 256), none for 0 (an empty way), so a line's
/// summary is the OR over its ways with no test for empties. Within a group
/// (one value of the check bits) no two tags share a mask.
const SUM_BITS: [u64; 2048] = {
    let mut t = [0u64; 2048];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut g = 0;
    while g < 8 {
        let mut i = 128;
        while i < 256 {
            let mut m = 0u64;
            while m.count_ones() < 3 {
                // xorshift64*: any fixed, well-spread choice of bits works.
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                m |= 1 << (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 58);
            }
            // Distinct masks in a group (two tags with one mask are never
            // told apart).
            let mut j = 128;
            while j < i && t[g * 256 + j] != m {
                j += 1;
            }
            if j < i {
                continue;
            }
            t[g * 256 + i] = m;
            i += 1;
        }
        g += 1;
    }
    t
};

/// The summary bits of a way with tag `tag` whose way value is `v` (only
/// its check bits count; none for an empty way, tag 0).
#[inline(always)]
fn sum_bits(tag: u8, v: u32) -> u64 {
    SUM_BITS[((v & CHECK_MASK) >> CHECK_SHIFT) as usize * 256 + usize::from(tag)]
}

impl Bucket {
    /// Match masks for `tag` of this line's two tag words, each loaded with
    /// `o` (`tag` 0 gives exactly the empty ways); see [`each_way`].
    #[inline]
    fn matches(&self, tag: u8, o: Ordering) -> (u64, u32) {
        (
            match_byte(self.tags.load(o), tag),
            match_byte32(self.tags_hi.load(o), tag),
        )
    }

    /// The ways holding an entry, as masks like [`matches`](Self::matches)
    /// (exact).
    #[inline]
    fn occupied(&self, o: Ordering) -> (u64, u32) {
        (
            !match_byte(self.tags.load(o), 0) & USED,
            !match_byte32(self.tags_hi.load(o), 0) & USED_HI,
        )
    }

    /// Under the bucket's lock: the union of [`sum_bits`] of this line's
    /// ways (a fixed OR over the ways; empty ones add nothing).
    #[inline]
    fn summary_bits(&self) -> u64 {
        let lo = self.tags.load(Relaxed).to_le_bytes();
        let hi = self.tags_hi.load(Relaxed).to_le_bytes();
        let mut m = 0;
        for (w, t) in lo[..LO_WAYS].iter().enumerate() {
            m |= sum_bits(*t, self.ways[w].load(Relaxed));
        }
        for (w, t) in hi[..HI_WAYS].iter().enumerate() {
            m |= sum_bits(*t, self.ways[LO_WAYS + w].load(Relaxed));
        }
        m
    }

    /// Way `w`'s tag (0 = empty).
    #[inline]
    fn tag(&self, w: usize, o: Ordering) -> u8 {
        if w < LO_WAYS {
            (self.tags.load(o) >> (8 * w)) as u8
        } else {
            (self.tags_hi.load(o) >> (8 * (w - LO_WAYS))) as u8
        }
    }

    /// Under the bucket's lock: sets way `w`'s tag (0 = clears it) with one
    /// `Release` store of the word that holds it; the other ways' bytes are
    /// kept (only the lock holder writes tags).
    #[inline]
    fn set_tag(&self, w: usize, tag: u8) {
        if w < LO_WAYS {
            let s = 8 * w;
            let t = self.tags.load(Relaxed);
            self.tags
                .store(t & !(0xFF << s) | u64::from(tag) << s, Release);
        } else {
            let s = 8 * (w - LO_WAYS);
            let t = self.tags_hi.load(Relaxed);
            self.tags_hi
                .store(t & !(0xFF << s) | u32::from(tag) << s, Release);
        }
    }
}

/// Overflow lines: chunks of 64 << k lines, allocated on demand.
#[derive(Debug)]
struct Pool {
    dir: Box<[OnceLock<HugeArray<Bucket>>]>,
    high: AtomicU32,
}

const POOL_CHUNKS: usize = 26;

/// (chunk, offset, chunk length) of overflow line `i` (0-based).
#[inline]
fn pool_locate(i: u32) -> (usize, usize, usize) {
    let j = u64::from(i) / 64 + 1;
    let k = 63 - j.leading_zeros() as usize;
    let start = 64 * ((1u64 << k) - 1);
    (k, (u64::from(i) - start) as usize, 64 << k)
}

impl Pool {
    fn new() -> Pool {
        Pool {
            dir: (0..POOL_CHUNKS).map(|_| OnceLock::new()).collect(),
            high: AtomicU32::new(0),
        }
    }

    /// A fresh, empty line's number + 1 (under a bucket lock); `None` if the
    /// allocator refuses.
    fn alloc(&self) -> Option<u32> {
        let i = self.high.fetch_add(1, Relaxed);
        let (c, _, len) = pool_locate(i);
        if c >= POOL_CHUNKS {
            return None;
        }
        self.dir[c].get_or_init(|| {
            HugeArray::zeroed(len).unwrap_or_else(|| {
                std::alloc::handle_alloc_error(
                    std::alloc::Layout::array::<Bucket>(len).expect("chunk layout"),
                )
            })
        });
        Some(i + 1)
    }

    #[inline]
    fn line(&self, n: u32) -> &Bucket {
        let (c, off, _) = pool_locate(n - 1);
        // Invariant: only numbers returned by `alloc` (whose chunk exists)
        // are ever stored in a `next` link.
        &self.dir[c].get().expect("overflow line from alloc")[off]
    }

    fn bytes(&self) -> usize {
        self.dir
            .iter()
            .filter_map(|c| c.get())
            .map(|c| c.bytes())
            .sum()
    }
}

/// What an index lookup compares a candidate node with: a forward key, or a
/// reply key (which only matches reply ways).
pub(crate) trait Matcher {
    /// Whether this key lives in reply ways.
    const REPLY: bool;
    /// Whether node `n` has this key (live or not: callers check).
    fn hit(&self, n: Node<'_>) -> bool;
}

impl Matcher for PackedKey {
    const REPLY: bool = false;
    #[inline]
    fn hit(&self, n: Node<'_>) -> bool {
        n.matches(self)
    }
}

impl Matcher for PackedReply {
    const REPLY: bool = true;
    #[inline]
    fn hit(&self, n: Node<'_>) -> bool {
        n.matches_reply(self)
    }
}

/// The node of way value `v` if it is of the kind `M` looks for.
#[inline]
fn way_node<M: Matcher + ?Sized>(v: u32) -> Option<u32> {
    ((v & REPLY_WAY != 0) == M::REPLY).then_some(v & WAY_IDX)
}

/// Outcome of a locked insert.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Put {
    /// Published; `true` if in an overflow line (the bucket is crowded).
    Done(bool),
    /// The key is present in this node (live, or pending: its insert is
    /// still adding its other index entry).
    Exists(u32),
    /// The chain holds `max_chain` entries (or no overflow line could be had).
    Full,
}

/// One index (a table has one, two during a resize).
#[derive(Debug)]
pub(crate) struct Index {
    buckets: HugeArray<Bucket>,
    /// Per bucket: the union of [`sum_bits`] of every way in its chain (a
    /// superset while a remove is under way), or all ones once it moved.
    /// See "Summaries" in the module docs.
    summary: HugeArray<AtomicU64>,
    n: u64,
    pool: Pool,
    successor: OnceLock<Arc<Index>>,
    /// Next bucket to move (claimed with `fetch_add`).
    claim: AtomicUsize,
    /// Buckets moved.
    moved: AtomicUsize,
}

/// A locked bucket: its header value without the lock bit.
pub(crate) struct Locked<'a> {
    b: &'a Bucket,
    /// The bucket's number (its summary's).
    at: usize,
    hdr: u32,
    #[cfg(loom)]
    _mx: loom::sync::MutexGuard<'a, ()>,
}

impl Locked<'_> {
    pub(crate) fn moved(&self) -> bool {
        self.hdr & MOVED != 0
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        self.b.hdr.store(self.hdr, Release);
    }
}

/// Bytes of bucket arrays of every index alive in the process: each
/// table's current one, a resize's successor, and replaced ones whose
/// grace period has not ended (see [`index_bytes_alive`]).
static INDEX_BYTES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Bytes of index bucket arrays alive in this process, whatever table
/// holds them: lets a test check that a resize frees the index it replaced
/// (tests/index_reclaim.rs).
#[doc(hidden)]
pub fn index_bytes_alive() -> usize {
    INDEX_BYTES.load(std::sync::atomic::Ordering::Relaxed)
}

impl Drop for Index {
    fn drop(&mut self) {
        INDEX_BYTES.fetch_sub(
            self.buckets.bytes() + self.summary.bytes(),
            std::sync::atomic::Ordering::Relaxed,
        );
    }
}

impl Index {
    /// An index of `n` buckets (`1..=2^32`); `None` if the allocation fails.
    pub(crate) fn try_new(n: usize) -> Option<Index> {
        let n = n.clamp(1, 1 << 32);
        let buckets = HugeArray::zeroed(n)?;
        let summary = HugeArray::zeroed(n)?;
        INDEX_BYTES.fetch_add(
            buckets.bytes() + summary.bytes(),
            std::sync::atomic::Ordering::Relaxed,
        );
        Some(Index {
            buckets,
            summary,
            n: n as u64,
            pool: Pool::new(),
            successor: OnceLock::new(),
            claim: AtomicUsize::new(0),
            moved: AtomicUsize::new(0),
        })
    }

    /// Buckets.
    pub(crate) fn len(&self) -> usize {
        self.n as usize
    }

    /// Bytes of bucket array, summaries and overflow lines.
    pub(crate) fn bytes(&self) -> usize {
        self.buckets.bytes() + self.summary.bytes() + self.pool.bytes()
    }

    /// Bucket of a hash.
    #[inline]
    pub(crate) fn bucket_of(&self, hi: u32) -> usize {
        ((u64::from(hi) * self.n) >> 32) as usize
    }

    /// Smallest `hi` of bucket `b` (`2^32` for `b == len`).
    pub(crate) fn bucket_start(&self, b: usize) -> u64 {
        ((b as u64) << 32).div_ceil(self.n)
    }

    #[inline]
    pub(crate) fn bucket(&self, b: usize) -> &Bucket {
        &self.buckets[b]
    }

    pub(crate) fn successor(&self) -> Option<&Arc<Index>> {
        self.successor.get()
    }

    /// Sets the successor; `false` if one exists.
    pub(crate) fn set_successor(&self, s: Arc<Index>) -> bool {
        self.successor.set(s).is_ok()
    }

    /// Whether every bucket has moved to the successor.
    pub(crate) fn fully_moved(&self) -> bool {
        self.moved.load(Acquire) >= self.len()
    }

    /// Prefetches the summary and the bucket line of `h`.
    #[inline]
    pub(crate) fn prefetch(&self, h: Hash) {
        let b = self.bucket_of(h.hi);
        crate::raw::prefetch(&self.summary[b]);
        crate::raw::prefetch(self.bucket(b));
    }

    /// Whether bucket `b`'s summary admits a way with `tag` (`false`: no
    /// such way in its chain, nor did it move). `Acquire`: see "Summaries".
    #[inline(always)]
    fn admits(&self, b: usize, h: Hash) -> bool {
        let m = sum_bits(h.tag, h.check);
        self.summary[b].load(Acquire) & m == m
    }

    /// Prefetches the nodes whose tags match `h` in its bucket's head line
    /// (the second stage of a batched lookup), if its summary admits it.
    #[inline]
    pub(crate) fn prefetch_candidates<A: Arena + ?Sized>(&self, arena: &A, h: Hash) {
        let bi = self.bucket_of(h.hi);
        if !self.admits(bi, h) {
            return;
        }
        let b = self.bucket(bi);
        let (lo, hi) = b.matches(h.tag, Relaxed);
        each_way::<()>(lo, hi, |w| {
            // Acquire, as a lookup's: the way's node may be in a slab chunk
            // made just before the insert published the way (Release), and
            // finding that chunk must see it made (free on x86; on a weakly
            // ordered CPU a Relaxed load could see the way but not the
            // chunk, and `node` would panic).
            let v = b.ways[w].load(Acquire);
            if v & CHECK_MASK == h.check {
                arena.node(v & WAY_IDX).prefetch();
            }
            None
        });
    }

    /// Lock-free lookup of a live entry (by forward or reply key). Follows
    /// `MOVED` buckets into successors.
    ///
    /// The common case — a home bucket that has not moved and has no
    /// overflow lines — is inlined into the caller: one line read, one tag
    /// match. The rest is out of line, so the inlined part stays small.
    #[inline(always)]
    pub(crate) fn find<A: Arena + ?Sized, M: Matcher + ?Sized>(
        &self,
        arena: &A,
        h: Hash,
        key: &M,
    ) -> Option<u32> {
        let bi = self.bucket_of(h.hi);
        if !self.admits(bi, h) {
            return None;
        }
        let b = self.bucket(bi);
        let hdr = b.hdr.load(Acquire);
        if hdr & (MOVED | OVF_MASK) == 0 {
            return scan_line(b, arena, h, key);
        }
        self.find_slow(b, hdr, arena, h, key)
    }

    /// [`find`](Self::find) from a home bucket that moved or overflowed.
    #[inline(never)]
    fn find_slow<'a, A: Arena + ?Sized, M: Matcher + ?Sized>(
        &'a self,
        mut b: &'a Bucket,
        mut hdr: u32,
        arena: &A,
        h: Hash,
        key: &M,
    ) -> Option<u32> {
        let mut ix = self;
        while hdr & MOVED != 0 {
            ix = ix.successor()?;
            b = ix.bucket(ix.bucket_of(h.hi));
            hdr = b.hdr.load(Acquire);
        }
        ix.find_in(b, hdr, arena, h, key)
    }

    #[inline]
    fn find_in<A: Arena + ?Sized, M: Matcher + ?Sized>(
        &self,
        b: &Bucket,
        hdr: u32,
        arena: &A,
        h: Hash,
        key: &M,
    ) -> Option<u32> {
        if let Some(i) = scan_line(b, arena, h, key) {
            return Some(i);
        }
        if hdr & OVF_MASK == 0 {
            return None;
        }
        let mut l = b.next.load(Acquire);
        while l != 0 {
            let line = self.pool.line(l);
            if let Some(i) = scan_line(line, arena, h, key) {
                return Some(i);
            }
            l = line.next.load(Acquire);
        }
        None
    }

    /// Locks the home bucket of `h`, following moved buckets into
    /// successors: returns the index that owns the key now and its locked
    /// bucket. The bucket stays locked until the guard drops.
    pub(crate) fn lock_home(&self, h: Hash) -> (&Index, Locked<'_>) {
        let mut ix = self;
        loop {
            let l = ix.lock_bucket(ix.bucket_of(h.hi));
            if !l.moved() {
                return (ix, l);
            }
            drop(l);
            ix = ix
                .successor()
                .expect("a moved bucket's index has a successor");
        }
    }

    #[cfg(loom)]
    pub(crate) fn lock_bucket(&self, at: usize) -> Locked<'_> {
        let b = self.bucket(at);
        let g = b.mx.lock().unwrap();
        let h = b.hdr.fetch_or(LOCK, Acquire);
        assert!(h & LOCK == 0, "bucket lock bit set under its mutex");
        Locked {
            b,
            at,
            hdr: h,
            _mx: g,
        }
    }

    #[cfg(not(loom))]
    pub(crate) fn lock_bucket(&self, at: usize) -> Locked<'_> {
        let b = self.bucket(at);
        loop {
            let h = b.hdr.fetch_or(LOCK, Acquire);
            if h & LOCK == 0 {
                return Locked { b, at, hdr: h };
            }
            while b.hdr.load(Relaxed) & LOCK != 0 {
                std::hint::spin_loop();
            }
        }
    }

    /// Visits every way of a locked bucket's chain: `f(line, way, node)`.
    fn for_each<'a>(&'a self, l: &Locked<'a>, mut f: impl FnMut(&'a Bucket, usize, u32) -> bool) {
        let mut line = l.b;
        loop {
            let (lo, hi) = line.occupied(Relaxed);
            let stop = each_way(lo, hi, |w| {
                (!f(line, w, line.ways[w].load(Relaxed))).then_some(())
            });
            if stop.is_some() {
                return;
            }
            let n = line.next.load(Relaxed);
            if n == 0 {
                return;
            }
            line = self.pool.line(n);
        }
    }

    /// Visits the ways of a locked bucket's chain whose tag is `tag`:
    /// `f(line, way, way value)` until it returns `Some`. The SWAR match
    /// narrows each line to candidates, confirmed by an exact tag compare.
    fn find_way<'a, T>(
        &'a self,
        l: &Locked<'a>,
        tag: u8,
        mut f: impl FnMut(&'a Bucket, usize, u32) -> Option<T>,
    ) -> Option<T> {
        let mut line = l.b;
        loop {
            let (lo, hi) = line.matches(tag, Relaxed);
            let r = each_way(lo, hi, |w| {
                if line.tag(w, Relaxed) != tag {
                    return None;
                }
                f(line, w, line.ways[w].load(Relaxed))
            });
            if r.is_some() {
                return r;
            }
            let n = line.next.load(Relaxed);
            if n == 0 {
                return None;
            }
            line = self.pool.line(n);
        }
    }

    /// Under the lock: the union of [`sum_bits`] over the ways of the
    /// chain headed by `head`.
    fn chain_bits(&self, head: &Bucket) -> u64 {
        let mut m = 0;
        let mut line = head;
        loop {
            m |= line.summary_bits();
            match line.next.load(Relaxed) {
                0 => return m,
                n => line = self.pool.line(n),
            }
        }
    }

    /// Under the lock: the node holding `key`, if any: live, or pending
    /// (its insert is still adding its reply entry). Never a removed one:
    /// removal unpublishes a key under its bucket's lock before or as it
    /// clears the live bit.
    pub(crate) fn find_locked<A: Arena + ?Sized, M: Matcher + ?Sized>(
        &self,
        l: &Locked<'_>,
        arena: &A,
        h: Hash,
        key: &M,
    ) -> Option<u32> {
        self.find_way(l, h.tag, |_, _, v| {
            way_node::<M>(v).filter(|&i| key.hit(arena.node(i)))
        })
    }

    /// Under the lock: publishes way value `idx` (a node index, already
    /// initialised, with [`REPLY_WAY`] for a reply entry) with tag of `h`.
    /// `key` = check for it first; `cap` = chain limit.
    pub(crate) fn put<A: Arena + ?Sized, M: Matcher + ?Sized>(
        &self,
        l: &mut Locked<'_>,
        arena: &A,
        h: Hash,
        key: Option<&M>,
        idx: u32,
        cap: usize,
    ) -> Put {
        if let Some(k) = key
            && let Some(i) = self.find_locked(l, arena, h, k)
        {
            return Put::Exists(i);
        }
        let count = ((l.hdr & CNT_MASK) >> CNT_SHIFT) as usize;
        if count >= cap.min((CNT_MASK >> CNT_SHIFT) as usize) {
            return Put::Full;
        }
        let mut line = l.b;
        let mut head = true;
        loop {
            let (lo, hi) = line.matches(0, Relaxed);
            if let Some(w) = each_way(lo, hi, Some) {
                // The summary admits the tag before the way holds it. It
                // is made afresh from the chain's tags (the lines are in
                // cache: this insert just read them), so it also drops the
                // bits of entries removed since: removes leave it alone
                // (a stale bit only sends a reader on to the line), and the
                // store needs no load of the old value first.
                self.summary[l.at].store(self.chain_bits(l.b) | sum_bits(h.tag, h.check), Release);
                line.ways[w].store(idx & !CHECK_MASK | h.check, Release);
                line.set_tag(w, h.tag);
                l.hdr += 1 << CNT_SHIFT;
                if !head {
                    l.hdr += 1 << OVF_SHIFT;
                }
                return Put::Done(!head);
            }
            let n = line.next.load(Relaxed);
            let n = if n == 0 {
                let Some(n) = self.pool.alloc() else {
                    return Put::Full;
                };
                // A fresh line is all zeros (empty) and reachable by no
                // reader until this Release store.
                line.next.store(n, Release);
                n
            } else {
                n
            };
            line = self.pool.line(n);
            head = false;
        }
    }

    /// Second step of inserting an entry that has a reply key (after its
    /// forward entry is in): under the lock of the reply key's home bucket,
    /// publishes the reply way of pending node `idx` (duplicate check and
    /// chain cap as `put`) and, if that worked, makes the node live, so
    /// that lookups by either key return it only once both are in.
    pub(crate) fn publish_reply<A: Arena + ?Sized>(
        &self,
        arena: &A,
        h: Hash,
        rk: &PackedReply,
        idx: u32,
        cap: usize,
    ) -> Put {
        let (home, mut l) = self.lock_home(h);
        let r = home.put(&mut l, arena, h, Some(rk), idx | REPLY_WAY, cap);
        if matches!(r, Put::Done(_)) {
            arena.node(idx).set_live();
        }
        r
    }

    /// Unpublishes way value `v` from the home of hash `h` (wherever a
    /// resize has moved it); `false` if it is not there.
    pub(crate) fn unpublish(&self, h: Hash, v: u32) -> bool {
        let (home, mut l) = self.lock_home(h);
        home.unput(&mut l, h, v)
    }

    /// Last step of removing an entry that has a reply key, after its
    /// forward way was unpublished (which decided the removal, under that
    /// bucket's lock): under the reply bucket's lock, unpublishes the reply
    /// way and clears the node's live bit. Until then a reply lookup may
    /// still find the entry (the removal has not finished); after it, never.
    /// So a reply bucket holds only reply ways of live or pending nodes.
    pub(crate) fn retire_reply<A: Arena + ?Sized>(&self, arena: &A, h: Hash, idx: u32) -> bool {
        let (home, mut l) = self.lock_home(h);
        let ok = home.unput(&mut l, h, idx | REPLY_WAY);
        arena.node(idx).clear_live();
        ok
    }

    /// Under the lock: unpublishes way value `idx` (node index, with
    /// [`REPLY_WAY`] for a reply entry) filed under hash `h`; `false` if it
    /// is not here.
    pub(crate) fn unput(&self, l: &mut Locked<'_>, h: Hash, idx: u32) -> bool {
        let head = l.b;
        let idx = idx & !CHECK_MASK;
        let Some((line, w)) = self.find_way(l, h.tag, |line, w, v| {
            (v & !CHECK_MASK == idx).then_some((line, w))
        }) else {
            return false;
        };
        let head = std::ptr::eq(line, head);
        line.set_tag(w, 0);
        l.hdr -= 1 << CNT_SHIFT;
        if !head {
            l.hdr -= 1 << OVF_SHIFT;
        }
        // The summary keeps the removed tag's bits until the bucket's next
        // insert remakes it: a superset is all a reader needs, and a store
        // here cost churn a cache miss per remove.
        true
    }

    /// Entries in a bucket's chain (racy read, for statistics).
    pub(crate) fn count(&self, b: usize) -> Option<usize> {
        let h = self.bucket(b).hdr.load(Relaxed);
        (h & MOVED == 0).then_some(((h & CNT_MASK) >> CNT_SHIFT) as usize)
    }

    /// Lock-free: the node indices in bucket `b`'s chain (forward entries
    /// only: reply ways are skipped, so each entry is read once), or `None`
    /// if it moved (look in the successor). A snapshot of ways taken while
    /// writers run: an entry present throughout is in it.
    pub(crate) fn read_bucket(&self, b: usize, out: &mut Vec<u32>) -> bool {
        let bk = self.bucket(b);
        let hdr = bk.hdr.load(Acquire);
        if hdr & MOVED != 0 {
            return false;
        }
        read_line(bk, out);
        if hdr & OVF_MASK != 0 {
            let mut l = bk.next.load(Acquire);
            while l != 0 {
                let line = self.pool.line(l);
                read_line(line, out);
                l = line.next.load(Acquire);
            }
        }
        true
    }

    /// Prefetches the nodes of bucket `b`'s head line.
    #[inline]
    pub(crate) fn prefetch_nodes<A: Arena + ?Sized>(&self, arena: &A, b: usize) {
        let bk = self.bucket(b);
        let (lo, hi) = bk.occupied(Relaxed);
        each_way::<()>(lo, hi, |w| {
            // Acquire: see `prefetch_candidates`.
            arena
                .node(bk.ways[w].load(Acquire) & WAY_IDX)
                .prefetch_all();
            None
        });
    }

    /// Moves bucket `b` into the successor (caller claimed it). `rehash`
    /// gives a way value's hash (a reply way's by its reply key). Returns
    /// the entries moved.
    pub(crate) fn migrate<A: Arena + ?Sized>(
        &self,
        b: usize,
        arena: &A,
        rehash: &impl Fn(u32) -> u64,
    ) -> usize {
        let succ = self.successor().expect("migrate needs a successor");
        let mut l = self.lock_bucket(b);
        if l.moved() {
            return 0;
        }
        let mut moved = 0;
        let mut items = Vec::with_capacity(WAYS);
        self.for_each(&l, |_, _, i| {
            items.push(i);
            true
        });
        for i in items {
            let h = Hash::new(rehash(i));
            let mut nl = succ.lock_bucket(succ.bucket_of(h.hi));
            debug_assert!(!nl.moved());
            // Never refused for the cap: the entry exists already. Only a
            // failed overflow allocation could refuse, and that aborts.
            let r = succ.put::<_, PackedKey>(&mut nl, arena, h, None, i, usize::MAX);
            assert!(matches!(r, Put::Done(_)), "moving an entry during a resize");
            moved += 1;
        }
        // Admit every tag before MOVED is set, so that no reader stops at
        // this summary for a key inserted into the successor later.
        self.summary[b].store(!0, Release);
        l.hdr |= MOVED;
        drop(l);
        self.moved.fetch_add(1, Release);
        moved
    }

    /// Claims the next bucket to move, if any remain.
    pub(crate) fn claim(&self) -> Option<usize> {
        if self.claim.load(Relaxed) >= self.len() {
            return None;
        }
        let b = self.claim.fetch_add(1, Relaxed);
        (b < self.len()).then_some(b)
    }
}

#[inline(always)]
fn scan_line<A: Arena + ?Sized, M: Matcher + ?Sized>(
    line: &Bucket,
    arena: &A,
    h: Hash,
    key: &M,
) -> Option<u32> {
    let (lo, hi) = line.matches(h.tag, Acquire);
    each_way(lo, hi, |w| {
        let v = line.ways[w].load(Acquire);
        if v & CHECK_MASK != h.check {
            return None; // another key: no need to read its node
        }
        let i = way_node::<M>(v)?;
        let n = arena.node(i);
        (key.hit(n) && n.is_live()).then_some(i)
    })
}

fn read_line(line: &Bucket, out: &mut Vec<u32>) {
    let (lo, hi) = line.occupied(Acquire);
    each_way::<()>(lo, hi, |w| {
        let v = line.ways[w].load(Acquire);
        if v & REPLY_WAY == 0 {
            out.push(v & WAY_IDX);
        }
        None
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64.
    fn next(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    #[test]
    fn match_byte_finds_every_match_and_empties_exactly() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..10_000 {
            let x = next(&mut x);
            let tags = x | HI; // every byte a real tag
            let tag = (x >> 8) as u8 | 0x80;
            let m = match_byte(tags, tag);
            assert_eq!(m & !USED, 0, "only bytes of ways that exist");
            for w in 0..LO_WAYS {
                if (tags >> (8 * w)) as u8 == tag {
                    assert!(m & (0x80 << (8 * w)) != 0);
                }
            }
            // Clear some bytes: exactly those are empty.
            let clear = x.rotate_left(17) & 0xFF;
            let mut t2 = tags;
            for w in 0..8 {
                if clear & (1 << w) != 0 {
                    t2 &= !(0xFF << (8 * w));
                }
            }
            let e = match_byte(t2, 0);
            for w in 0..LO_WAYS {
                let empty = (t2 >> (8 * w)) as u8 == 0;
                assert_eq!(e & (0x80 << (8 * w)) != 0, empty);
            }
        }
    }

    #[test]
    fn match_byte32_finds_every_match_and_empties_exactly() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..10_000 {
            let x = next(&mut x);
            // Real tags in the bytes of ways that exist, the top byte 0 as
            // in a bucket line.
            let tags = (x as u32 | HI32) & !(0xFF << 24);
            let tag = (x >> 40) as u8 | 0x80;
            let m = match_byte32(tags, tag);
            assert_eq!(m & !USED_HI, 0, "only bytes of ways that exist");
            for j in 0..HI_WAYS {
                if (tags >> (8 * j)) as u8 == tag {
                    assert!(m & (0x80 << (8 * j)) != 0);
                }
            }
            // A tag that is certainly present: found.
            let t0 = tags as u8;
            assert!(match_byte32(tags, t0) & 0x80 != 0);
            let clear = (x >> 48) as u32 & 0x7;
            let mut t2 = tags;
            for j in 0..3 {
                if clear & (1 << j) != 0 {
                    t2 &= !(0xFF << (8 * j));
                }
            }
            let e = match_byte32(t2, 0);
            for j in 0..HI_WAYS {
                let empty = (t2 >> (8 * j)) as u8 == 0;
                assert_eq!(e & (0x80 << (8 * j)) != 0, empty);
            }
            assert_eq!(e & !USED_HI, 0);
        }
    }

    /// `each_way` visits every flagged way of both words once, the low
    /// word's first, in way order.
    #[test]
    fn each_way_visits_the_ways_of_both_words_in_order() {
        for lo in 0..1u64 << LO_WAYS {
            for hi in 0..1u32 << HI_WAYS {
                let mut lm = 0u64;
                for w in 0..LO_WAYS {
                    if lo & (1 << w) != 0 {
                        lm |= 0x80 << (8 * w);
                    }
                }
                let mut hm = 0u32;
                for j in 0..HI_WAYS {
                    if hi & (1 << j) != 0 {
                        hm |= 0x80 << (8 * j);
                    }
                }
                let mut got = Vec::new();
                let none = each_way::<()>(lm, hm, |w| {
                    got.push(w);
                    None
                });
                assert_eq!(none, None);
                let want: Vec<usize> = (0..WAYS)
                    .filter(|&w| {
                        if w < LO_WAYS {
                            lo & (1 << w) != 0
                        } else {
                            hi & (1 << (w - LO_WAYS)) != 0
                        }
                    })
                    .collect();
                assert_eq!(got, want, "lo {lo:#b} hi {hi:#b}");
                // It stops at the first `Some`.
                if let Some(&last) = want.last() {
                    let mut seen = 0;
                    let r = each_way(lm, hm, |w| {
                        seen += 1;
                        (w == last).then_some(w)
                    });
                    assert_eq!((r, seen), (Some(last), want.len()));
                }
            }
        }
    }

    /// One bucket, more entries than it has ways, some sharing a tag: every
    /// one is found (in the head line, both tag words, or the overflow
    /// line), removed ones are not, freed ways are reused.
    #[test]
    fn a_full_bucket_uses_every_way_of_both_tag_words() {
        use crate::node::Slab;
        use crate::types::*;
        let slab = Slab::new();
        let n = (WAYS + 5) as u32;
        let start = slab.alloc_block(n).unwrap().start;
        let (key, init) = (test_key, test_init());
        // Same bucket (one-bucket index); tags 0x80 + i % 7: entries i and
        // i + 7 share a tag.
        let hash = |i: u32| Hash::new(u64::from(i) << 40 | u64::from(i % 7));
        let ix = Index::try_new(1).unwrap();
        for i in 0..n {
            let idx = start + i;
            let node = slab.node(idx);
            node.init(&key(i), &init, u64::from(idx), Millis(0), 0, false);
            node.set_live();
            let (home, mut l) = ix.lock_home(hash(i));
            let r = home.put(&mut l, &slab, hash(i), Some(&key(i)), idx, 64);
            assert_eq!(r, Put::Done(i as usize >= WAYS), "entry {i}");
        }
        let b = ix.bucket(0);
        // The head line is full: every byte of both words holds a real tag,
        // the high word's top byte none.
        assert_eq!(b.tags.load(Relaxed) & USED, USED);
        assert_eq!(b.tags_hi.load(Relaxed) & USED_HI, USED_HI);
        assert_eq!(b.tags_hi.load(Relaxed) >> (8 * HI_WAYS), 0);
        for w in 0..WAYS {
            assert_eq!(
                b.tag(w, Relaxed),
                hash((b.ways[w].load(Relaxed) & WAY_IDX) - start).tag
            );
        }
        assert_eq!(ix.count(0), Some(WAYS + 5));
        assert_eq!(summary_of_chain(&ix, 0), ix.summary[0].load(Relaxed));
        for i in 0..n {
            assert_eq!(ix.find(&slab, hash(i), &key(i)), Some(start + i), "{i}");
            // Under another tag it is not there (the candidates for that
            // tag are other keys).
            assert_eq!(ix.find(&slab, hash(i + 1), &key(i)), None, "{i}");
        }
        let mut ids = Vec::new();
        assert!(ix.read_bucket(0, &mut ids));
        ids.sort_unstable();
        assert_eq!(ids, (start..start + n).collect::<Vec<_>>());
        // Remove the entries in the high word's ways and two others, one of
        // them in the overflow line.
        let in_way = |w: usize| (b.ways[w].load(Relaxed) & WAY_IDX) - start;
        let mut gone: Vec<u32> = (LO_WAYS..WAYS).map(in_way).collect();
        gone.extend([in_way(0), n - 1]);
        for &i in &gone {
            assert!(ix.unpublish(hash(i), start + i), "{i}");
            assert!(!ix.unpublish(hash(i), start + i), "{i} twice");
        }
        assert_eq!(b.tags_hi.load(Relaxed), 0);
        assert_eq!(ix.count(0), Some(WAYS + 5 - gone.len()));
        let want = summary_of_chain(&ix, 0);
        assert_eq!(ix.summary[0].load(Relaxed) & want, want);
        for i in 0..n {
            let want = (!gone.contains(&i)).then_some(start + i);
            assert_eq!(ix.find(&slab, hash(i), &key(i)), want, "{i}");
        }
        // Put them back: they refill the head line's free ways first.
        for &i in &gone {
            let (home, mut l) = ix.lock_home(hash(i));
            let r = home.put(&mut l, &slab, hash(i), Some(&key(i)), start + i, 64);
            assert!(matches!(r, Put::Done(_)), "{i}: {r:?}");
        }
        assert_eq!(b.tags_hi.load(Relaxed) & USED_HI, USED_HI);
        for i in 0..n {
            assert_eq!(ix.find(&slab, hash(i), &key(i)), Some(start + i), "{i}");
            // Already there: refused.
            let (home, mut l) = ix.lock_home(hash(i));
            let r = home.put(&mut l, &slab, hash(i), Some(&key(i)), start + i, 64);
            assert_eq!(r, Put::Exists(start + i));
        }
        assert_eq!(ix.count(0), Some(WAYS + 5));
        assert_eq!(summary_of_chain(&ix, 0), ix.summary[0].load(Relaxed));
    }

    /// Entry `i`'s key in the tests that fill an index by hand.
    fn test_key(i: u32) -> PackedKey {
        use crate::types::*;
        PackedKey::new(&FlowKey {
            tenant: TenantId(1),
            proto: Proto::Tcp,
            client: std::net::SocketAddr::from(([10, 0, 0, 1], 4000 + i as u16)),
            virt: "10.0.0.100:80".parse().unwrap(),
        })
    }

    /// What those tests' nodes hold besides their key.
    fn test_init() -> crate::types::FlowInit<'static> {
        use crate::types::*;
        FlowInit {
            service: ServiceId(1),
            backend: BackendId(2),
            state: FlowState::Established,
            owner: 0,
            profile: crate::types::ProfileRef::NONE,
        }
    }

    /// The union of the summary bits of bucket `b`'s chain, read way by way
    /// (single-threaded tests only).
    fn summary_of_chain(ix: &Index, b: usize) -> u64 {
        let mut m = 0;
        let mut line = ix.bucket(b);
        loop {
            for w in 0..WAYS {
                let t = line.tag(w, Relaxed);
                if t != 0 {
                    m |= sum_bits(t, line.ways[w].load(Relaxed));
                }
            }
            match line.next.load(Relaxed) {
                0 => return m,
                n => line = ix.pool.line(n),
            }
        }
    }

    #[test]
    fn sum_bits_are_three_bits_for_tags_and_none_for_empty_ways() {
        for g in 0..8u32 {
            let v = g << CHECK_SHIFT | 5;
            for t in 0..=255u8 {
                let want = if t & 0x80 != 0 { 3 } else { 0 };
                assert_eq!(sum_bits(t, v).count_ones(), want, "tag {t:#x}, check {g}");
            }
            // Distinct tags, distinct bits (else they never tell apart).
            let mut seen: Vec<u64> = (0x80..=0xFF).map(|t| sum_bits(t, v)).collect();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), 128, "check {g}");
        }
        // The check bits choose the mask too: a tag collision is told
        // apart by the summary seven times in eight.
        let mut seen: Vec<u64> = (0..8u32)
            .map(|g| sum_bits(0x85, g << CHECK_SHIFT))
            .collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 8);
    }

    /// Model test of the summaries: through random inserts and removes
    /// (overflow lines included) every bucket's summary holds the union of
    /// its chain's tag bits, exactly so after each insert, so every present
    /// key passes it; after a resize moved them, old summaries admit
    /// everything and the successor's hold its entries. And it earns its place: at the table's
    /// target load (8.25 entries per bucket) it turns most misses away
    /// before the bucket line is read.
    #[test]
    fn summaries_cover_every_entry_under_inserts_removes_and_moves() {
        use crate::node::Slab;
        use crate::types::*;
        const BUCKETS: usize = 64;
        const KEYS: u32 = 1100; // ~17 per bucket at the peak: overflow lines
        let slab = Slab::new();
        let start = slab.alloc_block(KEYS).unwrap().start;
        let (key, init) = (test_key, test_init());
        // splitmix64's finaliser: well spread over buckets and tags.
        let mix = |i: u32| {
            let mut z = u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let hash = |i: u32| Hash::new(mix(i));
        for i in 0..KEYS {
            let node = slab.node(start + i);
            node.init(&key(i), &init, u64::from(start + i), Millis(0), 0, false);
            node.set_live();
        }
        let ix = Index::try_new(BUCKETS).unwrap();
        let mut present = vec![false; KEYS as usize];
        let mut rng = 0x1234_5678_9ABC_DEF1u64;
        // A summary holds every present way's bits (more only for ways
        // removed since the bucket's last insert, which remakes it).
        let check = |ix: &Index, present: &[bool]| {
            for b in 0..ix.len() {
                let (want, got) = (summary_of_chain(ix, b), ix.summary[b].load(Relaxed));
                assert_eq!(got & want, want, "bucket {b}");
            }
            for (i, &p) in present.iter().enumerate() {
                let i = i as u32;
                let want = p.then_some(start + i);
                assert_eq!(ix.find(&slab, hash(i), &key(i)), want, "key {i}");
            }
        };
        for round in 0..40 {
            for _ in 0..200 {
                let i = (next(&mut rng) % u64::from(KEYS)) as u32;
                // Fill up in the first rounds, then churn around half.
                let insert = if round < 5 {
                    true
                } else {
                    next(&mut rng).is_multiple_of(2)
                };
                let (home, mut l) = ix.lock_home(hash(i));
                if insert && !present[i as usize] {
                    let r = home.put(&mut l, &slab, hash(i), Some(&key(i)), start + i, 1024);
                    assert!(matches!(r, Put::Done(_)), "{r:?}");
                    present[i as usize] = true;
                    // An insert remakes its bucket's summary exactly.
                    let b = home.bucket_of(hash(i).hi);
                    assert_eq!(home.summary[b].load(Relaxed), summary_of_chain(home, b));
                } else if !insert && present[i as usize] {
                    assert!(home.unput(&mut l, hash(i), start + i));
                    present[i as usize] = false;
                }
            }
            check(&ix, &present);
        }
        // A resize moves every bucket; the old summaries admit every tag.
        let succ = Arc::new(Index::try_new(2 * BUCKETS).unwrap());
        assert!(ix.set_successor(succ.clone()));
        while let Some(b) = ix.claim() {
            ix.migrate(b, &slab, &|v| mix((v & WAY_IDX) - start));
            assert_eq!(ix.summary[b].load(Relaxed), !0);
        }
        check(&succ, &present);
        for (i, &p) in present.iter().enumerate() {
            let i = i as u32;
            assert_eq!(ix.find(&slab, hash(i), &key(i)), p.then_some(start + i));
        }

        // Turned away: absent keys at 8.25 entries per bucket.
        let full = Index::try_new(BUCKETS).unwrap();
        let per = (8.25 * BUCKETS as f64) as u32;
        for i in 0..per {
            let (home, mut l) = full.lock_home(hash(i));
            let r = home.put(&mut l, &slab, hash(i), None::<&PackedKey>, start + i, 1024);
            assert!(matches!(r, Put::Done(_)));
        }
        let probes = 100_000u32;
        let admitted = (0..probes)
            .filter(|&p| {
                let h = Hash::new(mix(KEYS + p));
                full.admits(full.bucket_of(h.hi), h)
            })
            .count();
        // ~4% expected (a summary of the tags alone admits ~10%, 6% of
        // them tag collisions); one that stopped narrowing would admit far
        // more.
        assert!(
            admitted < probes as usize * 7 / 100,
            "{admitted} of {probes} absent keys admitted"
        );
    }

    /// An arena that counts the nodes looked at.
    struct Counting<'a>(&'a crate::node::Slab, std::cell::Cell<usize>);

    impl Arena for Counting<'_> {
        fn node(&self, i: u32) -> Node<'_> {
            self.1.set(self.1.get() + 1);
            self.0.node(i)
        }
    }

    /// Check bits: every way value carries bits 8-10 of its key's hash
    /// (also after a resize moved it and with the reply bit), and a lookup
    /// whose tag matches a way reads that way's node only if they match
    /// too; removal finds its way whatever they are.
    #[test]
    fn check_bits_spare_the_node_read_of_a_tag_collision() {
        use crate::node::Slab;
        let slab = Slab::new();
        let start = slab.alloc_block(8).unwrap().start;
        // One bucket, one tag (0x85), check bits i: 0..8.
        let hash = |i: u32| Hash::new(0x4000_0000_0000_0005 | u64::from(i) << 8);
        let ix = Index::try_new(1).unwrap();
        for i in 0..4 {
            let node = slab.node(start + i);
            node.init(
                &test_key(i),
                &test_init(),
                u64::from(start + i),
                crate::types::Millis(0),
                0,
                false,
            );
            node.set_live();
            let (home, mut l) = ix.lock_home(hash(i));
            let r = home.put(&mut l, &slab, hash(i), Some(&test_key(i)), start + i, 64);
            assert_eq!(r, Put::Done(false));
        }
        let b = ix.bucket(0);
        for w in 0..4 {
            let v = b.ways[w].load(Relaxed);
            let i = (v & WAY_IDX) - start;
            assert_eq!(v & CHECK_MASK, hash(i).check, "way {w}");
            assert_eq!(v & REPLY_WAY, 0);
        }
        let count = Counting(&slab, std::cell::Cell::new(0));
        // Absent keys under the shared tag: check bits 4..8 match no way,
        // so no node is read; under an entry's check bits, only its node.
        for i in 4..8 {
            assert_eq!(ix.find(&count, hash(i), &test_key(i)), None);
        }
        assert_eq!(count.1.get(), 0, "nodes read for check-bit misses");
        assert_eq!(ix.find(&count, hash(2), &test_key(6)), None);
        assert_eq!(count.1.get(), 1);
        for i in 0..4 {
            assert_eq!(ix.find(&slab, hash(i), &test_key(i)), Some(start + i));
        }
        // Moved by a resize, the ways keep their bits.
        let succ = Arc::new(Index::try_new(3).unwrap());
        assert!(ix.set_successor(succ.clone()));
        while let Some(bk) = ix.claim() {
            ix.migrate(bk, &slab, &|v| {
                0x4000_0000_0000_0005 | u64::from((v & WAY_IDX) - start) << 8
            });
        }
        let sb = succ.bucket(succ.bucket_of(hash(0).hi));
        for w in 0..4 {
            let v = sb.ways[w].load(Relaxed);
            assert_eq!(
                v & CHECK_MASK,
                hash((v & WAY_IDX) - start).check,
                "moved way {w}"
            );
        }
        for i in 0..4 {
            assert_eq!(succ.find(&slab, hash(i), &test_key(i)), Some(start + i));
            assert!(succ.unpublish(hash(i), start + i), "remove {i}");
            assert_eq!(succ.find(&slab, hash(i), &test_key(i)), None);
        }
    }

    /// A reply way and a forward way of the same node under the same hash
    /// (bucket and tag): each kind of lookup takes only its own kind of
    /// way, even where the node would match the other kind's key.
    #[test]
    fn the_reply_bit_is_part_of_the_match() {
        use crate::node::Slab;
        use crate::types::*;
        let slab = Slab::new();
        let idx = slab.alloc_block(1).unwrap().start;
        let key = FlowKey {
            tenant: TenantId(1),
            proto: Proto::Tcp,
            client: "10.0.0.1:4000".parse().unwrap(),
            virt: "10.0.0.100:80".parse().unwrap(),
        };
        let init = FlowInit {
            service: ServiceId(1),
            backend: BackendId(2),
            state: FlowState::Established,
            owner: 0,
            profile: crate::types::ProfileRef::NONE,
        };
        let pk = PackedKey::new(&key);
        let n = slab.node(idx);
        n.init(
            &pk,
            &init,
            crate::table::next_cookie(0, idx),
            crate::types::Millis(0),
            0,
            true,
        );
        n.set_live();
        let rk = n.reply_key();
        assert_eq!(
            rk,
            PackedReply::new(&ReplyKey {
                tenant: TenantId(1),
                proto: Proto::Tcp,
                backend: BackendId(2),
                dst: ReplyDst::Client(key.client),
            })
        );
        assert!(n.matches(&pk) && n.matches_reply(&rk));
        let ix = Index::try_new(1).unwrap();
        let h = Hash::new(0x1234_5678_9abc_def0);
        // Only the reply way: a forward lookup misses, a reply lookup hits.
        assert_eq!(ix.publish_reply(&slab, h, &rk, idx, 8), Put::Done(false));
        assert_eq!(ix.find(&slab, h, &pk), None);
        assert_eq!(ix.find(&slab, h, &rk), Some(idx));
        // A second reply way for the same reply key is refused.
        assert_eq!(ix.publish_reply(&slab, h, &rk, idx, 8), Put::Exists(idx));
        // Only the forward way: the other way round.
        assert!(ix.unpublish(h, idx | REPLY_WAY));
        {
            let (home, mut l) = ix.lock_home(h);
            let r = home.put(&mut l, &slab, h, Some(&pk), idx, 8);
            assert_eq!(r, Put::Done(false));
        }
        assert_eq!(ix.find(&slab, h, &rk), None);
        assert_eq!(ix.find(&slab, h, &pk), Some(idx));
        // Dump reads list the node once with both ways in.
        assert_eq!(ix.publish_reply(&slab, h, &rk, idx, 8), Put::Done(false));
        let mut ids = Vec::new();
        assert!(ix.read_bucket(0, &mut ids));
        assert_eq!(ids, [idx]);
        assert_eq!(ix.count(0), Some(2));
        // Retiring the reply way clears the live bit: found by neither key.
        assert!(ix.retire_reply(&slab, h, idx));
        assert!(!n.is_live());
        assert_eq!(ix.find(&slab, h, &rk), None);
        assert_eq!(ix.find(&slab, h, &pk), None);
        assert_eq!(ix.count(0), Some(1));
    }

    #[test]
    fn pool_locate_is_contiguous() {
        let mut expect = (0usize, 0usize);
        for i in 0..100_000u32 {
            let (c, off, len) = pool_locate(i);
            if off == 0 && i != 0 {
                expect = (expect.0 + 1, 0);
            }
            assert_eq!((c, off), expect, "line {i}");
            assert!(off < len);
            expect.1 += 1;
        }
    }

    #[test]
    fn bucket_ranges_tile_the_hash_space() {
        for n in [1usize, 2, 3, 7, 1000, 1 << 20, 12_345_677] {
            let ix = Index {
                buckets: HugeArray::zeroed(1).unwrap(),
                summary: HugeArray::zeroed(1).unwrap(),
                n: n as u64,
                pool: Pool::new(),
                successor: OnceLock::new(),
                claim: AtomicUsize::new(0),
                moved: AtomicUsize::new(0),
            };
            assert_eq!(ix.bucket_start(0), 0);
            assert_eq!(ix.bucket_start(n), 1 << 32);
            for b in [0, n / 2, n - 1] {
                let s = ix.bucket_start(b);
                assert_eq!(ix.bucket_of(s as u32), b);
                if s > 0 {
                    assert_eq!(ix.bucket_of((s - 1) as u32), b - 1);
                }
            }
        }
    }
}
