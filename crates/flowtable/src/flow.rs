//! [`FlowTable`]: tenants, the public operations, expiry and dumps.

use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};

use crossbeam_epoch::{self as epoch, Guard};
use crossbeam_utils::CachePadded;
use parking_lot::Mutex;

use crate::chain::{self, Scan};
use crate::cursor::Cursor;
use crate::node::{Arena, Node, PackedKey, Slab, UNFILED};
use crate::raw::EpochCell;
use crate::table::{
    DEFAULT_STRIPES, FreePool, NODE_CACHES, NodeCache, StripeState, Table, ref_current, ref_idx,
    thread_slot,
};
use crate::types::*;
use crate::wheel::Wheel;

/// Multiplicative hasher for tenant ids (ids come from the admin, not from
/// the network, so an unkeyed hash is fine here).
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u32(&mut self, v: u32) {
        self.0 = u64::from(v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type IdMap<V> = hashbrown::HashMap<u32, V, BuildHasherDefault<IdHasher>>;

/// Dumps prefetch the first node of the bucket this far ahead.
const PREFETCH_AHEAD: usize = 12;

/// One tenant.
#[derive(Debug)]
struct Tenant {
    id: TenantId,
    table: Arc<Table>,
    placement: Placement,
    salt: u64,
    timeouts: [AtomicU64; 10],
    removed: AtomicBool,
    /// Entry count, one shard per stripe of the tenant's table, written only
    /// under that stripe's lock: a plain load + store instead of a locked
    /// read-modify-write (a full barrier on x86), and two writers share a
    /// line only if their stripes are neighbours (8 per line).
    entries: Box<[AtomicI64]>,
    refused: AtomicU64,
    wheel: Mutex<Wheel>,
    own_bytes: usize,
}

impl Tenant {
    #[inline]
    fn timeout(&self, st: FlowState) -> u64 {
        self.timeouts[st.code() as usize].load(Relaxed)
    }

    /// `_held` proves that the caller holds stripe `stripe`'s lock of this
    /// tenant's table, which serialises every writer of that shard.
    fn add_entries(&self, _held: &mut StripeState, stripe: usize, d: i64) {
        let c = &self.entries[stripe];
        c.store(c.load(Relaxed) + d, Relaxed);
    }

    fn entries(&self) -> u64 {
        let n: i64 = self.entries.iter().map(|c| c.load(Relaxed)).sum();
        n.max(0) as u64
    }
}

/// The tenant directory, replaced copy-on-write.
#[derive(Clone, Debug, Default)]
struct TenantMap {
    map: IdMap<Arc<Tenant>>,
    /// Tenants with their own table, by id (dump order).
    own: Vec<Arc<Tenant>>,
}

/// State of the maintenance side (expiry and tenant administration).
#[derive(Debug, Default)]
struct Maint {
    /// Tenant id the next expiry pass starts at (round robin under budget).
    next_tenant: u32,
    own_bytes: usize,
    tables_made: u64,
}

/// Outcome of removing a specific node.
enum Unlink {
    Removed(FlowSnapshot),
    /// Still live but failed the check (e.g. touched since): refile it.
    Kept,
    Gone,
}

/// See [`FlowTable::reader`].
#[derive(Debug)]
pub struct Reader<'a> {
    table: &'a FlowTable,
    guard: Guard,
}

impl Reader<'_> {
    /// Like [`FlowTable::get`].
    #[inline]
    pub fn get(&self, key: &FlowKey) -> Option<FlowSnapshot> {
        self.table
            .lookup_in(&self.guard, key, |t, n| n.snapshot(|s| t.timeout(s)))
    }

    /// Like [`FlowTable::touch`].
    #[inline]
    pub fn touch(
        &self,
        key: &FlowKey,
        now: Millis,
        dir: Dir,
        bytes: u64,
    ) -> Option<(Cookie, BackendId)> {
        self.table.lookup_in(&self.guard, key, |_, n| {
            n.touch(now, dir == Dir::Out, bytes)
        })
    }
}

