//! One hash table (the shared one or a tenant's own): its current bucket
//! index (replaced by a successor when it resizes), the keyed hash, entry
//! counters; and the per-thread node caches (allocation, recycling, cookies,
//! entries waiting to be filed in an expiry wheel) shared by all tables of a
//! `FlowTable`.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering::Relaxed};

use crossbeam_epoch::Guard;
use crossbeam_utils::CachePadded;
use parking_lot::Mutex;

use crate::index::{BUCKET_BYTES, Hash, Index, WAYS};
use crate::node::{Arena, IDX_BITS, NIL, Node, PackedKey, Slab};
use crate::raw::EpochCell;

/// Node indices recycled after their grace period, shared by all tables.
#[derive(Debug, Default)]
pub(crate) struct FreePool {
    pub(crate) free: Mutex<Vec<u32>>,
}

/// Nodes moved between a node cache and the pool/slab at once.
const BATCH: usize = 64;
/// Node caches per `FlowTable` (threads map onto them round-robin).
pub(crate) const NODE_CACHES: usize = 8;

/// A thread's cache of free node indices, of removed nodes waiting for their
/// grace period, and of inserted nodes not yet filed in their
/// tenant's expiry wheel. One per thread slot ([`thread_slot`]): a freed
/// node is reused a grace period plus at most 2 x 64 of the thread's own
/// operations later, while its lines are still cached.
#[derive(Debug)]
pub(crate) struct NodeCache {
    free: Vec<u32>,
    pending: Vec<u32>,
    /// Inserted (or re-stated) nodes not yet filed, as [`filing_ref`]s.
    pub(crate) new_nodes: Vec<u32>,
    compact_at: usize,
    /// A refile was pushed since the list was last sorted or taken.
    maybe_dups: bool,
}

impl Default for NodeCache {
    fn default() -> Self {
        NodeCache {
            free: Vec::new(),
            pending: Vec::new(),
            new_nodes: Vec::new(),
            compact_at: 1024,
            maybe_dups: false,
        }
    }
}

/// This thread's node-cache slot (threads numbered in order of first use).
#[inline]
pub(crate) fn thread_slot() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local!(static SLOT: usize = NEXT.fetch_add(1, Relaxed));
    SLOT.with(|s| *s) % NODE_CACHES
}

/// A to-be-filed reference: the node index plus the low 4 bits of the
/// entry's cookie, so that compaction and filing can tell a reference to the
/// entry it was pushed for from a stale one whose index was recycled. One
/// stale reference in 16 slips through; it only makes a duplicate wheel
/// reference, which expiry tolerates (slot check).
#[inline]
pub(crate) fn filing_ref(idx: u32, cookie: u64) -> u32 {
    idx | (((cookie >> IDX_BITS) as u32) << IDX_BITS)
}

/// Uses of one node a cookie counts before it wraps (2^28 - 1).
const COOKIE_USES: u64 = (1 << 28) - 1;

/// The cookie of the next entry at node `idx`, whose previous entry had
/// cookie `prev` (0 for a node never used): the node's index in the low 28
/// bits and the node's use count (1 ..= 2^28 - 1) above them. So a cookie
/// names its node ([`cookie_idx`]: `weir kill COOKIE` is one node read, not
/// a search), it is never 0, it stays below 2^56 (the daemon's owner word
/// keeps 8 bits beside it), and it is unique until one node has been used
/// 268 million times.
pub(crate) fn next_cookie(prev: u64, idx: u32) -> u64 {
    let uses = (prev >> IDX_BITS) % COOKIE_USES + 1;
    uses << IDX_BITS | u64::from(idx)
}

/// The node a cookie was made for (see [`next_cookie`]); the node's own
/// cookie and live bit say whether the entry is still there.
#[inline]
pub(crate) fn cookie_idx(cookie: u64) -> u32 {
    (cookie as u32) & NIL
}

/// The node index of a [`filing_ref`].
#[inline]
pub(crate) fn ref_idx(r: u32) -> u32 {
    r & NIL
}

/// Whether `n` (at [`ref_idx`]`(r)`) is live and still the entry `r` was
/// made for (up to the 4 cookie bits).
#[inline]
pub(crate) fn ref_current(r: u32, n: Node<'_>) -> bool {
    n.is_live() && filing_ref(0, n.cookie()) == r & !NIL
}

impl NodeCache {
    /// A free node index, refilling from the pool (most recently freed
    /// first) or the slab in batches.
    pub(crate) fn alloc(&mut self, slab: &Slab, pool: &FreePool) -> Option<u32> {
        if self.free.is_empty() {
            {
                let mut p = pool.free.lock();
                let take = p.len().min(BATCH);
                let at = p.len() - take;
                self.free.extend(p.drain(at..));
            }
            if self.free.is_empty() {
                self.free.extend(slab.alloc_block(BATCH as u32)?.rev());
            }
        }
        self.free.pop()
    }

