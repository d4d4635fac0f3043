//! One hash table (the shared one or a tenant's own): bucket heads, lock
//! stripes, the keyed hash and chain statistics; and the per-thread node
//! caches (allocation/recycling) shared by all tables of a `FlowTable`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

use crossbeam_epoch::Guard;
use crossbeam_utils::CachePadded;
use parking_lot::{Mutex, MutexGuard};

use crate::node::{Arena, BLOOM_BITS, IDX_BITS, NIL, Node, PackedKey, Slab};
use crate::raw::HugeArray;
use crate::sync::AtomicU32;

/// Node indices recycled after their grace period, shared by all tables.
#[derive(Debug, Default)]
pub(crate) struct FreePool {
    pub(crate) free: Mutex<Vec<u32>>,
}

/// Nodes moved between a node cache and the pool/slab at once.
const BATCH: usize = 64;
/// Node caches per `FlowTable` (threads map onto them round-robin).
pub(crate) const NODE_CACHES: usize = 8;

/// A thread's cache of free node indices and of unlinked nodes waiting for
/// their grace period. One per thread slot ([`thread_slot`]), not per lock
/// stripe: with 256 stripes, a per-stripe cache handed a freed node back
/// only after ~16 k other operations (64 removes, then 64 inserts, in the
/// same stripe), long after its lines left the cache, so every insert's
/// `Node::init` missed on 2-3 lines. A per-thread cache reuses a node a
/// grace period plus at most 2 x 64 of the thread's own operations later.
#[derive(Debug, Default)]
pub(crate) struct NodeCache {
    /// Free node indices.
    free: Vec<u32>,
    /// Unlinked nodes waiting to be retired to the pool in one batch.
    pending: Vec<u32>,
}

/// This thread's node-cache slot (threads numbered in order of first use).
#[inline]
pub(crate) fn thread_slot() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local!(static SLOT: usize = NEXT.fetch_add(1, Relaxed));
    SLOT.with(|s| *s) % NODE_CACHES
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

    /// An unlinked node: recycled once every reader that might still be on
    /// it has unpinned (batched: one deferred closure per `BATCH` nodes).
    pub(crate) fn retire(&mut self, idx: u32, guard: &Guard, pool: &Arc<FreePool>) {
        self.pending.push(idx);
        if self.pending.len() >= BATCH {
            // A full-size replacement (`take` would leave an empty Vec that
            // reallocates 5 times on the way back to `BATCH`).
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

    pub(crate) fn memory_bytes(&self) -> usize {
        4 * (self.free.capacity() + self.pending.capacity())
    }
}
/// Cookies a stripe reserves from the global counter at once.
const COOKIE_BLOCK: u64 = 256;
/// Default lock stripes of a table (fewer if it has fewer buckets).
pub(crate) const DEFAULT_STRIPES: usize = 256;

/// A to-be-filed reference: the node index plus the low 6 bits of the
/// entry's cookie, so that compaction and filing can tell a reference to the
/// entry it was pushed for from a stale one whose index was recycled (fast,
/// per-thread recycling makes those common). One stale reference in 64
/// slips through; it only makes a duplicate wheel reference, which expiry
/// tolerates (slot check).
#[inline]
pub(crate) fn filing_ref(idx: u32, cookie: u64) -> u32 {
    idx | ((cookie as u32) << IDX_BITS)
}

/// The node index of a [`filing_ref`].
#[inline]
pub(crate) fn ref_idx(r: u32) -> u32 {
    r & NIL
}

/// Whether `n` (at [`ref_idx`]`(r)`) is live and still the entry `r` was
/// made for (up to the 6 cookie bits).
#[inline]
pub(crate) fn ref_current(r: u32, n: &Node) -> bool {
    n.is_live() && filing_ref(0, n.cookie()) == r & !NIL
}

/// Writer-side state of one lock stripe (buckets `b` with `b & mask == i`).
#[derive(Debug)]
pub(crate) struct StripeState {
    /// Inserted (or re-stated) nodes not yet filed in their tenant's wheel,
    /// as [`filing_ref`]s.
    pub(crate) new_nodes: Vec<u32>,
    compact_at: usize,
    cookie_next: u64,
    cookie_end: u64,
    /// `hist[n]` = buckets of this stripe holding `n` entries.
    hist: Box<[u64]>,
}

/// A lock stripe.
#[derive(Debug)]
pub(crate) struct Stripe {
    lock: Mutex<StripeState>,
    /// `new_nodes.len()`, readable without the lock (expiry skips empty stripes).
    new_hint: AtomicUsize,
}

/// A hash table.
#[derive(Debug)]
pub(crate) struct Table {
    /// Dump order: 0 for the shared table, tenant id + 1 for own tables.
    pub(crate) order: u64,
    heads: HugeArray<AtomicU32>,
    mask: u64,
    stripes: Box<[CachePadded<Stripe>]>,
    stripe_mask: usize,
    hash: crate::hash::KeyedHash,
    pub(crate) max_chain: usize,
}

/// Where a key lives in a table.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Loc {
    pub(crate) bucket: usize,
    pub(crate) stripe: usize,
    /// Bloom bit of the key in its bucket head.
    pub(crate) tag: u32,
}