/// The connection table. `Send + Sync`; share it with `Arc`.
///
/// See the crate documentation for the design, costs and guarantees.
#[derive(Debug)]
pub struct FlowTable {
    slab: Slab,
    pool: Arc<FreePool>,
    /// Per-thread-slot node caches (taken inside a stripe lock, never the
    /// other way round; the pool lock is taken inside them).
    caches: Box<[CachePadded<Mutex<NodeCache>>]>,
    cookies: CachePadded<AtomicU64>,
    shared: Arc<Table>,
    tenants: EpochCell<TenantMap>,
    maint: Mutex<Maint>,
    max_chain: usize,
    memory_budget: usize,
    seed: u64,
    stripes: usize,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Runs deferred frees (this thread's and others' already queued) once no
/// reader can hold them. Each pin-and-flush advances the global epoch at
/// most one step and a bag is freed two steps after it was sealed, hence a
/// few rounds. Bounded: a reader pinned for long only leaves the free to a
/// later collection.
fn reclaim_now() {
    for _ in 0..4 {
        epoch::pin().flush();
    }
}

fn random_seed() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(0x5eed_u64)
}

impl FlowTable {
    /// A table with no tenants.
    ///
    /// # Panics
    /// If the shared bucket array cannot be allocated (like `Box::new`).
    pub fn new(cfg: TableConfig) -> Self {
        Self::with_stripes(cfg, DEFAULT_STRIPES)
    }

    /// Like [`new`](Self::new) with an explicit number of lock stripes per
    /// table (a power of two; for the lock-granularity benchmark).
    #[doc(hidden)]
    pub fn with_stripes(cfg: TableConfig, stripes: usize) -> Self {
        let seed = cfg.seed.unwrap_or_else(random_seed);
        let buckets = cfg.shared_buckets.clamp(1, 1 << 26).next_power_of_two();
        let max_chain = cfg.max_chain.clamp(1, 1024);
        let stripes = stripes.clamp(1, 1 << 20).next_power_of_two();
        let pool = Arc::new(FreePool::default());
        let keys = (splitmix(seed), splitmix(seed ^ 0xA5A5_A5A5));
        let shared = Table::try_new(0, buckets, max_chain, stripes, keys)
            .expect("allocating the shared bucket array");
        FlowTable {
            slab: Slab::new(),
            pool,
            caches: (0..NODE_CACHES).map(|_| CachePadded::default()).collect(),
            cookies: CachePadded::new(AtomicU64::new(1)),
            shared: Arc::new(shared),
            tenants: EpochCell::new(TenantMap::default()),
            maint: Mutex::new(Maint::default()),
            max_chain,
            memory_budget: cfg.memory_budget,
            seed,
            stripes,
        }
    }

    /// Creates a tenant. With `own_buckets == 0` it shares the global table;
    /// otherwise it gets its own table of that many buckets unless that would
    /// exceed the memory budget or the allocation fails, in which case it
    /// shares and the returned [`Placement::Shared`] says why.
    pub fn add_tenant(&self, id: TenantId, cfg: TenantConfig) -> Result<Placement, TenantError> {
        let b = cfg.own_buckets;
        if b != 0 && (!b.is_power_of_two() || b > MAX_OWN_BUCKETS) {
            return Err(TenantError::BadSize(b));
        }
        let mut m = self.maint.lock();
        let guard = epoch::pin();
        let cur = self.tenants.load(&guard);
        if cur.map.contains_key(&id.0) {
            return Err(TenantError::Exists(id));
        }
        let mut own_bytes = 0;
        let (table, placement) = if b == 0 {
            (
                Arc::clone(&self.shared),
                Placement::Shared {
                    requested: 0,
                    reason: FallbackReason::Requested,
                },
            )
        } else {
            let needed = Table::bytes_for(b, self.max_chain, self.stripes);
            let available = self.memory_budget.saturating_sub(m.own_bytes);
            if needed > available {
                (
                    Arc::clone(&self.shared),
                    Placement::Shared {
                        requested: b,
                        reason: FallbackReason::OverBudget { needed, available },
                    },
                )
            } else {
                m.tables_made += 1;
                let k = splitmix(self.seed ^ splitmix(u64::from(id.0) << 20 ^ m.tables_made));
                let keys = (k, splitmix(k));
                match Table::try_new(u64::from(id.0) + 1, b, self.max_chain, self.stripes, keys) {
                    Some(t) => {
                        own_bytes = needed;
                        (Arc::new(t), Placement::Own { buckets: b })
                    }
                    None => (
                        Arc::clone(&self.shared),
                        Placement::Shared {
                            requested: b,
                            reason: FallbackReason::AllocFailed { needed },
                        },
                    ),
                }
            }
        };
        m.own_bytes += own_bytes;
        let shards = table.stripes();
        let tenant = Arc::new(Tenant {
            id,
            table,
            placement,
            salt: splitmix(self.seed ^ 0x7E4A_u64 ^ u64::from(id.0)),
            timeouts: cfg.timeouts.to_array().map(AtomicU64::new),
            removed: AtomicBool::new(false),
            entries: (0..shards).map(|_| AtomicI64::new(0)).collect(),
            refused: AtomicU64::new(0),
            wheel: Mutex::new(Wheel::new()),
            own_bytes,
        });
        let mut next = cur.clone();
        next.map.insert(id.0, Arc::clone(&tenant));
        if own_bytes != 0 {
            let at = next.own.partition_point(|t| t.id < id);
            next.own.insert(at, tenant);
        }
        self.tenants.replace(next, &guard);
        Ok(placement)
    }