    /// Gives back a node that was never published.
    pub(crate) fn unalloc(&mut self, idx: u32) {
        self.free.push(idx);
    }

    /// A removed node: recycled once every reader that might still be on it
    /// has unpinned (batched: one deferred closure per `BATCH` nodes).
    pub(crate) fn retire(&mut self, idx: u32, guard: &Guard, pool: &Arc<FreePool>) {
        self.pending.push(idx);
        if self.pending.len() >= BATCH {
            let batch = std::mem::replace(&mut self.pending, Vec::with_capacity(BATCH));
            let pool = Arc::clone(pool);
            guard.defer(move || pool.free.lock().extend(batch));
            // Hand the batch to the global queue now and collect expired
            // ones. Without this it waited in this thread's bag of deferred
            // functions until 64 closures had piled up: up to 4,096 removed
            // nodes per removing thread unavailable for reuse, so under
            // steady churn with a few hundred live entries the slab's
            // high-water mark (its chunks are never freed) passed 8 Ki nodes
            // within two minutes, 1.3 MiB of chunks (docs/BENCHMARKS.md,
            // soak; tests/recycle.rs). Now a node is
            // reusable a grace period after its batch fills. The deferred
            // functions of this crate take no lock but the pool's, which is
            // not held here.
            guard.flush();
        }
    }

    /// Records a new entry (node `idx`, `cookie`) for filing in its
    /// tenant's wheel. See [`compact`](Self::compact) for the list's bound.
    #[inline]
    pub(crate) fn push_new(&mut self, idx: u32, cookie: u64, slab: &Slab) {
        self.new_nodes.push(filing_ref(idx, cookie));
        if self.new_nodes.len() >= self.compact_at {
            self.compact(slab);
        }
    }

    /// Records an entry already filed, or already on a list, for filing
    /// again (its state, hence its timeout, changed): the one way a list
    /// gets duplicate references.
    #[inline]
    pub(crate) fn push_refile(&mut self, idx: u32, cookie: u64, slab: &Slab) {
        self.maybe_dups = true;
        self.push_new(idx, cookie, slab);
    }

    /// Keeps the list O(live entries) if expiry does not run for a while
    /// (amortised O(1) per push): stale references are dropped, then
    /// duplicates (a sort) if refiles may have made some and dropping stale
    /// ones did not halve the list; the next compaction is at twice the
    /// length left (at least 1024).
    ///
    /// The bound. A compaction that halves the list moves the next one no
    /// further out. One that sorts leaves at most one reference per live
    /// node. One that does neither ran with no refile since the last sort:
    /// each node's references since then come from distinct inserts, whose
    /// 4 cookie bits ([`filing_ref`]) differ for 16 in a row, so at most
    /// `1 + n/16` of a node's `n` references look current; then at most 2 x
    /// live + length / 16 remain, and the length stays under ~4.6 x live +
    /// 1024. Under churn with no expiry pass (most references stale, as
    /// in `weir-bench table`'s churn) this never sorts; sorting the list of
    /// a million-entry table at every doubling was ~25% of an insert +
    /// remove pair's instructions.
    fn compact(&mut self, slab: &Slab) {
        let before = self.new_nodes.len();
        self.new_nodes
            .retain(|&r| ref_current(r, slab.node(ref_idx(r))));
        if self.maybe_dups && self.new_nodes.len() > before / 2 {
            self.new_nodes.sort_unstable();
            self.new_nodes.dedup();
            self.maybe_dups = false;
        }
        self.compact_at = (self.new_nodes.len() * 2).max(1024);
    }

    pub(crate) fn take_new(&mut self) -> Vec<u32> {
        self.compact_at = 1024;
        self.maybe_dups = false;
        std::mem::take(&mut self.new_nodes)
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        4 * (self.free.capacity() + self.pending.capacity() + self.new_nodes.capacity())
    }
}

/// Target load when sizing an index: entries per way.
const LOAD: f64 = 0.75;
/// Grow (x2) past this load.
const GROW_AT: f64 = 0.875;
/// Shrink (/2) below this load, never under the starting size.
const SHRINK_AT: f64 = 0.2;
/// Buckets an insert or remove moves while a resize runs.
const HELP: usize = 2;

/// Buckets for `entries` at the target load.
pub(crate) fn buckets_for(entries: usize) -> usize {
    ((entries as f64 / (WAYS as f64 * LOAD)).ceil() as usize).max(1)
}