/// Snapshot of chain statistics.
#[derive(Debug)]
pub(crate) struct ChainStats {
    pub(crate) hist: Vec<u64>,
    pub(crate) entries: u64,
    pub(crate) max_chain: usize,
}

impl StripeState {
    /// Next cookie: increasing within the stripe (hence within each chain),
    /// unique across the whole `FlowTable` (blocks come from one counter).
    pub(crate) fn next_cookie(&mut self, global: &AtomicU64) -> u64 {
        if self.cookie_next == self.cookie_end {
            self.cookie_next = global.fetch_add(COOKIE_BLOCK, Relaxed);
            self.cookie_end = self.cookie_next + COOKIE_BLOCK;
        }
        let c = self.cookie_next;
        self.cookie_next += 1;
        c
    }

    pub(crate) fn hist_move(&mut self, from: usize, to: usize) {
        if let Some(h) = self.hist.get_mut(from) {
            *h = h.saturating_sub(1);
        }
        if let Some(h) = self.hist.get_mut(to) {
            *h += 1;
        }
    }

    /// Records node `idx` (entry `cookie`) for filing in its tenant's wheel.
    /// Amortised O(1) and O(live entries) even if expiry never runs: when
    /// the list reaches `compact_at`, it is compacted (stale references
    /// dropped, O(n), then duplicates, O(n log n), if still needed) only if
    /// it holds at least `floor` = twice the stripe's entries + 1024
    /// references; below that it is left alone (already O(entries)) and
    /// checked again at most 64 pushes later, so plain churn never pays the
    /// sort. After a compaction the next one is at least the list's length
    /// away, so compactions are amortised O(log n) per push, and a check
    /// (reads the stripe's histogram, O(max_chain)) happens at most every 64
    /// pushes. The list stays below `max(2 x compacted length, floor + 64)`
    /// <= `2 x floor` (compacted lengths stay below `floor` unless stale
    /// references to recycled indices pass the 6-bit cookie check, 1 in 64).
    pub(crate) fn push_new(&mut self, idx: u32, cookie: u64, slab: &Slab) {
        self.new_nodes.push(filing_ref(idx, cookie));
        if self.new_nodes.len() >= self.compact_at {
            let floor = 2 * self.entries() + 1024;
            let len = self.new_nodes.len();
            self.compact_at = if len >= floor {
                self.new_nodes
                    .retain(|&r| ref_current(r, slab.node(ref_idx(r))));
                // Only repeated `set_state`s (or indices recycled into other
                // stripes) leave duplicates; plain churn leaves dead nodes,
                // which the retain alone drops, without the sort.
                if self.new_nodes.len() >= floor {
                    self.new_nodes.sort_unstable();
                    self.new_nodes.dedup();
                }
                (self.new_nodes.len() * 2).max(floor)
            } else {
                floor.max(len + 64)
            };
        }
    }

    /// Entries in this stripe's buckets (from the histogram).
    fn entries(&self) -> usize {
        self.hist
            .iter()
            .enumerate()
            .map(|(n, &c)| n * c as usize)
            .sum()
    }

    pub(crate) fn take_new(&mut self) -> Vec<u32> {
        self.compact_at = 1024;
        std::mem::take(&mut self.new_nodes)
    }

    fn memory_bytes(&self) -> usize {
        4 * self.new_nodes.capacity() + 8 * self.hist.len()
    }
}