    /// Removes a tenant and all its entries (appended to `out`). Cost
    /// O(its entries + lock stripes + wheel slots + entries inserted by
    /// anyone since the last [`expire`](Self::expire)) — never a walk of the
    /// shared table. Concurrent inserts for the tenant fail with `NoTenant`.
    pub fn remove_tenant(
        &self,
        id: TenantId,
        out: &mut Vec<FlowSnapshot>,
    ) -> Result<(), TenantError> {
        let mut m = self.maint.lock();
        let guard = epoch::pin();
        let cur = self.tenants.load(&guard);
        let t = Arc::clone(cur.map.get(&id.0).ok_or(TenantError::NoTenant(id))?);
        let mut next = cur.clone();
        next.map.remove(&id.0);
        next.own.retain(|o| o.id != id);
        self.tenants.replace(next, &guard);
        t.removed.store(true, Relaxed);
        // Barrier: after locking every stripe once, no insert for this
        // tenant is in flight and later ones see `removed`. Collect its
        // not-yet-filed nodes on the way.
        let mut refs = Vec::new();
        for s in 0..t.table.stripes() {
            let mut st = t.table.lock(s);
            st.new_nodes.retain(|&r| {
                let i = ref_idx(r);
                let mine = self.slab.node(i).tenant() == id.0;
                if mine {
                    refs.push(i);
                }
                !mine
            });
            t.table.set_new_hint(s, &st);
        }
        refs.extend(t.wheel.lock().drain_all());
        for idx in refs {
            if let Unlink::Removed(s) = self.unlink_node(&t, idx, &guard, |_| true) {
                out.push(s);
            }
        }
        m.own_bytes -= t.own_bytes;
        drop(m);
        drop(guard);
        // The old directory holds the last reference to the tenant (and its
        // own table, megabytes to gigabytes): free it now rather than when
        // this thread's bag of deferred frees happens to fill up (dozens of
        // removed tables stayed allocated that way).
        drop(t);
        reclaim_now();
        Ok(())
    }