/// A hash table.
#[derive(Debug)]
pub(crate) struct Table {
    /// Dump order: 0 for the shared table, tenant id + 1 for own tables.
    pub(crate) order: u64,
    cur: EpochCell<Arc<Index>>,
    hash: crate::hash::KeyedHash,
    pub(crate) max_chain: usize,
    /// Entries and reply index entries, one shard per thread slot.
    entries: Box<[CachePadded<[AtomicI64; 2]>]>,
    min_buckets: usize,
    max_buckets: usize,
    /// Entries the table may hold: inserts past it are refused.
    max_entries: usize,
    /// Serialises starting and finishing resizes.
    resize: Mutex<()>,
    pub(crate) resizes: AtomicU64,
    /// An own table is on the flow table's maintenance queue (written to
    /// since `maintain` last looked at it, or resizing).
    pub(crate) queued: std::sync::atomic::AtomicBool,
}

/// Snapshot of chain statistics.
#[derive(Debug)]
pub(crate) struct ChainStats {
    pub(crate) hist: Vec<u64>,
    pub(crate) entries: u64,
    pub(crate) replies: u64,
    pub(crate) max_chain: usize,
    pub(crate) buckets: usize,
}

impl Table {
    /// Bytes a table sized for `entries` needs at first.
    pub(crate) fn bytes_for(entries: usize) -> usize {
        buckets_for(entries) * BUCKET_BYTES
    }