impl Table {
    /// Bytes a table of `buckets` buckets needs (for the memory budget).
    pub(crate) fn bytes_for(buckets: usize, max_chain: usize, stripes: usize) -> usize {
        let stripes = stripes.min(buckets);
        buckets * std::mem::size_of::<AtomicU32>()
            + stripes * (std::mem::size_of::<CachePadded<Stripe>>() + 8 * (max_chain + 1))
    }

    /// A table; `None` if the bucket array cannot be allocated.
    pub(crate) fn try_new(
        order: u64,
        buckets: usize,
        max_chain: usize,
        stripes: usize,
        keys: (u64, u64),
    ) -> Option<Table> {
        assert!(buckets.is_power_of_two() && stripes.is_power_of_two());
        let stripes = stripes.min(buckets);
        let heads = HugeArray::<AtomicU32>::zeroed(buckets)?;
        for h in heads.iter() {
            h.store(crate::chain::EMPTY, Relaxed);
        }
        let per_stripe = (buckets / stripes) as u64;
        let stripes = (0..stripes)
            .map(|_| {
                let mut hist = vec![0u64; max_chain + 1].into_boxed_slice();
                hist[0] = per_stripe;
                CachePadded::new(Stripe {
                    lock: Mutex::new(StripeState {
                        new_nodes: Vec::new(),
                        compact_at: 1024,
                        cookie_next: 0,
                        cookie_end: 0,
                        hist,
                    }),
                    new_hint: AtomicUsize::new(0),
                })
            })
            .collect::<Box<[_]>>();
        Some(Table {
            order,
            heads,
            mask: (buckets - 1) as u64,
            stripe_mask: stripes.len() - 1,
            stripes,
            hash: crate::hash::KeyedHash::new(keys.0, keys.1),
            max_chain,
        })
    }

    pub(crate) fn buckets(&self) -> usize {
        self.heads.len()
    }

    /// Keyed hash (see `hash.rs`) of the full key, salted with the tenant's
    /// salt (which stands for the tenant: distinct salts per tenant).
    #[inline]
    pub(crate) fn locate(&self, k: &PackedKey, salt: u64) -> Loc {
        let h = self.hash.hash5([
            salt ^ (u64::from(k.ports) << 32 | u64::from(k.bits)),
            k.caddr[0],
            k.caddr[1],
            k.vaddr[0],
            k.vaddr[1],
        ]);
        let bucket = (h & self.mask) as usize;
        Loc {
            bucket,
            stripe: bucket & self.stripe_mask,
            tag: ((h >> 32) as u32) % BLOOM_BITS,
        }
    }

    #[inline]
    pub(crate) fn head(&self, b: usize) -> &AtomicU32 {
        &self.heads[b]
    }

    pub(crate) fn stripes(&self) -> usize {
        self.stripes.len()
    }

    #[inline]
    pub(crate) fn lock(&self, s: usize) -> MutexGuard<'_, StripeState> {
        self.stripes[s].lock.lock()
    }

    pub(crate) fn set_new_hint(&self, s: usize, st: &StripeState) {
        self.stripes[s].new_hint.store(st.new_nodes.len(), Relaxed);
    }

    pub(crate) fn has_new(&self, s: usize) -> bool {
        self.stripes[s].new_hint.load(Relaxed) != 0
    }

    /// Nodes waiting to be filed in wheels, summed over stripes.
    pub(crate) fn pending_filing_refs(&self) -> usize {
        self.stripes
            .iter()
            .map(|s| s.lock.lock().new_nodes.len())
            .sum()
    }

    /// O(stripes x max_chain): locks each stripe briefly.
    pub(crate) fn chain_stats(&self) -> ChainStats {
        let mut hist = vec![0u64; self.max_chain + 1];
        for s in self.stripes.iter() {
            let st = s.lock.lock();
            for (a, b) in hist.iter_mut().zip(st.hist.iter()) {
                *a += b;
            }
        }
        let entries = hist.iter().enumerate().map(|(n, c)| n as u64 * c).sum();
        let max_chain = hist.iter().rposition(|&c| c != 0).unwrap_or(0);
        hist.truncate(max_chain + 1);
        ChainStats {
            hist,
            entries,
            max_chain,
        }
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        let mut b =
            self.heads.bytes() + self.stripes.len() * std::mem::size_of::<CachePadded<Stripe>>();
        for s in self.stripes.iter() {
            b += s.lock.lock().memory_bytes();
        }
        b
    }
}