    /// Replaces a tenant's timeouts. Longer timeouts apply at once; a
    /// shorter one applies to an already-filed entry when its current wheel
    /// slot comes due (at most the old timeout later) or at its next
    /// `set_state`.
    pub fn set_timeouts(&self, id: TenantId, t: Timeouts) -> Result<(), TenantError> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let ten = map.map.get(&id.0).ok_or(TenantError::NoTenant(id))?;
        for (a, v) in ten.timeouts.iter().zip(t.to_array()) {
            a.store(v, Relaxed);
        }
        Ok(())
    }

    /// A tenant's timeouts.
    pub fn timeouts(&self, id: TenantId) -> Option<Timeouts> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let ten = map.map.get(&id.0)?;
        Some(Timeouts::from_array(
            ten.timeouts.each_ref().map(|a| a.load(Relaxed)),
        ))
    }

    /// Inserts a new entry (takes one stripe lock). Refused if the key
    /// exists, the tenant does not, or the chain already holds `max_chain`
    /// entries.
    pub fn insert(&self, key: FlowKey, init: FlowInit, now: Millis) -> Result<Cookie, InsertError> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let t = map.map.get(&key.tenant.0).ok_or(InsertError::NoTenant)?;
        let pk = PackedKey::new(&key);
        let table = &*t.table;
        let loc = table.locate(&pk, t.salt);
        let (head, s) = (table.head(loc.bucket), loc.stripe);
        let mut st = table.lock(s);
        if t.removed.load(Relaxed) {
            return Err(InsertError::NoTenant);
        }
        let len = match chain::scan(&self.slab, head, &pk, loc.tag) {
            Scan::Found(i) => return Err(InsertError::Exists(Cookie(self.slab.node(i).cookie()))),
            Scan::Absent(len) => len,
        };
        if len >= table.max_chain {
            t.refused.fetch_add(1, Relaxed);
            return Err(InsertError::ChainFull);
        }
        let Some(idx) = self.node_cache().alloc(&self.slab, &self.pool) else {
            t.refused.fetch_add(1, Relaxed);
            return Err(InsertError::ChainFull);
        };
        let cookie = st.next_cookie(&self.cookies);
        self.slab.node(idx).init(&pk, loc.tag, &init, cookie, now);
        chain::append(&self.slab, head, idx, loc.tag);
        st.hist_move(len, len + 1);
        st.push_new(idx, cookie, &self.slab);
        table.set_new_hint(s, &st);
        t.add_entries(&mut st, s, 1);
        drop(st);
        Ok(Cookie(cookie))
    }

    /// This thread's node cache.
    #[inline]
    fn node_cache(&self) -> parking_lot::MutexGuard<'_, NodeCache> {
        self.caches[thread_slot()].lock()
    }

    #[inline]
    fn lookup<R>(&self, key: &FlowKey, f: impl FnOnce(&Tenant, &Node) -> R) -> Option<R> {
        self.lookup_in(&epoch::pin(), key, f)
    }

    #[inline]
    fn lookup_in<R>(
        &self,
        guard: &Guard,
        key: &FlowKey,
        f: impl FnOnce(&Tenant, &Node) -> R,
    ) -> Option<R> {
        let map = self.tenants.load(guard);
        let t = map.map.get(&key.tenant.0)?;
        let pk = PackedKey::new(key);
        let loc = t.table.locate(&pk, t.salt);
        let (_, n) = chain::find(&self.slab, t.table.head(loc.bucket), &pk, loc.tag)?;
        Some(f(t, n))
    }

    /// Lock-free lookup; writes nothing shared.
    pub fn get(&self, key: &FlowKey) -> Option<FlowSnapshot> {
        self.lookup(key, |t, n| n.snapshot(|s| t.timeout(s)))
    }

    /// Lock-free hot path: +1 packet and +`bytes` in direction `dir`,
    /// `last_active = max(last_active, now)`. Writes only the entry's own
    /// counters. A touch racing with the entry's removal may be lost.
    #[inline]
    pub fn touch(
        &self,
        key: &FlowKey,
        now: Millis,
        dir: Dir,
        bytes: u64,
    ) -> Option<(Cookie, BackendId)> {
        self.lookup(key, |_, n| n.touch(now, dir == Dir::Out, bytes))
    }

    /// A read handle that serves many `get`/`touch` calls under one epoch
    /// pin (e.g. one batch of datagrams), saving the pin per call. While it
    /// lives, removed entries' slots are not recycled: keep it for a batch,
    /// not for the life of a worker.
    pub fn reader(&self) -> Reader<'_> {
        Reader {
            table: self,
            guard: epoch::pin(),
        }
    }

    /// Changes the state (and refreshes `last_active`); `false` if absent.
    pub fn set_state(&self, key: &FlowKey, state: FlowState, now: Millis) -> bool {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let Some(t) = map.map.get(&key.tenant.0) else {
            return false;
        };
        let pk = PackedKey::new(key);
        let loc = t.table.locate(&pk, t.salt);
        let s = loc.stripe;
        let mut st = t.table.lock(s);
        let Some((idx, n)) = chain::find(&self.slab, t.table.head(loc.bucket), &pk, loc.tag) else {
            return false;
        };
        n.set_state(state);
        n.bump_last_active(now);
        // Refile so that a shorter timeout for the new state takes effect.
        st.push_new(idx, n.cookie(), &self.slab);
        t.table.set_new_hint(s, &st);
        true
    }

    /// Removes an entry, returning its final snapshot.
    pub fn remove(&self, key: &FlowKey) -> Option<FlowSnapshot> {
        self.remove_where(key, |_| true)
    }

    /// Removes the entry for `key` only if it is still the one `cookie`
    /// names (a newer entry for the same key stays), in one locked step.
    pub fn remove_cookie(&self, key: &FlowKey, cookie: Cookie) -> Option<FlowSnapshot> {
        self.remove_where(key, |n| n.cookie() == cookie.0)
    }

    fn remove_where(&self, key: &FlowKey, check: impl Fn(&Node) -> bool) -> Option<FlowSnapshot> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let t = map.map.get(&key.tenant.0)?;
        let pk = PackedKey::new(key);
        let loc = t.table.locate(&pk, t.salt);
        let (head, s) = (t.table.head(loc.bucket), loc.stripe);
        let mut st = t.table.lock(s);
        let (idx, n) = chain::find(&self.slab, head, &pk, loc.tag)?;
        if !check(n) {
            return None;
        }
        let len = chain::unlink(&self.slab, head, idx)?;
        n.clear_live();
        let snap = n.snapshot(|s| t.timeout(s));
        st.hist_move(len, len - 1);
        t.add_entries(&mut st, s, -1);
        drop(st);
        self.node_cache().retire(idx, &guard, &self.pool);
        Some(snap)
    }

    /// Removes node `idx` if it is a live entry of `t` and `check` holds
    /// under the stripe lock.
    fn unlink_node(
        &self,
        t: &Tenant,
        idx: u32,
        guard: &Guard,
        check: impl Fn(&Node) -> bool,
    ) -> Unlink {
        let n = self.slab.node(idx);
        if !n.is_live() || n.tenant() != t.id.0 {
            return Unlink::Gone;
        }
        // The key may change under us if the node is recycled meanwhile;
        // then it is not on the chain we lock and `unlink` finds nothing.
        let pk = n.key();
        let loc = t.table.locate(&pk, t.salt);
        let (head, s) = (t.table.head(loc.bucket), loc.stripe);
        let mut st = t.table.lock(s);
        if !n.is_live() || n.tenant() != t.id.0 || !n.matches(&pk) {
            return Unlink::Gone;
        }
        if !check(n) {
            return Unlink::Kept;
        }
        let Some(len) = chain::unlink(&self.slab, head, idx) else {
            return Unlink::Gone;
        };
        n.clear_live();
        let snap = n.snapshot(|s| t.timeout(s));
        st.hist_move(len, len - 1);
        t.add_entries(&mut st, s, -1);
        drop(st);
        self.node_cache().retire(idx, guard, &self.pool);
        Unlink::Removed(snap)
    }

    /// Files every not-yet-filed node of `table` in its tenant's wheel.
    fn drain_new(&self, map: &TenantMap, table: &Table, now: u64) {
        for s in 0..table.stripes() {
            if !table.has_new(s) {
                continue;
            }
            let v = {
                let mut st = table.lock(s);
                let v = st.take_new();
                table.set_new_hint(s, &st);
                v
            };
            let mut cur: Option<(&Arc<Tenant>, parking_lot::MutexGuard<'_, Wheel>)> = None;
            for r in v {
                let idx = ref_idx(r);
                let n = self.slab.node(idx);
                if !ref_current(r, n) {
                    continue;
                }
                let tid = n.tenant();
                if cur.as_ref().is_none_or(|(t, _)| t.id.0 != tid) {
                    cur = None;
                    if let Some(t) = map.map.get(&tid) {
                        let mut w = t.wheel.lock();
                        w.start(now);
                        cur = Some((t, w));
                    }
                }
                if let Some((t, w)) = cur.as_mut() {
                    let deadline = n.last_active().saturating_add(t.timeout(n.state()));
                    let slot = w.file(idx, deadline, now);
                    n.set_filed_slot(slot);
                }
            }
        }
    }

    /// Removes up to `max` entries idle past their state's timeout
    /// (`now >= last_active + timeout`), appending them to `out`; returns
    /// how many. Bounded work: files the entries inserted since the last
    /// call, then examines at most `16 * max + 1024` wheel references and
    /// `SLOTS` empty ticks per tenant. Call it periodically (e.g. every
    /// second); an entry is removed at most one wheel tick (1 s) plus the
    /// call period after its deadline if the budget keeps up, never before. Round-robin over tenants when the budget runs
    /// out.
    pub fn expire(&self, now: Millis, max: usize, out: &mut Vec<FlowSnapshot>) -> usize {
        if max == 0 {
            return 0;
        }
        let now = now.0;
        let mut m = self.maint.lock();
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        self.drain_new(map, &self.shared, now);
        for t in &map.own {
            self.drain_new(map, &t.table, now);
        }
        let mut ids: Vec<u32> = map.map.keys().copied().collect();
        ids.sort_unstable();
        let start = ids.partition_point(|&i| i < m.next_tenant);
        let mut budget = max.saturating_mul(16).saturating_add(1024);
        let mut removed = 0;
        for k in 0..ids.len() {
            let id = ids[(start + k) % ids.len()];
            let Some(t) = map.map.get(&id) else { continue };
            let mut w = t.wheel.lock();
            w.start(now);
            while let Some(slot) = w.due_slot(now) {
                while let Some(idx) = w.pop(slot) {
                    if removed == max || budget == 0 {
                        w.push_back(slot, idx);
                        m.next_tenant = id;
                        return removed;
                    }
                    budget -= 1;
                    let n = self.slab.node(idx);
                    if !n.is_live() || n.tenant() != id || n.filed_slot() != slot {
                        continue; // stale reference
                    }
                    let deadline = |n: &Node| n.last_active().saturating_add(t.timeout(n.state()));
                    let mut refile = true;
                    if now >= deadline(n) {
                        match self.unlink_node(t, idx, &guard, |n| {
                            n.filed_slot() == slot && now >= deadline(n)
                        }) {
                            Unlink::Removed(s) => {
                                out.push(s);
                                removed += 1;
                                refile = false;
                            }
                            Unlink::Kept => {}
                            Unlink::Gone => refile = false,
                        }
                    }
                    if refile {
                        let s = w.file(idx, deadline(n), now);
                        n.set_filed_slot(s);
                    }
                }
            }
            // Stale references (removed entries) outnumber live ones:
            // compact some slots with what is left of the budget.
            if w.refs() > 2 * t.entries() as usize + 4096 {
                let slab = &self.slab;
                budget = budget.saturating_sub(w.compact(budget, |slot, i| {
                    let n = slab.node(i);
                    n.is_live() && n.tenant() == id && n.filed_slot() == slot
                }));
            }
        }
        m.next_tenant = 0;
        removed
    }

    /// References (live and stale) in a tenant's expiry wheel.
    #[doc(hidden)]
    pub fn wheel_refs(&self, id: TenantId) -> Option<usize> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        Some(map.map.get(&id.0)?.wheel.lock().refs())
    }

    /// References waiting in the stripes' to-be-filed lists of a tenant's
    /// table (shared by all sharing tenants), live and stale.
    #[doc(hidden)]
    pub fn pending_filing_refs(&self, id: TenantId) -> Option<usize> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        Some(map.map.get(&id.0)?.table.pending_filing_refs())
    }

    /// Tables in dump order, restricted to one tenant's table if asked.
    fn dump_tables<'a>(
        &'a self,
        map: &'a TenantMap,
        tenant: Option<TenantId>,
    ) -> Option<impl Iterator<Item = &'a Table> + 'a> {
        let (single, all) = match tenant {
            Some(id) => (Some(&*map.map.get(&id.0)?.table), false),
            None => (None, true),
        };
        Some(
            single
                .into_iter()
                .chain(all.then_some(&*self.shared))
                .chain(map.own.iter().filter(move |_| all).map(|t| &*t.table)),
        )
    }

    /// Resumable dump: appends up to `limit` entries matching `filter` to
    /// `out` and returns the cursor to continue from, or `None` when done.
    ///
    /// Guarantees (see the crate docs for the argument): total cost
    /// O(entries + buckets) over a whole dump whatever `limit` is (each
    /// resume re-walks one chain, `<= max_chain` nodes); an entry present for
    /// the whole dump is returned exactly once; entries added or removed
    /// meanwhile at most once; it always terminates. Pass the same filter on
    /// every page.
    pub fn dump(
        &self,
        cursor: Option<&Cursor>,
        filter: &DumpFilter,
        limit: usize,
        out: &mut Vec<FlowSnapshot>,
    ) -> Option<Cursor> {
        let start = cursor.copied().unwrap_or(Cursor::START);
        if limit == 0 {
            return Some(start);
        }
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let tables = self.dump_tables(map, filter.tenant)?;
        // Entries created after this point are "added during the dump":
        // skipping them bounds every walk even under endless inserts.
        let below = self.cookies.load(Relaxed);
        let mut emitted = 0;
        let mut cached: Option<&Arc<Tenant>> = None;
        for table in tables {
            if table.order < start.order {
                continue;
            }
            let same = table.order == start.order;
            let b0 = if same { start.bucket } else { 0 };
            let b0 = usize::try_from(b0).unwrap_or(usize::MAX);
            let buckets = table.buckets();
            for b in b0..buckets {
                if b + PREFETCH_AHEAD < buckets {
                    chain::prefetch_first(&self.slab, table.head(b + PREFETCH_AHEAD));
                }
                let after = if same && b == b0 { start.cookie } else { 0 };
                let mut stop = None;
                chain::walk(&self.slab, table.head(b), after, below, |n| {
                    if !n.is_live() {
                        return true;
                    }
                    let tid = n.tenant();
                    if filter.tenant.is_some_and(|t| t.0 != tid)
                        || filter.service.is_some_and(|v| v != n.service())
                        || filter.backend.is_some_and(|v| v != n.backend())
                        || filter.state.is_some_and(|v| v != n.state())
                    {
                        return true;
                    }
                    if cached.is_none_or(|t| t.id.0 != tid) {
                        cached = map.map.get(&tid);
                    }
                    let Some(t) = cached else { return true };
                    out.push(n.snapshot(|s| t.timeout(s)));
                    emitted += 1;
                    if emitted == limit {
                        stop = Some(n.cookie());
                        return false;
                    }
                    true
                });
                if let Some(c) = stop {
                    return Some(Cursor {
                        order: table.order,
                        bucket: b as u64,
                        cookie: c,
                    });
                }
            }
        }
        None
    }

    /// The pre-2021 `/proc/net/tcp` resume algorithm, as a contrast for
    /// benchmarks: resume at (bucket, offset within the bucket) of the shared
    /// table. Cheap, but under concurrent change it skips or repeats entries.
    #[doc(hidden)]
    pub fn dump_naive_offset(
        &self,
        resume: (usize, usize),
        limit: usize,
        out: &mut Vec<FlowSnapshot>,
    ) -> Option<(usize, usize)> {
        if limit == 0 {
            return Some(resume);
        }
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let mut emitted = 0;
        for b in resume.0..self.shared.buckets() {
            let skip = if b == resume.0 { resume.1 } else { 0 };
            let mut pos = 0;
            let mut stop = None;
            chain::walk(&self.slab, self.shared.head(b), 0, u64::MAX, |n| {
                pos += 1;
                if pos <= skip || !n.is_live() {
                    return true;
                }
                if let Some(t) = map.map.get(&n.tenant()) {
                    out.push(n.snapshot(|s| t.timeout(s)));
                    emitted += 1;
                }
                if emitted >= limit {
                    stop = Some(pos);
                    return false;
                }
                true
            });
            if let Some(p) = stop {
                return Some((b, p));
            }
        }
        None
    }

    /// Introspection for one tenant. Cheap: O(lock stripes x max_chain),
    /// never a walk of the entries.
    pub fn tenant_stats(&self, id: TenantId) -> Option<TableStats> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let t = map.map.get(&id.0)?;
        let cs = t.table.chain_stats();
        let buckets = t.table.buckets();
        Some(TableStats {
            entries: t.entries(),
            table_entries: cs.entries,
            buckets,
            load_factor: cs.entries as f64 / buckets as f64,
            chain_histogram: cs.hist,
            max_chain: cs.max_chain,
            refused_inserts: t.refused.load(Relaxed),
            placement: t.placement,
        })
    }

    /// Existing tenants, sorted.
    pub fn tenants(&self) -> Vec<TenantId> {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let mut v: Vec<TenantId> = map.map.keys().map(|&i| TenantId(i)).collect();
        v.sort_unstable();
        v
    }

    /// Approximate bytes held: node arena, bucket arrays, stripes, wheels,
    /// free lists.
    pub fn memory_bytes(&self) -> usize {
        let guard = epoch::pin();
        let map = self.tenants.load(&guard);
        let mut b = self.slab.memory_bytes()
            + self.shared.memory_bytes()
            + 4 * self.pool.free.lock().capacity()
            + self
                .caches
                .iter()
                .map(|c| c.lock().memory_bytes())
                .sum::<usize>();
        for t in map.map.values() {
            b += t.wheel.lock().memory_bytes() + std::mem::size_of::<Tenant>();
        }
        for t in &map.own {
            b += t.table.memory_bytes();
        }
        b
    }

    /// Number of lock stripes per table.
    #[doc(hidden)]
    pub fn lock_stripes(&self) -> usize {
        self.stripes
    }
}

#[allow(dead_code)]
const _UNFILED_FITS: () = assert!(UNFILED as u64 > crate::wheel::SLOTS);