    /// A table sized for `entries` that may grow to `max_entries`; `None` if
    /// the bucket array cannot be allocated.
    pub(crate) fn try_new(
        order: u64,
        entries: usize,
        max_entries: usize,
        max_chain: usize,
        keys: (u64, u64),
    ) -> Option<Table> {
        let n = buckets_for(entries);
        let ix = Index::try_new(n)?;
        Some(Table {
            order,
            cur: EpochCell::new(Arc::new(ix)),
            hash: crate::hash::KeyedHash::new(keys.0, keys.1),
            max_chain,
            entries: (0..NODE_CACHES).map(|_| CachePadded::default()).collect(),
            min_buckets: n,
            max_buckets: buckets_for(max_entries).max(n),
            max_entries: max_entries.max(entries),
            resize: Mutex::new(()),
            resizes: AtomicU64::new(0),
            queued: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The current index (follow `successor` for buckets that moved).
    #[inline]
    pub(crate) fn index<'g>(&'g self, guard: &'g Guard) -> &'g Index {
        self.cur.load(guard)
    }

    /// Keyed hash (see `hash.rs`) of the full key, salted with the tenant's
    /// salt (which stands for the tenant: distinct salts per tenant).
    #[inline]
    pub(crate) fn hash(&self, k: &PackedKey, salt: u64) -> Hash {
        Hash::new(self.hash_raw(k, salt))
    }

    #[inline]
    pub(crate) fn hash_raw(&self, k: &PackedKey, salt: u64) -> u64 {
        self.hash.hash5([
            salt ^ (u64::from(k.ports) << 32 | u64::from(k.bits)),
            k.caddr[0],
            k.caddr[1],
            k.vaddr[0],
            k.vaddr[1],
        ])
    }

    pub(crate) fn add_entries(&self, d: i64) {
        self.entries[thread_slot()][0].fetch_add(d, Relaxed);
    }

    /// Reply index entries (an entry inserted with a reply key has two
    /// index entries: they count for the load).
    pub(crate) fn add_replies(&self, d: i64) {
        self.entries[thread_slot()][1].fetch_add(d, Relaxed);
    }

    pub(crate) fn replies(&self) -> u64 {
        let n: i64 = self.entries.iter().map(|c| c[1].load(Relaxed)).sum();
        n.max(0) as u64
    }

    /// Whether the table holds its cap of entries (`max_entries`, or the
    /// starting size if larger): an insert must be refused. The shards are
    /// summed only once the newest index has its largest size (below it the
    /// table is far from its cap, or still growing), so inserts pay for the
    /// sum only near the cap. Concurrent inserts may overshoot it by the
    /// inserts in flight. A table that the memory budget keeps from growing
    /// is bounded by its chain cap instead.
    pub(crate) fn at_cap(&self, guard: &Guard) -> bool {
        let ix = self.index(guard);
        let newest = ix.successor().map_or(ix.len(), |s| s.len());
        newest >= self.max_buckets && self.entries() >= self.max_entries as u64
    }

    pub(crate) fn entries(&self) -> u64 {
        let n: i64 = self.entries.iter().map(|c| c[0].load(Relaxed)).sum();
        n.max(0) as u64
    }

    /// Starts a resize if the load asks for one (and none runs). `grow_ok`
    /// says whether memory may be added (budget, which it takes);
    /// `give_back` returns what it took if the resize does not start after
    /// all (another started meanwhile, or the allocation failed).
    pub(crate) fn maybe_resize(
        &self,
        guard: &Guard,
        grow_ok: impl Fn(usize) -> bool,
        give_back: impl Fn(usize),
    ) -> bool {
        let ix = self.index(guard);
        if ix.successor().is_some() {
            return false;
        }
        let n = ix.len();
        let load = (self.entries() + self.replies()) as f64 / (n * WAYS) as f64;
        let target = if load > GROW_AT && n < self.max_buckets {
            (n * 2).min(self.max_buckets)
        } else if load < SHRINK_AT && n > self.min_buckets {
            (n / 2).max(self.min_buckets)
        } else {
            return false;
        };
        let more = if target > n {
            (target - n) * BUCKET_BYTES
        } else {
            0
        };
        if more != 0 && !grow_ok(more) {
            return false;
        }
        let started = self.start_resize(guard, target);
        if !started && more != 0 {
            give_back(more);
        }
        started
    }

    /// Starts moving to an index of `buckets` buckets; `false` if a resize
    /// runs already or the allocation fails.
    pub(crate) fn start_resize(&self, guard: &Guard, buckets: usize) -> bool {
        let _g = self.resize.lock();
        let ix = self.index(guard);
        if ix.successor().is_some() {
            return false;
        }
        let Some(next) = Index::try_new(buckets) else {
            return false;
        };
        ix.set_successor(Arc::new(next))
    }

    /// Moves up to `budget` buckets of a running resize and finishes it when
    /// all moved. Returns the buckets moved.
    pub(crate) fn help_resize<A: Arena + ?Sized>(
        &self,
        guard: &Guard,
        arena: &A,
        budget: usize,
        rehash: &impl Fn(u32) -> u64,
    ) -> usize {
        let ix = self.index(guard);
        let Some(succ) = ix.successor() else {
            return 0;
        };
        let mut done = 0;
        while done < budget {
            let Some(b) = ix.claim() else { break };
            ix.migrate(b, arena, rehash);
            done += 1;
        }
        if ix.fully_moved() {
            let _g = self.resize.lock();
            let now = self.index(guard);
            if std::ptr::eq(now, ix) {
                self.cur.replace(Arc::clone(succ), guard);
                self.resizes.fetch_add(1, Relaxed);
            }
        }
        done
    }

    /// Whether a resize is running.
    pub(crate) fn resizing(&self, guard: &Guard) -> bool {
        self.index(guard).successor().is_some()
    }

    /// Buckets an insert moves while a resize runs.
    pub(crate) const HELP: usize = HELP;

    /// Bucket counts: all buckets up to 2^20, else an even sample of 2^20
    /// of them scaled up. During a resize, the old index's buckets not yet
    /// moved plus all of the successor's, and `buckets` says how many that
    /// is (so the histogram always sums to `buckets`).
    pub(crate) fn chain_stats(&self, guard: &Guard) -> ChainStats {
        let mut hist = vec![0u64; self.max_chain + 1];
        let mut counted = 0u64;
        let mut add = |ix: &Index| {
            let n = ix.len();
            let step = n.div_ceil(1 << 20).max(1);
            let mut b = 0;
            while b < n {
                if let Some(c) = ix.count(b) {
                    let c = c.min(self.max_chain);
                    hist[c] += step as u64;
                    counted += step as u64;
                }
                b += step;
            }
        };
        let ix = self.index(guard);
        add(ix);
        let buckets = match ix.successor() {
            Some(s) => {
                add(s);
                counted as usize
            }
            None => ix.len(),
        };
        let max_chain = hist.iter().rposition(|&c| c != 0).unwrap_or(0);
        hist.truncate(max_chain + 1);
        ChainStats {
            hist,
            entries: self.entries(),
            replies: self.replies(),
            max_chain,
            buckets,
        }
    }

    /// [`chain_stats`](Self::chain_stats) without reading a bucket: the
    /// counts and the bucket count only (no histogram, `max_chain` 0).
    pub(crate) fn counts_only(&self, guard: &Guard) -> ChainStats {
        let ix = self.index(guard);
        ChainStats {
            hist: Vec::new(),
            entries: self.entries(),
            replies: self.replies(),
            max_chain: 0,
            buckets: ix.len(),
        }
    }

    pub(crate) fn memory_bytes(&self, guard: &Guard) -> usize {
        let ix = self.index(guard);
        ix.bytes() + ix.successor().map_or(0, |s| s.bytes())
    }
}
